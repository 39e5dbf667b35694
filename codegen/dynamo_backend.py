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
fxlite's op table (and so its fusion) is keyed by torch-level functions, which Dynamo's
graphs hold. ``backend="fxlite_aot"`` (:data:`fxlite_aot_backend`) goes through
AOTAutograd with fxlite compiling the forward and backward graphs; it is correct but
fuses no aten op yet, so it runs no kernels of its own today.

**Dynamo's backends inside fxlite.** ``fxlite.compile(fn, backend="inductor")`` (or any
name ``torch._dynamo.list_backends()`` knows) gives each of fxlite's segment graphs to
that backend, converted to a ``torch.fx.GraphModule`` by :func:`to_torch_fx`
(:func:`dynamo_segment_backend`). A backend that cannot take one raises an error
naming the backend and why, and fxlite runs that segment's path in eager PyTorch with
one warning saying so.

What ran: :func:`compiled_graphs` lists the compiled functions this module made (each
has ``kernels`` and ``fallbacks``), and :func:`kernel_count` adds up their kernels.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch

__all__ = ["compiled_graphs", "dynamo_segment_backend", "fxlite_aot_backend", "fxlite_backend",
           "kernel_count", "known_backends", "to_torch_fx"]

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
    from fxlite.codegen.compile import compile as fx_compile

    _ready(gm)
    compiled = fx_compile(gm, mode=mode, options=options)
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
    from torch._functorch.aot_autograd import make_boxed_func

    compiled = fxlite_backend(gm, example_inputs)
    return make_boxed_func(lambda *args: compiled(*args))


def _make_aot() -> Any:
    from torch._dynamo.backends.common import aot_autograd

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


# ---------------------------------------------------------------------- the other way
def known_backends() -> list[str]:
    """Every name ``torch._dynamo`` knows, debug and experimental ones included."""
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


def to_torch_fx(gm: Any) -> torch.fx.GraphModule:
    """A ``torch.fx.GraphModule`` with the same nodes as fxlite's ``gm``.

    Targets, names and arguments are kept; ``get_attr`` and ``call_module`` targets are
    copied from ``gm`` as ``torch.fx.GraphModule`` copies them from a root module.

    Example::

        tgm = to_torch_fx(fxlite.symbolic_trace(model))
        torch.testing.assert_close(tgm(x), model(x))
    """
    from fxlite.node import map_arg

    graph = torch.fx.Graph()
    env: dict[Any, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        args = map_arg(node.args, env.__getitem__)
        kwargs = map_arg(node.kwargs, env.__getitem__)
        op = str(node.op)
        if op == "output":
            graph.output(args[0])
            continue
        made = graph.create_node(op, node.target, tuple(args), dict(kwargs), name=node.name)
        env[node] = made
    return torch.fx.GraphModule(gm, graph, type(gm).__name__)


def dynamo_segment_backend(name: str, *, mode: str | None = None,
                           options: dict[str, Any] | None = None,
                           dynamic: bool | None = None) -> Any:
    """``backend(gm, example_inputs)`` for ``fxlite.compile``: each of fxlite's segment
    graphs, converted by :func:`to_torch_fx`, given to the Dynamo backend ``name``.

    ``mode`` and ``options`` go to it as ``torch.compile`` gives them: for
    ``"inductor"``, the mode's settings and the options as its config patches; for
    another backend, as ``mode=`` and ``options=`` when given.

    Raises (when a segment compiles) a ``RuntimeError`` naming the backend and the
    reason, which ``fxlite.compile`` turns into one warning and eager PyTorch.
    """
    import torch._dynamo

    compiler = torch._dynamo.lookup_backend(name)
    kwargs: dict[str, Any] = {}
    if name == "inductor":
        import torch._inductor

        patches = dict(torch._inductor.list_mode_options(mode or "default", dynamic))
        patches.update(options or {})
        if patches:
            kwargs["config_patches"] = patches
    else:
        if mode and mode != "default":
            kwargs["mode"] = mode
        if options:
            kwargs["options"] = options

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        try:
            tgm = to_torch_fx(gm)
            return compiler(tgm, list(example_inputs), **kwargs)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise RuntimeError(f"backend {name!r} cannot compile fxlite's segment graph: "
                               f"{type(e).__name__}: {first}") from e

    backend.__name__ = backend.__qualname__ = f"dynamo_{name}"
    return backend
