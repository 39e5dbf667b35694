"""fxlite's disk cache folder, and shape records that let a new process skip ShapeProp.

Why: ShapeProp runs the graph eagerly, and the first eager run of each op in a process
loads that op's GPU code: on an H200 host relu, add and mul took 40 ms of a 53 ms first
call in a new process whose kernels were all cached. A pure function's shapes follow from
its code and its inputs' layouts, so :func:`propagate_shapes` records them once per
(code, input layouts) and reads them back later.

Only graphs without ``get_attr`` and ``call_module`` nodes are recorded (a module's
parameters and leaf modules hold state the code does not show), and only when every
value is one tensor or a plain scalar. A stale or wrong record cannot make results
wrong: kernels are generated from, and checked against, the real values of the first
call, and a group whose recorded shapes disagree with them runs in eager.

Example::

    propagate_shapes(gm, (x,))    # ShapeProp, or the record of an earlier process
    gm.graph.print_tabular()      # shape and dtype columns either way
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fxlite.graph_module import GraphModule

__all__ = ["cache_root", "propagate_shapes", "write_atomic"]

_TYPES: dict[str, type] = {"Tensor": torch.Tensor, "int": int, "float": float, "bool": bool,
                           "NoneType": type(None), "Size": torch.Size}
_FORMATS = {str(f): f for f in (torch.contiguous_format, torch.channels_last,
                                torch.channels_last_3d)}


def cache_root() -> Path:
    """``$FXLITE_CACHE_DIR``, or ``fxlite-<uid>`` in the temp folder."""
    root = os.environ.get("FXLITE_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"fxlite-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    return Path(root)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (creating its folder) so that no reader, in this process
    or another, ever sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _key(gm: GraphModule, args: Sequence[Any]) -> str | None:
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        return None
    # Whether autograd records anything decides requires_grad of every value (the graph
    # holds no parameters); grad mode alone does not.
    autograd = torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    parts: list[Any] = [torch.__version__, autograd, gm.code]
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.layout != torch.strided or a.is_quantized:
                return None
            parts.append((tuple(a.shape), a.stride(), str(a.dtype), a.requires_grad,
                          a.device.type))
        elif a is None or type(a) in (int, float, bool):
            parts.append(repr(a))
        else:
            return None
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _record(gm: GraphModule) -> dict[str, Any] | None:
    from fxlite.passes.shape_prop import TensorMetadata

    out: dict[str, Any] = {}
    for n in gm.graph.nodes:
        kind = n.meta.get("type")
        name = getattr(kind, "__name__", None)
        if _TYPES.get(name) is not kind:
            return None
        entry: dict[str, Any] = {"type": name}
        tm = n.meta.get("tensor_meta")
        if tm is not None:
            if not isinstance(tm, TensorMetadata) or tm.is_quantized:
                return None
            entry.update(shape=list(tm.shape), dtype=str(tm.dtype).removeprefix("torch."),
                         requires_grad=tm.requires_grad, stride=list(tm.stride),
                         memory_format=None if tm.memory_format is None else str(tm.memory_format))
        out[n.name] = entry
    return out


def _apply(gm: GraphModule, record: dict[str, Any]) -> bool:
    from fxlite.passes.shape_prop import TensorMetadata

    nodes = list(gm.graph.nodes)
    if sorted(record) != sorted(n.name for n in nodes):
        return False
    for n in nodes:
        entry = record[n.name]
        n.meta["type"] = _TYPES[entry["type"]]
        if "shape" in entry:
            n.meta["tensor_meta"] = TensorMetadata(
                shape=torch.Size(entry["shape"]), dtype=getattr(torch, entry["dtype"]),
                requires_grad=entry["requires_grad"], stride=tuple(entry["stride"]),
                memory_format=_FORMATS.get(entry["memory_format"]))
        else:
            n.meta.pop("tensor_meta", None)
    return True


def propagate_shapes(gm: GraphModule, args: Sequence[Any]) -> None:
    """Give every node of ``gm`` the metadata ShapeProp would, for inputs ``args``.

    Runs ShapeProp, unless a record for this code and these input layouts exists, and
    records the result for later processes when the graph allows (see the module doc).
    """
    from fxlite.passes.shape_prop import ShapeProp

    key = _key(gm, args)
    path = cache_root() / "shapes" / f"{key}.json" if key else None
    if path is not None and path.exists():
        try:
            if _apply(gm, json.loads(path.read_text())):
                return
        except Exception:  # unreadable or from another version: run ShapeProp instead
            pass
    ShapeProp(gm).propagate(*args)
    record = _record(gm) if path is not None else None
    if record is None:
        return
    try:
        write_atomic(path, json.dumps(record))
    except OSError:  # a read-only or full cache folder: the record is only an optimization
        pass
