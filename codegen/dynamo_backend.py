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

**Dynamo under fxlite.compile** (``fxlite.compile(fn, dynamic=True)``, and a call given a
tensor marked with ``torch._dynamo.mark_dynamic``) is ``codegen/dynamic.py``.

What ran: :func:`compiled_graphs` lists the compiled functions this module made (each
has ``kernels`` and ``fallbacks``), and :func:`kernel_count` adds up their kernels.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any

import torch
from fxlite.codegen import compiler
from fxlite.codegen import options as options_module
from fxlite.codegen.compile import compile as fx_compile
from fxlite.codegen.dynamic import ready_graph
from fxlite.codegen.lower.autograd import backward_untraced

__all__ = ["compiled_graphs", "fxlite_aot_backend", "fxlite_backend", "kernel_count"]

_LOCK = threading.Lock()
_MADE: list[weakref.ref] = []  # the compiled graphs of fxlite_backend, oldest first


def fxlite_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                   mode: str | None = None, options: dict[str, Any] | None = None) -> Any:
    """A Dynamo backend: compile one graph that Dynamo captured with ``fxlite.compile``.

    Args:
        gm: Dynamo's graph (torch-level functions, methods and modules).
        example_inputs: its example inputs (unused: fxlite records the first real call).
        mode: ``torch.compile``'s mode, passed on to ``fxlite.compile``.
        options: ``torch.compile``'s options, passed on to ``fxlite.compile``.

    Returns:
        The compiled graph, called with the graph's inputs.

    Example::

        compiled = torch.compile(model, backend="fxlite")
        compiled(x)
    """
    ready_graph(gm)
    backward_untraced()
    compiled = fx_compile(gm, mode=mode, options=options)
    with _LOCK:
        _MADE.append(weakref.ref(compiled))
    return compiled


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
