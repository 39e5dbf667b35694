"""Attention on PyTorch's math path, compiled (issue 38: T5's encoder).

T5 calls ``scaled_dot_product_attention`` with a float position bias; on a GPU its
layout makes PyTorch take the math path, five eager ops between the two matmuls. The
``decompose`` rule turns it into matmul, one fused kernel (scale, bias, softmax and the
zeros of a row masked whole) and matmul. The math path is forced here, on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.runtime.kernel import interpreting
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxlite

pytest.importorskip("triton")
DEVICE = "cpu" if interpreting() else "cuda"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def t5_attention(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0).transpose(1, 2)


def inputs(length, dtype, requires_grad=False):
    q, k, v = (torch.randn(2, 3, length, 8, device=DEVICE, dtype=dtype,
                           requires_grad=requires_grad) for _ in range(3))
    bias = torch.randn(1, 3, length, length, device=DEVICE, dtype=dtype)
    bias[..., 2, :] = float("-inf")  # query 2 sees no key: zeros, as eager's _safe_softmax
    return q, k, v, bias


def softmax_kernel(c):
    found = [k for k in c.kernels if k.direction == "forward"
             and {"exp", "where"} <= {n.rstrip("_0123456789") for n in k.nodes}]
    assert len(found) == 1, [k.nodes for k in c.kernels]
    return found[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_with_a_bias_is_one_kernel_between_its_matmuls(dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    with sdpa_kernel(SDPBackend.MATH):
        c = fxlite.compile(t5_attention)
        for length in (6, 6, 6, 9, 9):  # fresh inputs each call, then a new length
            args = inputs(length, dtype)
            out, want = c(*args), t5_attention(*args)
            torch.testing.assert_close(out, want, rtol=tol, atol=tol)
            assert out[:, 2].eq(0).all()
    assert c.fallbacks == []
    kernel = softmax_kernel(c)
    assert "amax" in " ".join(kernel.nodes) and "add" in " ".join(kernel.nodes)


def test_attention_gradients_equal_eagers():
    """Training through the decomposed attention: several steps, gradients of q, k, v."""
    with sdpa_kernel(SDPBackend.MATH):
        c = fxlite.compile(t5_attention)
        for _ in range(3):
            args = inputs(6, torch.float32, requires_grad=True)
            twins = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
            c(*args).square().sum().backward()
            t5_attention(*twins).square().sum().backward()
            for a, b in zip(args[:3], twins[:3]):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    softmax_kernel(c)
