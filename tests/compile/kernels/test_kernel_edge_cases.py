"""Kernels right by construction: half-precision reductions, ``x ** 0``, integer division
by zero, and how fp16 intermediates are rounded (issue 9, "silently wrong results").

Every test calls the same generated kernels twice or more: benign inputs first (they
generate the kernels), then the trap. Nothing compares a kernel with eager in between, so
the first-call check of ``fxlite.compile`` is never what makes these pass.
"""

from __future__ import annotations

import re
import warnings

from test_triton_kernels import DEVICE, group, same  # isort: skip  (sets TRITON_INTERPRET)

import pytest
import torch
import torch.nn.functional as F
from _pipeline import Kernels, lower
from fxlite.codegen.kernels.generate import why_unsupported
from fxlite.codegen.runtime.kernel import generate_kernel
from fxlite.passes.decompose import decompose
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
HALF = (torch.float16, torch.bfloat16)


def _rows(dtype, *rows):
    return torch.tensor(rows, dtype=torch.float32, device=DEVICE).to(dtype)


def _traps(dtype):
    """Rows that break a reduction computed in ``dtype`` instead of fp32."""
    if dtype == torch.float16:
        big = [300.0, -300.0, 20.0, 1.0, 0.5, -2.0, 7.0, 3.0]  # 300**2 > 65504
        tiny = [1e-3] * 8          # rms_norm: fp16's eps (1e-3) would swamp mean(x*x)
        huge = [60000.0 - 1000.0 * i for i in range(8)]  # the sum overflows fp16
        return _rows(dtype, big, tiny, huge, [-v for v in huge])
    # bf16 has fp32's range but 8 bits: a mean near 1000 rounds by up to 4, which wrecks
    # the centred values (992..1016 differ by 8) of a variance computed in bf16.
    near = [992.0, 1000.0, 1008.0, 1016.0, 992.0, 1000.0, 1008.0, 1016.0]
    return _rows(dtype, near, [1e-3] * 8, [-1016.0, -992.0] * 4, [3e38, 1.0] * 4)


def _weight(dtype):
    return (torch.linspace(0.5, 1.5, 8, device=DEVICE)).to(dtype)


REDUCTIONS = {
    "layer_norm": lambda x, w: F.layer_norm(x, (8,), w, w * 0.5 - 0.25),
    "layer_norm_plain": lambda x, w: F.layer_norm(x, (8,)) + w * 0,
    "rms_norm": lambda x, w: F.rms_norm(x, (8,), w),
    "rms_norm_eps": lambda x, w: F.rms_norm(x, (8,), w, eps=1e-6),
    "mean": lambda x, w: x.mean(-1) + w.sum() * 0,
    "var": lambda x, w: torch.var(x, -1, keepdim=True) * w,
    "std": lambda x, w: torch.std(x, -1, keepdim=True, correction=0) + w,
    "softmax": lambda x, w: F.softmax(x * w, -1),
    "log_softmax": lambda x, w: F.log_softmax(x, -1) * w,
}


def _finite_rows(name, dtype, x):
    """The trap rows whose eager result is finite (rows of 3e38 overflow var/std in eager)."""
    if name in ("var", "std", "layer_norm", "layer_norm_plain") and dtype == torch.bfloat16:
        return x[:3]
    return x


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_half_decompositions_compute_in_fp32(name, dtype):
    """The decomposed graph alone (the eager fallback of a group) equals eager on traps."""
    fn = REDUCTIONS[name]
    benign = torch.randn(4, 8, device=DEVICE).to(dtype)
    w = _weight(dtype)
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(benign, w)
    decompose(normalize(gm))
    assert not any(n.op == "call_function" and getattr(n.target, "__name__", "") in (
        "layer_norm", "rms_norm", "softmax", "log_softmax", "mean", "var", "std")
        for n in gm.graph.nodes), gm.code
    casts = [n for n in gm.graph.nodes if n.op == "call_function" and n.args
             and n.args[-1:] == (torch.float32,)] + [n for n in gm.graph.nodes
                                                     if n.kwargs.get("dtype") == torch.float32]
    assert casts, f"no fp32 upcast in\n{gm.code}"
    same(gm(benign, w), fn(benign, w))
    x = _finite_rows(name, dtype, _traps(dtype))
    same(gm(x, w), fn(x, w))


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_half_reduction_kernels_after_a_benign_call(name, dtype):
    fn = REDUCTIONS[name]
    benign = torch.randn(4, 8, device=DEVICE).to(dtype)
    w = _weight(dtype)
    run = Kernels(lower(fn, benign, w))
    same(run(benign, w), fn(benign, w))
    assert run.kernels and not run.refused, run.refused
    x = _finite_rows(name, dtype, _traps(dtype))
    same(run(x, w), fn(x, w))
    assert sum(k.compilations for k in run.kernels.values()) == len(run.kernels)  # reused


def test_half_mean_and_rms_norm_overflow_traps_are_finite():
    """The issue's reproducers, stated directly: no inf where eager has none."""
    ones = torch.ones(2, 8, dtype=torch.float16, device=DEVICE)
    run_mean = Kernels(lower(lambda x: x.mean(-1), ones))
    run_mean(ones)
    big = _rows(torch.float16, [60000.0] * 8, [-60000.0] * 8)
    assert torch.isfinite(run_mean(big)).all()
    same(run_mean(big), big.mean(-1))
    w = torch.ones(8, dtype=torch.float16, device=DEVICE)
    run_ln = Kernels(lower(lambda x, w: F.layer_norm(x, (8,), w), ones, w))
    run_ln(torch.randn(2, 8, device=DEVICE).half(), w)
    row300 = _rows(torch.float16, [300.0] + [1.0] * 7, [-300.0] + [1.0] * 7)
    same(run_ln(row300, w), F.layer_norm(row300, (8,), w))


# ---------------------------------------------------------------------- x ** 0
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16, torch.int32),
                         ids=str)
@pytest.mark.parametrize("spelling", ["pow_op", "torch_pow", "float_exponent"])
def test_pow_zero_is_one_for_nan_and_inf(dtype, spelling):
    fn = {"pow_op": lambda x: x ** 0, "torch_pow": lambda x: torch.pow(x, 0) + 0,
          "float_exponent": lambda x: x ** 0.0 * 2}[spelling]
    if not dtype.is_floating_point and spelling == "float_exponent":
        pytest.skip("an int tensor ** 0.0 is a float result; covered by the float dtypes")
    benign = torch.arange(1, 7, device=DEVICE).to(dtype).reshape(2, 3)
    kernel = generate_kernel(group(fn, benign), [benign])
    assert kernel is not None
    same(kernel(benign), fn(benign))
    if dtype.is_floating_point:
        trap = torch.tensor([[float("nan"), float("inf"), -float("inf")], [0.0, -0.0, 5.0]],
                            device=DEVICE).to(dtype)
    else:
        trap = torch.tensor([[0, -1, 2**31 - 1], [-(2**31), 3, 0]], device=DEVICE).to(dtype)
    same(kernel(trap), fn(trap))


# ---------------------------------------------------------------------- integer division
INT_DIV = {
    "floordiv": lambda a, b: a // b + 1,
    "remainder": lambda a, b: a % b + 1,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc") + 1,
    "fmod": lambda a, b: torch.fmod(a, b) + 1,
}


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64, torch.uint8), ids=str)
@pytest.mark.parametrize("name", sorted(INT_DIV))
def test_integer_division_by_a_tensor_runs_in_eager(name, dtype):
    """CPU eager raises ZeroDivisionError and CUDA eager gives a hardware-defined value for
    an integer divisor of 0; no kernel can promise either, so the group runs eagerly and
    gives exactly eager's answer (here on the CPU: the error)."""
    fn = INT_DIV[name]
    a = torch.tensor([[7, 9, 12]], device=DEVICE).to(dtype)
    b = torch.tensor([[2, 4, 5]], device=DEVICE).to(dtype)
    run = Kernels(lower(fn, a, b))
    same(run(a, b), fn(a, b))
    assert run.refused and all("may be 0" in why for why in run.refused.values())
    zero = torch.tensor([[2, 0, 5]], device=DEVICE).to(dtype)
    if DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            fn(a, zero)
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            run(a, zero)
    else:
        same(run(a, zero), fn(a, zero))


def test_integer_division_by_a_scalar_argument_or_zero_literal_runs_in_eager():
    a = torch.tensor([5, -7, 9], device=DEVICE)
    gm = group(lambda x, n: x // n, a, 2)
    assert generate_kernel(gm, [a, 2]) is None
    assert "may be 0" in why_unsupported(gm, [a, 2])
    by_zero = fxlite.symbolic_trace(lambda x: x % 0)
    ShapeProp(by_zero).propagate(a.to("meta"))  # eager raises on the CPU: shapes from meta
    assert generate_kernel(by_zero, [a]) is None


def test_integer_division_by_a_nonzero_literal_fuses():
    fn = lambda a: (a // 3) * 2 + a % -4  # noqa: E731
    a = torch.tensor([5, -7, 9, 0, -12], device=DEVICE, dtype=torch.int32)
    run = Kernels(lower(fn, a))
    same(run(a), fn(a))
    assert not run.refused
    edge = torch.tensor([2**31 - 1, -(2**31) + 1, -1, 1, 3], device=DEVICE, dtype=torch.int32)
    same(run(edge), fn(edge))


def test_float_division_by_zero_stays_in_the_kernel():
    fn = lambda a, b: torch.floor_divide(a, b) + torch.remainder(a, b)  # noqa: E731
    a = torch.tensor([1.0, -2.0, 0.0, 3.5], device=DEVICE)
    b = torch.tensor([2.0, 3.0, 1.0, -1.0], device=DEVICE)
    kernel = generate_kernel(group(fn, a, b), [a, b])
    assert kernel is not None
    same(kernel(a, b), fn(a, b))
    zero = torch.zeros(4, device=DEVICE)
    same(kernel(a, zero), fn(a, zero))  # inf, -inf and nan, as eager


# ---------------------------------------------------------------------- fp16 intermediates
def test_half_intermediates_stay_fp32_between_fused_ops():
    """The documented choice (codegen/runtime/kernel.py): inside a kernel, f16/bf16 values are held
    in fp32 and rounded once where they are stored, not after every op as eager rounds.

    So a fused chain gives the fp32 result rounded once: equal to eager wherever eager's
    per-op rounding loses nothing, and the more precise value where it does (cancellation,
    or an intermediate beyond fp16's range)."""
    fn = lambda x: (x + 0.0004) - 1.0  # noqa: E731
    x = torch.ones(4, dtype=torch.float16, device=DEVICE)
    kernel = generate_kernel(group(fn, x), [x])
    assert kernel is not None
    benign = torch.tensor([2.0, 3.0, 4.0, 8.0], dtype=torch.float16, device=DEVICE)
    same(kernel(benign), fn(benign))
    got = kernel(x)
    assert (fn(x) == 0).all()                            # eager: 1 + 0.0004 rounds to 1
    assert torch.equal(got, fn(x.float()).half())        # fxlite: fp32, rounded once
    assert (got != 0).all()

    over = lambda x: (x * 1000.0) / 1000.0  # noqa: E731
    kernel = generate_kernel(group(over, x), [x])
    big = torch.tensor([100.0, -100.0, 1.0, 60.0], dtype=torch.float16, device=DEVICE)
    assert torch.isinf(over(big)[:2]).all()              # eager: 1e5 overflows fp16
    assert torch.equal(kernel(big), big)                  # fxlite: no overflow in fp32


def test_half_values_are_rounded_where_the_difference_would_show():
    """Before a discrete op (compare, floor, cast) or a promotion to fp32, a computed half
    value is rounded to its dtype first, as eager has it at that point."""
    x = torch.tensor([0.1, 0.2, 0.3, 0.7], dtype=torch.float16, device=DEVICE)
    for fn in (lambda a: torch.floor(a * 10.0), lambda a: (a * 3.0) == (a * 3.0).half(),
               lambda a: (a * 3.0).float() * 1.0001, lambda a: (a * 10.0).to(torch.int32)):
        kernel = generate_kernel(group(fn, x), [x])
        assert kernel is not None
        same(kernel(x * 2), fn(x * 2))
        assert torch.equal(kernel(x), fn(x))


# ---------------------------------------------------------------------- index math
def test_division_magic_divides_exactly():
    """Index splitting divides by runtime sizes through magic numbers (triton_source):
    exact for every index a 32-bit kernel can hold."""
    import random

    from fxlite.codegen.kernels.source import division_magic

    rng = random.Random(0)
    divisors = list(range(1, 3000)) + [rng.randrange(1, 2**31) for _ in range(3000)] + [
        2**k + e for k in range(1, 31) for e in (-1, 0, 1)]
    for d in divisors:
        m, s = division_magic(d)
        assert -(2**31) <= m < 2**31 and 0 <= s <= 31
        mu = m % 2**32  # the unsigned bits the kernel multiplies with
        for n in [0, 1, d - 1, d, 2**31 - 1, 2**31 - 2] + [rng.randrange(2**31) for _ in range(8)]:
            if 0 <= n < 2**31:
                assert ((((n * mu) >> 32) + n) % 2**32) >> s == n // d, (n, d)


def test_odd_sizes_split_the_index_right():
    fn = lambda a, b, c: a * b + c  # noqa: E731
    a = torch.randn(3, 5, 7, 11, device=DEVICE)
    b = torch.randn(5, 1, 11, device=DEVICE)
    c = torch.randn(7, 1, device=DEVICE)
    kernel = generate_kernel(group(fn, a, b, c), [a, b, c])
    assert "_fdiv(" in kernel.source
    for shape in ((3, 5, 7, 11), (2, 13, 9, 3), (1, 17, 4, 255)):
        a = torch.randn(*shape, device=DEVICE)
        b = torch.randn(shape[1], 1, shape[3], device=DEVICE)
        c = torch.randn(shape[2], 1, device=DEVICE)
        same(kernel(a, b, c), fn(a, b, c))
        same(kernel(a[:, :, :, ::2], b[:, :, ::2], c), fn(a[:, :, :, ::2], b[:, :, ::2], c))


# ---------------------------------------------------------------------- copies
@pytest.mark.parametrize("layout", ["sliced", "transposed", "channels_last", "empty"])
def test_clone_is_a_copy_kernel_with_eagers_layout_that_aliases_nothing(layout):
    """A ``clone`` fuses as a copy (the padded LM head's columns, ``passes/pad_matmul``):
    a new tensor with eager's strides, on every call with fresh inputs."""
    def make():
        base = torch.randn(2, 3, 4, 6, device=DEVICE)
        return {"sliced": base[..., :5], "transposed": base.transpose(1, 3),
                "channels_last": base.contiguous(memory_format=torch.channels_last),
                "empty": base[:0]}[layout]
    fn = lambda a: a.clone()  # noqa: E731
    compiled = fxlite.compile(fn)
    for _ in range(3):
        a = make()
        before = a.tolist()
        got, want = compiled(a), fn(a)
        same(got, want)
        assert got.stride() == want.stride() or not want.numel()
        assert got.numel() == 0 or got.data_ptr() != a.data_ptr()
        got.add_(1)  # the copy is the caller's own
        assert a.tolist() == before
    assert "clone" in compiled.report() or layout == "empty"
    assert not compiled.fallbacks


def test_clone_to_another_memory_format_runs_in_eager_without_a_warning():
    x = torch.randn(2, 3, 4, 5, device=DEVICE).contiguous(memory_format=torch.channels_last)
    fn = lambda a: a.clone(memory_format=torch.contiguous_format) * 2  # noqa: E731
    compiled = fxlite.compile(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fuse leaves the clone out: nothing to fall back
        for _ in range(2):
            got = compiled(x)
    same(got, fn(x))
    assert got.stride() == fn(x).stride()
    assert compiled.kernels and not compiled.fallbacks  # the `* 2` still runs as a kernel


# ---------------------------------------------------------------------- views of size-1 dims
def _norm_then_flatten(x, w):
    # GPT-2's blocks: a layer norm, then .view(-1, width): at batch 1 that only drops the
    # size-1 batch dim, so the view joins the norm's group
    return F.layer_norm(x, (8,), w, w * 0.5).view(-1, 8) * 2


def test_a_view_dropping_a_batch_of_one_joins_the_kernel_and_other_batches_stay_right():
    """A regression: at batch 1 such groups ran in eager with "a view that changes the
    shape" (GPT-2 at batch 1 got no kernels at all)."""
    w = torch.linspace(0.5, 1.5, 8, device=DEVICE)
    compiled = fxlite.compile(_norm_then_flatten)
    for batch in (1, 1, 3, 1):  # fresh inputs; other batches after the first
        x = torch.randn(batch, 5, 8, device=DEVICE)
        same(compiled(x, w), _norm_then_flatten(x, w))
    assert compiled.kernels and not compiled.fallbacks


def test_a_view_that_moves_values_to_other_dims_stays_out_of_the_kernel():
    # (6,) -> (6, 1) puts the values on another iteration dim: not a size-1 view
    fn = lambda x, y: (x + 1).view(6, 1) * y  # noqa: E731
    x, y = torch.randn(6, device=DEVICE), torch.randn(6, 4, device=DEVICE)
    compiled = fxlite.compile(fn)
    for _ in range(2):
        same(compiled(x, y), fn(x, y))


def test_a_fused_norms_size_check_still_raises_for_other_sizes():
    # its element count now reads the residual's operands (passes/fuse/size_sources.py)
    fn = lambda a, b: F.layer_norm(a * 2 + b, (8,))  # noqa: E731
    compiled = fxlite.compile(fn)
    for rows in (3, 3, 5):
        a, b = torch.randn(rows, 8, device=DEVICE), torch.randn(8, device=DEVICE)
        same(compiled(a, b), fn(a, b))
    assert compiled.kernels
    a, b = torch.randn(3, 6, device=DEVICE), torch.randn(6, device=DEVICE)
    with pytest.raises(RuntimeError, match="normalized_shape"):
        fn(a, b)
    with pytest.raises(RuntimeError, match="normalized_shape"):
        compiled(a, b)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_an_output_of_a_lower_rank_input_keeps_its_rank_in_a_reordered_kernel(layout):
    """A pointwise group over a transposed rank-3 input and a rank-4 one runs in the
    inputs' memory order on full-rank views; the output made from the rank-3 input alone
    came back as 1x3x2x2, the check refused the kernel, and the group ran in eager (GPU
    fuzz seed 1007807)."""
    def f(x1, x0):
        v0 = F.relu6(x1)
        return v0, torch.minimum(v0, x0)

    compiled = fxlite.compile(f)
    for _ in range(3):
        x1 = torch.randn(3, 2, 2, device=DEVICE) * 4
        x1 = x1.transpose(1, 2) if layout == "transposed" else x1
        x0 = torch.randn(2, 3, 2, 2, device=DEVICE) * 4
        got, want = compiled(x1, x0), f(x1, x0)
        for g, w in zip(got, want):
            same(g, w)
            assert g.stride() == w.stride()
    assert not compiled.fallbacks, compiled.fallbacks


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "contiguous"])
def test_a_reordered_pointwise_kernel_is_generated_once(layout, monkeypatch):
    """A pointwise group over channels-last inputs runs in their memory order; its kernel
    was generated first for the logical order (never run), then for the memory order at
    the first launch, then for the logical order again to count its bytes: two or three
    sources per kernel of every channels-last net's first call. One now, the one it runs,
    and the results are eager's on every call."""
    import fxlite.codegen.runtime.kernel as runtime_kernel

    built = []
    real = runtime_kernel._build
    monkeypatch.setattr(runtime_kernel, "_build",
                        lambda group, inputs, *rest: (built.append(inputs), real(group, inputs, *rest))[1])

    def f(x, b):
        return torch.relu(x * 2 + b) - 1

    compiled = fxlite.compile(f)
    for _ in range(3):
        x = torch.randn(4, 8, 5, 3, device=DEVICE)
        x = {"channels_last": x.contiguous(memory_format=torch.channels_last),
             "transposed": x.transpose(1, 3), "contiguous": x}[layout]
        b = torch.randn(8, 1, 1, device=DEVICE) if layout != "transposed" else torch.randn(3, 1, 1,
                                                                                         device=DEVICE)
        got, want = compiled(x, b), f(x, b)
        same(got, want)
    assert len(compiled.kernels) == 1 and not compiled.fallbacks, compiled.fallbacks
    assert len(built) == 1, [[tuple(t.stride()) for t in i if isinstance(t, torch.Tensor)]
                             for i in built]


def test_a_view_of_a_kept_reduced_dim_checks_the_values_size_not_the_rows():
    """``amax(x, -1, keepdim=True).reshape(1, 1)`` of a 1x4 input: the view's size check
    compared its literal 1 with the iteration space's 4 at the reduced dim, so the kernel
    refused its own inputs and the group ran in eager (GPU fuzz seeds 1000404, 1002521,
    1006066). Views of spanned dims keep their checks (the fused norm test above)."""
    def f(x):
        return torch.amax(x, dim=-1, keepdim=True).reshape(1, 1) * 2

    compiled = fxlite.compile(f)
    for _ in range(3):
        x = torch.randn(1, 4, device=DEVICE)
        same(compiled(x), f(x))
    assert not compiled.fallbacks, compiled.fallbacks


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_chain_of_in_place_writes_to_a_half_buffer_rounds_each_write_as_eager(dtype):
    """Before: ``b.mul_(0.9).add_(m); b **= 2`` on a float16 buffer ran as one kernel that
    rounded only the last value, where eager rounds each write into the buffer: the
    buffer drifted from eager's from the second call on, the squaring amplifying it (38
    apart at call 4, fuzz seed 8910782). Each write's readers now read it rounded, so a
    chain of correctly rounded writes whose operands eager and the kernel hold alike (the
    inputs; ``x.mean() * 0.1`` is an unrounded float32 value in the kernel) leaves the
    buffer and an input written the same way equal to eager's, bit for bit."""
    compiled_model, eager_model = _InPlaceChain(dtype).to(DEVICE), _InPlaceChain(dtype).to(DEVICE)
    compiled = fxlite.compile(compiled_model)
    for _ in range(5):
        x, y = (torch.randn(4, 1, device=DEVICE).to(dtype) for _ in range(2))
        y_eager = y.clone()
        got, want = compiled(x, y), eager_model(x, y_eager)
        assert torch.equal(compiled_model.b, eager_model.b)
        assert torch.equal(y, y_eager)
        torch.testing.assert_close(got, want)
    assert compiled.kernels


class _InPlaceChain(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.register_buffer("b", torch.randn(4, 1, generator=torch.Generator()
                                              .manual_seed(1001)).to(dtype))

    def forward(self, x, y):
        self.b.mul_(0.9).add_(x).mul_(x)
        self.b += 0.25
        y.mul_(0.7).add_(self.b).sub_(x)
        return x.clamp(0) * 3


_COMPILE_FOR_SM90 = """
import re, sys, importlib.util
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("k", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
for name in sys.argv[3:]:
    fn = getattr(module, name)
    sig = {a: ("*" + sys.argv[2]) if a.endswith("_ptr") else "constexpr" if a.isupper()
           else "i32" for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, {a: 128 for a, t in sig.items() if t == "constexpr"}),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "enable_fp_fusion": True})
    print("\\n".join(l.strip() for l in k.asm["ptx"].splitlines()
                    if re.match(r"\\s*(fma|mul|add|sub|cvt)\\.", l)))
"""


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_gpu_source_keeps_each_in_place_rounding_through_fp_fusion(dtype, tmp_path,
                                                                       monkeypatch):
    """The kernel of the chain above, as generated for a GPU and compiled for sm_90 with
    FP fusion on (Triton's CUDA backend, no GPU needed): written as plain round trips,
    LLVM narrowed the writes to half ops and contracted ``(...) * x`` and the ``+ 0.25``
    after it into one half FMA (``fma.rn.bf16``), which skips eager's rounding between
    them (a bfloat16 buffer one ulp off eager's at the fifth call on an H200). The kept
    roundings leave the PTX no FMA at all: every product is rounded before its sum."""
    import subprocess
    import sys

    from fxlite.codegen.kernels.generate import generate_source
    from fxlite.codegen.runtime.kernel import TritonKernel

    seen = []
    real_call = TritonKernel.__call__
    monkeypatch.setattr(TritonKernel, "__call__",
                        lambda self, *inputs: (seen.append((self, inputs)),
                                               real_call(self, *inputs))[1])
    model = _InPlaceChain(dtype).to(DEVICE)
    compiled = fxlite.compile(model)
    compiled(torch.randn(4, 1, device=DEVICE).to(dtype), torch.randn(4, 1, device=DEVICE).to(dtype))
    kernel, inputs = next((k, i) for k, i in seen if len(k.nodes) > 4)  # (not the clamp)
    _, src = generate_source(kernel.group, list(inputs), True)
    path = tmp_path / "chain.py"
    path.write_text(src.text)
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, str(path),
                           "bf16" if dtype == torch.bfloat16 else "fp16",
                           *src.functions.values()],
                          env=env, capture_output=True, text=True)
    if done.returncode and ("ptxas" in done.stderr or "No such file" in done.stderr):
        pytest.skip("this Triton has no CUDA backend tools to compile with")
    assert done.returncode == 0, done.stderr[-2000:]
    floats = [line for line in done.stdout.splitlines() if re.match(r"(mul|add)\.\S*f(32|16)", line)]
    assert floats and not any(line.startswith("fma") for line in done.stdout.splitlines()), \
        done.stdout


_COMPILE_AND_SHOW_EXTERNS = """
import sys, importlib.util
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("k", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
fn = getattr(module, sys.argv[2])
sig = {a: "*fp32" if a.endswith("_ptr") else "constexpr" if a.isupper() else "i32"
       for a in fn.arg_names}
k = triton.compile(ASTSource(fn, sig, {a: 128 for a, t in sig.items() if t == "constexpr"}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("LIBDEVICE" if "__nv_" in k.asm["ttgir"] else "NO-LIBDEVICE")
print("\\n".join(l.strip() for l in k.asm["ptx"].splitlines() if "rsqrt" in l or "mul.hi" in l))
"""


def test_the_gpu_source_of_an_index_split_and_rsqrt_calls_no_libdevice(tmp_path):
    """A kernel that calls any libdevice function gets all of libdevice linked in and
    optimized with it: 50 to 100 ms of its compile on an H200 host. fxlite's kernels
    called it for two instructions only: ``umulhi`` (splitting a flat index into dims by
    magic numbers) and ``rsqrt`` (every norm); resnet50's first call linked it 9 times,
    swin_t's 29. Their GPU forms are the instructions themselves now (``mul.hi.u32``,
    ``rsqrt.approx.f32``, which is CUDA's rsqrtf, eager's: denormals not flushed), the
    CPU interpreter keeps Triton's portable ones. Compiled here for sm_90 with Triton's
    CUDA backend (no GPU needed)."""
    import subprocess
    import sys

    from fxlite.codegen.kernels.generate import generate_source

    x = torch.randn(3, 7, 5).permute(2, 1, 0)  # read through its strides: dims split by _fdiv
    y = torch.randn(5, 7, 3)
    gm = group(lambda a, b: torch.rsqrt(a.abs() + 1.0) * b, x, y)
    _, gpu = generate_source(gm, [x, y], True)
    _, portable = generate_source(gm, [x, y], False)
    assert "_fdiv(" in gpu.text and "tl.umulhi" in portable.text and "tl.rsqrt(" in portable.text
    assert "tl.umulhi" not in gpu.text and "tl.rsqrt(" not in gpu.text
    path = tmp_path / "kernel.py"
    path.write_text(gpu.text)
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_AND_SHOW_EXTERNS, str(path),
                           gpu.functions["pointwise"]], env=env, capture_output=True, text=True)
    if done.returncode and ("ptxas" in done.stderr or "No such file" in done.stderr):
        pytest.skip("this Triton has no CUDA backend tools to compile with")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "NO-LIBDEVICE", done.stdout
    assert any(line.startswith("rsqrt.approx.f32") for line in lines), done.stdout
    assert any(line.startswith("mul.hi.u32") for line in lines), done.stdout


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_stored_half_value_is_read_rounded_by_the_kernel_s_other_ops(dtype):
    """Before: a half value the kernel stores (a buffer's ``exp_``) was read unrounded by
    the kernel's other ops, so a float16 exp that overflowed was stored as inf while
    ``sin`` of it gave a number where eager's gives NaN (fuzz seed 7404901), and
    generally the other outputs were computed from another value than the stored one.
    Readers of a stored value now read it rounded, as eager reads what it stored.

    The kernel computes ``sin(b) + x`` in float32 and rounds once, where eager rounds
    ``sin(b)`` to the half type first; where the add cancels (``sin(11.03) + 0.92`` on the
    GPU's draws) the two differ by 2% of the result, so the sum is compared with the
    float32 computation from the stored buffer, rounded once, and with eager's within
    the rounding of ``sin(b)`` (an eps)."""
    class Buffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.tensor([1.0, 10.0, 11.5, 12.0, -3.0]).to(dtype))

        def forward(self, x):
            self.b.exp_()
            return torch.sin(self.b) + x

    compiled_model, eager_model = Buffer().to(DEVICE), Buffer().to(DEVICE)
    compiled = fxlite.compile(compiled_model)
    for _ in range(3):
        x = torch.randn(5, device=DEVICE).to(dtype)
        got, want = compiled(x), eager_model(x)
        assert torch.equal(compiled_model.b, eager_model.b)
        assert torch.equal(got.isnan(), want.isnan())
        fused = (torch.sin(eager_model.b.float()) + x.float()).to(dtype)
        torch.testing.assert_close(got, fused, equal_nan=True)
        torch.testing.assert_close(got, want, equal_nan=True, atol=torch.finfo(dtype).eps,
                                   rtol=0)
        with torch.no_grad():  # start again from values that overflow within a call or two
            compiled_model.b.copy_(torch.tensor([1.0, 2.0, 2.4, 2.5, -3.0]))
            eager_model.b.copy_(compiled_model.b)
    assert compiled.kernels
