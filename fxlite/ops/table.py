"""The op table's mechanism: the record type, the table keyed by op name, and lookups.

Each :class:`OpInfo` names an op once and lists every spelling that means it::

    OpInfo("add", "pointwise", torch.add,
           functions=(torch.add, operator.add), methods=("add",))

``lookup(node)`` maps a node, whichever spelling it uses, to its record, so that passes
never grow ``if target == ...`` chains. The records themselves are in
``fxlite/ops/records.py``; ``fxlite.ops`` imports both, so its ``OPS`` always holds every
record, complete. What other layers know about an op lives in their own tables, keyed
by the same name: derivatives (``fxlite.ops.derivatives.VJP``), decompositions
(``fxlite.passes.decompose.DECOMPOSITIONS``) and Triton expressions
(``fxlite.codegen.kernels.ops.TRITON_OPS``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fxlite.node import Node

__all__ = ["OpInfo", "OPS", "attribute_at", "call_args", "canonical_args", "canonical_target", "dtype_of",
           "lookup", "lookup_target", "promote", "register", "resolve", "result_dtype", "same_literal",
           "copying_index", "view_base", "view_root"]


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
    positional: int | None = None
    swapped: str | None = None
    refine: Callable[[dict[str, Any]], tuple[str, dict[str, Any]] | None] | None = None
    module_params: Callable[[Any], dict[str, Any] | None] | None = None


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


def view_base(node: Node, module: torch.nn.Module | None = None) -> Node | None:
    """The node ``node`` is a view of (the input of an op the table calls a view), or None.

    Example::

        view_base(x_unsqueezed)   # the node of x, for x.unsqueeze(0)
    """
    info = lookup(node, module) if node.op in ("call_function", "call_method") else None
    if info is None or info.kind != "view" or info.name == "getitem" and len(node.args) > 1 \
            and copying_index(node.args[1]):
        return None
    base = node.args[0] if node.args else node.kwargs.get("input")
    return base if isinstance(base, Node) else None


def copying_index(index: Any) -> bool:
    """Whether ``x[index]`` copies (advanced indexing: a list, a bool or a tensor in the
    index) rather than views ``x``'s memory, as basic indexing (ints, slices, None,
    Ellipsis) does. A tensor index views only where it is a 0-d integer tensor, read as
    an int. A node in the index is a tensor by its ``tensor_meta``; without one (an int
    computed in the graph, or a graph with no metadata) it counts as a view, which is
    what aliasing checks must assume::

        x[0, 1:]      # a view            x[[0, -1]]    # a copy
        x[i]          # a view, for i a 0-d long tensor; a copy for a 1-d one or a mask
    """
    if isinstance(index, tuple):
        return any(copying_index(i) for i in index)
    if isinstance(index, (list, bool)):
        return True
    if isinstance(index, torch.Tensor):
        return not _selects(index.shape, index.dtype)
    if isinstance(index, Node):
        meta = index.meta.get("tensor_meta")
        return meta is not None and hasattr(meta, "shape") and not _selects(meta.shape,
                                                                             meta.dtype)
    return False


def _selects(shape: Any, dtype: torch.dtype) -> bool:
    return len(shape) == 0 and not dtype.is_floating_point and not dtype.is_complex \
        and dtype not in (torch.bool, torch.uint8)


def view_root(node: Node, module: torch.nn.Module | None = None) -> Node:
    """The node at the bottom of ``node``'s chain of view ops (``node`` itself if it is no
    view): whose memory ``node`` shares.

    Example::

        view_root(x_unsqueezed_row)   # the node of x, for x.unsqueeze(0)[1]
    """
    while (base := view_base(node, module)) is not None:
        node = base
    return node


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


def same_literal(a: Any, b: Any) -> bool:
    """``a == b`` as arguments of a torch op: ``1``, ``1.0`` and ``True`` differ (Python
    says they are equal); tensors and other values without a plain truth value compare by
    identity."""
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
        if len(rest) > 1 or type(rest[0]) is int or (
                isinstance(rest[0], Node) and rest[0].meta.get("type") is int):
            args = (args[0], tuple(rest))  # (an int node: x.reshape(x.numel()) of sizes)
    params = info.params
    for i, a in enumerate(args):
        out[params[i] if i < len(params) else f"#{i}"] = a
    out.update(node.kwargs)
    out.pop("_stacklevel", None)  # F.softmax's: it only picks a warning's frame
    for key, default in info.defaults:
        if key in out and same_literal(out[key], default):
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
