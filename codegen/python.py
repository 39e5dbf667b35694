"""Python code generation: a Graph becomes the source of ``forward``.

Each node becomes one statement, and values are freed after their last use::

    import torch
    def forward(self, x):
        linear = self.linear(x);  x = None
        relu = torch.relu(linear);  linear = None
        return relu

Safety: node names are identifiers by construction; attribute and module paths that are
not plain identifiers are emitted as ``getattr(self, '...')`` with the name as a string
literal, so no module or attribute name can inject code. Objects that have no literal
spelling are bound as globals of the generated function, never pasted as text.
"""

from __future__ import annotations

import builtins
import keyword
import linecache
import math
import operator
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fxlite.graph import _RESERVED, Graph, _Namespace
from fxlite.node import Node

from .python_hooks import CodeGen

__all__ = ["PythonCode", "generate"]

_INFIX = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
    operator.lshift: "<<", operator.rshift: ">>", operator.and_: "&", operator.or_: "|",
    operator.xor: "^", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
    operator.le: "<=", operator.gt: ">", operator.ge: ">=",
}
_PREFIX = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}
# Modules whose functions print by their dotted name (torch.relu, math.sqrt).
_NAMED_MODULES = ("torch", "math", "operator", "builtins", "typing", "numpy")


def _is_ident(s: str) -> bool:
    return s.isidentifier() and not keyword.iskeyword(s)


@dataclass
class PythonCode:
    """Generated source plus the globals it needs; ``compile()`` gives the function."""

    src: str
    globals: dict[str, Any] = field(default_factory=dict)

    def compile(self, filename: str = "<fxlite-forward>") -> Callable[..., Any]:
        """Execute the source and return the ``forward`` function it defines."""
        # Register the text so tracebacks and pdb can show generated lines.
        linecache.cache[filename] = (len(self.src), None, self.src.splitlines(True), filename)
        namespace = dict(self.globals)
        namespace["__builtins__"] = builtins
        exec(compile(self.src, filename, "exec"), namespace)
        return namespace["forward"]


class _Emitter:
    """Turns values into Python expressions, binding globals for anything without a literal."""

    def __init__(self, graph: Graph) -> None:
        self.names = _Namespace()
        for n in graph.nodes:
            self.names.reserve(n.name)
        self.globals: dict[str, Any] = {}
        self._by_id: dict[int, str] = {}
        self._spelled: dict[int, str] = {}  # id(obj) -> qualified(obj); objects outlive this

    def bind(self, hint: str, obj: Any) -> str:
        """A global name for ``obj``; the same object always gets the same name."""
        name = self._by_id.get(id(obj))
        if name is None:
            if isinstance(obj, types.ModuleType) and hint == obj.__name__ and _is_ident(hint) \
                    and hint not in self.names._used:
                name = hint
                self.names.reserve(hint)
            elif _is_ident(hint) and hint not in self.names._used and hint not in _RESERVED:
                name = hint  # keep the user's spelling (CustomArgObject), as torch.fx does
                self.names.reserve(hint)
            else:
                name = self.names.create_name(hint)
            self.globals[name] = obj
            self._by_id[id(obj)] = name
        return name

    def qualified(self, obj: Any) -> str:
        """How to spell a function or class: ``torch.relu``, ``math.sqrt``, ``len``, or a global."""
        # Cached: resolving a dotted path costs several getattrs, once per node otherwise.
        text = self._spelled.get(id(obj))
        if text is None:
            text = self._spelled[id(obj)] = self._qualify(obj)
        return text

    def _qualify(self, obj: Any) -> str:
        if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            path = _torch_op_path(obj)  # torch.ops.aten.add.Tensor, as torch.fx prints it
            if path is not None:
                return self.bind("torch", torch) + path[len("torch"):]
        name = getattr(obj, "__name__", None)
        if isinstance(name, str) and getattr(builtins, name, None) is obj:
            return name
        mod = getattr(obj, "__module__", None) or ""
        mod = {"_operator": "operator"}.get(mod, mod)
        if not mod and isinstance(name, str) and getattr(torch.Tensor, name, None) is obj:
            return self.bind("torch", torch) + ".Tensor." + name  # torch.Tensor.view: no __module__
        top = mod.split(".")[0]
        if top in _NAMED_MODULES and top in sys.modules and isinstance(name, str):
            qual = getattr(obj, "__qualname__", name)
            for path in (f"{mod}.{qual}", f"{mod}.{name}", f"{top}.{name}"):
                if _resolves(path, obj):
                    root = self.bind(top, sys.modules[top])
                    return root + path[len(top):]
        return self.bind(name if isinstance(name, str) else type(obj).__name__, obj)

    def expr(self, a: Any) -> str:
        """A Python expression for an argument value."""
        if isinstance(a, Node):
            return a.name
        t = type(a)
        if t is tuple or (isinstance(a, tuple) and not hasattr(a, "_fields")):
            inner = ", ".join(self.expr(x) for x in a)
            return f"({inner},)" if len(a) == 1 else f"({inner})"
        if isinstance(a, tuple):
            return f"{self.qualified(t)}({', '.join(self.expr(x) for x in a)})"
        if t is list:
            return "[" + ", ".join(self.expr(x) for x in a) + "]"
        if t is dict:
            return "{" + ", ".join(f"{self.expr(k)}: {self.expr(v)}" for k, v in a.items()) + "}"
        if t is slice:
            return f"slice({self.expr(a.start)}, {self.expr(a.stop)}, {self.expr(a.step)})"
        if a is ...:
            return "..."
        if t in (int, bool, str, bytes, type(None)):
            return repr(a)
        if t is float:
            return repr(a) if math.isfinite(a) else f"float('{a}')"
        if t is complex:
            return f"complex({self.expr(a.real)}, {self.expr(a.imag)})"
        if t in (torch.dtype, torch.memory_format, torch.layout):
            return f"{self.bind('torch', torch)}.{str(a).split('.')[-1]}"
        if t is torch.device:
            return f"{self.bind('torch', torch)}.device({str(a)!r})"
        if isinstance(a, (types.FunctionType, types.BuiltinFunctionType, type)):
            return self.qualified(a)
        return self.bind(f"_{t.__name__}_constant", a)

    def operand(self, a: Any) -> str:
        # Infix operands: parenthesize anything that is not a name or a plain literal.
        text = self.expr(a)
        return text if isinstance(a, Node) or not text.startswith("-") and (
            text.isidentifier() or text.replace(".", "").isalnum()) else f"({text})"

    def receiver(self, a: Any) -> str:
        # The object of `.attr`, `.method()` or `[...]`: parenthesize anything but a name.
        return a.name if isinstance(a, Node) else f"({self.expr(a)})"

    def index(self, idx: Any) -> str:
        """Subscript text: ``x[:, 0]``, ``x[..., None]``, ``x[1:3]``."""
        if type(idx) is tuple:
            parts = [self.index_part(i) for i in idx]
            return ", ".join(parts) + ("," if len(parts) == 1 else "") if parts else "()"
        return self.index_part(idx)

    def index_part(self, i: Any) -> str:
        if type(i) is slice:
            s = lambda v: "" if v is None else self.expr(v)
            text = f"{s(i.start)}:{s(i.stop)}"
            return text + (f":{s(i.step)}" if i.step is not None else "")
        return self.expr(i)

    def call_args(self, args: tuple, kwargs: dict) -> str:
        parts = [self.expr(a) for a in args]
        plain = {k: v for k, v in kwargs.items() if _is_ident(k)}
        parts += [f"{k} = {self.expr(v)}" for k, v in plain.items()]
        odd = {k: v for k, v in kwargs.items() if k not in plain}
        if odd:
            parts.append("**" + self.expr(odd))
        return ", ".join(parts)

    def annotation(self, t: Any) -> str:
        if isinstance(t, str):
            return repr(t)
        if isinstance(t, types.GenericAlias):  # list[int], tuple[torch.Tensor, ...]
            inner = ", ".join("..." if a is Ellipsis else self.annotation(a) for a in t.__args__)
            return f"{self.annotation(t.__origin__)}[{inner}]"
        if isinstance(t, type):
            return self.qualified(t)
        text = repr(t)
        if text.startswith("typing."):
            self.bind("typing", sys.modules["typing"])
            return text
        return self.bind("_annotation", t)


def _torch_op_path(op: Any) -> str | None:
    """``torch.ops.aten.add.Tensor`` for an op overload (or packet), if that path finds it."""
    if isinstance(op, torch._ops.OpOverload):
        namespace, _, name = op._schema.name.partition("::")
        path = f"torch.ops.{namespace}.{name}.{op._overloadname}"
    else:
        namespace, _, name = op._qualified_op_name.partition("::")
        path = f"torch.ops.{namespace}.{name}"
    ok = all(_is_ident(atom) for atom in path.split(".")) and _resolves(path, op)
    return path if ok else None


def _resolves(path: str, obj: Any) -> bool:
    parts = path.split(".")
    cur: Any = sys.modules.get(parts[0])
    for p in parts[1:]:
        cur = getattr(cur, p, None)
        if cur is None:
            return False
    return cur is obj


def attr_path(base: str, path: str) -> str:
    """``self.a.b`` for a dotted path, with ``getattr(x, '...')`` for atoms that are not identifiers."""
    expr = base
    for atom in path.split("."):
        expr = f"{expr}.{atom}" if _is_ident(atom) else f"getattr({expr}, {atom!r})"
    return expr


def _statement(node: Node, em: _Emitter, root: str) -> str:
    op, target, args, kwargs = node.op, node.target, node.args, node.kwargs
    if op == "get_attr":
        return attr_path(root, target)
    if op == "call_module":
        return f"{attr_path(root, target)}({em.call_args(args, kwargs)})"
    if op == "call_method":
        obj = em.receiver(args[0])
        fn = f"{obj}.{target}" if _is_ident(target) else f"getattr({obj}, {target!r})"
        return f"{fn}({em.call_args(args[1:], kwargs)})"
    # call_function
    if not kwargs:
        if target in _INFIX and len(args) == 2:
            return f"{em.operand(args[0])} {_INFIX[target]} {em.operand(args[1])}"
        if target in _PREFIX and len(args) == 1:
            return f"{_PREFIX[target]}{em.operand(args[0])}"
        if target is operator.getitem and len(args) == 2:
            return f"{em.receiver(args[0])}[{em.index(args[1])}]"
        if target is builtins.getattr and len(args) == 2 and isinstance(args[1], str) \
                and _is_ident(args[1]):
            return f"{em.receiver(args[0])}.{args[1]}"
    return f"{em.qualified(target)}({em.call_args(args, kwargs)})"


_INPLACE = {
    operator.iadd: "+=", operator.isub: "-=", operator.imul: "*=", operator.itruediv: "/=",
    operator.ifloordiv: "//=", operator.imod: "%=", operator.ipow: "**=", operator.imatmul: "@=",
    operator.ilshift: "<<=", operator.irshift: ">>=", operator.iand: "&=", operator.ior: "|=",
    operator.ixor: "^=",
}


def _inplace(node: Node, em: _Emitter) -> str | None:
    """``a *= b;  imul = a`` for an in-place operator on a value held in a variable.

    Why not ``imul = operator.imul(a, b)``: for immutable values (ints) that leaves ``a``
    unchanged, so code that returns ``a`` would return the old value.
    """
    if node.op != "call_function" or node.kwargs or len(node.args) != 2 \
            or not isinstance(node.args[0], Node):
        return None
    try:
        op = _INPLACE.get(node.target)  # type: ignore[call-overload]
    except TypeError:  # an unhashable target
        return None
    if op is None:
        return None
    target = node.args[0].name
    return f"{target} {op} {em.operand(node.args[1])};  {node.name} = {target}"


def generate(graph: Graph, root_module: str = "self") -> PythonCode:
    """Generate ``def forward(self, ...)`` for ``graph``.

    Args:
        graph: the graph to print.
        root_module: the name of the module argument (``self``).

    Returns:
        The source and the globals it refers to.

    Example::

        code = generate(gm.graph)
        print(code.src)
        forward = code.compile()
    """
    em = _Emitter(graph)
    nodes = list(graph.nodes)
    # Free each value right after its last use, so memory peaks as it would in eager code.
    last_use: dict[Node, Node] = {}
    for n in nodes:
        for inp in n._input_nodes:
            last_use[inp] = n
            if inp.graph is not graph:
                raise RuntimeError(f"node {n.name!r} reads {inp.name!r}, which does not belong to "
                                   "this Graph; map copied nodes' inputs (graph.node_copy(n, "
                                   "arg_transform)) before generating code")
    to_free: dict[Node, list[str]] = {}
    for value, user in last_use.items():
        if user.op != "output":
            to_free.setdefault(user, []).append(value.name)

    hooks = getattr(graph, "_codegen", None)
    if type(hooks) is CodeGen:
        hooks = None  # the default: generate as below
    params: list[str] = []
    body: list[str] = []
    seen_default = seen_star = False
    returns = ""
    for n in nodes:
        if n.op == "placeholder":
            text = n.name
            if n.type is not None:
                text += f" : {em.annotation(n.type)}"
            if str(n.target).startswith("**"):
                text = "**" + text
            elif str(n.target).startswith("*"):
                text, seen_star = "*" + text, True
            elif n.args:
                text += f" = {em.expr(n.args[0])}"
                seen_default = True
            elif seen_default and not seen_star:
                params.append("*")
                seen_star = True
            params.append(text)
            continue
        if n.op == "output":
            if n.type is not None:
                returns = f" -> {em.annotation(n.type)}"
            if hooks is not None:
                hooks._expr = em.expr  # for the duration of this call only (see below)
                try:
                    body.append(hooks.generate_output(n.args[0]))
                finally:
                    del hooks._expr
            else:
                body.append(f"return {em.expr(n.args[0])}")
            continue
        line = _inplace(n, em) or f"{n.name} = {_statement(n, em, root_module)}"
        freed = to_free.get(n)
        if freed:
            line += f";  {' = '.join(freed)} = None"
        body.append(line)
    if not body or not body[-1].startswith("return"):
        body.append("return None")
    imports = [f"import {name}" for name, v in em.globals.items()
               if isinstance(v, types.ModuleType) and name == v.__name__]
    if hooks is not None:
        free = [p for p in params if p != "*"]
        header = hooks.gen_fn_def(free, returns)
        for name, obj in hooks.additional_globals():
            if name in em.names._used and em.globals.get(name) is not obj:
                raise RuntimeError(f"{type(hooks).__name__}.additional_globals() names {name!r}, "
                                   "which the generated code already uses")
            em.globals[name] = obj
    else:
        header = f"def forward({', '.join([root_module, *params])}){returns}:"
    src = "\n".join([*imports, header, *("    " + b for b in body)]) + "\n"
    return PythonCode(src, em.globals)
