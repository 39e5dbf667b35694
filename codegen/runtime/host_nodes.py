"""Host nodes as one generated function: the Python work between a segment's replays.

A segment replayed from CUDA graphs still runs some nodes as Python on every call: a
training step's ``opt.zero_grad(set_to_none=True)`` is a ``getattr`` and a ``setattr`` per
parameter, before the forward's graph. Run through the :class:`~fxlite.Interpreter`, each
node costs its argument mapping and a hook dispatch: resnet18's 124 such nodes took 353 us
of host time a step on an H200 host, all of it before the GPU had any work.
:func:`host_function` writes one flat function for such a run of nodes instead::

    def run(env):
        env[_n0] = _c0(env[_n1], _c1)          # getattr(p, 'grad')
        env[_n2] = _c2(env[_n1], _c1, _c3)     # setattr(p, 'grad', None)

Every target, constant and node is bound to a generated name (``_c<i>``, ``_n<i>``), never
written into the source, so no name or repr in a graph can change the code.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Sequence
from typing import Any

from fxlite.node import Node

__all__ = ["host_function"]


def host_function(nodes: Sequence[Node], fetch_attr: Callable[[str], Any],
                  submodules: dict[str, Any]) -> Callable[[dict[Node, Any]], None]:
    """A function that runs ``nodes`` in order on an interpreter's ``env``, as
    ``Interpreter.run_node`` would: it reads their inputs from ``env`` and stores each
    node's value there.

    Args:
        nodes: ``call_function``, ``call_method``, ``call_module`` or ``get_attr`` nodes.
        fetch_attr: the interpreter's ``fetch_attr`` (``get_attr`` and submodules, looked
            up on each call as the interpreter does).
        submodules: the interpreter's cache of submodules by path.

    Returns:
        ``run(env)``.

    Example::

        run = host_function(nodes, runner.fetch_attr, runner.submodules)
        run(runner.env)   # the same as: for n in nodes: runner.env[n] = runner.run_node(n)
    """
    names: dict[int, str] = {}
    scope: dict[str, Any] = {"_getattr": getattr}

    def bind(value: Any, prefix: str = "_c") -> str:
        key = id(value) if prefix == "_n" else None
        if key is not None and key in names:
            return names[key]
        name = f"{prefix}{len(scope)}"
        scope[name] = value
        if key is not None:
            names[key] = name
        return name

    def arg(a: Any) -> str:
        if isinstance(a, Node):
            return f"env[{bind(a, '_n')}]"
        if type(a) is tuple:
            return "(" + "".join(f"{arg(x)}, " for x in a) + ")"
        if type(a) is list:
            return "[" + ", ".join(arg(x) for x in a) + "]"
        if type(a) is dict and all(isinstance(k, str) for k in a):
            return "{" + ", ".join(f"{bind(k)}: {arg(v)}" for k, v in a.items()) + "}"
        return bind(a)  # any other value, containers of other kinds included, as it is

    def call(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        parts = [arg(a) for a in args]
        for k, v in kwargs.items():
            if k.isidentifier() and not keyword.iskeyword(k):
                parts.append(f"{k}={arg(v)}")
            else:
                parts.append(f"**{{{bind(k)}: {arg(v)}}}")
        return ", ".join(parts)

    lines = ["def run(env):"]
    for n in nodes:
        if n.op == "call_function":
            value = f"{bind(n.target)}({call(n.args, n.kwargs)})"
        elif n.op == "call_method":
            value = (f"_getattr({arg(n.args[0])}, {bind(n.target)})"
                     f"({call(n.args[1:], n.kwargs)})")
        elif n.op == "call_module":
            module = submodules.get(n.target) if isinstance(n.target, str) else None
            target = bind(module) if module is not None else \
                f"{bind(fetch_attr)}({bind(n.target)})"
            value = f"{target}({call(n.args, n.kwargs)})"
        elif n.op == "get_attr":
            value = f"{bind(fetch_attr)}({bind(n.target)})"
        else:
            raise ValueError(f"host_function: {n.op} node {n.name} is not a host node")
        lines.append(f"    env[{bind(n, '_n')}] = {value}")
    lines.append("    return None")
    code = compile("\n".join(lines), "<fxlite-host-nodes>", "exec")
    exec(code, scope)
    return scope["run"]
