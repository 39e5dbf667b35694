"""Bugs the program fuzzer found only on a GPU (``benchmarks/fuzz.py --device cuda``).

Eager CUDA kernels differ from the CPU's at the edges (infinities, rounding), and Triton's
GPU code differs from its CPU interpreter. Each bug has a test that runs anywhere (on the
graph a rule makes, or on the kernel source) and, where a GPU is present, the program
itself against eager CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fxlite.passes import ShapeProp, decompose

import fxlite

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _decomposed_on(device: str, fn, *inputs):
    """``fn`` traced, its metadata saying ``device``, decomposed, run on the CPU."""
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*inputs)
    for node in gm.graph.nodes:
        if "device" in node.meta:
            node.meta["device"] = torch.device(device)
    return decompose(gm)(*inputs)


def test_rms_norm_row_with_an_infinity_is_nan_as_eager_cuda_gives_it():
    # Eager's CUDA rms_norm accumulates the mean square with Welford's update, so a row
    # holding an infinity comes out all NaN; the CPU kernel gives x * rsqrt(inf), which is
    # 0 where x is finite. The decomposition follows the device it runs on.
    x = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, math.inf], [2.0, 1e30, 1.0]])
    cuda = _decomposed_on("cuda", lambda t: F.rms_norm(t, (3,)), x)
    cpu = _decomposed_on("cpu", lambda t: F.rms_norm(t, (3,)), x)
    torch.testing.assert_close(cpu, F.rms_norm(x, (3,)), equal_nan=True)  # the CPU's rule
    assert cuda[1:].isnan().all()  # the infinite row, and the one whose squares overflow
    torch.testing.assert_close(cuda[0], F.rms_norm(x[:1], (3,))[0])  # finite rows unchanged


@pytest.mark.skipif(not CUDA, reason="eager's CUDA kernel is the reference")
def test_rms_norm_with_infinities_matches_eager_cuda():
    w = torch.randn(5, device="cuda")
    f = lambda t: F.rms_norm(F.silu(t), (5,), w, eps=1e-5)  # noqa: E731
    compiled = fxlite.compile(f)
    for i in range(3):
        x = torch.randn(3, 5, device="cuda")
        if i:
            x[1, -1] = math.inf * (-1) ** i
        torch.testing.assert_close(compiled(x.clone()), f(x), equal_nan=True)
    assert not compiled.fallbacks


def test_float32_division_rounds_correctly_in_kernels():
    # Triton's float32 `/` is an approximate division on GPUs (div.full.f32, up to 2 ulp):
    # trunc(x / x) gave 0 for some x, where eager gives 1. Kernels divide with div_rn.
    from fxlite.codegen.triton import generate_kernel

    def trunc(a):
        return torch.div(a, a, rounding_mode="trunc")

    def true(a):
        return a / (a + 1.0)

    def recip(a):
        return torch.reciprocal(a)

    x = torch.randn(7)
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


@pytest.mark.skipif(not CUDA, reason="eager's CUDA kernel is the reference")
def test_training_batch_norm_running_mean_of_a_channel_with_an_infinity():
    # Eager's CUDA batch_norm accumulates with Welford's update: a channel holding an
    # infinity gets a NaN running mean, where a sum / n gives +-inf.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(3)

        def forward(self, x):
            return self.bn(x) * 2

    eager, mine = M().cuda(), M().cuda()
    compiled = fxlite.compile(mine)
    for i in range(3):
        x = torch.randn(4, 3, device="cuda")
        if i:
            x[1, 0], x[2, 2] = math.inf, -math.inf
        torch.testing.assert_close(compiled(x.clone()), eager(x), equal_nan=True)
        for k, v in eager.state_dict().items():
            torch.testing.assert_close(mine.state_dict()[k], v, equal_nan=True, msg=k)
    assert not compiled.fallbacks
