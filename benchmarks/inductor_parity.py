"""Parity with torch.compile's Inductor, measured by Inductor's own ``self.common`` test cases.

PyTorch ships ``test/inductor/test_torchinductor.py``. Its ``CommonTemplate`` class holds
580 tests (in the version this script was written against), of which 449 (504 with
``test_pointwise``'s parametrizations) hand a function or module and its inputs to
``self.common``, which for the CPU is ``check_model``: compile with Inductor, run, compare
with eager PyTorch. They are not part of fxlite: save the
file (BSD-licensed, from the PyTorch repository) into an ignored folder, by default::

    .parity/inductor/test_torchinductor.py

This script adapts it at run time, with the fewest changes, and runs it in-process:

- ``check_model`` (``self.common``, and ``SweepInputs2``'s 64 layout sweeps, which call it
  directly) is replaced: the function is compiled **once** with ``fxlite.compile`` and
  called ``--calls`` times (4): on the test's own inputs (fxlite's recording call), twice on
  fresh inputs of the same shapes, strides and dtypes, then on copies of the test's inputs
  (a replay on the values the test chose). Fresh inputs are the test's tensors with their
  elements shuffled: a new order of the same values, so index bounds, NaNs and value
  ranges hold; sorted tensors (bucketize boundaries, offsets) and expanded ones are copied
  as they are, as are inputs eager PyTorch rejects once shuffled and the tests of
  :data:`KEEP_INPUTS`. Every call is compared with eager PyTorch as upstream's
  ``check_model`` compares its one call: output types and dtypes, values with the test's
  ``atol``/``rtol``/``exact_dtype`` (``reference_in_float``: the reference in float32 for
  float16/bfloat16 inputs), the inputs after the call (mutations), gradients when the test
  asks (``check_gradient``, which no test of this file does), plus a module's
  ``state_dict`` against an eager copy's. On shuffled inputs only, an output outside the
  test's tolerance still passes when it is as close to a float64 run as eager's (the
  tolerance was chosen for the test's inputs; the report names such tests). A compiled call
  that raises where eager does not is an error, not a failure (a wrong answer);
- **Inductor-internal assertions neutralised** where the comparison is the real test:
  ``assertGeneratedKernelCountEqual`` passes, statements that read Inductor's metrics,
  generated code or compile counters are replaced by ``pass`` (:data:`NEUTRALISE`),
  ``@torch.compile`` decorating a function handed to ``self.common`` is dropped (fxlite
  compiles it) and other ``torch.compile(...)`` calls in those tests become
  ``fxlite.compile(...)``; ``is_cpp_backend`` answers False (fxlite is not Inductor's C++
  backend, so tests Inductor skips for that backend's gaps run); the tests' decorators that
  patch Inductor's ``config`` are dropped: they change nothing fxlite reads, and some name
  options this torch no longer has (``abi_compatible``);
- the CommonTemplate tests that do not go through ``self.common`` (they call
  ``torch.compile``, ``compile_fx_inner`` or AOTInductor themselves, or read Inductor's
  generated code) are set aside by rule, with their reason; :data:`SET_ASIDE` lists the
  others;
- imports of names this torch no longer has become stand-ins that fail only the tests that
  use them; ``expecttest`` (which ``torch.testing._internal`` needs) is a stand-in too.

Every edit keeps line numbers, so tracebacks point at the saved file. Run::

    TRITON_INTERPRET=1 python benchmarks/inductor_parity.py [--tests .parity/inductor]
        [-k PATTERN] [-v] [--failures] [--calls 4] [--shard I/N] [--timeout S]
        [--progress] [--reference] [--list-set-aside]

``-k`` is a regular expression searched in each test's id (``-k "test_add|test_cat"``).
It prints, per class, how many in-scope tests pass, fail (a wrong answer against eager),
error (a crash where eager works), time out, or are skipped by their own decorators
(GPU-only tests on a CPU machine, tests upstream marks flaky, tests that need
torchvision); how many are set aside, by reason; and how the compiled
calls ran (fxlite's kernels, a replay without kernels, its followed tier, or eager). ``--reference`` runs the same
adaptation on ``torch.compile(backend="eager")``: a test that fails there too fails
because of the saved file (drift against this torch) or of the harness, not of fxlite.

On the 2-core development CPU with ``TRITON_INTERPRET=1`` (Triton's interpreter runs the
kernels, in Python) the whole file takes over an hour, most of it in a few tests whose
inputs hold ten million elements or more (``test_shape_prop_torch_ones``,
``test_multilayer_var_lowp``, ``test_index_put1``): run subsets with ``-k`` or ``--shard``,
and cap such tests with ``--timeout``. With ``--timeout 120`` the four shards of
``--shard I/4`` took 9, 5, 7 and 2 minutes, and those three tests were the only ones to
time out; given longer, ``test_index_put1`` passed in 203 seconds and
``test_multilayer_var_lowp`` in 412.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import importlib
import io
import os
import re
import signal
import sys
import tempfile
import time
import types
import unittest
import warnings
from collections import Counter, defaultdict
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------ what is not run, and why
# Rules for CommonTemplate tests that never call self.common (checked in this order).
_AOTI = "tests AOTInductor's eager kernel cache (Inductor's ahead-of-time C++ compiler)"
_CODE = ("asserts Inductor's generated code or scheduler (run_and_get_code, FileCheck, "
         "scheduler hooks), outside self.common")
_COMPILE_FX = "calls Inductor's compile_fx_inner on a make_fx graph itself, outside self.common"
_METRICS = "asserts Inductor's kernel counts or IR metrics, outside self.common"
_TORCH_COMPILE = ("calls torch.compile / torch._dynamo.optimize itself and checks its own "
                  "results, outside self.common (not a self.common case)")
_NO_COMPILE = ("compiles nothing through self.common: tests an Inductor helper or eager "
               "PyTorch directly")
RULES = (
    (lambda name, body: "aoti" in name, _AOTI),
    (lambda name, body: re.search(r"run_and_get_\w*code|FileCheck|run_fw_bw_and_get_code|"
                                  r"add_scheduler_init_hook|GraphLowering", body), _CODE),
    (lambda name, body: "compile_fx_inner" in body or "make_fx" in body, _COMPILE_FX),
    (lambda name, body: "metrics." in body, _METRICS),
    (lambda name, body: re.search(r"torch\.compile|_dynamo\.optimize", body), _TORCH_COMPILE),
    (lambda name, body: True, _NO_COMPILE),
)

# self.common tests set aside by name (the adapted name, without the _cpu suffix).
_DRIFT = ("fails in eager PyTorch with this torch (and so with --reference): the saved file "
          "calls torch.ops.prims._low_memory_max_pool2d_with_offsets, which torch 2.13 lacks")
_REFUSAL = ("expects torch.compile to raise where eager PyTorch returns a result (cat of a 2-D "
            "tensor and a 1-D empty one of unbacked size: eager's legacy rule accepts it, "
            "Dynamo's fake tensors cannot tell the size is 0)")
_RESIZE = ("compiles with torch._dynamo.optimize_assert(compile_fx) itself, in its helper "
           "_check_resize_common, outside self.common")
SET_ASIDE: dict[str, str] = {
    "test_low_memory_max_pool": _DRIFT,
    "test_cat_unbacked_legacy_empty": _REFUSAL,
    "test_resize": _RESIZE,
    "test_resize_as": _RESIZE,
}

# Statements replaced by `pass` in a self.common test: the substrings that pick them. Each
# is an assertion about Inductor itself, in a test whose comparison with eager is the test.
NEUTRALISE: dict[str, tuple[str, ...]] = {
    # Inductor's IR node counts before fusion
    "test_forced_buffer_realize": ("ir_nodes_pre_fusion",),
    "test_scheduler_vertical_fusion1": ("ir_nodes_pre_fusion",),
    # the number of kernels Inductor generated
    "test_mm_views": ("generated_kernel_count, expected_kernel",),
    # Inductor's generated code
    "test_reuse_buffers_with_aliasing": ("run_and_get_triton_code", '"aten.view_as_real" in code'),
    "test_reinterpret_dtypeview": ("run_and_get_code", "FileCheck"),
    "test_custom_scan_op_compiled": ("run_and_get_code", "FileCheck"),
    "test_AllenaiLongformerBase_repro": ("is_cpp_backend(self.device)",),
    # the second half runs Inductor's compile_fx_inner on a make_fx graph
    "test_where_broadcast": ("make_fx(", "compile_fx_inner(", "compiled(args)",
                             "inductor_out, eager_out"),
    # Dynamo's refusal of a torch.Generator argument (torch._dynamo.exc.Unsupported)
    "test_randn_generator": ("torch._dynamo.exc.Unsupported",),
}

# Tests whose later calls get copies of the test's inputs, not shuffled ones: shuffling
# breaks how the inputs were built.
_NO_OVERFLOW = ("its inputs are built so that their running product never overflows "
                "(_large_cumprod_input alternates values and their reciprocals); shuffled, "
                "float16's product overflows where the float32 reference does not")
KEEP_INPUTS: dict[str, str] = {
    "test_split_cumprod": _NO_OVERFLOW,
    "test_split_cumprod_low_prec": _NO_OVERFLOW,
    "test_consecutive_split_cumprod": _NO_OVERFLOW,
}

_SUPPORT = "_inductor_parity"  # the stand-in module the adapted file imports names from


# ------------------------------------------------------------------ adapting the file's text
def _text(lines: list[str], node: ast.AST) -> str:
    """The whole lines a node spans (ast.get_source_segment splits the file at every call)."""
    return "\n".join(lines[node.lineno - 1:node.end_lineno])


def _classify(tree: ast.Module, src: str) -> dict[str, str | None]:
    """CommonTemplate test name -> the reason it is set aside, or None when it is run."""
    out: dict[str, str | None] = {}
    lines = src.split("\n")
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and cls.name == "CommonTemplate"):
            continue
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
                continue
            body = _text(lines, fn)  # from the def line: inner decorators, not its own
            if fn.name in SET_ASIDE:
                out[fn.name] = SET_ASIDE[fn.name]
            elif "self.common(" in body:
                out[fn.name] = None
            else:
                out[fn.name] = next(why for rule, why in RULES if rule(fn.name, body))
    return out


def adapt(src: str) -> str:
    """The test file's text, adapted (the same for fxlite and --reference). Every edit keeps
    the line count."""
    tree = ast.parse(src)
    lines = src.split("\n")
    src_lines = list(lines)

    def replace(node: ast.AST, text: str) -> None:
        first = lines[node.lineno - 1]
        lines[node.lineno - 1] = first[:len(first) - len(first.lstrip())] + text
        for i in range(node.lineno, node.end_lineno):
            lines[i] = ""

    for node in tree.body:  # names this torch lacks fail only the tests that use them
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = ", ".join(a.asname or a.name for a in node.names)
            wanted = [a.name for a in node.names]
            replace(node, f"{targets}, = __import__({_SUPPORT!r}).names({node.module!r}, "
                          f"{wanted!r})")
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and cls.name == "CommonTemplate"):
            continue
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            for deco in fn.decorator_list:  # Inductor's config: nothing fxlite reads
                text = _text(src_lines, deco).strip()
                if re.match(r"@?(torch\._inductor\.)?config\.patch\(|@?patch\.object\("
                            r"(torch\._inductor\.)?config\b", text):
                    replace(deco, f"@__import__({_SUPPORT!r}).identity")
            picks = NEUTRALISE.get(fn.name, ())
            done: list[tuple[int, int]] = []
            for stmt in ast.walk(fn):
                if stmt is fn or not isinstance(stmt, ast.stmt):
                    continue
                if any(a <= stmt.lineno <= b for a, b in done):
                    continue
                text = _text(src_lines, stmt)
                if any(p in text for p in picks):
                    replace(stmt, "pass  # inductor_parity: an assertion about Inductor itself")
                    done.append((stmt.lineno, stmt.end_lineno))
        for i in range(cls.lineno - 1, cls.end_lineno):
            # a function decorated with torch.compile is handed to self.common: fxlite compiles it
            lines[i] = re.sub(r"^(\s*)@torch\.compile(\(.*\))?\s*$",
                              rf"\1@__import__({_SUPPORT!r}).identity", lines[i])
            lines[i] = lines[i].replace("torch.compile(", f"__import__({_SUPPORT!r}).compile(")
    out = "\n".join(lines)
    assert out.count("\n") == src.count("\n")
    return out


# ------------------------------------------------------------------ stand-ins
def _expecttest() -> types.ModuleType:
    """What torch.testing._internal.common_utils imports from expecttest (not installed)."""
    mod = types.ModuleType("expecttest")

    class TestCase(unittest.TestCase):
        def assertExpectedInline(self, actual: str, expect: str, skip: int = 0) -> None:
            self.assertMultiLineEqual(expect, actual)

    mod.TestCase = TestCase
    return mod


class Missing:
    """Stands for a name this torch lacks: any use raises, failing only that test."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"this torch has no {self._name}")

    def __getattr__(self, attr: str) -> Any:
        raise NotImplementedError(f"this torch has no {self.__dict__['_name']}")


def _support_module(compile_fn: Any) -> types.ModuleType:
    mod = types.ModuleType(_SUPPORT)

    def names(module: str, wanted: list[str]) -> list[Any]:
        try:
            found = importlib.import_module(module)
        except ImportError:
            found = None
        return [getattr(found, n) if hasattr(found, n) else Missing(f"{module}.{n}")
                for n in wanted]

    def compile(fn: Any = None, **kwargs: Any) -> Any:  # noqa: A001 (torch.compile's name)
        kwargs = {k: v for k, v in kwargs.items() if k in ("fullgraph", "dynamic")}
        if fn is None:
            return lambda f: compile_fn(f, **kwargs)
        return compile_fn(fn, **kwargs)

    mod.names = names
    mod.identity = lambda fn: fn
    mod.compile = compile
    return mod


# ------------------------------------------------------------------ the new check_model
class CompiledError(RuntimeError):
    """The compiled call raised where eager PyTorch returned: an error, not a wrong answer."""


class Timeout(BaseException):
    """A test ran past --timeout (a BaseException, so that no `except Exception` in the
    compiler swallows it)."""


def _snapshot(x: Any) -> Any:
    """A detached copy with x's strides, storage offset and requires_grad flag."""
    import torch

    if isinstance(x, (list, tuple)):
        return type(x)(_snapshot(v) for v in x)
    if not isinstance(x, torch.Tensor):
        return x
    with torch.no_grad():
        y = _clone_strided(x.detach())
    return y.requires_grad_(x.requires_grad) if x.is_floating_point() or x.is_complex() else y


def _clone_strided(x: Any) -> Any:
    import torch

    if x.numel() == 0 or x.layout != torch.strided:
        return x.clone()
    buf = torch.as_strided(x, (x.untyped_storage().size() // x.element_size(),), (1,), 0)
    return torch.as_strided(buf.clone(), x.size(), x.stride(), x.storage_offset())


def _sorted(flat: Any) -> bool:
    import torch

    if flat.dtype == torch.bool or flat.is_complex():
        return False
    return bool((flat[1:] >= flat[:-1]).all()) or bool((flat[1:] <= flat[:-1]).all())


def _fresh(x: Any, gen: Any) -> Any:
    """A copy of x (a snapshot) whose elements are shuffled: same shape, strides, dtype and
    values, in a new order. Sorted and expanded tensors are copied as they are."""
    import torch

    if isinstance(x, (list, tuple)):
        return type(x)(_fresh(v, gen) for v in x)
    if not isinstance(x, torch.Tensor):
        return x
    with torch.no_grad():
        out = _clone_strided(x.detach())
        flat = x.detach().reshape(-1)
        if flat.numel() > 1 and x.layout == torch.strided and not _sorted(flat) and \
                torch._debug_has_internal_overlap(out) == 0:
            perm = torch.randperm(flat.numel(), generator=gen)
            out.copy_(flat[perm].view(x.shape))
    return out.requires_grad_(x.requires_grad) if x.requires_grad else out


class Stats:
    """How the compiled calls of each test ran (fxlite only)."""

    def __init__(self) -> None:
        self.current = ""
        self.by_test: dict[str, set[str]] = defaultdict(set)
        self.arbitrated: set[str] = set()  # passed shuffled calls by the float64 check

    def note(self, compiled: Any) -> None:
        tier = getattr(compiled, "tier", None)
        if tier is None:
            return
        kernels = len(getattr(compiled, "kernels", []) or [])
        kind = tier.split(":")[0]
        self.by_test[self.current].add("kernels" if kernels and kind != "eager" else kind)


@dataclasses.dataclass
class _Checks:
    """check_model's options, as one compiled call is checked with them."""

    atol: Any
    rtol: Any
    grad_atol: Any
    grad_rtol: Any
    exact_dtype: bool
    reference_in_float: bool
    assert_equal: bool
    check_gradient: bool
    output_process_fn_grad: Any
    is_module: bool
    calls: int


class _EagerRejects(Exception):
    """Eager PyTorch raised on a later call's shuffled inputs."""


def make_check_model(compile_fn: Any, calls: int, stats: Stats) -> Any:
    """check_model with the signature of test_torchinductor.py's, run through compile_fn."""
    import torch

    def check_model(self: Any, model: Any, example_inputs: Any, kwargs: Any = None, *,
                    atol: Any = None, rtol: Any = None, grad_atol: Any = None,
                    grad_rtol: Any = None, check_lowp: bool = True, exact_dtype: bool = True,
                    nopython: bool = True, copy_to_gpu: bool = True,
                    reference_in_float: bool = True, assert_equal: bool = True,
                    check_gradient: bool = False, check_has_compiled: bool = True,
                    output_process_fn_grad: Any = lambda x: x) -> None:
        # check_lowp and copy_to_gpu are GPU-only (check_model_gpu); nopython and
        # check_has_compiled assert Dynamo captured one graph and called Inductor: fxlite
        # splits where Python reads a tensor, as torch.compile does without fullgraph.
        kwargs = kwargs or {}
        torch._dynamo.reset()
        is_module = isinstance(model, torch.nn.Module)
        checks = _Checks(atol, rtol, grad_atol, grad_rtol, exact_dtype, reference_in_float,
                         assert_equal, check_gradient, output_process_fn_grad, is_module, calls)
        originals = [_snapshot(x) for x in example_inputs]
        eager_model = copy.deepcopy(model) if is_module else model

        def run(*ex: Any, **kw: Any) -> Any:
            return model(*ex, **kw)

        compiled = compile_fn(run)
        keep = self._testMethodName.removesuffix("_cpu") in KEEP_INPUTS
        for call in range(calls):
            # the test's inputs, then shuffled copies, and copies of the test's inputs last
            shuffled = 0 < call < calls - 1 or call == 1 == calls - 1
            inputs = list(example_inputs) if call == 0 else [_snapshot(x) for x in originals]
            if shuffled and not keep:
                gen = torch.Generator().manual_seed(1000 + call)
                inputs = [_fresh(x, gen) for x in originals]
            try:
                _check_call(self, compiled, eager_model, inputs, kwargs, call, checks,
                            shuffled and not keep, stats)
            except _EagerRejects:  # eager rejects the shuffled inputs: use copies instead
                _check_call(self, compiled, eager_model, [_snapshot(x) for x in originals],
                            kwargs, call, checks, False, stats)
            stats.note(compiled)
            if is_module:  # the module's state after the call, against an eager copy's
                self.assertEqual(model.state_dict(), eager_model.state_dict(), atol=atol,
                                 rtol=rtol, equal_nan=True, exact_dtype=exact_dtype,
                                 msg=f"call {call + 1}: module state")
        torch._dynamo.reset()

    return check_model


def _check_call(self: Any, compiled: Any, eager_model: Any, inputs: list, kwargs: dict,
                call: int, c: _Checks, shuffled: bool, stats: Stats) -> None:
    """One compiled call against eager PyTorch, checked as upstream's check_model checks its
    one call (comments there). Eager's failure on shuffled inputs raises _EagerRejects.

    On shuffled inputs only, outputs outside the test's tolerance of eager's still pass when
    they are as close to a float64 run as eager's own (:func:`_as_accurate`): a tolerance
    chosen for the test's inputs can be tighter than float32 allows on others (a sum's
    rounding depends on its order, and fxlite's reductions sum in another order)."""
    import torch
    from torch.utils import _pytree as pytree

    ref_inputs = [_snapshot(x) for x in inputs]
    lowp = _has_lowp((ref_inputs, kwargs))
    try:
        expect_dtypes = None
        if c.reference_in_float and c.exact_dtype and lowp:  # eager's own dtypes, in lowp
            torch.manual_seed(0)
            probe = copy.deepcopy(eager_model) if c.is_module else eager_model
            try:
                eager_result = probe(*[_snapshot(x) for x in ref_inputs], **kwargs)
            except RuntimeError:  # eager may not support the low-precision dtype
                eager_result = None
            expect_dtypes = [x.dtype if isinstance(x, torch.Tensor) else None
                             for x in pytree.tree_leaves(eager_result)]
        ref_model, ref_kwargs = eager_model, kwargs
        if c.reference_in_float:
            ref_inputs = [_upcast(x) for x in ref_inputs]
            ref_kwargs = {k: _upcast(v) for k, v in kwargs.items()}
            if lowp and hasattr(eager_model, "to"):
                ref_model = copy.deepcopy(eager_model).to(torch.float)
        torch.manual_seed(0)
        correct = ref_model(*ref_inputs, **ref_kwargs)
    except Exception:
        if shuffled:
            raise _EagerRejects from None
        raise
    if expect_dtypes is None:
        expect_dtypes = [x.dtype if isinstance(x, torch.Tensor) else None
                         for x in pytree.tree_leaves(correct)]

    torch.manual_seed(0)
    try:
        actual = compiled(*inputs, **kwargs)
    except Exception as e:
        raise CompiledError(f"compiled call {call + 1} raised where eager returned: "
                            f"{type(e).__name__}: {e}") from e

    msg = f"call {call + 1} of {c.calls}"
    assert type(actual) is type(correct), \
        f"{msg}: {type(actual).__name__} returned, eager {type(correct).__name__}"
    if isinstance(actual, (tuple, list)):
        assert len(actual) == len(correct), f"{msg}: output count differs"
        assert all(type(a) is type(b) for a, b in zip(actual, correct)), \
            f"{msg}: output types differ"
    correct_flat, correct_spec = pytree.tree_flatten(correct)
    actual_flat = pytree.tree_leaves(actual)
    if c.reference_in_float and c.exact_dtype:
        for want, got in zip(expect_dtypes, actual_flat):
            if want is not None:
                assert got.dtype == want, \
                    f"{msg}: dtype mismatch, expected {want} but got {got.dtype}"
    if c.reference_in_float:
        correct_flat = _to_expect(actual_flat, correct_flat)
        correct = pytree.tree_unflatten(list(correct_flat), correct_spec)
    if c.assert_equal:
        try:
            self.assertEqual(actual, correct, atol=c.atol, rtol=c.rtol, equal_nan=True,
                             exact_dtype=c.exact_dtype, msg=f"{msg}: outputs")
        except AssertionError:
            if not (shuffled and _as_accurate(eager_model, c.is_module, inputs, kwargs,
                                              actual_flat, correct_flat, c)):
                raise
            stats.arbitrated.add(stats.current)
        self.assertEqual(ref_inputs, inputs, atol=c.atol, rtol=c.rtol, equal_nan=True,
                         exact_dtype=False, msg=f"{msg}: inputs after the call")
    else:
        for want, got in zip(correct_flat, actual_flat):
            if isinstance(want, torch.Tensor):
                assert want.device == got.device and want.size() == got.size(), msg
                same, _ = torch._prims_common.check_significant_strides(want, got)
                assert same and want.layout == got.layout, f"{msg}: strides or layout"
                if c.exact_dtype:
                    assert want.dtype == got.dtype, f"{msg}: dtype"

    if c.check_gradient:
        actual, correct = c.output_process_fn_grad(actual), c.output_process_fn_grad(correct)
        grads = [torch.rand(r.shape, device=r.device, dtype=r.dtype)
                 for r in pytree.tree_leaves(correct)
                 if isinstance(r, torch.Tensor) and r.requires_grad]
        for g in grads:
            g /= g.norm()
        correct_grad = _grads(ref_inputs, ref_kwargs, correct, grads)
        actual_grad = _grads(inputs, kwargs, actual, grads)
        expect = _to_expect(actual_grad, correct_grad) if c.reference_in_float else correct_grad
        self.assertEqual(actual_grad, expect, atol=c.grad_atol or c.atol,
                         rtol=c.grad_rtol or c.rtol, equal_nan=True, exact_dtype=c.exact_dtype,
                         msg=f"{msg}: gradients")


def _as_accurate(eager_model: Any, is_module: bool, inputs: list, kwargs: dict,
                 actual_flat: Any, correct_flat: Any, c: _Checks) -> bool:
    """Whether every floating output outside the tolerance is at most twice as far from a
    float64 run of the same function (plus a rounding unit of its dtype) as eager's own
    output; integer and boolean outputs must have matched."""
    import torch
    from torch.utils import _pytree as pytree

    def wide(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().double()
        if isinstance(x, torch.Tensor) and x.is_complex():
            return x.detach().to(torch.complex128)
        return x

    try:
        model64 = copy.deepcopy(eager_model).double() if is_module else eager_model
        torch.manual_seed(0)
        ref64 = pytree.tree_leaves(model64(*[wide(_snapshot(x)) for x in inputs],
                                           **{k: wide(v) for k, v in kwargs.items()}))
    except Exception:
        return False
    if len(ref64) != len(actual_flat):
        return False
    for got, want, r64 in zip(actual_flat, correct_flat, ref64):
        if not isinstance(got, torch.Tensor):
            continue
        if not (got.is_floating_point() or got.is_complex()):
            if not torch.equal(got, want):
                return False
            continue
        if torch.allclose(got, want, atol=c.atol or 1e-5, rtol=c.rtol or 1.3e-6, equal_nan=True):
            continue
        if not isinstance(r64, torch.Tensor) or r64.shape != got.shape or \
                not torch.equal(got.isnan(), want.isnan()):
            return False
        err_got = (got.to(r64.dtype) - r64).abs().nan_to_num(0.0, posinf=0.0)
        err_eager = (want.to(r64.dtype) - r64).abs().nan_to_num(0.0, posinf=0.0)
        unit = torch.finfo(got.dtype).eps * float(r64.abs().nan_to_num(0.0, 0.0, 0.0).max())
        if float(err_got.max()) > 2 * float(err_eager.max()) + unit:
            return False
    return True


def _upcast(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def _has_lowp(xs: Any) -> bool:
    import torch
    from torch.utils import _pytree as pytree

    return any(isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16)
               for x in pytree.tree_leaves(xs))


def _to_expect(actual_flat: Any, correct_flat: Any) -> tuple:
    """The float reference cast to the dtypes of the compiled results."""
    import torch

    return tuple(y.to(x.dtype) if isinstance(y, torch.Tensor) and y.dtype.is_floating_point
                 else y for x, y in zip(actual_flat, correct_flat))


def _grads(args: Any, kwargs: Any, results: Any, grads: Any) -> Any:
    import torch
    from torch.utils import _pytree as pytree

    leaves = [a for a in pytree.arg_tree_leaves(*args, **kwargs)
              if isinstance(a, torch.Tensor) and a.requires_grad]
    outs = [r for r in pytree.tree_leaves(results)
            if isinstance(r, torch.Tensor) and r.requires_grad]
    assert outs and leaves, "check_gradient: no output or input requires grad"
    return torch.autograd.grad(outs, leaves, grads, allow_unused=True, retain_graph=True)


# ------------------------------------------------------------------ loading and running
def _find(tests: str) -> str:
    for path in (os.path.join(tests, "test_torchinductor.py"),
                 os.path.join(tests, "inductor", "test_torchinductor.py")):
        if os.path.isfile(path):
            return path
    raise SystemExit(f"inductor_parity: test_torchinductor.py not found in {tests} (nor in "
                     f"{tests}/inductor); save PyTorch's test file there (see the docstring)")


def load(tests: str, workdir: str, compile_fn: Any, calls: int, stats: Stats
         ) -> tuple[dict[str, list[unittest.TestCase]], dict[str, str]]:
    """Adapt and import the file; return its test cases by class, and the set-aside tests."""
    with open(_find(tests)) as f:
        src = f.read()
    reasons = _classify(ast.parse(src), src)
    with open(os.path.join(workdir, "test_torchinductor.py"), "w") as f:
        f.write(adapt(src))
    sys.modules.setdefault("expecttest", _expecttest())
    sys.modules[_SUPPORT] = _support_module(compile_fn)
    sys.path.insert(0, workdir)
    argv, sys.argv = sys.argv, sys.argv[:1]  # torch's test helpers parse sys.argv on import
    try:
        module = importlib.import_module("test_torchinductor")
    finally:
        sys.argv = argv
    check_model = make_check_model(compile_fn, calls, stats)
    module.check_model = check_model  # SweepInputs2 calls it by its global name
    module.assertGeneratedKernelCountEqual = lambda self, expected: None
    module.is_cpp_backend = lambda device: False

    class CpuTests(module.TestCase):
        common = check_model
        device = "cpu"

    class SweepInputsCpuTest(module.SweepInputs2, module.TestCase):
        gen = module.InputGen(10, "cpu")

    SweepInputsCpuTest.populate()
    module.copy_tests(module.CommonTemplate, CpuTests, "cpu")
    for cls in (CpuTests, SweepInputsCpuTest):  # ids as upstream's: test_torchinductor.CpuTests...
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
    names = sorted(reasons, key=len, reverse=True)
    set_aside: dict[str, str] = {}
    loader = unittest.TestLoader()
    by_class: dict[str, list[unittest.TestCase]] = {}
    for cls in (CpuTests, SweepInputsCpuTest):
        cases = []
        for test in loader.loadTestsFromTestCase(cls):
            name = test._testMethodName.removesuffix("_cpu")
            base = next((n for n in names if name == n or name.startswith(n + "_")), None)
            why = reasons.get(base) if base else None
            if why:
                set_aside[name] = why
            else:
                cases.append(test)
        by_class[cls.__name__] = cases
    return by_class, set_aside


class _Result(unittest.TestResult):
    def __init__(self, stats: Stats, timeout: float) -> None:
        super().__init__()
        self.outcome: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self._stats, self._timeout, self._start = stats, timeout, 0.0
        self.progress = False

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._stats.current = test.id()
        self._start = time.perf_counter()
        if self._timeout:
            signal.setitimer(signal.ITIMER_REAL, self._timeout)

    def stopTest(self, test: unittest.TestCase) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.seconds[test.id()] = time.perf_counter() - self._start
        super().stopTest(test)
        if self.progress:  # stdout is captured while the tests run
            print(f"  {self.outcome.get(test.id(), '?'):<7} {self.seconds[test.id()]:>6.1f}s "
                  f"{test.id()}", file=sys.stderr, flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:
        self.outcome[test.id()] = "pass"

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self.outcome[test.id()] = "fail"

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self.outcome[test.id()] = "timeout" if err[0] is Timeout else "error"

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self.outcome[test.id()] = "skip"

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        self.addFailure(test, err)

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self.addSuccess(test)


def _on_alarm(signum: int, frame: Any) -> None:
    raise Timeout("the test ran past --timeout")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", default=os.path.join(REPO, ".parity", "inductor"),
                        help="folder holding PyTorch's test_torchinductor.py")
    parser.add_argument("-k", default=None,
                        help="run only tests whose id matches this regular expression "
                             "(re.search: 'test_add|test_cat' runs both)")
    parser.add_argument("-v", action="store_true", help="print each test's outcome and time")
    parser.add_argument("--failures", action="store_true", help="print each failure's traceback")
    parser.add_argument("--calls", type=int, default=4,
                        help="compiled calls per self.common: the test's inputs, shuffled "
                             "copies, then copies of the test's inputs")
    parser.add_argument("--shard", default="1/1", help="I/N: run every N-th test, from the I-th")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds a test may take before it counts as timed out (0: none)")
    parser.add_argument("--progress", action="store_true",
                        help="print each test's outcome on stderr as it ends")
    parser.add_argument("--list-set-aside", action="store_true", help="print the set-aside tests")
    parser.add_argument("--reference", action="store_true",
                        help='run the same adaptation on torch.compile(backend="eager")')
    args = parser.parse_args(argv)
    shard, shards = (int(p) for p in args.shard.split("/"))
    if not 1 <= shard <= shards:
        parser.error(f"--shard {args.shard}: expected I/N with 1 <= I <= N")
    if args.calls < 1:
        parser.error("--calls must be at least 1")

    import torch

    import fxlite

    if args.reference:
        def compile_fn(fn: Any, **kw: Any) -> Any:
            return torch.compile(fn, backend="eager", **kw)
        subject = 'torch.compile(backend="eager") (--reference)'
    else:
        def compile_fn(fn: Any, **kw: Any) -> Any:
            return fxlite.compile(fn, **kw)
        subject = f"fxlite from {os.path.dirname(fxlite.__file__)}"

    stats = Stats()
    with tempfile.TemporaryDirectory(prefix="inductor_parity_") as workdir:
        suites, set_aside = load(args.tests, workdir, compile_fn, args.calls, stats)
        if args.list_set_aside:
            for name, why in sorted(set_aside.items()):
                print(f"{name}: {why}")
            return 0
        signal.signal(signal.SIGALRM, _on_alarm)
        print(f"torch {torch.__version__}, {subject}, {args.calls} calls per self.common, "
              f"shard {shard}/{shards}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")
        print(f"{'class':<22} {'pass':>5} {'fail':>5} {'error':>5} {'t/out':>5} {'skip':>5} "
              f"{'in scope':>9} {'rate':>7}")
        totals: Counter[str] = Counter()
        results = []
        for cls, cases in suites.items():
            cases = sorted(cases, key=lambda c: c.id())
            if args.k:
                cases = [c for c in cases if re.search(args.k, c.id())]
            cases = cases[shard - 1::shards]
            result = _Result(stats, args.timeout)
            result.progress = args.progress
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                unittest.TestSuite(cases).run(result)
            counts = Counter(result.outcome.values())
            scope = len(cases) - counts["skip"]
            rate = counts["pass"] / scope if scope else 1.0
            print(f"{cls:<22} {counts['pass']:>5} {counts['fail']:>5} {counts['error']:>5} "
                  f"{counts['timeout']:>5} {counts['skip']:>5} {scope:>9} {rate:>7.1%}   "
                  f"({time.perf_counter() - start:.0f} s)")
            totals.update(counts)
            totals["scope"] += scope
            results.append(result)
        rate = totals["pass"] / totals["scope"] if totals["scope"] else 1.0
        print(f"{'overall':<22} {totals['pass']:>5} {totals['fail']:>5} {totals['error']:>5} "
              f"{totals['timeout']:>5} {totals['skip']:>5} {totals['scope']:>9} {rate:>7.1%}")
        reasons = Counter(set_aside.values())
        print(f"set aside (not run): {len(set_aside)} CommonTemplate tests; list them with "
              "--list-set-aside")
        for why, n in reasons.most_common():
            print(f"  {n:>4}  {why}")
        if stats.by_test:
            kinds = Counter("kernels" if "kernels" in v else "followed" if "followed" in v
                            else "replayed" if "replayed" in v else "eager"
                            for v in stats.by_test.values())
            print("how the later compiled calls ran, per test: " + ", ".join(
                f"{kinds[k]} {label}" for k, label in (
                    ("kernels", "ran fxlite kernels"), ("replayed", "replayed without kernels"),
                    ("followed", "followed"), ("eager", "eager"))))
        if stats.arbitrated:
            print(f"passed shuffled calls only by the float64 check: "
                  f"{', '.join(sorted(t.rsplit('.', 1)[-1] for t in stats.arbitrated))}")
        for result in results:
            if args.v:
                for tid, outcome in sorted(result.outcome.items()):
                    how = ",".join(sorted(stats.by_test.get(tid, ())))
                    print(f"    {outcome:<7} {result.seconds.get(tid, 0):>6.1f}s {how:<14} {tid}")
            if args.failures:
                for test, tb in result.failures + result.errors:
                    print(f"\n=== {test.id()}\n{tb}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
