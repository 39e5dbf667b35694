"""The memory order a pointwise kernel iterates in: its inputs' layout, as eager's.

A pointwise kernel walks its iteration space with one linear index. Walking it in the
logical order of the dims (row-major over the shape) is right for contiguous inputs, but
a channels-last tensor, or a permuted view such as ``linear(x).permute(0, 3, 1, 2)``, is
then read with a large stride between neighbouring lanes: every load is a transpose
(measured at 24% of copy for convnext's layer-scale ``mul`` on an H200).

Eager's TensorIterator instead orders the dims by the operands' strides (the first
operand that tells two dims apart decides, broadcast operands abstain) and gives its
output the same layout. :func:`memory_order` computes that order (it and
:func:`dense_strides` live in the core's ``fxlite.tensor_meta``, which the op table's shape
rules share; imported here); the kernel is then specialized for and launched on inputs
permuted into it (views: no copy), so that its loads and stores are linear, and the outputs
are permuted back: values as before, and the output layout that eager would pick (a
channels-last result for channels-last inputs)::

    order = memory_order(inputs)         # (0, 2, 3, 1) for channels-last NCHW inputs
    inner = permute_inputs(inputs, order)
    outs = [o.permute(inverse(order)) for o in kernel_on(inner)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fxlite.tensor_meta import dense_strides, memory_order

__all__ = ["dense_strides", "eager_layout", "inverse", "memory_order", "merges", "permute_inputs",
           "stride_order"]


def inverse(order: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes ``order``."""
    out = [0] * len(order)
    for i, d in enumerate(order):
        out[d] = i
    return tuple(out)


def permute_inputs(inputs: Sequence[Any], order: Sequence[int]) -> list[Any]:
    """Each tensor input viewed at the full rank and permuted into ``order``.

    Lower-rank tensors get leading size-1 dims first (broadcasting aligns on the right);
    scalars and 0-dim tensors pass through (a 0-dim tensor promotes less than one with
    dims: ``bf16 / tensor(2.0)`` is bf16). All are views: the data pointers do not change.
    """
    rank = len(order)
    out: list[Any] = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            if t.dim() < rank:
                t = t[(None,) * (rank - t.dim()) + (Ellipsis,)]
            t = t.permute(order)
        out.append(t)
    return out


# ---------------------------------------------------------------------- output layouts
# A kernel that does not run in memory order (a reduction group, say) stores each output
# in the layout eager gave it: ``softmax(x)`` is row-major whatever ``x``'s layout, but
# ``x.fmod(x)`` has ``x``'s. The layout comes from the group's metadata (the recording's
# real tensors, or a run on meta tensors for these inputs), so it depends on the order of
# the inputs' strides: the guard key holds that order (:func:`stride_order`).


def stride_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dims that are neither size 1 nor broadcast, outermost (largest stride) first."""
    shape, stride = t.shape, t.stride()
    dims = [d for d in range(t.dim()) if shape[d] != 1 and stride[d] != 0]
    return tuple(sorted(dims, key=lambda d: -stride[d]))


def eager_layout(t: torch.Tensor) -> tuple[int, ...] | None:
    """The order of ``t``'s dims (outermost first) that lays it out densely as it is.

    Returns:
        None when ``t`` is row-major (or is not dense: overlapping or with gaps, which a
        kernel's fresh output never copies). A size-1 dim sits inside a dim of equal stride.

    Example::

        eager_layout(torch.randn(5, 3).t())    # (1, 0)
        eager_layout(torch.randn(3, 5))        # None
    """
    k = t.dim()
    shape, stride = t.shape, t.stride()
    order = tuple(sorted(range(k), key=lambda d: (-stride[d], shape[d] == 1, d)))
    if order == tuple(range(k)):
        return None
    want = dense_strides(shape, order)
    if any(shape[d] != 1 and want[d] != stride[d] for d in range(k)):
        return None
    return order


def merges(inputs: Sequence[Any], runs: Sequence[Sequence[int]]) -> bool:
    """Whether the first tensor of ``inputs`` lays out each run of dims in ``runs`` as one
    dim (each dim's stride is the next one's size times its stride): a pointwise kernel's
    transpose variant addresses a run through its innermost stride.

    Example::

        merges([torch.randn(2, 3, 4, 5)], [(2, 3)])          # True
        merges([torch.randn(2, 3, 4, 8)[..., :5]], [(2, 3)])  # False
    """
    t = next(x for x in inputs if isinstance(x, torch.Tensor))
    return all(t.stride(d) == t.shape[e] * t.stride(e)
               for run in runs for d, e in zip(run, run[1:]))
