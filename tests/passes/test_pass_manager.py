"""PassManager: order, in-place and returning passes, lint, numerics, rollback, timing, summary."""

from __future__ import annotations

import functools
import operator
import time

import pytest
import torch
from fxlite.passes.cse import cse
from fxlite.passes.decompose import decompose
from fxlite.passes.normalize import normalize
from fxlite.passes.pass_manager import NumericsError, PassError, PassManager, PassRecord

import fxlite
from fxlite.graph_module import GraphModule


def _f(x, y):
    a = x + y
    b = x + y            # a duplicate for cse
    return torch.relu(a * b)


def _gm() -> GraphModule:
    return fxlite.symbolic_trace(_f)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 5), torch.randn(4, 5)


def _add_to_sub(gm: GraphModule) -> None:
    """In place: every ``+`` becomes ``-`` (changes the numbers)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.add:
            n.target = operator.sub


def _append_neg_neg(gm: GraphModule) -> GraphModule:
    """Returns the module with ``-(-out)`` appended (same numbers, two more nodes)."""
    out = gm.graph.output_node()
    val = out.args[0]
    with gm.graph.inserting_before(out):
        nn = gm.graph.call_function(operator.neg, (gm.graph.call_function(operator.neg, (val,)),))
    out.args = (nn,)
    gm.recompile()
    return gm


def test_runs_passes_in_order_and_leaves_input_alone() -> None:
    seen: list[tuple[str, int]] = []

    def first(gm):
        seen.append(("first", len(gm.graph.nodes)))
        return _append_neg_neg(gm)

    def second(gm):
        seen.append(("second", len(gm.graph.nodes)))   # sees first's result

    gm = _gm()
    code, count = gm.code, len(gm.graph.nodes)
    out = PassManager([first, second])(gm)
    assert seen == [("first", count), ("second", count + 2)]
    assert gm.code == code and len(gm.graph.nodes) == count
    assert out is not gm and len(out.graph.nodes) == count + 2
    x, y = _inputs()
    torch.testing.assert_close(out(x, y), _f(x, y))


def test_in_place_pass_is_recompiled() -> None:
    # _add_to_sub edits targets without recompiling; the manager regenerates forward.
    out = PassManager([_add_to_sub])(_gm())
    assert "x - y" in out.code and "x + y" not in out.code
    x, y = _inputs()
    torch.testing.assert_close(out(x, y), torch.relu((x - y) * (x - y)))


def test_summary_lists_passes_times_and_counts(capsys) -> None:
    def slow(gm):
        time.sleep(0.02)

    gm = _gm()
    before = len(gm.graph.nodes)
    pm = PassManager([cse, slow])
    out = pm(gm)
    after_cse = len(out.graph.nodes)
    assert after_cse < before      # the duplicate x + y is gone
    assert [r.name for r in pm.records] == ["cse", "slow"]
    assert pm.records[0] == PassRecord("cse", pm.records[0].time_ms, before, after_cse, "ok")
    assert (pm.records[1].nodes_before, pm.records[1].nodes_after) == (after_cse, after_cse)
    assert pm.records[1].time_ms >= 20.0
    assert all(r.time_ms >= 0.0 for r in pm.records)
    table = pm.summary()
    lines = table.splitlines()
    assert lines[0].split() == ["pass", "time", "(ms)", "nodes", "before", "nodes", "after", "status"]
    cse_row = next(line.split() for line in lines if line.startswith("cse"))
    assert cse_row[0] == "cse" and cse_row[2:] == [str(before), str(after_cse), "ok"]
    assert float(cse_row[1]) == pytest.approx(pm.records[0].time_ms, abs=1e-3)
    slow_row = next(line.split() for line in lines if line.startswith("slow"))
    assert float(slow_row[1]) >= 20.0
    pm.print_summary()
    assert capsys.readouterr().out.strip() == table.strip()


def test_empty_manager_and_add_pass() -> None:
    gm = _gm()
    pm = PassManager([])
    assert pm(gm) is gm
    assert pm.records == []
    assert pm.summary().splitlines()[0].split() == \
        ["pass", "time", "(ms)", "nodes", "before", "nodes", "after", "status"]
    assert len(pm.summary().splitlines()) == 2        # headers and rule, no rows
    pm.add_pass(functools.partial(_append_neg_neg))
    out = pm(gm)
    assert [r.name for r in pm.records] == ["_append_neg_neg"]
    assert len(out.graph.nodes) == len(gm.graph.nodes) + 2
    with pytest.raises(TypeError, match="callable"):
        pm.add_pass("cse")
    with pytest.raises(TypeError, match="callable"):
        PassManager([cse, 3])
    with pytest.raises(TypeError, match="GraphModule"):
        pm(_f)


def test_lint_failure_names_the_pass() -> None:
    def rename_clash(gm):
        nodes = list(gm.graph.nodes)
        nodes[2].name = nodes[0].name          # two nodes named "x": lint must catch it

    gm = _gm()
    code = gm.code
    pm = PassManager([cse, rename_clash])
    with pytest.raises(PassError, match=r"pass 'rename_clash' left a graph that fails lint") as err:
        pm(gm)
    assert err.value.pass_name == "rename_clash"
    assert "duplicate name" in str(err.value)
    assert gm.code == code
    assert [r.status for r in pm.records] == ["ok", "lint failed"]
    assert pm.last_good is not None and len(pm.last_good.graph.nodes) == pm.records[0].nodes_after


def test_input_failing_lint_is_reported() -> None:
    gm = _gm()
    list(gm.graph.nodes)[1].name = "x"
    with pytest.raises(PassError, match="before any pass ran") as err:
        PassManager([cse])(gm)
    assert err.value.pass_name == "<input>"


def test_numeric_check_names_the_breaking_pass() -> None:
    x, y = _inputs()
    pm = PassManager([cse, _append_neg_neg, _add_to_sub, normalize], check_numerics=True,
                     example_inputs=(x, y))
    with pytest.raises(NumericsError, match=r"pass '_add_to_sub' changed the numerics") as err:
        pm(_gm())
    assert err.value.pass_name == "_add_to_sub"
    expected = (torch.relu((x + y) * (x + y)) - torch.relu((x - y) * (x - y))).abs().max().item()
    assert err.value.max_abs_diff == pytest.approx(expected, rel=1e-6)
    assert f"max abs difference {err.value.max_abs_diff:.6g}" in str(err.value)
    assert [r.status for r in pm.records] == ["ok", "ok", "numerics"]


def test_numeric_check_passes_real_pipeline_and_tolerances() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.LayerNorm(6),
                                torch.nn.Softmax(-1)).eval()
    x = torch.randn(3, 6)
    gm = fxlite.symbolic_trace(model)
    pm = PassManager([normalize, decompose, cse], check_numerics=True, example_inputs=x)
    out = pm(gm)
    torch.testing.assert_close(out(x), model(x))
    assert [r.status for r in pm.records] == ["ok", "ok", "ok"]

    def nudge(gm):
        """Scale the output by (1 + 1e-3)."""
        o = gm.graph.output_node()
        with gm.graph.inserting_before(o):
            o.args = (gm.graph.call_function(operator.mul, (o.args[0], 1.001)),)

    with pytest.raises(NumericsError, match="'nudge'"):
        PassManager([nudge], check_numerics=True, example_inputs=x)(gm)
    loose = PassManager([nudge], check_numerics=True, example_inputs=x, rtol=1e-2, atol=1e-2)
    loose(gm)
    assert loose.records[0].status == "ok"
    with pytest.raises(ValueError, match="example_inputs"):
        PassManager([nudge], check_numerics=True)
    with pytest.raises(ValueError, match="rtol and atol"):
        PassManager([nudge], rtol=1e-3)


def test_numeric_check_catches_structure_and_run_failures() -> None:
    x, y = _inputs()

    def to_tuple(gm):
        o = gm.graph.output_node()
        o.args = ((o.args[0], o.args[0]),)

    with pytest.raises(NumericsError, match="output is a tuple, expected a tensor") as err:
        PassManager([to_tuple], check_numerics=True, example_inputs=(x, y))(_gm())
    assert err.value.max_abs_diff == float("inf")

    def bad_call(gm):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is torch.relu:
                n.args = (n.args[0], n.args[0])        # relu takes one argument

    with pytest.raises(NumericsError, match="'bad_call' the module fails"):
        PassManager([bad_call], check_numerics=True, example_inputs=(x, y))(_gm())


def test_raising_pass_leaves_the_graph_unchanged() -> None:
    def half_done(gm):
        _add_to_sub(gm)
        gm.recompile()
        raise ValueError("gave up halfway")

    gm = _gm()
    code = gm.code
    x, y = _inputs()
    pm = PassManager([half_done])
    with pytest.raises(PassError, match=r"pass 'half_done' raised ValueError: gave up halfway") as err:
        pm(gm)
    assert isinstance(err.value.__cause__, ValueError)
    assert err.value.pass_name == "half_done"
    assert gm.code == code and "x + y" in gm.code
    torch.testing.assert_close(gm(x, y), _f(x, y))
    assert pm.records[0].status == "raised ValueError" and pm.records[0].nodes_after is None
    assert pm.last_good is gm
    assert "raised ValueError" in pm.summary()


def test_bad_results_and_pass_result_objects() -> None:
    class Result:  # shaped like torch.fx's PassResult
        def __init__(self, graph_module, modified):
            self.graph_module, self.modified = graph_module, modified

    out = PassManager([lambda gm: Result(_append_neg_neg(gm), True)])(_gm())
    assert len(out.graph.nodes) == len(_gm().graph.nodes) + 2

    with pytest.raises(PassError, match="returned a int"):
        PassManager([lambda gm: 3])(_gm())


def test_verbose_prints_each_pass(capsys) -> None:
    PassManager([cse], verbose=True)(_gm())
    line = capsys.readouterr().out.strip()
    assert line.startswith("[PassManager] cse:") and "nodes" in line
