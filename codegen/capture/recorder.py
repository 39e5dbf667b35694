"""The recorder: a ``TorchFunctionMode`` that appends every torch call to a graph.

``fxlite.codegen.capture.run.record`` runs the user's function under a :class:`Recorder`.
Each call the mode sees is classified (``capture.kinds``) and either run as it is
(metadata), recorded as a node (ops, effects), or recorded as a read that ends a
segment. When a recording continues an earlier one from a read, the calls before that
read are fast-forwarded by a :class:`Prefix`: their results come from the segments that
already ran, and the recorder records from the read on.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from fxlite.codegen.capture.cond import CondOp
from fxlite.codegen.capture.kinds import (
    DYNAMIC_SHAPE,
    SIZE_FANOUT,
    UNSUPPORTED,
    autocast_state,
    classify,
    eager_context,
    hidden_writes,
    mutation_candidates,
    random_op,
    set_autocast,
    state_name,
)
from fxlite.codegen.capture.records import (
    EagerValue,
    Out,
    Read,
    Recording,
    SeqOut,
    Step,
    TensorOut,
    ValueOut,
    format_site,
    layout_copies,
    tensor_meta,
    user_site,
)
from fxlite.codegen.capture.rules import (
    Diverged,
    bool_index,
    break_message,
    func_name,
    has_tensor,
    map_tensors,
    rng_state_of,
    same_func,
    spelling,
    structure,
    tensors_in,
)
from fxlite.codegen.capture.symbolic import SymbolicInt
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fxlite.graph import Graph
from fxlite.node import Node, collect_nodes, target_name
from fxlite.proxy import TraceError

__all__ = ["Prefix", "Recorder", "saved_attributes"]

# Formatting a tensor as text reads its values, which a followed call (codegen/capture/follow.py)
# does for real: such a recording is followed, not stopped.
_FORMATS = frozenset({"__repr__", "__str__", "__format__"})
# ops that raise on some values of their tensors (Recorder.keep_unused_checks)
_INDEXING = frozenset({"index_select", "gather", "take", "take_along_dim", "embedding"})
_DIVIDING = frozenset({"fmod", "remainder", "floor_divide", "div", "floordiv", "mod"})
# Kept when their result is unused, as checks: decompositions whose error may be the
# point (`try: torch.linalg.cholesky(a)` to test positive definiteness)
_CHECKS = frozenset({"linalg_cholesky", "cholesky", "linalg_inv", "inverse", "linalg_solve",
                     "linalg_lu_factor", "linalg_solve_triangular"})


_SAVED: dict[type, list[str]] = {}  # autograd node type -> its saved values' attributes


def saved_attributes(grad_fn: Any) -> list[str]:
    """The attributes (``_saved_self``...) by which autograd node ``grad_fn`` shows the
    values it saved for its backward (reading one raises once the value was written)."""
    names = _SAVED.get(type(grad_fn))
    if names is None:
        names = _SAVED[type(grad_fn)] = [a for a in dir(grad_fn) if a.startswith("_saved_")]
    return names


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
        # ids of tensors an opaque call wrote that the recording had not met before it
        # (an optimizer's moments): no snapshot, as nothing before the call read them
        self._unsnapped: set[int] = set()
        self._keep: list[Any] = []  # external objects (ids must stay unique)
        self._grads: set[str] = set()  # nodes that are gradients (p.grad, or views of one)
        # inputs, parameters and buffers whose .grad was None when a backward began: a
        # check's backward, into a private copy, gives what the program reads from them
        self._fresh_grads: set[str] = set()
        self._dynamic = recording.dynamic
        self._attr_tail: Node | None = None  # get_attr nodes go after the inputs, in order
        self._grad = torch.is_grad_enabled()
        self._autocast = autocast_state()
        self._seed = torch.initial_seed()
        # the calls to fast-forward through before recording (None once they are done)
        self._prefix = Prefix(prefix, values or {}, read_value, self.graph, self._nodes,
                              self._bind) if prefix else None
        # every value the prefix made (a step's result, or an item of one: min(...)[1])
        self._prefix_names = {n.name for n in self.graph.nodes} if prefix else set()
        # inference tensors met (inference mode, or an argument made in it): they carry
        # no version counter, so writes are seen through the ops' schemas (_Writes)
        self.inference = False
        self.devices: list[int] = []
        self.record_rest = True
        # sizes taken as inputs (a Dynamo graph's SymInts: capture/symbolic.py), and size
        # reads recorded as ops, when set; whether one was used as a value (compared,
        # hashed, converted)
        self.symbolic = False
        self.keyed: set[str] = set()  # inputs whose values the key holds (record's keyed)
        self.escaped_nodes: list[Node] = []  # the sizes used as values (symbolic.py)
        self.escaped = False
        # how to record a function of its own (torch.cond's branches): capture.record
        self.sub_record: Callable[..., tuple[Any, Recording]] = _no_sub_record

    # ------------------------------------------------------------------ setup
    def know_modules(self, roots: list[tuple[str, torch.nn.Module]]) -> None:
        """Name the parameters and buffers of ``roots`` by their paths (for readable graphs)."""
        for prefix, root in roots:
            for name, t in [*root.named_parameters(remove_duplicate=False),
                            *root.named_buffers(remove_duplicate=False)]:
                self._known.setdefault(id(t), f"{prefix}.{name}" if prefix != "self" else name)

    def bind_input(self, t: torch.Tensor, name: str) -> None:
        self._bind(t, name)
        node = self._nodes.get(name)
        if node is not None and node.op == "placeholder":  # a path recorded after a read
            node.meta["tensor_meta_rec"] = tensor_meta(t)  # has this call's layouts

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
        return map_tensors(a, self._tensor_node)

    def _tensor_node(self, t: torch.Tensor) -> Node:
        return self._nodes[self._name_of(t) or self._external(t)]

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
        node.meta["tensor_meta_rec"] = tensor_meta(t)
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
            if self._prefix is not None:
                return self._fast_forward(func, args, kwargs)
            return self._record(func, args, kwargs)
        except TraceError:
            raise
        except Exception as e:  # a failure of the recorder must never break user code
            if getattr(e, "_fxlite_user", False):
                raise
            # reads as the rest of "f runs in eager PyTorch: it ..."
            self.stop(f"calls {func_name(func)}, which fxlite could not record "
                      f"({type(e).__name__}: {e})")
            return func(*args, **kwargs)

    def stop(self, reason: str, site: Any = None) -> None:
        """Stop recording; the call finishes in eager PyTorch and is not compiled."""
        if self.rec.unsupported is None:
            where = format_site(site or user_site())
            self.rec.unsupported = f"{reason}\n  {where}"
        self.off = True

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        kind = classify(func)
        if kind in _FORMATS:  # printing a tensor: its Python must run on every call
            if self.rec.effect is None:
                self.rec.effect = (f"{UNSUPPORTED[kind]}, which a replay would not do again"
                                   f"\n  {format_site(user_site())}")
            return func(*args, **kwargs)
        if kind in UNSUPPORTED:
            self.stop(UNSUPPORTED[kind])
            return func(*args, **kwargs)
        if _double_backward(func, args, kwargs):
            self.stop(f"differentiates a gradient again ({func_name(func)}(..., "
                      "create_graph=True)), and fxlite's kernels are differentiated once")
            return func(*args, **kwargs)
        odd = eager_context()
        if odd is not None:
            self.stop(odd)
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
            if self.symbolic and t is not None and name in ("size", "shape", "numel",
                                                            "nelement"):
                return self._symbolic_size(t, out, args[1:], kwargs,
                                           "numel" if name == "nelement" else name)
            self.rec.sizes_read = True
        return out

    def _symbolic_size(self, t: torch.Tensor, out: Any, args: tuple, kwargs: dict,
                       name: str) -> Any:
        """``t.size()``, ``t.shape``, ``t.size(d)`` or ``t.numel()`` (``name``) in a Dynamo
        graph with sizes as inputs (``capture/symbolic.py``): sizes whose use the recording
        records, computed from ``t`` on each replay."""
        tensor = self._tensor_node(t)
        grad = torch.is_grad_enabled()
        if isinstance(out, int):
            node = self.graph.call_method("numel" if name == "numel" else "size",
                                          (tensor, *args), kwargs)
            node.meta.update(type=int, grad_enabled=grad)
            return SymbolicInt(out, node, self)
        whole = self.graph.call_method("size", (tensor,))
        whole.meta.update(type=torch.Size, grad_enabled=grad)
        dims = []
        for i, n in enumerate(out):
            node = self.graph.call_function(operator.getitem, (whole, i))
            node.meta.update(type=int, grad_enabled=grad)
            dims.append(SymbolicInt(n, node, self))
        return torch.Size(dims)

    def _op(self, func: Any, kind: str, args: tuple, kwargs: dict) -> Any:
        tensors = tensors_in((args, kwargs))
        writes = mutation_candidates(func, args, kwargs)
        self._snapshot(writes)
        if kind == "external" and (state_name(func) == "backward"
                                   or func is torch.autograd.backward):
            self._fresh_grads.update(self._leaves_without_grad())
        try:
            out, mutated = self._run_seeing_writes(lambda: func(*args, **kwargs), tensors)
        except Exception as e:
            if writes or kind in ("effect", "external"):  # (a pure op may run again)
                self._user_raised(func, e)
            raise
        mutated += [t for t in hidden_writes(func, args, kwargs) if all(t is not m for m in mutated)]
        if kind == "read" or (not has_tensor(out) and out is not None and kind != "effect"):
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
        elif state_name(func) in _CHECKS:  # kept though unused, and safe to run again
            meta.update(impure=True, checks=True)
        if kind == "external":
            meta["external"] = True
        if mutated:
            self._note_mutation(node, mutated, out)
        elif isinstance(out, torch.Tensor) and out.grad_fn is not None:
            self._note_saved(node, out, tensors)
        if state_name(func) in SIZE_FANOUT and not self.symbolic:
            # (a Dynamo graph takes the results by fixed positions, and Dynamo's guards
            # keep their number: GPT-2's qkv.split serves every sequence length)
            self.rec.sizes_read = True
        if state_name(func) == "grad" and args:  # whether it is None steers Python (zero_grad)
            self.rec.grad_reads.append((args[0], out is None))
            self._grads.add(node.name)
            if self._name_of(args[0]) in self._fresh_grads:
                # the program reads a gradient its own backward made: the checks run that
                # backward into a private copy of the tensor (segments.split makes it an
                # input), as they do for what an optimizer writes; the real .grad is the
                # call's to keep or clear (zero_grad(set_to_none=True) after the read)
                self._snapshot([args[0]])
        elif isinstance(out, torch.Tensor) and out._is_view() and self._grads.intersection(
                n.name for n in node.all_input_nodes):
            self._grads.add(node.name)  # a view of a gradient is one too
        if mutated and self.rec.effect is None and not state_name(func).startswith("_foreach_"):
            # (torch's multi-tensor writes, clip_grad_norm_'s default, replay as recorded)
            self._written_state(meta.get("mutated", ()))
        if state_name(func) in DYNAMIC_SHAPE or self._dynamic.intersection(
                n.name for n in node.all_input_nodes) or bool_index(func, args):
            self._dynamic.add(node.name)
        if args and out is args[0] and not mutated and isinstance(out, torch.Tensor):
            # It returned its input object (x.float() of a float tensor, x.contiguous() of
            # a contiguous one): the object keeps its name, so a result that is this
            # object is the caller's own tensor, as in eager, not a compiled copy. A random
            # op does so only for an empty tensor (dropout): then sizes are part of the key.
            meta["returns_input"] = True
            if meta.get("impure"):
                self.rec.sizes_read = True
            meta["type"] = type(out)
            meta["requires_grad"] = out.requires_grad
            meta["tensor_meta_rec"] = tensor_meta(out)
        else:
            self._bind_out(out, node)
        self.rec.steps.append(Step(func, node.name, structure(out)))
        return out

    def _run_seeing_writes(self, run: Callable[[], Any],
                           tensors: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
        """``run()``'s result, and which of ``tensors`` it wrote (each once: ``x.add_(x)``
        passes ``x`` twice): seen through their version counters, or, once the recording
        has met an inference tensor (which has none), through the schemas of the aten
        ops it ran (a write to any tensor sharing the memory counts, as a version
        counter, shared by views, does)."""
        if not self.inference and any(t.is_inference() for t in tensors):
            self._enter_inference()
        mutated: list[torch.Tensor] = []
        if self.inference:
            with _Writes() as seen:
                out = run()
            for t in tensors:
                if _storage(t) in seen.written and all(t is not m for m in mutated):
                    mutated.append(t)
            return out, mutated
        before = [t._version for t in tensors]
        out = run()
        for i, t in enumerate(tensors):
            if t._version != before[i] and all(t is not m for m in mutated):
                mutated.append(t)
        return out, mutated

    def _user_raised(self, func: Any, e: Exception) -> None:
        """Mark ``e``, raised by the user's op ``func`` that writes or has effects, as the
        user's: it propagates as in eager (a backward through a tensor modified in
        place), the op not run again, and the call finishes in eager PyTorch (its Python
        may catch ``e``, and a replay would not raise where this call did). A pure op's
        exception goes to ``__torch_function__``'s handler instead, which runs it again
        outside the recording: eager's exception again, or, had the recorder caused it,
        eager's result."""
        self.stop(f"raised {type(e).__name__} in {func_name(func)}, where a replay would "
                  "not raise")
        e._fxlite_user = True  # type: ignore[attr-defined]

    def _enter_inference(self) -> None:
        """The recording met inference mode or an inference tensor: from now on writes are
        seen through op schemas, and its Python runs on every call (a followed call: no
        version counter lets a replay's checks see what the recorded ops wrote)."""
        self.inference = True
        if self.rec.effect is None:
            self.rec.effect = ("runs in inference mode (or on its tensors), whose tensors "
                               "carry no version counter for a replay's checks"
                               f"\n  {format_site(user_site())}")

    def _effect(self, func: Any, args: tuple, kwargs: dict, setter: bool = False) -> Any:
        out = func(*args, **kwargs)
        node = self._node(func, args, kwargs)
        node.meta["impure"] = node.meta["external"] = True
        node.meta["type"] = type(out)
        self.rec.steps.append(Step(func, node.name, structure(out)))
        return out

    def _node(self, func: Any, args: tuple, kwargs: dict) -> Node:
        target, opcode, args = spelling(func, args)
        site = user_site()
        node = self.graph.create_node(opcode, target, self._arg(args),
                                      self._arg(kwargs) if kwargs else {})
        node.meta["stack_trace"] = format_site(site)
        node.meta["site"] = site
        node.meta["grad_enabled"] = torch.is_grad_enabled()
        if any(enabled for enabled, _ in self._autocast):
            node.meta["autocast"] = True
        self._nodes[node.name] = node
        return node

    def _bind_out(self, out: Any, node: Node) -> None:
        node.meta["type"] = type(out)
        if isinstance(out, torch.Tensor):
            node.meta["requires_grad"] = out.requires_grad
            node.meta["tensor_meta_rec"] = tensor_meta(out)
            if out._is_view():  # shares memory with another value: followed calls
                node.meta["view"] = True  # run it for real (codegen/capture/follow.py)
            self._bind(out, node.name)
            self.rec.expected[node.name] = EagerValue(weakref.ref(out), _version(out))
            return
        if isinstance(out, (tuple, list)):
            import operator

            # an item that is a sequence holding tensors gets a node of its own, bound
            # item by item at any depth (histogramdd's bin_edges: a tuple in a tuple)
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor) or (
                        isinstance(item, (tuple, list)) and has_tensor(item)):
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
            if aliased and not self._is_external(name):
                # a write through a view also writes the inputs, parameters or buffers it
                # views: they count as written (segments then sandbox them in checks)
                names += [n for n, _ in self._externals_sharing(t) if n not in names]
            if (self._nodes[name].op in ("placeholder", "get_attr")
                    or name in self._prefix_names) and name not in self.rec.pre_state \
                    and id(t) not in self._unsnapped:
                self.rec.unknown_pre_state = True
            self.rec.expected.pop(name, None)  # its recorded value was overwritten
            if out is t:  # later reads see the written tensor through this node
                self._bind(t, node.name)
                self.rec.expected[node.name] = EagerValue(weakref.ref(t), _version(t))
                node.meta["same_object"] = name  # a later version of the same tensor
        node.meta["mutated"] = names
        node.meta["aliased"] = aliased

    def _note_saved(self, node: Node, out: torch.Tensor, tensors: list[Any]) -> None:
        """Name the inputs that eager's autograd saved for the backward of ``node``'s op
        (``meta["saved_by_eager"]``; ``""`` names the op's own result, as ``std`` and
        ``exp`` save theirs): a later segment that writes one makes eager's backward raise,
        so the kernel running the op checks its version too
        (``codegen/lower/written_inputs.py``)."""
        names: list[str] = []
        for attr in saved_attributes(out.grad_fn):
            try:
                saved = getattr(out.grad_fn, attr)
            except Exception:  # (a value saved and freed)
                continue
            if not isinstance(saved, torch.Tensor):
                continue
            names += [name for t in tensors if t is saved
                      and (name := self._name_of(t)) is not None and name not in names]
            # a saved result comes back as a new tensor object over the same memory (not
            # told by the address for empty tensors, which all have none: fuzz seed
            # 9953868, clamp(x, x) of an empty x saved x, not its result)
            if "" not in names and out.numel() and saved.data_ptr() == out.data_ptr() and \
                    saved.shape == out.shape and saved.stride() == out.stride():
                names.append("")
        if names:
            node.meta["saved_by_eager"] = tuple(names)

    def _written_state(self, names: list[str]) -> None:
        """A parameter or a gradient written in place by the program itself (an EMA,
        manual SGD, clipping or unscaling ``p.grad``), not by an optimizer's step: its
        Python must run on every call (``Recording.effect``), where these writes run
        for real."""
        for name in names:
            node = self._nodes[name]
            if name in self._grads or node.op == "get_attr" and getattr(
                    self.rec.externals.get(node.target), "requires_grad", False):
                what = "a gradient" if name in self._grads else "a parameter"
                self.rec.effect = (f"writes {what} in place outside an optimizer's step"
                                   f"\n  {format_site(user_site())}")
                return

    def _snapshot(self, tensors: list[torch.Tensor]) -> None:
        """Keep the value of each external tensor (input, parameter, buffer, constant)
        before its first write, for the compile-time checks, which must start from the
        state the call started from."""
        for t in tensors:
            name = self._name_of(t) or self._external(t)
            # a view of an input writes the input; an input (or an earlier segment's
            # result) writes the others that share its memory (x and x.squeeze())
            targets = [(name, t)] if self._is_external(name) else []
            targets += [(n, v) for n, v in self._externals_sharing(t) if n != name]
            new = [(n, v) for n, v in targets if self._is_external(n) and n not in self.rec.pre_state]
            # (copies sharing memory as the tensors do: a write to one shows in the others)
            for (n, _), copy in zip(new, layout_copies([v for _, v in new])):
                self.rec.pre_state[n] = copy

    def _leaves_without_grad(self) -> list[str]:
        """The inputs, parameters and buffers met so far that are leaves needing a
        gradient and hold none."""
        names = []
        for ref, name in list(self._env.values()):
            t = ref()
            if t is not None and self._is_external(name) and t.requires_grad and t.is_leaf \
                    and t.grad is None:
                names.append(name)
        return names

    def _is_external(self, name: str) -> bool:
        return self._nodes[name].op in ("placeholder", "get_attr") or name in self._prefix_names

    def _externals_sharing(self, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The inputs, parameters and buffers whose storage ``t`` shares."""
        try:
            storage = t.untyped_storage()._cdata
        except Exception:
            return []
        found = []
        for ref, name in list(self._env.values()):
            other = ref()
            if other is None or not self._is_external(name):
                continue
            try:
                if other.untyped_storage()._cdata == storage:
                    found.append((name, other))
            except Exception:
                continue
        return found

    def _read(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        if self.symbolic and state_name(func) == "sym_sum" and _symbolic_in(args):
            # a Dynamo graph's sum of sizes: its additions are recorded (SymbolicInt's)
            self.rec.steps.append(Step(func, "", ValueOut(out)))
            return sum(args[0])
        return self._read_value_of(out, None, func, args, kwargs)

    def _read_value_of(self, out: Any, owner: str | None, func: Any, args: tuple,
                       kwargs: dict) -> Any:
        if owner is None and (self._constant(args, kwargs) or self._sized(func, args, kwargs,
                                                                           out)
                              or self._keyed_input(args)):
            # Its value is fixed by the key (sizes and literals): no segment ends here.
            self.rec.steps.append(Step(func, "", ValueOut(out)))
            return out
        site = user_site()
        if self.fullgraph:
            raise TraceError(break_message(func, site))
        node = self._node(func, args, kwargs)
        node.meta["read"] = state_name(func)
        node.meta["impure"] = True
        node.meta["type"] = type(out)
        live = [name for ref, name in self._env.values()
                if ref() is not None and self._nodes[name].op not in ("placeholder", "get_attr")]
        self.rec.reads.append(Read(node.name, out, site, sorted(set(live))))
        self.rec.steps.append(Step(func, node.name, ValueOut(out), read=True))
        return out

    def _keyed_input(self, args: tuple) -> bool:
        """Whether the value read is an input's whose value the key holds (a float a
        Dynamo graph takes as a 0-d tensor), not written since the call began."""
        return len(args) == 1 and isinstance(args[0], torch.Tensor) and \
            self._name_of(args[0]) in self.keyed

    def _constant(self, args: tuple, kwargs: dict) -> bool:
        """Whether the tensors read were computed from literals alone: by pure recorded
        calls (``arange``, ``full``, arithmetic) that take no input, parameter, buffer or
        external tensor and draw no random numbers.

        Why: such a value is the same on every call that has this recording's key (which
        holds the sizes the literals came from), so reading it needs no segment break and
        no wait for the GPU. HF models read one on every call: GPT-2 checks whether its
        ``arange`` position ids are a packed batch (``(mask[:, -1] == 0).all()``).
        """
        tensors = tensors_in((args, kwargs))
        todo = []
        for t in tensors:
            name = self._name_of(t)
            if name is None:
                return False
            todo.append(self._nodes[name])
        seen: set[str] = set()
        while todo:
            node = todo.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op not in ("call_function", "call_method") or node.meta.get("impure") \
                    or node.name in self._dynamic or node.name in self._prefix_names \
                    or "read" in node.meta:
                return False
            todo.extend(node.all_input_nodes)
        return bool(tensors)

    def _sized(self, func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        """Whether a value that holds no tensor is fixed by sizes and Python values alone,
        which the key then holds (the recording becomes size-specific): a torch function
        given no tensor (``torch.sym_max(n, 1)`` of sizes, as ``make_contiguous_strides_for``
        calls it), or the empty sequence that iterating or unbinding a tensor whose first
        dimension is 0 gives. Reading it is Python's arithmetic, not a graph break. (Other
        functions given no tensor may read state a replay must read again: the flags of
        ``torch.are_deterministic_algorithms_enabled()``; they stay reads.)"""
        if state_name(func).lstrip("_").startswith("sym_") and not tensors_in((args, kwargs)):
            # (the numbers may be sizes; in a Dynamo graph a size is a SymbolicInt, and
            # without one they are literals: GELU's torch._sym_sqrt(2 / pi))
            if not self.symbolic:
                self.rec.sizes_read = True
            else:  # the key holds the sizes used (symbolic.escaped_positions)
                for value in _symbolic_in((args, kwargs)):
                    self.escaped = True
                    self.escaped_nodes.append(value.node)
            return True
        if type(out) in (tuple, list) and not out and state_name(func) in SIZE_FANOUT:
            self.rec.sizes_read = True
            return True
        return False

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
        if torch.is_inference_mode_enabled() and not self.inference:  # the caller's or its own
            self._enter_inference()

    def finish(self) -> None:
        """Close the recording: restore ambient state at the end, check the generator."""
        if self.off:
            return
        self._sync_state()
        if torch.initial_seed() != self._seed:
            self.stop("reseeds the random generator (torch.manual_seed) inside the function")

    def keep_unused_checks(self) -> None:
        """Keep the unused ops that raise on some values, as eager does: an index out of
        range (``x[idx]``, ``gather``, ``index_select``), an integer division by zero
        (``fmod``, ``remainder``). Their results are read by nothing (or only by other
        unused ops, in-place writes into such a value among them), so dead-code
        elimination would drop them (functionalize makes those writes pure) and the error;
        they stay, as ``checks`` (pure: safe to run again). Any other unused op of the
        recorded values makes the recording one per size (``sizes_read``): it may raise
        at other sizes (``x.reshape(9, 1)``). Called once the graph has its output."""
        dead: set[Node] = set()  # its values read by nothing, or only by dead nodes
        for node in reversed(list(self.graph.nodes)):
            if node.op in ("call_function", "call_method") and (
                    not node.meta.get("impure") or _private_write(node)) and all(
                    user in dead or _layout_only(user, node) for user in node.users):
                dead.add(node)
        for node in self.graph.nodes:
            if node not in dead:
                continue
            name = target_name(node)
            meta = node.meta.get("tensor_meta_rec")
            integer = meta is not None and not meta[2].is_floating_point \
                and not meta[2].is_complex
            if name in _INDEXING or name in _DIVIDING and integer or name in (
                    "getitem", "__getitem__") and _nodes_in(node.args[1:]):
                node.meta.update(impure=True, checks=True)
        if not self.symbolic and any(_nodes_in((n.args, n.kwargs)) for n in dead
                                     if not n.meta.get("checks")):
            # The others may raise at other sizes (``x.reshape(9, 1)``, ``x + y``), where
            # eager's raises too: the key holds the sizes, so a call at new ones records
            # again (fuzz seed 8516201: a dead reshape of a resized input).
            self.rec.sizes_read = True

    # ------------------------------------------------------------------ opaque calls
    def call_opaque(self, target: Any, runner: Callable[..., Any], args: tuple,
                    kwargs: dict, touches: list[torch.Tensor] | None = None) -> Any:
        """Record ``runner(*args, **kwargs)`` as one call of ``target``, without recording
        what happens inside it (a custom autograd Function keeps its own backward).

        ``touches`` lists state the call may write besides its arguments (an optimizer's
        parameters and moments): the call is then an effect on outside state, which
        checks skip, and those tensors are kept as they were before it."""
        if self._prefix is not None:
            return self._fast_forward(target, args, kwargs)
        # Called from a hook, outside the mode's handler: the mode would see the
        # recorder's own torch calls, so it looks away for the whole call.
        self._sync_state()
        self.off = True
        try:
            tensors = tensors_in((args, kwargs))
            if touches is not None:
                # What the recording met already may have been read before this call: the
                # checks start from its value before it. The rest (an optimizer's moments)
                # is read, if at all, after it, where the checks read the values it left.
                met = [t for t in touches if self._name_of(t) is not None
                       or id(t) in self._externals]
                self._snapshot(met)
                self._unsnapped.update(id(t) for t in touches if all(t is not m for m in met))
                tensors += [t for t in touches if all(t is not u for u in tensors)]
            try:
                out, mutated = self._run_seeing_writes(lambda: runner(*args, **kwargs), tensors)
            except Exception as e:
                self._user_raised(target, e)
                raise
            node = self._node(target, args, kwargs)
            node.meta["impure"] = True
            node.meta["external"] = touches is not None
            if mutated:
                self._note_mutation(node, mutated, out)
            self._bind_out(out, node)
            self.rec.steps.append(Step(target, node.name, structure(out)))
        finally:
            self.off = self.rec.unsupported is not None
        return out

    def record_cond(self, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
        """``torch.cond``: both branches become graphs of their own, the call one node."""
        if self._prefix is not None:
            return self._fast_forward(CondOp, (pred, *operands), {})
        self._sync_state()
        self.off = True  # called from a hook: the recorder's own torch calls stay unseen
        try:
            branches = [self.sub_record(fn, tuple(operands), {}, roots=self.rec.modules)
                        for fn in (true_fn, false_fn)]
            taken = bool(pred)
            for _, sub in branches:
                if sub.unsupported or sub.reads:
                    why = sub.unsupported or "it reads a tensor's value"
                    self.stop(f"calls torch.cond with a branch fxlite cannot record ({why})")
                    return branches[0 if taken else 1][0]
            op = CondOp(branches[0][1], branches[1][1], [o.detach().clone() for o in operands])
            node = self._node(op, (pred, *operands), {})
            self._bind_out(branches[0 if taken else 1][0], node)
            self.rec.steps.append(Step(CondOp, node.name, structure(branches[0][0])))
        finally:
            self.off = self.rec.unsupported is not None
        return branches[0 if taken else 1][0]

    # ------------------------------------------------------------------ fast-forward
    def _fast_forward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A call of the prefix, answered by it; after its last call (the read this
        recording continues from), what follows is recorded."""
        prefix = self._prefix
        out = prefix.replay(func, args, kwargs)
        if prefix.done:
            self._prefix = None
            self.rec.steps = list(prefix.steps)
            self.rec.rng_state = rng_state_of(self.devices)
            self.rec.ambient = (torch.is_grad_enabled(), autocast_state())
            self.off = not self.record_rest
        return out


class Prefix:
    """The calls of a recorded path up to one of its reads, fast-forwarded when a new path
    is recorded from that read (``capture.run.record`` with a ``prefix``).

    The user's function runs again from the start; each torch call it makes before the
    read is matched with the next recorded :class:`Step` and answered without running:
    with its value from the segments that already ran (``values``, by node name), or,
    for a value no later code can read, an uninitialized tensor of its layout. The read
    itself is answered with ``read_value``, its new outcome. A call that is not the
    recorded one raises :class:`Diverged`.

    ``graph``, ``nodes`` and ``bind`` are the recorder's: its graph, that graph's nodes by
    name, and how a tensor of this call is bound to the node it stands for (so that the
    recording goes on from it).
    """

    def __init__(self, steps: list[Step], values: dict[str, Any], read_value: Any,
                 graph: Graph, nodes: dict[str, Node],
                 bind: Callable[[torch.Tensor, str], None]) -> None:
        self.steps = steps
        self._at = 0
        self._values = values
        self._read_value = read_value
        self._graph = graph
        self._nodes = nodes
        self._bind = bind
        self._versions: dict[str, str] | None = None  # name -> its next in-place version

    @property
    def done(self) -> bool:
        """Whether every step has been replayed (the last one is the read)."""
        return self._at == len(self.steps)

    def replay(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Replay a recorded call of the prefix: return its value from the segments that
        already ran (or a stand-in of the right layout) instead of running it again."""
        kind = classify(func)
        if kind == "meta" or kind == "grad_mode" or kind in UNSUPPORTED:
            return func(*args, **kwargs)
        step = self.steps[self._at]
        if not (same_func(step.func, func) or isinstance(step.func, type) and func is step.func):
            raise Diverged(f"the call sequence changed: expected {func_name(step.func)}, "
                            f"got {func_name(func)}")
        self._at += 1
        if not step.node:  # a read of a value the key fixes (see Recorder._constant)
            return step.out.value
        if step.read:
            return self._read_value if self.done else step.out.value
        node = self._nodes[step.node]
        if node.meta.get("returns_input") and args and isinstance(args[0], torch.Tensor):
            return args[0]  # it returned its input, which keeps its own name
        if node.meta.get("same_object") is not None and args and isinstance(args[0], torch.Tensor):
            out: Any = args[0]  # an in-place op returns the tensor it wrote
        else:
            out = self._stand_in(step.out, step.node)
        if isinstance(out, torch.Tensor):  # this call's layout, not the recording call's
            node.meta["tensor_meta_rec"] = tensor_meta(out)
        self._rebind(out, step.node)
        return out

    def _stand_in(self, structure: Out, name: str | None) -> Any:
        """The value of a recorded result in this call: from the segments already run,
        or, for a value no later code can read, an uninitialized tensor of its layout."""
        kind = type(structure)
        if kind is TensorOut:
            value = self._latest_value(name) if name is not None else None
            if value is not None:
                return value
            shape, stride, dtype, device, requires_grad = structure.meta
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            return t.requires_grad_() if requires_grad and (dtype.is_floating_point
                                                            or dtype.is_complex) else t
        if kind is SeqOut:
            items = [self._stand_in(sub, self._getitem_name(name, i) if name else None)
                     for i, sub in enumerate(structure.items)]
            cls = structure.cls
            # tuple, list and torch.return_types (struct sequences) take one sequence;
            # named tuples take their fields
            return cls(items) if cls in (tuple, list) or hasattr(cls, "n_fields") else cls(*items)
        return structure.value

    def _latest_value(self, name: str) -> Any:
        """This call's value of ``name``, or of a later in-place version of it: in eager
        they are one tensor object, which Python may still hold after the read."""
        if self._versions is None:
            self._versions = {}
            for node in self._graph.nodes:
                older = node.meta.get("same_object")
                if older is not None:
                    self._versions[older] = node.name
        value, seen = None, set()
        while name is not None and name not in seen:
            seen.add(name)
            value = self._values.get(name, value)
            name = self._versions.get(name)
        return value

    def _rebind(self, out: Any, name: str) -> None:
        if isinstance(out, torch.Tensor):
            self._bind(out, name)
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, (torch.Tensor, tuple, list)):
                    sub = self._getitem_name(name, i)
                    if sub is not None:
                        self._rebind(item, sub)

    def _getitem_name(self, name: str | None, i: int) -> str | None:
        node = self._nodes.get(name) if name is not None else None
        if node is None:
            return None
        for user in node.users:
            if user.target is operator.getitem and user.args[1] == i:
                return user.name
        return None


_LAYOUT_READERS = frozenset({"new_zeros", "new_ones", "new_full", "new_empty", "zeros_like",
                             "ones_like", "empty_like", "full_like"})


def _private_write(node: Node) -> bool:
    """Whether ``node`` writes in place only the value of a pure op, which shares its
    memory with nothing (``v0 = x.reshape(9, 1)`` of a copy, then ``v0.relu_()``):
    functionalize makes such a write pure, so it is as dead as that value."""
    mutated = node.meta.get("mutated")
    first = node.args[0] if node.args else None
    return isinstance(first, Node) and mutated == [first.name] and \
        node.meta.get("aliased") is False and first.op in ("call_function", "call_method") \
        and not first.meta.get("impure")


def _layout_only(user: Node, node: Node) -> bool:
    """Whether ``user`` reads only ``node``'s layout (``node.new_zeros(...)``)."""
    return target_name(user) in _LAYOUT_READERS and user.args[:1] == (node,) and \
        node not in _nodes_in((user.args[1:], user.kwargs))


def _nodes_in(value: Any) -> dict[Node, None]:
    """The nodes in an argument (``fxlite.node.collect_nodes``), as an ordered set."""
    found: dict[Node, None] = {}
    collect_nodes(value, found)
    return found


def _symbolic_in(value: Any) -> list[SymbolicInt]:
    """The :class:`SymbolicInt` s in ``value`` (args and kwargs), at any depth."""
    if isinstance(value, SymbolicInt):
        return [value]
    if type(value) in (tuple, list):
        return [s for v in value for s in _symbolic_in(v)]
    if type(value) is dict:
        return [s for v in value.values() for s in _symbolic_in(v)]
    return []


class _Writes(TorchDispatchMode):
    """Collects the storages that the aten ops run under it write, as their schemas say
    (``add_(Tensor(a!) self, ...)``, ``out=``): how writes to inference tensors, which
    carry no version counter, are seen."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types_: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            if info is not None and info.is_write:
                value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor):
                        self.written.add(_storage(t))
        return func(*args, **kwargs)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _version(t: torch.Tensor) -> int:
    """``t._version``; -1 for an inference tensor, which has none (its recording is
    followed, which reads no version)."""
    return -1 if t.is_inference() else t._version


def _no_sub_record(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("this recorder cannot record branches (no sub_record given)")


def _double_backward(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` builds a graph of its gradients (``create_graph``)."""
    at = {torch.autograd.grad: 4, torch.autograd.backward: 4, torch.Tensor.backward: 3}
    pos = at.get(func)
    if pos is None:
        return False
    return bool(kwargs.get("create_graph", args[pos] if len(args) > pos else False))
