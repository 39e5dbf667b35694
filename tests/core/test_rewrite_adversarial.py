"""Adversarial graphs for replace_pattern: shared intermediates, shared input lists,
identity replacements, unused results, in-place chains, would-be cycles, random chains,
and a check that the work done grows linearly with the graph."""

import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxlite
import fxlite.matcher as matcher_module
from fxlite.graph import Graph, _NodeList
from fxlite.rewrite import SubgraphMatcher, explain_no_match, replace_pattern


def relu_plus_one(x):  # the pattern of most tests: relu(x + 1) -> clamp(x + 1, min=0)
    return torch.relu(x + 1.0)


def clamp_plus_one(x):
    return (x + 1.0).clamp(min=0)


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target == target)


def test_intermediate_used_elsewhere_is_not_rewritten():
    def model(x):
        for i in range(4):
            h = x + 1.0
            x = torch.relu(h) * 2.0
            if i % 2:
                x = x + h  # the add of blocks 1 and 3 escapes its match
        return x

    gm = fxlite.symbolic_trace(model)
    before = str(gm.graph)
    matches = replace_pattern(gm, relu_plus_one, clamp_plus_one)
    assert len(matches) == 2 and count(gm, torch.relu) == 2 and count(gm, "clamp") == 2
    assert before != str(gm.graph)
    x = torch.randn(8)
    torch.testing.assert_close(gm(x), model(x))
    report = explain_no_match(gm, relu_plus_one)
    assert "is also used by" in report and "outside the match" in report


def test_back_to_back_matches_sharing_an_input_list():
    # The second cat's list holds the first match's result, which the first rewrite
    # replaces: the second rewrite must read the new node, not the erased one.
    def model(a, b):
        c1 = torch.cat([a, b]).relu()
        c2 = torch.cat([c1, b]).relu()
        return torch.cat([c1, c2]).relu()

    gm = fxlite.symbolic_trace(model)
    matches = replace_pattern(gm, lambda xs: torch.cat(xs).relu(), lambda xs: torch.cat(xs).clamp(min=0))
    assert len(matches) == 3 and count(gm, "relu") == 0
    gm.graph.lint()
    first_new = next(n for n in gm.graph.nodes if n.target == "clamp")
    assert matches[1].nodes_map[next(iter(matches[1].nodes_map))][0] is first_new
    a, b = torch.randn(2), torch.randn(3)
    torch.testing.assert_close(gm(a, b), model(a, b))


def test_two_nodes_holding_the_same_list_object():
    g = Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    shared = [a, b]
    cat1 = g.call_function(torch.cat, (shared,))
    cat2 = g.call_function(torch.cat, (shared,))
    s1 = g.call_method("sum", (cat1,))
    g.output((s1, cat2))
    gm = fxlite.GraphModule(torch.nn.Module(), g)
    matches = replace_pattern(gm, lambda x, y: torch.cat([x, y]).sum(), lambda x, y: x.sum() + y.sum())
    assert len(matches) == 1  # cat2 has no sum
    assert cat2.args[0] == [a, b] and shared == [a, b]  # the shared list was not mutated
    a_, b_ = torch.randn(2), torch.randn(3)
    s, c = gm(a_, b_)
    torch.testing.assert_close(s, torch.cat([a_, b_]).sum())
    torch.testing.assert_close(c, torch.cat([a_, b_]))


def test_replacement_returning_its_own_input():
    def model(x):
        return (x * 1.0 * 1.0).relu() * 1.0

    gm = fxlite.symbolic_trace(model)
    matches = replace_pattern(gm, lambda x: x * 1.0, lambda x: x)
    assert len(matches) == 3
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_method", "output"]
    assert gm.graph.output_node().args[0].target == "relu"
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), x.relu())
    gm = fxlite.symbolic_trace(lambda x: x * 1.0)  # the output itself becomes the input
    replace_pattern(gm, lambda x: x * 1.0, lambda x: x)
    assert "return x" in gm.code


def test_pattern_whose_result_has_no_users():
    def model(x):
        torch.relu(x + 1.0)  # computed, never used
        return x * 2

    gm = fxlite.symbolic_trace(model)
    matches = replace_pattern(gm, relu_plus_one, lambda x: torch.sigmoid(x))
    assert len(matches) == 1
    sig = next(n for n in gm.graph.nodes if n.target is torch.sigmoid)
    assert not sig.users and count(gm, torch.relu) == 0 and count(gm, operator.add) == 0
    gm.graph.lint()
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), x * 2)


def test_in_place_chain():
    def model(x):
        y = x.add_(1.0).mul_(2.0)
        return y + x

    gm = fxlite.symbolic_trace(model)
    matches = replace_pattern(gm, lambda x: x.add_(1.0).mul_(2.0), lambda x: x.mul_(2.0).add_(2.0))
    assert len(matches) == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["mul_", "add_"]
    x = torch.randn(4)
    torch.testing.assert_close(gm(x.clone()), model(x.clone()))
    # An in-place op is another op than its out-of-place spelling.
    gm = fxlite.symbolic_trace(model)
    assert replace_pattern(gm, lambda x: x.add(1.0).mul(2.0), lambda x: x) == []


def test_in_place_chain_whose_first_result_escapes():
    def model(x):
        a = x.add_(1.0)
        b = a.mul_(2.0)
        return b + a.sum()

    gm = fxlite.symbolic_trace(model)
    before = str(gm.graph)
    assert replace_pattern(gm, lambda x: x.add_(1.0).mul_(2.0), lambda x: x.mul_(2.0).add_(2.0)) == []
    assert str(gm.graph) == before


def test_rewrite_that_would_create_a_cycle_is_refused():
    def pattern(x, y):
        return torch.sigmoid(x), x + y

    def replacement(x, y):
        return torch.tanh(x), x - y

    def cyclic(x):
        a = torch.sigmoid(x)
        y = a.neg()  # the second output's input is computed from the first output
        return x + y

    def acyclic(x, y):
        return torch.sigmoid(x) * (x + y)

    gm = fxlite.symbolic_trace(cyclic)
    before = str(gm.graph)
    assert replace_pattern(gm, pattern, replacement) == []
    assert str(gm.graph) == before
    assert "would create a cycle" in explain_no_match(gm, pattern)
    gm = fxlite.symbolic_trace(acyclic)
    assert len(replace_pattern(gm, pattern, replacement)) == 1
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(gm(x, y), torch.tanh(x) * (x - y))


def test_a_user_between_two_outputs_gets_the_replacement_before_it():
    def pattern(x):
        return torch.sigmoid(x), torch.tanh(x)

    def model(x):
        a = torch.sigmoid(x)
        early = a * 3.0  # uses the first output before the second is computed
        b = torch.tanh(x)
        return early + b

    gm = fxlite.symbolic_trace(model)
    assert len(replace_pattern(gm, pattern, lambda x: (torch.sigmoid(x) + 0.0, torch.tanh(x) + 0.0))) == 1
    gm.graph.lint()
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), model(x))


def test_pattern_input_may_match_a_constant():
    gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 3.0))
    matches = replace_pattern(gm, lambda x, c: torch.relu(x + c), lambda x, c: (x + c).clamp(min=0))
    assert len(matches) == 1
    assert 3.0 in list(matches[0].nodes_map.values())
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), torch.relu(x + 3.0))


def test_two_pattern_inputs_never_match_one_node():
    gm = fxlite.symbolic_trace(lambda a: a + a)
    assert replace_pattern(gm, lambda x, y: x + y, lambda x, y: x * 2) == []
    assert "already matched to pattern node" in explain_no_match(gm, lambda x, y: x + y)


BLOCKS = {  # name -> (block, whether it is a rewritable match of relu(x + 1.0))
    "match": (lambda x: torch.relu(x + 1.0), True),
    "other_constant": (lambda x: torch.relu(x + 2.0), False),
    "other_op": (lambda x: torch.sigmoid(x + 1.0), False),
    "swapped": (lambda x: torch.relu(x) + 1.0, False),
    "method": (lambda x: x.add(1.0).relu(), True),
}


@settings(max_examples=25, deadline=None, derandomize=True)  # same examples in every CI run
@given(st.lists(st.tuples(st.sampled_from(sorted(BLOCKS)), st.booleans()), min_size=1, max_size=12))
def test_random_chains_rewrite_exactly_the_safe_matches(blocks):
    def model(x):
        for name, escape in blocks:
            h = BLOCKS[name][0](x)
            x = h * 0.5 + (x if escape else 0.0)
        return x

    expected = sum(1 for name, _ in blocks if BLOCKS[name][1])
    gm = fxlite.symbolic_trace(model)
    matches = replace_pattern(gm, relu_plus_one, clamp_plus_one)
    assert len(matches) == expected
    gm.graph.lint()
    x = torch.randn(6)
    torch.testing.assert_close(gm(x), model(x))


def test_work_grows_linearly_with_the_graph(monkeypatch):
    """Count node visits: whole-graph walks and op-key computations, per graph size."""
    visits = {"walk": 0, "key": 0}
    real_iter, real_key = _NodeList.__iter__, matcher_module.op_key

    def counting_iter(self):
        for n in real_iter(self):
            visits["walk"] += 1
            yield n

    def counting_key(*args):
        visits["key"] += 1
        return real_key(*args)

    def chain(n):
        def f(x):
            for _ in range(n):
                x = torch.relu(x + 1.0) * 2.0
            return x
        return fxlite.symbolic_trace(f)

    costs = {}
    for n in (100, 400):
        gm = chain(n)
        pattern = fxlite.symbolic_trace(relu_plus_one)
        replacement = fxlite.symbolic_trace(clamp_plus_one)
        visits.update(walk=0, key=0)
        monkeypatch.setattr(_NodeList, "__iter__", counting_iter)
        monkeypatch.setattr(matcher_module, "op_key", counting_key)
        assert len(replace_pattern(gm, pattern, replacement)) == n
        monkeypatch.undo()
        costs[n] = dict(visits)
    for kind in ("walk", "key"):
        # 4x the nodes may cost at most ~4x the visits (quadratic would be 16x).
        assert costs[400][kind] <= 4.5 * costs[100][kind], (kind, costs)
        assert costs[400][kind] <= 12 * (3 * 400), (kind, costs)


@pytest.mark.slow
def test_fifteen_thousand_node_chain():
    def f(x):
        for _ in range(5000):
            x = torch.relu(x + 1.0) * 2.0
        return x

    gm = fxlite.symbolic_trace(f)
    assert len(gm.graph.nodes) == 15002
    assert len(replace_pattern(gm, relu_plus_one, clamp_plus_one)) == 5000
    assert len(SubgraphMatcher(fxlite.symbolic_trace(clamp_plus_one).graph).match(gm.graph)) == 5000
