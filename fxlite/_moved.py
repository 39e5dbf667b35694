"""Old module paths of fxlite's internals, kept for one release after the layout of issue 37.

``import fxlite.codegen.triton`` still works and returns the module now at
``fxlite.codegen.runtime.kernel``, with one ``DeprecationWarning`` that names the new path.
The finder is pure Python and imports nothing until an old path is imported, so
``import fxlite`` stays free of torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

# old dotted path -> new dotted path; each entry goes in the release after next.
MOVED = {
    "fxlite.codegen.capture_hooks": "fxlite.codegen.capture.hooks",
    "fxlite.codegen.capture_kinds": "fxlite.codegen.capture.kinds",
    "fxlite.codegen.capture_rules": "fxlite.codegen.capture.rules",
    "fxlite.codegen.capture_watch": "fxlite.codegen.capture.watch",
    "fxlite.codegen.recorder": "fxlite.codegen.capture.recorder",
    "fxlite.codegen.recording": "fxlite.codegen.capture.records",
    "fxlite.codegen.guards": "fxlite.codegen.capture.guards",
    "fxlite.codegen.follow": "fxlite.codegen.capture.follow",
    "fxlite.codegen.cond": "fxlite.codegen.capture.cond",
    "fxlite.codegen.structure": "fxlite.codegen.capture.structure",
    "fxlite.codegen.segments": "fxlite.codegen.capture.segments",
    "fxlite.codegen.pipeline": "fxlite.codegen.lower.segment",
    "fxlite.codegen.autograd_pipeline": "fxlite.codegen.lower.autograd_pipeline",
    "fxlite.codegen.autograd": "fxlite.codegen.lower.autograd",
    "fxlite.codegen.accuracy": "fxlite.codegen.lower.accuracy",
    "fxlite.codegen.optimizer_steps": "fxlite.codegen.lower.optimizer_steps",
    "fxlite.passes.autocast": "fxlite.codegen.lower.autocast",
    "fxlite.passes.autograd_regions": "fxlite.codegen.lower.autograd_regions",
    "fxlite.passes.pad_matmul": "fxlite.codegen.lower.pad_matmul",
    "fxlite.autodiff": "fxlite.codegen.lower.autodiff",
    "fxlite.autodiff_batch_norm": "fxlite.codegen.lower.batch_norm",
    "fxlite.codegen.triton_common": "fxlite.codegen.kernels.analysis",
    "fxlite.codegen.triton_config": "fxlite.codegen.kernels.config",
    "fxlite.codegen.triton_emit": "fxlite.codegen.kernels.emit",
    "fxlite.codegen.triton_generate": "fxlite.codegen.kernels.generate",
    "fxlite.codegen.triton_layout": "fxlite.codegen.kernels.layout",
    "fxlite.codegen.triton_meta": "fxlite.codegen.kernels.meta",
    "fxlite.codegen.triton_ops": "fxlite.codegen.kernels.ops",
    "fxlite.codegen.triton_pointwise": "fxlite.codegen.kernels.pointwise",
    "fxlite.codegen.triton_pool": "fxlite.codegen.kernels.pool",
    "fxlite.codegen.triton_reduction": "fxlite.codegen.kernels.reduction",
    "fxlite.codegen.triton_source": "fxlite.codegen.kernels.source",
    "fxlite.codegen.triton": "fxlite.codegen.runtime.kernel",
    "fxlite.codegen.triton_launch": "fxlite.codegen.runtime.launch",
    "fxlite.codegen.triton_binaries": "fxlite.codegen.runtime.binaries",
    "fxlite.codegen.triton_precompile": "fxlite.codegen.runtime.precompile",
    "fxlite.codegen.cache": "fxlite.codegen.runtime.cache",
    "fxlite.codegen.straight_line": "fxlite.codegen.runtime.straight_line",
    "fxlite.codegen.cudagraphs": "fxlite.codegen.runtime.cudagraphs",
    "fxlite.codegen.segment_graphs": "fxlite.codegen.runtime.segment_graphs",
    "fxlite.codegen.trial": "fxlite.codegen.runtime.trial",
    "fxlite.codegen.host_nodes": "fxlite.codegen.runtime.host_nodes",
    "fxlite.codegen.python": "fxlite.python_code",
    "fxlite.codegen.python_hooks": "fxlite.python_code_hooks",
    "fxlite.passes.fuse_classes": "fxlite.passes.fuse.classes",
    "fxlite.passes.fuse_remat": "fxlite.passes.fuse.remat",
    "fxlite.passes.size_sources": "fxlite.passes.fuse.size_sources",
    "fxlite.passes.split_sums": "fxlite.passes.fuse.split_sums",
    "fxlite.op_records": "fxlite.ops.records",
    "fxlite.op_derivatives": "fxlite.ops.derivatives",
    "fxlite.autodiff_meta": "fxlite.ops.shapes",
    "fxlite.autodiff_random": "fxlite.ops.dropout",
    "fxlite.tabular": "fxlite.viz.tabular",
    "fxlite.html": "fxlite.viz.html",
    "fxlite.serialize_allowlist": "fxlite.serialize.allowlist",
    "fxlite.serialize_tensors": "fxlite.serialize.tensors",
    "fxlite.cli_commands": "fxlite.cli.commands",
    "fxlite.cli_load": "fxlite.cli.load",
    "fxlite.progress": "fxlite.cli.progress",
    "fxlite.demo": "fxlite.cli.demo",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def find_spec(self, name: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder: exec_module swaps in the real module

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {new}; import it from there (the old path "
                      "goes in the next release)", DeprecationWarning, stacklevel=2)
        # The import system returns whatever sys.modules holds once this returns.
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Put the finder for old paths at the end of ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())
