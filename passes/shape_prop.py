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
from fxlite.ops import lookup
from fxlite.tensor_meta import (
    FORMAT_RANKS,
    MEMORY_FORMATS,
    TensorMetadata,
    dense_strides,
    extract_tensor_metadata,
    rebuild_tensor_metadata,
)

__all__ = ["CONVS", "FORMAT_RANKS", "MEMORY_FORMATS", "ShapeProp", "TensorMetadata",
           "extract_tensor_metadata", "fill_missing_meta", "recorded_metadata"]

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


def recorded_metadata(rec: tuple) -> TensorMetadata:
    """ShapeProp's :class:`TensorMetadata` for what fxlite.compile recorded of a tensor
    (``tensor_meta_rec``: shape, stride, dtype, device, requires_grad)."""
    shape, stride, dtype, _device, requires_grad = rec
    return TensorMetadata(torch.Size(shape), dtype, requires_grad, tuple(stride),
                          memory_format_of(shape, stride))


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
        if isinstance(result, torch.Tensor):
            n.meta["device"] = result.device
        else:
            n.meta.pop("device", None)
        n.meta["type"] = type(result)
        if n.op == "placeholder" and type(result) is int:  # a size taken as an argument
            n.meta["value"] = result
        return result

    def propagate(self, *args: Any) -> Any:
        """Run the module on ``args``, recording metadata on every node.

        Args:
            *args: example inputs, one per placeholder.

        Returns:
            The module's output for ``args``.
        """
        return self.run(*args)


def fill_missing_meta(gm: torch.nn.Module, *, strict: bool = False) -> None:
    """Give nodes that lack ShapeProp metadata some, computed from their inputs' metadata.

    The one meta-tensor evaluator of graphs: for graphs that ShapeProp or a recording
    already described and a pass then extended (``decompose`` adds ``amax``, ``sub``,
    ``exp``... for a softmax). Each node is given a value, so no data is computed:

    - a node with ``tensor_meta`` is not run: its value is a ``meta``-device tensor of
      that layout (contiguous where no stride was recorded);
    - a ``get_attr`` is the module's attribute, moved to the meta device;
    - any other ``call_function`` or ``call_method`` is run on its inputs' values, and
      gets ``tensor_meta`` (when its value holds tensors) and ``type``;
    - a node with a ``type`` and no ``tensor_meta`` (a size, a flag) keeps what it has:
      it is run for the value later nodes need when it is pure, and not run again when it
      has effects (an in-place ``_foreach_add_`` returns a list on meta tensors where it
      returned None when recorded);
    - a placeholder without ``tensor_meta`` has no known value, and neither has a node
      that needs one.

    Grad mode is as it was before the call, whatever recorded ``torch.no_grad()`` ran.

    Args:
        gm: the module whose graph gets metadata.
        strict: raise where a node without metadata cannot be given any (the compiler
            wants all of a segment's metadata, or none of its kernels). Otherwise such a
            node keeps no metadata, and neither do the nodes that need its value.

    Raises:
        RuntimeError: with ``strict``, naming the node that could not be evaluated.

    Example::

        ShapeProp(gm).propagate(x)
        gm = decompose(gm)      # the new nodes have no meta
        fill_missing_meta(gm)   # now they do
    """
    with torch.set_grad_enabled(torch.is_grad_enabled()):  # restores grad mode on exit
        _evaluate(gm, strict)


_UNKNOWN = object()


def _evaluate(gm: torch.nn.Module, strict: bool) -> None:
    env: dict[Node, Any] = {}
    for n in gm.graph.nodes:
        tm = n.meta.get("tensor_meta")
        if tm is not None:
            env[n] = _meta_values(tm)
        elif n.op == "get_attr":
            value = attr_at(gm, n.target, "fill_missing_meta")
            env[n] = value.to("meta") if isinstance(value, torch.Tensor) else value
        elif n.op == "placeholder" and "value" in n.meta:  # an int argument (ShapeProp's)
            env[n] = n.meta["value"]
        elif n.op not in ("call_function", "call_method"):
            env[n] = _UNKNOWN
        elif "type" in n.meta:  # described already: its value only, and never twice
            env[n] = _UNKNOWN if n.is_impure() else _run_on_meta(n, env, strict=False)
        else:
            env[n] = value = _run_on_meta(n, env, strict)
            if value is not _UNKNOWN:
                meta = _tensor_meta_of(value)
                if meta is not None:
                    n.meta["tensor_meta"] = meta
                n.meta["type"] = type(value)


def _run_on_meta(n: Node, env: dict[Node, Any], strict: bool) -> Any:
    """``n``'s value from its inputs' values in ``env``, or ``_UNKNOWN``."""
    missing = next((i for i in n.all_input_nodes if env[i] is _UNKNOWN), None)
    if missing is not None:
        if strict:
            raise RuntimeError(f"cannot infer the metadata of {n.format_node()}: "
                               f"its input {missing.name!r} has none")
        return _UNKNOWN
    args = map_aggregate(n.args, lambda a: env[a] if isinstance(a, Node) else a)
    kwargs = map_aggregate(n.kwargs, lambda a: env[a] if isinstance(a, Node) else a)
    try:
        if n.op == "call_function":
            value = _conv_layout(n.target, args, n.target(*args, **kwargs))
        else:
            value = getattr(args[0], n.target)(*args[1:], **kwargs)
        return _pointwise_layout(n, args, kwargs, value)
    except Exception as e:
        if strict:
            raise RuntimeError(f"cannot infer the metadata of {n.format_node()}: {e}") from e
        return _UNKNOWN  # the op cannot run on meta tensors: leave it unknown


CONVS = frozenset({torch.conv2d, torch.nn.functional.conv2d})  # (the channels-last pass's too)


def _conv_layout(target: Any, args: tuple, value: Any) -> Any:
    """A conv2d's value in the layout eager gives it. On meta tensors, which carry no
    device to pick a backend by, torch's conv2d returns a contiguous tensor; cuDNN and
    oneDNN return channels-last when the input's or the weight's strides read as
    channels-last (``suggest_memory_format``; cuDNN keeps float64 NCHW), and the
    precompile plans a channels-last net's kernels from this metadata. An (N, C, 1, 1)
    pool is both layouts by shape and channels-last by its strides: its 1 x 1 conv's
    value gets channels-last strides, ``(C', 1, C', C')``, which ``.contiguous()`` in
    either format would not give it."""
    if target not in CONVS or not isinstance(value, torch.Tensor) or value.dim() != 4:
        return value
    if any(isinstance(a, torch.Tensor) and a.dim() == 4
           and _strides_like_channels_last(a) for a in args[:2]):
        return torch.empty(value.shape, dtype=value.dtype, device=value.device,
                           memory_format=torch.channels_last)
    return value


_SMALL = 1 << 12  # elements: a pointwise op on tensors this small runs on the CPU to see


def _pointwise_layout(n: Node, args: tuple, kwargs: dict, value: Any) -> Any:
    """A pointwise op's value in the strides eager gives it, where a 4-d input is both NCHW
    and channels-last by its shape (an (N, C, 1, 1) pool): eager's iterator then takes
    the NCHW fast path or reads the strides, by which operands it has (``relu(p)`` is
    NCHW, ``p * 2`` keeps ``p``'s channels-last strides), where torch's meta kernels keep
    the input's strides in both. Such inputs are small: the op runs on CPU zeros of their
    layout (eager's iterator decides alike on every device), and its strides are taken
    (random ops are ``effect`` ops in the table, never run here: no generator moves)."""
    info = lookup(n) if isinstance(value, torch.Tensor) and value.dim() == 4 else None
    if info is None or info.kind != "pointwise":
        return value
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not any(map(_both_layouts, tensors)) or any(a.numel() > _SMALL for a in tensors):
        return value

    def cpu(a: Any) -> Any:
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).zero_() \
            if isinstance(a, torch.Tensor) else a

    run = n.target if n.op == "call_function" else getattr(torch.Tensor, n.target)
    try:
        eager = run(*map_aggregate(args, cpu), **map_aggregate(kwargs, cpu))
    except Exception:  # (a dtype the CPU lacks): the meta kernel's strides, as before
        return value
    if not isinstance(eager, torch.Tensor) or eager.shape != value.shape:
        return value
    return torch.empty_strided(value.shape, eager.stride(), dtype=value.dtype,
                               device=value.device)


def _both_layouts(t: torch.Tensor) -> bool:
    """Whether 4-d ``t`` is contiguous in both formats by its shape, with strides other
    than row-major's (which size-1 dims allow): where eager and the meta kernels part."""
    return t.dim() == 4 and t.is_contiguous() \
        and t.is_contiguous(memory_format=torch.channels_last) \
        and t.stride() != dense_strides(t.shape, range(4))


def _strides_like_channels_last(t: torch.Tensor) -> bool:
    """Whether a 4-d tensor's ``suggest_memory_format()`` is channels-last: c10's
    ``is_channels_last_strides_2d`` (dims C, W, H, N each no closer than the last; a
    stride-0 C, or an N as close as C, is read as NCHW)."""
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < low or d == 0 and low == strides[1]:
            return False
        low = strides[d] * max(sizes[d], 1)
    return True


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
    if m.stride:  # recorded; an unknown stride is taken as contiguous
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    return torch.empty(m.shape, dtype=m.dtype, device="meta")
