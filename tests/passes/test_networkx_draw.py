"""to_networkx, to_dot and draw: attributes, edges, escaping, clusters for fused groups."""

from __future__ import annotations

import importlib
import json
import operator
import re
import shutil
import subprocess

import networkx as nx
import pytest
import torch
from fxlite.passes.decompose import decompose
from fxlite.passes.draw import draw, to_dot
from fxlite.passes.fuse import fuse
from fxlite.passes.networkx import to_networkx
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

# The module itself: fxlite.passes.draw is also the name of the draw() function.
draw_module = importlib.import_module("fxlite.passes.draw")

import fxlite
from fxlite.graph import Graph
from fxlite.graph_module import GraphModule

DOT = shutil.which("dot")
_QUOTED = r'"((?:[^"\\]|\\.)*)"'
_EDGE = re.compile(rf"^\s*{_QUOTED}\s*->\s*{_QUOTED}(?:\s*\[label=\"x(\d+)\"\])?;$", re.M)
_CLUSTER = re.compile(rf"^\s*subgraph\s+{_QUOTED}\s*{{", re.M)


def _unquote(s: str) -> str:
    """Invert draw._quote (\\" -> ", \\\\ -> \\, \\n -> newline)."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r"}.get(m.group(1), m.group(1)), s)


def _edges(text: str) -> dict[tuple[str, str], int]:
    return {(_unquote(a), _unquote(b)): int(c or 1) for a, b, c in _EDGE.findall(text)}


def _render_json(text: str) -> dict:
    """Let Graphviz parse ``text``; return its JSON description."""
    proc = subprocess.run([DOT, "-Tjson"], input=text.encode(), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def _check_dot(text: str) -> dict | None:
    """The DOT text is well formed: rendered by ``dot`` when installed, else checked by shape."""
    if DOT is not None:
        proc = subprocess.run([DOT, "-Tsvg"], input=text.encode(), capture_output=True, timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert b"<svg" in proc.stdout
        return _render_json(text)
    # Structure only: one digraph, balanced braces outside quoted strings and HTML labels.
    assert text.startswith("digraph ") and text.rstrip().endswith("}")
    bare = _outside_strings_and_labels(text)
    assert bare.count("{") == bare.count("}")
    return None


def _outside_strings_and_labels(text: str) -> str:
    """The DOT text less its quoted strings and its ``<...>`` HTML-like labels (nested)."""
    out, i, depth = [], 0, 0
    while i < len(text):
        c = text[i]
        if depth:
            depth += {"<": 1, ">": -1}.get(c, 0)
        elif c == '"':
            end = re.match(_QUOTED, text[i:])
            assert end is not None, f"unterminated string at {i}"
            i += end.end()
            continue
        elif c == "<":
            depth = 1
        else:
            out.append(c)
        i += 1
    assert depth == 0, "unbalanced HTML-like label"
    return "".join(out)


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        s = h + h                              # one input read twice
        return torch.clamp(s, min=y.sum()).transpose(0, 1)   # kwargs input


def _fused_by_hand() -> GraphModule:
    """x -> fused_0(x, y) -> add(fused_0, x) -> output, fused_0 = relu(a) * b (pointwise)."""
    inner = Graph()
    a, b = inner.placeholder("a"), inner.placeholder("b")
    inner.output(inner.call_function(operator.mul, (inner.call_function(torch.relu, (a,)), b)))
    sub = GraphModule(torch.nn.Module(), inner)
    sub.meta["fused_kind"] = "pointwise"
    root = torch.nn.Module()
    root.fused_0 = sub
    outer = Graph()
    x, y = outer.placeholder("x"), outer.placeholder("y")
    f = outer.call_module("fused_0", (x, y))
    outer.output(outer.call_function(operator.add, (f, x)))
    return GraphModule(root, outer)


# ---------------------------------------------------------------------- to_networkx
def test_to_networkx_nodes_attributes_and_edges() -> None:
    gm = fxlite.symbolic_trace(_Small())
    g = to_networkx(gm)
    nodes = list(gm.graph.nodes)
    assert list(g.nodes) == [n.name for n in nodes]
    by_name = {n.name: n for n in nodes}
    for name, attrs in g.nodes(data=True):
        n = by_name[name]
        assert attrs["op"] == str(n.op)
        assert attrs["shape"] is None and attrs["dtype"] is None  # no ShapeProp yet
        assert attrs["fused_kind"] is None
    assert g.nodes["lin"]["kind"] == "extern" and g.nodes["lin"]["target"] == "lin"
    assert g.nodes["add"]["kind"] == "pointwise" and g.nodes["add"]["target"] == "operator.add"
    assert g.nodes["transpose"]["kind"] == "view"
    assert g.nodes["x"]["kind"] is None and g.nodes["output"]["kind"] is None
    # One edge per (input, user) pair, with multiplicity; kwargs inputs count too.
    expected = {}
    for n in nodes:
        for inp in n.all_input_nodes:
            expected[(inp.name, n.name)] = None
    assert set(g.edges) == set(expected)
    assert g.edges["lin", "add"]["count"] == 2
    clamp = next(n for n in nodes if n.name.startswith("clamp"))
    assert g.edges["sum_1", clamp.name]["count"] == 1
    assert all(c >= 1 for *_, c in g.edges(data="count"))
    # Graph order is a topological order of the DiGraph.
    position = {name: i for i, name in enumerate(g.nodes)}
    assert all(position[a] < position[b] for a, b in g.edges)
    assert nx.is_directed_acyclic_graph(g)


def test_to_networkx_with_shape_prop_meta() -> None:
    def f(x):
        m = torch.max(x, dim=1)          # a (values, indices) tuple
        return m[0].to(torch.float64), m[1]

    gm = fxlite.symbolic_trace(f)
    x = torch.randn(3, 5)
    ShapeProp(gm).propagate(x)
    g = to_networkx(gm)
    values, indices = torch.max(x, dim=1)
    assert g.nodes["x"]["shape"] == tuple(x.shape) and g.nodes["x"]["dtype"] == x.dtype
    assert g.nodes["max_1"]["shape"] == (tuple(values.shape), tuple(indices.shape))
    assert g.nodes["max_1"]["dtype"] == (values.dtype, indices.dtype)
    to_node = next(n for n in g.nodes if n.startswith("to"))
    assert g.nodes[to_node]["dtype"] == torch.float64
    assert g.nodes[to_node]["shape"] == tuple(values.shape)


def test_to_networkx_accepts_graph_and_reports_fused_groups() -> None:
    gm = _fused_by_hand()
    from_graph = to_networkx(gm.graph)   # owning_module resolves call_module targets
    from_module = to_networkx(gm)
    assert dict(from_graph.nodes(data=True)) == dict(from_module.nodes(data=True))
    assert from_module.nodes["fused_0"]["fused_kind"] == "pointwise"
    assert from_module.nodes["fused_0"]["op"] == "call_module"
    assert from_module.nodes["add"]["fused_kind"] is None
    assert set(from_module.edges) == {("x", "fused_0"), ("y", "fused_0"), ("x", "add"),
                                      ("fused_0", "add"), ("add", "output")}
    with pytest.raises(TypeError, match="Graph or GraphModule"):
        to_networkx(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------- to_dot
def test_to_dot_labels_edges_and_parse() -> None:
    gm = fxlite.symbolic_trace(_Small())
    ShapeProp(gm).propagate(torch.randn(2, 4), torch.randn(3))
    text = to_dot(gm)
    edges = _edges(text)
    nxg = to_networkx(gm)
    assert edges == {(a, b): c for a, b, c in nxg.edges(data="count")}
    add_line = next(line for line in text.splitlines() if line.strip().startswith('"add" ['))
    assert "call_function[operator.add]" in add_line and "pointwise" in add_line
    assert "(2, 3) float32" in add_line        # from tensor_meta of h + h
    parsed = _check_dot(text)
    if parsed is not None:
        assert sorted(o["name"] for o in parsed["objects"]) == sorted(n.name for n in gm.graph.nodes)
        assert len(parsed["edges"]) == len(edges)


ODD_NAMES = ['a"b', "a);print(", "line\nbreak", "<b>&amp;", 'x" ]; "evil" [label="pwned', "tab\there"]


def test_to_dot_escapes_odd_names_and_targets() -> None:
    g = Graph()
    nodes = [g.placeholder("p")]
    for _ in ODD_NAMES[1:]:
        nodes.append(g.call_method('we"ird}<&', (nodes[-1],)))
    g.output(nodes[-1])
    for n, name in zip(nodes, ODD_NAMES):
        n.name = name                # names a tracer would never make; to_dot must cope
    text = to_dot(g)
    chain = list(zip(ODD_NAMES, ODD_NAMES[1:])) + [(ODD_NAMES[-1], "output")]
    assert _edges(text) == {pair: 1 for pair in chain}
    assert "<B>a&quot;b</B>" in text and "&lt;b&gt;&amp;amp;" in text
    assert "call_method[we&quot;ird}&lt;&amp;]" in text
    assert '"line\\nbreak" [label=<<B>line\\x0abreak</B>' in text  # the newline stays escaped
    parsed = _check_dot(text)
    if parsed is not None:
        names = [o["name"] for o in parsed["objects"]]
        assert len(names) == len(ODD_NAMES) + 1          # no node injected, none lost
        assert "evil" not in names
        for name in ('a"b', "a);print(", "<b>&amp;", 'x" ]; "evil" [label="pwned'):
            assert name in names


def test_to_dot_draws_fused_groups_as_clusters() -> None:
    gm = _fused_by_hand()
    text = to_dot(gm)
    assert _CLUSTER.findall(text) == ["cluster_fused_0"]
    # The cluster's body holds the inner nodes and the box standing for fused_0.
    body = text[text.index('subgraph "cluster_fused_0"'):]
    body = body[: body.index("\n  }")]
    assert "fused_0 (pointwise)" in body
    for ident in ("fused_0/a", "fused_0/b", "fused_0/relu", "fused_0/mul", "fused_0"):
        assert f'"{ident}" [' in body
    assert "fused pointwise" in body
    # Parent inputs feed the inner placeholders; users read the group's box.
    assert _edges(text) == {
        ("x", "fused_0/a"): 1, ("y", "fused_0/b"): 1, ("fused_0/a", "fused_0/relu"): 1,
        ("fused_0/relu", "fused_0/mul"): 1, ("fused_0/b", "fused_0/mul"): 1,
        ("fused_0/mul", "fused_0"): 1, ("fused_0", "add"): 1, ("x", "add"): 1, ("add", "output"): 1,
    }
    parsed = _check_dot(text)
    if parsed is not None:
        clusters = [o for o in parsed["objects"] if o["name"].startswith("cluster_")]
        assert [c["name"] for c in clusters] == ["cluster_fused_0"]
        inside = {parsed["objects"][i]["name"] for i in clusters[0]["nodes"]}
        assert inside == {"fused_0/a", "fused_0/b", "fused_0/relu", "fused_0/mul", "fused_0"}
    # A plain Graph without an owning module has no submodules to open: no clusters.
    g = Graph()
    g.output(g.call_module("fused_0", (g.placeholder("x"),)))
    assert _CLUSTER.findall(to_dot(g)) == []


# ---------------------------------------------------------------------- draw
def test_draw_writes_dot_and_svg(tmp_path) -> None:
    gm = _fused_by_hand()
    out = draw(gm, tmp_path / "g.dot")
    assert out == str(tmp_path / "g.dot")
    assert (tmp_path / "g.dot").read_text() == to_dot(gm)
    with pytest.raises(ValueError, match="unsupported file type"):
        draw(gm, tmp_path / "g.txt")
    if DOT is None:
        pytest.skip("Graphviz dot is not installed")
    svg = tmp_path / "g.svg"
    assert draw(gm, svg) == str(svg)
    assert "<svg" in svg.read_text() and "cluster_fused_0" in svg.read_text()
    png = tmp_path / "g.png"
    draw(gm, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_without_dot_writes_dot_and_says_so(tmp_path, monkeypatch) -> None:
    gm = _fused_by_hand()
    monkeypatch.setattr(draw_module.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match=r"'dot' binary was not found") as said:
        written = draw(gm, tmp_path / "pic.svg")  # says so, does not raise (README)
    fallback = tmp_path / "pic.dot"
    assert written == str(fallback) and len(said) == 1
    assert str(fallback) in str(said[0].message)
    assert fallback.read_text() == to_dot(gm)
    assert not (tmp_path / "pic.svg").exists()


def test_draw_reports_a_failing_dot(tmp_path, monkeypatch) -> None:
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` binary")
    monkeypatch.setattr(draw_module.shutil, "which", lambda name: false)
    with pytest.raises(RuntimeError, match=r"failed \(exit 1\)"):
        draw(_fused_by_hand(), tmp_path / "pic.svg")
    assert (tmp_path / "pic.dot").exists()


class _MLPBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


def test_draw_mlp_block_after_fuse(tmp_path) -> None:
    model = _MLPBlock().eval()
    x = torch.randn(4, 8)
    gm = fxlite.symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    gm = decompose(normalize(gm))
    ShapeProp(gm).propagate(x)
    fused = fuse(gm)
    groups = [n for n in fused.graph.nodes
              if n.op == "call_module" and isinstance(fused.get_submodule(n.target), GraphModule)]
    assert len(groups) == 2

    g = to_networkx(fused)
    assert nx.is_directed_acyclic_graph(g)
    kinds = [g.nodes[n.name]["fused_kind"] or g.nodes[n.name]["kind"] for n in fused.graph.nodes
             if n.op not in ("placeholder", "get_attr", "output")
             and n.meta.get("type") is not int]  # element counts (size, norms' checked count)
    assert kinds == ["extern", "pointwise", "extern", "reduction"]

    dot_path = tmp_path / "mlp.dot"
    draw(fused, dot_path)
    text = dot_path.read_text()
    assert sorted(_CLUSTER.findall(text)) == sorted(f"cluster_{n.name}" for n in groups)
    for n in groups:
        kind = fused.get_submodule(n.target).meta["fused_kind"]
        assert f"{n.name} ({kind})" in text
        inner = [m for m in fused.get_submodule(n.target).graph.nodes if m.op != "output"]
        for m in inner:
            assert f'"{n.name}/{m.name}" [' in text
    _check_dot(text)
    if DOT is None:
        pytest.skip("Graphviz dot is not installed")
    svg = tmp_path / "mlp.svg"
    draw(fused, svg)
    assert "<svg" in svg.read_text()
