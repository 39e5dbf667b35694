"""A channels-last graph's weight conversions as one kernel, and the pass that makes them one.

``passes/channels_last.py`` converts every convolution weight to channels-last on each
call, one copy kernel a weight: inception_v3 launched 38 such copies a forward, resnet50
18. Each launch costs host time (about 8 us on an H200 host, the launch and the output's
allocation), where the copies themselves take 1 to 5 us of GPU time. In inference (no
node needs autograd) :func:`pack_weight_copies` makes them one call of
:func:`channels_last_copies`: one kernel, generated for the weights' shapes, copying each
weight into its own new channels-last tensor. The values are the weights' own, to the bit.

Example of the pass::

    # before                                               # after
    w1_cl = torch.clone(w1, memory_format=channels_last)    cls = channels_last_copies(w1, w2)
    conv1 = torch.conv2d(x, w1_cl)                          w1_cl = cls[0]
    w2_cl = torch.clone(w2, memory_format=channels_last)    conv1 = torch.conv2d(x, w1_cl)
    conv2 = torch.conv2d(conv1, w2_cl)                      w2_cl = cls[1]
                                                            conv2 = torch.conv2d(conv1, w2_cl)

In training the conversions stay clones: autograd differentiates them (their backward
writes each gradient in its weight's layout).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
from fxlite.codegen.kernels.generate import interpreting
from fxlite.codegen.kernels.layout import dense_strides
from fxlite.codegen.runtime.cache import load_module
from fxlite.codegen.runtime.launch import TRITON_OPTIONS, Binary
from fxlite.passes.channels_last import CONVS

from fxlite.graph_module import GraphModule
from fxlite.node import Node

__all__ = ["channels_last_copies", "pack_weight_copies", "planned_launch"]

_BLOCK = 1024
_WARPS = 4
_MAX_ELEMENTS = 2**31 - _BLOCK  # offsets are int32
_MAX_WEIGHTS = 32  # a kernel's branches; more weights take several kernels
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_CHANNELS_LAST = (0, 2, 3, 1)  # (K, C, R, S) dims, outermost first


def _source(shapes: tuple[tuple[int, int, int, int], ...]) -> str:
    """A Triton kernel copying contiguous ``(K, C, R, S)`` tensors into channels-last ones:
    each program copies one block of one tensor, in the output's memory order."""
    args = ", ".join(f"src{i}, dst{i}" for i in range(len(shapes)))
    lines = ["import triton", "import triton.language as tl", "", "", "@triton.jit",
             f"def channels_last_copies({args}, BLOCK: tl.constexpr):",
             "    pid = tl.program_id(0)"]
    start = 0
    for i, (k, c, r, s) in enumerate(shapes):
        blocks = -(-(k * c * r * s) // _BLOCK)
        lines += [f"    {'if' if i == 0 else 'elif'} pid < {start + blocks}:",
                  f"        offs = (pid - {start}) * BLOCK + tl.arange(0, BLOCK)",
                  f"        mask = offs < {k * c * r * s}",
                  f"        ci = offs % {c}",  # the output's order: K, R, S, C
                  f"        rest = offs // {c}",
                  f"        si = rest % {s}",
                  f"        rest = rest // {s}",
                  f"        ri = rest % {r}",
                  f"        ki = rest // {r}",
                  f"        at = ki * {c * r * s} + ci * {r * s} + ri * {s} + si",
                  f"        tl.store(dst{i} + offs, tl.load(src{i} + at, mask=mask), mask=mask)"]
        start += blocks
    return "\n".join(lines) + "\n"


class _Prepared(NamedTuple):
    """The kernel for one list of weight shapes, dtype and device, and its grid."""

    fn: Any  # the JIT function (the interpreter runs it)
    binary: Binary | None  # its compiled binary (CUDA)
    grid: tuple[int, int, int]
    shapes: tuple[tuple[int, int, int, int], ...]
    strides: tuple[tuple[int, int, int, int], ...]  # channels-last strides of each copy


# (shapes, dtype, device, which weights are 16-byte aligned) -> the prepared kernel
_PREPARED: dict[tuple, _Prepared] = {}


def _takes(ws: tuple, planning: bool = False) -> bool:
    """Whether the kernel takes these values: 4-d contiguous float tensors or parameters
    (no other subclass: a fake tensor has no address) of one dtype on one CUDA device (or
    the CPU under the interpreter), none empty or needing autograd. ``planning``: for the
    precompile, they may be meta tensors instead, and autograd is the call's to see."""
    if not ws or len(ws) > _MAX_WEIGHTS or not all(type(w) in _PLAIN for w in ws):
        return False
    first = ws[0]
    if not (first.is_cuda or interpreting() and first.device.type == "cpu"
            or planning and first.is_meta) or not first.dtype.is_floating_point:
        return False
    grad = torch.is_grad_enabled() and not planning
    return all(w.dim() == 4 and w.dtype == first.dtype and w.device == first.device
               and 0 < w.numel() <= _MAX_ELEMENTS and w.is_contiguous()
               and not (grad and w.requires_grad) for w in ws)


def _kernel(ws: tuple, device: Any) -> tuple[Any, tuple[int, int, int], list[torch.Tensor]]:
    """The kernel for these weights' shapes, its grid, and its arguments: each weight,
    then a new channels-last tensor of its shape on ``device``."""
    shapes = tuple(tuple(w.shape) for w in ws)
    fn = load_module(_source(shapes), "channels_last_copies").channels_last_copies
    grid = (sum(-(-w.numel() // _BLOCK) for w in ws), 1, 1)
    outs = [torch.empty_strided(sh, dense_strides(sh, _CHANNELS_LAST), dtype=ws[0].dtype,
                                device=device) for sh in shapes]
    return fn, grid, [t for pair in zip(ws, outs) for t in pair]


def planned_launch(ws: tuple) -> tuple | None:
    """For the parallel precompile (``codegen/runtime/precompile.py``): the compile a call
    ``channels_last_copies(*ws)`` makes, ``ws`` meta tensors of the weights' layouts, as
    ``(source_id, fn, args, grid, constexprs, num_warps)``; None where the call makes
    torch's clones."""
    if not _takes(ws, planning=True) or not ws[0].is_meta:
        return None
    fn, grid, args = _kernel(ws, "meta")
    return f"{fn.__module__}.{fn.__name__}", fn, args, grid[:1], {"BLOCK": _BLOCK}, _WARPS


def _prepare(ws: tuple, key: tuple) -> _Prepared:
    fn, grid, args = _kernel(ws, ws[0].device)
    shapes = tuple(tuple(w.shape) for w in ws)
    strides = tuple(a.stride() for a in args[1::2])
    binary = None
    if not interpreting():
        binary = Binary(fn.warmup(*args, grid=grid[:1], BLOCK=_BLOCK, num_warps=_WARPS,
                                  **TRITON_OPTIONS))
    if len(_PREPARED) >= 256:  # ever new weight shapes: start over
        _PREPARED.clear()
    prepared = _PREPARED[key] = _Prepared(fn, binary, grid, shapes, strides)
    return prepared


def channels_last_copies(*ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tuple(torch.clone(w, memory_format=torch.channels_last) for w in ws)``, in one
    kernel where it can (see :func:`_takes`), else by torch's clones.

    Example::

        w1_cl, w2_cl = channels_last_copies(conv1.weight, conv2.weight)
    """
    if not _takes(ws):
        return tuple(torch.clone(w, memory_format=torch.channels_last) for w in ws)
    first = ws[0]
    key = (tuple(w.shape for w in ws), first.dtype, first.device,
           tuple(w.data_ptr() % 16 == 0 for w in ws))  # Triton specializes each pointer
    prepared = _PREPARED.get(key) or _prepare(ws, key)
    dtype, device = first.dtype, first.device
    outs = tuple(torch.empty_strided(sh, st, dtype=dtype, device=device)
                 for sh, st in zip(prepared.shapes, prepared.strides))
    args = [t for pair in zip(ws, outs) for t in pair]
    if prepared.binary is None:
        prepared.fn[prepared.grid[:1]](*args, BLOCK=_BLOCK, num_warps=_WARPS, **TRITON_OPTIONS)
    else:
        prepared.binary.launch(prepared.grid, [*args, _BLOCK], device.index or 0)
    return outs


# the parallel precompile plans each call (codegen/runtime/precompile.py)
channels_last_copies.planned_launch = (  # type: ignore[attr-defined]
    lambda target, args, kwargs: planned_launch(args))


def _weight_copy(n: Node) -> bool:
    """A conversion of a graph input that convolutions read as their weight only (an
    input image's conversion stays a tiled transpose kernel: it is large)."""
    return n.op == "call_function" and n.target is torch.clone and "channels_last_of" in n.meta \
        and n.kwargs.get("memory_format") is torch.channels_last and len(n.args) == 1 \
        and isinstance(n.args[0], Node) and n.args[0].op in ("placeholder", "get_attr") \
        and all(u.target in CONVS and len(u.args) > 1 and u.args[1] is n
                and u.args[0] is not n for u in n.users)


def pack_weight_copies(gm: GraphModule) -> bool:
    """Make the weight conversions ``passes/channels_last.py`` inserted (clones marked
    ``channels_last_of``) calls of :func:`channels_last_copies`, one for every
    ``_MAX_WEIGHTS`` of one dtype, placed before the first conversion. Run it only where no
    node needs autograd. Returns whether ``gm`` changed."""
    by_dtype: dict[Any, list[Node]] = {}
    for n in gm.graph.nodes:
        meta = n.meta.get("tensor_meta")
        if _weight_copy(n) and meta is not None and not meta.requires_grad:
            by_dtype.setdefault((meta.dtype, n.meta.get("device")), []).append(n)
    changed = False
    for copies in by_dtype.values():
        for i in range(0, len(copies) - 1, _MAX_WEIGHTS):
            chunk = copies[i:i + _MAX_WEIGHTS]
            if len(chunk) < 2:
                continue
            with gm.graph.inserting_before(chunk[0]):
                packed = gm.graph.call_function(channels_last_copies,
                                                tuple(c.args[0] for c in chunk))
            order = {n: k for k, n in enumerate(gm.graph.nodes)}
            for w in packed.args:  # an attribute read after the first copy: read it before
                if order[w] > order[packed]:
                    packed.prepend(w)
            packed.meta["type"] = tuple
            for j, c in enumerate(chunk):
                with gm.graph.inserting_before(c):
                    item = gm.graph.call_function(operator.getitem, (packed, j))
                item.meta.update(c.meta)
                c.replace_all_uses_with(item)
                gm.graph.erase_node(c)
            changed = True
    if changed:
        gm.recompile()
    return changed
