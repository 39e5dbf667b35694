"""The code examples of the torch.fx guide (shared/reference/fx.rst), ported to fxlite.

Each test follows one example with ``torch.fx`` replaced by ``fxlite`` and checks the
graph, table, code or output that the guide describes. The Interpreter, ShapeProp,
Transformer and replace_pattern examples live in their own test files, and the
"Limitations of Symbolic Tracing" examples in test_reference_limitations.py. The guide's
torchvision examples use a small hand-written ResNet-like model instead of resnet18.
"""

from __future__ import annotations

import importlib
import io
import operator
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxlite as fx
from fxlite.proxy import GraphAppendingTracer


class TinyResNet(nn.Module):
    """Stands in for torchvision's resnet18: conv stem, two residual blocks, pooled head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.block_a = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.block_b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.block_a(x) + x)
        x = self.relu(self.block_b(x) + x)
        return self.fc(torch.flatten(self.pool(x), 1))


def _rows(gm: fx.GraphModule) -> list[tuple]:
    return [(str(n.op), n.name, n.target, n.args, n.kwargs) for n in gm.graph.nodes]


# ---------------------------------------------------------------------- Writing Transformations
def test_transform_skeleton_with_tracer_class():
    def transform(m: nn.Module, tracer_class: type = fx.Tracer) -> nn.Module:
        graph: fx.Graph = tracer_class().trace(m)
        return fx.GraphModule(m, graph)

    m = TinyResNet().eval()
    out = transform(m)
    assert isinstance(out, nn.Module) and isinstance(out, fx.GraphModule)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(out(x), m(x))


def test_transform_skeleton_modifying_graph_module():
    class M(nn.Module):
        def forward(self, x):
            return torch.add(x, 1)

    def transform(m: nn.Module) -> nn.Module:
        gm: fx.GraphModule = fx.symbolic_trace(m)
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target == torch.add:
                node.target = torch.sub
        gm.recompile()
        return gm

    x = torch.randn(3)
    gm = transform(M())
    torch.testing.assert_close(gm(x), x - 1)
    assert "torch.sub" in gm.code


# ---------------------------------------------------------------------- A Quick Primer on Graphs
class PrimerModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.param = nn.Parameter(torch.rand(3, 4))
        self.linear = nn.Linear(4, 5)

    def forward(self, x):
        return torch.topk(torch.sum(self.linear(x + self.linear.weight).relu(), dim=-1), 3)


def test_primer_tabular(capsys):
    m = PrimerModule()
    gm = fx.symbolic_trace(m)
    rows = _rows(gm)
    x_, w_, add_, lin_, relu_, sum_, topk_, _ = list(gm.graph.nodes)
    assert rows == [
        ("placeholder", "x", "x", (), {}),
        ("get_attr", "linear_weight", "linear.weight", (), {}),
        ("call_function", "add", operator.add, (x_, w_), {}),
        ("call_module", "linear", "linear", (add_,), {}),
        ("call_method", "relu", "relu", (lin_,), {}),
        ("call_function", "sum_1", torch.sum, (relu_,), {"dim": -1}),
        ("call_function", "topk", torch.topk, (sum_, 3), {}),
        ("output", "output", "output", (topk_,), {}),
    ]
    gm.graph.print_tabular()
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["opcode", "name", "target", "args", "kwargs"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    body = [re.split(r"\s{2,}", line.strip()) for line in lines[2:]]
    assert [r[:2] for r in body] == [[r[0], r[1]] for r in rows]
    assert body[2][2:] == ["<built-in function add>", "(x, linear_weight)", "{}"]
    assert re.fullmatch(r"<built-in method sum of type object at 0x[0-9a-f]+>", body[5][2])
    assert body[5][3:] == ["(relu,)", "{'dim': -1}"]
    assert body[6][3] == "(sum_1, 3)" and body[7][3] == "(topk,)"
    x = torch.randn(5, 4)  # broadcasts against linear.weight, as the forward requires
    for got, want in zip(gm(x), m(x)):
        torch.testing.assert_close(got, want)
    assert not hasattr(gm, "param")  # unused by forward, so not copied


# ---------------------------------------------------------------------- Direct Graph Manipulation
def test_add_to_mul_transform():
    class M(nn.Module):
        def forward(self, x, y):
            return torch.add(x, y)

    def transform(m: nn.Module, tracer_class: type = fx.Tracer) -> nn.Module:
        graph: fx.Graph = tracer_class().trace(m)
        for node in graph.nodes:
            if node.op == "call_function":
                if node.target == torch.add:
                    node.target = torch.mul
        graph.lint()
        return fx.GraphModule(m, graph)

    gm = transform(M())
    x, y = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(gm(x, y), x * y)
    assert [n.target for n in gm.graph.find_nodes(op="call_function")] == [torch.mul]
    assert "torch.mul(x, y)" in gm.code


def test_inserting_after_relu_and_replace_all_uses_with():
    class M(nn.Module):
        def forward(self, x):
            return (x - 1) * 3

    traced = fx.symbolic_trace(M())
    (node,) = traced.graph.find_nodes(op="call_function", target=operator.sub)
    with traced.graph.inserting_after(node):
        new_node = traced.graph.call_function(torch.relu, args=(node,))
    node.replace_all_uses_with(new_node, delete_user_cb=lambda user: user is not new_node)
    assert new_node.args == (node,)  # the relu still reads the original value
    assert list(node.users) == [new_node]
    traced.graph.lint()
    traced.recompile()
    x = torch.randn(10)
    torch.testing.assert_close(traced(x), torch.relu(x - 1) * 3)
    assert [n.name for n in traced.graph.nodes] == ["x", "sub", "relu", "mul", "output"]


def test_replace_all_uses_without_callback_makes_a_cycle_that_lint_reports():
    traced = fx.symbolic_trace(lambda x: (x - 1) * 3)
    (node,) = traced.graph.find_nodes(op="call_function", target=operator.sub)
    with traced.graph.inserting_after(node):
        new_node = traced.graph.call_function(torch.relu, args=(node,))
    node.replace_all_uses_with(new_node)  # also rewires the relu to read itself
    assert new_node.args == (new_node,)
    with pytest.raises(RuntimeError, match="relu"):
        traced.graph.lint()


# ---------------------------------------------------------------------- Proxy/Retracing
def relu_decomposition(x):
    return (x > 0) * x


decomposition_rules = {F.relu: relu_decomposition}


def decompose(model: nn.Module, tracer_class: type = fx.Tracer) -> nn.Module:
    """The guide's decompose(), with the tracer built on the graph it appends to."""
    graph: fx.Graph = tracer_class().trace(model)
    new_graph = fx.Graph()
    env = {}
    tracer = GraphAppendingTracer(new_graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in decomposition_rules:
            proxy_args = [fx.Proxy(env[x.name], tracer) if isinstance(x, fx.Node) else x
                          for x in node.args]
            output_proxy = decomposition_rules[node.target](*proxy_args)
            new_node = output_proxy.node
            env[node.name] = new_node
        else:
            new_node = new_graph.node_copy(node, lambda x: env[x.name])
            env[node.name] = new_node
    return fx.GraphModule(model, new_graph)


def test_proxy_decomposition_with_graph_appending_tracer():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return F.relu(self.lin(x)) + F.relu(x)

    m = M()
    gm = decompose(m)
    targets = [n.target for n in gm.graph.find_nodes(op="call_function")]
    assert F.relu not in targets
    assert targets.count(operator.gt) == 2 and targets.count(operator.mul) == 2
    gm.graph.lint()
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), m(x))


# ---------------------------------------------------------------------- Checking Correctness
def test_checking_correctness_of_modules():
    def transform(m: nn.Module) -> nn.Module:
        gm = fx.symbolic_trace(m)
        gm.recompile()
        return gm

    resnet = TinyResNet().eval()
    transformed = transform(resnet)
    input_image = torch.randn(5, 3, 16, 16)
    with pytest.raises(RuntimeError, match="Boolean value of Tensor with more than one value"):
        assert resnet(input_image) == transformed(input_image)
    assert torch.allclose(resnet(input_image), transformed(input_image))


def test_pdb_steps_into_generated_forward():
    import pdb

    def my_pass(inp: nn.Module, tracer_class: type = fx.Tracer) -> nn.Module:
        graph = tracer_class().trace(inp)
        return fx.GraphModule(inp, graph)

    my_module = TinyResNet().eval()
    transformed = my_pass(my_module)
    input_value = torch.randn(5, 3, 8, 8)
    out = io.StringIO()
    debugger = pdb.Pdb(stdin=io.StringIO("p x.shape\nwhere\ncontinue\n"), stdout=out, readrc=False)
    debugger.use_rawinput = False
    result = debugger.runcall(transformed.forward, input_value)
    session = out.getvalue()
    assert "torch.Size([5, 3, 8, 8])" in session  # stopped inside forward, with x bound
    assert "forward()" in session
    torch.testing.assert_close(result, my_module(input_value))


# ---------------------------------------------------------------------- Print the Generated Code
def test_print_generated_code_and_paste_it_into_a_subclass(capsys):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.x = nn.Parameter(torch.randn(4))

        def forward(self, y):
            return self.x + y

    traced = fx.symbolic_trace(M())
    print(traced)
    printed = capsys.readouterr().out
    assert "def forward(self, y):" in printed
    assert "x = self.x" in traced.code
    assert "add = x + y;  x = y = None" in traced.code

    namespace: dict = {"torch": torch}
    exec(traced.code, namespace)  # what a user pastes into their subclass
    SubclassM = type("SubclassM", (M,), {"forward": namespace["forward"]})
    pre_trace = M()
    post_trace = SubclassM()
    post_trace.load_state_dict(pre_trace.state_dict())
    y = torch.randn(4)
    torch.testing.assert_close(post_trace(y), pre_trace(y))


def test_to_folder(tmp_path, monkeypatch):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, x):
            return torch.relu(self.lin(x)) * self.scale

    m = fx.symbolic_trace(M())
    m.to_folder(tmp_path / "foo", "Bar")
    assert (tmp_path / "foo" / "module.py").exists()
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [k for k in sys.modules if k == "foo" or k.startswith("foo.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    try:
        from foo import Bar

        y = Bar()
        x = torch.randn(2, 4)
        torch.testing.assert_close(y(x), m(x))
    finally:
        for name in [k for k in sys.modules if k == "foo" or k.startswith("foo.")]:
            del sys.modules[name]


# ---------------------------------------------------------------------- Debugging the Transformation
class AddModule(nn.Module):
    def forward(self, x, y):
        return x + y


def test_print_traced_graph_and_table(capsys):
    traced = fx.symbolic_trace(AddModule())
    assert traced.code.strip() == "def forward(self, x, y):\n    add = x + y;  x = y = None\n    return add"
    print(traced)
    assert "def forward(self, x, y):\n    add = x + y;  x = y = None\n    return add" in capsys.readouterr().out
    print(traced.graph)
    # The guide shows torch.fx's older "[#users=1]"; torch.fx 2.x prints "[num_users=1]", as here.
    assert capsys.readouterr().out.strip() == (
        "graph():\n"
        "    %x : [num_users=1] = placeholder[target=x]\n"
        "    %y : [num_users=1] = placeholder[target=y]\n"
        "    %add : [num_users=1] = call_function[target=operator.add](args = (%x, %y), kwargs = {})\n"
        "    return add")
    traced.graph.print_tabular()
    assert capsys.readouterr().out.strip() == """\
opcode         name    target                   args    kwargs
-------------  ------  -----------------------  ------  --------
placeholder    x       x                        ()      {}
placeholder    y       y                        ()      {}
call_function  add     <built-in function add>  (x, y)  {}
output         output  output                   (add,)  {}"""


def test_transform_graph_retraces_a_graph_module(capsys):
    def transform_graph(module: nn.Module, tracer_class: type = fx.Tracer) -> nn.Module:
        g = tracer_class().trace(module)
        return fx.GraphModule(module, g)

    traced = fx.symbolic_trace(AddModule())
    transformed = transform_graph(traced)
    print(transformed)
    assert "add = x + y" in capsys.readouterr().out
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(transformed(x, y), x + y)
