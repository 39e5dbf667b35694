"""Tracer: runs a module or function on Proxies and records what it does as a Graph.

``symbolic_trace(root)`` is the one-line entry point; subclass :class:`Tracer` to change
which modules stay opaque (``is_leaf_module``) or how values become nodes.

While ``Tracer.trace`` runs, the tracing thread sees these patches (other threads see the
originals; see :mod:`fxlite.patching`):

- ``nn.Module.__call__``, so submodule calls go through ``Tracer.call_module``;
- ``nn.Module.__getattr__``, so ``self.weight`` becomes a ``get_attr`` node;
- functions registered with :func:`wrap` (or with ``torch.fx.wrap`` by a library), and the
  functions of ``autowrap_modules`` (``math``), so calls on Proxies are recorded instead of
  executed.

``concrete_args`` fixes arguments while tracing. A fixed value gets a placeholder and a
guard (``torch._assert``) that checks each call passes the same value; the placeholder
object :data:`PH` keeps a value symbolic inside a fixed structure::

    gm = symbolic_trace(f, concrete_args={"flag": True})        # f(x, flag): flag_1 == True
    gm = symbolic_trace(g, concrete_args={"xs": [PH, PH]})      # g(xs): xs is a 2-list
"""

from __future__ import annotations

import builtins
import copy
import functools
import inspect
import math
import operator
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import patching
from .graph import Graph, gc_paused
from .graph_module import GraphModule
from .node import Argument, describe_value, safe_repr
from .proxy import (
    DEFAULT_CREATE_ARG,
    GraphAppendingTracer,
    Proxy,
    ProxyableClassMeta,
    TraceError,
    TracerBase,
    find_tracer,
)
from .python_code_hooks import PyTreeCodeGen

__all__ = ["PH", "GraphAppendingTracer", "PHBase", "PHWithMeta", "ProxyableClassMeta", "Tracer",
           "symbolic_trace", "wrap"]

# (globals dict, name) pairs registered with wrap(), and the functions registered by object.
_WRAPPED_NAMES: list[tuple[dict[str, Any], str]] = []
_WRAPPED_FNS: dict[int, Callable[..., Any]] = {}
# builtins recorded when given a Proxy (see _patch_wrapped), as they were at import
_BUILTINS = {name: getattr(builtins, name) for name in ("max", "min")}
_GLOBAL_IDS: set[int] = set()  # functions that every tracer records (wrap registrations)


class TraceAssertionError(TraceError, AssertionError):
    """A TraceError that is also an AssertionError, the type torch.fx raises for these cases
    (a built-in function or a missing ``traced_func_name`` as the root)."""


def wrap(fn_or_name: str | Callable[..., Any]) -> Any:
    """Record calls to a function as single ``call_function`` nodes instead of tracing into it.

    Call it at module scope with a name (``fxlite.wrap('len')``), or use it as a decorator.
    Only calls that receive a Proxy are recorded; other calls run normally.

    Example::

        fxlite.wrap('sqrt')          # at module scope, after `from math import sqrt`

        @fxlite.wrap
        def torch_randn(x, shape):
            return torch.randn(shape)
    """
    if callable(fn_or_name):
        fn = fn_or_name
        _WRAPPED_FNS[id(fn)] = fn
        globals_ = getattr(fn, "__globals__", None)
        if globals_ is not None:
            _WRAPPED_NAMES.append((globals_, fn.__name__))
        return fn
    if not isinstance(fn_or_name, str):
        raise TypeError(f"wrap: fn_or_name must be a function or a function's name (a str), "
                        f"not {describe_value(fn_or_name)}")
    frame = sys._getframe(1)
    if frame.f_code.co_name != "<module>":
        raise NotImplementedError("wrap('name') must be called at module scope")
    _WRAPPED_NAMES.append((frame.f_globals, fn_or_name))
    return None


def _torch_fx_registrations() -> list[tuple[dict[str, Any], str]]:
    """Names that libraries registered with ``torch.fx.wrap`` (torchvision does, for example)."""
    st = sys.modules.get("torch.fx._symbolic_trace")
    registry = getattr(st, "_wrapped_fns_to_patch", None)
    if isinstance(registry, dict):  # {(id(globals), name): globals}
        return [(g, key[1]) for key, g in registry.items()]
    if isinstance(registry, list):  # older torch: [(globals, name)]
        return [(g, name) for g, name in registry]
    return []


_WRAPPERS: dict[int, Callable[..., Any]] = {}  # id(orig) -> its wrapper, made once


def _wrapper_for(orig: Callable[..., Any]) -> Callable[..., Any]:
    wrapper = _WRAPPERS.get(id(orig))
    if wrapper is None or wrapper.__fxlite_orig__ is not orig:  # type: ignore[attr-defined]
        wrapper = _WRAPPERS[id(orig)] = _make_wrapper(orig)
    return wrapper


def _make_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    plain_with_kwargs = any(orig is f for f in _BUILTINS.values())

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs and plain_with_kwargs:  # max(..., key=f): f could not be written out
            return orig(*args, **kwargs)
        try:
            tracer = find_tracer(args, kwargs)
        except RuntimeError:
            return orig(*args, **kwargs)
        if id(orig) not in _GLOBAL_IDS and id(orig) not in getattr(tracer, "_autowrap_ids", ()):
            return orig(*args, **kwargs)  # another thread's trace wrapped it, not this one
        return tracer.create_proxy("call_function", orig, args, kwargs)
    wrapped.__fxlite_orig__ = orig  # type: ignore[attr-defined]
    return wrapped


# ---------------------------------------------------------------------- placeholders
class PHBase:
    """A placeholder inside ``concrete_args``: this leaf stays a traced input.

    Subclass it to attach attributes; they are copied onto the placeholder node (unless
    the node already has them).
    """

    def __repr__(self) -> str:
        return "PH"


PH = PHBase()


class PHWithMeta(PHBase):
    """A placeholder that carries a user key onto its node as ``node.ph_key``."""

    def __init__(self, ph_key: str | None = None) -> None:
        super().__init__()
        self.ph_key = ph_key


def _assert_is_none(value: Any, msg: str) -> None:
    assert value is None, msg


_assert_is_none._is_impure = True  # type: ignore[attr-defined]  # DCE keeps the guard
_GUARDED = (bool, int, float, str, complex, torch.dtype, torch.device)


def _transfer_attrs(src: PHBase, node: Any) -> None:
    for name in dir(src):
        if name.startswith("__"):
            continue
        value = getattr(src, name)
        if not callable(value) and not hasattr(node, name):
            setattr(node, name, value)


class Tracer(TracerBase):
    """Turns an ``nn.Module`` or function into a :class:`Graph`.

    Args:
        autowrap_modules: modules whose functions are recorded as calls when given a
            Proxy (default: ``math``).
        autowrap_functions: extra functions treated the same way.
        param_shapes_constant: accepted for torch.fx compatibility; parameter shapes are
            recorded as ``getattr`` nodes either way, which gives the same results.

    Attributes:
        traced_func_name: the method of a module root that is traced (``"forward"``).
        record_stack_traces: store the user's stack in ``node.meta["stack_trace"]``.

    Overridable hooks: ``is_leaf_module``, ``call_module``, ``create_proxy``,
    ``create_node``, ``create_arg``, ``getattr``, ``path_of_module``.

    Example::

        class MyTracer(fxlite.Tracer):
            def is_leaf_module(self, m, qualname):
                return isinstance(m, MyBlock) or super().is_leaf_module(m, qualname)

        graph = MyTracer().trace(model)
        gm = fxlite.GraphModule(model, graph)
    """

    traced_func_name: str = "forward"

    def __init__(self, autowrap_modules: tuple[ModuleType, ...] = (math,),
                 autowrap_functions: tuple[Callable[..., Any], ...] = (),
                 param_shapes_constant: bool = False) -> None:
        autowrap_modules = _check_items(autowrap_modules, "autowrap_modules", "a module",
                                        lambda m: isinstance(m, ModuleType), "(math,)")
        autowrap_functions = _check_items(autowrap_functions, "autowrap_functions", "a function",
                                          callable, "(my_fn,)")
        self._autowrap_modules = tuple(autowrap_modules)
        self._autowrap_ids = {
            id(v) for m in autowrap_modules for k, v in vars(m).items()
            if not k.startswith("_") and callable(v)} | {id(f) for f in autowrap_functions}
        self.param_shapes_constant = param_shapes_constant
        self.root: torch.nn.Module = torch.nn.Module()
        self.graph = Graph(tracer_cls=type(self))
        self.module_stack: dict[str, tuple[str, type]] = {}
        self._trace_frame: Any = None

    def __deepcopy__(self, memo: dict) -> Tracer:
        # Modules (autowrap_modules) cannot be deep-copied; they are shared.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = v if k in ("_autowrap_modules", "_trace_frame") else copy.deepcopy(v, memo)
        return new

    # ------------------------------------------------------------------ hooks
    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        """Whether ``m`` is recorded as one ``call_module`` node (True) or traced through.

        By default the standard ``torch.nn`` modules are leaves, except ``Sequential``.
        """
        mod = type(m).__module__
        return (mod.startswith("torch.nn") or mod.startswith("torch.ao.nn")) and not isinstance(
            m, torch.nn.Sequential)

    def path_of_module(self, mod: torch.nn.Module) -> str:
        """The dotted path of ``mod`` inside the root module; NameError if it is not there."""
        path = self._module_paths.get(id(mod))
        if path is None:
            raise NameError(f"module {type(mod).__name__} is not a submodule of the traced root; "
                            "assign it as an attribute of the root (or of one of its submodules)")
        return path

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
        """Handle a submodule call: record it if it is a leaf, else trace through ``forward``.

        While it runs, ``module_stack`` names the module; the nodes created meanwhile get
        it as ``node.meta["nn_module_stack"]``.
        """
        path = self.path_of_module(m)
        stack = self.module_stack
        entered = path not in stack
        if entered:
            stack[path] = (path, type(m))
        try:
            if not self.is_leaf_module(m, path):
                return forward(*args, **kwargs)
            return self.create_proxy("call_module", path, args, kwargs)
        finally:
            if entered:
                del stack[path]

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """Handle ``module.attr`` during tracing: parameters become ``get_attr`` nodes."""
        if isinstance(attr_val, torch.nn.Parameter):
            path = self._tensor_paths.get(id(attr_val))
            if path is not None:
                if path not in parameter_proxy_cache:
                    parameter_proxy_cache[path] = self.create_proxy("get_attr", path, (), {})
                return parameter_proxy_cache[path]
        return attr_val

    def create_arg(self, a: Any) -> Argument:
        """Like ``TracerBase.create_arg``; tensors and submodules become ``get_attr`` nodes.

        Parameters and buffers of the root are read by their own path; other tensors are
        stored on the root as ``_tensor_constant0``, ``_tensor_constant1``...
        """
        if isinstance(a, torch.Tensor):
            path = self._tensor_paths.get(id(a))
            if path is None:
                path = f"_tensor_constant{self._constant_count}"
                self._constant_count += 1
                setattr(self.root, path, a)
                self._tensor_paths[id(a)] = path
                self._keep_alive.append(a)
            return self.create_node("get_attr", path, (), {})
        if isinstance(a, torch._C.ScriptModule):  # the C++ half of a TorchScript submodule
            for path, m in self.root.named_modules():
                if getattr(m, "_c", None) == a:  # a new wrapper each time: compare, not `is`
                    return self.create_node("get_attr", f"{path}._c" if path else "_c", (), {})
        if isinstance(a, torch.nn.Module):
            path = self._module_paths.get(id(a))
            if path is None:
                raise TraceError(f"module {type(a).__name__} was passed as a value but is not a "
                                 "submodule of the traced root; assign it as an attribute of "
                                 "the root so the graph can refer to it")
            return self.create_node("get_attr", path, (), {})
        return super().create_arg(a)

    # ------------------------------------------------------------------ tracing
    def trace(self, root: torch.nn.Module | Callable[..., Any],
              concrete_args: dict[str, Any] | tuple | None = None) -> Graph:
        """Trace ``root`` and return its Graph.

        Args:
            root: an ``nn.Module`` (its ``traced_func_name`` method is traced) or a function.
            concrete_args: argument values to fix while tracing, by name (a dict) or by
                position (a tuple). Control flow on them is resolved with these values, and
                a guard checks that each call passes the same value. :data:`PH` inside a
                fixed structure keeps that leaf symbolic.
        """
        _check_traceable(root)
        _check_concrete_args(concrete_args)
        if isinstance(root, torch.nn.Module):
            fn = getattr(type(root), self.traced_func_name, None)
            if fn is None:
                raise TraceAssertionError(
                    f"traced_func_name={self.traced_func_name} doesn't exist in "
                    f"{type(root).__name__}; set Tracer.traced_func_name to one of its methods")
            self.root, bound = root, (root,)
        else:
            self.root, fn, bound = torch.nn.Module(), root, ()
        code_fn = inspect.unwrap(fn)
        if not isinstance(code_fn, types.FunctionType):
            raise TraceAssertionError(
                f"cannot trace {fn!r}: it is built in and has no Python code to run on "
                "Proxies. To record it as one node, trace a function that calls it, e.g. "
                "symbolic_trace(lambda x: f(x))")
        self.graph = Graph(tracer_cls=type(self))
        code = code_fn.__code__
        self.graph._co_fields = {"co_filename": code.co_filename,
                                 "co_firstlineno": code.co_firstlineno, "co_name": code.co_name}
        self._module_paths = {}
        self._tensor_paths: dict[int, str] = {}
        params: dict[int, str] = {}
        modules = []
        for path, m in self.root.named_modules():  # one walk (named_buffers would walk again)
            self._module_paths[id(m)] = path
            modules.append(m)
            prefix = f"{path}." if path else ""
            for name, t in m._buffers.items():
                if t is not None:
                    self._tensor_paths.setdefault(id(t), prefix + name)
            for name, t in m._parameters.items():
                if t is not None:
                    params.setdefault(id(t), prefix + name)
        for key, path in params.items():  # buffers first, as before
            self._tensor_paths.setdefault(key, path)
        self._constant_count = 0
        while _has_own(self.root, f"_tensor_constant{self._constant_count}"):
            self._constant_count += 1
        self._keep_alive: list[Any] = []
        self.module_stack = {}
        call, args, tree = self._root_call(fn, code_fn, bound, concrete_args)
        # Module roots patch their modules' classes; a function root has no submodules to
        # intercept (a module it creates is traced through).
        classes = patching.classes_to_patch(modules) if bound else []
        with patching.tracing(self, classes) as session, gc_paused():
            self._patch_wrapped(session, code_fn)
            self._trace_frame = sys._getframe()
            try:
                result = call(*bound, *args)
            finally:
                self._trace_frame = None
        type_expr = _hints(code_fn).get("return")
        if tree is not None:  # outputs are flattened too; the code generator rebuilds them
            result, out_spec = pytree.tree_flatten(result)
            self.graph.set_codegen(PyTreeCodeGen(tree[0], tree[1], out_spec))
            type_expr = None
        self.create_node("output", "output", (self.create_arg(result),), {}, type_expr=type_expr)
        return self.graph

    def _root_call(self, fn: Callable[..., Any], code_fn: types.FunctionType, bound: tuple,
                   concrete_args: dict[str, Any] | tuple | None) -> tuple[Callable[..., Any], list, Any]:
        """Create the placeholders; return how to call ``fn``, its arguments, and the input
        pytree (argument names, spec) when ``concrete_args`` fixed a structure."""
        sig = inspect.signature(code_fn)
        hints = _hints(code_fn)
        params = list(sig.parameters.values())
        if bound and (not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                            inspect.Parameter.POSITIONAL_OR_KEYWORD)):
            raise TraceError(
                f"{code_fn.__qualname__} has no `self` parameter: ``self`` argument cannot be "
                "part of *args expansion. Declare it: def forward(self, *args, **kwargs)")
        params = params[len(bound):]
        concrete = self._concrete_by_name(code_fn, params, concrete_args)
        values: list[Any] = []
        for p in params:
            if p.name in concrete:
                values.append(self._fixed(p, concrete[p.name]))
            elif p.kind is p.VAR_POSITIONAL:  # one Proxy for the whole tuple, as in torch.fx
                values.append(self.create_proxy("placeholder", f"*{p.name}", (), {},
                                                type_expr=hints.get(p.name)))
            elif p.kind is p.VAR_KEYWORD:
                values.append(self.create_proxy("placeholder", f"**{p.name}", (), {},
                                                type_expr=hints.get(p.name)))
            else:
                default = () if p.default is p.empty else (p.default,)
                values.append(self.create_proxy("placeholder", p.name, default, {},
                                                type_expr=hints.get(p.name)))
        tree = None
        if concrete:
            spec = pytree.tree_flatten(tuple(values))[1]
            if any(not c.is_leaf() for c in _children(spec)):
                tree = ([("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD
                          else "") + p.name for p in params], spec)
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            if fn is not code_fn:
                raise TraceError(
                    f"{code_fn.__qualname__} is wrapped by a decorator and takes *args or "
                    "**kwargs, which tracing passes as single values; fix them with "
                    "concrete_args, or trace the undecorated function")
            # *args and **kwargs are single values here: pass them as plain positionals.
            return _all_positional(code_fn), values, tree
        positional = [v for p, v in zip(params, values) if p.kind is not p.KEYWORD_ONLY]
        keywords = {p.name: v for p, v in zip(params, values) if p.kind is p.KEYWORD_ONLY}
        if not keywords:
            return fn, positional, tree
        return (lambda *a: fn(*a, **keywords)), positional, tree

    def _concrete_by_name(self, code_fn: types.FunctionType, params: list[inspect.Parameter],
                          concrete_args: dict[str, Any] | tuple | None) -> dict[str, Any]:
        if concrete_args is None:
            return {}
        if isinstance(concrete_args, tuple):  # by position; extra values fill *args
            named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            star = [p for p in params if p.kind is p.VAR_POSITIONAL]
            if len(concrete_args) > len(named) and not star:
                raise TraceError(f"concrete_args has {len(concrete_args)} values but "
                                 f"{code_fn.__qualname__} takes {len(named)} positional arguments")
            out = dict(zip((p.name for p in named), concrete_args))
            if len(concrete_args) > len(named):
                out[star[0].name] = tuple(concrete_args[len(named):])
            return out
        unknown = set(concrete_args) - {p.name for p in params}
        if unknown:
            raise TraceError(f"concrete_args names {sorted(unknown)}, which {code_fn.__qualname__} "
                             f"does not take (it takes {[p.name for p in params]})")
        return dict(concrete_args)

    def _fixed(self, p: inspect.Parameter, value: Any) -> Any:
        """The value the body sees for a fixed argument: each leaf gets a placeholder
        (``name_1``, ``name_2``...); PH leaves stay symbolic, the others get a guard."""
        count = 0
        default = () if p.default is p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) \
            else (p.default,)

        def leaf(x: Any) -> Any:
            nonlocal count
            count += 1
            out = self.create_proxy("placeholder", f"{p.name}_{count}", default, {})
            if isinstance(x, PHBase):
                if x is not PH:
                    _transfer_attrs(x, out.node)
                return out
            msg = f"{p.name} has been specialized to have value {x} but got another value"
            if x is None:
                self.create_proxy("call_function", _assert_is_none, (out, msg), {})
            elif type(x) in _GUARDED:
                eq = self.create_proxy("call_function", operator.eq, (out, x), {})
                self.create_proxy("call_function", torch._assert, (eq, msg), {})
            else:
                warnings.warn(f"concrete_args[{p.name!r}] holds {type(x).__name__} {x!r}, "
                              "which no guard can check: calls of the traced module must pass "
                              "the same value", stacklevel=4)
            return x

        return pytree.tree_map(leaf, value)

    def _patch_wrapped(self, session: Any, code_fn: types.FunctionType) -> None:
        for globals_, name in _WRAPPED_NAMES + _torch_fx_registrations():
            orig = globals_.get(name, getattr(builtins, name, None))
            orig = getattr(orig, "__fxlite_orig__", orig)
            if orig is not None:
                _GLOBAL_IDS.add(id(orig))
                session.patch_dict(globals_, name, lambda old, o=orig: _wrapper_for(o))
        fn_globals = code_fn.__globals__
        for name, value in list(fn_globals.items()):
            if id(value) in self._autowrap_ids or id(value) in _WRAPPED_FNS:
                if id(value) in _WRAPPED_FNS:
                    _GLOBAL_IDS.add(id(value))
                session.patch_dict(fn_globals, name, lambda old, o=value: _wrapper_for(o))
        for module in self._autowrap_modules:
            namespace = vars(module)
            for name, value in list(namespace.items()):
                if id(value) in self._autowrap_ids:
                    session.patch_dict(namespace, name, lambda old, o=value: _wrapper_for(o))
        # max(size - k, 0) on a traced size (timm's TensorFlow-style "same" padding):
        # recorded as a call, as torch.fx cannot; plain values pass straight through
        for name, orig in _BUILTINS.items():
            _GLOBAL_IDS.add(id(orig))
            session.patch_dict(vars(builtins), name, lambda old, o=orig: _wrapper_for(o))


def _has_own(module: torch.nn.Module, name: str) -> bool:
    """``hasattr(module, name)`` without ``nn.Module.__getattr__``'s costly miss."""
    d = module.__dict__
    return name in d or any(name in d[t] for t in ("_parameters", "_buffers", "_modules")) \
        or hasattr(type(module), name)


def _children(spec: Any) -> list[Any]:
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s annotations, with string annotations (``from __future__ import annotations``) evaluated."""
    try:
        return inspect.get_annotations(fn, eval_str=True)
    except Exception:
        return dict(getattr(fn, "__annotations__", {}))


def _all_positional(fn: types.FunctionType) -> Callable[..., Any]:
    """A copy of ``fn`` whose keyword-only parameters, ``*args`` and ``**kwargs`` are plain
    positional ones.

    Why: while tracing, ``*args`` and ``**kwargs`` are single Proxies, so the body must
    receive those Proxies themselves (``args[0]`` then records a getitem), not a 1-tuple
    around them.
    """
    code = fn.__code__
    stars = bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    flat = code.replace(co_argcount=code.co_argcount + code.co_kwonlyargcount + stars,
                        co_posonlyargcount=0, co_kwonlyargcount=0,
                        co_flags=code.co_flags & ~(inspect.CO_VARARGS | inspect.CO_VARKEYWORDS))
    return types.FunctionType(flat, fn.__globals__, fn.__name__, None, fn.__closure__)


DEFAULT_CREATE_ARG.add(Tracer.create_arg)


def _check_traceable(root: Any) -> None:
    """Say exactly what is wrong with a root that is neither a module instance nor a function."""
    if isinstance(root, type):
        name = root.__qualname__
        if issubclass(root, torch.nn.Module):
            raise TypeError(f"symbolic_trace got the module class {name}, not an instance: "
                            f"build it first, e.g. symbolic_trace({name}(...))")
        raise TypeError(f"symbolic_trace got the class {name}; it traces an nn.Module "
                        f"instance or a function")
    if not callable(root):
        raise TypeError(f"symbolic_trace expects an nn.Module or a function, not "
                        f"{type(root).__name__} ({_short_repr(root)})")


def _check_concrete_args(concrete_args: Any) -> None:
    """A TypeError naming ``concrete_args`` unless it is None, a dict or a tuple (before the
    trace starts, so nothing of the tracer changes)."""
    if concrete_args is None or isinstance(concrete_args, (Mapping, tuple)):
        return
    fix = "tuple(values)" if isinstance(concrete_args, list) else "{'x': value}"
    raise TypeError(f"symbolic_trace: concrete_args must be a dict {{argument name: value}} or a "
                    f"tuple of values by position, not {describe_value(concrete_args)}; "
                    f"e.g. concrete_args={fix}")


def _check_items(values: Any, argument: str, what: str, ok: Callable[[Any], bool],
                 example: str) -> tuple:
    """``tuple(values)`` if every item is ``what``; a TypeError naming ``argument`` otherwise."""
    items = None
    if not isinstance(values, (str, bytes, ModuleType)):
        try:
            items = tuple(values)
        except TypeError:
            pass
    if items is None:
        raise TypeError(f"Tracer: {argument} must be a tuple of items, each {what}, not "
                        f"{describe_value(values)}; e.g. {argument}={example}")
    for item in items:
        if not ok(item):
            raise TypeError(f"Tracer: each item of {argument} must be {what}, not "
                            f"{describe_value(item)}; e.g. {argument}={example}")
    return items


def _short_repr(value: Any) -> str:
    text = safe_repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def symbolic_trace(root: torch.nn.Module | Callable[..., Any],
                   concrete_args: dict[str, Any] | tuple | None = None) -> Any:
    """Trace ``root`` and return a runnable :class:`~fxlite.GraphModule`.

    Args:
        root: an ``nn.Module`` or a function.
        concrete_args: argument values to fix while tracing (see ``Tracer.trace``).

    Returns:
        A GraphModule whose ``forward`` is the regenerated code of the trace.

    Example::

        gm = fxlite.symbolic_trace(lambda x: torch.relu(x) + 1)
        print(gm.code)
    """
    tracer = Tracer()
    graph = tracer.trace(root, concrete_args)
    name = type(root).__name__ if isinstance(root, torch.nn.Module) else root.__name__
    return GraphModule(tracer.root, graph, name)


__all__ += ["Proxy"]
