"""CUDA-graph replay for ``mode="reduce-overhead"``: one replay instead of N launches.

A graph is captured per (input addresses, sizes, strides, dtypes, grad mode) for small
inputs, reading the caller's tensors in place, so a replay needs no input copies and
reads their current contents. The compiled function looks the key up before anything
else, so a replay costs one key, one lookup and the graph launch.
Its outputs live in the graph's memory and would be overwritten by the next replay, so
each key keeps two graphs and replays one whose previous outputs nobody holds any more
(``sys.getrefcount``, where a view holds its base, plus the storage's use count, which
also sees ``detach()``-ed aliases). When both are still held, or a key is new after the
graph budget is spent, the forward runs normally.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fxlite.node import map_aggregate

__all__ = ["GraphReplays", "end_failed_capture", "reference_counts", "side_stream",
           "tensors_in"]

SMALL_NUMEL = 1 << 20  # inputs above this gain little from replay and cost memory
MAX_KEYS = 16


def reference_counts(tensors: list[torch.Tensor], storages: list[int]) -> list[int]:
    """What says whether anyone else holds tensors living in a graph's memory: Python
    references to each tensor (views hold their base), plus the uses of each storage
    (``storages``: their ``_cdata``), since ``y.detach()`` shares the memory through a new
    tensor that does not reference ``y``. Compare with a baseline taken the same way."""
    use_count = torch._C._storage_Use_Count
    return [sys.getrefcount(t) for t in tensors] + [use_count(s) for s in storages]


class _Captured:
    __slots__ = ("graph", "outputs", "flat", "storages", "base")

    def __init__(self, fn: Callable[..., Any], args: tuple, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*args)
        out = self.outputs
        self.flat = [t for t in (out if isinstance(out, (tuple, list)) else [out])
                     if isinstance(t, torch.Tensor)]
        del out  # a local reference would inflate the baseline below
        self.watch()

    def watch(self) -> None:
        """Take the baseline of references: ours, before anyone else holds an output."""
        # The storages' addresses stay valid while self.flat holds the tensors.
        self.storages = [t.untyped_storage()._cdata for t in self.flat]
        self.base = self._counts()

    def _counts(self) -> list[int]:
        return reference_counts(self.flat, self.storages)

    def free(self) -> bool:
        return self._counts() == self.base


class GraphReplays:
    """The captured CUDA graphs of one compiled function (``mode="reduce-overhead"``).

    A key holds everything a replay depends on: grad mode, the train/eval flags of the
    model's modules, and each argument (a tensor's address, sizes, strides, dtype and
    requires_grad; any other argument's value). So a hit can replay without the
    compiled function's own guard.

    Example::

        graphs = GraphReplays()
        key = graphs.key(args, flags)
        found = graphs.replay(key)   # (outputs, tag), or MISS unless captured and one is free
        out = graphs.run(key, forward, args) if found is MISS else found[0]
    """

    MISS = object()

    def __init__(self) -> None:
        self._graphs: dict[tuple, tuple[Any, list[_Captured]]] = {}  # key -> (tag, pair)
        self._pool: Any = None

    @staticmethod
    def key(args: tuple, flags: tuple = ()) -> tuple | None:
        """The replay key of ``args``, or None when an argument cannot be part of one."""
        key: list[Any] = [torch.is_grad_enabled(), flags]
        for a in args:
            if isinstance(a, torch.Tensor):
                key.append((a.data_ptr(), a.shape, a.stride(), a.dtype, a.requires_grad))
            elif a is None or type(a) in (int, float, bool, str):
                key.append((type(a), a))
            else:
                return None
        return tuple(key)

    def replay(self, key: tuple | None) -> Any:
        """Replay the graph captured for ``key`` whose outputs nobody holds.

        Returns ``(outputs, tag)`` (the tag given to :meth:`run`), or MISS.
        """
        found = self._graphs.get(key) if key is not None else None
        if found is not None:
            for cap in found[1]:
                if cap.free():
                    cap.graph.replay()
                    return cap.outputs, found[0]
        return GraphReplays.MISS

    def run(self, key: tuple | None, fn: Callable[..., Any], args: tuple, tag: Any = None) -> Any:
        """Capture ``fn`` for ``key`` and replay it when the inputs allow; else call it.

        ``tag`` comes back with every replay of this capture (the compiled entry)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if (key is None or key in self._graphs or len(self._graphs) >= MAX_KEYS or not tensors
                or not all(a.is_cuda and a.numel() <= SMALL_NUMEL for a in tensors)
                or torch.cuda.is_current_stream_capturing()):
            return fn(*args)
        out, pair = self._first_run(fn, args)
        self._graphs[key] = tag, pair
        return out

    def __len__(self) -> int:
        return len(self._graphs)

    def _first_run(self, fn: Callable[..., Any], args: tuple) -> tuple[Any, list[_Captured]]:
        """This call, run on a side stream (the warm-up a capture wants: allocator and lazy
        init), and the pair of graphs captured after it (a capture computes nothing).

        The warm-up is the call's own run, so its writes (a buffer counted up) happen
        once, as in eager; before, it ran besides the capture's replay, and wrote twice.
        No pair where the outputs carry an autograd graph (a training forward): each
        replay would hand back the capture's, used up by the first backward.
        """
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                out = fn(*args)
        finally:  # (also when it raises: later work must follow what it enqueued)
            current.wait_stream(side)
        flat = tensors_in(out)
        for t in flat:  # made on the side stream, used on this one
            t.record_stream(current)
        if any(t.requires_grad for t in flat):
            return out, []  # (an empty pair: never replayed)
        del flat
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return out, [_Captured(fn, args, self._pool), _Captured(fn, args, self._pool)]


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, through its tuples, lists and dicts, in order."""
    found: list[torch.Tensor] = []
    map_aggregate(value, lambda x: found.append(x) if isinstance(x, torch.Tensor) else x)
    return found


_SIDE: dict[int, Any] = {}  # device -> side stream


@contextlib.contextmanager
def side_stream(enabled: bool = True) -> Iterator[None]:
    """Run the block on a side stream, ordered after and before the current stream's work.

    Why: the calls before a capture (the recording, the observed calls) must not run on
    the default stream. Libraries set up per-stream state there, and autograd keeps the
    stream a parameter's gradient accumulator was made on: a loss the caller still holds
    from such a call keeps its accumulators, and a captured backward that meets one made
    on the legacy default stream must sync with that stream, which ends the capture.
    """
    if not enabled:
        yield
        return
    device = torch.cuda.current_device()
    side = _SIDE.get(device)
    if side is None:
        side = _SIDE[device] = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        current.wait_stream(side)


def end_failed_capture() -> None:
    """Leave no capture state behind a failed capture: torch's CUDA generator stays in its
    capture mode when one fails (later random ops then raise), so end a trivial one."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.empty(1, device="cuda").zero_()
    except Exception:  # nothing more can be done here
        pass
