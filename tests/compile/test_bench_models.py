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
    assert default.models == list(bench.MODELS)
    # fxlite compiles before inductor: what the process pays once (cuDNN's plans) is its
    assert default.compilers == ["eager", "fxlite", "inductor"]
    assert bench.parse_args(["--compilers", "inductor,fxlite", "--dynamo-fxlite"]).compilers \
        == ["eager", "inductor", "fxlite", "dynamo_fxlite"]
    for bad in (["--models", "resnet51"], ["--dtypes", "f16"], ["--batches", "0"],
                ["--batches", "x"], ["--compilers", "tvm"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_registry_and_selection(bench):
    reg = bench.REGISTRY
    assert all(suite in bench.SUITES and callable(builder) for suite, builder in reg.values())
    # the six names BENCHMARKS.md cites stay, and stay the default
    assert set(bench.MODELS) <= set(reg) and bench.parse_args([]).models == list(bench.MODELS)
    tv = [m for m, (suite, _) in reg.items() if suite == "torchvision"]
    assert set(bench.TORCHVISION) <= set(tv)
    assert {"swin_t", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_1_6gf",
            "shufflenet_v2_x1_0", "densenet121", "maxvit_t"} <= set(tv)
    assert [m for m, (s, _) in reg.items() if s == "timm"] == [f"timm_{m}" for m in bench.TIMM]
    assert {"bert_layer", "gpt2_lm", "t5_encoder", "llama_gqa", "hf_vit", "wav2vec2"} <= {
        m for m, (s, _) in reg.items() if s == "hf"}
    assert bench.parse_args(["--models", "all"]).models == list(reg)
    assert bench.parse_args(["--suites", "torchvision,timm,hf"]).models == list(reg)
    assert bench.parse_args(["--suites", "hf"]).models == list(bench.HF_MODELS)
    # --models in its own order; with --suites, only the named models of those suites
    assert bench.parse_args(["--models", "gpt2_lm,swin_t"]).models == ["gpt2_lm", "swin_t"]
    assert bench.parse_args(["--models", "gpt2_lm,swin_t", "--suites", "hf"]).models == ["gpt2_lm"]
    for bad in (["--suites", "keras"], ["--models", "swin_t", "--suites", "timm"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def _commands(bench, capsys, argv):
    assert bench.main(["--list-runs", *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    groups = []
    for line in lines:
        words = line.split()
        groups.append(words[words.index("--models") + 1].split(","))
    return lines, groups


@pytest.mark.parametrize("argv", [[], ["--models", "all"], ["--suites", "timm,hf"],
                                  ["--models", "all", "--budget", "200"]])
def test_list_runs_cover_every_model_once_within_the_budget(bench, capsys, argv):
    args = bench.parse_args(argv)
    lines, groups = _commands(bench, capsys, argv)
    assert sorted(m for g in groups for m in g) == sorted(args.models)
    budget = args.budget or 480
    for group in groups:
        assert len({bench.REGISTRY[m][0] for m in group}) == 1  # one suite a command
        cost = bench.STARTUP_S + sum(bench.estimate_s(m) for m in group)
        assert cost <= budget or len(group) == 1
    assert len({line.split("--json ")[1] for line in lines}) == len(lines)  # own JSON each
    if "--budget" in argv:
        assert all("--budget 200" in line for line in lines)


def test_list_runs_pass_the_case_selection_on(bench, capsys):
    lines, groups = _commands(bench, capsys, ["--models", "all", "--batches", "32",
                                              "--dtypes", "bf16"])
    assert all("--batches 32" in line and "--dtypes bf16" in line for line in lines)
    _, four_cases = _commands(bench, capsys, ["--models", "all"])
    assert len(groups) < len(four_cases)  # a quarter of the cases: fewer commands
    plain, _ = _commands(bench, capsys, [])
    assert not any("--batches" in line or "--dtypes" in line for line in plain)


def test_group_runs_packs_first_fit(bench, monkeypatch):
    monkeypatch.setattr(bench, "STARTUP_S", 10.0)
    monkeypatch.setattr(bench, "SUITE_ESTIMATE_S", {"torchvision": 40.0, "timm": 40.0,
                                                     "hf": 40.0})
    monkeypatch.setattr(bench, "ESTIMATE_S", {"alexnet": 60.0, "resnet18": 30.0,
                                               "vgg16_bn": 100.0})
    # alexnet 10+60 = 70; resnet18 fits with it (100); vgg16_bn is over 100 alone;
    # swin_t (40) opens a third; gpt2_lm is another suite
    assert bench.group_runs(["alexnet", "vgg16_bn", "resnet18", "swin_t", "gpt2_lm"], 100) == [
        ["alexnet", "resnet18"], ["vgg16_bn"], ["swin_t"], ["gpt2_lm"]]
    assert bench.estimate_s("swin_t", cases=2) == 20.0 and bench.estimate_s("alexnet") == 60.0


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
             "eager_first20_s": 0.25, "inductor_first20_s": 9.5, "fxlite_first20_s": 3.125,
             "eager_peak_mib": 800.0, "inductor_peak_mib": 1200.4, "fxlite_peak_mib": 999.6,
             "fxlite_cold_profile": {"fuse": 0.1}},
            {"model": "gpt2_lm", "dtype": "f32", "batch": 1, "eager_ms": 3.0,
             "eager_first20_s": 0.5, "eager_peak_mib": None,
             "inductor_error": "RuntimeError: boom"}]
    text = bench.table(rows)
    assert "| resnet50 | bf16 | 32 | 10.000 | 5.000 | 4.000 | 2.00 | 2.50 | 1.25 |" in text
    header = text.splitlines()[0].split(" | ")
    first, peak = header.index("first 20 s (eager/ind/fx)"), header.index("peak MiB (eager/ind/fx)")
    resnet = text.splitlines()[2].split(" | ")
    assert resnet[first] == "0.25/9.50/3.12" and resnet[peak] == "800/1200/1000"
    gpt2 = text.splitlines()[3].split(" | ")
    assert gpt2[first] == "0.50/-/-" and gpt2[peak] == "-/-/-"  # None on CPU, no compiler
    assert "54/60" in text and "inductor failed: RuntimeError: boom" in text
    assert "- resnet50 bf16 b32: fuse 0.1" in text
    assert "- bf16 b32: fxlite/inductor 1.250 over 1 rows, fxlite/eager 2.500 over 1 rows" in text
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"facts": {"device": "cuda", "gpu": "H200", "date": "d",
                                          "torch": "2.11", "triton": "3.6", "command": "c"},
                                "rows": rows}))
    assert bench.main(["--merge", str(path)]) == 0
    out = capsys.readouterr().out
    assert "H200" in out and "| gpt2_lm | f32 | 1 | 3.000 | - |" in out


def test_geometric_means_per_dtype_and_batch(bench):
    def row(model, dtype, batch, eager, inductor, fxlite):
        return {"model": model, "dtype": dtype, "batch": batch, "eager_ms": eager,
                "inductor_ms": inductor, "fxlite_ms": fxlite}

    rows = [row("a", "f32", 32, 8.0, 4.0, 2.0), row("b", "f32", 32, 9.0, 1.0, 3.0),
            row("a", "f32", 1, 2.0, None, 4.0),  # inductor failed: only against eager
            row("a", "bf16", 32, 6.0, 3.0, None)]  # fxlite failed: in no mean
    means = {(g["dtype"], g["batch"]): g for g in bench.geomeans(rows)}
    assert set(means) == {("f32", 32), ("f32", 1), ("f32", None)}
    # f32 b32: inductor/fxlite 4/2 = 2 and 1/3, eager/fxlite 8/2 = 4 and 9/3 = 3
    assert means["f32", 32]["vs_inductor"] == pytest.approx((2 * (1 / 3)) ** 0.5)
    assert means["f32", 32]["vs_eager"] == pytest.approx(12 ** 0.5)
    assert means["f32", 32]["n_inductor"] == 2 and means["f32", 32]["n_eager"] == 2
    assert means["f32", 1]["vs_inductor"] is None and means["f32", 1]["n_inductor"] == 0
    assert means["f32", 1]["vs_eager"] == pytest.approx(0.5)
    # every f32 batch: eager ratios 4, 3, 0.5
    assert means["f32", None]["vs_eager"] == pytest.approx(6 ** (1 / 3))
    assert means["f32", None]["vs_inductor"] == pytest.approx((2 / 3) ** 0.5)
    lines = bench.geomean_lines(rows)
    assert f"- f32 all batches: fxlite/inductor {(2 / 3) ** 0.5:.3f} over 2 rows, " \
           f"fxlite/eager {6 ** (1 / 3):.3f} over 3 rows" in lines
    assert bench.geomean([]) is None and bench.geomean([2.0, 8.0]) == pytest.approx(4.0)


def _quick_env(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_models.py"])
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # restored after the test
        monkeypatch.setenv(var, str(tmp_path / var))
    # --device cpu sets TRITON_INTERPRET=1 where it is unset (a GPU machine): restore it,
    # or every kernel compiled by a later test there would run through the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))


def _quick_row(bench, tmp_path, monkeypatch, model: str) -> dict:
    """The one row of a ``--quick --device cpu`` run of ``model`` (fxlite, batch 1, f32)."""
    out = tmp_path / "quick.json"
    _quick_env(tmp_path, monkeypatch)
    assert bench.main(["--quick", "--device", "cpu", "--compilers", "fxlite", "--batches", "1",
                       "--dtypes", "f32", "--models", model, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    return row


def test_quick_cpu_smoke_run(bench, tmp_path, monkeypatch):
    pytest.importorskip("torchvision")
    pytest.importorskip("transformers")
    row = _quick_row(bench, tmp_path, monkeypatch, "convnext_tiny")
    assert row["fxlite_max_rel_err"] < 1e-4 and row["fxlite_kernels"] > 0


def test_quick_cpu_smoke_run_hf_first_calls(bench, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    row = _quick_row(bench, tmp_path, monkeypatch, "gpt2_block")
    assert row["suite"] == "hf" and row["fxlite_max_rel_err"] < 1e-4
    for compiler in ("eager", "fxlite"):  # 20 calls take longer than the first alone
        assert row[f"{compiler}_first20_s"] > row[f"{compiler}_cold_s"] > 0
        assert row[f"{compiler}_peak_mib"] is None  # no GPU memory on CPU


def test_missing_package_skips_its_model(bench, tmp_path, monkeypatch, capsys):
    def no_timm(quick, batch):
        raise ModuleNotFoundError("No module named 'timm'", name="timm")

    monkeypatch.setitem(bench.REGISTRY, "timm_resnet18", ("timm", no_timm))
    out = tmp_path / "skip.json"
    _quick_env(tmp_path, monkeypatch)
    assert bench.main(["--quick", "--device", "cpu", "--models", "timm_resnet18",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["skipped"] == ["timm_resnet18 (timm is not installed)"]
    assert "timm is not installed" in capsys.readouterr().out


def test_first_call_ops_puts_a_compiles_ops_down_to_fxlites_stages(capsys):
    """benchmarks/first_call_ops.py: its stage labels wrap functions that exist (a renamed
    one fails here), and a compile's ops come out under them."""
    pytest.importorskip("transformers")
    path = SCRIPT.parent / "first_call_ops.py"
    spec = importlib.util.spec_from_file_location("first_call_ops", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec.loader.exec_module(module)
        module.profile_first_calls("gpt2_block", "f32", 2, "cpu", True, 40, 2)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    out = capsys.readouterr().out
    stages = [line.split(":", 1)[1] for line in out.splitlines() if "stages (ms" in line]
    assert len(stages) == 2 and "record" in stages[0] + stages[1], out
    assert any("group check" in s and "passes" in s for s in stages), out
    assert "aten::" in out
    import fxlite.codegen.lower.pipeline as pipeline  # the labels are taken off again

    assert not hasattr(pipeline.precompile, "__wrapped__")
