"""host_function: a run of host nodes as one generated function, equal to the Interpreter."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
from fxlite.codegen.runtime.host_nodes import host_function

import fxlite


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor(2.0))


def step_graph() -> fxlite.GraphModule:
    """Every kind of host node: a module call, an attribute, a list and a tuple argument,
    keyword arguments, a method, and a ``zero_grad``-style getattr/setattr pair."""
    g = fxlite.Graph()
    x, p = g.placeholder("x"), g.placeholder("p")
    y = g.call_function(operator.mul, (g.call_module("lin", (x,)), g.get_attr("scale")))
    z = g.call_function(torch.cat, ([y, x],), {"dim": -1})
    s = g.call_method("sum", (z,), {"dim": (0,), "keepdim": True})
    before = g.call_function(getattr, (p, "grad"))
    g.call_function(setattr, (p, "grad", None))
    after = g.call_function(getattr, (p, "grad"))
    g.output((s, before, after))
    return fxlite.GraphModule(Holder(), g)


def _run_both(gm, inputs, reset=lambda: None):
    reset()
    want = fxlite.Interpreter(gm, garbage_collect_values=False)
    want.run(*inputs)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    reset()
    runner = fxlite.Interpreter(gm, garbage_collect_values=False)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    runner.env = dict(zip(placeholders, inputs))
    host_function(nodes, runner.fetch_attr, runner.submodules)(runner.env)
    return want.env, runner.env, nodes


def test_a_generated_run_equals_the_interpreter_node_by_node():
    torch.manual_seed(0)
    gm = step_graph()
    p = nn.Parameter(torch.randn(2))
    x = torch.randn(4, 3)
    want, got, nodes = _run_both(gm, (x, p), reset=lambda: setattr(p, "grad", torch.ones(2)))
    assert len(nodes) == 8
    for n in nodes:
        a, b = want[n], got[n]
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n.name)
        else:
            assert type(a) is type(b) and (a is None) == (b is None), n.name
    assert p.grad is None  # the setattr ran
    torch.testing.assert_close(got[nodes[5]], torch.ones(2))  # the grad read before it


def test_names_and_constants_are_data_never_code():
    """A string constant that would end the call and run code, a kwarg key that is no
    identifier, and a node name chosen to shadow a generated one all stay values."""
    g = fxlite.Graph()
    x = g.placeholder("x")
    evil = "x); __import__('os')._exit(3); (x"
    a = g.call_function(operator.add, (x, 1))
    a.name = "_c0"
    b = g.call_function(dict, (), {"not an identifier": a, "ok": evil})
    c = g.call_method("get", (b, "ok"))
    g.output(c)
    gm = fxlite.GraphModule(torch.nn.Module(), g)
    want, got, nodes = _run_both(gm, (5,))
    assert got[b] == {"not an identifier": 6, "ok": evil} == want[b]
    assert got[c] == evil


def test_a_node_kind_without_a_host_meaning_is_refused():
    g = fxlite.Graph()
    x = g.placeholder("x")
    g.output(x)
    with pytest.raises(ValueError, match="placeholder"):
        host_function([x], lambda t: None, {})
