"""Saved expected outputs ("golden" files) for generated code and printed graphs.

``assert_golden("normalize_mlp", gm.code)`` compares against ``tests/golden/normalize_mlp.txt``.
After an intended change, rewrite the files with ``FXLITE_UPDATE_GOLDEN=1 pytest ...`` and
review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "golden"


def assert_golden(name: str, text: str) -> None:
    """Fail unless ``text`` equals the saved ``tests/golden/<name>.txt`` (or rewrite it)."""
    path = GOLDEN / f"{name}.txt"
    text = text.rstrip() + "\n"
    if os.environ.get("FXLITE_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        raise AssertionError(f"no golden file {path}; create it with FXLITE_UPDATE_GOLDEN=1")
    expected = path.read_text()
    assert text == expected, (f"output differs from {path} (FXLITE_UPDATE_GOLDEN=1 rewrites it)\n"
                              f"--- expected\n{expected}\n--- got\n{text}")
