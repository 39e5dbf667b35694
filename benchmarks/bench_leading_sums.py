"""Sums over leading dims (bias and norm-weight gradients): one kernel, or two.

Run on a CUDA machine::

    PYTHONPATH=$PWD python benchmarks/bench_leading_sums.py

A sum of ``(B, T, C)`` over ``(0, 1)`` is the gradient of a linear's bias over a batch of
tokens (``x * y`` summed: a norm's weight). For each shape, ``generate_kernel`` builds one
kernel for the whole sum, and two for the split ``split_sums`` could make of it: the last
reduced dim first, in float32, then the rest, cast back. Printed: the GPU time of each
(``triton.testing.do_bench_cudagraph``: no host time; inputs of 25 MB or less stay in L2
between replays), of the inner kernel alone, of eager's ``torch.sum`` and of a copy of the
input, and the largest difference of each result from eager's.
"""

from __future__ import annotations

import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reductions import kernel_of  # noqa: E402


def _first(r):
    return r[0] if isinstance(r, (tuple, list)) else r


def _us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def row(shape: tuple[int, ...], dtype: torch.dtype, product: bool) -> None:
    """Time one shape's sum both ways and print the line."""
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    y = torch.randn(*shape, device="cuda", dtype=dtype)
    if product:
        def one(x, y):
            return torch.sum(x * y, (0, 1))

        def inner(x, y):
            return torch.sum(x * y, (1,), keepdim=True, dtype=torch.float32)
        args: tuple = (x, y)
    else:
        def one(x):
            return torch.sum(x, (0, 1))

        def inner(x):
            return torch.sum(x, (1,), keepdim=True, dtype=torch.float32)
        args = (x,)

    def outer(p):
        return torch.sum(p, (0, 1)).to(dtype)

    whole, first = kernel_of(one, list(args)), kernel_of(inner, list(args))
    rest = kernel_of(outer, [_first(first(*args))])

    def two():
        return rest(_first(first(*args)))

    want = one(*args).float()
    errors = [(_first(r).float() - want).abs().max().item() for r in (whole(*args), two())]
    copy = torch.empty_like(x)
    times = [_us(f) for f in (lambda: whole(*args), two, lambda: first(*args),
                              lambda: one(*args), lambda: copy.copy_(x))]
    print(f"{'x*y ' if product else ''}{shape} {str(dtype)[6:]}: one kernel {times[0]:.1f} us, "
          f"two {times[1]:.1f} (inner {times[2]:.1f}), eager {times[3]:.1f}, copy "
          f"{times[4]:.1f}; err one {errors[0]:.2g} two {errors[1]:.2g}", flush=True)


def main() -> None:
    bf16, f32 = torch.bfloat16, torch.float32
    for shape, dtype in (((8, 1024, 768), bf16), ((8, 1024, 2304), bf16), ((8, 1024, 3072), bf16),
                         ((32, 197, 768), f32), ((32, 197, 3072), f32), ((8, 1024, 768), f32),
                         ((16, 128, 512), f32), ((64, 49, 1024), f32), ((2, 4096, 768), bf16)):
        row(shape, dtype, False)
    for shape, dtype in (((8, 1024, 768), bf16), ((32, 197, 768), f32)):
        row(shape, dtype, True)


if __name__ == "__main__":
    main()
