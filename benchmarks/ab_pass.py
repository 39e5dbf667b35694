"""One forward pass on and off, side by side with eager and inductor, in one process.

Run on a CUDA machine::

    FXLITE_TRIAL=0 PYTHONPATH=$PWD python benchmarks/ab_pass.py --without empty_cats \\
        --cases gpt2_124m,nanogpt_124m --blocks 8

For each training case of ``bench_training.py``, four contenders are warmed up, each on its
own copy of the model: eager, ``torch.compile``, ``fxlite.compile`` with the pass taken out
of ``FORWARD_PASSES`` while it compiles, and ``fxlite.compile`` as it is. Printed: each
fxlite contender's fallbacks and kernels and, from one profiled step, its ``aten::cat``
calls and ``CatBackward`` events (what ``empty_cats`` removes); then each contender's best
and median ms a step over ``--blocks`` blocks of 20 steps, the blocks taking turns (forward
order on even rounds, backward on odd ones); then the peak memory of one steady-state step
above what was allocated as it began.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_training import WARMUP, gpt2_124m_case, nanogpt_124m_case  # noqa: E402
from fxlite.codegen.lower import segment  # noqa: E402
from profile_step import take_turns  # noqa: E402

import fxlite  # noqa: E402

CASES = {"gpt2_124m": gpt2_124m_case, "nanogpt_124m": nanogpt_124m_case}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without", default="empty_cats", help="the forward pass to take out")
    parser.add_argument("--cases", default="gpt2_124m")
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    off = f"fxlite without {args.without}"
    for case in args.cases.split(","):
        base, make_opt, data, step, _ = CASES[case]()
        contenders = []
        for label in ("eager", "inductor", off, "fxlite"):
            model = copy.deepcopy(base)
            opt = make_opt(model)
            fn = step if label == "eager" else torch.compile(step) if label == "inductor" \
                else fxlite.compile(step)
            passes = segment.FORWARD_PASSES
            if label == off:
                segment.FORWARD_PASSES = tuple(p for p in passes if p.name != args.without)
            start = time.perf_counter()
            try:
                for i in range(WARMUP):
                    fn(model, opt, *data[i % len(data)])
                torch.cuda.synchronize()
            finally:
                segment.FORWARD_PASSES = passes
            print(f"{case} {label}: warm-up {time.perf_counter() - start:.1f} s", flush=True)
            if label.startswith("fxlite"):
                print("  fallbacks", [f[:150] for f in fn.fallbacks][:3], "kernels",
                      len(fn.kernels), flush=True)
                with torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    fn(model, opt, *data[0])
                    torch.cuda.synchronize()
                names = [e.name for e in prof.events()]
                print("  aten::cat", names.count("aten::cat"), "CatBackward",
                      sum("CatBackward" in n for n in names), flush=True)
            contenders.append((label, fn, model, opt))
        turns = take_turns(contenders, data, args.blocks)
        for label, (ts, _) in turns.items():
            print(f"{case} {label}: best {min(ts):.2f} median {statistics.median(ts):.2f} ms  "
                  f"blocks {[round(t, 2) for t in ts]}", flush=True)
        for label, fn, model, opt in contenders:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            fn(model, opt, *data[1])
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - held) / 2**30
            print(f"{case} {label}: steady-state step peak {peak:.3f} GiB above the "
                  f"{held / 2**30:.3f} held", flush=True)
        del contenders
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
