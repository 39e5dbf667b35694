"""explicit_autocast: spell out the casts autocast made, so ops recorded under it can fuse.

Under ``torch.autocast`` an op may run in another dtype than its inputs' promotion gives:
autocast casts the inputs first (``softmax`` and ``layer_norm`` to float32 on CUDA,
``prelu`` to bfloat16 on CPU, say). A replayed extern op sees autocast again, but a
Triton kernel does not, so for each pointwise, reduction or composite op that the capture
recorded under autocast (``meta["autocast"]``) with a floating result, the pass casts its
floating inputs of another dtype to the recorded result's dtype, as autocast did::

    # recorded under autocast(cuda, bfloat16)      # after
    softmax = F.softmax(x, -1)                      to = x.to(torch.float32)
        # x: bfloat16, result: float32              softmax = F.softmax(to, -1)

For an op autocast leaves alone, the cast gives what promotion gives (a float32 result
of bfloat16 and float32 inputs), except for the norms that take a half input with float32
parameters themselves (``layer_norm``, ``rms_norm`` on CPU): their result has the input's
dtype, computed with the float32 parameters, which stay as they are (cast, they made
results one bfloat16 unit off eager's: fuzz_train seed 500128).

The matmul family (``linear``, ``matmul``, ``addmm``, ``baddbmm``,
``scaled_dot_product_attention``) is cast too, where the recording shows that autocast
cast it (a 16-bit result of a float32 input): each floating input of another dtype, not
float64 (which autocast leaves alone), is cast to the result's dtype as a graph op. The op
itself still runs as recorded, under autocast, which then finds nothing left to cast. A
cast of a group's result then fuses into that group (a layer norm writes its 16-bit
result directly), and the casts of parameters become one call (``batched_casts``): a
nanoGPT step's 120 casts were as many kernels and autograd nodes::

    # recorded under autocast(cuda, bfloat16)      # after
    h = F.layer_norm(x, (768,), w, b)               h = F.layer_norm(x, (768,), w, b)
    y = F.linear(h, weight, bias)                   to = h.to(torch.bfloat16)
        # h, weight, bias: float32; y: bfloat16     to_1 = weight.to(torch.bfloat16)
                                                    to_2 = bias.to(torch.bfloat16)
                                                    y = F.linear(to, to_1, to_2)

Other extern ops run as recorded, under autocast.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import resolve, view_base

__all__ = ["explicit_autocast"]

# composite norms whose kernels take a 16-bit input with float32 parameters (result: the
# input's dtype); group_norm and batch_norm do too, but are extern ops: they run as recorded
_MIXED_NORMS = frozenset({"layer_norm", "rms_norm"})

# extern ops that autocast runs in its 16-bit dtype, each of its floating inputs cast
_LOWER_PRECISION = frozenset({
    F.linear, torch._C._nn.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm,
    torch.baddbmm, F.scaled_dot_product_attention})
_LOWER_PRECISION_METHODS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm"})
_HALVES = (torch.float16, torch.bfloat16)


def _dtype(a: Any) -> Any:
    tm = a.meta.get("tensor_meta") if isinstance(a, Node) else None
    return getattr(tm, "dtype", None)


def explicit_autocast(gm: GraphModule) -> GraphModule:
    """Cast the inputs of ops recorded under autocast to the dtype they ran in.

    Args:
        gm: a recorded graph whose nodes carry ``tensor_meta`` (from the recording).

    Returns:
        ``gm``, recompiled if anything changed.
    """
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if not node.meta.get("autocast") or node.op not in ("call_function", "call_method"):
            continue
        if node.target in _LOWER_PRECISION or (node.op == "call_method"
                                               and node.target in _LOWER_PRECISION_METHODS):
            changed |= _cast_lower_precision(node)
            continue
        found = resolve(node, gm)
        want = _dtype(node)
        if found is None or want is None or not want.is_floating_point or \
                found[0].kind not in ("pointwise", "reduction", "composite"):
            continue
        x = found[1].get("input")
        if found[0].name in _MIXED_NORMS and isinstance(x, Node) and _dtype(x) == want:
            continue  # autocast left it alone: its own mixed-dtype kernel
        for inp in node.all_input_nodes:
            dtype = _dtype(inp)
            if dtype is None or dtype == want or not dtype.is_floating_point:
                continue
            with graph.inserting_before(node):
                node.replace_input_with(inp, _cast(inp, want, node))
            changed = True
    if changed:
        gm.recompile()
    return gm


def _cast_lower_precision(node: Node) -> bool:
    """Cast the floating inputs of a matmul-family ``node`` to its 16-bit result's dtype,
    where one of them is float32 (autocast cast them: without it the call would have
    raised on mixed dtypes, or given a float32 result). Returns whether it changed."""
    want = _dtype(node)
    device = node.meta.get("device")
    if want not in _HALVES or device is None:
        return False
    inputs = {a: d for a in node.all_input_nodes
              if (d := _dtype(a)) is not None and d.is_floating_point and d != torch.float64}
    if torch.float32 not in inputs.values() or any(
            a.meta.get("device") is None or a.meta["device"].type != device.type
            for a in inputs):
        return False
    graph = node.graph
    for inp, dtype in inputs.items():
        if dtype == want:
            continue
        chain = _whole_views(inp)  # cast their base, then view it: the cast joins its group
        with graph.inserting_before(node):
            cast = _cast(chain[-1].args[0] if chain else inp, want, node)
            for view in reversed(chain):
                base = view.args[0]
                cast = graph.node_copy(
                    view, lambda n, base=base, cast=cast: cast if n is base else n)
                cast.meta.update(tensor_meta=view.meta["tensor_meta"]._replace(dtype=want),
                                 type=torch.Tensor, device=view.meta.get("device"))
        node.replace_input_with(inp, cast)
    return True


def _cast(x: Node, dtype: torch.dtype, site: Node) -> Node:
    """``x.to(dtype)`` as a node, at the graph's insertion point, for the op ``site``."""
    cast = x.graph.call_method("to", (x, dtype))
    cast.meta.update(tensor_meta=x.meta["tensor_meta"]._replace(dtype=dtype),
                     type=torch.Tensor, device=x.meta.get("device"),
                     stack_trace=site.meta.get("stack_trace"))
    return cast


def _whole_views(x: Node) -> list[Node]:
    """The chain of views from ``x`` up to the value it views (``x`` first), where each is
    a contiguous view of all of a contiguous value (GPT-2's ``addmm(b, h.view(-1, 768), w)``):
    a cast of that value, viewed the same way, is the same tensor; empty otherwise."""
    chain: list[Node] = []
    while True:
        base = view_base(x) if x.op in ("call_function", "call_method") else None
        if not isinstance(base, Node) or base is not x.args[0] or not _whole(x, base):
            return chain
        chain.append(x)
        x = base


def _whole(view: Node, base: Node) -> bool:
    v, b = view.meta.get("tensor_meta"), base.meta.get("tensor_meta")
    return all(getattr(m, "memory_format", None) == torch.contiguous_format for m in (v, b)) \
        and v.dtype == b.dtype and v.shape.numel() == b.shape.numel()
