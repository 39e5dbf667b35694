"""The statements random programs are made of: at least one for every op-table record.

Each entry of :data:`CATALOG` draws one :class:`~fuzz_programs.Step` through the helper
:class:`G`, which picks operands among the values defined so far (recent ones first) and
scalars. Spellings vary (``x + y``, ``torch.add(x, y)``, ``x.add(y)``), so are operand
kinds (tensor or Python scalar, mixed dtypes: promotion), dims (negative, tuples,
keepdim) and layouts (views of inputs). Every entry names the record it exercises; the
coverage report compares that with the records the captured graphs really hold.

Conventions that keep results comparable (see ``fuzz_programs``): operands of
discontinuous ops are exact (``g.t(exact=True)``); operands of ops that amplify rounding
(``log``, ``sqrt``, ``1 / x``) are used raw only when exact, else as ``x.abs() + 1``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from fuzz_programs import Draw, Skip, State, Step

__all__ = ["CATALOG", "EXCLUDED", "G", "draw_step"]

# Open bugs other work is fixing: the generator steers around each trigger (the ops stay
# in the mix) and a strict xfail in tests/fuzz/test_fuzz_regressions.py shows each one. When
# such a test starts passing, pytest fails it: then delete the entry here.
KNOWN_OPEN = {
    "max_all_nan_grad": "on the CPU, eager's backward of torch.max(x) and torch.min(x) (no "
                        "dim) puts a NaN cotangent on the maxima (minima) only "
                        "(masked_fill); fxlite's rule (as eager on CUDA) multiplies it by "
                        "the mask: NaN everywhere "
                        "(test_max_of_all_elements_with_a_nan_gradient_on_the_cpu)",
}

FLOAT_SCALARS = ["0.5", "2.0", "-1.5", "0.0", "-0.0", "3.0", "1e-3", "float('inf')"]
INT_SCALARS = ["1", "2", "-1", "0", "3", "-3"]


class G:
    """Draws one step's parts: operands, scalars, dims, parameters."""

    def __init__(self, draw: Draw, state: State, index: int) -> None:
        self.d, self.s, self.index = draw, state, index
        self.out = f"v{index}"
        self.reads: list[str] = []
        self.weak: list[str] = []  # reads of only a shape, dtype or device
        self.init: list[str] = []
        self._params = 0

    # ------------------------------------------------------------ operands
    def t(self, exact: bool = False, kind: str = "any", min_dim: int = 0,
          like: str | None = None, same_shape: bool = False, mutable: bool = False) -> str:
        """A tensor value's name. ``kind``: any, float, int (not bool), bool, intlike,
        num (not bool). ``like``: broadcastable with that value (same shape if asked)."""
        cands = []
        for v in self.s.values:
            x = v.sample
            if not isinstance(x, torch.Tensor) or (exact and not v.exact) or x.dim() < min_dim:
                continue
            if not _kind_ok(x.dtype, kind):
                continue
            if like is not None:
                other = self.sample(like).shape
                if same_shape and x.shape != other:
                    continue
                if not _broadcasts(x.shape, other):
                    continue
            if mutable and x.numel() > 1 and 0 in x.stride():
                continue
            cands.append(v.name)
        if not cands:
            raise Skip("no operand")
        if self.d.bool(0.6):
            name = cands[-1 - self.d.int(0, min(2, len(cands) - 1))]
        else:
            name = self.d.choice(cands)
        self.reads.append(name)
        return name

    def ts(self, like: str, exact: bool = False, scalars: str = "auto") -> str:
        """A tensor broadcastable with ``like``, or a Python scalar."""
        if self.d.bool(0.5):
            try:
                return self.t(exact=exact, like=like)
            except Skip:
                pass
        return self.scalar(scalars if scalars != "auto" else _scalar_kind(self.sample(like)))

    def scalar(self, kind: str = "any") -> str:
        if kind == "bool":
            return self.d.choice(["True", "False"])
        if kind == "int" or (kind == "any" and self.d.bool(0.4)):
            return self.d.choice(INT_SCALARS)
        if kind == "pos":
            return self.d.choice(["1", "2", "0.5", "3.0"])
        return self.d.choice(FLOAT_SCALARS)

    def sample(self, name: str) -> torch.Tensor:
        return self.s.get(name).sample

    def exact(self, name: str) -> bool:
        return self.s.get(name).exact

    def nd(self, name: str) -> int:
        return self.sample(name).dim()

    def dim(self, name: str) -> int:
        nd = self.nd(name)
        return self.d.int(-1, 0) if nd == 0 else self.d.int(-nd, nd - 1)

    def keepdim(self) -> str:
        return self.d.choice(["False", "True"])

    def safe(self, name: str, pole: bool = False) -> str:
        """``name`` if exact, else ``(name.abs() + 1)``: ops that amplify rounding. With
        ``pole`` (1 / x, rsqrt: +-inf at +-0), raw only for an input (a computed zero's
        sign is not reliable)."""
        v = self.s.get(name)
        raw = v.exact and (v.input or not pole)
        return name if raw else f"({name}.abs() + 1)"

    def divisor(self, like: str) -> str:
        """A divisor for ``like``: exact (an input, if floating point), and mostly non-zero
        where it is an integer (integer division by zero raises)."""
        if self.d.bool(0.5):
            try:
                b = self.t(exact=True, like=like)
            except Skip:
                return self.d.choice(["2", "-3", "0.5", "-1.5", "0.0"])
            if not self.sample(b).is_floating_point():  # zeros: eager raises, so must we
                return b if self.d.bool(0.3) else f"({b}.abs() + 1)"
            return self.safe(b, pole=True)
        return self.d.choice(["2", "-3", "0.5", "-1.5", "0.0"])

    def param(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> str:
        """A new buffer of the module (a weight), deterministic: ``self.p<step>_<k>``."""
        name = f"p{self.index}_{self._params}"
        self._params += 1
        key = 100 * self.index + self._params
        self.init.append(f"self.register_buffer('{name}', torch.randn({tuple(shape)!r}, "
                         f"generator=torch.Generator().manual_seed({key})).to({dtype}))")
        return f"self.{name}"

    def choice(self, seq: Any) -> Any:
        return self.d.choice(seq)

    # ------------------------------------------------------------ steps
    def _read(self, code: str) -> tuple[str, ...]:
        """The operands drawn that ``code`` uses (a draw may fall back to a literal)."""
        return tuple(n for n in self.reads if re.search(rf"\b{re.escape(n)}\b", code))

    def expr(self, record: str, code: str, rule: str = "exact", alias: bool = False,
             **kw: Any) -> Step:
        return Step([f"{self.out} = {code}"], record, self._read(code), out=self.out,
                    rule=rule, alias=alias, init=self.init, weak=tuple(self.weak), **kw)

    def stmt(self, record: str, code: str | list[str], writes: str | None,
             rule: str = "exact", **kw: Any) -> Step:
        lines = [code] if isinstance(code, str) else code
        return Step(lines, record, self._read("\n".join(lines)), writes=writes, rule=rule,
                    init=self.init, weak=tuple(self.weak), **kw)


def _kind_ok(dtype: torch.dtype, kind: str) -> bool:
    fl, b = dtype.is_floating_point, dtype == torch.bool
    return {"any": True, "float": fl, "int": not fl and not b, "bool": b,
            "intlike": not fl, "num": not b}[kind]


def _scalar_kind(x: torch.Tensor) -> str:
    if x.dtype == torch.bool:
        return "bool"
    return "any"


def _broadcasts(a: torch.Size, b: torch.Size) -> bool:
    for x, y in zip(reversed(a), reversed(b)):
        if x != y and x != 1 and y != 1:
            return False
    return True


# ---------------------------------------------------------------------- pointwise
# (record, rule, spellings, operand mode): mode "any" takes any operand, "exact" an exact
# one (discontinuous ops), "safe" an exact one or |x| + 1 (ops that amplify rounding),
# "pole" an exact input or |x| + 1 (ops with a pole at zero, whose sign matters).
UNARY = [
    ("neg", "exact", ["-{a}", "torch.neg({a})", "{a}.neg()", "torch.negative({a})"], "any"),
    ("detach", "exact", ["{a}.detach()", "torch.detach({a})"], "any"),
    ("clone", "exact", ["{a}.clone()", "torch.clone({a})"], "any"),
    ("abs", "exact", ["torch.abs({a})", "{a}.abs()", "abs({a})"], "any"),
    ("relu", "exact", ["torch.relu({a})", "F.relu({a})", "{a}.relu()"], "any"),
    ("gelu", "inexact", ["F.gelu({a})", "F.gelu({a}, approximate='tanh')"], "any"),
    ("silu", "inexact", ["F.silu({a})"], "any"),
    ("sigmoid", "inexact", ["torch.sigmoid({a})", "{a}.sigmoid()", "torch.special.expit({a})"],
     "any"),
    ("tanh", "inexact", ["torch.tanh({a})", "{a}.tanh()", "F.tanh({a})"], "any"),
    ("exp", "inexact", ["torch.exp({a})", "{a}.exp()"], "any"),
    ("log", "inexact", ["torch.log({a})", "{a}.log()"], "safe"),
    ("sqrt", "inexact", ["torch.sqrt({a})", "{a}.sqrt()"], "safe"),
    ("rsqrt", "inexact", ["torch.rsqrt({a})", "{a}.rsqrt()"], "pole"),
    ("exp2", "inexact", ["torch.exp2({a})", "torch.special.exp2({a})"], "any"),
    ("log1p", "inexact", ["torch.log1p({a})", "{a}.log1p()"], "safe"),
    ("log2", "inexact", ["torch.log2({a})", "{a}.log2()"], "safe"),
    ("sin", "inexact", ["torch.sin({a})", "{a}.sin()"], "any"),
    ("cos", "inexact", ["torch.cos({a})", "{a}.cos()"], "any"),
    ("erf", "inexact", ["torch.erf({a})", "torch.special.erf({a})"], "any"),
    ("reciprocal", "inexact", ["torch.reciprocal({a})", "{a}.reciprocal()"], "pole"),
    ("expm1", "inexact", ["torch.expm1({a})", "torch.special.expm1({a})"], "any"),
    ("square", "arith", ["torch.square({a})", "{a}.square()"], "any"),
    ("isnan", "exact", ["torch.isnan({a})", "{a}.isnan()"], "exact"),
    ("isinf", "exact", ["torch.isinf({a})", "{a}.isinf()"], "exact"),
    ("isfinite", "exact", ["torch.isfinite({a})", "{a}.isfinite()"], "exact"),
    ("floor", "exact", ["torch.floor({a})", "{a}.floor()"], "exact"),
    ("ceil", "exact", ["torch.ceil({a})", "{a}.ceil()"], "exact"),
    ("trunc", "exact", ["torch.trunc({a})", "{a}.trunc()"], "exact"),
    ("sign", "exact", ["torch.sign({a})", "{a}.sign()"], "exact"),
    ("round", "exact", ["torch.round({a})", "{a}.round()"], "exact"),
    ("softplus", "inexact", ["F.softplus({a})", "F.softplus({a}, beta=2.0, threshold=5.0)"],
     "any"),
    ("mish", "inexact", ["F.mish({a})"], "any"),
    ("relu6", "exact", ["F.relu6({a})"], "any"),
    ("hardsigmoid", "inexact", ["F.hardsigmoid({a})"], "any"),
    ("hardswish", "inexact", ["F.hardswish({a})"], "any"),
    ("leaky_relu", "inexact", ["F.leaky_relu({a})", "F.leaky_relu({a}, 0.2)"], "any"),
    ("elu", "inexact", ["F.elu({a})", "F.elu({a}, alpha=0.5)"], "any"),
    ("hardtanh", "exact", ["F.hardtanh({a})", "F.hardtanh({a}, -0.5, 2.0)"], "any"),
    ("logical_not", "exact", ["torch.logical_not({a})", "{a}.logical_not()"], "exact"),
    ("bitwise_not", "exact", ["torch.bitwise_not({a})", "~{a}"], "exact"),
]

# (record, rule, spellings, mode, second operand): second is "ts" (tensor or scalar),
# "t" (tensor), "div" (a divisor), "int" (a small exact integer tensor or scalar).
BINARY = [
    ("add", "arith", ["{a} + {b}", "torch.add({a}, {b})", "{a}.add({b})", "{b} + {a}",
                      "torch.add({a}, {b}, alpha=2)"], "any", "ts"),
    ("sub", "arith", ["{a} - {b}", "torch.sub({a}, {b})", "{a}.subtract({b})"], "any", "ts"),
    ("rsub", "arith", ["torch.rsub({a}, {b})", "2 - {a}"], "any", "ts"),
    ("mul", "arith", ["{a} * {b}", "torch.mul({a}, {b})", "{a}.multiply({b})"], "any", "ts"),
    ("truediv", "inexact", ["{a} / {b}", "torch.div({a}, {b})", "{a}.true_divide({b})"],
     "any", "div"),
    ("truediv", "exact", ["torch.div({a}, {b}, rounding_mode='trunc')",
                          "{a}.div({b}, rounding_mode='floor')"], "exact", "div"),
    ("floordiv", "arith", ["{a} // {b}", "torch.floor_divide({a}, {b})"], "exact", "div"),
    ("remainder", "arith", ["{a} % {b}", "torch.remainder({a}, {b})"], "exact", "div"),
    ("fmod", "arith", ["torch.fmod({a}, {b})", "{a}.fmod({b})"], "exact", "div"),
    ("pow", "arith", ["{a} ** {b}", "torch.pow({a}, {b})", "{a}.pow({b})"], "any", "exp"),
    ("maximum", "exact", ["torch.maximum({a}, {b})", "torch.max({a}, {b})"], "any", "t"),
    ("minimum", "exact", ["torch.minimum({a}, {b})", "torch.min({a}, {b})"], "any", "t"),
    ("eq", "exact", ["{a} == {b}", "torch.eq({a}, {b})"], "exact", "ts"),
    ("ne", "exact", ["{a} != {b}", "torch.ne({a}, {b})", "{a}.not_equal({b})"], "exact", "ts"),
    ("lt", "exact", ["{a} < {b}", "torch.lt({a}, {b})", "torch.less({a}, {b})"], "exact", "ts"),
    ("le", "exact", ["{a} <= {b}", "{a}.le({b})"], "exact", "ts"),
    ("gt", "exact", ["{a} > {b}", "torch.gt({a}, {b})", "{b} < {a}"], "exact", "ts"),
    ("ge", "exact", ["{a} >= {b}", "torch.greater_equal({a}, {b})"], "exact", "ts"),
    ("logical_and", "exact", ["torch.logical_and({a}, {b})"], "exact", "t"),
    ("logical_or", "exact", ["torch.logical_or({a}, {b})", "{a}.logical_or({b})"], "exact",
     "t"),
    ("logical_xor", "exact", ["torch.logical_xor({a}, {b})"], "exact", "t"),
    ("bitwise_and", "exact", ["{a} & {b}", "torch.bitwise_and({a}, {b})"], "exact", "int"),
    ("bitwise_or", "exact", ["{a} | {b}", "torch.bitwise_or({a}, {b})"], "exact", "int"),
    ("bitwise_xor", "exact", ["{a} ^ {b}", "torch.bitwise_xor({a}, {b})"], "exact", "int"),
    ("bitwise_left_shift", "exact", ["{a} << {b}", "torch.bitwise_left_shift({a}, {b})"],
     "exact", "shift"),
    ("bitwise_right_shift", "exact", ["{a} >> {b}", "torch.bitwise_right_shift({a}, {b})"],
     "exact", "shift"),
]

EXPONENTS = ["2", "3", "1", "0.5", "-1", "2.5", "-2", "0"]


def _operand(g: G, mode: str, kind: str = "any", **kw: Any) -> str:
    a = g.t(exact=(mode == "exact"), kind=kind, **kw)
    if mode in ("safe", "pole"):
        return g.safe(a, pole=mode == "pole")
    return a


def _second(g: G, a: str, how: str, exact: bool) -> str:
    if how == "t":
        return g.t(exact=exact, like=a)
    if how == "div":
        return g.divisor(a)
    if how == "int":
        if g.d.bool(0.5):
            return g.t(exact=True, kind="intlike", like=a)
        return g.choice(["1", "3", "True", "-2"])
    if how == "shift":
        if g.d.bool(0.5):
            return f"({g.t(exact=True, kind='int', like=a)}.abs() % 8)"
        return g.choice(["0", "1", "3"])
    if how == "exp":
        if g.d.bool(0.3):
            return f"{g.t(exact=True, like=a)}.abs().clamp(max=3)"
        e = g.choice(EXPONENTS)
        if e.startswith("-") and g.safe(a, pole=True) != a:
            raise Skip("a negative power of a computed value")  # +-0 ** -1 is +-inf
        return e
    return g.ts(a, exact=exact)


def unary(g: G) -> Step:
    record, rule, forms, mode = g.choice(UNARY)
    a = _operand(g, mode)
    return g.expr(record, g.choice(forms).format(a=a), rule)


def binary(g: G) -> Step:
    record, rule, forms, mode, how = g.choice(BINARY)
    a = _operand(g, mode)
    b = _second(g, a, how, exact=(mode == "exact"))
    return g.expr(record, g.choice(forms).format(a=a, b=b), rule)


def where(g: G) -> Step:
    """torch.where / Tensor.where with tensors and scalars of mixed dtypes."""
    c = _condition(g)
    a = g.ts(c)
    b = g.ts(c)
    if g.d.bool(0.2) and a in g.reads:
        return g.expr("Tensor.where", f"{a}.where({c}, {b})")
    return g.expr("where", f"torch.where({c}, {a}, {b})")


def soft_where(g: G) -> Step:
    """A comparison on an inexact value, used where it is continuous (leaky relu)."""
    a = g.t(kind="float")
    return g.expr("where", f"torch.where({a} > 0, {a}, {a} * 0.1)", "inexact")


def _condition(g: G) -> str:
    if g.d.bool(0.5):
        try:
            return g.t(exact=True, kind="bool")
        except Skip:
            pass
    e = g.t(exact=True)
    return f"({e} {g.choice(['>', '<=', '!=', '=='])} {g.scalar(_scalar_kind(g.sample(e)))})"


def clamp(g: G) -> Step:
    a = g.t()
    lo, hi = g.scalar("any"), g.scalar("any")
    form = g.d.int(0, 6)
    if form == 0:
        return g.expr("clamp", f"torch.clamp({a}, min={lo}, max={hi})")
    if form == 1:
        return g.expr("clamp", f"{a}.clamp({lo})")
    if form == 2:
        return g.expr("clamp", f"{a}.clip(max={hi})")
    if form == 3:
        b = g.t(like=a)
        return g.expr("clamp", f"torch.clamp({a}, {b})")
    if form == 4:
        return g.expr("clamp_min", f"torch.clamp_min({a}, {lo})")
    if form == 5:
        return g.expr("clamp_max", f"{a}.clamp_max({hi})")
    b, c = g.t(like=a), g.t(like=a)
    return g.expr("clamp", f"torch.clamp({a}, {b}, {c})")


# ---------------------------------------------------------------------- casts
CASTS = [("Tensor.float", ".float()", "f"), ("Tensor.half", ".half()", "f"),
         ("Tensor.double", ".double()", "f"), ("Tensor.bfloat16", ".bfloat16()", "f"),
         ("Tensor.int", ".int()", "i"), ("Tensor.long", ".long()", "i"),
         ("Tensor.short", ".short()", "i"), ("Tensor.char", ".char()", "i"),
         ("Tensor.byte", ".byte()", "u"), ("Tensor.bool", ".bool()", "f"),
         ("to", ".to(torch.float16)", "f"), ("to", ".to(dtype=torch.int32)", "i"),
         ("to", ".to(torch.bfloat16)", "f"), ("type", ".type(torch.float16)", "f"),
         ("type", ".type(torch.int64)", "i")]


def cast(g: G) -> Step:
    record, form, target = g.choice(CASTS)
    a = g.t(exact=target != "f")
    if target != "f" and g.sample(a).is_floating_point():
        # float -> integer is undefined for NaN, infinities and out-of-range values
        lo = "0" if target == "u" else "-100"
        a = f"torch.where({a}.isfinite(), {a}, 0).clamp({lo}, 100)"
    elif target == "u":
        a = f"{a}.clamp(min=0)" if not g.sample(a).dtype == torch.bool else a
    return g.expr(record, f"{a}{form}")


def to_other(g: G) -> Step:
    a = g.t()
    form = g.d.int(0, 2)
    if form == 0:
        b = g.t(exact=not g.sample(a).is_floating_point())
        if not g.sample(b).is_floating_point() and g.sample(a).is_floating_point():
            raise Skip("float to integer")
        if b != a:  # a.to(a) reads a's values: then a is no weak read
            g.weak.append(b)  # only its dtype and device count: the compiler may drop b
        return g.expr("to_other", f"{a}.to({b})")
    if form == 1:
        return g.expr("to_other", f"{a}.to({a}.device, torch.float32)")
    return g.expr("to_other", f"{a}.to(copy=True)")


# ---------------------------------------------------------------------- registry
CATALOG: list[tuple[int, Callable[[G], Step]]] = [
    (14, unary), (16, binary), (3, where), (1, soft_where), (3, clamp), (3, cast),
    (1, to_other),
]

# Records no program can reach, and why (the coverage report lists them apart).
EXCLUDED = {
    "_operator.delitem": "del t[i] is not defined for tensors",
    "_operator.imatmul": "tensors have no in-place matmul: a @= b runs (and traces) as "
                         "a = a @ b",
    "seeded_dropout": "made by the compiler (seed_dropouts) when autograd is on, not by users",
    "draw_seed": "made by the compiler (seed_dropouts) when autograd is on, not by users",
}


def draw_step(g: G) -> Step | None:
    """One step from :data:`CATALOG`, weighted."""
    from fuzz_catalog_more import MORE  # reductions, views, externs, effects, control flow

    table = CATALOG + MORE
    total = sum(w for w, _ in table)
    pick = g.d.int(0, total - 1)
    for w, fn in table:
        if pick < w:
            return fn(g)
        pick -= w
    return None


def aiming_at(record: str, attempts: int = 1000) -> Any:
    """A ``make_step`` whose first step exercises ``record`` (drawn until one does; the
    rest are drawn as usual): programs that cover a given record."""

    def make_step(g: G) -> Step | None:
        if g.index > 0:  # the first step is in: it is the record's
            return draw_step(g)
        for _ in range(attempts):
            trial = G(g.d, g.s, g.index)
            try:
                step = draw_step(trial)
            except Skip:
                continue
            if step is not None and step.record == record:
                return step
        return None

    return make_step
