"""Which ops the table calls views of their input (``fxlite.ops.view_base``): the memory
a node's value shares, which aliasing checks and the functionalize pass go by."""

from __future__ import annotations

import pytest
import torch

import fxlite


@pytest.mark.parametrize("index", [
    0, (0, slice(1, None)), None, Ellipsis, (Ellipsis, None, 1), torch.tensor(1),
    [0], [0, -1], True, False, (0, [1, 0]), torch.tensor([1]), torch.tensor(True),
    torch.tensor(1, dtype=torch.uint8), torch.tensor([True, False]),
], ids=repr)
def test_copying_index_tells_a_copy_from_a_view_as_torch_does(index):
    """``x[index]`` shares ``x``'s memory for basic indexing and copies for advanced
    indexing; view_base (and the functionalize pass's returned views) go by this."""
    from fxlite.passes.shape_prop import ShapeProp

    from fxlite.ops import copying_index, view_base

    x = torch.arange(24.0).view(2, 3, 4)
    shares = x[index].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert copying_index(index) == (not shares)
    gm = fxlite.symbolic_trace(lambda t: t[index])
    ShapeProp(gm).propagate(x)  # a tensor in the index is a constant node: its metadata
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert (view_base(node) is None) == (not shares)


def test_an_index_node_counts_as_a_view_unless_its_metadata_says_a_copy():
    """A node in the index with no metadata (an int computed in the graph) may select:
    aliasing checks must take it for a view; a 1-d tensor node's metadata says a copy."""
    from fxlite.passes.shape_prop import ShapeProp

    from fxlite.ops import copying_index

    gm = fxlite.symbolic_trace(lambda x, i: x[i])
    i = next(n for n in gm.graph.nodes if n.name == "i")
    assert not copying_index(i)
    ShapeProp(gm).propagate(torch.randn(3, 4), torch.tensor([0, 2]))
    assert copying_index(i)
    ShapeProp(gm).propagate(torch.randn(3, 4), torch.tensor(2))
    assert not copying_index(i)
