"""empty_cats: a cat of one tensor and constant empty ones reads that tensor instead.

transformers' key/value cache starts each layer's keys and values as ``torch.tensor([])``
and concatenates the new ones to it (``DynamicLayer.update``), in training too, where the
attention alone reads the result and the cache is then dropped. Each layer copied its
keys and values, and autograd kept a ``CatBackward`` node for each and the copies for the
attention's backward (GPT-2 124M: 24 copies a step, 0.3 GB kept)::

    # before                                      # after
    cat = torch.cat([_folded_1, k], -2)            sdpa = F.scaled_dot_product_attention(
    sdpa = F.scaled_dot_product_attention(             q, k, v)
        q, cat, cat_1)

Eager's cat returns a tensor of its own, so the cat goes only where nothing can tell the
difference: the empty operands are constants (``fold_sizes`` made them) of the result's
dtype, the one left has that dtype too, only the attention or extern ops (matmuls, cats),
whose results do not depend on its layout, read the result, the graph does not return
it, and the memory of the tensor left is the graph's own (no input's or parameter's, and
nothing writes to it or returns a view of it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import canonical_args, is_impure, lookup, view_base
from fxlite.tensor_meta import strided_meta

__all__ = ["cats_without_empties"]


def cats_without_empties(gm: GraphModule) -> GraphModule:
    """Replace each ``torch.cat`` of one tensor and constant empty ones by that tensor,
    where no one can tell (see the module docstring).

    Args:
        gm: a graph with ShapeProp metadata (after ``fold_sizes``).

    Returns:
        ``gm``, changed in place (and recompiled) where a cat went.
    """
    changed, aliases = False, None
    for cat in list(gm.graph.nodes):
        kept = _kept_operand(cat, gm)
        if kept is None:
            continue
        aliases = aliases or _aliases(gm)
        if _private(kept, aliases):
            cat.replace_all_uses_with(kept)
            gm.graph.erase_node(cat)
            del aliases.base[cat]
            changed = True
    if changed:
        gm.recompile()
    return gm


class _Aliases(NamedTuple):
    """What ``_private`` reads of each node, looked up once a graph (in graph order)."""

    base: dict[Node, Node | None]  # the node it is a view of (``view_base``)
    unknown: frozenset[Node]  # ops the table does not know: views of any input, maybe
    exposing: tuple[Node, ...]  # the output and the impure ops: they write or return


def _aliases(gm: GraphModule) -> _Aliases:
    nodes = list(gm.graph.nodes)
    return _Aliases(
        {n: view_base(n, gm) for n in nodes},
        frozenset(n for n in nodes if n.op in ("call_function", "call_method")
                  and lookup(n, gm) is None),
        tuple(n for n in nodes if n.op == "output" or n.op != "placeholder"
              and is_impure(n, gm)))


def _kept_operand(cat: Node, gm: GraphModule) -> Node | None:
    """The one operand of ``cat`` that is not a constant empty tensor, where it may stand
    for the cat's result: same dtype and sizes, and read only by the attention or extern
    ops (``_reads_as_a_value``)."""
    if cat.op != "call_function" or (info := lookup(cat, gm)) is None or info.name != "cat":
        return None
    tensors = canonical_args(cat, info, gm).get("tensors")
    want = strided_meta(cat)
    if not isinstance(tensors, (list, tuple)) or want is None:
        return None
    rest = [t for t in tensors if not _constant_empty(t, want.dtype)]
    if len(rest) != 1 or not isinstance(rest[0], Node) or len(rest) == len(tensors):
        return None
    meta = strided_meta(rest[0])
    if meta is None or meta.dtype != want.dtype or tuple(meta.shape) != tuple(want.shape):
        return None
    for user in cat.users:
        if not _reads_as_a_value(user, gm):
            return None
    return rest[0]


def _reads_as_a_value(user: Node, gm: GraphModule) -> bool:
    """Whether ``user``'s result is the same for any layout of its input: the attention,
    or a pure extern op (a matmul, a cat). A view would fail or alias on another layout,
    and a pointwise op's result takes its input's strides, which a later view can fail on."""
    if user.op != "call_function" or is_impure(user, gm):
        return False
    if user.target is F.scaled_dot_product_attention:
        return True
    found = lookup(user, gm)
    return found is not None and found.kind == "extern"


def _constant_empty(t: object, dtype: torch.dtype) -> bool:
    meta = strided_meta(t)
    return meta is not None and t.op == "get_attr" and meta.dtype == dtype and \
        0 in tuple(meta.shape)


def _private(node: Node, aliases: _Aliases) -> bool:
    """Whether ``node``'s memory is made inside the graph and never written or returned.
    Ops the table does not know (``split``, attention) may return views of their inputs:
    they count as views of each."""
    roots, stack = set(), [node]
    while stack:
        m = stack.pop()
        base = aliases.base[m]
        if base is not None:
            stack.append(base)
            continue
        if m in aliases.unknown:
            stack += m.all_input_nodes
        roots.add(m)
    if any(r.op in ("placeholder", "get_attr") for r in roots):
        return False
    family = set(roots)
    for n, base in aliases.base.items():
        if n not in family and (base in family or n in aliases.unknown and any(
                a in family for a in n.all_input_nodes)):
            family.add(n)
    return not any(a in family for n in aliases.exposing for a in n.all_input_nodes)
