"""The op table's spellings and rules, and the normalize pass."""

from __future__ import annotations

import importlib
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _golden import assert_golden
from fxlite.passes.normalize import normalize, produces_tensor
from fxlite.passes.shape_prop import ShapeProp

import fxlite
from fxlite import ops
from fxlite.ops import OPS, call_args, canonical_args, lookup, resolve, result_dtype


def trace(fn_or_module):
    return fxlite.symbolic_trace(fn_or_module)


def calls(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def assert_canonical(gm):
    """Every node of a known op on tensors is call_function of its record's torch_fn."""
    tensor = {}
    for n in gm.graph.nodes:
        tensor[n] = produces_tensor(n, gm, tensor)
    for n in calls(gm):
        info = lookup(n, gm)
        if info is not None and info.torch_fn is not None and not info.impure and tensor[n]:
            assert n.op == "call_function" and n.target is info.torch_fn, n.format_node()


class Block(nn.Module):
    """Module, method, operator and functional spellings side by side."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.GELU(approximate="tanh")
        self.drop = nn.Dropout(0.3)
        self.ln = nn.LayerNorm(8)
        self.ident = nn.Identity()

    def forward(self, x, y):
        h = self.act(self.lin(x)) + 1
        h = self.drop(h) * 2 - y.relu()
        h = 1 - self.ln(h) / x.abs().add(1)
        h = torch.max(h, y) + F.softmax(h, dim=-1)
        return self.ident(h.sum(dim=1, keepdim=True)), (2 * h).mean(1)


class Views(nn.Module):
    def forward(self, x):
        n = x.size(0)
        v = x.view(n, -1).reshape(2, 3, 4).permute(0, 2, 1).transpose(1, 2)
        s = v[:, None, 1:, ...].squeeze(1).flatten(1).unsqueeze(0).contiguous()
        c = (s.half().float() > 0).logical_not()
        return torch.where(c, s.type(torch.float64), x.sum().to(torch.float64)), n * 2


def test_block_golden_and_numerics():
    gm = trace(Block().eval())
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    expected = gm(x, y)
    normalize(gm)
    assert_golden("normalize_block", gm.code)
    torch.testing.assert_close(gm(x, y), expected)
    assert_canonical(gm)
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]


def test_views_golden_and_numerics():
    gm = trace(Views())
    x = torch.randn(2, 12)
    expected = gm(x)
    normalize(gm)
    assert_golden("normalize_views", gm.code)
    torch.testing.assert_close(gm(x), expected)
    assert_canonical(gm)


SPELLINGS = {
    "add": ([lambda x, y: x + y, lambda x, y: torch.add(x, y), lambda x, y: x.add(y),
             lambda x, y: torch.add(x, y, alpha=1)],
            torch.add),
    "mul_scalar": ([lambda x, y: x * 2, lambda x, y: 2 * x, lambda x, y: x.mul(2),
                    lambda x, y: torch.multiply(x, 2)], torch.mul),
    "relu": ([lambda x, y: F.relu(x), lambda x, y: x.relu(), lambda x, y: torch.relu(x),
              lambda x, y: F.relu(x, inplace=False)], torch.relu),
    "sum": ([lambda x, y: x.sum(dim=1), lambda x, y: x.sum(1), lambda x, y: torch.sum(x, 1),
             lambda x, y: torch.sum(x, dim=1, keepdim=False)], torch.sum),
    "maximum": ([lambda x, y: torch.max(x, y), lambda x, y: x.max(y),
                 lambda x, y: torch.maximum(x, y)], torch.maximum),
    "cast": ([lambda x, y: x.half(), lambda x, y: x.to(torch.float16),
              lambda x, y: x.type(torch.float16), lambda x, y: x.to(dtype=torch.float16)],
             torch.Tensor.to),
    "view": ([lambda x, y: x.view(2, 8), lambda x, y: x.view((2, 8))], torch.Tensor.view),
    "rsub": ([lambda x, y: 1 - x, lambda x, y: torch.rsub(x, 1)], torch.rsub),
    "div": ([lambda x, y: x / y, lambda x, y: torch.true_divide(x, y), lambda x, y: x.div(y),
             lambda x, y: torch.divide(x, y)], torch.div),
    "lt": ([lambda x, y: x < 0.5, lambda x, y: 0.5 > x, lambda x, y: torch.less(x, 0.5),
            lambda x, y: x.lt(0.5)], torch.lt),
    "var": ([lambda x, y: x.var(1, False), lambda x, y: torch.var(x, 1, unbiased=False),
             lambda x, y: torch.var(x, dim=1, correction=0)], torch.var),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spellings_become_one_call(name):
    fns, target = SPELLINGS[name]
    x, y = torch.rand(4, 4) + 0.5, torch.rand(4, 4) + 0.5
    forms = set()
    for fn in fns:
        gm = trace(fn)
        expected = gm(x, y)
        normalize(gm)
        (node,) = calls(gm)
        assert node.op == "call_function" and node.target is target, node.format_node()
        forms.add(repr(fxlite.map_arg((node.args, node.kwargs), lambda n: n.name)))
        torch.testing.assert_close(gm(x, y), expected)
    assert len(forms) == 1, forms


@pytest.mark.parametrize("spelling, args, target", [
    (torch.Tensor.add, ("x", "y"), torch.add), (torch.Tensor.view, ("x", 2, 8), torch.Tensor.view),
    (torch.Tensor.relu, ("x",), torch.relu), (torch.Tensor.float, ("x",), torch.Tensor.to),
    (torch.Tensor.amax, ("x", 1), torch.amax), (torch.clip, ("x", 0.2, 0.8), torch.clamp),
])
def test_tensor_function_spellings(spelling, args, target):
    # torch.Tensor.add(x, y) cannot be traced (the descriptor rejects a Proxy): build it.
    graph = fxlite.Graph()
    env = {"x": graph.placeholder("x"), "y": graph.placeholder("y")}
    graph.output(graph.call_function(spelling, tuple(env.get(a, a) for a in args)))
    gm = fxlite.GraphModule(nn.Module(), graph)
    x, y = torch.rand(4, 4), torch.rand(4, 4)
    expected = gm(x, y)
    normalize(gm)
    (node,) = calls(gm)
    assert node.target is target
    torch.testing.assert_close(gm(x, y), expected)


@pytest.mark.parametrize("module, target", [
    (nn.ReLU(), torch.relu), (nn.SiLU(), F.silu), (nn.Sigmoid(), torch.sigmoid),
    (nn.Tanh(), torch.tanh), (nn.GELU(), F.gelu), (nn.Softmax(dim=1), torch.softmax),
    (nn.Softplus(beta=2.0), F.softplus), (nn.LayerNorm(6), F.layer_norm),
    (nn.Linear(6, 3), F.linear), (nn.Embedding(10, 6), F.embedding),
    (nn.BatchNorm1d(6), F.batch_norm), (nn.GroupNorm(2, 6), F.group_norm),
    (nn.RMSNorm(6), F.rms_norm),
])
def test_modules_become_functions(module, target):
    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, x):
            return self.m(x)

    model = Wrap().eval()
    if isinstance(module, nn.BatchNorm1d):  # non-trivial statistics
        model.m.running_mean.uniform_(-1, 1)
        model.m.running_var.uniform_(0.5, 2)
    x = torch.randint(0, 10, (4, 6)) if isinstance(module, nn.Embedding) else torch.randn(4, 6)
    gm = trace(model)
    expected = gm(x)
    normalize(gm)
    (node,) = calls(gm)
    assert node.op == "call_function" and node.target is target and node.name == "m"
    assert all(a.op == "get_attr" for a in node.all_input_nodes[1:])
    torch.testing.assert_close(gm(x), expected)


@pytest.mark.parametrize("module", [
    nn.BatchNorm1d(6).train(), nn.ReLU(inplace=True), nn.Conv1d(6, 6, 3, padding=1, padding_mode="reflect"),
    nn.Embedding(10, 6, max_norm=1.0), nn.Softmax(),
])
def test_modules_without_a_safe_function_form_stay(module):
    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, x):
            return self.m(x)

    gm = trace(Wrap())
    before = gm.code
    normalize(gm)
    assert gm.code == before


def test_dropout_identity_only_in_eval():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x) + F.dropout(x, 0.5, self.training)

    train = trace(M().train())
    normalize(train)
    targets = [n.target for n in calls(train)]
    assert "drop" in targets and F.dropout in targets  # random: kept
    evaluated = trace(M().eval())
    normalize(evaluated)
    (node,) = calls(evaluated)
    assert node.target is torch.add and node.args == (evaluated.graph.find_nodes(op="placeholder")[0],) * 2


def test_python_arithmetic_on_sizes_is_kept():
    def f(x):
        n = x.size(0) * 2 + 1
        return x.reshape(n - 1, -1) * 3
    gm = trace(f)
    x = torch.randn(4, 6)
    expected = gm(x)
    normalize(gm)
    int_ops = [n.target for n in calls(gm) if n.target in (operator.mul, operator.add, operator.sub)]
    assert int_ops == [operator.mul, operator.add, operator.sub]
    assert [n.target for n in calls(gm)][-1] is torch.mul
    torch.testing.assert_close(gm(x), expected)


def test_names_and_meta_survive():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(x + 1).sum(dim=-1)

    gm = trace(M())
    ShapeProp(gm).propagate(torch.randn(3, 5))
    before = {n.name: n.meta["tensor_meta"] for n in gm.graph.nodes if n.op != "output"}
    normalize(gm)
    after = {n.name: n.meta["tensor_meta"] for n in gm.graph.nodes if n.op != "output"}
    assert after == before and list(after) == ["x", "add", "act", "sum_1"]


def test_failure_leaves_graph_unchanged(monkeypatch):
    gm = trace(Block().eval())
    before, nodes = gm.code, list(gm.graph.nodes)

    def broken(info, args):
        if info.name == "layer_norm":
            raise RuntimeError("boom")
        return call_args(info, args)

    # the module, not the function that fxlite.passes exports under the same name
    monkeypatch.setattr(importlib.import_module("fxlite.passes.normalize"), "call_args", broken)
    with pytest.raises(RuntimeError, match="boom"):
        normalize(gm)
    assert gm.code == before and list(gm.graph.nodes) == nodes
    gm.graph.lint()


# ---------------------------------------------------------------------- the table itself
REQUIRED = """add sub rsub mul truediv floordiv remainder pow neg abs eq ne lt le gt ge
logical_and logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not
where exp exp2 log log1p sqrt rsqrt sin cos tanh sigmoid relu gelu silu softplus clamp
clamp_min clamp_max floor ceil round maximum minimum to dropout identity sum mean amax amin
max min var std prod view reshape permute transpose unsqueeze squeeze expand flatten
contiguous getitem softmax log_softmax layer_norm rms_norm group_norm linear matmul conv1d
conv2d conv3d batch_norm embedding""".split()


def test_table_covers_the_required_ops():
    missing = [name for name in REQUIRED if name not in OPS]
    assert not missing
    for name in REQUIRED:
        info = OPS[name]
        assert info.kind in ("pointwise", "reduction", "view", "extern", "effect", "composite")


@pytest.mark.parametrize("fn", [torch.mm, torch.bmm, operator.matmul, lambda a, b: a.matmul(b),
                                lambda a, b: a.bmm(b)])
def test_matmul_spellings(fn):
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    gm = trace(lambda a, b: fn(a, b))
    if fn is torch.mm:
        a, b = a[0], b[0]
    expected = gm(a, b)
    normalize(gm)
    (node,) = calls(gm)
    assert lookup(node).name == "matmul" and node.target is torch.matmul
    torch.testing.assert_close(gm(a, b), expected)


DTYPE_CASES = [
    ("add", lambda a, b: torch.add(a, b)), ("truediv", lambda a, b: torch.div(a, b)),
    ("mul", lambda a, b: torch.mul(a, 2.5)), ("eq", lambda a, b: torch.eq(a, b)),
    ("exp", lambda a, b: torch.exp(a)), ("sum", lambda a, b: torch.sum(a)),
    ("neg", lambda a, b: torch.neg(a)), ("where", lambda a, b: torch.where(a > 0, a, b)),
]
DTYPES = [torch.float32, torch.float16, torch.int32, torch.int64, torch.bool]


@pytest.mark.parametrize("name, fn", DTYPE_CASES, ids=[c[0] for c in DTYPE_CASES])
@pytest.mark.parametrize("da", DTYPES, ids=str)
@pytest.mark.parametrize("db", [torch.float32, torch.int32, torch.bool], ids=str)
def test_result_dtype_matches_torch(name, fn, da, db):
    a, b = torch.ones(3, dtype=da), torch.ones(3, dtype=db)
    try:
        actual = fn(a, b).dtype
    except RuntimeError:
        pytest.skip("torch rejects these dtypes")
    gm = trace(fn)
    (node,) = [n for n in calls(gm) if lookup(n).name == name]
    info, args = resolve(node)
    # tensors are given as their dtypes; the only other tensor input is where's condition
    dtype_of = {"a": da, "b": db}
    as_dtypes = {k: dtype_of.get(v.name, torch.bool) if isinstance(v, fxlite.Node) else v
                 for k, v in args.items()}
    assert result_dtype(info, as_dtypes) == actual


def test_lookup_refines_and_canonical_args_agree():
    gm = trace(lambda x, y: (torch.max(x, y), torch.max(x, 1), x.double(), x.var(0, True)))
    nodes = {n.name: n for n in calls(gm)}
    assert lookup(nodes["max_1"]).name == "maximum"
    assert lookup(nodes["max_2"]).name == "max"
    assert lookup(nodes["double"]).name == "to"
    assert canonical_args(nodes["double"], OPS["to"])["dtype"] is torch.float64
    assert canonical_args(nodes["var"], OPS["var"]) == {"input": nodes["var"].args[0], "dim": 0}
    assert call_args(OPS["sum"], {"input": 1, "dim": 2, "keepdim": True}) == ((1,), {"dim": 2, "keepdim": True})
    assert call_args(OPS["layer_norm"], {"input": 1, "normalized_shape": (4,), "bias": 2}) == \
        ((1, (4,), None, 2), {})


def test_is_impure_trusts_the_table():
    gm = trace(lambda x: (x > 0) & (x < 1))
    (and_node,) = [n for n in calls(gm) if n.target is operator.and_]
    assert not ops.is_impure(and_node)
    gm2 = trace(lambda x: x.add_(1))
    assert ops.is_impure(calls(gm2)[0])


@pytest.mark.parametrize("make", [lambda x: F.dropout(x, 0.0, True), lambda x: nn.Dropout(0)(x)])
def test_a_dropout_that_draws_nothing_is_pure(make):
    # p=0 returns its input and draws no random numbers: dead, it goes (transformers'
    # GPT-2 with dropout off keeps one after each residual branch, read by nothing),
    # where p=0.5 stays for the generator state it advances
    class M(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.drop = nn.Dropout(p)

        def forward(self, x):
            F.dropout(x, self.drop.p, True)
            self.drop(x)
            return x + 1

    for p, kept in ((0.0, 0), (0.5, 2)):
        gm = trace(M(p))
        gm.graph.eliminate_dead_code()
        assert sum("drop" in str(n.target) for n in calls(gm)) == kept
    assert not ops.is_impure(calls(trace(make))[0])


def test_chained_identities_and_idempotence():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Identity()
            self.b = nn.Dropout(0.1)

        def forward(self, x):
            y = self.b(self.a(self.b(x)))
            return y * 2, F.dropout(y, 0.2, training=False) + y

    gm = trace(M().eval())
    x = torch.randn(3)
    expected = gm(x)
    normalize(gm)
    assert [n.target for n in calls(gm)] == [torch.mul, torch.add]
    torch.testing.assert_close(gm(x), expected)
    once = gm.code
    normalize(gm)
    assert gm.code == once
    block = normalize(trace(Block().eval()))
    once = block.code
    assert normalize(block).code == once


def test_aten_overloads_that_are_spellings_of_table_ops_normalize_to_them():
    """AOTAutograd's graphs call aten overloads (``backend="fxlite_aot"``): where the
    overload lists the record's parameters in order, it is one more spelling, so fusion
    sees ``torch.add``, ``torch.sum``... Others (``threshold_backward``) stay."""
    aten = torch.ops.aten
    graph = fxlite.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    a = graph.call_function(aten.add.Tensor, (x, y), {"alpha": 2})
    r = graph.call_function(aten.relu.default, (a,))
    s = graph.call_function(aten.sum.dim_IntList, (r, [1], True))
    t = graph.call_function(aten.threshold_backward.default, (s, s, 0.0))
    graph.output(t)
    gm = fxlite.GraphModule(torch.nn.Module(), graph)
    out = normalize(gm)
    targets = [n.target for n in out.graph.nodes if n.op == "call_function"]
    assert targets == [torch.add, torch.relu, torch.sum, aten.threshold_backward.default]
    xs = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(out(*xs), gm(*xs))
