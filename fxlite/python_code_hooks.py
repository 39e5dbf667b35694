"""Hooks that change the signature and the return of generated ``forward`` code.

A :class:`CodeGen` set on a graph (``graph.set_codegen(cg)``) decides how ``forward``
receives its inputs and returns its outputs, as in torch.fx. The body, one statement per
node, is generated as usual. For example, a forward that takes one list::

    class ListCodeGen(CodeGen):
        def gen_fn_def(self, free_vars, maybe_return_annotation):
            return (f"def forward(self, args_list){maybe_return_annotation}:\\n"
                    f"    {', '.join(free_vars)} = args_list")

        def process_inputs(self, *inputs):       # for Interpreter.run and graph.process_inputs
            return inputs[0]

    gm.graph.set_codegen(ListCodeGen()); gm.recompile(); gm([x, y])

:class:`PyTreeCodeGen` is the one ``symbolic_trace`` installs when ``concrete_args`` fixed
a structure (``{"x": [PH, PH]}``): ``forward(self, x)`` flattens ``x`` with
:func:`tree_flatten_spec` into one placeholder per leaf, and rebuilds the output.
"""

from __future__ import annotations

import collections
from typing import Any

import torch.utils._pytree as pytree

from fxlite.proxy import Proxy
from fxlite.python_code import CodeGen

# CodeGen, the base class, is defined with the code generator that calls it (which sits
# below fxlite.graph); it is exported here too, where torch.fx users look for it.
__all__ = ["CodeGen", "PyTreeCodeGen", "tree_flatten_spec"]


def _children(spec: Any) -> list[Any]:
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)


def tree_flatten_spec(value: Any, spec: Any) -> list[Any]:
    """The leaves of ``value``, read in the order of the pytree ``spec``.

    Works on traced values too (it only indexes), which is why generated code uses it.
    Raises TypeError naming the mismatch when a real value does not have ``spec``'s shape.
    """
    if spec.is_leaf():
        return [value]
    t, children = spec.type, _children(spec)
    traced = isinstance(value, Proxy)
    if t is collections.namedtuple or (isinstance(t, type) and issubclass(t, (list, tuple))):
        if not traced and (not isinstance(value, (list, tuple)) or len(value) != len(children)):
            raise TypeError(f"expected a sequence of {len(children)} items, as traced, "
                            f"got {type(value).__name__} {value!r}")
        items = [value[i] for i in range(len(children))]
    elif isinstance(t, type) and issubclass(t, dict):
        keys = list(spec.context)
        if not traced and (not isinstance(value, dict) or set(value) != set(keys)):
            raise TypeError(f"expected a dict with keys {keys}, as traced, got {value!r}")
        items = [value[k] for k in keys]
    else:
        node = pytree.SUPPORTED_NODES.get(t)
        if node is None:
            raise TypeError(f"no pytree flattening is registered for {t.__name__}")
        if not traced and not isinstance(value, t):
            raise TypeError(f"expected a {t.__name__}, as traced, got {type(value).__name__}")
        items = list(node.flatten_fn(value)[0])
    return [leaf for item, child in zip(items, children) for leaf in tree_flatten_spec(item, child)]


class PyTreeCodeGen(CodeGen):
    """``forward`` takes the original arguments and flattens them into the placeholders;
    the flat outputs are rebuilt into the original structure.

    Args:
        orig_args: the traced function's parameter names (``*args`` style for star ones).
        in_spec: the pytree spec of the tuple of arguments.
        out_spec: the pytree spec of the result, or None to return the flat outputs.
    """

    def __init__(self, orig_args: list[str], in_spec: Any, out_spec: Any = None) -> None:
        self.orig_args = list(orig_args)
        self.in_spec = in_spec
        self.out_spec = out_spec

    def __deepcopy__(self, memo: dict) -> PyTreeCodeGen:
        return PyTreeCodeGen(self.orig_args, self.in_spec, self.out_spec)  # specs are immutable

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str) -> str:
        head = super().gen_fn_def(self.orig_args, maybe_return_annotation)
        names = [v.split(":")[0].split("=")[0].strip().lstrip("*") for v in free_vars]
        if not names:
            return head
        values = ", ".join(a.lstrip("*") for a in self.orig_args)
        return f"{head}\n    {', '.join(names)}, = tree_flatten_spec(({values},), _in_spec)"

    def generate_output(self, output_args: Any) -> str:
        if self.out_spec is None:
            return super().generate_output(output_args)
        return f"return tree_unflatten({self._expr(output_args)}, _out_spec)"

    def additional_globals(self) -> list[tuple[str, Any]]:
        return [("tree_flatten_spec", tree_flatten_spec), ("tree_unflatten", pytree.tree_unflatten),
                ("_in_spec", self.in_spec), ("_out_spec", self.out_spec)]

    def process_inputs(self, *args: Any) -> Any:
        return tree_flatten_spec(args, self.in_spec)

    def process_outputs(self, outputs: Any) -> Any:
        if self.out_spec is None:
            return outputs
        return pytree.tree_unflatten(outputs, self.out_spec)
