"""The op table's records: one per op, each complete where it is written.

``fxlite/ops/table.py`` holds the mechanism (:class:`~fxlite.ops.OpInfo`, ``register``,
``lookup``, ``canonical_args``, ``call_args``, ``result_dtype``); this module registers
every record, and ``fxlite/ops/__init__.py`` imports it, so ``fxlite.ops.OPS`` always
holds every record with its kind, spellings, parameters and dtype rule. Read a record as::

    _op("maximum", "pointwise", torch.maximum, (T.maximum,), ("maximum",),
        params=_BINARY, positional=2, swapped="maximum", dtype_rule="promote")

``swapped`` names the op with ``input`` and ``other`` exchanged, so that ``1 + x``
normalizes to ``torch.add(x, 1)`` and ``1 - x`` to ``torch.rsub(x, 1)``. ``refine`` maps a
spelling that really means another op onto it (``torch.max(a, b)`` is ``maximum``,
``x.half()`` is ``to(x, torch.float16)``, eval-mode ``nn.Dropout`` is ``identity``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fxlite.node import Node
from fxlite.ops.dropout import draw_seed, seeded_dropout
from fxlite.ops.table import (
    OpInfo,
    attribute_at,
    dtype_of,
    lookup,
    promote,
    register,
)

__all__ = ["amax_or_empty", "draws_by_layout", "has_side_effect", "is_impure"]

T = torch.Tensor
# aten overloads are spellings too (AOTAutograd's graphs, ``backend="fxlite_aot"``): only
# those whose schema lists the record's parameters in its order, so the arguments map.
A = torch.ops.aten
_UNARY = ("input",)
_BINARY = ("input", "other")
_ALPHA = ("alpha", 1)
_INPLACE = (("inplace", False),)


def _op(name: str, kind: str, torch_fn: Any, functions: tuple = (), methods: tuple = (),
        **fields: Any) -> OpInfo:
    fns = tuple(dict.fromkeys(f for f in (torch_fn, *functions) if f is not None))
    return register(OpInfo(name, kind, torch_fn, functions=fns, methods=methods, **fields))


def _input_dtype(args: dict[str, Any]) -> Any:
    return dtype_of(args.get("input"))


def _sum_dtype(args: dict[str, Any]) -> Any:
    # sum and prod accumulate ints and bools in int64.
    d = _input_dtype(args)
    return torch.int64 if d is not None and not (d.is_floating_point or d.is_complex) else d


def _float_rule(args: dict[str, Any]) -> Any:
    d = promote([args.get("input"), args.get("other")])
    return torch.get_default_dtype() if d is not None and not d.is_floating_point else d


# ---------------------------------------------------------------------- side effects
_RANDOM_FUNCTIONS = (
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.randperm, torch.bernoulli, torch.multinomial, torch.normal,
    torch.poisson, torch.dropout, torch.alpha_dropout, torch.feature_dropout,
    F.rrelu, F.gumbel_softmax,
)  # F.dropout and nn.Dropout (random only in training mode) are records below
_EFFECT_FUNCTIONS = (
    operator.setitem, operator.delitem, print, torch._assert, torch.manual_seed,
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift,
)
_RANDOM_METHODS = ("bernoulli", "multinomial")
_RANDOM_MODULES = (torch.nn.RReLU,)

for _f in _RANDOM_FUNCTIONS + _EFFECT_FUNCTIONS:
    register(OpInfo(f"{getattr(_f, '__module__', '') or ''}.{_f.__name__}", "effect", _f,
                    functions=(_f,), impure=True))
for _m in _RANDOM_METHODS:
    register(OpInfo(f"Tensor.{_m}", "effect", getattr(torch.Tensor, _m), methods=(_m,), impure=True))
for _t in _RANDOM_MODULES:
    register(OpInfo(f"nn.{_t.__name__}", "effect", None, modules=(_t,), impure=True))


def _is_random(info: OpInfo) -> bool:
    return any(f in _RANDOM_FUNCTIONS for f in info.functions) or any(
        m in _RANDOM_METHODS for m in info.methods) or any(t in _RANDOM_MODULES for t in info.modules)


# the dropouts, functional and module: random in training mode, recorded below
_DROPOUT_OPS = ((F.dropout, nn.Dropout), (F.dropout1d, nn.Dropout1d),
                (F.dropout2d, nn.Dropout2d), (F.dropout3d, nn.Dropout3d),
                (F.alpha_dropout, nn.AlphaDropout),
                (F.feature_alpha_dropout, nn.FeatureAlphaDropout))
_DROPOUTS = frozenset(fn.__name__ for fn, _ in _DROPOUT_OPS)
# in-place fills of a tensor with random numbers (Tensor methods)
_RANDOM_FILLS = frozenset({"uniform_", "normal_", "bernoulli_", "exponential_", "random_",
                           "geometric_", "log_normal_", "cauchy_"})


def draws_by_layout(node: Node, module: torch.nn.Module | None = None) -> bool:
    """Whether ``node`` draws random numbers into a tensor shaped like one it reads, whose
    values then follow that tensor's memory order: ``torch.rand_like`` of a channels-last
    value fills it in channels-last order, so element ``(n, c, h, w)`` gets another number
    than eager's in its NCHW value. Training-mode dropout (``p > 0``), the random records
    of the table and in-place random fills count; an eval-mode or ``p=0`` dropout is the
    identity (its record refines to ``identity``).

    Example::

        draws_by_layout(rand_like_node)   # True
        draws_by_layout(relu_node)        # False
    """
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.op == "call_method" and node.target in _RANDOM_FILLS:
        return True
    info = lookup(node, module)
    if info is None or info.kind != "effect":
        return False
    return info.name in _DROPOUTS or _is_random(info)


def has_side_effect(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as having a side effect, so dead-code elimination keeps its calls.

    Use it as a decorator, with or after :func:`fxlite.wrap`; it returns ``fn``.

    Example::

        @fxlite.has_side_effect
        @fxlite.wrap
        def log(x):
            print(x)
    """
    name = f"{getattr(fn, '__module__', '') or ''}.{getattr(fn, '__qualname__', repr(fn))}"
    register(OpInfo(name, "effect", fn, functions=(fn,), impure=True))
    return fn


def _mutates(target: Any) -> bool:
    # torch.ops overloads say in their schema whether they write to an argument.
    schema = getattr(target, "_schema", None)
    if schema is None and isinstance(target, torch._ops.OpOverloadPacket):
        schemas = [getattr(target, o)._schema for o in target.overloads()]
        return any(s.is_mutable for s in schemas)
    return bool(schema is not None and schema.is_mutable)


def is_impure(node: Node, module: torch.nn.Module | None = None, impure_random: bool = True) -> bool:
    """True if removing ``node`` could change behaviour even when its result is unused.

    That covers placeholders and outputs, in-place ops (``add_``, ``operator.iadd``,
    ``out=``), random ops (which advance the generator) and side effects (``print``,
    ``setitem``, ``torch._assert``), and modules marked ``_is_impure``.
    """
    if node.op in ("placeholder", "output"):
        return True
    if node.meta.get("impure"):  # the capture saw it write, draw random numbers, or act
        return True
    if node.kwargs.get("out") is not None or node.kwargs.get("inplace") is True:
        return True
    info = lookup(node, module)
    if info is not None:  # the table knows (operator.and_ is no in-place op despite its "_")
        if info.impure and not impure_random and info.kind == "effect" and _is_random(info):
            return False
        return info.impure
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            qualified = getattr(node.target, "_qualified_op_name", None) or node.target.name()
            return _mutates(node.target) or qualified.startswith("profiler::")
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__") or getattr(node.target, "_is_impure", False)
    if node.op == "call_module" and module is not None:
        return bool(getattr(attribute_at(module, node.target), "_is_impure", False))
    return False


# ---------------------------------------------------------------------- spellings
# One record per op, listing every spelling that computes it. The rewriter matches a
# pattern's `x + y` against `torch.add(x, y)` and `x.add(y)` through these records.

# x + y, torch.add(x, y), x.add(y), torch.Tensor.add(x, y)
_op("add", "pointwise", torch.add, (operator.add, T.add, A.add.Tensor, A.add.Scalar), ("add",),
    params=(*_BINARY, "alpha"), defaults=(_ALPHA,), swapped="add", positional=2,
    dtype_rule="promote")
_op("sub", "pointwise", torch.sub,
    (operator.sub, torch.subtract, T.sub, T.subtract, A.sub.Tensor, A.sub.Scalar),
    ("sub", "subtract"), params=(*_BINARY, "alpha"), defaults=(_ALPHA,), swapped="rsub",
    positional=2, dtype_rule="promote")
_op("mul", "pointwise", torch.mul,
    (operator.mul, torch.multiply, T.mul, T.multiply, A.mul.Tensor, A.mul.Scalar),
    ("mul", "multiply"), params=_BINARY, swapped="mul", positional=2, dtype_rule="promote")
_op("truediv", "pointwise", torch.div,
    (operator.truediv, torch.divide, torch.true_divide, T.div, T.divide, T.true_divide,
     A.div.Tensor, A.div.Scalar),
    ("div", "divide", "true_divide"), params=(*_BINARY, "rounding_mode"),
    defaults=(("rounding_mode", None),), positional=2,
    dtype_rule=lambda a: promote([a.get("input"), a.get("other")])
    if a.get("rounding_mode") is not None else _float_rule(a))
_op("floordiv", "pointwise", torch.floor_divide, (operator.floordiv, T.floor_divide),
    ("floor_divide",), params=_BINARY, positional=2, dtype_rule="promote")
_op("pow", "pointwise", torch.pow, (operator.pow, T.pow, A.pow.Tensor_Scalar, A.pow.Tensor_Tensor),
    ("pow",), params=("input", "exponent"),
    positional=2, dtype_rule="promote")
_op("matmul", "extern", torch.matmul,
    (operator.matmul, T.matmul, torch.mm, torch.bmm, T.mm, T.bmm), ("matmul", "mm", "bmm"),
    params=_BINARY, dtype_rule="promote")
_op("neg", "pointwise", torch.neg,
    (operator.neg, torch.negative, T.neg, T.negative, A.neg.default),
    ("neg", "negative"), params=_UNARY, dtype_rule="same")
_op("abs", "pointwise", torch.abs,
    (operator.abs, torch.absolute, T.abs, T.absolute, A.abs.default),
    ("abs", "absolute"), params=_UNARY, dtype_rule="same")
_op("clamp", "pointwise", torch.clamp, (torch.clip, T.clamp, T.clip), ("clamp", "clip"),
    params=("input", "min", "max"), defaults=(("min", None), ("max", None)),
    dtype_rule="promote")

# relu(x): torch.relu, F.relu, x.relu(), nn.ReLU(). F.gelu's approximate is keyword-only.
_op("relu", "pointwise", torch.relu, (F.relu, T.relu, A.relu.default), ("relu",),
    modules=(nn.ReLU,),
    params=("input", "inplace"), defaults=_INPLACE,
    module_kwargs=lambda m: {"inplace": m.inplace}, dtype_rule="same")
_op("gelu", "pointwise", F.gelu, (A.gelu.default,), (), modules=(nn.GELU,),
    params=("input", "approximate"), defaults=(("approximate", "none"),),
    module_kwargs=lambda m: {"approximate": m.approximate}, positional=1, dtype_rule="same")
_op("silu", "pointwise", F.silu, (A.silu.default,), (), modules=(nn.SiLU,),
    params=("input", "inplace"), defaults=_INPLACE,
    module_kwargs=lambda m: {"inplace": m.inplace}, dtype_rule="same")
_op("sigmoid", "pointwise", torch.sigmoid,
    (F.sigmoid, torch.special.expit, T.sigmoid, A.sigmoid.default),
    ("sigmoid",), modules=(nn.Sigmoid,), params=_UNARY, module_kwargs=lambda m: {},
    dtype_rule="float")
_op("tanh", "pointwise", torch.tanh, (F.tanh, T.tanh, A.tanh.default), ("tanh",),
    modules=(nn.Tanh,),
    params=_UNARY, module_kwargs=lambda m: {}, dtype_rule="float")
for _name in ("exp", "log", "sqrt", "rsqrt"):
    _op(_name, "pointwise", getattr(torch, _name),
        (getattr(T, _name), getattr(A, _name).default), (_name,),
        params=_UNARY, dtype_rule="float")

# Row-wise reductions. F.softmax's `_stacklevel` only affects a warning. nn.Softmax()
# without a dim picks one from the rank (deprecated): no canonical call.
_SOFTMAX_DEFAULTS = (("_stacklevel", 3), ("dtype", None))
_IMPLICIT_DIM = lambda a: ("softmax_implicit_dim", a) if a.get("dim") is None else None
_op("softmax", "composite", torch.softmax, (F.softmax, torch.special.softmax, T.softmax),
    ("softmax",), modules=(nn.Softmax,), params=("input", "dim"),
    defaults=_SOFTMAX_DEFAULTS, module_kwargs=lambda m: {"dim": m.dim}, positional=1,
    dtype_rule="same", refine=_IMPLICIT_DIM)
_op("log_softmax", "composite", torch.log_softmax,
    (F.log_softmax, torch.special.log_softmax, T.log_softmax), ("log_softmax",),
    modules=(nn.LogSoftmax,), params=("input", "dim"), defaults=_SOFTMAX_DEFAULTS,
    module_kwargs=lambda m: {"dim": m.dim}, positional=1, dtype_rule="same",
    refine=_IMPLICIT_DIM)
_op("layer_norm", "composite", F.layer_norm, (torch.layer_norm,), (),
    modules=(nn.LayerNorm,), params=("input", "normalized_shape", "weight", "bias", "eps"),
    defaults=(("weight", None), ("bias", None), ("eps", 1e-5)), dtype_rule="same",
    module_params=lambda m: {"normalized_shape": tuple(m.normalized_shape),
                             "weight": m.weight, "bias": m.bias, "eps": m.eps})
_op("linear", "extern", F.linear, (), (), modules=(nn.Linear,),
    params=("input", "weight", "bias"), defaults=(("bias", None),), dtype_rule="promote",
    module_params=lambda m: {"weight": m.weight, "bias": m.bias})
_op("addmm", "extern", torch.addmm, (), ("addmm",),
    params=("input", "mat1", "mat2", "beta", "alpha"), defaults=(("beta", 1), ("alpha", 1)),
    positional=3,
    dtype_rule="promote")
_op("cat", "extern", torch.cat, (torch.concat, torch.concatenate), (),
    params=("tensors", "dim"), defaults=(("dim", 0),), dtype_rule="promote")
_op("stack", "extern", torch.stack, (), (), params=("tensors", "dim"), defaults=(("dim", 0),),
    dtype_rule="promote")
# Canonical reductions pass their dims by keyword: torch.sum(x, dim=1, keepdim=True).
_REDUCE_DEFAULTS = (("dim", None), ("keepdim", False), ("dtype", None))
_op("sum", "reduction", torch.sum, (T.sum, A.sum.dim_IntList), ("sum",),
    params=("input", "dim", "keepdim"),
    defaults=_REDUCE_DEFAULTS, positional=1, dtype_rule=_sum_dtype)
_op("mean", "reduction", torch.mean, (T.mean, A.mean.dim), ("mean",),
    params=("input", "dim", "keepdim"),
    defaults=_REDUCE_DEFAULTS, positional=1, dtype_rule="same")


def amax_or_empty(input: torch.Tensor, dim: Any = (), keepdim: bool = False) -> torch.Tensor:
    """``torch.amax``, except that reducing an empty dim gives zeros of the result's shape
    where amax raises. It is softmax's row max (``decompose``): softmax over an empty dim
    is empty, so nothing reads those zeros."""
    dims = range(input.dim()) if dim in ((), []) else [dim] if isinstance(dim, int) else dim
    if input.numel() == 0 and any(input.size(d) == 0 for d in dims):
        sizes = [1 if any(d % input.dim() == i for d in dims) and n == 0 else n
                 for i, n in enumerate(input.shape)]
        return torch.amax(input.new_zeros(sizes), dim, keepdim)
    return torch.amax(input, dim, keepdim)


_op("amax", "reduction", torch.amax, (T.amax, amax_or_empty, A.amax.default), ("amax",),
    params=("input", "dim", "keepdim"), defaults=(("dim", ()), ("keepdim", False)),
    positional=1, dtype_rule="same")

# Views. `x.view(2, 3)` and `x.view((2, 3))` are one call (varargs).
_op("transpose", "view", torch.transpose,
    (torch.swapaxes, torch.swapdims, T.transpose, T.swapaxes, T.swapdims),
    ("transpose", "swapaxes", "swapdims"), params=("input", "dim0", "dim1"), dtype_rule="same")
_op("permute", "view", torch.permute, (T.permute, A.permute.default), ("permute",),
    params=("input", "dims"),
    varargs=True, dtype_rule="same")
_op("view", "view", T.view, (A.view.default,), ("view",), params=("input", "size"),
    varargs=True,
    dtype_rule="same")
_op("reshape", "view", torch.reshape, (T.reshape,), ("reshape",), params=("input", "shape"),
    varargs=True, dtype_rule="same")
_op("expand", "view", T.expand, (A.expand.default,), ("expand",), params=("input", "size"),
    varargs=True,
    dtype_rule="same")
_op("flatten", "view", torch.flatten, (T.flatten,), ("flatten",),
    params=("input", "start_dim", "end_dim"), defaults=(("start_dim", 0), ("end_dim", -1)),
    dtype_rule="same")
_op("unsqueeze", "view", torch.unsqueeze, (T.unsqueeze, A.unsqueeze.default), ("unsqueeze",),
    params=("input", "dim"), dtype_rule="same")
_op("squeeze", "view", torch.squeeze, (T.squeeze,), ("squeeze",), params=("input", "dim"),
    dtype_rule="same")
_op("contiguous", "view", T.contiguous, (), ("contiguous",),
    params=("input", "memory_format"), defaults=(("memory_format", torch.contiguous_format),),
    positional=1, dtype_rule="same")


# ---------------------------------------------------------------------- arithmetic
# 1 - x  ->  torch.rsub(x, 1)
_op("rsub", "pointwise", torch.rsub, (), (), params=(*_BINARY, "alpha"), defaults=(_ALPHA,),
    positional=2, swapped="sub", dtype_rule="promote")
_op("remainder", "pointwise", torch.remainder, (operator.mod, T.remainder), ("remainder",),
    params=_BINARY, positional=2, dtype_rule="promote")
_op("fmod", "pointwise", torch.fmod, (T.fmod,), ("fmod",), params=_BINARY, positional=2,
    dtype_rule="promote")
_op("maximum", "pointwise", torch.maximum, (T.maximum, A.maximum.default), ("maximum",),
    params=_BINARY,
    positional=2, swapped="maximum", dtype_rule="promote")
_op("minimum", "pointwise", torch.minimum, (T.minimum, A.minimum.default), ("minimum",),
    params=_BINARY,
    positional=2, swapped="minimum", dtype_rule="promote")
for _name in ("clamp_min", "clamp_max"):
    _op(_name, "pointwise", getattr(torch, _name), (getattr(T, _name),), (_name,),
        params=("input", _name[-3:]), dtype_rule="promote")
_op("where", "pointwise", torch.where, (A.where.self,), (), params=("condition", *_BINARY),
    dtype_rule=lambda a: promote([a.get("input"), a.get("other")]))
# x.where(c, y) is torch.where(c, x, y): the tensor is the input, not the condition
_op("Tensor.where", "extern", None, (T.where,), ("where",), params=("input", "condition", "other"),
    refine=lambda a: ("where", {"condition": a["condition"], "input": a["input"],
                                "other": a["other"]}) if set(a) == {"input", "condition", "other"}
    else None)

# ---------------------------------------------------------------------- comparisons, logic
# x < y, torch.lt(x, y), x.lt(y), torch.less(x, y); 2 < x swaps to x > 2.
_COMPARISONS = {
    "eq": ("eq", operator.eq, ()), "ne": ("ne", operator.ne, ("not_equal",)),
    "lt": ("gt", operator.lt, ("less",)), "le": ("ge", operator.le, ("less_equal",)),
    "gt": ("lt", operator.gt, ("greater",)), "ge": ("le", operator.ge, ("greater_equal",)),
}
for _name, (_swap, _operator, _aliases) in _COMPARISONS.items():
    _names = (_name, *_aliases)
    _op(_name, "pointwise", getattr(torch, _name),
        (_operator, *(getattr(torch, n) for n in _aliases), *(getattr(T, n) for n in _names)),
        _names, params=_BINARY, positional=2, swapped=_swap, dtype_rule="bool")
for _name in ("logical_and", "logical_or", "logical_xor"):
    _op(_name, "pointwise", getattr(torch, _name), (getattr(T, _name),), (_name,), params=_BINARY,
        positional=2, swapped=_name, dtype_rule="bool")
_op("logical_not", "pointwise", torch.logical_not, (T.logical_not,), ("logical_not",),
    params=_UNARY, dtype_rule="bool")
# x & y is bitwise_and: on bool tensors that is logical and.
for _name, _operator, _commutes in (("bitwise_and", operator.and_, True),
                                    ("bitwise_or", operator.or_, True),
                                    ("bitwise_xor", operator.xor, True),
                                    ("bitwise_left_shift", operator.lshift, False),
                                    ("bitwise_right_shift", operator.rshift, False)):
    _op(_name, "pointwise", getattr(torch, _name), (_operator, getattr(T, _name)), (_name,),
        params=_BINARY, positional=2, swapped=_name if _commutes else None, dtype_rule="promote")
_op("bitwise_not", "pointwise", torch.bitwise_not, (operator.invert, T.bitwise_not),
    ("bitwise_not",), params=_UNARY, dtype_rule="same")

# ---------------------------------------------------------------------- unary math
for _name, _special in (("exp2", torch.special.exp2), ("log1p", torch.special.log1p),
                        ("log2", None), ("sin", None), ("cos", None),
                        ("erf", torch.special.erf), ("reciprocal", None)):
    _op(_name, "pointwise", getattr(torch, _name), (_special, getattr(T, _name)), (_name,),
        params=_UNARY, dtype_rule="float")
_op("expm1", "pointwise", torch.expm1, (torch.special.expm1, T.expm1), ("expm1",),
    params=_UNARY, dtype_rule="float")
# square is pow(x, 2): bools become int64, as torch.pow(True, 2) does
_op("square", "pointwise", torch.square, (T.square,), ("square",), params=_UNARY,
    dtype_rule=lambda a: torch.int64 if _input_dtype(a) == torch.bool else _input_dtype(a))
for _name in ("isnan", "isinf", "isfinite"):
    _op(_name, "pointwise", getattr(torch, _name), (getattr(T, _name),), (_name,),
        params=_UNARY, dtype_rule="bool")
for _name in ("floor", "ceil", "trunc", "sign"):
    _op(_name, "pointwise", getattr(torch, _name), (getattr(T, _name),), (_name,),
        params=_UNARY, dtype_rule="same")
_op("round", "pointwise", torch.round, (T.round,), ("round",), params=_UNARY,
    defaults=(("decimals", 0),), dtype_rule="same")

# Activations.
_op("softplus", "pointwise", F.softplus, (), (), modules=(nn.Softplus,),
    params=("input", "beta", "threshold"), defaults=(("beta", 1), ("threshold", 20)),
    module_kwargs=lambda m: {"beta": m.beta, "threshold": m.threshold}, dtype_rule="same")
for _fn, _module in ((F.mish, nn.Mish), (F.relu6, nn.ReLU6), (F.hardsigmoid, nn.Hardsigmoid),
                     (F.hardswish, nn.Hardswish)):
    _op(_fn.__name__, "pointwise", _fn, (), (), modules=(_module,), params=("input", "inplace"),
        defaults=_INPLACE, module_kwargs=lambda m: {"inplace": m.inplace}, dtype_rule="same")
_op("leaky_relu", "pointwise", F.leaky_relu, (), (), modules=(nn.LeakyReLU,),
    params=("input", "negative_slope", "inplace"),
    defaults=(("negative_slope", 0.01), *_INPLACE), dtype_rule="same",
    module_kwargs=lambda m: {"negative_slope": m.negative_slope, "inplace": m.inplace})
_op("elu", "pointwise", F.elu, (), (), modules=(nn.ELU,), params=("input", "alpha", "inplace"),
    defaults=(("alpha", 1.0), *_INPLACE), dtype_rule="same",
    module_kwargs=lambda m: {"alpha": m.alpha, "inplace": m.inplace})
_op("hardtanh", "pointwise", F.hardtanh, (), (), modules=(nn.Hardtanh,),
    params=("input", "min_val", "max_val", "inplace"),
    defaults=(("min_val", -1.0), ("max_val", 1.0), *_INPLACE), dtype_rule="same",
    module_kwargs=lambda m: {"min_val": m.min_val, "max_val": m.max_val, "inplace": m.inplace})

# ---------------------------------------------------------------------- casts
# x.to(torch.float16), x.half(), x.type(torch.float16): all torch.Tensor.to(x, torch.float16).
# Other uses of .to (devices, copies, another tensor's dtype) are the extern "to_other".


def _to_refine(args: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    if set(args) == {"input", "dtype"} and isinstance(args["dtype"], torch.dtype):
        return None
    out = dict(args)
    if "dtype" in out and not isinstance(out["dtype"], torch.dtype):
        out["#1"] = out.pop("dtype")  # x.to(device) or x.to(other): positional, not a dtype
    return "to_other", out


_TO_DEFAULTS = (("non_blocking", False), ("copy", False))
_op("to", "pointwise", T.to, (), ("to",), params=("input", "dtype"), defaults=_TO_DEFAULTS,
    refine=_to_refine, dtype_rule="same")
# Everything but the tensor keeps its spelling: to(x, device, dtype) or to(x, dtype=, device=).
register(OpInfo("to_other", "extern", T.to, params=("input",), defaults=_TO_DEFAULTS))
# A copy: a new tensor of the same values (memory_format: only the default, which keeps
# a dense input's strides and lays anything else out row-major, as a kernel's outputs are).
_op("clone", "pointwise", torch.clone, (T.clone,), ("clone",), params=("input",),
    defaults=(("memory_format", None),), positional=1, dtype_rule="same")


def _cast_refine(dtype: torch.dtype) -> Callable[[dict[str, Any]], Any]:
    return lambda a: ("to", {"input": a["input"], "dtype": dtype}) if set(a) == {"input"} else None


_CASTS = {"float": torch.float32, "half": torch.float16, "double": torch.float64,
          "bfloat16": torch.bfloat16, "int": torch.int32, "long": torch.int64,
          "short": torch.int16, "char": torch.int8, "byte": torch.uint8, "bool": torch.bool}
for _name, _dtype in _CASTS.items():
    _op(f"Tensor.{_name}", "extern", getattr(T, _name), (), (_name,),
        params=("input", "memory_format"), defaults=(("memory_format", torch.preserve_format),),
        refine=_cast_refine(_dtype), dtype_rule=lambda a, d=_dtype: d)
_op("type", "extern", None, (T.type,), ("type",), params=("input", "dtype"),  # x.type(): a string
    refine=lambda a: ("to", a) if set(a) == {"input", "dtype"} and isinstance(a["dtype"], torch.dtype)
    else None)

# ---------------------------------------------------------------------- dropout
# Random in training mode (an effect, which DCE and CSE keep); the identity in eval mode.
# nn.Identity and eval-mode dropout are both "identity", which normalize removes.
_op("identity", "view", None, (), (), modules=(nn.Identity,), params=_UNARY,
    module_kwargs=lambda m: {}, dtype_rule="same")


def _dropout_refine(args: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    # eval mode or p=0: eager returns its input itself and draws nothing (transformers'
    # GPT-2 with dropout off keeps one after each residual branch, read by nothing)
    p = args.get("p", 0.5)
    if (args.get("training", True) is False or type(p) in (int, float) and p == 0) \
            and isinstance(args.get("input"), Node):
        return "identity", {"input": args["input"]}
    return None


for _fn, _module in _DROPOUT_OPS:
    _op(_fn.__name__, "effect", _fn, (), (), modules=(_module,), impure=True,
        params=("input", "p", "training", "inplace"),
        defaults=(("p", 0.5), ("training", True), ("inplace", False)),
        module_kwargs=lambda m: {"p": m.p, "training": m.training, "inplace": m.inplace},
        refine=_dropout_refine, dtype_rule="same")

# Training-mode dropout made deterministic (fxlite.ops.dropout.seed_dropouts): the mask
# is a function of a seed drawn by draw_seed, an effect that advances torch's generator.
_op("seeded_dropout", "pointwise", seeded_dropout, (), (),
    params=("input", "p", "seed", "offset"), defaults=(("offset", 0),), positional=4,
    dtype_rule="same")
_op("draw_seed", "effect", draw_seed, (), (), impure=True)

# ---------------------------------------------------------------------- reductions
_op("amin", "reduction", torch.amin, (T.amin,), ("amin",), params=("input", "dim", "keepdim"),
    defaults=(("dim", ()), ("keepdim", False)), positional=1, dtype_rule="same")
_op("prod", "reduction", torch.prod, (T.prod,), ("prod",), params=("input", "dim", "keepdim"),
    defaults=(("keepdim", False), ("dtype", None)), positional=1, dtype_rule=_sum_dtype)


def _binary_refine(name: str, whole: str) -> Callable[[dict[str, Any]], Any]:
    # torch.max(a, b) with a tensor b is the elementwise maximum; torch.max(a) alone is
    # amax over every dim (a 0-d tensor, NaN if any element is NaN, as amax gives).
    def refine(args: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        other = args.get("other", args.get("dim"))
        if "other" in args or isinstance(other, Node):
            return name, {"input": args["input"], "other": other}
        if set(args) == {"input"}:
            return whole, {"input": args["input"]}
        return None
    return refine


for _name, _binary in (("max", "maximum"), ("min", "minimum")):
    # torch.max(x, dim) returns (values, indices); torch.max(x) a 0-d tensor.
    _op(_name, "reduction", getattr(torch, _name), (getattr(T, _name),), (_name,),
        params=("input", "dim", "keepdim"), defaults=(("keepdim", False),), positional=1,
        refine=_binary_refine(_binary, f"a{_name}"), dtype_rule="same")


def _var_refine(name: str) -> Callable[[dict[str, Any]], Any]:
    # unbiased=True/False (also positional: var(x, True), var(x, dim, False)) is correction=1/0.
    def refine(args: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        new = dict(args)
        if isinstance(new.get("dim"), bool):
            new["unbiased"] = new.pop("dim")
        if "unbiased" in new:
            unbiased = new.pop("unbiased")
            if not isinstance(unbiased, bool):
                return None
            if not unbiased:
                new["correction"] = 0
        if type(new.get("correction")) is int and new["correction"] == 1:
            del new["correction"]
        return (name, new) if new != args else None
    return refine


for _name in ("var", "std"):
    _op(_name, "reduction", getattr(torch, _name), (getattr(T, _name),), (_name,),
        params=("input", "dim", "unbiased", "keepdim"),
        defaults=(("dim", None), ("keepdim", False), ("correction", 1)), positional=1,
        refine=_var_refine(_name), dtype_rule="same")

# ---------------------------------------------------------------------- views
# x.view(2, 3) -> torch.Tensor.view(x, (2, 3)); x[:, 0] -> operator.getitem(x, (slice, 0)).
_op("t", "view", torch.t, (T.t,), ("t",), params=_UNARY, dtype_rule="same")
_op("getitem", "view", operator.getitem, (), (), params=("input", "index"), dtype_rule="same")

# ---------------------------------------------------------------------- composites and externs
# nn.Softmax() without a dim (softmax's refine): no canonical call.
register(OpInfo("softmax_implicit_dim", "extern", None))
_op("rms_norm", "composite", F.rms_norm, (torch.rms_norm,), (), modules=(nn.RMSNorm,),
    params=("input", "normalized_shape", "weight", "eps"),
    defaults=(("weight", None), ("eps", None)), dtype_rule="same",
    module_params=lambda m: {"normalized_shape": tuple(m.normalized_shape),
                             "weight": m.weight, "eps": m.eps})
# input + value * tensor1 * tensor2 (and / tensor2): decompose splits them into the
# pointwise ops, so they fuse (timm's GlobalResponseNorm, hand-written optimizer steps).
_THREE = ("input", "tensor1", "tensor2")
for _name in ("addcmul", "addcdiv"):
    _op(_name, "composite", getattr(torch, _name), (getattr(T, _name),), (_name,),
        params=(*_THREE, "value"), defaults=(("value", 1),), positional=3,
        dtype_rule=lambda a: promote([a.get(k) for k in _THREE]))
# Vector norms: decompose writes the 2-norm as sqrt(sum(x * x)). torch.norm with a number
# (or "fro" over at most two dims) is a vector norm, as torch.norm itself computes it.
_op("vector_norm", "composite", torch.linalg.vector_norm, (), (),
    params=("input", "ord", "dim", "keepdim"),
    defaults=(("ord", 2), ("dim", None), ("keepdim", False), ("dtype", None)), positional=2,
    dtype_rule="same")


def _norm_refine(a: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    p, dim = a.get("p", "fro"), a.get("dim")
    if not (dim is None or type(dim) is int or isinstance(dim, (list, tuple))):
        return None
    if p == "fro" and (dim is None or type(dim) is int or len(dim) <= 2):
        p = 2
    if type(p) not in (int, float, type(None)):
        return None  # a matrix norm ("nuc"), or an error torch.norm reports
    new = {"input": a["input"], "ord": 2.0 if p is None else p}
    if dim is not None:
        new["dim"] = [dim] if type(dim) is int else dim
    for key in ("keepdim", "dtype"):
        if key in a:
            new[key] = a[key]
    return "vector_norm", new


_op("norm", "composite", torch.norm, (T.norm,), ("norm",), params=("input", "p", "dim", "keepdim"),
    defaults=(("p", "fro"), ("dim", None), ("keepdim", False), ("dtype", None)), positional=2,
    dtype_rule="same", refine=_norm_refine)
_op("group_norm", "extern", F.group_norm, (), (), modules=(nn.GroupNorm,),
    params=("input", "num_groups", "weight", "bias", "eps"),
    defaults=(("weight", None), ("bias", None), ("eps", 1e-5)), dtype_rule="same",
    module_params=lambda m: {"num_groups": m.num_groups, "weight": m.weight, "bias": m.bias,
                             "eps": m.eps})


def _conv_params(m: Any) -> dict[str, Any] | None:
    if m.padding_mode != "zeros":  # the functional form pads with zeros only
        return None
    return {"weight": m.weight, "bias": m.bias, "stride": m.stride, "padding": m.padding,
            "dilation": m.dilation, "groups": m.groups}


for _fn, _module in ((F.conv1d, nn.Conv1d), (F.conv2d, nn.Conv2d), (F.conv3d, nn.Conv3d)):
    _op(_fn.__name__, "extern", _fn, (), (), modules=(_module,),
        params=("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
        defaults=(("bias", None), ("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1)),
        dtype_rule="promote", module_params=_conv_params)


def _batch_norm_params(m: Any) -> dict[str, Any] | None:
    # Only the eval-mode form with running statistics is a plain function of its input.
    if m.training or m.running_mean is None or m.running_var is None:
        return None
    return {"running_mean": m.running_mean, "running_var": m.running_var,
            "weight": m.weight, "bias": m.bias, "eps": m.eps}


_op("batch_norm", "extern", F.batch_norm, (), (),
    modules=(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
    params=("input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
            "eps"),
    defaults=(("weight", None), ("bias", None), ("training", False), ("momentum", 0.1),
              ("eps", 1e-5)),
    dtype_rule="same", module_params=_batch_norm_params)


def _embedding_params(m: Any) -> dict[str, Any] | None:
    if m.max_norm is not None:  # renormalizes the weight in place on every call
        return None
    return {"weight": m.weight, "padding_idx": m.padding_idx,
            "scale_grad_by_freq": m.scale_grad_by_freq, "sparse": m.sparse}


_op("embedding", "extern", F.embedding, (), (), modules=(nn.Embedding,),
    params=("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
            "sparse"),
    defaults=(("padding_idx", None), ("max_norm", None), ("norm_type", 2.0),
              ("scale_grad_by_freq", False), ("sparse", False)),
    dtype_rule=lambda a: dtype_of(a.get("weight")),
    module_params=_embedding_params)

# The same values, cut from autograd (decompose uses it where a term's gradient is 0).
_op("detach", "view", torch.detach, (T.detach,), ("detach",), params=("input",), positional=1,
    dtype_rule="same")
del T
