"""``fxlite.compiler`` and ``fxlite.reset``: the helpers ``torch.compiler`` users reach for.

- :func:`disable`: a function that always runs eagerly (``torch.compiler.disable``);
- :func:`is_compiling`: True while fxlite records the user's function
  (``torch.compiler.is_compiling``);
- :func:`reset`: drop every compiled function's recordings and kernels' places in them,
  as ``torch._dynamo.reset()`` / ``torch.compiler.reset()`` do.

Example::

    @fxlite.compiler.disable
    def log_stats(x):
        print(x.mean())          # runs on every call, never recorded

    @fxlite.compile
    def step(x):
        log_stats(x)
        return x * 2
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from fxlite.codegen.capture.records import recording_thread

__all__ = ["disable", "is_compiling", "reset"]

_LOCK = threading.Lock()
# id -> (weak reference to a CompiledFunction, its constructor's arguments, what compile()
# set on it besides): what reset() rebuilds
_LIVE: dict[int, tuple[weakref.ref, tuple, Callable[[Any], None]]] = {}
# what reset() calls besides: modules above this one forgetting what they keep
_ON_RESET: list[Callable[[], None]] = []


def register(compiled: Any, args: tuple, configure: Callable[[Any], None]) -> None:
    """Remember a compiled function (a ``CompiledFunction`` or ``CompiledModule``) for
    :func:`reset`: ``args`` rebuild it, ``configure`` sets what ``compile()`` set."""
    target = compiled.__dict__.get("_compiled", compiled)  # a CompiledModule's function
    key = id(target)

    def forget(_: Any, key: int = key) -> None:
        with _LOCK:
            _LIVE.pop(key, None)

    with _LOCK:
        _LIVE[key] = (weakref.ref(target, forget), args, configure)


def on_reset(forget: Callable[[], None]) -> None:
    """Have :func:`reset` call ``forget()`` too: a module above this one (the Dynamo
    backend's list of the graphs it compiled) drops what it keeps."""
    _ON_RESET.append(forget)


def reset() -> None:
    """Drop all compiled state, as ``torch._dynamo.reset()`` does: every live compiled
    function (from ``fxlite.compile`` or ``torch.compile(backend="fxlite")``) forgets its
    recordings, paths, guards and eager fallbacks, and records again on its next call.

    Built kernels stay in the process's and the disk caches, which are keyed by their
    source (as Inductor's code cache is). Dynamo's own cache is ``torch._dynamo.reset()``'s.

    Example::

        f = fxlite.compile(f)
        f(x)
        fxlite.reset()
        f(x)   # records again
    """
    with _LOCK:
        entries = list(_LIVE.values())
    for ref, args, configure in entries:
        compiled = ref()
        if compiled is None:
            continue
        lock = compiled.__dict__.get("_lock")
        with lock if lock is not None else contextlib.nullcontext():
            given = compiled.__dict__.get("_given")  # compile()'s arguments, for copies
            compiled.__dict__.clear()
            type(compiled).__init__(compiled, *args)
            configure(compiled)
            if given is not None:
                compiled._given = given
    for forget in _ON_RESET:
        forget()


def is_compiling() -> bool:
    """True while fxlite records the user's function (its first call, or a new path),
    as ``torch.compiler.is_compiling()`` is while Dynamo traces.

    Example::

        def f(x):
            if not fxlite.compiler.is_compiling():
                print("eager")
            return x + 1
    """
    rec = recording_thread()
    return rec is not None and not rec.off


def disable(fn: Callable[..., Any] | None = None, recursive: bool = True, *,
            reason: str | None = None) -> Any:
    """A function that always runs eagerly, as ``torch.compiler.disable`` makes one.

    ``fxlite.compile`` of it returns it as it is. Called while fxlite records a compiled
    function, it stops that recording: that call finishes in eager PyTorch and, with
    one warning naming the call, so do the compiled function's later calls with the
    same key (fxlite cannot yet replay around a Python call). The function's own
    Python and torch calls always run, on every call.

    Args:
        fn: the function; omit it to use ``@disable(reason=...)``.
        recursive: accepted for ``torch.compiler.disable``'s signature; fxlite never
            compiles what such a function calls either way.
        reason: shown in the warning.

    Returns:
        A function with ``fn``'s signature.
    """
    if fn is None:
        return functools.partial(disable, recursive=recursive, reason=reason)
    if getattr(fn, "_fxlite_disabled", False):
        return fn
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)

    @functools.wraps(fn)
    def eager(*args: Any, **kwargs: Any) -> Any:
        rec = recording_thread()
        if rec is not None and not rec.off:
            why = f"calls {name}, which fxlite.compiler.disable keeps out of compiled code"
            rec.stop(f"{why} ({reason})" if reason else why)
        return fn(*args, **kwargs)

    eager._fxlite_disabled = True  # type: ignore[attr-defined]
    return eager
