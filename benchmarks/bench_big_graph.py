"""Big graphs: every whole-graph operation at up to 100,000 nodes, with torch.fx beside it.

Workload: a chain of N links ``x = torch.relu(x + 1.0) * 2.0`` (3 nodes per link), traced
from a function whose loop tracing unrolls. Operations, each timed on both libraries in
the same round where torch.fx has it:

- ``trace``: ``symbolic_trace`` (builds the GraphModule, generates ``forward``);
- ``first call``: one call on a 4-element tensor (compiles the generated ``forward``);
- ``deepcopy``, ``lint``, ``recompile`` (code generation);
- ``DCE``: ``eliminate_dead_code`` after the output is pointed at the first relu (all
  but 3 nodes dead), on a fresh copy;
- ``pickle``: ``pickle.dumps`` then ``pickle.loads`` (torch.fx re-traces on load);
- ``save/load``: ``fxlite.save`` then ``fxlite.load`` to a temporary file (fxlite only).

Everything runs with the recursion limit lowered to 400, so that any recursion over the
node list fails instead of passing. The scaling column divides the time per node at the
largest size by the time per node at the smallest: about 1 means linear time.

Usage (after the README's setup)::

    python benchmarks/bench_big_graph.py                        # 10k, 30k, 100k nodes
    python benchmarks/bench_big_graph.py --links 1000,3000 --rounds 1
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from tabulate import tabulate

import fxlite


def make_chain(links: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(links):
            x = torch.relu(x + 1.0) * 2.0
        return x

    return chain


ERRORS: dict[float, str] = {}  # a failed op records a NaN; its error type is kept here


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    start = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # torch.fx fails some ops on big graphs: report, don't stop
        nan = float("nan")
        ERRORS[id(nan)] = type(e).__name__
        return nan, None
    return time.perf_counter() - start, out


def _dce(lib: Any, gm: Any) -> Any:
    g = copy.deepcopy(gm).graph if lib is fxlite else copy.deepcopy(gm.graph)
    first_relu = next(n for n in g.nodes if n.target is torch.relu)
    g.output_node().args = (first_relu,)

    def run() -> bool:
        return g.eliminate_dead_code()
    return run


def _save_load(gm: fxlite.GraphModule, folder: str) -> fxlite.GraphModule:
    path = os.path.join(folder, "big.fxl")
    fxlite.save(gm, path)
    return fxlite.load(path)


def measure(links: int, rounds: int, folder: str) -> dict[str, dict[str, float]]:
    """Median seconds per op and library for a chain of ``links`` links."""
    fn = make_chain(links)
    x = torch.randn(4)
    times: dict[str, dict[str, list[float]]] = {}

    def record(op: str, lib: str, seconds: float) -> None:
        times.setdefault(op, {}).setdefault(lib, []).append(seconds)

    for _ in range(rounds):
        for lib, mod in (("torch.fx", torch.fx), ("fxlite", fxlite)):
            t, gm = _timed(lambda mod=mod: mod.symbolic_trace(fn))
            record("trace", lib, t)
            if gm is None:
                continue
            record("first call", lib, _timed(lambda gm=gm: gm(x))[0])
            record("deepcopy", lib, _timed(lambda gm=gm: copy.deepcopy(gm))[0])
            record("lint", lib, _timed(gm.graph.lint)[0])
            record("recompile", lib, _timed(gm.recompile)[0])
            record("DCE", lib, _timed(_dce(mod, gm))[0])
            record("pickle", lib, _timed(lambda gm=gm: pickle.loads(pickle.dumps(gm)))[0])
            if mod is fxlite:
                t, gm2 = _timed(lambda gm=gm: _save_load(gm, folder))
                record("save/load", lib, t)
                if gm2 is not None:
                    torch.testing.assert_close(gm2(x), gm(x))
                    record("file MB", lib, os.path.getsize(os.path.join(folder, "big.fxl")) / 1e6)
            del gm
    return {op: {lib: _median(v) for lib, v in libs.items()} for op, libs in times.items()}


def _median(values: list[float]) -> float:
    failed = [v for v in values if v != v]
    return failed[0] if failed else statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--links", default="3334,10000,33334",
                        help="chain lengths in links (3 nodes each); default 10k, 30k, 100k nodes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tablefmt", default="simple")
    args = parser.parse_args()
    sizes = [int(s) for s in args.links.split(",")]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    sys.setrecursionlimit(400)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for links in sizes:
            results[links] = measure(links, args.rounds, folder)
    rows = []
    small, big = sizes[0], sizes[-1]
    for op in results[big]:
        for lib in ("torch.fx", "fxlite"):
            if lib not in results[big][op]:
                continue
            row = [op, lib] + [_fmt(results[n][op].get(lib), op) for n in sizes]
            if op != "file MB" and len(sizes) > 1:
                per_node = [results[n][op][lib] / (3 * n + 2) for n in (small, big)]
                row.append(f"{per_node[1] / per_node[0]:.2f}" if per_node[0] == per_node[0] else "")
            rows.append(row)
    headers = ["op", "library"] + [f"{3 * n + 2:,} nodes (s)" for n in sizes] + ["scaling"]
    print(tabulate(rows, headers=headers, tablefmt=args.tablefmt, disable_numparse=True))


def _fmt(v: float | None, op: str) -> str:
    if v is None:
        return "-"
    if v != v:
        return ERRORS.get(id(v), "failed")
    return f"{v:.1f}" if op == "file MB" else f"{v:.3f}"


if __name__ == "__main__":
    main()
