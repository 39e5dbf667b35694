"""max_pool2d and avg_pool2d as Triton kernels, and the pass that routes a graph's pools
to them.

On a GPU torch's ``max_pool2d`` computes the argmax of every window even when nobody asks
for it, and writes it as int64: for resnet50's stem at batch 32 in bfloat16 (a 32 x 64 x
112 x 112 input) that is 100 MB of indices next to 26 MB of values, and the op took 114 us
of a forward's 2.0 ms of GPU time on an H200 (torch.profiler), where inductor's kernel
took 21. The kernel here reads each window and writes the maxima only.

On channels-last inputs torch's ``avg_pool2d`` kernel is slow: resnet50d's three 2 x 2
average pools took 294 us a forward (bfloat16, batch 32, H200), twice their time on
contiguous inputs, where inductor's kernels took a few tens.

Semantics are eager's: windows that hang over the border ignore the missing elements
(``padding`` and ``ceil_mode``), a NaN anywhere in a window makes its maximum NaN, an
average divides by what eager divides by (``count_include_pad``, ``divisor_override``) and
sums in the same order and precision, and the result has eager's shape and memory format
(channels-last in, channels-last out). Anything else (indices wanted, autograd recording
the call, a layout that is neither contiguous nor channels-last, arguments eager would
reject) runs torch's op.

A pool's first call on a shape goes through Triton's dispatcher (about 60 us of host time
a pool on an H200 host, where inception_v3 runs 13 a forward); later calls with the same
shape, strides, dtype and arguments reuse its binary through fxlite's launcher
(:class:`~fxlite.codegen.runtime.launch.Binary`), allocating the output and launching.

Example of the pass::

    # before                                          # after
    pool = F.max_pool2d(relu, 3, stride=2, padding=1)  pool = max_pool2d(relu, 3, stride=2, padding=1)
    avg = F.avg_pool2d(pool, 2, ceil_mode=True)        avg = avg_pool2d(pool, 2, ceil_mode=True)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from fxlite.codegen.kernels.generate import interpreting
from fxlite.codegen.runtime.launch import TRITON_OPTIONS, Binary

from fxlite.graph_module import GraphModule

__all__ = ["avg_pool2d", "max_pool2d", "nearest_bf16", "planned_launch", "use_pool_kernels"]

_MAX_POOLS = frozenset({F.max_pool2d, torch.max_pool2d})
_AVG_POOLS = frozenset({F.avg_pool2d})
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BLOCK = 1024
_WARPS = 4


@triton.jit
def _split(offs, a, b, c):
    """A flat index as four, innermost first: the sizes ``a``, ``b``, ``c``, then the rest."""
    rest = offs // a
    rest2 = rest // b
    return offs % a, rest % b, rest2 % c, rest2 // c


@triton.jit
def _max_pool2d_kernel(x_ptr, out_ptr, total, C, H, W, OH, OW,
                       sxn, sxc, sxh, sxw, son, soc, soh, sow,
                       KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                       PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                       CHANNELS_LAST: tl.constexpr, BIG: tl.constexpr, F64: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if BIG:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    # the output's elements in its memory order, so that stores are contiguous
    if CHANNELS_LAST:
        c, ow, oh, n = _split(offs, C, OW, OH)
    else:
        ow, oh, c, n = _split(offs, OW, OH, C)
    base = n * sxn + c * sxc
    # compared in float32 (float64 for float64): exact for a maximum, and Triton's CPU
    # interpreter compares 16-bit floats by their bits
    acc = tl.full([BLOCK], float("-inf"), tl.float64 if F64 else tl.float32)
    for kh in tl.static_range(KH):
        ih = oh * SH - PH + kh * DH
        row_ok = mask & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = ow * SW - PW + kw * DW
            ok = row_ok & (iw >= 0) & (iw < W)
            v = tl.load(x_ptr + base + ih * sxh + iw * sxw, mask=ok, other=float("-inf"))
            v = v.to(acc.dtype)
            acc = tl.where((v > acc) | (v != v), v, acc)  # a NaN wins, as in eager
    tl.store(out_ptr + n * son + c * soc + oh * soh + ow * sow,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def nearest_bf16(x):
    """fp32 to the nearest bfloat16 (ties to even), kept in fp32: the interpreter's own
    conversion truncates (the generated kernels' ``_round_bf16`` helper, the same bits)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return tl.where(x != x, x, (bits & 0xFFFF0000).to(tl.float32, bitcast=True))


@triton.jit
def _avg_pool2d_kernel(x_ptr, out_ptr, total, C, H, W, OH, OW,
                       sxn, sxc, sxh, sxw, son, soc, soh, sow,
                       KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                       PH: tl.constexpr, PW: tl.constexpr, INCLUDE_PAD: tl.constexpr,
                       DIVISOR: tl.constexpr, CHANNELS_LAST: tl.constexpr, BIG: tl.constexpr,
                       F64: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if BIG:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    if CHANNELS_LAST:
        c, ow, oh, n = _split(offs, C, OW, OH)
    else:
        ow, oh, c, n = _split(offs, OW, OH, C)
    base = n * sxn + c * sxc
    # eager's window (AvgPool2d.cu): clipped to the padded input for count_include_pad's
    # count, then to the input for the sum and the other count
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    h1 = tl.minimum(h0 + KH, H + PH)
    w1 = tl.minimum(w0 + KW, W + PW)
    padded = (h1 - h0) * (w1 - w0)
    inside = (tl.minimum(h1, H) - tl.maximum(h0, 0)) * (tl.minimum(w1, W) - tl.maximum(w0, 0))
    # summed in eager's order and accumulator (float32; float64 for float64)
    acc = tl.zeros([BLOCK], tl.float64 if F64 else tl.float32)
    for kh in tl.static_range(KH):
        ih = h0 + kh
        row_ok = mask & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = w0 + kw
            ok = row_ok & (iw >= 0) & (iw < W)
            v = tl.load(x_ptr + base + ih * sxh + iw * sxw, mask=ok, other=0.0)
            acc += v.to(acc.dtype)
    if DIVISOR != 0:
        count = tl.full([BLOCK], DIVISOR, tl.int32)
    elif INCLUDE_PAD:
        count = padded
    else:
        count = inside
    empty = (tl.minimum(h1, H) <= tl.maximum(h0, 0)) | (tl.minimum(w1, W) <= tl.maximum(w0, 0))
    count = tl.where(count == 0, 1, count).to(acc.dtype)
    if F64:
        avg = acc / count
    else:  # correctly rounded, as eager's CUDA division (Triton's fp32 `/` is approximate)
        avg = tl.div_rn(acc, count)
    avg = tl.where(empty, 0.0, avg)
    if ROUND_BF16:
        avg = nearest_bf16(avg)
    tl.store(out_ptr + n * son + c * soc + oh * soh + ow * sow,
             avg.to(out_ptr.dtype.element_ty), mask=mask)


def _pair(v: Any) -> tuple[int, int] | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return v, v
    if isinstance(v, (tuple, list)) and len(v) == 1:
        return _pair(v[0])
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in v):
        return int(v[0]), int(v[1])
    return None


def _out_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """torch's pooling output length (pooling_shape.h)."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (span + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:  # the last window must start inside
        out -= 1
    return out


def _layout(x: torch.Tensor) -> bool | None:
    """True for channels-last, False for contiguous (eager's result takes the same
    memory format), None when ``x`` is laid out in neither or could be read as both (one
    channel, or one pixel: eager's choice then depends on its stride rules)."""
    nchw, nhwc = x.is_contiguous(), x.is_contiguous(memory_format=torch.channels_last)
    return None if nchw == nhwc else nhwc


class _Prepared(NamedTuple):
    """A pool's launch as an earlier call made it, for inputs of the same key (:func:`_key`):
    the output's size and strides, the binary, the grid, and the kernel's arguments after
    its two pointers."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    binary: Binary
    grid: tuple[int, int, int]
    values: tuple

    def run(self, input: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(self.size, self.stride, dtype=input.dtype, device=input.device)
        self.binary.launch(self.grid, (input, out, *self.values), input.device.index or 0)
        return out


# _key -> the launch an earlier call prepared (CUDA only: the interpreter has no binaries)
_PREPARED: dict[tuple, _Prepared] = {}
_MAX_PREPARED = 1024


def _key(kernel: Any, input: Any, args: tuple) -> tuple | None:
    """What a pool's launch depends on besides its input's data: the kernel, the input's
    shape, strides, dtype, device and 16-byte alignment (what Triton specializes pointers
    on), and the pool's arguments, by their ``repr``: ``True`` and ``1`` are equal, but
    eager takes one and rejects the other where it wants an int. None for what is not a
    plain CUDA tensor (a subclass, a fake or meta tensor: no address to read)."""
    if type(input) is not torch.Tensor or not input.is_cuda:
        return None
    return (kernel, input.shape, input.stride(), input.dtype, input.device,
            input.data_ptr() % 16 == 0, repr(args))


def _prepared(key: tuple | None, input: torch.Tensor) -> _Prepared | None:
    """The prepared launch of ``key``, unless autograd must record this call."""
    if key is None or (input.requires_grad and torch.is_grad_enabled()):
        return None
    return _PREPARED.get(key)


class _Launch(NamedTuple):
    """A 2-d pool's kernel launch: its window, the output it fills and the grid."""

    k: tuple[int, int]  # kernel size, stride, padding and dilation, each (h, w)
    s: tuple[int, int]
    p: tuple[int, int]
    d: tuple[int, int]
    out: torch.Tensor
    channels_last: bool

    def arguments(self, input: Any, **constants: Any) -> tuple[tuple[int], tuple, dict]:
        """The grid, the arguments after the two pointers, and the constexprs of the
        launch over ``out`` (``constants``: the kernel's own ones)."""
        out, total = self.out, self.out.numel()
        _, c, oh, ow = out.shape
        args = (total, c, input.shape[2], input.shape[3], oh, ow, *input.stride(),
                *out.stride())
        constants.update(KH=self.k[0], KW=self.k[1], SH=self.s[0], SW=self.s[1],
                         PH=self.p[0], PW=self.p[1], CHANNELS_LAST=self.channels_last,
                         BIG=max(total, input.numel()) + _BLOCK >= 2**31,
                         F64=input.dtype == torch.float64, BLOCK=_BLOCK)
        return (triton.cdiv(total, _BLOCK),), args, constants

    def run(self, kernel: Any, input: torch.Tensor, key: tuple | None,
            **constants: Any) -> torch.Tensor:
        """Launch ``kernel`` over ``out`` (none for an empty output) and return ``out``;
        on CUDA, keep the launch under ``key`` for the next calls."""
        out, total = self.out, self.out.numel()
        if not total:
            return out
        grid, args, constants = self.arguments(input, **constants)
        if interpreting() or key is None:
            kernel[grid](input, out, *args, num_warps=_WARPS, **constants, **TRITON_OPTIONS)
            return out
        compiled = kernel.warmup(input, out, *args, grid=grid, num_warps=_WARPS, **constants,
                                 **TRITON_OPTIONS)
        values = args + tuple(constants[n] for n in kernel.arg_names[2 + len(args):])
        prepared = _Prepared(tuple(out.shape), out.stride(), Binary(compiled), (grid[0], 1, 1),
                             values)
        prepared.binary.launch(prepared.grid, (input, out, *values), input.device.index or 0)
        if len(_PREPARED) >= _MAX_PREPARED:  # a program of ever new sizes: start over
            _PREPARED.clear()
        _PREPARED[key] = prepared
        return out


def _launch(input: Any, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
            ceil_mode: bool, planning: bool = False) -> _Launch | None:
    """The launch of a pool over ``input`` with these arguments, its output allocated in
    eager's shape and layout; None where torch's op must run (what the kernels do not
    take, and arguments eager rejects: it raises its own error). ``planning``: for the
    precompile, ``input`` may be a meta tensor, and so is the output."""
    k = _pair(kernel_size)
    s = k if stride is None or (isinstance(stride, (tuple, list)) and not stride) \
        else _pair(stride)
    p, d = _pair(padding), _pair(dilation)
    if k is None or s is None or p is None or d is None \
            or not isinstance(input, torch.Tensor) or input.dim() != 4 \
            or input.dtype not in _FLOATS \
            or not (input.is_cuda or interpreting() or planning and input.is_meta) \
            or (input.requires_grad and torch.is_grad_enabled()) \
            or min(*k, *s, *d) < 1 or p[0] < 0 or p[1] < 0 \
            or p[0] > k[0] // 2 or p[1] > k[1] // 2:
        return None
    channels_last = _layout(input)
    n, c, h, w = input.shape
    oh, ow = (_out_size(size, k[i], s[i], p[i], d[i], bool(ceil_mode))
              for i, size in enumerate((h, w)))
    if channels_last is None or oh < 1 or ow < 1 or c == 0 or h == 0 or w == 0:
        return None
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((n, c, oh, ow), dtype=input.dtype, device=input.device,
                      memory_format=fmt)
    return _Launch(k, s, p, d, out, channels_last)


def max_pool2d(input: torch.Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
               dilation: Any = 1, ceil_mode: bool = False,
               return_indices: bool = False) -> Any:
    """``F.max_pool2d`` computed by one Triton kernel that writes no indices.

    Falls back to ``F.max_pool2d`` for what the kernel does not do (see the module
    docstring), so it can stand wherever ``F.max_pool2d`` stands.

    Example::

        y = max_pool2d(torch.randn(8, 64, 56, 56, device="cuda"), 3, stride=2, padding=1)
    """
    key = None if return_indices else _key(
        _max_pool2d_kernel, input, (kernel_size, stride, padding, dilation, ceil_mode))
    prepared = _prepared(key, input)
    if prepared is not None:
        return prepared.run(input)
    call = _max_call(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    if call is None:
        return F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode,
                            return_indices)
    return call[0].run(_max_pool2d_kernel, input, key, **call[1])


def _max_call(input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
              dilation: Any = 1, ceil_mode: bool = False, return_indices: bool = False,
              planning: bool = False) -> tuple[_Launch, dict] | None:
    """:func:`max_pool2d`'s launch and its kernel's own constexprs, or None."""
    launch = None if return_indices else _launch(input, kernel_size, stride, padding,
                                                  dilation, ceil_mode, planning)
    return None if launch is None else (launch, {"DH": launch.d[0], "DW": launch.d[1]})


def avg_pool2d(input: torch.Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
               ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: Any = None) -> torch.Tensor:
    """``F.avg_pool2d`` computed by one Triton kernel.

    Falls back to ``F.avg_pool2d`` for what the kernel does not do (see the module
    docstring), so it can stand wherever ``F.avg_pool2d`` stands.

    Example::

        y = avg_pool2d(torch.randn(8, 64, 56, 56, device="cuda"), 2, ceil_mode=True)
    """
    key = _key(_avg_pool2d_kernel, input, (kernel_size, stride, padding, ceil_mode,
                                           count_include_pad, divisor_override))
    prepared = _prepared(key, input)
    if prepared is not None:
        return prepared.run(input)
    call = _avg_call(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)
    if call is None:
        return F.avg_pool2d(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                            divisor_override)
    return call[0].run(_avg_pool2d_kernel, input, key, **call[1])


def _avg_call(input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
              ceil_mode: bool = False, count_include_pad: bool = True,
              divisor_override: Any = None, planning: bool = False) -> tuple[_Launch, dict] | None:
    """:func:`avg_pool2d`'s launch and its kernel's own constexprs, or None."""
    plain = type(ceil_mode) is bool and type(count_include_pad) is bool and (
        divisor_override is None or type(divisor_override) is int
        and 0 < divisor_override < 2**31)
    launch = _launch(input, kernel_size, stride, padding, 1, ceil_mode, planning) \
        if plain else None
    if launch is None:
        return None
    return launch, {"INCLUDE_PAD": count_include_pad, "DIVISOR": divisor_override or 0,
                    "ROUND_BF16": input.dtype == torch.bfloat16 and interpreting()}


def planned_launch(target: Any, args: tuple, kwargs: dict) -> tuple | None:
    """For the parallel precompile (``codegen/runtime/precompile.py``): the compile a call
    ``target(*args, **kwargs)`` of :func:`max_pool2d` or :func:`avg_pool2d` makes, its
    input a meta tensor of the layout the call will give, as ``(source_id, fn, args,
    grid, constexprs, num_warps)``; None where the call runs torch's op, or nothing."""
    kernel, call = (_max_pool2d_kernel, _max_call) if target is max_pool2d \
        else (_avg_pool2d_kernel, _avg_call)
    try:
        found = call(*args, **kwargs, planning=True)
    except TypeError:  # arguments the op rejects: it says so when it runs
        return None
    if found is None or not found[0].out.numel():
        return None
    launch, constants = found
    input = args[0] if args else kwargs["input"]
    grid, values, constexprs = launch.arguments(input, **constants)
    return (f"{kernel.__module__}.{kernel.__name__}", kernel, [input, launch.out, *values], grid,
            constexprs, _WARPS)


# the parallel precompile plans each call of these (codegen/runtime/precompile.py)
max_pool2d.planned_launch = planned_launch  # type: ignore[attr-defined]
avg_pool2d.planned_launch = planned_launch  # type: ignore[attr-defined]


def use_pool_kernels(gm: GraphModule) -> bool:
    """Route ``gm``'s ``max_pool2d`` and ``avg_pool2d`` calls to :func:`max_pool2d` and
    :func:`avg_pool2d` (which fall back to torch's for calls they do not take). Returns
    whether ``gm`` changed."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _MAX_POOLS:
            node.target = max_pool2d
            changed = True
        elif node.op == "call_function" and node.target in _AVG_POOLS:
            node.target = avg_pool2d
            changed = True
    if changed:
        gm.recompile()
    return changed
