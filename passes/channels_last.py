"""channels_last_convs: run a conv net's activations in channels-last layout.

On recent NVIDIA GPUs cuDNN's convolution kernels read and write NHWC. Given NCHW
(contiguous) tensors, each convolution first transposes its input to NHWC and its
output back: for resnet50 at batch 32 in bf16 on an H200 the GPU was busy 3.71 ms per
forward in NCHW and 2.46 ms with a channels-last input (measured with
``torch.profiler``). A convolution given a channels-last input returns a channels-last
output, and pointwise ops, BatchNorm and pooling keep that layout, so converting the
graph's own inputs to the convolutions is enough for the layout to carry through the net.

It pays for depthwise convolutions too. An earlier rule left float32 graphs with one in
NCHW (convnext_tiny's kernels took 6.12 ms a call channels-last against 4.32 in NCHW, on
an earlier torch); with torch 2.11 and cuDNN 9.19 on an H200, cuDNN's NHWC depthwise
kernel beat torch's NCHW one in every shape of ``benchmarks/bench_depthwise.py``, in
float32 (convnext_tiny's 7x7 at 96 channels: 185 us against 320; maxvit_t's 3x3 at 256:
76 against 248) and in bfloat16, and dropping the rule took the GPU time of a float32
call from 3,949 to 3,905 us for convnext_tiny, 1,572 to 1,273 for mobilenet_v3_large,
2,656 to 2,015 for efficientnet_b0 and 10,042 to 9,678 for maxvit_t (batch 32, one
process per tree; BENCHMARKS.md, nineteenth session).

What this pass changes, and what it keeps:

- each 4-d input of the graph (placeholder or attribute) that a ``conv2d`` reads, directly
  or through a constant pad (timm's "same" padding), is converted for that read only
  (``torch.clone(x, memory_format=torch.channels_last)``, a copy kernel once fused); other
  readers, and writes, still see the tensor itself;
- a copy into a contiguous NCHW value whose channels come from the source's last dim
  (``reshape(permute(s, (0, 5, 1, 3, 2, 4)), (N, C, H, W))``: MaxViT's window
  departition), read by a convolution after it, copies into NHWC instead and is seen
  as NCHW through a permute: the same values, channels-last, and the copy keeps the
  channels innermost on both sides. On an H200 at batch 32 this took maxvit_t's GPU time
  a call from 9,688 to 8,313 us in float32 and from 7,631 to 6,054 in bfloat16, its
  convolutions after the first attention layer no longer in NCHW;
- values the graph returns that depend on a converted read get back eager's layout
  (``.contiguous()``, or channels-last where eager's was), so callers see eager's strides;
- a value returned through a chain of reshapes (``flatten``, ``reshape``, ``squeeze``,
  ``unsqueeze``) of a tensor nothing else reads, as squeezenet returns
  ``torch.flatten(pool, 1)``, gets eager's layout back before the chain, so the reshapes
  give eager's strides;
- a graph that returns such a value through another view, or with a layout that is
  neither contiguous nor channels-last, is left unchanged: copying it back could break
  an alias eager's result had. So is one where such a value meets an op whose result
  depends on the layout (``view``, ``as_strided``, ``stride()``, storing it with
  ``setattr``), or a random draw shaped like a value whose strides change
  (``rand_like``, training-mode dropout: their numbers follow the memory order, so each
  element would get another than eager's; found on the new metadata, the graph then put
  back as it was);
- the metadata of the values whose layout changes (the recorded ``tensor_meta_rec``, or
  ShapeProp's ``tensor_meta``) is computed again on meta tensors, so that the passes after
  it, and the parallel precompile, see the strides the graph runs with;
- the weights of those convolutions (attributes, or inputs when a training step takes
  the model as an argument) are converted on each call, in the graph, by the same
  clone: a Triton copy kernel. Under autograd the clone's backward kernel writes the
  weight's gradient back in the weight's layout; without the conversion cuDNN copied each
  weight in the forward, again in the backward, and AccumulateGrad copied the
  channels-last gradient (resnet18's training step on an H200: 51 strided copies, 194 us
  of GPU time a step). Left to cuDNN, the conversion took the
  same GPU time and more host time (resnet50, bf16, batch 32, H200: 3.0-3.3 ms of host
  time a call against 3.4-8.6 ms, in three alternating runs on a noisy host); torch's own
  copy kernel (``x.contiguous(memory_format=...)``) took 95 us of GPU time a call for
  resnet50's 18 conversions in float32. A copy kept between calls could go stale: a write
  through ``w.data`` changes no version counter that a check could read.

Example::

    # before                                    # after
    conv2d = torch.conv2d(x, w, b)              x_cl = torch.clone(x, memory_format=torch.channels_last)
    relu = torch.relu(conv2d)                   conv2d = torch.conv2d(x_cl, w, b)
    return relu                                 relu = torch.relu(conv2d)
                                                return relu.contiguous()
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
from fxlite.passes.shape_prop import (
    CONVS,
    TensorMetadata,
    fill_missing_meta,
    memory_format_of,
    node_layout,
    recorded_metadata,
)

from fxlite.graph_module import GraphModule
from fxlite.node import Node, map_arg, target_name
from fxlite.ops import lookup
from fxlite.ops.records import draws_by_layout

__all__ = ["CONVS", "channels_last_convs"]

CL = torch.channels_last
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# ops whose result may share memory with an argument (a conservative list: any other op
# makes a new tensor)
_VIEWS = frozenset({"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten",
                    "permute", "transpose", "t", "expand", "expand_as", "squeeze",
                    "unsqueeze", "narrow", "select", "as_strided", "split", "chunk",
                    "unbind", "diagonal", "movedim", "swapaxes", "swapdims", "detach",
                    "getitem", "contiguous", "unfold", "real", "imag", "view_as_real"})


# ops whose result depends on the layout (or that fail on a non-contiguous tensor)
_LAYOUT_SENSITIVE = frozenset({"view", "view_as", "as_strided", "stride", "is_contiguous",
                               "data_ptr", "untyped_storage", "storage", "set_", "resize_",
                               "setattr"})


_SIZE_READS = frozenset({"size", "dim", "numel", "nelement", "ndimension", "stride",
                         "is_contiguous", "data_ptr"})
_SIZE_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "layout", "is_cuda"})


def _tensors_from(starts: list[Node]) -> set[Node]:
    """The values computed from ``starts`` (by their users, transitively), not through
    a size read: ``torch.empty(x.shape)`` has no layout of ``x``'s."""
    found: set[Node] = set()
    todo = list(starts)
    while todo:
        n = todo.pop()
        name = target_name(n)
        if n in found or name in _SIZE_READS or name == "getattr" and len(n.args) > 1 \
                and n.args[1] in _SIZE_ATTRIBUTES:
            continue
        found.add(n)
        todo.extend(u for u in n.users if u.op != "output")
    return found


def _drawn_like(n: Node) -> Node | None:
    """The tensor a random draw ``n`` takes its layout from (``rand_like(y)``: ``y``;
    ``t.uniform_()``: ``t``; ``dropout(y)``: ``y``): its first tensor argument."""
    for a in (*n.args, *n.kwargs.values()):
        if isinstance(a, Node) and _layout(a) is not None:
            return a
    return None


def _strides(n: Node) -> tuple | None:
    layout = node_layout(n)
    return None if layout is None else tuple(layout[1])


def _layout(node: Node) -> tuple[tuple, torch.dtype, Any] | None:
    """(shape, dtype, memory format) recorded for ``node``'s value, or None."""
    layout = node_layout(node)
    if layout is None:
        return None
    shape, stride, dtype = layout
    fmt = memory_format_of(shape, stride)
    return shape, dtype, fmt if fmt in (torch.contiguous_format, CL) else None


def _channels_last_already(shape: tuple) -> bool:
    """Whether a contiguous NCHW tensor of ``shape`` is channels-last too: one channel (a
    depthwise convolution's weight) or a 1x1 plane (a pointwise one's)."""
    return shape[1] == 1 or shape[2] * shape[3] == 1


def _root(n: Node, names: dict[str, Node]) -> Node | None:
    """The node that made the tensor ``n`` returns (through in-place ops, which return
    their input), or None if that tensor may view another one. ``names``: the graph's
    nodes by name."""
    while True:
        if n.meta.get("same_object") is not None:
            n = names.get(n.meta["same_object"])
        elif (n.meta.get("returns_input") or target_name(n).endswith("_")) and n.args \
                and isinstance(n.args[0], Node):  # an in-place op: its input's tensor
            n = n.args[0]
        else:
            break
        if n is None:
            return None
    if n.op != "call_function" and n.op != "call_method" or target_name(n) in _VIEWS:
        return None
    return n


def _constant_pad(n: Any) -> bool:
    """Whether ``n`` pads with a constant (``F.pad``'s default mode), an op that keeps its
    input's layout (timm's "same" padding pads the image before the stem's conv)."""
    if not isinstance(n, Node) or n.op != "call_function" or not n.args:
        return False
    if n.target is torch.constant_pad_nd:
        return True
    mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
    return n.target is torch.nn.functional.pad and mode == "constant"


def channels_last_convs(gm: GraphModule) -> bool:
    """Convert the graph inputs that ``conv2d`` reads to channels-last (see the module
    docstring). Returns whether ``gm`` changed; it is left unchanged when nothing would
    carry the layout or a returned value could not get eager's layout back."""
    graph = gm.graph
    reads: list[tuple[Node, Node]] = []  # (conv, or the pad before it; the input it reads)
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in CONVS or not n.args:
            continue
        reader, x = n, n.args[0]
        if _constant_pad(x) and isinstance(x.args[0], Node):
            reader, x = x, x.args[0]  # a padded input ("same" padding): converted at the pad
        if not isinstance(x, Node) or x.op not in ("placeholder", "get_attr"):
            continue
        layout = _layout(x)
        if layout is None or len(layout[0]) != 4 or layout[1] not in _FLOATS \
                or layout[2] is not torch.contiguous_format:
            continue
        reads.append((reader, x))
    switches = _layout_switches(graph)
    if not reads and not switches:
        return False
    downstream: set[Node] = set()
    starts = [reader for reader, _ in reads] + [s.reshape for s in switches]
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n not in downstream:
            downstream.add(n)
            stack.extend(u for u in n.users if u.op != "output")
    if any(target_name(n) in _LAYOUT_SENSITIVE for n in downstream):
        return False
    # random draws shaped like a value computed from a converted one: the conversion
    # stands only if that value keeps eager's strides (checked after it, on the new
    # metadata; the graph as it was is kept to go back to)
    draws = [n for n in _tensors_from(starts) if draws_by_layout(n, gm)]
    drawn = {n: a for n in draws if (a := _drawn_like(n)) is not None}
    if len(drawn) < len(draws):
        return False  # a draw shaped like nothing we can follow
    strides = {a: _strides(a) for a in drawn.values()}
    as_it_was = copy.deepcopy(graph) if drawn else None
    output = next(n for n in graph.nodes if n.op == "output")
    returned: list[tuple[Node, Any]] = []
    roots: set[Node] = set()
    names = {m.name: m for m in graph.nodes}
    before_views: list[tuple[Node, Node, Any]] = []  # (base, its first view, its layout)
    for n in output.all_input_nodes:
        if n not in downstream:
            continue
        layout, root = _layout(n), _root(n, names)
        if root is None:
            found = _reshaped(n, downstream, output)
            if found is None or found[0] in roots:
                return False  # a view, or two results sharing one tensor: a copy would split them
            roots.add(found[0])
            before_views.append(found)
            continue
        if layout is None or layout[2] is None or root in roots:
            return False
        roots.add(root)
        returned.append((n, layout[2]))
    for switch in switches:
        downstream.discard(switch.reshape)
        downstream.add(_switch_to_channels_last(graph, switch))
    for reader, x in reads:
        with graph.inserting_before(reader):
            cl = graph.call_function(torch.clone, (x,), {"memory_format": CL})
        cl.meta["channels_last_of"] = x.name
        reader.replace_input_with(x, cl)
    converted: dict[Node, Node] = {}  # a weight two convs share is converted once
    # every conv now reads channels-last: so should its weight (graph order, so that a
    # shared weight's conversion comes before its first reader)
    for conv in [n for n in graph.nodes if n in downstream]:
        w = conv.args[1] if conv.target in CONVS and len(conv.args) > 1 else None
        layout = _layout(w) if isinstance(w, Node) and w.op in ("get_attr", "placeholder") \
            else None
        if layout is not None and len(layout[0]) == 4 and layout[2] is torch.contiguous_format \
                and not _channels_last_already(layout[0]):
            if w not in converted:
                with graph.inserting_before(conv):
                    converted[w] = graph.call_function(torch.clone, (w,), {"memory_format": CL})
                converted[w].meta["channels_last_of"] = w.name
            conv.replace_input_with(w, converted[w])
    restored: dict[Node, Node] = {}
    for n, fmt in returned:
        with graph.inserting_before(output):
            kwargs = {} if fmt is torch.contiguous_format else {"memory_format": fmt}
            restored[n] = graph.call_method("contiguous", (n,), kwargs)
            restored[n].meta.update({k: v for k, v in n.meta.items()
                                     if k in ("tensor_meta_rec", "tensor_meta", "type")})
    output.args = map_arg(output.args, lambda a: restored.get(a, a))
    for base, first, fmt in before_views:  # eager's layout back before the views
        with graph.inserting_before(first):
            kwargs = {} if fmt is torch.contiguous_format else {"memory_format": fmt}
            back = graph.call_method("contiguous", (base,), kwargs)
        back.meta.update({k: v for k, v in base.meta.items()
                          if k in ("tensor_meta_rec", "tensor_meta", "type")})
        first.replace_input_with(base, back)
    gm.recompile()
    again = _layouts_again(gm, downstream)
    if any(_strides(a) != before or a in downstream and a not in again
           for a, before in strides.items()):
        gm.graph = as_it_was  # a draw would fill another order than eager's
        return False
    return True


class _Switch(NamedTuple):
    """A copy into NCHW that reads its channels along the source's last dim."""

    reshape: Node  # the copying reshape to (N, C, H, W)
    permute: Node  # the permute it reads, C second
    dims: tuple[int, ...]  # the permute's dims with C moved last
    shape: tuple[Any, ...]  # the reshape's sizes in NHWC order


def _layout_switches(graph: Any) -> list[_Switch]:
    """Copies into a contiguous 4-d NCHW value ``reshape(permute(s, dims), (N, C, H, W))``
    whose channels are ``s``'s last dim, of stride 1, and whose value a convolution reads
    (through any ops): MaxViT's window departition, before its next MBConv. Made into
    channels-last (:func:`_switch_to_channels_last`), the copy keeps the channels
    innermost on both sides and the convolutions after it get NHWC."""
    found = []
    for r in graph.nodes:
        if r.op not in ("call_function", "call_method") or target_name(r) != "reshape" \
                or len(r.args) < 2 or r.kwargs:
            continue
        pm, sizes = r.args[0], r.args[1] if len(r.args) == 2 else r.args[1:]
        layout = _layout(r)
        if not isinstance(pm, Node) or pm.op not in ("call_function", "call_method") \
                or target_name(pm) != "permute" or len(pm.users) != 1 or pm.kwargs \
                or not isinstance(sizes, (tuple, list)) or len(sizes) != 4 or layout is None \
                or any(u.op == "output" for u in r.users) \
                or len(layout[0]) != 4 or layout[1] not in _FLOATS \
                or layout[2] is not torch.contiguous_format:
            continue
        src = pm.args[0]
        dims = pm.args[1] if len(pm.args) == 2 else pm.args[1:]
        source = node_layout(src) if isinstance(src, Node) else None
        if source is None or not isinstance(dims, (tuple, list)) \
                or not all(type(d) is int for d in dims) or len(dims) != len(source[0]):
            continue
        rank = len(dims)
        dims = tuple(d % rank for d in dims)
        if dims[1] != rank - 1 or source[1][-1] != 1 \
                or (source[0][dims[0]], source[0][-1]) != tuple(layout[0][:2]) \
                or _views(source, dims, layout[0]) or not _reaches_conv(r):
            continue  # (where eager's reshape is a view, its alias of ``s`` stays)
        found.append(_Switch(r, pm, (dims[0], *dims[2:], dims[1]),
                             (sizes[0], sizes[2], sizes[3], sizes[1])))
    return found


def _views(source: tuple, dims: tuple[int, ...], shape: tuple) -> bool:
    """Whether ``s.permute(dims).reshape(shape)`` is a view, for ``s`` of the layout
    ``source`` (``(shape, stride, dtype)``)."""
    if 0 in source[0]:
        return True
    s = torch.empty_strided(source[0], source[1], dtype=source[2], device="meta")
    try:
        s.permute(dims).view(shape)
    except RuntimeError:
        return False
    return True


def _reaches_conv(n: Node) -> bool:
    seen, stack = set(), [n]
    while stack:
        m = stack.pop()
        if m.op == "call_function" and m.target in CONVS:
            return True
        if m not in seen:
            seen.add(m)
            stack.extend(m.users)
    return False


def _switch_to_channels_last(graph: Any, switch: _Switch) -> Node:
    """Replace ``switch``'s copy into NCHW by one into NHWC, seen as NCHW (the same
    values, channels-last); returns the new value (the old reshape's metadata, for its
    strides to be computed again).

    Example (MaxViT's window departition)::

        # before                                  # after
        permute = x.permute(0, 5, 1, 3, 2, 4)     permute = x.permute(0, 1, 3, 2, 4, 5)
        reshape = permute.reshape(B, C, H, W)     reshape = permute.reshape(B, H, W, C)
                                                  permute_1 = reshape.permute(0, 3, 1, 2)
    """
    r, pm = switch.reshape, switch.permute
    with graph.inserting_before(r):
        moved = graph.call_method("permute", (pm.args[0], switch.dims))
        copied = graph.call_method("reshape", (moved, switch.shape))
        back = graph.call_method("permute", (copied, (0, 3, 1, 2)))
    back.meta = dict(r.meta)
    r.replace_all_uses_with(back)
    graph.erase_node(r)
    graph.erase_node(pm)
    return back


def _layouts_again(gm: GraphModule, changed: set[Node]) -> set[Node]:
    """The metadata of the values whose layout the conversion changed, computed again on
    meta tensors: it was recorded (``tensor_meta_rec``) or propagated (``tensor_meta``) in
    eager's layout, and the parallel precompile plans kernels for what it says. Planned
    for NCHW, a BatchNorm group after a converted convolution keyed its per-channel
    operands as another layout, and compiled again, one kernel after another, at the
    first call. Only strides change; a value that cannot be computed keeps what it had,
    and so does a node with effects other than writing its input (it is not run again,
    not even on meta tensors). Returns the nodes whose metadata was computed again.

    Example (a conv's output, ``tensor_meta_rec``)::

        # before                                  # after
        ((8, 8, 7, 7), (392, 49, 7, 1), ...)      ((8, 8, 7, 7), (392, 1, 56, 8), ...)
    """
    work = GraphModule(gm, copy.deepcopy(gm.graph), type(gm).__name__)
    names = {n.name for n in changed if _runs_again(n, gm)}
    for n in work.graph.nodes:
        if n.name in names:
            for key in ("tensor_meta", "type"):
                n.meta.pop(key, None)
        elif n.meta.get("tensor_meta_rec") is not None:
            n.meta["tensor_meta"] = recorded_metadata(n.meta["tensor_meta_rec"])
            n.meta["type"] = torch.Tensor
    try:
        fill_missing_meta(work)
    except Exception:  # the metadata serves planning only: left as it was
        return set()
    found = {n.name: n.meta.get("tensor_meta") for n in work.graph.nodes if n.name in names}
    done: set[Node] = set()
    for n in changed:
        tm = found.get(n.name)
        if not isinstance(tm, TensorMetadata):
            continue
        rec, old = n.meta.get("tensor_meta_rec"), n.meta.get("tensor_meta")
        if rec is not None and tuple(rec[0]) == tuple(tm.shape) and rec[2] == tm.dtype:
            n.meta["tensor_meta_rec"] = (rec[0], tuple(tm.stride), *rec[2:])
        if isinstance(old, TensorMetadata) and old.shape == tm.shape and old.dtype == tm.dtype:
            n.meta["tensor_meta"] = old._replace(stride=tm.stride, memory_format=tm.memory_format)
        done.add(n)
    return done


def _runs_again(n: Node, gm: GraphModule) -> bool:
    """Whether ``n`` may run again, on meta tensors, for its layout: a pure op, or a tensor
    op that writes its input (``relu_``, ``F.relu(inplace=True)``, ``x.add_``); not a
    function with other effects."""
    if not n.is_impure(impure_random=False):
        return True
    info = lookup(n, gm)
    if info is not None:
        return info.kind != "effect"
    name = target_name(n)
    return n.op in ("call_function", "call_method") and name.endswith("_") \
        and not name.startswith("_") and callable(getattr(torch.Tensor, name, None))


_RESHAPES = frozenset({"flatten", "reshape", "squeeze", "unsqueeze"})


def _reshaped(n: Node, downstream: set[Node], output: Node) -> tuple[Node, Node, Any] | None:
    """For a returned value that is a chain of reshapes (``flatten``, ``reshape``,
    ``squeeze``, ``unsqueeze``) of a tensor nothing else reads, as squeezenet returns
    ``torch.flatten(pool, 1)``: ``(base, the chain's first reshape, base's eager layout)``,
    so that eager's layout can be given back to the base before the chain, which then
    gives eager's strides. Else None."""
    first = n
    while first.op in ("call_function", "call_method") and target_name(first) in _RESHAPES \
            and first.args and isinstance(first.args[0], Node):
        base = first.args[0]
        if target_name(base) not in _RESHAPES or base.op not in ("call_function", "call_method"):
            layout = _layout(base)
            if base not in downstream or base.op == "placeholder" or len(base.users) != 1 \
                    or layout is None or layout[2] is None or target_name(base) in _VIEWS:
                return None
            return base, first, layout[2]
        if len(base.users) != 1 or output in base.users:
            return None
        first = base
    return None
