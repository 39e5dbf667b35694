"""A ``contiguous()`` copy of a permuted pointwise result joins that op's kernel
(``passes/sink_views.py``): the kernel stores the result row-major, where eager's copy
kernel ran after it (T5's head merge, ``o.to(dtype).transpose(1, 2).contiguous()``).
Eager's values, gradients and layouts over several calls; where the op's value is read
elsewhere, or the op is a norm's tail, the copy stays."""

from __future__ import annotations

from test_triton_kernels import DEVICE  # isort: skip  (sets TRITON_INTERPRET on CPU)

import pytest
import torch
import torch.nn.functional as F
from fxlite.passes.decompose import decompose
from fxlite.passes.fuse import fuse
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp, fill_missing_meta

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _head_merge(a, b, w):
    o = (a @ b).to(torch.bfloat16)          # (B, H, S, D)
    o = o.transpose(1, 2).contiguous()      # (B, S, H, D): eager copies here
    return F.linear(o.reshape(o.shape[0], o.shape[1], -1), w)


def _scaled_merge(a, b, w):
    o = (a @ b) * 0.5
    o = o.transpose(1, 2).contiguous()
    return F.linear(o.reshape(o.shape[0], o.shape[1], -1), w)


def _returned(x):
    return (x * 2 + 1).permute(2, 0, 1).contiguous()


def _read_twice(x):
    y = x * 2
    return y.transpose(0, 1).contiguous(), y


def _norm_tail(x):
    return F.layer_norm(x, (x.shape[-1],)).transpose(0, 1).contiguous()


def _channels_last(x):
    return (x * 2).permute(0, 1, 3, 2).contiguous(memory_format=torch.channels_last)


def _fused_ops(fn, *args):
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*args)
    work = decompose(normalize(gm))
    fill_missing_meta(work)
    fused = fuse(work)
    return [getattr(n.target, "__name__", n.target) for n in fused.graph.nodes
            if n.op in ("call_function", "call_method")]


def test_the_copy_leaves_the_graph_for_the_ops_kernel():
    a, b, w = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 16), torch.randn(64, 64)
    assert "contiguous" not in _fused_ops(_head_merge, a, b, w.to(torch.bfloat16))
    assert "contiguous" not in _fused_ops(_scaled_merge, a, b, w)
    assert "contiguous" not in _fused_ops(_returned, torch.randn(3, 4, 5))


@pytest.mark.parametrize("fn", [_read_twice, _norm_tail, _channels_last])
def test_the_copy_stays_where_the_op_cannot_take_it(fn):
    assert "contiguous" in _fused_ops(fn, torch.randn(3, 4, 5, 6)[..., 0] if fn is not
                                      _channels_last else torch.randn(2, 3, 4, 5))


@pytest.mark.parametrize("fn", [_head_merge, _scaled_merge])
def test_head_merge_is_one_kernel_with_eagers_values(fn):
    dtype = torch.bfloat16 if fn is _head_merge else torch.float32
    w = torch.randn(64, 64, device=DEVICE, dtype=dtype)
    op = "to" if fn is _head_merge else "mul"
    with torch.no_grad():
        compiled = fxlite.compile(fn)
        # fresh inputs each call; then one head, whose transpose(1, 2) swaps a size-1 dim:
        # already row-major, where eager's contiguous() copies nothing
        for heads in (4, 4, 1):
            a = torch.randn(2, heads, 8, 8, device=DEVICE)
            b = torch.randn(2, heads, 8, 64 // heads, device=DEVICE)
            torch.testing.assert_close(compiled(a, b, w), fn(a, b, w))
            if heads == 4:
                (kernel,) = [k for k in compiled.kernels
                             if any(n.startswith(op) for n in k.nodes)]
                assert "clone" in kernel.nodes, kernel.nodes  # the copy is its store


def test_a_returned_copy_is_row_major_and_its_own_memory_over_calls_and_gradients():
    compiled = fxlite.compile(_returned)
    for _ in range(3):
        x = torch.randn(3, 4, 5, device=DEVICE, requires_grad=True)
        ref = x.detach().clone().requires_grad_()
        out, want = compiled(x), _returned(ref)
        assert out.is_contiguous() and out.shape == want.shape
        torch.testing.assert_close(out, want)
        g = torch.randn_like(want)
        (out * g).sum().backward()
        (want * g).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad)
        with torch.no_grad():
            out.zero_()  # the caller owns it: nothing fxlite keeps may change
        torch.testing.assert_close(compiled(x), _returned(ref))


@pytest.mark.parametrize("fn", [_read_twice, _norm_tail])
def test_copies_that_stay_keep_eagers_values(fn):
    compiled = fxlite.compile(fn)
    for _ in range(3):
        x = torch.randn(4, 6, device=DEVICE)
        got, want = compiled(x), fn(x)
        torch.testing.assert_close(got, want)
