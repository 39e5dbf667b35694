"""cse, fold_constants and fold_conv_bn."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _golden import assert_golden
from fxlite.passes.cse import cse
from fxlite.passes.fold_constants import fold_constants
from fxlite.passes.fold_conv_bn import fold_conv_bn
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite


def trace(fn):
    return fxlite.symbolic_trace(fn)


def ops_of(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


# ---------------------------------------------------------------------- cse
def spelled_twice(x, y):
    a = x + y
    b = torch.add(x, y)
    c = y.add(x)                       # add commutes
    d = torch.relu(a) * torch.relu(b)  # the relus merge once a and b have
    e = x.sum([0, 1]) + x.sum([0, 1])  # list arguments
    f = x[:, 1:] * x[:, 1:]            # slices
    return d + c + e + f.sum()


def test_cse_golden_and_numerics():
    gm = trace(spelled_twice)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    expected = gm(x, y)
    cse(gm)
    assert_golden("cse_spellings", gm.code)
    torch.testing.assert_close(gm(x, y), expected)
    targets = [n.target for n in ops_of(gm)]
    # a (b and c merged into it), e's sum + sum, then d + c, + e and + f.sum()
    assert targets.count(operator.add) == 5
    assert targets.count(torch.relu) == 1 and targets.count(operator.getitem) == 1


def test_cse_keeps_distinct_literals():
    gm = trace(lambda x: (x * 1, x * 1.0, x * True, x * 0.0, x * -0.0, x * 1))
    cse(gm)
    assert len(ops_of(gm)) == 5  # only the two `x * 1` merge
    out = gm(torch.tensor([-2.0]))
    assert torch.signbit(out[3]).item() and not torch.signbit(out[4]).item()


def test_cse_never_merges_random_or_impure_ops():
    def f(x):
        a = torch.rand_like(x)
        b = torch.rand_like(x)
        return a + b, F.dropout(x, 0.5, True), F.dropout(x, 0.5, True)
    gm = trace(f)
    cse(gm)
    targets = [n.target for n in ops_of(gm)]
    assert targets.count(torch.rand_like) == 2 and targets.count(F.dropout) == 2


def test_cse_does_not_merge_across_mutation():
    def f(x):
        a = x + 1
        x.add_(1)
        b = x + 1
        return a, b
    gm = trace(f)
    cse(gm)
    assert len(ops_of(gm)) == 3
    a, b = gm(torch.zeros(2))
    torch.testing.assert_close(b - a, torch.ones(2))


def test_cse_does_not_merge_results_whose_field_is_written_later():
    # torch.min(x, 0).values is the min's own tensor: writing it wrote the other min's
    # values once the two mins merged (fuzz seed 8829871, on the passes path)
    def f(x):
        v = torch.min(x, 0).values
        w = torch.min(x, 0).values
        v[..., 0] = -5.0
        return w
    gm = trace(f)
    cse(gm)
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), f(x))


@pytest.mark.parametrize("write", ["direct", "through_a_view", "through_a_cast",
                                   "through_to_another", "through_an_unknown_method"])
def test_cse_does_not_merge_a_value_that_is_written_later(write):
    # two equal copies are one only while neither changes (a regression: both merged, so
    # the write to one showed in the other)
    def f(x):
        a, b = x.clone(), x.clone()
        c, d = x + 0, x + 0
        if write == "direct":
            a.add_(1)
            c.mul_(3)
        elif write == "through_a_view":
            a.view(-1).add_(1)
            c[0].mul_(3)
        elif write == "through_a_cast":  # a float32 x: .float() returns a itself
            a.float().add_(1)
            c.to(torch.float32)[0] = 3
        elif write == "through_to_another":  # x.to(y) of y's dtype: x itself (fuzz 7538913)
            a.to(b).add_(1)
            c.to(d)[0] = 3
        else:  # on the CPU, .cpu() returns a itself
            a.cpu().add_(1)
            c.cpu()[0] = 3
        return a, b, c, d
    gm = trace(f)
    cse(gm)
    x = torch.ones(2, 2)
    for got, want in zip(gm(x), f(x)):
        torch.testing.assert_close(got, want)
    assert [n.target for n in ops_of(gm)].count("clone") == 2


def test_cse_does_not_merge_unknown_modules():
    class Counter(nn.Module):
        def forward(self, x):
            return x + 1

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = Counter()

        def forward(self, x):
            return self.c(x) + self.c(x)

    tracer = type("Leafy", (fxlite.Tracer,), {"is_leaf_module": lambda self, m, q: isinstance(m, Counter)})()
    gm = fxlite.GraphModule(M(), tracer.trace(M()))
    cse(gm)
    assert [n.target for n in ops_of(gm)].count("c") == 2


# ---------------------------------------------------------------------- fold_constants
class WithConstants(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        self.register_buffer("scale", torch.tensor([2.0, 3.0, 4.0]))

    def forward(self, x):
        w = self.w.t() * 2 + 1                 # folds into one buffer
        n = self.w.size(0)                     # folds into the literal 4
        y = torch.mm(x.view(-1, n), w.t()) * self.scale
        return y + torch.rand_like(self.w).sum() * 0  # random: never folded


def test_fold_constants_golden_and_numerics():
    model = WithConstants()
    gm = trace(model)
    x = torch.randn(2, 4)
    torch.manual_seed(1)
    expected = gm(x)
    fold_constants(gm)
    assert_golden("fold_constants", gm.code)
    torch.manual_seed(1)
    torch.testing.assert_close(gm(x), expected)
    torch.testing.assert_close(gm._folded_0, (model.w.t() * 2 + 1).t().detach())
    assert "_folded_0" in dict(gm.named_buffers())
    assert not hasattr(gm, "_folded_1")
    assert [n.target for n in ops_of(gm)].count(torch.rand_like) == 1
    assert sorted(n.target for n in gm.graph.nodes if n.op == "get_attr") == ["_folded_0", "scale", "w"]


def test_fold_constants_leaves_input_dependent_graphs_alone():
    gm = trace(lambda x: torch.relu(x * 2) + 1)
    before = gm.code
    fold_constants(gm)
    assert gm.code == before


def test_fold_constants_failure_leaves_module_unchanged():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(2, 3))
            self.b = nn.Parameter(torch.randn(4, 5))

        def forward(self, x):
            return x + torch.mm(self.a, self.b)  # shapes do not match: evaluation raises

    gm = trace(Bad())
    before, buffers = gm.code, dict(gm.named_buffers())
    with pytest.raises(RuntimeError):
        fold_constants(gm)
    assert gm.code == before and dict(gm.named_buffers()) == buffers
    gm.graph.lint()


# ---------------------------------------------------------------------- fold_conv_bn
def randomize_bn(bn):
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        if bn.weight is not None:
            bn.weight.uniform_(0.5, 2)
            bn.bias.uniform_(-1, 1)
    return bn


class ConvBN(nn.Module):
    def __init__(self, dims=2, bias=True, affine=True):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
        self.conv = conv(3, 6, 3, padding=1, bias=bias, groups=3)
        self.bn = randomize_bn(bn(6, affine=affine))

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 4)
        self.bn = randomize_bn(nn.BatchNorm1d(4))

    def forward(self, x):
        return self.bn(self.lin(x)) * 2


def test_fold_conv_bn_golden_and_numerics():
    model = ConvBN().eval()
    original_weight = model.conv.weight.detach().clone()
    gm = trace(model)
    x = torch.randn(2, 3, 5, 5)
    expected = model(x)
    fold_conv_bn(gm)
    assert_golden("fold_conv_bn", gm.code)
    torch.testing.assert_close(gm(x), expected)
    assert torch.equal(model.conv.weight, original_weight)  # the user's model is untouched
    assert gm.conv is not model.conv
    assert not hasattr(gm, "bn") and hasattr(model, "bn")  # folded BatchNorm deleted from gm


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("bias, affine", [(True, True), (False, True), (True, False)])
def test_fold_conv_bn_variants(dims, bias, affine):
    model = ConvBN(dims, bias, affine).eval()
    gm = trace(model)
    x = torch.randn(2, 3, *([4] * dims))
    fold_conv_bn(gm)
    assert not any(n.target == "bn" for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), model(x))


def test_fold_linear_bn():
    model = LinearBN().eval()
    gm = trace(model)
    x = torch.randn(6, 5)
    fold_conv_bn(gm)
    assert [n.target for n in ops_of(gm)] == ["lin", operator.mul]
    torch.testing.assert_close(gm(x), model(x))


def test_fold_linear_bn_skips_3d_inputs_when_shapes_are_known():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = randomize_bn(nn.BatchNorm1d(4))

        def forward(self, x):  # (N, 4, L=4): BatchNorm1d normalizes dim 1, not the features
            return self.bn(self.lin(x))

    gm = trace(M().eval())
    ShapeProp(gm).propagate(torch.randn(2, 4, 4))
    before = gm.code
    fold_conv_bn(gm)
    assert gm.code == before


def test_fold_conv_bn_functional_form():
    model = ConvBN().eval()
    gm = normalize(trace(model))
    x = torch.randn(2, 3, 5, 5)
    fold_conv_bn(gm)
    assert_golden("fold_conv_bn_functional", gm.code)
    assert F.batch_norm not in [n.target for n in ops_of(gm)]
    assert not hasattr(gm, "bn")
    torch.testing.assert_close(gm(x), model(x))


def test_fold_conv_bn_leaves_training_mode_and_shared_outputs():
    train = trace(ConvBN().train())
    before = train.code
    fold_conv_bn(train)
    assert train.code == before

    class Shared(ConvBN):
        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y  # the conv output has another user

    shared = trace(Shared().eval())
    before = shared.code
    fold_conv_bn(shared)
    assert shared.code == before


def test_fold_conv_bn_with_a_shared_conv_module():
    class Twice(ConvBN):
        def forward(self, x):
            return self.bn(self.conv(x)) + self.conv(x)

    model = Twice().eval()
    gm = trace(model)
    x = torch.randn(2, 3, 5, 5)
    fold_conv_bn(gm)
    assert sorted(n.target for n in ops_of(gm) if isinstance(n.target, str)) == ["conv", "conv_folded"]
    torch.testing.assert_close(gm(x), model(x))
    assert copy.deepcopy(gm)(x).shape == (2, 6, 5, 5)


def test_fold_conv_bn_keeps_a_batch_norm_still_used_elsewhere():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.bn = randomize_bn(nn.BatchNorm2d(3))

        def forward(self, x, y):
            return self.bn(self.conv(x)) + self.bn(y)

    model = M().eval()
    gm = trace(model)
    fold_conv_bn(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["conv", "bn"]
    x, y = torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4)
    torch.testing.assert_close(gm(x, y), model(x, y))


def window_mask(x):
    """Swin's shifted-window attention mask: made from sizes alone, in every call."""
    mask = x.new_zeros((8, 8))
    count = 0
    for h in ((0, -4), (-4, -2), (-2, None)):
        for w in ((0, -4), (-4, -2), (-2, None)):
            mask[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    mask = mask.view(2, 4, 2, 4).permute(0, 2, 1, 3).reshape(4, 16)
    mask = mask.unsqueeze(1) - mask.unsqueeze(2)
    mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
    return x + mask


def folded(fn, *inputs, **options):
    gm = trace(fn)
    ShapeProp(gm).propagate(*inputs)
    return fold_constants(gm, **options)


def test_fold_constants_folds_a_mask_made_from_sizes_and_writes():
    x = torch.randn(4, 16, 16)
    gm = folded(window_mask, x, attributes=False)
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "get_attr", "call_function", "output"]
    for _ in range(3):  # the folded buffer is read, never written
        x = torch.randn(4, 16, 16)
        torch.testing.assert_close(gm(x), window_mask(x))


def test_fold_constants_keeps_writes_that_a_run_reads_in_between():
    def f(x):
        t = x.new_zeros(3)
        y = x + t          # reads t before the write: the write must stay after it
        t[0] = 5.0
        return y * t

    gm = folded(f, torch.ones(3), attributes=False)
    assert any(n.target is operator.setitem for n in gm.graph.nodes)
    for _ in range(2):
        x = torch.randn(3)
        torch.testing.assert_close(gm(x), f(x))


def test_fold_constants_keeps_writes_into_a_value_a_returned_op_reads_before_them():
    """Fuzz seed 9400824: the matmul and the cast are returned, so they run each call (a
    caller may write what it gets), while the value they read and the write into it were
    folded: the folded value held the write, and the matmul, which comes before the write,
    read it (6 where eager gives 3). The kernel check caught it; the write now stays."""
    def f(x):
        v1 = x.new_zeros(3) + 1
        v2 = v1 @ v1
        v1[-1] = 2.0
        return v1.double(), v2

    gm = folded(f, torch.ones(3), attributes=False)
    assert any(n.target is operator.setitem for n in gm.graph.nodes)
    for _ in range(2):
        x = torch.randn(3)
        torch.testing.assert_close(gm(x), f(x))


def test_fold_constants_never_folds_memory_a_run_writes():
    def f(x):
        t = x.new_ones(3)
        t[1] = 2.0         # a constant write into memory ...
        t.add_(x)          # ... that the run writes: a fresh t each call
        return t * t.sum()

    gm = folded(f, torch.ones(3), attributes=False)
    assert not any(n.op == "get_attr" for n in gm.graph.nodes)
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(gm(x), f(x))


def test_fold_constants_without_attributes_leaves_weights_and_large_values():
    model = WithConstants()
    gm = trace(model)
    before = gm.code
    fold_constants(gm, attributes=False)  # weights may change between calls
    assert gm.code == before

    def big(x):
        return x + x.new_ones((64, 64)).tril()

    x = torch.randn(64, 64)
    assert not any(n.op == "get_attr" for n in folded(big, x, max_bytes=1024).graph.nodes)
    assert any(n.op == "get_attr" for n in folded(big, x, max_bytes=64 * 64 * 4).graph.nodes)


def test_fold_constants_never_returns_a_folded_tensor():
    """Regression: a constant the graph returns was folded into a buffer, so every call
    returned the same tensor, and a caller's write into it (GradScaler's found_inf, filled
    by a later op) changed what the next call returned."""
    def f(x):
        found = x.new_zeros(1)
        return x * 2, found

    gm = folded(f, torch.ones(3), attributes=False)
    first, second = gm(torch.ones(3))[1], gm(torch.ones(3))[1]
    first.add_(1)
    assert first is not second and second.item() == 0
