"""What fxlite records about a tensor value: shape, dtype, strides, memory format.

A node's ``meta['tensor_meta']`` holds a :class:`TensorMetadata`, made by
:func:`extract_tensor_metadata` from a real or meta tensor (ShapeProp, the op table's
shape rules in ``fxlite.ops.shapes``, and the passes that add nodes all record it this
way). The layouts a record may name are :data:`MEMORY_FORMATS`, with the rank each needs in
:data:`FORMAT_RANKS`.

The stride helpers say which dense layout a set of tensors lies in and build one:
:func:`memory_order` gives the order of dims (outermost first) that eager's TensorIterator
would iterate and lay its output out in, and :func:`dense_strides` the strides of a dense
tensor in a given order::

    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    extract_tensor_metadata(x).memory_format        # torch.channels_last
    order = memory_order([x])                       # (0, 2, 3, 1)
    dense_strides((2, 3, 4, 5), order)              # (60, 1, 15, 3): x.stride()

:func:`reduced_dims` is the one reading of a ``dim`` argument (a reduction's, squeeze's)
as the dims it names, used by the shape rules, the derivatives, fusion and codegen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fxlite.node import Node, describe_value

__all__ = ["FORMAT_RANKS", "MEMORY_FORMATS", "TensorMetadata", "dense_strides",
           "extract_tensor_metadata", "is_dense", "memory_order", "rebuild_tensor_metadata", "reduced_dims",
           "strided_meta", "views_as"]

# The dense layouts a tensor's metadata names (and a clone may ask for), with the rank
# each needs (0: any). Checked in this order: a tensor that is several at once (size-1
# dims) reports the first.
FORMAT_RANKS = {torch.contiguous_format: 0, torch.channels_last: 4, torch.channels_last_3d: 5}
MEMORY_FORMATS = tuple(FORMAT_RANKS)


class TensorMetadata(NamedTuple):
    """What ShapeProp records about one tensor.

    Attributes:
        shape: its ``torch.Size``.
        dtype: its element type.
        requires_grad: whether autograd tracks it.
        stride: its strides (``()`` for non-strided layouts such as sparse).
        memory_format: ``torch.contiguous_format``, ``torch.channels_last``,
            ``torch.channels_last_3d``, or None when it is laid out in none of them.
        is_quantized: whether it is a quantized tensor.
        qparams: for quantized tensors, ``qscheme`` and ``scale``/``zero_point`` (or
            per-channel ``scale``, ``zero_point`` and ``axis``); else empty.
    """

    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    stride: tuple[int, ...]
    memory_format: torch.memory_format | None
    is_quantized: bool = False
    qparams: dict[str, Any] = {}  # shared default; extract_tensor_metadata makes fresh ones

    def __reduce__(self) -> tuple:
        # torch.memory_format objects do not pickle at protocol 2, torch.save's default:
        # store the format's name and look it up again on load.
        fmt = None if self.memory_format is None else str(self.memory_format).rpartition(".")[2]
        return (rebuild_tensor_metadata, (self.shape, self.dtype, self.requires_grad,
                                          self.stride, fmt, self.is_quantized, self.qparams))


def rebuild_tensor_metadata(shape: torch.Size, dtype: torch.dtype, requires_grad: bool,
                            stride: tuple[int, ...], memory_format: str | None,
                            is_quantized: bool, qparams: dict[str, Any]) -> TensorMetadata:
    """The :class:`TensorMetadata` a pickle stored, its memory format given by name
    (``"channels_last"``); what unpickling calls."""
    fmt = None if memory_format is None else getattr(torch, memory_format)
    return TensorMetadata(shape, dtype, requires_grad, stride, fmt, is_quantized, qparams)


def extract_tensor_metadata(t: torch.Tensor) -> TensorMetadata:
    """Record ``t``'s shape, dtype, strides, memory format and quantization.

    Args:
        t: any tensor.

    Returns:
        Its :class:`TensorMetadata`.

    Example::

        >>> extract_tensor_metadata(torch.zeros(2, 3)).stride
        (3, 1)
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"extract_tensor_metadata: t must be a torch.Tensor, not {describe_value(t)}")
    strided = t.layout == torch.strided
    memory_format = None
    if strided:
        for fmt in MEMORY_FORMATS:
            if t.is_contiguous(memory_format=fmt):
                memory_format = fmt
                break
    qparams: dict[str, Any] = {}
    if t.is_quantized:
        qscheme = t.qscheme()
        qparams["qscheme"] = qscheme
        if qscheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            qparams["scale"] = t.q_scale()
            qparams["zero_point"] = t.q_zero_point()
        else:
            qparams["scale"] = t.q_per_channel_scales().tolist()
            qparams["zero_point"] = t.q_per_channel_zero_points().tolist()
            qparams["axis"] = t.q_per_channel_axis()
    return TensorMetadata(
        shape=t.shape, dtype=t.dtype, requires_grad=t.requires_grad,
        stride=tuple(t.stride()) if strided else (), memory_format=memory_format,
        is_quantized=t.is_quantized, qparams=qparams)


def _votes(t: torch.Tensor, rank: int, a: int, b: int) -> int:
    """-1: ``t`` wants dim ``a`` outside ``b``; 1: inside; 0: it does not say."""
    off = rank - t.dim()
    if a < off or b < off:
        return 0
    na, nb = t.shape[a - off], t.shape[b - off]
    sa, sb = t.stride(a - off), t.stride(b - off)
    if na == 1 or nb == 1 or sa == 0 or sb == 0 or sa == sb:
        return 0
    return -1 if sa > sb else 1


def memory_order(inputs: Sequence[Any]) -> tuple[int, ...] | None:
    """The order of dims (outermost first) that follows the inputs' memory layout.

    Args:
        inputs: a kernel's inputs (tensors and scalars).

    Returns:
        A permutation of the iteration space's dims, or None when the logical order is
        the memory order already (contiguous inputs) or no tensor says otherwise.

    Example::

        x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
        memory_order([x, 1.0])     # (0, 2, 3, 1)
        memory_order([x.contiguous()])  # None
    """
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    rank = max((t.dim() for t in tensors), default=0)
    if rank < 2:
        return None
    # TensorIterator's fast setup first: inputs of one shape, all contiguous (row-major
    # output) or all channels-last (a channels-last one), whatever their size-1 strides.
    if all(t.shape == tensors[0].shape for t in tensors):
        if all(t.is_contiguous() for t in tensors):
            return None
        if rank == 4 and all(t.is_contiguous(memory_format=torch.channels_last)
                             for t in tensors):
            return (0, 2, 3, 1)
    # TensorIterator's reorder_dimensions: insertion sort, innermost first. A pair no
    # tensor tells apart (size 1, broadcast) does not stop the search for a place.
    perm = list(range(rank - 1, -1, -1))
    for i in range(1, rank):
        inner = i
        for outer in range(i - 1, -1, -1):
            vote = 0
            for t in tensors:
                vote = _votes(t, rank, perm[inner], perm[outer])
                if vote:
                    break
            if vote == 1:  # perm[outer] belongs inside perm[inner]: swap
                perm[outer], perm[inner] = perm[inner], perm[outer]
                inner = outer
            elif vote == -1:
                break
    order = perm[::-1]
    return None if order == sorted(order) else tuple(order)


def dense_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` whose dims lie in ``order`` (outermost first)."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is non-overlapping and dense (some permutation of it is contiguous):
    what ``empty_like`` reproduces stride for stride, and what a kernel walking its
    memory flat (torch's fused optimizer steps) may take.

    Example::

        is_dense(x.t()), is_dense(x[:, ::2])   # True, False
    """
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1)
    step = 1
    for s, n in dims:
        if s != step:
            return False
        step *= n
    return True


def reduced_dims(dim: Any, rank: int) -> tuple[int, ...]:
    """A ``dim`` argument as the sorted, distinct, non-negative dims it names.

    None, ``()`` and ``[]`` name every dim; an int or a sequence of ints is wrapped by
    ``rank`` (no range check: callers that must reject a dim out of range check first).
    A 0-d tensor has no dims::

        reduced_dims(None, 3)         # (0, 1, 2)
        reduced_dims((-1, 0, 2), 3)   # (0, 2)
        reduced_dims(-1, 0)           # ()
    """
    if dim is None or dim == () or dim == []:
        return tuple(range(rank))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return tuple(sorted({d % rank for d in dims})) if rank else ()


def strided_meta(n: Any) -> TensorMetadata | None:
    """``n``'s ShapeProp metadata where ``n`` is a node of one tensor with strides, else
    None (not a node, no metadata, a tuple of results, a 0-d or sparse tensor).

    Example::

        strided_meta(node).stride   # (32, 1) for a row-major 4 x 32 value
    """
    tm = n.meta.get("tensor_meta") if isinstance(n, Node) else None
    return tm if isinstance(tm, TensorMetadata) and tm.stride != () else None


def views_as(tm: TensorMetadata | None, shape: Sequence[int]) -> bool:
    """Whether a tensor of ``tm``'s shape and strides takes ``.view(shape)`` (a reshape
    that copies nothing); False for no metadata and for a tensor without elements.

    Example::

        views_as(strided_meta(permuted), (-1, 32))   # False: its rows are not one stride apart
    """
    if tm is None or 0 in tm.shape:
        return False
    t = torch.empty_strided(tuple(tm.shape), tuple(tm.stride), dtype=tm.dtype, device="meta")
    try:
        t.view(tuple(shape))
    except RuntimeError:
        return False
    return True
