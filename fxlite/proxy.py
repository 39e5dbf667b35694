"""Proxy: the stand-in value that records every operation applied to it as a Node.

During tracing, each input is a :class:`Proxy`. Python operators, attribute access,
method calls and ``torch.*`` / ``torch.nn.functional.*`` calls (through
``__torch_function__``) on a Proxy each append a Node to the tracer's graph and return a
new Proxy. What a Proxy cannot do is reveal a value: ``bool()``, ``len()`` and iteration
of unknown length raise :class:`TraceError`, naming the user's line.

:class:`GraphAppendingTracer` lets a transform use Proxies to write new nodes into an
existing graph, as in the torch.fx decomposition example::

    tracer = GraphAppendingTracer(new_graph)
    out = relu_decomposition(Proxy(env[x.name], tracer))   # appends gt and mul nodes
"""

from __future__ import annotations

import dataclasses
import dis
import linecache
import operator
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch

from .graph import Graph
from .node import Argument, Node, Target

__all__ = ["DEFAULT_CREATE_ARG", "Attribute", "GraphAppendingTracer", "Proxy",
           "ProxyableClassMeta", "TraceError", "TracerBase", "find_tracer"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class TraceError(ValueError, RuntimeError):
    """Raised when a program cannot be traced symbolically.

    The message names the user's file, line and source text, and how to fix it.
    """


def user_frame(start: FrameType | None = None) -> FrameType | None:
    """The innermost frame that belongs to neither fxlite nor torch: the user's code."""
    f = start or sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not (fn.startswith(_HERE) or fn.startswith(_TORCH_DIR) or fn.startswith("<fxlite")):
            return f
        f = f.f_back
    return None


def user_location(frame: FrameType | None = None) -> str:
    """``File "x.py", line 6, in f`` plus the source line, for the user's frame."""
    f = user_frame(frame or sys._getframe(1))
    if f is None:
        return "  (no user frame found)"
    line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
    return f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {f.f_code.co_name}\n    {line}'


def _user_stack(tracer: TracerBase) -> str:
    """The user's frames, outermost first, from the traced function down to this call.

    Frames of fxlite and torch, and of the tracer's own methods (a ``create_node``
    override), are left out.
    """
    boundary = getattr(tracer, "_trace_frame", None)
    frames = []
    f = sys._getframe(2)
    while f is not None and f is not boundary:
        fn = f.f_code.co_filename
        if not (fn.startswith(_HERE) or fn.startswith(_TORCH_DIR) or fn.startswith("<fxlite")) \
                and not ("self" in f.f_code.co_varnames and f.f_locals.get("self") is tracer):
            frames.append(traceback.FrameSummary(fn, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    if boundary is None:  # no trace() frame to stop at: only the innermost user frame
        frames = frames[:1]
    return "".join(traceback.format_list(frames[::-1]))


_FIXES = (
    "To trace it, either:\n"
    "  - fix the value with concrete_args, e.g. symbolic_trace(f, concrete_args={'flag': True}),\n"
    "    if it comes from an argument that does not change between calls;\n"
    "  - move the code into a function decorated with @fxlite.wrap, so it is recorded as one call;\n"
    "  - or make the module that contains it a leaf (override Tracer.is_leaf_module)."
)


class TracerBase:
    """The part of a tracer that Proxies talk to: it turns operations into nodes."""

    graph: Graph
    record_stack_traces: bool = False
    # When True, tracing an operation that writes into an argument (``torch.sigmoid(x,
    # out=y)``, ``torch.relu_(x)``) raises instead of recording it, as in torch.fx.
    check_mutable_operations: bool = False

    def create_node(self, kind: str, target: Target, args: tuple, kwargs: dict,
                    name: str | None = None, type_expr: Any = None) -> Node:
        """Append a node to ``self.graph``. Override to tag or redirect nodes."""
        if self.check_mutable_operations and kind == "call_function":
            mutable = _mutable_op(target, args, kwargs)
            if mutable:
                raise RuntimeError(
                    f"Tried to trace mutable operation {mutable}. Tracing here only records "
                    f"functional code, and this call writes into an argument.\n{user_location()}\n"
                    "Use the out-of-place form (y = torch.sigmoid(x)), or set "
                    "check_mutable_operations = False on the tracer to record it anyway.")
        node = self.graph.create_node(kind, target, args, kwargs, name, type_expr)
        stack = getattr(self, "module_stack", None)
        if stack:
            node.meta["nn_module_stack"] = dict(stack)
        if self.record_stack_traces:
            node.meta["stack_trace"] = _user_stack(self)
        return node

    def proxy(self, node: Node) -> Proxy:
        """Wrap ``node`` in a Proxy owned by this tracer."""
        return Proxy(node, self)

    def create_proxy(self, kind: str, target: Target, args: tuple, kwargs: dict,
                     name: str | None = None, type_expr: Any = None) -> Proxy:
        """Record an operation: convert the arguments with ``create_arg``, add a node, wrap it."""
        if type(self).create_arg in DEFAULT_CREATE_ARG:
            # Same result as create_arg for Proxies and plain values, without the calls.
            args_ = tuple([x.node if type(x) is Proxy else x if type(x) in _ATOMS
                           else self.create_arg(x) for x in args])
        else:
            args_ = self.create_arg(args)
        kwargs_ = self.create_arg(kwargs) if kwargs else {}
        return self.proxy(self.create_node(kind, target, args_, kwargs_, name, type_expr))

    def create_arg(self, a: Any) -> Argument:
        """Turn a value seen during tracing into a node argument (Proxies become Nodes)."""
        t = type(a)
        if t in _ATOMS:
            return a
        if isinstance(a, Proxy):
            return a.node
        if t is tuple or t is list:
            return t([self.create_arg(x) for x in a])
        if hasattr(t, "__fx_create_arg__"):  # the object says how it becomes an argument
            return a.__fx_create_arg__(self)
        if isinstance(a, tuple) and hasattr(a, "_fields"):
            return t(*[self.create_arg(x) for x in a])
        if isinstance(a, (tuple, list)):
            items = [self.create_arg(x) for x in a]
            return tuple(items) if t is torch.Size else t(items)
        if isinstance(a, dict):
            for k in a:
                if isinstance(k, (Proxy, Node)):
                    raise TraceError(
                        f"a dict used as an argument has the traced value {k!r} as a key; keys "
                        f"for dictionaries used as an argument cannot contain a Node\n"
                        f"{user_location()}\nUse constant keys (str, int...).")
            return {k: self.create_arg(v) for k, v in a.items()}
        if t is slice:
            return slice(self.create_arg(a.start), self.create_arg(a.stop), self.create_arg(a.step))
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            # Rebuilt by a call at run time, so fields that hold traced values are computed.
            fields = {f.name: self.create_arg(getattr(a, f.name))
                      for f in dataclasses.fields(a) if f.init}
            return self.create_node("call_function", t, (), fields)
        return a

    def to_bool(self, obj: Proxy) -> bool:
        """Called for ``bool(proxy)``, as in ``if x.sum() > 0:``. Raises TraceError."""
        raise TraceError(
            "symbolically traced variables cannot be used as inputs to control flow\n"
            f"{user_location()}\n"
            f"The condition depends on {obj.node.name!r}, a value computed from the inputs, "
            f"so it can change from call to call.\n{_FIXES}")

    def iter(self, obj: Proxy) -> Iterator[Proxy]:
        """Called for ``iter(proxy)``: works for unpacking of a known length, else raises."""
        frame = sys._getframe(2)  # the user frame running UNPACK_SEQUENCE
        count = _unpack_count(frame)
        if count is not None:
            return iter([obj[i] for i in range(count)])
        raise TraceError(
            f"Proxy object cannot be iterated: the length of the traced value "
            f"{obj.node.name!r} is not known while tracing\n{user_location()}\n"
            "Unpack it with a fixed count (a, b = x), index it (x[0]), or\n" + _FIXES)

    def keys(self, obj: Proxy) -> Any:
        """Called for ``**proxy``: records ``proxy.keys()``."""
        return Attribute(obj, "keys")()


def _mutable_op(target: Any, args: tuple, kwargs: dict) -> str | None:
    """The schema of a torch builtin call that writes into an argument, or None.

    The call is matched against the overloads' schemas by argument count and keyword names;
    as in torch.fx, only a call that matches exactly one (mutable) overload is reported.
    """
    name = getattr(target, "__name__", None)
    if not isinstance(name, str) or isinstance(target, type) or getattr(
            target, "__module__", None) not in (None, "torch", "torch._C._nn",
                                                "torch._C._VariableFunctions", "torch.functional"):
        return None
    get_schemas = getattr(torch._C, "_jit_get_schemas_for_operator", None)
    if get_schemas is None:
        return None
    try:
        schemas = get_schemas(f"aten::{name}")
    except RuntimeError:
        return None
    matched = [s for s in schemas if _binds(s, len(args), kwargs)]
    if len(matched) == 1 and matched[0].is_mutable:
        return str(matched[0])
    return None


def _binds(schema: Any, n_args: int, kwargs: dict) -> bool:
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if n_args > len(positional):
        return False
    names = {a.name for a in schema.arguments}
    if any(k not in names for k in kwargs):
        return False
    given = {a.name for a in positional[:n_args]} | set(kwargs)
    return all(a.name in given or a.has_default_value() for a in schema.arguments)


_ATOMS = frozenset({int, float, bool, str, type(None), complex, bytes, type(...), torch.dtype,
                    torch.device, torch.memory_format, torch.layout, range})
DEFAULT_CREATE_ARG: set[Callable[..., Any]] = set()
"""The ``create_arg`` implementations whose answer for Proxies and plain constants
``create_proxy`` may inline (a tracing speed-up); registered from above: fxlite.tracer adds
``Tracer.create_arg``. A subclass overriding ``create_arg`` is always called."""
_UNPACK_CACHE: dict[tuple[Any, int], int | None] = {}


def _unpack_count(frame: FrameType) -> int | None:
    key = (frame.f_code, frame.f_lasti)
    if key not in _UNPACK_CACHE:
        count = None
        for inst in dis.get_instructions(frame.f_code):
            if inst.offset == frame.f_lasti:
                if inst.opname == "UNPACK_SEQUENCE":
                    count = inst.argval
                break
        _UNPACK_CACHE[key] = count
    return _UNPACK_CACHE[key]


DEFAULT_CREATE_ARG.add(TracerBase.create_arg)


class GraphAppendingTracer(TracerBase):
    """A tracer that appends nodes to an existing graph; for Proxy-based transforms."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph


class ProxyableClassMeta(type):
    """A metaclass: building an instance from traced values records one ``call_function``
    node whose target is the class, so the object is built when the graph runs.

    Example::

        class TensorPair(metaclass=fxlite.ProxyableClassMeta):
            def __init__(self, left, right):
                self.left, self.right = left, right

        def f(x, y):
            return TensorPair(x, y)       # traced: %tensor_pair = call_function[TensorPair](x, y)
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            tracer = find_tracer(args, kwargs)
        except RuntimeError:  # no traced value among the arguments: build it now
            return super().__call__(*args, **kwargs)
        return tracer.create_proxy("call_function", cls, args, kwargs)


class Proxy:
    """A traced value. Operations on it record nodes in ``tracer.graph``.

    Args:
        node: the node whose value this Proxy stands for.
        tracer: the tracer to record into; defaults to one appending to ``node.graph``.

    Example::

        tracer = GraphAppendingTracer(graph)
        y = Proxy(x_node, tracer) * 2        # appends a mul node; y.node is it
    """

    def __init__(self, node: Node, tracer: TracerBase | None = None) -> None:
        self.node = node
        self.tracer = tracer if tracer is not None else GraphAppendingTracer(node.graph)

    def __repr__(self) -> str:
        return f"Proxy({self.node.name})"

    def __getattr__(self, name: str) -> Attribute:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # keep copy/pickle/numpy protocol probes off the graph
        return Attribute(self, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Proxy:
        return self.tracer.create_proxy("call_method", "__call__", (self, *args), kwargs)

    def __iter__(self) -> Iterator[Proxy]:
        return self.tracer.iter(self)

    def __bool__(self) -> bool:
        return self.tracer.to_bool(self)

    def __len__(self) -> int:
        raise TraceError(
            f"'len' is not supported in symbolic tracing by default: the length of "
            f"{self.node.name!r} is not known while tracing.\n{user_location()}\n"
            "If you want this call to be recorded, call fxlite.wrap('len') at module scope, "
            "or use x.size(0) / x.shape[0], which are traced.")

    def __index__(self) -> int:
        raise TraceError(f"a traced value ({self.node.name!r}) cannot be used as a Python "
                         f"integer\n{user_location()}\n{_FIXES}")

    def keys(self) -> Any:
        return self.tracer.keys(self)

    __hash__ = object.__hash__

    @classmethod
    def __torch_function__(cls, orig_method: Callable[..., Any], types: tuple,
                           args: tuple = (), kwargs: dict | None = None) -> Proxy:
        kwargs = kwargs or {}
        tracer = find_tracer(args, kwargs)
        if isinstance(orig_method, torch._C.ScriptMethod):  # a TorchScript submodule's method
            return tracer.create_proxy("call_method", orig_method.name,
                                       (orig_method.owner, *args), kwargs)
        if is_tensor_method(orig_method):
            return tracer.create_proxy("call_method", orig_method.__name__, args, kwargs)
        return tracer.create_proxy("call_function", orig_method, args, kwargs)


_TENSOR_METHOD: dict[Any, bool] = {}


def is_tensor_method(fn: Any) -> bool:
    # Cached: torch's check wraps every call in warnings.catch_warnings, which cost about
    # a tenth of tracing time on big graphs, and its first call builds a table of every
    # overridable function (about 13 ms). The answer never changes for a given function.
    # A method bound to an object is not cached: the key would keep the object (an
    # optimizer, and through it a model's parameters and state) alive for good.
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, (type, types.ModuleType)):
        return _tensor_method_uncached(fn)
    try:
        return _TENSOR_METHOD[fn]
    except KeyError:
        result = _TENSOR_METHOD[fn] = _tensor_method_uncached(fn)
        return result
    except TypeError:  # unhashable
        return torch.overrides.is_tensor_method_or_property(fn)


def _tensor_method_uncached(fn: Any) -> bool:
    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        if name == "__get__" or getattr(torch.Tensor, name, None) is fn:
            return True  # a method or a property getter of Tensor
        for namespace in (torch, torch.nn.functional, torch.special, torch.linalg, torch.fft):
            if getattr(namespace, name, None) is fn:
                return False  # a public torch function
    return torch.overrides.is_tensor_method_or_property(fn)


def find_tracer(args: Any, kwargs: dict) -> TracerBase:
    """The tracer of the first Proxy among ``args`` and ``kwargs`` (searched in nested tuples,
    lists and dicts); RuntimeError if there is none."""
    stack = [args, kwargs]
    while stack:
        x = stack.pop()
        if isinstance(x, Proxy):
            return x.tracer
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    raise RuntimeError("no Proxy among the arguments")


class Attribute(Proxy):
    """``proxy.name``: becomes a method call if called, else a ``getattr`` node on first use."""

    def __init__(self, root: Proxy, attr: str) -> None:
        self.root, self.attr, self.tracer = root, attr, root.tracer
        self._node: Node | None = None

    @property
    def node(self) -> Node:  # type: ignore[override]
        if self._node is None:
            self._node = self.tracer.create_proxy("call_function", getattr, (self.root, self.attr), {}).node
        return self._node

    def __call__(self, *args: Any, **kwargs: Any) -> Proxy:
        return self.tracer.create_proxy("call_method", self.attr, (self.root, *args), kwargs)


def _binary(op: Callable[..., Any]) -> Callable[[Proxy, Any], Proxy]:
    def method(self: Proxy, other: Any) -> Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})
    return method


def _reflected(op: Callable[..., Any]) -> Callable[[Proxy, Any], Proxy]:
    def method(self: Proxy, other: Any) -> Proxy:
        return self.tracer.create_proxy("call_function", op, (other, self), {})
    return method


def _unary(op: Callable[..., Any]) -> Callable[[Proxy], Proxy]:
    def method(self: Proxy) -> Proxy:
        return self.tracer.create_proxy("call_function", op, (self,), {})
    return method


_ARITH = ["add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lshift",
          "rshift", "and_", "or_", "xor"]
for _name in _ARITH:
    _dunder = _name.rstrip("_")
    setattr(Proxy, f"__{_dunder}__", _binary(getattr(operator, _name)))
    setattr(Proxy, f"__r{_dunder}__", _reflected(getattr(operator, _name)))
    if _dunder != "matmul":  # tensors have no in-place matmul: `a @= b` is `a = a @ b`
        setattr(Proxy, f"__i{_dunder}__", _binary(getattr(operator, f"i{_dunder}")))
for _name in ["eq", "ne", "lt", "le", "gt", "ge", "getitem"]:
    setattr(Proxy, f"__{_name}__", _binary(getattr(operator, _name)))
for _name in ["neg", "pos", "invert", "abs"]:
    setattr(Proxy, f"__{_name}__", _unary(getattr(operator, _name)))


def _setitem(self: Proxy, key: Any, value: Any) -> None:
    # Setting an item is an effect on its first argument: record it, return nothing.
    self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


Proxy.__setitem__ = _setitem  # type: ignore[attr-defined]
