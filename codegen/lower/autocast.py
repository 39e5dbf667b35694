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
results one bfloat16 unit off eager's: fuzz_train seed 500128). Other ops (extern ones)
run as recorded, under autocast.
"""

from __future__ import annotations

from typing import Any

import torch

from fxlite.graph_module import GraphModule
from fxlite.node import Node
from fxlite.ops import resolve

__all__ = ["explicit_autocast"]

# composite norms whose kernels take a 16-bit input with float32 parameters (result: the
# input's dtype); group_norm and batch_norm do too, but are extern ops: they run as recorded
_MIXED_NORMS = frozenset({"layer_norm", "rms_norm"})


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
                cast = graph.call_method("to", (inp, want))
            cast.meta.update(tensor_meta=inp.meta["tensor_meta"]._replace(dtype=want),
                             type=torch.Tensor, stack_trace=node.meta.get("stack_trace"))
            node.replace_input_with(inp, cast)
            changed = True
    if changed:
        gm.recompile()
    return gm
