"""Straight-line forwards (codegen/runtime/straight_line.py), checked without a GPU.

Stand-in kernels with prepared "launches" replace Triton's; on the GPU the same paths run
end to end in tests/compile/test_compile_gpu.py (test_gpu_straight_line_*).
"""

from __future__ import annotations

import operator
import types

import pytest
import torch
from fxlite.codegen.lower.batch_norm import per_channel
from fxlite.codegen.runtime.launch import fingerprint
from fxlite.codegen.runtime.straight_line import (
    AttrCheck,
    StraightRunner,
    attr_key,
    fast_key,
    straight_line,
)

import fxlite


class _Kernel:
    """Stands in for a TritonKernel with direct launches prepared for some fingerprints."""

    def __init__(self, name, fn, *example_inputs):
        self.__name__, self.fn = name, fn
        self.fast_calls = self.general_calls = 0
        self._direct = {}
        for inputs in example_inputs:
            self.prepare(inputs)

    def prepare(self, inputs):
        self._direct[fingerprint(inputs)] = types.SimpleNamespace(fast=self._fast)

    def _fast(self, inputs):
        self.fast_calls += 1
        return self.fn(*inputs)

    def __call__(self, *inputs):
        self.general_calls += 1
        return self.fn(*inputs)


def _module(build, root=None):
    g = fxlite.Graph()
    build(g)
    return fxlite.GraphModule(root if root is not None else torch.nn.Module(), g)


def test_fast_key_follows_the_fingerprint_and_autograd() -> None:
    x = torch.randn(4, 8)
    assert fast_key([x, 3]) == fast_key([torch.randn(4, 8), 4])
    assert fast_key([x]) != fast_key([x.t()])
    assert fast_key([x]) != fast_key([x.requires_grad_(False).clone().requires_grad_()])
    assert fast_key([x, [1]]) is None


def test_kernels_chain_their_prepared_launches() -> None:
    x = torch.randn(4, 8)
    add = _Kernel("add", lambda a, s: (a + s, a * s), (x, 2.0))
    relu = _Kernel("relu", torch.relu, (x,))

    def build(g):
        a = g.placeholder("print('PWNED') or x")
        pair = g.call_function(add, (a, 2.0))
        first = g.call_function(operator.getitem, (pair, 0))
        second = g.call_function(operator.getitem, (pair, 1))
        g.output((g.call_function(relu, (first,)), second))

    fn, result, attrs, complete = straight_line(_module(build), (x,))
    torch.testing.assert_close(result[0], torch.relu(x + 2))
    torch.testing.assert_close(result[1], x * 2)
    assert attrs == [] and complete
    y = torch.randn(4, 8)  # same fingerprint: the same function serves it
    out = fn(y)
    torch.testing.assert_close(out[0], torch.relu(y + 2))
    assert add.fast_calls == relu.fast_calls == 2 and add.general_calls == 0


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 3, 3, 3), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.randn(3), requires_grad=False)


def _conv_scale(kernel):
    """conv2d(x in channels-last, weight) * per_channel(scale): extern ops (a Tensor
    method called as a function, too), a view of an attribute."""
    def build(g):
        x = g.call_function(torch.Tensor.contiguous, (g.placeholder("x"),),
                            {"memory_format": torch.channels_last})
        conv = g.call_function(torch.conv2d, (x, g.get_attr("weight")), {"padding": 1})
        channels = g.call_method("size", (conv, 1))
        scale = g.call_function(per_channel, (g.get_attr("scale"), channels, 4, "weight"))
        g.output(g.call_function(kernel, (conv, scale)))
    return build


def _want(net, x):
    return torch.conv2d(x, net.weight, padding=1) * net.scale.reshape(-1, 1, 1)


def test_extern_ops_and_attributes_keep_kernels_on_their_launches(monkeypatch) -> None:
    net, x = _Net(), torch.randn(2, 3, 5, 5)
    mul = _Kernel("mul", torch.mul)
    conv = torch.conv2d(x.contiguous(memory_format=torch.channels_last), net.weight, padding=1)
    mul.prepare([conv, net.scale.reshape(-1, 1, 1)])
    gm = _module(_conv_scale(mul), net)
    fn, result, attrs, _ = straight_line(gm, (x,))
    torch.testing.assert_close(result, _want(net, x))
    assert {id(a) for a in attrs} == {id(net.weight), id(net.scale)}
    key, check = attr_key(attrs), AttrCheck(attrs)
    assert check()
    # The per-channel view and the size read were made once: neither runs again.
    views = []
    y = torch.randn(2, 3, 5, 5)
    want = _want(net, y)
    monkeypatch.setattr(torch.Tensor, "reshape", lambda *a: views.append(a))
    torch.testing.assert_close(fn(y), want)
    monkeypatch.undo()
    assert views == [] and mul.fast_calls == 2 and mul.general_calls == 0
    # An in-place write to the attribute is seen through the view bound once.
    with torch.no_grad():
        net.scale.mul_(-3)
    torch.testing.assert_close(fn(y), _want(net, y))
    assert attr_key(attrs) == key and check()
    # A `.data` swap changes the key, so the caller makes a new function.
    net.scale.data = torch.randn(3)
    assert attr_key(attrs) != key and not check()


@pytest.mark.parametrize("swap", ["memory", "shape", "strides", "dtype"])
@pytest.mark.parametrize("cxx_guard", [True, False])
def test_the_attribute_check_sees_every_data_swap(swap, cxx_guard, monkeypatch) -> None:
    import torch._C._dynamo.guards as guards

    if not cxx_guard:  # a torch without the private guard: the Python comparison
        monkeypatch.setattr(guards, "TensorGuards", None)
    net = _Net()
    w = net.weight
    check = AttrCheck([net.scale, w])
    assert (check.guard is not None) == cxx_guard
    before = attr_key(check.tensors)
    assert check()
    if swap == "memory":
        w.data = w.data.clone()
    elif swap == "shape":       # the same memory, seen as another shape
        w.data = w.data.view(9, 9)
    elif swap == "strides":
        w.data = w.data.transpose(2, 3)
    else:
        w.data = w.data.view(torch.int32)
    assert not check() and attr_key(check.tensors) != before


def test_a_kernel_reading_unfixed_values_looks_its_launch_up() -> None:
    # An unaligned argument, and values of an op whose shape depends on the data: the
    # kernel finds its launch through its fingerprint on every call.
    mul = _Kernel("mul", lambda a: a * 2)

    def build(g):
        x = g.placeholder("x")
        nz = g.call_function(torch.nonzero, (x,))
        g.output((g.call_function(mul, (x,)), g.call_function(mul, (nz,))))

    base = torch.randn(33)
    x = base[1:].view(4, 8)  # 4 bytes past an aligned address
    mul.prepare([x])
    fn, result, _, _ = straight_line(_module(build), (x,))
    torch.testing.assert_close(result[0], x * 2)
    torch.testing.assert_close(result[1], torch.nonzero(x) * 2)
    assert mul.general_calls == 2 and mul.fast_calls == 0
    y = torch.zeros(33)[1:].view(4, 8)
    y[0, 0] = 1.0
    out = fn(y)
    torch.testing.assert_close(out[1], torch.nonzero(y) * 2)  # one row, not 32


@pytest.mark.parametrize("index, fast, other", [
    (torch.tensor([3, 0, 1, 1]), True, torch.tensor([2, 2, 0, 3])),
    (torch.tensor([True, False, True, True]), False, torch.tensor([False, True, False, False])),
    (torch.tensor(1), False, torch.tensor(2)),  # selects: a view at the value's address
    (1, False, 2),
], ids=["integers", "mask", "0-dim", "number"])
def test_an_index_by_integers_keeps_its_reader_on_its_launch_and_others_do_not(
        index, fast, other) -> None:
    # MaxViT's relative position bias, table[index.view(-1)]: a new tensor, its shape from
    # the index's. Read as a possible mask, it sent 192 of maxvit_t's 201 kernels a call
    # through their lookups. A mask's result depends on its values, and an index by a
    # number (or a 0-dim tensor) is a view whose alignment depends on the number: each
    # call looks its launch up.
    mul = _Kernel("mul", lambda a: a * 2)

    def build(g):
        x, i = g.placeholder("x"), g.placeholder("index")
        g.output(g.call_function(mul, (g.call_function(operator.getitem, (x, i)),)))

    x = torch.randn(4, 3)
    mul.prepare([x[index]])
    fn, result, _, _ = straight_line(_module(build), (x, index))
    torch.testing.assert_close(result, x[index] * 2)
    torch.testing.assert_close(fn(x, index), x[index] * 2)
    assert (mul.fast_calls, mul.general_calls) == ((2, 0) if fast else (0, 2))
    torch.testing.assert_close(fn(x, other), x[other] * 2)


def test_it_declines_before_running_anything() -> None:
    ran = []
    k = _Kernel("k", lambda a: ran.append(a) or a)

    def odd_method(g):
        x = g.placeholder("x")
        y = g.call_function(k, (x,))
        g.output(g.call_method("relu(); import os #", (y,)))

    x = torch.randn(4)
    k.prepare([x])
    assert straight_line(_module(odd_method), (x,)) is None
    assert straight_line(_module(lambda g: g.output(g.placeholder("x"))), (x, x)) is None
    assert ran == []


def test_a_kernel_without_a_prepared_launch_is_called_through_its_lookup() -> None:
    relu = _Kernel("relu", torch.relu)

    def build(g):
        g.output(g.call_function(relu, (g.placeholder("x"),)))

    x = torch.randn(4, 8)
    fn, result, _, complete = straight_line(_module(build), (x,))
    assert not complete and relu.general_calls == 1
    torch.testing.assert_close(result, torch.relu(x))
    torch.testing.assert_close(fn(x), torch.relu(x))  # written, and right
    assert relu.general_calls == 2
    relu.prepare([x])
    fn, _, _, complete = straight_line(_module(build), (x,))
    assert complete


@pytest.mark.parametrize("exit_op", ["output", "flatten"])
def test_a_view_bound_once_never_reaches_the_caller(exit_op) -> None:
    # A view bound once that the caller got back could be changed in place by it. A view
    # the graph returns is made on each call; one an op gives back as itself (flatten
    # of a 1-d view) stops the graph from being written.
    net = _Net()
    ident = _Kernel("ident", lambda a, v: a + v.sum())

    def build(g):
        x = g.placeholder("x")
        view = g.call_method("view", (g.get_attr("scale"), -1))
        out = g.call_function(ident, (x, view))
        back = view if exit_op == "output" else g.call_method("flatten", (view,))
        g.output((out, back))

    x = torch.randn(3)
    ident.prepare([x, net.scale.view(-1)])
    fn, result, _, _ = straight_line(_module(build, net), (x,))
    torch.testing.assert_close(result[1], net.scale)
    if exit_op == "flatten":
        assert fn is None
    else:
        first, second = fn(x)[1], fn(x)[1]
        assert first is not second and first is not result[1]
        first.unsqueeze_(0)
        torch.testing.assert_close(fn(x)[0], x + net.scale.sum())


def test_the_runner_keeps_one_forward_per_layout_and_follows_data_swaps() -> None:
    net, x = _Net(), torch.randn(2, 3, 5, 5)
    mul = _Kernel("mul", torch.mul)
    conv = torch.conv2d(x.contiguous(memory_format=torch.channels_last), net.weight, padding=1)
    mul.prepare([conv, net.scale.reshape(-1, 1, 1)])
    run = StraightRunner(_module(_conv_scale(mul), net))
    for _ in range(3):
        torch.testing.assert_close(run(x), _want(net, x))
    assert len(run.lines) == 1 and mul.fast_calls == 3
    net.scale.data = torch.randn(3)  # the check fails: made again for the new memory
    torch.testing.assert_close(run(x), _want(net, x))
    torch.testing.assert_close(run(x), _want(net, x))
    assert len(run.lines) == 1 and mul.general_calls == 0
    small = torch.randn(1, 3, 4, 4)  # another layout: no launch prepared at first
    torch.testing.assert_close(run(small), _want(net, small))
    assert run.lines[fast_key([small])].rewrites == run._REWRITES
    assert run.complete(fast_key([small])) is None
    small_conv = torch.conv2d(small.contiguous(memory_format=torch.channels_last),
                              net.weight, padding=1)
    mul.prepare([small_conv, net.scale.reshape(-1, 1, 1)])  # as its first call would
    fast = mul.fast_calls
    for _ in range(3):
        torch.testing.assert_close(run(small), _want(net, small))
    assert run.complete(fast_key([small])) is not None and mul.fast_calls == fast + 3
    assert len(run.lines) == 2 and not run.off


def test_the_runner_turns_off_for_graphs_it_cannot_write() -> None:
    def build(g):
        g.output(g.call_method("relu(); import os #", (g.placeholder("x"),)))

    gm = _module(build)
    run = StraightRunner(gm)
    gm.forward = lambda x: torch.relu(x)  # stands in for a forward Python can run
    run.plain = gm.forward
    torch.testing.assert_close(run(-torch.ones(3)), torch.zeros(3))
    assert run.off and run.lines == {}


@pytest.mark.skipif(not __import__("fxlite.codegen.runtime.kernel", fromlist=["x"]).interpreting(),
                    reason="compiles kernels under Triton's interpreter")
def test_a_compiled_model_runs_its_straight_line_and_follows_its_parameters():
    # End to end: fxlite.compile of a conv + BatchNorm + ReLU model runs through the
    # runner, which binds the per-channel views once and still sees every write.
    import fxlite.codegen.lower.batch_norm as bn_mod

    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                            torch.nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    c = fxlite.compile(m)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(c(x), m(x))
        run = c._last[0].run
        assert isinstance(run, StraightRunner) and not run.off and len(run.lines) == 1
        forward = next(iter(run.lines.values()))[0]
        bound = list(forward.__globals__.values())
        assert bn_mod.per_channel not in bound  # its views are bound once, not called
        # BatchNorm's four per-channel views, and the conv's bias (it joins the kernel)
        views = [v for v in bound if isinstance(v, torch.Tensor) and v.dim() == 3]
        assert len(views) == 5 and all(
            v.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in (
                m[1].weight, m[1].bias, m[1].running_mean, m[1].running_var, m[0].bias)}
            for v in views)
        m[1].weight.mul_(-1)                       # in place
        torch.testing.assert_close(c(x), m(x))
        m[0].bias.data = torch.randn(4)            # the conv's bias, in the kernel
        torch.testing.assert_close(c(x), m(x))
        m[1].bias.data = torch.randn(4)            # new memory: written again
        torch.testing.assert_close(c(x), m(x))
        m[1].running_var.data = m[1].running_var.data.clone()
        torch.testing.assert_close(c(x), m(x))
        y = torch.randn(3, 3, 10, 10)              # another layout: another forward
        torch.testing.assert_close(c(y), m(y))
        assert len(run.lines) == 2


@pytest.mark.skipif(not __import__("fxlite.codegen.runtime.kernel", fromlist=["x"]).interpreting(),
                    reason="compiles kernels under Triton's interpreter")
def test_a_layer_norms_size_checks_are_made_once_per_layout():
    # layer_norm's decomposition checks the normalized sizes on every call of the graph;
    # for one layout the answer is fixed, so the straight line binds it.
    from fxlite.passes.decompose_rules import _normalized_count

    m = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.LayerNorm(8)).eval()
    c = fxlite.compile(m)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            torch.testing.assert_close(c(x), m(x))
        forward = next(iter(c._last[0].run.lines.values()))[0]
        assert _normalized_count not in forward.__globals__.values()
        with pytest.raises(RuntimeError, match="normalized_shape"):
            c(torch.randn(4, 6))  # another layout still checks, as eager does


def test_a_dict_argument_with_other_keys_is_refused_before_anything_runs() -> None:
    # A dict with non-string keys cannot be written as a literal: the graph is refused
    # up front, not halfway through a run (that would repeat the ops before it).
    ran = []
    k = _Kernel("k", lambda a: ran.append(a) or a)

    def build(g):
        y = g.call_function(k, (g.placeholder("x"),))
        g.output(g.call_function(lambda t, table: t * table[1], (y, {1: 2.0})))

    x = torch.randn(4)
    k.prepare([x])
    assert straight_line(_module(build), (x,)) is None
    assert ran == []


def test_a_chain_of_views_is_one_as_strided_written_where_an_op_reads_it() -> None:
    # GPT-2's heads: qkv.split(...)[1].view(...).transpose(1, 2) was four torch calls a
    # call; it is one as_strided of qkv, at the right offset from wherever qkv starts
    big = torch.randn(64 + 2 * 24)
    x = big[4:4 + 2 * 24].view(2, 24)  # an argument with a storage offset (aligned)
    relu = _Kernel("relu", torch.relu, (x,))
    scale = _Kernel("scale", lambda a: a * 3, (torch.randn(2, 3, 4).transpose(1, 2),))

    def build(g):
        qkv = g.call_function(relu, (g.placeholder("x"),))
        parts = g.call_method("split", (qkv, 8), {"dim": 1})
        k = g.call_function(operator.getitem, (parts, 1))
        heads = g.call_method("transpose", (g.call_method("view", (k, 2, 4, 2)), 1, 2))
        g.call_method("view", (qkv, -1))  # read by nothing: never written
        head0 = g.call_method("select", (g.call_method("view", (heads, 2, 2, 4)), 1, 0))
        cat = g.call_function(torch.cat, (parts, 1))  # the tuple itself is read
        g.output((g.call_function(scale, (head0,)), heads, cat))

    def want(a):
        heads = torch.relu(a).split(8, 1)[1].view(2, 4, 2).transpose(1, 2)
        return heads.view(2, 2, 4)[:, 0] * 3, heads, torch.relu(a)

    fn, result, _, _ = straight_line(_module(build), (x,))
    names = fn.__code__.co_names
    assert names.count("_as_strided") == 1 and "split" in names
    assert "transpose" not in names and "view" not in names and "select" not in names
    for arg in (x, big[8:8 + 2 * 24].view(2, 24), torch.randn(2, 24)):  # same fast key
        got = fn(arg)
        for g_, w in zip(got, want(arg)):
            assert g_.shape == w.shape and g_.stride() == w.stride()
            torch.testing.assert_close(g_, w)
        assert got[1]._base is not None  # a view of the kernel's result, as in eager


def test_views_of_tensors_autograd_records_are_written_as_the_graph_calls_them() -> None:
    x = torch.randn(2, 6, requires_grad=True)

    def build(g):
        v = g.call_method("view", (g.placeholder("x"), 3, 4))
        g.output(g.call_function(torch.mul, (v, 2.0)))

    fn, _, _, _ = straight_line(_module(build), (x,))
    assert "_as_strided" not in fn.__code__.co_names
    fn(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 6), 2.0))


def test_views_are_made_before_an_op_that_may_move_their_tensors_storage() -> None:
    x = torch.randn(2, 6)
    double = _Kernel("double", lambda a: a * 2, (x,))

    def build(g):
        y = g.call_function(double, (g.placeholder("x"),))
        v = g.call_method("view", (y, 3, 4))
        g.call_method("set_", (y, torch.zeros(5)))  # y's storage changes; v keeps the old
        g.output(g.call_function(torch.add, (v, 1)))

    fn, result, _, _ = straight_line(_module(build), (x,))
    torch.testing.assert_close(result, (x * 2).view(3, 4) + 1)
    torch.testing.assert_close(fn(x + 1), ((x + 1) * 2).view(3, 4) + 1)


def _first_dies_before_third(build) -> None:
    """Write the forward of ``build(g, first, second, third)`` and run it twice more.
    ``first`` doubles, ``second`` negates and ``third`` adds one, noting whether
    ``first``'s output is gone by then (the graph lets only ``second`` read it): it must
    be, in the writing call and in each call of the forward."""
    import weakref

    x = torch.randn(4, 8)
    made: list[weakref.ref] = []
    seen: list[bool] = []

    def double(a):
        out = a * 2
        made.append(weakref.ref(out))
        return out

    def probe(a):
        seen.append(made[-1]() is None)
        return a + 1

    kernels = (_Kernel("double", double, (x,)), _Kernel("neg", torch.neg, (x,)),
               _Kernel("probe", probe, (x,)))
    fn, result, _, complete = straight_line(_module(lambda g: build(g, *kernels)), (x,))
    assert complete
    torch.testing.assert_close(result, -(x * 2) + 1)
    for _ in range(2):
        y = torch.randn(4, 8)
        torch.testing.assert_close(fn(y), -(y * 2) + 1)
    assert seen == [True, True, True], seen  # the writing call, then the forward twice


def test_each_value_dies_after_the_last_op_that_reads_it() -> None:
    """A forward drops its intermediates as eager Python does: a training step's segment
    kept every activation and gradient alive until it returned (3x eager's peak memory).
    So does the call that writes it (a GPT-2 step's first kernel call peaked 1.5 GiB above
    the next ones)."""

    def build(g, first, second, third):
        a = g.placeholder("x")
        unused = g.call_function(torch.sin, (a,))  # read by nothing: dies where it is made
        del unused
        g.output(g.call_function(third, (g.call_function(second, (g.call_function(first, (a,)),)),)))

    _first_dies_before_third(build)


def test_the_writing_call_drops_a_value_once_its_views_are_made() -> None:
    """A chain of views is written where an op reads it, from the chain's first tensor:
    the writing call kept that tensor, and every view left unwritten (one nothing reads),
    until it returned. vit_b_16's writing call peaked at 5x eager's memory, every layer's
    activations kept by its attention's views."""

    def build(g, first, second, third):
        y = g.call_function(first, (g.placeholder("x"),))
        g.call_method("view", (y, -1))  # read by nothing: never written
        twice = g.call_method("transpose", (g.call_method("transpose", (y, 0, 1)), 0, 1))
        g.output(g.call_function(third, (g.call_function(second, (twice,)),)))

    _first_dies_before_third(build)


def test_release_frees_each_value_after_its_last_read():
    """_release finds each line's reads with a regex (parsing each line was 18 ms for a
    vit_b_16-sized forward). No value is freed before a line that reads it, by ast's
    reading; each one not returned is freed; a look-alike inside a string only makes a
    value live longer."""
    import ast
    import random

    from fxlite.codegen.runtime import straight_line as sl

    rng = random.Random(0)
    lines = ["    v1 = K0((a0,))"]
    for i in range(2, 60):
        args = ", ".join(f"v{rng.randint(max(1, i - 6), i - 1)}" for _ in range(2))
        lines.append(f"    v{i} = f{i % 4}({args}, dim=-1, shape=(3, {i}), mode='v{i - 3}')")
    lines.append("    return (v59, v3)")

    def reads(line):
        return {n.id for n in ast.walk(ast.parse(line.strip())) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Load) and sl._LOCAL.fullmatch(n.id)}

    out = sl._release(lines)
    assert [o.split(";  ")[0] for o in out] == lines
    last = {}
    for i, line in enumerate(lines):
        for name in reads(line):
            last[name] = i
    freed = {}
    for i, o in enumerate(out):
        for name in (o.split(";  ")[1].split(" = ")[:-1] if ";  " in o else []):
            assert name not in freed and i >= last.get(name, i), (name, i)
            freed[name] = i
    assert set(freed) == {f"v{i}" for i in range(1, 59) if i != 3}  # all but the returned


def test_a_straight_lines_lines_are_in_tracebacks_while_it_lives() -> None:
    # Before, every straight line was compiled as "<fxlite-straight-line>" with no source
    # lines: a traceback showed none, and compile._raised_before_writes could not tell a
    # write-back line that raised from an earlier op.
    import gc
    import linecache
    import traceback

    x = torch.randn(4, 8)

    def build(g):
        a = g.placeholder("x")
        g.output(g.call_function(torch.Tensor.view, (g.call_function(torch.relu, (a,)), 8, 4)))

    fn, _, _, _ = straight_line(_module(build), (x,))
    name = fn.__code__.co_filename
    assert name.startswith("<fxlite-straight-line-") and linecache.getlines(name)
    other, _, _, _ = straight_line(_module(build), (x,))
    assert other.__code__.co_filename != name  # each its own lines
    try:
        fn(torch.randn(4, 7))  # no view of 28 elements as 8 x 4
    except RuntimeError as e:
        lines = [f.line for f in traceback.extract_tb(e.__traceback__) if f.filename == name]
        assert lines and "(8, 4)" in lines[0], lines  # the line of the view (as strided)
    else:
        raise AssertionError("the view should have raised")
    del fn
    gc.collect()
    assert linecache.getlines(name) == []  # released with the function


def test_the_runner_checks_the_last_layout_first_and_keys_the_rest(monkeypatch) -> None:
    import fxlite.codegen.runtime.straight_line as sl

    keys = []
    real_key = sl.fast_key
    monkeypatch.setattr(sl, "fast_key", lambda args: keys.append(1) or real_key(args))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    add = _Kernel("add", torch.add, (x, y), (x.t(), y.t()))

    def build(g):
        g.output(g.call_function(add, (g.placeholder("a"), g.placeholder("b"))))

    run = StraightRunner(_module(build))
    flat = torch.randn(33)
    calls = [  # (arguments, whether the call computes the key)
        ((x, y), 1), ((x, y), 1), ((x, y), 0),  # written; keyed and kept; checked only
        ((x.t(), y.t()), 1), ((x.t(), y.t()), 1), ((x.t(), y.t()), 0),  # another layout
        ((x, y), 1), ((x.t(), y.t()), 1), ((x, y), 1),  # two layouts in turn
        ((flat[1:].view(4, 8), y), 1), ((flat[1:].view(4, 8), y), 1),  # not 16-aligned
        ((x.clone().requires_grad_(), y), 1),  # requires_grad: another layout
        ((x, x), 1),  # one tensor twice: torch's guard refuses it; (x, y)'s key serves
        ((x, y), 0)]
    for (a, b), keyed in calls:
        keys.clear()
        torch.testing.assert_close(run(a, b), a + b)
        assert len(keys) == keyed
    assert add.general_calls + add.fast_calls == len(calls)
    # an int: its range (the key's) is checked with the layout
    scaled = _Kernel("scaled", lambda a, k: a * k, (x, 3))

    def build_int(g):
        g.output(g.call_function(scaled, (g.placeholder("a"), g.placeholder("k"))))

    run = StraightRunner(_module(build_int))
    for k, keyed in ((3, 1), (3, 1), (5, 0), (2**40, 1), (3, 0)):
        keys.clear()
        torch.testing.assert_close(run(x, k), x * k)
        assert len(keys) == keyed, k
