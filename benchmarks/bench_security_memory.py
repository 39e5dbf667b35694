"""Memory that files and recompiles can cost: what SECURITY.md's resource promises mean.

Measures, each in a fresh subprocess so that peak RSS (``ru_maxrss``) is its own:

- ``cycles``: N compile-and-drop cycles of a traced 1,000-node module (``symbolic_trace``
  of a 333-link chain, ``recompile``, one call, then dropped): Python's ``linecache``
  entries and characters held for generated sources, and RSS, before and after; with
  torch.fx side by side for reference.
- ``refuse``: ``fxlite.load`` of a 1 GiB file (a sparse file whose header claims more than
  the file holds) that must be refused: the error, the time, and the peak RSS of the
  process against the same process's peak before the load.

Usage::

    python benchmarks/bench_security_memory.py            # 1,000 cycles, a 1 GiB file
    python benchmarks/bench_security_memory.py --cycles 200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

CYCLES = textwrap.dedent("""
    import gc, json, linecache, resource, sys, torch, fxlite, torch.fx
    class Chain(torch.nn.Module):
        def forward(self, x):
            for _ in range(333):
                x = torch.relu(x + 1.0) * 2.0
            return x
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    def held():
        return len(linecache.cache), sum(len("".join(v[2])) for v in linecache.cache.values()
                                         if isinstance(v, tuple) and len(v) > 2 and v[2])
    out = {}
    x = torch.ones(2)
    for name, trace in (("fxlite", fxlite.symbolic_trace), ("torch.fx", torch.fx.symbolic_trace)):
        gc.collect()
        before = (held(), rss())
        for _ in range(int(sys.argv[1])):
            gm = trace(Chain())
            gm.recompile()
            gm(x)
            del gm
        gc.collect()
        after = (held(), rss())
        out[name] = {"linecache_entries": [before[0][0], after[0][0]],
                     "linecache_chars": [before[0][1], after[0][1]],
                     "rss_mib": [round(before[1], 1), round(after[1], 1)]}
    print(json.dumps(out))
""")

REFUSE = textwrap.dedent("""
    import json, os, resource, struct, sys, tempfile, time, fxlite
    path = os.path.join(tempfile.mkdtemp(), "big.fxl")
    with open(path, "wb") as f:  # a header length far beyond the file, then 1 GiB of holes
        f.write(struct.pack("<Q", 2**40))
        f.truncate(2**30)
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:  # import torch and fxlite's reader first: their cost is not the file's
        fxlite.load(path + ".missing")
    except FileNotFoundError:
        pass
    before = peak()
    start = time.perf_counter()
    try:
        fxlite.load(path)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    print(json.dumps({"file_gib": os.path.getsize(path) / 2**30, "error": error,
                      "seconds": round(time.perf_counter() - start, 4),
                      "peak_rss_mib_before": round(before, 1),
                      "peak_rss_mib_after": round(peak(), 1)}))
""")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    run = lambda code, *a: json.loads(subprocess.run(
        [sys.executable, "-c", code, *a], capture_output=True, text=True,
        check=True).stdout.strip().splitlines()[-1])
    result = {"cycles": args.cycles, "compile_and_drop": run(CYCLES, str(args.cycles)),
              "refuse_1gib": run(REFUSE)}
    for name, r in result["compile_and_drop"].items():
        print(f"{name:9} {args.cycles} compile-and-drop cycles of a 1,000-node module: "
              f"linecache {r['linecache_entries'][0]} -> {r['linecache_entries'][1]} entries, "
              f"{r['linecache_chars'][0]:,} -> {r['linecache_chars'][1]:,} chars; RSS "
              f"{r['rss_mib'][0]} -> {r['rss_mib'][1]} MiB")
    r = result["refuse_1gib"]
    print(f"refusing a {r['file_gib']:.0f} GiB file: {r['error']} in {r['seconds']} s; peak RSS "
          f"{r['peak_rss_mib_before']} -> {r['peak_rss_mib_after']} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
