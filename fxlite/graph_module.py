"""GraphModule: an ``nn.Module`` whose ``forward`` is generated from a Graph.

It holds only the parameters, buffers and submodules its graph refers to, and regenerates
``forward`` from the graph on :meth:`GraphModule.recompile` (and whenever ``graph`` is
assigned). Each instance has its own class, so recompiling one never affects another.
"""

from __future__ import annotations

import copy
import itertools
import linecache
import os
import re
import sys
import types
from typing import Any

import torch

from fxlite.python_code import PythonCode, generate, import_spelling, is_ident

from .graph import Graph, gc_paused
from .node import describe_value

__all__ = ["GraphModule", "attr_at", "copy_attr", "expect_graph_module", "expect_graph_or_module"]

_counter = itertools.count()


def _split(target: str) -> tuple[str, str]:
    prefix, _, name = target.rpartition(".")
    return prefix, name


_MISSING = object()


def _child(obj: Any, atom: str) -> Any:
    """``getattr(obj, atom)``, or _MISSING. Reads a module's own dicts first: for a missing
    name, ``nn.Module.__getattr__`` builds an error message, which made copying the
    attributes of a large model's graph a large part of tracing it."""
    if isinstance(obj, torch.nn.Module):
        d = obj.__dict__
        if atom in d:
            return d[atom]
        for store in ("_parameters", "_buffers", "_modules"):
            table = d.get(store)
            if table is not None and atom in table:
                return table[atom]
    return getattr(obj, atom, _MISSING)


def attr_at(obj: Any, target: str, what: str) -> Any:
    """The attribute at the dotted path ``target`` of ``obj`` (``obj`` itself for "");
    a RuntimeError naming ``what`` and the first missing part otherwise."""
    for i, atom in enumerate(target.split(".") if target else []):
        nxt = _child(obj, atom)
        if nxt is _MISSING:
            where = ".".join(target.split(".")[:i]) or "the root"
            raise RuntimeError(f"{what}: {where} has no attribute {atom!r} (looking up {target!r})")
        obj = nxt
    return obj


def copy_attr(src: torch.nn.Module, dst: torch.nn.Module, target: str, what: str) -> None:
    """Copy ``src.<target>`` to ``dst``, creating empty parent modules as needed."""
    prefix, name = _split(target)
    src_parent = attr_at(src, prefix, what)
    value = attr_at(src_parent, name, what) if prefix else attr_at(src, name, what)
    for atom in prefix.split(".") if prefix else []:
        nxt = _child(dst, atom)
        if nxt is _MISSING:
            nxt = torch.nn.Module()
            _put(dst, "_modules", atom, nxt)
        dst = nxt
    if isinstance(value, torch.nn.Module):
        _put(dst, "_modules", name, value)
    elif isinstance(value, torch.nn.Parameter):
        _put(dst, "_parameters", name, value)
    elif isinstance(src_parent, torch.nn.Module) and name in src_parent._buffers:
        _put(dst, "_buffers", name, value)
        if name in src_parent._non_persistent_buffers_set:
            dst._non_persistent_buffers_set.add(name)
    else:
        setattr(dst, name, value)


def _put(dst: Any, store: str, name: str, value: Any) -> None:
    """``dst.add_module`` / ``register_parameter`` / ``register_buffer`` for a fresh name.

    Why not those methods: each first asks ``hasattr(dst, name)``, and a miss goes through
    ``nn.Module.__getattr__``, which costs tens of microseconds in recent torch; GraphModule
    construction adds one entry per graph target."""
    d = dst.__dict__
    if isinstance(dst, torch.nn.Module) and "." not in name and not hasattr(type(dst), name) \
            and name not in d and all(name not in d[t] for t in ("_parameters", "_buffers", "_modules")):
        d[store][name] = value
    elif store == "_modules":
        dst.add_module(name, value)
    elif store == "_parameters":
        dst.register_parameter(name, value)
    else:
        dst.register_buffer(name, value)


class GraphModule(torch.nn.Module):
    """A module that runs a Graph.

    Args:
        root: the module (or ``{path: value}`` dict) that ``get_attr`` and ``call_module``
            nodes refer to. Only the referenced values are copied; a missing one raises
            RuntimeError naming it.
        graph: the graph to run.
        class_name: the name shown for this module's class.

    Raises:
        TypeError: an argument of the wrong type, named in the message, before anything is
            built (for ``root``, a :class:`RootTypeError`, which is also the RuntimeError
            torch.fx raises there).

    Example::

        graph = fxlite.Tracer().trace(model)
        gm = fxlite.GraphModule(model, graph)
        print(gm.code)
    """

    # torch.jit.script(gm) compiles forward; these Python-only properties are left out.
    __jit_unused_properties__ = ["graph", "code"]

    def __new__(cls, *args: Any, **kwargs: Any) -> GraphModule:
        # A class per instance: forward is installed on it by recompile().
        base = next(c for c in cls.__mro__ if c.__name__ != "GraphModuleImpl")

        class GraphModuleImpl(base):  # type: ignore[valid-type, misc]
            pass

        return super().__new__(GraphModuleImpl)

    def __init__(self, root: torch.nn.Module | dict[str, Any], graph: Graph,
                 class_name: str = "GraphModule") -> None:
        if not isinstance(root, (torch.nn.Module, dict)):
            raise RootTypeError(f"GraphModule: root must be an nn.Module or a dict, not "
                                f"{describe_value(root)}; pass the module the graph was traced "
                                "from (tracer.root), or {} for a graph without attributes")
        if not isinstance(graph, Graph):
            raise TypeError(f"GraphModule: graph must be a fxlite.Graph, not {describe_value(graph)}"
                            + _graph_hint(graph))
        if not isinstance(class_name, str):
            raise TypeError(f"GraphModule: class_name must be a str, not {describe_value(class_name)}")
        super().__init__()
        # Free-form, as torch.fx's GraphModule.meta. Not annotated: torch.jit.script reads
        # annotations in __init__ and rejects this one.
        self.meta = {}
        type(self).__name__ = class_name
        type(self).__qualname__ = class_name
        targets = dict.fromkeys(n.target for n in graph.nodes if n.op in ("get_attr", "call_module"))
        if isinstance(root, torch.nn.Module):
            self.training = root.training
            for target in targets:
                copy_attr(root, self, target, f"the graph refers to {target!r}")
        else:  # a dict {path: value}
            for target in targets:
                if target not in root:
                    raise RuntimeError(f"the graph refers to {target!r}, which the dict root lacks")
                prefix, name = _split(target)
                holder = torch.nn.Module()
                setattr(holder, name, root[target])
                parent = self
                for atom in prefix.split(".") if prefix else []:
                    if not hasattr(parent, atom):
                        parent.add_module(atom, torch.nn.Module())
                    parent = getattr(parent, atom)
                copy_attr(holder, parent, name, f"the graph refers to {target!r}")
        self.graph = graph

    # ------------------------------------------------------------------ graph and code
    @property
    def graph(self) -> Graph:
        """The graph this module runs. Assigning a new graph recompiles ``forward``."""
        return self._graph

    @graph.setter
    def graph(self, g: Graph) -> None:
        if not isinstance(g, Graph):
            raise TypeError(f"GraphModule.graph must be a fxlite.Graph, not {describe_value(g)}"
                            + _graph_hint(g))
        self.__dict__["_graph"] = g
        g.owning_module = self
        self.recompile()

    @property
    def code(self) -> str:
        """The source of the generated ``forward``."""
        return self._code

    def recompile(self) -> PythonCode:
        """Regenerate ``forward`` from ``self.graph``; call it after editing the graph."""
        with gc_paused():
            python_code = generate(self._graph, "self")
        self.__dict__["_code"] = python_code.src
        filename = f"<fxlite-forward-{next(_counter)}:{type(self).__name__}"
        where = self._graph._co_fields
        if where:  # tracebacks name the traced source: "... from model.py:12 in forward>"
            filename += f" from {where['co_filename']}:{where['co_firstlineno']} in {where['co_name']}"
        filename += ">"
        type(self).forward = _CompileOnFirstUse(python_code, filename)
        return python_code

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as e:
            _report_generated_line(e)
            raise

    def __str__(self) -> str:
        return f"{super().__str__()}\n\n\n\n{self._code}"

    def print_readable(self, print_output: bool = True) -> str:
        """The module as a class definition, with nested GraphModules inlined."""
        text = self._readable(type(self).__name__)
        if print_output:
            print(text)
        return text

    def _readable(self, name: str, indent: str = "") -> str:
        lines = [f"{indent}class {_class_name(name)}(torch.nn.Module):"]
        for sub_name, sub in self.named_children():
            if isinstance(sub, GraphModule):
                lines.append(sub._readable(sub_name, indent + "    "))
        lines += [indent + "    " + line for line in self._code.splitlines() if line.strip()
                  and not line.startswith("import ")]
        return "\n".join(lines) + "\n"

    def _repr_html_(self) -> str:
        return self._graph._repr_html_()

    # ------------------------------------------------------------------ submodules
    def add_submodule(self, target: str, m: torch.nn.Module) -> bool:
        """Install ``m`` at the dotted path ``target``, creating parents. False if blocked."""
        _check_path(target, "add_submodule")
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"GraphModule.add_submodule: m must be an nn.Module, not "
                            f"{describe_value(m)}; store other values with setattr(gm, name, value)")
        prefix, name = _split(target)
        mod: Any = self
        for atom in prefix.split(".") if prefix else []:
            if not hasattr(mod, atom):
                mod.add_module(atom, torch.nn.Module())
            mod = getattr(mod, atom)
            if not isinstance(mod, torch.nn.Module):
                return False
        mod.add_module(name, m)
        return True

    def delete_submodule(self, target: str) -> bool:
        """Remove the submodule at ``target``. False if there is none."""
        _check_path(target, "delete_submodule")
        prefix, name = _split(target)
        try:
            parent = self.get_submodule(prefix) if prefix else self
        except AttributeError:
            return False
        if name not in parent._modules:
            return False
        del parent._modules[name]
        return True

    def delete_all_unused_submodules(self) -> None:
        """Remove every submodule that no ``call_module`` or ``get_attr`` node needs."""
        used: set[str] = {""}
        for n in self._graph.nodes:
            if n.op in ("call_module", "get_attr"):
                atoms = n.target.split(".")
                used.update(".".join(atoms[:i]) for i in range(1, len(atoms) + 1))
                if n.op == "call_module":  # a called module needs all of its children
                    used.update(f"{n.target}.{k}" for k, _ in attr_at(self, n.target, "").named_modules())
        for name, _ in sorted(self.named_modules(), key=lambda kv: -len(kv[0])):
            if name not in used:
                self.delete_submodule(name)

    # ------------------------------------------------------------------ copying
    def __deepcopy__(self, memo: dict) -> GraphModule:
        res = GraphModule.__new__(GraphModule)
        memo[id(self)] = res
        torch.nn.Module.__init__(res)
        body = {k: v for k, v in self.__dict__.items() if k not in ("_graph", "_code")}
        res.__dict__.update(copy.deepcopy(body, memo))
        type(res).__name__ = type(self).__name__
        res.graph = copy.deepcopy(self._graph, memo)
        return res

    def __copy__(self) -> GraphModule:
        res = GraphModule.__new__(GraphModule)
        torch.nn.Module.__init__(res)
        res.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_graph", "_code")})
        type(res).__name__ = type(self).__name__
        res.graph = self._graph
        return res

    def __reduce__(self) -> tuple:
        # Pickle the graph as data (no generated code); forward is regenerated on load.
        body = {k: v for k, v in self.__dict__.items() if k not in ("_graph", "_code")}
        return (_rebuild, (body, self._graph, type(self).__name__))

    # ------------------------------------------------------------------ to_folder
    def to_folder(self, folder: str | os.PathLike, module_name: str = "FxModule") -> None:
        """Write this module as an importable package: ``from folder import module_name``.

        ``folder/module.py`` holds the class with the generated ``forward``; tensors and
        submodules are saved beside it and loaded by ``__init__``. Annotations that name
        something the file could not import (a local class) are written as strings.

        Raises:
            ValueError: ``module_name`` is not a Python identifier.
            RuntimeError: the code needs an object that cannot be imported by name.
        """
        if not isinstance(folder, (str, os.PathLike)):
            raise TypeError(f"to_folder: folder must be a path (a str or os.PathLike), not "
                            f"{describe_value(folder)}")
        if not is_ident(module_name):
            raise ValueError(f"to_folder: module_name must be a Python identifier, not {module_name!r}")
        os.makedirs(folder, exist_ok=True)
        tensors = {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}
        init = ["super().__init__()", "_here = os.path.dirname(os.path.abspath(__file__))",
                "_state = torch.load(os.path.join(_here, 'state.pt'), weights_only=True)"]
        lit = lambda name: repr(str.__str__(name))  # a str subclass could override __repr__
        for name, p in self._parameters.items():
            if p is not None:
                init.append(f"self.register_parameter({lit(name)}, torch.nn.Parameter("
                            f"_state['param:' + {lit(name)}], requires_grad={bool(p.requires_grad)}))")
        for name in self._buffers:
            init.append(f"self.register_buffer({lit(name)}, _state['buffer:' + {lit(name)}])")
        for name in tensors:
            init.append(f"setattr(self, {lit(name)}, _state['tensor:' + {lit(name)}])")
        state = {f"param:{k}": v.detach() for k, v in self._parameters.items() if v is not None}
        state.update({f"buffer:{k}": v for k, v in self._buffers.items() if v is not None})
        state.update({f"tensor:{k}": v for k, v in tensors.items()})
        for i, (name, sub) in enumerate(self._modules.items()):
            torch.save(sub, os.path.join(folder, f"submodule_{i}.pt"))
            init.append(f"self.add_module({lit(name)}, torch.load(os.path.join(_here, "
                        f"'submodule_{i}.pt'), weights_only=False))")
        torch.save(state, os.path.join(folder, "state.pt"))
        code = generate(self._graph, "self", portable=True)
        header = list(dict.fromkeys(["import os", "import torch", *_import_lines(code)]))
        forward = [line for line in code.src.splitlines() if not line.startswith("import ")]
        src = "\n".join([*header, "", "", f"class {module_name}(torch.nn.Module):",
                         "    def __init__(self):", *("        " + line for line in init), "",
                         *("    " + line for line in forward)]) + "\n"
        with open(os.path.join(folder, "module.py"), "w") as f:
            f.write(src)
        with open(os.path.join(folder, "__init__.py"), "w") as f:
            f.write(f"from .module import {module_name}\n")


class RootTypeError(TypeError, RuntimeError):
    """A root that is neither a module nor a dict: a TypeError, and also the RuntimeError that
    torch.fx raises there, so code written against either keeps catching it."""


def _graph_hint(value: Any) -> str:
    """How to get a fxlite Graph from ``value``, when it is something that has one."""
    if isinstance(getattr(value, "graph", None), Graph):
        return "; pass its .graph"
    if type(value).__module__.startswith("torch.fx"):
        return "; it is a torch.fx object: trace the module with fxlite.symbolic_trace instead"
    return ""


def _check_path(target: Any, where: str) -> None:
    if not isinstance(target, str):
        raise TypeError(f"GraphModule.{where}: target must be a dotted path str such as "
                        f"'layer1.conv', not {describe_value(target)}")


def expect_graph_module(value: Any, where: str, argument: str = "gm") -> GraphModule:
    """Return ``value`` if it is a GraphModule, else raise a TypeError naming ``argument``.

    The public entry of each pass calls it first, so a wrong argument fails at the user's
    call with what was expected and how to get it, before anything is changed.

    Args:
        value: what the user passed.
        where: the function, as the message names it (``"cse"``).
        argument: the parameter's name.

    Example::

        def my_pass(gm):
            gm = expect_graph_module(gm, "my_pass")
    """
    if isinstance(value, GraphModule):
        return value
    if isinstance(value, Graph):
        fix = ("; wrap the graph in a module first: GraphModule(root, graph)"
               if value.owning_module is None else "; pass the module that owns it: graph.owning_module")
    else:
        fix = _trace_hint(value, argument) or \
            "; trace a module or function first: fxlite.symbolic_trace(model)"
    raise TypeError(f"{where}: {argument} must be a fxlite.GraphModule, not "
                    f"{describe_value(value)}{fix}")


def expect_graph_or_module(value: Any, where: str, argument: str = "graph_or_gm"
                           ) -> tuple[Graph, torch.nn.Module | None]:
    """``(graph, module)`` for a Graph (its ``owning_module``) or a GraphModule; a TypeError
    naming ``argument`` of ``where`` for anything else.

    Example::

        graph, module = expect_graph_or_module(graph_or_gm, "to_dot")
    """
    if isinstance(value, GraphModule):
        return value.graph, value
    if isinstance(value, Graph):
        return value, value.owning_module
    raise TypeError(f"{where}: {argument} must be a fxlite Graph or GraphModule, not "
                    f"{describe_value(value)}{_trace_hint(value, argument)}")


def _trace_hint(value: Any, argument: str) -> str:
    if type(value).__module__.startswith("torch.fx"):
        return "; this is torch.fx's: trace the original module with fxlite.symbolic_trace"
    if isinstance(value, torch.nn.Module) or callable(value):
        return f"; trace it first: fxlite.symbolic_trace({argument})"
    return ""


def _import_lines(code: PythonCode) -> list[str]:
    """Import statements that recreate the globals of generated code in a source file."""
    lines = []
    for name, obj in code.globals.items():
        mod_name = getattr(obj, "__name__", None) if isinstance(obj, types.ModuleType) else None
        if mod_name is not None and sys.modules.get(mod_name) is obj and all(
                is_ident(a) for a in mod_name.split(".")):
            lines.append(f"import {mod_name}" if name == mod_name else f"import {mod_name} as {name}")
            continue
        spelling = import_spelling(obj)
        if spelling is None:
            raise RuntimeError(f"to_folder cannot write {name} ({obj!r}): it is not importable "
                               "by name; make it a module-level function or a module attribute")
        head, _, rest = spelling[1].partition(".")
        lines.append(f"from {spelling[0]} import {head} as {name}")
        if rest:  # a nested name (Outer.inner): import the outer one, then look it up
            lines.append(f"{name} = {name}.{rest}")
    return lines


def _class_name(name: str) -> str:
    """``name`` if it can follow ``class`` in source (``<lambda>`` cannot), else a cleaned-up one."""
    if is_ident(name):
        return name
    cleaned = re.sub(r"\W+", "_", str.__str__(name) if isinstance(name, str) else "").strip("_")
    return cleaned if is_ident(cleaned) else f"GraphModule_{cleaned}" if cleaned else "GraphModule"


# Callers under which a failing generated line is not printed: registered from above
# (fxlite.compile's call, whose replays rerun the user's function where eager would raise).
QUIET_CALLERS: set[types.CodeType] = set()


class _CompileOnFirstUse:
    """Stands in for ``forward`` until it is first looked up, then compiles it.

    Why: Python's ``compile()`` is most of the cost of ``recompile()`` on big graphs, and
    a pass pipeline recompiles after every pass. Any lookup (a call, ``inspect.signature``,
    ``type(gm).forward``) compiles and installs the real function, so nothing can observe
    the stand-in except by reading the class ``__dict__``.
    """

    __slots__ = ("code", "filename")

    def __init__(self, code: PythonCode, filename: str) -> None:
        self.code, self.filename = code, filename

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        owner = cls if cls is not None else type(obj)
        with gc_paused():
            fn = self.code.compile(self.filename)
        if owner.__dict__.get("forward") is self:
            owner.forward = fn
        return fn if obj is None else types.MethodType(fn, obj)


def _report_generated_line(e: BaseException) -> None:
    """If ``e`` was raised by a line of generated code itself (not inside a function it
    called), print that line in context to stderr, as torch.fx does; but not when a
    compiled function replays its recording (``fxlite.compile``), whose users wrote no
    generated code: their exception is eager's (``replay_failed``)."""
    tb = e.__traceback__
    if tb is None:
        return
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in QUIET_CALLERS:
            return
        f = f.f_back
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    if not filename.startswith("<fxlite-forward-"):
        return
    lines = linecache.getlines(filename)
    lineno = tb.tb_lineno
    context = "".join(f"{'-->' if i + 1 == lineno else '   '} {lines[i]}"
                      for i in range(max(0, lineno - 3), min(len(lines), lineno + 2)))
    print(f"Call using an FX-traced Module, line {lineno} of the traced Module's generated "
          f"forward function:\n{context}(in {filename}; print gm.code to see it all)",
          file=sys.stderr)


def _rebuild(body: dict[str, Any], graph: Graph, class_name: str) -> GraphModule:
    gm = GraphModule.__new__(GraphModule)
    torch.nn.Module.__init__(gm)
    gm.__dict__.update(body)
    type(gm).__name__ = class_name
    gm.graph = graph
    return gm


