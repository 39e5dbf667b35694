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
the segment tree (``fxlite.codegen.segments``) cuts the graph there and keys the rest of
the program on the value. Everything else that can change between calls is a guard
(``fxlite.codegen.guards``): the inputs' layouts and Python values, module state, and
sizes once Python has read one.

Each node records what later stages need: ``stack_trace`` (the user's file, line and
code), ``grad_enabled``, ``requires_grad``, ``impure`` (it mutated a tensor, draws random
numbers or has another effect), ``mutated`` (which argument tensors changed, seen through
their version counters) and ``aliased`` (a mutated tensor shared its storage with another
recorded tensor, so the write cannot be made functional).

What cannot be replayed stops the recording (the call still finishes in eager PyTorch):
formatting a tensor as text, reading its address, reseeding the generator, or entering
inference mode. See ``Recording.unsupported``.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fxlite.codegen.capture_kinds import (
    DYNAMIC_SHAPE,
    SIZE_FANOUT,
    UNSUPPORTED,
    autocast_state,
    classify,
    hidden_writes,
    mutation_candidates,
    random_op,
    set_autocast,
    state_name,
)
from fxlite.codegen.structure import flatten
from torch.overrides import TorchFunctionMode

from fxlite.graph import Graph
from fxlite.node import Node
from fxlite.proxy import TraceError

__all__ = ["Recording", "Step", "record", "recording_thread"]

_LIB_DIRS = tuple(os.path.dirname(os.path.abspath(p)) + os.sep for p in (
    torch.__file__, __file__, sys.modules["fxlite"].__file__,
    sys.modules["fxlite.graph"].__file__))
_LOCAL = threading.local()


def recording_thread() -> Any:
    """The recorder active in this thread, or None (used by fxlite's call hooks)."""
    return getattr(_LOCAL, "recorder", None)


def user_site() -> tuple[str, int, str, str] | None:
    """``(file, line, function, source)`` of the innermost frame of the user's code."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_LIB_DIRS) or name.startswith("<fxlite")
                or name.startswith("<frozen")):
            return (name, f.f_lineno, f.f_code.co_name,
                    linecache.getline(name, f.f_lineno).strip())
        f = f.f_back
    return None


def format_site(site: tuple[str, int, str, str] | None) -> str:
    """``File "x.py", line 6, in f`` plus the source line, as torch.fx's stack traces."""
    if site is None:
        return "(no user frame found)"
    return f'File "{site[0]}", line {site[1]}, in {site[2]}\n    {site[3]}'


@dataclass(eq=False)
class Step:
    """One recorded call, as fast-forwarding a new path replays it (see ``segments``)."""

    func: Any
    node: str  # the node's name in the graph
    out: Any  # the result's structure: ("t", meta) | ("seq", type, [...]) | ("v", value)
    read: bool = False


@dataclass(eq=False)
class Read:
    """A value Python read from tensors: the end of a segment."""

    node: str
    value: Any
    site: tuple[str, int, str, str] | None
    live: list[str]  # recorded values still referenced when the read happened


@dataclass(eq=False)
class Recording:
    """One path through the user's Python, as a graph plus what replaying it needs."""

    graph: Graph
    holder: torch.nn.Module  # owns the parameters, buffers and constants of get_attr nodes
    in_spec: Any
    placeholders: list[str | None]  # per input leaf: its placeholder name, None if not a tensor
    out_spec: Any = None
    out_refs: list[tuple[str, Any]] = field(default_factory=list)  # ("node", name) | ("const", v)
    steps: list[Step] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    sizes_read: bool = False
    unsupported: str | None = None
    rng_state: Any = None
    pre_state: dict[str, torch.Tensor] = field(default_factory=dict)  # externals before writes
    unknown_pre_state: bool = False  # an external changed without a snapshot: no checks
    expected: dict[str, Any] = field(default_factory=dict)  # name -> (weakref, version)
    externals: dict[str, Any] = field(default_factory=dict)  # get_attr target -> object
    modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    dynamic: set[str] = field(default_factory=set)  # nodes whose sizes depend on values


class _Abort(Exception):
    pass


def _tensor_meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)


class Recorder(TorchFunctionMode):
    """Appends every torch call made while it is active to ``recording.graph``."""

    def __init__(self, recording: Recording, fullgraph: bool = False,
                 prefix: list[Step] | None = None, values: dict[str, Any] | None = None,
                 read_value: Any = None) -> None:
        super().__init__()
        self.rec = recording
        self.graph = recording.graph
        self.fullgraph = fullgraph
        self.off = False
        self._env: dict[int, tuple[Any, str]] = {}  # id(tensor) -> (weakref, node name)
        self._nodes: dict[str, Node] = {n.name: n for n in self.graph.nodes}
        self._known: dict[int, str] = {}  # id(parameter/buffer) -> readable path
        self._externals: dict[int, str] = {}  # id(tensor) -> get_attr node name
        self._keep: list[Any] = []  # external objects (ids must stay unique)
        self._dynamic = recording.dynamic
        self._attr_tail: Node | None = None  # get_attr nodes go after the inputs, in order
        self._grad = torch.is_grad_enabled()
        self._autocast = autocast_state()
        self._seed = torch.initial_seed()
        # fast-forward: replay `prefix` without running it, using `values` from the
        # segments already run; `read_value` is the new outcome of its last read
        self._prefix = prefix or []
        self._prefix_names = {step.node for step in self._prefix}
        self._at = 0
        self._values = values or {}
        self._read_value = read_value
        self._versions: dict[str, str] | None = None  # name -> its next in-place version
        self.devices: list[int] = []
        self.record_rest = True

    # ------------------------------------------------------------------ setup
    def know_modules(self, roots: list[tuple[str, torch.nn.Module]]) -> None:
        """Name the parameters and buffers of ``roots`` by their paths (for readable graphs)."""
        for prefix, root in roots:
            for name, t in [*root.named_parameters(remove_duplicate=False),
                            *root.named_buffers(remove_duplicate=False)]:
                self._known.setdefault(id(t), f"{prefix}.{name}" if prefix != "self" else name)

    def bind_input(self, t: torch.Tensor, name: str) -> None:
        self._bind(t, name)

    # ------------------------------------------------------------------ tensors <-> nodes
    def _bind(self, t: torch.Tensor, name: str) -> None:
        self._env[id(t)] = (weakref.ref(t), name)

    def _name_of(self, t: torch.Tensor) -> str | None:
        found = self._env.get(id(t))
        if found is not None and found[0]() is t:
            return found[1]
        return None

    def _arg(self, a: Any) -> Any:
        """A graph argument for a call argument: tensors become nodes."""
        if isinstance(a, torch.Tensor):
            return self._nodes[self._name_of(a) or self._external(a)]
        t = type(a)
        if t is tuple or t is list:
            return t(self._arg(x) for x in a)
        if t is dict:
            return {k: self._arg(v) for k, v in a.items()}
        if t is slice:
            return slice(self._arg(a.start), self._arg(a.stop), self._arg(a.step))
        if isinstance(a, torch.Size):
            return tuple(a)
        return a

    def _external(self, t: torch.Tensor) -> str:
        """A get_attr node for a tensor the recording did not make: a parameter, buffer or
        constant. The holder keeps the object itself, so in-place updates are seen."""
        name = self._externals.get(id(t))
        if name is not None:
            return name
        hint = self._known.get(id(t), "_tensor_constant")
        attr = "".join(c if c.isalnum() else "_" for c in hint).strip("_") or "constant"
        if attr[0].isdigit():
            attr = "_" + attr
        base, i = attr, 0
        while hasattr(self.rec.holder, attr):
            i += 1
            attr = f"{base}_{i}"
        if isinstance(t, torch.nn.Parameter):
            self.rec.holder.register_parameter(attr, t)
        else:
            self.rec.holder.register_buffer(attr, t, persistent=False)
        self.rec.externals[attr] = t
        with self.graph.inserting_after(self._attr_anchor()):
            node = self.graph.get_attr(attr)
        self._attr_tail = node
        node.meta["tensor_meta_rec"] = _tensor_meta(t)
        self._nodes[node.name] = node
        self._externals[id(t)] = node.name
        self._keep.append(t)
        self._bind(t, node.name)
        return node.name

    def _attr_anchor(self) -> Node | None:
        if self._attr_tail is None:
            for n in self.graph.nodes:
                if n.op not in ("placeholder", "get_attr"):
                    return n.prev
            return None
        return self._attr_tail

    def adopt_externals(self) -> None:
        """Index the get_attr nodes of a copied graph (continuing a recording)."""
        for n in self.graph.nodes:
            if n.op == "get_attr":
                obj = self.rec.externals[n.target]
                self._externals[id(obj)] = n.name
                self._keep.append(obj)
                self._bind(obj, n.name)
                self._attr_tail = n

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func: Any, types_: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        try:
            if self._at < len(self._prefix):
                return self._fast_forward(func, args, kwargs)
            return self._record(func, args, kwargs)
        except (_Abort, TraceError):
            raise
        except Exception as e:  # a failure of the recorder must never break user code
            if getattr(e, "_fxlite_user", False):
                raise
            self.stop(f"fxlite could not record {_func_name(func)}: {type(e).__name__}: {e}")
            return func(*args, **kwargs)

    def stop(self, reason: str, site: Any = None) -> None:
        """Stop recording; the call finishes in eager PyTorch and is not compiled."""
        if self.rec.unsupported is None:
            where = format_site(site or user_site())
            self.rec.unsupported = f"{reason}\n  {where}"
        self.off = True

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        kind = classify(func)
        if kind in UNSUPPORTED:
            self.stop(UNSUPPORTED[kind])
            return func(*args, **kwargs)
        self._sync_state()
        if kind == "meta":  # sizes, dtypes, devices: guarded, not recorded
            return self._meta(func, args, kwargs)
        if kind == "grad_mode":
            out = func(*args, **kwargs)
            self._sync_state()
            return out
        if kind == "set":
            return self._effect(func, args, kwargs, setter=True)
        return self._op(func, kind, args, kwargs)

    def _meta(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        name = state_name(func)
        if name in SIZE_FANOUT or isinstance(out, torch.Size):
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
            owner = self._name_of(t) if t is not None else None
            if owner in self._dynamic:  # a data-dependent size: read it like a value
                return self._read_value_of(out, owner, func, args, kwargs)
            self.rec.sizes_read = True
        return out

    def _op(self, func: Any, kind: str, args: tuple, kwargs: dict) -> Any:
        tensors = _tensors_in((args, kwargs))
        before = [t._version for t in tensors]
        self._snapshot(mutation_candidates(func, args, kwargs))
        out = func(*args, **kwargs)
        mutated = [t for i, t in enumerate(tensors) if t._version != before[i]]
        mutated += [t for t in hidden_writes(func, args, kwargs) if all(t is not m for m in mutated)]
        if kind == "read" or (not _has_tensor(out) and out is not None and kind != "effect"):
            if isinstance(out, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
                return out
            if isinstance(out, torch.Size):
                self.rec.sizes_read = True
                return out
            return self._read(func, args, kwargs, out)
        node = self._node(func, args, kwargs)
        meta = node.meta
        if mutated or random_op(func, args, kwargs) or out is None or kind in (
                "effect", "external") or state_name(func) in ("grad", "data", "_base"):
            meta["impure"] = True
        if kind == "external":
            meta["external"] = True
        if mutated:
            self._note_mutation(node, mutated, out)
        if state_name(func) in SIZE_FANOUT:
            self.rec.sizes_read = True
        if func in DYNAMIC_SHAPE or self._dynamic.intersection(
                n.name for n in node.all_input_nodes) or _bool_index(func, args):
            self._dynamic.add(node.name)
        self._bind_out(out, node)
        self.rec.steps.append(Step(func, node.name, _structure(out)))
        return out

    def _effect(self, func: Any, args: tuple, kwargs: dict, setter: bool = False) -> Any:
        out = func(*args, **kwargs)
        node = self._node(func, args, kwargs)
        node.meta["impure"] = node.meta["external"] = True
        node.meta["type"] = type(out)
        self.rec.steps.append(Step(func, node.name, _structure(out)))
        return out

    def _node(self, func: Any, args: tuple, kwargs: dict) -> Node:
        target, opcode, args = _spelling(func, args)
        site = user_site()
        node = self.graph.create_node(opcode, target, self._arg(args),
                                      self._arg(kwargs) if kwargs else {})
        node.meta["stack_trace"] = format_site(site)
        node.meta["site"] = site
        node.meta["grad_enabled"] = torch.is_grad_enabled()
        self._nodes[node.name] = node
        return node

    def _bind_out(self, out: Any, node: Node) -> None:
        node.meta["type"] = type(out)
        if isinstance(out, torch.Tensor):
            node.meta["requires_grad"] = out.requires_grad
            node.meta["tensor_meta_rec"] = _tensor_meta(out)
            self._bind(out, node.name)
            self.rec.expected[node.name] = (weakref.ref(out), out._version)
            return
        if isinstance(out, (tuple, list)):
            import operator

            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    with self.graph.inserting_after(None):
                        sub = self.graph.call_function(operator.getitem, (node, i))
                    sub.meta.update(stack_trace=node.meta["stack_trace"], site=node.meta["site"],
                                    grad_enabled=node.meta["grad_enabled"])
                    self._nodes[sub.name] = sub
                    if node.name in self._dynamic:
                        self._dynamic.add(sub.name)
                    self._bind_out(item, sub)

    def _note_mutation(self, node: Node, mutated: list[torch.Tensor], out: Any) -> None:
        names = []
        aliased = False
        for t in mutated:
            name = self._name_of(t) or self._external(t)
            names.append(name)
            storage = t.untyped_storage()._cdata
            for other_id, (ref, _) in self._env.items():
                other = ref()
                if other is None or other is t or other_id == id(t):
                    continue
                try:
                    if other.untyped_storage()._cdata == storage:
                        aliased = True
                        break
                except Exception:
                    aliased = True
            if t._base is not None:
                aliased = True
            if (self._nodes[name].op in ("placeholder", "get_attr")
                    or name in self._prefix_names) and name not in self.rec.pre_state:
                self.rec.unknown_pre_state = True
            self.rec.expected.pop(name, None)  # its recorded value was overwritten
            if out is t:  # later reads see the written tensor through this node
                self._bind(t, node.name)
                self.rec.expected[node.name] = (weakref.ref(t), t._version)
                node.meta["same_object"] = name  # a later version of the same tensor
        node.meta["mutated"] = names
        node.meta["aliased"] = aliased

    def _snapshot(self, tensors: list[torch.Tensor]) -> None:
        """Keep the value of each external tensor (input, parameter, buffer, constant)
        before its first write, for the compile-time checks, which must start from the
        state the call started from."""
        for t in tensors:
            name = self._name_of(t) or self._external(t)
            if self._nodes[name].op not in ("placeholder", "get_attr") and \
                    name not in self._prefix_names:
                continue
            if name not in self.rec.pre_state:
                with torch.no_grad():
                    self.rec.pre_state[name] = t.detach().clone()

    def _read(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        return self._read_value_of(out, None, func, args, kwargs)

    def _read_value_of(self, out: Any, owner: str | None, func: Any, args: tuple,
                       kwargs: dict) -> Any:
        site = user_site()
        if self.fullgraph:
            raise TraceError(_break_message(func, site))
        node = self._node(func, args, kwargs)
        node.meta["read"] = state_name(func)
        node.meta["impure"] = True
        node.meta["type"] = type(out)
        live = [name for ref, name in self._env.values()
                if ref() is not None and self._nodes[name].op not in ("placeholder", "get_attr")]
        self.rec.reads.append(Read(node.name, out, site, sorted(set(live))))
        self.rec.steps.append(Step(func, node.name, ("v", out), read=True))
        return out

    def _sync_state(self) -> None:
        """Record changes of grad mode and autocast, which no torch call reports."""
        grad = torch.is_grad_enabled()
        if grad != self._grad:
            self._grad = grad
            node = self.graph.call_function(torch._C._set_grad_enabled, (grad,))
            node.meta.update(impure=True, grad_enabled=grad)
        state = autocast_state()
        if state != self._autocast:
            self._autocast = state
            node = self.graph.call_function(set_autocast, (state,))
            node.meta.update(impure=True, grad_enabled=grad)
        if torch.is_inference_mode_enabled():
            raise_unsupported = "enters inference mode inside the function"
            self.stop(raise_unsupported)

    def finish(self) -> None:
        """Close the recording: restore ambient state at the end, check the generator."""
        if self.off:
            return
        self._sync_state()
        if torch.initial_seed() != self._seed:
            self.stop("reseeds the random generator (torch.manual_seed) inside the function")

    # ------------------------------------------------------------------ opaque calls
    def call_opaque(self, target: Any, runner: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
        """Record ``runner(*args, **kwargs)`` as one call of ``target``, without recording
        what happens inside it (a custom autograd Function keeps its own backward)."""
        if self._at < len(self._prefix):
            return self._fast_forward(target, args, kwargs)
        self._sync_state()
        tensors = _tensors_in((args, kwargs))
        before = [t._version for t in tensors]
        self.off = True
        try:
            out = runner(*args, **kwargs)
        finally:
            self.off = False
        node = self._node(target, args, kwargs)
        node.meta["impure"] = True
        mutated = [t for i, t in enumerate(tensors) if t._version != before[i]]
        if mutated:
            self._note_mutation(node, mutated, out)
        self._bind_out(out, node)
        self.rec.steps.append(Step(target, node.name, _structure(out)))
        return out

    def record_cond(self, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
        """``torch.cond``: both branches become graphs of their own, the call one node."""
        from fxlite.codegen.cond import CondOp

        if self._at < len(self._prefix):
            return self._fast_forward(CondOp, (pred, *operands), {})
        self._sync_state()
        self.off = True
        try:
            branches = [record(fn, tuple(operands), {}, roots=self.rec.modules)
                        for fn in (true_fn, false_fn)]
            taken = bool(pred)
        finally:
            self.off = False
        for _, sub in branches:
            if sub.unsupported or sub.reads:
                why = sub.unsupported or "it reads a tensor's value"
                self.stop(f"a torch.cond branch cannot be recorded: {why}")
                return branches[0 if taken else 1][0]
        op = CondOp(branches[0][1], branches[1][1], [o.detach().clone() for o in operands])
        node = self._node(op, (pred, *operands), {})
        self._bind_out(branches[0 if taken else 1][0], node)
        self.rec.steps.append(Step(CondOp, node.name, _structure(branches[0][0])))
        return branches[0 if taken else 1][0]

    # ------------------------------------------------------------------ fast-forward
    def _fast_forward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Replay a recorded call of the prefix: return its value from the segments that
        already ran (or a stand-in of the right layout) instead of running it again."""
        kind = classify(func)
        if kind == "meta" or kind == "grad_mode" or kind in UNSUPPORTED:
            return func(*args, **kwargs)
        step = self._prefix[self._at]
        if not (_same_func(step.func, func) or isinstance(step.func, type) and func is step.func):
            raise _Diverged(f"the call sequence changed: expected {_func_name(step.func)}, "
                            f"got {_func_name(func)}")
        self._at += 1
        if step.read:
            last = self._at == len(self._prefix)
            value = self._read_value if last else step.out[1]
            if last:  # the prefix ends here; what follows is recorded
                self.rec.steps = list(self._prefix)
                self.rec.rng_state = _rng_state_of(self.devices)
                self.off = not self.record_rest
            return value
        node = self._nodes[step.node]
        if node.meta.get("same_object") is not None and args and isinstance(args[0], torch.Tensor):
            out: Any = args[0]  # an in-place op returns the tensor it wrote
        else:
            out = self._stand_in(step.out, step.node)
        self._rebind(out, step.node)
        return out

    def _stand_in(self, structure: Any, name: str | None) -> Any:
        """The value of a recorded result in this call: from the segments already run,
        or, for a value no later code can read, an uninitialized tensor of its layout."""
        kind = structure[0]
        if kind == "t":
            value = self._latest_value(name) if name is not None else None
            if value is not None:
                return value
            shape, stride, dtype, device, requires_grad = structure[1]
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            return t.requires_grad_() if requires_grad and (dtype.is_floating_point
                                                            or dtype.is_complex) else t
        if kind == "seq":
            items = [self._stand_in(sub, self._getitem_name(name, i) if name else None)
                     for i, sub in enumerate(structure[2])]
            return structure[1](items) if structure[1] in (tuple, list) else structure[1](*items)
        return structure[1]

    def _latest_value(self, name: str) -> Any:
        """This call's value of ``name``, or of a later in-place version of it: in eager
        they are one tensor object, which Python may still hold after the read."""
        if self._versions is None:
            self._versions = {}
            for node in self.graph.nodes:
                older = node.meta.get("same_object")
                if older is not None:
                    self._versions[older] = node.name
        value = None
        while name is not None:
            value = self._values.get(name, value)
            name = self._versions.get(name)
        return value

    def _rebind(self, out: Any, name: str) -> None:
        if isinstance(out, torch.Tensor):
            self._bind(out, name)
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    sub = self._getitem_name(name, i)
                    if sub is not None:
                        self._bind(item, sub)

    def _getitem_name(self, name: str | None, i: int) -> str | None:
        import operator

        node = self._nodes.get(name) if name is not None else None
        if node is None:
            return None
        for user in node.users:
            if user.target is operator.getitem and user.args[1] == i:
                return user.name
        return None


class _Diverged(Exception):
    """Fast-forwarding met a different call than the recorded path has."""


def _func_name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _same_func(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _break_message(func: Any, site: Any) -> str:
    return (f"fullgraph=True, but the function reads a tensor's value in Python "
            f"({state_name(func)}), which splits it into several graphs:\n  {format_site(site)}\n"
            "To keep one graph: compute both branches and pick with torch.where, use "
            "torch.cond(pred, true_fn, false_fn, operands), fix the value with concrete_args "
            "when tracing with symbolic_trace, or move the code into a leaf module.")


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def _has_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return any(_has_tensor(i) for i in x)
    return False


def _structure(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return ("t", _tensor_meta(out))
    if isinstance(out, (tuple, list)) and _has_tensor(out):
        return ("seq", type(out), [_structure(x) for x in out])
    return ("v", out)


def _bool_index(func: Any, args: tuple) -> bool:
    """``x[mask]``: indexing with a bool tensor gives a value-dependent size."""
    if state_name(func) != "__getitem__" or len(args) < 2:
        return False
    idx = args[1]
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in items)


_DUNDER_OPS: dict[str, tuple[Any, bool]] = {}


def _spelling(func: Any, args: tuple) -> tuple[Any, str, tuple]:
    """``(target, opcode, args)`` for a call: Tensor methods become ``call_method``
    nodes (as symbolic tracing records them), operators become ``operator`` functions."""
    import operator

    if not _DUNDER_OPS:
        for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                     "and", "or", "xor", "lshift", "rshift"):
            op = getattr(operator, name + "_" if name in ("and", "or") else name)
            _DUNDER_OPS[f"__{name}__"] = (op, False)
            _DUNDER_OPS[f"__r{name}__"] = (op, True)
        for name in ("eq", "ne", "lt", "le", "gt", "ge", "getitem"):
            _DUNDER_OPS[f"__{name}__"] = (getattr(operator, name), False)
        for name in ("neg", "pos", "invert", "abs"):
            _DUNDER_OPS[f"__{name}__"] = (getattr(operator, name), False)
        _DUNDER_OPS["__setitem__"] = (operator.setitem, False)
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__") and isinstance(getattr(func, "__self__", None),
                                                     types.GetSetDescriptorType):
        attr = func.__self__.__name__
        if name == "__get__":
            return getattr, "call_function", (args[0], attr)
        return setattr, "call_function", (args[0], attr, args[1])
    if isinstance(name, str) and name in _DUNDER_OPS and _is_tensor_method(func):
        op, swap = _DUNDER_OPS[name]
        return op, "call_function", ((args[1], args[0], *args[2:]) if swap else args)
    if isinstance(name, str) and _is_tensor_method(func) and name != "__call__":
        return name, "call_method", args
    return func, "call_function", args


def _is_tensor_method(func: Any) -> bool:
    from fxlite.proxy import _is_tensor_method as check

    return check(func)


def record(fn: Callable[..., Any], args: tuple, kwargs: dict, *,
           roots: list[tuple[str, torch.nn.Module]], fullgraph: bool = False,
           prefix: Recording | None = None, upto: int = 0, values: dict[str, Any] | None = None,
           read_value: Any = None, record_rest: bool = True) -> tuple[Any, Recording]:
    """Call ``fn(*args, **kwargs)`` for real and record it. Returns ``(result, recording)``.

    With ``prefix``, the calls of ``prefix`` up to and including its read number ``upto``
    are not run again: their results come from ``values`` (what the segments already
    computed, by node name), ``read_value`` is the new outcome of that read, and recording
    starts after it (or, with ``record_rest=False``, the call just finishes eagerly).
    Python between those calls runs again as it did the first time.
    """
    from fxlite.codegen.capture_hooks import installed

    leaves, in_spec = flatten((args, kwargs))
    if prefix is None:
        rec = Recording(Graph(), torch.nn.Module(), in_spec, [])
        recorder = Recorder(rec, fullgraph)
        names = _leaf_names(in_spec, fn)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                node = rec.graph.placeholder(names[i])
                node.meta["tensor_meta_rec"] = _tensor_meta(leaf)
                recorder._nodes[node.name] = node
                rec.placeholders.append(node.name)
            else:
                rec.placeholders.append(None)
    else:
        rec = _continue(prefix, upto, read_value)
        recorder = Recorder(rec, fullgraph, rec.steps, values, read_value)
        recorder.record_rest = record_rest
        recorder.adopt_externals()
        rec.steps = []
    rec.modules = roots
    recorder.know_modules(roots)
    for leaf, name in zip(leaves, rec.placeholders):
        if name is not None:
            recorder.bind_input(leaf, name)
    recorder.devices = sorted({t.device.index or 0 for t in leaves
                               if isinstance(t, torch.Tensor) and t.is_cuda})
    if prefix is None:
        rec.rng_state = _rng_state_of(recorder.devices)
    outer = getattr(_LOCAL, "recorder", None)
    _LOCAL.recorder = recorder
    try:
        with installed(), recorder:
            result = fn(*args, **kwargs)
            recorder.finish()
    except _Diverged as e:
        raise RuntimeError(f"fxlite: {e}") from None
    finally:
        _LOCAL.recorder = outer
    if not recorder.off:
        _finish_output(recorder, result)
    return result, rec


def _continue(prefix: Recording, upto: int, read_value: Any) -> Recording:
    """A new recording that starts as a copy of ``prefix`` up to its read ``upto``, whose
    value in the new path is ``read_value``.

    Node names stay the same, so values computed by the prefix's segments can be found
    by name in the new path."""
    import copy

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
            steps.append(Step(step.func, step.node, ("v", read_value), read=True))
            break
        steps.append(step)
    old = prefix.reads[upto]
    reads = [*prefix.reads[:upto], Read(old.node, read_value, old.site, old.live)]
    kept = {n.name for n in graph.nodes}
    rec = Recording(graph, prefix.holder, prefix.in_spec, list(prefix.placeholders),
                    steps=steps, reads=reads,
                    sizes_read=prefix.sizes_read, pre_state=dict(prefix.pre_state),
                    unknown_pre_state=prefix.unknown_pre_state,
                    externals=dict(prefix.externals),
                    dynamic={n for n in prefix.dynamic if n in kept})
    return rec


def _rng_state_of(devices: list[int]) -> Any:
    """The generators' states (CPU and the given CUDA devices), to replay random ops."""
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


def _leaf_names(in_spec: Any, fn: Callable[..., Any]) -> list[str]:
    """Placeholder names for the input leaves: the parameter names where they are known."""
    import inspect

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
            rec.out_refs.append(("node", len(outs)))
            outs.append(recorder._nodes[name])
        else:
            rec.out_refs.append(("const", leaf))
    rec.graph.output(tuple(outs))
