"""fxlite's disk cache folder, and atomic writes into it.

The folder (``$FXLITE_CACHE_DIR``, default ``fxlite-<uid>`` in the temp folder) holds
kernel sources and the index of compiled binaries (``triton_binaries``). Deleting it is
always safe. Shapes need no cache: ``fxlite.compile`` records them from its first call.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["cache_root", "write_atomic"]

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
