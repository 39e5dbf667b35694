"""Progress on stderr for the ``fxlite`` command's long steps.

On a terminal (or with ``FXLITE_PROGRESS=1``) it is a one-line bar, redrawn in place::

    compile  [##########----------]  1/2  fxlite: 3 kernels, 4.2 s

Anywhere else (a pipe, a CI log) it prints plain lines instead, which a log keeps
readable: one as a step starts, one every :data:`LINE_EVERY` seconds while it runs, and
one as it ends::

    compile: first call ...
    compile: first call: 2 kernel(s) made so far, 10 s
    compile: first call done (1/1): 5 kernel(s), 12.3 s

``FXLITE_PROGRESS=0`` turns both off. A step of unknown length (a first call that
compiles many kernels, autotuning) shows its elapsed time and what it has done so far.
Every line fits ``width`` (100) columns.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from fxlite import config

__all__ = ["Progress"]

_BAR = 20
LINE_EVERY = 10.0
"""Seconds between the progress lines of a running step, away from a terminal."""


class Progress:
    """A progress bar over ``total`` steps, drawn on one line of ``stream``.

    Args:
        total: the number of steps.
        title: the word in front of the bar.
        stream: where to draw (``sys.stderr`` when None).
        enabled: draw the bar (True), nothing (False), or, with None: the bar on a
            terminal or with ``FXLITE_PROGRESS=1``, nothing with ``FXLITE_PROGRESS=0``,
            else plain progress lines.
        width: the most columns a line may take.

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
        self.lines = False  # plain lines instead of the bar
        if enabled is None:
            forced = config.progress()  # True, False, or None: decide by the stream
            enabled = forced is True or (forced is None and _isatty(self.stream))
            self.lines = not enabled and forced is None
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

    def _fit(self, text: str) -> str:
        return text if len(text) <= self.width else text[: self.width - 3] + "..."

    def _say(self, text: str) -> None:
        """Print one progress line (line mode)."""
        with self._lock:
            self.stream.write(self._fit(text) + "\n")
            self.stream.flush()

    def _status_text(self) -> str:
        status = self._status() if self._status is not None else ""
        elapsed = time.perf_counter() - self._start
        return f"{status + ', ' if status else ''}{elapsed:.1f} s"

    def line(self) -> str:
        """The text of the bar as it stands, cut to ``width`` columns."""
        filled = _BAR * self.done // max(self.total, 1)
        text = (f"{self.title}  [{'#' * filled}{'-' * (_BAR - filled)}]  "
                f"{self.done}/{self.total}")
        if self._label:
            text += f"  {self._label}: {self._status_text()}"
        return self._fit(text)

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
        if self.lines:
            self._say(f"{self.title}: {label} ...")
        if self.enabled or self.lines:
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
            if self.lines:
                self._say(f"{self.title}: {label} done ({self.done}/{self.total}): "
                          f"{self._status_text()}")

    def _tick(self, stop: threading.Event) -> None:
        if self.lines:
            while not stop.wait(LINE_EVERY):
                self._say(f"{self.title}: {self._label}: {self._status_text()}")
            return None
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
