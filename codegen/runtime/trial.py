"""Never slower than eager: a segment's kernels must beat its recorded ops on real calls.

Fused kernels usually win, but not always: tiny tensors, many small groups, or a training
step whose groups each add an autograd node can cost more host time than the kernels save
on the device. So on a GPU a compiled segment starts on trial, each user call running one
side once::

    calls 1-2: compiled, recorded (warm-ups, not timed)
    calls 3-5: compiled, timed as a block      calls 6-8: recorded, timed as a block
    then: the faster one runs every later call (from call 9); when the two are within
    10%, one more block each (calls 9-14) decides, on both blocks' times

(The calls are the trial's own; the compiled function's first call, which compiles and
checks the kernels, comes before them, so the winner runs from the user's tenth call.)
Each side's first call is left out: there the compiled side writes its straight-line
forward for the call's layout (``codegen/runtime/straight_line.py``: 30 to 40 ms for
vit_b_16, convnext_tiny and resnet50 on an H200 host, against 3 to 8 ms for a later
call), and the recorded side ran up to 1.3x its later calls. An earlier trial warmed up
with five calls, when the compiled side wrote its forward twice and the recorded side's
first two calls took 145 and 55 ms for vit_b_16; neither happens now (measured at
52bcb3b).

A block in which the compiled side writes a forward again (its kernels' launches were not
all prepared, or the attributes' layouts changed) is void, and run again; so is a block
with a call at sizes its side has not run before (a Dynamo graph with symbolic sizes,
given a new sequence length: its first call writes a straight line again, and Triton may
compile its kernels for the new sizes). Measured on GPT-2 124M under
``fxlite.compile(dynamic=True)`` at four lengths, before this: the kernels' blocks took
126 ms a call against the recorded ops' 13.7, and the kernels lost. After ``_VOIDS`` void
blocks the blocks count as they come (a program whose sizes change on every call would
otherwise stay on trial).

A block is three consecutive calls of one side, timed from a synchronized start to a
synchronized end, so that the host's launches of one call overlap the GPU's work on the
last, as in a loop of calls: timed one at a time with the GPU idle at each start, kernels
that save GPU time at some host cost lost to the recorded ops (convnext_tiny on an H200:
6.94 ms against 5.99 a call, while in a loop they took 4.50 against eager's 5.55). A
program that synchronizes between calls (``loss.item()``) gets no such overlap, and its
blocks measure that too. Nothing runs twice, so no call does more work
than its side's (an earlier trial ran each timed call three times over, and vit_b_16's
calls 5-10 did 3.6 times the matmuls of a call). What the program does between calls
(its other segments, its Python) falls in the blocks of both sides alike.

Under ``mode="reduce-overhead"`` a training segment's two sides both replay from CUDA
graphs while on trial, one side after the other (``GraphedTrial``), so that GPU time
decides rather than the kernels' host cost.

Both sides give eager's results (the compiled one was checked; the recorded one is the
user's own ops), so the trial costs only the synchronizations of its blocks. When the
recorded ops win, the segment's kernels are dropped and ``fallbacks`` says why. Recorded
ops that carry channels-last convolutions then go on a second trial of the same shape,
against the same ops without that rewrite (``_layout_trial``; the trial's calls 9-16 or
later).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from fxlite.codegen.lower.segment import CompiledSegment, direct_forward
from fxlite.codegen.runtime.segment_graphs import WARMUP, SegmentGraphs, runs_backward

from fxlite import config
from fxlite.graph_module import GraphModule

__all__ = ["GraphedTrial", "Trial", "TrialResult", "choose_runner"]

_ROUNDS = 3  # timed calls of each side (GraphedTrial)
_WARM = 2  # untimed calls first: one of each side, the compiled side's first
_BLOCK = 3  # consecutive calls of one side: one timed block
_VOIDS = 4  # void blocks run again at most this many times in all
_CLOSE = 1.1  # sides within this ratio after one block each get a second block each


def _sizes(args: tuple) -> tuple:
    """What of a call's arguments makes a side's first run at them slow: tensor sizes,
    and ints (a Dynamo graph's sizes taken as inputs)."""
    return tuple(a.shape if isinstance(a, torch.Tensor) else a if type(a) is int else None
                 for a in args)


class TrialResult(NamedTuple):
    """How one trial of a segment ended (``fxlite.compile(...).trials``)."""

    race: str  # "kernels against recorded ops", or the second trial's "layouts"
    winner: str  # "kernels", "recorded ops", "channels-last" or "no channels-last"
    ms: tuple[float, float]  # a call of the first side, and of the second (block means)
    calls: int  # the trial's calls until it decided (the compiled function's first
    #            call, which compiles, comes before them)

    def __str__(self) -> str:
        return (f"{self.race}: {self.winner} won after {self.calls} calls ({self.ms[0]:.3f} "
                f"against {self.ms[1]:.3f} ms a call)")


class Trial:
    """Stands in for a segment's ``run`` until it knows which side is faster.

    Args:
        compiled: the compiled segment's runner.
        recorded: a runner of the segment's recorded ops.
        decide: called once with ``(winner_is_compiled, compiled_ms, recorded_ms)``; it
            installs the winner.
    """

    def __init__(self, compiled: Callable[..., Any], recorded: Callable[..., Any],
                 decide: Callable[[bool, float, float], None]) -> None:
        self.sides = (compiled, recorded)
        self.times: tuple[list[float], list[float]] = ([], [])  # ms a call, per block
        self.off: list[Any] = [None, None]  # why each side gave up its graphs, if it did
        self.calls = 0
        self.sizes: tuple[set, set] = (set(), set())  # the arguments' sizes each side ran
        self._void = False  # whether the current block did first-call work (left out)
        self.voids = 0  # blocks left out so far
        self.decide = decide
        self.done = False
        self._start = 0.0
        self._winner = 0

    def __call__(self, *args: Any) -> Any:
        turn, self.calls = self.calls, self.calls + 1
        if self.done:  # (decide installs the winner in the trial's place; until then)
            return self.sides[self._winner](*args)
        sizes = _sizes(args)
        if turn < _WARM:
            self.sizes[turn % 2].add(sizes)
            return self.sides[turn % 2](*args)
        block, place = divmod(turn - _WARM, _BLOCK)
        side = block % 2  # the compiled side's block first, then the recorded ops'
        new = sizes not in self.sizes[side]
        self.sizes[side].add(sizes)
        if place == 0:
            torch.cuda.synchronize()
            self._start, self._void = time.perf_counter(), False
        writes = _writes(self.sides[side])
        out = self.sides[side](*args)
        self._void = self._void or new or _writes(self.sides[side]) != writes
        if place == _BLOCK - 1:
            torch.cuda.synchronize()
            if self._void and self.voids < _VOIDS:
                self.voids += 1
            else:
                self.times[side].append((time.perf_counter() - self._start) * 1e3 / _BLOCK)
            if side == 1 and all(self.times):
                self._settle()
        return out

    def _settle(self) -> None:  # (each side has a block's time)
        """After each pair of blocks: decide, unless the sides are close and this was the
        first pair."""
        ours, theirs = (sum(t) / len(t) for t in self.times)
        if len(self.times[0]) >= 2 or max(ours, theirs) > _CLOSE * min(ours, theirs):
            self.done, self._winner = True, int(ours > theirs)
            self.decide(ours <= theirs, ours, theirs)


def _writes(side: Callable[..., Any]) -> int:
    """How many straight-line forwards ``side`` has written (a ``StraightRunner``'s
    first-call work); 0 for other runners."""
    return getattr(side, "writes", 0)


def choose_runner(seg: Any, cuda: bool, graphed: bool) -> Callable[..., Any]:
    """What runs a compiled segment ``seg`` (``seg.compiled`` set by the pipeline).

    On a GPU a segment with kernels goes on trial against its recorded ops; under
    ``mode="reduce-overhead"`` (``graphed``) the winner runs from CUDA graphs. A training
    segment under ``graphed`` is tried with both sides replayed from CUDA graphs, since
    its kernels' host cost (an autograd node a group) is gone there.
    """
    compiled = seg.compiled
    on_trial = bool(compiled.kernels) and cuda and config.trial()
    if graphed and _trains(seg, compiled):
        if on_trial:
            return _graphed_trial(seg)
        if not compiled.kernels:
            return _graphed_recording(seg, compiled)
    if on_trial:
        return _on_trial(seg, graphed)
    if graphed:
        return SegmentGraphs(compiled.gm, compiled.run, compiled.fallbacks)
    return compiled.run


def _on_trial(seg: Any, graphed: bool) -> Trial:
    """Let real calls decide between the segment's kernels and its recorded ops; with
    ``graphed``, the winner then runs from CUDA graphs."""
    compiled, recorded = seg.compiled, _recorded_side(seg)

    def decide(kernels_win: bool, ours: float, theirs: float) -> None:
        seg.trials.append(TrialResult("kernels against recorded ops", "kernels" if kernels_win
                                      else "recorded ops", (ours, theirs), trial.calls))
        winner = _keep(seg, recorded, kernels_win, ours, theirs)
        if not kernels_win and not graphed and compiled.plain is not None:
            seg.run = _layout_trial(seg, compiled.plain)
            return
        seg.run = SegmentGraphs(winner.gm, winner.run, winner.fallbacks) if graphed \
            else winner.run

    trial = Trial(compiled.run, recorded.run, decide)
    return trial


def _layout_trial(seg: Any, plain_gm: GraphModule) -> Trial:
    """After the recorded ops won their trial (``seg.compiled`` is now they): a second
    trial, between them and the same ops without the channels-last rewrite.

    Why: that rewrite pays for cuDNN's NHWC kernels with a copy of each converted input
    and weight, a launch each. Where the kernels lose, the calls are host-bound, and there
    the copies can cost more than they save: alexnet f32 (batch 32, H200) ran its recorded
    ops at 0.87x eager's speed, with 7 copies and its max pools in NHWC (97 us of GPU time
    a call against eager's 52 in NCHW). Not under CUDA graphs, where launches cost no host
    time. The recorded side runs first, as the compiled side does in the first trial."""
    laid_out = seg.compiled
    plain = CompiledSegment(direct_forward(plain_gm), plain_gm,
                            fallbacks=list(laid_out.fallbacks))

    def decide(layout_wins: bool, ours: float, theirs: float) -> None:
        seg.trials.append(TrialResult("layouts", "channels-last" if layout_wins
                                      else "no channels-last", (ours, theirs), trial.calls))
        if not layout_wins:
            plain.fallbacks.append(
                f"its recorded ops ran faster without channels-last convolutions ({theirs:.3f} "
                f"ms against {ours:.3f} ms a call, timed over real calls), so they run so")
            seg.compiled = plain
        seg.run = seg.compiled.run

    trial = Trial(laid_out.run, plain.run, decide)
    return trial


def _recorded_side(seg: Any) -> CompiledSegment:
    """The segment's recorded ops (with the rewrites that need no kernels) as a runner."""
    compiled = seg.compiled
    gm = compiled.recorded if compiled.recorded is not None else seg.gm
    return CompiledSegment(direct_forward(gm), gm)


def _keep(seg: Any, recorded: CompiledSegment, kernels_win: bool, ours: float,
          theirs: float, how: str = "") -> CompiledSegment:
    """Make the trial's winner ``seg.compiled`` (saying why when the recorded ops won)."""
    compiled = seg.compiled
    if not kernels_win:
        recorded.fallbacks.append(
            f"{how}its recorded ops ran faster than its {len(compiled.kernels)} kernels "
            f"({theirs:.3f} ms against {ours:.3f} ms a call, timed over real calls), so "
            "they run instead")
    seg.compiled = compiled if kernels_win else recorded
    return seg.compiled


def _trains(seg: Any, compiled: CompiledSegment) -> bool:
    """Whether ``seg`` runs a backward or autograd-aware kernels (a training segment)."""
    return any(map(runs_backward, seg.gm.graph.nodes)) or any(
        hasattr(k, "_variants") for k in compiled.kernels)


class GraphedTrial(Trial):
    """A trial of two sides that each replay from CUDA graphs, one side after the other.

    Each side's graphs hold a memory pool as large as the step's own working memory, so
    the sides are never alive together: the first side is observed, captured and timed,
    and dropped; then the second; then the winner is made again (and captures again after
    its observed calls). A training step that fits in memory with graphs therefore fits
    during its trial too.

    Args:
        make: two functions that each make a fresh runner (a ``SegmentGraphs``): the
            kernels' side first.
        decide: called once with ``(kernels_win, kernels_ms, recorded_ms, winner)``.
        warm: untimed calls a side first (observed calls and the capture).

    A call's time runs from its start to the next call's start, each at a synchronized
    device: what the program does between calls counts too. For a module whose backward
    runs after it (``loss.backward()`` outside, or DistributedDataParallel's), that is
    the side's backward, which timing the call alone would leave out.

    A side that gave up its graphs on trial (``off`` set: say a module with a backward
    hook, whose outputs need autograd after it) cannot capture them later either. When it
    wins, it runs plainly (``plain``) rather than being observed node by node for three
    more calls and failing to capture again.
    """

    def __init__(self, make: tuple[Callable[[], Any], Callable[[], Any]],
                 decide: Callable[[bool, float, float, Any], None], warm: int) -> None:
        self.make, self.decide_with, self.warm = make, decide, warm
        self.times: tuple[list[float], list[float]] = ([], [])
        self.off: list[Any] = [None, None]  # why each side gave up its graphs, if it did
        self.side, self.calls, self.done = 0, 0, False
        self.seen = 0  # calls in all
        self.started: float | None = None  # when the latest timed call started
        self.runner: Any = make[0]()

    def __call__(self, *args: Any) -> Any:
        self.seen += 1
        if self.started is not None:  # the latest call was timed: its time ends here
            torch.cuda.synchronize()
            times = self.times[self.side]
            times.append((time.perf_counter() - self.started) * 1e3)
            self.started = None
            if len(times) >= _ROUNDS:
                self._next_side()
        if self.done or self.calls < self.warm:
            self.calls += 1
            return self.runner(*args)
        torch.cuda.synchronize()
        self.started = time.perf_counter()
        return self.runner(*args)

    def _next_side(self) -> None:
        """Drop the side just timed; make the other, or (both timed) the winner."""
        self.off[self.side] = getattr(self.runner, "off", None)
        self.runner = None  # its graphs go before the next side captures its own
        if self.side == 0:
            self.side, self.calls = 1, 0
            self.runner = self.make[1]()
            return
        ours, theirs = (statistics.median(t) for t in self.times)
        self.done = True
        winner = 0 if ours <= theirs else 1
        runner = self.make[winner]()
        self.runner = runner if self.off[winner] is None else runner.plain
        self.decide_with(ours <= theirs, ours, theirs, self.runner)


def _graphed_trial(seg: Any) -> GraphedTrial:
    """A training segment under ``mode="reduce-overhead"``: its kernels and its recorded
    ops both replay from CUDA graphs, and real calls decide between them.

    With the host cost gone, what decides is GPU time. Measured on an H200 (steps of
    ``bench_training.py``): a GPT-2 block's fused forward and backward kernels kept the GPU
    busy 0.85 ms a step against 1.10 for its recorded ops (f32; bf16 0.50 against 0.81),
    while resnet18's took 2.69 ms against 2.05 (cuDNN's batch norms and convolutions,
    channels-last). The sides run one after the other (:class:`GraphedTrial`).
    """
    compiled, recorded = seg.compiled, _recorded_side(seg)

    def decide(kernels_win: bool, ours: float, theirs: float, winner: Any) -> None:
        seg.trials.append(TrialResult("kernels against recorded ops, from CUDA graphs",
                                      "kernels" if kernels_win else "recorded ops",
                                      (ours, theirs), trial.seen - 1))  # (at a call's start)
        _keep(seg, recorded, kernels_win, ours, theirs, "replayed from CUDA graphs, ")
        seg.run = winner

    trial = GraphedTrial((lambda: SegmentGraphs(compiled.gm, compiled.run, compiled.fallbacks),
                         lambda: SegmentGraphs(recorded.gm, recorded.run, recorded.fallbacks)),
                         decide, warm=WARMUP + 2)
    return trial


def _graphed_recording(seg: Any, compiled: CompiledSegment) -> SegmentGraphs:
    """Under ``mode="reduce-overhead"`` a training segment without kernels replays its
    recorded ops (with the rewrites that need no kernels, such as fused optimizer steps)
    from CUDA graphs."""
    gm = compiled.recorded if compiled.recorded is not None else compiled.gm
    recorded = CompiledSegment(direct_forward(gm), gm)
    seg.compiled = recorded
    return SegmentGraphs(gm, recorded.run, recorded.fallbacks)
