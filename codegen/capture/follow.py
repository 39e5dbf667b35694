"""Following: the user's Python runs on every call, and kernels serve its torch calls.

A recording whose Python did more than compute tensors (``capture.watch``: it prints,
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
still run. A call that does not match the recording (another op, a number of another
type or in a dim or size, an unknown tensor) ends the match: that call and the rest of
the function run eagerly, on those real tensors.

Tensors are matched by name, not by size: as a replayed segment does, a compiled piece
runs on tensors of any sizes (its kernels take sizes as arguments, and raise where eager
raises). It is compiled once, at its first run, on that call's tensors; where their sizes
are not the recording's, on its graph with the layouts its recorded ops compute from them
(``_resize``). The numbers a call passes are still matched on every call, sizes the
Python read among them, so a piece computes with each number its calls pass; one of its
later calls passing another (a size of the new batch) leaves the match there, having been
handed nothing computed from the stale one, and a piece whose run raises on the new sizes
leaves it at its first call (eager then runs, and raises if eager raises)::

    def fn(x):                           call 1 (x: 2x8, recorded); calls 2, 3... (3x8, 5x8)
        log.append(len(x))
        h = torch.relu(x) * 2            %relu, %mul: piece 0   runs on 3x8, 5x8
        return h.view(len(x), -1)        view(%mul, 2, -1)       3 is not 2: leaves the
                                                                 match (h.view(3, -1) eager)

A piece holding an op whose number of results depends on sizes (``unsafe_split``) runs
only on the sizes it was compiled for (``Piece.fixed``): the Python is handed as many
results as the recording had.

A Python number the function passes as a value of a pure pointwise op (``x * s``,
``torch.clamp(x, max=m)``; not a dim, a size, a mode, an exponent, nor an integer divisor
of ``//`` or ``%``, where eager raises for 0) that differs from the recorded one, with the
same Python type, is *varying* from then on (a float argument of a function recorded
``recompile_limit`` times for its values is followed so, ``compile.py``): the piece computing
that node starts there and takes the number as an input (a placeholder of its type, an
argument of its kernels), bound from each call's own number when the node's call matches.
The call that finds it goes on matching, on pieces cut again (those that ran before that
node in this call stand)::

    def fn(x):                           call 1 (recorded): %mul = mul(%relu, 0.31)
        h = torch.relu(x)                call 2: 0.87 at mul's argument 1 -> varying;
        return h * random.random() + 1           pieces: [relu], [mul, add] (its input
                                                 %mul_scalar_1), the call goes on
                                         call 3 on: [mul, add] runs on the call's number

A tensor the Python keeps between calls outside module state (``self.h = torch.tanh(...)``
on a plain object, ``cache["h"]`` in a global dict, a batch from ``next(it)``) was
recorded as a constant (a ``get_attr`` node), and a later call passes another tensor
there. The first such call makes every such name *varying* at once (a batch's ``y`` is
passed anew after its ``x``): pieces take them as inputs and start where each is first
used, so that the tensor the Python passes at that first use (with the recorded layout)
is bound to the name before any piece reads it. The call that finds it binds it there
and goes on matching, on pieces cut again, where this is its first use; elsewhere (a
piece read it before, in this call) it leaves the match::

    def fn(x):                           call 1 (recorded): cache["h"] is a constant %h
        h = torch.tanh(cache["h"] + x)   call 2 on: another tensor at %h, its first use:
        cache["h"] = h * 2                       %h varying, bound there, kernels
        return h

A call that runs for real (a write, a view, a gather, an optimizer's per-tensor update)
passed other plain values than the recorded ones (numbers of the same Python type, lists
and slices of them, numpy arrays of the same dtype and shape) goes on matching: its
values are baked nowhere, as it runs with the call's own, provided its result has the
recorded layout (sizes, strides, dtype, device, whether it requires grad), which the
pieces after it were made for; another layout (``x.view(n, -1)`` with another ``n``)
ends the match there, the call having run::

    def step(x):                         Adam, foreach=False: each step passes another
        ...                              value=-lr / (1 - beta1 ** step) to the real
        opt.step()                       p.addcdiv_(exp_avg, denom, value=...): matched
        return x[order].cumsum(0)        x[order] with another shuffled list: matched

A call that leaves the match at a call of another function than the recorded one (the
Python took another path: ``requires_grad_(True)`` at step 3, a model put in eval mode)
counts in ``Follow.moved``; two calls in a row leaving it so, at the same step for the
same function (the new path is kept to, not one of paths taken in turn), make
``compile.py``'s ``_follow`` record a new plan on the next call, while recordings are
left (so does one call, for a plan recorded at the function's first call that no call
matched, left at a step that runs for real: the first call read gradients still None,
an optimizer made its state); three calls in a row that leave it otherwise make the
function run in eager PyTorch.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from fxlite.codegen.capture.hooks import installed, opaque_methods
from fxlite.codegen.capture.kinds import SIZE_FANOUT, UNSUPPORTED, classify, state_name
from fxlite.codegen.capture.records import (
    Out,
    Recording,
    SeqOut,
    Step,
    TensorOut,
    ValueOut,
    recording_in_thread,
    tensor_meta,
)
from fxlite.codegen.capture.rules import map_tensors, same_func, spelling
from fxlite.codegen.capture.structure import flatten
from fxlite.codegen.lower.written_inputs import written_later
from torch.overrides import TorchFunctionMode

from fxlite import ops as op_table
from fxlite.graph import Graph
from fxlite.graph_module import GraphModule
from fxlite.interpreter import Interpreter
from fxlite.node import Node

__all__ = ["Expect", "Follow", "Follower", "Left", "Piece"]


@dataclass(eq=False)
class Piece:
    """A run of pure recorded nodes, compiled as one graph that returns all its values."""

    nodes: list[Node]
    inputs: list[str]  # names of the values it is given, made before it
    outputs: list[str]  # names of its values, in the order the graph returns them
    attrs: list[str] = field(default_factory=list)  # parameters, buffers it reads itself
    index: int = 0  # its place in the recording's list of pieces
    shapes: list[Any] = field(default_factory=list)  # its inputs' sizes when compiled
    # how many results one of its nodes has depends on sizes (``x.unsafe_split(2)``),
    # and the Python is handed the recorded number: it runs on the sizes it was made for
    fixed: bool = False
    compiled: Any = None  # the pipeline's CompiledSegment, after its first run


class Expect(NamedTuple):
    """What following needs of one recorded step, worked out once per recording (so
    that a call matched on later calls costs a key and a few lookups)."""

    func: Any  # the function called
    node: str  # its node's name; "" for a call whose value the key fixes (no node)
    piece: Piece | None  # the piece that computes its value; None: it runs for real
    tensor: bool  # its value is the one tensor named ``node`` (no sequence, no constant)
    keeps_name: bool  # it returns its input object, which keeps its own name
    out: Out  # its result's structure, as recorded (``Step.out``)
    passed: bool  # its function's calls run unmatched (a size read that was recorded)
    grad: bool | None  # grad mode as recorded (a piece's values depend on it); None: any
    scalars: tuple = ()  # (position, name) of each varying number it passes (``Follow.scalars``)


class Left(NamedTuple):
    """Where a followed call left the match at a call of another function than the
    recorded one."""

    at: int  # the recorded step it reached
    func: Any  # the function it called there instead


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
        # constants that are not module state (a tensor a plain object or a global dict
        # holds), which the Python may pass anew on later calls; and those seen to be
        state = {id(t) for _, root in rec.modules for t in (*root.parameters(),
                                                             *root.buffers())}
        self.loose = {name for name, v in self.attrs.items() if id(v) not in state}
        self.varying: set[str] = set()
        # per node: its varying numbers, position (an index into its args, or a keyword)
        # -> the name of the piece input that takes it; and each such name's Python type
        self.scalars: dict[str, dict[int | str, str]] = {}
        self.scalar_types: dict[str, type] = {}
        self.order = {n.name: i for i, n in enumerate(rec.graph.nodes)}
        self.pieces: list[Piece] = []
        self.diverged = 0  # calls whose torch calls left the recording, in a row
        self.completed = 0  # calls that matched it to their end
        # calls in a row that left it at the same step for the same call of another
        # function than the recorded one (the Python took another path, and keeps to
        # it), not at other arguments of the same; and where the latest one left it
        self.moved = 0
        self.left: Left | None = None
        # recorded at the function's first call, which may differ from all later ones in
        # what it reads and writes (gradients still None, an optimizer making its state);
        # and whether a call left it at another read or write than the recorded one
        # before any call matched it to its end (``compile.py``'s ``_follow``)
        self.first_call = False
        self.restart = False
        self.stale = False  # its calls took another path: the next one records anew
        self.dead = _dead_after(rec)
        self._plan()

    def _plan(self) -> None:
        """Cut the pieces (in place: callers hold the list) and work out each step's
        record, for the names now varying."""
        rec, nodes = self.rec, self.nodes
        # a piece cut again the same keeps its compiled form
        old = {_signature(p): p for p in self.pieces if p.compiled is not None}
        self.pieces[:] = _pieces(rec, nodes, self.varying, self.scalars)
        for piece in self.pieces:
            same = old.get(_signature(piece))
            if same is not None:
                piece.compiled, piece.shapes = same.compiled, same.shapes
        piece_of = {n.name: piece for piece in self.pieces for n in piece.nodes}
        self.expects = [_expect(step, piece_of.get(step.node), nodes, self.scalars)
                        for step in rec.steps]
        # per step: the key of a call that matched it (later calls compare this key alone)
        self.keys: list[tuple | None] = [None] * len(rec.steps)
        # per step index: the varying names first used there, bound there on each call
        self.first_use: dict[int, set[str]] = {}
        seen: set[str] = set()
        for i, step in enumerate(rec.steps):
            node = nodes.get(step.node) if step.node else None
            for inp in node.all_input_nodes if node is not None else ():
                if inp.name in self.varying and inp.name not in seen:
                    seen.add(inp.name)
                    self.first_use.setdefault(i, set()).add(inp.name)

    def vary(self, names: set[str]) -> None:
        """``names`` (loose constants) were passed anew: from now on they are bound where
        first used (the compiled pieces are cut again, and compiled again)."""
        if names - self.varying:
            self.varying |= names
            self._plan()

    def vary_scalars(self, name: str, values: dict[int | str, Any]) -> None:
        """The numbers at these positions of node ``name``'s call (its ``args`` index or
        keyword -> this call's value) changed between calls: from now on the piece that
        computes ``name`` starts there and takes each as an input, whose value every call
        passes (the pieces are cut again; those that change are compiled again)."""
        places = self.scalars.setdefault(name, {})
        for pos, value in values.items():
            if pos in places:
                continue  # (varying already)
            made = f"{name}_scalar_{pos}"
            while made in self.nodes or made in self.scalar_types:
                made += "_"
            places[pos] = made
            self.scalar_types[made] = type(value)
        self._plan()

    def __call__(self, args: tuple, kwargs: dict, bound: Sequence[Any],
                 leaves: list[Any] | None = None) -> Any:
        """Run the function on ``args`` and ``kwargs`` (whose leaves are ``leaves``,
        flattened here when not given), ``bound`` being the objects it carries or names."""
        if leaves is None:
            leaves, _ = flatten((args, kwargs))
        follower = Follower(self)
        for leaf, name in zip(leaves, self.rec.placeholders):
            if name is not None:
                follower.bind(leaf, name)
        with recording_in_thread(follower), installed(), \
                opaque_methods([*leaves, *bound]), follower:
            result = self.fn(*args, **kwargs)
        self.diverged = self.diverged + 1 if follower.diverged else 0
        self.completed += not follower.diverged
        left = follower.left if follower.diverged else None
        if left is None:
            self.moved = 0
        else:
            last = self.left
            same = last is not None and last.at == left.at and (
                last.func is left.func or same_func(last.func, left.func))
            self.moved = self.moved + 1 if same else 1
        self.left = left
        self.restart = left is not None and follower.left_real and self.first_call \
            and not self.completed
        return result

    def run_piece(self, piece: Piece, env: dict[str, Any]) -> bool:
        """Run ``piece`` on this call's values, putting its results in ``env``; False
        (having run nothing) where they cannot serve this call: a piece whose results
        depend on sizes in number (``Piece.fixed``) given other sizes than those it was
        made for, or a first run whose recorded ops raise on these sizes. A compiled
        piece raising on other sizes raises here (the follower then leaves the match).

        A compiled piece runs on tensors of any sizes, as a replayed segment does (its
        kernels take sizes as arguments, and raise where eager raises); its numbers are
        the recorded ones, which each of its calls matches (see the module docstring)."""
        values, shapes = [], []
        for name in piece.inputs:  # (a loop, not two comprehensions: host time)
            v = env[name]
            values.append(v)
            shapes.append(v.shape if isinstance(v, torch.Tensor) else None)
        if piece.compiled is None:
            recorded = self._recorded_sizes(piece, values)
            if piece.fixed and not recorded:
                return False
            gm = _piece_graph(piece, self.rec, self.nodes, self.scalars, self.scalar_types)
            if not recorded and not _resize(gm, values):
                return False
            piece.shapes = shapes
            written_later(list(self.nodes.values()), gm)  # (not saved by groups)
            piece.compiled = self._compile(gm, values)
            outs = piece.compiled.outputs
            piece.compiled.outputs = None
        elif piece.fixed and shapes != piece.shapes:
            return False
        else:
            outs = piece.compiled.run(*values)
        env.update(zip(piece.outputs, outs))
        return True

    def _recorded_sizes(self, piece: Piece, values: list[Any]) -> bool:
        """Whether the tensors a piece is first given have the recording's sizes and
        strides, which its graph's metadata holds (``tensor_meta_rec``: the pipeline
        reads its nodes' layouts there). Otherwise the piece is compiled on a graph
        whose layouts are those of this call (``_resize``): compiling the recorded one
        on other sizes failed (fuzz seed 1001, a layer_norm's normalized_shape)."""
        for name, v in zip(piece.inputs, values):
            node = self.nodes.get(name)
            rec = node.meta.get("tensor_meta_rec") if node is not None else None
            if isinstance(v, torch.Tensor) and rec is not None and (
                    tuple(rec[0]) != tuple(v.shape) or tuple(rec[1]) != v.stride()):
                return False
        return True


class Follower(TorchFunctionMode):
    """Matches each torch call of one call of the function with the recording's (see
    the module docstring). Set as the thread's recorder, so fxlite's call hooks (an
    optimizer's step, ``autograd.Function.apply``) hand their calls to it whole."""

    def __init__(self, follow: Follow) -> None:
        super().__init__()
        self.follow = follow
        self.expects, self.keys = follow.expects, follow.keys
        self.dead = follow.dead
        self.at = 0
        self.env: dict[str, Any] = dict(follow.attrs)
        self.ids: dict[int, str] = dict(follow.externals)
        self.ran = [False] * len(follow.pieces)  # per piece: run in this call
        self.off = False
        self.diverged = False
        # where it left the match at a call of another function than the recorded one
        # (``Follow.moved``); None otherwise
        self.left: Left | None = None
        self.left_real = False  # (the recorded step there runs for real: no piece)
        # the call just matched runs for real with other values than the recorded ones:
        # its result must have the recorded layout (``_passes_other_values``)
        self.layout_check = False

    def bind(self, value: Any, name: str) -> None:
        self.env[name] = value
        if isinstance(value, torch.Tensor):
            self.ids[id(value)] = name

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        at, expects = self.at, self.expects
        upcoming = expects[at] if at < len(expects) else None
        # (a call of the next step's own function needs no classify: its kind is known)
        if upcoming.passed if upcoming is not None and func is upcoming.func \
                else classify(func) in _PASSED:
            return func(*args, **kwargs)
        expect = self._match(func, args, kwargs)
        if expect is None:  # (at another function than the recorded one: another path)
            at, expects = self.at, self.expects  # (as cut again, where it was)
            upcoming = expects[at] if at < len(expects) else None
            if upcoming is None or func is not upcoming.func \
                    and not same_func(upcoming.func, func):
                self.left = Left(at, func)
                self.left_real = upcoming is not None and upcoming.piece is None
            return self._diverge(func, args, kwargs)
        done = self.at - 1
        out = self._serve(func, args, kwargs, expect)
        for name in self.dead[done]:  # values no later step reads: they die here, as
            self.env.pop(name, None)  # eager's locals do (the Python holds what it kept)
        return out

    def _serve(self, func: Any, args: tuple, kwargs: dict, expect: Expect) -> Any:
        """The value of a matched call: run for real, or served by its piece."""
        piece = expect.piece
        if piece is None:  # a write, a random draw, a read, a view, an effect: for real
            out = func(*args, **kwargs)
            if self.layout_check and not self._recorded_layout(out, expect.node):
                self.off = self.diverged = True  # (it ran: the rest runs eagerly)
                return out
            if not expect.keeps_name:  # (its input keeps its name, as recorded)
                self._bind_out(out, expect.node)
            return out
        if not self.ran[piece.index]:  # its first call in this call: run it
            self.ran[piece.index] = True
            self.off = True  # fxlite's call hooks see the piece's own calls as no one's
            try:
                ok = self.follow.run_piece(piece, self.env)
            except Exception:  # its kernels refused these values: eager raises its own
                ok = False
            finally:
                self.off = False
            if not ok:
                return self._diverge(func, args, kwargs)
        name = expect.node
        if expect.tensor:
            out = self.env[name]
            self.ids[id(out)] = name
            return out
        out = self._value(expect.out, name)
        self._bind_out(out, name)
        return out

    # ------------------------------------------------------------------ matching
    def _match(self, func: Any, args: tuple, kwargs: dict) -> Expect | None:
        """The next recorded step, if this call is the same call: same function, same
        tensors (by the names this call gave them), equal other arguments."""
        at = self.at
        if at >= len(self.expects):
            return None
        expect = self.expects[at]
        if func is not expect.func and not same_func(expect.func, func):
            return None
        if expect.grad is not None and expect.grad is not torch.is_grad_enabled():
            return None  # Python chose another grad mode: a piece's values would differ
        if expect.node:
            try:
                key = _call_key(args, kwargs, self.ids, self.env)
            except _Unknown:
                if not self._rebind(func, args, kwargs, expect.node):
                    return None
                expect = self.expects[at]  # (the plan may have been cut again)
                try:
                    key = _call_key(args, kwargs, self.ids, self.env)
                except _Unknown:
                    return None
            if expect.scalars:  # (no key: its numbers differ from call to call)
                if not self._scalar_call(func, args, kwargs, expect):
                    expect = self._vary_scalars(func, args, kwargs, expect)  # another one
                    if expect is None or not self._scalar_call(func, args, kwargs, expect):
                        return None
                self.at = at + 1
                return expect
            known = self.keys[at]
            try:
                hit = known is not None and known == key
            except Exception:  # values without a plain equality: the full comparison
                hit = False
            if not hit:
                if not self._same_call(func, args, kwargs, self.follow.nodes[expect.node]):
                    if expect.piece is None and \
                            self._passes_other_values(func, args, kwargs, expect.node):
                        self.at, self.layout_check = at + 1, True  # (checked once it ran)
                        return expect
                    expect = self._vary_scalars(func, args, kwargs, expect)
                    if expect is None or not self._scalar_call(func, args, kwargs, expect):
                        return None
                    self.at = at + 1
                    return expect
                self.keys[at] = key  # later calls compare this key alone
        self.at = at + 1
        return expect

    def _passes_other_values(self, func: Any, args: tuple, kwargs: dict, name: str) -> bool:
        """Whether the call is node ``name``'s but for plain values (``_other_values``:
        Python numbers of the recorded types, lists and slices of them, numpy arrays of
        the recorded dtype and shape), where the node runs for real: ``p.addcdiv_(m, d,
        value=-lr / bias_correction)``, whose value an optimizer computes anew on each
        step; ``x[order]`` with a list shuffled anew. Its values are baked nowhere (it
        runs with the call's own), so the call goes on matching, provided its result then
        has the recorded layout (``_recorded_layout``): later pieces and calls see that
        real result by name, as they would the recorded call's."""
        node = self.follow.nodes[name]
        target, opcode, spelled = spelling(func, args)
        if opcode != node.op or not same_func(target, node.target):
            return False
        try:
            return _other_values(self._arg(tuple(spelled)), node.args) and \
                _other_values(self._arg(kwargs) if kwargs else {}, node.kwargs)
        except _Unknown:
            return False

    def _recorded_layout(self, out: Any, name: str) -> bool:
        """After a call matched by ``_passes_other_values`` ran: whether its result is
        nothing or a tensor of the layout (sizes, strides, dtype, device, whether it
        requires grad) node ``name`` recorded. Another layout (``x.view(n, -1)`` with another
        ``n``; ``x.resize_(n)``) or another kind of result ends the match there."""
        self.layout_check = False
        if out is None:
            return True
        recorded = self.follow.nodes[name].meta.get("tensor_meta_rec")
        return isinstance(out, torch.Tensor) and recorded is not None \
            and tensor_meta(out) == tuple(recorded)

    def _scalar_call(self, func: Any, args: tuple, kwargs: dict, expect: Expect) -> bool:
        """Whether the call is ``expect``'s but for its varying numbers, each of the
        recorded Python type; if so, each number is bound to its piece input's name."""
        node = self.follow.nodes[expect.node]
        target, opcode, spelled = spelling(func, args)
        if opcode != node.op or not same_func(target, node.target):
            return False
        spelled, kwargs = list(spelled), dict(kwargs)
        got: list[tuple[str, Any]] = []
        for pos, name in expect.scalars:
            where, recorded = (spelled, node.args) if type(pos) is int else (kwargs, node.kwargs)
            if type(pos) is int and pos >= len(spelled) or type(pos) is str and pos not in kwargs:
                return False
            value = where[pos]
            if not _number(value) or type(value) is not type(recorded[pos]):
                return False  # another type: another call (1 is not 1.0, nor True)
            got.append((name, value))
            where[pos] = recorded[pos]
        try:
            if not (_same(self._arg(tuple(spelled)), node.args)
                    and _same(self._arg(kwargs) if kwargs else {}, node.kwargs)):
                return False
        except _Unknown:
            return False
        for name, value in got:
            self.env[name] = value
        return True

    def _vary_scalars(self, func: Any, args: tuple, kwargs: dict, expect: Expect
                      ) -> Expect | None:
        """A call that is ``expect``'s but for Python numbers of the recorded types, passed
        as values of a pure pointwise op (``x * next(it)``, not a dim or a size): those
        numbers become varying (``Follow.vary_scalars``) and this call goes on matching,
        on pieces cut again (those that ran in this call did so before this node: their
        values stand). The step's new record; None for any other difference."""
        follow = self.follow
        node = follow.nodes[expect.node]
        if expect.piece is None:
            return None
        target, opcode, spelled = spelling(func, args)
        if opcode != node.op or not same_func(target, node.target):
            return None
        try:
            changed = _changed_numbers(self._arg(spelled), node.args, kwargs and self._arg(kwargs),
                                       node.kwargs)
        except _Unknown:
            return None
        if not changed or not _scalar_operands(node, changed) \
                or changed.keys() <= follow.scalars.get(node.name, {}).keys():
            return None  # (varying already: another type)
        self._cut_again(node, lambda: follow.vary_scalars(node.name, changed))
        return self.expects[self.at]

    def _cut_again(self, node: Node, change: Callable[[], None]) -> None:
        """Make ``change`` to the plan (pieces cut again) at node ``node``'s step, in
        the middle of a call: pieces made of nodes before it that ran in this call stand
        (their values are in ``env``); the others run at their first call from here on,
        computing again any value a piece that ran computed at or after ``node`` (which
        the Python has not been handed yet)."""
        follow = self.follow
        ran = {n.name for p in follow.pieces if self.ran[p.index] for n in p.nodes}
        change()
        here = follow.order[node.name]
        self.expects, self.keys = follow.expects, follow.keys
        self.ran = [follow.order[p.nodes[0].name] < here and all(n.name in ran for n in p.nodes)
                    for p in follow.pieces]

    def _rebind(self, func: Any, args: tuple, kwargs: dict, name: str) -> bool:
        """Bind the tensors this call passes where the recorded ``name`` had a loose
        constant (see the module docstring), each with the recorded layout and known by
        no other name; True if it bound any. Only at the step where a varying name is
        first used (no piece has read it yet in this call): a loose name found passed
        anew makes every loose name varying (the pieces cut again, mid-call), and is
        bound if this step is its first use, else this call leaves the match."""
        follow = self.follow
        node = follow.nodes[name]
        pairs: list[tuple[torch.Tensor, Node]] = []
        try:
            _, _, spelled = spelling(func, args)
            _pairs(spelled, node.args, pairs)
            _pairs(kwargs, node.kwargs, pairs)
        except Exception:
            return False
        fresh: dict[str, torch.Tensor] = {}
        for t, n in pairs:
            if self.env.get(n.name) is t:
                continue
            known = self.ids.get(id(t))
            if n.name not in follow.loose or (known is not None and self.env.get(known) is t) \
                    or fresh.get(n.name, t) is not t \
                    or tensor_meta(t) != n.meta.get("tensor_meta_rec"):
                return False
            fresh[n.name] = t
        if not fresh:
            return False
        first = follow.first_use.get(self.at, ())
        if any(n not in first for n in fresh):
            # every loose constant becomes varying at once (a batch's ``y`` is passed
            # anew after its ``x``), bound where first used; one the Python does not
            # pass anew stays bound to its recorded tensor. Where this step is the first
            # use of those passed here, this call binds them and goes on matching
            self._cut_again(node, lambda: follow.vary(follow.loose | set(fresh)))
            first = follow.first_use.get(self.at, ())
            if any(n not in first for n in fresh):
                return False
        for n, t in fresh.items():
            self.bind(t, n)
        return True

    def _same_call(self, func: Any, args: tuple, kwargs: dict, node: Node) -> bool:
        """Whether the call is ``node``'s, compared as the recorder wrote it (spelling,
        tensors as nodes, other values by ``_same``)."""
        target, opcode, spelled = spelling(func, args)
        try:
            return opcode == node.op and same_func(target, node.target) \
                and _same(self._arg(spelled), node.args) \
                and _same(self._arg(kwargs) if kwargs else {}, node.kwargs)
        except _Unknown:
            return False

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
    def _value(self, structure: Out, name: str) -> Any:
        kind = type(structure)
        if kind is TensorOut:
            return self.env[name]
        if kind is SeqOut:
            items = [sub.value if type(sub) is ValueOut
                     else self._value(sub, self._getitem(name, i))
                     for i, sub in enumerate(structure.items)]
            cls = structure.cls
            return cls(items) if cls in (tuple, list) or hasattr(cls, "n_fields") else cls(*items)
        return structure.value

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
        elif isinstance(out, (tuple, list)):  # at any depth, as the recorder named them
            for i, item in enumerate(out):
                if isinstance(item, (torch.Tensor, tuple, list)):
                    try:
                        self._bind_out(item, self._getitem(name, i))
                    except KeyError:
                        pass

    # ------------------------------------------------------------------ call hooks
    def call_opaque(self, target: Any, runner: Callable[..., Any], args: tuple,
                    kwargs: dict, touches: list[torch.Tensor] | None = None) -> Any:
        """A call recorded whole (an optimizer's step): matched, then run for real."""
        expect = self._match(target, args, kwargs)
        self.off = True  # its own torch calls are its business
        try:
            out = runner(*args, **kwargs)
        finally:
            self.off = self.diverged
        if expect is None or self.layout_check and not self._recorded_layout(out, expect.node):
            self.off = self.diverged = True
        else:
            self._bind_out(out, expect.node)
        return out

    def record_cond(self, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
        """``torch.cond``: runs the branch the predicate picks, eagerly, and ends the match."""
        self.off = self.diverged = True
        return (true_fn if bool(pred) else false_fn)(*operands)


# kinds of calls that run as called, unmatched: sizes, grad mode, printing...
_PASSED = frozenset({"meta", "grad_mode", *UNSUPPORTED})


def _expect(step: Step, piece: Piece | None, nodes: dict[str, Node],
            scalars: dict[str, dict[int | str, str]]) -> Expect:
    """``step``'s record for following it: what the follower would otherwise look up on
    every call (its piece, its node's meta, its function's kind, its varying numbers)."""
    node = nodes.get(step.node) if step.node else None
    return Expect(step.func, step.node, piece, type(step.out) is TensorOut,
                  node is not None and bool(node.meta.get("returns_input")), step.out,
                  classify(step.func) in _PASSED,
                  node.meta.get("grad_enabled") if node is not None else None,
                  tuple(scalars.get(step.node, {}).items()) if piece is not None else ())


def _number(v: Any) -> bool:
    """A Python number a kernel may take as an argument: a float, a bool, or an int
    that fits in 32 bits (a wider one may overflow the tensor's dtype, as eager says)."""
    t = type(v)
    return t is float or t is bool or t is int and -2**31 <= v < 2**31


def _other_values(a: Any, b: Any) -> bool:
    """Whether a call's argument ``a`` (tensors swapped for nodes) is the recorded ``b``
    but for plain values a call that runs for real may pass anew: numbers of the same
    Python type (``_number``), lists, tuples and slices of the same length holding them,
    numpy arrays of the same dtype and shape (``np.random.choice(n, 2)``). Tensors,
    containers' lengths, types and any other value must be the recorded ones."""
    if _same(a, b):
        return True
    t = type(a)
    if t is not type(b):
        return False
    if t is tuple or t is list:
        return len(a) == len(b) and all(_other_values(x, y) for x, y in zip(a, b))
    if t is dict:
        return a.keys() == b.keys() and all(_other_values(a[k], b[k]) for k in a)
    if t is slice:
        return _other_values((a.start, a.stop, a.step), (b.start, b.stop, b.step))
    if _ndarray(a):
        return a.dtype == b.dtype and a.shape == b.shape
    return _number(a) and _number(b)


def _ndarray(v: Any) -> bool:
    """Whether ``v`` is a numpy array (numpy is not imported for this)."""
    t = type(v)
    return t.__name__ == "ndarray" and t.__module__ == "numpy"


def _holds_ndarray(a: Any) -> bool:
    t = type(a)
    if t is tuple or t is list:
        return any(_holds_ndarray(x) for x in a)
    if t is dict:
        return any(_holds_ndarray(x) for x in a.values())
    return _ndarray(a)


def _changed_numbers(args: Any, rec_args: tuple, kwargs: Any, rec_kwargs: dict
                     ) -> dict[int | str, Any] | None:
    """The positions (index into ``args``, or keyword) where a call's plain number differs
    from the recorded one of the same Python type, with the call's value; None if
    anything else differs (another type, a container, a tensor, a keyword)."""
    kwargs = kwargs or {}
    if len(args) != len(rec_args) or kwargs.keys() != rec_kwargs.keys():
        return None
    changed: dict[int | str, Any] = {}
    for pos, a, b in [*((i, a, b) for i, (a, b) in enumerate(zip(args, rec_args))),
                      *((k, kwargs[k], rec_kwargs[k]) for k in kwargs)]:
        if _same(a, b):
            continue
        if not (_number(a) and _number(b) and type(a) is type(b)):
            return None
        changed[pos] = a
    return changed


# parameters of pointwise ops that are values (a kernel argument computes the same), not
# choices (``inplace``, ``approximate``, a dtype) nor exponents (eager computes x**2 as
# x*x, x**0.5 as sqrt: a kernel's pow differs in its last bits)
_VALUE_PARAMS = frozenset({"input", "other", "alpha", "min", "max", "beta", "threshold",
                           "negative_slope", "min_val", "max_val"})
# ops where an integer 0 raises in eager ("ZeroDivisionError") and not in a kernel (and
# ``truediv`` with a rounding mode); ``x / 0`` gives inf in both
_INT_DIVISIONS = frozenset({"floordiv", "remainder", "fmod"})


def _scalar_operands(node: Node, changed: dict[int | str, Any]) -> bool:
    """Whether each changed position of ``node``'s call is a value operand of a pointwise
    op (``x * s``, ``torch.clamp(x, max=m)``), which a kernel may take as an argument."""
    info = op_table.lookup(node)
    if info is None or info.kind != "pointwise" or info.varargs:
        return False
    for pos, value in changed.items():
        param = pos if type(pos) is str else info.params[pos] if pos < len(info.params) else None
        if param not in _VALUE_PARAMS:
            return False
        if type(value) is not float and (info.name in _INT_DIVISIONS or info.name == "truediv"
                                         and (len(node.args) > 2 or "rounding_mode" in node.kwargs)):
            return False
    return True


def _call_key(args: tuple, kwargs: dict, ids: dict[int, str], env: dict[str, Any]) -> tuple:
    """A call's arguments as a comparable tuple: a tensor as the name this call gave it
    (``_Unknown`` for one it gave none), a container as its length (a dict: its keys)
    then its items, any other value with its type (``1`` is not ``1.0``, nor ``True``).
    Equal to a key that matched the recording: the same call (the comparison that made
    that key knew the spelling, which depends on nothing else). ``x + 1`` with ``x``
    named ``t``::

        (args, kwargs) = ((x, 1), {})   ->   (2, "t", (int, 1))
    """
    out: list[Any] = [len(args)]
    for a in args:  # (as _add_key does, tensors inline: a call per argument is host time)
        if isinstance(a, torch.Tensor):
            name = ids.get(id(a))
            if name is None or env.get(name) is not a:
                raise _Unknown
            out.append(name)
        else:
            _add_key(a, out, ids, env)
    if kwargs:
        _add_key(kwargs, out, ids, env)
    return tuple(out)


def _add_key(a: Any, out: list[Any], ids: dict[int, str], env: dict[str, Any]) -> None:
    t = type(a)
    if t is tuple or t is list:
        out.append(len(a))
        for x in a:
            _add_key(x, out, ids, env)
    elif isinstance(a, torch.Tensor):
        name = ids.get(id(a))
        if name is None or env.get(name) is not a:
            raise _Unknown
        out.append(name)
    elif t is dict:
        out.append((_DICT, tuple(a)))
        for x in a.values():
            _add_key(x, out, ids, env)
    else:
        out.append((t, a if t is not float or a == a else _NAN))


def _pairs(a: Any, b: Any, out: list[tuple[torch.Tensor, Node]]) -> None:
    """Each tensor of a call's argument ``a`` with the node at its place in the recorded
    argument ``b`` (where the structures agree)."""
    if isinstance(a, torch.Tensor):
        if isinstance(b, Node):
            out.append((a, b))
    elif type(a) in (tuple, list) and type(b) in (tuple, list) and len(a) == len(b):
        for x, y in zip(a, b):
            _pairs(x, y, out)
    elif type(a) is dict and type(b) is dict:
        for k in a.keys() & b.keys():
            _pairs(a[k], b[k], out)


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


_DICT = object()  # marks a dict's keys in a call's key
_NAN = object()  # stands for NaN in a key (NaN is not equal to itself)


class _Unknown(Exception):
    """A tensor the recording does not know (made outside torch calls, or another one)."""


def _pure(node: Node) -> bool:
    """Whether ``node`` may run inside a piece: computed from its inputs alone, with new
    results that no one else can see (no view, not its input returned), no numpy array
    among its arguments. A ``getitem``
    of a multi-output op goes with the op."""
    meta = node.meta
    if node.op not in ("call_function", "call_method") or meta.get("impure") \
            or meta.get("mutated") or "read" in meta or meta.get("returns_input") \
            or meta.get("view"):
        return False
    if _holds_ndarray(node.args) or _holds_ndarray(node.kwargs):
        return False  # data from outside torch (``torch.as_tensor(rows)``): for real, so
        # that another array of its dtype and shape goes on matching (``_other_values``)
    kind = meta.get("type")
    if kind is torch.Tensor:
        return True
    items = [u for u in node.users if u.target is operator.getitem]
    return isinstance(kind, type) and issubclass(kind, tuple | list) and bool(items) and \
        all(u.meta.get("type") is torch.Tensor and not u.meta.get("view") for u in items)


def _pieces(rec: Recording, nodes: dict[str, Node], varying: set[str] = frozenset(),
            scalars: dict[str, dict[int | str, str]] | None = None) -> list[Piece]:
    """The recording's runs of pure nodes, in program order (see the module docstring);
    a node that reads a ``varying`` constant or passes varying numbers (``scalars``)
    starts a run, which takes them as inputs."""
    scalars = scalars or {}
    pieces: list[Piece] = []
    run: list[Node] = []

    def close() -> None:
        if run:
            made = {n.name for n in run}
            inputs: list[str] = []
            attrs: list[str] = []
            for n in run:
                for inp in n.all_input_nodes:
                    if inp.name in made or inp.name in inputs or inp.name in attrs:
                        continue
                    fixed = inp.op == "get_attr" and inp.name not in written \
                        and inp.name not in varying
                    (attrs if fixed else inputs).append(inp.name)
                inputs.extend(scalars.get(n.name, {}).values())
            outputs = [n.name for n in run if n.meta.get("type") is torch.Tensor]
            sized = any((n.target if type(n.target) is str else state_name(n.target))
                        in SIZE_FANOUT for n in run)
            pieces.append(Piece(list(run), inputs, outputs, attrs, fixed=sized))
            run.clear()

    # Parameters, buffers and constants no call writes are read by the piece itself, as
    # a replayed segment reads them (segments.py): a call gives it the other values
    # alone, and on a GPU its straight-line forward binds them once
    written = {name for n in rec.graph.nodes for name in n.meta.get("mutated", ())}

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
        if varying and any(inp.name in varying for inp in node.all_input_nodes) \
                or node.name in scalars:
            close()  # bound at this node's call, before the run reads it
        pure.add(node.name)
        run.append(node)
    close()
    pieces = [p for p in pieces if p.outputs]
    for i, piece in enumerate(pieces):
        piece.index = i
    return pieces


def _dead_after(rec: Recording) -> list[tuple[str, ...]]:
    """Per recorded step, the values no later step reads, which a followed call drops once
    that step is done. Kept to the call's end, a training step's activations outlived
    eager's (a transformers output's logits, through the backward)::

        %linear = linear(%x, %w)      step 0   dead after it: ()
        %relu = relu(%linear)         step 1   dead after it: (linear,)
        %sum = sum(%relu)             step 2   dead after it: (relu, sum)

    A value the graph's output reads, or that no step reads, is kept (the Python holds
    what it returns); an item of a multi-output op is read where its readers are."""
    step_of = {s.node: i for i, s in enumerate(rec.steps) if s.node}
    never = len(rec.steps)
    last: dict[str, int] = {}
    for node in reversed(list(rec.graph.nodes)):  # readers before the values they read
        at = step_of.get(node.name, -1)
        for user in node.users:
            at = max(at, never if user.op == "output" else
                     step_of.get(user.name, last.get(user.name, never)))
        last[node.name] = at if at >= 0 else never
    dead: list[list[str]] = [[] for _ in rec.steps]
    for node in rec.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and \
                last[node.name] < never:
            dead[last[node.name]].append(node.name)
    return [tuple(d) for d in dead]


def _signature(piece: Piece) -> tuple:
    """What a piece's compiled form depends on: its nodes, its inputs and attributes."""
    return tuple(n.name for n in piece.nodes), tuple(piece.inputs), tuple(piece.attrs)


def _piece_graph(piece: Piece, rec: Recording, nodes: dict[str, Node],
                 scalars: dict[str, dict[int | str, str]] | None = None,
                 types: dict[str, type] | None = None) -> GraphModule:
    """A module computing ``piece`` from its inputs and the attributes it reads (held by
    the recording's holder), returning every one of its values::

        recording                                     piece 0 (inputs: t)
        %t = placeholder                              %t = placeholder
        %w = get_attr[mlp.0.weight]                   %w = get_attr[mlp.0.weight]
        %linear = linear(%t, %w)                      %linear = linear(%t, %w)
        %gelu = gelu(%linear)                         %gelu = gelu(%linear)
        %item = item(%gelu)       (a read: its own)   output((%linear, %gelu))

    A varying number (``scalars``) is a placeholder of its Python type in its place::

        %mul = mul(%t, 0.5)       (0.5 varying)       %mul_scalar_1 = placeholder
                                                      %mul = mul(%t, %mul_scalar_1)
    """
    scalars, types = scalars or {}, types or {}
    graph = Graph()
    env: dict[Node, Node] = {}
    numbers: dict[str, Node] = {}
    for name in piece.inputs:
        new = graph.placeholder(name)
        if name in types:
            new.meta = {"type": types[name]}
            numbers[name] = new
            continue
        old = nodes[name]
        new.meta = dict(old.meta)
        env[old] = new
    for name in piece.attrs:
        old = nodes[name]
        new = graph.get_attr(old.target)
        new.meta = dict(old.meta)
        env[old] = new
    for node in piece.nodes:
        new = env[node] = graph.node_copy(node, lambda n: env[n])
        for pos, name in scalars.get(node.name, {}).items():
            if type(pos) is int:
                new.args = (*new.args[:pos], numbers[name], *new.args[pos + 1:])
            else:
                new.kwargs = {**new.kwargs, pos: numbers[name]}
    graph.output(tuple(env[nodes[n]] for n in piece.outputs))
    return GraphModule(rec.holder, graph)


class _Layouts(Interpreter):
    """Runs a piece's graph on a call's values, noting each tensor's layout by node."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.layouts: dict[str, tuple] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.layouts[n.name] = tensor_meta(out)
        return out


def _resize(gm: GraphModule, values: list[Any]) -> bool:
    """Give ``gm``'s nodes (a piece's graph) the sizes and strides its recorded ops
    compute from ``values`` (run once, eagerly), in place of the recording's, so that it
    is compiled for the sizes of the call that first runs it; False, changing nothing,
    where they raise on these values (a number in the graph that fits the recorded sizes
    alone: that call passes another, and leaves the match there)::

        recording (x: 2x8)                          first run on a 3x8 x
        %x = placeholder      [2, 8]                %x = placeholder      [3, 8]
        %relu = relu(%x)      [2, 8]       ->       %relu = relu(%x)      [3, 8]
        %add = add(%relu, 1)  [2, 8]                %add = add(%relu, 1)  [3, 8]
    """
    probe = _Layouts(gm)
    try:
        probe.run(*values)
    except Exception:
        return False
    for node in gm.graph.nodes:
        layout, rec = probe.layouts.get(node.name), node.meta.get("tensor_meta_rec")
        if layout is not None and rec is not None:  # (dtypes, devices, grads: recorded)
            node.meta["tensor_meta_rec"] = (layout[0], layout[1], *rec[2:])
    return True
