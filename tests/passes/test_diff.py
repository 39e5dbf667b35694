"""fxlite.passes.diff and PassManager(show_diff=True)."""

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from fxlite.passes import GraphDiff, PassError, PassManager, diff, normalize
from fxlite.passes.diff import describe_node

import fxlite as fx


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).transpose(0, 1)


def _relu_to_gelu(gm):
    for node in gm.graph.find_nodes(op="call_function", target=torch.relu):
        with gm.graph.inserting_before(node):
            gelu = gm.graph.call_function(F.gelu, node.args, {"approximate": "tanh"})
        node.replace_all_uses_with(gelu)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


def test_diff_lists_added_removed_and_changed_nodes(capsys):
    before = fx.symbolic_trace(Block())
    after = _relu_to_gelu(copy.deepcopy(before))
    d = diff(before, after)
    assert d.removed == [("relu", "torch.relu(fc1)")]
    assert d.added == [("gelu", "torch.nn.functional.gelu(fc1, approximate='tanh')")]
    assert d.changed == [("fc2", "self.fc2(relu)", "self.fc2(gelu)")]
    assert capsys.readouterr().out.splitlines() == [
        "1 added, 1 removed, 1 changed",
        "- relu = torch.relu(fc1)",
        "+ gelu = torch.nn.functional.gelu(fc1, approximate='tanh')",
        "~ fc2 = self.fc2(relu)  ->  self.fc2(gelu)"]
    assert diff(before.graph, after.graph, print_output=False) == d  # graphs work too


def test_no_change_is_falsy_and_says_so(capsys):
    gm = fx.symbolic_trace(Block())
    d = diff(gm, copy.deepcopy(gm))
    assert not d and isinstance(d, GraphDiff)
    assert capsys.readouterr().out == "0 added, 0 removed, 0 changed\n"


def test_each_opcode_has_a_statement():
    gm = fx.symbolic_trace(Block())
    g = gm.graph
    texts = {n.name: describe_node(n) for n in g.nodes}
    assert texts == {"x": "placeholder", "fc1": "self.fc1(x)", "relu": "torch.relu(fc1)",
                     "fc2": "self.fc2(relu)", "transpose": "fc2.transpose(0, 1)",
                     "output": "return transpose"}
    with g.inserting_before(g.output_node()):
        w = g.get_attr("fc1.weight")
    assert describe_node(w) == "self.fc1.weight"


def test_long_lines_are_cut_to_the_width():
    g1, g2 = fx.Graph(), fx.Graph()
    for g, k in ((g1, 1), (g2, 2)):
        x = g.placeholder("x")
        g.output(g.call_function(operator.add, (x, "y" * 200 * k)))
    text = diff(g1, g2, print_output=False).format(width=100)
    assert max(map(len, text.splitlines())) == 100 and text.endswith("...")
    assert "y" * 400 in diff(g1, g2, print_output=False).format(width=None)


def test_diff_rejects_other_objects():
    with pytest.raises(TypeError, match="diff expects fxlite Graphs or GraphModules, not int"):
        diff(1, 2)


def test_pass_manager_show_diff_prints_each_pass(capsys):
    gm = fx.symbolic_trace(lambda x: (x + x) * 2)
    out = PassManager([normalize, _relu_to_gelu], show_diff=True)(gm)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[PassManager] normalize: 0 added, 0 removed, 2 changed"
    assert "~ add = operator.add(x, x)  ->  torch.add(x, x)" in lines
    assert lines[-1] == "[PassManager] _relu_to_gelu: 0 added, 0 removed, 0 changed"
    assert isinstance(out, fx.GraphModule)


def test_pass_manager_prints_no_diff_for_a_pass_that_fails(capsys):
    def broken(gm):
        raise ValueError("no")

    with pytest.raises(PassError):
        PassManager([broken], show_diff=True)(fx.symbolic_trace(lambda x: x + 1))
    assert capsys.readouterr().out == ""
