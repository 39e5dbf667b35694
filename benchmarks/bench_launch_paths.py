"""Host cost of launch paths: fxlite with and without some of its changes, side by side.

Run on a CUDA machine (torchvision and timm installed)::

    PYTHONPATH=$PWD python benchmarks/bench_launch_paths.py \\
        inception_v3:f32:32,googlenet:bf16:32 [--off cat_groups] [--json out.json]

A conv net compiled by fxlite launches, besides its fused kernels, a pool kernel per pool
(``codegen/kernels/pool.py``), a copy of each convolution weight (channels-last), and a
``torch.cat`` per inception block. The changes that cut their cost, any of which
``--off`` names (default: the first two):

- ``pool_launch``: a pool's later calls on a shape reuse its binary through fxlite's
  launcher instead of Triton's dispatcher;
- ``pack_weights``: in inference the weights' conversions are one kernel
  (``codegen/kernels/weights.py``), not one kernel each;
- ``cat_groups``: in inference a cat and the pointwise groups only it reads are one
  kernel (``codegen/kernels/cat.py``).

Each case (``model:dtype:batch``, as in ``bench_models.py``) is timed in one process,
side by side: eager, ``torch.compile``, fxlite without the changes named (``fxlite_before``:
a pass removed from the pipeline while it compiles, the pool's launch key switched
off) and fxlite as it is. Reported per contender: the median over ``--rounds`` rounds
(each timing every contender in turn) of the mean wall time of ``--calls`` calls back to
back, the first call's time, and the peak memory over 20 calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402
from fxlite.codegen.kernels import pool  # noqa: E402
from fxlite.codegen.lower import pipeline, segment  # noqa: E402

import fxlite  # noqa: E402

_PASSES = pipeline.FORWARD_PASSES
_KEY = pool._key


CHANGES = ("pack_weights", "pool_launch", "cat_groups")
OFF = {"pack_weights", "pool_launch"}  # what fxlite_before goes without (--off)


def _before(on: bool) -> None:
    """Switch the changes in ``OFF`` off (``on``) or back on."""
    # (segment.py runs the tuple it imported: that binding is the one to switch)
    segment.FORWARD_PASSES = tuple(p for p in _PASSES if p.name not in OFF) if on else _PASSES
    pool._key = (lambda *a: None) if on and "pool_launch" in OFF else _KEY


def _wall_ms(fn: Callable, inputs: tuple, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def run_case(case: str, rounds: int, calls: int) -> dict[str, Any]:
    """One row: each contender's steady-state ms, first call and peak memory."""
    name, dtype, batch = case.split(":")
    model, inputs = bm.build(name, False, int(batch), "cuda")
    model, inputs = bm.cast(model, inputs, dtype)
    row: dict[str, Any] = {"case": case}
    makers = {"eager": lambda: model, "inductor": lambda: torch.compile(model),
              "fxlite_before": lambda: fxlite.compile(model), "fxlite": lambda: fxlite.compile(model)}
    contenders: dict[str, Any] = {}
    with torch.no_grad():
        torch._dynamo.reset()
        for label, make in makers.items():
            _before(label == "fxlite_before")
            fn = make()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            fn(*inputs)
            torch.cuda.synchronize()
            row[f"{label}_first_s"] = round(time.perf_counter() - start, 2)
            for _ in range(19):
                fn(*inputs)
            torch.cuda.synchronize()
            row[f"{label}_peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
            contenders[label] = fn
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(rounds):
            for label, fn in contenders.items():
                _before(label == "fxlite_before")
                times[label].append(_wall_ms(fn, inputs, calls))
        _before(False)
    for label, ts in times.items():
        row[f"{label}_ms"] = round(statistics.median(ts), 3)
    for label in ("fxlite_before", "fxlite"):
        kernels = getattr(contenders[label], "kernels", [])
        row[f"{label}_kernels"] = len(kernels)
        row[f"{label}_cat_kernels"] = sum(getattr(k, "kind", "") == "cat" for k in kernels)
    row["kernels"] = row["fxlite_kernels"]
    row["fallbacks"] = len(getattr(contenders["fxlite"], "fallbacks", []))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", help="comma-separated model:dtype:batch")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=30, help="calls timed back to back a round")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--off", default="pack_weights,pool_launch",
                   help=f"comma-separated changes fxlite_before goes without, from {CHANGES}")
    args = p.parse_args()
    OFF.clear()
    OFF.update(args.off.split(","))
    if OFF - set(CHANGES):
        p.error(f"--off: unknown changes {sorted(OFF - set(CHANGES))}")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    for case in args.cases.split(","):
        row = run_case(case, args.rounds, args.calls)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(tabulate([[r["case"], r["eager_ms"], r["inductor_ms"], r["fxlite_before_ms"],
                     r["fxlite_ms"], round(r["fxlite_before_ms"] / r["fxlite_ms"], 2),
                     round(r["inductor_ms"] / r["fxlite_ms"], 2),
                     round(r["inductor_ms"] / r["fxlite_before_ms"], 2)] for r in rows],
                   headers=["case", "eager ms", "inductor ms", "before ms", "fxlite ms",
                            "before/fxlite", "inductor/fxlite", "inductor/before"],
                   tablefmt="github"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "off": sorted(OFF), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
