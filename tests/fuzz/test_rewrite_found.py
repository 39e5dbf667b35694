"""What the rewriter fuzzer found, each reduced to its smallest graph."""

from __future__ import annotations

import operator

import torch

import fxlite as fx
from fxlite.rewrite import SubgraphMatcher, replace_pattern_with_filters


class Root(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = torch.nn.ReLU()


def _graph_with_module_relu() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.neg, (g.call_module("act", (x,)),)))
    return fx.GraphModule(Root(), g)


def _bare_pattern() -> tuple[fx.Graph, fx.Graph]:
    pattern, replacement = fx.Graph(), fx.Graph()
    p = pattern.placeholder("a")
    pattern.output(pattern.call_module("act", (p,)))
    r = replacement.placeholder("a")
    replacement.output(replacement.call_function(torch.clamp, (r,), {"min": 0.0}))
    return pattern, replacement


def test_pattern_module_given_matches_call_module():
    gm = _graph_with_module_relu()
    pattern, replacement = _bare_pattern()
    done = replace_pattern_with_filters(gm, fx.GraphModule(Root(), pattern), replacement)
    assert len(done) == 1
    x = torch.randn(6)
    torch.testing.assert_close(gm(x), -torch.relu(x))


def test_pattern_graph_without_module_matches_call_module_by_target():
    # Found by the fuzzer: a pattern Graph without a module keyed its call_module node by
    # target, the graph keyed the same node by op name ('relu'), so they never matched.
    # torch.fx's SubgraphMatcher matches call_module nodes by target.
    gm = _graph_with_module_relu()
    pattern, replacement = _bare_pattern()
    assert len(SubgraphMatcher(pattern).match(gm.graph, gm)) == 1
    other = fx.Graph()
    other.output(other.call_module("other", (other.placeholder("a"),)))
    assert SubgraphMatcher(other).match(gm.graph, gm) == []
    assert len(replace_pattern_with_filters(gm, pattern, replacement)) == 1
    x = torch.randn(6)
    torch.testing.assert_close(gm(x), -torch.relu(x))


def test_match_needing_a_reorder_is_skipped_and_changes_nothing():
    # Found by the fuzzer: the replacement's input (c) is computed after a user (d) of one
    # of its results (a). No single place can hold it without moving nodes, so the match
    # is skipped; the graph must stay valid and unchanged.
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.abs, (x,))
    b = g.call_function(torch.abs, (a,))
    d = g.call_function(torch.abs, (a,))  # reads a result before c exists
    c = g.call_function(torch.abs, (x,))
    e = g.call_function(torch.maximum, (a, c))
    g.output((b, d, e))
    gm = fx.GraphModule(torch.nn.Module(), g)
    before = str(gm.graph)

    def pattern(p, q):
        a = torch.abs(p)
        return a, torch.abs(a), torch.maximum(a, q)

    def replacement(p, q):
        a = torch.maximum(p, -p)
        return a, torch.abs(a), torch.maximum(q, a)

    x = torch.randn(5)
    want = gm(x)
    assert replace_pattern_with_filters(gm, pattern, replacement) == []
    gm.graph.lint()
    assert str(gm.graph) == before
    torch.testing.assert_close(gm(x), want)


def test_pattern_input_binds_a_constant():
    # Found by the fuzzer (torch.fx does the same): a pattern input matches a literal, so
    # add(in0, in1) matches x + 1.5 and the replacement receives the float 1.5. A
    # replacement written with tensor-only calls (torch.neg(in1)) would fail at run time;
    # one written with operators works.
    gm = fx.symbolic_trace(lambda x: x + 1.5)

    def replacement(a, b):
        return a - operator.neg(b)

    done = replace_pattern_with_filters(gm, lambda a, b: torch.add(a, b), replacement)
    assert len(done) == 1
    assert 1.5 in [v for k, v in done[0].nodes_map.items() if k.op == "placeholder"]
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), x + 1.5)
