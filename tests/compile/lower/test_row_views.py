"""A softmax over the last dim of a view runs before the view (``codegen/lower/row_views.py``):
the masked add before it and the softmax share one kernel, with eager's values and
gradients over several calls; where the move could change a value or a layout, it is not
made."""

from __future__ import annotations

from test_triton_kernels import DEVICE  # isort: skip  (sets TRITON_INTERPRET on CPU)

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.lower.row_views import softmax_before_views
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _masked(scores, mask):
    # transformers' LED / MVP / SpeechT5 attention, and Swin's shifted windows
    attn = scores.view(2, 3, 5, 5) + mask
    return attn.view(6, 5, 5).softmax(-1)


def _masked_log(scores, mask):
    attn = scores.view(2, 3, 5, 5) + mask
    return F.log_softmax(attn.reshape(6, 5, 5), dim=2)


def _prepared(fn, *args):
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*args)
    return normalize(gm)


def _ops(gm):
    return [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("fn", [_masked, _masked_log])
def test_the_softmax_runs_before_the_view(fn):
    scores, mask = torch.randn(6, 5, 5), torch.randn(2, 1, 5, 5)
    gm = softmax_before_views(_prepared(fn, scores, mask))
    ops = _ops(gm)
    assert ops.index("add") < next(i for i, o in enumerate(ops) if "softmax" in o) < max(
        i for i, o in enumerate(ops) if o in ("view", "reshape")), gm.code
    torch.testing.assert_close(gm(scores, mask), fn(scores, mask))


def _transposed(scores, mask):  # the view's input is not row-major: reshape copies
    return (scores.transpose(1, 2) + mask).reshape(6, 5, 5).softmax(-1)


def _other_dim(scores, mask):
    return (scores.view(2, 3, 5, 5) + mask).view(6, 5, 5).softmax(1)


def _last_dim_changes(scores, mask):
    return (scores.view(2, 3, 5, 5) + mask).view(6, 25).softmax(-1)


def _view_read_twice(scores, mask):
    v = (scores.view(2, 3, 5, 5) + mask).view(6, 5, 5)
    return v.softmax(-1), v


def test_a_view_read_twice_stays_for_its_other_reader():
    scores, mask = torch.randn(6, 5, 5), torch.randn(2, 1, 5, 5)
    gm = softmax_before_views(_prepared(_view_read_twice, scores, mask))
    softmax = next(n for n in gm.graph.nodes if "softmax" in str(n.target))
    assert len(softmax.args[0].meta["tensor_meta"].shape) == 4, gm.code  # before the view
    assert sum("view" in str(n.target) for n in gm.graph.nodes) == 3, gm.code  # two views
    for got, want in zip(gm(scores, mask), _view_read_twice(scores, mask)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("fn", [_transposed, _other_dim, _last_dim_changes])
def test_the_softmax_stays_after_a_view_it_cannot_precede(fn):
    scores = torch.randn(2, 5, 3, 5) if fn is _transposed else torch.randn(6, 5, 5)
    gm = _prepared(fn, scores, torch.randn(2, 1, 5, 5))
    before = gm.code
    assert softmax_before_views(gm).code == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_softmax_is_one_kernel_with_eager_s_values_and_gradients(dtype):
    compiled = fxlite.compile(_masked)
    mask = torch.randn(2, 1, 5, 5, device=DEVICE).to(dtype)
    for k in range(3):
        scores = torch.randn(6, 5, 5, device=DEVICE, dtype=dtype, requires_grad=True)
        ref = scores.detach().clone().requires_grad_()
        mask[..., k] = float("-inf")  # a masked column, changed between calls
        out, want = compiled(scores, mask), _masked(ref, mask)
        weights = torch.randn_like(want)
        (out * weights).sum().backward()
        (want * weights).sum().backward()
        # bfloat16: the kernel keeps the masked scores in float32 for the softmax, where
        # eager rounds them first (and its backward rounds each op)
        tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 4e-3}
        torch.testing.assert_close(out, want, **tol)
        torch.testing.assert_close(scores.grad, ref.grad, **tol)
    with torch.no_grad():
        inference = fxlite.compile(_masked)
        for _ in range(2):
            scores = torch.randn(6, 5, 5, device=DEVICE, dtype=dtype)
            torch.testing.assert_close(inference(scores, mask), _masked(scores, mask), **tol)
    (kernel,) = inference.kernels  # the add and the softmax's max, exp, sum and division
    assert len(kernel.nodes) > 4, kernel.nodes
