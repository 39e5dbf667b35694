"""written_inputs: mark the values of fused groups that the program writes in place later.

A fused group run under autograd saves what its backward reads, and autodiff's min cut
(``codegen/lower/autodiff.py``) prefers the group's inputs and results: they exist
anyway. Eager's own ops may have saved something else: ``F.rms_norm`` of a float16 input
saves its float32 copy, ``sigmoid`` its result. A program that writes such a value in
place before its backward then runs eager's backward fine, while the group's, which saved
the value itself, raised "modified by an inplace operation" (fuzz seeds 8532012 and
7105288)::

    v0 = torch.cat([x1, x2])             cat = torch.cat([x1, x2])
    v2 = F.rms_norm(v0, (1,))      ->    fused_0 = fused_0(cat)   # its input 0 marked
    v0[..., ::2] = -1.5                  setitem(cat, (Ellipsis, slice(None, None, 2)), -1.5)

:func:`mark_written_inputs` sets ``meta["written_later"]`` on such a group's placeholder,
or on the node a result of the group returns; autodiff then saves values computed from it
instead (rms_norm's normalized input), or, where the backward needs the value itself,
the group runs under eager autograd. A value counts as written when a node after the
group writes it in place (``meta["mutated"]``), or memory it shares (through view ops, or
as the result of an in-place op: ``meta["same_object"]``), with no backward in between;
:func:`written_later` marks the values a later segment of the recording writes (past a
read: ``if x.amax() > 0: v0.mul_(2)``), before the segment's passes run.

The other way round, eager's op may have saved the value itself (``relu6`` its input)
where the group saves something else: a program that writes the value before its backward
makes eager's backward raise, and must make the group's raise too, also where the write
comes after the segment, on a path the segment was not compiled for (fuzz seed 9409364)
or after the compiled call returned. The recording names the inputs each op's autograd
node saved (``meta["saved_by_eager"]``); :func:`mark_written_inputs` marks each group
placeholder or result that such an op read and that Python after the segment can reach
(``meta["checks_version"]``: the group's outputs that depend on the op), and the group's
backward checks its version as eager's autograd checks a saved value's, where one of
those outputs got a gradient (``codegen/lower/autograd.py``).
"""

from __future__ import annotations

import operator
from typing import Any

from fxlite.codegen.runtime.segment_graphs import runs_backward

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import view_base

__all__ = ["mark_written_inputs", "memory_root", "written_later"]


def mark_written_inputs(gm: GraphModule) -> None:
    """Mark each fused group's (or region's) placeholder whose value a later node of
    ``gm`` writes in place: ``meta["written_later"] = True`` (see the module docstring).
    ``gm`` is ``fuse``'s result (after ``autograd_regions``); its submodules change."""
    by_name = {n.name: n for n in gm.graph.nodes}
    outside = _reachable_from_outside(gm, by_name)
    written: set[Node] = set()  # memory (by its root node) that a later node writes
    backward_after = False  # the segment runs a backward after this node
    for node in reversed(list(gm.graph.nodes)):
        if runs_backward(node):  # its backward has read what the groups before it saved
            written.clear()
            backward_after = True
        group = _group(gm, node)
        if group is not None:
            places = [n for n in group.graph.nodes if n.op == "placeholder"]
            for arg, place in zip(node.args, places):
                # (a write in a later segment comes after this segment's backward, if
                # it has one: a linear's weight, which SGD steps past a read)
                if isinstance(arg, Node) and (arg.meta.get("written_later") and not
                                              backward_after or memory_root(
                        arg, gm, by_name) in written):
                    place.meta["written_later"] = True
            results = group.graph.output_node().args[0]
            several = isinstance(results, (tuple, list))
            for i, value in _results(node) if several else [(0, node)]:
                inner = results[i] if several else results
                if isinstance(inner, Node) and memory_root(value, gm, by_name) in written:
                    inner.meta["written_later"] = True

        if group is not None and not backward_after:  # (Python after it comes too late)
            _mark_saved_by_eager(node, group, gm, by_name, outside)
        names = node.meta.get("mutated", ())
        for name in names:
            target = by_name.get(name)
            if target is None and len(names) == 1 and node.args and isinstance(
                    node.args[0], Node):
                target = node.args[0]  # (a value fuse moved into a group: its result)
            if target is not None:
                written.add(memory_root(target, gm, by_name))


def _reachable_from_outside(gm: GraphModule, by_name: dict[str, Node]) -> set[Node]:
    """The memory (by :func:`_shared`) of ``gm``'s inputs and returned values: Python
    after the segment can write it in place (a later segment, past a graph break)."""
    out = gm.graph.output_node()
    ends = [n for n in gm.graph.nodes if n.op == "placeholder"] + out.all_input_nodes
    return {_shared(n, gm, by_name) for n in ends}


def _shared(node: Node, gm: Any, by_name: dict[str, Node]) -> Node:
    """The node whose version counter ``node``'s tensor shares (:func:`memory_root`
    through groups' results too)."""
    return memory_root(node, gm, by_name, through_groups=True)


def _mark_saved_by_eager(call: Node, group: GraphModule, gm: GraphModule,
                         by_name: dict[str, Node], outside: set[Node]) -> None:
    """Mark the placeholders and results of ``group`` (called by ``call``) whose memory
    Python after the segment can write and which eager's autograd saved for an op of the
    group (its ``meta["saved_by_eager"]``): ``meta["checks_version"]``, the positions of
    the group's outputs downstream of such ops (their gradients make eager's backward of
    the op run, and raise for a written value)."""
    nodes = {n.name: n for n in group.graph.nodes}
    places = [n for n in group.graph.nodes if n.op == "placeholder"]
    results = group.graph.output_node().args[0]
    several = isinstance(results, (tuple, list))
    returned = list(results) if several else [results]
    values = dict(_results(call)) if several else {0: call}
    for op in group.graph.nodes:
        saved = [op if name == "" else nodes[name] for name in op.meta.get("saved_by_eager", ())
                 if name == "" or name in nodes]
        if not saved:
            continue
        downstream = _downstream(op, returned)
        for m in saved:
            root = _shared(m, group, nodes)
            if root in places:
                arg = call.args[places.index(root)]
                if isinstance(arg, Node) and _shared(arg, gm, by_name) in outside:
                    _add_positions(root, downstream)
            for i, r in enumerate(returned):
                if isinstance(r, Node) and _shared(r, group, nodes) is root and i in values \
                        and _shared(values[i], gm, by_name) in outside:
                    _add_positions(r, downstream)


def _downstream(op: Node, returned: list[Any]) -> frozenset[int]:
    """The positions of ``returned`` (a group's results) that depend on ``op``."""
    seen, todo = set(), [op]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return frozenset(i for i, r in enumerate(returned) if r in seen)


def _add_positions(node: Node, positions: frozenset[int]) -> None:
    node.meta["checks_version"] = node.meta.get("checks_version", frozenset()) | positions


def _group(gm: GraphModule, node: Node) -> Any:
    """The fused group (or region) graph module ``node`` calls, or None."""
    if node.op != "call_module":
        return None
    sub = gm.get_submodule(node.target)
    if not getattr(sub, "meta", {}).get("fused_kind"):
        return None
    inner = getattr(sub, "inner", sub)  # (a group run without autocast)
    return inner if isinstance(inner, GraphModule) else None


def memory_root(node: Node, gm: Any, by_name: dict[str, Node], *,
                through_groups: bool = False) -> Node:
    """The node whose memory ``node`` is: down chains of view ops and in-place results
    (``by_name`` maps the graph's names to its nodes; ``gm`` resolves ``call_module``).
    A group's result is memory of its own, not a view of the call, unless
    ``through_groups``: a version counter its views share with it."""
    seen = {node}
    while True:
        base = view_base(node, gm)
        if base is None:
            base = by_name.get(node.meta.get("same_object"))
        if base is None or base in seen or not through_groups and _group(gm, base) is not None:
            return node
        seen.add(base)
        node = base


def _results(call: Node) -> list[tuple[int, Node]]:
    """``(position, getitem node)`` of each result taken from a group call's tuple."""
    return [(u.args[1], u) for u in call.users if u.op == "call_function"
            and u.target is operator.getitem and type(u.args[1]) is int]


def written_later(recorded: list[Node], segment: GraphModule) -> None:
    """Mark ``segment``'s nodes whose memory a node after it in the recording (a later
    segment of its path: ``recorded`` is the recording's nodes, in order) writes in place
    before a backward runs: ``meta["written_later"] = True``, which
    :func:`mark_written_inputs` passes on to the groups that read them.

    Example: ``v4 = sigmoid(v0)`` in one segment and ``v0.mul_(2)`` in the next, past a
    ``bool(x.amax() > 0)``: the first segment's ``v0`` is marked (fuzz seed 7105288).
    """
    by_name = {n.name: n for n in recorded}
    mine = {n.name for n in segment.graph.nodes if n.op not in ("placeholder", "output")}
    last = max((i for i, n in enumerate(recorded) if n.name in mine), default=None)
    if last is None:
        return
    written: set[Node] = set()
    for node in recorded[last + 1:]:
        if runs_backward(node):
            break
        for name in node.meta.get("mutated", ()):
            if name in by_name:
                written.add(memory_root(by_name[name], None, by_name))
    if not written:
        return
    for node in segment.graph.nodes:
        own = by_name.get(node.name)
        if own is not None and memory_root(own, None, by_name) in written:
            node.meta["written_later"] = True
