"""Graph breaks on the GPU: the compile tutorial's ``bar`` against eager and torch.compile.

Run on a CUDA machine::

    python benchmarks/bench_capture.py            # 4096 x 4096, as the issue asks
    python benchmarks/bench_capture.py --n 1024   # smaller

``bar`` reads ``b.sum() < 0`` in Python, so every compiler splits it into two graphs and
syncs once per call. Reported, all from this one process:

- device time per call for each branch (median of ``triton.testing.do_bench``), with
  fxlite's share of a device-to-device copy of the same bytes (a, b read, the result
  written), and the speedups over eager and torch.compile;
- cold compile time (first call) for torch.compile and fxlite;
- the host cost of a break: wall time per call on tiny tensors of ``bar`` and of
  ``bar_fixed`` (torch.cond, one graph) and ``no_break`` (the same math without the
  ``if``), best of 5 loops of 2,000 calls (the host CPU is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

_CACHE = tempfile.mkdtemp(prefix="fxlite-bench-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHE, "triton"))
os.environ.setdefault("FXLITE_CACHE_DIR", os.path.join(_CACHE, "fxlite"))

import torch  # noqa: E402
from bench_kernels import (  # noqa: E402  (the same timing, in this folder)
    bench,
    copy_bandwidth,
    first_call_seconds,
    host_cost_us,
)
from tabulate import tabulate  # noqa: E402

import fxlite  # noqa: E402


def bar(a, b):
    x = a / (torch.abs(a) + 1)
    if b.sum() < 0:
        b = b * -1
    return x * b


def bar_fixed(a, b):
    x = a / (torch.abs(a) + 1)
    x = torch.cond(b.sum() < 0, lambda y: y * -1, lambda y: y.clone(), (b,))
    return x * b


def no_break(a, b):
    return a / (torch.abs(a) + 1) * b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="tensors are n x n (default 4096)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_capture.py needs a CUDA device")
    n = args.n
    gbs = copy_bandwidth(n)
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda").abs() + 0.1
    inductor, ours = torch.compile(bar), fxlite.compile(bar)
    cold = {"torch.compile": first_call_seconds(inductor, (a, b)),
            "fxlite": first_call_seconds(ours, (a, b))}
    rows, out = [], {"device": torch.cuda.get_device_name(), "n": n, "copy_GBps": gbs,
                     "cold_s": cold, "branches": {}}
    for name, bb in (("b.sum() >= 0", b), ("b.sum() < 0", -b)):
        for fn in (inductor, ours):
            fn(a, bb)  # the second branch compiles here, outside the timing
        eager_ms, ind_ms, ours_ms = (bench(f, (a, bb)) for f in (bar, inductor, ours))
        torch.testing.assert_close(ours(a, bb), bar(a, bb))
        moved = 3 * a.numel() * a.element_size()
        pct = moved / ours_ms / 1e6 / gbs * 100
        rows.append([name, f"{eager_ms:.3f}", f"{ind_ms:.3f}", f"{ours_ms:.3f}",
                     f"{eager_ms / ours_ms:.2f}x", f"{ind_ms / ours_ms:.2f}x", f"{pct:.1f}%",
                     len(ours.kernels)])
        out["branches"][name] = {"eager_ms": eager_ms, "inductor_ms": ind_ms,
                                 "fxlite_ms": ours_ms, "pct_of_copy": pct,
                                 "kernels": len(ours.kernels)}
    print(f"device: {out['device']}; copy {gbs:.0f} GB/s; bar on {n}x{n} float32")
    print(tabulate(rows, headers=["branch", "eager ms", "inductor ms", "fxlite ms",
                                  "vs eager", "vs inductor", "fxlite % of copy", "kernels"]))
    print(f"cold compile (first call): torch.compile {cold['torch.compile']:.2f} s, "
          f"fxlite {cold['fxlite']:.2f} s")

    ta, tb = torch.randn(16, device="cuda"), torch.randn(16, device="cuda").abs() + 0.1
    host = {}
    for label, fn in (("bar", bar), ("bar_fixed", bar_fixed), ("no_break", no_break)):
        compiled = {"eager": fn, "torch.compile": torch.compile(fn), "fxlite": fxlite.compile(fn)}
        host[label] = {k: host_cost_us(f, (ta, tb)) for k, f in compiled.items()}
    out["host_us"] = host
    print("\nhost cost per call on 16-element tensors (us, best of 5 loops of 2,000 calls)")
    print(tabulate([[k, *(f"{v[c]:.1f}" for c in ("eager", "torch.compile", "fxlite"))]
                    for k, v in host.items()], headers=["function", "eager", "torch.compile",
                                                        "fxlite"]))
    cost = host["bar"]["fxlite"] - host["no_break"]["fxlite"]
    print(f"fxlite's cost of a break (bar - no_break): {cost:.1f} us per call")
    out["break_cost_us"] = cost
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
