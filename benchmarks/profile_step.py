"""Where a compiled call spends host time: cProfile of eager and fxlite side by side.

Run on a CUDA machine::

    python benchmarks/profile_step.py --case gpt2_block_f32 [--steps 30] [--top 25]

Uses the cases of ``bench_training.py``; prints each contender's median step time, then the
functions with the most own time in fxlite's steps (after warm-up, so no compiling).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_training import gpt2_block_case, resnet18_case, time_steps  # noqa: E402

import fxlite  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="gpt2_block_f32",
                        choices=["resnet18", "gpt2_block_f32", "gpt2_block_bf16"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    make = {"resnet18": resnet18_case, "gpt2_block_f32": lambda: gpt2_block_case(torch.float32),
            "gpt2_block_bf16": lambda: gpt2_block_case(torch.bfloat16)}[args.case]
    base, make_opt, data, step, _ = make()
    for label, fn in (("eager", step), ("fxlite", fxlite.compile(step))):
        model = copy.deepcopy(base)
        opt = make_opt(model)
        for i in range(10):
            fn(model, opt, *data[i % len(data)])
        ms = time_steps(fn, model, opt, data, args.steps)
        print(f"{label}: {ms:.3f} ms a step", flush=True)
        if label == "fxlite":
            print("fallbacks:", [f[:160] for f in fn.fallbacks][:4])
            profile = cProfile.Profile()
            profile.enable()
            time_steps(fn, model, opt, data, args.steps)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
