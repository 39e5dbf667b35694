"""An on-disk index of compiled kernel binaries, so a new process skips Triton's JIT.

Why: before Triton's JIT can look a kernel up in its own cache, it hashes Triton's
installed sources once per process (about 0.35 s on an H200 host) and imports its
compiler stack. A kernel fxlite has compiled before is fully described by its source,
its launch configuration and its arguments' types, alignments and integer values, so
fxlite records where Triton stored the binary and loads it from there directly.

Each entry is one JSON file under ``$FXLITE_CACHE_DIR/triton/binaries``; it also records
whether the binary's output has been checked against eager PyTorch, so that a new process
need not run the eager reference again. Loading is best-effort: a missing file, another
Triton version or any error means the normal JIT path runs (and refreshes the entry).
"""

from __future__ import annotations

import hashlib
import json
import os
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .cache import write_atomic

__all__ = ["binary_key", "has_binary", "load_binary", "save_binary"]


def binary_key(source_id: str, variant: str, args: Sequence[Any], constexprs: dict[str, Any],
               num_warps: int) -> str:
    """What a compiled binary depends on: Triton specializes on all of these.

    ``source_id`` names the kernel source (its module name, which holds a digest of the
    text), so the source itself is not re-hashed on every launch that reaches here.
    """
    import triton

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


def _entry(cache_dir: Path, key: str) -> Path:
    return cache_dir / "binaries" / f"{key}.json"


def has_binary(cache_dir: Path, key: str) -> bool:
    """Whether the index has a record under ``key`` (:func:`load_binary` may still find
    its files gone, and then the launch compiles)."""
    return _entry(cache_dir, key).exists()


def save_binary(cache_dir: Path, key: str, compiled: Any, checked: bool = False) -> None:
    """Record where Triton stored ``compiled`` (a CompiledKernel), if it can be described.

    ``checked``: the binary's output has matched eager PyTorch (see :func:`load_binary`).
    """
    try:
        record = {"hash": compiled.hash, "metadata_group": dict(compiled.metadata_group),
                  "signature": list(compiled.src.signature.items()),
                  "constants": [[list(k) if isinstance(k, tuple) else k, v]
                                for k, v in compiled.src.constants.items()],
                  "checked": bool(checked)}
        text = json.dumps(record)
    except Exception:  # an unexpected Triton version or value: just don't cache it
        return
    try:
        write_atomic(_entry(cache_dir, key), text)
    except OSError:  # a read-only or full cache folder: the index is only an optimization
        pass


def load_binary(cache_dir: Path, key: str, fn: Any) -> tuple[Any, bool] | None:
    """The CompiledKernel recorded under ``key`` for the JIT function ``fn``, or None.

    Returns ``(compiled, checked)``: ``checked`` says that this binary's output matched
    eager PyTorch in an earlier process, so fxlite.compile need not check it again.
    Nothing is loaded onto a GPU yet.
    """
    path = _entry(cache_dir, key)
    if not path.exists():
        return None
    try:
        from triton.compiler.compiler import CompiledKernel

        record = json.loads(path.read_text())
        if not all(os.path.exists(p) for p in record["metadata_group"].values()):
            return None
        src = types.SimpleNamespace(
            fn=fn, signature=dict(record["signature"]), attrs={},
            constants={tuple(k) if isinstance(k, list) else k: v for k, v in record["constants"]})
        return CompiledKernel(src, record["metadata_group"], record["hash"]), bool(
            record.get("checked"))
    except Exception:
        return None
