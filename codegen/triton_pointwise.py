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

That split costs an integer division per element and dim, which is measurable at full
memory bandwidth. So a kernel that needs it also gets a *rows* variant (``<name>_rows``):
each program covers one block of one row of the innermost dim, so the inner index is the
lane's column and the outer indices are split once per program from the row number. The
launcher picks the rows variant when a row is wide enough to fill blocks without much
padding (:func:`~fxlite.codegen.triton.launch_config`)::

    pid = tl.program_id(0)
    r = pid // tl.cdiv(cols, BLOCK)
    c = (pid - r * tl.cdiv(cols, BLOCK)) * BLOCK + tl.arange(0, BLOCK)
    mask = c < cols
    offs = r * cols + c
    i1 = c
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    b = tl.load(b_ptr + i1 * b_stride1, mask=mask, other=0)
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
        stores.append((j, v, acc))

    pid = "tl.program_id(0).to(tl.int64)" if plan.int64 else "tl.program_id(0)"
    ind = "    "
    flat = [f"{ind}pid = {pid}", f"{ind}offs = pid * BLOCK + tl.arange(0, BLOCK)",
            f"{ind}mask = offs < numel"]
    decompose(flat, "offs", nt, needed, ind, "rem", fast=not plan.int64)
    variants = [("pointwise", plan.name, flat)]
    if needed and len(nt) >= 2:
        # Each program takes one block of one row of the innermost dim (consecutive
        # programs walk along a row): the row number and the outer indices are split
        # once per program, so no lane divides by a size.
        inner = nt[-1]
        rows = [f"{ind}pid = {pid}", f"{ind}r = pid // tl.cdiv(cols, BLOCK)",
                f"{ind}c = (pid - r * tl.cdiv(cols, BLOCK)) * BLOCK + tl.arange(0, BLOCK)",
                f"{ind}mask = c < cols", f"{ind}offs = r * cols + c"]
        if inner in needed:
            rows.append(f"{ind}i{inner} = c")
        decompose(rows, "r", nt[:-1], needed - {inner}, ind, "rem", fast=not plan.int64)
        variants.append(("rows", f"{plan.name}_rows", rows))

    helpers: set[str] = set()
    bodies = []
    for variant, _, prologue in variants:
        e = Emitter(libdevice=libdevice, index="offs", space=frozenset(nt))
        e.lines += prologue
        e.lines += scalar_lines(plan, used, "[BLOCK]", ind)
        for v, acc in loads:
            if variant == "rows" and not _along(acc, nt[-1]):
                acc = Access(acc.offset, frozenset(), acc.strides)  # one element per row
            e.lines.append(ind + load_line(v, acc, "mask", "[BLOCK]"))
        for v in plan.values:
            if v.kind in ("pw", "count"):
                emit_value(e, v, ind)
        for j, v, acc in stores:
            if variant == "rows":
                pad = "" if _along(acc, nt[-1]) else " + 0 * c"
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
    for (_, fn, _), body in zip(variants, bodies):
        text += f"\n\n{deco}\ndef {fn}({', '.join(sig)}, BLOCK: tl.constexpr):\n{body}\n"
    return KernelSource(text, {variant: fn for variant, fn, _ in variants}, args)
