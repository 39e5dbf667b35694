"""Every ``meta`` key the source uses is declared once, in ``fxlite/meta_keys.py``.

The scan reads ``fxlite/``, ``passes/`` and ``codegen/`` as text (no import) and finds each
key written or read by name: ``X.meta["k"]``, ``X.meta.get("k")`` (``pop``, ``setdefault``),
``"k" in X.meta``, ``X.meta.update(k=...)`` and ``X.meta = {"k": ...}``, where ``X.meta``
may also be ``getattr(X, "meta", {})`` or a local named ``meta``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from fxlite.meta_keys import MODULE_META, NODE_META

REPO = Path(__file__).resolve().parents[2]
SOURCE = ("fxlite", "passes", "codegen")


def _key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_meta(e: ast.AST) -> bool:
    """``X.meta``, ``getattr(X, "meta", ...)``, or a variable named ``meta``."""
    if isinstance(e, ast.Attribute):
        return e.attr == "meta"
    if isinstance(e, ast.Name):
        return e.id == "meta"
    return (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "getattr"
            and len(e.args) >= 2 and _key(e.args[1]) == "meta")


def uses(tree: ast.AST) -> Iterator[tuple[str, str]]:
    """``(key, "write" | "read")`` for each use of a meta key by name in ``tree``."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and _is_meta(n.value) and _key(n.slice):
            yield _key(n.slice), "read" if isinstance(n.ctx, ast.Load) else "write"
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and _is_meta(n.func.value):
            if n.func.attr in ("get", "pop", "setdefault") and n.args and _key(n.args[0]):
                yield _key(n.args[0]), "write" if n.func.attr == "setdefault" else "read"
            elif n.func.attr == "update":
                yield from ((kw.arg, "write") for kw in n.keywords if kw.arg)
                yield from ((_key(k), "write") for a in n.args if isinstance(a, ast.Dict)
                            for k in a.keys if k is not None and _key(k))
        elif (isinstance(n, ast.Compare) and isinstance(n.ops[0], (ast.In, ast.NotIn))
              and _is_meta(n.comparators[0]) and _key(n.left)):
            yield _key(n.left), "read"
        elif isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Dict):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(_is_meta(t) for t in targets):
                yield from ((_key(k), "write") for k in n.value.keys if k is not None and _key(k))


def scan() -> dict[str, dict[str, set[str]]]:
    """key -> {"write": files, "read": files}, files relative to the repository."""
    found: dict[str, dict[str, set[str]]] = defaultdict(lambda: {"write": set(), "read": set()})
    for folder in SOURCE:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for key, how in uses(ast.parse(path.read_text(), rel)):
                found[key][how].add(rel)
    return found


def _strings(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            | {kw.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for kw in n.keywords if kw.arg})


DECLARED = {**NODE_META, **MODULE_META}


def test_every_meta_key_used_is_declared():
    found = scan()
    assert len(found) > 20  # the scan sees the source
    undeclared = sorted(set(found) - set(DECLARED))
    assert not undeclared, f"declare these in fxlite/meta_keys.py: {undeclared}"


def test_the_declared_writers_and_readers_are_complete():
    missing = []
    for key, where in scan().items():
        declared = DECLARED.get(key)
        if declared is None:
            continue  # the test above names it
        missing += [f"{key}: written by {f}" for f in sorted(where["write"] - set(declared.written_by))]
        missing += [f"{key}: read by {f}" for f in sorted(where["read"] - set(declared.read_by))]
    assert not missing, "add to fxlite/meta_keys.py:\n" + "\n".join(missing)


def test_each_declared_file_exists_and_names_the_key():
    stale = []
    for key, declared in DECLARED.items():
        assert declared.name == key and declared.type and declared.meaning, key
        for rel in {*declared.written_by, *declared.read_by}:
            path = REPO / rel
            if not path.is_file() or key not in _strings(path):
                stale.append(f"{key}: {rel}")
    assert not stale, "fxlite/meta_keys.py names files that no longer use these keys:\n" + \
        "\n".join(stale)


def test_node_and_module_keys_are_apart():
    assert not set(NODE_META) & set(MODULE_META)


def test_the_scan_finds_each_spelling():
    src = ("n.meta['a'] = 1\nn.meta.get('b')\n'c' in n.meta\nn.meta.update(d=1, **x)\n"
           "n.meta.update({'e': 1})\ng.meta = {'f': 1}\ngetattr(s, 'meta', {}).get('g')\n"
           "meta = n.meta\nmeta.pop('h')\nn.meta.setdefault('i', 0)\nother['z'] = 1\n")
    got = dict(uses(ast.parse(src)))
    assert got == {"a": "write", "b": "read", "c": "read", "d": "write", "e": "write",
                   "f": "write", "g": "read", "h": "read", "i": "write"}
