"""Pointwise kernels: a 1-D grid over the iteration space, one element per lane.

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
"""

from __future__ import annotations

from .triton_common import Plan, Value, computed_outputs, used_values
from .triton_ops import Emitter
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
        if span == every:
            acc = Access("offs", frozenset({"lin"}))
        else:
            off, strides = _strided(f"out{j}", sorted(span))
            acc = Access(off, frozenset({"lin"}), strides, tuple(sorted(every - span)))
            needed |= every
        stores.append((j, v, acc))

    e = Emitter(libdevice=libdevice)
    ind = "    "
    pid = "tl.program_id(0).to(tl.int64)" if plan.int64 else "tl.program_id(0)"
    e.lines += [f"{ind}pid = {pid}", f"{ind}offs = pid * BLOCK + tl.arange(0, BLOCK)",
                f"{ind}mask = offs < numel"]
    decompose(e.lines, "offs", nt, needed, ind, "rem")
    e.lines += scalar_lines(plan, used, "[BLOCK]", ind)
    for v, acc in loads:
        e.lines.append(ind + load_line(v, acc, "mask", "[BLOCK]"))
    for v in plan.values:
        if v.kind in ("pw", "count"):
            emit_value(e, v, ind)
    for j, v, acc in stores:
        pad = "" if acc.offset else " + 0 * offs"
        e.lines.append(ind + store_line(e, f"out{j}_ptr", v, acc, "mask", pad))
    body = "\n".join(e.lines)
    fn = plan.name
    sig, args, nospec = signature(plan, body, used, loads, stores, ["numel"])
    deco = f"@triton.jit(do_not_specialize={nospec!r})" if nospec else "@triton.jit"
    text = (header(body, e.helpers) + f"\n\n{deco}\ndef {fn}({', '.join(sig)}, "
            f"BLOCK: tl.constexpr):\n{body}\n")
    return KernelSource(text, {"pointwise": fn}, args)


