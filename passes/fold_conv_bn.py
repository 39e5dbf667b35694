"""fold_conv_bn: fold eval-mode BatchNorm into the conv or linear layer before it.

In eval mode BatchNorm is an affine map per channel, ``y = (x - mean) * s + beta`` with
``s = gamma / sqrt(var + eps)``, so after a conv or linear layer it folds into that
layer's weight and bias::

    weight' = weight * s        (scaled per output channel)
    bias'   = (bias - mean) * s + beta

Both spellings fold: modules (``nn.Conv1d/2d/3d`` + ``nn.BatchNorm1d/2d/3d``, and
``nn.Linear`` + ``nn.BatchNorm1d``) and the functional form left by ``normalize``
(``F.conv2d(x, w, b)`` + ``F.batch_norm(y, mean, var, gamma, beta)`` whose tensors are
``get_attr`` nodes). A pair folds only when BatchNorm is in eval mode with running
statistics and the conv or linear output feeds nothing but the BatchNorm. The modules of
the original model are never modified: folded layers are copies. BatchNorm modules that
nothing reads any more are deleted from ``gm``, as torch.fx's fuser does.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import Node
from fxlite.ops import call_args, resolve

__all__ = ["fold_conv_bn"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_LAYER_OPS = ("conv1d", "conv2d", "conv3d", "linear")


@dataclass
class _Fold:
    layer: Node
    bn: Node
    weight: torch.Tensor
    bias: torch.Tensor


def fold_conv_bn(gm: GraphModule) -> GraphModule:
    """Fold each eval-mode BatchNorm that follows a conv or linear layer into that layer.

    Args:
        gm: the module to rewrite in place.

    Returns:
        ``gm``, recompiled. If anything raises, ``gm`` is left as it was.

    Example::

        # before                                   # after
        def forward(self, x):                      def forward(self, x):
            conv = self.conv(x)                        conv = self.conv(x)    # a folded copy
            bn = self.bn(conv)                         relu = torch.relu(conv)
            relu = torch.relu(bn)                      return relu
            return relu
    """
    expect_graph_module(gm, "fold_conv_bn")
    folds = [f for f in (_plan(node, gm) for node in gm.graph.nodes) if f is not None]
    if not folds:
        return gm
    counter = itertools.count()
    old_attrs: dict[Node, None] = {}
    for fold in folds:
        for node in (fold.layer, fold.bn):
            old_attrs.update((n, None) for n in node.all_input_nodes if n.op == "get_attr")
        if fold.layer.op == "call_module":
            _apply_module(gm, fold)
        else:
            _apply_functional(gm, fold, counter)
        fold.bn.replace_all_uses_with(fold.layer)
        gm.graph.erase_node(fold.bn)
    folded_modules = {f.bn.target for f in folds if f.bn.op == "call_module"}
    for node in old_attrs:  # the old weights and statistics, where nothing else reads them
        if not node.users:
            gm.graph.erase_node(node)
            folded_modules.add(node.target.rpartition(".")[0])
    _delete_unused_submodules(gm, folded_modules)
    gm.graph.lint()
    gm.recompile()
    return gm


# ---------------------------------------------------------------------- finding pairs
def _plan(bn: Node, gm: GraphModule) -> _Fold | None:
    """The fold of ``bn`` into the layer before it, computed but not applied; or None."""
    stats = _bn_stats(bn, gm)
    if stats is None:
        return None
    layer = stats.pop("input")
    if not isinstance(layer, Node) or len(layer.users) != 1:
        return None
    found = _layer_weights(layer, gm)
    if found is None:
        return None
    kind, weight, bias = found
    if kind == "linear":
        if bn.op == "call_module" and not isinstance(_fetch(gm, bn.target), nn.BatchNorm1d):
            return None
        if _rank(bn) not in (None, 2):
            return None  # BatchNorm1d on (N, C, L) normalizes dim 1, not the linear's features
    if weight.shape[0] != stats["running_mean"].shape[0]:
        return None
    with torch.no_grad():
        new_weight, new_bias = _fold_weights(weight, bias, **stats)
    return _Fold(layer, bn, new_weight, new_bias)


def _bn_stats(bn: Node, gm: GraphModule) -> dict[str, Any] | None:
    """BatchNorm's input and statistics, if it is an eval-mode BatchNorm with running stats."""
    if bn.op == "call_module":
        m = _fetch(gm, bn.target)
        if not isinstance(m, _BATCH_NORMS) or m.training or m.running_mean is None or len(bn.args) != 1 or bn.kwargs:
            return None
        return {"input": bn.args[0], "running_mean": m.running_mean, "running_var": m.running_var,
                "gamma": m.weight, "beta": m.bias, "eps": m.eps}
    found = resolve(bn, gm) if bn.op == "call_function" else None
    if found is None or found[0].name != "batch_norm":
        return None
    args = found[1]
    if args.get("training", False) is not False:
        return None
    tensors = {k: _attr_value(args.get(k), gm) for k in ("running_mean", "running_var", "weight", "bias")}
    if any(v is False for v in tensors.values()) or tensors["running_mean"] is None or tensors["running_var"] is None:
        return None
    eps = args.get("eps", 1e-5)
    if not isinstance(eps, float):
        return None
    return {"input": args.get("input"), "running_mean": tensors["running_mean"],
            "running_var": tensors["running_var"], "gamma": tensors["weight"],
            "beta": tensors["bias"], "eps": eps}


def _layer_weights(layer: Node, gm: GraphModule) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
    """(kind, weight, bias) of a conv or linear layer node, or None."""
    if layer.op == "call_module":
        m = _fetch(gm, layer.target)
        if isinstance(m, _CONVS):
            return "conv", m.weight, m.bias
        if isinstance(m, nn.Linear):
            return "linear", m.weight, m.bias
        return None
    found = resolve(layer, gm) if layer.op == "call_function" else None
    if found is None or found[0].name not in _LAYER_OPS:
        return None
    args = found[1]
    weight, bias = _attr_value(args.get("weight"), gm), _attr_value(args.get("bias"), gm)
    if not isinstance(weight, torch.Tensor) or bias is False:
        return None
    return ("linear" if found[0].name == "linear" else "conv"), weight, bias


def _attr_value(arg: Any, gm: GraphModule) -> torch.Tensor | None | bool:
    """The tensor a ``get_attr`` argument reads, None for None, False for anything else."""
    if arg is None:
        return None
    if isinstance(arg, Node) and arg.op == "get_attr":
        value = _fetch(gm, arg.target)
        return value if isinstance(value, torch.Tensor) else False
    return False


def _fold_weights(weight: torch.Tensor, bias: torch.Tensor | None, running_mean: torch.Tensor,
                  running_var: torch.Tensor, gamma: torch.Tensor | None,
                  beta: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.rsqrt(running_var + eps)
    if gamma is not None:
        scale = scale * gamma
    new_weight = weight * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    new_bias = (bias if bias is not None else torch.zeros_like(running_mean)) - running_mean
    new_bias = new_bias * scale
    if beta is not None:
        new_bias = new_bias + beta
    return new_weight.to(weight.dtype).detach(), new_bias.to(weight.dtype).detach()


# ---------------------------------------------------------------------- applying
def _apply_module(gm: GraphModule, fold: _Fold) -> None:
    target = fold.layer.target
    layer = copy.deepcopy(_fetch(gm, target))
    layer.weight = nn.Parameter(fold.weight, requires_grad=layer.weight.requires_grad)
    layer.bias = nn.Parameter(fold.bias, requires_grad=layer.weight.requires_grad)
    shared = any(n is not fold.layer and n.op in ("call_module", "get_attr")
                 and (n.target == target or n.target.startswith(target + ".")) for n in gm.graph.nodes)
    if shared:  # the original layer is used elsewhere: install the folded copy beside it
        new_target = _fresh(gm, target.replace(".", "_") + "_folded")
        gm.add_submodule(new_target, layer)
        fold.layer.target = new_target
    else:
        gm.add_submodule(target, layer)


def _apply_functional(gm: GraphModule, fold: _Fold, counter: Any) -> None:
    info, args = resolve(fold.layer, gm)
    graph = gm.graph
    stem = _fresh(gm, f"_folded_bn_{next(counter)}", ("_weight", "_bias"))
    with graph.inserting_before(fold.layer):
        for key, value in (("weight", fold.weight), ("bias", fold.bias)):
            gm.register_buffer(f"{stem}_{key}", value)
            args[key] = graph.get_attr(f"{stem}_{key}")
    new_args, new_kwargs = call_args(info, args)
    fold.layer.target = info.torch_fn
    fold.layer.args, fold.layer.kwargs = new_args, new_kwargs


def _delete_unused_submodules(gm: GraphModule, paths: set[str]) -> None:
    """Delete the folded BatchNorm modules (as torch.fx's fuser does) unless still used."""
    used = [n.target for n in gm.graph.nodes if n.op in ("call_module", "get_attr")]
    for path in sorted(paths, key=len, reverse=True):
        if path and not any(u == path or u.startswith(path + ".") for u in used) \
                and isinstance(_fetch(gm, path), _BATCH_NORMS):
            gm.delete_submodule(path)


# ---------------------------------------------------------------------- helpers
def _rank(node: Node) -> int | None:
    meta = node.meta.get("tensor_meta")
    return len(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _fetch(module: Any, target: str) -> Any:
    obj = module
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _fresh(gm: GraphModule, stem: str, suffixes: tuple[str, ...] = ("",)) -> str:
    """``stem`` or ``stem_1``... such that no ``name + suffix`` is taken on ``gm``."""
    taken = set(dir(gm))
    for i in itertools.count():
        name = stem if i == 0 else f"{stem}_{i}"
        if not any(name + s in taken for s in suffixes):
            return name
    raise AssertionError("unreachable")
