"""Reverse-mode autodiff of a graph of table ops, split into a forward and a backward graph.

``differentiate(group, example_inputs, requires_grad)`` reads a graph of canonical ops (a
fused group after ``normalize`` + ``decompose``, or any graph of ops with derivative
rules, composites such as ``softmax`` included) and returns a :class:`GroupGrad`: two
plain GraphModules and how to wire them::

    group (x, w) -> y                      forward (x, w) -> (y, rstd)         # rstd saved
                                           backward (x, w, rstd, tangent_0) -> (grad_x,)

It works in three steps:

1. **Joint graph.** The group's nodes are copied, a ``tangent_<i>`` placeholder is added
   for each differentiable output, and the derivative rules of the op table
   (``fxlite.ops.derivatives``) are run in reverse order on Proxies, recording the
   backward nodes. Broadcast cotangents are summed back to their parameter's shape and
   cast to its dtype. Every node gets ``tensor_meta`` as it is recorded (inferred from
   the op table, ``fxlite.ops.shapes``: no data is touched).
2. **Save or recompute** (:func:`_min_cut`): the nodes that do not depend on a tangent
   form the forward side; the backward reads some of them. Each could be saved by the
   forward or recomputed by the backward from saved values. See ``_min_cut`` for the rule.
3. **Split**: the forward graph computes the outputs and the saved intermediates; the
   backward graph takes the saved values and the tangents, recomputes what was not saved
   and returns the gradients.

Both are ordinary graphs for the same pipeline (decompose, ShapeProp, fuse, Triton):
backward is just another graph. ``fxlite.codegen.lower.autograd`` compiles and runs them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fxlite.passes.cse import merge_duplicates
from fxlite.passes.normalize import normalize_graph

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule
from fxlite.node import Node, ancestors, map_arg
from fxlite.ops import derivatives as op_derivatives
from fxlite.ops import lookup, resolve
from fxlite.ops.shapes import as_meta, infer, meta_tensor, record
from fxlite.proxy import GraphAppendingTracer, Proxy

__all__ = ["GroupGrad", "NotDifferentiable", "differentiate", "without_tangents"]


class NotDifferentiable(Exception):
    """autodiff cannot differentiate this graph (no rule for an op); run eager autograd."""


@dataclass
class GroupGrad:
    """A group's forward and backward graphs and how they connect.

    Attributes:
        forward: ``(*inputs) -> (*outputs, *extra)``: the group's outputs, then the saved
            intermediates that are neither inputs nor outputs (always a tuple).
        backward: ``(*saved, *tangents) -> (*grads)`` (always a tuple).
        n_outputs: how many of the forward's results are the group's outputs.
        single: the group returns one value rather than a tuple.
        saved: for each saved value, in the backward's order: ``("input", i)`` (the i-th
            group input) or ``("result", j)`` (the j-th forward result).
        tangents: the output positions that carry a gradient (one tangent each, in order).
        grads: per group input, the index of its gradient among the backward's results, or
            None (the input needs none, or gets zero).
        zero_grads: inputs that need a gradient but get zero (only unused outputs'
            tangents reach them; a piecewise-constant op passes a tensor of zeros back).
        sources: per tangent, the inputs a differentiable path joins to its output. An
            input that no output with a gradient reaches gets None, as in eager (an output
            the loss does not use gets no gradient).
        checked: values whose version the backward checks, as eager's autograd would for
            the values its ops saved: ``(kind, i, outputs)``, ``kind`` and ``i`` as in
            ``saved`` (``"result"``: the i-th output), checked when an output among
            ``outputs`` got a gradient (``meta["checks_version"]``, set by
            ``codegen/lower/written_inputs.py``).
    """

    forward: GraphModule
    backward: GraphModule
    n_outputs: int
    single: bool
    saved: list[tuple[str, int]]
    tangents: list[int]
    grads: list[int | None]
    zero_grads: list[int]
    sources: list[frozenset[int]]
    checked: list[tuple[str, int, frozenset[int]]] = field(default_factory=list)


# ---------------------------------------------------------------------- values and meta
def _float_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _bytes(node: Node) -> int:
    tm = node.meta.get("tensor_meta")
    if tm is None or not hasattr(tm, "shape"):
        return 0
    n = 1
    for s in tm.shape:
        n *= s
    return n * tm.dtype.itemsize


class _Recorder(GraphAppendingTracer):
    """Appends nodes like GraphAppendingTracer, evaluating each on meta values at once,
    so that rules can read the shape and dtype of every value they build."""

    def __init__(self, graph: Graph, values: dict[Node, Any]) -> None:
        super().__init__(graph)
        self.values = values
        self.created: list[Node] = []

    def create_node(self, kind: str, target: Any, args: tuple, kwargs: dict,
                    name: str | None = None, type_expr: Any = None) -> Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        self.values[node] = value = infer(node, self.values)
        record(node, value)
        self.created.append(node)
        return node


# ---------------------------------------------------------------------- the joint graph
@dataclass
class _Joint:
    graph: Graph
    primals: list[Node]
    outputs: list[Node]
    single: bool
    tangents: list[Node | None]  # per output
    grads: list[Node | None]  # per primal
    needs_grad: list[bool]  # per primal
    created: list[Node]
    sources: dict[Node, frozenset[int]]  # per live node: the primals it is computed from


def _joint(gm: GraphModule, inputs: Sequence[Any], requires_grad: Sequence[bool]) -> _Joint:
    graph = Graph()
    values: dict[Node, Any] = {}
    tracer = _Recorder(graph, values)
    env: dict[Node, Node] = {}
    primals: list[Node] = []
    out_arg: Any = None
    for node in gm.graph.nodes:
        if node.op == "output":
            out_arg = node.args[0]
            break
        new = graph.node_copy(node, env.__getitem__)
        env[node] = new
        if node.op == "placeholder":
            if len(primals) >= len(inputs):
                raise NotDifferentiable("fewer example inputs than placeholders")
            values[new] = as_meta(inputs[len(primals)])
            primals.append(new)
        elif node.op in ("call_function", "call_method"):
            values[new] = infer(new, values)
        else:
            raise NotDifferentiable(f"{node.format_node()}: autodiff reads call_function and "
                                    "call_method nodes only (normalize the graph first)")
        record(new, values[new])
    single = not isinstance(out_arg, (tuple, list))
    outputs = [env.get(o) if isinstance(o, Node) else None for o in ([out_arg] if single else out_arg)]
    if any(o is None for o in outputs):
        raise NotDifferentiable("the group returns something other than its values")

    # Which values carry a gradient: floats computed from an input that needs one.
    needs_grad = [bool(r) and _float_tensor(values[p]) for p, r in zip(primals, requires_grad)]
    live = {p for p, r in zip(primals, needs_grad) if r}
    sources = {p: frozenset({i}) for i, p in enumerate(primals) if p in live}
    ops = [n for n in graph.nodes if n.op != "placeholder"]
    for n in ops:
        if _float_tensor(values[n]) and not _detaches(n, gm) and any(
                i in live for i in n.all_input_nodes):
            live.add(n)
            sources[n] = frozenset().union(*(sources[i] for i in n.all_input_nodes
                                             if i in live))

    # Tangents, one per differentiable output, right after the inputs.
    tangents: list[Node | None] = []
    cotangent: dict[Node, Any] = {}
    for i, o in enumerate(outputs):
        if o not in live:
            tangents.append(None)
            continue
        with graph.inserting_before(ops[0] if ops else None):
            t = graph.placeholder(f"tangent_{i}")
        values[t] = meta_tensor(values[o].shape, values[o].dtype)
        record(t, values[t])
        tangents.append(t)
        _accumulate(cotangent, o, Proxy(t, tracer))

    for n in reversed(ops):
        if n in live and n in cotangent:
            _apply_rule(n, cotangent, live, tracer, gm)

    grads = [_as_of(cotangent[p], p).node if p in live and p in cotangent else None
             for p in primals]
    graph.output((*outputs, *(g for g in grads if g is not None)))
    return _Joint(graph, primals, outputs, single, tangents, grads, needs_grad, tracer.created,
                  sources)


def _detaches(n: Node, gm: GraphModule | None) -> bool:
    """Whether ``n`` is ``detach``: its value carries no gradient (unlike ops whose
    derivative is 0, such as floor, whose results still require grad in eager)."""
    found = resolve(n, gm)
    return found is not None and found[0].name == "detach"


def _accumulate(cotangent: dict[Node, Any], node: Node, grad: Any) -> None:
    old = cotangent.get(node)
    cotangent[node] = grad if old is None else old + grad


def _as_of(grad: Any, node: Node) -> Any:
    """``grad`` in ``node``'s dtype. Contributions are summed in their own dtype and cast
    once, here, when the cotangent is read: a float16 value read through two float32 paths
    (a training BatchNorm's mean and its centred values) gets one rounding of their sum,
    as eager's fused backward gives it, not a rounding of each term before they nearly
    cancel (fuzz seed 9967744: 10 to 17% off eager's in a channel of near-equal values)."""
    dtype = node.meta["tensor_meta"].dtype
    return grad if grad.node.meta["tensor_meta"].dtype == dtype else grad.to(dtype)


def _apply_rule(n: Node, cotangent: dict[Node, Any], live: set[Node], tracer: _Recorder,
                gm: GraphModule) -> None:
    found = resolve(n, gm)
    rule = op_derivatives.VJP.get(found[0].name) if found is not None else None
    if rule is None:
        raise NotDifferentiable(f"no derivative rule for {n.format_node()}")
    info, args = found
    g = _as_of(cotangent[n], n)
    rank = len(n.meta["tensor_meta"].shape)
    while len(g.node.meta["tensor_meta"].shape) < rank:  # rules get g at the rank of out
        g = g.unsqueeze(0)
    proxied = {k: map_arg(v, lambda x: Proxy(x, tracer)) for k, v in args.items()}
    result = rule(g, proxied, Proxy(n, tracer))
    if result is NotImplemented:
        raise NotDifferentiable(f"the derivative rule of {info.name} declines {n.format_node()}")
    # (an extern op's parameters are not broadcast operands: a linear's weight of shape
    # (64, 64) broadcasts to its (4, 64, 64) result by chance, and its gradient was
    # taken for a spread value and multiplied by 4)
    out = Proxy(n, tracer) if info.kind != "extern" else None
    for param, grad in result.items():
        target = args.get(param)
        if isinstance(target, Node) and target in live and isinstance(grad, Proxy):
            _accumulate(cotangent, target, _fit(grad, target, out))


def _fit(grad: Any, target: Node, out: Any = None) -> Any:
    """``grad`` summed over the dims ``target`` was broadcast along, in its own dtype
    (:func:`_as_of` casts the sum of a target's contributions once, where it is read).

    A grad smaller than its target (a row value read by full-size ops) is left as it is:
    its users broadcast it, and the caller expands what the group returns. A cotangent
    can be smaller than its op's result ``out`` too (a mean's, spread by broadcasting):
    where ``target`` was broadcast along such a dim as well, the sum over it is the
    value times the dim's size. (``log_softmax(x, -1).mean(-1)``: the ``log(sum)`` term
    read by each of the row's ``n`` elements gets ``n`` times the mean's cotangent.)
    """
    gs = tuple(grad.node.meta["tensor_meta"].shape)
    tm = target.meta["tensor_meta"]
    ts = tuple(tm.shape)
    os_ = tuple(out.node.meta["tensor_meta"].shape) if out is not None else ()
    if out is not None and _broadcasts_to(ts, os_):  # not a reduction's input
        spread = [i for i in range(len(os_)) if os_[i] != 1
                  and _size_at(gs, i, len(os_)) == 1 and _size_at(ts, i, len(os_)) == 1]
        if spread:
            count: Any = None
            for i in spread:
                count = out.size(i) if count is None else count * out.size(i)
            grad = grad * count
            gs = tuple(grad.node.meta["tensor_meta"].shape)
    off = len(gs) - len(ts)  # shapes align on the right
    lead = max(off, 0)
    ones = [off + i for i, s in enumerate(ts) if s == 1 and off + i >= 0 and gs[off + i] != 1]
    # Sums that give the target's shape directly: a squeeze after a keepdim sum would be
    # a shape-changing view, which kernels do not take.
    if ones:
        grad = torch.sum(grad, ones, keepdim=True)
    if lead:
        grad = torch.sum(grad, list(range(lead)))
    return grad


def _broadcasts_to(shape: tuple[int, ...], result: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``result`` (an operand of a pointwise op does; the
    input of a reduction, which has the reduced dims or more of them, does not)."""
    if len(shape) > len(result):
        return False
    return all(s in (1, r) for s, r in zip(shape[::-1], result[::-1]))


def _size_at(shape: tuple[int, ...], i: int, rank: int) -> int:
    """The size of ``shape`` at dim ``i`` of a rank-``rank`` shape it broadcasts to."""
    j = i - (rank - len(shape))
    return shape[j] if j >= 0 else 1


# ---------------------------------------------------------------------- save or recompute
_COMPARED = frozenset({"amax", "amin", "max", "min"})  # backward: input == result


def _recomputable(n: Node) -> bool:
    """Pointwise ops and views can be recomputed inside a backward kernel for free:
    they read values the kernel loads anyway. Reductions cannot (another pass over the
    row), nor externs, inputs or Python values."""
    if n.op not in ("call_function", "call_method") or "tensor_meta" not in n.meta:
        return False
    info = lookup(n)
    return info is not None and info.kind in ("pointwise", "view") and not info.impure


def _min_cut(forward: list[Node], needs: set[Node], primals: set[Node], outputs: set[Node],
             unsaved: frozenset[Node] | set[Node] = frozenset()) -> tuple[list[Node], list[Node]]:
    """Choose which forward values to save: ``(saved, recomputed)``, in graph order.

    The rule: save the set of values of least cost from which the backward can recompute
    everything it reads using pointwise ops and views only. A value's cost is the bytes
    the choice moves: inputs and outputs exist anyway, so saving one costs its size (the
    backward reads it); an intermediate costs twice its size (the forward writes it too);
    Python ints (sizes) cost nothing. Reductions are never recomputed (that would be
    another pass over the row), so a reduction the backward needs is saved: a row value,
    small next to the full-size tensors it summarizes.

    This is a minimum cut, as in inductor's partitioner: each value is an edge
    ``v_in -> v_out`` of capacity its cost; a recomputable value's inputs feed its
    ``v_in``, a value that cannot be recomputed is fed by the source, and the values the
    backward reads drain to the sink. Example: for ``softmax(x)`` the backward needs
    ``exp(x - max)`` and the sum; saving ``x`` (an input), the max and the sum (rows) is
    cheaper than saving the exponentials (an intermediate), which the backward kernel
    recomputes as it reads ``x``. A value in ``unsaved`` is never saved (its cost is
    infinite): the cut moves to values computed from it.
    """
    inf = float("inf")
    index = {n: i for i, n in enumerate(forward)}
    source, sink = 2 * len(forward), 2 * len(forward) + 1
    # the input of an amax or amin is saved, never recomputed: its backward compares it
    # with the saved result, and a recomputation rounded otherwise (exp: one ulp) matched
    # no element and lost the gradient (fuzz seed 7719980)
    compared = {n.all_input_nodes[0] for n in forward if n.all_input_nodes
                and getattr(lookup(n), "name", None) in _COMPARED}
    cap: dict[int, dict[int, float]] = {i: {} for i in range(2 * len(forward) + 2)}

    def edge(a: int, b: int, c: float) -> None:
        cap[a][b] = cap[a].get(b, 0) + c
        cap[b].setdefault(a, 0)

    for n in forward:
        i = index[n]
        size = _bytes(n)
        edge(2 * i, 2 * i + 1, inf if n in unsaved else
             size if n in primals or n in outputs else 2 * size)
        if _recomputable(n) and n not in compared:
            for u in n.all_input_nodes:
                edge(2 * index[u] + 1, 2 * i, inf)
        else:
            edge(source, 2 * i, inf)
        if n in needs:
            edge(2 * i + 1, sink, inf)
    sink_side = _max_flow_residual(cap, source, sink)
    cut = {n for n in forward if 2 * index[n] not in sink_side and 2 * index[n] + 1 in sink_side}
    saved: set[Node] = set()
    recomputed: set[Node] = set()
    stack = list(needs)
    while stack:  # what the backward actually uses: saved values, and what it recomputes
        n = stack.pop()
        if n in saved or n in recomputed:
            continue
        if n in cut:
            saved.add(n)
            continue
        assert _recomputable(n), f"min cut left {n.name} neither saved nor recomputable"
        recomputed.add(n)
        stack.extend(n.all_input_nodes)
    return ([n for n in forward if n in saved], [n for n in forward if n in recomputed])


def _max_flow_residual(cap: dict[int, dict[int, float]], source: int, sink: int) -> set[int]:
    """Edmonds-Karp on ``cap`` (changed in place); returns the vertices that still reach
    the sink in the residual graph: the sink side of the minimum cut closest to the sink.

    Why closest to the sink: among cuts of equal cost it saves the values nearest to what
    the backward reads (a layer norm's mean and rstd rather than the sums they come from),
    which leaves the backward less to recompute.
    """
    while True:
        parent = {source: source}
        queue = deque([source])
        while queue and sink not in parent:
            a = queue.popleft()
            for b, c in cap[a].items():
                if c > 0 and b not in parent:
                    parent[b] = a
                    queue.append(b)
        if sink not in parent:
            break
        path, b = [], sink
        while b != source:
            path.append((parent[b], b))
            b = parent[b]
        flow = min(cap[a][b] for a, b in path)
        if flow == float("inf"):  # a need that cannot be saved or recomputed
            raise NotDifferentiable("a value the backward needs can be neither saved nor "
                                    "recomputed")
        for a, b in path:
            cap[a][b] -= flow
            cap[b][a] += flow
    into: dict[int, list[int]] = {v: [] for v in cap}
    for a, out in cap.items():
        for b, c in out.items():
            if c > 0:
                into[b].append(a)
    reach = {sink}
    queue = deque([sink])
    while queue:
        for a in into[queue.popleft()]:
            if a not in reach:
                reach.add(a)
                queue.append(a)
    return reach


# ---------------------------------------------------------------------- splitting
def _tangent_dependent(graph: Graph, tangents: set[Node]) -> set[Node]:
    dep = set(tangents)
    for n in graph.nodes:
        if n.op not in ("placeholder", "output") and any(i in dep for i in n.all_input_nodes):
            dep.add(n)
    return dep


def _subgraph(nodes: list[Node], inputs: list[Node], outputs: list[Node]) -> GraphModule:
    graph = Graph()
    env: dict[Node, Node] = {}
    for i in inputs:
        ph = graph.placeholder(i.name)
        ph.meta = dict(i.meta)
        env[i] = ph
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    graph.lint()
    return GraphModule(torch.nn.Module(), graph)


def differentiate(gm: GraphModule, example_inputs: Sequence[Any],
                  requires_grad: Sequence[bool] | None = None) -> GroupGrad:
    """Build the forward and backward graphs of ``gm`` (see the module docstring).

    Args:
        gm: a graph of canonical ops (``normalize``d; typically a fused group after
            ``decompose``), whose placeholders take tensors or Python scalars.
        example_inputs: one value per placeholder; only shapes, strides and dtypes are
            read (the graph is evaluated on meta tensors).
        requires_grad: per input, whether its gradient is wanted (default: the tensors'
            ``requires_grad``). Only floating-point tensors get gradients.

    Returns:
        A :class:`GroupGrad`. The graphs are specialized on which dims of each input are
        broadcast (size 1), not on sizes. An input or result marked
        ``meta["written_later"]`` (``codegen/lower/written_inputs.py``: the program writes
        it in place before its backward runs, where eager's own ops saved what they
        computed from it, rms_norm's float32 copy or sigmoid's result) is never saved: the
        backward reads values computed from it instead, which may cost more memory.

    Raises:
        NotDifferentiable: an op has no derivative rule (as ``floor_divide`` has none in
            eager either), the graph holds something other than canonical calls, or the
            backward needs a value marked ``written_later`` itself.

    Example::

        gm = fxlite.symbolic_trace(lambda x, w: torch.sigmoid(x) * w)
        grad = differentiate(gm, [x, w], [True, True])
        print(grad.backward.code)   # (x, w, tangent_0) -> (grad_x, grad_w)
    """
    if requires_grad is None:
        requires_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in example_inputs]
    joint = _joint(gm, example_inputs, requires_grad)
    graph = joint.graph
    normalize_graph(graph, None, [n for n in joint.created if not n._erased])
    _forget_detaches(graph, set(joint.outputs))
    graph.eliminate_dead_code()
    graph.lint()

    tangents = {t for t in joint.tangents if t is not None}
    backward_side = _tangent_dependent(graph, tangents)
    forward = [n for n in graph.nodes if n.op != "output" and n not in backward_side]
    grad_nodes = [g for g in graph.result[len(joint.outputs):]]
    needs = {i for n in backward_side if n.op != "placeholder" for i in n.all_input_nodes
             if i not in backward_side}
    needs |= {g for g in grad_nodes if g not in backward_side}  # (a grad that is an input)
    primals = set(joint.primals)
    unsaved = {n for n in forward if n.meta.get("written_later")}
    saved, recomputed = _min_cut(forward, needs, primals, set(joint.outputs), unsaved)

    outputs = list(graph.result[:len(joint.outputs)])
    extra = [n for n in saved if n not in primals and n not in outputs]
    results = outputs + extra
    keep = ancestors(results, primals)
    fw = _subgraph([n for n in forward if n in keep and n not in primals], joint.primals, results)
    where = [("input", joint.primals.index(n)) if n in primals else ("result", results.index(n))
             for n in saved]
    bw_nodes = [n for n in graph.nodes if n in recomputed or (
        n in backward_side and n.op not in ("placeholder", "output"))]
    tangent_list = [t for t in joint.tangents if t is not None]
    bw = _subgraph(bw_nodes, saved + tangent_list, grad_nodes)

    grads: list[int | None] = []
    zero: list[int] = []
    k = 0
    for i, g in enumerate(joint.grads):
        grads.append(k if g is not None else None)
        k += g is not None
        if g is None and joint.needs_grad[i]:
            zero.append(i)
    checked = [("input", i, p.meta["checks_version"]) for i, p in enumerate(joint.primals)
               if p.meta.get("checks_version")]
    checked += [("result", i, o.meta["checks_version"]) for i, o in enumerate(outputs)
                if isinstance(o, Node) and o.meta.get("checks_version")]
    return GroupGrad(fw, bw, len(outputs), joint.single, where,
                     [i for i, t in enumerate(joint.tangents) if t is not None], grads, zero,
                     [joint.sources[o] for o, t in zip(joint.outputs, joint.tangents)
                      if t is not None], checked)


def _forget_detaches(graph: Graph, keep: set[Node]) -> None:
    """Once the rules have run, ``detach`` has done its work: each one (but an output) is
    replaced by its input, and the duplicates that leaves are merged. BatchNorm's variance
    reads ``x - mean.detach()`` and its output ``x - mean``; the two become one value, so
    the forward computes it once and the backward reads or recomputes one tensor."""
    dropped = False
    for n in list(graph.nodes):
        if n in keep or n.op not in ("call_function", "call_method") or not _detaches(n, None):
            continue
        source = resolve(n)[1].get("input")
        if isinstance(source, Node):
            n.replace_all_uses_with(source)
            graph.erase_node(n)
            dropped = True
    if dropped:
        merge_duplicates(graph, None, keep)


def without_tangents(backward: GraphModule, n_tangents: int, unused: Sequence[int]) -> GraphModule:
    """A copy of ``backward`` (``(*saved, *tangents) -> grads``) in which the tangents at
    positions ``unused`` among its last ``n_tangents`` placeholders contribute nothing.

    Why: an output the loss does not use gets a zero tangent, and ``0 * inf`` is NaN: a
    term of the backward that only carries that zero (a ``log_softmax`` row holding an
    infinity) would put NaN into the gradient of an input the used outputs share, where
    eager, which never computes the term, gives a finite one. The backward is linear in
    its tangents, so a value computed from unused tangents alone is a zero term: where a
    cotangent sum adds one (``torch.add``), the sum becomes its other term, and DCE drops
    the rest. A term used any other way keeps its (zero) tangent input::

        # before (tangent_1 unused)                  # after
        mul = torch.mul(tangent_0, cos)              mul = torch.mul(tangent_0, cos)
        mul_1 = torch.mul(tangent_1, big)
        add = torch.add(mul, mul_1)
        mul_2 = torch.mul(tangent_1, x)
        return (add, mul_2)                          return (mul, None)

    A gradient that only unused tangents reach is returned as None: it is zero (trunc's
    input gets one), which the caller gives as zeros. A sum whose zero term promoted it to
    a wider float type becomes its other term cast to that type.
    """
    import copy

    gm = GraphModule(backward, copy.deepcopy(backward.graph), class_name=type(backward).__name__)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tangents = placeholders[len(placeholders) - n_tangents:]
    carries = set(tangents)  # values that depend on a tangent
    zero = {tangents[i] for i in unused}
    for n in list(graph.nodes):
        if n.op in ("placeholder", "output"):
            continue
        parts = [a for a in n.all_input_nodes if a in carries]
        if not parts:
            continue
        carries.add(n)
        info = lookup(n)
        if info is not None and info.name == "add" and len(n.args) == 2 and not n.kwargs:
            # (before the test below: a sum of a zero term and a value that carries no
            # tangent, trunc's zero gradient, is that value, not a term to compute: fuzz
            # seed 8542728, whose zero term read a value written in place since)
            kept = [a for a in n.args if not (isinstance(a, Node) and a in zero)]
            if len(kept) == 1 and isinstance(kept[0], Node) and _same_meta(kept[0], n,
                                                                          dtype=False):
                # (a float16 term plus a float32 zero term is the term in float32: a
                # dead training BatchNorm's statistics, computed in float32 from a half
                # input, fuzz seed 9873120)
                found = kept[0]
                if not _same_meta(found, n):
                    with graph.inserting_before(n):
                        found = graph.call_function(torch.Tensor.to, (found, n.meta[
                            "tensor_meta"].dtype))
                    found.meta = dict(n.meta)
                n.replace_all_uses_with(found)
                continue
        if all(a in zero for a in parts):
            zero.add(n)
    out = graph.output_node()
    # A gradient of unused tangents alone is zero: None, which the caller makes zeros,
    # rather than ``0 * x`` (NaN at an infinite x) reading a value it need not have saved
    out.args = (map_arg(out.args[0], lambda a: None if a in zero else a),)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _same_meta(a: Node, b: Node, dtype: bool = True) -> bool:
    ta, tb = a.meta.get("tensor_meta"), b.meta.get("tensor_meta")
    return ta is not None and tb is not None and tuple(ta.shape) == tuple(tb.shape) and \
        (not dtype or ta.dtype == tb.dtype)
