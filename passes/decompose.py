"""decompose: rewrite composite ops into table primitives with Proxy-based rules.

A rule is a Python function with the signature of the op's canonical call; it receives
:class:`fxlite.Proxy` values for the node's inputs and computes the op from simpler ones,
which records the replacement nodes, as in torch.fx's decomposition example::

    @register_decomposition(torch.nn.functional.silu)
    def silu(x, inplace=False):
        return x * torch.sigmoid(x)

Rules live in :data:`DECOMPOSITIONS`, keyed by the op's name in the op table
(``fxlite.ops.OPS``), so a rule registered for ``F.softmax`` is ``DECOMPOSITIONS["softmax"]``
and also decomposes ``torch.softmax``, ``x.softmax(-1)`` and ``nn.Softmax``; a function the
table does not know is its own key. The defaults cover softmax, log_softmax, layer_norm,
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

The table and the default rules live in ``decompose_rules``. What rules emit is normalized (``x * 2`` becomes ``torch.mul(x, 2)``) and decomposed again
if it holds composites itself.

Extern ops get rules where that lets their pointwise part fuse: eval-mode ``batch_norm``
becomes per-channel pointwise math (which fuses with a following ReLU and residual add;
its statistics are checked against the input's channels each call, as eager checks),
and the bias of ``linear`` and ``conv`` becomes an add after a bias-free call, when every
user of the result can join a kernel (so the add joins their kernel: an epilogue).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from fxlite.graph import check_order
from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import Node, describe_value, map_arg
from fxlite.ops import call_args, is_impure, resolve
from fxlite.proxy import GraphAppendingTracer, Proxy

from .decompose_rules import DECOMPOSITIONS, Rule, decomposition_key, register_decomposition
from .normalize import copy_graph, normalize_graph

__all__ = ["DECOMPOSITIONS", "decompose", "register_decomposition"]

_MAX_DEPTH = 16  # rules that expand into themselves forever are an error, not a hang


def decompose(gm: GraphModule, rules: dict[Any, Rule] | None = None) -> GraphModule:
    """Replace every node that has a rule by the nodes its rule records.

    Args:
        gm: the module to rewrite; run ``normalize`` first so module spellings with
            parameters (``nn.LayerNorm``) are functional calls, and ``ShapeProp`` if mean,
            var and std should decompose too.
        rules: the rule table, keyed by each op's name or any spelling of it (defaults
            to :data:`DECOMPOSITIONS`).

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
    expect_graph_module(gm, "decompose")
    if rules is not None and not isinstance(rules, dict):
        raise TypeError(f"decompose: rules must be a dict {{op: rule}} or None (the default "
                        f"DECOMPOSITIONS), not {describe_value(rules)}")
    table = DECOMPOSITIONS if rules is None else {decomposition_key(k): v for k, v in rules.items()}
    check_order(gm.graph, "decompose")
    graph = copy_graph(gm)
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


def _match(node: Node, gm: GraphModule, table: dict[Any, Rule],
           final: bool = True) -> tuple[Rule, tuple, dict[str, Any]] | object | None:
    """The rule for ``node`` and the arguments of its canonical call, or None; ``_LATER``
    when the rule's ``when`` declines and this is not the ``final`` round."""
    if node.op not in ("call_function", "call_method", "call_module") or node.meta.get("no_fuse"):
        return None
    found = resolve(node, gm)
    if found is None:  # a function the op table lacks: its rule is keyed by the function
        rule = _rule_of_target(node, table)
        call = None if rule is None else (rule, node.args, dict(node.kwargs))
    else:
        info, args = found
        rule = table.get(info.name)
        if node.op == "call_module" and (info.module_params is not None
                                         or info.module_kwargs is None):
            return None  # its parameters are not arguments yet: normalize first
        call = None if rule is None else (rule, *call_args(info, args))
    if call is None or is_impure(node, gm):
        return None
    when = getattr(rule, "when", None)
    if when is not None and not when(node, gm):
        return None if final else _LATER
    return call


def _rule_of_target(node: Node, table: dict[Any, Rule]) -> Rule | None:
    """The rule a table keys by ``node``'s function itself (``decomposition_key`` of a
    function the op table lacks, such as an aten backward op), or None."""
    if node.op != "call_function":
        return None
    try:
        return table.get(node.target)
    except TypeError:  # an unhashable target
        return None


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
