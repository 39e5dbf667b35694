"""Run a list of passes over a GraphModule, checking and timing each one.

``PassManager([normalize, cse, decompose])(gm)`` runs the passes in order. After each
pass it lints the graph, regenerates ``forward``, and (optionally) compares the outputs
on example inputs with those of the module it was given. A pass that raises, leaves an
invalid graph or changes the numbers is named in the error, and the module is left as
it was: every pass runs on a deep copy, which is adopted only once all checks pass.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from tabulate import tabulate

from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import describe_value

from .diff import diff

__all__ = ["NumericsError", "PassError", "PassManager", "PassRecord"]

# A pass takes a GraphModule and returns the transformed module, or None when it worked
# in place. (An object with a ``graph_module`` attribute, like torch.fx's PassResult, works too.)
Pass = Callable[[GraphModule], Union[GraphModule, None, Any]]


class PassError(RuntimeError):
    """A pass failed: it raised, returned something odd, or left a graph that fails lint.

    Attributes:
        pass_name: the name of the pass that failed (``"<input>"`` when the module given
            to the PassManager already failed lint).
    """

    def __init__(self, pass_name: str, message: str) -> None:
        super().__init__(message)
        self.pass_name = pass_name


class NumericsError(PassError):
    """A pass changed the module's outputs on the example inputs.

    Attributes:
        pass_name: the pass after which the outputs first differed.
        max_abs_diff: the largest absolute difference found (``inf`` when shapes,
            dtypes or structure differ, or NaNs appear in only one of the two).
    """

    def __init__(self, pass_name: str, message: str, max_abs_diff: float) -> None:
        super().__init__(pass_name, message)
        self.max_abs_diff = max_abs_diff


@dataclass
class PassRecord:
    """What one pass did in the last run.

    Attributes:
        name: the pass's name.
        time_ms: wall time of the pass itself (not the copy, lint or numeric check).
        nodes_before: node count of the module the pass received.
        nodes_after: node count of its result; None if the pass failed.
        status: ``"ok"`` or a short reason for the failure.
    """

    name: str
    time_ms: float
    nodes_before: int
    nodes_after: int | None
    status: str = "ok"


def _pass_name(p: Any) -> str:
    while isinstance(p, functools.partial):
        p = p.func
    return getattr(p, "__name__", None) or type(p).__name__


def _clone(value: Any) -> Any:
    """Fresh copies of the tensors in ``value`` so that in-place ops cannot leak between runs."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _uncopyable(gm: torch.nn.Module) -> str:
    """Which attribute of ``gm`` (or of a submodule) ``copy.deepcopy`` fails on, in words."""
    for prefix, mod in gm.named_modules(remove_duplicate=False):
        items = [(k, v) for k, v in vars(mod).items() if k not in ("_modules", "_graph", "_code")]
        items += list(mod._parameters.items()) + list(mod._buffers.items())
        for key, value in items:
            if isinstance(value, dict) and key.startswith("_"):
                value_items = list(value.items())  # torch's own tables (hooks...): look inside
            else:
                value_items = [(None, value)]
            for _, v in value_items:
                try:
                    copy.deepcopy(v)
                except Exception:
                    path = f"{prefix}.{key}" if prefix else key
                    return f"the module attribute {path!r} ({type(v).__name__})"
    return "one of the module's attributes"


def _compare(ref: Any, got: Any, rtol: float | None, atol: float | None, where: str = "output"
             ) -> tuple[str, float] | None:
    """None if ``got`` matches ``ref``; else (what differs, max abs difference)."""
    inf = float("inf")
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where} is a {type(got).__name__}, expected a tensor", inf
        if ref.shape != got.shape or ref.dtype != got.dtype:
            return (f"{where} is {tuple(got.shape)} {got.dtype}, expected "
                    f"{tuple(ref.shape)} {ref.dtype}"), inf
        try:
            torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, equal_nan=True)
            return None
        except AssertionError:
            pass
        if ref.numel() == 0:
            return f"{where} differs", inf
        a, b = ref.detach().double(), got.detach().double()
        nan_mismatch = bool((a.isnan() != b.isnan()).any())
        gap = (a - b).abs().nan_to_num(nan=0.0, posinf=inf)
        return f"{where} differs", inf if nan_mismatch else float(gap.max())
    if isinstance(ref, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(ref):
            return f"{where} has a different structure", inf
        worst = None
        for i, (r, g) in enumerate(zip(ref, got)):
            bad = _compare(r, g, rtol, atol, f"{where}[{i}]")
            if bad is not None and (worst is None or bad[1] > worst[1]):
                worst = bad
        return worst
    if isinstance(ref, dict):
        if not isinstance(got, dict) or got.keys() != ref.keys():
            return f"{where} has different keys", inf
        worst = None
        for k in ref:
            bad = _compare(ref[k], got[k], rtol, atol, f"{where}[{k!r}]")
            if bad is not None and (worst is None or bad[1] > worst[1]):
                worst = bad
        return worst
    try:
        same = bool(ref == got)
    except Exception:
        same = ref is got
    return None if same else (f"{where} is {got!r}, expected {ref!r}", inf)


class PassManager:
    """Runs passes in order, with lint, optional numeric checks, timing and rollback.

    Args:
        passes: callables taking a GraphModule and returning a GraphModule, or None when
            they change it in place. May be empty; :meth:`add_pass` appends more.
        check_numerics: after each pass, run the module on ``example_inputs`` and compare
            with the outputs of the module given to the manager (``torch.testing
            .assert_close`` with ``rtol``/``atol``, NaNs equal). Raises
            :class:`NumericsError` naming the first pass that changed them.
        example_inputs: positional inputs for the numeric check (a tuple, or one tensor).
        rtol, atol: tolerances; None uses assert_close's defaults for the dtype.
        lint: run ``graph.lint()`` after each pass (and on the input).
        verbose: print one line per pass as it finishes.
        show_diff: print the nodes each pass added, removed or changed
            (:func:`fxlite.passes.diff`) as it finishes.

    Cost: each pass runs on ``copy.deepcopy`` of the current module, so the graph and
    every parameter and buffer are copied once per pass (time linear in graph size,
    and peak memory about twice the module's). That copy is what guarantees that a
    failing pass leaves nothing half-modified: the module given to the manager is never
    changed, and a failure leaves the last good result untouched.

    Example::

        pm = PassManager([normalize, cse], check_numerics=True,
                         example_inputs=(torch.randn(4, 8),))
        gm2 = pm(fxlite.symbolic_trace(model))
        pm.print_summary()
        # pass         time (ms)    nodes before    nodes after  status
        # ---------  -----------  --------------  -------------  --------
        # normalize         0.41              12             12  ok
        # cse               0.12              12              9  ok
    """

    def __init__(self, passes: Iterable[Pass] | None = None, *, check_numerics: bool = False,
                 example_inputs: Sequence[Any] | torch.Tensor | None = None,
                 rtol: float | None = None, atol: float | None = None, lint: bool = True,
                 verbose: bool = False, show_diff: bool = False) -> None:
        if passes is not None and (callable(passes) or isinstance(passes, (str, bytes))
                                   or not isinstance(passes, Iterable)):
            fix = f"; wrap one pass in a list: PassManager([{getattr(passes, '__name__', 'p')}])" \
                if callable(passes) else ""
            raise TypeError(f"PassManager: passes must be a list of passes, not "
                            f"{describe_value(passes)}{fix}")
        self.passes: list[Pass] = list(passes or [])
        for p in self.passes:
            self._check_callable(p)
        if check_numerics and example_inputs is None:
            raise ValueError("PassManager: check_numerics=True needs example_inputs")
        if (rtol is None) != (atol is None):
            raise ValueError("PassManager: give both rtol and atol, or neither")
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        self.check_numerics = check_numerics
        self.example_inputs = tuple(example_inputs) if example_inputs is not None else None
        self.rtol, self.atol = rtol, atol
        self.lint = lint
        self.verbose = verbose
        self.show_diff = show_diff
        self.records: list[PassRecord] = []
        # The result of the last pass that succeeded in the last run (the input module if
        # none did): what a caller can keep after catching a PassError.
        self.last_good: GraphModule | None = None

    @staticmethod
    def _check_callable(p: Any) -> None:
        if not callable(p):
            raise TypeError(f"PassManager: a pass must be callable, not {describe_value(p)}")

    def add_pass(self, p: Pass) -> None:
        """Append ``p`` to the list of passes.

        Args:
            p: a callable taking a GraphModule and returning a GraphModule or None.

        Example::

            pm = PassManager([])
            pm.add_pass(cse)
        """
        self._check_callable(p)
        self.passes.append(p)

    def _run_module(self, gm: GraphModule) -> Any:
        with torch.no_grad():
            return gm(*_clone(self.example_inputs))

    def __call__(self, gm: GraphModule) -> GraphModule:
        """Run every pass on ``gm`` and return the result; ``gm`` itself is not changed.

        Args:
            gm: the module to transform.

        Returns:
            The transformed module (``gm`` itself when there are no passes).

        Raises:
            PassError: a pass raised (the original exception is its ``__cause__``),
                returned something other than a GraphModule or None, or left a graph
                that fails lint.
            NumericsError: with ``check_numerics``, a pass changed the outputs.
        """
        expect_graph_module(gm, "PassManager")
        self.records = []
        if self.lint:
            try:
                gm.graph.lint()
            except Exception as e:
                raise PassError("<input>", f"the module given to PassManager fails lint "
                                           f"before any pass ran: {e}") from e
        reference = self._run_module(gm) if self.check_numerics else None
        current = self.last_good = gm
        for p in self.passes:
            current = self.last_good = self._run_one(p, current, reference)
        return current

    def _run_one(self, p: Pass, current: GraphModule, reference: Any) -> GraphModule:
        name = _pass_name(p)
        before = len(current.graph.nodes)
        record = PassRecord(name, 0.0, before, None, "raised")
        self.records.append(record)
        try:
            work = copy.deepcopy(current)
        except Exception as e:
            record.status = "copy failed"
            raise PassError(name, f"pass {name!r} did not run: PassManager runs each pass on a "
                                  f"deep copy, so that a failing pass leaves the module as it was, "
                                  f"and {_uncopyable(current)} cannot be deep-copied "
                                  f"({type(e).__name__}: {e}); remove it before running the "
                                  "passes, or give its type a __deepcopy__") from e
        start = time.perf_counter()
        try:
            result = p(work)
        except Exception as e:
            record.time_ms = (time.perf_counter() - start) * 1e3
            record.status = f"raised {type(e).__name__}"
            raise PassError(name, f"pass {name!r} raised {type(e).__name__}: {e}; "
                                  f"the module is left as it was before the pass") from e
        record.time_ms = (time.perf_counter() - start) * 1e3
        if result is None:
            result = work
        elif not isinstance(result, GraphModule) and isinstance(
                getattr(result, "graph_module", None), GraphModule):
            result = result.graph_module
        if not isinstance(result, GraphModule):
            record.status = "bad result"
            raise PassError(name, f"pass {name!r} returned a {type(result).__name__}; a pass "
                                  f"must return a GraphModule or None (changed in place)")
        if self.lint:
            try:
                result.graph.lint()
            except Exception as e:
                record.status = "lint failed"
                raise PassError(name, f"pass {name!r} left a graph that fails lint: {e}") from e
        try:
            result.recompile()  # a pass that edited the graph in place may not have
        except Exception as e:
            record.status = "codegen failed"
            raise PassError(name, f"pass {name!r} left a graph whose code cannot be "
                                  f"generated: {type(e).__name__}: {e}") from e
        record.nodes_after = len(result.graph.nodes)
        if self.check_numerics:
            self._check(name, record, result, reference)
        record.status = "ok"
        if self.verbose:
            print(f"[PassManager] {name}: {record.time_ms:.2f} ms, "
                  f"{before} -> {record.nodes_after} nodes")
        if self.show_diff:  # `current` is untouched: the pass ran on a copy
            print(f"[PassManager] {name}: ", end="")
            diff(current, result)
        return result

    def _check(self, name: str, record: PassRecord, gm: GraphModule, reference: Any) -> None:
        try:
            got = self._run_module(gm)
        except Exception as e:
            record.status = "run failed"
            raise NumericsError(name, f"after pass {name!r} the module fails on the example "
                                      f"inputs: {type(e).__name__}: {e}", float("inf")) from e
        bad = _compare(reference, got, self.rtol, self.atol)
        if bad is not None:
            what, diff = bad
            record.status = "numerics"
            raise NumericsError(name, f"pass {name!r} changed the numerics: {what} "
                                      f"(max abs difference {diff:.6g})", diff)

    def summary(self) -> str:
        """The last run as a table: pass, time (ms), node counts before/after, status.

        Returns:
            The table text (tabulate's ``simple`` format); only headers before any run.
        """
        rows = [[r.name, f"{r.time_ms:.3f}", r.nodes_before,
                 "-" if r.nodes_after is None else r.nodes_after, r.status] for r in self.records]
        return tabulate(rows, headers=["pass", "time (ms)", "nodes before", "nodes after", "status"],
                        tablefmt="simple", disable_numparse=True)

    def print_summary(self) -> None:
        """Print :meth:`summary`."""
        print(self.summary())
