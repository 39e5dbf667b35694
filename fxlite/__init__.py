"""fxlite: symbolic tracing, graph transformation and compilation for PyTorch programs.

Written to be used as ``import fxlite as fx`` by code written for ``torch.fx``::

    import fxlite as fx
    gm = fx.symbolic_trace(model)
    gm.graph.print_tabular()
    print(gm.code)
"""

from __future__ import annotations

import importlib
from typing import Any

from .graph import Graph
from .graph_module import GraphModule
from .node import Node, map_arg
from .proxy import Proxy, TraceError
from .tracer import Tracer, symbolic_trace, wrap

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
}

__all__ = ["Graph", "GraphModule", "Node", "Proxy", "TraceError", "Tracer", "map_arg",
           "symbolic_trace", "wrap", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fxlite' has no attribute {name!r}")
