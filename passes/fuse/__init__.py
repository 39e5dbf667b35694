"""The fusion partitioner: group pointwise, reduction and simple view nodes into kernels.

``fuse(gm)`` reads the op table (``fxlite.ops.lookup``) and ShapeProp's
``meta['tensor_meta']`` and returns a new GraphModule in which each group is one
``call_module`` to ``fused_<i>``, itself a GraphModule holding the group's nodes::

    before (after normalize + decompose)        after fuse
        x -> mul(x, 0.5) -> amax -> sub ->          x -> fused_0(x) -> out
             exp -> sum -> div -> out

Rules:

* **Kinds.** Only ``pointwise``, ``reduction`` and ``view`` ops can join a group. Anything
  else (``extern`` such as matmul/linear/conv, ``composite`` such as an undecomposed
  softmax, ``effect``, impure or unknown ops, ops without one plain tensor result) stays in
  the parent graph, and groups never reach across it. Reductions must be plain ones
  (``sum``, ``mean``, ``amax``, ``amin``, ``prod``, single-result ``max``/``min``: only
  ``input``/``dim``/``keepdim``/``dtype`` parameters); ``var``/``std`` are decomposed or
  stay outside. (Which node may join as what: ``passes/fuse/classes.py``.)
* **Iteration space.** A pointwise group is nodes of one output shape ``I`` (inputs may
  broadcast), plus pointwise nodes whose smaller shape broadcasts into ``I`` (a
  per-channel ``rsqrt(var + eps)`` of an eval-mode batch_norm): the kernel recomputes those
  per element instead of launching a kernel of their own. A reduction group has ``I = outer + inner``: every reduction in it reduces an
  ``I``-shaped value over the trailing ``inner`` dims (``keepdim`` either way). Its
  values are either *full* (broadcast right-aligned against ``I``: shape ``I`` or
  ``outer + (1,)*len(inner)``) or *row* (shape ``outer``, from ``keepdim=False``); a node
  only reads group values of its own space, so every value is a function of its row and
  column, never of another row. So softmax and layer_norm are one group each.
* **Views** join the group of the value they view, and only when they merely insert or
  drop size-1 dims (view/reshape/flatten/squeeze/unsqueeze/contiguous) or broadcast
  (expand), so that the viewed value stays the same function of the iteration index.
  Anything else (permute, transpose, slicing, real reshapes) stays outside; but first
  ``sink_views`` moves permutes and transposes above the pointwise ops they follow, onto
  the inputs, where a kernel reads through them (see ``passes/sink_views.py``). A sum over
  trailing and earlier dims (BatchNorm's ``(0, 2, 3)``) is first split by ``split_sums``
  into a trailing sum, which groups as above, and a small outer one.
* **Siblings.** A pointwise node also merges with the groups of up to four earlier
  pointwise nodes of its shape that read the same memory (an input, or views of one
  value: the q, k and v heads of one projection), while the two hold 24 nodes or fewer
  and no ``cat`` reads either (``cat_groups`` makes those one kernel with the cat):
  one kernel for work that shares no edge. The no-cycle rule below still holds, so
  readers joined by a path stay apart.
* **No cycles.** Groups grow consumer-into-producer in graph order; a merge is refused if
  some path leaves the merged set and comes back (through ungrouped nodes or other groups),
  so every group is convex and the graph of groups is acyclic. Impure nodes (in-place,
  random, side effects) are barriers: no group spans one, and nothing is reordered across
  one.

Single-node groups are kept: a lone ``relu`` or ``sum`` still becomes ``fused_<i>``, so
the code generator runs every pointwise and reduction op.

Each submodule's ``meta`` is ``{"fused_kind": "pointwise" | "reduction", "nodes": [...],
"iteration_shape": I}`` plus ``"reduction_dims"`` (dims of ``I``, e.g. ``(1,)``) for
reduction groups. Its nodes keep ``tensor_meta`` and carry ``meta["fused_space"]``
(``"full"`` or ``"row"``).
"""

from __future__ import annotations

import copy
import heapq
from collections import ChainMap
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from fxlite.passes.decompose import DECOMPOSITIONS, decompose
from fxlite.passes.fuse.classes import BROADCAST_VIEWS, UNIT_VIEWS, FusionClass, Shape, classify
from fxlite.passes.fuse.read_through import read_through_copies
from fxlite.passes.fuse.remat import rematerialize
from fxlite.passes.fuse.size_sources import size_sources
from fxlite.passes.fuse.split_sums import split_sums
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import fill_missing_meta
from fxlite.passes.sink_views import sink_views
from fxlite.passes.split_module import extract_subgraph, set_call_meta, unpack_outputs

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule, copy_attr, expect_graph_module
from fxlite.node import Node, describe_value
from fxlite.ops import is_impure, lookup, view_root

__all__ = ["fuse"]

FULL, ROW = "full", "row"
_SIBLINGS = 4  # earlier readers of one value a pointwise group tries to merge with
# the most nodes two sibling groups may hold together: a kernel per few siblings, not one
# kernel with an output per reader of a value read a thousand times
_SIBLING_NODES = 24


@dataclass(eq=False)
class _Group:
    """A growing group. ``split`` is None for pointwise groups, else ``len(outer)``."""

    shape: Shape
    split: int | None
    nodes: set[Node] = field(default_factory=set)
    tags: dict[Node, str] = field(default_factory=dict)  # "full" or "row", per member
    outside: dict[Node, None] = field(default_factory=dict)  # users not in the group
    segment: int = 0  # number of impure nodes before the group's nodes


# ---------------------------------------------------------------------- spaces and tags
def _aligned(shape: Shape, base: Shape) -> tuple[int, ...] | None:
    """Positions in ``base`` of ``shape``'s non-1 dims, right-aligned; None if it does not broadcast."""
    off = len(base) - len(shape)
    if off < 0:
        return None
    out = []
    for j, s in enumerate(shape):
        if s == 1:
            continue
        if s != base[off + j]:
            return None
        out.append(off + j)
    return tuple(out)


def _tag(node: Node, cls: FusionClass, g: _Group, members: Container[Node], tags: Mapping[Node, str]) -> str | None:
    """The space of ``node`` inside a group like ``g`` with ``members``, or None if it cannot join."""
    shape, split = g.shape, g.split
    outer = shape if split is None else shape[:split]
    if cls.kind == "pointwise":
        if cls.shape == shape or split is not None and cls.shape == outer + (1,) * (len(shape) - split):
            tag = FULL
        elif split is not None and cls.shape == outer:
            tag = ROW
        elif _aligned(cls.shape, shape) is not None:
            tag = FULL  # smaller, broadcast into the space: recomputed per element
        else:
            return None
        for inp in node.all_input_nodes:
            if inp in members and tags.get(inp) != tag:
                return None
        return tag
    if cls.kind == "reduction":
        if split != cls.split or cls.in_shape != shape:
            return None
        if cls.source in members and tags.get(cls.source) != FULL:
            return None
        return FULL if cls.keepdim else ROW
    # A view must read a value of the group, and keep it the same function of the index.
    src_tag = tags.get(cls.source) if cls.source in members else None
    if src_tag is None:
        return None
    bases = {FULL: shape, ROW: outer}
    allowed = {_aligned(shape, shape), _aligned(outer, outer)}  # storable: whole space or rows
    a_in = _aligned(cls.in_shape, bases[src_tag])
    if a_in is None:
        return None
    for tag in (src_tag, ROW if src_tag == FULL else FULL):
        if tag == ROW and split is None:
            continue
        a_out = _aligned(cls.shape, bases[tag])
        if a_out is None or a_out not in allowed:
            continue
        if cls.view in UNIT_VIEWS and a_out == a_in:
            return tag
        if cls.view in BROADCAST_VIEWS and tag == src_tag and set(a_in) <= set(a_out):
            return tag
    return None


def _merged_space(a: _Group, b: _Group) -> tuple[Shape, int | None] | None:
    if a.split is None and b.split is None:
        if a.shape == b.shape:
            return a.shape, None
        # a group of smaller values (a per-channel scale) joins the group it broadcasts into
        if _aligned(a.shape, b.shape) is not None:
            return b.shape, None
        return (a.shape, None) if _aligned(b.shape, a.shape) is not None else None
    if a.split is not None and b.split is not None:
        return (a.shape, a.split) if (a.shape, a.split) == (b.shape, b.split) else None
    red = a if a.split is not None else b
    return red.shape, red.split


# ---------------------------------------------------------------------- the partitioner
class _Pair:
    """Membership in the union of two groups, without building the union."""

    __slots__ = ("group_of", "a", "b")

    def __init__(self, group_of: dict[Node, _Group], a: _Group, b: _Group) -> None:
        self.group_of, self.a, self.b = group_of, a, b

    def __contains__(self, n: Node) -> bool:
        g = self.group_of.get(n)
        return g is self.a or g is self.b


class _Partitioner:
    """Grows groups consumer-into-producer, visiting nodes in graph order.

    Invariants: every group is convex and the graph of groups is acyclic; only nodes up
    to ``limit`` (the node being visited) are grouped. ``_Group.outside`` (users of the
    group that are not in it) is kept up to date so cycle checks never walk a group's
    members.
    """

    def __init__(self, gm: GraphModule, max_group_size: int | None) -> None:
        self.gm = gm
        self.max_size = max_group_size
        self.nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.cls: dict[Node, FusionClass] = {}
        self.group_of: dict[Node, _Group] = {}
        self.limit = -1
        self.readers: dict[Node, list[Node]] = {}  # memory -> pointwise nodes reading it
        # Impure nodes (in-place, random, side effects) are barriers: a group never spans
        # one, and _build keeps every unit on its side, so mutations stay ordered.
        self.segment: dict[Node, int] = {}
        self.barriers: set[Node] = set()
        for n in self.nodes:
            self.segment[n] = len(self.barriers)
            if n.op in ("call_function", "call_method", "call_module") and is_impure(n, gm):
                self.barriers.add(n)

    def run(self) -> list[_Group]:
        for i, n in enumerate(self.nodes):
            c = classify(n, self.gm)
            if c is None:
                continue
            self.cls[n] = c
            self.limit = i
            if c.kind == "view":
                self._add_view(n, c)
                continue
            split = None if c.kind == "pointwise" else c.split
            g = self._new_group(n, c.in_shape if c.kind == "reduction" else c.shape, split,
                                FULL if c.kind == "pointwise" or c.keepdim else ROW)
            for inp in n.all_input_nodes:
                other = self.group_of.get(inp)
                if other is not None and other is not g:
                    g = self._merge(other, g) or g
            if c.kind == "pointwise":
                self._join_siblings(n, g)
        return list({id(g): g for g in self.group_of.values()}.values())

    def _join_siblings(self, n: Node, g: _Group) -> None:
        """Merge ``g`` with the groups of earlier pointwise nodes of its shape that read
        the same memory (an input, or views of one value: q, k and v of one projection),
        where no path joins them: one kernel, one launch, in place of several."""
        for root in dict.fromkeys(view_root(i, self.gm) for i in n.all_input_nodes):
            readers = self.readers.setdefault(root, [])
            for m in reversed(readers[-_SIBLINGS:]):
                h = self.group_of.get(m)
                if g.split is None and h is not None and h is not g and h.split is None \
                        and h.shape == g.shape \
                        and len(h.nodes) + len(g.nodes) <= _SIBLING_NODES \
                        and not self._feeds_cat(g) and not self._feeds_cat(h):
                    g = self._merge(h, g) or g
            readers.append(n)

    def _feeds_cat(self, g: _Group) -> bool:
        """Whether a ``cat`` reads ``g``: ``cat_groups`` (``codegen/kernels/cat.py``) makes
        a cat and the groups only it reads one kernel, which a sibling would prevent."""
        for u in g.outside:
            info = lookup(u, self.gm) if u.op in ("call_function", "call_method") else None
            if info is not None and info.name == "cat":
                return True
        return False

    def _new_group(self, n: Node, shape: Shape, split: int | None, tag: str) -> _Group:
        g = _Group(shape, split, {n}, {n: tag}, dict.fromkeys(n.users), self.segment[n])
        self.group_of[n] = g
        return g

    def _add_view(self, n: Node, c: FusionClass) -> None:
        """Put view ``n`` in the group of the value it views, when it keeps its meaning."""
        g = self.group_of.get(c.source)
        if g is None:
            return
        tag = _tag(n, c, g, g.nodes, g.tags)
        if tag is not None:
            single = self._new_group(n, g.shape, g.split, tag)
            if self._merge(g, single) is None:
                del self.group_of[n]

    def _merge(self, a: _Group, b: _Group) -> _Group | None:
        """Merge ``a`` and ``b`` (into the larger) if legal; return the merged group."""
        space = _merged_space(a, b)
        if space is None or a.segment != b.segment:
            return None
        if self.max_size is not None and len(a.nodes) + len(b.nodes) > self.max_size:
            return None
        inside = _Pair(self.group_of, a, b)
        probe = _Group(space[0], space[1])
        # A pointwise side joining a reduction group is re-tagged (full or row) in graph
        # order, so that its inputs are tagged before it; the other side keeps its tags.
        stale = [side for side in (a, b) if (side.shape, side.split) != space]
        fresh: dict[Node, str] = {}
        tags = ChainMap(fresh, *(side.tags for side in (a, b) if side not in stale))
        for n in sorted((n for side in stale for n in side.nodes), key=self.index.__getitem__):
            t = _tag(n, self.cls[n], probe, inside, tags)
            if t is None:
                return None
            fresh[n] = t
        small, large = (a, b) if len(a.nodes) <= len(b.nodes) else (b, a)
        for n in small.nodes:  # edges between the two sides must agree on spaces
            if any(m in large.nodes for m in n.all_input_nodes):
                if _tag(n, self.cls[n], probe, inside, tags) != tags[n]:
                    return None
            for u in n.users:
                if u in large.nodes and _tag(u, self.cls[u], probe, inside, tags) != tags[u]:
                    return None
        if self._leaves_and_returns(a, b):
            return None
        if large in stale:
            large.tags = fresh
            large.tags.update(small.tags)
        else:
            large.tags.update(fresh if small in stale else small.tags)
        large.nodes |= small.nodes
        large.shape, large.split = space
        for n in small.nodes:
            self.group_of[n] = large
            large.outside.pop(n, None)
        for u in small.outside:
            if self.group_of.get(u) is not large:
                large.outside[u] = None
        return large

    def _leaves_and_returns(self, a: _Group, b: _Group) -> bool:
        """True if some path leaves ``a | b`` and comes back, over nodes and whole groups.

        Why whole groups: a path that enters another group at one node and leaves it at
        another is a path in the graph of groups, even without a node-level path. Nodes
        after ``limit`` are ungrouped and only reach later nodes, so they are skipped.
        """
        index, limit, group_of = self.index, self.limit, self.group_of
        stack: list[Node] = []
        for g in (a, b):
            for u in g.outside:
                if index[u] <= limit:
                    owner = group_of.get(u)
                    if owner is not a and owner is not b:
                        stack.append(u)
        seen_nodes: set[Node] = set()
        seen_groups: set[int] = set()
        while stack:
            x = stack.pop()
            g = group_of.get(x)
            if g is not None:
                if id(g) in seen_groups:
                    continue
                seen_groups.add(id(g))
                successors: Iterable[Node] = g.outside
            else:
                if x in seen_nodes:
                    continue
                seen_nodes.add(x)
                successors = x.users
            for u in successors:
                if index[u] > limit:
                    continue
                owner = group_of.get(u)
                if owner is a or owner is b:
                    return True
                stack.append(u)
        return False


# ---------------------------------------------------------------------- building the result
def fuse(gm: GraphModule, *, max_group_size: int | None = None, recompute: bool = True
         ) -> GraphModule:
    """Partition ``gm`` into fusible groups, each called as a ``fused_<i>`` submodule.

    Args:
        gm: a GraphModule whose nodes carry ShapeProp meta. Composites with a
            decomposition rule (softmax, layer_norm...) are decomposed first, in a copy, so
            they fuse as their primitives; running ``normalize`` and ``decompose`` yourself
            gives the same groups.
        max_group_size: if given, no group grows beyond this many nodes.
        recompute: let a group recompute full-size pointwise values of a reduction group
            rather than load them, where that moves less memory (``passes/fuse/remat.py``).
            Their copies are new nodes, so the groups then cover more than ``gm``'s nodes.
            Off when ``max_group_size`` is given.

    Returns:
        A new GraphModule computing the same outputs. Extern and unclassified nodes stay as
        they were; each group is one ``call_module`` (plus ``getitem`` nodes when it has
        several outputs) with ``tensor_meta`` of what it returns. ``gm`` is not changed.
        See the module docstring for the grouping rules and the submodules' ``meta``.

    Raises:
        ValueError: a node lacks ShapeProp meta.

    Example::

        gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1) * 2)
        ShapeProp(gm).propagate(torch.randn(4, 8))
        fused = fuse(gm)
        print(fused.code)            # fused_0 = self.fused_0(x);  ...  return fused_0
        fused.fused_0.meta["nodes"]  # ['add', 'relu', 'mul']
    """
    expect_graph_module(gm, "fuse")
    if max_group_size is not None:
        if not isinstance(max_group_size, int) or isinstance(max_group_size, bool):
            raise TypeError(f"fuse: max_group_size must be an int or None (no limit), not "
                            f"{describe_value(max_group_size)}")
        if max_group_size < 1:
            raise ValueError(f"fuse: max_group_size must be at least 1 (or None: no limit), not "
                             f"{max_group_size}")
    for n in gm.graph.nodes:
        if n.op != "output" and "tensor_meta" not in n.meta and "type" not in n.meta:
            raise ValueError(
                f"fuse needs shape metadata, but node {n.name!r} has none: run "
                f"ShapeProp(gm).propagate(*example_inputs) first")
    gm = sink_views(_decomposed(gm))  # permutes move onto inputs, out of the way of groups
    gm = size_sources(gm)  # size checks read the inputs, not values a kernel computes
    gm = split_sums(gm)  # sums over inner and outer dims: the inner part fuses
    partitioner = _Partitioner(gm, max_group_size)
    groups = partitioner.run()
    # (with a size limit a copy might not fit its reader's group: then none are made)
    again = None if max_group_size is not None or not recompute else rematerialize(
        gm, groups, {n: c.kind for n, c in partitioner.cls.items()})
    if again is not None:  # readers recompute values rather than load them: partition anew
        gm = again
        partitioner = _Partitioner(gm, max_group_size)
        groups = partitioner.run()
    fused = _build(gm, groups, partitioner.segment, partitioner.barriers)
    read_through_copies(fused)  # groups read a contiguous() copy's source instead
    return fused


def _decomposed(gm: GraphModule) -> GraphModule:
    """``gm``, or a normalized and decomposed copy of it when it holds composites that have
    a decomposition rule (softmax, layer_norm...), so they fuse as their primitives do.
    The new nodes get their metadata from their inputs' (no example inputs are needed)."""
    def composite(n: Node) -> bool:
        info = lookup(n, gm)
        return info is not None and info.kind == "composite" and info.name in DECOMPOSITIONS

    if not any(composite(n) for n in gm.graph.nodes):
        return gm
    work = normalize(GraphModule(gm, copy.deepcopy(gm.graph)))
    fill_missing_meta(work)  # rules use shapes (to count the elements a mean reduces)
    work = decompose(work)
    fill_missing_meta(work)
    if any(n.op != "output" and "tensor_meta" not in n.meta and "type" not in n.meta
           for n in work.graph.nodes):
        return gm  # some new node's shape is unknown: fuse the graph as it is
    return work


def _build(gm: GraphModule, groups: list[_Group], segment: dict[Node, int],
           barriers: set[Node]) -> GraphModule:
    graph = gm.graph
    index = {n: i for i, n in enumerate(graph.nodes)}
    unit_of: dict[Node, int] = {}  # node -> unit id: groups first, then single nodes
    units: list[list[Node]] = []
    for g in groups:
        for n in g.nodes:
            unit_of[n] = len(units)
        units.append(sorted(g.nodes, key=index.__getitem__))
    n_groups = len(units)
    for n in graph.nodes:
        if n not in unit_of:
            unit_of[n] = len(units)
            units.append([n])

    # Kahn's algorithm over units, preferring the unit whose first node comes first; units
    # never cross an impure node (its segment ends with it).
    def key(u: int) -> tuple[int, bool, int]:
        first = units[u][0]
        return segment[first], first in barriers, index[first]

    deps = [set() for _ in units]
    users: list[set[int]] = [set() for _ in units]
    for n in graph.nodes:
        u = unit_of[n]
        for inp in n.all_input_nodes:
            v = unit_of[inp]
            if v != u and v not in deps[u]:
                deps[u].add(v)
                users[v].add(u)
    waiting = [len(d) for d in deps]
    ready = [(key(u), u) for u in range(len(units)) if not waiting[u]]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(u)
        for w in users[u]:
            waiting[w] -= 1
            if not waiting[w]:
                heapq.heappush(ready, (key(w), w))
    if len(order) != len(units):  # the partitioner guarantees this never happens
        raise RuntimeError("fuse: the groups form a cycle (partitioner bug)")

    parent = Graph()
    env: dict[Node, Node] = {}
    holder = torch.nn.Module()
    holder.training = gm.training
    taken = {name for name, _ in gm.named_children()} | set(gm.__dict__) | {
        n.target for n in graph.nodes if n.op in ("get_attr", "call_module")}
    next_id = 0
    for u in order:
        members = units[u]
        if u >= n_groups:
            node = members[0]
            env[node] = parent.node_copy(node, env.__getitem__)
            if node.op in ("get_attr", "call_module"):
                copy_attr(gm, holder, node.target, f"node {node.name!r} refers to {node.target!r}")
            continue
        while f"fused_{next_id}" in taken:
            next_id += 1
        name = f"fused_{next_id}"
        next_id += 1
        g = groups[u]
        member_set = g.nodes
        inputs = list(dict.fromkeys(
            inp for n in members for inp in n.all_input_nodes if inp not in member_set))
        outputs = [n for n in members if any(x not in member_set for x in n.users)]
        sub_graph = extract_subgraph(members, inputs, outputs)
        copies = [sn for sn in sub_graph.nodes if sn.op not in ("placeholder", "output")]
        for orig, sn in zip(members, copies, strict=True):
            sn.meta["fused_space"] = g.tags[orig]
        sub = GraphModule(gm, sub_graph, class_name=name)
        sub.meta = _group_meta(g, members)
        type(sub).__call__ = _call_forward  # each GraphModule has a class of its own
        holder.add_module(name, sub)
        call = parent.call_module(name, tuple(env[i] for i in inputs))
        set_call_meta(call, outputs)
        unpack_outputs(parent, call, outputs, env)
    return GraphModule(holder, parent, class_name=type(gm).__name__)


def _call_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A fused group's call: its ``forward`` alone. A group is fxlite's, not the user's: the
    user's global module hooks (``register_module_forward_hook``) must not see it."""
    return self.forward(*args, **kwargs)


def _group_meta(g: _Group, members: list[Node]) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "fused_kind": "pointwise" if g.split is None else "reduction",
        "nodes": [n.name for n in members],
        "iteration_shape": g.shape,
    }
    if g.split is not None:
        meta["reduction_dims"] = tuple(range(g.split, len(g.shape)))
    return meta
