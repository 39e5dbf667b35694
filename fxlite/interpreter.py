"""Interpreter and Transformer: run a Graph node by node, or re-trace it into a new one.

An :class:`Interpreter` walks ``graph.nodes`` in order and evaluates each node through one
overridable method per opcode, so a pass that observes values (shape propagation,
profiling, checking) overrides a single hook instead of re-writing the loop. A
:class:`Transformer` runs the same walk with :class:`~fxlite.proxy.Proxy` values, so every
hook records a node into a new graph instead of computing a tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch

from .graph import Graph
from .graph_module import GraphModule
from .node import Argument, Node, Target, describe_value, map_aggregate, map_arg
from .proxy import GraphAppendingTracer, Proxy

__all__ = ["Interpreter", "Transformer"]

# Opcode -> hook name. Node.op is a str enum, so plain strings look it up too.
_HOOKS = {op: op for op in ("placeholder", "get_attr", "call_function", "call_method",
                            "call_module", "output")}

# Meta keys that describe where a node came from rather than the value it computes. A node
# that a Transformer hook created in place of a *different* op gets only these.
_PROVENANCE_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node",
                    "custom")


def _add_note(e: BaseException, note: str) -> None:
    """Attach ``note`` to ``e`` without changing its type (``add_note`` on 3.11+)."""
    if hasattr(e, "add_note"):
        e.add_note(note)
    elif e.args and isinstance(e.args[0], str):  # pragma: no cover - Python 3.10
        e.args = (f"{e.args[0]}\n\n{note}",) + e.args[1:]
    else:  # pragma: no cover - Python 3.10
        e.args = (note,) + e.args


class Interpreter:
    """Run a GraphModule one node at a time, through methods that subclasses override.

    The hooks form this tree; override any box to change how that part runs::

        run(*args, initial_env=None)
         │   once per node, in graph order; nodes already in env are skipped,
         │   values are freed after their last use
         └── run_node(n)
              │   fetch_args_kwargs_from_env(n) ── map_nodes_to_values(n.args, n)
              │   then dispatch on n.op:
              ├── placeholder(target, args, kwargs)     next positional input, or default
              ├── get_attr(target, args, kwargs)        fetch_attr(target)
              ├── call_function(target, args, kwargs)   target(*args, **kwargs)
              ├── call_method(target, args, kwargs)     getattr(args[0], target)(*args[1:], **kwargs)
              ├── call_module(target, args, kwargs)     fetch_attr(target)(*args, **kwargs)
              └── output(target, args, kwargs)          args[0], the value run() returns

    Args:
        module: the module to run; its ``graph`` is run unless ``graph`` is given.
        garbage_collect_values: free each value from ``env`` right after its last use,
            so peak memory follows the live values rather than the whole graph.
        graph: run this graph instead of ``module.graph`` (attributes still come from
            ``module``).

    Example::

        class CountCalls(Interpreter):
            def call_function(self, target, args, kwargs):
                self.count = getattr(self, "count", 0) + 1
                return super().call_function(target, args, kwargs)

        out = CountCalls(symbolic_trace(model)).run(torch.randn(3))
    """

    def __init__(self, module: torch.nn.Module, garbage_collect_values: bool = True,
                 graph: Graph | None = None) -> None:
        graph = _check_module_and_graph(type(self).__name__, module, graph)
        self.module = module
        self.submodules = dict(module.named_modules())
        self.graph: Graph = graph
        self.garbage_collect_values = garbage_collect_values
        self.env: dict[Node, Any] = {}
        self.name = type(self).__name__
        self.extra_traceback = True
        self.args_iter: Iterator[Any] = iter(())

    # ------------------------------------------------------------------ the main loop
    def run(self, *args: Any, initial_env: dict[Node, Any] | None = None,
            enable_io_processing: bool = True) -> Any:
        """Run the graph on ``args`` and return what its output node returns.

        Args:
            *args: the positional inputs, matched to placeholders in order.
            initial_env: values for some nodes, computed elsewhere; those nodes are not run
                (a placeholder listed here does not consume a positional input).
            enable_io_processing: let the graph pre-process inputs and post-process outputs
                when it defines ``process_inputs`` / ``process_outputs``.

        Returns:
            The value of the graph's output node.

        Example::

            interp = Interpreter(gm)
            out = interp.run(torch.randn(3))
            x_node = next(iter(gm.graph.nodes))
            out2 = interp.run(initial_env={x_node: torch.randn(3)})  # x given, no args
        """
        if initial_env is not None and not isinstance(initial_env, dict):
            raise TypeError(f"{self.name}.run: initial_env must be a dict {{Node: value}} or "
                            f"None, not {describe_value(initial_env)}")
        self.env = dict(initial_env) if initial_env is not None else {}
        if enable_io_processing:
            args = self._process_inputs(args)
        self.args_iter = iter(args)
        last_uses = freed_after(self.graph) if self.garbage_collect_values else {}

        for node in self.graph.nodes:
            if node not in self.env:
                try:
                    self.env[node] = self.run_node(node)
                except Exception as e:
                    if self.extra_traceback:
                        _add_note(e, self._error_note(node))
                    raise
            for dead in last_uses.get(node, ()):
                self.env.pop(dead, None)
            if node.op == "output":
                out = self.env[node]
                return self._process_outputs(out) if enable_io_processing else out
        return None

    def boxed_run(self, args_list: list[Any]) -> Any:
        """Run with the inputs in a list, which is emptied once they are taken, so the
        caller's references do not keep the inputs alive while the graph runs.

        Raises RuntimeError, leaving ``args_list`` untouched, if it holds more or fewer
        values than the graph has placeholders.
        """
        if not isinstance(args_list, list):
            raise TypeError(f"{self.name}.boxed_run: args_list must be a list (it is emptied once "
                            f"the inputs are taken), not {describe_value(args_list)}; "
                            "pass list(args), or call run(*args)")
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        if len(args_list) > len(placeholders):
            raise RuntimeError(f"{self.name}.boxed_run got {len(args_list)} inputs for "
                               f"{len(placeholders)} placeholders: extra arguments")
        if len(args_list) < len(placeholders):
            missing = [n.name for n in placeholders[len(args_list):]]
            raise RuntimeError(f"{self.name}.boxed_run got {len(args_list)} inputs for "
                               f"{len(placeholders)} placeholders: missing arguments {missing}")
        env = dict(zip(placeholders, args_list))
        args_list.clear()
        return self.run(initial_env=env)

    def _error_note(self, node: Node) -> str:
        note = f"While executing {node.format_node()}"
        trace = node.stack_trace
        if trace:
            note += f"\nOriginal traceback:\n{trace.rstrip()}"
        return note

    def _process_inputs(self, args: tuple) -> tuple:
        hook = getattr(self.graph, "process_inputs", None)
        return tuple(hook(*args)) if callable(hook) else args

    def _process_outputs(self, out: Any) -> Any:
        hook = getattr(self.graph, "process_outputs", None)
        return hook(out) if callable(hook) else out

    def run_node(self, n: Node) -> Any:
        """Evaluate one node: fetch its argument values, then call the hook for ``n.op``.

        Args:
            n: the node to run; its inputs must already be in ``self.env``.

        Returns:
            The node's value.
        """
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return getattr(self, _HOOKS[n.op])(n.target, args, kwargs)

    # ------------------------------------------------------------------ per-opcode hooks
    def placeholder(self, target: Target, args: tuple, kwargs: dict) -> Any:
        """The next positional input (all remaining ones for ``*args``), else the default.

        Args:
            target: the parameter name; ``"*args"`` style names take every remaining input.
            args: ``(default,)`` when the parameter has a default value, else ``()``.
            kwargs: unused.

        Returns:
            The input value.
        """
        assert isinstance(target, str)
        if target.startswith("**"):
            return {}  # run() takes positional inputs only
        if target.startswith("*"):
            return list(self.args_iter)
        try:
            return next(self.args_iter)
        except StopIteration:
            if args:
                return args[0]
            raise RuntimeError(
                f"Expected positional argument for parameter {target}, but one was not passed "
                f"in: placeholder {target!r} got no value ({self.name}.run was given too few "
                "inputs)") from None

    def get_attr(self, target: Target, args: tuple, kwargs: dict) -> Any:
        """The attribute of the module at the dotted path ``target`` (a parameter, buffer...)."""
        assert isinstance(target, str)
        return self.fetch_attr(target)

    def call_function(self, target: Target, args: tuple, kwargs: dict) -> Any:
        """``target(*args, **kwargs)``.

        Example: override to count or swap ops::

            def call_function(self, target, args, kwargs):
                if target is torch.sigmoid:
                    return torch.neg(*args, **kwargs)
                return super().call_function(target, args, kwargs)
        """
        assert not isinstance(target, str)
        return target(*args, **kwargs)

    def call_method(self, target: Target, args: tuple, kwargs: dict) -> Any:
        """``args[0].<target>(*args[1:], **kwargs)``."""
        assert isinstance(target, str)
        self_obj, *rest = args
        return getattr(self_obj, target)(*rest, **kwargs)

    def call_module(self, target: Target, args: tuple, kwargs: dict) -> Any:
        """Call the submodule at the dotted path ``target`` with ``args`` and ``kwargs``."""
        assert isinstance(target, str)
        submod = self.submodules.get(target)
        if submod is None:
            submod = self.fetch_attr(target)
        return submod(*args, **kwargs)

    def output(self, target: Target, args: tuple, kwargs: dict) -> Any:
        """The value the graph returns: ``args[0]``."""
        return args[0]

    # ------------------------------------------------------------------ helpers
    def fetch_attr(self, target: str) -> Any:
        """Follow the dotted path ``target`` from ``self.module``.

        Args:
            target: a path such as ``"layer1.0.weight"``.

        Returns:
            The attribute.

        Raises:
            RuntimeError: naming the first missing part of the path.

        Example::

            w = Interpreter(gm).fetch_attr("linear.weight")
        """
        if not isinstance(target, str):
            raise TypeError(f"{self.name}.fetch_attr: target must be a dotted path str such as "
                            f"'linear.weight', not {describe_value(target)}")
        obj: Any = self.module
        atoms = target.split(".")
        for i, atom in enumerate(atoms):
            if not hasattr(obj, atom):
                where = ".".join(atoms[:i]) or type(self.module).__name__
                raise RuntimeError(f"node referenced nonexistent target {target!r}: "
                                   f"{where!r} has no attribute {atom!r}")
            obj = getattr(obj, atom)
        return obj

    def fetch_args_kwargs_from_env(self, n: Node) -> tuple[tuple, dict]:
        """``n.args`` and ``n.kwargs`` with every Node replaced by its value from ``env``.

        Args:
            n: the node whose arguments to fetch.

        Returns:
            ``(args, kwargs)`` holding values instead of Nodes.
        """
        args = self.map_nodes_to_values(n.args, n)
        kwargs = self.map_nodes_to_values(n.kwargs, n)
        assert isinstance(args, tuple) and isinstance(kwargs, dict)
        return args, kwargs

    def map_nodes_to_values(self, args: Argument, n: Node) -> Argument:
        """Replace every Node in ``args`` (any nesting) by its value in ``env``.

        Args:
            args: an argument structure of Nodes and constants.
            n: the node these arguments belong to, named in the error if a value is missing.

        Returns:
            The same structure holding values.
        """
        env = self.env

        def load(a: Node) -> Any:
            try:
                return env[a]
            except KeyError:
                raise RuntimeError(
                    f"node {n.name!r} referenced {a.name!r}, which has no value; it may have "
                    f"been freed early or never run (Graph.lint() diagnoses misordered "
                    f"graphs)") from None

        return map_arg(args, load)


def _check_module_and_graph(who: str, module: Any, graph: Any) -> Graph:
    """The graph an Interpreter runs; a TypeError naming ``module`` or ``graph`` when the
    arguments cannot give one (checked before anything is read from them)."""
    if not isinstance(module, torch.nn.Module):
        fix = "; trace it first: fxlite.symbolic_trace(fn)" if callable(module) else \
            "; pass a fxlite.GraphModule, e.g. fxlite.symbolic_trace(model)"
        raise TypeError(f"{who}: module must be an nn.Module (a fxlite.GraphModule), not "
                        f"{describe_value(module)}{fix}")
    if graph is not None:
        if not isinstance(graph, Graph):
            raise TypeError(f"{who}: graph must be a fxlite.Graph or None, not "
                            f"{describe_value(graph)}")
        return graph
    own = getattr(module, "graph", None)
    if not isinstance(own, Graph):
        raise TypeError(f"{who}: module is a {type(module).__name__} without a fxlite graph; "
                        f"trace it first: {who}(fxlite.symbolic_trace(module)), or pass the graph "
                        f"to run: {who}(module, graph=graph)")
    return own


class Transformer(Interpreter):
    """Re-trace a GraphModule through the Interpreter hooks into a new GraphModule.

    Every hook receives and returns :class:`~fxlite.proxy.Proxy` values, so an override can
    return the result of ordinary torch code on them, and that code is recorded::

        class NegForSigmoid(Transformer):
            def call_function(self, target, args, kwargs):
                if target is torch.sigmoid:
                    return torch.neg(*args, **kwargs)      # a Proxy: records torch.neg
                return super().call_function(target, args, kwargs)

        new_gm = NegForSigmoid(gm).transform()

    Nodes keep their names (a node created for an old node takes its name as a hint).
    A node that survives, i.e. the hook returned a new node with the old op and target,
    gets a copy of the old node's ``meta``; other nodes created while running an old node
    get only its provenance entries (``stack_trace``, ``nn_module_stack``...), since
    recorded values such as ``tensor_meta`` may no longer hold for them.

    Args:
        module: the GraphModule to transform; it is not modified.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.new_graph = Graph()
        self.new_graph.set_codegen(module.graph._codegen)  # same signature and return hooks
        self.tracer = GraphAppendingTracer(self.new_graph)
        self.tracer.root = module
        self._current: Node | None = None

    def _proxy(self, op: str, target: Target, args: tuple, kwargs: dict) -> Proxy:
        name = self._current.name if self._current is not None else None
        return self.tracer.create_proxy(op, target, args, kwargs, name=name)

    def run_node(self, n: Node) -> Any:
        """Run ``n``'s hook with Proxy values, then give the nodes it created names and meta."""
        before = len(self.new_graph.nodes)
        saved, self._current = self._current, n
        try:
            result = super().run_node(n)
        finally:
            self._current = saved
        created = len(self.new_graph.nodes) - before
        if created and n.op != "output":
            result_node = result.node if isinstance(result, Proxy) else None
            for i, new in enumerate(reversed(self.new_graph.nodes)):
                if i == created:
                    break
                if new is result_node and new.op == n.op and new.target == n.target:
                    for k, v in n.meta.items():
                        new.meta.setdefault(k, copy.copy(v))
                else:
                    for k in _PROVENANCE_KEYS:
                        if k in n.meta:
                            new.meta.setdefault(k, copy.copy(n.meta[k]))
        return result

    def placeholder(self, target: Target, args: tuple, kwargs: dict) -> Proxy:
        """A placeholder of the new graph, with the same name and default value."""
        assert isinstance(target, str)
        name = self._current.name if self._current is not None else None
        node = self.new_graph.create_node("placeholder", target, args, name=name)
        return Proxy(node, self.tracer)

    def get_attr(self, target: Target, args: tuple, kwargs: dict) -> Proxy:
        """A ``get_attr`` node of the new graph (the new module shares the attribute)."""
        assert isinstance(target, str)
        return self._proxy("get_attr", target, args, kwargs)

    def call_function(self, target: Target, args: tuple, kwargs: dict) -> Proxy:
        """A ``call_function`` node of the new graph."""
        return self._proxy("call_function", target, args, kwargs)

    def call_method(self, target: Target, args: tuple, kwargs: dict) -> Proxy:
        """A ``call_method`` node of the new graph."""
        return self._proxy("call_method", target, args, kwargs)

    def call_module(self, target: Target, args: tuple, kwargs: dict) -> Proxy:
        """A ``call_module`` node of the new graph: submodules stay leaves, never inlined."""
        assert isinstance(target, str)
        self.fetch_attr(target)  # fail early, naming the node, if the submodule is missing
        return self._proxy("call_module", target, args, kwargs)

    def transform(self) -> GraphModule:
        """Run the hooks over the whole graph and return the new GraphModule.

        Returns:
            A GraphModule over ``module``'s attributes and the newly recorded graph.

        Example::

            new_gm = Transformer(gm).transform()   # an identical copy of gm
        """
        result = super().run(enable_io_processing=False)
        if result is not None:
            out = map_aggregate(result, lambda a: a.node if isinstance(a, Proxy) else a)
            old_out = self.graph.output_node()
            new_out = self.new_graph.output(out, old_out.type)
            new_out.meta.update(copy.copy(old_out.meta))
        return GraphModule(self.module, self.new_graph)


def freed_after(graph: Graph) -> dict[Node, list[Node]]:
    """For each node, the values whose last reader it is (one backward sweep,
    O(nodes+edges)); a value nobody reads is its own entry, freed right after it is made.
    What :class:`Interpreter` and the straight-line writer (``codegen/runtime/straight_line.py``)
    drop after each node, as eager Python's locals die::

        %a = relu(%x)          freed after %a: ()
        %b = neg(%a)           freed after %b: (%a,)
        %c = add(%b, %x)       freed after %c: (%b, %x)
    """
    freed_at: dict[Node, list[Node]] = {}
    seen: set[Node] = set()
    for node in reversed(graph.nodes):
        if node.op != "output" and not node.users:
            freed_at.setdefault(node, []).append(node)
        for inp in node.all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                freed_at.setdefault(node, []).append(inp)
    return freed_at
