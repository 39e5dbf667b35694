"""A seeded mutation fuzzer for fxlite.load.

From three valid files (a model of standard modules, a hand-built graph of odd values and a
deep values table, a split module with tied weights) it makes ``FILES`` mutated files: bit
flips and truncations of the bytes, and, re-signed with a valid checksum so that load's own
checks are what meet them, edits of the graph JSON, of the tensor index and of the stored
tensors' shapes. Each load must either succeed, and then the module is called, or raise
SerializationError; it must finish within ``LOAD_SECONDS``; and neither loading nor calling
may run code from the file (a sentinel records eval, exec and compile of anything but
fxlite's generated forward, os.system, subprocess and pickle) or change global state.

``FXLITE_SERIALIZE_FUZZ_SEED`` and ``FXLITE_SERIALIZE_FUZZ_FILES`` pick another run; a failure
names the seed, the file's number and its mutations, and leaves the file in tmp_path.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import gc
import hashlib
import json
import operator
import os
import pickle
import random
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from fxlite.passes import split_module
from torch import nn

import fxlite as fx
from fxlite.graph_module import GraphModule
from fxlite.serialize import Limits, SerializationError
from fxlite.serialize import allowlist as serialize_allowlist
from fxlite.serialize import tensors as serialize_tensors

SEED = int(os.environ.get("FXLITE_SERIALIZE_FUZZ_SEED", "36"))
FILES = int(os.environ.get("FXLITE_SERIALIZE_FUZZ_FILES", "1200"))
LOAD_SECONDS = 5.0


# ---------------------------------------------------------------------- the valid files
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.seq = nn.Sequential(nn.Linear(4, 8), nn.GELU(approximate="tanh"), nn.Linear(8, 4, bias=False))
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, ids, x):
        h = self.ln(torch.relu(self.lin(x + self.emb(ids))))
        h = self.bn(self.seq(h) * self.scale).softmax(dim=-1) + x.shape[0]
        return self.drop(h[:, :2]).flatten(1), {"mean": h.mean(dim=(0,))}


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).sum(dim=1)


def _odd_values() -> GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    t = g.get_attr("const")
    y = g.call_function(torch.add, (x, t), {"alpha": 2})
    y = g.call_method("to", (y,), {"dtype": torch.float64})
    y = g.call_function(operator.getitem, (y, (slice(0, 2), ..., None)))
    w = g.call_function(torch.mul, (x, complex(1, 2)))
    deep: Any = x
    for _ in range(40):  # deeper than save's nesting: parts go to the values table
        deep = [{"k": (deep,)}]
    z = g.call_function(operator.getitem, (deep, 0))
    g.output((y, w, z, torch.Size([2, 3]), float("-inf")))
    return GraphModule({"const": torch.arange(3.0)}, g)


def _split() -> GraphModule:
    gm = fx.symbolic_trace(Tied())
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return split_module(gm, gm, lambda n: 0 if order[n] < 3 else 1)


class Base(NamedTuple):
    name: str
    blob: bytes  # the file save wrote
    doc: dict  # its graph
    tensors: dict[str, torch.Tensor]
    module_keys: list[str]  # the stored tensors of standard modules (shapes load cross-checks)
    inputs: Callable[[], tuple]


def _module_keys(doc: dict) -> list[str]:
    keys, stack = [], [doc["root"]]
    while stack:
        rec = stack.pop()
        if rec.get("kind") == "module":
            keys += [e["key"] for e in rec["tensors"].values()]
        stack += rec.get("children", {}).values()
    return sorted(set(keys))


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> list[Base]:
    folder = tmp_path_factory.mktemp("bases")
    made = []
    for name, gm, inputs in [
        ("net", fx.symbolic_trace(Net()), lambda: (torch.tensor([1, 2, 3]), torch.randn(3, 4))),
        ("odd", _odd_values(), lambda: (torch.randn(3),)),
        ("split", _split(), lambda: (torch.randn(2, 3),)),
    ]:
        path = folder / f"{name}.fxl"
        fx.save(gm, path)
        text, tensors = serialize_tensors.read(path)
        doc = json.loads(text)
        blob = path.read_bytes()
        assert _pack(text, tensors) == blob  # this file's packer writes what save writes
        made.append(Base(name, blob, doc, tensors, _module_keys(doc), inputs))
    return made


# ---------------------------------------------------------------------- the file, written here
def _pack(graph: str, tensors: dict[str, torch.Tensor], index_edit: Callable | None = None) -> bytes:
    """A file in the layout serialize_tensors documents, signed with a valid checksum;
    ``index_edit`` may change the tensor index first."""
    index, chunks, offset = {}, [], 0
    for key, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        code = {v: k for k, v in serialize_tensors.DTYPES.items()}[t.dtype]
        index[key] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if index_edit is not None:
        index_edit(index)
    data = b"".join(chunks)
    h = hashlib.sha256(json.dumps(index, sort_keys=True).encode())
    h.update(graph.encode())
    h.update(data)
    header = {**index, "__metadata__": {"format": "fxlite", "fxlite.graph": graph,
                                        "fxlite.sha256": h.hexdigest()}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


# ---------------------------------------------------------------------- mutations
_STRINGS = ["", "x", "output", "__class__", "__dict__", "__init__", "forward", "forward.__globals__",
            "__class__.__init__.__defaults__", "_modules", "lin.weight", "lin", "seq.0", "scale",
            "const", "a.weight", "submod_0", "os.system", "builtins.eval", "builtins.getattr",
            "torch.load", "torch.relu", "operator.add", "torch.nn.Linear", "torch.nn.LSTM",
            "subprocess.Popen", "sum", "storage", "__reduce_ex__", "relu", "t0", "t1", "F32", "I64",
            "placeholder", "get_attr", "call_module", "call_function", "call_method", "graph",
            "module", "container", "my-mod", "a\nb", "\u00e9", "1e400"]
_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2, 3, 7, 255, 2**31, 2**63, -(2**63), 10**30, 0.5, -0.0, 1e308,
    [], {}, [[]], [None], {"ref": 0}, {"ref": 1}, {"ref": -1}, {"ref": 10**9}, {"node": "x"},
    {"node": "output"}, {"node": "nope"}, {"tensor": "t0"}, {"tensor": "t999"}, {"tensor": 0},
    {"function": "builtins.eval"}, {"function": "torch.relu"}, {"registered": "os.system"},
    {"dtype": "float16"}, {"dtype": "__class__"}, {"device": "meta"}, {"device": "cuda:99"},
    {"tuple": []}, {"tuple": [1, {"node": "x"}]}, {"dict": [[1, 2]]}, {"dict": [[[], 1]]},
    {"slice": [0, 1, None]}, {"slice": [1]}, {"size": [2, 3]}, {"size": ["a"]}, {"float": "inf"},
    {"float": "1e999"}, {"complex": [1, 2]}, {"complex": [{"float": "nan"}, 0]}, {"ellipsis": True},
    {"memory_format": "contiguous_format"}, {"layout": "strided"}, {"pickle": "gASV"},
    {"class": "builtins.int"}, {"text": "int"},
    {"kind": "module", "class": "torch.nn.Linear", "args": {"in_features": 2**20, "out_features": 2**20},
     "tensors": {}, "training": {}},
    {"kind": "module", "class": "torch.nn.LSTM", "args": {"input_size": 4000, "hidden_size": 4000},
     "tensors": {}, "training": {}},
    {"kind": "graph", "class_name": "G", "nodes": [], "training": True, "tensors": {}, "children": {},
     "constants": {}},
    {"name": "evil", "op": "get_attr", "target": "__class__.__init__.__defaults__",
     "args": {"tuple": []}, "kwargs": {"dict": []}},
    {"name": "evil", "op": "call_module", "target": "forward.__globals__.get",
     "args": {"tuple": ["__builtins__"]}, "kwargs": {"dict": []}},
    {"name": "evil", "op": "call_function", "target": "builtins.eval",
     "args": {"tuple": ["1"]}, "kwargs": {"dict": []}},
]


def _slots(doc: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) in a JSON document, containers included."""
    out, stack = [], [doc]
    while stack:
        c = stack.pop()
        keys = list(c) if isinstance(c, dict) else range(len(c))
        for k in keys:
            out.append((c, k))
            if isinstance(c[k], (dict, list)):
                stack.append(c[k])
    return out


def _pick_value(rng: random.Random, doc: dict) -> Any:
    roll = rng.random()
    if roll < 0.5:
        return copy.deepcopy(rng.choice(_VALUES))
    if roll < 0.8:
        return rng.choice(_STRINGS)
    if roll < 0.9:  # another part of the same document
        return copy.deepcopy(rng.choice(_slots(doc))[0])
    depth = rng.choice([10, 100, 520])  # past Limits.max_json_depth with the rest
    return json.loads("[" * depth + "]" * depth)


def _mutate_json(rng: random.Random, doc: dict) -> str:
    container, key = rng.choice(_slots(doc))
    action = rng.choice(["replace", "replace", "replace", "delete", "duplicate", "swap", "bump"])
    if action == "delete":
        del container[key]
    elif action == "duplicate" and isinstance(container, list):
        container.insert(key, copy.deepcopy(container[key]))
    elif action == "swap" and isinstance(container, list) and len(container) > 1:
        other = rng.randrange(len(container))
        container[key], container[other] = container[other], container[key]
    elif action == "bump" and type(container[key]) is int:
        container[key] += rng.choice([-2, -1, 1, 2, 1000])
    else:
        action = "replace"
        container[key] = _pick_value(rng, doc)
    return f"json {action} at {str(key)[:30]!r}"


def _mutate_index(rng: random.Random, index: dict) -> None:
    entry = index[rng.choice(sorted(index))]
    field = rng.choice(["dtype", "shape", "data_offsets"])
    entry[field] = rng.choice({
        "dtype": ["F16", "F64", "I64", "BOOL", "U8", "X9", None],
        "shape": [[], [0], [1, 1], [-1], [2**62, 0], [2**40], list(reversed(entry["shape"])), None],
        "data_offsets": [[0, 0], [0, 2**62], [-4, 4], [1, 0], None,
                         [entry["data_offsets"][0] + 4, entry["data_offsets"][1] + 4]],
    }[field])


def _reshaped(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    """A tensor of the same dtype and another shape."""
    shapes = [(t.numel() + 1,), (max(t.numel() - 1, 0),), (*t.shape, 1), tuple(reversed(t.shape)) + (2,),
              tuple(d + 1 for d in t.shape) or (1,), (1, *t.shape[1:])]
    shape = rng.choice([s for s in shapes if tuple(s) != tuple(t.shape)])
    return torch.zeros(shape, dtype=t.dtype)


class Mutant(NamedTuple):
    blob: bytes
    what: str
    must_refuse: bool  # a stored module tensor of another shape: load must refuse it


def _mutant(rng: random.Random, base: Base) -> Mutant:
    kind = rng.choices(["flip", "truncate", "json", "index", "tensor"], [20, 8, 52, 10, 10])[0]
    if kind == "flip":
        blob = bytearray(base.blob)
        spots = [rng.randrange(len(blob)) for _ in range(rng.randint(1, 3))]
        for i in spots:
            blob[i] ^= 1 << rng.randrange(8)
        return Mutant(bytes(blob), f"flip bytes {spots}", False)
    if kind == "truncate":
        cut = rng.randrange(len(base.blob))
        return Mutant(base.blob[:cut], f"truncate at {cut}", False)
    if kind == "index":
        return Mutant(_pack(json.dumps(base.doc), base.tensors, lambda ix: _mutate_index(rng, ix)),
                      "index edit", False)
    if kind == "tensor" and base.module_keys:
        key = rng.choice(base.module_keys)
        tensors = dict(base.tensors)
        tensors[key] = _reshaped(rng, tensors[key])
        return Mutant(_pack(json.dumps(base.doc), tensors),
                      f"tensor {key} reshaped to {list(tensors[key].shape)}", True)
    doc = copy.deepcopy(base.doc)
    what = [_mutate_json(rng, doc) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    return Mutant(_pack(json.dumps(doc), base.tensors), "; ".join(what), False)


# ---------------------------------------------------------------------- the sentinel
def _state() -> dict[str, Any]:
    def functions(cls):
        return {k: (v.__defaults__, v.__kwdefaults__, v.__code__) for k, v in vars(cls).items()
                if callable(v) and hasattr(v, "__code__")}

    return {"GraphModule": dict(vars(GraphModule)), "GraphModule functions": functions(GraphModule),
            "Module": dict(vars(nn.Module)), "Module functions": functions(nn.Module),
            "dtype": torch.get_default_dtype(), "device": torch.get_default_device(),
            "grad": torch.is_grad_enabled(), "gc": gc.isenabled(),
            "registered": serialize_allowlist.registered()}


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
def _sentinel():
    """Record code execution: eval, exec and compile of anything but fxlite's own forward,
    os.system/popen, subprocess, pickle and torch.load."""
    calls: list[str] = []
    real_exec, real_compile = builtins.exec, builtins.compile

    def ours(filename: Any) -> bool:
        return isinstance(filename, str) and filename.startswith("<fxlite-forward")

    def record(name, during_imports=False):
        real = getattr(builtins, name, None)

        def fn(*args, **kwargs):
            if during_imports and _importing():
                return real(*args, **kwargs)
            calls.append(name)
            raise RuntimeError(f"sentinel: {name} called")
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
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        yield calls
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


# ---------------------------------------------------------------------- the run
def test_mutated_files_load_cleanly_or_are_refused(bases, tmp_path):
    rng = random.Random(SEED)
    limits = Limits(max_seconds=LOAD_SECONDS)
    path = tmp_path / "mutant.fxl"
    before = _state()
    counts = {"loaded": 0, "ran": 0, "call raised": 0, "refused": 0}
    slowest = 0.0
    for i in range(FILES):
        base = bases[i % len(bases)]
        mutant = _mutant(rng, base)
        path.write_bytes(mutant.blob)
        where = f"seed {SEED}, file #{i} ({base.name}: {mutant.what}), kept at {path}"
        with _sentinel() as calls:
            start = time.perf_counter()
            try:
                gm = fx.load(path, limits=limits)
            except SerializationError:
                gm = None
            except Exception as e:
                pytest.fail(f"{where}: load raised {type(e).__name__}: {e}")
            took = time.perf_counter() - start
            if gm is not None:
                counts["loaded"] += 1
                assert not mutant.must_refuse, f"{where}: a module tensor of another shape loaded"
                try:
                    with warnings.catch_warnings():  # edited arguments: 0.5[0], x[[0, 1]]...
                        warnings.simplefilter("ignore")
                        gm(*base.inputs())
                    counts["ran"] += 1
                except Exception:  # an edited argument may fail in torch; never code from the file
                    counts["call raised"] += 1
            else:
                counts["refused"] += 1
        assert calls == [], f"{where}: code ran: {calls}"
        assert took < LOAD_SECONDS + 1, f"{where}: load took {took:.1f} s"
        slowest = max(slowest, took)
        if GraphModule.__init__.__defaults__ != ("GraphModule",) or not i % 100:
            assert _state() == before, f"{where}: global state changed"
    assert _state() == before
    print(f"serialize fuzz, seed {SEED}: {FILES} files, {counts}, slowest load {slowest * 1e3:.0f} ms")
    assert counts["loaded"] + counts["refused"] == FILES
    assert counts["ran"] > 0 and counts["refused"] > FILES // 4  # both paths were exercised
