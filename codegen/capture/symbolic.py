"""Size arguments recorded as values, not literals: a Dynamo graph's ``SymInt`` inputs.

``torch.compile(f, backend="fxlite", dynamic=True)`` hands fxlite graphs whose sizes are
inputs of their own (``s77 : torch.SymInt``) and whose code does arithmetic on them and
passes them to ops::

    def forward(self, s77, s27, s53, L_x_):
        mul = s77 * s27
        view = L_x_.view(mul, s53)
        ...

Recorded with its sizes as plain ints, such a graph would be recorded again for every new
size. Instead, each such argument is a placeholder of the recording and enters the call as
a :class:`SymbolicInt`: an ``int`` whose arithmetic with other ints is recorded too (one
graph node per ``+``, ``*``, ``//``...), and which an op given it records as that node. A
replay then computes the sizes from the call's own arguments.

Anything else done with one (a comparison, ``bool()``, ``hash()``, a conversion, being
returned) makes the recording depend on its value: :attr:`SymbolicInt.escaped` is set
on the recorder, and the recording is keyed by the values, as any recording that reads
sizes is. Python's C code takes an ``int`` subclass's value without asking it
(``range(n)``, a list's ``[0] * n``), which this cannot see: only graphs whose Python is
Dynamo's generated code, where sizes go to ops and arithmetic alone, get such arguments
(:func:`symbolic_positions`).

Example::

    c = torch.compile(f, backend="fxlite", dynamic=True)
    c(torch.randn(2, 3, 8)); c(torch.randn(4, 5, 8))   # one recording, replayed for both
"""

from __future__ import annotations

import operator
from typing import Any

import torch

__all__ = ["SymbolicInt", "dynamo_graph", "escaped_positions", "keyed_positions", "plain",
           "symbolic_positions"]


def symbolic_positions(fn: Any) -> frozenset[int]:
    """The positions of ``fn``'s ``SymInt`` inputs, where ``fn`` is a graph Dynamo made
    (a ``torch.fx.GraphModule`` whose placeholders Dynamo annotated), else none."""
    if not isinstance(fn, torch.fx.GraphModule):
        return frozenset()
    places = [n for n in fn.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, n in enumerate(places)
                     if n.type is torch.SymInt
                     or isinstance(n.meta.get("example_value"), torch.SymInt))


def dynamo_graph(fn: Any) -> bool:
    """Whether ``fn`` is a graph Dynamo made (its placeholders carry Dynamo's records)."""
    return isinstance(fn, torch.fx.GraphModule) and any(
        "grapharg" in n.meta for n in fn.graph.nodes if n.op == "placeholder")


def keyed_positions(fn: Any) -> frozenset[int]:
    """The positions of the floats a Dynamo graph takes as 0-d tensors and reads with
    ``.item()`` (with ``dynamic=True``, Dynamo passes a module's float attributes so:
    ``eps``, a dropout's ``p``). fxlite keys the recording by their values, so that
    reading one is no graph break (a segment each, before)."""
    if not isinstance(fn, torch.fx.GraphModule):
        return frozenset()
    places = [n for n in fn.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, n in enumerate(places)
                     if getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False))


def _plain(v: Any) -> Any:
    return int.__int__(v) if isinstance(v, SymbolicInt) else v


def _arithmetic(name: str, op: Any, reflected: bool = False) -> Any:
    def method(self: SymbolicInt, other: Any) -> Any:
        if type(other) is not int and not isinstance(other, SymbolicInt):
            return self._escape(op, other, reflected)
        a, b = (other, self) if reflected else (self, other)
        value = op(_plain(a), _plain(b))
        node = self.graph.call_function(op, (_node(a), _node(b)))
        node.meta.update(type=int, grad_enabled=torch.is_grad_enabled())
        return SymbolicInt(value, node, self.owner)

    method.__name__ = name
    return method


def _node(v: Any) -> Any:
    return v.node if isinstance(v, SymbolicInt) else v


def _escaping(name: str) -> Any:
    base = getattr(int, name)

    def method(self: SymbolicInt, *args: Any) -> Any:
        self.owner.escaped = True
        _note_escape(self)
        return base(int.__int__(self), *(_plain(a) for a in args))

    method.__name__ = name
    return method


def _note_escape(value: SymbolicInt) -> None:
    """Tell the recorder which size was used as a value (``escaped_nodes``), so that its
    key can hold that size alone where it is computed from the sizes taken as inputs."""
    nodes = getattr(value.owner, "escaped_nodes", None)
    if nodes is not None:
        nodes.append(value.node)


def escaped_positions(nodes: list[Any], placeholders: list[str | None]) -> tuple[int, ...] | None:
    """The positions of the sizes taken as inputs that the escaped ``nodes`` are computed
    from by arithmetic alone (``s53 ** 0.5`` of an input ``s53``), or None where one is
    computed from a tensor's size (then the key holds every size)."""
    where = {name: i for i, name in enumerate(placeholders) if name is not None}
    found: set[int] = set()
    todo, seen = list(nodes), set()
    while todo:
        node = todo.pop()
        if node.name in seen:
            continue
        seen.add(node.name)
        if node.op == "placeholder":
            if node.meta.get("type") is not int or node.name not in where:
                return None
            found.add(where[node.name])
        elif node.op == "call_function" and node.target.__module__ == "_operator":
            todo.extend(node.all_input_nodes)
        else:  # a tensor's size
            return None
    return tuple(sorted(found))


class SymbolicInt(int):
    """An ``int`` argument that a recording takes as an input (see the module docstring).

    Attributes:
        node: the recording's node that computes it.
        owner: the recorder, whose ``escaped`` is set when the value is used as a value.
    """

    def __new__(cls, value: int, node: Any, owner: Any) -> SymbolicInt:
        self = super().__new__(cls, value)
        self.node = node
        self.owner = owner
        return self

    @property
    def graph(self) -> Any:
        return self.node.graph

    def _escape(self, op: Any, other: Any, reflected: bool) -> Any:
        self.owner.escaped = True
        _note_escape(self)
        a, b = (other, int.__int__(self)) if reflected else (int.__int__(self), other)
        return op(a, b)

    __add__ = _arithmetic("__add__", operator.add)
    __radd__ = _arithmetic("__radd__", operator.add, reflected=True)
    __sub__ = _arithmetic("__sub__", operator.sub)
    __rsub__ = _arithmetic("__rsub__", operator.sub, reflected=True)
    __mul__ = _arithmetic("__mul__", operator.mul)
    __rmul__ = _arithmetic("__rmul__", operator.mul, reflected=True)
    __floordiv__ = _arithmetic("__floordiv__", operator.floordiv)
    __rfloordiv__ = _arithmetic("__rfloordiv__", operator.floordiv, reflected=True)
    __mod__ = _arithmetic("__mod__", operator.mod)
    __rmod__ = _arithmetic("__rmod__", operator.mod, reflected=True)

    def __neg__(self) -> SymbolicInt:
        node = self.graph.call_function(operator.neg, (self.node,))
        node.meta.update(type=int, grad_enabled=torch.is_grad_enabled())
        return SymbolicInt(-int.__int__(self), node, self.owner)

    def __pos__(self) -> SymbolicInt:
        return self

    for _name in ("__bool__", "__hash__", "__index__", "__int__", "__float__", "__repr__",
                  "__str__", "__format__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
                  "__ge__", "__truediv__", "__rtruediv__", "__pow__", "__rpow__", "__abs__",
                  "__round__", "__trunc__", "__floor__", "__ceil__", "__and__", "__rand__",
                  "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__",
                  "__rshift__", "__rrshift__", "__invert__", "__divmod__", "__rdivmod__",
                  "__reduce__", "__reduce_ex__", "__getnewargs__", "bit_length", "to_bytes",
                  "conjugate", "as_integer_ratio"):
        locals()[_name] = _escaping(_name)
    del _name


def plain(value: Any) -> tuple[Any, bool]:
    """``value`` with each :class:`SymbolicInt` in it (at any depth of tuples, lists and
    dicts) an ``int``, and whether one was found. Without one, ``value`` itself: a result
    is the caller's object, not a copy."""
    if isinstance(value, SymbolicInt):
        return int.__int__(value), True
    t = type(value)
    if t in (tuple, list):
        items = [plain(x) for x in value]
        if any(f for _, f in items):
            return t(v for v, _ in items), True
    elif t is dict:
        found = {k: plain(v) for k, v in value.items()}
        if any(f for _, f in found.values()):
            return {k: v for k, (v, _) in found.items()}, True
    return value, False
