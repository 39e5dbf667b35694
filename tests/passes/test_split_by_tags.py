"""split_by_tags: one submodule per node tag, in tag order."""

from __future__ import annotations

import pytest
import torch
from fxlite.passes import split_by_tags

import fxlite as fx


class _M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x) + 1) * 2


def _tagged():
    gm = fx.symbolic_trace(_M())
    for n in gm.graph.nodes:
        n.tag = "head" if n.name in ("lin", "add") else "tail"
    return gm


def test_split_by_tags_names_submodules_after_tags():
    gm = _tagged()
    split, fqn = split_by_tags(gm, ["head", "tail"], return_fqn_mapping=True)
    assert [n.target for n in split.graph.nodes if n.op == "call_module"] == ["head", "tail"]
    assert fqn == {"head.lin": "lin"}
    x = torch.randn(3, 4)
    torch.testing.assert_close(split(x), gm(x))
    as_tuples = split_by_tags(gm, ["head", "tail"], return_tuple=True)
    assert isinstance(as_tuples.head(x), tuple)
    torch.testing.assert_close(as_tuples(x), gm(x))


def test_split_by_tags_rejects_tags_against_the_data_flow():
    gm = _tagged()
    with pytest.raises(ValueError, match="comes later"):
        split_by_tags(gm, ["tail", "head"])
    next(n for n in gm.graph.nodes if n.name == "relu").tag = "other"
    with pytest.raises(ValueError, match="'relu' has tag 'other'"):
        split_by_tags(gm, ["head", "tail"])
