"""Sizes that change between calls: eager vs torch.compile vs fxlite.compile, side by side.

Run on a CUDA machine (transformers installed)::

    python benchmarks/bench_dynamic.py --json out.json
    python benchmarks/bench_dynamic.py --quick          # 2 layers, fewer lengths

The model is transformers' GPT2LMHeadModel (GPT-2 124M's configuration, random weights, bf16,
inference) at batch 8, called with a new sequence length on each of its first calls
(``LENGTHS``), then timed at each length. Contenders, each on its own copy of the model:

- ``eager``;
- ``inductor``: ``torch.compile(model)`` (Dynamo's automatic dynamic shapes: the second
  length recompiles with sizes symbolic);
- ``inductor_dynamic``: ``torch.compile(model, dynamic=True)``;
- ``fxlite``: ``fxlite.compile(model)``, whose recordings that read sizes are specialized:
  a new length records again;
- ``fxlite_dynamic``: ``fxlite.compile(model, dynamic=True)``: Dynamo captures with sizes
  symbolic, fxlite compiles each graph once for all lengths.

Reported per contender: the total time of the first calls (one per new length, compiles
and recordings included), the steady-state median at each length and their geometric
mean, how many recordings (fxlite) or graphs (Dynamo) were made, fxlite's kernels, the
largest difference of the logits from eager's, and the peak memory of its calls (less
what was allocated before them). The steady state is timed in rounds, each round timing
every contender in turn at every length.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import tempfile
import time

_CACHE = tempfile.mkdtemp(prefix="fxlite-bench-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHE, "triton"))
os.environ.setdefault("FXLITE_CACHE_DIR", os.path.join(_CACHE, "fxlite"))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import fxlite  # noqa: E402

LENGTHS = [128, 256, 384, 512, 640, 768, 896, 1024]
CONTENDERS = ["eager", "inductor", "inductor_dynamic", "fxlite", "fxlite_dynamic"]


def build(layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel  # here: an optional dependency

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=1024,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config).to("cuda", torch.bfloat16).eval()


def wrap(name: str, model: torch.nn.Module):
    if name == "eager":
        return model
    if name == "inductor":
        return torch.compile(model)
    if name == "inductor_dynamic":
        return torch.compile(model, dynamic=True)
    if name == "fxlite":
        return fxlite.compile(model)
    return fxlite.compile(model, dynamic=True)


def timed(fn, ids) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        fn(ids)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def graphs_made() -> int:
    from torch._dynamo.utils import counters  # here: a slow import

    return int(counters["stats"]["unique_graphs"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 layers, 4 lengths, 2 rounds")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    lengths = LENGTHS[::2] if args.quick else LENGTHS
    rounds = 2 if args.quick else args.rounds
    base = build(2 if args.quick else 12)
    names = args.contenders.split(",")
    batches = {n: torch.randint(0, 50257, (8, n), device="cuda") for n in lengths}
    with torch.no_grad():
        want = {n: base(ids).logits.float() for n, ids in batches.items()}
    rows: dict[str, dict] = {}
    fns = {}
    for name in names:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        fn = wrap(name, model)
        before = graphs_made() if name != "eager" else 0
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        first = []
        err = 0.0
        for n in lengths:
            first.append(timed(fn, batches[n]))
            with torch.no_grad():
                got = fn(batches[n]).logits.float()
            err = max(err, float((got - want[n]).abs().max() / want[n].abs().max()))
        row = dict(first_calls_ms=[round(t, 1) for t in first], first_total_ms=sum(first),
                   max_rel_diff=err, peak_gib=(torch.cuda.max_memory_allocated() - held) / 2**30)
        if name.startswith("fxlite"):
            row.update(recordings=fn.recordings, kernels=len(fn.kernels), tier=fn.tier,
                       fallbacks=fn.fallbacks[:3])
        if name in ("inductor", "inductor_dynamic", "fxlite_dynamic"):
            row["dynamo_graphs"] = graphs_made() - before
        rows[name], fns[name] = row, fn
        print(f"{name}: first calls {row['first_total_ms']:.0f} ms", flush=True)
    # (Dynamo's caches were reset between contenders above; its compiled code stays valid)
    samples = {name: {n: [] for n in lengths} for name in names}
    for _ in range(rounds):
        for name in names:
            for n in lengths:
                for _ in range(5):
                    samples[name][n].append(timed(fns[name], batches[n]))
    for name in names:
        steady = {n: statistics.median(samples[name][n]) for n in lengths}
        rows[name]["steady_ms"] = {n: round(t, 3) for n, t in steady.items()}
        rows[name]["steady_geomean_ms"] = math.exp(
            statistics.fmean(math.log(t) for t in steady.values()))
    eager = rows.get("eager", {}).get("steady_geomean_ms")
    table = []
    for name in names:
        r = rows[name]
        table.append([name, f"{r['first_total_ms']:.0f}", f"{r['steady_geomean_ms']:.2f}",
                      f"{eager / r['steady_geomean_ms']:.2f}" if eager else "",
                      r.get("recordings", ""), r.get("dynamo_graphs", ""), r.get("kernels", ""),
                      f"{r['max_rel_diff']:.1e}", f"{r['peak_gib']:.2f}"])
    print(tabulate(table, headers=["contender", "first calls ms", "steady geomean ms",
                                   "x eager", "recordings", "Dynamo graphs", "kernels",
                                   "max rel diff", "peak GiB"]))
    if args.json:
        out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   lengths=lengths, date=time.strftime("%Y-%m-%d"), rows=rows)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
