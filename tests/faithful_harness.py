"""Differential harness: a program run eagerly and through ``fxlite.compile`` must behave the same.

DESIGN.md, "Faithful by construction": code that is hard to capture may cost speed, never
correctness. A *program* here is what a user writes around a compiled function: the
function (or module, or training-step closure), the Python and torch state it touches,
and a schedule of calls with fresh inputs, with state changes between them (a config
attribute set, ``model.eval()``, a hook added, a param group added, a reseed...).

:func:`check` runs a program from identical fresh factories and identical seeds, eagerly
(twice: a program whose eager runs differ is a bug of the program, reported as such) and
with ``fxlite.compile(fn)`` in place of ``fn`` (a module compiles as a module), takes a
:class:`Snapshot` after every call and compares eager's and the compiled run's call by
call, failing at the first call that differs and naming what differs
(``call 2: state.model.params.0.weight.grad``):

- the output, structure and types included (``None`` against a tensor, ``torch.Size``
  against a tuple); iterators and generators in it are consumed right after the call;
- the inputs (a function may write them);
- the program's state: modules (``state_dict``, every submodule's ``training`` flag, every
  parameter's ``requires_grad`` and ``.grad``, plain attributes), optimizers and schedulers
  (``state_dict``), lists, dicts, sets, plain objects, :class:`Probe` values (a
  ``nonlocal`` or a ``global`` read back), generators' states;
- what the call printed (``redirect_stdout``), logged (to ``LOGGER`` and its children),
  warned (every ``warnings.warn``, under the "always" filter; ignoring warnings whose
  message starts with ``fxlite`` and those of Triton's CPU interpreter);
- the exception it raised, if any (by type; what the user's own ``except`` caught shows
  in the state it records), and what a program's ``after`` step (a backward through
  the output) returned or raised;
- torch's, ``random``'s and numpy's global generator states after the call;
- the process-wide state the call leaves: grad mode, autocast, the default dtype,
  torch-function modes, Python's trace/profile/monitoring hooks.

Inputs are drawn with :func:`randn`/:func:`rand`/:func:`randint` from a generator private
to the harness, seeded per call, so the global generators belong to the program alone.

The compiled run's last call decides the program's *tier*, kept in ``RESULTS``: whether it
ran Triton kernels (``.kernels``) and whether it fell back to eager (``.fallbacks``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import itertools
import logging
import math
import os
import random
import sys
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import fxlite

__all__ = ["LOGGER", "PROGRAMS", "RESULTS", "Probe", "Program", "check", "program", "rand",
           "randint", "randn", "summary", "tiers"]

LOGGER = logging.getLogger("faithful")
PROGRAMS: dict[str, Callable[[], Program]] = {}
RESULTS: dict[str, Tier] = {}

# Triton's interpreter (TRITON_INTERPRET=1, kernels on CPU through numpy) warns about
# masked-off lanes (0/0) where a GPU kernel is silent: its warnings are the test rig's.
_TRITON_DIR = os.path.dirname(importlib.util.find_spec("triton").origin)
_INPUTS = torch.Generator()  # the harness's own: inputs never touch the program's generators
_SEED = 0
_MAX_DEPTH = 8


# ---------------------------------------------------------------------------- programs
@dataclasses.dataclass
class Program:
    """One fresh instance of a program.

    Attributes:
        fn: what gets compiled: a function, a bound method or an ``nn.Module``.
        args: call index -> positional arguments, drawn with :func:`randn` and friends.
        state: named objects compared after every call (modules, optimizers, lists...).
        before: call index -> nothing; changes state before that call (runs captured).
        after: ``(call index, output)`` -> anything; runs after the call (a backward
            outside the compiled function, reading a result); its value is compared too.
        kwargs: call index -> keyword arguments.
        around: call index -> a context manager the caller holds around that call
            (``torch.no_grad()``, ``torch.autocast(...)``, ``torch.inference_mode()``).
        calls: how many calls (at least 4).
        rtol, atol: float tolerances for tensors and Python floats.
    """

    fn: Any
    args: Callable[[int], tuple] = lambda i: ()
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    before: Callable[[int], Any] | None = None
    after: Callable[[int, Any], Any] | None = None
    kwargs: Callable[[int], dict] | None = None
    around: Callable[[int], Any] | None = None
    calls: int = 4
    rtol: float = 1e-5
    atol: float = 1e-5


def program(group: str, name: str | None = None) -> Callable[[Callable[[], Program]], Callable[[], Program]]:
    """Register ``make`` (a factory of fresh :class:`Program` instances) as ``group-name``."""
    def register(make: Callable[[], Program]) -> Callable[[], Program]:
        key = f"{group}-{name or make.__name__.removeprefix('make_')}"
        assert key not in PROGRAMS, f"two programs named {key}"
        PROGRAMS[key] = make
        return make
    return register


class Probe:
    """A value read back for the snapshot: a ``nonlocal``, a ``global``, a computed view."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self.read = read


def randn(*shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> torch.Tensor:
    """A fresh normal input from the harness's own generator."""
    return torch.randn(*shape, generator=_INPUTS, dtype=dtype).requires_grad_(requires_grad)


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh uniform [0, 1) input from the harness's own generator."""
    return torch.rand(*shape, generator=_INPUTS, dtype=dtype)


def randint(high: int, *shape: int) -> torch.Tensor:
    """Fresh int64 class labels / indices in [0, high)."""
    return torch.randint(high, shape, generator=_INPUTS)


# ---------------------------------------------------------------------------- snapshots
@dataclasses.dataclass
class Node:
    """A snapshot of a container or object: its kind and its named (dict) or indexed (list)
    parts, so that a mismatch reads ``state.model.grad.0.weight``."""

    kind: str
    parts: dict[str, Any] | list[Any]


@dataclasses.dataclass
class TensorSnap:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    value: torch.Tensor
    grad: Any  # a TensorSnap of a leaf's .grad, or None


def _is_iterator(x: Any) -> bool:
    return isinstance(x, Iterator) and not isinstance(x, torch.Tensor)


def _snap_tensor(t: torch.Tensor) -> TensorSnap:
    grad = None
    if t.is_leaf and t.requires_grad and t.grad is not None:
        grad = _snap_tensor(t.grad)
    return TensorSnap(t.dtype, tuple(t.shape), t.requires_grad, t.detach().clone(), grad)


def _snap_module(m: torch.nn.Module, depth: int, memo: dict[int, Any]) -> Node:
    training = {n or "(root)": sm.training for n, sm in m.named_modules()}
    state = {k: _snap_tensor(v.detach()) for k, v in m.state_dict().items()}
    params = {n: Node("Parameter", {"requires_grad": p.requires_grad,
                                    "grad": None if p.grad is None else _snap_tensor(p.grad)})
              for n, p in m.named_parameters()}
    attrs = {}
    for n, sm in m.named_modules():
        for k, v in vars(sm).items():
            if k.startswith("_") or k == "training" or isinstance(v, torch.nn.Module):
                continue
            attrs[f"{n}.{k}" if n else k] = snap(v, False, depth + 1, memo)
    hooks = {n or "(root)": (len(sm._forward_hooks), len(sm._forward_pre_hooks), len(sm._backward_hooks))
             for n, sm in m.named_modules()}
    return Node(f"module {type(m).__qualname__}",
                {"training": training, "state_dict": state, "params": params, "attrs": attrs,
                 "hooks": hooks})


def snap(x: Any, consume: bool = False, depth: int = 0, memo: dict[int, tuple[int, Any]] | None = None) -> Any:
    """A comparable, detached copy of ``x``: tensors cloned, containers walked, modules and
    optimizers by their state, objects by their attributes. With ``consume``, iterators
    and generators are run to the end (outputs); otherwise only their type is kept."""
    memo = {} if memo is None else memo
    if depth > _MAX_DEPTH:
        return Node(f"deep {type(x).__qualname__}", [])
    if x is None or type(x) in (bool, int, float, complex, str, bytes):
        return x
    if isinstance(x, (bool, int, float, complex, str, bytes)):  # an IntEnum, a str subclass
        return Node(type(x).__qualname__, [type(x).__mro__[1](x) if not isinstance(x, bool) else bool(x)])
    if isinstance(x, torch.Tensor):
        return _snap_tensor(x)
    if isinstance(x, (torch.dtype, torch.device)):
        return Node(f"torch {x}", [])
    if isinstance(x, torch.Generator):
        return Node("Generator", [_snap_tensor(x.get_state())])
    if isinstance(x, Probe):
        return Node("Probe", [snap(x.read(), consume, depth + 1, memo)])
    if isinstance(x, np.ndarray):
        return Node(f"ndarray {x.dtype.str}", [_snap_tensor(torch.from_numpy(np.array(x)))])
    if isinstance(x, np.generic):
        return Node(f"numpy {type(x).__qualname__}", [x.item()])
    if id(x) in memo:
        return Node("seen before", [memo[id(x)][0]])
    memo[id(x)] = (len(memo), x)  # x kept alive: a temporary's id must not be reused
    if isinstance(x, torch.nn.Module):
        return _snap_module(x, depth, memo)
    if isinstance(x, torch.optim.Optimizer):
        return Node(f"optimizer {type(x).__qualname__}", [snap(x.state_dict(), False, depth + 1, memo)])
    if isinstance(x, torch.optim.lr_scheduler.LRScheduler):
        return Node(f"scheduler {type(x).__qualname__}", [snap(x.state_dict(), False, depth + 1, memo)])
    if isinstance(x, (list, tuple)):
        return Node(type(x).__qualname__, [snap(v, consume, depth + 1, memo) for v in x])
    if isinstance(x, dict):
        return Node(type(x).__qualname__, {repr(k) if not isinstance(k, str) else k:
                                           snap(v, consume, depth + 1, memo) for k, v in x.items()})
    if isinstance(x, (set, frozenset)):
        return Node(type(x).__qualname__, sorted(repr(v) for v in x))
    if isinstance(x, itertools.count):
        return Node(repr(x), [])
    if _is_iterator(x):
        if consume:
            return Node(f"iterator {type(x).__qualname__}", [snap(v, True, depth + 1, memo) for v in x])
        return Node(f"iterator {type(x).__qualname__}", [])
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
                      functools.partial)):
        return Node(f"callable {getattr(x, '__qualname__', type(x).__qualname__)}", [])
    if isinstance(x, (logging.Logger, types.ModuleType)):
        return Node(f"opaque {type(x).__qualname__}", [])
    fields = getattr(x, "__dict__", None)
    if fields is not None:
        return Node(f"object {type(x).__qualname__}",
                    {k: snap(v, consume, depth + 1, memo) for k, v in fields.items()})
    return Node(f"opaque {type(x).__qualname__}", [])


@dataclasses.dataclass
class Snapshot:
    """Everything observable after one call."""

    out: Any
    raised: str | None
    inputs: Any
    after: Any
    state: Any
    stdout: str
    logs: list[tuple[str, str]]
    warns: list[tuple[str, str]]
    rng: Any
    ambient: Any
    error_text: str = ""  # the traceback, for the report only


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def _rng() -> Node:
    state = np.random.get_state()
    return Node("rng", {"torch": torch.get_rng_state(), "random": random.getstate(),
                        "numpy": (state[1].copy(), state[2])})


def _ambient() -> Node:
    """Process-wide state a call must leave as eager leaves it: grad mode, autocast, the
    default dtype, torch-function modes, Python's trace/profile/monitoring hooks."""
    monitoring = getattr(sys, "monitoring", None)
    tools = [monitoring.get_tool(t) for t in range(6)] if monitoring is not None else []
    return Node("ambient", {
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "autocast_cpu": (torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu"))),
        "default_dtype": str(torch.get_default_dtype()),
        "torch_function_modes": torch._C._len_torch_function_stack(),
        "trace": type(sys.gettrace()).__qualname__,
        "profile": type(sys.getprofile()).__qualname__,
        "monitoring_tools": tools,
    })


def _reset_ambient() -> None:
    """Start every run from eager's defaults, so that a leak fails one program, not the next."""
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    torch.set_autocast_enabled("cpu", False)


def seed_all(seed: int = _SEED) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@dataclasses.dataclass
class Tier:
    """How the compiled run's last call ran."""

    kernels: int
    fallbacks: list[str]
    passed: bool = False


def run(make: Callable[[], Program], compiler: Callable[[Any], Any] | None
        ) -> tuple[list[Snapshot], Any, Program]:
    """Run a fresh program, eagerly or with ``compiler(fn)`` in place of ``fn``; return a
    snapshot per call, the compiled object (or None) and the program."""
    _reset_ambient()
    seed_all()
    _INPUTS.manual_seed(999)  # what a factory draws with randn()
    prog = make()
    assert prog.calls >= 4, "a program makes at least four calls"
    fn = compiler(prog.fn) if compiler is not None else prog.fn
    handler = _Records()
    old_level, old_propagate = LOGGER.level, LOGGER.propagate
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False
    snaps = []
    try:
        for i in range(prog.calls):
            handler.records = []
            stdout = io.StringIO()
            out = raised = after = None
            error_text = ""
            with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(stdout):
                warnings.simplefilter("always")
                if prog.before is not None:
                    prog.before(i)
                _INPUTS.manual_seed(1000 + i)
                args = prog.args(i)
                kwargs = prog.kwargs(i) if prog.kwargs is not None else {}
                try:
                    with (prog.around(i) if prog.around is not None else contextlib.nullcontext()):
                        result = fn(*args, **kwargs)
                    out = snap(result, consume=True)
                except Exception as e:  # the user's exception, or one fxlite made up
                    raised = f"{type(e).__module__}.{type(e).__qualname__}"
                    error_text = "".join(traceback.format_exception(e)[-6:])
                    result = None
                if prog.after is not None and raised is None:
                    try:
                        after = snap(prog.after(i, result), consume=True)
                    except Exception as e:  # a backward through the compiled output...
                        after = Node(f"raised {type(e).__module__}.{type(e).__qualname__}", [])
                        error_text = "".join(traceback.format_exception(e)[-6:])
            warns = [(w.category.__name__, str(w.message)) for w in caught
                     if not str(w.message).startswith("fxlite")
                     and not w.filename.startswith(_TRITON_DIR)]
            snaps.append(Snapshot(out=out, raised=raised, inputs=snap((args, kwargs)), after=after,
                                  state=snap(prog.state), stdout=stdout.getvalue(),
                                  logs=list(handler.records), warns=warns, rng=_rng(), ambient=_ambient(),
                                  error_text=error_text))
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(old_level)
        LOGGER.propagate = old_propagate
    return snaps, (fn if compiler is not None else None), prog


# ---------------------------------------------------------------------------- comparing
class Mismatch(AssertionError):
    pass


def compare(a: Any, b: Any, where: str, rtol: float, atol: float) -> None:
    """Raise :class:`Mismatch` naming ``where`` when eager's ``a`` and compiled ``b`` differ."""
    if type(a) is not type(b):
        raise Mismatch(f"{where}: eager has {_short(a)}, compiled has {_short(b)}")
    if isinstance(a, TensorSnap):
        if (a.dtype, a.shape, a.requires_grad) != (b.dtype, b.shape, b.requires_grad):
            raise Mismatch(f"{where}: eager {a.dtype}{list(a.shape)} requires_grad={a.requires_grad}, "
                           f"compiled {b.dtype}{list(b.shape)} requires_grad={b.requires_grad}")
        try:
            torch.testing.assert_close(b.value, a.value, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as e:
            raise Mismatch(f"{where}: {e}") from None
        compare(a.grad, b.grad, f"{where}.grad", rtol, atol)
    elif isinstance(a, Node):
        if a.kind != b.kind or type(a.parts) is not type(b.parts):
            raise Mismatch(f"{where}: eager has {a.kind}, compiled has {b.kind}")
        if isinstance(a.parts, dict):
            if list(a.parts) != list(b.parts):
                raise Mismatch(f"{where}: eager has keys {list(a.parts)}, compiled {list(b.parts)}")
            for k in a.parts:
                compare(a.parts[k], b.parts[k], f"{where}.{k}", rtol, atol)
        else:
            if len(a.parts) != len(b.parts):
                raise Mismatch(f"{where}: eager has {len(a.parts)} items, compiled {len(b.parts)}: "
                               f"{_short(a.parts)} against {_short(b.parts)}")
            for k, (x, y) in enumerate(zip(a.parts, b.parts)):
                compare(x, y, f"{where}[{k}]", rtol, atol)
    elif isinstance(a, dict):  # the parts of a module's snapshot
        compare(Node("dict", a), Node("dict", b), where, rtol, atol)
    elif isinstance(a, float):
        if not (math.isclose(a, b, rel_tol=rtol, abs_tol=atol) or (math.isnan(a) and math.isnan(b))
                or a == b):
            raise Mismatch(f"{where}: eager {a!r}, compiled {b!r}")
    elif isinstance(a, (list, tuple)):  # the harness's own records (rng, logs, warnings)
        if len(a) != len(b):
            raise Mismatch(f"{where}: eager has {len(a)} items {_short(a)}, compiled {len(b)} {_short(b)}")
        for k, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{where}[{k}]", rtol, atol)
    elif isinstance(a, torch.Tensor):
        if not torch.equal(a, b):
            raise Mismatch(f"{where}: differs")
    elif isinstance(a, np.ndarray):
        if not np.array_equal(a, b):
            raise Mismatch(f"{where}: differs")
    elif a != b:
        raise Mismatch(f"{where}: eager {a!r}, compiled {b!r}")


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 160 else text[:157] + "..."


def _compare_snapshots(i: int, e: Snapshot, c: Snapshot, prog: Program) -> None:
    where = f"call {i}"
    if e.raised != c.raised:
        raise Mismatch(f"{where}: eager raised {e.raised}, compiled raised {c.raised}\n"
                       f"compiled: {c.error_text}eager: {e.error_text}")
    for field in ("out", "after", "inputs", "state", "stdout", "logs", "warns", "rng",
                  "ambient"):
        compare(getattr(e, field), getattr(c, field), f"{where}: {field}", prog.rtol, prog.atol)


def check(name: str, make: Callable[[], Program],
          compiler: Callable[[Any], Any] = fxlite.compile, record: bool = True) -> None:
    """Run ``make``'s program eagerly and compiled; fail at the first call that differs.

    ``compiler`` is ``fxlite.compile``, or a stand-in for the harness's own tests; with
    ``record``, the compiled run's tier goes to ``RESULTS``."""
    eager, _, prog = run(make, None)
    again, _, _ = run(make, None)
    for i, (e, a) in enumerate(zip(eager, again)):  # the program itself must be deterministic
        try:
            _compare_snapshots(i, e, a, prog)
        except Mismatch as m:
            raise AssertionError(f"the program is not deterministic in eager: {m}") from None
    compiled, fn, _ = run(make, compiler)
    tier = Tier(len(getattr(fn, "kernels", [])), list(getattr(fn, "fallbacks", [])))
    if record:
        RESULTS[name] = tier
    for i, (e, c) in enumerate(zip(eager, compiled)):
        _compare_snapshots(i, e, c, prog)
    tier.passed = True


def summary() -> str:
    n = len(RESULTS)
    k = sum(1 for t in RESULTS.values() if t.kernels)
    f = sum(1 for t in RESULTS.values() if t.fallbacks)
    return f"faithful programs: {n} ran, {k} ran kernels, {f} fell back to eager"


def tiers(verbose: bool = False) -> str:
    """Per group: programs, how many ran kernels, fell back, failed; then the failing
    programs (every program with ``verbose``), each with its kernels and first fallback."""
    groups: dict[str, list[Tier]] = {}
    for name, t in RESULTS.items():
        groups.setdefault(name.split("-")[0], []).append(t)
    lines = [f"  {'group':<10} {'programs':>8} {'kernels':>8} {'fell back':>9} {'failed':>6}"]
    for g, ts in groups.items():
        lines.append(f"  {g:<10} {len(ts):>8} {sum(1 for t in ts if t.kernels):>8} "
                     f"{sum(1 for t in ts if t.fallbacks):>9} {sum(1 for t in ts if not t.passed):>6}")
    for name, t in RESULTS.items():
        if verbose or not t.passed:
            why = t.fallbacks[0][:110] if t.fallbacks else ""
            lines.append(f"  {'ok  ' if t.passed else 'FAIL'} {name:<52} kernels={t.kernels:<3} {why}")
    return "\n".join(lines)
