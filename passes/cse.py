"""cse: common subexpression elimination.

Two pure nodes that compute the same op on the same arguments are one value: the later
one is replaced by the earlier one. Ops in the table compare by their canonical name and
arguments, so every spelling of one call merges (``x + y``, ``torch.add(x, y)``,
``x.add(y)``, and ``y + x`` as add commutes). In-place, random and side-effecting ops
(``fxlite.ops.is_impure``) never merge, nor do calls of unknown Python functions and
unknown modules, which may keep state; no value computed before an impure node
(which may mutate its inputs, as ``x.add_(1)`` does) merges with one computed after it;
and no value that an impure node may write (``a = x.clone(); a.add_(1)``) merges at all.
"""

from __future__ import annotations

import math
from collections.abc import Container
from typing import Any

import torch

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import Node
from fxlite.ops import is_impure, resolve

__all__ = ["cse", "merge_duplicates"]

_CALLS = ("call_function", "call_method", "call_module")


def cse(gm: GraphModule) -> GraphModule:
    """Merge the duplicate pure computations of ``gm``.

    Args:
        gm: the module to rewrite in place.

    Returns:
        ``gm``, recompiled. If anything raises, ``gm`` is left as it was.

    Example::

        # before                                   # after
        def forward(self, x, y):                   def forward(self, x, y):
            add = x + y                                add = x + y
            add_1 = torch.add(x, y)                    mul = add * add
            mul = add * add_1                          return mul
            return mul
    """
    expect_graph_module(gm, "cse")
    merge_duplicates(gm.graph, gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def merge_duplicates(graph: Graph, gm: GraphModule | None = None,
                     keep: Container[Node] = ()) -> int:
    """``cse``'s work on a bare graph: merge each later duplicate into the first.

    Args:
        graph: the graph to rewrite in place (not linted or recompiled here).
        gm: the module that owns ``graph``, to resolve its ``call_module`` nodes (None for a
            graph of calls only, such as autodiff's joint graph).
        keep: nodes that must stay themselves (a caller holds them): they are never
            replaced, though later duplicates of them are.

    Returns:
        How many nodes were merged away.
    """
    # Plan first (nothing changes while keys are computed), then apply.
    rep: dict[Node, Node] = {}
    seen: dict[Any, Node] = {}
    for node in graph.nodes:
        key = None if _written(node, gm) else _key(node, gm, rep)
        if key is None:
            if node.op in _CALLS and is_impure(node, gm):
                seen.clear()  # it may mutate a value: nothing before it equals anything after
            continue
        first = seen.setdefault(key, node)
        if first is not node and node not in keep:
            rep[node] = first
    for node, first in rep.items():
        node.replace_all_uses_with(first)
    for node in reversed(list(rep)):
        graph.erase_node(node)
    return len(rep)


def _key(node: Node, gm: GraphModule | None, rep: dict[Node, Node]) -> Any:
    """What two nodes must share to be merged, or None if ``node`` must stay."""
    op = node.op
    if op == "get_attr":
        return (op, node.target)
    if op not in _CALLS or is_impure(node, gm):
        return None
    found = resolve(node, gm)
    if found is None:
        if op != "call_method" and not _is_torch_function(node.target, op):
            return None  # an unknown function or module may have state
        return (str(op), _hashable(node.target, rep), _hashable(node.args, rep),
                _hashable(node.kwargs, rep))
    info, args = found
    items = {k: _hashable(v, rep) for k, v in args.items()}
    if info.swapped == info.name and "alpha" not in items:
        # a commuting op: order its two operands by a stable key so x + y meets y + x
        a, b = info.params[0], info.params[1]
        if a in items and b in items and repr(items[b]) < repr(items[a]):
            items[a], items[b] = items[b], items[a]
    return ("op", info.name, tuple(sorted(items.items())))


# casts that return their input itself when nothing changes (``x.float()`` of a float32
# ``x``, ``x.to(y)`` with ``y`` of x's dtype and device)
_MAY_RETURN_INPUT = frozenset({"to", "to_other"})


def _written(node: Node, gm: GraphModule | None) -> bool:
    """Whether an impure op may write ``node``'s value: it reads it directly, through views
    (``a.view(-1).mul_(3)``) or through what may be ``node`` itself: a cast that changes
    nothing, or a method the table does not know (``a.to(b)[0] = 2``, ``a.cpu().add_(1)``
    on the CPU). Two equal values are one only while neither changes."""
    todo, seen = [node], {node}
    while todo:
        for user in todo.pop().users:
            if user.op in _CALLS and is_impure(user, gm):
                return True
            found = resolve(user, gm) if user.op in _CALLS else None
            aliasing = (user.op == "call_method" or user.target is getattr) if found is None \
                else found[0].kind == "view" or found[0].name in _MAY_RETURN_INPUT
            # (getattr: a field of a result, ``torch.min(x, 0).values``, is its tensor:
            # ``v = torch.min(x, 0).values; v[0] = 0`` wrote the other min's values too,
            # once the two mins merged: fuzz seed 8829871)
            if aliasing and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def _is_torch_function(target: Any, op: str) -> bool:
    if op != "call_function":
        return False
    module = getattr(target, "__module__", None) or ""
    return module.startswith("torch") or module in ("_operator", "math")


def _hashable(a: Any, rep: dict[Node, Node]) -> Any:
    """A hashable key for an argument; equal keys mean interchangeable arguments.

    Nodes stand for their representative; lists, dicts and slices become tagged tuples;
    literals keep their type (``1``, ``1.0`` and ``True`` differ to torch) and floats
    their sign (``-0.0``); anything unhashable (a tensor constant) is keyed by identity.
    """
    if isinstance(a, Node):
        return ("node", rep.get(a, a).name)
    if isinstance(a, tuple):
        return ("tuple", type(a).__name__, tuple(_hashable(x, rep) for x in a))
    if isinstance(a, list):
        return ("list", tuple(_hashable(x, rep) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple(sorted((repr(k), _hashable(v, rep)) for k, v in a.items())))
    if isinstance(a, slice):
        return ("slice", _hashable(a.start, rep), _hashable(a.stop, rep), _hashable(a.step, rep))
    if isinstance(a, float):
        return ("float", repr(a) if not math.isnan(a) else "nan")
    if isinstance(a, torch.Tensor):
        return ("id", id(a))
    try:
        hash(a)
    except TypeError:
        return ("id", id(a))
    return (type(a).__name__, a)
