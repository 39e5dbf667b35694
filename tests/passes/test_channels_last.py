"""Channels-last convolutions (``passes/channels_last.py``): the graph's inputs to conv2d
are converted, the layout carries through the net, and what the graph returns has
eager's layout. On the CPU the pass is switched on by hand (fxlite applies it on CUDA)."""

from __future__ import annotations

import contextlib
import copy
import math
import re
import warnings

import fxlite.codegen.lower.segment as segment
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fxlite.passes.channels_last import channels_last_convs
from fxlite.passes.shape_prop import ShapeProp

import fxlite

CL = torch.channels_last
_NOTED: list = []


def _noted(t):
    """A function with an effect (it notes each call), kept by the tracer as a call."""
    _NOTED.append(t.shape)
    return t


fxlite.wrap("_noted")
fxlite.has_side_effect(_noted)


def needs_kernels() -> None:
    """Skip unless Triton kernels run here: the CPU tests need TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from fxlite.codegen.runtime.kernel import interpreting

    if not interpreting():
        pytest.skip("kernels need a GPU or TRITON_INTERPRET=1")


def converts(compiled) -> bool:
    """Whether a compiled function's graph, or one of its kernels' groups, converts to
    channels-last (a conversion fused into a copy kernel leaves the top graph)."""
    groups = [getattr(k, "group", None) for k in compiled.kernels]
    return "channels_last" in compiled.code or any(
        "channels_last" in getattr(g, "code", "") for g in groups)


def traced(fn, *inputs):
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*inputs)
    return gm


def block(x, w1, w2):
    y = F.relu(F.conv2d(x, w1, padding=1))
    return F.conv2d(y, w2, padding=1) + y


def inputs():
    torch.manual_seed(0)
    return torch.randn(2, 4, 6, 6), torch.randn(4, 4, 3, 3), torch.randn(4, 4, 3, 3)


def test_conv_inputs_become_channels_last_and_the_result_keeps_eagers_layout():
    args = inputs()
    gm = traced(block, *args)
    assert channels_last_convs(gm)
    code = gm.code
    # x, and both weights (inputs here): cuDNN would copy a weight to channels-last itself
    assert code.count("memory_format = torch.channels_last") == 3
    seen = {}

    class Spy(fxlite.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            seen[n.name] = out
            return out

    out = Spy(gm).run(*args)
    torch.testing.assert_close(out, block(*args))
    assert out.is_contiguous()  # given back as eager had it
    convs = [v for k, v in seen.items() if k.startswith("conv2d")]
    assert convs and all(c.is_contiguous(memory_format=CL) and not c.is_contiguous()
                         for c in convs)  # the layout carried through both convolutions
    assert args[0].is_contiguous()  # the caller's input itself is untouched


def depthwise_block(x, w_dw, w):
    return F.conv2d(F.conv2d(x, w_dw, padding=1, groups=4), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_graph_with_a_depthwise_conv_becomes_channels_last_in_either_dtype(dtype):
    """Before: float32 graphs with a depthwise convolution stayed NCHW, where torch's NCHW
    depthwise kernel took 2 to 3x cuDNN's NHWC one (``benchmarks/bench_depthwise.py``)."""
    torch.manual_seed(0)
    args = (torch.randn(2, 4, 6, 6), torch.randn(4, 1, 3, 3), torch.randn(4, 4, 1, 1))
    args = tuple(a.to(dtype) for a in args)
    gm = traced(depthwise_block, *args)
    assert channels_last_convs(gm)
    clones = [n for n in gm.graph.nodes if n.target is torch.clone]
    assert clones and clones[0].args[0].name == "x", gm.code  # the input, converted
    for _ in range(2):
        x = torch.randn(2, 4, 6, 6).to(dtype)
        torch.testing.assert_close(gm(x, *args[1:]), depthwise_block(x, *args[1:]))


def test_tensors_that_are_channels_last_already_are_not_copied():
    """A regression: converting with ``clone`` copied depthwise weights (one input channel)
    and 1x1 weights, that ``contiguous`` had returned as they were: 18 more kernels in
    convnext_tiny."""
    from fxlite.passes.normalize import normalize

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1, groups=4),
                          nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3)).to(torch.bfloat16).eval()
    x = torch.randn(2, 3, 6, 6, dtype=torch.bfloat16)
    gm = normalize(fxlite.symbolic_trace(model))
    ShapeProp(gm).propagate(x)
    assert channels_last_convs(gm)
    copied = [n.args[0].target for n in gm.graph.nodes if n.target is torch.clone
              and n.args[0].op == "get_attr"]
    assert copied == ["0.weight", "3.weight"], gm.code  # not the depthwise or 1x1 ones
    torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize("tail", ["view", "permute", "stride"])
def test_a_layout_sensitive_use_leaves_the_graph_unchanged(tail):
    def fn(x, w):
        y = F.conv2d(x, w)
        if tail == "view":
            return y.view(y.shape[0], -1)
        if tail == "permute":
            return y.permute(0, 2, 3, 1)
        return y * y.stride(1)

    x, w = torch.randn(2, 3, 5, 5), torch.randn(4, 3, 1, 1)
    gm = traced(fn, x, w)
    before = gm.code
    assert not channels_last_convs(gm)
    assert gm.code == before


@pytest.mark.parametrize("tail", ["pooled", "flatten", "reshape_unsqueeze"])
def test_a_result_reshaped_from_a_converted_value_gets_eagers_strides(tail):
    """squeezenet returns ``torch.flatten(pool, 1)``: the pass once left such a graph NCHW
    (a returned view), and its convolutions ran cuDNN's NCHW kernels on the GPU."""
    def fn(x, w):
        y = F.relu(F.conv2d(x, w, padding=1))
        if tail == "pooled":
            return torch.flatten(F.adaptive_avg_pool2d(y, 1), 1)
        if tail == "flatten":
            return y.flatten(1)
        return y.reshape(2, 4, -1).unsqueeze(0)

    x, w = torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3)
    gm = traced(fn, x, w)
    assert channels_last_convs(gm)
    got, want = gm(x, w), fn(x, w)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()


def test_a_compiled_squeezenet_like_net_runs_channels_last_and_returns_eagers_strides(
        channels_last_on_cpu):
    class Fire(nn.Module):
        def __init__(self):
            super().__init__()
            self.squeeze = nn.Conv2d(8, 4, 1)
            self.e1, self.e3 = nn.Conv2d(4, 6, 1), nn.Conv2d(4, 6, 3, padding=1)

        def forward(self, x):
            s = F.relu(self.squeeze(x))
            return torch.cat([F.relu(self.e1(s)), F.relu(self.e3(s))], 1)

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), Fire(), nn.Conv2d(12, 5, 1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()
    f = fxlite.compile(model)
    with torch.no_grad():
        for n in (2, 2, 3):
            x = torch.randn(n, 3, 9, 9)
            got, want = f(x), model(x)
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
    assert converts(f)


def test_a_reshaped_result_whose_base_is_returned_too_leaves_the_graph_unchanged():
    def fn(x, w):
        y = F.conv2d(x, w)
        return y, y.flatten(1)  # eager's two results share memory

    x, w = torch.randn(2, 3, 5, 5), torch.randn(4, 3, 1, 1)
    gm = traced(fn, x, w)
    before = gm.code
    assert not channels_last_convs(gm)
    assert gm.code == before


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        y = self.bn2(self.conv2(y)) + y
        y = y.relu_()
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1)), y


class _Mixed(nn.Module):
    """A value made contiguous again between convs, a mean kept as (N, C, 1, 1), a gate,
    a cat and a pool: layouts that do not all carry channels-last."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 6, 3, padding=1)
        self.b = nn.Conv2d(6, 6, 1)

    def forward(self, x):
        y = F.relu(self.a(x))
        z = self.b(y.contiguous())
        gate = torch.sigmoid(z.mean((2, 3), keepdim=True))
        return F.avg_pool2d(torch.cat([z * gate, y], 1), 2) + 1


@pytest.mark.parametrize("weight", ["plain", "channels_last"])
@pytest.mark.parametrize("pooled", ["plain", "channels_last"])
def test_a_convs_metadata_on_an_n_c_1_1_value_has_eagers_strides(pooled, weight):
    """An (N, C, 1, 1) tensor is both NCHW and channels-last by shape; oneDNN and cuDNN
    give a conv channels-last strides when its input's or weight's strides read as
    channels-last (``suggest_memory_format``), ``(C', 1, C', C')``. The metadata said
    ``(C', 1, 1, 1)``, so after the channels-last conversion the groups after the 1 x 1
    convs of efficientnet_b0's and mobilenet_v3's squeeze-and-excitation were planned for
    the wrong strides and compiled again at the first call (H200: 2 and 3 late compiles).
    Eager here is the CPU's oneDNN, whose rule is cuDNN's."""
    from fxlite.passes.shape_prop import _conv_layout

    strides = {"plain": (8, 1, 1, 1), "channels_last": (8, 1, 8, 8)}
    x = torch.empty_strided((2, 8, 1, 1), strides[pooled]).normal_()
    w = torch.empty_strided((4, 8, 1, 1), strides[weight]).normal_()
    meta = [t.to("meta") for t in (x, w)]
    got = _conv_layout(torch.conv2d, tuple(meta), torch.conv2d(*meta))
    want = torch.conv2d(x, w)
    assert (got.shape, got.stride()) == (want.shape, want.stride())


class _SqueezeExcite(nn.Module):
    """torchvision's squeeze-and-excitation (efficientnet, mobilenet_v3): 1 x 1 convs on an
    (N, C, 1, 1) pool, whose layout is both NCHW and channels-last by its strides."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)

    def forward(self, x):
        y = F.silu(self.conv(x))
        s = F.relu(self.fc1(F.adaptive_avg_pool2d(y, 1)))
        return y * torch.sigmoid(self.fc2(s))


@pytest.mark.parametrize("model", ["Net", "_Mixed", "_SqueezeExcite"])
@pytest.mark.parametrize("source", ["tensor_meta", "tensor_meta_rec"])
def test_the_metadata_gives_the_layout_each_value_has_after_the_conversion(source, model):
    """The parallel precompile plans kernels from the metadata: left in eager's layout, a
    BatchNorm group after a converted conv was planned for NCHW and compiled again, at the
    first call, for the channels-last tensors it was given. In a squeeze-and-excitation
    block the (N, C, 1, 1) values are both layouts by shape: their convs and pointwise
    ops follow eager's rules (``_conv_layout``, ``_pointwise_layout``), which the meta
    kernels do not."""
    from fxlite.passes.normalize import normalize

    torch.manual_seed(0)
    model = globals()[model]().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = normalize(fxlite.symbolic_trace(model))  # modules as functions: conv2d, batch_norm
    ShapeProp(gm).propagate(x)
    if source == "tensor_meta_rec":  # as fxlite.compile records it
        for n in gm.graph.nodes:
            tm = n.meta.pop("tensor_meta", None)
            if hasattr(tm, "stride"):
                n.meta["tensor_meta_rec"] = (tuple(tm.shape), tuple(tm.stride), tm.dtype,
                                             x.device, tm.requires_grad)
    assert channels_last_convs(gm)
    seen = {}

    class Spy(fxlite.Interpreter):
        def run_node(self, n):
            seen[n] = out = super().run_node(n)
            return out

    with torch.no_grad():
        Spy(gm).run(x)
    described = [(n, seen[n]) for n in gm.graph.nodes
                 if isinstance(seen.get(n), torch.Tensor) and n.meta.get(source) is not None]
    relaid = [n for n, v in described if v.dim() == 4 and not v.is_contiguous()]
    assert len(relaid) >= (6 if model == "Net" else 2), gm.code  # convs, BatchNorms, relus...
    for n, value in described:
        meta = n.meta[source]
        shape, stride = (meta[0], meta[1]) if source == "tensor_meta_rec" else \
            (meta.shape, meta.stride)
        assert (tuple(shape), tuple(stride)) == (value.shape, value.stride()), n.format_node()


def test_recomputing_the_metadata_runs_no_effect_of_the_graph():
    """Only pure ops and in-place torch ops are run again (on meta tensors) for their
    layout: a function with effects downstream of a converted conv is not called."""
    def fn(x, w):
        y = torch.relu_(F.conv2d(x, w, padding=1))
        return _noted(y) * 2

    x, w = torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3)
    gm = traced(fn, x, w)
    assert len(_NOTED) == 1  # ShapeProp's run
    assert channels_last_convs(gm)
    assert len(_NOTED) == 1
    relu = next(n for n in gm.graph.nodes if n.name.startswith("relu"))
    assert relu.meta["tensor_meta"].memory_format is CL  # the in-place op was run on meta
    out = gm(x, w)
    assert len(_NOTED) == 2 and out.stride() == fn(x, w).stride()


@pytest.fixture
def channels_last_on_cpu(monkeypatch):
    calls = []

    def wanted(sample):
        calls.append(1)
        return True
    monkeypatch.setattr(segment, "channels_last_wanted", wanted)
    return calls


@pytest.mark.parametrize("backend", ["python", "triton"])
def test_a_compiled_conv_net_with_channels_last_matches_eager(backend, channels_last_on_cpu):
    if backend == "triton":
        needs_kernels()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    compiled = fxlite.compile(model, backend=backend)
    for _ in range(3):  # training mode: batch statistics and running-stat updates
        x = torch.randn(2, 3, 8, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            logits, feats = compiled(x)
        want_logits, want_feats = ref(x)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(feats, want_feats, rtol=1e-4, atol=1e-5)
        assert feats.stride() == want_feats.stride()  # eager's layout, not channels-last
        torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=1e-4, atol=1e-5)
    assert channels_last_on_cpu
    assert converts(compiled)


class PaddedStem(nn.Module):
    """timm's tf_ models: "same" padding pads the image, then a stride-2 conv reads it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, bias=False)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)

    def forward(self, x):
        y = F.silu(self.conv(F.pad(x, [0, 1, 0, 1])))
        return self.dw(y) + y


def test_an_input_padded_before_its_conv_becomes_channels_last_at_the_pad(channels_last_on_cpu):
    """Before: only a conv reading a graph input directly converted it, so a net whose stem
    pads first ran every conv NCHW (tf_efficientnet_b0 in bfloat16 on an H200: its 16
    depthwise convolutions in torch's NCHW kernel, 978 us a call, and 22 layout copies
    inside cuDNN). The input is converted where the pad reads it; the pad keeps the layout."""
    model = PaddedStem().to(torch.bfloat16).eval()

    def stem(x, w, w_dw):
        y = F.silu(F.conv2d(F.pad(x, [0, 1, 0, 1]), w, stride=2))
        return F.conv2d(y, w_dw, padding=1, groups=8) + y

    weights = model.conv.weight.detach(), model.dw.weight.detach()
    gm = traced(stem, torch.randn(2, 3, 9, 9).to(torch.bfloat16), *weights)
    assert channels_last_convs(gm)
    pad = next(n for n in gm.graph.nodes if n.target is F.pad)
    assert pad.args[0].kwargs.get("memory_format") == CL  # the pad reads the converted input
    compiled = fxlite.compile(model, backend="python")
    for k in range(3):
        x = torch.randn(2, 3, 9 + 2 * k, 9).to(torch.bfloat16)
        with torch.no_grad():
            got, want = compiled(x), model(x)
        torch.testing.assert_close(gm(x, *weights), want)
        torch.testing.assert_close(got, want)
        assert got.stride() == want.stride()
    assert channels_last_on_cpu and converts(compiled)


def test_a_training_step_with_channels_last_gives_eagers_gradients(channels_last_on_cpu):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)

    def loss_of(m, x):
        logits, _ = m(x)
        return logits.square().mean()

    def step(m, x):
        loss = loss_of(m, x)
        loss.backward()
        return loss

    compiled = fxlite.compile(step, backend="python")
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        torch.testing.assert_close(compiled(model, x), step(ref, x_ref))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
            assert p.grad.stride() == q.grad.stride(), name
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
        assert x.grad.stride() == x_ref.grad.stride()
    assert "channels_last" in compiled.code


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.b.weight = self.a.weight  # one weight, two convolutions

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_weight_two_convs_share_is_converted_once(channels_last_on_cpu):
    torch.manual_seed(0)
    model = Shared().eval()
    compiled = fxlite.compile(model, backend="python")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4, 6, 6)
            torch.testing.assert_close(compiled(x), model(x))
    # the recording reads the shared weight once; one conversion serves both convs
    assert compiled.code.count("clone(_weight") + compiled.code.count("clone(a_weight") == 1, \
        compiled.code
    assert compiled.code.count("torch.conv2d") == 2


def test_a_compiled_model_follows_weight_writes_through_data(channels_last_on_cpu):
    # EMA teachers and old init code write weights through .data, which changes no
    # version counter: the compiled model must still compute with the new values
    torch.manual_seed(0)
    model = Net().eval()
    compiled = fxlite.compile(model)
    writes = [lambda: None, lambda: model.conv1.weight.data.mul_(-2),
              lambda: model.bn1.running_var.data.add_(1.0),
              lambda: model.conv2.weight.data.copy_(torch.randn_like(model.conv2.weight))]
    with torch.no_grad():
        for write in writes:
            write()
            for _ in range(2):
                x = torch.randn(2, 3, 8, 8)
                got, want = compiled(x), model(x)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert channels_last_on_cpu and converts(compiled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fxlite applies it on CUDA")
def test_on_the_gpu_a_conv_net_runs_channels_last(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # eager's exact algorithms
    torch.manual_seed(0)
    model = Net().cuda().eval()
    compiled = fxlite.compile(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 3, 16, 16, device="cuda")
            (logits, feats), (want_logits, want_feats) = compiled(x), model(x)
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(feats, want_feats, rtol=1e-4, atol=1e-5)
            assert feats.stride() == want_feats.stride()
    assert converts(compiled)


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.c3 = nn.Conv2d(3, 4, 3, padding=1)
        self.c1 = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.c1(torch.relu(self.c3(x)))


def test_conv_weights_are_converted_in_the_graph_and_follow_every_write():
    from fxlite.passes.normalize import normalize

    torch.manual_seed(0)
    model = Stem().eval()
    gm = normalize(fxlite.symbolic_trace(model))
    x = torch.randn(2, 3, 6, 6)
    ShapeProp(gm).propagate(x)
    assert channels_last_convs(gm)
    weights = [n for n in gm.graph.nodes if n.target is torch.clone and n.args[0].op == "get_attr"]
    assert len(weights) == 1  # the 3x3 weight; a 1x1 weight is channels-last already
    writes = {2: lambda: model.c3.weight.mul_(-1),  # in place
              3: lambda: model.c3.weight.data.mul_(3),  # through .data: no version change
              4: lambda: setattr(model.c3.weight, "data", torch.randn(4, 3, 3, 3))}
    with torch.no_grad():
        for step in range(5):
            writes.get(step, lambda: None)()
            x = torch.randn(2, 3, 6, 6)
            torch.testing.assert_close(gm(x), model(x))
    x = torch.randn(2, 3, 6, 6)  # gradients reach the weight through the conversion
    got = torch.autograd.grad(gm(x).sum(), model.c3.weight)[0]
    torch.testing.assert_close(got, torch.autograd.grad(model(x).sum(), model.c3.weight)[0])


def test_training_batch_norm_keeps_a_channels_last_input_channels_last_on_every_call():
    # The batch norm's centred values come out of a reduction kernel, which stores them in
    # the layout its metadata says; autodiff's metadata said row-major for every pointwise
    # result, so from the second call on the output (and the next conv's input) was NCHW.
    from fxlite.codegen.runtime.kernel import interpreting

    device = "cpu" if interpreting() else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("kernels need a GPU or TRITON_INTERPRET=1")
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8).to(device).train()
    ref = copy.deepcopy(bn)
    compiled = fxlite.compile(lambda y: torch.relu(bn(y)))
    for _ in range(3):
        y = torch.randn(2, 8, 5, 5, device=device).to(memory_format=CL).requires_grad_()
        y_ref = y.detach().clone().requires_grad_()
        got, want = compiled(y), torch.relu(ref(y_ref))
        torch.testing.assert_close(got, want)
        assert got.stride() == want.stride()
        g = torch.randn(2, 8, 5, 5, device=device).to(memory_format=CL)
        got.backward(g)
        want.backward(g)
        torch.testing.assert_close(y.grad, y_ref.grad, rtol=1e-4, atol=1e-5)
        assert y.grad.stride() == y_ref.grad.stride()
    assert compiled.kernels and not compiled.fallbacks


def test_the_conversions_are_copy_kernels_that_follow_weight_writes(channels_last_on_cpu):
    """The input's and the 3x3 weight's conversions to channels-last are Triton copy
    kernels (torch's own copy took 95 us a call for resnet50's 18 conversions in float32 on
    an H200), each writing eager's channels-last strides for the convolution, and they
    read the weight again on every call."""
    needs_kernels()
    torch.manual_seed(0)
    model = Stem().eval()
    compiled = fxlite.compile(model)
    with torch.no_grad():
        for step in range(4):
            if step == 2:
                model.c3.weight.data.mul_(-3)  # no version change: read again all the same
            x = torch.randn(2, 3, 6, 6)
            torch.testing.assert_close(compiled(x), model(x))
        copies = [k for k in compiled.kernels
                  if [n.target for n in k.group.graph.nodes if n.op == "call_function"]
                  == [torch.clone]]
        assert len(copies) == 2, [k.group.code for k in compiled.kernels]  # x and c3's weight
        for t in (torch.randn(2, 3, 6, 6), model.c3.weight):
            (copy,) = [k for k in copies if k.group.graph.find_nodes(op="placeholder")[0].meta[
                "tensor_meta"].shape == t.shape]
            out = copy(t)
            assert out.is_contiguous(memory_format=CL) and not out.is_contiguous()
            torch.testing.assert_close(out, t, rtol=0, atol=0)
    assert not compiled.fallbacks


@pytest.mark.parametrize("fmt, shape", [(CL, (4, 3, 3, 3)), (torch.channels_last_3d, (4, 3, 3, 3, 3))],
                         ids=["2d", "3d"])
def test_a_clone_to_channels_last_that_no_kernel_reads_is_a_kernel_with_eagers_strides(fmt, shape):
    needs_kernels()
    compiled = fxlite.compile(lambda w: torch.clone(w, memory_format=fmt))
    for _ in range(3):  # fresh values each call
        w = torch.randn(*shape)
        got, want = compiled(w), torch.clone(w, memory_format=fmt)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.stride() == want.stride()
    assert len(compiled.kernels) == 1 and not compiled.fallbacks


def test_a_step_that_takes_the_model_converts_its_weights_and_gives_contiguous_grads(
        channels_last_on_cpu):
    """A training step that takes the model as an argument sees its weights as inputs,
    not attributes; they were left NCHW, so cuDNN copied each one to channels-last in the
    forward, again in the backward, and AccumulateGrad copied the channels-last gradient
    back (resnet18 on an H200: 51 strided copies, 194 us a step). Now the weight's
    conversion is a copy kernel whose backward kernel writes the gradient in the weight's
    own layout, so the optimizer sees eager's strides."""
    needs_kernels()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)}

    def step(m, opt, x):
        opt.zero_grad(set_to_none=True)
        logits, _ = m(x)
        loss = logits.square().mean()
        loss.backward()
        opt.step()
        return loss

    from torch.utils._python_dispatch import TorchDispatchMode

    weights = []  # (op, whether the weight it got is channels-last)

    class Convs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.convolution.default,
                        torch.ops.aten.convolution_backward.default):
                w = args[1] if func is torch.ops.aten.convolution.default else args[2]
                weights.append((func.__name__, w.is_contiguous(memory_format=CL)))
            return func(*args, **(kwargs or {}))

    compiled = fxlite.compile(step)
    for i in range(3):  # fresh inputs, and weights the optimizer changed
        x = torch.randn(2, 3, 8, 8)
        with Convs() if i == 2 else contextlib.nullcontext():
            got = compiled(model, opts[id(model)], x)
        torch.testing.assert_close(got, step(ref, opts[id(ref)], x), rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
            assert p.grad.stride() == q.grad.stride(), name
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    clones = [k for k in compiled.kernels
              if [n.target for n in k.group.graph.nodes if n.op == "call_function"] == [torch.clone]]
    directions = sorted(k.direction for k in clones)
    # conv1's and conv2's weights go to channels-last (forward) and their grads back
    assert directions.count("backward") == 2, [k.group.code for k in clones]
    assert directions.count("forward") >= 2
    # no conv gets an NCHW weight to convert again (forward and backward)
    assert len(weights) == 4 and all(cl for _, cl in weights), weights
    assert not compiled.fallbacks


@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("source", ["contiguous", "channels_last", "transposed", "sliced"])
def test_a_clone_into_a_memory_format_has_that_format_on_every_call(fmt, source):
    """A regression: a pointwise kernel iterates in its inputs' memory order, and so gave
    a clone into contiguous format of a channels-last input a channels-last result from
    the second call on (a conv weight's gradient, which AccumulateGrad then copied)."""
    needs_kernels()
    make = {"contiguous": lambda t: t, "channels_last": lambda t: t.to(memory_format=CL),
            "transposed": lambda t: t.transpose(2, 3),
            # channels-last order, but H and W do not merge: no tiles over them
            "sliced": lambda t: t.to(memory_format=CL)[..., :3]}[source]
    compiled = fxlite.compile(lambda t: torch.clone(t, memory_format=fmt))
    for _ in range(3):
        x = make(torch.randn(4, 3, 5, 5))
        got, want = compiled(x), torch.clone(x, memory_format=fmt)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.stride() == want.stride()
    assert len(compiled.kernels) == 1 and not compiled.fallbacks


@pytest.mark.parametrize("to_cl", [True, False], ids=["to_channels_last", "to_contiguous"])
@pytest.mark.parametrize("shape", [(8, 8, 3, 3), (2, 3, 17, 5), (4, 70, 6, 6), (3, 5, 4, 3, 2)],
                         ids=str)
def test_a_layout_conversion_runs_as_tiles_of_a_transpose(to_cl, shape):
    """A copy between contiguous and channels-last reads along one layout and writes
    along the other; its kernel's transpose variant takes tiles, loaded along the
    input's contiguous dims and stored along the output's."""
    needs_kernels()
    cl = CL if len(shape) == 4 else torch.channels_last_3d
    fmt, source = (cl, torch.contiguous_format) if to_cl else (torch.contiguous_format, cl)
    compiled = fxlite.compile(lambda t: torch.clone(t, memory_format=fmt))
    for _ in range(3):
        x = torch.randn(*shape).contiguous(memory_format=source)
        got, want = compiled(x), torch.clone(x, memory_format=fmt)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.stride() == want.stride()
    (kernel,) = compiled.kernels
    spec = kernel._current
    assert "transpose" in spec.fns
    counts, cfg = spec.config(tuple(shape))
    assert cfg["variant"] == "transpose"
    spatial = math.prod(shape[2:])
    assert {counts["lena"], counts["lenb"]} == {spatial, shape[1]}


class Tower(nn.Module):
    """Four 3x3 convolutions (one weight read twice) and a 1x1, inception-like."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, (1, 3), padding=(0, 1))
        self.c = nn.Conv2d(8, 8, (3, 1), padding=(1, 0))
        self.d = nn.Conv2d(8, 5, 1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        y = self.c(torch.relu(self.b(y))) + self.b(y)
        return self.d(y)


def test_inference_converts_its_weights_in_one_kernel_that_follows_every_write(
        channels_last_on_cpu):
    """In inference the weights' conversions are one call of ``channels_last_copies``, one
    kernel for all of them (inception_v3 launched 38 copy kernels a forward on an H200,
    each costing host time); it gives each weight's values to the bit in channels-last
    strides, and reads the weights again on every call (a write through ``.data`` changes
    no version counter). In training the conversions stay clones that autograd follows."""
    needs_kernels()
    from fxlite.codegen.kernels import weights
    from fxlite.codegen.kernels.weights import channels_last_copies

    torch.manual_seed(0)
    model = Tower().eval()
    compiled = fxlite.compile(model)
    weights._PREPARED.clear()
    with torch.no_grad():
        for step in range(4):
            if step == 2:
                model.c.weight.data.mul_(-3)
            x = torch.randn(2, 3, 7, 6)
            torch.testing.assert_close(compiled(x), model(x))
    assert len(re.findall(r"= channels_last_copies\w*\(", compiled.code)) == 1, compiled.code
    assert not compiled.fallbacks
    ws = (model.a.weight, model.b.weight, model.c.weight, model.d.weight.half())
    assert [k[0] for k in weights._PREPARED] == [tuple(w.shape for w in ws[:3])]  # ran
    weights._PREPARED.clear()
    with torch.no_grad():  # parameters themselves: the kernel, not clones
        outs = channels_last_copies(*ws[:3])
    assert [k[0] for k in weights._PREPARED] == [tuple(w.shape for w in ws[:3])]
    for w, out in zip(ws, outs):
        assert out.stride() == w.clone(memory_format=CL).stride() and out.is_contiguous(
            memory_format=CL) and not out.is_contiguous()
        torch.testing.assert_close(out, w, rtol=0, atol=0)
    for shift in (0, 1):  # one weight 4 bytes off alignment, then the other
        flat = [torch.randn(1 + w.numel()) for w in ws[:2]]
        views = [f[1:].view(w.shape) if i == shift else f[:-1].view(w.shape)
                 for i, (f, w) in enumerate(zip(flat, ws))]
        for v, out in zip(views, channels_last_copies(*views)):
            torch.testing.assert_close(out, v, rtol=0, atol=0)
    mixed = channels_last_copies(*ws)  # two dtypes: torch's clones
    assert [o.dtype for o in mixed] == [w.dtype for w in ws]
    train = fxlite.compile(Tower())
    x = torch.randn(2, 3, 7, 6)
    train(x).sum().backward()
    assert "channels_last_copies" not in train.code


def test_the_precompile_plans_the_weight_copies_kernel():
    """The parallel precompile compiles the packed weight copies ahead (the first call
    once compiled them itself): the kernel and arguments it plans on meta tensors are
    the ones a call on the weights makes; weights it would not take are not planned."""
    from fxlite.codegen.kernels import weights
    from fxlite.codegen.runtime import precompile as pre

    model = Tower().eval()
    graph = fxlite.Graph()
    a, w = graph.placeholder("a"), graph.get_attr("w")  # an input, and an attribute
    graph.output(graph.call_function(weights.channels_last_copies, (a, w)))
    root = nn.Module()
    root.w = model.c.weight
    gm = fxlite.GraphModule(root, graph)
    x = model.a.weight
    ShapeProp(gm).propagate(x)
    jobs, _, _, _ = pre._plan(gm, torch.device("cpu"))
    assert len(jobs) == 1
    fn, args, _, constexprs, _ = next(iter(jobs.values()))
    want_fn, _, want_args = weights._kernel((x, gm.w), "cpu")
    assert fn is want_fn and constexprs == {"BLOCK": weights._BLOCK}
    assert [a.dtype for a in args] == [a.dtype for a in want_args]
    assert weights.planned_launch((x.to("meta"), gm.w.to("meta")))[2][1].stride() == \
        want_args[1].stride()
    assert weights.planned_launch((x.to("meta").half(), gm.w.to("meta"))) is None  # two dtypes
    assert weights.planned_launch((x.to("meta").transpose(2, 3),)) is None  # not contiguous


def departed(x, w, w_dw):
    """MaxViT's window departition (windows of 2x2 back into NCHW) before an MBConv's
    convolutions, then a head that returns a new tensor."""
    b, g, pp, c = x.shape
    y = x.reshape(b, 2, 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, 4, 4)
    z = F.conv2d(F.gelu(F.conv2d(y, w)), w_dw, padding=1, groups=w_dw.shape[0])
    return (y + F.conv2d(z, w.transpose(0, 1))).mean((2, 3))


def test_a_departition_copies_into_channels_last_for_the_convs_after_it():
    """Before: the copy back into NCHW made every convolution after it NCHW (MaxViT's
    depthwise ones in torch's NCHW kernel), and copied with the channels strided on one
    side. Now it copies into NHWC, seen as NCHW: the same values, channels-last."""
    torch.manual_seed(0)
    args = (torch.randn(2, 4, 4, 8), torch.randn(16, 8, 1, 1), torch.randn(16, 1, 3, 3))
    gm = traced(departed, *args)
    assert channels_last_convs(gm)
    permutes = [n.args[1] for n in gm.graph.nodes if n.target == "permute"]
    assert permutes == [(0, 1, 3, 2, 4, 5), (0, 3, 1, 2)], gm.code
    for _ in range(3):
        x = torch.randn(2, 4, 4, 8)
        torch.testing.assert_close(gm(x, *args[1:]), departed(x, *args[1:]))
    seen = next(n for n in gm.graph.nodes if n.target is F.conv2d).args[0]
    assert seen.target == "permute" and seen.args[1] == (0, 3, 1, 2)  # the departition's
    ShapeProp(gm).propagate(torch.randn(2, 4, 4, 8), *args[1:])
    tm = seen.meta["tensor_meta"]
    assert tm.memory_format == CL and tuple(tm.shape) == (2, 8, 4, 4)


def test_a_departition_the_graph_returns_stays():
    def returned(x, w):
        b, g, pp, c = x.shape
        y = x.reshape(b, 2, 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, 4, 4)
        return y, F.conv2d(y, w)

    gm = traced(returned, torch.randn(2, 4, 4, 8), torch.randn(16, 8, 1, 1))
    before = gm.code
    assert not channels_last_convs(gm)  # eager returns the NCHW copy itself
    assert gm.code == before


def test_a_compiled_departition_before_convs_matches_eager_over_calls(channels_last_on_cpu):
    torch.manual_seed(0)
    w, w_dw = torch.randn(16, 8, 1, 1), torch.randn(16, 1, 3, 3)
    compiled = fxlite.compile(departed)
    with torch.no_grad():
        for b in (2, 2, 3):
            x = torch.randn(b, 4, 4, 8)
            torch.testing.assert_close(compiled(x, w, w_dw), departed(x, w, w_dw))
    assert channels_last_on_cpu and not compiled.fallbacks


def test_a_departition_that_eager_does_as_a_view_stays():
    def one_pixel(x, w):  # windows of one pixel: eager's reshape views x, no copy
        b, g, pp, c = x.shape
        y = x.reshape(b, 1, 1, 1, 1, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, 1, 1)
        return F.conv2d(y, w).flatten(1) + 0

    args = (torch.randn(2, 1, 1, 8), torch.randn(16, 8, 1, 1))
    gm = traced(one_pixel, *args)
    before = gm.code
    assert not channels_last_convs(gm)
    assert gm.code == before


@pytest.mark.parametrize("draw, converted", [
    (lambda y: torch.rand_like(y), False), (lambda y: torch.randn_like(y), False),
    (lambda y: torch.bernoulli(torch.sigmoid(y)), False),
    (lambda y: torch.empty_like(y).uniform_(), False),
    (lambda y: F.dropout(y, 0.3, training=True), False),
    (lambda y: torch.rand_like(torch.sort(y, dim=1)[0]), False),  # through a tuple's item
    (lambda y: F.dropout(y, 0.0, training=True), True),  # draws nothing
    (lambda y: F.dropout(y, 0.3, training=False), True)],  # the identity
    ids=["rand_like", "randn_like", "bernoulli", "uniform_", "dropout", "sorted",
         "dropout_p0", "dropout_eval"])
def test_a_random_draw_shaped_like_a_converted_value_leaves_the_graph_unchanged(
        draw, converted):
    # their numbers follow the memory order: channels-last, each element gets another
    # number than eager's (fuzz seed 9898076, an H200: 12 of 16 values of a rand_like
    # after a conv2d differed on every call, in the kernels and in the recorded ops alike)
    def fn(x, w):
        y = F.conv2d(x, w, stride=2, padding=1)
        return draw(y) * 2

    x, w = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 2, 2)
    gm = traced(fn, x, w)
    before = gm.code
    assert channels_last_convs(gm) == converted
    if not converted:
        assert gm.code == before


@pytest.mark.parametrize("backend", ["python", "triton"])
def test_a_compiled_conv_then_rand_like_draws_eagers_numbers(backend, channels_last_on_cpu):
    if backend == "triton":
        needs_kernels()

    def fn(x, w):
        y = F.conv2d(x, w, stride=2, padding=1)
        return torch.rand_like(y).to(torch.bfloat16).to(torch.randn_like(y))

    w = torch.randn(2, 3, 2, 2)
    compiled = fxlite.compile(fn, backend=backend)
    for call in range(3):
        x = torch.randn(2, 3, 4, 4)
        torch.manual_seed(call)
        got = compiled(x, w)
        torch.manual_seed(call)
        assert torch.equal(got, fn(x, w)), call


def test_a_dropout_of_a_flattened_pool_keeps_the_conversion():
    # efficientnet's and mobilenet_v3's classifier in training: the (N, C) value the
    # dropout reads has eager's strides in either layout
    def fn(x, w):
        y = F.adaptive_avg_pool2d(F.conv2d(x, w, padding=1), 1)
        return F.dropout(torch.flatten(y, 1), 0.2, training=True) * 2

    x, w = torch.randn(2, 3, 4, 4), torch.randn(5, 3, 3, 3)
    gm = traced(fn, x, w)
    assert channels_last_convs(gm)
    torch.manual_seed(0)
    got = gm(x, w)
    torch.manual_seed(0)
    want = fn(x, w)
    assert torch.equal(got == 0, want == 0)  # eager's mask (the conv rounds apart)
    torch.testing.assert_close(got, want)


def test_a_stochastic_depth_mask_drawn_per_sample_keeps_the_conversion():
    # torchvision's StochasticDepth ("row"): a (N, 1, 1, 1) mask, drawn in one order in
    # either layout, from the input's size (a size read: no layout of the input's)
    def fn(x, w):
        y = F.conv2d(x, w, padding=1)
        noise = torch.empty((y.shape[0], 1, 1, 1)).bernoulli_(0.9).div_(0.9)
        keep = y.new_empty((y.shape[0], 1, 1, 1)).bernoulli_(0.9)
        return y * noise * keep

    x, w = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 3, 3)
    gm = traced(fn, x, w)
    assert channels_last_convs(gm)


@pytest.mark.parametrize("fn", [
    lambda p: torch.relu(p), lambda p: torch.sigmoid(p), lambda p: p * 2, lambda p: p + p,
    lambda p: p.clamp(min=0), lambda p: p.pow(2), lambda p: torch.where(p > 0, p, 0.0),
    lambda p: p * p.mean(),
], ids=["relu", "sigmoid", "times_2", "plus_itself", "clamp", "pow", "where", "times_0d"])
def test_pointwise_metadata_on_an_n_c_1_1_value_has_eagers_strides(fn):
    """On a value both NCHW and channels-last by shape, eager's iterator makes a unary op's
    result NCHW (its fast path) and keeps the input's strides where a Python number or a
    0-d tensor joins as an operand; the meta kernels keep them always. The evaluator's
    metadata is eager's in each case."""
    from fxlite.passes.shape_prop import fill_missing_meta

    p = torch.empty_strided((2, 8, 1, 1), (8, 1, 8, 8)).normal_()
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(p)  # eager's values
    want = {n.name: tuple(n.meta["tensor_meta"].stride) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            n.meta.pop("tensor_meta")
            n.meta.pop("type", None)
    fill_missing_meta(gm)
    got = {n.name: tuple(n.meta["tensor_meta"].stride) for n in gm.graph.nodes
           if n.op in ("call_function", "call_method")}
    assert got == want
