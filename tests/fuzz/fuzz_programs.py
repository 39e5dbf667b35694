"""Random PyTorch programs for differential fuzzing: what they are, how they are drawn.

A program is a module (or a function, when it needs no state) whose ``forward`` is a list
of *steps*, each one line of ordinary PyTorch (or a small ``if``/``for`` block)::

    class Program(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer('b0', torch.randn(3, 4, generator=...))

        def forward(self, x0, x1):
            v0 = torch.where(x0 > x1, x0, 0.5)      # a step: one op-table record
            self.b0.mul_(0.9)                       # in-place: a buffer update
            if x0.sum() > 0:                        # a data-dependent branch
                v1 = v0 * 0.5
            else:
                v1 = v0 - 1
            return (v1, self.b0)

Steps are drawn one at a time from the catalog (``fuzz_catalog.py``) and run at once on
sample inputs; a step eager PyTorch rejects (a broadcast that fails, an op without an
integer kernel) is dropped, so every program runs in eager by construction.

**Exactness.** Each value carries a flag: *exact* values are bit-identical wherever they
are computed (inputs, their views, comparisons, casts, integer arithmetic, max/min...),
the others (and buffers, which carry what earlier calls wrote) may differ by rounding (a fused kernel keeps float16 intermediates in float32,
sums in another order, contracts ``a * b + c``). Steps that are discontinuous in their
operands (comparisons, ``floor``, ``%``, casts to integers, branch conditions) only take
exact operands, so a result can never flip because of rounding noise, and exact results
are compared bit for bit (NaN equal to NaN; the sign of zero is not compared: max, min
and clamp of -0.0 and 0.0 may return either, and differ between torch's CPU and CUDA).
Ops with a pole at zero (``1 / x``, ``rsqrt``, negative powers) take raw operands only
from inputs, whose zeros have a known sign, so -0.0 is tested through them.

Draws come from a :class:`Draw`: hypothesis (``HypothesisDraw``, which shrinks a failing
program to a minimal one) or ``random.Random`` (``RandomDraw``, for long runs).
"""

from __future__ import annotations

import linecache
import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Draw", "HypothesisDraw", "InputSpec", "Program", "RandomDraw", "Skip", "Step",
           "generate", "make_inputs", "rebuild"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
DTYPES = FLOATS + (torch.int32, torch.int64, torch.bool)
# Base shapes: 0-d, size 1, empty, odd, and a 4-d one for channels-last; all tiny, so the
# Triton interpreter runs each kernel in milliseconds.
SHAPES = [(3, 5), (), (1,), (7,), (0,), (2, 3), (1, 4), (4, 1), (2, 0), (2, 3, 4),
          (2, 3, 2, 2), (1, 3, 1, 2), (3, 3)]
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "channels_last", "offset")


class Skip(Exception):
    """The step being drawn does not apply (no operand fits); draw another."""


# ---------------------------------------------------------------------- draws
class Draw:
    """Where a program's random choices come from. Each method shrinks toward its first
    or smallest value (hypothesis shrinks a failing program that way)."""

    def int(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def bool(self, p: float = 0.5) -> bool:
        """True with probability ``p``; shrinks to False."""
        return self.int(0, 99) >= round(100 * (1 - p))


class RandomDraw(Draw):
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class HypothesisDraw(Draw):
    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))


# ---------------------------------------------------------------------- programs
@dataclass(frozen=True)
class InputSpec:
    """One tensor argument (or buffer): its shape, dtype, layout and whether later calls
    put NaN, infinities and -0.0 in it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str = "contiguous"
    special: bool = False


@dataclass
class Step:
    """One statement of ``forward`` (or a block: ``if``/``for``).

    ``out`` names the value it defines (None for a pure effect); ``writes`` the value it
    changes in place; ``reads`` every value name it uses. ``rule`` says when ``out`` (or
    the written value) is exact: ``"exact"`` when every read is, ``"arith"`` when every
    read is and the result is not floating point, ``"inexact"`` never.
    """

    code: list[str]
    record: str
    reads: tuple[str, ...]
    out: str | None = None
    writes: str | None = None
    rule: str = "exact"
    alias: bool = False  # ``out`` may share storage with ``reads[0]`` (a view)
    init: list[str] = field(default_factory=list)
    branches: bool = False  # reads a tensor's value in Python (a graph break)
    traceable: bool = True  # symbolic_trace can trace it (no value reads, no printing)
    weak: tuple[str, ...] = ()  # reads of only a shape, dtype or device (not values)


@dataclass
class Program:
    """A generated program: inputs, buffers, steps and what it returns."""

    seed: int
    inputs: list[InputSpec]
    buffers: list[InputSpec]
    steps: list[Step]
    returns: list[str]
    ret_form: str = "tuple"  # "tuple", "single" or "dict"
    exact: dict[str, bool] = field(default_factory=dict)  # of each returned name, at return
    training: bool = False

    @property
    def is_module(self) -> bool:
        return bool(self.buffers) or any(s.init for s in self.steps)

    @property
    def traceable(self) -> bool:
        return all(s.traceable for s in self.steps)

    @property
    def records(self) -> set[str]:
        return {s.record for s in self.steps}

    def exact_structure(self) -> Any:
        """Exactness of the result, shaped like it: a bool, a list or a dict of bools."""
        flags = [self.exact.get(n, False) for n in self.returns]
        if self.ret_form == "single" or len(flags) == 1:
            return flags[0]
        if self.ret_form == "dict":
            return {f"r{i}": e for i, e in enumerate(flags)}
        return flags

    def value_steps(self) -> set[int]:
        """The steps whose values matter: they write an input, a buffer or a value that
        matters, have effects (print, assert), or make a value a later such step or the
        result reads (reads of only a shape or device do not count: a compiler may drop
        the value)."""
        source = {s.out: s.reads[0] for s in self.steps if s.alias and s.out and s.reads}

        def root(name: str) -> str:
            while name in source and source[name] != name:
                name = source[name]
            return name

        needed = set(self.returns)
        keep: set[int] = set()
        for i in range(len(self.steps) - 1, -1, -1):
            s = self.steps[i]
            effect = s.out is None and s.writes is None
            writes = s.writes is not None and (
                not root(s.writes).startswith("v") or root(s.writes) in {root(n) for n in needed})
            if effect or writes or s.out in needed:
                keep.add(i)
                needed.update(n for n in s.reads if n not in s.weak)
        return keep

    def step_at(self, lineno: int) -> int | None:
        """The step whose code is at line ``lineno`` of :meth:`source`, if any."""
        first = 2 if not self.is_module else 6 + len(self.buffers) + sum(
            len(s.init) for s in self.steps)
        line = first
        for i, s in enumerate(self.steps):
            if line <= lineno < line + len(s.code):
                return i
            line += len(s.code)
        return None

    def source(self) -> str:
        """The program as Python source: a class ``Program`` or a function ``program``."""
        args = ", ".join(f"x{i}" for i in range(len(self.inputs)))
        body = [line for s in self.steps for line in s.code]
        ret = self._return_line()
        if not self.is_module:
            lines = [f"def program({args}):", *(f"    {b}" for b in body), f"    {ret}"]
            return "\n".join(lines) + "\n"
        init = []
        for i, b in enumerate(self.buffers):
            init.append(f"self.register_buffer('b{i}', {tensor_literal(b, 1000 + i)})")
        init += [line for s in self.steps for line in s.init]
        lines = ["class Program(nn.Module):", "    def __init__(self):",
                 "        super().__init__()", *(f"        {i}" for i in init), "",
                 f"    def forward(self, {args}):", *(f"        {b}" for b in body),
                 f"        {ret}"]
        return "\n".join(lines) + "\n"

    def _return_line(self) -> str:
        if self.ret_form == "single" or len(self.returns) == 1:
            return f"return {self.returns[0]}"
        if self.ret_form == "dict":
            items = ", ".join(f"'r{i}': {n}" for i, n in enumerate(self.returns))
            return f"return {{{items}}}"
        return f"return ({', '.join(self.returns)},)"

    def build(self, device: str = "cpu") -> Any:
        """A fresh instance: the module (on ``device``, in train mode if ``training``) or
        the function."""
        filename = f"<fuzz program {self.seed}>"
        src = self.source()
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        namespace = namespace_for()
        exec(compile(src, filename, "exec"), namespace)
        if not self.is_module:
            return namespace["program"]
        module = namespace["Program"]().to(device)
        return module.train(self.training)


def namespace_for() -> dict[str, Any]:
    import io

    return {"torch": torch, "nn": nn, "F": F, "_sink": io.StringIO()}


def tensor_literal(spec: InputSpec, key: int) -> str:
    """Source for a deterministic tensor of ``spec``'s shape and dtype."""
    gen = f"generator=torch.Generator().manual_seed({key})"
    shape = repr(tuple(spec.shape))
    if spec.dtype == torch.bool:
        return f"torch.rand({shape}, {gen}) > 0.5"
    if spec.dtype.is_floating_point:
        return f"torch.randn({shape}, {gen}).to({spec.dtype})"
    return f"torch.randint(-4, 5, {shape}, {gen}, dtype={spec.dtype})"


# ---------------------------------------------------------------------- inputs
def make_inputs(program: Program, call: int, device: str = "cpu",
                resize: bool = False) -> list[torch.Tensor]:
    """Fresh inputs for call number ``call``: signs flip on odd calls (so branches on
    sums alternate), and from call 1 on, inputs marked ``special`` hold NaN, +-inf and
    -0.0 (floats) or 0 and large values (integers): benign first, then the traps.

    ``resize``: the last dim of the first input, and every input's last dim of that size,
    becomes another size (empty for one program in three): a compiled function must
    handle new sizes, or raise where eager raises."""
    specs = program.inputs
    if resize:
        specs = [_resized(spec, specs[0].shape, program.seed) for spec in specs]
    return [make_input(spec, program.seed * 7919 + call * 31 + i, call, device)
            for i, spec in enumerate(specs)]


def _resized(spec: InputSpec, first: tuple[int, ...], seed: int) -> InputSpec:
    if not first or not spec.shape or spec.shape[-1] != first[-1] or first[-1] == 1:
        return spec
    size = 0 if seed % 3 == 0 else first[-1] + 2
    return InputSpec((*spec.shape[:-1], size), spec.dtype, spec.layout, spec.special)


def make_input(spec: InputSpec, key: int, call: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(key)
    shape, layout = list(spec.shape), spec.layout
    nd = len(shape)
    if layout == "transposed" and nd >= 2:
        shape[-1], shape[-2] = shape[-2], shape[-1]
    elif layout == "sliced" and nd >= 1:
        shape[-1] *= 2
    elif layout == "expanded" and nd >= 1:
        shape[0] = 1
    extra = 3 if layout == "offset" else 0
    numel = 1
    for s in shape:
        numel *= s
    flat = _values(spec.dtype, numel + extra, gen, call, spec.special).to(device)
    t = flat[extra:].reshape(shape)  # a view of ``flat``: the layout survives any device
    if layout == "transposed" and nd >= 2:
        t = t.transpose(-1, -2)
    elif layout == "sliced" and nd >= 1:
        t = t[..., ::2]
    elif layout == "expanded" and nd >= 1:
        t = t.expand(spec.shape)
    elif layout == "channels_last" and nd == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    return t


def _values(dtype: torch.dtype, n: int, gen: torch.Generator, call: int,
            special: bool) -> torch.Tensor:
    sign = -1 if call % 2 else 1
    if dtype == torch.bool:
        t = torch.rand(n, generator=gen) > 0.5
        return ~t if sign < 0 else t
    if dtype.is_floating_point:
        t = torch.randn(n, generator=gen) * 2 * sign
        traps = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0]
    else:
        t = torch.randint(-4, 5, (n,), generator=gen) * sign
        traps = [0, -1, 1 << 15]  # within float16's range (see RELIABILITY.md)
    if special and call >= 1 and n:
        picks = torch.randint(0, n, (max(1, n // 4),), generator=gen)
        for j, p in enumerate(picks.tolist()):
            t[p] = traps[(j + call) % len(traps)]
    return t.to(dtype)


# ---------------------------------------------------------------------- state
@dataclass
class Value:
    name: str
    sample: Any
    exact: bool
    group: int  # values sharing storage share a group
    input: bool = False


class State:
    """The values a program has defined so far, run on sample inputs."""

    def __init__(self, program: Program, module: Any, samples: list[torch.Tensor]) -> None:
        self.program = program
        self.env: dict[str, Any] = namespace_for()
        self.env["self"] = module
        self.values: list[Value] = []
        self.counter = 0
        for i, t in enumerate(samples):
            self.add(f"x{i}", t, True, input=True)
        for i in range(len(program.buffers)):
            # inexact: a buffer carries what earlier calls wrote, maybe rounded differently
            self.add(f"self.b{i}", getattr(module, f"b{i}"), False)

    def add(self, name: str, sample: Any, exact: bool, group: int | None = None,
            input: bool = False) -> None:
        if group is None:
            self.counter += 1
            group = self.counter
        self.values = [v for v in self.values if v.name != name]
        self.values.append(Value(name, sample, exact, group, input))
        if not name.startswith("self."):
            self.env[name] = sample

    def get(self, name: str) -> Value:
        for v in self.values:
            if v.name == name:
                return v
        raise KeyError(name)

    def run(self, step: Step) -> None:
        """Run ``step`` on the samples and update exactness; raises if eager does."""
        module = self.env["self"]
        for line in step.init:
            exec(line, self.env)
        exec("\n".join(step.code), self.env)
        reads_exact = all(self.get(n).exact for n in step.reads
                          if n not in step.weak and _is_value(self, n))
        if step.out is not None:
            value = self.env[step.out]
            if not isinstance(value, torch.Tensor):
                raise Skip("not a tensor")
            group = self.get(step.reads[0]).group if step.alias and step.reads else None
            if group is None:  # a cast to the dtype it has returns its input (x.float())
                group = next((v.group for v in self.values if isinstance(v.sample, torch.Tensor)
                              and v.sample is value), None)
            self.add(step.out, value, _exact(step.rule, reads_exact, value), group)
        if step.writes is not None:
            target = self.get(step.writes)
            now = _exact(step.rule, reads_exact, target.sample)
            if not now:
                for v in self.values:
                    if v.group == target.group:
                        v.exact = False
        del module


def _is_value(state: State, name: str) -> bool:
    return any(v.name == name for v in state.values)


def _exact(rule: str, reads_exact: bool, value: torch.Tensor) -> bool:
    if rule == "exact":
        return reads_exact
    if rule == "arith":
        return reads_exact and not (value.is_floating_point() or value.is_complex())
    return False


# ---------------------------------------------------------------------- generation
def generate(draw: Draw, seed: int, make_step: Callable[[Any], Step | None],
             max_steps: int = 8, buffers: bool = True) -> Program:
    """Draw a program: inputs, buffers, steps (each checked on the samples), returns.

    ``make_step(g)`` draws one step with the helper ``g`` (``fuzz_catalog.G``); it raises
    :class:`Skip` or returns None when nothing fits.
    """
    base = draw.choice(SHAPES)
    n_inputs = draw.int(1, 3)
    inputs = [_input_spec(draw, base, first=(i == 0)) for i in range(n_inputs)]
    bufs = [_buffer_spec(draw, base) for _ in range(draw.int(0, 2) if draw.bool(0.4) else 0)]
    program = Program(seed, inputs, bufs if buffers else [], [], [], training=draw.bool(0.3))
    state = _fresh_state(program)
    n_steps = draw.int(1, max_steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _grow(draw, program, state, make_step, n_steps, max_steps)
    return program


def _grow(draw: Draw, program: Program, state: State, make_step: Callable[[Any], Step | None],
          n_steps: int, max_steps: int) -> None:
    from fuzz_catalog import G  # the catalog imports this module

    tries = 0
    while len(program.steps) < n_steps and tries < 3 * max_steps:
        tries += 1
        g = G(draw, state, len(program.steps))
        try:
            step = make_step(g)
            if step is None:
                continue
            trial = _fresh_state(program)
            for s in program.steps:
                trial.run(s)
            trial.run(step)  # on a fresh copy: a failing step must not touch the samples
        except Exception:
            continue
        program.steps.append(step)
        state = trial
    _choose_returns(draw, program, state)


def _fresh_state(program: Program) -> State:
    import warnings

    module = _sample_module(program)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return State(program, module, make_inputs(program, 0))


def _sample_module(program: Program) -> Any:
    module = nn.Module()
    for i, b in enumerate(program.buffers):
        module.register_buffer(f"b{i}", eval(tensor_literal(b, 1000 + i), namespace_for()))
    return module.train(program.training)


def _input_spec(draw: Draw, base: tuple[int, ...], first: bool) -> InputSpec:
    shape = base
    if not first and base and draw.bool(0.4):  # broadcast: trailing dims, or size-1 dims
        if draw.bool():
            shape = base[draw.int(1, len(base)):]
        else:
            shape = tuple(1 if draw.bool() else s for s in base)
    elif not first and draw.bool(0.1):
        shape = ()
    dtype = draw.choice(DTYPES if draw.bool(0.5) else (torch.float32,))
    layout = draw.choice(LAYOUTS) if draw.bool(0.5) else "contiguous"
    if layout == "channels_last" and len(shape) != 4:
        layout = "transposed"
    return InputSpec(tuple(shape), dtype, layout, special=draw.bool(0.3))


def _buffer_spec(draw: Draw, base: tuple[int, ...]) -> InputSpec:
    shape = base if draw.bool(0.7) else ()
    dtype = draw.choice((torch.float32, torch.float32, torch.int64, torch.float16))
    return InputSpec(tuple(shape), dtype)


def _choose_returns(draw: Draw, program: Program, state: State) -> None:
    names = [v.name for v in state.values if isinstance(v.sample, torch.Tensor)]
    defined = [s.out for s in program.steps if s.out is not None]
    last = defined[-1] if defined else names[0]
    picks = [last]
    for _ in range(draw.int(0, 2)):
        name = draw.choice(names)
        if name not in picks:
            picks.append(name)
    program.ret_form = draw.choice(("tuple", "single", "dict"))
    program.returns = picks[:1] if program.ret_form == "single" else picks
    program.exact = {n: state.get(n).exact for n in picks}


def rebuild(program: Program, keep: Callable[[int, Step], bool]) -> Program | None:
    """The program without the steps ``keep`` rejects, and without every later step that
    reads what a dropped step defined; steps that no longer run are dropped too. Used to
    shrink a failing program outside hypothesis. None if nothing is left to return."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _rebuild(program, keep)


def _rebuild(program: Program, keep: Callable[[int, Step], bool]) -> Program | None:
    out = Program(program.seed, program.inputs, program.buffers, [], [], program.ret_form,
                  training=program.training)
    state = _fresh_state(out)
    dropped: set[str] = set()
    for i, step in enumerate(program.steps):
        if not keep(i, step) or dropped & set(step.reads):
            if step.out:
                dropped.add(step.out)
            continue
        trial = _fresh_state(out)
        try:
            for s in out.steps:
                trial.run(s)
            trial.run(step)
        except Exception:
            if step.out:
                dropped.add(step.out)
            continue
        out.steps.append(step)
        state = trial
    returns = [n for n in program.returns if n not in dropped and _is_value(state, n)]
    if not returns:
        return None
    out.returns = returns
    out.exact = {n: state.get(n).exact for n in returns}
    return out


def shrink(program: Program, fails: Callable[[Program], bool], budget: int = 200) -> Program:
    """A smaller program that still ``fails``: steps dropped one at a time (with what
    depends on them), then returns, buffers' use and inputs' traps and layouts simplified.
    Greedy, at most ``budget`` checks; hypothesis shrinks better, this serves long runs."""
    import dataclasses

    best, tries = program, 0

    def attempt(candidate: Program | None) -> bool:
        nonlocal best, tries
        if candidate is None or tries >= budget:
            return False
        tries += 1
        try:
            ok = fails(candidate)
        except Exception:
            ok = False
        if ok:
            best = candidate
        return ok

    changed = True
    while changed and tries < budget:
        changed = False
        for i in range(len(best.steps) - 1, -1, -1):
            if i < len(best.steps) and attempt(rebuild(best, lambda j, s, i=i: j != i)):
                changed = True
        for i, spec in enumerate(best.inputs):
            for simpler in (dataclasses.replace(spec, special=False),
                            dataclasses.replace(spec, layout="contiguous")):
                if simpler != spec:
                    inputs = [*best.inputs[:i], simpler, *best.inputs[i + 1:]]
                    if attempt(rebuild(dataclasses.replace(best, inputs=inputs),
                                       lambda j, s: True)):
                        changed = True
                        break
        if len(best.returns) > 1:
            for n in list(best.returns):
                trial = dataclasses.replace(best, returns=[r for r in best.returns if r != n])
                if attempt(rebuild(trial, lambda j, s: True)):
                    changed = True
                    break
    return best
