"""The lowering pipeline's two pass lists (codegen/lower/pipeline.py), their runner, and the one
tolerance table of the kernel check (codegen/lower/accuracy.py)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from fxlite.codegen.lower import pipeline, segment
from fxlite.codegen.lower.accuracy import TOLERANCE, Tolerance, assert_same
from fxlite.codegen.lower.pipeline import (
    BACKWARD_PASSES,
    FORWARD_PASSES,
    Lowering,
    Pass,
    run_passes,
)
from fxlite.codegen.lower.segment import compile_segment
from fxlite.passes import PassError
from test_cse_fold import window_mask

import fxlite


def _listed(column: int) -> list[str]:
    """The pass names the module docstring's table shows in one column (0: forward)."""
    lines = pipeline.__doc__.splitlines()
    header = next(line for line in lines if "BACKWARD_PASSES (" in line)
    split = header.index("BACKWARD_PASSES")
    names = []
    for line in lines[lines.index(header) + 1:]:
        if line and not line.startswith("    "):
            break
        cell = line[4:split] if column == 0 else line[split:]  # a name, then what it does
        if re.match(r"[a-z_0-9]+\b", cell):
            names.append(cell.split()[0])
    return names


def test_the_docstring_shows_both_lists_as_they_are():
    assert _listed(0) == [p.name for p in FORWARD_PASSES]
    assert _listed(1) == [p.name for p in BACKWARD_PASSES]


def _traced() -> fxlite.GraphModule:
    return fxlite.symbolic_trace(lambda x: torch.relu(x) + 1)


def _misorder(gm, low):
    """A broken pass: relu's ``+ 1`` moved before the relu it reads."""
    relu, add = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    relu.prepend(add)


def test_a_pass_that_breaks_the_graph_is_named_under_lint(monkeypatch):

    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)  # FXLITE_LINT alone turns it on
    monkeypatch.setenv("FXLITE_LINT", "1")
    gm = _traced()
    with pytest.raises(PassError) as err:
        run_passes([Pass("ok", lambda gm, low: None), Pass("misorder", _misorder)], gm,
                   Lowering([]))
    assert err.value.pass_name == "misorder"


def _recorded() -> fxlite.GraphModule:
    """The segment fxlite.compile records for ``relu(x) + 1``."""
    fn = fxlite.compile(lambda x: torch.relu(x) + 1, backend="python")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            fn(torch.randn(4))
    return fn._last[0].gm


@pytest.mark.parametrize("lint", [True, False])
def test_a_segment_whose_pass_breaks_its_graph_fails_under_lint_and_falls_back_without(
        monkeypatch, lint):
    # the segment catches the pipeline's failures and runs its recorded ops; a lint
    # failure it lets through, so that in tests a pass that breaks a graph fails the test
    monkeypatch.setattr(segment, "FORWARD_PASSES", (Pass("misorder", _misorder), *FORWARD_PASSES))
    monkeypatch.setenv("FXLITE_LINT", "1" if lint else "0")
    if not lint:
        monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    x, said = torch.randn(4), []
    if lint:
        with pytest.raises(PassError) as err:
            compile_segment(_recorded(), [x], warn=said.append)
        assert err.value.pass_name == "misorder"
        return
    compiled = compile_segment(_recorded(), [x], warn=said.append)
    assert said == compiled.fallbacks and "the compile pipeline failed" in said[0], said
    assert compiled.kernels == []
    torch.testing.assert_close(compiled.run(x)[0], torch.relu(x) + 1)


def test_through_fxlite_compile_a_pass_that_breaks_its_graph_fails_the_test(monkeypatch):
    # compile.py's own catch-all (a path whose recording cannot be replayed runs in eager)
    # lets the lint failure through too
    monkeypatch.setattr(segment, "FORWARD_PASSES", (Pass("misorder", _misorder), *FORWARD_PASSES))
    fn = fxlite.compile(lambda x: torch.relu(x) + 1)
    with pytest.raises(PassError) as err:
        fn(torch.randn(4))
    assert err.value.pass_name == "misorder"


def test_passes_run_in_order_where_wanted_and_adopt_new_modules():
    seen = []
    new = _traced()
    passes = [Pass("first", lambda gm, low: seen.append("first")),
              Pass("skipped", lambda gm, low: seen.append("skipped"), when=lambda gm, low: False),
              Pass("replace", lambda gm, low: new),
              Pass("last", lambda gm, low: seen.append(gm is new))]
    assert run_passes(passes, _traced(), Lowering([])) is new
    assert seen == ["first", True]


def test_one_tolerance_table_judges_a_value_by_its_dtype_or_a_looser_one():
    x = torch.ones(8)
    assert_same(x + 5e-6, x)  # float32: 1e-5
    with pytest.raises(AssertionError, match="max abs difference"):
        assert_same(x + 1e-3, x)
    assert_same(x + 1e-3, x, through=torch.bfloat16)  # computed in bfloat16: its tolerance
    with pytest.raises(AssertionError):
        assert_same(x.double() + 1e-6, x.double())  # float64: 1e-7
    assert set(TOLERANCE) == {torch.bfloat16, torch.float16, torch.float32, torch.float64}
    assert all(isinstance(t, Tolerance) for t in TOLERANCE.values())


def shifted_window_scores(scores):
    """Attention scores plus Swin's shifted-window mask (``window_mask``), then softmax."""
    return torch.softmax(window_mask(scores), dim=-1)


def test_a_mask_made_from_sizes_is_computed_once_and_never_written():
    c = fxlite.compile(shifted_window_scores)
    for _ in range(4):  # fresh inputs; the folded mask is read, never written
        scores = torch.randn(3, 4, 16, 16)
        torch.testing.assert_close(c(scores), shifted_window_scores(scores))
    assert "_folded_" in c.code and "setitem" not in c.code and "masked_fill" not in c.code
    assert c.fallbacks == [] and len(c.kernels) == 1  # the add and the softmax


def test_fold_sizes_leaves_the_graph_when_evaluating_fails(monkeypatch):
    """A failing evaluation is the program's own error: it happens when the graph runs."""
    def boom(*a, **k):
        raise RuntimeError("no")

    monkeypatch.setattr(pipeline, "fold_constants", boom)
    c = fxlite.compile(shifted_window_scores)
    scores = torch.randn(3, 4, 16, 16)
    for _ in range(2):
        torch.testing.assert_close(c(scores), shifted_window_scores(scores))
    assert "setitem" in c.code and c.fallbacks == []
