"""What an op's Triton emitter works with: the :class:`Emitter` (operand casts, fresh
temporaries, helper functions), dtype rules (half types compute in fp32) and the
:class:`Unsupported` error by which a generator refuses a group.

The emitters themselves, one per op, are in ``codegen/kernels/ops.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Emitter", "Operand", "Unsupported", "compute_dtype", "promote", "tl_dtype"]


class Unsupported(Exception):
    """The generator cannot prove a kernel right for this group; the caller runs eager."""


_TL = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
       torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16",
       torch.int32: "tl.int32", torch.int64: "tl.int64", torch.uint8: "tl.uint8",
       torch.bool: "tl.int1"}
_FLOATS = (torch.float32, torch.float64)


def tl_dtype(dtype: torch.dtype) -> str:
    """The ``tl`` spelling of a torch dtype (``torch.float16`` -> ``"tl.float16"``)."""
    try:
        return _TL[dtype]
    except KeyError:
        raise Unsupported(f"dtype {dtype}") from None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype values of ``dtype`` are computed in: fp32 for f16/bf16, else itself."""
    tl_dtype(dtype)
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass(frozen=True)
class Operand:
    """A tensor-valued argument of an op: a kernel variable and its storage dtype.

    ``pytype`` is set for Python scalar kernel arguments (which promote as weak scalars),
    ``zero_dim`` for 0-d tensors (which promote like scalars).
    """

    expr: str
    dtype: torch.dtype | None
    zero_dim: bool = False
    pytype: type | None = None


@dataclass
class Emitter:
    """What an op emitter may use: casts, fresh temporaries and helper functions."""

    libdevice: bool = False
    lines: list[str] = field(default_factory=list)
    helpers: set[str] = field(default_factory=set)
    _counter: int = 0
    # The element's row-major index in the iteration space, for ops that draw random
    # numbers per element; None where the kernel has no such index (or the value does not
    # cover the whole space, see ``source.emit_value``).
    index: str | None = None
    space: frozenset[int] = frozenset()  # the non-trivial dims ``index`` runs over
    # A row kernel's reduced dims: a quotient of a value along them by a value constant
    # along them (softmax's ``exp / sum``) multiplies by the row's reciprocal (ops._div).
    reduced: frozenset[int] = frozenset()

    def tmp(self, expr: str) -> str:
        """Assign ``expr`` to a fresh variable (for an operand used several times)."""
        self._counter += 1
        name = f"tmp{self._counter}"
        self.lines.append(f"{name} = {expr}")
        return name

    def helper(self, name: str) -> str:
        self.helpers.add(name)
        return name

    def rounded(self, expr: str, dtype: torch.dtype, *, kept: bool = False) -> str:
        """``expr`` (fp32) rounded to half type ``dtype``, still as fp32.

        ``kept``: a rounding the GPU must not lose (an in-place write, whose value eager
        stored: a buffer or parameter that drifts from eager's by an ulp a call stays
        apart). Written as a plain round trip, LLVM narrows the ops around it to half ops
        and, with FP fusion on, contracts a product and the sum it feeds into one half
        FMA, which skips the rounding between them (seen in the PTX for
        ``b.mul_(x).add_(0.25)`` of a bfloat16 buffer: ``fma.rn.bf16``). A kept one goes
        through integer ops (bfloat16) or an opaque conversion (float16) instead. Other
        roundings keep the round trip, and with it the FMAs (an ulp, within tolerance).
        """
        if dtype == torch.bfloat16 and (kept or not self.libdevice):
            return f"{self.helper('_round_bf16')}({expr})"
        if kept and self.libdevice:
            return f"{self.helper('_round_f16')}({expr})"
        return f"{expr}.to({tl_dtype(dtype)}).to(tl.float32)"

    def lit(self, value: Any, ct: torch.dtype) -> str:
        """A Python literal formatted for compute dtype ``ct``."""
        if isinstance(value, complex) or not isinstance(value, (bool, int, float)):
            raise Unsupported(f"literal {value!r}")
        if ct == torch.bool:
            return "True" if value else "False"
        if ct.is_floating_point:
            v = float(value)
            if math.isnan(v):
                return 'float("nan")'
            if math.isinf(v):
                return 'float("inf")' if v > 0 else 'float("-inf")'
            if ct == torch.float64 and float(torch.tensor(v, dtype=torch.float32)) != v:
                # Triton makes a Python float a float32 constant: keep float64's digits
                return f"tl.full([], {v!r}, tl.float64)"
            return repr(v)
        if isinstance(value, float) and not value.is_integer():
            raise Unsupported(f"float literal {value} in an integer op")
        info = torch.iinfo(ct)
        if not info.min <= int(value) <= info.max:
            raise Unsupported(f"literal {value} does not fit {ct}")
        return repr(int(value))

    def t(self, x: Any, ct: torch.dtype) -> str:
        """Like :meth:`c`, but a literal becomes a 0-d tensor (helpers call ``.to`` on it)."""
        if isinstance(x, Operand):
            return self.c(x, ct)
        return f"tl.full([], {self.lit(x, ct)}, {tl_dtype(ct)})"

    def c(self, x: Any, ct: torch.dtype) -> str:
        """Operand or literal ``x`` as an expression of compute dtype ``ct``."""
        if not isinstance(x, Operand):
            return self.lit(x, ct)
        if x.pytype is float and ct == torch.float64:
            raise Unsupported("a float argument feeds a float64 op (passed as fp32)")
        have = compute_dtype(x.dtype)
        if have == ct:
            return x.expr
        if ct == torch.bool:
            return f"({x.expr} != 0)"
        return f"{x.expr}.to({tl_dtype(ct)})"


_META_CACHE: dict[Any, Any] = {}


def _proxy(x: Any) -> Any:
    if isinstance(x, Operand):
        if x.pytype is not None:
            return x.pytype(1)
        key = (x.dtype, x.zero_dim)
        t = _META_CACHE.get(key)
        if t is None:
            t = _META_CACHE[key] = torch.empty(() if x.zero_dim else (1,), dtype=x.dtype,
                                               device="meta")
        return t
    return x


def promote(a: Any, b: Any) -> torch.dtype:
    """torch's result dtype for an op on ``a`` and ``b`` (operands or literals)."""
    pa, pb = _proxy(a), _proxy(b)
    if not isinstance(pa, torch.Tensor) and not isinstance(pb, torch.Tensor):
        raise Unsupported("an op on two scalars")
    return torch.result_type(pa, pb)
