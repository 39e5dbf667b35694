"""benchmarks/bench_models.py: argument handling, the measures it reports, and a smoke run
(the smoke run needs torchvision and transformers, which CI does not install)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_models.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(bench):
    args = bench.parse_args(["--models", "resnet50,gpt2_lm", "--compilers", "fxlite",
                             "--batches", "1,32", "--dtypes", "bf16"])
    assert args.models == ["resnet50", "gpt2_lm"] and args.batches == [1, 32]
    assert args.compilers == ["eager", "fxlite"]  # eager is the reference: always there
    assert args.dtypes == ["bf16"] and args.device == "cuda" and args.budget is None
    default = bench.parse_args([])
    assert default.models == list(bench.MODELS) and default.compilers == list(bench.COMPILERS)
    for bad in (["--models", "resnet51"], ["--dtypes", "f16"], ["--batches", "0"],
                ["--batches", "x"], ["--compilers", "tvm"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_list_runs_cover_every_model_once(bench, capsys):
    assert bench.main(["--list-runs"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(bench.MODELS)
    for model, line in zip(bench.MODELS, lines):
        assert f"--models {model} " in line and f"bench_models_{model}.json" in line


def test_max_relative_error_and_nested_outputs(bench):
    a = torch.tensor([1.0, -4.0, 2.0])
    assert bench.max_rel_error((a, {"x": a * 2}), (a, {"x": a * 2})) == 0.0
    assert bench.max_rel_error(a + torch.tensor([0.0, 0.4, 0.0]), a) == pytest.approx(0.1)
    assert bench.max_rel_error((a,), (a, a)) == float("inf")
    assert bench.max_rel_error(torch.tensor([1, 2]), torch.tensor([1, 3])) == 1.0
    assert len(bench.tensors_of([a, (a, [a]), None, 3])) == 3


def test_table_and_merge(bench, tmp_path, capsys):
    rows = [{"model": "resnet50", "dtype": "bf16", "batch": 32, "eager_ms": 10.0,
             "inductor_ms": 5.0, "fxlite_ms": 4.0, "inductor_speedup": 2.0,
             "fxlite_speedup": 2.5, "fxlite_vs_inductor": 1.25, "fxlite_kernels": 54,
             "inductor_kernels": 60, "fxlite_fallbacks": [], "fxlite_max_rel_err": 1e-3,
             "fxlite_cold_profile": {"fuse": 0.1}},
            {"model": "gpt2_lm", "dtype": "f32", "batch": 1, "eager_ms": 3.0,
             "inductor_error": "RuntimeError: boom"}]
    text = bench.table(rows)
    assert "| resnet50 | bf16 | 32 | 10.000 | 5.000 | 4.000 | 2.00 | 2.50 | 1.25 |" in text
    assert "54/60" in text and "inductor failed: RuntimeError: boom" in text
    assert "- resnet50 bf16 b32: fuse 0.1" in text
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"facts": {"device": "cuda", "gpu": "H200", "date": "d",
                                          "torch": "2.11", "triton": "3.6", "command": "c"},
                                "rows": rows}))
    assert bench.main(["--merge", str(path)]) == 0
    out = capsys.readouterr().out
    assert "H200" in out and "| gpt2_lm | f32 | 1 | 3.000 | - |" in out


def test_quick_cpu_smoke_run(bench, tmp_path, monkeypatch):
    pytest.importorskip("torchvision")
    pytest.importorskip("transformers")
    out = tmp_path / "quick.json"
    monkeypatch.setattr(sys, "argv", ["bench_models.py"])
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # restored after the test
        monkeypatch.setenv(var, str(tmp_path / var))
    # --device cpu sets TRITON_INTERPRET=1 where it is unset (a GPU machine): restore it,
    # or every kernel compiled by a later test there would run through the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    assert bench.main(["--quick", "--device", "cpu", "--compilers", "fxlite", "--batches", "1",
                       "--dtypes", "f32", "--models", "convnext_tiny", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["fxlite_max_rel_err"] < 1e-4 and row["fxlite_kernels"] > 0
