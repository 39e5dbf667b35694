"""Following: the user's Python runs on every call, and kernels serve its torch calls.

A recording whose Python did more than compute tensors (``capture_watch``: it prints,
appends to a list, draws ``random.random()``...) cannot be replayed without its Python.
Instead of running such a function in eager PyTorch, :class:`Follow` runs the function
itself on every call, under a :class:`Follower` (a ``TorchFunctionMode``) that matches
each torch call with the recorded one, in order::

    def step(x):                          recorded nodes          on a later call
        log.append(len(x))               (Python: runs)
        h = torch.relu(x @ w)            %matmul  ┐ piece 0      kernels, run at the
        y = h * 2 + 1                    %relu    │ (pure)       first of its calls;
                                         %mul     │              each call returns its
                                         %add     ┘              value from the piece
        print(y.sum().item())            %sum, %item (a read)    runs as called
        return y

The recorded nodes are cut into *pieces*: a run of pure nodes (no write, no random draw,
no effect, no read, no view) is one piece, compiled by the same pipeline as a replayed
segment, whose outputs are every value the Python received; every other call (writes,
random ops, views, reads, ``backward()``, an optimizer's step) runs for real, as the user
called it. So every tensor the Python holds is a real tensor with its autograd history,
Python's effects, exceptions and state are eager's by construction, and fused kernels
still run. A call that does not match the recording (another op, another scalar, an
unknown tensor, other sizes) ends the match: that call and the rest of the function run
eagerly, on those real tensors.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fxlite.codegen.capture_kinds import UNSUPPORTED, classify
from fxlite.codegen.capture_rules import map_tensors, same_func, spelling
from fxlite.codegen.recording import _LOCAL, Recording, Step
from torch.overrides import TorchFunctionMode

from fxlite.graph import Graph
from fxlite.graph_module import GraphModule
from fxlite.node import Node

__all__ = ["Follow", "Follower", "Piece"]


@dataclass(eq=False)
class Piece:
    """A run of pure recorded nodes, compiled as one graph that returns all its values."""

    nodes: list[Node]
    inputs: list[str]  # names of the values it reads, made before it
    outputs: list[str]  # names of its values, in the order the graph returns them
    shapes: list[tuple] = field(default_factory=list)  # its inputs' sizes when compiled
    compiled: Any = None  # the pipeline's CompiledSegment, after its first run


class Follow:
    """The compiled form of a recording that must run its Python: call it like the
    function. ``compile(gm, sample)`` compiles one piece (``compile_segment`` with the
    function's backend), called at each piece's first run."""

    def __init__(self, rec: Recording, fn: Callable[..., Any],
                 compile: Callable[[GraphModule, list[Any]], Any], why: str) -> None:
        self.rec, self.fn, self.why = rec, fn, why
        self._compile = compile
        self.nodes = {n.name: n for n in rec.graph.nodes}
        # parameters, buffers and constants: by name, and their names by id
        self.attrs = {n.name: rec.externals[n.target] for n in rec.graph.nodes
                      if n.op == "get_attr"}
        self.externals = {id(v): name for name, v in self.attrs.items()}
        self.piece_of: dict[str, Piece] = {}
        self.pieces = _pieces(rec, self.nodes)
        for piece in self.pieces:
            for n in piece.nodes:
                self.piece_of[n.name] = piece
        self.diverged = 0  # calls whose torch calls left the recording, in a row
        self.keys: dict[int, tuple] = {}  # step number -> the key of a call that matched

    def __call__(self, args: tuple, kwargs: dict, bound: list[Any]) -> Any:
        from fxlite.codegen.capture_hooks import installed, opaque_methods
        from fxlite.codegen.structure import flatten

        leaves, _ = flatten((args, kwargs))
        follower = Follower(self)
        for leaf, name in zip(leaves, self.rec.placeholders):
            if name is not None:
                follower.bind(leaf, name)
        outer = getattr(_LOCAL, "recorder", None)
        _LOCAL.recorder = follower
        try:
            with installed(), opaque_methods([*leaves, *bound]), follower:
                result = self.fn(*args, **kwargs)
        finally:
            _LOCAL.recorder = outer
        self.diverged = self.diverged + 1 if follower.diverged else 0
        return result

    def run_piece(self, piece: Piece, env: dict[str, Any]) -> bool:
        """Run ``piece`` on this call's values, putting its results in ``env``; False
        (having run nothing) when its inputs' sizes differ from those it was made for."""
        values = [env[n] for n in piece.inputs]
        shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in values]
        if piece.compiled is None:
            piece.shapes = shapes
            piece.compiled = self._compile(_piece_graph(piece, self.nodes), values)
            outs = piece.compiled.outputs
            piece.compiled.outputs = None
        elif shapes != piece.shapes:
            return False
        else:
            outs = piece.compiled.run(*values)
        env.update(zip(piece.outputs, outs))
        return True


class Follower(TorchFunctionMode):
    """Matches each torch call of one call of the function with the recording's (see
    the module docstring). Set as the thread's recorder, so fxlite's call hooks (an
    optimizer's step, ``autograd.Function.apply``) hand their calls to it whole."""

    def __init__(self, follow: Follow) -> None:
        super().__init__()
        self.follow = follow
        self.steps: list[Step] = follow.rec.steps
        self.at = 0
        self.env: dict[str, Any] = dict(follow.attrs)
        self.ids: dict[int, str] = dict(follow.externals)
        self.ran: set[int] = set()  # ids of the pieces run in this call
        self.off = False
        self.diverged = False

    def bind(self, value: Any, name: str) -> None:
        self.env[name] = value
        if isinstance(value, torch.Tensor):
            self.ids[id(value)] = name

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        kind = classify(func)
        if kind in ("meta", "grad_mode") or kind in UNSUPPORTED:
            return func(*args, **kwargs)
        step = self._match(func, args, kwargs)
        if step is None:
            return self._diverge(func, args, kwargs)
        piece = self.follow.piece_of.get(step.node)
        if piece is None:  # a write, a random draw, a read, a view, an effect: for real
            out = func(*args, **kwargs)
            if not (step.node and self.follow.nodes[step.node].meta.get("returns_input")):
                self._bind_out(out, step.node)  # (its input keeps its name, as recorded)
            return out
        if id(piece) not in self.ran:
            self.ran.add(id(piece))
            self.off = True  # fxlite's call hooks see the piece's own calls as no one's
            try:
                ok = self.follow.run_piece(piece, self.env)
            except Exception:  # its kernels refused these values: eager raises its own
                ok = False
            finally:
                self.off = False
            if not ok:
                return self._diverge(func, args, kwargs)
        out = self._value(step.out, step.node)
        self._bind_out(out, step.node)
        return out

    # ------------------------------------------------------------------ matching
    def _match(self, func: Any, args: tuple, kwargs: dict) -> Step | None:
        """The next recorded step, if this call is the same call: same function, same
        tensors (by the names this call gave them), equal other arguments."""
        if self.at >= len(self.steps):
            return None
        step = self.steps[self.at]
        if not (same_func(step.func, func) or isinstance(step.func, type) and func is step.func):
            return None
        if step.node:
            try:
                key = self._key(args, kwargs)
            except _Unknown:
                return None
            known = self.follow.keys.get(self.at)
            try:
                hit = known is not None and known == key
            except Exception:  # values without a plain equality: the full comparison
                hit = False
            if not hit:
                node = self.follow.nodes[step.node]
                target, opcode, spelled = spelling(func, args)
                if not (opcode == node.op and same_func(target, node.target)
                        and _same(self._arg(spelled), node.args)
                        and _same(self._arg(kwargs) if kwargs else {}, node.kwargs)):
                    return None
                self.follow.keys[self.at] = key  # later calls compare this key alone
        self.at += 1
        return step

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        """The call's arguments as a comparable tuple: tensors by the name this call gave
        them, other values with their type (``1`` is not ``1.0``, nor ``True``). Equal
        to a key that matched the recording: the same call (the comparison that made that
        key knew the spelling, which depends on nothing else)."""
        out: list[Any] = []
        add = out.append
        ids, env = self.ids, self.env

        def walk(a: Any) -> None:
            t = type(a)
            if t is tuple or t is list:
                add(len(a))
                for x in a:
                    walk(x)
            elif isinstance(a, torch.Tensor):
                name = ids.get(id(a))
                if name is None or env.get(name) is not a:
                    raise _Unknown
                add(_TENSOR)
                add(name)
            elif t is dict:
                add(tuple(a))
                for x in a.values():
                    walk(x)
            else:
                add(t)
                add(a if t is not float or a == a else _NAN)

        walk(args)
        if kwargs:
            walk(kwargs)
        return tuple(out)

    def _arg(self, a: Any) -> Any:
        """``a`` with each tensor swapped for its recorded node (as the recorder wrote it)."""
        return map_tensors(a, self._tensor_node)

    def _tensor_node(self, t: torch.Tensor) -> Node:
        name = self.ids.get(id(t))
        if name is None or self.env.get(name) is not t:
            raise _Unknown
        return self.follow.nodes[name]

    def _diverge(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The rest of this call runs eagerly (every value the Python holds is real)."""
        self.off = self.diverged = True
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ values
    def _value(self, structure: Any, name: str) -> Any:
        kind = structure[0]
        if kind == "t":
            return self.env[name]
        if kind == "seq":
            items = [self._value(sub, self._getitem(name, i)) if sub[0] != "v" else sub[1]
                     for i, sub in enumerate(structure[2])]
            cls = structure[1]
            return cls(items) if cls in (tuple, list) or hasattr(cls, "n_fields") else cls(*items)
        return structure[1]

    def _getitem(self, name: str, i: int) -> str:
        for user in self.follow.nodes[name].users:
            if user.target is operator.getitem and user.args[1] == i:
                return user.name
        raise KeyError(f"{name}[{i}]")

    def _bind_out(self, out: Any, name: str) -> None:
        if not name:
            return
        if isinstance(out, torch.Tensor):
            self.bind(out, name)
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    try:
                        self.bind(item, self._getitem(name, i))
                    except KeyError:
                        pass

    # ------------------------------------------------------------------ call hooks
    def call_opaque(self, target: Any, runner: Callable[..., Any], args: tuple,
                    kwargs: dict, touches: list[torch.Tensor] | None = None) -> Any:
        """A call recorded whole (an optimizer's step): matched, then run for real."""
        step = self._match(target, args, kwargs)
        self.off = True  # its own torch calls are its business
        try:
            out = runner(*args, **kwargs)
        finally:
            self.off = self.diverged
        if step is None:
            self.off = self.diverged = True
        else:
            self._bind_out(out, step.node)
        return out

    def record_cond(self, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
        """``torch.cond``: runs the branch the predicate picks, eagerly, and ends the match."""
        self.off = self.diverged = True
        return (true_fn if bool(pred) else false_fn)(*operands)


def _same(a: Any, b: Any) -> bool:
    """Whether a call's argument ``a`` (tensors swapped for nodes) equals the recorded
    ``b``: nodes by identity, containers item by item, floats by value (NaN is NaN),
    TorchScript objects (a profiler's record, made anew each call) by type, other
    values by ``==`` where it gives a bool, else by identity."""
    if isinstance(b, Node):
        return a is b
    t = type(a)
    if t is not type(b):
        return False
    if t is tuple or t is list:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if t is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if t is slice:
        return _same(a.start, b.start) and _same(a.stop, b.stop) and _same(a.step, b.step)
    if t is float:
        return a == b or a != a and b != b
    if isinstance(a, torch.ScriptObject):
        return True
    try:
        return bool(a == b)
    except Exception:  # numpy arrays, objects without a plain equality
        return a is b


_TENSOR = object()  # marks a tensor's name in a call's key
_NAN = object()  # stands for NaN in a key (NaN is not equal to itself)


class _Unknown(Exception):
    """A tensor the recording does not know (made outside torch calls, or another one)."""


def _pure(node: Node) -> bool:
    """Whether ``node`` may run inside a piece: computed from its inputs alone, with new
    results that no one else can see (no view, not its input returned). A ``getitem``
    of a multi-output op goes with the op."""
    meta = node.meta
    if node.op not in ("call_function", "call_method") or meta.get("impure") \
            or meta.get("mutated") or "read" in meta or meta.get("returns_input") \
            or meta.get("view"):
        return False
    kind = meta.get("type")
    if kind is torch.Tensor:
        return True
    items = [u for u in node.users if u.target is operator.getitem]
    return isinstance(kind, type) and issubclass(kind, tuple | list) and bool(items) and \
        all(u.meta.get("type") is torch.Tensor and not u.meta.get("view") for u in items)


def _pieces(rec: Recording, nodes: dict[str, Node]) -> list[Piece]:
    """The recording's runs of pure nodes, in program order (see the module docstring)."""
    pieces: list[Piece] = []
    run: list[Node] = []

    def close() -> None:
        if run:
            made = {n.name for n in run}
            inputs: list[str] = []
            for n in run:
                for inp in n.all_input_nodes:
                    if inp.name not in made and inp.name not in inputs:
                        inputs.append(inp.name)
            outputs = [n.name for n in run if n.meta.get("type") is torch.Tensor]
            pieces.append(Piece(list(run), inputs, outputs))
            run.clear()

    pure: set[str] = set()
    for node in rec.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        parent = node.args[0] if node.target is operator.getitem and node.args and \
            isinstance(node.args[0], Node) else None
        if parent is not None and parent.name in pure:
            run.append(node)  # an item of a multi-output op in this piece
            continue
        if node.op == "output" or parent is not None or not _pure(node):
            close()
            continue
        pure.add(node.name)
        run.append(node)
    close()
    return [p for p in pieces if p.outputs]


def _piece_graph(piece: Piece, nodes: dict[str, Node]) -> GraphModule:
    """A module computing ``piece`` from its inputs, returning every one of its values."""
    graph = Graph()
    env: dict[Node, Node] = {}
    for name in piece.inputs:
        old = nodes[name]
        new = graph.placeholder(name)
        new.meta = dict(old.meta)
        env[old] = new
    for node in piece.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[nodes[n]] for n in piece.outputs))
    return GraphModule(torch.nn.Module(), graph)
