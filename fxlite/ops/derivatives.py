"""Derivative rules: :data:`VJP`, keyed by op name, one rule per differentiable op.

A rule is the op's vector-Jacobian product written with table ops, as autodidax keeps
its transpose rules next to each primitive. It gets the cotangent ``g`` of the op's
result, the op's canonical arguments ``a`` (``fxlite.ops.canonical_args``: a
:class:`~fxlite.proxy.Proxy` for every tensor, plain Python values otherwise) and the
result ``out``, and returns the cotangents of its tensor parameters by name::

    "mul": lambda g, a, out: {"input": g * a["other"], "other": g * a["input"]}

Running a rule on Proxies records the backward nodes (the compiler's
``fxlite.codegen.lower.autodiff`` does that).
What rules leave to autodiff:

* **broadcasting**: a rule may return a cotangent larger than its parameter (``g * y``
  for a bias of shape ``(D,)``); autodiff sums it down to the parameter's shape;
* **dtype casts**: cotangents are cast to their parameter's dtype (``x.half() * w``);
* **which grads are needed**: a rule returns every cotangent; the unused ones are dead
  code, and only what the needed ones read from the forward is saved or recomputed.

``g`` always has the rank of ``out`` (size-1 dims where it is broadcast), so reduction
rules may unsqueeze it at the reduced dims. Rules start from ``g`` (``g * o * o``, not
``g * (o * o)``): an op on saved row values alone would be a kernel of its own. Rules that need an element count read sizes
from the forward (``x.size(d)``): Python ints, which the forward computes and saves.

Two markers stand for rules without a formula: :data:`ZERO` (piecewise-constant ops such
as ``floor``: their gradient is a tensor of zeros, as eager's) and ops absent from :data:`VJP`
(``floor_divide``, whose derivative eager does not implement either), which autodiff
refuses. Ops with bool or integer results (comparisons, ``isnan``, bitwise ops) carry
no gradient and need no rule.

Ties follow eager: ``amax``/``amin`` split the gradient evenly among the maxima,
``maximum``/``minimum`` halve it on ties, ``relu``'s gradient at 0 is 0, ``clamp`` passes
it at the bounds and ``hardtanh`` does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fxlite.ops.dropout import seeded_dropout
from fxlite.proxy import Proxy
from fxlite.tensor_meta import MEMORY_FORMATS, reduced_dims

__all__ = ["VJP", "ZERO", "expand_reduced", "reduced_dims"]

Rule = Callable[[Any, dict[str, Any], Any], dict[str, Any]]


def ZERO(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    """The rule of a piecewise-constant op: its gradient is zero everywhere, as a tensor of
    zeros, which eager's backward passes on too: the rules before it then compute with it,
    and give NaN where eager's do (``x.amax().floor()`` of a row holding a NaN: amax's
    rule divides the zeros by a count of 0 maxima)."""
    return {"input": torch.zeros_like(g)}


def _no_gradient(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    """``detach``'s rule: its input gets no gradient at all (not zeros)."""
    return {}


# ---------------------------------------------------------------------- helpers
def _rank(p: Any) -> int:
    return len(p.node.meta["tensor_meta"].shape)


def _dtype(p: Any) -> torch.dtype:
    return p.node.meta["tensor_meta"].dtype


def _scale(g: Any, c: Any) -> Any:
    return g if type(c) in (int, float) and c == 1 else g * c


def _tensor(v: Any) -> bool:
    return isinstance(v, Proxy)


def expand_reduced(g: Any, a: dict[str, Any], rank: int) -> Any:
    """``g`` of a reduction's result, given the rank of its input (unsqueezed if needed).

    Broadcasting then spreads it over the reduced dims; no sizes are needed.
    """
    if a.get("keepdim", False):
        return g
    for d in reduced_dims(a.get("dim"), rank):
        g = g.unsqueeze(d)
    return g


def _count(x: Any, dims: tuple[int, ...]) -> Any:
    """How many elements ``dims`` of ``x`` hold: a product of sizes read from the forward."""
    n: Any = None
    for d in dims:
        n = x.size(d) if n is None else n * x.size(d)
    return 1 if n is None else n


def _between(x: Any, low: Any, high: Any, g: Any) -> Any:
    # g where low < x < high (strictly), else 0 (NaN too): hardsigmoid
    return torch.where(torch.logical_and(x > low, x < high), g, 0.0)


def _not_outside(x: Any, low: Any, high: Any, g: Any) -> Any:
    # 0 where x <= low or x >= high, else g: hardtanh and relu6, whose eager backward
    # passes the gradient of a NaN input on (no comparison with NaN holds). So do CUDA's
    # kernel and the CPU kernel's scalar loop; its vectorized loop gives 0 there, so on
    # the CPU eager's own answer depends on where the NaN sits (a NaN among the first 16
    # of 24 elements gets 0, one in the last 8 gets g: fuzz seeds 8039568, 8042476,
    # 8047160). This rule gives g everywhere.
    return torch.where(torch.logical_or(x <= low, x >= high), 0.0, g)


# ---------------------------------------------------------------------- arithmetic
def _truediv(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    if a.get("rounding_mode") is not None:  # floor/trunc division: piecewise constant,
        zeros = torch.zeros_like(g)           # zeros to each tensor operand, as eager's
        return {k: zeros for k in ("input", "other") if _tensor(a.get(k))}
    x, y = a["input"], a["other"]
    # d(x/y)/dy = -x / y**2, as -(g x / y) / y: every op reads g, so none is an op on
    # saved row values alone (a kernel of its own: fuse groups it apart)
    return {"input": g / y, "other": -(g * x / y) / y}


def _pow(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    x, e = a["input"], a["exponent"]
    grads: dict[str, Any] = {}
    if _tensor(x):
        if _tensor(e):  # e * x**(e-1), and 0 where e == 0 (eager's convention)
            grads["input"] = torch.where(e == 0, 0.0, g * e * torch.pow(x, e - 1))
        elif e != 0:
            grads["input"] = g * e * torch.pow(x, e - 1)
    if _tensor(e):
        # out * log(x), and 0 where x == 0 and e >= 0 (where out * log(x) is 0 * -inf);
        # g multiplies the whole, as in eager, so a NaN g stays NaN there too
        if _tensor(x):
            at_zero = torch.logical_and(x == 0, e >= 0)
            grads["exponent"] = g * torch.where(at_zero, 0.0, out * torch.log(x))
        elif x == 0:
            grads["exponent"] = g * torch.where(e >= 0, 0.0, out * -math.inf)
        else:
            grads["exponent"] = g * out * (math.log(x) if x > 0 else math.nan)
    return grads


def _remainder(trunc: bool) -> Rule:
    # x - y * floor(x / y) (fmod: trunc): d/dx = 1, d/dy = -(x // y), as eager divides:
    # its floor division gives NaN for an infinite x, where floor(x / y) gives inf
    mode = "trunc" if trunc else "floor"

    def rule(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
        return {"input": g, "other": -g * torch.div(a["input"], a["other"], rounding_mode=mode)}
    return rule


def _clamp(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # The input's gradient passes where min <= x <= max (inclusive, as eager); a tensor
    # bound gets it where it is the one that clamped (max wins when min > max).
    x, lo, hi = a["input"], a.get("min"), a.get("max")
    keep = None
    if lo is not None:
        keep = x >= lo
    if hi is not None:
        keep = x <= hi if keep is None else torch.logical_and(keep, x <= hi)
    grads = {"input": g if keep is None else torch.where(keep, g, 0.0)}
    if _tensor(lo):
        below = x < lo if hi is None else torch.logical_and(x < lo, lo < hi)
        grads["min"] = torch.where(below, g, 0.0)
    if _tensor(hi):
        above = x > hi if lo is None else torch.logical_or(x > hi, hi < lo)
        grads["max"] = torch.where(above, g, 0.0)
    return grads


def _clamp_one(param: str) -> Rule:
    def rule(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
        return _clamp(g, {"input": a["input"], param: a[param]}, out)
    return rule


def _extremum(larger: bool) -> Rule:
    # maximum/minimum: the chosen side gets g; ties split it in half, as eager does
    def rule(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
        x, y = a["input"], a["other"]
        half = torch.where(x == y, g * 0.5, g)
        x_loses, y_loses = (x < y, x > y) if larger else (x > y, x < y)
        return {"input": torch.where(x_loses, 0.0, half), "other": torch.where(y_loses, 0.0, half)}
    return rule


def _where(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    c = a["condition"]
    return {"input": torch.where(c, g, 0.0), "other": torch.where(c, 0.0, g)}


# ---------------------------------------------------------------------- activations
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    x = a["input"]
    if a.get("approximate", "none") == "tanh":
        # y = x/2 * (1 + tanh(u)), u = k (x + c x^3):
        # y' = (1 + tanh u)/2 + x/2 * (1 - tanh(u)^2) * k (1 + 3 c x^2)
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        t = torch.tanh((x + x * x * x * c) * k)
        return {"input": g * ((t + 1) * 0.5 + x * 0.5 * (1 - t * t) * ((x * x * (3 * c) + 1) * k))}
    # y = x Phi(x): y' = Phi(x) + x phi(x)
    cdf = (torch.erf(x * _SQRT1_2) + 1) * 0.5
    pdf = torch.exp(x * x * -0.5) * _INV_SQRT_2PI
    return {"input": g * (cdf + x * pdf)}


def _silu(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # (x s)' = s (1 + x (1 - s)), s = sigmoid(x)
    x = a["input"]
    s = torch.sigmoid(x)
    return {"input": g * s * (x * (1 - s) + 1)}


def _softplus(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # log(1 + exp(b x)) / b: sigmoid(b x), and 1 where b x > threshold (the linear branch)
    x, beta, threshold = a["input"], a.get("beta", 1), a.get("threshold", 20)
    bx = _scale(x, beta)
    return {"input": torch.where(bx > threshold, g, g * torch.sigmoid(bx))}


def _mish(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # x tanh(softplus(x)): tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2)
    x = a["input"]
    t = torch.tanh(F.softplus(x))
    return {"input": g * (t + x * torch.sigmoid(x) * (1 - t * t))}


def _elu(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # eager's backward takes the negative branch where x <= 0: a NaN input passes g
    x, alpha = a["input"], a.get("alpha", 1.0)
    return {"input": torch.where(x <= 0, g * torch.exp(x) * alpha, g)}


def _hardswish(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # x relu6(x + 3) / 6: 0 up to -3, x/3 + 1/2 up to 3 (exclusive), then 1
    x = a["input"]
    inner = torch.where(x < 3, g * (x / 3 + 0.5), g)
    return {"input": torch.where(x <= -3, 0.0, inner)}


# ---------------------------------------------------------------------- reductions
def _sum(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    return {"input": expand_reduced(g, a, _rank(a["input"]))}


def _mean(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    x = a["input"]
    dims = reduced_dims(a.get("dim"), _rank(x))
    return {"input": expand_reduced(g, a, _rank(x)) / _count(x, dims)}


def _prod(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # d prod / d x_i is the product of the others. Eager takes it as out / x_i when the
    # input holds no zero at all (NaN at an infinite x_i), and otherwise, for every row,
    # as the exclusive products from both ends multiplied (prod_safe_zeros_backward):
    # NaN where the others hold a NaN or both an inf and a 0, else 0 where they hold a 0,
    # else an inf of their sign where they hold one, else their finite product (fuzz
    # seeds 6065, 8707468). Of the whole input's product (no dim), two zeros or more
    # give zeros (eager's shortcut outside grad mode), even where g is NaN (8512012).
    x = a["input"]
    a = {**a, "dim": a.get("dim")}
    rank = _rank(x)
    dims = reduced_dims(a["dim"], rank)
    g, p = expand_reduced(g, a, rank), expand_reduced(out, a, rank)

    def rows(op: Any, v: Any) -> Any:
        for d in dims:  # torch.prod takes one dim at a time
            v = op(v, d, keepdim=True)
        return v

    def count(mask: Any) -> Any:  # per row, as integers: a 0-d input has no dim to sum,
        return rows(torch.sum, torch.where(mask, 1, 0))  # and bool - 1 raises (9503603)

    def in_others(mask: Any, count: Any) -> Any:  # whether the row's others hold one
        return torch.where(mask, count - 1, count) > 0

    zero, nan, inf = x == 0, torch.isnan(x), torch.isinf(x)
    plain = torch.logical_not(torch.logical_or(zero, torch.logical_or(nan, inf)))
    finite = rows(torch.prod, torch.where(plain, x, 1.0))  # the finite nonzero factors
    signs = rows(torch.prod, torch.where(inf, torch.sign(x), 1.0))  # the infinities' signs
    zeros = count(zero)
    others_zero = in_others(zero, zeros)
    others_nan = in_others(nan, count(nan))
    others_inf = in_others(inf, count(inf))
    rest = torch.where(plain, finite / x, finite)  # the others' finite nonzero factors
    sign = torch.where(inf, signs * torch.sign(x), signs) * torch.where(rest < 0, -1.0, 1.0)
    others = torch.where(others_inf, sign * math.inf, rest)
    others = torch.where(others_zero, 0.0, others)
    others = torch.where(torch.logical_or(others_nan, torch.logical_and(
        others_inf, others_zero)), math.nan, others)
    grad = torch.where(torch.sum(zero) > 0, g * others, g * p / x)
    if a["dim"] is None:  # (zeros, whatever g holds: a NaN gradient too)
        grad = torch.where(zeros > 1, 0.0, grad)
    return {"input": grad}


def _extreme(reduce: Callable[..., Any]) -> Rule:
    # eager splits g evenly among the elements equal to the result (ties)
    def rule(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
        x = a["input"]
        a = {**a, "dim": a.get("dim", ())}
        dims = reduced_dims(a["dim"], _rank(x))
        # the result at x's rank: keepdim=True again rather than an unsqueeze of out, which
        # would be a view inside the forward kernel
        top = out if a.get("keepdim", False) else reduce(x, dims, keepdim=True)
        hit = x == top
        count = torch.sum(hit, dims, keepdim=True)
        return {"input": expand_reduced(g, a, _rank(x)) / count * hit}
    return rule


def _max_all(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any] | Any:
    # torch.max(x) (no dim): g split evenly among the maxima, NaNs counting as the max
    if "dim" in a:
        return NotImplemented  # (values, indices): not a single tensor
    x = a["input"]
    dims = tuple(range(_rank(x)))
    hit = torch.logical_or(x == out, torch.logical_and(torch.isnan(x), torch.isnan(out)))
    return {"input": hit * (g / torch.sum(hit, dims, keepdim=True))}


def _var_grad(g: Any, x: Any, dims: tuple[int, ...], correction: Any, whole: bool) -> Any:
    # d var / dx = 2 (x - mean) / (n - correction). ``whole``: a var of the whole tensor
    # (no dim given, or a 0-dim input), where eager's var_backward has a case of its own
    # for no degree of freedom left (n <= correction): g * inf where x differs from the
    # mean (a NaN does), NaN where it equals it, whatever the sign of x - mean.
    n = _count(x, dims)
    mean = torch.sum(x, dims, keepdim=True) / n
    dof = n - correction
    if whole and isinstance(dof, (int, float)) and dof <= 0:
        return torch.where(x == mean, g * math.nan, g * math.inf)
    # (a runtime Python float would reach the kernel as fp32: divide by the int instead)
    return g * (x - mean) * 2 / dof


def _var(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    x = a["input"]
    dims = reduced_dims(a.get("dim"), _rank(x))
    return {"input": _var_grad(expand_reduced(g, a, _rank(x)), x, dims, a.get("correction", 1),
                               a.get("dim") is None or _rank(x) == 0)}


def _std(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # std = sqrt(var): d var = g / (2 std), and 0 where std == 0 (eager's convention)
    x = a["input"]
    dims = reduced_dims(a.get("dim"), _rank(x))
    std = expand_reduced(out, a, _rank(x))
    g_var = torch.where(std == 0, 0.0, expand_reduced(g, a, _rank(x)) / (std * 2))
    return {"input": _var_grad(g_var, x, dims, a.get("correction", 1),
                               a.get("dim") is None or _rank(x) == 0)}


# ---------------------------------------------------------------------- composites
def _softmax(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # y (g - sum(g y)) over the softmax dim
    return {"input": out * (g - torch.sum(g * out, a["dim"], keepdim=True))}


def _log_softmax(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # g - softmax(x) sum(g)
    return {"input": g - torch.exp(out) * torch.sum(g, a["dim"], keepdim=True)}


def _normalized(x: Any, normalized_shape: Any, center: bool, eps: Any
                ) -> tuple[Any, Any, tuple[int, ...], Any]:
    """(x_hat, rstd, dims, n) of a layer or RMS norm, recomputed from x.

    They read only forward values, so autodiff computes the row statistics in the forward
    kernel and saves them (as eager saves mean and rstd), and recomputes x_hat.
    """
    k = len(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else 1
    dims = tuple(range(_rank(x) - k, _rank(x)))
    n = _count(x, dims)
    if center:
        x = x - torch.sum(x, dims, keepdim=True) / n
    rstd = torch.rsqrt(torch.sum(x * x, dims, keepdim=True) / n + eps)
    return x * rstd, rstd, dims, n


def _norm_backward(g: Any, a: dict[str, Any], center: bool, eps: Any) -> dict[str, Any]:
    x_hat, rstd, dims, n = _normalized(a["input"], a["normalized_shape"], center, eps)
    w = a.get("weight")
    gh = g * w if w is not None else g

    def mean(v: Any) -> Any:
        return torch.sum(v, dims, keepdim=True) / n

    inner = gh - x_hat * mean(gh * x_hat)
    if center:
        inner = inner - mean(gh)
    grads = {"input": inner * rstd, "weight": g * x_hat}
    if "bias" in a:
        grads["bias"] = g
    return grads


def _layer_norm(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    return _norm_backward(g, a, True, a.get("eps", 1e-5))


def _rms_norm(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    eps = a.get("eps")
    return _norm_backward(g, a, False, torch.finfo(_dtype(a["input"])).eps if eps is None else eps)


def _multiply_add(divide: bool) -> Rule:
    def rule(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
        # input + value * t1 * t2 (or t1 / t2): every cotangent reads g first
        t1, t2, gv = a["tensor1"], a["tensor2"], _scale(g, a.get("value", 1))
        if divide:
            return {"input": g, "tensor1": gv / t2, "tensor2": -(gv * t1 / t2) / t2}
        return {"input": g, "tensor1": gv * t2, "tensor2": gv * t1}
    return rule


def _vector_norm(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # the 2-norm: x g / norm, and 0 where the norm is 0, as eager's norm_backward
    ord = a.get("ord", 2)
    if type(ord) not in (int, float) or ord != 2 or a.get("dtype") is not None:
        return NotImplemented
    x = a["input"]
    norm = expand_reduced(out, a, _rank(x))
    return {"input": torch.where(norm == 0, 0.0, expand_reduced(g, a, _rank(x)) / norm) * x}


def _seeded_dropout(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # The same mask and scale, regenerated from the seed: nothing but the seed is saved.
    # The mask is indexed by element, so g must have out's full shape (sizes read from x).
    x = a["input"]
    if tuple(g.node.meta["tensor_meta"].shape) != tuple(out.node.meta["tensor_meta"].shape):
        g = g.expand(*(x.size(d) for d in range(_rank(x))))
    call = (g, a["p"], a["seed"], a.get("offset", 0))
    return {"input": g.tracer.create_proxy("call_function", seeded_dropout, call, {})}


# ---------------------------------------------------------------------- matmuls
def _linear(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # y = x @ w.T + b over x's leading dims: the weight's gradient is one matmul of g and x
    # flattened to rows (g.T @ x), as eager's addmm backward computes it; the bias's is g,
    # which autodiff sums over the leading dims.
    x, w = a["input"], a["weight"]
    g = _full(g, out)
    rows_g, rows_x = g, x
    if _rank(x) == 1:
        rows_g, rows_x = g.unsqueeze(0), x.unsqueeze(0)
    elif _rank(x) > 2:
        rows_g, rows_x = g.flatten(0, -2), x.flatten(0, -2)
    return {"input": torch.matmul(g, w), "weight": torch.matmul(rows_g.t(), rows_x), "bias": g}


def _addmm(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # beta * input + alpha * (mat1 @ mat2), as transformers' Conv1D calls it: the bias
    # gets beta * g, which autodiff sums over the rows
    g = _full(g, out)
    scaled = _scale(g, a.get("alpha", 1))
    return {"input": _scale(g, a.get("beta", 1)), "mat1": torch.matmul(scaled, a["mat2"].t()),
            "mat2": torch.matmul(a["mat1"].t(), scaled)}


def _full(g: Any, out: Any) -> Any:
    """``g`` expanded to the sizes of ``out`` where it is broadcast (a sum's cotangent
    reaches a linear as ``(1, 1)``): a matmul does not broadcast its reduced dim, and an
    extern op's bias is summed over its rows as they are (autodiff multiplies a broadcast
    cotangent by the rows it spreads over for pointwise ops only)."""
    gs, os = g.node.meta["tensor_meta"].shape, out.node.meta["tensor_meta"].shape
    if tuple(gs) == tuple(os):
        return g
    return g.expand(*(out.size(d) for d in range(len(os))))


# ---------------------------------------------------------------------- views
def _unit_view(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # A view that only inserts or drops size-1 dims: drop out's size-1 dims from g, then
    # insert x's. No sizes are needed, and a g broadcast along some dim stays broadcast.
    # A real reshape (never in a fused group; a region's ``h.view(-1, 768)`` before an
    # addmm) reshapes g to x's sizes, read from the forward.
    x = a["input"]
    xs, os = x.node.meta["tensor_meta"].shape, out.node.meta["tensor_meta"].shape
    if [s for s in xs if s != 1] != [s for s in os if s != 1]:
        return {"input": g.reshape([x.size(d) for d in range(len(xs))])}
    for d in reversed(range(len(os))):
        if os[d] == 1:
            g = g.squeeze(d)
    for d in range(len(xs)):
        if xs[d] == 1:
            g = g.unsqueeze(d)
    return {"input": g}


def _permute(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    rank = _rank(a["input"])
    dims = [d % rank for d in a["dims"]]
    return {"input": g.permute([dims.index(i) for i in range(rank)])}


def _identity(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    return {"input": g}  # expand: autodiff sums g back over the broadcast dims


def _clone(g: Any, a: dict[str, Any], out: Any) -> dict[str, Any]:
    # A clone into another memory format (a conv weight made channels-last) hands back a
    # gradient in the input's own format: written so by the backward kernel, it is the
    # one copy, where AccumulateGrad would otherwise copy it again for a parameter.
    fmt = a.get("memory_format")
    tm = a["input"].node.meta.get("tensor_meta")
    src = getattr(tm, "memory_format", None)
    if fmt in MEMORY_FORMATS and src in MEMORY_FORMATS and src != fmt and len(tm.shape) in (4, 5):
        return {"input": torch.clone(g, memory_format=src)}
    return {"input": g}


_LN2 = math.log(2.0)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

VJP: dict[str, Rule] = {
    # arithmetic
    "add": lambda g, a, o: {"input": g, "other": _scale(g, a.get("alpha", 1))},
    "sub": lambda g, a, o: {"input": g, "other": -_scale(g, a.get("alpha", 1))},
    "rsub": lambda g, a, o: {"input": -_scale(g, a.get("alpha", 1)), "other": g},  # o - a x
    "mul": lambda g, a, o: {"input": g * a["other"], "other": g * a["input"]},
    "truediv": _truediv,
    "pow": _pow,
    "remainder": _remainder(trunc=False),
    "fmod": _remainder(trunc=True),
    "neg": lambda g, a, o: {"input": -g},
    "clone": _clone,
    "abs": lambda g, a, o: {"input": g * torch.sign(a["input"])},
    "square": lambda g, a, o: {"input": g * a["input"] * 2},
    "reciprocal": lambda g, a, o: {"input": -g * o * o},
    "clamp": _clamp,
    "clamp_min": _clamp_one("min"),
    "clamp_max": _clamp_one("max"),
    "maximum": _extremum(larger=True),
    "minimum": _extremum(larger=False),
    "where": _where,
    "to": lambda g, a, o: {"input": g},  # autodiff casts g back to the input's dtype
    # unary math
    "exp": lambda g, a, o: {"input": g * o},
    "exp2": lambda g, a, o: {"input": g * o * _LN2},
    "expm1": lambda g, a, o: {"input": g * (o + 1)},
    "log": lambda g, a, o: {"input": g / a["input"]},
    "log2": lambda g, a, o: {"input": g / (a["input"] * _LN2)},
    "log1p": lambda g, a, o: {"input": g / (a["input"] + 1)},
    "sqrt": lambda g, a, o: {"input": g / o * 0.5},
    "rsqrt": lambda g, a, o: {"input": g * o * o * o * -0.5},
    "sin": lambda g, a, o: {"input": g * torch.cos(a["input"])},
    "cos": lambda g, a, o: {"input": -g * torch.sin(a["input"])},
    "erf": lambda g, a, o: {"input": g * torch.exp(-(a["input"] * a["input"])) * _TWO_OVER_SQRT_PI},
    "sigmoid": lambda g, a, o: {"input": g * o * (1 - o)},
    "tanh": lambda g, a, o: {"input": g * (1 - o * o)},
    **{name: ZERO for name in ("floor", "ceil", "trunc", "round", "sign")},
    "detach": _no_gradient,
    # activations
    # (eager's backward zeroes where x <= 0, so a NaN input's gradient passes: as here)
    "relu": lambda g, a, o: {"input": torch.where(a["input"] <= 0, 0.0, g)},
    "leaky_relu": lambda g, a, o: {
        "input": torch.where(a["input"] > 0, g, g * a.get("negative_slope", 0.01))},
    "elu": _elu,
    "gelu": _gelu,
    "silu": _silu,
    "softplus": _softplus,
    "mish": _mish,
    "hardtanh": lambda g, a, o: {
        "input": _not_outside(a["input"], a.get("min_val", -1.0), a.get("max_val", 1.0), g)},
    "relu6": lambda g, a, o: {"input": _not_outside(a["input"], 0, 6, g)},
    "hardsigmoid": lambda g, a, o: {"input": _between(a["input"], -3, 3, g / 6)},
    "hardswish": _hardswish,
    "seeded_dropout": _seeded_dropout,
    # reductions
    "sum": _sum,
    "mean": _mean,
    "prod": _prod,
    "amax": _extreme(torch.amax),
    "amin": _extreme(torch.amin),
    "max": _max_all,
    "min": _max_all,
    "var": _var,
    "std": _std,
    # composites
    "softmax": _softmax,
    "log_softmax": _log_softmax,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "addcmul": _multiply_add(divide=False),
    "addcdiv": _multiply_add(divide=True),
    "vector_norm": _vector_norm,
    # matmuls
    "linear": _linear,
    "addmm": _addmm,
    # views
    **{name: _unit_view for name in ("view", "reshape", "flatten", "squeeze", "unsqueeze")},
    **{name: _identity for name in ("expand", "contiguous", "identity")},
    "permute": _permute,
    "transpose": lambda g, a, o: {"input": g.transpose(a["dim0"], a["dim1"])},
    "t": lambda g, a, o: {"input": g.t()},
}
