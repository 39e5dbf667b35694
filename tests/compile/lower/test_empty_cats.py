"""empty_cats: a cat of one tensor and constant empty ones reads that tensor instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fxlite.codegen.lower.empty_cats import cats_without_empties
from fxlite.passes.shape_prop import ShapeProp

import fxlite


class _Cache(nn.Module):
    """transformers' key/value cache in one step: an empty start and the new keys."""

    def __init__(self, how):
        super().__init__()
        self.register_buffer("empty", torch.empty(0))
        self.how = how

    def forward(self, q, w):
        k = F.linear(q, w).view(2, 5, 2, 4).transpose(1, 2)
        if self.how == "input":
            k = q.view(2, 5, 2, 4).transpose(1, 2)
        kk = torch.cat([self.empty, k], -2)
        if self.how == "written":
            k.mul_(2)
        if self.how == "returned":
            return kk
        if self.how == "scaled":  # takes the strides of its input: the view could fail
            return (kk * 2).view(-1).sum()
        if self.how == "viewed":
            kk = torch.reshape(kk, (2, 2, 20))
            return kk.sum()
        return F.scaled_dot_product_attention(kk, kk, kk)


def _args():
    return torch.randn(2, 5, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


def _cats(gm):
    return [n for n in gm.graph.nodes if n.target is torch.cat]


def test_the_attentions_cat_of_an_empty_cache_reads_the_keys_themselves():
    module = _Cache("read")
    gm = fxlite.symbolic_trace(module)
    args = _args()
    ShapeProp(gm).propagate(*args)
    assert _cats(gm) and not _cats(cats_without_empties(gm))
    got, want = gm(*args), module(*args)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), args),
                               torch.autograd.grad(want.sum(), args))


@pytest.mark.parametrize("how", ["input", "written", "returned", "viewed", "scaled"])
def test_a_cat_whose_copy_someone_could_tell_apart_stays(how):
    # the keys are an input's memory, are written after the cat, the copy is returned,
    # read through a view, or by a pointwise op (whose result takes the copy's strides)
    module = _Cache(how)
    gm = fxlite.symbolic_trace(module)
    ShapeProp(gm).propagate(*_args())
    assert len(_cats(cats_without_empties(gm))) == 1


def test_an_empty_of_another_dtype_promotes_and_stays():
    # cat([float32 empty, float64 k]) is float64, but cat([float32 empty, bfloat16 k])
    # is float32: only an empty of the result's dtype is dropped
    def f(k, e):
        return torch.cat([e, k.bfloat16()], 0).sum()

    gm = fxlite.symbolic_trace(f)
    ShapeProp(gm).propagate(torch.randn(3), torch.empty(0))
    assert len(_cats(cats_without_empties(gm))) == 1


def test_a_compiled_training_step_with_a_key_cache_matches_eager():
    module = _Cache("read")

    def step(m, q, w):
        out = m(q, w)
        out.square().mean().backward()
        return out

    compiled = fxlite.compile(step)
    for _ in range(3):  # fresh inputs after the first call's check
        a = _args()
        b = [t.detach().clone().requires_grad_() for t in a]
        torch.testing.assert_close(compiled(module, *a), step(module, *b))
        for x, y in zip(a, b):
            torch.testing.assert_close(x.grad, y.grad)
    assert compiled.fallbacks == []
