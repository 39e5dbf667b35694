"""DOT text of a graph, for Graphviz: what ``fxlite.passes.draw`` writes and what the HTML
view of a graph draws.

Each node is a box labelled with its name, opcode, target and (after ShapeProp) shape
and dtype, filled by its op-table kind. A ``call_module`` node whose target is a
GraphModule (a fused group from ``fxlite.passes.fuse``) becomes a cluster holding the
group's own nodes; the group's output box stands for the call_module node, so edges to
its users leave from there::

    digraph "GraphModule" {
      "x" [label=<<B>x</B><BR/>placeholder>, shape=ellipse];
      subgraph "cluster_fused_0" {
        label=<fused_0 (pointwise)>;
        "fused_0/x" [label=<...>];  "fused_0/add" [label=<...>];  "fused_0" [label=<...>];
      }
      "x" -> "fused_0/x";  "fused_0/x" -> "fused_0/add";  "fused_0/add" -> "fused_0"; ...
    }

Everything taken from the graph is escaped: IDs are DOT quoted strings, labels are
Graphviz HTML-like labels with XML entities, so names and targets holding quotes,
backslashes, newlines or ``<&>`` cannot break the syntax.

A graph is typed Any here: fxlite.graph sits above this module (its HTML view draws
through it).
"""

from __future__ import annotations

import html
import re
from typing import Any

import torch

from fxlite.node import Node, format_target, map_arg
from fxlite.ops import lookup

__all__ = ["graph_dot", "node_input_counts", "node_shape_dtype", "sub_graphmodule"]

# Fill colours by op-table kind; unknown ops stay white.
_FILL = {
    "pointwise": "#d0ebff", "reduction": "#ffe8cc", "view": "#e9ecef",
    "extern": "#ffc9c9", "effect": "#fff3bf", "composite": "#d3f9d8",
}
_CLUSTER_FILL = {"pointwise": "#f1f8ff", "reduction": "#fff8f0"}
_SHAPE = {"placeholder": "ellipse", "output": "invhouse", "get_attr": "cylinder"}
_MAX_LINE = 80      # label lines longer than this are cut, so huge tuples stay readable
_MAX_DEPTH = 8      # nesting of GraphModules drawn as clusters
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _structure(meta: Any, field: str) -> Any:
    """``field`` of a ``tensor_meta`` entry, keeping tuple/list/dict nesting."""
    if meta is None:
        return None
    if hasattr(meta, field) and hasattr(meta, "dtype"):  # one TensorMetadata
        value = getattr(meta, field)
        return tuple(value) if field == "shape" else value
    if isinstance(meta, (tuple, list)):
        return tuple(_structure(m, field) for m in meta)
    if isinstance(meta, dict):
        return {k: _structure(v, field) for k, v in meta.items()}
    return None


def node_shape_dtype(node: Node) -> tuple[Any, Any]:
    """The shape and dtype ShapeProp recorded for ``node``, or ``(None, None)``.

    Args:
        node: any node; its ``meta['tensor_meta']`` is read when present.

    Returns:
        ``(shape, dtype)``: a shape is a tuple of ints and a dtype a ``torch.dtype``. A node
        whose value is a tuple/list/dict of tensors gives the same nesting of shapes and of
        dtypes.

    Example::

        >>> ShapeProp(gm).propagate(torch.randn(2, 3))
        >>> node_shape_dtype(next(iter(gm.graph.nodes)))
        ((2, 3), torch.float32)
    """
    meta = node.meta.get("tensor_meta")
    return _structure(meta, "shape"), _structure(meta, "dtype")


def node_input_counts(arg: Any) -> dict[Node, int]:
    """How many times each Node occurs in ``arg`` (args, kwargs, or any nesting of them)."""
    counts: dict[Node, int] = {}

    def note(n: Node) -> Node:
        counts[n] = counts.get(n, 0) + 1
        return n

    map_arg(arg, note)
    return counts


def sub_graphmodule(node: Node, module: torch.nn.Module | None) -> Any:
    """The GraphModule a ``call_module`` node calls (a fused group, say), or None."""
    if node.op != "call_module" or module is None:
        return None
    try:
        sub = module.get_submodule(node.target)
    except AttributeError:
        return None
    # A GraphModule is the module whose graph is of fxlite's kind, as the caller's is
    # (torch.fx's GraphModule holds a torch.fx Graph). Named by what it holds, not by its
    # class: fxlite.graph_module sits above this module.
    return sub if isinstance(getattr(sub, "graph", None), type(node.graph)) else None


def _quote(s: str) -> str:
    """A DOT quoted-string ID for ``s`` (distinct strings give distinct IDs)."""
    s = s.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + s.replace("\n", "\\n").replace("\r", "\\r") + '"'


def _text(s: str) -> str:
    """``s`` as one line of an HTML-like label: entities for ``<>&"'``, control chars shown."""
    s = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", s)
    if len(s) > _MAX_LINE:
        s = s[: _MAX_LINE - 3] + "..."
    return html.escape(s, quote=True)


def _label(*lines: str, bold_first: bool = True) -> str:
    parts = [_text(line) for line in lines if line]
    if bold_first and parts:
        parts[0] = f"<B>{parts[0]}</B>"
    return "<" + "<BR/>".join(parts) + ">"


def _meta_line(node: Node) -> str:
    shape, dtype = node_shape_dtype(node)
    if shape is None and dtype is None:
        return ""
    dtype_s = str(dtype).replace("torch.", "") if dtype is not None else ""
    return f"{shape} {dtype_s}".strip()


class _DotWriter:
    """Accumulates DOT lines; edges are written last, at the top level."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.edges: list[str] = []
        self.clusters: set[str] = set()

    def edge(self, src: str, dst: str, count: int = 1) -> None:
        extra = f' [label="x{count}"]' if count > 1 else ""
        self.edges.append(f"  {_quote(src)} -> {_quote(dst)}{extra};")

    def node(self, ident: str, label: str, indent: str, shape: str = "box",
             fill: str | None = None, dashed: bool = False) -> None:
        attrs = [f"label={label}", f"shape={shape}"]
        if fill:
            attrs.append(f'fillcolor="{fill}"')
        if dashed:
            attrs.append('style="rounded,filled,dashed"')
        self.lines.append(f"{indent}{_quote(ident)} [{', '.join(attrs)}];")

    def cluster_id(self, path: str) -> str:
        base = "cluster_" + re.sub(r"[^0-9A-Za-z_]", "_", path)
        ident, i = base, 1
        while ident in self.clusters:
            ident, i = f"{base}_{i}", i + 1
        self.clusters.add(ident)
        return ident

    def graph(self, graph: Any, module: torch.nn.Module | None, prefix: str, indent: str,
              depth: int, stands_for: tuple[Node, str, torch.nn.Module | None] | None = None
              ) -> None:
        """Write ``graph``'s nodes, their IDs prefixed by ``prefix``.

        For a group's inner graph, ``stands_for`` is ``(call_module node, its ID, the module
        owning it)``: the output box is drawn as that node, under that ID.
        """
        for node in graph.nodes:
            ident = prefix + node.name
            sub = sub_graphmodule(node, module) if depth < _MAX_DEPTH else None
            if sub is not None:
                self.cluster(node, sub, module, prefix, indent, depth)
                continue
            if node.op == "output" and stands_for is not None:
                outer, outer_id, outer_module = stands_for
                self.node(outer_id, self.node_label(outer, outer_module, None), indent)
                for src, count in node_input_counts((node.args, node.kwargs)).items():
                    self.edge(prefix + src.name, outer_id, count)
                continue
            info = lookup(node, module)
            kind = info.kind if info is not None else None
            self.node(ident, self.node_label(node, module, kind), indent,
                      shape=_SHAPE.get(str(node.op), "box"), fill=_FILL.get(kind or "", "#ffffff"),
                      dashed=node.op == "placeholder" and stands_for is not None)
            for src, count in node_input_counts((node.args, node.kwargs)).items():
                self.edge(prefix + src.name, ident, count)

    def cluster(self, node: Node, sub: Any, module: torch.nn.Module | None, prefix: str,
                indent: str, depth: int) -> None:
        kind = sub.meta.get("fused_kind") or type(sub).__name__
        inner = f"{prefix}{node.name}/"
        self.lines.append(f"{indent}subgraph {_quote(self.cluster_id(prefix + node.name))} {{")
        self.lines.append(f"{indent}  label={_label(f'{node.name} ({kind})', bold_first=False)};")
        self.lines.append(f'{indent}  style="rounded,filled"; color="#868e96"; '
                          f'fillcolor="{_CLUSTER_FILL.get(str(kind), "#f8f9fa")}";')
        self.graph(sub.graph, sub, inner, indent + "  ", depth + 1,
                   stands_for=(node, prefix + node.name, module))
        self.lines.append(f"{indent}}}")
        # Parent inputs feed the group's placeholders: positional arguments in order,
        # keywords by placeholder name; anything left over points at the group itself.
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        by_name = {str(p.target): p for p in placeholders}
        targets: list[tuple[object, str]] = []
        for i, arg in enumerate(node.args):
            p = placeholders[i] if i < len(placeholders) else None
            targets.append((arg, inner + p.name if p is not None else prefix + node.name))
        for key, arg in node.kwargs.items():
            p = by_name.get(key)
            targets.append((arg, inner + p.name if p is not None else prefix + node.name))
        for arg, dst in targets:
            for src, count in node_input_counts(arg).items():
                self.edge(prefix + src.name, dst, count)

    @staticmethod
    def node_label(node: Node, module: torch.nn.Module | None, kind: str | None) -> str:
        op = str(node.op)
        if op in ("placeholder", "output"):
            head = op
        else:
            head = f"{op}[{format_target(node.target)}]"
        sub = sub_graphmodule(node, module)
        if sub is not None and sub.meta.get("fused_kind"):
            kind = f"fused {sub.meta['fused_kind']}"
        return _label(node.name, head, kind or "", _meta_line(node))


def graph_dot(graph: Any, module: torch.nn.Module | None = None, name: str = "graph") -> str:
    """The DOT text of ``graph``: the body of ``fxlite.passes.draw.to_dot``, which checks its
    arguments and documents the picture.

    Args:
        graph: a fxlite Graph.
        module: the module that resolves ``call_module`` targets (the GraphModule, or the
            graph's ``owning_module``); without one no clusters are drawn.
        name: the DOT graph's name.
    """
    w = _DotWriter()
    w.graph(graph, module, "", "  ", 0)
    head = [
        f"digraph {_quote(name)} {{",
        "  rankdir=TB;",
        '  graph [fontname="Helvetica", fontsize=11];',
        '  node [shape=box, style="rounded,filled", fillcolor="#ffffff", fontname="Helvetica", fontsize=10];',
        '  edge [color="#495057"];',
    ]
    return "\n".join(head + w.lines + w.edges + ["}"]) + "\n"
