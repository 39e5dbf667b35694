"""fxlite.compile: record a function's torch calls, compile them into kernels, replay them.

    call ─► key (capture/guards.py) ─► segment tree (capture/segments.py) ─► compiled
              │ a new key, or a value read           segments (runtime/) ─► result
              │ that no path has seen
              ▼
           record (capture/run.py): run the Python for real ─► cut at reads ─► compile
           each segment (lower/: functionalize, decompose, fuse, Triton, checks)

The first call with a new key runs the user's function itself under the recorder, so its
result is eager PyTorch's own. Later calls with that key take one of three tiers:

1. replay the compiled segments, when the recording watcher (capture/watch.py) saw the
   Python do nothing but compute tensors; where Python read a tensor's value
   (``if x.sum() > 0``), the call reads it too and follows the path recorded for that
   value, or records the new path from that point on;
2. follow (capture/follow.py), when the Python did more (printed, appended, drew random
   numbers): the Python runs on every call and its torch calls are served by compiled
   pieces;
3. eager, with one warning, where neither holds (below).

Falls back to eager PyTorch, with one warning naming the user's line, when: the function
reads tensors' addresses or reseeds the generator (Python state it changes, a module's
step counter or training flag, an argument's attributes, a dict that keeps tensors, makes
it followed, as does inference mode; a path recorded after a read that changes the state
its key holds runs in eager); a function is recorded more than ``recompile_limit`` times (8, as torch's cache limit;
one whose keys differ in float arguments' values alone is then recorded once more and
followed, those floats varying: ``f(x, a)`` given a new ``a`` on every call);
and, per segment, when a pass or kernel fails or its results disagree with eager.
"""

from __future__ import annotations

import copy
import functools
import linecache
import operator
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from fxlite.codegen.capture.follow import Follow
from fxlite.codegen.capture.guards import StateGuard, ambient_key, input_key
from fxlite.codegen.capture.kinds import eager_context
from fxlite.codegen.capture.records import LIB_DIRS, last_frame, strided_clone
from fxlite.codegen.capture.run import format_site, record, recording_thread
from fxlite.codegen.capture.segments import Segment, read_key, split
from fxlite.codegen.capture.structure import flatten_call
from fxlite.codegen.capture.symbolic import dynamo_graph, keyed_positions, symbolic_positions
from fxlite.codegen.compiler import register
from fxlite.codegen.dynamic import DynamicFunction
from fxlite.codegen.kernels.generate import interpreting
from fxlite.codegen.lower.batch_norm import update_running_stats
from fxlite.codegen.lower.pipeline import ambient, ambient_restored, lint_failure, set_ambient
from fxlite.codegen.lower.segment import (
    CompiledSegment,
    compile_segment,
    direct_forward,
    expand_kernels,
)
from fxlite.codegen.lower.written_inputs import written_later
from fxlite.codegen.options import MODES, Settings, resolve
from fxlite.codegen.report import kernel_report
from fxlite.codegen.runtime.cudagraphs import GraphReplays, side_stream
from fxlite.codegen.runtime.straight_line import AttrCheck, StraightRunner, fast_key
from fxlite.codegen.runtime.trial import Trial, choose_runner
from fxlite.passes.functionalize import changes_state

from fxlite.graph_module import QUIET_CALLERS, GraphModule
from fxlite.logs import log_break, log_graph
from fxlite.node import Node
from fxlite.ops import lookup, lookup_target
from fxlite.proxy import TraceError

__all__ = ["CompiledFunction", "CompiledModule", "compile"]

Backend = str | Callable[[GraphModule, list[Any]], Callable[..., Any]]
_warned: set[str] = set()
_EAGER = object()  # a key or read value whose path runs in eager PyTorch
_NOT_RUN = object()  # what _straight_line returns when it ran nothing


class StateKey(NamedTuple):
    """The Python state a replay depends on (part of a :class:`CallKey`)."""

    guards: Any  # module, closure-cell and global state (``StateGuard.key``)
    grads: tuple[bool, ...]  # whether each gradient a recording read is None


class CallKey(NamedTuple):
    """What a call's recorded paths are stored under: calls with equal keys replay them.

    A followed plan's key for any values of float arguments is one too, with the floats'
    entries masked and ``_NUMBERS`` for its state (``_numbers_key``)."""

    structure: Any  # the arguments' structure: positions, keyword names, containers
    ambient: Any  # grad mode, autocast and the default dtype (``guards.ambient_key``)
    inputs: tuple  # each argument leaf's dtype, device, layout, ... or value (``input_key``)
    state: Any  # a StateKey (``_NUMBERS`` in a numbers key)
    sizes: tuple | None = None  # the tensor arguments' sizes, once a recording read them


class FollowKey(NamedTuple):
    """A followed plan's key: no Python state (its Python runs on every call), and plain
    objects among the arguments by class, identity and attribute names alone."""

    structure: Any
    ambient: Any
    inputs: tuple
    requires_grad: tuple = ()  # the parameters' (StateGuard.requires_grad)


class FastKey(NamedTuple):
    """The key of a straight-line forward: calls whose arguments are all tensors."""

    layouts: Any  # ``straight_line.fast_key(args)``: the tensors' layouts
    ambient: Any
    state: StateKey
    values: tuple = ()  # a Dynamo graph's floats passed as tensors (symbolic.keyed_positions)


_NO_FAST_KEY = FastKey(None, None, None)  # type: ignore[arg-type]  # (no straight line)


class FastEntry(NamedTuple):
    """A call's straight-line forward, kept under its :class:`FastKey`."""

    run: Callable[..., Any]  # the segment's forward for these layouts
    segment: Segment  # the one segment it runs (its result rebuilds the user's)
    check: AttrCheck  # the attribute tensors still have the layouts it was written for


def warn_user(message: str) -> None:
    """Warn once per message, attributed to the innermost frame of the user's code."""
    if message in _warned:
        return
    _warned.add(message)
    level, f = 2, sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(LIB_DIRS)
                             or f.f_code.co_filename.startswith("<")):
        level, f = level + 1, f.f_back
    warnings.warn(message, stacklevel=level)


class CompiledFunction:
    """What :func:`compile` returns for a function: call it like the original.

    Attributes:
        kernels: the Triton kernels the latest call ran.
        fallbacks: why parts of it run in eager PyTorch.
        trials: on a GPU, how each segment's race of its kernels against its recorded ops
            ended (``codegen/runtime/trial.py``).
        code: the generated Python of each segment the latest call ran.
        recompile_limit: how many paths and keys are recorded before new ones run eagerly.
    """

    recompile_limit = 8

    def __init__(self, fn: Callable[..., Any], backend: Backend = "triton",
                 fullgraph: bool = False, mode: str | None = None) -> None:
        _check_options(fn, backend, fullgraph, mode)
        self._fn, self._backend, self._fullgraph, self._mode = fn, backend, fullgraph, mode
        self._given: dict[str, Any] = {}  # compile()'s arguments (set by it), for copies
        self._guard = StateGuard(fn)
        self._trees: dict[CallKey, Any] = {}  # key -> root Segment, or _EAGER
        # (structure, ambient state, input layouts) -> the Follow of a recording whose
        # Python must run on every call (no Python state in its key: the Python runs)
        self._followed: dict[FollowKey | CallKey, Any] = {}
        self._by_numbers = False  # some plan is followed for any value of float arguments
        self._behind_back_warned = False
        self._replay_warned = False
        # keys whose recordings read sizes -> the size arguments that decide them (None: the
        # sizes of every argument)
        self._sized: dict[CallKey, tuple[int, ...] | None] = {}
        # the positions of the sizes a Dynamo graph takes as arguments: recorded as inputs
        # (capture/symbolic.py), so that one recording serves every size
        self._symbolic = symbolic_positions(fn)
        self._keyed = keyed_positions(fn)  # its floats passed as tensors: keyed by value
        # fn under Dynamo (dynamic.DynamicFunction) once an argument was marked with
        # torch._dynamo.mark_dynamic; a graph's arguments (Dynamo's own) are not followed
        self._dynamo: Any = None
        self.follow_marks = not isinstance(fn, torch.fx.GraphModule)
        self._recordings = 0
        # key -> why its calls run in eager PyTorch
        self._eager_why: dict[CallKey | FollowKey, str] = {}
        self._last_eager: str | None = None  # why the latest call did, when it did
        self._limit_warned = False
        self._lock = threading.RLock()
        self._last: list[Segment] = []
        self._alias = False  # keys hold storage sharing once a recording writes tensors
        # tensors whose .grad a recording read: whether each is None is part of the key
        # (optimizer.zero_grad() only clears gradients that exist)
        self._grad_watch: list[torch.Tensor] = []
        self._graphs: Any = None  # GraphReplays, for mode="reduce-overhead" on CUDA
        if mode == "reduce-overhead" and backend == "triton" and torch.cuda.is_available():
            self._graphs = GraphReplays()
        # the straight-line forwards of calls with tensor arguments only whose path is one
        # segment with kernels (codegen/runtime/straight_line.py); None when off
        self._fast: dict[FastKey, FastEntry] | None = None
        if backend == "triton" and mode != "reduce-overhead" and torch.cuda.is_available():
            self._fast = {}
        # a Dynamo graph: its calls may take the straight line with sizes and parameters
        self._graph_args = dynamo_graph(fn)
        if self._graph_args:  # (Dynamo drops its records from the graph after compiling)
            _GRAPH_NAMES[fn] = _graph_name(fn)
        if self._keyed:  # (CUDA graphs key tensors by layout, not by these values)
            self._graphs = None
        if not isinstance(fn, torch.nn.Module):
            try:
                functools.update_wrapper(self, fn)
            except AttributeError:  # builtins such as torch.relu have no __dict__
                pass

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy compiles the same function again with the same arguments; a method of an
        object (``model.forward = fxlite.compile(model.forward)``) becomes that method of
        the object's copy, as when the object itself is deep-copied (an EMA model). Its
        recordings and kernels are its own."""
        fn = self._fn
        owner = getattr(fn, "__self__", None)
        if owner is not None and not isinstance(owner, types.ModuleType) \
                and hasattr(fn, "__func__"):
            fn = types.MethodType(fn.__func__, copy.deepcopy(owner, memo))
        return compile(fn, **self._given)

    # ------------------------------------------------------------------ calling
    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """Bound to the instance when it is a method in a class body, as a function (and
        torch.compile's result) is::

            class Model:
                @fxlite.compile
                def run(self, x): ...
            Model().run(x)          # run(self=that model, x)
        """
        return self if obj is None else types.MethodType(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._dynamo is not None:
            return self._dynamo(*args, **kwargs)
        rec = recording_thread()
        if rec is not None and not rec.off:  # inside another recording: be recorded
            return self._fn(*args, **kwargs)
        odd = eager_context()
        if odd is not None:
            why = f"it {odd}"
            warn_user(f"fxlite.compile: {_name(self._fn)} runs in eager PyTorch: {why}")
            self._last, self._last_eager = [], why
            return self._fn(*args, **kwargs)
        if self._followed and not self._trees:  # followed only: no replay key to compute
            out = self._follow_only(args, kwargs)
            if out is not _NOT_RUN:
                return out
        fast, graphs = self._fast, self._graphs
        # Both shortcuts serve calls whose arguments are all tensors (so the state key has
        # no module arguments, as below): check that before computing any key.
        # (a tensor with Python attributes takes the general path: its key holds them)
        tensors_only = not kwargs and all(type(a) is _TENSOR and a.layout is _STRIDED
                                          and not a.is_nested and not a.__dict__ for a in args)
        # a Dynamo graph's arguments also hold sizes, and parameters (with attributes its
        # code never reads): the straight line takes them as they are
        straight = tensors_only or (self._graph_args and not kwargs and _graph_args(args))
        fkey = _NO_FAST_KEY
        # the state key, once a call (the guard walks a part of the modules each key)
        state: StateKey | None = None
        if fast is not None and straight:  # laid out as seen before: launch directly
            keyed = self._keyed
            state = self._state_key()
            fkey = FastKey(fast_key(args), ambient_key(), state,
                           tuple(args[i].item() for i in keyed) if keyed else ())
            found = fast.get(fkey)
            if found is not None and found.check():
                seg = found.segment
                self._last = [seg]
                try:
                    return seg.result(found.run(*args))
                except Exception:
                    return self._replay_failed(seg, args, kwargs)
        replay_key = None
        if graphs is not None and tensors_only:  # a CUDA graph captured for these inputs
            if state is None:
                state = self._state_key()
            replay_key = graphs.key(args, (ambient_key(), state))
            found = graphs.replay(replay_key)
            if found is not graphs.MISS:
                self._last = [found[1]]
                return found[1].result(found[0])
        leaves, spec = flatten_call(args, kwargs)
        odd = _unusual(leaves)
        if odd is not None:  # sparse, nested or subclass tensors: eager, with one warning
            why = f"it is given a {odd}, which fxlite does not compile"
            warn_user(f"fxlite.compile: {_name(self._fn)} runs in eager PyTorch: {why}")
            self._last, self._last_eager = [], why
            return self._fn(*args, **kwargs)
        arg_modules = tuple(x for x in leaves if isinstance(x, torch.nn.Module))
        base = CallKey(spec, ambient_key(), input_key(leaves, False, self._alias,
                                                      symbolic=self._symbolic, keyed=self._keyed),
                       state if state is not None and not arg_modules
                       else self._state_key(arg_modules))
        key = self._sized_key(base, leaves)
        root = self._trees.get(key)
        if root is None and self._followed:
            plan_key: Any = self._follow_key(base, leaves)
            plan = self._followed.get(plan_key)
            if plan is None and self._by_numbers:
                plan_key = _numbers_key(base, leaves)
                plan = self._followed.get(plan_key) if plan_key is not None else None
            if plan is _EAGER:
                self._last, self._last_eager = [], self._eager_why.get(plan_key)
                return self._fn(*args, **kwargs)
            if plan is not None:
                return self._follow(plan, plan_key, args, kwargs, leaves)
        if root is None:
            with self._lock:
                root = self._trees.get(key)
                if root is None:
                    return self._first(key, base, leaves, args, kwargs)
        if root is _EAGER:
            self._last, self._last_eager = [], self._eager_why.get(key)
            return self._fn(*args, **kwargs)
        if root.read is None and root.compiled is not None and root.compiled.kernels and (
                fast is not None and straight or graphs is not None and tensors_only
                and not _trains(root.compiled)) \
                and root.picks is not None and not isinstance(root.run, Trial):
            self._last = [root]
            try:
                if graphs is not None:
                    run = getattr(root.run, "plain", root.run)  # not SegmentGraphs in a graph
                    return root.result(graphs.run(replay_key, run, args, root))
                out = self._straight_line(fkey, root, args, root.picks)
            except Exception:
                return self._replay_failed(root, args, kwargs)
            if out is not _NOT_RUN:
                return root.result(out)
        return self._walk(root, leaves, args, kwargs)

    def _marked_dynamic(self, args: tuple, kwargs: dict) -> Any:
        """A call given a tensor marked with ``torch._dynamo.mark_dynamic``: from now on
        ``fn`` runs under Dynamo, which keeps the marked sizes symbolic, and fxlite compiles
        its graphs (as ``fxlite.compile(fn, dynamic=True)`` does for every size)."""
        backend, mode, limit = self._backend, self._mode, self.recompile_limit
        self._dynamo = DynamicFunction(
            self._fn, lambda gm: compile(gm, backend=backend, mode=mode,
                                         recompile_limit=limit), self._fullgraph, dynamic=None)
        return self._dynamo(*args, **kwargs)

    def _replay_failed(self, seg: Segment, args: tuple, kwargs: dict,
                       grad: tuple | None = None) -> Any:
        """Called in an ``except`` clause, where replaying ``seg``'s path raised: re-raise,
        or, when its recording changes nothing (no write, no random draw, no effect), run
        the function again from the start. Eager then raises its own exception, at the
        user's line, where the user's ``except`` sees it (a shape that no longer
        broadcasts, a Cholesky of a matrix that is not positive definite).

        Where eager then returns, the replay raised what the program does not. A
        RuntimeError, IndexError or ValueError is what ops raise on values (the program
        may catch it itself: a size that no longer broadcasts); any other exception (a
        TypeError, an AttributeError, a KeyError) is fxlite's own failure, which would
        otherwise cost every such call a replay and an eager run unseen: the first one
        warns, with the exception."""
        if grad is not None:  # eager's `with torch.no_grad():` (and autocast's `with`)
            set_ambient(grad)  # restore them on the way out
        error = sys.exc_info()[1]
        if not (_pure(seg.recording) or _nothing_written(seg, error)):
            raise  # the exception being handled
        self._last = []
        out = self._fn(*args, **kwargs)
        if not self._replay_warned and not isinstance(error, _VALUE_ERRORS):
            self._replay_warned = True
            said = str(error).strip().splitlines()
            warn_user(f"fxlite.compile: a compiled call of {_name(self._fn)} raised "
                      f"{type(error).__name__}{': ' + said[0] if said else ''}, where eager "
                      "PyTorch did not: an fxlite bug, please report it. That call ran in "
                      "eager PyTorch, as will others that raise so")
        return out

    def _straight_line(self, fkey: FastKey, seg: Segment, args: tuple,
                       picks: tuple[int, ...]) -> Any:
        """Run the segment through its straight-line runner and keep the forward it used
        for these layouts, so the next such call skips the tree; its result, or
        ``_NOT_RUN`` having run nothing. ``picks``: the arguments the segment takes."""
        fast, run = self._fast, seg.run
        if fast is None or fkey.layouts is None or len(fast) >= 64 \
                or not isinstance(run, StraightRunner):
            return _NOT_RUN
        every = picks == tuple(range(len(args)))
        taken = args if every else tuple(args[i] for i in picks)
        out = run(*taken)
        forward = run.complete(fkey.layouts if every else fast_key(taken))
        if forward is not None:
            straight = forward.run if every else functools.partial(_picked, forward.run, picks)
            fast[fkey] = FastEntry(straight, seg, forward.check)
        return out

    def _walk(self, seg: Segment, leaves: list[Any], args: tuple, kwargs: dict) -> Any:
        grad = ambient()  # grad mode and autocast as the call began
        try:
            if seg.read is None and seg.direct:  # one segment taking the arguments as is
                self._last = [seg]
                return seg.result(seg.run(*leaves))
            return self._walk_path(seg, leaves, args, kwargs)
        except Exception as e:
            if getattr(e, "_fxlite_user", False):  # the user's own code raised, recording
                set_ambient(grad)
                raise
            return self._replay_failed(seg, args, kwargs, grad)

    def _walk_path(self, seg: Segment, leaves: list[Any], args: tuple, kwargs: dict) -> Any:
        entry = ambient()
        rec = seg.recording
        env = {name: leaf for name, leaf in zip(rec.placeholders, leaves) if name is not None}
        path = []
        while True:
            taken = seg.arguments(env)
            try:
                outs = seg.run(*taken)
            except Exception as e:  # (for _nothing_written: how far the call got)
                if not path or not _raised_before_writes(seg, e):
                    _note_ran_before(e, len(path))
                    raise
                # a later segment that raised before writing (running the call again
                # would repeat the earlier segments' writes): its recorded ops, eager's,
                # write in eager's order up to the op that raises, and raise eager's
                # exception, or, where only the kernels raised, give eager's results.
                # (Grad mode and autocast are as the segment began: a graph that changes
                # them is not one whose writes come last.)
                outs = direct_forward(seg.gm)(*taken)
            path.append(seg)
            if seg.read is None:
                self._last = path
                return seg.result(outs)
            env.update(zip(seg.outputs, outs))
            child = seg.children.get(read_key(outs[0]))
            if child is None or child is _EAGER:
                self._last = path
                try:
                    with self._lock:
                        # the segments run so far may have left grad mode or autocast
                        # changed (a read inside `with torch.no_grad():`); the Python runs
                        # again from the start, as the call began
                        set_ambient(entry)
                        return self._miss(seg, outs[0], env, leaves, args, kwargs,
                                          eager=child is _EAGER)
                except Exception as e:  # the user's code, running for real
                    e._fxlite_user = True  # type: ignore[attr-defined]
                    raise
            seg = child

    # ------------------------------------------------------------------ recording
    def _first(self, key: CallKey, base: CallKey, leaves: list[Any], args: tuple,
               kwargs: dict) -> Any:
        fkey = self._follow_key(base, leaves)  # (as the call began: it may add attributes)
        numbers = _numbers_key(base, leaves)
        if self._recordings >= self.recompile_limit:
            # past the limit because float arguments' values keep changing (the keys
            # recorded differ from this one in those alone): one more recording, followed
            # with those floats varying (follow.py), rather than eager
            if numbers is None or numbers in self._followed or sum(
                    1 for k in (*self._trees, *self._followed)
                    if (isinstance(k, FollowKey) or k.state == base.state)
                    and _numbers_key(k, leaves) == numbers) < 2:
                self._over_limit(_what_changed(list(self._trees), key, leaves))
                self._last, self._last_eager = [], (
                    f"it was recorded {self.recompile_limit} times (recompile_limit)")
                return self._fn(*args, **kwargs)
            fkey = numbers
        if self.follow_marks and any(getattr(x, "_dynamo_dynamic_indices", None)
                                     for x in leaves if isinstance(x, torch.Tensor)):
            return self._marked_dynamic(args, kwargs)
        self._recordings += 1
        arg_modules = tuple(x for x in leaves if isinstance(x, torch.nn.Module))
        with side_stream(self._graphs_wanted()):
            result, rec = record(self._fn, args, kwargs, roots=self._guard.roots(leaves),
                                 fullgraph=self._fullgraph, bound=self._guard.bound_objects(),
                                 symbolic=self._symbolic, keyed=self._keyed)
        if self._stays_eager(rec, base, arg_modules, key):
            return result
        if rec.effect is None:
            rec.effect = self._guard.unchecked(rec.globals_read)
        if fkey is numbers:
            self._by_numbers = True
            if rec.effect is None:
                rec.effect = ("is given another float on each call, which its kernels take "
                              "as an argument")
        if rec.effect is not None and self._recordings == 1 < self.recompile_limit \
                and rec.effect.startswith(_ONCE):
            # a first call's log message or warning is often its only one (transformers'
            # warning_once, an lru_cache over the message): the next call records again
            what, _, site = rec.effect.partition("\n")
            self._last = []
            self._last_eager = f"it {what} (the next call records again)\n{site}".rstrip()
            return result
        if rec.effect is not None:  # its Python runs on every call, served by kernels:
            # Python state needs no guard then, and calls that leave the recording run on
            # eagerly (follow.py)
            rec.pre_state.clear()  # snapshots for the checks of replayed segments only
            plan = self._followed[fkey] = Follow(rec, self._fn, self._compile_piece, rec.effect)
            plan.first_call = self._recordings == 1
            self._last = plan.pieces  # (not compiled yet: this call ran eagerly)
            return result
        base = self._watch_globals(rec, base, arg_modules)
        segments = split(rec)
        failure = self._compile(segments, rec, 0, _sample_env(rec, leaves))
        if failure is not None:
            self._eager(key, failure)
            return result
        _link(segments)
        segments[0].direct = _plain(segments[0], leaves)
        segments[0].picks = _picks(segments[0], leaves, self._keyed)
        # A recording that writes tensors adds storage sharing to keys from now on (see
        # _stays_eager), one that reads gradients their presence, one that reads sizes
        # sizes: store it under its key's new form.
        pattern = list(base.state.grads)  # the gradients' presence as the call began
        watched = {id(t) for t in self._grad_watch}
        for t, was_none in rec.grad_reads:
            if id(t) not in watched:
                watched.add(id(t))
                self._grad_watch.append(t)
                pattern.append(was_none)
        base = base._replace(inputs=input_key(leaves, False, self._alias,
                                              symbolic=self._symbolic, keyed=self._keyed),
                             state=base.state._replace(grads=tuple(pattern)))
        if rec.sizes_read:
            was = self._sized.get(base, ())
            self._sized[base] = None if was is None or rec.sizes_from is None else \
                tuple(sorted({*was, *rec.sizes_from}))
        key = self._sized_key(base, leaves)
        self._trees[key] = segments[0]
        self._last = segments
        return result

    def _compile_piece(self, gm: GraphModule, sample: list[Any]) -> Any:
        """Compile one piece of a followed recording on this call's values (follow.py)."""
        name = _name(self._fn)
        warn = lambda reason: warn_user(f"fxlite.compile: in {name}, {reason}")
        log_graph(gm, f"{name}, a piece of a followed call")
        with ambient_restored():
            return compile_segment(gm, sample, backend=self._backend, mode=self._mode,
                                   warn=warn)

    def _follow_only(self, args: tuple, kwargs: dict) -> Any:
        """A call of a function with no replayed recording: follow the plan of its
        arguments' structure and layouts (or run it in eager PyTorch, where that plan says
        so) without computing the state key, which only a replay needs (followed Python
        runs); ``_NOT_RUN`` for a call that has no plan (a new key: ``__call__`` goes on)."""
        leaves, spec = flatten_call(args, kwargs)
        if _unusual(leaves) is not None:
            return _NOT_RUN
        key = FollowKey(spec, ambient_key(), input_key(leaves, False, self._alias, False),
                        self._guard.requires_grad())
        plan = self._followed.get(key)
        if plan is None:
            return _NOT_RUN
        if plan is _EAGER:
            self._last, self._last_eager = [], self._eager_why.get(key)
            return self._fn(*args, **kwargs)
        return self._follow(plan, key, args, kwargs, leaves)

    def _follow(self, plan: Follow, key: FollowKey | CallKey, args: tuple, kwargs: dict,
                leaves: list[Any]) -> Any:
        """Run the function's Python, its torch calls served by the plan's kernels. After
        two calls in a row that leave the recording at the same step for the same call
        of another function than the recorded one, the Python has taken another path
        and keeps to it (``body.requires_grad_(True)`` at step 3, a model put in eval
        mode; ``Follow.moved``): the plan is dropped, and the next call records one for
        the new behaviour, while recordings are left (``recompile_limit``). After three
        calls in a row that leave it otherwise (their arguments differ from the recorded
        ones on every call: a number drawn anew as an exponent, another batch size passed
        to a view; paths taken in turn), it runs in eager PyTorch. A plan recorded at the
        function's first call is dropped so at the first call that leaves it at a step
        that runs for real, if none matched it to its end: the first call often differs
        from all later ones in what it reads and writes (``opt.zero_grad()`` with
        gradients still None, an optimizer making its state)."""
        if plan.stale:  # dropped: this call records anew (``__call__`` finds no plan)
            with self._lock:
                if self._followed.get(key) is plan:
                    del self._followed[key]
            return self(*args, **kwargs)
        self._last = plan.pieces
        out = plan(args, kwargs, self._guard.bound_objects(), leaves)
        if (plan.moved >= 2 or plan.restart) and self._recordings < self.recompile_limit:
            plan.stale = True  # (the next call records: this one reads as followed)
            return out
        if plan.diverged >= 3:
            why = (f"its torch calls differ from its recorded ones on every call (it "
                   f"{plan.why.splitlines()[0]})")
            warn_user(f"fxlite.compile: {_name(self._fn)} runs in eager PyTorch: {why}")
            self._followed[key], self._eager_why[key] = _EAGER, why
            self._last, self._last_eager = [], why  # (this call ended eagerly too)
        return out

    def _follow_key(self, base: CallKey, leaves: list[Any]) -> FollowKey:
        """The key of a followed plan: ``base``'s structure, ambient state and input key,
        plain objects in it by class, identity and attribute names alone (their Python runs
        and reads what they hold on every call: ``guards.argument_key``)."""
        requires = self._guard.requires_grad()  # (a frozen layer unfrozen: new pieces)
        if all(isinstance(x, _PLAIN_LEAVES) for x in leaves):
            return FollowKey(base.structure, base.ambient, base.inputs, requires)  # (no object)
        return FollowKey(base.structure, base.ambient,
                         input_key(leaves, False, self._alias, False), requires)

    def _sized_key(self, base: CallKey, leaves: list[Any]) -> CallKey:
        """``base`` with the arguments' sizes where a recording under it read sizes."""
        if base not in self._sized:
            return base
        positions = self._sized[base]
        if positions is None:
            return base._replace(sizes=input_key(leaves, True))
        return base._replace(sizes=tuple(leaves[i] for i in positions))

    def _graphs_wanted(self) -> bool:
        """Whether segments may be captured in CUDA graphs (``mode="reduce-overhead"``)."""
        return self._mode == "reduce-overhead" and torch.cuda.is_available() and \
            not interpreting()

    def _state_key(self, arg_modules: tuple = ()) -> StateKey:
        """Module, closure and global state, and which watched gradients are None."""
        grads = tuple(t.grad is None for t in self._grad_watch) if self._grad_watch else ()
        key = StateKey(self._guard.key(arg_modules), grads)
        if self._guard.behind_back and not self._behind_back_warned:
            self._behind_back_warned = True
            warn_user(
                f"fxlite.compile: a module {_name(self._fn)} uses was changed behind "
                "nn.Module's back (its __dict__, _parameters, _buffers or _modules written "
                "directly), which fxlite checks only every 16 calls: up to 15 calls before "
                "this one may have used the old state. It now checks on every call; assign "
                "with setattr (or register_parameter / register_buffer) to keep it cheap")
        return key

    def _stays_eager(self, rec: Any, base: CallKey, arg_modules: tuple, key: CallKey) -> bool:
        """Whether a recording cannot be compiled; if so, mark what runs eagerly instead.
        One whose call changed the state its key holds (a module's counter or training
        flag, a rebound buffer) gets ``rec.effect``: it is followed (follow.py), where a
        call whose torch calls that state changes (BatchNorm in eval) leaves the match,
        and a tensor rebound between calls is bound where first used or ends it."""
        if rec.unsupported is not None:
            if self._fullgraph:
                raise TraceError(f"fullgraph=True, but the function cannot be captured: "
                                 f"it {rec.unsupported}")
            why = f"it {rec.unsupported}"
            warn_user(f"fxlite.compile: {_name(self._fn)} runs in eager PyTorch: {why}")
            self._eager(key, why)
            return True
        if rec.effect is None and self._guard.key(arg_modules) != base.state.guards:
            # a replay would skip the Python that changes it: followed instead (its Python
            # runs on every call, and calls that a changed flag makes differ leave the match)
            rec.effect = _CHANGES_STATE
        if any(n.meta.get("mutated") for n in rec.graph.nodes):
            self._alias = True
        return False

    def _watch_globals(self, rec: Any, base: CallKey, arg_modules: tuple) -> CallKey:
        """Guard the globals that the call's other functions read too, and the context and
        environment variables it read; ``base`` with its state key computed again when
        that added any."""
        added = self._guard.watch_globals(rec.globals_read)
        added = self._guard.watch_context(rec.context_read) or added
        if not (self._guard.watch_environ(rec.environ_read) or added):
            return base
        return base._replace(state=base.state._replace(guards=self._guard.key(arg_modules)))

    def _eager(self, key: CallKey, why: str) -> None:
        """Calls under ``key`` run in eager PyTorch, for ``why``; this one did too."""
        self._trees[key], self._eager_why[key] = _EAGER, why
        self._last, self._last_eager = [], why

    def _miss(self, seg: Segment, value: Any, env: dict[str, Any], leaves: list[Any],
              args: tuple, kwargs: dict, eager: bool) -> Any:
        """A read value no recorded path has: record the rest of the path from the read."""
        over = self._recordings >= self.recompile_limit
        if over:
            site = format_site(seg.read.site) if seg.read is not None else ""
            self._over_limit(f"the value read at\n  {site}\nkeeps changing")
        roots = self._guard.roots(leaves)
        arg_modules = tuple(x for x in leaves if isinstance(x, torch.nn.Module))
        state = None if eager or over else self._guard.key(arg_modules)
        with side_stream(self._graphs_wanted()):
            result, rec = record(self._fn, args, kwargs, roots=roots, prefix=seg.recording,
                                 upto=seg.index, values=env, read_value=value,
                                 record_rest=not (eager or over), bound=self._guard.bound_objects())
        if eager or over:
            return result
        self._recordings += 1
        key = read_key(value)
        if rec.effect is None and self._guard.key(arg_modules) != state:
            rec.effect = _CHANGES_STATE  # (the tree's key holds the state before: stale after)
        if rec.unsupported is not None or rec.effect is not None:
            warn_user(f"fxlite.compile: a path of {_name(self._fn)} runs in eager PyTorch: "
                      f"it {rec.unsupported or rec.effect}")
            seg.children[key] = _EAGER
            return result
        segments = split(rec)
        new = segments[seg.index + 1:]
        available = set(env) | {n for n in rec.placeholders if n}
        for s in new:
            missing = [n for n in s.inputs if n not in available and n not in s.seeds]
            if missing:
                warn_user(f"fxlite.compile: a path of {_name(self._fn)} runs in eager PyTorch: "
                          f"it needs values ({', '.join(missing)}) the earlier segments did "
                          "not keep")
                seg.children[key] = _EAGER
                return result
            available.update(s.outputs)
        if self._compile(segments, rec, seg.index + 1, dict(env)) is not None:
            seg.children[key] = _EAGER
            return result
        _link(new)
        seg.children[key] = new[0]
        self._last = self._last + new
        return result

    def _over_limit(self, why: str) -> None:
        if self._limit_warned:
            return
        self._limit_warned = True
        warn_user(f"fxlite.compile: {_name(self._fn)} was recorded "
                  f"{self.recompile_limit} times (recompile_limit), because {why}; new "
                  "inputs and paths now run in eager PyTorch")

    def _compile(self, segments: list[Segment], rec: Any, start: int,
                 env: dict[str, Any]) -> str | None:
        """Compile ``segments[start:]`` in path order, each checked on the values the
        recording (or the segments before it) gave its inputs. If even the recorded ops
        could not be replayed, that path runs in eager: warns, and returns why."""
        try:
            self._compile_path(segments, rec, start, env)
        except Exception as e:  # never a crash where eager works
            if lint_failure(e):  # a pass broke its graph: in tests, fail there
                raise
            why = (f"replaying its recording failed ({type(e).__name__}: "
                   f"{str(e).splitlines()[0]})")
            warn_user(f"fxlite.compile: {_name(self._fn)} runs in eager PyTorch: {why}")
            return why
        finally:  # the snapshots served the checks only; the segments keep the recording
            rec.pre_state.clear()
        return None

    def _compile_path(self, segments: list[Segment], rec: Any, start: int,
                      env: dict[str, Any]) -> None:
        cpu_state, devices, cuda_states = rec.rng_state
        name = _name(self._fn)
        warn = lambda reason: warn_user(f"fxlite.compile: in {name}, {reason}")
        with torch.random.fork_rng(devices=devices), ambient_restored():
            if rec.ambient is not None:  # as the path's new part began (maybe in no_grad)
                set_ambient(rec.ambient)
            torch.set_rng_state(cpu_state)
            for d, state in zip(devices, cuda_states):
                torch.cuda.set_rng_state(state, d)
            private: dict[str, Any] = {}
            real_env = dict(env)  # (env takes the checks' values as they come)
            settled = _settled(rec, real_env)
            after_steps: dict[str, Any] = {}  # written by an earlier segment's settled step
            recorded = list(rec.graph.nodes)
            for seg in segments[start:]:
                sample = []
                for n in seg.inputs:
                    if n in private or n in rec.pre_state:  # a private copy of its value
                        value = private.get(n)  # before the call, one per path: later
                        if value is None:       # segments see the writes earlier checks made
                            real = after_steps[n]() if n in after_steps else None
                            # (the snapshot itself: no other check needs it)
                            value = private[n] = rec.pre_state.pop(n) if real is None \
                                else real.detach().clone()
                            if _recorded_grad(seg, n) and value.is_floating_point():
                                # not a leaf: the segment may write it in place, as the
                                # program wrote the (non-leaf) value it stands for; it
                                # keeps its gradient, which a step may read (clipping)
                                # (with its strides: overlaps as the program's)
                                value = private[n] = strided_clone(value.requires_grad_())
                                value.retain_grad()
                        sample.append(value)
                    else:
                        sample.append(seg.seeds[n] if n in seg.seeds else env[n])
                _mark_unscales(seg, rec, private, real_env)
                written_later(recorded, seg.gm)  # (before a backward: not saved by groups)
                for node in seg.gm.graph.nodes:  # (the check copies them in: _Replay)
                    if node.name in settled:
                        node.meta["settled"] = [(n, ref) for n, ref in settled[node.name]
                                                if n in private]
                        after_steps.update(settled[node.name])
                backend = self._backend if not rec.unknown_pre_state else "python"
                log_graph(seg.gm, f"{name}, graph {seg.index}")
                if seg.read is not None:
                    log_break(f"{name} splits where Python reads a tensor's value:\n  "
                              f"{format_site(seg.read.site)}")
                compiled = compile_segment(seg.gm, sample, backend=backend, mode=self._mode,
                                           expected=_expected(rec, seg), warn=warn)
                seg.compiled, seg.run = compiled, compiled.run
                cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in sample) and \
                    not interpreting()
                graphed = cuda and self._graphs_wanted() and backend in ("triton", "python")
                seg.run = choose_runner(seg, cuda, graphed)
                env.update(zip(seg.outputs, compiled.outputs or ()))
                # The check run's values hold its autograd graph, and with it the grad
                # accumulators of the parameters, made on this stream: a later CUDA graph
                # capture whose backward met them would sync with this stream and fail.
                compiled.outputs = None

    # ------------------------------------------------------------------ introspection
    @property
    def kernels(self) -> list[Any]:
        """The Triton kernels of the segments the latest call ran."""
        if self._dynamo is not None:
            return self._dynamo.kernels
        return expand_kernels([k for seg in self._last
                               for k in (seg.compiled.kernels if seg.compiled else [])])

    def _kernel_groups(self) -> list[Any]:
        return [k for seg in self._last if seg.compiled for k in seg.compiled.kernels
                if hasattr(k, "_variants")]

    @property
    def trials(self) -> list[Any]:
        """How the trials of the segments the latest call ran ended, on a GPU: a
        ``TrialResult`` each (which side won, after how many calls, at what time a call);
        none while a segment is still on trial, or where it had none."""
        if self._dynamo is not None:
            return []
        return [t for seg in self._last for t in seg.trials]

    @property
    def fallbacks(self) -> list[str]:
        """Why parts of the latest call run in eager PyTorch (or all of it), including the
        parts of autograd groups built after the compile (a backward's kernels are made
        and checked by the first backward)."""
        if self._dynamo is not None:
            return self._dynamo.fallbacks
        whole = None if self._last else self._last_eager
        said = ([f"{_name(self._fn)} runs in eager PyTorch: {whole}"] if whole else []) + [
            f for seg in self._last for f in (seg.compiled.fallbacks if seg.compiled else [])]
        for group in self._kernel_groups():
            said += [f for f in group.fallbacks if f not in said]
        return said

    @property
    def tier(self) -> str:
        """How the latest call ran, and why: ``"replayed"``, ``"followed: it ..."`` (its
        Python ran, its torch calls served by kernels) or ``"eager: it ..."``."""
        if self._dynamo is not None:
            return self._dynamo.tier
        plan = next((p for p in self._followed.values() if p is not _EAGER
                     and p.pieces is self._last), None)
        if plan is not None:
            return f"followed: it {plan.why}"
        whole = None if self._last else self._last_eager
        return f"eager: {whole}" if whole else "replayed"

    @property
    def recordings(self) -> int:
        """How many times the function was recorded (its first call, and each call whose
        key no recording matched: new argument layouts, or sizes where one read them)."""
        return self._recordings + (self._dynamo.recordings if self._dynamo is not None else 0)

    @property
    def code(self) -> str:
        """The generated Python of the segments the latest call ran."""
        if self._dynamo is not None:
            return self._dynamo.code
        parts = [seg.compiled.gm.code for seg in self._last if seg.compiled is not None]
        return "\n".join(parts)

    def report(self, benchmark: bool = False) -> str:
        """Print and return a table of the kernels: name, fused ops, shapes, bytes moved.

        With ``benchmark=True`` each kernel is also timed on fresh inputs of the recorded
        shapes, with its GB/s and its share of a device-to-device copy of as many bytes.
        """
        records = [r for seg in self._last for r in (seg.compiled.records if seg.compiled else [])]
        records += [r for k in self._kernel_groups() for r in k.records]
        text = kernel_report(records, benchmark=benchmark,
                             note=f"{_name(self._fn)}: {self.tier}")
        print(text)
        return text


QUIET_CALLERS.add(CompiledFunction.__call__.__code__)


def _what_changed(keys: list[CallKey], key: CallKey, leaves: list[Any]) -> str:
    """Which guard a new key fails, against the nearest recorded key."""
    def differs(old: CallKey) -> list[str]:
        parts = []
        if old.structure != key.structure:
            parts.append("the arguments' structure (positions, keyword names, containers)")
        if old.ambient != key.ambient:
            parts.append("grad mode, autocast, the default dtype or a torch flag "
                         "(deterministic algorithms, matmul precision, anomaly mode)")
        if len(old.inputs) == len(key.inputs):
            for i, (a, b) in enumerate(zip(old.inputs, key.inputs)):
                if a != b:
                    leaf = leaves[i] if i < len(leaves) else None
                    what = (f"argument {i}'s dtype, device, layout or sizes"
                            if isinstance(leaf, torch.Tensor) else f"argument {i}'s value")
                    if isinstance(leaf, torch.Tensor) and a[:-1] == b[:-1] and \
                            type(b[-1]) is float:  # a float Dynamo passes as a 0-d tensor
                        what = (f"the value of argument {i}, a float Dynamo passes as a "
                                f"tensor (a module's float attribute: an eps, a dropout's "
                                f"p), now {b[-1]!r}")
                        parts.append(what)
                        continue
                    parts.append(f"{what} (now {_short(leaf)})")
        if old.state != key.state:
            parts.append("the state of a module, closure cell or global it reads")
        if old.sizes != key.sizes:
            parts.append("the sizes of its tensor arguments (the code reads sizes)")
        return parts

    candidates = [differs(k) for k in keys]
    best = min(candidates, key=len, default=["its inputs or state"])
    return f"this guard keeps failing: {'; '.join(best) or 'its inputs or state'}"


def _numbers_key(key: CallKey | FollowKey, leaves: list[Any]) -> CallKey | None:
    """A key's structure, ambient state and input key with the values of the float
    arguments left out (each one's entry is ``("float",)``): the key of a plan followed
    for any such values; None where no argument is a float, or one is an object (its
    followed key is another, ``_follow_key``). The leaves say which entries are floats
    (another key of the same structure has floats at the same places, or differs)."""
    if not any(type(x) is float for x in leaves) \
            or not all(isinstance(x, _PLAIN_LEAVES) for x in leaves) \
            or len(key.inputs) != len(leaves):
        return None
    entries = key.inputs
    masked = tuple(("float",) if type(x) is float and type(k) is tuple and k[:1] == ("float",)
                   else k for x, k in zip(leaves, entries))
    return CallKey(key.structure, key.ambient, masked, _NUMBERS)


_NUMBERS = object()  # marks a key whose float arguments' values are left out
# Effects that a first call often makes alone: a function whose first recording made one
# is recorded again on its second call, and replayed if that one made none.
_ONCE = ("logs a message", "warns")
# why a recording is followed (a path recorded after a read: runs in eager) whose call
# changed the state its key holds (``StateGuard.key``)
_CHANGES_STATE = "changes Python state that it reads (a module attribute, flag or parameter)"


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {list(x.shape)}"
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _plain(seg: Segment, leaves: list[Any]) -> bool:
    """Whether ``seg`` takes exactly the call's arguments, in order: tensors, and a Dynamo
    graph's sizes (placeholders too)."""
    return not seg.seeds and len(seg.inputs) == len(leaves) and all(
        isinstance(x, (torch.Tensor, int)) for x in leaves) and \
        seg.inputs == seg.recording.placeholders


def _picks(seg: Segment, leaves: list[Any], keyed: frozenset[int]) -> tuple[int, ...] | None:
    """The positions of the call's arguments that ``seg`` takes, in its inputs' order (a
    split orders them by first use), where it takes them all (tensors and a Dynamo graph's
    sizes) but floats whose values its key holds (``keyed``: read once, no input of its
    graph); None otherwise."""
    if seg.seeds or not all(isinstance(x, (torch.Tensor, int)) for x in leaves):
        return None
    position = {n: i for i, n in enumerate(seg.recording.placeholders) if n is not None}
    if any(n not in position for n in seg.inputs):
        return None
    picks = tuple(position[n] for n in seg.inputs)
    left = set(range(len(leaves))) - set(picks)
    return picks if left <= keyed else None


def _picked(run: Callable[..., Any], picks: tuple[int, ...], *args: Any) -> Any:
    """``run`` given the arguments at ``picks`` (a straight line that takes no keyed
    float)."""
    return run(*[args[i] for i in picks])


def _graph_args(args: tuple) -> bool:
    """Whether a Dynamo graph's call arguments are strided tensors (parameters included,
    whatever their Python attributes: its code reads none) and ints (its sizes)."""
    return all(type(a) is int or (type(a) in _GRAPH_TENSORS and a.layout is _STRIDED
                                  and not a.is_nested) for a in args)


_STRIDED = torch.strided
_PLAIN_LEAVES = (torch.Tensor, bool, int, float, str, type(None))  # keyed without objects
_TENSOR = torch.Tensor
_GRAPH_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _unusual(leaves: list[Any]) -> str | None:
    """The kind of the first argument tensor fxlite does not compile (sparse, nested, or
    of a subclass of ``torch.Tensor`` other than ``nn.Parameter``: its ``__torch_function__``
    or ``__torch_dispatch__`` decides what each op does and returns, which a recording of
    plain tensors would not replay, and a replay returned plain tensors)."""
    for a in leaves:
        if isinstance(a, torch.Tensor):
            if a.layout is not _STRIDED or a.is_nested:
                kind = "nested" if a.is_nested else str(a.layout).removeprefix("torch.")
                return f"{kind} tensor"
            if type(a) is not _TENSOR and not isinstance(a, torch.nn.Parameter):
                return f"tensor of the subclass {type(a).__qualname__}"
    return None


# what ops raise on the values they are given (a program may catch them itself)
_VALUE_ERRORS = (RuntimeError, IndexError, ValueError)


def _pure(rec: Any) -> bool:
    """Whether a recording's ops change nothing outside their results (no write, no
    random draw, no effect), so that running its function again is safe."""
    pure = getattr(rec, "_fxlite_pure", None)
    if pure is None:
        pure = rec._fxlite_pure = not any(
            n.meta.get("impure") and "read" not in n.meta and "checks" not in n.meta
            for n in rec.graph.nodes)
    return pure


def _nothing_written(seg: Segment, error: BaseException | None) -> bool:
    """Whether the call that raised ``error`` in ``seg`` wrote nothing yet, so that
    running its function again is safe: ``seg`` is the call's first segment and the one
    that raised (or the whole call), and it raised before writing
    (:func:`_raised_before_writes`). A buffer update before an integer division by zero
    then takes effect, as in eager (fuzz seeds 7102901, 7413326). A later segment that
    raises so runs its recorded ops instead (``_walk_path``; 8023118)."""
    first = seg.read is None or getattr(error, "_fxlite_ran_before", None) == 0
    return first and _raised_before_writes(seg, error)


def _raised_before_writes(seg: Segment, error: BaseException | None) -> bool:
    """Whether ``seg``'s compiled graph raised ``error`` before writing anything: its
    writes all come after every op that could raise, with no draw and no effect
    (:func:`_write_calls`), and the exception came from before them."""
    compiled = seg.compiled
    writes = None if compiled is None or isinstance(seg.run, Trial) \
        else _write_calls(compiled.gm)
    if writes is None:
        return False
    tb = getattr(error, "__traceback__", None)
    while tb is not None:  # a generated forward's line that writes: too late
        code = tb.tb_frame.f_code
        line = linecache.getline(code.co_filename, tb.tb_lineno)
        if code.co_filename.startswith("<") and any(w in line for w in writes):
            return False
        tb = tb.tb_next
    return True


def _trains(compiled: CompiledSegment) -> bool:
    """Whether ``compiled``'s kernels include autograd groups: a training forward, whose
    outputs carry an autograd graph. Such a call is not replayed from one CUDA graph of
    the whole call, which would hand back the capture's autograd graph each time; its
    segment's own graphs (``SegmentGraphs``) capture the backward too."""
    if compiled.trains is None:
        compiled.trains = any(hasattr(k, "_variants") for k in compiled.kernels)
    return compiled.trains


def _note_ran_before(error: BaseException, segments: int) -> None:
    """Mark ``error`` with how many of the call's segments completed before it."""
    try:
        error._fxlite_ran_before = segments  # type: ignore[attr-defined]
    except Exception:  # an exception type without attributes: nothing is assumed
        pass


_FILLS = frozenset({"fill_", "zero_"})  # in-place writes that raise before writing, if at all


def _write_calls(gm: GraphModule) -> frozenset[str] | None:
    """For a graph whose writes all come after its other ops, with nothing else in it
    impure (a random draw, an effect), the text of its writing calls as generated lines
    spell them (``.copy_(``); None for any other graph. The writes: ``copy_`` write-backs,
    a training BatchNorm's ``update_running_stats`` (which ``lower/batch_norm.py`` moves
    to the end), and fills of the graph's inputs that the program ends with (``x0.fill_(3)``,
    fuzz seed 8023118). Not other in-place ops: one that raises partway (an integer
    ``floor_divide_`` by zero) has written some elements, and the straight line's
    generated code has no source lines for the traceback check of
    :func:`_raised_before_writes` to see it by. What a functionalized segment compiles to::

        fused_0 = triton_fused_0(b0, x0)
        fused_1 = self.fused_1(x0, x1)        # may raise: nothing is written yet
        copy_ = b0.copy_(fused_0)
        copy__1 = x0.copy_(fused_1)
    """
    found = getattr(gm, "_fxlite_write_calls", False)
    if found is False:
        calls: set[str] | None = set()
        for n in gm.graph.nodes:
            if n.op not in ("call_function", "call_method", "call_module"):
                continue
            if n.target is update_running_stats:
                calls.add("update_running_stats(")
            elif n.op == "call_method" and (n.target == "copy_" or n.target in _FILLS
                                            and getattr(n.args[0], "op", None) == "placeholder"):
                calls.add(f".{n.target}(")
            elif not calls and _local_write(n, gm):
                continue  # a tensor the graph made: lost with it if the call raises
            elif calls or changes_state(n, gm):
                calls = None
                break
        found = gm._fxlite_write_calls = None if calls is None else frozenset(calls)
    return found


def _local_write(n: Node, gm: GraphModule) -> bool:
    """Whether ``n`` writes in place (``y[0] = -1``, ``y.add_(1)``) into a tensor made in
    ``gm`` itself, through views at most: a kernel's or a pointwise op's fresh result, not
    an input, an attribute or a view of one. If the call raises before its first write of
    state, such a write has reached nothing the rerun of the user's function could see
    (fuzz seed 9313724: ``y = torch.fmod(x, d); y[0] = -1`` after a training BatchNorm,
    where an integer division by zero raised and the BatchNorm's update was lost)."""
    name = n.target if n.op == "call_method" else None
    if n.target is not operator.setitem and not (
            isinstance(name, str) and (name in _FILLS or name == "copy_" or name.endswith("_")
                                       and _kind(lookup_target(getattr(torch, name[:-1], None)))
                                       == "pointwise")):
        return False
    base = n.args[0] if n.args else None
    while isinstance(base, Node) and (base.meta.get("returns_input")
                                      or _kind(lookup(base, gm)) == "view"):
        base = base.args[0] if base.args else None
    if not isinstance(base, Node) or base.meta.get("impure"):
        return False
    if base.op == "call_module":  # a fused group's result: a tensor its kernel made
        return bool(getattr(gm.get_submodule(base.target), "meta", {}).get("fused_kind"))
    return base.op in ("call_function", "call_method") and _kind(lookup(base, gm)) in (
        "pointwise", "reduction")


def _kind(info: Any) -> str | None:
    return getattr(info, "kind", None)


def _settled(rec: Any, env: dict[str, Any]) -> dict[str, list[tuple[str, Any]]]:
    """Per recorded effect that writes outside state (an optimizer's ``step()``): the
    tensors it writes that nothing later in the call writes again, each as its name and a
    weak reference to the real tensor. Their values now, after the call, are those the
    step left, which the checks cannot compute (they skip effects): a check reaching the
    step copies them into its private copies, so that what the call reads after it (a
    validation loss, an EMA, a GAN's second phase) is checked on the values eager read::

        backward = loss.backward()
        step = step_1()            # settled: [("fc_weight", ref), ("fc_bias", ref)]
        linear_1 = linear(xv, fc_weight, fc_bias)    # checked on the stepped weights
    """
    nodes = {n.name: n for n in rec.graph.nodes}
    later: set[str] = set()  # names written after each node, walking back
    out: dict[str, list[tuple[str, Any]]] = {}
    for node in reversed(nodes.values()):
        written = node.meta.get("mutated") or ()
        if node.meta.get("external") and written:
            refs = []
            for n in written:
                real = None if n in later else _real_tensor(rec, nodes, n, env)
                if real is not None:
                    refs.append((n, weakref.ref(real)))
            if refs:
                out[node.name] = refs
        later.update(written)
    return out


def _real_tensor(rec: Any, nodes: dict[str, Any], name: str, env: dict[str, Any]) -> Any:
    """The user's tensor a recording's input or attribute ``name`` stands for, or None."""
    node = nodes.get(name)
    if node is None:
        return None
    real = rec.externals.get(node.target) if node.op == "get_attr" else env.get(name)
    return real if isinstance(real, torch.Tensor) else None


def _mark_unscales(seg: Segment, rec: Any, private: dict[str, Any], env: dict[str, Any]
                   ) -> None:
    """Give each ``GradScaler.unscale_(opt)`` of ``seg`` the check's private copies, as
    (the user's tensor, its copy) weak pairs: the check unscales the copies' gradients
    as the call did the real ones (``pipeline._Replay``), so that what reads them after
    (clipping, a norm) is checked on eager's values."""
    marked = [n for n in seg.gm.graph.nodes if n.meta.get("external")
              and getattr(n.target, "__func__", None) is torch.amp.GradScaler.unscale_]
    if not marked:
        return
    nodes = {n.name: n for n in rec.graph.nodes}
    pairs = [(weakref.ref(real), weakref.ref(copy)) for name, copy in private.items()
             if (real := _real_tensor(rec, nodes, name, env)) is not None]
    for node in marked:
        node.meta["copies"] = pairs


def _recorded_grad(seg: Segment, name: str) -> bool:
    """Whether the input ``name`` of ``seg`` required grad when it was recorded."""
    for node in seg.gm.graph.nodes:
        if node.op == "placeholder" and node.name == name:
            meta = node.meta.get("tensor_meta_rec")
            return bool(meta and meta[4])
    return False


def _sample_env(rec: Any, leaves: list[Any]) -> dict[str, Any]:
    return {name: leaf for name, leaf in zip(rec.placeholders, leaves) if name is not None}


def _expected(rec: Any, seg: Segment) -> list[Any]:
    """Per output of ``seg``, the tensor eager PyTorch computed (None where unknown)."""
    out: list[Any] = []
    for i, name in enumerate(seg.outputs):
        found = rec.expected.get(name)
        value = found.ref() if found is not None and (i > 0 or seg.read is None) else None
        out.append(value if value is not None and value._version == found.version else None)
    return out


def _link(segments: list[Segment]) -> None:
    for seg, nxt in zip(segments, segments[1:]):
        assert seg.read is not None
        seg.children[read_key(seg.read.value)] = nxt


_GRAPH_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Dynamo graph -> name


def _graph_name(gm: Any) -> str:
    """A Dynamo graph's name in messages (its class is GraphModule): the user's function
    its first traced node came from."""
    traced = next((n.meta["stack_trace"] for n in gm.graph.nodes
                   if n.meta.get("stack_trace")), "")
    frame = last_frame(traced)
    return f"Dynamo's graph of {frame[2]}" if frame else "Dynamo's graph"


def _name(fn: Any) -> str:
    named = _GRAPH_NAMES.get(fn) if isinstance(fn, torch.fx.GraphModule) else None
    if named is not None:
        return named
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _check_options(fn: Any, backend: Any, fullgraph: Any, mode: Any) -> None:
    if isinstance(fn, type):
        raise TypeError(f"fxlite.compile expects a function or a module instance, got the "
                        f"class {fn.__name__}; create the module first: "
                        f"fxlite.compile({fn.__name__}(...))")
    if not callable(fn):
        raise TypeError(f"fxlite.compile expects a function or an nn.Module, got "
                        f"{type(fn).__name__}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of "
                         f"{', '.join(repr(m) for m in MODES)}")
    if not (callable(backend) or backend in ("triton", "python")):
        raise ValueError(f"unknown backend {backend!r}; expected 'triton', 'python' or a "
                         "callable backend(gm, example_inputs) (fxlite.compile also takes "
                         "'eager' and Dynamo's backend names)")
    if not isinstance(fullgraph, bool):
        raise TypeError(f"fullgraph must be True or False, not {fullgraph!r}")


class CompiledModule(torch.nn.Module):
    """What :func:`compile` returns for a module: a module that runs the compiled forward."""

    def __init__(self, module: torch.nn.Module, compiled: CompiledFunction) -> None:
        super().__init__()
        self._orig_mod = module
        self.__dict__["_compiled"] = compiled

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy compiles a deep copy of the module with the same arguments, as
        ``torch.compile``'s module copies (an EMA model made by ``copy.deepcopy``): its
        recordings and kernels are its own, made on its first calls."""
        return compile(copy.deepcopy(self._orig_mod, memo), **self._compiled._given)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``torch.save``) as the module and ``compile()``'s arguments."""
        return _recompiled, (self._orig_mod, self._compiled._given)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            compiled = self.__dict__.get("_compiled")
            if compiled is not None and hasattr(compiled, name):
                return getattr(compiled, name)
            return getattr(self._orig_mod, name)


def _through_dynamo(fn: Any, settings: Settings, given: dict[str, Any]) -> DynamicFunction:
    """``fxlite.compile(fn, dynamic=True)``: Dynamo captures ``fn`` with symbolic sizes
    and fxlite compiles its graphs (``codegen/dynamic.py``); a Dynamo backend's name gets
    Dynamo's graphs, with ``mode`` and ``options``, as in ``torch.compile``."""
    backend = given["backend"]
    named = backend if isinstance(backend, str) and backend not in (
        "triton", "python", "fxlite") else None
    own, mode, limit = settings.backend, settings.mode, given["recompile_limit"]
    args = (fn, lambda gm: compile(gm, backend=own, mode=mode, recompile_limit=limit),
            given["fullgraph"], True, named,
            given["mode"], given["options"], functools.partial(compile, fn, **given))
    made = DynamicFunction(*args)
    register(made, args, lambda _: None)
    return made


def _recompiled(module: torch.nn.Module, given: dict[str, Any]) -> Any:
    """``compile(module, **given)``: how a pickled compiled module is loaded."""
    return compile(module, **given)


def compile(fn: Callable[..., Any] | torch.nn.Module | None = None, *,
            fullgraph: bool = False, dynamic: bool | None = None, backend: Backend = "triton",
            mode: str | None = None, options: dict[str, Any] | None = None,
            name: str | None = None, disable: bool = False, recompile_limit: int | None = None,
            isolate_recompiles: bool = False, shapes_spec: Any = None) -> Any:
    """Compile a function or module, as ``torch.compile`` does (the same arguments).

    The first call with new inputs runs ``fn`` eagerly while recording its torch calls;
    later calls replay them as fused Triton kernels (the ``"triton"`` backend) and
    regenerated Python. Python control flow on tensor values splits the recording into
    segments, each compiled; a value not seen before records the rest of that path.

    A function whose Python does more than compute tensors (prints, appends to a list,
    logs, draws ``random.random()``, sets attributes of an argument or of a module it
    reads, ``model.train(flag)``, keeps tensors in a dict that outlives the call) is
    *followed*: its Python runs on every call, its torch
    calls served by the compiled kernels (``fxlite.codegen.capture.follow``).

    What is guarded before a replay (checked on every call): argument structure, tensor
    dtypes, devices, ranks, layouts and ``requires_grad`` (and sizes, once the code reads
    one); other arguments by value or identity; the state of reachable modules (training
    flag, parameters, buffers, hooks, plain attributes, the objects they hold); closure
    cells, defaults and the globals the function and its helpers name, with the contents
    of small containers and plain objects; optimizers' param groups; grad mode, autocast
    and the default dtype.

    What falls back to eager PyTorch, with one warning naming the line: reading a
    tensor's address, reseeding, calling a function marked with ``fxlite.compiler.disable``; more than
    ``recompile_limit`` recordings; and any segment whose passes or kernels fail or
    disagree with eager on the recording's inputs. Groups under autograd run a Triton
    forward and a generated Triton backward.

    Args:
        fn: a function or ``nn.Module``; omit it to use ``@fxlite.compile(...)``.
        fullgraph: no graph break, as ``torch.compile``'s: raise :class:`fxlite.TraceError`
            (naming the line) instead of splitting the function where Python reads a
            tensor's value, or of running it in eager PyTorch where it cannot be captured
            (it reads an address or a storage, reseeds). Python
            effects are no graph break: a function that prints, sets an argument's
            attributes or keeps tensors in a dict is followed, as Dynamo replays them.
        dynamic: True runs ``fn`` under Dynamo with every size symbolic, fxlite compiling
            each graph it captures once for all sizes (``dynamic.DynamicFunction``).
            None: fxlite's keys hold no sizes unless the recorded code reads one, and a
            recording that reads sizes is specialized to them; a call given a tensor
            marked with ``torch._dynamo.mark_dynamic`` switches ``fn`` to Dynamo. False:
            specialized, marks ignored.
        backend: ``"triton"`` (or ``"fxlite"``: fused kernels), ``"python"`` (the recorded
            ops as Python), ``"eager"`` (``fn`` itself, not compiled), a name that
            ``torch._dynamo.list_backends()`` knows (``"inductor"``, ``"aot_eager"``: each
            of fxlite's segment graphs goes to it), or a callable
            ``backend(gm, example_inputs) -> callable`` given each segment.
        mode: None, ``"default"``, ``"reduce-overhead"`` (replay segments from CUDA graphs,
            training steps included; see ``fxlite.codegen.runtime.segment_graphs``),
            ``"max-autotune"`` or ``"max-autotune-no-cudagraphs"`` (both: try several block
            sizes per kernel; fxlite adds no CUDA graphs to max-autotune).
        options: a dict; with fxlite's backends the keys of
            ``fxlite.codegen.options.OPTIONS`` (``"triton.cudagraphs"``, ``"max_autotune"``,
            ``"max_autotune_pointwise"``); with a Dynamo backend, its own. Not with ``mode``.
        name: accepted (a str), shown nowhere yet.
        disable: True returns ``fn`` itself.
        recompile_limit: how many recordings (keys and paths) before new ones run in eager
            PyTorch, with one warning; default ``CompiledFunction.recompile_limit`` (8).
        isolate_recompiles: accepted: every ``fxlite.compile`` call has its own entries.
        shapes_spec: accepted, no effect.

    Returns:
        A callable with the original's signature (a module for a module); ``fn`` itself
        for ``disable=True`` and ``backend="eager"``.

    Raises:
        TypeError, ValueError: a bad argument, with one line naming it (an unknown option
            key lists the known ones).

    Example::

        @fxlite.compile
        def f(x):
            return torch.relu(x + 1) * 2

        f(torch.randn(8192, 8192, device="cuda"))
        print(f.kernels[0].source)
    """
    given = dict(fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                 options=options, name=name, disable=disable, recompile_limit=recompile_limit,
                 isolate_recompiles=isolate_recompiles, shapes_spec=shapes_spec)
    if fn is None:
        resolve(None, **given)  # a bad argument fails here, not at the decorated def
        return functools.partial(compile, **given)
    settings = resolve(fn, **given)
    if settings.as_is:
        _check_options(fn, "triton", fullgraph, None)
        return fn
    if dynamic:
        compiled = _through_dynamo(fn, settings, given)
    else:
        compiled = CompiledFunction(fn, settings.backend, fullgraph, settings.mode)
        settings.apply(compiled, fn, fullgraph)
    compiled._given = given  # (for copies)
    if isinstance(fn, torch.nn.Module):
        return CompiledModule(fn, compiled)
    return compiled
