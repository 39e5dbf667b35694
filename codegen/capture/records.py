"""The records a capture produces: a recorded path (:class:`Recording`), its calls
(:class:`Step`) and reads (:class:`Read`), and where in the user's code a call came from.

See ``fxlite.codegen.capture.run`` for how a recording is made and ``segments`` for how it
is cut and replayed.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import linecache
import os
import re
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from fxlite.graph import Graph

__all__ = ["LIB_DIRS", "ConstRef", "EagerValue", "NodeRef", "ObjectRef", "Out", "Read", "Recording",
           "ResultRef", "SeqOut", "Slot", "Step", "TensorOut", "ValueOut", "format_site",
           "last_frame", "layout_copies", "layout_copy", "recording_in_thread", "recording_thread",
           "result_leaves", "strided_clone", "tensor_meta", "user_site"]

# Frames in these folders are fxlite's or torch's, never the user's.
LIB_DIRS = tuple(os.path.dirname(os.path.abspath(p)) + os.sep for p in (
    torch.__file__, os.path.dirname(os.path.abspath(__file__)), sys.modules["fxlite"].__file__,
    sys.modules["fxlite.graph"].__file__,
    # fxlite.passes: its own folder (setup.cfg's package_dir), entered when a first
    # backward compiles its kernels inside a recorded call
    importlib.util.find_spec("fxlite.passes").origin))
_LOCAL = threading.local()


def layout_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (detached) with ``t``'s strides, where ``clone()`` gives a sliced
    tensor row-major ones: a check that starts from the copy then sees the memory overlaps
    the program saw (``v = x.unsqueeze(0); v.mul_(x)`` runs on a sliced ``x`` and raises on
    a row-major one; fuzz seed 9805300). An expanded tensor (a stride 0) is cloned."""
    with torch.no_grad():
        return strided_clone(t.detach())


def layout_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`layout_copy` of each tensor, where tensors that share memory get copies that
    share one copy of it the same way: a check that writes one then sees the write through
    the others, as the program does (``v = b.squeeze()``, a branch on a value, ``b += 1``,
    ``v`` returned: separate copies gave the check the old ``v``, and the path ran in
    eager for it; fuzz seed 12006268).

    Example::

        b = torch.zeros(7); v = b.squeeze()
        cb, cv = layout_copies([b, v])
        cb += 1                       # cv sees it, as v sees b += 1
    """
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        key = _shared_storage(t)
        groups.setdefault(-1 - i if key is None else key, []).append(i)
    out: list[Any] = [None] * len(tensors)
    with torch.no_grad():
        for members in groups.values():
            if len(members) == 1:
                out[members[0]] = layout_copy(tensors[members[0]])
                continue
            # the bytes the members span, from a multiple of the widest itemsize (each
            # member's offset into the copy is then a whole number of its elements)
            width = max(tensors[i].element_size() for i in members)
            spans = [_byte_span(tensors[i]) for i in members]
            lo = min(a for a, _ in spans) // width * width
            hi = max(b for _, b in spans)
            first = tensors[members[0]]
            whole = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
                first.untyped_storage())
            storage = whole[lo:hi].clone().untyped_storage()
            for i in members:
                t = tensors[i]
                out[i] = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    storage, t.storage_offset() - lo // t.element_size(), t.shape, t.stride())
    return out


def _shared_storage(t: torch.Tensor) -> int | None:
    """The storage by which :func:`layout_copies` groups ``t``, or None where ``t`` gets a
    copy of its own: no storage to share (a tensor subclass), or a conjugate or negative
    view, which reads its memory through a flag a copy of the bytes would lose."""
    if t.layout != torch.strided or t.is_conj() or t.is_neg():
        return None
    try:
        return t.untyped_storage()._cdata
    except Exception:
        return None


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``t`` reaches: ``[first, last + 1)``."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def strided_clone(t: torch.Tensor) -> torch.Tensor:
    """``t.clone()`` with ``t``'s strides (see :func:`layout_copy`), recorded by autograd
    as a clone is; an expanded tensor (a stride 0) is cloned.

    Example::

        strided_clone(x[..., ::2]).stride()   # x[..., ::2].stride(), not row-major ones
    """
    if t.is_contiguous() or any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        return t.clone()
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def recording_thread() -> Any:
    """The recorder active in this thread, or None (used by fxlite's call hooks)."""
    return getattr(_LOCAL, "recorder", None)


@contextlib.contextmanager
def recording_in_thread(recorder: Any) -> Iterator[None]:
    """Make ``recorder`` (a ``Recorder`` or a followed call's ``Follower``) what
    :func:`recording_thread` returns while the block runs, then the outer one again."""
    outer = getattr(_LOCAL, "recorder", None)
    _LOCAL.recorder = recorder
    try:
        yield
    finally:
        _LOCAL.recorder = outer


def user_site() -> tuple[str, int, str, str] | None:
    """``(file, line, function, source)`` of the innermost frame of the user's code; in
    a Dynamo graph's generated code, the user's line that Dynamo traced it from."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(LIB_DIRS) or name.startswith("<fxlite")
                or name.startswith("<frozen")):
            if name.startswith("<eval_with_key>"):
                site = _graph_site(f.f_locals.get("self"), f.f_lineno)
                if site is not None:
                    return site
            return (name, f.f_lineno, f.f_code.co_name,
                    linecache.getline(name, f.f_lineno).strip())
        f = f.f_back
    return None


_GRAPH_NODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # gm -> its nodes
_TRACE_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _graph_site(gm: Any, line: int) -> tuple[str, int, str, str] | None:
    """The user's site of the node at ``line`` of a ``torch.fx.GraphModule``'s generated
    code: the last frame of the stack trace Dynamo put on it, or None."""
    lines = getattr(gm, "_lineno_map", None)
    if not lines:
        return None
    index = lines.get(line - getattr(gm, "_prologue_start", 0))
    if index is None:
        return None
    nodes = _GRAPH_NODES.get(gm)
    if nodes is None or len(nodes) <= index:
        nodes = _GRAPH_NODES[gm] = list(gm.graph.nodes)
    if index >= len(nodes):
        return None
    return last_frame(nodes[index].meta.get("stack_trace") or "")


def last_frame(trace: str) -> tuple[str, int, str, str] | None:
    """``(file, line, function, source)`` of the last frame of a stack trace as text
    (``File "x.py", line 6, in f`` and the source line below it), or None."""
    found = _TRACE_LINE.findall(trace)
    if not found:
        return None
    file, number, function, source = found[-1]
    return file, int(number), function, source.strip()


def format_site(site: tuple[str, int, str, str] | None) -> str:
    """``File "x.py", line 6, in f`` plus the source line, as torch.fx's stack traces."""
    if site is None:
        return "(no user frame found)"
    return f'File "{site[0]}", line {site[1]}, in {site[2]}\n    {site[3]}'


class TensorOut(NamedTuple):
    """A recorded call's result that is one tensor: its layout (:func:`tensor_meta`)."""

    meta: tuple


class SeqOut(NamedTuple):
    """A recorded call's result that is a sequence holding tensors (a tuple, a list, a
    ``torch.return_types`` struct sequence or a named tuple), item by item."""

    cls: type
    items: list[Out]


class ValueOut(NamedTuple):
    """A recorded call's result that holds no tensor: the value itself."""

    value: Any


Out = TensorOut | SeqOut | ValueOut


@dataclass(eq=False)
class Step:
    """One recorded call, as fast-forwarding a new path replays it (see ``segments``)."""

    func: Any
    node: str  # the node's name in the graph
    out: Out  # the result's structure
    read: bool = False


@dataclass(eq=False)
class Read:
    """A value Python read from tensors: the end of a segment."""

    node: str
    value: Any
    site: tuple[str, int, str, str] | None
    live: list[str]  # recorded values still referenced when the read happened


class EagerValue(NamedTuple):
    """The tensor eager PyTorch computed for a node while recording, held weakly, and its
    version counter then (it is that value only while the counter has not moved)."""

    ref: weakref.ref[torch.Tensor]
    version: int


@dataclass(eq=False)
class Recording:
    """One path through the user's Python, as a graph plus what replaying it needs."""

    graph: Graph
    holder: torch.nn.Module  # owns the parameters, buffers and constants of get_attr nodes
    in_spec: Any
    placeholders: list[str | None]  # per input leaf: its placeholder name, None if not a tensor
    out_spec: Any = None
    out_refs: list[ResultRef] = field(default_factory=list)  # per result leaf: result_leaves
    steps: list[Step] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    sizes_read: bool = False
    # with sizes_read: the positions of the sizes taken as inputs that alone decide it
    # (capture/symbolic.py's escaped_positions), or None for every size
    sizes_from: tuple[int, ...] | None = None
    grad_reads: list[Any] = field(default_factory=list)  # (tensor, .grad was None) Python read
    unsupported: str | None = None  # why it stopped: the call ran on in eager PyTorch
    effect: str | None = None  # why its Python must run on every call (codegen/capture/follow.py)
    rng_state: Any = None
    ambient: Any = None  # grad mode and autocast where the recording (or its new part) began
    pre_state: dict[str, torch.Tensor] = field(default_factory=dict)  # externals before writes
    unknown_pre_state: bool = False  # an external changed without a snapshot: no checks
    expected: dict[str, EagerValue] = field(default_factory=dict)  # by node name
    externals: dict[str, Any] = field(default_factory=dict)  # get_attr target -> object
    modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    dynamic: set[str] = field(default_factory=set)  # nodes whose sizes depend on values
    # (globals dict, name) pairs that functions other than the compiled one named
    globals_read: list[tuple[Any, str]] = field(default_factory=list)
    context_read: list[Any] = field(default_factory=list)  # context variables it read
    environ_read: list[str] = field(default_factory=list)  # environment variables it read


def tensor_meta(t: torch.Tensor) -> tuple:
    """``(shape, stride, dtype, device, requires_grad)``: what a stand-in needs."""
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)


class NodeRef(NamedTuple):
    """A result leaf that is the graph's flat output ``index``."""

    index: int


class ConstRef(NamedTuple):
    """A result leaf that is the same object on every call."""

    value: Any


class ObjectRef(NamedTuple):
    """A result leaf rebuilt on each call from ``template`` (an object holding tensors,
    a transformers KV cache): see :class:`Slot`."""

    template: Any
    slots: list[Slot]  # one per graph output it takes, in order
    shared: dict[int, Any]  # id -> module it holds, not copied


ResultRef = NodeRef | ConstRef | ObjectRef


class Slot:
    """Stands for one tensor in the template of a result object (a transformers KV cache):
    the template is the object deep-copied at record time with each tensor swapped for a
    slot, and each call deep-copies it again with the slots swapped for its tensors
    (the modules it holds, ``shared`` by id, are not copied)."""


def result_leaves(out_refs: list[ResultRef], flat: Any) -> list[Any]:
    """A recording's result leaves for one call, from the graph's flat outputs ``flat``.

    Example::

        result_leaves([NodeRef(0), ConstRef(3)], (t,))   # [t, 3]
    """
    it = iter(flat)
    leaves: list[Any] = []
    for ref in out_refs:
        kind = type(ref)
        if kind is NodeRef:
            leaves.append(next(it))
        elif kind is ObjectRef:
            memo = dict(ref.shared)  # modules stay the same objects
            memo.update((id(s), next(it)) for s in ref.slots)
            leaves.append(copy.deepcopy(ref.template, memo))
        else:
            leaves.append(ref.value)
    return leaves
