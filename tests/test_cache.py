"""Shape records (codegen/cache.py): what a new process reads instead of running ShapeProp."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen import cache
from fxlite.passes.shape_prop import ShapeProp

import fxlite


def layer_norm_gelu(x, w, n: int):
    return F.gelu(F.layer_norm(x, (n,), w)) * x.size(-1)


def _metas(gm):
    return {n.name: (n.meta.get("tensor_meta"), n.meta.get("type")) for n in gm.graph.nodes}


def test_a_record_gives_what_shapeprop_gives(tmp_path, monkeypatch):
    monkeypatch.setenv("FXLITE_CACHE_DIR", str(tmp_path))
    args = (torch.randn(4, 8).t(), torch.randn(4), 4)
    gm = fxlite.symbolic_trace(layer_norm_gelu)
    cache.propagate_shapes(gm, args)
    records = list((tmp_path / "shapes").glob("*.json"))
    assert len(records) == 1
    fresh = fxlite.symbolic_trace(layer_norm_gelu)
    calls = []
    monkeypatch.setattr(ShapeProp, "propagate", lambda self, *a: calls.append(a))
    cache.propagate_shapes(fresh, args)
    assert calls == [] and _metas(fresh) == _metas(gm)


def test_other_layouts_and_values_are_other_records(tmp_path, monkeypatch):
    monkeypatch.setenv("FXLITE_CACHE_DIR", str(tmp_path))
    gm = fxlite.symbolic_trace(layer_norm_gelu)
    x, w = torch.randn(4, 8), torch.randn(8)
    for args in [(x, w, 8), (x.double(), w.double(), 8), (torch.randn(2, 8), w, 8),
                 (torch.randn(8, 2).t(), w, 8)]:
        cache.propagate_shapes(gm, args)
        assert list(gm.graph.nodes)[-1].meta["tensor_meta"].shape == args[0].shape
    assert len(list((tmp_path / "shapes").glob("*.json"))) == 4


def test_modules_and_nested_values_are_not_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("FXLITE_CACHE_DIR", str(tmp_path))
    lin = fxlite.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    cache.propagate_shapes(lin, (torch.randn(2, 4),))
    pair = fxlite.symbolic_trace(lambda x: (x + 1, x * 2))
    cache.propagate_shapes(pair, (torch.randn(2, 4),))
    assert not (tmp_path / "shapes").exists() or not list((tmp_path / "shapes").iterdir())
    assert list(lin.graph.nodes)[-1].meta["tensor_meta"].shape == (2, 4)


@pytest.mark.parametrize("damage", ["garbage", "renamed", "wrong shapes"])
def test_a_bad_record_never_gives_wrong_results(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("FXLITE_CACHE_DIR", str(tmp_path))
    f = lambda x, b: torch.relu(x + b) * 2  # noqa: E731
    x, b = torch.randn(6, 5), torch.randn(5)
    fxlite.compile(f)(x, b)
    for path in (tmp_path / "shapes").glob("*.json"):
        record = json.loads(path.read_text())
        if damage == "garbage":
            path.write_text("{not json")
            continue
        if damage == "renamed":
            record = {k + "_": v for k, v in record.items()}
        else:
            for entry in record.values():
                if "shape" in entry:
                    entry["shape"] = [3, 2]
                    entry["stride"] = [2, 1]
        path.write_text(json.dumps(record))
    c = fxlite.compile(f)
    torch.testing.assert_close(c(x, b), f(x, b))
    x2 = torch.randn(7, 5)
    torch.testing.assert_close(c(x2, b), f(x2, b))
