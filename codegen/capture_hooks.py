"""Call hooks the capture needs where a ``TorchFunctionMode`` sees too much or too little.

- ``torch.autograd.Function.apply``: the mode sees the ops inside a custom function's
  ``forward``, but replaying those would lose its hand-written ``backward``. While a
  recording runs, ``apply`` is recorded as one call.
- ``torch.cond``: in eager mode it hands itself to ``torch.compile``; while recording, its
  two branches are recorded as graphs of their own and the call becomes one node.

The hooks are installed only while some thread records, and they pass every call from any
other thread (and any call made while the recorder is paused) straight to the original,
so no other thread sees a change of behaviour.
"""

from __future__ import annotations

import contextlib
import threading
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


def _hop_hook(orig: Any) -> Any:
    def hop_compile_and_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _active()
        if rec is None or getattr(fn, "__name__", "") != "_cond_op_wrapper" or kwargs:
            return orig(fn, *args, **kwargs)
        (pred, true_fn, false_fn, operands), = args
        return rec.record_cond(pred, true_fn, false_fn, operands)
    return hop_compile_and_call


def _install() -> None:
    fn_cls = torch.autograd.Function
    orig_apply = fn_cls.__dict__["apply"]
    fn_cls.apply = _apply_hook(orig_apply)
    _undo.append(lambda: setattr(fn_cls, "apply", orig_apply))
    try:
        import torch._higher_order_ops.utils as hop_utils
    except ImportError:  # an older torch: torch.cond is left as it is
        return
    orig_hop = getattr(hop_utils, "_hop_compile_and_call", None)
    if orig_hop is not None:
        hop_utils._hop_compile_and_call = _hop_hook(orig_hop)
        _undo.append(lambda: setattr(hop_utils, "_hop_compile_and_call", orig_hop))


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
