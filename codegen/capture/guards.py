"""Guards: what a compiled function checks on every call before it replays a recording.

A recording is valid for calls that look like the one it was made on. The key of a call
holds, flat in one tuple:

- grad mode, autocast state and the default dtype;
- the structure of the arguments (positions, keyword names, containers);
- per tensor: dtype, device, rank, requires_grad, contiguity, 16-byte alignment, which
  dims broadcast (stride 0), and, once the Python code read a size, all sizes and strides;
  which arguments are the same tensor (and, for functions that write tensors, which share
  memory); its Python attributes, if any (``x.test = 1``);
- per other argument: its value (numbers, strings, dtypes, enums, numpy arrays), a
  ``functools.partial``'s function and bound values, or its class and identity (a serial
  number no later object at the same address shares, :func:`identity`) with a plain
  object's attribute names and values;
- the state of every module the function can reach (the module itself, its arguments,
  closure cells, globals its code names): training flags, the identity and requires_grad
  of each parameter, buffers and submodules, hooks, and plain Python attributes (numbers,
  strings, flags such as a temperature);
- closure cells, ``functools.partial`` arguments and the globals the function's own code
  names (but not the functions, classes and Python modules it names), by value (numbers,
  strings) or identity (tensors, other objects).

Not guarded, and so not seen when they change after the first call: globals read by
other functions than the compiled one, attributes of objects that are not modules
(a config object, say), and Python state changed by the function itself: a function
whose call changes what its key holds (a counter, a training flag, a rebound buffer) is
followed instead of replayed (``compile.CompiledFunction._stays_eager``), its Python running
on every call; a path recorded after a read that changes it runs in eager PyTorch.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import itertools
import operator
import os
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from fxlite.codegen.capture.kinds import autocast_state
from fxlite.codegen.capture.segments import read_key
from fxlite.codegen.capture.watch import (
    contents_key,
    is_stateful,
    optimizer_key,
    too_large,
    user_class,
    users_object,
)

__all__ = ["CODE_TYPES", "LayoutCheck", "StateGuard", "ambient_key", "argument_key", "identity",
           "input_key", "tensor_guard"]

_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
            torch.layout, torch.memory_format, torch.Size, enum.Enum, range, slice)
_MODULE_INTERNALS = frozenset({"training", "_parameters", "_buffers", "_modules",
                               "_non_persistent_buffers_set", "_is_full_backward_hook",
                               "_version", "call_super_init", "dump_patches"})


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def ambient_key() -> tuple:
    """Global state every recording depends on: grad mode, autocast, default dtype,
    inference mode, and the flags a program may read and branch on (deterministic
    algorithms and their warn-only mode, float32 matmul precision, anomaly detection)."""
    autocast = autocast_state() if _any_autocast is None or _any_autocast() else None
    return (torch.is_grad_enabled(), autocast, torch.get_default_dtype(),
            torch.is_inference_mode_enabled(), _deterministic(), _warn_only(), _precision(),
            _anomaly())


_deterministic = torch._C._get_deterministic_algorithms
_warn_only = torch._C._get_deterministic_algorithms_warn_only
_precision = torch._C._get_float32_matmul_precision
_anomaly = torch.is_anomaly_enabled


def _scalar_key(v: Any) -> Any:
    t = type(v)
    if t is float or t is complex or t is tuple or t is list:
        return read_key(v)
    if isinstance(v, enum.Enum):
        return (t, v.value)
    if t is slice:
        return (t, _scalar_key(v.start), _scalar_key(v.stop), _scalar_key(v.step))
    return (t, v)


def input_key(leaves: list[Any], sizes: bool, storage: bool = False,
              contents: bool = True, symbolic: frozenset[int] = frozenset(),
              keyed: frozenset[int] = frozenset()) -> tuple:
    """The key of a call's argument leaves (see the module docstring); with
    ``contents=False`` a plain object's without what it holds (:func:`argument_key`).
    An int at a position in ``symbolic`` (a size the recording takes as an input:
    ``capture/symbolic.py``) is keyed by its type alone, unless ``sizes``; a 0-d tensor
    at a position in ``keyed`` (a float a Dynamo graph reads) by its value too."""
    key: list[Any] = []
    seen: dict[int, int] = {}
    storages: dict[int, int] = {}
    for i, a in enumerate(leaves):
        if isinstance(a, torch.Tensor):
            same = seen.setdefault(id(a), i)
            contiguous = a.is_contiguous()
            item: tuple = (a.dtype, a.device, a.dim(), a.requires_grad, contiguous,
                           a.is_meta or a.data_ptr() % 16 == 0,
                           None if contiguous else tuple(s == 0 for s in a.stride()),
                           type(a), same)
            if sizes:
                item += (tuple(a.shape), a.stride(), a.storage_offset())
            if storage:
                item += (storages.setdefault(a.untyped_storage()._cdata, i),)
            if i in keyed and a.dim() == 0:
                item += (a.item(),)
            attrs = a.__dict__  # Python attributes (x.test = 1): usually none
            if attrs:
                item += (_tensor_attributes(attrs),)
            key.append(item)
        elif isinstance(a, _SCALARS):
            key.append(int if not sizes and i in symbolic and type(a) is int
                       else _scalar_key(a))
        else:  # an object: itself, and what it holds (a loss object's weight)
            key.append(argument_key(a, contents))
    return tuple(key)


def _tensor_attributes(attrs: dict) -> tuple:
    """A tensor argument's Python attributes: names (``hasattr(x, "test")``), and values
    where plain (numbers, strings, flags), else their class.

    Example::

        x.test = 1
        _tensor_attributes(x.__dict__)   # (("test", 1),)
    """
    return tuple((k, v if v.__class__ in _FLAT and v == v else type(v))  # NaN: its class
                 for k, v in attrs.items())


def identity(obj: Any) -> Any:
    """A key for ``obj``'s identity that no later object can share: a serial number,
    given on first sight and kept while ``obj`` lives (a weak reference tells), where
    ``id()`` is reused once ``obj`` is freed (a new object of another class, or a new
    partial over other tensors, at the same address would pass a guard keyed on it). An
    object that takes no weak reference is keyed by its class and ``id``.

    Example::

        a = Plain(); k = identity(a)
        identity(a) == k          # True while a lives
        del a; identity(Other())  # another serial, whatever its address
    """
    i = id(obj)
    entry = _SERIALS.get(i)
    if entry is not None and entry[0]() is obj:
        return entry[1]
    try:
        ref = weakref.ref(obj, functools.partial(_forget, i))
    except TypeError:  # no weak reference (a class with __slots__, an int subclass)
        return (type(obj), i)
    serial = next(_NEXT_SERIAL)
    _SERIALS[i] = (ref, serial)
    return serial


_SERIALS: dict[int, tuple[Any, int]] = {}
_NEXT_SERIAL = itertools.count()


def _forget(i: int, ref: Any) -> None:
    """Drop a freed object's serial (a weak reference's callback)."""
    entry = _SERIALS.get(i)
    if entry is not None and entry[0] is ref:
        del _SERIALS[i]


# Arrays up to this many elements are keyed by their bytes; larger ones by a digest
_SMALL_ARRAY = 256


def argument_key(a: Any, contents: bool = True) -> tuple:
    """The key of an argument that is neither a tensor nor a scalar: its class and
    identity (:func:`identity`), and what a recording may have read from it: a plain
    object's attribute names and values (``hasattr(obj, "z")``, ``obj.scale``), a
    ``functools.partial``'s function and bound values, a numpy array's values.

    Example::

        argument_key(functools.partial(mul, y=2))  # (partial, <mul>, (), (("y", (int, 2)),))
        argument_key(np.ones(3))                   # (ndarray, "<f8", (3,), b"...")

    With ``contents=False``, a plain object's key holds its class, identity and attribute
    names alone: the key of a followed plan (``codegen/capture/follow.py``), whose Python reads
    the object on every call and whose torch calls are matched one by one (a tensor the
    object carries from call to call is bound where it is used).
    """
    t = type(a)
    if t is functools.partial:  # by contents: a new partial of the same call replays
        return (t, _bound_key(a.func), tuple(map(_bound_key, a.args)),
                tuple([(k, _bound_key(v)) for k, v in (a.keywords or {}).items()]))
    np = sys.modules.get("numpy")
    if np is not None and isinstance(a, (np.ndarray, np.generic)):
        return _array_key(a)
    if isinstance(a, torch.nn.Module):  # its state is the state key's (StateGuard)
        return (t, identity(a))
    try:
        d = object.__getattribute__(a, "__dict__")
    except AttributeError:
        d = None
    names = tuple(d) if type(d) is dict else None  # attributes added or deleted
    return (t, identity(a), names, _value_key(a)) if contents else (t, identity(a), names)


def _bound_key(v: Any) -> Any:
    """A key for a value a ``functools.partial`` argument binds."""
    if isinstance(v, _SCALARS):
        return _scalar_key(v)
    if isinstance(v, torch.Tensor):
        return (torch.Tensor, identity(v))  # recorded as a constant: this very tensor
    return argument_key(v)


def _array_key(a: Any) -> tuple:
    """A numpy array's (or numpy scalar's) key: its values, which change in place
    under the same identity. Up to 256 elements it holds the bytes themselves, compared
    exactly. A larger array is keyed by a 16-byte BLAKE2 digest of its bytes, not its
    bytes (a key lives as long as its recording: a copy of every large array seen would
    stay in memory) and not its identity or a sample (an in-place change would go
    unseen): hashing reads every byte, at about 1 GB/s, which eager's use of the array
    costs too; a collision is as unlikely as for any 128-bit cryptographic hash. An
    array of Python objects is keyed by its elements' identities."""
    t = type(a)
    if a.dtype.hasobject:
        return (t, a.shape, tuple(map(identity, a.flat)) if a.size <= _SMALL_ARRAY
                else identity(a))
    if a.size <= _SMALL_ARRAY:
        return (t, a.dtype.str, a.shape, a.tobytes())
    data = a.data if a.flags.c_contiguous else a.tobytes()
    return (t, a.dtype.str, a.shape, hashlib.blake2b(data, digest_size=16).digest())


def _getters(fn: Any) -> list[tuple[str, Callable[[], Any]]]:
    """Readers of what a function carries or names: its ``self``, closure cells,
    ``partial`` arguments, defaults and the globals its own code names. Each reads the
    current value, since cells and globals can be rebound between calls."""
    out: list[tuple[str, Callable[[], Any]]] = []
    seen: set[int] = set()
    stack = [("", fn)]
    const = lambda v: (lambda: v)
    while stack:
        prefix, f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, torch.nn.Module):
            out.append((prefix or "self", const(f)))
            continue
        if isinstance(f, functools.partial):
            stack.append((prefix, f.func))
            out += [(f"{prefix}partial{i}", const(a)) for i, a in enumerate(f.args)]
            out += [(f"{prefix}{k}", const(v)) for k, v in (f.keywords or {}).items()]
            continue
        if isinstance(f, types.MethodType):
            out.append((f"{prefix}self", const(f.__self__)))
            stack.append((prefix, f.__func__))
            continue
        code = getattr(f, "__code__", None)
        if code is None:
            wrapped = getattr(f, "__wrapped__", None)
            call = type(f).__dict__.get("__call__")  # its own (not a builtin's)
            if wrapped is not None:
                stack.append((prefix, wrapped))
            elif isinstance(call, types.FunctionType) and is_stateful(f):
                # a callable object: its attributes, and what its __call__ names
                out.append((f"{prefix}self", const(f)))
                stack.append((prefix, call))
            continue
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            out.append((f"{prefix}{name}", functools.partial(_cell_value, cell)))
        glob = getattr(f, "__globals__", {})
        for name in code.co_names:
            value = glob.get(name, _EMPTY)
            if isinstance(value, (*_SCALARS, torch.Tensor, torch.nn.Module)) or not (
                    value is _EMPTY or isinstance(value, CODE_TYPES)) or isinstance(
                    value, type) and user_class(value):  # a dict, a state object, a class
                out.append((f"{prefix}{name}", functools.partial(dict.get, glob, name, _EMPTY)))
        if getattr(f, "__defaults__", None):
            out.append((f"{prefix}defaults", functools.partial(getattr, f, "__defaults__")))
    return out


CODE_TYPES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
              types.MethodType, functools.partial, type)
"""Globals that are code, not state: the functions, classes and Python modules a function
calls."""


def _context_value(var: Any) -> Any:
    return var.get(_EMPTY)


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _EMPTY


_EMPTY = object()


class StateGuard:
    """The Python state a function's recordings depend on, as one comparable tuple.

    Example::

        guard = StateGuard(fn)
        key = guard.key(())          # changes when a module is retrained, a parameter
                                     # replaced or frozen, a hook added, an attribute set
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._getters = _getters(fn)
        self._root_ids: tuple[int, ...] | None = None
        self.modules: list[torch.nn.Module] = []
        self._attrs: list[tuple[str, ...]] = []
        self._children: list[tuple[int, ...]] = []
        self._params: list[Any] = []
        self._sizes: list[int] = []
        self._roots: list[torch.nn.Module] = []
        self._objects: list[Any] = []
        self._classes: list[tuple[type, tuple[str, ...]]] = []
        self._held: tuple = ()  # what _find_objects last looked at (_holdings)
        self._public: list[tuple[dict, tuple[str, ...]]] = []
        self._types: list[type] = []
        self._epoch = -1
        self._modules_key: int = -1  # a token for the last walk (see _token)
        self._parts: tuple[tuple, ...] = ()  # the last walk, a part a call (see key)
        self._calls = 0
        # set when a periodic walk found a change made behind nn.Module's back: from then
        # on every call walks (see key)
        self.behind_back = False

    def bound_objects(self) -> tuple[Any, ...]:
        """What the function carries or names now (its self, closure cells, globals)."""
        return tuple(g() for _, g in self._getters)

    def roots(self, leaves: list[Any]) -> list[tuple[str, torch.nn.Module]]:
        """The modules a call can reach: bound ones, then module arguments."""
        out: list[tuple[str, torch.nn.Module]] = []
        seen: set[int] = set()
        candidates = [(n, g()) for n, g in self._getters]
        candidates += [(f"arg{i}", leaf) for i, leaf in enumerate(leaves)]
        for name, value in candidates:
            if isinstance(value, torch.nn.Module) and id(value) not in seen:
                seen.add(id(value))
                out.append((name, value))
        return out

    def _rebuild(self, roots: list[torch.nn.Module]) -> None:
        self._roots = list(roots)
        modules: dict[int, torch.nn.Module] = {}
        for root in roots:
            for m in root.modules():
                modules.setdefault(id(m), m)
        self.modules = list(modules.values())
        self._children = [tuple(map(id, m._modules.values())) for m in self.modules]
        # (a None slot is in the walk: the ids of each module's parameters)
        self._params = [p for m in self.modules for p in m._parameters.values() if p is not None]
        self._attrs = [_plain_attrs(m) for m in self.modules]
        self._sizes = [len(m.__dict__) for m in self.modules]
        self._find_objects()

    def _find_objects(self) -> None:
        """The plain objects the modules hold (``self.config``, a hook object) and the
        user's module classes with plain class attributes: both change without a module
        setattr, so ``key`` reads them on every call."""
        objects: dict[int, Any] = {}
        for m in self.modules:
            for k, v in m.__dict__.items():
                if not k.startswith("_") and is_stateful(v):
                    objects.setdefault(id(v), v)
                elif k.endswith("hooks") and isinstance(v, dict):  # a hook object's own
                    for h in v.values():  # attributes (`self.scale` read by its __call__)
                        if not isinstance(h, types.FunctionType) and users_object(h):
                            objects.setdefault(id(h), h)
        self._objects = list(objects.values())
        classes = {id(type(m)): type(m) for m in self.modules}
        self._classes = [(c, names) for c in classes.values()
                         if not c.__module__.startswith("torch.") and (names := tuple(
                             k for k, v in c.__dict__.items()
                             if not k.startswith("_") and isinstance(v, _SCALARS)))]
        self._public = [(m.__dict__, tuple(k for k in m.__dict__ if not k.startswith("_")))
                        for m in self.modules]
        self._types = [c for c in classes.values() if not c.__module__.startswith("torch.")]
        self._held = self._holdings()

    def _holdings(self) -> tuple:
        """What :meth:`_find_objects` reads, cheaply: each module's number of attributes and
        the identity of its public ones, and of the values in each of its module classes
        it reads. While these stay the same, so do the objects and class attributes it
        finds (its is_stateful checks took 1.0 of the 1.3 ms a walk of a 6-layer T5 took on
        a 2-core CPU, every 16 calls)."""
        return (tuple([len(d) for d, _ in self._public]),
                tuple([id(d.get(k)) for d, keys in self._public for k in keys]),
                tuple([id(v) for c in self._types for v in c.__dict__.values()]))

    def requires_grad(self) -> tuple[bool, ...]:
        """Which parameters of the modules last keyed require grad (a followed plan's key
        holds it: its pieces' autograd depends on it, while its Python runs anyway)."""
        return tuple(map(_REQUIRES_GRAD, self._params))

    def key(self, arg_modules: tuple[torch.nn.Module, ...] = ()) -> tuple:
        """The current state, as a tuple equal to an earlier one iff nothing changed.

        The walk over every module runs only when some module changed since the last
        walk (``module_epoch``); otherwise it is reused, and only what changes without a
        module setattr is read again: parameters' requires_grad, global hooks, bound values.
        """
        bound = [g() for _, g in self._getters]
        roots = [v for v in bound if isinstance(v, torch.nn.Module)] + list(arg_modules)
        ids = tuple(map(id, roots))
        epoch = _EPOCH[0]
        if ids != self._root_ids or epoch != self._epoch:
            if ids != self._root_ids:
                self._rebuild(roots)
                self._root_ids = ids
            self._parts = self._walk()
            self._modules_key = _token(self._parts)
            self._epoch = epoch
        elif self.modules:
            # A write behind nn.Module's back (m._parameters[k] = p, m.__dict__[k] = v)
            # bumps no epoch: each call walks one of _RECHECK parts of the modules, so each
            # module is looked at every _RECHECK calls, and all of them on every call once
            # a change was seen (the compiled function warns). (Walked whole every 16th
            # call, the walk made that call 1.5 ms slower for vit_b_16 and 7 ms for
            # maxvit_t on an H200 host: above the 1.25x eager that issue 38 allows a call.)
            self._calls += 1
            part = self._calls % _RECHECK
            if self.behind_back or self._walk_part(part) != self._parts[part]:
                parts = self._walk()
                token = _token(parts)
                if token != self._modules_key:
                    self._parts, self._modules_key, self.behind_back = parts, token, True
            elif part == 0 and self._holdings() != self._held:
                self._find_objects()
        out: list[Any] = [ids, self._modules_key,
                          tuple(map(_REQUIRES_GRAD, self._params))]
        append = out.append
        if self.modules:
            for hooks in _global_hooks():
                append(tuple(map(id, hooks.values())) if hooks else ())
        for v in bound:
            if isinstance(v, tuple):  # defaults
                append(tuple(map(_value_key, v)))
            else:
                append(_value_key(v))
        if self._objects:  # plain objects modules hold (a config), read each call: their
            # own attributes only (a transformers config has dozens, some of them dicts)
            append(tuple(map(_attributes_key, self._objects)))
        for cls, names in self._classes:  # class attributes of the user's module classes
            d = cls.__dict__
            append(tuple(_scalar_key(d.get(n)) for n in names))
        return tuple(out)

    def unchecked(self, pairs: list[tuple[dict, str]]) -> str | None:
        """Why a replay could miss a change to what the function names, or None: a value
        it (or a helper, ``pairs`` as for :meth:`watch_globals`) names holds a container
        too large to key by its items on every call. Such a function is followed (its
        Python runs on every call), which costs speed, never results."""
        named = [(n, g()) for n, g in self._getters]
        named += [(name, _named_value(glob, name, None)) for glob, name in pairs]
        for name, value in named:
            if isinstance(value, (dict, list, tuple, bytearray, set)) or is_stateful(value):
                found = too_large(value)
                if found is not None:
                    return (f"names `{name}`, which holds a {type(found).__name__} of "
                            f"{len(found)} items: too many to check on every call")
        return None

    def watch_context(self, variables: list[Any]) -> bool:
        """Also check the context variables a call read (``ContextVar.get``); returns
        whether any was new."""
        known = {id(g.args[0]) for _, g in self._getters
                 if isinstance(g, functools.partial) and g.func is _context_value}
        new = [v for v in variables if id(v) not in known]
        self._getters += [(v.name, functools.partial(_context_value, v)) for v in new]
        return bool(new)

    def watch_environ(self, names: list[str]) -> bool:
        """Also check the environment variables a call read (``os.environ.get(name)``);
        returns whether any was new."""
        known = {g.args[0] for _, g in self._getters
                 if isinstance(g, functools.partial) and g.func == os.environ.get}
        new = [n for n in dict.fromkeys(names) if n not in known]
        self._getters += [(f"os.environ[{n!r}]", functools.partial(os.environ.get, n))
                          for n in new]
        return bool(new)

    def watch_globals(self, pairs: list[tuple[Any, str]]) -> bool:
        """Also check the globals ``(globals dict, name)`` and closure cells ``(cell,
        name)`` that other functions the call entered read (a helper reading a global
        flag, a hook reading its closure's list); returns whether any was new."""
        known = {(id(g.args[0]), g.args[1]) for _, g in self._getters
                 if isinstance(g, functools.partial) and g.func in (dict.get, _cell_get)}
        added = False
        for glob, name in pairs:
            value = _named_value(glob, name)
            if (id(glob), name) in known or value is _EMPTY or isinstance(value, CODE_TYPES) \
                    and not (isinstance(value, type) and user_class(value)):
                continue
            known.add((id(glob), name))
            get = dict.get if isinstance(glob, dict) else _cell_get
            self._getters.append((name, functools.partial(get, glob, name, _EMPTY)))
            added = True
        return added

    def _walk(self) -> tuple[tuple, ...]:
        """Every module's flags, parameters, buffers, children, hooks and attributes, in
        ``_RECHECK`` parts (:meth:`_walk_part`)."""
        while True:
            parts = []
            for part in range(_RECHECK):
                walked = self._walk_part(part)
                if walked is None:  # the modules were listed again: walk them again
                    break
                parts.append(walked)
            else:
                if self._holdings() != self._held:
                    self._find_objects()
                return tuple(parts)

    def _walk_part(self, part: int) -> tuple | None:
        """The walk of every ``_RECHECK``-th module from the ``part``-th; None if a module's
        children changed (the modules are then listed again)."""
        out: list[Any] = []
        append = out.append
        modules, all_attrs, sizes = self.modules, self._attrs, self._sizes
        for i in range(part, len(modules), _RECHECK):
            m, attrs, children = modules[i], all_attrs[i], self._children[i]
            d = m.__dict__
            if len(d) != sizes[i]:  # an attribute was added or deleted: list them again
                attrs = all_attrs[i] = _plain_attrs(m)
                sizes[i] = len(d)
            append(d.get("training"))
            append(tuple(map(id, d["_parameters"].values())))
            append(tuple(map(id, d["_buffers"].values())))
            now = tuple(map(id, d["_modules"].values()))
            if now != children:  # a submodule was replaced, added or removed
                self._rebuild([m for m in self._roots])
                return None
            append(now)
            for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                         "_backward_pre_hooks"):
                hooks = d.get(name)
                append(tuple(map(id, hooks.values())) if hooks else ())
            for name in attrs:
                v = d.get(name, _EMPTY)
                t = type(v)
                if t is bool or t is int or t is str or v is None:  # _scalar_key's, inline
                    append((t, v))
                else:
                    append(_scalar_key(v) if isinstance(v, _SCALARS) else id(v))
        return tuple(out)


def _cell_get(cell: Any, name: str, default: Any) -> Any:
    """A closure cell's value (``name``: the free variable's), or ``default`` if empty."""
    try:
        return cell.cell_contents
    except ValueError:
        return default


def _named_value(where: Any, name: str, default: Any = _EMPTY) -> Any:
    """The value of a global (``where``: a globals dict) or a closure cell (a cell)."""
    return where.get(name, default) if isinstance(where, dict) else \
        _cell_get(where, name, default)


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_RECHECK = 16  # calls between walks of an unchanged epoch (StateGuard.key)
_TOKENS: dict[tuple, int] = {}
_NEXT_TOKEN = itertools.count()


def _token(walked: tuple) -> int:
    """A small int standing for ``walked`` (a model's walk: thousands of entries), the same
    for equal walks while remembered. Keys holding it hash in constant time: every call
    hashes its key (resnet50's walk took 10 us to hash on a 2-core CPU, each call).
    Tokens are never reused, so forgetting (past 1024 walks) costs misses, not mix-ups."""
    found = _TOKENS.get(walked)
    if found is None:
        if len(_TOKENS) >= 1024:
            _TOKENS.clear()
        found = _TOKENS[walked] = next(_NEXT_TOKEN)
    return found


_FLAT = frozenset({bool, int, float, str, type(None)})


def _attributes_key(obj: Any, depth: int = 2) -> tuple:
    """An object's own attributes, scalars by value and the rest by identity, and an
    object of the user's own class among them the same way, ``depth`` levels down
    (``self.cfg.inner.temp``): cheap enough for every call (a transformers config, read
    through ``object`` so its own ``__getattribute__`` stays out of it)."""
    if isinstance(obj, (dict, list, set, bytearray)):
        return contents_key(obj)  # a container the module holds: its items
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return (id(obj),)
    out: list[Any] = []
    append = out.append
    for v in d.values():
        if v.__class__ in _FLAT:
            append(v)
        elif depth > 1 and user_class(type(v)):  # (users_object's test)
            append((id(v), _attributes_key(v, depth - 1)))
        else:
            append(id(v))
    return tuple(out)


# How _value_key keys a value, by its type (the guard keys the same few types each call;
# deciding took 2.2 of a logging.Logger's 5.0 us on a 2-core CPU, five a T5 call)
_SCALAR, _ID, _TENSOR, _OPTIMIZER, _CLASS, _CONTENTS, _LENGTH, _ATTRIBUTES = range(8)
_KINDS: dict[type, int] = {}


def _kind(v: Any) -> int:
    if isinstance(v, _SCALARS):
        return _SCALAR
    if isinstance(v, torch.Tensor):  # a global or closure tensor: requires_grad can flip
        return _TENSOR
    if isinstance(v, torch.optim.Optimizer):
        return _OPTIMIZER
    if isinstance(v, type):
        return _CLASS
    if not is_stateful(v):
        return _ID
    if type(v) in (list, dict, set, bytearray) or users_object(v):
        return _CONTENTS
    if isinstance(v, (list, dict, set, bytearray)):  # a library's registry
        return _LENGTH
    # a library's object (a logging.Logger, a transformers registry): its own attributes
    # only; walking on into a Logger's manager cost 0.1-0.4 ms a call, and a transformers
    # model's helpers name five loggers
    return _ATTRIBUTES


def _value_key(v: Any) -> Any:
    """A key for a value a function reads (a global, a closure cell, a default): a
    scalar by value (:func:`_scalar_key`); otherwise its identity, and for a small
    container or plain object (a list a closure holds, a config) also its contents, which
    can change while the identity stays; for a tensor, whether it requires grad."""
    t = type(v)
    try:
        kind = _KINDS[t]
    except KeyError:
        kind = _kind(v)
        if len(_KINDS) < 4096:  # (classes made on the fly, in a loop: decided each time)
            _KINDS[t] = kind
    except TypeError:  # (a metaclass without __hash__)
        kind = _kind(v)
    if kind == _SCALAR:
        return _scalar_key(v)
    if kind == _ID:
        return id(v)
    if kind == _ATTRIBUTES:
        return (id(v), _attributes_key(v))
    if kind == _TENSOR:
        return (id(v), v.requires_grad)
    if kind == _CONTENTS:
        return (id(v), contents_key(v))
    if kind == _LENGTH:
        return (id(v), len(v))
    if kind == _OPTIMIZER:
        return (id(v), optimizer_key(v))
    return (id(v), contents_key(v)) if user_class(v) else id(v)  # a class


def _plain_attrs(m: torch.nn.Module) -> tuple[str, ...]:
    """The module's plain attributes a forward may read: numbers, strings, flags, tensors."""
    return tuple(k for k, v in m.__dict__.items()
                 if k not in _MODULE_INTERNALS and not k.endswith("hooks")
                 and isinstance(v, (*_SCALARS, torch.Tensor)))


def _global_hooks() -> list[Any]:
    from torch.nn.modules import module as mm

    return [getattr(mm, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks")]


# ---------------------------------------------------------------------- the module epoch
# A counter bumped by every change to any module made through nn.Module's own methods
# (attribute assignment and deletion, registering parameters, buffers, submodules and
# hooks, removing a hook), so a guard re-walks a model only after one of them. The
# wrappers only count; each calls the original method. Changes made behind nn.Module's
# back (writing m.__dict__ or m._parameters directly) bump nothing: a guard walks every
# _RECHECK calls anyway and, once it saw one, on every call (StateGuard.key).
_EPOCH = [0]
_COUNTED = ("__setattr__", "__delattr__", "register_parameter", "register_buffer",
            "register_module", "add_module", "register_forward_hook",
            "register_forward_pre_hook", "register_full_backward_hook",
            "register_full_backward_pre_hook", "register_backward_hook")


def _counting(method: Any) -> Any:
    @functools.wraps(method)
    def counted(*args: Any, **kwargs: Any) -> Any:
        _EPOCH[0] += 1
        return method(*args, **kwargs)
    counted.__fxlite_counted__ = True  # type: ignore[attr-defined]
    return counted


def _install_epoch() -> None:
    from torch.utils.hooks import RemovableHandle

    for name in _COUNTED:
        method = torch.nn.Module.__dict__.get(name)
        if method is not None and not getattr(method, "__fxlite_counted__", False):
            setattr(torch.nn.Module, name, _counting(method))
    remove = RemovableHandle.__dict__.get("remove")
    if remove is not None and not getattr(remove, "__fxlite_counted__", False):
        RemovableHandle.remove = _counting(remove)


_install_epoch()


def tensor_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """Torch's C++ guard over ``tensors``' class, dtype, device, requires_grad, sizes and
    strides (``guard.check(*others)``: whether ``others`` match them all), or None where
    this torch has no such guard or it does not accept ``tensors``. It keeps no reference
    to them."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        guard = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])
        return guard if guard.check(*tensors) else None
    except Exception:  # another torch's private API: the caller compares in Python
        return None


class LayoutCheck:
    """Whether a call's arguments have the layout of the call this check was made from:
    the same count, the same type where not a tensor, and tensors of the same class,
    dtype, device, requires_grad, sizes and strides (the layout key's fields and more).

    Torch's C++ tensor guard (:func:`tensor_guard`) compares the tensors: a training
    step's segment takes about 126 of them, whose key took 94 us to compute on an H200's
    host; the guard reads them in a fraction of that. It keeps no reference to any tensor
    (a reference would change the counts that replays compare). Where this torch has no
    such guard, ``ok`` is False and the key is computed instead.
    """

    __slots__ = ("count", "tensors", "same", "others", "guard", "ok")

    def __init__(self, args: tuple) -> None:
        self.count = len(args)
        # torch's guard refuses one tensor given twice (a shared zero tangent of a
        # BatchNorm's backward): it sees each tensor once, and a later place of one
        # must hold that tensor again (``same``: (place, its first place))
        first: dict[int, int] = {}
        self.tensors: list[int] = []
        self.same: list[tuple[int, int]] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                j = first.setdefault(id(a), i)
                if j == i:
                    self.tensors.append(i)
                else:
                    self.same.append((i, j))
        self.others = [(i, type(a)) for i, a in enumerate(args)
                       if not isinstance(a, torch.Tensor)]
        self.guard = tensor_guard([args[i] for i in self.tensors])
        self.ok = self.guard is not None  # whether the guard can decide (else compare keys)

    def __call__(self, args: tuple) -> bool:
        """True when ``args`` has this layout (only meaningful where ``ok``)."""
        if len(args) != self.count:
            return False
        for i, kind in self.others:
            if type(args[i]) is not kind:
                return False
        for i, j in self.same:
            if args[i] is not args[j]:
                return False
        try:
            return bool(self.guard.check(*[args[i] for i in self.tensors]))
        except Exception:  # a tensor where a non-tensor was, or the reverse
            return False
