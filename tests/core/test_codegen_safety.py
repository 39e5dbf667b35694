"""Generated code cannot be hijacked: names, targets, annotations and reprs never become code.

Each payload calls ``fxlite_pwned()``, a builtin this file installs, so a payload needs no
dot and no import to run. Every graph goes through everything that turns it into code or
runs it (recompile, a call, deepcopy, pickle, ``to_folder`` plus an import of the folder,
``print_readable``), and the hook must never be called. The generated source must parse.
"""

from __future__ import annotations

import ast
import builtins
import collections
import copy
import enum
import importlib
import pickle
import sys
import types
import typing

import pytest
import torch
from torch import nn

import fxlite as fx

PAYLOAD = "fxlite_pwned()"
CALLS: list[str] = []


@pytest.fixture(autouse=True)
def pwned_hook():
    CALLS.clear()
    builtins.fxlite_pwned = lambda *a: CALLS.append("payload ran") or 0
    yield
    del builtins.fxlite_pwned
    assert CALLS == [], "a payload ran"


class EvilRepr:
    """An annotation whose repr looks like typing and breaks out of the line."""

    def __repr__(self):
        return f"typing.Any=1):\n    {PAYLOAD}\ndef forward(self, x"


class EvilStr(str):
    """A string whose repr, isidentifier and str are lies."""

    def __repr__(self):
        return f"'a'+{PAYLOAD}"

    def isidentifier(self):
        return True

    def __str__(self):
        return f"x;{PAYLOAD}"


class Color(enum.Enum):
    RED = 1

    def __repr__(self):
        return f"{PAYLOAD}"


def _no_payload(code: str) -> None:
    """The payload may appear inside a string literal, never as a name the code can call."""
    for node in ast.walk(ast.parse(code)):
        assert not (isinstance(node, ast.Name) and node.id == "fxlite_pwned"), code


def _chain(first, type_expr=None, out_type=None):
    """x -> first(x) -> relu -> output."""
    g = fx.Graph()
    x = g.placeholder("x", type_expr=type_expr)
    y = first(g, x)
    z = g.call_function(torch.relu, (y,))
    g.output(z, type_expr=out_type)
    return g


def _exercise(gm: fx.GraphModule, tmp_path, x=None, expect=None, folder=True):
    """Everything that prints or runs generated code; the payload must never run."""
    x = torch.tensor([-1.0, 2.0]) if x is None else x
    _no_payload(gm.code)
    gm.recompile()
    got = gm(x)
    if expect is not None:
        torch.testing.assert_close(got, expect)
    gm2 = copy.deepcopy(gm)
    torch.testing.assert_close(gm2(x), got)
    try:
        blob = pickle.dumps(gm)
    except (pickle.PicklingError, AttributeError, TypeError):
        blob = None  # a payload object defined in a test need not pickle; it must not run
    if blob is not None:
        torch.testing.assert_close(pickle.loads(blob)(x), got)
    text = gm.print_readable(print_output=False)
    _no_payload(text)
    str(gm.graph)
    if folder:
        pkg = f"fxlite_safety_{abs(hash(str(tmp_path)))}"
        gm.to_folder(tmp_path / pkg, "Mod")
        _no_payload((tmp_path / pkg / "module.py").read_text())
        sys.path.insert(0, str(tmp_path))
        try:
            mod = importlib.import_module(pkg)
            torch.testing.assert_close(mod.Mod()(x), got)
        finally:
            sys.path.remove(str(tmp_path))
            sys.modules.pop(pkg, None)
            sys.modules.pop(f"{pkg}.module", None)
    return got


# ---------------------------------------------------------------------- annotations
@pytest.mark.parametrize("annotation", [EvilRepr(), EvilStr("torch.Tensor"),
                                        typing.Literal[Color.RED], list[EvilRepr],
                                        typing.Optional[EvilRepr]],
                         ids=["repr", "str-subclass", "literal-enum", "generic", "optional"])
def test_annotation_repr_cannot_break_out(annotation, tmp_path):
    g = _chain(lambda g, x: g.call_function(torch.neg, (x,)), type_expr=annotation,
               out_type=annotation)
    gm = fx.GraphModule(nn.Module(), g)
    _exercise(gm, tmp_path, expect=torch.tensor([1.0, 0.0]), folder=False)


def test_traced_function_with_hostile_annotations(tmp_path):
    def f(x, y=None):
        return torch.relu(x) * 2

    f.__annotations__ = {"x": EvilRepr(), "y": EvilStr("int"), "return": typing.Literal[Color.RED]}
    gm = fx.symbolic_trace(f)
    _exercise(gm, tmp_path, expect=torch.tensor([0.0, 4.0]), folder=False)
    gm.to_folder(tmp_path / "hostile", "Hostile")  # the annotations become inert strings
    _no_payload((tmp_path / "hostile" / "module.py").read_text())


def test_literal_enum_annotation_traces_and_runs(tmp_path):
    # Was: SyntaxError in generated code, since repr(Literal[E.A]) is "<E.A: 1>".
    class Mode(enum.Enum):
        A = 1

    def f(x, mode=None):
        return x + 1

    f.__annotations__ = {"mode": typing.Literal[Mode.A]}  # an object, not a string
    gm = fx.symbolic_trace(f)
    assert "typing.Literal[" in gm.code
    x = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(gm(x), x + 1)
    torch.testing.assert_close(gm(x, Mode.A), x + 1)
    # to_folder cannot import Mode (a local class): the annotation becomes a string.
    gm.to_folder(tmp_path / "lit", "Lit")
    src = (tmp_path / "lit" / "module.py").read_text()
    _no_payload(src)
    assert "'typing.Literal[" in src


def test_annotations_are_rebuilt_readably():
    g = fx.Graph()
    a = g.placeholder("a", type_expr=typing.Optional[torch.Tensor])
    b = g.placeholder("b", type_expr=list[int])
    c = g.placeholder("c", type_expr=typing.Callable[[int], str])
    d = g.placeholder("d", type_expr=int | None)
    e = g.placeholder("e", type_expr=typing.Tuple[torch.Tensor, ...])  # noqa: UP006 (the typing form on purpose)
    g.output((a, b, c, d, e), type_expr=typing.Any)
    gm = fx.GraphModule(nn.Module(), g)
    code = gm.code
    assert "a : typing.Optional[torch.Tensor]" in code
    assert "b : list[int]" in code
    assert "c : typing.Callable[[int], str]" in code
    assert "d : int | None" in code
    assert "e : typing.Tuple[torch.Tensor, ...]" in code
    assert "-> typing.Any" in code
    hints = typing.get_type_hints(gm.forward)  # evaluates the text: it names the same objects
    assert hints["a"] == typing.Optional[torch.Tensor] and hints["b"] == list[int]
    assert hints["c"] == typing.Callable[[int], str] and hints["d"] == (int | None)
    assert hints["e"] == typing.Tuple[torch.Tensor, ...] and hints["return"] == typing.Any  # noqa: UP006


# ---------------------------------------------------------------------- node names
@pytest.mark.parametrize("name", ['x;open("/tmp/p","w");y', f"y = {PAYLOAD}\n    z", "torch",
                                  "self", "len", "class", EvilStr("ok")])
def test_renamed_node_cannot_inject_code(name, tmp_path):
    g = _chain(lambda g, x: g.call_function(torch.neg, (x,)))
    neg = next(n for n in g.nodes if n.target is torch.neg)
    neg.name = name  # lint rejects this; code generation must cope anyway
    if isinstance(name, str) and "open(" in name:
        neg.name = name.replace("/tmp/p", str(tmp_path / "p"))
    gm = fx.GraphModule(nn.Module(), g)
    _no_payload(gm.code)
    assert "open(" not in gm.code
    _exercise(gm, tmp_path, expect=torch.tensor([1.0, 0.0]))
    assert not (tmp_path / "p").exists()


def test_renamed_placeholder_cannot_inject_code(tmp_path):
    g = _chain(lambda g, x: g.call_function(torch.neg, (x,)))
    next(iter(g.nodes)).name = f"x):\n    {PAYLOAD}\n    def f(x"
    gm = fx.GraphModule(nn.Module(), g)
    _exercise(gm, tmp_path, expect=torch.tensor([1.0, 0.0]))


# ---------------------------------------------------------------------- function targets
def _evil_function(namespace, name):
    def f(x):
        return -x

    f.__name__ = f.__qualname__ = name
    f.__module__ = namespace.__name__
    setattr(namespace, name, f)
    return f


@pytest.mark.parametrize("namespace", [torch, builtins, __import__("math"), __import__("operator")])
def test_function_named_like_code_in_a_named_module(namespace, tmp_path):
    # A name with no dot resolves as <module>.<name>; it must not be pasted after "torch.".
    name = f"neg(x) or {PAYLOAD} or neg"
    f = _evil_function(namespace, name)
    try:
        gm = fx.GraphModule(nn.Module(), _chain(lambda g, x: g.call_function(f, (x,))))
        _no_payload(gm.code)
        _exercise(gm, tmp_path, expect=torch.tensor([1.0, 0.0]), folder=False)
        with pytest.raises(RuntimeError, match="not importable"):
            gm.to_folder(tmp_path / "evil_fn", "Mod")
    finally:
        delattr(namespace, name)


def test_function_with_lying_module_and_qualname(tmp_path):
    def f(x):
        return -x

    f.__module__ = "torch"
    f.__qualname__ = f"nn.{PAYLOAD}"
    f.__name__ = "f"
    gm = fx.GraphModule(nn.Module(), _chain(lambda g, x: g.call_function(f, (x,))))
    _no_payload(gm.code)
    _exercise(gm, tmp_path, expect=torch.tensor([1.0, 0.0]), folder=False)


def test_tensor_attribute_named_like_code(tmp_path):
    # A function without __module__ found on torch.Tensor prints as torch.Tensor.<name>.
    name = f"neg(x) or {PAYLOAD} or x"

    def f(x):
        return -x

    f.__name__, f.__module__ = name, None
    setattr(torch.Tensor, name, f)
    try:
        gm = fx.GraphModule(nn.Module(), _chain(lambda g, x: g.call_function(f, (x,))))
        _no_payload(gm.code)
        _exercise(gm, tmp_path, expect=torch.tensor([1.0, 0.0]), folder=False)
        gm = fx.GraphModule(nn.Module(), _chain(lambda g, x: g.call_method(name, (x,))))
        _no_payload(gm.code)
        _exercise(gm, tmp_path, expect=torch.tensor([1.0, 0.0]))
    finally:
        delattr(torch.Tensor, name)


# ---------------------------------------------------------------------- targets and values
def test_string_subclass_targets_and_keys(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

    m = M()
    g = fx.Graph()
    x = g.placeholder("x")
    h = g.call_module(EvilStr("lin"), (x,))
    h = g.call_method(EvilStr("neg"), (h,))
    w = g.get_attr(EvilStr("lin.weight"))
    s = g.call_function(torch.sum, (w,), {EvilStr("dim"): 0})
    g.output(g.call_function(torch.add, (h, s)))
    gm = fx.GraphModule(m, g)
    _no_payload(gm.code)
    x = torch.randn(3, 2)
    expect = -m.lin(x) + m.lin.weight.sum(dim=0)
    _exercise(gm, tmp_path, x=x, expect=expect, folder=False)


def test_constants_with_odd_reprs_are_bound_not_pasted(tmp_path):
    class Pt(collections.namedtuple("Pt", "a b")):
        pass

    Pt.__name__ = Pt.__qualname__ = PAYLOAD
    module = types.ModuleType(f"m;{PAYLOAD}")

    class F(float):
        def __repr__(self):
            return PAYLOAD

    g = fx.Graph()
    x = g.placeholder("x", default_value=Color.RED)
    values = (EvilStr("k"), Pt(1, 2), module, F(2.0), {EvilStr("key"): 1}, Color.RED)
    y = g.call_function(_identity_pair, (x, values))
    g.output(y)
    gm = fx.GraphModule(nn.Module(), g)
    _no_payload(gm.code)
    ast.parse(gm.code)
    out = gm(torch.tensor([1.0]))
    assert out[1][3] == 2.0 and type(out[1][1]) is Pt and out[1][2] is module
    copy.deepcopy(gm)(torch.tensor([1.0]))
    _no_payload(gm.print_readable(print_output=False))


def _identity_pair(a, b):
    return a, b


# ---------------------------------------------------------------------- print_readable, to_folder
def test_traced_lambda_prints_valid_python():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    text = gm.print_readable(print_output=False)
    tree = ast.parse(text)
    assert isinstance(tree.body[0], ast.ClassDef)
    ns = {"torch": torch}
    exec(compile(text, "<readable>", "exec"), ns)  # noqa: S102 -- the text is what we test
    cls = ns[tree.body[0].name]
    x = torch.tensor([-1.0, 1.0])
    torch.testing.assert_close(cls.forward(None, x), torch.relu(x) + 1)


@pytest.mark.parametrize("bad", ["my-module", "class", "a.b", "Mod\n", EvilStr("Mod"), 3])
def test_to_folder_rejects_a_module_name_that_is_not_an_identifier(bad, tmp_path):
    gm = fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ValueError, match="identifier"):
        gm.to_folder(tmp_path / "f", bad)
    assert not (tmp_path / "f").exists()


class LocalHolder:
    pass


def test_to_folder_survives_name_mangling_and_local_class_annotations(tmp_path):
    class Local:
        pass

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("__secret", torch.tensor([2.0]))
            self.register_parameter("__w", nn.Parameter(torch.tensor([3.0])))
            self.add_module("__sub", nn.ReLU())

        def forward(self, x, y=None, z=None):
            return getattr(self, "__sub")(x * getattr(self, "__secret") + getattr(self, "__w"))

    m = M()
    gm = fx.symbolic_trace(m)
    x = torch.tensor([-5.0, 1.0])
    # Annotation objects (this file's own annotations are strings: __future__.annotations).
    types_ = {"x": torch.Tensor, "y": typing.Optional[Local], "z": typing.Optional[LocalHolder]}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.type = types_[n.name]
        if n.op == "call_function":  # a node whose own name would be mangled in a class body
            n.name = "__hidden"
    gm.recompile()
    gm.to_folder(tmp_path / "mangled", "Mangled")
    src = (tmp_path / "mangled" / "module.py").read_text()
    assert "'typing.Optional[" in src  # Local cannot be imported: a string annotation
    assert "x : torch.Tensor" in src and "z : typing.Optional[LocalHolder]" in src
    assert "__hidden" not in src
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module("mangled")
        torch.testing.assert_close(mod.Mangled()(x), m(x))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mangled", None)
        sys.modules.pop("mangled.module", None)


# ---------------------------------------------------------------------- deep nesting
@pytest.mark.parametrize("kinds", ["tuple", "tuple list dict slice"])
def test_argument_nested_3000_levels_deep(kinds, tmp_path):
    wrap = {"tuple": lambda v: (v,), "list": lambda v: [v, 1], "dict": lambda v: {"k": v, 2: 3},
            "slice": lambda v: slice(None, v, 2)}
    kinds = kinds.split()
    g = fx.Graph()
    x = g.placeholder("x")
    deep = x
    for i in range(3000):
        deep = wrap[kinds[i % len(kinds)]](deep)
    y = g.call_function(_depth, (deep,))
    dead = g.call_function(_depth, (deep,))
    g.output(y)
    gm = fx.GraphModule(nn.Module(), g)
    assert max(len(line) - len(line.lstrip("(")) for line in gm.code.splitlines()) < 200
    x = torch.tensor([1.0])
    assert gm(x) == 3000
    gm.graph.lint()
    assert str(gm.graph).count("%x") == 3
    assert fx.Interpreter(gm).run(x) == 3000
    assert copy.deepcopy(gm)(x) == 3000
    assert pickle.loads(pickle.dumps(gm))(x) == 3000
    _no_payload(gm.print_readable(print_output=False))
    assert gm.graph.eliminate_dead_code()
    assert dead not in set(gm.graph.nodes)
    gm.recompile()
    assert gm(x) == 3000


def _depth(t):
    n = 0
    while not isinstance(t, torch.Tensor):
        t = t[0] if isinstance(t, (tuple, list)) else t["k"] if isinstance(t, dict) else t.stop
        n += 1
    return n
