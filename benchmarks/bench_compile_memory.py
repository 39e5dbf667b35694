"""Peak memory of compiling a large graph with fxlite.compile, next to eager and
torch.compile, and what a dropped compiled function gives back.

    python benchmarks/bench_compile_memory.py                    # CPU (Triton interpreter)
    python benchmarks/bench_compile_memory.py --device cuda --blocks 200 --json mem.json

The model is ``--blocks`` residual blocks (Linear, LayerNorm, GELU, add; a graph break
every ``--break-every`` blocks, where Python reads ``h.mean() > 0``), run on a small
batch. Each measurement runs in a fresh process (so one cannot inherit another's peak):

- ``eager``: two calls of the model;
- ``fxlite``: ``fxlite.compile``, the first call (records, compiles, checks) and a second;
- ``torch.compile`` (inductor; on the GPU, and on the CPU when a C++ compiler is present).

Reported per row: the peak resident set size of the process over its baseline (after
imports, the model built and one eager call, so it counts compilation alone), the peak
of Python allocations (tracemalloc) during the calls, on CUDA the peak of allocated
device memory, the wall time, and for fxlite the nodes, kernels and segments; then what
is left after the compiled function is dropped: resident memory (the allocator and the
imported compiler keep some), Python allocations made since the baseline (caches that
outlive the function: loaded kernel modules, Triton's own) and device memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(kind: str, blocks: int, every: int, width: int, device: str) -> dict:
    """One measurement, in this process."""
    import gc
    import tracemalloc
    import warnings

    import torch
    import torch.nn as nn

    import fxlite

    warnings.simplefilter("ignore")

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
            self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(blocks))

        def forward(self, x):
            h = x
            for i, (lin, norm) in enumerate(zip(self.lins, self.norms)):
                h = h + torch.nn.functional.gelu(norm(lin(h)))
                if every and i % every == every - 1 and h.mean() > 0:
                    h = h * 0.5
            return h

    torch.manual_seed(0)
    model = Model().to(device).eval()
    x = torch.randn(8, width, device=device)
    with torch.no_grad():
        model(x)  # eager's one-time costs go into the baseline
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    base_rss, base_peak = _rss_mb(), _peak_rss_mb()
    tracemalloc.start()
    started = time.perf_counter()
    fn = model
    if kind == "fxlite":
        fn = fxlite.compile(model)
    elif kind == "torch.compile":
        fn = torch.compile(model)
    with torch.no_grad():
        fn(x)
        fn(x)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    _, py_peak = tracemalloc.get_traced_memory()
    row = {"kind": kind, "blocks": blocks, "device": device, "seconds": round(seconds, 2),
           "peak_rss_over_baseline_mb": round(max(_peak_rss_mb(), base_rss) - base_rss, 1),
           "python_peak_mb": round(py_peak / 2**20, 1), "baseline_rss_mb": round(base_rss, 1),
           "baseline_was_peak_mb": round(base_peak, 1)}
    if device == "cuda":
        row["cuda_peak_over_baseline_mb"] = round(
            (torch.cuda.max_memory_allocated() - base_cuda) / 2**20, 1)
    if kind == "fxlite":
        segs, todo = [], list(fn._compiled._trees.values())
        while todo:
            s = todo.pop()
            if hasattr(s, "gm"):
                segs.append(s)
                todo += list(s.children.values())
        row["segments"] = len(segs)
        row["nodes"] = sum(s.nodes() for s in segs)
        row["kernels"] = sum(len(s.compiled.kernels) for s in segs if s.compiled)
        del segs, todo
    del fn
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        row["cuda_left_after_drop_mb"] = round(
            (torch.cuda.memory_allocated() - base_cuda) / 2**20, 1)
    row["rss_left_after_drop_mb"] = round(_rss_mb() - base_rss, 1)
    row["python_left_after_drop_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
    tracemalloc.stop()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100)
    parser.add_argument("--break-every", type=int, default=25)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--kinds", default="eager,fxlite,torch.compile")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.one:
        print(json.dumps(measure(args.one, args.blocks, args.break_every, args.width, device)))
        return 0
    env = dict(os.environ, FXLITE_CACHE_DIR=tempfile.mkdtemp(prefix="fxlite-mem-"),
               TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-mem-"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    rows = []
    for kind in args.kinds.split(","):
        cmd = [sys.executable, __file__, "--one", kind, "--blocks", str(args.blocks),
               "--break-every", str(args.break_every), "--width", str(args.width),
               "--device", device]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{kind}: failed ({done.stderr.strip().splitlines()[-1:]})")
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    from tabulate import tabulate

    keys = ["kind", "seconds", "peak_rss_over_baseline_mb", "python_peak_mb",
            "cuda_peak_over_baseline_mb", "rss_left_after_drop_mb", "python_left_after_drop_mb",
            "cuda_left_after_drop_mb",
            "segments", "nodes", "kernels"]
    keys = [k for k in keys if any(k in r for r in rows)]
    print(f"{args.blocks} blocks of Linear/LayerNorm/GELU/add, width {args.width}, a break "
          f"every {args.break_every}; {device}; {time.strftime('%Y-%m-%d')}")
    print(tabulate([[r.get(k, "") for k in keys] for r in rows], headers=keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "command": " ".join(sys.argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
