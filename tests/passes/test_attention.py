"""unpack_attention: nn.MultiheadAttention compiles to its fast path.

Under fxlite.compile's recorder nn.MultiheadAttention takes its slow path (any
__torch_function__ mode makes it); the pass rewrites that call into eager's fast-path op
where eager takes it (no grad recorded, an even head count), else into one projection,
attention on views and the output projection, and leaves every other form alone.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from fxlite.codegen.runtime.kernel import interpreting

import fxlite

DEVICE = "cpu" if interpreting() else "cuda"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class Encoder(nn.Module):
    """A pre-norm ViT encoder block's attention half."""

    def __init__(self, batch_first: bool = True, dropout: float = 0.0, e: int = 16,
                 heads: int = 2) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(e)
        self.attn = nn.MultiheadAttention(e, heads, dropout=dropout, batch_first=batch_first)

    def forward(self, x, **kw):
        y = self.ln(x)
        y, w = self.attn(y, y, y, **kw)
        return x + y if w is None else (x + y, w)


def targets(compiled):
    return [n.target for seg in compiled._last for n in seg.compiled.gm.graph.nodes]


@pytest.mark.parametrize("batch_first", [True, False])
def test_self_attention_without_grad_runs_eagers_fast_path_op_and_kernels(batch_first):
    model = Encoder(batch_first).to(DEVICE).eval()
    c = fxlite.compile(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        for _ in range(3):
            x = torch.randn(2, 5, 16, device=DEVICE)
            torch.testing.assert_close(c(x, need_weights=False), model(x, need_weights=False))
    found = targets(c)
    assert F.multi_head_attention_forward not in found
    assert torch._native_multi_head_attention in found  # one call, as eager's
    assert F.scaled_dot_product_attention not in found
    assert c.fallbacks == [] and len(c.kernels) == 2  # layer norm; residual


@pytest.mark.parametrize("why", ["grad", "odd heads"])
def test_self_attention_runs_the_fast_paths_calls_where_eager_would_not_take_it(why):
    # Eager's fast path needs an even head count and nothing for autograd to record; the
    # pass then writes its math as calls: one projection, attention on views, the output
    # projection (whose bias fuses with the residual).
    torch.manual_seed(0)
    model = Encoder(heads=2 if why == "grad" else 1).to(DEVICE).eval()
    c = fxlite.compile(model)
    for _ in range(3):
        x = torch.randn(2, 5, 16, device=DEVICE)
        with torch.set_grad_enabled(why == "grad"):
            got, want = c(x, need_weights=False), model(x, need_weights=False)
        torch.testing.assert_close(got, want)
        if why == "grad":
            g = torch.randn_like(got)
            mine = torch.autograd.grad(got, list(model.parameters()), g)
            theirs = torch.autograd.grad(want, list(model.parameters()), g)
            torch.testing.assert_close(mine, theirs)
    found = targets(c)
    assert F.multi_head_attention_forward not in found
    assert torch._native_multi_head_attention not in found
    assert torch._C._nn.scaled_dot_product_attention in found or \
        F.scaled_dot_product_attention in found
    assert c.fallbacks == []
    if why == "odd heads":  # the residual add reads the projection through no transposes
        assert len(c.kernels) == 2  # layer norm; bias + residual
        code = c._last[0].compiled.gm.code
        assert code.count("transpose(") == 3, code  # query in and back, heads out


@pytest.mark.parametrize("case", ["weights", "mask", "cross", "dropout"])
def test_other_forms_keep_the_slow_path_and_eagers_results(case):
    model = Encoder(dropout=0.5 if case == "dropout" else 0.0).to(DEVICE)
    model.train(case == "dropout")
    mask = torch.zeros(2, 5, dtype=torch.bool, device=DEVICE)
    mask[1, 3:] = True
    kw = {"weights": {"need_weights": True}, "mask": {"key_padding_mask": mask,
                                                      "need_weights": False},
          "cross": {}, "dropout": {"need_weights": False}}[case]
    if case == "cross":
        model.forward = lambda x: model.attn(model.ln(x), x, x, need_weights=False)[0]
    c = fxlite.compile(model)
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(2, 5, 16, device=DEVICE)
            torch.manual_seed(seed)
            got = c(x, **kw) if case != "cross" else c(x)
            torch.manual_seed(seed)
            want = model(x, **kw) if case != "cross" else model(x)
            torch.testing.assert_close(got, want)
    assert F.multi_head_attention_forward in targets(c)
