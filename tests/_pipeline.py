"""The compile pipeline at the level of passes and kernels, for tests.

``lower`` runs what ``fxlite.compile`` runs before code generation (trace, ShapeProp,
normalize, decompose, metadata for the new nodes, fuse); :class:`Kernels` then runs the fused module with a
Triton kernel for each group, generated on the first call and reused after, with no
comparison against eager anywhere. So a test that calls it with benign inputs first and
the trap second passes only if the kernels are right by construction::

    run = Kernels(lower(fn, benign))
    run(benign)                  # generates the kernels
    assert not run.refused       # every group got a kernel
    same(run(trap), fn(trap))    # the same kernels, on the trap
"""

from __future__ import annotations

from typing import Any

import torch
from fxlite.codegen.lower.pipeline import propagate_meta
from fxlite.codegen.runtime.kernel import generate_kernel, why_unsupported
from fxlite.passes.decompose import decompose
from fxlite.passes.fuse import fuse
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite
from fxlite.graph_module import GraphModule
from fxlite.interpreter import Interpreter


def lower(fn: Any, *example: Any) -> GraphModule:
    """Trace ``fn`` and run the compile passes on ``example``: the fused module."""
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*example)
    gm = decompose(normalize(gm))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    propagate_meta(gm)  # as the pipeline: a decomposed op's result keeps the op's layout
    return fuse(gm)


class Kernels(Interpreter):
    """Runs a fused module, each group through its Triton kernel (generated once).

    Attributes:
        kernels: group name -> kernel (None where the generator refused the group).
        refused: group name -> why the generator refused it (that group runs eagerly).
    """

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.kernels: dict[str, Any] = {}
        self.refused: dict[str, str] = {}

    def __call__(self, *args: Any) -> Any:
        with torch.no_grad():
            return self.run(*args)

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        sub = self.fetch_attr(target)
        if not getattr(sub, "meta", {}).get("fused_kind"):
            return super().call_module(target, args, kwargs)
        if target not in self.kernels:
            kernel = generate_kernel(sub, list(args), name=f"k_{target}")
            self.kernels[target] = kernel
            if kernel is None:
                self.refused[target] = str(why_unsupported(sub, list(args)))
        kernel = self.kernels[target]
        return sub(*args) if kernel is None else kernel(*args)

    @property
    def ops(self) -> list[str]:
        """The op nodes of every group that got a kernel."""
        return [n for name, k in self.kernels.items() if k is not None
                for n in self.module.get_submodule(name).meta["nodes"]]
