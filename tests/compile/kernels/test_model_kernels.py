"""Kernel mechanisms for real models (issue 12), on tiny blocks under the Triton interpreter.

- eval-mode batch_norm is per-channel pointwise math, one kernel with its ReLU and
  residual add;
- a linear's or conv's bias joins the kernel that follows (an epilogue);
- permutes sink onto a group's inputs, so a convnext block is three kernels;
- a pointwise kernel iterates in its inputs' memory order and returns eager's layout.

Every block is run through the passes and kernels (``_pipeline``) with several inputs;
no group may be refused ("not supported"). ReLUs are out of place: in-place modules fuse
only after the functionalization of the compile capture (the lead's side).
"""

from __future__ import annotations

from test_triton_kernels import DEVICE, group, same  # isort: skip  (sets TRITON_INTERPRET)

import pytest
import torch
import torch.nn.functional as F
from _pipeline import Kernels, lower
from fxlite.codegen.lower.batch_norm import per_channel
from fxlite.codegen.runtime.kernel import generate_kernel
from fxlite.passes.decompose import decompose
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp
from fxlite.passes.sink_views import sink_views
from torch import nn

import fxlite
from fxlite.ops import lookup

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _bn(c: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():  # non-trivial statistics, as after training
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


class ResBlock(nn.Module):
    """A resnet basic block: conv-BN-ReLU, conv-BN, + residual, ReLU (out of place)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = _bn(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = _bn(c)
        self.relu = nn.ReLU()

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


class ConvNeXtBlock(nn.Module):
    """torchvision's convnext block: depthwise conv, permute, LayerNorm, MLP, permute back,
    layer scale, residual."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pw2 = nn.Linear(4 * dim, dim)
        self.layer_scale = nn.Parameter(torch.rand(dim, 1, 1) + 0.5)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pw2(self.act(self.pw1(self.norm(y)))).permute(0, 3, 1, 2)
        return self.layer_scale * y + x


def _run_block(model, make, calls=3):
    model = model.eval().to(DEVICE)
    run = Kernels(lower(model, make()))
    with torch.no_grad():
        for _ in range(calls):
            x = make()
            torch.testing.assert_close(run(x), model(x), rtol=1e-4, atol=1e-4)
    assert not run.refused, run.refused
    return run


def test_resnet_block_is_two_kernels_around_the_convs():
    run = _run_block(ResBlock(), lambda: torch.randn(2, 4, 6, 6, device=DEVICE))
    assert len(run.kernels) == 2  # BN+ReLU; BN+add+ReLU
    for ops in (run.module.get_submodule(n).meta["nodes"] for n in run.kernels):
        assert any(o.startswith("rsqrt") for o in ops) and any(o.startswith("relu") for o in ops)


def test_convnext_block_is_three_kernels():
    run = _run_block(ConvNeXtBlock(), lambda: torch.randn(2, 8, 5, 5, device=DEVICE))
    assert len(run.kernels) == 3  # dw bias + LayerNorm; pw1 bias + GELU; pw2 bias + scale + add
    parent = [n for n in run.module.graph.nodes if n.op == "call_function"]
    names = [lookup(n).name for n in parent if lookup(n) is not None]
    assert names.count("conv2d") == 1 and names.count("linear") == 2
    # every permute reads an extern's output or a parameter: none sits between two groups
    for n in parent:
        if lookup(n) is not None and lookup(n).name == "permute":
            assert n.args[0].op != "call_module"


def test_convnext_block_in_channels_last_memory():
    model = ConvNeXtBlock().eval().to(DEVICE)
    run = Kernels(lower(model, torch.randn(2, 8, 5, 5, device=DEVICE)))
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 8, 5, 5, device=DEVICE).to(memory_format=torch.channels_last)
            got, want = run(x), model(x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert got.stride() == want.stride()


# ---------------------------------------------------------------------- batch_norm
def test_eval_batch_norm_decomposes_to_pointwise_math():
    bn = nn.Sequential(_bn(3)).eval()
    gm = fxlite.symbolic_trace(bn)
    x = torch.randn(2, 3, 4, 4)
    ShapeProp(gm).propagate(x)
    decompose(normalize(gm))
    # per_channel shapes the statistics to (C, 1, 1), checked against x's channels
    kinds = {lookup(n).kind for n in gm.graph.nodes
             if n.op == "call_function" and n.target is not per_channel}
    assert kinds <= {"pointwise", "view"}, gm.code
    for _ in range(2):
        x = torch.randn(2, 3, 4, 4) * 5
        torch.testing.assert_close(gm(x), bn(x))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_half_batch_norm_computes_in_fp32(dtype):
    bn = _bn(3).eval()
    fn = lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, eps=1e-5)  # noqa: E731
    params = [t.to(DEVICE, dtype) for t in (bn.running_mean, bn.running_var, bn.weight, bn.bias)]
    x = torch.randn(2, 3, 4, 4, device=DEVICE).to(dtype)
    run = Kernels(lower(fn, x, *params))
    same(run(x, *params), fn(x, *params))
    assert not run.refused
    big = torch.full((2, 3, 4, 4), 300.0, device=DEVICE).to(dtype)
    same(run(big, *params), fn(big, *params))


@pytest.mark.parametrize("rank", (2, 3, 4, 5, 7))
def test_per_channel_shapes_and_checks_statistics_as_eager(rank):
    values = torch.arange(6.0)
    got = per_channel(values, 6, rank, "weight")
    assert got.shape == (6,) + (1,) * (rank - 2) and got.data_ptr() == values.data_ptr()
    assert per_channel(values, 0, rank, "weight").numel() == 0  # no channels: empty
    strided = torch.arange(12.0)[::2]  # a non-contiguous vector still gives its values
    assert per_channel(strided, 6, rank, "bias").flatten().tolist() == strided.tolist()
    with pytest.raises(RuntimeError, match="weight should contain 5 elements not 6"):
        per_channel(values, 5, rank, "weight")


def test_training_batch_norm_is_kept():
    bn = _bn(3).train()
    gm = fxlite.symbolic_trace(lambda x, m, v: F.batch_norm(x, m, v, training=True))
    x = torch.randn(2, 3, 4)
    ShapeProp(gm).propagate(x, bn.running_mean.clone(), bn.running_var.clone())
    decompose(normalize(gm))
    assert "batch_norm" in gm.code


# ---------------------------------------------------------------------- epilogues
def _decomposed(fn, *inputs):
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*inputs)
    decompose(normalize(gm))
    return gm


def test_linear_bias_joins_the_next_kernel():
    lin = nn.Linear(8, 16)
    run = _run_block(nn.Sequential(lin, nn.GELU()), lambda: torch.randn(3, 8, device=DEVICE))
    (ops,) = (run.module.get_submodule(n).meta["nodes"] for n in run.kernels)
    assert ops[0].startswith("add")  # the bias add, then gelu's pointwise math
    linear = next(n for n in run.module.graph.nodes if n.op == "call_function"
                  and lookup(n) is not None and lookup(n).name == "linear")
    assert len(linear.args) == 2 or linear.args[2] is None  # the matmul runs without it


def test_a_bias_that_would_stay_alone_stays_in_the_matmul():
    class Net(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.lin, self.how = nn.Linear(8, 16), how

        def forward(self, a):
            y = self.lin(a)
            return {"alone": y, "view": y.view(3, 4, 4), "mm": torch.mm(y, self.lin.weight)}[self.how]

    x = torch.randn(3, 8)
    for fn in (Net("alone"), Net("view"), Net("mm")):
        gm = _decomposed(fn, x)
        linear = next(n for n in gm.graph.nodes if lookup(n) is not None and lookup(n).name == "linear")
        assert linear.args[2] is not None or linear.kwargs.get("bias") is not None, gm.code
        torch.testing.assert_close(gm(x), fn(x))


def test_conv_bias_joins_the_next_kernel():
    conv = nn.Conv2d(3, 4, 3, padding=1)
    run = _run_block(nn.Sequential(conv, nn.SiLU()), lambda: torch.randn(2, 3, 5, 5, device=DEVICE))
    assert len(run.kernels) == 1
    (conv_node,) = [n for n in run.module.graph.nodes if lookup(n) is not None
                    and lookup(n).name == "conv2d"]
    assert conv_node.args[2] is None


def test_conv_bias_joins_an_eval_batch_norm_kernel():
    # vgg16_bn: conv (with bias) -> BatchNorm -> ReLU. The decomposed batch_norm reads the
    # conv's size to check its channels; that read once kept the bias in the conv, whose
    # separate add then took 23% of vgg16_bn's GPU time (H200, batch 32).
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    run = _run_block(model, lambda: torch.randn(2, 3, 5, 5, device=DEVICE))
    assert len(run.kernels) == 1
    (conv_node,) = [n for n in run.module.graph.nodes if lookup(n) is not None
                    and lookup(n).name == "conv2d"]
    assert conv_node.args[2] is None


# ---------------------------------------------------------------------- permutes
def test_permutes_sink_through_single_use_pointwise_ops():
    def fn(a, b, s):
        return (torch.relu(a + b) * 2).permute(0, 2, 1) * s

    a, b, s = torch.randn(2, 3, 4), torch.randn(4), torch.randn(4, 3)
    gm = _decomposed(fn, a, b, s)
    ShapeProp(gm).propagate(a, b, s)
    moved = sink_views(gm)
    assert moved is not gm
    order = [lookup(n).name for n in moved.graph.nodes if n.op == "call_function"]
    assert order.index("permute") < order.index("add") and order[-1] == "mul"
    for _ in range(2):
        a, b, s = torch.randn(2, 3, 4), torch.randn(4), torch.randn(4, 3)
        torch.testing.assert_close(moved(a, b, s), fn(a, b, s))
    run = Kernels(lower(fn, a, b, s))
    same(run(a, b, s), fn(a, b, s))
    assert len(run.kernels) == 1


def test_a_permute_of_a_permute_folds_and_sinks_into_one_kernel():
    # nn.MultiheadAttention's batch_first output: transposed, biased, transposed back, then
    # the residual add. Both transposes sink through the bias add and cancel.
    def fn(mm, bias, x):
        y = (mm + bias).transpose(0, 1)
        return x + y.transpose(1, 0) * 2

    mm, bias, x = torch.randn(2, 3, 4), torch.randn(4), torch.randn(2, 3, 4)
    gm = _decomposed(fn, mm, bias, x)
    ShapeProp(gm).propagate(mm, bias, x)
    moved = sink_views(gm)
    names = [lookup(n).name for n in moved.graph.nodes if n.op == "call_function"]
    assert "transpose" not in names and "permute" not in names, names
    for _ in range(2):
        mm, bias, x = torch.randn(2, 3, 4), torch.randn(4), torch.randn(2, 3, 4)
        torch.testing.assert_close(moved(mm, bias, x), fn(mm, bias, x))
    run = Kernels(lower(fn, mm, bias, x))
    same(run(mm, bias, x), fn(mm, bias, x))
    assert len(run.kernels) == 1


def test_permutes_that_do_not_cancel_compose_into_one():
    def fn(a, b):
        return ((a + b).permute(1, 2, 0).permute(2, 0, 1).transpose(1, 2)) * 3

    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    run = Kernels(lower(fn, a, b))
    for _ in range(2):
        a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        same(run(a, b), fn(a, b))
    assert len(run.kernels) == 1


def test_a_norms_tail_keeps_its_kernel_and_eagers_layout():
    """A regression: the permute back of a LayerNorm2d (permute, layer_norm, permute) sank
    into the norm's scale and shift, so they left the norm's kernel (two passes over the
    values) and the result was NCHW where eager's is channels-last: convnext_tiny's first
    depthwise conv then ran torch's NCHW kernel (320 us against 190 on an H200)."""
    def fn(x, w, b, s):
        y = F.layer_norm(x.permute(0, 2, 3, 1), (4,), w, b).permute(0, 3, 1, 2)
        return y, y * s + y  # a pointwise reader of the permuted norm: what made it sink

    def make():
        return [torch.randn(2, 4, 3, 5, device=DEVICE), torch.rand(4, device=DEVICE) + 0.5,
                torch.randn(4, device=DEVICE), torch.randn(4, 1, 1, device=DEVICE)]

    run = Kernels(lower(fn, *make()))
    for _ in range(2):
        args = make()
        got, want = run(*args), fn(*args)
        same(got, want)
        assert got[0].stride() == want[0].stride()  # channels-last, as eager's
    assert [k.kind for k in run.kernels.values()] == ["reduction", "pointwise"]


def test_a_norms_row_major_clone_fuses_into_its_kernel():
    """A regression: eager's layer_norm gives a row-major result for a permuted input, a
    clone that decompose writes after the norm's math. It ran as torch's copy when a view
    read it (convnext's stem: 49 us a call of convnext_tiny f32 on an H200). The norm's
    kernel now stores the clone itself; a conv and a pointwise kernel read it."""
    conv = nn.Conv2d(4, 4, 3, padding=1).to(DEVICE)

    def fn(x, w, b):
        y = F.layer_norm(x.permute(0, 2, 3, 1), (4,), w, b).permute(0, 3, 1, 2)
        return conv(y) + y

    compiled = fxlite.compile(fn)
    with torch.no_grad():
        for _ in range(3):
            args = (torch.randn(2, 4, 3, 5, device=DEVICE), torch.rand(4, device=DEVICE) + 0.5,
                    torch.randn(4, device=DEVICE))
            got, want = compiled(*args), fn(*args)
            same(got, want)
    assert "clone" not in compiled.code and compiled.kernels and not compiled.fallbacks


def test_a_permute_whose_source_is_used_twice_stays():
    def fn(a):
        y = a + 1
        return y.permute(1, 0) * 2, y

    a = torch.randn(3, 4)
    gm = _decomposed(fn, a)
    ShapeProp(gm).propagate(a)
    assert sink_views(gm) is gm


# ---------------------------------------------------------------------- memory order
@pytest.mark.parametrize("layout", ["channels_last", "permuted", "contiguous"])
def test_pointwise_kernels_follow_the_inputs_memory_order(layout):
    fn = lambda x, s, r: x * s + r  # noqa: E731
    base = torch.randn(2, 3, 4, 5, device=DEVICE)
    make = {"channels_last": lambda t: t.to(memory_format=torch.channels_last),
            "permuted": lambda t: t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
            "contiguous": lambda t: t}[layout]
    s = torch.rand(3, 1, 1, device=DEVICE)
    x = make(base)
    kernel = generate_kernel(group(fn, x, s, make(base)), [x, s, make(base)])
    for _ in range(2):
        x, r = make(torch.randn(2, 3, 4, 5, device=DEVICE)), make(torch.randn(2, 3, 4, 5, device=DEVICE))
        same(kernel(x, s, r), fn(x, s, r))  # same() checks eager's strides too
    assert "in0_ptr + offs" in kernel.source  # x is read linearly: no transpose
    mixed = kernel(x, s, torch.randn(2, 3, 4, 5, device=DEVICE))  # the first operand decides
    assert mixed.stride() == fn(x, s, torch.randn(2, 3, 4, 5, device=DEVICE)).stride()


# ---------------------------------------------------------------------- cold compile
def test_repeated_blocks_share_kernel_sources_and_precompile_foresees_them(monkeypatch):
    from fxlite.codegen.runtime import precompile as triton_precompile

    model = nn.Sequential(ResBlock(), ResBlock(), ResBlock()).eval().to(DEVICE)
    x = torch.randn(2, 4, 6, 6, device=DEVICE)
    fused = lower(model, x)
    planned: set[str] = set()
    binaries: list[int] = []
    real_plan = triton_precompile._plan

    def spy(gm, device):
        jobs, groups, kernels, sources = real_plan(gm, device)
        planned.update(sources)
        binaries.append(len(jobs))
        return jobs, groups, kernels, sources

    monkeypatch.setattr(triton_precompile, "_plan", spy)
    report = triton_precompile.precompile(fused)
    assert report["groups"] == report["kernels"] == 6
    # one binary per distinct group body; all of them compile, or none when an earlier
    # test in this process (or the disk cache) already has them
    assert report["sources"] == 2 and binaries == [2] and report["compiles"] in (0, 2)
    run = Kernels(fused)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), rtol=1e-4, atol=1e-4)
    assert {k._current.source_id for k in run.kernels.values()} == planned


class _FlatBlock(nn.Module):
    """A GPT-2 MLP's tail at batch one: pointwise math, then a view that drops the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.fc(x) * 0.5 + 1).view(-1, 16).unsqueeze(0)


def test_blocks_whose_view_drops_a_batch_of_one_share_kernel_sources():
    # The view's value was named after its node (view_10, view_21, ...), so at batch one
    # every GPT-2 layer's kernel had a source of its own: 39 compiles in place of 6.
    from fxlite.codegen.runtime import precompile as triton_precompile

    model = nn.Sequential(_FlatBlock(), _FlatBlock(), _FlatBlock()).eval().to(DEVICE)
    x = torch.randn(1, 8, 16, device=DEVICE)
    fused = lower(model, x)
    report = triton_precompile.precompile(fused)
    assert report["kernels"] == 3 and report["sources"] == 1, report
    run = Kernels(fused)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_precompile_compiles_what_the_first_call_launches():
    model = nn.Sequential(ConvNeXtBlock(32), ConvNeXtBlock(32)).eval().cuda()
    x = torch.randn(4, 32, 14, 14, device="cuda")
    fused = lower(model, x)
    from fxlite.codegen.runtime.precompile import precompile

    report = precompile(fused, "cuda", progress=False)
    assert report["compiles"] >= 1 and report["kernels"] == report["groups"]
    run = Kernels(fused)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), rtol=1e-3, atol=1e-3)


class _Stem(nn.Module):
    """A conv net's pieces the precompile must foresee under channels-last: BatchNorm
    groups after converted convolutions, a max and an average pool, a cat of branches,
    the packed weight copies (odd sizes: no earlier test compiled these kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 11, 3, stride=2, bias=False)
        self.bn = _bn(11)
        self.a = nn.Conv2d(11, 7, 1, bias=False)
        self.a_bn = _bn(7)
        self.b = nn.Conv2d(11, 5, 3, padding=1, bias=False)
        self.b_bn = _bn(5)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.bn(self.stem(x))), 3, 2, ceil_mode=True)
        y = torch.cat([F.relu(self.a_bn(self.a(y))), F.relu(self.b_bn(self.b(y)))], 1)
        return F.avg_pool2d(y, 2, ceil_mode=True)


@pytest.mark.gpu
def test_after_the_precompile_a_conv_nets_first_call_compiles_nothing(monkeypatch):
    """Metadata left in the recording's NCHW layout planned the BatchNorm groups of a
    channels-last net for the wrong strides, and cat kernels, pools and weight copies
    were not planned at all: each compiled at the first call, one after another
    (googlenet on an H200: 16 such compiles)."""
    import fxlite.codegen.lower.pipeline as pipeline
    import triton.runtime.jit as jit

    if not hasattr(jit.JITFunction, "_do_compile"):  # (Triton 3.6 to 3.9 have it)
        pytest.skip("this Triton compiles through another method: nothing to count")
    planned, late = [], []
    real_precompile, real_compile = pipeline.precompile, jit.JITFunction._do_compile

    def precompile(gm, device):
        report = real_precompile(gm, device)
        planned.append(report)
        return report

    def compile_(self, *args, **kwargs):
        if planned:
            late.append(self.__name__)
        return real_compile(self, *args, **kwargs)

    monkeypatch.setattr(pipeline, "precompile", precompile)
    monkeypatch.setattr(jit.JITFunction, "_do_compile", compile_)
    model = _Stem().eval().cuda().to(torch.bfloat16)
    f = fxlite.compile(model)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 3, 37, 37, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(f(x), model(x), rtol=2e-2, atol=2e-2)
    assert planned and planned[0]["compiles"] >= 4, planned
    assert not late, late


def test_an_in_place_relu_module_on_a_private_temporary_fuses():
    """nn.ReLU(inplace=True) after BN overwrites a value only it reads: one kernel. On a
    value someone else reads (or a group input) the generator refuses, and eager runs."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), _bn(4), nn.ReLU(inplace=True)).eval().to(DEVICE)
    run = _run_block(model, lambda: torch.randn(1, 3, 6, 6, device=DEVICE))
    assert len(run.kernels) == 1 and any(n == "_2" for n in run.ops)

    class Shared(nn.Module):  # the in-place input is read again by the add
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            y = x * 2
            return self.act(y) + y

    x = torch.randn(4, 5, device=DEVICE)
    gm = lower(Shared().eval(), x)
    sub = next(m for name, m in gm.named_children() if name.startswith("fused"))
    assert generate_kernel(sub, [x]) is None


def test_rules_read_the_dtype_of_values_earlier_rules_made():
    """GELU after a split bf16 linear reads a bias add no ShapeProp has seen: its dtype
    comes from the op table, so GELU still computes in fp32, as eager's kernel does."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval().to(torch.bfloat16)
    model.requires_grad_(False)  # inference: a GELU whose input needs a gradient stays whole
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    gm = _decomposed(model, x)
    casts = [n.args[1] for n in gm.graph.nodes if lookup(n) is not None and lookup(n).name == "to"]
    assert casts == [torch.float32, torch.bfloat16], gm.code
    torch.testing.assert_close(gm(x), model(x), rtol=3e-2, atol=1e-3)


def test_batch_norm_relu_global_pool_is_one_kernel_with_one_output():
    """The head of resnets, shufflenet and mnasnet: conv, BN, ReLU(inplace), mean over H, W.
    The mean's element count is read from a value before the BN (sizes read from the BN's
    math would make it a second output of the kernel, and the ReLU no longer private)."""
    model = nn.Sequential(nn.Conv2d(4, 8, 1, bias=False), _bn(8), nn.ReLU(inplace=True),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten())

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model[:3]

        def forward(self, x):
            return self.body(x).mean([2, 3])

    run = _run_block(Head(), lambda: torch.randn(2, 4, 3, 3, device=DEVICE))
    (name,) = run.kernels
    assert any(n.startswith("sum") for n in run.module.get_submodule(name).meta["nodes"])
    (call,) = [n for n in run.module.graph.nodes if n.target == name]
    assert "tensor_meta" in call.meta and hasattr(call.meta["tensor_meta"], "shape")  # one output


def test_every_kernel_launch_and_compile_asks_for_fp_fusion(monkeypatch):
    """Triton 3.10 turns FP fusion (``a * b + c`` as one FMA) off by default, and 3.9
    warns on the first compile that leaves it unset: every kernel fxlite compiles or
    launches through Triton (fused groups, cats, pools; on CUDA the weight copies and the
    precompile too) asks for it, so fxlite's kernels round and run alike under each."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    asked = []
    for cls in (JITFunction, InterpretedFunction):
        def run(self, *args, _real=cls.run, **kwargs):
            asked.append((self.__name__, kwargs.get("enable_fp_fusion")))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", run)
    model = _Stem().eval().to(DEVICE)
    f = fxlite.compile(model)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3, 17, 17, device=DEVICE)
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
    names = {name for name, _ in asked}
    kinds = ("cat", "pool") if DEVICE == "cuda" else ("cat",)  # pools: CUDA's layouts
    assert len(names) >= 2 and all(any(k in n for n in names) for k in kinds), names
    assert all(fusion is True for _, fusion in asked), asked


class _WindowBias(nn.Module):
    """torchvision Swin's attention scores plus relative position bias, then softmax: the
    bias is a permuted view of a gathered table, made contiguous on every call."""

    def __init__(self, heads: int = 2, window: int = 3, shifted: bool = False):
        super().__init__()
        self.window, self.shifted = window, shifted
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads))
        self.register_buffer("index", torch.randint(0, (2 * window - 1) ** 2, (window ** 4,)))
        self.register_buffer("mask", torch.randn(2, 1, window ** 2, window ** 2))

    def forward(self, attn):
        n = self.window ** 2
        bias = self.table[self.index].view(n, n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        if not self.shifted:
            return torch.softmax(attn + bias, -1)
        # shifted windows: the bias added in a pointwise group, then the mask by windows
        attn = (attn + bias).view(2, 2, -1, n, n) + self.mask
        return torch.softmax(attn.view(-1, attn.shape[2], n, n), -1)


@pytest.mark.parametrize("shifted", [False, True])
def test_swin_s_position_bias_is_read_by_the_softmax_kernel(shifted):
    """The bias's contiguous() copy was an eager op a block; the softmax's kernel reads
    the permuted view through its strides now (passes/fuse/read_through.py). Values as
    eager's over several calls, with the table changed between them and a table whose
    gradient is eager's."""
    run = _run_block(_WindowBias(shifted=shifted), lambda: torch.randn(4, 2, 9, 9, device=DEVICE))
    assert not any(getattr(lookup(n), "name", None) == "contiguous"
                   for n in run.module.graph.nodes), run.module.code
    model = _WindowBias(shifted=shifted).to(DEVICE)
    compiled = fxlite.compile(model)
    for k in range(3):
        with torch.no_grad():
            model.table.mul_(0.5 + k)  # the parameter changes between calls
        attn = torch.randn(4, 2, 9, 9, device=DEVICE, requires_grad=True)
        ref = attn.detach().clone().requires_grad_()
        out, want = compiled(attn), model(ref)
        weights = torch.randn_like(want)
        (out * weights).sum().backward()
        got_table = model.table.grad.clone()
        model.table.grad = None
        (want * weights).sum().backward()
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(attn.grad, ref.grad)
        torch.testing.assert_close(got_table, model.table.grad)
        model.table.grad = None
