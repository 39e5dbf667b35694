"""``fxlite.compile(fn, dynamic=True)``: ``fn`` under Dynamo with symbolic sizes.

Size-generic code must know every use of a size. fxlite's recorder sees the torch calls,
but Python's C code reads an int's value without asking it (``range(n)``), so a size it
hands to the user's Python could be used unseen. Dynamo runs the bytecode and sees each
use. Its graphs take sizes as ``SymInt`` arguments, which fxlite records as inputs
(``capture/symbolic.py``): one recording per graph serves every size, with the same
kernels. :class:`DynamicFunction` is that pairing; ``compile.py`` builds it for
``dynamic=True``, and for a call given a tensor marked with ``torch._dynamo.mark_dynamic``.

Before/after, for ``f(x) = relu(x.view(x.shape[0] * x.shape[1], -1))``::

    fxlite.compile(f)(x)                 # a recording per (B, T): the key holds the sizes
    fxlite.compile(f, dynamic=True)(x)   # Dynamo's graph: view(l_x_, (s0 * s1, -1)),
                                         # recorded once, s0 and s1 inputs of its kernels
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from fxlite.codegen.lower.autograd import backward_untraced

__all__ = ["DynamicFunction", "ready_graph"]


def ready_graph(gm: torch.fx.GraphModule) -> None:
    """Generate a lazy GraphModule's code now: its first call would set its ``forward``,
    which fxlite's guards would see as the module changing its own state."""
    real = getattr(gm, "real_recompile", None)
    if real is not None:
        real()


class DynamicFunction:
    """``fn`` under Dynamo with sizes symbolic; ``compile_graph(gm)`` compiles each graph
    Dynamo captures (``fxlite.compile(gm, ...)``), or, with ``named``, Dynamo's graphs go
    to that Dynamo backend with ``mode`` and ``options``, as in ``torch.compile``.

    Attributes (of the graphs the latest call ran, as ``CompiledFunction``'s):
        kernels, fallbacks, code, tier; ``recordings`` counts over all graphs made.
    """

    def __init__(self, fn: Any, compile_graph: Callable[[torch.fx.GraphModule], Any],
                 fullgraph: bool = False, dynamic: bool | None = True,
                 named: str | None = None, mode: str | None = None,
                 options: dict[str, Any] | None = None,
                 copy: Callable[[], Any] | None = None) -> None:
        import torch._dynamo  # here: a slow import that only this path needs

        self._fn = fn
        self._graphs: list[Any] = []  # every graph compiled for fn
        self._ran: list[Any] = []  # the graphs the current call ran
        self._last: list[Any] = []  # ... and the latest finished call
        self._copy = copy  # compiles fn again with the same arguments, for deepcopy
        self._named = named
        if named is not None:
            self._dynamo = torch.compile(fn, backend=named, fullgraph=fullgraph,
                                         dynamic=dynamic, mode=mode, options=options)
        else:
            self._dynamo = torch.compile(fn, backend=self._backend(compile_graph),
                                         fullgraph=fullgraph, dynamic=dynamic)
        if not isinstance(fn, torch.nn.Module):
            try:
                functools.update_wrapper(self, fn)
            except AttributeError:  # builtins such as torch.relu have no __dict__
                pass

    def _backend(self, compile_graph: Callable[[torch.fx.GraphModule], Any]) -> Any:
        """A Dynamo backend that compiles each graph and notes each run of it."""

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            ready_graph(gm)
            backward_untraced()
            compiled = compile_graph(gm)
            self._graphs.append(compiled)

            def run(*args: Any) -> Any:
                self._ran.append(compiled)
                return compiled(*args)

            return run

        return backend

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
        if self._copy is None:
            raise TypeError("this DynamicFunction was not made by fxlite.compile")
        return self._copy()

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
