"""Tracer: runs a module or function on Proxies and records what it does as a Graph.

``symbolic_trace(root)`` is the one-line entry point; subclass :class:`Tracer` to change
which modules stay opaque (``is_leaf_module``) or how values become nodes.

While ``Tracer.trace`` runs, it temporarily patches:

- ``nn.Module.__call__``, so submodule calls go through ``Tracer.call_module``;
- ``nn.Module.__getattr__``, so ``self.weight`` becomes a ``get_attr`` node;
- functions registered with :func:`wrap`, and the functions of ``autowrap_modules``
  (``math``), so calls on Proxies are recorded instead of executed.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import math
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from .graph import Graph, gc_paused
from .node import Argument
from .proxy import (
    _DEFAULT_CREATE_ARG,
    GraphAppendingTracer,
    Proxy,
    TraceError,
    TracerBase,
    _find_tracer,
)

__all__ = ["GraphAppendingTracer", "Tracer", "symbolic_trace", "wrap"]

# (globals dict, name) pairs registered with wrap(), and the functions registered by object.
_WRAPPED_NAMES: list[tuple[dict[str, Any], str]] = []
_WRAPPED_FNS: dict[int, Callable[..., Any]] = {}


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
        raise TypeError(f"wrap() takes a function or a function name, not {fn_or_name!r}")
    frame = sys._getframe(1)
    if frame.f_code.co_name != "<module>":
        raise NotImplementedError("wrap('name') must be called at module scope")
    _WRAPPED_NAMES.append((frame.f_globals, fn_or_name))
    return None


def _wrapper_for(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            tracer = _find_tracer(args, kwargs)
        except RuntimeError:
            return orig(*args, **kwargs)
        return tracer.create_proxy("call_function", orig, args, kwargs)
    wrapped.__fxlite_orig__ = orig  # type: ignore[attr-defined]
    return wrapped


class _Patcher:
    """Sets attributes and dict entries for the length of a trace, then restores them."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._seen: set[tuple[int, str]] = set()

    def patch_dict(self, d: dict[str, Any], name: str, new: Any) -> None:
        if (id(d), name) in self._seen:
            return
        self._seen.add((id(d), name))
        missing = name not in d
        old = d.get(name)
        d[name] = new
        self._undo.append(lambda: d.pop(name, None) if missing else d.__setitem__(name, old))

    def patch_attr(self, obj: Any, name: str, new: Any) -> None:
        old = obj.__dict__[name] if name in obj.__dict__ else getattr(obj, name)
        setattr(obj, name, new)
        self._undo.append(lambda: setattr(obj, name, old))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


class Tracer(TracerBase):
    """Turns an ``nn.Module`` or function into a :class:`Graph`.

    Args:
        autowrap_modules: modules whose functions are recorded as calls when given a
            Proxy (default: ``math``).
        autowrap_functions: extra functions treated the same way.

    Overridable hooks: ``is_leaf_module``, ``call_module``, ``create_proxy``,
    ``create_arg``, ``getattr``, ``path_of_module``.

    Example::

        class MyTracer(fxlite.Tracer):
            def is_leaf_module(self, m, qualname):
                return isinstance(m, MyBlock) or super().is_leaf_module(m, qualname)

        graph = MyTracer().trace(model)
        gm = fxlite.GraphModule(model, graph)
    """

    def __init__(self, autowrap_modules: tuple[ModuleType, ...] = (math,),
                 autowrap_functions: tuple[Callable[..., Any], ...] = ()) -> None:
        self._autowrap_modules = tuple(autowrap_modules)
        self._autowrap_ids = {
            id(v) for m in autowrap_modules for k, v in vars(m).items()
            if not k.startswith("_") and callable(v)} | {id(f) for f in autowrap_functions}
        self.root: torch.nn.Module = torch.nn.Module()
        self.graph = Graph(tracer_cls=type(self))

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
        """Handle a submodule call: record it if it is a leaf, else trace through ``forward``."""
        path = self.path_of_module(m)
        if not self.is_leaf_module(m, path):
            return forward(*args, **kwargs)
        return self.create_proxy("call_module", path, args, kwargs)

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
        """Like ``TracerBase.create_arg``; tensors become ``get_attr`` nodes.

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
        if isinstance(a, torch.nn.Module):
            raise TraceError(f"module {type(a).__name__} was passed as a value; only calls of "
                             "submodules can be traced")
        return super().create_arg(a)

    # ------------------------------------------------------------------ tracing
    def trace(self, root: torch.nn.Module | Callable[..., Any],
              concrete_args: dict[str, Any] | None = None) -> Graph:
        """Trace ``root`` and return its Graph.

        Args:
            root: an ``nn.Module`` (its ``forward`` is traced) or a function.
            concrete_args: argument values to fix during tracing; their control flow is
                resolved with these values, and the argument keeps them as defaults.
        """
        _check_traceable(root)
        if isinstance(root, torch.nn.Module):
            self.root, fn, bound = root, type(root).forward, (root,)
        else:
            self.root, fn, bound = torch.nn.Module(), root, ()
        fn = inspect.unwrap(fn)
        self.graph = Graph(tracer_cls=type(self))
        self._module_paths = {id(m): name for name, m in self.root.named_modules()}
        self._tensor_paths: dict[int, str] = {}
        for name, t in self.root.named_buffers():
            self._tensor_paths.setdefault(id(t), name)
        for name, t in self.root.named_parameters():
            self._tensor_paths.setdefault(id(t), name)
        self._constant_count = 0
        while hasattr(self.root, f"_tensor_constant{self._constant_count}"):
            self._constant_count += 1
        self._keep_alive: list[Any] = []
        self._star_args: Proxy | None = None
        args, kwargs = self._placeholders(fn, len(bound), concrete_args or {})
        call = fn
        if self._star_args is not None:  # the body must see *args as one Proxy, as in torch.fx
            call = _varargs_as_positional(fn)
            args, kwargs = [*args, *kwargs.values(), self._star_args], {}
        with self._patched(fn), gc_paused():
            result = call(*bound, *args, **kwargs)
        self.create_node("output", "output", (self.create_arg(result),), {},
                         type_expr=_hints(fn).get("return"))
        return self.graph

    def _placeholders(self, fn: Callable[..., Any], skip: int,
                      concrete: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        sig = inspect.signature(fn)
        hints = _hints(fn)
        unknown = set(concrete) - set(sig.parameters)
        if unknown:
            raise TraceError(f"concrete_args names {sorted(unknown)}, which {fn.__qualname__} "
                             f"does not take (it takes {list(sig.parameters)[skip:]})")
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in list(sig.parameters.values())[skip:]:
            if p.kind is p.VAR_KEYWORD:
                raise TraceError(f"{fn.__qualname__} takes **{p.name}, which symbolic tracing "
                                 "cannot represent; fix its keys with concrete_args")
            if p.name in concrete:
                self.graph.placeholder(p.name, hints.get(p.name), default_value=concrete[p.name])
                value: Any = concrete[p.name]
            elif p.kind is p.VAR_POSITIONAL:
                # *args is one Proxy for the whole tuple: its length is unknown while tracing
                self._star_args = self.create_proxy("placeholder", f"*{p.name}", (), {},
                                                    type_expr=hints.get(p.name))
                continue
            else:
                default = () if p.default is p.empty else (p.default,)
                value = self.create_proxy("placeholder", p.name, default, {},
                                          type_expr=hints.get(p.name))
            if p.kind is p.VAR_POSITIONAL:  # fixed by concrete_args
                args.extend(value)
            elif p.kind is p.KEYWORD_ONLY:
                kwargs[p.name] = value
            else:
                args.append(value)
        return args, kwargs

    @contextmanager
    def _patched(self, fn: Callable[..., Any]) -> Iterator[None]:
        patcher = _Patcher()
        tracer = self
        orig_call = torch.nn.Module.__call__
        orig_getattr = torch.nn.Module.__getattr__
        cache: dict[str, Any] = {}

        def module_call(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return tracer.call_module(mod, lambda *a, **k: orig_call(mod, *a, **k), args, kwargs)

        def module_getattr(mod: torch.nn.Module, attr: str) -> Any:
            return tracer.getattr(attr, orig_getattr(mod, attr), cache)

        try:
            patcher.patch_attr(torch.nn.Module, "__call__", module_call)
            patcher.patch_attr(torch.nn.Module, "__getattr__", module_getattr)
            for globals_, name in _WRAPPED_NAMES:
                orig = globals_.get(name, getattr(builtins, name, None))
                if orig is not None:
                    patcher.patch_dict(globals_, name, _wrapper_for(orig))
            fn_globals = getattr(fn, "__globals__", {})
            for name, value in list(fn_globals.items()):
                if id(value) in self._autowrap_ids or id(value) in _WRAPPED_FNS:
                    patcher.patch_dict(fn_globals, name, _wrapper_for(value))
            for module in self._autowrap_modules:
                for name, value in list(vars(module).items()):
                    if id(value) in self._autowrap_ids:
                        patcher.patch_dict(vars(module), name, _wrapper_for(value))
            yield
        finally:
            patcher.restore()


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s annotations, with string annotations (``from __future__ import annotations``) evaluated."""
    try:
        return inspect.get_annotations(fn, eval_str=True)
    except Exception:
        return dict(getattr(fn, "__annotations__", {}))


def _varargs_as_positional(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` whose keyword-only parameters and ``*args`` are plain positional ones.

    Why: while tracing, ``*args`` is a single Proxy for the tuple, so the body must receive
    that Proxy itself (``args[0]`` then records a getitem), not a 1-tuple around it.
    """
    code = fn.__code__
    flat = code.replace(co_argcount=code.co_argcount + code.co_kwonlyargcount + 1,
                        co_posonlyargcount=0, co_kwonlyargcount=0,
                        co_flags=code.co_flags & ~inspect.CO_VARARGS)
    return types.FunctionType(flat, fn.__globals__, fn.__name__, None, fn.__closure__)


_DEFAULT_CREATE_ARG.add(Tracer.create_arg)


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


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def symbolic_trace(root: torch.nn.Module | Callable[..., Any],
                   concrete_args: dict[str, Any] | None = None) -> Any:
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
    from .graph_module import GraphModule

    tracer = Tracer()
    graph = tracer.trace(root, concrete_args)
    name = type(root).__name__ if isinstance(root, torch.nn.Module) else root.__name__
    return GraphModule(tracer.root, graph, name)


__all__ += ["Proxy"]
