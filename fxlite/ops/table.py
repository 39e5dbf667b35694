"""The op table: one record per op, consulted by DCE, the rewriter and the passes.

Each :class:`OpInfo` names an op once and lists every spelling that means it::

    OpInfo("add", "pointwise", torch.add,
           functions=(torch.add, operator.add), methods=("add",))

``lookup(node)`` maps a node, whichever spelling it uses, to its record, so that passes
never grow ``if target == ...`` chains.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fxlite.node import Node

__all__ = ["OpInfo", "OPS", "attribute_at", "call_args", "canonical_args", "canonical_target", "dtype_of", "has_side_effect",
           "is_impure", "lookup", "lookup_target", "register", "resolve", "result_dtype"]


@dataclass(frozen=True)
class OpInfo:
    """What fxlite knows about one op.

    Attributes:
        name: the canonical name (``"add"``).
        kind: ``"pointwise"``, ``"reduction"``, ``"view"``, ``"extern"`` or ``"effect"``.
        torch_fn: the reference torch function.
        functions: ``call_function`` targets that mean this op.
        methods: ``call_method`` names that mean this op.
        modules: leaf module types that mean this op (``nn.ReLU``).
        impure: True for in-place, random and side-effecting ops, which DCE keeps.
        params: canonical parameter names, input first (``("input", "other", "alpha")``),
            used to line up positional and keyword spellings of one call.
        defaults: ``(name, value)`` pairs that mean "not given" in every spelling, so
            ``torch.add(x, y, alpha=1)`` and ``x + y`` compare equal.
        varargs: the method spelling may pass the last parameter unpacked
            (``x.view(2, 3)`` is ``x.view((2, 3))``).
        module_kwargs: for ``modules``, turns a module instance into the keyword arguments
            of the function spelling (``nn.Softmax(1)`` -> ``{"dim": 1}``); None when the
            module form has no function equivalent (``nn.Linear`` owns its weight).
        dtype_rule: the result dtype (see :func:`result_dtype`): ``"promote"`` (torch type
            promotion of the operands), ``"float"`` (promote, then ints and bools become the
            default float), ``"bool"``, ``"same"`` (the input's dtype), ``"index"`` (int64),
            or a callable ``rule(args) -> dtype`` over canonical args whose tensors are given
            as their dtypes. A ``dtype=`` argument overrides it. None: unknown.
        triton: how the Triton code generator emits the op (a ``TritonOp``), set by
            :func:`amend` when ``fxlite.codegen.kernels.ops`` is imported; None for ops it
            cannot emit and before that import (the core does not import codegen).
        positional: how many leading ``params`` the canonical call passes positionally
            (the rest go by keyword); None for all of them.
        swapped: the op computing this one with ``input`` and ``other`` exchanged (``"add"``
            for add, ``"rsub"`` for sub); used to put the tensor operand first.
        refine: ``refine(args) -> (name, args) | None`` maps the canonical args of a call
            that really means another op, or needs its arguments restated, to that op's
            name and args (``torch.max(a, b)`` is ``maximum``; ``x.float()`` is ``to``).
        module_params: for ``modules`` that own tensors (``nn.Linear``), the keyword
            arguments of the function spelling, with the module's parameters and buffers as
            tensors; returns None when the module has no safe function form (BatchNorm in
            training mode).
        vjp: the op's derivative rule, set by :func:`amend` when ``fxlite.ops.derivatives``
            is imported (by ``fxlite.autodiff``): ``vjp(g, args, out) -> {param: grad}``,
            the cotangents of the tensor parameters given the cotangent ``g`` of the result
            (see that module). None: no rule (autodiff declines the graph).
    """

    name: str
    kind: str
    torch_fn: Callable[..., Any] | None
    functions: tuple[Callable[..., Any], ...] = ()
    methods: tuple[str, ...] = ()
    modules: tuple[type, ...] = ()
    impure: bool = False
    params: tuple[str, ...] = ()
    defaults: tuple[tuple[str, Any], ...] = ()
    varargs: bool = False
    module_kwargs: Callable[[Any], dict[str, Any]] | None = None
    dtype_rule: str | Callable[[dict[str, Any]], Any] | None = None
    triton: Any = None
    positional: int | None = None
    swapped: str | None = None
    refine: Callable[[dict[str, Any]], tuple[str, dict[str, Any]] | None] | None = None
    module_params: Callable[[Any], dict[str, Any] | None] | None = None
    vjp: Any = None


OPS: dict[str, OpInfo] = {}
_BY_FUNCTION: dict[Any, OpInfo] = {}
_BY_METHOD: dict[str, OpInfo] = {}
_BY_MODULE: dict[type, OpInfo] = {}


def register(info: OpInfo) -> OpInfo:
    """Add ``info`` to the table, indexing all of its spellings."""
    OPS[info.name] = info
    for f in info.functions:
        _BY_FUNCTION[f] = info
    for m in info.methods:
        _BY_METHOD[m] = info
    for t in info.modules:
        _BY_MODULE[t] = info
    return info


def amend(updates: dict[str, dict[str, Any]]) -> None:
    """Replace fields of registered records; every spelling keeps pointing at its record.

    Code generators fill their column of the table this way: ``fxlite.codegen.kernels.ops``
    sets each op's ``triton`` emitter when it is imported.

    Example::

        amend({"relu": {"triton": TritonOp(_relu, ("inplace",))}})
        OPS["relu"].triton.emit  # the emitter
    """
    swap: dict[int, OpInfo] = {}
    for name, fields in updates.items():
        old = OPS[name]
        OPS[name] = swap[id(old)] = dataclasses.replace(old, **fields)
    for index in (_BY_FUNCTION, _BY_METHOD, _BY_MODULE):
        for key, info in index.items():
            if id(info) in swap:
                index[key] = swap[id(info)]


def lookup(node: Node, module: torch.nn.Module | None = None) -> OpInfo | None:
    """The record for ``node``'s op, whichever spelling it uses, or None if unknown.

    ``module`` (the owning module) is needed to resolve ``call_module`` nodes. A spelling
    whose record has a ``refine`` hook resolves to the op it really computes
    (``torch.max(a, b)`` gives ``maximum``; ``nn.Dropout`` in eval mode gives ``identity``).
    """
    info = _direct_lookup(node, module)
    if info is None or info.refine is None:
        return info
    return _refined(node, info, module)[0]


def resolve(node: Node, module: torch.nn.Module | None = None) -> tuple[OpInfo, dict[str, Any]] | None:
    """``(lookup(node), canonical_args(...))`` in one step, or None for an unknown op.

    Example::

        info, args = resolve(node)     # x.float() -> (OPS["to"], {"input": x, "dtype": torch.float32})
    """
    info = _direct_lookup(node, module)
    if info is None:
        return None
    return _refined(node, info, module)


def lookup_target(target: Any) -> OpInfo | None:
    """The record for a ``call_function`` target (any spelling), or None."""
    try:
        return _BY_FUNCTION.get(target)
    except TypeError:  # unhashable target
        return None


def _refined(node: Node, info: OpInfo, module: torch.nn.Module | None) -> tuple[OpInfo, dict[str, Any]]:
    args = _raw_args(node, info, module)
    for _ in range(4):  # a refinement may lead to a record that refines again (var -> var)
        if info.refine is None:
            break
        step = info.refine(args)
        if step is None:
            break
        name, args = step
        if OPS[name] is info:
            break
        info = OPS[name]
    return info, args


def _direct_lookup(node: Node, module: torch.nn.Module | None = None) -> OpInfo | None:
    if node.op == "call_function":
        try:
            return _BY_FUNCTION.get(node.target)
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method":
        return _BY_METHOD.get(node.target)
    if node.op == "call_module" and module is not None:
        sub = attribute_at(module, node.target)
        return _BY_MODULE.get(type(sub)) if sub is not None else None
    return None


def attribute_at(module: Any, target: str) -> Any:
    """The attribute at the dotted path ``target`` under ``module`` (a submodule, parameter,
    buffer or constant), or None where the path leads nowhere."""
    obj: Any = module
    for atom in target.split("."):
        obj = getattr(obj, atom, None)
        if obj is None:
            return None
    return obj


# ---------------------------------------------------------------------- side effects
_RANDOM_FUNCTIONS = (
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.randperm, torch.bernoulli, torch.multinomial, torch.normal,
    torch.poisson, torch.dropout, torch.alpha_dropout, torch.feature_dropout,
    F.rrelu, F.gumbel_softmax,
)  # F.dropout and nn.Dropout (random only in training mode) are in op_records.py
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
    if "out" in node.kwargs or node.kwargs.get("inplace") is True:
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
T = torch.Tensor
_BINARY = ("input", "other")
_ALPHA = (("alpha", 1),)


def _spell(name: str, kind: str, torch_fn: Any, functions: tuple = (), methods: tuple = (),
           **extra: Any) -> OpInfo:
    fns = tuple(dict.fromkeys(f for f in (torch_fn, *functions) if f is not None))
    return register(OpInfo(name, kind, torch_fn, functions=fns, methods=methods, **extra))


# x + y, torch.add(x, y), x.add(y), torch.Tensor.add(x, y)
_spell("add", "pointwise", torch.add, (operator.add, T.add), ("add",),
       params=(*_BINARY, "alpha"), defaults=_ALPHA)
_spell("sub", "pointwise", torch.sub, (operator.sub, torch.subtract, T.sub, T.subtract),
       ("sub", "subtract"), params=(*_BINARY, "alpha"), defaults=_ALPHA)
_spell("mul", "pointwise", torch.mul, (operator.mul, torch.multiply, T.mul, T.multiply),
       ("mul", "multiply"), params=_BINARY)
_spell("truediv", "pointwise", torch.div,
       (operator.truediv, torch.divide, torch.true_divide, T.div, T.divide, T.true_divide),
       ("div", "divide", "true_divide"), params=(*_BINARY, "rounding_mode"),
       defaults=(("rounding_mode", None),))
_spell("floordiv", "pointwise", torch.floor_divide, (operator.floordiv, T.floor_divide),
       ("floor_divide",), params=_BINARY)
_spell("pow", "pointwise", torch.pow, (operator.pow, T.pow), ("pow",), params=("input", "exponent"))
_spell("matmul", "extern", torch.matmul, (operator.matmul, T.matmul), ("matmul",), params=_BINARY)
_spell("neg", "pointwise", torch.neg, (operator.neg, torch.negative, T.neg, T.negative),
       ("neg", "negative"), params=("input",))
_spell("abs", "pointwise", torch.abs, (operator.abs, torch.absolute, T.abs, T.absolute),
       ("abs", "absolute"), params=("input",))
_spell("clamp", "pointwise", torch.clamp, (torch.clip, T.clamp, T.clip), ("clamp", "clip"),
       params=("input", "min", "max"), defaults=(("min", None), ("max", None)))

# relu(x): torch.relu, F.relu, x.relu(), nn.ReLU()
_INPLACE = (("inplace", False),)
_spell("relu", "pointwise", torch.relu, (F.relu, T.relu), ("relu",), modules=(torch.nn.ReLU,),
       params=("input", "inplace"), defaults=_INPLACE,
       module_kwargs=lambda m: {"inplace": m.inplace})
_spell("gelu", "pointwise", F.gelu, (), (), modules=(torch.nn.GELU,),
       params=("input", "approximate"), defaults=(("approximate", "none"),),
       module_kwargs=lambda m: {"approximate": m.approximate})
_spell("silu", "pointwise", F.silu, (), (), modules=(torch.nn.SiLU,),
       params=("input", "inplace"), defaults=_INPLACE,
       module_kwargs=lambda m: {"inplace": m.inplace})
_spell("sigmoid", "pointwise", torch.sigmoid, (F.sigmoid, torch.special.expit, T.sigmoid),
       ("sigmoid",), modules=(torch.nn.Sigmoid,), params=("input",), module_kwargs=lambda m: {})
_spell("tanh", "pointwise", torch.tanh, (F.tanh, T.tanh), ("tanh",), modules=(torch.nn.Tanh,),
       params=("input",), module_kwargs=lambda m: {})
for _name in ("exp", "log", "sqrt", "rsqrt"):
    _spell(_name, "pointwise", getattr(torch, _name), (getattr(T, _name),), (_name,),
           params=("input",))

# Row-wise reductions. F.softmax's `_stacklevel` only affects a warning.
_SOFTMAX_DEFAULTS = (("_stacklevel", 3), ("dtype", None))
_spell("softmax", "reduction", torch.softmax, (F.softmax, torch.special.softmax, T.softmax),
       ("softmax",), modules=(torch.nn.Softmax,), params=("input", "dim"),
       defaults=_SOFTMAX_DEFAULTS, module_kwargs=lambda m: {"dim": m.dim})
_spell("log_softmax", "reduction", torch.log_softmax,
       (F.log_softmax, torch.special.log_softmax, T.log_softmax), ("log_softmax",),
       modules=(torch.nn.LogSoftmax,), params=("input", "dim"), defaults=_SOFTMAX_DEFAULTS,
       module_kwargs=lambda m: {"dim": m.dim})
_spell("layer_norm", "reduction", F.layer_norm, (torch.layer_norm,), (),
       modules=(torch.nn.LayerNorm,), params=("input", "normalized_shape", "weight", "bias", "eps"),
       defaults=(("weight", None), ("bias", None), ("eps", 1e-5)))
_spell("linear", "extern", F.linear, (), (), modules=(torch.nn.Linear,),
       params=("input", "weight", "bias"), defaults=(("bias", None),))
_spell("cat", "extern", torch.cat, (torch.concat, torch.concatenate), (),
       params=("tensors", "dim"), defaults=(("dim", 0),))
_spell("stack", "extern", torch.stack, (), (), params=("tensors", "dim"), defaults=(("dim", 0),))
_REDUCE_DEFAULTS = (("dim", None), ("keepdim", False), ("dtype", None))
for _name in ("sum", "mean"):
    _spell(_name, "reduction", getattr(torch, _name), (getattr(T, _name),), (_name,),
           params=("input", "dim", "keepdim"), defaults=_REDUCE_DEFAULTS)
_spell("amax", "reduction", torch.amax, (T.amax,), ("amax",), params=("input", "dim", "keepdim"),
       defaults=(("dim", ()), ("keepdim", False)))

# Views. `x.view(2, 3)` and `x.view((2, 3))` are one call (varargs).
_spell("transpose", "view", torch.transpose,
       (torch.swapaxes, torch.swapdims, T.transpose, T.swapaxes, T.swapdims),
       ("transpose", "swapaxes", "swapdims"), params=("input", "dim0", "dim1"))
_spell("permute", "view", torch.permute, (T.permute,), ("permute",), params=("input", "dims"),
       varargs=True)
_spell("view", "view", None, (T.view,), ("view",), params=("input", "size"), varargs=True)
_spell("reshape", "view", torch.reshape, (T.reshape,), ("reshape",), params=("input", "shape"),
       varargs=True)
_spell("expand", "view", None, (T.expand,), ("expand",), params=("input", "size"), varargs=True)
_spell("flatten", "view", torch.flatten, (T.flatten,), ("flatten",),
       params=("input", "start_dim", "end_dim"), defaults=(("start_dim", 0), ("end_dim", -1)))
_spell("unsqueeze", "view", torch.unsqueeze, (T.unsqueeze,), ("unsqueeze",), params=("input", "dim"))
_spell("squeeze", "view", torch.squeeze, (T.squeeze,), ("squeeze",), params=("input", "dim"))
_spell("contiguous", "view", None, (T.contiguous,), ("contiguous",),
       params=("input", "memory_format"), defaults=(("memory_format", torch.contiguous_format),))
del T


def _same_literal(a: Any, b: Any) -> bool:
    # `1 == 1.0 == True` in Python, but they are different arguments to a torch op.
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # tensors and other values without a plain truth value
        return a is b


def canonical_args(node: Node, info: OpInfo, module: torch.nn.Module | None = None) -> dict[str, Any]:
    """``node``'s arguments keyed by ``info``'s parameter names, defaults left out.

    Every spelling of one call gives the same dict: ``torch.add(x, y)``, ``x + y`` and
    ``x.add(y, alpha=1)`` all give ``{"input": x, "other": y}``. Positional arguments
    beyond ``info.params`` are keyed ``"#2"``, ``"#3"``... ``module`` resolves the
    configuration of a ``call_module`` node (``nn.Softmax(1)`` gives ``dim=1``). When
    ``info`` is the record a ``refine`` hook leads to (``lookup(node)``), the refined
    arguments are returned.

    Example::

        canonical_args(node, lookup(node))   # {"input": x, "other": y}
    """
    direct = _direct_lookup(node, module)
    if direct is not None and direct.refine is not None:
        refined, args = _refined(node, direct, module)
        if refined is info:
            return args
    return _raw_args(node, info, module)


def _raw_args(node: Node, info: OpInfo, module: torch.nn.Module | None = None) -> dict[str, Any]:
    args = node.args
    out: dict[str, Any] = {}
    if node.op == "call_module" and info.module_kwargs is not None and module is not None:
        sub = attribute_at(module, node.target)
        if sub is not None:
            out.update(info.module_kwargs(sub))
    if info.varargs and len(args) > 1:
        rest = args[1:]
        if len(rest) > 1 or (type(rest[0]) is int):
            args = (args[0], tuple(rest))
    params = info.params
    for i, a in enumerate(args):
        out[params[i] if i < len(params) else f"#{i}"] = a
    out.update(node.kwargs)
    out.pop("_stacklevel", None)  # F.softmax's: it only picks a warning's frame
    for key, default in info.defaults:
        if key in out and _same_literal(out[key], default):
            del out[key]
    return out


def canonical_target(info: OpInfo) -> Callable[..., Any] | None:
    """The ``call_function`` target of ``info``'s canonical form (``torch.add`` for add)."""
    return info.torch_fn


def call_args(info: OpInfo, args: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The inverse of :func:`canonical_args`: ``(args, kwargs)`` for calling ``info.torch_fn``.

    The first ``info.positional`` parameters go positionally (all of them when None),
    the rest by keyword in parameter order. A gap before a positional argument is filled
    with its default; ValueError if it has none.

    Example::

        call_args(OPS["sum"], {"input": x, "dim": 1})   # ((x,), {"dim": 1})
    """
    params = info.params
    limit = len(params) if info.positional is None else info.positional
    present = [i for i, p in enumerate(params[:limit]) if p in args]
    extras = [int(k[1:]) for k in args if k.startswith("#")]
    count = max([i + 1 for i in present] + [i + 1 for i in extras] + [0])
    defaults = dict(info.defaults)
    positional: list[Any] = []
    for i in range(count):
        key = params[i] if i < len(params) else f"#{i}"
        if key in args:
            positional.append(args[key])
        elif key in defaults:
            positional.append(defaults[key])
        else:
            raise ValueError(f"{info.name}: argument {key!r} is missing before a positional one")
    used = set(params[:count]) | {f"#{i}" for i in range(count)}
    order = {p: i for i, p in enumerate(params)}
    rest = sorted((k for k in args if k not in used), key=lambda k: order.get(k, len(order)))
    return tuple(positional), {k: args[k] for k in rest}


# Parameters that take part in type promotion; the rest (dims, flags, alpha) do not.
_OPERANDS = ("input", "other", "exponent", "min", "max", "tensors")


def result_dtype(info: OpInfo, args: dict[str, Any]) -> torch.dtype | None:
    """The dtype of ``info``'s result, from canonical args whose tensors are given as dtypes
    (0-dim ones as tensors, meta ones will do: see :func:`promote`).

    Python numbers among the operands promote as torch does (an int tensor plus ``1.5``
    is float; a float16 tensor plus ``1.5`` stays float16). Returns None when the rule is
    unknown or no operand is a tensor.

    Example::

        result_dtype(OPS["add"], {"input": torch.int32, "other": 1.5})   # torch.float32
    """
    override = args.get("dtype")
    if isinstance(override, torch.dtype):
        return override
    rule = info.dtype_rule
    if callable(rule):
        return rule(args)
    if rule == "bool":
        return torch.bool
    if rule == "index":
        return torch.int64
    if rule == "same":
        return dtype_of(args.get("input"))
    if rule in ("promote", "float"):
        values: list[Any] = []
        for key in _OPERANDS:
            v = args.get(key)
            values.extend(v if isinstance(v, (list, tuple)) else [v])
        dtype = promote(values)
        if rule == "float" and dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            dtype = torch.get_default_dtype()
        return dtype
    return None


def dtype_of(value: Any) -> torch.dtype | None:
    """The dtype of an operand given as a dtype or a (meta) tensor; None for anything else."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    return value if isinstance(value, torch.dtype) else None


def promote(values: list[Any]) -> torch.dtype | None:
    """torch's result dtype for operands: dtypes or tensors with dims, 0-dim tensors (given
    as tensors, meta ones will do) and Python numbers.

    The three kinds rank as torch ranks them: a 0-dim tensor or a number changes the
    result's dtype only where its category (bool < integer < float < complex) is higher.

    Example::

        promote([torch.bfloat16, torch.empty((), device="meta")])  # torch.bfloat16
        promote([torch.int32, 1.5])                                # torch.float32
    """
    dims: torch.dtype | None = None
    zeros: torch.dtype | None = None
    numbers: torch.dtype | None = None
    for v in values:
        if isinstance(v, torch.dtype) or isinstance(v, torch.Tensor) and v.dim() > 0:
            dims = _promote_two(dims, dtype_of(v))
        elif isinstance(v, torch.Tensor):
            zeros = _promote_two(zeros, v.dtype)
        elif isinstance(v, (bool, int, float, complex)):
            numbers = _promote_two(numbers, _NUMBER_DTYPES[type(v)]())
    if dims is None and zeros is None:
        return None
    return _combine(dims, _combine(zeros, numbers))


_NUMBER_DTYPES = {bool: lambda: torch.bool, int: lambda: torch.int64,
                  float: torch.get_default_dtype,
                  complex: lambda: torch.complex128 if torch.get_default_dtype() == torch.float64
                  else torch.complex64}


def _promote_two(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
    return b if a is None else a if b is None else torch.promote_types(a, b)


def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    """A higher-ranked kind's dtype, raised by a lower kind's only where its category is
    higher (c10's ``combine_categories``)."""
    if higher is None or lower is None:
        return lower if higher is None else higher
    if higher.is_complex:
        return higher
    if lower.is_complex:
        return higher.to_complex() if higher.is_floating_point else lower
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


from fxlite.ops import records as op_records  # noqa: E402,F401  (registers the rest of the table)
