"""Old module paths of the internals moved by issue 37 still import, for one release, with a
DeprecationWarning that names the new path (fxlite/_moved.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from fxlite._moved import MOVED

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_new_module_and_says_where_it_went(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)


def test_no_old_path_is_a_file_any_more() -> None:
    for old in MOVED:
        parts = old.split(".")[1:]
        root = {"codegen": "codegen", "passes": "passes"}.get(parts[0], None)
        folder = REPO / root if root else REPO / "fxlite"
        rest = parts[1:] if root else parts
        assert not (folder.joinpath(*rest).with_suffix(".py")).exists(), old


def test_importing_fxlite_still_imports_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", "import fxlite, sys; print('torch' in sys.modules)"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"
