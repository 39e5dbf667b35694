"""The host cost of a compiled call's state key: what fxlite reads of the module, its
config objects, globals and closures on every call to decide that a replay still holds.

A transformers T5 encoder (the default ``T5Config``: t5-small, 6 layers, random weights)
is compiled and called four times on 8 tokens, then its guard's ``key`` is timed alone:
the best of ``--rounds`` rounds of ``--calls`` keys. transformers is a benchmark extra,
not fxlite's dependency. On a CPU-only machine the calls run their kernels through
Triton's interpreter (set ``TRITON_INTERPRET=1``); the key's cost does not depend on it::

    TRITON_INTERPRET=1 python benchmarks/bench_state_key.py
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import fxlite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import transformers

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = transformers.T5EncoderModel(transformers.T5Config()).eval()
    tokens = torch.randint(0, 32000, (1, 8))
    compiled = fxlite.compile(model)
    with torch.no_grad():
        for _ in range(4):
            compiled(tokens)
    guard = compiled._compiled._guard
    best = float("inf")
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.calls):
            guard.key(())
        best = min(best, (time.perf_counter() - start) / args.calls * 1e6)
    print(f"t5-small state key: {best:.1f} us a call (best of {args.rounds} rounds of "
          f"{args.calls}; {len(guard.modules)} modules, torch {torch.__version__})")


if __name__ == "__main__":
    main()
