"""Malformed graphs and failing copies give clear errors that name the node, and change nothing."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from fxlite.passes import PassError, PassManager, cse, decompose, normalize, split_module
from torch import nn

import fxlite as fx
from fxlite.graph_pickle import NodeRef


def _cyclic() -> fx.GraphModule:
    """x -> add(relu, 1) -> relu(add) -> mul: add and relu read each other."""
    gm = fx.symbolic_trace(lambda x: torch.relu(x + 1) * 2)
    add = next(n for n in gm.graph.nodes if n.name == "add")
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    add.args = (relu, 1)
    return gm


def _snapshot(gm: fx.GraphModule) -> tuple:
    return str(gm.graph), gm.code, [(n.name, n.op, n.target, n.args, n.kwargs) for n in gm.graph.nodes]


OPERATIONS = {
    "normalize": normalize,
    "decompose": decompose,
    "split_module": lambda gm: split_module(gm, gm, lambda n: 0 if n.name == "mul" else 1),
    "deepcopy": copy.deepcopy,
    "deepcopy graph": lambda gm: copy.deepcopy(gm.graph),
    "pickle": pickle.dumps,
}


@pytest.mark.parametrize("op", OPERATIONS)
def test_cyclic_graph_gives_a_clear_error_and_changes_nothing(op):
    gm = _cyclic()
    before = _snapshot(gm)
    with pytest.raises(RuntimeError) as info:
        OPERATIONS[op](gm)
    message = str(info.value)
    assert "'add'" in message and "'relu'" in message, message  # names the node and its input
    assert not isinstance(info.value, (KeyError, IndexError))
    assert _snapshot(gm) == before


def test_normalize_checks_before_rewriting():
    # Before the fix, normalize rewrote x + 1 to torch.add and only then failed lint.
    gm = _cyclic()
    with pytest.raises(RuntimeError, match="left unchanged"):
        normalize(gm)
    add = next(n for n in gm.graph.nodes if n.name == "add")
    assert add.target is not torch.add and add.op == "call_function"


def test_unpickling_damaged_data_names_the_node():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    state = gm.graph.__getstate__()
    name, op, target, args, kwargs, type_expr, meta = state["records"][1]
    state["records"][1] = (name, op, target, (NodeRef(7),), kwargs, type_expr, meta)
    g = fx.Graph.__new__(fx.Graph)
    with pytest.raises(RuntimeError, match=f"node {name!r} reads node #7"):
        g.__setstate__(state)


class Locked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.lin.lock = threading.Lock()  # deepcopy raises TypeError on it

    def forward(self, x):
        return torch.relu(self.lin(x)) + 0


@pytest.mark.parametrize("where", ["root", "submodule"])
def test_pass_manager_uncopyable_attribute_gives_pass_error(where):
    m = Locked()
    gm = fx.symbolic_trace(m)
    if where == "root":
        del gm.lin.lock
        gm.lock = threading.Lock()
    before = _snapshot(gm)
    pm = PassManager([cse, normalize])
    with pytest.raises(PassError) as info:
        pm(gm)
    err = info.value
    assert err.pass_name == "cse"
    assert ("'lock'" if where == "root" else "'lin.lock'") in str(err)
    assert isinstance(err.__cause__, TypeError)
    assert _snapshot(gm) == before
    assert pm.last_good is gm and pm.records[0].status == "copy failed"
    x = torch.randn(2, 3)
    torch.testing.assert_close(gm(x), m(x))
