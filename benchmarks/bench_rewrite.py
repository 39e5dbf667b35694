"""fxlite's replace_pattern against torch.fx's, side by side in one process.

Workloads (the modules come from ``bench_trace.py``, so both benchmarks time the same graphs):

- chains of N links ``x = torch.relu(x + 1.0) * 2.0`` (3 nodes per link), rewritten with
  ``relu(x + 1.0) -> (x + 1.0).clamp(min=0)``: N matches;
- a 12-layer transformer encoder, rewritten with
  ``softmax(((q @ k^T) * s).masked_fill(m, -inf)) -> softmax(((q * s) @ k^T).masked_fill(m, -inf))``:
  one match per layer.

Each library traces the module itself, untimed; only the ``replace_pattern`` call is
timed (it traces the pattern and replacement functions, matches, rewrites, lints and
recompiles, in both libraries). Each figure is the median of several repeats, each on a
freshly traced module. Both rewritten modules are checked against eager PyTorch, and
both must find the same number of matches. Ratios are torch.fx time / fxlite time.

Usage::

    python benchmarks/bench_rewrite.py                 # chains of 1000 and 5000 links
    python benchmarks/bench_rewrite.py --quick         # one repeat
    python benchmarks/bench_rewrite.py --sizes 100,500 --tablefmt github
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.fx.subgraph_rewriter
from tabulate import tabulate
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trace import Chain, Encoder

import fxlite  # after the path fix, so that the checkout is used when not installed
from fxlite.rewrite import replace_pattern

SPEEDUP_TARGET = 20.0  # torch.fx / fxlite on the largest chain
MAX_SCALING = 1.2  # t(largest) / t(smallest) <= this x the ratio of node counts (6x for 5x)
SCALE = 16 ** -0.5  # the encoder's attention scale (head_dim 16)


# ---------------------------------------------------------------------------- rules
def chain_pattern(x):  # relu(x + 1) -> clamp(x + 1, min=0)
    return torch.relu(x + 1.0)


def chain_replacement(x):
    return (x + 1.0).clamp(min=0)


def attention_pattern(q, k, mask):  # softmax(((q @ k^T) * s).masked_fill(m)) -> scale q first
    scores = (q @ k.transpose(-2, -1)) * SCALE
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


def attention_replacement(q, k, mask):
    scores = (q * SCALE) @ k.transpose(-2, -1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


LIBS: dict[str, tuple[Callable[[nn.Module], Any], Callable[..., list]]] = {
    "torch.fx": (torch.fx.symbolic_trace, torch.fx.subgraph_rewriter.replace_pattern),
    "fxlite": (fxlite.symbolic_trace, replace_pattern),
}


# ---------------------------------------------------------------------------- timing
def time_rewrite(lib: str, module: nn.Module, rule: tuple[Callable, Callable], repeats: int,
                 inputs: tuple[torch.Tensor, ...], expected: torch.Tensor) -> tuple[float, int, int]:
    """Median seconds of one ``replace_pattern`` call, the match count and the node count.

    Each repeat traces ``module`` afresh (untimed). The last rewritten module is run on
    ``inputs`` and compared with ``expected``.
    """
    trace, rewrite = LIBS[lib]
    times, matches, nodes, gm = [], -1, 0, None
    for _ in range(repeats):
        gm = trace(module)
        nodes = len(gm.graph.nodes)
        gc.collect()
        start = time.perf_counter()
        found = rewrite(gm, *rule)
        times.append(time.perf_counter() - start)
        if matches not in (-1, len(found)):
            raise AssertionError(f"{lib}: match count changed between repeats")
        matches = len(found)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), expected, msg=lambda m: f"{lib}: {m}")
    return statistics.median(times), matches, nodes


def run(sizes: list[int], repeats: int, encoder_layers: int, tablefmt: str) -> bool:
    """Run the benchmark, print its tables, and return True if every target is met."""
    mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    mask[..., -2:] = True
    workloads = [(f"chain x{n}", Chain(n), (torch.randn(4),), (chain_pattern, chain_replacement))
                 for n in sizes]
    workloads.append((f"encoder x{encoder_layers}", Encoder(encoder_layers).eval(),
                      (torch.randn(2, 8, 64), mask), (attention_pattern, attention_replacement)))
    rows, lite_times, met = [], {}, True
    for name, module, inputs, rule in workloads:
        with torch.no_grad():
            expected = module(*inputs)
        fx_t, fx_matches, fx_nodes = time_rewrite("torch.fx", module, rule, repeats, inputs, expected)
        lite_t, lite_matches, lite_nodes = time_rewrite("fxlite", module, rule, repeats, inputs, expected)
        if fx_matches != lite_matches:
            raise AssertionError(f"{name}: torch.fx found {fx_matches} matches, fxlite {lite_matches}")
        lite_times[name] = (lite_nodes, lite_t, fx_t)
        rows.append([name, f"{fx_nodes}/{lite_nodes}", str(lite_matches), f"{fx_t:.4f}",
                     f"{lite_t:.4f}", f"{fx_t / lite_t:.1f}x"])
        print(f"done: {name}", file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["workload", "nodes fx/lite", "matches", "torch.fx (s)",
                                  "fxlite (s)", "fx / fxlite"], tablefmt=tablefmt,
                   disable_numparse=True))
    if sizes:
        n_large, lite_l, fx_l = lite_times[f"chain x{max(sizes)}"]
        speedup = fx_l / lite_l
        ok = speedup >= SPEEDUP_TARGET
        met &= ok
        print(f"\nspeedup at {n_large} nodes: {speedup:.1f}x "
              f"(target >= {SPEEDUP_TARGET:g}x: {'met' if ok else 'MISSED'})")
    if len(sizes) >= 2:
        n_small, lite_s, fx_s = lite_times[f"chain x{min(sizes)}"]
        limit = MAX_SCALING * n_large / n_small
        ok = lite_l / lite_s <= limit
        met &= ok
        print(f"scaling t({n_large}) / t({n_small}): fxlite {lite_l / lite_s:.2f}, torch.fx "
              f"{fx_l / fx_s:.2f} (target for fxlite <= {limit:.1f}: {'met' if ok else 'MISSED'})")
    return met


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the benchmark; with ``--check``, 1 if a target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,5000",
                        help="comma-separated chain lengths in links of 3 nodes (default: 1000,5000)")
    parser.add_argument("--quick", action="store_true", help="1 repeat instead of 3")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement")
    parser.add_argument("--encoder-layers", type=int, default=12)
    parser.add_argument("--tablefmt", default="simple", help="tabulate format, e.g. github")
    parser.add_argument("--check", action="store_true", help="exit 1 if any target is missed")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(",") if s.strip())
    repeats = args.repeats or (1 if args.quick else 3)
    print(f"torch {torch.__version__}, fxlite {fxlite.__version__}, python "
          f"{sys.version.split()[0]}, median of {repeats}")
    met = run(sizes, repeats, args.encoder_layers, args.tablefmt)
    print("\nall targets met" if met else "\nsome targets MISSED")
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
