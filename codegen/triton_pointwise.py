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
padding (:func:`~fxlite.codegen.triton.launch_config`)::

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

from .triton_common import Plan, Value, computed_outputs, used_values
from .triton_emit import Emitter
from .triton_source import (
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
    loads: list[tuple[Value, Access]] = []
    for v in plan.values:
        if v.kind != "input" or v not in used:
            continue
        pat = plan.patterns[v.index]
        sdims = [d for d in nt if pat[d] == "s"]
        if not sdims:
            acc = Access("", frozenset())
        elif plan.dense[v.index] and set(sdims) == every:
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
        if span == every and v.layout is None:  # else eager's layout: stored by strides
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

    helpers: set[str] = set()
    bodies = []
    for variant, _, prologue in variants:
        e = Emitter(libdevice=libdevice, index="offs", space=frozenset(nt))
        e.lines += prologue
        block = "[ROWS, BLOCK]" if variant == "rows" else "[BLOCK]"
        e.lines += scalar_lines(plan, used, block, ind)
        for v, acc in loads:
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
    counts = ["numel", "cols"] if len(variants) > 1 else ["numel"]
    sig, args, nospec = signature(plan, "\n".join(bodies), used, loads, stores, counts)
    deco = f"@triton.jit(do_not_specialize={nospec!r})" if nospec else "@triton.jit"
    text = header("\n".join(bodies), helpers)
    for (variant, fn, _), body in zip(variants, bodies):
        rows = ", ROWS: tl.constexpr" if variant == "rows" else ""
        text += f"\n\n{deco}\ndef {fn}({', '.join(sig)}, BLOCK: tl.constexpr{rows}):\n{body}\n"
    return KernelSource(text, {variant: fn for variant, fn, _ in variants}, args)
