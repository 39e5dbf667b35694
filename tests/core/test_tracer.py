"""Tracer and Proxy: operators, attribute access, dispatch, unpacking, errors and overrides."""

from __future__ import annotations

import inspect
import math
import operator
import os

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import fxlite as fx

THIS_FILE = os.path.basename(__file__)


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def _line_of(fn, text: str) -> int:
    """The absolute line number of the first line of ``fn`` that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


# ---------------------------------------------------------------------- operators
BINARY = [operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
          operator.mod, operator.pow, operator.lt, operator.le, operator.gt, operator.ge,
          operator.eq, operator.ne]


@pytest.mark.parametrize("op", BINARY, ids=lambda o: o.__name__)
def test_binary_operator_between_proxies(op):
    def f(x, y):
        return op(x, y)

    gm = fx.symbolic_trace(f)
    (node,) = _calls(gm)
    assert node.op == "call_function" and node.target is op
    assert [a.name for a in node.args] == ["x", "y"]
    x, y = torch.rand(3, 4) + 0.5, torch.rand(3, 4) + 0.5
    assert_close(gm(x, y), op(x, y))


ARITH = [operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
         operator.mod, operator.pow]


@pytest.mark.parametrize("op", ARITH, ids=lambda o: o.__name__)
def test_reflected_operator_with_constant_on_the_left(op):
    def f(x):
        return op(2.0, x)

    gm = fx.symbolic_trace(f)
    (node,) = _calls(gm)
    assert node.target is op
    assert node.args[0] == 2.0 and node.args[1].name == "x"
    x = torch.rand(5) + 0.5
    assert_close(gm(x), op(2.0, x))


@pytest.mark.parametrize("op", [operator.lt, operator.le, operator.gt, operator.ge, operator.eq,
                                operator.ne], ids=lambda o: o.__name__)
def test_comparison_with_constant_on_the_left(op):
    def f(x):
        return op(0.5, x)

    gm = fx.symbolic_trace(f)
    x = torch.rand(8)
    assert torch.equal(gm(x), op(0.5, x))


def test_reflected_spelled_as_in_source():
    def f(x):
        return 1 + x, 2 ** x, 3 - x, 1 / x

    gm = fx.symbolic_trace(f)
    targets = [(n.target, n.args[0]) for n in _calls(gm)]
    assert targets == [(operator.add, 1), (operator.pow, 2), (operator.sub, 3), (operator.truediv, 1)]
    x = torch.rand(4) + 0.1
    for got, want in zip(gm(x), f(x)):
        assert_close(got, want)


@pytest.mark.parametrize("op", [operator.and_, operator.or_, operator.xor, operator.lshift,
                                operator.rshift], ids=lambda o: o.__name__)
def test_bitwise_operators(op):
    def f(x, y):
        return op(x, y), op(3, x)

    gm = fx.symbolic_trace(f)
    assert [n.target for n in _calls(gm)] == [op, op]
    x, y = torch.tensor([1, 2, 3]), torch.tensor([2, 1, 0])
    for got, want in zip(gm(x, y), f(x, y)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("op", [operator.neg, operator.pos, operator.abs, operator.invert],
                         ids=lambda o: o.__name__)
def test_unary_operators(op):
    def f(x):
        return op(x)

    gm = fx.symbolic_trace(f)
    (node,) = _calls(gm)
    assert node.target is op
    x = torch.tensor([-2, 0, 3])
    assert torch.equal(gm(x), op(x))


def test_matmul_operator():
    def f(x, w):
        return x @ w, 2 * (x @ w.t())

    gm = fx.symbolic_trace(f)
    assert _calls(gm)[0].target is operator.matmul
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    for got, want in zip(gm(x, w), f(x, w)):
        assert_close(got, want)


def test_inplace_operators_are_recorded_and_keep_semantics():
    def f(x, y):
        x += 1
        x *= y
        x -= 0.5
        x /= 2
        return x

    gm = fx.symbolic_trace(f)
    assert [n.target for n in _calls(gm)] == [operator.iadd, operator.imul, operator.isub,
                                              operator.itruediv]
    a, b = torch.rand(4), torch.rand(4)
    a_eager, a_traced = a.clone(), a.clone()
    want = f(a_eager, b)
    got = gm(a_traced, b)
    assert_close(got, want)
    assert_close(a_traced, a_eager)  # the input was updated in place, as in eager mode
    assert got.data_ptr() == a_traced.data_ptr()


# ---------------------------------------------------------------------- attributes and methods
def test_attribute_access_shape_and_T():
    def f(x):
        return x.reshape(x.shape[0], -1) + x.T.sum(), x.dtype

    gm = fx.symbolic_trace(f)
    getattrs = [n for n in gm.graph.nodes if n.target is getattr]
    assert sorted(n.args[1] for n in getattrs) == ["T", "dtype", "shape"]
    x = torch.randn(3, 3)
    out, dt = gm(x)
    assert_close(out, f(x)[0])
    assert dt == torch.float32


def test_method_calls_with_args_and_kwargs():
    def f(x):
        return x.relu().view(2, -1).sum(dim=1, keepdim=True)

    gm = fx.symbolic_trace(f)
    nodes = _calls(gm)
    assert [(n.op, n.target) for n in nodes] == [("call_method", "relu"), ("call_method", "view"),
                                                 ("call_method", "sum")]
    assert nodes[1].args[1:] == (2, -1)
    assert nodes[2].kwargs == {"dim": 1, "keepdim": True}
    x = torch.randn(4, 3)
    assert_close(gm(x), f(x))


def test_torch_and_functional_dispatch():
    def f(x, y, w):
        a = torch.cat([x, y], dim=0)
        b = torch.where(a > 0, a, torch.zeros_like(a))
        c = F.gelu(F.linear(b, w))
        d = F.softmax(c, dim=-1)
        return torch.stack((d, F.layer_norm(c, (4,))))

    gm = fx.symbolic_trace(f)
    fns = [n.target for n in _calls(gm) if n.op == "call_function"]
    for fn in (torch.cat, torch.where, torch.zeros_like, F.gelu, F.linear, F.softmax, torch.stack,
               F.layer_norm):
        assert fn in fns, fn
    cat = gm.graph.find_nodes(op="call_function", target=torch.cat)[0]
    assert [a.name for a in cat.args[0]] == ["x", "y"] and cat.kwargs == {"dim": 0}
    x, y, w = torch.randn(2, 3), torch.randn(2, 3), torch.randn(4, 3)
    assert_close(gm(x, y, w), f(x, y, w))


# ---------------------------------------------------------------------- indexing and unpacking
def test_indexing_and_slicing():
    def f(x):
        return x[:, 0], x[..., None], x[1:3], x[::2, -1], x[0]

    gm = fx.symbolic_trace(f)
    keys = [n.args[1] for n in _calls(gm)]
    assert all(n.target is operator.getitem for n in _calls(gm))
    assert keys == [(slice(None), 0), (Ellipsis, None), slice(1, 3), (slice(None, None, 2), -1), 0]
    x = torch.randn(4, 5)
    for got, want in zip(gm(x), f(x)):
        assert torch.equal(got, want)


def test_index_with_a_traced_tensor():
    def f(x, idx):
        return x[idx] * 2

    gm = fx.symbolic_trace(f)
    x, idx = torch.randn(5), torch.tensor([4, 0, 2])
    assert_close(gm(x, idx), f(x, idx))


def test_tuple_unpacking_of_known_length():
    def f(x):
        a, b = x.chunk(2)
        c, d, e = torch.split(x, 2, dim=1)
        n, m = x.shape
        return a + b, c * d - e, x.view(m, n)

    gm = fx.symbolic_trace(f)
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert [n.args[1] for n in getitems] == [0, 1, 0, 1, 2, 0, 1]
    x = torch.randn(4, 6)
    for got, want in zip(gm(x), f(x)):
        assert_close(got, want)


def test_len_raises_trace_error_naming_the_line():
    def f(x):
        return x / len(x)

    with pytest.raises(fx.TraceError) as info:
        fx.symbolic_trace(f)
    msg = str(info.value)
    assert THIS_FILE in msg
    assert f"line {_line_of(f, 'len(x)')}" in msg
    assert "return x / len(x)" in msg
    assert "wrap" in msg


def test_iteration_raises_trace_error_naming_the_line():
    def f(x):
        total = 0
        for row in x:
            total = total + row
        return total

    with pytest.raises(fx.TraceError) as info:
        fx.symbolic_trace(f)
    msg = str(info.value)
    assert THIS_FILE in msg
    assert f"line {_line_of(f, 'for row in x')}" in msg
    assert "for row in x:" in msg


def test_control_flow_raises_trace_error_which_is_value_and_runtime_error():
    def f(x):
        while x.max() > 1:
            x = x / 2
        return x

    with pytest.raises(fx.TraceError) as info:
        fx.symbolic_trace(f)
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    msg = str(info.value)
    assert f"line {_line_of(f, 'while x.max()')}" in msg
    assert "concrete_args" in msg and "wrap" in msg and "leaf" in msg


# ---------------------------------------------------------------------- functions and signatures
def test_default_args_varargs_and_keyword_only():
    def with_default(x, y=2):
        return x * y

    def with_varargs(x, *args):
        return x + args[0] * args[1]

    def with_kwonly(x, *, scale=3.0):
        return x * scale

    x = torch.randn(3)
    gm = fx.symbolic_trace(with_default)
    assert_close(gm(x), x * 2)
    assert_close(gm(x, 5), x * 5)
    gm = fx.symbolic_trace(with_varargs)
    y, z = torch.randn(3), torch.randn(3)
    assert_close(gm(x, y, z), x + y * z)
    gm = fx.symbolic_trace(with_kwonly)
    assert_close(gm(x), x * 3.0)
    assert_close(gm(x, scale=0.5), x * 0.5)


def test_symbolic_trace_module_params_and_constants():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 3))
            self.register_buffer("offset", torch.randn(3))

        def forward(self, x):
            return x @ self.weight + self.offset + torch.tensor([1.0, 2.0, 3.0])

    m = M()
    gm = fx.symbolic_trace(m)
    attrs = {n.target for n in gm.graph.find_nodes(op="get_attr")}
    assert attrs == {"weight", "offset", "_tensor_constant0"}
    assert isinstance(gm.weight, torch.nn.Parameter)
    assert torch.equal(gm._tensor_constant0, torch.tensor([1.0, 2.0, 3.0]))
    x = torch.randn(2, 3)
    assert_close(gm(x), m(x))


def test_autowrap_math_functions():
    def f(x):
        return x / math.sqrt(x.size(0)) + math.log(x.size(1))

    gm = fx.symbolic_trace(f)
    targets = [n.target for n in _calls(gm)]
    assert math.sqrt in targets and math.log in targets
    for x in (torch.randn(4, 3), torch.randn(9, 7)):  # sizes are read at run time
        assert_close(gm(x), f(x))


def test_max_and_min_of_traced_sizes_are_recorded():
    # TensorFlow-style "same" padding, as timm's tf_efficientnet computes it: torch.fx
    # raises at max(); fxlite records max/min calls, so the padding follows the input size.
    def pad_same(x, k=3, s=2):
        ih, iw = x.size()[-2:]
        ph = max((math.ceil(ih / s) - 1) * s + k - ih, 0)
        pw = max((math.ceil(iw / s) - 1) * s + k - iw, 0)
        return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)) * min(ih, iw)

    gm = fx.symbolic_trace(pad_same)
    targets = [n.target for n in _calls(gm)]
    assert max in targets and min in targets
    for shape in [(1, 2, 7, 8), (1, 2, 4, 4), (2, 1, 1, 1)]:
        x = torch.randn(shape)
        assert_close(gm(x), pad_same(x))
    # plain values, in and out of a trace, pass straight through
    assert (max(3, 4), min([5, 2]), max(i for i in range(3))) == (4, 2, 2)
    traced = fx.symbolic_trace(lambda x: x * max([1, 2]))
    assert max not in [n.target for n in _calls(traced)]
    # with key= (a function the generated code could not name) it raises, as torch.fx does
    with pytest.raises(Exception, match="control flow|traced"):
        fx.symbolic_trace(lambda x: x * max(x.shape[0], 3, key=lambda v: v))


# ---------------------------------------------------------------------- Tracer overrides
class Inner(torch.nn.Module):
    def forward(self, x):
        return torch.neg(x) + 1


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.inner = Inner()

    def forward(self, x):
        return self.inner(self.lin(x))


def test_default_leaves_are_torch_nn_modules():
    gm = fx.symbolic_trace(Outer())
    assert [n.target for n in gm.graph.find_nodes(op="call_module")] == ["lin"]
    assert gm.graph.find_nodes(op="call_function", target=torch.neg)


def test_is_leaf_module_override():
    class LeafInner(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Inner) or super().is_leaf_module(m, qualname)

    class NoLeaves(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return False

    m = Outer()
    x = torch.randn(2, 4)
    g = LeafInner().trace(m)
    assert [n.target for n in g.find_nodes(op="call_module")] == ["lin", "inner"]
    assert_close(fx.GraphModule(m, g)(x), m(x))
    g = NoLeaves().trace(m)
    assert not g.find_nodes(op="call_module")
    assert {n.target for n in g.find_nodes(op="get_attr")} == {"lin.weight", "lin.bias"}
    assert_close(fx.GraphModule(m, g)(x), m(x))


def test_call_module_and_path_of_module_overrides():
    seen, paths = [], []

    class Recording(fx.Tracer):
        def call_module(self, m, forward, args, kwargs):
            seen.append(type(m).__name__)
            return super().call_module(m, forward, args, kwargs)

        def path_of_module(self, mod):
            path = super().path_of_module(mod)
            paths.append(path)
            return path

    m = Outer()
    g = Recording().trace(m)
    assert seen == ["Linear", "Inner"]
    assert "lin" in paths
    assert_close(fx.GraphModule(m, g)(torch.ones(1, 4)), m(torch.ones(1, 4)))


def test_create_proxy_override_tags_nodes():
    class Tagging(fx.Tracer):
        def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None):
            proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr)
            proxy.node.meta["tagged"] = True
            return proxy

    g = Tagging().trace(Outer())
    for node in g.nodes:
        if node.op != "output":
            assert node.meta.get("tagged") is True, node.name


class Scale:
    """A value the default tracer does not know how to put in a graph."""

    def __init__(self, value: float) -> None:
        self.value = value


SCALE = Scale(3.0)


def test_create_arg_override():
    def f(x):
        return x * SCALE

    class Unwrapping(fx.Tracer):
        def create_arg(self, a):
            if isinstance(a, Scale):
                return a.value
            return super().create_arg(a)

    g = Unwrapping().trace(f)
    (mul,) = g.find_nodes(op="call_function", target=operator.mul)
    assert mul.args[1] == 3.0
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert_close(gm(torch.ones(2)), torch.full((2,), 3.0))


def test_getattr_override():
    accessed = []

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return x * self.weight + self.weight

    class Recording(fx.Tracer):
        def getattr(self, attr, attr_val, parameter_proxy_cache):
            accessed.append(attr)
            return super().getattr(attr, attr_val, parameter_proxy_cache)

    m = M()
    g = Recording().trace(m)
    assert accessed.count("weight") == 2
    assert len(g.find_nodes(op="get_attr")) == 1  # both uses share one get_attr node
    assert_close(fx.GraphModule(m, g)(torch.ones(3)), m(torch.ones(3)))


def test_trace_graph_module_again():
    m = Outer()
    gm = fx.symbolic_trace(m)
    gm2 = fx.symbolic_trace(gm)
    assert [n.op for n in gm2.graph.nodes] == [n.op for n in gm.graph.nodes]
    x = torch.randn(2, 4)
    assert_close(gm2(x), m(x))
