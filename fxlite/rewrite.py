"""replace_pattern: find every copy of a pattern in a graph and swap in a replacement.

A rewrite rule is a pair of functions with the same inputs; read it as algebra::

    def pattern(x):                      # relu(x + 1) -> gelu(x + 1)
        return torch.relu(x + 1.0)

    def replacement(x):
        return F.gelu(x + 1.0)

    matches = fxlite.replace_pattern(gm, pattern, replacement)

Both are traced with :func:`fxlite.symbolic_trace` (Graphs and GraphModules are taken as
they are). Matching is linear in the size of the graph (see :mod:`fxlite.matcher`) and,
beyond torch.fx:

- **spelling-blind**: ``x + y``, ``torch.add(x, y)`` and ``x.add(y)`` match each other,
  as do ``torch.relu``, ``F.relu``, ``x.relu()`` and ``nn.ReLU``; the equivalences come
  from :mod:`fxlite.ops`. ``match_spellings=False`` asks for equal targets instead.
- **explained**: ``explain_no_match`` (or ``explain=True``) names, for the closest
  candidates, the first pattern node or argument that failed and why.
- **transactional**: everything that can fail (tracing, validation, filters) runs before
  the graph is touched; if the rewrite still raises, the graph is restored as it was.

A match is rewritten only if no matched node other than a returned one is used outside
it, it overlaps no earlier match (graph order, first wins), and the replacement can be
placed where all its inputs are computed and before all users of its results. The
replacement is inserted right after the last matched node (or, if a user of a result
comes earlier, right before that user); matched nodes left unused are erased. The graph
is linted once at the end and the module recompiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .graph import Graph, gc_paused
from .graph_module import GraphModule, copy_attr
from .matcher import UNBOUND, InternalMatch, Search, SubgraphMatcher, fetch_attr, flatten
from .node import Node, collect_nodes, map_arg
from .proxy import TraceError
from .tracer import Tracer

__all__ = ["InternalMatch", "Match", "ReplacedPatterns", "SubgraphMatcher", "explain_no_match",
           "replace_pattern", "replace_pattern_with_filters"]

Pattern = Callable[..., Any] | Graph | GraphModule
MatchFilter = Callable[[InternalMatch, Graph, Graph], bool]


class Match(NamedTuple):
    """One rewritten match: ``anchor`` is the graph node matched to the pattern's output,
    ``nodes_map`` maps pattern nodes to the graph nodes they matched. A pattern input maps
    to the value the replacement read: after an earlier rewrite in the same call replaced
    that value, the new node, never an erased one."""

    anchor: Node
    nodes_map: dict[Node, Node]


@dataclass
class ReplacedPatterns:
    """One rewritten match, with ``replacements``: the nodes inserted for it."""

    anchor: Node
    nodes_map: dict[Node, Node]
    replacements: list[Node]


def replace_pattern(gm: GraphModule, pattern: Pattern, replacement: Pattern, *,
                    match_spellings: bool = True, explain: bool = False) -> list[Match]:
    """Replace every non-overlapping match of ``pattern`` in ``gm`` with ``replacement``.

    Args:
        gm: the module to rewrite in place (a bare Graph is accepted too).
        pattern: a function, Graph or GraphModule; its inputs match any value.
        replacement: a function, Graph or GraphModule with as many inputs as ``pattern``
            and as many outputs.
        match_spellings: let equivalent spellings of an op match (``x + 1`` and
            ``torch.add(x, 1)``). False asks for equal targets, as torch.fx does.
        explain: print, before rewriting, the matches and why the closest other
            candidates failed (see :func:`explain_no_match`).

    Returns:
        One :class:`Match` per rewritten match, in graph order.

    Raises:
        TraceError: ``pattern`` or ``replacement`` cannot be traced (the message names it).
        ValueError: the pattern has dead code or unused inputs, or pattern and replacement
            take different numbers of inputs or return different numbers of values.

    Example::

        def pattern(w1, w2):
            return torch.cat([w1, w2]).sum()

        def replacement(w1, w2):
            return torch.stack([w1, w2])

        matches = fxlite.replace_pattern(gm, pattern, replacement)
    """
    _expect_target(gm, "replace_pattern")
    done = replace_pattern_with_filters(gm, pattern, replacement, match_spellings=match_spellings,
                                        explain=explain)
    return [Match(r.anchor, r.nodes_map) for r in done]


def _expect_target(gm: Any, where: str) -> None:
    """A TypeError naming ``gm`` unless it is a GraphModule or a Graph to rewrite."""
    if not isinstance(gm, GraphModule | Graph):
        raise TypeError(f"{where}: gm must be a GraphModule or Graph to rewrite, not "
                        f"{type(gm).__name__}; trace it first: fxlite.symbolic_trace(module)")


def replace_pattern_with_filters(
        gm: GraphModule, pattern: Pattern, replacement: Pattern | None = None,
        match_filters: Sequence[MatchFilter] | None = None, ignore_literals: bool = False,
        replacement_callback: Callable[[InternalMatch, Graph, Graph], Graph] | None = None, *,
        match_spellings: bool = True, explain: bool = False) -> list[ReplacedPatterns]:
    """:func:`replace_pattern` with match filters, literal wildcards and per-match replacements.

    Args:
        gm, pattern, replacement, match_spellings, explain: as in :func:`replace_pattern`.
        match_filters: each is called as ``f(match, original_graph, pattern_graph)`` with
            an :class:`InternalMatch`; a match is rewritten only if all return True.
            A rejected match does not block an overlapping later one.
        ignore_literals: constant arguments in the pattern match any constant.
        replacement_callback: called as ``f(match, original_graph, pattern_graph)`` to
            build the replacement Graph of each match, instead of ``replacement``.

    Returns:
        One :class:`ReplacedPatterns` per rewritten match, with the inserted nodes.

    Example::

        only_small = lambda m, g, p: m.placeholder_nodes[0].name.startswith("x")
        replace_pattern_with_filters(gm, pattern, replacement, [only_small])
    """
    _expect_target(gm, "replace_pattern_with_filters")
    graph, module = _target(gm)
    pgraph, pmod = _as_graph(pattern, "pattern")
    matcher = SubgraphMatcher(pgraph, ignore_literals=ignore_literals,
                              match_spellings=match_spellings, pattern_module=pmod)
    if (replacement is None) == (replacement_callback is None):
        raise ValueError("give exactly one of replacement and replacement_callback")
    fixed = None
    if replacement is not None:
        fixed = _Replacement(matcher, *_as_graph(replacement, "replacement"), module)
    filters = list(match_filters or ())
    accept = (lambda m: all(f(m, graph, pgraph) for f in filters)) if filters else None
    if explain:
        print(_report(matcher, graph, module, accept, _name(pattern), 3))
    with gc_paused():  # a rewrite allocates a few objects per node: see gc_paused
        search = Search(matcher, graph, module, accept=accept)
        matches = search.run()
        if not matches:
            return []
        plans = []
        for m in matches:  # build and check every replacement before touching the graph
            rep = fixed
            if rep is None:
                rep = _Replacement(matcher, *_as_graph(replacement_callback(m, graph, pgraph),
                                                       "replacement"), module)
            plans.append((m, rep))
        return _Rewrite(graph, module, matcher, search.pos).apply(plans)


def explain_no_match(gm: GraphModule | Graph, pattern: Pattern, *,
                     match_filters: Sequence[MatchFilter] | None = None,
                     ignore_literals: bool = False, match_spellings: bool = True, top: int = 3) -> str:
    """Explain where ``pattern`` matches in ``gm`` and why the closest candidates don't.

    Every operation node is tried as the pattern's anchor, those computing another op
    too. For the ``top`` candidates that got furthest, the report names the first pattern
    node or argument that failed and the reason. Nothing is modified.

    Args:
        gm: the module or graph to search.
        pattern, match_filters, ignore_literals, match_spellings: as in
            :func:`replace_pattern_with_filters`.
        top: how many near misses to show.

    Returns:
        The report, several lines of text.

    Example::

        print(fxlite.rewrite.explain_no_match(gm, lambda x: torch.relu(x + 1.0)))
        # ... candidate %relu (matched 2 of 3 pattern nodes): at pattern node
        #     %add (call_function operator.add), argument 1: the constant differs: ...
    """
    graph, module = _target(gm)
    pgraph, pmod = _as_graph(pattern, "pattern")
    matcher = SubgraphMatcher(pgraph, ignore_literals=ignore_literals,
                              match_spellings=match_spellings, pattern_module=pmod)
    filters = list(match_filters or ())
    accept = (lambda m: all(f(m, graph, pgraph) for f in filters)) if filters else None
    return _report(matcher, graph, module, accept, _name(pattern), top)


def _report(matcher: SubgraphMatcher, graph: Graph, module: Any,
            accept: Callable[[InternalMatch], bool] | None, name: str, top: int) -> str:
    matches, misses = matcher.explain(graph, module, accept)
    ops = ", ".join(n.name for n in matcher.op_nodes)
    found = len(matches)
    head = f"pattern {name} (ops: {ops}) in a graph of {len(graph.nodes)} nodes: {found} match"
    head += "es" if found != 1 else ""
    if matches:
        head += " at " + ", ".join(f"%{m.anchors[0].name}" for m in matches[:10])
        head += ", ..." if found > 10 else ""
    lines = [head + "."]
    if not misses:
        lines.append("No other candidate." if matches else "The graph has no operation to match.")
    else:
        lines.append(f"{len(misses)} other candidate{'s' if len(misses) != 1 else ''}; the closest:")
        lines += [f"  {i}. {miss}" for i, miss in enumerate(misses[:top], 1)]
    return "\n".join(lines)


# ---------------------------------------------------------------------- inputs
def _name(obj: Any) -> str:
    if isinstance(obj, Graph):
        return "<Graph>"
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def _target(gm: Any) -> tuple[Graph, torch.nn.Module | None]:
    if isinstance(gm, GraphModule):
        return gm.graph, gm
    if isinstance(gm, Graph):
        return gm, gm.owning_module
    raise TypeError(f"expected a fxlite.GraphModule or Graph to rewrite, got {type(gm).__name__}")


def _as_graph(obj: Any, role: str) -> tuple[Graph, torch.nn.Module | None]:
    """The graph of a pattern or replacement, tracing it if it is a function or module."""
    if isinstance(obj, GraphModule):
        return obj.graph, obj
    if isinstance(obj, Graph):
        return obj, obj.owning_module
    if not callable(obj):
        raise TypeError(f"the {role} must be a function, Graph or GraphModule, not {type(obj).__name__}")
    tracer = Tracer()  # a Graph is all we need: no GraphModule, no compiled forward
    try:
        graph = tracer.trace(obj)
    except Exception as e:
        raise TraceError(f"cannot trace the {role} {_name(obj)!r}: {e}") from e
    return graph, tracer.root


class _Replacement:
    """A replacement graph, checked against the pattern and taken apart once."""

    __slots__ = ("graph", "module", "placeholders", "ops", "leaves", "attrs", "flat")

    def __init__(self, matcher: SubgraphMatcher, rgraph: Graph, rmod: Any, module: Any) -> None:
        nodes = list(rgraph.nodes)
        self.graph, self.module = rgraph, rmod
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.ops = [n for n in nodes if n.op not in ("placeholder", "output")]
        # Ops whose arguments are Nodes or constants, not containers, and with kwargs
        # free of Nodes: copied by a fast path (most replacement nodes are).
        self.flat = {n for n in self.ops
                     if all(type(a) is Node or type(a) in (int, float, bool, str, type(None))
                            for a in n.args)
                     and not any(isinstance(v, (Node, list, tuple, dict, slice))
                                 for v in n.kwargs.values())}
        pph = matcher.placeholders
        if len(self.placeholders) != len(pph):
            raise ValueError(f"the pattern takes {len(pph)} inputs ({', '.join(p.name for p in pph)}) "
                             f"but the replacement takes {len(self.placeholders)} "
                             f"({', '.join(p.name for p in self.placeholders)})")
        outs = [n for n in nodes if n.op == "output"]
        if len(outs) != 1:
            raise ValueError(f"the replacement must have exactly one output node, found {len(outs)}")
        self.leaves: list[Any] = []
        flatten(outs[0].args[0] if outs[0].args else None, self.leaves)
        if len(self.leaves) != len(matcher.returning):
            raise ValueError(f"the pattern returns {len(matcher.returning)} values but the "
                             f"replacement returns {len(self.leaves)}")
        self.attrs = []  # attributes the rewritten module lacks, to copy from the replacement
        for n in self.ops:
            if n.op in ("get_attr", "call_module") and fetch_attr(module, n.target) is UNBOUND:
                if fetch_attr(rmod, n.target) is UNBOUND:
                    raise ValueError(f"the replacement's %{n.name} refers to {n.target!r}, which "
                                     "neither the replacement nor the rewritten module has")
                self.attrs.append(n.target)
        if self.attrs and not isinstance(module, torch.nn.Module):
            raise ValueError(f"the replacement refers to {self.attrs[0]!r}, but the rewritten "
                             "graph has no owning module to hold it")


# ---------------------------------------------------------------------- the rewrite
class _Rewrite:
    """Applies matches to a graph, keeping a journal so that a failure can be undone."""

    def __init__(self, graph: Graph, module: Any, matcher: SubgraphMatcher,
                 pos: dict[Node, float]) -> None:
        self.graph, self.module, self.matcher, self.pos = graph, module, matcher, pos
        self.order = list(pos)  # the original nodes, in order (pos was filled in order)
        self.saved: dict[Node, tuple[tuple, dict]] = {}
        self.created: list[Node] = []
        self.created_set: set[Node] = set()
        self.added_attrs: list[str] = []
        self.next_suffix = dict(graph._namespace._next_suffix)
        self.replaced: dict[Node, Any] = {}
        self.dropped_modules: set[str] = set()  # call_module targets of erased nodes

    def touch(self, n: Node) -> None:
        if n not in self.saved and n not in self.created_set:
            self.saved[n] = (n.args, n.kwargs)

    def apply(self, plans: list[tuple[InternalMatch, _Replacement]]) -> list[ReplacedPatterns]:
        done = []
        try:
            for m, rep in plans:
                r = self._one(m, rep)
                if r is not None:
                    done.append(r)
            if done:
                self.graph.lint()
                if isinstance(self.module, GraphModule) and self.module.graph is self.graph:
                    self.module.recompile()
        except BaseException:
            self.rollback()
            raise
        if done:
            self._delete_replaced_modules()
        return done

    def _delete_replaced_modules(self) -> None:
        """Delete the submodules that only the replaced nodes called (as torch.fx does)."""
        if not self.dropped_modules or not isinstance(self.module, GraphModule):
            return
        used = {n.target for n in self.graph.nodes if n.op in ("call_module", "get_attr")}
        for target in sorted(self.dropped_modules):
            if not any(u == target or u.startswith(target + ".") for u in used):
                self.module.delete_submodule(target)

    def _resolve(self, n: Any) -> Any:
        replaced = self.replaced
        while isinstance(n, Node) and n in replaced:
            n = replaced[n]
        return n

    def _one(self, m: InternalMatch, rep: _Replacement) -> ReplacedPatterns | None:
        graph, pos, matcher, resolve = self.graph, self.pos, self.matcher, self._resolve
        inputs = [resolve(v) if isinstance(v, Node) else map_arg(v, resolve)
                  for v in m.placeholder_nodes]
        nodes_map = m.nodes_map
        matched = [nodes_map[pn] for pn in matcher.op_nodes]
        mset = set(matched)
        if len(mset) != len(matched) or any(gn._erased for gn in matched):
            return None
        # Where the replacement can go: after every input, before every outside user.
        last_input = -1.0
        for v in inputs:
            if isinstance(v, Node):
                last_input = max(last_input, pos[v])
            else:
                found: dict[Node, None] = {}
                collect_nodes(v, found)
                last_input = max([last_input, *(pos[n] for n in found)])
        last = max(matched, key=pos.__getitem__)
        first_user = min((u for r in m.returning_nodes for u in r.users if u not in mset),
                         key=pos.__getitem__, default=None)
        if first_user is None or pos[last] < pos[first_user]:
            where = last._next
        elif last_input < pos[first_user]:
            where = first_user
        else:
            return None  # earlier rewrites moved things so that this one would make a cycle
        if rep.attrs:
            self._copy_attrs(rep)
        val_map: dict[Node, Any] = dict(zip(rep.placeholders, inputs))
        new_nodes: list[Node] = []
        saved_point, graph._insert_before = graph._insert_before, where  # inserting_before
        try:
            lookup = val_map.__getitem__
            for rn in rep.ops:
                if rn in rep.flat:  # plain arguments: map them without the general walk
                    args = tuple([val_map[a] if type(a) is Node else a for a in rn.args])
                    new = graph.create_node(rn.op, rn.target, args, rn.kwargs, rn.name, rn.type)
                    if rn.meta:
                        new.meta = dict(rn.meta)
                else:
                    new = graph.node_copy(rn, lookup)
                new_nodes.append(new)
                val_map[rn] = new
        finally:  # record what was created even if copying failed halfway, for rollback
            graph._insert_before = saved_point
            self.created.extend(new_nodes)
            self.created_set.update(new_nodes)
        if new_nodes:
            self._number(new_nodes, where)
        for r, leaf in zip(m.returning_nodes, rep.leaves):
            new = val_map[leaf] if isinstance(leaf, Node) else leaf
            for u in [u for u in r.users if u not in mset]:
                self.touch(u)
                u.replace_input_with(r, new)
            self.replaced[r] = new
        for gn in reversed(matched):  # users before producers
            if not gn.users:
                self.touch(gn)
                graph.erase_node(gn)
                if gn.op == "call_module":
                    self.dropped_modules.add(gn.target)
        nodes_map = dict(nodes_map)
        for p, v in zip(matcher.placeholders, inputs):
            nodes_map[p] = v
        return ReplacedPatterns(m.anchors[0], nodes_map, new_nodes)

    def _number(self, new_nodes: list[Node], before: Node) -> None:
        """Give inserted nodes positions between their neighbours (renumber if too tight)."""
        pos = self.pos
        lo = pos.get(new_nodes[0].prev, -1.0)
        hi = pos.get(before, lo + len(new_nodes) + 1.0)
        step = (hi - lo) / (len(new_nodes) + 1)
        values = [lo + step * (i + 1) for i in range(len(new_nodes))]
        if all(a < b for a, b in zip([lo, *values], [*values, hi])):
            pos.update(zip(new_nodes, values))
        else:  # float gaps exhausted by many rewrites at one spot: rare, O(n)
            for i, n in enumerate(self.graph.nodes):
                pos[n] = float(i)

    def _copy_attrs(self, rep: _Replacement) -> None:
        for target in rep.attrs:
            if fetch_attr(self.module, target) is not UNBOUND:  # copied for an earlier match
                continue
            atoms = target.split(".")
            first_missing = next(".".join(atoms[:i + 1]) for i in range(len(atoms))
                                 if fetch_attr(self.module, ".".join(atoms[:i + 1])) is UNBOUND)
            self.added_attrs.append(first_missing)
            copy_attr(rep.module, self.module, target, f"the replacement refers to {target!r}")

    def rollback(self) -> None:
        """Put the graph back exactly as it was before :meth:`apply`."""
        graph = self.graph
        for n in self.saved:
            n._erased = False
        for n, (args, kwargs) in self.saved.items():
            n._update_args_kwargs(args, kwargs)
        for n in reversed(self.created):
            n._update_args_kwargs((), {})
        for n in self.created:
            n.users.clear()
            n._erased = True
            graph._namespace.release(n.name)
        root, prev = graph._root, graph._root
        for n in self.order:
            prev._next, n._prev = n, prev
            prev = n
        prev._next, root._prev = root, prev
        graph._len = len(self.order)
        graph._namespace._next_suffix = self.next_suffix
        for target in reversed(self.added_attrs):
            parent, _, name = target.rpartition(".")
            holder = fetch_attr(self.module, parent) if parent else self.module
            if holder is not UNBOUND and hasattr(holder, name):
                delattr(holder, name)
        if self.created and isinstance(self.module, GraphModule) and self.module.graph is graph:
            self.module.recompile()
