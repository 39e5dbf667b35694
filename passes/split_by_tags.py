"""split_by_tags: cut a GraphModule into one submodule per tag, as torch.fx's split_utils does.

Each computing node carries a ``tag`` attribute (``node.tag = "gpu"``); placeholders,
``get_attr`` nodes and the output need none. The result calls one submodule per tag,
named after the tag, in the order of ``tags``::

    before (tags "a", "b")                    after split_by_tags(gm, ["a", "b"])
        add (a) -> relu (a) -> mul (b)            x -> a(x) -> b(relu) -> out

A node may read values of its own tag or of earlier tags only, so the submodules run one
after another in ``tags`` order.
"""

from __future__ import annotations

import operator

from fxlite.graph_module import GraphModule, expect_graph_module
from fxlite.node import Node, describe_value

from .split_module import split_module

__all__ = ["split_by_tags"]


def split_by_tags(gm: GraphModule, tags: list[str], return_fqn_mapping: bool = False,
                  return_tuple: bool = False) -> GraphModule | tuple[GraphModule, dict[str, str]]:
    """Split ``gm`` into submodules named after the ``tag`` of their nodes.

    Args:
        gm: the module to split; every node but placeholders, ``get_attr`` nodes and the
            output has a ``tag`` attribute whose value is in ``tags``.
        tags: the tags, in the order their submodules run.
        return_fqn_mapping: also return ``{new qualified name: original name}`` for the
            modules and attributes copied into the submodules.
        return_tuple: make every submodule return a tuple, even of one value.

    Returns:
        The split GraphModule (and the name mapping if asked). ``gm`` is not changed.

    Raises:
        ValueError: a node has no tag or an unknown one, or reads a value of a later tag.

    Example::

        for n in gm.graph.nodes:
            n.tag = "pre" if n.name in ("x", "add") else "post"
        split = split_by_tags(gm, ["pre", "post"])
        print(split.code)   # pre = self.pre(x);  post = self.post(pre) ...
    """
    expect_graph_module(gm, "split_by_tags")
    if isinstance(tags, (str, bytes)) or not isinstance(tags, (list, tuple)):
        raise TypeError(f"split_by_tags: tags must be a list of tag names, not "
                        f"{describe_value(tags)}; e.g. tags=['pre', 'post']")
    order = {t: i for i, t in enumerate(tags)}
    if len(order) != len(tags):
        raise ValueError(f"tags must be distinct, got {tags}")
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        tag = getattr(n, "tag", None)
        if tag not in order:
            raise ValueError(f"node {n.name!r} has tag {tag!r}, which is not one of {tags}; set "
                             f"node.tag on every node but placeholders, get_attr and output")
        for inp in n.all_input_nodes:
            if inp.op not in ("placeholder", "get_attr") and order[inp.tag] > order[tag]:
                raise ValueError(f"node {n.name!r} (tag {tag!r}) reads {inp.name!r}, whose tag "
                                 f"{inp.tag!r} comes later in {tags}: tags must follow the "
                                 "data flow")
    mapping: dict[str, str] = {}
    split = split_module(gm, gm, lambda n: order[n.tag], qualname_map=mapping)
    renames = {f"submod_{order[t]}": t for t in tags}
    for n in list(split.graph.nodes):
        if n.op == "call_module" and n.target in renames:
            sub = split.get_submodule(n.target)
            split.delete_submodule(n.target)
            n.target = renames[n.target]
            n._rename(n.target)
            split.add_submodule(n.target, sub)
            if return_tuple:
                _as_tuple(split, n, sub)
    split.graph.lint()
    split.recompile()
    if not return_fqn_mapping:
        return split
    fqn = {}
    for key, original in mapping.items():
        head, _, rest = key.partition(".")
        fqn[f"{renames.get(head, head)}.{rest}"] = original
    return split, fqn


def _as_tuple(split: GraphModule, call: Node, sub: GraphModule) -> None:
    """Make ``sub`` return a 1-tuple where it returned one value, and read it back."""
    out = sub.graph.output_node()
    if isinstance(out.args[0], tuple):
        return
    out.args = ((out.args[0],),)
    sub.recompile()
    with split.graph.inserting_after(call):
        first = split.graph.call_function(operator.getitem, (call, 0))
    call.replace_all_uses_with(first, delete_user_cb=lambda u: u is not first)
    first.meta.update(call.meta)
