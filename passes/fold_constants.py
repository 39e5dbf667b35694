"""fold_constants: compute once what does not depend on the inputs.

A node is constant when everything it reads is a ``get_attr`` (a parameter, buffer or
constant tensor of the module), a literal, or another constant node, and it is pure
(``fxlite.ops.is_impure``: no random, in-place or side-effecting op). Each constant value
that a non-constant node reads is computed once, under ``torch.no_grad()``, and stored
on the module as a buffer ``_folded_0``, ``_folded_1``...; a single ``get_attr`` replaces
the subgraph. Constant Python numbers (``w.size(0)``) are inlined as literals.

Two more kinds of node count as constant:
- ``x.new_zeros(size)`` and its siblings read only ``x``'s dtype and device (from its
  value, or its ``tensor_meta`` and ``device`` meta), so they are constant when their
  other arguments are;
- a write (``t[i] = v``, ``t.fill_(v)``, ``t.add_(v)``...) into a constant tensor, with
  constant arguments, is done once, in order, into the folded value: Swin's attention
  mask is a ``new_zeros`` and nine slice writes, made again in every call. A write into
  memory that a non-constant node reads first, or writes, or may take a view of, or
  that the graph returns, is not: that tensor, and every write into it, stays in the
  graph.

With ``attributes=False`` (what ``fxlite.compile`` uses) a ``get_attr`` is not constant,
since a compiled module's weights may change between calls: only what the graph builds
from literals and sizes folds (masks, position indices).

Folded values are detached from the parameters they came from: fold for inference.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch

from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import Node, map_arg
from fxlite.ops import is_impure, lookup

from .shape_prop import extract_tensor_metadata

__all__ = ["fold_constants"]

_CALLS = ("call_function", "call_method", "call_module")
_LITERALS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
# methods that read only their tensor's dtype and device
_FRESH = frozenset({"new_zeros", "new_ones", "new_full", "new_empty"})
# writes into their first argument, with no other effect
_WRITES = frozenset({operator.setitem, torch.Tensor.__setitem__})
_WRITE_METHODS = frozenset({"__setitem__", "fill_", "zero_", "copy_", "masked_fill_", "add_",
                            "sub_", "mul_", "div_", "clamp_", "index_fill_"})


def fold_constants(gm: GraphModule, *, attributes: bool = True,
                   max_bytes: int | None = None) -> GraphModule:
    """Replace each input-independent subgraph of ``gm`` by one ``get_attr`` of its value.

    Args:
        gm: the module to rewrite in place; new buffers are registered on it.
        attributes: whether ``get_attr`` values (parameters, buffers) count as constant.
        max_bytes: the largest folded tensor (its storage) kept as a buffer; larger ones
            are computed when the graph runs, as before (None: no limit).

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
    values = _constant_values(gm, attributes)
    if max_bytes is not None:
        values = _without_storages(values, {_storage(v) for v in values.values() if isinstance(
            v, torch.Tensor) and v.untyped_storage().nbytes() > max_bytes})
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
                for key in ("impure", "mutated", "aliased", "same_object"):  # (a write's)
                    new.meta.pop(key, None)
                # its metadata is its value's, even where the folded node had none (made
                # by an earlier rewrite): the passes after need it (fuzzer seed 7205737)
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


def _constant_values(gm: GraphModule, attributes: bool = True) -> dict[Node, Any]:
    """The constant nodes and their values (tensors and literals only), in graph order;
    a folded write's value is what it returns (None for ``t[i] = v``)."""
    values: dict[Node, Any] = {}
    read: set[int] = set()  # storages of constants that non-constant nodes read
    kept: set[int] = set()  # ...that they may write or take views of: computed at run time
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                if attributes:
                    values[node] = _fetch(gm, node.target)
                continue
            if node.op == "output":  # a caller may write what it gets: a fresh one each call
                kept.update(_storage(values[n]) for n in node.all_input_nodes
                            if n in values and isinstance(values[n], torch.Tensor))
            if node.op not in _CALLS:
                continue
            value = _value(gm, node, values, read, kept)
            if value is not _RUNTIME and (isinstance(value, torch.Tensor) or _is_literal(value)):
                values[node] = value
                continue
            inputs = [values[n] for n in node.all_input_nodes
                      if n in values and isinstance(values[n], torch.Tensor)]
            read.update(_storage(t) for t in inputs)
            if inputs and (_writes(node) or is_impure(node, gm, impure_random=False)
                           or _may_alias(node, gm)):
                kept.update(_storage(t) for t in inputs)
    values = _without_storages(values, kept)
    while True:  # a value read at run time before a folded write into it: not folded
        late = _written_after_read(gm, values)
        if not late:
            return values
        values = _without_storages(values, late)


def _written_after_read(gm: GraphModule, values: dict[Node, Any]) -> set[int]:
    """Storages of folded tensors that a node left to run time reads before a folded
    write into them: the folded value holds that write already. ``v1 = x.new_zeros(3) + 1;
    v2 = v1 @ v1; v1[-1] = 2.0; return v1.double(), v2``: the returned values run each
    call (a caller may write them), and the matmul read ``v1`` after its write (fuzz seed
    9400824, caught by the kernel check)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_write: dict[int, int] = {}
    for node in values:
        if _writes(node):
            storage = _storage(values[node.args[0]])
            last_write[storage] = max(last_write.get(storage, -1), order[node])
    late: set[int] = set()
    for node in gm.graph.nodes:
        if node in values or node.op not in (*_CALLS, "output"):
            continue
        for inp in node.all_input_nodes:
            value = values.get(inp)
            if isinstance(value, torch.Tensor) and last_write.get(_storage(value), -1) > order[node]:
                late.add(_storage(value))
    return late


_RUNTIME = object()  # _value: the node runs when the graph runs


def _value(gm: GraphModule, node: Node, values: dict[Node, Any], read: set[int],
           kept: set[int]) -> Any:
    """``node``'s value if it is constant (see the module docstring), else ``_RUNTIME``.
    ``read`` and ``kept``: storages non-constant nodes read so far, and those they may
    write (a value read from these is only known when the graph runs)."""
    fresh = node.op == "call_method" and node.target in _FRESH and bool(node.args) and \
        isinstance(node.args[0], Node)
    writes = _writes(node)
    if not writes and is_impure(node, gm):
        return _RUNTIME
    inputs = node.all_input_nodes[1:] if fresh else node.all_input_nodes
    if any(n not in values for n in inputs):
        return _RUNTIME
    if node.op == "call_module" and _fetch(gm, node.target).training:
        return _RUNTIME  # a training-mode module (BatchNorm) may change from call to call
    value_of = values.__getitem__
    if fresh and node.args[0] not in values:
        like = _like(node.args[0])
        if like is None:
            return _RUNTIME
        value_of = lambda n: like if n is node.args[0] else values[n]  # noqa: E731
    args, kwargs = map_arg(node.args, value_of), map_arg(node.kwargs, value_of)
    tensors = [values[n] for n in inputs if isinstance(values[n], torch.Tensor)]
    if any(_storage(t) in kept for t in tensors):
        return _RUNTIME
    if writes and (not isinstance(args[0], torch.Tensor) or _storage(args[0]) in read):
        return _RUNTIME  # read at run time before this write: it must stay in order
    return _run(gm, node, args, kwargs)


def _writes(node: Node) -> bool:
    """Whether ``node`` only writes its first argument (``t[i] = v``, ``t.fill_(v)``)."""
    if node.op == "call_function":
        return node.target in _WRITES
    return node.op == "call_method" and node.target in _WRITE_METHODS


def _may_alias(node: Node, gm: GraphModule) -> bool:
    """Whether ``node``'s value may share memory with an input: a view, or an op the table
    does not know."""
    info = lookup(node, gm) if node.op != "call_module" else None
    return info is None or info.kind == "view"


def _like(node: Node) -> torch.Tensor | None:
    """An empty tensor of ``node``'s dtype and device (from its meta), or None."""
    tm, device = node.meta.get("tensor_meta"), node.meta.get("device")
    if not hasattr(tm, "dtype") or device is None:
        return None
    return torch.empty(0, dtype=tm.dtype, device=device)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _without_storages(values: dict[Node, Any], storages: set[int]) -> dict[Node, Any]:
    """``values`` less the tensors in ``storages`` and the writes into them."""
    def kept(node: Node, value: Any) -> bool:
        if _writes(node):
            target = node.args[0]
            return target in values and _storage(values[target]) not in storages
        return not isinstance(value, torch.Tensor) or _storage(value) not in storages
    return {n: v for n, v in values.items() if kept(n, v)}


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
