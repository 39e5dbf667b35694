"""The kernel cache's promises (codegen/runtime/cache.py, codegen/runtime/binaries.py).

Where it lives, that it is private (0700 folders, 0600 files, whatever the umask), that a
folder of another user or one that group/others can write is refused with one warning
while kernels still run, that nothing planted in it runs (``__pycache__`` bytecode, a
changed source), that writes never follow a link, that damaged entries are rebuilt, that
the binary index names no path outside the folder and trusts nothing whose sha256 does
not match, and that threads and processes can share one folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import py_compile
import stat
import subprocess
import sys
import textwrap
import threading
import types
import warnings
from pathlib import Path

import pytest
import torch
from fxlite.codegen.runtime import binaries as triton_binaries
from fxlite.codegen.runtime import cache
from fxlite.codegen.runtime.kernel import generate_kernel, interpreting
from fxlite.passes.shape_prop import ShapeProp

import fxlite as fx

DEVICE = "cpu" if interpreting() else "cuda"
ROOT = Path(__file__).resolve().parents[3]
_IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
posix_only = pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX owners and modes")


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache folder (not made yet), and a process that has loaded no kernel."""
    path = tmp_path / "cache"
    monkeypatch.setenv("FXLITE_CACHE_DIR", str(path))
    monkeypatch.setattr(cache, "_MODULES", {})
    monkeypatch.setattr(cache, "_WARNED", set())
    return path


def _kernel(c: float = 1.0, n: int = 16):
    """A kernel for ``relu(x + c) * 2``, checked against eager; the constant picks the source."""
    gm = fx.symbolic_trace(lambda x: torch.relu(x + c) * 2)
    x = torch.randn(n, device=DEVICE)
    ShapeProp(gm).propagate(x)
    kernel = generate_kernel(gm, [x], name="triton_cache_test")
    assert kernel is not None
    torch.testing.assert_close(kernel(x), gm(x))
    return kernel


def _source_file(kernel) -> Path:
    folder = cache.kernel_dir()
    assert folder is not None
    return folder / f"{kernel._current.source_id}.py"


def _cache_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "kernel cache folder" in str(w.message)]


def _run(script: str, env_cache: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``script`` in a new process (on this process's device) with the cache at
    ``env_cache``; ``kernel(c)`` there makes and checks the kernel ``_kernel(c)`` makes."""
    env = dict(os.environ, FXLITE_CACHE_DIR=str(env_cache),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    prelude = textwrap.dedent(f"""
        import torch, fxlite as fx
        from fxlite.codegen.runtime.kernel import generate_kernel
        from fxlite.passes.shape_prop import ShapeProp

        def kernel(c):
            gm = fx.symbolic_trace(lambda x: torch.relu(x + c) * 2)
            x = torch.randn(16, device={DEVICE!r})
            ShapeProp(gm).propagate(x)
            k = generate_kernel(gm, [x], name="triton_cache_test")
            torch.testing.assert_close(k(x), gm(x))
            return k
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)], env=env,
                          cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------- where it lives
def test_xdg_cache_home_is_respected(tmp_path, monkeypatch):
    monkeypatch.delenv("FXLITE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(cache, "_MODULES", {})
    assert cache.cache_root() == tmp_path / "xdg" / "fxlite"
    kernel = _kernel(0.25)
    assert _source_file(kernel).parent == tmp_path / "xdg" / "fxlite" / "triton"
    assert _source_file(kernel).is_file()


def test_home_cache_when_xdg_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("FXLITE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.cache_root() == tmp_path / ".cache" / "fxlite"


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    monkeypatch.delenv("FXLITE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.cache_root() == tmp_path / ".cache" / "fxlite"


def test_fxlite_cache_dir_moves_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FXLITE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
    monkeypatch.setenv("FXLITE_CACHE_DIR", "")  # empty: unset
    assert cache.cache_root() == tmp_path / "xdg" / "fxlite"


def test_nothing_goes_to_the_temp_folder_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("FXLITE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert not str(cache.cache_root()).startswith("/tmp/fxlite-")


# ------------------------------------------------------------------------- private modes
@posix_only
@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077, 0o777])
def test_folders_are_0700_whatever_the_umask(folder, umask):
    old = os.umask(umask)
    try:
        made = cache.private_dir(folder / "a" / "b")
        cache.kernel_dir()
    finally:
        os.umask(old)
    for path in (folder, folder / "a", made, folder / "triton"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path


@posix_only
@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_files_are_0600_whatever_the_umask(folder, umask):
    old = os.umask(umask)
    try:
        kernel = _kernel(1.0 + umask / 1000)
        path = _source_file(kernel)
        cache.write_atomic(path.parent / "other.bin", b"\x00\x01")
    finally:
        os.umask(old)
    for p in (path, path.parent / "other.bin"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p


@posix_only
def test_missing_parents_are_made_private(tmp_path, monkeypatch):
    monkeypatch.setenv("FXLITE_CACHE_DIR", str(tmp_path / "p" / "q" / "cache"))
    old = os.umask(0)
    try:
        assert cache.kernel_dir() is not None
    finally:
        os.umask(old)
    for p in (tmp_path / "p", tmp_path / "p" / "q"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700


@posix_only
def test_an_own_folder_others_can_only_read_is_used(folder):
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cache.kernel_dir() == folder / "triton"
    assert not _cache_warnings(record)


# ------------------------------------------------------------------------- refused folders
def _assert_refused_once(folder: Path, named: Path) -> None:
    """Kernels run, nothing is written into ``folder``, and one warning names ``named``."""
    before = sorted(p.name for p in folder.rglob("*")) if folder.is_dir() else None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        kernels = [_kernel(2.0 + i / 8) for i in range(3)]
    found = _cache_warnings(record)
    assert len(found) == 1, found
    assert str(named) in found[0] and "\n" not in found[0]
    assert all(k._current.source_id for k in kernels)
    assert cache.kernel_dir() is None
    if before is not None:
        assert sorted(p.name for p in folder.rglob("*")) == before


@posix_only
@pytest.mark.skipif(not _IS_ROOT, reason="chown to another user needs root")
def test_a_folder_of_another_user_is_refused(folder):
    folder.mkdir(mode=0o700)
    os.chown(folder, 12345, 12345)
    _assert_refused_once(folder, folder)


@posix_only
def test_a_folder_of_another_uid_is_refused_simulated(folder, monkeypatch):
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(folder).st_uid + 1)
    _assert_refused_once(folder, folder)


@posix_only
@pytest.mark.parametrize("mode", [0o770, 0o720, 0o707, 0o702, 0o777, 0o1777])
def test_a_folder_group_or_others_can_write_is_refused(folder, mode):
    folder.mkdir()
    os.chmod(folder, mode)
    _assert_refused_once(folder, folder)


@posix_only
def test_a_writable_subfolder_is_refused(folder):
    (folder / "triton").mkdir(parents=True)
    os.chmod(folder, 0o700)
    os.chmod(folder / "triton", 0o777)
    _assert_refused_once(folder, folder)


@posix_only
@pytest.mark.skipif(not _IS_ROOT, reason="chown to another user needs root")
def test_a_link_to_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    link = tmp_path / "cache"
    link.symlink_to(theirs)
    monkeypatch.setenv("FXLITE_CACHE_DIR", str(link))
    monkeypatch.setattr(cache, "_MODULES", {})
    monkeypatch.setattr(cache, "_WARNED", set())
    _assert_refused_once(theirs, theirs)


def test_a_file_in_the_way_is_refused_with_the_folder_named(folder):
    folder.write_text("not a folder")
    _assert_refused_once(folder, folder)


def test_a_folder_that_cannot_be_made_is_refused_with_the_folder_named(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "cache"
    monkeypatch.setenv("FXLITE_CACHE_DIR", str(path))
    monkeypatch.setattr(cache, "_MODULES", {})
    monkeypatch.setattr(cache, "_WARNED", set())
    _assert_refused_once(path, path)


@posix_only
def test_an_in_memory_kernel_keeps_its_source_for_tracebacks(folder):
    import inspect
    import linecache

    folder.mkdir()
    os.chmod(folder, 0o777)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernel = _kernel(3.5)
    module = cache._MODULES[kernel._current.source_id]
    assert module.__file__.startswith("<") and linecache.getlines(module.__file__)
    fn = next(iter(kernel._current.fns.values()))
    assert "tl.store" in inspect.getsource(fn.fn)


# ------------------------------------------------------------------------- nothing planted runs
def _plant_pyc(source: Path, sentinel: Path) -> Path:
    """Bytecode in ``__pycache__`` that Python's import would prefer over ``source``."""
    evil = source.with_name("evil_src.py")
    evil.write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    pyc = Path(importlib.util.cache_from_source(str(source)))
    pyc.parent.mkdir(exist_ok=True)
    py_compile.compile(str(evil), cfile=str(pyc), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    evil.unlink()
    return pyc


def test_planted_bytecode_never_runs(folder, tmp_path, monkeypatch):
    source = _source_file(_kernel(4.0))
    sentinel = tmp_path / "sentinel"
    _plant_pyc(source, sentinel)
    monkeypatch.setattr(cache, "_MODULES", {})  # as a new process: load it again
    _kernel(4.0)
    assert not sentinel.exists()


def test_planted_bytecode_never_runs_in_the_next_process(folder, tmp_path):
    source = _source_file(_kernel(4.5))
    sentinel = tmp_path / "sentinel"
    _plant_pyc(source, sentinel)
    done = _run("kernel(4.5); print('ok')", folder)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
    assert not sentinel.exists()


def test_kernels_are_never_imported_and_leave_no_bytecode(folder, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel went through the import machinery")

    monkeypatch.setattr(importlib.util, "spec_from_file_location", refuse)
    kernel = _kernel(5.0)
    assert kernel._current.source_id not in sys.modules
    assert not list(folder.rglob("__pycache__")) and not list(folder.rglob("*.pyc"))


def test_a_changed_source_file_never_runs_and_is_rewritten(folder, tmp_path, monkeypatch):
    kernel = _kernel(5.5)
    source = _source_file(kernel)
    good = source.read_text()
    sentinel = tmp_path / "sentinel"
    source.write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n" + good)
    monkeypatch.setattr(cache, "_MODULES", {})
    _kernel(5.5)
    assert not sentinel.exists()
    assert source.read_text() == good


def test_the_file_name_carries_the_sources_sha256(folder):
    kernel = _kernel(6.0)
    source = _source_file(kernel)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    assert source.stem.endswith(digest[:32])


# ------------------------------------------------------------------------- writes and links
@posix_only
def test_a_link_at_the_temp_name_is_not_followed(folder, tmp_path, monkeypatch):
    target = tmp_path / "victim"
    target.write_text("precious")
    path = cache.kernel_dir() / "entry.json"
    monkeypatch.setattr(cache.secrets, "token_hex", lambda n: "guessed")
    (path.parent / ".entry.json.guessed.tmp").symlink_to(target)
    with pytest.raises(OSError):
        cache.write_atomic(path, "new")
    assert target.read_text() == "precious" and not path.exists()


@posix_only
def test_a_link_at_the_temp_name_does_not_stop_the_kernel(folder, tmp_path, monkeypatch):
    target = tmp_path / "victim"
    target.write_text("precious")
    folder_ = cache.kernel_dir()
    monkeypatch.setattr(cache.secrets, "token_hex", lambda n: "guessed")
    real = cache.write_atomic

    def plant_then_write(path: Path, data) -> None:
        (path.parent / f".{path.name}.guessed.tmp").symlink_to(target)
        real(path, data)

    monkeypatch.setattr(cache, "write_atomic", plant_then_write)
    kernel = _kernel(6.5)
    assert target.read_text() == "precious"
    assert cache._MODULES[kernel._current.source_id].__file__.startswith("<")
    assert folder_ is not None


@posix_only
def test_a_link_at_the_kernel_file_is_replaced_not_followed(folder, tmp_path):
    kernel = _kernel(7.0)
    source = _source_file(kernel)
    good = source.read_text()
    target = tmp_path / "victim"
    target.write_text("precious")
    source.unlink()
    source.symlink_to(target)
    cache._MODULES.clear()
    _kernel(7.0)
    assert target.read_text() == "precious"
    assert not source.is_symlink() and source.read_text() == good


@posix_only
def test_read_file_does_not_follow_links(tmp_path):
    (tmp_path / "real").write_bytes(b"data")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert cache.read_file(tmp_path / "real") == b"data"
    assert cache.read_file(tmp_path / "link") is None
    assert cache.read_file(tmp_path) is None and cache.read_file(tmp_path / "missing") is None


def test_write_atomic_leaves_no_temp_file(tmp_path):
    cache.write_atomic(tmp_path / "a", "one")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x").write_text("")
    with pytest.raises(OSError):  # a non-empty folder in the way: os.replace fails
        cache.write_atomic(tmp_path / "dir", "two")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "dir"]
    assert (tmp_path / "a").read_text() == "one"


# ------------------------------------------------------------------------- damaged entries
_DAMAGE = {
    "syntax error": lambda p: p.write_text("def broken(:\n"),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:40]),
    "empty": lambda p: p.write_bytes(b""),
    "not utf-8": lambda p: p.write_bytes(b"\xff\xfe\x00garbage"),
    "hash mismatch": lambda p: p.write_text(p.read_text().replace("2.0", "3.0")),
    "raises": lambda p: p.write_text("raise RuntimeError('damaged')\n"),
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_a_damaged_source_is_rebuilt(folder, damage):
    c = 8.0 + list(_DAMAGE).index(damage) / 8
    source = _source_file(_kernel(c))
    good = source.read_text()
    _DAMAGE[damage](source)
    cache._MODULES.clear()
    _kernel(c)  # checked against eager
    assert source.read_text() == good


def test_an_unreadable_entry_is_rebuilt(folder, monkeypatch):
    source = _source_file(_kernel(9.0))
    good = source.read_text()
    os.chmod(source, 0)
    real_open = os.open

    def no_read(path, flags, *args):  # mode 0 does not stop root: refuse reads here too
        if Path(path) == source and not flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_read)
    cache._MODULES.clear()
    _kernel(9.0)
    monkeypatch.setattr(os, "open", real_open)
    assert source.read_text() == good and stat.S_IMODE(os.stat(source).st_mode) == 0o600


def test_a_folder_in_place_of_an_entry_does_not_stop_the_kernel(folder):
    source = _source_file(_kernel(9.5))
    source.unlink()
    (source / "x").mkdir(parents=True)  # os.replace cannot replace it
    cache._MODULES.clear()
    kernel = _kernel(9.5)
    assert cache._MODULES[kernel._current.source_id].__file__.startswith("<")


def test_damaged_entries_work_and_are_rebuilt_in_the_next_process(folder):
    sources = [_source_file(_kernel(10.0 + i)) for i in range(3)]
    good = [s.read_text() for s in sources]
    sources[0].write_text("def broken(:\n")
    sources[1].write_bytes(b"")
    sources[2].write_text(good[2].replace("2.0", "5.0"))
    done = _run("for i in range(3): kernel(10.0 + i)\nprint('ok')", folder)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
    assert [s.read_text() for s in sources] == good


# ------------------------------------------------------------------------- the binary index
class _FakeCompiledKernel:
    """Stands in for Triton's CompiledKernel, which needs a GPU target to load."""

    def __init__(self, src, metadata_group, hash):
        self.src, self.metadata_group, self.hash = src, metadata_group, hash
        self.files = {k: Path(p).read_bytes() for k, p in metadata_group.items()}


@pytest.fixture
def binaries(folder, tmp_path, monkeypatch):
    """A cache folder, and a compiled kernel as Triton's cache would describe it."""
    import triton.compiler.compiler as triton_compiler

    monkeypatch.setattr(triton_compiler, "CompiledKernel", _FakeCompiledKernel)
    triton_cache = tmp_path / "triton-cache"
    triton_cache.mkdir()
    files = {"k.json": b'{"name": "k"}', "k.cubin": b"\x7fELF binary", "k.ptx": b"// ptx"}
    for name, data in files.items():
        (triton_cache / name).write_bytes(data)
    compiled = types.SimpleNamespace(
        hash="h" * 64, metadata_group={n: str(triton_cache / n) for n in files},
        asm={"cubin": files["k.cubin"], "ptx": files["k.ptx"].decode(), "json": "{}"},
        src=types.SimpleNamespace(signature={"x": "*fp32", "n": "i32"}, constants={(1,): 16}))
    return cache.kernel_dir(), compiled, files


def _index(kdir: Path, key: str) -> dict:
    return json.loads((kdir / "binaries" / f"{key}.json").read_text())


def test_a_saved_binary_loads_from_copies_inside_the_cache(binaries):
    kdir, compiled, files = binaries
    triton_binaries.save_binary(kdir, "k1", compiled, checked=True)
    loaded, checked = triton_binaries.load_binary(kdir, "k1", fn=None)
    assert checked is True
    assert set(loaded.metadata_group) == {"k.json", "k.cubin"}  # not the IR files
    for name, path in loaded.metadata_group.items():
        assert Path(path).parent == kdir / "binaries" / "files"
        assert loaded.files[name] == files[name]
    assert loaded.src.signature == {"x": "*fp32", "n": "i32"}
    assert loaded.src.constants == {(1,): 16}
    assert "metadata_group" not in _index(kdir, "k1")  # the index holds no paths


@posix_only
def test_binary_files_are_private(binaries):
    kdir, compiled, _ = binaries
    old = os.umask(0)
    try:
        triton_binaries.save_binary(kdir, "k1", compiled)
    finally:
        os.umask(old)
    for p in (kdir / "binaries", kdir / "binaries" / "files"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p
    for p in [*(kdir / "binaries").glob("*.json"), *(kdir / "binaries" / "files").iterdir()]:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p


def test_a_binary_whose_hash_does_not_match_is_refused_and_rebuilt(binaries):
    kdir, compiled, files = binaries
    triton_binaries.save_binary(kdir, "k1", compiled, checked=True)
    digest = _index(kdir, "k1")["files"]["k.cubin"]
    blob = kdir / "binaries" / "files" / f"{digest}.cubin"
    blob.write_bytes(b"\x7fELF tampered")
    assert triton_binaries.load_binary(kdir, "k1", fn=None) is None  # checked or not
    triton_binaries.save_binary(kdir, "k1", compiled)  # what the next compile does
    assert blob.read_bytes() == files["k.cubin"]
    assert triton_binaries.load_binary(kdir, "k1", fn=None) is not None


def test_a_checked_flag_counts_only_with_matching_hashes(binaries):
    kdir, compiled, _ = binaries
    triton_binaries.save_binary(kdir, "k1", compiled, checked=False)
    entry = _index(kdir, "k1")
    entry["checked"] = True
    entry["files"]["k.cubin"] = hashlib.sha256(b"another binary").hexdigest()
    (kdir / "binaries" / "k1.json").write_text(json.dumps(entry))
    assert triton_binaries.load_binary(kdir, "k1", fn=None) is None


def test_a_checked_flag_must_be_exactly_true(binaries):
    kdir, compiled, _ = binaries
    triton_binaries.save_binary(kdir, "k1", compiled)
    entry = _index(kdir, "k1")
    entry["checked"] = "yes"
    (kdir / "binaries" / "k1.json").write_text(json.dumps(entry))
    assert triton_binaries.load_binary(kdir, "k1", fn=None)[1] is False


@pytest.mark.parametrize("entry", [
    # the old format: absolute paths anywhere on disk
    lambda tmp, d: {"hash": "h", "metadata_group": {"k.json": str(tmp / "outside.json")},
                    "signature": [], "constants": [], "checked": True},
    lambda tmp, d: {"hash": "h", "files": {"../../outside.json": d}, "signature": [],
                    "constants": [], "checked": True},
    lambda tmp, d: {"hash": "h", "files": {"k.json": "../../../outside"}, "signature": [],
                    "constants": [], "checked": True},
    lambda tmp, d: {"hash": "h", "files": {"k.json": str(tmp / "outside.json")},
                    "signature": [], "constants": [], "checked": True},
    lambda tmp, d: {"hash": "h", "files": {"k/../../x.json": d}, "signature": [],
                    "constants": [], "checked": True},
    lambda tmp, d: {"hash": "h", "files": {"k.json/..": d}, "signature": [],
                    "constants": [], "checked": True},
], ids=["absolute-paths", "dotdot-name", "dotdot-digest", "absolute-digest", "slash-name",
        "dotdot-suffix"])
def test_an_index_entry_pointing_outside_the_cache_is_refused(binaries, tmp_path, entry):
    kdir, _, _ = binaries
    outside = tmp_path / "outside.json"
    outside.write_bytes(b'{"name": "planted"}')
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    (kdir / "binaries").mkdir(mode=0o700, exist_ok=True)
    (kdir / "binaries" / "k1.json").write_text(json.dumps(entry(tmp_path, digest)))
    assert triton_binaries.load_binary(kdir, "k1", fn=None) is None


@posix_only
def test_a_binary_linked_to_a_file_outside_is_refused(binaries, tmp_path):
    kdir, compiled, files = binaries
    triton_binaries.save_binary(kdir, "k1", compiled)
    digest = _index(kdir, "k1")["files"]["k.cubin"]
    blob = kdir / "binaries" / "files" / f"{digest}.cubin"
    outside = tmp_path / "outside.cubin"
    outside.write_bytes(files["k.cubin"])  # even with the right content
    blob.unlink()
    blob.symlink_to(outside)
    assert triton_binaries.load_binary(kdir, "k1", fn=None) is None


@pytest.mark.parametrize("text", ["", "{", "[]", '{"files": 3}', "null", '{"files": {}}'])
def test_a_damaged_index_entry_is_refused_and_rewritten(binaries, text):
    kdir, compiled, _ = binaries
    triton_binaries.save_binary(kdir, "k1", compiled, checked=True)
    (kdir / "binaries" / "k1.json").write_text(text)
    assert triton_binaries.load_binary(kdir, "k1", fn=None) is None
    triton_binaries.save_binary(kdir, "k1", compiled)
    assert triton_binaries.load_binary(kdir, "k1", fn=None) is not None


def test_no_cache_folder_means_no_index(binaries):
    _, compiled, _ = binaries
    triton_binaries.save_binary(None, "k1", compiled)
    assert triton_binaries.load_binary(None, "k1", fn=None) is None
    assert not triton_binaries.has_binary(None, "k1")


# ------------------------------------------------------------------------- threads and processes
def test_four_threads_compile_into_one_cache(folder):
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(3):
                _kernel(20.0 + (i + j) % 4)  # the threads share sources, and each makes some
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    sources = sorted(cache.kernel_dir().glob("*.py"))
    assert len(sources) == 4
    assert not list(cache.kernel_dir().glob(".*.tmp"))


def test_two_processes_compile_into_one_cache(folder):
    script = "for i in range(4): kernel(30.0 + i)\nprint('ok')"
    outs: list[subprocess.CompletedProcess] = []
    lock = threading.Lock()

    def run_one() -> None:  # both processes start before either ends
        done = _run(script, folder)
        with lock:
            outs.append(done)

    procs = [threading.Thread(target=run_one) for _ in range(2)]
    for t in procs:
        t.start()
    for t in procs:
        t.join()
    assert len(outs) == 2
    for done in outs:
        assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
    sources = sorted(cache.kernel_dir().glob("*.py"))
    assert len(sources) == 4
    for s in sources:
        compile(s.read_text(), str(s), "exec")  # whole files, never a mix
    assert not list(cache.kernel_dir().glob(".*.tmp"))


def test_concurrent_writes_of_one_file_never_mix(tmp_path):
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    path = tmp_path / "f"
    threads = [threading.Thread(target=cache.write_atomic, args=(path, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_bytes() in payloads
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


# ------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_a_real_binary_is_indexed_inside_the_cache_and_loads_in_the_next_process(folder):
    kernel = _kernel(40.0, n=1000)
    kdir = cache.kernel_dir()
    entries = sorted((kdir / "binaries").glob("*.json"))
    assert len(entries) == 1
    record = json.loads(entries[0].read_text())
    assert {Path(n).suffix for n in record["files"]} == {".json", ".cubin"}
    for name, digest in record["files"].items():
        blob = kdir / "binaries" / "files" / f"{digest}{Path(name).suffix}"
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest
    done = _run(f"""
        from fxlite.codegen import cache, triton_binaries
        k = kernel(40.0)
        fn = next(iter(k._current.fns.values()))
        found = triton_binaries.load_binary(cache.kernel_dir(), {entries[0].stem!r}, fn)
        assert found is not None
        assert all(str(cache.kernel_dir()) in p for p in found[0].metadata_group.values())
        print("ok")
    """, folder)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
    assert kernel is not None
