"""normalize: rewrite every spelling of a known op to its one canonical call.

The canonical form of an op in the table (``fxlite.ops``) is ``call_function`` of its
``torch_fn``, tensor operand first, with the arguments laid out by ``ops.call_args``::

    x + y, x.add(y), torch.Tensor.add(x, y)       ->  torch.add(x, y)
    1 + x / 1 - x                                  ->  torch.add(x, 1) / torch.rsub(x, 1)
    F.relu(x), x.relu(), nn.ReLU()(x)              ->  torch.relu(x)
    x.sum(1), x.sum(dim=1)                         ->  torch.sum(x, dim=1)
    x.view(2, 3)                                   ->  torch.Tensor.view(x, (2, 3))
    x.half(), x.type(torch.float16)                ->  torch.Tensor.to(x, torch.float16)
    torch.max(x, y)                                ->  torch.maximum(x, y)
    nn.Linear()(x)                                 ->  F.linear(x, lin_weight, lin_bias)  (get_attr)
    nn.Dropout()(x) in eval, nn.Identity()(x)      ->  x

Nodes keep their names and ``meta``. Left as they are: unknown ops, in-place and random
ops, modules without a safe functional form (BatchNorm in training mode, Conv with
``padding_mode="reflect"``), and Python arithmetic on non-tensors (``x.size(0) * 2``).

Every pass that builds a new module the same way shares :func:`copy_graph` (a copy to edit)
and :func:`copy_module` (the edited copy as a new GraphModule), written here.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable
from typing import Any

import torch

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import Node, Opcode, describe_value, map_aggregate, map_arg
from fxlite.ops import (
    OPS,
    OpInfo,
    attribute_at,
    call_args,
    is_impure,
    lookup,
    resolve,
    same_literal,
)

from .shape_prop import TensorMetadata, extract_tensor_metadata

__all__ = ["copy_graph", "copy_module", "normalize", "normalize_graph", "produces_tensor"]

_CALLS = ("call_function", "call_method", "call_module")
# Tensor methods whose result is not a tensor; other Tensor methods are assumed to give one.
_NON_TENSOR_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "item", "tolist", "stride",
    "storage_offset", "element_size", "is_contiguous", "is_floating_point", "is_complex",
    "data_ptr", "get_device", "type", "__len__", "__bool__", "__int__", "__float__",
})


def normalize(gm: GraphModule) -> GraphModule:
    """Rewrite every known op of ``gm`` to its canonical ``call_function`` form.

    Args:
        gm: the module to rewrite in place.

    Returns:
        ``gm``, recompiled. If anything raises, ``gm`` is left as it was (the graph is
        linted first, and every rewrite is planned before the first one is applied).

    Example::

        # before                                   # after
        def forward(self, x):                      def forward(self, x):
            add = x + 1                                add = torch.add(x, 1)
            relu = self.relu(add)                      relu = torch.relu(add)
            sum_1 = relu.sum(dim=1)                    sum_1 = torch.sum(relu, dim=1)
            drop = self.drop(sum_1)  # eval            lin_weight = self.lin.weight
            lin = self.lin(drop)                       lin_bias = self.lin.bias
            return lin                                 lin = torch._C._nn.linear(sum_1, lin_weight, lin_bias)
                                                       return lin
    """
    expect_graph_module(gm, "normalize")
    try:  # check first: a malformed graph must fail before any node is rewritten
        gm.graph.lint()
    except RuntimeError as e:
        raise RuntimeError(f"normalize: the graph is malformed and was left unchanged: {e}") from None
    normalize_graph(gm.graph, gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def normalize_graph(graph: Graph, module: torch.nn.Module | None = None,
                    nodes: Iterable[Node] | None = None) -> None:
    """Normalize ``graph`` in place (only ``nodes``, if given); see :func:`normalize`.

    Every rewrite is planned first; if planning raises, the graph is untouched.

    Args:
        graph: the graph to rewrite.
        module: the module owning its ``get_attr`` / ``call_module`` targets (defaults to
            ``graph.owning_module``).
        nodes: restrict the rewrite to these nodes (``decompose`` passes the nodes its
            rules created).

    Example::

        normalize_graph(gm.graph, gm); gm.recompile()
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"normalize_graph: graph must be a fxlite Graph, not {describe_value(graph)}"
                        + ("; pass gm.graph, or call normalize(gm)" if isinstance(graph, GraphModule)
                           else ""))
    if module is not None and not isinstance(module, torch.nn.Module):
        raise TypeError(f"normalize_graph: module must be an nn.Module or None (the graph's "
                        f"owning_module), not {describe_value(module)}")
    module = module if module is not None else graph.owning_module
    only = None if nodes is None else set(nodes)
    tensor: dict[Node, bool] = {}
    plans: list[tuple[Node, Any]] = []
    for node in graph.nodes:
        tensor[node] = produces_tensor(node, module, tensor)
        if node.op in _CALLS and (only is None or node in only):
            plan = _plan(node, module, tensor)
            if plan is not None:
                plans.append((node, plan))
    order = {n: i for i, n in enumerate(graph.nodes)}  # new get_attr nodes go before their user,
    attrs = {n.target: n for n in reversed(graph.nodes) if n.op == "get_attr"}  # so reuse is safe
    removed: dict[Node, Node] = {}  # identities, and the node each one passes on
    for node, plan in plans:
        if isinstance(plan, Node):  # an identity: its users read its input instead
            source = removed.get(plan, plan)
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            removed[node] = source
            continue
        target, args, kwargs = plan

        def fetch(a: Any, node: Node = node) -> Any:
            if isinstance(a, _Attr):
                return _get_attr(graph, node, a, attrs, order)
            return removed.get(a, a) if isinstance(a, Node) else a

        node.op = Opcode.CALL_FUNCTION
        node.target = target
        node.args, node.kwargs = map_aggregate(args, fetch), map_aggregate(kwargs, fetch)


def produces_tensor(node: Node, module: torch.nn.Module | None = None,
                    known: dict[Node, bool] | None = None) -> bool:
    """Whether ``node``'s value is (or is taken to be) a tensor.

    ShapeProp's ``meta['type']`` / ``meta['tensor_meta']`` decide when present. Otherwise:
    placeholders, tensor attributes, table ops, torch functions and leaf modules give
    tensors; Python operators give one when an input does (``known`` maps inputs to their
    answer); ``x.size()``, ``getattr`` and unknown Python functions do not.

    Example::

        produces_tensor(size_node)   # False: x.size(0) * 2 stays Python arithmetic
    """
    if not isinstance(node, Node):
        raise TypeError(f"produces_tensor: node must be a fxlite Node, not {describe_value(node)}")
    known = known if known is not None else {}
    typ = node.meta.get("type")
    if isinstance(typ, type):
        return issubclass(typ, torch.Tensor)
    if "tensor_meta" in node.meta:
        return isinstance(node.meta["tensor_meta"], TensorMetadata)
    op, target = node.op, node.target
    if op == "placeholder":
        return True
    if op == "get_attr":
        return module is None or isinstance(attribute_at(module, target), torch.Tensor)
    if op == "call_module":
        return True
    if op == "call_method":
        return target not in _NON_TENSOR_METHODS and hasattr(torch.Tensor, target)
    if op != "call_function":
        return False
    if _is_python_operator(target):
        if target is operator.getitem:
            first = node.args[0] if node.args else None
            return isinstance(first, Node) and known.get(first, False)
        return lookup(node, module) is not None and any(known.get(n, False) for n in node.all_input_nodes)
    info = lookup(node, module)
    if info is not None and info.kind != "effect":
        return True
    return (getattr(target, "__module__", None) or "").startswith("torch")


# ---------------------------------------------------------------------- one node
class _Attr:
    """A module tensor that the rewritten call reads through a ``get_attr`` node."""

    __slots__ = ("target", "value")

    def __init__(self, target: str, value: torch.Tensor) -> None:
        self.target, self.value = target, value


def _plan(node: Node, module: Any, tensor: dict[Node, bool]) -> Any:
    """``(target, args, kwargs)`` of ``node``'s canonical call, the input that replaces an
    identity, or None to leave the node as it is. Changes nothing."""
    found = resolve(node, module)
    if found is None or is_impure(node, module):
        return None
    info, args = found
    if args.get("inplace") is True:
        return None  # nn.ReLU(inplace=True): no out-of-place canonical call means the same
    if node.op == "call_function" and _is_python_operator(node.target) and \
            not any(tensor.get(n, False) for n in node.all_input_nodes):
        return None  # Python arithmetic on sizes and other non-tensors
    if info.name == "identity":
        source = args.get("input")
        return source if isinstance(source, Node) else None
    if node.op == "call_module":
        params = _module_params(node, info, module)
        if params is None:
            return None
        args = {**args, **params}
    info, args = _tensor_first(info, args, tensor)
    if info.torch_fn is None:
        return None
    try:
        new_args, new_kwargs = call_args(info, args)
    except ValueError:
        return None
    return info.torch_fn, new_args, new_kwargs


def _tensor_first(info: OpInfo, args: dict[str, Any], tensor: dict[Node, bool]
                  ) -> tuple[OpInfo, dict[str, Any]]:
    """``1 - x`` -> ``rsub(x, 1)``; ``2 * x`` -> ``mul(x, 2)``."""
    if info.swapped is None or "alpha" in args and info.name == info.swapped:
        return info, args  # add(1, x, alpha=2) is 1 + 2x: not the same as add(x, 1, alpha=2)
    first, second = info.params[0], info.params[1]
    a, b = args.get(first), args.get(second)
    if _is_tensor(a, tensor) or not _is_tensor(b, tensor):
        return info, args
    return OPS[info.swapped], {**args, first: b, second: a}


def _is_tensor(value: Any, tensor: dict[Node, bool]) -> bool:
    return isinstance(value, Node) and tensor.get(value, False)


def _module_params(node: Node, info: OpInfo, module: Any) -> dict[str, Any] | None:
    """The module's configuration as call arguments, its tensors as :class:`_Attr`."""
    if module is None:
        return None
    sub = attribute_at(module, node.target)
    if info.module_params is None:
        return {} if info.module_kwargs is not None else None
    params = info.module_params(sub)
    if params is None:
        return None
    names = {id(t): n for n, t in (*sub.named_parameters(recurse=False),
                                   *sub.named_buffers(recurse=False))}
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, torch.Tensor):
            if id(value) not in names:
                return None  # a computed tensor: no attribute to read it from
            value = _Attr(f"{node.target}.{names[id(value)]}", value)
        out[key] = value
    defaults = dict(info.defaults)
    return {k: v for k, v in out.items() if not (k in defaults and same_literal(v, defaults[k]))}


def _get_attr(graph: Graph, user: Node, attr: _Attr, attrs: dict[str, Node],
              order: dict[Node, int]) -> Node:
    """A ``get_attr`` node for ``attr`` defined before ``user``: an existing one, or a new one.

    ``order`` holds the positions of the nodes that existed before the rewrite; get_attr
    nodes made by it come before a rewritten node, so before every later one too.
    """
    node = attrs.get(attr.target)
    if node is not None and (node not in order or order[node] < order[user]):
        return node
    with graph.inserting_before(user):
        node = graph.get_attr(attr.target)
    if "tensor_meta" in user.meta:  # keep the graph's ShapeProp meta complete
        node.meta["tensor_meta"] = extract_tensor_metadata(attr.value)
        node.meta["type"] = type(attr.value)
    attrs[attr.target] = node
    return node


# ---------------------------------------------------------------------- helpers
def _is_python_operator(target: Any) -> bool:
    return getattr(target, "__module__", None) == "_operator"


def copy_graph(gm: GraphModule) -> Graph:
    """A copy of ``gm.graph`` (names and meta kept) that a pass can edit before swapping it in."""
    old = gm.graph
    graph = Graph(owning_module=gm, tracer_cls=old._tracer_cls)
    val_map: dict[Node, Any] = {}
    out = graph.graph_copy(old, val_map, return_output_node=True)
    if out is not None:
        graph.output(map_arg(out.args[0], val_map.__getitem__), out.type)
        graph.output_node().meta = copy.copy(out.meta)
    return graph


def copy_module(gm: GraphModule, graph: Graph) -> GraphModule:
    """A new GraphModule (``gm`` unchanged) of ``graph``, an edited ``copy_graph(gm)``,
    with ``gm``'s class name and meta."""
    graph.lint()
    out = GraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta = dict(getattr(gm, "meta", {}))
    return out
