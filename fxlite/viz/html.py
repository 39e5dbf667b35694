"""HTML views for Jupyter: graph tables (with a drawing when Graphviz is installed) and reports.

``Graph._repr_html_`` and ``GraphModule._repr_html_`` return :func:`graph_html`; the kernel
report of ``fxlite.compile`` renders with :func:`table_html`. Every cell is escaped, so
names, targets and reprs show as text and never as markup.
"""

from __future__ import annotations

import html
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from fxlite.viz.dot import graph_dot
from fxlite.viz.tabular import graph_rows

# A graph is typed Any here: fxlite.graph sits above (Graph._repr_html_ calls graph_html).
__all__ = ["graph_html", "graph_svg", "table_html"]

SVG_MAX_NODES = 300
"""Graphs with more nodes show the table only: their drawing would be slow and unreadable."""

_STYLE = """<style>
.fxlite table { border-collapse: collapse; font-family: monospace; font-size: 12px; }
.fxlite th, .fxlite td { border: 1px solid #ced4da; padding: 2px 8px; text-align: left;
  vertical-align: top; }
.fxlite th { background: #f1f3f5; }
.fxlite caption { text-align: left; font-weight: bold; padding: 4px 0; }
.fxlite pre { font-size: 12px; background: #f8f9fa; padding: 6px; }
</style>"""


def table_html(headers: Sequence[str], rows: Sequence[Sequence[Any]],
               caption: str | None = None) -> str:
    """An escaped ``<table>``: one header row, then one ``<tr>`` per row.

    Args:
        headers: the column names.
        rows: the cells (anything; shown as ``str(cell)``).
        caption: an optional caption above the table.

    Returns:
        The HTML, starting with ``<table>``.

    Example::

        table_html(["kernel", "ms"], [["triton_fused_0", "0.012"]])
    """
    esc = html.escape
    parts = ["<table>"]
    if caption:
        parts.append(f"<caption>{esc(caption)}</caption>")
    parts.append("<thead><tr>" + "".join(f"<th>{esc(str(h))}</th>" for h in headers)
                 + "</tr></thead><tbody>")
    for row in rows:
        parts.append("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def wrap_html(body: str) -> str:
    """``body`` inside a ``<div class="fxlite">`` with the shared style."""
    return f'<div class="fxlite">{_STYLE}{body}</div>'


def graph_svg(graph_or_gm: Any) -> str | None:
    """The graph drawn by Graphviz as inline SVG; None without ``dot`` or for big graphs.

    Args:
        graph_or_gm: a Graph or GraphModule.

    Returns:
        The ``<svg>`` element, or None when ``dot`` is not on PATH, fails, or the graph
        has more than :data:`SVG_MAX_NODES` nodes.
    """
    graph = getattr(graph_or_gm, "graph", graph_or_gm)
    dot = shutil.which("dot")
    if dot is None or len(graph.nodes) > SVG_MAX_NODES:
        return None
    if graph is graph_or_gm:
        text = graph_dot(graph, graph.owning_module)
    else:
        text = graph_dot(graph, graph_or_gm, type(graph_or_gm).__name__)
    try:
        proc = subprocess.run([dot, "-Tsvg"], input=text.encode("utf-8"),
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = proc.stdout.decode("utf-8", errors="replace")
    start = text.find("<svg")
    return text[start:] if proc.returncode == 0 and start >= 0 else None


def graph_html(graph: Any, svg: bool = True) -> str:
    """A graph as an HTML table (targets by qualified name), and its drawing under it.

    Args:
        graph: the graph.
        svg: add the Graphviz drawing when ``dot`` is installed.

    Returns:
        The HTML: ``<div class="fxlite">``, the table, then the ``<svg>`` if any.

    Example::

        from IPython.display import HTML
        HTML(graph_html(gm.graph))      # what a notebook shows for `gm.graph`
    """
    headers, rows = graph_rows(graph, qualified=True)
    caption = f"{len(rows)} nodes"
    body = table_html(headers, rows, caption)
    drawing = graph_svg(graph) if svg else None
    if drawing is not None:
        body += f'<div class="fxlite-svg">{drawing}</div>'
    return wrap_html(body)
