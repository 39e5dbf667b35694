"""The "Limitations of Symbolic Tracing" examples of the torch.fx guide
(shared/reference/fx.rst), ported to fxlite: dynamic and static control flow,
``concrete_args``, non-``torch`` functions and ``wrap``, custom tracers, leaf modules, and
the miscellanea (dropout's training flag, type annotations).

Each test follows one example with ``torch.fx`` replaced by ``fxlite`` and checks what the
guide describes. The guide's other examples are in test_reference_examples.py.
"""

from __future__ import annotations

import importlib
import inspect
import operator
import os
import re
import typing
from math import sqrt

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxlite as fx

THIS_FILE = os.path.basename(__file__)

# "Non-torch Functions": record len() and sqrt() as calls in this module's traces.
fx.wrap("len")
fx.wrap("sqrt")


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
