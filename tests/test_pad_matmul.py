"""Linear layers with odd output widths run with padded, aligned weights
(``passes/pad_matmul.py``), giving eager's values and layout; the padded copy follows every
write to the weight, through ``.data`` too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fxlite.passes import pad_matmul
from fxlite.passes.pad_matmul import pad_linears, padded_linear
from fxlite.passes.shape_prop import ShapeProp

import fxlite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_padded_linear_gives_aligned_rows_that_start_with_eagers_values(dtype, with_bias):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, dtype=dtype)
    for w in (torch.randn(13, 16, dtype=dtype), torch.randn(16, 13, dtype=dtype).t()):
        b = torch.randn(13, dtype=dtype) if with_bias else None
        torch.empty(4096, dtype=dtype).fill_(float("nan"))  # freed memory the pad may reuse
        with torch.no_grad():
            got, want = padded_linear(x, w, b), F.linear(x, w, b)
        assert got.shape == (2, 3, 16)  # 13 rounded up to 16 bytes' worth
        assert got.stride(-2) * got.element_size() % 16 == 0
        torch.testing.assert_close(got[..., :13], want)
        assert torch.equal(got[..., 13:], torch.zeros_like(got[..., 13:]))  # zero rows


def test_the_padded_copy_follows_every_write_to_the_weight():
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    writes = [lambda: w.mul_(2),  # in place
              lambda: w.data.copy_(torch.randn(5, 8)),  # through .data: no version change
              lambda: setattr(w, "data", torch.randn(5, 8))]  # new storage
    with torch.no_grad():
        for write in writes:
            torch.testing.assert_close(padded_linear(x, w)[:, :5], F.linear(x, w))
            write()
            torch.testing.assert_close(padded_linear(x, w)[:, :5], F.linear(x, w))


def test_calls_autograd_records_run_plain_linear_and_get_gradients():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    padded_linear(x, w).square().sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    F.linear(x, w).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


class Head(torch.nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, rows, bias=False)

    def forward(self, x):  # F.linear: what fxlite.compile's recordings hold
        hidden = torch.relu(F.linear(x, self.proj.weight, self.proj.bias))
        return F.linear(hidden, self.head.weight)


def test_the_pass_routes_only_large_unaligned_linears(monkeypatch):
    monkeypatch.setattr(pad_matmul, "_MIN_FLOPS", 2 * 64 * 32 * 32 + 1)  # proj is too small
    for rows, expect in ((1001, True), (1000, False)):
        gm = fxlite.symbolic_trace(Head(rows))
        x = torch.randn(64, 32)
        ShapeProp(gm).propagate(x)
        assert pad_linears(gm) == expect
        assert ("padded_linear" in gm.code) == expect and gm.code.count("padded_linear") <= 1
        with torch.no_grad():
            got = gm(x)
            torch.testing.assert_close(got, Head.forward(gm, x))
            assert got.is_contiguous()


def test_compiled_the_padded_head_copies_its_columns_in_a_kernel(monkeypatch):
    """The clone of the linear's columns is a graph op: fuse makes it a kernel (here a
    lone copy; the pass runs on CUDA only, so this test says it is on one)."""
    from fxlite.codegen import pipeline

    monkeypatch.setattr(pad_matmul, "_MIN_FLOPS", 0)
    monkeypatch.setattr(pipeline, "_on_gpu", lambda sample: True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # conftest interprets on CPU
    torch.manual_seed(0)
    model = Head(37).eval().to(device)
    compiled = fxlite.compile(model)
    with torch.no_grad():
        for _ in range(3):  # fresh inputs each call
            x = torch.randn(2, 5, 32, device=device)
            got, want = compiled(x), model(x)
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
            got.add_(1)  # the result is the caller's: no other tensor changes
            torch.testing.assert_close(compiled(x), want)
    assert "padded_linear" in compiled.code
    rows = [line.split() for line in compiled.report().splitlines()]
    assert [r[1:3] for r in rows if "clone" in r] == [["pointwise", "clone"]]  # one copy kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fxlite pads on CUDA")
def test_on_the_gpu_an_lm_head_with_an_odd_vocabulary_is_padded():
    torch.manual_seed(0)
    model = Head(50257).cuda().eval().to(torch.bfloat16)
    compiled = fxlite.compile(model)
    with torch.no_grad():
        for step in range(6):
            if step == 3:  # the weight is written in place, then through .data
                model.head.weight.mul_(-2)
            if step == 4:
                model.head.weight.data.mul_(-1)
            if step == 5:  # and then swapped for new storage
                model.head.weight.data = torch.randn_like(model.head.weight)
            x = torch.randn(64, 8, 32, device="cuda", dtype=torch.bfloat16)
            got, want = compiled(x), model(x)
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
            assert got.stride() == want.stride()
    assert "padded_linear" in compiled.code
