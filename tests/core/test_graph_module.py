"""GraphModule: construction, attribute copying, codegen, submodules, copying and odd names."""

from __future__ import annotations

import ast
import copy
import operator
import pickle
import re

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import fxlite as fx


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.unused_param = nn.Parameter(torch.randn(2))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return torch.relu(self.used(x)) * self.scale


# ---------------------------------------------------------------------- construction
def test_copies_only_referenced_attributes():
    m = TwoLayers()
    gm = fx.GraphModule(m, fx.Tracer().trace(m))
    assert hasattr(gm, "used") and hasattr(gm, "scale")
    assert not hasattr(gm, "unused") and not hasattr(gm, "unused_param")
    assert dict(gm.named_children()).keys() == {"used"}
    assert gm.used is m.used  # shared, not copied: it is the same submodule
    assert isinstance(gm.scale, nn.Parameter)
    x = torch.randn(3, 4)
    assert_close(gm(x), m(x))


def test_nested_targets_are_rebuilt():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
            self.block.register_buffer("shift", torch.ones(3))

        def forward(self, x):
            return self.block(x) + self.block.shift

    m = M()
    gm = fx.symbolic_trace(m)
    assert {n.target for n in gm.graph.find_nodes(op="call_module")} == {"block.0", "block.1"}
    assert torch.equal(gm.block.shift, m.block.shift)
    assert "shift" in dict(gm.block.named_buffers())
    x = torch.randn(2, 3)
    assert_close(gm(x), m(x))


def test_from_dict_root():
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("weights.w")
    h = g.call_module("sub.lin", (x,))
    g.output(g.call_function(operator.add, (h, w)))
    lin = nn.Linear(2, 2)
    w_val = torch.randn(2)
    gm = fx.GraphModule({"sub.lin": lin, "weights.w": w_val}, g)
    assert gm.sub.lin is lin
    assert torch.equal(gm.weights.w, w_val)
    x_val = torch.randn(5, 2)
    assert_close(gm(x_val), lin(x_val) + w_val)
    gm.graph.lint()


@pytest.mark.parametrize("root_kind", ["module", "dict"])
def test_missing_attribute_raises_naming_it(root_kind):
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("missing_weight")
    g.output(g.call_function(operator.add, (x, w)))
    root = nn.Module() if root_kind == "module" else {}
    with pytest.raises(RuntimeError, match="missing_weight"):
        fx.GraphModule(root, g)


def test_missing_submodule_raises_naming_it():
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_module("enc.missing_layer", (x,)))
    root = nn.Module()
    root.enc = nn.Module()
    with pytest.raises(RuntimeError, match="missing_layer"):
        fx.GraphModule(root, g)


def test_placeholder_named_like_a_keyword():
    g = fx.Graph()
    a = g.placeholder("class")
    b = g.placeholder("sum")
    g.output(g.call_function(operator.sub, (a, b)))
    gm = fx.GraphModule(nn.Module(), g)
    assert_close(gm(torch.ones(2), torch.full((2,), 3.0)), torch.full((2,), -2.0))
    compile(gm.code, "<check>", "exec")


# ---------------------------------------------------------------------- code and recompile
def test_code_updates_only_on_recompile():
    gm = fx.symbolic_trace(lambda x, y: x + y)
    old = gm.code
    for node in gm.graph.nodes:
        if node.target is operator.add:
            node.target = operator.mul
    assert gm.code == old
    x, y = torch.randn(3), torch.randn(3)
    assert_close(gm(x, y), x + y)  # still the old forward
    gm.recompile()
    assert "x * y" in gm.code and gm.code != old
    assert_close(gm(x, y), x * y)


def test_graph_setter_recompiles():
    gm = fx.symbolic_trace(lambda x: x + 1)
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.neg, (x,)))
    gm.graph = g
    assert "torch.neg(x)" in gm.code
    assert_close(gm(torch.ones(2)), -torch.ones(2))
    assert gm.graph.owning_module is gm


def test_recompile_does_not_affect_other_instances():
    a = fx.symbolic_trace(lambda x: x + 1)
    b = fx.symbolic_trace(lambda x: x + 1)
    for node in a.graph.nodes:
        if node.target is operator.add:
            node.target = operator.sub
    a.recompile()
    assert_close(a(torch.zeros(1)), -torch.ones(1))
    assert_close(b(torch.zeros(1)), torch.ones(1))


def test_print_readable(capsys):
    gm = fx.symbolic_trace(TwoLayers())
    text = gm.print_readable()
    assert capsys.readouterr().out.strip() == text.strip()
    assert re.search(r"^class \w+\(torch\.nn\.Module\):", text, re.M)
    assert "def forward(self, x):" in text
    assert "used = self.used(x);  x = None" in text
    assert gm.print_readable(print_output=False) == text
    assert capsys.readouterr().out == ""


def test_generated_code_frees_values_after_last_use():
    def f(x, y):
        a = torch.relu(x + 1.0)
        b = a * y
        c = b - a
        return c.sum() + x.mean()

    gm = fx.symbolic_trace(f)
    lines = [line.strip() for line in gm.code.splitlines() if "=" in line and "def " not in line]
    freed_after: dict[str, int] = {}
    for i, line in enumerate(lines):
        if ";" in line:
            for name in line.split(";", 1)[1].replace("= None", "").replace("=", " ").split():
                freed_after[name] = i
    used_at = {}
    for i, line in enumerate(lines):
        for name in re.findall(r"[A-Za-z_]\w*", line.split(";", 1)[0].split("=", 1)[1]):
            used_at[name] = i
    values = [n.name for n in gm.graph.nodes if n.op not in ("output",)]
    returned = {n.name for n in gm.graph.output_node().all_input_nodes}
    for name in values:
        if name in returned:
            continue
        assert name in freed_after, f"{name} is never freed:\n{gm.code}"
        assert freed_after[name] == used_at[name], f"{name} freed away from its last use"
    x, y = torch.randn(4), torch.randn(4)
    assert_close(gm(x, y), f(x, y))


def test_a_value_nothing_reads_is_freed_where_it_is_made():
    """A recorded ``dropout(x, training=False)`` returns ``x`` itself and nothing reads it;
    held to the end of ``forward``, such values kept swin_t's activations alive (a GPU
    peak three times eager's). Each later node must find it gone."""
    import weakref

    made: list[weakref.ref] = []

    def unused_copy(t):
        out = t * 2
        made.append(weakref.ref(out))
        return out

    def gone(t):
        assert made and made[-1]() is None, "the unused value is still alive"
        return t + 1

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(unused_copy, (x,))
    graph.output(graph.call_function(gone, (x,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert "unused_copy = None" in gm.code
    assert_close(gm(torch.ones(3)), torch.full((3,), 2.0))


# ---------------------------------------------------------------------- submodules
def test_add_and_delete_submodule():
    gm = fx.symbolic_trace(lambda x: x * 2)
    assert gm.add_submodule("extra.inner.lin", nn.Linear(2, 2)) is True
    assert isinstance(gm.get_submodule("extra.inner.lin"), nn.Linear)
    (mul,) = gm.graph.find_nodes(op="call_function", target=operator.mul)
    with gm.graph.inserting_after(mul):
        lin = gm.graph.call_module("extra.inner.lin", (mul,))
    mul.replace_all_uses_with(lin, delete_user_cb=lambda u: u is not lin)
    gm.graph.lint()
    gm.recompile()
    x = torch.randn(3, 2)
    assert_close(gm(x), gm.extra.inner.lin(x * 2))
    assert gm.delete_submodule("extra.inner.nothing") is False
    assert gm.delete_submodule("no.such.path") is False
    gm.graph.erase_node(gm.graph.output_node())
    gm.graph.output(mul)
    gm.graph.erase_node(lin)
    assert gm.delete_submodule("extra.inner.lin") is True
    assert not hasattr(gm.extra.inner, "lin")
    gm.recompile()
    assert_close(gm(x), x * 2)


def test_delete_all_unused_submodules():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.keep = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            self.drop_me = nn.Linear(2, 2)

        def forward(self, x):
            return self.drop_me(self.keep(x))

    class KeepLeaf(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return qualname == "keep" or super().is_leaf_module(m, qualname)

    m = M()
    gm = fx.GraphModule(m, KeepLeaf().trace(m))
    (last,) = gm.graph.find_nodes(op="call_module", target="drop_me")
    last.replace_all_uses_with(last.args[0])
    gm.graph.erase_node(last)
    gm.delete_all_unused_submodules()
    assert not hasattr(gm, "drop_me")
    assert isinstance(gm.keep[0], nn.Linear) and isinstance(gm.keep[1], nn.ReLU)
    gm.recompile()
    x = torch.randn(4, 2)
    assert_close(gm(x), m.keep(x))


# ---------------------------------------------------------------------- copying
def _local_model_and_tracer():
    """A module class and tracer class that pickle cannot find by name."""

    class LocalModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("bias", torch.randn(4))

        def forward(self, x):
            return torch.sigmoid(self.lin(x)) + self.bias + torch.tensor(0.5)

    class LocalTracer(fx.Tracer):
        pass

    return LocalModel(), LocalTracer


def test_deepcopy():
    m, tracer_cls = _local_model_and_tracer()
    gm = fx.GraphModule(m, tracer_cls().trace(m))
    gm2 = copy.deepcopy(gm)
    x = torch.randn(2, 4)
    assert_close(gm2(x), gm(x))
    assert gm2.lin is not gm.lin and gm2.graph is not gm.graph
    assert gm2.graph.owning_module is gm2
    with torch.no_grad():
        gm2.lin.weight.zero_()
    assert not torch.equal(gm.lin.weight, gm2.lin.weight)
    for node in gm2.graph.nodes:
        if node.target is torch.sigmoid:
            node.target = torch.tanh
    gm2.recompile()
    assert "sigmoid" in gm.code and "tanh" in gm2.code
    assert [n.name for n in gm.graph.nodes] == [n.name for n in gm2.graph.nodes]


def test_pickle_round_trip_without_the_original_classes():
    m, tracer_cls = _local_model_and_tracer()
    gm = fx.GraphModule(m, tracer_cls().trace(m))
    data = pickle.dumps(gm)  # neither LocalModel nor LocalTracer can be pickled by name
    gm2 = pickle.loads(data)
    x = torch.randn(3, 4)
    assert_close(gm2(x), gm(x))
    assert gm2.code == gm.code
    gm2.graph.lint()
    assert [(n.op, n.name, n.target) for n in gm2.graph.nodes] == [
        (n.op, n.name, n.target) for n in gm.graph.nodes]


def test_pickle_symbolic_trace_of_function():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) * 3)
    gm2 = pickle.loads(pickle.dumps(gm))
    x = torch.randn(5)
    assert_close(gm2(x), torch.relu(x) * 3)


# ---------------------------------------------------------------------- odd names
EVIL = "a);print('PWNED');(b"


class OddNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module(EVIL, nn.Linear(3, 3))
        self.block = nn.Module()
        self.block.add_module("it's", nn.ReLU())
        self.register_parameter("class", nn.Parameter(torch.randn(3)))
        self.register_buffer("my-attr", torch.randn(3))
        self.register_buffer("it's", torch.randn(3))
        self.register_buffer("(x)", torch.randn(3))

    def forward(self, x):
        h = getattr(self, EVIL)(x) * getattr(self, "class")
        h = getattr(self.block, "it's")(h) + getattr(self, "my-attr")
        return (h - getattr(self, "it's")) * getattr(self, "(x)")


def _assert_no_print_call(code: str) -> None:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "print", code


def test_odd_names_cannot_inject_code(capsys):
    m = OddNames()
    gm = fx.symbolic_trace(m)
    x = torch.randn(2, 3)
    assert_close(gm(x), m(x))
    targets = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    assert targets == {EVIL, "block.it's", "class", "my-attr", "it's", "(x)"}
    for node in gm.graph.nodes:
        assert node.name.isidentifier(), node.name
    _assert_no_print_call(gm.code)
    gm.recompile()
    assert_close(gm(x), m(x))
    gm.graph.lint()
    gm2 = copy.deepcopy(gm)
    assert_close(gm2(x), m(x))
    gm3 = pickle.loads(pickle.dumps(gm))
    assert_close(gm3(x), m(x))
    assert "PWNED" not in capsys.readouterr().out
    # The dumps show the name as text, but never run it.
    print(gm.graph)
    gm.graph.print_tabular()
    gm.print_readable()
    for line in capsys.readouterr().out.splitlines():
        assert line.strip() != "PWNED"


def test_odd_names_from_dict_root(capsys):
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr(EVIL)
    h = g.call_module("my-mod.class", (x,))
    g.output(g.call_function(operator.add, (h, w)))
    lin, w_val = nn.Linear(2, 2), torch.randn(2)
    gm = fx.GraphModule({EVIL: w_val, "my-mod.class": lin}, g)
    _assert_no_print_call(gm.code)
    x_val = torch.randn(1, 2)
    assert_close(gm(x_val), lin(x_val) + w_val)
    assert "PWNED" not in capsys.readouterr().out
