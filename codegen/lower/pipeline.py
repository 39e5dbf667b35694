"""The lowering pipeline: the passes a graph goes through before its kernels, on one page.

Two lists, run in order by :func:`run_passes`. A recorded segment
(``codegen/lower/segment.py``) takes :data:`FORWARD_PASSES`; a graph autodiff made for a
fused group, its forward or its backward (``codegen/lower/autograd_pipeline.py``), takes
:data:`BACKWARD_PASSES`::

    FORWARD_PASSES (a recorded segment)           BACKWARD_PASSES (autodiff's graphs)
    fill_meta          metadata of the recording
    explicit_autocast  autocast's casts as ops
    functionalize      writes as new values
    batch_norm_train   batch statistics as ops
    seed_dropouts      training: seeded masks
    fold_sizes         masks made from sizes
    normalize
    window_views       inference: a norm before
                       its windows' views
    row_views          softmax or norm before
                       a view
    empty_cats         a key cache's cat of an
                       empty start: its keys
    decompose                                     decompose
    dead_code                                     dead_code
    row_gathers        inference: a roll and its
                       windows as one gather
    matmul_copies      inference: operand copies
                       of matmul, einsum as ops
    propagate_meta     new nodes' metadata        propagate    all metadata, on meta tensors
    pool_kernels       CUDA: max-pools' kernels
    pack_weights       inference: weight copies
                       to channels-last as one
    batched_casts      inputs' casts as one call
    fuse                                          fuse
    empty_ok_max       softmax of empty dims      lone_groups  lone ops as groups too
    cat_groups         inference: a cat and the
                       groups only it reads as one
    autograd_regions   training: one autograd
                       node per region of groups
    written_inputs     training: inputs written
                       later are not saved
    precompile         CUDA: kernels in parallel
    autocast_off       groups without autocast

Both then hand the fused graph to the one kernel check (``codegen/lower/accuracy.py``).

Each pass takes the graph and the :class:`Lowering` (the sample's device, what earlier
passes found) and returns the new graph module, or changes the one it was given.
The pipeline works on a copy of the segment's graph, so a pass that fails leaves the
segment's graph as it was (and the segment runs its recorded ops). Under
``FXLITE_LINT=1``, and in tests, every pass's result is linted (``Graph.lint``, its groups'
graphs too), and a pass that leaves a broken graph raises a
:class:`~fxlite.passes.PassError` naming it, which ``compile_segment`` lets through
(:func:`lint_failure`) where any other failure makes the segment run its recorded ops.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from fxlite.codegen.capture.kinds import autocast_state, set_autocast
from fxlite.codegen.kernels.cat import cat_groups
from fxlite.codegen.kernels.generate import interpreting
from fxlite.codegen.kernels.pool import use_pool_kernels
from fxlite.codegen.kernels.weights import pack_weight_copies
from fxlite.codegen.lower.autocast import explicit_autocast
from fxlite.codegen.lower.autograd_regions import autograd_regions
from fxlite.codegen.lower.batch_norm import batch_norm_train
from fxlite.codegen.lower.batched_casts import batch_casts
from fxlite.codegen.lower.empty_cats import cats_without_empties
from fxlite.codegen.lower.matmul_copies import explicit_matmul_copies
from fxlite.codegen.lower.row_gathers import gather_rolled_rows
from fxlite.codegen.lower.row_views import softmax_before_views
from fxlite.codegen.lower.window_views import rows_through_windows
from fxlite.codegen.lower.written_inputs import mark_written_inputs
from fxlite.codegen.runtime.precompile import precompile
from fxlite.passes.decompose import decompose
from fxlite.passes.fold_constants import fold_constants
from fxlite.passes.functionalize import functionalize
from fxlite.passes.fuse import fuse
from fxlite.passes.fuse.lone_groups import lone_groups
from fxlite.passes.normalize import normalize
from fxlite.passes.pass_manager import PassError
from fxlite.passes.shape_prop import fill_missing_meta, recorded_metadata

from fxlite import config
from fxlite.graph_module import GraphModule
from fxlite.ops.dropout import seed_dropouts
from fxlite.ops.records import amax_or_empty
from fxlite.ops.shapes import propagate

__all__ = ["BACKWARD_PASSES", "FORWARD_PASSES", "AutocastOff", "Lowering", "Pass", "ambient",
           "ambient_restored", "fill_meta", "fold_sizes", "lint_failure", "linting", "propagate_meta",
           "run_passes", "set_ambient"]


PRECOMPILE = True  # compile a segment's kernels on a thread pool before its check run
# training segments: fused groups joined by table ops differentiate as one region
# (codegen/lower/autograd_regions.py); FXLITE_REGIONS=0 keeps one autograd node per group
REGIONS = config.regions()


@dataclass
class Lowering:
    """What the passes of one run read besides the graph, and what they found."""

    sample: Sequence[Any]  # one value per placeholder (backward: meta tensors)
    cuda: torch.device | None = None  # the first CUDA device among the sample's tensors
    training: bool = False  # some node needs gradients (asked by fuse, of the unfused graph)
    autocast: bool = False  # some node ran under autocast (likewise)
    seeded: bool = False  # dropout draws its masks in kernels (not comparable with eager)


class Pass(NamedTuple):
    """One step of a pipeline: ``run(gm, lowering)`` returns the new graph module (anything
    else: it changed ``gm`` in place); it runs only where ``when(gm, lowering)``."""

    name: str
    run: Callable[[GraphModule, Lowering], Any]
    when: Callable[[GraphModule, Lowering], bool] = lambda gm, low: True


def _on(f: Callable[[GraphModule], Any]) -> Callable[[GraphModule, Lowering], Any]:
    """A pass of the graph alone."""
    return lambda gm, low: f(gm)


def _on_cuda(gm: GraphModule, low: Lowering) -> bool:
    return low.cuda is not None and not interpreting()


def linting() -> bool:
    """Whether :func:`run_passes` lints each pass's result: ``FXLITE_LINT=1``, or in tests."""
    return config.lint() or "PYTEST_CURRENT_TEST" in os.environ


def lint_failure(e: BaseException) -> bool:
    """Whether ``e`` is a pass's broken graph that :func:`linting` caught: a caller that
    runs the recorded ops when the pipeline fails re-raises it instead, so that a test
    fails at the pass rather than passing on the fallback."""
    return isinstance(e, PassError) and linting()


def run_passes(passes: Sequence[Pass], gm: GraphModule, lowering: Lowering) -> GraphModule:
    """Run ``passes`` in order on ``gm``; returns the last pass's graph module.

    Args:
        passes: :data:`FORWARD_PASSES` or :data:`BACKWARD_PASSES`.
        gm: the graph to lower (passes may change it in place: give a copy).
        lowering: what the passes read, and write what they find.

    Raises:
        PassError: under :func:`linting`, naming the pass whose result fails ``lint``.
    """
    lint = linting()
    for p in passes:
        if not p.when(gm, lowering):
            continue
        out = p.run(gm, lowering)
        gm = out if isinstance(out, GraphModule) else gm
        if lint:
            try:
                for g in gm.modules():  # gm first, then its groups
                    if isinstance(g, GraphModule):
                        g.graph.lint()
            except Exception as e:
                raise PassError(p.name, f"pass {p.name!r} left a graph that fails lint: {e}") from e
    return gm


# ---------------------------------------------------------------------- the passes
def fill_meta(gm: GraphModule) -> None:
    """ShapeProp's ``tensor_meta`` and ``type`` for every node, from the recording."""
    for node in gm.graph.nodes:
        rec = node.meta.get("tensor_meta_rec")
        if rec is None:
            continue
        node.meta["tensor_meta"] = recorded_metadata(rec)
        node.meta["type"] = torch.Tensor
        node.meta["device"] = rec[3]


def _seed_dropouts(gm: GraphModule, low: Lowering) -> GraphModule:
    before = len(gm.graph.nodes)
    gm = seed_dropouts(gm)
    low.seeded = len(gm.graph.nodes) != before
    return gm


FOLD_BYTES = 16 << 20  # the largest value fold_sizes keeps (a mask, position indices)


def fold_sizes(gm: GraphModule) -> None:
    """Compute once what the graph builds from literals and sizes alone, each call in
    eager (Swin's window masks, T5's position buckets): ``fold_constants`` without the
    weights, which may change between calls. If evaluating it fails, the graph is left as
    it was, and the failure happens where it did, when the graph runs."""
    try:
        fold_constants(gm, attributes=False, max_bytes=FOLD_BYTES)
    except Exception:
        pass


def _dead_code(gm: GraphModule) -> None:
    gm.graph.eliminate_dead_code()
    gm.recompile()


def propagate_meta(gm: GraphModule) -> None:
    """Metadata for nodes without any (those passes created), computed on meta tensors
    by the one evaluator, :func:`~fxlite.passes.shape_prop.fill_missing_meta`, strictly:
    a node it cannot describe fails the pass, and the segment runs its recorded ops.

    Nodes with metadata are not run; their values are meta tensors of their layout. A
    recorded ``torch.no_grad()`` (``_set_grad_enabled``) among those run changes grad mode
    here as it did in the program, and no further: the check run after this starts in the
    mode the segment began in (the clipping of ``clip_grad_norm_(error_if_nonfinite=True)``
    left it off, and the check's ``backward()`` then found no graph). Autocast is restored
    too."""
    with ambient_restored():
        fill_missing_meta(gm, strict=True)


def _needs_autograd(gm: GraphModule) -> bool:
    return any(n.meta.get("requires_grad") and n.meta.get("grad_enabled") for n in gm.graph.nodes)


def _fuse(gm: GraphModule, low: Lowering) -> GraphModule:
    # what later passes ask of the nodes, which fuse moves into groups
    low.training = _needs_autograd(gm)
    low.autocast = any(n.meta.get("autocast") for n in gm.graph.nodes)
    return fuse(gm)


def _empty_ok_max(fused: GraphModule) -> None:
    """Softmax's row max (``amax`` marked ``empty_ok`` by decompose) runs as
    ``amax_or_empty`` wherever it runs eagerly, at the top level or in a group's eager
    ops: softmax over an empty dim is empty, where ``torch.amax`` raises."""
    for gm in (fused, *(m for m in fused.children() if isinstance(m, GraphModule))):
        marked = [n for n in gm.graph.nodes if n.meta.get("empty_ok") and n.target is torch.amax]
        for n in marked:
            n.target = amax_or_empty
        if marked:
            gm.recompile()


class AutocastOff(torch.nn.Module):
    """A fused group that runs without autocast: ``explicit_autocast`` already spelled out
    the casts autocast made, and the kernel (which autocast never sees) computes as
    written; the group's eager ops must too, or they would be cast a second time."""

    def __init__(self, inner: GraphModule) -> None:
        super().__init__()
        self.inner = inner
        self.meta = inner.meta

    def forward(self, *args: Any) -> Any:
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return self.inner(*args)


def _groups_without_autocast(fused: GraphModule) -> None:
    for name, sub in list(fused.named_children()):
        if getattr(sub, "meta", {}).get("fused_kind"):
            setattr(fused, name, AutocastOff(sub))


# ---------------------------------------------------------------------- the two lists
FORWARD_PASSES: tuple[Pass, ...] = (
    Pass("fill_meta", _on(fill_meta)),
    Pass("explicit_autocast", _on(explicit_autocast)),
    Pass("functionalize", _on(functionalize)),
    Pass("batch_norm_train", _on(batch_norm_train)),  # batch statistics as table ops: they fuse
    Pass("seed_dropouts", _seed_dropouts,
         when=lambda gm, low: _needs_autograd(gm)),  # training: dropout masks drawn in kernels
    Pass("fold_sizes", _on(fold_sizes)),
    Pass("normalize", _on(normalize)),
    Pass("window_views", _on(rows_through_windows),  # Swin's windows: no copies around them
         when=lambda gm, low: not _needs_autograd(gm)),
    Pass("row_views", _on(softmax_before_views)),  # a masked add and its softmax: one kernel
    Pass("empty_cats", _on(cats_without_empties)),  # a key cache's cat([empty, k]): k
    Pass("decompose", _on(decompose)),
    Pass("dead_code", _on(_dead_code)),
    Pass("row_gathers", _on(gather_rolled_rows),
         when=lambda gm, low: not _needs_autograd(gm)),  # Swin's rolled windows: one gather
    Pass("matmul_copies", _on(explicit_matmul_copies),  # a matmul's operand copies fuse
         when=lambda gm, low: not _needs_autograd(gm)),
    Pass("propagate_meta", _on(propagate_meta)),
    Pass("pool_kernels", _on(use_pool_kernels), when=_on_cuda),  # max-pools without indices; avg-pools
    Pass("pack_weights", _on(pack_weight_copies),  # channels-last weight copies: one kernel
         when=lambda gm, low: not _needs_autograd(gm)),
    Pass("batched_casts", _on(batch_casts)),  # autocast's parameter casts: one copy, one node
    Pass("fuse", _fuse),
    Pass("empty_ok_max", _on(_empty_ok_max)),
    Pass("cat_groups", _on(cat_groups),  # a cat and the groups only it reads: one kernel
         when=lambda gm, low: not low.training and (low.cuda is not None or interpreting())),
    Pass("autograd_regions", _on(autograd_regions),  # groups joined by table ops: one autograd node
         when=lambda gm, low: low.training and REGIONS),
    Pass("written_inputs", _on(mark_written_inputs),  # inputs written later: not saved
         when=lambda gm, low: low.training),
    Pass("precompile", lambda gm, low: precompile(gm, low.cuda),  # every distinct kernel at once
         when=lambda gm, low: PRECOMPILE and _on_cuda(gm, low)),
    Pass("autocast_off", _on(_groups_without_autocast), when=lambda gm, low: low.autocast),
)

BACKWARD_PASSES: tuple[Pass, ...] = (
    Pass("decompose", _on(decompose)),
    Pass("dead_code", _on(_dead_code)),
    Pass("propagate", lambda gm, low: propagate(gm, low.sample)),  # ShapeProp's meta, no ops run
    Pass("fuse", _on(fuse)),
    Pass("lone_groups", _on(lone_groups)),  # a bias gradient's sum over the batch: a kernel too
)


# ---------------------------------------------------------------------- grad mode and autocast
@contextlib.contextmanager
def ambient_restored() -> Iterator[None]:
    """Grad mode and autocast as they were, whatever recorded state changes ran.

    Segments pass these on to each other (a read may happen inside ``torch.no_grad()``),
    so a whole path's check runs go inside one block, not one per segment."""
    grad, state = ambient()
    try:
        yield
    finally:
        set_ambient((grad, state))


def ambient() -> tuple:
    """Grad mode and autocast state now (restore them with :func:`set_ambient`)."""
    return torch.is_grad_enabled(), autocast_state()


def set_ambient(state: tuple) -> None:
    """Set grad mode and autocast state to ``state``, a value of :func:`ambient`."""
    torch._C._set_grad_enabled(state[0])
    set_autocast(state[1])
