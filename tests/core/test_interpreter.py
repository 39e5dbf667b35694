"""Interpreter and Transformer: the fx.rst Interpreter pattern, hooks, GC, errors, re-tracing."""

from __future__ import annotations

import operator
import weakref

import pytest
import torch
import torch.nn.functional as F
from fxlite.passes import ShapeProp

import fxlite as fx
from fxlite.interpreter import Interpreter, Transformer


class Block(torch.nn.Module):
    """Submodules (nested too), a parameter read through get_attr, and a method call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 5)
        self.seq = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(5, 3))
        self.scale = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = torch.sigmoid(self.lin(x))
        h = self.seq(h) * self.scale
        return h.sum(dim=-1, keepdim=True) + x.mean()


def _chain(x):
    a = torch.relu(x)
    b = a + 1
    c = b * 2
    return torch.sigmoid(c)


@pytest.fixture
def block():
    return Block()


@pytest.fixture
def block_gm(block):
    return fx.symbolic_trace(block)


# ---------------------------------------------------------------------- running
def test_run_matches_eager_on_submodules_params_and_methods(block_gm):
    ops = {n.op for n in block_gm.graph.nodes}
    assert {"call_module", "get_attr", "call_method", "call_function"} <= ops
    x = torch.randn(2, 4)
    torch.testing.assert_close(Interpreter(block_gm).run(x), block_gm(x))


def test_call_function_override_counts_and_swaps_ops(block, block_gm):
    class NegSigmSwap(Interpreter):
        def __init__(self, module):
            super().__init__(module)
            self.calls: dict[object, int] = {}

        def call_function(self, target, args, kwargs):
            self.calls[target] = self.calls.get(target, 0) + 1
            if target is torch.sigmoid:
                return torch.neg(*args, **kwargs)
            return super().call_function(target, args, kwargs)

    x = torch.randn(2, 4)
    interp = NegSigmSwap(block_gm)
    out = interp.run(x)
    expected_counts: dict[object, int] = {}
    for n in block_gm.graph.nodes:
        if n.op == "call_function":
            expected_counts[n.target] = expected_counts.get(n.target, 0) + 1
    assert interp.calls == expected_counts

    m = block  # eager with the swap, computed by hand from the module's own layers
    h = torch.neg(m.lin(x))
    torch.testing.assert_close(out, (m.seq(h) * m.scale).sum(dim=-1, keepdim=True) + x.mean())


def test_every_hook_is_called_once_per_node_of_its_opcode(block_gm):
    seen: list[str] = []

    class Recorder(Interpreter):
        pass

    for op in ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output"):
        def hook(self, target, args, kwargs, _op=op):
            seen.append(_op)
            return getattr(Interpreter, _op)(self, target, args, kwargs)
        setattr(Recorder, op, hook)

    Recorder(block_gm).run(torch.randn(2, 4))
    assert seen == [str(n.op) for n in block_gm.graph.nodes]


def test_initial_env_skips_the_nodes_it_gives():
    gm = fx.symbolic_trace(_chain)
    nodes = {n.name: n for n in gm.graph.nodes}
    ran: list[str] = []

    class Log(Interpreter):
        def run_node(self, n):
            ran.append(n.name)
            return super().run_node(n)

    b_value = torch.tensor([5.0, -3.0])
    env = {nodes["add"]: b_value}
    out = Log(gm).run(torch.randn(2), initial_env=env)
    torch.testing.assert_close(out, torch.sigmoid(b_value * 2))
    assert ran == ["x", "relu", "mul", "sigmoid", "output"]
    assert list(env) == [nodes["add"]]  # the caller's dict is not modified

    # A placeholder given in initial_env consumes no positional input.
    ran.clear()
    out = Log(gm).run(initial_env={nodes["x"]: torch.tensor([-1.0, 2.0])})
    torch.testing.assert_close(out, torch.sigmoid((torch.tensor([0.0, 2.0]) + 1) * 2))
    assert "x" not in ran


def test_explicit_graph_argument_runs_that_graph_with_module_attrs(block_gm):
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("lin.weight")
    g.output(g.call_function(torch.matmul, (x, g.call_method("t", (w,)))))
    inp = torch.randn(2, 4)
    out = Interpreter(block_gm, graph=g).run(inp)
    torch.testing.assert_close(out, inp @ block_gm.lin.weight.t())


# ---------------------------------------------------------------------- placeholders
def test_placeholder_default_and_star_args():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y", default_value=10)
    rest = g.create_node("placeholder", "*args")
    g.output((g.call_function(operator.add, (x, y)), rest))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert Interpreter(gm).run(1) == (11, [])
    assert Interpreter(gm).run(1, 2, 3, 4) == (3, [3, 4])


def test_traced_star_args_and_transform_round_trip():
    def f(x, *args):
        return x * args[1] + args[0]

    gm = fx.symbolic_trace(f)
    x = torch.randn(3)
    torch.testing.assert_close(Interpreter(gm).run(x, 1.0, 2.0), x * 2.0 + 1.0)
    new_gm = fx.Transformer(gm).transform()  # also reachable as fxlite.Transformer
    assert [n.target for n in new_gm.graph.find_nodes(op="placeholder")] == ["x", "*args"]
    torch.testing.assert_close(new_gm(x, 1.0, 2.0), x * 2.0 + 1.0)


def test_missing_positional_argument_names_the_parameter():
    gm = fx.symbolic_trace(lambda a, b: a + b)
    with pytest.raises(RuntimeError, match="'b'"):
        Interpreter(gm).run(torch.ones(1))


# ---------------------------------------------------------------------- garbage collection
def test_env_holds_only_the_output_after_run():
    gm = fx.symbolic_trace(Block())
    interp = Interpreter(gm)
    interp.run(torch.randn(2, 4))
    assert [n.op for n in interp.env] == ["output"]

    keep = Interpreter(gm, garbage_collect_values=False)
    keep.run(torch.randn(2, 4))
    assert list(keep.env) == list(gm.graph.nodes)


def test_value_is_freed_right_after_its_last_use():
    gm = fx.symbolic_trace(_chain)
    refs: dict[str, weakref.ref] = {}
    alive_at: dict[str, set[str]] = {}

    class Watch(Interpreter):
        def run_node(self, n):
            alive_at[n.name] = {name for name, r in refs.items() if r() is not None}
            result = super().run_node(n)
            if isinstance(result, torch.Tensor):
                refs[n.name] = weakref.ref(result)
            return result

    x = torch.randn(3)
    Watch(gm).run(x)
    del x
    # relu's value is read only by add: by the time mul runs it is gone; add's is still live.
    assert alive_at["add"] >= {"relu"}
    assert "relu" not in alive_at["mul"] and "add" in alive_at["mul"]
    assert "add" not in alive_at["sigmoid"]


def test_dead_values_are_freed_and_env_stays_small_on_a_long_chain():
    def f(x):
        for _ in range(2000):
            x = x + 1
            x * 3  # dead: nobody reads it
        return x

    gm = fx.symbolic_trace(f)
    peak = 0

    class Peak(Interpreter):
        def run_node(self, n):
            nonlocal peak
            peak = max(peak, len(self.env))
            return super().run_node(n)

    out = Peak(gm).run(torch.zeros(2))
    torch.testing.assert_close(out, torch.full((2,), 2000.0))
    assert peak <= 2


# ---------------------------------------------------------------------- errors
def test_error_keeps_type_and_names_the_node():
    def f(x):
        y = x.relu()
        return torch.matmul(y, y)  # 1-d @ 1-d works; a 3x2 matrix does not

    gm = fx.symbolic_trace(f)
    node = next(n for n in gm.graph.nodes if n.target is torch.matmul)
    node.stack_trace = '  File "model.py", line 7, in forward\n    torch.matmul(y, y)'
    with pytest.raises(RuntimeError) as info:
        Interpreter(gm).run(torch.randn(3, 2))
    notes = "\n".join(getattr(info.value, "__notes__", [])) or str(info.value)
    assert node.format_node() in notes
    assert 'model.py", line 7' in notes


def test_error_of_other_types_is_not_rewrapped():
    def f(x):
        return x[5]

    gm = fx.symbolic_trace(f)
    with pytest.raises(IndexError) as info:
        Interpreter(gm).run([1, 2])
    notes = "\n".join(getattr(info.value, "__notes__", [])) or str(info.value)
    assert "getitem" in notes


def test_missing_value_and_missing_attribute_are_reported():
    gm = fx.symbolic_trace(_chain)
    interp = Interpreter(gm)
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    with pytest.raises(RuntimeError, match="'x'"):
        interp.map_nodes_to_values(relu.args, relu)
    with pytest.raises(RuntimeError, match="nope"):
        Interpreter(fx.symbolic_trace(Block())).fetch_attr("lin.nope")
    interp.env = {relu.args[0]: torch.ones(2)}
    args, kwargs = interp.fetch_args_kwargs_from_env(relu)
    assert kwargs == {} and torch.equal(args[0], torch.ones(2))


# ---------------------------------------------------------------------- Transformer
def test_identity_transform_keeps_names_meta_and_behaviour(block_gm):
    x = torch.randn(2, 4)
    ShapeProp(block_gm).propagate(x)
    for n in block_gm.graph.nodes:
        n.meta["tag"] = n.name
    new_gm = fx.Transformer(block_gm).transform()
    assert new_gm is not block_gm and new_gm.graph is not block_gm.graph
    new_gm.graph.lint()
    old_nodes, new_nodes = list(block_gm.graph.nodes), list(new_gm.graph.nodes)
    assert [(n.name, n.op, n.target) for n in new_nodes] == [(n.name, n.op, n.target) for n in old_nodes]
    for old, new in zip(old_nodes, new_nodes):
        assert new.meta["tag"] == old.name
        assert new.meta.get("tensor_meta") == old.meta.get("tensor_meta")
    torch.testing.assert_close(new_gm(x), block_gm(x))


def test_transformer_swaps_sigmoid_for_neg(block, block_gm):
    class NegSigmSwap(Transformer):
        def call_function(self, target, args, kwargs):
            if target is torch.sigmoid:
                return torch.neg(*args, **kwargs)  # ordinary torch code on Proxies
            return super().call_function(target, args, kwargs)

    old_names = [n.name for n in block_gm.graph.nodes]
    block_gm.graph.find_nodes(op="call_function", target=torch.sigmoid)[0].stack_trace = "here"
    new_gm = NegSigmSwap(block_gm).transform()
    new_gm.graph.lint()
    assert not new_gm.graph.find_nodes(op="call_function", target=torch.sigmoid)
    (neg,) = new_gm.graph.find_nodes(op="call_function", target=torch.neg)
    assert neg.stack_trace == "here"
    assert [n.name for n in new_gm.graph.nodes] == [
        neg.name if name == "sigmoid" else name for name in old_names]

    x = torch.randn(2, 4)
    m = block
    expected = (m.seq(torch.neg(m.lin(x))) * m.scale).sum(dim=-1, keepdim=True) + x.mean()
    torch.testing.assert_close(new_gm(x), expected)
    # The source module is untouched.
    assert block_gm.graph.find_nodes(op="call_function", target=torch.sigmoid)
    torch.testing.assert_close(block_gm(x), Interpreter(block_gm).run(x))


def test_transformer_super_call_with_other_target_keeps_name():
    class SigToTanh(Transformer):
        def call_function(self, target, args, kwargs):
            if target is torch.sigmoid:
                target = torch.tanh
            return super().call_function(target, args, kwargs)

    gm = fx.symbolic_trace(_chain)
    new_gm = SigToTanh(gm).transform()
    names = [n.name for n in gm.graph.nodes]
    assert [n.name for n in new_gm.graph.nodes] == names
    x = torch.randn(4)
    torch.testing.assert_close(new_gm(x), torch.tanh((torch.relu(x) + 1) * 2))


def test_transformer_decomposition_gets_provenance_but_not_values():
    class DecomposeRelu(Transformer):
        def call_function(self, target, args, kwargs):
            if target in (torch.relu, F.relu):
                (x,) = args
                return (x > 0) * x
            return super().call_function(target, args, kwargs)

    gm = fx.symbolic_trace(_chain)
    ShapeProp(gm).propagate(torch.randn(3))
    relu = gm.graph.find_nodes(op="call_function", target=torch.relu)[0]
    relu.stack_trace = "relu line"
    new_gm = DecomposeRelu(gm).transform()
    new_gm.graph.lint()
    gt = new_gm.graph.find_nodes(op="call_function", target=operator.gt)
    assert len(gt) == 1
    assert gt[0].stack_trace == "relu line"
    assert "tensor_meta" not in gt[0].meta  # a bool tensor: relu's record would be wrong
    x = torch.tensor([-1.0, 0.5, 2.0])
    torch.testing.assert_close(new_gm(x), gm(x))


def test_transformer_keeps_leaf_submodules_as_call_module():
    class Nested(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.Tanh()))

        def forward(self, x):
            return self.inner(x)

    gm = fx.symbolic_trace(Nested())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets == ["inner.0", "inner.1.0"]
    new_gm = Transformer(gm).transform()
    assert [n.target for n in new_gm.graph.nodes if n.op == "call_module"] == targets
    x = torch.randn(2, 3)
    torch.testing.assert_close(new_gm(x), gm(x))


def test_transformer_keeps_placeholder_defaults():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y", default_value=2.0)
    g.output(g.call_function(operator.mul, (x, y)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    new_gm = Transformer(gm).transform()
    new_x, new_y = new_gm.graph.find_nodes(op="placeholder")
    assert (new_x.name, new_x.args, new_y.name, new_y.args) == ("x", (), "y", (2.0,))
    torch.testing.assert_close(new_gm(torch.ones(2)), torch.full((2,), 2.0))
