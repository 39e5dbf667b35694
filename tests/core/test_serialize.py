"""fxlite.save / fxlite.load: round trips, no code from the file, and clear errors for bad files."""

from __future__ import annotations

import builtins
import copy
import json
import operator
import pickle
import struct

import pytest
import torch
import torch.nn.functional as F
from fxlite.passes import decompose, normalize, split_module
from torch import nn

import fxlite as fx
from fxlite.serialize import SerializationError, register
from fxlite.serialize import allowlist as serialize_allowlist
from fxlite.serialize import tensors as serialize_tensors


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.seq = nn.Sequential(nn.Linear(4, 8), nn.GELU(approximate="tanh"), nn.Linear(8, 4, bias=False))
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.bn = nn.BatchNorm1d(2)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("scale", torch.tensor(2.0))
        self.register_buffer("mask", torch.tensor([True, False, True, True]), persistent=False)
        self.half_bias = nn.Parameter(torch.randn(4).half(), requires_grad=False)

    def forward(self, ids, x, k: int = 2):
        h = self.ln(torch.relu(self.lin(x + self.emb(ids))))
        h = self.seq(h) * self.scale
        c = self.bn(self.conv(h.view(-1, 2, 2)))
        h = h + c.view(h.shape[0], -1).softmax(dim=-1) + x.shape[0] + self.half_bias.float()
        h = torch.where(self.mask, h, h.new_zeros(()))
        h = self.drop(h[:, :k][..., None].flatten(1))
        return F.pad(h, (0, 4 - h.shape[1])).to(torch.float64), {"mean": h.mean(dim=(0,))}


def _inputs():
    return torch.tensor([1, 2, 3]), torch.randn(3, 4)


def _round_trip(gm, tmp_path, name="m.fxl"):
    path = tmp_path / name
    fx.save(gm, path)
    return fx.load(path)


def _assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_round_trip_of_a_traced_model(tmp_path):
    m = Net()
    m.bn.eval()  # a submodule in eval mode, the rest training: both survive
    gm = fx.symbolic_trace(m)
    gm2 = _round_trip(gm, tmp_path)
    assert gm2.code == gm.code
    assert type(gm2).__name__ == "Net"
    assert [n.name for n in gm2.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert gm2.training and not gm2.bn.training and getattr(gm2.seq, "0").training
    assert gm2.half_bias.dtype == torch.float16 and not gm2.half_bias.requires_grad
    assert gm2.lin.weight.requires_grad and isinstance(gm2.lin.weight, nn.Parameter)
    assert "mask" not in gm2.state_dict() and torch.equal(gm2.mask, m.mask)  # non-persistent
    assert gm2.state_dict().keys() == gm.state_dict().keys()
    gm.eval()
    gm2.eval()
    ids, x = _inputs()
    _assert_same(gm2(ids, x), gm(ids, x))
    _assert_same(gm2(ids, x, 3), gm(ids, x, 3))


def test_round_trip_after_passes(tmp_path):
    m = Net().eval()
    gm = decompose(normalize(fx.symbolic_trace(m)))  # torch._C._nn.linear, Tensor.view, get_attr
    gm2 = _round_trip(gm, tmp_path)
    assert gm2.code == gm.code
    ids, x = _inputs()
    _assert_same(gm2(ids, x), gm(ids, x))


def test_round_trip_of_split_module_keeps_nested_graphs(tmp_path):
    m = Net().eval()
    gm = fx.symbolic_trace(m)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    parts = split_module(gm, gm, lambda n: 0 if order[n] < 8 else 1)
    gm2 = _round_trip(parts, tmp_path)
    assert isinstance(gm2.submod_0, fx.GraphModule) and gm2.submod_0.code == parts.submod_0.code
    ids, x = _inputs()
    _assert_same(gm2(ids, x), m(ids, x))


def test_tied_weights_stay_tied(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    gm2 = _round_trip(fx.symbolic_trace(Tied()), tmp_path)
    assert gm2.a.weight is gm2.b.weight


def test_constants_and_odd_values(tmp_path):
    g = fx.Graph()
    x = g.placeholder("x")
    t = g.get_attr("const")
    y = g.call_function(torch.add, (x, t), {"alpha": 2})
    y = g.call_method("to", (y,), {"dtype": torch.float64, "memory_format": torch.contiguous_format})
    y = g.call_function(operator.getitem, (y, (slice(None, None, -1) if False else slice(0, 2), ..., None)))
    z = g.call_function(torch.full, ((2,), float("-inf")), {"device": torch.device("cpu")})
    w = g.call_function(torch.tensor, ([complex(1, 2), 3j],))
    g.output((y, z, w, torch.Size([2, 3])))
    gm = fx.GraphModule({"const": torch.arange(3.0)}, g)
    gm2 = _round_trip(gm, tmp_path)
    x = torch.randn(3)
    out, out2 = gm(x), gm2(x)
    _assert_same(out2[:3], out[:3])
    assert type(out[3]) is torch.Size and type(out2[3]) is torch.Size and out2[3] == out[3]


def test_odd_attribute_names(tmp_path):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("__secret", torch.tensor([2.0]))
            self.register_parameter("class", nn.Parameter(torch.tensor([3.0])))
            self.add_module("my-mod", nn.ReLU())
            self.register_buffer("it's", torch.tensor([1.0]))

        def forward(self, x):
            h = getattr(self, "my-mod")(x * getattr(self, "__secret") + getattr(self, "class"))
            return h - getattr(self, "it's")

    m = Odd()
    gm2 = _round_trip(fx.symbolic_trace(m), tmp_path)
    x = torch.tensor([-4.0, 1.0])
    _assert_same(gm2(x), m(x))


def test_deeply_nested_argument(tmp_path):
    g = fx.Graph()
    x = g.placeholder("x")
    deep = x
    for _ in range(3000):
        deep = [{"k": (deep,)}]
    g.output(g.call_function(operator.getitem, (deep, 0)))
    gm = fx.GraphModule(nn.Module(), g)
    gm2 = _round_trip(gm, tmp_path)
    out = gm2(torch.ones(1))
    for _ in range(2999):
        out = out["k"][0][0]
    assert torch.equal(out["k"][0], torch.ones(1))


# ---------------------------------------------------------------------- no code from the file
def test_load_never_calls_eval_exec_or_pickle(tmp_path, monkeypatch):
    m = Net().eval()
    gm = fx.symbolic_trace(m)
    path = tmp_path / "m.fxl"
    fx.save(gm, path)
    calls = []

    def forbidden(name):
        def refuse(*a, **k):
            calls.append(name)
            raise AssertionError(f"fxlite.load called {name}")
        return refuse

    with monkeypatch.context() as mp:
        for name in ("eval", "exec", "compile"):
            mp.setattr(builtins, name, forbidden(name))
        for name in ("load", "loads", "Unpickler"):
            mp.setattr(pickle, name, forbidden(f"pickle.{name}"))
        mp.setattr(torch, "load", forbidden("torch.load"))
        gm2 = fx.load(path)
    assert calls == []
    ids, x = _inputs()
    _assert_same(gm2(ids, x), m(ids, x))  # forward is generated by fxlite on first call


# ---------------------------------------------------------------------- what save refuses
def my_op(x):
    return x * 3


fx.wrap("my_op")


class Scale(nn.Module):
    def __init__(self, factor: float = 1.0):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class UsesCustom(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = Scale(4.0)

    def forward(self, x):
        return my_op(self.scale(x))


class LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, Scale) or super().is_leaf_module(m, qualname)


def _custom_gm():
    m = UsesCustom()
    return m, fx.GraphModule(m, LeafTracer().trace(m))


@pytest.fixture
def clean_registry():
    saved = dict(serialize_allowlist._REGISTERED), dict(serialize_allowlist._REGISTERED_NAMES)
    yield
    serialize_allowlist._REGISTERED.clear()
    serialize_allowlist._REGISTERED.update(saved[0])
    serialize_allowlist._REGISTERED_NAMES.clear()
    serialize_allowlist._REGISTERED_NAMES.update(saved[1])


def test_unknown_function_and_module_are_refused_until_registered(tmp_path, clean_registry):
    m, gm = _custom_gm()
    with pytest.raises(SerializationError, match=r"node 'my_op' calls .*my_op.*register"):
        fx.save(gm, tmp_path / "a.fxl")
    register(my_op)
    with pytest.raises(SerializationError, match=r"submodule 'scale' is a .*Scale.*register"):
        fx.save(gm, tmp_path / "a.fxl")
    register(Scale)
    fx.save(gm, tmp_path / "a.fxl")
    gm2 = fx.load(tmp_path / "a.fxl")
    x = torch.randn(2)
    _assert_same(gm2(x), m(x))
    # A program that did not register them refuses the file, naming the target.
    serialize_allowlist._REGISTERED.clear()
    serialize_allowlist._REGISTERED_NAMES.clear()
    with pytest.raises(SerializationError, match=r"Scale' is not in the allowlist"):
        fx.load(tmp_path / "a.fxl")


def test_module_that_cannot_be_rebuilt_is_refused(tmp_path):
    class W(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, add_bias_kv=True)

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_module("attn", (x, x, x)))
    with pytest.raises(SerializationError, match="'attn'.*cannot be rebuilt.*bias_k"):
        fx.save(fx.GraphModule(W(), g), tmp_path / "a.fxl")


def test_constant_without_a_safe_form_is_refused(tmp_path):
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.add, (x, object())))
    with pytest.raises(SerializationError, match="node 'add' holds a builtins.object"):
        fx.save(fx.GraphModule(nn.Module(), g), tmp_path / "a.fxl")


def test_cyclic_graph_is_refused_with_the_node_named(tmp_path):
    gm = fx.symbolic_trace(lambda x: torch.relu(x + 1))
    add, relu = list(gm.graph.nodes)[1:3]
    add.args = (relu, 1)
    with pytest.raises(RuntimeError, match="node 'add'.*reads 'relu'"):
        fx.save(gm, tmp_path / "a.fxl")


# ---------------------------------------------------------------------- crafted, truncated, edited
def _saved(tmp_path):
    gm = fx.symbolic_trace(lambda x: torch.relu(x.sum(dim=0)) + x.shape[0])
    path = tmp_path / "m.fxl"
    fx.save(gm, path)
    graph, tensors = serialize_tensors.read(path)
    return path, json.loads(graph), tensors


def _rewrite(path, doc, tensors):
    """What an attacker can do: write any graph, with a valid checksum."""
    serialize_tensors.write(path, json.dumps(doc), tensors)


def _nodes(doc):
    return {n["name"]: n for n in doc["root"]["nodes"]}


def _args(doc, name):
    return _nodes(doc)[name]["args"]["tuple"]


@pytest.mark.parametrize("edit, message", [
    (lambda d: _nodes(d)["relu"].update(target="os.system"), "unknown target 'os.system'"),
    (lambda d: _nodes(d)["relu"].update(target="torch.load"), "unknown target 'torch.load'"),
    (lambda d: _nodes(d)["relu"].update(target="operator.call"), "unknown target 'operator.call'"),
    (lambda d: _nodes(d)["relu"].update(target="my.fn", registered=True), "register it"),
    (lambda d: _nodes(d)["sum_1"].update(target="__reduce_ex__"), "method '__reduce_ex__' is not"),
    (lambda d: _nodes(d)["sum_1"].update(target="storage"), "method 'storage' is not"),
    (lambda d: _args(d, "getattr_1").__setitem__(1, "__class__"), "public Tensor attribute"),
    (lambda d: _nodes(d)["relu"].update(op="call_eval"), "unknown op 'call_eval'"),
    (lambda d: _args(d, "relu").__setitem__(0, {"node": "add"}), "reads node 'add', which is not defined"),
    (lambda d: _args(d, "relu").__setitem__(0, {"pickle": "x"}), "cannot read the value"),
    (lambda d: _args(d, "relu").__setitem__(0, {"function": "os.system"}), "cannot read the value"),
    (lambda d: _args(d, "relu").__setitem__(0, {"tensor": "t99"}), "no tensor 't99'"),
    (lambda d: d["root"].update(kind="module", **{"class": "subprocess.Popen"}), "'subprocess.Popen' is not in the allowlist"),
    (lambda d: d.update(version=99), "format version 99"),
    (lambda d: d["root"]["constants"].update(_parameters=1), "bad attribute name '_parameters'"),
    (lambda d: d["root"]["constants"].update(__class__=1), "bad attribute name '__class__'"),
    (lambda d: d["root"]["nodes"].pop(), "output"),
], ids=["os.system", "torch.load", "operator.call", "unregistered", "dunder-method", "storage-method",
        "getattr-dunder", "op", "forward-ref", "unknown-tag", "function-value", "tensor-key",
        "module-class", "version", "module-internal", "dunder", "no-output"])
def test_crafted_file_is_refused_naming_the_problem(tmp_path, edit, message):
    path, doc, tensors = _saved(tmp_path)
    edit(doc)
    _rewrite(path, doc, tensors)
    with pytest.raises(SerializationError, match=message.replace("(", r"\(")) as info:
        fx.load(path)
    assert str(path) in str(info.value)


def test_truncated_file_is_refused(tmp_path):
    m = nn.Linear(64, 64)
    gm = fx.symbolic_trace(m)
    path = tmp_path / "m.fxl"
    fx.save(gm, path)
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    for cut, message in [(0, "too short"), (5, "too short"), (8 + size // 2, "truncated"),
                         (8 + size + 100, "past the end of the file"), (len(blob) - 1, "past the end")]:
        path.write_bytes(blob[:cut])
        with pytest.raises(SerializationError, match=message):
            fx.load(path)


def test_edited_file_is_refused(tmp_path):
    gm = fx.symbolic_trace(nn.Linear(4, 4))
    path = tmp_path / "m.fxl"
    fx.save(gm, path)
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x40  # one bit of one weight
    path.write_bytes(bytes(blob))
    with pytest.raises(SerializationError, match="checksum mismatch"):
        fx.load(path)
    text = bytes(blob).replace(b'"linear"', b'"lineaR"', 1)  # the graph, same length
    path.write_bytes(text)
    with pytest.raises(SerializationError, match="checksum mismatch"):
        fx.load(path)
    blob[8] = ord("x")  # break the JSON header
    path.write_bytes(bytes(blob))
    with pytest.raises(SerializationError, match="header is not valid JSON"):
        fx.load(path)


def test_not_an_fxlite_file(tmp_path):
    path = tmp_path / "x.fxl"
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    with pytest.raises(SerializationError, match="no __metadata__"):
        fx.load(path)
    path.write_bytes(b"\x80\x04\x95" + b"\0" * 64)  # a pickle
    with pytest.raises(SerializationError, match="truncated or not an fxlite file"):
        fx.load(path)


def test_safetensors_library_reads_the_tensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    m = nn.Linear(3, 2)
    gm = fx.symbolic_trace(m)
    fx.save(gm, tmp_path / "m.fxl")
    tensors = st.load_file(str(tmp_path / "m.fxl"))
    assert sorted(t.shape for t in tensors.values()) == sorted([m.weight.shape, m.bias.shape])


def test_save_does_not_change_the_module(tmp_path):
    m = Net()
    gm = fx.symbolic_trace(m)
    before = copy.deepcopy(gm.state_dict()), gm.code
    fx.save(gm, tmp_path / "m.fxl")
    after = gm.state_dict()
    assert all(torch.equal(before[0][k], after[k]) for k in after) and gm.code == before[1]
