"""``fxlite.explain`` and ``fxlite.export``: what the capture sees in a function.

``explain(fn)(*args, **kwargs)`` (or ``explain(fn, *args, **kwargs)``, as
``torch._dynamo.explain`` takes both) runs ``fn`` once under the recorder and reports the
graphs it splits into, where and why it splits (each break with the user's file, line and
source), the ops of each graph and what later calls are guarded on::

    report = fxlite.explain(bar)(a, b)
    print(report)              # graphs: 2, graph breaks: 1 ... at line 14: if b.sum() < 0:
    report.graphs[0].code      # each graph is a GraphModule

``export(fn, *args, **kwargs)`` returns the captured program as one GraphModule, and
raises :class:`fxlite.TraceError`, naming the line, where it cannot be one graph.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import torch
from fxlite.codegen.capture.guards import StateGuard
from fxlite.codegen.capture.records import result_leaves
from fxlite.codegen.capture.run import record
from fxlite.codegen.capture.segments import split
from fxlite.codegen.capture.structure import flatten, unflatten
from fxlite.codegen.compile import CompiledFunction, CompiledModule

from fxlite.graph_module import GraphModule
from fxlite.node import Node, format_target
from fxlite.proxy import TraceError

__all__ = ["BreakReason", "Explanation", "explain", "export"]


@dataclass(frozen=True)
class BreakReason:
    """Where and why a function splits into another graph."""

    reason: str
    file: str
    line: int
    function: str
    source: str

    def __str__(self) -> str:
        return f'{self.reason}\n  File "{self.file}", line {self.line}, in {self.function}\n    {self.source}'


class Explanation:
    """What :func:`explain` found. Prints as a readable report; renders as HTML in Jupyter.

    Attributes:
        graphs: the captured graphs (GraphModules), in the order the call ran them.
        graph_count: ``len(graphs)``.
        graph_break_count: how many times the call split (``graph_count - 1``).
        break_reasons: a :class:`BreakReason` per break.
        ops_per_graph: per graph, the ops it calls (qualified names).
        guards: what later calls are checked against, one description per line.
        unsupported: why the function cannot be compiled at all, or None.
        effect: why its Python must run on every call (it is *followed*), or None.
        tier: how later calls run: ``"replayed"`` (the compiled graphs alone),
            ``"followed"`` (its Python runs, its torch calls served by kernels) or
            ``"eager"``.
    """

    def __init__(self, graphs: list[GraphModule], break_reasons: list[BreakReason],
                 guards: list[str], unsupported: str | None,
                 effect: str | None = None) -> None:
        self.graphs = graphs
        self.break_reasons = break_reasons
        self.guards = guards
        self.unsupported = unsupported
        self.effect = effect
        self.tier = "eager" if unsupported else "followed" if effect else "replayed"
        self.ops_per_graph = [[_op_name(n) for n in g.graph.nodes
                               if n.op in ("call_function", "call_method", "call_module")]
                              for g in graphs]

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    @property
    def graph_break_count(self) -> int:
        return len(self.break_reasons)

    def __str__(self) -> str:
        lines = [f"graphs: {self.graph_count}, graph breaks: {self.graph_break_count}"]
        if self.unsupported:
            lines.append(f"runs in eager PyTorch: it {self.unsupported}")
        elif self.effect:
            lines.append(f"followed (its Python runs on every call, its torch calls served "
                         f"by kernels): it {self.effect}")
        else:
            lines.append("replayed (its Python computes tensors and nothing else)")
        for i, ops in enumerate(self.ops_per_graph):
            lines.append(f"graph {i}: {len(ops)} ops: {', '.join(ops[:12])}"
                         + (", ..." if len(ops) > 12 else ""))
        for i, reason in enumerate(self.break_reasons):
            lines.append(f"break {i}: {reason}")
        lines.append("guards:")
        lines += [f"  - {g}" for g in self.guards]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        esc = html.escape
        rows = "".join(f"<tr><td>{i}</td><td>{len(ops)}</td><td>{esc(', '.join(ops))}</td></tr>"
                       for i, ops in enumerate(self.ops_per_graph))
        breaks = "".join(
            f"<tr><td>{i}</td><td>{esc(b.reason)}</td><td>{esc(b.file)}:{b.line}</td>"
            f"<td><code>{esc(b.source)}</code></td></tr>"
            for i, b in enumerate(self.break_reasons))
        guards = "".join(f"<li>{esc(g)}</li>" for g in self.guards)
        warn = (f"<p><b>Runs in eager:</b> {esc(self.unsupported)}</p>" if self.unsupported
                else f"<p><b>Followed:</b> {esc(self.effect)}</p>" if self.effect
                else "<p>Replayed</p>")
        return (f"<div class='fxlite-explain'><p>{self.graph_count} graphs, "
                f"{self.graph_break_count} graph breaks</p>{warn}"
                "<table><thead><tr><th>graph</th><th>ops</th><th>calls</th></tr></thead>"
                f"<tbody>{rows}</tbody></table>"
                "<table><thead><tr><th>break</th><th>reason</th><th>where</th><th>code</th>"
                f"</tr></thead><tbody>{breaks}</tbody></table><ul>{guards}</ul></div>")


def _op_name(node: Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return str(node.target)
    return format_target(node.target)


def _unwrap(fn: Any) -> Any:
    if isinstance(fn, CompiledModule):
        return fn._orig_mod
    if isinstance(fn, CompiledFunction):
        return fn._fn
    return fn


def explain(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` once, recording it, and report how it would compile.

    Both of ``torch._dynamo.explain``'s forms work: ``explain(fn)(*args, **kwargs)``, and
    ``explain(fn, *args, **kwargs)``. Given ``fn`` alone it returns the function that
    takes the arguments (so a function of no arguments is ``explain(fn)()``).

    Args:
        fn: a function, a module, or what ``fxlite.compile`` returned.
        *args, **kwargs: the call's arguments (the function really runs once).

    Returns:
        An :class:`Explanation`; given ``fn`` alone, a function that returns one.

    Example::

        report = fxlite.explain(bar)(torch.randn(10), torch.randn(10))
        assert report.graph_break_count == 1
        print(report.break_reasons[0].source)     # if b.sum() < 0:
    """
    if not args and not kwargs:
        def explain_call(*args: Any, **kwargs: Any) -> Explanation:
            return _explain(fn, args, kwargs)

        return explain_call
    return _explain(fn, args, kwargs)


def _explain(fn: Any, args: tuple, kwargs: dict) -> Explanation:
    if not callable(fn):
        raise TypeError(f"fxlite.explain: fn must be a function or an nn.Module, not "
                        f"{type(fn).__name__}")
    fn = _unwrap(fn)
    leaves, _ = flatten((args, kwargs))
    guard = StateGuard(fn)
    _, rec = record(fn, args, kwargs, roots=guard.roots(leaves), bound=guard.bound_objects())
    graphs = [] if rec.unsupported else [s.gm for s in split(rec)]
    reasons = [BreakReason(f"Python reads a tensor's value ({_read_kind(rec, r.node)})",
                           *(r.site or ("?", 0, "?", "?")))
               for r in rec.reads] if not rec.unsupported else []
    return Explanation(graphs, reasons, describe_guards(fn, leaves, rec, guard),
                       rec.unsupported, rec.effect)


def _read_kind(rec: Any, name: str) -> str:
    for node in rec.graph.nodes:
        if node.name == name:
            return str(node.meta.get("read", "value"))
    return "value"


def describe_guards(fn: Any, leaves: list[Any], rec: Any, guard: StateGuard) -> list[str]:
    """Human-readable lines for what a recording is guarded on."""
    out = ["grad mode, autocast state, default dtype and inference mode"]
    names = rec.placeholders
    for i, leaf in enumerate(leaves):
        name = names[i] if i < len(names) and names[i] else f"argument {i}"
        if isinstance(leaf, torch.Tensor):
            text = (f"{name}: a {leaf.dtype} tensor on {leaf.device}, {leaf.dim()}-d, "
                    f"requires_grad={leaf.requires_grad}, its layout pattern")
            if rec.sizes_read:
                text += f", sizes {list(leaf.shape)} (the code reads sizes)"
            out.append(text)
        elif isinstance(leaf, torch.nn.Module):
            out.append(f"argument {i}: this very {type(leaf).__name__} module, and its state")
        elif isinstance(leaf, (int, float, bool, str, type(None))):
            out.append(f"argument {i} == {leaf!r}")
        else:
            out.append(f"argument {i}: this very {type(leaf).__name__} object")
    modules = guard.roots(leaves)
    if modules:
        count = sum(1 for _, m in modules for _ in m.modules())
        out.append(f"the state of {count} modules: training flags, parameters (identity and "
                   "requires_grad), buffers, submodules, hooks, plain attributes")
    out.append("closure cells, defaults and the globals the function's own code names")
    for r in rec.reads:
        where = f"{r.site[0]}:{r.site[1]}" if r.site else "?"
        out.append(f"the value read at {where} picks the path ({r.value!r} here)")
    out.append("not guarded: globals read by other functions, attributes of non-module objects")
    return out


def export(fn: Any, *args: Any, **kwargs: Any) -> GraphModule:
    """The captured program of ``fn(*args, **kwargs)`` as one GraphModule.

    The function runs once. Tensor arguments become the graph's inputs, in order; other
    arguments are fixed at the values given. Raises :class:`fxlite.TraceError`, naming
    the line, where the function reads a tensor's value or cannot be recorded.

    Example::

        gm = fxlite.export(model, torch.randn(2, 8))
        print(gm.code)
        gm(torch.randn(2, 8))
    """
    if not callable(fn):
        raise TypeError(f"fxlite.export: fn must be a function or an nn.Module, not "
                        f"{type(fn).__name__}")
    fn = _unwrap(fn)
    leaves, _ = flatten((args, kwargs))
    guard = StateGuard(fn)
    try:
        _, rec = record(fn, args, kwargs, roots=guard.roots(leaves), fullgraph=True,
                        bound=guard.bound_objects())
    except TraceError as e:
        raise _export_error(e) from None
    if rec.unsupported:
        raise TraceError(f"export: the function cannot be captured: it {rec.unsupported}")
    graph = rec.graph
    out = graph.output_node()
    flat = list(out.args[0])
    structured = unflatten(rec.out_spec, result_leaves(rec.out_refs, flat))
    if _graph_literal(structured):
        out.args = (structured,)
    gm = GraphModule(rec.holder, graph, _export_name(fn))
    gm.meta["out_spec"] = rec.out_spec
    return gm


_FULLGRAPH = "fullgraph=True, but "


def _export_error(e: TraceError) -> TraceError:
    """The recorder's one-graph error, worded for export: export takes no ``fullgraph``
    argument (it always wants one graph), so the message must not blame one."""
    text = str(e)
    if not text.startswith(_FULLGRAPH):
        return e
    return TraceError("export: " + text[len(_FULLGRAPH):])


def _graph_literal(value: Any) -> bool:
    """Whether a structure can be a graph output as it is (plain containers and atoms)."""
    if isinstance(value, Node) or value is None or type(value) in (int, float, bool, str):
        return True
    if type(value) in (tuple, list):
        return all(_graph_literal(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _graph_literal(v) for k, v in value.items())
    return False


def _export_name(fn: Any) -> str:
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    name = getattr(fn, "__name__", "Exported")
    return name if name.isidentifier() else "Exported"

