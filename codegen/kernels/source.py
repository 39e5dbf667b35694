"""Pieces of Triton source shared by the pointwise and reduction kernel builders.

- ``HELPERS``: small ``@triton.jit`` functions the expressions call (NaN-propagating
  max/min, torch's floor division and remainder, and portable forms of the libdevice
  functions the CPU interpreter lacks, computed in fp64 so they stay accurate for fp32).
- :class:`Access`: how one tensor operand is addressed (linear, per row, strided...).
- :func:`decompose`: the lines that split a linear index into per-dim indices.
- :func:`emit_value`, :func:`load_line`, :func:`store_line`: one kernel line each.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fxlite.codegen.kernels.analysis import Plan, Value
from fxlite.codegen.kernels.emit import Emitter, Operand, compute_dtype, tl_dtype
from fxlite.codegen.kernels.ops import TRITON_OPS

from fxlite import config
from fxlite import ops as op_table

__all__ = ["HELPERS", "Access", "ArgKind", "KernelArg", "KernelSource", "decompose",
           "division_magic", "emit_value", "header", "load_line", "scalar_dtype", "scalar_lines",
           "signature", "store_line"]

# Helpers broadcast their operands first: Triton's interpreter mistypes a 0-d comparison
# result once it is splat to a block (the GPU compiler does not).
HELPERS: dict[str, str] = {
    "_maximum": '''
@triton.jit
def _maximum(a, b):
    # torch.maximum: NaN in either operand wins (tl.maximum's default drops it).
    a, b = tl.broadcast(a, b)
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
''',
    "_minimum": '''
@triton.jit
def _minimum(a, b):
    # torch.minimum: NaN in either operand wins (tl.minimum's default drops it).
    a, b = tl.broadcast(a, b)
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
''',
    "_prod": '''
@triton.jit
def _prod(a, b):
    return a * b
''',
    "_floordiv_int": '''
@triton.jit
def _floordiv_int(a, b):
    # Triton's // truncates toward zero; torch floors.
    a, b = tl.broadcast(a, b)
    q = a // b
    return tl.where((q * b != a) & ((a < 0) != (b < 0)), q - 1, q)
''',
    "_remainder_int": '''
@triton.jit
def _remainder_int(a, b):
    # Triton's % takes the dividend's sign (C); torch's takes the divisor's.
    a, b = tl.broadcast(a, b)
    m = a % b
    return tl.where((m != 0) & ((m < 0) != (b < 0)), m + b, m)
''',
    "_floordiv_float": '''
@triton.jit
def _floordiv_float(a, b, m):
    # torch's float floor division, from m = fmod(a, b): exact where floor(a / b) is not.
    a, b = tl.broadcast(a, b)
    a, m = tl.broadcast(a, m)
    div = (a - m) / b
    div = tl.where((m != 0) & ((b < 0) != (m < 0)), div - 1.0, div)
    fl = tl.floor(div)
    fl = tl.where(div - fl > 0.5, fl + 1.0, fl)
    q = a / b
    res = tl.where(div != 0, fl, tl.where(q < 0, -0.0, 0.0))
    return tl.where(b == 0, q, res)
''',
    "_fdiv": '''
@triton.jit
def _fdiv(n, m, s):
    # n // d for 0 <= n < 2**31, from d's magic numbers (triton_source.division_magic).
    # Unsigned operands: older interpreters sign-extend int32 operands of umulhi.
    u = n.to(tl.uint32, bitcast=True)
    q = _umulhi(u, m.to(tl.uint32, bitcast=True)) + u
    return (q >> s.to(tl.uint32, bitcast=True)).to(tl.int32, bitcast=True)
''',
    "_umulhi": '''
@triton.jit
def _umulhi(a, b):
    return tl.umulhi(a, b)
''',
    "_round_half_even": '''
@triton.jit
def _round_half_even(x):
    # x - floor(x) is exact, so ties are seen exactly and go to the even neighbour.
    f = tl.floor(x)
    d = x - f
    odd = f - 2.0 * tl.floor(f * 0.5) != 0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
''',
    "_round_bf16": '''
@triton.jit
def _round_bf16(x):
    # fp32 -> nearest bf16 (ties to even), kept in fp32. The interpreter's own conversion
    # truncates; the GPU path uses the hardware conversion, except for the roundings it
    # must keep (Emitter.rounded), which LLVM cannot see through integer ops.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    r = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r)
''',
    "_round_f16": '''
@triton.jit
def _round_f16(x):
    # fp32 -> nearest f16 (ties to even), kept in fp32, by one conversion LLVM cannot see
    # through (Emitter.rounded's kept roundings; GPU only: the interpreter runs no asm).
    h = tl.inline_asm_elementwise("cvt.rn.f16.f32 $0, $1;", "=h,r", [x], dtype=tl.float16,
                                  is_pure=True, pack=1)
    return h.to(tl.float32)
''',
    "_tanh": '''
@triton.jit
def _tanh(x):
    # Portable tanh (the interpreter has none), in fp64: the cancellation in 1 - e for small |x|
    # stays far below fp32 precision, and a series covers |x| < 1e-3 for fp64.
    y = x.to(tl.float64)
    ay = tl.abs(y)
    e = tl.exp(-2.0 * ay)
    t = (1.0 - e) / (1.0 + e)
    s = y * y
    t = tl.where(ay < 1e-3, ay * (1.0 - s * (1.0 / 3.0 - s * (2.0 / 15.0))), t)
    return tl.where(y < 0, -t, t)
''',
    "_log1p": '''
@triton.jit
def _log1p(x):
    # Portable log1p: log(u) * y / (u - 1) cancels the rounding of u = 1 + y.
    y = x.to(tl.float64)
    u = 1.0 + y
    r = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
    return tl.where(u == float("inf"), u, r)
''',
    "_expm1": '''
@triton.jit
def _expm1(x):
    # Portable expm1: (u - 1) * y / log(u) cancels the rounding of u = exp(y).
    y = x.to(tl.float64)
    u = tl.exp(y)
    r = tl.where(u == 1.0, y, (u - 1.0) * (y / tl.log(u)))
    r = tl.where(u - 1.0 == -1.0, -1.0, r)
    return tl.where(u == float("inf"), u, r)
''',
    "_pow": '''
@triton.jit
def _pow(x, y):
    # Portable pow through exp2/log2 in fp64, with torch's signs and special cases.
    # C's special cases: (-inf) ** y is +-inf or 0, (-1) ** +-inf is 1, x ** +-inf even.
    a, b = tl.broadcast(x.to(tl.float64), y.to(tl.float64))
    m = tl.exp2(b * tl.log2(tl.abs(a)))
    inf_b = tl.abs(b) == float("inf")
    whole = tl.floor(b) == b
    odd = whole & (b - 2.0 * tl.floor(b * 0.5) != 0) & ~inf_b
    signed = tl.where(odd, -m, m)
    m = tl.where(a < 0, tl.where(whole | (a == float("-inf")), signed, float("nan")), m)
    m = tl.where((a == -1.0) & inf_b, 1.0, m)
    return tl.where((b == 0) | (a == 1), 1.0, m)
''',
}


# The GPU's forms of helpers whose portable form Triton lowers to a libdevice call: one
# PTX instruction each, the one libdevice's function is. A kernel that calls any libdevice
# function has all of libdevice linked into it and optimized with it, 50 to 100 ms of
# each compile, and on an H200 host most of fxlite's kernels linked it only for these two
# (resnet50: 9 of 9 kernels that linked it, swin_t 25 of 29; BENCHMARKS.md).
GPU_HELPERS = {
    "_umulhi": '''
@triton.jit
def _umulhi(a, b):
    # the high 32 bits of a * b (uint32): libdevice's __nv_umulhi is this instruction
    return tl.inline_asm_elementwise("mul.hi.u32 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.uint32, is_pure=True, pack=1)
''',
    "_rsqrt_f32": '''
@triton.jit
def _rsqrt_f32(x):
    # 1 / sqrt(x) in fp32, as CUDA's rsqrtf (eager's): denormal inputs are not flushed to
    # zero, as libdevice's __nv_rsqrtf does under Triton's default FTZ reflection
    return tl.inline_asm_elementwise("rsqrt.approx.f32 $0, $1;", "=r,r", [x],
                                     dtype=tl.float32, is_pure=True, pack=1)
''',
}


def header(body: str, helpers: set[str], libdevice: bool = False) -> str:
    """The module preamble: imports and the helper functions ``body`` uses, in their GPU
    form (:data:`GPU_HELPERS`) where ``libdevice`` (compiling for a GPU) and one exists."""
    lines = ["import triton", "import triton.language as tl"]
    if "libdevice." in body:
        lines.append("from triton.language.extra import libdevice")
    text = "\n".join(lines) + "\n"
    if "_fdiv(" in body:  # index splitting (decompose) uses it without an Emitter
        helpers = helpers | {"_fdiv"}
    if "_fdiv" in helpers:
        helpers = helpers | {"_umulhi"}
    for name in sorted(helpers):
        text += "\n" + (GPU_HELPERS[name] if libdevice and name in GPU_HELPERS
                        else HELPERS[name])
    return text


@dataclass
class Access:
    """How a tensor operand is addressed in a kernel.

    Attributes:
        offset: the element offset expression (``""`` for a single element).
        deps: which block indices the offset varies with: ``"lin"`` (pointwise), or
            ``"row"``/``"col"`` (reductions).
        strides: ``(dim, runtime argument name)`` of the strides the offset uses.
        mask_dims: dims whose index must be 0 for a store (the output is broadcast there).
    """

    offset: str
    deps: frozenset[str]
    strides: tuple[tuple[int, str], ...] = ()
    mask_dims: tuple[int, ...] = ()


def decompose(lines: list[str], linear: str, dims: list[int], needed: set[int],
              indent: str, tag: str, fast: bool = False) -> None:
    """Append lines splitting ``linear`` into ``i<d>`` for the ``needed`` of ``dims``.

    ``dims`` are the non-trivial dims the index runs over, outermost first; the size of
    dim ``d`` is the runtime argument ``size<d>``.

    ``fast`` (32-bit indices only): divide through the magic numbers ``size<d>_m`` and
    ``size<d>_s`` (see :func:`division_magic`) instead of by ``size<d>``. Why: sizes are
    runtime arguments, and a GPU divides by a runtime integer in about 20 instructions,
    which is more than a bf16 kernel can spend per element at full bandwidth; the magic
    form is a multiply-high, an add and a shift (what Inductor gets from sizes it bakes in).
    """
    want = [d for d in dims if d in needed]
    if not want:
        return
    outermost = want[0]
    rem = linear
    order = [d for d in reversed(dims) if d >= outermost]
    for k, d in enumerate(order):
        last = d == outermost
        if last and d == dims[0]:
            lines.append(f"{indent}i{d} = {rem}")
            break
        if fast:
            quotient = f"{tag}{k}" if not last else f"{tag}q{k}"
            lines.append(f"{indent}{quotient} = _fdiv({rem}, size{d}_m, size{d}_s)")
            lines.append(f"{indent}i{d} = {rem} - {quotient} * size{d}")
            rem = quotient
            continue
        lines.append(f"{indent}i{d} = {rem} % size{d}")
        if not last:
            nxt = f"{tag}{k}"
            lines.append(f"{indent}{nxt} = {rem} // size{d}")
            rem = nxt


def division_magic(d: int) -> tuple[int, int]:
    """``(m, s)`` with ``n // d == (umulhi(n, m) + n) >> s`` for every ``0 <= n < 2**31``.

    ``s = ceil(log2(d))`` and ``m = ceil(2**(32 + s) / d) - 2**32`` (so that the 33-bit
    multiplier fits 32 bits; the ``+ n`` adds its top bit back), the classic division by an
    invariant integer. ``m`` is returned as the signed 32-bit integer with the same bits,
    so that Triton passes it as an int32.
    """
    s = (d - 1).bit_length()
    m = -(-(1 << (32 + s)) // d) - (1 << 32)
    return (m - (1 << 32) if m >= 1 << 31 else m), s


_HALVES = (torch.float16, torch.bfloat16)
# Ops whose result jumps when an input moves by a rounding error: their half-typed
# inputs are rounded first, as eager has them.
DISCRETE = frozenset({"to", "eq", "ne", "lt", "le", "gt", "ge", "floor", "ceil", "round",
                      "trunc", "sign", "floordiv", "remainder", "fmod", "isnan", "isinf",
                      "isfinite", "logical_and", "logical_or", "logical_xor", "logical_not"})


def operand(v: Value, consumer: Value | None = None, e: Emitter | None = None,
            common: torch.dtype | None = None) -> Operand:
    """``v`` as an op argument for ``consumer``, whose operands eager casts to ``common``.

    Half values are computed in fp32 and rounded only at the store, except where the
    difference would show: when ``consumer`` is discrete (a comparison, a cast, floor...)
    or computes in another dtype (f16 promoted to f32), or ``v`` is stored itself or
    written in place (its readers then read what the caller sees: an ``exp_`` of a float16 buffer that
    overflowed to inf, eager's value, and not the fp32 value; fuzz seed 7404901), ``v`` is
    rounded first. An operand
    of another dtype than a half ``common`` (a 0-dim fp32 tensor in a bf16 op, an f16
    one compared with bf16) is rounded to ``common`` too, as eager casts it.
    """
    expr = v.name
    e = e or Emitter()
    if consumer is not None and v.dtype in _HALVES and not v.exact and (
            v.stored or v.written or consumer.op in DISCRETE or consumer.dtype != v.dtype
            or (consumer.op == "truediv" and consumer.args.get("rounding_mode"))):
        expr = e.rounded(v.name, v.dtype, kept=v.written)
    dtype = scalar_dtype(v) if v.kind == "scalar" else v.dtype
    if common in _HALVES and dtype != common:
        wide = expr if compute_dtype(dtype) == torch.float32 else f"{expr}.to(tl.float32)"
        expr, dtype = e.rounded(wide, common), common
    return Operand(expr, dtype, zero_dim=len(v.dims) == 0, pytype=v.pytype)


_OPERAND_KEYS = ("input", "other", "exponent", "min", "max")
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})


def common_dtype(v: Value) -> torch.dtype | None:
    """``v``'s common dtype (TensorIterator's), for ops that promote their operands; None
    for the rest. Eager casts a discrete op's operands to it before computing.

    Example: for ``x_bf16 < tensor(0.1)`` it is bf16, so ``0.1`` is compared as
    ``0.10009765625``, as eager compares it.
    """
    info = op_table.OPS.get(v.op)
    if info is None or not (info.dtype_rule in ("promote", "float") or v.op in _COMPARISONS
                            or v.op in ("truediv", "where")):
        return None
    values: list[Any] = []
    for key in _OPERAND_KEYS:
        a = v.args.get(key)
        if isinstance(a, Value):
            if a.kind == "scalar":
                values.append(a.pytype(1) if a.pytype is not None else None)
            elif a.dims == ():
                values.append(torch.empty((), dtype=a.dtype, device="meta"))
            else:
                values.append(a.dtype)
        elif isinstance(a, (bool, int, float)):
            values.append(a)
    return op_table.promote(values)


def _rounded_literal(a: Any, common: torch.dtype | None) -> Any:
    """A float literal as eager sees it in an op of half dtype ``common`` (cast to it)."""
    if common in _HALVES and isinstance(a, float) and math.isfinite(a):
        return float(torch.tensor(a, dtype=common))
    return a


def emit_value(e: Emitter, v: Value, indent: str) -> None:
    """Append the line computing pointwise or count value ``v`` (through ``e.lines``)."""
    ct = compute_dtype(v.dtype)
    start = len(e.lines)
    if v.kind == "count":
        x = v.args["input"].name
        corr = v.args["correction"]
        denom = "cols" if corr == 0 else f"tl.maximum(cols - {int(corr)}, 0)"
        expr = f"{x} / {denom}"
    else:
        # eager casts the operands of discrete ops to their common dtype first; arithmetic
        # reads a 0-dim or Python-number operand unrounded (``original_scalar_value``)
        common = common_dtype(v) if v.op in DISCRETE or v.op == "truediv" and v.args.get(
            "rounding_mode") else None
        args = {k: operand(a, v, e, common) if isinstance(a, Value) else
                _rounded_literal(a, common) if k in _OPERAND_KEYS else a
                for k, a in v.args.items()}
        if v.op in ("to", "truediv"):  # a cast, and a quotient rounded as eager's dtype
            args["_out_dtype"] = v.dtype
        other = v.args.get("other")
        if v.op == "truediv" and isinstance(other, Value) and v.span & e.reduced \
                and not other.span & e.reduced:
            args["_by_row"] = True
        index = e.index
        if not e.space <= v.span:  # the index names elements of the whole space only
            e.index = None
        try:
            expr = TRITON_OPS[v.op].emit(e, args, ct)
        finally:
            e.index = index
    e.lines.append(f"{v.name} = {expr}")
    for i in range(start, len(e.lines)):
        e.lines[i] = indent + e.lines[i]


def scalar_lines(plan: Plan, used: set[Value], block: str, indent: str) -> list[str]:
    """Turn scalar kernel arguments into blocks of a fixed dtype.

    Triton types a Python scalar by its value (and the interpreter leaves it a Python
    number); a block of fp32 / int64 / int1 behaves the same everywhere.
    """
    lines = []
    for v in plan.values:
        if v.kind == "scalar" and v in used:
            lines.append(f"{indent}{v.name} = tl.full({block}, {v.name}, "
                         f"{tl_dtype(scalar_dtype(v))})")
    return lines


def scalar_dtype(v: Value) -> torch.dtype:
    """The kernel dtype of a Python scalar argument."""
    return {bool: torch.bool, int: torch.int64}.get(v.pytype, torch.float32)


def load_line(v: Value, acc: Access, mask: str, block: str, eviction: str = "") -> str:
    """``v = tl.load(...)``, converted to its compute dtype.

    A single element (an offset that varies with no block index) is broadcast to
    ``block`` (a shape such as ``"[BLOCK]"``) so that no 0-d value is splat later (see
    HELPERS). ``eviction`` is a cache hint for the load (``"evict_last"``, ``"evict_first"``).
    """
    cvt = "" if compute_dtype(v.dtype) == v.dtype else f".to({tl_dtype(compute_dtype(v.dtype))})"
    if not acc.deps:  # one element (at a per-program offset) for the whole block
        ptr = f"{v.name}_ptr + {acc.offset}" if acc.offset else f"{v.name}_ptr"
        return f"{v.name} = tl.broadcast_to(tl.load({ptr}){cvt}, {block})"
    hint = f", eviction_policy={eviction!r}" if eviction else ""
    return f"{v.name} = tl.load({v.name}_ptr + {acc.offset}, mask={mask}, other=0{hint}){cvt}"


def store_line(e: Emitter, ptr: str, v: Value, acc: Access, mask: str, pad: str,
               index_pad: str = "") -> str:
    """``tl.store(...)`` of ``v``, rounded once to its storage dtype.

    ``pad`` (such as ``" + 0 * r"``) broadcasts the address to the block the mask covers;
    ``index_pad`` does the same for the indices of ``acc.mask_dims`` (per-program scalars
    in a pointwise rows kernel).
    """
    val = v.name
    if compute_dtype(v.dtype) != v.dtype:
        if v.dtype == torch.bfloat16 and not e.libdevice:
            val = e.rounded(val, v.dtype)
        val += f".to({tl_dtype(v.dtype)})"
    extra = "".join(f" & (i{d}{index_pad} == 0)" for d in acc.mask_dims)
    off = acc.offset or "0"
    return f"tl.store({ptr} + {off}{pad}, {val}, mask={mask}{extra})"


ArgKind = Literal["in", "scalar", "out", "count", "size", "size_m", "size_s", "stride",
                  "ostride"]


@dataclass(frozen=True, slots=True)
class KernelArg:
    """One runtime argument of a kernel: what the launch passes for it.

    Attributes:
        kind: ``"in"`` (tensor input ``index``), ``"scalar"`` (Python number input
            ``index``), ``"out"`` (output ``index``), ``"count"`` (the launch's count
            ``name``: ``numel``, ``rows``, ``cols``, ``lena`` or ``lenb``), ``"size"``
            (the size of iteration dim ``dim``), ``"size_m"``/``"size_s"`` (its division
            magic, see :func:`division_magic`), ``"stride"`` (input ``index``'s stride
            along iteration dim ``dim``), ``"ostride"`` (output ``index``'s stride along
            iteration dim ``dim``).
        index: the input or output it belongs to (-1: none).
        dim: the iteration dim it describes (-1: none).
        name: a count's name.

    Example::

        KernelArg("stride", index=0, dim=1)  # input 0's stride along dim 1
    """

    kind: ArgKind
    index: int = -1
    dim: int = -1
    name: str = ""


@dataclass
class KernelSource:
    """Generated kernel text plus what the launcher needs.

    Attributes:
        text: the module source (imports, helpers, kernels).
        functions: variant (``"pointwise"``, ``"persistent"``, ``"looped"``) -> function name.
        args: one :class:`KernelArg` per runtime argument, in signature order.
        tile: for a pointwise kernel with a ``"transpose"`` variant, the dims its tiles
            run along: those contiguous in the input, then those contiguous in the output.
    """

    text: str
    functions: dict[str, str]
    args: list[KernelArg]
    tile: tuple[tuple[int, ...], tuple[int, ...]] | None = None


def signature(plan: Plan, body: str, used: set[Value], loads: list[tuple[Value, Access]],
              stores: list[tuple[int, Value, Access]], counts: list[str]
              ) -> tuple[list[str], list[KernelArg], list[str]]:
    """Kernel parameter names, their :class:`KernelArg`, and those not to specialize on.

    Triton specializes integer arguments equal to 1 or divisible by 16. Sizes used only to
    split an index (``size<d>``), ``rows`` and integer scalars are marked
    ``do_not_specialize``, so resizes never recompile for them. The element count, the row
    length and strides are left to Triton (unless FXLITE_TRITON_SPECIALIZE=0): knowing
    that they are multiples of 16 is what lets it vectorize masked loads and stores (4x
    the bandwidth for fp32 rows); a resize that changes that compiles one more variant.
    """
    align = config.triton_specialize()
    names: list[str] = []
    args: list[KernelArg] = []
    nospec: list[str] = []

    def add(name: str, desc: KernelArg, integer: bool) -> None:
        names.append(name)
        args.append(desc)
        if integer:
            nospec.append(name)

    for v, _ in loads:
        add(f"{v.name}_ptr", KernelArg("in", index=v.index), False)
    for j, _, _ in stores:
        add(f"out{j}_ptr", KernelArg("out", index=j), False)
    for v in plan.values:
        if v.kind == "scalar" and v in used:
            add(v.name, KernelArg("scalar", index=v.index), v.pytype is not float)
    for c in counts:
        add(c, KernelArg("count", name=c), c == "rows" or not align)
    for d in range(plan.rank):
        if re.search(rf"\bsize{d}\b", body):
            add(f"size{d}", KernelArg("size", dim=d), True)
        if re.search(rf"\bsize{d}_m\b", body):
            add(f"size{d}_m", KernelArg("size_m", dim=d), True)
            add(f"size{d}_s", KernelArg("size_s", dim=d), True)
    for v, acc in loads:
        for d, s in acc.strides:
            add(s, KernelArg("stride", index=v.index, dim=d), not align)
    for j, _, acc in stores:
        for d, s in acc.strides:
            add(s, KernelArg("ostride", index=j, dim=d), not align)
    return names, args, nospec
