"""row_views: a softmax over the last dim of a view runs before the view instead.

Attention written as ``(scores.view(b, h, t, s) + mask).view(b * h, t, s).softmax(-1)``
(Swin's shifted windows, and transformers' LED, MVP, SpeechT5, XGLM...) puts a view
between the masked add and the softmax: the two cannot share a kernel (a group iterates
one shape), so the masked scores make a round trip through memory and a launch of their
own. A softmax normalizes each row of its last dim on its own, and a view that keeps the
last dim keeps the rows, so the softmax can run first, on the view's input; the view then
reads its (row-major) result::

    # before                                   # after
    add = torch.add(view, mask)                 add = torch.add(view, mask)
    view_1 = add.view(-1, 3, 49, 49)            softmax = torch.softmax(add, -1)
    softmax = torch.softmax(view_1, -1)         view_1 = softmax.view(-1, 3, 49, 49)

Only where the view's input is row-major (the softmax's result is, so the view stays a
view of the same values); ``log_softmax`` likewise, and ``layer_norm`` and ``rms_norm``
over the last dim alone (Swin's norm after its windows are put back in a residual add,
``codegen/lower/window_views.py``: the add and the norm share a kernel again). A view
that something else reads stays for it.
"""

from __future__ import annotations

import torch
from fxlite.passes.shape_prop import fill_missing_meta

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import canonical_args, is_impure, lookup
from fxlite.tensor_meta import strided_meta

__all__ = ["softmax_before_views"]

_NORMS = frozenset({"layer_norm", "rms_norm"})
_ROW_OPS = frozenset({"softmax", "log_softmax"}) | _NORMS
_VIEWS = frozenset({"view", "reshape"})


def softmax_before_views(gm: GraphModule) -> GraphModule:
    """Run each softmax (or norm) over the last dim of a view (that keeps the last dim)
    on the view's row-major input, and view its result instead.

    Args:
        gm: a normalized graph with ShapeProp metadata (before ``decompose``).

    Returns:
        ``gm``, changed in place (and recompiled) where a softmax moved.
    """
    moved = False
    for op in list(gm.graph.nodes):
        view = _moving_view(op, gm)
        if view is None:
            continue
        source = view.args[0]
        with gm.graph.inserting_before(view):
            new_op = gm.graph.node_copy(op, lambda a, v=view, s=source: s if a is v else a)
        new_op.meta = {k: v for k, v in op.meta.items() if k not in ("tensor_meta", "type")}
        if lookup(op, gm).name not in _NORMS:
            _last_dim(new_op)
        with gm.graph.inserting_after(op):
            new_view = gm.graph.node_copy(view, lambda a, s=source, n=new_op: n if a is s else a)
        new_view.meta = dict(op.meta)  # the softmax's value, as it was
        op.replace_all_uses_with(new_view)
        gm.graph.erase_node(op)
        if not view.users:  # (another reader keeps it)
            gm.graph.erase_node(view)
        moved = True
    if moved:
        fill_missing_meta(gm, strict=True)
        gm.recompile()
    return gm


def _moving_view(op: Node, gm: GraphModule) -> Node | None:
    """The view ``op`` (a softmax over the last dim) reads, where it can run before it."""
    info = lookup(op, gm) if op.op in ("call_function", "call_method") else None
    if info is None or info.name not in _ROW_OPS or is_impure(op, gm):
        return None
    args = canonical_args(op, info, gm)
    view, dim = args.get("input"), args.get("dim")
    vm, om = strided_meta(view), strided_meta(op)
    if vm is None or om is None:
        return None
    if info.name in _NORMS:  # over the last dim alone
        shape = args.get("normalized_shape")
        if not isinstance(shape, (list, tuple)) or len(shape) != 1:
            return None
    elif type(dim) is not int or dim not in (-1, len(vm.shape) - 1):
        return None
    vinfo = lookup(view, gm) if view.op in ("call_function", "call_method") else None
    if vinfo is None or vinfo.name not in _VIEWS or is_impure(view, gm):
        return None
    source = view.args[0] if view.args else None
    sm = strided_meta(source)
    if sm is None or sm.memory_format != torch.contiguous_format or not sm.shape \
            or sm.shape[-1] != vm.shape[-1] or vm.memory_format != torch.contiguous_format \
            or om.memory_format != torch.contiguous_format:
        return None
    return view


def _last_dim(op: Node) -> None:
    """Make ``op``'s dim the last one, counted from the end (its input's rank changed)."""
    if "dim" in op.kwargs:
        op.kwargs = {**op.kwargs, "dim": -1}
    else:
        op.args = (op.args[0], -1, *op.args[2:])
