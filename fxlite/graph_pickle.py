"""How a Graph pickles: flat records that refer to nodes by index, ``torch.ops`` targets by
name, and arguments too deep for pickle's recursion as flat programs.

``Graph.__getstate__`` and ``__setstate__`` (``fxlite.graph``) use these records, so a graph
of any size and any nesting pickles without recursion errors.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NodeRef", "TorchOp", "shallow"]


class NodeRef:
    """A reference to the node at ``index`` in a graph's list of records."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple:
        return (NodeRef, (self.index,))


class TorchOp:
    """A picklable stand-in for a ``torch.ops`` target (``torch.ops.aten.add.Tensor``),
    which torch cannot pickle itself: the op is looked up again by name on load."""

    __slots__ = ("name", "overload")

    def __init__(self, name: str, overload: str | None) -> None:
        self.name, self.overload = name, overload

    def __reduce__(self) -> tuple:
        return (TorchOp, (self.name, self.overload))

    @staticmethod
    def wrap(target: Any) -> Any:
        """A TorchOp for a ``torch.ops`` target; any other target as it is."""
        if isinstance(target, torch._ops.OpOverload):
            return TorchOp(target._schema.name, target._overloadname)
        if isinstance(target, torch._ops.OpOverloadPacket):
            return TorchOp(target._qualified_op_name, None)
        return target

    @staticmethod
    def unwrap(target: Any) -> Any:
        """The ``torch.ops`` target a TorchOp names; any other target as it is."""
        if not isinstance(target, TorchOp):
            return target
        namespace, _, op = target.name.partition("::")
        packet = getattr(getattr(torch.ops, namespace), op)
        return packet if target.overload is None else getattr(packet, target.overload)


_DEEP = 200  # nesting beyond which an argument pickles as a flat program (pickle recurses)


def shallow(a: Any) -> Any:
    """``a``, or a :class:`_Flat` of it when it nests too deep for pickle's recursion."""
    if not isinstance(a, (tuple, list, dict)):
        return a
    stack = [(a, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > _DEEP:
            return _Flat(a)
        for y in (x.values() if isinstance(x, dict) else x):
            if isinstance(y, (tuple, list, dict, slice)):
                stack.append((y.__reduce__()[1] if isinstance(y, slice) else y, depth + 1))
    return a


class _Flat:
    """A deeply nested argument, pickled as a post-order program instead of nested containers.

    The program lists leaves as they are and closes each container with a
    ``(_Flat, kind, size, keys)`` marker; a loop rebuilds it, so depth costs no stack.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple:
        program: list[Any] = []
        stack: list[tuple[Any, bool]] = [(self.value, False)]
        while stack:
            x, closing = stack.pop()
            kind = "tuple" if type(x) is tuple else "list" if type(x) is list else \
                "dict" if type(x) is dict else "slice" if type(x) is slice else None
            if kind is None:
                program.append(x)
            elif closing:
                keys = tuple(x) if kind == "dict" else None
                program.append((_Flat, kind, len(x) if kind != "slice" else 3, keys))
            else:
                items = list(x.values()) if kind == "dict" else \
                    [x.start, x.stop, x.step] if kind == "slice" else list(x)
                stack.append((x, True))
                stack.extend((y, False) for y in reversed(items))
        return (_unflatten, (program,))


def _unflatten(program: list[Any]) -> Any:
    values: list[Any] = []
    for item in program:
        if type(item) is tuple and len(item) == 4 and item[0] is _Flat:
            _, kind, size, keys = item
            parts = values[len(values) - size:] if size else []
            del values[len(values) - size:]
            values.append(tuple(parts) if kind == "tuple" else parts if kind == "list" else
                          dict(zip(keys, parts)) if kind == "dict" else slice(*parts))
        else:
            values.append(item)
    return values[0]


# The names pickles made before 0.1 refer to.
_NodeRef, _TorchOp = NodeRef, TorchOp
