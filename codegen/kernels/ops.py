"""Triton expressions for pointwise ops, and the reductions the kernel generator knows.

One record per op, keyed by the op table's canonical name (``fxlite.ops.lookup(node).name``)::

    "add": TritonOp(("input", "other", "alpha"), {"alpha": 1}, _add)

An emitter gets the :class:`~fxlite.codegen.kernels.emit.Emitter` (which casts operands
and declares helpers), the
bound arguments and the result's compute dtype, and returns one Triton expression. Values
of half types are computed in fp32 and rounded once at the store (see "Numerics" in
``codegen/runtime/kernel.py`` for where and why this differs from eager's per-op rounding).

Triton's CPU interpreter lacks libdevice (``tanh``, ``log1p``, ``pow``, ``fmod`` ...), so
every op has a portable expression built from core ``tl`` functions; the libdevice form is
used only when ``Emitter.libdevice`` is set (compiling for a GPU).

:data:`TRITON_OPS` is the op table's Triton column: a dict keyed by the op's name in
``fxlite.ops.OPS``, read by the kernel generator (``TRITON_OPS[info.name]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fxlite.codegen.kernels.emit import (
    Emitter,
    Operand,
    Unsupported,
    compute_dtype,
    promote,
    tl_dtype,
)

__all__ = ["REDUCTIONS", "TRITON_OPS", "TritonOp"]


# ---------------------------------------------------------------------------- emitters
Emit = Callable[[Emitter, dict[str, Any], torch.dtype], str]


@dataclass(frozen=True)
class TritonOp:
    """How to emit one op. Its parameters and defaults are the op table's."""

    emit: Emit
    ignore: tuple[str, ...] = ()  # parameters that never change the value (``inplace``)


def _is_float(ct: torch.dtype) -> bool:
    return ct.is_floating_point


def _alpha(e: Emitter, y: str, a: dict[str, Any], ct: torch.dtype) -> str:
    alpha = a.get("alpha", 1)
    return y if alpha == 1 and type(alpha) is not float else f"{y} * {e.lit(alpha, ct)}"


def _add(e: Emitter, a: dict, ct: torch.dtype) -> str:
    x, y = e.c(a["input"], ct), e.c(a["other"], ct)
    if ct == torch.bool:
        return f"{x} | {y}"
    return f"{x} + {_alpha(e, y, a, ct)}"


def _sub(e: Emitter, a: dict, ct: torch.dtype) -> str:
    if ct == torch.bool:
        raise Unsupported("bool subtraction")
    return f"{e.c(a['input'], ct)} - {_alpha(e, e.c(a['other'], ct), a, ct)}"


def _rsub(e: Emitter, a: dict, ct: torch.dtype) -> str:
    if ct == torch.bool:
        raise Unsupported("bool subtraction")
    return f"{e.c(a['other'], ct)} - {_alpha(e, e.c(a['input'], ct), a, ct)}"


def _mul(e: Emitter, a: dict, ct: torch.dtype) -> str:
    x, y = e.c(a["input"], ct), e.c(a["other"], ct)
    return f"{x} & {y}" if ct == torch.bool else f"{x} * {y}"


def _fmod(e: Emitter, x: str, y: str) -> str:
    # Triton's float % is frem, which the NVPTX backend approximates; libdevice is exact.
    return f"libdevice.fmod({x}, {y})" if e.libdevice else f"{x} % {y}"


def _integer_divisor(a: dict, ct: torch.dtype, param: str = "other") -> None:
    """Refuse an integer division whose divisor may be zero when the kernel runs.

    Why: for an integer divisor of 0, CPU eager raises ``ZeroDivisionError``, and CUDA
    eager returns whatever the hardware gives (-1 for int32, 2**32 - 1 for int64 in
    torch 2.x: pytorch/pytorch#165650, #89418), while in Triton it is undefined behaviour
    (LLVM may assume a divisor is not 0). No kernel can promise eager's result, so such a
    group runs in eager. A non-zero literal divisor (``i // 2``, ``i % 3``) is fine.
    """
    if ct.is_floating_point:
        return
    y = a[param]
    if isinstance(y, Operand) or y == 0:
        raise Unsupported("integer division by a value that may be 0: eager raises "
                          "ZeroDivisionError on the CPU and gives a device-specific value on "
                          "CUDA, which a kernel cannot promise")


def _floordiv(e: Emitter, a: dict, ct: torch.dtype) -> str:
    if ct == torch.bool:
        raise Unsupported("bool floor division")
    _integer_divisor(a, ct)
    x, y = e.t(a["input"], ct), e.t(a["other"], ct)
    if _is_float(ct):
        x, y = e.tmp(x), e.tmp(y)
        return f"{e.helper('_floordiv_float')}({x}, {y}, {_fmod(e, x, y)})"
    return f"{e.helper('_floordiv_int')}({x}, {y})"


def _remainder(e: Emitter, a: dict, ct: torch.dtype) -> str:
    if ct == torch.bool:
        raise Unsupported("bool remainder")
    _integer_divisor(a, ct)
    x, y = e.t(a["input"], ct), e.t(a["other"], ct)
    if _is_float(ct):
        y = e.tmp(y)
        m = e.tmp(_fmod(e, x, y))
        return f"tl.where(({m} != 0) & (({m} < 0) != ({y} < 0)), {m} + {y}, {m})"
    return f"{e.helper('_remainder_int')}({x}, {y})"


def _fmod_op(e: Emitter, a: dict, ct: torch.dtype) -> str:
    if ct == torch.bool:
        raise Unsupported("bool fmod")
    _integer_divisor(a, ct)
    x, y = e.c(a["input"], ct), e.c(a["other"], ct)
    return _fmod(e, x, y) if _is_float(ct) else f"{x} % {y}"


def _trunc_expr(e: Emitter, x: str) -> str:
    x = e.tmp(x)
    return f"tl.where({x} < 0, tl.ceil({x}), tl.floor({x}))"


def _quot(x: str, y: str, ct: torch.dtype) -> str:
    # Triton's float32 `/` is div.full.f32 on GPUs (up to 2 ulp off), so x / x can give
    # 0.99999994 and trunc or floor of it 0; eager's division rounds correctly.
    return f"tl.div_rn({x}, {y})" if ct == torch.float32 else f"{x} / {y}"


def _quot_by_row(e: Emitter, x: str, y: str) -> str:
    """``x / y`` for a ``y`` constant along a row kernel's reduced dims, as ``x * (1 / y)``.

    One correctly rounded division per row and two multiplies per element, in place of a
    division per element: at most 1.5 ulp from eager's quotient in place of 0.5. Measured
    on an H200 (``benchmarks/sweep_row_configs.py``, bf16 softmax over 2048x16384), 76%
    of copy with a division per element and 90% this way; a branch to a division for
    rows with extreme divisors (instead of the scale below) cost more than it saved (60%).

    A divisor outside [2**-100, 2**100] is first scaled by 2**64 or 2**-64 (exactly: a
    power of 2), so that its reciprocal is neither infinite (a subnormal ``y``) nor
    subnormal (``|y|`` above 2**126, flushed to 0 on GPUs); the product is scaled back
    after, where it only over- or underflows if the quotient does. 0, inf and NaN
    divisors give eager's inf, 0 and NaN.

    Before::

        truediv = tl.div_rn(exp, sum)

    After::

        tmp1 = tl.where(tl.abs(sum) < 7.888609052210118e-31, 1.8446744073709552e+19,
                        tl.where(tl.abs(sum) > 1.2676506002282294e+30, 5.421010862427522e-20, 1.0))
        tmp2 = tl.div_rn(tl.full(sum.shape, 1.0, tl.float32), sum * tmp1)
        truediv = exp * tmp2 * tmp1
    """
    y = y if y.isidentifier() else e.tmp(y)  # (read four times; ``x`` once)
    scale = e.tmp(f"tl.where(tl.abs({y}) < {2.0 ** -100!r}, {2.0 ** 64!r}, "
                  f"tl.where(tl.abs({y}) > {2.0 ** 100!r}, {2.0 ** -64!r}, 1.0))")
    inv = e.tmp(f"tl.div_rn(tl.full({y}.shape, 1.0, tl.float32), {y} * {scale})")
    return f"{x} * {inv} * {scale}"


def _div(e: Emitter, a: dict, ct: torch.dtype) -> str:
    mode = a.get("rounding_mode")
    if mode is None:
        if not _is_float(ct):
            raise Unsupported("true division into an integer dtype")
        if a.get("_by_row") and ct == torch.float32:
            return _quot_by_row(e, e.c(a["input"], ct), e.c(a["other"], ct))
        return _quot(e.c(a["input"], ct), e.c(a["other"], ct), ct)
    if mode == "floor":
        return _floordiv(e, a, ct)
    if mode != "trunc" or ct == torch.bool:
        raise Unsupported(f"rounding_mode={mode!r}")
    _integer_divisor(a, ct)
    x, y = e.c(a["input"], ct), e.c(a["other"], ct)
    if not _is_float(ct):
        return f"{x} // {y}"
    # eager divides in the result's dtype: a half result is trunc(bf16(a / b)), the
    # quotient rounded first; a float32 one (f32 / f16) is not rounded to the half operand
    out = a.get("_out_dtype")
    half = out if out in (torch.float16, torch.bfloat16) else None
    q = _quot(x, y, ct)
    return _trunc_expr(e, e.rounded(q, half) if half is not None else q)


def _sqrt(x: str, ct: torch.dtype) -> str:
    # tl.sqrt is approximate for fp32 on GPUs; sqrt_rn rounds correctly (fp32 only).
    return f"tl.sqrt_rn({x})" if ct == torch.float32 else f"tl.sqrt({x})"


def _pow(e: Emitter, a: dict, ct: torch.dtype) -> str:
    base, exp = a["input"], a["exponent"]
    if ct == torch.bool:
        raise Unsupported("bool pow")
    if not isinstance(exp, Operand):
        if exp == 0.5 and _is_float(ct):
            return _sqrt(e.c(base, ct), ct)
        if exp == -0.5 and _is_float(ct):
            return f"1.0 / {_sqrt(e.c(base, ct), ct)}"
        if float(exp).is_integer() and abs(exp) <= 8 and isinstance(base, Operand):
            n = int(exp)
            if n < 0 and not _is_float(ct):
                raise Unsupported("negative integer power of an integer")
            if n == 0:  # 1 everywhere, NaN and inf included (not 1 + 0 * x)
                return f"tl.full([], {e.lit(1, ct)}, {tl_dtype(ct)}) + tl.zeros_like({e.c(base, ct)})"
            x = e.tmp(e.c(base, ct)) if abs(n) > 1 else e.c(base, ct)
            prod = " * ".join([x] * abs(n))
            return f"1.0 / ({prod})" if n < 0 else prod
    if not _is_float(ct):
        raise Unsupported("integer pow with a tensor or large exponent")
    x, y = e.t(base, ct), e.t(exp, ct)
    if e.libdevice:
        return f"libdevice.pow({x}, {y})"
    return f"{e.helper('_pow')}({x}, {y}).to({tl_dtype(ct)})"


def _unary(fn: str, *, floats_only: bool = True, int_identity: bool = False) -> Emit:
    def emit(e: Emitter, a: dict, ct: torch.dtype) -> str:
        x = e.c(a["input"], ct)
        if not _is_float(ct):
            if int_identity:
                return x
            raise Unsupported(f"{fn} on {ct}")
        return f"{fn}({x})"
    return emit


def _via_helper(helper: str, libdevice_fn: str | None) -> Emit:
    """A float op that needs libdevice on the GPU and a portable helper in the interpreter."""
    def emit(e: Emitter, a: dict, ct: torch.dtype) -> str:
        if not _is_float(ct):
            raise Unsupported(f"{helper} on {ct}")
        x = e.c(a["input"], ct)
        if e.libdevice and libdevice_fn:
            return f"libdevice.{libdevice_fn}({x})"
        return f"{e.helper(helper)}({x}).to({tl_dtype(ct)})"
    return emit


def _rsqrt(e: Emitter, a: dict, ct: torch.dtype) -> str:
    # fp32 on the GPU: one PTX instruction, not libdevice's (source.GPU_HELPERS)
    if not _is_float(ct):
        raise Unsupported(f"rsqrt on {ct}")
    x = e.c(a["input"], ct)
    if e.libdevice and ct == torch.float32:
        return f"{e.helper('_rsqrt_f32')}({x})"
    return f"tl.rsqrt({x})"


def _neg(e: Emitter, a: dict, ct: torch.dtype) -> str:
    if ct == torch.bool:
        raise Unsupported("bool negation")
    return f"-{e.c(a['input'], ct)}"


def _abs(e: Emitter, a: dict, ct: torch.dtype) -> str:
    x = e.c(a["input"], ct)
    return x if ct == torch.bool else f"tl.abs({x})"


def _relu(e: Emitter, a: dict, ct: torch.dtype) -> str:
    if ct == torch.bool:
        raise Unsupported("relu of bool")
    x = e.c(a["input"], ct)
    # `x < 0` is False for NaN, so NaN passes through as in torch.
    return f"tl.where({x} < 0, {e.lit(0, ct)}, {x})"


def _float_op(body: Callable[[Emitter, str, dict, torch.dtype], str]) -> Emit:
    def emit(e: Emitter, a: dict, ct: torch.dtype) -> str:
        if not _is_float(ct):
            raise Unsupported(f"float op on {ct}")
        return body(e, e.c(a["input"], ct), a, ct)
    return emit


def _tanh_of(e: Emitter, x: str, ct: torch.dtype) -> str:
    if e.libdevice:
        return f"libdevice.tanh({x})"
    return f"{e.helper('_tanh')}({x}).to({tl_dtype(ct)})"


def _gelu(e: Emitter, x: str, a: dict, ct: torch.dtype) -> str:
    approx = a.get("approximate", "none")
    if approx == "none":
        # gelu(+inf) = +inf here, as CUDA's eager kernel gives; CPU eager's vectorized
        # loop gives NaN for it (its scalar loop, one element alone, gives +inf): fuzz
        # seeds 8027637, 8036813, 8046723
        return f"0.5 * {x} * (1.0 + tl.erf({x} * {1 / math.sqrt(2)!r}))"
    if approx != "tanh":
        raise Unsupported(f"gelu approximate={approx!r}")
    inner = e.tmp(f"{math.sqrt(2 / math.pi)!r} * ({x} + 0.044715 * {x} * {x} * {x})")
    return f"0.5 * {x} * (1.0 + {_tanh_of(e, inner, ct)})"


def _log1p_of(e: Emitter, x: str, ct: torch.dtype) -> str:
    if e.libdevice:
        return f"libdevice.log1p({x})"
    return f"{e.helper('_log1p')}({x}).to({tl_dtype(ct)})"


def _expm1_of(e: Emitter, x: str, ct: torch.dtype) -> str:
    if e.libdevice:
        return f"libdevice.expm1({x})"
    return f"{e.helper('_expm1')}({x}).to({tl_dtype(ct)})"


def _softplus(e: Emitter, x: str, a: dict, ct: torch.dtype) -> str:
    beta, threshold = a.get("beta", 1.0), a.get("threshold", 20.0)
    bx = e.tmp(f"{x} * {e.lit(beta, ct)}")
    soft = _log1p_of(e, f"tl.exp({bx})", ct)
    return f"tl.where({bx} > {e.lit(threshold, ct)}, {x}, {soft} / {e.lit(beta, ct)})"


def _mish(e: Emitter, x: str, a: dict, ct: torch.dtype) -> str:
    sp = e.tmp(_softplus(e, x, {}, ct))
    return f"{x} * {_tanh_of(e, sp, ct)}"


def _clamp_expr(e: Emitter, x: str, lo: Any, hi: Any, ct: torch.dtype) -> str:
    # torch.clamp is min(max(x, lo), hi), with NaN in any operand propagating.
    if lo is not None:
        x = f"{e.helper('_maximum')}({x}, {e.t(lo, ct)})"
    if hi is not None:
        x = f"{e.helper('_minimum')}({x}, {e.t(hi, ct)})"
    return x


def _clamp(e: Emitter, a: dict, ct: torch.dtype) -> str:
    lo, hi = a.get("min"), a.get("max")
    if ct == torch.bool or (lo is None and hi is None):
        raise Unsupported("clamp without bounds or on bool")
    return _clamp_expr(e, e.t(a["input"], ct), lo, hi, ct)


def _binary_helper(helper: str) -> Emit:
    def emit(e: Emitter, a: dict, ct: torch.dtype) -> str:
        x, y = e.t(a["input"], ct), e.t(a["other"], ct)
        if ct == torch.bool:
            return f"{x} | {y}" if helper == "_maximum" else f"{x} & {y}"
        return f"{e.helper(helper)}({x}, {y})"
    return emit


def _compare(sym: str) -> Emit:
    def emit(e: Emitter, a: dict, ct: torch.dtype) -> str:
        pt = compute_dtype(promote(a["input"], a["other"]))
        return f"{e.c(a['input'], pt)} {sym} {e.c(a['other'], pt)}"
    return emit


def _logical(sym: str) -> Emit:
    def emit(e: Emitter, a: dict, ct: torch.dtype) -> str:
        x, y = e.c(a["input"], torch.bool), e.c(a["other"], torch.bool)
        return e.c(Operand(f"({x} {sym} {y})", torch.bool), ct)
    return emit


def _bitwise(sym: str) -> Emit:
    def emit(e: Emitter, a: dict, ct: torch.dtype) -> str:
        if _is_float(ct):
            raise Unsupported("bitwise op on floats")
        return f"{e.c(a['input'], ct)} {sym} {e.c(a['other'], ct)}"
    return emit


def _operand_ct(a: dict) -> torch.dtype:
    x = a["input"]
    if not isinstance(x, Operand) or x.pytype is not None:
        raise Unsupported("predicate on a scalar")
    return compute_dtype(x.dtype)


def _logical_not(e: Emitter, a: dict, ct: torch.dtype) -> str:
    return e.c(Operand(f"({e.c(a['input'], _operand_ct(a))} == 0)", torch.bool), ct)


def _bitwise_not(e: Emitter, a: dict, ct: torch.dtype) -> str:
    if _is_float(ct):
        raise Unsupported("bitwise not on floats")
    x = e.c(a["input"], ct)
    return f"{x} == 0" if ct == torch.bool else f"~{x}"


def _isnan(e: Emitter, a: dict, ct: torch.dtype) -> str:
    x = e.c(a["input"], _operand_ct(a))
    return f"{x} != {x}"


def _isinf(e: Emitter, a: dict, ct: torch.dtype) -> str:
    it = _operand_ct(a)
    x = e.c(a["input"], it)
    return f'tl.abs({x}) == float("inf")' if _is_float(it) else f"{x} != {x}"


def _isfinite(e: Emitter, a: dict, ct: torch.dtype) -> str:
    it = _operand_ct(a)
    x = e.c(a["input"], it)
    return f'({x} == {x}) & (tl.abs({x}) != float("inf"))' if _is_float(it) else f"{x} == {x}"


def _where(e: Emitter, a: dict, ct: torch.dtype) -> str:
    cond = e.c(a["condition"], torch.bool)
    return f"tl.where({cond}, {e.c(a['input'], ct)}, {e.c(a['other'], ct)})"


def _to(e: Emitter, a: dict, ct: torch.dtype) -> str:
    # ct is the compute dtype of the target; `out_dtype` is the storage dtype (from meta).
    x = a["input"]
    out = a["_out_dtype"]
    src = x.dtype if isinstance(x, Operand) and x.pytype is None else None
    expr = e.c(x, ct)
    if out in (torch.float16, torch.bfloat16) and src != out:
        # An explicit cast to a half type rounds, even though we compute in fp32.
        if out == torch.bfloat16 and not e.libdevice:
            return f"{e.helper('_round_bf16')}({expr})"  # the interpreter truncates
        return f"{expr}.to({tl_dtype(out)}).to(tl.float32)"
    return expr


def _seeded_dropout(e: Emitter, a: dict, ct: torch.dtype) -> str:
    # fxlite.ops.dropout.seeded_dropout: the same Philox stream (tl.rand), per element
    if e.index is None:
        raise Unsupported("seeded_dropout needs the element index of the whole iteration space")
    p = a["p"]
    if isinstance(p, Operand) or not 0 <= p <= 1:
        raise Unsupported("seeded_dropout: p must be a constant in [0, 1]")
    seed, offset = e.c(a["seed"], torch.int64), e.c(a["offset"], torch.int64)
    keep = f"tl.rand({seed}, {offset} + {e.index}) >= {e.lit(p, torch.float32)}"
    scale = 1.0 / (1.0 - p) if p < 1 else 0.0
    return f"tl.where({keep}, {e.c(a['input'], ct)} * {e.lit(scale, ct)}, {e.lit(0, ct)})"


def _sign(e: Emitter, a: dict, ct: torch.dtype) -> str:
    x = e.c(a["input"], ct)
    if ct == torch.bool:
        return x
    one, zero = e.lit(1, ct), e.lit(0, ct)
    # torch computes (0 < x) - (x < 0): NaN gives 0.
    sign = f"tl.where({x} > 0, {one}, tl.where({x} < 0, -{one}, {zero}))"
    # Triton makes the literals int32: an int64 sign stays int64 (an amax of it starts
    # from int64's minimum, which int32 cannot hold: fuzz seed 13215350)
    return sign if _is_float(ct) else f"{sign}.to({tl_dtype(ct)})"


def _round(e: Emitter, a: dict, ct: torch.dtype) -> str:
    if a.get("decimals", 0) != 0:
        raise Unsupported("round with decimals")
    x = e.c(a["input"], ct)
    return f"{e.helper('_round_half_even')}({x})" if _is_float(ct) else x


def _leaky_relu(e: Emitter, x: str, a: dict, ct: torch.dtype) -> str:
    return f"tl.where({x} > 0, {x}, {x} * {e.lit(a.get('negative_slope', 0.01), ct)})"


def _elu(e: Emitter, x: str, a: dict, ct: torch.dtype) -> str:
    alpha = e.lit(a.get("alpha", 1.0), ct)
    return f"tl.where({x} > 0, {x}, {alpha} * {_expm1_of(e, x, ct)})"


def _relu6_of(e: Emitter, x: str, ct: torch.dtype) -> str:
    return _clamp_expr(e, x, 0.0, 6.0, ct)


_F = _float_op
_TANH = _via_helper("_tanh", "tanh")
TRITON_OPS: dict[str, TritonOp] = {
    "add": TritonOp(_add),
    "sub": TritonOp(_sub),
    "rsub": TritonOp(_rsub),
    "mul": TritonOp(_mul),
    "truediv": TritonOp(_div),
    "floordiv": TritonOp(_floordiv),
    "remainder": TritonOp(_remainder),
    "fmod": TritonOp(_fmod_op),
    "pow": TritonOp(_pow),
    "neg": TritonOp(_neg),
    "clone": TritonOp(lambda e, a, ct: e.c(a["input"], ct), ("memory_format",)),
    "abs": TritonOp(_abs),
    "relu": TritonOp(_relu, ("inplace",)),
    "sigmoid": TritonOp(_unary("tl.sigmoid")),
    "tanh": TritonOp(_TANH),
    "exp": TritonOp(_unary("tl.exp")),
    "exp2": TritonOp(_unary("tl.exp2")),
    "log": TritonOp(_unary("tl.log")),
    "log2": TritonOp(_unary("tl.log2")),
    "log1p": TritonOp(_via_helper("_log1p", "log1p")),
    "expm1": TritonOp(_via_helper("_expm1", "expm1")),
    "sqrt": TritonOp(_F(lambda e, x, a, ct: _sqrt(x, ct))),
    "rsqrt": TritonOp(_rsqrt),
    "sin": TritonOp(_unary("tl.sin")),
    "cos": TritonOp(_unary("tl.cos")),
    "erf": TritonOp(_unary("tl.erf")),
    "floor": TritonOp(_unary("tl.floor", int_identity=True)),
    "ceil": TritonOp(_unary("tl.ceil", int_identity=True)),
    "trunc": TritonOp(_F(lambda e, x, a, ct: _trunc_expr(e, x))),
    "round": TritonOp(_round),
    "sign": TritonOp(_sign),
    "reciprocal": TritonOp(_F(lambda e, x, a, ct: _quot("1.0", x, ct))),
    "square": TritonOp(lambda e, a, ct: _pow(e, {**a, "exponent": 2}, ct)),
    "gelu": TritonOp(_F(_gelu)),
    "silu": TritonOp(_F(lambda e, x, a, ct: f"{x} / (1.0 + tl.exp(-{x}))"), ("inplace",)),
    "softplus": TritonOp(_F(_softplus)),
    "mish": TritonOp(_F(_mish), ("inplace",)),
    "leaky_relu": TritonOp(_F(_leaky_relu), ("inplace",)),
    "elu": TritonOp(_F(_elu), ("inplace",)),
    "hardtanh": TritonOp(_F(lambda e, x, a, ct: _clamp_expr(e, x, a["min_val"], a["max_val"], ct)),
                         ("inplace",)),
    "relu6": TritonOp(_F(lambda e, x, a, ct: _relu6_of(e, x, ct)), ("inplace",)),
    "hardsigmoid": TritonOp(_F(lambda e, x, a, ct: f"{_relu6_of(e, f'{x} + 3.0', ct)} / 6.0"),
                            ("inplace",)),
    "hardswish": TritonOp(_F(lambda e, x, a, ct: f"{x} * {_relu6_of(e, f'{x} + 3.0', ct)} / 6.0"),
                          ("inplace",)),
    "clamp": TritonOp(_clamp),
    "clamp_min": TritonOp(_clamp),
    "clamp_max": TritonOp(_clamp),
    "maximum": TritonOp(_binary_helper("_maximum")),
    "minimum": TritonOp(_binary_helper("_minimum")),
    "where": TritonOp(_where),
    "eq": TritonOp(_compare("==")),
    "ne": TritonOp(_compare("!=")),
    "lt": TritonOp(_compare("<")),
    "le": TritonOp(_compare("<=")),
    "gt": TritonOp(_compare(">")),
    "ge": TritonOp(_compare(">=")),
    "logical_and": TritonOp(_logical("&")),
    "logical_or": TritonOp(_logical("|")),
    "logical_xor": TritonOp(_logical("^")),
    "logical_not": TritonOp(_logical_not),
    "bitwise_and": TritonOp(_bitwise("&")),
    "bitwise_or": TritonOp(_bitwise("|")),
    "bitwise_xor": TritonOp(_bitwise("^")),
    "bitwise_not": TritonOp(_bitwise_not),
    "isnan": TritonOp(_isnan),
    "isinf": TritonOp(_isinf),
    "isfinite": TritonOp(_isfinite),
    "to": TritonOp(_to),
    "seeded_dropout": TritonOp(_seeded_dropout),
}

# Reductions: canonical name -> (parameters, defaults). Their code lives in the kernel
# builders, since they shape the kernel rather than one expression.
REDUCTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "sum": (("input", "dim", "keepdim", "dtype"), {"dim": None, "keepdim": False, "dtype": None}),
    "mean": (("input", "dim", "keepdim", "dtype"), {"dim": None, "keepdim": False, "dtype": None}),
    "prod": (("input", "dim", "keepdim", "dtype"), {"dim": None, "keepdim": False, "dtype": None}),
    "amax": (("input", "dim", "keepdim"), {"dim": (), "keepdim": False}),
    "amin": (("input", "dim", "keepdim"), {"dim": (), "keepdim": False}),
    "var": (("input", "dim", "unbiased", "keepdim"),
            {"dim": None, "unbiased": None, "keepdim": False, "correction": None}),
    "std": (("input", "dim", "unbiased", "keepdim"),
            {"dim": None, "unbiased": None, "keepdim": False, "correction": None}),
}
