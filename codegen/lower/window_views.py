"""window_views: a row-wise norm before the views that cut its result into windows, and a
pointwise op on windows put back done in the windows' order.

Swin cuts its normalized map into windows with a view, a permute and a ``reshape`` that
copies, and puts the attention's windows back the same way before the residual add::

    x = layer_norm(h).view(B, H // 7, 7, W // 7, 7, C).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(-1, 49, C)                                  # a copy
    ...
    y = y.view(B, H // 7, W // 7, 7, 7, C).permute(0, 1, 3, 2, 4, 5)
    h = h + y.reshape(B, H, W, C)                             # a copy, then the add

Each copy is an eager kernel moving the whole map. A norm over the last dim computes each
row on its own, so it can run on the permuted view of its input (a kernel reads through
the strides) and the copying ``reshape`` becomes a view of its row-major result; a
pointwise op gives the same values in any order, so the add can run in the permuted
space, reading the windows where they are, and store row-major::

    # before                                    # after
    layer_norm = F.layer_norm(h, (C,), w, b)    view = h.view(B, 2, 7, 2, 7, C)
    view = layer_norm.view(B, 2, 7, 2, 7, C)    permute = view.permute(0, 1, 3, 2, 4, 5)
    permute = view.permute(0, 1, 3, 2, 4, 5)    layer_norm = F.layer_norm(permute, (C,), w, b)
    reshape = permute.reshape(-1, 49, C)        reshape = layer_norm.reshape(-1, 49, C)

    view_1 = y.view(B, 2, 2, 7, 7, C)           view_1 = y.view(B, 2, 2, 7, 7, C)
    permute_1 = view_1.permute(0, 1, 3, 2, 4, 5)  permute_1 = view_1.permute(0, 1, 3, 2, 4, 5)
    reshape_1 = permute_1.reshape(B, H, W, C)   view_2 = h.view(B, 2, 7, 2, 7, C)
    add = torch.add(h, reshape_1)               add = torch.add(view_2, permute_1)
                                                clone = torch.clone(add, memory_format=..)
                                                add_1 = clone.reshape(B, H, W, C)

Only in inference, only where the chain's links keep the last dim last and whole (its
rows), nothing else reads a link, the ``reshape`` at its end copies, and the norm's input
(or the add's other operands) is row-major; a zero ``pad`` and a slice that keeps every
value (Swin's, for maps that need no padding) are dropped from the chain. Windows of a
``roll`` are left to ``row_gathers`` (one gather of rows). Both results are
row-major as eager's were, and their values are eager's bit for bit: only the order in
which rows are visited changes.
"""

from __future__ import annotations

from typing import Any

import torch
from fxlite.passes.shape_prop import fill_missing_meta

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import is_impure, lookup, resolve
from fxlite.tensor_meta import TensorMetadata, strided_meta, views_as

__all__ = ["rows_through_windows"]

_NORMS = frozenset({"layer_norm", "rms_norm"})
_PADS = (torch.nn.functional.pad, torch._C._nn.pad)


def rows_through_windows(gm: GraphModule) -> GraphModule:
    """Move each last-dim norm whose result is cut into windows after the cut's views,
    and run each pointwise op that reads windows put back in the windows' order.

    Args:
        gm: a normalized graph with ShapeProp metadata (before ``decompose``), in which
            no node needs autograd.

    Returns:
        ``gm``, changed in place (and recompiled) where a copy went.
    """
    changed = False
    for n in list(gm.graph.nodes):
        if n._erased:
            continue
        changed = _norm_first(n, gm) or _pointwise_in_windows(n, gm) or changed
    if changed:
        fill_missing_meta(gm, strict=True)
        gm.recompile()
    return gm


# ---------------------------------------------------------------------- the two rewrites
def _norm_first(norm: Node, gm: GraphModule) -> bool:
    found = _resolved(norm, gm)
    if found is None or found[0].name not in _NORMS or is_impure(norm, gm):
        return False
    args = found[1]
    x, shape = args.get("input"), args.get("normalized_shape")
    xm, nm = strided_meta(x), strided_meta(norm)
    if xm is None or nm is None or not _row_major(xm) or not _row_major(nm) \
            or not isinstance(shape, (list, tuple)) or len(shape) != 1:
        return False
    chain = _windows_after(norm, gm)
    if chain is None:
        return False
    graph, value, width, made = gm.graph, x, nm.shape[-1], []
    with graph.inserting_before(chain[-1]):
        for link in chain[:-1]:
            if _link(link, gm, width) != "identity":
                value = graph.node_copy(link, lambda a, v=value, s=link.args[0]: v if a is s else a)
                made.append(value)
        new_norm = graph.node_copy(norm, lambda a, v=value: v if a is x else a)
        last = chain[-1]
        new_last = graph.node_copy(last, lambda a, v=new_norm, s=last.args[0]: v if a is s else a)
    for node in (*made, new_norm, new_last):
        node.meta = {}
    new_last.meta = dict(last.meta)
    last.replace_all_uses_with(new_last)
    for node in reversed([norm, *chain]):
        graph.erase_node(node)
    return True


def _pointwise_in_windows(op: Node, gm: GraphModule) -> bool:
    info = lookup(op, gm) if op.op in ("call_function", "call_method") else None
    om = strided_meta(op)
    if info is None or info.kind != "pointwise" or is_impure(op, gm) or om is None \
            or not _row_major(om):
        return False
    for windows in op.all_input_nodes:
        chain = _windows_before(windows, gm)
        if chain is None:
            continue
        permuted = chain[-1].args[0]  # what the copying reshape read
        pm, shape = strided_meta(permuted), tuple(om.shape)
        others = [i for i in op.all_input_nodes if i is not windows]
        if tuple(strided_meta(windows).shape) != shape or not all(
                _shaped(strided_meta(o), shape) and views_as(strided_meta(o), pm.shape)
                for o in others):
            continue
        graph = gm.graph
        with graph.inserting_before(op):
            views = {o: graph.call_method("view", (o, tuple(pm.shape))) for o in others}
            new_op = graph.node_copy(op, lambda a, w=windows, p=permuted, v=views:
                                     p if a is w else v.get(a, a))
            clone = graph.call_function(torch.clone, (new_op,),
                                        {"memory_format": torch.contiguous_format})
            back = graph.call_method("reshape", (clone, shape))
        for node in (*views.values(), new_op, clone):
            node.meta = {}
        back.meta = dict(op.meta)
        op.replace_all_uses_with(back)
        graph.erase_node(op)
        for node in chain:
            graph.erase_node(node)
        return True
    return False


# ---------------------------------------------------------------------- chains
def _windows_after(norm: Node, gm: GraphModule) -> list[Node] | None:
    """The links from ``norm``'s sole reader to a copying ``reshape``, each read once,
    each keeping the last dim last and whole; None if there is no such chain."""
    chain, n, width = [], norm, strided_meta(norm).shape[-1]
    while len(n.users) == 1:
        n = next(iter(n.users))
        kind = _link(n, gm, width)
        if kind is None:
            return None
        chain.append(n)
        if kind == "copy":
            return chain
    return None


def _windows_before(n: Node, gm: GraphModule) -> list[Node] | None:
    """For ``n`` read once: ``[identities..., reshape]`` (readers first) when ``n`` is a
    copying ``reshape`` (or links that drop nothing after one) of a permuted view keeping
    the last dim; None otherwise."""
    chain = []
    width = strided_meta(n).shape[-1] if strided_meta(n) is not None and strided_meta(n).shape else None
    while width is not None and len(n.users) == 1 and _link(n, gm, width) == "identity":
        chain.append(n)
        n = n.args[0]
    if width is None or len(n.users) != 1 or _link(n, gm, width) != "copy":
        return None
    source = n.args[0]
    if strided_meta(source) is None or _permute_keeping_last(source, gm) is None \
            or _rolled(source, gm, width):
        return None
    return [*chain, n]


def _rolled(n: Node, gm: GraphModule, width: int) -> bool:
    """Whether the views below ``n`` start at a ``roll``: ``row_gathers`` makes that chain
    one gather (a kernel); the windows' reader then reads the gather's rows."""
    while isinstance(n, Node) and _link(n, gm, width) in ("view", "identity"):
        n = n.args[0]
    return isinstance(n, Node) and n.target in (torch.roll, torch.Tensor.roll, "roll")


def _link(n: Node, gm: GraphModule, width: int) -> str | None:
    """What ``n`` is in a chain of windows of rows ``width`` wide: "view" (a view or
    permute that keeps the last dim last and whole), "identity" (a zero pad, a slice that
    keeps every value, a row-major copy of a row-major value), "copy" (a ``reshape`` that
    copies), or None."""
    found = _resolved(n, gm)
    src = n.args[0] if n.args else None
    nm, sm = strided_meta(n), strided_meta(src)
    if nm is None or sm is None or not nm.shape or nm.shape[-1] != width \
            or sm.shape[-1] != width or n.op != "call_function" and found is None:
        return None
    if found is None:  # F.pad is no op of the table: eager's, as the graph records it
        pads = n.args[1] if len(n.args) > 1 else n.kwargs.get("pad")
        return "identity" if n.target in _PADS and isinstance(pads, (list, tuple)) \
            and not any(pads) and n.kwargs.get("mode", "constant") == "constant" else None
    if is_impure(n, gm):
        return None
    name = found[0].name
    if any(i is not src for i in n.all_input_nodes):  # sizes or indices that are values
        return None
    same = tuple(nm.shape) == tuple(sm.shape) and tuple(nm.stride) == tuple(sm.stride)
    if name == "getitem" and same or name == "contiguous" and same and _row_major(sm):
        return "identity"
    if name == "permute":
        return "view" if _permute_keeping_last(n, gm) is not None else None
    if name in ("view", "reshape"):
        if _row_major(sm) or views_as(sm, nm.shape):
            return "view"
        return "copy" if name == "reshape" and _row_major(nm) else None
    return None


def _permute_keeping_last(n: Node, gm: GraphModule) -> tuple[int, ...] | None:
    found = _resolved(n, gm)
    if found is None or found[0].name != "permute":
        return None
    dims, rank = found[1].get("dims"), len(strided_meta(n).shape)
    if not isinstance(dims, (list, tuple)) or not dims or dims[-1] % rank != rank - 1:
        return None
    return tuple(dims)


# ---------------------------------------------------------------------- helpers
def _resolved(n: Any, gm: GraphModule) -> Any:
    return resolve(n, gm) if isinstance(n, Node) and n.op in ("call_function", "call_method") \
        else None


def _row_major(tm: TensorMetadata) -> bool:
    return tm.memory_format == torch.contiguous_format


def _shaped(tm: TensorMetadata | None, shape: tuple[int, ...]) -> bool:
    return tm is not None and tuple(tm.shape) == shape

