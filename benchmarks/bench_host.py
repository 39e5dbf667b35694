"""Host cost per call: eager against fxlite's replay and its followed tier, side by side.

A compiled call costs host time (Python) before and between its kernels. This script
measures it on four programs, each in one process, the variants taking turns:

- ``tiny``: ``torch.relu(x + 1) * 2`` on a small tensor;
- ``tiny_logged``: the same, appending to a Python list on every call, which makes
  fxlite *follow* it (codegen/capture/follow.py: the user's Python runs on every call and its
  torch calls are matched with the recording and served by compiled pieces);
- ``mlp20``: a 10-layer MLP (20 torch ops per call: linear and GELU);
- ``mlp20_logged``: the same, appending to a Python list on every call (followed);
- ``t5_small``: a 6-layer transformers T5 encoder (d_model 64) on 8 tokens, where
  transformers is installed: about 200 torch calls, and the module, config and logger
  state fxlite's guards read on every call.

Variants: ``eager``, ``fxlite`` (the program compiled with ``fxlite.compile``; on a GPU
with the Triton backend, on the CPU with ``backend="python"``, which runs the recorded
ops as generated Python, so that the figure is fxlite's host cost and not the Triton
interpreter's), and on a GPU ``torch.compile``. Each figure is the median over rounds of
the mean time per call of a batch of calls, after warm-up calls (the first calls record,
compile and, on a GPU, race kernels against the recorded ops). On a GPU each batch ends
with a synchronize, so the figure is wall time per call, which equals host time for
inputs this small.

Usage::

    python benchmarks/bench_host.py                 # CPU: eager vs fxlite (python backend)
    python benchmarks/bench_host.py --device cuda   # GPU: also torch.compile
    python benchmarks/bench_host.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch

import fxlite


def programs(device: str) -> dict[str, tuple]:
    x = torch.randn(8, 64, device=device)
    mlp = torch.nn.Sequential(*[m for _ in range(10) for m in (torch.nn.Linear(64, 64),
                                                               torch.nn.GELU())]).to(device)
    log: list[int] = []

    def tiny(t):
        return torch.relu(t + 1) * 2

    def tiny_logged(t):
        log.append(1)
        return torch.relu(t + 1) * 2

    def mlp20(t):
        return mlp(t)

    def mlp20_logged(t):
        log.append(1)
        return mlp(t)

    found = {"tiny": (tiny, x), "tiny_logged": (tiny_logged, x), "mlp20": (mlp20, x),
             "mlp20_logged": (mlp20_logged, x)}
    try:
        import transformers
    except ImportError:  # a benchmark extra
        return found
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=64, d_ff=128, num_layers=6, num_heads=4, d_kv=16,
                                   vocab_size=100)
    t5 = transformers.T5EncoderModel(config).eval().to(device)

    def t5_small(tokens):
        return t5(tokens).last_hidden_state

    found["t5_small"] = (t5_small, torch.randint(0, 100, (1, 8), device=device))
    return found


def per_call(fn, x, calls: int, rounds: int, sync) -> float:
    """Median over ``rounds`` of the mean seconds per call over ``calls`` calls."""
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    backend = "triton" if cuda else "python"
    rows = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (fn, x) in programs(args.device).items():
            variants = {"eager": fn, "fxlite": fxlite.compile(fn, backend=backend)}
            if cuda:
                variants["torch.compile"] = torch.compile(fn)
            for f in variants.values():
                for _ in range(25):  # record, compile, trial
                    f(x)
            row = {"program": name}
            for vname, f in variants.items():
                row[vname] = per_call(f, x, args.calls, args.rounds, sync) * 1e6
            row["fxlite tier"] = variants["fxlite"].tier.split(":")[0]
            row["fxlite / eager"] = row["fxlite"] / row["eager"]
            rows.append(row)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"host cost per call, us ({device}, torch {torch.__version__}, fxlite "
          f"backend={backend!r})")
    print(f"{'program':<14}{'eager':>10}{'fxlite':>10}{'torch.compile':>15}"
          f"{'fxlite/eager':>14}  tier")
    for r in rows:
        tc = f"{r['torch.compile']:>15.1f}" if "torch.compile" in r else f"{'-':>15}"
        print(f"{r['program']:<14}{r['eager']:>10.1f}{r['fxlite']:>10.1f}{tc}"
              f"{r['fxlite / eager']:>14.2f}  {r['fxlite tier']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
