"""fxlite.compile: trace a function or module, fuse it, and run Triton kernels.

On the first call with a new guard key (dtypes, ranks, devices, stride patterns, grad
mode), the pipeline runs once::

    trace -> ShapeProp on the real inputs -> normalize -> decompose -> ShapeProp -> fuse
          -> one Triton kernel per fused group (checked against eager on that call)
          -> a regenerated Python forward that calls the kernels and torch for the rest

Anything that cannot be compiled runs in eager PyTorch: a graph that cannot be traced,
a group the kernel generator declines, a kernel whose first result disagrees with eager,
and any call that needs autograd (kernels are inference-only). Each fallback is recorded
in ``.fallbacks`` and warned about once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fxlite.codegen.report import KernelRecord, kernel_report
from fxlite.codegen.triton_launch import fast_key, only_kernels, straight_line

from fxlite.graph_module import GraphModule
from fxlite.interpreter import Interpreter
from fxlite.node import Opcode
from fxlite.proxy import TraceError
from fxlite.tracer import symbolic_trace

__all__ = ["CompiledFunction", "compile"]

Backend = str | Callable[[GraphModule, list[Any]], Callable[..., Any]]
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _guard_key(args: Sequence[Any]) -> tuple:
    """What a compiled entry is specialized on: never sizes, so resizes reuse kernels."""
    key: list[Any] = [torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            contiguous = a.is_contiguous()
            key.append((a.dtype, a.device, a.dim(), contiguous, a.requires_grad,
                        a.data_ptr() % 16 == 0,
                        None if contiguous else tuple(s == 0 for s in a.stride())))
        else:
            key.append(type(a))
    return tuple(key)


@dataclass
class _Entry:
    """One compiled specialization: the function to call plus what went into it."""

    run: Callable[..., Any]
    gm: GraphModule | None = None
    kernels: list[Any] = field(default_factory=list)
    records: list[KernelRecord] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)


class _KernelCheck(Interpreter):
    """Runs the fused module once, building and checking a kernel for each fused group."""

    def __init__(self, gm: GraphModule, mode: str | None) -> None:
        super().__init__(gm)
        self.kernels: dict[str, Any] = {}
        self.records: list[KernelRecord] = []
        self.fallbacks: list[str] = []
        self._mode = mode

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        sub = self.fetch_attr(target)
        if not getattr(sub, "meta", {}).get("fused_kind") or kwargs:
            return sub(*args, **kwargs)
        from fxlite.codegen.triton import generate_kernel

        try:
            kernel = generate_kernel(sub, list(args), name=f"triton_{target}")
        except Exception as e:  # the generator must never break a model: fall back
            kernel, reason = None, f"{type(e).__name__}: {e}"
        else:
            reason = "the kernel generator does not support it"
        got = expected = None
        if kernel is not None:
            try:
                if self._mode == "max-autotune":
                    kernel.autotune(*args)  # time candidate block sizes and warps, keep the best
                got = kernel(*args)
                if not kernel.checked:  # else it matched eager before (the disk index says)
                    expected = sub(*args)
                    _assert_same(got, expected)
                    kernel.mark_checked()
            except Exception as e:
                kernel, reason = None, f"its kernel disagreed with eager: {e}"
        if kernel is None:
            self.fallbacks.append(f"{target} ({', '.join(sub.meta.get('nodes', []))}) runs in "
                                  f"eager: {reason}")
            return sub(*args) if expected is None else expected
        self.kernels[target] = kernel
        result = got if expected is None else expected
        self.records.append(KernelRecord.of(kernel, args, result))
        return result


def _assert_same(got: Any, expected: Any) -> None:
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            raise AssertionError("output structure differs")
        for g, e in zip(got, expected):
            _assert_same(g, e)
        return
    if isinstance(expected, torch.Tensor):
        if not (expected.is_floating_point() or expected.is_complex()):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)  # integers, bool
            return
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(expected.dtype, 1.3e-6)
        atol = 1e-5 if expected.dtype == torch.float32 else tol
        torch.testing.assert_close(got, expected, rtol=max(tol, 1e-5), atol=atol, equal_nan=True)
    elif got != expected:
        raise AssertionError(f"{got!r} != {expected!r}")


def _swap_in_kernels(gm: GraphModule, kernels: dict[str, Any]) -> None:
    """Turn each ``call_module fused_i`` into a direct call of its kernel."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in kernels:
            target = node.target
            node.op, node.target = Opcode.CALL_FUNCTION, kernels[target]
            gm.delete_submodule(target)
    gm.recompile()


class CompiledFunction:
    """What :func:`compile` returns for a function: call it like the original.

    Attributes:
        kernels: the Triton kernels of the most recent specialization (after a call).
        fallbacks: why parts of it run in eager PyTorch.
        code: the generated Python forward of that specialization.
    """

    def __init__(self, fn: Callable[..., Any], backend: Backend = "triton",
                 fullgraph: bool = False, mode: str | None = None) -> None:
        if mode not in (None, "default", "reduce-overhead", "max-autotune"):
            raise ValueError(f"unknown mode {mode!r}; expected None, 'default', "
                             "'reduce-overhead' or 'max-autotune'")
        if isinstance(backend, str) and backend not in ("triton", "python"):
            raise ValueError(f"unknown backend {backend!r}; expected 'triton', 'python' or a "
                             "callable backend(gm, example_inputs)")
        self._fn, self._backend, self._fullgraph, self._mode = fn, backend, fullgraph, mode
        self._signature = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.Lock()
        self._last: _Entry | None = None
        self._submodules = list(fn.modules()) if isinstance(fn, torch.nn.Module) else []
        self._graphs: Any = None  # GraphReplays, for mode="reduce-overhead" on CUDA
        if mode == "reduce-overhead" and backend == "triton" and torch.cuda.is_available():
            from fxlite.codegen.cudagraphs import GraphReplays

            self._graphs = GraphReplays()
        # fast_key -> a forward of straight direct launches (GPU kernels only); None once
        # an entry turns out to hold other ops
        self._fast: dict[tuple, tuple[Callable[..., Any], _Entry]] | None = None
        self._fast_misses = 0
        if backend == "triton" and mode != "reduce-overhead" and torch.cuda.is_available():
            self._fast = {}
        if not isinstance(fn, torch.nn.Module):
            functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # positional, in signature order; skipped defaults filled in
            bound = self._signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        # kernels bake in train/eval behaviour (dropout, batch_norm)
        flags = tuple(m.training for m in self._submodules) if self._submodules else ()
        graphs = self._graphs
        if graphs is not None:  # a captured CUDA graph for these very inputs: replay it
            replay_key = graphs.key(args, flags)
            found = graphs.replay(replay_key)
            if found is not graphs.MISS:
                self._last = found[1]
                return found[0]
        fast = self._fast
        if fast is not None:  # inputs laid out as seen before: launch the kernels directly
            fkey = fast_key(args)
            fast_id = (torch.is_grad_enabled(), flags, fkey)
            found = fast.get(fast_id)
            if found is not None:
                self._last = found[1]
                return found[0](*args)
        key = _guard_key(args) + flags
        entry = self._entries.get(key)
        if entry is None:
            with self._lock:  # threads racing on a first call compile once
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._compile(args)
                    self._entries[key] = entry
        self._last = entry
        if graphs is not None and entry.kernels:
            return graphs.run(replay_key, entry.run, args, entry)
        if fast is not None and entry.kernels and fkey is not None and len(fast) < 64:
            made = straight_line(entry.gm, args)
            if made is not None:
                fast[fast_id] = made[0], entry
                return made[1]
            self._fast_misses += 1  # a kernel without a prepared launch (yet)
            if not only_kernels(entry.gm) or self._fast_misses > 8:
                self._fast = None  # extern ops: their outputs' layouts are not in the key
        return entry.run(*args)

    # ------------------------------------------------------------------ introspection
    @property
    def kernels(self) -> list[Any]:
        """The Triton kernels of the latest specialization."""
        return list(self._last.kernels) if self._last else []

    @property
    def fallbacks(self) -> list[str]:
        """Why parts of the latest specialization run in eager PyTorch."""
        return list(self._last.fallbacks) if self._last else []

    @property
    def code(self) -> str:
        """The generated Python forward of the latest specialization."""
        if self._last is None or self._last.gm is None:
            return ""
        return self._last.gm.code

    def report(self, benchmark: bool = False) -> str:
        """Print and return a table of the kernels: name, fused ops, shapes, bytes moved.

        With ``benchmark=True`` each kernel is also timed on fresh inputs of the recorded
        shapes, with its GB/s and its share of a device-to-device copy of as many bytes.
        """
        text = kernel_report(self._last.records if self._last else [], benchmark=benchmark)
        print(text)
        return text

    # ------------------------------------------------------------------ compiling
    def _compile(self, args: tuple) -> _Entry:
        try:
            gm = symbolic_trace(self._fn)
        except TraceError as e:
            if self._fullgraph:
                raise TraceError(f"fullgraph=True, but the function cannot be captured as one "
                                 f"graph:\n{e}") from None
            reason = f"graph break: {str(e).splitlines()[0]}; the whole call runs in eager"
            _warn_once(f"fxlite.compile: {reason}\n{e}")
            return _Entry(run=self._fn, fallbacks=[reason])
        if callable(self._backend):
            return _Entry(run=self._backend(gm, list(args)), gm=gm)
        entry = _Entry(run=_direct_forward(gm), gm=gm)
        if self._backend == "triton":
            entry = self._compile_triton(gm, args) or entry
        return entry

    def _compile_triton(self, gm: GraphModule, args: tuple) -> _Entry | None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        on_gpu = any(t.is_cuda for t in tensors)
        if not on_gpu and not _interpreting():
            _warn_once("fxlite.compile: no GPU tensors and TRITON_INTERPRET is not set, so "
                       "backend='triton' runs the regenerated Python forward instead")
            return None
        if torch.is_grad_enabled() and (any(t.requires_grad for t in tensors) or any(
                p.requires_grad for p in gm.parameters())):
            _warn_once("fxlite.compile: Triton kernels are inference-only and this call needs "
                       "autograd, so it runs the Python forward; wrap calls in torch.no_grad() "
                       "or torch.inference_mode() to use kernels")
            return _Entry(run=_direct_forward(gm), gm=gm,
                          fallbacks=["autograd is enabled: the Python forward runs"])
        from fxlite.codegen.cache import propagate_shapes
        from fxlite.passes.decompose import decompose
        from fxlite.passes.fuse import fuse
        from fxlite.passes.normalize import normalize

        with _sandbox(gm, args) as sample:
            propagate_shapes(gm, sample)  # ShapeProp, or what it gave an earlier process
            gm = decompose(normalize(gm))
            gm.graph.eliminate_dead_code()
            gm.recompile()
            propagate_shapes(gm, sample)
            fused = fuse(gm)
            check = _KernelCheck(fused, self._mode)
            check.run(*sample)
        for reason in check.fallbacks:
            _warn_once(f"fxlite.compile: {reason}")
        _swap_in_kernels(fused, check.kernels)
        run = _direct_forward(fused)
        return _Entry(run=run, gm=fused, kernels=list(check.kernels.values()),
                      records=check.records, fallbacks=check.fallbacks)


def _private_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its own storage but the same offset, sizes and strides."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride())


@contextlib.contextmanager
def _sandbox(gm: GraphModule, args: tuple) -> Iterator[tuple]:
    """Inputs for the compile-time runs (ShapeProp twice, the kernel check), which must
    leave no trace: the first call would otherwise apply in-place ops on the caller's
    tensors several times, update module buffers (BatchNorm statistics in training mode)
    several times, and advance the random generators that the real run then uses."""
    from fxlite.ops import is_impure

    mutates = any(is_impure(n, gm) or n.op == Opcode.CALL_MODULE and getattr(
        gm.get_submodule(n.target), "inplace", False) is True for n in gm.graph.nodes
        if n.op not in (Opcode.PLACEHOLDER, Opcode.OUTPUT))
    sample = tuple(_private_copy(a) if mutates and isinstance(a, torch.Tensor) else a
                   for a in args)
    saved = [(b, b.clone()) for b in gm.buffers()]
    devices = sorted({a.device.index or 0 for a in args
                      if isinstance(a, torch.Tensor) and a.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            yield sample
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _direct_forward(gm: GraphModule) -> Callable[..., Any]:
    # Calling forward directly skips nn.Module.__call__ and its hook checks: host time.
    return functools.partial(type(gm).forward, gm)


class CompiledModule(torch.nn.Module):
    """What :func:`compile` returns for a module: a module that runs the compiled forward."""

    def __init__(self, module: torch.nn.Module, compiled: CompiledFunction) -> None:
        super().__init__()
        self._orig_mod = module
        self.__dict__["_compiled"] = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            compiled = self.__dict__.get("_compiled")
            if compiled is not None and hasattr(compiled, name):
                return getattr(compiled, name)
            return getattr(self._orig_mod, name)


def compile(fn: Callable[..., Any] | torch.nn.Module | None = None, *,
            backend: Backend = "triton", fullgraph: bool = False,
            mode: str | None = None) -> Any:
    """Compile a function or module, as ``torch.compile`` does.

    Args:
        fn: a function or ``nn.Module``; omit it to use ``@fxlite.compile(...)``.
        backend: ``"triton"`` (fused kernels), ``"python"`` (the regenerated forward only),
            or a callable ``backend(gm, example_inputs) -> callable``.
        fullgraph: raise instead of falling back to eager when tracing fails.
        mode: None, ``"reduce-overhead"`` (replay CUDA graphs for small inputs) or
            ``"max-autotune"`` (try several block sizes per kernel).

    Returns:
        A callable with the original's signature (a module for a module).

    Example::

        @fxlite.compile
        def f(x):
            return torch.relu(x + 1) * 2

        f(torch.randn(8192, 8192, device="cuda"))
        print(f.kernels[0].source)
    """
    if fn is None:
        return functools.partial(compile, backend=backend, fullgraph=fullgraph, mode=mode)
    compiled = CompiledFunction(fn, backend, fullgraph, mode)
    if isinstance(fn, torch.nn.Module):
        return CompiledModule(fn, compiled)
    return compiled
