"""``torch.compile(f, backend="fxlite", dynamic=True)``: one recording for every size.

Dynamo hands fxlite graphs whose sizes are ``SymInt`` arguments. fxlite records each
graph once, with those sizes as inputs (``codegen/capture/symbolic.py``): later calls of
any size replay it, computing the sizes from their own arguments, and run the same
kernels. Each test calls with several sizes, in an order that returns to earlier ones,
and compares with eager every time; a graph that uses a size as a value (returns it) is
recorded per size instead, and still equals eager.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import torch._dynamo
from fxlite.codegen import dynamo_backend
from fxlite.codegen.capture.symbolic import SymbolicInt

import fxlite

from test_dynamo_backend import _fresh  # noqa: F401  isort: skip  (resets around each test)

pytest.importorskip("triton")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SIZES = [(2, 3), (3, 5), (4, 7), (2, 3), (5, 2)]


def norm_relu(x, w):
    B, T, C = x.shape
    h = F.layer_norm(x.view(B * T, C), (C,), w)
    return torch.relu(h).view(B, T, C) * 2


def heads(x, w):
    B, T, C = x.shape
    q = (x @ w).view(B, T, 2, C // 2).transpose(1, 2)
    return torch.softmax(q * 0.5, -1).transpose(1, 2).reshape(B, T, C) + x


def positions(x, w):
    B, T, C = x.shape
    pos = torch.arange(T, dtype=x.dtype).view(1, T, 1)
    return torch.sigmoid(x[:, : T - 1] + pos[:, 1:]) * w


def split_attention(x, w):
    # GPT-2's attention: a split whose number of results depends on a size (SIZE_FANOUT)
    B, T, C = x.shape
    q, k, v = (x @ w).split(C, dim=2)
    a, b = v.chunk(2, dim=-1)
    att = torch.softmax(q @ k.transpose(1, 2) * 0.5, -1)
    return torch.cat([att @ a, att @ b], -1) + x


def graphs():
    return [g for g in dynamo_backend.compiled_graphs()]


@pytest.mark.parametrize("fn", [norm_relu, heads, positions, split_attention])
def test_one_recording_serves_every_size(fn):
    compiled = torch.compile(fn, backend="fxlite", dynamic=True)
    w = {heads: torch.randn(8, 8), split_attention: torch.randn(8, 24)}.get(fn, torch.randn(8))
    for B, T in SIZES:
        x = torch.randn(B, T, 8)
        torch.testing.assert_close(compiled(x, w), fn(x, w))
    made = graphs()
    assert made and all(g.recordings == 1 for g in made), [g.recordings for g in made]
    assert sum(len(g.kernels) for g in made) >= 1
    assert not [f for g in made for f in g.fallbacks]


def sizes_out(x):
    return x * 2, x.shape[0] * x.shape[1]


def test_a_size_returned_is_recorded_per_size_and_equals_eager():
    compiled = torch.compile(sizes_out, backend="fxlite", dynamic=True)
    for B, T in SIZES:
        x = torch.randn(B, T)
        got, n = compiled(x)
        want, m = sizes_out(x)
        torch.testing.assert_close(got, want)
        assert n == m and type(n) is int
    made = graphs()
    assert made and max(g.recordings for g in made) >= 2  # (sizes as values: keyed by them)


def test_training_steps_of_varying_sizes_equal_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)

    def step(model, x):
        B, T, C = x.shape
        out = model(x.view(B * T, C)).view(B, T, 4)
        loss = out.square().mean()
        loss.backward()
        return loss.detach()

    compiled = torch.compile(step, backend="fxlite", dynamic=True)
    for B, T in SIZES:
        x = torch.randn(B, T, 8)
        torch.testing.assert_close(compiled(model, x), step(ref, x))
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            p.grad, q.grad = None, None
    assert all(g.recordings == 1 for g in graphs()), [g.recordings for g in graphs()]


def test_a_symbolic_int_records_its_arithmetic_and_says_when_used_as_a_value():
    class Owner:
        escaped = False

    from fxlite.graph import Graph

    graph = Graph()
    owner = Owner()
    n = SymbolicInt(6, graph.placeholder("n"), owner)
    m = (n * 2 + 1) // 3 - n % 4
    assert m == (6 * 2 + 1) // 3 - 6 % 4 and owner.escaped  # (the == itself is a use)
    owner.escaped = False
    k = 3 * n - 1
    assert isinstance(k, SymbolicInt) and not owner.escaped
    assert [node.target.__name__ for node in graph.nodes if node.op == "call_function"][-2:] \
        == ["mul", "sub"]
    assert isinstance(n / 2, float) and owner.escaped


def test_a_returned_container_is_the_functions_own_object():
    # the recording call's result had its SymbolicInts made ints by rebuilding its
    # containers; a list the function keeps and returns must stay that very list
    kept: list = []

    def fn(x):
        kept.append(x * 2)
        return kept

    compiled = fxlite.compile(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            assert compiled(torch.randn(3)) is kept
    compiled_graph = torch.compile(sizes_out, backend="fxlite", dynamic=True)
    out = compiled_graph(torch.randn(2, 3))
    assert type(out[1]) is int and not isinstance(out[1], SymbolicInt)


# ------------------------------------------- fxlite.compile(fn, dynamic=True), mark_dynamic
@pytest.mark.parametrize("fn", [norm_relu, heads, positions, split_attention])
def test_fxlite_compile_dynamic_true_records_each_graph_once(fn):
    w = {heads: torch.randn(8, 8), split_attention: torch.randn(8, 24)}.get(fn, torch.randn(8))
    dynamic = fxlite.compile(fn, dynamic=True)
    specialized = fxlite.compile(fn)
    for B, T in SIZES:
        x = torch.randn(B, T, 8)
        want = fn(x, w)
        torch.testing.assert_close(dynamic(x, w), want)
        torch.testing.assert_close(specialized(x, w), want)
        assert dynamic.kernels and not dynamic.fallbacks and dynamic.tier == "replayed"
    # one recording per graph Dynamo made (it may make another where a size is 1)
    assert [g.recordings for g in dynamic._graphs] == [1] * len(dynamic._graphs)
    assert dynamic.recordings < specialized.recordings == len(set(SIZES))  # (fxlite's recorder: keyed by sizes)


def test_fxlite_compile_dynamic_true_trains_a_module_over_sizes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    compiled = fxlite.compile(model, dynamic=True)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    for B, T in SIZES:
        x = torch.randn(B, T, 8)
        losses = []
        for m, o in ((compiled, opt), (ref, ref_opt)):
            loss = m(x.view(B * T, 8)).view(B, T, 4).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(*losses)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert compiled.recordings == 1 and compiled.kernels


def test_fxlite_compile_dynamic_true_runs_python_between_graphs_on_every_call():
    seen = []

    def f(x):
        y = torch.relu(x) * 2
        seen.append(int(y.sum() > 0))  # a graph break: the Python runs on each call
        B, T = x.shape
        return y.view(B * T) + 1

    compiled = fxlite.compile(f, dynamic=True)
    mine = []
    for B, T in SIZES:
        x = torch.randn(B, T)
        torch.testing.assert_close(compiled(x), f(x))
        mine.append(seen[-2])
    assert mine == seen[1::2] and compiled.kernels
    # (Dynamo makes new graphs after this break, as torch.compile does: each recorded once)
    assert [g.recordings for g in compiled._graphs] == [1] * len(compiled._graphs)


@pytest.mark.parametrize("dynamic", [None, False])
def test_mark_dynamic_makes_the_marked_sizes_symbolic_unless_dynamic_is_false(dynamic):
    compiled = fxlite.compile(norm_relu, dynamic=dynamic)
    w = torch.randn(8)
    for B, T in SIZES:
        x = torch.randn(B, T, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(x, 1)
        torch.testing.assert_close(compiled(x, w), norm_relu(x, w))
        assert compiled.kernels
    assert compiled.recordings == (1 if dynamic is None else len(set(SIZES)))


def test_dynamic_true_with_a_dynamo_backends_name_gives_it_dynamos_graphs():
    compiled = fxlite.compile(heads, dynamic=True, backend="aot_eager")
    w = torch.randn(8, 8)
    for B, T in SIZES:
        x = torch.randn(B, T, 8)
        torch.testing.assert_close(compiled(x, w), heads(x, w))
    assert "aot_eager" in compiled.tier and not compiled.kernels


def test_dynamic_true_after_reset_and_in_a_copy_records_again():
    compiled = fxlite.compile(norm_relu, dynamic=True)
    w = torch.randn(8)
    compiled(torch.randn(2, 3, 8), w)
    fxlite.reset()
    assert compiled.recordings == 0
    twin = copy.deepcopy(compiled)
    for B, T in SIZES:
        x = torch.randn(B, T, 8)
        torch.testing.assert_close(compiled(x, w), norm_relu(x, w))
        torch.testing.assert_close(twin(x, w), norm_relu(x, w))
    assert compiled.recordings == 1 and twin.recordings == 1
    assert twin is not compiled and twin._graphs is not compiled._graphs


def shape_prefix(x, w):
    # x.shape[:-1] is a torch.Size of sizes taken as inputs: each must stay symbolic
    return torch.relu(x @ w).view(x.shape[:-1] + (2, 4)).sum(-1)


def test_a_torch_size_of_symbolic_sizes_stays_symbolic():
    compiled = fxlite.compile(shape_prefix, dynamic=True)
    w = torch.randn(8, 8)
    for B, T in SIZES:
        x = torch.randn(B, T, 8)
        torch.testing.assert_close(compiled(x, w), shape_prefix(x, w))
        assert compiled.kernels and compiled.tier == "replayed", compiled.tier  # no eager rerun
    assert [g.recordings for g in compiled._graphs] == [1] * len(compiled._graphs)


class ScaledNorm(torch.nn.Module):
    """A module whose float attributes Dynamo passes as 0-d tensors with dynamic=True."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.eps, self.scale = 1e-5, 0.5

    def forward(self, x):
        return F.layer_norm(self.lin(x), (8,), eps=self.eps) * self.scale


def test_floats_dynamo_passes_as_tensors_key_the_recording_and_split_nothing():
    model = ScaledNorm()
    compiled = fxlite.compile(model, dynamic=True)
    for i, (B, T) in enumerate(SIZES):
        model.scale = 0.5 if i < 3 else 2.0  # a new value: recorded again, not a stale one
        x = torch.randn(B, T, 8)
        torch.testing.assert_close(compiled(x), model(x))
    graphs = compiled._compiled._graphs
    assert [len(g._last) for g in graphs if g._last] == [1]  # one segment: no read of a float
    assert compiled.recordings == 2


def test_hf_gpt2_under_dynamic_true_records_once_and_keeps_its_kernels():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=64, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config).eval()
    compiled = fxlite.compile(model, dynamic=True)
    with torch.no_grad():
        for T in (8, 12, 16, 9):
            ids = torch.randint(0, 100, (2, T))
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits,
                                       rtol=1e-4, atol=1e-4)
            assert compiled.kernels and compiled.tier == "replayed", compiled.tier
    assert compiled.recordings == len(compiled._compiled._graphs)  # one per graph
    main = max(compiled._compiled._graphs, key=lambda g: len(g._fn.graph.nodes))
    # one segment: its floats (eps, dropout's p) and GELU's torch._sym_sqrt(2 / pi) of
    # literals split nothing
    assert len(main._last) == 1


def flat(x):
    return x.reshape(x.numel()) * 2


def summed(x):
    return x.new_zeros(torch.sym_sum([1, x.shape[0], x.shape[1]])) + 1


@pytest.mark.parametrize("fn", [flat, summed])
def test_numel_and_sym_sum_of_sizes_stay_symbolic(fn):
    compiled = fxlite.compile(fn, dynamic=True)
    for B, T in SIZES:
        x = torch.randn(B, T)
        torch.testing.assert_close(compiled(x), fn(x))
        assert compiled.kernels and not compiled.fallbacks, compiled.fallbacks
    assert [g.recordings for g in compiled._graphs] == [1] * len(compiled._graphs)


def scaled_by_a_size(x):
    return x * x.shape[0] ** 0.5  # a float of a size: recorded per size


def test_past_the_recompile_limit_a_graph_says_it_runs_eagerly():
    compiled = fxlite.compile(scaled_by_a_size, dynamic=True, recompile_limit=2)
    with pytest.warns(UserWarning, match="recorded 2 times"):
        for B in (2, 3, 4, 5, 6):
            x = torch.randn(B, 4)
            torch.testing.assert_close(compiled(x), scaled_by_a_size(x))
    assert compiled.recordings == 2  # the limit reaches the graphs fxlite compiles
    assert compiled.tier.startswith("eager:") and "recompile_limit" in compiled.tier
    assert not compiled.kernels


def test_messages_name_the_users_function_and_lines_not_dynamos_generated_code():
    compiled = fxlite.compile(scaled_by_a_size, dynamic=True, recompile_limit=1)
    with pytest.warns(UserWarning, match="Dynamo's graph of scaled_by_a_size was recorded"):
        for B in (2, 3):
            compiled(torch.randn(B, 4))
    (graph,) = compiled._graphs
    root = next(iter(graph._compiled._trees.values()))
    traces = [n.meta["stack_trace"] for n in root.gm.graph.nodes if "stack_trace" in n.meta]
    assert traces and all(__file__ in t and "x.shape[0] ** 0.5" in t for t in traces), traces


def test_a_float_changing_on_every_call_is_named_at_the_limit():
    model = ScaledNorm()
    compiled = fxlite.compile(model, dynamic=True, recompile_limit=2)
    with pytest.warns(UserWarning, match="a float Dynamo passes as a tensor .* now 3.0"):
        for i in range(4):
            model.scale = float(i + 1)  # a new value each call: recorded again each time
            x = torch.randn(2, 3, 8)
            torch.testing.assert_close(compiled(x), model(x))


def scaled_attention(q, k):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1)


def sqrt_scaled_attention(q, k):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)), -1)


@pytest.mark.parametrize("fn", [scaled_attention, sqrt_scaled_attention])
def test_a_float_of_one_size_keys_the_recording_by_that_size_alone(fn):
    # C ** -0.5 uses the size C as a value: recorded per C, not per (B, T, C)
    compiled = fxlite.compile(fn, dynamic=True)
    shapes = [(2, 3, 8), (3, 5, 8), (4, 7, 8), (2, 4, 16), (5, 6, 16), (2, 3, 8)]
    for B, T, C in shapes:
        q, k = torch.randn(B, T, C), torch.randn(B, T, C)
        torch.testing.assert_close(compiled(q, k), fn(q, k))
        assert compiled.kernels
    assert compiled.recordings == len({C for _, _, C in shapes})
