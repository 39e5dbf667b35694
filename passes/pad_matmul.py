"""pad_linears: aligned rows for a linear layer whose output width is odd.

cuBLAS's tensor-core kernels need every row of a matmul's output to start on a 16-byte
boundary. A linear layer with 50,257 outputs (GPT-2's vocabulary) gives rows of odd
length, and cuBLAS then runs an old kernel that does not need the alignment: on an H200,
GPT-2's LM head at batch 32 x 128 tokens in bfloat16 took 3.3 ms of the model's 5.0 ms of
GPU time (torch.profiler). With the weight's rows padded to a multiple of 16 bytes, the
matmul writes aligned rows; a ``clone`` of their first columns gives eager's contiguous
result. The clone is a graph op, so it fuses: alone it is a Triton copy (0.23 ms for
GPT-2's bfloat16 logits at batch 32 on an H200, where torch's copy of the same slice took
0.46), and a pointwise consumer (a cast, a softmax) reads the padded rows directly.

The padded weight is made on each call: one copy of the weight, 0.074 ms of GPU time for
GPT-2's head in bfloat16 on an H200. A copy kept between calls could go stale: a write
through ``weight.data`` changes no version counter that a check could read. Calls that
autograd records run the plain ``F.linear`` (the slice then takes every column).

Writing the plain weight's product into a padded view (``torch.mm(..., out=view)``, the
row stride aligned but 50,257 columns) does not help: cuBLAS still ran the old kernel,
3.35 ms for GPT-2's bfloat16 head at batch 32 on an H200, against 0.49 ms for the padded
weight's copy and matmul together.

Example::

    # before                                   # after
    logits = torch._C._nn.linear(h, wte)        padded = padded_linear(h, wte)
                                                 rows = padded[..., :50257]
                                                 logits = torch.clone(rows)
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from fxlite.passes.shape_prop import node_layout

from fxlite.graph_module import GraphModule
from fxlite.node import Node

__all__ = ["pad_linears", "padded_linear"]

_LINEARS = frozenset({F.linear, torch._C._nn.linear})
_MIN_FLOPS = 1e9  # below this the copies cost more than the alignment saves


def _aligned(rows: int, dtype: torch.dtype) -> int:
    per = max(1, 16 // dtype.itemsize)
    return -(-rows // per) * per


def padded_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed with ``weight``'s rows padded so that the
    output's rows are 16-byte aligned: its last dim is ``weight.shape[0]`` rounded up, and
    the linear's values are its first ``weight.shape[0]`` columns. Without padding to do,
    or when autograd records the call, it is the plain ``F.linear``."""
    rows = weight.shape[0] if weight.dim() == 2 else 0
    if not rows or _aligned(rows, weight.dtype) == rows or torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias)):
        return F.linear(x, weight, bias)
    pad = _aligned(rows, weight.dtype) - rows
    b = None if bias is None else F.pad(bias, (0, pad))
    return F.linear(x, _pad_rows(weight, pad), b)


def _pad_rows(weight: torch.Tensor, pad: int) -> torch.Tensor:
    """``weight`` with ``pad`` rows of zeros below it. One copy and a fill of the new rows
    alone (``F.pad`` fills the whole buffer first: GPT-2's head on an H200 took 24 us
    for that fill and 41 for the copy)."""
    out = weight.new_empty((weight.shape[0] + pad, weight.shape[1]))
    out[:weight.shape[0]].copy_(weight)
    out[weight.shape[0]:].zero_()
    return out


def pad_linears(gm: GraphModule) -> bool:
    """Route each large ``linear`` of a 16- or 32-bit float weight whose rows would not be
    16-byte aligned through :func:`padded_linear`, and give its users a contiguous clone
    of the linear's columns. Linears that autograd would record (grad mode on and a
    tensor needing grad, when the recording saw them) are left alone. Returns whether
    ``gm`` changed."""
    changed = False
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _LINEARS or len(n.args) < 2:
            continue
        x, w = node_layout(n.args[0]), node_layout(n.args[1])
        if x is None or w is None or len(w[0]) != 2 or not x[0] or w[2] not in (
                torch.float16, torch.bfloat16, torch.float32) or _records_grad(n):
            continue
        rows, k = w[0]
        m = 1
        for size in x[0][:-1]:
            m *= size
        if _aligned(rows, w[2]) != rows and 2 * m * rows * k >= _MIN_FLOPS:
            n.target = padded_linear
            with graph.inserting_after(n):
                cut = graph.call_function(operator.getitem, (n, (Ellipsis, slice(None, rows))))
                with graph.inserting_after(cut):
                    out = graph.call_function(torch.clone, (cut,))
            n.replace_all_uses_with(out, delete_user_cb=lambda user, cut=cut: user is not cut)
            for key in ("tensor_meta", "tensor_meta_rec", "type", "device"):
                if key in n.meta:  # the clone has the linear's result; the new ones get theirs
                    out.meta[key] = n.meta.pop(key)
            changed = True
    if changed:
        gm.recompile()
    return changed


def _records_grad(n: Node) -> bool:
    """Whether autograd recorded the call when fxlite.compile's recording saw it."""
    return bool(n.meta.get("requires_grad") and n.meta.get("grad_enabled"))
