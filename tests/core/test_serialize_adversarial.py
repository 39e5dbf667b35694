"""fxlite.load against files written by an attacker (issue 36).

Each hostile file is a real fxlite file with a valid checksum (``serialize_tensors.write``
re-signs whatever we put in it), so what refuses it is load's own checks, not the checksum.
Every refusal is a SerializationError naming the node or module and the field; every hostile
load runs under a sentinel that records eval/exec/compile of anything but fxlite's own
forward, os.system, subprocess and pickle, and compares the process's global state before
and after.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from torch import nn

import fxlite as fx
from fxlite.graph_module import GraphModule
from fxlite.serialize import Limits, SerializationError
from fxlite.serialize import allowlist as serialize_allowlist
from fxlite.serialize import tensors as serialize_tensors


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        h = self.seq(self.lin(x) * self.scale)
        return self.bn(h).sum(dim=-1) + x.shape[0]


@pytest.fixture
def saved(tmp_path):
    """A valid file, its graph document and its tensors, ready to be edited."""
    path = tmp_path / "m.fxl"
    fx.save(fx.symbolic_trace(Small()), path)
    text, tensors = serialize_tensors.read(path)
    return path, json.loads(text), tensors


def _rewrite(path, doc, tensors):
    serialize_tensors.write(path, json.dumps(doc), tensors)


def _node(doc, name):
    return next(n for n in doc["root"]["nodes"] if n["name"] == name)


def _insert(doc, rec):
    """Put a node record just before the output."""
    rec = {"args": {"tuple": []}, "kwargs": {"dict": []}, **rec}
    doc["root"]["nodes"].insert(len(doc["root"]["nodes"]) - 1, rec)


def _functions(obj):
    return {k: (v.__defaults__, v.__kwdefaults__, v.__code__) for k, v in vars(obj).items()
            if callable(v) and hasattr(v, "__code__")}


def _global_state():
    return {
        "GraphModule": dict(vars(GraphModule)), "GraphModule functions": _functions(GraphModule),
        "Module": dict(vars(nn.Module)), "Module functions": _functions(nn.Module),
        "Linear": dict(vars(nn.Linear)), "Linear functions": _functions(nn.Linear),
        "builtins": dict(vars(builtins)), "default dtype": torch.get_default_dtype(),
        "default device": torch.get_default_device(), "grad": torch.is_grad_enabled(),
        "gc": gc.isenabled(), "recursion limit": sys.getrecursionlimit(),
        "registered": serialize_allowlist.registered(), "cwd": os.getcwd(),
        "environ": dict(os.environ), "threads": threading.active_count(),
    }


def _importing() -> bool:
    """Is a module being imported? Torch imports parts of itself lazily (torch._dynamo, on a
    meta kernel's first error), and an import execs that module's own code: not the file's,
    which cannot name a module to import."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.startswith("<frozen importlib"):
            return True
        f = f.f_back
    return False


@contextlib.contextmanager
def _watched():
    """Record any code execution and fail on any change to global state."""
    before = _global_state()
    calls = []
    real_exec, real_compile = builtins.exec, builtins.compile

    def ours(filename):
        return isinstance(filename, str) and filename.startswith("<fxlite-forward")

    def record(name, during_imports=False):
        real = getattr(builtins, name, None)

        def fn(*args, **kwargs):
            if during_imports and _importing():
                return real(*args, **kwargs)
            calls.append(name)
            raise AssertionError(f"{name} was called")
        return fn

    def guarded_compile(source, filename, *args, **kwargs):
        if not ours(filename) and not _importing():
            calls.append(f"compile {filename!r}")
        return real_compile(source, filename, *args, **kwargs)

    def guarded_exec(code, *args, **kwargs):
        if not ours(getattr(code, "co_filename", None)) and not _importing():
            calls.append("exec")
        return real_exec(code, *args, **kwargs)

    patches = [(builtins, "eval", record("eval", during_imports=True)), (builtins, "exec", guarded_exec),
               (builtins, "compile", guarded_compile), (os, "system", record("os.system")),
               (os, "popen", record("os.popen")), (subprocess, "Popen", record("subprocess.Popen")),
               (pickle, "loads", record("pickle.loads")), (pickle, "load", record("pickle.load")),
               (torch, "load", record("torch.load"))]
    saved_attrs = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        yield calls
    finally:
        for obj, name, fn in saved_attrs:
            setattr(obj, name, fn)
    assert calls == [], f"code ran: {calls}"
    after = _global_state()
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"global state changed: {changed}"


def _refused(path, match, limits=None):
    """load refuses ``path`` with a SerializationError matching ``match`` (a regex), runs no
    code, changes nothing global."""
    with _watched(), pytest.raises(SerializationError, match=match) as info:
        gm = fx.load(path, limits=limits)
        gm(torch.randn(2, 4))  # not reached; if it were, the sentinel watches the call too
    assert str(path) in str(info.value)
    return info.value


# ---------------------------------------------------------------------- get_attr / call_module targets
HOSTILE_GET_ATTR = [
    "__class__", "__dict__", "__init__", "__class__.__init__.__defaults__",
    "forward.__globals__", "forward.__func__.__globals__", "__init__.__globals__",
    "_modules", "_parameters", "_buffers", "training", "forward", "state_dict",
    "lin.__dict__", "lin.forward", "lin.weight.__class__", "lin.weight.data", "lin.weight.T",
    "lin.in_features", "lin._parameters", "scale.__reduce_ex__", "seq.__getitem__",
    "seq.0.forward.__globals__", "missing", "seq.5", "", ".", "lin..weight", "lin.", ".lin",
    "graph", "code", "meta",
]


@pytest.mark.parametrize("target", HOSTILE_GET_ATTR)
def test_get_attr_target_outside_the_module_tree_is_refused(saved, target):
    path, doc, tensors = saved
    _insert(doc, {"name": "evil", "op": "get_attr", "target": target})
    _rewrite(path, doc, tensors)
    _refused(path, r"node 'evil': field 'target'")


@pytest.mark.parametrize("target", [
    "scale", "lin.weight", "lin.bias", "bn.running_mean", "forward", "__class__",
    "lin.__class__", "seq.0.__call__", "seq.__getitem__", "_modules.lin", "eval",
])
def test_call_module_target_that_is_not_a_stored_module_is_refused(saved, target):
    path, doc, tensors = saved
    _node(doc, "lin")["target"] = target
    _rewrite(path, doc, tensors)
    _refused(path, r"node 'lin': field 'target'")


def test_the_globals_chain_of_the_audit_is_refused(saved):
    # The audit's shape: a module path into a function's globals, a lookup of eval, and an
    # allowed builtin that calls what it is given (max's key).
    path, doc, tensors = saved
    _insert(doc, {"name": "g", "op": "call_module", "target": "forward.__globals__.get",
                  "args": {"tuple": ["__builtins__"]}})
    _insert(doc, {"name": "e", "op": "call_function", "target": "operator.getitem",
                  "args": {"tuple": [{"node": "g"}, "eval"]}})
    _insert(doc, {"name": "m", "op": "call_function", "target": "builtins.max",
                  "args": {"tuple": [["1", "2"]]}, "kwargs": {"dict": [["key", {"node": "e"}]]}})
    _rewrite(path, doc, tensors)
    _refused(path, r"node 'g': field 'target' 'forward.__globals__.get'")


def test_the_defaults_of_graph_module_init_are_left_alone(saved):
    path, doc, tensors = saved
    defaults = GraphModule.__init__.__defaults__
    _insert(doc, {"name": "d", "op": "get_attr", "target": "__class__.__init__.__defaults__"})
    _rewrite(path, doc, tensors)
    _refused(path, r"node 'd': field 'target'")
    assert GraphModule.__init__.__defaults__ == defaults == ("GraphModule",)


# ---------------------------------------------------------------------- allowlists
@pytest.mark.parametrize("target", [
    "builtins.eval", "builtins.exec", "builtins.compile", "builtins.__import__", "builtins.open",
    "builtins.setattr", "os.system", "subprocess.run", "pickle.loads", "torch.load", "torch.save",
    "torch.from_file", "torch.hub.load", "operator.attrgetter", "operator.methodcaller",
    "operator.call", "torch.Tensor.register_hook", "torch.Tensor.apply_", "math.__loader__",
    "importlib.import_module", "fxlite.serialize.load",
])
def test_call_function_outside_the_allowlist_is_refused(saved, target):
    path, doc, tensors = saved
    _node(doc, "mul")["target"] = target
    _rewrite(path, doc, tensors)
    _refused(path, r"node 'mul': unknown target")


@pytest.mark.parametrize("method", [
    "__reduce_ex__", "__class__", "__setattr__", "__init__", "__getattribute__", "storage",
    "untyped_storage", "apply_", "map_", "register_hook", "share_memory_", "data_ptr",
])
def test_call_method_outside_the_allowlist_is_refused(saved, method):
    path, doc, tensors = saved
    _node(doc, "sum_1")["target"] = method
    _rewrite(path, doc, tensors)
    _refused(path, r"node 'sum_1': method .* is not an allowed Tensor method")


@pytest.mark.parametrize("attr", ["__class__", "__dict__", "_base", "storage", "__init__"])
def test_getattr_of_a_private_tensor_attribute_is_refused(saved, attr):
    path, doc, tensors = saved
    _node(doc, "getattr_1")["args"]["tuple"][1] = attr
    _rewrite(path, doc, tensors)
    _refused(path, r"node 'getattr_1': getattr may only read a public Tensor attribute")


@pytest.mark.parametrize("value", [
    {"function": "builtins.eval"}, {"function": "os.system"}, {"registered": "os.system"},
    {"function": "torch.load"}, {"pickle": "gASV"}, {"dtype": "__class__"}, {"device": "cpu:-7"},
])
def test_a_value_outside_the_allowlist_is_refused(saved, value):
    path, doc, tensors = saved
    _node(doc, "add")["args"]["tuple"][1] = value
    _rewrite(path, doc, tensors)
    _refused(path, r"node 'add': cannot read the value")


@pytest.mark.parametrize("cls", [
    "subprocess.Popen", "builtins.eval", "torch.nn.Module.__subclasses__", "fxlite.GraphModule",
    "torch.nn.modules.module.Module",
])
def test_a_module_class_outside_the_allowlist_is_refused(saved, cls):
    path, doc, tensors = saved
    doc["root"]["children"]["lin"]["class"] = cls
    _rewrite(path, doc, tensors)
    _refused(path, r"module 'lin': module class .* is not in the allowlist")


@pytest.mark.parametrize("name", [
    "__class__", "__dict__", "_parameters", "_modules", "forward", "training", "meta", "graph",
    "code", "eval", "recompile", "a.b",
])
def test_an_attribute_name_that_would_shadow_internals_is_refused(saved, name):
    path, doc, tensors = saved
    doc["root"]["constants"][name] = 1
    _rewrite(path, doc, tensors)
    _refused(path, r"bad attribute name")


def test_one_name_for_two_things_is_refused(saved):
    path, doc, tensors = saved
    doc["root"]["constants"]["lin"] = 3
    _rewrite(path, doc, tensors)
    _refused(path, r"'lin' names two things")


@pytest.mark.parametrize("node, args, message", [
    ("output", {"tuple": [{"node": "add"}, {"node": "add"}]}, "a node of op 'output' cannot take 2 args"),
    ("sum_1", {"tuple": []}, "a node of op 'call_method' cannot take 0 args"),
    ("scale", {"tuple": [1]}, "a node of op 'get_attr' cannot take 1 args"),
    ("x", {"tuple": [{"node": "x"}]}, "reads node 'x', which is not defined before it"),
    ("add", {"tuple": [{"node": {"dict": []}}, 1]}, "reads node .*, which is not defined"),
    ("add", {"tuple": [{"dict": [[[1], 2]]}]}, "a dict key is unhashable"),
    ("add", {"tuple": [{"size": [1.5]}]}, "a torch.Size holds only ints"),
])
def test_a_node_of_the_wrong_shape_is_refused(saved, node, args, message):
    path, doc, tensors = saved
    _node(doc, node)["args"] = args
    _rewrite(path, doc, tensors)
    _refused(path, rf"node '{node}': {message}")


def test_a_placeholder_default_that_reads_a_node_is_refused(saved):
    path, doc, tensors = saved
    doc["root"]["nodes"].insert(1, {"name": "y", "op": "placeholder", "target": "y",
                                    "args": {"tuple": [{"node": "x"}]}, "kwargs": {"dict": []}})
    _rewrite(path, doc, tensors)
    _refused(path, r"node 'y': a placeholder's default cannot read another node")


# ---------------------------------------------------------------------- modules: built on meta, checked
def _lin(doc):
    return doc["root"]["children"]["lin"]


def test_a_linear_whose_weight_contradicts_its_arguments_is_refused_at_load(saved):
    path, doc, tensors = saved
    _lin(doc)["args"]["in_features"] = 5  # the stored weight is 3x4
    _rewrite(path, doc, tensors)
    _refused(path, r"module 'lin', tensor 'weight': stored with shape \[3, 4\], but "
                   r"Linear\(.*\) makes it \[3, 5\]")


def test_a_huge_linear_is_checked_on_the_meta_device_and_refused(saved, monkeypatch):
    path, doc, tensors = saved
    _lin(doc)["args"].update(in_features=1 << 20, out_features=1 << 20)  # 4 TiB if allocated
    _rewrite(path, doc, tensors)
    devices = []
    real = nn.Linear.reset_parameters
    monkeypatch.setattr(nn.Linear, "reset_parameters",
                        lambda self: (devices.append(self.weight.device.type), real(self))[1])
    start = time.perf_counter()
    _refused(path, r"makes it \[1048576, 1048576\]")
    assert time.perf_counter() - start < 5
    assert devices and set(devices) == {"meta"}


def test_lstm_constructor_arguments_through_kwargs_are_refused(saved):
    # nn.LSTM takes **kwargs and ignores the device it is not given: 0.5 GB for (4000, 4000).
    path, doc, tensors = saved
    _lin(doc).update({"class": "torch.nn.LSTM", "args": {"input_size": 4000, "hidden_size": 4000}})
    _rewrite(path, doc, tensors)
    _refused(path, r"'input_size' is not an argument LSTM accepts")


def test_a_transformer_of_a_million_layers_is_refused_before_it_is_built(saved):
    path, doc, tensors = saved
    _lin(doc).update({"class": "torch.nn.Transformer",
                      "args": {"d_model": 8, "nhead": 2, "num_encoder_layers": 10**6}})
    _rewrite(path, doc, tensors)
    start = time.perf_counter()
    _refused(path, r"num_encoder_layers=1000000 asks for 1000000 layers, more than the 2 tensors")
    assert time.perf_counter() - start < 5


def test_a_million_cutoffs_are_refused_before_they_are_built(saved):
    path, doc, tensors = saved
    _lin(doc).update({"class": "torch.nn.AdaptiveLogSoftmaxWithLoss",
                      "args": {"in_features": 4, "n_classes": 10**6 + 2,
                               "cutoffs": list(range(1, 10**6 + 1))}})
    _rewrite(path, doc, tensors)
    start = time.perf_counter()
    _refused(path, r"cutoffs=.* asks for 1000000 layers, more than the 2 tensors")
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("arg", ["device", "dtype", "_weight", "not_an_argument", "self"])
def test_a_constructor_argument_the_file_may_not_give_is_refused(saved, arg):
    path, doc, tensors = saved
    _lin(doc)["args"][arg] = "meta" if arg == "device" else 1
    _rewrite(path, doc, tensors)
    _refused(path, rf"'{arg}' is not an argument Linear accepts")


def test_a_constructor_argument_holding_a_tensor_is_refused(saved):
    path, doc, tensors = saved
    _lin(doc)["args"]["bias"] = {"tuple": [{"tensor": "t0"}]}
    _rewrite(path, doc, tensors)
    _refused(path, r"module 'lin': argument 'bias' holds a tensor")


def test_a_buffer_stored_with_another_dtype_is_refused(saved):
    path, doc, tensors = saved
    key = doc["root"]["children"]["bn"]["tensors"]["num_batches_tracked"]["key"]
    tensors[key] = tensors[key].float()
    _rewrite(path, doc, tensors)
    _refused(path, r"tensor 'num_batches_tracked': stored as torch.float32, but BatchNorm1d makes it torch.int64")


def test_a_parameter_stored_as_a_buffer_is_refused(saved):
    path, doc, tensors = saved
    _lin(doc)["tensors"]["weight"]["param"] = False
    _rewrite(path, doc, tensors)
    _refused(path, r"tensor 'weight': Linear makes it a parameter")


@pytest.mark.parametrize("edit", ["extra", "missing"])
def test_a_module_with_other_tensors_than_its_constructor_makes_is_refused(saved, edit):
    path, doc, tensors = saved
    stored = _lin(doc)["tensors"]
    if edit == "extra":
        stored["secret"] = dict(stored["bias"])
    else:
        del stored["bias"]
    _rewrite(path, doc, tensors)
    _refused(path, r"module 'lin': the file stores tensors .* but Linear")


# ---------------------------------------------------------------------- bombs and limits
def test_shared_values_that_would_expand_exponentially_are_refused_fast(saved):
    path, doc, tensors = saved
    values = [[1, 2]] + [{"tuple": [{"ref": i}, {"ref": i}]} for i in range(40)]  # 2**40 leaves
    add = _node(doc, "add")
    add["values"] = values
    add["args"]["tuple"][1] = {"ref": 40}
    _rewrite(path, doc, tensors)
    assert len(json.dumps(values)) < 2048
    start = time.perf_counter()
    _refused(path, r"node 'add': part #0 of the 'values' table is used twice")
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize("limits, message", [
    (Limits(max_nodes=5), r"more than 5 nodes \(Limits.max_nodes\)"),
    (Limits(max_values=10), r"more than 10 values \(Limits.max_values\)"),
    (Limits(max_json_depth=4), r"the graph nests \d+ levels deep, over the limit of 4"),
    (Limits(max_header_bytes=100), r"over the limit of 100 \(Limits.max_header_bytes\)"),
    (Limits(max_file_bytes=100), r"over the limit of 100 \(Limits.max_file_bytes\)"),
    (Limits(max_seconds=0.0), r"Limits.max_seconds"),
], ids=["nodes", "values", "depth", "header", "file", "time"])
def test_each_limit_refuses_a_valid_file_that_exceeds_it(saved, limits, message):
    path, _, _ = saved
    _refused(path, message, limits=limits)
    fx.load(path)  # the defaults admit it


def test_deep_json_is_refused_before_it_is_parsed(saved):
    path, doc, tensors = saved
    text = json.dumps(doc).replace('"dim", -1', '"dim", ' + "[" * 100_000 + "]" * 100_000, 1)
    serialize_tensors.write(path, text, tensors)
    _refused(path, r"the graph nests 100\d+ levels deep, over the limit of 512")


def test_a_node_bomb_is_refused_before_any_node_is_built(saved):
    path, doc, tensors = saved
    doc["root"]["nodes"][1:1] = [{"name": f"n{i}"} for i in range(1000)]
    _rewrite(path, doc, tensors)
    _refused(path, r"more than 100 nodes", limits=Limits(max_nodes=100))


def test_a_header_length_past_the_file_is_refused_without_reading(tmp_path):
    path = tmp_path / "m.fxl"
    path.write_bytes(struct.pack("<Q", 1 << 63) + b"{}")
    _refused(path, r"the header claims 9223372036854775808 bytes but the file holds 2")


def test_a_large_file_is_refused_after_reading_only_its_header(tmp_path):
    # 768 MB on disk (sparse), a 4-byte tensor in the index: refused from the index alone.
    path = tmp_path / "big.fxl"
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "__metadata__": {"format": "fxlite", "fxlite.graph": "{}",
                                          "fxlite.sha256": "0" * 64}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(768 << 20)
    tracemalloc.start()
    try:
        _refused(path, r"bytes after the last tensor")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_a_tensor_past_the_end_is_refused_before_its_bytes_are_read(saved):
    path, _, _ = saved
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + size])
    header["t1"]["data_offsets"][1] += 1 << 40
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + size:])
    _refused(path, r"tensor 't1': bytes .* past the end of the file")


@pytest.mark.parametrize("shape", [[-1], [1] * 65, [1 << 63], ["3"], None])
def test_a_bad_shape_in_the_index_is_refused(saved, shape):
    path, _, _ = saved
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + size])
    header["t1"]["shape"] = shape
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + size:])
    _refused(path, r"tensor 't1' has a bad shape")


# ---------------------------------------------------------------------- damaged files
@pytest.mark.parametrize("where", [0, 4, 7, 8, 9, "mid-header", "header-end", "mid-data", "last"])
def test_a_truncated_file_is_refused(saved, where):
    path, _, _ = saved
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    cut = {"mid-header": 8 + size // 2, "header-end": 8 + size, "mid-data": (8 + size + len(blob)) // 2,
           "last": len(blob) - 1}.get(where, where)
    path.write_bytes(blob[:cut])
    _refused(path, r"too short|truncated|past the end|ended early|not valid JSON")


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.97, 0.999])
def test_a_bit_flip_is_refused(saved, fraction):
    path, _, _ = saved
    blob = bytearray(path.read_bytes())
    blob[int(fraction * (len(blob) - 1))] ^= 0x10
    path.write_bytes(bytes(blob))
    _refused(path, r"checksum mismatch|not valid JSON|header|tensor|bytes|__metadata__")


# ---------------------------------------------------------------------- the path itself
def test_a_missing_file_raises_file_not_found(tmp_path):
    with _watched(), pytest.raises(FileNotFoundError):
        fx.load(tmp_path / "nope.fxl")


def test_a_folder_raises_is_a_directory(tmp_path):
    with _watched(), pytest.raises(IsADirectoryError, match="not a folder"):
        fx.load(tmp_path)


def test_a_link_to_a_folder_raises_is_a_directory(tmp_path):
    (tmp_path / "link.fxl").symlink_to(tmp_path)
    with _watched(), pytest.raises(IsADirectoryError):
        fx.load(tmp_path / "link.fxl")


def test_a_dangling_link_raises_file_not_found(tmp_path):
    (tmp_path / "link.fxl").symlink_to(tmp_path / "gone")
    with _watched(), pytest.raises(FileNotFoundError):
        fx.load(tmp_path / "link.fxl")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "pipe.fxl")
    _refused(tmp_path / "pipe.fxl", r"not a regular file")


def test_an_empty_file_is_refused(tmp_path):
    (tmp_path / "e.fxl").write_bytes(b"")
    _refused(tmp_path / "e.fxl", r"0 bytes long, too short")


# ---------------------------------------------------------------------- saving
def _leftovers(folder):
    return sorted(p.name for p in Path(folder).iterdir() if p.name != "m.fxl")


def test_concurrent_saves_from_eight_threads_all_succeed(tmp_path):
    gm = fx.symbolic_trace(Small())
    path = tmp_path / "m.fxl"
    start = threading.Barrier(8)
    errors = []

    def save():
        start.wait()
        try:
            for _ in range(4):
                fx.save(gm, path)
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(e)

    threads = [threading.Thread(target=save) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _leftovers(tmp_path) == []
    x = torch.randn(2, 4)
    gm.eval()
    gm2 = fx.load(path).eval()
    torch.testing.assert_close(gm2(x), gm(x))


def test_concurrent_saves_from_two_processes_all_succeed(tmp_path):
    path = tmp_path / "m.fxl"
    script = ("import sys, torch, fxlite as fx\n"
              "gm = fx.symbolic_trace(torch.nn.Linear(8, int(sys.argv[2])))\n"
              "for _ in range(20):\n"
              "    fx.save(gm, sys.argv[1])\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(n)]) for n in (8, 9)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert _leftovers(tmp_path) == []
    assert fx.load(path).weight.shape[0] in (8, 9)


def test_save_replaces_a_link_rather_than_writing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "m.fxl").symlink_to(victim)
    fx.save(fx.symbolic_trace(Small()), tmp_path / "m.fxl")
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "m.fxl").is_symlink()
    fx.load(tmp_path / "m.fxl")


def test_a_failed_save_leaves_no_temporary_file(tmp_path):
    gm = fx.symbolic_trace(Small())
    with pytest.raises(FileNotFoundError):
        fx.save(gm, tmp_path / "no-such-folder" / "m.fxl")
    (tmp_path / "m.fxl").mkdir()  # os.replace onto a folder fails after the temp file is written
    with pytest.raises(OSError):
        fx.save(gm, tmp_path / "m.fxl")
    assert _leftovers(tmp_path) == []


# ---------------------------------------------------------------------- what still loads
def test_a_valid_file_loads_under_the_sentinel_and_runs(saved):
    path, _, _ = saved
    m = Small().eval()
    with _watched():
        gm = fx.load(path).eval()
    gm.load_state_dict(m.state_dict())
    x = torch.randn(2, 4)
    with _watched():
        out = gm(x)
    torch.testing.assert_close(out, m(x))
