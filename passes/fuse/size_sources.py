"""size_sources: read a pointwise value's size from the values it is computed from.

Decompositions check sizes when the graph runs: layer_norm's element count reads
``x.size(-1)`` so that a graph reused for other sizes raises as eager does. When ``x`` is
computed by pointwise ops that fuse, that read is a use of ``x`` outside the kernel: the
group must write ``x`` out, and the count it reads back splits the group in two
(convnext's downsampling LayerNorm2d after a block's residual add ran as three kernels).
The size of a broadcasting op's result is the broadcast of its operands' sizes, so the
read can go to the operands, back through every pointwise op, to values no kernel
computes::

    # before                                  # after
    y = a * s + b                             y = a * s + b
    n = y.size(-1)                            n = broadcast_size(-1, a, s, b)

Only pointwise ops of the op table are looked through (their operands broadcast); the
sizes are still read on every call, so the graph stays valid after a resize.
"""

from __future__ import annotations

from typing import Any

import torch
from fxlite.passes.normalize import copy_graph, copy_module

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import is_impure, lookup

__all__ = ["broadcast_size", "size_sources"]

_LIMIT = 64  # operands looked at per size read


def broadcast_size(dim: int, *tensors: torch.Tensor) -> int:
    """Size ``dim`` of the broadcast of ``tensors``' shapes (right-aligned, as torch
    broadcasts); raises as eager does when two of them disagree.

    Example::

        broadcast_size(-1, torch.ones(3, 1), torch.ones(5))   # 5
    """
    rank = max(t.dim() for t in tensors)
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of "
                         f"[{-rank}, {rank - 1}], but got {dim})")
    d = dim - rank if dim >= 0 else dim
    size = 1
    for t in tensors:
        if t.dim() >= -d:
            s = t.shape[d]
            if s != 1:
                if size not in (1, s):
                    raise RuntimeError(f"The size of tensor a ({size}) must match the size of "
                                       f"tensor b ({s}) at non-singleton dimension {d}")
                size = s
    return size


def size_sources(gm: GraphModule) -> GraphModule:
    """Send each ``v.size(d)`` of a pointwise value ``v`` to the values ``v`` is computed
    from (see the module docstring).

    Returns:
        ``gm`` itself when no read moves; otherwise a new GraphModule (``gm`` unchanged).
    """
    if not any(_moves(n, gm) for n in gm.graph.nodes):
        return gm
    graph = copy_graph(gm)
    for node in list(graph.nodes):
        sources = _moves(node, gm)
        if sources is None:
            continue
        with graph.inserting_before(node):
            read = graph.call_function(broadcast_size, (node.args[1], *sources))
        read.meta = dict(node.meta)
        node.replace_all_uses_with(read)
        graph.erase_node(node)
    return copy_module(gm, graph)


def _moves(node: Node, gm: GraphModule) -> list[Node] | None:
    """Where the size read ``node`` goes, or None when it stays."""
    found = _size_read(node)
    if found is None:
        return None
    sources = _sources(found[0], gm)
    return None if not sources or sources == [found[0]] else sources


def _size_read(node: Node) -> tuple[Node, int] | None:
    """``(v, d)`` when ``node`` is ``v.size(d)`` of a tensor node with an int ``d``."""
    if node.op != "call_method" or node.target != "size" or node.kwargs or len(node.args) != 2:
        return None
    value, dim = node.args
    if not isinstance(value, Node) or type(dim) is not int:
        return None
    return value, dim


def _sources(value: Node, gm: GraphModule) -> list[Node] | None:
    """The tensors whose broadcast shape is ``value``'s, found back through pointwise ops
    (``value`` itself when it is not one); None when there are too many."""
    out: dict[Node, None] = {}
    todo, seen = [value], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > _LIMIT:
            return None
        operands = _pointwise_operands(n, gm)
        if operands is None:
            out[n] = None
        else:
            todo.extend(operands)
    return list(out)


def _pointwise_operands(n: Node, gm: GraphModule) -> list[Node] | None:
    """The tensor operands of a pure pointwise op node, else None."""
    if n.op not in ("call_function", "call_method", "call_module"):
        return None
    info = lookup(n, gm)
    if info is None or info.kind != "pointwise" or is_impure(n, gm):
        return None
    operands: list[Node] = []
    for a in n.all_input_nodes:
        tm: Any = a.meta.get("tensor_meta")
        if tm is not None and hasattr(tm, "shape"):
            operands.append(a)
        elif "tensor_meta" in a.meta or a.meta.get("type") not in (int, float, bool):
            return None  # an operand of unknown kind: do not guess the shape
    return operands or None
