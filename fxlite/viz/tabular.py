"""Tables of graphs and reports: ``Graph.print_tabular``, the ``fxlite`` command, Jupyter.

``print_tabular`` keeps torch.fx's format (targets as ``str(target)``). The command and the
HTML views print targets by qualified name (``torch.softmax``, not ``<built-in method
softmax ...>``) and fit a width: :func:`fit_table` cuts or wraps the widest columns.
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from fxlite.node import format_target, map_aggregate, unprintable

# A graph is typed Any here: fxlite.graph sits above (Graph.print_tabular calls tabular).

_HEADERS = ["opcode", "name", "target", "args", "kwargs"]


def _meta_cell(meta: Any, field: str) -> str:
    """Shape or dtype of a ``tensor_meta`` entry; nested outputs print as tuples."""
    if meta is None:
        return ""
    if hasattr(meta, field):
        value = getattr(meta, field)
        return str(tuple(value)) if field == "shape" else str(value).replace("torch.", "")
    if isinstance(meta, (tuple, list)):
        return "(" + ", ".join(_meta_cell(m, field) for m in meta) + ")"
    if isinstance(meta, dict):
        return "{" + ", ".join(f"{k}: {_meta_cell(v, field)}" for k, v in meta.items()) + "}"
    return ""


_QUALIFIED: dict[int, str] = {}


def _namespaces() -> dict[int, str]:
    """id(object) -> qualified name, for the public functions of torch and the stdlib."""
    if not _QUALIFIED:
        import builtins
        import math
        import operator

        import torch
        import torch.nn.functional as F

        spaces = [("builtins", builtins), ("math", math), ("operator", operator),
                  ("torch.special", torch.special), ("torch.linalg", torch.linalg),
                  ("torch.fft", torch.fft), ("torch.Tensor", torch.Tensor),
                  ("torch.nn.functional", F), ("torch", torch)]
        for prefix, space in spaces:  # later ones win: torch.relu over torch.special...
            for attr in dir(space):
                if attr.startswith("__"):
                    continue
                obj = getattr(space, attr, None)
                if callable(obj) and not isinstance(obj, type):
                    _QUALIFIED[id(obj)] = f"{prefix}.{attr}"
    return _QUALIFIED


def qualified_name(target: Any) -> str:
    """How a node's target prints in tables: ``torch.softmax``, ``operator.add``, ``relu``.

    Functions of torch, ``torch.nn.functional``, ``torch.Tensor``, ``operator``, ``math``
    and ``builtins`` print by the name users write; other functions by module and
    qualified name; strings (module paths, method names) as they are.

    Example::

        >>> qualified_name(torch.softmax), qualified_name(torch.nn.functional.gelu)
        ('torch.softmax', 'torch.nn.functional.gelu')
    """
    if isinstance(target, str):
        return target
    name = _namespaces().get(id(target))
    if name is not None:
        return name
    return format_target(target)


def graph_rows(graph: Any, qualified: bool = False) -> tuple[list[str], list[list[str]]]:
    """The headers and rows of a graph table; shape and dtype when any node has tensor_meta.

    Args:
        graph: the graph.
        qualified: print targets with :func:`qualified_name` instead of ``str(target)``.

    Returns:
        (headers, rows), every cell a string.
    """
    with_meta = any("tensor_meta" in n.meta for n in graph.nodes)
    show = qualified_name if qualified else str
    rows = []
    for n in graph.nodes:
        row = [str(n.op), n.name, _cell(n.target, show), _cell(n.args), _cell(n.kwargs)]
        if with_meta:
            tm = n.meta.get("tensor_meta")
            row += [_meta_cell(tm, "shape"), _meta_cell(tm, "dtype")]
        rows.append(row)
    return _HEADERS + (["shape", "dtype"] if with_meta else []), rows


class _Shown:
    """Stands in for a value whose ``repr`` raises, and prints as ``<unprintable Foo>``."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _printable(value: Any) -> Any:
    try:
        repr(value)
    except Exception:
        return _Shown(unprintable(value))
    return value


def _cell(value: Any, show: Callable[[Any], str] = str) -> str:
    """``show(value)``; where a constant in it cannot print itself, the same text with that
    constant shown as ``<unprintable Foo>`` (a table of a graph never fails on one value)."""
    try:
        return show(value)
    except Exception:
        pass
    try:
        return str(map_aggregate(value, _printable))  # only leaves: tuples, lists, dicts are walked
    except Exception:
        return unprintable(value)


def tabular(graph: Any, tablefmt: str = "simple", width: int | None = None) -> str:
    """Render ``graph`` as a table in the torch.fx ``print_tabular`` format.

    Shape and dtype columns are added when any node carries ``meta['tensor_meta']``.

    Args:
        graph: the graph.
        tablefmt: a tabulate format (``"simple"``, ``"html"``, ``"github"``...).
        width: fit the table in this many columns (cutting long cells with ``...``) and
            print targets by qualified name, as the ``fxlite`` command does.
    """
    headers, rows = graph_rows(graph, qualified=width is not None)
    if width is not None:
        return _narrow_graph_table(headers, rows, width)
    if tablefmt == "simple":
        text = _simple_table(headers, rows)
        if text is not None:
            return text
    # Here, not at import: fxlite.graph imports this module, and tabulate takes longer to
    # import than fxlite.graph itself; the "simple" layout above rarely needs it.
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def _narrow_graph_table(headers: list[str], rows: list[list[str]], width: int) -> str:
    """The command's graph table: shapes as ``2x4x8``, one dtype note when all agree."""
    note = ""
    if "shape" in headers:
        i = headers.index("shape")
        for row in rows:
            row[i] = row[i].replace(", ", "x").replace(",)", ")").strip("()") \
                if row[i].startswith("(") and "(" not in row[i][1:] else row[i]
        dtypes = {row[i + 1] for row in rows} - {""}
        if len(dtypes) == 1 and all("(" not in d for d in dtypes):
            note = f"\n(every tensor is {dtypes.pop()})"
            headers = headers[:-1]
            rows = [row[:-1] for row in rows]
    return fit_table(headers, rows, width, keep=("opcode", "name", "target", "shape")) + note


def _simple_table(headers: list[str], rows: list[list[str]]) -> str | None:
    """tabulate's ``"simple"`` layout, written directly; None where tabulate must decide.

    Why: tabulate spends most of its time inferring each cell's type, which is wasted on
    cells that are all strings, and made print_tabular slow on big graphs. This gives the
    same text for plain printable ASCII cells; wide, control and escape characters (whose
    width tabulate measures its own way) are left to tabulate.
    """
    if not rows:
        return None
    # tabulate strips cells and pads each column to its widest cell, and to at least
    # two more than its header; rows are joined by two spaces and right-stripped.
    cols = [[cell.strip() for cell in col] for col in zip(*rows)]
    if len(cols) != len(headers):
        return None
    widths = []
    for header, col in zip(headers, cols):
        joined = "".join(col)
        if not (joined.isascii() and joined.isprintable()):
            return None
        widths.append(max(len(header) + 2, max(map(len, col))))
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers).rstrip(), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*row).rstrip() for row in zip(*cols)]
    return "\n".join(lines)


def fit_table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int = 100,
              wrap: Sequence[str] = (), keep: Sequence[str] = ()) -> str:
    """A plain table (tabulate's ``simple`` look) no wider than ``width`` columns.

    While it is too wide, the widest column narrows by one: first the columns not named
    in ``keep``, down to 12 characters, then down to 8, then any column down to 8 (never
    below a header's width). Cells of the columns named in ``wrap`` wrap onto more lines; other cells are
    cut, ending in ``...``.

    Args:
        headers: the column names.
        rows: the cells, as strings.
        width: the most columns a line may take.
        wrap: the headers of the columns whose cells wrap instead of being cut.
        keep: the headers of the columns to narrow last.

    Returns:
        The table text, lines joined by newlines.

    Example::

        print(fit_table(["name", "ops"], [["k0", "add, mul, relu"]], width=40, wrap=["ops"]))
    """
    cells = [[" ".join(str(c).split()) if h in wrap else str(c).replace("\n", " ")
              for h, c in zip(headers, row)] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    for floors in ([w if h in keep else max(12, len(h)) for h, w in zip(headers, widths)],
                   [w if h in keep else max(8, len(h)) for h, w in zip(headers, widths)],
                   [max(8, len(h)) for h in headers]):
        while sum(widths) + 2 * (len(widths) - 1) > width:
            i = max(range(len(widths)), key=lambda j: widths[j] - floors[j])
            if widths[i] <= floors[i]:
                break  # nothing left to narrow at this stage
            widths[i] -= 1

    def cut(text: str, w: int) -> list[str]:
        if len(text) <= w:
            return [text]
        return [text[: w - 3] + "..."]

    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    for row in cells:
        parts = [textwrap.wrap(c, w, break_on_hyphens=False) or [""] if h in wrap else cut(c, w)
                 for h, c, w in zip(headers, row, widths)]
        for line in itertools.zip_longest(*parts, fillvalue=""):
            lines.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    return "\n".join(lines)
