"""Inference: the peak memory of each of fxlite's first calls, and what held it.

Run on a CUDA machine (torchvision, timm or transformers installed, as the model needs)::

    PYTHONPATH=$PWD python benchmarks/first_calls_memory.py vit_b_16:f32,swin_t:bf16 \\
        [--calls 14] [--sites 2] [--top 8]

For each case (``model:dtype`` of ``bench_models.py``'s registry, batch 32, TF32 on) it
prints eager's peak for one call, then fxlite's peak for each of its first ``--calls``
calls (call 1 records and checks the kernels, call 2 writes the straight-line forward,
the trial follows), all above the weights and inputs. For the first ``--sites`` calls it
prints the blocks live at the call's peak, grouped by the fxlite and model frames that
allocated them (torch's CUDA memory history), and whether a wider reference run judged
the segment (``accuracy.reference_problem``). ``bench_models.py`` reports the peak over
the first 20 calls; this script says which call made it, and why.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_models import build, cast  # noqa: E402
from fxlite.codegen.lower import accuracy, segment  # noqa: E402
from profile_step import _print_sites  # noqa: E402

import fxlite  # noqa: E402

_MIB = 2**20


def _report_reference_runs() -> None:
    """Print each wider reference run the segment checks make, and its verdict."""
    real = accuracy.reference_problem

    def reported(gm, args, got, expected, problem):
        verdict = real(gm, args, got, expected, problem)
        print(f"  reference run after: {problem[:120]}; verdict: "
              f"{'rounding' if verdict is None else verdict[-120:]}")
        return verdict

    accuracy.reference_problem = segment.reference_problem = reported


def run_case(name: str, dtype: str, calls: int, sites: int, top: int) -> None:
    """Eager's peak, then fxlite's per call, for one model in one dtype."""
    model, inputs = cast(*build(name, False, 32, "cuda"), dtype)
    with torch.no_grad():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(*inputs)
        torch.cuda.synchronize()
        print(f"{name} {dtype}: weights and inputs {base / _MIB:.0f} MiB; eager's call peaks "
              f"{(torch.cuda.max_memory_allocated() - base) / _MIB:.0f} MiB above them",
              flush=True)
        compiled = fxlite.compile(model)
        peaks = []
        for i in range(calls):
            if i < sites:
                torch.cuda.memory._record_memory_history(max_entries=3_000_000,
                                                         stacks="python")
            torch.cuda.reset_peak_memory_stats()
            compiled(*inputs)
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - base) / _MIB)
            if i < sites:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                _print_sites(f"  call {i + 1}", snap, top)
        print(f"  fxlite's peak above them, call by call: {' '.join(f'{p:.0f}' for p in peaks)}")
        print(f"  held after: {(torch.cuda.memory_allocated() - base) / _MIB:.0f} MiB; "
              f"kernels {len(compiled.kernels)}", flush=True)
    del model, inputs, compiled
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", help="comma-separated model:dtype (dtype f32 or bf16)")
    parser.add_argument("--calls", type=int, default=14)
    parser.add_argument("--sites", type=int, default=2, help="calls whose peak blocks to print")
    parser.add_argument("--top", type=int, default=8, help="sites printed per call")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    _report_reference_runs()
    for case in args.cases.split(","):
        name, _, dtype = case.partition(":")
        run_case(name, dtype or "f32", args.calls, args.sites, args.top)


if __name__ == "__main__":
    main()
