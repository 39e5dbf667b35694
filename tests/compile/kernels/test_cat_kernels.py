"""A cat and the pointwise groups only it reads, as one kernel (``codegen/kernels/cat.py``).

On the CPU the kernels run through Triton's interpreter (conftest sets it), on small shapes.
Each test compiles a function, calls it several times with fresh inputs, and compares with
eager: values, dtype, shape and strides."""

from __future__ import annotations

import hashlib

import fxlite.codegen.lower.segment as segment
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fxlite.codegen.kernels.cat import cat_groups
from fxlite.codegen.runtime.cat import CatKernel
from fxlite.passes.fuse import fuse
from fxlite.passes.shape_prop import ShapeProp

import fxlite

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def kernels_run_here():
    pytest.importorskip("triton")
    from fxlite.codegen.kernels.generate import interpreting

    if not interpreting() and DEV == "cpu":
        pytest.skip("kernels need a GPU or TRITON_INTERPRET=1")


def cat_kernels(compiled) -> list[CatKernel]:
    return [k for k in compiled.kernels if isinstance(k, CatKernel)]


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, dtype, shape and strides; a half type within two of its units of
    rounding (a kernel rounds ``a * 3 + 1`` once, eager twice, as every fused group)."""
    if want.dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(want.dtype).eps
        torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps)
    else:
        torch.testing.assert_close(got, want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == want.stride()


def fused_graph(fn, *args):
    """``fn`` traced, described on ``args`` and fused: what ``cat_groups`` runs on."""
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*args)
    return fuse(gm)


def cat_group(fn, *args):
    """The cat group ``cat_groups`` makes of ``fn``'s fused graph (it must make one)."""
    fused = fused_graph(fn, *args)
    assert cat_groups(fused)
    return next(m for m in fused.children() if getattr(m, "meta", {}).get("fused_kind") == "cat")


class Branch(nn.Module):
    """A convolution, its eval BatchNorm and a ReLU: one inception branch."""

    def __init__(self, cin: int, cout: int, k: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class Inception(nn.Module):
    """Four branches, one of them a cat of two (flattened into the outer cat), and a pool."""

    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2 = Branch(8, 4), Branch(8, 6, 3)
        self.b3a, self.b3b = Branch(8, 3), Branch(8, 5, 3)

    def forward(self, x):
        inner = torch.cat([self.b3a(x), self.b3b(x)], 1)
        pool = F.max_pool2d(x, 3, 1, 1)
        return torch.cat([self.b1(x), self.b2(x), inner, pool], 1)


def _randomize_bn(m: nn.Module) -> None:
    for bn in m.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-1, 1)


@pytest.mark.parametrize("channels_last", [False, True])
def test_an_inception_block_is_one_kernel_with_eagers_values_and_layout(channels_last):
    torch.manual_seed(0)
    m = Inception().eval().to(DEV)
    _randomize_bn(m)
    f = fxlite.compile(m)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8, 5, 5, device=DEV).to(memory_format=fmt)
            same(f(x), m(x))
    kernels = cat_kernels(f)
    assert len(kernels) == 1  # 4 groups and 2 cats: one kernel
    others = [k for k in f.kernels if k not in kernels]  # on a GPU: channels-last copies of x
    assert not any("relu" in " ".join(k.nodes) for k in others), [k.nodes for k in others]
    assert "torch.cat" not in f.code
    assert kernels[0].compilations == 1  # one layout, three calls
    assert not f.fallbacks


def test_a_new_size_gets_its_own_kernel_and_state_changes_are_seen():
    torch.manual_seed(1)
    m = Inception().eval().to(DEV)
    _randomize_bn(m)
    f = fxlite.compile(m)
    with torch.no_grad():
        for n in (5, 7, 5):
            x = torch.randn(2, 8, n, n, device=DEV)
            same(f(x), m(x))
        m.b2.bn.running_mean.add_(3.0)  # a buffer written between calls
        x = torch.randn(2, 8, 7, 7, device=DEV)
        same(f(x), m(x))
    assert cat_kernels(f)[0].compilations == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_dtypes_round_as_eager_does(dtype):
    def fn(a, b, c):
        return torch.cat([a * 3 + 1, (b - c) * b, c], dim=-1)

    f = fxlite.compile(fn)
    for _ in range(3):
        if dtype.is_floating_point:
            args = [torch.randn(3, 4, n, device=DEV).to(dtype) for n in (2, 5, 5)]
        else:
            args = [torch.randint(-50, 50, (3, 4, n), dtype=dtype, device=DEV) for n in (2, 5, 5)]
        same(f(*args), fn(*args))
    assert len(cat_kernels(f)) == 1


def test_broadcast_and_strided_inputs_and_the_first_dim():
    def fn(x, bias, view):
        return torch.cat([torch.sigmoid(x + bias) * 2, view.exp()], dim=0)

    f = fxlite.compile(fn)
    for _ in range(3):
        x, bias = torch.randn(3, 6, device=DEV), torch.randn(6, device=DEV)
        view = torch.randn(6, 4, device=DEV).t()  # strided: read through its strides
        same(f(x, bias, view), fn(x, bias, view))
    kernels = cat_kernels(f)
    assert len(kernels) == 1 and kernels[0].compilations == 1


def test_a_scalar_input_is_an_argument_triton_does_not_specialize_on():
    """A group's Python-number input (a size of a Dynamo graph, say) changes between calls
    that share one layout: an int equal to 1 or a multiple of 16 must not be baked into
    the binary that later calls reuse."""
    def fn(a, s, b):
        return torch.cat([a * s, b + 1], 1)

    args = [torch.randn(2, 3, device=DEV), 1, torch.randn(2, 4, device=DEV)]
    group = cat_group(fn, *args)
    kernel = CatKernel(group, "cat")
    for s in (1, 16, 3, 1):
        now = [args[0], s, args[2]]
        same(kernel(*now), group(*now))
    assert kernel.compilations == 1
    assert "do_not_specialize" in kernel.source


def test_a_group_read_outside_the_cat_stays_its_own_kernel():
    def fn(a, b):
        r = torch.relu(a)
        return torch.cat([r, b * 2], 1), r.sum()

    f = fxlite.compile(fn)
    for _ in range(2):
        a, b = torch.randn(2, 3, device=DEV), torch.randn(2, 4, device=DEV)
        got, want = f(a, b), fn(a, b)
        same(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    kernels = cat_kernels(f)
    assert len(kernels) == 1
    assert "relu" not in " ".join(kernels[0].nodes)  # the relu group is read twice


def test_siblings_a_cat_reads_stay_apart_for_the_cat_kernel():
    # inception_v3's transform_input: three scaled channels of one input, concatenated.
    # fuse's sibling groups would make them one group of three outputs, which no cat
    # kernel takes (a cat and an eager copy); they stay three groups, one cat kernel.
    def fn(x):
        a = torch.unsqueeze(x[:, 0], 1) * 0.5 + 0.1
        b = torch.unsqueeze(x[:, 1], 1) * 0.4 - 0.2
        c = torch.unsqueeze(x[:, 2], 1) * 0.3 + 0.3
        return torch.cat((a, b, c), 1)

    f = fxlite.compile(fn)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3, 4, 4, device=DEV)
            same(f(x), fn(x))
    assert len(cat_kernels(f)) == 1


def test_mixed_dtypes_and_training_keep_torch_cat():
    def mixed(a, b):
        return torch.cat([a * 2, b * 2], 1)  # float32 and float64: cat promotes

    f = fxlite.compile(mixed)
    a, b = torch.randn(2, 3, device=DEV), torch.randn(2, 4, dtype=torch.float64, device=DEV)
    same(f(a, b), mixed(a, b))
    assert not cat_kernels(f)

    def step(w, x):
        return torch.cat([torch.relu(w * x), w + 1], 0).sum()

    g = fxlite.compile(step)
    for _ in range(2):
        w = torch.randn(4, requires_grad=True, device=DEV)
        w2 = w.detach().clone().requires_grad_()
        x = torch.randn(4, device=DEV)
        g(w, x).backward()
        step(w2, x).backward()
        torch.testing.assert_close(w.grad, w2.grad)
    assert not cat_kernels(g)


def test_an_exception_in_a_branch_is_eagers():
    if DEV == "cuda":
        pytest.skip("an index out of range is a device-side assert on CUDA")
    def fn(a, idx):
        return torch.cat([torch.relu(a), a[idx] * 2], 0)

    f = fxlite.compile(fn)
    a = torch.randn(3, 4, device=DEV)
    same(f(a, torch.tensor([0, 2], device=DEV)), fn(a, torch.tensor([0, 2], device=DEV)))
    with pytest.raises(IndexError):
        f(a, torch.tensor([0, 7], device=DEV))


def test_the_pass_leaves_a_graph_without_such_cats_unchanged():
    def fn(a, b):
        return torch.cat([a, b], 1) * 2  # no group feeds the cat

    a, b = torch.randn(2, 3, device=DEV), torch.randn(2, 4, device=DEV)
    fused = fused_graph(fn, a, b)
    before = fused.code
    assert not cat_groups(fused)
    assert fused.code == before


def test_inception_v3_style_net_under_channels_last(monkeypatch):
    """The convolutions channels-last, as on a GPU: every block's output keeps that layout."""
    monkeypatch.setattr(segment, "channels_last_wanted", lambda sample: True)
    torch.manual_seed(2)
    m = nn.Sequential(Inception(), nn.Conv2d(26, 8, 1), nn.ReLU(), Inception()).eval().to(DEV)
    _randomize_bn(m)
    f = fxlite.compile(m)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 8, 6, 6, device=DEV)
            torch.testing.assert_close(f(x), m(x))
    assert len(cat_kernels(f)) == 2
    assert not f.fallbacks


def test_the_output_takes_eagers_layout_for_the_inputs_it_is_given():
    """Made from a contiguous recording, called on channels-last results (the compiler's
    channels-last convolutions change layouts after recording): the output is channels-last
    as eager's cat of the branches' results is, not the recording's layout (which sent
    every later convolution of inception_v3 through a layout conversion)."""

    def fn(a, s, b):
        return torch.cat([torch.relu(a * s), b], 1)

    args = [torch.randn(2, 3, 4, 4, device=DEV), torch.randn(1, 3, 1, 1, device=DEV),
            torch.randn(2, 5, 4, 4, device=DEV)]
    group = cat_group(fn, *args)
    kernel = CatKernel(group, "cat")
    for fmt in (torch.contiguous_format, torch.channels_last):
        now = [t.contiguous(memory_format=fmt) for t in args]
        same(kernel(*now), group(*now))
    assert kernel(*[t.contiguous(memory_format=torch.channels_last) for t in args]) \
        .is_contiguous(memory_format=torch.channels_last)
    assert kernel.compilations == 2


def test_nested_cats_flatten_into_one_kernel_and_the_code_is_regenerated():
    def fn(a, b, c):
        return torch.cat([a.exp(), torch.cat([b * 2, c], 1)], 1)

    args = [torch.randn(2, n, device=DEV) for n in (3, 4, 5)]
    fused = fused_graph(fn, *args)
    assert cat_groups(fused)
    assert fused.code.count("torch.cat") == 0 and "cat_0" in fused.code
    torch.testing.assert_close(fused(*args), fn(*args))


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=str)
def test_the_precompile_plans_the_compile_the_first_call_makes(fmt, monkeypatch):
    """The parallel precompile compiles each cat kernel ahead, for the layout the
    metadata gives (it once left them to the first call, one after another: 9 of
    googlenet's 14 late compiles)."""
    from fxlite.codegen.runtime import precompile as pre

    def fn(a, s, b):
        return torch.cat([torch.relu(a * s), b.exp()], 1)

    args = [torch.randn(2, 3, 4, 4, device=DEV).contiguous(memory_format=fmt),
            torch.randn(1, 3, 1, 1, device=DEV),
            torch.randn(2, 5, 4, 4, device=DEV).contiguous(memory_format=fmt)]
    fused = fused_graph(fn, *args)
    assert cat_groups(fused)
    plans = []
    real_plan = pre._plan

    def spy(gm, device):
        plans.append(real_plan(gm, device))
        return plans[-1]

    monkeypatch.setattr(pre, "_plan", spy)
    report = pre.precompile(fused, DEV)
    jobs, _, _, sources = plans[0]
    assert report["groups"] == report["kernels"] == 1 and len(jobs) == 1
    kernel = CatKernel(next(m for m in fused.children()
                            if getattr(m, "meta", {}).get("fused_kind") == "cat"), "cat")
    same(kernel(*args), fn(*args))
    assert sources == {hashlib.sha256(kernel.source.encode()).hexdigest()}
    planned_fn, planned_args, _, constexprs, _ = next(iter(jobs.values()))
    assert planned_fn is kernel._current.fn  # the same JIT function: Triton's cache serves it
    assert [a.dtype for a in planned_args] == [torch.float32] * 4 and constexprs


def test_a_one_element_input_and_an_empty_branch():
    """Fuzz seed 7905323: a 0-d tensor reshaped to one element had an offset without a
    block index, and Triton refused its load under a block mask (the check caught it)."""
    def fn(a, s, e):
        return torch.cat([torch.relu(a).reshape(-1), s.reshape(-1), F.mish(e)])

    f = fxlite.compile(fn)
    for n in (3, 5):
        a, s, e = torch.randn(2, n, device=DEV), torch.randn((), device=DEV), \
            torch.randn(0, device=DEV)
        same(f(a, s, e), fn(a, s, e))
    assert len(cat_kernels(f)) == 1 and not f.fallbacks, f.fallbacks


def test_a_one_element_cat_with_an_empty_branch():
    """Fuzz seed 9603729: one element and an empty branch make a cat of one element, whose
    index along the cat's dim was the number 0: the empty branch's offset had no block
    index, and Triton refused its load under a block mask (the check caught it, and the
    group ran in eager)."""
    def fn(a, b):
        return torch.cat([torch.relu(a).reshape(-1), torch.remainder(b, 2.0).reshape(-1)])

    f = fxlite.compile(fn)
    for n in (0, 0, 3):
        a, b = torch.randn((), device=DEV), torch.randn(n, device=DEV)
        same(f(a, b), fn(a, b))
    assert len(cat_kernels(f)) == 1 and not f.fallbacks, f.fallbacks


@pytest.mark.gpu
def test_cat_kernels_replay_in_cuda_graphs():
    torch.manual_seed(3)
    m = Inception().eval().to("cuda")
    _randomize_bn(m)
    f = fxlite.compile(m, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 8, 7, 7, device="cuda").to(memory_format=torch.channels_last)
            same(f(x), m(x))
    assert len(cat_kernels(f)) == 1
