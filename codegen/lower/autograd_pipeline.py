"""The kernel pipeline for autodiff's graphs: decompose, ShapeProp, fuse, Triton.

:class:`CompiledGraph` takes a graph of canonical ops (a group's forward, or its backward
from ``codegen/lower/autodiff.py``) through ``BACKWARD_PASSES`` (``codegen/lower/pipeline.py``)
and the same kernel check as ``fxlite.compile``::

    graph ─ decompose ─ ShapeProp (meta tensors) ─ fuse ─ lone ops as groups ─┐
    first call: each group's kernel is generated, run and checked against eager;  │
    groups whose kernel is missing or disagrees run eagerly (``fallbacks`` says why) ◄┘
    later calls: a straight-line function per layout calls the kernels directly

Besides fuse's groups, every pointwise or reduction node that fuse leaves alone (a
reduction over leading dims, such as a bias gradient summed over the batch) becomes a
group of its own (``passes/fuse/lone_groups.py``), since the kernel generator handles
reductions over any dims.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from fxlite.codegen.kernels.generate import interpreting
from fxlite.codegen.lower.accuracy import TOLERANCE, check_group
from fxlite.codegen.lower.pipeline import BACKWARD_PASSES, Lowering, run_passes
from fxlite.codegen.report import KernelRecord
from fxlite.codegen.runtime.straight_line import StraightRunner

from fxlite.graph_module import GraphModule
from fxlite.interpreter import Interpreter
from fxlite.logs import log_kernel
from fxlite.node import Opcode

__all__ = ["CompiledGraph"]


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
        self.gm = run_passes(BACKWARD_PASSES, gm, Lowering(example_inputs))
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
        if not any(t.is_cuda for t in tensors) and not interpreting():
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
        # one straight-line function per layout of the arguments: the kernels' launches
        # are prepared, not looked up by fingerprint (codegen/runtime/straight_line.py)
        self._run = StraightRunner(self.gm)
        return result


class _KernelCheck(Interpreter):
    """Runs the fused graph once, building each group's kernel and checking it on the way
    (``accuracy.check_group``, as ``fxlite.compile``'s first call does)."""

    def __init__(self, owner: CompiledGraph) -> None:
        super().__init__(owner.gm)
        self.owner = owner
        self.kernels: dict[str, Any] = {}

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        sub = self.fetch_attr(target)
        if not getattr(sub, "meta", {}).get("fused_kind") or kwargs:
            return sub(*args, **kwargs)
        owner = self.owner
        checked = check_group(sub, args, f"{owner.name}_{target}", direction=owner.direction,
                              through=_least_precise(args))
        if checked.kernel is None:
            owner.fallbacks.append(f"{owner.direction} {target} "
                                   f"({', '.join(sub.meta.get('nodes', []))}) runs in eager: "
                                   f"{checked.reason}")
            return checked.expected
        kernel = checked.kernel
        self.kernels[target] = kernel
        owner.kernels.append(kernel)
        owner.records.append(KernelRecord.of(
            kernel, args, checked.got if checked.expected is None else checked.expected))
        log_kernel(kernel)  # a backward kernel is made by the first backward, not the compile
        return checked.got  # what later calls get from the kernel: the same values on every call


def _least_precise(args: Sequence[Any]) -> torch.dtype | None:
    """The floating dtype of least precision among the tensor arguments, if any: the
    check's ``through``. The eager reference runs the group op by op in its dtypes,
    rounding every half intermediate (``1 - o * o`` of a bf16 ``o`` near 1 cancels), while
    the kernel computes in fp32 and rounds once, as eager's own backward kernels do: a
    float32 gradient of bf16 values is only as close as bf16."""
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in TOLERANCE]
    return max(dtypes, key=lambda d: TOLERANCE[d].rtol, default=None)
