"""Fused groups under autograd: a Triton forward and a generated Triton backward.

``make_autograd_group(group, example_inputs)`` returns an :class:`AutogradGroup`, a
callable to put in place of a fused group (``fused_<i>``) when gradients are needed::

    group_fn = make_autograd_group(fused.fused_0, [x, w, b], name="fused_0")
    y = group_fn(x, w, b)         # forward kernel; saves what the backward needs
    y.sum().backward()            # backward kernel(s): x.grad, w.grad, b.grad
    [k.direction for k in group_fn.kernels]   # ['forward', 'backward', ...]

Under grad mode with an input that requires grad, the call runs a
``torch.autograd.Function``: its forward is the group's kernel, extended to also store
the values autodiff (``lower/autodiff.py``) chose to save (row statistics such as a layer
norm's rstd; full-size values are recomputed from the inputs instead), and its backward runs the
backward graph through the same pipeline (``autograd_pipeline.CompiledGraph``). Without
gradients the call runs the group's plain kernel.

One variant is built per input signature (dtypes, ranks, which dims are size 1, which
inputs require grad); sizes are runtime values. A group autodiff cannot differentiate
(an op without a rule) runs as the eager group under autograd, and says so in
``fallbacks``. Double backward (``create_graph=True``) is refused with an error, never
answered with gradients that silently lack their second-order part.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import torch
from fxlite.codegen.capture.guards import LayoutCheck
from fxlite.codegen.lower.autodiff import (
    GroupGrad,
    NotDifferentiable,
    differentiate,
    without_tangents,
)
from fxlite.codegen.lower.autograd_pipeline import CompiledGraph
from fxlite.codegen.lower.pipeline import lint_failure
from fxlite.codegen.report import kernel_report

from fxlite.graph_module import GraphModule
from fxlite.node import Node, Opcode, map_arg
from fxlite.ops import lookup
from fxlite.ops.shapes import as_meta, meta_tensor, propagate

__all__ = ["AutogradGroup", "backward_untraced", "make_autograd_group", "swap_in_autograd"]

_MAX_VARIANTS = 16
_CHECKS = 4  # layout checks a group makes (AutogradGroup._variant_of)


def _signature(args: Sequence[Any]) -> tuple:
    """The variant key of ``args`` (called in grad mode): per tensor its dtype, device type,
    whether it requires grad and which dims are size 1 (its rank where none is: cheaper,
    and most activations have none); per other value its type. Each call of a group
    computes it: a 4-d tensor costs about a third of the host time of the general form."""
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            s = a.shape
            key.append((a.dtype, a.is_cuda or a.device.type, a.requires_grad,
                        tuple(n == 1 for n in s) if 1 in s else len(s)))
        else:
            key.append(type(a))
    return tuple(key)


def _copy(gm: GraphModule) -> GraphModule:
    new = GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


class _Variant:
    """The compiled forward and backward of one input signature."""

    def __init__(self, grad: GroupGrad, args: Sequence[Any], name: str) -> None:
        self.grad = grad
        values = propagate(grad.forward, args)
        results = map_arg(grad.forward.graph.result, values.__getitem__)
        self.forward = CompiledGraph(grad.forward, args, "forward", name)
        # their layouts only: real values would keep the first call's activations (and
        # through their autograd graphs, the compile check's private parameter copies)
        # alive for as long as the kernels live
        saved = [as_meta(args[i] if kind == "input" else results[i])
                 for kind, i in grad.saved]
        outs = results[:grad.n_outputs]
        tangents = [meta_tensor(outs[i].shape, outs[i].dtype) for i in grad.tangents]
        self._examples, self._name = [*saved, *tangents], f"{name}_bwd"
        # backward graphs per pattern of outputs that got gradients, compiled when a
        # backward first needs one (a training BatchNorm's statistics never get any)
        self._backward: dict[tuple[bool, ...], CompiledGraph] = {}
        self._needs: dict[tuple[bool, ...], tuple[int, ...]] = {}
        # with several outputs a backward may read fewer saved values than it saved (an
        # output the loss does not use): it checks their versions itself (_check_versions)
        self.checks_by_hand = len(grad.tangents) > 1 and _TOP_HOOKS is not None
        self._lock = threading.Lock()
        self._zeros: dict[tuple, torch.Tensor] = {}

    def backward_for(self, used: Sequence[bool]) -> CompiledGraph:
        """The backward for calls where only the outputs marked ``used`` got gradients: the
        others' zero tangents contribute nothing (``autodiff.without_tangents``)."""
        key = tuple(used)
        found = self._backward.get(key)
        if found is None:
            with self._lock:
                found = self._backward.get(key)
                if found is None:
                    unused = [k for k, u in enumerate(key) if not u]
                    graph = without_tangents(self.grad.backward, len(key), unused) \
                        if unused else self.grad.backward
                    places = [n for n in graph.graph.nodes if n.op == Opcode.PLACEHOLDER]
                    self._needs[key] = tuple(i for i, n in enumerate(
                        places[:len(self.grad.saved)]) if n.users)
                    found = self._backward[key] = CompiledGraph(
                        graph, self._examples, "backward", self._name)
        return found

    def needs(self, used: Sequence[bool]) -> tuple[int, ...]:
        """The saved values that the backward for ``used`` reads (after ``backward_for``)."""
        return self._needs[tuple(used)]

    def parts(self) -> list[CompiledGraph]:
        """Every compiled graph: the forward and the backwards built so far."""
        return [self.forward, *self._backward.values()]

    def zeros(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tangent of an output the loss does not use (a BatchNorm's batch mean, read
        only by the running-stat update): one zero tensor kept per shape, since the
        backward only reads it (a fill kernel a call and output before)."""
        key = (shape, dtype, device)
        found = self._zeros.get(key)
        if found is None:
            found = torch.zeros(shape, dtype=dtype, device=device)
            # (made inside a CUDA graph capture, it would live in the graph's memory pool)
            if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
                self._zeros[key] = found
        return found


def output_views(group: GraphModule) -> dict[int, int]:
    """Which of ``group``'s outputs are views of another: output index -> that output's
    index (through view ops: reshape, view, permute, detach...), or the same value twice."""
    node = next(n for n in group.graph.nodes if n.op == Opcode.OUTPUT)
    outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
    first: dict[Any, int] = {}
    for j, n in enumerate(outs):
        if isinstance(n, Node):
            first.setdefault(n, j)
    found: dict[int, int] = {}
    for i, n in enumerate(outs):
        while isinstance(n, Node):
            if first.get(n, i) != i:
                found[i] = first[n]
                break
            info = lookup(n, group) if n.op in (Opcode.CALL_FUNCTION, Opcode.CALL_METHOD) \
                else None
            if info is None or info.kind != "view" or not n.args:
                break
            n = n.args[0]
    return found


def _aliases(view: torch.Tensor, base: Any) -> bool:
    return isinstance(base, torch.Tensor) and base.dtype == view.dtype and \
        base.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()


def _remade_views(outs: tuple, views: dict[int, Any]) -> tuple:
    """``outs`` with each output that the kernel returned as a view of another output made
    again as that view (the Function returned a copy): ``v2 = v1.reshape(...)`` written in
    place after a graph break then writes ``v1``, as in eager (fuzz seed 977848)."""
    remade = list(outs)
    for i, source in views.items():
        if not isinstance(source, tuple):
            continue
        j, size, stride, offset = source
        base = outs[j] if remade[i].requires_grad else outs[j].detach()
        remade[i] = base.as_strided(size, stride, offset)
    return tuple(remade)


try:  # saved-tensor hooks, as `torch.autograd.graph.saved_tensors_hooks` sets them
    _TOP_HOOKS = torch._C._autograd._top_saved_tensors_default_hooks
    _PUSH_HOOKS = torch._C._autograd._push_saved_tensors_default_hooks
    _POP_HOOKS = torch._C._autograd._pop_saved_tensors_default_hooks
    _HOOKS_ON = torch._C._autograd._saved_tensors_hooks_is_enabled
except AttributeError:  # another torch: autograd checks every saved value
    _TOP_HOOKS = _PUSH_HOOKS = _POP_HOOKS = _HOOKS_ON = None


def _detached(t: torch.Tensor) -> torch.Tensor:
    # an alias without autograd history, sharing the version counter: an output saved
    # as itself by a hook would hold its own grad_fn, a cycle that is never freed
    return t.detach()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _check_versions(saved: list[Any], versions: list[Any], needed: Sequence[int]) -> None:
    """Raise as eager's autograd does where a saved value the backward reads was written
    in place since the forward saved it. One it does not read (the value a dead result's
    backward would need) may have been: eager never runs that node's backward either
    (fuzz seed 7105288)."""
    for i in needed:
        t, version = saved[i], versions[i]
        if version is not None and t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [{t.type()} {list(t.shape)}], which a fused group "
                f"saved, is at version {t._version}; expected version {version} instead. "
                "Hint: enable anomaly detection to find the operation that failed to compute "
                "its gradient, with torch.autograd.set_detect_anomaly(True).")


class _GroupFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, variant: _Variant, views: dict, by_hand: bool, *args: Any) -> Any:
        grad = variant.grad
        results = variant.forward(*args)
        saved = [args[i] if kind == "input" else results[i] for kind, i in grad.saved]
        ctx.save_for_backward(*(v for v in saved if isinstance(v, torch.Tensor)))
        ctx.plain = [None if isinstance(v, torch.Tensor) else v for v in saved]
        # by hand (under AutogradGroup's saved-tensor hooks autograd skips its version
        # check of the saved values): backward checks those its graph reads
        ctx.versions = [v._version if isinstance(v, torch.Tensor) else None
                        for v in saved] if by_hand else None
        ctx.variant = variant
        ctx.inputs = [(a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else None
                      for a in args]
        # An input returned as it is, or a view, would make autograd forbid the caller's
        # in-place writes into the result; one tensor returned twice (x and detach(x))
        # would be marked non-differentiable for both: those outputs are copies (kernels'
        # results are tensors of their own already; an identity group returns its input).
        # An output the group makes as a view of another (``views``), which the kernel
        # returned as one, is made again as that view outside, so that a later in-place
        # write through it reaches its base, as in eager.
        outs: list[Any] = []
        for i, o in enumerate(results[:grad.n_outputs]):
            if isinstance(o, torch.Tensor) and (o._base is not None or any(
                    o is a for a in args) or any(o is p for p in outs)):
                j = views.get(i)
                if j is not None and _aliases(o, results[j]):
                    views[i] = (j, tuple(o.shape), o.stride(), o.storage_offset())
                o = o.clone()
            outs.append(o)
        # an output the loss does not use gets None, not zeros: the inputs only it reaches
        # then get None too, as in eager (backward below)
        # values eager's ops saved and Python may write before the backward: their versions
        # now (an output through a detached alias: itself would be a cycle through ctx)
        ctx.checked = None
        if grad.checked:
            ctx.checked = []
            for kind, i, outputs in grad.checked:
                t = args[i] if kind == "input" else outs[i]
                if isinstance(t, torch.Tensor):
                    ctx.checked.append((t if kind == "input" else _detached(t), t._version,
                                        outputs))
        ctx.set_materialize_grads(False)
        ctx.outs = [(outs[i].shape, outs[i].dtype, outs[i].device) for i in grad.tangents]
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outs)
                                      if i not in grad.tangents and isinstance(o, torch.Tensor)))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():  # create_graph=True: these grads would be constants
            raise RuntimeError(
                "fxlite: a compiled group's backward is differentiable only once, but it ran "
                "with create_graph=True (double backward); compute higher-order gradients "
                "of this part without fxlite")
        variant = ctx.variant
        grad = variant.grad
        tensors = iter(ctx.saved_tensors)
        saved = [next(tensors) if v is None else v for v in ctx.plain]
        used = [grads[i] is not None for i in grad.tangents]
        reached = frozenset().union(*(s for s, u in zip(grad.sources, used) if u))
        if not reached:
            return (None,) * (3 + len(ctx.inputs))
        tangents = [grads[i] if u else variant.zeros(shape, dtype, device)
                    for i, u, (shape, dtype, device) in zip(grad.tangents, used, ctx.outs)]
        backward = variant.backward_for(used)
        if ctx.versions is not None:
            _check_versions(saved, ctx.versions, variant.needs(used))
        if ctx.checked is not None:  # as eager's backward of the op that saved each
            _check_versions([t for t, _, _ in ctx.checked], [v for _, v, _ in ctx.checked],
                            [k for k, (_, _, outputs) in enumerate(ctx.checked)
                             if any(grads[i] is not None for i in outputs)])
        results = backward(*saved, *tangents)
        if not all(used):  # a gradient that is a shared zero tangent (or a view of one)
            # would be written by whoever accumulates it: give a copy
            shared = {t.untyped_storage().data_ptr() for t, u in zip(tangents, used) if not u}
            results = [r.clone() if isinstance(r, torch.Tensor)
                       and r.untyped_storage().data_ptr() in shared else r for r in results]
        out: list[Any] = [None, None, None]
        for i, spec in enumerate(ctx.inputs):
            k = grad.grads[i]
            if i not in reached:
                out.append(None)
            elif k is not None and results[k] is not None:
                g = results[k]
                out.append(g if g.shape == spec[0] else g.expand(spec[0]))
            elif i in grad.zero_grads or k is not None:  # (zero: without_tangents)
                out.append(torch.zeros(spec[0], dtype=spec[1], device=spec[2]))
            else:
                out.append(None)
        return tuple(out)


try:  # Function.apply, less its Python: the C apply (one group call's host time -15%)
    _C_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _GroupFunction)
    _TRANSFORMS = torch._C._are_functorch_transforms_active
except (AttributeError, KeyError):  # another torch: the public apply
    _C_APPLY, _TRANSFORMS = None, None


def _apply() -> Any:
    """``_GroupFunction.apply``, or where no functorch transform (vmap, grad) is active,
    the C apply it ends in: it skips the Python around it (``inspect``'s check for a
    ``setup_context``, which the group lacks, and the unwrapping of dead functorch
    wrappers, which only a tensor leaked out of a finished transform is)."""
    if _C_APPLY is None or _TRANSFORMS():
        return _GroupFunction.apply
    return _C_APPLY


_NO_GRAD = object()  # a variant key whose tensors need no gradient: the inference kernel


def backward_untraced() -> None:
    """Run the fused groups' backward with Dynamo off, from now on (the Dynamo backend
    calls it, with ``torch._dynamo`` imported).

    Why: Dynamo compiles each Python frame entered while it runs the Python of a graph
    break, and ``loss.backward()`` inside a compiled step is one: the autograd engine
    enters this backward there, and Dynamo traced into it, into fxlite's kernel checks
    and Triton's interpreter, graph-breaking at every step (a two-layer step did not
    finish its first call in 100 s on the CPU)."""
    backward = _GroupFunction.__dict__["backward"].__func__
    if not getattr(backward, "_fxlite_untraced", False):
        untraced = torch._dynamo.disable(backward, recursive=True)
        untraced._fxlite_untraced = True
        _GroupFunction.backward = staticmethod(untraced)


def _hooked_leaf(args: tuple) -> bool:
    """Whether a parameter (a leaf that requires grad) among ``args`` has a gradient hook.

    A region's backward hands back the gradients of parameters that eager computes in
    nodes of their own, one after another: a hook that raises on the last layer's weight
    (a non-finite check) stopped eager's backward before the first layer's gradient was
    made, while the region's had made them all, and the engine stored the first layer's.
    Such calls run the region's ops under eager autograd."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf and (
                a._backward_hooks or a._post_accumulate_grad_hooks):
            return True
    return False


class AutogradGroup:
    """A fused group callable under autograd (see the module docstring).

    Attributes:
        group: the group's GraphModule (runs eagerly where no kernel can).
        name: used in kernel names.
    """

    def __init__(self, group: GraphModule, name: str = "group") -> None:
        self.group = group
        self.name = name
        self._fallbacks: list[str] = []
        self._plain: CompiledGraph | None = None
        self._variants: dict[tuple, _Variant | None] = {}
        self._lock = threading.Lock()
        self._views: dict[int, int] | None = None
        # a region merges ops that eager's autograd runs as nodes of their own
        self._merges = getattr(group, "meta", {}).get("fused_kind") == "region"
        self._last: tuple[LayoutCheck, Any] | None = None  # the last layout and its variant
        self._checks_left = _CHECKS

    @property
    def __name__(self) -> str:  # generated forward code calls the callable by this name
        return self.name

    def _parts(self) -> list[CompiledGraph]:
        parts = [self._plain] if self._plain is not None else []
        for v in list(self._variants.values()):
            if isinstance(v, _Variant):
                parts += v.parts()
        return parts

    @property
    def kernels(self) -> list[Any]:
        """Every kernel built so far, forward and backward (each has ``.direction``)."""
        return [k for p in self._parts() for k in p.kernels]

    @property
    def records(self) -> list[Any]:
        """A ``KernelRecord`` per kernel, for ``fxlite.codegen.report.kernel_report``."""
        return [r for p in self._parts() for r in p.records]

    @property
    def fallbacks(self) -> list[str]:
        """Why some call, or some part of one, runs eagerly."""
        return self._fallbacks + [f for p in self._parts() for f in p.fallbacks]

    def __call__(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._inference(args)
        last = self._last
        if last is not None and last[0](args):
            variant = last[1]  # the last call's layout: its variant (see _variant_of)
        else:
            variant = self._variant_of(args)
        if variant is _NO_GRAD:
            return self._inference(args)
        if variant is None or self._merges and _hooked_leaf(args):
            return self.group(*args)
        if self._views is None:
            self._views = output_views(self.group)
        views: dict[int, Any] = dict(self._views)
        # (none of the user's hooks, and hooks allowed: not under
        # `torch.autograd.graph.disable_saved_tensors_hooks`, where pushing one raises)
        if variant.checks_by_hand and _TOP_HOOKS(False) is None and _HOOKS_ON():
            _PUSH_HOOKS(_detached, _same)  # (the C calls: a `with` costs more host time)
            try:
                outs = _apply()(variant, views, True, *args)
            finally:
                _POP_HOOKS()
        else:
            outs = _apply()(variant, views, False, *args)
        if any(isinstance(v, tuple) for v in views.values()):
            outs = _remade_views(outs, views)
        return outs[0] if variant.grad.single else outs

    def _variant_of(self, args: tuple) -> Any:
        """The variant for ``args`` by its key (:func:`_signature`), built on first use.

        The key costs host time on every call (a region of a 2-layer GPT-2 takes 17
        arguments), so the call's layout is also kept in a :class:`LayoutCheck`, torch's
        C++ guard over the tensors' dtypes, devices, requires_grad, sizes and strides
        and the other arguments' types: a later call that passes it has this key. A
        training step calls each group with the same layouts on every step. Where they
        keep changing (a new sequence length each call), checks stop being made after
        ``_CHECKS`` of them and every call computes the key, as before."""
        key = _signature(args)
        variant = self._variants.get(key, False)
        if variant is False:
            with self._lock:
                variant = self._variants.get(key, False)
                if variant is False:
                    variant = self._build(args) if any(
                        isinstance(a, torch.Tensor) and a.requires_grad for a in args) \
                        else _NO_GRAD
                    if len(self._variants) < _MAX_VARIANTS:
                        self._variants[key] = variant
        if self._checks_left > 0 and key in self._variants:
            self._checks_left -= 1
            check = LayoutCheck(args)
            self._last = (check, variant) if check.ok else None
        else:
            self._last = None
        return variant

    def _inference(self, args: tuple) -> Any:
        if self._plain is None:
            with self._lock:
                if self._plain is None:
                    with torch.no_grad():
                        self._plain = CompiledGraph(_copy(self.group), args, "forward", self.name)
        with torch.no_grad():
            return self._plain(*args)

    def _build(self, args: tuple) -> _Variant | None:
        try:
            grad = differentiate(self.group, args)
            return _Variant(grad, args, self.name)
        except NotDifferentiable as e:
            reason = str(e)
        except Exception as e:  # a failure to compile must never break a model
            if lint_failure(e):  # a pass broke its graph: in tests, fail there
                raise
            reason = f"{type(e).__name__}: {e}"
        self._fallbacks.append(f"{self.name} runs under eager autograd: {reason}")
        return None

    def report(self) -> str:
        """Print and return the table of forward and backward kernels."""
        text = kernel_report(self.records)
        print(text)
        return text


def make_autograd_group(group_gm: GraphModule, example_inputs: Sequence[Any] = (),
                        name: str = "group") -> AutogradGroup:
    """A callable to run a fused group with Triton kernels under autograd.

    Args:
        group_gm: a fused group (``fuse``'s ``fused_<i>`` submodule, after ``normalize``
            and ``decompose``), or any graph of canonical table ops with ShapeProp meta.
        example_inputs: optional: one value per placeholder; when given, the variant for
            them (forward and backward graphs, forward kernel on the first call) is built
            now rather than on the first call that needs gradients.
        name: prefix of the kernel names.

    Returns:
        An :class:`AutogradGroup`: call it with the group's inputs. It returns what the
        group returns; outputs carry ``grad_fn`` when an input requires grad (and grad
        mode is on). Its ``.kernels`` lists forward and backward kernels, each with
        ``.direction``; ``.fallbacks`` says what runs eagerly and why.

    Example::

        fused = fuse(gm)
        fn = make_autograd_group(fused.fused_0, [x, w, b], name="fused_0")
        y = fn(x, w, b); y.sum().backward()
    """
    group = AutogradGroup(group_gm, name)
    if example_inputs and torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in example_inputs):
        key = _signature(example_inputs)
        group._variants[key] = group._build(tuple(example_inputs))
    return group


def swap_in_autograd(fused: GraphModule) -> dict[str, AutogradGroup]:
    """Replace every ``fused_<i>`` call of ``fused`` (``fuse``'s result) by its
    :class:`AutogradGroup`; returns them by submodule name. ``fused`` is changed in place.

    Example::

        fused = fuse(gm)
        groups = swap_in_autograd(fused)
        fused(x).sum().backward()    # every group ran a forward and a backward kernel
    """
    groups: dict[str, AutogradGroup] = {}
    for node in fused.graph.nodes:
        if node.op != Opcode.CALL_MODULE or node.kwargs:
            continue
        sub = fused.get_submodule(node.target)
        if getattr(sub, "meta", {}).get("fused_kind"):
            target = node.target
            groups[target] = make_autograd_group(sub, (), name=target)
            node.op, node.target = Opcode.CALL_FUNCTION, groups[target]
            fused.delete_submodule(target)
    fused.recompile()
    return groups
