"""``fxlite show`` and ``fxlite compile``: trace or compile what ``PKG.MODULE:OBJ`` names.

Everything they print fits :data:`WIDTH` columns: tables narrow their widest columns,
code lines wrap inside their brackets, and targets print by qualified name.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import fxlite as fx
from fxlite.cli.load import (
    UsageError,
    check_arity,
    check_device,
    check_size,
    load_target,
    make_inputs,
    parse_input,
)
from fxlite.cli.progress import Progress
from fxlite.logs import kernel_listener
from fxlite.passes import ShapeProp, draw
from fxlite.viz.tabular import fit_table, tabular

__all__ = ["WIDTH", "KernelCount", "bench", "run_compile", "run_explain", "run_show", "say", "use_interpreter",
           "wrap_code"]

WIDTH = 100
"""The most columns a line of the command's output takes."""


def say(text: str = "") -> None:
    """Print ``text`` with every line cut or wrapped to :data:`WIDTH` columns."""
    for line in text.splitlines() or [""]:
        print(textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False,
                            replace_whitespace=False)
              if len(line) > WIDTH else line)


def _breaks(line: str, depth: int) -> list[tuple[int, int]]:
    """Where ``line`` may break: (index after ", " in brackets or ";  " outside, depth there).

    ``depth`` is the bracket depth at the start of the line (a continuation line starts
    inside the brackets its first part opened).
    """
    spots, quote, i = [], "", 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and line.startswith(", ", i) and depth > 0:
            spots.append((i + 2, depth))
        elif c == ";" and line.startswith(";  ", i) and depth == 0:
            spots.append((i + 3, 0))
        i += 1
    return spots


def wrap_code(src: str, width: int = WIDTH) -> str:
    """Python source with its long lines wrapped, still valid Python.

    A line breaks after a comma inside brackets (the rest indented 8 more), or between
    the ``;``-separated statements the code generator writes. A line with no such place
    stays as it is.

    Example::

        print(wrap_code(gm.code))
    """
    out: list[str] = []
    pending = [(line, line, 0) for line in src.rstrip("\n").splitlines()]
    while pending:
        line, statement, depth = pending.pop(0)  # statement: the line this one continues
        if len(line) <= width:
            out.append(line)
            continue
        indent = statement[: len(statement) - len(statement.lstrip())]
        lead = len(line) - len(line.lstrip())
        spots = [s for s in _breaks(line, depth) if lead + 1 < s[0] <= width]
        if not spots:
            out.append(line)
            continue
        at, depth_there = spots[-1]
        out.append(line[:at].rstrip().rstrip(";").rstrip())
        rest = line[at:].lstrip()
        if depth_there == 0:  # a new statement
            pending.insert(0, (indent + rest, indent + rest, 0))
        else:
            pending.insert(0, (indent + " " * 8 + rest, statement, depth_there))
    return "\n".join(out)


def use_interpreter(device: str) -> bool:
    """On the CPU, run Triton kernels through Triton's interpreter; True when it is on."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------- show
def run_show(args: argparse.Namespace) -> int:
    """``fxlite show``: trace, print the table (with shapes when there are inputs), and more."""
    if args.svg:
        _check_drawable(args.svg)
    target = load_target(args.target).with_arity(len(args.input or []))
    if args.input:
        check_arity(target, args.input)
    elif args.shapes:
        raise UsageError("--shapes needs --input for each input, e.g. --input 2x16")
    inputs = make_inputs(args.input or [], "cpu", args.seed)
    gm = fx.symbolic_trace(target.obj)
    outputs = None
    if inputs:
        with torch.no_grad():
            outputs = ShapeProp(gm).propagate(*inputs)
    say(f"{target.spec}: {len(gm.graph.nodes)} nodes")
    say(tabular(gm.graph, width=WIDTH))
    if args.shapes:
        say()
        for name, t in zip(target.parameters or [f"input{i}" for i in range(len(inputs))],
                           inputs):
            say(f"input  {name}: {_describe(t)}")
        flat = outputs if isinstance(outputs, (tuple, list)) else [outputs]
        for i, t in enumerate(flat):
            say(f"output {i}: {_describe(t)}")
    if args.code:
        say()
        say(wrap_code(gm.code))
    if args.svg:
        say(f"\ndrawing written to {draw(gm, args.svg)}")
    return 0


def _check_drawable(path: str) -> None:
    """A usage error, before any work, for a drawing that cannot be made."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".svg", ".png", ".pdf", ".dot", ".gv"):
        raise UsageError(f"--svg {path}: use a .svg, .png, .pdf or .dot file name")
    if suffix not in (".dot", ".gv") and shutil.which("dot") is None:
        raise UsageError("--svg needs Graphviz's dot (apt-get install graphviz), or a .dot "
                         "file name")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        shape = "x".join(map(str, value.shape)) or "scalar"
        return f"{shape} {str(value.dtype).replace('torch.', '')}"
    return type(value).__name__


# ---------------------------------------------------------------------- compile
class KernelCount:
    """The progress status of a compiled function's first call: the kernels made so far
    while it runs (``kernel_listener``), then, once ``finished``, the kernels the call
    runs (``compiled.kernels``, the number the report lists)."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.made: dict[int, Any] = {}  # by identity: a kernel logged twice counts once
        self.finished = False

    def add(self, kernel: Any) -> None:
        self.made[id(kernel)] = kernel

    def __call__(self) -> str:
        if self.finished:
            return f"{len(self.compiled.kernels)} kernel(s)"
        return f"{len(self.made)} kernel(s) made so far"


def _max_diff(got: Any, want: Any) -> float:
    if isinstance(got, torch.Tensor):
        return float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    if isinstance(got, (tuple, list)):
        return max((_max_diff(g, w) for g, w in zip(got, want)), default=0.0)
    return 0.0


def run_compile(args: argparse.Namespace) -> int:
    """``fxlite compile``: compile, check against eager, print kernels and fallbacks."""
    device = check_device(args.device)
    target = load_target(args.target).with_arity(len(args.input or []))
    check_arity(target, args.input or [])
    for spec in args.input or []:  # bad shapes are usage errors, found before any work
        check_size(spec, *parse_input(spec), device)
    interpreting = use_interpreter(device)
    inputs = make_inputs(args.input or [], device, args.seed)
    if isinstance(target.obj, torch.nn.Module):
        target.obj.to(device)
    if device == "cpu":
        say("no GPU: the kernels run through Triton's interpreter (TRITON_INTERPRET=1), "
            "slowly: use tiny inputs" if interpreting else
            "on the CPU without TRITON_INTERPRET: fxlite runs its regenerated Python forward")
    compiled = fx.compile(target.obj)
    count = KernelCount(compiled)
    with Progress(1, "compile") as bar, kernel_listener(count.add), torch.no_grad():
        with bar.step("first call", count):
            start = time.perf_counter()
            got = compiled(*inputs)
            first = time.perf_counter() - start
            count.finished = True
        want = target.obj(*inputs)
    ok = _same(got, want)
    say(f"{target.spec} on {device}: {len(compiled.kernels)} kernel(s), first call "
        f"(trace, fuse, generate, check) {first:.2f} s")
    say()
    with contextlib.redirect_stdout(io.StringIO()):  # report() prints; we print it fitted
        report = compiled.report()
    say(report)
    say()
    fallbacks = compiled.fallbacks
    say("fallbacks: " + ("none" if not fallbacks else f"{len(fallbacks)}"))
    for reason in fallbacks:
        say(f"  - {reason}")
    say(f"check against eager: {'same' if ok else 'DIFFERENT'} "
        f"(max abs difference {_max_diff(got, want):.3g})")
    if args.bench:
        say()
        bench(target.obj, compiled, inputs, device, interpreting)
    return 0 if ok else 1


def run_explain(args: argparse.Namespace) -> int:
    """``fxlite explain``: the graphs a call splits into, each break and why, the guards."""
    target = load_target(args.target).with_arity(len(args.input or []))
    check_arity(target, args.input or [])
    inputs = make_inputs(args.input or [], "cpu", args.seed)
    with torch.no_grad():
        report = fx.explain(target.obj, *inputs)
    say(f"{target.spec} on input(s) {', '.join(args.input)}")
    say(str(report))
    return 0


def _same(got: Any, want: Any) -> bool:
    try:
        torch.testing.assert_close(got, want, equal_nan=True)
        return True
    except (AssertionError, TypeError, ValueError):
        return False


def _times_ms(fn: Callable[[], Any], device: str, budget_s: float) -> np.ndarray:
    """Milliseconds per call: triton's do_bench samples on a GPU, timed calls on the CPU."""
    if device == "cuda":
        import triton.testing

        return np.asarray(triton.testing.do_bench(fn, return_mode="all"), dtype=float)
    warm = time.perf_counter() + budget_s / 4  # compilers may still be busy after a first call
    for _ in range(1000):
        fn()
        if time.perf_counter() > warm:
            break
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return np.asarray(times)


def bench(module: Any, compiled: Any, inputs: Sequence[torch.Tensor], device: str,
          interpreting: bool, budget_s: float = 1.0) -> list[list[str]]:
    """Time eager, fxlite and ``torch.compile`` side by side, in this process; print a table.

    Each contender's first call (which compiles) is timed once; after a warm-up, calls are
    timed for about ``budget_s`` seconds (``triton.testing.do_bench`` on a GPU); the table gives the
    median and the 10th-90th percentiles (numpy), and the speed-up over eager's median.

    Returns:
        The table's rows.
    """
    contenders: list[tuple[str, Callable[..., Any]]] = [
        ("eager", module), ("fxlite", compiled), ("torch.compile", torch.compile(module))]
    rows: list[list[str]] = []
    medians: dict[str, float] = {}
    with Progress(len(contenders), "bench") as bar, torch.no_grad():
        for name, fn in contenders:
            with bar.step(name):
                try:
                    start = time.perf_counter()
                    fn(*inputs)
                    first = time.perf_counter() - start
                    ms = _times_ms(lambda fn=fn: fn(*inputs), device, budget_s)
                except Exception as e:  # one contender failing must not hide the others
                    reason = str(e).splitlines()[0] if str(e) else ""
                    rows.append([name, "-", "-", "-", f"failed: {type(e).__name__}: {reason}"])
                    continue
            medians[name] = float(np.median(ms))
            p10, p90 = np.percentile(ms, [10, 90])
            rows.append([name, f"{first:.2f}", f"{medians[name]:.4f}",
                         f"{p10:.4f} - {p90:.4f}", ""])
    for row in rows:
        if row[0] in medians and "eager" in medians:
            row[4] = f"{medians['eager'] / medians[row[0]]:.2f}x"
    say(fit_table(["", "first call s", "median ms", "p10 - p90 ms", "vs eager"], rows,
                  WIDTH, wrap=["vs eager"]))
    if device == "cpu":
        say("on the CPU, fxlite's times measure " + ("Triton's interpreter, not a GPU"
            if interpreting else "its Python forward") + "; torch.compile runs its CPU code")
    return rows
