"""Small rules the recorder applies to each call: how it is spelled as a node, what its
result looks like, whether it indexes by a mask. Kept apart from ``recorder`` so that
file reads top to bottom as the mode itself.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from fxlite.codegen.capture.kinds import state_name
from fxlite.codegen.capture.records import (
    Out,
    SeqOut,
    TensorOut,
    ValueOut,
    format_site,
    tensor_meta,
)
from fxlite.codegen.capture.symbolic import SymbolicInt

from fxlite.proxy import is_tensor_method

__all__ = ["Diverged", "bool_index", "break_message", "func_name", "has_tensor",
           "rng_state_of", "same_func", "spelling", "structure", "tensors_in"]


class Diverged(Exception):
    """Fast-forwarding met a different call than the recorded path has."""


def func_name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def same_func(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def break_message(func: Any, site: Any) -> str:
    return (f"fullgraph=True, but the function reads a tensor's value in Python "
            f"({state_name(func)}), which splits it into several graphs:\n  {format_site(site)}\n"
            "To keep one graph: compute both branches and pick with torch.where, use "
            "torch.cond(pred, true_fn, false_fn, operands), fix the value with concrete_args "
            "when tracing with symbolic_trace, or move the code into a leaf module.")


def tensors_in(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def has_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return any(has_tensor(i) for i in x)
    return False


def map_tensors(a: Any, node_of: Callable[[torch.Tensor], Any]) -> Any:
    """A graph argument for a call argument ``a``: each tensor becomes ``node_of(tensor)``,
    containers are rebuilt around them, a ``torch.Size`` becomes a tuple."""
    if isinstance(a, torch.Tensor):
        return node_of(a)
    t = type(a)
    if t is SymbolicInt:  # a size taken as an input, or arithmetic on one
        return a.node
    if t is tuple or t is list:
        return t(map_tensors(x, node_of) for x in a)
    if t is dict:
        return {k: map_tensors(v, node_of) for k, v in a.items()}
    if t is slice:
        return slice(map_tensors(a.start, node_of), map_tensors(a.stop, node_of),
                     map_tensors(a.step, node_of))
    if isinstance(a, torch.Size):  # (it may hold sizes taken as inputs: x.shape[:-1])
        return tuple(map_tensors(x, node_of) for x in a)
    return a


def structure(out: Any) -> Out:
    """What replaying a call needs of its result ``out`` (``Step.out``)."""
    if isinstance(out, torch.Tensor):
        return TensorOut(tensor_meta(out))
    if isinstance(out, (tuple, list)) and has_tensor(out):
        return SeqOut(type(out), [structure(x) for x in out])
    return ValueOut(out)


def bool_index(func: Any, args: tuple) -> bool:
    """``x[mask]``: indexing with a bool tensor gives a value-dependent size."""
    if state_name(func) != "__getitem__" or len(args) < 2:
        return False
    idx = args[1]
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in items)


_DUNDER_OPS: dict[str, tuple[Any, bool]] = {}


def spelling(func: Any, args: tuple) -> tuple[Any, str, tuple]:
    """``(target, opcode, args)`` for a call: Tensor methods become ``call_method``
    nodes (as symbolic tracing records them), operators become ``operator`` functions."""
    import operator

    if not _DUNDER_OPS:
        for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                     "and", "or", "xor", "lshift", "rshift"):
            op = getattr(operator, name + "_" if name in ("and", "or") else name)
            _DUNDER_OPS[f"__{name}__"] = (op, False)
            _DUNDER_OPS[f"__r{name}__"] = (op, True)
        for name in ("eq", "ne", "lt", "le", "gt", "ge", "getitem"):
            _DUNDER_OPS[f"__{name}__"] = (getattr(operator, name), False)
        for name in ("neg", "pos", "invert", "abs"):
            _DUNDER_OPS[f"__{name}__"] = (getattr(operator, name), False)
        _DUNDER_OPS["__setitem__"] = (operator.setitem, False)
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__") and isinstance(getattr(func, "__self__", None),
                                                     types.GetSetDescriptorType):
        attr = func.__self__.__name__
        if name == "__get__":
            return getattr, "call_function", (args[0], attr)
        return setattr, "call_function", (args[0], attr, args[1])
    if isinstance(name, str) and name in _DUNDER_OPS and is_tensor_method(func):
        op, swap = _DUNDER_OPS[name]
        return op, "call_function", ((args[1], args[0], *args[2:]) if swap else args)
    if isinstance(name, str) and is_tensor_method(func) and name != "__call__":
        return name, "call_method", args
    return func, "call_function", args


def rng_state_of(devices: list[int]) -> Any:
    """The generators' states (CPU and the given CUDA devices), to replay random ops."""
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]
