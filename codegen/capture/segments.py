"""The segment tree: a recorded path cut at its reads, compiled piece by piece, and run.

A recording (``fxlite.codegen.capture.run``) is one path through the user's Python. Each read
node (a value Python read from a tensor) ends a segment; the rest of the path depends on
the value read. The paths of one function share their first segments and fork at reads::

    call ─► [segment 1] ─► read b.sum() < 0 ─┬─ False ─► [segment 2a] ─► result
                                             └─ True  ─► [segment 2b] ─► result

Running a call walks the tree: run a segment, read its value, go to the child for that
value. A value not seen before is a miss: the caller records the rest of the path
(fast-forwarding the Python up to the read, see ``capture.record``) and adds a child.

A segment's graph takes, as inputs, the values it reads from earlier segments (by node
name) and the external tensors the path writes; it returns its read value first, then
every value it defines that Python still held at the read (any later path may use
those) or that a later segment of its own path uses.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fxlite.codegen.capture.records import NodeRef, Read, Recording, result_leaves
from fxlite.codegen.capture.structure import unflatten

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule
from fxlite.node import Node

__all__ = ["Segment", "read_key", "split"]

_ONE = ("leaf",)


@dataclass(eq=False)
class Segment:
    """One compiled piece of a path, and the children that follow its read."""

    recording: Recording
    index: int  # the number of its read in the recording (its position on the path)
    gm: GraphModule  # the recorded piece, before any pass
    inputs: list[str]  # env names, in the order of gm's placeholders
    outputs: list[str]  # env names of gm's results (the read value first, if any)
    read: Read | None
    seeds: dict[str, Any] = field(default_factory=dict)  # inputs that are fixed objects
    run: Callable[..., Any] | None = None
    compiled: Any = None  # what the pipeline made of it (kernels, fallbacks, code)
    children: dict[Any, Segment] = field(default_factory=dict)
    direct: bool = False  # a root taking exactly the call's tensor arguments, in order
    # the positions of the call's arguments a root takes, when it takes them all but a
    # Dynamo graph's keyed floats (compile._picks): its calls may take the straight line
    picks: tuple[int, ...] | None = None
    trials: list[Any] = field(default_factory=list)  # how its trials ended (runtime/trial.py)

    def arguments(self, env: dict[str, Any]) -> list[Any]:
        """The values of this segment's inputs, from the call's env."""
        seeds = self.seeds
        return [seeds[n] if n in seeds else env[n] for n in self.inputs]

    def result(self, flat: Any) -> Any:
        """The user's result, rebuilt from the last segment's flat outputs."""
        rec = self.recording
        if rec.out_spec == _ONE and type(rec.out_refs[0]) is NodeRef:  # one tensor: common
            return flat[0]
        return unflatten(rec.out_spec, result_leaves(rec.out_refs, flat))

    def nodes(self) -> int:
        """How many ops the recorded piece holds (for reports)."""
        return sum(1 for n in self.gm.graph.nodes
                   if n.op not in ("placeholder", "output", "get_attr"))


def read_key(value: Any) -> Any:
    """A hashable key for a read value, equal exactly when the values are the same.

    Floats key by their bits (so NaN matches NaN, and -0.0 differs from 0.0), arrays by
    dtype, shape and bytes, sequences item by item.
    """
    t = type(value)
    if t is bool or t is int or t is str or value is None:
        return (t.__name__, value)
    if t is float:
        return ("float", struct.pack("<d", value) if not math.isnan(value) else b"nan")
    if t is complex:
        return ("complex", read_key(value.real), read_key(value.imag))
    if isinstance(value, (list, tuple)):
        return (t.__name__, tuple(read_key(v) for v in value))
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):  # numpy arrays and scalars
        return ("array", str(value.dtype), getattr(value, "shape", ()), value.tobytes())
    if isinstance(value, (int, float)):  # subclasses (numpy ints are handled above)
        return read_key(t.__mro__[1](value) if t.__mro__[1] in (int, float) else float(value))
    return ("object", repr(value))


def split(rec: Recording) -> list[Segment]:
    """Cut ``rec``'s graph at its reads into segments, in path order."""
    graph = rec.graph
    reads = {r.node: i for i, r in enumerate(rec.reads)}
    mutated = _mutated_externals(rec)
    seg_of: dict[Node, int] = {}
    pieces: list[list[Node]] = [[] for _ in range(len(rec.reads) + 1)]
    k = 0
    output: Node | None = None
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            seg_of[node] = -1
        elif node.op == "output":
            output = node
            seg_of[node] = len(rec.reads)
        else:
            seg_of[node] = k
            pieces[k].append(node)
            if node.name in reads:
                k += 1
    # values each segment defines that a later segment of this path reads
    used_later: list[set[str]] = [set() for _ in pieces]
    for node in graph.nodes:
        for inp in node.all_input_nodes:
            j = seg_of[inp]
            if j >= 0 and j < seg_of[node]:
                used_later[j].add(inp.name)
    segments = []
    for k, nodes in enumerate(pieces):
        read = rec.reads[k] if k < len(rec.reads) else None
        if read is not None:
            defined = {n.name for n in nodes}
            extra = sorted((set(read.live) | used_later[k]) & defined - {read.node})
            outs = [read.node, *extra]
        else:
            assert output is not None
            outs = [n.name for n in output.args[0]]
        segments.append(_build(rec, k, nodes, outs, read, seg_of, mutated))
    return segments


def _mutated_externals(rec: Recording) -> set[str]:
    """get_attr nodes some node writes, or with a snapshot for the checks (a gradient the
    program reads after its backward): they become inputs, so checks can sandbox them."""
    written: set[str] = set(rec.pre_state)
    for node in rec.graph.nodes:
        written.update(node.meta.get("mutated", ()))
    return {n.name for n in rec.graph.nodes if n.op == "get_attr" and n.name in written}


def _build(rec: Recording, k: int, nodes: list[Node], outs: list[str], read: Read | None,
           seg_of: dict[Node, int], mutated: set[str]) -> Segment:
    graph = Graph()
    val_map: dict[Node, Node] = {}
    inputs: list[str] = []
    seeds: dict[str, Any] = {}
    by_name = {n.name: n for n in rec.graph.nodes}
    needed: dict[Node, None] = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            if seg_of[inp] != k:
                needed.setdefault(inp)
    for name in outs:
        node = by_name[name]
        if seg_of.get(node, k) != k:
            needed.setdefault(node)
    for inp in needed:  # placeholders first, in graph order, then get_attr nodes
        if inp.op == "get_attr" and inp.name not in mutated:
            continue
        new = graph.placeholder(inp.name)
        new.meta = dict(inp.meta)
        # what the op that made it wrote, and into which node of the earlier segment, is
        # not this graph's: a placeholder with ``same_object`` naming another graph's node
        # took, in functionalize, a node of that name here for the tensor it wrote (fuzz
        # seed 9014541: a float16 result returned as the float32 buffer written after it)
        for key in ("mutated", "same_object", "aliased"):
            new.meta.pop(key, None)
        val_map[inp] = new
        inputs.append(inp.name)
        if inp.op == "get_attr":
            seeds[inp.name] = rec.externals[inp.target]
    for inp in needed:
        if inp not in val_map:
            new = graph.get_attr(inp.target)
            new.meta = dict(inp.meta)
            val_map[inp] = new
    for node in nodes:
        val_map[node] = graph.node_copy(node, val_map.__getitem__)
    graph.output(tuple(val_map[by_name[n]] for n in outs))
    gm = GraphModule(rec.holder, graph, f"segment_{k}")
    return Segment(rec, k, gm, inputs, outs, read, seeds)
