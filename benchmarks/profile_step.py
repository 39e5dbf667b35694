"""Where a compiled call spends host time: cProfile of eager and fxlite side by side.

Run on a CUDA machine::

    python benchmarks/profile_step.py --case gpt2_block_f32 [--steps 30] [--top 25]
    FXLITE_TRIAL=0 python benchmarks/profile_step.py --case resnet18 --gpu   # device time
    python benchmarks/profile_step.py --case resnet18 --gpu --mode reduce-overhead --inductor
    FXLITE_TRIAL=0 python benchmarks/profile_step.py --case resnet18 --blocks 8   # walls
    FXLITE_TRIAL=0 python benchmarks/profile_step.py --case nanogpt_124m --gaps --inductor

Uses the cases of ``bench_training.py``; prints each contender's median step time, then the
functions with the most own time in fxlite's steps (after warm-up, so no compiling).
With ``--gpu``, it prints instead how long the GPU was busy per step (torch.profiler over
3 steps) and the kernels that kept it busy longest, for each contender. With ``--memory``,
it prints each contender's peak memory step by step over the first steps (recording, the
trial, captures) and at steady state, and the memory a step leaves allocated. With
``--gaps``, the GPU's idle time a step that waited on the host, by the op that launched
late, then the host's time a step by thread and outermost op. With ``--blocks``, walls of
blocks of 20 steps, the contenders' blocks taking turns in one process, and the time
Python's garbage collector took in them.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_training import (  # noqa: E402
    WARMUP,
    gpt2_124m_case,
    gpt2_block_case,
    gpt2_lm_step_case,
    nanogpt_124m_case,
    resnet18_case,
    time_steps,
    vision_case,
)

import fxlite  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="gpt2_block_f32",
                        choices=["resnet18", "resnet50", "vit_b_16", "gpt2_block_f32",
                                 "gpt2_block_bf16", "gpt2_lm_step", "gpt2_124m",
                                 "nanogpt_124m"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"],
                        help="order of cProfile's table")
    parser.add_argument("--gpu", action="store_true", help="profile device time instead")
    parser.add_argument("--gaps", action="store_true",
                        help="where the GPU waits for the host: its idle time a step, by "
                             "thread and by the op that launched the kernel it waited for")
    parser.add_argument("--mode", default=None, help="compile mode (reduce-overhead: graphs)")
    parser.add_argument("--inductor", action="store_true", help="also profile torch.compile")
    parser.add_argument("--memory", action="store_true", help="peak memory step by step")
    parser.add_argument("--blocks", type=int, default=0, metavar="N",
                        help="instead of profiling: N blocks of 20 steps each, synchronized "
                             "only at their ends; the best and median block's ms a step")
    parser.add_argument("--memory-sites", type=int, default=0, metavar="STEPS",
                        help="with --memory: the allocation sites live at the peak of each of the "
                             "first STEPS steps (torch's memory history)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    make = {"resnet18": resnet18_case, "gpt2_block_f32": lambda: gpt2_block_case(torch.float32),
            "gpt2_block_bf16": lambda: gpt2_block_case(torch.bfloat16),
            "gpt2_lm_step": gpt2_lm_step_case, "gpt2_124m": gpt2_124m_case,
            "nanogpt_124m": nanogpt_124m_case,
            "resnet50": lambda: vision_case("resnet50", 32, 224, 1000),
            "vit_b_16": lambda: vision_case("vit_b_16", 32, 224, 1000)}[args.case]
    base, make_opt, data, step, _ = make()
    contenders = [("eager", step), ("fxlite", fxlite.compile(step, mode=args.mode))]
    if args.inductor:
        contenders.insert(1, ("torch.compile", torch.compile(step, mode=args.mode)))
    if args.blocks:
        interleaved_blocks(contenders, base, make_opt, data, args.blocks)
        return
    for label, fn in contenders:
        model = copy.deepcopy(base)
        opt = make_opt(model)
        if args.memory:
            if args.memory_sites:
                peak_sites(label, fn, model, opt, data, args.memory_sites, args.top)
            else:
                memory_profile(label, fn, model, opt, data)
            del model, opt
            torch.cuda.empty_cache()
            continue
        for i in range(WARMUP):
            fn(model, opt, *data[i % len(data)])
        ms = time_steps(fn, model, opt, data, args.steps)
        print(f"{label}: {ms:.3f} ms a step", flush=True)
        if args.gaps:
            gap_profile(fn, model, opt, data, args.top)
        elif args.gpu:
            gpu_profile(fn, model, opt, data, args.top)
            if label == "fxlite":
                print(f"tier: {fn.tier[:120]}; kernels {len(fn.kernels)}; runners "
                      f"{[type(s.run).__name__ for s in fn._last]}; fallbacks "
                      f"{[f[:160] for f in fn.fallbacks][:4]}", flush=True)
        elif label == "fxlite":
            print("fallbacks:", [f[:160] for f in fn.fallbacks][:4])
            profile = cProfile.Profile()
            profile.enable()
            time_steps(fn, model, opt, data, args.steps)
            profile.disable()
            pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)


@contextlib.contextmanager
def collections_timed():
    """Yields ``[seconds, gen0, gen1, gen2]``: the time Python's garbage collector spent
    inside the block, and its collections by generation."""
    found = [0.0, 0, 0, 0]
    start = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            found[0] += time.perf_counter() - start[0]
            found[1 + info["generation"]] += 1

    gc.callbacks.append(timed)
    try:
        yield found
    finally:
        gc.callbacks.remove(timed)


def interleaved_blocks(contenders, base, make_opt, data, blocks: int) -> None:
    """Print each contender's best and median ms a step over ``blocks`` blocks of 20 steps
    that take turns (:func:`take_turns`), each contender warmed up first on its own copy
    of the model."""
    runs = []
    for label, fn in contenders:
        model = copy.deepcopy(base)
        opt = make_opt(model)
        for i in range(WARMUP):
            fn(model, opt, *data[i % len(data)])
        runs.append((label, fn, model, opt))
    turns = take_turns(runs, data, blocks)
    for label, fn, _, _ in runs:
        times, collected = turns[label]
        kept = f"; kernels {len(fn.kernels)}" if label == "fxlite" else ""
        print(f"{label}: best {min(times):.2f} ms, median {statistics.median(times):.2f} "
              f"ms a step, over {blocks} blocks of 20 taking turns{kept}; Python's garbage "
              f"collector {collected[0] / blocks / 20 * 1e3:.3f} ms a step (collections by "
              f"generation {collected[1:]}); blocks {[round(t, 2) for t in times]}", flush=True)


def take_turns(runs, data, blocks: int) -> dict[str, tuple[list[float], list]]:
    """Per label of ``runs`` (``(label, fn, model, opt)``, warmed up), its ms a step of
    each of ``blocks`` blocks of 20 steps and what Python's garbage collector took in them
    (``collections_timed``'s list). The blocks take turns, in forward order on even rounds
    and backward on odd ones, so that a host whose speed drifts over the minutes of a run
    (the device hosts do, by 10% and more) slows all contenders alike, not the one that
    happened to run last."""
    out: dict[str, tuple[list[float], list]] = {r[0]: ([], [0.0, 0, 0, 0]) for r in runs}
    for r in range(blocks):
        for label, fn, model, opt in runs[::1 if r % 2 == 0 else -1]:
            times, collected = out[label]
            with collections_timed() as found:
                times += time_blocks(fn, model, opt, data, 1)
            collected[:] = [a + b for a, b in zip(collected, found)]
    return out


def time_blocks(fn, model, opt, data, blocks: int) -> list[float]:
    """ms a step of each block of 20 steps, synchronized only at the block's ends (the
    host's launches of one step overlap the GPU's work on the last, as in training)."""
    times = []
    torch.cuda.synchronize()
    for _ in range(blocks):
        start = time.perf_counter()
        for i in range(20):
            fn(model, opt, *data[i % len(data)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / 20 * 1e3)
    return times


def memory_profile(label: str, fn, model, opt, data) -> None:
    """Print the peak memory of each of the first steps and of steady-state steps, and
    what a step leaves allocated (GiB)."""
    gib = 2**30
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    peaks, kept = [], []
    for i in range(WARMUP + 6):
        torch.cuda.reset_peak_memory_stats()
        fn(model, opt, *data[i % len(data)])
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() / gib)
        kept.append((torch.cuda.memory_allocated() - start) / gib)
    print(f"{label}: before the first step {start / gib:.2f} GiB allocated")
    print(f"  peak per step:  {' '.join(f'{p:.2f}' for p in peaks)}")
    print(f"  kept per step:  {' '.join(f'{k:.2f}' for k in kept)}")
    print(f"  steady-state peak {max(peaks[-6:]):.2f} GiB, first steps' peak {max(peaks):.2f}",
          flush=True)
    if getattr(fn, "tier", None):
        print(f"  tier: {fn.tier}; kernels {len(fn.kernels)}; fallbacks "
              f"{[f[:160] for f in fn.fallbacks][:3]}")


def peak_sites(label: str, fn, model, opt, data, steps: int, top: int) -> None:
    """Run the first ``steps`` steps, each under torch's memory history; print, per step,
    the blocks live at its highest point (beyond what was allocated as the step began),
    grouped by the innermost two frames of fxlite and two of the model that allocated them."""
    for i in range(steps):
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        fn(model, opt, *data[i % len(data)])
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        _print_sites(f"{label}, step {i + 1}", snap, top)


def _print_sites(label: str, snap: dict, top: int) -> None:
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list]] = {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] in ("free_requested", "free") and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    sites: dict[str, int] = {}
    for size, frames in at_peak.values():
        ours = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames
                if "/fxlite/" in f["filename"] or "/codegen/" in f["filename"]
                or "/passes/" in f["filename"]]
        model = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames
                 if "transformers" in f["filename"] or "torchvision" in f["filename"]]
        key = " <- ".join(ours[:2] + model[:2]) or "(no fxlite or model frame)"
        sites[key] = sites.get(key, 0) + size
    print(f"{label}: {peak / 2**30:.2f} GiB allocated at its highest point (beyond what "
          "was allocated as it began), by site:")
    for key, size in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {size / 2**30:7.3f} GiB  {key}")


def gpu_profile(fn, model, opt, data, top: int) -> None:
    """Print the GPU's busy time per step and its longest-running kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            fn(model, opt, *data[i % len(data)])
        torch.cuda.synchronize()
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in device) / 3 / 1e3
    ours = sum(e.name.startswith("fx_") for e in device) / 3
    print(f"GPU busy {busy:.2f} ms a step; {len(device) / 3:.0f} kernels a step, {ours:.0f} "
          "of them fxlite's")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top,
                                    max_name_column_width=60))


def gap_profile(fn, model, opt, data, top: int) -> None:
    """Print the GPU's idle time per step that waited on the host, split by the launching
    thread and by the outermost CPU op around the launch of the kernel it waited for (a
    launch from Python, such as a Triton kernel's, has none: ``(python)``)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    steps = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            fn(model, opt, *data[i % len(data)])
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    ops: dict = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops.setdefault(e["tid"], []).append(e)
    engine = {e["tid"] for e in events if e.get("cat") == "cpu_op"
              and e["name"].startswith("autograd::engine::evaluate_function")}
    idle: dict[tuple[str, str], list[float]] = {}
    waits = busy = 0.0
    end = device[0]["ts"] + device[0]["dur"]
    for k in device:
        busy += k["dur"]
        gap = k["ts"] - end
        end = max(end, k["ts"] + k["dur"])
        launch = launches.get(k.get("args", {}).get("correlation"))
        if gap <= 0 or launch is None or launch["ts"] + launch["dur"] < k["ts"] - gap:
            continue  # no gap, or the launch came before the GPU went idle (a dependency)
        waits += gap
        around = [o for o in ops.get(launch["tid"], ())
                  if o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]
        outer = min(around, key=lambda o: o["ts"])["name"] if around else "(python)"
        where = "backward (engine)" if launch["tid"] in engine else "main thread"
        entry = idle.setdefault((where, outer[:90]), [0.0, 0])
        entry[0] += gap
        entry[1] += 1
    span = (end - device[0]["ts"]) / steps / 1e3
    print(f"GPU span {span:.2f} ms a step, busy {busy / steps / 1e3:.2f}, idle waiting on the "
          f"host {waits / steps / 1e3:.2f}")
    for (where, outer), (gap, count) in sorted(idle.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {gap / steps / 1e3:7.3f} ms  {count / steps:6.1f} gaps  {where:18s} {outer}")
    host_time(ops, engine, launches, steps, top)
    sys.stdout.flush()


def host_time(ops: dict, engine: set, launches: dict, steps: int, top: int) -> None:
    """Print the host's time a step by thread and outermost CPU op (the ops no other op of
    the same thread encloses), and the launches made outside every op (Triton's, from
    Python): where the host's time goes, whether or not the GPU waited for it."""
    spent: dict[tuple[str, str], list[float]] = {}
    for tid, events in ops.items():
        where = "backward (engine)" if tid in engine else "main thread"
        end = -1.0
        starts, ends = [], []  # the outermost ops' spans, in order
        for o in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            if o["ts"] + o["dur"] <= end:
                continue  # inside the last outermost op
            end = o["ts"] + o["dur"]
            starts.append(o["ts"])
            ends.append(end)
            entry = spent.setdefault((where, o["name"][:90]), [0.0, 0])
            entry[0] += o["dur"]
            entry[1] += 1
        loose = [e for e in launches.values()
                 if e["tid"] == tid and not _inside(e["ts"], starts, ends)]
        if loose:  # (summed with another thread's of the same kind)
            entry = spent.setdefault((where, "(launches outside ops)"), [0.0, 0])
            entry[0] += sum(e["dur"] for e in loose)
            entry[1] += len(loose)
    total: dict[str, float] = {}
    for (where, _), (t, _) in spent.items():
        total[where] = total.get(where, 0.0) + t
    print("host time a step in CPU ops (outermost) and launches outside them, by thread: "
          + ", ".join(f"{w} {t / steps / 1e3:.2f} ms" for w, t in sorted(total.items())))
    for (where, name), (t, count) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t / steps / 1e3:7.3f} ms  {count / steps:6.1f} calls  {where:18s} {name}")


def _inside(ts: float, starts: list[float], ends: list[float]) -> bool:
    """Whether ``ts`` falls in one of the sorted, disjoint spans ``starts``/``ends``."""
    i = bisect.bisect_right(starts, ts)
    return i > 0 and ts <= ends[i - 1]


if __name__ == "__main__":
    main()
