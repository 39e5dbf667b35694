"""The rule table of ``decompose`` (see its docstring) and its default rules: softmax,
log_softmax, the norms, gelu, silu, var, std, mean, eval-mode batch_norm, the bias of
linear and conv, the aten backward ops of relu and gelu (AOTAutograd's graphs), and
``scaled_dot_product_attention`` where eager takes PyTorch's math path, and a ``pad`` by
nothing where its copy cannot be told from its input.

:data:`DECOMPOSITIONS` is keyed by op name, and holds every default rule once this module
is imported (``fxlite.passes.decompose`` imports it and re-exports the table). Helpers
here read the ShapeProp metadata of a rule's inputs; :func:`per_channel` is the graph call
that shapes batch-norm statistics, here and in training-mode batch norm
(``codegen/lower/batch_norm.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from fxlite.graph_module import GraphModule
from fxlite.node import Node, describe_value, map_arg
from fxlite.ops import is_impure, lookup, lookup_target, promote, resolve, result_dtype
from fxlite.proxy import Proxy

from .functionalize import recorded_requires_grad

__all__ = ["DECOMPOSITIONS", "Rule", "decomposition_key", "per_channel", "register_decomposition"]


# ---------------------------------------------------------------------- the rule table
Rule = Callable[..., Any]
DECOMPOSITIONS: dict[Any, Rule] = {}  # op name (or a function the op table lacks) -> rule


def register_decomposition(target: Callable[..., Any],
                           table: dict[Any, Rule] | None = None, *,
                           when: Callable[[Node, GraphModule], bool] | None = None
                           ) -> Callable[[Rule], Rule]:
    """Decorator: make the decorated function the rule for ``target``'s op.

    Args:
        target: any spelling of the op (``F.gelu``, ``torch.softmax``); the rule is stored
            under the op's name (``"gelu"``, ``"softmax"``: :func:`decomposition_key`).
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
    if not callable(target):
        raise TypeError(f"register_decomposition: target must be the op to decompose (a function "
                        f"such as torch.relu), not {describe_value(target)}")
    if table is not None and not isinstance(table, dict):
        raise TypeError(f"register_decomposition: table must be a dict or None (the default "
                        f"DECOMPOSITIONS), not {describe_value(table)}")
    if when is not None and not callable(when):
        raise TypeError(f"register_decomposition: when must be a function (node, gm) -> bool or "
                        f"None, not {describe_value(when)}")

    def decorator(rule: Rule) -> Rule:
        if not callable(rule):
            raise TypeError(f"register_decomposition: the decorated rule must be a function, not "
                            f"{describe_value(rule)}")
        if when is not None:
            rule.when = when  # type: ignore[attr-defined]
        (DECOMPOSITIONS if table is None else table)[decomposition_key(target)] = rule
        return rule
    return decorator


def decomposition_key(target: Any) -> Any:
    """The key of ``target``'s rules in a rule table: the name of its op in
    ``fxlite.ops.OPS`` for any spelling of it (``F.softmax`` and ``torch.softmax`` give
    ``"softmax"``), else ``target`` itself (an op name, or a function the table lacks)."""
    info = lookup_target(target)
    return info.name if info is not None else target


def per_channel(values: torch.Tensor, channels: int, rank: int, what: str) -> torch.Tensor:
    """``values`` (one per channel) as ``(C, 1, ...)``, to broadcast against an input of
    ``rank`` dims with ``channels`` channels (dim 1); checked as eager checks them.

    Why a call in the graph: a compiled graph is reused for other sizes. Eager raises when
    the lengths differ, except for an input without channels, which it returns whatever
    the statistics' length: then the values are an empty view, so the math gives the empty
    result (a plain reshape broadcasts a length-1 input against them, or raises on 0).
    """
    if values.numel() != channels:
        if channels != 0:
            raise RuntimeError(f"{what} should contain {channels} elements not {values.numel()}")
        values = values[:0]
    # sizes as separate arguments: torch parses them in about half the host time of one
    # tuple (resnet50 makes 212 of these calls each time it runs)
    return values.reshape(*_SHAPES[rank]) if rank in _SHAPES else values.reshape(
        (-1,) + (1,) * (rank - 2))


_SHAPES = {rank: (-1,) + (1,) * (rank - 2) for rank in range(2, 6)}


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


def _needs_grad(x: Any) -> bool:
    """Whether ``x`` (a Proxy) held a tensor that requires grad when it was recorded.

    An activation with a rule of its own in ``fxlite/ops/derivatives.py`` (silu, gelu)
    then stays whole: autograd differentiating ``x * sigmoid(x)`` by the product rule
    gives ``g s + g x s (1 - s)``, which is ``inf - inf`` (NaN) where eager's
    ``g s (1 + x (1 - s))`` is an infinity (an infinite incoming gradient at x < 0; fuzz
    seed 9304060). The kernel computes the op whole as well.
    """
    return isinstance(x, Proxy) and recorded_requires_grad(x.node)


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
    # Cut from autograd: softmax does not change when its row is shifted, so the max's
    # gradient is 0; differentiated, it is ``sum(g) / count * (x == max)``, and an
    # infinite ``g`` made it inf * 0 = NaN at every other element of the row, where
    # eager's softmax backward gives inf (fuzz seed 10170212)
    return m.detach()


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
    source = x
    x, out = _opmath(x, src)
    if eps is None:
        eps = torch.finfo(torch.float32 if out is not None else src).eps
    y = x * torch.rsqrt(torch.sum(x * x, dims, keepdim=True) / n + eps)
    # eager's kernel keeps a channels-last input's layout and makes others row-major
    y = _back(y * weight if weight is not None else y, out)
    return _eager_layout(y, source, keeps_channels_last=True)


@register_decomposition(F.gelu)
def _gelu(x: Any, approximate: str = "none") -> Any:
    if approximate not in ("none", "tanh") or _needs_grad(x):
        return NotImplemented
    x, out = _opmath(x, _dtype(x))  # halves: fp32, as eager; unknown dtype: as it comes
    if approximate == "tanh":
        # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))
        inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
        return _back(x * 0.5 * (torch.tanh(inner) + 1), out)
    # 0.5 * x * (1 + erf(x / sqrt(2)))
    return _back(x * 0.5 * (torch.erf(x * (1.0 / math.sqrt(2.0))) + 1), out)


# The backward ops of AOTAutograd's graphs (``backend="fxlite_aot"``), which have no record
# in the op table: their rules are keyed by the aten overload itself.
@register_decomposition(torch.ops.aten.threshold_backward.default)
def _threshold_backward(grad: Any, x: Any, threshold: Any) -> Any:
    # relu's backward: the gradient where x > threshold, else 0 (in grad's dtype)
    return torch.where(x <= threshold, 0.0, grad)


@register_decomposition(torch.ops.aten.gelu_backward.default)
def _gelu_backward(grad: Any, x: Any, approximate: str = "none") -> Any:
    if approximate != "none":
        return NotImplemented
    dtype = _dtype(grad)
    x, out = _opmath(x, _dtype(x))
    g, _ = _opmath(grad, dtype)
    # d/dx 0.5 * x * (1 + erf(x / sqrt(2))) = cdf(x) + x * pdf(x)
    cdf = (torch.erf(x * (1.0 / math.sqrt(2.0))) + 1) * 0.5
    pdf = torch.exp(x * x * -0.5) * (1.0 / math.sqrt(2.0 * math.pi))
    return _back(g * (cdf + x * pdf), out)


def _sdpa_arguments(node: Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    return {**dict(zip(names, node.args)), **node.kwargs}


def _on_math_path(node: Node, gm: GraphModule) -> bool:
    """Whether eager runs this ``scaled_dot_product_attention`` on PyTorch's math path,
    asked of torch (``_fused_sdp_choice``) with empty tensors of the recorded layouts and
    device. Only there does the decomposition pay: the math path is separate ops (matmul,
    add, softmax, and the checks of a fully masked row), and a fused attention kernel
    (flash, memory-efficient, cuDNN) is left to run."""
    args, device = _sdpa_arguments(node), node.meta.get("device")

    def empty(value: Any) -> Any:
        tm = value.meta.get("tensor_meta") if isinstance(value, Node) else None
        if tm is None or not hasattr(tm, "stride") or device is None:
            raise LookupError(value)
        t = torch.empty_strided(tm.shape, tm.stride, dtype=tm.dtype, device=device)
        return t.requires_grad_() if tm.requires_grad and t.is_floating_point() else t

    try:
        q, k, v = (empty(args.get(name)) for name in ("query", "key", "value"))
        mask = args.get("attn_mask")
        choice = torch._fused_sdp_choice(
            q, k, v, None if mask is None else empty(mask), args.get("dropout_p", 0.0),
            args.get("is_causal", False), scale=args.get("scale"),
            enable_gqa=args.get("enable_gqa", False))
    except Exception:  # a layout not recorded, a traced argument, an older torch: leave it
        return False
    return choice == SDPBackend.MATH.value


def _row_major(x: Any, source: Any) -> Any:
    """``x`` (``source`` or its fp32 copy) made row-major where ``source`` is not, as a
    heads' view of a projection is: matmul folds the batch dims and would copy it anyway,
    in an eager op; as a clone, the copy joins the cast's kernel (halves) or is one."""
    tm = source.node.meta.get("tensor_meta") if isinstance(source, Proxy) else None
    if tm is None or getattr(tm, "memory_format", None) == torch.contiguous_format:
        return x
    return torch.clone(x, memory_format=torch.contiguous_format)


def _default_scale(head_dim: int) -> float:
    """``1 / sqrt(E)``, SDPA's scale when none is given (E is read when the graph runs)."""
    return 1.0 / math.sqrt(head_dim)


@register_decomposition(F.scaled_dot_product_attention, when=_on_math_path)
def _scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                  dropout_p: Any = 0.0, is_causal: Any = False,
                                  scale: Any = None, enable_gqa: Any = False) -> Any:
    # softmax(q @ k^T * scale + mask) @ v, where eager takes PyTorch's math path (a float
    # bias such as T5's, a mask with strides the fused kernels refuse): as that path does,
    # halves compute in fp32, a boolean mask keeps the scores where it is True, and a row
    # masked whole gives zeros, not NaN (_safe_softmax). The scale, mask and softmax then
    # fuse into one kernel between the two matmuls. Dropout, causal and GQA calls are left.
    if type(dropout_p) not in (int, float) or dropout_p != 0 or is_causal is not False \
            or enable_gqa is not False:
        return NotImplemented
    dtype, keys = _dtype(query), _shape(key)
    if dtype is None or not keys or keys[-2] == 0 or {_dtype(key), _dtype(value)} != {dtype} \
            or attn_mask is not None and _dtype(attn_mask) is None:  # bool or float: unknown
        return NotImplemented
    q, out = _opmath(query, dtype)
    k, v = (_row_major(_opmath(x, dtype)[0], x) for x in (key, value))
    q = _row_major(q, query)
    if scale is None:
        scale = query.tracer.create_proxy("call_function", _default_scale, (query.size(-1),), {})
    attn = torch.matmul(q, k.transpose(-2, -1))
    if not (type(scale) in (int, float) and scale == 1):  # T5's scale is 1
        attn = attn * scale
    if attn_mask is not None:
        attn = torch.where(attn_mask, attn, -math.inf) if _dtype(attn_mask) is torch.bool \
            else attn + attn_mask
    # a row masked whole has max -inf: shifted by 0 instead, its exps are 0 and so is its
    # sum, which becomes 1, so its probabilities are 0, with gradients 0 and not NaN
    top = _row_max(attn, -1)
    e = torch.exp(attn - torch.where(top == -math.inf, 0.0, top))
    total = torch.sum(e, -1, keepdim=True)
    probs = e / torch.where(total == 0, 1.0, total)
    return _back(torch.matmul(probs, v), out)


def _pads_nothing(node: Node, gm: GraphModule) -> bool:
    """Whether this ``F.pad`` adds nothing and may return its input itself: zero pads, a
    row-major input (the copy would be row-major too), no write anywhere in the graph (so
    no one can tell an alias from a copy), and the result not returned, itself or through a
    view (the caller would get an alias where eager gives a copy)."""
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    source = node.args[0] if node.args else None
    tm = source.meta.get("tensor_meta") if isinstance(source, Node) else None
    if not isinstance(pad, (list, tuple)) or any(type(p) is not int or p for p in pad) or \
            getattr(tm, "memory_format", None) != torch.contiguous_format:
        return False
    if any(n.op in ("call_function", "call_method", "call_module")
           and is_impure(n, gm, impure_random=False) for n in gm.graph.nodes):
        return False
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                return False
            info = lookup(user, gm)
            if user not in seen and (info is None or info.kind == "view"):
                seen.add(user)
                todo.append(user)
    return True


@register_decomposition(F.pad, when=_pads_nothing)
def _pad_nothing(x: Any, pad: Any, mode: str = "constant", value: Any = None) -> Any:
    # F.pad(x, (0, 0, 0, 0)) copies x (Swin pads each block's input by what its windows
    # need, often nothing): where no one can tell, x itself
    return x


@register_decomposition(torch.round)
def _round_decimals(x: Any, decimals: Any = 0) -> Any:
    # round(x, decimals=d): rint(x * 10**d) / 10**d, or rint(x / 10**-d) * 10**-d for d < 0,
    # in the op's math dtype with 10**d in it, as eager's kernel computes
    dtype = _dtype(x)
    if type(decimals) is not int or decimals == 0 or dtype not in (
            torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return NotImplemented
    x, out = _opmath(x, dtype)
    scale = float(10 ** abs(decimals))
    y = torch.round(x * scale) / scale if decimals > 0 else torch.round(x / scale) * scale
    return _back(y, out)


@register_decomposition(F.silu)
def _silu(x: Any, inplace: bool = False) -> Any:
    # x * sigmoid(x)
    if _needs_grad(x):
        return NotImplemented  # the product rule's gradient is not eager's: see _needs_grad
    x, out = _opmath(x, _dtype(x))
    return _back(x * torch.sigmoid(x), out)


def _var_parts(x: Any, dim: Any, correction: Any, keepdim: bool) -> Any:
    # (sum(c**2) - sum(c)**2 / n) / (n - correction), c = x - mean, n the number of
    # reduced elements: the corrected two-pass sum, whose second term takes out the
    # rounding of the mean. A constant row's mean can miss its value by an ulp, and
    # sum(c**2) alone then made its std a tiny positive number, whose gradient, eager's
    # 0 there, came out near 1 / sqrt(n) (fuzz seed 8732652)
    shape = _shape(x)
    dims = _dims(dim, len(shape)) if shape is not None else None
    if dims is None or not isinstance(correction, (int, float)) or isinstance(correction, bool):
        return NotImplemented
    n = _count(x, dims)
    if (dim is None or len(shape) == 0) and all(type(s) is int for s in shape) \
            and math.prod(shape) - correction <= 0:
        # no degree of freedom left in a var of the whole tensor: eager's gradient has a
        # case of its own there (fxlite/ops/derivatives.py, _var_grad), which the op keeps
        return NotImplemented
    x, out = _opmath(x, _dtype(x))
    # the mean's own gradient term is 0 (the centred values sum to 0), so it is cut from
    # autograd: differentiated, it would spread a row's NaN (x - inf) over the whole row
    centered = x - (torch.sum(x, dims, keepdim=True) / n).detach()
    # divided by max(n - correction, 0), as torch does; n is only known when the graph runs
    denominator = x.tracer.create_proxy("call_function", _nonnegative, (n - correction,), {})
    total = torch.sum(centered, dims, keepdim=keepdim)
    # (at least 0: the difference of two roundings may fall below it; the correction cut
    # from autograd as the mean is, whose NaN for a row holding an inf it would spread)
    squares = torch.sum(centered * centered, dims, keepdim=keepdim) - (total * total / n).detach()
    squares = torch.where(squares < 0, 0.0, squares)  # (NaN passes, with its gradient)
    return squares / denominator, out


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
    return _back(_sqrt_zero_at_zero(var), out)


def _sqrt_zero_at_zero(v: Any) -> Any:
    """sqrt(v), written so that its gradient is 0 where v is 0, as eager's std and norm
    backwards give (sqrt's own is g / 0 there)."""
    zero = v == 0
    return torch.where(zero, 0.0, torch.sqrt(torch.where(zero, 1.0, v)))


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


def _multiply_add(divide: bool) -> Rule:
    def rule(input: Any, tensor1: Any, tensor2: Any, value: Any = 1) -> Any:
        # input + value * (tensor1 * tensor2), or (tensor1 / tensor2): each operand cast to
        # the common dtype first (a 0-dim float32 beside bfloat16 tensors is rounded, as
        # TensorIterator does), computed in its math dtype and rounded once, as eager's
        # kernel does
        operands = (input, tensor1, tensor2)
        if not all(isinstance(t, Proxy) for t in operands):
            return NotImplemented
        common = promote([_operand(t.node, 8) for t in operands])
        if common is None or not common.is_floating_point:
            return NotImplemented  # integer addcmul is rare; addcdiv's is an error
        math_dtype = torch.float32 if common in _HALVES else common

        def cast(t: Any) -> Any:
            t = t if _dtype(t) == common else t.to(common)
            return t if math_dtype == common else t.to(math_dtype)
        a, b, c = (cast(t) for t in operands)
        b = _spread(b, operands)  # (the casts have no shapes yet: the operands' sizes)
        y = b / c if divide else b * c
        if isinstance(value, Proxy) or value != 1:
            y = value * y if divide else (value * b) * c
        return _back(a + y, common if common in _HALVES else None)
    rule.__name__ = "_addcdiv" if divide else "_addcmul"
    return rule


def _spread(t: Any, operands: tuple[Any, ...]) -> Any:
    """``t`` expanded to the shape all ``operands`` broadcast to, where the input alone
    makes it larger than the product's: eager's backward multiplies the cotangent by the
    other factor at that shape and then sums (an infinite factor and cotangents of both
    signs give NaN there), where a product of the smaller shape would be summed first
    (fuzz seed 9860897). The sizes are read from the operands, not written."""
    shapes = [_shape(o) for o in operands]
    if any(s is None for s in shapes):
        return t
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + s for s in shapes]
    # a dim broadcasts to the size of the operands that are not 1 there (0 beside 1 is 0,
    # fuzz seeds 10056018 and 10072336), else 1
    wide = [[j for j, p in enumerate(padded) if p[i] != 1] for i in range(rank)]
    if all(not w or any(j > 0 for j in w) for w in wide) \
            and max(len(s) for s in shapes[1:]) == rank:
        return t  # the product has the result's shape already
    sizes = [operands[w[0]].size(i - (rank - len(shapes[w[0]]))) if w else 1
             for i, w in enumerate(wide)]
    return t.expand(*sizes)


register_decomposition(torch.addcmul)(_multiply_add(divide=False))
register_decomposition(torch.addcdiv)(_multiply_add(divide=True))


@register_decomposition(torch.linalg.vector_norm)
def _vector_norm(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False,
                 dtype: Any = None) -> Any:
    # the 2-norm: sqrt(sum(x * x)) in the op's math dtype; its gradient is 0 where the norm
    # is 0, as eager's norm_backward has it (sqrt's own is g / 0 there)
    shape, src = _shape(x), _dtype(x)
    if type(ord) not in (int, float) or ord != 2 or dtype is not None or shape is None \
            or src is None or not src.is_floating_point:
        return NotImplemented
    dims = tuple(range(len(shape))) if isinstance(dim, (list, tuple)) and not dim else \
        _dims(dim, len(shape))
    if dims is None:
        return NotImplemented
    x, out = _opmath(x, src)
    return _back(_sqrt_zero_at_zero(torch.sum(x * x, dims, keepdim=keepdim)), out)


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
    that runs anyway; an add that stays alone costs one more pass over the result. A read
    of its size is no use of its values (a decomposed batch_norm checks the channels; such
    a read of the add goes back to its operands, see ``size_sources``).
    """
    if not node.users:
        return False
    for user in node.users:
        if user.op == "call_method" and user.target in ("size", "dim") and user.args[0] is node:
            continue
        info = lookup(user, gm)
        if info is None or is_impure(user, gm):
            return False
        if info.name in ("permute", "transpose"):
            if not _feeds_kernels(user, gm):
                return False
        elif info.kind not in _FUSIBLE_KINDS:
            return False
    return True


def _splits_bias(node: Node, gm: GraphModule) -> bool:
    """Whether a linear's or conv's bias may become an add after a bias-free call: every
    user joins a kernel (:func:`_feeds_kernels`) and the call gives its bias's dtype.

    Why: under autocast a linear or conv of float32 tensors runs in bfloat16, its bias
    cast too; an add split off it added the float32 bias and gave float32 where eager
    gives bfloat16 (fuzz_train seed 500128).
    """
    found = resolve(node, gm)
    bias = found[1].get("bias") if found is not None else None
    if isinstance(bias, Node) and _node_dtype(bias, 8) != _node_dtype(node, 8):
        return False
    return _feeds_kernels(node, gm)


@register_decomposition(F.linear, when=_splits_bias)
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
    register_decomposition(_conv, when=_splits_bias)(_conv_rule(_conv, _spatial))
