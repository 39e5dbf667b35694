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
if os.path.isfile(os.path.join(_checkout, "codegen", "python.py")) and os.path.isfile(
        os.path.join(_checkout, "passes", "__init__.py")):
    __path__.append(_checkout)  # type: ignore[name-defined]

from .graph import Graph  # noqa: E402  (after the checkout path above)
from .graph_module import GraphModule  # noqa: E402
from .node import Node, map_arg  # noqa: E402
from .proxy import Proxy, ProxyableClassMeta, TraceError  # noqa: E402
from .tracer import PH, PHBase, PHWithMeta, Tracer, symbolic_trace, wrap  # noqa: E402

__version__ = "0.1.0"

# Heavier parts load on first use, so `import fxlite` stays fast and never imports Triton.
_LAZY = {
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
    "CodeGen": "fxlite.codegen.python_hooks",
    "save": "fxlite.serialize",
    "load": "fxlite.serialize",
}

__all__ = ["PH", "Graph", "GraphModule", "Node", "PHBase", "PHWithMeta", "Proxy",
           "ProxyableClassMeta", "TraceError", "Tracer", "map_arg", "symbolic_trace", "wrap", *_LAZY]


# Submodules reachable as attributes without an import of their own (`fx.passes.diff`),
# as torch.fx.passes and torch.fx.subgraph_rewriter are.
_SUBMODULES = ("passes", "subgraph_rewriter", "interpreter", "rewrite", "codegen", "ops",
               "logs", "examples")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"fxlite.{name}")
    raise AttributeError(f"module 'fxlite' has no attribute {name!r}")
