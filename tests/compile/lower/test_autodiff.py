"""Autodiff of fused groups: every derivative rule against eager autograd, in float64.

Each case traces a small function, runs the compile pipeline (normalize, decompose,
ShapeProp, fuse), swaps every group for its ``AutogradGroup`` and compares the gradients
with eager's for random output gradients, on two calls with fresh inputs. Each case also
checks that a backward Triton kernel ran. Inputs include the points where piecewise ops
switch (0 for relu, +-3 for hardswish, ties for max) so the conventions match eager's.
"""

from __future__ import annotations

# First: it sets TRITON_INTERPRET=1 (on CPU) before anything imports triton.
from test_triton_kernels import DEVICE  # isort: skip


import math

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.lower.autograd import make_autograd_group, swap_in_autograd
from fxlite.codegen.runtime import kernel as triton_codegen
from fxlite.passes.decompose import decompose
from fxlite.passes.fuse import fuse
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
F64 = torch.float64
# The points where piecewise ops switch, then random values.
EDGES = [-6.0, -3.0, -2.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 6.0]


def _wrap(fn, n):
    return {1: lambda a: fn(a), 2: lambda a, b: fn(a, b), 3: lambda a, b, c: fn(a, b, c),
            4: lambda a, b, c, d: fn(a, b, c, d)}[n]


def edgy(*shape, low=None):
    """float64 values with the switch points of piecewise ops among them."""
    x = torch.randn(*shape, dtype=F64, device=DEVICE) * 2
    flat = x.view(-1)
    k = min(len(EDGES), flat.numel())
    flat[:k] = torch.tensor(EDGES[:k], dtype=F64, device=DEVICE)
    if low is not None:
        x = x.abs() + low
    return x


@pytest.fixture
def directions(monkeypatch):
    """The ``direction`` of every Triton kernel launched during the test."""
    return spy_directions(monkeypatch)


def spy_directions(monkeypatch):
    # (a prepared direct launch, CUDA's, skips TritonKernel.__call__: none, so that every
    # launch is seen: on an H200, 122 of the 148 tests here failed without it)
    monkeypatch.setenv("FXLITE_DIRECT_LAUNCH", "0")
    seen: list[str] = []
    call = triton_codegen.TritonKernel.__call__

    def spy(self, *args):
        seen.append(getattr(self, "direction", "forward"))
        return call(self, *args)

    monkeypatch.setattr(triton_codegen.TritonKernel, "__call__", spy)
    return seen


def build(fn, inputs, *, decomposed=True):
    """``fn`` compiled with autograd groups: the fused module (or one group if not
    ``decomposed``: composites such as softmax then use their own derivative rules)."""
    gm = fxlite.symbolic_trace(_wrap(fn, len(inputs)))
    ShapeProp(gm).propagate(*inputs)
    gm = normalize(gm)
    if not decomposed:
        ShapeProp(gm).propagate(*inputs)
        return make_autograd_group(gm, name="group")
    gm = decompose(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ShapeProp(gm).propagate(*inputs)
    fused = fuse(gm)
    swap_in_autograd(fused)
    return fused


def grads(fn, inputs, tangent_seed=1):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(tangent_seed)
    tangents = [torch.randn(o.shape, dtype=o.dtype, generator=gen).to(o.device) for o in outs]
    wrt = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    got = torch.autograd.grad(outs, wrt, tangents, allow_unused=True)
    return outs, got


def check_grads(fn, make_inputs, directions, *, decomposed=True, atol=1e-9, eager_ok=(),
                out_rtol=1e-9):
    """Compiled and eager gradients agree, on two calls with fresh inputs; no part runs
    eagerly but the groups named in ``eager_ok`` (ops the kernel generator lacks)."""
    compiled = build(fn, make_inputs(), decomposed=decomposed)
    for _ in range(2):
        inputs = make_inputs()
        exp_out, expected = grads(fn, inputs)
        directions.clear()
        got_out, got = grads(compiled, inputs)
        for g, e in zip(got_out, exp_out):
            torch.testing.assert_close(g, e, rtol=out_rtol, atol=atol, equal_nan=True)
        for g, e in zip(got, expected):
            if e is None:
                assert g is None or not g.any()
            else:
                assert g is not None
                torch.testing.assert_close(g, e, rtol=1e-7, atol=atol, equal_nan=True)
        assert "backward" in directions, "no backward kernel ran"
    assert not [f for f in fallbacks(compiled) if not any(ok in f for ok in eager_ok)]
    return compiled


def fallbacks(compiled):
    """What runs eagerly in ``compiled`` (a fused module or one AutogradGroup)."""
    groups = [compiled] if hasattr(compiled, "fallbacks") else [
        n.target for n in compiled.graph.nodes if hasattr(n.target, "fallbacks")]
    return [f for g in groups for f in g.fallbacks]


def req(x):
    return x.requires_grad_()


# ------------------------------------------------------------------------ pointwise
UNARY = {
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1,
    "sin": torch.sin, "cos": torch.cos, "erf": torch.erf, "square": torch.square,
    # piecewise constant: zero gradient, so each is paired with a product
    "floor": lambda x: torch.floor(x) * x, "ceil": lambda x: torch.ceil(x) * x,
    "trunc": lambda x: torch.trunc(x) * x, "round": lambda x: torch.round(x) * x,
    "sign": lambda x: torch.sign(x) * x,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "softplus": lambda x: F.softplus(x, beta=2.0, threshold=3.0), "mish": F.mish,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2), "elu": lambda x: F.elu(x, alpha=0.5),
    "hardtanh": lambda x: F.hardtanh(x, -2.0, 3.0), "relu6": F.relu6,
    "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish,
    "clamp": lambda x: torch.clamp(x, -2.0, 3.0), "clamp_min": lambda x: torch.clamp_min(x, 0.5),
    "clamp_max": lambda x: torch.clamp_max(x, 1.0),
    "to": lambda x: x.to(torch.float32).to(F64) * x,
    "clone": lambda x: torch.clone(x) * x,
    "pow_scalar": lambda x: torch.pow(x, 3), "pow_base": lambda x: torch.pow(2.0, x),
    "pow_zero_base": lambda x: torch.pow(0.0, x), "rsub": lambda x: 2 - x,
    "where": lambda x: torch.where(x > 0, x * 2, 1.0),
}
POSITIVE = {
    "log": torch.log, "log2": torch.log2, "log1p": torch.log1p, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "pow_frac": lambda x: x ** 1.5,
}
BINARY = {
    "add": lambda x, y: torch.add(x, y, alpha=2), "sub": lambda x, y: torch.sub(x, y, alpha=3),
    "mul": torch.mul, "truediv": torch.div, "remainder": torch.remainder, "fmod": torch.fmod,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "where2": lambda x, y: torch.where(x > y, x, y),
    "clamp_tensor": lambda x, y: torch.clamp(x, y - 1, y + 1),
    "clamp_min_tensor": lambda x, y: torch.clamp_min(x, y),
    "div_floor": lambda x, y: torch.div(x, y, rounding_mode="floor") * y,
    "pow_tensor": lambda x, y: torch.pow(x.abs() + 0.5, y),
}


@pytest.mark.parametrize("name", UNARY)
def test_unary(name, directions):
    # eager's CUDA hardsigmoid and hardswish scale by a float32 1/6 (1.0f / 6.0f) even in
    # float64, 3e-8 off; the kernels divide by 6 in float64 (the CPU's eager does too)
    loose = DEVICE == "cuda" and name in ("hardsigmoid", "hardswish")
    check_grads(UNARY[name], lambda: [req(edgy(3, 4))], directions,
                out_rtol=1e-7 if loose else 1e-9)


ACTIVATIONS_AT_NAN = ("relu", "hardtanh", "relu6", "hardsigmoid", "hardswish", "leaky_relu",
                      "clamp", "elu")


@pytest.mark.parametrize("name", ACTIVATIONS_AT_NAN)
def test_activation_gradients_at_nan_inputs_are_eagers(name, directions):
    # Regression (fuzzer, seed 740140: log1p of x < -1, then relu_): eager's relu, hardtanh
    # and relu6 backward zero the gradient where x is at or past a bound, so at a NaN
    # input it passes on; the rules tested x > 0 (or low < x < high) and gave 0 there.
    # elu's takes its negative branch where x <= 0 (the fuzz replay of session 15).
    made = []

    def nan_edgy():  # for the build and the first call benign; the second call's has NaN
        made.append(None)
        x = edgy(3, 4)
        if len(made) >= 3:
            x.view(-1)[-3:] = torch.tensor([float("nan"), 6.0, -1.0], dtype=F64)
        return [req(x)]

    loose = DEVICE == "cuda" and name in ("hardsigmoid", "hardswish")  # see test_unary
    check_grads(UNARY[name], nan_edgy, directions, out_rtol=1e-7 if loose else 1e-9)


@pytest.mark.parametrize("name", POSITIVE)
def test_positive(name, directions):
    check_grads(POSITIVE[name], lambda: [req(edgy(3, 4, low=0.2))], directions)


@pytest.mark.parametrize("name", BINARY)
def test_binary(name, directions):
    def make():
        x, y = edgy(3, 4), edgy(3, 4).flip(-1)
        y[0, :2] = x[0, :2]  # ties
        return [req(x), req(y)]
    check_grads(BINARY[name], make, directions)


def test_broadcast_and_dtype(directions):
    # a row bias, a column scale, a float32 operand: grads summed back and cast back
    def fn(x, b, s, h):
        return torch.tanh(x * s + b) * h
    check_grads(fn, lambda: [req(edgy(3, 4)), req(torch.randn(4, dtype=F64, device=DEVICE)),
                             req(torch.randn(3, 1, dtype=F64, device=DEVICE)),
                             req(torch.randn(3, 4, dtype=torch.float32, device=DEVICE))], directions)


def test_zero_gradient_is_zeros_not_none(directions):
    # eager gives x.grad = zeros (not None) through a piecewise-constant op
    fn = build(lambda x: torch.floor(x) * 2, [req(edgy(3, 4))])
    x = req(edgy(3, 4))
    fn(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()


# ------------------------------------------------------------------------ reductions
REDUCTIONS = {
    "sum": lambda x: torch.sum(x, -1, keepdim=True) * x,
    "sum_all": lambda x: torch.sum(x * x),
    "sum_dim0": lambda x: torch.sum(torch.exp(x), 0),
    "mean": lambda x: torch.mean(x, -1) ,
    "mean_keep": lambda x: x - torch.mean(x, -1, keepdim=True),
    "prod": lambda x: torch.prod(x, -1, keepdim=True),
    "amax": lambda x: torch.amax(x, -1, keepdim=True),
    "amax_nokeep": lambda x: torch.amax(x * 2, -1) + 1,
    "amin": lambda x: torch.amin(x, -1),
    "max_all": lambda x: torch.max(x) * x,
    "min_all": lambda x: torch.min(x),
    "var": lambda x: torch.var(x, -1),
    "var_pop": lambda x: torch.var(x, -1, unbiased=False, keepdim=True),
    "std": lambda x: torch.std(x, -1, correction=2),
}


def _ties(*shape):
    x = edgy(*shape)
    x[:, 1] = x[:, 0] = x.max(-1).values + 1  # two maxima per row
    x[0, 2] = 0.0  # and a zero, for prod
    return x


@pytest.mark.parametrize("decomposed", [True, False], ids=["decomposed", "composite"])
@pytest.mark.parametrize("name", REDUCTIONS)
def test_reductions(name, decomposed, directions):
    # the kernel generator has no all-element max/min: that forward runs eagerly
    check_grads(REDUCTIONS[name], lambda: [req(_ties(3, 5))], directions, decomposed=decomposed,
                eager_ok=("(max_1", "(min_1"))


@pytest.mark.parametrize("fn", [lambda x: torch.prod(x, -1), lambda x: torch.prod(x),
                                lambda x: torch.prod(x, 0, keepdim=True)],
                         ids=["row", "all", "column"])
def test_prod_gradient_at_zeros_infinities_and_nans_is_eagers(fn):
    # Eager's rule switches on whether the whole input holds a zero, and then multiplies
    # each element's exclusive products from both ends: NaN where the others hold a NaN
    # or both an inf and a 0, an inf of their sign where they hold an inf (the rule gave
    # NaN for inf / inf: fuzz seeds 6065, 8707468), and zeros for two zeros or more in the
    # whole product, whatever the incoming gradient (NaN there: 8512012).
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan]
    gen = torch.Generator().manual_seed(0)
    compiled = fxlite.compile(lambda x: torch.sigmoid(fn(x)).sum())
    for _ in range(40):
        x = torch.randn(3, 4, generator=gen, dtype=F64) * 2
        pick = torch.rand(3, 4, generator=gen) < 0.4
        x[pick] = torch.tensor(specials, dtype=F64)[
            torch.randint(0, len(specials), (int(pick.sum()),), generator=gen)]
        want, got = x.clone().requires_grad_(), x.to(DEVICE).requires_grad_()
        torch.sigmoid(fn(want)).sum().backward()
        compiled(got).backward()
        torch.testing.assert_close(got.grad.cpu(), want.grad, equal_nan=True)
    assert compiled.kernels


@pytest.mark.parametrize("fn", [lambda x: torch.std(F.elu(x, 0.5), -2, correction=0),
                                lambda x: torch.std(x, 0, keepdim=True),
                                lambda x: torch.var(x * 3, 1)], ids=["elu_std", "std", "var"])
def test_std_of_a_constant_row_is_zero_with_eagers_zero_gradient(fn):
    # A constant row's mean, a sum divided by n, can miss its value by an ulp: the centred
    # values were then that ulp, the std a tiny positive number, and its gradient (eager:
    # 0) near 1 / sqrt(n) (fuzz seed 8732652). The sum of squares is now corrected by the
    # centred values' own sum; other rows still give eager's values and gradients.
    compiled = fxlite.compile(fn)
    gen = torch.Generator().manual_seed(0)
    for k in range(8):
        row = torch.randn(1, 3, generator=gen) * 3
        x = (row.expand(3, 3) if k % 2 == 0 else row.t().expand(3, 3)).contiguous() \
            if k < 6 else torch.randn(3, 3, generator=gen)
        want, got = x.clone().requires_grad_(), x.to(DEVICE).requires_grad_()
        out_want, out_got = fn(want), compiled(got)
        out_want.sum().backward()
        out_got.sum().backward()
        torch.testing.assert_close(out_got.cpu(), out_want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got.grad.cpu(), want.grad, atol=1e-5, rtol=1e-5)
    assert compiled.kernels


def test_prod_with_zeros(directions):
    def make():
        x = edgy(4, 3)
        x[1, 0] = 0.0
        x[2, :2] = 0.0  # two zeros in a row: all gradients 0
        return [req(x)]
    check_grads(lambda x: torch.prod(x, -1), make, directions, decomposed=False)


# ------------------------------------------------------------------------ composites
def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


COMPOSITES = {
    "softmax": (lambda x: torch.softmax(x, -1), 1),
    "log_softmax": (lambda x: F.log_softmax(x, dim=-1), 1),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (5,), w, b), 3),
    "layer_norm_plain": (lambda x: F.layer_norm(x, (5,)), 1),
    "rms_norm": (lambda x, w: F.rms_norm(x, (5,), w, eps=1e-6), 2),
    "rms_norm_default_eps": (lambda x: F.rms_norm(x, (5,)), 1),
    "layer_norm_2d": (lambda x: F.layer_norm(x, (2, 5)), 1),
    "addcmul": (lambda x, w: torch.addcmul(w, x, w, value=0.5), 2),
    "addcdiv": (lambda x, w: torch.addcdiv(x, w, x.abs() + 1, value=-2), 2),
    "vector_norm": (lambda x: torch.linalg.vector_norm(x, dim=-1, keepdim=True) * x, 1),
    "norm_all": (lambda x: x.norm() + x, 1),
    "norm_zero_row": (lambda x: torch.norm(x * (x.abs() > 1e9), dim=-1), 1),
}


@pytest.mark.parametrize("name", COMPOSITES)
@pytest.mark.parametrize("decomposed", [True, False], ids=["decomposed", "composite"])
def test_composites(name, decomposed, directions):
    fn, n = COMPOSITES[name]
    shape = (3, 2, 5) if name.endswith("2d") else (3, 5)

    def make():
        params = [req(torch.randn(*shape[-1:], dtype=F64, device=DEVICE)) for _ in range(n - 1)]
        return [req(edgy(*shape)), *params]
    check_grads(fn, make, directions, decomposed=decomposed)


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5), (2, 4, 4)],
                         ids=["rank1", "rank2", "rank3", "square"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_linear_gradients_are_eagers(shape, bias, directions):
    # a linear inside one autograd node (a region through it, autograd_regions): the
    # weight's gradient is one matmul of g and x flattened to rows, the bias's a sum of g.
    # "square": the (4, 4) weight broadcasts to the (2, 4, 4) result by chance, and its
    # gradient came out twice eager's (taken for a value spread over the leading dim)
    def fn(x, w, *b):
        return torch.tanh(F.linear(torch.sin(x), w, *b))

    k = shape[-1]
    def make():
        return [req(edgy(*shape)), req(torch.randn(4, k, dtype=F64, device=DEVICE)),
                *([req(torch.randn(4, dtype=F64, device=DEVICE))] if bias else [])]
    check_grads(fn, make, directions, decomposed=False)


@pytest.mark.parametrize("scales", [{}, {"beta": 0.5, "alpha": -2.0}], ids=["plain", "scaled"])
def test_addmm_and_reshape_gradients_are_eagers(scales, directions):
    # transformers' Conv1D: addmm(b, h.view(-1, k), w).view(...): the real reshapes'
    # gradients are g reshaped to the input's sizes, read from the forward
    def fn(x, w, b):
        return torch.tanh(torch.addmm(b, torch.sin(x).view(-1, 5), w, **scales).view(2, 3, 4))

    def make():
        return [req(edgy(2, 3, 5)), req(torch.randn(5, 4, dtype=F64, device=DEVICE)),
                req(torch.randn(4, dtype=F64, device=DEVICE))]
    check_grads(fn, make, directions, decomposed=False)


@pytest.mark.parametrize("op", ["linear", "addmm"])
def test_a_linears_gradient_from_a_sum_is_eagers(op, directions):
    # the sum's cotangent reaches the linear broadcast, as (1, 1): its weight's gradient
    # is a matmul, which does not broadcast (fxlite's test_compile_state_drift found it)
    def fn(x, w, b):
        y = F.linear(x, w, b) if op == "linear" else torch.addmm(b, x, w.t())
        return torch.tanh(y.sum())

    def make():
        return [req(edgy(3, 5)), req(torch.randn(4, 5, dtype=F64, device=DEVICE)),
                req(torch.randn(4, dtype=F64, device=DEVICE))]
    check_grads(fn, make, directions, decomposed=False)


# ------------------------------------------------------------------------ a block
class MLPBlock(torch.nn.Module):
    def __init__(self, d=8, h=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, h)
        self.gate = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x):
        y = self.norm(x)
        y = F.gelu(self.up(y)) * F.silu(self.gate(y))
        return x + self.down(y)


def _compile_module(model, x):
    gm = fxlite.symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    gm = decompose(normalize(gm))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ShapeProp(gm).propagate(x)
    fused = fuse(gm)
    return fused, swap_in_autograd(fused)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
def test_mlp_block_parameter_grads(dtype, directions):
    torch.manual_seed(0)
    model = MLPBlock().to(DEVICE, dtype)
    fused, groups = _compile_module(model, torch.randn(2, 3, 8, dtype=dtype, device=DEVICE))
    tol = 1e-9 if dtype == F64 else 1e-5
    for step in range(2):
        x = torch.randn(2, 3, 8, dtype=dtype, device=DEVICE, requires_grad=True)
        model.zero_grad()
        expected_out = model(x)
        expected_out.pow(2).sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        expected_x = x.grad.clone()
        x.grad = None
        model.zero_grad()
        directions.clear()
        out = fused(x)
        torch.testing.assert_close(out, expected_out, rtol=tol, atol=tol)
        out.pow(2).sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[n], rtol=tol, atol=tol, msg=n)
        torch.testing.assert_close(x.grad, expected_x, rtol=tol, atol=tol)
        assert directions.count("backward") >= len(groups) >= 3
    kernels = [k for g in groups.values() for k in g.kernels]
    assert {k.direction for k in kernels} == {"forward", "backward"}
    assert not [f for g in groups.values() for f in g.fallbacks]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_mlp_block_half_precision(dtype):
    # kernels compute in fp32 and round once: within the dtype's precision of eager
    torch.manual_seed(0)
    model = MLPBlock().to(DEVICE, dtype)
    fused, groups = _compile_module(model, torch.randn(2, 3, 8, dtype=dtype, device=DEVICE))
    x = torch.randn(2, 3, 8, dtype=dtype, device=DEVICE, requires_grad=True)
    fused(x).float().pow(2).sum().backward()
    got = {n: p.grad.float() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).float().pow(2).sum().backward()
    for n, p in model.named_parameters():
        err = (got[n] - p.grad.float()).abs().max() / p.grad.float().abs().max()
        assert err < (2e-2 if dtype == torch.bfloat16 else 3e-3), n
    assert not [f for g in groups.values() for f in g.fallbacks]


# ------------------------------------------------------------------------ the callable
def test_backward_of_norms_runs_row_kernels():
    x = req(edgy(4, 6))
    w, b = req(torch.randn(6, dtype=F64, device=DEVICE)), req(torch.randn(6, dtype=F64, device=DEVICE))
    for fn in (lambda x, w, b: F.layer_norm(x, (6,), w, b), lambda x, w, b: torch.softmax(x * w + b, -1)):
        group = build(fn, [x, w, b], decomposed=False)
        fn_out = group(x, w, b)
        fn_out.backward(torch.randn_like(fn_out))
        kinds = {(k.direction, k.kind) for k in group.kernels}
        assert ("backward", "reduction") in kinds and ("forward", "reduction") in kinds


def test_resize_broadcast_change_and_requires_grad_change(directions):
    fn = lambda x, b: torch.sigmoid(x + b) * x  # noqa: E731
    compiled = build(fn, [req(edgy(3, 4)), req(torch.randn(4, dtype=F64, device=DEVICE))])
    cases = [  # other sizes, b broadcast along another dim, and only b needing a gradient
        (req(edgy(5, 7)), req(torch.randn(7, dtype=F64, device=DEVICE))),
        (req(edgy(5, 7)), req(torch.randn(5, 1, dtype=F64, device=DEVICE))),
        (edgy(5, 7), req(torch.randn(7, dtype=F64, device=DEVICE))),
    ]
    for x, b in cases:
        _, expected = grads(fn, [x, b])
        _, got = grads(compiled, [x, b])
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)
    assert not fallbacks(compiled)


def test_expanded_and_strided_output_gradients():
    # .sum().backward() gives the group an expanded gradient; .t() a transposed one
    fn = lambda x: torch.tanh(x) * 3  # noqa: E731
    compiled = build(fn, [req(edgy(4, 5))])
    x = req(edgy(4, 5))
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, 3 * (1 - torch.tanh(x.detach()) ** 2))
    x.grad = None
    g = torch.randn(5, 4, dtype=F64, device=DEVICE)
    compiled(x).t().backward(g)
    torch.testing.assert_close(x.grad, 3 * (1 - torch.tanh(x.detach()) ** 2) * g.t())


def test_double_backward_is_refused_and_saved_outputs_are_guarded():
    compiled = build(lambda x: torch.exp(x) * 2, [req(edgy(3, 4))])
    x = req(edgy(3, 4))
    y = compiled(x)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)  # an error, not a wrong answer
    # what the backward saved (here x, from which it recomputes exp) is guarded by
    # autograd's version counters: changing it in place is an error, not a wrong gradient
    h = x * 1
    y = compiled(h)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_saved_value_only_an_unused_output_needs_may_be_written_in_place():
    """Before: a group with several outputs saved the values every output's backward
    needs, and autograd checked them all, so writing one that only an output the loss does
    not use needs made the backward raise where eager's does not (fuzz seed 7200785).
    Such a group checks the versions of the values its backward reads itself: those, and
    only those, still raise, with eager's message."""
    def fn(x):
        v = torch.var(x, dim=-1, correction=0)      # exp2(e)'s backward needs e
        e = torch.expm1(v)
        return e, torch.exp2(e), F.hardsigmoid(v)

    compiled = build(fn, [req(edgy(4, 5))])
    for k in range(3):
        x, ref = req(edgy(4, 5)), req(edgy(4, 5))
        with torch.no_grad():
            ref.copy_(x)
        got, want = compiled(x), fn(ref)
        got[0].mul_(2)   # written after the forward: only exp2's backward reads it
        want[0].mul_(2)
        (got[2] * (k + 1)).sum().backward()
        (want[2] * (k + 1)).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad)
    x = req(edgy(4, 5))
    e, two, _ = compiled(x)
    e.mul_(2)   # now the loss reads exp2's result, whose backward reads e: eager raises
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        two.sum().backward()
    _, two, hard = compiled(x)
    (two.sum() + hard.sum()).backward(retain_graph=False)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        two.sum().backward()
    import weakref

    x, ref = req(edgy(4, 5)), req(edgy(4, 5))  # under the user's own saved-tensor hooks
    with torch.no_grad():
        ref.copy_(x)
    with torch.autograd.graph.save_on_cpu():
        got, want = compiled(x), fn(ref)
    sum(o.sum() for o in got).backward()
    sum(o.sum() for o in want).backward()
    torch.testing.assert_close(x.grad, ref.grad)
    x, ref = req(edgy(4, 5)), req(edgy(4, 5))  # where no hook may be pushed at all
    with torch.no_grad():
        ref.copy_(x)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        got, want = compiled(x), fn(ref)
    sum(o.sum() for o in got).backward()
    sum(o.sum() for o in want).backward()
    torch.testing.assert_close(x.grad, ref.grad)
    outs = compiled(req(edgy(4, 5)))  # what the group saved holds no cycle: freed at once
    refs = [weakref.ref(o) for o in outs] + [weakref.ref(outs[1].grad_fn)]
    del outs
    assert all(r() is None for r in refs)


def test_no_grad_and_inference_calls_run_the_forward_kernel(directions):
    compiled = build(lambda x: torch.relu(x) * 2, [edgy(3, 4)])
    with torch.no_grad():
        out = compiled(req(edgy(3, 4)))
    assert not out.requires_grad and directions == ["forward"]


def test_an_op_without_a_rule_runs_under_eager_autograd():
    # floor_divide has no derivative in eager either: same result, same error
    fn = lambda x, y: torch.floor_divide(x, y) * x  # noqa: E731
    compiled = build(fn, [req(edgy(3, 4)), edgy(3, 4).abs() + 1], decomposed=False)
    x, y = req(edgy(3, 4)), edgy(3, 4).abs() + 1
    out = compiled(x, y)
    torch.testing.assert_close(out, fn(x, y))
    assert any("no derivative rule for" in f and "floor_divide" in f for f in compiled.fallbacks)
    with pytest.raises(RuntimeError, match="floor_divide"):
        out.sum().backward()


def test_without_tangents_drops_the_terms_of_unused_outputs():
    # y = exp(x) and z = x * w: with z's tangent unused, x's gradient is g_y * exp(x)
    # alone, and w's gradient (reached only through z) is zero: None, computing nothing
    from fxlite.codegen.lower.autodiff import differentiate, without_tangents

    gm = normalize(fxlite.symbolic_trace(lambda x, w: (torch.exp(x), x * w)))
    x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    grad = differentiate(gm, [x, w])
    pruned = without_tangents(grad.backward, len(grad.tangents), [1])
    tangent = [n for n in pruned.graph.nodes if n.op == "placeholder"][-1]
    adds = [n for n in pruned.graph.nodes if n.op == "call_function" and n.target is torch.add]
    assert not adds and not tangent.users  # x's sum is gone, and w's term
    assert grad.saved == [("input", 0), ("input", 1)]
    g_y = torch.randn(3)
    with torch.no_grad():
        got = pruned(x, w, g_y, torch.zeros(3))
        torch.testing.assert_close(got[grad.grads[0]], g_y * torch.exp(x))
        assert got[grad.grads[1]] is None


def test_a_gradient_only_an_unused_output_reaches_is_zero_not_nan():
    # t = trunc(x) and m = x * t, the loss reading t alone: x's gradient is trunc's, 0.
    # The group's backward computed m's term with its zero tangent, 0 * t, NaN where x is
    # infinite; and read t, which a write in place since made the backward raise where
    # eager's does not (fuzz seed 8542728).
    def f(x):
        t = x.trunc()
        return t, x * t

    compiled = fxlite.compile(f)
    for values in ([0.5, 2.0], [float("inf"), 1.5], [3.0, float("-inf")], [1.0, 2.0]):
        grads = []
        for fn in (f, compiled):
            x = torch.tensor(values, device=DEVICE, requires_grad=True)
            t, _ = fn(x)
            t[0] = 5.0  # written in place: the backward of x * t, never run, saved t
            t.std().backward()
            grads.append(x.grad)
        torch.testing.assert_close(grads[1], grads[0])
    assert compiled.kernels and compiled.fallbacks == []


def test_a_detached_copy_of_a_value_is_the_value_once_the_rules_have_run():
    # x - m.detach() and x - m differ only for autodiff: the forward computes one of them
    from fxlite.codegen.lower.autodiff import differentiate

    def f(x):
        m = x.sum(1, keepdim=True) / 5
        a = x - m.detach()
        return (a * a).sum(1, keepdim=True) + (x - m)

    gm = normalize(fxlite.symbolic_trace(f))
    x = torch.randn(3, 5, requires_grad=True)
    grad = differentiate(gm, [x])
    subs = [n for n in grad.forward.graph.nodes if n.op == "call_function" and n.target is torch.sub]
    assert len(subs) == 1
    assert not [n for n in grad.forward.graph.nodes if "detach" in str(n.target)]
    g = torch.randn(3, 5)
    with torch.no_grad():
        got = grad.forward(x)
        back = grad.backward(*[x if kind == "input" else got[i] for kind, i in grad.saved], g)
    torch.testing.assert_close(got[0], f(x))
    f(x).backward(g)
    torch.testing.assert_close(back[grad.grads[0]], x.grad)


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("op", ["log_softmax", "center", "softmax"])
def test_a_row_statistic_read_by_a_reduction_over_the_same_dim(op, reduce, dim):
    # log_softmax(x, -1).mean(-1) (a label-smoothed loss) and (x - x.mean(d)).mean(d): the
    # mean's cotangent reaches the row's log(sum) or mean through values it spreads over
    # the row by broadcasting, so its gradient is n times the cotangent; it was given once,
    # and x's gradient was wrong from the first call that ran the backward kernels (found
    # by the fuzzer, seed 855668).
    def f(x):
        y = {"log_softmax": lambda: torch.log_softmax(x, dim),
             "center": lambda: x - x.mean(dim, keepdim=True),
             "softmax": lambda: torch.softmax(x, dim)}[op]()
        return y.mean(dim) if reduce == "mean" else y.sum(dim, keepdim=True)

    compiled = fxlite.compile(f)
    for _ in range(3):
        x = torch.randn(3, 4, 5, dtype=F64, device=DEVICE)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        w = torch.randn_like(f(x))
        (compiled(a) * w).sum().backward()
        (f(b) * w).sum().backward()
        torch.testing.assert_close(a.grad, b.grad)


def test_the_input_of_an_amax_is_saved_not_recomputed():
    # Fuzz seed 7719980: amax's backward compares its input with the saved result. The
    # input, exp(x0) + ..., was recomputed in the backward kernel, one ulp from the
    # forward's under the interpreter: no element matched, and the gradient was all zero.
    def program(x0, x1, x2):
        v1 = torch.where(x1 > 0, x1, x1 * 0.1)
        return torch.addcdiv(x0.exp(), v1, x2.abs() + 1).amax()

    x0 = torch.tensor([3.772425413131714, -2.585873603820801, -2.219567060470581,
                       -3.653651475906372, -1.5468378067016602, 2.1460864543914795,
                       -2.117786407470703, -2.119009494781494, -1.6093757152557373,
                       -1.9544545412063599, 0.6065439581871033, -2.390040397644043,
                       -2.347503900527954, -1.8946726322174072, -0.18926140666007996])
    x1 = torch.tensor([-3.22316837310791, 0.38539406657218933, 1.3615480661392212])
    x2 = torch.tensor([0.45055606961250305, 3.30391788482666, -1.607835054397583,
                       -0.7136278748512268, -1.1769523620605469])
    inputs = [x0.reshape(3, 5).to(DEVICE), x1.reshape(3, 1).to(DEVICE), x2.to(DEVICE)]
    compiled = fxlite.compile(program)
    for _ in range(3):
        a = [x.clone().requires_grad_() for x in inputs]
        b = [x.clone().requires_grad_() for x in inputs]
        program(*a).backward()
        compiled(*b).backward()
        for want, got in zip(a, b):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", [torch.softmax, torch.log_softmax])
def test_softmax_gradient_of_infinite_cotangents_is_eagers(op) -> None:
    """A cotangent of +-inf in a row: eager's backward gives inf (or NaN where the inf
    meets itself) there; the decomposition's row max was differentiated too, its gradient
    (0 in exact arithmetic) an ``inf * 0`` = NaN at every other element of the row (fuzz
    seed 10170212). Its max is now cut from autograd. Three calls, fresh values."""
    fn = fxlite.compile(lambda x: op(x, -1))
    for _ in range(3):
        x = torch.randn(3, 5, device=DEVICE)
        g = torch.randn(3, 5, device=DEVICE)
        g[0, 1], g[2, 3] = float("-inf"), float("inf")
        got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
        fn(got).backward(g)
        op(want, -1).backward(g)
        torch.testing.assert_close(got.grad, want.grad, equal_nan=True)


def test_variants_are_told_apart_by_rank_size_one_dims_and_requires_grad(directions):
    # the variant key stands for a rank by its length where no dim is size 1: a rank-3
    # call must not reuse the rank-2 variant; a call needing no gradient (under grad mode)
    # runs the inference kernel, and a later one that needs them still gets them
    fn = lambda x, b: torch.sigmoid(x + b) * x  # noqa: E731
    group = build(fn, [req(edgy(3, 4)), req(torch.randn(4, dtype=F64, device=DEVICE))],
                  decomposed=False)
    calls = [(req(edgy(3, 4)), req(torch.randn(4, dtype=F64, device=DEVICE))),
             (req(edgy(2, 3, 4)), req(torch.randn(4, dtype=F64, device=DEVICE))),
             (req(edgy(2, 1, 4)), req(torch.randn(4, dtype=F64, device=DEVICE))),
             (req(edgy(5, 6)), req(torch.randn(6, dtype=F64, device=DEVICE)))]
    for x, b in calls:
        _, expected = grads(fn, [x, b])
        _, got = grads(group, [x, b])
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)
    assert len(group._variants) == 3  # (5, 6) reuses (3, 4)'s
    x, b = edgy(3, 4), torch.randn(4, dtype=F64, device=DEVICE)
    directions.clear()
    out = group(x, b)
    assert not out.requires_grad and directions == ["forward"]
    torch.testing.assert_close(out, fn(x, b), rtol=1e-9, atol=1e-9)
    assert len(group._variants) == 4 and "backward" in [k.direction for k in group.kernels]
    x = req(edgy(3, 4))
    _, (gx,) = grads(group, [x, b])  # only x needs a gradient: a variant of its own
    torch.testing.assert_close(gx, grads(fn, [x, b])[1][0], rtol=1e-9, atol=1e-9)
    assert not fallbacks(group)


def test_a_group_follows_its_arguments_layouts_from_call_to_call(directions):
    """A group keeps the last call's layout in a C++ guard and reuses that call's variant
    when the next call passes it. Each call below changes what the variant depends on
    (which inputs need a gradient, which dims are broadcast) or only sizes, and must get
    eager's values and gradients; sizes that change on every call stop the guards being
    made after a few (``_CHECKS``), and the calls go on right."""
    from fxlite.codegen.lower import autograd

    def fn(x, w):
        return torch.tanh(x * w + 1).sum(-1)

    def inputs(rows, cols, w_cols=None, w_grad=True):
        x = torch.randn(rows, cols, dtype=torch.float64, device=DEVICE, requires_grad=True)
        w = torch.randn(1 if w_cols is None else w_cols, dtype=torch.float64, device=DEVICE,
                        requires_grad=w_grad)
        return [x, w]

    group = build(fn, inputs(4, 5, 5), decomposed=False)
    layouts = [(4, 5, 5, True), (4, 5, 5, True), (4, 5, 5, False), (4, 5, 5, False),
               (4, 5, None, True), (4, 5, 5, True), *((r, 5, 5, True) for r in range(2, 9))]
    for rows, cols, w_cols, w_grad in layouts:
        xs = inputs(rows, cols, w_cols, w_grad)
        (want,), want_grads = grads(fn, xs)
        (got,), got_grads = grads(group, xs)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert len(got_grads) == len(want_grads) == 1 + w_grad
        for g, e in zip(got_grads, want_grads):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    assert group._checks_left == 0 and group._last is None  # sizes kept changing
    assert "backward" in directions and not group.fallbacks
    assert len(group._variants) == 3 and autograd._CHECKS == 4
