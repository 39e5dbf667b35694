"""The layout of issue 37, measured from the code's own imports: no import circles, few
imports hidden inside functions (each with a reason), few imports of another module's
private names, and a short codegen/ top level.

Every import of a project module counts: at the top, inside functions, and under
``TYPE_CHECKING``. ``python tests/docs/test_layout.py -v`` prints the lists.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"fxlite": REPO / "fxlite", "fxlite.passes": REPO / "passes",
            "fxlite.codegen": REPO / "codegen"}
MAX_IN_FUNCTION = 25
MAX_PRIVATE = 10
MAX_CODEGEN_FILES = 12


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(project module, imported name or None) for each name an import statement binds."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        if MODULES[module].name != "__init__.py":
            parts.pop()
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, base] if base else parts)
    return [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in MODULES else (base, a.name)
            for a in node.names]


def _project(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


class Imports:
    """The import graph of fxlite's modules, with the in-function and private imports."""

    def __init__(self) -> None:
        self.graph = nx.DiGraph()
        self.in_function: list[tuple[str, int, str]] = []  # module, line, source line
        self.private: list[tuple[str, int, str]] = []  # module, line, imported name
        for module, path in MODULES.items():
            self.graph.add_node(module)
            source = path.read_text()
            lines = source.splitlines()
            tree = ast.parse(source)
            self._walk(module, tree, lines, in_function=False)

    def _walk(self, module: str, node: ast.AST, lines: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                self._add(module, child, lines, in_function)
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            self._walk(module, child, lines, inner)

    def _add(self, module: str, node: ast.Import | ast.ImportFrom, lines: list[str],
             in_function: bool) -> None:
        project = False
        for target, name in _targets(module, node):
            owner = _project(target)
            if owner is None:
                continue
            project = True
            if owner != module:
                self.graph.add_edge(module, owner)
                if name and name.startswith("_") and not name.startswith("__"):
                    self.private.append((module, node.lineno, f"{owner}.{name}"))
        if project and in_function:
            self.in_function.append((module, node.lineno, lines[node.lineno - 1].strip()))

    def circles(self) -> list[list[str]]:
        return [sorted(c) for c in nx.strongly_connected_components(self.graph) if len(c) > 1]


def _reason(module: str, line: int) -> bool:
    """An in-function import says why: a comment on its line or on the line above."""
    lines = MODULES[module].read_text().splitlines()
    return "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")


IMPORTS = Imports()


def test_no_import_circles() -> None:
    assert IMPORTS.circles() == []


def test_few_imports_inside_functions_and_each_says_why() -> None:
    assert len(IMPORTS.in_function) <= MAX_IN_FUNCTION, IMPORTS.in_function
    assert [x for x in IMPORTS.in_function if not _reason(x[0], x[1])] == []


def test_few_imports_of_private_names() -> None:
    assert len(IMPORTS.private) <= MAX_PRIVATE, IMPORTS.private


def test_codegen_top_level_is_short() -> None:
    files = [p for p in (REPO / "codegen").iterdir() if p.suffix == ".py"]
    assert len(files) <= MAX_CODEGEN_FILES, sorted(p.name for p in files)


def _layer(module: str) -> int:
    """0: the core (fxlite's own modules), 1: passes, 2: the compiler; 3: the package, its
    command line and the finder of old paths, which sit above everything."""
    if module in ("fxlite", "fxlite.__main__", "fxlite._moved") or module.startswith("fxlite.cli"):
        return 3
    if module == "fxlite.codegen" or module.startswith("fxlite.codegen."):
        return 2
    return 1 if module == "fxlite.passes" or module.startswith("fxlite.passes.") else 0


def test_the_core_imports_nothing_above_it() -> None:
    # DESIGN.md: fxlite/ imports nothing from passes/ or codegen/, and passes/ nothing from
    # codegen/.
    upward = [(a, b) for a, b in IMPORTS.graph.edges if _layer(a) < _layer(b) <= 2]
    assert upward == []


if __name__ == "__main__":
    print(f"modules {len(MODULES)}, circles {len(IMPORTS.circles())}, "
          f"in-function {len(IMPORTS.in_function)}, private {len(IMPORTS.private)}")
    if "-v" in sys.argv:
        for circle in IMPORTS.circles():
            print("circle", circle)
        for item in IMPORTS.in_function:
            print("in function", *item, "" if _reason(item[0], item[1]) else "(no reason)")
        for item in IMPORTS.private:
            print("private", *item)
