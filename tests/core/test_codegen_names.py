"""Names in generated ``forward()`` code, and how long its source stays in linecache.

Python folds identifiers with NFKC, so ``ｇｅｔａｔｔｒ`` written in source *is* ``getattr``:
a name is used as-is only if folding leaves it unchanged; any other gets a fresh name
(itself folded first: ``ｓｕｍ`` becomes ``sum_1``), or is spelled as a string literal.
"""

from __future__ import annotations

import builtins
import gc
import io
import linecache
import tokenize
import unicodedata

import pytest
import torch

import fxlite as fx
from fxlite.python_code import generate

FULLWIDTH = {w: "".join(chr(ord(c) + 0xFEE0) for c in w) for w in
             ["getattr", "torch", "self", "print", "len", "None", "True", "if", "class",
              "lambda", "forward", "x"]}


def _names_are_folded(code: str) -> None:
    """Every name token of ``code`` is one Python reads as written."""
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.NAME:
            assert unicodedata.normalize("NFKC", tok.string) == tok.string, tok.string


def _module(graph: fx.Graph, root: torch.nn.Module | None = None) -> fx.GraphModule:
    gm = fx.GraphModule(root or torch.nn.Module(), graph)
    _names_are_folded(gm.code)
    return gm


class _Trap:
    """An input that records being called (as a shadowed builtin would call it)."""

    called = False

    def __call__(self, *args, **kwargs):
        _Trap.called = True
        return "trapped"


@pytest.mark.parametrize("builtin", ["getattr", "print", "len"])
@pytest.mark.parametrize("how", ["placeholder", "renamed"])
def test_a_fullwidth_builtin_name_never_calls_the_argument(builtin, how):
    g = fx.Graph()
    x = g.placeholder("x")
    trap = g.placeholder(FULLWIDTH[builtin] if how == "placeholder" else "t")
    if how == "renamed":
        trap.name = FULLWIDTH[builtin]  # set directly: the graph's namer never saw it
    args = {"getattr": (x, "shape"), "print": (x,), "len": (x,)}[builtin]
    out = g.call_function(getattr(builtins, builtin), args)
    g.output((out, trap))
    gm = _module(g)
    _Trap.called = False
    t = _Trap()
    x_val = torch.ones(3)
    result, passed = gm(x_val, t)
    assert not _Trap.called and passed is t
    assert result == {"getattr": torch.Size([3]), "print": None, "len": 3}[builtin]


@pytest.mark.parametrize("how", ["placeholder", "renamed"])
def test_a_fullwidth_torch_does_not_shadow_the_module(how):
    g = fx.Graph()
    p = g.placeholder(FULLWIDTH["torch"] if how == "placeholder" else "p")
    if how == "renamed":
        p.name = FULLWIDTH["torch"]
    g.output(g.call_function(torch.relu, (p,)))
    gm = _module(g)
    assert torch.equal(gm(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))


@pytest.mark.parametrize("how", ["placeholder", "renamed"])
def test_a_fullwidth_self_is_not_a_duplicate_argument(how):
    g = fx.Graph()
    p = g.placeholder(FULLWIDTH["self"] if how == "placeholder" else "p")
    if how == "renamed":
        p.name = FULLWIDTH["self"]
    lin = g.call_module("lin", (p,))
    g.output(lin)
    root = torch.nn.Module()
    root.lin = torch.nn.Linear(2, 2)
    gm = _module(g, root)
    x = torch.randn(3, 2)
    torch.testing.assert_close(gm(x), root.lin(x))


@pytest.mark.parametrize("word", ["None", "True", "if", "class", "lambda", "forward"])
def test_fullwidth_keywords_and_constants_give_valid_code(word):
    g = fx.Graph()
    p = g.placeholder("p")
    p.name = FULLWIDTH[word]
    q = g.placeholder("q")
    out = g.call_function(torch.add, (p, q))
    out.name = FULLWIDTH[word] + "_1"
    g.output((out, None))
    gm = _module(g)
    total, none = gm(torch.ones(2), torch.ones(2))
    assert torch.equal(total, torch.full((2,), 2.0)) and none is None


def test_the_graph_namer_folds_before_it_checks_reserved_names():
    g = fx.Graph()
    names = [g.placeholder(FULLWIDTH[w]).name for w in ("getattr", "torch", "self", "x")]
    assert names == ["getattr_1", "torch_1", "self_1", "x"]


def test_two_names_that_fold_alike_stay_two_values():
    g = fx.Graph()
    a = g.placeholder("x")
    b = g.placeholder("y")
    b.name = FULLWIDTH["x"]  # Python would read both as x
    g.output(g.call_function(torch.sub, (a, b)))
    gm = _module(g)
    assert torch.equal(gm(torch.full((2,), 5.0), torch.ones(2)), torch.full((2,), 4.0))


def test_a_fullwidth_attribute_is_read_by_its_own_name():
    root = torch.nn.Module()
    root.register_buffer("w", torch.zeros(2))
    root.register_buffer(FULLWIDTH["x"], torch.ones(2))  # Python would read self.x
    root.register_buffer("x", torch.full((2,), 7.0))
    g = fx.Graph()
    g.output(g.get_attr(FULLWIDTH["x"]))
    gm = _module(g, root)
    assert torch.equal(gm(), torch.ones(2))


def test_a_fullwidth_method_and_keyword_are_passed_by_their_own_names():
    class Box:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):  # any method, recording the names it was called by
            return lambda *a, **kw: self.calls.append((name, sorted(kw)))

    g = fx.Graph()
    box = g.placeholder("box")
    g.output(g.call_method(FULLWIDTH["len"], (box,), {FULLWIDTH["x"]: 1}))
    gm = _module(g)
    b = Box()
    gm(b)
    assert b.calls == [(FULLWIDTH["len"], [FULLWIDTH["x"]])]


def test_a_function_with_a_fullwidth_name_is_bound_apart_from_torch():
    def f(x):
        return x + 1

    f.__name__ = f.__qualname__ = FULLWIDTH["torch"]
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.relu, (g.call_function(f, (x,)),)))
    gm = _module(g)
    assert torch.equal(gm(torch.tensor([-3.0, 1.0])), torch.tensor([0.0, 2.0]))


def test_a_function_named_forward_is_not_rebound_by_the_def():
    def forward(x):
        return x * 3

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.create_node("call_function", forward, (x,), name="y"))
    gm = _module(g)
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 3.0))


def test_portable_source_folds_names_too(tmp_path):
    g = fx.Graph()
    p = g.placeholder("p")
    p.name = FULLWIDTH["self"]
    g.output(g.call_function(torch.neg, (p,)))
    code = generate(g, portable=True)
    _names_are_folded(code.src)
    with pytest.raises(ValueError):
        _module(g).to_folder(tmp_path / "m", FULLWIDTH["x"])


# ------------------------------------------------------------------------- linecache
def _chain(n: int):
    def f(x):
        for _ in range(n):
            x = torch.relu(x) + 1
        return x
    return f


def _generated() -> int:
    return sum(1 for k in linecache.cache if k.startswith("<fxlite-forward"))


def test_linecache_stays_bounded_over_200_compile_and_drop_cycles():
    gc.collect()
    before = _generated()
    f = _chain(100)
    for _ in range(200):
        gm = fx.symbolic_trace(f)
        gm(torch.ones(2))  # compiles forward: its source enters linecache
        del gm
    gc.collect()
    assert _generated() <= before + 1


def test_recompiling_releases_the_previous_source():
    gm = fx.symbolic_trace(_chain(3))
    gm(torch.ones(2))
    first = gm.forward.__code__.co_filename
    assert first in linecache.cache
    gm.recompile()
    gm(torch.ones(2))
    assert first not in linecache.cache  # no gc.collect() needed
    assert gm.forward.__code__.co_filename in linecache.cache


def test_a_live_forward_keeps_its_source_for_tracebacks():
    gm = fx.symbolic_trace(_chain(3))
    forward = gm.forward  # held elsewhere: its traceback lines must stay
    filename = forward.__code__.co_filename
    del gm
    gc.collect()
    assert linecache.getlines(filename)
    del forward
    gc.collect()
    assert filename not in linecache.cache
