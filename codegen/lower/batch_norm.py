"""Training-mode BatchNorm as table ops: batch statistics, then the running-stat update.

``batch_norm_train(gm)`` rewrites each training-mode BatchNorm (``nn.BatchNorm1d/2d/3d``
in training mode, or ``F.batch_norm(..., training=True)``) into reductions and pointwise
ops that fuse and differentiate like any others, plus one effect at the end of the graph
that updates the running statistics as eager does::

    before                               after
        y = bn(x)                            n = x.size(0) * x.size(2) * x.size(3)
                                             mean = sum(x, (0, 2, 3), keepdim=True) / n
                                             c = x - mean
                                             d = x - mean.detach()  # c, to autodiff's eyes
                                             var = sum(d * d, (0, 2, 3), keepdim=True) / n
                                             y = c * rsqrt(var + eps) * w[:, None, None] + b[...]
                                             ...
                                             update_running_stats((bn.running_mean, bn.running_var,
                                                 bn.num_batches_tracked, mean, var, n, 0.1), ...)

Halves (fp16, bf16) are cast to fp32 first and ``y`` back at the end, as eager's kernel
computes: the statistics and the normalization are all fp32. Normalization uses the
biased batch variance; the running variance gets the unbiased one
(``var * n / (n - 1)``), ``momentum=None`` is the cumulative average, and the module's
``num_batches_tracked`` is incremented, as ``nn.BatchNorm`` does. The update runs without
grad, so the buffers never join the autograd graph. A node that reads those statistics
later in the graph (an eval-mode BatchNorm after a training one, in one step) gets the
update right before it: at the end, it read the old statistics.

Why ``d``: the variance's gradient through the mean is 0 (the centred values sum to 0),
and left in, it costs the backward a second pass of sums over the batch. autodiff merges
``d`` with ``c`` once the derivative rules have run, so the forward computes one.

Where ``split_sums`` would split those sums (a batch and spatial dims, enough values), the
statistics come instead from each sample's sum and centred sum of squares, one pass over
x (``_sample_statistics``): four kernels in place of five, and one read of x fewer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from fxlite.passes.decompose_rules import per_channel
from fxlite.passes.fuse.split_sums import MIN_NUMEL
from fxlite.passes.normalize import normalize_graph

from fxlite.ops import resolve
from fxlite.proxy import GraphAppendingTracer, Proxy

__all__ = ["batch_norm_train", "per_channel", "update_running_stats"]


def update_running_stats(*stats: tuple) -> None:
    """Update the buffers of every training-mode BatchNorm of a graph, in place.

    Each of ``stats`` is ``(running_mean, running_var, num_batches_tracked, mean, var, n,
    momentum)`` for one BatchNorm: its buffers (any may be None), the batch ``mean`` and
    biased ``var`` and the number ``n`` of values behind them. Eager's formula,
    ``running = momentum * batch + (1 - momentum) * running`` with the unbiased variance
    ``var * n / (n - 1)``, rounded as eager rounds it; ``momentum=None`` is the
    cumulative average (``1 / num_batches_tracked`` after its increment).

    One call for all of them, with torch's multi-tensor (``_foreach``) ops: a handful of
    launches for a network rather than about ten small kernels per BatchNorm (resnet18's
    training step made 200 of them, 0.3 ms of GPU time on an H200).

    As in eager, the running buffers' version counters stay as they were: eager's
    batch_norm writes them inside its kernel, unseen by autograd, which saves them for
    its backward. So a second forward before the first's backward (two inputs through
    one network, then one loss) must not make that backward fail its version check.
    (``num_batches_tracked`` is counted up, as eager's ``add_(1)`` does.)
    """
    buffers = [id(b) for s in stats for b in s[:3] if b is not None]
    if len(set(buffers)) < len(buffers) and len(stats) > 1:
        # a BatchNorm called twice: its updates apply in order (one multi-tensor launch
        # would write the buffer from two places at once)
        for entry in stats:
            update_running_stats(entry)
        return
    running = tuple(b for s in stats for b in s[:2] if b is not None)
    versions = tuple(b._version for b in running)
    with torch.no_grad():
        counters = [s[2] for s in stats if s[2] is not None]
        if counters:
            torch._foreach_add_(counters, 1)
        runs: tuple[list[Any], list[Any]] = ([], [])  # running_mean / running_var buffers
        batch: tuple[list[Any], list[Any]] = ([], [])  # their batch values
        factors: tuple[list[float], list[float]] = ([], [])
        unbias: list[float] = []
        for running_mean, running_var, tracked, mean, var, n, momentum in stats:
            if (running_mean is None and running_var is None) or mean.numel() == 0 or n == 0:
                continue  # no statistics, or no channels or no values in them (eager
                # leaves the buffers as they are)
            if momentum is None:  # a 0-d tensor factor (no host sync on a GPU): one by one
                _cumulative(running_mean, running_var, tracked, mean, var, n)
                continue
            for k, run, value in ((0, running_mean, mean), (1, running_var, var)):
                if run is not None:
                    runs[k].append(run)
                    batch[k].append(value.reshape(run.shape).to(run.dtype))
                    factors[k].append(momentum)
            if running_var is not None:
                unbias.append(n / max(n - 1, 1))
        if batch[1]:
            batch = (batch[0], torch._foreach_mul(batch[1], unbias))
        for k in (0, 1):
            if runs[k]:
                scaled = torch._foreach_mul(batch[k], factors[k])
                torch._foreach_mul_(runs[k], [1 - f for f in factors[k]])
                torch._foreach_add_(runs[k], scaled)
    _set_versions(running, versions)


def _set_versions(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    """Put back the version counters of ``tensors`` (what torch's
    ``torch.autograd.grad_mode._unsafe_preserve_version_counter`` does)."""
    if not tensors:
        return
    try:
        torch._C._autograd._unsafe_set_version_counter(tensors, versions)
    except TypeError:  # a torch whose setter takes one tensor at a time
        for t, v in zip(tensors, versions):
            torch._C._autograd._unsafe_set_version_counter(t, v)


def _cumulative(running_mean: Any, running_var: Any, tracked: Any, mean: torch.Tensor,
                var: torch.Tensor, n: int) -> None:
    factor: Any = 1.0 / tracked.double() if tracked is not None else 0.0
    if running_mean is not None:
        value = mean.reshape(running_mean.shape).to(running_mean.dtype)
        running_mean.copy_(value * factor + running_mean * (1 - factor))
    if running_var is not None:
        unbiased = var.reshape(running_var.shape).to(running_var.dtype) * (n / max(n - 1, 1))
        running_var.copy_(unbiased * factor + running_var * (1 - factor))


update_running_stats._is_impure = True  # type: ignore[attr-defined]  # DCE keeps it


def _module_args(gm: Any, node: Any) -> dict[str, Any] | None:
    """The batch_norm arguments of a training-mode BatchNorm module call, as get_attrs."""
    mod = gm.get_submodule(node.target)
    if not isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) or not mod.training or len(
            node.args) != 1 or node.kwargs:
        return None
    graph = gm.graph

    def attr(name: str) -> Any:
        if getattr(mod, name, None) is None:
            return None
        with graph.inserting_before(node):
            return graph.get_attr(f"{node.target}.{name}")

    track = mod.track_running_stats
    return {"input": node.args[0], "weight": attr("weight"), "bias": attr("bias"),
            "running_mean": attr("running_mean") if track else None,
            "running_var": attr("running_var") if track else None,
            "num_batches_tracked": attr("num_batches_tracked") if track else None,
            "momentum": mod.momentum, "eps": mod.eps}


def _function_args(node: Any) -> dict[str, Any] | None:
    found = resolve(node)
    if found is None or found[0].name != "batch_norm":
        return None
    args = found[1]
    if args.get("training") is not True or set(args) - {
            "input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
            "eps"}:
        return None
    momentum = args.get("momentum", 0.1)
    if momentum is not None and type(momentum) not in (int, float):
        return None
    return {"input": args["input"], "weight": args.get("weight"), "bias": args.get("bias"),
            "running_mean": args.get("running_mean"), "running_var": args.get("running_var"),
            "num_batches_tracked": None, "momentum": momentum, "eps": args.get("eps", 1e-5)}


def batch_norm_train(gm: Any) -> Any:
    """Rewrite every training-mode BatchNorm of ``gm`` (see the module docstring).

    Args:
        gm: a GraphModule with ShapeProp meta on the BatchNorm inputs (their rank decides
            the reduced dims); ``normalize`` before or after, as you like.

    Returns:
        ``gm``, recompiled. BatchNorms whose input rank is unknown, or with arguments
        that are not plain values, are left as they are.
    """
    graph = gm.graph
    tracer = GraphAppendingTracer(graph)
    output = graph.output_node()
    created: list[Any] = []
    updates: list[tuple] = []
    for node in list(graph.nodes):
        if node.op == "call_module":
            args = _module_args(gm, node)
        elif node.op in ("call_function", "call_method"):
            args = _function_args(node)
        else:
            continue
        tm = node.meta.get("tensor_meta")
        if args is None or not hasattr(tm, "shape") or len(tm.shape) < 2:
            if updates and _reads_stats(node, updates):  # an eval-mode BatchNorm, say: it
                with graph.inserting_before(node):  # reads what the updates write
                    graph.call_function(update_running_stats, tuple(updates))
                updates = []
            continue
        before = node.prev
        with graph.inserting_before(node):
            y, mean, var, n = _normalize(Proxy(args["input"], tracer), tm.dtype, len(tm.shape),
                                         *(Proxy(args[k], tracer) if args[k] is not None else None
                                           for k in ("weight", "bias")), args["eps"],
                                         _static_shape(tm))
        created += _between(before, node)
        # the write of the running statistics moved to update_running_stats: y is pure
        # (kept "impure", it would be a fusion barrier between the math and a ReLU)
        y.node.meta.update({k: v for k, v in node.meta.items() if k != "impure"})
        node.replace_all_uses_with(y.node)
        graph.erase_node(node)
        if any(args[k] is not None for k in ("running_mean", "running_var", "num_batches_tracked")):
            updates.append((args["running_mean"], args["running_var"], args["num_batches_tracked"],
                            mean.node, var.node, n.node if isinstance(n, Proxy) else n,
                            args["momentum"]))
    if updates:  # one call at the end for all of them (but those read before, above)
        with graph.inserting_before(output):
            graph.call_function(update_running_stats, tuple(updates))
    normalize_graph(graph, gm, [n for n in created if not n._erased])
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm


def _static_shape(tm: Any) -> tuple[int, ...] | None:
    """``tm``'s shape as ints, or None where a size is symbolic."""
    shape = tuple(tm.shape)
    return shape if all(type(s) is int for s in shape) else None


def _reads_stats(node: Any, updates: list[tuple]) -> bool:
    """Whether ``node`` reads a running statistic (or batch count) that ``updates`` write."""
    written = {id(t) for entry in updates for t in entry[:3] if t is not None}
    return any(id(i) in written for i in node.all_input_nodes)


def _between(before: Any, node: Any) -> list[Any]:
    out = []
    cur = before.next
    while cur is not node:
        out.append(cur)
        cur = cur.next
    return out


def _normalize(x: Any, dtype: Any, rank: int, weight: Any, bias: Any, eps: float,
               shape: tuple[int, ...] | None) -> tuple[Any, Any, Any, Any]:
    # statistics over every dim but the channels (dim 1), kept as (1, C, 1, ...)
    dims = (0, *range(2, rank))
    channels = x.size(1)
    n = x.size(0)  # sizes from x itself, not from its fp32 copy
    for d in range(2, rank):
        n = n * x.size(d)
    # Halves: eager computes in fp32 and rounds y once (a mean rounded to fp16 leaves
    # x - mean != 0 for a batch whose rows are all equal). The sums read x itself, so no
    # fp32 copy of x is written for them.
    half = dtype in (torch.float16, torch.bfloat16)
    acc = {"dtype": torch.float32} if half else {}
    wide = x.to(torch.float32) if half else x
    if _one_pass(shape):
        mean, var = _sample_statistics(x, wide, rank, n, acc)
    else:
        mean = torch.sum(x, dims, keepdim=True, **acc) / n
        # The variance's path to the mean is cut from autograd: its gradient there is 0
        # (the centred values sum to 0), and differentiated it is a second pass over the
        # batch (sum of the centred gradient) that the backward kernels would have to make.
        apart = wide - mean.detach()
        var = torch.sum(apart * apart, dims, keepdim=True) / n
    centered = wide - mean
    y = centered * torch.rsqrt(var + eps)
    for p, what, combine in ((weight, "weight", torch.mul), (bias, "bias", torch.add)):
        if p is not None:  # (C,) -> (C, 1, ...), checked against x's channels
            p = p.tracer.create_proxy("call_function", per_channel,
                                      (p, channels, rank, what), {})
            y = combine(y, p)
    return (y.to(dtype) if half else y), mean, var, n


def _one_pass(shape: tuple[int, ...] | None) -> bool:
    """Whether the statistics of a BatchNorm input of ``shape`` are taken per sample first
    (``_sample_statistics``): with a batch and spatial dims of 2 or more and
    ``split_sums.MIN_NUMEL`` values, where ``split_sums`` would split the two-pass sums
    anyway (a single channel too, which it would not), so that the two sums of a sample
    share one pass over x."""
    return shape is not None and len(shape) >= 3 and shape[0] >= 2 and \
        math.prod(shape[2:]) >= 2 and math.prod(shape) >= MIN_NUMEL


def _sample_statistics(x: Any, wide: Any, rank: int, n: Any, acc: dict[str, Any]
                       ) -> tuple[Any, Any]:
    """The batch ``mean`` and biased ``var`` of ``x`` (N, C, spatial...; ``wide``: ``x`` in
    float32 where it is a half, with ``acc`` the sums' float32 dtype) over every dim but
    the channels, from each sample's sum and centred sum of squares (the pairwise
    combination of Chan et al., as cuDNN's Welford kernels combine their parts): both
    come from one pass over x, where the mean and then the variance about it take two::

        t = sum(x, spatial)                     # (N, C, 1, 1): one row kernel over each
        q = sum((x - t / m) ** 2, spatial)      #   sample's channel gives t, q and t / n
        mean = sum(t / n, 0)
        var = sum(q + m * (t / m - mean) ** 2, 0) / n

    Four kernels with the normalization (the two small sums over N, each its own launch),
    where summing x, then the squares about the mean, takes five and one more pass over
    x. Each sum of squares is about its own mean, as stable as the two passes.

    To autograd, ``var``'s gradient is eager's ``2 (x - mean) / n``: each sample's mean is
    cut (its path adds 0, and would cost the backward a pass over the batch) and the
    missing ``2 (t / m - mean) / n`` comes in through ``t``, by a term of value 0.
    """
    spatial = tuple(range(2, rank))
    m = x.size(2)
    for d in range(3, rank):
        m = m * x.size(d)
    t = torch.sum(x, spatial, keepdim=True, **acc)
    own = (t / m).detach()  # each sample's mean
    apart = wide - own
    q = torch.sum(apart * apart, spatial, keepdim=True)
    # the shares summed, not the sum divided: then no op after the sum reads the mean
    # with the spread below, and x - mean is not pulled into the spread's kernel
    mean = torch.sum(t / n, (0,), keepdim=True)
    spread = (own - mean).detach()
    slope = spread * t
    parts = q + spread * spread * m + (slope - slope.detach()) * 2.0
    return mean, torch.sum(parts, (0,), keepdim=True) / n
