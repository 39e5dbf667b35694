"""decompose: the default rules, user rules, and failure safety."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _golden import assert_golden
from fxlite.passes.decompose import DECOMPOSITIONS, decompose, register_decomposition
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite
from fxlite.ops import lookup

PRIMITIVE_KINDS = ("pointwise", "reduction", "view")


def trace(fn):
    return fxlite.symbolic_trace(fn)


def lower(fn, *inputs, shapes=False):
    """normalize + decompose, checking outputs against the traced original."""
    gm = trace(fn)
    expected = gm(*inputs)
    if shapes:
        ShapeProp(gm).propagate(*inputs)
    decompose(normalize(gm))
    torch.testing.assert_close(gm(*inputs), expected)
    return gm


def size_queries(gm):
    """Nodes that compute element counts from ``x.size(d)``: Python ints, not tensor ops."""
    out = set()
    for n in gm.graph.nodes:
        if (n.op == "call_method" and n.target == "size") or (
                n.op == "call_function" and n.all_input_nodes
                and all(i in out for i in n.all_input_nodes)):
            out.add(n)
    return out


def assert_primitive(gm):
    sizes = size_queries(gm)
    for n in gm.graph.nodes:
        if n in sizes:
            continue
        if n.op in ("call_method", "call_module"):
            raise AssertionError(f"{n.format_node()} is not in canonical form")
        if n.op == "call_function":
            info = lookup(n, gm)
            assert info is not None and info.kind in PRIMITIVE_KINDS, n.format_node()


class LayerNormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 2)
            self.ln.bias.uniform_(-1, 1)

    def forward(self, x):
        return self.ln(x)


CANONICAL = {
    "softmax": (lambda x: F.softmax(x, dim=-1), lambda: torch.randn(4, 8) * 10),
    "layer_norm": (LayerNormModel(), lambda: torch.randn(4, 8) * 3 + 1),
    "gelu": (nn.GELU(), lambda: torch.randn(4, 8) * 3),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda: torch.randn(4, 8) * 3),
}


@pytest.mark.parametrize("name", sorted(CANONICAL))
def test_canonical_ops_become_table_primitives(name):
    fn, make = CANONICAL[name]
    gm = lower(fn, make(), shapes=True)
    assert_golden(f"decompose_{name}", gm.code)
    assert_primitive(gm)
    for _ in range(3):  # more random inputs
        x = make()
        torch.testing.assert_close(gm(x), fn(x))


@pytest.mark.parametrize("fn", [
    lambda x: torch.log_softmax(x, 1),
    lambda x: x.softmax(0, dtype=torch.float64),
    lambda x: F.log_softmax(x.half(), -1, dtype=torch.float32),
    lambda x: F.layer_norm(x, (3, 8)),
    lambda x: F.rms_norm(x, (8,), eps=1e-3),
    lambda x: F.silu(x) + nn.functional.gelu(x),
    lambda x: torch.softmax(x, -1) - torch.softmax(x + 1, -1),
], ids=["log_softmax", "softmax_dtype", "log_softmax_half", "layer_norm_2d", "rms_norm",
        "silu_gelu", "two_softmax"])
def test_default_rules_match_torch(fn):
    x = torch.randn(2, 3, 8)
    gm = lower(fn, x, shapes=True)
    assert_primitive(gm)


@pytest.mark.parametrize("fn", [
    lambda x: x.mean(),
    lambda x: x.mean(dim=(0, 2), keepdim=True),
    lambda x: torch.mean(x, -1, dtype=torch.float64),
    lambda x: x.var(1),
    lambda x: x.var(dim=(1, 2), unbiased=False, keepdim=True),
    lambda x: torch.var(x, -1, correction=2),
    lambda x: x.std(),
    lambda x: torch.std(x, 0, keepdim=True),
    lambda x: F.rms_norm(x, (8,)),
    lambda x: F.softmax(x, -1),
    lambda x: F.layer_norm(x, (8,)),
], ids=["mean", "mean_dims", "mean_dtype", "var", "var_unbiased", "var_correction", "std",
        "std_dim", "rms_norm_default_eps", "softmax", "layer_norm"])
def test_shape_dependent_rules_need_shapeprop(fn):
    x = torch.randn(3, 5, 8)
    gm = lower(fn, x, shapes=True)
    assert_primitive(gm)
    without = lower(fn, x)  # no shapes: the op is kept, numerics still hold
    assert any(lookup(n).kind == "composite" or lookup(n).name in ("mean", "var", "std")
               for n in without.graph.nodes if n.op == "call_function")


def test_user_rules_and_spellings():
    table = {}

    @register_decomposition(F.relu, table)
    def relu(x, inplace=False):
        # relu(x) = where(x > 0, x, 0)
        return torch.where(x > 0, x, 0.0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(x) + x.relu() + torch.relu(x)

    gm = trace(M())
    x = torch.randn(5)
    expected = gm(x)
    decompose(gm, table)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.relu not in targets and targets.count(torch.where) == 3
    assert targets.count(torch.gt) == 3  # `x > 0` in the rule was normalized
    torch.testing.assert_close(gm(x), expected)
    assert set(table) == {"relu"} and "relu" not in DECOMPOSITIONS  # keyed by op name


def test_register_into_the_default_table():
    @register_decomposition(torch.sigmoid)
    def sigmoid(x):
        # sigmoid(x) = 1 / (1 + exp(-x))
        return torch.reciprocal(torch.exp(-x) + 1)

    try:
        assert DECOMPOSITIONS["sigmoid"] is sigmoid  # keyed by the op's name
        gm = trace(lambda x: F.silu(x))  # silu -> x * sigmoid(x) -> x * reciprocal(...)
        x = torch.randn(6)
        expected = gm(x)
        decompose(gm)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert torch.sigmoid not in targets and torch.reciprocal in targets
        torch.testing.assert_close(gm(x), expected)
    finally:
        del DECOMPOSITIONS["sigmoid"]


def test_rule_that_raises_leaves_graph_unchanged():
    def broken(x, dim=None, dtype=None):
        torch.exp(x)  # records a node, then fails
        raise ValueError("rule failed")

    gm = trace(lambda x: torch.softmax(torch.softmax(x, -1) * 2, -1))
    before, nodes = gm.code, list(gm.graph.nodes)
    with pytest.raises(ValueError, match="rule failed"):
        decompose(gm, {torch.softmax: broken})
    assert gm.code == before and list(gm.graph.nodes) == nodes
    gm.graph.lint()


def test_rule_that_expands_forever_leaves_graph_unchanged():
    def loop(x, dim=None, dtype=None):
        return torch.softmax(x * 1, dim)

    gm = trace(lambda x: torch.softmax(x, -1))
    before = gm.code
    with pytest.raises(RecursionError):
        decompose(gm, {torch.softmax: loop})
    assert gm.code == before


def test_not_implemented_keeps_the_node():
    gm = trace(lambda x: torch.softmax(x, -1) + 1)
    before = gm.code
    decompose(gm, {torch.softmax: lambda x, dim=None, dtype=None: NotImplemented})
    assert gm.code == before


def test_rule_returning_a_non_proxy_is_an_error():
    gm = trace(lambda x: torch.softmax(x, -1))
    before = gm.code
    with pytest.raises(TypeError, match="must return a Proxy"):
        decompose(gm, {torch.softmax: lambda x, dim=None, dtype=None: 3})
    assert gm.code == before


def test_decomposed_nodes_take_the_place_and_meta_of_the_original():
    gm = trace(lambda x: torch.relu(torch.softmax(x, -1)))
    ShapeProp(gm).propagate(torch.randn(2, 3))
    meta = gm.graph.find_nodes(op="call_function", target=torch.softmax)[0].meta["tensor_meta"]
    decompose(gm)
    relu = gm.graph.find_nodes(op="call_function", target=torch.relu)[0]
    (producer,) = relu.all_input_nodes
    assert producer.target is torch.div and producer.meta["tensor_meta"] == meta
    order = list(gm.graph.nodes)
    assert all(order.index(i) < order.index(n) for n in order for i in n.all_input_nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_linear_bias_splits_off_only_where_it_adds_no_rounding(dtype):
    # In bfloat16 the split would round the matmul before the bias add; addmm adds first.
    def fn(x, w, b):
        return F.gelu(F.linear(x, w, b))

    args = [torch.randn(4, 8).to(dtype), torch.randn(6, 8).to(dtype), torch.randn(6).to(dtype)]
    gm = lower(fn, *args, shapes=True)
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert len(linears) == 1
    assert (len(linears[0].args) + len(linears[0].kwargs) == 3) == (dtype == torch.bfloat16)


@pytest.mark.parametrize("decimals", [2, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_round_with_decimals_runs_as_a_kernel_with_eagers_values(dtype, decimals):
    """Before: ``torch.round(x, decimals=d)`` had no Triton form (a softmax rounded for a
    log line ran its group in eager); it is rint(x * 10**d) / 10**d in the op's math dtype,
    as eager's kernel computes, to the bit."""
    import fxlite

    def fn(x):
        return torch.round(x, decimals=decimals), x.abs().round(decimals=decimals) * 2

    compiled = fxlite.compile(fn)
    for k in range(3):  # fresh values each call, halves at .5 boundaries included
        x = (torch.randn(512, generator=torch.Generator().manual_seed(k)) * 50).to(dtype)
        x[:4] = torch.tensor([0.05, 0.15, -0.25, 2.5]).to(dtype)
        x = x.to("cuda" if torch.cuda.is_available() else "cpu")  # (CPU: interpreted)
        got, want = compiled(x), fn(x)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
    assert compiled.kernels and not compiled.fallbacks


def test_a_rule_keyed_by_a_function_the_op_table_lacks_applies():
    """``register_decomposition`` keys such a rule by the function itself; ``decompose``
    found rules through the op table only, so these rules never ran."""
    def scaled(x, k):
        return x * k

    table = {}

    @register_decomposition(scaled, table)
    def _scaled(x, k):
        return torch.mul(x, k)

    graph = fxlite.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(scaled, (x, 3.0)))
    gm = fxlite.GraphModule(torch.nn.Module(), graph)
    out = decompose(gm, rules=table)
    assert [n.target for n in out.graph.nodes if n.op == "call_function"] == [torch.mul]
    t = torch.randn(5)
    torch.testing.assert_close(out(t), t * 3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aten_backward_ops_decompose_to_eagers_values(dtype):
    """AOTAutograd's backward graphs (``backend="fxlite_aot"``) call threshold_backward
    (relu's) and gelu_backward; their rules give aten's values, at the threshold too."""
    aten = torch.ops.aten
    graph = fxlite.Graph()
    g, x = graph.placeholder("g"), graph.placeholder("x")
    relu_grad = graph.call_function(aten.threshold_backward.default, (g, x, 0.0))
    gelu_grad = graph.call_function(aten.gelu_backward.default, (g, x))
    graph.output((relu_grad, gelu_grad))
    gm = fxlite.GraphModule(torch.nn.Module(), graph)
    grad = torch.randn(64, dtype=dtype)
    x_val = torch.cat([torch.randn(62), torch.zeros(2)]).to(dtype)  # 0: the threshold itself
    want = gm(grad, x_val)
    ShapeProp(gm).propagate(grad, x_val)
    out = decompose(gm)
    assert not [n for n in out.graph.nodes if "backward" in str(n.target)]
    got = out(grad, x_val)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)


# ---------------------------------------------------------------------- attention
def _attention(mask, scale):
    """A function of q, k, v (and the mask, if any) that calls SDPA with ``scale``."""
    if mask is None:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=scale)
    return lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)


def _sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]


@pytest.mark.parametrize("mask", ["float", "bool", None])
@pytest.mark.parametrize("scale", [None, 1.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_on_the_math_path_decomposes_to_eagers_values(mask, scale, dtype):
    """Where eager takes PyTorch's math path (forced here; on a GPU, T5's float position
    bias in a layout the fused kernels refuse), SDPA becomes matmul, one softmax and
    matmul, with the math path's values: halves in fp32, a boolean mask keeping scores
    where True, and zeros (not NaN) for a query row masked whole."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inputs = [torch.randn(2, 3, 5, 4, dtype=dtype) for _ in range(3)]
    if mask == "float":
        inputs.append(torch.randn(1, 3, 5, 5, dtype=dtype))
        inputs[-1][..., 1, :] = float("-inf")
    elif mask == "bool":
        inputs.append(torch.rand(2, 1, 5, 5) > 0.3)
        inputs[-1][..., 1, :] = False
    with sdpa_kernel(SDPBackend.MATH):
        gm = trace(_attention(mask, scale))
        want = gm(*inputs)
        ShapeProp(gm).propagate(*inputs)
        decompose(gm)
        assert not _sdpa_nodes(gm)
        got = gm(*inputs)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if mask is not None:
        assert got[:, :, 1].eq(0).all()


def test_attention_a_fused_kernel_takes_is_left_alone():
    """Where torch would pick a fused kernel (flash here, on the CPU), or for dropout and
    causal calls, the SDPA call stays: the decomposition only pays on the math path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 3, 8, 4)
    gm = trace(_attention(None, None))
    ShapeProp(gm).propagate(q, q, q)
    assert torch._fused_sdp_choice(q, q, q) != SDPBackend.MATH.value
    assert len(_sdpa_nodes(decompose(gm))) == 1

    def causal(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    with sdpa_kernel(SDPBackend.MATH):
        gm = trace(causal)
        ShapeProp(gm).propagate(q)
        assert len(_sdpa_nodes(decompose(gm))) == 1


def _pads(gm):
    return [n for n in gm.graph.nodes if n.target is F.pad]


def _decomposed(fn, *inputs):
    gm = trace(fn)
    ShapeProp(gm).propagate(*inputs)
    return decompose(gm)


def test_a_pad_by_nothing_is_its_input_where_no_one_can_tell():
    """Swin pads each block's input by what its windows need, often nothing: F.pad then
    copies. Inside a graph with no writes, whose result is not returned, the copy goes."""
    def inside(x):
        return torch.roll(F.pad(x * 2, (0, 0, 0, 0)), 1, 1) + 1

    x = torch.randn(2, 5, 3)
    gm = _decomposed(inside, x)
    assert not _pads(gm)
    torch.testing.assert_close(gm(x), inside(x))


@pytest.mark.parametrize("case", ["returned", "returned_view", "pads", "write", "transposed"])
def test_a_pad_anyone_could_tell_from_its_input_stays(case):
    def returned(x):
        return F.pad(x * 2, (0, 0))

    def returned_view(x):
        return F.pad(x * 2, (0, 0)).view(-1)

    def pads(x):
        return F.pad(x * 2, (0, 1)) + 1

    def write(x):
        y = x * 2
        z = F.pad(y, (0, 0)) + 1
        y.add_(1)  # an alias of y would see this write
        return z

    def transposed(x):
        return F.pad(x.t(), (0, 0)) + 1  # the copy is row-major, x.t() is not

    fn = locals()[case]
    x = torch.randn(4, 3)
    gm = _decomposed(fn, x)
    assert len(_pads(gm)) == 1
    torch.testing.assert_close(gm(x), fn(x))


MULTIPLY_ADDS_AND_NORMS = {
    "addcmul": lambda x, y, s: torch.addcmul(x, y, x, value=0.3),
    "addcmul_method_broadcast": lambda x, y, s: y[0].addcmul(x, y),
    "addcmul_0dim_operand": lambda x, y, s: torch.addcmul(x, y, s),
    "addcdiv": lambda x, y, s: torch.addcdiv(x, x, y.abs() + 1, value=-2),
    "addcdiv_0dim_divisor": lambda x, y, s: x.addcdiv(y, s),
    "norm_dims": lambda x, y, s: x.norm(p=2, dim=(0, 1), keepdim=True),
    "norm_dim_int": lambda x, y, s: torch.norm(x, dim=-1),
    "norm_fro": lambda x, y, s: torch.norm(x, "fro"),
    "norm_all": lambda x, y, s: x.norm(),
    "vector_norm": lambda x, y, s: torch.linalg.vector_norm(x, 2.0, dim=1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(MULTIPLY_ADDS_AND_NORMS))
def test_multiply_adds_and_norms_decompose_to_eagers_values(name, dtype):
    """Before: ``addcmul``, ``addcdiv`` and the 2-norm were not in the op table, so each ran
    as an op of its own between kernels (timm's GlobalResponseNorm: 2 of convnextv2's 6
    ops a block on the GPU). Now each spelling decomposes into pointwise ops and a sum of
    squares, in the op's math dtype: in half precision they are eager's values to the bit,
    a 0-dim float32 operand rounded to the common dtype first, as TensorIterator does."""
    fn = MULTIPLY_ADDS_AND_NORMS[name]
    for k in range(3):
        g = torch.Generator().manual_seed(k)
        x, y = (torch.randn(3, 4, 8, generator=g) * 4).to(dtype), torch.randn(4, 8, generator=g).to(dtype)
        s = torch.tensor(3.3)
        gm = lower(fn, x, y, s, shapes=True)
        assert_primitive(gm)
        got, want = gm(x, y, s), fn(x, y, s)
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)


@pytest.mark.parametrize("fn", [
    lambda x: x.norm(p=1, dim=1),
    lambda x: torch.norm(x, "nuc"),
    lambda x: torch.linalg.vector_norm(x, float("inf")),
    lambda x: torch.addcmul(x.long(), x.long(), x.long(), value=2),
], ids=["p1", "nuclear", "inf", "integer_addcmul"])
def test_norms_and_multiply_adds_the_rules_do_not_cover_stay(fn):
    x = torch.randn(4, 6)
    gm = lower(fn, x, shapes=True)
    assert any(lookup(n) is not None and lookup(n).kind == "composite"
               for n in gm.graph.nodes if n.op in ("call_function", "call_method"))


def test_global_response_norm_runs_as_kernels_with_eagers_values_and_gradients():
    """timm's GlobalResponseNorm (convnextv2): a norm over H and W, and an addcmul with
    broadcast weights. Kernels only, eager's values over fresh inputs, and eager's
    gradients where a norm is 0 (0 there, as eager's norm_backward: sqrt's own is NaN)."""
    def grn(x, w, b):
        xg = x.norm(p=2, dim=(1, 2), keepdim=True)
        xn = xg / (xg.mean(dim=-1, keepdim=True) + 1e-6)
        return x + torch.addcmul(b.view(1, 1, 1, -1), w.view(1, 1, 1, -1), x * xn)

    compiled = fxlite.compile(grn)
    for k in range(3):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(2, 5, 6, 8, generator=g)
        x[0, :, :, k] = 0  # a zero norm
        w, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
        ours = [t.clone().requires_grad_() for t in (x, w, b)]
        theirs = [t.clone().requires_grad_() for t in (x, w, b)]
        got, want = compiled(*ours), grn(*theirs)
        torch.testing.assert_close(got, want)
        (got * want.detach()).sum().backward()
        (want * want.detach()).sum().backward()
        for a, r in zip(ours, theirs):
            assert not a.grad.isnan().any()
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-4, atol=1e-4)
    assert compiled.kernels and not compiled.fallbacks

    class Calls(torch.overrides.TorchFunctionMode):
        seen: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    inference = fxlite.compile(grn)  # what runs: no op of its own for the norm or addcmul
    for _ in range(3):
        inference(torch.randn(2, 5, 6, 8), torch.randn(8), torch.randn(8))
    with Calls():
        inference(torch.randn(2, 5, 6, 8), torch.randn(8), torch.randn(8))
    assert "empty" in Calls.seen  # (the mode sees what runs: the kernels' outputs)
    assert not {"norm", "linalg_vector_norm", "addcmul"} & set(Calls.seen)
