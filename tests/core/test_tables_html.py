"""Tables that fit a width, targets by qualified name, and the HTML views for Jupyter."""

import operator
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.report import KernelReport
from fxlite.passes import ShapeProp

import fxlite as fx
from fxlite.examples import example_input, make_example
from fxlite.viz.html import graph_html, table_html
from fxlite.viz.tabular import fit_table, qualified_name, tabular


@pytest.mark.parametrize("target, name", [
    (torch.softmax, "torch.softmax"), (torch.relu, "torch.relu"),
    (F.gelu, "torch.nn.functional.gelu"), (F.layer_norm, "torch.nn.functional.layer_norm"),
    (operator.add, "operator.add"), (torch.Tensor.add, "torch.Tensor.add"),
    (getattr, "builtins.getattr"), ("relu", "relu"), ("fc1.linear", "fc1.linear"),
])
def test_targets_print_by_qualified_name(target, name):
    assert qualified_name(target) == name


def test_qualified_name_of_a_user_function_is_module_and_qualname():
    def helper(x):
        return x

    assert qualified_name(helper) == f"{__name__}.{helper.__qualname__}"


def test_graph_table_fits_the_width_and_shows_no_object_reprs():
    gm = fx.symbolic_trace(make_example())
    ShapeProp(gm).propagate(example_input())
    for width in (100, 80):
        text = tabular(gm.graph, width=width)
        lines = text.splitlines()
        assert max(map(len, lines)) <= width
        # One dtype everywhere: said once under the table instead of in a column.
        assert lines[0].split() == ["opcode", "name", "target", "args", "kwargs", "shape"]
        assert len(lines) == 2 + len(gm.graph.nodes) + 1 and lines[-1] == "(every tensor is float32)"
        assert " at 0x" not in text and "<built-in" not in text
    rows = {line.split()[1]: line for line in tabular(gm.graph, width=100).splitlines()[2:-1]}
    assert rows["softmax"].split()[2] == "torch.softmax" and rows["softmax"].endswith(" 2x4x4")
    # Mixed dtypes keep the column.
    gm2 = fx.symbolic_trace(lambda x: (x * 2).to(torch.float64))
    ShapeProp(gm2).propagate(torch.randn(3))
    mixed = tabular(gm2.graph, width=100).splitlines()
    assert mixed[0].split()[-2:] == ["shape", "dtype"] and mixed[-1].endswith("float64")
    # print_tabular keeps torch.fx's format (str(target)), whatever its width.
    assert "<built-in method softmax" in tabular(gm.graph)


def test_fit_table_cuts_or_wraps_and_keeps_what_it_is_told_to():
    headers = ["name", "ops", "note"]
    rows = [["kernel_with_a_long_name", "add, mul, relu, exp, sum, div, sub", "x" * 50]]
    text = fit_table(headers, rows, width=60, wrap=["ops"], keep=["name"])
    lines = text.splitlines()
    assert max(map(len, lines)) <= 60
    assert "kernel_with_a_long_name" in lines[2]           # kept whole
    assert lines[2].rstrip().endswith("...")               # the note was cut
    ops = " ".join(line[25:].split("  ")[0].strip() for line in lines[2:])
    assert ops.split() == "add, mul, relu, exp, sum, div, sub".split()  # wrapped, nothing lost
    assert fit_table(["a"], [["b"]], width=100) == "a\n-\nb"


def test_graph_html_is_an_escaped_table_with_qualified_targets(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no Graphviz: table only
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.softmax, (x, -1))
    z = g.call_method("<script>alert(1)</script>", (y,))
    g.output(z)
    html = g._repr_html_()
    assert html.count("<tr>") == len(g.nodes) + 1
    assert "<td>torch.softmax</td>" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<svg" not in html


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")
def test_graph_html_has_a_drawing_when_graphviz_is_there():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    html = graph_html(gm.graph)
    assert html.count("<svg") == 1 and "</svg>" in html
    assert html.index("<table>") < html.index("<svg")


def test_table_html_escapes_cells_and_caption():
    html = table_html(["a&b"], [["<i>x</i>"]], caption="<b>c</b>")
    assert "<th>a&amp;b</th>" in html and "<td>&lt;i&gt;x&lt;/i&gt;</td>" in html
    assert "<caption>&lt;b&gt;c&lt;/b&gt;</caption>" in html


def test_kernel_report_is_text_and_html():
    kernel = SimpleNamespace(name="triton_fused_0", kind="pointwise", nodes=["add", "relu"],
                             source="@triton.jit\ndef triton_fused_0(x_ptr):\n    x < 1\n")
    headers = ["kernel", "kind", "fused ops", "inputs", "outputs", "bytes moved"]
    report = KernelReport(headers, [["triton_fused_0", "pointwise", "add, relu", "4x8", "4x8",
                                     "256"]], [(kernel.name, kernel.source)])
    assert isinstance(report, str) and report.splitlines()[0].split()[:2] == ["kernel", "kind"]
    html = report._repr_html_()
    assert html.count("<tr>") == 2 and "<td>add, relu</td>" in html
    assert "<details><summary>triton_fused_0 source</summary>" in html
    assert "x &lt; 1" in html
    assert KernelReport(headers, [], []).startswith("no kernels")
