"""Differential tests of the Triton kernel generator against eager PyTorch.

On a CPU-only machine kernels run through Triton's interpreter (TRITON_INTERPRET=1, set
by conftest.py unless the environment says otherwise); with CUDA and TRITON_INTERPRET unset they
run natively on the GPU. Shapes are small so the interpreter stays fast.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fxlite.codegen.runtime.kernel import (
    TritonKernel,
    generate_kernel,
    guard_key,
    interpreting,
    launch_config,
    why_unsupported,
)
from fxlite.passes.shape_prop import ShapeProp

import fxlite

DEVICE = "cpu" if interpreting() else "cuda"
HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)
GOLDEN = Path(__file__).resolve().parents[2] / "golden"

# Masked lanes of the interpreter compute on padding (log(0), x / 0): harmless, but noisy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _wrap(fn, n):
    """A Python function of ``n`` positional tensors (symbolic_trace needs a signature)."""
    return {1: lambda a: fn(a), 2: lambda a, b: fn(a, b), 3: lambda a, b, c: fn(a, b, c),
            4: lambda a, b, c, d: fn(a, b, c, d)}[n]


def group(fn, *inputs):
    """Trace ``fn`` into a fused-group-like GraphModule with ShapeProp metadata."""
    plain = fn.__module__.startswith("test_") and fn.__name__ != "<lambda>"
    gm = fxlite.symbolic_trace(fn if plain else _wrap(fn, len(inputs)))
    ShapeProp(gm).propagate(*inputs)
    return gm


def tol(dtype):
    return {torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 4e-2),
            torch.float32: (1e-5, 1e-5), torch.float64: (1e-7, 1e-7)}.get(dtype, (0, 0))


def same(got, expected):
    if isinstance(expected, (tuple, list)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for g, e in zip(got, expected):
            same(g, e)
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # the layout eager gives (contiguous, or its inputs' memory order: codegen/triton_layout)
    assert got.stride() == expected.stride() or got.numel() <= 1, (got.stride(), expected.stride())
    rtol, atol = tol(expected.dtype)
    torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=rtol, atol=atol, equal_nan=True)


def check(fn, *inputs, expected=None, **kw) -> TritonKernel:
    """Generate a kernel for ``fn`` and compare it with eager; returns the kernel."""
    gm = group(fn, *inputs)
    kernel = generate_kernel(gm, list(inputs), name="k", **kw)
    assert kernel is not None, why_unsupported(gm, list(inputs))
    same(kernel(*inputs), fn(*inputs) if expected is None else expected)
    return kernel


def rand(*shape, dtype=torch.float32, scale=3.0):
    if dtype == torch.bool:
        return torch.rand(*shape, device=DEVICE) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-20, 20, shape, device=DEVICE).to(dtype)
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


# ------------------------------------------------------------------------ pointwise ops
POS = lambda x: x.abs() + 0.25  # noqa: E731  (domain helper for log, sqrt...)
UNARY_FLOAT = {
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "exp": torch.exp, "exp2": torch.exp2, "log": lambda x: torch.log(POS(x)),
    "log2": lambda x: torch.log2(POS(x)), "log1p": lambda x: torch.log1p(x.abs() - 0.5),
    "expm1": torch.expm1, "sqrt": lambda x: torch.sqrt(POS(x)),
    "rsqrt": lambda x: torch.rsqrt(POS(x)), "sin": torch.sin, "cos": torch.cos,
    "erf": torch.erf, "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc,
    "round": torch.round, "sign": torch.sign, "reciprocal": lambda x: torch.reciprocal(POS(x)),
    "square": torch.square, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu, "softplus": F.softplus, "mish": F.mish, "leaky_relu": F.leaky_relu,
    "elu": F.elu, "hardtanh": F.hardtanh, "relu6": F.relu6, "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish, "isnan": torch.isnan, "isinf": torch.isinf,
    "isfinite": torch.isfinite, "logical_not": torch.logical_not, "pow2": lambda x: x ** 2,
    "pow3": lambda x: torch.pow(x, 3), "pow_frac": lambda x: POS(x) ** 1.7,
    "pow_half": lambda x: POS(x) ** 0.5, "rsub": lambda x: 1 - x,
    "to_f16": lambda x: x.to(torch.float16), "to_i32": lambda x: (x * 3).to(torch.int32),
    "to_bool": lambda x: (x - x.round()).bool(), "to_f32": lambda x: (x * 3).float(),
    "clamp": lambda x: torch.clamp(x, -0.5, 0.5), "clamp_min": lambda x: x.clamp(min=0.1),
    "relu_add_mul": lambda x: torch.relu(x + 1) * 2,
}
BINARY_FLOAT = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "div_trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
    "div_floor": lambda x, y: torch.div(x, y, rounding_mode="floor"),
    "floor_divide": torch.floor_divide, "remainder": torch.remainder, "fmod": torch.fmod,
    "pow": lambda x, y: torch.pow(POS(x), y), "maximum": torch.maximum,
    "minimum": torch.minimum, "eq": lambda x, y: x.round() == y.round(), "ne": torch.ne,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor, "where": lambda x, y: torch.where(x > 0, x, y),
    "alpha": lambda x, y: torch.add(x, y, alpha=2), "clamp_t": lambda x, y: torch.clamp(x, min=y),
}


@pytest.mark.parametrize("dtype", FLOATS + (torch.float64,), ids=str)
def test_float_unary_ops(dtype):
    x = rand(3, 7, dtype=dtype)
    for name, fn in UNARY_FLOAT.items():
        try:
            check(fn, x)
        except AssertionError as e:
            raise AssertionError(f"{name} on {dtype}: {e}") from e


@pytest.mark.parametrize("dtype", FLOATS + (torch.float64,), ids=str)
def test_float_binary_ops(dtype):
    x, y = rand(3, 7, dtype=dtype), rand(3, 7, dtype=dtype, scale=2.0)
    for name, fn in BINARY_FLOAT.items():
        try:
            check(fn, x, y)
        except AssertionError as e:
            raise AssertionError(f"{name} on {dtype}: {e}") from e


INT_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "sign": torch.sign,
    "square": torch.square, "pow3": lambda x: x ** 3, "floor": torch.floor,
    "rsub": lambda x: 3 - x, "clamp": lambda x: x.clamp(-5, 5), "bitwise_not": torch.bitwise_not,
    "to_f16": lambda x: x.half(), "exp": torch.exp, "sigmoid": torch.sigmoid,
    "isnan": torch.isnan, "logical_not": torch.logical_not, "float_mul": lambda x: x * 0.5,
}
INT_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "true_div": torch.div,
    "div_trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
    "floor_divide": torch.floor_divide, "remainder": torch.remainder, "fmod": torch.fmod,
    "maximum": torch.maximum, "minimum": torch.minimum, "eq": torch.eq, "lt": torch.lt,
    "where": lambda x, y: torch.where(x > y, x, y), "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
    "alpha": lambda x, y: torch.sub(x, y, alpha=3),
}

INT_DIVISIONS = ("div_trunc", "floor_divide", "remainder", "fmod")
INT_BY_LITERAL = {  # a non-zero literal divisor is safe
    "div_trunc": lambda x: torch.div(x, 3, rounding_mode="trunc"),
    "floor_divide": lambda x: x // 3, "floor_negative": lambda x: x // -4,
    "remainder": lambda x: x % 5, "remainder_negative": lambda x: torch.remainder(x, -3),
    "fmod": lambda x: torch.fmod(x, 3),
}


@pytest.mark.parametrize("dtype", INTS + (torch.int8, torch.uint8), ids=str)
def test_integer_ops(dtype):
    x = rand(3, 7, dtype=dtype)
    y = torch.randint(1, 7, (3, 7), device=DEVICE) * (torch.randint(0, 2, (3, 7), device=DEVICE) * 2 - 1)
    y = y.to(dtype)
    for name, fn in INT_UNARY.items():
        if dtype == torch.uint8 and name == "clamp":  # -5 does not fit: eager only
            assert generate_kernel(group(fn, x), [x]) is None
            continue
        check(fn, x)
    for name, fn in INT_BINARY.items():
        if name in INT_DIVISIONS:  # a tensor divisor may be 0: eager's answer is per device
            assert generate_kernel(group(fn, x, y), [x, y]) is None, name
            continue
        try:
            check(fn, x, y)
        except AssertionError as e:
            raise AssertionError(f"{name} on {dtype}: {e}") from e
    for name, fn in INT_BY_LITERAL.items():
        if dtype == torch.uint8 and name.endswith("negative"):  # -4 does not fit: eager only
            assert generate_kernel(group(fn, x), [x]) is None
            continue
        try:
            check(fn, x)
        except AssertionError as e:
            raise AssertionError(f"{name} on {dtype}: {e}") from e


def test_bool_ops():
    a, b = rand(4, 5, dtype=torch.bool), rand(4, 5, dtype=torch.bool)
    x = rand(4, 5)
    for fn in (torch.logical_and, torch.logical_or, torch.logical_xor, torch.bitwise_and,
               torch.bitwise_xor, torch.add, torch.mul, torch.eq, torch.lt, torch.maximum,
               torch.minimum, lambda p, q: torch.where(p, q, False)):
        check(fn, a, b)
    for fn in (torch.logical_not, torch.bitwise_not, lambda p: p.float() * 2, torch.sign,
               lambda p: p + 1):
        check(fn, a)
    check(lambda p, v: torch.where(p, v, -v), a, x)


@pytest.mark.parametrize("dtype", INTS + (torch.float32,), ids=str)
def test_floor_division_and_remainder_with_negatives(dtype):
    signs = torch.tensor([7, -7, 7, -7, 6, -6, 0, 1], device=DEVICE).to(dtype)
    divisors = torch.tensor([2, 2, -2, -2, 3, -3, 5, -4], device=DEVICE).to(dtype)
    if not dtype.is_floating_point:  # tensor divisors: see test_integer_division_by_zero
        for d in (2, -2, 3, -3, 5, -4):
            check(lambda a, b, d=d: torch.floor_divide(a, d) + b * 0, signs, divisors)
            check(lambda a, b, d=d: torch.remainder(a, d) + b * 0, signs, divisors)
        return
    k = check(torch.floor_divide, signs, divisors)
    assert (k(signs, divisors).cpu() == torch.floor_divide(signs, divisors).cpu()).all()
    check(torch.remainder, signs, divisors)
    check(lambda a, b: torch.div(a, b, rounding_mode="floor"), signs, divisors)
    check(lambda a, b: a % 3, signs, divisors)  # a literal divisor


def test_the_op_table_holds_the_triton_column():
    from fxlite.codegen.kernels.ops import REDUCTIONS, TRITON_OPS

    from fxlite.ops import OPS

    for name, spec in TRITON_OPS.items():
        assert name in OPS and spec.emit  # keyed by the op table's names
    lacking = {name for name, info in OPS.items() if info.kind == "pointwise"
               and name not in TRITON_OPS and name not in REDUCTIONS}
    # Pointwise ops with no kernel form yet: they run in eager PyTorch.
    assert lacking == {"bitwise_left_shift", "bitwise_right_shift"}


def test_tensor_where_takes_the_tensor_as_input():
    # x.where(c, y) is torch.where(c, x, y); the generator once bound x as the condition.
    x, c = rand(3, 4), rand(3, 4)
    check(lambda a, b: a.where(b > 0, 0.0), x, c)
    check(lambda a, b: a.where(b > 0, b), x, c)


def test_type_promotion():
    f16, f32 = rand(3, 4, dtype=torch.float16), rand(3, 4)
    i32, i64 = rand(3, 4, dtype=torch.int32), rand(3, 4, dtype=torch.int64)
    b = rand(3, 4, dtype=torch.bool)
    check(torch.add, f16, f32)                     # f16 + f32 -> f32
    check(lambda a, c: (a * 3) + c, f16, f32)      # the f16 product is rounded first
    check(torch.mul, i32, i64)                     # -> int64
    check(lambda a: a * 2.5, i32)                  # int * float scalar -> f32
    check(torch.add, b, i32)                       # bool + int -> int
    t0 = torch.tensor(1.5, dtype=torch.float64, device=DEVICE)
    check(torch.mul, f32, t0)                      # a 0-d f64 tensor does not promote
    check(lambda a, c: a > c, i32, f16)            # comparison computed in f16


# ------------------------------------------------------------------ layouts and shapes
def test_broadcasting_and_non_contiguous_inputs():
    f = lambda a, b: torch.relu(a + 1) * b  # noqa: E731
    x = rand(4, 3, 5)
    check(f, x, rand(3, 5))                        # broadcast leading dim
    check(f, x, rand(4, 1, 5))                     # size-1 middle dim
    check(f, x.transpose(0, 2).contiguous().transpose(0, 2), rand(5))  # permuted input
    check(f, rand(6, 10)[:, ::2], rand(6, 5).t().contiguous().t())     # sliced, transposed
    check(f, rand(4, 1).expand(4, 5), rand(5))     # expanded (stride 0)
    check(f, torch.tensor(2.0, device=DEVICE), rand(2, 3))  # 0-d tensor
    check(f, rand(2, 3), torch.tensor(-1.0, device=DEVICE))


def test_scalar_arguments():
    x = rand(3, 5)
    check(lambda a, s: a * s + 1, x, 2.5)
    check(lambda a, n: a + n, rand(3, 5, dtype=torch.int32), 7)
    check(lambda a, n: (a > n).float(), x, 1)
    k = check(lambda a, s: a * s, x, 2.5)
    same(k(x, -1.25), x * -1.25)                   # another value: same kernel
    assert k.compilations == 1


def test_empty_and_zero_dim():
    check(lambda a: torch.exp(a) + 1, torch.empty(0, 4, device=DEVICE))
    check(lambda a, b: a * b, torch.empty(3, 0, device=DEVICE), torch.empty(0, device=DEVICE))
    check(lambda a: torch.sigmoid(a) * 2, torch.tensor(0.3, device=DEVICE))
    check(lambda a, b: torch.maximum(a, b), torch.tensor(1.0, device=DEVICE),
          torch.tensor(float("nan"), device=DEVICE))


def test_multiple_outputs_and_passthrough():
    x, b = rand(4, 6), rand(6)
    check(lambda a, c: (a + c, torch.relu(a + c), a), x, b)
    check(lambda a, c: [a * 2, c * 3], x, b)       # an output smaller than the space
    k = check(lambda a, c: (a * c, a * c), x, b)
    assert len(k.nodes) >= 1


def test_nan_and_inf_propagation():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[nan, 1.0, -inf, 2.0], [0.0, nan, inf, -1.0]], device=DEVICE)
    y = torch.tensor([[1.0, nan, 0.0, inf], [nan, nan, -inf, 5.0]], device=DEVICE)
    for fn in (torch.maximum, torch.minimum, lambda a, b: torch.clamp(a, min=b),
               lambda a, b: torch.clamp(a, max=b), torch.add, torch.eq, torch.ne, torch.lt,
               lambda a, b: torch.where(torch.isnan(a), b, a)):
        check(fn, x, y)
    for fn in (torch.relu, torch.tanh, torch.sigmoid, torch.sign, torch.isinf, torch.isfinite,
               F.silu, torch.log1p, torch.expm1, torch.round, torch.floor, torch.exp,
               lambda a: torch.clamp(a, -1, 1), lambda a: torch.pow(a, 2.0)):
        check(fn, x)
    check(F.gelu, x.nan_to_num(posinf=3.0))  # eager's CPU gelu(inf) is NaN; erf's limit is inf


def test_guard_key_ignores_sizes_and_resizes_reuse_the_kernel():
    f = lambda a, b: torch.relu(a + b) * 2  # noqa: E731
    x, b = rand(4, 8), rand(8)
    k = check(f, x, b)
    key = guard_key([x, b])
    for rows, cols in ((7, 3), (2, 16), (33, 5)):
        x2, b2 = rand(rows, cols), rand(cols)
        assert guard_key([x2, b2]) == key
        same(k(x2, b2), f(x2, b2))
    assert k.compilations == 1
    # Another dtype, or a broadcast where there was none, is another specialization.
    x2, y2 = rand(6, 10), rand(6, 10)
    assert guard_key([x.half(), b]) != key and guard_key([x2, y2]) != key
    same(k(x2, y2), f(x2, y2))    # specialized anew for the new key and sizes
    assert k.compilations == 2 and "in0_ptr + offs" in k.source and "in1_ptr + offs" in k.source


def test_the_kernel_source_is_specialized_not_sized():
    k = check(lambda a: torch.relu(a + 1) * 2, rand(5, 7))
    assert "in0_ptr + offs" in k.source                     # the linear fast path
    assert not re.search(r"\b(5|7|35)\b", k.source)      # no size is baked in
    k2 = check(lambda a, b: a + b, rand(8, 8)[:, ::2], rand(8, 1))
    assert "i0 * in0_stride0 + i1 * in0_stride1" in k2.source  # the strided path (a slice)
    kt = check(lambda a, b: a + b, rand(4, 8).t(), rand(8, 1))
    assert "in0_ptr + offs" in kt.source  # a transposed input is read in its memory order
    # sizes that only split the index never specialize; numel, cols and strides may
    # (multiples of 16 are what let Triton vectorize), rows never.
    assert "@triton.jit(do_not_specialize=['size1', 'size1_m', 'size1_s'])" in k2.source
    k3 = check(lambda a: a.sum(-1), rand(4, 8))
    assert "do_not_specialize=['rows']" in k3.source


def test_int64_indexing_is_chosen_from_the_largest_address():
    small = torch.empty(4, 8)
    big = torch.empty(1, device="meta").expand(2**31 + 8)
    assert guard_key([small])[2] is False
    assert guard_key([big])[2] is True
    from fxlite.codegen.kernels.analysis import analyze
    from fxlite.codegen.kernels.pointwise import build_pointwise

    gm = group(lambda a: a * 2, big)
    plan = analyze(gm, [big], "big")
    text = build_pointwise(plan, libdevice=False).text
    assert "pid = tl.program_id(0).to(tl.int64)" in text


def test_unsupported_groups_return_none():
    x = rand(3, 4)
    gm = group(lambda a: torch.cumsum(a, 0), x)
    assert generate_kernel(gm, [x]) is None
    assert "no Triton form" in why_unsupported(gm, [x])
    gm = group(lambda a: a.view(12) + 1, x)
    assert generate_kernel(gm, [x]) is None
    z = torch.randn(3, 4, dtype=torch.complex64, device=DEVICE)
    gm = group(lambda a: a * 2, z)
    assert generate_kernel(gm, [z]) is None
    gm = group(lambda a: torch.amax(a, dim=0) + torch.sum(a, dim=1), rand(4, 4))
    assert generate_kernel(gm, [rand(4, 4)]) is None  # reductions over different dims


def test_libdevice_path_is_emitted_for_gpus():
    x = rand(3, 4)
    gm = group(lambda a, b: torch.tanh(a) + torch.pow(a.abs(), b) + torch.fmod(a, b)
               + torch.log1p(a.abs()), x, x)
    from fxlite.codegen.kernels.analysis import analyze
    from fxlite.codegen.kernels.pointwise import build_pointwise

    gpu = build_pointwise(analyze(gm, [x, x], "k"), libdevice=True).text
    cpu = build_pointwise(analyze(gm, [x, x], "k"), libdevice=False).text
    for fn in ("tanh", "pow", "fmod", "log1p"):
        assert f"libdevice.{fn}(" in gpu and f"libdevice.{fn}(" not in cpu
    assert "from triton.language.extra import libdevice" in gpu
    assert "libdevice" not in cpu


def test_rows_variant_for_wide_inner_dims():
    """Broadcast or strided inputs with a wide innermost dim launch the rows variant (no
    per-element division); narrow ones keep the flat variant. Both come from one spec."""
    f = lambda a, b: torch.relu(a + 1) * b  # noqa: E731
    k = check(f, rand(3, 512), rand(512))
    assert "_rows("  in k.source and "i1 = c" in k.source and "% size" not in \
        k.source.split("_rows(")[1]
    spec = k._current
    assert spec.config((3, 512))[1]["variant"] == "rows"
    assert spec.config((3, 256))[1] == {"variant": "rows", "BLOCK": 256, "ROWS": 4,
                                        "num_warps": 4}  # 4 rows a program: 3 are real
    for a, b in [(rand(5, 512), rand(512)),                      # pads by nothing
                 (rand(5, 256), rand(256)),                      # 4 rows a program, 5 rows
                 (rand(3, 3, 768), rand(768)),                   # 3 blocks a row
                 (rand(2, 3, 1024), rand(3, 1)),                  # outer dims from the row id
                 (rand(2, 3, 4600), rand(1, 3, 4600)),            # a ragged last block
                 (rand(7, 5), rand(5)),                           # narrow: the flat variant
                 (rand(1024, 6).t(), rand(6, 1)),                 # transposed, wide rows
                 (rand(3, 1).expand(3, 1024), rand(1024)),        # expanded
                 (rand(2, 3, 2048)[:, :, ::2], rand(3, 1024)),    # sliced inner dim
                 (torch.empty(0, 512, device=DEVICE), rand(512))]:
        same(k(a, b), f(a, b))
    before = k.compilations
    for a, b in [(rand(9, 512), rand(512)), (rand(4, 7), rand(7))]:  # rows, then flat
        same(k(a, b), f(a, b))
    assert k.compilations == before  # the variant is picked per launch, not per key
    k2 = check(lambda a, c: (a * c, torch.relu(a * c), c * 2), rand(4, 1024), rand(1024))
    assert k2._current.config((4, 1024))[1]["variant"] == "rows"
    # an output along the columns alone, next to a full one, with 4 rows a program (a
    # BatchNorm's mean next to its normalized values: was a compile error on the GPU)
    k3 = check(lambda a, c: (a * (c / 2), c / 2), rand(8, 256), rand(256))
    assert k3._current.config((8, 256))[1]["ROWS"] == 4
    check(lambda a, r: (a * (r / 2), r / 2), rand(8, 256), rand(8, 1))  # along the rows alone
    sliced = check(lambda a: a * 2, rand(4, 2048)[:, :1024])  # strided, nothing broadcast
    assert "_rows(" not in sliced.source  # the flat variant: as fast, one binary fewer
    check(lambda a, c: a // 7 + c, rand(2, 512, dtype=torch.int32), rand(512, dtype=torch.int32))
    check(lambda a, c: a * c, rand(3, 512, dtype=torch.float16), rand(512))


def test_launch_heuristic():
    assert launch_config("pointwise", 10**6) == {"variant": "pointwise", "BLOCK": 1024,
                                                  "num_warps": 4}
    assert launch_config("pointwise", 8192 * 8192, 8192)["variant"] == "rows"
    assert launch_config("pointwise", 64 * 1536, 1536)["BLOCK"] == 512  # 3 blocks, no padding
    assert launch_config("pointwise", 64 * 768, 768) == {"variant": "rows", "BLOCK": 256,
                                                         "ROWS": 4, "num_warps": 4}
    assert launch_config("pointwise", 64 * 200, 200)["variant"] == "pointwise"  # 28% padding
    assert launch_config("pointwise", 64 * 100, 100)["variant"] == "pointwise"
    cfg = launch_config("reduction", 8192, 8192)
    assert cfg["variant"] == "persistent" and cfg["BLOCK_C"] == 8192 and cfg["num_warps"] == 16
    assert launch_config("reduction", 4096, 32)["ROWS"] == 64
    assert launch_config("reduction", 8192, 8192, row_inputs=2)["num_warps"] == 4
    x, r, w = rand(4, 16), rand(4, 16), rand(16)
    ln = fxlite.compile(lambda a, c: F.layer_norm(a, (16,), c, c))
    add_ln = fxlite.compile(lambda a, b, c: F.layer_norm(a + b, (16,), c, c))
    ln(x, w), add_ln(x, r, w)
    assert ln.kernels[0]._current.launch.row_inputs == 1  # x (w is one row for all)
    assert add_ln.kernels[0]._current.launch.row_inputs == 2  # x and r
    assert launch_config("reduction", 8, 100_000)["variant"] == "looped"
    assert launch_config("reduction", 8, 100, max_block=16)["variant"] == "looped"
    # rows of 65 to 512 run one warp a program over 1024 elements (H200 measurements in
    # launch_config); shorter and longer rows keep 2048 elements over 4 warps or more
    narrow = launch_config("reduction", 100_352, 96)
    assert (narrow["ROWS"], narrow["BLOCK_C"], narrow["num_warps"]) == (8, 128, 1)
    assert launch_config("reduction", 4, 96)["ROWS"] == 4  # no more rows than there are
    assert launch_config("reduction", 8192, 768)["num_warps"] >= 4


def test_wide_rows_time_their_warps_and_narrow_ones_keep_the_heuristic():
    """Rows held whole from 8192 elements: the first GPU call times 4, 8, 16 and 32 warps
    (the best differs by op there), and from 16,384 the looped variant too; others,
    looped rows and strided ones time nothing."""
    from fxlite.codegen.kernels.config import WIDE_ROW, wide_row_configs
    wide = wide_row_configs(64, WIDE_ROW)
    assert wide[0] == launch_config("reduction", 64, WIDE_ROW)  # the heuristic's first
    assert sorted(c["num_warps"] for c in wide) == [4, 8, 16, 32]
    assert all({**c, "num_warps": 0} == {**wide[0], "num_warps": 0} for c in wide)
    wider = wide_row_configs(64, 2 * WIDE_ROW, itemsize=2)
    assert [c["variant"] for c in wider] == ["persistent"] * 4 + ["looped"] * 2
    assert [c["variant"] for c in wide_row_configs(64, 2 * WIDE_ROW)] == ["persistent"] * 4
    assert wide_row_configs(64, 2 * WIDE_ROW, max_block=WIDE_ROW, itemsize=2) == []
    assert wide_row_configs(64, WIDE_ROW // 2) == []
    assert wide_row_configs(64, WIDE_ROW, trailing=False) == []
    assert wide_row_configs(4, 100_000) == []  # looped: its chunk's warps were measured
    if interpreting():  # nothing to time: the heuristic stands
        x = rand(4, 16)
        ln = fxlite.compile(lambda a: F.layer_norm(a, (16,)))
        ln(x)
        assert ln.kernels[0].tune_wide_rows(x) is None and not ln.kernels[0]._current.tuned
    else:  # the kernel's check timed the warps and kept one
        x = rand(4, WIDE_ROW)
        ln = fxlite.compile(lambda a: F.layer_norm(a, (WIDE_ROW,)))
        torch.testing.assert_close(ln(x), F.layer_norm(x, (WIDE_ROW,)), rtol=1e-4, atol=1e-4)
        assert ln.kernels[0]._current.tuned[WIDE_ROW]["num_warps"] in (4, 8, 16, 32)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax"])
def test_every_config_timed_for_rows_of_16384_gives_eager_s_result(op, monkeypatch):
    """Whichever candidate the first GPU call's timing keeps for a 16,384-wide bfloat16
    row (held whole at 4 to 32 warps, or looped over chunks of 2048 or 4096) computes
    eager's result: each runs on the inputs the kernel's check saw, through the kernel's
    own runner (a GPU's later calls bypass it), two launches each."""
    from fxlite.codegen.kernels.analysis import iteration_space
    from fxlite.codegen.kernels.config import WIDE_ROW, wide_row_configs
    n = 2 * WIDE_ROW
    fn = {"layer_norm": lambda a, w: F.layer_norm(a, (n,), w, w),
          "rms_norm": lambda a, w: F.rms_norm(a, (n,), w, eps=1e-6),
          "softmax": lambda a, w: torch.softmax(a * w, -1)}[op]
    seen = []
    real_call = TritonKernel.__call__
    monkeypatch.setattr(TritonKernel, "__call__",
                        lambda self, *inputs: (seen.append(inputs), real_call(self, *inputs))[1])
    x, w = rand(2, n, dtype=torch.bfloat16), rand(n, dtype=torch.bfloat16)
    compiled = fxlite.compile(fn)
    want = fn(x, w)
    torch.testing.assert_close(compiled(x, w), want, rtol=2e-2, atol=2e-2)
    kernel, inputs = compiled.kernels[0], seen[0]
    spec = kernel._spec_for(inputs)
    shape = iteration_space(list(inputs))
    launched = []
    real_launch = spec._launch
    spec._launch = lambda variant, *rest: (launched.append(variant), real_launch(variant, *rest))
    configs = wide_row_configs(2, n, trailing=spec.launch.row_config, max_block=kernel._max_block,
                               row_inputs=spec.launch.row_inputs, itemsize=2)
    assert {c["variant"] for c in configs} == {"persistent", "looped"}
    if interpreting():  # it runs no warps: one config per variant and chunk
        configs = list({(c["variant"], c["BLOCK_C"]): c for c in configs}.values())
    for cfg in configs:
        for _ in range(2):
            launched.clear()
            got = spec.launch.returned(inputs, spec.run(inputs, shape, cfg))
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            assert launched == [cfg["variant"]], (cfg, launched)


def test_bytes_moved():
    x, b = rand(4, 8), rand(8)
    k = check(lambda a, c: a + c, x, b)
    assert k.bytes_moved(x, b) == (32 + 8 + 32) * 4
    assert k.bytes_moved(rand(4, 1).expand(4, 8), b) == (4 + 8 + 32) * 4


# --------------------------------------------------------------------- golden sources
def _golden(name: str, text: str) -> None:
    path = GOLDEN / f"triton_{name}.txt"
    if os.environ.get("FXLITE_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing {path}; run with FXLITE_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"generated source for {name} changed"


def _golden_source(fn, *inputs, name):
    gm = group(fn, *inputs)
    from fxlite.codegen.kernels.analysis import analyze
    from fxlite.codegen.kernels.pointwise import build_pointwise
    from fxlite.codegen.kernels.reduction import build_reduction

    plan = analyze(gm, list(inputs), name)
    build = build_pointwise if plan.kind == "pointwise" else build_reduction
    return build(plan, libdevice=False).text


def test_golden_relu_add_mul():
    _golden("relu_add_mul", _golden_source(lambda a: torch.relu(a + 1) * 2, torch.randn(4, 8),
                                           name="triton_relu_add_mul"))


def _softmax(x):
    m = torch.amax(x, dim=-1, keepdim=True)
    e = torch.exp(x - m)
    return e / torch.sum(e, dim=-1, keepdim=True)


def _layer_norm(x, w, b):
    mean = torch.mean(x, dim=-1, keepdim=True)
    centred = x - mean
    var = torch.mean(centred * centred, dim=-1, keepdim=True)
    return centred * torch.rsqrt(var + 1e-5) * w + b


def test_golden_softmax():
    _golden("softmax", _golden_source(_softmax, torch.randn(4, 8), name="triton_softmax"))


def test_golden_layer_norm():
    _golden("layer_norm", _golden_source(_layer_norm, torch.randn(4, 8), torch.randn(8),
                                         torch.randn(8), name="triton_layer_norm"))


# ------------------------------------------------------------------- GPU-only checks
@pytest.mark.gpu
@pytest.mark.parametrize("libdevice", [True, False], ids=["libdevice", "portable"])
def test_both_expression_paths_compile_natively(libdevice):
    """The interpreter path's expressions also compile and agree on a GPU."""
    x, y = rand(33, 65), rand(33, 65, scale=1.0)
    for fn in (torch.tanh, lambda a: F.gelu(a, approximate="tanh"), torch.log1p,
               torch.expm1, F.mish, lambda a: a.abs() ** 1.7, torch.round,
               lambda a: a.to(torch.bfloat16)):
        check(fn, x.abs() if fn is torch.log1p else x, libdevice=libdevice)
    for fn in (torch.fmod, torch.remainder, torch.floor_divide,
               lambda a, b: torch.pow(a.abs() + 0.5, b)):
        check(fn, x, y, libdevice=libdevice)
    check(lambda a: (a * 3).bfloat16(), x.bfloat16(), libdevice=libdevice)


@pytest.mark.gpu
def test_resizes_compile_once_on_the_gpu():
    """Sizes never recompile; only a change in multiple-of-16 alignment may (see signature),
    or a launch configuration not used before (the flat variant, or rows of 1024 or 256)."""
    f = lambda a, c: torch.relu(a + c) * 2  # noqa: E731
    k = check(f, rand(64, 1024), rand(1024))      # the rows variant, blocks of 1024
    check(f, rand(64, 256), rand(256))            # blocks of 256
    check(f, rand(4, 16), rand(16))               # the flat variant
    fns = k._current.fns.values()  # shared with earlier tests of the same source

    def compiled():
        return sum(len(cache[0]) for fn in fns for cache in fn.device_caches.values())

    before = compiled()
    for rows, cols in ((32, 48), (256, 2048), (5, 16), (3, 4096), (7, 768)):
        x2, b2 = rand(rows, cols), rand(cols)
        same(k(x2, b2), torch.relu(x2 + b2) * 2)
    assert k.compilations == 1 and compiled() == before
