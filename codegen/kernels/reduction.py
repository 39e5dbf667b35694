"""Row kernels: reductions with their pointwise prologue and epilogue, in one kernel.

The iteration space splits into *kept* dims (rows, indexed by ``r``) and *reduced* dims
(columns, ``c``). Each program owns ``ROWS`` rows. Values that vary along the columns
("full" values) are ``[ROWS, BLOCK_C]`` blocks; values constant along a row ("row" values,
such as a reduction's result) are ``[ROWS, 1]``.

Two variants are generated, and the launcher picks one from the row length:

- ``<name>_persistent`` loads a whole row (``BLOCK_C >= cols``) once, keeps it in
  registers and runs every stage (softmax: max, exp, sum, divide) on it.
- ``<name>_looped`` runs one loop over the row per reduction *level* (a reduction whose
  input depends on an earlier reduction is one level deeper), recomputing that loop's
  prologue from loads and the row values found so far. A full-size output is stored by
  the first loop that can compute it; those that need the deepest reductions get a final
  loop of their own.

Before any reduction the block is re-masked with the reduction's identity (0 for sum, 1
for prod, -inf/+inf or the integer extremes for max/min), so padded lanes and padded rows
never leak into a result, even when the prologue turns padding into inf or NaN (centred
values in a variance, ``exp(x - max)`` in a softmax). Max and min propagate NaN as torch
does, through a ``tl.reduce`` with a NaN-aware combine. Half types accumulate in fp32.
"""

from __future__ import annotations

import torch
from fxlite.codegen.kernels.analysis import Plan, Value, computed_outputs, used_values
from fxlite.codegen.kernels.emit import Emitter, compute_dtype, tl_dtype
from fxlite.codegen.kernels.source import (
    Access,
    KernelSource,
    decompose,
    emit_value,
    header,
    load_line,
    operand,
    scalar_lines,
    signature,
    store_line,
)

__all__ = ["build_reduction"]


def _identity(op: str, ct: torch.dtype) -> str:
    if op == "sum":
        return "0.0" if ct.is_floating_point else "0"
    if op == "prod":
        return "1.0" if ct.is_floating_point else "1"
    if ct.is_floating_point:
        return 'float("-inf")' if op == "max" else 'float("inf")'
    info = torch.iinfo(ct)
    return str(info.min if op == "max" else info.max)


def _reduce_ct(v: Value) -> torch.dtype:
    ct = compute_dtype(v.dtype)
    return torch.int32 if ct == torch.bool else ct  # bool max/min reduce as 0/1 integers


def _combine(op: str, ct: torch.dtype, e: Emitter) -> str:
    """The elementwise combine of two partial results (a format string with {a}, {b})."""
    if op == "sum":
        return "{a} + {b}"
    if op == "prod":
        return "{a} * {b}"
    if not ct.is_floating_point:
        return "tl.maximum({a}, {b})" if op == "max" else "tl.minimum({a}, {b})"
    fn = e.helper("_maximum" if op == "max" else "_minimum")
    return fn + "({a}, {b})"


def _final(op: str, ct: torch.dtype, block: str, e: Emitter) -> str:
    """Reduce ``block`` along the columns to a ``[ROWS, 1]`` row value."""
    if op == "sum":
        return f"tl.sum({block}, axis=1)[:, None]"
    if op == "prod":
        return f"tl.reduce({block}, 1, {e.helper('_prod')})[:, None]"
    if not ct.is_floating_point:
        return f"tl.{op}({block}, axis=1)[:, None]"
    fn = e.helper("_maximum" if op == "max" else "_minimum")
    return f"tl.reduce({block}, 1, {fn})[:, None]"


def _deps(row: bool, col: bool) -> frozenset[str]:
    return frozenset(({"row"} if row else set()) | ({"col"} if col else set()))


class _Kernel:
    """Layout facts shared by both variants of one plan."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        nt = [d for d in range(plan.rank) if d not in plan.trivial]
        self.red = [d for d in nt if d in plan.reduced]
        self.kept = [d for d in nt if d not in plan.reduced]
        self.trailing = not self.kept or not self.red or max(self.kept) < min(self.red)
        self.used = used_values(plan)
        self.needed_rows: set[int] = set()
        self.needed_cols: set[int] = set()
        self.loads = [(v, self._input_access(v)) for v in plan.values
                      if v.kind == "input" and v in self.used]
        self.stores = [(j, v, self._output_access(j, v)) for j, v in computed_outputs(plan)]

    def full(self, v: Value) -> bool:
        return bool(v.span & set(self.red))

    def _strided(self, name: str, dims: list[int]) -> tuple[str, tuple[tuple[int, str], ...]]:
        strides = tuple((d, f"{name}_stride{d}") for d in dims)
        for d in dims:
            (self.needed_rows if d in self.kept else self.needed_cols).add(d)
        return " + ".join(f"i{d} * {s}" for d, s in strides), strides

    def _fast(self, row_dep: bool, col_dep: bool) -> Access:
        row = ("r * cols" if col_dep else "r") if row_dep else ""
        off = " + ".join(p for p in (row, "c" if col_dep else "") if p)
        return Access(off, _deps(row_dep, col_dep))

    def _input_access(self, v: Value) -> Access:
        pat = self.plan.patterns[v.index]
        sk = [d for d in self.kept if pat[d] == "s"]
        sr = [d for d in self.red if pat[d] == "s"]
        if self.plan.dense[v.index] and self.trailing and sk in ([], self.kept) \
                and sr in ([], self.red):
            return self._fast(bool(sk), bool(sr))
        off, strides = self._strided(v.name, sk + sr)
        return Access(off, _deps(bool(sk), bool(sr)), strides)

    def _output_access(self, j: int, v: Value) -> Access:
        sk = [d for d in self.kept if d in v.span]
        sr = [d for d in self.red if d in v.span]
        full = bool(sr)
        if full:
            mask_dims = tuple(d for d in self.kept + self.red if d not in v.span)
        else:
            mask_dims = tuple(d for d in self.kept if d not in v.span)
        self.needed_rows |= {d for d in mask_dims if d in self.kept}
        self.needed_cols |= {d for d in mask_dims if d in self.red}
        if v.layout is None and sk in ([], self.kept) and (
                not full or (self.trailing and sr == self.red)):
            acc = self._fast(bool(sk), full)
        else:
            off, strides = self._strided(f"out{j}", sk + sr)
            acc = Access(off, _deps(bool(sk), bool(sr)), strides)
        acc.mask_dims = mask_dims
        return acc


def _load_mask(acc: Access) -> str:
    return {frozenset({"row"}): "rmask", frozenset({"col"}): "cmask"}.get(acc.deps, "mask")


def _store(e: Emitter, k: _Kernel, j: int, v: Value, acc: Access) -> str:
    pad = "" if "row" in acc.deps else " + 0 * r"
    if k.full(v):
        pad += "" if "col" in acc.deps else " + 0 * c"
        return store_line(e, f"out{j}_ptr", v, acc, "mask", pad)
    return store_line(e, f"out{j}_ptr", v, acc, "rmask", pad)


def _reduce_input(e: Emitter, v: Value) -> str:
    ct = _reduce_ct(v)
    x = e.c(operand(v.args["input"], v, e), ct)
    return f"tl.where(mask, {x}, {_identity(v.op, ct)})"


def _row_prelude(k: _Kernel, block: str, ind: str) -> list[str]:
    lines = [f"r = {block} * ROWS + tl.arange(0, ROWS)[:, None]", "rmask = r < rows"]
    decompose(lines, "r", k.kept, k.needed_rows, "", "rrem", fast=not k.plan.int64)
    return [ind + ln for ln in lines]


def _pid(int64: bool) -> str:
    return "    pid = " + ("tl.program_id(0).to(tl.int64)" if int64 else "tl.program_id(0)")


def _col_prelude(k: _Kernel, start: str, ind: str) -> list[str]:
    lines = [f"c = {start}tl.arange(0, BLOCK_C)[None, :]", "cmask = c < cols",
             "mask = rmask & cmask"]
    decompose(lines, "c", k.red, k.needed_cols, "", "crem", fast=not k.plan.int64)
    return [ind + ln for ln in lines]


def _persistent(k: _Kernel, e: Emitter) -> None:
    # One row block per program. (A grid-stride loop over row blocks with num_stages
    # pipelining measured slower on an H200: 75% vs 93% of copy for an fp32 softmax.)
    ind = "    "
    e.lines += [_pid(k.plan.int64)] + _row_prelude(k, "pid", ind)
    e.lines += scalar_lines(k.plan, k.used, "[ROWS, 1]", ind) + _col_prelude(k, "", ind)
    for v, acc in k.loads:
        e.lines.append(ind + load_line(v, acc, _load_mask(acc), "[ROWS, 1]"))
    for v in k.plan.values:
        if v.kind == "reduce":
            block = _reduce_input(e, v)
            red = _final(v.op, _reduce_ct(v), block, e)
            if compute_dtype(v.dtype) == torch.bool:
                red = f"({red} != 0)"
            e.lines.append(f"{ind}{v.name} = {red}")
        elif v.kind in ("pw", "count"):
            emit_value(e, v, ind)
    for j, v, acc in k.stores:
        e.lines.append(ind + _store(e, k, j, v, acc))


def _levels(plan: Plan) -> dict[Value, int]:
    level: dict[Value, int] = {}
    for v in plan.values:
        deps = [level[d] for d in v.deps()]
        base = max(deps, default=0)
        level[v] = base + 1 if v.kind == "reduce" else base
    return level


def _cone(k: _Kernel, roots: list[Value]) -> set[Value]:
    """The full values (and full loads) a loop must recompute to produce ``roots``."""
    out: set[Value] = set()
    todo = list(roots)
    while todo:
        v = todo.pop()
        if v in out or not k.full(v):
            continue
        out.add(v)
        todo.extend(v.deps())
    return out


def _looped(k: _Kernel, e: Emitter) -> None:
    plan = k.plan
    level = _levels(plan)
    depth = max(level.values())
    loads = dict(k.loads)
    e.lines += [_pid(plan.int64)] + _row_prelude(k, "pid", "    ")
    e.lines += scalar_lines(plan, k.used, "[ROWS, 1]", "    ")
    ind, inner = "    ", "        "

    def emit_rows(lvl: int) -> None:
        for v in plan.values:
            if k.full(v) or level[v] != lvl or v.kind == "reduce":
                continue
            if v.kind == "input" and v in loads:
                e.lines.append(ind + load_line(v, loads[v], _load_mask(loads[v]), "[ROWS, 1]"))
            elif v.kind in ("pw", "count"):
                emit_value(e, v, ind)
        for j, v, acc in k.stores:
            if not k.full(v) and level[v] == lvl:
                e.lines.append(ind + _store(e, k, j, v, acc))

    def emit_loop(roots: list[Value], body_tail: list[str], last: bool) -> None:
        # Cache hints: rows read again by a later loop stay in L2 (evict_last) until the
        # last loop (evict_first); a row vector (a weight) every program reads stays too.
        cone = _cone(k, roots)
        e.lines.append(f"{ind}for c0 in range(0, cols, BLOCK_C):")
        e.lines += _col_prelude(k, "c0 + ", inner)
        for v in plan.values:
            if v not in cone:
                continue
            if v.kind == "input":
                acc = loads[v]
                hint = "evict_first" if last and "row" in acc.deps else "evict_last"
                e.lines.append(inner + load_line(v, acc, _load_mask(acc), "[ROWS, 1]", hint))
            elif v.kind in ("pw", "count"):
                emit_value(e, v, inner)
        e.lines.extend(inner + t for t in body_tail)

    # A full-size output is stored by the first loop that can compute it: the loop of
    # the level after its own (its reductions are row values by then), or a last loop
    # for those that need the deepest reductions. Stored in a reduction's loop, it costs
    # no second pass over the inputs (a BatchNorm backward's masked gradient is level 0).
    full_out = [(j, v, acc) for j, v, acc in k.stores if k.full(v)]
    early = {lvl: [(j, v, acc) for j, v, acc in full_out if level[v] == lvl - 1]
             for lvl in range(1, depth + 1)}
    late = [(j, v, acc) for j, v, acc in full_out if level[v] >= depth]
    emit_rows(0)
    for lvl in range(1, depth + 1):
        reds = [v for v in plan.values if v.kind == "reduce" and level[v] == lvl]
        tail = [_store(e, k, j, v, acc) for j, v, acc in early[lvl]]
        for v in reds:
            ct = _reduce_ct(v)
            e.lines.append(f"{ind}{v.name}_acc = tl.full([ROWS, BLOCK_C], "
                           f"{_identity(v.op, ct)}, {tl_dtype(ct)})")
        for v in reds:
            block = _reduce_input(e, v)
            comb = _combine(v.op, _reduce_ct(v), e).format(a=f"{v.name}_acc", b=block)
            tail.append(f"{v.name}_acc = {comb}")
        emit_loop([v.args["input"] for v in reds] + [v for _, v, _ in early[lvl]], tail,
                  lvl == depth and not late)
        for v in reds:
            red = _final(v.op, _reduce_ct(v), f"{v.name}_acc", e)
            if compute_dtype(v.dtype) == torch.bool:
                red = f"({red} != 0)"
            e.lines.append(f"{ind}{v.name} = {red}")
        emit_rows(lvl)
    if late:
        emit_loop([v for _, v, _ in late], [_store(e, k, j, v, acc) for j, v, acc in late], True)


def build_reduction(plan: Plan, libdevice: bool) -> KernelSource:
    """Generate both row-kernel variants for ``plan``.

    Args:
        plan: an analyzed group with at least one reduction.
        libdevice: use libdevice functions (GPU); False for the CPU interpreter.

    Returns:
        The source with ``<name>_persistent`` and ``<name>_looped``, and their (shared)
        launch arguments.
    """
    k = _Kernel(plan)
    # with the reduced dims innermost, row r and column c are element r * cols + c
    e = Emitter(libdevice=libdevice, index="(r * cols + c)" if k.trailing else None,
                space=frozenset(k.kept + k.red), reduced=frozenset(k.red))
    _persistent(k, e)
    persistent = e.lines
    e.lines = []
    _looped(k, e)
    looped = e.lines
    body = "\n".join(persistent + looped)
    sig, args, nospec = signature(plan, body, k.used, k.loads, k.stores, ["rows", "cols"])
    deco = f"@triton.jit(do_not_specialize={nospec!r})" if nospec else "@triton.jit"
    params = ", ".join(sig) + ", ROWS: tl.constexpr, BLOCK_C: tl.constexpr"
    text = header(body, e.helpers, libdevice)
    fns = {}
    for variant, lines in (("persistent", persistent), ("looped", looped)):
        fn = f"{plan.name}_{variant}"
        fns[variant] = fn
        text += f"\n\n{deco}\ndef {fn}({params}):\n" + "\n".join(lines) + "\n"
    return KernelSource(text, fns, args)
