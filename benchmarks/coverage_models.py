"""Tracing and compile coverage: torchvision's classification models and 20 timm models.

For each model (random weights, eval mode, one 224x224 image unless ``--size``,
``torch.no_grad()``):

- **traced**: ``fxlite.symbolic_trace(model)`` runs and equals eager;
- **python**: ``fxlite.compile(model, backend="python")`` equals eager, with no fallback;
- **triton** (``--triton``; on by default with ``--device cuda``): ``fxlite.compile(model)``
  equals eager (the dtype's tolerance), its kernel count, fallbacks, and its speedup over
  eager (medians of ``triton.testing.do_bench`` after 30 calls each: a compiled model's
  first calls also run its trial of kernels against recorded ops, and write its
  straight-line forwards).

::

    python benchmarks/coverage_models.py --device cpu --json cov.json     # trace + python
    PYTHONPATH=$PWD python benchmarks/coverage_models.py --json cov.json  # on a GPU: all

Needs torchvision and timm. A failure is a row of the table (the first line of its
error), never a crash of the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

# One or two per torchvision classification family (19).
TORCHVISION = ("alexnet", "vgg16_bn", "resnet18", "resnet50", "resnext50_32x4d",
               "densenet121", "squeezenet1_1", "googlenet", "inception_v3", "mobilenet_v2",
               "mobilenet_v3_large", "shufflenet_v2_x1_0", "mnasnet1_0", "efficientnet_b0",
               "regnet_y_400mf", "convnext_tiny", "vit_b_16", "swin_t", "maxvit_t")
# resnets, efficientnets, vits, convnexts and regnets from timm (20).
TIMM = ("resnet18", "resnet50", "resnet50d", "seresnet50", "resnext50_32x4d",
        "efficientnet_b0", "efficientnet_b2", "tf_efficientnet_b0", "mobilenetv3_large_100",
        "efficientnetv2_rw_t", "vit_tiny_patch16_224", "vit_small_patch16_224",
        "vit_base_patch16_224", "deit_small_patch16_224", "convnext_atto", "convnext_tiny",
        "convnextv2_atto", "regnetx_002", "regnety_004", "regnety_016")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suites", default="torchvision,timm", help="torchvision, timm or both")
    p.add_argument("--models", default="", help="comma-separated names to keep (any suite)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    p.add_argument("--triton", action=argparse.BooleanOptionalAction, default=None,
                   help="compile with Triton kernels too (default: on cuda only)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--size", type=int, default=224,
                   help="image size, for models that take any (smaller is faster under the "
                        "CPU interpreter); transformers keep 224")
    p.add_argument("--json", metavar="OUT", help="write the rows to OUT (after every model)")
    args = p.parse_args(argv)
    args.suites = [s for s in args.suites.split(",") if s]
    if not set(args.suites) <= {"torchvision", "timm"} or not args.suites:
        p.error("--suites takes torchvision, timm or both")
    args.models = {m for m in args.models.split(",") if m}
    if args.triton is None:
        args.triton = args.device == "cuda"
    return args


def cases(args: argparse.Namespace) -> list[tuple[str, str]]:
    out = [(suite, m) for suite, names in (("torchvision", TORCHVISION), ("timm", TIMM))
           if suite in args.suites for m in names]
    return [c for c in out if not args.models or c[1] in args.models]


def build(suite: str, name: str) -> Any:
    if suite == "torchvision":
        import torchvision

        kwargs = {"aux_logits": False, "init_weights": False} if name in (
            "googlenet", "inception_v3") else {}
        return getattr(torchvision.models, name)(weights=None, **kwargs)
    import timm

    return timm.create_model(name, pretrained=False)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def _close(got: Any, want: Any, tol: float) -> str | None:
    """None if every output tensor matches, else what differs."""
    import torch

    g = got if isinstance(got, (tuple, list)) else [got]
    w = want if isinstance(want, (tuple, list)) else [want]
    if len(g) != len(w):
        return f"{len(g)} outputs, eager has {len(w)}"
    for a, b in zip(g, w):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return "output shapes differ"
        scale = b.float().abs().max().item() or 1.0
        err = (a.float() - b.float()).abs().max().item() / scale
        if not err <= tol:
            return f"max relative error {err:.2e}"
    return None


_SETTLE = 30  # calls before timing: fxlite's trial and straight-line forwards are made then


def _median_ms(fn: Any, device: str) -> float:
    if device == "cuda":
        import triton.testing

        for _ in range(_SETTLE):
            fn()
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_model(suite: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import fxlite

    row: dict[str, Any] = {"suite": suite, "model": name}
    torch.manual_seed(0)
    try:
        model = build(suite, name).eval().to(args.device)
    except Exception as e:
        row["build"] = _first_line(e)
        return row
    fixed = any(k in name for k in ("vit", "deit", "swin", "maxvit"))  # position tables
    size = 224 if fixed else args.size
    x = torch.randn(args.batch, 3, size, size, device=args.device)
    if args.dtype == "bf16":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    tol = 2e-2 if args.dtype == "bf16" else 1e-4
    with torch.no_grad():
        want = model(x)
        try:
            gm = fxlite.symbolic_trace(model)
            bad = _close(gm(x), want, tol)
            row["traced"] = bad or "ok"
        except Exception as e:
            row["traced"] = _first_line(e)
        try:
            py = fxlite.compile(model, backend="python")
            bad = _close(py(x), want, tol)
            row["python"] = bad or ("ok" if not py.fallbacks else f"fallback: {py.fallbacks[0]}")
        except Exception as e:
            row["python"] = _first_line(e)
        if args.triton:
            try:
                compiled = fxlite.compile(model)
                start = time.perf_counter()
                got = compiled(x)
                row["cold_s"] = round(time.perf_counter() - start, 2)
                bad = _close(got, want, tol)
                row["triton"] = bad or ("ok" if not compiled.fallbacks else
                                        f"{len(compiled.fallbacks)} fallbacks")
                row["kernels"] = len(compiled.kernels)
                row["fallbacks"] = [str(f)[:160] for f in compiled.fallbacks]
                eager_ms = _median_ms(functools.partial(model, x), args.device)
                row["speedup"] = round(eager_ms / _median_ms(functools.partial(compiled, x),
                                                             args.device), 3)
            except Exception as e:
                row["triton"] = _first_line(e)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["suite", "model", "traced", "python", "triton", "kernels", "speedup"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r.get(c, r.get("build", "-") if c == "traced" else "-")) for c in cols]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    for col in ("traced", "python", "triton"):
        done = [r for r in rows if col in r]
        if done:
            ok = sum(r[col] == "ok" for r in done)
            lines.append(f"\n{col}: {ok}/{len(done)} ok")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = tempfile.mkdtemp(prefix="fxlite-coverage-")
    os.environ.setdefault("FXLITE_CACHE_DIR", os.path.join(root, "fxlite"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    if args.device == "cpu" and args.triton:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    rows = []
    for suite, name in cases(args):
        start = time.perf_counter()
        row = run_model(suite, name, args)
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(f"{suite} {name}: traced {row.get('traced')}, python {row.get('python')}, "
              f"triton {row.get('triton', '-')} ({row['seconds']} s)", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": sys.argv[1:], "rows": rows}, f, indent=1, default=str)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
