"""fuse_cross_entropy: a classifier's loss in two kernels, its logits kept in their dtype.

transformers' causal-LM loss upcasts the logits, then calls eager's cross entropy::

    logits = logits.float()                               # (N, V): bfloat16 -> float32
    loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)

Eager then makes, at the logits' size in float32: the upcast copy, the log-softmax it saves
for the backward, and in the backward nll's gradient and log-softmax's, before casting back
to bfloat16. For GPT-2 124M at 8 x 1024 tokens (V = 50,257) each is 1.53 GiB, and three of
them were live at fxlite's peak (BENCHMARKS.md, twenty-sixth session). nanoGPT's loss
takes 16-bit logits under autocast. On the CPU, autocast runs it on their float32 upcast,
as above; on CUDA it keeps the log-softmax in the logits' dtype (cross entropy passes it
their dtype) and upcasts only that for nll: the log-probabilities are rounded to 16 bits,
and the backward rounds nll's gradient, then log-softmax's, to 16 bits.

:func:`fused_cross_entropy` computes the loss from the logits as they are: one kernel
finds each row's maximum and log-sum-exp in float32 (a running maximum and sum over the
row's chunks) and its loss, ``lse - x[target]``; the mean over the counted rows is
torch's. It saves the logits and two floats a row (the maximum and the log of the sum, kept
apart so that ``x - lse`` rounds as eager's log-softmax does). Its backward is one kernel
that writes the gradient straight in the logits' dtype, ``(exp(x - lse) - onehot(target))
* g / count``: eager's value in float32, rounded once, as eager's cast back rounds it.

Under CUDA's autocast the kernels round where eager does: each row's log-probability of
its target is rounded before the loss; in the backward, ``g / count`` and each
log-probability are rounded before ``onehot(target) * g - exp(logp) * g`` (log-softmax's
backward).

Semantics are eager's: rows whose target is ``ignore_index`` add 0 and are not counted (a
mean over no counted rows is NaN, their gradient 0); a NaN or infinite logit makes its
row's loss what eager's gives (NaN). One difference: a target outside ``[0, V)`` (and not
``ignore_index``) makes the loss NaN, where eager's CUDA kernel stops the process with a
device-side assertion. A backward that builds a graph (``create_graph=True``) computes
the gradient with differentiable torch ops instead. Off CUDA (and off Triton's
interpreter), and for layouts the kernels do not take, the function runs eager's ops.

Example of the pass::

    # before                                         # after
    float_1 = logits.float()                          view = logits.view(-1, 50257)
    view = float_1.view(-1, 50257)                    loss = fused_cross_entropy(
    loss = F.cross_entropy(view, labels,                  view, labels, -100, 'mean', True,
                           ignore_index=-100)                 False)
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from fxlite.codegen.kernels.generate import interpreting
from fxlite.codegen.kernels.pool import nearest_bf16
from fxlite.codegen.lower.pad_matmul import padded_linear
from fxlite.passes.shape_prop import node_layout

from fxlite.graph_module import GraphModule
from fxlite.node import Node

__all__ = ["fuse_cross_entropy", "fused_cross_entropy"]

_HALVES = (torch.float16, torch.bfloat16)
_FLOATS = (*_HALVES, torch.float32)
_SIGNATURE = inspect.signature(F.cross_entropy)
_VIEWS = frozenset({"view", "reshape", "flatten"})
_MAX_BLOCK = 4096


@triton.jit
def _rounded(v, dtype: tl.constexpr, NEAREST_BF16: tl.constexpr):
    """float32 ``v`` rounded to ``dtype`` and back (``NEAREST_BF16``: to nearest, where the
    interpreter's own bfloat16 cast truncates)."""
    if NEAREST_BF16:
        return nearest_bf16(v)
    return v.to(dtype).to(tl.float32)


@triton.jit
def _cross_entropy_forward(x_ptr, t_ptr, loss_ptr, top_ptr, log_sum_ptr, row_stride, C,
                           ignore_index, ROUND: tl.constexpr, NEAREST_BF16: tl.constexpr,
                           BLOCK: tl.constexpr):
    """One row: its maximum and the log of its sum of ``exp(x - maximum)`` (running
    maxima and sums per lane, float32), and its loss, in eager's order of roundings:
    ``-((x[t] - maximum) - log_sum)``, the log-probability rounded to x's dtype first where
    ``ROUND`` (CUDA's autocast)."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, C, BLOCK):
        c = start + cols
        x = tl.load(base + c, mask=c < C, other=float("-inf")).to(tl.float32)
        new = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
        # a lane that has seen only -inf subtracts 0, not -inf (-inf - -inf is NaN)
        shift = tl.where(new == float("-inf"), 0.0, new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = new
    top = tl.max(m, 0)  # a NaN lane has a NaN sum: the total is NaN whatever top is
    top = tl.where(top == float("-inf"), 0.0, top)
    log_sum = tl.log(tl.sum(s * tl.exp(m - top), 0))
    t = tl.load(t_ptr + row).to(tl.int64)
    counted = t != ignore_index
    inside = (t >= 0) & (t < C)
    xt = tl.load(base + t, mask=counted & inside, other=0.0).to(tl.float32)
    log_prob = (xt - top) - log_sum
    if ROUND:
        log_prob = _rounded(log_prob, x_ptr.dtype.element_ty, NEAREST_BF16)
    loss = tl.where(counted, tl.where(inside, -log_prob, float("nan")), 0.0)
    tl.store(loss_ptr + row, loss)
    tl.store(top_ptr + row, top)
    tl.store(log_sum_ptr + row, log_sum)


@triton.jit
def _cross_entropy_backward(x_ptr, t_ptr, top_ptr, log_sum_ptr, scale_ptr, dx_ptr, row_stride,
                            C, W, ignore_index, ROUND: tl.constexpr, NEAREST_BF16: tl.constexpr,
                            BLOCK: tl.constexpr):
    """One row of the gradient, ``(exp((x - top) - log_sum) - onehot(t)) * scale``, in dx's
    dtype; where ``ROUND`` (CUDA's autocast), log-softmax's backward of rounded values,
    ``onehot(t) * g - exp(logp) * g`` with ``g = -scale`` and ``logp`` rounded to dx's dtype.
    dx's rows are ``W`` wide: columns from ``C`` on (a padded linear's) get zeros.
    (``NEAREST_BF16``: bfloat16 rounded to nearest, where the interpreter's cast truncates.)"""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    out = dx_ptr + row * W
    cols = tl.arange(0, BLOCK)
    t = tl.load(t_ptr + row).to(tl.int64)
    top = tl.load(top_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    coef = tl.where(t != ignore_index, tl.load(scale_ptr), 0.0)
    if ROUND:  # nll's gradient at the target, -scale, as eager's cast back rounds it
        coef = -_rounded(coef, dx_ptr.dtype.element_ty, NEAREST_BF16)
    for start in range(0, W, BLOCK):
        c = start + cols
        x = tl.load(base + c, mask=c < C, other=0.0).to(tl.float32)
        if ROUND:
            log_prob = _rounded((x - top) - log_sum, dx_ptr.dtype.element_ty, NEAREST_BF16)
            g = tl.where(c == t, coef, 0.0) - tl.exp(log_prob) * coef
        else:
            g = (tl.exp((x - top) - log_sum) - tl.where(c == t, 1.0, 0.0)) * coef
        g = tl.where(c < C, g, 0.0)
        if NEAREST_BF16:
            g = nearest_bf16(g)
        tl.store(out + c, g.to(dx_ptr.dtype.element_ty), mask=c < W)


def _launch_shape(classes: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of ``classes`` values: chunks of up to 4,096 values, 16
    warps for the widest (the best of 12 shapes for the three cases of
    ``benchmarks/bench_cross_entropy.py --sweep``, within 3% of each case's best)."""
    block = min(_MAX_BLOCK, triton.next_power_of_2(max(classes, 16)))
    return block, 16 if block >= 4096 else 8 if block >= 2048 else 4


def _kernels_take(x: torch.Tensor, target: torch.Tensor) -> bool:
    return ((x.is_cuda or interpreting()) and x.dtype in _FLOATS and x.dim() == 2
            and x.stride(1) == 1 and target.dim() == 1 and target.shape[0] == x.shape[0]
            and target.dtype == torch.int64 and target.device == x.device)


class _CrossEntropy(torch.autograd.Function):
    """The loss and its gradient, each one kernel (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor, ignore_index: int,
                reduction: str, rounded: bool = False, classes: int | None = None
                ) -> torch.Tensor:
        rows, width = x.shape
        classes = width if classes is None else classes
        losses = torch.empty(rows, dtype=torch.float32, device=x.device)
        top = torch.empty(rows, dtype=torch.float32, device=x.device)
        log_sum = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            block, warps = _launch_shape(classes)
            _cross_entropy_forward[(rows,)](x, target, losses, top, log_sum, x.stride(0),
                                            classes, ignore_index, ROUND=rounded,
                                            NEAREST_BF16=rounded and _nearest_bf16(x),
                                            BLOCK=block, num_warps=warps)
        count = (target != ignore_index).sum()
        loss = losses.sum()
        if reduction == "mean":
            loss = loss / count
        ctx.save_for_backward(x, target, top, log_sum, count)
        ctx.ignore_index, ctx.reduction, ctx.rounded = ignore_index, reduction, rounded
        ctx.classes = classes
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, target, top, log_sum, count = ctx.saved_tensors
        scale = grad.float() / count if ctx.reduction == "mean" else grad.float()
        if torch.is_grad_enabled():  # create_graph: a gradient autograd can differentiate
            grad = _differentiable_grad(x[:, :ctx.classes], target, ctx.ignore_index, scale,
                                        ctx.rounded)
            return F.pad(grad, (0, x.shape[1] - ctx.classes)), None, None, None, None, None
        rows, width = x.shape
        dx = torch.empty((rows, width), dtype=x.dtype, device=x.device)
        if rows:
            block, warps = _launch_shape(ctx.classes)
            _cross_entropy_backward[(rows,)](x, target, top, log_sum, scale.reshape(1), dx,
                                             x.stride(0), ctx.classes, width, ctx.ignore_index,
                                             ROUND=ctx.rounded, NEAREST_BF16=_nearest_bf16(x),
                                             BLOCK=block, num_warps=warps)
        return dx, None, None, None, None, None


def _nearest_bf16(x: torch.Tensor) -> bool:
    """Whether the kernels round bfloat16 by hand (the interpreter's cast truncates)."""
    return x.dtype == torch.bfloat16 and interpreting()


def _differentiable_grad(x: torch.Tensor, target: torch.Tensor, ignore_index: int,
                         scale: torch.Tensor, rounded: bool) -> torch.Tensor:
    """The backward kernel's value from torch ops that autograd records."""
    counted = target != ignore_index
    onehot = F.one_hot(torch.where(counted, target, 0), x.shape[1]).to(torch.float32)
    coef = torch.where(counted, scale, 0.0)[:, None]
    if rounded:
        g = -coef.to(x.dtype).float()
        log_prob = torch.log_softmax(x.float(), -1).to(x.dtype).float()
        return (onehot * g - log_prob.exp() * g).to(x.dtype)
    return ((torch.softmax(x.float(), -1) - onehot) * coef).to(x.dtype)


def fused_cross_entropy(x: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                        reduction: str = "mean", upcast: bool = False,
                        autocast: bool = False, classes: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(x.to(torch.float32) if upcast else x, target,
    ignore_index=ignore_index, reduction=reduction)``, with the kernels of the module
    docstring where they apply (``x`` of shape ``(N, C)`` in float16, bfloat16 or float32
    with unit column stride, ``target`` of shape ``(N,)``, on CUDA or Triton's interpreter;
    ``reduction`` ``"mean"`` or ``"sum"``), eager's ops elsewhere.

    Args:
        x: the logits; with ``upcast`` or ``autocast``, in their 16-bit dtype (the gradient
            comes back in their dtype, as eager gives it).
        target: class indices.
        ignore_index: a target that adds nothing to the loss and is not counted.
        reduction: ``"mean"`` (over the counted rows) or ``"sum"``.
        upcast: whether eager computed the loss of ``x`` cast to float32.
        autocast: whether eager computed the loss of the 16-bit ``x`` under autocast, as
            this call does: in float32 on the CPU, as ``upcast``; on CUDA with the
            log-probabilities rounded to ``x``'s dtype (the module docstring).
        classes: where given, the logits are ``x``'s first ``classes`` columns (``x``: a
            padded linear's rows, read in place); the other columns get zero gradients.

    Returns:
        The float32 scalar loss.
    """
    if reduction in ("mean", "sum") and (upcast or autocast or x.dtype == torch.float32) \
            and _kernels_take(x, target):
        return _CrossEntropy.apply(x, target, ignore_index, reduction,
                                   autocast and x.dtype != torch.float32 and x.is_cuda, classes)
    if classes is not None:
        x = x[:, :classes]
    return F.cross_entropy(x.to(torch.float32) if upcast else x, target,
                           ignore_index=ignore_index, reduction=reduction)


def _only_user(n: Node, user: Node) -> bool:
    return list(n.users) == [user]


def _upcast_source(n: Node) -> Node | None:
    """The 16-bit value that ``n`` (a cast to float32 that nothing else reads) upcasts."""
    if n.op != "call_method" or not n.args or not isinstance(n.args[0], Node):
        return None
    spelled = (n.target == "float" and len(n.args) == 1 and not n.kwargs) or (
        n.target == "to" and ((len(n.args) == 2 and n.args[1] is torch.float32 and not n.kwargs)
                              or (len(n.args) == 1 and n.kwargs == {"dtype": torch.float32})))
    if not spelled:  # x.float(), x.to(torch.float32), x.to(dtype=torch.float32)
        return None
    src, out = node_layout(n.args[0]), node_layout(n)
    if src is None or out is None or src[2] not in _HALVES or out[2] != torch.float32 \
            or src[:2] != out[:2]:
        return None
    return n.args[0]


def _read_padded_rows(n: Node) -> None:
    """Where the loss ``n`` (now ``fused_cross_entropy``) reads the contiguous clone of a
    padded linear's first columns (``pad_matmul.pad_linears``), through a view or not, and
    nothing else reads the clone, let it read the padded rows in place: no clone, and its
    backward writes the padded rows' gradient (zeros in the padding), where autograd made
    a zero-filled buffer and copied the columns into it (GPT-2's head on an H200: the
    clone 0.49 ms and that copy 0.95 ms a step; nanoGPT's the same)."""
    graph, x = n.graph, n.args[0]
    view = x if x.op == "call_method" and x.target in _VIEWS else None
    clone = view.args[0] if view is not None else x
    if not (isinstance(clone, Node) and clone.op == "call_function"
            and clone.target is torch.clone and len(clone.args) == 1 and not clone.kwargs
            and _only_user(clone, view or n) and (view is None or _only_user(view, n))):
        return
    cut = clone.args[0]
    if not (isinstance(cut, Node) and cut.op == "call_function"
            and cut.target is operator.getitem and len(cut.args) == 2
            and isinstance(cut.args[0], Node) and cut.args[0].target is padded_linear
            and _only_user(cut, clone)):
        return
    padded, index = cut.args
    # pad_linears' cut: (..., :classes) of a result whose rows are args[3] wide
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis
            and isinstance(index[1], slice) and index[1].start is None
            and index[1].step is None and isinstance(index[1].stop, int)
            and len(padded.args) > 3 and isinstance(padded.args[3], int)):
        return
    classes, width = index[1].stop, padded.args[3]
    layout, rec = node_layout(x), x.meta.get("tensor_meta_rec")
    if layout is None or rec is None or layout[0][1] != classes:
        return
    with graph.inserting_before(n):
        rows = graph.call_method("reshape", (padded, (-1, width)))
    rows.meta.update({k: v for k, v in x.meta.items() if not k.startswith("tensor_meta")})
    rows.meta["tensor_meta_rec"] = ((layout[0][0], width), (width, 1), *rec[2:])
    n.args = (rows, *n.args[1:], classes)
    for dead in (view, clone, cut):
        if dead is not None:
            graph.erase_node(dead)


def _with_dtype(n: Node, dtype: torch.dtype) -> None:
    """``n``'s recorded layout, now of ``dtype`` (a view moved onto the uncast value)."""
    rec = n.meta.get("tensor_meta_rec")
    if rec is not None:
        n.meta["tensor_meta_rec"] = (rec[0], rec[1], dtype, *rec[3:])
    tm = n.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "_replace"):
        n.meta["tensor_meta"] = tm._replace(dtype=dtype)


def fuse_cross_entropy(gm: GraphModule) -> bool:
    """Route each ``F.cross_entropy`` of 2-d float logits (no weights, no label
    smoothing, ``"mean"`` or ``"sum"``) to :func:`fused_cross_entropy`; where the logits
    are a float32 upcast of 16-bit values (through a view or not) that nothing else reads,
    the upcast goes and the function reads the 16-bit values, as it does for 16-bit logits
    whose loss autocast computed (nanoGPT's: rounded where CUDA's autocast rounds); logits
    that are a padded linear's clone are read in place (``_read_padded_rows``). Returns
    whether ``gm`` changed."""
    graph = gm.graph
    changed = False
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not F.cross_entropy:
            continue
        try:
            bound = _SIGNATURE.bind(*n.args, **n.kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        a = bound.arguments
        x, target = a["input"], a["target"]
        if a["weight"] is not None or a["size_average"] is not None or a["reduce"] is not None \
                or a["label_smoothing"] != 0.0 or a["reduction"] not in ("mean", "sum") \
                or type(a["ignore_index"]) is not int or not isinstance(x, Node) \
                or not isinstance(target, Node):
            continue
        xl, tl_, out = node_layout(x), node_layout(target), node_layout(n)
        if xl is None or tl_ is None or out is None or len(xl[0]) != 2 or xl[1][1] != 1 \
                or len(tl_[0]) != 1 or tl_[2] != torch.int64 or out[2] != torch.float32:
            continue
        # 16-bit logits under autocast, which ran the loss in float32 (its CUDA rounding:
        # fused_cross_entropy's autocast)
        autocast = xl[2] in _HALVES and bool(n.meta.get("autocast"))
        if xl[2] != torch.float32 and not autocast:
            continue
        view = x if x.op == "call_method" and x.target in _VIEWS and x.args else None
        cast = view.args[0] if view is not None else x
        src = _upcast_source(cast) if isinstance(cast, Node) and not autocast else None
        if src is not None and not (_only_user(cast, view or n)
                                    and (view is None or _only_user(view, n))):
            src = None  # the float32 values are read elsewhere too: they stay
        if src is not None:
            if view is not None:
                view.replace_input_with(cast, src)
                _with_dtype(view, node_layout(src)[2])
            else:
                x = src
        n.target = fused_cross_entropy
        n.args = (x, target, a["ignore_index"], a["reduction"], src is not None, autocast)
        n.kwargs = {}
        if src is not None:
            graph.erase_node(cast)  # read by nothing now
        _read_padded_rows(n)
        changed = True
    if changed:
        gm.recompile()
    return changed
