"""Recompute instead of store: a value one group writes only for another to read.

A reduction group often computes full-size pointwise values that a later group needs
too, after a small sum between them. BatchNorm's backward is the common case: the first
kernel sums over the centred input ``c = x - mean`` and the masked gradient ``g``; the
second, which needs those sums, reads ``c`` and ``g`` again. Partitioned as they come,
the first kernel stores both (two full-size writes) and the second loads them. Reading
``x`` and the incoming gradient instead (which the first kernel loads anyway) and redoing
the subtraction and the mask costs the second kernel the same loads and saves both
stores::

    # before: two kernels                      # after
    fused_0: c = x - mean; g = where(m, 0, t)  fused_0: c = x - mean; g = where(m, 0, t)
             s = sum(c * g, (2, 3))                     s = sum(c * g, (2, 3))
             -> (c, g, s)                               -> s
    fused_1(c, g, s, ...)                      fused_1(x, t, mean, s, ...): c, g again

The rule, for a full-size value ``p`` that reduction group ``A`` computes and other groups
read (two pointwise groups of one shape are apart for a reason: a size limit or a cycle):
``p`` must come from pointwise ops of ``A`` only (no reduction, view or impure op on the
way; at most ``MAX_CONE`` of them), every reader group ``B`` must iterate over ``p``'s
shape, with no impure op between the two groups. Counting full-size tensors only, a
reader takes the copy when the inputs it would newly load are no more than the one it
stops loading (``p``), and the store of ``p`` goes away when no reader is left. So memory
traffic never grows; the arithmetic is done twice, which memory-bound kernels hide.
Values are decided in graph order, and a reader's loads grow as it takes copies, so a
second value over the same inputs is free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fxlite.passes.normalize import copy_graph, copy_module

from fxlite.graph_module import GraphModule
from fxlite.node import Node

__all__ = ["MAX_CONE", "rematerialize"]

MAX_CONE = 24
_FULL = "full"


def rematerialize(gm: GraphModule, groups: list[Any], kinds: Mapping[Node, str]
                  ) -> GraphModule | None:
    """A copy of ``gm`` where readers recompute the values that pay (module docstring).

    Args:
        gm: the graph ``fuse`` partitioned (not changed).
        groups: the partitioner's groups (``nodes``, ``tags``, ``shape``, ``segment``).
        kinds: each classified node's fusion kind (``"pointwise"``, ``"reduction"``...).

    Returns:
        None when no value pays; otherwise a new GraphModule in which each chosen reader
        reads its own copy of the value's pointwise ops, placed just before it. Partition
        that again: the copies join their reader's group.
    """
    plan = _plan(gm, groups, kinds)
    if not plan:
        return None
    graph = copy_graph(gm)
    by_name = {n.name: n for n in graph.nodes}
    # the readers' order, read once: copies go in before them and never reorder them
    position = {n: i for i, n in enumerate(graph.nodes)}.__getitem__
    for cone, readers in plan:
        first = min((by_name[r] for r in readers), key=position)
        env: dict[Node, Node] = {}
        with graph.inserting_before(first):
            for name in cone:
                old = by_name[name]
                env[old] = graph.node_copy(old, _mapper(env))
        top = by_name[cone[-1]]
        for r in readers:
            by_name[r].replace_input_with(top, env[top])
    return copy_module(gm, graph)


def _mapper(env: dict[Node, Node]) -> Any:
    return lambda a: env.get(a, a)


def _numel(n: Node) -> int | None:
    shape = getattr(n.meta.get("tensor_meta"), "shape", None)
    return None if shape is None else math.prod(shape)


def _cone(p: Node, group: Any, kinds: Mapping[Node, str]) -> tuple[list[Node], set[Node]] | None:
    """``p``'s pointwise ancestors inside ``group`` (graph order, ``p`` last) and the
    values they read from outside it; None if a reduction or view of the group feeds it."""
    members: set[Node] = set()
    leaves: set[Node] = set()
    todo = [p]
    while todo:
        n = todo.pop()
        if n in members:
            continue
        if kinds.get(n) != "pointwise" or group.tags.get(n) != _FULL:
            return None
        members.add(n)
        if len(members) > MAX_CONE:
            return None
        for i in n.all_input_nodes:
            if i in group.nodes:
                todo.append(i)
            else:
                leaves.add(i)
    order = [n for n in p.graph.nodes if n in members]
    return order, leaves


def _plan(gm: GraphModule, groups: list[Any], kinds: Mapping[Node, str]) -> list[tuple[list[str], list[str]]]:
    group_of = {n: g for g in groups for n in g.nodes}
    loads = {id(g): {i for n in g.nodes for i in n.all_input_nodes if i not in g.nodes}
             for g in groups}
    plan: list[tuple[list[str], list[str]]] = []
    for p in gm.graph.nodes:
        owner = group_of.get(p)
        outside = [u for u in p.users if owner is not None and u not in owner.nodes]
        size = _numel(p)
        if not outside or not size or owner.split is None or owner.tags.get(p) != _FULL or \
                tuple(p.meta["tensor_meta"].shape) != tuple(owner.shape):
            continue
        found = _cone(p, owner, kinds)
        if found is None:
            continue
        cone, leaves = found
        readers: dict[int, list[Node]] = {}
        stays = False  # someone keeps reading the stored value
        for u in outside:
            g = group_of.get(u)
            if g is None or g.segment != owner.segment or tuple(g.shape) != tuple(owner.shape):
                stays = True
                continue
            readers.setdefault(id(g), []).append(u)
        chosen = []
        for key, users in readers.items():
            new = [leaf for leaf in leaves if _numel(leaf) == size and leaf not in loads[key]]
            if len(new) <= (1 if not stays else 0):
                chosen.append((key, users, new))
        if not chosen:
            continue
        if stays or len(chosen) < len(readers):
            # the store stays: take only readers that load nothing new
            chosen = [c for c in chosen if not c[2]]
        for key, users, _ in chosen:
            loads[key] |= leaves
            loads[key].discard(p)
            plan.append(([n.name for n in cone], [u.name for u in users]))
    return plan
