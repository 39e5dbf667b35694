"""Real models: eager vs torch.compile (inductor) vs fxlite.compile, side by side.

On a CUDA machine with torchvision and transformers installed, one model per run (each
stays under 9 minutes)::

    python benchmarks/bench_models.py --list-runs            # the commands of a full run
    PYTHONPATH=$PWD python benchmarks/bench_models.py --models resnet50 --json out/resnet50.json
    python benchmarks/bench_models.py --merge out/*.json     # the tables for BENCHMARKS.md

For each model, dtype (f32 with TF32 on, bf16 weights) and batch (1, 32), in eval mode
under ``torch.no_grad()``: the median ms of each compiler (``triton.testing.do_bench``),
speedup over eager, fxlite's ratio to inductor (inductor ms / fxlite ms: above 1 is
faster), the cold compile of each (the first call's wall time, with empty cache folders:
every compiler starts cold in this process), fxlite's kernel count and fallbacks,
inductor's generated kernel count, and the max relative error of each against eager
(max |y - y_eager| / max |y_eager| over every output). ``--profile`` adds where
fxlite's cold compile spends its time (cProfile, cumulative seconds per pipeline stage).

``--dynamo-fxlite`` adds a column for ``torch.compile(model, backend="fxlite")``: Dynamo
captures the graphs and fxlite compiles each one (``fxlite.codegen.dynamo_backend``), with
the same measures (steady-state ms, speedup, ratio to inductor, cold first call, error
against eager) plus the number of graphs Dynamo handed over and their kernels. It is off
by default since it adds a third cold compile to every case (``--list-runs`` does not
include it: add the flag to a model's command).

``--quick --device cpu`` is a smoke test of the script itself: scaled-down models, the
Triton interpreter, no timing worth reporting.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import json
import os
import platform
import pstats
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

MODELS = ("resnet50", "vit_b_16", "convnext_tiny", "bert_layer", "gpt2_block", "gpt2_lm")
COMPILERS = ("eager", "inductor", "fxlite")  # the default columns
# torch.compile(model, backend="fxlite"): with --dynamo-fxlite or --compilers
EXTRA_COMPILERS = ("dynamo_fxlite",)
DTYPES = ("f32", "bf16")
BATCHES = (1, 32)
SEQ = 128  # tokens per sequence for the transformers models
ROUNDS = 3  # timing rounds per case, each timing every contender in turn

# cProfile functions whose cumulative time is reported per stage of fxlite's cold compile.
STAGES = {
    "trace": ("symbolic_trace",),
    "shape_prop": ("propagate", "fill_meta", "propagate_meta"),
    "functionalize": ("functionalize",),
    "normalize": ("normalize",),
    "decompose": ("decompose",),
    "fuse": ("fuse",),
    "generate_kernel": ("generate_kernel",),
    "precompile": ("precompile",),
    "triton_compile": ("compile",),  # triton.compiler.compiler.compile
    "first_call_check": ("_assert_same", "assert_same"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--compilers", default=",".join(COMPILERS),
                   help="comma-separated, from eager, inductor, fxlite, dynamo_fxlite "
                        "(eager always runs)")
    p.add_argument("--dynamo-fxlite", action="store_true",
                   help='add torch.compile(model, backend="fxlite") as a column '
                        "(compiler dynamo_fxlite)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: f32, bf16")
    p.add_argument("--mode", default=None, help="compile mode of every compiler, such as "
                   "reduce-overhead (CUDA graphs)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true",
                   help="scaled-down models and short timing (a smoke test)")
    p.add_argument("--profile", action="store_true",
                   help="profile fxlite's cold compile by pipeline stage")
    p.add_argument("--no-precompile", action="store_true",
                   help="do not compile fxlite's kernels in parallel ahead of the first call")
    p.add_argument("--json", metavar="OUT",
                   help="write the rows and run facts to OUT (rewritten after every case)")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="start no case that would end after S seconds (its estimate: the "
                        "longest case so far); skipped cases are listed. Default: 480 on "
                        "cuda (the device tool's 10-minute limit), none on cpu")
    p.add_argument("--list-runs", action="store_true",
                   help="print the commands of a full run, one model each, and exit")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="print the tables of earlier --json files and exit")
    args = p.parse_args(argv)
    args.models = _choices(args.models, MODELS, "model")
    chosen = set(_choices(args.compilers, COMPILERS + EXTRA_COMPILERS, "compiler"))
    chosen |= {"eager"} | ({"dynamo_fxlite"} if args.dynamo_fxlite else set())
    # always in this order: inductor's torch._dynamo.reset() comes before dynamo_fxlite
    args.compilers = [c for c in COMPILERS + EXTRA_COMPILERS if c in chosen]
    args.dtypes = _choices(args.dtypes, DTYPES, "dtype")
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches takes integers, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        p.error("--batches needs at least one positive batch size")
    return args


def _choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    got = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in got if t not in allowed]
    if bad or not got:
        raise SystemExit(f"bench_models.py: unknown {what} {bad or text!r}; "
                         f"choose from {', '.join(allowed)}")
    return got


def list_runs(json_dir: str = "bench-out") -> list[str]:
    """The commands of a full run: one model each (a few minutes per model)."""
    return [f"PYTHONPATH=$PWD python benchmarks/bench_models.py --models {m} --profile "
            f"--json {json_dir}/bench_models_{m}.json" for m in MODELS]


# ---------------------------------------------------------------------- environment
def _prepare_environment(device: str) -> str:
    """Empty cache folders (every compile in this process is cold), the interpreter on CPU."""
    root = tempfile.mkdtemp(prefix="fxlite-bench-models-")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    os.environ.setdefault("FXLITE_CACHE_DIR", os.path.join(root, "fxlite"))
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return root


# ---------------------------------------------------------------------- models
def build(name: str, quick: bool, batch: int, device: str) -> tuple[Any, tuple]:
    """The model (eval mode, f32, on ``device``) and its example inputs."""
    import torch

    torch.manual_seed(0)
    if name in ("resnet50", "vit_b_16", "convnext_tiny"):
        import torchvision

        if quick:
            model = {"resnet50": lambda: torchvision.models.resnet18(num_classes=10),
                     "vit_b_16": lambda: torchvision.models.VisionTransformer(
                         image_size=32, patch_size=16, num_layers=2, num_heads=2,
                         hidden_dim=32, mlp_dim=64, num_classes=10),
                     "convnext_tiny": lambda: _tiny_convnext(torchvision)}[name]()
            size = 32
        else:
            model, size = getattr(torchvision.models, name)(), 224
        inputs = (torch.randn(batch, 3, size, size),)
    else:
        import transformers as tf

        seq = 8 if quick else SEQ
        small = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512} if quick else {}
        if name == "bert_layer":
            cfg = tf.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128) \
                if quick else tf.BertConfig()
            model = tf.models.bert.modeling_bert.BertLayer(cfg)
            inputs = (torch.randn(batch, seq, cfg.hidden_size),)
        elif name == "gpt2_block":
            cfg = tf.GPT2Config(**small)
            model = tf.models.gpt2.modeling_gpt2.GPT2Block(cfg, layer_idx=0)
            inputs = (torch.randn(batch, seq, cfg.n_embd),)
        else:
            cfg = tf.GPT2Config(use_cache=False, **small)
            model = tf.GPT2LMHeadModel(cfg)
            inputs = (torch.randint(0, cfg.vocab_size, (batch, seq)),)
    model = model.eval().to(device)
    return model, tuple(t.to(device) for t in inputs)


def _tiny_convnext(torchvision: Any) -> Any:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=10)


def cast(model: Any, inputs: tuple, dtype: str) -> tuple[Any, tuple]:
    import torch

    if dtype == "f32":
        return model, inputs
    model = model.to(torch.bfloat16)
    return model, tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs)


# ---------------------------------------------------------------------- measuring
def tensors_of(out: Any) -> list[Any]:
    """Every tensor in a model's output (tuples, lists, dicts, HF ModelOutputs)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict) or hasattr(out, "to_tuple"):
        out = list(out.values()) if isinstance(out, dict) else list(out.to_tuple())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in tensors_of(o)]
    return []


def max_rel_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want|, over every output tensor (inf if shapes differ)."""
    g, w = tensors_of(got), tensors_of(want)
    if len(g) != len(w):
        return float("inf")
    worst = 0.0
    for a, b in zip(g, w):
        if a.shape != b.shape:
            return float("inf")
        if not b.is_floating_point():
            worst = max(worst, float((a != b).any()))
            continue
        scale = b.detach().float().abs().max().item() or 1.0
        worst = max(worst, (a.detach().float() - b.detach().float()).abs().max().item() / scale)
    return worst


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], device: str, quick: bool) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 200,
                                       return_mode="median")
    times = []
    for _ in range(2 if quick else 10):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def first_call(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def stage_seconds(profile: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds of the functions named in STAGES (the largest entry per name)."""
    stats = pstats.Stats(profile)
    best: dict[str, float] = {}
    for (filename, _, func), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        for stage, names in STAGES.items():
            in_triton = f"triton{os.sep}compiler" in filename
            if func in names and in_triton == (stage == "triton_compile"):
                best[stage] = max(best.get(stage, 0.0), cumulative)
    return {k: round(v, 3) for k, v in sorted(best.items())}


def measure(compiler: str, model: Any, inputs: tuple, args: argparse.Namespace,
            row: dict[str, Any]) -> tuple[Callable[[], Any], Any]:
    """Compile ``model`` with ``compiler`` and make its first call; adds the cold columns.
    Returns the call to time and the compiled model."""
    import torch

    import fxlite

    metrics = None
    if compiler == "inductor":
        try:
            import torch._inductor.metrics as metrics
        except ImportError:  # another torch version: no kernel count
            metrics = None
        torch._dynamo.reset()
        if metrics is not None:
            metrics.reset()
        compiled = torch.compile(model, mode=args.mode)
    elif compiler == "dynamo_fxlite":
        if "inductor" not in args.compilers:  # else reset by inductor's turn, just before
            torch._dynamo.reset()
        compiled = DynamoFxlite(model, args.mode)
    else:
        compiled = fxlite.compile(model, mode=args.mode)
    call = functools.partial(compiled, *inputs)
    profile = cProfile.Profile() if args.profile and compiler == "fxlite" else None
    if profile is not None:
        profile.enable()
    _, row[f"{compiler}_cold_s"] = first_call(call, args.device)
    if profile is not None:
        profile.disable()
        row["fxlite_cold_profile"] = stage_seconds(profile)
    if metrics is not None:
        row["inductor_kernels"] = metrics.generated_kernel_count
    return call, compiled


class DynamoFxlite:
    """``torch.compile(model, backend="fxlite")``, and the fxlite graphs it made: Dynamo
    hands each graph it captures (one per piece between graph breaks) to
    ``fxlite.compile``; ``kernels`` and ``fallbacks`` are theirs, as fxlite.compile's."""

    def __init__(self, model: Any, mode: str | None) -> None:
        import weakref

        import torch
        from fxlite.codegen import dynamo_backend

        self._backend = dynamo_backend
        if "fxlite" not in torch._dynamo.list_backends():  # fxlite on PYTHONPATH, not
            torch._dynamo.register_backend(name="fxlite")(  # installed: no entry point
                dynamo_backend.fxlite_backend)
        self._known = weakref.WeakSet(dynamo_backend.compiled_graphs())  # earlier cases'
        self.compiled = torch.compile(model, backend="fxlite", mode=mode)

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)

    @property
    def graphs(self) -> list[Any]:
        return [g for g in self._backend.compiled_graphs() if g not in self._known]

    @property
    def kernels(self) -> list[Any]:
        return [k for g in self.graphs for k in g.kernels]

    @property
    def fallbacks(self) -> list[str]:
        return [f for g in self.graphs for f in g.fallbacks]


def time_side_by_side(calls: dict[str, Callable[[], Any]], args: argparse.Namespace,
                      row: dict[str, Any]) -> None:
    """Each contender's median ms: ``ROUNDS`` rounds, each timing every contender in turn,
    so that a slow spell of the host falls on all of them (the H200 host's eager times of
    one model varied by 50% between runs); the median of the rounds is reported."""
    for _ in range(1 if args.quick else ROUNDS):
        for name, call in list(calls.items()):
            try:
                row.setdefault(f"{name}_rounds_ms", []).append(
                    round(median_ms(call, args.device, args.quick), 4))
            except Exception as e:  # a compiler that fails is a result, not a crash
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                del calls[name]
    for name in calls:
        row[f"{name}_ms"] = statistics.median(row[f"{name}_rounds_ms"])


def run_case(name: str, dtype: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    model, inputs = cast(*build(name, args.quick, batch, args.device), dtype)
    row: dict[str, Any] = {"model": name, "dtype": dtype, "batch": batch,
                           "mode": args.mode or "default"}
    with torch.no_grad():
        want = model(*inputs)
        calls: dict[str, Callable[[], Any]] = {"eager": functools.partial(model, *inputs)}
        compiled: dict[str, Any] = {}
        for compiler in args.compilers:
            if compiler == "eager":
                continue
            try:
                calls[compiler], compiled[compiler] = measure(compiler, model, inputs, args, row)
            except Exception as e:  # a compiler that fails is a result, not a crash
                row[f"{compiler}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            if args.device == "cuda":
                torch.cuda.empty_cache()
        time_side_by_side(calls, args, row)
        for compiler in compiled:
            if compiler not in calls:
                continue
            # The error of a call made after the timing: fxlite's first call is the eager run
            # it records, and a GPU segment settles on kernels or recorded ops in its first calls.
            row[f"{compiler}_max_rel_err"] = max_rel_error(calls[compiler](), want)
            if compiler in ("fxlite", "dynamo_fxlite"):
                row[f"{compiler}_kernels"] = len(compiled[compiler].kernels)
                row[f"{compiler}_fallbacks"] = [str(f)[:200] for f in compiled[compiler].fallbacks]
            if compiler == "dynamo_fxlite":
                row["dynamo_fxlite_graphs"] = len(compiled[compiler].graphs)
    for compiler in ("inductor", "fxlite", "dynamo_fxlite"):
        if f"{compiler}_ms" in row:
            row[f"{compiler}_speedup"] = row["eager_ms"] / row[f"{compiler}_ms"]
    for compiler in ("fxlite", "dynamo_fxlite"):
        if f"{compiler}_ms" in row and "inductor_ms" in row:
            row[f"{compiler}_vs_inductor"] = row["inductor_ms"] / row[f"{compiler}_ms"]
    return row


# ---------------------------------------------------------------------- reporting
def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (no third-party formatter needed)."""
    cols = [("model", "model", ""), ("dtype", "dtype", ""), ("batch", "batch", ""),
            ("eager ms", "eager_ms", ".3f"), ("inductor ms", "inductor_ms", ".3f"),
            ("fxlite ms", "fxlite_ms", ".3f"), ("inductor x", "inductor_speedup", ".2f"),
            ("fxlite x", "fxlite_speedup", ".2f"), ("fxlite/inductor", "fxlite_vs_inductor", ".2f"),
            ("inductor cold s", "inductor_cold_s", ".1f"), ("fxlite cold s", "fxlite_cold_s", ".1f"),
            ("kernels (fx/ind)", None, ""), ("fallbacks", None, ""),
            ("max rel err (fx/ind)", None, "")]
    if any(k.startswith("dynamo_fxlite_") for r in rows for k in r):  # --dynamo-fxlite
        cols += [("dynamo+fxlite ms", "dynamo_fxlite_ms", ".3f"),
                 ("dynamo+fxlite x", "dynamo_fxlite_speedup", ".2f"),
                 ("dynamo+fxlite/inductor", "dynamo_fxlite_vs_inductor", ".2f"),
                 ("dynamo+fxlite cold s", "dynamo_fxlite_cold_s", ".1f"),
                 ("dynamo+fxlite graphs/kernels/fallbacks", None, ""),
                 ("dynamo+fxlite max rel err", "dynamo_fxlite_max_rel_err", ".1e")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = []
        for title, key, spec in cols:
            if key is not None:
                cells.append(_fmt(r.get(key), spec))
            elif title.startswith("kernels"):
                cells.append(f"{_fmt(r.get('fxlite_kernels'), '')}/{_fmt(r.get('inductor_kernels'), '')}")
            elif title == "fallbacks":
                fb = r.get("fxlite_fallbacks")
                cells.append("-" if fb is None else str(len(fb)))
            elif title.startswith("dynamo+fxlite graphs"):
                fb = r.get("dynamo_fxlite_fallbacks")
                cells.append(f"{_fmt(r.get('dynamo_fxlite_graphs'), '')}/"
                             f"{_fmt(r.get('dynamo_fxlite_kernels'), '')}/"
                             f"{'-' if fb is None else len(fb)}")
            else:
                cells.append(f"{_fmt(r.get('fxlite_max_rel_err'), '.1e')}/"
                             f"{_fmt(r.get('inductor_max_rel_err'), '.1e')}")
        lines.append("| " + " | ".join(cells) + " |")
    errors = [(r["model"], r["dtype"], r["batch"], k, v) for r in rows for k, v in r.items()
              if k.endswith("_error")]
    for model, dtype, batch, k, v in errors:
        lines.append(f"\n{model} {dtype} b{batch}: {k[:-6]} failed: {v}")
    profiles = [r for r in rows if r.get("fxlite_cold_profile")]
    if profiles:
        lines.append("\nfxlite cold compile by stage (cumulative s; stages nest):")
        for r in profiles:
            stages = ", ".join(f"{k} {v}" for k, v in r["fxlite_cold_profile"].items())
            lines.append(f"- {r['model']} {r['dtype']} b{r['batch']}: {stages}")
    return "\n".join(lines)


def facts(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join(shlex.quote(a) for a in sys.argv), "python": platform.python_version(),
           "torch": torch.__version__, "device": args.device, "quick": args.quick,
           "precompile": not args.no_precompile and args.device == "cuda"}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_runs:
        print("\n".join(list_runs()))
        return 0
    if args.merge:
        rows, runs = [], []
        for path in args.merge:
            with open(path) as f:
                data = json.load(f)
            rows += data["rows"]
            runs.append(data["facts"])
        for run in runs:
            print(f"- {run.get('gpu', run['device'])}, {run['date']}, torch {run['torch']}, "
                  f"triton {run.get('triton')}: `{run['command']}`")
        print(table(rows))
        return 0
    _prepare_environment(args.device)
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_models.py: no CUDA device; use --device cpu for a smoke test")
        torch.backends.cuda.matmul.allow_tf32 = True  # "f32" means f32 weights with TF32 on
        torch.backends.cudnn.allow_tf32 = True
        if args.no_precompile:
            import fxlite.codegen.lower.pipeline as pipeline

            pipeline.PRECOMPILE = False
    budget = args.budget if args.budget is not None else (480.0 if args.device == "cuda" else None)
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    longest = 0.0
    for name in args.models:
        for dtype in args.dtypes:
            for batch in args.batches:
                if budget is not None and time.perf_counter() - began + longest > budget:
                    skipped.append(f"{name} {dtype} b{batch}")
                    continue
                start = time.perf_counter()
                row = run_case(name, dtype, batch, args)
                row["case_s"] = round(time.perf_counter() - start, 1)
                longest = max(longest, row["case_s"])
                rows.append(row)
                print(f"{name} {dtype} b{batch}: done in {row['case_s']} s", file=sys.stderr)
                _write(args.json, {"facts": facts(args), "rows": rows, "skipped": skipped})
    _write(args.json, {"facts": facts(args), "rows": rows, "skipped": skipped})
    print(table(rows))
    if skipped:
        print(f"\nskipped (time budget {budget} s): {', '.join(skipped)}; run them with --models")
    return 0


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
