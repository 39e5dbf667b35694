"""autograd_regions: fused groups joined by table ops become one region for autodiff.

In a training segment each fused group runs as an autograd node of its own
(``codegen/lower/autograd.py``). A value read by two groups then gets two gradients, which
torch's autograd engine adds with a kernel of its own, and each group saves or rewrites
its own copies of what its backward needs. A training-mode BatchNorm is five groups
(sums in two stages, the centred values, the normalization), so resnet18's step made 91
such additions and 57 autograd nodes. ``autograd_regions`` joins groups that only table
ops connect into one *region*: a flat graph of table ops that autodiff differentiates as
a whole (``codegen/lower/autodiff.py``) and the kernel pipeline fuses again, forward and backward
(``codegen/lower/autograd_pipeline.py``)::

    before                                       after
        s = fused_0(x)              # sum (2, 3)     r = region_0(x, n, w, b)
        t = torch.sum(s, (0, 2, 3))                  mean = r[0]
        u = fused_1(t, n, x)        # mean, x - mean var = r[1]
        m, c, q = u[0], u[1], u[2]                   y = r[2]
        v = torch.sum(q, (0, 2, 3))
        y = fused_2(v, n, c, w, b)  # normalize, relu

What joins: calls of fused groups whose every op has a derivative rule, their
``getitem``s, pure pointwise and reduction ops with a derivative rule (such as the
outer sums of ``split_sums``) between them, ``detach`` (BatchNorm's variance reads
its mean detached) and linears. Regions stay convex (no path leaves one and comes back)
and never span an impure node, as fuse's groups. Two kinds are made:

* **through linears**: a region holding a linear and at least two autograd nodes in all
  (groups or linears), and no ``detach`` (see :func:`_detaches`). A transformer block's
  norm, linears, activation and residual adds between two attentions become one node,
  whose forward and backward call the matmuls between their kernels::

      before                                   after
          h = fused_0(x, w1, b1)  # layer norm     r = region_0(x, w1, b1, w2, b2, ...)
          u = linear(h, w2, b2)                    y = r[0]
          a = fused_1(u)          # gelu
          y = linear(a, w3, b3)

  A step's host time goes to its autograd nodes: nanoGPT's 48 linears were each an
  ``addmm``, two views and a backward node of three launches, and each group a node too.
* **around a per-channel reduction**: regions of two groups or more around a reduction
  that fuse left outside its groups and that keeps a dim (the per-channel outer sums of
  ``split_sums``): there the engine's gradient additions and the small outer sums are
  what a region saves. Elsewhere groups stay apart: measured on an H200, a GPT-2 block's
  training step whose loss (a mean over everything, outside the groups) joined the last
  residual add kept the GPU 0.10 ms (f32) and 0.17 ms (bf16) longer than with its
  groups apart.

The region's call takes the place of its last node. A region's call runs its ops under
eager autograd where a parameter it reads has a gradient hook
(``codegen/lower/autograd.py``): eager's backward runs them in its order.
"""

from __future__ import annotations

import heapq
import operator
from typing import Any

from fxlite.passes.split_module import set_call_meta, unpack_outputs

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule
from fxlite.node import Node, map_arg
from fxlite.ops import is_impure, lookup, resolve, view_base
from fxlite.ops.derivatives import VJP

__all__ = ["autograd_regions"]

GROUP_KINDS = ("pointwise", "reduction")
# ops outside the group kinds that regions take in: detach, and linears, whose matmuls the
# region's forward and backward call between their kernels (one autograd node, not three)
JOINING = frozenset({"detach", "linear", "addmm"})
LINEARS = frozenset({"linear", "addmm"})


def autograd_regions(gm: GraphModule) -> GraphModule:
    """Join the fused groups of ``gm`` (``fuse``'s result) into regions (see the module
    docstring); ``gm`` is changed in place and returned.

    Each region is a submodule ``region_<i>`` with ``meta["fused_kind"] == "region"`` and
    ``meta["nodes"]`` (the names of the ops in it).
    """
    _literal_sizes(gm)
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    window = _impure_windows(nodes, gm)
    # regions through linears first, but none holding a detach (see _detaches); then,
    # among the nodes those left, regions of groups and table ops alone
    chosen = [r for r in (_without_trailing_views(r, gm) for r in _join(
                  nodes, gm, index, window, linears=True))
              if _made_of_linears(r, gm) and not _detaches(r, gm)
              and not _returns_a_view_of_an_input(r, gm)]
    taken = {n for r in chosen for n in r}
    chosen += [r for r in _join([n for n in nodes if n not in taken], gm, index, window,
                                linears=False) if _worth_it(r, gm)]
    made = 0
    for region in chosen:
        if _replace(gm, sorted(region, key=index.__getitem__), f"region_{made}"):
            made += 1
    if made:
        _reorder(gm)
        gm.graph.lint()
        gm.recompile()
    return gm


def _literal_sizes(gm: GraphModule) -> None:
    """Each ``v.size(d)`` of a view ``v`` whose sizes are literals becomes that literal.

    Why: a size read is an edge out of a region and back into it. transformers' GPT-2
    reads the size of ``addmm(b, h, w).view(8, 1024, 768)`` for the next layer norm's
    element count, and the linear and the norm could not join one region::

        before                                   after
            v = addmm_1.view(8, 1024, 768)           v = addmm_1.view(8, 1024, 768)
            n = v.size(-1)                           c = _normalized_count((768,), (768,))
            c = _normalized_count((n,), (768,))
    """
    changed = False
    for n in list(gm.graph.nodes):
        if not (n.op == "call_method" and n.target == "size" and len(n.args) == 2
                and not n.kwargs and isinstance(n.args[1], int)):
            continue
        src = n.args[0]
        found = resolve(src, gm) if isinstance(src, Node) and src.op in (
            "call_function", "call_method") else None
        if found is None or found[0].name not in ("view", "reshape"):
            continue
        sizes = found[1].get("size", found[1].get("shape"))
        if isinstance(sizes, (tuple, list)) and sizes and all(
                type(s) is int and s >= 0 for s in sizes) and -len(sizes) <= n.args[1] < len(sizes):
            n.replace_all_uses_with(sizes[n.args[1]])
            gm.graph.erase_node(n)
            changed = True
    if changed:
        gm.recompile()


def _join(nodes: list[Node], gm: GraphModule, index: dict[Node, int], window: dict[Node, int],
          linears: bool) -> list[set[Node]]:
    """The maximal convex sets of joining nodes among ``nodes`` (linears only with
    ``linears``), each inside one impure window."""
    region_of: dict[Node, set[Node]] = {}
    for n in nodes:
        if not _joins(n, gm, views=linears) or not linears and _linear(n, gm):
            continue
        region = {n}
        region_of[n] = region
        for p in n.all_input_nodes:
            other = region_of.get(p)
            if other is None or other is region or window[p] != window[n]:
                continue
            if _convex(other | region, index):
                region |= other
                for m in region:
                    region_of[m] = region
    return list({id(r): r for r in region_of.values()}.values())


def _without_trailing_views(region: set[Node], gm: GraphModule) -> set[Node]:
    """``region`` less the views that only nodes outside it read (a sink leaves a convex
    set convex). Why: a region returning a view returns a copy of it (a view of memory its
    autograd node made would forbid the caller's in-place writes), and transformers'
    GPT-2 reads its attention's input as ``addmm(b, h, w).view(8, 1024, 2304)``::

        before                                   after
            r = region_0(x, w1, b1, w, b)            r = region_0(x, w1, b1, w, b)
            qkv = r                # a copy          qkv = r.view(8, 1024, 2304)
    """
    region = set(region)
    sinks = [m for m in region if not any(u in region for u in m.users)]
    while sinks:
        m = sinks.pop()
        if m.op == "call_module" or m.target is operator.getitem or m not in region \
                or any(u in region for u in m.users):
            continue  # (a group's item stays with its group)
        if view_base(m, gm) is None:
            continue
        region.discard(m)
        sinks += [p for p in m.all_input_nodes if p in region]
    return region


def _worth_it(region: set[Node], gm: GraphModule) -> bool:
    """Groups around a reduction that keeps a dim (see the module docstring)."""
    groups = [m for m in region if m.op == "call_module"]
    return len(groups) >= 2 and any(_reduction(m, gm) for m in region)


def _made_of_linears(region: set[Node], gm: GraphModule) -> bool:
    """At least one linear, and two autograd nodes (groups or linears) in all."""
    linears = sum(_linear(m, gm) for m in region)
    return linears > 0 and linears + sum(m.op == "call_module" for m in region) >= 2


def _returns_a_view_of_an_input(region: set[Node], gm: GraphModule) -> bool:
    """Whether a value ``region`` returns is a view of one of its inputs (through view
    ops alone): the region's node would hand out a view of memory it did not make."""
    for m in region:
        if not any(u not in region for u in m.users):
            continue
        while m in region and (base := view_base(m, gm)) is not None:
            m = base
        if m not in region:
            return True
    return False


def _detaches(region: set[Node], gm: GraphModule) -> bool:
    """Whether ``region`` holds a ``detach`` (in a group too). Through a linear, a region
    could then join parts that different backwards run: a GAN's discriminator loss reads
    ``gen(z).detach()`` and its backward runs before the generator's loss reads
    ``gen(z)``; as one autograd node, the first backward ran (and freed) the generator's
    part too, and the second found nothing saved. (A BatchNorm's variance reads its mean
    detached: its region, of groups alone, is made in the second round.)"""
    for m in region:
        owner = gm
        if m.op == "call_module":
            owner = gm.get_submodule(m.target)
            owner = getattr(owner, "inner", owner)
        if any(_named(n, owner, ("detach",)) for n in (
                owner.graph.nodes if owner is not gm else (m,))):
            return True
    return False


def _impure_windows(nodes: list[Node], gm: GraphModule) -> dict[Node, int]:
    """The number of impure nodes before each node (regions stay inside one window)."""
    out, count = {}, 0
    for n in nodes:
        if n.op in ("call_function", "call_method", "call_module") and is_impure(n, gm):
            count += 1
        out[n] = count
    return out


def _differentiable(n: Node, gm: GraphModule, views: bool = False) -> bool:
    """A pointwise or reduction op with a derivative rule (``detach`` and linears too),
    or with ``views`` a view op with one. (Views between groups join regions through
    linears only: a GPT-2 linear is ``addmm(b, h.view(-1, 768), w).view(8, 1024, 768)``;
    inside a group fuse admits unit and broadcast views only.)"""
    found = resolve(n, gm)
    return found is not None and (found[0].kind in GROUP_KINDS or found[0].name in JOINING
                                  or views and found[0].kind == "view") \
        and found[0].name in VJP and not is_impure(n, gm)


def _joins(n: Node, gm: GraphModule, views: bool = False) -> bool:
    """Whether ``n`` may be part of a region (a view op outside groups with ``views``)."""
    if n.op == "call_module":
        sub = gm.get_submodule(n.target)
        if getattr(sub, "meta", {}).get("fused_kind") not in GROUP_KINDS or n.kwargs:
            return False
        inner = getattr(sub, "inner", sub)
        if _tuple(n) and not all(u.op == "call_function" and u.target is operator.getitem
                                 and _tensor(u) for u in n.users):
            return False  # its results must each be a value the region can return
        return all(m.op in ("placeholder", "output") or (
            m.op in ("call_function", "call_method") and _differentiable(m, inner, views=True))
            for m in inner.graph.nodes)
    if n.op != "call_function":
        return n.op == "call_method" and _tensor(n) and _differentiable(n, gm, views)
    if n.target is operator.getitem:  # an item of a group's results (not an indexing:
        src = n.args[0]                 # vit_b_16's class token, ``x[:, 0]``, has no rule)
        return isinstance(src, Node) and src.op == "call_module" and _tuple(src) \
            and isinstance(n.args[1], int) and _tensor(n)
    return _tensor(n) and _differentiable(n, gm, views)


def _reduction(n: Node, gm: GraphModule) -> bool:
    """A reduction outside any group that keeps a dim (such as the outer sum of
    ``split_sums``, one value per channel; not a loss's mean over everything, a 0-d
    value). A single channel's sums, of shape (1, 1, ...), count: apart, a half-precision
    BatchNorm's input would get two gradients rounded to its dtype before the engine adds
    them, where eager's rounds their sum once (fuzz seed 10219968)."""
    if n.op not in ("call_function", "call_method"):
        return False
    found = resolve(n, gm)
    shape = getattr(n.meta.get("tensor_meta"), "shape", ())
    return found is not None and found[0].kind == "reduction" and len(shape) > 0


def _linear(n: Node, gm: GraphModule) -> bool:
    return n.op == "call_function" and _named(n, gm, LINEARS)


def _named(n: Node, gm: Any, names: Any) -> bool:
    """Whether ``n`` calls a table op named in ``names``."""
    info = lookup(n, gm) if n.op in ("call_function", "call_method") else None
    return info is not None and info.name in names


def _tensor(n: Node) -> bool:
    return hasattr(n.meta.get("tensor_meta"), "shape")


def _convex(region: set[Node], index: dict[Node, int]) -> bool:
    """No path leaves ``region`` and comes back into it."""
    last = max(index[n] for n in region)
    stack = [u for n in region for u in n.users if u not in region and index[u] < last]
    seen: set[Node] = set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        for w in u.users:
            if w in region:
                return False
            if index[w] < last:
                stack.append(w)
    return True


def _replace(gm: GraphModule, members: list[Node], name: str) -> bool:
    """Put one call of a new flat region module in place of ``members``; False (and
    ``gm`` unchanged) when the region returns nothing."""
    # an item of a result made outside the region is one of its inputs, not a member
    outside = set(members)
    members = [n for n in members if not (n.op == "call_function" and n.target is
                                          operator.getitem and n.args[0] not in outside)]
    inside = set(members)
    inputs: dict[Node, None] = {}
    for n in members:
        for p in n.all_input_nodes:
            if p not in inside:
                inputs[p] = None
    outputs = [n for n in members if any(u not in inside for u in n.users)
               and not (n.op == "call_module" and _tuple(n))]
    if not outputs:
        return False
    graph = Graph()
    env: dict[Node, Any] = {}
    for p in inputs:
        ph = graph.placeholder(p.name)
        ph.meta.update({k: p.meta[k] for k in ("tensor_meta", "type") if k in p.meta})
        env[p] = ph
    names: list[str] = []
    for n in members:
        if n.op == "call_module":
            sub = gm.get_submodule(n.target)
            inner = getattr(sub, "inner", sub)
            names += sub.meta.get("nodes", [])
            sub_env: dict[Node, Any] = {}
            args = iter(n.args)
            for m in inner.graph.nodes:
                if m.op == "placeholder":
                    sub_env[m] = map_arg(next(args), env.__getitem__)
                elif m.op != "output":
                    sub_env[m] = graph.node_copy(m, sub_env.__getitem__)
            env[n] = map_arg(inner.graph.result, sub_env.__getitem__)
        elif n.op == "call_function" and n.target is operator.getitem and isinstance(
                env.get(n.args[0]), (tuple, list)):  # an item of a group's results
            env[n] = env[n.args[0]][n.args[1]]
        else:
            names.append(n.name)
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs) if len(outputs) > 1 else env[outputs[0]])
    region = GraphModule(gm, graph, class_name=name)
    region.meta = {"fused_kind": "region", "nodes": names}
    gm.add_module(name, region)
    parent = gm.graph
    with parent.inserting_after(members[-1]):
        call = parent.call_module(name, tuple(inputs))
    set_call_meta(call, outputs)
    mapped: dict[Node, Node] = {}
    with parent.inserting_after(call):
        unpack_outputs(parent, call, outputs, mapped)
    for o in outputs:
        o.replace_all_uses_with(mapped[o], delete_user_cb=lambda u: u not in inside)
    for n in reversed(members):
        parent.erase_node(n)
        if n.op == "call_module":
            gm.delete_submodule(n.target)
    return True


def _tuple(n: Node) -> bool:
    tm = n.meta.get("tensor_meta")  # (a TensorMetadata is a named tuple too)
    return n.meta.get("type") in (tuple, list) or isinstance(tm, tuple) and not hasattr(tm, "shape")


def _reorder(gm: GraphModule) -> None:
    """Put the graph in topological order again, keeping the old order where it may
    (a region's call sits where its last node was; its readers between its first and
    last node move after it; they are pure, as the region's window has no impure node)."""
    nodes = list(gm.graph.nodes)
    rank = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(rank[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (rank[u], u))
    if len(order) != len(nodes):
        raise RuntimeError("autograd_regions: the graph has a cycle (pass bug)")
    if order == nodes:
        return
    anchor = order[0]
    for n in order[1:]:
        anchor.append(n)
        anchor = n
