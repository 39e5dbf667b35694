"""A linear layer whose output rows are not 16-byte multiples (GPT-2's LM head, 50,257
columns), in the ways fxlite can run it, next to eager and torch.compile::

    PYTHONPATH=$PWD python benchmarks/bench_lm_head.py [--json OUT]

Rows: ``plain`` (eager ``F.linear``), ``padded`` (fxlite's padded weight and the copy of
its columns, ``passes/pad_matmul.padded_linear``), ``grouped`` (fxlite's row groups,
``grouped_linear``), ``inductor`` (``torch.compile`` of ``F.linear``) and ``fxlite``
(``fxlite.compile`` of the layer, whichever its pass picks). Time is
``triton.testing.do_bench_cudagraph`` (GPU only) for the three plain functions and
``do_bench`` (a call as made, host included) for the two compiled ones; host time is a
loop of calls, the GPU drained before and after. ``copy us`` is a device-to-device copy of the result's
bytes, measured in this run. Each result is checked against a float64 product.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

_CACHE = tempfile.mkdtemp(prefix="fxlite-bench-lm-head-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHE, "triton"))
os.environ.setdefault("FXLITE_CACHE_DIR", os.path.join(_CACHE, "fxlite"))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402
from fxlite.codegen.lower.pad_matmul import grouped_linear, padded_linear  # noqa: E402

import fxlite  # noqa: E402

VOCAB, WIDTH = 50257, 768


def _host_us(fn: Callable[[], Any], calls: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return took


def run_case(rows: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Every way of computing one head's logits for ``rows`` tokens."""
    torch.manual_seed(0)
    x = torch.randn(rows, WIDTH, device="cuda", dtype=dtype) / 8
    w = torch.randn(VOCAB, WIDTH, device="cuda", dtype=dtype) / 8
    exact = F.linear(x.double(), w.double())
    head = torch.nn.Linear(WIDTH, VOCAB, bias=False, device="cuda", dtype=dtype)
    head.weight.data.copy_(w)
    with torch.no_grad():
        fx, ind = fxlite.compile(head), torch.compile(F.linear)
        ways = {"plain": lambda: F.linear(x, w),
                "padded": lambda: padded_linear(x, w)[:, :VOCAB].clone(),
                "grouped": lambda: grouped_linear(x, w),
                "inductor": lambda: ind(x, w),
                "fxlite": lambda: fx(x)}
        src, out = exact.to(dtype), torch.empty(rows, VOCAB, device="cuda", dtype=dtype)
        copy = triton.testing.do_bench_cudagraph(lambda: out.copy_(src), rep=50) * 1e3
        found = []
        for name, fn in ways.items():
            for _ in range(20):  # the compilers' first calls (their trials) run eagerly
                got = fn()
            err = ((got.double() - exact).abs().max() / exact.abs().max()).item()
            if name in ("inductor", "fxlite"):  # compiled calls, host time included
                gpu, timing = triton.testing.do_bench(fn, rep=100, return_mode="median"), "do_bench"
            else:
                gpu, timing = triton.testing.do_bench_cudagraph(fn, rep=60), "cuda graph"
            gpu *= 1e3
            found.append({"rows": rows, "dtype": str(dtype).replace("torch.", ""), "way": name,
                          "timing": timing,
                          "gpu_us": round(gpu, 1), "host_us": round(_host_us(fn), 1),
                          "copy_us": round(copy, 1), "rel_err": float(f"{err:.2e}"),
                          "contiguous": got.is_contiguous()})
        found[-1]["fxlite_code"] = "grouped_linear" if "grouped_linear" in fx.code else (
            "padded_linear" if "padded_linear" in fx.code else "plain")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    print("| rows | dtype | way | us (timing) | host us | copy us | rel. err | contiguous |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for m in (128, 1024, 4096):
            for r in run_case(m, dtype):
                rows.append(r)
                way = r["way"] + (f" ({r['fxlite_code']})" if "fxlite_code" in r else "")
                print(f"| {m} | {r['dtype']} | {way} | {r['gpu_us']} ({r['timing']}) | "
                      f"{r['host_us']} | "
                      f"{r['copy_us']} | {r['rel_err']:.1e} | {r['contiguous']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
