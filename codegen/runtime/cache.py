"""fxlite's disk cache: a private folder of kernel sources and compiled binaries.

Where: ``$FXLITE_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxlite``, else ``~/.cache/fxlite``.
It holds kernel sources (``triton/``) and the index of compiled binaries
(``triton/binaries``, see ``runtime/binaries.py``). Deleting it is always safe.

What it promises (SECURITY.md has the threat model):

- **The folder is the user's own.** It is made with mode 0700 whatever the umask, and a
  folder owned by another user, or writable by group or others, is refused with one
  warning naming it; fxlite then keeps kernels in memory for the process, and they run.
- **Nothing read from it runs.** A kernel module is compiled from the source fxlite has
  just generated and executed into a fresh module object; the file on disk is a copy
  for tracebacks, debuggers and profilers, never imported, so no ``__pycache__`` is
  read or written. Binaries are loaded only after their sha256 matches the index.
- **Writes never follow a link and are atomic**: a fresh temp name opened with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, then ``os.replace``. Readers, in any
  thread or process, see the old file or the new one.
- **A damaged file is rewritten**, from the fresh source or binary, never trusted and
  never left to disable its kernel.
"""

from __future__ import annotations

import hashlib
import linecache
import os
import re
import secrets
import stat
import threading
import types
import warnings
from pathlib import Path

from fxlite import config

__all__ = ["cache_root", "kernel_dir", "load_module", "private_dir", "read_file",
           "write_atomic"]

_LOAD_LOCK = threading.Lock()
_MODULES: dict[str, types.ModuleType] = {}  # kernel modules of this process, by name
_WARNED: set[str] = set()  # refused folders, each warned about once per process
_WARN_LOCK = threading.Lock()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)


class _Refused(OSError):
    """A folder that is not safe to use; the message says why."""


def cache_root() -> Path:
    """Where the cache folder is configured to be: ``$FXLITE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/fxlite``, else ``~/.cache/fxlite`` (it may not exist yet).

    A relative ``$XDG_CACHE_HOME`` is ignored, as the XDG specification asks.
    """
    root = config.cache_dir()
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "fxlite")


def private_dir(path: Path) -> Path:
    """``path`` as a folder only the current user can write, made with mode 0700 (and its
    missing parents too) when absent.

    Raises:
        OSError: it cannot be made, or it is not a folder of the current user that group
            and others cannot write (a link is refused too).
    """
    missing = []
    p = str(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:  # made meanwhile by another thread or process
            continue
        os.chmod(p, 0o700)  # the umask may have taken bits away
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _Refused(f"{path} is {'a link' if stat.S_ISLNK(st.st_mode) else 'not a folder'}")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise _Refused(f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
    if hasattr(os, "geteuid") and st.st_mode & 0o022:
        raise _Refused(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
    return path


def kernel_dir() -> Path | None:
    """The folder of kernel sources and binaries (made if missing), or None when the
    cache folder cannot be used: then one warning names it and kernels live in memory.

    Checked on every call (a few ``stat`` calls): the folder may be deleted meanwhile.
    """
    configured = cache_root()
    # Resolved once, so that a link swapped later does not move the folder under us.
    root = Path(os.path.realpath(configured))
    try:
        return private_dir(private_dir(root) / "triton")
    except OSError as e:  # (a _Refused folder too)
        why = str(e)
    with _WARN_LOCK:
        if str(root) in _WARNED:
            return None
        _WARNED.add(str(root))
    shown = f"{configured} ({root})" if Path(os.path.abspath(configured)) != root else f"{root}"
    warnings.warn(f"fxlite: not using the kernel cache folder {shown}: {why}; kernels are kept "
                  "in memory for this process (make the folder yours and writable only by "
                  "you, or set FXLITE_CACHE_DIR)", RuntimeWarning, stacklevel=2)
    return None


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` (in an existing folder) so that no reader, in this process
    or another, ever sees a half-written file, and no link is ever followed.

    The data goes to a fresh temp file in the same folder, opened with ``O_CREAT | O_EXCL
    | O_NOFOLLOW`` and mode 0600, which then replaces ``path`` (a link at ``path`` is
    replaced, not written through).
    """
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | _BINARY,
                 0o600)
    try:
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o600)  # whatever the umask
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_file(path: Path) -> bytes | None:
    """The bytes of the regular file at ``path``; None when it is missing, unreadable,
    or not a regular file (a link is not followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _BINARY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def load_module(text: str, name: str) -> types.ModuleType:
    """A module made from the kernel source ``text``, once per process per source.

    The module is compiled from ``text`` itself and executed into a fresh module object;
    nothing is imported from disk. Its source is registered in ``linecache``, where
    Triton's JIT (which reads functions' source) and tracebacks find it. The copy written
    into the cache folder, named by the text's sha256, is rewritten when its bytes differ
    (damaged, or changed by anyone), so that files and line numbers in tracebacks and
    profilers are the ones that ran.
    """
    digest = hashlib.sha256(text.encode()).hexdigest()
    modname = f"fxlite_kernel_{re.sub(r'[^A-Za-z0-9_]', '_', name)[:100]}_{digest[:32]}"
    with _LOAD_LOCK:
        module = _MODULES.get(modname)
        if module is None:
            filename = _store_source(modname, text)
            code = compile(text, filename, "exec", dont_inherit=True)
            module = types.ModuleType(modname)
            module.__file__ = filename
            # mtime None: linecache.checkcache() keeps the entry whatever is on disk.
            linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
            exec(code, module.__dict__)
            _MODULES[modname] = module
        return module


def _store_source(modname: str, text: str) -> str:
    """Write the cache's copy of a kernel source if it is missing or differs; its path,
    or a ``<...>`` name when there is no usable cache folder."""
    folder = kernel_dir()
    if folder is None:
        return f"<{modname}>"
    path = folder / f"{modname}.py"
    if read_file(path) != text.encode():
        try:
            write_atomic(path, text)
        except OSError:  # a full disk, or a folder in the way: the kernel still runs
            return f"<{modname}>"
    return str(path)
