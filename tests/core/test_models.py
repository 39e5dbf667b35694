"""Realistic models: traced outputs equal eager outputs (and running statistics, in training)."""

from __future__ import annotations

import copy
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import fxlite as fx


def _check(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    """Trace a copy of ``model`` and compare outputs, gradients and module state with eager."""
    eager = model
    traced_src = copy.deepcopy(model)
    gm = fx.symbolic_trace(traced_src)
    gm.graph.lint()
    x_eager = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    x_traced = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    want = eager(*x_eager)
    got = gm(*x_traced)
    assert_close(got, want)
    want.sum().backward()
    got.sum().backward()
    for a, b in zip(x_traced, x_eager):
        if a.grad is not None or b.grad is not None:
            assert_close(a.grad, b.grad)
    for (name, a), (_, b) in zip(traced_src.named_parameters(), eager.named_parameters()):
        assert a.grad is not None, name
        assert_close(a.grad, b.grad, msg=name)
    # Buffers (BatchNorm running statistics) move the same way in both.
    for (name, a), (_, b) in zip(gm.named_buffers(), traced_src.named_buffers()):
        assert a is b, name  # the GraphModule uses the traced module's own buffers
    for (name, a), (_, b) in zip(traced_src.named_buffers(), eager.named_buffers()):
        assert_close(a, b, msg=name)
    return gm


# ---------------------------------------------------------------------- ResNet block
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return F.relu(out + identity)


class TinyResNetStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, stride=2))
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = self.layer1(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_resnet_block(mode):
    model = TinyResNetStage()
    with torch.no_grad():  # non-trivial statistics, so eval mode really uses them
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
    model.train(mode == "train")
    gm = _check(model, torch.randn(4, 3, 16, 16))
    targets = {n.target for n in gm.graph.find_nodes(op="call_module")}
    assert {"layer1.0.conv1", "layer1.0.bn1", "layer1.1.downsample.0", "fc"} <= targets
    adds = gm.graph.find_nodes(op="call_function", target=operator.add)
    assert len(adds) == 2  # one residual per block
    if mode == "train":
        bn = gm.get_submodule("layer1.0.bn1")
        assert int(bn.num_batches_tracked) == 1


# ---------------------------------------------------------------------- Transformer encoder
class EncoderLayer(nn.Module):
    """Post-norm encoder layer written with plain torch ops."""

    def __init__(self, d_model: int = 32, heads: int = 4, ffn: int = 64):
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ff1 = nn.Linear(d_model, ffn)
        self.ff2 = nn.Linear(ffn, d_model)
        self.ln1_w = nn.Parameter(torch.rand(d_model) + 0.5)
        self.ln1_b = nn.Parameter(torch.randn(d_model) * 0.1)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        ctx = (attn @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = F.layer_norm(x + self.proj(ctx), (C,), self.ln1_w, self.ln1_b)
        return self.norm2(x + self.ff2(F.gelu(self.ff1(x))))


def test_transformer_encoder_layer():
    layer = EncoderLayer().eval()
    x = torch.randn(2, 6, 32)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0  # padding in the first sequence
    gm = _check(layer, x, mask)
    fns = {n.target for n in gm.graph.find_nodes(op="call_function")}
    assert {torch.softmax, operator.matmul, F.layer_norm, F.gelu, operator.truediv} <= fns
    methods = {n.target for n in gm.graph.find_nodes(op="call_method")}
    assert {"view", "transpose", "masked_fill", "split", "contiguous"} <= methods
    # The shape is read at run time, so other batch and sequence sizes work too.
    x2, mask2 = torch.randn(3, 5, 32), torch.ones(3, 5, dtype=torch.long)
    assert_close(gm(x2, mask2), layer(x2, mask2))


def test_encoder_stack_with_module_list():
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(EncoderLayer(16, 2, 32) for _ in range(3))

        def forward(self, x, mask):
            for layer in self.layers:
                x = layer(x, mask)
            return x

    model = Encoder().eval()
    gm = _check(model, torch.randn(2, 4, 16), torch.ones(2, 4, dtype=torch.long))
    assert {n.target for n in gm.graph.find_nodes(op="call_module")} >= {
        f"layers.{i}.qkv" for i in range(3)}


# ---------------------------------------------------------------------- MobileNet block
class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int = 4):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.expand = nn.Sequential(nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                                    nn.ReLU6(inplace=True))
        self.depthwise = nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden,
                                   bias=False)
        self.bn_dw = nn.BatchNorm2d(hidden)
        self.pointwise = nn.Conv2d(hidden, cout, 1, bias=False)
        self.bn_pw = nn.BatchNorm2d(cout)

    def forward(self, x):
        h = F.relu6(self.bn_dw(self.depthwise(self.expand(x))))
        h = self.bn_pw(self.pointwise(h))
        return x + h if self.use_res else h


class TinyMobileNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(InvertedResidual(8, 8, 1), InvertedResidual(8, 12, 2),
                                    InvertedResidual(12, 12, 1))

    def forward(self, x):
        return self.blocks(x).mean(dim=(2, 3))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_mobilenet_block(mode):
    model = TinyMobileNet().train(mode == "train")
    gm = _check(model, torch.randn(2, 8, 12, 12))
    dw = gm.get_submodule("blocks.0.depthwise")
    assert dw.groups == dw.in_channels == 32
    adds = gm.graph.find_nodes(op="call_function", target=operator.add)
    assert len(adds) == 2  # blocks 0 and 2 have residuals; block 1 changes shape
    assert len(gm.graph.find_nodes(op="call_function", target=F.relu6)) == 3
