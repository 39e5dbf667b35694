"""Parity with torch.fx, measured by PyTorch's own FX test suite.

PyTorch ships ``test/test_fx.py`` and ``test/fx/test_subgraph_rewriter.py``. They are not part
of fxlite: save them (BSD-licensed, from the PyTorch repository at the tag of the torch you
run) into an ignored folder, by default ``.parity/``::

    .parity/test_fx.py
    .parity/fx/test_subgraph_rewriter.py      (or .parity/test_subgraph_rewriter.py)
    .parity/fx/named_tup.py, .parity/fx/test_future.py   (small helpers some tests import)

This script adapts them at run time, with the fewest changes, and runs them in-process:

- ``torch.fx`` becomes ``fxlite`` (``torch.fx.proxy`` -> ``fxlite.proxy``, and so on); imports
  of torch-internal modules that fxlite does not mirror stay torch's, and only the tests set
  aside below use them;
- ``torch.testing._internal`` (which needs ``expecttest``) is replaced by a small stand-in
  with the same names: a ``unittest.TestCase`` whose ``assertEqual`` compares tensors;
- the test base's ``setUp`` no longer loads ``libtorchbind_test.so``, which torch wheels do
  not ship;
- other test files that ``test_fx.py`` imports are replaced by empty stand-ins;
- every test in :data:`SET_ASIDE` is removed before the run and listed with its reason.

Every edit keeps line numbers, so tracebacks and ``stack_trace`` metadata point at the
saved files. Run::

    python benchmarks/fx_parity.py [--tests .parity] [-k PATTERN] [-v] [--failures]

It prints, per file, how many in-scope tests pass, fail, error or are skipped by their own
decorators (a CUDA-only test on a CPU machine, for example), then the totals.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import os
import re
import sys
import tempfile
import time
import types
import unittest
from collections import Counter
from collections.abc import Iterator
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Why each test is not run. Reasons name the torch-internal machinery the test is about.
_JIT = "tests TorchScript (torch.jit) itself"
_TORCHBIND = "needs torch's test-only C++ library libtorchbind_test.so (not in torch wheels)"
_EXPERIMENTAL = "tests torch.fx.experimental (RewritingTracer, proxy_tensor.make_fx)"
_BC = "checks torch.fx's backward-compatibility signature records (torch.fx._compatibility)"
_SCHEMA = "tests torch's operator-signature tables (torch.fx.operator_schemas)"
_EXPORT = "needs torch.export and dynamo's fake tensors"
_DYNAMO = "tests torch.compile / functorch control flow (dynamo)"
_IMMUTABLE = ("tests torch.fx.immutable_collections, torch.fx's container classes for node "
              "arguments; fxlite keeps arguments as plain tuples, lists and dicts")
_PATCH_INTERNAL = "patches torch.fx._symbolic_trace internals in a subprocess"
_PRIVATE = "checks private attributes of torch.fx's GraphModule (_lineno_map, _prologue_start)"
_SPELLING = ("asserts a name torch.fx's code generator invents for an annotation "
             "(_torch__ops_aten_aten_relu_, typing_List), and TorchScript's printed code")
_DRIFT = ("fails on torch.fx itself with this torch (checked with --reference): the saved test "
          "file predates this functional's current code")

SET_ASIDE: dict[str, str] = {
    # test_fx.py, TestFX
    "TestFX.test_native_callable": _TORCHBIND,
    "TestFX.test_torchbind_class_attribute_in_fx": _TORCHBIND,
    "TestFX.test_torchbind_class_attribute_in_fx_tensor_arg": _TORCHBIND,
    "TestFX.test_ast_rewriter_rewrites_assert": _EXPERIMENTAL,
    "TestFX.test_ast_rewriter_rewrites_assert_with_message": _EXPERIMENTAL,
    "TestFX.test_ast_rewriter_reassigns_submodules": _EXPERIMENTAL,
    "TestFX.test_ast_rewriter_wrap": _EXPERIMENTAL,
    "TestFX.test_ast_rewriter_wrap_fn_directly": _EXPERIMENTAL,
    "TestFX.test_ast_rewriter_wrapped_via_decorator": _EXPERIMENTAL,
    "TestFX.test_ast_rewriter_wrapped_via_decorator_and_transformed": _EXPERIMENTAL,
    "TestFX.test_ast_rewriter_wrap_with_submodule": _EXPERIMENTAL,
    "TestFX.test_delete_unused_values": _EXPERIMENTAL,
    "TestFX.test_get_torch_func_signature": _SCHEMA,
    "TestFX.test_shape_prop_unbacked_sym": _EXPORT,
    "TestFX.test_control_flow_tracing": _DYNAMO,
    "TestFX.test_immutable_list_pytree_ops": _IMMUTABLE,
    "TestFX.test_immutable_dict_pytree_ops": _IMMUTABLE,
    "TestFX.test_copy_it": _IMMUTABLE,
    "TestFX.test_no_mutation": _IMMUTABLE,
    "TestFX.test_getitem_subproc": _PATCH_INTERNAL,
    "TestFX.test_user_friendly_call_provenance_with_function": _JIT,
    "TestFX.test_user_friendly_call_provenance_with_module": _JIT,
    "TestFX.test_lineno_map": _PRIVATE,
    "TestFX.test_print_graph": _SPELLING,
    "TestFX.test_return_type_exists_pre_pep585": _SPELLING,
    # test_fx.py, TestFunctionalTracing (generated per torch.nn.functional function)
    "TestFunctionalTracing.test_nn_functional_linear_cross_entropy": _DRIFT,
    "TestFunctionalTracing.test_nn_functional_max_pool3d_with_indices": _DRIFT,
    # test_fx.py, other classes
    "TestOperatorSignatures": _SCHEMA,
    "TestOperatorSignaturesCPU": _SCHEMA,
    "TestFXAPIBackwardCompatibility": _BC,
    # test_subgraph_rewriter.py
    "TestSubgraphRewriter.test_subgraph_rewriter_annotations_int": _EXPERIMENTAL,
}

# torch.fx.<atom>: modules and names that map to fxlite's; KEEP_TORCH stay torch's (they are
# imported at the top of test_fx.py, and only set-aside tests use them).
MODULE_MAP = {"_symbolic_trace": "tracer"}
KEEP_TORCH = {"experimental", "_compatibility", "operator_schemas", "immutable_collections",
              "_pytree", "annotate"}

# torch.testing._internal modules replaced by the stand-in below.
INTERNAL = ("common_utils", "jit_utils", "common_quantization", "common_methods_invocations",
            "common_device_type")


def _fx_ref(m: re.Match) -> str:
    atom = m.group(1)
    if atom is None:
        return "fxlite"
    if atom in KEEP_TORCH:
        return m.group(0)
    return f"fxlite.{MODULE_MAP.get(atom, atom)}"


def _tolerant_import(m: re.Match) -> str:
    names = [n.strip() for n in m.group(2).split(",") if n.strip()]
    return f"{', '.join(names)}, = __import__(\"_parity_support\").names({m.group(1)!r}, {names!r})"


def adapt(src: str, reference: bool = False) -> str:
    """The test file's text, adapted to fxlite (to torch.fx itself with ``reference``).
    Every edit keeps the line count."""
    original = src
    # Classes set aside whole keep their text: their bodies name torch.fx internals.
    keep = set()
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef) and node.name in SET_ASIDE:
            keep.update(range(node.lineno - 1, node.end_lineno))
    lines = src.split("\n")
    src = "\n".join(line if i in keep or reference
                    else re.sub(r"\btorch\.fx\b(?:\.(\w+))?", _fx_ref, line)
                    for i, line in enumerate(lines))
    src = re.sub(r"\btorch\.testing\._internal\.(" + "|".join(INTERNAL) + r")\b",
                 "_parity_support", src)
    # The base class's setUp loads torch's test-only C++ library: not in torch wheels.
    src = re.sub(r"^(\s*)torch\.ops\.load_library\(str\(lib_file_path\)\)$", r"\1pass",
                 src, flags=re.M)
    # `torch.fx.X` became `fxlite.X`: bind the name where torch is imported.
    src = re.sub(r"^import torch$", "import torch; import fxlite", src, count=1, flags=re.M)
    # Names fxlite lacks fail the tests that use them, not the whole file.
    src = re.sub(r"^from (fxlite[\w.]*) import ([\w, ]+)$", _tolerant_import, src, flags=re.M)
    assert src.count("\n") == original.count("\n")
    return src


# ---------------------------------------------------------------- the stand-in test support
def _support_module() -> types.ModuleType:
    """What the test files import from ``torch.testing._internal``, written for this runner."""
    import torch

    mod = types.ModuleType("_parity_support")

    class ParityTestCase(unittest.TestCase):
        """``assertEqual`` that compares tensors, numbers and nested containers of them."""

        def assertEqual(self, first: Any, second: Any, msg: Any = None, **_: Any) -> None:
            try:
                torch.testing.assert_close(first, second, equal_nan=True, rtol=1.3e-6,
                                           atol=1e-5, msg=msg)
                return
            except TypeError:
                pass  # not a type assert_close knows: fall back to ==
            except AssertionError:
                if _numbers_equal(first, second):
                    return
                raise
            super().assertEqual(first, second, msg)

        def assertExpectedInline(self, actual: str, expect: str, skip: int = 0) -> None:
            self.assertMultiLineEqual(expect, actual)

        def assertExpected(self, s: str, subname: str = "") -> None:  # noqa: ARG002
            raise unittest.SkipTest("expect files of torch's test suite are not available")

        @contextlib.contextmanager
        def capture_stderr(self) -> Iterator[list[str]]:
            captured = [""]
            buf = io.StringIO()
            with contextlib.redirect_stderr(buf):
                try:
                    yield captured
                finally:
                    captured[0] = buf.getvalue()

    def _numbers_equal(a: Any, b: Any) -> bool:
        num = (int, float, bool)
        return isinstance(a, num) and isinstance(b, num) and float(a) == float(b)

    def _noop_decorator_factory(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda f: f

    def _skip(reason: str) -> Any:
        def deco(f: Any) -> Any:
            return unittest.skip(reason)(f)
        return deco

    class Missing:
        """Stands for a name fxlite lacks: any use raises, failing only that test."""

        def __init__(self, name: str) -> None:
            self._name = name

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"fxlite has no {self._name}")

        def __getattr__(self, attr: str) -> Any:
            raise NotImplementedError(f"fxlite has no {self.__dict__['_name']}")

    def names(module: str, wanted: list[str]) -> list[Any]:
        mod = importlib.import_module(module)
        return [getattr(mod, n, None) or Missing(f"{module}.{n}") for n in wanted]

    mod.names = names
    mod.JitTestCase = ParityTestCase
    mod.TestCase = ParityTestCase
    mod.IS_FBCODE = False
    mod.IS_WINDOWS = sys.platform == "win32"
    mod.IS_MACOS = sys.platform == "darwin"
    mod.TEST_WITH_ROCM = False
    mod.find_library_location = lambda name: name
    mod.run_tests = lambda: None
    mod.skipIfTorchDynamo = _noop_decorator_factory
    mod.skipIfRocm = _noop_decorator_factory
    mod.skipIfNoDynamoSupport = _skip("dynamo tests are set aside")
    mod.op_db = []
    mod.ops = lambda *a, **k: (lambda f: f)
    mod.onlyCPU = lambda f: f
    mod.instantiate_device_type_tests = lambda cls, scope, **k: None
    return mod


class _OtherSuites(types.ModuleType):
    """Stands in for the other test files that test_fx.py imports (not part of this run)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})  # not a TestCase: nothing is collected


# Helper modules that tests import from test/fx/, used when saved beside the test files.
HELPERS = ("named_tup.py", "test_future.py")

# A stand-in for test/fx/named_tup.py when it is not saved (written for this runner).
_NAMED_TUP = (
    "from typing import NamedTuple\n\nimport torch\n\n\n"
    "class MyNamedTup(NamedTuple):\n    a: torch.Tensor\n    b: torch.Tensor\n"
)


def _find(tests: str, name: str) -> str:
    for path in (os.path.join(tests, name), os.path.join(tests, "fx", name)):
        if os.path.isfile(path):
            return path
    raise SystemExit(f"fx_parity: {name} not found in {tests} (nor in {tests}/fx); save "
                     "PyTorch's test file there (see the docstring of this script)")


def load_suites(tests: str, workdir: str, reference: bool = False) -> dict[str, list[unittest.TestCase]]:
    """Adapt, write and import both files; return their test cases keyed by file name."""
    fx_src = _find(tests, "test_fx.py")
    rw_src = _find(tests, "test_subgraph_rewriter.py")
    os.makedirs(os.path.join(workdir, "fx"), exist_ok=True)
    with open(os.path.join(workdir, "fx", "__init__.py"), "w") as f:
        f.write("")
    with open(os.path.join(workdir, "fx", "named_tup.py"), "w") as f:
        f.write(_NAMED_TUP)
    for helper in HELPERS:  # small helper modules of test/fx, adapted the same way if saved
        for folder in (tests, os.path.join(tests, "fx")):
            path = os.path.join(folder, helper)
            if os.path.isfile(path):
                with open(path) as f:
                    text = adapt(f.read(), reference)
                with open(os.path.join(workdir, "fx", helper), "w") as f:
                    f.write(text)
                break
    for src, dst in ((fx_src, "test_fx.py"), (rw_src, os.path.join("fx", "test_subgraph_rewriter.py"))):
        with open(src) as f:
            text = adapt(f.read(), reference)
        with open(os.path.join(workdir, dst), "w") as f:
            f.write(text)

    sys.modules["_parity_support"] = _support_module()
    sys.path.insert(0, workdir)
    importlib.invalidate_caches()
    fx_pkg = importlib.import_module("fx")
    for other in ("test_common_passes", "test_cse_pass", "test_dce_pass", "test_fx_const_fold",
                  "test_fx_param_shape_control_flow", "test_gradual_type", "test_matcher_utils",
                  "test_opaque_infrastructure", "test_pass_infra", "test_source_matcher_utils"):
        sys.modules[f"fx.{other}"] = _OtherSuites(f"fx.{other}")
        setattr(fx_pkg, other, sys.modules[f"fx.{other}"])
    module = importlib.import_module("test_fx")

    loader = unittest.TestLoader()
    by_file: dict[str, list[unittest.TestCase]] = {"test_fx.py": [], "test_subgraph_rewriter.py": []}
    for name, cls in sorted(vars(module).items()):
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)):
            continue
        if cls.__module__ == "test_fx":
            key = "test_fx.py"
        elif cls.__module__ == "fx.test_subgraph_rewriter":
            key = "test_subgraph_rewriter.py"
        else:
            continue
        if name in SET_ASIDE:
            continue
        for test in loader.loadTestsFromTestCase(cls):
            if f"{name}.{test._testMethodName}" not in SET_ASIDE:
                by_file[key].append(test)
    return by_file


class _Result(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcome: dict[str, str] = {}

    def addSuccess(self, test: unittest.TestCase) -> None:
        self.outcome[test.id()] = "pass"

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self.outcome[test.id()] = "fail"

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self.outcome[test.id()] = "error"

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self.outcome[test.id()] = "skip"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", default=os.path.join(REPO, ".parity"),
                        help="folder holding PyTorch's test_fx.py and test_subgraph_rewriter.py")
    parser.add_argument("-k", default=None, help="run only tests whose id contains this text")
    parser.add_argument("-v", action="store_true", help="print each test's outcome")
    parser.add_argument("--failures", action="store_true", help="print each failure's traceback")
    parser.add_argument("--list-set-aside", action="store_true", help="print the set-aside tests")
    parser.add_argument("--reference", action="store_true",
                        help="run the same adapted tests on torch.fx itself, to calibrate")
    args = parser.parse_args(argv)

    if args.list_set_aside:
        for name, reason in SET_ASIDE.items():
            print(f"{name}: {reason}")
        return 0

    import torch

    import fxlite

    with tempfile.TemporaryDirectory(prefix="fx_parity_") as workdir:
        suites = load_suites(args.tests, workdir, args.reference)
        totals: Counter[str] = Counter()
        subject = "torch.fx itself (--reference)" if args.reference else \
            f"fxlite from {os.path.dirname(fxlite.__file__)}"
        print(f"torch {torch.__version__}, {subject}")
        print(f"{'file':<28} {'pass':>5} {'fail':>5} {'error':>5} {'skip':>5} {'in scope':>9} {'rate':>7}")
        for file, cases in suites.items():
            if args.k:
                cases = [c for c in cases if args.k in c.id()]
            result = _Result()
            start = time.perf_counter()
            sink = io.StringIO()
            with contextlib.redirect_stdout(sink):  # the tests print graphs and code
                unittest.TestSuite(cases).run(result)  # runs setUpClass/tearDownClass too
            counts = Counter(result.outcome.values())
            scope = len(cases) - counts["skip"]
            rate = counts["pass"] / scope if scope else 1.0
            print(f"{file:<28} {counts['pass']:>5} {counts['fail']:>5} {counts['error']:>5} "
                  f"{counts['skip']:>5} {scope:>9} {rate:>7.1%}   ({time.perf_counter() - start:.1f} s)")
            totals.update(counts)
            totals["scope"] += scope
            if args.v:
                for tid, outcome in sorted(result.outcome.items()):
                    print(f"    {outcome:<5} {tid}")
            if args.failures:
                for test, tb in result.failures + result.errors:
                    print(f"\n=== {test.id()}\n{tb}")
        rate = totals["pass"] / totals["scope"] if totals["scope"] else 1.0
        print(f"{'overall':<28} {totals['pass']:>5} {totals['fail']:>5} {totals['error']:>5} "
              f"{totals['skip']:>5} {totals['scope']:>9} {rate:>7.1%}")
        print(f"set aside (not run): {len(SET_ASIDE)} entries; list them with --list-set-aside")
    return 0


if __name__ == "__main__":
    sys.exit(main())
