"""Export a graph to networkx, for analysis with graph algorithms.

``to_networkx(gm)`` gives one networkx node per fxlite node, keyed by the node's name,
and one edge per producer -> consumer pair. The attributes make the common questions
one-liners: which nodes are extern ops, what is on the path between two nodes, is a
grouping acyclic (``nx.is_directed_acyclic_graph``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule, expect_graph_or_module
from fxlite.node import Node, format_target
from fxlite.ops import lookup
from fxlite.viz.dot import node_input_counts, node_shape_dtype, sub_graphmodule

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["node_input_counts", "node_shape_dtype", "to_networkx"]


def _owner(graph_or_gm: Graph | GraphModule, where: str = "to_networkx"
           ) -> tuple[Graph, torch.nn.Module | None]:
    return expect_graph_or_module(graph_or_gm, where)


def _fused_kind(node: Node, module: torch.nn.Module | None) -> str | None:
    """``meta['fused_kind']`` of a ``call_module`` node's GraphModule target, if any."""
    sub = sub_graphmodule(node, module)
    return sub.meta.get("fused_kind") if sub is not None else None


def to_networkx(graph_or_gm: Graph | GraphModule) -> nx.DiGraph:
    """Convert a graph to an ``nx.DiGraph`` whose nodes are keyed by node name.

    Every node carries the attributes:

    - ``op``: the opcode string (``"call_function"``);
    - ``target``: the target as a string, as printed in the graph (``"operator.add"``);
    - ``shape`` and ``dtype``: from ``meta['tensor_meta']`` (see :func:`node_shape_dtype`),
      or None when ShapeProp has not run;
    - ``kind``: the op table's kind (``"pointwise"``, ``"reduction"``, ``"view"``,
      ``"extern"``...) via ``fxlite.ops.lookup``, or None for unknown ops, placeholders,
      outputs and ``get_attr``;
    - ``fused_kind``: for a ``call_module`` node whose target is a GraphModule with
      ``meta['fused_kind']`` (a group made by ``fxlite.passes.fuse``), that kind; else None.

    Each edge runs from an input to a node that reads it. A node that reads the same
    input several times (``x + x``) has one edge with ``count=2``; every edge has a
    ``count``.

    Args:
        graph_or_gm: a Graph or GraphModule. The module (the GraphModule itself, or the
            graph's ``owning_module``) resolves ``call_module`` targets.

    Returns:
        A new ``nx.DiGraph``; changing it does not change the fxlite graph.

    Example::

        def f(x):
            return torch.relu(x + x)

        # before (fxlite):   %add = call_function[target=operator.add](args = (%x, %x))
        #                    %relu = call_function[target=torch.relu](args = (%add,))
        g = to_networkx(fxlite.symbolic_trace(f))
        # after (networkx):  nodes x, add, relu, output
        #   g.nodes["add"] == {"op": "call_function", "target": "operator.add",
        #                      "shape": None, "dtype": None, "kind": "pointwise",
        #                      "fused_kind": None}
        #   g.edges["x", "add"]["count"] == 2
        list(nx.topological_sort(g))  # ['x', 'add', 'relu', 'output']
    """
    graph, module = _owner(graph_or_gm)
    import networkx as nx  # here, not at import: it takes ~0.5 s to import, compile needs none

    out = nx.DiGraph()
    for node in graph.nodes:
        info = lookup(node, module)
        shape, dtype = node_shape_dtype(node)
        out.add_node(node.name, op=str(node.op), target=format_target(node.target),
                     shape=shape, dtype=dtype, kind=info.kind if info is not None else None,
                     fused_kind=_fused_kind(node, module))
        for src, count in node_input_counts((node.args, node.kwargs)).items():
            out.add_edge(src.name, node.name, count=count)
    return out
