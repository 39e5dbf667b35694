"""Long runs of the program fuzzer (tests/fuzz/): thousands of random programs through
fxlite.compile, compared with eager PyTorch, on the GPU or the CPU.

    python benchmarks/fuzz.py --count 10000 --seed 0 --device cuda --json fuzz.json

Programs are drawn with ``random.Random(seed + i)`` (the tests draw with hypothesis), so a
run is reproducible and ``--seed S --count 1`` replays program ``S``. Each program runs
through the Triton backend (five calls, the last with other sizes); one in
``--python-every`` also through the Python backend, one in ``--passes-every`` through
symbolic_trace, normalize, cse, decompose and fuse, and one in ``--grad-every`` through
the gradient check (``tests/fuzz/fuzz_check_grad.py``: backward, every input's ``.grad``).
``--jobs`` worker processes share fxlite's kernel cache folder (a kernel compiled by one is loaded by the others); a worker
that dies (a crash in a kernel) is restarted after the program it was running, which
counts as a failure. A failing program is shrunk (``fuzz_programs.shrink``) and its
minimal source saved in the JSON. At the end: the program count, op coverage, failures.

``--device cpu`` runs kernels through Triton's interpreter (TRITON_INTERPRET=1).
``--replay old.json`` runs the failing programs of an earlier run again, every path each,
to see which still fail (``--json`` writes the same summary as a run).
``--time-limit`` stops starting programs after that many seconds (the count says how many
ran). Exit status 1 if any program failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "tests" / "fuzz"
CONTEXT_LOST = 3  # a worker's exit status after a CUDA error, which no later call survives


# ---------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """Run the seeds ``start, start + jobs, ...`` and append one JSON line per event."""
    sys.path[:0] = [str(ROOT), str(FUZZ)]
    import dataclasses
    import signal
    import warnings

    warnings.simplefilter("ignore")
    import torch
    from fuzz_catalog import draw_step
    from fuzz_check import COVERAGE, NOTES, STATS, check_compiled, check_passes
    from fuzz_check_grad import check_backward, gradable
    from fuzz_programs import RandomDraw, generate, rebuild, shrink

    out = open(args.out, "a", buffering=1)

    def emit(**record: object) -> None:
        out.write(json.dumps(record) + "\n")

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"a program ran over {args.program_timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)
    deadline = args.deadline
    replay = bool(getattr(args, "seeds", None))  # every path of the given seeds
    seeds = args.seeds if replay else range(args.start, args.seed + args.count, args.jobs)
    for n, seed in enumerate(seeds):
        if deadline and time.time() > deadline:
            break
        emit(event="start", seed=seed)
        program = generate(RandomDraw(seed), seed, draw_step)
        paths = ["triton"]
        if replay or n % args.python_every == 0:
            paths.append("python")
        traceable = None
        if replay or n % args.passes_every == 0:
            traceable = rebuild(dataclasses.replace(program, buffers=[]),
                                lambda i, s: s.traceable)
            if traceable is not None:
                paths.append("passes")
        grad = None
        if replay or args.grad_every and n % args.grad_every == 0:
            grad = gradable(program)
            if grad is not None:
                paths.append("grad")
        lost = False
        for path in paths:
            if lost:
                break
            subject = {"passes": traceable, "grad": grad}.get(path, program)
            check = {"passes": lambda p: check_passes(p, args.device),
                     "grad": lambda p: check_backward(p, args.device)}.get(
                path, lambda p, b=path: check_compiled(p, b, args.device))
            signal.alarm(args.program_timeout)
            try:
                failures = check(subject)
            except Exception as e:  # the checker itself must not stop the run
                failures = [f"{type(e).__name__}: {e}"]
            finally:
                signal.alarm(0)
            lost = any("CUDA error" in f for f in failures)
            if failures:
                small = subject
                if args.shrink and not lost:  # shrinking needs CUDA calls
                    signal.alarm(args.program_timeout * 4)
                    try:
                        small = shrink(subject, lambda p, c=check: bool(c(p)), budget=60)
                    except Exception:
                        pass
                    finally:
                        signal.alarm(0)
                emit(event="failure", seed=seed, path=path, failures=failures[:4],
                     source=small.source(), inputs=repr(small.inputs),
                     buffers=repr(small.buffers), training=small.training)
        for note_seed, note in NOTES:
            emit(event="note", seed=note_seed, note=note)
        NOTES.clear()
        emit(event="done", seed=seed, paths=paths)
        if lost:  # no later CUDA call in this process can succeed
            emit(event="coverage", coverage=dict(COVERAGE), stats=dict(STATS))
            out.close()
            os._exit(CONTEXT_LOST)
        if n % 100 == 99:  # what a worker that dies later has covered
            emit(event="coverage", coverage=dict(COVERAGE), stats={})
        if torch.cuda.is_available() and n % 200 == 199:
            torch.cuda.empty_cache()
    emit(event="coverage", coverage=dict(COVERAGE), stats=dict(STATS))
    out.close()


# ---------------------------------------------------------------------- driver
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--python-every", type=int, default=5)
    parser.add_argument("--passes-every", type=int, default=3)
    parser.add_argument("--grad-every", type=int, default=4,
                        help="one program in N also through the gradient check (0: none)")
    parser.add_argument("--program-timeout", type=int, default=120)
    parser.add_argument("--time-limit", type=float, default=0.0)
    parser.add_argument("--no-shrink", dest="shrink", action="store_false")
    parser.add_argument("--replay", default=None, metavar="JSON",
                        help="instead of new programs, run the failing ones of an earlier "
                             "run's --json through every path, in this process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.replay:
        return _replay(args, device)
    env = dict(os.environ)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("FXLITE_CACHE_DIR", tempfile.mkdtemp(prefix="fxlite-fuzz-"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    started = time.time()
    deadline = started + args.time_limit if args.time_limit else 0.0
    jobs = max(1, min(args.jobs, args.count))
    records = _run_workers(args, device, env, jobs, deadline)
    return _report(args, device, records, time.time() - started)


def _replay(args: argparse.Namespace, device: str) -> int:
    """Run the failing seeds of an earlier run (``--replay``) through every path, in this
    process, and report as a run does (``--json`` for the same summary)."""
    failing = json.loads(Path(args.replay).read_text())["failing"]
    args.seeds = sorted({f["seed"] for f in failing if isinstance(f.get("seed"), int)})
    args.count, args.jobs = len(args.seeds), 1
    args.device = device
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton
    os.environ.setdefault("FXLITE_CACHE_DIR", tempfile.mkdtemp(prefix="fxlite-fuzz-"))
    out = Path(tempfile.mkdtemp(prefix="fuzz-replay-")) / "replay.jsonl"
    args.out, args.deadline = str(out), 0.0
    started = time.time()
    worker(args)
    return _report(args, device, _read(out), time.time() - started)


def _run_workers(args: argparse.Namespace, device: str, env: dict, jobs: int,
                 deadline: float) -> list[dict]:
    """Run ``jobs`` workers to their end, restarting one that dies after the seed it was
    on (which counts as a failure); returns every worker's records."""
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-run-"))
    pending = {j: args.seed + j for j in range(jobs)}  # worker -> the seed it starts at
    procs: dict[int, subprocess.Popen] = {}
    last_print = time.time()

    def launch(j: int) -> None:
        cmd = [sys.executable, __file__, "--worker", "--seed", str(args.seed), "--count",
               str(args.count), "--start", str(pending[j]), "--jobs", str(jobs), "--device",
               device, "--out", str(tmp / f"worker{j}.jsonl"), "--python-every",
               str(args.python_every), "--passes-every", str(args.passes_every),
               "--program-timeout", str(args.program_timeout), "--deadline", str(deadline),
               "--grad-every", str(args.grad_every)]
        if not args.shrink:
            cmd.append("--no-shrink")
        with open(tmp / f"worker{j}.err", "a") as err:
            procs[j] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)

    for j in range(jobs):
        launch(j)
    while procs:
        time.sleep(1.0)
        for j, proc in list(procs.items()):
            if proc.poll() is None:
                continue
            del procs[j]
            lines = _read(tmp / f"worker{j}.jsonl")
            if proc.returncode == 0:
                continue
            if proc.returncode == CONTEXT_LOST:  # restart after the seed that lost it
                pending[j] = max(r["seed"] for r in lines if r["event"] == "done") + jobs
                if pending[j] < args.seed + args.count:
                    launch(j)
                continue
            dones = {r["seed"] for r in lines if r["event"] == "done"}
            crashed = next((r["seed"] for r in reversed(lines)
                            if r["event"] == "start" and r["seed"] not in dones), None)
            if crashed is None:
                continue
            with open(tmp / f"worker{j}.jsonl", "a") as f:
                f.write(json.dumps({"event": "failure", "seed": crashed, "path": "?",
                                    "failures": [f"the worker died (exit {proc.returncode}"
                                                 f"); see {tmp / f'worker{j}.err'}"]}) + "\n")
                f.write(json.dumps({"event": "done", "seed": crashed, "paths": []}) + "\n")
            pending[j] = crashed + jobs
            if pending[j] < args.seed + args.count:
                launch(j)
        if time.time() - last_print > 30:
            done = sum(1 for j in range(jobs) for r in _read(tmp / f"worker{j}.jsonl")
                       if r["event"] == "done")
            print(f"... {done} programs", flush=True)
            last_print = time.time()
    return [r for j in range(jobs) for r in _read(tmp / f"worker{j}.jsonl")]


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            pass
    return out


def _report(args: argparse.Namespace, device: str, records: list[dict],
            elapsed: float) -> int:
    sys.path[:0] = [str(ROOT), str(FUZZ)]
    import torch
    from fuzz_catalog import EXCLUDED
    from fuzz_check import table_records

    done = [r for r in records if r["event"] == "done"]
    failures = [r for r in records if r["event"] == "failure"]
    notes = [r for r in records if r["event"] == "note"]
    coverage: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    for r in records:
        if r["event"] == "coverage":  # records seen (cumulative per worker run)
            coverage.update(r["coverage"].keys())
            stats.update(r["stats"])
    paths = Counter(p for r in done for p in r["paths"])
    names = [n for n in table_records() if n not in EXCLUDED]
    missed = [n for n in names if not coverage[n]]
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (Triton interpreter)"
    summary = {
        "programs": len(done), "runs": dict(paths), "failures": len(failures),
        "seconds": round(elapsed, 1), "device": gpu, "jobs": args.jobs,
        "seed": args.seed, "count_asked": args.count,
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "coverage": f"{len(names) - len(missed)} of {len(names)} records",
        "not_exercised": missed, "excluded": EXCLUDED, "stats": dict(stats),
        "failing": failures,
        "replaced_by_eager_after_disagreeing": notes,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    print(f"fuzz: {len(done)} programs ({', '.join(f'{v} {k}' for k, v in paths.items())}) "
          f"in {elapsed:.0f} s on {gpu}, {args.jobs} jobs; {len(failures)} failing")
    print(f"fuzz op coverage: {summary['coverage']}" +
          (f"; not exercised: {', '.join(missed)}" if missed else ""))
    for k, v in sorted(stats.items()):
        if not k.startswith("programs"):
            print(f"fuzz: {k}: {v}")
    for n in notes[:10]:
        print(f"note, seed {n['seed']}: {n['note'][:200]}")
    for f in failures[:10]:
        print(f"\n--- seed {f['seed']} ({f['path']}): " + "\n    ".join(f["failures"]))
        if f.get("source"):
            print(f["source"] + f"inputs: {f.get('inputs')}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
