"""fxlite's disk cache folder, and atomic writes into it.

The folder (``$FXLITE_CACHE_DIR``, default ``fxlite-<uid>`` in the temp folder) holds
kernel sources and the index of compiled binaries (``triton_binaries``). Deleting it is
always safe. Shapes need no cache: ``fxlite.compile`` records them from its first call.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["cache_root", "kernel_dir", "load_module", "write_atomic"]

_LOAD_LOCK = threading.Lock()


def cache_root() -> Path:
    """``$FXLITE_CACHE_DIR``, or ``fxlite-<uid>`` in the temp folder."""
    root = os.environ.get("FXLITE_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"fxlite-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    return Path(root)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (creating its folder) so that no reader, in this process
    or another, ever sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def kernel_dir() -> Path:
    """The folder of kernel sources and binaries (made if missing)."""
    path = cache_root() / "triton"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_module(text: str, name: str) -> Any:
    """Import kernel source ``text`` from a file (Triton's JIT reads functions' source)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    modname = f"fxlite_kernel_{name}_{digest}"
    with _LOAD_LOCK:
        if modname in sys.modules:
            return sys.modules[modname]
        path = kernel_dir() / f"{modname}.py"
        if not path.exists() or path.read_text() != text:
            write_atomic(path, text)
        spec = importlib.util.spec_from_file_location(modname, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[modname] = module
        return module
