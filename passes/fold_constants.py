"""fold_constants: compute once what does not depend on the inputs.

A node is constant when everything it reads is a ``get_attr`` (a parameter, buffer or
constant tensor of the module), a literal, or another constant node, and it is pure
(``fxlite.ops.is_impure``: no random, in-place or side-effecting op). Each constant value
that a non-constant node reads is computed once, under ``torch.no_grad()``, and stored
on the module as a buffer ``_folded_0``, ``_folded_1``...; a single ``get_attr`` replaces
the subgraph. Constant Python numbers (``w.size(0)``) are inlined as literals.

Folded values are detached from the parameters they came from: fold for inference.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import Node, map_arg
from fxlite.ops import is_impure

from .shape_prop import extract_tensor_metadata

__all__ = ["fold_constants"]

_CALLS = ("call_function", "call_method", "call_module")
_LITERALS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)


def fold_constants(gm: GraphModule) -> GraphModule:
    """Replace each input-independent subgraph of ``gm`` by one ``get_attr`` of its value.

    Args:
        gm: the module to rewrite in place; new buffers are registered on it.

    Returns:
        ``gm``, recompiled. If anything raises, ``gm`` is left as it was.

    Example::

        # before                                   # after
        def forward(self, x):                      def forward(self, x):
            w = self.w                                 _folded_0 = self._folded_0
            t = w.t();  w = None                       mm = torch.mm(x, _folded_0)
            mul = t * 2;  t = None                     return mm
            mm = torch.mm(x, mul)
            return mm
    """
    graph = expect_graph_module(gm, "fold_constants").graph
    values = _constant_values(gm)
    # Each constant read by a non-constant node is materialized; the rest become dead.
    boundary = [n for n in values if n.op in _CALLS and any(u not in values for u in n.users)]
    if not boundary:
        return gm
    names = _fresh_names(gm, sum(isinstance(values[n], torch.Tensor) for n in boundary))
    registered: list[str] = []
    try:
        for node in boundary:
            value = values[node]
            if isinstance(value, torch.Tensor):
                name = next(names)
                gm.register_buffer(name, value)
                registered.append(name)
                with graph.inserting_before(node):
                    new = graph.get_attr(name)
                new.meta.update(node.meta)
                if "tensor_meta" in node.meta:
                    new.meta["tensor_meta"] = extract_tensor_metadata(value)
                node.replace_all_uses_with(new)
            else:
                for user in list(node.users):
                    user.args = map_arg(user.args, lambda n, node=node, v=value: v if n is node else n)
                    user.kwargs = map_arg(user.kwargs, lambda n, node=node, v=value: v if n is node else n)
        read = {n for n in values if n.op == "get_attr" and n.users}
        for node in reversed(list(values)):  # the folded nodes, and attributes only they read
            if not node.users and (node.op in _CALLS or node in read):
                graph.erase_node(node)
        graph.lint()
    except Exception:
        for name in registered:  # the graph work is the only thing that can fail here
            delattr(gm, name)
        raise
    gm.recompile()
    return gm


def _constant_values(gm: GraphModule) -> dict[Node, Any]:
    """The constant nodes and their values (tensors and literals only), in graph order."""
    values: dict[Node, Any] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                values[node] = _fetch(gm, node.target)
                continue
            if node.op not in _CALLS or is_impure(node, gm):
                continue
            if any(n not in values for n in node.all_input_nodes):
                continue
            if node.op == "call_module" and _fetch(gm, node.target).training:
                continue  # a training-mode module (BatchNorm) may change from call to call
            args = map_arg(node.args, values.__getitem__)
            kwargs = map_arg(node.kwargs, values.__getitem__)
            value = _run(gm, node, args, kwargs)
            if isinstance(value, torch.Tensor) or _is_literal(value):
                values[node] = value
    return values


def _run(gm: GraphModule, node: Node, args: tuple, kwargs: dict) -> Any:
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)
    return _fetch(gm, node.target)(*args, **kwargs)


def _is_literal(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_literal(v) for v in value)
    return isinstance(value, _LITERALS)


def _fetch(module: Any, target: str) -> Any:
    obj = module
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _fresh_names(gm: GraphModule, count: int) -> Any:
    taken = set(dir(gm))
    free = (f"_folded_{i}" for i in itertools.count() if f"_folded_{i}" not in taken)
    return itertools.islice(free, count)
