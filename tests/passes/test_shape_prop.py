"""ShapeProp: the fx.rst hand-written example, fxlite.passes.ShapeProp, and tabular views."""

from __future__ import annotations

import operator
import pickle
from typing import Dict  # noqa: UP035 - the fx.rst example, as written

import pytest
import torch
from fxlite.passes import ShapeProp, TensorMetadata, extract_tensor_metadata

import fxlite
import fxlite as fx
from fxlite.interpreter import Interpreter
from fxlite.node import Node


class DocShapeProp:
    """The ShapeProp class of fx.rst ("The Interpreter Pattern"), with torch.fx -> fxlite."""

    def __init__(self, mod):
        self.mod = mod
        self.graph = mod.graph
        self.modules = dict(self.mod.named_modules())

    def propagate(self, *args):
        args_iter = iter(args)
        env : Dict[str, Node] = {}  # noqa: UP006

        def load_arg(a):
            return fxlite.graph.map_arg(a, lambda n: env[n.name])

        def fetch_attr(target : str):
            target_atoms = target.split('.')
            attr_itr = self.mod
            for i, atom in enumerate(target_atoms):
                if not hasattr(attr_itr, atom):
                    raise RuntimeError(f"Node referenced nonexistant target {'.'.join(target_atoms[:i])}")
                attr_itr = getattr(attr_itr, atom)
            return attr_itr

        for node in self.graph.nodes:
            if node.op == 'placeholder':
                result = next(args_iter)
            elif node.op == 'get_attr':
                result = fetch_attr(node.target)
            elif node.op == 'call_function':
                result = node.target(*load_arg(node.args), **load_arg(node.kwargs))
            elif node.op == 'call_method':
                self_obj, *args = load_arg(node.args)
                kwargs = load_arg(node.kwargs)
                result = getattr(self_obj, node.target)(*args, **kwargs)
            elif node.op == 'call_module':
                result = self.modules[node.target](*load_arg(node.args), **load_arg(node.kwargs))

            # This is the only code specific to shape propagation.
            # you can delete this `if` branch and this becomes
            # a generic GraphModule interpreter.
            if isinstance(result, torch.Tensor):
                node.shape = result.shape
                node.dtype = result.dtype

            env[node.name] = result

        return load_arg(self.graph.result)


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 6)
        self.bias = torch.nn.Parameter(torch.zeros(6))

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        h = h.mean(dim=(2, 3))
        h = self.fc(h) + self.bias
        return h.to(torch.float64).softmax(-1)


@pytest.fixture
def conv_gm():
    return fx.symbolic_trace(ConvNet().eval())


def test_doc_shape_prop_example_runs(conv_gm):
    x = torch.randn(2, 3, 8, 8)
    out = DocShapeProp(conv_gm).propagate(x)
    torch.testing.assert_close(out, conv_gm(x))
    for node in conv_gm.graph.nodes:
        if node.op != "output":
            assert isinstance(node.shape, torch.Size) and isinstance(node.dtype, torch.dtype)
    assert conv_gm.graph.result.dtype == torch.float64


def test_shape_prop_agrees_with_doc_example_and_eager(conv_gm):
    x = torch.randn(2, 3, 8, 8)
    DocShapeProp(conv_gm).propagate(x)
    out = ShapeProp(conv_gm).propagate(x)
    torch.testing.assert_close(out, conv_gm(x))
    for node in conv_gm.graph.nodes:
        if node.op == "output":
            continue
        tm = node.meta["tensor_meta"]
        assert isinstance(tm, TensorMetadata)
        assert (tm.shape, tm.dtype) == (node.shape, node.dtype)
        assert node.meta["type"] is torch.Tensor or issubclass(node.meta["type"], torch.Tensor)
    out_meta = conv_gm.graph.output_node().meta["tensor_meta"]
    assert (out_meta.shape, out_meta.dtype) == (out.shape, out.dtype)


def test_strides_requires_grad_and_memory_formats():
    def f(x, y, z):
        return x.t(), y + 1, z * 2, x.sum()

    gm = fx.symbolic_trace(f)
    x = torch.randn(3, 5, requires_grad=True)
    y = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    z = torch.randn(2, 3, 2, 4, 5).to(memory_format=torch.channels_last_3d)
    ShapeProp(gm).propagate(x, y, z)
    meta = {n.name: n.meta["tensor_meta"] for n in gm.graph.nodes if n.op != "output"}
    assert meta["x"].memory_format == torch.contiguous_format and meta["x"].stride == (5, 1)
    assert meta["x"].requires_grad
    assert meta["t"].memory_format is None and meta["t"].stride == x.t().stride()
    assert meta["t"].requires_grad and not meta["add"].requires_grad
    assert meta["y"].memory_format == torch.channels_last and meta["y"].stride == y.stride()
    assert (y + 1).is_contiguous(memory_format=torch.channels_last)  # eager keeps the format
    assert meta["add"].memory_format == torch.channels_last and meta["add"].stride == (y + 1).stride()
    assert meta["z"].memory_format == torch.channels_last_3d
    assert meta["sum_1"].shape == torch.Size([]) and meta["sum_1"].stride == ()
    assert not meta["x"].is_quantized and meta["x"].qparams == {}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool])
def test_dtypes_follow_eager(dtype):
    def f(x):
        return (x + x).sum(0), x.to(torch.float32) * 2

    gm = fx.symbolic_trace(f)
    x = (torch.arange(6).reshape(2, 3) % 2).to(dtype)
    ShapeProp(gm).propagate(x)
    eager = f(x)
    out_meta = gm.graph.output_node().meta["tensor_meta"]
    assert [(m.shape, m.dtype) for m in out_meta] == [(t.shape, t.dtype) for t in eager]


def test_nested_outputs_get_matching_structure():
    def f(x):
        a, b = torch.split(x, 2)
        top = torch.topk(x, 1, dim=0)
        return (a, [b, x.shape[0]], {"v": top.values, "n": None})

    gm = fx.symbolic_trace(f)
    x = torch.randn(4, 3)
    ShapeProp(gm).propagate(x)
    nodes = {n.name: n for n in gm.graph.nodes}
    split_meta = nodes["split"].meta["tensor_meta"]
    assert isinstance(split_meta, tuple) and len(split_meta) == 2
    assert all(isinstance(m, TensorMetadata) and m.shape == (2, 3) for m in split_meta)
    assert nodes["split"].meta["type"] is tuple

    out = gm.graph.output_node().meta["tensor_meta"]
    a_meta, (b_meta, n0), d = out
    assert isinstance(out, tuple) and isinstance(out[1], list) and isinstance(d, dict)
    assert a_meta.shape == b_meta.shape == (2, 3)
    assert n0 == 4 and d["n"] is None and d["v"].shape == (1, 3)

    # Values holding no tensor record no tensor_meta, only their type.
    int_nodes = [n for n in gm.graph.nodes if n.meta.get("type") is int]
    assert int_nodes and all("tensor_meta" not in n.meta for n in int_nodes)


def test_stale_tensor_meta_is_removed_on_rerun():
    gm = fx.symbolic_trace(lambda x: x * 2)
    ShapeProp(gm).propagate(torch.ones(3))
    assert "tensor_meta" in gm.graph.output_node().meta
    ShapeProp(gm).propagate(5)
    assert "tensor_meta" not in gm.graph.output_node().meta
    assert gm.graph.output_node().meta["type"] is int


@pytest.mark.filterwarnings("ignore:.*quantize.*deprecated:UserWarning")
def test_quantized_tensor_metadata():
    q = torch.quantize_per_tensor(torch.randn(4), scale=0.5, zero_point=3, dtype=torch.quint8)
    m = extract_tensor_metadata(q)
    assert m.is_quantized and m.dtype == torch.quint8
    assert m.qparams == {"qscheme": torch.per_tensor_affine, "scale": 0.5, "zero_point": 3}
    qc = torch.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]),
                                    torch.tensor([0, 1]), axis=0, dtype=torch.qint8)
    mc = extract_tensor_metadata(qc)
    assert mc.qparams["axis"] == 0 and mc.qparams["zero_point"] == [0, 1]
    assert mc.qparams["scale"] == pytest.approx([0.1, 0.2])


def test_metadata_pickled_before_it_moved_to_the_core_still_loads():
    # TensorMetadata pickles through its rebuild function, which lived in passes/shape_prop.py
    # until issue 37 moved the class to fxlite/tensor_meta.py; pickles made before name it there.
    m = extract_tensor_metadata(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    data = pickle.dumps(m, protocol=2)  # torch.save's protocol: globals are plain text
    old = data.replace(b"cfxlite.tensor_meta\nrebuild_tensor_metadata\n",
                       b"cfxlite.passes.shape_prop\n_rebuild_tensor_metadata\n")
    assert old != data
    assert pickle.loads(old) == pickle.loads(data) == m
    assert pickle.loads(old).memory_format is torch.channels_last


def test_shape_prop_is_an_interpreter(conv_gm):
    assert issubclass(ShapeProp, Interpreter)
    sp = ShapeProp(conv_gm)
    sp.propagate(torch.randn(1, 3, 4, 4))
    assert [n.op for n in sp.env] == ["output"]  # values were freed as it went


# ---------------------------------------------------------------------- tables
def test_print_tabular_shows_shape_and_dtype_after_shape_prop(conv_gm, capsys):
    conv_gm.graph.print_tabular()
    plain = capsys.readouterr().out
    assert "shape" not in plain.splitlines()[0]

    ShapeProp(conv_gm).propagate(torch.randn(2, 3, 8, 8))
    conv_gm.graph.print_tabular()
    table = capsys.readouterr().out
    header = table.splitlines()[0].split()
    assert header[-2:] == ["shape", "dtype"]
    rows = {line.split()[1]: line for line in table.splitlines()[2:]}
    fc = next(n for n in conv_gm.graph.nodes if n.target == "fc")
    assert str(tuple(fc.meta["tensor_meta"].shape)) in rows["fc"]
    assert rows["fc"].rstrip().endswith("float32")
    assert rows["softmax"].rstrip().endswith("float64")


def test_repr_html_is_a_table(conv_gm):
    ShapeProp(conv_gm).propagate(torch.randn(1, 3, 4, 4))
    html = conv_gm.graph._repr_html_()
    assert "<table>" in html and "</table>" in html
    assert html.count("<tr>") == len(conv_gm.graph.nodes) + 1  # header + one row per node
    assert "float32" in html and "<th>shape" in html.replace(" ", "")
    assert conv_gm._repr_html_() == html


# ---------------------------------------------------------------- fill_missing_meta
# The one meta-tensor evaluator: the pass library calls it leniently (fuse, after
# decompose), the compiler strictly (codegen/lower/pipeline.propagate_meta).

from fxlite.passes.shape_prop import fill_missing_meta  # noqa: E402


def _softmax_decomposed(x: torch.Tensor) -> fxlite.GraphModule:
    from fxlite.passes.decompose import decompose
    gm = fx.symbolic_trace(lambda x: torch.softmax(x, -1) * x.size(0))
    ShapeProp(gm).propagate(x)
    return decompose(gm)


def test_new_nodes_get_the_metadata_eager_would_give():
    x = torch.randn(4, 6, dtype=torch.float64)
    gm = _softmax_decomposed(x)
    new = [n for n in gm.graph.nodes if n.op == "call_function" and "tensor_meta" not in n.meta]
    assert new, "decompose added no node"
    fill_missing_meta(gm)
    for n in new:
        tm = n.meta["tensor_meta"]
        assert n.meta["type"] is torch.Tensor
        assert tm.dtype == torch.float64 and tm.shape[0] == 4
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out.meta["tensor_meta"].shape == gm(x).shape


def test_a_size_read_is_run_for_its_value_and_an_effect_is_not_repeated():
    """``x.size(0)`` has a type and no tensor_meta: its value feeds the new ``view``. The
    in-place ``_foreach_add_`` was recorded returning None (as ``fxlite.compile`` records
    it) and returns a list on meta tensors; run again it would get a tensor_meta it never
    had (which made a compiled training step update its weights wrongly)."""
    def f(x, counters):
        torch._foreach_add_(counters, 1)
        return x.view(x.size(0), -1)

    gm = fx.symbolic_trace(f)
    x, counters = torch.randn(2, 3, 4), [torch.zeros((), dtype=torch.int64)]
    ShapeProp(gm).propagate(x, counters)
    foreach = next(n for n in gm.graph.nodes if n.target is torch._foreach_add_)
    foreach.meta.pop("tensor_meta", None)
    foreach.meta["type"] = type(None)
    view = next(n for n in gm.graph.nodes if n.target == "view")
    del view.meta["tensor_meta"], view.meta["type"]  # as a pass would leave a new node
    fill_missing_meta(gm, strict=True)
    assert view.meta["tensor_meta"].shape == (2, 12)
    assert foreach.meta["type"] is type(None) and "tensor_meta" not in foreach.meta


def test_an_op_meta_tensors_cannot_run_is_unknown_or_raises_with_strict():
    def f(x):
        return x + x.sum().item()

    gm = fx.symbolic_trace(f)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["tensor_meta"] = extract_tensor_metadata(torch.randn(3))
    fill_missing_meta(gm)
    item = next(n for n in gm.graph.nodes if n.target == "item")
    add = next(n for n in gm.graph.nodes if n.target is operator.add)
    assert "type" not in item.meta and "tensor_meta" not in add.meta
    with pytest.raises(RuntimeError, match=r"cannot infer the metadata of .*item"):
        fill_missing_meta(gm, strict=True)


def test_attributes_are_read_and_grad_mode_is_restored():
    """A recorded ``torch.no_grad()`` changes grad mode for the nodes after it, and for
    them only: the caller's mode is back afterwards."""
    root = torch.nn.Module()
    root.register_buffer("scale", torch.ones(5, dtype=torch.float16))
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["tensor_meta"] = extract_tensor_metadata(torch.randn(2, 5, requires_grad=True))
    graph.call_function(torch._C._set_grad_enabled, (False,))
    mul = graph.call_function(operator.mul, (x, graph.get_attr("scale")))
    graph.output(mul)
    gm = fx.GraphModule(root, graph)
    assert torch.is_grad_enabled()
    fill_missing_meta(gm, strict=True)
    assert torch.is_grad_enabled()
    tm = mul.meta["tensor_meta"]
    assert (tm.shape, tm.dtype, tm.requires_grad) == ((2, 5), torch.float32, False)
