"""Bad input at the public boundary (issue 36): a TypeError or ValueError that names the
argument, says what was expected, and is raised before anything changes.

Each case calls one public entry point of ``fxlite`` or ``fxlite.passes`` with a wrong
argument and checks three things: the exception type, that the message names the
argument, and that the module and graph are as they were (``gm.code``, ``str(graph)``, the
module's attributes and the graph's used names). Where torch.fx raises a clear type on the
same input (RuntimeError for a bad GraphModule root, a node of another graph or a node in
use), fxlite's exception is that type too.

The second half: a constant whose ``__repr__`` raises prints as ``<unprintable Foo>`` in
``str(graph)``, ``print_tabular``, the HTML view and the other views built on them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
from fxlite.passes import (
    DECOMPOSITIONS,
    PassManager,
    ShapeProp,
    cse,
    decompose,
    diff,
    draw,
    extract_tensor_metadata,
    fold_constants,
    fold_conv_bn,
    fuse,
    normalize,
    normalize_graph,
    produces_tensor,
    register_decomposition,
    sink_views,
    split_by_tags,
    split_module,
    to_dot,
    to_networkx,
    unpack_attention,
)
from torch import nn

import fxlite
import fxlite as fx
from fxlite.viz.tabular import tabular


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x) + 1) * 2


def _gm() -> fx.GraphModule:
    return fx.symbolic_trace(Net())


def _snapshot(gm: fx.GraphModule) -> tuple:
    """What a refused call must leave as it was."""
    graph = gm.graph
    return (gm.code, str(graph), len(graph.nodes), sorted(graph._namespace._used),
            [(n.name, n.args, n.kwargs, list(n.users)) for n in graph.nodes],
            sorted(k for k, _ in gm.named_modules()), sorted(k for k, _ in gm.named_parameters()),
            {k: v for k, v in vars(gm).items() if not k.startswith("_")})


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _other_node() -> fx.Node:
    """A node of another graph, unused there."""
    other = fx.symbolic_trace(lambda x: x * 2)
    with other.graph.inserting_before(other.graph.output_node()):
        return other.graph.call_function(torch.neg, (next(iter(other.graph.nodes)),))


def _erased_node() -> fx.Node:
    """A node erased from another graph."""
    other = fx.symbolic_trace(lambda x: x + 1)
    out = other.graph.output_node()
    add = out.args[0]
    out.args = (next(iter(other.graph.nodes)),)
    other.graph.erase_node(add)
    return add


def _tag_all(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        n.tag = "a"


# id -> (call on the module, exception type, regex the message must match: the argument)
CASES: dict[str, tuple[Callable[[fx.GraphModule], Any], type[BaseException], str]] = {
    # ------------------------------------------------------------------ GraphModule
    "GraphModule root None": (lambda gm: fx.GraphModule(None, gm.graph), TypeError, r"\broot\b"),
    "GraphModule root int": (lambda gm: fx.GraphModule(3, gm.graph), RuntimeError, r"\broot\b.*int"),
    "GraphModule graph None": (lambda gm: fx.GraphModule(gm, None), TypeError, r"\bgraph\b.*None"),
    "GraphModule graph is a module": (lambda gm: fx.GraphModule(gm, gm), TypeError,
                                      r"\bgraph\b.*pass its \.graph"),
    "GraphModule graph from torch.fx": (
        lambda gm: fx.GraphModule(gm, torch.fx.symbolic_trace(lambda x: x).graph), TypeError,
        r"\bgraph\b.*torch\.fx"),
    "GraphModule class_name": (lambda gm: fx.GraphModule(gm, gm.graph, 3), TypeError, r"class_name"),
    "GraphModule.graph setter": (lambda gm: setattr(gm, "graph", "x"), TypeError, r"\bgraph\b"),
    "add_submodule target": (lambda gm: gm.add_submodule(3, nn.ReLU()), TypeError, r"\btarget\b"),
    "add_submodule m": (lambda gm: gm.add_submodule("new.deep", 3), TypeError, r"\bm must"),
    "delete_submodule target": (lambda gm: gm.delete_submodule(None), TypeError, r"\btarget\b"),
    "to_folder folder": (lambda gm: gm.to_folder(None), TypeError, r"\bfolder\b"),
    "to_folder module_name": (lambda gm: gm.to_folder("/nonexistent/x", "not an ident"), ValueError,
                              r"module_name"),
    # ------------------------------------------------------------------ Interpreter family
    "Interpreter module None": (lambda gm: fx.Interpreter(None), TypeError, r"\bmodule\b"),
    "Interpreter module function": (lambda gm: fx.Interpreter(lambda x: x), TypeError,
                                    r"\bmodule\b.*symbolic_trace"),
    "Interpreter untraced module": (lambda gm: fx.Interpreter(nn.Linear(2, 2)), TypeError,
                                    r"\bmodule\b.*symbolic_trace"),
    "Interpreter graph": (lambda gm: fx.Interpreter(gm, graph="g"), TypeError, r"\bgraph\b"),
    "Interpreter.run initial_env": (lambda gm: fx.Interpreter(gm).run(torch.ones(4), initial_env=[1]),
                                    TypeError, r"initial_env"),
    "Interpreter.boxed_run args_list": (lambda gm: fx.Interpreter(gm).boxed_run((torch.ones(4),)),
                                        TypeError, r"args_list"),
    "Interpreter.fetch_attr target": (lambda gm: fx.Interpreter(gm).fetch_attr(None), TypeError,
                                      r"\btarget\b"),
    "Transformer module None": (lambda gm: fx.Transformer(None), TypeError, r"Transformer: module"),
    "Transformer untraced module": (lambda gm: fx.Transformer(nn.ReLU()), TypeError,
                                    r"Transformer: module"),
    "ShapeProp module None": (lambda gm: ShapeProp(None), TypeError, r"ShapeProp: module"),
    "ShapeProp torch.fx module": (lambda gm: ShapeProp(torch.fx.symbolic_trace(Net())), TypeError,
                                  r"ShapeProp: module"),
    # ------------------------------------------------------------------ Graph
    "erase_node None": (lambda gm: gm.graph.erase_node(None), TypeError, r"to_erase"),
    "erase_node another graph's node": (lambda gm: gm.graph.erase_node(_other_node()), RuntimeError,
                                        r"to_erase.*does not belong"),
    "erase_node node in use": (lambda gm: gm.graph.erase_node(_node(gm, "add")), RuntimeError,
                               r"to_erase.*still had 1 users"),
    "erase_node node erased elsewhere": (lambda gm: gm.graph.erase_node(_erased_node()),
                                         RuntimeError, r"to_erase"),
    "create_node op unknown": (lambda gm: gm.graph.create_node("call_lambda", torch.relu), ValueError,
                               r"\bop\b.*opcode"),
    "create_node op type": (lambda gm: gm.graph.create_node(None, torch.relu), TypeError, r"\bop\b"),
    "create_node args": (lambda gm: gm.graph.create_node("call_function", torch.relu, 3), TypeError,
                         r"\bargs\b"),
    "create_node kwargs": (lambda gm: gm.graph.create_node("call_function", torch.relu, (), [1]),
                           TypeError, r"\bkwargs\b"),
    "create_node name": (lambda gm: gm.graph.create_node("call_function", torch.relu, (), {}, 3),
                         TypeError, r"\bname\b"),
    "create_node reads an erased node": (
        lambda gm: gm.graph.create_node("call_function", torch.relu, (_erased_node(),), name="new"),
        RuntimeError, r"args or kwargs.*erased"),
    "placeholder name": (lambda gm: gm.graph.placeholder(3), TypeError, r"\bname\b"),
    "get_attr qualified_name": (lambda gm: gm.graph.get_attr(None), TypeError, r"qualified_name"),
    "call_module module_name": (lambda gm: gm.graph.call_module(nn.ReLU()), TypeError, r"module_name"),
    "call_method method_name": (lambda gm: gm.graph.call_method(None), TypeError, r"method_name"),
    "call_function the_function": (lambda gm: gm.graph.call_function("relu"), TypeError,
                                    r"the_function"),
    "inserting_before n": (lambda gm: gm.graph.inserting_before(3).__enter__(), TypeError, r": n must"),
    "inserting_after another graph's node": (
        lambda gm: gm.graph.inserting_after(_other_node()).__enter__(), ValueError, r": n is node"),
    "node_copy node": (lambda gm: gm.graph.node_copy(None), TypeError, r"\bnode must"),
    "node_copy arg_transform": (lambda gm: gm.graph.node_copy(_node(gm, "add"), 3), TypeError,
                                r"arg_transform"),
    "graph_copy g": (lambda gm: gm.graph.graph_copy(gm, {}), TypeError, r"\bg must.*pass gm\.graph"),
    "graph_copy val_map": (lambda gm: fx.Graph().graph_copy(gm.graph, None), TypeError, r"val_map"),
    "eliminate_dead_code is_impure_node": (lambda gm: gm.graph.eliminate_dead_code(True), TypeError,
                                           r"is_impure_node"),
    "Node.args setter": (lambda gm: setattr(_node(gm, "add"), "args", 3), TypeError, r"\bargs\b"),
    "Node.kwargs setter": (lambda gm: setattr(_node(gm, "add"), "kwargs", 3), TypeError, r"\bkwargs\b"),
    "Node.args reads an erased node": (
        lambda gm: setattr(_node(gm, "add"), "args", (_node(gm, "lin"), _erased_node())),
        RuntimeError, r"args or kwargs.*erased"),
    # ------------------------------------------------------------------ tracing
    "symbolic_trace concrete_args str": (lambda gm: fx.symbolic_trace(Net(), concrete_args="x"),
                                         TypeError, r"concrete_args.*dict"),
    "symbolic_trace concrete_args list": (
        lambda gm: fx.symbolic_trace(lambda x, y: x + y, concrete_args=["y"]), TypeError,
        r"concrete_args.*tuple"),
    "Tracer.trace concrete_args int": (lambda gm: fx.Tracer().trace(Net(), 3), TypeError,
                                       r"concrete_args"),
    "Tracer autowrap_modules": (lambda gm: fx.Tracer(autowrap_modules=3), TypeError,
                                r"autowrap_modules"),
    "Tracer autowrap_modules item": (lambda gm: fx.Tracer(autowrap_modules=("math",)), TypeError,
                                     r"autowrap_modules.*module"),
    "Tracer autowrap_functions item": (lambda gm: fx.Tracer(autowrap_functions=(3,)), TypeError,
                                       r"autowrap_functions"),
    "wrap fn_or_name": (lambda gm: fx.wrap(3), TypeError, r"fn_or_name"),
    # ------------------------------------------------------------------ fxlite.passes
    "cse gm": (lambda gm: cse(None), TypeError, r"cse: gm must"),
    "normalize gm is a graph": (lambda gm: normalize(gm.graph), TypeError,
                                r"normalize: gm must.*owning_module"),
    "decompose gm": (lambda gm: decompose(nn.ReLU()), TypeError, r"decompose: gm must.*symbolic_trace"),
    "decompose rules": (lambda gm: decompose(gm, rules=[torch.relu]), TypeError, r"\brules\b"),
    "fold_constants gm": (lambda gm: fold_constants(3), TypeError, r"fold_constants: gm must"),
    "fold_conv_bn gm": (lambda gm: fold_conv_bn(torch.fx.symbolic_trace(Net())), TypeError,
                        r"fold_conv_bn: gm must.*torch\.fx"),
    "fuse gm": (lambda gm: fuse(None), TypeError, r"fuse: gm must"),
    "fuse max_group_size": (lambda gm: fuse(gm, max_group_size=0), ValueError, r"max_group_size"),
    "fuse max_group_size type": (lambda gm: fuse(gm, max_group_size="4"), TypeError,
                                 r"max_group_size"),
    "sink_views gm": (lambda gm: sink_views(None), TypeError, r"sink_views: gm must"),
    "unpack_attention gm": (lambda gm: unpack_attention(None), TypeError, r"unpack_attention: gm must"),
    "split_by_tags gm": (lambda gm: split_by_tags(None, ["a"]), TypeError, r"split_by_tags: gm must"),
    "split_by_tags tags": (lambda gm: (_tag_all(gm), split_by_tags(gm, "a")), TypeError, r"\btags\b"),
    "split_module gm": (lambda gm: split_module(None, gm, lambda n: 0), TypeError,
                        r"split_module: gm must"),
    "split_module root_m": (lambda gm: split_module(gm, None, lambda n: 0), TypeError, r"root_m"),
    "split_module split_callback": (lambda gm: split_module(gm, gm, None), TypeError,
                                    r"split_callback"),
    "split_module qualname_map": (lambda gm: split_module(gm, gm, lambda n: 0, qualname_map=[]),
                                  TypeError, r"qualname_map"),
    "PassManager passes is one pass": (lambda gm: PassManager(cse), TypeError,
                                       r"passes.*PassManager\(\[cse\]\)"),
    "PassManager a pass": (lambda gm: PassManager([cse, 3]), TypeError, r"a pass must be callable"),
    "PassManager gm": (lambda gm: PassManager([cse])(gm.graph), TypeError,
                       r"PassManager: gm must be a fxlite.GraphModule"),
    "normalize_graph graph": (lambda gm: normalize_graph(gm), TypeError, r"\bgraph\b.*gm\.graph"),
    "normalize_graph module": (lambda gm: normalize_graph(gm.graph, module=3), TypeError,
                               r"\bmodule\b"),
    "produces_tensor node": (lambda gm: produces_tensor("add"), TypeError, r"\bnode\b"),
    "extract_tensor_metadata t": (lambda gm: extract_tensor_metadata([1.0]), TypeError, r"\bt must"),
    "register_decomposition target": (lambda gm: register_decomposition("relu"), TypeError,
                                       r"\btarget\b"),
    "register_decomposition table": (lambda gm: register_decomposition(torch.relu, table=[]),
                                      TypeError, r"\btable\b"),
    "register_decomposition when": (lambda gm: register_decomposition(torch.relu, when=True),
                                     TypeError, r"\bwhen\b"),
    "diff before": (lambda gm: diff(None, gm, print_output=False), TypeError, r"\bbefore is None"),
    "diff after": (lambda gm: diff(gm, "after", print_output=False), TypeError, r"\bafter is str"),
    "to_dot graph_or_gm": (lambda gm: to_dot(None), TypeError, r"graph_or_gm"),
    "to_dot name": (lambda gm: to_dot(gm, name=3), TypeError, r"\bname\b"),
    "draw graph_or_gm": (lambda gm: draw(nn.ReLU(), "never_written.dot"), TypeError,
                         r"draw: graph_or_gm.*symbolic_trace"),
    "draw path": (lambda gm: draw(gm, None), TypeError, r"\bpath\b"),
    "to_networkx graph_or_gm": (lambda gm: to_networkx([gm]), TypeError, r"graph_or_gm"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_argument_is_named_and_changes_nothing(case: str) -> None:
    call, error, argument = CASES[case]
    gm = _gm()
    before = _snapshot(gm)
    with pytest.raises(error, match=argument) as info:
        call(gm)
    assert not isinstance(info.value, (AttributeError, KeyError, IndexError)), info.value
    assert _snapshot(gm) == before
    assert gm(torch.ones(2, 4)).shape == (2, 4)  # and it still runs


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 40


# ---------------------------------------------------------------------- beyond the snapshot
def test_refused_nodes_take_no_name() -> None:
    gm = _gm()
    for bad in (lambda: gm.graph.call_method(None), lambda: gm.graph.create_node("bogus", "relu"),
                lambda: gm.graph.create_node("call_function", torch.relu, (_erased_node(),),
                                             name="relu")):
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            bad()
    with gm.graph.inserting_before(gm.graph.output_node()):
        assert gm.graph.call_function(torch.relu, (_node(gm, "mul"),)).name == "relu_1"


def test_erase_node_twice_names_the_node() -> None:
    gm = _gm()
    mul = _node(gm, "mul")
    gm.graph.output_node().args = (_node(gm, "relu"),)
    gm.graph.erase_node(mul)
    text = str(gm.graph)
    with pytest.raises(RuntimeError, match="to_erase, node 'mul', was already erased"):
        gm.graph.erase_node(mul)
    assert str(gm.graph) == text


def test_erase_node_of_another_graph_leaves_both_graphs() -> None:
    gm = _gm()
    node = _other_node()
    other_before = str(node.graph)
    with pytest.raises(RuntimeError, match=r"erase it from its own graph"):
        gm.graph.erase_node(node)
    assert str(node.graph) == other_before
    node.graph.lint()


def test_refused_args_keep_the_users_bookkeeping() -> None:
    gm = _gm()
    add = _node(gm, "add")
    with pytest.raises(RuntimeError):
        add.args = (_node(gm, "lin"), _erased_node())
    assert add.args == (_node(gm, "lin"), 1) and add in _node(gm, "lin").users
    gm.graph.lint()


def test_add_submodule_checks_before_creating_parents() -> None:
    gm = _gm()
    with pytest.raises(TypeError):
        gm.add_submodule("new.deep", "not a module")
    assert not hasattr(gm, "new")


def test_draw_refuses_before_writing(tmp_path) -> None:
    with pytest.raises(TypeError):
        draw(None, tmp_path / "g.dot")
    assert not list(tmp_path.iterdir())


def test_register_decomposition_refuses_before_registering() -> None:
    before = dict(DECOMPOSITIONS)
    with pytest.raises(TypeError, match="rule"):
        register_decomposition(torch.relu)(3)
    assert DECOMPOSITIONS == before


def test_exception_types_match_torch_fx_where_it_has_one() -> None:
    # torch.fx: RuntimeError('Unsupported type None passed for root!'); fxlite's is both.
    tgm = torch.fx.symbolic_trace(Net())
    with pytest.raises(RuntimeError):
        torch.fx.GraphModule(None, tgm.graph)
    with pytest.raises(RuntimeError):
        fx.GraphModule(None, _gm().graph)
    with pytest.raises(TypeError):
        fx.GraphModule(None, _gm().graph)
    # a node in use, and a node of another graph: RuntimeError in both
    used = next(n for n in tgm.graph.nodes if n.op == "call_module")
    with pytest.raises(RuntimeError):
        tgm.graph.erase_node(used)
    with pytest.raises(RuntimeError):
        _gm().graph.erase_node(_node(_gm(), "lin"))
    # torch.fx fails on these too, with a bare AttributeError or TypeError from inside
    for call in (lambda: torch.fx.Interpreter(None), lambda: tgm.graph.erase_node(None),
                 lambda: torch.fx.symbolic_trace(Net(), concrete_args="x")):
        with pytest.raises((AttributeError, TypeError)):
            call()


def test_messages_say_what_was_given_and_how_to_fix_it() -> None:
    with pytest.raises(TypeError) as info:
        cse(nn.Linear(2, 2))
    assert str(info.value).startswith("cse: gm must be a fxlite.GraphModule, not Linear (Linear(")
    assert "fxlite.symbolic_trace(gm)" in str(info.value)
    with pytest.raises(TypeError) as info:
        fx.Interpreter(nn.Linear(2, 2))
    assert "Interpreter(fxlite.symbolic_trace(module))" in str(info.value)
    assert "graph=graph" in str(info.value)


# ---------------------------------------------------------------------- unprintable constants
class Foo:
    def __repr__(self) -> str:
        raise RuntimeError("repr is broken")


class Custom:
    def _custom_fx_repr_fn(self) -> str:
        raise ValueError("so is this")


class BadCallable:
    def __call__(self, x: Any) -> Any:
        return x

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class BadType:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def _unprintable_graph() -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y", default_value=Foo())
    a = g.call_function(operator.add, (x, Foo()), {"k": [1, (Foo(), {"d": Foo()})]})
    b = g.call_function(BadCallable(), (a, Custom(), slice(Foo(), 2)))
    c = g.call_method("add", (b, y), type_expr=BadType())
    g.output((c, Foo()))
    return g


def test_str_graph_shows_a_placeholder() -> None:
    text = str(_unprintable_graph())
    assert "%y : [num_users=1] = placeholder[target=y][default=<unprintable Foo>]" in text
    assert "args = (%x, <unprintable Foo>), kwargs = {k: [1, (<unprintable Foo>, " \
           "{d: <unprintable Foo>})]}" in text
    assert "<unprintable Custom>" in text and "slice(<unprintable Foo>, 2, None)" in text
    assert "<unprintable BadCallable>" in text and "<unprintable BadType>" in text
    assert "return (add_1, <unprintable Foo>)" in text


def test_print_tabular_shows_a_placeholder(capsys) -> None:
    g = _unprintable_graph()
    g.print_tabular()
    out = capsys.readouterr().out
    assert "(x, <unprintable Foo>)" in out
    assert "{'k': [1, (<unprintable Foo>, {'d': <unprintable Foo>})]}" in out
    assert "((add_1, <unprintable Foo>),)" in out
    assert "<unprintable BadCallable>" in out
    assert "<unprintable BadCallable>" in tabular(g, width=200)  # the command's fitted table


def test_html_view_shows_a_placeholder() -> None:
    g = _unprintable_graph()
    page = g._repr_html_()
    assert "&lt;unprintable Foo&gt;" in page and "<unprintable" not in page
    gm = fx.GraphModule(nn.Module(), g)
    assert "&lt;unprintable Foo&gt;" in gm._repr_html_()


def test_other_views_of_an_unprintable_constant() -> None:
    g = _unprintable_graph()
    assert "&lt;unprintable BadCallable&gt;" in to_dot(g)  # labels show targets, escaped
    changes = diff(fx.Graph(), g, print_output=False).format(width=None)
    assert "<unprintable Foo>" in changes
    g.lint()
    gm = fx.GraphModule(nn.Module(), g)  # the generated code holds the constant by reference
    assert "def forward" in gm.code


def test_a_failing_node_with_an_unprintable_constant_reports_its_line() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(operator.add, (x, Foo())))
    with pytest.raises(TypeError) as info:
        fx.Interpreter(fx.GraphModule(nn.Module(), g)).run(torch.ones(2))
    assert "<unprintable Foo>" in "\n".join(getattr(info.value, "__notes__", []))


def test_describe_value_never_raises() -> None:
    from fxlite.node import describe_value, safe_repr

    assert safe_repr(Foo()) == "<unprintable Foo>"
    assert describe_value(Foo()) == "Foo (<unprintable Foo>)"
    assert describe_value(None) == "None" and describe_value(3) == "int (3)"
    assert describe_value("a" * 80).endswith("...)")
    with pytest.raises(TypeError, match="not Foo"):
        fx.symbolic_trace(Foo())


# ---------------------------------------------------------------------- rewriting, files
@pytest.mark.parametrize("call, argument", [
    (lambda gm: fxlite.replace_pattern(None, torch.relu, torch.relu), "gm"),
    (lambda gm: fxlite.replace_pattern_with_filters(3, torch.relu, torch.relu), "gm"),
    (lambda gm: fxlite.SubgraphMatcher(None), "pattern"),
    (lambda gm: fxlite.save(gm, None), "path"),
    (lambda gm: fxlite.load(None), "path"),
    (lambda gm: fxlite.export(None), "fn"),
    (lambda gm: fxlite.explain(None)(), "fn"),
], ids=["replace_pattern", "replace_pattern_with_filters", "SubgraphMatcher", "save", "load",
        "export", "explain"])
def test_rewrites_files_and_capture_name_their_bad_argument(call, argument):
    gm = fxlite.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    code = gm.code
    with pytest.raises(TypeError, match=argument):
        call(gm)
    assert gm.code == code
