"""Call hooks the capture needs where a ``TorchFunctionMode`` sees too much or too little.

- ``torch.autograd.Function.apply``: the mode sees the ops inside a custom function's
  ``forward``, but replaying those would lose its hand-written ``backward``. While a
  recording runs, ``apply`` is recorded as one call.
- ``torch.cond``: in eager mode it hands itself to ``torch.compile``, which would trace
  the recorder too; while recording, its two branches are recorded as graphs of their
  own and the call becomes one node. Users hold the function itself (``from
  functorch.experimental.control_flow import cond`` is the same object), so the hook
  swaps its code object, which every reference sees, and restores it afterwards.

The hooks are installed only while some thread records, and they pass every call from any
other thread (and any call made while the recorder is paused) straight to the original,
so no other thread sees a change of behaviour.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["installed"]

_lock = threading.Lock()
_users = 0
_undo: list[Any] = []


def _active() -> Any:
    from fxlite.codegen.recording import recording_thread

    rec = recording_thread()
    return rec if rec is not None and not rec.off else None


def _apply_hook(orig: Any) -> Any:
    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _active()
        if rec is None:
            return orig.__func__(cls, *args, **kwargs)
        return rec.call_opaque(cls.apply, lambda *a, **k: orig.__func__(cls, *a, **k),
                               args, kwargs)
    return classmethod(apply)


def _cond_dispatch(*args: Any, **kwargs: Any) -> Any:
    original = torch.cond.__globals__["_fxlite_cond_original"]
    rec = _active()
    if rec is None:
        return original(*args, **kwargs)
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    pred, true_fn, false_fn, operands = bound.args[:4]
    if not isinstance(pred, torch.Tensor):  # a Python bool: eager cond just calls a branch
        return original(*args, **kwargs)
    return rec.record_cond(pred, true_fn, false_fn, operands)


def _cond_entry(*args: Any, **kwargs: Any) -> Any:
    return _fxlite_cond_dispatch(*args, **kwargs)  # noqa: F821  (in torch.cond's globals)


def _install() -> None:
    fn_cls = torch.autograd.Function
    orig_apply = fn_cls.__dict__["apply"]
    fn_cls.apply = _apply_hook(orig_apply)
    _undo.append(lambda: setattr(fn_cls, "apply", orig_apply))
    cond = getattr(torch, "cond", None)  # an older torch has none
    if not isinstance(cond, types.FunctionType) or cond.__code__.co_freevars:
        return
    glob, code = cond.__globals__, cond.__code__
    original = types.FunctionType(code, glob, cond.__name__, cond.__defaults__)
    glob["_fxlite_cond_original"] = original
    glob["_fxlite_cond_dispatch"] = _cond_dispatch
    cond.__code__ = _cond_entry.__code__.replace(co_name=code.co_name)

    def undo() -> None:
        cond.__code__ = code
        glob.pop("_fxlite_cond_original", None)
        glob.pop("_fxlite_cond_dispatch", None)
    _undo.append(undo)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Keep the hooks installed while the block runs (reference-counted across threads)."""
    global _users
    with _lock:
        if _users == 0:
            _install()
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                while _undo:
                    _undo.pop()()
