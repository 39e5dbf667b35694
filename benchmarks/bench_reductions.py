"""Reductions alone on the GPU: fxlite's kernel against eager and the device's copy.

Run on a CUDA machine::

    PYTHONPATH=$PWD python benchmarks/bench_reductions.py

Each case is one sum, traced into a one-op graph and compiled by ``generate_kernel`` with
the default launch configuration (printed). Times are ``triton.testing.do_bench`` medians
of the kernel, the same torch call, and ``x.clone()`` of the first input (the copy a
memory-bound reduction can at best approach). The cases are the shapes of resnet18's
BatchNorm statistics (NCHW and channels-last, batch 16) and of a transformer's bias
gradients (sums over the tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from fxlite.codegen.runtime.kernel import generate_kernel
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp
from tabulate import tabulate

import fxlite

CL = torch.channels_last


def _cases(dev: str) -> list[tuple[str, Callable[..., torch.Tensor], list[torch.Tensor]]]:
    def spatial(x):
        return torch.sum(x, (2, 3), keepdim=True)

    def weighted(x, y):
        return torch.sum(x * y, (2, 3), keepdim=True)

    def tokens(x):
        return torch.sum(x, (0,), keepdim=True)

    def r(*shape, cl=False):
        t = torch.randn(*shape, device=dev)
        return t.to(memory_format=CL) if cl else t

    return [
        ("16x64x32x32 channels-last, sum over H, W", spatial, [r(16, 64, 32, 32, cl=True)]),
        ("16x64x32x32 NCHW, sum over H, W", spatial, [r(16, 64, 32, 32)]),
        ("16x64x64x64 channels-last, sum over H, W", spatial, [r(16, 64, 64, 64, cl=True)]),
        ("16x512x4x4 channels-last, sum over H, W", spatial, [r(16, 512, 4, 4, cl=True)]),
        ("16x128x16x16 channels-last, sum(x * y) over H, W", weighted,
         [r(16, 128, 16, 16, cl=True), r(16, 128, 16, 16, cl=True)]),
        ("4096x768, sum over dim 0", tokens, [r(4096, 768)]),
        ("2048x3072, sum over dim 0", tokens, [r(2048, 3072)]),
    ]


def main() -> None:
    import triton.testing

    rows = []
    for label, fn, xs in _cases("cuda"):
        gm = normalize(fxlite.symbolic_trace(fn))
        ShapeProp(gm).propagate(*xs)
        kernel = generate_kernel(gm, xs)
        torch.testing.assert_close(kernel(*xs), fn(*xs), rtol=1e-4, atol=1e-3)
        _, config = kernel._current.config(tuple(xs[0].shape))
        runs = (lambda k=kernel, a=xs: k(*a), lambda f=fn, a=xs: f(*a),
                lambda a=xs: a[0].clone())
        times = [triton.testing.do_bench(run, rep=200) * 1e3 for run in runs]
        rows.append([label, f"{config['ROWS']}, {config['BLOCK_C']}, {config['num_warps']}",
                     *(f"{t:.1f}" for t in times)])
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(tabulate(rows, headers=["case", "rows/program, block, warps", "fxlite us",
                                  "eager us", "copy us"]))


if __name__ == "__main__":
    main()
