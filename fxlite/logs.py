"""Logs of what the compiler does, printed as it happens: graphs, graph breaks, kernels.

Turn them on in code, or from the environment without touching the code::

    fxlite.set_logs(graph_code=True, graph_breaks=True, kernels=True)

    FXLITE_LOGS=graph_code,graph_breaks,kernels python train.py    # or FXLITE_LOGS=all

Each log goes to stderr (or the ``file`` given to :func:`set_logs`). A captured graph
prints as its generated code, with the user's file, line and source text above the ops
that line produced::

    ===== captured graph: f =====
    def forward(self, x):
        # File: model.py:5 in f, code: y = torch.sin(x) + 1
        sin = torch.sin(x);  x = None
        add = sin + 1;  sin = None
        return add

The compiler calls :func:`log_graph`, :func:`log_break` and :func:`log_kernel`; each
returns at once when its log is off.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from fxlite import config

__all__ = ["LOGS", "enabled", "format_graph", "kernel_listener", "log_break", "log_graph",
           "log_kernel", "set_logs"]

LOGS = ("graph_code", "graph_breaks", "kernels")
"""The names of the logs, as :func:`set_logs` and ``FXLITE_LOGS`` take them."""

_on: set[str] = set()
_file: TextIO | None = None  # None: sys.stderr at the time of printing


def set_logs(graph_code: bool = False, graph_breaks: bool = False, kernels: bool = False, *,
             file: TextIO | None = None) -> None:
    """Choose which compiler logs print; a log not named is turned off.

    Args:
        graph_code: print each captured graph as code, under the user's source lines.
        graph_breaks: print each graph break with its reason.
        kernels: print the source of each generated kernel.
        file: where to print (``sys.stderr`` when None).

    Example::

        fxlite.set_logs(graph_code=True)
        f = fxlite.compile(f)
        f(x)              # prints the captured graph
        fxlite.set_logs() # all off again
    """
    global _file
    _on.clear()
    _on.update(name for name, flag in zip(LOGS, (graph_code, graph_breaks, kernels)) if flag)
    _file = file


def _from_env(value: str) -> None:
    """Turn on the logs that ``FXLITE_LOGS`` names (comma-separated, or ``all``)."""
    names = {part.strip() for part in value.split(",") if part.strip()}
    if "all" in names:
        names = (names - {"all"}) | set(LOGS)
    unknown = sorted(names - set(LOGS))
    if unknown:
        warnings.warn(f"FXLITE_LOGS: unknown log name(s) {', '.join(unknown)}; "
                      f"use {', '.join(LOGS)} or all", stacklevel=2)
    set_logs(**{name: name in names for name in LOGS})


def enabled(name: str) -> bool:
    """Whether the log ``name`` (one of :data:`LOGS`) is on.

    Example::

        if fxlite.logs.enabled("kernels"): ...
    """
    return name in _on


def _print(text: str) -> None:
    out = _file if _file is not None else sys.stderr
    print(text, file=out, flush=True)


# ---------------------------------------------------------------------- graphs
# One frame of a torch.fx-style stack trace: `File "x.py", line 6, in f` then the code line.
_FRAME = re.compile(r'File "(?P<file>[^"\n]*)", line (?P<line>\d+), in (?P<fn>[^\n]*)'
                    r'(?:\n[ \t]*(?P<code>[^\n]*))?')


def source_comment(stack_trace: str | None) -> str | None:
    """``# File: x.py:6 in f, code: y = x + 1`` for the innermost frame of a stack trace.

    Args:
        stack_trace: a node's ``meta["stack_trace"]``, formatted as torch.fx does.

    Returns:
        The comment, or None when there is no frame in it.

    Example::

        >>> source_comment('  File "m.py", line 6, in f\\n    y = x + 1')
        '# File: m.py:6 in f, code: y = x + 1'
    """
    if not stack_trace:
        return None
    frames = list(_FRAME.finditer(stack_trace))
    if not frames:
        return None
    last = frames[-1]
    path = last["file"]
    try:  # a path under the working folder prints relative to it
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            path = rel
    except ValueError:
        pass
    code = (last["code"] or "").strip()
    return f"# File: {path}:{last['line']} in {last['fn'].strip()}" + (
        f", code: {code}" if code else "")


def format_graph(gm: Any, title: str = "captured graph") -> str:
    """A graph as readable code, with the user's source line above the ops it produced.

    Args:
        gm: a GraphModule or a Graph. Nodes whose ``meta["stack_trace"]`` is set get a
            ``# File: ...`` comment where their source line changes.
        title: the heading.

    Returns:
        The text :func:`log_graph` prints.

    Example::

        print(format_graph(gm, "after decompose"))
    """
    graph = getattr(gm, "graph", gm)
    src = gm.code if hasattr(gm, "code") else graph.python_code("self").src
    lines = src.rstrip("\n").splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("def forward")), None)
    body_nodes = [n for n in graph.nodes if n.op != "placeholder"]
    body = lines[header + 1:] if header is not None else []
    # The code generator writes one statement per node, in order; anything else (a future
    # code generator) prints without the comments rather than with wrong ones.
    lined_up = len(body) >= len(body_nodes) and all(
        line.strip().startswith(f"{n.name} = ") for line, n in zip(body, body_nodes)
        if n.op != "output")
    out = [f"===== {title} ====="]
    if not lined_up:
        return "\n".join(out + lines)
    out.append(lines[header])  # the imports above it are left out
    last = None
    for line, node in zip(body, body_nodes):
        comment = source_comment(node.meta.get("stack_trace"))
        if comment is not None and comment != last:
            out.append("    " + comment)
            last = comment
        out.append(line)
    out += body[len(body_nodes):]
    return "\n".join(out)


def log_graph(gm: Any, title: str = "captured graph") -> None:
    """Print ``gm`` with :func:`format_graph` when the ``graph_code`` log is on.

    Example::

        log_graph(gm, f"captured graph {index}: {fn.__qualname__}")
    """
    if "graph_code" in _on:
        _print(format_graph(gm, title))


def log_break(reason: str) -> None:
    """Print a graph break and its reason when the ``graph_breaks`` log is on.

    Args:
        reason: what broke the graph, with the user's file, line and code.

    Example::

        log_break('data-dependent branch\\n  File "m.py", line 6, in f\\n    if x.sum() > 0:')
    """
    if "graph_breaks" in _on:
        _print("----- graph break -----\n" + reason.rstrip("\n"))


def log_kernel(kernel: Any) -> None:
    """Print a generated kernel's source when the ``kernels`` log is on.

    Args:
        kernel: anything with ``.name`` and ``.source`` (and optionally ``.kind`` and
            ``.nodes``, the names of the ops it fuses).

    Example::

        log_kernel(kernel)
    """
    for listener in list(_kernel_listeners):
        listener(kernel)
    if "kernels" not in _on:
        return
    kind = getattr(kernel, "kind", None)
    nodes = getattr(kernel, "nodes", None)
    what = f" ({kind}: {', '.join(map(str, nodes))})" if kind and nodes else ""
    _print(f"===== kernel {kernel.name}{what} =====\n{str(kernel.source).rstrip()}")


_kernel_listeners: list[Callable[[Any], None]] = []


@contextmanager
def kernel_listener(callback: Callable[[Any], None]) -> Iterator[None]:
    """Call ``callback(kernel)`` for each kernel logged while the block runs, logs on or off.

    The ``fxlite`` command's progress bar counts kernels this way.

    Example::

        made = []
        with kernel_listener(made.append):
            compiled(x)
    """
    _kernel_listeners.append(callback)
    try:
        yield
    finally:
        _kernel_listeners.remove(callback)


if config.logs():
    _from_env(config.logs())
