"""read_through: fused groups read a copy's source through its strides, not the copy.

A ``contiguous()`` of a strided value that only fused groups read (through views that
add, drop or broadcast size-1 dims at most) is an eager copy kernel a call for nothing: a
group's kernel loads its inputs through their strides anyway, and a reduction group
stores its results in the layout of their metadata, whatever its inputs' layouts.
torchvision's Swin and MaxViT build their relative position bias that way in every block
(``table[index].view(49, 49, -1).permute(2, 0, 1).contiguous().unsqueeze(0)``), which the
softmax's kernel adds::

    # before                                   # after
    permute = torch.permute(view, (2, 0, 1))    permute = torch.permute(view, (2, 0, 1))
    contiguous = permute.contiguous()           unsqueeze = permute.unsqueeze(0)
    unsqueeze = contiguous.unsqueeze(0)         fused_0 = self.fused_0(bmm, unsqueeze)
    fused_0 = self.fused_0(bmm, unsqueeze)

A pointwise group's kernel lays its results out in its inputs' memory order, as eager's
TensorIterator does: it reads through the copy only where that order stays the same with
the source in the copy's place (another input decides it, as the scores do above; Swin's
shifted windows add the bias in a pointwise group of its own).
"""

from __future__ import annotations

import torch
from fxlite.passes.shape_prop import TensorMetadata, extract_tensor_metadata

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import is_impure, lookup
from fxlite.tensor_meta import memory_order

__all__ = ["read_through_copies"]

_SIZE_ONE_VIEWS = frozenset({"unsqueeze", "squeeze", "expand"})  # valid on any strides


def read_through_copies(gm: GraphModule) -> bool:
    """Drop each ``contiguous()`` copy of ``gm`` (a fused module, as ``fuse`` returns it)
    that only groups read, where their kernels keep their results' layouts; they read its
    source instead.

    Returns:
        Whether anything changed (``gm`` is changed in place, its views' metadata and its
        groups' placeholders' given the layouts they now read).
    """
    dropped = False
    for n in list(gm.graph.nodes):
        src = n.args[0] if n.args else None
        if not _copy(n, gm) or not isinstance(src, Node) or not _strided(src):
            continue
        views = _views_between(n, gm)
        calls = _group_calls(n, views, gm)
        laid_out = _laid_out(n, src, views) if calls else None
        if laid_out is None or not _same_orders(laid_out, calls, gm):
            continue
        n.replace_all_uses_with(src)
        gm.graph.erase_node(n)
        for v in views:  # their new layouts, as run on meta tensors
            v.meta["tensor_meta"] = extract_tensor_metadata(laid_out[v])._replace(
                requires_grad=v.meta["tensor_meta"].requires_grad)
        for call in calls:  # each group's placeholder takes the layout it now reads
            sub = gm.get_submodule(call.target)
            places = [p for p in sub.graph.nodes if p.op == "placeholder"]
            for p, arg in zip(places, call.args):
                if isinstance(arg, Node) and "tensor_meta" in arg.meta:
                    p.meta["tensor_meta"] = arg.meta["tensor_meta"]
        dropped = True
    if dropped:
        gm.recompile()
    return dropped


def _copy(n: Node, gm: GraphModule) -> bool:
    """Whether ``n`` is a plain ``contiguous()`` (row-major, nothing written or returned)."""
    info = lookup(n, gm) if n.op in ("call_function", "call_method") else None
    if info is None or info.name != "contiguous" or is_impure(n, gm):
        return False
    fmt = n.kwargs.get("memory_format", n.args[1] if len(n.args) > 1 else None)
    return fmt in (None, torch.contiguous_format)


def _strided(src: Node) -> bool:
    tm = src.meta.get("tensor_meta")
    return isinstance(tm, TensorMetadata) and tm.stride != () and not tm.is_quantized \
        and tm.memory_format != torch.contiguous_format


def _group_calls(n: Node, views: list[Node], gm: GraphModule) -> list[Node]:
    """The groups that read ``n``, directly or through ``views`` (its size-1 views); empty
    when anything else reads it (or a view of it), or it is returned."""
    calls: list[Node] = []
    todo = list(n.users)
    while todo:
        u = todo.pop()
        if u.op == "call_module" and getattr(gm.get_submodule(u.target), "meta", {}).get(
                "fused_kind") in ("reduction", "pointwise"):
            calls.append(u)
            continue
        if u not in views or is_impure(u, gm) or u.args[0] is not n and u.args[0] not in views:
            return []
        todo.extend(u.users)
    return list(dict.fromkeys(calls))


def _views_between(n: Node, gm: GraphModule) -> list[Node]:
    """The size-1 views that read ``n``, and views of them, in graph order."""
    found: list[Node] = []
    todo = [n]
    while todo:
        for u in todo.pop().users:
            info = lookup(u, gm) if u.op in ("call_function", "call_method") else None
            if info is not None and info.name in _SIZE_ONE_VIEWS and u not in found:
                found.append(u)
                todo.append(u)
    return found


def _laid_out(n: Node, src: Node, views: list[Node]) -> dict[Node, torch.Tensor] | None:
    """Meta tensors of ``src`` read in ``n``'s place and of ``views`` over it, keyed by the
    node each stands for; None where a view has other arguments than plain values, or
    fails on the source's layout."""
    new: dict[Node, torch.Tensor] = {n: _meta(src)}
    for v in views:  # in graph order: each reads ``n`` or a view before it
        args = [new.get(a, a) if isinstance(a, Node) else a for a in v.args]
        if any(isinstance(a, Node) for a in args) or any(isinstance(a, Node)
                                                         for a in v.kwargs.values()):
            return None
        fn = getattr(torch.Tensor, v.target) if v.op == "call_method" else v.target
        try:
            new[v] = fn(*args, **v.kwargs)
        except Exception:  # a view that fails on the source's layout: keep the copy
            return None
    return new


def _same_orders(laid_out: dict[Node, torch.Tensor], calls: list[Node],
                 gm: GraphModule) -> bool:
    """Whether each pointwise group among ``calls`` keeps its memory order (the layout of
    its results, ``fxlite.tensor_meta.memory_order``) with its inputs laid out as
    ``laid_out`` says, where it names them."""
    for call in calls:
        if getattr(gm.get_submodule(call.target), "meta", {}).get("fused_kind") != "pointwise":
            continue
        before = [_meta(a) if isinstance(a, Node) and "tensor_meta" in a.meta else 0
                  for a in call.args]  # (sizes and other numbers do not vote)
        after = [laid_out[a] if a in laid_out else b for a, b in zip(call.args, before)]
        if None in before or memory_order(before) != memory_order(after):
            return False
    return True


def _meta(n: Node) -> torch.Tensor | None:
    """A meta-device tensor laid out as ``n``'s metadata says, or None without one."""
    tm = n.meta.get("tensor_meta")
    if not isinstance(tm, TensorMetadata) or tm.stride == ():
        return None if not isinstance(tm, TensorMetadata) else torch.empty(
            tuple(tm.shape), dtype=tm.dtype, device="meta")
    return torch.empty_strided(tuple(tm.shape), tuple(tm.stride), dtype=tm.dtype,
                               device="meta")
