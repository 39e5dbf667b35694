"""Tracing as torch.fx traces: the cases where fxlite used to build a wrong graph silently,
threads, concrete_args, *args/**kwargs, and library registrations."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import operator
import threading
import types

import pytest
import torch
from torch.testing import assert_close

import fxlite as fx


# ---------------------------------------------------------------------- silently wrong graphs
def _with_relu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return torch.relu(fn(*args, **kwargs))
    return wrapper


def test_decorated_forward_keeps_the_decorators_ops():
    class M(torch.nn.Module):
        @_with_relu
        def forward(self, x, w):
            return x @ w

    gm = fx.symbolic_trace(M())
    assert any(n.target is torch.relu for n in gm.graph.nodes)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    assert_close(gm(x, w), torch.relu(x @ w))
    assert (gm(x, w) >= 0).all()


@dataclasses.dataclass
class _Out:
    total: torch.Tensor
    scaled: torch.Tensor


def test_dataclass_output_is_rebuilt_from_the_inputs_of_each_call():
    class M(torch.nn.Module):
        def forward(self, x):
            return _Out(total=x + x, scaled=x * 3)

    gm = fx.symbolic_trace(M())
    assert any(n.target is _Out for n in gm.graph.nodes)
    for _ in range(2):  # fresh inputs each call: a constant frozen at trace time would fail
        x = torch.randn(4)
        out = gm(x)
        assert isinstance(out, _Out)
        assert_close(out.total, x + x)
        assert_close(out.scaled, x * 3)


def test_traced_func_name_selects_the_method():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return x + y

        def minus(self, x, y):
            return x - y

    m, tracer = M(), fx.Tracer()
    tracer.traced_func_name = "minus"
    gm = fx.GraphModule(m, tracer.trace(m))
    x, y = torch.randn(3), torch.randn(3)
    assert_close(gm(x, y), x - y)
    tracer.traced_func_name = "nope"
    with pytest.raises(AssertionError, match="doesn't exist in M"):
        tracer.trace(m)


def test_inplace_operator_node_is_generated_in_place():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.call_function(operator.imul, (a, b))
    g.output(a)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert "a *= b" in gm.code
    assert gm(2, 3) == 6  # generated out of place, this returned 2
    t = torch.ones(2)
    gm(t, torch.full((2,), 4.0))
    assert_close(t, torch.full((2,), 4.0))


# ---------------------------------------------------------------------- threads
class _Blocking(torch.nn.Module):
    """A module whose forward waits for an event mid-trace, so other threads run meanwhile."""

    def __init__(self, started, release):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.started, self.release = started, release

    def forward(self, x):
        y = self.lin(x)
        self.started.set()
        assert self.release.wait(10)
        return torch.relu(y) + math.sqrt(4.0)


def test_other_threads_see_eager_modules_while_one_thread_traces():
    original_call, original_sqrt = torch.nn.Module.__call__, math.sqrt
    started, release = threading.Event(), threading.Event()
    result = {}

    def trace():
        result["gm"] = fx.symbolic_trace(_Blocking(started, release))

    t = threading.Thread(target=trace)
    t.start()
    try:
        assert started.wait(10)
        eager = torch.nn.Linear(3, 3)
        x = torch.randn(2, 3)
        out = eager(x)  # while the other thread traces
        assert type(out) is torch.Tensor
        assert_close(out, x @ eager.weight.T + eager.bias)
        assert isinstance(eager.weight, torch.nn.Parameter)
        assert math.sqrt(9.0) == 3.0
    finally:
        release.set()
        t.join(10)
    assert_close(result["gm"](torch.ones(1, 3)).shape, torch.Size([1, 3]))
    assert torch.nn.Module.__call__ is original_call
    assert math.sqrt is original_sqrt


def test_overlapping_traces_in_two_threads_leave_no_patch_behind():
    original_call, original_getattr = torch.nn.Module.__call__, torch.nn.Module.__getattr__
    started, release = threading.Event(), threading.Event()
    result = {}
    first = threading.Thread(target=lambda: result.setdefault(
        "a", fx.symbolic_trace(_Blocking(started, release))))
    first.start()
    try:
        assert started.wait(10)
        # Both traces patch nn.Linear; the second one ending must not unpatch it.
        second = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
        x = torch.randn(2, 3)
        assert_close(second(x), second.get_submodule("1")(second.get_submodule("0")(x)))
        assert "__call__" in vars(torch.nn.Linear) and "__call__" in vars(_Blocking)
        assert "__call__" not in vars(torch.nn.ReLU)  # only the first trace's classes remain
    finally:
        release.set()
        first.join(10)
    assert "a" in result
    for cls in (torch.nn.Linear, torch.nn.ReLU, torch.nn.Sequential, _Blocking):
        assert "__call__" not in vars(cls) and "__getattr__" not in vars(cls)
    assert torch.nn.Module.__call__ is original_call
    assert torch.nn.Module.__getattr__ is original_getattr
    assert math.sqrt.__module__ == "math"


# ---------------------------------------------------------------------- arguments
def test_concrete_args_become_guarded_placeholders():
    def f(x, flag, scale=None):
        y = x * 2 if flag else x
        return y if scale is None else y * scale

    gm = fx.symbolic_trace(f, concrete_args={"flag": True, "scale": None})
    assert any(n.target is torch._assert for n in gm.graph.nodes)
    x = torch.randn(3)
    assert_close(gm(x, True), x * 2)
    with pytest.raises(AssertionError, match="flag has been specialized to have value True"):
        gm(x, False)
    with pytest.raises(AssertionError, match="scale has been specialized to have value None"):
        gm(x, True, 2.0)
    gm.graph.eliminate_dead_code()  # the guards are side effects: DCE keeps them
    gm.recompile()
    with pytest.raises(AssertionError):
        gm(x, False)


def test_placeholders_inside_a_fixed_structure():
    def f(xs, d):
        return xs[0] + xs[1] * d["k"]

    gm = fx.symbolic_trace(f, concrete_args={"xs": [fx.PH, fx.PH], "d": {"k": fx.PHWithMeta("key")}})
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert names == ["xs_1", "xs_2", "d_1"]
    assert next(n for n in gm.graph.nodes if n.name == "d_1").ph_key == "key"
    a, b, c = torch.randn(3), torch.randn(3), torch.randn(3)
    assert_close(gm([a, b], {"k": c}), a + b * c)
    bare = fx.GraphModule({}, copy.deepcopy(gm.graph))  # the flat function, default codegen
    bare.graph.set_codegen(fx.CodeGen())
    bare.recompile()
    flat = gm.graph.process_inputs([a, b], {"k": c})
    assert len(flat) == 3
    assert_close(gm.graph.process_outputs(bare(*flat)), a + b * c)
    with pytest.raises(TypeError, match="2 items"):
        gm([a], {"k": c})
    retraced = fx.symbolic_trace(gm)  # the flattening is traced too
    assert_close(retraced([a, b], {"k": c}), a + b * c)


def test_star_args_and_kwargs_trace_as_single_values():
    class M(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args[0] + kwargs["foo"]

    gm = fx.symbolic_trace(M())
    assert "def forward(self, *args, **kwargs):" in gm.code
    a, b = torch.randn(2), torch.randn(2)
    assert_close(gm(a, foo=b), a + b)
    pos = fx.symbolic_trace(M(), concrete_args=(fx.PH, fx.PH))  # *args fixed to two values
    assert [n.name for n in pos.graph.nodes if n.op == "placeholder"] == ["args_1", "args_2", "kwargs"]


def test_forward_without_self_names_the_problem():
    class M(torch.nn.Module):
        def forward(*args):  # noqa: N805
            return args[1]

    with pytest.raises(fx.TraceError, match="cannot be part of \\*args expansion"):
        fx.symbolic_trace(M())


def test_builtin_root_raises_an_assertion_error_naming_it():
    with pytest.raises(AssertionError, match="built in"):
        fx.symbolic_trace(torch.relu)


# ---------------------------------------------------------------------- registrations and hooks
class _Pair(metaclass=fx.ProxyableClassMeta):
    def __init__(self, left, right):
        self.left, self.right = left, right


def test_proxyable_class_is_built_when_the_graph_runs():
    gm = fx.symbolic_trace(lambda x, y: _Pair(x + 1, y))
    x, y = torch.randn(2), torch.randn(2)
    out = gm(x, y)
    assert isinstance(out, _Pair)
    assert_close(out.left, x + 1)


_LIBRARY = """
import torch, torch.fx

def helper(x):
    return x * 2   # traced through, unless registered

torch.fx.wrap("helper")   # at module scope, as torchvision does for its helpers

def user(x):
    return helper(x) + 1
"""


def test_torch_fx_wrap_registrations_of_libraries_are_honoured():
    import torch.fx._symbolic_trace as st

    lib = types.ModuleType("a_library")
    exec(compile(_LIBRARY, "<a_library>", "exec"), lib.__dict__)
    try:
        gm = fx.symbolic_trace(lib.user)
    finally:
        st._wrapped_fns_to_patch.pop((id(lib.__dict__), "helper"), None)
    assert any(n.target is lib.helper for n in gm.graph.nodes)
    assert not any(n.target is operator.mul for n in gm.graph.nodes)
    assert lib.__dict__["helper"] is lib.helper and lib.helper.__name__ == "helper"
    assert_close(gm(torch.ones(2)), torch.full((2,), 3.0))


def test_stack_trace_and_module_stack_point_at_user_code():
    def helper(a, b):
        return a * b

    class Sub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            return helper(self.lin(x), x)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = Sub()

        def forward(self, x):
            return self.sub(x)

    tracer = fx.Tracer()
    tracer.record_stack_traces = True
    graph = tracer.trace(M())
    mul = next(n for n in graph.nodes if n.target is operator.mul)
    assert "return self.sub(x)" in mul.stack_trace and "return a * b" in mul.stack_trace
    assert mul.stack_trace.index("self.sub(x)") < mul.stack_trace.index("a * b")  # outer first
    lin = next(n for n in graph.nodes if n.op == "call_module")
    assert list(lin.meta["nn_module_stack"]) == ["sub", "sub.lin"]
    assert lin.meta["nn_module_stack"]["sub.lin"] == ("sub.lin", torch.nn.Linear)
    gm = fx.GraphModule(M(), graph)
    assert __file__ in gm.forward.__code__.co_filename


def test_check_mutable_operations_rejects_out_arguments():
    class Checking(fx.Tracer):
        check_mutable_operations = True

    def f(x):
        y = torch.empty_like(x)
        torch.sigmoid(x, out=y)
        return y

    with pytest.raises(RuntimeError, match="mutable operation aten::sigmoid.out"):
        Checking().trace(f)
    fx.Tracer().trace(f)  # off by default
