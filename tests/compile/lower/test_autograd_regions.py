"""autograd_regions: fused groups joined by table ops differentiate as one region."""

from __future__ import annotations

# First: it sets TRITON_INTERPRET=1 (on CPU) before anything imports triton.
from test_triton_kernels import DEVICE  # isort: skip

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fxlite.codegen.lower.autograd_regions import autograd_regions
from fxlite.passes.decompose import decompose
from fxlite.passes.fuse import fuse
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite


def _fused(fn, *args):
    gm = decompose(normalize(fxlite.symbolic_trace(fn)))
    ShapeProp(gm).propagate(*args)
    return fuse(gm)


def _region_groups(compiled):
    """The regions' graphs among the kernels of a compiled function's last call."""
    return [k.group for seg in compiled._last for k in seg.compiled.kernels
            if getattr(getattr(k, "group", None), "meta", {}).get("fused_kind") == "region"]


def _loss_and_grads(model, x):
    """A training step's loss and gradients (the model's first output, squared)."""
    out = model(x)
    loss = (out[0] if isinstance(out, tuple) else out).float().square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss, grads


def _calls(gm, kind):
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and getattr(gm.get_submodule(n.target), "meta", {}).get("fused_kind") == kind]


def test_groups_joined_by_a_table_op_become_one_region_with_the_same_results():
    # A layer norm by hand over the leading dim: a sum fuse leaves out joins its groups.
    def f(x, w):
        mean = torch.sum(x, 0, keepdim=True) / x.shape[0]
        c = x - mean
        var = torch.sum(c * c, 0, keepdim=True)
        return torch.relu(c * torch.rsqrt(var + 1e-5) * w), mean

    x, w = torch.randn(6, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    gm = _fused(f, x, w)
    assert len(_calls(gm, "pointwise") + _calls(gm, "reduction")) >= 2
    want = gm(x, w)
    out = autograd_regions(gm)
    regions = _calls(out, "region")
    assert len(regions) == 1 and not _calls(out, "pointwise") and not _calls(out, "reduction")
    region = out.get_submodule(regions[0].target)
    assert all(n.op in ("placeholder", "output", "call_function", "call_method")
               for n in region.graph.nodes)  # flat: the groups' ops, inlined
    for got, expected in zip(out(x, w), want):
        torch.testing.assert_close(got, expected)


def test_a_region_never_reaches_across_an_extern_op():
    # g1 -> matmul -> g2 and g1 -> g2: joining g1 and g2 would put the matmul both before
    # and after the region (a cycle), so they stay apart.
    def f(x, m):
        a = torch.relu(x) * 2
        b = torch.matmul(a, m)
        return torch.tanh(b) + a.sum(-1, keepdim=True)

    x, m = torch.randn(4, 4, device=DEVICE), torch.randn(4, 4, device=DEVICE)
    gm = _fused(f, x, m)
    before = len(_calls(gm, "pointwise") + _calls(gm, "reduction"))
    out = autograd_regions(gm)
    assert not _calls(out, "region")
    assert len(_calls(out, "pointwise") + _calls(out, "reduction")) == before
    torch.testing.assert_close(out(x, m), f(x, m))


class _ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(y)) + x)


def test_a_training_step_runs_one_autograd_region_a_batch_norm(monkeypatch):
    # Each training-mode BatchNorm (its statistics in two-stage sums, the normalization,
    # the ReLU and the residual add) is one region: one autograd node, one backward graph.
    # (On a GPU, TF32 convolutions differ between calls by algorithm: 2e-3 after 3 Adam
    # steps with or without regions. Compared in float32 here.)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                          nn.ReLU(inplace=True), _ResBlock(16), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 10)).to(DEVICE)
    eager = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-2)

    def step(net, optimizer, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        return loss

    compiled = fxlite.compile(step)
    for _ in range(3):  # 2 x 16 x 32 x 32: the statistics' sums split in two stages
        x = torch.randn(2, 3, 32, 32, device=DEVICE)
        y = torch.randint(0, 10, (2,), device=DEVICE)
        torch.testing.assert_close(compiled(model, opt, x, y), step(eager, eager_opt, x, y),
                                   rtol=1e-4, atol=1e-5)
    for (name, got), want in zip(model.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
    regions = [k for seg in compiled._last for k in seg.compiled.kernels
               if getattr(getattr(k, "group", None), "meta", {}).get("fused_kind") == "region"]
    assert len(regions) == 3 and compiled.fallbacks == []
    directions = {k.direction for k in compiled.kernels}
    assert directions == {"forward", "backward"}


def test_an_unused_outputs_zero_tangent_is_made_once_and_never_handed_out():
    # A BatchNorm's batch mean is read only by the running-stat update: its tangent is
    # zero on every call. One zero tensor serves every call; a gradient that would be that
    # tensor itself is a copy, so accumulating into it cannot change later calls.
    from fxlite.codegen.lower.autograd import make_autograd_group

    def f(x, b):
        y = torch.relu(x) * b
        return y, y * 2

    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    b = torch.randn(8, device=DEVICE, requires_grad=True)
    gm = _fused(f, x.detach(), b.detach())
    sub = gm.get_submodule("fused_0")
    group = make_autograd_group(sub, [x, b], name="g")
    for _ in range(3):
        x.grad = b.grad = None
        y, m = group(x, b)
        (y * 3).sum().backward()
        torch.testing.assert_close(x.grad, (x > 0) * b.detach() * 3)
        torch.testing.assert_close(b.grad, (torch.relu(x) * 3).sum(0).detach())
        (variant,) = [v for v in group._variants.values() if v is not None]
        assert len(variant._zeros) == 1
        zero = next(iter(variant._zeros.values()))
        assert zero.abs().sum() == 0 and b.grad.data_ptr() != zero.data_ptr()
        b.grad.add_(1)  # what an optimizer or an accumulation may do
    assert zero.abs().sum() == 0


def test_a_reshape_between_groups_keeps_them_apart():
    # Found on a GPT-2 block: a view joined a region, its rule declined the reshape at
    # autodiff time and the whole region ran under eager autograd. Views stay outside.
    def f(x):
        a = torch.relu(x) * 2
        b = a.reshape(4, 2, 4).sum(-1)
        return torch.tanh(b) + 1

    x = torch.randn(4, 8, device=DEVICE)
    out = autograd_regions(_fused(f, x))
    assert not _calls(out, "region")
    torch.testing.assert_close(out(x), f(x))


def test_sibling_sums_over_leading_dims_share_one_kernel():
    # A BatchNorm backward's outer sums read values that are all ready before the first
    # of them: one kernel computes them together (a dependent one stays apart).
    from fxlite.codegen.lower.autograd_pipeline import CompiledGraph

    def f(p, q, r):
        a = torch.sum(p, (0, 2, 3), keepdim=True)
        b = torch.sum(q, (0, 2, 3), keepdim=True)
        c = torch.sum(r * a, (0, 2, 3), keepdim=True)  # reads a: not a sibling of it
        return a, b, c

    args = [torch.randn(16, 8, 1, 1, device=DEVICE) for _ in range(3)]
    gm = decompose(normalize(fxlite.symbolic_trace(f)))
    ShapeProp(gm).propagate(*args)
    compiled = CompiledGraph(gm, args, "backward", "g")
    for _ in range(2):
        args = [torch.randn(16, 8, 1, 1, device=DEVICE) for _ in range(3)]
        for got, want in zip(compiled(*args), f(*args)):
            torch.testing.assert_close(got, want)
    assert compiled.fallbacks == []
    outputs = sorted(len(r.outputs) for r in compiled.records)
    assert outputs == [1, 2]  # a and b together, then c


def test_a_gpt2_blocks_step_runs_its_addmms_inside_regions():
    # transformers' GPT-2 linears are Conv1D: addmm(b, h.view(-1, d), w).view(...), whose
    # sizes the next layer norm reads. The views and the addmm join the groups around
    # them: the norm and c_attn before the attention, then c_proj, the residual, the
    # norm, the MLP and the loss after it. (Groups without a linear between them still
    # join only around per-channel sums: found on an H200, a region of the last residual
    # add and the loss alone kept the GPU longer, 0.67 ms a step against 0.50 in bf16.)
    pytest.importorskip("transformers")
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=256, n_head=4, n_positions=256, attn_implementation="sdpa",
                     resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    block = GPT2Block(cfg).to(DEVICE)
    eager = copy.deepcopy(block)

    compiled = fxlite.compile(_loss_and_grads)
    for _ in range(3):  # fresh inputs after the first call's check
        x = torch.randn(2, 128, 256, device=DEVICE)  # large enough for split_sums
        got, want = compiled(block, x), _loss_and_grads(eager, x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    regions = _region_groups(compiled)
    addmms = [sum(n.startswith("addmm") for n in r.meta["nodes"]) for r in regions]
    assert sorted(addmms) == [1, 3] and compiled.fallbacks == []


@pytest.mark.parametrize("rows", [2, 64])
def test_a_single_channel_half_batch_norm_rounds_its_input_gradient_once(rows):
    # Fuzz seed 10219968 (CPU): a float16 BatchNorm of one channel, near-equal values. Its
    # sums are (1, 1): when only sums with a dim over 1 made regions, its groups stayed
    # apart, and x got two float16 gradients (the mean's sum, and the centred values') of
    # about 30 that cancel to 0.07, each rounded before the engine added them: 0.0703 and
    # -0.0781 where eager's kernel, rounding once, gives 0.0734 and -0.0734.
    def f(x, rm, rv):
        return F.batch_norm(x, rm, rv, training=True, momentum=0.1)

    gen = torch.Generator().manual_seed(0)
    compiled = fxlite.compile(f)
    for call in range(3):
        x = (0.6 + 0.03 * torch.randn(rows, 1, generator=gen)).half().to(DEVICE)
        if call == 0 and rows == 2:
            x = torch.tensor([[0.5903], [0.6499]], dtype=torch.float16, device=DEVICE)
        g = torch.randn(rows, 1, generator=gen).half().to(DEVICE)
        grads, outs = [], []
        for fn in (f, compiled):
            xs = x.clone().requires_grad_()
            stats = (torch.zeros(1, device=DEVICE), torch.ones(1, device=DEVICE))
            y = fn(xs, *stats)
            y.backward(g)
            grads.append(xs.grad)
            outs.append((y.detach(), *stats))
        wide = x.double().requires_grad_()
        F.batch_norm(wide, None, None, training=True).backward(g.double())
        eager_error = (grads[0].double() - wide.grad).abs().max()
        assert (grads[1].double() - wide.grad).abs().max() <= eager_error * 1.5 + 1e-4, call
        for got, want in zip(outs[1], outs[0]):
            torch.testing.assert_close(got, want)
    assert compiled.fallbacks == []
    kinds = [getattr(getattr(k, "group", None), "meta", {}).get("fused_kind")
             for seg in compiled._last for k in seg.compiled.kernels]
    assert "region" in kinds


class _NormMLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 10, bias=False)

    def forward(self, x):
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.head(torch.tanh(x))


@pytest.mark.parametrize("rank", [2, 3])
def test_a_training_step_runs_its_linears_inside_one_region(rank):
    # The groups and the linears between them are one autograd node: the linears' matmuls
    # run from the region's forward and backward (a nanoGPT step's 48 linears were each
    # an addmm, two views and a backward node of three launches).
    torch.manual_seed(0)
    model = _NormMLP().to(DEVICE)
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)

    def step(net, optimizer, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x).flatten(0, -2), y.flatten())
        loss.backward()
        optimizer.step()
        return loss

    compiled = fxlite.compile(step)
    lead = (3, 4) if rank == 3 else (6,)
    for _ in range(3):  # fresh inputs after the first call's check
        x, y = torch.randn(*lead, 16, device=DEVICE), torch.randint(0, 10, lead, device=DEVICE)
        torch.testing.assert_close(compiled(model, opt, x, y), step(eager, eager_opt, x, y),
                                   rtol=1e-4, atol=1e-5)
    for (name, got), want in zip(model.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
    regions = _region_groups(compiled)
    assert len(regions) == 1 and compiled.fallbacks == []
    assert sum(name.startswith("linear") for name in regions[0].meta["nodes"]) == 3


def test_a_region_through_a_linear_never_holds_a_detach():
    # A GAN's step: the discriminator's loss reads gen(z).detach(), and its backward runs
    # before the generator's loss reads gen(z). One autograd node for both ran the
    # generator's part in the first backward, and the second backward found its saved
    # values freed ("Trying to backward through the graph a second time").
    def f(z, w1, w2):
        fake = torch.tanh(F.linear(z, w1))
        return torch.sigmoid(F.linear(fake.detach(), w2)), fake

    z, w1, w2 = (torch.randn(*s, device=DEVICE) for s in ((4, 8), (8, 8), (3, 8)))
    gm = _fused(f, z, w1, w2)
    out = autograd_regions(gm)
    for call in _calls(out, "region"):
        names = out.get_submodule(call.target).meta["nodes"]
        assert not (any(n.startswith("linear") for n in names)
                    and any(n.startswith("detach") for n in names)), names
    for got, want in zip(out(z, w1, w2), f(z, w1, w2)):
        torch.testing.assert_close(got, want)


def test_an_indexing_between_a_group_and_a_linear_keeps_them_apart():
    # vit_b_16's class token: the final norm's group, x[:, 0], the head. The indexing
    # joined as an item of the group's results, and autodiff, which has no rule for it,
    # sent the region to eager autograd.
    def f(x, w, lw, lb):
        return F.linear(F.layer_norm(x, (8,), lw, lb)[:, 0], w)

    args = [torch.randn(2, 5, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE),
            torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE)]
    out = autograd_regions(_fused(f, *args))
    assert not _calls(out, "region")
    torch.testing.assert_close(out(*args), f(*args))


def test_a_region_never_returns_a_view_of_its_input():
    # x.view(-1, 8) read by the linear and returned too: the region's node would hand
    # out a view of memory it did not make
    def f(x, w):
        v = x.view(-1, 8)
        return torch.tanh(F.linear(torch.relu(v), w)), v

    x, w = torch.randn(2, 3, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    out = autograd_regions(_fused(f, x, w))
    for call in _calls(out, "region"):
        assert "view" not in out.get_submodule(call.target).meta["nodes"]
    for got, want in zip(out(x, w), f(x, w)):
        torch.testing.assert_close(got, want)


class _ViewedLinear(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d)

    def forward(self, x):
        h = self.up(self.norm(x)).view(*x.shape[:-1], 3, x.shape[-1])
        return torch.cumsum(h, 2)  # read outside the region


def test_a_view_that_only_later_ops_read_stays_outside_the_region():
    # transformers' GPT-2 reads its attention's input as addmm(...).view(8, 1024, 2304):
    # returned by the region, the view was a copy, a kernel and an activation more for
    # each layer; outside it, it stays a view of the region's result
    torch.manual_seed(0)
    model = _ViewedLinear().to(DEVICE)
    eager = copy.deepcopy(model)

    compiled = fxlite.compile(_loss_and_grads)
    for _ in range(3):  # fresh inputs after the first call's check
        x = torch.randn(2, 5, 16, device=DEVICE)
        torch.testing.assert_close(compiled(model, x), _loss_and_grads(eager, x),
                                   rtol=1e-4, atol=1e-5)
    (region,) = _region_groups(compiled)
    assert "linear" in region.meta["nodes"] and "view" not in region.meta["nodes"]
    assert compiled.fallbacks == []


def test_a_gpt2_lm_training_step_matches_eager_with_its_regions():
    # transformers' GPT2LMHeadModel with clipping, as bench_training trains it: a group's
    # item that only ops after the region read stays with its group (trimming it off as
    # a trailing view broke the rewrite, and the step ran in eager whole). SGD, not
    # AdamW: the keys' bias gets a gradient of rounding noise alone (softmax ignores a
    # shift shared by all keys), which Adam's normalization makes a step of lr's size.
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_head=2, n_layer=2, n_positions=16, vocab_size=64,
                     attn_implementation="sdpa", resid_pdrop=0.0, attn_pdrop=0.0,
                     embd_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).to(DEVICE)
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]

    def step(net, opt, ids):
        loss = net(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    compiled = fxlite.compile(step)
    for _ in range(3):  # fresh inputs after the first call's check
        ids = torch.randint(0, 64, (2, 16), device=DEVICE)
        torch.testing.assert_close(compiled(model, opts[0], ids), step(eager, opts[1], ids),
                                   rtol=1e-4, atol=1e-5)
    for (name, got), want in zip(model.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
    assert compiled.fallbacks == [] and _region_groups(compiled)
