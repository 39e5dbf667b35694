"""Shape propagation: run a GraphModule on example inputs and record each value's metadata.

After ``ShapeProp(gm).propagate(x)`` every node whose value holds tensors carries
``node.meta['tensor_meta']``: a :class:`TensorMetadata` for a tensor, or the same
tuple/list/dict structure of them for a nested value. Every node gets
``node.meta['type']``, the Python type of its value. ``gm.graph.print_tabular()`` then
shows shape and dtype columns.

:class:`TensorMetadata`, :func:`extract_tensor_metadata` and the memory-format tables live
in the core (``fxlite.tensor_meta``), which records metadata without passes; they are
imported here under their old names.
"""

from __future__ import annotations

from typing import Any

import torch

from fxlite.graph_module import attr_at
from fxlite.interpreter import Interpreter
from fxlite.node import Node, map_aggregate
from fxlite.tensor_meta import (
    FORMAT_RANKS,
    MEMORY_FORMATS,
    TensorMetadata,
    extract_tensor_metadata,
    rebuild_tensor_metadata,
)

__all__ = ["FORMAT_RANKS", "MEMORY_FORMATS", "ShapeProp", "TensorMetadata",
           "extract_tensor_metadata", "fill_missing_meta"]

# The name pickles made before TensorMetadata moved to fxlite.tensor_meta refer to.
_rebuild_tensor_metadata = rebuild_tensor_metadata


def memory_format_of(shape: Any, stride: Any) -> torch.memory_format | None:
    """The memory format a tensor of this shape and stride is contiguous in, or None.

    Example::

        >>> memory_format_of((2, 3, 4, 5), (60, 1, 15, 3))
        torch.channels_last
    """
    probe = torch.empty_strided(tuple(shape), tuple(stride), device="meta")
    return next((f for f in MEMORY_FORMATS if probe.is_contiguous(memory_format=f)), None)


def node_layout(node: Any) -> tuple[tuple, tuple, torch.dtype] | None:
    """``(shape, stride, dtype)`` of a node's tensor, from what fxlite.compile recorded
    (``tensor_meta_rec``) or what ShapeProp found (``tensor_meta``); None if neither says."""
    rec = getattr(node, "meta", {}).get("tensor_meta_rec")
    if rec is not None:
        return tuple(rec[0]), tuple(rec[1]), rec[2]
    tm = getattr(node, "meta", {}).get("tensor_meta")
    if tm is None or not hasattr(tm, "shape") or tm.stride is None:
        return None
    return tuple(tm.shape), tuple(tm.stride), tm.dtype


def _tensor_meta_of(value: Any) -> Any:
    """``value`` with each tensor in it replaced by its :class:`TensorMetadata`, or None
    when it holds no tensor."""
    found = False

    def record(obj: Any) -> Any:
        nonlocal found
        if isinstance(obj, torch.Tensor):
            found = True
            return extract_tensor_metadata(obj)
        return obj

    meta = map_aggregate(value, record)
    return meta if found else None


class ShapeProp(Interpreter):
    """An Interpreter that records every node's tensor metadata as it runs.

    Args:
        gm: the GraphModule whose nodes get ``meta['tensor_meta']`` and ``meta['type']``.

    Example::

        gm = fxlite.symbolic_trace(lambda x: torch.relu(x) + 1)
        ShapeProp(gm).propagate(torch.randn(2, 3))
        gm.graph.print_tabular()

        # before: opcode, name, target, args, kwargs
        # after:  the same columns plus shape and dtype
        # opcode         name    target                   args       kwargs    shape    dtype
        # placeholder    x       x                        ()         {}        (2, 3)   float32
        # call_function  relu    <built-in method relu>   (x,)       {}        (2, 3)   float32
        # call_function  add     <built-in function add>  (relu, 1)  {}        (2, 3)   float32
        # output         output  output                   (add,)     {}        (2, 3)   float32
    """

    def run_node(self, n: Node) -> Any:
        """Run ``n`` as the Interpreter would, then store its metadata in ``n.meta``."""
        result = super().run_node(n)
        meta = _tensor_meta_of(result)
        if meta is not None:
            n.meta["tensor_meta"] = meta
        else:
            n.meta.pop("tensor_meta", None)  # a stale record from an earlier run would mislead
        n.meta["type"] = type(result)
        return result

    def propagate(self, *args: Any) -> Any:
        """Run the module on ``args``, recording metadata on every node.

        Args:
            *args: example inputs, one per placeholder.

        Returns:
            The module's output for ``args``.
        """
        return self.run(*args)


def fill_missing_meta(gm: torch.nn.Module) -> None:
    """Give nodes that lack ShapeProp metadata some, computed from their inputs' metadata.

    For graphs that ShapeProp already ran on and a pass then extended (``decompose``
    adds ``amax``, ``sub``, ``exp``... for a softmax). Each new ``call_function`` or
    ``call_method`` node is evaluated on ``meta``-device tensors shaped as its inputs, so
    no data is computed. Nodes whose inputs are unknown keep no metadata.

    Example::

        ShapeProp(gm).propagate(x)
        gm = decompose(gm)      # the new nodes have no meta
        fill_missing_meta(gm)   # now they do
    """
    env: dict[Node, Any] = {}
    unknown = object()
    for n in gm.graph.nodes:
        tm = n.meta.get("tensor_meta")
        if tm is not None:
            env[n] = _meta_values(tm)
            continue
        if n.op == "get_attr":
            value = attr_at(gm, n.target, "fill_missing_meta")
            env[n] = value.to("meta") if isinstance(value, torch.Tensor) else value
        elif n.op in ("call_function", "call_method") and not any(
                env.get(i, unknown) is unknown for i in n.all_input_nodes):
            args = map_aggregate(n.args, lambda a: env[a] if isinstance(a, Node) else a)
            kwargs = map_aggregate(n.kwargs, lambda a: env[a] if isinstance(a, Node) else a)
            try:
                fn = n.target if n.op == "call_function" else getattr(args[0], n.target)
                value = fn(*args, **kwargs) if n.op == "call_function" else fn(*args[1:], **kwargs)
            except Exception:
                env[n] = unknown  # the op cannot run on meta tensors: leave it unknown
                continue
            env[n] = value
            meta = _tensor_meta_of(value)
            if meta is not None:
                n.meta["tensor_meta"] = meta
            n.meta["type"] = type(value)
        else:
            env[n] = unknown


def _meta_values(m: Any) -> Any:
    """Meta-device tensors laid out as recorded, in the recorded structure."""
    if isinstance(m, TensorMetadata):
        return _meta_tensor(m)
    if isinstance(m, (tuple, list)):
        items = [_meta_values(x) for x in m]
        return type(m)(*items) if hasattr(m, "_fields") else type(m)(items)
    if isinstance(m, dict):
        return {k: _meta_values(v) for k, v in m.items()}
    return m


def _meta_tensor(m: TensorMetadata) -> torch.Tensor:
    if m.stride:
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    return torch.empty(m.shape, dtype=m.dtype, device="meta")
