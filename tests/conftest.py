"""Shared pytest setup: import paths, the Triton interpreter on CPU-only machines, a
fixed random seed, and the ``gpu`` marker.

CI installs the package in editable mode (``pip install -e .``), which maps the folders
``passes/`` and ``codegen/`` to ``fxlite.passes`` and ``fxlite.codegen``. So that a plain
``pytest`` from a fresh checkout works too, the same mapping is added here as a fallback
finder, consulted only when no installation provides those packages.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, generated kernels run through Triton's interpreter. It must be chosen
# before anything imports triton, so it is set here, ahead of every test module.
if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parent.parent
_FOLDERS = {"fxlite.passes": ROOT / "passes", "fxlite.codegen": ROOT / "codegen"}


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``fxlite.passes`` and ``fxlite.codegen`` in their source folders."""

    def find_spec(self, name: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        folder = _FOLDERS.get(name)
        if folder is None or not (folder / "__init__.py").exists():
            return None
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)])


def _install_source_tree_imports() -> None:
    if importlib.util.find_spec("fxlite") is None and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    # Appended last: an installation's own finder, when there is one, answers first.
    sys.meta_path.append(_SourceTreeFinder())


_install_source_tree_imports()


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


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state, so failures reproduce."""
    torch.manual_seed(0)
