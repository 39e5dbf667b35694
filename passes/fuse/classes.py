"""Fusion classes: which ops may join a kernel group, and as what (used by ``fuse``).

Each node gets a :class:`FusionClass`, or None when it stays outside every group:

- pointwise: an op-table pointwise op whose inputs broadcast to its output;
- reduction: a plain reduction (sum, amax...) over trailing dims, one row per program;
- view: a view that only adds or drops size-1 dims, copies, or broadcasts.

Example::

    classify(relu_node, gm)    # FusionClass(kind="pointwise", shape=(4, 8))
    classify(conv_node, gm)    # None: an extern op
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from fxlite.passes.shape_prop import MEMORY_FORMATS, TensorMetadata

from fxlite.node import Node, map_aggregate
from fxlite.ops import OpInfo, canonical_args, is_impure, lookup, view_base, view_root
from fxlite.ops.shapes import broadcast_shapes
from fxlite.tensor_meta import reduced_dims

__all__ = ["BROADCAST_VIEWS", "UNIT_VIEWS", "FusionClass", "Shape", "classify"]

# Views that only add or drop size-1 dims (or copy), and views that broadcast.
UNIT_VIEWS = frozenset({"view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous", "identity",
                         "detach"})
BROADCAST_VIEWS = frozenset({"expand", "expand_as"})
_REDUCTION_KEYS = frozenset({"input", "dim", "keepdim", "dtype"})
_SCALAR_TYPES = (int, float, bool)
_FEW_ROWS, _LONG_ROW = 64, 1 << 16

Shape = tuple[int, ...]


@dataclass
class FusionClass:
    """How one node may take part in a group."""

    kind: str  # "pointwise" | "reduction" | "view"
    shape: Shape  # its output shape
    source: Node | None = None  # reductions and views: the tensor they read
    in_shape: Shape = ()  # reductions and views: the shape of `source`
    split: int = 0  # reductions: len(outer)
    keepdim: bool = False
    view: str = ""  # views: the op name


# ---------------------------------------------------------------------- classification
def _tensor_meta(n: Any) -> TensorMetadata | None:
    tm = n.meta.get("tensor_meta") if isinstance(n, Node) else None
    return tm if isinstance(tm, TensorMetadata) else None


def _plain(tm: TensorMetadata) -> bool:
    strided = tm.stride != () or len(tm.shape) == 0  # a 0-d tensor has no strides either
    return strided and not tm.is_quantized and not tm.dtype.is_complex


def classify(node: Node, module: torch.nn.Module) -> FusionClass | None:
    """The node's fusion class, or None when it must stay outside every group."""
    if node.op not in ("call_function", "call_method", "call_module") or node.meta.get("no_fuse"):
        return None
    info = lookup(node, module)
    if info is None or info.kind not in ("pointwise", "reduction", "view"):
        return None
    tm = _tensor_meta(node)
    fmt = node.kwargs.get("memory_format")
    if tm is None or not _plain(tm) or is_impure(node, module) or (
            fmt is not None and not _layout_copy(info, fmt)):
        return None
    in_shapes: list[Shape] = []
    for inp in node.all_input_nodes:
        itm = _tensor_meta(inp)
        if itm is not None and _plain(itm):
            in_shapes.append(tuple(itm.shape))
        elif "tensor_meta" in inp.meta or inp.meta.get("type") not in _SCALAR_TYPES:
            return None  # tensor lists, nested results, unknown values
    if _has_tensor_constant(node):
        return None
    shape = tuple(tm.shape)
    if info.kind == "pointwise":
        try:
            fits = bool(in_shapes) and broadcast_shapes(in_shapes) == shape
        except ValueError:  # the inputs do not broadcast
            fits = False
        if not fits:
            return None
        return FusionClass("pointwise", shape)
    if info.kind == "reduction":
        return _classify_reduction(node, info, module, shape)
    return _classify_view(node, info, module, shape, len(in_shapes))


def _layout_copy(info: OpInfo, fmt: Any) -> bool:
    """Whether an op of ``info`` with ``memory_format=fmt`` is a clone into a dense
    layout (a convolution's input or weight made channels-last, a norm's result made
    row-major as eager's kernel gives it).
    It fuses: a kernel stores each result in the layout of its metadata, and its readers
    in the group read the value, not memory, so the layout only matters to that store."""
    return info.name == "clone" and fmt in MEMORY_FORMATS


def _has_tensor_constant(node: Node) -> bool:
    found = False

    def visit(a: Any) -> Any:
        nonlocal found
        found = found or isinstance(a, torch.Tensor)
        return a

    map_aggregate((node.args, node.kwargs), visit)
    return found


def _classify_reduction(node: Node, info: OpInfo, module: torch.nn.Module, shape: Shape) -> FusionClass | None:
    # Plain reductions only: var/std (a correction parameter) and composites stay outside.
    if "keepdim" not in info.params or not set(info.params) <= _REDUCTION_KEYS:
        return None
    args = canonical_args(node, info, module)
    src = args.get("input")
    stm = _tensor_meta(src)
    keepdim = args.get("keepdim", False)
    if stm is None or not set(args) <= _REDUCTION_KEYS or not isinstance(keepdim, bool):
        return None
    in_shape = tuple(stm.shape)
    ndim = len(in_shape)
    dim = args.get("dim")
    if ndim == 0:
        return None
    named = () if dim is None else dim if isinstance(dim, (tuple, list)) else (dim,)
    if not all(isinstance(d, int) and -ndim <= d < ndim for d in named):
        return None
    dims = list(reduced_dims(dim, ndim))
    split = ndim - len(dims)
    if dims != list(range(split, ndim)):
        return None  # only trailing dims: one row per program
    expected = in_shape[:split] + ((1,) * len(dims) if keepdim else ())
    if expected != shape:
        return None
    rows, cols = math.prod(in_shape[:split]), math.prod(in_shape[split:])
    if rows < _FEW_ROWS and cols >= _LONG_ROW:
        # A kernel runs one program per row: a few long rows (x.sum() of a big tensor)
        # would keep a handful of SMs busy, where torch splits each row over many blocks.
        return None
    return FusionClass("reduction", shape, src, in_shape, split, keepdim)


def _classify_view(node: Node, info: OpInfo, module: torch.nn.Module, shape: Shape,
                   n_tensors: int) -> FusionClass | None:
    if info.name not in UNIT_VIEWS | BROADCAST_VIEWS or n_tensors != 1 and info.name != "expand_as":
        return None
    src = node.args[0] if node.args else node.kwargs.get("input")
    stm = _tensor_meta(src)
    if stm is None or not _plain(stm):
        return None
    # A view aliases its input; materializing it in a kernel is only safe when nobody
    # writes the memory they share, through them or any other view of it (fuzz seed
    # 9891099: ``v = x.min(); a = v.reshape(1); b = v.reshape(1, 1); silu(a, inplace=True)``,
    # where ``b`` became a kernel's copy, made before the write, and missed it).
    if any(u.op != "output" and is_impure(u, module) for x in (node, src) for u in x.users) \
            or _written_through_a_view(src, module):
        return None
    # Nor when the graph returns it and what it views is seen outside the graph too (an
    # input, or a value the graph returns itself or through another view): a later
    # segment, or the caller, may write one and read the other. The fuzzer's seed
    # 7107124: ``v1 = v0.squeeze()`` returned, ``v0[::2] = 1e-3`` after a graph break.
    if _returned(node) and _seen_outside(src, node, module):
        return None
    return FusionClass("view", shape, src, tuple(stm.shape), view=info.name)


def _written_through_a_view(src: Node, module: torch.nn.Module) -> bool:
    """Whether an impure op (an in-place write left as it is) reads ``src``'s memory:
    its root along view ops, or any view of that."""
    return any(u.op != "output" and is_impure(u, module)
               for n in _view_family(view_root(src, module), module) for u in n.users)


def _view_family(root: Node, module: torch.nn.Module) -> set[Node]:
    """``root`` and every view of it, down the view ops: the values sharing its memory."""
    family, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n not in family:
            family.add(n)
            todo.extend(u for u in n.users if view_base(u, module) is n)
    return family


def _returned(node: Node) -> bool:
    return any(u.op == "output" for u in node.users)


def _seen_outside(src: Node, view: Node, module: torch.nn.Module) -> bool:
    """Whether the memory ``view`` shares with ``src`` reaches outside the graph other than
    through ``view``: ``src``'s root along view ops is an input or attribute, or it or
    one of its views (all of them, down the view ops) is returned."""
    root = view_root(src, module)
    if root.op in ("placeholder", "get_attr"):
        return True
    return any(n is not view and _returned(n) for n in _view_family(root, module))
