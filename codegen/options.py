"""``fxlite.compile``'s arguments: torch.compile's whole signature, checked and mapped.

:func:`resolve` checks every argument ``fxlite.compile`` takes (one clear error per bad
one) and says what to build. The meanings follow ``torch.compile``:

==========================  ================================================================
argument                    what fxlite does with it
==========================  ================================================================
``fullgraph``               no graph break, as torch's: raise :class:`fxlite.TraceError`
                            where Python reads a tensor's value (a split) or the function
                            cannot be captured (an eager fallback); a function whose Python
                            has effects (prints, sets an argument's attributes) is followed
                            (its Python runs on every call), not refused
``dynamic``                 True: ``fn`` runs under Dynamo with every size symbolic, each
                            graph it captures compiled by fxlite with its sizes as inputs,
                            so one recording serves every size
                            (``dynamic.DynamicFunction``). None: fxlite's own
                            recorder, whose keys hold sizes only once the recorded code
                            reads one (``x.shape[0]``); a call given a tensor marked with
                            ``torch._dynamo.mark_dynamic`` switches ``fn`` to Dynamo, as
                            True does for the marked sizes. False: sizes are specialized,
                            marks ignored.
``backend``                 ``"triton"`` (also ``"fxlite"``; fused kernels), ``"python"``
                            (regenerated Python), ``"eager"`` (the function itself, not
                            compiled), a name ``torch._dynamo.list_backends()`` knows
                            (``"inductor"``, ``"aot_eager"``, ...; given each of fxlite's
                            segment graphs, see :func:`dynamo_segment_backend`),
                            or a callable ``backend(gm, example_inputs)`` given each segment
``mode``                    see :data:`MODES`
``options``                 see :data:`OPTIONS` (with fxlite's backends); with a Dynamo
                            backend, passed to it as ``torch.compile`` does
``name``                    a str or None, accepted (fxlite shows it nowhere yet)
``disable``                 True returns ``fn`` itself
``recompile_limit``         how many recordings before new keys and paths run in eager
                            (default ``CompiledFunction.recompile_limit``, 8); past it fxlite
                            warns and runs eagerly, also under ``fullgraph=True``
``isolate_recompiles``      accepted: each ``fxlite.compile`` call always has its own entries
``shapes_spec``             accepted, no effect
==========================  ================================================================

``mode`` and ``options`` together are an error, as in ``torch.compile``.

**Dynamo's backends inside fxlite.** ``fxlite.compile(fn, backend="inductor")`` (or any
name ``torch._dynamo.list_backends()`` knows) gives each of fxlite's segment graphs to
that backend, converted to a ``torch.fx.GraphModule`` by :func:`to_torch_fx`
(:func:`dynamo_segment_backend`). A backend that cannot take one raises an error
naming the backend and why, and fxlite runs that segment's path in eager PyTorch with
one warning saying so. (fxlite *as* a Dynamo backend is ``dynamo_backend.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from fxlite.codegen.compiler import register

from fxlite.node import map_arg

__all__ = ["MODES", "OPTIONS", "Settings", "dynamo_segment_backend", "known_backends",
           "resolve", "to_torch_fx"]

MODES: dict[Any, str] = {
    None: "the default",
    "default": "the default",
    "reduce-overhead": "replay segments from CUDA graphs (on a GPU; training steps too)",
    "max-autotune": "time several block sizes per kernel and keep the fastest (fxlite does "
                    "not add CUDA graphs to it, unlike Inductor's max-autotune)",
    "max-autotune-no-cudagraphs": "the same as fxlite's max-autotune",
}
"""The modes fxlite's backends take, and what each does."""

OPTIONS: dict[str, str] = {
    "triton.cudagraphs": "bool; True runs as mode='reduce-overhead'",
    "max_autotune": "bool; True runs as mode='max-autotune'",
    "max_autotune_pointwise": "bool; the same as max_autotune (fxlite's kernels are all "
                              "pointwise or reductions)",
}
"""The ``options`` keys fxlite's backends take, and what each maps to."""

_OWN = ("triton", "python")
_EAGER_NAMES = ("eager",)


@dataclass(frozen=True)
class Settings:
    """What :func:`resolve` decided.

    Attributes:
        as_is: return the function itself (``disable=True``, ``backend="eager"``, or a
            function marked with ``fxlite.compiler.disable``).
        backend: what ``CompiledFunction`` gets: ``"triton"``, ``"python"`` or a callable.
        mode: fxlite's mode for it (None with a callable backend: the mode went to it).
        recompile_limit: the compiled function's limit, or None for the default.
        name: the ``name`` argument.
        dynamic: the ``dynamic`` argument.
    """

    as_is: bool
    backend: Any
    mode: str | None
    recompile_limit: int | None = None
    name: str | None = None
    dynamic: bool | None = None

    def apply(self, compiled: Any, fn: Any, fullgraph: bool) -> None:
        """Set what ``CompiledFunction``'s constructor does not take, and register the
        compiled function for ``fxlite.reset()``."""

        def configure(cf: Any) -> None:
            if self.recompile_limit is not None:
                cf.recompile_limit = self.recompile_limit
            if self.dynamic is False:  # as torch.compile's: sizes are never symbolic
                cf.follow_marks = False

        configure(compiled)
        register(compiled, (fn, self.backend, fullgraph, self.mode), configure)


def resolve(fn: Any, *, fullgraph: Any = False, dynamic: Any = None, backend: Any = "triton",
            mode: Any = None, options: Any = None, name: Any = None, disable: Any = False,
            recompile_limit: Any = None, isolate_recompiles: Any = False,
            shapes_spec: Any = None) -> Settings:
    """Check ``fxlite.compile``'s arguments and decide what to build.

    Raises:
        TypeError: an argument of the wrong type (``fullgraph="yes"``).
        ValueError: an unknown backend, mode or option key, or ``mode`` with ``options``.

    Example::

        resolve(f, mode="max-autotune-no-cudagraphs").mode    # 'max-autotune'
    """
    for what, value in (("fullgraph", fullgraph), ("disable", disable),
                        ("isolate_recompiles", isolate_recompiles)):
        if not isinstance(value, bool):
            raise TypeError(f"fxlite.compile: {what} must be True or False, not {value!r}")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"fxlite.compile: dynamic must be None, True or False, not {dynamic!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"fxlite.compile: name must be a str or None, not {name!r}")
    if recompile_limit is not None and (isinstance(recompile_limit, bool) or not isinstance(
            recompile_limit, int) or recompile_limit < 0):
        raise TypeError(f"fxlite.compile: recompile_limit must be None or an int >= 0, not "
                        f"{recompile_limit!r}")
    if mode not in MODES:
        raise ValueError(f"fxlite.compile: unknown mode {mode!r}; expected one of "
                         f"{', '.join(repr(m) for m in MODES)}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"fxlite.compile: options must be a dict, not {type(options).__name__}")
    if mode is not None and options:
        raise ValueError("fxlite.compile: give mode or options, not both (as torch.compile)")
    if backend is None or backend == "fxlite":
        backend = "triton"
    marked = getattr(fn, "_fxlite_disabled", False)
    if isinstance(backend, str) and backend in _EAGER_NAMES:
        _own_options(options)  # still a bad key is an error
        return Settings(True, backend, None, recompile_limit, name, dynamic)
    if isinstance(backend, str) and backend in _OWN:
        own = _own_mode(mode, _own_options(options))
        return Settings(disable or marked, backend, own, recompile_limit, name, dynamic)
    if isinstance(backend, str):
        known = known_backends()
        if backend not in known:
            raise ValueError(
                f"fxlite.compile: unknown backend {backend!r}; expected 'triton', 'python', "
                f"'eager', a name torch._dynamo.list_backends() knows "
                f"({', '.join(sorted(set(known) - {'fxlite', 'eager'}))}), or a callable "
                "backend(gm, example_inputs)")
        made = dynamo_segment_backend(backend, mode=mode, options=options, dynamic=dynamic)
        return Settings(disable or marked, made, None, recompile_limit, name, dynamic)
    if not callable(backend):
        raise ValueError(f"fxlite.compile: backend must be a name or a callable "
                         f"backend(gm, example_inputs), not {type(backend).__name__}")
    own = _own_mode(mode, _own_options(options))
    return Settings(disable or marked, backend, own, recompile_limit, name, dynamic)


def _own_options(options: dict[str, Any] | None) -> dict[str, bool]:
    """``options`` checked against :data:`OPTIONS`."""
    out: dict[str, bool] = {}
    for key, value in (options or {}).items():
        if key not in OPTIONS:
            raise ValueError(f"fxlite.compile: unknown option {key!r}; fxlite's backends know "
                             f"{', '.join(repr(k) for k in OPTIONS)}")
        if not isinstance(value, bool):
            raise TypeError(f"fxlite.compile: option {key!r} must be True or False, not "
                            f"{value!r}")
        out[key] = value
    return out


def _own_mode(mode: str | None, options: dict[str, bool]) -> str | None:
    """fxlite's internal mode for ``mode`` or ``options``."""
    if mode == "max-autotune-no-cudagraphs":
        return "max-autotune"
    if mode == "default":
        return None
    graphs = options.get("triton.cudagraphs", False)
    tune = options.get("max_autotune", False) or options.get("max_autotune_pointwise", False)
    if graphs and tune:
        raise ValueError("fxlite.compile: options 'triton.cudagraphs' and 'max_autotune' "
                         "cannot be combined yet (fxlite runs one mode); choose one")
    if graphs:
        return "reduce-overhead"
    if tune:
        return "max-autotune"
    return mode


# ------------------------------------------------- Dynamo's backends inside fxlite
def known_backends() -> list[str]:
    """Every name ``torch._dynamo`` knows, debug and experimental ones included."""
    import torch._dynamo  # here: a slow import that only a Dynamo backend's name needs

    return list(torch._dynamo.list_backends(exclude_tags=()))


def to_torch_fx(gm: Any) -> torch.fx.GraphModule:
    """A ``torch.fx.GraphModule`` with the same nodes as fxlite's ``gm``.

    Targets, names and arguments are kept; ``get_attr`` and ``call_module`` targets are
    copied from ``gm`` as ``torch.fx.GraphModule`` copies them from a root module.

    Example::

        tgm = to_torch_fx(fxlite.symbolic_trace(model))
        torch.testing.assert_close(tgm(x), model(x))
    """
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
    import torch._dynamo  # as in known_backends

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
