"""Real models: eager vs torch.compile (inductor) vs fxlite.compile, side by side.

The project's broad benchmark. On a CUDA machine (one process per command, each under
the device tool's 10-minute limit)::

    python benchmarks/bench_models.py --models all --list-runs   # the commands of a full run
    PYTHONPATH=$PWD python benchmarks/bench_models.py --models resnet50,swin_t --json out/a.json
    python benchmarks/bench_models.py --merge out/*.json          # the tables for BENCHMARKS.md
    python benchmarks/bench_models.py --suites timm --list-models  # names, suite, estimate

``--list-runs`` packs the selected models into commands whose estimated time (a model's
``ESTIMATE_S``, else its suite's ``SUITE_ESTIMATE_S``, plus ``STARTUP_S`` a command) fits
``--budget`` (default 480 s); inside a command the same budget stops it from starting a
case that would end late, and lists what it skipped.

The models are a registry (``REGISTRY``: name -> (suite, builder)), random weights:

- ``torchvision``: one or two models of every classification family (``TORCHVISION_MODELS``:
  coverage_models.TORCHVISION plus regnet_y_1_6gf, efficientnet_v2_s, wide_resnet50_2),
  224x224 images (inception_v3: 299x299);
- ``timm``: coverage_models.TIMM as ``timm_<name>`` (``timm.create_model(name,
  pretrained=False)``, 224x224; timm is imported only when such a model is built);
- ``hf`` (transformers, from configs, ``SEQ`` tokens a sequence): ``bert_layer`` (one
  BertLayer of bert-base), ``bert_base`` (BertModel), ``gpt2_block``, ``gpt2_lm``
  (GPT2LMHeadModel), ``t5_encoder`` (T5EncoderModel of the default T5Config: t5-small),
  ``llama_gqa`` (LlamaForCausalLM, a ~155M-parameter Llama with grouped-query attention:
  hidden 1024, 8 layers, 16 heads, 4 key/value heads, intermediate 2816, vocab 32000),
  ``hf_vit`` (ViTModel of the default ViTConfig: ViT-B/16, 224x224) and ``wav2vec2``
  (Wav2Vec2Model of the default Wav2Vec2Config on 1 s of 16 kHz audio).

``--models`` takes names or ``all``; ``--suites torchvision,timm,hf`` takes whole suites
(with ``--models``, it keeps the named models of those suites). The default is the six
models of the earlier tables (resnet50, vit_b_16, convnext_tiny, bert_layer, gpt2_block,
gpt2_lm). timm and transformers (and torchvision) are benchmark extras, not fxlite's
dependencies: a model whose package is missing is skipped, and said so.

For each model, dtype (f32 with TF32 on, bf16 weights) and batch (1, 32), in eval mode
under ``torch.no_grad()``, in one process: the median ms of each compiler
(``triton.testing.do_bench``), speedup over eager, fxlite's ratio to inductor (inductor ms
/ fxlite ms: above 1 is faster), the cold compile of each (the first call's wall time,
with empty cache folders: every compiler starts cold in this process; fxlite compiles
before inductor, so what the process pays once, such as cuDNN's plans, falls on fxlite's
first call, not inductor's: ``ORDER``), the total wall
time of each compiler's first ``FIRST_CALLS`` (20) calls, the cold one included
(``<compiler>_first20_s``; eager's first call is the reference of the errors), the peak
GPU memory during those calls (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``, MiB, ``<compiler>_peak_mib``: it counts the weights, the
inputs, eager's reference outputs and whatever an earlier compiler of the case still
holds; None on CPU), fxlite's kernel count and fallbacks, inductor's generated kernel
count, and the max relative error of each against eager (max |y - y_eager| / max |y_eager|
over every output). After the table: the geometric mean of fxlite's speedups over
inductor and over eager, per dtype and batch, over the rows that have both times.
``--profile`` adds where fxlite's cold compile spends its time (cProfile, cumulative
seconds per pipeline stage).

``--dynamo-fxlite`` adds a column for ``torch.compile(model, backend="fxlite")``: Dynamo
captures the graphs and fxlite compiles each one (``fxlite.codegen.dynamo_backend``), with
the same measures (steady-state ms, speedup, ratio to inductor, cold first call, error
against eager) plus the number of graphs Dynamo handed over and their kernels. It is off
by default since it adds a third cold compile to every case (``--list-runs`` does not
include it: add the flag to a command).

``--quick --device cpu`` is a smoke test of the script itself: scaled-down models (tiny
configs; torchvision models without a tiny variant at 64x64, timm ones too), the Triton
interpreter, no timing worth reporting.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import json
import math
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

try:
    from coverage_models import TIMM, TORCHVISION
except ImportError:  # loaded by path (the tests): benchmarks/ is not on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from coverage_models import TIMM, TORCHVISION

# The default --models: the six of the earlier tables in BENCHMARKS.md.
MODELS = ("resnet50", "vit_b_16", "convnext_tiny", "bert_layer", "gpt2_block", "gpt2_lm")
SUITES = ("torchvision", "timm", "hf")
# coverage_models.TORCHVISION's 19, and the families or sizes it leaves out.
TORCHVISION_MODELS = TORCHVISION + ("regnet_y_1_6gf", "efficientnet_v2_s", "wide_resnet50_2")
HF_MODELS = ("bert_layer", "bert_base", "gpt2_block", "gpt2_lm", "t5_encoder", "llama_gqa",
             "hf_vit", "wav2vec2")
COMPILERS = ("eager", "inductor", "fxlite")  # the default columns
# The default order the compilers of a case compile and make their first calls in
# (--compilers reorders them): a compile pays what no earlier one in the process paid,
# such as cuDNN's plans for the channels-last convolutions both run (about 3 s of
# efficientnet_b0's first call, BENCHMARKS.md), so fxlite goes first, against itself.
ORDER = ("eager", "fxlite", "inductor")
# torch.compile(model, backend="fxlite"): with --dynamo-fxlite or --compilers
EXTRA_COMPILERS = ("dynamo_fxlite",)
DTYPES = ("f32", "bf16")
BATCHES = (1, 32)
SEQ = 128  # tokens per sequence for the transformers models
ROUNDS = 3  # timing rounds per case, each timing every contender in turn
FIRST_CALLS = 20  # <compiler>_first20_s and <compiler>_peak_mib cover calls 1..FIRST_CALLS

# Estimated seconds of a model's four cases (f32, bf16 x batch 1, 32) on an H200, for
# --list-runs. From the H200 runs of the six models (session 18: 18 to 74 s for four cases,
# inductor's cold compile, 3 to 11 s a case, being most of it), scaled by graph size (the
# fxlite kernel counts of coverage_models' H200 runs: resnet50 49, densenet121 121,
# maxvit_t 201) and rounded up; the others take their suite's default.
SUITE_ESTIMATE_S = {"torchvision": 80.0, "timm": 80.0, "hf": 90.0}
ESTIMATE_S = {
    "resnet50": 80.0, "vit_b_16": 60.0, "convnext_tiny": 60.0, "bert_layer": 35.0,
    "gpt2_block": 25.0, "gpt2_lm": 55.0, "alexnet": 50.0, "squeezenet1_1": 50.0,
    "resnet18": 60.0, "densenet121": 150.0, "googlenet": 100.0, "inception_v3": 120.0,
    "mobilenet_v3_large": 100.0, "efficientnet_b0": 100.0, "efficientnet_v2_s": 150.0,
    "regnet_y_400mf": 100.0, "regnet_y_1_6gf": 120.0, "swin_t": 140.0, "maxvit_t": 200.0,
    "timm_resnet18": 60.0, "timm_seresnet50": 100.0, "timm_efficientnet_b0": 100.0,
    "timm_efficientnet_b2": 110.0, "timm_tf_efficientnet_b0": 100.0,
    "timm_mobilenetv3_large_100": 100.0, "timm_efficientnetv2_rw_t": 150.0,
    "timm_vit_tiny_patch16_224": 60.0, "timm_deit_small_patch16_224": 60.0,
    "timm_regnety_004": 100.0, "timm_regnety_016": 120.0, "bert_base": 100.0,
    "llama_gqa": 120.0, "wav2vec2": 120.0, "hf_vit": 90.0,
}
STARTUP_S = 40.0  # a command's imports, CUDA start and first-case warm-up

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
    p.add_argument("--models", default=None,
                   help=f"comma-separated names of REGISTRY, or all (default: "
                        f"{','.join(MODELS)}; --list-models lists them)")
    p.add_argument("--suites", default=None,
                   help=f"comma-separated, from {', '.join(SUITES)}: their models (with "
                        "--models: the named models of these suites)")
    p.add_argument("--list-models", action="store_true",
                   help="print the registry's models, suite and estimate each, and exit")
    p.add_argument("--compilers", default=",".join(ORDER),
                   help="comma-separated, from eager, inductor, fxlite, dynamo_fxlite, "
                        "compiled in this order (eager always runs first; dynamo_fxlite "
                        "after inductor)")
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
                   help="print the commands that run the selected models, grouped to fit "
                        "--budget each, and exit")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="print the tables of earlier --json files and exit")
    args = p.parse_args(argv)
    args.suites = _choices(args.suites, SUITES, "suite") if args.suites else None
    args.models = select_models(args.models, args.suites)
    given = _choices(args.compilers, COMPILERS + EXTRA_COMPILERS, "compiler")
    given += ["dynamo_fxlite"] if args.dynamo_fxlite else []
    # eager first; inductor's torch._dynamo.reset() comes before dynamo_fxlite
    args.compilers = ["eager"] + [c for c in dict.fromkeys(given) if c not in (
        "eager", "dynamo_fxlite")] + (["dynamo_fxlite"] if "dynamo_fxlite" in given else [])
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


def select_models(models: str | None, suites: list[str] | None) -> list[str]:
    """The names ``--models`` and ``--suites`` select, in ``--models``' order (registry
    order for ``all`` or suites alone); the default is ``MODELS``."""
    if models is None:
        if suites is None:
            return list(MODELS)
        return [m for m, (suite, _) in REGISTRY.items() if suite in suites]
    names = list(REGISTRY) if models.strip() == "all" else _choices(models, tuple(REGISTRY),
                                                                   "model")
    if suites is not None:
        names = [m for m in names if REGISTRY[m][0] in suites]
    if not names:
        raise SystemExit(f"bench_models.py: no model of {models!r} is in suites {suites}")
    return names


def estimate_s(name: str, cases: int = 4) -> float:
    """Estimated seconds of ``cases`` cases of model ``name`` (``ESTIMATE_S``, else its
    suite's ``SUITE_ESTIMATE_S``: both for 4 cases)."""
    return ESTIMATE_S.get(name, SUITE_ESTIMATE_S[REGISTRY[name][0]]) * cases / 4


def group_runs(models: list[str], budget: float, cases: int = 4) -> list[list[str]]:
    """The models in commands of one suite each: every model, in order, joins the first
    command of its suite whose estimate (``STARTUP_S`` plus its models' ``estimate_s``)
    stays within ``budget``, else starts a command (alone, where it is over the budget by
    itself)."""
    groups: list[list[str]] = []
    totals: list[float] = []
    for name in models:
        cost = estimate_s(name, cases)
        for i, group in enumerate(groups):
            if REGISTRY[group[0]][0] == REGISTRY[name][0] and totals[i] + cost <= budget:
                group.append(name)
                totals[i] += cost
                break
        else:
            groups.append([name])
            totals.append(STARTUP_S + cost)
    return groups


def list_runs(args: argparse.Namespace | None = None, json_dir: str = "bench-out") -> list[str]:
    """The commands that run ``args``' models (default: ``MODELS``), grouped by
    ``group_runs`` to fit ``--budget`` (default 480 s); each writes its own JSON."""
    args = args or parse_args([])
    budget = args.budget if args.budget is not None else 480.0
    extra = ""
    if args.dtypes != list(DTYPES):
        extra += f" --dtypes {','.join(args.dtypes)}"
    if args.batches != list(BATCHES):
        extra += f" --batches {','.join(map(str, args.batches))}"
    if args.compilers != list(ORDER):
        extra += f" --compilers {','.join(args.compilers)}"
    if args.budget is not None:
        extra += f" --budget {args.budget:g}"
    if args.profile:  # cProfile slows fxlite's cold compile and first 20 calls: opt in
        extra += " --profile"
    out, count = [], {}
    for group in group_runs(args.models, budget, len(args.dtypes) * len(args.batches)):
        suite = REGISTRY[group[0]][0]
        count[suite] = count.get(suite, 0) + 1
        out.append(f"PYTHONPATH=$PWD python benchmarks/bench_models.py --models "
                   f"{','.join(group)}{extra} "
                   f"--json {json_dir}/bench_models_{suite}_{count[suite]}.json")
    return out


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
Builder = Callable[[bool, int], tuple[Any, tuple]]  # (quick, batch) -> model, inputs on CPU


def build(name: str, quick: bool, batch: int, device: str) -> tuple[Any, tuple]:
    """The model (eval mode, f32, on ``device``) and its example inputs."""
    import torch

    torch.manual_seed(0)
    model, inputs = REGISTRY[name][1](quick, batch)
    model = model.eval().to(device)
    return model, tuple(t.to(device) for t in inputs)


def _images(batch: int, size: int) -> tuple:
    import torch

    return (torch.randn(batch, 3, size, size),)


def _torchvision(name: str) -> Builder:
    """torchvision.models.<name>; with ``quick``, a tiny variant of the same family where
    there is one (32 to 56 pixels), else the model itself on 64x64 images (inception_v3:
    80) with 10 classes."""

    def builder(quick: bool, batch: int) -> tuple[Any, tuple]:
        import torchvision

        if quick and name in _TINY_TORCHVISION:
            model, size = _TINY_TORCHVISION[name](torchvision)
            return model, _images(batch, size)
        kwargs: dict[str, Any] = {"num_classes": 10} if quick else {}
        if name in ("googlenet", "inception_v3"):
            kwargs.update(aux_logits=False, init_weights=False)
        model = getattr(torchvision.models, name)(weights=None, **kwargs)
        size = (80 if quick else 299) if name == "inception_v3" else (64 if quick else 224)
        return model, _images(batch, size)

    return builder


def _tiny_convnext(torchvision: Any) -> Any:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=10)


# Scaled-down members of a family, and their image size, for --quick.
_TINY_TORCHVISION: dict[str, Callable[[Any], tuple[Any, int]]] = {
    "resnet50": lambda tv: (tv.models.resnet18(num_classes=10), 32),
    "vit_b_16": lambda tv: (tv.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10), 32),
    "convnext_tiny": lambda tv: (_tiny_convnext(tv), 32),
    "swin_t": lambda tv: (tv.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[4, 4],
        stochastic_depth_prob=0.0, num_classes=10), 32),
    # 56 pixels: the stem halves them, each of the two blocks halves them again, and every
    # block's grid (14, 7) must split into 7x7 partitions
    "maxvit_t": lambda tv: (tv.models.MaxVit(
        input_size=(56, 56), stem_channels=8, partition_size=7, block_channels=[8, 16],
        block_layers=[1, 1], head_dim=4, stochastic_depth_prob=0.0, num_classes=10), 56),
}


def _timm(name: str) -> Builder:
    """``timm.create_model(name, pretrained=False)`` on 224x224 images; with ``quick``,
    10 classes on 64x64 images (the vision transformers built for 64 pixels)."""

    def builder(quick: bool, batch: int) -> tuple[Any, tuple]:
        import timm  # a benchmark extra: imported only when a timm model is built

        kwargs: dict[str, Any] = {}
        if quick:
            kwargs["num_classes"] = 10
            if "vit" in name or "deit" in name:  # position tables of a fixed image size
                kwargs["img_size"] = 64
        return timm.create_model(name, pretrained=False, **kwargs), _images(
            batch, 64 if quick else 224)

    return builder


def _tokens(batch: int, seq: int, vocab: int) -> tuple:
    import torch

    return (torch.randint(0, vocab, (batch, seq)),)


def _hf(name: str) -> Builder:
    """A transformers model with random weights from its config (``SEQ`` tokens; tiny
    configs and 8 tokens with ``quick``)."""

    def builder(quick: bool, batch: int) -> tuple[Any, tuple]:
        import torch
        import transformers as tf

        seq = 8 if quick else SEQ
        if name in ("bert_layer", "bert_base"):
            cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, vocab_size=512) \
                if quick else tf.BertConfig()
            if name == "bert_layer":
                return (tf.models.bert.modeling_bert.BertLayer(cfg),
                        (torch.randn(batch, seq, cfg.hidden_size),))
            return tf.BertModel(cfg), _tokens(batch, seq, cfg.vocab_size)
        if name in ("gpt2_block", "gpt2_lm"):
            small = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512} if quick else {}
            if name == "gpt2_block":
                cfg = tf.GPT2Config(**small)
                return (tf.models.gpt2.modeling_gpt2.GPT2Block(cfg, layer_idx=0),
                        (torch.randn(batch, seq, cfg.n_embd),))
            cfg = tf.GPT2Config(use_cache=False, **small)
            return tf.GPT2LMHeadModel(cfg), _tokens(batch, seq, cfg.vocab_size)
        if name == "t5_encoder":
            cfg = tf.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                              vocab_size=512) if quick else tf.T5Config()  # t5-small
            return tf.T5EncoderModel(cfg), _tokens(batch, seq, cfg.vocab_size)
        if name == "llama_gqa":
            size = ({"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
                    if quick else
                    {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
                     "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000})
            cfg = tf.LlamaConfig(max_position_embeddings=2048, use_cache=False, **size)
            return tf.LlamaForCausalLM(cfg), _tokens(batch, seq, cfg.vocab_size)
        if name == "hf_vit":
            cfg = tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, image_size=32, patch_size=8) \
                if quick else tf.ViTConfig()  # ViT-B/16, 224x224
            return tf.ViTModel(cfg), _images(batch, cfg.image_size)
        if name == "wav2vec2":
            cfg = tf.Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2),
                                    conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                    num_conv_pos_embedding_groups=4) \
                if quick else tf.Wav2Vec2Config()  # wav2vec2-base
            samples = 1600 if quick else 16000  # 0.1 s or 1 s of 16 kHz audio
            return tf.Wav2Vec2Model(cfg), (torch.randn(batch, samples),)
        raise KeyError(name)

    return builder


# name -> (suite, builder): every model the benchmark knows.
REGISTRY: dict[str, tuple[str, Builder]] = {
    **{m: ("torchvision", _torchvision(m)) for m in TORCHVISION_MODELS},
    **{f"timm_{m}": ("timm", _timm(m)) for m in TIMM},
    **{m: ("hf", _hf(m)) for m in HF_MODELS},
}


def cast(model: Any, inputs: tuple, dtype: str) -> tuple[Any, tuple]:
    """The model and its floating-point inputs in ``dtype`` (f32: as they are; bf16)."""
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
    """The median ms of a call of ``fn`` (``triton.testing.do_bench`` on CUDA)."""
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


def first_calls(call: Callable[[], Any], device: str, calls: int = FIRST_CALLS,
                profile: cProfile.Profile | None = None) -> tuple[Any, float, float, float | None]:
    """Calls 1..``calls`` of ``call``, synchronized: the first call's output, its seconds
    (``profile`` enabled around it alone), the seconds of all of them, and the peak GPU
    memory allocated during them in MiB (None on CPU)."""
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    out = call()
    _sync(device)
    if profile is not None:
        profile.disable()
    cold = time.perf_counter() - start
    for _ in range(calls - 1):
        call()
    _sync(device)
    total = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return out, cold, total, peak


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
    """Compile ``model`` with ``compiler`` and make its first ``FIRST_CALLS`` calls; adds the
    cold, first-calls and peak-memory columns. Returns the call to time and the compiled
    model."""
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
    _, row[f"{compiler}_cold_s"], row[f"{compiler}_first{FIRST_CALLS}_s"], \
        row[f"{compiler}_peak_mib"] = first_calls(call, args.device, profile=profile)
    if profile is not None:
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
    """One row: model ``name`` in ``dtype`` at ``batch``, every compiler of ``args``."""
    import torch

    row: dict[str, Any] = {"model": name, "suite": REGISTRY[name][0], "dtype": dtype,
                           "batch": batch, "mode": args.mode or "default"}
    model, inputs = cast(*build(name, args.quick, batch, args.device), dtype)
    with torch.no_grad():
        calls: dict[str, Callable[[], Any]] = {"eager": functools.partial(model, *inputs)}
        # eager's first call is the reference of every error below
        want, row["eager_cold_s"], row[f"eager_first{FIRST_CALLS}_s"], row["eager_peak_mib"] = \
            first_calls(calls["eager"], args.device)
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
            (f"first {FIRST_CALLS} s (eager/ind/fx)", "first", ".2f"),
            ("peak MiB (eager/ind/fx)", "peak", ".0f"),
            ("kernels (fx/ind)", None, ""), ("fallbacks", None, ""),
            ("max rel err (fx/ind)", None, "")]
    if any(k.startswith("dynamo_fxlite_") for r in rows for k in r):  # --dynamo-fxlite
        cols += [("dynamo+fxlite ms", "dynamo_fxlite_ms", ".3f"),
                 ("dynamo+fxlite x", "dynamo_fxlite_speedup", ".2f"),
                 ("dynamo+fxlite/inductor", "dynamo_fxlite_vs_inductor", ".2f"),
                 ("dynamo+fxlite cold s", "dynamo_fxlite_cold_s", ".1f"),
                 (f"dynamo+fxlite first {FIRST_CALLS} s", f"dynamo_fxlite_first{FIRST_CALLS}_s",
                  ".2f"),
                 ("dynamo+fxlite peak MiB", "dynamo_fxlite_peak_mib", ".0f"),
                 ("dynamo+fxlite graphs/kernels/fallbacks", None, ""),
                 ("dynamo+fxlite max rel err", "dynamo_fxlite_max_rel_err", ".1e")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = []
        for title, key, spec in cols:
            if key in ("first", "peak"):  # eager/inductor/fxlite in one cell
                suffix = f"_first{FIRST_CALLS}_s" if key == "first" else "_peak_mib"
                cells.append("/".join(_fmt(r.get(c + suffix), spec) for c in COMPILERS))
            elif key is not None:
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
    means = geomean_lines(rows)
    if means:
        lines.append("\ngeometric mean of fxlite's speedups (rows with both times):")
        lines += means
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


def geomean(values: list[float]) -> float | None:
    """The geometric mean of positive ``values`` (None if there are none)."""
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def geomeans(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """fxlite's speedups, per dtype and batch and per dtype over every batch (batch None):
    the geometric mean of inductor ms / fxlite ms (``vs_inductor``) over the rows with
    both times, and of eager ms / fxlite ms (``vs_eager``), with the number of rows each."""

    def ratios(group: list[dict[str, Any]], over: str) -> list[float]:
        return [r[f"{over}_ms"] / r["fxlite_ms"] for r in group
                if r.get(f"{over}_ms") and r.get("fxlite_ms")]

    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        same = [r for r in rows if r["dtype"] == dtype]
        batches = sorted({r["batch"] for r in same}, reverse=True)
        for batch in batches + ([None] if len(batches) > 1 else []):
            group = [r for r in same if batch is None or r["batch"] == batch]
            vs_inductor, vs_eager = ratios(group, "inductor"), ratios(group, "eager")
            if vs_inductor or vs_eager:
                out.append({"dtype": dtype, "batch": batch,
                            "vs_inductor": geomean(vs_inductor), "n_inductor": len(vs_inductor),
                            "vs_eager": geomean(vs_eager), "n_eager": len(vs_eager)})
    return out


def geomean_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``geomeans`` as markdown list lines."""
    return [f"- {g['dtype']} {'all batches' if g['batch'] is None else 'b' + str(g['batch'])}: "
            f"fxlite/inductor {_fmt(g['vs_inductor'], '.3f')} over {g['n_inductor']} rows, "
            f"fxlite/eager {_fmt(g['vs_eager'], '.3f')} over {g['n_eager']} rows"
            for g in geomeans(rows)]


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
        print("\n".join(list_runs(args)))
        return 0
    if args.list_models:
        for name in args.models:
            print(f"{name} {REGISTRY[name][0]} {estimate_s(name):.0f}")
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
    missing: set[str] = set()  # models whose package is not installed
    for name in args.models:
        for dtype in args.dtypes:
            for batch in args.batches:
                if name in missing:
                    continue
                if budget is not None and time.perf_counter() - began + longest > budget:
                    skipped.append(f"{name} {dtype} b{batch}")
                    continue
                start = time.perf_counter()
                try:
                    row = run_case(name, dtype, batch, args)
                except ModuleNotFoundError as e:  # timm or another benchmark extra
                    skipped.append(f"{name} ({e.name} is not installed)")
                    print(f"{name}: skipped, {e.name} is not installed", file=sys.stderr)
                    missing.add(name)
                    continue
                except Exception as e:  # a model that fails to build or run eagerly: a row
                    row = {"model": name, "suite": REGISTRY[name][0], "dtype": dtype,
                           "batch": batch, "model_error": f"{type(e).__name__}: "
                           f"{str(e).splitlines()[0][:300] if str(e) else ''}"}
                row["case_s"] = round(time.perf_counter() - start, 1)
                longest = max(longest, row["case_s"])
                rows.append(row)
                print(f"{name} {dtype} b{batch}: done in {row['case_s']} s", file=sys.stderr)
                _write(args.json, {"facts": facts(args), "rows": rows, "skipped": skipped})
    _write(args.json, {"facts": facts(args), "rows": rows, "skipped": skipped})
    print(table(rows))
    if skipped:
        print(f"\nskipped (time budget {budget} s, or a missing package): {', '.join(skipped)}; "
              "run them with --models")
    return 0


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
