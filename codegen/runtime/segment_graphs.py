"""CUDA graphs for whole segments (``mode="reduce-overhead"``), training steps included.

A compiled segment launches one kernel or library call per op, so a small step is bound
by host time. Under ``mode="reduce-overhead"`` a :class:`SegmentGraphs` runs the segment
instead: it splits the segment's nodes into *host* nodes, which must run as Python on
every call, and *regions* of device work in between, and replays each region from a CUDA
graph. For the tutorial's training step::

    segment                                   runs as
    p.grad = None   (zero_grad)   ┐ host      Python, every call
    conv2d, fused kernels, loss   ┐
    loss.backward()               ┘ region 1  one graph replay (gradients included)
    opt.step()                      host      Python (Adam's step counts live on the CPU)
    running-stat updates            region 2  one graph replay

Which nodes are host: setting or reading ``.grad``; calls outside torch and fxlite (an
optimizer, a scheduler, a user function); tensors made from host data; seeds drawn on
the host; and, as seen on the observed calls, nodes touching CPU tensors, nodes that
synchronize with the device, and nodes fed a Python value that changed between calls.

Calls with a new input layout are observed three times (run node by node; first calls
may still build and check kernels), then the regions are captured on the fourth call and
replayed from then on. Each replay first checks what
its graph assumed and otherwise runs that region's nodes normally:

- inputs that were the same tensor on every observed call (parameters, buffers) must
  still be; others are copied into the graph's own input buffers;
- Python values flowing into a region equal the captured ones;
- gradients a region's backward made are in the state they were at capture (None, or the
  same tensor) and nobody else holds them; after the replay they are put back on
  ``.grad``, so ``optimizer.step()`` reads them as it would in eager;
- nobody holds a region output from an earlier call (it would be overwritten).

Tensors a region hands to the caller are copied out of the graph's memory. A loss
returned by a captured step comes back without its autograd graph: its backward already
ran inside the region. A region whose outputs need autograd after it (a compiled module
whose backward the caller runs, as inside DistributedDataParallel) gets its backward
captured as a second graph and replays as one autograd node (``graphed_backward.py``).
A segment whose regions cannot be captured (an input that requires grad but changes
every call, a module backward hook, a failed capture) runs as it would without graphs,
from then on.
"""

from __future__ import annotations

import bisect
import operator
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from fxlite.codegen.capture.guards import LayoutCheck
from fxlite.codegen.runtime.cudagraphs import (
    end_failed_capture,
    reference_counts,
    side_stream,
    tensors_in,
)
from fxlite.codegen.runtime.graphed_backward import GraphedBackward, NotGraphable
from fxlite.codegen.runtime.host_nodes import host_function

from fxlite.graph_module import GraphModule
from fxlite.interpreter import Interpreter
from fxlite.node import Node, map_aggregate, map_arg

__all__ = ["SegmentGraphs", "ambient_node", "host_node", "regions", "runs_backward"]

WARMUP = 3  # observed calls per input layout before the capture (syncs count on the last)
MAX_LAYOUTS = 4  # captured input layouts per segment
_FLAT_MIN = 8  # host nodes in a run worth one generated function (compiling it: ~0.1 ms)
MAX_MISSES = 4  # replays refused (inputs moved, outputs held) before graphs are dropped
_HOST_MODULES = ("torch.optim", "torch.amp", "torch.cuda", "torch.utils", "torch.distributed",
                 "torch.random", "torch.autograd.profiler", "torch.profiler")
_FROM_HOST_DATA = frozenset({"tensor", "as_tensor", "asarray", "from_numpy", "frombuffer",
                             "new_tensor", "draw_seed"})
_PYTHON_EFFECTS = frozenset({"register_hook", "retain_grad", "requires_grad_",
                             "register_post_accumulate_grad_hook", "item", "tolist"})
_ERROR_MODE = "thread_local"  # other threads may use the GPU meanwhile
_PURE_PYTHON = ("operator", "_operator", "builtins", "math")
_STATE = frozenset({"set_autocast_enabled", "set_autocast_dtype", "manual_seed", "seed",
                    "set_rng_state"})
# Grad mode and autocast set by the recording: set again after each replay of a region
# holding them (the graph already has their effect on the device work).
_AMBIENT = frozenset({"_set_grad_enabled", "set_autocast"})


def host_node(n: Node) -> bool:
    """Whether ``n`` must run as Python on every call (see the module docstring).

    Example::

        [n.name for n in gm.graph.nodes if host_node(n)]  # ['setattr_1', 'step']
    """
    if n.op in ("placeholder", "output", "get_attr", "call_module"):
        return False
    if n.op == "call_method":
        return n.target in _PYTHON_EFFECTS or n.target in _FROM_HOST_DATA
    t = n.target
    if t is setattr or t is delattr:
        return True
    if t is getattr:
        return len(n.args) > 1 and n.args[1] == "grad"
    name = getattr(t, "__name__", "") or ""
    module = getattr(t, "__module__", None) or type(t).__module__ or ""
    if name in _FROM_HOST_DATA or name in _STATE or "profiler" in module or "profiler" in name \
            or type(t).__name__ == "CondOp":
        return True
    if module.startswith(("torch", "fxlite")):
        return module.startswith(_HOST_MODULES)
    return module not in _PURE_PYTHON


def runs_backward(n: Node) -> bool:
    """Whether ``n`` runs autograd's backward (``loss.backward()``, ``autograd.backward``)."""
    return n.target == "backward" or n.target is torch.autograd.backward


def ambient_node(n: Node) -> bool:
    """Whether ``n`` sets grad mode or autocast (recorded state changes)."""
    return n.op == "call_function" and getattr(n.target, "__name__", "") in _AMBIENT


def _device_op(n: Node) -> bool:
    module = getattr(n.target, "__module__", None) or ""
    return n.op in ("call_method", "call_module") or (
        n.op == "call_function" and module not in _PURE_PYTHON)


def regions(nodes: list[Node], host: set[Node], min_ops: int = 2) -> list[list[Node]]:
    """Maximal runs of non-host nodes holding at least ``min_ops`` device ops.

    Example::

        regions(list(gm.graph.nodes), {n for n in gm.graph.nodes if host_node(n)})
    """
    out: list[list[Node]] = []
    run: list[Node] = []
    for n in [*nodes, None]:
        if n is None or n in host or n.op in ("placeholder", "output"):
            if sum(map(_device_op, run)) >= min_ops:
                out.append(run)
            run = []
        else:
            run.append(n)
    return out


def _leaf(t: torch.Tensor) -> bool:
    """A parameter-like tensor: autograd accumulates into it rather than through it."""
    return t.is_leaf and t.requires_grad


def _alias(leaf: torch.Tensor, aliases: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    view = leaf.view_as(leaf)
    aliases.append((view, leaf))
    return view


def _python_part(value: Any) -> Any:
    """``value`` with its tensors blanked out (to compare what Python passes along)."""
    return map_aggregate(value, lambda x: None if isinstance(x, torch.Tensor) else x)


class _Runner(Interpreter):
    """Runs chosen nodes of the segment on an env shared with the replays."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self._flat: dict[tuple[int, int, int], Any] = {}

    def run_nodes(self, nodes: list[Node]) -> None:
        """Run ``nodes`` in order; a longer run (a step's ``zero_grad``: two nodes a
        parameter) as one generated function (``host_nodes``), made on its first call."""
        env = self.env
        if len(nodes) < _FLAT_MIN:
            for n in nodes:
                env[n] = self.run_node(n)
            return
        key = (id(nodes[0]), id(nodes[-1]), len(nodes))  # slices of one node order
        run = self._flat.get(key)
        if run is None:
            run = self._flat[key] = host_function(nodes, self.fetch_attr, self.submodules)
        run(env)

    def capture_nodes(self, nodes: list[Node], aliases: list | None = None) -> None:
        """``run_nodes`` under a capture: a failure names the node it happened at.

        With ``aliases`` (a list), each parameter (leaf that requires grad) a node gives is
        replaced by a view of it made in the capture, and ``(view, parameter)`` appended:
        a backward captured later differentiates with respect to the views.
        """
        env = self.env
        for n in nodes:
            try:
                env[n] = value = self.run_node(n)
            except Exception as e:
                raise RuntimeError(f"at {n.format_node()}: {str(e).splitlines()[0]}") from e
            if aliases is not None and isinstance(value, torch.Tensor) and _leaf(value):
                env[n] = _alias(value, aliases)


class _Region:
    """One run of device work: its graph, what it assumed, and where its values go."""

    def __init__(self, nodes: list[Node], end: str = "") -> None:
        inside = set(nodes)
        self.end = end  # where and why the region ends, for messages
        self.nodes = nodes
        self.inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes
                                         if i not in inside))
        self.outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        # outputs the segment returns: copied out of the graph's memory for the caller
        self.returned = {n for n in self.outputs if any(u.op == "output" for u in n.users)}
        self.backward = any(map(runs_backward, nodes))
        # outputs need autograd after the region: its backward is captured too (set by _plan)
        self.autograd = False
        self.back: GraphedBackward | None = None
        self.leaves: tuple[tuple[int, bool], ...] = ()  # (address, requires_grad) of its leaves
        self.ambient = [n for n in nodes if ambient_node(n)]
        self.graph: Any = None
        self.feeds: list[tuple[int, Any, Any]] = []  # (input, "same"/"copy"/"value", ref)
        self.writes: list[tuple[int, torch.Tensor]] = []  # copied inputs it writes
        # the "same" inputs (nodes, tensors, where their data was), checked in one pass
        self.same: tuple[list[Node], list[torch.Tensor], tuple[int, ...]] = ([], [], ())
        self.others: list[tuple[int, Any, Any]] = []  # the "copy" and "value" feeds
        self.values: list[Any] = []  # its outputs, in the graph's memory
        self.grads: list[tuple[torch.Tensor, Any, torch.Tensor]] = []  # (leaf, before, after)
        self.held: list[torch.Tensor] = []  # tensors nobody else may hold at a replay
        self.drop: list[Node] = []  # env values no node reads from the region's start on
        self.storages: list[int] = []  # their storages
        self.base: list[int] = []

    # ------------------------------------------------------------------ capture
    def capture(self, runner: _Runner, stable: list[bool], pool: Any) -> None:
        env = runner.env
        feeds, args = [], []
        for i, (node, same) in enumerate(zip(self.inputs, stable)):
            v = env[node]
            if not isinstance(v, torch.Tensor):
                if tensors_in(v):
                    raise _NotCapturable(f"{node.name} passes tensors in a container")
                feeds.append((i, "value", v))
                args.append(v)
            elif v.requires_grad and not v.is_leaf:
                # its autograd graph was built outside the region: a backward inside would
                # be captured reading that call's saved tensors
                raise _NotCapturable(f"{node.name} carries an autograd graph into the region")
            elif same:
                feeds.append((i, "same", v))
                args.append(v)
            elif v.requires_grad:  # a copy of it would get the gradients, not the caller's
                raise _NotCapturable(f"{node.name} requires grad and is a new tensor each call")
            else:
                buf = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                buf.copy_(v)
                feeds.append((i, "copy", buf))
                args.append(buf)
        versions = [ref._version if kind == "copy" else 0 for _, kind, ref in feeds]
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad
                  and a.is_leaf]
        before = [t.grad for t in leaves]
        originals = [env[node] for node in self.inputs]
        for node, a in zip(self.inputs, args):
            env[node] = a
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        cache = torch.is_autocast_cache_enabled()
        torch.clear_autocast_cache()
        torch.set_autocast_cache_enabled(False)
        try:
            aliases: list[tuple[torch.Tensor, torch.Tensor]] | None = None
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=_ERROR_MODE):
                if self.autograd:
                    aliases = []
                    for node in self.inputs:
                        if isinstance(env[node], torch.Tensor) and _leaf(env[node]):
                            env[node] = _alias(env[node], aliases)
                runner.capture_nodes(self.nodes, aliases)
            # (outputs the observed calls handed on with an autograd graph may not have
            # one now: those of a region after a captured backward, say)
            if aliases is not None and any(t.requires_grad for n in self.outputs
                                           for t in tensors_in(env[n])):
                values = self._capture_backward(env, pool, aliases)
            else:
                values = [self._kept(n, env[n]) for n in self.outputs]
        except BaseException:
            for t, g in zip(leaves, before):  # the capture's gradients were never computed
                t.grad = g
            # the region then runs its nodes: on the caller's tensors, not on the copies
            # (whose writes would not reach the caller) or the parameters' views
            env.update(zip(self.inputs, originals))
            raise
        finally:
            torch.set_autocast_cache_enabled(cache)
        self.graph, self.feeds = graph, feeds
        same = [(self.inputs[i], ref) for i, kind, ref in feeds if kind == "same"]
        self.same = ([n for n, _ in same], [r for _, r in same],
                     tuple(r.data_ptr() for _, r in same))
        self.others = [f for f in feeds if f[1] != "same"]
        # copied inputs the region writes in place: written back to the caller's after a replay
        self.writes = [(i, ref) for (i, kind, ref), v in zip(feeds, versions)
                       if kind == "copy" and ref._version != v]
        self.grads = [(t, g, t.grad) for t, g in zip(leaves, before)
                      if t.grad is not g and t.grad is not None]
        self.values = values
        # the capture computed nothing: this call's values come from here
        self._bind(env, originals, self._replayed())
        env.update(zip(self.inputs, originals))  # later nodes see the caller's tensors

    def _capture_backward(self, env: dict[Node, Any], pool: Any,
                          aliases: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
        """Capture the backward of the region's outputs that need autograd after it, with
        respect to the views of the parameters (``aliases``) its nodes read.

        Why views: autograd would otherwise reach each parameter's gradient accumulator,
        which remembers the stream it was made on. DistributedDataParallel keeps those
        from before, on the default stream, and a capture may not wait on that stream
        ("operation would make the legacy stream depend on a capturing blocking stream").

        Its values (as ``self.values``): the outputs, detached.
        """
        if any(not isinstance(env[n], torch.Tensor) and any(map(_leaf, tensors_in(env[n])))
               for n in self.nodes):  # (in a container, it was not replaced by a view)
            raise _NotCapturable("a parameter passes through it in a container")
        raw = [env[n] for n in self.outputs]
        flat = tensors_in(raw)
        try:
            self.back = GraphedBackward(flat, aliases, pool, _ERROR_MODE)
        except NotGraphable as e:
            raise _NotCapturable(str(e)) from e
        self.leaves = tuple((t.data_ptr(), t.requires_grad) for t in self.back.leaves)
        return [map_aggregate(v, lambda x: x.detach() if isinstance(x, torch.Tensor) else x)
                for v in raw]

    def _replayed(self) -> list[Any]:
        """Replay the graph; the values of the region's outputs."""
        if self.back is None:
            self.graph.replay()
            return self.values
        outs = iter(self.back.apply(self.graph.replay))
        return [map_aggregate(v, lambda x: next(outs) if isinstance(x, torch.Tensor) else x)
                for v in self.values]

    def _kept(self, n: Node, value: Any) -> Any:
        """An output as the region keeps it: detached (replays build no autograd graph).

        Only a region that runs a backward may hand on values that require grad: their
        autograd graph was used up inside it, as the backward frees it in eager. (One
        whose observed calls handed them on captures its backward: ``_capture_backward``.)
        """
        if not self.backward and any(t.requires_grad for t in tensors_in(value)):
            raise _NotCapturable(f"{n.name} needs autograd after the region ({self.end})")
        return map_aggregate(value, lambda x: x.detach() if isinstance(x, torch.Tensor) else x)

    def watch(self) -> None:
        """Take the baseline of references to our tensors, once the call has ended."""
        inputs = {t.untyped_storage().data_ptr() for _, kind, t in self.feeds if kind == "same"}
        # (comprehensions only: no local of this frame may still hold a tensor below)
        self.held = list({id(t): t for t in [g for _, _, g in self.grads] + [
            t for v in self.values for t in tensors_in(v)
            if t.untyped_storage().data_ptr() not in inputs and not _leaf(t)]}.values())
        # (their storages stay valid while self.held holds the tensors)
        self.storages = [t.untyped_storage()._cdata for t in self.held]
        # The baseline as a replay will see it: by then each parameter's .grad is back to
        # what it was before the region (the replay's first check; zero_grad did it), so
        # the parameter no longer holds the gradient the region made. Counted with .grad
        # still set, a caller holding last step's gradient would look like the parameter.
        # (indices, not tensors: a reference of ours alive here would be counted)
        grads = self.grads
        on_grad = [k for k, (t, _, after) in enumerate(grads) if t.grad is after]
        for k in on_grad:
            grads[k][0].grad = grads[k][1]
        try:
            self.base = self._counts()
        finally:
            for k in on_grad:
                grads[k][0].grad = grads[k][2]

    def _counts(self) -> list[int]:
        return reference_counts(self.held, self.storages)

    # ------------------------------------------------------------------ replay
    def replay(self, runner: _Runner) -> bool:
        """Replay into ``runner.env``; False (nothing done) when an assumption fails."""
        env = runner.env
        # (the checks run in a call of their own: no reference they take may be alive
        # when the counts are compared with the baseline)
        if not self._feeds_ok(env) or any(map(operator.gt, self._counts(), self.base)):
            return False
        inputs = self.inputs
        for i, kind, ref in self.others:
            if kind == "copy":
                ref.copy_(env[inputs[i]])
        originals = [env[n] for n in inputs] if self.writes else []
        self._bind(env, originals, self._replayed())
        runner.run_nodes(self.ambient)
        return True

    def _feeds_ok(self, env: dict[Node, Any]) -> bool:
        """Whether the inputs and gradients are as the graph assumed."""
        # The same tensors, still on the same memory (`p.data = ...` moves it): one pass
        # in C over the ~126 parameters and buffers of a training step, not a Python loop.
        nodes, refs, addresses = self.same
        values = list(map(env.__getitem__, nodes))
        if not all(map(operator.is_, values, refs)) or \
                tuple(map(torch.Tensor.data_ptr, values)) != addresses:
            return False
        inputs = self.inputs
        for i, kind, ref in self.others:
            v = env[inputs[i]]
            if kind == "copy":
                if not isinstance(v, torch.Tensor) or v.shape != ref.shape or \
                        v.stride() != ref.stride() or v.dtype != ref.dtype or v.device != ref.device:
                    return False
            elif not _same(v, ref):
                return False
        for t, before, _ in self.grads:
            if t.grad is not before:
                return False
        # the parameters its backward differentiates: where they were, and still trained
        return self.back is None or self.leaves == tuple(
            (t.data_ptr(), t.requires_grad) for t in self.back.leaves)

    def _bind(self, env: dict[Node, Any], originals: list[Any], values: list[Any]) -> None:
        for i, buf in self.writes:
            originals[i].copy_(buf)
        for t, _, after in self.grads:
            t.grad = after
        env.update(zip(self.outputs, values))


class _NotCapturable(Exception):
    pass


class _Layout:
    """Observations and captures for one input layout."""

    def __init__(self) -> None:
        self.check: LayoutCheck | None = None  # made on its first call
        self.calls = 0
        self.seen: list[dict[Node, Any]] = []  # per observed call: node -> Python part
        self.host: dict[Node, str] = {}  # observed host nodes, and why
        self.objects: list[dict[Node, Any]] = []  # per observed call: node -> weakref
        self.regions: list[_Region] | None = None
        self.needs_grad: set[Node] = set()  # nodes whose values carried an autograd graph
        self.returned: set[Node] = set()  # region outputs the segment returns


class SegmentGraphs:
    """Runs a compiled segment with its device work replayed from CUDA graphs.

    Args:
        gm: the segment's graph as it runs (kernels swapped in, or the recorded ops).
        plain: the segment's usual runner: used inside another capture, for layouts past
            ``MAX_LAYOUTS``, and after graphs are given up (``off`` says why).
        fallbacks: a list to note there why graphs were given up (the segment's own).

    Example::

        run = SegmentGraphs(compiled.gm, compiled.run)
        out = run(*inputs)   # calls 1-3 observed, 4 captured, then replays
    """

    def __init__(self, gm: GraphModule, plain: Callable[..., Any],
                 fallbacks: list[str] | None = None) -> None:
        self.gm, self.plain = gm, plain
        self.fallbacks = fallbacks if fallbacks is not None else []
        self.nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.body = self.nodes[len(self.placeholders):-1]
        self.out_node = self.nodes[-1]
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.static_host = {n for n in self.nodes if host_node(n)}
        self.layouts: dict[tuple, _Layout] = {}
        self.recent: _Layout | None = None  # the layout of the latest call
        self.runner = _Runner(gm)
        self.lock = threading.Lock()  # one call at a time uses the runner and the graphs
        self.pool: Any = None
        self.off: str | None = None  # why graphs were given up
        self.misses = 0
        self.host_reasons: dict[str, str] = {}  # observed host nodes of the latest plan

    @property
    def captured(self) -> int:
        """How many regions have a captured graph, over all input layouts."""
        return sum(r.graph is not None for lay in self.layouts.values() for r in lay.regions or [])

    def __call__(self, *args: Any) -> Any:
        if self.off is not None or torch.cuda.is_current_stream_capturing():
            return self.plain(*args)
        if not self.lock.acquire(blocking=False):  # another thread is in: run it plainly
            return self.plain(*args)
        try:
            return self._call(args)
        finally:
            self.lock.release()

    def _call(self, args: tuple) -> Any:
        layout = self.recent
        if layout is None or layout.check is None or not layout.check.ok or \
                not layout.check(args):
            key = tuple((a.shape, a.stride(), a.dtype, a.device)
                        if isinstance(a, torch.Tensor) else type(a) for a in args)
            layout = self.layouts.get(key)
            if layout is None:
                if len(self.layouts) >= MAX_LAYOUTS:
                    return self.plain(*args)
                layout = self.layouts[key] = _Layout()
            if layout.check is None:
                layout.check = LayoutCheck(args)
            self.recent = layout
        layout.calls += 1
        if layout.regions is not None:
            return self._run(layout, args, capture=False)
        if layout.calls <= WARMUP:
            return self._observe(layout, args)
        try:
            layout.regions = self._plan(layout)
            layout.returned = {n for r in layout.regions for n in r.returned}
        except _NotCapturable as e:
            self._give_up(str(e))
            return self.plain(*args)
        return self._run(layout, args, capture=True)

    # ------------------------------------------------------------------ observing
    def _observe(self, layout: _Layout, args: tuple) -> Any:
        with side_stream():  # as CUDA graphs want their warm-up (see side_stream)
            return self._observe_nodes(layout, args)

    def _observe_nodes(self, layout: _Layout, args: tuple) -> Any:
        runner = self.runner
        env = runner.env = dict(zip(self.placeholders, args))
        seen: dict[Node, Any] = {n: _python_part(a) for n, a in zip(self.placeholders, args)}
        for n in self.body:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    env[n] = value = runner.run_node(n)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            touched = tensors_in(value) + tensors_in(runner.fetch_args_kwargs_from_env(n))
            synced = [w for w in caught if "synchroniz" in str(w.message)]
            if synced and layout.calls == WARMUP:  # earlier calls may check new kernels
                layout.host[n] = "synchronizes with the device"
            elif any(not t.is_cuda for t in touched):
                layout.host[n] = "works on CPU tensors"
            elif not touched and _device_op(n) and not ambient_node(n) and not getattr(
                    n.target, "__module__", "").startswith("fxlite"):  # fxlite's are pure
                layout.host[n] = "touches no tensor (Python state)"
            for w in caught:  # the user's own warnings still reach the user
                if w not in synced:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            seen[n] = _python_part(value)
        layout.seen.append(seen)
        layout.needs_grad = {n for n, v in env.items()
                             if any(t.requires_grad and not t.is_leaf for t in tensors_in(v))}
        layout.objects.append({n: weakref.ref(v) for n, v in env.items()
                               if isinstance(v, torch.Tensor)})
        result = runner.run_node(self.out_node)
        runner.env = {}
        return result

    def _plan(self, layout: _Layout) -> list[_Region]:
        first, last = layout.seen[0], layout.seen[-1]
        changing = {n for n in first if not _same(first[n], last.get(n))}
        why = {n: "it must run as Python (host_node)" for n in self.static_host}
        why.update(layout.host)
        # a Python value that changes between calls cannot be baked into a graph
        why.update({n: "a Python value it takes changes between calls" for n in self.body
                    if n in changing or any(i in changing for i in n.all_input_nodes)})
        self.host_reasons = {n.name: r for n, r in why.items() if n not in self.static_host}
        made = []
        for nodes in regions(self.nodes, set(why)):
            after = self.nodes[self.position[nodes[-1]] + 1]
            region = _Region(nodes, f"the region ends at {after.name}: "
                             f"{why.get(after, 'the end of the segment')}")
            region.autograd = not region.backward and any(
                n in layout.needs_grad for n in region.outputs)
            made.append(region)
        if not made:
            raise _NotCapturable("it has no device work to replay")
        # Values no node reads from a region's start on are dropped there, before its
        # replay counts references: zero_grad's reads of .grad still hold last step's
        # gradients in the env, which are the very tensors the replay will overwrite.
        position, starts = self.position, [self.position[r.nodes[0]] for r in made]
        for n in self.nodes[:-1]:
            last = max([position[u] for u in n.users], default=position[n])
            k = bisect.bisect_right(starts, last)
            if k < len(made):
                made[k].drop.append(n)
        return made

    # ------------------------------------------------------------------ running
    def _run(self, layout: _Layout, args: tuple, capture: bool) -> Any:
        runner, nodes = self.runner, self.nodes
        env = runner.env = dict(zip(self.placeholders, args))
        made: set[Node] = set()  # outputs of this call's captured regions: stable objects
        done = len(self.placeholders)
        for region in layout.regions or []:
            start = self.position[region.nodes[0]]
            runner.run_nodes(nodes[done:start])
            done = start + len(region.nodes)
            if capture and self.off is None:
                stable = [i in made or self._stable(layout, i) for i in region.inputs]
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                # (a pool of its own: its saved tensors must outlive other regions' replays)
                pool = torch.cuda.graph_pool_handle() if region.autograd else self.pool
                try:
                    region.capture(runner, stable, pool)
                    made.update(region.outputs)
                    continue
                except Exception as e:  # never a crash where eager works: run it normally
                    end_failed_capture()
                    self._give_up(f"capturing failed ({type(e).__name__}: {e})")
            elif not capture:
                for n in region.drop:
                    env.pop(n, None)
                if region.back is not None and region.back.busy():
                    pass  # the last replay's backward is still to come (not a miss)
                elif region.replay(runner):
                    continue
                else:
                    self.misses += 1
                    if self.misses > MAX_MISSES:
                        self._give_up("its graphs' inputs or outputs kept changing hands")
            runner.run_nodes(region.nodes)
        runner.run_nodes(nodes[done:-1])
        returned = layout.returned
        result = map_arg(self.out_node.args[0],
                         lambda n: _copy_out(env[n]) if n in returned else env[n])
        env.clear()  # drop our references before taking the baseline below
        if self.off is None and capture:
            for region in layout.regions or []:
                region.watch()
        return result

    def _give_up(self, why: str) -> None:
        """Run the plain segment from now on (graphs already captured are dropped)."""
        self.off = why
        self.layouts = {}
        self.recent = None
        self.fallbacks.append(f"CUDA graphs are off for this segment: {why}")

    @staticmethod
    def _stable(layout: _Layout, node: Node) -> bool:
        """Whether every observed call gave ``node`` the same tensor object."""
        refs = [objs.get(node) for objs in layout.objects]
        alive = [r() if r is not None else None for r in refs]
        return alive[0] is not None and all(a is alive[0] for a in alive)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # values without a plain ==
        return False


def _copy_out(value: Any) -> Any:
    return map_aggregate(value, lambda x: x.clone() if isinstance(x, torch.Tensor)
                         and not _leaf(x) else x)

