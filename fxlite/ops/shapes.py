"""Shapes and dtypes of table ops, computed from the op table instead of by running ops.

Autodiff and its pipeline need every node's shape, strides and dtype. Running the ops on
``meta`` tensors would give them, but the first such call imports torch's Python meta
kernels (seconds, once per process: a cold compile would pay it). The ops of fused groups
and their gradients are few and regular, so :func:`infer` computes their results here:
broadcasting for pointwise ops, the reduced dims for reductions, the view's rule for
views, the table's dtype rule for dtypes (``fxlite.ops.result_dtype``). Values are meta
tensors made by ``empty_strided`` (a factory: no meta kernel), contiguous. Anything else
runs on meta tensors after all.

Example::

    values = propagate(gm, [x, w])       # every node: meta["tensor_meta"] and meta["type"]
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxlite.graph_module import GraphModule
from fxlite.node import Node, map_arg
from fxlite.ops import is_impure, resolve, result_dtype
from fxlite.tensor_meta import (
    FORMAT_RANKS,
    dense_strides,
    extract_tensor_metadata,
    memory_order,
    reduced_dims,
)

__all__ = ["VIEW_SHAPES", "as_meta", "broadcast_shapes", "infer", "meta_tensor", "propagate", "record"]

_PYTHON_OPS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv,
                         operator.floordiv, operator.mod, operator.neg, operator.pow, max, min})


def meta_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous meta tensor (made by a factory: no meta kernel runs)."""
    shape = tuple(shape)
    return torch.empty_strided(shape, dense_strides(shape, range(len(shape))), dtype=dtype,
                               device="meta")


def as_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.device.type != "meta":
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


def record(node: Node, value: Any) -> None:
    """Store ``value``'s metadata on ``node`` as ShapeProp would."""
    if isinstance(value, torch.Tensor):
        node.meta["tensor_meta"] = extract_tensor_metadata(value)
    else:
        node.meta.pop("tensor_meta", None)
    node.meta["type"] = type(value)


def broadcast_shapes(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to, by torch's rules: ``[(2, 1), (3,)]`` gives
    ``(2, 3)``. (``torch.broadcast_shapes`` would import torch's meta kernels.)

    Raises:
        ValueError: when they do not broadcast.
    """
    out: list[int] = []
    for shape in shapes:
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        for i, s in enumerate(shape, len(out) - len(shape)):
            if s != 1:
                if out[i] not in (1, s):
                    raise ValueError(f"shapes {shapes} do not broadcast")
                out[i] = s
    return tuple(out)


def _squeeze(shape: list[int], a: dict[str, Any]) -> list[int]:
    dim = a.get("dim")
    # squeeze(()) squeezes nothing, where a reduction's dim=() means every dim
    dims = () if isinstance(dim, (tuple, list)) and not dim else reduced_dims(dim, len(shape))
    return [s for i, s in enumerate(shape) if not (i in dims and s == 1)]


def _unsqueeze(shape: list[int], a: dict[str, Any]) -> list[int]:
    d = a["dim"] % (len(shape) + 1)
    return shape[:d] + [1] + shape[d:]


def _expand(shape: list[int], a: dict[str, Any]) -> list[int]:
    sizes = list(a["size"])
    lead = len(sizes) - len(shape)
    return [shape[i - lead] if s == -1 else s for i, s in enumerate(sizes)]


def _sized(key: str) -> Any:
    # view(size) and reshape(shape): one -1 takes what the other sizes leave
    def rule(shape: list[int], a: dict[str, Any]) -> list[int]:
        sizes = list(a[key])
        if -1 in sizes:
            known = total = 1
            for s in sizes:
                known *= s if s != -1 else 1
            for s in shape:
                total *= s
            sizes = [total // known if s == -1 else s for s in sizes]
        return sizes
    return rule


def _swap(shape: list[int], i: int, j: int) -> list[int]:
    order = list(range(len(shape)))
    if len(shape) >= 2:
        i, j = i % len(shape), j % len(shape)
        order[i], order[j] = order[j], order[i]
    return [shape[d] for d in order]


def _flatten(shape: list[int], a: dict[str, Any]) -> list[int]:
    rank = len(shape)
    start, end = a.get("start_dim", 0) % max(rank, 1), a.get("end_dim", -1) % max(rank, 1)
    n = 1
    for s in shape[start:end + 1]:
        n *= s
    return shape[:start] + [n] + shape[end + 1:] if rank else [1]


# The shape of a view's result from its input's shape and canonical args, by op name.
# Pointwise ops broadcast, reductions drop or keep their dims, composites broadcast their
# tensors (softmax, the norms: the input's shape; addcmul) unless they reduce (_table);
# other ops run on meta tensors.
VIEW_SHAPES: dict[str, Callable[[list[int], dict[str, Any]], list[int]]] = {
    "contiguous": lambda shape, a: shape,
    "identity": lambda shape, a: shape,
    "detach": lambda shape, a: shape,
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
    "expand": _expand,
    "view": _sized("size"),
    "reshape": _sized("shape"),
    "permute": lambda shape, a: [shape[d % len(shape)] for d in a["dims"]],
    "transpose": lambda shape, a: _swap(shape, a["dim0"], a["dim1"]),
    "t": lambda shape, a: _swap(shape, 0, 1),
    "flatten": _flatten,
}


def _table(node: Node, values: dict[Node, Any]) -> Any:
    found = resolve(node)
    if found is None:
        return NotImplemented
    info, args = found
    if info.kind not in ("pointwise", "reduction", "view", "composite"):
        return NotImplemented
    a = map_arg(args, lambda n: values[n])
    x = a.get("input")
    # a 0-dim tensor stays a tensor: it promotes less than one with dims
    dtypes = map_arg(args, lambda n: values[n].dtype if isinstance(values[n], torch.Tensor)
                     and values[n].dim() > 0 else values[n])
    dtype = result_dtype(info, dtypes)
    tensors = [v for v in a.values() if isinstance(v, torch.Tensor)]
    if not tensors or dtype is None and info.kind != "view":
        return NotImplemented
    if info.kind == "pointwise":
        shape = broadcast_shapes([tuple(t.shape) for t in tensors])
        fmt = a.get("memory_format")
        if fmt in FORMAT_RANKS and FORMAT_RANKS[fmt] in (0, len(shape)):  # a clone into a layout
            return torch.empty(shape, dtype=dtype, device="meta", memory_format=fmt)
        # eager lays the result out in its inputs' memory order (TensorIterator): a
        # channels-last input gives a channels-last result, and a kernel that stores it
        # (a reduction group's full-size output) must too, or the next conv converts it
        order = memory_order(tensors)  # None: row-major
        if order is not None:
            return torch.empty_strided(shape, dense_strides(shape, order), dtype=dtype,
                                       device="meta")
    elif info.kind == "composite":
        if "keepdim" in info.params:  # a reducing composite (a norm): run it on meta tensors
            return NotImplemented
        shape = list(broadcast_shapes([tuple(t.shape) for t in tensors]))
    elif info.kind == "view":
        if not isinstance(x, torch.Tensor):
            return NotImplemented
        rule = VIEW_SHAPES.get(info.name)
        if rule is None:
            return NotImplemented
        shape = rule(list(x.shape), a)
        dtype = x.dtype
    else:
        if not isinstance(x, torch.Tensor) or info.name in ("max", "min") and "dim" in a:
            return NotImplemented  # (values, indices)
        if set(a) - {"input", "dim", "keepdim", "dtype", "correction"}:
            return NotImplemented
        dims = reduced_dims(a.get("dim"), x.dim())
        keep = a.get("keepdim", False)
        shape = [1 if i in dims else s for i, s in enumerate(x.shape)] if keep else [
            s for i, s in enumerate(x.shape) if i not in dims]
    return meta_tensor(shape, dtype)


def infer(node: Node, values: dict[Node, Any]) -> Any:
    """The value of ``node`` (a meta tensor or a Python value) given its inputs' values.

    Effects (``draw_seed``, buffer updates) are not run: an int stands for an int result,
    None for anything else.
    """
    if node.op in ("call_function", "call_method", "call_module") and is_impure(node):
        return 0 if node.meta.get("type") is int else None
    if node.op == "call_method" and node.target in ("size", "dim", "numel"):
        x = values[node.args[0]]
        return getattr(x, node.target)(*node.args[1:], **node.kwargs)
    args = map_arg(node.args, lambda n: values[n])
    kwargs = map_arg(node.kwargs, lambda n: values[n])
    leaves: list[Any] = []
    map_arg((node.args, node.kwargs), lambda n: leaves.append(values[n]))
    if node.op == "call_function" and not any(isinstance(v, torch.Tensor) for v in leaves) and (
            node.target in _PYTHON_OPS or getattr(node.target, "__module__", "").startswith("fxlite")):
        return node.target(*args, **kwargs)  # arithmetic on sizes
    if node.op in ("call_function", "call_method"):
        out = _table(node, values)
        if out is not NotImplemented:
            return out
    if node.op == "call_function":
        return node.target(*map_arg(args, as_meta), **map_arg(kwargs, as_meta))
    if node.op == "call_method":
        return getattr(as_meta(args[0]), node.target)(*args[1:], **kwargs)
    raise TypeError(f"cannot infer the value of {node.format_node()}")


def propagate(gm: GraphModule, inputs: Sequence[Any]) -> dict[Node, Any]:
    """Give every node of ``gm`` ShapeProp's ``tensor_meta`` and ``type`` for ``inputs``
    (tensors of any device; only shapes, strides and dtypes are read)."""
    values: dict[Node, Any] = {}
    it = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "output":
            break
        if node.op == "placeholder":
            values[node] = as_meta(next(it))
        elif node.op == "get_attr":
            obj: Any = gm
            for atom in node.target.split("."):
                obj = getattr(obj, atom)
            values[node] = as_meta(obj)
        else:
            values[node] = infer(node, values)
        record(node, values[node])
    return values

