"""What ``fxlite.load`` may call: functions, Tensor methods and module classes, by name.

A saved graph names each target as text (``"torch.relu"``); loading looks the text up
here and nowhere else. Nothing is imported or evaluated to resolve a name. The table is
built from rules, so that it covers the tensor ops of the installed torch without listing
them, and leaves out what would reach files, processes or Python's object graph:

    torch.<name>                 ATen ops (torch.relu, torch.cat), torch.functional (torch.split)
                                 but not torch.from_file, torch.load, torch.save, torch.hub...
    torch.nn.functional.<name>   F.relu, F.softmax, F.scaled_dot_product_attention...
    torch.special / linalg / fft ATen ops; torch._C._nn.<name> (what normalize emits)
    torch.Tensor.<name>          public methods and operator dunders, not storage, hook,
                                 shared-memory or callable-taking ones (apply_, map_)
    operator.<name>              arithmetic, comparison, bitwise, getitem, setitem: not
                                 call, methodcaller or attrgetter
    math.<name>                  every function of math
    builtins.<name>              len, int, float, bool, min, max, abs, sum, range, slice,
                                 tuple, list, round, pow, divmod, all, any, and getattr of a
                                 public Tensor attribute name (x.shape, x.dtype)
    torch.nn.<Module>            standard modules, rebuilt from their constructor arguments

Anything else must be registered by the loading program (:func:`register`), which is
how a user says "I trust this code".
"""

from __future__ import annotations

import builtins
import functools
import inspect
import math
import operator
import types
from typing import Any

import torch
import torch.nn.functional as F

from fxlite.serialize.tensors import SerializationError

__all__ = ["construct", "constructor_args", "function_name", "init_parameters", "module_name",
           "rebuild_problem", "register", "registered", "resolve_function", "resolve_module",
           "size_problem", "tensor_attribute_ok", "tensor_method_ok", "unbuilt_problem"]

_ATEN_MODULES = ("torch", "torch._C._nn", "torch._C._special", "torch._C._linalg", "torch._C._fft",
                 "torch._C._VariableFunctions")
_DENY_TORCH = frozenset({"from_file"})
_DENY_TENSOR = frozenset({
    "storage", "untyped_storage", "storage_type", "share_memory_", "is_shared", "module_load",
    "register_hook", "register_post_accumulate_grad_hook", "apply_", "map_", "map2_",
    "data_ptr", "_base",
})
_OPERATOR = (
    "abs add and_ concat contains countOf delitem eq floordiv ge getitem gt iadd iand iconcat "
    "ifloordiv ilshift imatmul imod imul index indexOf inv invert ior ipow irshift is_ is_not "
    "isub itruediv ixor le lshift lt matmul mod mul ne neg not_ or_ pos pow rshift setitem sub "
    "truediv truth xor").split()
_BUILTINS = ("abs all any bool divmod float getattr int len list max min pow range round "
             "slice sum tuple").split()
# Operator dunders a Tensor method spelling may use (x.__add__(y), torch.Tensor.__getitem__).
_DUNDERS = frozenset(
    {f"__{p}{n.rstrip('_')}__" for n in _OPERATOR for p in ("", "r", "i")}
    | {"__getitem__", "__setitem__", "__len__", "__bool__", "__float__", "__int__", "__index__",
       "__complex__", "__neg__", "__pos__", "__abs__", "__invert__", "__contains__"})

_REGISTERED: dict[str, Any] = {}
_REGISTERED_NAMES: dict[int, str] = {}


def register(obj: Any, name: str | None = None) -> str:
    """Allow ``fxlite.load`` to use ``obj`` (a function, or an ``nn.Module`` class).

    Register in the program that saves and in the one that loads: the file holds only
    the name. Registering is how you vouch for code that ``load`` would otherwise refuse.

    Args:
        obj: the function or module class.
        name: the name stored in files (default: ``module.qualname`` of ``obj``).

    Returns:
        The name.

    Example::

        @fxlite.serialize.register
        def my_op(x): ...
    """
    if name is None:
        name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
    if type(name) is not str or not name:
        raise TypeError(f"register: name must be a non-empty str, not {name!r}")
    if _allowed().get(name) is not None and _allowed()[name] is not obj:
        raise ValueError(f"register: {name!r} already names an allowed function")
    if not callable(obj):
        raise TypeError(f"register: {obj!r} is not callable")
    _REGISTERED[name] = obj
    _REGISTERED_NAMES[id(obj)] = name
    return name


def registered() -> dict[str, Any]:
    """The names registered with :func:`register`, and what they stand for."""
    return dict(_REGISTERED)


def function_name(fn: Any) -> tuple[str, bool] | None:
    """``(name, registered)`` under which ``fn`` is stored, or None if it is not allowed."""
    name = _allowed_names().get(id(fn))
    if name is not None and _allowed()[name] is fn:
        return name, False
    name = _REGISTERED_NAMES.get(id(fn))
    if name is not None and _REGISTERED.get(name) is fn:
        return name, True
    return None


def resolve_function(name: str, user: bool) -> Any:
    """The function a stored name stands for, or None if it is not allowed."""
    table = _REGISTERED if user else _allowed()
    fn = table.get(name) if type(name) is str else None
    return None if isinstance(fn, type) and issubclass(fn, torch.nn.Module) else fn


def resolve_module(name: str) -> type | None:
    """The ``nn.Module`` class a stored name stands for, or None if it is not allowed."""
    cls = _modules().get(name) if type(name) is str else None
    if cls is None and type(name) is str:
        cls = _REGISTERED.get(name)
    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None


def module_name(cls: type) -> str | None:
    """The name a module class is stored under, or None if it is not allowed."""
    name = f"torch.nn.{cls.__name__}"
    if _modules().get(name) is cls:
        return name
    name = _REGISTERED_NAMES.get(id(cls))
    return name if name is not None and _REGISTERED.get(name) is cls else None


def tensor_method_ok(name: Any) -> bool:
    """May a ``call_method`` node call ``name``? Only Tensor methods that touch no files,
    processes, hooks or Python callables."""
    return type(name) is str and name in _tensor_methods()


def tensor_attribute_ok(name: Any) -> bool:
    """May ``getattr(x, name)`` be loaded? Only public Tensor attributes (shape, dtype, T...)."""
    return type(name) is str and not name.startswith("_") and name not in _DENY_TENSOR \
        and hasattr(torch.Tensor, name)


# ---------------------------------------------------------------------- modules by constructor
def constructor_args(m: torch.nn.Module, where: str) -> dict[str, Any]:
    """The constructor arguments of a standard module, read back from its attributes."""
    args: dict[str, Any] = {}
    for p in inspect.signature(type(m).__init__).parameters.values():
        if p.name in ("self", "device", "dtype") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in vars(m) or p.name in m._parameters or p.name in m._buffers:
            value = getattr(m, p.name)
            if isinstance(value, torch.Tensor) or (value is None and p.name in m._parameters):
                value = value is not None  # bias=True/False, stored as a parameter or None
            elif isinstance(value, torch.nn.Module):
                continue
            args[p.name] = value
        elif p.default is inspect.Parameter.empty:
            raise SerializationError(f"fxlite.save: submodule {where!r} ({type(m).__name__}) has "
                                     f"no attribute for its constructor argument {p.name!r}")
    return args


@functools.cache
def init_parameters(cls: type) -> frozenset[str]:
    """The constructor arguments a file may give ``cls``: its named, public ones, but not
    ``device`` or ``dtype`` (load chooses them) and not ``*args``/``**kwargs``."""
    params = inspect.signature(cls.__init__).parameters.values()
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                     and p.name not in ("self", "device", "dtype") and not p.name.startswith("_"))


# Constructor arguments that count layers (an int), or list one entry per layer: each layer
# stores at least one tensor, so a file may ask for no more layers than it stores tensors
# (nn.RNNBase's num_layers, nn.Transformer's, nn.AdaptiveLogSoftmaxWithLoss's cutoffs).
_LAYER_COUNTS = ("num_layers", "num_encoder_layers", "num_decoder_layers", "cutoffs")


def size_problem(args: dict[str, Any], stored: int) -> str | None:
    """Why ``args`` would build more than a module that stores ``stored`` tensors; None if
    they would not. Checked before constructing: even on the meta device, a module of a
    million layers takes minutes to build."""
    for name in _LAYER_COUNTS:
        n = args.get(name)
        count = len(n) if type(n) in (list, tuple) else n
        if type(count) is int and count > stored:
            return (f"{name}={_short(n)[:40]} asks for {count} layers, more than the {stored} "
                    "tensors the file stores")
    return None


def construct(cls: type, args: dict[str, Any], what: str) -> torch.nn.Module:
    """``cls(**args)`` on the meta device, where construction allocates and initializes
    nothing; the stored tensors replace the parameters and buffers right after.

    Why not ``with torch.device("meta")`` as well: it sets a process-wide default (other
    threads' ``torch.get_default_device()`` would see it). Standard modules without a
    ``device`` argument build no tensors, and :func:`unbuilt_problem` refuses one that did.
    """
    extra = {"device": "meta"} if "device" in inspect.signature(cls.__init__).parameters else {}
    try:
        return cls(**args, **extra)
    except Exception as e:
        raise SerializationError(f"{what}: {cls.__name__}(**{_short(args)[:200]}) raised "
                                 f"{type(e).__name__}: {_short(e)[:200]}") from None


def unbuilt_problem(m: torch.nn.Module) -> str | None:
    """What a module built by :func:`construct` holds that stored tensors would not replace
    (a tensor attribute that is no parameter or buffer, a tensor off the meta device); None
    if nothing."""
    for path, sub in m.named_modules(remove_duplicate=False):
        where = f"{path}." if path else ""
        for k, v in vars(sub).items():
            if isinstance(v, torch.Tensor):
                return (f"it keeps tensor {where}{k}, which is neither a parameter nor a buffer, so "
                        "load would have to compute it")
        for k, v in [*sub._parameters.items(), *sub._buffers.items()]:
            if v is not None and not v.is_meta:
                return f"its constructor allocated {where}{k} (it ignores device='meta')"
    return None


def rebuild_problem(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    """What differs between two modules, besides tensor values and training flags; None if nothing."""
    problem = unbuilt_problem(b)
    if problem:
        return problem
    mods_a, mods_b = dict(a.named_modules()), dict(b.named_modules())
    if mods_a.keys() != mods_b.keys():
        return f"its submodules are {sorted(mods_a)}, a rebuilt one has {sorted(mods_b)}"
    for path, ma in mods_a.items():
        mb = mods_b[path]
        if type(ma) is not type(mb):
            return f"submodule {path!r} is a {type(ma).__name__}, rebuilt a {type(mb).__name__}"
        for kind in ("_parameters", "_buffers"):
            sa = {k: None if v is None else tuple(v.shape) for k, v in getattr(ma, kind).items()}
            sb = {k: None if v is None else tuple(v.shape) for k, v in getattr(mb, kind).items()}
            if sa != sb:
                return f"{kind[1:]} of {path or 'it'!r} are {sa}, rebuilt {sb}"
        for k, va in vars(ma).items():
            if k.startswith("_") and k != "_reversed_padding_repeated_twice" or k == "training":
                continue
            vb = vars(mb).get(k, _MISSING)
            if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
                if va.shape != vb.shape:
                    return f"tensor attribute {k!r} of {path or 'it'!r} has another shape"
                continue
            try:
                same = va is vb or (type(va) is type(vb) and bool(va == vb))
            except Exception:
                same = False
            if not same:
                return f"attribute {k!r} of {path or 'it'!r} is {_short(va)[:60]}, rebuilt {_short(vb)[:60]}"
    return None


_MISSING = object()


def _short(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = None
    return str.__str__(text) if isinstance(text, str) else f"<{type(obj).__name__}>"


# ---------------------------------------------------------------------- the tables (built once)
@functools.cache
def _tensor_methods() -> frozenset[str]:
    names = set()
    for name in dir(torch.Tensor):
        if name in _DENY_TENSOR or (name.startswith("_") and name not in _DUNDERS):
            continue
        if callable(getattr(torch.Tensor, name, None)) and not isinstance(
                getattr(torch.Tensor, name), type):
            names.add(name)
    return frozenset(names)


def _is_aten(obj: Any) -> bool:
    return isinstance(obj, types.BuiltinFunctionType) and getattr(obj, "__module__", None) in _ATEN_MODULES


@functools.cache
def _allowed() -> dict[str, Any]:
    table: dict[str, Any] = {}
    variable_functions = torch._C._VariableFunctions
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if name.startswith("_") or name in _DENY_TORCH:
            continue
        if (_is_aten(obj) and getattr(variable_functions, name, None) is obj) or (
                isinstance(obj, types.FunctionType) and obj.__module__ == "torch.functional"):
            table[f"torch.{name}"] = obj
    for name in dir(F):
        obj = getattr(F, name, None)
        if not name.startswith("_") and (_is_aten(obj) or (
                isinstance(obj, types.FunctionType) and obj.__module__ == "torch.nn.functional")):
            table[f"torch.nn.functional.{name}"] = obj
    for ns_name, ns in (("torch.special", torch.special), ("torch.linalg", torch.linalg),
                        ("torch.fft", torch.fft), ("torch._C._nn", torch._C._nn)):
        for name in dir(ns):
            obj = getattr(ns, name, None)
            if not name.startswith("_") and _is_aten(obj):
                table[f"{ns_name}.{name}"] = obj
    for name in _tensor_methods():
        table[f"torch.Tensor.{name}"] = getattr(torch.Tensor, name)
    for name in _OPERATOR:
        if hasattr(operator, name):
            table[f"operator.{name}"] = getattr(operator, name)
    for name in dir(math):
        if not name.startswith("_") and callable(getattr(math, name)):
            table[f"math.{name}"] = getattr(math, name)
    for name in _BUILTINS:
        table[f"builtins.{name}"] = getattr(builtins, name)
    return table


@functools.cache
def _allowed_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for name, obj in _allowed().items():  # first name wins: torch.* before its aliases
        names.setdefault(id(obj), name)
    return names


@functools.cache
def _modules() -> dict[str, type]:
    table: dict[str, type] = {}
    for name in dir(torch.nn):
        obj = getattr(torch.nn, name, None)
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and (
                obj.__module__.startswith("torch.nn.modules.")):
            table[f"torch.nn.{name}"] = obj
    return table
