"""``torch.cond`` inside a compiled function: one node that runs one of two graphs.

The capture records each branch as a graph of its own (``capture.Recorder.record_cond``)
and puts one ``call_function`` node in the caller's graph whose target is a
:class:`CondOp`::

    %lt   = call_method[lt](%sum, 0)
    %cond = call_function[CondOp(true: 1 node, false: 1 node)](%lt, %b)

The predicate is read when the node runs (one device sync, as in eager ``torch.cond``),
and the segment stays whole, so ``fullgraph=True`` accepts it. The compile pipeline
compiles both branches with :meth:`CondOp.compiled`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from fxlite.codegen.capture.records import result_leaves
from fxlite.codegen.capture.structure import unflatten

from fxlite.graph_module import GraphModule

__all__ = ["CondOp"]


class _Branch:
    """One branch: a callable over the flat operand tensors, and how to rebuild its result."""

    def __init__(self, recording: Any, run: Callable[..., Any] | None = None) -> None:
        self.recording = recording
        self.gm = GraphModule(recording.holder, recording.graph, "cond_branch")
        self.run = run if run is not None else self.gm

    def __call__(self, *operands: Any) -> Any:
        flat = self.run(*operands)
        return unflatten(self.recording.out_spec, result_leaves(self.recording.out_refs, flat))


class CondOp:
    """Calls the true or the false branch graph, by the predicate's value."""

    __name__ = "cond"

    def __init__(self, true_rec: Any, false_rec: Any, example: list[torch.Tensor],
                 branches: tuple[_Branch, _Branch] | None = None) -> None:
        self.true_rec, self.false_rec, self.example = true_rec, false_rec, example
        self.branches = branches or (_Branch(true_rec), _Branch(false_rec))

    def __call__(self, pred: Any, *operands: Any) -> Any:
        return self.branches[0 if bool(pred) else 1](*operands)

    def __repr__(self) -> str:
        count = lambda r: sum(1 for n in r.graph.nodes if n.op not in ("placeholder", "output"))
        return f"CondOp(true: {count(self.true_rec)} nodes, false: {count(self.false_rec)} nodes)"

    @property
    def graphs(self) -> tuple[GraphModule, GraphModule]:
        """The two branch graphs, as recorded."""
        return self.branches[0].gm, self.branches[1].gm

    def compiled(self, compile_branch: Callable[[GraphModule, list[Any]], Callable[..., Any]]
                 ) -> CondOp:
        """A copy whose branches run what ``compile_branch(gm, example_inputs)`` returns."""
        runs = tuple(_Branch(rec, compile_branch(_Branch(rec).gm, list(self.example)))
                     for rec in (self.true_rec, self.false_rec))
        return CondOp(self.true_rec, self.false_rec, self.example, runs)  # type: ignore[arg-type]
