"""replace_pattern, replace_pattern_with_filters and SubgraphMatcher: the torch.fx contract,
each option and rule, bad input, transactions, spelling-blind matching and explanations.

Adversarial graphs live in test_rewrite_adversarial.py.
"""

import operator

import pytest
import torch
import torch.nn.functional as F

import fxlite
from fxlite.graph import Graph
from fxlite.rewrite import (
    Match,
    ReplacedPatterns,
    SubgraphMatcher,
    explain_no_match,
    replace_pattern,
    replace_pattern_with_filters,
)


def targets(gm):
    """The call targets of a graph, in order (method names and module paths as strings)."""
    return [n.target for n in gm.graph.nodes if n.op.startswith("call_")]


# ---------------------------------------------------------------------- torch.fx parity
class CatSum(torch.nn.Module):
    def forward(self, x, w1, w2):
        m1 = torch.cat([w1, w2]).sum()
        m2 = torch.cat([w1, w2]).sum()
        return x + torch.max(m1) + torch.max(m2)


def test_basic_usage_from_the_torch_fx_docs():
    def pattern(w1, w2):
        return torch.cat([w1, w2]).sum()

    def replacement(w1, w2):
        return torch.stack([w1, w2])

    gm = fxlite.symbolic_trace(CatSum())
    before = str(gm.graph)
    assert before.count("torch.cat") == 2 and "torch.stack" not in before
    matches = replace_pattern(gm, pattern, replacement)
    after = str(gm.graph)
    assert len(matches) == 2
    assert all(isinstance(m, Match) for m in matches)
    assert "torch.cat" not in after and "sum" not in after and after.count("torch.stack") == 2
    gm.graph.lint()
    assert "torch.stack([w1, w2])" in gm.code  # recompiled
    x, w1, w2 = torch.randn(3), torch.randn(3), torch.randn(3)
    stacked = torch.max(torch.stack([w1, w2]))
    torch.testing.assert_close(gm(x, w1, w2), x + stacked + stacked)


def test_match_records_map_pattern_nodes_to_graph_nodes():
    gm = fxlite.symbolic_trace(CatSum())
    pattern = fxlite.symbolic_trace(lambda w1, w2: torch.cat([w1, w2]).sum())
    pnodes = {n.name: n for n in pattern.graph.nodes}
    graph_w1 = next(n for n in gm.graph.nodes if n.name == "w1")
    matches = replace_pattern(gm, pattern, lambda w1, w2: torch.stack([w1, w2]))
    first = matches[0]
    assert first.anchor.name == "sum_1"  # the graph node that matched the pattern's output
    assert first.nodes_map[pnodes["w1"]] is graph_w1
    assert first.nodes_map[pnodes["sum_1"]] is first.anchor
    assert first.nodes_map[pnodes["cat"]].name == "cat"


@pytest.mark.parametrize("form", ["function", "graph", "graph_module"])
def test_patterns_and_replacements_may_be_functions_graphs_or_graph_modules(form):
    def pattern(x):
        return torch.relu(x + 1.0)

    def replacement(x):
        return (x + 1.0).clamp(min=0)

    def convert(f):
        gm = fxlite.symbolic_trace(f)
        return {"function": f, "graph": gm.graph, "graph_module": gm}[form]

    def model(x):
        return torch.relu(x + 1.0) * 2.0

    gm = fxlite.symbolic_trace(model)
    assert len(replace_pattern(gm, convert(pattern), convert(replacement))) == 1
    assert torch.relu not in targets(gm) and "clamp" in targets(gm)
    x = torch.randn(8)
    torch.testing.assert_close(gm(x), model(x))


def test_replace_pattern_with_filters_returns_the_inserted_nodes():
    def model(x):
        return torch.relu(x + 1.0) - torch.relu(x + 1.0)

    gm = fxlite.symbolic_trace(model)
    done = replace_pattern_with_filters(gm, lambda x: torch.relu(x + 1.0),
                                        lambda x: (x + 1.0).clamp(min=0))
    assert len(done) == 2 and all(isinstance(r, ReplacedPatterns) for r in done)
    for r in done:
        assert [n.target for n in r.replacements] == [operator.add, "clamp"]
        assert all(n.graph is gm.graph for n in r.replacements)


# ---------------------------------------------------------------------- options and rules
def test_several_outputs_including_one_behind_no_other():
    # `b` is not an ancestor of `a`: the matcher finds it through the users of x.
    def pattern(x):
        a = torch.sigmoid(x)
        b = torch.tanh(x)
        return a, b

    def replacement(x):
        return torch.sigmoid(x) * 1.0, torch.tanh(x) * 1.0

    def model(x, y):
        return torch.sigmoid(x) + torch.tanh(x) + torch.sigmoid(y)

    gm = fxlite.symbolic_trace(model)
    matches = replace_pattern(gm, pattern, replacement)
    assert len(matches) == 1  # sigmoid(y) has no tanh(y) beside it
    assert targets(gm).count(operator.mul) == 2
    x, y = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(gm(x, y), model(x, y))


def test_kwargs_are_matched_by_name_and_value():
    def model(x):
        return torch.sum(x, dim=1) + torch.sum(x, dim=0).sum() + x.sum(1)

    gm = fxlite.symbolic_trace(model)
    matches = replace_pattern(gm, lambda x: torch.sum(x, dim=1), lambda x: torch.mean(x, dim=1) * 3)
    # torch.sum(x, dim=1) and x.sum(1) are one call; dim=0 is another.
    assert len(matches) == 2
    x = torch.randn(3, 3)
    torch.testing.assert_close(gm(x), x.mean(1) * 3 + x.sum(0).sum() + x.mean(1) * 3)


def test_literals_must_be_equal_unless_ignored():
    def model(x):
        return torch.relu(x + 1.0) + torch.relu(x + 2.0) + torch.relu(x + 1)

    gm = fxlite.symbolic_trace(model)
    # 1 (an int) is not the float 1.0: `x + 1` and `x + 1.0` differ in dtype promotion.
    assert len(replace_pattern(gm, lambda x: torch.relu(x + 1.0), lambda x: torch.sigmoid(x))) == 1
    gm = fxlite.symbolic_trace(model)
    done = replace_pattern_with_filters(gm, lambda x: torch.relu(x + 1.0),
                                        lambda x: torch.sigmoid(x), ignore_literals=True)
    assert len(done) == 3
    assert torch.relu not in targets(gm)


def test_list_arguments_must_match_item_by_item():
    def model(a, b, c):
        return torch.cat([a, b]).sum() + torch.cat([a, b, c]).sum() + torch.cat((b, a)).sum()

    gm = fxlite.symbolic_trace(model)
    matches = replace_pattern(gm, lambda x, y: torch.cat([x, y]).sum(),
                              lambda x, y: x.sum() + y.sum())
    # [a, b] and (b, a) match (lists and tuples alike); [a, b, c] has three items.
    assert len(matches) == 2
    assert targets(gm).count(torch.cat) == 1
    a, b, c = torch.randn(2), torch.randn(2), torch.randn(2)
    torch.testing.assert_close(gm(a, b, c), model(a, b, c))


def test_a_pattern_input_may_match_a_whole_list():
    def model(a, b):
        return torch.cat([a, b, a]).relu()

    gm = fxlite.symbolic_trace(model)
    matches = replace_pattern(gm, lambda xs: torch.cat(xs).relu(),
                              lambda xs: torch.cat(xs).clamp(min=0))
    assert len(matches) == 1
    xs = next(iter(matches[0].nodes_map.values()))
    assert [n.name for n in xs] == ["a", "b", "a"]
    a, b = torch.randn(2), torch.randn(2)
    torch.testing.assert_close(gm(a, b), model(a, b))


def test_call_method_patterns():
    def model(x):
        return x.relu().neg() + torch.relu(x).neg()

    gm = fxlite.symbolic_trace(model)
    done = replace_pattern_with_filters(gm, lambda x: x.relu().neg(), lambda x: x.clamp(max=0) * 0 - x.relu(),
                                        match_spellings=False)
    assert len(done) == 1 and targets(gm).count(torch.relu) == 1  # torch.relu(x) kept
    gm = fxlite.symbolic_trace(model)
    assert len(replace_pattern(gm, lambda x: x.relu().neg(), lambda x: -F.relu(x))) == 2


class Act(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.act = act

    def forward(self, x):
        return self.act(self.lin(x))


def test_call_module_patterns_match_by_target():
    gm = fxlite.symbolic_trace(Act(torch.nn.ReLU()))
    pattern = fxlite.symbolic_trace(Act(torch.nn.ReLU()))  # same module paths: lin, act

    def replacement(x):
        return x * 2.0

    done = replace_pattern_with_filters(gm, pattern, replacement, match_spellings=False)
    assert len(done) == 1 and targets(gm) == [operator.mul]
    gm.delete_all_unused_submodules()
    assert not hasattr(gm, "lin")


def test_leaf_modules_match_their_function_spelling():
    for act, func, matches in [(torch.nn.ReLU(), lambda x: F.relu(x), 1),
                               (torch.nn.ReLU(inplace=True), lambda x: F.relu(x), 0),
                               (torch.nn.Softmax(dim=1), lambda x: F.softmax(x, dim=1), 1),
                               (torch.nn.Softmax(dim=0), lambda x: F.softmax(x, dim=1), 0)]:
        gm = fxlite.symbolic_trace(Act(act))
        assert len(replace_pattern(gm, func, lambda x: x.neg())) == matches, act
        assert len(replace_pattern(fxlite.symbolic_trace(Act(act)), func, lambda x: x.neg(),
                                   match_spellings=False)) == 0


def test_overlapping_matches_first_in_graph_order_wins():
    def model(x):
        return x.relu().relu().relu()

    pattern = fxlite.symbolic_trace(lambda x: x.relu().relu()).graph
    gm = fxlite.symbolic_trace(model)
    assert len(SubgraphMatcher(pattern, remove_overlapping_matches=False).match(gm.graph)) == 2
    found = SubgraphMatcher(pattern).match(gm.graph)
    assert [m.anchors[0].name for m in found] == ["relu_1"]
    matches = replace_pattern(gm, pattern, lambda x: x.sigmoid())
    assert [m.anchor.name for m in matches] == ["relu_1"]
    assert targets(gm) == ["sigmoid", "relu"]


def test_match_output_and_match_placeholder():
    def model(x, y):
        return torch.relu(y + 1.0) + torch.relu(x + 1.0)

    gm = fxlite.symbolic_trace(model)
    pattern = fxlite.symbolic_trace(lambda x: torch.relu(x + 1.0)).graph
    assert len(SubgraphMatcher(pattern).match(gm.graph)) == 2
    assert len(SubgraphMatcher(pattern, match_output=True).match(gm.graph)) == 0
    assert len(SubgraphMatcher(pattern, match_placeholder=True).match(gm.graph)) == 2
    gm2 = fxlite.symbolic_trace(lambda x: torch.relu(torch.relu(x) + 1.0))
    assert len(SubgraphMatcher(pattern, match_placeholder=True).match(gm2.graph)) == 0
    only = SubgraphMatcher(pattern, match_output=True, match_placeholder=True).match(gm2.graph)
    assert only == []
    gm3 = fxlite.symbolic_trace(lambda a: torch.relu(a + 1.0))
    (m,) = SubgraphMatcher(pattern, match_output=True, match_placeholder=True).match(gm3.graph)
    assert m.placeholder_nodes[0].name == "a" and m.anchors[0].op == "output"


def test_match_filters_see_the_match_and_both_graphs():
    seen = []

    def only_from_x(match, original_graph, pattern_graph):
        seen.append((original_graph, pattern_graph))
        return match.placeholder_nodes[0].name == "x"

    def model(x, y):
        return torch.relu(x + 1.0) + torch.relu(y + 1.0)

    gm = fxlite.symbolic_trace(model)
    done = replace_pattern_with_filters(gm, lambda x: torch.relu(x + 1.0), lambda x: x.sigmoid(),
                                        match_filters=[only_from_x])
    assert len(done) == 1 and done[0].nodes_map
    assert len(seen) == 2 and all(g is gm.graph for g, _ in seen)
    assert all(isinstance(p, Graph) for _, p in seen)
    assert targets(gm).count(torch.relu) == 1  # relu(y + 1) stays


def test_a_rejected_match_does_not_block_an_overlapping_one():
    def model(x):
        return x.relu().relu().relu()

    gm = fxlite.symbolic_trace(model)
    done = replace_pattern_with_filters(gm, lambda x: x.relu().relu(), lambda x: x.sigmoid(),
                                        match_filters=[lambda m, g, p: m.anchors[0].name != "relu_1"])
    assert [r.anchor.name for r in done] == ["relu_2"]
    assert targets(gm) == ["relu", "sigmoid"]


def test_replacement_callback_builds_one_replacement_per_match():
    def model(x):
        return torch.relu(x + 1.0) * torch.relu(x * 3.0 + 1.0)

    def callback(match, original_graph, pattern_graph):
        scale = 2.0 if match.placeholder_nodes[0].name == "x" else 5.0
        return fxlite.symbolic_trace(lambda x: (x + 1.0).clamp(min=0) * scale).graph

    gm = fxlite.symbolic_trace(model)
    done = replace_pattern_with_filters(gm, lambda x: torch.relu(x + 1.0), replacement_callback=callback)
    assert len(done) == 2
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), torch.relu(x + 1) * 2 * torch.relu(x * 3 + 1) * 5)


def test_replacement_attributes_are_copied_into_the_module():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.full((3,), 4.0))

        def forward(self, x):
            return torch.sigmoid(x) * self.scale

    gm = fxlite.symbolic_trace(lambda x: torch.sigmoid(x) + 1)
    assert len(replace_pattern(gm, lambda x: torch.sigmoid(x), Scale())) == 1
    assert torch.equal(gm.scale, torch.full((3,), 4.0))
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), torch.sigmoid(x) * 4 + 1)


def test_graph_is_linted_and_recompiled_after_a_rewrite():
    gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1.0))
    old_code = gm.code
    replace_pattern(gm, lambda x: torch.relu(x + 1.0), lambda x: torch.sigmoid(x))
    gm.graph.lint()
    assert gm.code != old_code and "torch.sigmoid(x)" in gm.code


def test_no_match_leaves_module_untouched():
    gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1.0))
    before, code = str(gm.graph), gm.code
    assert replace_pattern(gm, lambda x: torch.tanh(x), lambda x: x) == []
    assert str(gm.graph) == before and gm.code == code


# ---------------------------------------------------------------------- spelling-blind matching
ADD_SPELLINGS = [  # (op, target, kwargs) of `x + 1.0`
    ("call_function", operator.add, {}), ("call_function", torch.add, {}),
    ("call_method", "add", {}), ("call_function", torch.Tensor.add, {}),
    ("call_function", torch.add, {"alpha": 1})]
RELU_SPELLINGS = [  # (op, target, kwargs) of relu
    ("call_function", torch.relu, {}), ("call_function", F.relu, {"inplace": False}),
    ("call_method", "relu", {}), ("call_module", "act", {})]


def spelled(add, relu):
    """A module computing relu(x + 1.0), spelled as asked."""
    g = Graph()
    x = g.placeholder("x")
    op, target, kwargs = ADD_SPELLINGS[add]
    y = g.create_node(op, target, (x, 1.0), kwargs)
    op, target, kwargs = RELU_SPELLINGS[relu]
    g.output(g.create_node(op, target, (y,), kwargs))
    root = torch.nn.Module()
    root.act = torch.nn.ReLU()
    return fxlite.GraphModule(root, g)


@pytest.mark.parametrize("add", range(len(ADD_SPELLINGS)))
@pytest.mark.parametrize("relu", range(len(RELU_SPELLINGS)))
def test_equivalent_spellings_match_each_other(add, relu):
    gm = spelled(add, relu)
    x = torch.randn(6)
    torch.testing.assert_close(gm(x), torch.relu(x + 1.0))
    matches = replace_pattern(gm, lambda x: torch.relu(x + 1.0), lambda x: (x + 1.0).clamp(min=0))
    assert len(matches) == 1
    assert targets(gm) == [operator.add, "clamp"]
    torch.testing.assert_close(gm(x), torch.relu(x + 1.0))
    # The pattern traces to operator.add and torch.relu; with spellings off only those match.
    exact = spelled(add, relu)
    got = replace_pattern(exact, lambda x: torch.relu(x + 1.0), lambda x: x, match_spellings=False)
    assert len(got) == int(add == 0 and relu == 0)


def test_spellings_with_varargs_and_aliases():
    def model(x):
        return x.view(2, 3) + torch.reshape(x, (2, 3)) + x.reshape(2, 3) + torch.swapaxes(x.view(3, 2), 0, 1)

    gm = fxlite.symbolic_trace(model)
    assert len(replace_pattern(gm, lambda x: torch.reshape(x, (2, 3)), lambda x: x.view(2, 3) * 1)) == 2
    assert len(replace_pattern(gm, lambda x: x.transpose(0, 1), lambda x: x.t())) == 1
    x = torch.randn(6)
    torch.testing.assert_close(gm(x), model(x))


def test_different_ops_never_match_through_spellings():
    gm = fxlite.symbolic_trace(lambda x: (x - 1.0) * 2.0 + torch.sigmoid(x))
    assert replace_pattern(gm, lambda x: x + 1.0, lambda x: x) == []
    assert replace_pattern(gm, lambda x: torch.tanh(x), lambda x: x) == []
    gm = fxlite.symbolic_trace(lambda x: F.relu(x, inplace=True))  # in place: another call
    assert replace_pattern(gm, lambda x: torch.relu(x), lambda x: x) == []


# ---------------------------------------------------------------------- bad input
def test_pattern_with_dead_code_is_rejected():
    def pattern(x):
        unused = x * 2.0  # noqa: F841
        return torch.relu(x)

    gm = fxlite.symbolic_trace(lambda x: torch.relu(x))
    with pytest.raises(ValueError, match="dead code.*mul"):
        replace_pattern(gm, pattern, lambda x: x)


def test_placeholder_counts_must_agree():
    gm = fxlite.symbolic_trace(lambda x, y: x + y)
    with pytest.raises(ValueError, match="pattern takes 2 inputs .* replacement takes 1"):
        replace_pattern(gm, lambda x, y: x + y, lambda x: x)


@pytest.mark.parametrize("pattern, replacement, message", [
    (lambda x, y: torch.relu(x), lambda x, y: x, "input %y is unused"),
    (lambda x: x, lambda x: x, "returns its input"),
    (lambda x: torch.relu(x), lambda x: (x, x), "returns 1 values but the replacement returns 2"),
    (lambda x, y: (torch.relu(x), torch.relu(y)), lambda x, y: (x, y), "not connected"),
    (lambda x: 3, lambda x: x, "constant"),
])
def test_other_bad_patterns_raise_value_error(pattern, replacement, message):
    gm = fxlite.symbolic_trace(lambda x, y: torch.relu(x) + torch.relu(y))
    before = str(gm.graph)
    with pytest.raises(ValueError, match=message):
        replace_pattern(gm, pattern, replacement)
    assert str(gm.graph) == before


def test_untraceable_pattern_raises_trace_error_naming_it():
    def branchy_pattern(x):
        if x.sum() > 0:
            return torch.relu(x)
        return x

    gm = fxlite.symbolic_trace(lambda x: torch.relu(x))
    with pytest.raises(fxlite.TraceError, match="branchy_pattern"):
        replace_pattern(gm, branchy_pattern, lambda x: x)


def test_bad_arguments_raise_type_error():
    with pytest.raises(TypeError, match="GraphModule or Graph"):
        replace_pattern(torch.nn.ReLU(), lambda x: x.relu(), lambda x: x)
    gm = fxlite.symbolic_trace(lambda x: torch.relu(x))
    with pytest.raises(TypeError, match="function, Graph or GraphModule"):
        replace_pattern(gm, 42, lambda x: x)


# ---------------------------------------------------------------------- transactions
def test_replacement_that_fails_to_trace_leaves_the_graph_as_it_was():
    def broken_replacement(x):
        raise RuntimeError("boom")

    gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1.0) * 2)
    before, code = str(gm.graph), gm.code
    with pytest.raises(fxlite.TraceError, match="broken_replacement.*boom"):
        replace_pattern(gm, lambda x: torch.relu(x + 1.0), broken_replacement)
    assert str(gm.graph) == before and gm.code == code


def test_a_rewrite_that_raises_midway_is_rolled_back(monkeypatch):
    def model(x):
        for _ in range(3):
            x = torch.relu(x + 1.0) * 2.0
        return x

    gm = fxlite.symbolic_trace(model)
    before, code = str(gm.graph), gm.code
    names = [n.name for n in gm.graph.nodes]
    calls = []
    real_erase = Graph.erase_node

    def flaky_erase(self, node):
        calls.append(node)
        if len(calls) == 4:  # the second match, halfway through erasing
            raise RuntimeError("disk on fire")
        real_erase(self, node)

    monkeypatch.setattr(Graph, "erase_node", flaky_erase)
    with pytest.raises(RuntimeError, match="disk on fire"):
        replace_pattern(gm, lambda x: torch.relu(x + 1.0), lambda x: (x + 1.0).clamp(min=0))
    monkeypatch.undo()
    assert str(gm.graph) == before and gm.code == code
    assert [n.name for n in gm.graph.nodes] == names
    gm.graph.lint()
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), model(x))
    # The graph works normally afterwards, new names included.
    assert len(replace_pattern(gm, lambda x: torch.relu(x + 1.0), lambda x: (x + 1.0).clamp(min=0))) == 3
    gm.graph.lint()
    assert [n.name for n in gm.graph.nodes if n.target == "clamp"] == ["clamp", "clamp_1", "clamp_2"]


def test_a_failing_recompile_is_rolled_back(monkeypatch):
    gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1.0))
    before, code = str(gm.graph), gm.code
    real = type(gm).recompile
    state = {"fail": True}

    def recompile(self):
        if state.pop("fail", False):
            raise RuntimeError("codegen broke")
        return real(self)

    monkeypatch.setattr(type(gm), "recompile", recompile)
    with pytest.raises(RuntimeError, match="codegen broke"):
        replace_pattern(gm, lambda x: torch.relu(x + 1.0), lambda x: x.sigmoid())
    assert str(gm.graph) == before and gm.code == code


# ---------------------------------------------------------------------- explanations
def chain(x):
    a = torch.relu(x + 2.0)
    b = torch.sigmoid(a - 1.0)
    return a + b


def test_near_miss_names_the_failing_argument():
    gm = fxlite.symbolic_trace(chain)
    report = explain_no_match(gm, lambda x: torch.relu(x + 1.0))
    assert "0 matches" in report
    lines = report.splitlines()
    assert "candidate %relu (matched 2 of 3 pattern nodes)" in lines[2]
    assert "pattern node %add" in lines[2] and "argument 'other'" in lines[2]
    assert "the pattern has 1.0, the graph has 2.0" in lines[2]


def test_near_miss_names_the_failing_op():
    gm = fxlite.symbolic_trace(chain)
    report = explain_no_match(gm, lambda x: torch.tanh(x - 1.0))
    closest = report.splitlines()[2]
    assert "candidate %sigmoid" in closest and "matched 2 of 3" in closest
    assert "the op differs: the pattern computes tanh, graph node %sigmoid computes sigmoid" in closest


def test_near_miss_names_a_broken_rule():
    gm = fxlite.symbolic_trace(chain)
    report = explain_no_match(gm, lambda x: torch.sigmoid(torch.relu(x + 2.0) - 1.0))
    closest = report.splitlines()[2]
    assert "matched 5 of 5" in closest
    assert "%relu is also used by %add_1, outside the match" in closest


def test_explain_flag_prints_the_report(capsys):
    gm = fxlite.symbolic_trace(chain)
    assert replace_pattern(gm, lambda x: torch.relu(x + 1.0), lambda x: x, explain=True) == []
    out = capsys.readouterr().out
    assert "0 matches" in out and "the constant differs" in out
    replace_pattern(gm, lambda x: torch.relu(x + 2.0), lambda x: x, explain=True)
    assert "1 match at %relu" in capsys.readouterr().out


def test_explain_reports_matches_and_filters():
    gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1.0) + torch.relu(x + 1.0))
    report = explain_no_match(gm, lambda x: torch.relu(x + 1.0),
                              match_filters=[lambda m, g, p: m.anchors[0].name == "relu"])
    assert "1 match at %relu." in report
    assert "candidate %relu_1 (matched 3 of 3 pattern nodes): at the match: a match filter rejected it" in report
