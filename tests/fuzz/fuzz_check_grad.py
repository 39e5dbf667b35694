"""The program fuzzer's gradient check: ``fxlite.compile``'s backward against eager's.

``check_backward(program)`` makes the program's floating-point inputs leaf tensors that
require grad (fresh ones per call, in the program's layouts), runs the program under grad
mode in eager and through ``fxlite.compile``, reduces the floating results to one scalar
with fixed random weights (in float64, so that the weights reach every result's gradient
unrounded), calls ``backward`` and compares, per call:

* the results, as the forward check does (``fuzz_check.same``);
* which results require grad (a compiled result that does not loses gradients);
* each input's ``.grad``: None where eager leaves it None, else the same values at the
  dtype's tolerance, or failing that against the program run in higher precision;
* exceptions: where eager raises (an op without a derivative, a value autograd saved and
  the program then changed in place), the compiled call or its backward must raise too.

Steps that write an input (or a view of one) in place are left out: eager rejects an
in-place write to a leaf that requires grad. So are steps that write a buffer: a buffer
given a value that requires grad carries that call's autograd graph into the next call,
whose backward then walks into the freed graph, which raises or not depending on whether
its nodes saved tensors (fxlite's groups do; ``mean``'s does not), in eager as compiled.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from fuzz_catalog import KNOWN_OPEN
from fuzz_check import (
    _FINDINGS,
    NOTES,
    STATS,
    _cuda_norm_rows,
    _dead_code_error,
    _flatten,
    _loosest,
    _state,
    _upcast,
    cleared_by_scalar_loops,
    rebuilt,
    same,
    strided_copy,
    upcast_program,
)
from fuzz_programs import FLOATS, Program, make_inputs, rebuild

__all__ = ["check_backward", "gradable"]


def gradable(program: Program) -> Program | None:
    """``program`` without the steps that write an input, a view of one or a buffer in
    place (and what depends on them); None if it has no floating-point input or nothing
    is left."""
    if not any(s.dtype in FLOATS for s in program.inputs):
        return None
    source = {s.out: s.reads[0] for s in program.steps if s.alias and s.out and s.reads}

    def root(name: str) -> str:
        while name in source and source[name] != name:
            name = source[name]
        return name

    writes_input = {i for i, s in enumerate(program.steps)
                    if s.writes is not None and root(s.writes).startswith(("x", "self."))}
    if "max_all_nan_grad" in KNOWN_OPEN:  # steps of torch.max or min: max(x), min(x)
        writes_input |= {i for i, s in enumerate(program.steps) if s.record in ("max", "min")}
    if not writes_input:
        return program
    return rebuild(program, lambda i, s: i not in writes_input)


def _leaves(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The floating inputs as leaves that require grad (views keep their layout: a view
    of a tensor that does not require grad is itself a leaf)."""
    return [x.requires_grad_() if x.dtype in FLOATS or x.dtype == torch.float64 else x
            for x in xs]


def _weights(out: Any, device: str) -> list[torch.Tensor | None]:
    """A fixed random float64 weight per floating result (None for the others)."""
    ws = []
    for k, t in enumerate(_flatten(out)):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            gen = torch.Generator().manual_seed(4242 + k)
            ws.append(torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device))
        else:
            ws.append(None)
    return ws


def _call_grad(fn: Any, args: list[Any], seed: int, device: str
               ) -> tuple[Any, BaseException | None, str, list[str]]:
    """Run ``fn`` under grad mode and backward from the weighted sum of its results:
    (result, exception, where it was raised, warning messages)."""
    torch.manual_seed(seed)
    stage = "forward"
    with torch.enable_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn(*args)
            stage = "backward"
            terms = [(t.double() * w).sum() for t, w in zip(_flatten(out), _weights(out, device))
                     if w is not None and t.requires_grad]
            if terms:
                torch.stack(terms).sum().backward()
            return out, None, stage, [str(w.message) for w in caught]
        except Exception as e:
            return None, e, stage, [str(w.message) for w in caught]


_RANDOM = ("rand", "dropout", "bernoulli", "multinomial", "normal", "poisson", "rrelu",
           "RReLU", "gumbel")


def check_backward(program: Program, device: str = "cpu", calls: int = 2) -> list[str]:
    """Failures of ``fxlite.compile(program)``'s results and input gradients against
    eager's, under grad mode, over ``calls + 1`` calls (the last with other sizes)."""
    from fxlite.codegen import compile as compile_module

    import fxlite

    if any(k in r for r in program.records for k in _RANDOM):
        # under grad, dropout and its kin draw in fxlite's kernels from seeds, on the CPU
        # (interpreter) as on CUDA: other numbers than eager's generator gives (documented
        # in the README; test_autodiff_training.py checks the masks' statistics)
        STATS["grad programs with random ops (other masks than eager's)"] += 1
        return []
    STATS["programs (grad)"] += 1
    compile_module._warned.clear()
    eager = program.build(device)
    subject = copy.deepcopy(eager) if program.is_module else eager
    compiled = fxlite.compile(subject, backend="triton")
    failures: list[str] = []
    low = _loosest(program)
    for call in range(calls + 1):
        seed = 3000 + call
        resize = call == calls
        before = {k: v.detach().clone() for k, v in _state(eager).items()}
        xe = _leaves(make_inputs(program, call, device, resize))
        xc = _leaves(make_inputs(program, call, device, resize))
        want, err_e, stage_e, _ = _call_grad(eager, xe, seed, device)
        got, err_c, stage_c, msgs = _call_grad(compiled, xc, seed, device)
        where = f"grad call {call}" + (" (resized)" if resize else "")
        for m in msgs:
            if "fxlite" in m and "disagreed" in m:
                STATS["segments or kernels replaced by eager after disagreeing"] += 1
                NOTES.append((program.seed, f"{where}: {m.splitlines()[0]}"))
            elif "fxlite" in m and any(k in m for k in _FINDINGS):
                failures.append(f"{where}: fallback: {m.splitlines()[0]}")
        if err_e is not None:
            if err_c is None and not _dead_code_error(program, err_e):
                failures.append(f"{where}: eager raised in {stage_e} "
                                f"{type(err_e).__name__}: {_first(err_e)}, compiled did not")
            else:
                STATS["grad calls both raised"] += 1
            break
        if err_c is not None:
            failures.append(f"{where}: compiled raised in {stage_c} "
                            f"{type(err_c).__name__}: {_first(err_c)}")
            break
        failures += [f"{where}: {p}" for p in _compare(program, device, call, seed, before,
                                                        resize, got, want, xc, xe, low)]
        if failures:
            break
    if failures:
        STATS["failures"] += 1
    return failures


def _compare(program: Program, device: str, call: int, seed: int,
             before: dict[str, torch.Tensor], resize: bool, got: Any, want: Any,
             xc: list[torch.Tensor], xe: list[torch.Tensor], low: torch.dtype | None
             ) -> list[str]:
    problems = _cuda_norm_rows(program, device, call, same(got, want, False, "result", None,
                                                           low))
    for i, (g, w) in enumerate(zip(_flatten(got), _flatten(want))):
        if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) and \
                g.requires_grad != w.requires_grad:
            problems.append(f"result {i}: requires_grad {g.requires_grad} != "
                            f"{w.requires_grad}")
    for i, (a, b) in enumerate(zip(xc, xe)):
        if (a.grad is None) != (b.grad is None):
            problems.append(f"x{i}.grad: {'None' if a.grad is None else 'a tensor'} where "
                            f"eager's is {'None' if b.grad is None else 'a tensor'}")
        elif b.grad is not None:
            problems += same(a.grad, b.grad, False, f"x{i}.grad", None, low)
    if problems and not any("requires_grad" in p or "None" in p for p in problems):
        # maybe rounding of low-precision intermediates: run in higher precision
        up_out, up_x = _reference(program, device, call, seed, before, resize)
        if up_out is not None:
            problems = _cuda_norm_rows(program, device, call,
                                       same(got, want, False, "result", up_out, low))
            for i, (a, b, u) in enumerate(zip(xc, xe, up_x)):
                if b.grad is not None:
                    problems += same(a.grad, b.grad, False, f"x{i}.grad", u.grad, low)
    return _cpu_loops(program, device, call, seed, before, resize, got, xc, problems, low)


def _cpu_loops(program: Program, device: str, call: int, seed: int,
               before: dict[str, torch.Tensor], resize: bool, got: Any,
               xc: list[torch.Tensor], problems: list[str], low: torch.dtype | None
               ) -> list[str]:
    """``problems``, less the differences where eager's CPU vector and scalar loops
    disagree (``fuzz_check._cpu_loops``, for results and gradients alike): eager is run
    again under grad on the same values laid out with a stride of 2, and where the
    compiled result and every gradient match that run, the differences are eager's own
    (fuzz seed 9303112: ``gelu`` of an input holding an infinity, NaN against a number;
    9961688: ``relu6``'s gradient at a NaN input, 0 in the vector loop and the cotangent
    in the scalar one, a number against a number)."""
    if device != "cpu" or not problems:
        return problems
    xs = _leaves([strided_copy(x) for x in make_inputs(program, call, device, resize)])
    other, err, _, _ = _call_grad(rebuilt(program, device, before), xs, seed, device)
    if err is not None or same(got, other, False, "result", None, low):
        return problems
    for i, (a, b) in enumerate(zip(xc, xs)):
        if (a.grad is None) != (b.grad is None) or b.grad is not None and same(
                a.grad, b.grad, False, f"x{i}.grad", None, low):
            return problems
    kept = cleared_by_scalar_loops(problems)
    STATS["gradients where eager's CPU vector and scalar loops disagree"] += len(kept)
    return []


def _reference(program: Program, device: str, call: int, seed: int,
               before: dict[str, torch.Tensor], resize: bool
               ) -> tuple[Any, list[torch.Tensor]]:
    """The program in higher precision, under grad mode: (result, leaf inputs)."""
    for wide in (False, True):  # all in float64 where eager refuses the mix
        ref = upcast_program(program, device, before, wide)
        xs = _leaves([_upcast(x, wide) for x in make_inputs(program, call, device, resize)])
        out, err, _, _ = _call_grad(ref, xs, seed, device)
        if err is None:
            break
    return (out if err is None else None), xs


def _first(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""
