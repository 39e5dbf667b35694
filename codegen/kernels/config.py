"""Launch configurations of generated kernels: the heuristic and the autotuning candidates.

Sizes are never specialized into a kernel's source, so the block shape is picked per launch
from the iteration space: :func:`launch_config` (what runs by default) and
:func:`candidate_configs` (what ``mode="max-autotune"`` times).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_MAX_BLOCK", "POINTWISE_BLOCK", "WIDE_ROW", "candidate_configs",
           "launch_config", "np2", "tile_config", "triton_cdiv", "wide_row_configs"]

DEFAULT_MAX_BLOCK = 16384  # longest row (elements, power of 2) kept in registers
POINTWISE_BLOCK = 1024
WIDE_ROW = 8192  # rows held whole at least this wide: the warps are timed (wide_row_configs)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def np2(n: int) -> int:
    """The smallest power of 2 that is >= ``n`` (1 for 0)."""
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def _warps(elements: int) -> int:
    # Measured on an H200: an 8192-wide fp32 row runs ~15% faster with 16 warps than 8.
    return 4 if elements <= 2048 else 8 if elements <= 4096 else 16



def _row_block(cols: int) -> int:
    """The block of a row for a pointwise rows launch over rows of ``cols`` elements; 0:
    the flat variant.

    1024, 512 or 256, the largest that pads a row by at most 1/8. A program takes
    ``1024 // BLOCK`` rows, so that it covers 1024 elements as a flat one does: on an H200
    (``benchmarks/bench_pointwise_rows.py``), relu(x * s + s) over a channels-last
    32x256x56x56 bf16 tensor with a per-channel ``s`` took 65 us in programs of one row
    of 256 (100,352 programs of one warp) against 30 us flat (copy: 29 us). Few sizes:
    each is a constexpr, so each is one more binary that a resize may compile.
    """
    for block in (1024, 512, 256):
        if triton_cdiv(cols, block) * block * 8 <= cols * 9:
            return block
    return 0


def launch_config(kind: str, rows: int, cols: int = 1, *, trailing: bool = True,
                  max_block: int = DEFAULT_MAX_BLOCK, row_inputs: int = 1) -> dict[str, Any]:
    """The heuristic launch configuration.

    Args:
        kind: ``"pointwise"`` (``rows`` is the element count) or ``"reduction"``.
        rows: rows of a reduction (elements of a pointwise kernel).
        cols: elements per row; for a pointwise kernel with a rows variant, the length of
            the innermost dim (1 otherwise: the flat variant runs).
        trailing: the reduced dims are the innermost ones (rows are contiguous).
        max_block: the longest row kept in registers; longer rows loop.
        row_inputs: how many inputs a reduction reads whole (a row of each per row).

    Returns:
        ``{"variant", "BLOCK" (and "ROWS" for pointwise rows) or "ROWS"/"BLOCK_C",
        "num_warps"}``.

    Example::

        launch_config("reduction", 8192, 8192)
        # {'variant': 'persistent', 'ROWS': 1, 'BLOCK_C': 8192, 'num_warps': 16, ...}
        launch_config("pointwise", 8192 * 768, 768)
        # {'variant': 'rows', 'BLOCK': 256, 'ROWS': 4, 'num_warps': 4}
    """
    if kind == "pointwise":
        block = _row_block(cols)
        if block:  # the kernel's rows variant: no per-element index division
            return {"variant": "rows", "BLOCK": block, "ROWS": 1024 // block, "num_warps": 4}
        return {"variant": "pointwise", "BLOCK": POINTWISE_BLOCK, "num_warps": 4}
    width = np2(cols)
    if trailing:
        if width <= max_block:
            block = width
            nrows = min(np2(rows), max(1, 2048 // block), 64)
            variant = "persistent"
            warps = _warps(nrows * block)
            if 128 <= block <= 512:
                # Rows of 65 to 512: one warp a program, 1024 elements. Measured on an
                # H200 (kernel time from CUDA graphs, layer_norm(x + b) of 32xHxWxC), 4
                # warps over 2048 took 32.5 us for bf16 56x56x96 against 14.7, and
                # 14.8 us for f32 32x32x128 against 7.3; every width from 96 to 512, in
                # both dtypes, was as fast or faster this way.
                nrows, warps = min(np2(rows), 1024 // block), 1
            if row_inputs >= 2:
                # Measured on an H200, fp32 add+layer_norm (two rows held per program):
                # 8192 wide, 4 warps reach 101% of copy, 16 94%, 8 only 74%; 16384 wide,
                # 8 warps 95%, 16 79%, 4 11% (spills). 2048 and 4096 wide: all within 1%.
                warps = {8192: 4, 16384: 8}.get(nrows * block, warps)
        else:
            # Measured on an H200: a looped fp32 softmax runs at 84% of copy with 16 warps
            # per 2048-4096 chunk, 49% with 4.
            block, nrows, variant = min(max_block, 4096), 1, "looped"
            warps = 16 if block >= 2048 else _warps(block)
    else:
        # Strided columns (the kept dims are innermost in memory: a reduction over leading
        # dims, or over H and W of a channels-last tensor): adjacent rows per program keep
        # the loads coalesced, but no more than a row's length calls for, so that long rows
        # still spread over many programs. Measured on an H200, a channels-last
        # 16x64x32x32 summed over H, W (1024 rows of 1024): 8 rows of 256 a step, 4 warps,
        # 7.2 us (copy: 7.2 us); 64 rows of 32, 19.1 us; row kernels (2 rows of 1024), 25.4.
        # 16x512x4x4: 32 rows of 16, 6.6 us; 64 rows, 7.1. A column loop needs many warps
        # to hide its latency: 16x64x64x64, 8 rows of 256, 12.9 us with 32 warps, 28.3 with 4.
        nrows = min(np2(rows), 64, max(8, np2(2048 // width)))
        block = min(width, max(1, 2048 // nrows), max_block)
        variant = "persistent" if width <= block else "looped"
        warps = 32 if variant == "looped" else _warps(nrows * block)
    return {"variant": variant, "ROWS": nrows, "BLOCK_C": block, "num_warps": warps}


def tile_config(lena: int, lenb: int) -> dict[str, Any]:
    """The launch of a pointwise kernel's transpose variant: tiles of ``BA x BB`` (about
    1024 elements; a short side, such as the 3x3 of a conv weight, gets its own size).

    Example::

        tile_config(4096, 64)   # {'variant': 'transpose', 'BA': 32, 'BB': 32, 'num_warps': 4}
    """
    bb = min(np2(lenb), 32)
    ba = min(np2(lena), max(32, 1024 // bb))
    if ba < 32:
        bb = min(np2(lenb), max(32, 1024 // ba))
    return {"variant": "transpose", "BA": ba, "BB": bb, "num_warps": 4}


def wide_row_configs(rows: int, cols: int, *, trailing: bool = True,
                     max_block: int = DEFAULT_MAX_BLOCK, row_inputs: int = 1,
                     itemsize: int = 4) -> list[dict[str, Any]]:
    """The warps a reduction holding rows of at least :data:`WIDE_ROW` elements times on
    its first GPU call, in every mode (empty for other reductions: the heuristic stands).

    No one count suits every op at these widths. Measured on an H200 at 8192x8192
    (``benchmarks/sweep_row_configs.py``): layer_norm reached 98.6% of copy with 4 warps
    in float32 and 68% with the heuristic's 16; softmax in bfloat16 reached 89% with 8,
    88% with 16 and under 63% with 4; rms_norm in bfloat16 97% with 4 and 90% with 16.
    Narrower rows are many, cheap and well served by the heuristic; these are few (a wide
    model's norms and softmaxes), so the cost is a few compiles of the kernels that gain.

    Rows of 16-bit values 16,384 wide or more (``itemsize`` is the widest full-size
    tensor's) also time the looped variant (chunks of 2048 and 4096, 16 warps): a row held
    whole there takes up to 255 registers a thread (one row in flight an SM), and in three
    sweeps on H200s bfloat16 layer_norm at 2048x16384 ran at 54 to 65% of copy held whole,
    73 to 77% looped over chunks of 4096, and bfloat16 rms_norm at 64 to 72% against 76 to
    88% (``benchmarks/results/issue38/row_reduction_config_sweep*``). Float32 rows were
    faster held whole in every sweep (layer_norm 85 to 87% against 76 to 77%), so they
    skip the two compiles.

    Example::

        [c["num_warps"] for c in wide_row_configs(8192, 8192)]   # [16, 4, 8, 32]
        [c["variant"] for c in wide_row_configs(2048, 16384, itemsize=2)][-2:]
        # ['looped', 'looped']
        wide_row_configs(8192, 1024)                              # []
    """
    base = launch_config("reduction", rows, cols, trailing=trailing, max_block=max_block,
                         row_inputs=row_inputs)
    if not trailing or base["variant"] != "persistent" or base["BLOCK_C"] < WIDE_ROW:
        return []
    held = [{**base, "num_warps": w} for w in (4, 8, 16, 32) if w != base["num_warps"]]
    looped = [{"variant": "looped", "ROWS": 1, "BLOCK_C": chunk, "num_warps": 16}
              for chunk in (2048, 4096) if base["BLOCK_C"] >= 2 * WIDE_ROW and itemsize <= 2]
    return [base] + held + looped


def candidate_configs(kind: str, rows: int, cols: int = 1, *, trailing: bool = True,
                      max_block: int = DEFAULT_MAX_BLOCK, tiles: bool = False
                      ) -> list[dict[str, Any]]:
    """Configurations ``TritonKernel.autotune`` times (``mode="max-autotune"``).

    The heuristic's choice comes first; ``tiles``: the kernel has a transpose variant,
    whose tile shapes come before. Example::

        candidate_configs("pointwise", 1 << 20)[0]["BLOCK"]  # 1024
    """
    base = launch_config(kind, rows, cols, trailing=trailing, max_block=max_block)
    out = [{"variant": "transpose", "BA": ba, "BB": bb, "num_warps": w}
           for ba, bb in ((32, 32), (64, 16), (16, 64), (64, 32), (32, 64))
           for w in (4, 8)] if tiles else []
    out.append(base)
    if kind == "pointwise":
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8):
                out.append({"variant": "pointwise", "BLOCK": block, "num_warps": warps})
        if base["variant"] == "rows":
            for block in (256, 512, 1024, 2048):
                if block <= 2 * base["BLOCK"]:
                    for nrows in (1, 2, 4, 8):
                        if block * nrows <= 4096:
                            for warps in (2, 4, 8):
                                out.append({"variant": "rows", "BLOCK": block, "ROWS": nrows,
                                            "num_warps": warps})
    else:
        for warps in (2, 4, 8, 16, 32):
            out.append({**base, "num_warps": warps})
        if base["variant"] == "persistent":
            for nrows in (1, 2, 4, 8):
                if nrows != base["ROWS"] and nrows * base["BLOCK_C"] <= 2 * max_block:
                    out.append({**base, "ROWS": nrows,
                                "num_warps": _warps(nrows * base["BLOCK_C"])})
    unique: list[dict[str, Any]] = []
    for c in out:
        if c not in unique:
            unique.append(c)
    return unique
