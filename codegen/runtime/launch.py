"""Launching compiled kernels: :class:`Binary` and the direct launches built on it.

A :class:`Binary` is one compiled kernel. It is launched through torch's own C++ launcher
(``torch._C._StaticCudaLauncher``, what inductor uses) when that can take it: Triton's
launcher is a C module that Triton builds with the system compiler on first use, once per
argument signature (about 0.25 s on an H200 host), and it initializes Triton's driver.
Otherwise, or while a Triton launch hook (a profiler) is installed, Triton launches it.

Triton's JIT dispatcher re-binds and re-hashes every argument on each call (about 14 us
of host time on an H200 host). For an input fingerprint seen before, every integer
argument and the grid are known, so fxlite generates a straight-line launcher
(:class:`_DirectLaunch`) that allocates the outputs and calls the binary with only the
tensors changing. Each one is checked once against the general launch before it is used.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fxlite.codegen.runtime.kernel import _Spec

__all__ = ["DIRECT_LAUNCH_PROBLEM", "SLOT", "Binary", "_DirectLaunch", "_fingerprint"]

# A tensor's place in a remembered launch (_Spec.last_launch): the launch keeps no tensor.
SLOT = object()

# Why the last attempt at a direct launch fell back to Triton's dispatcher, if one did.
DIRECT_LAUNCH_PROBLEM: str | None = None

# Triton signature types -> the argument codes of torch's static launcher.
_ARG_CODES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B",
              "u16": "H", "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f",
              "f32": "f", "fp64": "d"}


def _fingerprint(inputs: Sequence[Any]) -> tuple:
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


def _hooks() -> tuple[Any, Any]:
    from triton import knobs

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
        if launcher is None or os.environ.get("FXLITE_STATIC_LAUNCH") == "0":
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
        key: its entry in the disk index (see triton_binaries.py).
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


class _DirectLaunch:
    """A launch prepared for one input fingerprint: allocate outputs, call the binary.

    Why: Triton's JIT dispatcher re-binds and re-hashes every argument on each call
    (about 14 us of host time); for a fingerprint already seen, every integer argument
    and the grid are known, so only the tensors' addresses change.
    """

    __slots__ = ("binary", "grid", "stream_of", "device", "template", "tensor_slots",
                 "out_specs", "results", "structure", "hooks", "fast", "like")

    @classmethod
    def build(cls, spec: _Spec, inputs: Sequence[Any], outs: list[torch.Tensor]
              ) -> _DirectLaunch | None:
        record = spec.last_launch
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
        self.tensor_slots = [(k, "in" if desc[0] in ("in", "scalar") else "out", desc[1])
                             for k, desc in enumerate(spec.src.args)
                             if desc[0] in ("in", "scalar", "out")]
        slots = {k for k, _, _ in self.tensor_slots}
        if any(v is SLOT for k, v in enumerate(values) if k not in slots):
            return None  # a tensor the launch would have to keep: the general path
        # Outputs may be permuted views (a kernel run in its inputs' memory order): the
        # launch allocates them with those strides; only their addresses reach the binary.
        self.out_specs = [(tuple(o.shape), o.stride(), o.dtype, o.device) for o in outs]
        # An output laid out exactly like an input is allocated with empty_like(input):
        # about half the host time of torch.empty(shape, dtype=, device=).
        self.like = {}
        for j, o in enumerate(outs):
            for i, t in enumerate(inputs):
                if (isinstance(t, torch.Tensor) and t.shape == o.shape and t.dtype == o.dtype
                        and t.device == o.device and t.stride() == o.stride()
                        and _dense(t)):
                    self.like[j] = i
                    break
        self.results = spec.results
        self.structure = spec.plan.structure
        self.fast = self._generate()
        return self

    def _generate(self) -> Any:
        """A straight-line launcher for this fingerprint: constants inlined, no loops.

        Example of what it writes, for torch's static launcher::

            def launch(inputs):
                if _enter is not None and getattr(_enter, 'calls', True):
                    return _general(inputs)
                o0 = _empty_like(inputs[0])
                _launch(_function, 8, 1, 1, 4, 0, 'OOi', (inputs[0], o0, 1024), _stream(0))
                return o0

        and for Triton's launcher (``_run``), the same with Triton's argument list.
        """
        binary = self.binary
        env: dict[str, Any] = {"_empty": torch.empty, "_stream": self.stream_of,
                               "_enter": self.hooks[0], "_general": self.__call__}
        lines = ["def launch(inputs):",
                 "    if _enter is not None and getattr(_enter, 'calls', True):",
                 "        return _general(inputs)"]
        env["_empty_like"] = torch.empty_like
        env["_empty_strided"] = torch.empty_strided
        for j, (shape, stride, dtype, device) in enumerate(self.out_specs):
            if j in self.like:  # the fingerprint fixes that input's layout
                lines.append(f"    o{j} = _empty_like(inputs[{self.like[j]}])")
                continue
            env[f"_shape{j}"], env[f"_dtype{j}"], env[f"_device{j}"] = shape, dtype, device
            if stride == _contiguous_strides(shape):
                lines.append(f"    o{j} = _empty(_shape{j}, dtype=_dtype{j}, device=_device{j})")
            else:
                env[f"_stride{j}"] = stride
                lines.append(f"    o{j} = _empty_strided(_shape{j}, _stride{j}, dtype=_dtype{j}, "
                             f"device=_device{j})")
        slots = {k: (f"inputs[{i}]" if tag == "in" else f"o{i}") for k, tag, i in self.tensor_slots}
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
        results = [f"inputs[{i}]" if tag == "in" else f"o{i}" for tag, i in self.results]
        if self.structure == "single":
            lines.append(f"    return {results[0]}")
        else:
            body = ", ".join(results) + ("," if len(results) == 1 else "")
            lines.append(f"    return ({body})" if self.structure == "tuple" else f"    return [{body}]")
        exec(compile("\n".join(lines) + "\n", "<fxlite-direct-launch>", "exec"), env)
        return env["launch"]

    @staticmethod
    def agrees(direct: _DirectLaunch, inputs: Sequence[Any], spec: _Spec,
               outs: list[torch.Tensor]) -> bool:
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
        want = [inputs[i] if tag == "in" else outs[i] for tag, i in spec.results]
        same = all(torch.equal(g, w) or (g.is_floating_point() and torch.allclose(
            g, w, equal_nan=True, rtol=0, atol=0)) for g, w in zip(got, want))
        if not same:
            DIRECT_LAUNCH_PROBLEM = "a direct launch disagreed with the general launch"
        return same

    def __call__(self, inputs: Sequence[Any]) -> Any:
        """The general launch (also when a launch hook is installed)."""
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in self.out_specs]
        values = list(self.template)
        for k, tag, i in self.tensor_slots:  # inputs, scalars included, and outputs
            values[k] = inputs[i] if tag == "in" else outs[i]
        if self.grid[0]:
            self.binary.launch(self.grid, values, self.device)
        results = [inputs[i] if tag == "in" else outs[i] for tag, i in self.results]
        if self.structure == "single":
            return results[0]
        return tuple(results) if self.structure == "tuple" else results


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (some permutation of it is contiguous): what
    ``empty_like`` reproduces stride for stride."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1)
    step = 1
    for s, n in dims:
        if s != step:
            return False
        step *= n
    return True
