"""Subgraph matching in linear time: find every copy of a pattern graph inside a graph.

The matcher anchors on the pattern's output node(s). One pass over the target graph
numbers its nodes and collects the nodes that compute the anchor's op (its *op key*:
the canonical op name from :mod:`fxlite.ops` when spellings are on, else ``(op, target)``).
From each candidate it walks the pattern's edges backwards, which fixes every ancestor of
the anchor without any choice; pattern nodes that are not ancestors of the first anchor
(a second output, say) are reached forwards through the users of nodes already matched,
with backtracking. So a match costs O(pattern size) and a search O(n * pattern size),
where ``torch.fx``'s matcher grows quadratically.

A candidate is accepted when, besides matching node for node:

- no matched node other than a returned one is used outside the match;
- it shares no node (other than pattern inputs) with an earlier match, when overlapping
  matches are removed: graph order decides, the first match wins;
- replacing it cannot create a cycle: every input is computed before every outside user
  of its results;
- every match filter accepts it.

``SubgraphMatcher.explain`` runs the same search but records, for each candidate, how
far it got and the first pattern node or argument that failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .graph import Graph
from .node import Node, collect_nodes, format_target
from .ops import OPS, canonical_args, is_impure, lookup, same_literal

__all__ = ["UNBOUND", "InternalMatch", "NearMiss", "Search", "SubgraphMatcher", "fetch_attr", "flatten"]

_CALLS = ("call_function", "call_method", "call_module")


@dataclass
class InternalMatch:
    """One match of a pattern in a graph (the record match filters receive).

    Attributes:
        anchors: the graph nodes matched to the pattern's anchors (its output nodes).
        nodes_map: pattern node -> graph node (or constant, for a pattern input that
            matched a literal argument), in pattern order.
        placeholder_nodes: what each pattern input matched, in order.
        returning_nodes: the graph nodes matched to the pattern's returned values.
        name_node_map: pattern node name -> graph node.
    """

    anchors: list[Node]
    nodes_map: dict[Node, Any] = field(default_factory=dict)
    placeholder_nodes: list[Any] = field(default_factory=list)
    returning_nodes: list[Node] = field(default_factory=list)
    name_node_map: dict[str, Any] = field(default_factory=dict)

    def __copy__(self) -> InternalMatch:
        return InternalMatch(list(self.anchors), dict(self.nodes_map), list(self.placeholder_nodes),
                             list(self.returning_nodes), dict(self.name_node_map))


@dataclass
class NearMiss:
    """Why one candidate anchor did not become a match (see ``SubgraphMatcher.explain``).

    Attributes:
        anchor: the graph node tried as the pattern's anchor.
        matched: how many pattern nodes (inputs included) matched before the failure.
        total: how many pattern nodes there are.
        pattern_node: the pattern node at which matching failed.
        graph_node: the graph value it was compared with.
        where: which argument failed (``"argument 1"``, ``"argument 'dim'"``), or ``""``.
        reason: what was wrong, in words.
    """

    anchor: Node
    matched: int
    total: int
    pattern_node: Node | None
    graph_node: Any
    where: str
    reason: str

    def __str__(self) -> str:
        at = f"pattern node {_describe(self.pattern_node)}" if self.pattern_node is not None else "the match"
        if self.where:
            at += f", {self.where}"
        return (f"candidate %{self.anchor.name} (matched {self.matched} of {self.total} pattern "
                f"nodes): at {at}: {self.reason}")


def _describe(node: Any) -> str:
    if not isinstance(node, Node):
        return repr(node)
    if node.op in ("placeholder", "output"):
        return f"%{node.name} ({node.op})"
    return f"%{node.name} ({node.op} {format_target(node.target)})"


def _where(w: Any) -> str:
    if isinstance(w, tuple):
        return f"{_where(w[0])}[{w[1]}]"
    if isinstance(w, int):
        return f"argument {w}"
    if isinstance(w, str) and w.startswith("#"):
        return f"argument {w[1:]}"
    return f"argument {w!r}" if w is not None else ""


def op_key(node: Node, module: torch.nn.Module | None, spellings: bool) -> Any:
    """What must be equal for two nodes to compute the same op.

    With ``spellings``, the canonical name of the op from the table (``"add"`` for
    ``operator.add``, ``torch.add`` and ``x.add``); otherwise ``(op, target)``. A leaf
    module counts as its function spelling only if the table says how to restate its
    configuration as arguments (``nn.ReLU`` yes, ``nn.Linear`` no: it owns its weight).

    Example::

        op_key(node, gm, True)    # "relu" for torch.relu, F.relu, x.relu() and nn.ReLU()
        op_key(node, gm, False)   # ("call_function", torch.relu)
    """
    op = node.op
    if op in _CALLS:
        if spellings:
            info = lookup(node, module)
            if info is not None and (op != "call_module" or info.module_kwargs is not None):
                return info.name
        target = node.target
        try:
            hash(target)
        except TypeError:
            target = id(target)
        return (str(op), target)
    return (str(op),)


class SubgraphMatcher:
    """Finds the copies of ``pattern`` in a graph; mirrors torch.fx's ``SubgraphMatcher``.

    Args:
        pattern: the pattern graph. Its inputs match any value; its other nodes must
            match node for node, arguments included.
        match_output: the pattern's output must match the graph's output.
        match_placeholder: the pattern's inputs must match the graph's inputs.
        remove_overlapping_matches: keep only matches that share no computed node with an
            earlier one (graph order; the first wins).
        ignore_literals: constant arguments in the pattern match any constant.
        match_spellings: equivalent spellings of an op match (``x + y`` and ``torch.add``);
            False asks for equal targets, as torch.fx does.
        pattern_module: the module that owns the pattern's ``call_module`` targets
            (defaults to ``pattern.owning_module``).

    Raises:
        ValueError: the pattern has dead code, an unused input, no operation, returns an
            input unchanged, or falls apart into unconnected pieces.

    Example::

        matcher = SubgraphMatcher(fxlite.symbolic_trace(lambda x: torch.relu(x + 1)).graph)
        for m in matcher.match(gm.graph):
            print(m.anchors[0], m.placeholder_nodes)
    """

    def __init__(self, pattern: Graph, match_output: bool = False, match_placeholder: bool = False,
                 remove_overlapping_matches: bool = True, ignore_literals: bool = False, *,
                 match_spellings: bool = True, pattern_module: torch.nn.Module | None = None) -> None:
        if not isinstance(pattern, Graph):
            raise TypeError(f"SubgraphMatcher: pattern must be a Graph (a traced pattern's "
                            f".graph), not {type(pattern).__name__}")
        self.pattern = pattern
        self.match_output = match_output
        self.match_placeholder = match_placeholder
        self.remove_overlapping_matches = remove_overlapping_matches
        self.ignore_literals = ignore_literals
        self.match_spellings = match_spellings
        self.pattern_module = pattern_module if pattern_module is not None else pattern.owning_module
        self._analyse()

    # ------------------------------------------------------------------ the pattern
    def _analyse(self) -> None:
        self.pattern_nodes = nodes = list(self.pattern.nodes)
        outputs = [n for n in nodes if n.op == "output"]
        if len(outputs) != 1:
            raise ValueError(f"pattern must have exactly one output node, found {len(outputs)}")
        self.output = out = outputs[0]
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.op_nodes = [n for n in nodes if n.op not in ("placeholder", "output")]
        leaves: list[Any] = []
        flatten(out.args[0] if out.args else None, leaves)
        for leaf in leaves:
            if not isinstance(leaf, Node):
                raise ValueError(f"pattern returns the constant {leaf!r}; it must return computed nodes")
            if leaf.op == "placeholder":
                raise ValueError(f"pattern returns its input %{leaf.name} unchanged; "
                                 "a pattern must return values it computes")
        if len(set(leaves)) != len(leaves) or not leaves:
            raise ValueError("pattern must return one or more distinct nodes")
        self.returning: list[Node] = leaves
        if not self.op_nodes:
            raise ValueError("pattern has no operation to match")
        live: set[Node] = set()
        stack = list(leaves)
        while stack:
            n = stack.pop()
            if n not in live:
                live.add(n)
                stack.extend(n.all_input_nodes)
        for n in self.op_nodes:
            if n not in live and not is_impure(n, self.pattern_module):
                raise ValueError(f"pattern has dead code: {_describe(n)} does not contribute to the "
                                 "output; remove it (a graph would need the same unused node to match)")
        for p in self.placeholders:
            if not p.users:
                raise ValueError(f"pattern input %{p.name} is unused; every input must feed the pattern")
        # Anchor on the first returned node that no other pattern node reads: walking back
        # from it fixes the most nodes without choices.
        sinks = [r for r in leaves if not any(u.op != "output" for u in r.users)] or leaves
        self.anchors = [out] if self.match_output else sinks
        self.internal = [n for n in self.op_nodes if n not in set(leaves)]
        self._plan_search(nodes)
        mod = self.pattern_module
        self._pkey = {n: op_key(n, mod, self.match_spellings) for n in self.op_nodes}
        # A call_module node whose module the pattern does not own (a bare Graph) cannot
        # say which op it computes: it matches a graph call_module node of the same
        # target, as in torch.fx, whatever op that module computes.
        self._by_target = {n for n in self.op_nodes
                           if n.op == "call_module" and fetch_attr(mod, n.target) is UNBOUND}
        self._pkey[out] = op_key(out, mod, False)
        self._pargs = {n: self._call_args(n, self._pkey[n], mod) for n in (*self.op_nodes, out)}

    def _plan_search(self, nodes: list[Node]) -> None:
        """Order the forward steps: pattern nodes not behind the first anchor, each read
        from a node matched before it."""
        bound: set[Node] = set()

        def close(n: Node) -> None:
            stack = [n]
            while stack:
                m = stack.pop()
                if m not in bound:
                    bound.add(m)
                    stack.extend(m.all_input_nodes)

        close(self.anchors[0])
        self.plan: list[tuple[Node, Node]] = []
        rest = [n for n in nodes if n.op != "output" or self.match_output]
        while len(bound) < len(rest):
            step = next(((n, src) for n in rest if n not in bound
                         for src in n.all_input_nodes if src in bound), None)
            if step is None:
                loose = [n.name for n in rest if n not in bound]
                raise ValueError(f"pattern is not connected: {', '.join(loose)} share no node or "
                                 f"input with %{self.anchors[0].name}; split it into separate patterns")
            self.plan.append(step)
            close(step[0])

    def _call_args(self, node: Node, key: Any, module: torch.nn.Module | None) -> tuple[tuple, dict]:
        if isinstance(key, str):  # a known op with spellings on: compare by parameter name
            return (), canonical_args(node, OPS[key], module)
        return node.args, node.kwargs

    # ------------------------------------------------------------------ public API
    def match(self, graph: Graph, module: torch.nn.Module | None = None) -> list[InternalMatch]:
        """All matches of the pattern in ``graph``, in graph order of their anchors.

        Args:
            graph: the graph to search.
            module: the module owning ``graph``'s ``call_module`` targets (defaults to
                ``graph.owning_module``).

        Returns:
            One :class:`InternalMatch` per match.

        Example::

            matches = SubgraphMatcher(pattern_graph).match(gm.graph)
        """
        return Search(self, graph, module).run()

    def explain(self, graph: Graph, module: torch.nn.Module | None = None,
                accept: Callable[[InternalMatch], bool] | None = None) -> tuple[list[InternalMatch], list[NearMiss]]:
        """The matches, and for every other candidate anchor, where and why it failed.

        Candidates are all operation nodes; those computing another op than the pattern's
        anchor are still followed, so a near miss on the anchor's op is found. Near misses
        come closest first (most pattern nodes matched), then in graph order.

        Example::

            matches, misses = SubgraphMatcher(pattern_graph).explain(gm.graph)
            print(misses[0])   # candidate %relu_2 (matched 2 of 3 ...): at ... argument 1: ...
        """
        search = Search(self, graph, module, accept=accept, explain=True)
        matches = search.run()
        misses = sorted(search.misses, key=lambda m: (-m.matched, search.pos[m.anchor]))
        return matches, misses


def flatten(a: Any, out: list[Any]) -> None:
    """Append the leaves of ``a`` (nested tuples and lists) to ``out``, in order."""
    if isinstance(a, (tuple, list)):
        for x in a:
            flatten(x, out)
    else:
        out.append(a)


class Search:
    """The state of one search of one graph (bindings, the undo trail, overlap set).

    ``SubgraphMatcher.match`` runs one to the end; ``fxlite.rewrite`` drives one itself,
    replacing each match as it is found.
    """

    def __init__(self, m: SubgraphMatcher, graph: Graph, module: torch.nn.Module | None,
                 accept: Callable[[InternalMatch], bool] | None = None, explain: bool = False) -> None:
        self.m = m
        self.graph = graph
        self.module = module if module is not None else graph.owning_module
        self.accept = accept
        self.explaining = explain
        self.p2g: dict[Node, Any] = {}
        self.g2p: dict[Node, Node] = {}
        self.trail: list[Node] = []
        self.taken: set[Node] = set()
        self.keys: dict[Node, Any] = {}
        self.pos: dict[Node, float] = {}
        self.misses: list[NearMiss] = []
        self._first: tuple | None = None  # first failure of the current candidate
        self._relaxed: Node | None = None  # explain mode: anchor whose op may differ

    def key(self, n: Node) -> Any:
        k = self.keys.get(n)
        if k is None:
            k = self.keys[n] = op_key(n, self.module, self.m.match_spellings)
        return k

    def key_for(self, n: Node, pn: Node) -> Any:
        """``n``'s op key as pattern node ``pn`` compares it (by target, see _by_target)."""
        if pn in self.m._by_target and n.op == "call_module":
            return op_key(n, None, False)
        return self.key(n)

    def run(self) -> list[InternalMatch]:
        m, pos = self.m, self.pos
        anchor = m.anchors[0]
        akey = m._pkey[anchor]
        candidates = []
        spellings, module = m.match_spellings, self.module
        for i, n in enumerate(self.graph.nodes):  # the single O(n) pass
            pos[n] = float(i)
            op = n.op
            if op in _CALLS or op == "get_attr":
                k = self.keys[n] = op_key(n, module, spellings)
                if k == akey or (self.explaining and op in _CALLS) or (
                        op == "call_module" and self.key_for(n, anchor) == akey):
                    candidates.append(n)
            elif op == "output" and anchor.op == "output":
                candidates.append(n)
        found = []
        for gn in candidates:
            if gn in self.taken:
                if self.explaining:
                    self._first = (False, m.anchors[0], gn, None, f"graph node %{gn.name} belongs to an "
                                   "earlier match (overlapping matches are removed)")
                    self._record(gn, 0)
                continue
            self._first = None
            self._relaxed = gn if self.explaining and self.key_for(gn, anchor) != akey else None
            depth = [0]
            ok = self._unify(anchor, gn) and self._extend(0, depth)
            if ok and self._relaxed is None:
                found.append(self._result)
            elif self.explaining:
                self._record(gn, max(depth[0], len(self.trail)))
            self._undo(0)
        return found

    # ------------------------------------------------------------------ failures
    def _note(self, pn: Any, ga: Any, where: Any, reason: str, rule: bool = False) -> bool:
        # `rule`: the nodes all matched but a rule of _check failed; otherwise `pn` failed.
        if self._first is None:
            self._first = (rule, pn, ga, where, reason)
        return False

    def _record(self, anchor: Node, reached: int) -> None:
        if self._first is None:
            return
        rule, pn, ga, where, reason = self._first
        total = len(self.m.placeholders) + len(self.m.op_nodes)
        matched = min(reached, total) - (0 if rule or pn is None else 1)
        self.misses.append(NearMiss(anchor, max(matched, 0), total, pn, ga, _where(where), reason))

    # ------------------------------------------------------------------ binding
    def _undo(self, mark: int) -> None:
        trail, p2g, g2p = self.trail, self.p2g, self.g2p
        while len(trail) > mark:
            gv = p2g.pop(trail.pop())
            if isinstance(gv, Node):
                g2p.pop(gv, None)

    def _unify(self, pn0: Node, gn0: Any) -> bool:
        """Match ``pn0`` to ``gn0`` and, walking arguments, all of ``pn0``'s ancestors."""
        stack: list[tuple[Any, Any, Any, Any]] = [(pn0, gn0, None, None)]
        note = self._note
        while stack:
            pa, ga, owner, where = stack.pop()
            if isinstance(pa, Node):
                if not self._bind(pa, ga, owner, where, stack):
                    return False
            elif isinstance(pa, (tuple, list)):
                if not isinstance(ga, (tuple, list)):
                    return self.explaining and note(owner, ga, where, f"the pattern has a "
                                                    f"{type(pa).__name__}, the graph has {_describe(ga)}")
                if len(pa) != len(ga):
                    return self.explaining and note(owner, ga, where, f"the pattern has {len(pa)} "
                                                    f"items, the graph has {len(ga)}")
                for i in range(len(pa) - 1, -1, -1):
                    stack.append((pa[i], ga[i], owner, (where, i)))
            elif isinstance(pa, dict):
                if not isinstance(ga, dict) or pa.keys() != ga.keys():
                    return self.explaining and note(owner, ga, where, "the dicts differ in their keys")
                for k in reversed(list(pa)):
                    stack.append((pa[k], ga[k], owner, (where, k)))
            elif isinstance(pa, slice):
                if not isinstance(ga, slice):
                    return self.explaining and note(owner, ga, where, f"the graph has {ga!r}, not a slice")
                stack.extend(((pa.step, ga.step, owner, where), (pa.stop, ga.stop, owner, where),
                              (pa.start, ga.start, owner, where)))
            elif isinstance(ga, Node):
                return self.explaining and note(owner, ga, where, f"the pattern has the constant "
                                                f"{pa!r}, the graph has node %{ga.name}")
            elif not self.m.ignore_literals and not same_literal(pa, ga):
                if isinstance(ga, (tuple, list, dict, slice)):
                    return self.explaining and note(owner, ga, where, f"the pattern has {pa!r}, the graph has {ga!r}")
                return self.explaining and note(owner, ga, where, f"the constant differs: the pattern "
                                                f"has {pa!r}, the graph has {ga!r}")
        return True

    def _bind(self, pn: Node, ga: Any, owner: Any, where: Any, stack: list) -> bool:
        p2g, g2p, m = self.p2g, self.g2p, self.m
        bound = p2g.get(pn, UNBOUND)
        if bound is not UNBOUND:
            if bound is ga or (not isinstance(bound, Node) and not isinstance(ga, Node)
                               and same_literal(bound, ga)):
                return True
            return self.explaining and self._note(pn, ga, where, f"%{pn.name} already matched "
                                                  f"{_describe(bound)} elsewhere, here it meets {_describe(ga)}")
        if pn.op == "placeholder":
            if isinstance(ga, Node):
                if ga in g2p:
                    return self.explaining and self._note(pn, ga, where, f"graph node %{ga.name} is "
                                                          f"already matched to pattern node %{g2p[ga].name}")
                if m.match_placeholder and ga.op != "placeholder":
                    return self.explaining and self._note(pn, ga, where, f"graph node %{ga.name} is not "
                                                          "a graph input (match_placeholder=True)")
                g2p[ga] = pn
            elif m.match_placeholder:
                return self.explaining and self._note(pn, ga, where, f"the graph has the constant {ga!r}, "
                                                      "not a graph input (match_placeholder=True)")
            p2g[pn] = ga
            self.trail.append(pn)
            return True
        if not isinstance(ga, Node):
            return self.explaining and self._note(pn, ga, where, f"the graph has the constant {ga!r} "
                                                  "where the pattern computes a value")
        if ga in g2p:
            return self.explaining and self._note(pn, ga, where, f"graph node %{ga.name} is already "
                                                  f"matched to pattern node %{g2p[ga].name}")
        if ga in self.taken:
            return self.explaining and self._note(pn, ga, where, f"graph node %{ga.name} belongs to an "
                                                  "earlier match (overlapping matches are removed)")
        pkey = m._pkey[pn]
        gkey = self.key_for(ga, pn)
        if gkey != pkey:
            if self._relaxed is not ga or pn is not m.anchors[0]:
                return self.explaining and self._note(pn, ga, where, _op_differs(pn, ga, pkey, gkey))
            self._note(pn, ga, where, _op_differs(pn, ga, pkey, gkey))
        elif pn.op == "get_attr" and not self._same_attr(pn, ga):
            return self.explaining and self._note(pn, ga, where, f"attribute {ga.target!r} has another "
                                                  "type, shape or dtype than the pattern's")
        pargs, pkw = m._pargs[pn]
        gargs, gkw = m._call_args(ga, gkey, self.module)
        if len(pargs) != len(gargs):
            return self.explaining and self._note(pn, ga, where, f"the pattern passes {len(pargs)} "
                                                  f"positional arguments, the graph {len(gargs)}")
        if pkw.keys() != gkw.keys():
            if not self.explaining:
                return False
            extra = [k for k in gkw if k not in pkw]
            missing = [k for k in pkw if k not in gkw]
            what = "; ".join(s for s in (extra and f"the graph also passes {', '.join(map(repr, extra))}",
                                         missing and f"the graph lacks {', '.join(map(repr, missing))}") if s)
            return self._note(pn, ga, where, f"the arguments differ: {what}")
        p2g[pn] = ga
        g2p[ga] = pn
        self.trail.append(pn)
        for k in reversed(list(pkw)):
            stack.append((pkw[k], gkw[k], pn, k))
        for i in range(len(pargs) - 1, -1, -1):
            stack.append((pargs[i], gargs[i], pn, i))
        return True

    def _same_attr(self, pn: Node, gn: Node) -> bool:
        pv, gv = fetch_attr(self.m.pattern_module, pn.target), fetch_attr(self.module, gn.target)
        if pv is UNBOUND or gv is UNBOUND:
            return True
        if type(pv) is not type(gv):
            return False
        if isinstance(pv, torch.Tensor):
            return pv.shape == gv.shape and pv.dtype == gv.dtype
        return True

    # ------------------------------------------------------------------ forward steps
    def _extend(self, step: int, depth: list[int]) -> bool:
        """Match the pattern nodes behind no anchor, through users of matched nodes."""
        depth[0] = max(depth[0], len(self.trail))
        plan = self.m.plan
        if step == len(plan):
            return self._check()
        pu, src = plan[step]
        gsrc = self.p2g.get(src)
        if not isinstance(gsrc, Node):
            return self.explaining and self._note(pu, gsrc, None, "no graph node to search users of")
        want = self.m._pkey[pu]
        mark = len(self.trail)
        for cand in list(gsrc.users):
            if cand in self.g2p or self.key_for(cand, pu) != want:
                continue
            if self._unify(pu, cand) and self._extend(step + 1, depth):
                return True
            depth[0] = max(depth[0], len(self.trail))
            self._undo(mark)
        return self.explaining and self._note(pu, gsrc, None, f"no user of %{gsrc.name} matches "
                                              f"{_describe(pu)}")

    def _check(self) -> bool:
        """The rules a complete match must meet besides node-for-node equality."""
        p2g, g2p, m = self.p2g, self.g2p, self.m
        # A node bound to a pattern input is outside the match: it only feeds it.
        outside = lambda u: u not in g2p or g2p[u].op == "placeholder"
        for pn in m.internal:
            gn = p2g[pn]
            for u in gn.users:
                if outside(u):
                    return self.explaining and self._note(pn, gn, None, f"its value %{gn.name} is also "
                                                          f"used by %{u.name}, outside the match", True)
        if not m.match_output:
            pos = self.pos
            inputs: dict[Node, None] = {}
            for p in m.placeholders:
                collect_nodes(p2g[p], inputs)
            last_input = max((pos[n] for n in inputs), default=-1.0)
            for r in m.returning:
                for u in p2g[r].users:
                    if pos[u] <= last_input and outside(u):
                        return self.explaining and self._note(r, p2g[r], None, f"rewriting would create "
                                                              f"a cycle: %{u.name} uses the match's result "
                                                              "but comes before one of its inputs", True)
        if self._relaxed is not None:  # explain mode: the anchor's op differed
            return False
        result = InternalMatch([p2g[a] for a in m.anchors])
        nodes_map, names = result.nodes_map, result.name_node_map
        for n in m.pattern_nodes:
            if n in p2g:
                nodes_map[n] = names[n.name] = p2g[n]
        result.placeholder_nodes = [p2g[p] for p in m.placeholders]
        result.returning_nodes = [p2g[r] for r in m.returning]
        if self.accept is not None and not self.accept(result):
            return self.explaining and self._note(None, None, None, "a match filter rejected it", True)
        if m.remove_overlapping_matches:
            self.taken.update(gn for pn, gn in p2g.items() if pn.op != "placeholder")
        self._result = result
        return True


UNBOUND: Any = object()
"""What :func:`fetch_attr` returns for a path the module lacks."""


def fetch_attr(module: Any, target: str) -> Any:
    """The attribute at the dotted path ``target`` of ``module``, or :data:`UNBOUND`."""
    obj = module
    if obj is None:
        return UNBOUND
    for atom in target.split("."):
        obj = getattr(obj, atom, UNBOUND)
        if obj is UNBOUND:
            return UNBOUND
    return obj


def _op_differs(pn: Node, gn: Node, pkey: Any, gkey: Any) -> str:
    def name(node: Node, key: Any) -> str:
        return key if isinstance(key, str) else f"{node.op} {format_target(node.target)}"

    return f"the op differs: the pattern computes {name(pn, pkey)}, graph node %{gn.name} computes {name(gn, gkey)}"
