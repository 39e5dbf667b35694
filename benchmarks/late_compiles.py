"""Cold compile: what a model's first call still compiles after the parallel precompile.

Run on a CUDA machine (torchvision installed)::

    PYTHONPATH=$PWD python benchmarks/late_compiles.py googlenet:bf16,resnet50:f32 \\
        [--off relayout,cat,ops] [--json out.jsonl]

``fxlite.compile``'s pipeline compiles a segment's kernels on a thread pool
(``codegen/runtime/precompile.py``) from the graph's metadata. A kernel it did not
foresee compiles when the first call reaches it, one after another: that is the
"late" compile this script counts (every Triton JIT compile after the last precompile of
the call; its names are listed). Each case (``model:dtype``, batch 32, as in
``bench_models.py``) runs in a process of its own with empty cache folders, and reports
the first call's wall time, the precompile's own time and compiles, the late compiles
(and for each, where Triton's cache key, its arguments' specialization and constexprs,
differs from the closest one the precompile compiled for the same kernel), the second
call's time and the steady-state median over 30 calls.

``--off`` runs without some of the changes that made the precompile foresee more:

- ``relayout``: the channels-last pass recomputes the metadata of the values whose layout
  it changes (``passes/channels_last.py``), and the meta evaluator gives conv2d eager's
  channels-last layout (``passes/shape_prop.py``);
- ``cat``: cat kernels are planned (``CatKernel.planned_launch``);
- ``ops``: the pools' kernels and the packed weight copies are planned
  (``planned_launch`` of ``codegen/kernels/pool.py`` and ``weights.py``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

CHANGES = ("relayout", "cat", "ops")


def _switch_off(off: set[str]) -> None:
    # (imported in the child process only: the parent runs no torch)
    import fxlite.codegen.runtime.precompile as pre
    import fxlite.passes.channels_last as channels_last
    import fxlite.passes.shape_prop as shape_prop
    from fxlite.codegen.kernels import pool, weights

    if "relayout" in off:
        channels_last._layouts_again = lambda gm, changed: None
        shape_prop._conv_layout = lambda target, args, value: value
    if "cat" in off:
        planned = pre._planned
        pre._planned = lambda sub, kind, inputs, name: None if kind == "cat" \
            else planned(sub, kind, inputs, name)
    if "ops" in off:
        for op in (pool.max_pool2d, pool.avg_pool2d, weights.channels_last_copies):
            del op.planned_launch


def run_case(case: str, off: set[str]) -> dict[str, Any]:
    """One case, in this process (which must not have compiled anything yet)."""
    # (imported in the child process only: the parent runs no torch)
    import torch
    import triton.runtime.jit as jit

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_models as bm
    import fxlite.codegen.lower.pipeline as pipeline

    import fxlite

    if not hasattr(jit.JITFunction, "_do_compile"):  # (Triton 3.6 to 3.9 have it)
        raise SystemExit("this Triton compiles through another method: nothing to count")
    _switch_off(off)
    stamps: list[tuple[float, str, str]] = []
    lock = threading.Lock()
    real_compile, real_precompile = jit.JITFunction._do_compile, pipeline.precompile

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_compile(self, *args, **kwargs)
        with lock:
            # (Triton's cache key: the arguments' specialization and the constexprs)
            stamps.append((time.perf_counter(), self.__name__, str(args[0]) if args else ""))
        return out

    reports: list[dict] = []

    def precompile(gm: Any, device: Any) -> dict:
        report = real_precompile(gm, device)
        reports.append({**report, "end": time.perf_counter()})
        return report

    jit.JITFunction._do_compile = counted
    pipeline.precompile = precompile
    name, dtype = case.split(":")
    model, inputs = bm.build(name, False, 32, "cuda")
    model, inputs = bm.cast(model, inputs, dtype)
    f = fxlite.compile(model)
    row: dict[str, Any] = {"case": case, "off": sorted(off)}
    with torch.no_grad():
        for label in ("first_s", "second_s"):
            start = time.perf_counter()
            f(*inputs)
            torch.cuda.synchronize()
            row[label] = round(time.perf_counter() - start, 3)
        times = []
        for _ in range(30):
            start = time.perf_counter()
            f(*inputs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    row["steady_ms"] = round(1e3 * sorted(times)[len(times) // 2], 3)
    row["precompile_s"] = round(sum(r["seconds"] for r in reports), 3)
    row["precompiled"] = sum(r["compiles"] for r in reports)
    last = max((r["end"] for r in reports), default=0.0)
    late = [(n, key) for t, n, key in stamps if t > last]
    row["late_compiles"] = len(late)
    row["late_names"] = sorted({n for n, _ in late})
    row["late_differences"] = [
        _difference(key, [k for t, m, k in stamps if t <= last and m == n]) for n, key in late]
    row["kernels"] = len(getattr(f, "kernels", []))
    return row


def _difference(late: str, planned: list[str]) -> str:
    """Where a late compile's cache key differs from the closest key the precompile
    compiled for the same kernel: the differing stretches, ``planned -> late``, or a
    note that it planned none."""
    if not planned:
        return "no compile of this kernel was planned"
    closest = max(planned, key=lambda k: difflib.SequenceMatcher(None, k, late).ratio())
    ops = difflib.SequenceMatcher(None, closest, late, autojunk=False).get_opcodes()
    return "; ".join(f"{closest[max(0, i1 - 20):i2]!r} -> {late[max(0, j1 - 20):j2]!r}"
                     for tag, i1, i2, j1, j2 in ops if tag != "equal")[:600]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", help="comma-separated model:dtype (f32 or bf16)")
    p.add_argument("--off", default="", help=f"comma-separated, of {', '.join(CHANGES)}")
    p.add_argument("--json", help="append one JSON line per case here")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = p.parse_args()
    off = {c for c in args.off.split(",") if c}
    if off - set(CHANGES):
        p.error(f"--off takes {', '.join(CHANGES)}")
    if args.one:
        print("ROW " + json.dumps(run_case(args.cases, off)), flush=True)
        return
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory() as root:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(root, "triton"),
                       FXLITE_CACHE_DIR=os.path.join(root, "fxlite"))
            done = subprocess.run([sys.executable, __file__, case, "--off", args.off, "--one"],
                                  env=env, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("ROW ")), None)
        if line is None:
            print(f"{case}: failed\n{done.stderr[-2000:]}", flush=True)
            continue
        row = json.loads(line[4:])
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
