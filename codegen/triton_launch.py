"""Direct kernel launches: skip Triton's dispatcher for argument sets seen before.

Triton's JIT dispatcher re-binds and re-hashes every argument on each call (about 14 us
of host time on an H200 host). For an input fingerprint seen before, every integer
argument and the grid are known, so fxlite generates a straight-line launcher that
allocates the outputs and calls the compiled binary with only the tensors changing.
Each one is checked once against Triton's own launch before it is used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .triton import _Spec

__all__ = ["DIRECT_LAUNCH_PROBLEM", "_DirectLaunch", "_fingerprint"]

# Why the last attempt at a direct launch fell back to Triton's dispatcher, if one did.
DIRECT_LAUNCH_PROBLEM: str | None = None


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


class _DirectLaunch:
    """A launch prepared for one input fingerprint: allocate outputs, call the binary.

    Why: Triton's JIT dispatcher re-binds and re-hashes every argument on each call
    (about 14 us of host time); for a fingerprint already seen, every integer argument
    and the grid are known, so only the tensors' addresses change.
    """

    __slots__ = ("run", "function", "packed", "grid", "stream_of", "device", "template",
                 "tensor_slots", "out_specs", "results", "structure", "hooks", "compiled",
                 "fast")

    @classmethod
    def build(cls, spec: _Spec, inputs: Sequence[Any], outs: list[torch.Tensor]
              ) -> _DirectLaunch | None:
        record = spec.last_launch
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        if record is None or not tensors or not tensors[0].is_cuda:
            return None
        compiled, fn, grid, args, constexprs = record
        try:
            from triton import knobs

            names = list(fn.arg_names)
            values = list(args) + [constexprs[n] for n in names[len(args):]]
            self = cls()
            self.run = compiled.run
            self.function = compiled.function
            self.packed = compiled.packed_metadata
            self.hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
            self.compiled = compiled
        except Exception as e:  # another Triton version's internals: keep the JIT path
            global DIRECT_LAUNCH_PROBLEM
            DIRECT_LAUNCH_PROBLEM = f"{type(e).__name__}: {e}"
            return None
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.device = tensors[0].device.index or 0
        self.stream_of = torch._C._cuda_getCurrentRawStream
        # Inputs (tensors and scalars) and outputs change per call; sizes, strides and
        # counts are fixed by the fingerprint.
        self.template = values
        self.tensor_slots = [(k, "in" if desc[0] in ("in", "scalar") else "out", desc[1])
                             for k, desc in enumerate(spec.src.args)
                             if desc[0] in ("in", "scalar", "out")]
        self.out_specs = [(tuple(o.shape), o.dtype, o.device) for o in outs]
        self.results = spec.results
        self.structure = spec.plan.structure
        self.fast = self._generate()
        return self

    def _generate(self) -> Any:
        """A straight-line launcher for this fingerprint: constants inlined, no loops.

        Example of what it writes::

            def launch(inputs):
                if _enter is not None and _enter.calls:
                    return _general(inputs)
                o0 = _empty(_shape0, dtype=_dtype0, device=_device)
                _run(8, 1, 1, _stream(0), _function, _packed, None, None, None, inputs[0], o0, 1024, 1024)
                return o0
        """
        env: dict[str, Any] = {"_empty": torch.empty, "_run": self.run, "_stream": self.stream_of,
                               "_function": self.function, "_packed": self.packed,
                               "_enter": self.hooks[0], "_general": self.__call__}
        lines = ["def launch(inputs):",
                 "    if _enter is not None and getattr(_enter, 'calls', True):",
                 "        return _general(inputs)"]
        for j, (shape, dtype, device) in enumerate(self.out_specs):
            env[f"_shape{j}"], env[f"_dtype{j}"], env[f"_device{j}"] = shape, dtype, device
            lines.append(f"    o{j} = _empty(_shape{j}, dtype=_dtype{j}, device=_device{j})")
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
        if g[0]:
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
        """Run the direct launch once and compare it with the dispatcher's result.

        Why: it relies on Triton's launcher internals, which change between versions;
        a mismatch or an error keeps this kernel on Triton's own path.
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
            DIRECT_LAUNCH_PROBLEM = "a direct launch disagreed with Triton's own launch"
        return same

    def __call__(self, inputs: Sequence[Any]) -> Any:
        outs = [torch.empty(shape, dtype=dtype, device=device)
                for shape, dtype, device in self.out_specs]
        values = list(self.template)
        for k, tag, i in self.tensor_slots:  # inputs, scalars included, and outputs
            values[k] = inputs[i] if tag == "in" else outs[i]
        g = self.grid
        if g[0]:
            stream = self.stream_of(self.device)
            enter, leave = self.hooks
            if enter is not None and getattr(enter, "calls", True):
                # A launch hook (a profiler) gets what Triton's own launch would give it.
                meta = self.compiled.launch_metadata(g, stream, *values)
            else:  # no hook, or Triton's empty hook chain: skip building launch metadata
                enter = leave = meta = None
            self.run(g[0], g[1], g[2], stream, self.function, self.packed, meta, enter, leave,
                     *values)
        results = [inputs[i] if tag == "in" else outs[i] for tag, i in self.results]
        if self.structure == "single":
            return results[0]
        return tuple(results) if self.structure == "tuple" else results
