"""fuse: the canonical groups of issue 4, the grouping rules, and the structure of the result."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from _golden import assert_golden
from fxlite.passes.decompose import decompose
from fxlite.passes.fuse import fuse
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp, TensorMetadata

import fxlite
from fxlite.graph import Graph
from fxlite.graph_module import GraphModule
from fxlite.node import Node


def _prep(fn, *inputs, canonical: bool = True) -> GraphModule:
    """Trace, optionally normalize + decompose, and ShapeProp ``fn``."""
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(*inputs)
    if canonical:
        gm = decompose(normalize(gm))
        ShapeProp(gm).propagate(*inputs)
    return gm


def _fused_calls(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("fused_")]


def _compute_kinds(gm: GraphModule) -> list[str]:
    """The parent's computing nodes: ``fused_i`` for groups, the op name otherwise."""
    out = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output") or n.target is operator.getitem:
            continue
        if n.meta.get("type") is int:  # an element count (size, norms' checked count)
            continue
        out.append(n.target if n.op == "call_module" else getattr(n.target, "__name__", str(n.target)))
    return out


def _group_of(fused: GraphModule) -> dict[str, str]:
    """Original node name -> the ``fused_i`` holding it."""
    return {name: call.target for call in _fused_calls(fused)
            for name in getattr(fused, call.target).meta["nodes"]}


def _all_computing(gm: GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
            and n.meta.get("type") is not int]  # element counts are not tensor work


# ---------------------------------------------------------------------- canonical results
def test_pointwise_chain_is_one_group_golden() -> None:
    x = torch.randn(4, 8)
    gm = _prep(lambda x: torch.relu(x + 1) * 2, x, canonical=False)
    fused = fuse(gm)
    assert _compute_kinds(fused) == ["fused_0"]
    sub = fused.fused_0
    assert sub.meta == {"fused_kind": "pointwise", "nodes": ["add", "relu", "mul"],
                        "iteration_shape": (4, 8)}
    assert_golden("fuse_pointwise_parent", fused.code)
    assert_golden("fuse_pointwise_group", sub.code)
    torch.testing.assert_close(fused(x), torch.relu(x + 1) * 2)


def test_pointwise_chain_after_normalize() -> None:
    x = torch.randn(4, 8)
    gm = _prep(lambda x: torch.relu(x + 1) * 2, x)
    fused = fuse(gm)
    assert _compute_kinds(fused) == ["fused_0"]
    assert fused.fused_0.meta["nodes"] == _all_computing(gm)
    torch.testing.assert_close(fused(x), torch.relu(x + 1) * 2)


@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 8)])
def test_softmax_is_one_group(shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape)
    gm = _prep(lambda x: torch.softmax(x * 0.5, dim=-1), x)
    fused = fuse(gm)
    assert _compute_kinds(fused) == ["fused_0"]
    meta = fused.fused_0.meta
    assert meta["fused_kind"] == "reduction"
    assert meta["reduction_dims"] == (len(shape) - 1,)
    assert meta["iteration_shape"] == shape
    assert meta["nodes"] == _all_computing(gm)  # every decomposed primitive is in it
    torch.testing.assert_close(fused(x), torch.softmax(x * 0.5, dim=-1))


def test_layer_norm_residual_affine_is_one_group() -> None:
    x, r, w, b = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), torch.randn(8)

    def f(x, r, w, b):
        return F.layer_norm(x + r, (8,)) * w + b

    gm = _prep(f, x, r, w, b)
    fused = fuse(gm)
    assert _compute_kinds(fused) == ["fused_0"]
    meta = fused.fused_0.meta
    assert meta["fused_kind"] == "reduction" and meta["reduction_dims"] == (1,)
    assert meta["nodes"] == _all_computing(gm)
    # One input per tensor the group reads (x, r, w, b), plus the row length, read (and
    # checked against normalized_shape) at run time.
    assert [n.name for n in fused.fused_0.graph.nodes if n.op == "placeholder"] == [
        "x", "r", "_normalized_count", "w", "b"]
    torch.testing.assert_close(fused(x, r, w, b), f(x, r, w, b))


class _MLPBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(32, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


def test_mlp_block_is_extern_group_extern_group() -> None:
    model = _MLPBlock().eval()
    x = torch.randn(5, 8)
    fused = fuse(_prep(model, x))
    assert _compute_kinds(fused) == ["linear", "fused_0", "linear", "fused_1"]
    assert fused.fused_0.meta["fused_kind"] == "pointwise"  # gelu
    assert fused.fused_0.meta["iteration_shape"] == (5, 32)
    assert fused.fused_1.meta["fused_kind"] == "reduction"  # residual add + layer_norm
    torch.testing.assert_close(fused(x), model(x))


# ---------------------------------------------------------------------- structure of the result
def test_needs_shape_prop() -> None:
    gm = fxlite.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ValueError, match=r"ShapeProp\(gm\)\.propagate"):
        fuse(gm)


def test_group_nodes_keep_meta_and_calls_get_group_meta() -> None:
    x = torch.randn(4, 8)

    def f(x):
        s = x.sum(-1)
        m = s / 8
        return x - m.unsqueeze(-1), m

    gm = _prep(f, x, canonical=False)
    fused = fuse(gm)
    assert _compute_kinds(fused) == ["fused_0"]  # the unsqueeze view joins the row group
    sub = fused.fused_0
    spaces = {n.name: n.meta["fused_space"] for n in sub.graph.nodes if n.op == "call_method"
              or n.op == "call_function"}
    assert spaces == {"sum_1": "row", "truediv": "row", "unsqueeze": "full", "sub": "full"}
    for n in sub.graph.nodes:
        if n.op != "output":
            assert isinstance(n.meta["tensor_meta"], TensorMetadata), n.name
    # Two outputs: the call carries both metas, the getitems one each.
    call = _fused_calls(fused)[0]
    assert [tm.shape for tm in call.meta["tensor_meta"]] == [torch.Size([4]), torch.Size([4, 8])]
    items = [n for n in fused.graph.nodes if n.target is operator.getitem]
    assert [n.meta["tensor_meta"].shape for n in items] == [torch.Size([4]), torch.Size([4, 8])]
    out, m = fused(x)
    torch.testing.assert_close(out, f(x)[0])
    torch.testing.assert_close(m, f(x)[1])


def test_input_module_is_unchanged() -> None:
    x = torch.randn(4, 8)
    gm = _prep(lambda x: torch.relu(x + 1) * 2, x)
    before = gm.code
    fuse(gm)
    assert gm.code == before
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]


def test_unnormalized_spellings_and_leaf_modules() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = torch.nn.ReLU()

        def forward(self, x):
            return self.act(x.mul(3) + 1).sigmoid()

    x = torch.randn(4, 8)
    gm = _prep(M(), x, canonical=False)
    fused = fuse(gm)
    assert _compute_kinds(fused) == ["fused_0"]
    assert isinstance(fused.fused_0.act, torch.nn.ReLU)  # the leaf module went with its node
    torch.testing.assert_close(fused(x), M()(x))


# ---------------------------------------------------------------------- grouping rules
def test_no_fusion_through_extern_and_no_cycle() -> None:
    w = torch.randn(8, 8)

    def f(x):
        a = x + 1
        b = torch.matmul(a, w)
        return a * b

    x = torch.randn(4, 8)
    fused = fuse(_prep(f, x, canonical=False))
    # add and mul share an iteration space, but merging them would wrap around the matmul.
    assert _compute_kinds(fused) == ["fused_0", "matmul", "fused_1"]
    torch.testing.assert_close(fused(x), f(x))


def test_pointwise_reads_of_one_value_share_a_group() -> None:
    def f(x):  # q, k and v of one projection: views of one value, read apart
        return x[0] * 2, x[1].clone(memory_format=torch.contiguous_format), torch.relu(x[2])

    x = torch.randn(4, 8, 3).permute(2, 0, 1)
    fused = fuse(_prep(f, x, canonical=False))
    assert len(_fused_calls(fused)) == 1, fused.code
    for got, want in zip(fused(x), f(x)):
        torch.testing.assert_close(got, want)


def test_many_readers_of_one_value_make_several_kernels_not_one_with_an_output_each() -> None:
    w = torch.randn(4, 4)

    def f(x):  # 100 pointwise readers of x, each read by an extern op
        return [torch.matmul(x[i % 8] * (i + 1), w) for i in range(100)]

    x = torch.randn(8, 4, 4)
    fused = fuse(_prep(f, x, canonical=False))
    sizes = [len(fused.get_submodule(c.target).meta["nodes"]) for c in _fused_calls(fused)]
    assert max(sizes) <= 24 and len(sizes) < 100, sizes
    for got, want in zip(fused(x), f(x)):
        torch.testing.assert_close(got, want)


def test_readers_of_one_value_joined_by_a_path_or_of_other_shapes_stay_apart() -> None:
    w = torch.randn(8, 8)

    def f(x):
        a = x * 2
        c = x + torch.matmul(a, w)  # reads x too, but after a's matmul: one kernel would cycle
        return c, x[0] - 1  # reads x in another shape

    x = torch.randn(3, 4, 8)
    fused = fuse(_prep(f, x, canonical=False))
    groups = _group_of(fused)
    assert len({groups["mul"], groups["add"], groups["sub"]}) == 3, fused.code
    for got, want in zip(fused(x), f(x)):
        torch.testing.assert_close(got, want)


def test_smaller_values_join_the_group_they_broadcast_into() -> None:
    def f(x, w):
        return x + torch.rsqrt(w * 2 + 1)  # (8,) then (4, 8): one group over (4, 8)

    x, w = torch.randn(4, 8), torch.rand(8)
    fused = fuse(_prep(f, x, w))
    groups = _group_of(fused)
    assert groups["mul"] == groups["rsqrt"] == groups["add_1"]
    assert fused.get_submodule(groups["mul"]).meta["iteration_shape"] == (4, 8)
    torch.testing.assert_close(fused(x, w), f(x, w))


def test_different_iteration_spaces_stay_apart() -> None:
    def f(w, y):
        return (w * 2).reshape(2, 4) + y  # (8,), then a real reshape to (2, 4)

    w, y = torch.randn(8), torch.randn(2, 4)
    fused = fuse(_prep(f, w, y))
    groups = _group_of(fused)
    assert groups["mul"] != groups["add"]
    assert fused.get_submodule(groups["mul"]).meta["iteration_shape"] == (8,)
    torch.testing.assert_close(fused(w, y), f(w, y))


def test_cross_row_broadcast_is_not_fused() -> None:
    def f(x):
        s = torch.sum(x, dim=-1)  # (4,), broadcast along the columns below: s[c], not s[r]
        return x - s

    x = torch.randn(4, 4)
    fused = fuse(_prep(f, x, canonical=False))
    groups = _group_of(fused)
    assert groups["sum_1"] != groups["sub"]
    torch.testing.assert_close(fused(x), f(x))


def test_reductions_over_different_rows_stay_apart() -> None:
    def f(x):
        return torch.sum(x, dim=-1, keepdim=True) + torch.sum(x, dim=(-2, -1), keepdim=True)

    x = torch.randn(2, 3, 4)
    fused = fuse(_prep(f, x, canonical=False))
    groups = _group_of(fused)
    assert groups["sum_1"] != groups["sum_2"]
    assert fused.get_submodule(groups["sum_2"]).meta["reduction_dims"] == (1, 2)
    torch.testing.assert_close(fused(x), f(x))


def test_reduction_over_a_leading_dim_stays_in_parent() -> None:
    def f(x):
        return torch.sum(torch.exp(x), dim=0) * 2

    x = torch.randn(4, 8)
    fused = fuse(_prep(f, x, canonical=False))
    assert _compute_kinds(fused) == ["fused_0", "sum", "fused_1"]
    torch.testing.assert_close(fused(x), f(x))


def test_permute_stays_outside_groups() -> None:
    def f(x):
        return (x + 1).permute(1, 0) * 2

    x = torch.randn(4, 8)
    fused = fuse(_prep(f, x, canonical=False))
    assert _compute_kinds(fused) == ["fused_0", "permute", "fused_1"]
    torch.testing.assert_close(fused(x), f(x))


def test_max_group_size() -> None:
    def f(x):
        for _ in range(6):
            x = torch.tanh(x) * 2
        return x

    x = torch.randn(4, 8)
    fused = fuse(_prep(f, x, canonical=False), max_group_size=4)
    sizes = [len(getattr(fused, c.target).meta["nodes"]) for c in _fused_calls(fused)]
    assert sizes == [4, 4, 4]
    torch.testing.assert_close(fused(x), f(x))


def test_in_place_ops_are_barriers() -> None:
    def f(x):
        y = x + 1
        y.add_(1)  # an impure node: y * 2 must see the mutation
        return y * 2

    x = torch.randn(4, 8)
    gm = _prep(f, x.clone(), canonical=False)
    fused = fuse(gm)
    assert _compute_kinds(fused) == ["fused_0", "add_", "fused_1"]
    torch.testing.assert_close(fused(x.clone()), f(x.clone()))


def test_a_view_whose_memory_a_sibling_view_writes_stays_a_view() -> None:
    # fuzz seed 9891099: ``b`` in the group of ``m`` would be its kernel's copy, made
    # before the write through ``a``, which eager's ``b`` sees (the group's eager ops
    # make it a view still: the kernel is what would differ)
    def f(x):
        m = x.amin()
        a = torch.reshape(m, (1,))
        b = torch.reshape(m, (1, 1))
        a.mul_(2)
        return torch.maximum(b, b)

    x = torch.randn(4, 8)
    fused = fuse(_prep(f, x, canonical=False))
    assert [getattr(fused, c.target).meta["nodes"] for c in _fused_calls(fused)] == [
        ["amin"], ["maximum"]]
    torch.testing.assert_close(fused(x), f(x))


def test_scalar_inputs_become_group_inputs() -> None:
    g = Graph()
    x = g.placeholder("x")
    n = g.call_method("size", (x, 0))
    y = g.call_function(torch.mul, (x, n))
    g.output(g.call_function(torch.relu, (y,)))
    gm = GraphModule(torch.nn.Module(), g)
    t = torch.randn(3, 5)
    ShapeProp(gm).propagate(t)
    fused = fuse(gm)
    assert _compute_kinds(fused) == ["fused_0"]  # the size call stays outside the group
    assert [p.name for p in fused.fused_0.graph.nodes if p.op == "placeholder"] == ["x", "size"]
    torch.testing.assert_close(fused(t), torch.relu(t * 3))


def test_views_join_only_when_they_keep_the_index_map() -> None:
    def f(x, w):
        m = torch.amax(x, dim=-1, keepdim=True)
        e = m.expand(4, 8)  # broadcast of a row value: joins
        v = w.view(1, 8)  # a view of a group input, not of a group value: stays outside
        return (x - e) * v

    x, w = torch.randn(4, 8), torch.randn(8)
    fused = fuse(_prep(f, x, w, canonical=False))
    assert _compute_kinds(fused) == ["view", "fused_0"]
    assert fused.fused_0.meta["nodes"] == ["amax", "expand", "sub", "mul"]
    torch.testing.assert_close(fused(x, w), f(x, w))


def test_composites_and_var_are_decomposed_by_fuse_itself() -> None:
    def f(x):
        return torch.softmax(x + 1, dim=-1) + torch.var(x, dim=-1, keepdim=True)

    x = torch.randn(4, 8)
    fused = fuse(_prep(f, x, canonical=False))
    kinds = _compute_kinds(fused)
    assert "softmax" not in kinds and "var" not in kinds  # they used to stay in the parent
    assert kinds[-1] == "fused_0" and kinds.count("fused_0") == 1
    torch.testing.assert_close(fused(x), f(x))


def test_fuse_decomposes_composites_itself_when_the_graph_was_not_decomposed() -> None:
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(8)

        def forward(self, x):
            return torch.softmax(self.ln(x) * 2, dim=-1) + 1

    model = M()
    x = torch.randn(4, 8)
    gm = _prep(model, x, canonical=False)
    before = gm.code
    fused = fuse(gm)
    assert gm.code == before  # fuse works on a copy
    parent = [n.target for n in fused.graph.nodes if n.op in ("call_function", "call_module")]
    assert torch.softmax not in parent and "ln" not in parent
    assert [t for t in parent if isinstance(t, str)] == ["fused_0"]
    assert fused.fused_0.meta["fused_kind"] == "reduction"
    x2 = torch.randn(4, 8)  # fresh input
    torch.testing.assert_close(fused(x2), model(x2))


def test_a_few_long_rows_stay_with_torch():
    # One program per row: x.sum() over 2**16+ elements would run on one SM; torch splits it.
    from fxlite.passes import ShapeProp, fuse

    import fxlite

    gm = fxlite.symbolic_trace(lambda x: (x * 2).sum() + 1)
    x = torch.randn(256, 512)
    ShapeProp(gm).propagate(x)
    fused = fuse(gm)
    kinds = [m.meta["fused_kind"] for m in fused.children() if hasattr(m, "meta") and
             "fused_kind" in m.meta]
    assert "reduction" not in kinds and "pointwise" in kinds
    torch.testing.assert_close(fused(x), (x * 2).sum() + 1)
    small = torch.randn(4, 8)
    gm2 = fxlite.symbolic_trace(lambda x: (x * 2).sum(-1))
    ShapeProp(gm2).propagate(small)
    assert any(m.meta.get("fused_kind") == "reduction" for m in fuse(gm2).children()
               if hasattr(m, "meta"))


# ---------------------------------------------------------------------- size reads
def _scaled_residual_then_norm(y, x, s):
    # convnext: a block's layer-scaled residual, then the downsampling LayerNorm2d
    z = s * y.permute(0, 3, 1, 2) + x
    return F.layer_norm(z.permute(0, 2, 3, 1), (8,)).permute(0, 3, 1, 2)


def test_a_norms_size_check_reads_the_residuals_operands_so_one_kernel_does_both() -> None:
    """A regression: the norm's element count read ``z.size(-1)`` of the residual computed
    in the group, so the group wrote ``z`` out and split in two (three kernels in
    convnext_tiny's downsampling)."""
    from fxlite.passes.fuse.size_sources import broadcast_size

    y, x, s = torch.randn(2, 4, 4, 8), torch.randn(2, 8, 4, 4), torch.randn(8, 1, 1)
    gm = _prep(_scaled_residual_then_norm, y, x, s)
    before = gm.code
    fused = fuse(gm)
    assert gm.code == before  # the input module is left alone
    groups = [getattr(fused, c.target).meta["fused_kind"] for c in _fused_calls(fused)]
    assert groups == ["reduction"]
    assert any(n.target is broadcast_size for n in fused.graph.nodes)
    torch.testing.assert_close(fused(y, x, s), _scaled_residual_then_norm(y, x, s))


def test_broadcast_size_is_eagers_broadcast() -> None:
    from fxlite.passes.fuse.size_sources import broadcast_size

    a, b = torch.ones(3, 1, 5), torch.ones(4, 1)
    for d in range(-3, 3):
        assert broadcast_size(d, a, b) == torch.broadcast_shapes(a.shape, b.shape)[d]
    with pytest.raises(RuntimeError, match="must match"):
        broadcast_size(-1, torch.ones(3), torch.ones(4))
    with pytest.raises(IndexError):
        broadcast_size(3, a, b)


def _full_outputs(fused: GraphModule, call: Node, shape: tuple[int, ...]) -> int:
    sub = getattr(fused, call.target)
    outs = sub.graph.output_node().args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return sum(tuple(o.meta["tensor_meta"].shape) == shape for o in outs)


def test_a_reader_recomputes_a_reduction_groups_full_value_instead_of_loading_it() -> None:
    """``c = x - m`` feeds a row sum and, past a sum over rows that no group can hold, a
    second kernel. The second kernel loads ``x`` again rather than ``c``: the first one
    no longer stores ``c`` (one full-size write less, the same loads)."""
    def f(x, m):
        c = x - m
        s = (c * c).sum(1, keepdim=True)
        t = s.amax(0, keepdim=True)
        return c * t

    x, m = torch.randn(6, 40), torch.randn(6, 1)
    gm = _prep(f, x, m)
    plain, fused = fuse(gm, recompute=False), fuse(gm)
    first = [_full_outputs(g, _fused_calls(g)[0], (6, 40)) for g in (plain, fused)]
    assert first == [1, 0]
    second = _fused_calls(fused)[1]
    assert [a.name for a in second.args if isinstance(a, Node)][:1] == ["x"]
    for out in (plain(x, m), fused(x, m)):
        torch.testing.assert_close(out, f(x, m))
    x2 = torch.randn(6, 40)
    torch.testing.assert_close(fused(x2, m), f(x2, m))


def test_a_value_that_an_extern_op_also_reads_is_still_loaded() -> None:
    """When the stored value stays (a matmul reads it too), a reader recomputes it only if
    that loads nothing new: here it would load ``x`` instead of ``c``, so it does not."""
    def f(x, m, w):
        c = x - m
        s = (c * c).sum(1, keepdim=True)
        t = s.amax(0, keepdim=True)
        return c * t, c @ w

    x, m, w = torch.randn(6, 40), torch.randn(6, 1), torch.randn(40, 3)
    gm = _prep(f, x, m, w)
    fused = fuse(gm)
    calls = _fused_calls(fused)
    assert _full_outputs(fused, calls[0], (6, 40)) == 1
    assert "x" not in [a.name for a in calls[1].args if isinstance(a, Node)]
    for got, want in zip(fused(x, m, w), f(x, m, w)):
        torch.testing.assert_close(got, want)


def _bias_softmax(a: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # Swin's relative position bias: a permuted view made contiguous, added before softmax
    bias = table.view(7, 7, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
    return torch.softmax(a + bias, -1)


def test_a_contiguous_copy_only_a_reduction_group_reads_is_read_through() -> None:
    a, table = torch.randn(4, 3, 7, 7), torch.randn(49, 3)
    fused = fuse(_prep(_bias_softmax, a, table))
    assert "contiguous" not in _compute_kinds(fused)
    (call,) = _fused_calls(fused)
    places = [p for p in getattr(fused, call.target).graph.nodes if p.op == "placeholder"]
    # the group's placeholder holds the permuted view's layout (what its kernel now reads)
    assert [tuple(p.meta["tensor_meta"].stride) for p in places] == [
        (147, 49, 7, 1), tuple(table.view(7, 7, -1).permute(2, 0, 1).unsqueeze(0).stride())]
    torch.testing.assert_close(fused(a, table), _bias_softmax(a, table))


def test_a_pointwise_group_reads_through_a_copy_where_its_layout_stays() -> None:
    # the scores, the first input, decide the memory order: the result stays row-major
    def add(a, table):
        return a + table.view(7, 7, -1).permute(2, 0, 1).contiguous()

    a, table = torch.randn(3, 7, 7), torch.randn(49, 3)
    fused = fuse(_prep(add, a, table))
    assert "contiguous" not in _compute_kinds(fused)
    torch.testing.assert_close(fused(a, table), add(a, table))


def test_a_contiguous_copy_stays_where_anything_else_reads_it() -> None:
    # a pointwise group lays its result out in its inputs' memory order (the copy, first,
    # decides it here), and a returned copy is the caller's
    def pointwise(a, table):
        return table.view(7, 7, -1).permute(2, 0, 1).contiguous() + a

    def returned(a, table):
        bias = table.view(7, 7, -1).permute(2, 0, 1).contiguous()
        return torch.softmax(a + bias, -1), bias

    a, table = torch.randn(3, 7, 7), torch.randn(49, 3)
    for fn in (pointwise, returned):
        fused = fuse(_prep(fn, a, table))
        assert "contiguous" in _compute_kinds(fused), fn.__name__
        torch.testing.assert_close(fused(a, table), fn(a, table))
