"""Pictures of graphs: DOT text, and SVG/PNG/PDF through the Graphviz ``dot`` binary.

The DOT text, and what each box and cluster shows, is ``fxlite.viz.dot``'s (the HTML view
of a graph draws with it too); this module checks arguments and writes files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule, expect_graph_or_module
from fxlite.node import describe_value
from fxlite.viz.dot import graph_dot

__all__ = ["draw", "to_dot"]

_RENDERED = {".svg": "svg", ".png": "png", ".pdf": "pdf"}


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
    return graph_dot(graph, module, name or default)


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
