"""max_pool2d's Triton kernel (codegen/kernels/pool.py) against eager, under the interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.kernels.pool import max_pool2d, use_pool_kernels
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
