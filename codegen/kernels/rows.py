"""The rows of a row-major matrix picked by an index, as one Triton kernel
(``gather_rows`` of ``codegen/lower/row_gathers.py``: Swin's rolled windows).

``torch.index_select`` of rows ran at a quarter of copy speed on an H200 for Swin's first
stage (100,352 rows of 96 values at batch 32: 65 us, where a copy of the same bytes took
14 us in bfloat16 and 23 in float32), and at about copy speed for rows of 192 values or
more. Its kernel copies one row per thread block. Here each program copies a tile of
``4096 // BLOCK_C`` rows, loading their numbers first, which took 15 and 25 us for those
rows (``benchmarks/bench_row_gather.py``; BENCHMARKS.md, nineteenth session)::

    out = gather_rows_kernel(rows, index)   # torch.index_select(rows, 0, index)

On CUDA a call with the same shape, dtype, device and alignment as an earlier one reuses
its binary through fxlite's launcher (:class:`~fxlite.codegen.runtime.launch.Binary`), as
the pools do (``codegen/kernels/pool.py``); under Triton's interpreter the kernel runs on
CPU tensors, for the tests.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from fxlite.codegen.kernels.generate import interpreting
from fxlite.codegen.runtime.launch import TRITON_OPTIONS, Binary

__all__ = ["gather_rows_kernel", "planned_launch", "takes"]

_TILE = 4096  # values a program copies
_WIDEST = 8192  # rows wider than this take torch's index_select
_WARPS = 4


@triton.jit
def _gather_rows(src, index, dst, n_rows, C: tl.constexpr, BLOCK_C: tl.constexpr,
                 ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rows_ok = r < n_rows
    s = tl.load(index + r, mask=rows_ok, other=0)  # int64: no product overflows
    c = tl.arange(0, BLOCK_C)
    ok = rows_ok[:, None] & (c[None, :] < C)
    values = tl.load(src + s[:, None] * C + c[None, :], mask=ok)
    tl.store(dst + r.to(tl.int64)[:, None] * C + c[None, :], values, mask=ok)


class _Prepared(NamedTuple):
    """A compiled launch for one ``(rows, width, dtype, device, aligned)``."""

    binary: Binary
    grid: tuple[int, int, int]
    block_c: int
    per: int


# (rows picked, width, dtype, device, aligned) -> the launch an earlier call compiled (CUDA)
_PREPARED: dict[tuple, _Prepared] = {}
_MAX_PREPARED = 256


def takes(rows: torch.Tensor) -> bool:
    """Whether :func:`gather_rows_kernel` takes ``rows``: a plain row-major 2-d tensor of
    a float dtype, on CUDA (or any device under the interpreter), rows at most 8192 wide,
    and no autograd recording the call."""
    return (type(rows) is torch.Tensor and _fits(rows) and (rows.is_cuda or interpreting())
            and not (rows.requires_grad and torch.is_grad_enabled()))


def _fits(rows: torch.Tensor) -> bool:
    return (rows.dim() == 2 and rows.dtype.is_floating_point and rows.is_contiguous()
            and 0 < rows.shape[1] <= _WIDEST)


def _launch(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor
            ) -> tuple[tuple[int, int, int], list[Any], dict[str, int]]:
    """The grid, the arguments and the constexprs of the kernel's launch."""
    n, c = index.numel(), rows.shape[1]
    grid, block_c, per = _sizes(n, c)
    return grid, [rows, index, out, n], {"C": c, "BLOCK_C": block_c, "ROWS": per}


def planned_launch(rows: torch.Tensor, picked: int) -> tuple | None:
    """For the parallel precompile (``codegen/runtime/precompile.py``): the compile that
    gathering ``picked`` rows of ``rows`` (a meta tensor laid out as the call's will be)
    makes, as ``(source_id, fn, args, grid, constexprs, num_warps)``; None where the call
    runs ``index_select``, or nothing."""
    if not _fits(rows) or picked <= 0:
        return None
    index = torch.empty(picked, dtype=torch.int64, device=rows.device)
    out = torch.empty((picked, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    grid, args, constexprs = _launch(rows, index, out)
    return (f"{_gather_rows.__module__}._gather_rows", _gather_rows, args, grid[:1], constexprs,
            _WARPS)


def _sizes(n: int, c: int) -> tuple[tuple[int, int, int], int, int]:
    """The grid, the tile's width (a power of 2) and its rows, for ``n`` rows of ``c``."""
    block_c = 1 << (c - 1).bit_length()
    per = max(1, _TILE // block_c)
    return (-(-n // per), 1, 1), block_c, per


def gather_rows_kernel(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``torch.index_select(rows, 0, index)`` for ``rows`` that :func:`takes` takes and an
    int64 ``index`` on its device, every entry in range (the caller's: no bounds check).

    Example::

        gather_rows_kernel(x.view(-1, c), index)   # a new (len(index), c) tensor
    """
    n, c = index.numel(), rows.shape[1]
    out = rows.new_empty((n, c))
    if not n:
        return out
    if interpreting():
        grid, args, constexprs = _launch(rows, index, out)
        _gather_rows[grid[:1]](*args, **constexprs)
        return out
    device = rows.get_device()
    key = (n, c, rows.dtype, device, rows.data_ptr() % 16 == 0)
    prepared = _PREPARED.get(key)
    if prepared is None:
        grid, args, constexprs = _launch(rows, index, out)
        binary = Binary(_gather_rows.warmup(*args, **constexprs, grid=grid[:1],
                                            num_warps=_WARPS, **TRITON_OPTIONS))
        if len(_PREPARED) >= _MAX_PREPARED:
            _PREPARED.clear()
        prepared = _PREPARED[key] = _Prepared(binary, grid, constexprs["BLOCK_C"],
                                              constexprs["ROWS"])
    prepared.binary.launch(prepared.grid, (rows, index, out, n, c, prepared.block_c,
                                           prepared.per), device)
    return out
