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
import functools
import inspect
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from fxlite.codegen.capture.records import recording_thread

__all__ = ["installed", "opaque_methods", "opaque_names"]


def _active() -> Any:
    rec = recording_thread()
    return rec if rec is not None and not rec.off else None


def _apply_hook(orig: Any) -> Any:
    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _active()
        if rec is None:
            return orig.__func__(cls, *args, **kwargs)
        given = [a for a in (*args, *kwargs.values())
                 if callable(a) and not isinstance(a, type)]
        if given:
            # checkpoint(lambda t: model(t) * mask, x): a closure holds the call's own
            # values, and a replay would call the first call's; checkpoint(model, x,
            # use_reentrant=True): the module (or function) runs again inside backward,
            # where a replay's third call raised ("element 0 of tensors does not require
            # grad")
            rec.stop(f"passes a function holding values (a closure) to {cls.__name__}, "
                     "which a replay would call as the first call made it"
                     if any(_closure(a) for a in given) else
                     f"passes a function or module to {cls.__name__}, which may run it "
                     "again inside backward (reentrant checkpointing)")
            return orig.__func__(cls, *args, **kwargs)
        return rec.call_opaque(cls.apply, lambda *a, **k: orig.__func__(cls, *a, **k),
                               args, kwargs)
    return classmethod(apply)


def _closure(value: Any) -> bool:
    """A function that holds values: a closure or a ``functools.partial``."""
    return isinstance(value, functools.partial) or \
        isinstance(value, types.FunctionType) and value.__closure__ is not None


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


class _Patch(NamedTuple):
    """What installing the hooks sets, and what uninstalling sets back: made once (a
    followed function installs them on every call, so this is host time), and again
    only when one of the originals is another object."""

    apply: Any  # torch.autograd.Function's own ``apply`` (a classmethod)
    hook: Any  # what replaces it
    cond: Any  # torch.cond, or None where it is not hooked (an older torch)
    code: Any  # its code object
    defaults: Any  # its defaults
    entry: Any  # the code object that replaces its own
    original: Any  # a function running its own code (its globals' _fxlite_cond_original)


def _patch() -> _Patch:
    global _made
    apply = torch.autograd.Function.__dict__["apply"]
    cond = getattr(torch, "cond", None)
    if not isinstance(cond, types.FunctionType) or cond.__code__.co_freevars:
        cond = None
    made = _made
    if made is not None and made.apply is apply and made.cond is cond and (
            cond is None or cond.__code__ is made.code and cond.__defaults__ is made.defaults):
        return made
    if cond is None:
        made = _Patch(apply, _apply_hook(apply), None, None, None, None, None)
    else:
        code = cond.__code__
        made = _Patch(apply, _apply_hook(apply), cond, code, cond.__defaults__,
                      _cond_entry.__code__.replace(co_name=code.co_name),
                      types.FunctionType(code, cond.__globals__, cond.__name__,
                                         cond.__defaults__))
    _made = made
    return made


def _install() -> _Patch:
    patch = _patch()
    torch.autograd.Function.apply = patch.hook
    if patch.cond is not None:
        glob = patch.cond.__globals__
        glob["_fxlite_cond_original"] = patch.original
        glob["_fxlite_cond_dispatch"] = _cond_dispatch
        patch.cond.__code__ = patch.entry
    return patch


def _uninstall(patch: _Patch) -> None:
    torch.autograd.Function.apply = patch.apply
    if patch.cond is not None:
        patch.cond.__code__ = patch.code
        glob = patch.cond.__globals__
        glob.pop("_fxlite_cond_original", None)
        glob.pop("_fxlite_cond_dispatch", None)


_lock = threading.Lock()
_users = 0
_installed: _Patch | None = None  # the patch installed, while some thread records
_made: _Patch | None = None


class _Installed:
    """What ``installed()`` returns: one object for every block, counting its users."""

    def __enter__(self) -> None:
        global _users, _installed
        with _lock:
            if _users == 0:
                _installed = _install()
            _users += 1

    def __exit__(self, *exc: Any) -> None:
        global _users, _installed
        with _lock:
            _users -= 1
            if _users == 0 and _installed is not None:
                _uninstall(_installed)
                _installed = None


_INSTALLED = _Installed()


def installed() -> contextlib.AbstractContextManager[None]:
    """Keep the hooks installed while the block runs (reference-counted across threads)."""
    return _INSTALLED


# Objects whose methods run as one recorded call each: an optimizer step reads every
# parameter's step count in Python (a new value each call) and a scheduler's step changes
# Python state; replayed as calls, they run for real on every call, as eager runs them.
_OPAQUE = (("torch.optim", "Optimizer", ("step",)),
           ("torch.optim.lr_scheduler", "LRScheduler", ("step",)),
           ("torch.amp.grad_scaler", "GradScaler", ("step", "update", "unscale_")))


def _state_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors an optimizer (or a grad scaler's optimizers) can write in a step."""
    out: list[torch.Tensor] = []
    groups = getattr(obj, "param_groups", None)
    if groups is not None:
        for group in groups:
            out += [p for p in group["params"] if isinstance(p, torch.Tensor)]
        for state in getattr(obj, "state", {}).values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for name in ("_scale", "_growth_tracker"):  # GradScaler
        value = getattr(obj, name, None)
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


_NOTHING = object()


_classes: list[tuple[type, tuple[str, ...]]] = []  # _OPAQUE's, once all are imported
_every: list[tuple[type, ...]] = [()]  # the same classes, as one tuple for isinstance


def _opaque_classes() -> list[tuple[type, tuple[str, ...]]]:
    """``_OPAQUE``'s classes, each with its method names (looked up again until every
    one of their modules is imported)."""
    if len(_classes) == len(_OPAQUE):
        return _classes
    found = [(cls, names) for module, cls_name, names in _OPAQUE
             if isinstance(cls := getattr(sys.modules.get(module), cls_name, None), type)]
    _every[0] = tuple(cls for cls, _ in found)
    if len(found) == len(_OPAQUE):
        _classes[:] = found
    return found


def opaque_names(obj: Any, classes: list[tuple[type, tuple[str, ...]]] | None = None
                 ) -> tuple[str, ...]:
    """The names of ``obj``'s methods that a recording records as single calls (an
    optimizer's ``step``, a scheduler's, a grad scaler's; see ``_OPAQUE``), or ``()``;
    ``classes`` is the table to look in, by default those classes imported so far."""
    for cls, names in _opaque_classes() if classes is None else classes:
        if isinstance(obj, cls):
            return names
    return ()


def opaque_methods(objects: list[Any]) -> contextlib.AbstractContextManager[None]:
    """While the block runs, record calls of the listed objects' optimizer, scheduler and
    grad-scaler methods as single calls (see ``_OPAQUE``). Other threads see the
    original methods' behaviour: the wrappers pass their calls straight through."""
    classes = _opaque_classes()
    every = _every[0]
    for obj in objects:
        if isinstance(obj, every):
            return _opaque_methods(objects, classes)
    return _NO_METHODS  # (the common case, on every call of a followed function)


_NO_METHODS = contextlib.nullcontext()


@contextlib.contextmanager
def _opaque_methods(objects: list[Any],
                    classes: list[tuple[type, tuple[str, ...]]]) -> Iterator[None]:
    undo: list[Any] = []
    seen: set[int] = set()
    for obj in objects:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for name in opaque_names(obj, classes):
            own = obj.__dict__.get(name, _NOTHING)
            if own is not _NOTHING and not getattr(own, "_wrapped_by_lr_sched", False):
                continue  # an instance attribute someone else set: leave it alone
            # A learning-rate scheduler wraps its optimizer's step in an instance
            # attribute that notes the call: the recording calls that wrapper, and the
            # replays the step itself (the note is already made).
            method = getattr(type(obj), name).__get__(obj)
            runner = method if own is _NOTHING else own

            def wrapper(*args: Any, _method: Any = method, _runner: Any = runner,
                        _obj: Any = obj, **kwargs: Any) -> Any:
                rec = _active()
                if rec is None:
                    return _runner(*args, **kwargs)
                if any(callable(a) for a in (*args, *kwargs.values())):
                    # optimizer.step(closure): a replay would call the first call's
                    # closure, which holds that call's inputs
                    rec.stop(f"calls {type(_obj).__name__}.{_method.__name__}() with a "
                             "closure, which a replay would call as the first call made it")
                    return _runner(*args, **kwargs)
                touches = _state_tensors(_obj)
                for a in args:  # a grad scaler's step(opt), unscale_(opt)
                    if a is not _obj and getattr(a, "param_groups", None) is not None:
                        touches += _state_tensors(a)
                return rec.call_opaque(_method, _runner, args, kwargs, touches)
            if own is not _NOTHING:
                wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
            obj.__dict__[name] = wrapper
            undo.append((obj, name, own))
    try:
        yield
    finally:
        for obj, name, own in undo:
            if own is _NOTHING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = own
