"""functionalize: turn in-place writes into new values plus one write-back, so they fuse.

The capture records an in-place op (``x.add_(1)``, ``x += 1``, ``relu(x, inplace=True)``)
as a node that writes its first argument; later nodes read the written tensor through
that node. When nothing else shares the tensor's memory (the capture's
``meta["aliased"]`` is False), the write becomes a pure op that makes a new value, read by
every later use. If the written tensor is an input of the graph, whose new value the
caller must see, one ``copy_`` before the output writes the final value back, and the
graph returns the input itself where it returned the written tensor::

    # before                                   # after
    def forward(self, x, y):                   def forward(self, x, y):
        relu_ = torch.relu_(x)                     relu = torch.relu(x)
        mul = y * relu_                            mul = y * relu
        return (mul, relu_)                        copy_ = x.copy_(relu)
                                                   return (mul, copy_)

Writes through views, into memory another value shares, by ``out=`` arguments, by ops
without a pure spelling, into an input that requires grad, or (under grad mode) with a
result that does, stay as they are: they are impure nodes, which the fusion
partitioner never moves anything across. Needs the capture's ``meta["mutated"]``; nodes
without it (graphs from ``symbolic_trace``) are left alone.

In a graph that keeps such a node (or a random draw, or an effect), an input's
write-back goes right after the last node that writes it, not at the end: an op after
that which raises (an integer division by zero) must find eager's writes done, since
the call cannot run again::

    # before                                   # after, with x[:2].add_(1) kept first
    add_ = b.add_(1)                           add = b.add(1);  copy_ = b.copy_(add)
    floordiv = x // d                          floordiv = x // d
"""

from __future__ import annotations

from typing import Any

import torch

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import is_impure, view_base, view_root

__all__ = ["changes_state", "functionalize", "recorded_requires_grad"]

_DUNDERS = {"__iadd__": "add", "__isub__": "sub", "__imul__": "mul", "__itruediv__": "div",
            "__ifloordiv__": "floor_divide", "__imod__": "remainder", "__ipow__": "pow",
            "__iand__": "bitwise_and", "__ior__": "bitwise_or", "__ixor__": "bitwise_xor",
            "__ilshift__": "bitwise_left_shift", "__irshift__": "bitwise_right_shift"}
# Position of `inplace` in torch.nn.functional activations called positionally.
_INPLACE_AT = {"relu": 1, "relu6": 1, "elu": 2, "selu": 1, "celu": 2, "leaky_relu": 2,
               "hardtanh": 3, "threshold": 3, "silu": 1, "mish": 1, "hardswish": 1,
               "hardsigmoid": 1}


def functionalize(gm: GraphModule) -> GraphModule:
    """Make the graph's plain in-place writes functional (see the module docstring).

    Args:
        gm: a GraphModule whose nodes carry the capture's ``mutated``/``aliased`` meta.

    Returns:
        ``gm``, recompiled. A node that cannot be rewritten is left as it was.
    """
    graph = gm.graph
    final: dict[Node, Node] = {}  # input placeholder -> the last pure value written to it
    last: dict[Node, Node] = {}  # input placeholder -> the last node writing it, kept or pure
    root_of: dict[Node, Node] = {}
    by_name = {n.name: n for n in graph.nodes}
    changed = False
    for node in list(graph.nodes):
        plan = _pure_form(node)
        if plan is None:
            if node.meta.get("mutated") and node.args and isinstance(node.args[0], Node):
                # A write left as it is; through a view, a write of the view's base: the
                # base's write-back goes after it (fuzz seed 8612778: ``b += 1;
                # b.unsqueeze(-2).pow_(2)``, whose buffer was written back before the pow_)
                written = node.args[0]
                kept = _root(view_root(written, gm) if node.meta.get("aliased") else written,
                             root_of, by_name)
                if kept in final:  # (into a pure value written back: after it, then)
                    last[kept] = node
            continue
        target, args, kwargs = plan
        written = node.args[0]
        root = _root(written, root_of, by_name)
        if root.op == "placeholder" and (recorded_requires_grad(root) or (
                node.meta.get("grad_enabled") and recorded_requires_grad(node))):
            # (under no_grad too: the write-back goes before the output, where the
            # function may have turned gradients on again, and a leaf that requires grad
            # refuses an in-place write there)
            # An input autograd tracks, or a write into one whose result autograd tracks
            # (``b.div_(x)``, x requiring grad): the write-back would change, after the
            # fact, a value the pure ops saved for their backward (silu saves its input;
            # b / x saves b, and a fused group may save b to recompute ``b * 2`` for
            # ``b.mul_(2).div_(x)``). Eager's in-place op is written for autograd (it
            # saves what it needs), so it stays; into a pure value written back, the
            # write-back goes after it (an earlier segment's ``v``: ``v.mul_(2)`` pure,
            # ``v /= x`` kept, and ``v`` written back between them missed the division).
            if root in final:
                last[root] = node
            continue
        node.target, node.args, node.kwargs = target, args, kwargs
        node.meta["impure"] = False
        node.meta.pop("mutated", None)
        changed = True
        value = _keep_dtype(node, written)
        value.meta["in_place"] = True  # eager rounds it to the tensor's dtype: so do kernels
        by_name[value.name] = value
        root_of[value] = root
        if root.op == "placeholder":
            final[root] = last[root] = value
    if final:
        out = graph.output_node()
        # Where the graph keeps something impure (a write left as it is, a draw, an
        # effect), an input's write-back goes right after the last node that writes it,
        # as eager's last write: an op after it that raises (an integer remainder by
        # zero) then finds eager's writes done, the kept ones and these alike (fuzz seed
        # 8223430). Else each goes at the end, before which compile.py can run the
        # function again if the graph raises.
        early = any(changes_state(n, gm) for n in graph.nodes
                    if n.op not in ("placeholder", "output"))
        _count_in_place(graph, final, out)
        backs: dict[Node, Node] = {}
        for root, value in final.items():
            with graph.inserting_after(last[root]) if early else graph.inserting_before(out):
                back = graph.call_method("copy_", (root, value))
            back.meta.update(impure=True, mutated=[root.name], aliased=False,
                             stack_trace=value.meta.get("stack_trace"))
            if "tensor_meta" in root.meta:
                back.meta["tensor_meta"] = root.meta["tensor_meta"]
            out.args = (_swap(out.args[0], value, back),)
            backs[root] = back
        _returned_views(gm, out, {v: backs[r] for v, r in root_of.items() if r in backs},
                        by_name)
    if changed:
        gm.recompile()
    return gm


def _root(written: Node, root_of: dict[Node, Node], by_name: dict[str, Node]) -> Node:
    """The tensor a write into ``written`` writes: an input, where ``written`` is a pure
    value standing for it (``root_of``) or an in-place write left as it is into one
    (``b.copy_(v)`` returns the tensor it wrote, so a write to its result writes that
    tensor)."""
    root = root_of.get(written, written)
    seen = {root}
    while root.op != "placeholder" and root.meta.get("same_object") in by_name:
        older = by_name[root.meta["same_object"]]
        root = root_of.get(older, older)
        if root in seen:
            break
        seen.add(root)
    return root


def changes_state(node: Node, module: Any) -> bool:
    """Whether ``node`` is impure (``is_impure``) other than by what changes nothing: a
    read that ends a segment (``bool(t)``), a check (timm's ``torch._assert`` of a shape)."""
    return is_impure(node, module) and "read" not in node.meta \
        and "checks" not in node.meta and node.target is not torch._assert


def recorded_requires_grad(node: Node) -> bool:
    """Whether the capture saw ``node``'s value require grad."""
    return bool(node.meta.get("requires_grad")
                or getattr(node.meta.get("tensor_meta"), "requires_grad", False))


def _returned_views(gm: GraphModule, out: Node, back_of: dict[Node, Node],
                    by_name: dict[str, Node]) -> None:
    """A returned view of a written input's new value becomes the same view of the input
    after its write-back, as in eager, where it shares the input's memory: a later graph
    that writes through it (``v = b.view(6)`` returned, then ``v.mul_(2)`` past a graph
    break) writes the input::

        view = add.view((6,))                       copy_ = b.copy_(add)
        return (view,)                      ->      view_1 = copy_.view((6,))
                                                    return (view_1,)

    So does a returned in-place write left as it is into that value (``b.add_(s)``, then
    ``b.copy_(x)``: the copy writes the new value and returns it), which is the input
    itself in eager.
    """
    def rebased(n: Any) -> Any:
        chain, same, seen = [], False, set()
        while isinstance(n, Node) and n not in back_of:
            wrote = by_name.get(n.meta.get("same_object"))
            if wrote is not None and wrote is not n and wrote not in seen:
                seen.add(n)
                n, same = wrote, True  # an in-place op's result is the tensor it wrote
                continue
            # a view's chain only: ``b[[0, -1]]`` copies (fuzz seed 13122601, whose
            # ``v = b[[0, -1]]; v.mul_(3)`` came back as the index of b without the mul)
            base = view_base(n, gm)
            if base is None or not n.args or base is not n.args[0]:  # (rebuilt through args[0])
                return None
            chain.append(n)
            n = base
        if not (chain or same) or not isinstance(n, Node):
            return None
        base = back_of[n]
        for view in reversed(chain):
            with gm.graph.inserting_before(out):
                base = gm.graph.node_copy(view, lambda a, v=view, b=base: b if a is v.args[0] else a)
        return base

    def swap(a: Any) -> Any:
        if isinstance(a, (tuple, list)):
            return type(a)(swap(x) for x in a)
        if isinstance(a, dict):
            return {k: swap(x) for k, x in a.items()}
        new = rebased(a) if isinstance(a, Node) else None
        return a if new is None else new

    out.args = (swap(out.args[0]),)


def _count_in_place(graph: Any, final: dict[Node, Node], out: Node) -> None:
    """Write counters back with one multi-tensor add instead of a kernel and a copy each.

    A training BatchNorm's ``num_batches_tracked.add_(1)`` is read by nothing else: its
    pure form and write-back were two launches per BatchNorm (resnet18: 40 a step). Every
    input whose only use is ``x + c`` (``c`` a Python number), a value nothing reads and
    the graph does not return, is dropped from ``final`` and incremented in place by one
    ``torch._foreach_add_`` per ``c`` at the end of the graph::

        add = torch.add(a, 1); add_1 = torch.add(b, 1)   ->   torch._foreach_add_([a, b], 1)
        a.copy_(add); b.copy_(add_1)
    """
    returned = set(out.all_input_nodes)
    groups: dict[tuple[type, Any], list[Node]] = {}
    for root, value in list(final.items()):
        if value.op == "call_function" and value.target is torch.add or \
                value.op == "call_method" and value.target == "add":
            args = value.args
            c = args[1] if len(args) == 2 and not value.kwargs else None
            if args[0] is root and type(c) in (int, float) and not value.users and \
                    value not in returned and list(root.users) == [value]:
                groups.setdefault((type(c), c), []).append(root)
    for (_, c), roots in groups.items():
        if len(roots) < 2:
            continue
        for root in roots:
            graph.erase_node(final.pop(root))
        with graph.inserting_before(out):
            step = graph.call_function(torch._foreach_add_, (roots, c))
        step.meta.update(impure=True, mutated=[r.name for r in roots], aliased=False,
                         type=type(None))


def _keep_dtype(node: Node, written: Node) -> Node:
    """An in-place op keeps the written tensor's dtype; its pure form may promote
    (``half.mul_(float)`` is half, ``half * float`` is float): cast back where it could."""
    meta = written.meta.get("tensor_meta")
    dtype = getattr(meta, "dtype", None)
    if dtype is None:
        return node
    others = [a for a in (*node.args[1:], *node.kwargs.values())]
    promotes = any(getattr(a.meta.get("tensor_meta"), "dtype", dtype) != dtype
                   for a in others if isinstance(a, Node)) or (
        not dtype.is_floating_point and any(isinstance(a, float) for a in others))
    if not promotes:
        return node
    graph = node.graph
    with graph.inserting_after(node):
        cast = graph.call_method("to", (node, dtype))
    cast.meta.update({k: v for k, v in node.meta.items() if k != "mutated"})
    for user in list(node.users):
        if user is cast:
            continue
        # The cast stands for the written tensor, in the names its readers recorded too:
        # a later in-place write into it (``x.mul_(long_mask); x /= 2``) writes the cast's
        # value, so it too has a pure form (fuzz seed 8553095, whose kept ``div_`` made
        # the graph return a new tensor where eager returns ``x``).
        for key in ("mutated", "same_object"):
            names = user.meta.get(key)
            if names == node.name:
                user.meta[key] = cast.name
            elif isinstance(names, list) and node.name in names:
                user.meta[key] = [cast.name if m == node.name else m for m in names]
    node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
    return cast


def _swap(a: Any, old: Node, new: Node) -> Any:
    if a is old:
        return new
    if isinstance(a, tuple):
        return tuple(_swap(x, old, new) for x in a)
    if isinstance(a, list):
        return [_swap(x, old, new) for x in a]
    return a


def _pure_form(node: Node) -> tuple[Any, tuple, dict] | None:
    """``(target, args, kwargs)`` of the pure op computing what ``node`` writes, or None."""
    mutated = node.meta.get("mutated")
    if not mutated or node.meta.get("aliased", True) or not node.args:
        return None
    first = node.args[0]
    if not isinstance(first, Node) or mutated != [first.name] or "out" in node.kwargs:
        return None
    if node.op == "call_method":
        name = _DUNDERS.get(node.target) or (
            node.target[:-1] if node.target.endswith("_") and not node.target.startswith("_")
            else None)
        if name is None or not callable(getattr(torch.Tensor, name, None)):
            return None
        if name in ("copy", "set", "resize", "fill", "zero", "random", "uniform", "normal",
                    "requires_grad", "share_memory", "detach", "resize_as"):
            return None  # no pure op of that name computes the same value
        return name, node.args, node.kwargs
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if node.kwargs.get("inplace") is True:
            return node.target, node.args, {**node.kwargs, "inplace": False}
        at = _INPLACE_AT.get(name)
        if at is not None and len(node.args) > at and node.args[at] is True and \
                getattr(torch.nn.functional, name, None) is node.target:
            args = list(node.args)
            args[at] = False
            return node.target, tuple(args), node.kwargs
    return None
