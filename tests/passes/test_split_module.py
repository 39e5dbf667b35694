"""split_module: partitions by a callback, crossing values, attributes, order and cycles."""

from __future__ import annotations

import operator

import pytest
import torch
from _golden import assert_golden
from fxlite.passes.shape_prop import ShapeProp
from fxlite.passes.split_module import split_module

import fxlite


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x, y):
        a = self.lin(x) * self.scale
        b = torch.relu(a) + y
        c = b * self.scale
        return c - a, b


def _split_by(names_to_part: dict[str, int], default: int):
    return lambda n: names_to_part.get(n.name, default)


def test_split_by_callback_golden_and_outputs() -> None:
    model = _Model()
    gm = fxlite.symbolic_trace(model)
    qualname_map: dict[str, str] = {}
    parts = {"lin": 0, "mul": 0}
    split = split_module(gm, model, _split_by(parts, 1), qualname_map)
    assert_golden("split_module_top", split.code)
    assert_golden("split_module_submod_0", split.submod_0.code)
    assert_golden("split_module_submod_1", split.submod_1.code)
    # The Linear is copied (shared) into the partition that calls it, and the buffer into
    # every partition that reads it.
    assert split.submod_0.lin is model.lin
    assert split.submod_0.scale is model.scale and split.submod_1.scale is model.scale
    assert "scale" in dict(split.submod_1.named_buffers())
    assert qualname_map == {"submod_0.lin": "lin", "submod_0.scale": "scale", "submod_1.scale": "scale"}
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for got, want in zip(split(x, y), model(x, y), strict=True):
        torch.testing.assert_close(got, want)


def test_partitions_run_in_topological_order_with_multiple_outputs() -> None:
    model = _Model()
    gm = fxlite.symbolic_trace(model)
    # Ids chosen against the node order: 7 holds the first nodes, 3 the rest.
    split = split_module(gm, model, _split_by({"lin": 7, "mul": 7, "relu": 7, "add": 7}, 3))
    calls = [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert calls == ["submod_7", "submod_3"]
    # submod_7 returns a (used by submod_3) and b (used by submod_3 and the output).
    items = [n for n in split.graph.nodes if n.target is operator.getitem]
    assert [n.args[1] for n in items] == [0, 1]
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for got, want in zip(split(x, y), model(x, y), strict=True):
        torch.testing.assert_close(got, want)


def test_non_integer_partition_ids() -> None:
    gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1) * 2)
    split = split_module(gm, gm, lambda n: "front" if n.name == "add" else "back")
    assert [n.target for n in split.graph.nodes if n.op == "call_module"] == ["submod_front", "submod_back"]
    x = torch.randn(5)
    torch.testing.assert_close(split(x), torch.relu(x + 1) * 2)


def test_cycle_between_partitions_raises() -> None:
    gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1) * 2)
    # add in 0, relu in 1, mul in 0: 0 feeds 1 and 1 feeds 0.
    with pytest.raises(ValueError, match=r"cycle: 0 -> 1 -> 0|cycle: 1 -> 0 -> 1"):
        split_module(gm, gm, lambda n: 1 if n.name == "relu" else 0)


def test_keep_original_order_orders_inputs_by_definition() -> None:
    def f(x, y):
        a = x * 2
        return a + y  # first use: mul, y; definition order: y, mul

    gm = fxlite.symbolic_trace(f)
    first_use = split_module(gm, gm, lambda n: 0 if n.name == "mul" else 1)
    original = split_module(gm, gm, lambda n: 0 if n.name == "mul" else 1, keep_original_order=True)
    names = lambda m: [n.name for n in m.submod_1.graph.nodes if n.op == "placeholder"]
    assert names(first_use) == ["mul", "y"]
    assert names(original) == ["y", "mul"]
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(first_use(x, y), f(x, y))
    torch.testing.assert_close(original(x, y), f(x, y))


def test_shape_meta_is_carried() -> None:
    model = _Model()
    gm = fxlite.symbolic_trace(model)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    ShapeProp(gm).propagate(x, y)
    split = split_module(gm, model, _split_by({"lin": 0}, 1))
    call = next(n for n in split.graph.nodes if n.target == "submod_0")
    assert call.meta["tensor_meta"].shape == torch.Size([3, 4])
    inner = {n.name: n for n in split.submod_1.graph.nodes}
    assert inner["lin"].meta["tensor_meta"].shape == torch.Size([3, 4])  # a placeholder
    assert inner["relu"].meta["tensor_meta"].shape == torch.Size([3, 4])


def test_output_of_placeholders_and_attributes() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("buf", torch.arange(3.0))

        def forward(self, x):
            return x, self.buf, x + self.buf

    model = M()
    gm = fxlite.symbolic_trace(model)
    split = split_module(gm, model, lambda n: 0)
    assert "buf" in dict(split.named_buffers())
    x = torch.randn(3)
    for got, want in zip(split(x), model(x), strict=True):
        torch.testing.assert_close(got, want)
