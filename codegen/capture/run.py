"""Capture for ``fxlite.compile``: run the user's Python with real values, record torch calls.

``record(fn, args, kwargs)`` calls ``fn`` for real under a ``TorchFunctionMode`` that sees
every torch function, Tensor method and Tensor property, factories and random ops
included, and appends each call to a :class:`~fxlite.Graph`. Python control flow simply
runs, so the result of the recording call is eager PyTorch's own result::

    def f(x, b):                         graph of the path where b.sum() >= 0
        x = x * 2                            %x      = placeholder
        if b.sum() < 0:                      %b      = placeholder
            x = -x                           %mul    = call_method[mul](%x, 2)
        return x + 1                         %sum    = call_method[sum](%b)
                                             %lt     = call_method[lt](%sum, 0)
                                             %bool   = call_method[__bool__](%lt)   <- read
                                             %add    = call_method[add](%mul, 1)
                                             return (add,)

Where Python reads a tensor's value (``bool``, ``item``, ``tolist``, ``int``/``float``,
``np.asarray``, ``torch.equal``...), the value becomes a *read* node (``meta["read"]``):
the segment tree (``fxlite.codegen.capture.segments``) cuts the graph there and keys the rest of
the program on the value. Everything else that can change between calls is a guard
(``fxlite.codegen.capture.guards``): the inputs' layouts and Python values, module state, and
sizes once Python has read one.

Each node records what later stages need: ``stack_trace`` (the user's file, line and
code), ``grad_enabled``, ``requires_grad``, ``impure`` (it mutated a tensor, draws random
numbers or has another effect), ``mutated`` (which argument tensors changed, seen through
their version counters) and ``aliased`` (a mutated tensor shared its storage with another
recorded tensor, so the write cannot be made functional).

What cannot be replayed stops the recording (the call still finishes in eager PyTorch):
reading a tensor's address or storage, or reseeding the generator. See
``Recording.unsupported``. What a replay would skip but a followed call runs for real
(printing a tensor, the Python effects that ``capture.watch`` sees, inference mode,
whose tensors carry no version counter for a replay's checks) is ``Recording.effect``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from fxlite.codegen.capture.guards import CODE_TYPES
from fxlite.codegen.capture.hooks import installed, opaque_methods, opaque_names
from fxlite.codegen.capture.kinds import autocast_state
from fxlite.codegen.capture.recorder import Recorder, saved_attributes
from fxlite.codegen.capture.records import (
    ConstRef,
    NodeRef,
    ObjectRef,
    Read,
    Recording,
    Slot,
    Step,
    ValueOut,
    format_site,
    recording_in_thread,
    recording_thread,
    result_leaves,
    tensor_meta,
    user_site,
)
from fxlite.codegen.capture.rules import Diverged, rng_state_of
from fxlite.codegen.capture.segments import read_key
from fxlite.codegen.capture.structure import flatten
from fxlite.codegen.capture.symbolic import SymbolicInt, escaped_positions, plain
from fxlite.codegen.capture.watch import Watch

from fxlite.graph import Graph

__all__ = ["Read", "Recording", "Step", "format_site", "record", "recording_thread",
           "user_site"]


def record(fn: Callable[..., Any], args: tuple, kwargs: dict, *,
           roots: list[tuple[str, torch.nn.Module]], fullgraph: bool = False,
           bound: tuple[Any, ...] = (),
           prefix: Recording | None = None, upto: int = 0, values: dict[str, Any] | None = None,
           read_value: Any = None, record_rest: bool = True,
           symbolic: frozenset[int] = frozenset(),
           keyed: frozenset[int] = frozenset()) -> tuple[Any, Recording]:
    """Call ``fn(*args, **kwargs)`` for real and record it. Returns ``(result, recording)``.

    With ``prefix``, the calls of ``prefix`` up to and including its read number ``upto``
    are not run again: their results come from ``values`` (what the segments already
    computed, by node name), ``read_value`` is the new outcome of that read, and recording
    starts after it (or, with ``record_rest=False``, the call just finishes eagerly).
    ``bound`` lists objects the function reaches besides its arguments (closure cells,
    globals): optimizers, schedulers and grad scalers among them and the arguments have
    their ``step``-like methods recorded as single calls.
    Python between those calls runs again as it did the first time.
    ``symbolic`` holds the positions of ``args`` that are sizes taken as inputs (a Dynamo
    graph's ``SymInt`` arguments: ``capture/symbolic.py``); a recording that used one as a
    value has ``sizes_read`` set. ``keyed`` holds those of 0-d tensors whose values the
    key holds (``symbolic.keyed_positions``): reading one is no graph break.
    """
    leaves, in_spec = flatten((args, kwargs))
    if prefix is None:
        rec = Recording(Graph(), torch.nn.Module(), in_spec, [])
        recorder = Recorder(rec, fullgraph)
        names = _leaf_names(in_spec, fn)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                node = rec.graph.placeholder(names[i])
                node.meta["tensor_meta_rec"] = tensor_meta(leaf)
                recorder._nodes[node.name] = node
                rec.placeholders.append(node.name)
                if i in keyed and leaf.dim() == 0:
                    recorder.keyed.add(node.name)
            elif type(leaf) is int and i in symbolic and not kwargs and len(leaves) == len(args):
                node = rec.graph.placeholder(names[i])
                node.meta.update(type=int, value=leaf, grad_enabled=torch.is_grad_enabled())
                recorder._nodes[node.name] = node
                rec.placeholders.append(node.name)
                leaves[i] = SymbolicInt(leaf, node, recorder)
            else:
                rec.placeholders.append(None)
        if any(isinstance(x, SymbolicInt) for x in leaves):
            args = tuple(leaves)
            recorder.symbolic = True
    else:
        rec = _continue(prefix, upto, read_value)
        recorder = Recorder(rec, fullgraph, rec.steps, values, read_value)
        recorder.record_rest = record_rest
        recorder.adopt_externals()
        rec.steps = []
    rec.modules = roots
    recorder.sub_record = record
    recorder.know_modules(roots)
    for leaf, name in zip(leaves, rec.placeholders):
        if name is not None and isinstance(leaf, torch.Tensor):
            recorder.bind_input(leaf, name)
    recorder.devices = sorted({t.device.index or 0 for t in leaves
                               if isinstance(t, torch.Tensor) and t.is_cuda})
    if prefix is None:
        rec.rng_state = rng_state_of(recorder.devices)
        rec.ambient = (torch.is_grad_enabled(), autocast_state())
    with recording_in_thread(recorder):
        objects = [x for x in leaves if _plain_object(x)]
        before = [_object_state(x) for x in objects]
        reached = _reached_objects(roots, [*bound, *args, *kwargs.values()], objects)
        held = [_object_state(x, tensors_only=True) for x in reached]
        watch = Watch(None if isinstance(fn, torch.nn.Module) else fn, recorder)
        for x in reached:  # what the modules hold (self.calls = {...}) and the bound values
            watch.hold(x, type(x).__name__)
        try:
            with installed(), opaque_methods([*leaves, *bound]), recorder:
                with watch:
                    result = fn(*args, **kwargs)
                recorder.finish()
        except Diverged as e:
            raise RuntimeError(f"fxlite: {e}") from None
    if recorder.symbolic:
        result, returned = plain(result)
        if recorder.escaped or returned:  # a size used as a value: the key holds sizes
            # (those it is computed from, where they are inputs: C ** -0.5 of C alone)
            rec.sizes_from = None if returned or rec.sizes_read else escaped_positions(
                recorder.escaped_nodes, rec.placeholders)
            rec.sizes_read = True
    if not recorder.off and _saved_then_written(result, rec):
        recorder.stop("modifies in place a tensor that autograd saved for backward, and its "
                      "backward must raise as eager's does")
    rec.globals_read = watch.names
    rec.context_read = watch.context_vars
    rec.environ_read = watch.environ
    rec.effect = rec.effect or watch.effect or watch.changed() or \
        _unreplayable(leaves, result, rec) or _stored(objects, before, reached, held)
    if not recorder.off:
        _finish_output(recorder, result)
    return result, rec


def _saved_then_written(result: Any, rec: Recording) -> bool:
    """Whether the autograd graph of the tensors ``result`` holds saved a tensor that was
    then modified in place (``y = x.exp(); y.add_(1); return y``): eager's backward raises
    for it, and a replay's kernels, saving their own values, would not. Checked only when
    the recording wrote a tensor in place."""
    if not any("mutated" in n.meta for n in rec.graph.nodes):
        return False
    todo = [t.grad_fn for t in flatten(result)[0]
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        for name in saved_attributes(fn):
            try:
                getattr(fn, name)
            except Exception as e:  # (a freed graph raises too)
                if "modified by an inplace operation" in str(e):
                    return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def _stored(objects: list[Any], before: list[Any], reached: list[Any],
            held: list[Any]) -> str | None:
    """What the call wrote into Python objects that outlive it, which a replay (the
    recorded tensor ops alone) would not write again: attributes of an argument object
    (``before``: each of ``objects``' state as the call began), tensors put in an object
    that an argument, a module or a global holds (``held``: the tensors of ``reached``).
    A followed call runs the Python that writes them, as eager does."""
    for x, state in zip(objects, before):
        if state is None or _object_state(x) != state:
            return f"sets attributes of its {type(x).__name__} argument"
    for x, state in zip(reached, held):
        if state is not None and state != _object_state(x, tensors_only=True):
            return (f"stores tensors in a {type(x).__name__} that an argument, a module or "
                    "a global holds")
    return None


def _unreplayable(leaves: list[Any], result: Any, rec: Recording) -> str | None:
    """Why ops or results make a recording unfit to replay: a random generator
    of the user's (a replay would not draw from it), or an iterator returned (a replay
    would return the recording call's, already used up)."""
    for node in rec.graph.nodes:
        if isinstance(node.kwargs.get("generator"), torch.Generator) or any(
                isinstance(a, torch.Generator) for a in node.args):
            return ("draws from a torch.Generator of its own, which a replay would not "
                    f"advance\n  {node.meta.get('stack_trace', '')}")
    if any(isinstance(x, Iterator) and not isinstance(x, torch.Tensor) for x in leaves):
        return ("takes an iterator, which a replay would not advance (it would use the "
                "recording call's values)")
    out, _ = flatten(result)
    reads = {read_key(r.value) for r in rec.reads}
    for leaf in out:
        if isinstance(leaf, Iterator) and not isinstance(leaf, torch.Tensor):
            return (f"returns a {type(leaf).__name__} (an iterator), which a replay would "
                    "return already used up")
        if type(leaf) is float and read_key(leaf) not in reads:
            return ("returns a Python float that is not a tensor's value (a learning rate, "
                    "a time), which a replay would return unchanged")
    for _, root in rec.modules:
        for m in root.modules():
            if m._backward_hooks or m._backward_pre_hooks:
                return (f"has a backward hook on its {type(m).__name__}, which runs inside "
                        "backward")
    return None


def _plain_object(x: Any) -> bool:
    """An argument whose attributes the function might set: not a tensor, number, string,
    module (guarded state) or optimizer-like object (its steps are recorded calls)."""
    return not (x is None or isinstance(x, (*_NUMBERS, torch.Tensor, type, torch.nn.Module,
                                            torch.dtype, torch.device)) or opaque_names(x))


def _reached_objects(roots: list[tuple[str, torch.nn.Module]], bound: tuple[Any, ...],
                     args: list[Any]) -> list[Any]:
    """Plain objects a call reaches besides its argument objects ``args``: the public
    attributes of its modules that are not modules, tensors or numbers (``self.state``,
    ``self.history``), and ``bound``: the values it names (closure cells, globals) and
    the containers it is passed (a dict, a dataclass), Python modules and functions
    excepted."""
    out: list[Any] = []
    seen = {id(x) for x in args}
    found = [v for _, root in roots for m in root.modules()
             for k, v in vars(m).items() if not k.startswith("_")]
    for v in [*found, *bound]:
        if id(v) in seen or not _plain_object(v) or isinstance(v, CODE_TYPES):
            continue
        seen.add(id(v))
        out.append(v)
    return out



def _object_state(obj: Any, tensors_only: bool = False) -> tuple | None:
    """What ``obj`` holds, down its containers and attributes: each value by identity
    (numbers and strings by value), or with ``tensors_only`` its tensors alone. None when
    there is too much to look at."""
    edges = _walk(obj, _plain_object)
    if edges is None:
        return None
    return tuple((id(x), k if isinstance(k, (int, str)) else id(k),
                  v if v is None or isinstance(v, _NUMBERS) else id(v))
                 for x, k, v in edges if not tensors_only or isinstance(v, torch.Tensor))


def _walk(obj: Any, enter: Callable[[Any], bool]) -> list[tuple[Any, Any, Any]] | None:
    """Every ``(container, key, value)`` below ``obj``: the items of dicts, lists, tuples
    and sets, and the attributes of other objects (``__dict__`` and ``__slots__``),
    entering each value once when ``enter(value)``. None past 10,000 objects."""
    edges: list[tuple[Any, Any, Any]] = []
    todo, seen = [obj], set()
    while todo:
        x = todo.pop()
        if id(x) in seen or not enter(x):
            continue
        seen.add(id(x))
        if len(seen) > 10_000:
            return None
        if isinstance(x, dict):
            items: list[tuple[Any, Any]] = list(x.items())
        elif isinstance(x, (list, tuple, set, frozenset)):
            items = list(enumerate(x))
        else:
            fields = getattr(x, "__dict__", None)
            items = list(fields.items()) if isinstance(fields, dict) else []
            items += [(n, getattr(x, n, None)) for n in getattr(type(x), "__slots__", ())
                      if isinstance(n, str)]
        for k, v in items:
            edges.append((x, k, v))
            todo.append(v)
    return edges


_NUMBERS = (int, float, complex, str, bytes)


def _continue(prefix: Recording, upto: int, read_value: Any) -> Recording:
    """A new recording that starts as a copy of ``prefix`` up to its read ``upto``, whose
    value in the new path is ``read_value``.

    Node names stay the same, so values computed by the prefix's segments can be found
    by name in the new path. ``pre_state`` starts empty: the prefix's snapshots hold the
    values of the call that recorded it, while the new segments are checked on this
    call's values, which the recorder snapshots before the new part first writes them."""
    stop = prefix.reads[upto].node
    graph = copy.deepcopy(prefix.graph)
    doomed = []
    seen_stop = False
    for node in graph.nodes:
        if seen_stop:
            doomed.append(node)
        seen_stop = seen_stop or node.name == stop
    for node in reversed(doomed):
        graph.erase_node(node)
    steps: list[Step] = []
    for step in prefix.steps:
        if step.node == stop:
            steps.append(Step(step.func, step.node, ValueOut(read_value), read=True))
            break
        steps.append(step)
    old = prefix.reads[upto]
    reads = [*prefix.reads[:upto], Read(old.node, read_value, old.site, old.live)]
    kept = {n.name for n in graph.nodes}
    rec = Recording(graph, prefix.holder, prefix.in_spec, list(prefix.placeholders),
                    steps=steps, reads=reads,
                    sizes_read=prefix.sizes_read,
                    unknown_pre_state=prefix.unknown_pre_state,
                    externals=dict(prefix.externals),
                    dynamic={n for n in prefix.dynamic if n in kept})
    return rec


def _leaf_names(in_spec: Any, fn: Callable[..., Any]) -> list[str]:
    """Placeholder names for the input leaves: the parameter names where they are known."""

    try:
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        params = []
    names: list[str] = []

    def walk(spec: Any, path: str) -> None:
        if spec[0] == "leaf":
            names.append(path)
            return
        kind, detail, children = spec
        for i, child in enumerate(children):
            key = detail[i] if kind in ("dict", "OrderedDict") else str(i)
            walk(child, f"{path}_{key}" if path else str(key))

    (_, _, (args_spec, kwargs_spec)) = in_spec
    for i, child in enumerate(args_spec[2]):
        walk(child, params[i] if i < len(params) and "*" not in params[i] else f"arg{i}")
    for key, child in zip(kwargs_spec[1], kwargs_spec[2]):
        walk(child, str(key))
    return names


def _finish_output(recorder: Recorder, result: Any) -> None:
    rec = recorder.rec
    leaves, rec.out_spec = flatten(result)
    outs = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            name = recorder._name_of(leaf) or recorder._external(leaf)
            rec.out_refs.append(NodeRef(len(outs)))
            outs.append(recorder._nodes[name])
            continue
        # an object made in the call that holds tensors (a transformers KV cache): each
        # call gets a copy of it that holds that call's tensors
        held = _tensors_in(leaf)
        if held is not None and not held[0]:
            rec.out_refs.append(ConstRef(leaf))
            continue
        made = None if held is None else _template(recorder, leaf, *held)
        if made is None:  # a replay cannot rebuild it: the Python that makes it runs
            if rec.effect is None and rec.unsupported is None:
                rec.effect = (f"returns a {type(leaf).__name__} that fxlite cannot rebuild "
                              "for each call (it holds tensors, or too much to copy)")
            rec.out_refs.append(ConstRef(leaf))
            continue
        ref, nodes = made
        rec.out_refs.append(ref)
        outs.extend(nodes)
    rec.graph.output(tuple(outs))
    recorder.keep_unused_checks()


def _tensors_in(obj: Any) -> tuple[list[torch.Tensor], dict[int, Any]] | None:
    """The tensors ``obj`` reaches through containers and attributes, and the modules it
    meets on the way (by id; not entered: their tensors are guarded state). None when
    there is too much to look at."""
    edges = _walk(obj, lambda x: not (x is None or isinstance(x, (
        *_NUMBERS, torch.Tensor, torch.nn.Module, type, torch.dtype, torch.device))))
    if edges is None:
        return None
    tensors: dict[int, torch.Tensor] = {}
    modules: dict[int, Any] = {}
    for _, _, v in edges:
        if isinstance(v, torch.Tensor):
            tensors.setdefault(id(v), v)
        elif isinstance(v, torch.nn.Module):
            modules[id(v)] = v
    return list(tensors.values()), modules


def _template(recorder: Recorder, obj: Any, tensors: list[torch.Tensor],
              shared: dict[int, Any]) -> tuple[ObjectRef, list[Any]] | None:
    """The ``out_refs`` entry that rebuilds ``obj`` on each call (``obj`` deep-copied
    with a :class:`Slot` for each of its ``tensors``, the modules in ``shared`` not
    copied) and each tensor's node; None if that cannot be done."""
    slots = [Slot() for _ in tensors]
    try:
        nodes = [recorder._nodes[recorder._name_of(t) or recorder._external(t)]
                 for t in tensors]
        template = copy.deepcopy(obj, {**shared, **{id(t): s for t, s in zip(tensors, slots)}})
        ref = ObjectRef(template, slots, shared)
        result_leaves([ref], tensors)  # the copy each call makes must work
    except Exception:  # an object deepcopy cannot copy, or a tensor without a node
        return None
    return ref, nodes
