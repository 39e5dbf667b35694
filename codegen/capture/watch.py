"""The recording watcher: proof that a recording may be replayed without its Python.

A replay runs the recorded tensor ops and skips the Python between them. That is only
faithful when the Python did nothing a later call would need done again: no side effect
(appending to a list, printing, logging, warning, bumping a counter), no value that
changes by itself between calls (``random.random()``, ``time.time()``, ``next(it)``), and
no read of Python state the guards do not see. :class:`Watch` runs around the recording
call with Python's profile hook (``sys.setprofile``), which sees every Python function
entered and every C function called, and inspects the bytecode of each user function it
enters. Frames of torch and of fxlite are trusted and not looked into.

What it finds, with the user's line:

- **effects** (``Watch.effect``): a call of ``print``, ``input``, ``open``, ``exec``,
  ``eval``, a ``warnings.warn``, a write to a file or stream, a draw from Python's or
  numpy's random generators, a read of the clock, ``next()`` of an iterator the call did
  not just make, entering ``logging`` or ``random``, assigning a global or a ``nonlocal``,
  resuming a generator made before the call, setting a torch generator's state
  (``torch.default_generator.set_state``, ``torch.set_rng_state``), assigning ``.real``
  or ``.imag`` (a tensor write in C that the recorder's mode does not see); a result a
  replay cannot rebuild (a closure made in the call, a tensor with Python attributes);
  and, compared after the call, a change to a container (a deque too) or object that
  existed before it and that the user's functions name (their globals and closure cells,
  :meth:`Watch.changed`), or to the Python attributes of a tensor they name.
- **reads** (``Watch.names``): the globals that the user's functions other than the
  compiled one name (``(globals dict, name)`` pairs), so the guards check them too.

The first effect is enough: such a recording runs in eager PyTorch on later calls, with
one warning naming that line (``fxlite.compile``).

Example::

    with Watch() as watch:
        fn(x)
    watch.effect   # 'calls print()\\n  File "train.py", line 12, in step\\n    print(loss)'
"""

from __future__ import annotations

import builtins
import collections
import contextvars
import dis
import functools
import gc
import importlib.util
import inspect
import linecache
import os
import random
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from fxlite.codegen.capture.records import LIB_DIRS, format_site
from fxlite.codegen.capture.structure import flatten

__all__ = ["Watch", "contents_key", "is_stateful", "optimizer_key", "too_large", "user_class",
           "users_object"]

_STDLIB = os.path.dirname(os.__file__) + os.sep
def _library_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) + os.sep if spec is not None and spec.origin else ""


_NUMPY, _TRITON = _library_dir("numpy"), _library_dir("triton")
# torch's and fxlite's files, generated forward()s and Python's import machinery; Triton's
# frames too: its interpreter (TRITON_INTERPRET=1) runs the kernels a first backward
# compiles and checks inside a recorded call, and keeps state of its own
_TRUSTED = (*LIB_DIRS, *((_TRITON,) if _TRITON else ()), "<fxlite", "<frozen importlib")
_KERNEL_FILE = "fxlite_kernel_"  # a generated kernel's source in the cache folder (cache.py)
_FROZEN = "<frozen "  # a frozen standard-library module: "<frozen os>"
# torch's wrappers around its own functions (torch._dynamo's disable: eval_frame._fn)
_WRAPPERS = (os.path.join("torch", "_dynamo", "eval_frame.py"),
             os.path.join("torch", "_compile.py"))
# Standard-library modules whose functions act on the world or on hidden state.
_EFFECT_MODULES = {"logging": "logs a message", "random": "draws Python random numbers",
                   "secrets": "draws random numbers", "uuid": "makes a uuid",
                   "tempfile": "makes a temporary file", "shutil": "changes files",
                   "subprocess": "runs a process", "pprint": "prints",
                   "os": "reads the environment or the file system"}
# ``os`` functions that read one environment variable: guarded, not effects
# (``os.environ.get(k)`` and ``k in os.environ`` enter ``os`` through ``__getitem__``)
_ENVIRON_READS = frozenset({"__getitem__", "getenv"})
_OS_FILES = frozenset({os.getenv.__code__.co_filename})  # "<frozen os>" or os.py's path
# C functions, by module (or, for bound methods, their object's type's module).
_EFFECT_C_MODULES = {"time": "reads the clock", "_random": "draws Python random numbers",
                     "random": "draws Python random numbers", "_io": "reads or writes a file",
                     "io": "reads or writes a file", "_warnings": "warns",
                     "warnings": "warns",
                     "posix": "calls the operating system", "nt": "calls the operating system"}
_EFFECT_BUILTINS = {builtins.print: "calls print()", builtins.input: "calls input()",
                    builtins.open: "opens a file", builtins.exec: "calls exec()",
                    builtins.eval: "calls eval()", builtins.breakpoint: "calls breakpoint()",
                    # torch's settings that no key holds: a replay would use the first value
                    torch.get_num_threads: "reads torch's thread count",
                    torch.get_num_interop_threads: "reads torch's thread count"}
# torch.Generator methods that set its state, as torch.manual_seed does: a replay would
# not set it again, and the draws after them would differ from eager's
_GENERATOR_SETTERS = frozenset({"set_state", "manual_seed", "seed", "set_offset",
                                "graphsafe_set_state"})
# and the methods that read it: a replay would return the recording call's value
_GENERATOR_READERS = frozenset({"initial_seed", "get_state", "get_offset",
                                "graphsafe_get_state"})
# Tensor properties whose setters write the tensor's values without a torch function call
_WRITING_SETTERS = frozenset({"real", "imag"})
_GENERATOR = 0x20 | 0x200 | 0x100 | 0x80  # CO_GENERATOR, CO_ASYNC_GENERATOR, coroutines
_CALLS = {"CALL", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW", "CALL_KW",
          "CALL_FUNCTION_EX"}
_SKIP = {"PRECALL", "CACHE", "KW_NAMES", "PUSH_NULL", "EXTENDED_ARG", "NOP"}


class _Code:
    """What one code object's bytecode shows, computed once per code object."""

    __slots__ = ("stores", "instructions", "by_offset")

    def __init__(self, code: types.CodeType) -> None:
        self.instructions = list(dis.get_instructions(code))
        self.by_offset = {ins.offset: i for i, ins in enumerate(self.instructions)}
        self.stores: list[tuple[str, int | None]] = []  # (what, line)
        line = None
        for ins in self.instructions:
            line = ins.starts_line if isinstance(ins.starts_line, int) and \
                not isinstance(ins.starts_line, bool) else getattr(ins, "line_number", line)
            if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                self.stores.append((f"assigns the global {ins.argval}", line))
            elif ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in code.co_freevars:
                self.stores.append((f"assigns the nonlocal {ins.argval}", line))
            elif ins.opname == "STORE_ATTR" and ins.argval in _WRITING_SETTERS:
                # x.real = 10 writes a tensor's values in C, unseen by the recorder's mode
                self.stores.append((f"assigns .{ins.argval} (of a tensor: writes its values)",
                                    line))

    def fresh_argument(self, lasti: int) -> bool:
        """Whether the single argument of the call at ``lasti`` is the result of another
        call (``next(iter(x))``, ``next(self.parameters())``): an iterator the caller
        just made, not one that outlives the call."""
        i = self.by_offset.get(lasti)
        if i is None:
            return False
        i -= 1
        while i >= 0 and self.instructions[i].opname in _SKIP:
            i -= 1
        return i >= 0 and self.instructions[i].opname in _CALLS


class _Held(NamedTuple):
    """A container or object the call's Python names or reaches, held for ``changed``."""

    ref: Callable[[], Any]  # a reference to it
    before: Any  # its contents when held (``contents_key``)
    name: str
    site: Any  # where the user's code named it, or None where the call reaches it


class Watch:
    """Watches one recording call (a context manager; see the module docstring).

    Attributes:
        effect: the first effect found, with the user's line, or None.
        names: ``(globals, name)`` pairs the user's functions named, beyond the compiled
            function's own, whose values the guards should check.
        context_vars: the context variables the call read, which the guards check too.
        environ: the names of the environment variables the call read, which the guards
            check too.
    """

    _codes: dict[types.CodeType, _Code] = {}

    def __init__(self, own: Any = None, recorder: Any = None) -> None:
        self.effect: str | None = None
        # while ``recorder.off``, the recorder runs a call that every replay runs again
        # whole (an optimizer's step with its hooks): its Python is not skipped
        self._recorder = recorder
        self.names: list[tuple[Any, str]] = []  # (globals dict or closure cell, name)
        self.context_vars: list[contextvars.ContextVar] = []  # read: to guard
        self.environ: list[str] = []  # environment variables read: to guard
        self._own = getattr(own, "__code__", None)
        self._seen: set[types.CodeType] = set()
        # generator frames started during the call, by id (held while their generator
        # lives, so that no other frame has that id meanwhile; see _let_go)
        self._frames: dict[int, Any] = {}
        self._returned: list[int] = []  # of those, ids that returned (maybe for good)
        self._containers: list[_Held] = []
        self._named: dict[int, int] = {}  # id -> its place in _containers
        # id -> (a weak reference to it, its attributes)
        self._tensors: dict[int, tuple[weakref.ref, tuple]] = {}
        self._top: Any = None  # the compiled function's frame: its result is looked at
        self._old: Callable[..., Any] | None = None
        self._first = True
        self._random: tuple = ()
        self._ignored: set[Any] = set()
        self._outside: Any = None

    # ------------------------------------------------------------------ the hook
    def __enter__(self) -> Watch:
        self._random = _random_states()
        self._context = _context_state()
        # garbage-collector callbacks run wherever a collection happens: not the call's
        self._ignored = {getattr(cb, "__code__", None) for cb in gc.callbacks}
        self._old = sys.getprofile()
        self._outside = sys._getframe(1)  # where the call is made: frames from here up
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._outside = None  # (a frame: not kept past the call)
        old = self._old
        if old is None or callable(old):
            sys.setprofile(old)
        else:  # a profiler in C (cProfile): getprofile gives its object, not a function,
            sys.setprofile(None)  # which setprofile would call on every event (a crash)
            enable = getattr(old, "enable", None)
            if enable is not None:
                enable()  # it installs its own hook again, keeping its statistics
        self._frames.clear()
        self._returned.clear()

    def _event(self, frame: Any, event: str, arg: Any) -> None:
        if self.effect is not None or self._recorder is not None and self._recorder.off \
                or frame.f_code in self._ignored:
            return
        if event == "call":
            if self._returned:
                self._let_go()
            self._enter(frame)
        elif event == "c_call":
            self._c_call(frame, arg)
        elif event == "return":
            if frame is self._top:
                self._top = None
                what = _unreplayable_result(arg)
                if what is not None:
                    self._found(what, frame)
            elif id(frame) in self._frames:
                if id(frame) not in self._returned:  # (yielded, returned or closed)
                    self._returned.append(id(frame))

    def _let_go(self) -> None:
        """Forget the held generator frames whose generator is gone. Held to the call's
        end, they kept what they saw alive: the genexpr of ModelOutput's
        ``all(... for field in ...)`` held a transformers output, and with it a GPT-2
        step's logits (0.38 GiB) through the backward, where eager had freed them. A
        forgotten frame's id may come back as another frame's; a generator resumed in
        such a frame is taken as made before the call (an effect: followed), never the
        other way round."""
        alive = []
        for fid in self._returned:
            frame = self._frames.get(fid)
            # references: the dict, this name and getrefcount's argument; a live
            # generator adds its own (looked at again at the next call)
            if frame is not None and sys.getrefcount(frame) > 3:
                alive.append(fid)
            else:
                self._frames.pop(fid, None)
        frame = None  # (not one more reference until the next look)
        self._returned[:] = alive

    def _found(self, what: str, frame: Any, line: int | None = None) -> None:
        self.effect = f"{what}\n  {format_site(_site(frame, line))}"

    def _enter(self, frame: Any) -> None:
        code = frame.f_code
        name = code.co_filename
        if name.startswith(_TRUSTED) or _KERNEL_FILE in name:
            found = _torch_functions().get(code)
            if found is not None:
                caller = _caller(frame)
                if caller is None or caller.f_code.co_filename.startswith(_TRUSTED):
                    return  # torch's or fxlite's own call
                stops, what = found
                if not stops:
                    self._found(what, caller)
                elif self._recorder is not None:  # the call runs in eager
                    self._recorder.stop(what, _site(caller))
            return
        if name.startswith((_STDLIB, _FROZEN)):
            module = name[len(_FROZEN):-1] if name.startswith(_FROZEN) else \
                name[len(_STDLIB):].split(os.sep)[0].removesuffix(".py")
            what = _EFFECT_MODULES.get(module)
            if module == "os" and (_in_os(frame.f_back) or self._read_environ(frame)):
                return  # judged with the os call around it; a read of one variable: guarded
            caller = _user_frame(frame)
            if what is not None and caller is not None and not \
                    caller.f_code.co_filename.startswith(_TRUSTED) and not _importing(frame):
                self._found(what, caller)  # the user's call, not torch's or an import's
            return
        if code.co_flags & _GENERATOR:
            if id(frame) not in self._frames:
                if frame.f_lasti > 8:  # resumed past a yield: it was made before the call
                    self._found("resumes a generator made before the call, which a replay "
                                "would not advance", frame.f_back or frame)
                    return
                self._frames[id(frame)] = frame
        if code not in self._seen:
            self._seen.add(code)
            info = self._codes.get(code)
            if info is None:
                if len(self._codes) > 4096:
                    self._codes.clear()
                info = self._codes[code] = _Code(code)
            if info.stores:
                what, line = info.stores[0]
                self._found(f"{what}, which a replay would not do again", frame, line)
                return
            self._name_globals(frame, code, code is self._own)
            self._name_closure(frame, code)
            if self._first:  # the compiled function's (or forward's): its arguments
                self._first = False
                if self._own is None or code is self._own:
                    self._top = frame  # its result is looked at as it returns
                for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
                    if name in frame.f_locals:
                        self.hold(frame.f_locals[name], name, frame)

    def _read_environ(self, frame: Any) -> bool:
        """Whether ``frame`` (in ``os``) reads one environment variable
        (``os.environ.get(k)``, ``os.environ[k]``, ``k in os.environ``, ``os.getenv(k)``); if
        so its name goes into ``environ``, for the guards. transformers reads
        ``TRANSFORMERS_SDPA_FORCE_GQA`` in each attention call of a Llama-style model with
        grouped heads: as an effect, the whole model was followed rather than replayed."""
        code, local = frame.f_code, frame.f_locals
        if code.co_name not in _ENVIRON_READS or (
                code.co_name != "getenv" and local.get("self") is not os.environ):
            return False
        key = local.get("key")
        if type(key) is not str:
            return False
        if key not in self.environ:
            self.environ.append(key)
        return True

    def _c_call(self, frame: Any, fn: Any) -> None:
        caller = frame.f_code.co_filename
        if caller.startswith((*_TRUSTED, _STDLIB, _FROZEN)):
            return  # trusted, or (the standard library) judged by the module entered
        if _NUMPY and caller.startswith(_NUMPY) and _run_by_triton(frame):
            return
        what = _EFFECT_BUILTINS.get(fn) if type(fn) is types.BuiltinFunctionType else None
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, contextvars.ContextVar):
            if fn.__name__ == "get" and all(owner is not v for v in self.context_vars):
                self.context_vars.append(owner)  # read: guarded (its sets: seen after)
            return
        if what is None:
            if fn is builtins.next:
                info = self._codes.get(frame.f_code)
                if info is None or not info.fresh_argument(frame.f_lasti):
                    what = "calls next() on an iterator made before the call"
            else:
                what = _effect_of(fn)
        if what is not None:
            self._found(f"{what}, which a replay would not do again", frame)

    # ------------------------------------------------------------------ Python state
    def _name_globals(self, frame: Any, code: types.CodeType, own: bool) -> None:
        glob = frame.f_globals
        for name in code.co_names:
            if name in glob:
                if not own:
                    self.names.append((glob, name))
                self.hold(glob[name], name, frame)

    def _name_closure(self, frame: Any, code: types.CodeType) -> None:
        if not code.co_freevars:
            return
        local = frame.f_locals
        for name in code.co_freevars:
            if name in local:
                self.hold(local[name], name, frame)
        if not code.co_flags & _GENERATOR and any(
                is_stateful(local.get(name)) for name in code.co_freevars):
            # a helper or hook reading a list or object its closure holds (box[0]): its
            # cells are read like globals, and guarded (found through the function, once)
            self.names += _cells(frame, code, self._outside)

    def hold(self, value: Any, name: str, frame: Any = None) -> None:
        """Remember the state of a container or object the user's code names (in
        ``frame``, or, without one, that the call reaches: a module's ``self.calls``)."""
        if isinstance(value, (torch.Tensor, list, tuple, dict)):
            self._hold_tensors(value)
        known = self._named.get(id(value))
        if known is not None and self._containers[known].ref() is not value:
            known = None  # (another object, since died, had its id)
        if known is not None and (frame is None or self._containers[known].site is not None) \
                or not is_stateful(value):
            return
        site = None
        if frame is not None:
            code = frame.f_code
            site = (code.co_filename, code.co_firstlineno, code.co_name,
                    linecache.getline(code.co_filename, code.co_firstlineno).strip())
        if known is not None:  # held as reached; now named by the user's code: say so
            self._containers[known] = self._containers[known]._replace(name=name, site=site)
            return
        self._named[id(value)] = len(self._containers)
        self._containers.append(_Held(_ref(value), contents_key(value), name, site))

    def _hold_tensors(self, value: Any) -> None:
        """Remember the Python attributes of ``value``'s tensors (it, or its items one
        level down): ``x.flag = True`` on a tensor that outlives the call is an effect."""
        if isinstance(value, torch.Tensor):
            items: Any = (value,)
        elif len(value) > _LARGE:
            return
        else:
            items = value.values() if isinstance(value, dict) else value
        for t in items:
            if isinstance(t, torch.Tensor):
                held = self._tensors.get(id(t))
                if held is None or held[0]() is not t:
                    self._tensors[id(t)] = (weakref.ref(t), _attributes(t))

    def changed(self) -> str | None:
        """After the call: the first container or object named by the user's code whose
        contents changed during it, as a phrase; None if none did."""
        for ref, before, name, site in self._containers:
            value = ref()
            if value is not None and contents_key(value) != before:
                where = f"\n  {format_site(site)}" if site is not None else ""
                if type(before) is tuple and before[:1] == ("numpy random state",):
                    return (f"draws from the numpy random generator {name}, which a replay "
                            f"would not do again{where}")
                return (f"changes the {type(value).__name__} {name} that outlives the call, "
                        f"which a replay would not do again{where}")
        for ref, before in self._tensors.values():
            t = ref()
            if t is not None and _attributes(t) != before:
                return ("sets a Python attribute of a tensor that outlives the call, which a "
                        "replay would not do again")
        if _context_state() != self._context:  # set and not reset (transformers resets)
            return "sets a context variable, which a replay would not do again"
        if _random_states() != self._random:  # numpy's are Cython: no profile events
            return "draws numpy or Python random numbers, which a replay would not do again"
        return None


def _ref(value: Any) -> Callable[[], Any]:
    """A weak reference to ``value`` where it takes one, else a strong one. What the call
    names it watches for changes that outlive the call; one that dies during it cannot,
    and holding it would keep its tensors alive (a transformers output's logits, 0.38 GiB
    in a GPT-2 step, lived on through the backward)."""
    try:
        return weakref.ref(value)
    except TypeError:  # a plain list, dict or tuple
        return lambda: value


def _importing(frame: Any) -> bool:
    """Whether ``frame`` runs inside an import (which happens once, as in eager)."""
    f = frame
    while f is not None:
        if f.f_code.co_filename.startswith("<frozen importlib"):
            return True
        f = f.f_back
    return False


def _context_state() -> tuple:
    """The current context's variables and their values, by identity."""
    return tuple((id(k), id(v)) for k, v in contextvars.copy_context().items())


def _random_states() -> tuple:
    """Python's and (when imported) numpy's global random states, to compare."""
    np = sys.modules.get("numpy")
    state = random.getstate()
    if np is None:
        return (state,)
    kind, keys, pos, *rest = np.random.get_state()
    return state, pos, keys.tobytes()


def _in_os(frame: Any) -> bool:
    """Whether ``frame`` runs the ``os`` module's own code."""
    return frame is not None and frame.f_code.co_filename in _OS_FILES


def _run_by_triton(frame: Any) -> bool:
    """Whether numpy code runs for Triton's interpreter (``TRITON_INTERPRET=1``, as a
    first backward compiles and checks its kernels inside a recorded call), not for the
    user: the first frame past numpy's own is Triton's."""
    f = frame
    while f is not None and f.f_code.co_filename.startswith(_NUMPY):
        f = f.f_back
    return bool(_TRITON) and f is not None and f.f_code.co_filename.startswith(_TRITON)


def _cells(frame: Any, code: types.CodeType, outside: Any) -> list[tuple[Any, str]]:
    """``(cell, name)`` for each free variable of the function running in ``frame`` that
    holds a container or object made before the call: the function whose code is ``code``
    and whose cells hold the frame's values (a frame does not name its function; ``gc``
    finds it, once per recording and code). A cell of a function running in the call
    (the call made the closure: its values are the call's own) is left out, and so is
    its function's: a guard would keep them alive."""
    local = frame.f_locals
    running = set()
    f = frame.f_back
    while f is not None and f is not outside:  # the call's frames (``outside``: the caller's)
        for name in f.f_code.co_cellvars:
            running.add(id(f.f_locals.get(name)))
        f = f.f_back
    for fn in gc.get_referrers(code):
        if isinstance(fn, types.FunctionType) and fn.__code__ is code and fn.__closure__ \
                and all(c.cell_contents is local.get(n, c.cell_contents)
                        for n, c in zip(code.co_freevars, fn.__closure__)
                        if _filled(c)):
            return [(c, n) for c, n in zip(fn.__closure__, code.co_freevars)
                    if _filled(c) and is_stateful(c.cell_contents)
                    and id(c.cell_contents) not in running]
    return []


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


def _user_frame(frame: Any) -> Any:
    """The nearest frame outside the standard library (the user's call of it)."""
    f = frame
    while f is not None and f.f_code.co_filename.startswith((_STDLIB, _FROZEN)):
        f = f.f_back
    return f


def _attributes(t: torch.Tensor) -> tuple:
    """A tensor's Python attributes (``t.flag = 1``), by name and identity."""
    return tuple((k, id(v)) for k, v in t.__dict__.items())


def _unreplayable_result(result: Any) -> str | None:
    """Why the compiled function's result cannot be rebuilt by a replay, or None: a
    tensor carrying Python attributes (a replay returns new tensors without them), or a
    function holding state (a closure, a partial, a bound method), which a replay would
    return as the recording call's object.

    Example::

        _unreplayable_result(lambda: v + 1)   # 'returns a function, ...' (a closure)
        _unreplayable_result((x, 3))          # None
    """
    leaves, _ = flatten(result)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.__dict__:
            return ("returns a tensor with Python attributes, which a replay would not set "
                    "again")
        if isinstance(leaf, (functools.partial, types.MethodType)) or isinstance(
                leaf, types.FunctionType) and leaf.__closure__:
            return ("returns a function holding values of the call (a closure), which a "
                    "replay would return as the first call's")
    return None


def _caller(frame: Any) -> Any:
    """The frame that called ``frame``'s function, past torch's wrappers (Dynamo's) and
    the counting wrapper of guards.py around nn.Module's methods."""
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename.endswith(
            (*_WRAPPERS, os.path.join("capture", "guards.py"))):
        caller = caller.f_back
    return caller


_TORCH_FUNCTIONS: dict[types.CodeType, tuple[bool, str]] = {}


def _torch_functions() -> dict[types.CodeType, tuple[bool, str]]:
    """The code of torch's Python functions that the watcher does not otherwise look
    into but must see when the user calls them, each with whether the call then runs in
    eager (else it is followed) and why:

    - setting a generator's state (``torch.set_rng_state``, ``torch.manual_seed``) or
      reading it (``torch.initial_seed``, ``torch.get_rng_state``). (The recorder also
      compares ``torch.initial_seed()`` before and after, which misses a reseed to the
      seed already in place: ``torch.manual_seed(1)`` on every call.)
    - ``nn.Module``'s hook registrations: the hook is a function the call makes (it may
      hold the call's values), and a replay would keep the first call's. The call runs
      in eager."""
    if not _TORCH_FUNCTIONS:
        import torch.cuda.random as cuda_random
        import torch.random as cpu_random

        for fn in (cpu_random.set_rng_state, cpu_random.manual_seed, cpu_random.seed,
                   cuda_random.set_rng_state, cuda_random.set_rng_state_all,
                   cuda_random.manual_seed, cuda_random.manual_seed_all, cuda_random.seed,
                   cuda_random.seed_all):
            _TORCH_FUNCTIONS[fn.__code__] = (
                False, "sets a random generator's state, which a replay would not do again")
        for fn in (cpu_random.initial_seed, cpu_random.get_rng_state,
                   cuda_random.initial_seed, cuda_random.get_rng_state,
                   cuda_random.get_rng_state_all):
            _TORCH_FUNCTIONS[fn.__code__] = (
                False, "reads a random generator's state, which a replay would not do again")
        m = torch.nn.Module
        for fn in (m.register_forward_hook, m.register_forward_pre_hook,
                   m.register_full_backward_hook, m.register_full_backward_pre_hook,
                   m.register_backward_hook):
            # (the originals: guards.py wraps them all in one counting wrapper)
            _TORCH_FUNCTIONS[inspect.unwrap(fn).__code__] = (
                True, "registers a hook on a module")
    return _TORCH_FUNCTIONS


def _site(frame: Any, line: int | None = None) -> tuple[str, int, str, str]:
    """``frame``'s file, line (``line`` if given), function and source line."""
    code = frame.f_code
    lineno = line or frame.f_lineno
    return (code.co_filename, lineno, code.co_name,
            linecache.getline(code.co_filename, lineno).strip())


def _effect_of(fn: Any) -> str | None:
    """What calling the C function ``fn`` does to the world, or None if nothing known."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.Generator) and fn.__name__ in _GENERATOR_SETTERS:
        return "sets a random generator's state"
    if isinstance(owner, torch.Generator) and fn.__name__ in _GENERATOR_READERS:
        return "reads a random generator's state"
    module = getattr(fn, "__module__", None)
    if module is None and owner is not None:
        module = owner.__name__ if isinstance(owner, types.ModuleType) \
            else type(owner).__module__
    if not module:
        return None
    if module.startswith("numpy.random"):
        return "draws numpy random numbers"
    found = _EFFECT_C_MODULES.get(module)
    if found is None or module in ("_io", "io") and fn.__name__ not in (
            "write", "writelines", "read", "readline", "readlines", "flush", "truncate"):
        return None
    return found


_PLAIN = (bool, int, float, complex, str, bytes, type(None))
# Containers longer than this are keyed by length and identity alone (a guard reads
# them on every call; a config's attribute dict is below it)
_LARGE = 256
_DEPTH = 3  # levels of nested containers and objects looked into


def is_stateful(value: Any) -> bool:
    """A mutable container, plain object or user class whose contents (attributes) a
    call might read or change."""
    if isinstance(value, (list, dict, set, bytearray, collections.deque)):
        return True
    if isinstance(value, type):
        return user_class(value)
    if isinstance(value, (*_PLAIN, tuple, frozenset, type, types.ModuleType,
                          types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return False
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return False  # tensors are recorded; modules are guarded
    if type(value).__module__.startswith("numpy.random"):
        return _rng_key(value) is not None  # its state: what a draw changes
    return isinstance(getattr(value, "__dict__", None), dict) and \
        not type(value).__module__.startswith(("torch", "fxlite"))


def user_class(cls: type) -> bool:
    """A class of the user's (not torch's, fxlite's or the standard library's), whose
    plain class attributes (``Defaults.eps``) a call may read."""
    try:
        return _USER_CLASSES[cls]
    except KeyError:
        found = _USER_CLASSES[cls] = _user_class(cls)
        if len(_USER_CLASSES) > 4096:  # (classes made on the fly, in a loop)
            _USER_CLASSES.clear()
        return found
    except TypeError:  # (a metaclass without __hash__)
        return _user_class(cls)


# user_class by class: the guard asks it of the same few classes on every call (a
# transformers model's loggers and registries: 44 times a call of a T5 encoder)
_USER_CLASSES: dict[type, bool] = {}


def _user_class(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return not module.startswith(("torch", "fxlite", "builtins", "typing", "collections",
                                  "enum", "abc", "numpy", "transformers", "timm")) \
        and module.split(".")[0] not in sys.stdlib_module_names \
        and not issubclass(cls, (torch.nn.Module, BaseException))


def contents_key(value: Any, depth: int = 0) -> Any:
    """A comparable picture of ``value``'s contents: scalars by value, the rest by
    identity, containers one level down."""
    if isinstance(value, type):
        return tuple((k, _leaf(v, 1)) for k, v in value.__dict__.items()
                     if not k.startswith("__") and isinstance(v, _PLAIN))
    if isinstance(value, (dict, list, bytearray, set)) and len(value) > _LARGE:
        return (len(value), id(value))  # a log that grows: its length, not each item
    if isinstance(value, dict):
        return tuple((k if isinstance(k, _PLAIN) else id(k), _leaf(v, depth))
                     for k, v in value.items())
    if isinstance(value, (list, bytearray, collections.deque)):
        return (len(value), tuple(_leaf(v, depth) for v in value))
    if isinstance(value, set):  # (its items are hashable: a copy compares them, in C)
        return (len(value), frozenset(value))
    rng = _rng_key(value) if type(value).__module__.startswith("numpy.random") else None
    if rng is not None:
        return rng
    fields = getattr(value, "__dict__", None)
    return contents_key(fields, depth) if isinstance(fields, dict) else id(value)


def _rng_key(value: Any) -> Any:
    """The state of a numpy random generator (``np.random.default_rng()``, a
    ``RandomState``, a bit generator), to compare; None for anything else. Its draws are
    Cython, which Python's profile hook does not see: a replay froze
    ``rng.choice(...)`` at the recording's rows."""
    np = sys.modules.get("numpy")
    if np is None:
        return None
    if isinstance(value, np.random.Generator):
        value = value.bit_generator
    if isinstance(value, np.random.RandomState):
        _, keys, pos, *rest = value.get_state()
        return ("numpy random state", pos, keys.tobytes(), tuple(rest))
    if isinstance(value, np.random.BitGenerator):
        return ("numpy random state", repr(value.state))
    return None


def too_large(value: Any, depth: int = 0) -> Any:
    """The first container in ``value`` that :func:`contents_key` keys by length alone
    (more than 256 items, up to 3 levels down), or None: a replay could not see a change
    to its items.

    Example::

        too_large({"vocab": list(range(1000))})   # the list
        too_large([1, 2, 3])                       # None
    """
    if isinstance(value, (dict, list, bytearray, set)) and len(value) > _LARGE:
        return value
    if depth >= _DEPTH:
        return None
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    elif is_stateful(value) and not isinstance(value, (type, set, bytearray)) \
            and users_object(value):
        items = getattr(value, "__dict__", {}).values()
    else:
        return None
    for v in items:
        if isinstance(v, (dict, list, tuple, bytearray, set)) or is_stateful(v):
            found = too_large(v, depth + 1)
            if found is not None:
                return found
    return None


def users_object(value: Any) -> bool:
    """An instance of a class of the user's, not of a library's (a ``logging.Logger``
    reaches its manager's dict of every logger)."""
    return user_class(type(value))


def optimizer_key(opt: torch.optim.Optimizer) -> tuple:
    """Which parameters each of an optimizer's groups holds: ``add_param_group`` changes
    what its step and ``zero_grad`` touch (hyperparameters are read by the step itself,
    which every replay runs)."""
    return tuple(tuple(map(id, g["params"])) for g in opt.param_groups)


def _leaf(v: Any, depth: int) -> Any:
    if isinstance(v, _PLAIN):
        return "nan" if v != v else v  # NaN != NaN: it would never match itself
    if isinstance(v, torch.optim.Optimizer):
        return (id(v), optimizer_key(v))
    if depth < _DEPTH and is_stateful(v) and not isinstance(v, type):
        return (id(v), contents_key(v, depth + 1))  # cfg["model"]["norm"]["eps"]
    return id(v)
