"""The pooling Triton kernels (codegen/kernels/pool.py) against eager, under the interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.kernels.pool import avg_pool2d, max_pool2d, use_pool_kernels
from fxlite.codegen.runtime.kernel import interpreting

import fxlite

pytestmark = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def _same(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got.shape == want.shape and got.stride() == want.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("args", [
    dict(kernel_size=3, stride=2, padding=1),                 # resnet's stem
    dict(kernel_size=2),                                      # stride defaults to the kernel
    dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 0)),
    dict(kernel_size=3, stride=2, ceil_mode=True),            # googlenet's
    dict(kernel_size=3, stride=1, padding=1, dilation=2),
])
def test_the_kernel_gives_eagers_values_and_layout(dtype, layout, args):
    x = torch.randn(2, 5, 9, 7, device=DEVICE).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x[0, 1, 2, 3] = float("nan")
    x[1, 4] = float("-inf")   # a whole channel of -inf
    x[1, 0, 0, 0] = float("inf")
    _same(max_pool2d(x, **args), F.max_pool2d(x, **args))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_many_programs(layout):
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 8, 40, 41, device=DEVICE).contiguous(memory_format=fmt)
    for _ in range(2):  # a fresh input on a second call
        _same(max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 3, 2, 1))
        x = torch.randn_like(x)


def test_what_the_kernel_does_not_take_runs_torchs_op():
    x = torch.randn(1, 3, 8, 8, device=DEVICE)
    out, idx = max_pool2d(x, 2, return_indices=True)  # indices wanted
    want, want_idx = F.max_pool2d(x, 2, return_indices=True)
    _same(out, want)
    assert torch.equal(idx, want_idx)
    for odd in (x[:, :, ::2], x.transpose(2, 3), x[0]):  # strided, transposed, unbatched
        _same(max_pool2d(odd, 2), F.max_pool2d(odd, 2))
    empty = torch.randn(0, 3, 8, 8, device=DEVICE)
    _same(max_pool2d(empty, 2), F.max_pool2d(empty, 2))
    with pytest.raises(RuntimeError, match="pad should be"):
        max_pool2d(x, 2, padding=2)       # eager's own error
    w = torch.randn(1, 2, 6, 6, device=DEVICE, requires_grad=True)
    max_pool2d(w, 2).sum().backward()     # autograd records torch's op
    assert w.grad is not None and int((w.grad != 0).sum()) == 2 * 9


def test_the_pass_routes_max_pools_and_the_model_stays_eagers():
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                            torch.nn.MaxPool2d(3, 2, 1)).to(DEVICE).eval()
    gm = fxlite.symbolic_trace(lambda x: F.max_pool2d(torch.relu(x), 3, 2, 1))
    assert use_pool_kernels(gm) and "max_pool2d" in gm.code
    x = torch.randn(2, 4, 10, 10, device=DEVICE)
    _same(gm(x), F.max_pool2d(torch.relu(x), 3, 2, 1))
    traced = fxlite.symbolic_trace(m)
    assert not use_pool_kernels(traced)  # a module call: left as it is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("args", [
    dict(kernel_size=2, stride=2, ceil_mode=True, count_include_pad=False),  # resnet50d's
    dict(kernel_size=3, stride=1, padding=1),                      # inception_v3's branches
    dict(kernel_size=3, stride=1, padding=1, count_include_pad=False),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 1), ceil_mode=True),
    dict(kernel_size=3, stride=2, padding=1, divisor_override=5),
    dict(kernel_size=2),                                           # densenet's transitions
])
def test_the_average_kernel_gives_eagers_values_to_the_bit_and_layout(dtype, layout, args):
    """Before: ``avg_pool2d`` ran torch's kernel, which on channels-last inputs took twice
    its time on contiguous ones (resnet50d, H200). Each window sums in eager's order and
    precision and divides by eager's count, so the values are eager's to the bit."""
    x = torch.randn(2, 5, 9, 7, device=DEVICE).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x[0, 1, 2, 3] = float("nan")
    x[1, 0, 0, 0] = float("inf")
    _same(avg_pool2d(x, **args), F.avg_pool2d(x, **args))


def test_what_the_average_kernel_does_not_take_runs_torchs_op():
    x = torch.randn(1, 3, 8, 8, device=DEVICE)
    for odd in (x[:, :, ::2], x.transpose(2, 3), x[0]):  # strided, transposed, unbatched
        _same(avg_pool2d(odd, 2), F.avg_pool2d(odd, 2))
    _same(avg_pool2d(x, 2, divisor_override=None), F.avg_pool2d(x, 2))
    empty = torch.randn(0, 3, 8, 8, device=DEVICE)
    _same(avg_pool2d(empty, 2), F.avg_pool2d(empty, 2))
    with pytest.raises(RuntimeError, match="pad should be"):
        avg_pool2d(x, 2, padding=2)       # eager's own errors
    with pytest.raises(RuntimeError, match="divisor must be not zero"):
        avg_pool2d(x, 2, divisor_override=0)
    w = torch.randn(1, 2, 6, 6, device=DEVICE, requires_grad=True)
    avg_pool2d(w, 2).sum().backward()     # autograd records torch's op
    torch.testing.assert_close(w.grad, torch.full_like(w, 0.25))


def test_compiled_average_pools_stay_eagers_over_calls():
    """The pass routes ``F.avg_pool2d`` and ``nn.AvgPool2d`` (recorded as the function) to
    the kernel on a GPU; on the CPU the pipeline leaves pools to torch."""
    gm = fxlite.symbolic_trace(lambda x: F.avg_pool2d(torch.relu(x), 2, ceil_mode=True))
    assert use_pool_kernels(gm) and "avg_pool2d" in gm.code
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                            torch.nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
                            ).to(DEVICE).eval()
    compiled = fxlite.compile(m)
    for k in range(3):  # fresh inputs, odd sizes for ceil_mode
        x = torch.randn(2, 3, 11 + k, 9, device=DEVICE)
        with torch.no_grad():
            _same(gm(x), F.avg_pool2d(torch.relu(x), 2, ceil_mode=True))
            torch.testing.assert_close(compiled(x), m(x))


def test_later_calls_reuse_the_launch_only_for_the_same_key():
    """On CUDA a pool's second call on a shape reuses the first call's binary (no Triton
    dispatch); a call that differs in strides, alignment, arguments or their types (eager
    takes ``1`` and rejects ``True``) does not, and every call gives eager's values."""
    from fxlite.codegen.kernels import pool

    base = torch.randn(2, 4, 9, 8, device=DEVICE)
    for _ in range(2):  # fresh values on the second call
        x = torch.randn_like(base)
        _same(avg_pool2d(x, 2, ceil_mode=True), F.avg_pool2d(x, 2, ceil_mode=True))
        _same(max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 3, 2, 1))
    keys = [k for k in pool._PREPARED if k[1] == base.shape]
    assert len(keys) == (2 if DEVICE == "cuda" else 0)  # the interpreter has no binaries
    flat = torch.randn(1 + base.numel(), device=DEVICE)
    shifted = flat[1:].view(base.shape)  # same shape and strides, 4 bytes off alignment
    _same(max_pool2d(shifted, 3, 2, 1), F.max_pool2d(shifted, 3, 2, 1))
    cl = base.contiguous(memory_format=torch.channels_last)
    _same(max_pool2d(cl, 3, 2, 1), F.max_pool2d(cl, 3, 2, 1))
    _same(avg_pool2d(base, 2, ceil_mode=False), F.avg_pool2d(base, 2, ceil_mode=False))
    _same(avg_pool2d(base, 2, divisor_override=1), F.avg_pool2d(base, 2, divisor_override=1))
    with pytest.raises(TypeError, match="must be int, not bool"):
        avg_pool2d(base, 2, divisor_override=True)
    w = base.clone().requires_grad_()
    avg_pool2d(w, 2, ceil_mode=True).sum().backward()  # autograd records torch's op
    assert w.grad is not None


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_precompile_plans_the_launch_each_pool_makes(layout):
    """The parallel precompile compiles the pools' kernels ahead, from the graph's
    metadata (it once left them to the first call): planned on meta tensors, each launch
    is the one the call makes on the real input."""
    from fxlite.codegen.kernels import pool
    from fxlite.codegen.runtime import precompile as pre
    from fxlite.passes.shape_prop import ShapeProp

    def fn(x):
        y = F.max_pool2d(x, 3, 2, 1)
        return F.avg_pool2d(y, 2, ceil_mode=True), F.max_pool2d(x, 2, return_indices=True)[0]

    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 4, 9, 11, device=DEVICE).contiguous(memory_format=fmt)
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(x)
    assert use_pool_kernels(gm)
    jobs, _, _, _ = pre._plan(gm, torch.device(DEVICE))
    y = F.max_pool2d(x, 3, 2, 1)
    launches = [pool._max_call(x, 3, 2, 1)[0].arguments(x, DH=1, DW=1),
                pool._avg_call(y, 2, ceil_mode=True)[0].arguments(
                    y, INCLUDE_PAD=True, DIVISOR=0, ROUND_BF16=False)]
    assert len(jobs) == 2  # the pool that returns indices runs torch's op
    for (fn_, args, grid, constexprs, warps), (want_grid, values, want_constexprs) in zip(
            jobs.values(), launches):
        assert fn_ in (pool._max_pool2d_kernel, pool._avg_pool2d_kernel)
        assert args[2:] == list(values) and grid == want_grid and constexprs == want_constexprs
