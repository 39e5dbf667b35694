"""Pictures of graphs: DOT text, and SVG/PNG/PDF through the Graphviz ``dot`` binary.

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
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule, expect_graph_or_module
from fxlite.node import Node, _format_target, describe_value
from fxlite.ops import lookup

from .networkx import node_input_counts, node_shape_dtype, sub_graphmodule

__all__ = ["draw", "to_dot"]

# Fill colours by op-table kind; unknown ops stay white.
_FILL = {
    "pointwise": "#d0ebff", "reduction": "#ffe8cc", "view": "#e9ecef",
    "extern": "#ffc9c9", "effect": "#fff3bf", "composite": "#d3f9d8",
}
_CLUSTER_FILL = {"pointwise": "#f1f8ff", "reduction": "#fff8f0"}
_SHAPE = {"placeholder": "ellipse", "output": "invhouse", "get_attr": "cylinder"}
_MAX_LINE = 80      # label lines longer than this are cut, so huge tuples stay readable
_MAX_DEPTH = 8      # nesting of GraphModules drawn as clusters
_RENDERED = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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

    def graph(self, graph: Graph, module: torch.nn.Module | None, prefix: str, indent: str,
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

    def cluster(self, node: Node, sub: GraphModule, module: torch.nn.Module | None, prefix: str,
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
            head = f"{op}[{_format_target(node.target)}]"
        sub = sub_graphmodule(node, module)
        if sub is not None and sub.meta.get("fused_kind"):
            kind = f"fused {sub.meta['fused_kind']}"
        return _label(node.name, head, kind or "", _meta_line(node))


def to_dot(graph_or_gm: Graph | GraphModule, name: str | None = None) -> str:
    """Render a graph as Graphviz DOT text.

    Nodes are labelled with name, opcode and target, the op-table kind, and shape/dtype
    when ShapeProp has run. ``call_module`` nodes calling a GraphModule (fused groups from
    ``fxlite.passes.fuse``, whose ``meta['fused_kind']`` labels the cluster) are drawn as
    ``subgraph cluster_<name>`` holding the submodule's nodes.

    Args:
        graph_or_gm: a GraphModule, or a Graph (its ``owning_module``, if any, resolves
            ``call_module`` targets; without one no clusters are drawn).
        name: the DOT graph's name; defaults to the module's class name, or ``"graph"``.

    Returns:
        The DOT source text.

    Example::

        def f(x):
            return torch.relu(x + 1)

        print(to_dot(fxlite.symbolic_trace(f)))
        # before: placeholder x -> add -> relu -> output
        # after:  digraph "f" {
        #           "x" [label=<<B>x</B><BR/>placeholder>, shape=ellipse, ...];
        #           "add" [label=<<B>add</B><BR/>call_function[operator.add]<BR/>pointwise>, ...];
        #           ...
        #           "x" -> "add"; "add" -> "relu"; "relu" -> "output";
        #         }
    """
    graph, module = expect_graph_or_module(graph_or_gm, "to_dot")
    default = type(graph_or_gm).__name__ if isinstance(graph_or_gm, GraphModule) else "graph"
    if name is not None and not isinstance(name, str):
        raise TypeError(f"to_dot: name must be a str or None, not {describe_value(name)}")
    w = _DotWriter()
    w.graph(graph, module, "", "  ", 0)
    head = [
        f"digraph {_quote(name or default)} {{",
        "  rankdir=TB;",
        '  graph [fontname="Helvetica", fontsize=11];',
        '  node [shape=box, style="rounded,filled", fillcolor="#ffffff", fontname="Helvetica", fontsize=10];',
        '  edge [color="#495057"];',
    ]
    return "\n".join(head + w.lines + w.edges + ["}"]) + "\n"


def draw(graph_or_gm: Graph | GraphModule, path: str | os.PathLike) -> str:
    """Write a picture of the graph to ``path``; the format follows its suffix.

    ``.dot`` / ``.gv`` write the DOT text of :func:`to_dot`. ``.svg``, ``.png`` and ``.pdf``
    run the Graphviz ``dot`` binary on it.

    Args:
        graph_or_gm: a GraphModule or Graph.
        path: the file to write.

    Without Graphviz's ``dot`` on PATH, a rendered format writes the DOT text next to
    ``path`` (same name, ``.dot`` suffix), says so in one warning, and returns that path.

    Returns:
        The path written, as a string (the ``.dot`` file's without Graphviz).

    Raises:
        ValueError: for an unsupported suffix.
        RuntimeError: when ``dot`` fails. The DOT text is then written next to ``path``
            (same name, ``.dot`` suffix) and the message names that file.

    Example::

        gm = fxlite.passes.fuse(gm)       # after ShapeProp
        draw(gm, "mlp.svg")               # fused groups appear as clusters
        draw(gm, "mlp.dot")               # the DOT source only
    """
    expect_graph_or_module(graph_or_gm, "draw")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"draw: path must be a file path (a str or os.PathLike) such as "
                        f"'graph.svg', not {describe_value(path)}")
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".dot", ".gv") and suffix not in _RENDERED:
        raise ValueError(f"draw: unsupported file type {path.suffix!r}; "
                         f"use .dot, .gv, {', '.join(_RENDERED)}")
    text = to_dot(graph_or_gm)
    if suffix in (".dot", ".gv"):
        path.write_text(text, encoding="utf-8")
        return str(path)
    dot = shutil.which("dot")
    if dot is None:
        fallback = path.with_suffix(".dot")
        fallback.write_text(text, encoding="utf-8")
        warnings.warn(f"draw: the Graphviz 'dot' binary was not found on PATH, so {path.name} "
                      f"was not rendered; the DOT source was written to {fallback} (install "
                      "graphviz, e.g. `apt-get install graphviz`)", stacklevel=2)
        return str(fallback)
    proc = subprocess.run([dot, f"-T{_RENDERED[suffix]}", "-o", str(path)],
                          input=text.encode("utf-8"), capture_output=True, timeout=120)
    if proc.returncode != 0:
        fallback = path.with_suffix(".dot")
        fallback.write_text(text, encoding="utf-8")
        raise RuntimeError(f"draw: `dot -T{_RENDERED[suffix]}` failed (exit {proc.returncode}): "
                           f"{proc.stderr.decode(errors='replace').strip()}; "
                           f"the DOT source is in {fallback}")
    return str(path)
