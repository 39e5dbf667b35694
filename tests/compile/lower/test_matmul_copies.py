"""The copies eager's matmul makes of operands whose batch dims do not flatten, as graph
ops (``codegen/lower/matmul_copies.py``), and fuse's sibling groups that then put the
copies of one projection's heads in one kernel with the query's scale."""

from __future__ import annotations

from test_triton_kernels import DEVICE  # isort: skip  (sets TRITON_INTERPRET on CPU)

import pytest
import torch
from fxlite.codegen.lower.matmul_copies import explicit_matmul_copies
from fxlite.passes.fuse import fuse
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _attention(x, w):  # Swin's heads: one projection, q scaled, k and v permuted views
    b, n, c = x.shape
    qkv = torch.matmul(x, w).reshape(b, n, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = torch.matmul(q * 0.5, k.transpose(-2, -1)).softmax(-1)
    return torch.matmul(attn, v).transpose(1, 2).reshape(b, n, c)


def _prepared(fn, *args):
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*args)
    return normalize(gm)


def _clones(gm):
    return [n for n in gm.graph.nodes if n.target is torch.clone]


def test_the_heads_copies_are_clones_and_one_kernel_with_the_scale():
    x, w = torch.randn(3, 5, 8), torch.randn(8, 24)
    gm = explicit_matmul_copies(_prepared(_attention, x, w))
    clones = _clones(gm)
    # the scaled q (eager's mul keeps the permuted layout), k (before its transpose), v
    assert len(clones) == 3, gm.code
    assert all(tuple(c.args[0].meta["tensor_meta"].shape) == (3, 2, 5, 4) for c in clones)
    for _ in range(2):
        x, w = torch.randn(3, 5, 8), torch.randn(8, 24)
        torch.testing.assert_close(gm(x, w), _attention(x, w))
    ShapeProp(gm).propagate(x, w)
    fused = fuse(gm)
    groups = {call.target: fused.get_submodule(call.target).meta["nodes"]
              for call in fused.graph.nodes if call.op == "call_module"}
    heads = [names for names in groups.values() if any(n.startswith("clone") for n in names)]
    assert len(heads) == 1 and any(n.startswith("mul") for n in heads[0]), groups
    torch.testing.assert_close(fused(x, w), _attention(x, w))


def _plain(a, b):
    return torch.matmul(a, b)


@pytest.mark.parametrize("shapes,permuted", [
    (((2, 3, 4, 5), (2, 3, 5, 6)), False),  # row-major batches: views, no copy
    (((2, 3, 4, 5), (5, 6)), True),  # a matrix on the right: eager folds, no bmm copy
    (((2, 3, 4, 5), (3, 5, 6)), True),  # broadcast batch dims
])
def test_operands_eager_does_not_copy_as_such_stay(shapes, permuted):
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1])
    if permuted:
        a = a.transpose(0, 1).contiguous().transpose(0, 1)  # batch dims that do not flatten
    gm = _prepared(_plain, a, b)
    before = gm.code
    assert explicit_matmul_copies(gm).code == before


def _square(x):
    y = x.permute(1, 0, 2, 3)  # batch dims that do not flatten, read as both operands
    return torch.matmul(y, y)


def test_one_operand_read_twice_is_copied_once():
    x = torch.randn(3, 2, 4, 4)
    gm = explicit_matmul_copies(_prepared(_square, x))
    assert len(_clones(gm)) == 1, gm.code
    for _ in range(2):
        x = torch.randn(3, 2, 4, 4)
        torch.testing.assert_close(gm(x), _square(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_compiles_to_eagers_values_over_calls_and_shapes(dtype):
    compiled = fxlite.compile(_attention)
    with torch.no_grad():
        for b, n in [(3, 5), (3, 5), (2, 7)]:
            x = torch.randn(b, n, 8, device=DEVICE, dtype=dtype)
            w = torch.randn(8, 24, device=DEVICE, dtype=dtype)
            torch.testing.assert_close(compiled(x, w), _attention(x, w))
    assert not compiled.fallbacks


def test_in_training_gradients_match_eagers():
    compiled = fxlite.compile(_attention)
    for _ in range(2):
        x = torch.randn(3, 5, 8, device=DEVICE, requires_grad=True)
        w = torch.randn(8, 24, device=DEVICE, requires_grad=True)
        xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
        out, want = compiled(x, w), _attention(xr, wr)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()  # (a fused softmax's backward rounds in another order)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(w.grad, wr.grad, rtol=1e-4, atol=1e-4)


def _einsum_attention(x, w):  # MaxViT's heads: products written as einsums, k scaled
    b, g, p, c = x.shape
    q, k, v = torch.chunk(torch.matmul(x, w), 3, dim=-1)
    q, k, v = (t.reshape(b, g, p, 2, c // 2).permute(0, 1, 3, 2, 4) for t in (q, k, v))
    attn = torch.einsum("B G H I D, B G H J D -> B G H I J", q, k * 0.5).softmax(-1)
    out = torch.einsum("bghij,bghjd->bghid", attn, v)
    return out.permute(0, 1, 3, 2, 4).reshape(b, g, p, c)


def test_einsum_products_are_matmuls_with_the_copies_as_clones_in_one_kernel():
    x, w = torch.randn(2, 3, 5, 8), torch.randn(8, 24)
    gm = explicit_matmul_copies(_prepared(_einsum_attention, x, w))
    assert not [n for n in gm.graph.nodes if n.target is torch.einsum], gm.code
    assert len([n for n in gm.graph.nodes if n.target is torch.matmul]) == 3, gm.code  # (+ qkv)
    # q, the scaled k (eager's mul keeps the permuted layout) and v: eager's einsum
    # copies them
    assert len(_clones(gm)) == 3, gm.code
    for _ in range(2):
        x, w = torch.randn(2, 3, 5, 8), torch.randn(8, 24)
        assert torch.equal(gm(x, w), _einsum_attention(x, w))  # the same bmm operands
    ShapeProp(gm).propagate(x, w)
    fused = fuse(gm)
    groups = [fused.get_submodule(call.target).meta["nodes"]
              for call in fused.graph.nodes if call.op == "call_module"]
    heads = [names for names in groups if any(n.startswith("clone") for n in names)]
    assert len(heads) == 1 and any(n.startswith("mul") for n in heads[0]), groups
    torch.testing.assert_close(fused(x, w), _einsum_attention(x, w))


@pytest.mark.parametrize("equation,shapes", [
    ("bij,bjk->bki", ((2, 3, 4), (2, 4, 5))),  # the result's dims in another order
    ("bij,bkj->bki", ((2, 3, 4), (2, 5, 4))),
    ("...ij,...jk->...ik", ((2, 3, 4), (2, 4, 5))),  # an ellipsis
    ("bij,bjk->bik", ((2, 3, 4), (1, 4, 5))),  # a broadcast batch dim
    ("bij,bij->bij", ((2, 3, 4), (2, 3, 4))),  # no product
    ("ij,jk->ik", ((3, 4), (4, 5))),  # no batch dim
    ("bji,bjk->bik", ((2, 4, 3), (2, 4, 5))),  # the left operand transposed
])
def test_einsums_that_are_no_batched_product_stay(equation, shapes):
    a, b = (torch.randn(s).transpose(0, 1).contiguous().transpose(0, 1) if len(s) == 3
            else torch.randn(s) for s in shapes)
    gm = _prepared(lambda a, b: torch.einsum(equation, a, b), a, b)
    before = gm.code
    assert explicit_matmul_copies(gm).code == before
    assert torch.equal(gm(a, b), torch.einsum(equation, a, b))


def test_einsum_attention_compiles_to_eagers_values_over_calls():
    compiled = fxlite.compile(_einsum_attention)
    with torch.no_grad():
        for b in (2, 2, 3):
            x, w = torch.randn(b, 3, 5, 8, device=DEVICE), torch.randn(8, 24, device=DEVICE)
            torch.testing.assert_close(compiled(x, w), _einsum_attention(x, w))
    assert not compiled.fallbacks
