"""unpack_attention: ``nn.MultiheadAttention`` as its fast path.

In eval mode, ``nn.MultiheadAttention`` normally runs ``torch._native_multi_head_attention``:
one projection matmul, attention on strided views of its result, and the output
projection. Under any ``__torch_function__`` mode, fxlite.compile's recorder included,
it takes its slow path instead, ``F.multi_head_attention_forward``, which copies the
projected heads into a new layout and copies the attention's output back before the
output projection. On an H200 those copies were 1.2 ms a call of torchvision's
vit_b_16 at batch 32 in bfloat16, about a third of eager's time.

This pass rewrites the slow path's call into what the fast path computes, with the same
math (so eager's results, up to the order cuBLAS sums in). It applies to self-attention
(query, key and value one tensor) with no masks, no extra key/value biases, no attention
weights returned and no dropout (eval mode, or ``dropout=0``); any other call is left as
it is. Where eager itself would take the fast path (:func:`_native`: nothing for autograd
to record, an even head count, no autocast), the call becomes that one op, as in eager.
Elsewhere (a training step through an eval-mode layer, one head) it becomes the fast
path's calls: the projected heads stay views, and ``scaled_dot_product_attention`` picks
its fastest kernel on them.

Example::

    # before
    mha = F.multi_head_attention_forward(x, x, x, 768, 12, w_in, b_in, None, None,
                                         False, 0.0, w_out, b_out, training=False,
                                         need_weights=False, ...)
    out = mha[0]                                  # (L, B, E)

    # after, without grad
    xt = torch.transpose(x, 0, 1)                 # (B, L, E)
    o = torch._native_multi_head_attention(xt, xt, xt, 768, 12, w_in, b_in, w_out, b_out,
                                           None, False, True, None)[0]
    out = torch.transpose(o, 0, 1)                # (L, B, E), as before

    # after, with grad
    xt = torch.transpose(x, 0, 1)                 # (B, L, E)
    qkv = torch._C._nn.linear(xt, w_in, b_in)
    heads = qkv.unflatten(-1, (3, 12, 64)).permute(2, 0, 3, 1, 4)
    q, k, v = heads[0], heads[1], heads[2]        # (B, H, L, D) views
    att = F.scaled_dot_product_attention(q, k, v)
    o = torch._C._nn.linear(att.transpose(1, 2).flatten(2), w_out, b_out)
    out = torch.transpose(o, 0, 1)                # (L, B, E), as before
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.nn.functional as F
from fxlite.passes.shape_prop import node_layout

from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import Node

__all__ = ["unpack_attention"]

_MHA = F.multi_head_attention_forward
_SIGNATURE = inspect.signature(_MHA)
# Arguments that must have these values for the fast path's math to be the same.
_PLAIN = {"bias_k": None, "bias_v": None, "add_zero_attn": False, "key_padding_mask": None,
          "need_weights": False, "attn_mask": None, "use_separate_proj_weight": False,
          "static_k": None, "static_v": None, "is_causal": False}
_CARRIED = ("stack_trace", "site", "grad_enabled", "autocast")  # meta the new nodes keep


def _arguments(node: Node) -> dict[str, Any] | None:
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _plan(node: Node) -> tuple[dict[str, Any], int, int, Node] | None:
    """The call's arguments, head count, head size and its one used result (the
    ``mha[0]`` node), if the call can be unpacked."""
    if node.op != "call_function" or node.target is not _MHA or node.meta.get("impure"):
        return None
    a = _arguments(node)
    if a is None or any(a[k] is not v and a[k] != v for k, v in _PLAIN.items()):
        return None
    q, k, v = a["query"], a["key"], a["value"]
    if not (isinstance(q, Node) and q is k is v) or not isinstance(a["in_proj_weight"], Node):
        return None
    if a["training"] and a["dropout_p"] != 0:
        return None
    layout = node_layout(q)
    heads, embed = a["num_heads"], a["embed_dim_to_check"]
    if layout is None or len(layout[0]) != 3 or layout[0][2] != embed or type(heads) is not int \
            or heads <= 0 or embed % heads:
        return None
    users = list(node.users)
    if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
        return None
    return a, heads, embed // heads, users[0]


def _layouts(made: list[Node]) -> bool:
    """Give the new nodes the layout records the later passes read, computed on meta
    tensors; False if an input's layout is unknown or the calls fail on them."""
    env: dict[Node, Any] = {}
    grad: dict[Node, bool] = {}  # whether autograd records the value
    device = None

    def value(a: Any) -> Any:
        nonlocal device
        if not isinstance(a, Node):
            return a
        if a not in env:
            layout = node_layout(a)
            if layout is None:
                raise LookupError(a.name)
            rec = a.meta.get("tensor_meta_rec") or (None,) * 5
            device = device or rec[3]
            grad[a] = bool(rec[4] or a.meta.get("requires_grad"))
            env[a] = torch.empty_strided(layout[0], layout[1], dtype=layout[2], device="meta")
        return env[a]

    try:
        for new in made:
            args = tuple(value(a) for a in new.args)
            fn = getattr(torch.Tensor, new.target) if new.op == "call_method" else new.target
            env[new] = out = fn(*args)
            grad[new] = bool(new.meta.get("grad_enabled")) and any(
                grad.get(a, False) for a in new.args if isinstance(a, Node))
            if isinstance(out, tuple):  # (the native op's output and its unused weights)
                new.meta["type"] = tuple
            elif device is not None:  # recorded layouts (else later passes compute them)
                new.meta["type"] = torch.Tensor
                new.meta["requires_grad"] = grad[new]
                new.meta["tensor_meta_rec"] = (tuple(out.shape), out.stride(), out.dtype,
                                               device, grad[new])
    except (LookupError, RuntimeError, TypeError):
        return False
    return True


def _native(node: Node, a: dict[str, Any], heads: int) -> bool:
    """Whether eager's ``nn.MultiheadAttention`` would run ``_native_multi_head_attention``
    for this call (its fast path's conditions that the call's record shows): eval mode,
    an even head count, one dtype, no autocast, and nothing autograd records. Then the
    call becomes that one op, as in eager, rather than its eleven calls: on an H200,
    vit_b_16's recorded ops at batch 32 in bfloat16 spent 7.3 ms of host time a call
    against eager's 5.4, for the same GPU time."""
    tensors = [a[k] for k in ("query", "in_proj_weight", "in_proj_bias", "out_proj_weight",
                              "out_proj_bias")]
    if a["training"] or heads % 2 or node.meta.get("autocast") or \
            not all(isinstance(t, Node) for t in tensors):
        return False
    records = [t.meta.get("tensor_meta_rec") for t in tensors]
    if any(r is None for r in records) or len({r[2] for r in records}) != 1:
        return False
    return not (node.meta.get("grad_enabled") and any(r[4] for r in records))


def unpack_attention(gm: GraphModule) -> bool:
    """Rewrite each unpackable ``F.multi_head_attention_forward`` call into its fast
    path's calls (see the module docstring). Returns whether ``gm`` changed."""
    graph = expect_graph_module(gm, "unpack_attention").graph
    changed = False
    for node in list(graph.nodes):
        plan = _plan(node)
        if plan is None:
            continue
        a, heads, size, first = plan
        made: list[Node] = []

        def call(target: Any, *args: Any, op: str = "call_function",
                 made: list[Node] = made) -> Node:
            new = graph.create_node(op, target, args, {})
            made.append(new)
            return new

        with graph.inserting_before(node):
            x = call(torch.transpose, a["query"], 0, 1)
            if _native(node, a, heads):  # eager's own op, where eager takes it
                both = call(torch._native_multi_head_attention, x, x, x, heads * size, heads,
                            a["in_proj_weight"], a["in_proj_bias"], a["out_proj_weight"],
                            a["out_proj_bias"], None, False, True, None)
                out = call(operator.getitem, both, 0)
            else:
                qkv = call(torch._C._nn.linear, x, a["in_proj_weight"], a["in_proj_bias"])
                split = call("unflatten", qkv, -1, (3, heads, size), op="call_method")
                per_head = call("permute", split, (2, 0, 3, 1, 4), op="call_method")
                q, k, v = (call(operator.getitem, per_head, i) for i in range(3))
                att = call(F.scaled_dot_product_attention, q, k, v)
                rows = call("flatten", call("transpose", att, 1, 2, op="call_method"), 2,
                            op="call_method")
                out = call(torch._C._nn.linear, rows, a["out_proj_weight"], a["out_proj_bias"])
            result = call(torch.transpose, out, 0, 1)
        for new in made:
            new.meta.update({key: node.meta[key] for key in _CARRIED if key in node.meta})
        if not _layouts(made):
            for new in reversed(made):
                graph.erase_node(new)
            continue
        first.replace_all_uses_with(result)
        graph.erase_node(first)
        graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return changed
