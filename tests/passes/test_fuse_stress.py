"""Property-based stress test of the fusion partitioner on random DAGs of 50-500 nodes.

Each example builds a random graph with the Graph API that mixes pointwise ops on
same-shape and broadcast operands, row reductions (``sum``/``amax`` over the last dim, with
``keepdim=True`` or followed by ``unsqueeze(-1)``) and extern ops (``torch.matmul`` with a square weight, a leaf
``nn.Linear``), runs ShapeProp and ``fuse``, and checks that

* every group is convex on the original graph (no path leaves it and comes back),
* the graph of groups (each group contracted to one vertex) is acyclic,
* the fused module computes what the original computes.
"""

from __future__ import annotations

import operator
import random

import networkx as nx
import torch
from fxlite.passes.fuse import fuse
from fxlite.passes.shape_prop import ShapeProp
from hypothesis import given, settings
from hypothesis import strategies as st

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule
from fxlite.node import Node

R, C = 3, 5


class _Root(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(C, C)
        self.register_buffer("w", torch.randn(C, C) / C)


def _random_graph(n_nodes: int, seed: int, p_extern: float, p_reduce: float) -> GraphModule:
    """A random DAG over full (R, C) values, row values (R, 1) and a bias (C,)."""
    rng = random.Random(seed)
    g = Graph()
    full: list[Node] = [g.placeholder("x"), g.placeholder("y")]
    rows: list[Node] = [g.placeholder("r")]
    bias = g.placeholder("b")
    weight = g.get_attr("w")
    made: list[Node] = []
    unary = {"relu": torch.relu, "exp": torch.exp, "neg": torch.neg, "tanh": torch.tanh}

    def recent(pool: list[Node]) -> Node:
        # Favour recent values (long chains), but reach back too (wide fan-out).
        if rng.random() < 0.5:
            return pool[-1 - min(len(pool) - 1, int(rng.expovariate(0.3)))]
        return rng.choice(pool)

    while len(made) < n_nodes:
        roll = rng.random()
        if roll < p_extern:
            a = recent(full)
            if rng.random() < 0.5:
                n = g.call_function(torch.matmul, (a, weight))
            else:
                n = g.call_module("lin", (a,))
            full.append(n)
        elif roll < p_extern + p_reduce:
            fn = rng.choice((torch.sum, torch.amax))
            keepdim = rng.random() < 0.7
            n = g.call_function(fn, (recent(full),), {"dim": -1, "keepdim": keepdim})
            if not keepdim:  # an (R,) row value, viewed back as (R, 1)
                made.append(n)
                n = g.call_function(torch.unsqueeze, (n, -1))
            rows.append(n)
        else:
            op = rng.choice(("add", "mul", "bias", "row", "rowonly", *unary))
            if op in ("add", "mul"):
                fn = rng.choice({"add": (torch.add, operator.add), "mul": (torch.mul, operator.mul)}[op])
                n = g.call_function(fn, (recent(full), recent(full)))
                full.append(n)
            elif op == "bias":  # a (C,) operand broadcast across the rows
                n = g.call_function(torch.add, (recent(full), bias))
                full.append(n)
            elif op == "row":  # an (R, 1) operand broadcast across the columns
                n = g.call_function(torch.sub, (recent(full), recent(rows)))
                full.append(n)
            elif op == "rowonly":  # pointwise on row values
                n = g.call_function(torch.mul, (recent(rows), rng.choice((0.5, 2.0))))
                rows.append(n)
            else:
                pool = full if rng.random() < 0.8 else rows
                a = recent(pool)
                if op == "exp":  # tanh first keeps values bounded and outputs finite
                    a = g.call_function(torch.tanh, (a,))
                    made.append(a)
                    pool.append(a)
                n = g.call_function(unary[op], (a,))
                pool.append(n)
        made.append(n)
    g.output(tuple(n for n in made if not n.users))
    return GraphModule(_Root(), g)


def _groups(fused: GraphModule, original: GraphModule) -> list[set[Node]]:
    by_name = {n.name: n for n in original.graph.nodes}
    out = []
    for node in fused.graph.nodes:
        if node.op == "call_module" and node.target.startswith("fused_"):
            out.append({by_name[name] for name in getattr(fused, node.target).meta["nodes"]})
    return out


def _fused_calls(fused: GraphModule) -> list[Node]:
    return [n for n in fused.graph.nodes if n.op == "call_module" and n.target.startswith("fused_")]


def _is_convex(group: set[Node]) -> bool:
    """No path from the group through an outside node back into the group."""
    stack = [u for n in group for u in n.users if u not in group]
    seen: set[Node] = set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        for u in x.users:
            if u in group:
                return False
            stack.append(u)
    return True


def _contracted(graph: Graph, groups: list[set[Node]]) -> nx.DiGraph:
    unit = {n: ("group", i) for i, grp in enumerate(groups) for n in grp}
    dg = nx.DiGraph()
    for n in graph.nodes:
        dg.add_node(unit.get(n, n.name))
        for inp in n.all_input_nodes:
            a, b = unit.get(inp, inp.name), unit.get(n, n.name)
            if a != b:
                dg.add_edge(a, b)
    return dg


def _inputs() -> tuple[torch.Tensor, ...]:
    return torch.randn(R, C), torch.randn(R, C), torch.randn(R, 1), torch.randn(C)


@settings(max_examples=25, deadline=None, derandomize=True)  # same examples in every CI run
@given(n_nodes=st.integers(50, 500), seed=st.integers(0, 2**31),
       p_extern=st.sampled_from((0.0, 0.05, 0.15, 0.3)), p_reduce=st.sampled_from((0.0, 0.1, 0.25)))
def test_random_dags(n_nodes: int, seed: int, p_extern: float, p_reduce: float) -> None:
    gm = _random_graph(n_nodes, seed, p_extern, p_reduce)
    gm.graph.lint()
    inputs = _inputs()
    ShapeProp(gm).propagate(*inputs)
    fused = fuse(gm, recompute=False)  # the partition itself: each node in one group
    fused.graph.lint()
    groups = _groups(fused, gm)
    names = [name for grp in groups for name in (n.name for n in grp)]
    assert len(names) == len(set(names)), "a node is in two groups"
    for grp in groups:
        assert _is_convex(grp), sorted(n.name for n in grp)
    assert nx.is_directed_acyclic_graph(_contracted(gm.graph, groups))
    # Every pointwise and reduction node is in a group (single-node groups included);
    # the extern matmul and Linear nodes never are.
    computed = {n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is not torch.matmul}
    assert set(names) == computed
    torch.testing.assert_close(fused(*inputs), gm(*inputs), equal_nan=True)
    again = fuse(gm)  # readers recompute what pays: same values, no more groups
    again.graph.lint()
    assert len(_fused_calls(again)) <= len(groups)
    torch.testing.assert_close(again(*inputs), gm(*inputs), equal_nan=True)


def test_group_level_cycle_is_refused() -> None:
    """Merging two groups can close a cycle through a third group without any node path.

    ``a`` feeds ``c1`` and ``c2`` feeds ``b`` (through an extern ``amax`` over dim 0);
    ``c1`` and ``c2`` share a group but no path joins them. Putting ``a`` and ``b`` in one
    group would make the graph of groups cyclic.
    """
    g = Graph()
    x, z, w = g.placeholder("x"), g.placeholder("z"), g.placeholder("w")
    a = g.call_function(torch.exp, (x,))
    c1 = g.call_function(torch.add, (a, z))
    c2 = g.call_function(torch.mul, (w, 3.0))
    q = g.call_function(torch.add, (c1, c2))
    e2 = g.call_function(torch.amax, (c2,), {"dim": 0})
    b = g.call_function(torch.mul, (a, e2))
    g.output((q, b))
    gm = GraphModule(torch.nn.Module(), g)
    inputs = (torch.randn(R, C), torch.randn(2, 1, 1), torch.randn(2, R, C))
    ShapeProp(gm).propagate(*inputs)
    fused = fuse(gm)
    groups = _groups(fused, gm)
    group_of = {n: i for i, grp in enumerate(groups) for n in grp}
    assert group_of[c1] == group_of[c2] == group_of[q]
    assert group_of[a] != group_of[b]
    assert nx.is_directed_acyclic_graph(_contracted(gm.graph, groups))
    torch.testing.assert_close(fused(*inputs), gm(*inputs))


def test_large_random_dag_is_fast() -> None:
    import time

    gm = _random_graph(500, 1234, 0.1, 0.15)
    inputs = _inputs()
    ShapeProp(gm).propagate(*inputs)
    start = time.perf_counter()
    fused = fuse(gm)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"fuse took {elapsed:.2f}s on 500 nodes"
    torch.testing.assert_close(fused(*inputs), gm(*inputs), equal_nan=True)
