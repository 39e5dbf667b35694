"""The table behind ``Graph.print_tabular`` and the Jupyter HTML view."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tabulate import tabulate

if TYPE_CHECKING:
    from .graph import Graph

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


def tabular(graph: Graph, tablefmt: str = "simple") -> str:
    """Render ``graph`` as a table in the torch.fx ``print_tabular`` format.

    Shape and dtype columns are added when any node carries ``meta['tensor_meta']``.
    """
    with_meta = any("tensor_meta" in n.meta for n in graph.nodes)
    rows = []
    for n in graph.nodes:
        row = [str(n.op), n.name, str(n.target), str(n.args), str(n.kwargs)]
        if with_meta:
            tm = n.meta.get("tensor_meta")
            row += [_meta_cell(tm, "shape"), _meta_cell(tm, "dtype")]
        rows.append(row)
    headers = _HEADERS + (["shape", "dtype"] if with_meta else [])
    if tablefmt == "simple":
        text = _simple_table(headers, rows)
        if text is not None:
            return text
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


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
