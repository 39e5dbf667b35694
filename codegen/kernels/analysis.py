"""Analysis shared by the pointwise and reduction kernel builders.

A fused group is read into a :class:`Plan`: one :class:`Value` per kernel value, in
topological order. Every tensor lives in the *iteration space* ``S``, the broadcast of the
group's tensor inputs; ``S``'s dims are numbered ``0 .. rank-1`` and a value of rank ``k``
occupies the last ``k`` of them (torch's right alignment). A value's ``span`` is the set of
dims along which it varies; reductions remove their dims from it.

Kernel variables are named by position (``in0``, ``in1`` for inputs) and by op (``add``,
``add_1``), never by the graph's node names: two groups that compute the same thing (the
repeated blocks of a network) then give the same source text, which compiles once.

The kernel is specialized on the *guard key* (:func:`guard_key`): dtypes, ranks, the
device type, and per input and dim whether it is size 1 (``"1"``), expanded with stride 0
(``"0"``) or strided (``"s"``), plus whether each input is dense (contiguous, nothing
expanded), the order of a strided input's strides (it decides the layout of the outputs,
as in eager) and whether 64-bit indexing is needed. Sizes and strides are runtime arguments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fxlite.codegen.kernels.emit import Unsupported, compute_dtype
from fxlite.codegen.kernels.layout import eager_layout, stride_order
from fxlite.codegen.kernels.meta import meta_values
from fxlite.codegen.kernels.ops import REDUCTIONS, TRITON_OPS

from fxlite import ops as op_table
from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.tensor_meta import reduced_dims

__all__ = ["Plan", "Value", "analyze", "computed_outputs", "guard_key", "iteration_space",
           "key_and_shape", "resolve", "used_values"]

INT32_LIMIT = 2**31 - 1
# Room for the index overshoot of the last block (BLOCK, or ROWS rows of a reduction).
_OVERSHOOT = 2**17


# Views that never move data when their output shape equals their input shape.
IDENTITY_VIEWS = frozenset({"view", "reshape", "expand", "contiguous", "flatten", "squeeze",
                            "unsqueeze", "detach"})

# detach moves no data a kernel could see: a group's kernel reads the same values.
_COPIES = {torch.Tensor.detach: "detach"}


def resolve(node: Node, module: torch.nn.Module | None = None) -> str | None:
    """The op-table name of ``node``'s op when this module can emit it, else None.

    ``module`` (the group) resolves ``call_module`` nodes (``nn.ReLU``).

    Example::

        resolve(node)  # "add" for torch.add, operator.add and x.add(...)
    """
    info = op_table.lookup(node, module)
    if info is not None:
        known = info.name in TRITON_OPS or info.name in REDUCTIONS or info.name in IDENTITY_VIEWS
        return info.name if known else None
    if node.op == "call_method" and node.target == "detach":
        return node.target
    try:
        return _COPIES.get(node.target) if node.op == "call_function" else None
    except TypeError:  # an unhashable target
        return None


@dataclass(eq=False)
class Value:
    """One value of the kernel: a loaded input, a scalar argument, an op or a reduction.

    Attributes:
        name: the kernel variable.
        kind: ``"input"``, ``"scalar"``, ``"pw"``, ``"reduce"`` or ``"count"`` (the number
            of reduced elements, for mean and var).
        dtype: storage dtype (the node's meta dtype; for internal values their compute dtype).
        dims: the iteration-space dims of its shape, in order.
        span: the dims along which it varies.
        op: canonical op name (``"pw"``), or the combine (``"sum" "prod" "max" "min"``).
        args: bound arguments (``"pw"``): Values, literals, or other parameters.
        index: the placeholder position (``"input"``, ``"scalar"``).
        pytype: a scalar argument's Python type.
    """

    name: str
    kind: str
    dtype: torch.dtype | None
    dims: tuple[int, ...]
    span: frozenset[int]
    op: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    index: int = -1
    pytype: type | None = None
    node: str | None = None
    exact: bool = False  # a half-typed value that holds exactly its rounded value
    empty_ok: bool = False  # a max/min that may reduce nothing (softmax's): no error then
    layout: tuple[int, ...] | None = None  # an output's dim order as eager lays it out
    stored: bool = False  # an output: the kernel stores it (so its readers read it rounded)
    # an in-place write made a new value (b.mul_(0.9).add_(m) of a float16 buffer): eager
    # stored it, so its readers read it rounded too, a rounding FP fusion must not drop
    written: bool = False

    def deps(self) -> list[Value]:
        return [a for a in self.args.values() if isinstance(a, Value)]


@dataclass
class Plan:
    """A fused group, analyzed for one guard key."""

    name: str
    rank: int
    values: list[Value]
    inputs: list[Value | None]          # per placeholder; None for an unused slot
    patterns: list[str | None]          # per placeholder: guard pattern of a tensor
    dense: list[bool]
    outputs: list[Value]                # per output slot
    structure: str                      # "single" | "tuple" | "list"
    reduced: frozenset[int]             # reduced dims (non-trivial ones)
    trivial: frozenset[int]             # dims that are size 1 for every input
    int64: bool
    key: tuple
    node_names: list[str]
    # (iteration dim, size) pairs the launch must find: the literal sizes of views that
    # were no-ops when recorded (size -1: the dim must not be 1, for squeeze)
    size_checks: tuple[tuple[int, int], ...] = ()

    @property
    def kind(self) -> str:
        return "reduction" if any(v.kind == "reduce" for v in self.values) else "pointwise"


def iteration_space(inputs: list[Any]) -> tuple[int, ...]:
    """The broadcast shape of the tensor inputs (plain Python: torch's costs ~20 us)."""
    shapes = [t.shape for t in inputs if isinstance(t, torch.Tensor)]
    if len(shapes) == 1:
        return tuple(shapes[0])
    rank = max(map(len, shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        off = rank - len(shape)
        for i, n in enumerate(shape):
            cur = out[off + i]
            if n != cur:
                if cur == 1:
                    out[off + i] = n
                elif n != 1:
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
    return tuple(out)


def _pattern(t: torch.Tensor, rank: int) -> str:
    pad = rank - t.dim()
    return "1" * pad + "".join("1" if n == 1 else ("0" if s == 0 else "s")
                               for n, s in zip(t.shape, t.stride()))


def key_and_shape(inputs: Sequence[Any]) -> tuple[tuple, tuple[int, ...]]:
    """:func:`guard_key` and :func:`iteration_space` of ``inputs`` in one pass."""
    shape = iteration_space(inputs)
    rank = len(shape)
    big = math.prod(shape) + _OVERSHOOT > INT32_LIMIT
    entries: list[Any] = []
    device = None
    for t in inputs:
        if isinstance(t, torch.Tensor):
            device = t.device.type
            pat = _pattern(t, rank)
            dense = "0" not in pat and t.is_contiguous()
            # the order of the strides decides the layout eager gives the outputs
            order = None if dense else stride_order(t)
            if not big and t.numel():
                big = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) \
                    + _OVERSHOOT > INT32_LIMIT
            entries.append((t.dtype, pat, dense, order))
        else:
            entries.append(type(t))
    return (device, tuple(entries), big), shape


def guard_key(inputs: Sequence[Any]) -> tuple:
    """What a generated kernel is specialized on; never the sizes themselves.

    Args:
        inputs: the group's inputs (tensors and Python scalars).

    Returns:
        A hashable key: device type; per input its dtype, broadcast/stride pattern,
        density and, if not dense, the order of its strides (or the scalar's type); and
        whether 64-bit indexing is needed.

    Example::

        guard_key([torch.randn(4, 8), 2.0]) == guard_key([torch.randn(6, 3), 1.5])  # True
    """
    return key_and_shape(inputs)[0]


# ------------------------------------------------------------------------------ analysis
def _view_size_checks(node: Node, name: str, v: Value, module: Any = None
                      ) -> list[tuple[int, int]]:
    """What a view that changed nothing when recorded needs to stay a no-op: the literal
    sizes it names (``x.view(3, 5)``, ``x.expand(2, 4)``), and for ``squeeze`` dims that
    must not become 1. Without these checks, a kernel reused for other sizes would skip
    the error eager raises (or the squeeze it does). Only dims the value spans are checked:
    at the others (a reduced dim kept, a broadcast one) its size is 1, whatever the
    iteration space's."""
    info = op_table.lookup(node, module)
    try:
        args = op_table.canonical_args(node, info, module) if info is not None else {}
    except Exception:
        return []
    if name == "squeeze":
        dim = args.get("dim")
        dims = range(len(v.dims)) if dim is None else (
            [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple))
            else [])
        return [(v.dims[d], -1) for d in dims if isinstance(d, int) and
                -len(v.dims) <= d < len(v.dims) and v.dims[d] in v.span]
    sizes = args.get("size", args.get("shape")) if name in ("view", "reshape", "expand") \
        else None
    if isinstance(sizes, int):
        sizes = (sizes,)
    if not isinstance(sizes, (list, tuple)) or len(sizes) != len(v.dims):
        return []
    return [(v.dims[i], s) for i, s in enumerate(sizes)
            if type(s) is int and s >= 0 and v.dims[i] in v.span]


def _table_args(node: Node, info: op_table.OpInfo, module: torch.nn.Module | None = None
                ) -> dict[str, Any]:
    """``node``'s arguments by the op table's parameter names, defaults filled in."""
    args = op_table.canonical_args(node, info, module)
    defaults = dict(info.defaults)
    extra = [k for k in args if k not in info.params and k not in defaults]
    if extra:
        raise Unsupported(f"{node.name}: arguments {extra}")
    bound = {**defaults, **args}
    missing = [p for p in info.params if p not in bound]
    if missing:
        raise Unsupported(f"{node.name}: missing {missing}")
    return bound


def _bind(params: tuple[str, ...], defaults: dict[str, Any], node: Node) -> dict[str, Any]:
    if len(node.args) > len(params):
        raise Unsupported(f"{node.name}: too many arguments")
    bound = dict(zip(params, node.args))
    for k, v in node.kwargs.items():
        if k in bound or (k not in params and k not in defaults):
            raise Unsupported(f"{node.name}: argument {k!r}")
        bound[k] = v
    for k, v in defaults.items():
        bound.setdefault(k, v)
    missing = [p for p in params if p not in bound]
    if missing:
        raise Unsupported(f"{node.name}: missing {missing}")
    return bound


def _natural(rank: int, r: int) -> tuple[int, ...]:
    if rank > r:
        raise Unsupported("a value of higher rank than the iteration space")
    return tuple(range(r - rank, r))


class _Builder:
    def __init__(self, gm: GraphModule, inputs: list[Any]) -> None:
        self.gm = gm
        self.inputs = inputs
        self.shape = iteration_space(inputs)
        self.r = len(self.shape)
        self.values: list[Value] = []
        self.env: dict[Node, Value] = {}
        self.taken: set[str] = set()
        self.reduced: frozenset[int] | None = None
        self.trivial: frozenset[int] = frozenset()
        self.metas = meta_values(gm, inputs)
        self.size_checks: list[tuple[int, int]] = []

    def meta(self, node: Node) -> torch.Tensor:
        tm = self.metas.get(node)
        if tm is None:
            raise Unsupported(f"{node.name}: not a tensor")
        compute_dtype(tm.dtype)
        return tm

    def fresh(self, base: str) -> str:
        base = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in base).strip("_") or "v"
        if base[0].isdigit():
            base = "v" + base
        name, i = base, 0
        while name in self.taken or name in _RESERVED:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name

    def add(self, v: Value) -> Value:
        self.values.append(v)
        return v

    def operand(self, a: Any, node: Node, any_dims: bool = False) -> Any:
        if isinstance(a, Node):
            v = self.env.get(a)
            if v is None:
                raise Unsupported(f"{node.name}: argument {a.name} is not a group value")
            if not any_dims and v.kind not in ("scalar",) and v.dims != _natural(len(v.dims), self.r):
                raise Unsupported(f"{node.name}: uses a keepdim=False reduction elementwise")
            return v
        if isinstance(a, (list, tuple, dict, slice)) or isinstance(a, torch.Tensor):
            raise Unsupported(f"{node.name}: argument {a!r}")
        return a

    def check_shape(self, v: Value, node: Node) -> None:
        tm = self.meta(node)
        got = tuple(self.shape[d] if d in v.span else 1 for d in v.dims)
        if got != tuple(tm.shape) or compute_dtype(tm.dtype) != compute_dtype(v.dtype):
            raise Unsupported(f"{node.name}: analysis gives {got}, meta says {tuple(tm.shape)}")

    def placeholder(self, node: Node, i: int) -> None:
        x = self.inputs[i]
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided or x.is_complex() or x.is_quantized:
                raise Unsupported(f"input {node.name}: layout or dtype")
            if x.requires_grad and torch.is_grad_enabled():
                raise Unsupported(f"input {node.name} requires grad")
            compute_dtype(x.dtype)
            pat = _pattern(x, self.r)
            span = frozenset(d for d, p in enumerate(pat) if p != "1")
            v = Value(self.fresh(f"in{i}"), "input", x.dtype, _natural(x.dim(), self.r), span,
                      index=i, node=node.name, exact=True)
        elif isinstance(x, (bool, int, float)):
            v = Value(self.fresh(f"in{i}"), "scalar", None, (), frozenset(), index=i,
                      pytype=type(x), node=node.name)
        else:
            raise Unsupported(f"input {node.name} of type {type(x).__name__}")
        self.env[node] = self.add(v)

    def unit_view(self, v: Value, old: tuple, new: tuple, node: Node) -> Value:
        """``v`` seen through a view that only adds or drops size-1 dims (a batch of one
        flattened: ``(1, 16, 64) -> (16, 64)``): the same values at the same iteration
        dims, since both shapes sit right-aligned in the iteration space."""
        r = self.r

        def varying(shape: tuple) -> list[tuple[int, int]]:
            return [(d, n) for d, n in zip(_natural(len(shape), r), shape) if n != 1]

        if v.dims != _natural(len(old), r) or varying(old) != varying(new):
            raise Unsupported(f"{node.name}: a view that changes the shape")
        # a copy of the value at its new dims (emitted as the op-table's clone: no work),
        # named by the op as every value is: a node's name would make each layer's source
        # (and binary) its own, where the repeated blocks of a network share one
        return self.add(Value(self.fresh("view"), "pw", self.meta(node).dtype,
                              _natural(len(new), r), v.span, op="clone", args={"input": v},
                              node=node.name, exact=v.exact))

    def call(self, node: Node) -> None:
        name = resolve(node, self.gm)
        if name is None:
            raise Unsupported(f"{node.name}: op {node.target} has no Triton form")
        if name in IDENTITY_VIEWS:
            src = node.args[0] if node.args else None
            v = self.env.get(src) if isinstance(src, Node) else None
            tm = self.meta(node)
            if v is None or v.kind == "scalar" or src not in self.metas:
                raise Unsupported(f"{node.name}: a view that changes the shape")
            old, new = tuple(self.metas[src].shape), tuple(tm.shape)
            if old != new:
                v = self.unit_view(v, old, new, node)
            self.env[node] = v
            self.size_checks += _view_size_checks(node, name, v, self.gm)
            return
        if name in REDUCTIONS:
            self.reduction(node, name)
            return
        info = op_table.lookup(node, self.gm)
        spec = TRITON_OPS[info.name]
        bound = self.to_args(node) if name == "to" else _table_args(node, info, self.gm)
        for k in spec.ignore:
            if k == "inplace" and bound.get(k) is True and self.private(bound.get("input"), node):
                pass  # it overwrites a temporary nobody else reads: the same as out of place
            elif k == "memory_format":
                pass  # values are the same; a result's layout comes from its metadata
            elif bound.get(k) not in (False, None):
                raise Unsupported(f"{node.name}: {k}={bound[k]!r}")
            bound.pop(k, None)
        args = {k: self.operand(a, node, any_dims=True) for k, a in bound.items()}
        tm = self.meta(node)
        ops = [a for a in args.values() if isinstance(a, Value)]
        if not ops:
            raise Unsupported(f"{node.name}: no tensor operand")
        dims = _natural(len(tm.shape), self.r)
        # 0-d values broadcast against anything, at any dims
        tensors = [a for a in ops if a.kind != "scalar" and a.dims != ()]
        if any(a.dims != _natural(len(a.dims), self.r) for a in tensors):
            # A keepdim=False reduction's result sits at its kept dims, not right-aligned:
            # fine when every tensor operand sits there too (``sum(x, -1) / n``), since
            # torch's broadcasting would otherwise align them differently.
            if len({a.dims for a in tensors}) != 1:
                raise Unsupported(f"{node.name}: uses a keepdim=False reduction elementwise")
            dims = tensors[0].dims
        span = frozenset().union(*(a.span for a in ops))
        v = Value(self.fresh(name), "pw", tm.dtype, dims, span,
                  op=name, args=args, node=node.name, exact=name == "to",
                  written=bool(node.meta.get("in_place")))
        self.check_shape(v, node)
        self.env[node] = self.add(v)

    @staticmethod
    def private(value: Any, user: Node) -> bool:
        """Whether ``value`` is computed in the group and read by ``user`` alone (so an
        in-place ``user``, ``nn.ReLU(inplace=True)`` say, changes nothing anyone sees)."""
        return isinstance(value, Node) and value.op in ("call_function", "call_method",
                                                        "call_module") \
            and set(value.users) == {user}

    def to_args(self, node: Node) -> dict[str, Any]:
        for a in list(node.args[1:]) + list(node.kwargs.values()):
            if isinstance(a, (torch.device, str)) or (isinstance(a, Node) and a not in self.env):
                raise Unsupported(f"{node.name}: a cast that moves devices")
        return {"input": node.args[0]}

    def reduction(self, node: Node, name: str) -> None:
        params, defaults = REDUCTIONS[name]
        bound = _bind(params, defaults, node)
        x = self.operand(bound["input"], node)
        if not isinstance(x, Value) or x.kind == "scalar":
            raise Unsupported(f"{node.name}: reduction of a scalar")
        k = len(x.dims)
        dim = bound["dim"]
        dims = [] if dim is None else [dim] if isinstance(dim, int) else list(dim)
        if k == 0 and any(d not in (0, -1) for d in dims):
            raise Unsupported(f"{node.name}: dim {dim} of a 0-d tensor")
        if k and any(not -k <= d < k for d in dims):
            raise Unsupported(f"{node.name}: dim {dim}")
        rdims = reduced_dims(dim, k)
        sdims = frozenset(x.dims[d] for d in rdims)
        nontrivial = sdims - self.trivial
        if self.reduced is None:
            self.reduced = nontrivial
        elif self.reduced != nontrivial:
            raise Unsupported(f"{node.name}: reductions over different dims")
        if not nontrivial <= x.span:
            raise Unsupported(f"{node.name}: reduces a broadcast dim")
        span = x.span - sdims
        dims = x.dims if bound["keepdim"] else tuple(d for d in x.dims if d not in sdims)
        tm = self.meta(node)
        out = tm.dtype
        acc = compute_dtype(out)
        label = self.fresh(name)
        if name in ("sum", "prod"):
            v = Value(label, "reduce", out, dims, span, op=name, args={"input": x})
        elif name in ("amax", "amin"):
            v = Value(label, "reduce", out, dims, span, op="max" if name == "amax" else "min",
                      args={"input": x}, exact=x.exact,
                      empty_ok=bool(node.meta.get("empty_ok")))
        else:
            if not acc.is_floating_point:
                raise Unsupported(f"{node.name}: {name} of {x.dtype}")
            total = self.add(Value(self.fresh(label + "_sum"), "reduce", acc, dims, span,
                                   op="sum", args={"input": x}))
            mean = Value(label if name == "mean" else self.fresh(label + "_mean"), "count", acc,
                         dims, span, op="mean", args={"input": total, "correction": 0})
            if name == "mean":
                v = mean
                v.dtype = out
            else:
                corr = bound.get("correction")
                if corr is None:
                    corr = 0 if bound.get("unbiased") is False else 1
                if bound.get("unbiased") is not None and bound.get("correction") is not None:
                    raise Unsupported(f"{node.name}: both unbiased and correction")
                self.add(mean)
                keep = tuple(d for d in x.dims)  # the centred values live in x's full space
                centred = self.add(Value(self.fresh(label + "_centred"), "pw", acc, keep,
                                         x.span, op="sub", args={"input": x, "other": mean}))
                sq = self.add(Value(self.fresh(label + "_sq"), "pw", acc, keep, x.span,
                                    op="mul", args={"input": centred, "other": centred}))
                ssq = self.add(Value(self.fresh(label + "_ssq"), "reduce", acc, dims, span,
                                     op="sum", args={"input": sq}))
                var_name = label if name == "var" else self.fresh(label + "_var")
                var = Value(var_name, "count", acc if name == "std" else out, dims, span,
                            op="mean", args={"input": ssq, "correction": corr})
                if name == "std":
                    self.add(var)
                    v = Value(label, "pw", out, dims, span, op="sqrt", args={"input": var})
                else:
                    v = var
        v.node = node.name
        self.check_shape(v, node)
        self.env[node] = self.add(v)


_RESERVED = frozenset({
    "tl", "triton", "libdevice", "pid", "offs", "mask", "r", "c", "c0", "rmask", "cmask",
    "rows", "cols", "numel", "ROWS", "BLOCK", "BLOCK_C", "rem", "rrem", "crem", "True", "False",
    "None", "float", "int", "range", "and", "or", "not", "in", "is", "if", "else", "for",
    "def", "return", "lambda", "import", "from", "as", "with", "while", "pass", "del",
})


def used_values(plan: Plan) -> set[Value]:
    """Values some other value reads (inputs outside this set need no pointer)."""
    used: set[Value] = set()
    for v in plan.values:
        used.update(v.deps())
    return used


def computed_outputs(plan: Plan) -> list[tuple[int, Value]]:
    """The outputs a kernel stores: each computed value once, numbered in output order."""
    seen: list[Value] = []
    for v in plan.outputs:
        if v.kind != "input" and v not in seen:
            seen.append(v)
    return list(enumerate(seen))


def analyze(gm: GraphModule, inputs: list[Any], name: str) -> Plan:
    """Read a fused group into a :class:`Plan` for ``inputs``'s guard key.

    Raises:
        Unsupported: when any part of the group has no kernel form the generator can prove.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise Unsupported(f"{len(placeholders)} placeholders, {len(inputs)} inputs")
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if not tensors:
        raise Unsupported("no tensor input")
    if len({t.device for t in tensors}) != 1:
        raise Unsupported("inputs on several devices")
    try:
        b = _Builder(gm, inputs)
    except RuntimeError as e:
        raise Unsupported(f"inputs do not broadcast: {e}") from None
    key = guard_key(inputs)
    pats = [e[1] if isinstance(e, tuple) else None for e in key[1]]
    b.trivial = frozenset(d for d in range(b.r)
                          if all(p is None or p[d] == "1" for p in pats))
    out_node = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            b.placeholder(node, placeholders.index(node))
        elif node.op in ("call_function", "call_method", "call_module"):
            b.call(node)
        elif node.op == "output":
            out_node = node
        else:
            raise Unsupported(f"{node.name}: {node.op} in a fused group")
    result = out_node.args[0] if out_node is not None else None
    structure = "tuple" if isinstance(result, tuple) else "list" if isinstance(result, list) \
        else "single"
    items = list(result) if structure != "single" else [result]
    outputs = []
    for item in items:
        v = b.env.get(item) if isinstance(item, Node) else None
        if v is None or v.kind == "scalar":
            raise Unsupported(f"group output {item!r} is not a tensor value")
        m = b.metas.get(item)
        if v.kind != "input" and m is not None and m.dim() == len(v.dims):
            v.layout = eager_layout(m)
        v.stored = True
        outputs.append(v)
    inputs_v: list[Value | None] = [None] * len(inputs)
    for v in b.values:
        if v.kind in ("input", "scalar"):
            inputs_v[v.index] = v
    dense = [bool(e[2]) if isinstance(e, tuple) else False for e in key[1]]
    return Plan(name=name, rank=b.r, values=b.values, inputs=inputs_v, patterns=pats,
                dense=dense, outputs=outputs, structure=structure,
                reduced=b.reduced if b.reduced is not None else frozenset(),
                trivial=b.trivial, int64=key[2], key=key,
                node_names=[n.name for n in gm.graph.nodes
                            if n.op in ("call_function", "call_method", "call_module")],
                size_checks=tuple(b.size_checks))
