"""batched_casts: the casts of a segment's inputs, one call for all of them.

Under autocast each linear layer casts its float32 weight and bias to the 16-bit dtype,
on every call; ``explicit_autocast`` spells those casts out as graph ops. A cast of a
segment's input (a parameter) joins no fused group, so each ran as its own ``to``: a
kernel in the forward, and an autograd node (``ToCopyBackward0``) whose backward casts the
gradient back, in the backward. nanoGPT's step at GPT-2 124M's size made about 120 of
each; on an H200 the GPU sat idle for them, waiting on the host. :func:`batch_casts`
makes the casts of a stretch of the graph that only extern ops read (a fused group casts
as it reads) one call of :func:`cast_all`, which copies every tensor in one
``torch._foreach_copy_`` and is one autograd node whose backward casts every gradient
back in one more::

    before                                      after
        to = w0.to(torch.bfloat16)                  casts = cast_all(torch.bfloat16, w0, b0, w1)
        linear = linear(x, to, to_1)                to, to_1, to_2 = casts[0], casts[1], casts[2]
        ...                                         linear = linear(x, to, to_1)
        to_2 = w1.to(torch.bfloat16)                ...
        linear_1 = linear(y, to_2)                  linear_1 = linear(y, to_2)

The call takes the place of the first cast: the later casts move up to it, never past a
node that may write a tensor (an optimizer step writes the parameters a second forward
casts again), so each reads the value its cast read; random draws (dropout) do not stop
them. The 16-bit copies then all exist from the
first cast on; eager's autocast keeps them as long (it caches a parameter's cast until
the autocast block ends). The gradients come back together, once the backward has made
all of them: their values are eager's (a cast back is exact).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import is_impure, resolve

__all__ = ["batch_casts", "cast_all"]


class _CastAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dtype: torch.dtype, *tensors: torch.Tensor) -> tuple:
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.set_materialize_grads(False)
        return _copies(dtype, tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        given = [(i, g) for i, g in enumerate(grads)
                 if g is not None and ctx.needs_input_grad[i + 1]]
        out: list[Any] = [None] * (len(grads) + 1)
        if torch.is_grad_enabled():  # create_graph=True: differentiable casts
            for i, g in given:
                out[i + 1] = g.to(ctx.dtypes[i])
            return tuple(out)
        for dtype in {ctx.dtypes[i] for i, _ in given}:
            these = [(i, g) for i, g in given if ctx.dtypes[i] == dtype]
            for (i, _), c in zip(these, _copies(dtype, [g for _, g in these])):
                out[i + 1] = c
        return tuple(out)


def _copies(dtype: torch.dtype, tensors: Any) -> tuple:
    """``tuple(t.to(dtype) for t in tensors)``, as one foreach copy (strides as ``to``
    gives them: ``empty_like`` keeps a dense tensor's, lays out others row-major)."""
    outs = [torch.empty_like(t, dtype=dtype) for t in tensors]
    torch._foreach_copy_(outs, list(tensors))
    return tuple(outs)


def cast_all(dtype: torch.dtype, *tensors: torch.Tensor) -> tuple:
    """``tuple(t.to(dtype) for t in tensors)`` in one copy, and under autograd one node,
    whose backward casts each gradient back to its tensor's dtype (see the module
    docstring). Every tensor must have another dtype than ``dtype``."""
    return _CastAll.apply(dtype, *tensors)


def _cast(n: Node, gm: GraphModule) -> tuple[Node, torch.dtype] | None:
    """(the placeholder, the dtype) of a plain dtype cast ``n`` of a placeholder that no
    op reads that a fused group could take it into (there the group casts as it reads)."""
    if n.op not in ("call_function", "call_method"):
        return None
    found = resolve(n, gm)
    if found is None or found[0].name != "to":  # (only a dtype: "to_other" otherwise)
        return None
    x, dtype = found[1]["input"], found[1]["dtype"]
    was = getattr(x.meta.get("tensor_meta"), "dtype", None) if isinstance(x, Node) else None
    if was is None or x.op != "placeholder" or was == dtype or not was.is_floating_point:
        return None
    for user in n.users:
        read = resolve(user, gm) if user.op in ("call_function", "call_method",
                                                "call_module") else None
        if read is not None and read[0].kind != "extern":  # (not a table op: extern too)
            return None
    return x, dtype


def _may_write(n: Node, gm: GraphModule) -> bool:
    """Whether ``n`` may write a tensor a later cast reads: a write or an external call the
    capture saw, or, in a graph it did not record, an op with effects other than drawing
    random numbers (a dropout between two layers draws; it writes no parameter)."""
    if n.meta.get("mutated") or n.meta.get("external"):
        return True
    if "impure" in n.meta or not is_impure(n, gm, impure_random=False):
        return False
    found = resolve(n, gm)  # F.dropout and nn.Dropout: effects in the table, writes in place
    return found is None or "dropout" not in found[0].name or found[1].get("inplace") is True


def batch_casts(gm: GraphModule) -> bool:
    """Make the dtype casts of ``gm``'s placeholders that only extern ops read (before
    ``fuse``) one :func:`cast_all` call per dtype and stretch between nodes that may
    write (a lone one too: fused, it would be a group of one under autograd, its host
    cost a Python node's). Returns whether ``gm`` changed."""
    graph = gm.graph
    batches: dict[tuple[int, torch.dtype], list[Node]] = {}
    window = 0
    for n in graph.nodes:
        if n.op in ("call_function", "call_method", "call_module") and _may_write(n, gm):
            window += 1
            continue
        found = _cast(n, gm)
        if found is not None:
            batches.setdefault((window, found[1]), []).append(n)
    changed = False
    for (_, dtype), casts in batches.items():
        sources: dict[Node, Node] = {}  # placeholder -> the cast kept for it
        for c in casts:
            kept = sources.setdefault(c.args[0], c)
            if kept is not c:
                c.replace_all_uses_with(kept)
                graph.erase_node(c)
        kept = list(sources.values())
        with graph.inserting_before(kept[0]):
            call = graph.call_function(cast_all, (dtype, *sources))
            call.meta.update(type=tuple, tensor_meta=tuple(c.meta["tensor_meta"] for c in kept))
            items = [graph.call_function(operator.getitem, (call, i)) for i in range(len(kept))]
        for c, item in zip(kept, items):  # (erased after: the inserts go before kept[0])
            item.meta.update(c.meta)
            c.replace_all_uses_with(item)
            graph.erase_node(c)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return changed
