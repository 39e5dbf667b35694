"""The casts of a segment's inputs as one call (``codegen/lower/batched_casts.py``), and the
matmul family's casts that ``explicit_autocast`` spells out for it to batch."""

from __future__ import annotations

from test_triton_kernels import DEVICE  # isort: skip  (sets TRITON_INTERPRET on CPU)

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fxlite.codegen.lower import batched_casts
from fxlite.codegen.lower.batched_casts import batch_casts, cast_all
from fxlite.passes.shape_prop import ShapeProp

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
BF16 = torch.bfloat16


def test_cast_all_gives_each_tensors_cast_with_tos_strides():
    a, b = torch.randn(4, 6), torch.randn(6, 4).t()  # b: a transposed (dense) layout
    c = torch.randn(8, 8)[::2, 1:5]  # not dense: `to` lays it out row-major
    got = cast_all(BF16, a, b, c)
    for t, g in zip((a, b, c), got):
        want = t.to(BF16)
        assert g.dtype == BF16 and g.stride() == want.stride()
        assert torch.equal(g, want)


def test_cast_all_casts_each_gradient_back_to_its_tensors_dtype():
    w = torch.randn(5, 3, requires_grad=True)
    h = torch.randn(5, 3, dtype=torch.float16, requires_grad=True)
    frozen = torch.randn(3)  # needs no gradient
    unused = torch.randn(2, requires_grad=True)  # its cast is never read
    cw, ch, cf, _ = cast_all(torch.float32, w.to(BF16), h, frozen.double(), unused.half())
    (cw * ch * cf.float()).sum().backward()
    assert unused.grad is None and not frozen.requires_grad
    assert h.grad.dtype == torch.float16 and w.grad.dtype == torch.float32
    want_h = (w.to(BF16).float() * frozen.double().float()).to(torch.float16)
    torch.testing.assert_close(h.grad, want_h, rtol=0, atol=0)


def test_cast_all_is_differentiable_twice():
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    (cx,) = cast_all(torch.float32, x)
    (g,) = torch.autograd.grad((cx ** 3).sum(), x, create_graph=True)
    assert g.dtype == torch.float64
    (gg,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(gg, 6 * x.detach(), rtol=1e-5, atol=1e-5)


def _traced(fn, *args):
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*args)
    return gm


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def _two_layers(x, w0, b0, w1):
    h = F.linear(x.to(BF16), w0.to(BF16), b0.to(BF16))
    return F.linear(h, w1.to(BF16), b0.to(BF16))  # b0 cast twice: one copy


def test_the_casts_of_inputs_that_extern_ops_read_become_one_call():
    args = (torch.randn(3, 4), torch.randn(5, 4), torch.randn(5), torch.randn(5, 5))
    gm = _traced(_two_layers, *args)
    assert batch_casts(gm)
    (call,) = _calls(gm, cast_all)
    assert call.args == (BF16, *[n for n in gm.graph.nodes if n.op == "placeholder"])
    assert not [n for n in gm.graph.nodes if n.target == "to"], gm.code
    torch.testing.assert_close(gm(*args), _two_layers(*args), rtol=0, atol=0)
    assert not batch_casts(gm)  # nothing left to batch


def _two_forwards(x, w):
    y = F.linear(x, w.to(BF16))
    w.mul_(0.5)  # as an optimizer's step: the second cast reads the new weights
    return y, F.linear(x, w.to(BF16))


def test_casts_are_not_batched_across_a_node_with_side_effects():
    x = torch.randn(3, 4, dtype=BF16)
    gm = _traced(_two_forwards, x, torch.randn(5, 4))
    assert batch_casts(gm)
    assert len(_calls(gm, cast_all)) == 2, gm.code
    w = torch.randn(5, 4)
    got, want = gm(x, w.clone()), _two_forwards(x, w.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _dropout_between(x, w0, w1):
    h = F.dropout(F.linear(x, w0.to(BF16)), 0.5)
    return F.linear(torch.dropout(h, 0.5, True), w1.to(BF16))


def _dropout_in_place_between(x, w0, w1):
    h = F.dropout(F.linear(x, w0.to(BF16)), 0.5, inplace=True)  # (a write, as far as known)
    return F.linear(h, w1.to(BF16))


@pytest.mark.parametrize("f, calls", [(_dropout_between, 1), (_dropout_in_place_between, 2)],
                         ids=["draws", "in_place"])
def test_a_random_draw_between_casts_does_not_split_them(f, calls):
    x = torch.randn(3, 4, dtype=BF16)
    gm = _traced(f, x, torch.randn(4, 4), torch.randn(4, 4))
    assert batch_casts(gm)
    assert len(_calls(gm, cast_all)) == calls, gm.code
    assert [a.name for c in _calls(gm, cast_all) for a in c.args[1:]] == ["w0", "w1"]


def test_a_compiled_write_between_two_forwards_is_cast_again():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4)).to(DEVICE)

    def f(m, x):
        with torch.autocast(DEVICE, dtype=BF16):
            y = m(x)
        with torch.no_grad():
            m[1].weight.mul_(0.5)  # the second forward reads (and casts) the new weights
        with torch.autocast(DEVICE, dtype=BF16):  # (a new block: autocast's cache is empty)
            return y + m(x)

    c, mine = fxlite.compile(f), copy.deepcopy(m)
    for _ in range(3):
        x = torch.randn(2, 4, device=DEVICE)
        got, want = c(mine, x), f(m, x)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(mine[1].weight, m[1].weight, rtol=0, atol=0)


class _ReluModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU()

    def forward(self, x, w):
        xb = x.to(BF16)  # relu's group casts as it reads
        return self.relu(xb) + F.linear(xb, w.to(BF16))


def _relu_function(x, w):
    xb = x.to(BF16)
    return torch.relu(xb) + F.linear(xb, w.to(BF16))


@pytest.mark.parametrize("f", [_relu_function, _ReluModule()], ids=["function", "module"])
def test_a_cast_a_fused_group_could_read_is_left_to_the_group(f):
    gm = _traced(f, torch.randn(3, 4), torch.randn(4, 4))
    batch_casts(gm)
    (call,) = _calls(gm, cast_all)
    assert len(call.args) == 2 and call.args[1].name == "w", gm.code
    assert [n.args[0].name for n in gm.graph.nodes if n.target == "to"] == ["x"]


def _gpt2_mlp(dim=16):  # GPT-2's Conv1D: addmm(bias, x.view(-1, dim), weight)
    class Conv1D(nn.Module):
        def __init__(self, nx, nf):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
            self.bias = nn.Parameter(torch.randn(nf) * 0.1)

        def forward(self, x):
            out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
            return out.view(x.shape[:-1] + (self.bias.shape[0],))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(dim)
            self.fc, self.proj = Conv1D(dim, 2 * dim), Conv1D(2 * dim, dim)

        def forward(self, x):
            return x + self.proj(F.gelu(self.fc(self.ln(x))))

    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.LayerNorm(dim)).to(DEVICE)


def test_an_autocast_training_step_matches_eager_with_its_casts_in_one_call(monkeypatch):
    copies = []
    real = batched_casts._copies
    monkeypatch.setattr(batched_casts, "_copies", lambda d, ts: copies.append(len(ts))
                        or real(d, ts))
    base = _gpt2_mlp()

    def step(m, opt, x):
        opt.zero_grad()
        with torch.autocast(DEVICE, dtype=BF16):
            loss = m(x).float().square().mean()
        loss.backward()
        opt.step()
        return loss

    def train(fn):
        torch.manual_seed(1)
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        out = []
        for i in range(5):
            if i == 3:  # state changed between calls
                opt.param_groups[0]["lr"] = 3e-2
            out.append((fn(m, opt, torch.randn(2, 8, 16, device=DEVICE)).detach(),
                        [p.detach().clone() for p in m.parameters()]))
        return out

    want, got = train(step), train(c := fxlite.compile(step))
    for (loss, params), (want_loss, want_params) in zip(got, want):
        torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(params, want_params, rtol=1e-2, atol=1e-3)
    assert c.fallbacks == [] and c.kernels
    # each block's four parameters in one call, forward and backward; the LN's outputs,
    # viewed by addmm, are cast in their groups
    assert copies and max(copies) >= 8, copies


def test_explicit_autocast_leaves_float64_and_code_without_autocast_alone():
    def f(x, w, d):
        return F.linear(x, w), torch.matmul(d, d)

    c = fxlite.compile(f)
    x, w, d = (torch.randn(3, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE),
               torch.randn(2, 2, dtype=torch.float64, device=DEVICE))
    for autocast in (False, True, False):
        with torch.autocast(DEVICE, dtype=BF16, enabled=autocast):
            got, want = c(x, w, d), f(x, w, d)
        assert [g.dtype for g in got] == [t.dtype for t in want]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
