"""A 10,000-node graph: every whole-graph operation must work without recursion limits.

The chain is traced once (module fixture) and each operation is checked on it. The
interpreter's recursion limit is lowered to 400 while the operations run, far below the
graph's length, so that any recursion over the node list, even a shallow one per node,
fails loudly instead of passing by luck. (That is what keeps CI fast at this size; the
100,000-node run, with times, is ``benchmarks/bench_big_graph.py``.)
"""

from __future__ import annotations

import contextlib
import copy
import operator
import pickle
import sys
from collections.abc import Iterator

import pytest
import torch

import fxlite as fx

STEPS = 3_334  # 3 nodes per step: 10,002 call nodes, plus placeholder and output
pytestmark = pytest.mark.slow


def chain(x):
    for _ in range(STEPS):
        x = torch.relu(x + 1.0) * 2.0
    return x


@contextlib.contextmanager
def shallow_stack(limit: int = 400) -> Iterator[None]:
    """Run with a low recursion limit: far below the graph's length, above pytest's own depth."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, len(_stack()) + 100))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def _stack() -> list:
    frames, f = [], sys._getframe()
    while f is not None:
        frames.append(f)
        f = f.f_back
    return frames


@pytest.fixture(scope="module")
def big() -> fx.GraphModule:
    with shallow_stack():
        graph = fx.Tracer().trace(chain)
        return fx.GraphModule(torch.nn.Module(), graph)  # recompiles


@pytest.fixture(scope="module")
def big_copy(big) -> fx.GraphModule:
    with shallow_stack():
        return copy.deepcopy(big)


def test_trace_and_run(big):
    assert len(big.graph.nodes) == 3 * STEPS + 2
    assert [n.target for n in big.graph.nodes][1:4] == [operator.add, torch.relu, operator.mul]
    assert big.code.count("torch.relu(") == STEPS
    x = torch.tensor([-5.0, -2.0, -1.5])
    torch.testing.assert_close(big(x), chain(x))


def test_lint_and_print(big):
    with shallow_stack():
        big.graph.lint()
        text = str(big.graph)
    assert text.count("\n") == len(big.graph.nodes)


def test_deepcopy_recompiles_the_same_code(big, big_copy):
    assert big_copy.graph is not big.graph
    assert len(big_copy.graph.nodes) == len(big.graph.nodes)
    assert big_copy.code == big.code
    x = torch.tensor([-3.0])
    torch.testing.assert_close(big_copy(x), big(x))


def test_pickle(big):
    with shallow_stack():
        gm2 = pickle.loads(pickle.dumps(big))
    assert gm2.code == big.code
    assert [n.name for n in gm2.graph.nodes] == [n.name for n in big.graph.nodes]
    x = torch.tensor([-3.0])
    torch.testing.assert_close(gm2(x), big(x))


def test_eliminate_dead_code_of_a_long_dead_chain(big_copy):
    g = big_copy.graph
    first_relu = g.find_nodes(op="call_function", target=torch.relu)[0]
    g.output_node().args = (first_relu,)  # everything after the first relu is now dead
    with shallow_stack():
        assert g.eliminate_dead_code() is True
        g.lint()
    assert [n.name for n in g.nodes] == ["x", "add", "relu", "output"]
    big_copy.recompile()
    x = torch.tensor([-3.0, 0.5])
    torch.testing.assert_close(big_copy(x), torch.relu(x + 1.0))


def test_save_and_load(big, tmp_path):
    with shallow_stack():
        fx.save(big, tmp_path / "big.fxl")
        gm2 = fx.load(tmp_path / "big.fxl")
    assert gm2.code == big.code
    x = torch.tensor([-3.0, 0.5])
    torch.testing.assert_close(gm2(x), big(x))
