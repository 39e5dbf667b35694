"""Graph: an ordered list of Nodes that represents one function.

The list is doubly linked around a sentinel, so inserting and erasing anywhere is O(1)
and iterating while erasing is safe. ``str(graph)`` prints one node per line::

    graph():
        %x : [num_users=1] = placeholder[target=x]
        %y : [num_users=1] = placeholder[target=y]
        %add : [num_users=1] = call_function[target=operator.add](args = (%x, %y), kwargs = {})
        return add

Node names are unique within a graph, are valid Python identifiers, and never shadow a
keyword or a builtin (``sum`` becomes ``sum_1``), so generated code can use them as-is.
Candidates are folded with NFKC first, as Python folds identifiers (``ｓｕｍ`` is ``sum``).
Code generation lives in ``fxlite.python_code``, not here, and so does the ``Namespace``
that hands out those names. The displays (``print_tabular``, the HTML view) live in
``fxlite.viz``; none of these modules imports this one.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import keyword
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .graph_pickle import NodeRef, TorchOp, shallow
from .node import (
    OPCODES,
    Argument,
    Node,
    Target,
    as_args,
    as_kwargs,
    describe_value,
    map_aggregate,
    map_arg,
)
from .ops import is_impure
from .python_code import Namespace, PythonCode, generate
from .viz.html import graph_html
from .viz.tabular import tabular

__all__ = ["Graph", "map_arg"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a whole-graph operation.

    Why: building thousands of linked nodes triggers collections that rescan every live
    object, which makes tracing and copying big graphs superlinear. Nothing is leaked:
    the collector runs again afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _name_hint(op: str, target: Target) -> str:
    if op in ("placeholder", "call_method", "call_module", "get_attr", "output"):
        return str(target).lstrip("*")
    return getattr(target, "__name__", None) or type(target).__name__


class _NodeList:
    """A live view of a graph's nodes, in order. Safe to iterate while erasing."""

    __slots__ = ("_graph", "_reverse")

    def __init__(self, graph: Graph, reverse: bool = False) -> None:
        self._graph, self._reverse = graph, reverse

    def __len__(self) -> int:
        return self._graph._len

    def __iter__(self) -> Iterator[Node]:
        root = self._graph._root
        step = "_prev" if self._reverse else "_next"
        cur = getattr(root, step)
        while cur is not root:
            if not cur._erased:
                yield cur
            cur = getattr(cur, step)

    def __reversed__(self) -> Iterator[Node]:
        return iter(_NodeList(self._graph, not self._reverse))

    def __repr__(self) -> str:
        return f"[{', '.join(n.name for n in self)}]"


class Graph:
    """An ordered list of Nodes with one ``output`` node at the end: a function's body.

    Args:
        owning_module: the GraphModule that runs this graph, if any; ``lint`` uses it to
            check ``get_attr`` and ``call_module`` targets.

    Example::

        g = Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.relu, (x,))
        g.output(y)
    """

    def __init__(self, owning_module: Any = None, tracer_cls: type | None = None) -> None:
        self._root = Node(self, "", "placeholder", "_root", (), {})
        self._root.op = "root"  # the sentinel is no real node
        self._len = 0
        self._namespace = Namespace()
        self._insert_before = self._root
        self.owning_module = owning_module
        self._tracer_cls = tracer_cls
        self._codegen: Any = None  # a fxlite.python_code_hooks.CodeGen; None: the default
        self._co_fields: dict[str, Any] | None = None  # where the traced code came from

    # ------------------------------------------------------------------ the node list
    @property
    def nodes(self) -> _NodeList:
        """All nodes, in order. ``len(graph.nodes)`` is O(1); iteration tolerates erasure."""
        return _NodeList(self)

    def output_node(self) -> Node:
        """The graph's ``output`` node."""
        for n in reversed(self.nodes):
            if n.op == "output":
                return n
        raise RuntimeError("graph has no output node")

    @property
    def result(self) -> Argument:
        """The value the graph returns: the output node's argument."""
        return self.output_node().args[0]

    def find_nodes(self, *, op: str, target: Target | None = None, sort: bool = True) -> list[Node]:
        """Nodes with the given ``op`` (and ``target``, if given), in graph order."""
        return [n for n in self.nodes if n.op == op and (target is None or n.target == target)]

    # ------------------------------------------------------------------ insertion points
    @contextlib.contextmanager
    def inserting_before(self, n: Node | None = None) -> Iterator[None]:
        """New nodes go before ``n`` (before the first node if ``n`` is None), in creation order.

        Example::

            with graph.inserting_before(node):
                new = graph.call_function(torch.neg, (x,))
        """
        if n is not None:
            self._check_own_node(n, "inserting_before", "n")
        anchor = n if n is not None else self._root._next
        saved, self._insert_before = self._insert_before, anchor
        try:
            yield
        finally:
            self._insert_before = saved

    @contextlib.contextmanager
    def inserting_after(self, n: Node | None = None) -> Iterator[None]:
        """New nodes go after ``n`` (at the end if ``n`` is None), in creation order.

        Example::

            with graph.inserting_after(node):
                new = graph.call_function(torch.relu, (node,))
            node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        """
        if n is not None:
            self._check_own_node(n, "inserting_after", "n")
        with self.inserting_before(n._next if n is not None else self._root):
            yield

    def _check_own_node(self, n: Any, where: str, argument: str) -> None:
        """A TypeError or ValueError naming ``argument`` unless ``n`` is a Node of this graph."""
        if not isinstance(n, Node):
            raise TypeError(f"Graph.{where}: {argument} must be a Node of this graph (or None), "
                            f"not {describe_value(n)}")
        if n.graph is not self:
            raise ValueError(f"Graph.{where}: {argument} is node {n.name!r} of another graph; "
                             "pass a node of this graph (nodes cannot be shared between graphs: "
                             "copy them with graph.node_copy)")

    # ------------------------------------------------------------------ node creation
    def create_node(self, op: str, target: Target, args: tuple | None = None,
                    kwargs: dict | None = None, name: str | None = None,
                    type_expr: Any = None) -> Node:
        """Create a node at the current insertion point and return it.

        Args:
            op: one of the six opcodes.
            target: what to call or read (see :mod:`fxlite.node`).
            args, kwargs: its arguments; may contain Nodes of this graph. (Nodes of another
                graph are accepted, since torch.fx code copies nodes and then remaps their
                inputs, but ``lint`` and code generation reject a graph that still reads them.)
            name: a name hint; the node gets it or a unique variant of it.
            type_expr: an optional type annotation, kept in generated code.
        """
        _check_fields(op, target, name, "create_node", "target")
        args = () if args is None else as_args(args, "Graph.create_node: args")
        kwargs = {} if kwargs is None else as_kwargs(kwargs, "Graph.create_node: kwargs")
        # Named only once built: a refused node (one reading an erased node) takes no name.
        n = Node(self, name or _name_hint(op, target), op, target, args, kwargs, type_expr)
        n.name = self._namespace.create_name(n.name)
        self._insert_before.prepend(n)
        self._len += 1
        return n

    def placeholder(self, name: str, type_expr: Any = None,
                    default_value: Any = inspect.Signature.empty) -> Node:
        """An input of the function; ``default_value`` makes it optional."""
        _check_fields("placeholder", name, None, "placeholder", "name")
        args = () if default_value is inspect.Signature.empty else (default_value,)
        return self.create_node("placeholder", name, args, type_expr=type_expr)

    def get_attr(self, qualified_name: str, type_expr: Any = None) -> Node:
        """Read an attribute of the owning module by its dotted path.

        Warns if the owning module has no such attribute (yet).
        """
        _check_fields("get_attr", qualified_name, None, "get_attr", "qualified_name")
        self._warn_if_missing(qualified_name, "get_attr", "add_submodule / register_parameter "
                              "/ register_buffer")
        return self.create_node("get_attr", qualified_name, type_expr=type_expr)

    def call_module(self, module_name: str, args: tuple | None = None,
                    kwargs: dict | None = None, type_expr: Any = None) -> Node:
        """Call the submodule at the dotted path ``module_name``.

        Warns if the owning module has no such submodule (yet).
        """
        _check_fields("call_module", module_name, None, "call_module", "module_name")
        self._warn_if_missing(module_name, "call_module", "add_submodule")
        return self.create_node("call_module", module_name, args, kwargs, type_expr=type_expr)

    def _warn_if_missing(self, path: str, op: str, fix: str) -> None:
        if self.owning_module is None or self._lint_target_path(path) is None:
            return
        warnings.warn(f"Attempted to insert a {op} Node with no underlying reference in the "
                      f"owning GraphModule: it has no {path!r}. Add it first with "
                      f"GraphModule.{fix}, or the generated code will fail.", stacklevel=3)

    def call_method(self, method_name: str, args: tuple | None = None,
                    kwargs: dict | None = None, type_expr: Any = None) -> Node:
        """Call ``args[0].method_name(*args[1:], **kwargs)``."""
        _check_fields("call_method", method_name, None, "call_method", "method_name")
        return self.create_node("call_method", method_name, args, kwargs, type_expr=type_expr)

    def call_function(self, the_function: Callable[..., Any], args: tuple | None = None,
                      kwargs: dict | None = None, type_expr: Any = None) -> Node:
        """Call a free function such as ``torch.relu`` or ``operator.add``."""
        _check_fields("call_function", the_function, None, "call_function", "the_function")
        return self.create_node("call_function", the_function, args, kwargs, type_expr=type_expr)

    def output(self, result: Argument, type_expr: Any = None) -> Node:
        """Return ``result`` from the function. A graph has exactly one output node."""
        return self.create_node("output", "output", (result,), type_expr=type_expr)

    def node_copy(self, node: Node, arg_transform: Callable[[Node], Argument] = lambda x: x) -> Node:
        """Copy ``node`` (from any graph) into this one, mapping its inputs with ``arg_transform``."""
        if not isinstance(node, Node):
            raise TypeError(f"Graph.node_copy: node must be a Node, not {describe_value(node)}")
        if not callable(arg_transform):
            raise TypeError(f"Graph.node_copy: arg_transform must be a function from a Node of "
                            f"the copied graph to its value here, not {describe_value(arg_transform)}")
        args = map_arg(node.args, arg_transform)
        kwargs = map_arg(node.kwargs, arg_transform)
        new = self.create_node(node.op, node.target, args, kwargs, node.name, node.type)
        new.meta = copy.copy(node.meta)
        return new

    def graph_copy(self, g: Graph, val_map: dict[Node, Argument],
                   return_output_node: bool = False) -> Argument:
        """Copy every node of ``g`` but its output into this graph.

        ``val_map`` maps nodes of ``g`` to their copies and is filled in as nodes are
        copied; prefill it to substitute inputs. Returns the copied output value (or the
        output node itself with ``return_output_node=True``).
        """
        if not isinstance(g, Graph):
            raise TypeError(f"Graph.graph_copy: g must be a fxlite Graph, not {describe_value(g)}"
                            + ("; pass gm.graph" if isinstance(getattr(g, "graph", None), Graph) else ""))
        if not isinstance(val_map, dict):
            raise TypeError(f"Graph.graph_copy: val_map must be a dict (it is filled with the "
                            f"copies), not {describe_value(val_map)}; pass {{}} to start empty")
        for node in g.nodes:
            if node in val_map:
                continue
            lookup = _lookup_defined(val_map, node, "cannot copy the graph")
            if node.op == "output":
                out = map_arg(node.args[0], lookup)
                return node if return_output_node else out
            val_map[node] = self.node_copy(node, lookup)
        return None

    def erase_node(self, to_erase: Node) -> None:
        """Remove a node that nobody uses. Raises RuntimeError naming its users otherwise.

        Raises:
            TypeError: ``to_erase`` is not a Node.
            RuntimeError: it belongs to another graph, was already erased, or still has
                users (as torch.fx). Nothing is changed then.
        """
        if not isinstance(to_erase, Node):
            raise TypeError(f"Graph.erase_node: to_erase must be a Node of this graph, not "
                            f"{describe_value(to_erase)}")
        if to_erase.graph is not self:
            raise RuntimeError(f"Graph.erase_node: to_erase, node {to_erase.name!r}, does not "
                               "belong to this graph; erase it from its own graph: "
                               f"{to_erase.name}.graph.erase_node({to_erase.name})")
        if to_erase._erased:
            raise RuntimeError(f"Graph.erase_node: to_erase, node {to_erase.name!r}, was already "
                               "erased")
        if to_erase.users:
            users = ", ".join(u.name for u in to_erase.users)
            raise RuntimeError(
                f"Graph.erase_node: tried to erase node {to_erase.name!r} (to_erase) but it "
                f"still had {len(to_erase.users)} "
                f"users in the graph: {users}. Make them read another value first, e.g. "
                f"{to_erase.name}.replace_all_uses_with(new_node)")
        to_erase._remove_from_list()
        to_erase._update_args_kwargs((), {})
        to_erase._erased = True
        self._len -= 1

    # ------------------------------------------------------------------ whole-graph passes
    def eliminate_dead_code(self, is_impure_node: Callable[[Node], bool] | None = None) -> bool:
        """Erase nodes whose results are unused, keeping in-place, random and side-effecting ops.

        Returns True if anything was erased.

        Example: in ``y = x + 1; z = x * 2; return z`` the ``add`` is erased; in
        ``x.add_(1); return x`` nothing is.
        """
        if is_impure_node is not None and not callable(is_impure_node):
            raise TypeError(f"Graph.eliminate_dead_code: is_impure_node must be a function "
                            f"Node -> bool (or None), not {describe_value(is_impure_node)}")
        impure = is_impure_node or self._is_impure
        changed = False
        for node in reversed(self.nodes):
            if not node.users and node.op not in ("placeholder", "output") and not impure(node):
                self.erase_node(node)
                changed = True
        return changed

    def _is_impure(self, node: Node, impure_random: bool = True) -> bool:
        """The op table's ``is_impure`` for a node of this graph (``Node.is_impure`` asks here)."""
        return is_impure(node, self.owning_module, impure_random=impure_random)

    def lint(self) -> None:
        """Check the graph is well formed; raise RuntimeError naming the first bad node.

        Checks: each node belongs to this graph, names are unique identifiers, inputs are
        defined before use, ``users`` match actual uses, there is one output and it is
        last, and ``get_attr`` / ``call_module`` targets exist on the owning module.
        """
        seen: set[Node] = set()
        names: set[str] = set()
        outputs = count = 0
        last = None
        for node in self.nodes:
            count += 1
            last = node
            problem = self._lint_node(node, seen, names)
            if problem:
                raise RuntimeError(f"lint: node {node.name!r} ({node.format_node()}) {problem}")
            outputs += node.op == "output"
            seen.add(node)
            names.add(node.name)
        if count != self._len:
            raise RuntimeError(f"lint: graph counts {self._len} nodes but holds {count}")
        if outputs != 1 or last is None or last.op != "output":
            raise RuntimeError(f"lint: graph must end with exactly one output node (found {outputs})")

    def _lint_node(self, node: Node, seen: set[Node], names: set[str]) -> str | None:
        """What is wrong with ``node``, or None."""
        if node.graph is not self:
            return "does not belong to this Graph"
        if node.name in names:
            return "has a duplicate name"
        if not node.name.isidentifier() or keyword.iskeyword(node.name):
            return "has a name that is not a Python identifier"
        for inp in node._input_nodes:
            if inp.graph is not self:
                return f"reads {inp.name!r}, which does not belong to this Graph"
            if inp._erased:
                return f"reads erased node {inp.name!r}"
            if inp not in seen:
                return f"reads {inp.name!r}, which was used before it has been defined"
            if node not in inp.users:
                return f"reads {inp.name!r}, which does not list it as a user"
        for user in node.users:
            if node not in user._input_nodes or user._erased or user.graph is not self:
                return f"lists {user.name!r} as a user, but it does not read it"
        return self._lint_target(node)

    def _lint_target(self, node: Node) -> str | None:
        if self.owning_module is None or node.op not in ("get_attr", "call_module"):
            return None
        missing = self._lint_target_path(node.target)
        if missing:
            return missing
        obj = self.owning_module
        for atom in node.target.split("."):
            obj = getattr(obj, atom)
        if node.op == "call_module" and not isinstance(obj, torch.nn.Module):
            return f"calls {node.target!r}, which is not a module"
        return None

    def _lint_target_path(self, path: str) -> str | None:
        obj = self.owning_module
        for atom in path.split("."):
            if not hasattr(obj, atom):
                return f"refers to {path!r}, which the owning module lacks"
            obj = getattr(obj, atom)
        return None

    # ------------------------------------------------------------------ code generation hooks
    def set_codegen(self, codegen: Any) -> None:
        """Use ``codegen`` (a :class:`fxlite.python_code_hooks.CodeGen`) for ``forward``'s
        signature and return; call ``recompile()`` on the owning GraphModule afterwards."""
        self._codegen = codegen

    def process_inputs(self, *args: Any) -> Any:
        """The placeholder values for a call with ``args`` (the codegen's ``process_inputs``)."""
        return args if self._codegen is None else self._codegen.process_inputs(*args)

    def process_outputs(self, out: Any) -> Any:
        """A call's result from the output node's value (the codegen's ``process_outputs``)."""
        return out if self._codegen is None else self._codegen.process_outputs(out)

    # ------------------------------------------------------------------ printing
    def __str__(self) -> str:
        # torch.fx prints "graph():" and lists the inputs as placeholder lines below it.
        lines = ["graph():"]
        lines += ["    " + n.format_node() for n in self.nodes]
        return "\n".join(lines)

    def print_tabular(self) -> None:
        """Print the nodes as a table (opcode, name, target, args, kwargs), via tabulate.

        When ShapeProp has stored ``meta['tensor_meta']``, shape and dtype columns follow.
        """
        print(tabular(self))

    def _repr_html_(self) -> str:
        return graph_html(self)  # a table, and a drawing when Graphviz is installed

    def python_code(self, root_module: str = "self") -> PythonCode:
        """Generate the source of ``forward`` for this graph (see ``fxlite.python_code``)."""
        return generate(self, root_module)

    # ------------------------------------------------------------------ copying
    def __deepcopy__(self, memo: dict) -> Graph:
        with gc_paused():
            return self._deepcopy(memo)

    def _deepcopy(self, memo: dict) -> Graph:
        # graph_copy walks the list; the default deepcopy would recurse node to node.
        new = Graph(tracer_cls=self._tracer_cls)
        memo[id(self)] = new
        new._codegen = copy.deepcopy(self._codegen, memo)
        new._co_fields = self._co_fields
        val_map: dict[Node, Argument] = {}
        out = new.graph_copy(self, val_map, return_output_node=True)
        if out is not None:
            new.output(map_arg(out.args[0], lambda n: val_map[n]), out.type)
            new.output_node().meta = copy.copy(out.meta)
        for old, nn in val_map.items():
            nn.meta = copy.deepcopy(old.meta, memo)
        return new

    def __getstate__(self) -> dict:
        # A flat record per node keeps pickling iterative on graphs of any size.
        index: dict[Node, int] = {}
        records = []
        with gc_paused():  # allocating a record per node would trigger superlinear collections
            for n in self.nodes:
                ref = _lookup_defined(index, n, "cannot pickle the graph", NodeRef)
                records.append((n.name, str(n.op), TorchOp.wrap(n.target),
                                shallow(map_arg(n.args, ref)), shallow(map_arg(n.kwargs, ref)),
                                n.type, n.meta))
                index[n] = len(index)
        # The tracer class is informational; a local class (not importable) is left out, so
        # a graph pickles without it.
        cls = self._tracer_cls
        if cls is not None and getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is not cls:
            cls = None
        return {"records": records, "tracer_cls": cls, "codegen": self._codegen}

    def __setstate__(self, state: dict) -> None:
        Graph.__init__(self, tracer_cls=state.get("tracer_cls"))
        self._codegen = state.get("codegen")
        made: list[Node] = []

        def unref(r: Any) -> Any:
            if not isinstance(r, NodeRef):
                return r
            if not 0 <= r.index < len(made):
                raise RuntimeError(f"unpickling a Graph: node {name!r} reads node #{r.index}, "
                                   f"which is not defined before it (the data is damaged)")
            return made[r.index]

        with gc_paused():  # as in __deepcopy__: collections during the rebuild are superlinear
            for name, op, target, args, kwargs, type_expr, meta in state["records"]:
                n = self.create_node(op, TorchOp.unwrap(target), map_aggregate(args, unref),
                                     map_aggregate(kwargs, unref), name, type_expr)
                n.meta = meta
                made.append(n)


_TARGET_KINDS = {
    "placeholder": "the argument's name",
    "get_attr": "a dotted attribute path such as 'linear.weight'",
    "call_module": "a dotted submodule path such as 'layer1.0'",
    "call_method": "a method name such as 'relu'",
}


def _check_fields(op: Any, target: Any, name: Any, where: str, target_arg: str) -> None:
    """Raise a TypeError or ValueError naming the argument of ``Graph.<where>`` that cannot
    make a node: checked before the node is named or linked, so nothing changes."""
    if not isinstance(op, str):
        raise TypeError(f"Graph.{where}: op must be an opcode string, not {describe_value(op)}; "
                        f"expected one of {sorted(OPCODES)}")
    if op not in OPCODES:
        raise ValueError(f"Graph.{where}: op {op!r} is not an opcode; expected one of "
                         f"{sorted(OPCODES)}")
    kind = _TARGET_KINDS.get(op)
    if kind is not None and not isinstance(target, str):
        raise TypeError(f"Graph.{where}: {target_arg} of a {op} node must be a str ({kind}), "
                        f"not {describe_value(target)}")
    if op == "call_function" and not callable(target):
        raise TypeError(f"Graph.{where}: {target_arg} of a call_function node must be callable "
                        f"(such as torch.relu or operator.add), not {describe_value(target)}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"Graph.{where}: name must be a str (a name hint) or None, not "
                        f"{describe_value(name)}")


def check_order(graph: Graph, what: str) -> None:
    """Raise RuntimeError naming the first node that reads a value not defined before it.

    A cheap part of ``lint`` that passes run before changing anything: a cycle (or a node
    moved above its input) would otherwise surface as a bare KeyError deep inside them.
    """
    seen: set[Node] = set()
    for node in graph.nodes:
        for inp in node._input_nodes:
            if inp not in seen:
                _lookup_defined({}, node, what)(inp)
        seen.add(node)


def _lookup_defined(done: dict[Node, Any], node: Node, what: str,
                    wrap: Callable[[Any], Any] | None = None) -> Callable[[Node], Any]:
    """``n -> done[n]`` (or ``wrap(done[n])``) for the inputs of ``node``, raising a clear
    error for an input not yet in ``done``: one defined after ``node`` (a cycle, or an
    unordered graph), in another graph, or erased."""
    def missing(n: Node) -> RuntimeError:
        where = "after it" if n.graph is node.graph and not n._erased else \
            "in another graph" if n.graph is not node.graph else "nowhere (it was erased)"
        return RuntimeError(f"{what}: node {node.name!r} ({node.format_node()}) reads "
                            f"{n.name!r}, which is defined {where}; the graph is malformed "
                            "(a cycle?) and was left unchanged")

    if wrap is None:
        def lookup(n: Node) -> Any:
            try:
                return done[n]
            except KeyError:
                raise missing(n) from None
    else:
        def lookup(n: Node) -> Any:
            try:
                return wrap(done[n])
            except KeyError:
                raise missing(n) from None
    return lookup
