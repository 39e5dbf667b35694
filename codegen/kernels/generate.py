"""A fused group's Triton source, the pure step under ``generate_kernel``: no disk, no
launches, no state.

- :func:`interpreting`: whether kernels run through Triton's CPU interpreter (the one
  copy; ``codegen/lower`` and ``codegen/runtime`` import it from here).
- :func:`generate_source`: the environment checks, the group's analysis, the pointwise or
  reduction builder, and the kernel's name (what it computes and a digest of its text).
- :func:`why_unsupported`: why a group gets no kernel, or None.
- :func:`identifier`: a name made a valid Python identifier.

``codegen/runtime/kernel.py`` loads the source and wraps it in a ``TritonKernel``.

Example::

    plan, src = generate_source(group, [x], libdevice=None)
    print(src.text)                       # the Triton module
    why_unsupported(group, [x])           # None: generate_source raised nothing
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import torch
from fxlite.codegen.kernels.analysis import Plan, analyze
from fxlite.codegen.kernels.emit import Unsupported
from fxlite.codegen.kernels.pointwise import build_pointwise
from fxlite.codegen.kernels.reduction import build_reduction
from fxlite.codegen.kernels.source import KernelSource

from fxlite.graph_module import GraphModule

__all__ = ["generate_source", "identifier", "interpreting", "why_unsupported"]


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_UNNAMED = "_fxlite_kernel"  # no kernel variable starts with "_" (analysis._Builder.fresh)


def generate_source(group: GraphModule, inputs: list[Any], libdevice: bool | None
                    ) -> tuple[Plan, KernelSource]:
    """The analysis of ``group`` for ``inputs`` and its Triton module source.

    Args:
        group: a fused group with ShapeProp metadata (see ``generate_kernel``).
        inputs: tensors and Python scalars, one per placeholder.
        libdevice: use libdevice functions; None: when not interpreting.

    Raises:
        Unsupported: no kernel can be proven right for this group (or this environment).
    """
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if tensors and tensors[0].device.type == "cpu" and not interpreting():
        raise Unsupported("CPU tensors need TRITON_INTERPRET=1")
    if interpreting():
        import triton.language as tl  # Triton's import cost: only once a kernel is made

        if type(tl.sum).__name__ != "InterpretedFunction":
            raise Unsupported("TRITON_INTERPRET=1 was set after triton was imported; set it "
                              "before the first import of triton")
    if libdevice is None:
        libdevice = not interpreting()
    plan = analyze(group, inputs, _UNNAMED)
    src = (build_pointwise if plan.kind == "pointwise" else build_reduction)(plan, libdevice)
    # The function is named by what it computes and a digest of its text, not by the
    # group: identical groups (repeated blocks) give one source, compiled once.
    ops = list(dict.fromkeys(v.op for v in plan.values if v.kind in ("pw", "reduce")))
    label = "_".join(["fx"] + ops[:4])
    plan.name = f"{label}_{hashlib.sha256(src.text.encode()).hexdigest()[:10]}"
    src = KernelSource(src.text.replace(_UNNAMED, plan.name),
                       {v: f.replace(_UNNAMED, plan.name) for v, f in src.functions.items()},
                       src.args, src.tile)
    return plan, src


def why_unsupported(group_gm: GraphModule, example_inputs: Sequence[Any]) -> str | None:
    """Why ``generate_kernel`` returns None for this group, or None if it would not."""
    try:
        generate_source(group_gm, list(example_inputs), None)
    except Unsupported as e:
        return str(e)
    return None


def identifier(name: str) -> str:
    """``name`` with every character that may not stand in an identifier replaced by
    ``_`` (and ``k_`` before a leading digit): ``"layer-norm.1"`` -> ``"layer_norm_1"``."""
    out = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return out if out and not out[0].isdigit() else f"k_{out}"
