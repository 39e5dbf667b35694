"""Shapes and dtypes of a fused group's values for given inputs, as ``meta`` tensors.

The code generator specializes a group for its inputs' sizes and strides; it reads each
node's shape and dtype from here (``meta_values``), which reuses the group's ShapeProp
metadata when it describes these inputs and otherwise runs the group on the ``meta``
device (no memory, no compute).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from fxlite.codegen.kernels.emit import Unsupported

from fxlite.graph_module import GraphModule
from fxlite.interpreter import Interpreter
from fxlite.node import Node

__all__ = ["meta_values"]


class _MetaRun(Interpreter):
    """Runs the group on ``meta`` tensors: each node's shape and dtype for these inputs."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.found: dict[Node, torch.Tensor] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.found[n] = out
        return out


def _recorded_meta(gm: GraphModule, inputs: Sequence[Any]) -> dict[Node, torch.Tensor] | None:
    """The same answer from the group's ShapeProp metadata, when it describes ``inputs``.

    Why: running ops on ``meta`` tensors reaches torch's Python meta kernels, whose first
    call imports torch._dynamo (seconds); the first specialization never needs that.
    """
    found: dict[Node, torch.Tensor] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return None
    for n, t in zip(placeholders, inputs):
        tm = n.meta.get("tensor_meta")
        if isinstance(t, torch.Tensor) != hasattr(tm, "shape"):
            return None
        if isinstance(t, torch.Tensor) and (tuple(tm.shape) != tuple(t.shape) or tuple(
                tm.stride) != tuple(t.stride()) or tm.dtype != t.dtype):
            return None
    for n in gm.graph.nodes:
        tm = n.meta.get("tensor_meta")
        if n.op == "output" or tm is None:
            continue
        if not hasattr(tm, "shape"):
            return None  # a node holding several tensors: let the meta run sort it out
        found[n] = torch.empty_strided(tm.shape, tm.stride, dtype=tm.dtype, device="meta")
    return found


def meta_values(gm: GraphModule, inputs: Sequence[Any]) -> dict[Node, torch.Tensor]:
    """Every tensor node's value as a ``meta`` tensor, for inputs like ``inputs``.

    The group's own ShapeProp metadata describes the inputs it was built from; a kernel
    specialized for other sizes or strides needs the shapes and dtypes for these ones.
    Running on the ``meta`` device costs no memory or compute.
    """
    recorded = _recorded_meta(gm, inputs)
    if recorded is not None:
        return recorded
    fake = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if isinstance(t, torch.Tensor) else t for t in inputs]
    run = _MetaRun(gm)
    try:
        run.run(*fake)
    except Exception as e:  # the graph does not fit these inputs (or has no meta kernel)
        raise Unsupported(f"shape propagation on the inputs failed: {e}") from None
    return run.found
