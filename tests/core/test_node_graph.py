"""Unit tests of the IR: Node bookkeeping, Graph editing, DCE, lint, naming and printing."""

from __future__ import annotations

import builtins
import keyword
import operator

import pytest
import torch

import fxlite as fx
from fxlite.node import map_arg


def _chain() -> tuple[fx.Graph, fx.Node, fx.Node, fx.Node, fx.Node]:
    """x -> relu -> neg -> output."""
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.relu, (x,))
    n = g.call_function(torch.neg, (r,))
    out = g.output(n)
    return g, x, r, n, out


def _names(g: fx.Graph) -> list[str]:
    return [n.name for n in g.nodes]


# ---------------------------------------------------------------------- opcodes
def test_opcodes_compare_equal_to_strings():
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    f = g.call_function(operator.add, (x, w))
    m = g.call_method("relu", (f,))
    c = g.call_module("lin", (m,))
    o = g.output(c)
    expected = ["placeholder", "get_attr", "call_function", "call_method", "call_module", "output"]
    for node, op in zip([x, w, f, m, c, o], expected):
        assert node.op == op
        assert str(node.op) == op
        assert f"{node.op}" == op
        assert {op: 1}[node.op] == 1  # hashes like the string
        assert node.op != "something_else"


def test_unknown_opcode_rejected():
    g = fx.Graph()
    with pytest.raises(ValueError, match="opcode"):
        g.create_node("call_lambda", torch.relu)


# ---------------------------------------------------------------------- users bookkeeping
def test_args_setter_keeps_users_consistent():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    add = g.call_function(operator.add, (x, x))
    g.output(add)
    assert list(x.users) == [add] and not y.users
    add.args = (y, 1)
    assert not x.users and list(y.users) == [add]
    assert add.all_input_nodes == [y]
    add.kwargs = {"alpha": x}
    assert list(x.users) == [add]
    assert add.all_input_nodes == [y, x]
    add.kwargs = {}
    assert not x.users
    g.lint()


def test_nested_args_are_tracked():
    g = fx.Graph()
    a, b, c = (g.placeholder(n) for n in "abc")
    cat = g.call_function(torch.cat, ([a, (b, {"k": c})],), {"dim": 0})
    g.output(cat)
    assert cat.all_input_nodes == [a, b, c]
    for p in (a, b, c):
        assert cat in p.users
    s = g.call_function(operator.getitem, (a, slice(b, None)))
    assert a in s.all_input_nodes and b in s.all_input_nodes


def test_map_arg_maps_only_nodes_and_keeps_structure():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    arg = (a, [b, 3], {"k": a, "j": "s"}, slice(b, 2))
    mapped = map_arg(arg, lambda n: n.name)
    assert mapped == ("a", ["b", 3], {"k": "a", "j": "s"}, slice("b", 2))
    assert fx.map_arg is map_arg


def test_replace_all_uses_with():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    u1 = g.call_function(torch.relu, (x,))
    u2 = g.call_function(operator.add, (x, u1))
    g.output((u2, x))
    out = g.output_node()
    changed = x.replace_all_uses_with(y)
    assert set(changed) == {u1, u2, out}
    assert not x.users
    assert set(y.users) == {u1, u2, out}
    assert u1.args == (y,) and u2.args == (y, u1) and out.args == ((u2, y),)
    g.lint()


def test_replace_all_uses_with_delete_user_cb():
    g, x, r, n, out = _chain()
    with g.inserting_after(r):
        extra = g.call_function(torch.sigmoid, (r,))
    changed = r.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
    assert changed == [n]
    assert extra.args == (r,) and n.args == (extra,)
    g.lint()


def test_replace_input_with_update_arg_update_kwarg():
    g = fx.Graph()
    x, y, z = (g.placeholder(n) for n in "xyz")
    node = g.call_function(torch.clamp, (x, x), {"max": x})
    g.output(node)
    node.replace_input_with(x, y)
    assert node.args == (y, y) and node.kwargs == {"max": y}
    assert not x.users
    node.update_arg(1, z)
    assert node.args == (y, z)
    assert set(node.all_input_nodes) == {y, z}
    node.update_kwarg("max", 3.0)
    assert node.kwargs == {"max": 3.0}
    node.update_kwarg("min", x)
    assert node.kwargs == {"max": 3.0, "min": x}
    assert node in x.users and node in z.users
    g.lint()


# ---------------------------------------------------------------------- list position
def test_prepend_and_append_move_nodes():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    b = g.call_function(torch.sigmoid, (x,))
    c = g.call_function(torch.tanh, (x,))
    g.output((a, b, c))
    assert _names(g) == ["x", "relu", "sigmoid", "tanh", "output"]
    a.prepend(c)
    assert _names(g) == ["x", "tanh", "relu", "sigmoid", "output"]
    x.append(b)
    assert _names(g) == ["x", "sigmoid", "tanh", "relu", "output"]
    assert b.prev is x and b.next is c
    assert len(g.nodes) == 5
    g.lint()
    a.prepend(a)  # as in torch.fx: a node moved next to itself stays where it is
    a.append(a)
    assert _names(g) == ["x", "sigmoid", "tanh", "relu", "output"]
    g.lint()


def test_erase_node_raises_with_users_and_removes_otherwise():
    g, x, r, n, out = _chain()
    with pytest.raises(RuntimeError, match="relu") as info:
        g.erase_node(r)
    assert "neg" in str(info.value)  # names the user
    out.args = (r,)
    g.erase_node(n)
    assert _names(g) == ["x", "relu", "output"]
    assert len(g.nodes) == 3
    assert list(r.users) == [out]
    g.lint()


def test_erase_while_iterating_is_safe():
    g = fx.Graph()
    x = g.placeholder("x")
    dead = [g.call_function(torch.relu, (x,)) for _ in range(5)]
    g.output(x)
    for node in g.nodes:
        if node in dead:
            g.erase_node(node)
    assert _names(g) == ["x", "output"]


def test_inserting_before_and_after_keep_creation_order():
    g, x, r, n, out = _chain()
    with g.inserting_after(r):
        a = g.call_function(torch.sin, (r,))
        b = g.call_function(torch.cos, (a,))
        c = g.call_function(torch.exp, (b,))
    assert _names(g) == ["x", "relu", "sin", "cos", "exp", "neg", "output"]
    with g.inserting_before(r):
        d = g.call_function(torch.floor, (x,))
        e = g.call_function(torch.sqrt, (d,))
    assert _names(g) == ["x", "floor", "sqrt", "relu", "sin", "cos", "exp", "neg", "output"]
    with g.inserting_before(None):  # the very beginning
        first = g.placeholder("first")
    assert next(iter(g.nodes)) is first
    for node in (a, b, c, d, e):
        assert node.graph is g
    g.lint()


def test_insertion_point_is_restored_after_context():
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.relu, (x,))
    with g.inserting_before(r):
        with g.inserting_after(x):
            inner = g.call_function(torch.sin, (x,))
        outer = g.call_function(torch.cos, (x,))
    last = g.call_function(torch.neg, (r,))
    assert _names(g) == ["x", "sin", "cos", "relu", "neg"]
    assert [inner.name, outer.name, last.name] == ["sin", "cos", "neg"]


# ---------------------------------------------------------------------- copying and lookup
def test_node_copy_into_another_graph():
    g, x, r, n, out = _chain()
    r.meta["tag"] = [1]
    g2 = fx.Graph()
    x2 = g2.placeholder("inp")
    r2 = g2.node_copy(r, lambda old: {x: x2}[old])
    assert (r2.op, r2.target, r2.args, r2.name) == ("call_function", torch.relu, (x2,), "relu")
    assert r2.graph is g2 and r2.meta == {"tag": [1]}
    r2.meta["other"] = 1
    assert "other" not in r.meta  # meta is a new dict
    assert not x.users.keys() - {r}  # the original is untouched
    g2.output(r2)
    g2.lint()


def test_graph_copy_with_val_map():
    g, x, r, n, out = _chain()
    g2 = fx.Graph()
    y = g2.placeholder("y")
    val_map = {x: y}
    result = g2.graph_copy(g, val_map)
    g2.output(result)
    assert result is val_map[n]
    assert [node.op for node in g2.nodes] == ["placeholder", "call_function", "call_function", "output"]
    assert val_map[r].args == (y,)
    g2.lint()
    g.lint()
    assert len(g.nodes) == 4


def test_find_nodes_and_output_node():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    b = g.call_function(torch.neg, (a,))
    c = g.call_function(torch.relu, (b,))
    m = g.call_method("sum", (c,))
    out = g.output(m)
    assert g.find_nodes(op="call_function", target=torch.relu) == [a, c]
    assert g.find_nodes(op="call_function") == [a, b, c]
    assert g.find_nodes(op="call_method", target="sum") == [m]
    assert g.find_nodes(op="placeholder") == [x]
    assert g.find_nodes(op="get_attr") == []
    assert g.output_node() is out


# ---------------------------------------------------------------------- dead code
def test_eliminate_dead_code_removes_pure_dead_nodes():
    g = fx.Graph()
    x = g.placeholder("x")
    dead1 = g.call_function(operator.mul, (x, 2))
    g.call_function(torch.relu, (dead1,))  # dead, and makes dead1 dead only once it is gone
    g.call_method("sum", (x,))
    live = g.call_function(operator.add, (x, 1))
    g.output(live)
    assert g.eliminate_dead_code() is True
    assert _names(g) == ["x", "add", "output"]
    assert g.eliminate_dead_code() is False
    g.lint()


def test_eliminate_dead_code_keeps_impure_nodes():
    g = fx.Graph()
    x = g.placeholder("x")
    unused_input = g.placeholder("unused")
    inplace_m = g.call_method("add_", (x, 1))
    inplace_f = g.call_function(operator.iadd, (x, 1))
    rnd = g.call_function(torch.rand_like, (x,))
    prt = g.call_function(print, ("side effect",))
    st = g.call_function(operator.setitem, (x, 0, 1.0))
    dead = g.call_function(torch.neg, (x,))
    g.output(x)
    g.eliminate_dead_code()
    kept = list(g.nodes)
    for node in (unused_input, inplace_m, inplace_f, rnd, prt, st):
        assert node in kept, node.name
    assert dead not in kept


def test_eliminate_dead_code_custom_impurity():
    g = fx.Graph()
    x = g.placeholder("x")
    keep = g.call_function(torch.neg, (x,))
    g.output(x)
    g.eliminate_dead_code(is_impure_node=lambda n: n is keep)
    assert keep in list(g.nodes)


# ---------------------------------------------------------------------- lint
def test_lint_accepts_well_formed_graph():
    g, *_ = _chain()
    g.lint()


def test_lint_use_before_def():
    g = fx.Graph()
    x = g.placeholder("x")
    first = g.create_node("call_function", torch.relu, (x,), name="first_op")
    second = g.create_node("call_function", torch.neg, (first,), name="second_op")
    g.output(second)
    first.prepend(second)  # second now runs before its input
    with pytest.raises(RuntimeError, match="second_op"):
        g.lint()


def test_lint_node_from_another_graph():
    g, x, r, n, out = _chain()
    other = fx.Graph()
    stranger = other.placeholder("stranger")
    n.args = (stranger,)
    with pytest.raises(RuntimeError, match="neg"):
        g.lint()


def test_lint_broken_users_bookkeeping():
    g, x, r, n, out = _chain()
    del r.users[n]  # n still reads r, but r forgot it
    with pytest.raises(RuntimeError, match="neg|relu"):
        g.lint()
    g2, x2, r2, n2, _ = _chain()
    x2.users[n2] = None  # x2 claims a user that does not read it
    with pytest.raises(RuntimeError, match="'x'|neg"):
        g2.lint()


def test_lint_missing_get_attr_target():
    root = torch.nn.Module()
    root.register_buffer("present", torch.ones(1))
    g = fx.Graph(owning_module=root)
    x = g.placeholder("x")
    ok = g.get_attr("present")
    bad = g.create_node("get_attr", "absent_weight", name="bad_attr")
    g.output((x, ok, bad))
    with pytest.raises(RuntimeError, match="bad_attr") as info:
        g.lint()
    assert "absent_weight" in str(info.value)


def test_lint_missing_call_module_target():
    root = torch.nn.Module()
    g = fx.Graph(owning_module=root)
    x = g.placeholder("x")
    with pytest.warns(UserWarning, match="no underlying reference.*no_such_module"):
        c = g.call_module("no_such_module", (x,))
    g.output(c)
    with pytest.raises(RuntimeError, match="no_such_module"):
        g.lint()


def test_lint_requires_output_last():
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(x)
    g.call_function(torch.relu, (x,))  # after the output
    with pytest.raises(RuntimeError, match="output"):
        g.lint()


# ---------------------------------------------------------------------- naming
@pytest.mark.parametrize("hint", ["class", "sum", "1abc", "a-b", "input", "len", "def", "x.y",
                                  "it's", "(x)", "self"])
def test_names_are_valid_identifiers(hint):
    g = fx.Graph()
    nodes = [g.placeholder(hint)]
    nodes.append(g.create_node("call_function", torch.relu, (nodes[0],), name=hint))
    nodes.append(g.call_module(hint, (nodes[0],)))
    nodes.append(g.get_attr(hint))
    nodes.append(g.call_method(hint, (nodes[0],)))
    for node in nodes:
        assert node.name.isidentifier(), node.name
        assert not keyword.iskeyword(node.name), node.name
        assert node.name not in dir(builtins), node.name
    assert len({n.name for n in nodes}) == len(nodes)


def test_names_unique_and_suffixed():
    g = fx.Graph()
    x = g.placeholder("x")
    adds = [g.call_function(operator.add, (x, i)) for i in range(3)]
    s = g.call_function(torch.sum, (x,))
    assert [a.name for a in adds] == ["add", "add_1", "add_2"]
    assert s.name == "sum_1"
    explicit = g.create_node("call_function", torch.relu, (x,), name="add_1")
    assert explicit.name not in {a.name for a in adds}
    names = _names(g)
    assert len(names) == len(set(names))


def test_name_freed_after_erase_does_not_collide():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    b = g.call_function(torch.relu, (x,))
    g.erase_node(a)
    c = g.call_function(torch.relu, (x,))
    assert c.name != b.name


# ---------------------------------------------------------------------- printing
def _add_graph() -> fx.Graph:
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    g.output(g.call_function(operator.add, (x, y)))
    return g


def test_str_graph_format():
    expected = (
        "graph():\n"
        "    %x : [num_users=1] = placeholder[target=x]\n"
        "    %y : [num_users=1] = placeholder[target=y]\n"
        "    %add : [num_users=1] = call_function[target=operator.add](args = (%x, %y), kwargs = {})\n"
        "    return add"
    )
    assert str(_add_graph()).strip() == expected


def test_format_node_kinds():
    g = fx.Graph()
    x = g.placeholder("x", default_value=3)
    w = g.get_attr("lin.weight")
    m = g.call_method("view", (x, -1))
    s = g.call_function(torch.sum, (m,), {"dim": 0})
    c = g.call_module("lin", (s,))
    out = g.output((c, w))
    assert x.format_node().startswith("%x : [num_users=1] = placeholder[target=x]")
    assert "default=3" in x.format_node()
    assert w.format_node() == "%lin_weight : [num_users=1] = get_attr[target=lin.weight]"
    assert m.format_node() == "%view : [num_users=1] = call_method[target=view](args = (%x, -1), kwargs = {})"
    assert s.format_node() == "%sum_1 : [num_users=1] = call_function[target=torch.sum](args = (%view,), kwargs = {dim: 0})"
    assert c.format_node() == "%lin : [num_users=1] = call_module[target=lin](args = (%sum_1,), kwargs = {})"
    assert out.format_node() == "return (lin, lin_weight)"


def test_print_tabular_format(capsys):
    _add_graph().print_tabular()
    expected = """\
opcode         name    target                   args    kwargs
-------------  ------  -----------------------  ------  --------
placeholder    x       x                        ()      {}
placeholder    y       y                        ()      {}
call_function  add     <built-in function add>  (x, y)  {}
output         output  output                   (add,)  {}
"""
    assert capsys.readouterr().out.strip() == expected.strip()


def test_meta_and_stack_trace():
    g, x, r, n, out = _chain()
    assert r.meta == {}
    r.meta["k"] = 1
    assert n.meta.get("k") is None
    r.stack_trace = 'File "model.py", line 3, in forward'
    assert r.stack_trace == 'File "model.py", line 3, in forward'
    assert n.stack_trace is None
