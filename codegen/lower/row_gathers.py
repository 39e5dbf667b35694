"""row_gathers: a roll and the window views around it as one gather of rows.

Swin's shifted windows roll the feature map, then cut it into windows (a view, a permute
and a reshape that copies), and put the windows back the same way in reverse::

    x = torch.roll(x, shifts=(-3, -3), dims=(1, 2))                   # a kernel per dim
    x = x.view(B, H // 7, 7, W // 7, 7, C).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(-1, 49, C)                                          # a copy

Three kernels, each moving the whole map, where only whole rows move (the ``C`` values of
one position stay together, in order). The pass replaces the chain with one gather of
rows, :func:`gather_rows`, which runs the chain's links on a probe (each row's number in
place of its ``C`` values) to find the rows, once per input shape and device::

    # before                                    # after
    roll = torch.roll(x, (-3, -3), (1, 2))      gather_rows = gather_rows(x, (
    view = roll.view(2, 2, 7, 2, 7, 32)             ('roll', (-3, -3), (1, 2)),
    permute = view.permute(0, 1, 3, 2, 4, 5)        ('reshape', (2, 2, 7, 2, 7, 1)),
    reshape_1 = permute.reshape(8, 49, 32)          ('permute', (0, 1, 3, 2, 4, 5)),
                                                    ('reshape', (8, 49, 1))))

Only where the chain holds a roll over two dims or more, or a roll and a link more (a lone
roll over one dim is one kernel either way), its source is row-major, every value in it
keeps the last dim whole and last, nothing else reads its inner values, its arguments are
numbers, and its result is row-major as eager's is. Only in inference: ``index_select``'s
backward accumulates with atomics, which deterministic mode refuses where ``roll``'s does
not. Sizes the chain names run on the probe as they would on the tensor: for other
shapes, they fail as eager's views would, with torch's message.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from fxlite.codegen.kernels.rows import gather_rows_kernel, planned_launch, takes

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import is_impure, lookup
from fxlite.tensor_meta import strided_meta

__all__ = ["gather_rolled_rows", "gather_rows"]

_CHAIN = frozenset({"view", "reshape", "permute", "roll", "contiguous", "getitem"})


def gather_rolled_rows(gm: GraphModule) -> GraphModule:
    """Replace each chain of views, copies and rolls around a ``roll`` that only moves
    whole rows of the last dim by one :func:`gather_rows`.

    Args:
        gm: a normalized graph with ShapeProp metadata, in which no node needs autograd.

    Returns:
        ``gm``, changed in place (and recompiled) where a chain became a gather.
    """
    changed = False
    for roll in list(gm.graph.nodes):
        if roll._erased or _name(roll, gm) != "roll" or not _link(roll, gm):
            continue
        chain = _chain(roll, gm)
        links = _links(chain, gm)
        if links is None:
            continue
        last = chain[-1]
        with gm.graph.inserting_before(last):
            out = gm.graph.call_function(gather_rows, (chain[0].args[0], links))
        out.meta = dict(last.meta)
        last.replace_all_uses_with(out)
        for n in reversed(chain):
            gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.recompile()
    return gm


_INDEX: dict[tuple, tuple[torch.Tensor, tuple[int, ...]]] = {}


def gather_rows(x: torch.Tensor, links: tuple[tuple[Any, ...], ...]) -> torch.Tensor:
    """``x``'s rows (the values along its last dim) where ``links`` put them: one gather
    (``codegen/kernels/rows.py``'s kernel, or ``index_select``), the same values as the
    links' ops on ``x``, row-major.

    Args:
        x: a row-major tensor of rank 1 or more.
        links: ``("roll", shifts, dims)``, ``("reshape", shape)`` (the last size 1),
            ``("permute", dims)`` or ``("getitem", index)`` (a slice in it as
            ``("slice", start, stop, step)``), in order; none touches the last dim.

    Example::

        gather_rows(x, (("roll", (1,), (0,)),))  # torch.roll(x, 1, 0)
    """
    key = (links, x.shape, x.device)
    found = _INDEX.get(key)
    if found is None:
        # (under CUDA graph capture: made on the device, and not kept, since the graph's
        # memory pool holds it)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        probe = _probe(links, x.shape, x.device if capturing else "cpu")
        found = (probe.reshape(-1).to(x.device), tuple(probe.shape[:-1]))
        if not capturing:
            if len(_INDEX) >= 64:
                _INDEX.clear()
            _INDEX[key] = found
    index, shape = found
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (a view of a row-major x)
    # (a Triton kernel on CUDA: index_select ran at a quarter of copy speed on Swin's rows)
    picked = gather_rows_kernel(rows, index) if takes(rows) else \
        torch.index_select(rows, 0, index)
    return picked.view(*shape, x.shape[-1])


def _planned(target: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The precompile's plan of a :func:`gather_rows` call (``x`` a meta tensor): the
    kernel launch it will make (``kernels/rows.py``), its rows counted on a probe."""
    x, links = args
    try:
        picked = math.prod(_probe(links, x.shape, "cpu").shape[:-1])
    except Exception:  # sizes the links refuse: the call raises as eager's views do
        return None
    return planned_launch(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), picked)


# The precompile (codegen/runtime/precompile.py) compiles the kernel of each call ahead.
gather_rows.planned_launch = _planned  # type: ignore[attr-defined]


def _probe(links: tuple[tuple[Any, ...], ...], shape: Any,
           device: torch.device | str) -> torch.Tensor:
    """Each row's number of a tensor of ``shape`` (its last dim 1), moved by ``links``:
    the rows of the result's source, where the links put them."""
    probe = torch.arange(math.prod(shape[:-1]), device=device).view(*shape[:-1], 1)
    for link in links:
        probe = _apply(link, probe)
    return probe


def _apply(link: tuple[Any, ...], probe: torch.Tensor) -> torch.Tensor:
    op, *args = link
    if op == "roll":
        return torch.roll(probe, *args)
    if op == "reshape":
        return probe.reshape(args[0])
    if op == "permute":
        return probe.permute(args[0])
    return probe[tuple(slice(*i[1:]) if isinstance(i, tuple) else i for i in args[0])]


def _name(n: Node, gm: GraphModule) -> str | None:
    info = lookup(n, gm) if n.op in ("call_function", "call_method") else None
    if info is not None:
        return info.name
    # (roll is no op of the table: an eager op, as the graph records it)
    return "roll" if n.target in (torch.roll, torch.Tensor.roll, "roll") else None


def _link(n: Node, gm: GraphModule) -> bool:
    """Whether ``n`` may be a link of a chain: a view, copy, roll or slice of a tensor with
    plain arguments (no node but its input), nothing written."""
    name = _name(n, gm)
    if name not in _CHAIN or is_impure(n, gm) or not n.args or strided_meta(n) is None \
            or strided_meta(n.args[0]) is None or n.kwargs and name not in ("roll", "contiguous") \
            or n.kwargs.get("memory_format", torch.contiguous_format) != torch.contiguous_format:
        return False
    return not any(isinstance(a, Node) for a in _flat(n.args[1:])) and not any(
        isinstance(a, Node) for a in _flat(list(n.kwargs.values())))


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, (tuple, list)):
            out += _flat(a)
        elif isinstance(a, slice):
            out += [a.start, a.stop, a.step]
        else:
            out.append(a)
    return out


def _chain(roll: Node, gm: GraphModule) -> list[Node]:
    """The links around ``roll``, in order: back while a link's input is a link read by it
    alone, on while its only reader is a link."""
    chain = [roll]
    while isinstance(chain[0].args[0], Node) and _link(chain[0].args[0], gm) \
            and len(chain[0].args[0].users) == 1:
        chain.insert(0, chain[0].args[0])
    while len(chain[-1].users) == 1:
        user = next(iter(chain[-1].users))
        if not _link(user, gm) or user.args[0] is not chain[-1]:
            break
        chain.append(user)
    return chain


def _links(chain: list[Node], gm: GraphModule) -> tuple[tuple[Any, ...], ...] | None:
    """The chain as :func:`gather_rows`'s links, or None where it does not move whole rows
    or is not worth a gather (see the module docstring). The links are checked on a probe
    of the recorded shapes."""
    source, last = chain[0].args[0], chain[-1]
    sm, lm = strided_meta(source), strided_meta(last)
    if sm is None or lm is None or not sm.shape or sm.memory_format != torch.contiguous_format \
            or lm.memory_format != torch.contiguous_format:
        return None
    links = []
    for n in chain:
        link = _link_of(n, gm, strided_meta(n.args[0]).shape)
        if link is False:
            return None
        if link is not None:
            links.append(link)
    if len(links) == 1 and len(_listed(links[0][2])) < 2:
        return None  # a lone roll over one dim: one kernel either way
    try:
        probe = _probe(tuple(links), sm.shape, "cpu")
    except Exception:  # a link that does not apply to the probe: leave the chain
        return None
    # (each link keeps the last dim, _link_of checked: only the rows' shape can differ)
    return tuple(links) if tuple(probe.shape) == tuple(lm.shape[:-1]) + (1,) else None


def _listed(value: Any) -> list[Any]:
    """An argument that may be one value or several, as a list (a roll's dims)."""
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _link_of(n: Node, gm: GraphModule, shape: Any) -> tuple[Any, ...] | None | bool:
    """``n`` as a link of :func:`gather_rows` (its input's shape ``shape``); None for a
    link that moves nothing (``contiguous``); False where it would touch the last dim."""
    name, rank = _name(n, gm), len(shape)
    args = n.args[1:]
    if tuple(strided_meta(n).shape[-1:]) != tuple(shape[-1:]):
        return False
    if name in ("view", "reshape"):
        sizes = _listed(args[0]) if len(args) == 1 else list(args)
        if not sizes or sizes[-1] not in (-1, shape[-1]) or sizes.count(-1) > 1:
            return False
        return ("reshape", tuple(sizes[:-1]) + (1,))
    if name == "permute":
        dims = _listed(args[0]) if len(args) == 1 else list(args)
        if len(dims) != rank or dims[-1] % rank != rank - 1:
            return False
        return ("permute", tuple(d % rank for d in dims))
    if name == "roll":
        shifts = args[0] if args else n.kwargs.get("shifts")
        dims = args[1] if len(args) > 1 else n.kwargs.get("dims")
        if dims is None or any(type(d) is not int or d % rank == rank - 1
                               for d in _listed(dims)):
            return False
        return ("roll", shifts, dims)
    if name == "contiguous":
        return None
    if name == "getitem" and n.target is operator.getitem:
        index = args[0]
        items = list(index) if isinstance(index, tuple) else [index]
        if any(i is Ellipsis or i is None or not isinstance(i, (int, slice)) or
               isinstance(i, bool) for i in items) or len(items) > rank or \
                len(items) == rank and items[-1] != slice(None):
            return False
        # (slices as tuples: links are a cache key, and slices hash from Python 3.12 on)
        return ("getitem", tuple(("slice", i.start, i.stop, i.step) if isinstance(i, slice)
                                 else i for i in items))
    return False
