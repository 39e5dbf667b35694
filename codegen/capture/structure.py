"""Flatten call arguments and results into leaves, and rebuild them.

``flatten(obj)`` walks tuples, lists, dicts, namedtuples (with the instance attributes
of a subclass's instance: ``t.c = x``), dataclass instances and types
registered with ``torch.utils._pytree`` (HuggingFace's ``ModelOutput`` is one), and
returns the leaves in order with a hashable ``spec``; ``unflatten(spec, leaves)``
rebuilds an equal structure around new leaves::

    leaves, spec = flatten({"logits": t, "aux": (u, 3)})     # [t, u, 3]
    unflatten(spec, [t2, u2, 3])                             # {"logits": t2, "aux": (u2, 3)}

The capture uses it to give every tensor in a call's arguments its own placeholder, and
to rebuild a compiled function's result in the shape the Python code returned it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["flatten", "flatten_call", "unflatten"]

Spec = tuple  # ("leaf",) | (kind, detail, child specs)
_LEAF: Spec = ("leaf",)


def _pytree_node(obj: Any) -> Any:
    """The torch pytree registration of ``type(obj)``, for types not handled here."""
    try:
        from torch.utils import _pytree
    except ImportError:  # pragma: no cover - torch always has it
        return None
    return _pytree.SUPPORTED_NODES.get(type(obj))


def _frozen(x: Any) -> Any:
    """A hashable stand-in for a pytree context (lists become tuples)."""
    if isinstance(x, list):
        return tuple(_frozen(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _frozen(v)) for k, v in x.items())
    return x


def flatten(obj: Any) -> tuple[list[Any], Spec]:
    """The leaves of ``obj`` in order, and a hashable spec to rebuild it with.

    Example::

        leaves, spec = flatten(((x, 2), {"y": y}))   # leaves == [x, 2, y]
    """
    leaves: list[Any] = []
    return leaves, _flatten(obj, leaves)


_FLAT_LEAVES = frozenset({int, float, bool, str, type(None)})
_CALL_SPECS: dict[int, Spec] = {}


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Spec]:
    """``flatten((args, kwargs))``, quicker for the common call of plain positional values."""
    if not kwargs:
        import torch

        for a in args:
            if not (isinstance(a, torch.Tensor) or type(a) in _FLAT_LEAVES):
                break
        else:
            spec = _CALL_SPECS.get(len(args))
            if spec is None:
                spec = _CALL_SPECS[len(args)] = flatten((args, {}))[1]
            return list(args), spec
    return flatten((args, kwargs))


def _flatten(obj: Any, leaves: list[Any]) -> Spec:
    t = type(obj)
    if t is tuple or t is list or t is torch.Size:  # (torch's pytree unflattens a Size
        # into a plain tuple)
        return ("tuple" if t is tuple else "list" if t is list else "Size", len(obj),
                tuple(_flatten(x, leaves) for x in obj))
    if t is dict or t is OrderedDict:
        keys = tuple(obj)
        return (t.__name__, keys, tuple(_flatten(obj[k], leaves) for k in keys))
    if isinstance(obj, tuple) and hasattr(t, "_fields"):  # namedtuple
        extra = getattr(obj, "__dict__", None)  # a subclass's instance attributes (t.c = 1)
        if extra:
            names = tuple(extra)
            return ("namedtuple+", (t, names), tuple(_flatten(x, leaves) for x in
                                                     (*obj, *(extra[n] for n in names))))
        return ("namedtuple", t, tuple(_flatten(x, leaves) for x in obj))
    node = _pytree_node(obj)
    if node is not None:
        children, context = node.flatten_fn(obj)
        try:
            hash(_frozen(context))
        except TypeError:
            context_key: Any = id(context)  # unhashable context: identity (rare)
        else:
            context_key = _frozen(context)
        return ("pytree", (t, context_key, _Boxed(context)),
                tuple(_flatten(x, leaves) for x in children))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        # and attributes set beyond its fields (``cfg.z = True``): an added one is another
        # structure, and their values are leaves like the fields'
        names += tuple(k for k in getattr(obj, "__dict__", ()) if k not in names)
        template = copy.copy(obj)  # keeps no field values alive
        for n in names:
            object.__setattr__(template, n, None)
        return ("dataclass", (t, names, _Boxed(template)),
                tuple(_flatten(getattr(obj, n), leaves) for n in names))
    leaves.append(obj)
    return _LEAF


class _Boxed:
    """Carries an object through a spec without taking part in its hash or equality."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Boxed)


def unflatten(spec: Spec, leaves: list[Any]) -> Any:
    """Rebuild the structure ``spec`` describes around ``leaves`` (consumed in order)."""
    it = iter(leaves)
    return _unflatten(spec, it)


def _unflatten(spec: Spec, it: Any) -> Any:
    kind = spec[0]
    if kind == "leaf":
        return next(it)
    _, detail, children = spec
    items = [_unflatten(c, it) for c in children]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    if kind == "Size":
        return torch.Size(items)
    if kind == "dict":
        return dict(zip(detail, items))
    if kind == "OrderedDict":
        return OrderedDict(zip(detail, items))
    if kind == "namedtuple":
        return detail(*items)
    if kind == "namedtuple+":  # with instance attributes, after the fields
        t, names = detail
        out = t(*items[:len(items) - len(names)])
        out.__dict__.update(zip(names, items[len(items) - len(names):]))
        return out
    if kind == "pytree":
        t, _, context = detail
        return _pytree_node_of(t).unflatten_fn(items, context.value)
    if kind == "dataclass":
        # A shallow copy with the fields replaced: no __init__/__post_init__ runs again,
        # and frozen dataclasses work too.
        _, names, template = detail
        out = copy.copy(template.value)
        for name, value in zip(names, items):
            object.__setattr__(out, name, value)
        return out
    raise ValueError(f"unknown spec kind {kind!r}")


def _pytree_node_of(t: type) -> Any:
    from torch.utils import _pytree

    return _pytree.SUPPORTED_NODES[t]
