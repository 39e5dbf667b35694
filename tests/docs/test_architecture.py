"""ARCHITECTURE.md's layout tree names every source file, and only files that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("fxlite", "passes", "codegen")


def _tree() -> set[str]:
    """The paths the layout block of ARCHITECTURE.md names (two spaces per level)."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    block = text.split("## The layout, one line per file", 1)[1].split("```")[1]
    paths: set[str] = set()
    stack: list[str] = []
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        if not m:
            continue
        depth, name = len(m.group(1)) // 2, m.group(2)
        stack = stack[:depth]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
        else:
            paths.add("/".join([*stack, name]))
    return paths


def test_the_layout_names_every_source_file_and_no_other() -> None:
    files = {str(p.relative_to(REPO)) for root in ROOTS for p in (REPO / root).rglob("*.py")
             if "__pycache__" not in p.parts}
    named = _tree()
    assert sorted(files - named) == [], "files ARCHITECTURE.md does not name"
    assert sorted(named - files) == [], "ARCHITECTURE.md names files that do not exist"
