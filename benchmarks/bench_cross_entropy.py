"""A language model's loss, forward and backward: eager vs torch.compile vs fxlite, side by side.

Run on a CUDA machine::

    PYTHONPATH=$PWD python benchmarks/bench_cross_entropy.py [--json out.json] [--sweep]

Each case is transformers' causal-LM loss on random logits, ``F.cross_entropy(
logits.float(), labels, ignore_index=-100)`` with every 8th label ignored, then its backward
into the 16-bit logits (a leaf), as one training step's loss does. Contenders: eager,
``torch.compile`` and ``fxlite.compile`` of that function (loss and gradient returned), and
fxlite's kernels called directly (``fused_cross_entropy``, the function the compiled call
routes to). Reported per case: the median ms of a call (``triton.testing.do_bench``), its
bandwidth as a percentage of a device-to-device copy timed in the same process (bytes: the
logits read twice, forward and backward, and the gradient written), the peak memory a call
allocates beyond its inputs, each compiler's first call (seconds, fresh caches), and the
largest difference of the loss and gradient from eager's. ``--sweep`` also times the kernels
at each block width and warp count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

_CACHE = tempfile.mkdtemp(prefix="fxlite-bench-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHE, "triton"))
os.environ.setdefault("FXLITE_CACHE_DIR", os.path.join(_CACHE, "fxlite"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from bench_kernels import first_call_seconds  # noqa: E402
from fxlite.codegen.lower import cross_entropy as ce  # noqa: E402
from tabulate import tabulate  # noqa: E402

import fxlite  # noqa: E402

CASES = (("GPT-2 8x1024, 50,257 bf16", 8192, 50257, torch.bfloat16),
         ("Llama-3 4x1024, 128,256 bf16", 4096, 128256, torch.bfloat16),
         ("8192 rows, 32,000 f32", 8192, 32000, torch.float32))


def loss_and_grad(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's loss and the logits' gradient (x is a leaf; its .grad is reset)."""
    x.grad = None
    loss = F.cross_entropy(x.float(), t, ignore_index=-100)
    loss.backward()
    return loss.detach(), x.grad


def fused(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x.grad = None
    loss = ce.fused_cross_entropy(x, t, -100, "mean", x.dtype != torch.float32)
    loss.backward()
    return loss.detach(), x.grad


def copy_bandwidth() -> float:
    x = torch.randn(8192, 8192, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * x.element_size() / ms / 1e6  # GB/s


def peak_mib(fn, args) -> float:
    # (the last call's gradient stays set: setting it to None here would give fxlite a
    # state it has not seen, whose first call records eager's ops)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*args)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def sweep(x: torch.Tensor, t: torch.Tensor) -> list[list[str]]:
    """Each kernel's ms at each (BLOCK, num_warps), through the module's launch shape."""
    rows, default = [], ce._launch_shape
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            ce._launch_shape = lambda classes, b=block, w=warps: (b, w)
            try:
                ms = triton.testing.do_bench(lambda: fused(x, t), warmup=20, rep=100,
                                             return_mode="median")
                rows.append([str(block), str(warps), f"{ms:.3f}"])
            finally:
                ce._launch_shape = default
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true")
    opts = parser.parse_args()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton "
          f"{triton.__version__}; device-to-device copy {copy_gbs:.0f} GB/s")
    table, out = [], {"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs,
                      "cases": []}
    for name, rows, classes, dtype in CASES:
        x = (torch.randn(rows, classes, device="cuda") * 2).to(dtype).requires_grad_()
        t = torch.randint(0, classes, (rows,), device="cuda")
        t[::8] = -100
        moved = 3 * x.numel() * x.element_size()
        want = loss_and_grad(x, t)
        want = (want[0], want[1].clone())
        torch._dynamo.reset()
        contenders = {"eager": loss_and_grad, "inductor": torch.compile(loss_and_grad),
                      "fxlite": fxlite.compile(loss_and_grad), "fxlite kernels": fused}
        row = {"case": name}
        for label, fn in contenders.items():
            first = first_call_seconds(fn, (x, t))
            ms = triton.testing.do_bench(lambda fn=fn, x=x, t=t: fn(x, t), warmup=20,
                                         rep=200, return_mode="median")
            loss, grad = fn(x, t)
            row[label] = {"ms": ms, "pct_copy": 100 * moved / ms / 1e6 / copy_gbs,
                          "first_s": first, "peak_MiB": peak_mib(fn, (x, t)),
                          "loss_diff": abs(loss.item() - want[0].item()),
                          "grad_diff": (grad.float() - want[1].float()).abs().max().item()}
            r = row[label]
            table.append([name, label, f"{ms:.3f}", f"{r['pct_copy']:.1f}%", f"{first:.2f}",
                          f"{r['peak_MiB']:.0f}", f"{r['loss_diff']:.1e}",
                          f"{r['grad_diff']:.1e}"])
        if opts.sweep:
            row["sweep"] = sweep(x, t)
            print(name, "sweep (BLOCK, warps, ms):", row["sweep"], flush=True)
        row["fxlite_routed"] = "fused_cross_entropy" in getattr(contenders["fxlite"], "code", "")
        out["cases"].append(row)
        del x, t, want, contenders
        torch.cuda.empty_cache()
    print(tabulate(table, headers=["case", "contender", "ms", "% of copy", "first call s",
                                   "peak MiB", "loss diff", "grad diff"],
                   disable_numparse=True))
    print("fxlite.compile routed to the kernels:",
          [c.get("fxlite_routed") for c in out["cases"]])
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
