"""The op table's coverage: every op against every interpretation, keyed by op name.

Each interpretation keeps its own dict keyed by the records' names: the dtype rule is a
field of the record (``fxlite.ops.OPS``), shapes are ``fxlite.ops.shapes`` (by kind, and
``VIEW_SHAPES`` for views), derivatives ``fxlite.ops.derivatives.VJP``, decompositions
``fxlite.passes.decompose.DECOMPOSITIONS`` and Triton expressions
``fxlite.codegen.kernels.ops.TRITON_OPS`` (``REDUCTIONS`` for reductions). What an op
needs follows from its kind (:data:`NEEDS`); a hole that is not in :data:`EXCEPTIONS`,
with its reason, fails the test, and so does an exception that is no longer a hole.
"""

from __future__ import annotations

import torch
from fxlite.codegen.kernels.ops import REDUCTIONS, TRITON_OPS
from fxlite.passes.decompose import DECOMPOSITIONS

from fxlite.ops import OPS, OpInfo
from fxlite.ops.derivatives import VJP
from fxlite.ops.shapes import VIEW_SHAPES

COLUMNS = ("record", "dtype", "shape", "vjp", "decomposition", "triton")

# What each kind of op needs. Externs and effects run in eager PyTorch (on meta tensors
# for shapes), so their other columns are optional.
NEEDS = {
    "pointwise": {"dtype", "shape", "vjp", "triton"},
    "reduction": {"dtype", "shape", "vjp", "triton"},
    "view": {"dtype", "shape", "vjp"},  # kernels index through views (no expression)
    "composite": {"dtype", "shape", "vjp", "decomposition"},  # kernels see their parts
    "extern": {"dtype"},
    "effect": set(),
}

_INTEGER_ONLY = "integer and bool operands only: no gradient"
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("Tensor.where", "dtype"): "refines to where (x.where(c, y) is torch.where(c, x, y))",
    ("to_other", "dtype"): "x.to(device) or x.to(other): the dtype is another tensor's, or kept",
    ("type", "dtype"): "x.type() is a string; x.type(dtype) refines to to",
    ("softmax_implicit_dim", "dtype"): "nn.Softmax() without a dim (deprecated): runs in eager",
    ("getitem", "shape"): "indexing runs on meta tensors (shapes.infer falls back)",
    ("getitem", "vjp"): "no rule: autograd regions leave indexing to eager autograd",
    ("floordiv", "vjp"): "eager does not implement floor_divide's derivative either",
    ("bitwise_and", "vjp"): _INTEGER_ONLY,
    ("bitwise_or", "vjp"): _INTEGER_ONLY,
    ("bitwise_xor", "vjp"): _INTEGER_ONLY,
    ("bitwise_not", "vjp"): _INTEGER_ONLY,
    ("bitwise_left_shift", "vjp"): _INTEGER_ONLY,
    ("bitwise_right_shift", "vjp"): _INTEGER_ONLY,
    ("bitwise_left_shift", "triton"): "no kernel form yet: runs in eager PyTorch",
    ("bitwise_right_shift", "triton"): "no kernel form yet: runs in eager PyTorch",
    ("max", "triton"): "max(x, dim) gives (values, indices), which kernels do not; max(x) refines to amax",
    ("norm", "decomposition"): "matrix norms only (the rest refines to vector_norm): eager",
    ("norm", "vjp"): "matrix norms only (the rest refines to vector_norm): eager autograd",
    ("min", "triton"): "min(x, dim) gives (values, indices), which kernels do not; min(x) refines to amin",
}


def _has(name: str, info: OpInfo, column: str) -> bool:
    if column == "record":
        return True
    if column == "dtype":
        return info.dtype_rule is not None
    if column == "shape":
        return info.kind in ("pointwise", "reduction", "composite") or name in VIEW_SHAPES
    if column == "vjp":
        return name in VJP
    if column == "decomposition":
        return name in DECOMPOSITIONS
    return name in TRITON_OPS or name in REDUCTIONS


def _needs(info: OpInfo, column: str) -> bool:
    if column == "vjp" and info.dtype_rule == "bool":
        return False  # comparisons and tests (isnan): a bool result carries no gradient
    return column == "record" or column in NEEDS[info.kind]


def coverage() -> dict[str, dict[str, str]]:
    """``{op: {column: mark}}``: ``x`` present, ``.`` absent and not needed, ``e`` an
    excepted hole, ``!`` a hole."""
    out = {}
    for name, info in OPS.items():
        row = {}
        for column in COLUMNS:
            if _has(name, info, column):
                row[column] = "x"
            elif not _needs(info, column):
                row[column] = "."
            else:
                row[column] = "e" if (name, column) in EXCEPTIONS else "!"
        out[name] = row
    return out


def test_every_op_is_covered_or_excepted_with_a_reason():
    table = coverage()
    width = max(len(n) for n in table)
    print()
    print(f"{'op':{width}}  {'kind':10}" + "".join(f"{c:>14}" for c in COLUMNS))
    for name, row in table.items():
        print(f"{name:{width}}  {OPS[name].kind:10}" + "".join(f"{row[c]:>14}" for c in COLUMNS))
    holes = sorted((n, c) for n, row in table.items() for c, mark in row.items() if mark == "!")
    assert not holes, f"ops lacking an interpretation their kind needs: {holes}"
    stale = sorted(k for k in EXCEPTIONS if table.get(k[0], {}).get(k[1]) != "e")
    assert not stale, f"exceptions that are no longer holes: {stale}"
    assert all(reason for reason in EXCEPTIONS.values())


def test_every_interpretation_is_keyed_by_op_name():
    tables = {"VJP": VJP, "VIEW_SHAPES": VIEW_SHAPES, "TRITON_OPS": TRITON_OPS,
              "REDUCTIONS": REDUCTIONS,
              "DECOMPOSITIONS": {k: v for k, v in DECOMPOSITIONS.items() if isinstance(k, str)}}
    for label, table in tables.items():
        assert table, label
        assert set(table) <= set(OPS), (label, sorted(set(table) - set(OPS)))
    # function keys only for functions the table does not know (no op, no name)
    functions = [k for k in DECOMPOSITIONS if not isinstance(k, str)]
    assert all(k.__name__ not in OPS for k in functions), functions
    assert all(OPS[name].kind == "view" for name in VIEW_SHAPES)


def test_records_are_complete_without_the_interpretations():
    # a fresh interpreter: importing fxlite.ops alone gives complete records, and no
    # interpretation (derivatives, decompositions, Triton) is imported to get them
    import subprocess
    import sys

    code = ("import sys, fxlite.ops as ops; "
            "assert ops.OPS['relu'].dtype_rule == 'same' and ops.OPS['sum'].positional == 1; "
            "assert ops.OPS['matmul'] is ops.lookup_target(ops.OPS['matmul'].functions[-1]); "
            "print(sorted(m for m in sys.modules if m.startswith(('fxlite.ops.derivatives', "
            "'fxlite.passes.decompose', 'fxlite.codegen.kernels'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_squeeze_rule_agrees_with_eager_on_every_spelling_of_dim():
    # squeeze(()) squeezes nothing in torch; the rule once read () as every dim, as a
    # reduction's dim=() is
    x = torch.ones(1, 2, 1, 3, 1)
    for dim in (None, (), [], 0, -1, 1, (0, 2), [0, -1], (1,)):
        eager = x.squeeze() if dim is None else x.squeeze(dim)
        assert VIEW_SHAPES["squeeze"](list(x.shape), {"dim": dim}) == list(eager.shape), dim
