"""Launching compiled kernels: the :class:`LaunchPlan` of a specialization, the
:class:`Binary` it compiles to, and the direct launches built on it.

A :class:`LaunchPlan` is what a launch needs to know about a generated kernel, fixed when
it is generated: its arguments, its outputs' layout, what the group returns, and which
dims a launch runs over. It allocates the outputs and computes every argument for a call.

A :class:`Binary` is one compiled kernel. It is launched through torch's own C++ launcher
(``torch._C._StaticCudaLauncher``, what inductor uses) when that can take it: Triton's
launcher is a C module that Triton builds with the system compiler on first use, once per
argument signature (about 0.25 s on an H200 host), and it initializes Triton's driver.
Otherwise, or while a Triton launch hook (a profiler) is installed, Triton launches it.

Triton's JIT dispatcher re-binds and re-hashes every argument on each call (about 14 us
of host time on an H200 host). For an input fingerprint seen before, every integer
argument and the grid are known, so fxlite generates a straight-line launcher
(:class:`DirectLaunch`) that allocates the outputs and calls the binary with only the
tensors changing. Each one is checked once against the general launch before it is used.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from fxlite.codegen.kernels.analysis import Plan, computed_outputs
from fxlite.codegen.kernels.layout import dense_strides
from fxlite.codegen.kernels.source import KernelArg, KernelSource, division_magic

from fxlite import config

__all__ = ["BINARIES", "DIRECT_LAUNCH_PROBLEM", "SLOT", "TRITON_OPTIONS", "Binary", "DirectLaunch",
           "GroupResult", "LastLaunch", "LaunchPlan", "TensorSlot", "fingerprint", "same_values",
           "slices"]

# A tensor's place in a remembered launch (LastLaunch.values): the launch keeps no tensor.
SLOT = object()

# The Triton options of every kernel fxlite compiles or launches through Triton, beside
# ``num_warps``. FP fusion (a * b + c as one rounded FMA) stays on, as Triton <= 3.9 and
# inductor have it: Triton 3.9 warns when a compile leaves it unset, and 3.10 turns it off
# by default, which would change fxlite's rounding and speed with the Triton version. A
# user who sets TRITON_DEFAULT_FP_FUSION (or TRITON_FORCE_DISABLE_FP_FUSION) decides.
TRITON_OPTIONS: dict[str, Any] = (
    {} if os.environ.get("TRITON_DEFAULT_FP_FUSION") is not None else {"enable_fp_fusion": True})

# binary_key -> Binary, for this process (binaries.py keeps the index on disk)
BINARIES: dict[str, Binary] = {}

# Allocators without torch.empty's Python argument parsing, by device type: what
# inductor's generated code calls. On an H200 host a tensor took 2.5 us this way, against
# 6.6 for torch.empty(shape, dtype=, device=), 4.4 for empty_strided and 3.9 for
# empty_like. A CUDA one allocates on the current device.
try:
    _ALLOCATE: dict[str, Any] = {
        kind: found for kind in ("cuda", "cpu")
        if (found := getattr(torch._C._dynamo.guards, f"_empty_strided_{kind}", None))}
except AttributeError:  # a torch without them
    _ALLOCATE = {}


def _allocator(device: torch.device) -> Callable[[tuple, tuple, torch.dtype], torch.Tensor]:
    """``allocate(shape, stride, dtype)`` of an empty tensor on ``device``: the one of
    :data:`_ALLOCATE` (for CUDA: while ``device`` is the current device), else
    ``torch.empty_strided``."""
    found = _ALLOCATE.get(device.type)
    if found is not None:
        return found
    return lambda shape, stride, dtype: torch.empty_strided(shape, stride, dtype=dtype,
                                                            device=device)


# Why the last attempt at a direct launch fell back to Triton's dispatcher, if one did.
DIRECT_LAUNCH_PROBLEM: str | None = None

# Triton signature types -> the argument codes of torch's static launcher.
_ARG_CODES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B",
              "u16": "H", "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f",
              "f32": "f", "fp64": "d"}


class GroupResult(NamedTuple):
    """One value a group returns: input ``index`` itself (``source == "in"``) or the
    kernel's output ``index`` (``source == "out"``)."""

    source: Literal["in", "out"]
    index: int


class TensorSlot(NamedTuple):
    """A kernel argument that changes per call in a :class:`DirectLaunch`: argument
    ``position`` is input ``index`` (``source == "in"``, scalars included) or output
    ``index`` (``source == "out"``)."""

    position: int
    source: Literal["in", "out"]
    index: int


def fingerprint(inputs: Sequence[Any]) -> tuple:
    """Everything a launch's arguments and Triton's specialization depend on.

    Exact sizes and strides fix every integer argument; dtype and device fix the
    signature; 16-byte alignment is what Triton specializes pointers on; Python ints
    are specialized by Triton on 32- vs 64-bit range.
    """
    fp: list[Any] = []
    for t in inputs:
        if isinstance(t, torch.Tensor):
            fp.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0))
        elif type(t) is int:
            fp.append((int, -(2**31) <= t < 2**31))
        else:
            fp.append(type(t))
    return tuple(fp)


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """How to launch one generated specialization, read once from its plan and source.

    Attributes:
        args: the kernel's runtime arguments, in signature order (``KernelSource.args``).
        variants: the kernel's functions (``"pointwise"``, ``"rows"``, ``"transpose"``,
            ``"persistent"``, ``"looped"``).
        tile: the dims a ``"transpose"`` variant's tiles run along (``KernelSource.tile``).
        results: what the group returns, in order (:class:`GroupResult`): an input itself
            or one of the kernel's outputs.
        structure: ``"single"``, ``"tuple"`` or ``"list"``: how the results are returned.
        out_layout: per output, ``(dims, span, dtype, layout)``: the iteration dims it
            occupies, those it varies along, its dtype and eager's layout (None: contiguous).
        pointwise: a pointwise kernel (else a reduction).
        inner: the dim a pointwise rows launch runs along.
        red: the reduced dims that are not size 1 for every input.
        kept: the dims not reduced.
        row_config: a reduction launches as row kernels (see ``_Spec.config``).
        row_inputs: the tensors read whole (every row and column): they set the
            registers a row needs.
        needs_nonempty: an ``amax``/``amin`` that raises on an empty reduction, as eager.
    """

    args: list[KernelArg]
    variants: frozenset[str]
    tile: tuple[tuple[int, ...], tuple[int, ...]] | None
    results: list[GroupResult]
    structure: str
    out_layout: list[tuple[tuple[int, ...], frozenset[int], torch.dtype, Any]]
    pointwise: bool
    inner: int
    red: list[int]
    kept: list[int]
    row_config: bool
    row_inputs: int
    needs_nonempty: bool

    @classmethod
    def of(cls, plan: Plan, src: KernelSource) -> LaunchPlan:
        """The launch plan of ``plan``'s kernel ``src``."""
        outs = computed_outputs(plan)
        slot = {id(v): j for j, v in outs}
        nt = [d for d in range(plan.rank) if d not in plan.trivial]
        red = [d for d in nt if d in plan.reduced]
        kept_nt = [d for d in nt if d not in plan.reduced]
        trailing = not kept_nt or not red or max(kept_nt) < min(red)
        return cls(
            args=src.args, variants=frozenset(src.functions), tile=src.tile,
            results=[GroupResult("in", v.index) if v.kind == "input"
                     else GroupResult("out", slot[id(v)]) for v in plan.outputs],
            structure=plan.structure,
            out_layout=[(tuple(v.dims), v.span, v.dtype, v.layout) for _, v in outs],
            pointwise=plan.kind == "pointwise",
            inner=nt[-1] if nt else 0,
            red=red,
            kept=[d for d in range(plan.rank) if d not in plan.reduced],
            # Launch as row kernels also when the innermost dim is reduced (a batch norm's
            # sums over N, H, W): kept rows are then far apart in memory, and packing many
            # per program (the config for reductions over leading dims) starves the GPU: on
            # an H200 these sums took 0.26 ms each, 75% of resnet18's training-step kernel
            # time.
            row_config=(trailing or (bool(nt) and nt[-1] in red))
            and not _kept_innermost(plan, kept_nt),
            row_inputs=sum(1 for p in plan.patterns if p is not None and nt and all(
                p[d] == "s" for d in nt)),
            needs_nonempty=any(v.kind == "reduce" and v.op in ("max", "min")
                               and not v.empty_ok for v in plan.values))

    def allocate(self, shape: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
        """The outputs for iteration space ``shape``, each in eager's layout."""
        outs = []
        for dims, span, dtype, layout in self.out_layout:
            size = [shape[d] if d in span else 1 for d in dims]
            if layout is None:
                outs.append(torch.empty(size, dtype=dtype, device=device))
            else:  # eager's layout for these inputs (kernels/layout.eager_layout)
                outs.append(torch.empty_strided(size, dense_strides(size, layout),
                                                dtype=dtype, device=device))
        return outs

    def arguments(self, inputs: Sequence[Any], outs: list[torch.Tensor],
                  shape: tuple[int, ...], counts: dict[str, int]) -> list[Any]:
        """Every runtime argument's value, in signature order, for one launch."""
        r = len(shape)
        vals: list[Any] = []
        for a in self.args:
            kind = a.kind
            if kind == "in" or kind == "scalar":
                vals.append(inputs[a.index])
            elif kind == "out":
                vals.append(outs[a.index])
            elif kind == "size":
                vals.append(max(shape[a.dim], 1))
            elif kind == "size_m" or kind == "size_s":
                vals.append(division_magic(max(shape[a.dim], 1))[kind == "size_s"])
            elif kind == "stride":
                t = inputs[a.index]
                vals.append(t.stride(a.dim - (r - t.dim())))
            elif kind == "ostride":
                dims = self.out_layout[a.index][0]
                vals.append(outs[a.index].stride(dims.index(a.dim)))
            else:  # a count
                vals.append(counts[a.name])
        return vals

    def skips_outputs(self, shape: tuple[int, ...]) -> bool:
        """Whether a launch for iteration space ``shape`` would compute nothing though an
        output has elements: a 0-dim output of a group whose other tensors became empty
        (``b.sub_(b)`` next to ``clamp(b, x, x)`` for an empty ``x``). Such calls run the
        group's ops instead, or that output would hold whatever memory it was given."""
        if math.prod(shape) != 0:
            return False
        if not self.pointwise and math.prod(
                n for d, n in enumerate(shape) if d not in self.red) != 0:
            return False  # rows to reduce (over nothing): every output is written
        return any(math.prod(shape[d] for d in dims if d in span) != 0
                   for dims, span, _, _ in self.out_layout)

    def returned(self, inputs: Sequence[Any], outs: Sequence[Any]) -> Any:
        """What the group returns, given its inputs and the kernel's outputs."""
        return _returned(self.results, self.structure, inputs, outs)


def _returned(results: list[GroupResult], structure: str, inputs: Sequence[Any],
              outs: Sequence[Any]) -> Any:
    values = [inputs[i] if source == "in" else outs[i] for source, i in results]
    if structure == "single":
        return values[0]
    return tuple(values) if structure == "tuple" else values


def _kept_innermost(plan: Plan, kept: list[int]) -> bool:
    """Whether a full-size input lies with a kept dim innermost in memory (a channels-last
    tensor summed over H and W): its rows are then adjacent, its columns strided."""
    for entry in plan.key[1]:  # per input: (dtype, pattern, dense, stride order) or a type
        if isinstance(entry, tuple) and entry[3] and all(
                entry[1][d] == "s" for d in range(plan.rank) if d not in plan.trivial):
            return entry[3][-1] in kept
    return False


def _hooks() -> tuple[Any, Any]:
    from triton import knobs  # Triton's import cost: only once a kernel launches

    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _hooked(enter: Any) -> bool:
    # Triton's hook chain is an object that is empty until someone adds a hook.
    return enter is not None and bool(getattr(enter, "calls", True))


class _Static:
    """A binary loaded through ``torch._C._StaticCudaLauncher``."""

    __slots__ = ("launch_kernel", "load_kernel", "path", "name", "num_warps", "shared",
                 "codes", "keep", "extra", "functions")

    @classmethod
    def make(cls, compiled: Any) -> _Static | None:
        """The static launch of ``compiled``, or None when torch's launcher cannot take it."""
        launcher = getattr(torch._C, "_StaticCudaLauncher", None)
        if launcher is None or not config.static_launch():
            return None
        try:
            md = compiled.metadata
            if getattr(md, "num_ctas", 1) != 1 or any(
                    getattr(md, a, 0) for a in ("global_scratch_size", "profile_scratch_size")):
                return None
            path = next(p for k, p in compiled.metadata_group.items() if k.endswith(".cubin"))
            names = list(compiled.src.fn.arg_names)
            sig, constants = compiled.src.signature, compiled.src.constants
            self = cls()
            self.keep, self.codes = [], ""
            for i, name in enumerate(names):
                ty = sig.get(name, sig.get(i))
                if ty is None or ty == "constexpr" or (i,) in constants or name in constants:
                    continue  # compiled into the binary: not a launch argument
                self.keep.append(i)
                self.codes += "O" if ty.startswith("*") else _ARG_CODES[ty]
            # Newer Triton adds scratch-buffer parameters; unused ones take a null pointer.
            self.extra = sum(hasattr(md, a) for a in ("global_scratch_size",
                                                        "profile_scratch_size"))
            self.codes += "O" * self.extra
        except Exception:  # another Triton version's metadata: Triton launches it
            return None
        self.launch_kernel, self.load_kernel = launcher._launch_kernel, launcher._load_kernel
        self.path, self.name = path, md.name
        self.num_warps, self.shared = md.num_warps, md.shared
        self.functions: dict[int, int] = {}
        return self

    def function(self, device: int) -> int:
        found = self.functions.get(device)
        if found is None:
            loaded = self.load_kernel(self.path, self.name, self.shared, device)
            # (function, n_regs, n_spills), or (module, function, ...) in newer torch
            found = self.functions[device] = loaded[1] if len(loaded) == 4 else loaded[0]
        return found

    def arguments(self, values: Sequence[Any]) -> tuple:
        return tuple(values[i] for i in self.keep) + (None,) * self.extra


class Binary:
    """One compiled kernel (a Triton ``CompiledKernel``) and how fxlite launches it.

    Attributes:
        compiled: Triton's CompiledKernel.
        static: the torch static launch, or None (Triton launches it).
        checked: its output has matched eager PyTorch (in this process or, through the
            disk index, an earlier one).
        key: its entry in the disk index (see binaries.py).
    """

    __slots__ = ("compiled", "static", "checked", "key")

    def __init__(self, compiled: Any, checked: bool = False, key: str = "") -> None:
        self.compiled = compiled
        self.static = _Static.make(compiled)
        self.checked = checked
        self.key = key  # its entry in the disk index

    def launch(self, grid: tuple[int, int, int], values: Sequence[Any], device: int) -> None:
        """Launch on the current stream; ``values`` has every parameter, constexprs too."""
        static = self.static
        if static is not None and not _hooked(_hooks()[0]):
            try:
                static.launch_kernel(static.function(device), grid[0], grid[1], grid[2],
                                     static.num_warps, static.shared, static.codes,
                                     static.arguments(values),
                                     torch._C._cuda_getCurrentRawStream(device))
                return
            except Exception as e:  # a torch whose launcher differs: Triton's from now on
                global DIRECT_LAUNCH_PROBLEM
                DIRECT_LAUNCH_PROBLEM = f"static launch: {type(e).__name__}: {e}"
                self.static = None
        self.compiled[grid](*values)


class LastLaunch(NamedTuple):
    """A specialization's latest GPU launch, what a :class:`DirectLaunch` repeats.

    Not its tensors: each is :data:`SLOT`, filled per call (keeping them kept each
    kernel's last inputs and outputs alive between calls).
    """

    binary: Binary
    grid: tuple[int, int, int]
    values: list[Any]  # every argument value, constexprs too, SLOT for each tensor


class DirectLaunch:
    """A launch prepared for one input fingerprint: allocate outputs, call the binary.

    Why: Triton's JIT dispatcher re-binds and re-hashes every argument on each call
    (about 14 us of host time); for a fingerprint already seen, every integer argument
    and the grid are known, so only the tensors' addresses change.
    """

    __slots__ = ("binary", "grid", "stream_of", "device", "template", "tensor_slots",
                 "out_specs", "results", "structure", "hooks", "fast")

    @classmethod
    def build(cls, plan: LaunchPlan, record: LastLaunch | None, inputs: Sequence[Any],
              outs: list[torch.Tensor]) -> DirectLaunch | None:
        """The direct launch repeating ``record`` (a specialization's latest GPU launch)
        for these inputs' fingerprint, or None where the general path must run."""
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        if record is None or not tensors or not tensors[0].is_cuda:
            return None
        binary, grid, values = record
        try:
            self = cls()
            self.hooks = _hooks()
            if binary.static is None:  # Triton's launcher: check that its handles load
                binary.compiled.run  # noqa: B018
        except Exception as e:  # another Triton version's internals: keep the JIT path
            global DIRECT_LAUNCH_PROBLEM
            DIRECT_LAUNCH_PROBLEM = f"{type(e).__name__}: {e}"
            return None
        self.binary = binary
        self.grid = grid
        self.device = tensors[0].device.index or 0
        self.stream_of = torch._C._cuda_getCurrentRawStream
        # Inputs (tensors and scalars) and outputs change per call; sizes, strides and
        # counts are fixed by the fingerprint.
        self.template = values
        self.tensor_slots = [TensorSlot(k, "in" if a.kind in ("in", "scalar") else "out", a.index)
                             for k, a in enumerate(plan.args)
                             if a.kind in ("in", "scalar", "out")]
        slots = {s.position for s in self.tensor_slots}
        if any(v is SLOT for k, v in enumerate(values) if k not in slots):
            return None  # a tensor the launch would have to keep: the general path
        # Outputs may be permuted views (a kernel run in its inputs' memory order): the
        # launch allocates them with those strides; only their addresses reach the binary.
        self.out_specs = [(tuple(o.shape), o.stride(), o.dtype, o.device) for o in outs]
        self.results = plan.results
        self.structure = plan.structure
        self.fast = self._generate()
        return self

    def _generate(self) -> Any:
        """A straight-line launcher for this fingerprint: constants inlined, no loops.

        Example of what it writes, for torch's static launcher::

            def launch(inputs):
                if _enter is not None and getattr(_enter, 'calls', True):
                    return _general(inputs)
                if _current() != 0:  # (CUDA: the allocator's device is the current one)
                    return _general(inputs)
                o0 = _allocate0(_shape0, _stride0, _dtype0)
                _launch(_function, 8, 1, 1, 4, 0, 'OOi', (inputs[0], o0, 1024), _stream(0))
                return o0

        and for Triton's launcher (``_run``), the same with Triton's argument list.
        """
        binary = self.binary
        env: dict[str, Any] = {"_stream": self.stream_of, "_enter": self.hooks[0],
                               "_general": self.__call__}
        lines = ["def launch(inputs):",
                 "    if _enter is not None and getattr(_enter, 'calls', True):",
                 "        return _general(inputs)"]
        # (CUDA's allocator allocates on the current device: else the general launch)
        for index in sorted({d.index or 0 for *_, d in self.out_specs
                             if d.type == "cuda" and "cuda" in _ALLOCATE}):
            env["_current"] = torch._C._cuda_getDevice
            lines += [f"    if _current() != {index}:", "        return _general(inputs)"]
        for j, (shape, stride, dtype, device) in enumerate(self.out_specs):
            env[f"_shape{j}"], env[f"_stride{j}"], env[f"_dtype{j}"] = shape, tuple(stride), dtype
            env[f"_allocate{j}"] = _allocator(device)
            lines.append(f"    o{j} = _allocate{j}(_shape{j}, _stride{j}, _dtype{j})")
        slots = {k: (f"inputs[{i}]" if source == "in" else f"o{i}")
                 for k, source, i in self.tensor_slots}
        args = []
        for k, v in enumerate(self.template):
            if k in slots:
                args.append(slots[k])
            elif type(v) in (int, bool) or (type(v) is float and math.isfinite(v)):
                args.append(repr(v))
            else:
                env[f"_c{k}"] = v
                args.append(f"_c{k}")
        g = self.grid
        if g[0] and binary.static is not None:
            static = binary.static
            env["_launch"], env["_function"] = static.launch_kernel, static.function(self.device)
            kept = [args[i] for i in static.keep] + ["None"] * static.extra
            lines.append(f"    _launch(_function, {g[0]}, {g[1]}, {g[2]}, {static.num_warps}, "
                         f"{static.shared}, {static.codes!r}, ({', '.join(kept)},), "
                         f"_stream({self.device}))")
        elif g[0]:
            compiled = binary.compiled
            env["_run"], env["_function"] = compiled.run, compiled.function
            env["_packed"] = compiled.packed_metadata
            lines.append(f"    _run({g[0]}, {g[1]}, {g[2]}, _stream({self.device}), _function, "
                         f"_packed, None, None, None, {', '.join(args)})")
        results = [f"inputs[{i}]" if source == "in" else f"o{i}" for source, i in self.results]
        if self.structure == "single":
            lines.append(f"    return {results[0]}")
        else:
            body = ", ".join(results) + ("," if len(results) == 1 else "")
            lines.append(f"    return ({body})" if self.structure == "tuple" else f"    return [{body}]")
        exec(compile("\n".join(lines) + "\n", "<fxlite-direct-launch>", "exec"), env)
        return env["launch"]

    @staticmethod
    def agrees(direct: DirectLaunch, inputs: Sequence[Any], outs: list[torch.Tensor]) -> bool:
        """Run the direct launch once and compare it with the general launch's result.

        Why: it inlines what the general launch computed per call; a mismatch or an
        error keeps this kernel on the general path.
        """
        global DIRECT_LAUNCH_PROBLEM
        try:
            got = direct.fast(inputs)
        except Exception as e:
            DIRECT_LAUNCH_PROBLEM = f"{type(e).__name__}: {e}"
            return False
        got = got if isinstance(got, (tuple, list)) else [got]
        want = [inputs[i] if source == "in" else outs[i] for source, i in direct.results]
        same = all(map(same_values, got, want))
        if not same:
            DIRECT_LAUNCH_PROBLEM = "a direct launch disagreed with the general launch"
        return same

    def __call__(self, inputs: Sequence[Any]) -> Any:
        """The general launch (also when a launch hook is installed)."""
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in self.out_specs]
        values = list(self.template)
        for k, source, i in self.tensor_slots:  # inputs, scalars included, and outputs
            values[k] = inputs[i] if source == "in" else outs[i]
        if self.grid[0]:
            self.binary.launch(self.grid, values, self.device)
        return _returned(self.results, self.structure, inputs, outs)


_SLICE = 1 << 22  # elements compared at a time (same_values)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values (NaN matching NaN), compared a slice
    (:func:`slices`) at a time.

    Why slices: comparing whole tensors makes a bool temporary of their size. At the first
    call of maxvit_t (f32, batch 32, H200) the direct launch's check of a 383 MiB output
    held 96 MiB of it at the call's peak.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return _same(a, b)
    return all(map(_same, slices(a, _SLICE), slices(b, _SLICE)))


def slices(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views that cover ``t``, each of at most ``limit`` elements (or one element); two
    tensors of one shape give matching slices."""
    if t.numel() <= limit or t.dim() == 0:
        yield t
        return
    d = max(range(t.dim()), key=t.size)
    for piece in t.split(max(1, t.size(d) * limit // t.numel()), d):
        yield from slices(piece, limit)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(
        a, b, equal_nan=True, rtol=0, atol=0))


