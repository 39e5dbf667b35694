"""Lone ops as groups: each pointwise or reduction node that ``fuse`` left outside a group
becomes a group of its own, so the kernel generator runs it too.

``fuse`` leaves a reduction over leading dims alone (a bias gradient summed over the
batch: its rows are not the trailing dims), but the kernel generator handles reductions
over any dims. Autodiff's graphs (``codegen/lower/autograd_pipeline.py``) are full of
them; ``codegen/lower/pipeline.py``'s ``BACKWARD_PASSES`` runs this pass after ``fuse``::

    before                                   after
        db = sum(dy, (0,))                       db = lone_0(dy)
"""

from __future__ import annotations

import torch
from fxlite.passes.split_module import extract_subgraph, set_call_meta, unpack_outputs

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule
from fxlite.node import Node, Opcode
from fxlite.ops import canonical_args, is_impure, lookup
from fxlite.tensor_meta import reduced_dims

__all__ = ["lone_groups"]


def lone_groups(gm: GraphModule) -> None:
    """Make each pointwise or reduction node that fuse left outside a group a group.

    A reduction over leading dims (a bias gradient summed over the batch) also takes in
    the pointwise group that produces its input, when nothing else reads that group: one
    kernel then computes and reduces ``g * x_hat`` without writing it out. Sibling
    reductions (same op, arguments and input layout, inputs all ready before the first of
    them: a BatchNorm backward's outer sums, kept dims or not) share one kernel::

        a = sum(p, (0, 2, 3)); b = sum(q, (0, 2, 3))   ->   ab = lone_0(p, q); a, b = ab
    """
    lone = [n for n in gm.graph.nodes
            if n.op in (Opcode.CALL_FUNCTION, Opcode.CALL_METHOD) and _lone_op(n, gm)]
    producers = {n: _sole_pointwise_producer(n, gm) for n in lone}
    count = 0
    for batch in _siblings([n for n in lone if producers[n] is None], gm) + [
            [n] for n in lone if producers[n] is not None]:
        node, producer = batch[0], producers[batch[0]]
        if producer is None:
            inputs = list(dict.fromkeys(i for n in batch for i in n.all_input_nodes))
            sub_graph, names = extract_subgraph(batch, inputs, batch), [n.name for n in batch]
        else:
            group = gm.get_submodule(producer.target)
            inputs = list(producer.all_input_nodes)
            sub_graph = Graph()
            made = sub_graph.graph_copy(group.graph, {})  # placeholders: the group's inputs
            reduced = sub_graph.node_copy(node, lambda n, made=made: made)
            sub_graph.output(reduced)
            names = [*group.meta.get("nodes", []), node.name]
        name = f"lone_{count}"
        while hasattr(gm, name):
            count += 1
            name = f"lone_{count}"
        count += 1
        sub = GraphModule(gm, sub_graph, class_name=name)
        sub.meta = {"fused_kind": lookup(node).kind, "nodes": names}
        gm.add_module(name, sub)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, tuple(inputs))
        if len(batch) == 1:
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
        else:
            set_call_meta(call, batch)
            items: dict[Node, Node] = {}
            with gm.graph.inserting_after(call):
                unpack_outputs(gm.graph, call, batch, items)
            for n in batch:
                n.replace_all_uses_with(items[n])
        for n in batch:
            gm.graph.erase_node(n)
        if producer is not None:
            target = producer.target
            gm.graph.erase_node(producer)
            gm.delete_submodule(target)
    gm.recompile()


def _siblings(nodes: list[Node], gm: GraphModule) -> list[list[Node]]:
    """``nodes`` in batches of sibling reductions (see ``lone_groups``), in graph order."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    batches: list[list[Node]] = []
    open_: dict[tuple, list[Node]] = {}
    for n in nodes:
        key = _sibling_key(n, gm)
        batch = open_.get(key) if key is not None else None
        if batch is not None and all(position[i] < position[batch[0]]
                                     for i in n.all_input_nodes):
            batch.append(n)
            continue
        batches.append([n])
        if key is not None:
            open_[key] = batches[-1]
    return batches


def _sibling_key(n: Node, gm: GraphModule) -> tuple | None:
    info = lookup(n)
    if info.kind != "reduction" or len(n.all_input_nodes) != 1:
        return None
    src = n.all_input_nodes[0]
    tm, out = src.meta.get("tensor_meta"), n.meta.get("tensor_meta")
    if not hasattr(tm, "shape") or not hasattr(out, "shape"):
        return None
    args = canonical_args(n, info, gm)
    if set(args) - {"input", "dim", "keepdim", "dtype"}:
        rest = [a for a in n.args if a is not src]
        return (n.op, n.target, repr(rest), repr(sorted(n.kwargs.items())), tuple(tm.shape),
                tuple(tm.stride), tm.dtype, tuple(out.shape), out.dtype)
    # which values a sum adds: its dims of size 1 and whether it keeps the reduced dims
    # change only its result's shape (a BatchNorm backward's weight-gradient sum over
    # (0,) of an (N, C, 1, 1) and its statistics' over (0, 2, 3) share a kernel)
    dims = tuple(d for d in reduced_dims(args.get("dim"), len(tm.shape)) if tm.shape[d] != 1)
    return (info.name, dims, repr(args.get("dtype")),
            tuple(tm.shape), tuple(tm.stride), tm.dtype, out.dtype)


def _sole_pointwise_producer(node: Node, gm: GraphModule) -> Node | None:
    """The call of the pointwise group computing reduction ``node``'s input, if ``node``
    is its only reader and the group returns that one value."""
    if lookup(node).kind != "reduction" or len(node.all_input_nodes) != 1:
        return None
    src = node.all_input_nodes[0]
    if src.op != Opcode.CALL_MODULE or len(src.users) != 1:
        return None
    group = gm.get_submodule(src.target)
    meta = getattr(group, "meta", {})
    result = group.graph.result
    if meta.get("fused_kind") != "pointwise" or not isinstance(result, Node):
        return None
    return src


def _lone_op(node: Node, gm: GraphModule) -> bool:
    info = lookup(node)
    if info is None or info.kind not in ("pointwise", "reduction") or is_impure(node, gm):
        return False
    tm = node.meta.get("tensor_meta")
    if not hasattr(tm, "shape") or not all(
            hasattr(i.meta.get("tensor_meta"), "shape") or i.meta.get("type") in (int, float, bool)
            for i in node.all_input_nodes):
        return False
    return not any(isinstance(a, torch.Tensor) for a in (*node.args, *node.kwargs.values()))
