"""Generating a fused group's Triton source, the step under ``generate_kernel``:
:func:`interpreting` (whether kernels run through Triton's CPU interpreter), ``_generate``
(the environment checks, the group's analysis, the pointwise or reduction builder, and the
kernel's name: what it computes and a digest of its text) and ``_identifier`` (a name made
a valid identifier). ``triton.py`` wraps the source in a ``TritonKernel`` and re-exports
:func:`interpreting`.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from fxlite.codegen.kernels.analysis import Plan, analyze
from fxlite.codegen.kernels.emit import Unsupported
from fxlite.codegen.kernels.pointwise import build_pointwise
from fxlite.codegen.kernels.reduction import build_reduction
from fxlite.codegen.kernels.source import KernelSource

from fxlite.graph_module import GraphModule

__all__ = ["interpreting"]


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_UNNAMED = "_fxlite_kernel"  # no kernel variable starts with "_" (triton_common._Builder.fresh)


def _generate(group: GraphModule, inputs: list[Any], name: str, libdevice: bool | None
              ) -> tuple[Plan, KernelSource]:
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if tensors and tensors[0].device.type == "cpu" and not interpreting():
        raise Unsupported("CPU tensors need TRITON_INTERPRET=1")
    if interpreting():
        import triton.language as tl

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


def _identifier(name: str) -> str:
    out = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return out if out and not out[0].isdigit() else f"k_{out}"
