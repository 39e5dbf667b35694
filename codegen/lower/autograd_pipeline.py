"""The kernel pipeline for autodiff's graphs: decompose, ShapeProp, fuse, Triton.

:class:`CompiledGraph` takes a graph of canonical ops (a group's forward, or its backward
from ``fxlite.autodiff``) through the same stages as ``fxlite.compile``::

    graph ─ decompose ─ ShapeProp (meta tensors) ─ fuse ─ lone ops as groups ─┐
    first call: each group's kernel is generated, run and checked against eager;  │
    groups whose kernel is missing or disagrees run eagerly (``fallbacks`` says why) ◄┘
    later calls: the parent graph calls the kernels directly

Besides fuse's groups, every pointwise or reduction node that fuse leaves alone (a
reduction over leading dims, such as a bias gradient summed over the batch) becomes a
group of its own, since the kernel generator handles reductions over any dims.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from fxlite.codegen.lower.accuracy import HALF_TOLERANCE, allclose
from fxlite.codegen.report import KernelRecord

from fxlite.graph_module import GraphModule
from fxlite.interpreter import Interpreter
from fxlite.logs import log_kernel
from fxlite.node import Node, Opcode
from fxlite.ops import is_impure, lookup
from fxlite.ops.shapes import propagate

__all__ = ["CompiledGraph"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class CompiledGraph:
    """``gm`` compiled to Triton kernels where they are proven right; call it like ``gm``.

    Args:
        gm: canonical ops with ShapeProp-style meta (changed: it is decomposed in place).
        example_inputs: one per placeholder; tensors may be on the meta device (only their
            shapes, strides and dtypes are read here).
        direction: ``"forward"`` or ``"backward"``, given to each kernel's ``.direction``.
        name: prefix of the kernel names.

    Attributes:
        kernels: the kernels built by the first call.
        records: a :class:`~fxlite.codegen.report.KernelRecord` per kernel.
        fallbacks: why groups run eagerly.
    """

    def __init__(self, gm: GraphModule, example_inputs: Sequence[Any], direction: str,
                 name: str) -> None:
        from fxlite.passes.decompose import decompose
        from fxlite.passes.fuse import fuse

        gm = decompose(gm)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        propagate(gm, example_inputs)  # as ShapeProp, without running ops
        self.gm = fuse(gm)
        _lone_groups(self.gm)
        self.direction = direction
        self.name = name
        self.kernels: list[Any] = []
        self.records: list[KernelRecord] = []
        self.fallbacks: list[str] = []
        self._run: Any = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        run = self._run
        if run is None:
            with self._lock:  # threads racing on a first call build the kernels once
                if self._run is None:
                    return self._first(args)
                run = self._run
        return run(*args)

    def _first(self, args: tuple) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not any(t.is_cuda for t in tensors) and not _interpreting():
            self.fallbacks.append("no GPU tensors and TRITON_INTERPRET is not set")
            self._run = self.gm
            return self.gm(*args)
        check = _KernelCheck(self)
        result = check.run(*args)
        for node in self.gm.graph.nodes:
            if node.op == Opcode.CALL_MODULE and node.target in check.kernels:
                target = node.target
                node.op, node.target = Opcode.CALL_FUNCTION, check.kernels[target]
                self.gm.delete_submodule(target)
        self.gm.recompile()
        self._run = functools.partial(type(self.gm).forward, self.gm)
        return result


class _KernelCheck(Interpreter):
    """Runs the fused graph once, building each group's kernel and checking it on the way
    (the same check as ``fxlite.compile``'s first call)."""

    def __init__(self, owner: CompiledGraph) -> None:
        super().__init__(owner.gm)
        self.owner = owner
        self.kernels: dict[str, Any] = {}

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        sub = self.fetch_attr(target)
        if not getattr(sub, "meta", {}).get("fused_kind") or kwargs:
            return sub(*args, **kwargs)
        from fxlite.codegen.runtime.kernel import generate_kernel

        owner = self.owner
        try:
            kernel = generate_kernel(sub, list(args), name=f"{owner.name}_{target}")
        except Exception as e:  # the generator must never break a model: run eagerly
            kernel, reason = None, f"{type(e).__name__}: {e}"
        else:
            reason = "the kernel generator does not support it"
        # the kernel first, then eager's reference: the kernel's first call also checks
        # its direct launch (one more output), which must not meet the reference's
        # outputs too (three copies of a GPT-2 step's logits at once, 0.8 GiB each)
        got = failed = None
        if kernel is not None:
            kernel.direction = owner.direction
            try:
                got = kernel(*args)
            except Exception as e:
                failed = e
        expected = sub(*args)
        if kernel is not None:
            try:
                if failed is not None:
                    raise failed
                _assert_same(got, expected, _least_precise(args))
            except Exception as e:
                kernel, reason = None, f"its kernel disagreed with eager: {e}"
        if kernel is None:
            owner.fallbacks.append(f"{owner.direction} {target} "
                                   f"({', '.join(sub.meta.get('nodes', []))}) runs in eager: "
                                   f"{reason}")
            return expected
        self.kernels[target] = kernel
        owner.kernels.append(kernel)
        owner.records.append(KernelRecord.of(kernel, args, expected))
        log_kernel(kernel)  # a backward kernel is made by the first backward, not the compile
        return got  # what later calls get from the kernel: the same values on every call


_TOL = {**HALF_TOLERANCE, torch.float32: 1e-5, torch.float64: 1e-7}


def _least_precise(args: Sequence[Any]) -> torch.dtype | None:
    """The floating dtype of least precision among the tensor arguments, if any."""
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in _TOL]
    return max(dtypes, key=_TOL.__getitem__, default=None)


def _assert_same(got: Any, expected: Any, inputs: torch.dtype | None = None) -> None:
    """Raise unless ``got`` is ``expected`` up to rounding: at the tolerance of each
    result's dtype, or of ``inputs`` where that is looser. The eager reference runs the
    group op by op in its dtypes, rounding every half intermediate (``1 - o * o`` of a
    bf16 ``o`` near 1 cancels), while the kernel computes in fp32 and rounds once, as
    eager's own backward kernels do: a float32 gradient of bf16 values is only as close
    as bf16."""
    # (torch.testing.assert_close would import torch's meta kernels on first use: seconds)
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            raise AssertionError("output structure differs")
        for g, e in zip(got, expected):
            _assert_same(g, e, inputs)
        return
    if not isinstance(expected, torch.Tensor):
        if got != expected:
            raise AssertionError(f"{got!r} != {expected!r}")
        return
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError("shape or dtype differs")
    if not expected.is_floating_point():
        if not torch.equal(got, expected):
            raise AssertionError("values differ")
        return
    tol = max(_TOL.get(expected.dtype, 1e-5), _TOL.get(inputs, 0.0))
    if not allclose(got, expected, tol, tol):
        diff = (got.double() - expected.double()).abs().nan_to_num().max().item()
        raise AssertionError(f"values differ (max abs difference {diff:.3g})")


def _lone_groups(gm: GraphModule) -> None:
    """Make each pointwise or reduction node that fuse left outside a group a group.

    A reduction over leading dims (a bias gradient summed over the batch) also takes in
    the pointwise group that produces its input, when nothing else reads that group: one
    kernel then computes and reduces ``g * x_hat`` without writing it out. Sibling
    reductions (same op, arguments and input layout, inputs all ready before the first of
    them: a BatchNorm backward's three outer sums) share one kernel::

        a = sum(p, (0, 2, 3)); b = sum(q, (0, 2, 3))   ->   ab = lone_0(p, q); a, b = ab
    """
    from fxlite.passes.split_module import extract_subgraph, set_call_meta, unpack_outputs

    from fxlite.graph import Graph

    lone = [n for n in gm.graph.nodes
            if n.op in (Opcode.CALL_FUNCTION, Opcode.CALL_METHOD) and _lone_op(n, gm)]
    producers = {n: _sole_pointwise_producer(n, gm) for n in lone}
    count = 0
    for batch in _siblings([n for n in lone if producers[n] is None], gm) + [
            [n] for n in lone if producers[n] is not None]:
        node, producer = batch[0], producers[batch[0]]
        if producer is None:
            inputs = list(dict.fromkeys(i for n in batch for i in n.all_input_nodes))
            sub_graph, names = extract_subgraph(batch, inputs, batch), [n.name for n in batch]
        else:
            group = gm.get_submodule(producer.target)
            inputs = list(producer.all_input_nodes)
            sub_graph = Graph()
            made = sub_graph.graph_copy(group.graph, {})  # placeholders: the group's inputs
            reduced = sub_graph.node_copy(node, lambda n, made=made: made)
            sub_graph.output(reduced)
            names = [*group.meta.get("nodes", []), node.name]
        name = f"lone_{count}"
        while hasattr(gm, name):
            count += 1
            name = f"lone_{count}"
        count += 1
        sub = GraphModule(gm, sub_graph, class_name=name)
        sub.meta = {"fused_kind": lookup(node).kind, "nodes": names}
        gm.add_module(name, sub)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, tuple(inputs))
        if len(batch) == 1:
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
        else:
            set_call_meta(call, batch)
            items: dict[Node, Node] = {}
            with gm.graph.inserting_after(call):
                unpack_outputs(gm.graph, call, batch, items)
            for n in batch:
                n.replace_all_uses_with(items[n])
        for n in batch:
            gm.graph.erase_node(n)
        if producer is not None:
            target = producer.target
            gm.graph.erase_node(producer)
            gm.delete_submodule(target)
    gm.recompile()


def _siblings(nodes: list[Node], gm: GraphModule) -> list[list[Node]]:
    """``nodes`` in batches of sibling reductions (see ``_lone_groups``), in graph order."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    batches: list[list[Node]] = []
    open_: dict[tuple, list[Node]] = {}
    for n in nodes:
        key = _sibling_key(n, gm)
        batch = open_.get(key) if key is not None else None
        if batch is not None and all(position[i] < position[batch[0]]
                                     for i in n.all_input_nodes):
            batch.append(n)
            continue
        batches.append([n])
        if key is not None:
            open_[key] = batches[-1]
    return batches


def _sibling_key(n: Node, gm: GraphModule) -> tuple | None:
    info = lookup(n)
    if info.kind != "reduction" or len(n.all_input_nodes) != 1:
        return None
    src = n.all_input_nodes[0]
    tm, out = src.meta.get("tensor_meta"), n.meta.get("tensor_meta")
    if not hasattr(tm, "shape") or not hasattr(out, "shape"):
        return None
    rest = [a for a in n.args if a is not src]
    return (n.op, n.target, repr(rest), repr(sorted(n.kwargs.items())), tuple(tm.shape),
            tuple(tm.stride), tm.dtype, tuple(out.shape), out.dtype)


def _sole_pointwise_producer(node: Node, gm: GraphModule) -> Node | None:
    """The call of the pointwise group computing reduction ``node``'s input, if ``node``
    is its only reader and the group returns that one value."""
    if lookup(node).kind != "reduction" or len(node.all_input_nodes) != 1:
        return None
    src = node.all_input_nodes[0]
    if src.op != Opcode.CALL_MODULE or len(src.users) != 1:
        return None
    group = gm.get_submodule(src.target)
    meta = getattr(group, "meta", {})
    result = group.graph.result
    if meta.get("fused_kind") != "pointwise" or not isinstance(result, Node):
        return None
    return src


def _lone_op(node: Node, gm: GraphModule) -> bool:
    info = lookup(node)
    if info is None or info.kind not in ("pointwise", "reduction") or is_impure(node, gm):
        return False
    tm = node.meta.get("tensor_meta")
    if not hasattr(tm, "shape") or not all(
            hasattr(i.meta.get("tensor_meta"), "shape") or i.meta.get("type") in (int, float, bool)
            for i in node.all_input_nodes):
        return False
    return not any(isinstance(a, torch.Tensor) for a in (*node.args, *node.kwargs.values()))
