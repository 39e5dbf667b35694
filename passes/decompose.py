"""decompose: rewrite composite ops into table primitives with Proxy-based rules.

A rule is a Python function with the signature of the op's canonical call; it receives
:class:`fxlite.Proxy` values for the node's inputs and computes the op from simpler ones,
which records the replacement nodes, as in torch.fx's decomposition example::

    @register_decomposition(torch.nn.functional.silu)
    def silu(x, inplace=False):
        return x * torch.sigmoid(x)

Rules live in :data:`DECOMPOSITIONS`, keyed by the op's canonical ``torch_fn``
(``fxlite.ops``), so a rule registered for ``F.softmax`` also decomposes ``torch.softmax``,
``x.softmax(-1)`` and ``nn.Softmax``. The defaults cover softmax, log_softmax, layer_norm,
rms_norm, gelu (erf and tanh), silu, var, std and mean, and give numerically stable forms
(softmax subtracts the row max). A rule may return ``NotImplemented`` to keep the node
(mean, var and std need ShapeProp's ``meta['tensor_meta']`` on their input, to know how
many elements they reduce). What rules emit is normalized (``x * 2`` becomes
``torch.mul(x, 2)``) and decomposed again if it holds composites itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fxlite.graph import check_order
from fxlite.graph_module import GraphModule
from fxlite.node import Node, map_arg
from fxlite.ops import call_args, is_impure, lookup, lookup_target, resolve
from fxlite.proxy import GraphAppendingTracer, Proxy

from .normalize import _copy_graph, normalize_graph

__all__ = ["DECOMPOSITIONS", "decompose", "register_decomposition"]

Rule = Callable[..., Any]
DECOMPOSITIONS: dict[Callable[..., Any], Rule] = {}
_MAX_DEPTH = 16  # rules that expand into themselves forever are an error, not a hang


def register_decomposition(target: Callable[..., Any],
                           table: dict[Callable[..., Any], Rule] | None = None
                           ) -> Callable[[Rule], Rule]:
    """Decorator: make the decorated function the rule for ``target``'s op.

    Args:
        target: any spelling of the op (``F.gelu``, ``torch.softmax``); the rule is stored
            under the op's canonical ``torch_fn``.
        table: the rule table (defaults to :data:`DECOMPOSITIONS`).

    Returns:
        A decorator that registers the rule and returns it unchanged.

    Example::

        @register_decomposition(torch.relu)
        def relu(x):
            return torch.where(x > 0, x, 0.0)
    """
    def decorator(rule: Rule) -> Rule:
        (DECOMPOSITIONS if table is None else table)[_canonical(target)] = rule
        return rule
    return decorator


def decompose(gm: GraphModule, rules: dict[Callable[..., Any], Rule] | None = None) -> GraphModule:
    """Replace every node that has a rule by the nodes its rule records.

    Args:
        gm: the module to rewrite; run ``normalize`` first so module spellings with
            parameters (``nn.LayerNorm``) are functional calls, and ``ShapeProp`` if mean,
            var and std should decompose too.
        rules: the rule table, keyed by any spelling of each op (defaults to
            :data:`DECOMPOSITIONS`).

    Returns:
        ``gm``, recompiled. If a rule raises, the exception propagates and ``gm`` is left
        as it was.

    Example::

        # before                                   # after
        def forward(self, x):                      def forward(self, x):
            softmax = torch.softmax(x, dim=-1)         amax = torch.amax(x, dim=-1, keepdim=True)
            return softmax                             sub = torch.sub(x, amax)
                                                       exp = torch.exp(sub)
                                                       sum_1 = torch.sum(exp, dim=-1, keepdim=True)
                                                       truediv = torch.div(exp, sum_1)
                                                       return truediv
    """
    table = DECOMPOSITIONS if rules is None else {_canonical(k): v for k, v in rules.items()}
    check_order(gm.graph, "decompose")
    graph = _copy_graph(gm)
    tracer = GraphAppendingTracer(graph)
    depth: dict[Node, int] = {}
    created: list[Node] = []
    pending = deque(graph.nodes)
    while pending:
        node = pending.popleft()
        call = _match(node, gm, table)
        if call is None:
            continue
        rule, args, kwargs = call
        level = depth.get(node, 0)
        if level >= _MAX_DEPTH:
            raise RecursionError(f"decompose: rules for {node.format_node()} keep expanding "
                                 f"after {_MAX_DEPTH} levels")
        new_nodes = _expand(graph, tracer, node, rule, args, kwargs)
        if new_nodes is None:
            continue
        for n in new_nodes:
            depth[n] = level + 1
        created.extend(new_nodes)
        pending.extendleft(reversed(new_nodes))
    normalize_graph(graph, gm, [n for n in created if n.graph is graph and not n._erased])
    graph.lint()
    gm.graph = graph
    return gm


def _match(node: Node, gm: GraphModule, table: dict[Callable[..., Any], Rule]
           ) -> tuple[Rule, tuple, dict[str, Any]] | None:
    """The rule for ``node`` and the arguments of its canonical call, or None."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    found = resolve(node, gm)
    if found is None:
        return None
    info, args = found
    rule = table.get(info.torch_fn) if info.torch_fn is not None else None
    if rule is None or is_impure(node, gm):
        return None
    if node.op == "call_module" and (info.module_params is not None or info.module_kwargs is None):
        return None  # its parameters are not arguments yet: normalize first
    return (rule, *call_args(info, args))


def _expand(graph: Any, tracer: GraphAppendingTracer, node: Node, rule: Rule, args: tuple,
            kwargs: dict[str, Any]) -> list[Node] | None:
    """Run ``rule`` before ``node`` and put its result in ``node``'s place.

    Returns the nodes the rule created, or None if it declined (``NotImplemented``).
    """
    before = node.prev
    to_proxy = lambda n: Proxy(n, tracer)
    with graph.inserting_before(node):
        out = rule(*map_arg(args, to_proxy), **map_arg(kwargs, to_proxy))
    new_nodes = []
    cur = before.next
    while cur is not node:
        new_nodes.append(cur)
        cur = cur.next
    if out is NotImplemented:
        for n in reversed(new_nodes):
            graph.erase_node(n)
        return None
    result = out.node if isinstance(out, Proxy) else out
    if not isinstance(result, Node):
        raise TypeError(f"decomposition rule {getattr(rule, '__name__', rule)!r} returned "
                        f"{type(out).__name__}; it must return a Proxy (or NotImplemented)")
    for key, value in node.meta.items():
        result.meta.setdefault(key, value)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return new_nodes


def _canonical(target: Callable[..., Any]) -> Callable[..., Any]:
    info = lookup_target(target)
    return info.torch_fn if info is not None and info.torch_fn is not None else target


# ---------------------------------------------------------------------- the default rules
def _shape(x: Any) -> tuple[int, ...] | None:
    meta = x.node.meta.get("tensor_meta") if isinstance(x, Proxy) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _dims(dim: Any, ndim: int) -> tuple[int, ...] | None:
    """Reduction dims as non-negative ints (None: all dims), or None if not plain ints."""
    if dim is None:
        return tuple(range(ndim))
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    if not dims or not all(type(d) is int for d in dims):
        return None
    return tuple(d % ndim for d in dims) if ndim else None


def _last_dims(normalized_shape: Any) -> tuple[int, ...] | None:
    """The trailing dims a layer/rms norm reduces over (entries may be traced sizes)."""
    shape = tuple(normalized_shape) if isinstance(normalized_shape, (list, tuple)) else (normalized_shape,)
    return tuple(range(-len(shape), 0)) if shape else None


def _nonnegative(n: int) -> int:
    """``max(n, 0)``, recorded as one call because a traced ``n`` has no truth value."""
    return max(n, 0)


def _same_shape_source(x: Any) -> Any:
    """The earliest value with ``x``'s shape along a chain of pointwise ops.

    Why: reading a size from ``x + r`` makes the size a consumer of the add, which keeps a
    layer_norm's prologue out of its fused kernel; ``x`` itself has the same size.
    """
    node = x.node
    shape = _shape(x)
    while shape is not None:
        info = lookup(node, node.graph.owning_module)
        if info is None or info.kind != "pointwise":
            break
        same = [a for a in node.all_input_nodes
                if getattr(a.meta.get("tensor_meta"), "shape", None) == shape]
        if not same:
            break
        node = same[0]
    return x if node is x.node else Proxy(node, x.tracer)


def _count(x: Any, dims: tuple[int, ...]) -> Any:
    """How many elements ``dims`` hold, read from ``x`` when the graph runs.

    Why not the traced shape: a compiled graph is reused for other sizes of the same rank,
    so a literal count would be wrong after a resize.
    """
    x = _same_shape_source(x)
    n = None
    for d in dims:
        size = x.size(d)
        n = size if n is None else n * size
    return n


@register_decomposition(torch.softmax)
def _softmax(x: Any, dim: Any = None, dtype: Any = None) -> Any:
    # exp(x - max) / sum(exp(x - max)): the max keeps exp from overflowing
    if dim is None:
        return NotImplemented
    if dtype is not None:
        x = x.to(dtype)
    e = torch.exp(x - torch.amax(x, dim, keepdim=True))
    return e / torch.sum(e, dim, keepdim=True)


@register_decomposition(torch.log_softmax)
def _log_softmax(x: Any, dim: Any = None, dtype: Any = None) -> Any:
    # (x - max) - log(sum(exp(x - max)))
    if dim is None:
        return NotImplemented
    if dtype is not None:
        x = x.to(dtype)
    shifted = x - torch.amax(x, dim, keepdim=True)
    return shifted - torch.log(torch.sum(torch.exp(shifted), dim, keepdim=True))


@register_decomposition(F.layer_norm)
def _layer_norm(x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
                eps: float = 1e-5) -> Any:
    # (x - mean) * rsqrt(var + eps) * weight + bias, over the trailing normalized_shape dims
    dims = _last_dims(normalized_shape)
    if dims is None:
        return NotImplemented
    n = _count(x, dims)
    centered = x - torch.sum(x, dims, keepdim=True) / n
    var = torch.sum(centered * centered, dims, keepdim=True) / n
    y = centered * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


@register_decomposition(F.rms_norm)
def _rms_norm(x: Any, normalized_shape: Any, weight: Any = None, eps: Any = None) -> Any:
    # x * rsqrt(mean(x * x) + eps) * weight; eps defaults to the dtype's machine epsilon
    dims = _last_dims(normalized_shape)
    if eps is None:
        meta = x.node.meta.get("tensor_meta") if isinstance(x, Proxy) else None
        if meta is None or not hasattr(meta, "dtype"):
            return NotImplemented
        eps = torch.finfo(meta.dtype).eps
    if dims is None:
        return NotImplemented
    y = x * torch.rsqrt(torch.sum(x * x, dims, keepdim=True) / _count(x, dims) + eps)
    return y * weight if weight is not None else y


@register_decomposition(F.gelu)
def _gelu(x: Any, approximate: str = "none") -> Any:
    if approximate == "tanh":
        # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))
        inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
        return x * 0.5 * (torch.tanh(inner) + 1)
    if approximate != "none":
        return NotImplemented
    # 0.5 * x * (1 + erf(x / sqrt(2)))
    return x * 0.5 * (torch.erf(x * (1.0 / math.sqrt(2.0))) + 1)


@register_decomposition(F.silu)
def _silu(x: Any, inplace: bool = False) -> Any:
    # x * sigmoid(x)
    return x * torch.sigmoid(x)


def _var_parts(x: Any, dim: Any, correction: Any, keepdim: bool) -> Any:
    # sum((x - mean)**2) / (n - correction), n the number of reduced elements
    shape = _shape(x)
    dims = _dims(dim, len(shape)) if shape is not None else None
    if dims is None or not isinstance(correction, (int, float)) or isinstance(correction, bool):
        return NotImplemented
    n = _count(x, dims)
    centered = x - torch.sum(x, dims, keepdim=True) / n
    # divided by max(n - correction, 0), as torch does; n is only known when the graph runs
    denominator = x.tracer.create_proxy("call_function", _nonnegative, (n - correction,), {})
    return torch.sum(centered * centered, dims, keepdim=keepdim) / denominator


@register_decomposition(torch.var)
def _var(x: Any, dim: Any = None, correction: Any = 1, keepdim: bool = False) -> Any:
    return _var_parts(x, dim, correction, keepdim)


@register_decomposition(torch.std)
def _std(x: Any, dim: Any = None, correction: Any = 1, keepdim: bool = False) -> Any:
    # sqrt(var)
    var = _var_parts(x, dim, correction, keepdim)
    return var if var is NotImplemented else torch.sqrt(var)


@register_decomposition(torch.mean)
def _mean(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    # sum(x) / n
    shape = _shape(x)
    dims = _dims(dim, len(shape)) if shape is not None else None
    if dims is None:
        return NotImplemented
    if dtype is not None:
        x = x.to(dtype)
    elif not x.node.meta["tensor_meta"].dtype.is_floating_point:
        return NotImplemented  # torch.mean rejects integer tensors; let it say so
    return torch.sum(x, dims, keepdim=keepdim) / _count(x, dims)
