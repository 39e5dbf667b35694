"""``fxlite.subgraph_rewriter``: the module name torch.fx users import the rewriter from.

``from fxlite import subgraph_rewriter; subgraph_rewriter.replace_pattern(gm, p, r)`` works as
with ``torch.fx``; the implementation lives in :mod:`fxlite.rewrite`.
"""

from .rewrite import Match, ReplacedPatterns, replace_pattern, replace_pattern_with_filters

__all__ = ["Match", "ReplacedPatterns", "replace_pattern", "replace_pattern_with_filters"]
