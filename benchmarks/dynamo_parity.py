"""Parity with torch.compile, measured by PyTorch's own Dynamo test cases.

PyTorch ships ``test/dynamo/test_functions.py`` and ``test/dynamo/test_misc.py``: hundreds
of small programs, each compiled and compared with eager PyTorch. They are not part of
fxlite: save them (BSD-licensed, from the PyTorch repository) into an ignored folder, by
default ``.parity/dynamo/``::

    .parity/dynamo/test_functions.py
    .parity/dynamo/test_misc.py          (a file that is not there is not run)

This script adapts them at run time, with the fewest changes, and runs them in-process:

- ``torch.compile(...)``, ``@torch.compile``, ``torch._dynamo.optimize(...)`` and
  ``torch._dynamo.optimize_assert(...)`` become ``fxlite.compile`` with the same
  ``fullgraph`` and ``dynamic`` (``nopython=True`` is ``fullgraph=True``); the backend
  (``"eager"``, a ``CompileCounter``, a recording backend), ``mode`` and ``options`` are
  dropped: they name Dynamo's backends, and fxlite's own backend is what is measured;
- every compiled function and module is **checked against eager PyTorch on every call**,
  and called three times per call the test makes (``--calls``): twice on deep copies of
  the arguments, each time beside eager on another copy (random generators reset between
  them), comparing results *and* the arguments after the call (a mutated input), then once
  on the test's own arguments, which the test checks itself. A result that differs from
  eager's is a failure (a wrong answer); a compiled call that raises where eager does not
  is an error; a module's state after the call (``state_dict``, ``training``) is compared
  with an eager copy's. Tensors are compared with rtol 1e-4 / atol 1e-5 (float16/bfloat16:
  1e-2 / 1e-3), integers exactly, iterators by what they yield, strings with memory
  addresses blanked. A compiled function called by another is called as the test calls it;
  the tests in :data:`AS_WRITTEN` (they count changes to state outside their arguments, or
  return an argument's ``id``) get no extra calls; those in :data:`UNINITIALIZED` compare
  metadata only;
- ``torch._dynamo.testing.standard_test`` (what ``make_test`` runs) calls the compiled
  function with three sets of fresh ``randn(10, 10)`` inputs and once more with the first,
  each beside eager;
- **Dynamo-internal assertions neutralised** (the test's results are still checked, by the
  test and by the calls above): ``CompileCounter``'s ``frame_count`` and ``op_count``
  compare equal to any number (fxlite has no frames; standard_test's frame-count check
  is Dynamo's "no graph break" check, so it compiles with fxlite's defaults, splitting
  where Python reads a tensor, not with ``fullgraph``); ``torch._dynamo.utils.counters``
  stays empty, so "no graph break was counted" holds; ``unittest.expectedFailure``
  (Dynamo's known failures) is lifted, so those tests count as they come out;
- ``torch._dynamo.exc.Unsupported`` (what ``fullgraph=True`` raises at a graph break) also
  matches ``fxlite.TraceError``, fxlite's counterpart;
- ``torch._dynamo.reset()`` also forgets fxlite's recordings (``fxlite.reset()``);
- the ``torch.testing._internal`` modules that need ``expecttest`` (and
  ``torch._dynamo.test_case``) are replaced by a small stand-in with the same names: a
  ``unittest.TestCase`` whose ``assertEqual`` compares tensors and arrays,
  ``parametrize``, ``instantiate_parametrized_tests``, ``instantiate_device_type_tests``
  (CPU only, none where ``only_for`` leaves the CPU out, as torch does);
- every test in :data:`SET_ASIDE` is removed before the run and listed with its reason:
  what it asserts is Dynamo's machinery (recorded graphs, guards, its frame cache, export,
  symbolic shapes, its exceptions and config switches, its internal classes), not a
  program's results, or it compiles nothing.

Every edit keeps line numbers, so tracebacks point at the saved files. Run::

    TRITON_INTERPRET=1 python benchmarks/dynamo_parity.py [--tests .parity/dynamo]
        [-k PATTERN] [-v] [--failures] [--calls 3] [--reference] [--list-set-aside]

It prints, per file, how many in-scope tests pass, fail (a wrong answer, or any other
failed assertion), error (a crash) or are skipped by their own decorators (CUDA-only tests
on a CPU machine), how many are set aside, then the totals; ``-v`` prints each test as it
ends (with how many functions it compiled). ``--reference`` runs the same adapted tests,
the same extra calls included, on ``torch.compile(backend="eager")``: a test that fails
there too fails because of the saved file (drift against this torch), of Dynamo, or of the
harness, not of fxlite. On the 2-core development CPU with ``TRITON_INTERPRET=1`` a run of
both files takes about 2-3 minutes, ``--reference`` about 6 (BENCHMARKS.md has the figures).
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import copy
import dataclasses
import functools
import importlib
import io
import itertools
import logging
import os
import random
import re
import sys
import tempfile
import time
import types
import unittest
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("test_functions.py", "test_misc.py")
SUPPORT = "_dynamo_parity"  # the stand-in module the adapted files import

# Why each test is not run. Reasons name the Dynamo machinery the test is about; a test
# whose real check is a program's results is run, whatever Dynamo-internal assertion it also
# makes (those are neutralised, see the module docstring).
_NO_COMPILE = ("compiles nothing: tests a Dynamo helper or internal class (Source, ShapeEnv, "
               "guard CSE, funcname cache...) or eager code directly")
_INTERNALS = "tests or patches Dynamo's internal classes (VariableTracker, OutputGraph, TracingContext)"
_GRAPH_TEXT = ("asserts the graphs Dynamo hands its backend (EagerAndRecordGraphs, "
               "InductorAndRecordGraphs): fxlite.compile hands none")
_BACKEND = ("asserts what a Dynamo backend does (aot_eager's compiled backward, inductor's "
            "custom-op checks, a custom backend's errors, state or references)")
_GUARDS = ("tests Dynamo's guards (guard_fail_fn, guard_export_fn, guard_filter_fn, "
           "error_on_recompile, the guard code it prints)")
_CACHE = ("tests Dynamo's frame cache, precompile entries, compile metrics or the frames its "
          "tracer visits")
_COUNTERS = ("asserts Dynamo counted or logged a graph break (torch._dynamo.utils.counters, "
             "graph-break logs), which stay empty when Dynamo does not run")
_EXPORT = "tests torch._dynamo.export, Dynamo's graph export (fxlite.export is fxlite's)"
_IS_COMPILING = ("asserts torch.compiler.is_compiling()/is_dynamo_compiling() is True while "
                 "Dynamo traces: Dynamo's flag (fxlite's is fxlite.compiler.is_compiling)")
_SYMBOLIC = ("tests Dynamo's symbolic shapes: mark_dynamic/mark_unbacked constraints, unbacked "
             "SymInts, statically_known_true, and the runtime errors they raise where eager "
             "raises none")
_NUMPY = ("asserts Dynamo's numpy-as-torch semantics (torch._numpy), which differ from "
          "numpy's own: eager raises, or gives another type")
_CONFIG = ("tests a Dynamo config switch (replay_side_effects, error_on_nested_fx_trace) that "
           "makes Dynamo differ from eager on purpose")
_RUN = "tests torch._dynamo.run or OptimizedModule.dynamo_ctx"
_HELPER = ("needs a helper of torch's test suite that is not saved (test/dynamo/utils.py, "
           "OpInfo sample inputs, TestCase.generate_simple_inputs)")
_DRIFT = ("fails on torch.compile itself with this torch (checked with --reference): the saved "
          "file expects another torch (Dynamo's behaviour, or Tensor.rename_)")
_DYNAMO_EXC = ("asserts one of Dynamo's exceptions or messages (torch._dynamo.exc, its "
               "graph-break messages); fxlite raises eager's own exception, or none where "
               "eager raises none")
_SCALAR_CAPTURE = ("turns on Dynamo's capture_scalar_outputs / capture_dynamic_output_shape_ops "
                   "and asserts fullgraph=True holds through .item(), .tolist() or bool() of a "
                   "tensor (unbacked SymInts); under Dynamo's default config Dynamo raises "
                   "there, as fxlite does (fx.TraceError)")
_NEVER_ENDS = ("expects Dynamo to refuse, at compile time, a program that never ends when run "
               "(an infinite generator): run, as fxlite and eager run it, it exhausts memory")

_MISC = "MiscTests."
SET_ASIDE: dict[str, str] = {
    # test_functions.py
    "FunctionTests.test_partials_graph_break_reconstruct": _GRAPH_TEXT,
    "FunctionTests.test_partials_graph_break_reconstruct_mix": _GRAPH_TEXT,
    "FunctionTests.test_partials_graph_break_reconstruct_mix_no_source": _GRAPH_TEXT,
    "FunctionTests.test_partials_graph_break_reconstruct_args_and_kwargs": _GRAPH_TEXT,
    "FunctionTests.test_range_length": _INTERNALS,
    "FunctionTests.test_indexed_range": _INTERNALS,
    "FunctionTests.test_sliced_range": _INTERNALS,
    "FunctionTests.test_truth": _DRIFT,
    "DefaultsTests.test_zip_strict": _DYNAMO_EXC,
    "DefaultsTests.test_cast_tensor_single_elem": _DYNAMO_EXC,
    "DefaultsTests.test_frozenset_illegal_call_method": _DYNAMO_EXC,
    # test_misc.py
    **{_MISC + t: _NO_COMPILE for t in (
        "test_assert_size_stride", "test_const_dict_variable_python_type", "test_disable_flag",
        "test_funcname_cache", "test_get_instruction_source_311",
        "test_global_state_guard_serialization", "test_guard_function_builder_with_cse",
        "test_guards_cse_pass_multiple", "test_guards_cse_pass_single",
        "test_guards_strip_function_call", "test_hash_getitem_slice", "test_large_reduction_list",
        "test_recompile_on_disable_2", "test_shape_env_equal_constructor",
        "test_shape_env_equal_create_symbolic_sizes_strides_storage_offset",
        "test_shape_env_equal_empty", "test_shape_env_equal_evaluate_expr_divisible",
        "test_shape_env_equal_evaluate_expr_refinement",
        "test_shape_env_equal_evaluate_expr_replacement", "test_shape_env_equal_runtime_assert",
        "test_shape_env_equal_unbacked", "test_shape_env_no_recording",
        "test_shape_env_recorded_function_fallback", "test_version_ci")},
    **{_MISC + t: _INTERNALS for t in (
        "test_getattrvariable_as_python_constant", "test_inspect_signature_caching",
        "test_inspect_signature_caching_methods", "test_inspect_variable_redirect")},
    **{_MISC + t: _GRAPH_TEXT for t in (
        "test_compile_non_infra_inside_compile", "test_compile_non_infra_empty",
        "test_compile_non_infra_empty_with_disalloed_dispatch_mode",
        "test_compile_non_infra_multiple", "test_compile_non_infra_multiple_compile_internal",
        "test_compile_non_infra_multiple_compile_internal_mixed",
        "test_compile_non_infra_disabled_config", "test_dynamo_inside_custom_op",
        "test_sym_max_creates_graph_node", "test_grad_non_none")},
    **{_MISC + t: _BACKEND for t in (
        "test_anomaly_aot_autograd", "test_backward_deterministic_mode_mismatch_warning",
        "test_debugmode", "test_debugmode_warns_outside_ci", "test_raise_on_backend_error",
        "test_recompile_on_global_state_change", "test_release_module_memory",
        "test_graph_break_compilation_metrics_on_failure")},
    **{_MISC + t: _GUARDS for t in (
        "test_compare_shapes_with_constant", "test_recompile_message_on_parameter",
        "test_guard_failure_fn", "test_guard_failure_fn2", "test_guard_failure_fn_shape_control",
        "test_guard_failure_fn_tensor_iter", "test_no_guard_for_unused_sym_node_fstring",
        "test_guard_sym_node_fstring_when_used", "test_restore_graphstate",
        "test_error_on_recompile", "test_guard_filter_fn_by_id",
        "test_guard_filter_fn_by_is_global", "test_guard_filter_fn_by_name_and_value",
        "test_guard_filter_inbuilt_nn_modules", "test_guard_filter_nn_modules",
        "test_guard_filter_tensors", "test_guard_filter_globals")},
    **{_MISC + t: _CACHE for t in (
        "test_get_cache_entry", "test_dynamo_cache_move_to_front", "test_dynamo_cache_invalidate",
        "test_dynamo_reset_clears_cache", "test_precompile_entry_hit", "test_precompile_entry_miss",
        "test_precompile_entries", "test_precompile_fail_on_recompile",
        "test_fail_on_recompile_error_message", "test_graph_break_compilation_metrics",
        "test_compilation_metrics_size_limit", "test_torch_guards_stack_frame_register_inlining",
        "test_torch_guards_stack_frame_register_inlining_deep")},
    **{_MISC + t: _COUNTERS for t in (
        "test_dynamo_disabled_in_custom_op_kernels", "test_duplicate_graph_break_log",
        "test_data_ptr_graph_break_aten", "test_ne_operator_with_custom_graphbreak_eq",
        "test_torch_seed")},
    **{_MISC + t: _EXPORT for t in (
        "test_cond_export", "test_cond_export_single_arg", "test_flat_name_to_original_fqn",
        "test_fullgraph_capture", "test_nn_sequential_invocation",
        "test_nn_sequential_invocation_reposition_indices",
        "test_repro_graph_breaks_in__get_item_by_idx", "test_tagging_tensors_simple",
        "test_tagging_tensors_mix_used_unused_structure", "test_onnx_shape_as_tensor",
        "test_sys_modules")},
    **{_MISC + t: _IS_COMPILING for t in (
        "test_is_compiling", "test_user_defined_setattr1", "test_user_defined_setattr2")},
    **{_MISC + t: _SYMBOLIC for t in (
        "test_cannot_trace_mark_dynamic", "test_cat_unbacked", "test_cond_runtime_assert_generation",
        "test_mark_dynamic_with_ranges", "test_raise_guard_full_constraint",
        "test_raise_guard_indirect_full_constraint",
        "test_raise_guard_partial_constraint_no_graph_break",
        "test_raise_guard_partial_constraint_across_break", "test_mark_unbacked_strict",
        "test_unbacked_strict_mode", "test_user_code_statically_known", "test_dim_order",
        "test_sym_constrain_range_on_replaced_unbacked_symbol")},
    **{_MISC + t: _DYNAMO_EXC for t in (
        "test_check_assert_error_at_runtime_when_predicate_false_and_message_has_closure",
        "test_check_assert_error_at_runtime_when_predicate_true_and_message_has_closure",
        "test_non_pt2_compliant_ops_graph_break", "test_pt2_compliant_overload",
        "test_structseq_repr", "test_builtin_complex_args", "test_class_binop",
        "test_unpack_tensor_shape_mismatch", "test_error_on_nested_fx_trace")},
    **{_MISC + t: _NUMPY for t in ("test_numpy_min", "test_numpy_readonly")},
    **{_MISC + t: _CONFIG for t in (
        "test_replay_side_effects_config", "test_replay_side_effects_model_attr",
        "test_no_error_on_nested_fx_trace")},
    **{_MISC + t: _RUN for t in (
        "test_nested_optimize", "test_nested_optimize_decorator", "test_nested_optimize_run",
        "test_torch_compile_ctx_on_forward_and_training_step")},
    **{_MISC + t: _HELPER for t in (
        "test_clone_sparse_input", "test_nested_function_resuming_with_correct_globals",
        "test_numpy_take_along_axis")},
    **{_MISC + t: _SCALAR_CAPTURE for t in (
        "test_unbacked_repeat_cat", "test_bound_shape_checks",
        "test_arange_length_with_float32_dtype", "test_torch_check",
        "test_torch_check_symbolic_shape_rel", "test_torch_check_nonnegative", "test_item",
        "test_item_changes", "test_item_changes_new_shape", "test_foreach_tensor_scalar",
        "test_unbacked_empty_tensor", "test_sym_and_terms",
        "test_symint_fold_nontrivial_product_modulo", "test_validate_outputs_unbacked",
        "test_validate_outputs_unbacked_by_custom_op", "test_tolist_scalar", "test_tolist_1d",
        "test_tolist_kd", "test_tolist_0d", "test_check_simplification",
        "test_infer_unbacked_size_gt_zero", "test_builtin_bool_on_symint",
        "test_new_tensor_break", "test_builtin_bool_on_tensor", "test_builtin_bool_on_symfloat",
        "test_builtin_bool_on_symbool")},
    "DynamoOpPromotionTests.test_tensorify_track_item_symint": _SCALAR_CAPTURE,
    _MISC + "test_inplace_view_on_graph_input": _DRIFT,
    _MISC + "test_iterator_limit": _NEVER_ENDS,
}

# Tests run with their own calls only (no extra calls beside eager), and in scope: their
# compiled functions change state outside their arguments (a default argument, a closure
# cell, a global list, grad mode), which the test counts, or return the identity of an
# argument (id, data_ptr), which a copy does not share. Their results are still compared
# by the test itself.
_COUNTS_STATE = "counts the changes each call makes to state outside its arguments"
_IDENTITY = "returns or branches on the identity (id, data_ptr) of an argument"
AS_WRITTEN: dict[str, str] = {
    "DefaultsTests.test_func_default_tensor_args": _COUNTS_STATE,
    "DefaultsTests.test_meth_default_tensor_args": _COUNTS_STATE,
    "DefaultsTests.test_reconstructed_name": _COUNTS_STATE,
    **{_MISC + t: _COUNTS_STATE for t in (
        "test_closure_out_of_scope_cell_with_mutation", "test_nested_closure_mutation",
        "test_write_to_closures_in_inlining", "test_writes_to_cells_across_frames1",
        "test_writes_to_cells_across_frames2", "test_frozenset_of_non_literals",
        "test_grad_state_mutated", "test_deterministic_algorithms_mutated")},
    **{_MISC + t: _IDENTITY for t in (
        "test_data_ptr_graph_break_builtin", "test_id_guarded_module", "test_id_tensor")},
}

# Tests whose results hold uninitialized memory (torch.empty, Tensor.new(*sizes)): the extra
# calls compare the tensors' metadata, not their values.
UNINITIALIZED: dict[str, str] = {
    _MISC + "test_new_with_int_list": "x.new(*x.size()) + 5 is uninitialized memory + 5",
}


# ---------------------------------------------------------------- adapting the files
# torch.testing._internal modules that import expecttest: replaced by the stand-in below
# (the others, two_tensor say, are torch's own).
INTERNAL = ("common_utils", "common_cuda", "common_device_type", "common_methods_invocations",
            "jit_utils", "triton_utils", "inductor_utils")

_REWRITES = (
    (r"\btorch\._dynamo\.testing\.standard_test\b", f"{SUPPORT}.standard_test"),
    (r"\btorch\._dynamo\.optimize_assert\b", f"{SUPPORT}.optimize_assert"),
    (r"\btorch\._dynamo\.optimize\b", f"{SUPPORT}.optimize"),
    (r"\btorch\._dynamo\.reset\b", f"{SUPPORT}.reset"),
    (r"\btorch\.compiler\.reset\b", f"{SUPPORT}.reset"),
    (r"\btorch\.compile\b", f"{SUPPORT}.compile"),
    (r"\btorch\._dynamo\.exc\.Unsupported\b", f"{SUPPORT}.Unsupported"),
    (r"\btorch\._(?:dynamo|inductor)\.test_case\b", SUPPORT),
    (r"\btorch\.testing\._internal\.(?:" + "|".join(INTERNAL) + r")\b", SUPPORT),
)


def adapt(src: str) -> str:
    """The test file's text, adapted (the same text for ``--reference``: the support module
    is what differs). Every edit keeps the line count."""
    original = src
    for pattern, repl in _REWRITES:
        src = re.sub(pattern, repl, src)
    # The support module is bound where torch is imported.
    src = re.sub(r"^import torch$", f"import torch; import {SUPPORT}", src, count=1, flags=re.M)
    assert src.count("\n") == original.count("\n")
    return src


# ---------------------------------------------------------------- comparing with eager
class WrongAnswer(AssertionError):
    """A compiled call's result (or its arguments after the call) differs from eager's."""


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def _tolerance(dtype: Any) -> tuple[float, float]:
    import torch

    if dtype in (torch.float16, torch.bfloat16, torch.complex32):
        return 1e-2, 1e-3
    if dtype.is_floating_point or dtype.is_complex:
        return 1e-4, 1e-5
    return 0.0, 0.0


def compare(got: Any, want: Any, where: str, _seen: set | None = None, _depth: int = 0) -> None:
    """Raise :class:`WrongAnswer` where ``got`` differs from ``want`` (eager's): tensors by
    metadata and values (close, NaN equal to NaN), containers and plain objects item by
    item, strings with memory addresses blanked, everything else by ``==``."""
    import numpy as np
    import torch

    seen = set() if _seen is None else _seen
    if _depth > 40 or (id(got), id(want)) in seen:
        return
    seen.add((id(got), id(want)))

    def fail(msg: str) -> None:
        raise WrongAnswer(f"{where}: {msg}")

    def same_type() -> None:
        if type(got).__qualname__ != type(want).__qualname__:
            fail(f"a {type(got).__qualname__} where eager gives a {type(want).__qualname__}")

    def recurse(g: Any, w: Any, sub: str) -> None:
        compare(g, w, f"{where}{sub}", seen, _depth + 1)

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            fail(f"a {type(got).__name__} where eager gives a tensor")
        for attr in ("shape", "dtype", "device", "requires_grad", "layout"):
            if getattr(got, attr) != getattr(want, attr):
                fail(f"{attr} {getattr(got, attr)} where eager's is {getattr(want, attr)}")
        if want.device.type == "meta" or want.is_quantized or not Settings.values:
            return
        if type(want) not in (torch.Tensor, torch.nn.Parameter):
            if type(got).__qualname__ != type(want).__qualname__:
                fail(f"a {type(got).__qualname__} where eager gives a {type(want).__qualname__}")
            return  # a tensor subclass: its values are its own business
        if not (_readable(got) and _readable(want)):  # a storage resized away under it
            if got.untyped_storage().nbytes() != want.untyped_storage().nbytes():
                fail(f"storage of {got.untyped_storage().nbytes()} bytes where eager's has "
                     f"{want.untyped_storage().nbytes()}")
            return
        g, w = got.detach(), want.detach()
        if w.layout != torch.strided:
            g, w = g.to_dense(), w.to_dense()
        rtol, atol = _tolerance(w.dtype)
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True,
                                       check_stride=False)
        except AssertionError as e:
            fail(" ".join(str(e).split()))
        return
    if isinstance(want, np.ndarray):
        same_type()
        if got.shape != want.shape or got.dtype != want.dtype:
            fail(f"array {got.dtype}{list(got.shape)} where eager's is {want.dtype}{list(want.shape)}")
        if want.dtype.kind in "fc":
            rtol, atol = (1e-2, 1e-3) if want.dtype == np.float16 else (1e-4, 1e-5)
            if not np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
                fail(f"array values {got!r} where eager's are {want!r}")
        elif not np.array_equal(got, want):
            fail(f"array values {got!r} where eager's are {want!r}")
        return
    if isinstance(want, torch.nn.Module):
        same_type()
        if got.training != want.training:
            fail(f"training={got.training} where eager's is {want.training}")
        recurse(dict(got.state_dict()), dict(want.state_dict()), ".state_dict()")
        return
    if isinstance(want, (bool, np.bool_)) or isinstance(got, (bool, np.bool_)):
        same_type()
        if bool(got) != bool(want):
            fail(f"{got!r} where eager gives {want!r}")
        return
    if isinstance(want, (int, float, complex, np.number)):
        same_type()
        if got == want:
            return
        if isinstance(want, (float, complex, np.floating, np.complexfloating)):
            if cmath_isnan(got) and cmath_isnan(want):
                return
            if abs(got - want) <= 1e-5 * abs(want) + 1e-6:
                return
        fail(f"{got!r} where eager gives {want!r}")
    if isinstance(want, str):
        same_type()
        if _ADDRESS.sub("0x?", got) != _ADDRESS.sub("0x?", want):
            fail(f"{got!r} where eager gives {want!r}")
        return
    if isinstance(want, (list, tuple, collections.deque)):
        same_type()
        if len(got) != len(want):
            fail(f"{len(got)} items where eager gives {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            recurse(g, w, f"[{i}]")
        return
    if isinstance(want, dict):
        same_type()
        if len(got) != len(want):
            fail(f"{len(got)} keys {list(got)!r} where eager gives {list(want)!r}")
        for i, ((gk, gv), (wk, wv)) in enumerate(zip(got.items(), want.items())):
            recurse(gk, wk, f".keys()[{i}]")
            recurse(gv, wv, f"[{wk!r}]")
        return
    if isinstance(want, (set, frozenset)):
        same_type()
        if len(got) != len(want):
            fail(f"{len(got)} items where eager gives {len(want)}")
        if not any(isinstance(x, torch.Tensor) for x in want) and got != want:
            fail(f"{got!r} where eager gives {want!r}")
        return
    if want is None or isinstance(want, (type, types.ModuleType, torch.dtype, torch.device)):
        if got is not want and got != want:
            fail(f"{got!r} where eager gives {want!r}")
        return
    if isinstance(want, collections.abc.Iterator) and not isinstance(want, torch.Tensor):
        # an iterator an extra call returned (never the test's own): compare what it yields
        if not isinstance(got, collections.abc.Iterator):
            fail(f"a {type(got).__name__} where eager gives an iterator")
        recurse(list(itertools.islice(got, 10000)), list(itertools.islice(want, 10000)),
                " (items)")
        return
    if isinstance(want, (types.FunctionType, types.MethodType, functools.partial)):
        same_type()
        gq = getattr(got, "__qualname__", None) or getattr(getattr(got, "func", None), "__qualname__", None)
        wq = getattr(want, "__qualname__", None) or getattr(getattr(want, "func", None), "__qualname__", None)
        if gq != wq:
            fail(f"function {gq} where eager gives {wq}")
        return
    same_type()
    try:
        eq = got == want
    except Exception:  # noqa: BLE001 - an __eq__ that raises: compare what can be compared
        eq = None
    if eq is True:
        return
    if dataclasses.is_dataclass(want) or hasattr(want, "__dict__"):
        recurse(dict(vars(got)), dict(vars(want)), ".__dict__")
        return
    if eq is False and _ADDRESS.sub("0x?", repr(got)) != _ADDRESS.sub("0x?", repr(want)):
        fail(f"{got!r} where eager gives {want!r}")


def _readable(t: Any) -> bool:
    """Whether a strided tensor's storage holds all its elements (``storage.resize_(0)``
    leaves a tensor whose reads crash the process)."""
    import torch

    if t.layout != torch.strided or t.numel() == 0:
        return True
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size() <= t.untyped_storage().nbytes()


def _describe(value: Any, depth: int = 0) -> str:
    """A short description of a call's arguments, for a failure's message."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).split('.')[-1]}{list(value.shape)}"
    if depth < 3 and isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v, depth + 1) for v in value[:6])
        return f"({inner}{', ...' if len(value) > 6 else ''})"
    if depth < 3 and isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_describe(v, depth + 1)}" for k, v in
                               list(value.items())[:6]) + "}"
    text = repr(value)
    return text if len(text) < 40 else f"<{type(value).__qualname__}>"


def cmath_isnan(x: Any) -> bool:
    try:
        return x != x
    except Exception:  # noqa: BLE001
        return False


# ---------------------------------------------------------------- calling beside eager
def _rng_state() -> tuple:
    import numpy as np
    import torch

    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_rng(state: tuple) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])


def _copy(value: Any) -> Any:
    """A deep copy of the call's arguments; tensors that cannot be deep-copied (non-leaf
    tensors requiring grad) become detached clones. None when no copy can be made."""
    import torch
    from torch.utils import _pytree

    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001
        pass

    def clone(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        try:
            return copy.deepcopy(x)
        except Exception:  # noqa: BLE001
            raise TypeError(f"cannot copy a {type(x).__name__}") from None
    try:
        return _pytree.tree_map(clone, value)
    except Exception:  # noqa: BLE001
        return None


class Stats:
    """Counts over a run: calls checked beside eager, and calls that could not be."""

    checked = 0
    uncopyable = 0
    compiles = 0  # compile()/optimize()/standard_test calls: a test with none compiles nothing


class Settings:
    """Compiled calls per call a test makes (``--calls``; 1 for the tests in AS_WRITTEN), and
    how deep the checked calls now running are (a compiled function called by another one is
    called as the test calls it: its extra calls would run inside the outer recording)."""

    calls = 3
    default = 3
    depth = 0
    values = True  # compare tensor values (False: metadata only, see UNINITIALIZED)


@contextlib.contextmanager
def _checking() -> Iterator[bool]:
    """Yields whether this call may make extra calls (it is not inside another checked call)."""
    Settings.depth += 1
    try:
        yield Settings.depth == 1
    finally:
        Settings.depth -= 1


def check_call(eager: Callable[..., Any], compiled: Callable[..., Any], args: tuple,
               kwargs: dict, where: str, state: Callable[[], Any] | None = None,
               eager_state: Callable[[], Any] | None = None) -> bool:
    """Call ``compiled`` on one copy of the arguments and ``eager`` on another, from the same
    random state, and compare results, arguments after the call and (for modules) state.
    False when the arguments cannot be copied (nothing was called)."""
    mine, theirs = _copy((args, kwargs)), _copy((args, kwargs))
    if mine is None or theirs is None:
        Stats.uncopyable += 1
        return False
    rng = _rng_state()
    want_exc = got_exc = None
    try:
        want = eager(*theirs[0], **theirs[1])
    except Exception as e:  # noqa: BLE001
        want_exc = e
    _set_rng(rng)
    try:
        got = compiled(*mine[0], **mine[1])
    except Exception as e:  # noqa: BLE001
        if want_exc is None:
            raise
        got_exc = e
    Stats.checked += 1
    where = f"{where} with {_describe((args, kwargs))}"
    if want_exc is not None:
        if got_exc is None:
            raise WrongAnswer(f"{where}: returned {got!r} where eager raises {want_exc!r}")
        return True
    compare(got, want, f"{where}: result")
    compare(mine, theirs, f"{where}: arguments after the call")
    if state is not None and eager_state is not None:
        compare(state(), eager_state(), f"{where}: module state after the call")
    return True


class Checked:
    """A compiled function, checked against eager on every call (see the module docstring).

    Not a descriptor unless what it wraps is one: ``fxlite.compile`` of a method defined in
    a class body must bind as ``torch.compile``'s does, and a failure to is fxlite's."""

    def __init__(self, fn: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        self.__dict__.update(_fn=fn, _compiled=compiled)
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            with contextlib.suppress(AttributeError, TypeError):
                self.__dict__[attr] = getattr(fn, attr)
        self.__dict__["__wrapped__"] = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _checking() as outermost:
            if outermost:
                self._check(args, kwargs)
        return self._compiled(*args, **kwargs)

    def _check(self, args: tuple, kwargs: dict) -> None:
        import torch

        owner = getattr(self._fn, "__self__", None)
        name = getattr(self._fn, "__qualname__", self._fn)
        for i in range(Settings.calls - 1):
            eager, state, eager_state = self._fn, None, None
            if isinstance(owner, torch.nn.Module):  # a module's method: eager on a copy
                twin = _copy(owner)
                if twin is None:
                    break
                eager = getattr(twin, self._fn.__name__)
                state, eager_state = (lambda: owner), (lambda t=twin: t)
            if not check_call(eager, self._compiled, args, kwargs, f"extra call {i + 1} of {name}",
                              state, eager_state):
                break

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_compiled"], name)


class CheckedMethod(Checked):
    """:class:`Checked` for a compiled object that binds as a method, as a function does."""

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)


def check_module(compiled: Any, module: Any) -> Any:
    """Make the compiled module ``compiled`` (of ``module``) check each call against an eager
    copy of ``module`` (results, arguments, state), by giving it a subclass of its own type."""
    base = type(compiled)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _checking() as outermost:
            for i in range(Settings.calls - 1 if outermost else 0):
                eager = _copy(module)
                if eager is None:
                    Stats.uncopyable += 1
                    break
                if not check_call(eager, functools.partial(base.__call__, self), args, kwargs,
                                  f"extra call {i + 1} of {type(module).__name__}",
                                  lambda: module, lambda e=eager: e):
                    break
        return base.__call__(self, *args, **kwargs)

    compiled.__class__ = type(base.__name__, (base,), {"__call__": __call__,
                                                       "__module__": base.__module__})
    return compiled


# ---------------------------------------------------------------- the stand-in module
class AnyCount(int):
    """Stands for Dynamo's frame and op counts: equal to (and not less than) any number."""

    def __new__(cls) -> AnyCount:
        return super().__new__(cls, 0)

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    def __bool__(self) -> bool:
        return True

    def __lt__(self, other: object) -> bool:
        return True

    __le__ = __gt__ = __ge__ = __lt__

    def __add__(self, other: object) -> AnyCount:
        return self

    __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __add__
    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return "<any count>"


class CompileCounter:
    """``torch._dynamo.testing.CompileCounter`` whose counts are :class:`AnyCount`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.frame_count = AnyCount()
        self.op_count = AnyCount()
        self.graphs: list[Any] = []

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        return gm.forward

    def clear(self) -> None:
        pass


def support_module(reference: bool) -> types.ModuleType:
    """What the adapted files import in place of torch.compile's entry points and of
    ``torch.testing._internal`` / ``torch._dynamo.test_case``, written for this runner."""
    import numpy as np
    import torch

    import fxlite

    mod = types.ModuleType(SUPPORT)
    mod.__all__ = []  # `from torch.testing._internal.triton_utils import *` imports nothing

    def compile_one(fn: Any, fullgraph: bool = False, dynamic: bool | None = None) -> Any:
        if reference:
            return torch.compile(fn, backend="eager", fullgraph=fullgraph, dynamic=dynamic)
        return fxlite.compile(fn, fullgraph=fullgraph, dynamic=dynamic)

    def compile(fn: Any = None, *, fullgraph: bool = False, dynamic: bool | None = None,
                disable: bool = False, **_dropped: Any) -> Any:
        if fn is None:
            return lambda f: compile(f, fullgraph=fullgraph, dynamic=dynamic, disable=disable)
        Stats.compiles += 1
        if disable:
            return fn
        compiled = compile_one(fn, fullgraph, dynamic)
        if isinstance(fn, torch.nn.Module):
            return check_module(compiled, fn)
        if hasattr(type(compiled), "__get__"):
            return CheckedMethod(fn, compiled)
        return Checked(fn, compiled)

    class _Optimize:
        def __init__(self, fullgraph: bool, dynamic: bool | None, disable: bool) -> None:
            self.kw = dict(fullgraph=fullgraph, dynamic=dynamic, disable=disable)

        def __call__(self, fn: Any) -> Any:
            return compile(fn, **self.kw)

        def __enter__(self) -> None:
            raise NotImplementedError("torch._dynamo.optimize as a context manager has no "
                                      "fxlite.compile counterpart")

        def __exit__(self, *exc: Any) -> None:
            pass

    def optimize(*args: Any, nopython: bool = False, dynamic: bool | None = None,
                 disable: bool = False, **_dropped: Any) -> _Optimize:
        return _Optimize(bool(nopython), dynamic, disable)

    def optimize_assert(*args: Any, dynamic: bool | None = None, **_dropped: Any) -> _Optimize:
        # optimize_assert is Dynamo's "one frame, no graph break" check: neutralised with the
        # frame counts; the function is compiled with fxlite's defaults.
        return _Optimize(False, dynamic, False)

    def reset() -> None:
        torch._dynamo.reset()
        if not reference:
            fxlite.reset()

    def standard_test(self: Any, fn: Callable[..., Any], nargs: int, expected_ops: Any = None,
                      expected_ops_dynamic: Any = None, expected_frame_count: int = 1) -> None:
        Stats.compiles += 1
        opt_fn = compile_one(fn)
        inputs = [[torch.randn(10, 10) for _ in range(nargs)] for _ in range(max(Settings.calls, 3))]
        inputs.append(inputs[0])  # an input seen before
        for i, args in enumerate(inputs):
            if not check_call(fn, opt_fn, tuple(args), {}, f"call {i + 1} of {fn.__name__}"):
                raise unittest.SkipTest("arguments cannot be copied")

    # -- torch._dynamo.test_case / torch.testing._internal.common_utils
    class TestCase(unittest.TestCase):
        """``assertEqual`` that compares tensors, numbers and nested containers of them."""

        def setUp(self) -> None:
            super().setUp()
            Settings.calls = 1 if _short_id(self) in AS_WRITTEN else Settings.default
            Settings.values = _short_id(self) not in UNINITIALIZED
            reset()
            torch._dynamo.utils.counters.clear()

        def tearDown(self) -> None:
            reset()
            super().tearDown()

        def assertEqual(self, first: Any, second: Any, msg: Any = None, *, atol: Any = None,
                        rtol: Any = None, **_: Any) -> None:
            if isinstance(first, AnyCount) or isinstance(second, AnyCount):
                return  # a Dynamo frame or op count: neutralised
            if isinstance(first, np.ndarray) or isinstance(second, np.ndarray):
                if not (isinstance(first, np.ndarray) and isinstance(second, np.ndarray)
                        and first.shape == second.shape and first.dtype.kind == second.dtype.kind
                        and (np.array_equal(first, second) or (
                            first.dtype.kind in "fc" and np.allclose(first, second,
                                                                     equal_nan=True)))):
                    if not isinstance(first, np.ndarray) or not isinstance(second, np.ndarray):
                        torch.testing.assert_close(first, second, equal_nan=True,
                                                   check_dtype=False, msg=msg)
                        return
                    raise self.failureException(msg or f"{first!r} != {second!r}")
                return
            if atol is not None or rtol is not None:
                torch.testing.assert_close(first, second, atol=atol, rtol=rtol, equal_nan=True,
                                           check_dtype=False, msg=msg)
                return
            try:
                torch.testing.assert_close(first, second, equal_nan=True, check_dtype=False,
                                           msg=msg)
                return
            except (TypeError, ValueError, RuntimeError):
                pass  # not a type assert_close knows: fall back to ==
            except AssertionError:
                if _numbers_equal(first, second):
                    return
                raise
            if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)) \
                    and len(first) == len(second) and type(first) is not type(second):
                for a, b in zip(first, second):
                    self.assertEqual(a, b, msg)
                return
            if isinstance(first, dict) and isinstance(second, dict) and first.keys() == second.keys():
                for k in first:
                    self.assertEqual(first[k], second[k], msg)
                return
            try:
                super().assertEqual(first, second, msg)
            except RuntimeError:  # containers of tensors compared with ==
                compare(first, second, "assertEqual")

        def assertNotEqual(self, first: Any, second: Any, msg: Any = None, **_: Any) -> None:
            try:
                self.assertEqual(first, second)
            except AssertionError:
                return
            raise self.failureException(msg or f"{first!r} == {second!r}")

        def assertExpectedInline(self, actual: str, expect: str, skip: int = 0) -> None:
            if isinstance(actual, AnyCount) or actual == repr(AnyCount()):
                return  # a Dynamo frame or op count: neutralised
            self.assertMultiLineEqual(expect, actual)

        def assertExpectedRaisesInline(self, exc_type: Any, callable_: Any, expect: str,
                                       *args: Any, **kwargs: Any) -> None:
            with self.assertRaises(exc_type):
                callable_(*args, **kwargs)

        def assertExpected(self, s: str, subname: str = "") -> None:  # noqa: ARG002
            raise unittest.SkipTest("expect files of torch's test suite are not available")

    def _numbers_equal(a: Any, b: Any) -> bool:
        num = (int, float, bool)
        return isinstance(a, num) and isinstance(b, num) and float(a) == float(b)

    def _noop_decorator(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda f: f

    class subtest:
        def __init__(self, arg_values: Any, name: str | None = None,
                     decorators: list[Any] | None = None) -> None:
            self.arg_values, self.name, self.decorators = arg_values, name, decorators or []

    class parametrize:
        """``common_utils.parametrize``: the test becomes one test per value, named as
        torch names them (``test_x_arg_value``, ``test_x_arg0``, or ``name_fn``'s)."""

        def __init__(self, arg_str: str, arg_values: Any, name_fn: Any = None) -> None:
            self.names = [s.strip() for s in arg_str.split(",") if s.strip()]
            self.values, self.name_fn = list(arg_values), name_fn

        def __call__(self, fn: Any) -> Any:
            fn.__dict__.setdefault("_parity_params", []).append(self)
            return fn

        def _repr(self, idx: int, name: str, value: Any) -> str:
            if isinstance(value, torch.dtype):
                return str(value).split(".")[-1]
            if isinstance(value, torch.device):
                return str(value)
            if isinstance(value, (int, float, str)):
                return f"{name}_{str(value).replace('.', '_')}"
            return f"{name}{idx}"

        def expand(self) -> Iterator[tuple[str, dict[str, Any], list[Any]]]:
            for idx, value in enumerate(self.values):
                explicit, decorators = None, []
                if isinstance(value, subtest):
                    explicit, decorators, value = value.name, value.decorators, value.arg_values
                values = tuple(value) if len(self.names) > 1 else (value,)
                if explicit:
                    name = explicit
                elif self.name_fn:
                    name = self.name_fn(*values)
                else:
                    name = "_".join(self._repr(idx, n, v) for n, v in zip(self.names, values))
                yield name, dict(zip(self.names, values)), decorators

    def instantiate_parametrized_tests(cls: type) -> type:
        for attr, fn in list(vars(cls).items()):
            params = getattr(fn, "_parity_params", None)
            if not params:
                continue
            delattr(cls, attr)
            for combo in itertools.product(*(list(p.expand()) for p in reversed(params))):
                name = "_".join([attr] + [c[0] for c in combo if c[0]])
                kwargs: dict[str, Any] = {}
                for c in combo:
                    kwargs.update(c[1])

                @functools.wraps(fn)
                def test(self: Any, _fn: Any = fn, _kw: dict = kwargs) -> Any:
                    return _fn(self, **_kw)

                test.__dict__.pop("_parity_params", None)
                test.__name__ = name
                for c in combo:
                    for deco in c[2]:
                        test = deco(test)
                setattr(cls, name, test)
        return cls

    def instantiate_device_type_tests(cls: type, scope: dict, only_for: Any = None,
                                      **_: Any) -> None:
        """Device-generic tests for the CPU only: class ``<name>CPU``, tests ``<name>_cpu``
        (none where ``only_for`` leaves the CPU out, as torch does)."""
        scope.pop(cls.__name__, None)
        if only_for is not None and "cpu" not in ([only_for] if isinstance(only_for, str)
                                                  else list(only_for)):
            return
        instantiate_parametrized_tests(cls)
        body: dict[str, Any] = {}
        for attr, fn in list(vars(cls).items()):
            if attr.startswith("test") and callable(fn):
                @functools.wraps(fn)
                def test(self: Any, _fn: Any = fn) -> Any:
                    return _fn(self, "cpu")
                test.__name__ = f"{attr}_cpu"
                body[f"{attr}_cpu"] = test
        new = type(f"{cls.__name__}CPU", (cls,), body)
        for attr in list(vars(cls)):
            if attr.startswith("test"):
                setattr(new, attr, None)  # only the _cpu variants are collected
        new.__module__ = scope.get("__name__", cls.__module__)
        scope[new.__name__] = new

    @contextlib.contextmanager
    def freeze_rng_state() -> Iterator[None]:
        state = torch.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def set_default_dtype(dtype: Any) -> Iterator[None]:
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(old)

    def _skip(reason: str) -> Any:
        return lambda f: unittest.skip(reason)(f)

    def _only_cuda(f: Any) -> Any:
        return unittest.skipIf(not torch.cuda.is_available(), "needs CUDA")(f)

    class SampleInput:
        """``common_methods_invocations.SampleInput``: an input and its extra arguments."""

        def __init__(self, input: Any, *args: Any, args_: Any = None, kwargs: Any = None,
                     **_: Any) -> None:
            self.input, self.args, self.kwargs = input, tuple(args), kwargs or {}

    names = dict(
        SampleInput=SampleInput, Unsupported=(torch._dynamo.exc.Unsupported, fxlite.TraceError), compile=compile, optimize=optimize, optimize_assert=optimize_assert, reset=reset,
        standard_test=standard_test, TestCase=TestCase, JitTestCase=TestCase,
        run_tests=lambda: None, parametrize=parametrize, subtest=subtest,
        instantiate_parametrized_tests=instantiate_parametrized_tests,
        instantiate_device_type_tests=instantiate_device_type_tests,
        freeze_rng_state=freeze_rng_state, set_default_dtype=set_default_dtype,
        disable_translation_validation_if_dynamic_shapes=_noop_decorator,
        skipIfTorchDynamo=_noop_decorator, skipIfRocm=_noop_decorator,
        skipIfHpu=_noop_decorator, skipIfWindows=_noop_decorator, skipIfXpu=_noop_decorator,
        skipIfCrossRef=_noop_decorator, skipIfNNModuleInlined=_noop_decorator,
        wrapDeterministicFlagAPITest=_noop_decorator, serialTest=_noop_decorator,
        scoped_load_inline=_skip("needs a C++ toolchain (torch.utils.cpp_extension.load_inline)"),
        requires_cuda=_only_cuda, onlyCUDA=_only_cuda, onlyCPU=lambda f: f,
        skipCUDAIf=lambda cond, reason: _noop_decorator, dtypes=lambda *a, **k: (lambda f: f),
        largeTensorTest=lambda *a, **k: (lambda f: f),
        IS_FBCODE=False, IS_WINDOWS=sys.platform == "win32", IS_MACOS=sys.platform == "darwin",
        IS_LINUX=sys.platform.startswith("linux"), IS_CI=False, IS_SANDCASTLE=False,
        TEST_WITH_ROCM=False, TEST_CUDA=torch.cuda.is_available(), TEST_MULTIGPU=False,
        TEST_HPU=False, TEST_XPU=False, TEST_WITH_ASAN=False, TEST_WITH_TORCHDYNAMO=False,
        HAS_CUDA=torch.cuda.is_available(), HAS_GPU=torch.cuda.is_available(),
        HAS_CPU=True, GPU_TYPE="cuda", SM80OrLater=False, PLATFORM_SUPPORTS_FLASH_ATTENTION=False,
        find_library_location=lambda name: name, np=np,
    )
    for key, value in names.items():
        setattr(mod, key, value)

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def stand_in(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"the dynamo_parity stand-in has no {name}")
        return stand_in

    mod.__getattr__ = missing
    return mod


# ---------------------------------------------------------------- loading and running
def _patched_dynamo_testing() -> contextlib.AbstractContextManager:
    import torch._dynamo.testing as testing

    stack = contextlib.ExitStack()
    for name in ("CompileCounter", "CompileCounterWithBackend"):
        stack.enter_context(_setattr(testing, name, CompileCounter))
    return stack


@contextlib.contextmanager
def _setattr(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def load_suites(tests: str, workdir: str, reference: bool, calls: int
                ) -> dict[str, list[unittest.TestCase]]:
    """Adapt, write and import each saved file; return its in-scope test cases by file."""
    Settings.default = calls
    sys.modules[SUPPORT] = support_module(reference)
    sys.path.insert(0, workdir)
    importlib.invalidate_caches()
    loader = unittest.TestLoader()
    by_file: dict[str, list[unittest.TestCase]] = {}
    for file in FILES:
        path = os.path.join(tests, file)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            text = adapt(f.read())
        ast.parse(text)
        with open(os.path.join(workdir, file), "w") as f:
            f.write(text)
        name = file[:-3]
        module = importlib.import_module(name)
        cases = []
        for cls_name, cls in sorted(vars(module).items()):
            if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)
                    and cls.__module__ == name) or cls_name in SET_ASIDE:
                continue
            for test in loader.loadTestsFromTestCase(cls):
                if f"{cls_name}.{test._testMethodName}" in SET_ASIDE:
                    continue
                method = getattr(type(test), test._testMethodName)
                # Dynamo's known failures run as plain tests
                for fn in (method, getattr(method, "__func__", None)):
                    if fn is not None and getattr(fn, "__unittest_expecting_failure__", False):
                        fn.__unittest_expecting_failure__ = False
                cases.append(test)
        by_file[file] = cases
    if not by_file:
        raise SystemExit(f"dynamo_parity: none of {', '.join(FILES)} found in {tests}; save "
                         "PyTorch's test files there (see the docstring of this script)")
    return by_file


class _Result(unittest.TestResult):
    def __init__(self, live: bool = False) -> None:
        super().__init__()
        self.live = live  # print each outcome as it comes (the tests' own output is captured)
        self.outcome: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.compiles: dict[str, int] = {}
        self._start = 0.0
        self._compiles = 0

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._start = time.perf_counter()
        self._compiles = Stats.compiles

    def stopTest(self, test: unittest.TestCase) -> None:
        super().stopTest(test)
        self.seconds[test.id()] = time.perf_counter() - self._start
        self.compiles[test.id()] = Stats.compiles - self._compiles
        if self.live:
            print(f"    {self.outcome.get(test.id(), '?'):<5} {test.id()}  "
                  f"({self.seconds[test.id()]:.1f} s, {self.compiles[test.id()]} compiled)",
                  file=sys.__stdout__, flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:
        self.outcome.setdefault(test.id(), "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self.outcome[test.id()] = "fail"

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self.outcome[test.id()] = "error"

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self.outcome[test.id()] = "skip"

    def addSubTest(self, test: unittest.TestCase, subtest: Any, err: Any) -> None:
        if err is None:
            return
        if issubclass(err[0], test.failureException):
            self.failures.append((subtest, self._exc_info_to_string(err, test)))
            self.outcome[test.id()] = "fail"
        else:
            self.errors.append((subtest, self._exc_info_to_string(err, test)))
            self.outcome.setdefault(test.id(), "error")


def _short_id(test: Any) -> str:
    return ".".join(test.id().split(".")[-2:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", default=os.path.join(REPO, ".parity", "dynamo"),
                        help="folder holding PyTorch's test_functions.py and test_misc.py")
    parser.add_argument("-k", default=None, help="run only tests whose id contains this text")
    parser.add_argument("-v", action="store_true", help="print each test's outcome")
    parser.add_argument("--failures", action="store_true", help="print each failure's traceback")
    parser.add_argument("--calls", type=int, default=3,
                        help="compiled calls per call a test makes, each checked against eager")
    parser.add_argument("--list-set-aside", action="store_true", help="print the set-aside tests")
    parser.add_argument("--reference", action="store_true",
                        help='run the same adapted tests on torch.compile(backend="eager")')
    args = parser.parse_args(argv)

    if args.list_set_aside:
        for name, reason in SET_ASIDE.items():
            print(f"{name}: {reason}")
        print("\nrun with their own calls only (in scope):")
        for name, reason in AS_WRITTEN.items():
            print(f"{name}: {reason}")
        print("\nextra calls compare metadata only (in scope):")
        for name, reason in UNINITIALIZED.items():
            print(f"{name}: {reason}")
        return 0

    import torch

    import fxlite

    logging.disable(logging.WARNING)  # the compilers' warnings about fallbacks
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory(prefix="dynamo_parity_") as workdir, \
            _patched_dynamo_testing():
        suites = load_suites(args.tests, workdir, args.reference, args.calls)
        totals: Counter[str] = Counter()
        subject = 'torch.compile(backend="eager") (--reference)' if args.reference else \
            f"fxlite from {os.path.dirname(fxlite.__file__)}"
        print(f"torch {torch.__version__}, {subject}, {args.calls} compiled calls per call, "
              f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")
        print(f"{'file':<20} {'pass':>5} {'fail':>5} {'error':>5} {'skip':>5} {'aside':>6} "
              f"{'in scope':>9} {'rate':>7}")
        for file, cases in suites.items():
            if args.k:
                cases = [c for c in cases if args.k in c.id()]
            result = _Result(live=args.v)
            start = time.perf_counter()
            sink = io.StringIO()
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                unittest.TestSuite(cases).run(result)  # runs setUpClass/tearDownClass too
            counts = Counter(result.outcome.values())
            scope = len(cases) - counts["skip"]
            aside = sum(1 for k in SET_ASIDE if _file_of(k, suites, file))
            rate = counts["pass"] / scope if scope else 1.0
            print(f"{file:<20} {counts['pass']:>5} {counts['fail']:>5} {counts['error']:>5} "
                  f"{counts['skip']:>5} {aside:>6} {scope:>9} {rate:>7.1%}   "
                  f"({time.perf_counter() - start:.0f} s)")
            totals.update(counts)
            totals["scope"] += scope
            totals["aside"] += aside
            if args.failures:
                for test, tb in result.failures + result.errors:
                    print(f"\n=== {test.id()}\n{tb}")
        rate = totals["pass"] / totals["scope"] if totals["scope"] else 1.0
        print(f"{'overall':<20} {totals['pass']:>5} {totals['fail']:>5} {totals['error']:>5} "
              f"{totals['skip']:>5} {totals['aside']:>6} {totals['scope']:>9} {rate:>7.1%}")
        print(f"compiled calls checked against eager: {Stats.checked}; calls whose arguments "
              f"could not be copied (not repeated): {Stats.uncopyable}")
        print(f"set aside (not run): {len(SET_ASIDE)} entries; list them with --list-set-aside")
    return 0


def _file_of(key: str, suites: dict[str, Any], file: str) -> bool:
    """Whether the set-aside entry ``key`` (Class.test) belongs to ``file``'s module."""
    cls = key.split(".")[0]
    module = sys.modules.get(file[:-3])
    return module is not None and isinstance(getattr(module, cls, None), type)


if __name__ == "__main__":
    sys.exit(main())
