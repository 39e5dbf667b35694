"""Row gathers: torch's ``index_select``, fxlite's Triton kernel and torch.compile side by side.

Run on a CUDA machine::

    PYTHONPATH=$PWD python benchmarks/bench_row_gather.py [--json out.json]

Each case is one of swin_t's rolled-window gathers at batch 32 (``codegen/lower/
row_gathers.py`` makes the roll, the window cut and its permute one pick of rows): the
rows of stage 1 to 3 (56, 28 and 14 square, 96 to 384 values a row), in float32 and
bfloat16. One process times, in microseconds (medians of ``triton.testing.do_bench``): a
copy of the rows (the bytes any gather reads and writes), eager's ``index_select``,
``torch.compile``'s kernel for it and fxlite's (``codegen/kernels/rows.py``), after
checking that fxlite's values equal eager's to the bit.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fxlite.codegen.kernels.rows import gather_rows_kernel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_report import compiled, median_us, report  # noqa: E402

CASES = [(56, 96), (28, 192), (14, 384)]  # (side, width): swin_t's stages 1 to 3
BATCH, WINDOW, SHIFT = 32, 7, 3


def _index(side: int) -> torch.Tensor:
    """The rows a shifted window cut reads, in its order (as row_gathers' probe finds)."""
    p = torch.arange(BATCH * side * side, device="cuda").view(BATCH, side, side)
    p = torch.roll(p, (-SHIFT, -SHIFT), (1, 2))
    w = side // WINDOW
    return p.view(BATCH, w, WINDOW, w, WINDOW).permute(0, 1, 3, 2, 4).reshape(-1)


def row(side: int, width: int, dtype: torch.dtype) -> dict[str, Any]:
    """One case's times, after checking that fxlite's values equal eager's to the bit."""
    x = torch.randn(BATCH * side * side, width, device="cuda", dtype=dtype)
    index = _index(side)
    if not torch.equal(gather_rows_kernel(x, index), torch.index_select(x, 0, index)):
        raise SystemExit(f"{side}x{side}x{width} {dtype}: fxlite differs from eager")
    inductor = compiled(lambda t, i: torch.index_select(t, 0, i))
    inductor(x, index)
    return {"rows": f"{x.shape[0]} x {width}", "dtype": str(dtype).removeprefix("torch."),
            "copy_us": median_us(lambda: x.clone()),
            "eager_us": median_us(lambda: torch.index_select(x, 0, index)),
            "inductor_us": median_us(lambda: inductor(x, index)),
            "fxlite_us": median_us(lambda: gather_rows_kernel(x, index))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    rows = [row(side, width, dtype) for side, width in CASES
            for dtype in (torch.float32, torch.bfloat16)]
    report(rows, args.json)


if __name__ == "__main__":
    main()
