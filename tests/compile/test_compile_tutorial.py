"""The compile tutorial's examples (``reference/torch_compile_tutorial.txt``, "Introduction
to torch.compile") with ``torch.compile`` replaced by ``fxlite.compile``: the ones that
run on the CPU, at the tutorial's sizes (tiny), several calls each with fresh inputs,
each result equal to eager's.

Left out: the timing loops on CUDA (``timed`` needs CUDA events; ``foo3`` itself is
here), TorchScript's side of the comparisons, ``nn.Module.compile()`` (torch's own
method, which calls ``torch.compile``) and the logging calls.
"""

from __future__ import annotations

import os

import pytest
import torch

if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from fxlite.codegen import compile as compile_mod

import fxlite

pytest.importorskip("triton")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
CALLS = 4


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(compile_mod, "_warned", set())


def test_fns(fn1, fn2, args):  # the tutorial's helper, as it wrote it
    out1 = fn1(*args)
    out2 = fn2(*args)
    return torch.allclose(out1, out2)


test_fns.__test__ = False  # a helper, not a test


# ------------------------------------------------------------------ Basic Usage
def foo(x, y):
    a = torch.sin(x)
    b = torch.cos(y)
    return a + b


def test_foo_compiled_as_a_function_and_as_a_decorator():
    opt_foo1 = fxlite.compile(foo)

    @fxlite.compile
    def opt_foo2(x, y):
        a = torch.sin(x)
        b = torch.cos(y)
        return a + b

    for _ in range(CALLS):
        x, y = torch.randn(3, 3), torch.randn(3, 3)
        torch.testing.assert_close(opt_foo1(x, y), foo(x, y))
        torch.testing.assert_close(opt_foo2(x, y), foo(x, y))
    assert opt_foo1.kernels and opt_foo2.kernels and not opt_foo1.fallbacks


def inner(x):
    return torch.sin(x)


def test_nested_calls_are_compiled_too():
    @fxlite.compile
    def outer(x, y):
        a = inner(x)
        b = torch.cos(y)
        return a + b

    for _ in range(CALLS):
        x, y = torch.randn(3, 3), torch.randn(3, 3)
        torch.testing.assert_close(outer(x, y), torch.sin(x) + torch.cos(y))
    assert "sin" in " ".join(n for k in outer.kernels for n in k.nodes)


class MyModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.nn.functional.relu(self.lin(x))


def test_a_module():
    mod2 = MyModule()
    opt = fxlite.compile(mod2)
    for _ in range(CALLS):
        x = torch.randn(3, 3)
        got = opt(x)
        torch.testing.assert_close(got, mod2(x))
        assert got.requires_grad  # as the tutorial's output shows: it carries a grad_fn


# ------------------------------------------------------------------ Demonstrating Speedups
def foo3(x):
    y = x + 1
    z = torch.nn.functional.relu(y)
    u = z * 2
    return u


def test_foo3_at_a_cpu_size():
    opt_foo3 = fxlite.compile(foo3)
    for _ in range(CALLS):
        inp = torch.randn(64, 64)
        torch.testing.assert_close(opt_foo3(inp), foo3(inp))
    assert len(opt_foo3.kernels) == 1  # y, z and u fused into one kernel


# ------------------------------------------------------------------ Benefits over TorchScript
def f1(x, y):
    if x.sum() < 0:
        return -y
    return y


def test_data_dependent_control_flow_is_right_on_both_paths():
    compile_f1 = fxlite.compile(f1)
    for _ in range(CALLS):
        inp1, inp2 = torch.randn(5, 5), torch.randn(5, 5)
        assert test_fns(f1, compile_f1, (inp1, inp2))  # "compile 1, 1: True"
        assert test_fns(f1, compile_f1, (-inp1, inp2))  # "compile 1, 2: True"


def f2(x, y):
    return x + y


def test_an_int_argument_needs_no_annotation():
    compile_f2 = fxlite.compile(f2)
    for _ in range(CALLS):
        assert test_fns(f2, compile_f2, (torch.randn(5, 5), 3))
    assert test_fns(f2, compile_f2, (torch.randn(5, 5), 4))  # another int: its own key


# ------------------------------------------------------------------ Graph Breaks
def bar(a, b):
    x = a / (torch.abs(a) + 1)
    if b.sum() < 0:
        b = b * -1
    return x * b


def test_graph_break_both_branches():
    opt_bar = fxlite.compile(bar)
    inp1, inp2 = torch.ones(10), torch.ones(10)
    torch.testing.assert_close(opt_bar(inp1, inp2), bar(inp1, inp2))
    torch.testing.assert_close(opt_bar(inp1, -inp2), bar(inp1, -inp2))
    for _ in range(CALLS):
        a, b = torch.randn(10), torch.randn(10)
        torch.testing.assert_close(opt_bar(a, b), bar(a, b))
        torch.testing.assert_close(opt_bar(a, -b), bar(a, -b))
    report = fxlite.explain(bar)(inp1, inp2)
    assert report.graph_count == 2 and report.graph_break_count == 1


def test_fullgraph_raises_at_the_break_after_reset():
    fxlite.reset()  # "Reset to clear the torch.compile cache"
    opt_bar_fullgraph = fxlite.compile(bar, fullgraph=True)
    with pytest.raises(fxlite.TraceError, match=r"if b.sum\(\) < 0:"):
        opt_bar_fullgraph(torch.randn(10), torch.randn(10))


def test_cond_keeps_one_graph_under_fullgraph():
    @fxlite.compile(fullgraph=True)
    def bar_fixed(a, b):
        x = a / (torch.abs(a) + 1)

        def true_branch(y):
            return y * -1

        def false_branch(y):
            # NOTE: torch.cond doesn't allow aliased outputs
            return y.clone()

        x = torch.cond(b.sum() < 0, true_branch, false_branch, (b,))
        return x * b

    def eager(a, b):
        x = b * -1 if b.sum() < 0 else b.clone()
        return x * b

    inp1, inp2 = torch.ones(10), torch.ones(10)
    torch.testing.assert_close(bar_fixed(inp1, inp2), eager(inp1, inp2))
    torch.testing.assert_close(bar_fixed(inp1, -inp2), eager(inp1, -inp2))
    for _ in range(CALLS):
        a, b = torch.randn(10), torch.randn(10)
        torch.testing.assert_close(bar_fixed(a, b), eager(a, b))
        torch.testing.assert_close(bar_fixed(a, -b), eager(a, -b))
