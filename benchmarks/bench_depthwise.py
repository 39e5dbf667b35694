"""Depthwise convolutions in NCHW and channels-last, the layouts fxlite chooses between.

Run on a CUDA machine::

    PYTHONPATH=$PWD python benchmarks/bench_depthwise.py [--json out.json]

``passes/channels_last.py`` converts a conv net's activations to channels-last where
cuDNN's NHWC kernels pay. A depthwise convolution (``groups`` equal to the channels) in
NCHW runs torch's own kernel (``conv_depthwise2d``) or cuDNN's, and in channels-last
cuDNN's NHWC one; which is faster depends on the kernel size and the dtype. One process
times, in microseconds (medians of ``triton.testing.do_bench``), eager's convolution
of each model's depthwise shapes at batch 32 in both layouts, in float32 and bfloat16,
with a copy of the input (the bytes any convolution must read) and ``torch.compile``'s
choice beside them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_report import compiled, median_us, report  # noqa: E402

CASES = [  # (model, channels, side, kernel, stride)
    ("maxvit_t", 256, 56, 3, 1), ("maxvit_t", 512, 28, 3, 1), ("maxvit_t", 1024, 14, 3, 1),
    ("maxvit_t", 512, 56, 3, 2),
    ("mobilenet_v3_large", 72, 56, 3, 1), ("mobilenet_v3_large", 120, 28, 5, 1),
    ("efficientnet_b0", 144, 56, 3, 1), ("efficientnet_b0", 240, 28, 5, 1),
    ("convnext_tiny", 96, 56, 7, 1), ("convnext_tiny", 192, 28, 7, 1),
    ("convnext_tiny", 384, 14, 7, 1),
]
BATCH = 32


def row(model: str, c: int, side: int, k: int, stride: int, dtype: torch.dtype) -> dict[str, Any]:
    """One case's times in both layouts."""
    x = torch.randn(BATCH, c, side, side, device="cuda", dtype=dtype)
    w = torch.randn(c, 1, k, k, device="cuda", dtype=dtype)
    xl, wl = (t.contiguous(memory_format=torch.channels_last) for t in (x, w))
    conv = lambda a, b: F.conv2d(a, b, None, stride, k // 2, 1, c)  # noqa: E731
    inductor = compiled(conv)
    inductor(x, w)
    return {"model": model, "shape": f"{c}x{side}x{side} k{k} s{stride}",
            "dtype": str(dtype).removeprefix("torch."), "copy_us": median_us(lambda: x.clone()),
            "nchw_us": median_us(lambda: conv(x, w)), "channels_last_us": median_us(lambda: conv(xl, wl)),
            "inductor_nchw_us": median_us(lambda: inductor(x, w))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    torch.backends.cudnn.benchmark = False  # (eager's default, which fxlite runs under)
    rows = [row(*case, dtype) for dtype in (torch.float32, torch.bfloat16) for case in CASES]
    report(rows, args.json, f", cuDNN {torch.backends.cudnn.version()}")


if __name__ == "__main__":
    main()
