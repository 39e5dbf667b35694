"""Bugs the program fuzzer found only on a GPU (``benchmarks/fuzz.py --device cuda``).

Triton's GPU code differs from its CPU interpreter. Each bug has a test that runs anywhere
(on the kernel source) and, where a GPU is present, the program itself against eager.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fxlite.passes import ShapeProp

import fxlite

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_float32_division_rounds_correctly_in_kernels():
    # Triton's float32 `/` is an approximate division on GPUs (div.full.f32, up to 2 ulp):
    # trunc(x / x) gave 0 for some x, where eager gives 1. Kernels divide with div_rn.
    from fxlite.codegen.runtime.kernel import generate_kernel

    def trunc(a):
        return torch.div(a, a, rounding_mode="trunc")

    def true(a):
        return a / (a + 1.0)

    def recip(a):
        return torch.reciprocal(a)

    x = torch.randn(7, device="cuda" if CUDA else "cpu")
    for fn in (trunc, true, recip):
        gm = fxlite.symbolic_trace(fn)
        ShapeProp(gm).propagate(x)
        body = generate_kernel(gm, (x,)).source.split("@triton.jit")[-1]
        assert "tl.div_rn(" in body and " / " not in body, body


@pytest.mark.skipif(not CUDA, reason="Triton's GPU division is the subject")
def test_trunc_division_of_a_tensor_by_itself_is_one_on_the_gpu():
    compiled = fxlite.compile(lambda a: torch.div(a, a, rounding_mode="trunc"))
    for _ in range(3):
        x = torch.randn(4096, device="cuda")
        assert (compiled(x) == 1).all()
    assert not compiled.fallbacks

