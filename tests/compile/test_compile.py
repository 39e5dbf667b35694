"""Tests of ``fxlite.compile``: one fused kernel per group, checked fallbacks, guards.

On a CPU-only machine the kernels run through Triton's interpreter (TRITON_INTERPRET=1,
set by conftest.py before anything imports triton); tests marked ``gpu`` need CUDA with the
interpreter off. Shapes are tiny: the interpreter is slow.
Backends, modes and decorator forms are tested in test_compile_backends.py.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import re
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("triton")

import fxlite.codegen.compile as compile_mod
import fxlite.codegen.runtime.kernel as triton_mod
from _golden import assert_golden
from fxlite.codegen.runtime.kernel import interpreting

import fxlite

DEVICE = "cpu" if interpreting() else "cuda"
# Masked lanes of the interpreter compute on padding (log(0), x / 0): harmless, but noisy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="CPU behaviour (interpreter)")
native_gpu = pytest.mark.skipif(interpreting() or not torch.cuda.is_available(),
                                reason="needs CUDA with TRITON_INTERPRET unset")


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """Each test sees fxlite.compile's once-per-process warnings afresh."""
    monkeypatch.setattr(compile_mod, "_warned", set())


@pytest.fixture
def traces(monkeypatch):
    """The functions fxlite.compile recorded, in order (one entry per recording)."""
    seen, real = [], compile_mod.record

    def counting(fn, *args, **kwargs):
        seen.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(compile_mod, "record", counting)
    return seen


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def compiled_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("fxlite.compile")]


def run_quiet(c, *args):
    """Call ``c`` and return (result, fxlite.compile warnings)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = c(*args)
    return out, compiled_warnings(record)


def one_kernel(fn, *args, **tol):
    """Compile ``fn``, check it makes one kernel, no fallback, and matches eager."""
    c = fxlite.compile(fn)
    out, warned = run_quiet(c, *args)
    assert warned == [] and c.fallbacks == []
    assert len(c.kernels) == 1
    torch.testing.assert_close(out, fn(*args), **tol)
    return c


def relu_add_mul(x):
    return torch.relu(x + 1) * 2


def softmax(x):
    return torch.softmax(x, dim=-1)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def add_layer_norm(x, y, w, b):
    return F.layer_norm(x + y, (x.shape[-1],), w, b)


def gelu_bias(x, b):
    return F.gelu(x + b)


def centre(x):
    return x - x.mean(-1, keepdim=True)


def row_mean(x):
    return x.mean(-1)


class Norm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(n)

    def forward(self, x):
        return self.ln(x)


class LinearRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))


# ------------------------------------------------------------------ one kernel per case
def test_canonical_cases_are_one_kernel():
    x, y = rand(4, 8), rand(4, 8)
    w, b = rand(8), rand(8)
    one_kernel(relu_add_mul, x)
    one_kernel(gelu_bias, x, b)
    one_kernel(softmax, x)
    one_kernel(layer_norm, x, w, b)
    one_kernel(add_layer_norm, x, y, w, b)


def test_layer_norm_module_is_one_kernel():
    m = Norm(8).to(DEVICE)
    with torch.no_grad():
        m.ln.weight.copy_(rand(8))
        m.ln.bias.copy_(rand(8))
        c = fxlite.compile(m)
        x = rand(4, 8)
        out, warned = run_quiet(c, x)
        assert warned == [] and c.fallbacks == [] and len(c.kernels) == 1
        torch.testing.assert_close(out, m(x))


# ------------------------------------------------------------------ modules and autograd
def test_linear_relu_module_no_grad():
    m = LinearRelu().to(DEVICE)
    c = fxlite.compile(m)
    x = rand(4, 8)
    with torch.no_grad():
        out, warned = run_quiet(c, x)
        torch.testing.assert_close(out, m(x))
    assert warned == [] and c.fallbacks == []
    assert len(c.kernels) == 1 and c.kernels[0].name in c.code  # relu runs as a kernel
    assert_golden("compile_linear_relu_forward", c.code)


def test_linear_relu_module_with_autograd_runs_forward_and_backward_kernels():
    m = LinearRelu().to(DEVICE)
    ref = copy.deepcopy(m)
    c = fxlite.compile(m)
    for _ in range(3):
        x = rand(4, 8)
        out, warned = run_quiet(c, x)
        expected = ref(x)
        torch.testing.assert_close(out, expected)
        assert warned == [] and out.requires_grad
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(m.fc.weight.grad, ref.fc.weight.grad)
        torch.testing.assert_close(m.fc.bias.grad, ref.fc.bias.grad)
    directions = [k.direction for k in c.kernels]
    assert "forward" in directions and "backward" in directions and c.fallbacks == []


def test_input_requiring_grad_gets_gradients():
    c = fxlite.compile(relu_add_mul)
    for _ in range(3):
        x = rand(4, 8).requires_grad_()
        out, warned = run_quiet(c, x)
        assert warned == []
        out.sum().backward()
        torch.testing.assert_close(x.grad, 2.0 * (x.detach() + 1 > 0))
    assert {k.direction for k in c.kernels} == {"forward", "backward"}


# ------------------------------------------------------------------ resizes and guards
def test_resize_with_same_rank_reuses_kernels(traces):
    c = fxlite.compile(relu_add_mul)
    x = rand(4, 8)
    torch.testing.assert_close(c(x), relu_add_mul(x))
    (kernel,) = c.kernels
    for shape in [(6, 16), (3, 32), (5, 7)]:
        x = rand(*shape)
        torch.testing.assert_close(c(x), relu_add_mul(x))
        assert c.kernels == [kernel]
    assert len(traces) == 1


def test_resize_keeps_one_specialization_per_guard_key():
    # Sizes that are all multiples of 16 (or all not) are the guaranteed case: one
    # specialization, whatever Triton does with divisibility underneath.
    w16 = {n: (rand(n), rand(n)) for n in (16, 32, 48)}
    c = fxlite.compile(layer_norm)
    for rows, n in [(2, 16), (4, 32), (3, 48)]:
        x = rand(rows, n)
        torch.testing.assert_close(c(x, *w16[n]), layer_norm(x, *w16[n]))
        (kernel,) = c.kernels
        assert kernel.compilations == 1
    c = fxlite.compile(centre)
    for shape in [(3, 5), (5, 7), (7, 9)]:  # no size, row length or count divisible by 16
        x = rand(*shape)
        torch.testing.assert_close(c(x), centre(x))
        assert len(c.kernels) == 1 and c.kernels[0].compilations == 1


def test_second_call_reuses_the_first_calls_kernels_where_a_rewrite_changed_a_layout():
    # nn.MultiheadAttention(batch_first=True) off its fast path (as recorded) transposes
    # its output; the rewrite moves the transposes through the linear, so the residual add
    # gets contiguous inputs while its kernel keeps the recorded, transposed output layout.
    # The first call passed eager's contiguous values on, so the kernels after it were
    # specialized on a layout no later call gives: the second call generated them again
    # (on a GPU, 34 of vit_b_16's 51 kernels, 128 ms).
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.mlp = nn.Linear(16, 16)

        def forward(self, inp):
            x = self.ln(inp)
            x, _ = self.attn(x, x, x, need_weights=False)
            x = x + inp
            return x + self.mlp(self.ln(x)).relu()

    model = nn.Sequential(Block(), Block()).eval()
    c = fxlite.compile(model)
    with torch.no_grad():
        for call in range(3):
            x = rand(2, 5, 16)
            torch.testing.assert_close(c(x), model(x))
            built = sum(k.compilations for k in c.kernels)
            if call == 0:
                first = built
    assert built == first > 0


def test_eagers_values_take_the_kernels_layout_and_keep_their_aliasing():
    from fxlite.codegen.lower.segment import _laid_out_as

    value, kernels = rand(2, 3), torch.empty(3, 2).t()
    first, second, plain = _laid_out_as((value, value, value.t()), (kernels, kernels, value.t()))
    assert first is second and first.stride() == (1, 2)  # one value returned twice stays one
    torch.testing.assert_close(first, value)
    assert plain.stride() == value.t().stride()  # same layout: no copy
    broadcast = torch.empty(1, 3).expand(2, 3)  # a layout no copy can be written into
    assert _laid_out_as(value, broadcast) is value


def test_element_counts_are_read_at_run_time(traces):
    # mean divides by the row length: it must come from the new shape. These functions
    # read no size in Python, so one recording serves every size; layer_norm here reads
    # x.shape[-1], so each size is a recording of its own.
    c_ln, c_mean, c_centre = (fxlite.compile(f) for f in (layer_norm, row_mean, centre))
    kernels = None
    for shape in [(4, 8), (6, 16), (3, 32), (5, 7)]:
        x, w, b = rand(*shape), rand(shape[-1]), rand(shape[-1])
        for _ in range(2):  # the recording, then a replay
            torch.testing.assert_close(c_ln(x, w, b), layer_norm(x, w, b))
            torch.testing.assert_close(c_centre(x), centre(x))
            torch.testing.assert_close(c_mean(x), row_mean(x))
        assert len(c_ln.kernels) == 1
        kernels = kernels or (c_centre.kernels, c_mean.kernels)
        assert (c_centre.kernels, c_mean.kernels) == kernels
    assert traces.count(layer_norm) == 4 and traces.count(centre) == traces.count(row_mean) == 1


@pytest.mark.parametrize("fn", [row_mean, lambda x: x.sum(-1) * 2 + 1,
                                lambda x: x.amax(-1) - x.amin(-1),
                                lambda x: torch.sqrt(x.var(-1) + 1e-5),
                                lambda x: x.mean((0, 2)) + 1],
                         ids=["mean", "sum_epilogue", "range", "std", "mean_dims"])
def test_reductions_without_keepdim_are_one_kernel(fn):
    # Regression: a keepdim=False result used elementwise (mean = sum / n) ran in eager.
    x = rand(3, 4, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        c = fxlite.compile(fn)
        torch.testing.assert_close(c(x), fn(x))
    assert len(c.kernels) == 1 and c.fallbacks == []


def test_new_rank_or_dtype_compiles_again_and_is_right():
    c = fxlite.compile(softmax)
    x = rand(4, 8)
    c(x)
    (k2d,) = c.kernels
    x3 = rand(2, 3, 8)
    torch.testing.assert_close(c(x3), softmax(x3))
    assert c.kernels[0] is not k2d
    x64 = x.double()
    out, _ = run_quiet(c, x64)
    torch.testing.assert_close(out, softmax(x64))
    c(x)
    assert c.kernels == [k2d]


def test_train_and_eval_modes_are_guarded():
    m = nn.Sequential(nn.BatchNorm1d(4), nn.ReLU()).to(DEVICE)
    ref = copy.deepcopy(m)
    c = fxlite.compile(m)
    x = rand(8, 4)
    with torch.no_grad():
        m.eval(), ref.eval()
        torch.testing.assert_close(run_quiet(c, x)[0], ref(x))
        m.train(), ref.train()
        # Batch statistics, and running statistics updated exactly once, as eager does.
        torch.testing.assert_close(run_quiet(c, x)[0], ref(x))
        torch.testing.assert_close(m[0].running_mean, ref[0].running_mean)
        torch.testing.assert_close(m[0].running_var, ref[0].running_var)
        assert m[0].num_batches_tracked.item() == ref[0].num_batches_tracked.item() == 1
        m.eval(), ref.eval()
        torch.testing.assert_close(run_quiet(c, x)[0], ref(x))


def test_first_call_applies_in_place_ops_once():
    def bump(x):
        x.add_(1)
        return x * 2

    x = torch.zeros(3, 4, device=DEVICE)
    out, _ = run_quiet(fxlite.compile(bump), x)
    assert torch.equal(x, torch.ones_like(x))
    assert torch.equal(out, torch.full_like(x, 2.0))


def test_first_call_leaves_the_random_stream_as_eager_does():
    def noisy(x):
        return torch.relu(x) + torch.rand_like(x)

    c = fxlite.compile(noisy)
    x = rand(4, 8)
    torch.manual_seed(1)
    got = run_quiet(c, x)[0]
    torch.manual_seed(1)
    assert torch.equal(got, noisy(x))


def test_keyword_arguments_and_defaults():
    def affine(x, scale=1.0, shift=0.0):
        return x * scale + shift

    c = fxlite.compile(affine)
    x = rand(4, 8)
    torch.testing.assert_close(c(x, shift=3.0), affine(x, shift=3.0))
    torch.testing.assert_close(c(x, 2.0, shift=-1.0), affine(x, 2.0, shift=-1.0))
    torch.testing.assert_close(c(x), affine(x))


def test_non_tensor_arguments_are_guarded_by_value(traces):
    # The tutorial's f2(x, y) with y an int: a new value records again, an old one replays.
    def scaled(x, alpha):
        return torch.relu(x) * alpha + 1

    c = fxlite.compile(scaled)
    x = rand(4, 8)
    for alpha in (0.5, 3.0, 0.5, -2.25, 3.0, 3):
        for _ in range(2):
            torch.testing.assert_close(c(x, alpha), scaled(x, alpha))
        assert len(c.kernels) == 1
    assert len(traces) == 4  # 0.5, 3.0, -2.25 and the int 3


# ------------------------------------------------------------------ graph breaks
def branchy(x):
    if x.sum() > 0:
        return x + 1
    return x - 1


def test_fullgraph_raises_naming_the_line():
    lines, first = inspect.getsourcelines(branchy)
    lineno = first + next(i for i, s in enumerate(lines) if "x.sum() > 0" in s)
    with pytest.raises(fxlite.TraceError) as info:
        fxlite.compile(branchy, fullgraph=True)(rand(4))
    assert f"line {lineno}" in str(info.value) and "if x.sum() > 0" in str(info.value)


def test_graph_break_compiles_each_branch(traces):
    c = fxlite.compile(branchy)
    pos, neg = rand(4).abs() + 1, -rand(4).abs() - 1
    for x, want in [(pos, pos + 1), (neg, neg - 1), (pos, pos + 1), (neg, neg - 1)]:
        out, warned = run_quiet(c, x)
        torch.testing.assert_close(out, want)
        assert warned == [] and c.fallbacks == [] and len(c.kernels) == 2  # sum > 0; x + 1
    assert len(traces) == 2  # one recording per branch, then replays


@cpu_interpreter
def test_without_interpreter_or_gpu_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    c = fxlite.compile(relu_add_mul)
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="TRITON_INTERPRET") as record:
        torch.testing.assert_close(c(x), relu_add_mul(x))
        torch.testing.assert_close(c(x + 1), relu_add_mul(x + 1))
    assert len(compiled_warnings(record)) == 1
    assert c.kernels == [] and "triton_" not in c.code


# ------------------------------------------------------------------ threads
def test_threads_racing_on_the_first_call_compile_once(traces):
    backend_calls = []

    def counting_backend(gm, example_inputs):
        backend_calls.append(1)
        return gm.forward

    for c in (fxlite.compile(relu_add_mul), fxlite.compile(relu_add_mul, backend=counting_backend)):
        traces.clear()
        x = rand(4, 8)
        barrier = threading.Barrier(8)
        results, errors = [None] * 8, []

        def work(i, c=c, x=x, barrier=barrier, results=results, errors=errors):
            try:
                barrier.wait()
                results[i] = c(x)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        [t.start() for t in threads], [t.join() for t in threads]
        assert errors == [] and len(traces) == 1
        for r in results:
            torch.testing.assert_close(r, relu_add_mul(x))
    assert len(backend_calls) == 1


# ------------------------------------------------------------------ introspection
def test_kernels_code_and_report(capsys):
    c = fxlite.compile(relu_add_mul)
    assert c.kernels == [] and c.code == ""
    x = rand(4, 8)
    c(x)
    (k,) = c.kernels
    traced = fxlite.symbolic_trace(relu_add_mul)
    assert k.nodes == [n.name for n in traced.graph.nodes if n.op == "call_function"]
    assert re.fullmatch(r"\w+", k.name) and "@triton.jit" in k.source
    assert re.search(r"def fx_\w+\(", k.source)  # named by its ops and a digest
    assert re.search(rf"= {k.name}\(x\)", c.code)

    capsys.readouterr()
    text = c.report()
    printed = capsys.readouterr().out
    assert text in printed
    header, _, row = text.splitlines()[:3]
    assert "bytes moved" in header and "fused ops" in header
    moved = 2 * x.numel() * x.element_size()  # read x once, write the output once
    assert row.startswith(k.name) and ", ".join(k.nodes) in row
    assert row.split()[-1] == f"{moved:,}"

    timed = c.report(benchmark=True)
    header, _, row = timed.splitlines()[:3]
    assert all(col in header for col in ("ms", "GB/s", "% of copy"))
    ms, gbs, share = row.split()[-3:]
    assert float(ms) > 0 and float(gbs) >= 0 and share.endswith("%")


def test_module_exposes_kernels_and_report(capsys):
    m = LinearRelu().to(DEVICE)
    c = fxlite.compile(m)
    with torch.no_grad():
        c(rand(2, 8))
    assert len(c.kernels) == 1
    c.report()
    assert c.kernels[0].name in capsys.readouterr().out


# ------------------------------------------------------------------ correctness fallbacks
class FakeKernel:
    """Quacks like a TritonKernel: runs the group eagerly, plus ``offset``."""

    kind = "pointwise"

    def __init__(self, group, name, offset, checked=False):
        self.group, self.name, self.offset, self.calls = group, name, offset, 0
        self.nodes = [n.name for n in group.graph.nodes if n.op == "call_function"]
        self.checked, self.marked = checked, 0

    def mark_checked(self):
        self.checked = True
        self.marked += 1

    @property
    def __name__(self):
        return self.name

    def __call__(self, *args):
        self.calls += 1
        return self.group(*args) + self.offset

    def bytes_moved(self, *args):
        return 0

    def tune_wide_rows(self, *args):
        return None  # nothing to time


def fake_generator(offset, made, checked=False):
    def generate(group, example_inputs, name="kernel", **kw):
        made.append(FakeKernel(group, name, offset, checked))
        return made[-1]
    return generate


def test_a_right_kernel_passes_the_check(monkeypatch):
    made = []
    monkeypatch.setattr(triton_mod, "generate_kernel", fake_generator(0, made))
    c = fxlite.compile(relu_add_mul)
    x = rand(4, 8)
    torch.testing.assert_close(c(x), relu_add_mul(x))
    torch.testing.assert_close(c(x), relu_add_mul(x))
    assert c.kernels == made and c.fallbacks == []
    assert made[0].calls == 2  # the first call is the eager recording; the check, one replay
    assert made[0].marked == 1  # the disk index records that it passed


def test_a_kernel_checked_in_an_earlier_process_skips_the_eager_run(monkeypatch):
    made = []
    monkeypatch.setattr(triton_mod, "generate_kernel", fake_generator(0, made, checked=True))
    group_calls = []
    # the module (fxlite.passes.fuse is the function), and how it calls a fused group
    fuse_mod = importlib.import_module("fxlite.passes.fuse")
    real_call = fuse_mod._call_forward

    def counting_call(self, *args, **kwargs):
        group_calls.append(self)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(fuse_mod, "_call_forward", counting_call)
    c = fxlite.compile(relu_add_mul)
    x = rand(4, 8)
    torch.testing.assert_close(c(x), relu_add_mul(x))
    torch.testing.assert_close(c(x), relu_add_mul(x))
    # every run of the group was the fake kernel's own: eager never ran it for a check
    assert c.kernels == made and made[0].marked == 0 and len(group_calls) == made[0].calls == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_a_wrong_kernel_is_caught_on_the_first_call(monkeypatch, dtype):
    made = []
    monkeypatch.setattr(triton_mod, "generate_kernel", fake_generator(1, made))
    c = fxlite.compile(relu_add_mul)
    # Large integers: a relative tolerance would hide an off-by-one.
    x = rand(4, 8) if dtype.is_floating_point else torch.randint(
        10**6, 10**7, (4, 8), device=DEVICE)
    with pytest.warns(UserWarning, match="disagreed with eager"):
        out = c(x)
    assert torch.equal(out, relu_add_mul(x))
    assert torch.equal(c(x), relu_add_mul(x))
    assert c.kernels == [] and len(c.fallbacks) == 1
    assert "disagreed with eager" in c.fallbacks[0] and "relu" in c.fallbacks[0]
    assert made[0].calls == 1  # tried once, never used again


def test_a_generator_that_raises_falls_back_to_eager(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("generator exploded")

    monkeypatch.setattr(triton_mod, "generate_kernel", boom)
    c = fxlite.compile(relu_add_mul)
    x = rand(4, 8)
    with pytest.warns(UserWarning, match="generator exploded"):
        torch.testing.assert_close(c(x), relu_add_mul(x))
    assert c.kernels == [] and "RuntimeError: generator exploded" in c.fallbacks[0]


# ------------------------------------------------------------------ dtypes
HALF_TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_chains(dtype):
    x = rand(4, 8, dtype=dtype) * 3
    for fn in (relu_add_mul, softmax):
        c = one_kernel(fn, x, **HALF_TOL[dtype])
        assert c(x).dtype == dtype


def test_integer_floor_division_and_modulo_are_exact():
    def fn(x):
        return x // 3 + x % 3

    x = torch.arange(-10, 10, dtype=torch.int32, device=DEVICE).reshape(4, 5)
    c = one_kernel(fn, x)
    out = c(x)
    assert out.dtype == torch.int32 and torch.equal(out, fn(x))


@cpu_interpreter
def test_activation_modules_fuse_into_one_kernel():
    # Each of these is a pointwise record of the op table, so the partitioner groups them.
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Mish(), torch.nn.Hardswish(),
                            torch.nn.LeakyReLU(0.2), torch.nn.ELU(), torch.nn.Hardtanh(-0.5, 0.5),
                            torch.nn.ReLU6(), torch.nn.Hardsigmoid()).eval()
    c = fxlite.compile(m)
    x = rand(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
    # 7 activations and the Linear's bias add (split off the matmul: an epilogue)
    assert len(c.kernels) == 1 and len(c.kernels[0].nodes) == 8 and c.fallbacks == []


class _DecayThenDivide(nn.Module):
    """A buffer update, then an integer division that raises when a divisor is 0."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.ones(1))

    def forward(self, x, d):
        self.ema.mul_(0.9).add_(self.ema.mean() * 0.1)
        x //= d
        return x


class _DecayDivideThenBranch(_DecayThenDivide):
    """The same, and a graph break after the division: the call has two segments."""

    def forward(self, x, d):
        x = super().forward(x, d)
        return x * 2 if bool((x > 0).all()) else x - 1


class _BranchThenDecayDivide(_DecayThenDivide):
    """A graph break before the update and the division: the segment that raises is the
    call's second, after one that only read (fuzz seed 8023118 without its first write:
    the compiled call kept the buffer's old value where eager's update had landed before
    it raised)."""

    def forward(self, x, d):
        if bool((x > 6).all()):
            self.ema.mul_(0.9).add_(self.ema.mean() * 0.1)
        x //= d
        return x


class _WriteBranchDecayDivide(_DecayThenDivide):
    """Fuzz seed 8023118: an input written before the read (so the call cannot run again),
    a shape check, and an input filled at the end. The segment that raised wrote nothing
    yet, so its recorded ops run: the update lands, and the input is written once."""

    def forward(self, x, d):
        x.add_(1)
        if bool((x > 7).all()):
            self.ema.mul_(0.9).add_(self.ema.mean() * 0.1)
        torch._assert(x.dim() == 1, "rank")
        y = x // d
        x.fill_(3)
        return y


class _KeptWriteDecayDivide(_DecayThenDivide):
    """Fuzz seed 8223430: a write the compile keeps in place (through a view) comes first,
    so the call cannot run again; the buffer update after it was written back at the
    segment's end, after the division that raised, and never landed."""

    def forward(self, x, d):
        x[:2].add_(1)
        self.ema.mul_(0.9).add_(self.ema.mean() * 0.1)
        y = x // d
        return y


@pytest.mark.parametrize("model", [_DecayThenDivide, _DecayDivideThenBranch,
                                   _BranchThenDecayDivide, _WriteBranchDecayDivide,
                                   _KeptWriteDecayDivide])
def test_a_call_that_raises_leaves_eagers_state_buffer_writes_and_partial_writes_included(
        model):
    """Before: a compiled segment writes its buffers back at its end, so a call whose
    integer division raised kept the buffer's old value, and a recording that writes was
    not run again (fuzz seeds 7102901, 7413326). A first segment whose writes all come
    after the op that raised has written nothing, so the call runs again in eager: the
    buffer update lands once, and the division writes the elements eager writes before it
    raises."""
    compiled_model, eager_model = model(), model()
    compiled = fxlite.compile(compiled_model)
    for k in range(6):
        x = torch.arange(4) + 5 + k
        d = torch.tensor([1, 2, 3, 0 if k in (3, 4) else 1])
        ours, theirs = x.clone(), x.clone()
        outcome = []
        for fn, arg in ((compiled, ours), (eager_model, theirs)):
            try:
                outcome.append(fn(arg, d).tolist())
            except RuntimeError as e:
                outcome.append(type(e).__name__ + str(e))
        assert outcome[0] == outcome[1]
        assert torch.equal(ours, theirs)  # eager's partial writes on the calls that raise
        assert torch.equal(compiled_model.ema, eager_model.ema)
    assert compiled.kernels


class _NormThenDivideWriteResult(nn.Module):
    """A training BatchNorm's statistics update (which the compile moves to the end of
    the graph), then an integer ``fmod`` that raises where a divisor is 0, and writes into
    its result."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))

    def forward(self, x, d):
        F.batch_norm(x.float(), self.mean, self.var, training=True, momentum=0.1)
        y = torch.fmod(x, d)
        y[0] = -1
        y[1].add_(2)
        return y


def test_a_call_that_raises_before_writing_state_runs_again_despite_writes_to_its_own_values():
    """Before: fuzz seed 9313724. The statistics update comes last in the compiled graph,
    after the ``fmod`` that raised, so the call can run again in eager and land it, as
    for the divisions above; but the writes into ``fmod``'s result (a tensor the graph
    made, lost with it when the call raises) counted as writes of state, so the call was
    not run again and the update was lost from the second call on."""
    compiled_model, eager_model = _NormThenDivideWriteResult(), _NormThenDivideWriteResult()
    compiled = fxlite.compile(compiled_model)
    for k in range(5):
        x = torch.arange(6).view(2, 3) + k
        d = torch.tensor([1, 0, 3] if k in (1, 3) else [1, 2, 3])
        outcome = []
        for fn in (compiled, eager_model):
            try:
                outcome.append(fn(x, d).tolist())
            except RuntimeError as e:
                outcome.append(type(e).__name__)
        assert outcome[0] == outcome[1]
        torch.testing.assert_close(compiled_model.mean, eager_model.mean, rtol=0, atol=0)
        torch.testing.assert_close(compiled_model.var, eager_model.var, rtol=0, atol=0)
    assert compiled.kernels


def test_a_call_that_raises_while_its_segment_compiles_keeps_no_fallback():
    """Before: a piece of a followed call (one that prints: its Python runs on every
    call) compiles on the values of its first run; where that run's integer division
    raised, the compile pipeline "failed", and the piece ran its recorded ops from then on,
    with a warning blaming the pipeline (fuzz seed 7212607). The user's exception now
    propagates as eager's, and the next call compiles the piece."""
    import io

    log = io.StringIO()

    def fn(x, d):
        print(x.sum(), file=log)
        y = torch.relu(x * 2.0) + 1.0
        return y, torch.div(d * 3, d, rounding_mode="floor")

    compiled = fxlite.compile(fn)
    d = torch.tensor([1, 2, 3])
    x = torch.randn(8)
    torch.testing.assert_close(compiled(x, d), fn(x, d))  # recorded
    zero = torch.tensor([1, 0, 3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            compiled(x, zero)
    assert not any("pipeline failed" in str(w.message) for w in caught)
    for _ in range(2):
        x = torch.randn(8)
        torch.testing.assert_close(compiled(x, d), fn(x, d))
    assert compiled.kernels
    assert not any("pipeline failed" in f for f in compiled.fallbacks)


def _activation(x):
    return torch.tanh(x) * 2 + x.sin()


def _inner_vmap(x):
    return torch.vmap(_activation)(x * 2) + 1


def _inner_dual(x):
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        out = fwAD.unpack_dual(_activation(fwAD.make_dual(x * 2, torch.ones_like(x))))
    return out.primal + out.tangent


def _outer(transform):
    import torch.autograd.forward_ad as fwAD

    def dual(fn, x):
        with fwAD.dual_level():
            out = fwAD.unpack_dual(fn(fwAD.make_dual(x, torch.ones_like(x))))
        return out.primal + out.tangent

    return {
        "vmap": lambda fn, x: torch.vmap(fn)(x),
        "grad": lambda fn, x: torch.func.grad(lambda y: fn(y).sum())(x),
        "jvp": lambda fn, x: torch.func.jvp(fn, (x,), (torch.ones_like(x),))[1],
        "dual": dual,
    }[transform]


@pytest.mark.parametrize("case", ["vmap", "grad", "jvp", "dual", "inner_vmap", "inner_dual"])
def test_functorch_transforms_and_forward_ad_give_eagers_values(case):
    """Before: under ``torch.vmap``, ``torch.func.grad`` and ``torch.func.jvp`` a compiled
    function crashed ("Cannot access data pointer of Tensor that doesn't have storage": its
    tensors are wrappers), inside forward-mode AD its result lost its tangent, and a vmap
    inside the compiled function recorded per-example shapes and replayed them on the
    whole batch: silently wrong. Such calls run eagerly, with one warning saying why."""
    if case.startswith("inner_"):
        fn = {"inner_vmap": _inner_vmap, "inner_dual": _inner_dual}[case]
        compiled = fxlite.compile(fn)
        call, want_call = compiled, fn
    else:
        compiled = fxlite.compile(_activation)
        apply = _outer(case)
        call, want_call = (lambda x: apply(compiled, x)), (lambda x: apply(_activation, x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            x = torch.randn(3, 5)
            torch.testing.assert_close(call(x), want_call(x))
    assert any("torch.func transform" in str(w.message) or "forward-mode AD" in str(w.message)
               for w in caught)


def test_a_compiled_module_deep_copies_and_pickles_as_torch_compiles_does():
    """Before: ``copy.deepcopy(compiled)`` (an EMA model) raised "cannot pickle 'module'
    object" and ``torch.save(compiled)`` "Can't pickle local object", where
    ``torch.compile``'s module does both. A copy compiles a copy of the module with the
    same arguments; its state is its own."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    compiled = fxlite.compile(model, recompile_limit=3)
    for _ in range(3):
        compiled(torch.randn(4, 6))
    ema = copy.deepcopy(compiled)
    buffer = io.BytesIO()
    torch.save(compiled, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (ema, loaded):
        assert type(copied) is type(compiled) and copied._orig_mod is not model
        assert copied.recompile_limit == 3
        torch.testing.assert_close(copied.state_dict(), compiled.state_dict())
    with torch.no_grad():
        ema._orig_mod[0].weight.mul_(0.5)  # the copy's own parameters
    assert not torch.equal(ema._orig_mod[0].weight, model[0].weight)
    reference = copy.deepcopy(model)
    for _ in range(3):
        x = torch.randn(4, 6)
        torch.testing.assert_close(loaded(x), reference(x))  # training mode: stats move
        torch.testing.assert_close(loaded.state_dict()["_orig_mod.1.running_mean"],
                                   reference[1].running_mean)
    assert loaded.kernels


def test_a_module_whose_forward_was_compiled_deep_copies_onto_the_copy():
    """Before: ``model.forward = fxlite.compile(model.forward)`` (HF's idiom), then
    ``copy.deepcopy(model)`` raised "cannot pickle '_thread.lock' object", and so did a
    deep copy of a compiled function. The copy's forward is compiled anew, bound to the
    copy: it reads the copy's weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.forward = fxlite.compile(model.forward)
    model(torch.randn(2, 4))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.mul_(-1)
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(twin(x), torch.relu(F.linear(x, twin[0].weight, twin[0].bias)))
        torch.testing.assert_close(model(x), torch.relu(F.linear(x, model[0].weight,
                                                                  model[0].bias)))
    double = fxlite.compile(lambda t: t.relu() * 2)
    twice = copy.deepcopy(double)
    x = torch.randn(5)
    torch.testing.assert_close(twice(x), x.relu() * 2)
