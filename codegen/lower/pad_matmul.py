"""pad_linears: aligned rows for a linear layer whose output width is odd.

cuBLAS's tensor-core kernels need every row of a matmul's output to start on a 16-byte
boundary. A linear layer with 50,257 outputs (GPT-2's vocabulary) gives rows of odd
length, and cuBLAS then runs an old kernel that does not need the alignment: on an H200,
GPT-2's LM head at batch 32 x 128 tokens in bfloat16 took 3.3 ms of the model's 5.0 ms of
GPU time (torch.profiler). Two ways around it, chosen per linear from its shapes:

- **Row groups** (:func:`grouped_linear`, no bias, many rows). With ``per`` elements to
  16 bytes, rows ``r, r + per, r + 2 per, ...`` of eager's contiguous result form a matrix
  whose row stride (``per`` rows) is aligned. Starting each group at a column that makes
  its first element aligned, all ``per`` groups are one strided batched matmul straight
  into the result; two thin matmuls fill the columns left at both edges. GPT-2's head in
  bfloat16 at 4096 rows took 0.61 ms of GPU time on an H200 this way, against 0.98 ms
  padded and copied, and 3.33 ms plain (``benchmarks/bench_lm_head.py``). Each group
  reads the whole weight, so with few rows the padded copy is cheaper (128 rows:
  0.157 ms grouped, 0.098 padded).
- **A padded weight** (:func:`padded_linear`). With the weight's rows padded to a multiple
  of 16 bytes, the matmul writes aligned rows; a ``clone`` of their first columns gives
  eager's contiguous result. The clone is a graph op, so it fuses: alone it is a Triton
  copy, and a pointwise consumer (a cast, a softmax) reads the padded rows directly. The
  padded weight is made on each call (0.074 ms for GPT-2's bfloat16 head on an H200): a
  copy kept between calls could go stale, as a write through ``weight.data`` changes no
  version counter that a check could read. In float32 with few rows the plain linear is
  faster (128 rows: 0.096 ms plain, 0.189 padded), and the layer is left alone.

Calls that autograd records take the padded weight (autograd records the pad and the
slice, so the backward's matmuls are aligned too). Row groups write into one result
buffer, which autograd cannot record: they take only calls it does not record, whose
tensors meet their alignment and that autocast would not cast.

Writing the plain weight's product into a padded view (``torch.mm(..., out=view)``, the
row stride aligned but 50,257 columns) does not help: cuBLAS still ran the old kernel,
3.35 ms for GPT-2's bfloat16 head at batch 32 on an H200. The row groups' widths are
multiples of ``per`` too.

Example::

    # before                                   # after (padded weight)
    logits = torch._C._nn.linear(h, wte)        padded = padded_linear(h, wte)
                                                 rows = padded[..., :50257]
                                                 logits = torch.clone(rows)
                                                 # after (row groups)
                                                 logits = grouped_linear(h, wte)
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from fxlite.passes.shape_prop import node_layout

from fxlite.graph_module import GraphModule
from fxlite.node import Node

__all__ = ["grouped_linear", "pad_linears", "padded_linear"]

_LINEARS = frozenset({F.linear, torch._C._nn.linear})
_MIN_FLOPS = 1e9  # below this the copies cost more than the alignment saves
_GROUP_ROWS = 128  # rows a row group needs for its matmul to pay for reading the weight
_F32_PAD_ROWS = 1024  # float32: fewer rows run the plain linear faster than padded


def _aligned(rows: int, dtype: torch.dtype) -> int:
    per = _per(dtype)
    return -(-rows // per) * per


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  width: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed with ``weight``'s rows padded so that the
    output's rows are 16-byte aligned: its last dim is ``width`` (by default
    ``weight.shape[0]`` rounded up to 16 bytes), and the linear's values are its first
    ``weight.shape[0]`` columns. ``dtype`` is the dtype the matmul runs in, where autocast
    chose one: the tensors are cast to it first, as autocast casts them, so that the
    weight is padded in the dtype whose alignment counts (a float32 weight padded for
    float32 would leave bfloat16 rows unaligned), whatever autocast state the call sees.

    Autograd records the casts and the pad like any op, so a training step's backward
    matmuls are aligned too: the output's gradient reaches the matmul padded with zero
    columns, and the weight's gradient is the padded weight's first rows."""
    if dtype is not None:
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    rows = weight.shape[0] if weight.dim() == 2 else 0
    width = _aligned(rows, weight.dtype) if width is None else width
    if not rows or width <= rows:
        return F.linear(x, weight, bias)
    b = None if bias is None else F.pad(bias, (0, width - rows))
    return F.linear(x, _pad_rows(weight, width - rows), b)


def _per(dtype: torch.dtype) -> int:
    return max(1, 16 // dtype.itemsize)


def _groups_fit(rows: int, k: int, m: int, dtype: torch.dtype) -> bool:
    """Whether a bias-free linear of these sizes runs as row groups (:func:`grouped_linear`)."""
    per = _per(dtype)
    return (per > 1 and m % per == 0 and m // per >= _GROUP_ROWS and k % per == 0
            and rows >= 8 * per * per)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, eager's contiguous result, written by aligned matmuls when
    ``weight``'s rows are not a multiple of 16 bytes (see the module's docstring).

    Rows of the result are taken in ``per`` interleaved groups (``per`` elements to 16
    bytes): group ``r`` holds rows ``r, r + per, ...`` and starts at column
    ``per + s * r`` (``s`` makes its first element aligned), so its row stride, its start
    and its weight rows are all aligned, and the groups are one strided ``bmm``. The
    columns before the last group's start and after the first group's end come from two
    thin matmuls over every row. Tensors that do not fit (not contiguous, misaligned, a
    row count that ``per`` does not divide, other dtypes, autocast, autograd recording)
    run the plain ``F.linear``, as does a call with a bias.
    """
    rows, k = weight.shape if weight.dim() == 2 else (0, 0)
    per = _per(weight.dtype)
    if bias is not None or not rows or not _grouped_call_fits(x, weight, per):
        return F.linear(x, weight, bias)
    flat = x.view(-1, k)
    m = flat.shape[0] // per
    out = flat.new_empty((flat.shape[0], rows))
    shift = -rows % per  # group r starts at per + shift * r: r * rows + that is aligned
    last = per + shift * (per - 1)
    width = (rows - last) // per * per
    a = flat.as_strided((per, m, k), (k, per * k, 1))
    b = weight.as_strided((per, k, width), (shift * k, 1, k), weight.storage_offset() + per * k)
    c = out.as_strided((per, m, width), (rows + shift, per * rows, 1), per)
    torch.bmm(a, b, out=c)
    for lo, hi in ((0, last), (per + width, rows)):
        if hi > lo:
            torch.mm(flat, weight[lo:hi].t(), out=out[:, lo:hi])
    return out.view(*x.shape[:-1], rows)


def _grouped_call_fits(x: torch.Tensor, weight: torch.Tensor, per: int) -> bool:
    rows, k = weight.shape
    if (per == 1 or x.dtype != weight.dtype or x.device != weight.device or x.dim() < 2
            or x.shape[-1] != k or k % per or rows < 8 * per * per):
        return False
    if not (x.is_contiguous() and weight.is_contiguous()) or x.numel() // k % per:
        return False
    if (x.data_ptr() % 16 or weight.data_ptr() % 16 or x.numel() // k < per
            or torch.is_autocast_enabled(x.device.type)):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


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
    16-byte aligned through :func:`grouped_linear` (bias-free, with many rows) or through
    :func:`padded_linear`, whose users get a contiguous clone of the linear's columns.
    Linears that autograd would record (grad mode on and a tensor needing grad, when the
    recording saw them) take the padded weight; float32 ones with few rows are left alone
    (outside autocast). Returns whether ``gm`` changed."""
    changed = False
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _LINEARS or len(n.args) < 2:
            continue
        x, w = node_layout(n.args[0]), node_layout(n.args[1])
        if x is None or w is None or len(w[0]) != 2 or not x[0] or w[2] not in (
                torch.float16, torch.bfloat16, torch.float32):
            continue
        rows, k = w[0]
        m = 1
        for size in x[0][:-1]:
            m *= size
        out = node_layout(n)
        dtype = out[2] if out is not None and n.meta.get("autocast") else w[2]
        if _aligned(rows, dtype) == rows or 2 * m * rows * k < _MIN_FLOPS:
            continue
        bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if (bias is None and not n.kwargs and not _records_grad(n)
                and dtype == w[2] and _groups_fit(rows, k, m, w[2])):
            n.target = grouped_linear
            changed = True
        elif dtype != torch.float32 or m >= _F32_PAD_ROWS:
            n.target = padded_linear
            n.args = (n.args[0], n.args[1], bias, _aligned(rows, dtype),
                      None if dtype == w[2] else dtype)
            n.kwargs = {}
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
