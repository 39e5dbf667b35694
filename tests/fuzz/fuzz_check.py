"""Run a generated program through fxlite and compare everything with eager PyTorch.

``check_compiled(program, backend)`` calls ``fxlite.compile``'s result several times with
fresh inputs (benign first, then NaN/inf/-0.0 where the program asks for them), each time
against a fresh eager run from the same state and random seed, and compares:

* the results: exact values bit for bit, the others at their dtype's tolerance (or, failing
  that, against the program run in higher precision, which is what a fused kernel that
  keeps float16 intermediates in float32 computes);
* the inputs and buffers after the call (in-place writes must land);
* which results are the very input or buffer objects eager returns;
* exceptions: where eager raises, the compiled call must raise too;
* fallbacks: a segment or kernel that fxlite had to replace by eager because it crashed or
  disagreed with eager is a finding too, though the call's result is right.

``check_passes(program)`` runs ``symbolic_trace``, ``normalize``, ``cse``, ``decompose`` and
``fuse`` directly and compares the fused module with eager the same way.

Every check adds the op-table records the captured or traced graphs hold to
:data:`COVERAGE`; :func:`summary` reports them.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections import Counter
from typing import Any

import torch
from fuzz_programs import FLOATS, Program, make_inputs

__all__ = ["COVERAGE", "STATS", "check_compiled", "check_passes", "records_of", "summary"]

COVERAGE: Counter[str] = Counter()  # record name -> graphs it appeared in
STATS: Counter[str] = Counter()  # programs per path, failures, fallbacks
# Segments or kernels fxlite replaced by eager because they disagreed with eager on the
# recorded inputs: the result is right, and the check may have caught a wrong kernel or
# rounding beyond its tolerance. Listed (program seed, message) for review, not failed.
NOTES: list[tuple[int, str]] = []
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-3),
       torch.bfloat16: (5e-2, 1e-2), torch.float64: (1e-9, 1e-9)}
# Fallback reasons that are findings (a crash or a wrong kernel), not gaps.
_FINDINGS = ("disagreed", "failed", "Error", "error")


# ---------------------------------------------------------------------- comparison
def same(got: Any, want: Any, exact: Any, path: str, upcast: Any = None,
         loosest: torch.dtype | None = None) -> list[str]:
    """Differences between ``got`` and ``want`` (nested), as messages naming ``path``.

    ``exact`` (shaped like the result) asks for the same bits; other floating-point
    values compare at the tolerance of their dtype, or of ``loosest`` if that is looser
    (a float32 value computed from float16 data is only as good as float16), and failing
    that against ``upcast``, the program run in higher precision."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: dict keys differ"]
        ex = exact if isinstance(exact, dict) else {k: exact for k in want}
        return [m for k in want for m in same(got[k], want[k], ex[k], f"{path}[{k!r}]",
                                              None if upcast is None else upcast[k], loosest)]
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return [f"{path}: structure differs ({type(got).__name__})"]
        ex = exact if isinstance(exact, (tuple, list)) else [exact] * len(want)
        return [m for i, (g, w) in enumerate(zip(got, want))
                for m in same(g, w, ex[i], f"{path}[{i}]",
                              None if upcast is None else upcast[i], loosest)]
    if not isinstance(want, torch.Tensor):
        return [] if got == want or (got != got and want != want) else [
            f"{path}: {got!r} != {want!r}"]
    if not isinstance(got, torch.Tensor):
        return [f"{path}: expected a tensor, got {type(got).__name__}"]
    if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
        return [f"{path}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"]
    if exact or not (want.is_floating_point() or want.is_complex()):
        diff = bits_differ(got, want)
        return [f"{path} (exact): {diff}"] if diff else []
    rtol, atol = TOL.get(want.dtype, (1e-4, 1e-5))
    if loosest is not None:
        rtol, atol = max(rtol, TOL[loosest][0]), max(atol, TOL[loosest][1])
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
        return []
    except AssertionError as e:
        first = str(e).strip().splitlines()
        if upcast is not None and isinstance(upcast, torch.Tensor):
            try:
                torch.testing.assert_close(got, upcast.to(want.dtype), rtol=rtol, atol=atol,
                                           equal_nan=True)
                return []
            except AssertionError:
                pass
            if no_farther(got, want, upcast, rtol, atol):
                STATS["values no farther from the higher-precision run than eager's"] += 1
                return []
        return [f"{path}: " + " ".join(first[:4])]


def no_farther(got: torch.Tensor, want: torch.Tensor, upcast: torch.Tensor, rtol: float,
               atol: float) -> bool:
    """Whether no element of ``got`` is farther from ``upcast`` (the program run in
    higher precision) than eager's ``want`` is at its worst, up to the tolerance; NaN
    and infinities (in eager's result or the reference) must be eager's.

    Eager's own rounding error bounds what another order of the same operations gives:
    an ill-conditioned value (a batch norm of two elements per channel, or of bf16
    values of a tiny variance) amplifies rounding past any fixed tolerance, in eager as
    compiled, and a reduction spreads it over the elements (eager's two gradients of a
    two-element channel, exact negatives, were 5e-5 and 2e-7 off; fxlite's 2.6e-5
    both), while a wrong value lands farther from the reference than eager's worst."""
    g, w, u = (t.detach().cpu().double() for t in (got, want, upcast))
    if not g.shape == w.shape == u.shape:
        return False
    finite = u.isfinite() & w.isfinite()
    special = ((g == w) | (g.isnan() & w.isnan()))[~finite]
    if not finite.any():
        return bool(special.all())
    worst = (w - u)[finite].abs().max()
    close = ((g - u).abs() <= worst + atol + rtol * u.abs())[finite]
    return bool(special.all() and close.all())


def bits_differ(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Why two tensors are not the same values (NaN equals NaN, -0.0 equals 0.0)."""
    g, w = got.detach().cpu(), want.detach().cpu()
    if not (w.is_floating_point() or w.is_complex()):
        if torch.equal(g, w):
            return None
        bad = (g != w).nonzero()
        i = tuple(bad[0].tolist())
        return f"{int((g != w).sum())} of {w.numel()} differ, e.g. at {i}: {g[i]} != {w[i]}"
    g64, w64 = g.double(), w.double()
    gn, wn = g64.isnan(), w64.isnan()
    bad = (gn != wn) | (~wn & (g64 != w64))
    if not bad.any():
        return None
    i = tuple(bad.nonzero()[0].tolist())
    return f"{int(bad.sum())} of {w.numel()} differ, e.g. at {i}: {g[i].item()!r} != " \
           f"{w[i].item()!r}"


def _upcast(x: Any, wide: bool = False) -> Any:
    """``x`` in higher precision: float16 and bfloat16 as float32, float32 as float64
    (``wide``: every floating dtype as float64)."""
    if isinstance(x, torch.Tensor) and x.dtype in FLOATS:
        return x.to(torch.float64 if wide or x.dtype == torch.float32 else torch.float32)
    return x


# ---------------------------------------------------------------------- running
def _call(fn: Any, args: list[Any], seed: int) -> tuple[Any, BaseException | None, list[str]]:
    torch.manual_seed(seed)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn(*args), None, [str(w.message) for w in caught]
        except Exception as e:
            return None, e, [str(w.message) for w in caught]


def _state(obj: Any) -> dict[str, torch.Tensor]:
    return dict(obj.state_dict()) if isinstance(obj, torch.nn.Module) else {}


def _identity_map(out: Any, objs: list[Any]) -> list[int]:
    flat = _flatten(out)
    return [next((j for j, o in enumerate(objs) if t is o), -1) for t in flat]


def _flatten(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return [y for k in x for y in _flatten(x[k])]
    if isinstance(x, (tuple, list)):
        return [y for v in x for y in _flatten(v)]
    return [x]


def check_compiled(program: Program, backend: str = "triton", device: str = "cpu",
                   calls: int = 4) -> list[str]:
    """Failures of ``fxlite.compile(program, backend=backend)`` against eager."""
    from fxlite.codegen import compile as compile_module

    import fxlite

    STATS[f"programs ({backend})"] += 1
    compile_module._warned.clear()  # fxlite warns once per message: see every fallback
    eager = program.build(device)
    subject = copy.deepcopy(eager) if program.is_module else eager
    compiled = fxlite.compile(subject, backend=backend)
    failures: list[str] = []
    exact_out = program.exact_structure()
    low = _loosest(program)
    for call in range(calls + 1):
        seed = 1000 + call
        resize = call == calls  # the last call: other sizes
        before = {k: v.clone() for k, v in _state(eager).items()}
        xe = make_inputs(program, call, device, resize)
        xc = make_inputs(program, call, device, resize)
        want, err_e, _ = _call(eager, xe, seed)
        got, err_c, msgs = _call(compiled, xc, seed)
        where = f"call {call}" + (" (resized)" if resize else "")
        for m in msgs:
            if "fxlite" in m and "disagreed" in m:
                STATS["segments or kernels replaced by eager after disagreeing"] += 1
                NOTES.append((program.seed, f"{where}: {m.splitlines()[0]}"))
            elif "fxlite" in m and any(k in m for k in _FINDINGS):  # a crash in fxlite
                failures.append(f"{where}: fallback: {m.splitlines()[0]}")
        if err_e is not None:
            if err_c is None:
                if not _dead_code_error(program, err_e):
                    failures.append(f"{where}: eager raised {type(err_e).__name__}: "
                                    f"{err_e}, compiled did not")
                break  # the compiled call went on (writes after the error): states differ
            continue
        if err_c is not None:
            failures.append(f"{where}: compiled raised {type(err_c).__name__}: "
                            f"{str(err_c).splitlines()[0] if str(err_c) else ''}")
            break
        problems = same(got, want, _exact_like(exact_out, want), "result", None, low)
        if problems:  # maybe rounding of low-precision intermediates: run in higher precision
            up = _reference(program, device, call, seed, before, resize)
            problems = same(got, want, _exact_like(exact_out, want), "result", up[0], low)
        else:
            up = None
        problems = _cuda_norm_rows(program, device, call, problems)
        problems = _cpu_loops(program, device, call, seed, before, resize, got, problems, low)
        failures += [f"{where}: {p}" for p in problems]
        for i, (a, b) in enumerate(zip(xc, xe)):
            msg = same(a, b, False, f"input x{i} after the call",
                       None if up is None else up[1][i], low)
            msg = _cuda_norm_rows(program, device, call, msg)  # a norm written into it
            failures += [f"{where}: {m}" for m in msg]
        se, sc = _state(eager), _state(subject)
        for k in se:
            msg = same(sc.get(k), se[k], False, f"buffer {k}", None, low)
            if msg:
                up = up or _reference(program, device, call, seed, before, resize)
                msg = same(sc.get(k), se[k], False, f"buffer {k}", up[2].get(k), low)
            msg = _cuda_norm_rows(program, device, call, msg)
            failures += [f"{where}: {m}" for m in msg]
        ide = _identity_map(want, [t for t in list(xe) + list(se.values()) if t.numel()])
        idc = _identity_map(got, [t for t in list(xc) + list(sc.values()) if t.numel()])
        for i, (a, b) in enumerate(zip(idc, ide)):
            if b >= 0 and a != b:
                failures.append(f"{where}: result {i} is argument/buffer {b} in eager, not in "
                                f"the compiled call")
        if failures:
            break
    _cover_compiled(compiled)
    cover_program(program)
    if failures:
        STATS["failures"] += 1
    return failures


_NORMS = {"rms_norm", "layer_norm", "batch_norm", "group_norm", "instance_norm"}


def _cuda_norm_rows(program: Program, device: str, call: int, problems: list[str]) -> list[str]:
    """``problems``, less NaN-against-number differences of a norm over infinities on CUDA.

    Eager's CUDA norm kernels accumulate with Welford's update, whose result for a row or
    channel holding an infinity depends on where the infinity sits and on the kernel the
    shape picks: NaN for the whole row, or the formula's +-inf (and 0 at the finite
    elements). The CPU's kernels give the formula's, and so does fxlite, which the CPU runs
    check. Such differences are counted in STATS, not failed."""
    if device != "cuda" or not problems or call == 0 or not (program.records & _NORMS) \
            or not any(s.special for s in program.inputs):
        return problems
    kept = [p for p in problems if "difference: nan" not in p]
    STATS["NaN against a number in a CUDA norm over infinities (eager's order)"] += (
        len(problems) - len(kept))
    return kept


def _cpu_loops(program: Program, device: str, call: int, seed: int,
               before: dict[str, torch.Tensor], resize: bool, got: Any, problems: list[str],
               low: torch.dtype | None) -> list[str]:
    """``problems``, less NaN-against-number differences where eager's CPU kernels
    disagree with themselves.

    An elementwise CPU kernel runs a vectorized loop over contiguous runs and a scalar
    loop elsewhere, and the two can treat an infinity or a NaN differently: ``gelu(inf)``
    is NaN in the vector loop of float32 and bfloat16 and inf in the scalar one (fuzz
    seeds 8901735, 9000989, 9205403). Eager is run again, from the state before the
    call, on the same values laid out with a stride of 2 (its kernels then take the scalar
    loop). Where the compiled result matches that run, the difference is eager's own,
    counted in STATS, not failed. Only ops that read an input directly change loops this
    way (an intermediate is contiguous again): 9205403's gelu of an ``rsqrt`` still fails."""
    if device != "cpu" or not any("difference: nan" in p for p in problems):
        return problems
    strided = [strided_copy(x) for x in make_inputs(program, call, device, resize)]
    other, err, _ = _call(rebuilt(program, device, before), strided, seed)
    if err is not None or same(got, other, False, "result", None, low):
        return problems
    return cleared_by_scalar_loops(problems)


def rebuilt(program: Program, device: str, before: dict[str, torch.Tensor]) -> Any:
    """``program`` built again, with the state ``before`` (if any) loaded."""
    ref = program.build(device)
    if isinstance(ref, torch.nn.Module) and before:
        ref.load_state_dict(before)
    return ref


def strided_copy(x: Any) -> Any:
    """``x`` as a view with a stride of 2 along its last dim (same values): eager's CPU
    elementwise kernels take their scalar loop over it. Scalars and single elements as
    they are."""
    if isinstance(x, torch.Tensor) and x.dim() and x.numel() > 1:
        y = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
        x = y[..., ::2].copy_(x)
    return x


def cleared_by_scalar_loops(problems: list[str]) -> list[str]:
    """``problems`` less its NaN-against-number differences, counted in STATS: the caller
    found the compiled call equal to eager's run on strided inputs."""
    kept = [p for p in problems if "difference: nan" not in p]
    STATS["NaN against a number where eager's CPU vector and scalar loops disagree"] += (
        len(problems) - len(kept))
    return kept


def _loosest(program: Program) -> torch.dtype | None:
    """The lowest-precision floating dtype among the inputs, the buffers and the casts
    the program's code makes, float32 where bool or integer data is given, if any (a
    float64 result computed from float32 data is only as good as float32; a float32
    gradient through ``x.bfloat16()`` only as good as bfloat16: eager computes that
    gradient in bfloat16 too)."""
    order = (torch.bfloat16, torch.float16, torch.float32)
    dtypes = {s.dtype for s in program.inputs + program.buffers}
    if any(not (d.is_floating_point or d.is_complex) for d in dtypes):
        # a float op on bool or integer data computes in the default dtype (float32): a
        # float64 result of `b.cos().double()` is only as good as float32 (seed 7318743)
        dtypes.add(torch.get_default_dtype())
    code = "\n".join(line for s in program.steps for line in s.code)
    dtypes |= {d for d, pattern in _HALF_NAMES.items() if re.search(pattern, code)}
    return next((d for d in order if d in dtypes), None)


_HALF_NAMES = {torch.bfloat16: r"bfloat16|BFloat16", torch.float16: r"(?<!b)float16|half\b|Half"}


def _dead_code_error(program: Program, error: BaseException) -> bool:
    """Whether eager raised in a step whose value nothing uses (an ``expand`` to the old
    size of a value never read). A compiled function drops such code, so it does not
    raise; counted in STATS and noted with the seed (NOTES), not a failure."""
    import traceback

    filename = f"<fuzz program {program.seed}>"
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__)
             if f.filename == filename and f.lineno is not None]
    step = program.step_at(lines[-1]) if lines else None
    if step is None or step in program.value_steps():
        return False
    STATS["eager errors only in dead code (not raised when compiled)"] += 1
    NOTES.append((program.seed, f"eager raised {type(error).__name__} in dead code only "
                                f"(step {step}); compiled did not"))
    return True


def _exact_like(exact: Any, want: Any) -> Any:
    if isinstance(want, (tuple, list)) and not isinstance(exact, (tuple, list)):
        return [exact] * len(want)
    return exact


def upcast_program(program: Program, device: str, before: dict[str, torch.Tensor],
                   wide: bool = False) -> Any:
    """``program`` built with the state ``before`` (if any) and its buffers upcast
    (float16 and bfloat16 to float32, float32 to float64; ``wide``: all to float64)."""
    ref = rebuilt(program, device, before)
    if isinstance(ref, torch.nn.Module):
        for name, buf in list(ref.named_buffers()):
            owner = ref.get_submodule(name.rpartition(".")[0]) if "." in name else ref
            owner._buffers[name.rpartition(".")[2]] = _upcast(buf, wide)
    return ref


def _reference(program: Program, device: str, call: int, seed: int,
               before: dict[str, torch.Tensor], resize: bool = False
               ) -> tuple[Any, list[Any], dict[str, Any]]:
    """The program in higher precision (float16 and bfloat16 as float32, float32 as
    float64), from the state eager had before the call: (result, inputs after, state)."""
    for wide in (False, True):  # all in float64 where eager refuses the mix (batch_norm
        # of a float32 input with float64 statistics, from bf16 and f32)
        ref = upcast_program(program, device, before, wide)
        xs = [_upcast(x, wide) for x in make_inputs(program, call, device, resize)]
        out, err, _ = _call(ref, xs, seed)
        if err is None:
            break
    return (out if err is None else None), xs, _state(ref)


# ---------------------------------------------------------------------- the passes
def check_passes(program: Program, device: str = "cpu", calls: int = 2) -> list[str]:
    """Failures of trace -> normalize -> cse -> decompose -> fuse against eager.

    Programs with buffers are skipped: symbolic tracing (torch.fx's too) runs ops on
    buffers once, at trace time, and keeps the results as constants. Where fxlite cannot
    trace a program, torch.fx must fail too."""
    import torch.fx
    from fxlite.passes import ShapeProp, cse, decompose, fuse, normalize

    import fxlite

    if program.buffers:
        return []
    reference = program.build(device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = fxlite.symbolic_trace(copy.deepcopy(reference) if program.is_module else
                                       reference)
    except Exception as e:
        try:
            torch.fx.symbolic_trace(copy.deepcopy(reference) if program.is_module else
                                    reference)
        except Exception:
            return []  # torch.fx cannot trace it either
        STATS["failures"] += 1
        return [f"symbolic_trace raised {type(e).__name__}: {e} (torch.fx traces it)"]
    STATS["programs (passes)"] += 1
    _cover_graph(gm)
    stage = "ShapeProp"
    try:
        saved = {k: v.clone() for k, v in gm.state_dict().items()}
        torch.manual_seed(0)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ShapeProp(gm).propagate(*make_inputs(program, 0, device))
            for stage, p in (("normalize", normalize), ("cse", cse), ("decompose", decompose)):
                gm = p(gm)
                gm.graph.lint()
            stage = "ShapeProp after decompose"
            ShapeProp(gm).propagate(*make_inputs(program, 0, device))
            stage = "fuse"
            fused = fuse(gm)
            fused.graph.lint()
        _load(fused, saved)
    except Exception as e:
        if stage == "ShapeProp" and _call(reference, make_inputs(program, 0, device), 0)[1]:
            return []  # eager raises too (int matmul on CUDA): the compiled path checks that
        STATS["failures"] += 1
        return [f"{stage} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
    _cover_graph(gm)
    failures = []
    for call in range(calls):
        seed = 2000 + call
        xe, xc = make_inputs(program, call, device), make_inputs(program, call, device)
        want, err_e, _ = _call(reference, xe, seed)
        got, err_c, _ = _call(fused, xc, seed)
        if err_e is not None or err_c is not None:
            if (err_e is None) != (err_c is None):
                failures.append(f"call {call}: eager raised {err_e!r}, the fused module "
                                f"raised {err_c!r}")
            continue
        ex = _exact_like(program.exact_structure(), want)
        low = _loosest(program)  # as check_compiled: float32 from float16 data is float16's
        problems = same(got, want, ex, "result", None, low)
        if problems:  # maybe rounding of low-precision intermediates
            problems = same(got, want, ex, "result", _reference(program, device, call, seed,
                                                                 {})[0], low)
        problems = _cuda_norm_rows(program, device, call, problems)
        problems = _cpu_loops(program, device, call, seed, {}, False, got, problems, low)
        failures += [f"call {call} (fused): {p}" for p in problems]
        for i, (a, b) in enumerate(zip(xc, xe)):
            failures += [f"call {call}: {m}" for m in same(a, b, False, f"input x{i} after")]
    if failures:
        STATS["failures"] += 1
    return failures


def _load(gm: Any, saved: dict[str, torch.Tensor]) -> None:
    own = gm.state_dict()
    for k, v in saved.items():
        if k in own:
            own[k].copy_(v)


# ---------------------------------------------------------------------- coverage
def records_of(gm: Any) -> set[str]:
    """The op-table records ``gm``'s nodes use: as spelled and as refined, with in-place
    methods (``add_``, ``__iadd__``) counted as their op (and operator.iadd)."""
    from fxlite.ops import lookup
    from fxlite.ops.table import _BY_METHOD, _direct_lookup

    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        for info in (_direct_lookup(node, gm), _safe_lookup(lookup, node, gm)):
            if info is not None:
                out.add(info.name)
        if node.op == "call_method" and isinstance(node.target, str):
            m = node.target
            if m.startswith("__i") and m.endswith("__"):
                out.add(f"_operator.{m[2:-2]}")
                base = _BY_METHOD.get(m[3:-2])
            elif m.endswith("_") and not m.endswith("__"):
                base = _BY_METHOD.get(m[:-1])
            else:
                base = None
            if base is not None:
                out.add(base.name)
    return out


def _safe_lookup(fn: Any, node: Any, gm: Any) -> Any:
    try:
        return fn(node, gm)
    except Exception:
        return None


def _cover_graph(gm: Any) -> None:
    COVERAGE.update(records_of(gm))


def _cover_compiled(compiled: Any) -> None:
    from fxlite.codegen.compile import CompiledModule

    if isinstance(compiled, CompiledModule):
        compiled = compiled._compiled
    seen: set[int] = set()

    def walk(seg: Any) -> None:
        if id(seg) in seen or not hasattr(seg, "gm"):
            return
        seen.add(id(seg))
        _cover_graph(seg.gm)
        for child in seg.children.values():
            walk(child)

    for root in compiled._trees.values():
        walk(root)


# Effects that stop a recording (the call then runs in eager PyTorch): no captured graph
# holds them, so a program that ran them through fxlite.compile counts as covering them.
RUN_EAGER = {"builtins.print", "torch.random.manual_seed"}


def cover_program(program: Program) -> None:
    """Count the eager-only records ``program`` ran (see RUN_EAGER)."""
    COVERAGE.update(program.records & RUN_EAGER)


def table_records() -> list[str]:
    """The op table's records, less those a test registered (``fx.has_side_effect``)."""
    from fxlite.ops import OPS

    out = []
    for name, info in OPS.items():
        mods = {(getattr(f, "__module__", None) or "") for f in info.functions}
        if mods and all(m.split(".")[0].startswith("test") for m in mods):
            continue
        out.append(name)
    return sorted(out)


def summary() -> str:
    """Program counts, failures and op coverage, as a few lines of text."""
    from fuzz_catalog import EXCLUDED

    names = table_records()
    hit = [n for n in names if COVERAGE[n]]
    missed = [n for n in names if not COVERAGE[n] and n not in EXCLUDED]
    programs = ", ".join(f"{v} {k.split('(')[1][:-1]}" for k, v in sorted(STATS.items())
                         if k.startswith("programs"))
    lines = [f"fuzz: {sum(v for k, v in STATS.items() if k.startswith('programs'))} program "
             f"runs ({programs}); {STATS['failures']} failing",
             f"fuzz op coverage: {len(hit)} of {len(names)} op-table records exercised"
             f" ({len(EXCLUDED)} excluded: {', '.join(sorted(EXCLUDED))})"]
    if missed:
        lines.append(f"fuzz: not exercised: {', '.join(missed)}")
    return "\n".join(lines)
