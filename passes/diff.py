"""diff(before, after): the nodes a pass or rewrite added, removed or changed.

Nodes are matched by name (passes keep the names of the nodes they do not touch), and a
node is *changed* when its op, target, arguments or keyword arguments differ. Each node
prints as one statement, targets by qualified name::

    >>> before = fxlite.symbolic_trace(model)
    >>> after = copy.deepcopy(before); relu_to_gelu(after)
    >>> fxlite.passes.diff(before, after)
    1 added, 1 removed, 1 changed
    - relu = torch.relu(fc1)
    + gelu = torch.nn.functional.gelu(fc1)
    ~ fc2 = self.fc2(relu)  ->  self.fc2(gelu)

A pass that edits a module in place leaves nothing to compare with: diff a
``copy.deepcopy`` taken before it (``PassManager(show_diff=True)`` does this for you).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fxlite.graph import Graph
from fxlite.node import Node, describe_value, format_arg
from fxlite.viz.tabular import qualified_name

__all__ = ["GraphDiff", "diff", "describe_node"]


def describe_node(node: Node) -> str:
    """A node as one line of pseudo-code, without its name: ``torch.relu(fc1)``.

    Example::

        >>> describe_node(gm.graph.find_nodes(op="call_module")[0])
        'self.fc1(x)'
    """
    op, target = node.op, node.target
    args = format_arg(node.args, prefix="")
    inner = args[1:-1].rstrip(",")
    kwargs = ", ".join(f"{k}={format_arg(v, prefix='')}" for k, v in node.kwargs.items())
    call = ", ".join(p for p in (inner, kwargs) if p)
    if op == "placeholder":
        return "placeholder"
    if op == "get_attr":
        return f"self.{target}"
    if op == "call_module":
        return f"self.{target}({call})"
    if op == "call_method":
        receiver = format_arg(node.args[0], prefix="") if node.args else "?"
        rest = format_arg(node.args[1:], prefix="")[1:-1].rstrip(",")
        parts = ", ".join(p for p in (rest, kwargs) if p)
        return f"{receiver}.{target}({parts})"
    if op == "output":
        return f"return {format_arg(node.args[0], prefix='')}" if node.args else "return"
    return f"{qualified_name(target)}({call})"


@dataclass
class GraphDiff:
    """What changed between two graphs.

    Attributes:
        added: ``(name, statement)`` of the nodes only ``after`` has, in its order.
        removed: ``(name, statement)`` of the nodes only ``before`` has, in its order.
        changed: ``(name, old statement, new statement)``, in ``after``'s order.
    """

    added: list[tuple[str, str]] = field(default_factory=list)
    removed: list[tuple[str, str]] = field(default_factory=list)
    changed: list[tuple[str, str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def format(self, width: int | None = 100) -> str:
        """The diff as text: a count line, then ``-``, ``+`` and ``~`` lines.

        Args:
            width: cut longer lines to this many characters (None: never).
        """
        lines = [f"{len(self.added)} added, {len(self.removed)} removed, "
                 f"{len(self.changed)} changed"]
        lines += [f"- {name} = {text}" for name, text in self.removed]
        lines += [f"+ {name} = {text}" for name, text in self.added]
        lines += [f"~ {name} = {old}  ->  {new}" for name, old, new in self.changed]
        if width is not None:
            lines = [line if len(line) <= width else line[: width - 3] + "..." for line in lines]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    __repr__ = __str__  # a notebook cell ending in diff(...) shows the text


def _graph(obj: Any, argument: str) -> Graph:
    graph = getattr(obj, "graph", obj)
    if not isinstance(graph, Graph):
        raise TypeError(f"diff expects fxlite Graphs or GraphModules, not {type(obj).__name__}: "
                        f"{argument} is {describe_value(obj)}")
    return graph


def diff(before: Any, after: Any, print_output: bool = True) -> GraphDiff:
    """Compare two graphs node by node (matched by name) and print what changed.

    Args:
        before: the Graph or GraphModule before the change.
        after: the Graph or GraphModule after it (a different object: diff a deepcopy).
        print_output: print the diff (100 columns wide) as well as returning it.

    Returns:
        The :class:`GraphDiff`; falsy when nothing changed.

    Example::

        before = copy.deepcopy(gm)
        fxlite.replace_pattern(gm, pattern, replacement)
        fxlite.passes.diff(before, gm)
    """
    old_graph, new_graph = _graph(before, "before"), _graph(after, "after")
    old = {n.name: describe_node(n) for n in old_graph.nodes}
    new = {n.name: describe_node(n) for n in new_graph.nodes}
    result = GraphDiff(
        added=[(name, text) for name, text in new.items() if name not in old],
        removed=[(name, text) for name, text in old.items() if name not in new],
        changed=[(name, old[name], text) for name, text in new.items()
                 if name in old and old[name] != text])
    if print_output:
        print(result.format())
    return result
