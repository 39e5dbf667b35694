"""Pointwise kernels with a broadcast operand: the launch configs side by side.

Run on a CUDA machine::

    PYTHONPATH=$PWD python benchmarks/bench_pointwise_rows.py [--json out.json]

Three shapes of work that real models launch: ``gelu(x + bias)`` over ``(rows, cols)``
(a linear's bias and activation, as in ConvNeXt's MLP in float32), ``relu(x * s + s)``
over a channels-last NCHW tensor with per-channel ``s`` (BatchNorm and ReLU in resnet50),
and the copy of GPT-2's padded logits into eager's contiguous layout. For each, one
process times a copy of ``x`` (the bytes the kernel must move), eager, ``torch.compile``,
fxlite with its heuristic config (medians of ``triton.testing.do_bench``, in
microseconds), and fxlite's kernel under each candidate config of the rows and flat
variants (``BLOCKxROWS/warps``). Those launch through a slow Python path, so they are
replayed from a CUDA graph (``do_bench_cudagraph``): GPU time alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fxlite.codegen.kernels.layout import memory_order, permute_inputs  # noqa: E402
from fxlite.codegen.runtime.kernel import iteration_space  # noqa: E402

import fxlite  # noqa: E402

# (variant, BLOCK, ROWS, num_warps): rows of one block each (ROWS 1) as before, then
# programs of 1024 elements
CONFIGS = [("rows", 256, 1, 1), ("rows", 512, 1, 2), ("rows", 256, 4, 4), ("rows", 512, 2, 4),
           ("rows", 1024, 1, 4), ("rows", 2048, 1, 8), ("rows", 4096, 1, 8),
           ("pointwise", 1024, 1, 4)]


def bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + b)


def scale_relu(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * s + s)


def head_clone(x: torch.Tensor) -> torch.Tensor:
    return torch.clone(x)


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e3


def case(fn, *args: torch.Tensor) -> dict:
    """One row: copy, eager, inductor, fxlite (heuristic) and fxlite per config."""
    x = args[0]
    compiled = fxlite.compile(fn)
    torch._dynamo.reset()
    inductor = torch.compile(fn)
    for _ in range(3):
        compiled(*args), inductor(*args)
    torch.testing.assert_close(compiled(*args), fn(*args), rtol=2e-2, atol=2e-2)
    (kernel,) = compiled.kernels
    inputs = next(list(i) for i in itertools.permutations(args) if kernel._spec_for(i) is not None)
    order = memory_order(inputs)
    inner = permute_inputs(inputs, order) if order else inputs
    spec = kernel._spec_for(inner)
    shape = iteration_space(list(inner))
    heuristic = spec.config(shape)[1]
    row = {"op": fn.__name__, "dtype": str(x.dtype)[6:], "shape": "x".join(map(str, x.shape)),
           "copy": _us(lambda: x.clone()), "eager": _us(lambda: fn(*args)),
           "inductor": _us(lambda: inductor(*args)), "fxlite": _us(lambda: compiled(*args)),
           "heuristic": f"{heuristic['variant']} {heuristic['BLOCK']}x{heuristic.get('ROWS', 1)}"
                        f"/{heuristic['num_warps']}"}
    for variant, block, nrows, warps in CONFIGS:
        cfg = {"variant": variant, "BLOCK": block, "ROWS": nrows, "num_warps": warps}
        spec.run(inner, shape, cfg)  # compiled before the capture
        row[f"{variant[:4]} {block}x{nrows}/{warps}"] = triton.testing.do_bench_cudagraph(
            lambda c=cfg: spec.run(inner, shape, c), rep=100) * 1e3
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = []
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for n, cols in ((25088, 768), (6272, 1536), (1568, 3072), (25088, 384)):
                x = torch.randn(n, cols, device="cuda", dtype=dtype)
                rows.append(case(bias_gelu, x, torch.randn(cols, device="cuda", dtype=dtype)))
            for c, hw in ((256, 56), (512, 28), (1024, 14), (2048, 7)):
                x = torch.randn(32, c, hw, hw, device="cuda", dtype=dtype)
                x = x.to(memory_format=torch.channels_last)
                rows.append(case(scale_relu, x, torch.randn(c, 1, 1, device="cuda", dtype=dtype)))
            # GPT-2's LM head: the padded logits' first 50,257 columns, made contiguous
            padded = torch.randn(4096, 50264, device="cuda", dtype=dtype)
            rows.append(case(head_clone, padded[:, :50257]))
            print(tabulate([r.values() for r in rows[-9:]], headers=list(rows[-1].keys()),
                           floatfmt=".1f"), flush=True)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
