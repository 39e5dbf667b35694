"""The one kernel check, for forward and backward groups alike, with its tolerance table,
and a second look at results that round differently from eager's: a wider run decides.

:func:`check_group` builds a fused group's kernel, runs it on the group's inputs, runs the
group's eager ops, and keeps the kernel where :func:`assert_as_accurate` finds the two
results the same: at the tolerance of ``TOLERANCE`` (of the result's dtype, or of
``through``, the dtype the values were computed in, if looser), or, failing that, by
the wider look below. A recorded segment (``segment.py``) and autodiff's graphs
(``autograd_pipeline.py``) both judge their groups this way.

A fused kernel keeps its intermediates in float32 registers and rounds once; eager rounds
every op's result to the tensor's dtype. Over a few ops the two agree at the dtype's
tolerance, but over a deep bfloat16 model (GPT-2's twelve blocks), or after convolutions
that cuDNN runs with other algorithms (channels-last, TF32), their final values drift apart
by more than that while neither is wrong. So where the plain comparison fails, both are
measured against the same graph run wider: in float64, or in float32 without TF32 where
every floating value is a half (bfloat16, float16), whose rounding float32's is as far
below, or where a GPU allows TF32 and the graph runs convolutions or matmuls, whose TF32
rounding (about 1e-3) float32's is as far below; each in half the memory (the float64
run of a bfloat16 GPT-2 LM at batch 32 took 3.3 GiB on an H200). The compiled result
passes if its error is at most twice eager's, plus a tenth of the dtype's tolerance, the
rule PyTorch's own benchmark suite applies to compiled models. A wrong kernel (a dropped
term, a wrong index) is off by far more than eager's rounding and still fails.

Graphs the wider run cannot reproduce get no second look: ones that draw random numbers
a value reads, call submodules, or wrote to their inputs while they were checked (see
``versions``).

A large pointwise group's eager ops run, and compare, a slice of rows at a time
(:func:`_checked_in_pieces`): run whole, their temporaries were the check's peak memory.

Example: ``x`` in bfloat16 through twenty ``x = x * 1.01 + 0.1`` steps. Eager rounds twenty
times, the fused kernel once; they differ by ~3% at the end, so the plain check fails,
but the kernel is the closer of the two to the float32 run, so it is kept.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from fxlite.codegen.capture.kinds import mutation_candidates, random_op, state_name
from fxlite.codegen.runtime import kernel as runtime_kernel
from fxlite.codegen.runtime.launch import slices
from torch.overrides import TorchFunctionMode

from fxlite.graph_module import GraphModule
from fxlite.node import target_name
from fxlite.ops import attribute_at, lookup

__all__ = ["HALF", "OTHER", "TF32", "TOLERANCE", "Checked", "Tolerance", "allclose", "assert_as_accurate",
           "assert_same", "attributes", "check_group", "reference_problem", "reproducible",
           "tf32_allowed", "versions"]


class Tolerance(NamedTuple):
    """``got`` matches ``expected`` where ``|got - expected| <= atol + rtol * |expected|``."""

    rtol: float
    atol: float


# The one tolerance table, of forward and backward kernels and of a segment's results, by
# the result's dtype. The two pipelines had agreed on bfloat16, float16 and float32. For
# float64 the forward kept (1e-5, 1.3e-6), the backward (1e-7, 1e-7): the stricter one is
# kept. Other floating dtypes (complex; fuse groups none of them) keep the forward's.
TOLERANCE = {
    torch.bfloat16: Tolerance(1.6e-2, 1.6e-2),
    torch.float16: Tolerance(2e-3, 2e-3),
    torch.float32: Tolerance(1e-5, 1e-5),
    torch.float64: Tolerance(1e-7, 1e-7),
}
OTHER = Tolerance(1e-5, 1.3e-6)
# float32 results of a segment that ran extern ops (convolutions, matmuls) on a GPU that
# allows TF32 (cuDNN's default): its algorithms round differently from run to run
TF32 = Tolerance(2e-3, 2e-3)
HALF = (torch.bfloat16, torch.float16)  # the least precise first
_SEEDED = frozenset({"draw_seed", "seeded_dropout"})
# Effects that only raise or pass (timm checks shapes with torch._assert): running a
# graph again with them does the same.
_CHECKS = frozenset({torch._assert})


# elements compared at once (allclose, _compare_one): a float64 comparison of three
# slices of 2**24 took 0.7 GiB of temporaries on a swin_t's first call (bf16, batch 32)
_SLICE = 1 << 21


def allclose(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    """``torch.allclose(a, b, rtol, atol, equal_nan=True)`` for tensors of one shape, dtype
    and device, compared a slice (a view) of at most ``_SLICE`` elements at a time: its
    temporaries are a slice's, not the tensors' (checking a GPT-2 step's float32 logits
    took 3 GiB on top of the step's own memory).

    Example::

        allclose(torch.ones(3), torch.ones(3) + 1e-7, 1e-5, 1e-5)   # True
    """
    return all(torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
               for x, y in zip(slices(a, _SLICE), slices(b, _SLICE)))


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` in float64 (complex: in ``a``'s dtype), NaN counted as 0, computed a
    slice at a time."""
    if a.is_complex():
        return max(float((x - y).abs().max())
                   for x, y in zip(slices(a, _SLICE), slices(b, _SLICE)) if x.numel())
    return max((float((x.double() - y.double()).abs().nan_to_num().max())
                for x, y in zip(slices(a, _SLICE), slices(b, _SLICE)) if x.numel()), default=0.0)


def versions(tensors: Iterable[Any]) -> list[int]:
    """The ``_version`` of each tensor (-1 for other values): compare before and after a run
    to see whether it wrote any of them. An inference tensor has none: it gets a number
    never given before, so a run given one counts as one that may have written it."""
    return [(-1 if not isinstance(t, torch.Tensor) else next(_UNKNOWN) if t.is_inference()
             else t._version) for t in tensors]


_UNKNOWN = itertools.count(-2, -1)  # stands for the version of an inference tensor


def attributes(gm: GraphModule) -> list[Any]:
    """The values of ``gm``'s ``get_attr`` nodes (its parameters, buffers and constants)."""
    return [attribute_at(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]


class Checked(NamedTuple):
    """What :func:`check_group` found for one fused group."""

    kernel: Any  # the group's kernel, or None: the group runs its eager ops
    got: Any  # the kernel's result (None without a kernel)
    # eager's result (None where the kernel's binary matched eager before), or the kernel's
    # where eager's was the one off (assert_as_accurate): the result to go on with
    expected: Any
    reason: str  # why ``kernel`` is None


def check_group(group: torch.nn.Module, args: Sequence[Any], name: str, *,
                direction: str = "forward", autotune: bool = False,
                through: torch.dtype | None = None, eager_goes_on: bool = False) -> Checked:
    """Build ``group``'s kernel and check it against ``group``'s eager ops on ``args``.

    Args:
        group: a fused group (its graph is ``group.inner``'s where it wraps one, as
            ``AutocastOff`` does; its eager ops are ``group(*args)``).
        args: its inputs; neither run may write to them for the wider look to apply.
        name: the kernel's name.
        direction: ``"forward"``, or ``"backward"`` for a group of a generated backward.
        autotune: time candidate block sizes and warps first, and keep the best (without
            it, only the warps of a reduction over rows at least 8192 wide are timed).
        through: a dtype the values were computed in, whose tolerance applies if looser
            (the backward's least precise input: a float32 gradient of bfloat16 values is
            only as close as bfloat16).
        eager_goes_on: the caller goes on with eager's result, not the kernel's: where the
            check runs in pieces, the kernel's result is overwritten with eager's, piece by
            piece, and returned as both (one buffer less at the check's peak).

    Returns:
        The kernel, its result and the one to go on with (eager's, or the kernel's where
        eager's is the one off: :func:`assert_as_accurate`), or no kernel and the reason.
    """
    graph = getattr(group, "inner", group)
    try:  # (looked up in its module at each call: tests put in their own generator)
        kernel = runtime_kernel.generate_kernel(graph, list(args), name=name)
    except Exception as e:  # the generator must never break a model: run eagerly
        kernel, reason = None, f"{type(e).__name__}: {e}"
    else:
        reason = "the kernel generator does not support it"
    if kernel is None:
        return Checked(None, None, group(*args), reason)
    kernel.direction = direction
    # the kernel first, then eager's reference: the kernel's first call also checks its
    # direct launch (one more output), which must not meet the reference's outputs too
    # (three copies of a GPT-2 step's logits at once, 0.8 GiB each)
    expected = None
    try:
        if autotune:
            kernel.autotune(*args)
        else:  # wide rows only: their best warps differ by op (kernels/config.py)
            kernel.tune_wide_rows(*args)
        before = versions(args)
        got = kernel(*args)
        if not kernel.checked:  # else it matched eager before (the disk index says)
            expected = _checked_in_pieces(group, graph, args, got, before, through,
                                          eager_goes_on)
            if expected is None:
                expected = assert_as_accurate(graph, args, got, group(*args), before,
                                              through)
            kernel.mark_checked()
    except Exception as e:
        return Checked(None, None, group(*args) if expected is None else expected,
                       f"its kernel disagreed with eager: {e}")
    return Checked(kernel, got, expected, "")


_PIECE_BYTES = 16 << 20  # the outputs of one piece of a pointwise group's eager run


def _checked_in_pieces(group: torch.nn.Module, graph: GraphModule, args: Sequence[Any],
                       got: Any, before: list[int], through: torch.dtype | None,
                       overwrite: bool) -> Any:
    """Eager's result of a large pointwise group, run and compared with ``got`` a slice
    of the first dim at a time (:func:`assert_as_accurate` on each); None, having run
    nothing, where the group is small or not one that slices.

    Why: run whole, the group's eager ops (decomposed: a BatchNorm and GELU is eleven)
    held several temporaries of the full size beside the kernel's result. maxvit_t's
    first call at batch 32 took 1.5 GiB to check one such group of 392 MiB. In pieces,
    the check holds the kernel's result, eager's and one piece's temporaries; with
    ``overwrite``, eager's pieces are written over the kernel's once compared, and the
    kernel's result is returned as eager's.

    A group slices when every op in it is pointwise and draws nothing, each tensor
    input has the outputs' first dim or broadcasts over it, and each output is a tensor
    of its own with that first dim: the ops' values then depend on their row alone.
    """
    outs = list(got) if isinstance(got, (tuple, list)) else [got]
    if not outs or not all(isinstance(o, torch.Tensor) and o.dim() > 0 for o in outs):
        return None
    rows, total = outs[0].shape[0], sum(o.numel() * o.element_size() for o in outs)
    if total <= _PIECE_BYTES or rows < 2 or any(
            o.shape[0] != rows or o.dim() != outs[0].dim() for o in outs):
        return None
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    mine = {a.untyped_storage().data_ptr() for a in inputs}
    if len({o.untyped_storage().data_ptr() for o in outs}) < len(outs) or any(
            o.untyped_storage().data_ptr() in mine for o in outs):
        return None  # an output that is an input, or another output
    if any(a.dim() == outs[0].dim() and a.shape[0] not in (1, rows) or a.dim() > outs[0].dim()
           for a in inputs):
        return None
    for n in graph.graph.nodes:
        if n.op in ("call_module", "get_attr") or n.op in ("call_function", "call_method") and (
                getattr(lookup(n, graph), "kind", None) != "pointwise"):
            return None
    if not reproducible(graph):
        return None
    step = max(1, rows * _PIECE_BYTES // total)
    expected = outs if overwrite else [torch.empty_like(o) for o in outs]
    for start in range(0, rows, step):
        piece = slice(start, start + step)
        part = [a[piece] if isinstance(a, torch.Tensor) and a.dim() == outs[0].dim()
                and a.shape[0] == rows else a for a in args]
        want = group(*part)
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        want = assert_as_accurate(graph, part, [o[piece] for o in outs], want, before, through)
        for e, w in zip(expected, want):
            if e[piece].data_ptr() != w.data_ptr():  # (the kernel's piece: it stays)
                e[piece].copy_(w)
    return type(got)(expected) if isinstance(got, (tuple, list)) else expected[0]


def assert_same(got: Any, expected: Any, through: torch.dtype | None = None, *,
                tolerance: Tolerance | None = None) -> None:
    """Raise AssertionError unless ``got`` matches ``expected`` at ``TOLERANCE`` of the
    dtype (or at ``tolerance``), or of ``through`` (a dtype the values were computed in) if
    looser. Integers and bools must be equal; other values compare with ``!=``. Tensors
    are compared a slice at a time, so the check's temporaries stay small."""
    # (torch.testing.assert_close would import torch's meta kernels on first use: seconds)
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            raise AssertionError("output structure differs")
        for g, e in zip(got, expected):
            assert_same(g, e, through, tolerance=tolerance)
        return
    if not isinstance(expected, torch.Tensor):
        if got != expected and not (got is None and expected is None):
            raise AssertionError(f"{got!r} != {expected!r}")
        return
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"expected a tensor, got {type(got).__name__}")
    got, expected = got.detach(), expected.detach()
    if got.shape != expected.shape or got.dtype != expected.dtype or got.device != expected.device:
        raise AssertionError(f"shape, dtype or device differs: {tuple(got.shape)} {got.dtype} "
                             f"{got.device}, eager {tuple(expected.shape)} {expected.dtype} "
                             f"{expected.device}")
    if not (expected.is_floating_point() or expected.is_complex()):
        if not torch.equal(got, expected):
            raise AssertionError("values differ")
        return
    tol = tolerance or TOLERANCE.get(expected.dtype, OTHER)
    wide = TOLERANCE.get(through, tol) if through is not None else tol
    rtol, atol = max(tol.rtol, wide.rtol), max(tol.atol, wide.atol)
    if not allclose(got, expected, rtol, atol):
        raise AssertionError(f"values differ (max abs difference "
                             f"{_max_difference(got, expected):.3g}, rtol {rtol:g}, atol {atol:g})")


def assert_as_accurate(gm: GraphModule, args: Sequence[Any], got: Any, expected: Any,
                       before: list[int], through: torch.dtype | None = None) -> Any:
    """:func:`assert_same`, with a wider run of ``gm`` deciding where they differ by
    rounding and neither run wrote to ``args`` (``before``: their :func:`versions`).

    Returns:
        The result to go on with: ``expected``, or ``got`` where the wider run found
        eager's the one that is off (further from it than the check allows ``got``).
        Why: torch's CPU ops on a decomposed tanh GELU, in about one process in twenty,
        gave half the rows 3e-4 off; the kernel was right, but the segment went on with
        eager's values and then failed its own check against the recording.
    """
    try:
        assert_same(got, expected, through)
    except AssertionError as e:
        problem = str(e) or "values differ"
        if versions(args) != before:
            raise
        problem, eager_off = _judged(gm, args, got, expected, problem)
        if problem is not None:
            raise AssertionError(problem) from None
        return got if eager_off else expected
    return expected


def reference_problem(gm: GraphModule, args: Sequence[Any], got: Any, expected: Any,
                      problem: str) -> str | None:
    """None if ``got`` is about as close to ``gm`` run wider as ``expected`` is.

    Args:
        gm: the graph both results came from (not changed).
        args: its inputs, which neither run wrote to (``versions`` tells).
        got: the compiled result.
        expected: eager's result on ``args``.
        problem: why the plain comparison failed.

    Returns:
        None when ``got`` passes, else ``problem`` with what the wider run found.
    """
    return _judged(gm, args, got, expected, problem)[0]


def _judged(gm: GraphModule, args: Sequence[Any], got: Any, expected: Any,
            problem: str) -> tuple[str | None, bool]:
    """:func:`reference_problem`'s verdict, and whether ``expected`` would fail the same
    test against ``got`` (eager's result is the one off)."""
    if not reproducible(gm):
        return problem, False
    read = [*args, *attributes(gm)]
    real, _ = wide = _reference_dtypes(read, tf32_allowed() and _runs_tf32(gm))
    name = str(real).removeprefix("torch.")
    try:
        reference = _run_reference(gm, args, wide)
    except Exception as e:  # no float64 kernel for some op, say: the plain verdict stands
        return f"{problem} (a {name} run to compare with failed: {type(e).__name__})", False
    verdict = _compare(got, expected, reference)
    if verdict is not None:
        return f"{problem}; against a {name} run, {verdict}", False
    return None, _compare(expected, got, reference) is not None


def _reference_dtypes(values: Sequence[Any], tf32: bool = False
                      ) -> tuple[torch.dtype, torch.dtype]:
    """The real and complex dtypes of the wider run: float32 and complex64 where every
    floating tensor among ``values`` is a half, or, with ``tf32`` (the graph runs
    convolutions or matmuls that TF32 rounds), a half or float32 on a GPU. The wider run
    turns TF32 off, so float32 is then about a thousand times closer than the run it
    judges, at half the memory of float64 (resnet50's first call peaked at 2.7x eager's
    with a float64 copy of its weights and activations). Else float64 and complex128:
    for a graph of pointwise ops and reductions, float32 would be eager's own rounding."""
    tensors = [t for t in _leaves(list(values)) if isinstance(t, torch.Tensor)
               and (t.is_floating_point() or t.is_complex())]
    kinds = {t.dtype for t in tensors}
    if kinds and kinds <= set(HALF):
        return torch.float32, torch.complex64
    if kinds and kinds <= {*HALF, torch.float32} and tf32 and any(t.is_cuda for t in tensors):
        return torch.float32, torch.complex64
    return torch.float64, torch.complex128


# ops that TF32 rounds (cuBLAS and cuDNN), by name
_TF32_OPS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "_convolution", "matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm",
    "addbmm", "linear", "bilinear", "padded_linear", "einsum", "tensordot",
    "scaled_dot_product_attention", "multi_head_attention_forward",
    "_native_multi_head_attention"})


def _runs_tf32(gm: GraphModule) -> bool:
    """Whether ``gm`` calls an op that TF32 rounds. (A graph that calls a submodule gets
    no wider run: ``reproducible``.)"""
    return any(n.op in ("call_function", "call_method") and target_name(n) in _TF32_OPS
               for n in gm.graph.nodes)


def tf32_allowed() -> bool:
    """Whether torch may run float32 convolutions or matmuls in TF32 on a GPU."""
    return torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    """TF32 off for convolutions and matmuls, as the wider run needs them (float32's
    rounding, not TF32's); the settings are put back after."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def reproducible(gm: GraphModule) -> bool:
    """Whether running ``gm`` again computes the same from the same inputs: no random
    numbers that a value reads, no effects (``print``, external calls) and no submodules
    (which may hide either). Writes to its inputs are for the caller to rule out
    (``versions``). A second run's draws move the generators; the compile runs its checks
    inside ``fork_rng``."""
    for n in gm.graph.nodes:
        if n.op == "call_module" or n.meta.get("external"):  # the check skips external ones
            return False
        if n.op not in ("call_function", "call_method"):
            continue
        func = getattr(torch.Tensor, n.target, None) if n.op == "call_method" else n.target
        args, kwargs = tuple(n.args), dict(n.kwargs)
        if state_name(func) in _SEEDED:
            return False
        if random_op(func, args, kwargs):
            if n.users or mutation_candidates(func, args, kwargs) or \
                    kwargs.get("generator") is not None:  # (fork_rng forks the defaults)
                return False
            continue  # a draw nothing reads changes no value: the LayerDrop draw
            # `torch.rand([])` of transformers' encoders, read only in training
        info = lookup(n, gm)
        if info is not None and info.kind == "effect" and not all(  # operator writes and
                getattr(f, "__module__", None) == "_operator" or f in _CHECKS  # assertions:
                for f in info.functions):  # a second run does the same
            return False  # print, torch.manual_seed, functions marked has_side_effect
    return True


def _widen(value: Any, wide: tuple[torch.dtype, torch.dtype]) -> Any:
    """A copy of each tensor: floating ones in ``wide[0]``, complex ones in ``wide[1]``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return value.detach().to(wide[0], copy=True)
        if value.is_complex():
            return value.detach().to(wide[1], copy=True)
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_widen(v, wide) for v in value)
    return value


def _run_reference(gm: GraphModule, args: Sequence[Any], wide: tuple[torch.dtype, torch.dtype]
                   ) -> Any:
    root = {n.target: _widen(attribute_at(gm, n.target), wide)
            for n in gm.graph.nodes if n.op == "get_attr"}
    owner = gm.graph.owning_module
    try:  # the wide module shares gm's graph, which a GraphModule takes as its own
        reference = GraphModule(root, gm.graph, "WideReference")
        with torch.no_grad(), torch.autocast("cuda", enabled=False), \
                torch.autocast("cpu", enabled=False), _no_tf32(), _WideCasts(wide[0]):
            return reference(*[_widen(a, wide) for a in args])
    finally:  # give it back: else the graph keeps the wide copies of the weights alive
        gm.graph.owning_module = owner


class _WideCasts(TorchFunctionMode):
    """The wider run's casts to a 16-bit type (autocast's, made explicit) cast to its own
    dtype: else a matmul read a 16-bit activation and a widened weight, and failed. A
    region through a linear under autocast (``autograd_regions``) rounds its activations
    to bfloat16 before each matmul, as eager does, and both runs are judged against the
    values without those roundings::

        to = h.to(torch.bfloat16)        # in the wider run: h.to(torch.float32)
        y = F.linear(to, w, b)
    """

    def __init__(self, wide: torch.dtype) -> None:
        super().__init__()
        self.wide = wide

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            args = tuple(self.wide if _half(a) else a for a in args)
            kwargs = {k: self.wide if _half(v) else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _half(value: Any) -> bool:
    return isinstance(value, torch.dtype) and value in HALF


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _compare(got: Any, expected: Any, reference: Any) -> str | None:
    got, expected, reference = _leaves(got), _leaves(expected), _leaves(reference)
    if not len(got) == len(expected) == len(reference):
        return "the output structure differs"
    for i, (g, e, r) in enumerate(zip(got, expected, reference)):
        verdict = _compare_one(g, e, r) if isinstance(e, torch.Tensor) else (
            None if e is None or g == e else f"{g!r} != {e!r}")
        if verdict is not None:
            return f"output {i}: {verdict}"
    return None


def _compare_one(got: Any, expected: torch.Tensor, reference: Any) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or not isinstance(
            reference, torch.Tensor) or reference.shape != expected.shape:
        return "shapes differ"
    if not (expected.is_floating_point() or expected.is_complex()):
        return None if torch.equal(got.detach(), expected.detach()) else "values differ"
    squares, count = [0.0, 0.0, 0.0], 0  # of the errors, eager's errors and the values
    for pieces in zip(*(slices(t.detach(), _SLICE) for t in (got, expected, reference))):
        g, e, r = (t.to(torch.complex128 if t.is_complex() else torch.float64) for t in pieces)
        finite = torch.isfinite(e)
        if not torch.equal(finite, torch.isfinite(g)) or not torch.equal(
                g[~finite].nan_to_num(), e[~finite].nan_to_num()):
            return "its NaN or infinite values are not eager's"
        finite &= torch.isfinite(r)
        g, e, r = g[finite], e[finite], r[finite]
        for i, t in enumerate((g - r, e - r, r)):
            squares[i] += float(t.abs().square().sum())
        count += r.numel()
    error, eager_error, scale = (math.sqrt(s / count) if count else 0.0 for s in squares)
    tolerance = TOLERANCE[expected.dtype].rtol if expected.dtype in HALF else OTHER.atol
    if expected.dtype == torch.float32 and expected.is_cuda and tf32_allowed():
        tolerance = TF32.rtol
    if error <= 2 * eager_error + tolerance / 10 * scale:
        return None
    return (f"its error is {error:.3g} (root mean square), eager's is {eager_error:.3g}, "
            f"for values of size {scale:.3g}")

