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
(softmax subtracts the row max). A rule may return ``NotImplemented`` to keep the node:
the reductions (softmax, log_softmax, layer_norm, rms_norm, mean, var, std) need
ShapeProp's ``meta['tensor_meta']`` on their input, to know its dtype (and, for mean, var
and std, how many elements they reduce).

Half precision: eager's kernels compute f16/bf16 reductions (and gelu, silu) in fp32 and
round the result once, so the rules do the same: ``x.to(torch.float32)`` first, the
result ``.to(x.dtype)`` last. Computing a layer_norm in fp16 instead overflows for a row
holding 300 (300**2 > 65504), and a mean of values near 60000 becomes inf::

    # F.layer_norm(x, (8,)) on an fp16 x, decomposed
    to = x.to(torch.float32)
    ...                               # mean, variance, rsqrt: all fp32
    to_1 = mul_1.to(torch.float16)    # one rounding, as eager's kernel does

What rules emit is normalized (``x * 2`` becomes ``torch.mul(x, 2)``) and decomposed again
if it holds composites itself.

Extern ops get rules where that lets their pointwise part fuse: eval-mode ``batch_norm``
becomes per-channel pointwise math (which fuses with a following ReLU and residual add;
its statistics are checked against the input's channels each call, as eager checks),
and the bias of ``linear`` and ``conv`` becomes an add after a bias-free call, when every
user of the result can join a kernel (so the add joins their kernel: an epilogue).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fxlite.autodiff_batch_norm import per_channel
from fxlite.graph import check_order
from fxlite.graph_module import GraphModule
from fxlite.node import Node, map_arg
from fxlite.ops import call_args, is_impure, lookup, lookup_target, resolve, result_dtype
from fxlite.proxy import GraphAppendingTracer, Proxy

from .normalize import _copy_graph, normalize_graph

__all__ = ["DECOMPOSITIONS", "decompose", "register_decomposition"]

Rule = Callable[..., Any]
DECOMPOSITIONS: dict[Callable[..., Any], Rule] = {}
_MAX_DEPTH = 16  # rules that expand into themselves forever are an error, not a hang


def register_decomposition(target: Callable[..., Any],
                           table: dict[Callable[..., Any], Rule] | None = None, *,
                           when: Callable[[Node, GraphModule], bool] | None = None
                           ) -> Callable[[Rule], Rule]:
    """Decorator: make the decorated function the rule for ``target``'s op.

    Args:
        target: any spelling of the op (``F.gelu``, ``torch.softmax``); the rule is stored
            under the op's canonical ``torch_fn``.
        table: the rule table (defaults to :data:`DECOMPOSITIONS`).
        when: ``when(node, gm)`` says whether the rule applies to this node (its users, say);
            stored on the rule as ``rule.when``.

    Returns:
        A decorator that registers the rule and returns it unchanged.

    Example::

        @register_decomposition(torch.relu)
        def relu(x):
            return torch.where(x > 0, x, 0.0)
    """
    def decorator(rule: Rule) -> Rule:
        if when is not None:
            rule.when = when  # type: ignore[attr-defined]
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
    deferred: list[Node] = []  # conditional rules that declined: judged again at the end
    final = False
    while pending or (deferred and not final):
        if not pending:  # users are decomposed now, so a rule's `when` sees what they became
            final = True
            pending.extend(n for n in deferred if n.graph is graph and not n._erased)
            continue
        node = pending.popleft()
        call = _match(node, gm, table, final)
        if call is _LATER:
            deferred.append(node)
            continue
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


def _match(node: Node, gm: GraphModule, table: dict[Callable[..., Any], Rule],
           final: bool = True) -> tuple[Rule, tuple, dict[str, Any]] | object | None:
    """The rule for ``node`` and the arguments of its canonical call, or None; ``_LATER``
    when the rule's ``when`` declines and this is not the ``final`` round."""
    if node.op not in ("call_function", "call_method", "call_module") or node.meta.get("no_fuse"):
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
    when = getattr(rule, "when", None)
    if when is not None and not when(node, gm):
        return None if final else _LATER
    return (rule, *call_args(info, args))


_LATER = object()  # _match: a conditional rule declined for now


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


_HALVES = (torch.float16, torch.bfloat16)


def _dtype(x: Any) -> torch.dtype | None:
    """The dtype of value ``x``: its ShapeProp record, or for a node an earlier rule made
    (the bias add of a split linear), the op table's dtype rule over its inputs."""
    return _node_dtype(x.node, 8) if isinstance(x, Proxy) else None


def _node_dtype(node: Node, depth: int) -> torch.dtype | None:
    dtype = getattr(node.meta.get("tensor_meta"), "dtype", None)
    if isinstance(dtype, torch.dtype) or depth == 0:
        return dtype if isinstance(dtype, torch.dtype) else None
    found = resolve(node, node.graph.owning_module)
    if found is None:
        return None
    info, args = found
    return result_dtype(info, map_arg(args, lambda n: _operand(n, depth - 1)))


def _operand(node: Node, depth: int) -> Any:
    """``node`` as a dtype rule's operand: its dtype, or a meta tensor where it is 0-dim (a
    0-dim tensor promotes less than one with dims)."""
    dtype = _node_dtype(node, depth)
    shape = getattr(node.meta.get("tensor_meta"), "shape", None)
    if dtype is not None and shape is not None and len(shape) == 0:
        return torch.empty((), dtype=dtype, device="meta")
    return dtype


def _eager_layout(y: Any, x: Any, keeps_channels_last: bool = False) -> Any:
    """``y`` in the layout eager's softmax and norm kernels give their result: row-major
    (or channels-last for a channels-last input, for batch norm). The pointwise ops they
    decompose into follow the input's layout instead (TensorIterator), and a later
    ``view`` of a transposed input's norm would fail. Kernels lay out the clone as they
    store it (no extra pass)."""
    tm = x.node.meta.get("tensor_meta") if isinstance(x, Proxy) else None
    fmt = getattr(tm, "memory_format", torch.contiguous_format)
    if tm is None or len(tm.shape) < 2 or fmt == torch.contiguous_format or (
            keeps_channels_last and fmt == torch.channels_last):
        return y
    return torch.clone(y, memory_format=torch.contiguous_format)


def _opmath(x: Any, dtype: torch.dtype | None) -> tuple[Any, torch.dtype | None]:
    """``x`` in the dtype eager computes a ``dtype`` op in, and the dtype to round back to.

    Halves compute in fp32 (``x.to(torch.float32)``, then the result ``.to(dtype)``);
    other dtypes compute in themselves (no casts).
    """
    if dtype in _HALVES:
        return x.to(torch.float32), dtype
    return x, None


def _back(y: Any, dtype: torch.dtype | None) -> Any:
    return y if dtype is None else y.to(dtype)


def _normalized_count(sizes: tuple[int, ...], expected: Any) -> int:
    """How many elements a layer/rms norm normalizes; raises, as eager does, when the
    input's trailing sizes are not ``normalized_shape`` (a graph reused for other sizes
    must not normalize over whatever the last dims now hold)."""
    expected = tuple(expected) if isinstance(expected, (list, tuple)) else (expected,)
    if tuple(sizes) != expected:
        raise RuntimeError(f"Given normalized_shape={list(expected)}, expected input with "
                           f"shape [*, {', '.join(map(str, expected))}], but got input whose "
                           f"trailing sizes are {list(sizes)}")
    n = 1
    for s in sizes:
        n *= s
    return n


def _norm_count(x: Any, dims: tuple[int, ...], normalized_shape: Any) -> Any:
    """``_count`` for layer/rms norm, checked against ``normalized_shape`` when it runs."""
    src = _same_shape_source(x)
    sizes = tuple(src.size(d) for d in dims)
    return x.tracer.create_proxy("call_function", _normalized_count, (sizes, normalized_shape),
                                 {})


def _nonnegative(n: int) -> int:
    """``max(n, 0)``, recorded as one call because a traced ``n`` has no truth value."""
    return max(n, 0)


def _same_shape_source(x: Any) -> Any:
    """The earliest value with ``x``'s shape along a chain of pointwise ops.

    Why: reading a size from ``x + r`` makes the size a consumer of the add, which keeps a
    layer_norm's prologue out of its fused kernel; ``x`` itself has the same size.
    """
    node = x.node
    shape = _node_shape(node, 8)
    while shape is not None:
        info = lookup(node, node.graph.owning_module)
        if info is None or info.kind != "pointwise":
            break
        same = [a for a in node.all_input_nodes if _node_shape(a, 8) == shape]
        if not same:
            break
        node = same[0]
    return x if node is x.node else Proxy(node, x.tracer)


def _node_shape(node: Node, depth: int) -> tuple[int, ...] | None:
    """ShapeProp's shape of ``node``, or for a node an earlier rule made (the math and
    reshapes of a decomposed batch_norm), its op run on ``meta`` tensors of its inputs'
    shapes."""
    meta = node.meta.get("tensor_meta")
    if hasattr(meta, "shape"):
        return tuple(meta.shape)
    if depth == 0 or node.op not in ("call_function", "call_method") or not node.all_input_nodes:
        return None
    fakes = {a: _fake(a, depth - 1) for a in node.all_input_nodes}
    if any(f is None for f in fakes.values()):
        return None
    args, kwargs = map_arg(node.args, fakes.__getitem__), map_arg(node.kwargs, fakes.__getitem__)
    try:  # (rules record methods, x.reshape(...); normalize makes them functions later)
        fn = node.target if node.op == "call_function" else getattr(args[0], node.target)
        out = fn(*(args if node.op == "call_function" else args[1:]), **kwargs)
    except Exception:  # not an op that runs on meta tensors: unknown
        return None
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


def _fake(node: Node, depth: int) -> Any:
    """A meta tensor of ``node``'s shape; for a size read (``x.size(1)``, which the
    per-channel checks of a decomposed batch_norm take), the size; None if unknown."""
    if node.op == "call_method" and node.target == "size" and len(node.args) == 2 \
            and type(node.args[1]) is int and isinstance(node.args[0], Node):
        shape = _node_shape(node.args[0], depth)
        return shape[node.args[1]] if shape is not None else None
    shape = _node_shape(node, depth)
    return torch.empty(shape, device="meta") if shape is not None else None


def _count(x: Any, dims: tuple[int, ...]) -> Any:
    """How many elements ``dims`` hold, read from ``x`` when the graph runs.

    Why not the traced shape: a compiled graph is reused for other sizes of the same rank,
    so a literal count would be wrong after a resize.
    """
    if not dims:  # a 0-d tensor: one element
        return 1
    x = _same_shape_source(x)
    n = None
    for d in dims:
        size = x.size(d)
        n = size if n is None else n * size
    return n


def _row_max(x: Any, dim: int) -> Any:
    """``amax(x, dim, keepdim=True)`` for softmax: marked ``empty_ok``, because softmax
    over an empty dim is empty where amax would raise (kernels skip the check for it, and
    the pipeline runs it as ``amax_or_empty`` where it stays out of kernels)."""
    m = torch.amax(x, dim, keepdim=True)
    m.node.meta["empty_ok"] = True
    return m


def _empty_dim(x: Any, dim: Any) -> bool:
    shape = _shape(x)
    return isinstance(dim, int) and bool(shape) and -len(shape) <= dim < len(shape) and \
        shape[dim] == 0


@register_decomposition(torch.softmax)
def _softmax(x: Any, dim: Any = None, dtype: Any = None) -> Any:
    # exp(x - max) / sum(exp(x - max)): the max keeps exp from overflowing
    src = dtype if dtype is not None else _dtype(x)
    if dim is None or src is None or _empty_dim(x, dim):  # amax of nothing has no value
        return NotImplemented
    source = x
    if dtype is not None:
        x = x.to(dtype)
    x, out = _opmath(x, src)
    e = torch.exp(x - _row_max(x, dim))
    return _eager_layout(_back(e / torch.sum(e, dim, keepdim=True), out), source)


@register_decomposition(torch.log_softmax)
def _log_softmax(x: Any, dim: Any = None, dtype: Any = None) -> Any:
    # (x - max) - log(sum(exp(x - max)))
    src = dtype if dtype is not None else _dtype(x)
    if dim is None or src is None or _empty_dim(x, dim):
        return NotImplemented
    source = x
    if dtype is not None:
        x = x.to(dtype)
    x, out = _opmath(x, src)
    shifted = x - _row_max(x, dim)
    y = shifted - torch.log(torch.sum(torch.exp(shifted), dim, keepdim=True))
    return _eager_layout(_back(y, out), source)


@register_decomposition(F.layer_norm)
def _layer_norm(x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
                eps: float = 1e-5) -> Any:
    # (x - mean) * rsqrt(var + eps) * weight + bias, over the trailing normalized_shape dims
    # (halves: all of it in fp32, weight and bias included, rounded once at the end)
    dims = _last_dims(normalized_shape)
    src = _dtype(x)
    if dims is None or src is None:
        return NotImplemented
    n = _norm_count(x, dims, normalized_shape)
    source = x
    x, out = _opmath(x, src)
    centered = x - torch.sum(x, dims, keepdim=True) / n
    var = torch.sum(centered * centered, dims, keepdim=True) / n
    y = centered * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return _eager_layout(_back(y, out), source)


@register_decomposition(F.rms_norm)
def _rms_norm(x: Any, normalized_shape: Any, weight: Any = None, eps: Any = None) -> Any:
    # x * rsqrt(mean(x * x) + eps) * weight, in fp32 for halves; eps defaults to the machine
    # epsilon of the dtype it computes in (fp32's for halves, as eager's kernel has it)
    dims = _last_dims(normalized_shape)
    src = _dtype(x)
    if dims is None or src is None:
        return NotImplemented
    n = _norm_count(x, dims, normalized_shape)
    x, out = _opmath(x, src)
    if eps is None:
        eps = torch.finfo(torch.float32 if out is not None else src).eps
    y = x * torch.rsqrt(torch.sum(x * x, dims, keepdim=True) / n + eps)
    return _back(y * weight if weight is not None else y, out)


@register_decomposition(F.gelu)
def _gelu(x: Any, approximate: str = "none") -> Any:
    if approximate not in ("none", "tanh"):
        return NotImplemented
    x, out = _opmath(x, _dtype(x))  # halves: fp32, as eager; unknown dtype: as it comes
    if approximate == "tanh":
        # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))
        inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
        return _back(x * 0.5 * (torch.tanh(inner) + 1), out)
    # 0.5 * x * (1 + erf(x / sqrt(2)))
    return _back(x * 0.5 * (torch.erf(x * (1.0 / math.sqrt(2.0))) + 1), out)


@register_decomposition(F.silu)
def _silu(x: Any, inplace: bool = False) -> Any:
    # x * sigmoid(x)
    x, out = _opmath(x, _dtype(x))
    return _back(x * torch.sigmoid(x), out)


def _var_parts(x: Any, dim: Any, correction: Any, keepdim: bool) -> Any:
    # sum((x - mean)**2) / (n - correction), n the number of reduced elements
    shape = _shape(x)
    dims = _dims(dim, len(shape)) if shape is not None else None
    if dims is None or not isinstance(correction, (int, float)) or isinstance(correction, bool):
        return NotImplemented
    n = _count(x, dims)
    x, out = _opmath(x, _dtype(x))
    # the mean's own gradient term is 0 (the centred values sum to 0), so it is cut from
    # autograd: differentiated, it would spread a row's NaN (x - inf) over the whole row
    centered = x - (torch.sum(x, dims, keepdim=True) / n).detach()
    # divided by max(n - correction, 0), as torch does; n is only known when the graph runs
    denominator = x.tracer.create_proxy("call_function", _nonnegative, (n - correction,), {})
    return torch.sum(centered * centered, dims, keepdim=keepdim) / denominator, out


@register_decomposition(torch.var)
def _var(x: Any, dim: Any = None, correction: Any = 1, keepdim: bool = False) -> Any:
    parts = _var_parts(x, dim, correction, keepdim)
    return parts if parts is NotImplemented else _back(*parts)


@register_decomposition(torch.std)
def _std(x: Any, dim: Any = None, correction: Any = 1, keepdim: bool = False) -> Any:
    # sqrt(var), written so that its gradient is 0 where std is 0, as eager's std_backward
    # has it (sqrt's own is g / 0 there, and NaN once multiplied by the centred zeros)
    parts = _var_parts(x, dim, correction, keepdim)
    if parts is NotImplemented:
        return parts
    var, out = parts
    zero = var == 0
    return _back(torch.where(zero, 0.0, torch.sqrt(torch.where(zero, 1.0, var))), out)


@register_decomposition(torch.mean)
def _mean(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    # sum(x) / n
    shape = _shape(x)
    dims = _dims(dim, len(shape)) if shape is not None else None
    if dims is None:
        return NotImplemented
    src = dtype if dtype is not None else _dtype(x)
    if src is None or not src.is_floating_point:
        return NotImplemented  # torch.mean rejects integer tensors; let it say so
    n = _count(x, dims)
    if dtype is not None:
        x = x.to(dtype)
    x, out = _opmath(x, src)
    return _back(torch.sum(x, dims, keepdim=keepdim) / n, out)


# ---------------------------------------------------------------------- extern ops
@register_decomposition(F.batch_norm)
def _batch_norm(x: Any, running_mean: Any, running_var: Any, weight: Any = None,
                bias: Any = None, training: Any = False, momentum: Any = 0.1,
                eps: Any = 1e-5) -> Any:
    # eval mode: (x - mean) * rsqrt(var + eps) * weight + bias, per channel (dim 1);
    # halves compute in fp32, as eager's kernel
    shape, src = _shape(x), _dtype(x)
    if training is not False or running_mean is None or running_var is None or shape is None \
            or len(shape) < 2 or src is None or type(eps) not in (int, float) \
            or shape[1] == 0:  # no channels: eager ignores the statistics' length
        return NotImplemented
    # Per channel: (C,) -> (C, 1, ...), checked against x's channels when the graph runs
    # (eager raises on another length, and returns an input without channels as it is).
    channels = _same_shape_source(x).size(1)
    per = {what: x.tracer.create_proxy("call_function", per_channel,
                                       (t, channels, len(shape), what), {})
           for what, t in (("running_mean", running_mean), ("running_var", running_var),
                           ("weight", weight), ("bias", bias)) if t is not None}  # eager's order
    source = x
    x, out = _opmath(x, src)
    y = (x - per["running_mean"]) * torch.rsqrt(per["running_var"] + eps)
    if weight is not None:
        y = y * per["weight"]
    if bias is not None:
        y = y + per["bias"]
    return _eager_layout(_back(y, out), source, keeps_channels_last=True)


_FUSIBLE_KINDS = ("pointwise", "reduction", "composite")


def _feeds_kernels(node: Node, gm: GraphModule) -> bool:
    """Every user of ``node`` can join a kernel (through a permute or transpose, too).

    Why: a bias split off a matmul or conv is worth it only when the add joins a kernel
    that runs anyway; an add that stays alone costs one more pass over the result.
    """
    if not node.users:
        return False
    for user in node.users:
        info = lookup(user, gm)
        if info is None or is_impure(user, gm):
            return False
        if info.name in ("permute", "transpose"):
            if not _feeds_kernels(user, gm):
                return False
        elif info.kind not in _FUSIBLE_KINDS:
            return False
    return True


@register_decomposition(F.linear, when=_feeds_kernels)
def _linear(x: Any, weight: Any, bias: Any = None) -> Any:
    # linear(x, w, b) -> linear(x, w) + b: the bias add joins the next kernel. Not in 16-bit
    # floats: the matmul would round before the add, which eager's addmm makes in float32
    # (a bfloat16 LayerNorm after it then differed from eager by twice eager's error).
    if bias is None or _dtype(x) in (torch.float16, torch.bfloat16):
        return NotImplemented
    return F.linear(x, weight) + bias


def _conv_rule(conv: Callable[..., Any], spatial: int) -> Rule:
    def rule(x: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
             dilation: Any = 1, groups: Any = 1) -> Any:
        # conv(x, w, b) -> conv(x, w) + b per channel: the bias add joins the next kernel
        if bias is None:
            return NotImplemented
        y = conv(x, weight, None, stride, padding, dilation, groups)
        return y + bias.reshape((-1,) + (1,) * spatial)
    rule.__name__ = f"_{conv.__name__}"
    return rule


for _conv, _spatial in ((F.conv1d, 1), (F.conv2d, 2), (F.conv3d, 3)):
    register_decomposition(_conv, when=_feeds_kernels)(_conv_rule(_conv, _spatial))
