"""sink_views: move permutes and transposes above the pointwise ops they follow.

A permute is a view: free on its own, but the fusion partitioner cannot put a value and
its permuted view in one kernel, so ``permute(x + b)`` followed by more pointwise ops is
two kernels with a round trip through memory between them. Pointwise ops commute with
permutes, so the permute can move onto the op's inputs instead, where it is only a
different way to index a kernel's loads::

    # before                                    # after
    add = torch.add(mm, bias)                   permute_1 = torch.permute(mm, (0, 3, 1, 2))
    permute = torch.permute(add, (0, 3, 1, 2))  unsqueeze = torch.unsqueeze(bias, 0) ...
    mul = torch.mul(permute, scale)             permute_2 = torch.permute(unsqueeze_2, (0, 3, 1, 2))
                                                add = torch.add(permute_1, permute_2)
                                                mul = torch.mul(add, scale)   # one group now

A permute sinks through a pointwise op only when the op has no other user (its unpermuted
value is not needed), and only when the permute feeds an op that can join a kernel; then
it keeps sinking through the op's producers. It never sinks into the tail of a reduction
(a norm's scale and shift): the tail would then iterate in another order than its
reduction and leave its kernel, a second pass over the values (convnext_tiny's stem
LayerNorm2d ran as two kernels). The op that takes the permute's place keeps the layout
eager gave the permute's result, so a kernel writing it writes eager's strides. Inputs of lower rank first get leading size-1 dims up to
the op's rank (broadcasting aligns them on the right), 0-d tensors and Python scalars stay
as they are. No size is written into the graph, so it stays valid after a resize.

A row-major ``contiguous()`` of such a permute is a copy eager runs after the op (T5's
head merge after attention). It becomes a clone into row-major, a kernel's op, so that the
permute sinks and the clone joins the op's kernel, which stores its result row-major::

    # before                                    # after
    to = torch.to(matmul, torch.bfloat16)       transpose = torch.permute(matmul, (0, 2, 1, 3))
    transpose = torch.transpose(to, 1, 2)       to = torch.to(transpose, torch.bfloat16)
    contiguous = transpose.contiguous()         clone = torch.clone(to, memory_format=..)
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import Node, map_arg
from fxlite.ops import is_impure, lookup

from .normalize import copy_graph, copy_module
from .shape_prop import TensorMetadata, extract_tensor_metadata

__all__ = ["sink_views"]

_PERMUTES = ("permute", "transpose")
_FUSIBLE = ("pointwise", "reduction")


def sink_views(gm: GraphModule) -> GraphModule:
    """Sink permutes and transposes through single-use pointwise producers.

    Args:
        gm: a module with ShapeProp metadata on every node (canonical form, as ``fuse``
            expects it).

    Returns:
        ``gm`` itself when nothing moves; otherwise a new GraphModule (``gm`` unchanged)
        whose new nodes carry ``tensor_meta`` computed on the ``meta`` device.
    """
    expect_graph_module(gm, "sink_views")
    if not any(_sinkable(n, gm) or _copies_movable(n, gm) for n in gm.graph.nodes):
        return gm
    graph = copy_graph(gm)
    for n in list(graph.nodes):
        if _copies_movable(n, gm):  # the copy joins the op's kernel, as its store
            with graph.inserting_before(n):
                clone = graph.call_function(torch.clone, (n.args[0],),
                                            {"memory_format": torch.contiguous_format})
            clone.meta.update(n.meta)
            n.replace_all_uses_with(clone)
            graph.erase_node(n)
    todo = [n for n in graph.nodes if _sinkable(n, gm)]
    while todo:
        view = todo.pop()
        if view._erased or not _sinkable(view, gm):
            continue
        todo.extend(_sink(view, gm))
    return copy_module(gm, graph)


def tensor_meta(n: Any) -> TensorMetadata | None:
    """``n``'s ShapeProp record when ``n`` is a node holding a tensor of rank 1 or more."""
    tm = n.meta.get("tensor_meta") if isinstance(n, Node) else None
    return tm if isinstance(tm, TensorMetadata) and tm.stride != () else None


def _perm(view: Node, rank: int, gm: GraphModule) -> tuple[int, ...] | None:
    """The full permutation ``view`` applies, or None if its dims are not plain ints."""
    info = lookup(view, gm)
    args = list(view.args[1:])
    if info.name == "transpose":
        if len(args) != 2 or not all(type(d) is int for d in args) or view.kwargs:
            return None
        a, b = (d % rank for d in args)
        order = list(range(rank))
        order[a], order[b] = order[b], order[a]
        return tuple(order)
    dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
    if view.kwargs or len(dims) != rank or not all(type(d) is int for d in dims):
        return None
    return tuple(d % rank for d in dims) if rank else None


def _sinkable(view: Node, gm: GraphModule) -> bool:
    # worth it only when the permuted value feeds a kernel (directly or via more permutes)
    return _movable(view, gm) and any(_feeds(u, gm) for u in view.users)


def _movable(view: Node, gm: GraphModule) -> bool:
    """Whether ``view`` is a permute or transpose that can move onto the inputs of the op it
    reads: a pointwise op, of which it is the only reader, and no reduction's tail."""
    if view.op != "call_function" or not view.args:
        return False
    info = lookup(view, gm)
    if info is None or info.name not in _PERMUTES:
        return False
    src = view.args[0]
    if not isinstance(src, Node) or len(src.users) != 1 or tensor_meta(src) is None:
        return False
    src_info = lookup(src, gm)
    if src_info is None or src_info.kind != "pointwise" or is_impure(src, gm) \
            or src.op != "call_function":
        return False
    rank = len(tensor_meta(src).shape)
    if _perm(view, rank, gm) is None:
        return False
    for a in src.all_input_nodes:  # tensors of known rank (a traced size would need its value)
        if tensor_meta(a) is None or len(tensor_meta(a).shape) > rank:
            return False
    return not _reduction_tail(src, gm)


def _copies_movable(n: Node, gm: GraphModule) -> bool:
    """Whether ``n`` is a row-major ``contiguous()`` of a permute that can move: it becomes
    a clone into row-major, which the op's kernel stores."""
    info = lookup(n, gm) if n.op in ("call_function", "call_method") else None
    if info is None or info.name != "contiguous" or not n.args or is_impure(n, gm):
        return False
    fmt = n.kwargs.get("memory_format", n.args[1] if len(n.args) > 1 else None)
    return fmt in (None, torch.contiguous_format) and isinstance(n.args[0], Node) \
        and _movable(n.args[0], gm)


def _reduction_tail(src: Node, gm: GraphModule, limit: int = 64) -> bool:
    """Whether a reduction reaches ``src`` through pointwise ops alone (``src`` would
    share its kernel)."""
    seen: set[Node] = set()
    stack = list(src.all_input_nodes)
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen or n.op not in ("call_function", "call_method"):
            continue
        seen.add(n)
        info = lookup(n, gm)
        if info is not None and info.kind == "reduction":
            return True
        if info is not None and info.kind == "pointwise":
            stack.extend(n.all_input_nodes)
    return False


def _feeds(n: Node, gm: GraphModule) -> bool:
    info = lookup(n, gm)
    if info is None or is_impure(n, gm):
        return False
    if info.name in _PERMUTES:
        return any(_feeds(u, gm) for u in n.users)
    return info.kind in _FUSIBLE


def _sink(view: Node, gm: GraphModule) -> list[Node]:
    """Rewrite ``view(op(a, b))`` to ``op(view'(a), view'(b))``; the new views it made."""
    graph = view.graph
    src = view.args[0]
    rank = len(tensor_meta(src).shape)
    perm = _perm(view, rank, gm)
    made: list[Node] = []
    doomed: list[Node] = []  # permutes folded into the new ones
    # at the op's place, not the view's: an in-place write between them (one left impure,
    # to a view or aliased input) must not come before the op reads its inputs
    with graph.inserting_before(src):
        def move(a: Node) -> Node:
            tm = tensor_meta(a)
            if tm is None or len(tm.shape) == 0:
                return a  # scalars and 0-d tensors broadcast anywhere
            inner = _perm(a, rank, gm) if len(tm.shape) == rank and _is_permute(a, gm) \
                and len(a.users) == 1 else None
            if inner is not None:  # a permute of a permute is one permute, or none
                doomed.append(a)
                combined = tuple(inner[i] for i in perm)
                if combined == tuple(range(rank)):
                    return a.args[0]
                new = with_meta(graph.call_function(torch.permute, (a.args[0], combined)))
                made.append(new)
                return new
            x = a
            if len(tm.shape) < rank:  # a[None, None, ...]: one view, no sizes written
                index = (None,) * (rank - len(tm.shape)) + (Ellipsis,)
                x = with_meta(graph.call_function(operator.getitem, (a, index)))
            new = with_meta(graph.call_function(torch.permute, (x, perm)))
            made.append(new)
            return new

        args = map_arg(src.args, move)
        kwargs = map_arg(src.kwargs, move)
        op = with_meta(graph.call_function(src.target, args, kwargs))
    op.meta.update({k: v for k, v in src.meta.items() if k not in ("tensor_meta", "type")})
    seen = tensor_meta(view)  # the op's value is the view's: so is its eager layout
    if seen is not None and seen.shape == tensor_meta(op).shape \
            and seen.dtype == tensor_meta(op).dtype:
        op.meta["tensor_meta"] = seen
    view.replace_all_uses_with(op)
    graph.erase_node(view)
    graph.erase_node(src)
    for a in doomed:
        if not a.users:
            graph.erase_node(a)
    # A size read from the op would make it a producer of the size and split its kernel
    # (a layer_norm's count); a permuted input of the same shape has the same sizes.
    same = [m for m in made if tensor_meta(m).shape == tensor_meta(op).shape]
    for user in list(op.users):
        if same and user.op == "call_method" and user.target == "size" and user.args[0] is op:
            user.replace_input_with(op, same[0])
    # a permute of the op (one that read a permute before) can sink through it now
    return made + [u for u in op.users if _is_permute(u, gm)]


def _is_permute(n: Node, gm: GraphModule) -> bool:
    info = lookup(n, gm) if n.op == "call_function" else None
    return info is not None and info.name in _PERMUTES and isinstance(n.args[0], Node)


def with_meta(node: Node) -> Node:
    """Give a new node the ``tensor_meta`` of its value, computed on the ``meta`` device."""
    def fake(a: Node) -> Any:
        tm = tensor_meta(a)
        if tm is None:
            raise ValueError(f"{a.name} has no tensor metadata")
        return torch.empty_strided(tm.shape, tm.stride, dtype=tm.dtype, device="meta")

    args, kwargs = map_arg(node.args, fake), map_arg(node.kwargs, fake)
    value = node.target(*args, **kwargs)
    node.meta["tensor_meta"] = extract_tensor_metadata(value)
    node.meta["type"] = torch.Tensor
    return node
