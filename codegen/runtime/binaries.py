"""An on-disk index of compiled kernel binaries, so a new process skips Triton's JIT.

Why: before Triton's JIT can look a kernel up in its own cache, it hashes Triton's
installed sources once per process (about 0.35 s on an H200 host) and imports its
compiler stack. A kernel fxlite has compiled before is fully described by its source,
its launch configuration and its arguments' types, alignments and integer values, so
fxlite keeps a copy of the binary and loads it from there directly.

Under ``$FXLITE_CACHE_DIR/triton/binaries`` (see ``cache``), each entry ``<key>.json``
names its files by sha256; the files themselves (Triton's metadata JSON and the binary,
copied out of Triton's cache) are stored as ``files/<sha256><suffix>`` below it. The
index holds no paths: every file it names lies in that folder by construction, and is
read (never through a link) and hashed before it is used. The entry also records whether
the binary's output has matched eager PyTorch, so that a new process need not run the
eager reference again; that flag counts only when every file matches its hash.

Loading is best-effort: a missing or damaged entry or file, another Triton version or
any error means the normal JIT path runs, and saving its result rewrites the entry.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from fxlite.codegen.runtime.cache import private_dir, read_file, write_atomic

__all__ = ["binary_key", "has_binary", "load_binary", "save_binary"]


def binary_key(source_id: str, variant: str, args: Sequence[Any], constexprs: dict[str, Any],
               num_warps: int) -> str:
    """What a compiled binary depends on: Triton specializes on all of these.

    ``source_id`` names the kernel source (its module name, which holds a digest of the
    text), so the source itself is not re-hashed on every launch that reaches here.
    """
    import triton  # Triton's import cost: only once a kernel launches

    parts: list[Any] = [triton.__version__, source_id, variant, num_warps,
                        sorted(constexprs.items())]
    for a in args:
        if isinstance(a, torch.Tensor):
            arch = torch.cuda.get_device_capability(a.device) if a.is_cuda else a.device.type
            parts.append((str(a.dtype), a.data_ptr() % 16 == 0, arch))
        elif isinstance(a, bool) or isinstance(a, int):
            parts.append(a)  # exact: Triton specializes on 1, on multiples of 16, and on range
        else:
            parts.append(type(a).__name__)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


_DIGEST = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_SUFFIX = re.compile(r"\.[A-Za-z0-9_]{1,16}")


def _entry(cache_dir: Path, key: str) -> Path:
    return cache_dir / "binaries" / f"{key}.json"


def _blob(cache_dir: Path, name: str, digest: str) -> Path:
    """Where the file ``name`` (``triton_add.cubin``) with sha256 ``digest`` is kept.

    Raises:
        ValueError: a name or digest that could make a path leave the folder.
    """
    suffix = Path(name).suffix
    if not (_NAME.fullmatch(name) and _SUFFIX.fullmatch(suffix) and _DIGEST.fullmatch(digest)):
        raise ValueError(f"not a binary file of the index: {name!r} {digest!r}")
    return cache_dir / "binaries" / "files" / f"{digest}{suffix}"


def has_binary(cache_dir: Path | None, key: str) -> bool:
    """Whether the index has a record under ``key`` (:func:`load_binary` may still find
    it damaged, and then the launch compiles)."""
    return cache_dir is not None and _entry(cache_dir, key).exists()


def save_binary(cache_dir: Path | None, key: str, compiled: Any, checked: bool = False) -> None:
    """Copy ``compiled`` (a CompiledKernel) into the cache and index it under ``key``.

    Only what loading needs is copied: Triton's metadata JSON and the binary (the IR
    files stay in Triton's cache). ``checked``: the binary's output has matched eager
    PyTorch (see :func:`load_binary`). ``cache_dir`` None (no usable cache folder): nothing.
    """
    if cache_dir is None:
        return
    try:
        files = {}
        for name, path in compiled.metadata_group.items():
            ext = Path(name).suffix[1:]
            if ext == "json" or isinstance(compiled.asm.get(ext), bytes):  # the binary
                with open(path, "rb") as f:
                    files[name] = f.read()
        record = {"hash": compiled.hash,
                  "files": {n: hashlib.sha256(b).hexdigest() for n, b in files.items()},
                  "signature": list(compiled.src.signature.items()),
                  "constants": [[list(k) if isinstance(k, tuple) else k, v]
                                for k, v in compiled.src.constants.items()],
                  "checked": bool(checked)}
        text = json.dumps(record)
        blobs = {_blob(cache_dir, n, record["files"][n]): b for n, b in files.items()}
    except Exception:  # an unexpected Triton version or value: just don't cache it
        return
    try:
        private_dir(private_dir(cache_dir / "binaries") / "files")
        for path, data in blobs.items():
            if read_file(path) != data:  # missing or damaged
                write_atomic(path, data)
        write_atomic(_entry(cache_dir, key), text)
    except OSError:  # a read-only or full cache folder: the index is only an optimization
        pass


def load_binary(cache_dir: Path | None, key: str, fn: Any) -> tuple[Any, bool] | None:
    """The CompiledKernel recorded under ``key`` for the JIT function ``fn``, or None.

    Returns ``(compiled, checked)``: ``checked`` says that this binary's output matched
    eager PyTorch in an earlier process, so fxlite.compile need not check it again.
    None when the entry is missing or damaged, or names a file that is missing, is a
    link, or does not match its sha256. Nothing is loaded onto a GPU yet.
    """
    if cache_dir is None:
        return None
    raw = read_file(_entry(cache_dir, key))
    if raw is None:
        return None
    try:
        from triton.compiler.compiler import CompiledKernel  # Triton's import cost

        record = json.loads(raw)
        group = {}
        for name, digest in record["files"].items():
            path = _blob(cache_dir, name, digest)
            data = read_file(path)
            if data is None or hashlib.sha256(data).hexdigest() != digest:
                return None
            group[name] = str(path)
        if not any(n.endswith(".json") for n in group) or not isinstance(record["hash"], str):
            return None
        src = types.SimpleNamespace(
            fn=fn, signature=dict(record["signature"]), attrs={},
            constants={tuple(k) if isinstance(k, list) else k: v for k, v in record["constants"]})
        return CompiledKernel(src, group, record["hash"]), record["checked"] is True
    except Exception:
        return None
