"""The code examples of the torch.fx guide (shared/reference/fx.rst), ported to fxlite.

Each test follows one example with ``torch.fx`` replaced by ``fxlite`` and checks the
graph, table, code or output that the guide describes. The Interpreter, ShapeProp,
Transformer and replace_pattern examples live in their own test files. The guide's
torchvision examples use a small hand-written ResNet-like model instead of resnet18.
"""

from __future__ import annotations

import importlib
import inspect
import io
import operator
import os
import re
import sys
import typing
from math import sqrt

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxlite as fx
from fxlite.proxy import GraphAppendingTracer

THIS_FILE = os.path.basename(__file__)

# "Non-torch Functions": record len() and sqrt() as calls in this module's traces.
fx.wrap("len")
fx.wrap("sqrt")


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


# ---------------------------------------------------------------------- Limitations
def func_to_trace(x):
    if x.sum() > 0:
        return torch.relu(x)
    else:
        return torch.neg(x)


def test_dynamic_control_flow_raises_trace_error():
    with pytest.raises(fx.TraceError) as info:
        fx.symbolic_trace(func_to_trace)
    msg = str(info.value)
    lines, start = inspect.getsourcelines(func_to_trace)
    lineno = start + next(i for i, line in enumerate(lines) if "if x.sum() > 0:" in line)
    assert "symbolically traced variables cannot be used as inputs to control flow" in msg
    assert THIS_FILE in msg
    assert re.search(rf"\bline {lineno}\b", msg)
    assert "if x.sum() > 0:" in msg
    for fix in ("concrete_args", "wrap", "leaf"):
        assert fix in msg


class ActivationModule(nn.Module):
    def __init__(self, do_activation: bool = False):
        super().__init__()
        self.do_activation = do_activation
        self.linear = nn.Linear(512, 512)

    def forward(self, x):
        x = self.linear(x)
        if self.do_activation:
            x = torch.relu(x)
        return x


def test_static_control_flow():
    without_activation = ActivationModule(do_activation=False)
    with_activation = ActivationModule(do_activation=True)
    traced_without = fx.symbolic_trace(without_activation)
    code = [line.strip() for line in traced_without.code.strip().splitlines()]
    assert code[-2:] == ["linear = self.linear(x);  x = None", "return linear"]
    traced_with = fx.symbolic_trace(with_activation)
    code = [line.strip() for line in traced_with.code.strip().splitlines()]
    assert code[-3:] == ["linear = self.linear(x);  x = None",
                         "relu = torch.relu(linear);  linear = None", "return relu"]
    x = torch.randn(2, 512)
    torch.testing.assert_close(traced_without(x), without_activation(x))
    torch.testing.assert_close(traced_with(x), with_activation(x))


def test_concrete_args():
    def f(x, flag):
        if flag:
            return x
        else:
            return x * 2

    with pytest.raises(fx.TraceError):
        fx.symbolic_trace(f)
    gm = fx.symbolic_trace(f, concrete_args={"flag": True})
    assert not gm.graph.find_nodes(op="call_function", target=operator.mul)
    x = torch.randn(3)
    torch.testing.assert_close(gm(x, True), x)
    gm2 = fx.symbolic_trace(f, concrete_args={"flag": False})
    torch.testing.assert_close(gm2(x, False), x * 2)


SQRT_SOURCE = '''\
import torch
from math import sqrt


def normalize(x):
    """Normalize `x` by the size of the batch dimension."""
    return x / sqrt(len(x))
'''


def test_len_without_wrap_raises(tmp_path):
    path = tmp_path / "sqrt_example.py"
    path.write_text(SQRT_SOURCE)
    spec = importlib.util.spec_from_file_location("sqrt_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.normalize(torch.rand(3, 4))  # valid Python
    with pytest.raises(fx.TraceError) as info:
        fx.symbolic_trace(module.normalize)
    msg = str(info.value)
    assert "sqrt_example.py" in msg and "line 7" in msg
    assert "return x / sqrt(len(x))" in msg
    assert "wrap('len')" in msg


def normalize(x):
    """Normalize `x` by the size of the batch dimension."""
    return x / sqrt(len(x))


def test_wrap_len_and_sqrt_by_name():
    traced = fx.symbolic_trace(normalize)
    assert "len(x)" in traced.code
    assert "math.sqrt(" in traced.code
    targets = [n.target for n in traced.graph.find_nodes(op="call_function")]
    assert targets[:2] == [len, sqrt]
    for x in (torch.rand(3, 4), torch.rand(16, 2)):  # the length is read at run time
        torch.testing.assert_close(traced(x), x / sqrt(len(x)))
    assert len([1, 2]) == 2 and sqrt(4.0) == 2.0  # the names work normally outside tracing


@fx.wrap
def torch_randn(x, shape):
    return torch.randn(shape)


def test_wrap_decorator_keeps_random_call_out_of_the_trace():
    def f(x):
        return x + torch_randn(x, 5)

    gm = fx.symbolic_trace(f)
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.add]
    assert call.target.__name__ == "torch_randn" and call.args[1] == 5
    assert not gm.graph.find_nodes(op="get_attr")  # no random constant baked in
    x = torch.zeros(5)
    a, b = gm(x), gm(x)
    assert a.shape == (5,) and not torch.equal(a, b)


def test_custom_tracer():
    class MyCustomTracer(fx.Tracer):
        pass

    class MyModule(nn.Module):
        def forward(self, x):
            return torch.relu(x) + torch.ones(3, 4)

    mod = MyModule()
    traced_graph = MyCustomTracer().trace(mod)
    traced = fx.GraphModule(mod, traced_graph)
    x = torch.randn(3, 4)
    torch.testing.assert_close(traced(x), mod(x))
    # torch.ones ran during tracing; its value is embedded as a constant.
    (const,) = traced.graph.find_nodes(op="get_attr")
    assert torch.equal(getattr(traced, const.target), torch.ones(3, 4))
    assert not traced.graph.find_nodes(op="call_function", target=torch.ones)


class MySpecialSubmodule(nn.Module):
    def forward(self, x):
        return torch.neg(x)


class LeafDemo(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.submod = MySpecialSubmodule()

    def forward(self, x):
        return self.submod(self.linear(x))


def test_leaf_modules():
    m = LeafDemo()
    traced = fx.symbolic_trace(m)
    code = [line.strip() for line in traced.code.strip().splitlines()]
    assert code[-3:] == ["linear = self.linear(x);  x = None",
                         "neg = torch.neg(linear);  linear = None", "return neg"]
    assert [n.target for n in traced.graph.find_nodes(op="call_module")] == ["linear"]

    class SubmodLeaf(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, MySpecialSubmodule) or super().is_leaf_module(m, qualname)

    g = SubmodLeaf().trace(m)
    assert [n.target for n in g.find_nodes(op="call_module")] == ["linear", "submod"]
    x = torch.randn(2, 3)
    torch.testing.assert_close(traced(x), m(x))
    torch.testing.assert_close(fx.GraphModule(m, g)(x), m(x))


# ---------------------------------------------------------------------- Miscellanea
def test_dropout_functional_training_flag_is_baked_in():
    class DropoutRepro(nn.Module):
        def forward(self, x):
            return F.dropout(x, training=self.training)

    traced = fx.symbolic_trace(DropoutRepro())
    (drop,) = traced.graph.find_nodes(op="call_function", target=F.dropout)
    assert drop.kwargs["training"] is True
    assert "training = True" in traced.code
    traced.eval()
    x = torch.randn(5, 3)
    with pytest.raises(AssertionError, match="not close"):
        torch.testing.assert_close(traced(x), x)


def test_dropout_module_follows_eval():
    class DropoutRepro2(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout()

        def forward(self, x):
            return self.drop(x)

    traced = fx.symbolic_trace(DropoutRepro2())
    assert [line.strip() for line in traced.code.strip().splitlines()][-2:] == [
        "drop = self.drop(x);  x = None", "return drop"]
    traced.eval()
    x = torch.randn(5, 3)
    torch.testing.assert_close(traced(x), x)
    traced.train()
    assert not torch.equal(traced(x), x)


def test_type_annotations_are_preserved():
    def func(x: torch.Tensor, y: int) -> torch.Tensor:
        return x * y

    class Annotated(nn.Module):
        def forward(self, x: torch.Tensor, scale: float = 2.0
                    ) -> typing.Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
            return x * scale, x.neg()

    class BuiltinGenerics(nn.Module):
        def forward(self, xs: list[torch.Tensor], mask: typing.Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, ...]:
            return xs[0] + xs[1], xs[0]

    gm = fx.symbolic_trace(func)
    header = next(line for line in gm.code.splitlines() if line.startswith("def forward"))
    assert re.fullmatch(r"def forward\(self, x\s*:\s*torch\.Tensor, y\s*:\s*int\)\s*->\s*torch\.Tensor:",
                        header), header
    torch.testing.assert_close(gm(torch.ones(2), 3), torch.full((2,), 3.0))

    gm = fx.symbolic_trace(Annotated())
    header = next(line for line in gm.code.splitlines() if line.startswith("def forward"))
    assert re.search(r"x\s*:\s*torch\.Tensor", header) and re.search(r"scale\s*:\s*float", header)
    assert re.search(r"->\s*\S*Tuple\[torch\.Tensor,\s*torch\.Tensor\]", header), header
    a, b = gm(torch.ones(2))
    torch.testing.assert_close(a, torch.full((2,), 2.0))
    torch.testing.assert_close(b, -torch.ones(2))

    gm = fx.symbolic_trace(BuiltinGenerics())
    header = next(line for line in gm.code.splitlines() if line.startswith("def forward"))
    assert re.search(r"xs\s*:\s*list\[torch\.Tensor\]", header), header
    assert re.search(r"mask\s*:\s*typing\.Optional\[torch\.Tensor\]", header), header
    assert re.search(r"->\s*tuple\[torch\.Tensor, \.\.\.\]:", header), header
    a, b = gm([torch.ones(2), torch.ones(2)])
    torch.testing.assert_close(a, torch.full((2,), 2.0))
