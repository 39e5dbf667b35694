"""split_module: cut a GraphModule into submodules, one per partition, as torch.fx does.

A callback names each node's partition. The result's top graph keeps the placeholders,
calls ``submod_<id>`` once per partition (in a topological order of the partitions), and
returns what the original returned::

    before:                                   after split_module(gm, gm, lambda n: ...):
        x -> add (p0) -> relu (p1) -> out         x -> submod_0(x) -> submod_1(add) -> out

Values that cross partitions become outputs of the producing submodule and inputs of the
consuming one; ``get_attr`` nodes are copied into every partition that reads them, and the
modules that ``call_module`` nodes call are copied into their partition's submodule.
:func:`extract_subgraph` (building one submodule's graph from a set of nodes) is shared
with the fusion partitioner.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch

from fxlite.graph import Graph, check_order
from fxlite.graph_module import GraphModule, copy_attr, expect_graph_module
from fxlite.node import Argument, Node, describe_value

__all__ = ["extract_subgraph", "split_module"]

_META_KEYS = ("tensor_meta", "type")


def extract_subgraph(nodes: Sequence[Node], inputs: Sequence[Node], outputs: Sequence[Node],
                     copy_into: Iterable[Node] = ()) -> Graph:
    """Build a standalone Graph computing ``outputs`` from ``inputs`` with ``nodes``.

    Args:
        nodes: the nodes to copy, in a topological order (e.g. original graph order).
        inputs: outside values the nodes read; each becomes a placeholder named after it
            (its ``tensor_meta``/``type`` meta is copied onto the placeholder).
        outputs: nodes among ``nodes`` whose values are returned: a single value for one
            output, a tuple otherwise (an empty tuple for none).
        copy_into: outside nodes (typically ``get_attr``) copied as-is instead of becoming
            placeholders.

    Returns:
        The new Graph. Copied nodes keep their names and (shallow-copied) meta.

    Example::

        g = extract_subgraph([add, relu], inputs=[x], outputs=[relu])
        # graph(): %x = placeholder; %add = ...; %relu = ...; return relu
    """
    graph = Graph()
    env: dict[Node, Node] = {}
    for inp in inputs:
        ph = graph.placeholder(inp.name)
        for key in _META_KEYS:
            if key in inp.meta:
                ph.meta[key] = inp.meta[key]
        env[inp] = ph
    for extra in copy_into:
        env[extra] = graph.node_copy(extra, lambda n: env[n])
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    result: Argument = env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs)
    graph.output(result)
    return graph


def set_call_meta(call: Node, outputs: Sequence[Node]) -> None:
    """Give a call of an extracted subgraph the ``tensor_meta``/``type`` of what it returns."""
    if len(outputs) == 1:
        for key in _META_KEYS:
            if key in outputs[0].meta:
                call.meta[key] = outputs[0].meta[key]
        return
    call.meta["type"] = tuple
    if outputs and all("tensor_meta" in o.meta for o in outputs):
        call.meta["tensor_meta"] = tuple(o.meta["tensor_meta"] for o in outputs)


def unpack_outputs(graph: Graph, call: Node, outputs: Sequence[Node], env: dict[Node, Node]) -> None:
    """Map each of ``outputs`` to ``call`` (one output) or to a getitem of it (several)."""
    if len(outputs) == 1:
        env[outputs[0]] = call
        return
    for i, o in enumerate(outputs):
        item = graph.call_function(operator.getitem, (call, i))
        for key in _META_KEYS:
            if key in o.meta:
                item.meta[key] = o.meta[key]
        env[o] = item


class _Partition:
    __slots__ = ("pid", "first", "nodes", "inputs", "attrs", "outputs", "deps", "users")

    def __init__(self, pid: Hashable, first: int) -> None:
        self.pid = pid
        self.first = first  # index of its first node: the order partitions were seen in
        self.nodes: list[Node] = []
        self.inputs: dict[Node, None] = {}  # ordered sets
        self.attrs: dict[Node, None] = {}
        self.outputs: dict[Node, None] = {}
        self.deps: set[Hashable] = set()
        self.users: set[Hashable] = set()


def split_module(gm: GraphModule, root_m: torch.nn.Module, split_callback: Callable[[Node], Any],
                 qualname_map: dict[str, str] | None = None,
                 keep_original_order: bool = False) -> GraphModule:
    """Split ``gm`` into one submodule per partition named by ``split_callback``.

    Args:
        gm: the module to split.
        root_m: the module that ``get_attr`` and ``call_module`` targets are read from
            (usually ``gm`` itself, or the module it was traced from).
        split_callback: called on every node except placeholders, ``get_attr`` nodes and the
            output; returns its partition id (an int, or any hashable). The submodule for
            id ``p`` is installed as ``submod_<p>``.
        qualname_map: if given, filled with ``{"submod_<p>.<target>": "<target>"}`` for each
            module or attribute copied into a submodule.
        keep_original_order: the top graph always calls the partitions in a topological
            order that, among ready partitions, prefers the one whose first node comes first.
            Each submodule takes its inputs in order of first use by default, or in the
            original graph's definition order with True.

    Returns:
        A GraphModule whose top graph holds the placeholders, one ``call_module`` per
        partition (plus ``getitem`` nodes for multi-output partitions) and the output. It
        computes the same outputs as ``gm``.

    Raises:
        ValueError: the assignment makes partitions depend on each other in a cycle
            (e.g. ``a`` in 0, ``b = f(a)`` in 1, ``c = g(b)`` in 0); the message names them.

    Example::

        gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1) * 2)
        split = split_module(gm, gm, lambda n: 0 if n.name == "add" else 1)
        print(split.code)   # submod_0 = self.submod_0(x); submod_1 = self.submod_1(submod_0) ...
    """
    graph = expect_graph_module(gm, "split_module").graph
    if not isinstance(root_m, torch.nn.Module):
        raise TypeError(f"split_module: root_m must be the nn.Module that get_attr and call_module "
                        f"targets are read from (usually gm itself), not {describe_value(root_m)}")
    if not callable(split_callback):
        raise TypeError(f"split_module: split_callback must be a function node -> partition id, "
                        f"not {describe_value(split_callback)}; e.g. lambda n: 0")
    if qualname_map is not None and not isinstance(qualname_map, dict):
        raise TypeError(f"split_module: qualname_map must be a dict to fill, or None, not "
                        f"{describe_value(qualname_map)}")
    check_order(graph, "split_module")
    index = {n: i for i, n in enumerate(graph.nodes)}
    part_of: dict[Node, Hashable] = {}
    parts: dict[Hashable, _Partition] = {}
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        pid = split_callback(n)
        part_of[n] = pid
        if pid not in parts:
            parts[pid] = _Partition(pid, index[n])
        parts[pid].nodes.append(n)

    for p in parts.values():
        for n in p.nodes:
            for inp in n.all_input_nodes:
                q = part_of.get(inp)
                if q == p.pid and inp in part_of:
                    continue
                if inp.op == "get_attr":
                    p.attrs[inp] = None
                    continue
                p.inputs[inp] = None
                if q is not None:
                    p.deps.add(q)
                    parts[q].users.add(p.pid)
                    parts[q].outputs[inp] = None
    out_node = graph.output_node()
    for inp in out_node.all_input_nodes:
        if inp in part_of:
            parts[part_of[inp]].outputs[inp] = None

    order = _partition_order(parts)

    top = Graph()
    env: dict[Node, Node] = {}
    top_attrs: list[str] = []

    def lookup(n: Node) -> Node:
        if n not in env and n.op == "get_attr":  # read directly by the output
            env[n] = top.node_copy(n)
            top_attrs.append(n.target)
        return env[n]

    for n in graph.nodes:
        if n.op == "placeholder":
            env[n] = top.node_copy(n)
    holder = torch.nn.Module()
    holder.training = gm.training
    for p in order:
        inputs = sorted(p.inputs, key=index.__getitem__) if keep_original_order else list(p.inputs)
        outputs = sorted(p.outputs, key=index.__getitem__)
        sub_graph = extract_subgraph(p.nodes, inputs, outputs, copy_into=p.attrs)
        sub = GraphModule(root_m, sub_graph, class_name=f"submod_{p.pid}")
        name = f"submod_{p.pid}"
        holder.add_module(name, sub)
        if qualname_map is not None:
            for t in dict.fromkeys(x.target for x in sub_graph.nodes if x.op in ("get_attr", "call_module")):
                qualname_map[f"{name}.{t}"] = t
        call = top.call_module(name, tuple(lookup(i) for i in inputs))
        set_call_meta(call, outputs)
        unpack_outputs(top, call, outputs, env)
    top.node_copy(out_node, lookup)
    for t in top_attrs:
        copy_attr(root_m, holder, t, f"the output reads {t!r}")
    return GraphModule(holder, top, class_name=type(gm).__name__)


def _partition_order(parts: dict[Hashable, _Partition]) -> list[_Partition]:
    """A topological order of the partitions (Kahn), or ValueError naming a cycle."""
    # Heap entries are (first node index, id): first indices are unique, so ids (which
    # need not be comparable) are never compared.
    waiting = {pid: len(p.deps) for pid, p in parts.items()}
    ready = [(p.first, pid) for pid, p in parts.items() if waiting[pid] == 0]
    heapq.heapify(ready)
    order: list[_Partition] = []
    while ready:
        _, pid = heapq.heappop(ready)
        order.append(parts[pid])
        for user in parts[pid].users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (parts[user].first, user))
    if len(order) < len(parts):
        stuck = [pid for pid, w in waiting.items() if w > 0]
        raise ValueError(f"split_module: partitions depend on each other in a cycle: "
                         f"{' -> '.join(map(str, _find_cycle(parts, stuck)))}")
    return order


def _find_cycle(parts: dict[Hashable, _Partition], stuck: list[Hashable]) -> list[Hashable]:
    """One cycle among ``stuck`` partitions (each still waits on another stuck one)."""
    stuck_set = set(stuck)
    path: list[Hashable] = []
    on_path: dict[Hashable, int] = {}
    pid = stuck[0]
    while pid not in on_path:  # walk dependencies backwards; a stuck one always has a stuck dep
        on_path[pid] = len(path)
        path.append(pid)
        pid = next(d for d in parts[pid].deps if d in stuck_set)
    cycle = path[on_path[pid]:] + [pid]
    return cycle[::-1]  # producer -> consumer order
