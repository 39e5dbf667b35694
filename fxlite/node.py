"""Nodes: the single record type of the fxlite IR.

A :class:`Node` is one operation in a :class:`~fxlite.graph.Graph`. Its ``op`` is one of
six opcodes, and what ``target``, ``args`` and ``kwargs`` mean depends on it::

    op             target                      args / kwargs              printed as
    placeholder    argument name ("x")         (default,) if any          %x = placeholder[target=x]
    get_attr       dotted path ("linear.w")    ()                         %w = get_attr[target=linear.w]
    call_function  a Python callable           the call's arguments       %add = call_function[target=operator.add](...)
    call_method    method name ("relu")        (self_value, *arguments)   %relu = call_method[target=relu](...)
    call_module    dotted module path          the call's arguments       %lin = call_module[target=lin](...)
    output         "output"                    (returned value,)          return add

Arguments may be Nodes, constants, or lists/tuples/dicts/slices of them. Every Node
keeps the set of Nodes it reads (``all_input_nodes``) and the set of Nodes that read it
(``users``); assigning ``args`` or ``kwargs`` keeps both in sync.

The printed form is written here (:func:`format_target`, :func:`format_arg`), and so are
the argument checks every node-making function shares (:func:`as_args`, :func:`as_kwargs`).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Collection, Iterable
from typing import Any, Union

# This module imports nothing of fxlite: a Node's ``graph`` is typed Any because the Graph
# that owns it sits above, in fxlite.graph.
__all__ = ["OPCODES", "Argument", "Node", "Opcode", "Target", "ancestors", "as_args",
           "as_kwargs", "collect_nodes", "describe_value", "format_arg", "format_target", "map_aggregate",
           "map_arg", "safe_repr", "target_name", "unprintable"]


class Opcode(str, enum.Enum):
    """The six opcodes. Members compare equal to their names: ``Opcode.OUTPUT == "output"``."""

    PLACEHOLDER = "placeholder"
    GET_ATTR = "get_attr"
    CALL_FUNCTION = "call_function"
    CALL_METHOD = "call_method"
    CALL_MODULE = "call_module"
    OUTPUT = "output"

    def __str__(self) -> str:
        return self.value

    __hash__ = str.__hash__
    __format__ = str.__format__


OPCODES = {o.value: o for o in Opcode}
"""Opcode by name: ``OPCODES["output"] is Opcode.OUTPUT``."""

Target = Union[Callable[..., Any], str]
Argument = Any  # a Node, a constant, or a list/tuple/dict/slice of Arguments


_AGGREGATES = (tuple, list, dict, slice)


def map_aggregate(a: Argument, fn: Callable[[Any], Any]) -> Argument:
    """Apply ``fn`` to every leaf of ``a``, rebuilding tuples, lists, dicts and slices."""
    if not isinstance(a, _AGGREGATES):
        return fn(a)
    if not isinstance(a, slice):  # the common case, flat (x, 1.0), without the general walk
        for x in (a.values() if isinstance(a, dict) else a):
            if isinstance(x, _AGGREGATES):
                break
        else:
            if isinstance(a, dict):
                return {k: fn(v) for k, v in a.items()}
            items = [fn(x) for x in a]
            return items if isinstance(a, list) else type(a)(*items) if hasattr(a, "_fields") \
                else tuple(items)
    # A post-order walk over an explicit stack: no depth of nesting overflows Python's stack.
    stack: list[tuple[Any, Any, list]] = [(a, _items(a), [])]
    while True:
        value, items, done = stack[-1]
        while len(done) < len(items):
            x = items[len(done)]
            if isinstance(x, _AGGREGATES):
                stack.append((x, _items(x), []))
                break
            done.append(fn(x))
        else:
            stack.pop()
            built = _rebuild(value, done)
            if not stack:
                return built
            stack[-1][2].append(built)


def _items(a: Any) -> Any:
    if isinstance(a, dict):
        return list(a.values())
    if isinstance(a, slice):
        return (a.start, a.stop, a.step)
    return a


def _rebuild(a: Any, items: list) -> Any:
    if isinstance(a, tuple):
        return type(a)(*items) if hasattr(a, "_fields") else tuple(items)  # keep namedtuples
    if isinstance(a, list):
        return items
    if isinstance(a, dict):
        return dict(zip(a.keys(), items))
    return slice(*items)


def map_arg(a: Argument, fn: Callable[[Node], Argument]) -> Argument:
    """Apply ``fn`` to every Node inside ``a``; other leaves are kept as they are."""
    return map_aggregate(a, lambda x: fn(x) if isinstance(x, Node) else x)


_SCALARS = frozenset({int, float, bool, str, type(None)})


def collect_nodes(a: Argument, out: dict[Node, None]) -> None:
    """Add every Node inside ``a`` to ``out`` (a dict used as an ordered set), in order.

    Why not ``map_arg``: this builds nothing and is iterative, for the hot paths of node
    bookkeeping and matching.
    """
    # Iterative walk: arguments can be long lists (torch.cat of many tensors).
    stack = [a]
    while stack:
        x = stack.pop()
        if isinstance(x, Node):
            out.setdefault(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif isinstance(x, slice):
            stack.extend((x.step, x.stop, x.start))


def ancestors(nodes: Iterable[Node], stop: Collection[Node] = ()) -> set[Node]:
    """``nodes`` and every node they read, transitively; the inputs of a node in ``stop``
    are not followed (the stop node itself is included).

    Example::

        ancestors([relu])                 # {relu, add, x, w}
        ancestors([relu], stop={add})     # {relu, add}
    """
    seen: set[Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            stack.extend(n.all_input_nodes)
    return seen


_SCALARS_AND_NODE: frozenset = frozenset()  # filled in below, once Node exists


class Node:
    """One operation in a Graph. See the module docstring for the meaning of each field.

    Nodes are created by :meth:`Graph.create_node` and its helpers, never directly.
    Arbitrary attributes may be set on a node (``node.shape = ...``), but ``meta`` is
    the place for pass results.
    """

    __slots__ = (
        "graph", "name", "op", "target", "_args", "_kwargs", "_input_nodes", "users",
        "type", "meta", "_prev", "_next", "_erased", "__dict__", "__weakref__",
    )

    def __init__(self, graph: Any, name: str, op: str, target: Target,
                 args: tuple, kwargs: dict, type: Any = None) -> None:
        if op not in OPCODES:
            raise ValueError(f"unknown opcode {op!r}; expected one of {sorted(OPCODES)}")
        if op in ("call_method", "call_module", "get_attr") and not isinstance(target, str):
            raise ValueError(f"{op} node {name!r} needs a string target, got {target!r}")
        if op == "call_function" and not callable(target):
            raise ValueError(f"call_function node {name!r} needs a callable target, got {target!r}")
        self.graph = graph
        self.name = name
        self.op = OPCODES[op]
        self.target = target
        self._input_nodes: dict[Node, None] = {}
        self.users: dict[Node, None] = {}
        self.type = type
        self.meta: dict[str, Any] = {}
        self._prev = self._next = self
        self._erased = False
        self._args: tuple = ()
        self._kwargs: dict = {}
        self._update_args_kwargs(args, kwargs)

    # ------------------------------------------------------------------ arguments
    @property
    def args(self) -> tuple:
        """The positional arguments. Assigning a new tuple updates ``users`` bookkeeping."""
        return self._args

    @args.setter
    def args(self, a: tuple) -> None:
        self._update_args_kwargs(as_args(a, f"node {self.name!r}: args"), self._kwargs)

    @property
    def kwargs(self) -> dict:
        """The keyword arguments. Assigning a new dict updates ``users`` bookkeeping."""
        return self._kwargs

    @kwargs.setter
    def kwargs(self, k: dict) -> None:
        self._update_args_kwargs(self._args, as_kwargs(k, f"node {self.name!r}: kwargs"))

    @property
    def all_input_nodes(self) -> list[Node]:
        """Every Node this node reads, in order of first appearance in args then kwargs."""
        return list(self._input_nodes)

    def _update_args_kwargs(self, args: tuple, kwargs: dict) -> None:
        new: dict[Node, None] = {}
        for a in args:  # the common flat case without the general walk: tracing speed
            t = type(a)
            if t is Node:
                new[a] = None
            elif t not in _SCALARS:
                collect_nodes(a, new)
        if kwargs:
            collect_nodes(kwargs, new)
        for n in new:  # checked before anything changes: a refused assignment keeps the old one
            if n._erased:
                raise RuntimeError(f"node {self.name!r}: its args or kwargs would read erased node "
                                   f"{n.name!r}; an erased node cannot be used again, read a "
                                   "live node instead")
        for old in self._input_nodes:
            old.users.pop(self, None)
        self._args, self._kwargs = args, kwargs
        for n in new:
            n.users[self] = None
        self._input_nodes = new

    def update_arg(self, idx: int, arg: Argument) -> None:
        """Set ``args[idx]`` to ``arg``."""
        args = list(self._args)
        args[idx] = arg
        self.args = tuple(args)

    def update_kwarg(self, key: str, arg: Argument) -> None:
        """Set ``kwargs[key]`` to ``arg``."""
        self.kwargs = {**self._kwargs, key: arg}

    def insert_arg(self, idx: int, arg: Argument) -> None:
        """Insert ``arg`` into ``args`` at position ``idx`` (as ``list.insert``)."""
        args = list(self._args)
        args.insert(idx, arg)
        self.args = tuple(args)

    def is_impure(self, impure_random: bool = True) -> bool:
        """True if removing this node could change behaviour even when its result is unused:
        in-place ops, side effects (``print``, ``torch._assert``, functions marked with
        ``fxlite.has_side_effect``), and random ops. Dead-code elimination keeps such nodes.

        Args:
            impure_random: count random ops (``torch.rand``, dropout) as impure.
        """
        return self.graph._is_impure(self, impure_random)  # the op table, through the graph

    def replace_input_with(self, old_input: Node, new_input: Node) -> None:
        """Replace every use of ``old_input`` in this node's arguments with ``new_input``."""
        args, kwargs = self._args, self._kwargs
        flat = _SCALARS_AND_NODE
        if all(type(a) in flat for a in args) and all(type(v) in flat for v in kwargs.values()):
            # the common flat case, without the general walk (rewriting speed)
            self._update_args_kwargs(
                tuple([new_input if a is old_input else a for a in args]),
                {k: new_input if v is old_input else v for k, v in kwargs.items()} if kwargs else {})
            return
        swap = lambda n: new_input if n is old_input else n
        self._update_args_kwargs(map_arg(args, swap), map_arg(kwargs, swap))

    def replace_all_uses_with(self, replace_with: Node,
                              delete_user_cb: Callable[[Node], bool] = lambda user: True,
                              *, propagate_meta: bool = False) -> list[Node]:
        """Make every user of this node read ``replace_with`` instead.

        Args:
            replace_with: the node to use in place of ``self``.
            delete_user_cb: called per user; users for which it returns False are kept.
            propagate_meta: copy ``self.meta`` into ``replace_with.meta`` (which must be empty).

        Returns:
            The users that were changed.

        Example::

            with graph.inserting_after(node):
                new = graph.call_function(torch.relu, (node,))
            node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        """
        if propagate_meta:
            if replace_with.meta:
                raise RuntimeError(f"propagate_meta needs an empty meta on {replace_with.name!r}")
            replace_with.meta.update(self.meta)
        changed = [u for u in list(self.users) if delete_user_cb(u)]
        for user in changed:
            user.replace_input_with(self, replace_with)
        return changed

    # ------------------------------------------------------------------ list position
    @property
    def next(self) -> Node:
        """The next node in the graph (the graph's sentinel after the last node)."""
        return self._next

    @property
    def prev(self) -> Node:
        """The previous node in the graph (the graph's sentinel before the first node)."""
        return self._prev

    def _remove_from_list(self) -> None:
        # The node keeps its own links, so that a loop over graph.nodes that erases or
        # moves the current node still finds its way to the next one.
        p, n = self._prev, self._next
        p._next, n._prev = n, p

    def prepend(self, x: Node) -> None:
        """Move or insert ``x`` just before this node."""
        if x is self:
            return  # as in torch.fx: moving a node next to itself leaves the graph unchanged
        x._remove_from_list()
        p = self._prev
        p._next, x._prev = x, p
        x._next, self._prev = self, x

    def append(self, x: Node) -> None:
        """Move or insert ``x`` just after this node."""
        self._next.prepend(x)

    # ------------------------------------------------------------------ printing
    @property
    def stack_trace(self) -> str | None:
        """Where in user code this node was traced from, if the tracer recorded it."""
        return self.meta.get("stack_trace")

    @stack_trace.setter
    def stack_trace(self, trace: str | None) -> None:
        self.meta["stack_trace"] = trace

    def format_node(self) -> str:
        """One line in the ``str(graph)`` format: ``%add : [num_users=1] = call_function[...](...)``."""
        if self.op == "output":
            return f"return {format_arg(self._args[0], '') if self._args else None}"
        typename = f"{_format_type(self.type)} " if self.type is not None else ""  # as torch.fx
        if self.op == "placeholder":
            default = f"[default={format_arg(self._args[0])}]" if self._args else ""
            return f"%{self.name} : {typename}[num_users={len(self.users)}] = placeholder[target={self.target}]{default}"
        head = f"%{self.name} : {typename}[num_users={len(self.users)}] = {self.op}[target={format_target(self.target)}]"
        if self.op == "get_attr":
            return head
        return f"{head}(args = {format_arg(self._args)}, kwargs = {format_arg(self._kwargs)})"

    def __repr__(self) -> str:
        return self.name

    def _rename(self, candidate: str) -> None:
        """Rename this node, keeping names unique within its graph."""
        if candidate == self.name:
            return
        self.graph._namespace.release(self.name)
        self.name = self.graph._namespace.create_name(candidate)


def target_name(node: Node) -> str:
    """A node's op as a short name: a method's (``"view"``), a function's ``__name__``
    (``"relu"``, ``"getitem"`` for ``operator.getitem``), a module's path; else ``""``."""
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", "")


def format_target(target: Target) -> str:
    """``operator.add``, ``torch.sum``, ``my_module.my_fn``: how a target prints in a graph."""
    if isinstance(target, str):
        return target
    if type(target).__name__ in ("OpOverload", "OpOverloadPacket") and \
            type(target).__module__ == "torch._ops":
        return f"torch.ops.{target}"  # torch.ops.aten.add.Tensor
    mod = getattr(target, "__module__", None) or ""
    mod = {"_operator": "operator"}.get(mod, mod)
    name = getattr(target, "__name__", None)
    if name and getattr(sys.modules.get(mod), name, None) is target:
        return f"{mod}.{name}"
    qual = getattr(target, "__qualname__", None) or name or safe_repr(target)
    return f"{mod}.{qual}" if mod else qual


_SCALARS_AND_NODE = _SCALARS | {Node}


def _format_type(t: Any) -> str:
    """``torch.Tensor``, ``list[float]``, ``typing.List[float]``, ``float | None``."""
    if isinstance(t, type) and not getattr(t, "__args__", None):
        return format_target(t)
    return safe_repr(t)


def format_arg(a: Argument, prefix: str = "%") -> str:
    """How an argument prints in ``str(graph)``: ``(%x, 1.0)``, ``{'dim': 1}``; each Node as
    ``prefix`` + its name. Never raises on a constant that cannot print itself."""
    def leaf(x: Any) -> str:
        if isinstance(x, Node):
            return f"{prefix}{x.name}"
        if getattr(type(x), "_custom_fx_repr_fn", None) is not None:
            try:  # an argument type that says how it prints (torch.fx)
                text = x._custom_fx_repr_fn()
            except Exception:
                return unprintable(x)
            return text if isinstance(text, str) else unprintable(x)
        return safe_repr(x)

    if not isinstance(a, (tuple, list, dict, slice)) or hasattr(type(a), "_custom_fx_repr_fn"):
        return leaf(a)
    # Iterative, like map_aggregate: arguments may nest deeper than Python's stack allows.
    stack: list[tuple[Any, Any, list[str]]] = [(a, _items(a), [])]
    while True:
        value, items, done = stack[-1]
        while len(done) < len(items):
            x = items[len(done)]
            if isinstance(x, _AGGREGATES) and not hasattr(type(x), "_custom_fx_repr_fn"):
                stack.append((x, _items(x), []))
                break
            done.append(leaf(x))
        else:
            stack.pop()
            if isinstance(value, dict):
                text = "{" + ", ".join(f"{_safe_str(k)}: {v}" for k, v in zip(value, done)) + "}"
            elif isinstance(value, list):
                text = "[" + ", ".join(done) + "]"
            elif isinstance(value, slice):
                text = f"slice({', '.join(done)})"
            else:
                text = f"({done[0]},)" if len(done) == 1 else "(" + ", ".join(done) + ")"
            if not stack:
                return text
            stack[-1][2].append(text)


# ---------------------------------------------------------------------- printing user values
def unprintable(value: Any) -> str:
    """The text shown for a value that cannot print itself: ``<unprintable Foo>``."""
    return f"<unprintable {type(value).__name__}>"


def safe_repr(value: Any) -> str:
    """``repr(value)``, or ``<unprintable Foo>`` when its ``__repr__`` raises.

    Why: a graph holds the user's constants as they are, and ``str(graph)``,
    ``print_tabular``, the HTML view and error messages all print them; one constant with a
    broken ``__repr__`` must not make the whole graph unprintable.

    Example::

        >>> class Foo:
        ...     def __repr__(self): raise RuntimeError
        >>> safe_repr([1]), safe_repr(Foo())
        ('[1]', '<unprintable Foo>')
    """
    try:
        return repr(value)
    except Exception:
        return unprintable(value)


def _safe_str(value: Any) -> str:
    try:
        return str(value)
    except Exception:
        return unprintable(value)


def describe_value(value: Any, limit: int = 40) -> str:
    """A short description of a value for an error message: ``None``, ``int (3)``,
    ``str ('x')``, ``Linear (Linear(in_features=2, ...)``; never raises.

    Args:
        value: the value the user passed.
        limit: the longest repr shown; longer ones (and multi-line ones) are cut with ``...``.
    """
    if value is None:
        return "None"
    text = safe_repr(value)
    first = text.split("\n", 1)[0]
    if len(first) > limit or first != text:
        first = first[: limit - 3] + "..."
    return f"{type(value).__name__} ({first})"


def as_args(a: Any, what: str) -> tuple:
    """``tuple(a)`` for a node's new ``args``; a TypeError naming ``what`` otherwise."""
    if isinstance(a, tuple):
        return a
    if not isinstance(a, (str, bytes)):
        try:
            return tuple(a)
        except TypeError:
            pass
    raise TypeError(f"{what} must be a tuple (or list) of arguments, not {describe_value(a)}; "
                    "wrap a single argument in a tuple: (value,)")


def as_kwargs(k: Any, what: str) -> dict:
    """``dict(k)`` for a node's new ``kwargs``; a TypeError naming ``what`` otherwise."""
    if isinstance(k, dict):
        return dict(k)
    try:
        out = dict(k)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a dict of keyword arguments, not "
                        f"{describe_value(k)}; e.g. {{'dim': 1}}, or {{}} for none") from None
    return out
