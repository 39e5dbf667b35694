"""Shared pytest setup: import paths, the Triton interpreter on CPU-only machines, a
fresh fxlite cache folder, a fixed random seed, and the ``gpu`` marker.

CI installs the package in editable mode (``pip install -e .``). So that a plain
``pytest`` from a fresh checkout works too, the checkout is put on ``sys.path`` when no
installation provides fxlite.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Without a GPU, generated kernels run through Triton's interpreter. It must be chosen
# before anything imports triton, so it is set here, ahead of every test module.
if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Kernel sources, binaries and shape records go to a fresh folder per run: a test must
# not pass because of what an earlier run left behind.
if not os.environ.get("FXLITE_CACHE_DIR"):
    os.environ["FXLITE_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxlite-tests-")

# On a GPU, compiled segments race their recorded ops before keeping the faster side
# (codegen/runtime/trial.py, tested in test_trial.py): tests check what the kernels do.
os.environ.setdefault("FXLITE_TRIAL", "0")

ROOT = Path(__file__).resolve().parent.parent
# A checkout that is not installed: put it on the path. fxlite itself then maps the
# folders passes/ and codegen/ to fxlite.passes and fxlite.codegen (fxlite/__init__.py).
if importlib.util.find_spec("fxlite") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tests sit in folders that mirror the code, and share helpers by module name (`_golden`,
# `faithful_harness`, `from test_compile import FakeKernel`): every test folder is importable.
_TESTS = Path(__file__).resolve().parent
for _folder in [_TESTS, *sorted(p for p in _TESTS.rglob("*") if p.is_dir()
                                and p.name not in ("golden", "__pycache__"))]:
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when none is available")
    config.addinivalue_line("markers", "slow: a deliberately large test")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The program fuzzer's counts and op coverage (tests/fuzz/), when it ran."""
    check = sys.modules.get("fuzz_check")
    if check is not None and check.STATS:
        terminalreporter.write_line(check.summary())


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state, so failures reproduce."""
    torch.manual_seed(0)
