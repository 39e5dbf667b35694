"""Reductions alone on the GPU: fxlite's kernel against eager and the device's copy.

Run on a CUDA machine::

    PYTHONPATH=$PWD python benchmarks/bench_reductions.py
    PYTHONPATH=$PWD python benchmarks/bench_reductions.py --sweep   # the sums over tokens

Each case is one sum, traced into a one-op graph and compiled by ``generate_kernel`` with
the default launch configuration (printed). Times are ``triton.testing.do_bench`` medians
of the kernel, the same torch call, and ``x.clone()`` of the first input (the copy a
memory-bound reduction can at best approach). The cases are the shapes of resnet18's
BatchNorm statistics (NCHW and channels-last, batch 16) and of a transformer's bias
gradients (sums over the tokens: GPT-2 124M's, 8 x 1024 tokens in bfloat16, and
ViT-B/16's, 32 x 197 in float32). With ``--sweep``, each sum over the tokens is also timed
under other launch configurations (programs of 8 to 128 kept columns, 32 to 256 tokens a
loop step, 8 or 32 warps), through the kernel's own runner: the heuristic's and the
fastest are printed, with the next four.
"""

from __future__ import annotations

import argparse
import functools
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

    def r(*shape, cl=False, dtype=torch.float32):
        t = torch.randn(*shape, device=dev, dtype=dtype)
        return t.to(memory_format=CL) if cl else t

    bf16 = torch.bfloat16

    return [
        ("16x64x32x32 channels-last, sum over H, W", spatial, [r(16, 64, 32, 32, cl=True)]),
        ("16x64x32x32 NCHW, sum over H, W", spatial, [r(16, 64, 32, 32)]),
        ("16x64x64x64 channels-last, sum over H, W", spatial, [r(16, 64, 64, 64, cl=True)]),
        ("16x512x4x4 channels-last, sum over H, W", spatial, [r(16, 512, 4, 4, cl=True)]),
        ("16x128x16x16 channels-last, sum(x * y) over H, W", weighted,
         [r(16, 128, 16, 16, cl=True), r(16, 128, 16, 16, cl=True)]),
        ("4096x768, sum over dim 0", tokens, [r(4096, 768)]),
        ("2048x3072, sum over dim 0", tokens, [r(2048, 3072)]),
        *((f"8192x{n} bf16, sum over dim 0", tokens, [r(8192, n, dtype=bf16)])
          for n in (768, 2304, 3072)),
        *((f"6304x{n}, sum over dim 0", tokens, [r(6304, n)]) for n in (768, 3072)),
    ]


def kernel_of(fn: Callable[..., torch.Tensor], xs: list[torch.Tensor]) -> object:
    """``fn`` traced into a one-op graph and compiled by ``generate_kernel`` for ``xs``."""
    gm = normalize(fxlite.symbolic_trace(fn))
    ShapeProp(gm).propagate(*xs)
    return generate_kernel(gm, list(xs))


def _column_configs() -> list[dict]:
    """Launches of a sum over the tokens: ``ROWS`` kept columns a program, ``BLOCK_C``
    tokens a loop step."""
    return [{"variant": "looped", "ROWS": rows, "BLOCK_C": block, "num_warps": warps}
            for rows in (8, 16, 32, 64, 128) for block in (32, 64, 128, 256)
            if 1024 <= rows * block <= 8192 for warps in (8, 32)]


def _short(c: dict) -> str:
    return f"R{c['ROWS']} B{c['BLOCK_C']} w{c['num_warps']}"


def sweep(kernel, xs: list[torch.Tensor], heuristic: dict, label: str, copy_us: float) -> None:
    """Print the heuristic's time and the fastest configurations' for one sum."""
    import triton.testing
    from fxlite.codegen.kernels.analysis import iteration_space

    spec = kernel._spec_for(xs)
    shape = iteration_space(list(xs))
    timed = []
    for cfg in [heuristic, *_column_configs()]:
        run = functools.partial(spec.run, xs, shape, cfg)
        try:
            run()
        except Exception:  # a configuration that does not compile
            continue
        timed.append((triton.testing.do_bench(run, rep=100) * 1e3, cfg))
    mine = timed[0][0]
    timed.sort(key=lambda t: t[0])
    print(f"{label}: copy {copy_us:.1f} us; heuristic {_short(heuristic)} {mine:.1f} us; "
          "fastest " + ", ".join(f"{_short(c)} {t:.1f}" for t, c in timed[:5]), flush=True)


def main() -> None:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true",
                        help="also time other launches of the sums over the tokens")
    args = parser.parse_args()
    rows = []
    for label, fn, xs in _cases("cuda"):
        kernel = kernel_of(fn, xs)
        torch.testing.assert_close(kernel(*xs), fn(*xs), rtol=1e-2 if xs[0].dtype ==
                                   torch.bfloat16 else 1e-4, atol=1e-3)
        _, config = kernel._current.config(tuple(xs[0].shape))
        runs = (lambda k=kernel, a=xs: k(*a), lambda f=fn, a=xs: f(*a),
                lambda a=xs: a[0].clone())
        times = [triton.testing.do_bench(run, rep=200) * 1e3 for run in runs]
        rows.append([label, f"{config['ROWS']}, {config['BLOCK_C']}, {config['num_warps']}",
                     *(f"{t:.1f}" for t in times)])
        if args.sweep and "over dim 0" in label:
            sweep(kernel, xs, config, label, times[2])
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(tabulate(rows, headers=["case", "rows/program, block, warps", "fxlite us",
                                  "eager us", "copy us"]))


if __name__ == "__main__":
    main()
