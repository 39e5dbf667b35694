"""A concatenation of pointwise groups as one kernel, and the pass that makes them one group.

Every branch of an inception block (inception_v3, googlenet) ends in a convolution, then
its BatchNorm and ReLU, one fused group each, and the block concatenates the branches:
each group writes its result, then ``torch.cat`` reads them all again and writes them
once more, one launch per group and one for the cat (inception_v3: 15 cats and 44 such
groups a call). Inductor writes each branch's epilogue straight into its slice of the output.

:func:`cat_groups` joins a ``torch.cat`` and the pointwise groups only it reads into one
group (``meta["fused_kind"] == "cat"``), nested cats along the same dim flattened first;
:func:`build_cat` writes its kernel. Each lane takes one element of the output, in the
output's memory order, finds its branch by its index along the cat's dim, and computes
that branch's ops on the branch's inputs read at the index less the branch's offset
(masked: every lane computes every branch, and keeps its own)::

    before                                          after
    f0 = fused_0(conv0, mean0, var0, w0, b0)        cat = cat_0(conv0, mean0, var0, w0, b0,
    f1 = fused_1(conv1, mean1, var1, w1, b1)                    conv1, ..., pool)
    cat = torch.cat([f0, f1, pool], 1)

An input the cat reads that no such group computes (``pool``) is a branch that copies it.
Generated source for ``torch.cat([relu(x), y], 1)`` with a contiguous ``(2, 3, 4)`` ``x``
and a ``(2, 5, 4)`` ``y`` (sizes and strides are baked in: the kernel is made per layout)::

    @triton.jit
    def cat_kernel(b0_in0_ptr, b1_in0_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < 64
        i2 = offs % 4
        rem = offs // 4
        i1 = rem % 8
        i0 = rem // 8
        m0 = mask & (i1 < 3)
        b0_in0 = tl.load(b0_in0_ptr + (i0 * 12 + (i1 - 0) * 4 + i2 * 1), mask=m0, other=0)
        b0_relu = tl.where(b0_in0 < 0, 0.0, b0_in0)
        m1 = mask & (i1 >= 3)
        b1_in0 = tl.load(b1_in0_ptr + (i0 * 20 + (i1 - 3) * 4 + i2 * 1), mask=m1, other=0)
        value = tl.where(i1 < 3, b0_relu, b1_in0)
        tl.store(out_ptr + offs, value, mask=mask)

Only in inference: a cat group has no derivative (the pass runs where no node needs
autograd). The kernel is checked against the group's eager ops, as every group's is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from fxlite.codegen.kernels.analysis import (
    INT32_LIMIT,
    Value,
    analyze,
    iteration_space,
    used_values,
)
from fxlite.codegen.kernels.emit import Emitter, Unsupported
from fxlite.codegen.kernels.layout import dense_strides, eager_layout
from fxlite.codegen.kernels.source import (
    Access,
    emit_value,
    header,
    load_line,
    scalar_lines,
    store_line,
)
from fxlite.passes.split_module import extract_subgraph

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule
from fxlite.node import Node, ancestors
from fxlite.ops import is_impure

__all__ = ["Branch", "CatSource", "build_cat", "cat_branches", "cat_groups"]

MAX_BRANCHES = 8  # a cat of more inputs stays torch.cat (each lane computes every branch)
BLOCK = 1024


def _cat_args(node: Node) -> tuple[list[Any], Any] | None:
    """``(tensors, dim)`` of a plain ``torch.cat`` call node, else None."""
    if node.op != "call_function" or node.target is not torch.cat or not node.args:
        return None
    if set(node.kwargs) - {"dim"} or len(node.args) > 2 or not isinstance(node.args[0], (list, tuple)):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return list(node.args[0]), dim


def _rank(n: Any) -> int | None:
    tm = n.meta.get("tensor_meta") if isinstance(n, Node) else None
    return len(tm.shape) if tm is not None and hasattr(tm, "shape") else None


def _flatten(node: Node) -> bool:
    """Splice into ``node`` (a cat) the tensors of each cat along the same dim that only it
    reads: ``cat([a, cat([b, c], 1)], 1)`` -> ``cat([a, b, c], 1)``. Returns whether it did."""
    tensors, dim = _cat_args(node)
    rank = _rank(node)
    dtype = node.meta["tensor_meta"].dtype if rank is not None else None
    if rank is None or type(dim) is not int:
        return False
    out: list[Any] = []
    changed = False
    for t in tensors:
        inner = _cat_args(t) if isinstance(t, Node) else None
        if inner is not None and len(t.users) == 1 and tensors.count(t) == 1 \
                and type(inner[1]) is int and inner[1] % rank == dim % rank \
                and _rank(t) == rank and all(isinstance(a, Node) and _rank(a) == rank
                                             and a.meta["tensor_meta"].dtype == dtype
                                             for a in inner[0]):
            out.extend(inner[0])
            changed = True
        else:
            out.append(t)
    if changed:
        node.args = (out, *node.args[1:])
        for t in tensors:
            if isinstance(t, Node) and t.graph is node.graph and not t.users and \
                    _cat_args(t) is not None:
                node.graph.erase_node(t)
    return changed


def _branch_group(t: Node, gm: GraphModule, tensors: list[Any]) -> GraphModule | None:
    """The pointwise group that computes ``t`` for the cat alone, or None."""
    if t.op != "call_module" or len(t.users) != 1 or tensors.count(t) != 1 or t.kwargs:
        return None
    sub = gm.get_submodule(t.target)
    if getattr(sub, "meta", {}).get("fused_kind") != "pointwise" or not isinstance(sub, GraphModule):
        return None
    out = next(n for n in sub.graph.nodes if n.op == "output")
    if not isinstance(out.args[0], Node) or not all(isinstance(a, Node) for a in t.args):
        return None
    if any(n.op not in ("placeholder", "call_function", "call_method", "output")
           for n in sub.graph.nodes):
        return None
    return sub


def _join(gm: GraphModule, node: Node, name: str, index: dict[Node, int]) -> bool:
    """Make ``node`` (a cat) and the pointwise groups only it reads one cat group."""
    tensors, dim = _cat_args(node)
    tm = node.meta.get("tensor_meta")
    if tm is None or type(dim) is not int or not 2 <= len(tensors) <= MAX_BRANCHES \
            or not all(isinstance(t, Node) for t in tensors):
        return False
    rank = len(tm.shape)
    metas = [t.meta.get("tensor_meta") for t in tensors]
    if rank == 0 or any(m is None or len(m.shape) != rank or m.dtype != tm.dtype for m in metas):
        return False
    groups = [_branch_group(t, gm, tensors) for t in tensors]
    if not any(groups):
        return False
    first = min(index[t] for t, g in zip(tensors, groups) if g is not None)
    if any(is_impure(n, gm) for n in list(gm.graph.nodes)[first:index[node]]
           if n.op in ("call_function", "call_method", "call_module")):
        return False  # a write between a group and the cat: the group must run where it was
    g = Graph()
    places: dict[Node, Node] = {}

    def place(v: Node) -> Node:
        if v not in places:
            p = places[v] = g.placeholder(f"in{len(places)}")
            p.meta = dict(v.meta)
        return places[v]

    parts: list[Node] = []
    members: list[str] = []
    for t, sub in zip(tensors, groups):
        if sub is None:
            parts.append(place(t))
            continue
        env: dict[Node, Node] = {}
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for p, a in zip(phs, t.args):
            env[p] = place(a)
        for n in sub.graph.nodes:
            if n.op == "output":
                parts.append(env[n.args[0]])
            elif n.op != "placeholder":
                env[n] = g.node_copy(n, env.__getitem__)
                members.append(n.name)
    cat = g.call_function(torch.cat, (parts, dim))
    cat.meta = dict(node.meta)
    g.output(cat)
    made = GraphModule(gm, g, class_name=name)
    made.meta = {"fused_kind": "cat", "nodes": [*members, node.name]}
    gm.add_submodule(name, made)
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(name, tuple(places))
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    for t, sub in zip(tensors, groups):
        if sub is not None:
            gm.graph.erase_node(t)
            gm.delete_submodule(t.target)
    return True


def cat_groups(gm: GraphModule) -> bool:
    """Join each ``torch.cat`` with the pointwise groups only it reads into one group (see
    the module docstring); ``gm`` is ``fuse``'s result, changed in place. Run it only where
    no node needs autograd. Returns whether ``gm`` changed."""
    cats = [n for n in gm.graph.nodes if _cat_args(n) is not None]
    flattened = False
    for n in reversed(cats):  # outer cats first: an inner one they take in is gone after
        if n.users:
            flattened |= _flatten(n)
    made, number = 0, 0
    for n in [n for n in gm.graph.nodes if _cat_args(n) is not None]:
        index = {m: i for i, m in enumerate(gm.graph.nodes)}
        while hasattr(gm, f"cat_{number}"):
            number += 1
        if _join(gm, n, f"cat_{number}", index):
            made += 1
    if made or flattened:
        gm.recompile()
    return bool(made or flattened)


# ---------------------------------------------------------------------- the kernel
class Branch(NamedTuple):
    """One input of the cat: the graph computing it and where its inputs come from."""

    graph: GraphModule  # placeholders -> the branch's value (a placeholder itself: a copy)
    inputs: tuple[int, ...]  # the cat group's placeholder of each of its placeholders


def cat_branches(group: GraphModule) -> tuple[list[Branch], int]:
    """The branches of a cat group (:func:`cat_groups`'s) and the cat's dim (from 0)."""
    nodes = list(group.graph.nodes)
    phs = [n for n in nodes if n.op == "placeholder"]
    out = next(n for n in nodes if n.op == "output")
    cat = out.args[0]
    parts, dim = _cat_args(cat)
    rank = len(cat.meta["tensor_meta"].shape)
    branches = []
    for part in parts:
        needed = ancestors([part])
        used = [p for p in phs if p in needed]
        ops = [n for n in nodes if n in needed and n.op != "placeholder"]
        graph = extract_subgraph(ops, used, [part])
        branches.append(Branch(GraphModule(group, graph), tuple(phs.index(p) for p in used)))
    return branches, dim % rank


class CatSource(NamedTuple):
    """A cat kernel's module source and how to launch it."""

    text: str
    args: tuple[tuple[int, int], ...]  # per kernel argument before the output: (branch, its input)
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # the output's
    numel: int


def _index(d: int, dim: int, offset: int) -> str:
    return f"(i{d} - {offset})" if d == dim and offset else f"i{d}"


def build_cat(branches: Sequence[Branch], dim: int, inputs: Sequence[Any],
              libdevice: bool) -> CatSource:
    """The kernel of a cat group for ``inputs`` (one per group placeholder), sizes and
    strides baked in, writing its output in the layout eager's cat gives it for these
    inputs (channels-last for channels-last convolutions' results, say).

    Raises:
        Unsupported: some branch has no pointwise kernel form, or the sizes need 64-bit
            indices.
    """
    shapes = []
    plans = []
    for k, br in enumerate(branches):
        args = [inputs[i] for i in br.inputs]
        plan = analyze(br.graph, args, "cat")
        if plan.kind != "pointwise" or len(plan.outputs) != 1:
            raise Unsupported("a branch that is not pointwise")
        out = plan.outputs[0]
        shape = iteration_space(args)
        if out.dims != tuple(range(len(shape))):
            raise Unsupported("a branch whose result is not its whole iteration space")
        for d, size in plan.size_checks:
            if (shape[d] == 1) if size < 0 else (shape[d] != size):
                raise Unsupported("a view's size check fails")
        for v in plan.values:  # names of their own: the branches share one kernel body
            v.name = f"b{k}_{v.name}"
        shapes.append(shape)
        plans.append(plan)
    rank = len(shapes[0])
    if any(len(s) != rank or any(s[d] != shapes[0][d] for d in range(rank) if d != dim)
           for s in shapes):
        raise Unsupported("branches whose sizes differ off the cat's dim")
    total = [*shapes[0]]
    total[dim] = sum(s[dim] for s in shapes)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device_types = {t.device.type for t in tensors}
    if len(device_types) != 1:
        raise Unsupported("inputs on several devices")
    order = _eager_order(plans, branches, inputs, shapes, dim)
    strides = dense_strides(tuple(total), order)
    numel = math.prod(total)
    if numel + BLOCK > INT32_LIMIT or any(
            t.numel() and sum((n - 1) * s for n, s in zip(t.shape, t.stride())) > INT32_LIMIT
            for t in tensors):
        raise Unsupported("sizes that need 64-bit indices")
    ind = "    "
    e = Emitter(libdevice=libdevice, index=None, space=frozenset(range(rank)))
    e.lines += [f"{ind}offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
                f"{ind}mask = offs < {numel}"]
    mem = [d for d in order if total[d] != 1]  # outermost first
    rem = "offs"
    for j, d in enumerate(reversed(mem)):
        if j == len(mem) - 1:
            e.lines.append(f"{ind}i{d} = {rem}")
        else:
            e.lines.append(f"{ind}i{d} = {rem} % {total[d]}")
            e.lines.append(f"{ind}rem{j} = {rem} // {total[d]}")
            rem = f"rem{j}"
    for d in range(rank):
        if total[d] == 1:  # a block of zeros: an empty branch's offsets stay blocks (9603729)
            e.lines.append(f"{ind}i{d} = 0 * offs")
    params: list[str] = []
    args: list[tuple[int, int]] = []
    starts = []
    start = 0
    results = []
    for k, (br, plan, shape) in enumerate(zip(branches, plans, shapes)):
        starts.append(start)
        low = f"(i{dim} >= {start})" if k else ""
        high = f"(i{dim} < {start + shape[dim]})" if k < len(branches) - 1 else ""
        cond = " & ".join(c for c in (low, high) if c)
        e.lines.append(f"{ind}m{k} = mask & {cond}" if cond else f"{ind}m{k} = mask")
        used = used_values(plan) | {plan.outputs[0]}
        e.lines += scalar_lines(plan, used, "[BLOCK]", ind)
        for v in plan.values:
            if v in used and v.kind == "scalar":
                params.append(v.name)
                args.append((k, v.index))
        for v in plan.values:
            if v.kind == "input" and v in used:
                t = inputs[br.inputs[v.index]]
                pad = rank - t.dim()
                terms = [f"{_index(pad + j, dim, start)} * {s}"
                         for j, (n, s) in enumerate(zip(t.shape, t.stride())) if n != 1 and s != 0]
                # (a one-element input: loaded once and broadcast to the block, as the
                # other kernels load one)
                acc = Access(f"({' + '.join(terms)})", frozenset({"lin"})) if terms \
                    else Access("", frozenset())
                e.lines.append(ind + load_line(v, acc, f"m{k}", "[BLOCK]"))
                params.append(f"{v.name}_ptr")
                args.append((k, v.index))
            elif v.kind in ("pw", "count"):
                emit_value(e, v, ind)
        results.append(plan.outputs[0].name)
        start += shape[dim]
    value = results[-1]
    for k in range(len(results) - 2, -1, -1):
        value = f"tl.where(i{dim} < {starts[k + 1]}, {results[k]}, {value})"
    e.lines.append(f"{ind}value = {value}")
    out_dtype = plans[0].outputs[0].dtype
    result = Value("value", "pw", out_dtype, tuple(range(rank)), frozenset(range(rank)))
    e.lines.append(ind + store_line(e, "out_ptr", result, Access("offs", frozenset({"lin"})),
                                    "mask", ""))
    body = "\n".join(e.lines)
    text = header(body, e.helpers, libdevice)
    # scalars are arguments whose values change between calls: Triton must not specialize
    # on them (an int equal to 1 would be baked into the binary every later call reuses)
    scalars = [p for p in params if not p.endswith("_ptr")]
    deco = f"@triton.jit(do_not_specialize={scalars!r})" if scalars else "@triton.jit"
    text += (f"\n\n{deco}\ndef cat_kernel({', '.join([*params, 'out_ptr'])}, "
             f"BLOCK: tl.constexpr):\n{body}\n")
    return CatSource(text, tuple(args), tuple(total), strides, numel)


def _eager_order(plans: Sequence[Any], branches: Sequence[Branch], inputs: Sequence[Any],
                 shapes: Sequence[tuple[int, ...]], dim: int) -> tuple[int, ...]:
    """The dim order (outermost first) of eager's cat of the branches' results: torch.cat
    run on meta tensors laid out as eager lays out each branch's result (a computed one
    as its kernel would, ``Value.layout``; an input as it is)."""
    metas = []
    for plan, br, shape in zip(plans, branches, shapes):
        out = plan.outputs[0]
        if out.kind == "input":
            t = inputs[br.inputs[out.index]]
            metas.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
        else:
            order = out.layout if out.layout is not None else tuple(range(len(shape)))
            metas.append(torch.empty_strided(shape, dense_strides(shape, order),
                                             dtype=out.dtype, device="meta"))
    made = torch.cat(metas, dim)
    found = eager_layout(made)
    return tuple(range(made.dim())) if found is None else found
