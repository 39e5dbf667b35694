"""matmul_copies: the copies eager's matmul makes of its operands, as graph ops.

``torch.matmul`` of two batched operands flattens their batch dims with ``reshape``; an
operand whose batch dims are not one stride apart (a head of a fused qkv projection,
permuted) is copied row-major inside the matmul, an eager kernel of its own. Made a clone
into row-major in the graph, the copy is a kernel's op: ``fuse`` puts copies of views of
one value in one kernel with the pointwise work on the same value (Swin's q scale and its
k and v copies: one launch in place of three). A transposed operand is copied before its
transpose, so that the copy has the shape of the other heads' (the matmul reads it
transposed, as cuBLAS can)::

    # before                                    # after
    k = getitem(permute, 1)                     k = getitem(permute, 1)
    transpose = k.transpose(-2, -1)             clone = torch.clone(k, memory_format=..)
    matmul = torch.matmul(q, transpose)         transpose = clone.transpose(-2, -1)
    matmul_1 = torch.matmul(attn, v)            matmul = torch.matmul(q, transpose)
                                                clone_1 = torch.clone(v, memory_format=..)
                                                matmul_1 = torch.matmul(attn, clone_1)

A two-operand ``torch.einsum`` that is a batched product (MaxViT's ``"B G H I D, B G H J
D -> B G H I J"`` and ``"B G H I J, B G H J D -> B G H I D"``) becomes that ``matmul``
first: eager's einsum permutes and reshapes its operands into the same ``bmm`` operands
as matmul's, copying the same ones::

    # before                                    # after
    einsum = torch.einsum("bhid,bhjd->bhij",    clone = torch.clone(q, memory_format=..)
                          q, k)                 transpose = k.transpose(-2, -1)
                                                matmul = torch.matmul(clone, transpose)

Only where both operands have three dims or more and the same batch dims (no broadcast:
eager's copy is then exactly the row-major operand), and only in inference (the pipeline's
choice, as for ``row_gathers``). A copy of a transposed operand is bitwise eager's; the
product of a transposed copy may round differently from eager's product of the copied
transpose (cuBLAS picks a kernel per layout), as any fxlite GEMM layout may.
"""

from __future__ import annotations

from typing import Any

import torch

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import resolve
from fxlite.tensor_meta import TensorMetadata, strided_meta, views_as

__all__ = ["explicit_matmul_copies"]


def explicit_matmul_copies(gm: GraphModule) -> GraphModule:
    """Make each operand copy that a batched ``matmul`` would make inside eager a
    ``clone`` into row-major in the graph (of the transpose's input for a transposed one).

    Args:
        gm: a normalized graph with ShapeProp metadata, in which no node needs autograd.

    Returns:
        ``gm``, changed in place (and recompiled) where a copy became a node; the new
        nodes have no metadata (the pipeline's ``propagate_meta`` fills it).
    """
    graph, changed = gm.graph, False
    for mm in list(graph.nodes):
        product = _einsum_product(mm)
        if product is not None:
            _einsum_as_matmul(mm, product, graph)
            changed = True
            continue
        found = resolve(mm, gm) if mm.op in ("call_function", "call_method") else None
        if found is None or found[0].name != "matmul":
            continue
        a, b = found[1].get("input"), found[1].get("other")
        metas = [strided_meta(a), strided_meta(b)]
        if None in metas or min(len(m.shape) for m in metas) < 3 \
                or tuple(metas[0].shape[:-2]) != tuple(metas[1].shape[:-2]):
            continue
        for operand, tm in zip((a, b), metas):
            if operand not in mm.all_input_nodes or not _copied(tm):  # (matmul(x, x))
                continue
            source = _transposed(operand, gm)
            with graph.inserting_before(mm):
                clone = graph.call_function(torch.clone, (source or operand,),
                                            {"memory_format": torch.contiguous_format})
                new = clone if source is None else graph.call_function(
                    torch.transpose, (clone, -2, -1))
            mm.replace_input_with(operand, new)
            if not operand.users:
                graph.erase_node(operand)
            changed = True
    if changed:
        gm.recompile()
    return gm


def _einsum_product(n: Node) -> tuple[Node, Node, bool] | None:
    """``(a, b, transposed)`` when ``n`` is ``torch.einsum`` of two operands of one rank of
    three or more, the same batch letters first and the same batch sizes, computing
    ``a @ b`` (``"...ik,...kj->...ij"``) or ``a @ b.transpose(-2, -1)``
    (``"...ik,...jk->...ij"``); else None."""
    if n.op != "call_function" or n.target is not torch.einsum or n.kwargs \
            or len(n.args) < 2 or not isinstance(n.args[0], str):
        return None
    operands = n.args[1:] if len(n.args) > 2 else n.args[1]
    if not isinstance(operands, (list, tuple)) or len(operands) != 2 \
            or not all(isinstance(o, Node) for o in operands):
        return None
    inputs, arrow, out = n.args[0].replace(" ", "").partition("->")
    a, comma, b = inputs.partition(",")
    metas = [strided_meta(o) for o in operands]
    if not arrow or not comma or None in metas or not (a + b + out).isalpha() \
            or not len(a) == len(b) == len(out) >= 3 \
            or any(len(set(t)) != len(t) for t in (a, b, out)) \
            or not a[:-2] == b[:-2] == out[:-2] \
            or tuple(metas[0].shape[:-2]) != tuple(metas[1].shape[:-2]):
        return None
    i, k, j = a[-2], a[-1], out[-1]
    if out[-2] != i or len({i, j, k} | set(a[:-2])) != len(a) + 1 or b[-2:] not in (k + j, j + k):
        return None
    return operands[0], operands[1], b[-1] == k


def _einsum_as_matmul(n: Node, product: tuple[Node, Node, bool], graph: Any) -> None:
    """Replace the einsum ``n`` (the batched product ``product``, :func:`_einsum_product`)
    by ``matmul`` of row-major copies of the operands eager's einsum copies."""
    a, b, transposed = product
    with graph.inserting_before(n):
        a_, b_ = (graph.call_function(torch.clone, (o,), {"memory_format": torch.contiguous_format})
                  if _copied(strided_meta(o)) else o for o in (a, b))
        if transposed:
            b_ = graph.call_function(torch.transpose, (b_, -2, -1))
        mm = graph.call_function(torch.matmul, (a_, b_))
    n.replace_all_uses_with(mm)
    graph.erase_node(n)


def _copied(tm: TensorMetadata) -> bool:
    """Whether eager's matmul copies an operand of this layout: its batch dims do not
    flatten into one without a copy (``reshape`` is then no view)."""
    return 0 not in tm.shape and not views_as(tm, (-1, *tm.shape[-2:]))


def _transposed(n: Node, gm: GraphModule) -> Node | None:
    """The input of ``n`` when ``n`` swaps the last two dims of it and nothing else reads
    ``n``, else None."""
    found = resolve(n, gm) if n.op in ("call_function", "call_method") else None
    if found is None or found[0].name != "transpose" or len(n.users) != 1:
        return None
    x, rank = found[1].get("input"), len(strided_meta(n).shape)
    dims = {d % rank for d in (found[1].get("dim0"), found[1].get("dim1")) if isinstance(d, int)}
    return x if isinstance(x, Node) and dims == {rank - 2, rank - 1} and strided_meta(x) else None
