"""Rewriter fuzzer: a random connected piece of a random graph, swapped for an equivalent one.

Hypothesis builds a random graph of pointwise ops over two inputs, each op in a random
spelling (``x + y``, ``torch.add``, ``x.add``, ``F.relu``...). It takes a random
connected subgraph as the pattern (its outside inputs become the pattern's inputs, the
values used outside it its outputs) and builds a replacement that computes the same
values exactly, with other ops (``relu(a)`` -> ``clamp(a, min=0)``, ``a - b`` ->
``a + (-b)``, ``a * 2`` -> ``a + a``...). ``replace_pattern`` must then:

- leave the outputs unchanged, bit for bit, on fresh inputs;
- leave a graph that passes ``lint()``;
- touch no node outside the matches: every other node survives with its op, target and
  arguments, except that a read of a matched result now reads its replacement.

CI runs a fixed number of derandomized examples; ``FXLITE_FUZZ_EXAMPLES=5000`` runs more,
and ``FXLITE_FUZZ_RANDOM=1`` draws new ones on each run.
"""

from __future__ import annotations

import operator
import os

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fxlite as fx
from fxlite.rewrite import replace_pattern_with_filters

EXAMPLES = int(os.environ.get("FXLITE_FUZZ_EXAMPLES", "200"))
RANDOM = os.environ.get("FXLITE_FUZZ_RANDOM") == "1"

# op name -> (arity, spellings); a spelling builds the node from the graph and operands.
f = lambda fn, **kw: (lambda g, *a: g.call_function(fn, a, kw))
m = lambda name, **kw: (lambda g, *a: g.call_method(name, a, kw))
OPS = {
    "relu": (1, [f(torch.relu), f(F.relu), m("relu"), lambda g, a: g.call_module("act", (a,))]),
    "neg": (1, [f(torch.neg), f(operator.neg), m("neg")]),
    "sigmoid": (1, [f(torch.sigmoid), m("sigmoid")]),
    "tanh": (1, [f(torch.tanh), m("tanh")]),
    "abs": (1, [f(torch.abs), m("abs")]),
    "sum0": (1, [f(torch.sum, dim=0, keepdim=True), m("sum", dim=0, keepdim=True),
                 lambda g, a: g.call_method("sum", (a, 0, True))]),
    "add": (2, [f(torch.add), f(operator.add), m("add")]),
    "sub": (2, [f(torch.sub), f(operator.sub), m("sub")]),
    "mul": (2, [f(torch.mul), f(operator.mul), m("mul")]),
    "maximum": (2, [f(torch.maximum), m("maximum")]),
    "add_c": (2, [f(operator.add), f(torch.add)]),  # a + constant
    "mul_c": (2, [f(operator.mul), f(torch.mul)]),  # a * constant
}
CONSTANTS = [1.5, 2.0, -0.5]


class Root(torch.nn.Module):
    """Owns the module spelling of relu."""

    def __init__(self) -> None:
        super().__init__()
        self.act = torch.nn.ReLU()


# Exact equivalents, as functions of the graph and the operands: replacement programs.
# fxlite's pattern inputs match constants too (``x + 1.5`` matches ``add(in0, in1)``), so
# a rule for a binary op must hold when either operand is a Python number.
EQUIVALENTS = {
    "relu": [lambda g, a: g.call_function(torch.clamp, (a,), {"min": 0.0}),
             lambda g, a: g.call_method("relu", (a,))],
    "neg": [lambda g, a: g.call_function(operator.mul, (a, -1.0)),
            lambda g, a: g.call_function(torch.neg, (a,))],
    "sigmoid": [lambda g, a: g.call_method("sigmoid", (a,))],
    "tanh": [lambda g, a: g.call_function(torch.tanh, (a,))],
    "sum0": [lambda g, a: g.call_function(torch.sum, (a, 0, True)),
             lambda g, a: g.call_function(torch.sum, (a,), {"keepdim": True, "dim": 0})],
    "abs": [lambda g, a: g.call_function(torch.maximum, (a, g.call_function(torch.neg, (a,)))),
            lambda g, a: g.call_function(torch.abs, (a,))],
    "add": [lambda g, a, b: g.call_function(operator.add, (b, a)),
            lambda g, a, b: g.call_function(operator.sub, (a, g.call_function(operator.neg, (b,))))],
    "sub": [lambda g, a, b: g.call_function(operator.add, (a, g.call_function(operator.neg, (b,)))),
            lambda g, a, b: g.call_function(operator.neg, (g.call_function(operator.sub, (b, a)),))],
    "mul": [lambda g, a, b: g.call_function(operator.mul, (b, a))],
    "maximum": [lambda g, a, b: g.call_function(torch.maximum, (b, a))],
    "add_c": [lambda g, a, c: g.call_function(operator.add, (c, a)),
              lambda g, a, c: g.call_method("add", (a, c))],
    "mul_c": [lambda g, a, c: g.call_function(operator.add, (a, a)) if c == 2.0
              else g.call_function(operator.mul, (c, a))],
}


@st.composite
def programs(draw):
    """(graph, ops): a random graph, and each op node's (name, operands, constant)."""
    g = fx.Graph()
    values = [g.placeholder("x"), g.placeholder("y")]
    ops: dict[fx.Node, tuple] = {}
    for _ in range(draw(st.integers(2, 12))):
        name = draw(st.sampled_from(sorted(OPS)))
        arity, spellings = OPS[name]
        spelling = draw(st.sampled_from(spellings))
        const = None
        if name in ("add_c", "mul_c"):
            operands = (draw(st.sampled_from(values)),)
            const = draw(st.sampled_from(CONSTANTS))
            node = spelling(g, operands[0], const)
        else:
            operands = tuple(draw(st.sampled_from(values)) for _ in range(arity))
            node = spelling(g, *operands)
        ops[node] = (name, operands, const)
        values.append(node)
    sinks = [n for n in ops if not n.users]
    g.output(tuple(sinks) if len(sinks) > 1 else sinks[0])
    return g, ops


def _connected_subgraph(draw, ops: dict) -> list[fx.Node]:
    start = draw(st.sampled_from(list(ops)))
    chosen = [start]
    for _ in range(draw(st.sampled_from([0, 1, 2, 3, 4]))):
        frontier = sorted({n for c in chosen for n in (*c.all_input_nodes, *c.users)
                           if n in ops and n not in chosen}, key=lambda n: n.name)
        if not frontier:
            break
        chosen.append(draw(st.sampled_from(frontier)))
    order = {n: i for i, n in enumerate(ops)}
    return sorted(chosen, key=order.__getitem__)


def _pattern_and_replacement(draw, piece: list[fx.Node], ops: dict):
    inside = set(piece)
    inputs = list(dict.fromkeys(a for n in piece for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in piece if any(u not in inside for u in n.users)]
    pattern, replacement = fx.Graph(), fx.Graph()
    penv = {a: pattern.placeholder(f"in{i}") for i, a in enumerate(inputs)}
    renv = {a: replacement.placeholder(f"in{i}") for i, a in enumerate(inputs)}
    for n in piece:
        penv[n] = pattern.node_copy(n, penv.__getitem__)
        name, operands, const = ops[n]
        rule = draw(st.sampled_from(EQUIVALENTS[name]))
        args = [renv[a] for a in operands]
        renv[n] = rule(replacement, args[0], const) if const is not None else rule(replacement, *args)
    for graph, env in ((pattern, penv), (replacement, renv)):
        result = [env[o] for o in outputs]
        graph.output(tuple(result) if len(result) > 1 else result[0])
    # With a module, the pattern's call_module "act" is the op relu (it matches any
    # spelling); a bare Graph's "act" matches call_module nodes of that target only.
    return (fx.GraphModule(Root(), pattern) if draw(st.booleans()) else pattern), replacement


def _placeable(piece: list[fx.Node], g: fx.Graph) -> bool:
    """Can one block replace the piece without moving other nodes? Its inputs must all
    come before every outside user of its results."""
    inside = set(piece)
    pos = {n: i for i, n in enumerate(g.nodes)}
    inputs = [pos[a] for n in piece for a in n.all_input_nodes if a not in inside]
    users = [pos[u] for n in piece for u in n.users if u not in inside]
    return max(inputs, default=-1) < min(users, default=len(pos))


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(5, generator=gen), torch.randn(5, generator=gen)


@settings(max_examples=EXAMPLES, derandomize=not RANDOM, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_rewrite_fuzz(data):
    g, ops = data.draw(programs())
    gm = fx.GraphModule(Root(), g)
    piece = _connected_subgraph(data.draw, ops)
    pattern, replacement = _pattern_and_replacement(data.draw, piece, ops)
    inputs = [_inputs(s) for s in range(3)]
    expected = [gm(*i) for i in inputs]
    before = {n: (n.op, n.target, n.args, n.kwargs) for n in g.nodes}

    done = replace_pattern_with_filters(gm, pattern, replacement)
    event(f"matches: {min(len(done), 3)}{'+' if len(done) > 3 else ''}")
    event(f"pattern nodes: {len(piece)}")

    if _placeable(piece, g):  # else the rewriter skips the match: it does not reorder nodes
        assert done, "the pattern was cut from this graph, so it must match at least there"
    gm.graph.lint()
    matched = {gn for r in done for pn, gn in r.nodes_map.items() if pn.op != "placeholder"}
    inserted = {n for r in done for n in r.replacements}
    now = set(gm.graph.nodes)
    assert matched.isdisjoint(now), "a matched node survived its replacement"
    for n, (op, target, args, kwargs) in before.items():
        if n in matched:
            continue
        assert n in now, f"{n.name} is outside every match but was erased"
        assert (n.op, n.target) == (op, target), f"{n.name} changed its op or target"
        old = [*fx.node.map_arg((args, kwargs), lambda a: a)]
        new = [*fx.node.map_arg((n.args, n.kwargs), lambda a: a)]
        _same_but_replaced(old, new, matched, inserted, n.name)
    for i, want in zip(inputs, expected):
        torch.testing.assert_close(gm(*i), want, rtol=0, atol=0, equal_nan=True)


def _same_but_replaced(old, new, matched, inserted, name):
    """``new`` equals ``old``, except that reads of matched nodes now read inserted ones."""
    stack = [(old, new)]
    while stack:
        a, b = stack.pop()
        if isinstance(a, fx.Node):
            ok = b is a if a not in matched else b in inserted
            assert ok, f"{name} reads {getattr(b, 'name', b)} where it read {a.name}"
        elif isinstance(a, (tuple, list)):
            assert type(a) is type(b) and len(a) == len(b), f"{name}: arguments changed shape"
            stack.extend(zip(a, b))
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), f"{name}: keyword arguments changed"
            stack.extend((a[k], b[k]) for k in a)
        else:
            assert type(a) is type(b) and a == b, f"{name}: constant {a!r} became {b!r}"
