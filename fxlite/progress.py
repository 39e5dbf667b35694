"""A one-line progress bar on stderr, for the ``fxlite`` command's long steps.

It draws only on a terminal (or when ``FXLITE_PROGRESS=1``), so pipes and logs stay clean::

    compile  [##########----------]  1/2  fxlite: 3 kernels, 4.2 s

A step of unknown length (a first call that compiles many kernels, autotuning) shows
its elapsed time and what it has done so far, redrawn twice a second.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["Progress"]

_BAR = 20


class Progress:
    """A progress bar over ``total`` steps, drawn on one line of ``stream``.

    Args:
        total: the number of steps.
        title: the word in front of the bar.
        stream: where to draw (``sys.stderr`` when None).
        enabled: draw or not; None draws when the stream is a terminal or when the
            environment has ``FXLITE_PROGRESS=1``.
        width: the most columns the line may take.

    Example::

        with Progress(3, "bench") as bar:
            for name in ("eager", "fxlite", "torch.compile"):
                with bar.step(name):
                    time_it(name)
    """

    def __init__(self, total: int, title: str, stream: TextIO | None = None,
                 enabled: bool | None = None, width: int = 100) -> None:
        self.total, self.title, self.width = total, title, width
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            forced = os.environ.get("FXLITE_PROGRESS", "")
            enabled = forced == "1" or (forced != "0" and _isatty(self.stream))
        self.enabled = enabled
        self.done = 0
        self._label = ""
        self._status: Callable[[], str] | None = None
        self._start = time.perf_counter()
        self._lock = threading.Lock()
        self._drawn = False

    def __enter__(self) -> Progress:
        self.draw()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self) -> str:
        """The text of the bar as it stands, cut to ``width`` columns."""
        filled = _BAR * self.done // max(self.total, 1)
        text = (f"{self.title}  [{'#' * filled}{'-' * (_BAR - filled)}]  "
                f"{self.done}/{self.total}")
        if self._label:
            text += f"  {self._label}"
            status = self._status() if self._status is not None else ""
            elapsed = time.perf_counter() - self._start
            text += f": {status + ', ' if status else ''}{elapsed:.1f} s"
        return text if len(text) <= self.width else text[: self.width - 3] + "..."

    def draw(self) -> None:
        """Redraw the line (nothing when disabled)."""
        if not self.enabled:
            return
        with self._lock:
            self.stream.write("\r" + self.line().ljust(self.width - 1)[: self.width - 1])
            self.stream.flush()
            self._drawn = True

    @contextmanager
    def step(self, label: str, status: Callable[[], str] | None = None) -> Iterator[None]:
        """Run one step: show ``label`` and the elapsed time while it runs, then advance.

        Args:
            label: what the step does.
            status: called on each redraw for a few words of progress (``"3 kernels"``).
        """
        self._label, self._status, self._start = label, status, time.perf_counter()
        stop = threading.Event()
        ticker = None
        if self.enabled:
            ticker = threading.Thread(target=self._tick, args=(stop,), daemon=True)
            ticker.start()
        try:
            yield
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            self.done += 1
            self.draw()

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            self.draw()
        return None

    def close(self) -> None:
        """Clear the line, so the next output starts on a clean one."""
        if self.enabled and self._drawn:
            with self._lock:
                self.stream.write("\r" + " " * (self.width - 1) + "\r")
                self.stream.flush()
                self._drawn = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
