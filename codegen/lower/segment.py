"""One recorded segment compiled: its passes, Triton kernels, and the checks around them.

    recorded segment ─► rewrites that need no kernels (fused optimizer steps,
        attention's fast path, padded linears, channels-last convolutions)
        ─► FORWARD_PASSES (``codegen/lower/pipeline.py``: metadata from the recording,
           functionalize, normalize, decompose, fuse...)
        ─► one Triton kernel per fused group, each checked against eager on the
           recording's own inputs ─► a Python forward that calls the kernels
        ─► the whole segment's results checked against what eager PyTorch returned

Nothing runs twice on the user's data: the metadata comes from the recording, the checks
run on private copies of what the recording wrote, with the random generators set to
where the recording started them, and effects on state outside the graph (``backward``,
``p.grad = None``) are skipped in the check run. Anything that fails, or any result that
disagrees with eager PyTorch, makes the segment run its recorded ops in Python instead,
with the reason in ``fallbacks`` (but in tests and under ``FXLITE_LINT=1``, a pass that
leaves a broken graph raises its ``PassError``: ``pipeline.lint_failure``).
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fxlite.codegen.capture.cond import CondOp
from fxlite.codegen.kernels.generate import interpreting
from fxlite.codegen.lower.accuracy import (
    HALF,
    TF32,
    assert_as_accurate,
    assert_same,
    attributes,
    check_group,
    reference_problem,
    tf32_allowed,
    versions,
)
from fxlite.codegen.lower.autograd import make_autograd_group
from fxlite.codegen.lower.cross_entropy import fuse_cross_entropy
from fxlite.codegen.lower.optimizer_steps import fused_optimizer_steps
from fxlite.codegen.lower.pad_matmul import pad_linears
from fxlite.codegen.lower.pipeline import (
    FORWARD_PASSES,
    Lowering,
    ambient,
    lint_failure,
    run_passes,
    set_ambient,
)
from fxlite.codegen.report import KernelRecord
from fxlite.codegen.runtime.straight_line import StraightRunner
from fxlite.passes.attention import unpack_attention
from fxlite.passes.channels_last import CONVS, channels_last_convs
from fxlite.passes.shape_prop import node_layout

from fxlite import config
from fxlite.graph_module import GraphModule
from fxlite.interpreter import Interpreter
from fxlite.logs import log_kernel
from fxlite.node import Node, Opcode

__all__ = ["CHANNELS_LAST", "CompiledSegment", "channels_last_wanted", "compile_segment", "direct_forward",
           "expand_kernels", "kernel_prefix"]


# Conv inputs in channels-last on CUDA (passes/channels_last.py); FXLITE_CHANNELS_LAST=0
# turns it off. On an H200 it cut resnet50's bf16 forward at batch 32 from 3.7 to 1.85 ms
# of GPU time, and resnet18's training step from 2.43 to 2.04.
CHANNELS_LAST = True


@dataclass
class CompiledSegment:
    """What the pipeline made of one segment."""

    run: Callable[..., Any]
    gm: GraphModule  # the graph that runs (kernels swapped in), or the recorded one
    kernels: list[Any] = field(default_factory=list)
    records: list[KernelRecord] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    outputs: Any = None  # results of the check run: inputs for checking the next segment
    seeded: bool = False  # dropout draws its masks in kernels (not comparable with eager)
    # the recorded ops with the rewrites that need no kernels (fused optimizer steps,
    # channels-last convolutions): what runs where the kernels lose their trial
    recorded: GraphModule | None = None
    # ``recorded`` without its channels-last convolutions, where it has them: what runs
    # where the recorded ops win and then lose a second trial to it (runtime/trial.py)
    plain: GraphModule | None = None
    # whether its kernels include autograd groups (a training forward): a whole call's
    # CUDA graph would hand back its capture's autograd graph on every replay (None: not
    # asked yet; compile._trains)
    trains: bool | None = None


def direct_forward(gm: GraphModule) -> Callable[..., Any]:
    """``gm.forward`` without ``nn.Module.__call__`` (no hook checks: host time)."""
    return functools.partial(type(gm).forward, gm)


def compile_segment(gm: GraphModule, sample: list[Any], *, backend: Any = "triton",
                    mode: str | None = None, expected: list[Any] | None = None,
                    warn: Callable[[str], None] = lambda m: None) -> CompiledSegment:
    """Compile a recorded segment, checking it on ``sample`` (its inputs at record time).

    Args:
        gm: the recorded segment (left unchanged).
        sample: values for its placeholders; ones the segment writes must be private copies.
        backend: ``"triton"``, ``"python"`` or a callable ``backend(gm, example_inputs)``.
        mode: the compile mode (``"max-autotune"`` autotunes each kernel).
        expected: per output, the tensor eager PyTorch produced (None where unknown).
        warn: called with the text of each fallback.

    Returns:
        The compiled segment; ``outputs`` holds what the check run computed.
    """
    work = GraphModule(gm, copy.deepcopy(gm.graph), type(gm).__name__)
    entry = ambient()
    if callable(backend):
        return CompiledSegment(backend(work, list(sample)), work,
                               outputs=_run_checked(work, sample))
    if config.fused_optimizer():
        fused_optimizer_steps(work)
    unpack_attention(work)  # nn.MultiheadAttention's fast path, not its copies
    if _on_gpu(sample):
        pad_linears(work)
        fuse_cross_entropy(work)
    if channels_last_wanted(sample) and any(n.target in CONVS for n in work.graph.nodes):
        plain = GraphModule(work, copy.deepcopy(work.graph), type(work).__name__)
        if channels_last_convs(work):
            said: list[str] = []
            try:  # the layout is an optimization: if anything fails with it, go without
                result = _compile_layout(work, sample, backend, mode, expected, said.append)
            except Exception as e:
                if lint_failure(e):
                    raise
                set_ambient(entry)
                return _compile_layout(plain, sample, backend, mode, expected, warn)
            for reason in said:
                warn(reason)
            result.plain = plain
            return result
    return _compile_layout(work, sample, backend, mode, expected, warn)


def kernel_prefix(gm: GraphModule) -> str:
    """The start of the names of ``gm``'s kernels: ``triton_``, then where the graph sits,
    so that no two kernels of a compiled function share a name (they are shown by name in
    reports and logs). A segment after the first read adds ``seg<k>_``, a torch.cond
    branch ``cond<i>_``::

        segment_0             triton_fused_0
        segment_2             triton_seg2_fused_0
        segment_0__cond1      triton_cond1_fused_0
    """
    prefix = "triton_"
    for part in type(gm).__name__.split("__"):
        if part.startswith("segment_") and part[8:].isdigit() and part[8:] != "0":
            prefix += f"seg{part[8:]}_"
        elif part.startswith("cond") and part[4:].isdigit():
            prefix += f"{part}_"
    return prefix


def channels_last_wanted(sample: list[Any]) -> bool:
    """Whether a segment run on ``sample`` gets channels-last convolutions (CUDA only:
    cuDNN's kernels there are NHWC; see ``passes/channels_last.py``)."""
    return config.channels_last(CHANNELS_LAST) and _on_gpu(sample)


def _on_gpu(sample: list[Any]) -> bool:
    return not interpreting() and any(isinstance(a, torch.Tensor) and a.is_cuda for a in sample)


def _compile_layout(work: GraphModule, sample: list[Any], backend: Any, mode: str | None,
                    expected: list[Any] | None, warn: Callable[[str], None]) -> CompiledSegment:
    branches = _compile_conds(work, backend, mode, warn)
    result = _compile_work(work, sample, backend, mode, expected, warn)
    for b in branches:  # torch.cond's branch kernels count as the segment's
        result.kernels += b.kernels
        result.records += b.records
        result.fallbacks += b.fallbacks
    return result


def _compile_work(work: GraphModule, sample: list[Any], backend: Any, mode: str | None,
                  expected: list[Any] | None, warn: Callable[[str], None]) -> CompiledSegment:
    entry = ambient()  # a failed attempt may stop inside a no_grad region: start again here
    python = CompiledSegment(direct_forward(work), work)
    if backend == "triton" and not _wants_kernels(work, sample) and _tensors(work, sample):
        warn("no GPU tensors and TRITON_INTERPRET is not set, so backend='triton' runs the "
             "recorded ops in Python instead")
    if backend == "python" or not _wants_kernels(work, sample):
        python.outputs = _run_checked(work, sample)
        return python
    read = [*sample, *attributes(work)]
    before = versions(read)
    pristine = _pristine(sample)
    try:
        compiled = _triton(GraphModule(work, copy.deepcopy(work.graph), type(work).__name__),
                           sample, mode)
    except Exception as e:  # the pipeline must never break a model: run the recorded ops
        if lint_failure(e):  # (in tests, and under FXLITE_LINT=1, a pass broke a graph)
            raise
        return _recorded_ops(python, work, sample, entry, warn, "the compile pipeline failed "
                             f"({type(e).__name__}: {e}); its ops run in eager")
    for reason in compiled.fallbacks:
        warn(reason)
    written = [i for i, (a, b) in enumerate(zip(versions(read), before)) if a != b]
    problem = None if compiled.seeded else _disagreement(
        compiled.outputs, expected, _least_precise_float(work))
    # rounding, or a wrong result? A run in float64 from the inputs the check run had
    # decides: the sample as it is, or its copy from before the run where the run wrote
    # to it (a training BatchNorm's buffers: else its rounding under TF32 fails the check)
    start = sample if not written else [pristine.get(i, a) for i, a in enumerate(sample)] \
        if all(i in pristine for i in written) else None
    if problem is not None and start is not None:
        problem = reference_problem(work, start, compiled.outputs, expected, problem)
    if problem is not None:
        return _recorded_ops(python, work, sample, entry, warn, "the compiled segment "
                             f"disagreed with eager ({problem}); its ops run in eager")
    compiled.recorded = work
    return compiled


_PRISTINE_BYTES = 16 << 20  # the inputs copied before a check run, together at most


def _pristine(sample: list[Any]) -> dict[int, torch.Tensor]:
    """Copies of ``sample``'s smaller tensors (by position), for a reference run after the
    check run wrote some of them: a BatchNorm's buffers, not the activations."""
    copies: dict[int, torch.Tensor] = {}
    left = _PRISTINE_BYTES
    for i, a in sorted(enumerate(sample), key=lambda p: _bytes(p[1])):
        size = _bytes(a)
        if not isinstance(a, torch.Tensor) or size > left:
            continue
        left -= size
        with torch.no_grad():
            copies[i] = a.clone()
    return copies


def _bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _recorded_ops(python: CompiledSegment, work: GraphModule, sample: list[Any], entry: Any,
                  warn: Callable[[str], None], reason: str) -> CompiledSegment:
    """Fall back to ``python`` (the recorded ops) for ``reason``, from the ambient state
    ``entry`` the attempt started in. Where the recorded ops raise too (an integer
    division by a zero in this call's values), the user's exception propagates with no
    fallback kept and no warning: the next call compiles again (fuzz seed 7212607)."""
    set_ambient(entry)
    python.outputs = _run_checked(work, sample)
    warn(reason)
    python.fallbacks.append(reason)
    return python


def _tensors(gm: GraphModule, sample: list[Any]) -> list[torch.Tensor]:
    """The tensors a segment takes: its inputs, parameters and buffers (none for a graph
    of Python arithmetic, such as Dynamo's ``math.sqrt`` of a constant)."""
    return [a for a in sample if isinstance(a, torch.Tensor)] + list(gm.parameters()) + \
        list(gm.buffers())


def _wants_kernels(gm: GraphModule, sample: list[Any]) -> bool:
    return interpreting() or any(t.is_cuda for t in _tensors(gm, sample))


def _compile_conds(gm: GraphModule, backend: Any, mode: str | None,
                   warn: Callable[[str], None]) -> list[CompiledSegment]:
    """Compile the branches of each torch.cond node; returns what they became."""
    made: list[CompiledSegment] = []

    def branch(g: GraphModule, example: list[Any]) -> Callable[..., Any]:
        # named after its segment and its place, so its kernels' names are its own
        named = GraphModule(g, g.graph, f"{type(gm).__name__}__cond{len(made)}")
        made.append(compile_segment(named, example, backend=backend, mode=mode, warn=warn))
        return made[-1].run

    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, CondOp):
            node.target = node.target.compiled(branch)
            changed = True
    if changed:
        gm.recompile()
    return made


# ---------------------------------------------------------------------- the Triton path
def _triton(gm: GraphModule, sample: list[Any], mode: str | None) -> CompiledSegment:
    cuda = [a.device for a in sample if isinstance(a, torch.Tensor) and a.is_cuda]
    lowering = Lowering(sample, cuda[0] if cuda else None)
    fused = run_passes(FORWARD_PASSES, gm, lowering)
    check = _KernelCheck(fused, mode, kernel_prefix(gm))
    outputs = check.run(*sample)
    _swap_in_kernels(fused, check.kernels)
    # a straight-line forward per layout spares kernels their launch lookups on a GPU
    # (under the interpreter it runs the same way, so CPU tests exercise it)
    run = StraightRunner(fused)
    compiled = CompiledSegment(run, fused, list(check.kernels.values()),
                               check.records, check.fallbacks, outputs)
    compiled.seeded = lowering.seeded  # its masks are not eager's: no comparison with eager values
    return compiled


def expand_kernels(kernels: list[Any]) -> list[Any]:
    """Kernels with each autograd group replaced by its forward and backward kernels
    (backward kernels exist once a backward has run)."""
    out: list[Any] = []
    for k in kernels:
        out.extend(k.kernels if hasattr(k, "_variants") else [k])
    return out


class _Replay(Interpreter):
    """Runs a graph on sample inputs, skipping effects on state outside it."""

    _private: list[torch.Tensor] = []

    def run(self, *args: Any, **kwargs: Any) -> Any:
        # the segment's private copies of the tensors it writes (compile._compile_path)
        self._private = [a for a in args if isinstance(a, torch.Tensor) and a.retains_grad]
        self._inputs = dict(zip((p.name for p in self.module.graph.find_nodes(op="placeholder")),
                                args))
        return super().run(*args, **kwargs)

    def run_node(self, n: Node) -> Any:
        if n.meta.get("external"):
            if "copies" in n.meta:
                self._unscale(n)
            for name, real in n.meta.get("settled", ()):  # an optimizer's step: its
                copy, value = self._inputs.get(name), real()  # results, as eager left them
                if isinstance(copy, torch.Tensor) and value is not None and copy is not value:
                    with torch.no_grad():
                        copy.copy_(value)
            if n.op == "call_method" and n.target in ("requires_grad_", "retain_grad") \
                    and n.args[0].op in ("call_function", "call_method"):
                return super().run_node(n)  # on a tensor the graph made: not the user's
            if n.op == "call_method" and n.target == "backward" \
                    and n.kwargs.get("inputs") is None:
                # A step reads the gradients after backward (clipping, scaling, an input's
                # saliency): run it, accumulating into the private copies and the leaves
                # the graph made itself only, never the user's tensors.
                inputs = self._private + self._own_leaves()
                if inputs:
                    args, kwargs = self.fetch_args_kwargs_from_env(n)
                    kwargs = {k: v for k, v in kwargs.items() if k != "inputs"}
                    args[0].backward(*args[1:], **kwargs, inputs=inputs)
            return None
        if n.target is getattr and n.args[1:] == ("grad",):
            # The sample stands in for a parameter with a non-leaf copy (the segment may
            # write it): its .grad is None, as the program's was, and torch's warning
            # about reading a non-leaf's .grad is about fxlite's copy, not the user's code.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor")
                return super().run_node(n)
        return super().run_node(n)

    def _unscale(self, n: Node) -> None:
        """``scaler.unscale_(opt)`` on the private copies (``compile._mark_unscales``):
        their gradients divided by the copy of the scale, as the call divided the real
        ones. Left undone (the check then disagrees: recorded ops) where a copy is missing."""
        of = {id(real()): copy() for real, copy in n.meta["copies"]
              if real() is not None and copy() is not None}
        scaler = n.target.__self__
        scale = of.get(id(getattr(scaler, "_scale", None)))
        args, _ = self.fetch_args_kwargs_from_env(n)
        params = [p for group in getattr(args[0], "param_groups", ()) for p in group["params"]]
        if scale is None or not all(id(p) in of for p in params):
            return
        grads = [of[id(p)].grad for p in params if of[id(p)].grad is not None]
        found = torch.zeros(1, device=scale.device)
        with torch.no_grad():
            for device in {g.device for g in grads}:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    [g for g in grads if g.device == device], found.to(device),
                    scale.double().reciprocal().float().to(device))

    def _own_leaves(self) -> list[torch.Tensor]:
        """Leaves that need gradients and that this graph made (``x.detach().requires_grad_()``),
        not inputs or attributes: their gradients are the program's to read, nobody else's."""
        seen: set[int] = set()
        leaves = []
        for node, v in self.env.items():
            made = node.op in ("call_function", "call_method")
            if made and isinstance(v, torch.Tensor) and v.is_leaf and v.requires_grad \
                    and id(v) not in seen:
                seen.add(id(v))
                leaves.append(v)
        return leaves


def _run_checked(gm: GraphModule, sample: list[Any]) -> Any:
    return _Replay(gm).run(*sample)


class _KernelCheck(_Replay):
    """Runs the fused module once, building and checking a kernel for each fused group."""

    def __init__(self, gm: GraphModule, mode: str | None, prefix: str = "triton_") -> None:
        super().__init__(gm)
        self.kernels: dict[str, Any] = {}
        self.records: list[KernelRecord] = []
        self.fallbacks: list[str] = []
        self._mode = mode
        self._prefix = prefix

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        sub = self.fetch_attr(target)
        if not getattr(sub, "meta", {}).get("fused_kind") or kwargs:
            return sub(*args, **kwargs)
        if sub.meta["fused_kind"] == "region" or torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self._autograd_group(target, getattr(sub, "inner", sub), args)
        checked = check_group(sub, args, f"{self._prefix}{target}", autotune=self._mode in (
            "max-autotune", "max-autotune-no-cudagraphs"), eager_goes_on=True)
        if checked.kernel is None:
            self.fallbacks.append(f"{target} ({', '.join(sub.meta.get('nodes', []))}) runs in "
                                  f"eager: {checked.reason}{_site_of(sub)}")
            return checked.expected
        # eager's values go on where they were computed, as the recording's did, in the
        # kernel's layout, which later calls will see
        result = checked.got if checked.expected is None else _laid_out_as(checked.expected,
                                                                            checked.got)
        self.kernels[target] = checked.kernel
        self.records.append(KernelRecord.of(checked.kernel, args, result))
        log_kernel(checked.kernel)
        return result

    def _autograd_group(self, target: str, sub: GraphModule, args: tuple) -> Any:
        """A group whose inputs need gradients: a Triton forward and a generated Triton
        backward (``codegen/lower/autograd.py``), each checked against eager on first use."""
        group = make_autograd_group(sub, args, name=f"{self._prefix}{target}")
        before = versions(args)
        got = group(*args)
        expected = sub(*args)
        try:
            assert_as_accurate(sub, args, got, expected, before)
        except AssertionError as e:
            self.fallbacks.append(f"{target} runs in eager: its autograd kernel disagreed "
                                  f"with eager: {e}{_site_of(sub)}")
            return expected
        self.fallbacks.extend(group.fallbacks)
        self.kernels[target] = group
        return got


def _laid_out_as(values: Any, like: Any, _made: dict[int, Any] | None = None) -> Any:
    """``values`` with each tensor whose strides differ from its counterpart in ``like``
    copied into that layout (one copy per tensor: one returned twice stays one).

    A kernel lays its outputs out as eager did when the program was recorded, which can
    differ from what the group's ops give on the rewritten graph's inputs (two transposes
    that cancel: vit_b_16's attention residual, recorded transposed). Later kernels are
    specialized on what the first call gives them: in eager's layout, the second call
    met the kernel's and generated 34 of vit_b_16's 51 kernels again (128 ms).

    Example::

        _laid_out_as(torch.ones(2, 3), torch.empty(3, 2).t()).stride() == (1, 2)
    """
    made = {} if _made is None else _made
    if isinstance(values, (tuple, list)) and isinstance(like, (tuple, list)) \
            and len(values) == len(like):
        return type(values)(_laid_out_as(v, k, made) for v, k in zip(values, like))
    if isinstance(values, torch.Tensor) and isinstance(like, torch.Tensor) \
            and values.shape == like.shape and values.stride() != like.stride() \
            and all(st or n <= 1 for n, st in zip(like.shape, like.stride())):  # no overlap
        if id(values) not in made:
            out = torch.empty_strided(like.shape, like.stride(), dtype=values.dtype,
                                      device=values.device)
            made[id(values)] = out.copy_(values)
        return made[id(values)]
    return values


def _site_of(sub: Any) -> str:
    for node in getattr(sub, "inner", sub).graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            return "\n  " + trace.replace("\n", "\n  ")
    return ""


def _disagreement(outputs: Any, expected: list[Any] | None,
                  through: torch.dtype | None = None) -> str | None:
    """Why the check run's outputs differ from eager's, or None.

    The recording and the check run both call the extern ops (convolutions, matmuls),
    which on a GPU with TF32 allowed (cuDNN's default) may pick other algorithms and round
    differently from run to run: float32 values are then compared at TF32's tolerance.
    Each kernel was already checked at float32's, on identical inputs. Values computed
    through a half-precision dtype (``through``: autocast's bfloat16, say) are compared at
    its tolerance: a float32 loss of a bfloat16 forward carries bfloat16's rounding, which
    fused kernels (rounding once) and eager (rounding each op) make differently."""
    if expected is None or outputs is None:
        return None
    tf32 = tf32_allowed()
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if want is None:
            continue
        try:
            if (tf32 and isinstance(want, torch.Tensor) and want.is_cuda
                    and want.dtype == torch.float32 and isinstance(got, torch.Tensor)):
                assert_same(got, want, tolerance=TF32)
            else:
                assert_same(got, want, through)
        except AssertionError as e:
            return f"output {i}: {str(e).splitlines()[0] if str(e) else 'differs'}"
    return None


def _least_precise_float(gm: GraphModule) -> torch.dtype | None:
    """The half-precision float dtype (bfloat16 before float16) some value of ``gm`` has,
    as recorded, or None."""
    seen = set()
    for n in gm.graph.nodes:
        layout = node_layout(n)
        if layout is not None:
            seen.add(layout[2])
    return next((d for d in HALF if d in seen), None)


def _swap_in_kernels(gm: GraphModule, kernels: dict[str, Any]) -> None:
    """Turn each ``call_module fused_i`` into a direct call of its kernel."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in kernels:
            target = node.target
            node.op, node.target = Opcode.CALL_FUNCTION, kernels[target]
            gm.delete_submodule(target)
    gm.recompile()
