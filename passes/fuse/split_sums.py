"""split_sums: a sum over inner and outer dims becomes two sums, the inner one first.

A row kernel runs one program per kept row. BatchNorm's statistics sum an ``(N, C, H, W)``
tensor over ``(0, 2, 3)``: only ``C`` rows (64 in a resnet's first stage), each of
``N * H * W`` values that are not contiguous. The fusion partitioner takes only
reductions over trailing dims, so such a sum ran as torch's own reduction (8.6 us a call
on an H200 in a resnet18 training step, 0.55 ms of its 2.4 ms of GPU time), and in
backward graphs as one kernel whose few programs each walk a channel (36 us for the stem's
``16x64x64x64``). Summing the trailing dims first gives ``N * C`` contiguous rows, a
reduction the partitioner fuses with the ops that produce its input; the outer sum is then
over ``N`` values per channel::

    # before                                        # after (x: N x C x H x W)
    s = torch.sum(x, dim=(0, 2, 3), keepdim=True)   t = torch.sum(x, dim=(2, 3), keepdim=True)
                                                    s = torch.sum(t, dim=(0, 2, 3), keepdim=True)

Halves: eager accumulates a float16 or bfloat16 sum in float32 and rounds once, so the
inner sum is float32 and the outer one is cast back (``t`` rounded to 16 bits would round
twice). Integer and bool sums give int64 either way. Sums of fewer than ``MIN_NUMEL``
elements stay whole: there two launches cost more host time than the GPU saves. The
result is the same up to floating-point reassociation, which any parallel reduction has.
No size is written into the graph, so it stays valid after a resize.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from fxlite.passes.normalize import copy_graph, copy_module
from fxlite.passes.sink_views import tensor_meta, with_meta

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import canonical_args, is_impure, lookup
from fxlite.tensor_meta import reduced_dims

__all__ = ["split_sums"]

_HALVES = (torch.float16, torch.bfloat16)
MIN_NUMEL = 1 << 15


def split_sums(gm: GraphModule, min_numel: int = MIN_NUMEL) -> GraphModule:
    """Split every sum over both trailing and earlier dims into an inner and an outer sum.

    Args:
        gm: a module with ShapeProp metadata (canonical form, as ``fuse`` expects it).
        min_numel: sums of smaller inputs are left whole: one launch costs less host
            time than two, and the GPU gains nothing worth it on them.

    Returns:
        ``gm`` itself when no sum qualifies; otherwise a new GraphModule (``gm``
        unchanged) whose new nodes carry ``tensor_meta`` computed on the ``meta`` device.
        A sum qualifies when its input's shape is known and holds ``min_numel`` elements
        or more, it reduces a run of trailing dims holding at least 2 elements and
        earlier dims holding at least 2, and keeps a dim of size 2 or more.
    """
    if not any(_split_dims(n, gm, min_numel) for n in gm.graph.nodes):
        return gm
    graph = copy_graph(gm)
    for node in list(graph.nodes):
        found = _split_dims(node, gm, min_numel)
        if found:
            _split(node, *found)
    return copy_module(gm, graph)


def _split_dims(node: Node, gm: GraphModule, min_numel: int) -> tuple[Any, tuple[int, ...], tuple[int, ...],
                                                       bool, Any] | None:
    """``(input, inner dims, all dims, keepdim, dtype)`` when ``node`` is a sum to split."""
    if node.op != "call_function":
        return None
    info = lookup(node, gm)
    if info is None or info.name != "sum" or is_impure(node, gm):
        return None
    args = canonical_args(node, info, gm)
    x, dim, keepdim, dtype = (args.get(k) for k in ("input", "dim", "keepdim", "dtype"))
    tm = tensor_meta(x)
    if tm is None or set(args) - {"input", "dim", "keepdim", "dtype"} or \
            type(keepdim or False) is not bool or not (dtype is None or isinstance(dtype, torch.dtype)):
        return None
    shape = tuple(tm.shape)
    rank = len(shape)
    plain = isinstance(dim, (tuple, list)) and dim and all(type(d) is int for d in dim)
    if not plain or not rank or any(not -rank <= d < rank for d in dim) or 0 in shape \
            or math.prod(shape) < min_numel:
        return None
    dims = reduced_dims(dim, rank)
    start = rank
    while start - 1 in dims:
        start -= 1
    inner = tuple(range(start, rank))
    outer = [d for d in dims if d < start]
    kept = [d for d in range(rank) if d not in dims]
    if math.prod(shape[d] for d in inner) < 2 or math.prod(shape[d] for d in outer) < 2 \
            or math.prod(shape[d] for d in kept) < 2:
        return None
    return x, inner, tuple(dims), bool(keepdim), dtype


def _split(node: Node, x: Node, inner: tuple[int, ...], dims: tuple[int, ...], keepdim: bool,
           dtype: Any) -> None:
    graph = node.graph
    tm = tensor_meta(node)
    out_dtype = tm.dtype if tm is not None else None
    src = dtype if dtype is not None else tensor_meta(x).dtype
    with graph.inserting_before(node):
        kwargs: dict[str, Any] = {"dim": inner, "keepdim": True}
        if src in _HALVES:
            kwargs["dtype"] = torch.float32  # one rounding at the end, as eager's kernel
        elif dtype is not None:
            kwargs["dtype"] = dtype
        partial = with_meta(graph.call_function(torch.sum, (x,), kwargs))
        total = with_meta(graph.call_function(torch.sum, (partial,),
                                              {"dim": dims, "keepdim": keepdim}))
        if out_dtype is not None and tensor_meta(total).dtype != out_dtype:
            total = with_meta(graph.call_function(torch.Tensor.to, (total, out_dtype)))
    for key, value in node.meta.items():
        if key not in ("tensor_meta", "type"):
            total.meta.setdefault(key, value)
    node.replace_all_uses_with(total)
    graph.erase_node(node)
