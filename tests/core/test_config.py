"""Every ``FXLITE_*`` variable is listed in ``fxlite/config.py`` and read only there.

The source (``fxlite/``, ``passes/``, ``codegen/``) is read as text, not imported: a string
that is exactly a variable's name (``os.environ.get("FXLITE_...")``) anywhere but in
``fxlite/config.py`` is a read the config module does not know of.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from fxlite import config

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"FXLITE_[A-Z0-9_]+")
SOURCE = ("fxlite", "passes", "codegen")


def _files(*folders: str, suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    return [p for folder in folders for p in sorted((REPO / folder).rglob("*"))
            if p.suffix in suffixes and p.is_file()]


def test_no_variable_is_read_outside_the_config_module():
    reads = []
    for path in _files(*SOURCE):
        if path == REPO / "fxlite" / "config.py":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAME.fullmatch(n.value):
                reads.append(f"{path.relative_to(REPO)}:{n.lineno}: {n.value}")
    assert not reads, "read these through fxlite.config:\n" + "\n".join(reads)


def test_every_variable_named_anywhere_is_in_the_tables():
    known = set(config.VARIABLES) | set(config.TEST_VARIABLES)
    named = {}
    for path in _files(*SOURCE, "tests", "benchmarks", "notebooks",
                       suffixes=(".py", ".md", ".ipynb", ".cfg")) + sorted(REPO.glob("*.md")):
        for name in NAME.findall(path.read_text()):
            named.setdefault(name, path.relative_to(REPO).as_posix())
    missing = {name: where for name, where in named.items() if name not in known}
    assert not missing, f"list these in fxlite/config.py (name: a file naming it): {missing}"
    assert set(config.VARIABLES) <= set(named)  # the scan sees the source


def test_each_library_variable_has_an_accessor_and_a_row():
    tree = ast.parse((REPO / "fxlite" / "config.py").read_text())
    in_functions = {n.value for f in tree.body if isinstance(f, ast.FunctionDef)
                    for n in ast.walk(f) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    doc = config.__doc__ or ""
    for name, var in config.VARIABLES.items():
        assert var.name == name and var.meaning and var.read_by
        assert name in in_functions, f"{name} has no accessor"
        assert re.search(rf"^{name}\s", doc, re.M), f"{name} is not in the module's table"
        assert (REPO / var.read_by.split()[0]).is_file(), var.read_by
    assert not set(config.VARIABLES) & set(config.TEST_VARIABLES)


UNSET = object()


@pytest.mark.parametrize("value", [UNSET, "", "0", "1", "yes"])
def test_the_accessors_read_as_the_code_before_them(monkeypatch, value):
    """Each accessor against the expression it replaced, on every kind of value."""
    for name in config.VARIABLES:
        if value is UNSET:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    env = os.environ
    assert config.cache_dir() == env.get("FXLITE_CACHE_DIR")
    for default in (True, False):
        assert config.channels_last(default) == (
            env.get("FXLITE_CHANNELS_LAST", "1" if default else "0") == "1")
    assert config.direct_launch() == (not env.get("FXLITE_DIRECT_LAUNCH") == "0")
    assert config.fused_optimizer() == (env.get("FXLITE_FUSED_OPTIMIZER") != "0")
    assert config.lint() == (env.get("FXLITE_LINT", "0") not in ("", "0"))
    assert config.logs() == env.get("FXLITE_LOGS", "")
    forced = env.get("FXLITE_PROGRESS", "")
    assert config.progress() == (True if forced == "1" else False if forced == "0" else None)
    assert config.regions() == (env.get("FXLITE_REGIONS", "1") != "0")
    assert config.static_launch() == (not env.get("FXLITE_STATIC_LAUNCH") == "0")
    assert config.trial() == (env.get("FXLITE_TRIAL") != "0")
    assert config.triton_specialize() == (env.get("FXLITE_TRITON_SPECIALIZE", "1") != "0")
