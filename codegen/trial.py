"""Never slower than eager: a segment's kernels must beat its recorded ops on real calls.

Fused kernels usually win, but not always: tiny tensors, many small groups, or a training
step whose groups each add an autograd node can cost more host time than the kernels save
on the device. So on a GPU a compiled segment starts on trial::

    call 1: compiled (warm-up)   call 2: recorded ops (warm-up)
    calls 3-8: the two take turns, each timed from a synchronized start to a synchronized end
    then: the faster one (by median) runs every later call

Both sides give eager's results (the compiled one was checked; the recorded one is the
user's own ops), so the trial costs only the synchronizations of its six timed calls. When
the recorded ops win, the segment's kernels are dropped and ``fallbacks`` says why.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Trial"]

_ROUNDS = 3  # timed calls of each side


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
        self.times: tuple[list[float], list[float]] = ([], [])
        self.calls = 0
        self.decide = decide
        self.done = False

    def __call__(self, *args: Any) -> Any:
        turn, self.calls = self.calls, self.calls + 1
        side = turn % 2
        if turn < 2 or self.done:  # warm-ups (caches, allocator) are not timed
            return self.sides[side](*args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.sides[side](*args)
        torch.cuda.synchronize()
        self.times[side].append((time.perf_counter() - start) * 1e3)
        if min(len(t) for t in self.times) >= _ROUNDS and not self.done:
            self.done = True
            ours, theirs = (statistics.median(t) for t in self.times)
            self.decide(ours <= theirs, ours, theirs)
        return out
