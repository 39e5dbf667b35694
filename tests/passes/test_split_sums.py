"""split_sums: sums over trailing and earlier dims run as an inner and an outer sum."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from fxlite.codegen.kernels.generate import interpreting
from fxlite.passes.fuse import fuse
from fxlite.passes.fuse.split_sums import split_sums
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite

DEVICE = "cpu" if interpreting() else "cuda"


def _prep(fn, *inputs):
    gm = normalize(fxlite.symbolic_trace(fn))
    ShapeProp(gm).propagate(*inputs)
    return gm


def _sums(gm) -> list[tuple]:
    return [tuple(n.kwargs["dim"]) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.sum]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32,
                                   torch.bool], ids=str)
@pytest.mark.parametrize("keepdim", [True, False])
def test_a_batch_norm_sum_splits_and_keeps_eagers_value(dtype, keepdim):
    def f(x):
        return torch.sum(x, (0, -2, 3), keepdim=keepdim)

    x = (torch.randn(4, 3, 5, 6) * 10).to(dtype)
    gm = _prep(f, x)
    out = split_sums(gm, min_numel=0)
    assert out is not gm and _sums(gm) == [(0, -2, 3)]  # the input module is unchanged
    assert _sums(out) == [(2, 3), (0, 2, 3)]
    for _ in range(2):  # fresh values, and another size of the same rank
        for shape in ((4, 3, 5, 6), (2, 7, 3, 1)):
            x = (torch.randn(shape) * 10).to(dtype)
            got, want = out(x), f(x)
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want)


def test_halves_are_summed_in_float32_and_rounded_once():
    # values whose fp16 partial sums would round: 2049 + 1 per row is not representable
    x = torch.ones(8, 2, 64, 64, dtype=torch.float16)
    x[:, :, 0, 0] = 2048
    gm = split_sums(_prep(lambda x: torch.sum(x, (0, 2, 3)), x), min_numel=0)
    partial = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.sum)
    assert partial.kwargs.get("dtype") == torch.float32
    assert torch.equal(gm(x), torch.sum(x, (0, 2, 3)))


@pytest.mark.parametrize("dims, shape", [
    ((2, 3), (4, 3, 5, 6)),          # trailing only: already one row per kept value
    ((0, 1), (4, 3, 5, 6)),          # leading only
    ((0, 1, 2, 3), (4, 3, 5, 6)),    # everything
    ((0, 2, 3), (4, 3, 1, 1)),       # nothing inside the trailing dims
    ((0, 2, 3), (1, 3, 5, 6)),       # nothing outside them
])
def test_sums_that_gain_nothing_are_left_alone(dims, shape):
    gm = _prep(lambda x: torch.sum(x, dims), torch.randn(shape))
    assert split_sums(gm, min_numel=0) is gm


def test_fuse_puts_the_inner_sum_in_a_kernel_with_its_producer():
    def f(x):
        return torch.sum(torch.relu(x) * 2, (0, 2, 3), keepdim=True)

    x = torch.randn(8, 4, 32, 32)  # 32768 elements: split_sums.MIN_NUMEL
    fused = fuse(_prep(f, x))
    groups = [m for name, m in fused.named_children() if name.startswith("fused_")]
    assert len(groups) == 1 and groups[0].meta["fused_kind"] == "reduction"
    assert {"relu", "mul"} <= set(groups[0].meta["nodes"])
    torch.testing.assert_close(fused(x), f(x))


class _BNReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x))).sum((2, 3))


def _train_side_by_side(monkeypatch, shape, steps):
    """A compiled training-mode ``_BNReLU`` and an eager copy, each run forward and
    backward on the same fresh inputs ``steps`` times; outputs and buffers are checked
    against eager's on the way. Returns ``(model, eager, compiled)``."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = _BNReLU().to(DEVICE).train()
    eager = copy.deepcopy(model)
    compiled = fxlite.compile(model)
    for _ in range(steps):
        x = torch.randn(shape, device=DEVICE)
        got, want = compiled(x), eager(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        got.square().sum().backward()
        want.square().sum().backward()
    for (name, got), want in zip(model.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)
    return model, eager, compiled


def test_training_batch_norm_normalizes_and_relus_in_one_kernel(monkeypatch):
    # The module call writes the running statistics, so the capture marks it impure; the
    # rewrite moves that write to its own call, and the math it leaves in its place must
    # fuse with the ReLU (it was a barrier, so the bias add and the ReLU ran apart).
    model, eager, compiled = _train_side_by_side(monkeypatch, (2, 3, 6, 6), steps=3)
    # (fp32 sums in another order: BatchNorm's backward cancels, so rounding shows)
    torch.testing.assert_close(model.conv.weight.grad, eager.conv.weight.grad, rtol=2e-4,
                               atol=1e-3)
    ops = [set(k.nodes) for k in compiled.kernels if k.direction == "forward"]
    assert any({"relu", "rsqrt"} <= nodes for nodes in ops), ops
    assert not compiled.fallbacks


def test_small_sums_stay_whole_by_default():
    x = torch.randn(4, 3, 5, 6)
    gm = _prep(lambda x: torch.sum(x, (0, 2, 3)), x)
    assert split_sums(gm) is gm
    big = _prep(lambda x: torch.sum(x, (0, 2, 3)), torch.randn(8, 4, 32, 32))
    assert _sums(split_sums(big)) == [(2, 3), (0, 2, 3)]


def test_a_large_training_batch_norm_sums_in_kernels_and_matches_eager(monkeypatch):
    # 8 x 4 x 32 x 32: large enough to split, so the batch statistics run as a reduction
    # kernel over each (n, c) row plus a sum over n, in forward and backward.
    model, eager, compiled = _train_side_by_side(monkeypatch, (8, 3, 32, 32), steps=2)
    # (measured against float64: both off by about 5e-6 of the largest gradient)
    scale = eager.conv.weight.grad.abs().max().item()
    torch.testing.assert_close(model.conv.weight.grad, eager.conv.weight.grad, rtol=0,
                               atol=3e-5 * scale)
    rows = [k for k in compiled.kernels if k.kind == "reduction"]
    assert {"forward", "backward"} <= {k.direction for k in rows}
    assert not compiled.fallbacks
