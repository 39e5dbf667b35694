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
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)
