"""Long runs of the training-step fuzzer (``tests/fuzz/fuzz_train.py``): random models,
losses, optimizers and step functions through ``fxlite.compile``, compared with eager
after every call (results, parameters, gradients, buffers, optimizer and scheduler
state), with the state a user changes between calls changed on both sides.

    python benchmarks/fuzz_train.py --count 2000 --seed 0 --device cuda --jobs 8 --json out.json

Program ``S`` is ``draw_train(S)``, so ``--seed S --count 1`` replays it. ``--device cpu``
runs kernels through Triton's interpreter (TRITON_INTERPRET=1); with ``--cuda-passes`` it
also runs the rewrites fxlite makes on CUDA only (the padded LM head, at every size, and
the fused cross entropy), as if the tensors were on a GPU, and ``--loss ce`` keeps only the
programs with that loss. ``--time-limit`` stops starting programs after that many seconds.
Exit status 1 if any program failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _init(device: str, cuda_passes: bool = False) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "fuzz")]
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import warnings

    warnings.simplefilter("ignore")
    if cuda_passes:
        from fxlite.codegen.lower import pad_matmul, segment

        segment._on_gpu = lambda sample: True
        # every linear of odd width padded, as a large one is on CUDA: the programs' heads
        # are small
        pad_matmul._MIN_FLOPS = 0


def _run(seed_device: tuple[int, str]) -> dict:
    """One program: its seed, failures and counts (a crash is a failure)."""
    import signal

    from fuzz_train import check_train, draw_train

    seed, device = seed_device
    program = draw_train(seed)
    stats: dict[str, int] = {}

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError("the program took over 120 s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(120)
    try:
        failures = check_train(program, device, stats)
    except Exception as e:  # a crash of the harness or of fxlite outside a call
        failures = ["crashed: " + "".join(traceback.format_exception(e))[-1500:]]
    finally:
        signal.alarm(0)
    return {"seed": seed, "program": program.describe(), "failures": failures,
            "stats": stats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cuda-passes", action="store_true",
                        help="on the CPU, also run the rewrites made on CUDA only")
    parser.add_argument("--loss", default=None, help="only programs with this loss (ce, mse, ...)")
    args = parser.parse_args()
    start = time.time()
    seeds = [(args.seed + i, args.device) for i in range(args.count)]
    if args.loss is not None:
        _init(args.device)
        from fuzz_train import draw_train

        seeds = [s for s in seeds if draw_train(s[0]).loss == args.loss]
    records: list[dict] = []
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.jobs, initializer=_init, initargs=(args.device, args.cuda_passes),
                  maxtasksperchild=200) as pool:
        for record in pool.imap_unordered(_run, seeds):
            records.append(record)
            if record["failures"]:
                print(f"--- seed {record['seed']}: {record['program']}")
                for f in record["failures"][:6]:
                    print("   ", f)
            if len(records) % 100 == 0:
                print(f"... {len(records)} programs", flush=True)
            if args.time_limit is not None and time.time() - start > args.time_limit:
                pool.terminate()
                break
    totals: dict[str, int] = {}
    for r in records:
        for k, v in r["stats"].items():
            totals[k] = totals.get(k, 0) + v
    failing = sorted(r["seed"] for r in records if r["failures"])
    print(f"fuzz_train: {len(records)} programs in {time.time() - start:.0f} s on "
          f"{args.device}, {args.jobs} jobs; {len(failing)} failing; {totals}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python " + " ".join(sys.argv), "seed": args.seed,
            "programs": len(records), "seconds": round(time.time() - start, 1),
            "device": args.device, "stats": totals, "failing": failing,
            "failures": [r for r in records if r["failures"]]}, indent=1))
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
