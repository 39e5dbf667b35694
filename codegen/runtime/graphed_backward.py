"""A region whose outputs need autograd after it: its backward is a CUDA graph too.

A compiled module trained by a step the compiler does not see, as inside
``DistributedDataParallel`` or in ``loss = crit(model(x)); loss.backward()`` with only the
model compiled, hands tensors that require grad to code after its forward. A region's
forward graph alone cannot be replayed there: a replay builds no autograd graph. So
``SegmentGraphs`` captures such a region's backward as a second graph, right after its
forward (as ``torch.cuda.make_graphed_callables`` does), and ties the two together with
one autograd node a call::

    region                       captured                      each later call
    conv2d, batch_norm, relu  -> forward graph              -> RegionBackward.forward:
    linear (needs autograd                                      replay, outputs as aliases
            after the region)    backward graph: the
                                 gradients of the region's   -> loss.backward() reaches it:
                                 parameters from gradients      copy the incoming gradients
                                 of its outputs                 in, replay, hand out copies

The parameters' gradients reach ``.grad`` through autograd's own accumulation, so
DistributedDataParallel's hooks see them as in eager and gradients accumulate over
calls. The graphs share one memory pool of their own: the forward's saved tensors must
survive until its backward replays, which a pool shared with other regions (captured in
another order) would not promise.

One forward replay's saved tensors are the only copy, so a replay waits for the last
one's backward: while that call's autograd graph can still run a backward (it has not
run one, or ran one with ``retain_graph=True``), the region runs its nodes instead
(``busy``). A backward reached after a later replay (which cannot happen while ``busy``
holds) raises rather than read another call's tensors.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["GraphedBackward", "NotGraphable"]

_HOOKED = ("BackwardHookFunctionBackward",)  # module backward hooks: Python on every call


class NotGraphable(Exception):
    """Why a region's backward cannot be captured (its segment then runs without graphs)."""


class GraphedBackward:
    """The backward graph of one captured forward region, and the autograd node's state.

    Args:
        outputs: the region's output tensors as the forward capture left them (in the
            graph's memory, their autograd graph built during the capture).
        aliases: ``(view, parameter)`` for each parameter (leaf that requires grad) the
            region read, through a view of it made in the capture; a parameter read
            twice has two views, whose gradients add up.
        pool: the memory pool of the forward graph.
        mode: ``capture_error_mode`` of the capture.

    Example (``SegmentGraphs`` does this)::

        with torch.cuda.graph(fwd, pool=pool):
            v = w.view_as(w)
            y = x @ v                            # y requires grad
        back = GraphedBackward([y], [(v, w)], pool, "thread_local")
        out, = back.apply(fwd.replay)            # an autograd node of its own
        out.sum().backward()                     # replays the backward graph: w.grad
    """

    def __init__(self, outputs: list[torch.Tensor],
                 aliases: list[tuple[torch.Tensor, torch.Tensor]], pool: Any, mode: str) -> None:
        self.leaves = list({id(t): t for _, t in aliases}.values())
        if not self.leaves:
            raise NotGraphable("its outputs need autograd but it reads no parameter")
        for t in self.leaves:
            if t._backward_hooks:
                raise NotGraphable("a parameter has a gradient hook (Python on every backward)")
        self.differentiable = [t.requires_grad for t in outputs]
        roots = [t for t in outputs if t.requires_grad]
        _refuse_hooked_nodes(roots)
        self.outputs = [t.detach() for t in outputs]
        self.grad_outputs = [torch.empty_like(t) for t in roots]
        where = {id(t): k for k, t in enumerate(self.leaves)}
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode=mode):
            grads = torch.autograd.grad(roots, [v for v, _ in aliases], self.grad_outputs,
                                        allow_unused=True)
            summed: list[Any] = [None] * len(self.leaves)
            for (_, leaf), g in zip(aliases, grads):
                k = where[id(leaf)]
                if g is not None:
                    summed[k] = g if summed[k] is None else summed[k] + g
        self.grads = [g.detach() if g is not None else None for g in summed]
        self.token = torch.empty(0)  # saved by each call's node: freed by its backward
        self.generation = 0
        self.last: Any = None  # weak reference to the latest call's autograd node

    def busy(self) -> bool:
        """Whether the latest replay's autograd graph can still run a backward."""
        ctx = self.last() if self.last is not None else None
        if ctx is None:
            return False
        try:
            ctx.saved_tensors  # noqa: B018  (raises once a backward freed them)
        except RuntimeError:
            return False
        return True

    def apply(self, replay: Any) -> tuple[torch.Tensor, ...]:
        """Replay the forward (``replay()``) as one autograd node; its outputs, as aliases."""
        return RegionBackward.apply(self, replay, *self.leaves)


class RegionBackward(torch.autograd.Function):
    """One forward replay as an autograd node; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx: Any, back: GraphedBackward, replay: Any, *leaves: torch.Tensor) -> Any:
        replay()
        back.generation += 1
        ctx.back, ctx.generation = back, back.generation
        ctx.save_for_backward(back.token)
        back.last = weakref.ref(ctx)
        outs = tuple(t.detach() for t in back.outputs)
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, back.differentiable) if not d])
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        back = ctx.back
        ctx.saved_tensors  # noqa: B018  (torch's own error on a second backward)
        if ctx.generation != back.generation:
            raise RuntimeError(
                "fxlite: this backward reads a compiled region's saved tensors that a later "
                "call has overwritten (mode='reduce-overhead'); compile without "
                "mode='reduce-overhead' to keep every call's autograd graph")
        wanted = [g for g, d in zip(grads, back.differentiable) if d]
        for buf, g in zip(back.grad_outputs, wanted):
            buf.copy_(g)
        back.graph.replay()
        # copies: autograd may make a returned tensor a parameter's .grad, which the next
        # replay would overwrite (a kept gradient, or one accumulated over calls)
        return (None, None, *[g.clone() if g is not None else None for g in back.grads])


def _refuse_hooked_nodes(roots: list[torch.Tensor]) -> None:
    """Refuse an autograd graph holding module backward hooks: the capture would run their
    Python once, and replays never."""
    seen: set[int] = set()
    todo = [t.grad_fn for t in roots if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if type(fn).__name__ in _HOOKED:
            raise NotGraphable("a module in it has a backward hook")
        todo.extend(f for f, _ in fn.next_functions if f is not None)
