"""fxlite: symbolic tracing, graph transformation and compilation for PyTorch programs.

Written to be used as ``import fxlite as fx`` by code written for ``torch.fx``::

    import fxlite as fx
    gm = fx.symbolic_trace(model)
    gm.graph.print_tabular()
    print(gm.code)
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# In a source checkout that is not installed, fxlite.passes and fxlite.codegen live in the
# sibling folders passes/ and codegen/ (setup.cfg maps them when installing).
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "codegen", "compile.py")) and os.path.isfile(
        os.path.join(_checkout, "passes", "__init__.py")):
    __path__.append(_checkout)  # type: ignore[name-defined]

__version__ = "0.1.0"

# Internal modules moved in 0.1's layout (issue 37) still import from their old paths, with
# a DeprecationWarning, for one release.
from ._moved import install as _install_moved  # noqa: E402

_install_moved()

# Everything loads on first use, so `import fxlite` imports neither torch nor Triton: the
# `fxlite` command answers --help and --version without them (`from fxlite import Graph`
# and `fxlite.Graph` load fxlite.graph, and torch with it, then).
_LAZY = {
    "Graph": "fxlite.graph",
    "GraphModule": "fxlite.graph_module",
    "Node": "fxlite.node",
    "map_arg": "fxlite.node",
    "Proxy": "fxlite.proxy",
    "ProxyableClassMeta": "fxlite.proxy",
    "TraceError": "fxlite.proxy",
    "PH": "fxlite.tracer",
    "PHBase": "fxlite.tracer",
    "PHWithMeta": "fxlite.tracer",
    "Tracer": "fxlite.tracer",
    "symbolic_trace": "fxlite.tracer",
    "wrap": "fxlite.tracer",
    "Interpreter": "fxlite.interpreter",
    "Transformer": "fxlite.interpreter",
    "replace_pattern": "fxlite.rewrite",
    "replace_pattern_with_filters": "fxlite.rewrite",
    "SubgraphMatcher": "fxlite.rewrite",
    "Match": "fxlite.rewrite",
    "ReplacedPatterns": "fxlite.rewrite",
    "compile": "fxlite.codegen.compile",
    "explain": "fxlite.codegen.explain",
    "export": "fxlite.codegen.explain",
    "set_logs": "fxlite.logs",
    "has_side_effect": "fxlite.ops",
    "CodeGen": "fxlite.python_code_hooks",
    "save": "fxlite.serialize",
    "load": "fxlite.serialize",
    "reset": "fxlite.codegen.compiler",
}

__all__ = [*_LAZY, "compiler"]


# Submodules reachable as attributes without an import of their own (`fx.passes.diff`),
# as torch.fx.passes and torch.fx.subgraph_rewriter are.
# Any other module of the package (`fxlite.graph`) is one too.
_SUBMODULES = ("passes", "subgraph_rewriter", "interpreter", "rewrite", "codegen", "ops",
               "logs", "examples")
# fxlite.compiler is torch.compiler's counterpart: disable, is_compiling, reset.
_ALIASES = {"compiler": "fxlite.codegen.compiler"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later reads skip this function
        return value
    if name in _ALIASES:
        return importlib.import_module(_ALIASES[name])
    if name in _SUBMODULES or (not name.startswith("_") and any(
            os.path.isfile(os.path.join(d, name + ".py"))
            or os.path.isfile(os.path.join(d, name, "__init__.py")) for d in __path__[:1])):
        return importlib.import_module(f"fxlite.{name}")
    raise AttributeError(f"module 'fxlite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES) | set(_ALIASES))
