"""Pointwise kernels: one element per lane, over a flat or a rows grid.

Generated source for ``relu(x + 1) * 2`` on a contiguous f32 input::

    @triton.jit(do_not_specialize=["numel"])
    def triton_relu(x_ptr, out0_ptr, numel, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(x_ptr + offs, mask=mask, other=0)
        add = x + 1.0
        relu = tl.where(add < 0, 0.0, add)
        mul = relu * 2.0
        tl.store(out0_ptr + offs, mul, mask=mask)

Inputs that are dense with the iteration space's shape use the linear index ``offs``;
any other input (broadcast, transposed, sliced, expanded) splits ``offs`` into per-dim
indices with the runtime sizes and dots them with its runtime strides.

That split costs an integer division per element and dim. A kernel with an operand
constant along some dim (a bias, a per-channel scale) also gets a *rows* variant
(``<name>_rows``): each program covers one block of a few rows of the innermost dim, so
the inner index is the lane's column and the outer indices are split once per row. (With
no such operand the flat variant was as fast or faster on an H200: a strided copy of
GPT-2's padded logits took 219 us flat and 232 in rows, ``bench_pointwise_rows.py``.) The
launcher picks the rows variant when a row is wide enough to fill blocks without much
padding (:func:`~fxlite.codegen.runtime.kernel.launch_config`)::

    pid = tl.program_id(0)
    nb = tl.cdiv(cols, BLOCK)
    rb = pid // nb
    r = rb * ROWS + tl.arange(0, ROWS)[:, None]
    c = (pid - rb * nb) * BLOCK + tl.arange(0, BLOCK)[None, :]
    rmask = r < numel // cols
    mask = (c < cols) & rmask
    offs = r * cols + c
    i1 = c
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    b = tl.load(b_ptr + i1 * b_stride1, mask=mask, other=0)

A program takes ``ROWS`` rows of one block each (a block of ``ROWS x BLOCK``), so that a
short row does not make a program of a few hundred elements.
"""

from __future__ import annotations

from fxlite.codegen.kernels.analysis import Plan, Value, computed_outputs, used_values
from fxlite.codegen.kernels.emit import Emitter
from fxlite.codegen.kernels.source import (
    Access,
    KernelSource,
    decompose,
    emit_value,
    header,
    load_line,
    scalar_lines,
    signature,
    store_line,
)

__all__ = ["build_pointwise"]


def _strided(name: str, dims: list[int]) -> tuple[str, tuple[tuple[int, str], ...]]:
    strides = tuple((d, f"{name}_stride{d}") for d in dims)
    return " + ".join(f"i{d} * {s}" for d, s in strides), strides


def _along(acc: Access, dim: int) -> bool:
    """Whether ``acc``'s offset varies along iteration dim ``dim``."""
    return acc.offset == "offs" or any(d == dim for d, _ in acc.strides)


def build_pointwise(plan: Plan, libdevice: bool) -> KernelSource:
    """Generate the pointwise kernel for ``plan``.

    Args:
        plan: an analyzed group without reductions.
        libdevice: use libdevice functions (GPU); False for the CPU interpreter.

    Returns:
        The source, the kernel's function name, and its launch arguments.
    """
    nt = [d for d in range(plan.rank) if d not in plan.trivial]
    every = set(nt)
    needed: set[int] = set()
    broadcast = False  # an operand constant along some dim (a bias, a per-channel scale)
    used = used_values(plan)
    tile = _tile_dims(plan, nt, used)
    loads: list[tuple[Value, Access]] = []
    for v in plan.values:
        if v.kind != "input" or v not in used:
            continue
        pat = plan.patterns[v.index]
        sdims = [d for d in nt if pat[d] == "s"]
        if not sdims:
            acc = Access("", frozenset())
        elif plan.dense[v.index] and set(sdims) == every and tile is None:
            acc = Access("offs", frozenset({"lin"}))
        else:
            off, strides = _strided(v.name, sdims)
            acc = Access(off, frozenset({"lin"}), strides)
            needed |= set(sdims)
            broadcast |= set(sdims) != every
        loads.append((v, acc))
    stores: list[tuple[int, Value, Access]] = []
    for j, v in computed_outputs(plan):
        span = v.span & every
        if span == every and v.layout is None and tile is None:  # else stored by strides
            acc = Access("offs", frozenset({"lin"}))
        else:
            off, strides = _strided(f"out{j}", sorted(span))
            acc = Access(off, frozenset({"lin"}), strides, tuple(sorted(every - span)))
            needed |= every
            broadcast |= span != every
        stores.append((j, v, acc))

    pid = "tl.program_id(0).to(tl.int64)" if plan.int64 else "tl.program_id(0)"
    ind = "    "
    flat = [f"{ind}pid = {pid}", f"{ind}offs = pid * BLOCK + tl.arange(0, BLOCK)",
            f"{ind}mask = offs < numel"]
    decompose(flat, "offs", nt, needed, ind, "rem", fast=not plan.int64)
    variants = [("pointwise", plan.name, flat)]
    if needed and len(nt) >= 2 and broadcast:
        # Each program takes one block of ROWS rows of the innermost dim (consecutive
        # programs walk along the rows): the outer indices are split once per row, so no
        # lane divides by a size.
        inner = nt[-1]
        rows = [f"{ind}pid = {pid}", f"{ind}nb = tl.cdiv(cols, BLOCK)", f"{ind}rb = pid // nb",
                f"{ind}r = rb * ROWS + tl.arange(0, ROWS)[:, None]",
                f"{ind}c = (pid - rb * nb) * BLOCK + tl.arange(0, BLOCK)[None, :]",
                f"{ind}rmask = r < numel // cols", f"{ind}mask = (c < cols) & rmask",
                f"{ind}offs = r * cols + c"]
        if inner in needed:
            rows.append(f"{ind}i{inner} = c")
        decompose(rows, "r", nt[:-1], needed - {inner}, ind, "rem", fast=not plan.int64)
        variants.append(("rows", f"{plan.name}_rows", rows))
    if tile is not None:
        variants.append(("transpose", f"{plan.name}_transpose",
                         _tile_prologue(pid, nt, tile, ind, fast=not plan.int64)))

    helpers: set[str] = set()
    bodies = []
    for variant, _, prologue in variants:
        e = Emitter(libdevice=libdevice, index="offs", space=frozenset(nt))
        e.lines += prologue
        block = {"rows": "[ROWS, BLOCK]", "transpose": "[BA, BB]"}.get(variant, "[BLOCK]")
        e.lines += scalar_lines(plan, used, block, ind)
        for v, acc in loads:
            if variant == "transpose":
                acc = _tiled(acc, v.name, nt, tile)
            if variant == "rows" and not _along(acc, nt[-1]) and acc.offset:
                # one element per row, spread over the row's block
                name, load = load_line(v, acc, "rmask", block).split(" = ", 1)
                e.lines.append(f"{ind}{name} = tl.broadcast_to({load}, {block})")
                continue
            e.lines.append(ind + load_line(v, acc, "mask", block))
        for v in plan.values:
            if v.kind in ("pw", "count"):
                emit_value(e, v, ind)
        for j, v, acc in stores:
            if variant == "transpose":
                acc = _tiled(acc, f"out{j}", nt, tile)
            if variant == "rows":
                # the address covers the whole [ROWS, BLOCK] block, as the value does (an
                # output along the columns alone would address one row: [1, BLOCK])
                pad = "" if acc.offset == "offs" else " + 0 * offs"
                line = store_line(e, f"out{j}_ptr", v, acc, "mask", pad, " + 0 * c")
            else:
                pad = "" if acc.offset else " + 0 * offs"
                line = store_line(e, f"out{j}_ptr", v, acc, "mask", pad)
            e.lines.append(ind + line)
        helpers |= e.helpers
        bodies.append("\n".join(e.lines))
    names = [variant for variant, _, _ in variants]
    counts = ["numel"] + (["cols"] if "rows" in names else []) + (
        ["lena", "lenb"] if tile is not None else [])
    sig, args, nospec = signature(plan, "\n".join(bodies), used, loads, stores, counts)
    deco = f"@triton.jit(do_not_specialize={nospec!r})" if nospec else "@triton.jit"
    text = header("\n".join(bodies), helpers, libdevice)
    blocks = {"rows": "BLOCK: tl.constexpr, ROWS: tl.constexpr",
              "transpose": "BA: tl.constexpr, BB: tl.constexpr"}
    for (variant, fn, _), body in zip(variants, bodies):
        params = blocks.get(variant, "BLOCK: tl.constexpr")
        text += f"\n\n{deco}\ndef {fn}({', '.join(sig)}, {params}):\n{body}\n"
    return KernelSource(text, {variant: fn for variant, fn, _ in variants}, args, tile)


def _tile_dims(plan: Plan, nt: list[int], used: set[Value]
               ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """For a copy between two memory orders (a clone to channels-last, or back), the dims
    contiguous in the input and those contiguous in the output, else None.

    Such a kernel reads along one and writes along the other: iterating either way, half
    of its accesses were strided (a 512x512x3x3 float32 weight took 9 us on an H200,
    twice a tiled transpose's time). Its transpose variant loads a tile along the first
    dims and stores it along the second; Triton moves the tile between the two layouts
    through shared memory.
    """
    inputs = [v for v in plan.values if v.kind == "input" and v in used]
    outs = computed_outputs(plan)
    if len(nt) < 2 or len(inputs) != 1 or len(outs) != 1 or any(
            v.kind not in ("input", "pw") or v.kind == "pw" and v.op != "clone"
            for v in plan.values if v in used):
        return None
    v, out = inputs[0], outs[0][1]
    pat, entry = plan.patterns[v.index], plan.key[1][v.index]
    if pat is None or any(pat[d] != "s" for d in nt) or not out.span >= set(nt):
        return None
    order = list(nt) if plan.dense[v.index] else [d for d in entry[3] if d in nt]
    out_order = list(nt) if out.layout is None else [d for d in out.layout if d in nt]
    if sorted(order) != nt or sorted(out_order) != nt:
        return None
    a, b = _run(order, out_order), _run(out_order, order)
    if not a or not b or set(a) & set(b):
        return None
    return tuple(a), tuple(b)


def _run(order: list[int], other: list[int]) -> list[int]:
    """The longest run of ``order``'s innermost dims that ``other`` holds in that order,
    side by side (dims that merge into one in both layouts)."""
    best: list[int] = []
    for k in range(1, len(order) + 1):
        run = order[-k:]
        at = other.index(run[0])
        if other[at:at + k] != run:
            break
        best = run
    return best


def _tile_prologue(pid: str, nt: list[int], tile: tuple[tuple[int, ...], tuple[int, ...]],
                   ind: str, fast: bool) -> list[str]:
    """Index lines of the transpose variant: a program takes a ``BA x BB`` tile of the
    input-contiguous dims (``a``, ``lena`` long) by the output-contiguous ones (``b``)."""
    a_dims, b_dims = tile
    others = [d for d in nt if d not in a_dims and d not in b_dims]
    lines = [f"{ind}pid = {pid}", f"{ind}nba = tl.cdiv(lena, BA)",
             f"{ind}tiles = nba * tl.cdiv(lenb, BB)", f"{ind}t = pid % tiles",
             f"{ind}rest = pid // tiles",
             f"{ind}a = (t % nba) * BA + tl.arange(0, BA)[:, None]",
             f"{ind}b = (t // nba) * BB + tl.arange(0, BB)[None, :]",
             f"{ind}mask = (a < lena) & (b < lenb)"]
    decompose(lines, "rest", others, set(others), ind, "rr", fast=fast)
    return lines


def _tiled(acc: Access, name: str, nt: list[int],
           tile: tuple[tuple[int, ...], tuple[int, ...]]) -> Access:
    """``acc`` in the transpose variant: each run of merged dims is addressed through its
    innermost dim's stride (the launcher checks that the input's dims merge), so that a
    stride of 1 tells Triton which way the loads, and the stores, are contiguous."""
    a_dims, b_dims = tile
    terms = [f"i{d} * {name}_stride{d}" for d in nt if d not in a_dims and d not in b_dims]
    terms += [f"a * {name}_stride{a_dims[-1]}", f"b * {name}_stride{b_dims[-1]}"]
    return Access(" + ".join(terms), acc.deps, acc.strides, acc.mask_dims)
