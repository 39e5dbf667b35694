"""What the one-op kernel benchmarks share (``bench_pools.py``, ``bench_row_gather.py``,
``bench_depthwise.py``): a median time in microseconds, and the table and JSON of their
rows::

    inductor = compiled(lambda t: op(t, **kwargs))   # torch.compile, one case's own
    rows = [{"case": "...", "copy_us": median_us(lambda: x.clone()), ...}]
    report(rows, args.json)   # the device, then the table; the rows as JSON if asked
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import triton.testing
from tabulate import tabulate

__all__ = ["compiled", "median_us", "report"]


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` after clearing dynamo's caches. A benchmark's cases are
    lambdas of one line of code, which dynamo keys as one function: past its recompile
    limit (8) it ran the later cases in eager, so that the "inductor" column of
    ``bench_pools.py`` (12 cases) and ``bench_depthwise.py`` (22) showed eager's times
    from the ninth case on."""
    torch._dynamo.reset()
    return torch.compile(fn)


def median_us(fn: Callable[[], Any]) -> float:
    """``fn``'s median time in microseconds (``triton.testing.do_bench``, 20 warm-up and
    200 timed milliseconds)."""
    return triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median") * 1e3


def report(rows: list[dict[str, Any]], json_path: str | None, extra: str = "") -> None:
    """Print the device, torch's version (and ``extra``), then ``rows`` as a table; write
    them to ``json_path`` as JSON when it is given."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}{extra}")
    print(tabulate(rows, headers="keys", floatfmt=".1f", tablefmt="github"))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
