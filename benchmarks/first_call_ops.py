"""Where a compile's host time goes, by ATen op: which stage of fxlite ran it, in which
dtype and layout.

Run on a CUDA machine (torchvision and transformers installed)::

    PYTHONPATH=$PWD python benchmarks/first_call_ops.py efficientnet_b0:f32 [--top 20]

Each case is ``model:dtype`` with the models and dtypes of ``bench_models.py`` (batch 32,
``--batch``), under ``torch.no_grad()``. Eager runs the model once first (its own cuDNN
plans, its allocator's blocks), then each of ``fxlite.compile``'s first ``--calls`` calls
(1) runs under ``torch.profiler``, with fxlite's stages marked by ``record_function``
labels (:data:`LABELS`; Python stacks cannot tell them: the capture's own ``setprofile``
displaces the profiler's). Every top-level ATen op (one no other ATen op called) is put
down to the innermost label around it, or ``run`` (the call's own execution). Printed per
call: the milliseconds of each stage, then the ops with the most time by stage, op, dtype
of the first tensor and its layout (``cl``: channels-last strides, ``t``: other
non-row-major ones), with counts.

The profiler slows every op by a similar amount, so the figures are for comparing the
rows with each other, not for the call's wall time. ``--device cpu --quick`` runs the
scaled-down models on the CPU (under ``TRITON_INTERPRET=1``; there the first call records
and the second compiles): a smoke test of the script.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402

import fxlite  # noqa: E402

# (module, function) -> the stage label of its calls; the innermost label of an op wins
LABELS = (
    ("fxlite.codegen.compile", "record", "record"),
    ("fxlite.codegen.compile", "compile_segment", "lower"),
    ("fxlite.codegen.lower.segment", "run_passes", "passes"),
    ("fxlite.codegen.lower.pipeline", "precompile", "precompile"),
    ("fxlite.codegen.lower.segment", "check_group", "group check"),
    ("fxlite.codegen.lower.autograd_pipeline", "check_group", "group check"),
    ("fxlite.codegen.lower.accuracy", "_run_reference", "wider run"),
)
_STAGES = {label for _, _, label in LABELS}


def label_stages() -> list[tuple[Any, str, Any]]:
    """Wrap each function of :data:`LABELS` where its callers look it up; returns what to
    put back (``(module, name, function)`` each)."""
    import functools
    import importlib

    undo = []
    for module_name, attr, label in LABELS:
        module = importlib.import_module(module_name)
        fn = getattr(module, attr)

        @functools.wraps(fn)
        def labelled(*args: Any, _fn: Any = fn, _label: str = label, **kwargs: Any) -> Any:
            with torch.profiler.record_function(_label):
                return _fn(*args, **kwargs)

        undo.append((module, attr, fn))
        setattr(module, attr, labelled)
    return undo


def stage_of(event: Any) -> str:
    """The innermost stage label around ``event``, or ``run``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in _STAGES:
            return parent.name
        parent = parent.cpu_parent
    return "run"


def layout_of(strides: list[Any]) -> str:
    """``cl`` for 4-d channels-last strides, ``t`` for other non-row-major ones, else ``""``."""
    if not strides or not isinstance(strides[0], list) or len(strides[0]) < 2:
        return ""
    s = strides[0]
    if len(s) == 4 and s[1] == 1 and s[3] > 1:
        return "cl"
    return "" if all(a >= b for a, b in zip(s, s[1:])) else "t"


def top_level(events: list[Any]) -> list[Any]:
    """ATen ops that no other ATen op called."""
    out = []
    for e in events:
        if getattr(e, "is_python_function", False) or not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            out.append(e)
    return out


def profile_first_calls(name: str, dtype: str, batch: int, device: str, quick: bool,
                        top: int, calls: int) -> None:
    """Profile the first ``calls`` calls of a fresh ``fxlite.compile`` of the model, one
    table each (on the CPU the first call records, and the second compiles)."""
    from torch.profiler import ProfilerActivity, profile

    model, inputs = bm.build(name, quick, batch, device)
    model, inputs = bm.cast(model, inputs, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        model(*inputs)
        sync()
        undo = label_stages()
        try:
            f = fxlite.compile(model)
            for call in range(calls):
                start = time.perf_counter()
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    f(*inputs)
                    sync()
                report(f"{name}:{dtype} batch {batch}, call {call + 1}", prof,
                       time.perf_counter() - start, top)
        finally:
            for module, attr, fn in undo:
                setattr(module, attr, fn)


def report(title: str, prof: Any, seconds: float, top: int) -> None:
    """Print the stages and the op table of one profiled call."""
    stages: dict[str, float] = collections.Counter()
    rows: dict[tuple, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in top_level(list(prof.events())):
        stage = stage_of(e)
        ms = e.cpu_time_total / 1e3
        stages[stage] += ms
        # torch before 2.12 keeps neither dtypes nor strides on the event: blank columns
        dtypes = [d for d in (getattr(e, "input_dtypes", None) or []) if d]
        key = (stage, e.name, dtypes[0] if dtypes else "",
               layout_of(getattr(e, "structured_input_strides", None) or []))
        rows[key][0] += 1
        rows[key][1] += ms
    print(f"== {title}: {seconds:.2f} s under the profiler")
    print("   stages (ms of top-level ATen ops): " + ", ".join(
        f"{s} {ms:.0f}" for s, ms in sorted(stages.items(), key=lambda kv: -kv[1])))
    print(f"   {'stage':<12} {'op':<36} {'dtype':<10} {'layout':<6} {'calls':>6} {'ms':>9}")
    for (stage, op, dt, lay), (n, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"   {stage:<12} {op:<36} {dt:<10} {lay:<6} {n:>6} {ms:>9.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", help="comma-separated model:dtype (f32 or bf16)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--top", type=int, default=20, help="rows of the op table")
    p.add_argument("--calls", type=int, default=1, help="profile each of the first N calls")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="scaled-down models (a smoke test)")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    for case in args.cases.split(","):
        name, dtype = case.split(":")
        profile_first_calls(name, dtype, args.batch, args.device, args.quick, args.top,
                            args.calls)


if __name__ == "__main__":
    main()
