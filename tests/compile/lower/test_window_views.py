"""A last-dim norm before the views that cut its result into windows, and a pointwise op
on windows put back done in the windows' order (``codegen/lower/window_views.py``), with
the norm after such an op moved before its view (``row_views``): eager's values bit for
bit, row-major results, and the chains that must stay."""

from __future__ import annotations

from test_triton_kernels import DEVICE  # isort: skip  (sets TRITON_INTERPRET on CPU)

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.lower.row_views import softmax_before_views
from fxlite.codegen.lower.window_views import rows_through_windows
from fxlite.passes.decompose import decompose
from fxlite.passes.fuse import fuse
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _cut_at(n, hh, ww, c):
    def cut(h, w, b):  # Swin: normalize, pad by nothing, cut into 2x2 windows
        x = F.pad(F.layer_norm(h, (c,), w, b), (0, 0, 0, 0, 0, 0))
        x = x.view(n, hh // 2, 2, ww // 2, 2, c).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(-1, 4, c) * 2
    return cut


def _back_at(n, hh, ww, c):
    def back(y, h, w, b):  # windows put back, the full slice, the residual add, the next norm
        y = y.view(n, hh // 2, ww // 2, 2, 2, c).permute(0, 1, 3, 2, 4, 5)
        h = h + y.reshape(n, hh, ww, c)[:, :hh, :ww, :].contiguous()
        return h, F.layer_norm(h, (c,), w, b)
    return back


_cut, _back = _cut_at(2, 4, 6, 3), _back_at(2, 4, 6, 3)


def _args(name, c=3):
    h = torch.randn(2, 4, 6, c)
    w, b = torch.randn(c), torch.randn(c)
    return (h, w, b) if name == "cut" else (torch.randn(12, 4, c), h, w, b)


CASES = {"cut": _cut, "back": _back}


def _prepared(fn, *args):
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*args)
    return normalize(gm)


def _rewritten(fn, *args):
    return softmax_before_views(rows_through_windows(_prepared(fn, *args)))


def _targets(gm):
    return [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_copy_is_left_and_values_are_eagers_bit_for_bit(case):
    fn = CASES[case]
    gm = _rewritten(fn, *_args(case))
    ln = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "layer_norm"]
    assert len(ln) == 1 and _targets(gm).count("permute") == 1, gm.code
    assert "pad" not in _targets(gm) and "getitem" not in _targets(gm), gm.code
    # the norm reads the windows (cut) or the sum in the windows' order (back)
    assert len(ln[0].args[0].meta["tensor_meta"].shape) == 6, gm.code
    for _ in range(2):
        args = _args(case)
        got, want = gm(*args), fn(*args)
        for g, v in zip(got if isinstance(got, tuple) else [got],
                        want if isinstance(want, tuple) else [want]):
            assert g.is_contiguous() and g.shape == v.shape
            torch.testing.assert_close(g, v, rtol=0, atol=0)


def test_the_add_and_the_next_norm_share_a_kernel_again():
    args = _args("back")
    gm = decompose(_rewritten(_back, *args))
    ShapeProp(gm).propagate(*args)
    fused = fuse(gm)
    groups = [fused.get_submodule(n.target).meta["nodes"] for n in fused.graph.nodes
              if n.op == "call_module"]
    assert len(groups) == 1, groups  # the add and the norm; no copy of the windows
    for got, want in zip(fused(*args), _back(*args)):
        torch.testing.assert_close(got, want)


def _last_dim_moves(h, w, b):  # windows that split the last dim: rows do not stay whole
    x = F.layer_norm(h, (6,), w, b)
    return x.view(2, 2, 2, 6, 2, 3).permute(0, 1, 3, 2, 4, 5).reshape(-1, 3)


def _read_twice(h, w, b):
    x = F.layer_norm(h, (3,), w, b)
    return x.view(2, 2, 2, 3, 2, 3).permute(0, 1, 3, 2, 5, 4).reshape(-1, 3), x


def _two_dims(h, w, b):  # a norm over the last two dims: its rows are not the last dim
    x = F.layer_norm(h, (6, 3))
    return x.view(2, 2, 2, 6, 3).permute(0, 1, 3, 2, 4).reshape(-1, 2, 3) + w


def _strided_other(y, h, w, b):  # the add's other operand is not row-major
    y = y.view(2, 2, 3, 2, 2, 3).permute(0, 1, 3, 2, 4, 5).reshape(2, 4, 6, 3)
    return h + y


def _broadcast_other(y, h, w, b):  # a per-channel operand: broadcast, left alone
    y = y.view(2, 2, 3, 2, 2, 3).permute(0, 1, 3, 2, 4, 5).reshape(2, 4, 6, 3)
    return y * w


def _rolled_windows(y, h, w, b):  # windows of a roll: row_gathers' (one gather of rows)
    y = torch.roll(y.view(2, 2, 3, 2, 2, 3), (1, 1), (1, 2))
    return h + y.permute(0, 1, 3, 2, 4, 5).reshape(2, 4, 6, 3)


@pytest.mark.parametrize("fn,case", [(_last_dim_moves, "cut"), (_read_twice, "cut"),
                                     (_two_dims, "cut"), (_strided_other, "back"),
                                     (_broadcast_other, "back"), (_rolled_windows, "back")])
def test_chains_that_would_change_rows_or_layouts_stay(fn, case):
    args = _args(case, c=6 if fn is _last_dim_moves else 3)
    if fn is _strided_other:
        args = (args[0], torch.randn(2, 6, 4, 3).transpose(1, 2), *args[2:])
    gm = _prepared(fn, *args)
    before = gm.code
    assert rows_through_windows(gm).code == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_windows_are_eagers_over_calls_and_shapes_and_training_matches(dtype):
    def block(h, y, w, b):
        n, hh, ww, c = h.shape
        return _cut_at(n, hh, ww, c)(h, w, b), *_back_at(n, hh, ww, c)(y, h, w, b)

    compiled = fxlite.compile(block)
    with torch.no_grad():
        for n, hh, ww in [(2, 4, 6), (2, 4, 6), (1, 6, 4)]:
            h = torch.randn(n, hh, ww, 3, device=DEVICE, dtype=dtype)
            y = torch.randn(n * hh * ww // 4, 4, 3, device=DEVICE, dtype=dtype)
            w, b = (torch.randn(3, device=DEVICE, dtype=dtype) for _ in range(2))
            for got, want in zip(compiled(h, y, w, b), block(h, y, w, b)):
                assert got.is_contiguous()
                torch.testing.assert_close(got, want)
    assert not compiled.fallbacks
    h = torch.randn(2, 4, 6, 3, device=DEVICE, requires_grad=True)
    y, w, b = torch.randn(12, 4, 3, device=DEVICE), torch.randn(3, device=DEVICE), \
        torch.randn(3, device=DEVICE)
    ref = h.detach().clone().requires_grad_()
    sum(t.sum() for t in compiled(h, y, w, b)).backward()
    sum(t.sum() for t in block(ref, y, w, b)).backward()
    torch.testing.assert_close(h.grad, ref.grad, rtol=1e-4, atol=1e-4)
