"""CatKernel: a cat group (``codegen/kernels/cat.py``) called like the group, one launch.

Its kernel bakes in sizes and strides, so one is made per layout of the inputs (their
``fingerprint``: shapes, strides, dtypes, alignment); a layout it cannot take runs the
group's eager ops::

    kernel = CatKernel(group, name="triton_cat_0")
    out = kernel(*inputs)          # == group(*inputs), in the layout eager gives it
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from fxlite.codegen.kernels.cat import BLOCK, CatSource, build_cat, cat_branches
from fxlite.codegen.kernels.emit import Unsupported
from fxlite.codegen.kernels.generate import interpreting
from fxlite.codegen.kernels.source import KernelArg
from fxlite.codegen.runtime.cache import load_module
from fxlite.codegen.runtime.launch import (
    SLOT,
    TRITON_OPTIONS,
    Binary,
    DirectLaunch,
    GroupResult,
    LastLaunch,
    fingerprint,
)

from fxlite import config
from fxlite.graph_module import GraphModule

__all__ = ["CatKernel"]

_MAX_LAYOUTS = 64
_WARPS = 4


class _Prepared(NamedTuple):
    src: CatSource
    fn: Any  # the JIT function (the interpreter runs it)
    binary: Binary | None  # its compiled binary (CUDA)
    grid: tuple[int, int, int]
    positions: tuple[int, ...]  # the group input of each kernel argument before the output
    plan: _Plan  # what a DirectLaunch of it reads


class _Plan(NamedTuple):
    """The part of a ``LaunchPlan`` a :class:`DirectLaunch` reads: the kernel's arguments
    (group inputs, then the output), and what the group returns (the output)."""

    args: list[KernelArg]
    results: list[GroupResult]
    structure: str


class CatKernel:
    """The kernel of a cat group, callable like the group.

    Attributes:
        name: the name generated code calls it by.
        nodes: names of the group's op nodes (the branches' ops, then the cat).
        kind: ``"cat"``.
        compilations: how many layouts have been given a kernel.
    """

    direction = "forward"
    kind = "cat"
    checked = False  # its binaries are not in the disk index: the check always runs

    def __init__(self, group: GraphModule, name: str, libdevice: bool | None = None) -> None:
        self.group = group
        self.name = name
        self.nodes = list(getattr(group, "meta", {}).get("nodes", []))
        self.branches, self.dim = cat_branches(group)
        out = next(n for n in group.graph.nodes if n.op == "output").args[0]
        self.dtype = out.meta["tensor_meta"].dtype
        self.libdevice = not interpreting() if libdevice is None else libdevice
        self.compilations = 0
        self._prepared: dict[tuple, _Prepared | None] = {}
        self._current: _Prepared | None = None
        self._lock = threading.Lock()
        # fingerprint of the inputs -> a prepared launch (GPU only): the straight line
        # (runtime/straight_line.py) binds it where the inputs' layouts are fixed
        self._direct: dict[tuple, DirectLaunch] | None = (
            None if interpreting() or not config.direct_launch() else {})

    @property
    def __name__(self) -> str:  # generated forward code calls the kernel by this name
        return self.name

    @property
    def source(self) -> str:
        """The Triton module source of the most recently made layout ('' before any)."""
        return self._current.src.text if self._current is not None else ""

    def prepare(self, inputs: Sequence[Any]) -> _Prepared | None:
        """The kernel for this layout of ``inputs``, made on first use; None where the
        generator refuses it (the group's eager ops run)."""
        key = fingerprint(inputs)
        found = self._prepared.get(key, False)
        if found is not False:
            return found
        with self._lock:
            found = self._prepared.get(key, False)
            if found is False:
                found = self._make(inputs)
                if len(self._prepared) >= _MAX_LAYOUTS:
                    self._prepared.clear()
                self._prepared[key] = found
        return found

    def _make(self, inputs: Sequence[Any]) -> _Prepared | None:
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        if not tensors or not (tensors[0].is_cuda or interpreting()):
            return None
        try:
            src, fn, positions, grid = self._source(inputs)
            binary = None
            if not interpreting():
                out = torch.empty_strided(src.shape, src.strides, dtype=self.dtype,
                                          device=tensors[0].device)
                binary = Binary(fn.warmup(*(inputs[g] for g in positions), out, grid=grid[:1],
                                          BLOCK=BLOCK, num_warps=_WARPS, **TRITON_OPTIONS))
        except Unsupported:
            return None
        except Exception:  # a compile that fails must never break a model: eager ops run
            return None
        self.compilations += 1
        plan = _Plan([*(KernelArg("scalar" if not isinstance(inputs[g], torch.Tensor) else "in",
                                  index=g) for g in positions),
                      KernelArg("out", index=0)], [GroupResult("out", 0)], "single")
        made = _Prepared(src, fn, binary, grid, positions, plan)
        self._current = made
        return made

    def _source(self, inputs: Sequence[Any]) -> tuple[CatSource, Any, tuple[int, ...],
                                                      tuple[int, int, int]]:
        src = build_cat(self.branches, self.dim, inputs, self.libdevice)
        positions = tuple(self.branches[k].inputs[i] for k, i in src.args)
        fn = load_module(src.text, "cat_kernel").cat_kernel
        return src, fn, positions, (max(1, -(-src.numel // BLOCK)), 1, 1)

    def planned_launch(self, inputs: Sequence[Any]) -> tuple | None:
        """The compile the first call with inputs of this layout makes, for the parallel
        precompile (``codegen/runtime/precompile.py``), which runs it ahead: ``(source_id,
        fn, args, grid, constexprs, num_warps)``, where ``args`` are the kernel's inputs
        and then its output, a meta tensor of the output's layout. ``inputs`` may be meta
        tensors; nothing is compiled. None where the generator refuses this layout."""
        try:
            src, fn, positions, grid = self._source(inputs)
        except Exception:  # refused, or failing: the first call finds out, and says so
            return None
        out = torch.empty_strided(src.shape, src.strides, dtype=self.dtype, device="meta")
        source_id = hashlib.sha256(src.text.encode()).hexdigest()
        return (source_id, fn, [*(inputs[g] for g in positions), out], grid[:1],
                {"BLOCK": BLOCK}, _WARPS)

    def __call__(self, *inputs: Any) -> torch.Tensor:
        if self._direct is not None:
            launch = self._direct.get(fingerprint(inputs))
            if launch is not None:
                return launch.fast(inputs)
        prepared = self.prepare(inputs)
        if prepared is None:
            return self.group(*inputs)
        src = prepared.src
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        out = torch.empty_strided(src.shape, src.strides, dtype=self.dtype, device=device)
        if not src.numel:
            return out
        args = [inputs[g] for g in prepared.positions]
        if prepared.binary is None:
            prepared.fn[prepared.grid[:1]](*args, out, BLOCK=BLOCK, num_warps=_WARPS,
                                            **TRITON_OPTIONS)
            return out
        values = [*args, out, BLOCK]
        prepared.binary.launch(prepared.grid, values, device.index or 0)
        if self._direct is not None:
            record = LastLaunch(prepared.binary, prepared.grid,
                                [SLOT if isinstance(v, torch.Tensor) else v for v in values])
            direct = DirectLaunch.build(prepared.plan, record, inputs, [out])
            if direct is not None and DirectLaunch.agrees(direct, inputs, [out]):
                if len(self._direct) >= _MAX_LAYOUTS:
                    self._direct.clear()
                self._direct[fingerprint(inputs)] = direct
        return out

    def bytes_moved(self, *inputs: Any) -> int:
        """Bytes read (each input once) plus written."""
        total = sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
        prepared = self.prepare(inputs)
        if prepared is not None:
            total += prepared.src.numel * self.dtype.itemsize
        return total

    def mark_checked(self) -> None:
        """(Nothing to record: see ``checked``.)"""

    def autotune(self, *inputs: Any, configs: Any = None) -> dict[str, Any]:
        """Nothing to tune: one block size."""
        return {}

    def tune_wide_rows(self, *inputs: Any) -> None:
        """Nothing to tune: no rows."""
        return None
