"""torch.fx API that fxlite mirrors: codegen hooks, side effects, saving, TorchScript, and the
smaller node, graph and interpreter methods."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import re
import weakref

import pytest
import torch
from torch.testing import assert_close

import fxlite as fx
from fxlite.interpreter import Interpreter

ShapeProp = fx.passes.ShapeProp


class _ListCodeGen(fx.CodeGen):
    """forward(self, args_list) instead of forward(self, a, b)."""

    def gen_fn_def(self, free_vars, maybe_return_annotation):
        return (f"def forward(self, args_list: list[torch.Tensor]){maybe_return_annotation}:\n"
                f"    {', '.join(free_vars)} = args_list")

    def additional_globals(self):
        return [("torch", torch)]

    def process_inputs(self, *inputs):
        return inputs[0]


def test_codegen_hook_changes_the_signature_everywhere():
    gm = fx.symbolic_trace(lambda a, b: a + b)
    gm.graph.set_codegen(_ListCodeGen())
    gm.recompile()
    assert "def forward(self, args_list: list[torch.Tensor]):" in gm.code
    a, b = torch.randn(3), torch.randn(3)
    assert_close(gm([a, b]), a + b)
    assert_close(Interpreter(gm).run([a, b]), a + b)
    assert_close(fx.Transformer(gm).transform()([a, b]), a + b)
    assert_close(copy.deepcopy(gm)([a, b]), a + b)
    assert_close(torch.jit.script(gm)([a, b]), a + b)


@fx.has_side_effect
@fx.wrap
def _log(x):
    return None


def test_has_side_effect_and_is_impure_keep_nodes_through_dce():
    def f(x):
        _log(x)
        x.add_(1)
        torch.rand_like(x)
        return x

    gm = fx.symbolic_trace(f)
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert [n.is_impure() for n in calls] == [True, True, True]
    assert not calls[2].is_impure(impure_random=False)
    gm.graph.eliminate_dead_code()
    assert [n.target for n in gm.graph.nodes if n.op != "placeholder"][:2] == [_log, "add_"]


def test_graph_module_with_torch_ops_prints_pickles_and_deep_copies():
    def f(a):
        return torch.ops.aten.add.Tensor(torch.ops.aten.sigmoid(a), a)

    gm = fx.symbolic_trace(f)
    assert "torch.ops.aten.add.Tensor(sigmoid, a)" in gm.code
    assert "target=torch.ops.aten.sigmoid]" in str(gm.graph)
    x = torch.randn(4)
    for copied in (pickle.loads(pickle.dumps(gm)), copy.deepcopy(gm)):
        assert_close(copied(x), torch.sigmoid(x) + x)
        assert any(n.target is torch.ops.aten.add.Tensor for n in copied.graph.nodes)


def test_shape_metadata_survives_torch_save_at_its_default_protocol():
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
    ShapeProp(gm).propagate(torch.randn(4, 3))
    buf = io.BytesIO()
    torch.save(gm, buf)  # protocol 2: torch.memory_format alone does not pickle there
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    metas = [n.meta["tensor_meta"] for n in loaded.graph.nodes if "tensor_meta" in n.meta]
    assert metas[-1].shape == torch.Size([4, 2])
    assert metas[-1].memory_format is torch.contiguous_format


def test_jit_script_of_a_traced_module():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return torch.relu(self.lin(x)) + x.shape[0]

    gm = fx.symbolic_trace(M())
    x = torch.randn(2, 3)
    assert_close(torch.jit.script(gm)(x), gm(x))


def test_replace_pattern_deletes_the_submodules_it_replaced():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sigmoid = torch.nn.Sigmoid()
            self.keep = torch.nn.ReLU()

        def forward(self, x):
            return self.keep(self.sigmoid(x))

    class Pattern(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sigmoid = torch.nn.Sigmoid()

        def forward(self, x):
            return self.sigmoid(x)

    class Replacement(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tanh = torch.nn.Tanh()

        def forward(self, x):
            return self.tanh(x)

    gm = fx.symbolic_trace(M())
    assert len(fx.subgraph_rewriter.replace_pattern(gm, Pattern(), Replacement())) == 1
    assert not hasattr(gm, "sigmoid") and hasattr(gm, "tanh") and hasattr(gm, "keep")
    x = torch.randn(3)
    assert_close(gm(x), torch.relu(torch.tanh(x)))


def test_nodes_take_weak_references_and_insert_arg():
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.relu, (x,))
    n = g.call_function(torch.neg, (x,))
    out = g.output((r,))
    out.insert_arg(0, n)
    assert out.args == (n, (r,)) and out in n.users
    out.args = ((r,),)
    ref = weakref.ref(n)
    g.erase_node(n)
    del n
    gc.collect()
    assert ref() is None


def test_boxed_run_empties_the_list_and_checks_its_length():
    gm = fx.symbolic_trace(lambda a, b: a - b)
    interp = Interpreter(gm)
    args = [torch.tensor(3.0), torch.tensor(1.0)]
    assert_close(interp.boxed_run(args), torch.tensor(2.0))
    assert args == []
    too_many = [torch.tensor(1.0)] * 3
    with pytest.raises(RuntimeError, match="extra arguments"):
        interp.boxed_run(too_many)
    assert len(too_many) == 3


def test_error_messages_keep_torch_fx_phrases():
    gm = fx.symbolic_trace(lambda x: torch.relu(x + 1))
    add = next(n for n in gm.graph.nodes if n.name == "add")
    with pytest.raises(RuntimeError, match="but it still had 1 users in the graph: relu"):
        gm.graph.erase_node(add)
    with pytest.warns(UserWarning, match="no underlying reference.*'missing'"):
        gm.graph.get_attr("missing")
    with pytest.raises(fx.TraceError, match="Proxy object cannot be iterated"):
        fx.symbolic_trace(lambda x: list(x))


def test_error_in_a_generated_line_shows_that_line(capsys):
    gm = fx.symbolic_trace(lambda x: torch.relu(x + 1))
    with pytest.raises(TypeError):
        gm("not a tensor")
    err = capsys.readouterr().err
    assert re.search(r"line \d+ of the traced Module's generated forward function", err)
    assert "--> " in err and "add = x + 1" in err


def test_passes_and_subgraph_rewriter_are_attributes():
    assert fx.passes.ShapeProp is ShapeProp
    assert fx.subgraph_rewriter.replace_pattern is fx.replace_pattern
