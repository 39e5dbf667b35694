"""Launch configs of row reductions (layer_norm, add+layer_norm, rms_norm, softmax) timed
one by one on the GPU, against the device's copy of the same tensor.

Run on a CUDA machine::

    PYTHONPATH=$PWD python benchmarks/sweep_row_configs.py

For each case, ``fxlite.compile`` builds the kernel; each config (persistent rows of 1 or
2 with 4 to 32 warps, looped chunks of 2048 or 4096 with 8 or 16 warps) is then launched
through the kernel's own runner and timed by ``triton.testing.do_bench``. Printed: the
heuristic's config and its percentage of copy (copy time over kernel time; add+layer_norm
moves 1.5 copies), the best config, and the next five. The figures behind
``codegen/kernels/config.wide_row_configs``.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import triton
import triton.testing
from fxlite.codegen.kernels.analysis import iteration_space
from fxlite.codegen.runtime import kernel as runtime_kernel

import fxlite

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import add_layer_norm, layer_norm, rms_norm, softmax  # noqa: E402

_SEEN: dict[str, tuple] = {}  # kernel name -> the inputs of its latest call
_CALL = runtime_kernel.TritonKernel.__call__


def _recording_call(self, *inputs):
    _SEEN[self.name] = inputs
    return _CALL(self, *inputs)


def _configs(n: int) -> list[dict]:
    width = triton.next_power_of_2(n)
    out = [{"variant": "persistent", "ROWS": rows, "BLOCK_C": width, "num_warps": w}
           for rows in (1, 2) if rows * width <= 16384 for w in (4, 8, 16, 32)]
    return out + [{"variant": "looped", "ROWS": 1, "BLOCK_C": bc, "num_warps": w}
                  for bc in (2048, 4096) for w in (8, 16)]


def _short(c: dict) -> str:
    return f"{c['variant'][:4]} R{c['ROWS']} B{c['BLOCK_C']} w{c['num_warps']}"


def _ms(spec, inputs: tuple, shape: tuple, cfg: dict) -> float:
    return triton.testing.do_bench(functools.partial(spec.run, inputs, shape, cfg),
                                   warmup=25, rep=100)


def main() -> None:
    runtime_kernel.TritonKernel.__call__ = _recording_call
    for m, n in ((8192, 8192), (2048, 16384)):
        for dt in (torch.float32, torch.bfloat16):
            x, r = (torch.randn(m, n, device="cuda", dtype=dt) for _ in range(2))
            w, b = (torch.randn(n, device="cuda", dtype=dt) for _ in range(2))
            y = torch.empty_like(x)
            copy = triton.testing.do_bench(functools.partial(y.copy_, x), warmup=50, rep=200)
            for name, fn, args, copies in (("layer_norm", layer_norm, (x, w, b), 1),
                                           ("add+ln", add_layer_norm, (x, r, w, b), 1.5),
                                           ("rms_norm", rms_norm, (x, w), 1),
                                           ("softmax", softmax, (x,), 1)):
                compiled = fxlite.compile(fn)
                compiled(*args)
                compiled(*args)
                inputs = _SEEN[compiled.kernels[0].name]
                spec = compiled.kernels[0]._spec_for(inputs)
                shape = iteration_space(list(inputs))
                _, heuristic = spec.config(shape)
                ideal = copy * copies
                timed = []
                for cfg in _configs(n):
                    try:
                        timed.append((_ms(spec, inputs, shape, cfg), cfg))
                    except Exception:  # a config that does not compile
                        continue
                h_ms = _ms(spec, inputs, shape, heuristic)
                timed.sort(key=lambda t: t[0])
                best_ms, best = timed[0]
                print(f"{name:10s} {m}x{n} {str(dt)[6:]:8s} heur {_short(heuristic)} "
                      f"{ideal / h_ms * 100:5.1f}%  best {_short(best)} "
                      f"{ideal / best_ms * 100:5.1f}%  | "
                      + ", ".join(f"{_short(c)} {ideal / t * 100:4.0f}%" for t, c in timed[1:6]),
                      flush=True)


if __name__ == "__main__":
    main()
