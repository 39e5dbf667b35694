"""fxlite and ``torch._dynamo``, both ways.

**fxlite as a Dynamo backend.** ``pip install`` registers :func:`fxlite_backend` under the
``torch_dynamo_backends`` entry point (``setup.cfg``), so that::

    model = torch.compile(model, backend="fxlite")

works, and ``"fxlite"`` is in ``torch._dynamo.list_backends()``. Dynamo runs the Python:
it captures graphs, guards them, and breaks where Python must run (a ``print``, an
``.item()``). Each graph it hands over becomes ``fxlite.compile(graph)``: fxlite records
it on its first call, fuses it, and runs its own Triton kernels (through Triton's
interpreter on the CPU). Where inputs need gradients, fxlite's autograd gives each fused
group a Triton backward, so ``loss.backward()`` and the optimizer work as in eager.

Why not AOTAutograd by default: its graphs hold ``torch.ops.aten`` overloads, and
fxlite's op table (and so its fusion) knows an aten overload only where it is one more
spelling of a record (its schema lists the record's parameters in order: ``add.Tensor``,
``mul.Tensor``, ``relu``, ``sum.dim_IntList``, ``view``...). Dynamo's graphs hold the
torch-level functions, all of which it knows. ``backend="fxlite_aot"``
(:data:`fxlite_aot_backend`) goes through AOTAutograd with fxlite compiling the forward
and backward graphs. It is correct, and it fuses those spellings and the backward ops
that ``decompose`` has rules for (``threshold_backward``, ``gelu_backward``). Aten ops
with neither (``native_layer_norm`` and its backward) run as they are, so it runs fewer
kernels than ``backend="fxlite"``: a Linear-GELU-LayerNorm-Linear training step runs 2
kernels against 3.

**Dynamo's backends inside fxlite** (``fxlite.compile(fn, backend="inductor")``) are the
other way round, below ``fxlite.compile``: ``fxlite.codegen.options`` maps such a name to
a backend for each segment graph (``dynamo_segment_backend``, ``to_torch_fx``).

**Dynamo under fxlite.compile.** ``fxlite.compile(fn, dynamic=True)``, and a call given a
tensor marked with ``torch._dynamo.mark_dynamic``, run ``fn`` under Dynamo with symbolic
sizes, each graph compiled as above (:class:`DynamicFunction`): Dynamo sees every use of a
size in the Python, which fxlite's recorder cannot (``capture/symbolic.py``).

What ran: :func:`compiled_graphs` lists the compiled functions this module made (each
has ``kernels`` and ``fallbacks``), and :func:`kernel_count` adds up their kernels.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings
import weakref
from typing import Any

import torch
from fxlite.codegen import compiler
from fxlite.codegen import options as options_module
from fxlite.codegen.compile import compile as fx_compile
from fxlite.codegen.lower.autograd import backward_untraced

__all__ = ["DynamicFunction", "compiled_graphs", "fxlite_aot_backend", "fxlite_backend", "kernel_count"]

_LOCK = threading.Lock()
_MADE: list[weakref.ref] = []  # the compiled graphs of fxlite_backend, oldest first


def fxlite_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                   mode: str | None = None, options: dict[str, Any] | None = None,
                   backend: str = "triton") -> Any:
    """A Dynamo backend: compile one graph that Dynamo captured with ``fxlite.compile``.

    Args:
        gm: Dynamo's graph (torch-level functions, methods and modules).
        example_inputs: its example inputs (unused: fxlite records the first real call).
        mode: ``torch.compile``'s mode, passed on to ``fxlite.compile``.
        options: ``torch.compile``'s options, passed on to ``fxlite.compile``.
        backend: fxlite's backend for the graph, ``"triton"`` or ``"python"``.

    Returns:
        The compiled graph, called with the graph's inputs.

    Example::

        compiled = torch.compile(model, backend="fxlite")
        compiled(x)
    """
    _ready(gm)
    backward_untraced()
    compiled = fx_compile(gm, mode=mode, options=options, backend=backend)
    with _LOCK:
        _MADE.append(weakref.ref(compiled))
    return compiled


def _ready(gm: torch.fx.GraphModule) -> None:
    """Generate a lazy GraphModule's code now: its first call would set its ``forward``,
    which fxlite's guards would see as the module changing its own state."""
    real = getattr(gm, "real_recompile", None)
    if real is not None:
        real()


def _aot_compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """AOTAutograd's forward and backward compiler: the graph under ``fxlite.compile``,
    taking AOTAutograd's boxed arguments (a list it may clear)."""
    from torch._functorch.aot_autograd import make_boxed_func  # here: a slow import

    compiled = fxlite_backend(gm, example_inputs)
    return make_boxed_func(lambda *args: compiled(*args))


def _make_aot() -> Any:
    from torch._dynamo.backends.common import aot_autograd  # here: a slow import

    return aot_autograd(fw_compiler=_aot_compiler, bw_compiler=_aot_compiler)


class _LazyAot:
    """``fxlite_aot_backend``: AOTAutograd, built on first use (its import is heavy)."""

    def __init__(self) -> None:
        self._made: Any = None
        functools.update_wrapper(self, _make_aot)
        self.__name__ = "fxlite_aot_backend"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any
                 ) -> Any:
        if self._made is None:
            self._made = _make_aot()
        return self._made(gm, example_inputs, **kwargs)


fxlite_aot_backend = _LazyAot()
"""A Dynamo backend through AOTAutograd, with fxlite compiling its forward and backward
graphs (``backend="fxlite_aot"``). See the module docstring for what it fuses today."""


class DynamicFunction:
    """What ``fxlite.compile(fn, dynamic=True)`` returns: ``fn`` under Dynamo with sizes
    symbolic, each graph Dynamo captures compiled by :func:`fxlite_backend`.

    Why Dynamo: size-generic code must know every use of a size. fxlite's recorder sees
    the torch calls, but Python's C code reads an int's value without asking it
    (``range(n)``), so a size it hands to Python could be used unseen. Dynamo runs the
    bytecode and sees each use. Its graphs take sizes as ``SymInt`` arguments, which
    fxlite records as inputs (``capture/symbolic.py``): one recording per graph serves
    every size, with the same kernels.

    Attributes (of the graphs the latest call ran, as ``CompiledFunction``'s):
        kernels, fallbacks, code, tier; ``recordings`` counts over all graphs made.
    """

    def __init__(self, fn: Any, backend: Any = "triton", fullgraph: bool = False,
                 mode: str | None = None, options: dict[str, Any] | None = None,
                 dynamic: bool | None = True) -> None:
        import torch._dynamo  # here: a slow import that only this path needs

        self._fn = fn
        self._graphs: list[Any] = []  # every graph compiled for fn
        self._ran: list[Any] = []  # the graphs the current call ran
        self._last: list[Any] = []  # ... and the latest finished call
        self._given: dict[str, Any] = {}  # compile()'s arguments (set by it), for copies
        # a Dynamo backend's name: Dynamo's graphs go to it, as torch.compile's
        self._named = backend if isinstance(backend, str) and backend not in (
            "triton", "python") else None
        if self._named:
            self._dynamo = torch.compile(fn, backend=backend, fullgraph=fullgraph,
                                         dynamic=dynamic, mode=mode, options=options)
        else:
            self._dynamo = torch.compile(fn, backend=self._backend(backend, mode, options),
                                         fullgraph=fullgraph, dynamic=dynamic)
        if not isinstance(fn, torch.nn.Module):
            try:
                functools.update_wrapper(self, fn)
            except AttributeError:
                pass

    def _backend(self, backend: Any, mode: str | None, options: dict[str, Any] | None) -> Any:
        """A Dynamo backend that compiles each graph with fxlite and notes each run."""
        graphs, ran = self._graphs, self

        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            if callable(backend):
                _ready(gm)
                backward_untraced()
                compiled = fx_compile(gm, backend=backend, mode=mode)
            else:
                compiled = fxlite_backend(gm, example_inputs, mode=mode, options=options,
                                          backend=backend)
            graphs.append(compiled)

            def run(*args: Any) -> Any:
                ran._ran.append(compiled)
                return compiled(*args)

            return run

        return compile_graph

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """Bound to the instance when it is a method in a class body."""
        return self if obj is None else types.MethodType(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._ran = []
        try:
            return self._dynamo(*args, **kwargs)
        finally:
            self._last = self._ran

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy compiles the same function again with the same arguments."""
        return fx_compile(self._fn, **self._given)

    @property
    def kernels(self) -> list[Any]:
        """The Triton kernels of the graphs the latest call ran."""
        return [k for g in self._last for k in g.kernels]

    @property
    def fallbacks(self) -> list[str]:
        """Why parts of the graphs the latest call ran run in eager PyTorch."""
        return [f for g in self._last for f in g.fallbacks]

    @property
    def tier(self) -> str:
        """``"replayed"`` when each graph the latest call ran replayed its recording, else
        the first other graph's tier; ``"eager: ..."`` when Dynamo ran no graph."""
        if self._named:
            return f"Dynamo's graphs compiled by backend {self._named!r}"
        if not self._last:
            return "eager: Dynamo captured no graph in it"
        return next((g.tier for g in self._last if g.tier != "replayed"), "replayed")

    @property
    def recordings(self) -> int:
        """How many recordings the graphs made, in all (one per graph for every size,
        unless a graph uses a size as a value)."""
        return sum(g.recordings for g in self._graphs)

    @property
    def code(self) -> str:
        """The generated Python of the graphs the latest call ran."""
        return "\n".join(g.code for g in self._last)


def compiled_graphs() -> list[Any]:
    """The live compiled graphs that :func:`fxlite_backend` made, oldest first.

    Example::

        torch.compile(f, backend="fxlite")(x)
        [len(g.kernels) for g in compiled_graphs()]
    """
    with _LOCK:
        return [g for g in (r() for r in _MADE) if g is not None]


def kernel_count() -> int:
    """How many Triton kernels the latest call of each compiled graph ran, in all."""
    return sum(len(g.kernels) for g in compiled_graphs())


def forget() -> None:
    """Forget the graphs made so far (``fxlite.reset()``)."""
    with _LOCK:
        _MADE.clear()


compiler.on_reset(forget)

# moved to fxlite.codegen.options (below fxlite.compile, which uses them); the old names
# go in the release after next
_MOVED = ("dynamo_segment_backend", "known_backends", "to_torch_fx")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(f"fxlite.codegen.dynamo_backend.{name} moved to "
                      f"fxlite.codegen.options.{name}; import it from there (the old path "
                      "goes in the next release)", DeprecationWarning, stacklevel=2)
        return getattr(options_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
