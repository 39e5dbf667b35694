"""Differential tests of the Triton row kernels (reductions, softmax, norms) against eager.

Each case runs the persistent variant (the row fits in a block) and the looped one
(``max_block=16`` forces rows longer than 16 elements to loop).
"""

from __future__ import annotations

# First: it sets TRITON_INTERPRET=1 (on CPU) before anything imports triton.
from test_triton_kernels import DEVICE, FLOATS, check, group, rand, same  # isort: skip

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.runtime.kernel import generate_kernel, guard_key

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
VARIANTS = {"persistent": {}, "looped": {"max_block": 16}}


def softmax(x):
    m = torch.amax(x, dim=-1, keepdim=True)
    e = torch.exp(x - m)
    return e / torch.sum(e, dim=-1, keepdim=True)


def log_softmax(x):
    shifted = x - torch.amax(x, dim=-1, keepdim=True)
    return shifted - torch.log(torch.sum(torch.exp(shifted), dim=-1, keepdim=True))


def layer_norm(x, w, b):
    mean = torch.mean(x, dim=-1, keepdim=True)
    centred = x - mean
    var = torch.mean(centred * centred, dim=-1, keepdim=True)
    return centred * torch.rsqrt(var + 1e-5) * w + b


def rms_norm(x, w):
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6) * w


def add_layer_norm(x, r, w, b):
    return layer_norm(x + r, w, b)


REDUCTIONS = {
    "sum": lambda x: torch.sum(x, dim=-1, keepdim=True),
    "mean": lambda x: torch.mean(x, dim=-1),
    "amax": lambda x: torch.amax(x, dim=-1, keepdim=True),
    "amin": lambda x: x.amin(-1),
    "prod": lambda x: torch.prod(x * 0.1 + 1, dim=-1, keepdim=True),
    "var": lambda x: torch.var(x, dim=-1, keepdim=True),
    "var_pop": lambda x: torch.var(x, dim=-1, unbiased=False),
    "std": lambda x: torch.std(x, dim=-1, keepdim=True, correction=2),
    "sum_dim0": lambda x: x.sum(0),
    "amax_dim0": lambda x: torch.amax(x, dim=0, keepdim=True),
    "mean_all": lambda x: x.mean(),
    "var_dim0": lambda x: torch.var(x, 0),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_float_reductions(dtype, variant):
    x = rand(5, 37, dtype=dtype)
    for name, fn in REDUCTIONS.items():
        try:
            check(fn, x, **VARIANTS[variant])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e


@pytest.mark.parametrize("variant", VARIANTS)
def test_reductions_over_any_dims(variant):
    x = rand(3, 20, 6)
    kw = VARIANTS[variant]
    check(lambda a: a.sum((0, 2)), x, **kw)
    check(lambda a: torch.amax(a, dim=(0, 2), keepdim=True), x, **kw)
    check(lambda a: a.mean(1, keepdim=True) * a, x, **kw)      # middle dim, with epilogue
    check(lambda a: torch.var(a, dim=(1, 2)), x, **kw)
    check(lambda a: a.sum(-1), x.transpose(1, 2), **kw)          # strided rows
    check(lambda a: a.sum(), x[:, ::3], **kw)                    # everything, sliced


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64, torch.bool), ids=str)
def test_integer_and_bool_reductions(dtype):
    x = rand(4, 21, dtype=dtype)
    for kw in VARIANTS.values():
        check(lambda a: a.sum(-1), x, **kw)                      # -> int64
        check(lambda a: torch.amax(a, -1, keepdim=True), x, **kw)
        check(lambda a: torch.amin(a, 0), x, **kw)
        if dtype != torch.bool:
            check(lambda a: torch.prod(a % 3 - 1, -1), x, **kw)
            check(lambda a: a - torch.amax(a, -1, keepdim=True), x, **kw)


def test_reduction_identities_and_nan():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 3.0, 0.0, -1.0], [-inf, -inf, -inf, -inf, -inf],
                      [2.0, 5.0, nan, nan, 1.0], [inf, 1.0, 2.0, -inf, 0.0]], device=DEVICE)
    for kw in ({}, {"max_block": 2}):
        for fn in (lambda a: torch.amax(a, -1), lambda a: torch.amin(a, -1),
                   lambda a: a.sum(-1), lambda a: a.prod(-1), softmax, log_softmax,
                   lambda a: torch.amax(a, 0)):
            check(fn, x, **kw)
    # Padded lanes and padded rows (3 rows in a block of 4) never leak into results.
    y = rand(3, 5) - 10
    for kw in VARIANTS.values():
        k = check(lambda a: torch.amax(a, -1), y, **kw)
        assert not k(y).isnan().any()
        check(lambda a: torch.amin(a.abs() + 1, -1), y, **kw)  # 0-fill would give 0
        check(lambda a: torch.prod(a * 0 + 2, -1), y, **kw)     # 0-fill would give 0


def test_softmax_with_infinite_rows():
    inf = float("inf")
    x = rand(4, 12)
    x[1] = -inf                      # all -inf: NaN, like eager
    x[2, :6] = -inf                  # partly -inf
    x[3, 3] = inf
    for kw in VARIANTS.values():
        check(softmax, x, expected=torch.softmax(x, -1), **kw)
        check(log_softmax, x, expected=torch.log_softmax(x, -1), **kw)


NORMS = {
    "softmax": (softmax, lambda x: torch.softmax(x.float(), -1).to(x.dtype), 1),
    "log_softmax": (log_softmax, lambda x: torch.log_softmax(x.float(), -1).to(x.dtype), 1),
    "layer_norm": (layer_norm, lambda x, w, b: F.layer_norm(x.float(), x.shape[-1:], w.float(),
                                                             b.float()).to(x.dtype), 3),
    "rms_norm": (rms_norm, lambda x, w: F.rms_norm(x.float(), x.shape[-1:], w.float(),
                                                   1e-6).to(x.dtype), 2),
    "add_layer_norm": (add_layer_norm, lambda x, r, w, b: F.layer_norm(
        (x + r).float(), x.shape[-1:], w.float(), b.float()).to(x.dtype), 4),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", NORMS)
def test_norms_are_one_kernel(name, dtype, variant):
    fn, reference, n = NORMS[name]
    cols = 40
    inputs = [rand(6, cols, dtype=dtype)] + [rand(cols, dtype=dtype, scale=1.0)
                                            for _ in range(n - 1)]
    if name == "add_layer_norm":
        inputs[1] = rand(6, cols, dtype=dtype)
    k = check(fn, *inputs, expected=reference(*inputs), **VARIANTS[variant])
    assert k.kind == "reduction"
    assert k.source.count("_persistent(") == 1 and k.source.count("_looped(") == 1
    assert k.source.count("tl.store(") == 2   # one output, stored once by each variant
    # the eager decomposition (which rounds halves after every op) agrees too
    same(k(*inputs), fn(*inputs))


@pytest.mark.parametrize("variant", VARIANTS)
def test_quotient_by_a_row_value(variant):
    """``full / row`` multiplies by the row's reciprocal (ops._quot_by_row); a divisor
    that is subnormal or above 2**126 is scaled by a power of 2 first, so each quotient
    stays within eager's rounding, including 0, inf and NaN rows."""
    kw = VARIANTS[variant]
    fn = lambda a: a / a.sum(-1, keepdim=True)  # noqa: E731
    x = rand(6, 32)
    k = check(fn, x, **kw)
    assert "tl.div_rn(tl.full(" in k.source  # one division per row, not per element
    for dtype in (torch.float16, torch.bfloat16):  # halves divide in fp32 too
        check(fn, rand(6, 32, dtype=dtype), **kw)
    # sums exact in any order, so the quotients must equal eager's
    tiny = torch.full((6, 32), 2.0 ** -140, device=DEVICE)  # sum 2**-135: 1 / sum is inf
    mixed = torch.cat([tiny[:1], x[1:]])                    # such a row among normal ones
    huge = torch.zeros(6, 32, device=DEVICE)
    huge[:, :3] = torch.tensor([2.0 ** 127, 2.0 ** 125, -(2.0 ** 120)])  # 1 / sum: subnormal
    special = torch.zeros(6, 32, device=DEVICE)
    special[:, :2] = torch.tensor([[0.0, 0.0], [float("inf"), 1.0], [float("nan"), 1.0],
                                   [1.0, -1.0], [-0.0, 0.0], [3.0, float("-inf")]])
    for t in (tiny, mixed, huge, special, x * 1e-3):
        for _ in range(2):
            got, want = k(t), fn(t)
            same(got, want)
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    for t in (tiny, huge):
        assert torch.equal(k(t), fn(t))
    assert torch.equal(k(mixed)[0], fn(mixed)[0])


def test_norm_resize_reuses_the_kernel():
    w, b = rand(24), rand(24)
    x = rand(5, 24)
    k = check(layer_norm, x, w, b)
    for rows, cols in ((9, 24), (3, 17), (2, 64), (7, 100)):
        x2, w2, b2 = rand(rows, cols), rand(cols), rand(cols)
        assert guard_key([x2, w2, b2]) == guard_key([x, w, b])
        same(k(x2, w2, b2), layer_norm(x2, w2, b2))
    assert k.compilations == 1
    k2 = check(softmax, x, max_block=16)                 # rows longer than 16 loop
    y = rand(3, 100)
    same(k2(y), softmax(y))
    assert k2.compilations == 1


def test_row_outputs_and_prologues():
    x, m = rand(6, 30), rand(6, 1)
    for kw in VARIANTS.values():
        # a full output and row outputs (keepdim and not) from one kernel
        check(lambda a: (softmax(a), torch.amax(a, -1), a.sum(-1, keepdim=True)), x, **kw)
        # a row-shaped input in the prologue, and an epilogue with a full input
        check(lambda a, c: torch.sum(torch.exp(a - c), -1, keepdim=True) * a, x, m, **kw)
        check(lambda a, c: softmax(a) * c, x, rand(6, 30), **kw)
        # layer_norm statistics as extra outputs
        check(lambda a: (a.mean(-1, keepdim=True), torch.rsqrt(a.var(-1, keepdim=True) + 1e-5)),
              x, **kw)
    check(lambda a, eps: a * torch.rsqrt(torch.mean(a * a, -1, keepdim=True) + eps), x, 1e-3)


def test_empty_and_zero_dim_reductions():
    check(lambda a: a.sum(-1), torch.empty(4, 0, device=DEVICE))
    check(lambda a: a.mean(-1), torch.empty(4, 0, device=DEVICE))          # NaN, as eager
    check(lambda a: a.prod(-1, keepdim=True), torch.empty(3, 0, device=DEVICE))
    check(lambda a: softmax(a), torch.empty(0, 7, device=DEVICE))
    check(lambda a: a.sum(), torch.tensor(2.5, device=DEVICE))
    x = torch.empty(2, 0, device=DEVICE)
    k = generate_kernel(group(lambda a: torch.amax(a, -1), rand(2, 3)), [rand(2, 3)])
    with pytest.raises(IndexError):
        torch.amax(x, -1)
    with pytest.raises(IndexError):
        k(x)


def test_reduction_groups_it_cannot_prove_fall_back():
    x = rand(4, 4)
    gm = group(lambda a: a.sum(-1) + a.sum(0), x)        # two different reduced dims
    assert generate_kernel(gm, [x]) is None
    gm = group(lambda a: a.sum(-1) * a[:, 0], x)  # getitem: not a kernel op
    assert generate_kernel(gm, [x]) is None


def test_sums_over_batch_and_space_launch_one_row_per_program():
    # Regression (measured on an H200): a batch norm's gradient sums over (N, H, W) of an
    # NCHW tensor were launched like reductions over leading dims, 64 channels per program,
    # so 64 channels ran as one program: 0.26 ms a kernel, 75% of a resnet18 step.
    x = rand(4, 64, 8, 8)
    k = generate_kernel(group(lambda a: a.sum((0, 2, 3)), x), [x])
    same(k(x), x.sum((0, 2, 3)))
    counts, config = k._current.config(tuple(x.shape))
    assert counts == {"rows": 64, "cols": 256}
    assert config["ROWS"] <= 8  # at least 8 programs for 64 channels
    y = rand(64, 256)  # over a leading dim the kept rows are adjacent: packing them pays
    k2 = generate_kernel(group(lambda a: a.sum(0), y), [y])
    assert k2._current.config(tuple(y.shape))[1]["ROWS"] >= 8


def test_a_channels_last_sum_over_space_packs_adjacent_channels_per_program():
    # Regression (measured on an H200): a channels-last 16x64x32x32 summed over (H, W) was
    # launched as row kernels, 2 rows of 1024 strided values per program: 25.4 us against
    # 7.2 for 8 adjacent channels per program (as fast as a copy).
    x = rand(2, 8, 32, 32).to(memory_format=torch.channels_last)
    k = generate_kernel(group(lambda a: a.sum((2, 3), keepdim=True), x), [x])
    same(k(x), x.sum((2, 3), keepdim=True))
    counts, config = k._current.config(tuple(x.shape))
    assert counts == {"rows": 16, "cols": 1024}
    assert (config["ROWS"], config["BLOCK_C"]) == (8, 256)
    c = x.contiguous()  # rows of contiguous values: a whole row or two per program
    kc = generate_kernel(group(lambda a: a.sum((2, 3), keepdim=True), c), [c])
    assert kc._current.config(tuple(c.shape))[1]["BLOCK_C"] == 1024


def _looped_passes(kernel) -> int:
    looped = kernel.source.split("_looped(")[1]
    return looped.count("for c0 in range(")


def test_looped_full_outputs_are_stored_by_the_first_loop_that_computes_them():
    # A level-0 output (no reduction in its cone) is stored in the first reduction's loop,
    # a level-1 one in the second: no extra pass over the row unless an output needs the
    # deepest reduction. Checked in the contiguous and the strided-columns layout (BatchNorm
    # backward over H, W of a channels-last tensor stores its masked gradient this way).
    def two_levels(a, g):
        masked = torch.where(a > 0, g, 0.0)
        centred = a - torch.mean(a, -1, keepdim=True)
        var = torch.mean(centred * centred, -1, keepdim=True)
        return masked, centred, var, masked.sum(-1, keepdim=True)

    def deepest(a):
        centred = a - torch.mean(a, -1, keepdim=True)
        return centred * torch.rsqrt(torch.mean(centred * centred, -1, keepdim=True) + 1e-5)

    x, g = rand(5, 40), rand(5, 40)
    assert _looped_passes(check(two_levels, x, g, max_block=16)) == 2
    assert _looped_passes(check(deepest, x, max_block=16)) == 3
    xs = rand(2, 3, 6, 7).contiguous(memory_format=torch.channels_last)
    gs = rand(2, 3, 6, 7).contiguous(memory_format=torch.channels_last)

    def per_channel(a, b):
        masked = torch.where(a > 0, b, 0.0)
        return masked * 2, torch.sum(masked * a, (2, 3), keepdim=True)

    for kw in VARIANTS.values():
        check(per_channel, xs, gs, **kw)
    assert _looped_passes(check(per_channel, xs, gs, max_block=16)) == 1


@pytest.mark.parametrize("values", [[3.0, -7.5, 2.0, 0.5], [1.0, float("nan"), 3.0, 0.0],
                                    [-2, 9, 4, -9]], ids=["float", "nan", "int"])
def test_max_and_min_of_a_whole_tensor_run_as_kernels(values):
    """Before: ``torch.max(x)`` / ``x.min()`` with no dim had no Triton form, so a group
    such as ``x.abs().max() > 3`` (an outlier check) ran in eager; they are ``amax``/``amin``
    over every dim."""
    import fxlite

    def fn(x):
        return (x.abs().max() > 3, x.min() * 2, torch.max(x + 1))

    compiled = fxlite.compile(fn)
    base = torch.tensor(values, device=DEVICE)
    for k in range(3):  # fresh values each call
        x = base.roll(k) * (k + 1)
        got, want = compiled(x), fn(x)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, equal_nan=True)
    assert compiled.kernels and not compiled.fallbacks
