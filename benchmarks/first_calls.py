"""The first calls of fxlite.compile, one by one: does any call from the third on cost more
than 1.25x eager's (issue 38's target while the trial runs)?

Run on a CUDA machine (torchvision and transformers installed)::

    PYTHONPATH=$PWD python benchmarks/first_calls.py vit_b_16:f32:32,t5_encoder:bf16:32

Each case is ``model:dtype:batch`` with the models and dtypes of ``bench_models.py``, under
``torch.no_grad()``. Eager is warmed up with 5 calls; then a fresh ``fxlite.compile`` is
timed call by call over its first 20 calls, each synchronized, with one eager call timed
just before each (interleaved: the host's speed drifts by 30% within minutes on the H200
machines, and an eager median taken apart from fxlite's calls made eager-speed calls look
1.3x slower), and both in a loop of 30. Printed per case: eager's median call, fxlite's
20 calls, the worst of calls 3 to 20 over eager's median and over the eager call just
before it, the loop times, the kernels kept, how each segment's trial ended (its winner
runs from the call after the trial's last, counting the compiled function's first call,
which compiles) and the fallbacks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402

import fxlite  # noqa: E402


def per_call(fn: Callable[..., Any], inputs: tuple, n: int) -> list[float]:
    """Milliseconds of each of ``n`` calls, each synchronized."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*inputs)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def loop_ms(fn: Callable[..., Any], inputs: tuple, n: int = 30) -> float:
    """Milliseconds a call over a loop of ``n`` calls, synchronized at the end only."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn(*inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", help="comma-separated model:dtype:batch")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    for case in args.cases.split(","):
        name, dtype, batch = case.split(":")
        model, inputs = bm.cast(*bm.build(name, False, int(batch), "cuda"), dtype)
        with torch.no_grad():
            per_call(model, inputs, 5)
            compiled = fxlite.compile(model)
            eagers, calls = [], []
            for _ in range(20):
                eagers += per_call(model, inputs, 1)
                calls += per_call(compiled, inputs, 1)
            eager = statistics.median(eagers)
            eager_loop, fx_loop = loop_ms(model, inputs), loop_ms(compiled, inputs)
        beside = max(c / e for c, e in zip(calls[2:], eagers[2:]))
        print(f"{case}: eager {eager:.2f} ms a call; fxlite calls 1-20: "
              + " ".join(f"{t:.1f}" for t in calls)
              + f"; worst from call 3: {max(calls[2:]) / eager:.2f}x eager's median, "
              f"{beside:.2f}x the eager call before it; loop ms eager "
              f"{eager_loop:.2f} fxlite {fx_loop:.2f}; kernels {len(compiled.kernels)} "
              f"trials {[str(t) for t in compiled.trials]} "
              f"fallbacks {[f[:90] for f in compiled.fallbacks]}", flush=True)
        del model, compiled
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
