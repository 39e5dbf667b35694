"""GPU kernels of one forward: eager, torch.compile and fxlite.compile side by side.

Run on a CUDA machine (torchvision and transformers installed)::

    PYTHONPATH=$PWD python benchmarks/profile_models.py gpt2_lm:bf16:32,resnet50:bf16:32

Each case is ``model:dtype:batch`` with the models and dtypes of ``bench_models.py``.
Every contender is warmed up (``--warm`` calls, so that fxlite's trial has settled), then
``torch.profiler`` records ``--calls`` calls. Printed per contender: the GPU time of one
call summed over its kernels, the kernel count, and the kernels by GPU time a call. With
``--wall``, also a call's wall time (``triton.testing.do_bench``, calls back to back): a
wall time well above the GPU time says the calls are host-bound. With ``--host``, also a
call's host time (the time until the call returns, started on an idle GPU, so that no
launch waits for the queue), and for fxlite the functions of its host time
(``cProfile``, by own time).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import os
import pstats
import statistics
import sys
import time

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402

import fxlite  # noqa: E402


def kernels(fn, inputs: list, calls: int) -> dict[str, list[float]]:
    """GPU microseconds and launches a call, by kernel name, over ``calls`` calls."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            out[event.key][0] += event.self_device_time_total / calls
            out[event.key][1] += event.count / calls
    return out


def host_us(fn, inputs: list, calls: int = 20) -> float:
    """Median microseconds until a call returns, each started on an idle GPU."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def host_profile(fn, inputs: list, calls: int, rows: int) -> str:
    """The ``rows`` functions with the most own time over ``calls`` calls (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn(*inputs)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", help="comma-separated model:dtype:batch")
    p.add_argument("--warm", type=int, default=30, help="calls before profiling")
    p.add_argument("--calls", type=int, default=5, help="profiled calls")
    p.add_argument("--rows", type=int, default=25, help="kernels listed per contender")
    p.add_argument("--wall", action="store_true", help="also time a call's wall")
    p.add_argument("--host", action="store_true",
                   help="also time a call's host time, and cProfile fxlite's calls")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    for case in args.cases.split(","):
        name, dtype, batch = case.split(":")
        model, inputs = bm.build(name, False, int(batch), "cuda")
        model, inputs = bm.cast(model, inputs, dtype)
        with torch.no_grad():
            torch._dynamo.reset()
            contenders = {"eager": model, "fxlite": fxlite.compile(model),
                          "inductor": torch.compile(model)}
            for fn in contenders.values():
                for _ in range(args.warm):
                    fn(*inputs)
            print(f"===== {case}")
            for label, fn in contenders.items():
                wall = ""
                if args.wall:
                    ms = triton.testing.do_bench(functools.partial(fn, *inputs), warmup=50, rep=300)
                    wall = f"wall {ms * 1000:.0f} us, "
                if args.host:
                    wall += f"host {host_us(fn, inputs):.0f} us, "
                found = kernels(fn, inputs, args.calls)
                total = sum(us for us, _ in found.values())
                count = sum(n for _, n in found.values())
                print(f"--- {label}: {wall}GPU {total:.0f} us a call, {count:.0f} kernels")
                for key, (us, n) in sorted(found.items(), key=lambda kv: -kv[1][0])[:args.rows]:
                    print(f"  {us:8.1f} us {n:5.0f}x  {key[:110]}")
                if args.host and label == "fxlite":
                    print(host_profile(fn, inputs, args.calls, args.rows))


if __name__ == "__main__":
    main()
