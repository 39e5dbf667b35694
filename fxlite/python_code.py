"""Python code generation: a Graph becomes the source of ``forward``.

Each node becomes one statement, and values are freed after their last use::

    import torch
    def forward(self, x):
        linear = self.linear(x);  x = None
        relu = torch.relu(linear);  linear = None
        return relu

Safety: the source holds only identifiers checked here and literals written here, so no
name, target, annotation or repr can inject code:

- a node name is used only if it is an identifier that shadows nothing (``self``,
  ``torch``, a builtin) and that Python's NFKC folding of identifiers leaves as it is
  (``ｓｅｌｆ`` would mean ``self``); any other is replaced by a fresh name in the code;
- an attribute, module path, method or keyword name that is not a plain identifier (or
  that Python would fold or mangle, ``ｗ``, ``__x``) becomes ``getattr(x, '...')`` (or
  ``**{'...': v}``) with the name as a literal;
- a function prints as a dotted path (``torch.relu``) only if every atom is an identifier
  and the path leads back to that very object;
- annotations are rebuilt from their parts (``typing.Optional[torch.Tensor]``);
- everything else (objects without a literal spelling, odd annotations) is bound as a
  global of the generated function, never pasted as text.

Arguments nested deeper than Python's parser allows are built in steps, through
temporaries (``_nested = (x,)``), so no depth of nesting overflows a stack.
"""

from __future__ import annotations

import builtins
import functools
import keyword
import linecache
import math
import operator
import re
import sys
import types
import typing
import unicodedata
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fxlite.node import Node

# A graph is typed Any here: fxlite.graph sits above this module (Graph.python_code calls
# generate, and Graph names its nodes with Namespace).
__all__ = ["RESERVED", "CodeGen", "Namespace", "PythonCode", "generate", "import_spelling",
           "is_ident"]

RESERVED = set(keyword.kwlist) | set(dir(builtins)) | {"self", "torch", "inf", "nan", "fxlite"}
"""Names no node, global or temporary may take: keywords, builtins and the names generated
code relies on."""
_NOT_IDENT = re.compile(r"[^0-9a-zA-Z_]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")
_SUFFIX = re.compile(r"^(.*)_(\d+)$")
_SPLIT: dict[str, tuple[str, int]] = {}

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
# Brackets one expression may nest before a temporary takes over (the parser allows 200).
_MAX_NESTING = 64


def is_ident(s: Any) -> bool:
    """An identifier Python reads as exactly ``s``: the parser folds identifiers with NFKC,
    so ``ｇｅｔａｔｔｒ`` in source means ``getattr`` and must not pass as a fresh name."""
    # type() and not isinstance(): a str subclass could override isidentifier().
    return type(s) is str and s.isidentifier() and not keyword.iskeyword(s) and (
        s.isascii() or unicodedata.normalize("NFKC", s) == s)


def _is_attr(s: Any) -> bool:
    """An identifier that may follow a dot, even in a class body (where ``__x`` is mangled)."""
    return is_ident(s) and not (s.startswith("__") and not s.endswith("__"))


def _is_var(s: Any) -> bool:
    """A name generated code may define: an identifier that shadows nothing."""
    return is_ident(s) and s not in RESERVED


class Namespace:
    """Hands out unique identifiers: ``add``, ``add_1``, ``add_2``...

    Every name is a valid Python identifier that is not in :data:`RESERVED`, so generated
    code can use it as it is: a Graph names its nodes with one, the code generator its
    globals and temporaries with another.
    """

    __slots__ = ("_used", "_next_suffix", "_cache")

    def __init__(self) -> None:
        self._used: set[str] = set()
        self._next_suffix: dict[str, int] = {}
        self._cache: dict[str, str] = {}

    def _sanitize(self, candidate: str) -> str:
        name = self._cache.get(candidate)
        if name is None:
            # NFKC first, as Python folds identifiers: "ｇｅｔａｔｔｒ" is "getattr" (reserved)
            folded = unicodedata.normalize("NFKC", candidate)
            name = _NOT_IDENT.sub("_", _CAMEL.sub(r"_\1", folded)).lower() or "_"
            if name[0].isdigit():
                name = "_" + name
            self._cache[candidate] = name
        return name

    def create_name(self, candidate: str) -> str:
        """A fresh name from ``candidate``: itself if free, else with a number (``add_1``)."""
        name = self._sanitize(candidate)
        if name not in self._used and name not in RESERVED:
            self._used.add(name)
            return name
        split = _SPLIT.get(name)
        if split is None:  # "add_12" -> ("add", 12); cached: the same hints recur constantly
            m = _SUFFIX.match(name)
            split = (m.group(1), int(m.group(2))) if m else (name, 1)
            if len(_SPLIT) > 100_000:
                _SPLIT.clear()
            _SPLIT[name] = split
        base, n = split
        n = max(n, self._next_suffix.get(base, 1))
        while f"{base}_{n}" in self._used:
            n += 1
        name = f"{base}_{n}"
        self._next_suffix[base] = n + 1
        self._used.add(name)
        return name

    def reserve(self, name: str) -> None:
        """Mark ``name`` as taken, as it is."""
        self._used.add(name)

    def release(self, name: str) -> None:
        """Make ``name`` free again (a node was renamed)."""
        self._used.discard(name)


def _plain(s: str) -> str:
    """The characters of ``s`` as an exact ``str`` (whose repr() cannot be overridden)."""
    return str.__str__(s)


def _safe_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = None
    return _plain(text) if isinstance(text, str) else f"<{type(obj).__name__} object>"


def import_spelling(obj: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` if ``from module import qualname`` gives back ``obj``, else None.

    Every atom of both is checked to be an identifier, so the pair can be written into a
    source file as it is.
    """
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (type(mod) is str and type(qual) is str and mod in sys.modules):
        return None
    if not all(is_ident(a) for a in mod.split(".")) or not all(_is_attr(a) for a in qual.split(".")):
        return None
    target: Any = sys.modules[mod]
    for atom in qual.split("."):
        target = getattr(target, atom, None)
    return (mod, qual) if target is obj else None


class _Unspellable(Exception):
    """An annotation needs a global that a stand-alone source file could not import."""


@dataclass
class PythonCode:
    """Generated source plus the globals it needs; ``compile()`` gives the function."""

    src: str
    globals: dict[str, Any] = field(default_factory=dict)

    def compile(self, filename: str = "<fxlite-forward>") -> Callable[..., Any]:
        """Execute the source and return the ``forward`` function it defines.

        The text is registered in ``linecache`` under ``filename``, so that tracebacks and
        pdb show generated lines, for as long as the function lives: recompiling or
        dropping a GraphModule drops its function and so releases its source (a 1k-node
        module's is about 50 kB).
        """
        entry = (len(self.src), None, self.src.splitlines(True), filename)
        linecache.cache[filename] = entry
        namespace = dict(self.globals)
        namespace["__builtins__"] = builtins
        exec(compile(self.src, filename, "exec"), namespace)
        # Out of its own globals: no cycle, so it dies with its last reference.
        fn = namespace.pop("forward")
        weakref.finalize(fn, _forget_source, filename, entry).atexit = False
        return fn


def _forget_source(filename: str, entry: tuple) -> None:
    """Drop ``filename`` from linecache if it still holds ``entry`` (a later compile under
    the same name keeps its own)."""
    if linecache.cache.get(filename) is entry:
        del linecache.cache[filename]


class _Emitter:
    """Turns values into Python expressions, binding globals for anything without a literal."""

    def __init__(self, graph: Any, root_module: str = "self", portable: bool = False) -> None:
        self.names = Namespace()
        self.names.reserve(root_module)
        # The name each node has in the code: its own, when that is a safe identifier.
        self.ref: dict[Node, str] = {}
        odd: list[Node] = []
        for n in graph.nodes:
            # In a class body (portable source), Python would mangle a name like __x.
            if _is_var(n.name) and n.name not in self.names._used and not (
                    portable and n.name.startswith("__")):
                self.names.reserve(n.name)
                self.ref[n] = n.name
            else:
                odd.append(n)
        for n in odd:
            hint = _plain(n.name) if isinstance(n.name, str) else "node"
            self.ref[n] = self.names.create_name(hint.lstrip("_") or "node")
        # No global may be named forward: the generated def would rebind it. (A local may.)
        self.names.reserve("forward")
        self.globals: dict[str, Any] = {}
        self._by_id: dict[int, str] = {}
        self._spelled: dict[int, str] = {}  # id(obj) -> qualified(obj); objects outlive this
        self.pre: list[str] = []  # statements that must run before the current one
        self.temps: list[str] = []  # the temporaries they define
        self.portable = portable  # annotations may bind only importable objects
        self._in_annotation = False

    def bind(self, hint: str, obj: Any) -> str:
        """A global name for ``obj``; the same object always gets the same name."""
        name = self._by_id.get(id(obj))
        if name is None:
            if self._in_annotation and self.portable and not isinstance(obj, types.ModuleType) \
                    and import_spelling(obj) is None:
                raise _Unspellable
            hint = _plain(hint)
            if isinstance(obj, types.ModuleType) and hint == obj.__name__ and is_ident(hint) \
                    and hint not in self.names._used:
                name = hint
                self.names.reserve(hint)
            elif is_ident(hint) and hint not in self.names._used and hint not in RESERVED:
                name = hint  # keep the user's spelling (CustomArgObject), as torch.fx does
                self.names.reserve(hint)
            else:
                name = self.names.create_name("_" + hint.lstrip("_") if hint.startswith("__") else hint)
            self.globals[name] = obj
            self._by_id[id(obj)] = name
        return name

    def node(self, n: Node) -> str:
        name = self.ref.get(n)
        if name is None:
            raise RuntimeError(f"codegen: an argument refers to node {n.name!r}, which is not in "
                               "this graph (graph.lint() reports such problems)")
        return name

    def qualified(self, obj: Any) -> str:
        """How to spell a function or class: ``torch.relu``, ``math.sqrt``, ``len``, or a global."""
        # Cached: resolving a dotted path costs several getattrs, once per node otherwise.
        text = self._spelled.get(id(obj))
        if text is None:
            text = self._qualify(obj)
            if text is not None:
                self._spelled[id(obj)] = text
            else:
                name = getattr(obj, "__name__", None)
                text = self.bind(name if isinstance(name, str) else type(obj).__name__, obj)
        return text

    def _qualify(self, obj: Any) -> str | None:
        if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            path = _torch_op_path(obj)  # torch.ops.aten.add.Tensor, as torch.fx prints it
            if path is not None and all(_is_attr(a) for a in path.split(".")):
                return self.bind("torch", torch) + path[len("torch"):]
        name = getattr(obj, "__name__", None)
        if not _is_attr(name):
            return None
        if getattr(builtins, name, None) is obj:
            return name
        mod = getattr(obj, "__module__", None)
        mod = {"_operator": "operator"}.get(mod, mod) if type(mod) is str else ""
        if not mod and getattr(torch.Tensor, name, None) is obj:
            return self.bind("torch", torch) + ".Tensor." + name  # torch.Tensor.view: no __module__
        top = mod.split(".")[0]
        if top in _NAMED_MODULES and top in sys.modules:
            qual = getattr(obj, "__qualname__", name)
            for path in (f"{mod}.{qual}", f"{mod}.{name}", f"{top}.{name}"):
                if all(_is_attr(a) for a in path.split(".")) and _resolves(path, obj):
                    root = self.bind(top, sys.modules[top])
                    return root + path[len(top):]
        return None

    # ------------------------------------------------------------------ values
    def expr(self, a: Any) -> str:
        """A Python expression for an argument value (nested ones are walked without recursion)."""
        if isinstance(a, Node):
            return self.node(a)
        if _children(a) is None:
            return self.leaf(a)
        # Post-order walk over an explicit stack: [value, its children, their (text, depth)].
        stack: list[tuple[Any, list, list]] = [(a, _children(a), [])]
        while True:
            value, kids, done = stack[-1]
            if len(done) < len(kids):
                kid = kids[len(done)]
                grandkids = None if isinstance(kid, Node) else _children(kid)
                if grandkids is None:
                    done.append((self.node(kid) if isinstance(kid, Node) else self.leaf(kid), 1))
                else:
                    stack.append((kid, grandkids, []))
                continue
            stack.pop()
            text = self._join(value, [t for t, _ in done])
            depth = 1 + max((d for _, d in done), default=0)
            if depth > _MAX_NESTING:
                name = self.names.create_name("_nested")
                self.pre.append(f"{name} = {text}")
                self.temps.append(name)
                text, depth = name, 1
            if not stack:
                return text
            stack[-1][2].append((text, depth))

    def _join(self, a: Any, parts: list[str]) -> str:
        t = type(a)
        if t is list:
            return "[" + ", ".join(parts) + "]"
        if t is dict:
            return "{" + ", ".join(f"{k}: {v}" for k, v in zip(parts[::2], parts[1::2])) + "}"
        if t is slice:
            return f"slice({', '.join(parts)})"
        if hasattr(a, "_fields"):  # a namedtuple
            return f"{self.qualified(t)}({', '.join(parts)})"
        if t is torch.Size:  # not a plain tuple: x.new_zeros(size) and torch.Size methods differ
            return f"{self.bind('torch', torch)}.Size([{', '.join(parts)}])"
        return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"

    def leaf(self, a: Any) -> str:
        """A Python expression for a value that holds no other values."""
        t = type(a)
        if a is ...:
            return "..."
        if t in (int, bool, str, bytes, type(None)):
            return repr(a)
        if t is float:
            return repr(a) if math.isfinite(a) else f"float('{a}')"
        if t is complex:
            return f"complex({self.leaf(a.real)}, {self.leaf(a.imag)})"
        if t in (torch.dtype, torch.memory_format, torch.layout):
            name = str(a).split(".")[-1]
            if _is_attr(name) and getattr(torch, name, None) is a:
                return f"{self.bind('torch', torch)}.{name}"
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
        return self.node(a) if isinstance(a, Node) else f"({self.expr(a)})"

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
        plain = {k: v for k, v in kwargs.items() if _is_attr(k)}
        parts += [f"{k} = {self.expr(v)}" for k, v in plain.items()]
        odd = {k: v for k, v in kwargs.items() if k not in plain}
        if odd:
            parts.append("**" + self.expr(odd))
        return ", ".join(parts)

    # ------------------------------------------------------------------ annotations
    def annotation(self, t: Any) -> str:
        """An annotation, rebuilt from its parts; unspellable parts become globals.

        With ``portable``, an annotation that would need a global that cannot be imported
        by name becomes a string annotation holding its repr.
        """
        self._in_annotation = True
        try:
            return self._annotation(t)
        except _Unspellable:
            return repr(_safe_repr(t))
        finally:
            self._in_annotation = False

    def _annotation(self, t: Any) -> str:
        if t is None or t is type(None):
            return "None"
        if t is ...:
            return "..."
        if isinstance(t, str):
            return repr(_plain(t))
        if type(t) is list:  # the parameter list of Callable[[int], str]
            return "[" + ", ".join(self._annotation(a) for a in t) + "]"
        if isinstance(t, type) and not isinstance(t, types.GenericAlias):
            return self.qualified(t)
        text = self._generic(t)
        return text if text is not None else self.bind("_annotation", t)

    def _generic(self, t: Any) -> str | None:
        """``list[int]``, ``int | None``, ``typing.Optional[X]``...; None if ``t`` is none of them."""
        origin, args = typing.get_origin(t), typing.get_args(t)
        try:
            if origin is None or not args:
                name = getattr(t, "_name", None)
                if _is_attr(name) and getattr(typing, name, None) is t:  # typing.Any, typing.List
                    return f"{self.bind('typing', typing)}.{name}"
                return None
            if isinstance(t, types.GenericAlias):
                if types.GenericAlias(origin, args) != t:
                    return None
                head = self._annotation(origin)
            elif isinstance(t, types.UnionType):
                if functools.reduce(operator.or_, args) != t:
                    return None
                return " | ".join(self._annotation(a) for a in args)
            elif origin is typing.Union and len(args) == 2 and type(None) in args:
                other = args[0] if args[1] is type(None) else args[1]
                return f"{self.bind('typing', typing)}.Optional[{self._annotation(other)}]"
            else:
                name = "Union" if origin is typing.Union else \
                    "Literal" if origin is typing.Literal else getattr(t, "_name", None)
                form = getattr(typing, name, None) if _is_attr(name) else None
                if form is None or form[args if len(args) > 1 else args[0]] != t:
                    return None
                head = f"{self.bind('typing', typing)}.{name}"
        except Exception:  # an alias that cannot be rebuilt from its parts, or compared
            return None
        part = self.leaf if origin is typing.Literal else self._annotation
        return f"{head}[{', '.join(part(a) for a in args)}]"


def _children(a: Any) -> list | None:
    """The values inside a container argument, or None for a value that is not one."""
    t = type(a)
    if t is list or isinstance(a, tuple):
        return list(a)
    if t is dict:
        return [x for kv in a.items() for x in kv]
    if t is slice:
        return [a.start, a.stop, a.step]
    return None


def _torch_op_path(op: Any) -> str | None:
    """``torch.ops.aten.add.Tensor`` for an op overload (or packet), if that path finds it."""
    if isinstance(op, torch._ops.OpOverload):
        namespace, _, name = op._schema.name.partition("::")
        path = f"torch.ops.{namespace}.{name}.{op._overloadname}"
    else:
        namespace, _, name = op._qualified_op_name.partition("::")
        path = f"torch.ops.{namespace}.{name}"
    ok = all(is_ident(atom) for atom in path.split(".")) and _resolves(path, op)
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
    for atom in _plain(path).split("."):
        expr = f"{expr}.{atom}" if _is_attr(atom) else f"getattr({expr}, {atom!r})"
    return expr


def _statement(node: Node, em: _Emitter, root: str) -> str:
    op, target, args, kwargs = node.op, node.target, node.args, node.kwargs
    if op == "get_attr":
        return attr_path(root, target)
    if op == "call_module":
        return f"{attr_path(root, target)}({em.call_args(args, kwargs)})"
    if op == "call_method":
        obj = em.receiver(args[0])
        fn = f"{obj}.{target}" if _is_attr(target) else f"getattr({obj}, {_plain(target)!r})"
        return f"{fn}({em.call_args(args[1:], kwargs)})"
    # call_function
    if not kwargs:
        if target in _INFIX and len(args) == 2:
            return f"{em.operand(args[0])} {_INFIX[target]} {em.operand(args[1])}"
        if target in _PREFIX and len(args) == 1:
            return f"{_PREFIX[target]}{em.operand(args[0])}"
        if target is operator.getitem and len(args) == 2:
            return f"{em.receiver(args[0])}[{em.index(args[1])}]"
        if target is builtins.getattr and len(args) == 2 and _is_attr(args[1]):
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
    target = em.node(node.args[0])
    return f"{target} {op} {em.operand(node.args[1])};  {em.ref[node]} = {target}"


class CodeGen:
    """The default signature and return of generated ``forward`` code; subclass to change them.

    Hooks (each optional to override):
        gen_fn_def(free_vars, maybe_return_annotation): the ``def`` line (and any lines that
            unpack inputs); ``free_vars`` are the placeholders as written in a signature
            (``x``, ``y : int = 2``, ``*args``), ``self`` not included.
        generate_output(output_args): the ``return`` statement for the output node's argument.
        additional_globals(): ``[(name, object)]`` the generated code may refer to.
        process_inputs(*args) / process_outputs(out): turn call arguments into placeholder
            values, and the output node's value into the result (used by ``Interpreter``).
    """

    _expr: Callable[[Any], str] = repr  # set by the code generator: spells an argument

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str) -> str:
        """``def forward(self, <free_vars>)<annotation>:``."""
        return f"def forward({', '.join(['self', *free_vars])}){maybe_return_annotation}:"

    def generate_output(self, output_args: Any) -> str:
        """``return <output_args>``."""
        return f"return {self._expr(output_args)}"

    def additional_globals(self) -> list[tuple[str, Any]]:
        """Extra ``(name, object)`` globals for the generated code."""
        return []

    def process_inputs(self, *args: Any) -> Any:
        """The placeholder values for a call with ``args``."""
        return args

    def process_outputs(self, outputs: Any) -> Any:
        """The result of a call whose output node produced ``outputs``."""
        return outputs


def generate(graph: Any, root_module: str = "self", *, portable: bool = False) -> PythonCode:
    """Generate ``def forward(self, ...)`` for ``graph``.

    Args:
        graph: the graph to print.
        root_module: the name of the module argument (``self``).
        portable: write annotations that would need a global that cannot be imported by
            name as strings, so that the source can stand alone (``to_folder``).

    Returns:
        The source and the globals it refers to.

    Example::

        code = generate(gm.graph)
        print(code.src)
        forward = code.compile()
    """
    if not _is_var(root_module) and root_module != "self":
        raise ValueError(f"root_module must be an identifier that shadows nothing, not {root_module!r}")
    em = _Emitter(graph, root_module, portable)
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
        if user.op != "output" and value in em.ref:
            to_free.setdefault(user, []).append(em.ref[value])
    # A value nothing reads dies where it is made, as torch.fx's code does: a recorded
    # ``dropout(x, training=False)`` is ``x`` itself, and held to the end of forward it
    # kept swin_t's activations alive (a peak three times eager's on an H200).
    for n in nodes:
        if not n.users and n.op not in ("placeholder", "output") and n in em.ref:
            to_free.setdefault(n, []).append(em.ref[n])

    hooks = getattr(graph, "_codegen", None)
    if type(hooks) is CodeGen:
        hooks = None  # the default: generate as below
    params: list[str] = []
    body: list[str] = []
    seen_default = seen_star = False
    returns = ""
    for n in nodes:
        if n.op == "placeholder":
            text = em.ref[n]
            if n.type is not None:
                text += f" : {em.annotation(n.type)}"
            if str(n.target).startswith("**"):
                text = "**" + text
            elif str(n.target).startswith("*"):
                text, seen_star = "*" + text, True
            elif n.args:
                default = em.expr(n.args[0])
                if em.pre:  # too deep to spell inline: a default holds no nodes, so bind it
                    em.pre.clear()
                    em.temps.clear()
                    default = em.bind("_default", n.args[0])
                text += f" = {default}"
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
                    line = hooks.generate_output(n.args[0])
                finally:
                    del hooks._expr
            else:
                line = f"return {em.expr(n.args[0])}"
        else:
            line = _inplace(n, em) or f"{em.ref[n]} = {_statement(n, em, root_module)}"
            freed = to_free.get(n, [])
            if em.temps or freed:
                line += f";  {' = '.join([*em.temps, *freed])} = None"
        body += em.pre
        body.append(line)
        em.pre.clear()
        em.temps.clear()
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
