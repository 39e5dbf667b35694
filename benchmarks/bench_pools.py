"""Pooling kernels: torch's ops, fxlite's Triton kernels and torch.compile side by side.

Run on a CUDA machine::

    PYTHONPATH=$PWD python benchmarks/bench_pools.py [--json out.json]

Each case is a pool that a model runs (resnet50d's 2x2 average pool, inception_v3's 3x3
branch pools, resnet's max-pool stem) on a contiguous and on a channels-last input, in
float32 and bfloat16. One process times, in microseconds (medians of
``triton.testing.do_bench``): a copy of the input (the bytes any pool must read), eager's
op, ``torch.compile``'s kernel and fxlite's (``codegen/kernels/pool.py``), after checking
that fxlite's values equal eager's to the bit.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fxlite.codegen.kernels.pool import avg_pool2d, max_pool2d  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_report import compiled, median_us, report  # noqa: E402

CASES = [  # (name, shape, eager op, fxlite's, arguments)
    ("avg k2 s2 ceil", (32, 256, 56, 56), F.avg_pool2d, avg_pool2d,
     dict(kernel_size=2, stride=2, ceil_mode=True, count_include_pad=False)),
    ("avg k3 s1 p1", (32, 192, 35, 35), F.avg_pool2d, avg_pool2d,
     dict(kernel_size=3, stride=1, padding=1)),
    ("max k3 s2 p1", (32, 64, 112, 112), F.max_pool2d, max_pool2d,
     dict(kernel_size=3, stride=2, padding=1)),
]


def row(name: str, x: torch.Tensor, eager: Any, ours: Any, kwargs: dict) -> dict[str, Any]:
    """One case's times, after checking that fxlite's values equal eager's to the bit."""
    if not torch.equal(ours(x, **kwargs), eager(x, **kwargs)):
        raise SystemExit(f"{name} {x.dtype} {x.stride()}: fxlite differs from eager")
    inductor = compiled(lambda t: eager(t, **kwargs))
    inductor(x)
    return {"case": name, "dtype": str(x.dtype).removeprefix("torch."),
            "layout": "NCHW" if x.is_contiguous() else "channels-last",
            "copy_us": median_us(lambda: x.clone()), "eager_us": median_us(lambda: eager(x, **kwargs)),
            "inductor_us": median_us(lambda: inductor(x)), "fxlite_us": median_us(lambda: ours(x, **kwargs))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    rows = []
    for name, shape, eager, ours, kwargs in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            for t in (x, x.contiguous(memory_format=torch.channels_last)):
                rows.append(row(name, t, eager, ours, kwargs))
    report(rows, args.json)


if __name__ == "__main__":
    main()
