"""The temporary patches that tracing needs, made safe for threads and overlapping traces.

While a thread traces, ``nn.Module.__call__`` and ``nn.Module.__getattr__`` must route
through its tracer, and functions registered with ``wrap`` must record calls on Proxies.
These patches live on shared objects (a class, a module's globals), so they are seen by
every thread. Two rules keep other threads unaffected:

- each patched function passes straight through to the original unless the *calling*
  thread is tracing (the tracers of a thread are a thread-local stack);
- each patch is installed once, however many traces overlap, and removed when the last
  trace that needs it ends, even if the traces end in another order than they began.

Example: thread A traces a model while thread B runs another model eagerly; B's module
calls and attribute reads go to the original ``nn.Module`` methods and return tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["active_tracer", "classes_to_patch", "tracing"]

_local = threading.local()
_lock = threading.RLock()
# (id(container), name) -> [container, is_dict, original (or _MISSING), patch, users]
_installed: dict[tuple[int, str], list[Any]] = {}
_MISSING = object()

def active_tracer() -> Any:
    """The tracer of the innermost trace running in this thread, or None."""
    stack = getattr(_local, "stack", None)
    return stack[-1][0] if stack else None


def _make_module_call(orig: Callable[..., Any]) -> Callable[..., Any]:
    def module_call(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        stack = getattr(_local, "stack", None)
        if not stack:
            return orig(mod, *args, **kwargs)
        return stack[-1][0].call_module(mod, lambda *a, **k: orig(mod, *a, **k), args, kwargs)
    return module_call


def _make_module_getattr(orig: Callable[..., Any]) -> Callable[..., Any]:
    def module_getattr(mod: torch.nn.Module, attr: str) -> Any:
        value = orig(mod, attr)
        stack = getattr(_local, "stack", None)
        if not stack:
            return value
        tracer, cache = stack[-1]
        return tracer.getattr(attr, value, cache)
    return module_getattr


def _acquire(container: Any, name: str, make: Callable[[Any], Any], is_dict: bool) -> tuple:
    key = (id(container), name)
    entry = _installed.get(key)
    if entry is not None:
        entry[4] += 1
        return key
    if is_dict:
        old = container.get(name, _MISSING)
        new = make(old)
    else:  # a class: _MISSING means inherited, so the patch is deleted again afterwards
        old = container.__dict__.get(name, _MISSING)
        new = make(getattr(container, name) if old is _MISSING else old)
    if is_dict:
        container[name] = new
    else:
        setattr(container, name, new)
    _installed[key] = [container, is_dict, old, new, 1]
    return key


def _release(key: tuple) -> None:
    entry = _installed[key]
    entry[4] -= 1
    if entry[4]:
        return
    del _installed[key]
    container, is_dict, old, new, _ = entry
    if is_dict:
        # Only undo our own patch: if someone replaced it meanwhile, theirs stays.
        if container.get(key[1], _MISSING) is new:
            if old is _MISSING:
                del container[key[1]]
            else:
                container[key[1]] = old
    elif container.__dict__.get(key[1]) is new:
        if old is _MISSING:
            delattr(container, key[1])
        else:
            setattr(container, key[1], old)


class _Session:
    """The patches one trace holds; released together when the trace ends."""

    def __init__(self) -> None:
        self.keys: list[tuple] = []

    def patch_dict(self, d: dict[str, Any], name: str, make: Callable[[Any], Any]) -> None:
        """Set ``d[name] = make(original)`` for this trace (once per name)."""
        with _lock:
            self.keys.append(_acquire(d, name, make, True))


def classes_to_patch(modules: list[torch.nn.Module]) -> list[type]:
    """The classes whose ``__call__`` and ``__getattr__`` tracing ``modules`` must patch.

    Their own classes when they all inherit both from ``nn.Module``: patching a leaf
    class is cheap, while assigning an attribute of ``nn.Module`` itself invalidates the
    method caches of its hundreds of subclasses (about 0.3 ms, twice per trace and
    attribute). ``[nn.Module]`` when some class defines its own ``__call__`` or
    ``__getattr__``, which must keep running and reach the patched one through ``super()``.
    """
    classes = list(dict.fromkeys(type(m) for m in modules))
    base = torch.nn.Module
    for cls in classes:
        if cls.__call__ is not base.__call__ or cls.__getattr__ is not base.__getattr__:
            return [base]
    return classes


@contextmanager
def tracing(tracer: Any, classes: list[type] | None = None) -> Iterator[_Session]:
    """Route this thread's module calls and attribute reads through ``tracer``.

    Args:
        tracer: the tracer that records them.
        classes: the module classes to patch (see :func:`classes_to_patch`); by default
            ``nn.Module`` itself, which covers every module.

    Yields a session whose ``patch_dict`` installs further patches for this trace.
    """
    session = _Session()
    with _lock:
        for cls in [torch.nn.Module] if classes is None else classes:
            session.keys.append(_acquire(cls, "__call__", _make_module_call, False))
            session.keys.append(_acquire(cls, "__getattr__", _make_module_getattr, False))
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append((tracer, {}))
    try:
        yield session
    finally:
        stack.pop()
        with _lock:
            for key in reversed(session.keys):
                _release(key)

