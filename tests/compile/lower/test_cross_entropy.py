"""A classifier's loss in two kernels that read the logits in their own dtype
(``codegen/lower/cross_entropy.py``): eager's loss and gradients, over several calls, with
ignored rows, non-finite logits, strided rows and double backward; and the pass that routes
``F.cross_entropy`` there, dropping the upcast before it."""
from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.lower import cross_entropy as ce
from fxlite.codegen.lower.cross_entropy import fused_cross_entropy

import fxlite

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # conftest interprets on the CPU


def _eager(x, t, ignore_index, reduction, upcast):
    return F.cross_entropy(x.float() if upcast else x, t, ignore_index=ignore_index,
                           reduction=reduction)


def _both(x, t, ignore_index=-100, reduction="mean", seed=None):
    """(loss, x's gradient) of the fused function and of eager's ops."""
    upcast = x.dtype != torch.float32
    out = []
    for f in (fused_cross_entropy, _eager):
        leaf = x.detach().clone().requires_grad_()
        loss = f(leaf, t, ignore_index, reduction, upcast)
        loss.backward(seed)
        out.append((loss.detach(), leaf.grad))
    return out


def _close(got, want, dtype):
    (gl, gg), (wl, wg) = got, want
    assert gl.dtype == wl.dtype == torch.float32 and gg.dtype == wg.dtype == dtype
    torch.testing.assert_close(gl, wl, equal_nan=True)
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(gg, wg, equal_nan=True, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradient_are_eagers_over_several_calls(monkeypatch, dtype, reduction):
    monkeypatch.setattr(ce, "_MAX_BLOCK", 16)  # rows of 37: three chunks each
    torch.manual_seed(0)
    for call in range(3):  # fresh logits, targets and ignored rows each call
        x = (torch.randn(6, 37, device=DEVICE) * 4).to(dtype)
        t = torch.randint(0, 37, (6,), device=DEVICE)
        t[call] = -100
        got, want = _both(x, t, reduction=reduction, seed=torch.tensor(1.5 + call))
        _close(got, want, dtype)


def _cuda_autocast(x, t, ignore_index, reduction, seed):
    """(loss, x's gradient) as CUDA's autocast computes ``F.cross_entropy`` of 16-bit logits
    (cross entropy passes log-softmax their dtype): log-softmax in float32 rounded to x's
    dtype; nll on its upcast; nll's gradient ``-seed / count`` rounded to x's dtype, then
    log-softmax's backward of the rounded values, ``g - exp(logp) * sum(g)``, rounded (the
    GPU test below checks this against eager's)."""
    counted = t != ignore_index
    safe = torch.where(counted, t, 0)
    log_prob = torch.log_softmax(x.float(), 1).to(x.dtype).float()
    loss = -(log_prob.gather(1, safe[:, None])[:, 0] * counted).sum()
    count = counted.sum()
    g = -(seed / count if reduction == "mean" else seed).to(x.dtype).float() * counted
    onehot = F.one_hot(safe, x.shape[1]).float()
    grad = (onehot * g[:, None] - log_prob.exp() * g[:, None]).to(x.dtype)
    return (loss / count if reduction == "mean" else loss), grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_kernels_round_where_cudas_autocast_rounds(monkeypatch, dtype, reduction):
    """The loss differs from the float32 upcast's by about 1e-3: the default tolerance of a
    float32 loss tells them apart."""
    monkeypatch.setattr(ce, "_MAX_BLOCK", 16)
    torch.manual_seed(5)
    for call in range(3):
        x = (torch.randn(6, 37, device=DEVICE) * 4).to(dtype)
        t = torch.randint(0, 37, (6,), device=DEVICE)
        t[call] = -1
        seed = torch.tensor(1.5 + call, device=DEVICE)
        leaf = x.detach().clone().requires_grad_()
        loss = ce._CrossEntropy.apply(leaf, t, -1, reduction, True)
        loss.backward(seed)
        want = _cuda_autocast(x, t, -1, reduction, seed)
        torch.testing.assert_close((loss.detach(), leaf.grad), want, atol=1e-6, rtol=1e-6)
        assert not torch.allclose(loss, _eager(x, t, -1, reduction, True))
        # a backward that builds a graph takes torch's ops, to the same value
        loss = ce._CrossEntropy.apply(leaf, t, -1, reduction, True)
        (grad,) = torch.autograd.grad(loss, leaf, seed, create_graph=True)
        assert grad.requires_grad
        torch.testing.assert_close(grad.detach(), want[1], atol=1e-6, rtol=1e-6)


def test_ignored_rows_and_other_ignore_indices():
    torch.manual_seed(1)
    x = torch.randn(5, 11, dtype=torch.bfloat16)
    t = torch.tensor([3, 7, 7, 0, 10])
    for ignore in (7, 0, -1):
        _close(*_both(x, t, ignore_index=ignore), dtype=torch.bfloat16)
    every = torch.full((5,), -100)
    for reduction in ("mean", "sum"):  # a mean over no rows is NaN, its gradient 0
        got, want = _both(x, every, reduction=reduction)
        _close(got, want, torch.bfloat16)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.isnan(_both(x, every)[0][0])


def test_non_finite_logits_give_eagers_rows():
    x = torch.randn(4, 9)
    x[0, 2] = float("nan")
    x[1, :] = float("-inf")  # a row with no finite logit
    x[2, 3:] = float("-inf")  # masked classes, the target among the finite ones
    x[3, 5] = float("inf")
    t = torch.tensor([1, 4, 2, 0])
    for rows in ([2], [0, 2], [0, 1, 2, 3]):
        _close(*_both(x[rows], t[rows]), dtype=torch.float32)


def test_strided_rows_and_empty_input():
    padded = torch.randn(6, 40)
    x = padded[:, :37]  # an LM head's padded rows, read in place
    t = torch.randint(0, 37, (6,))
    _close(*_both(x, t), dtype=torch.float32)
    loss = fused_cross_entropy(torch.randn(0, 37, requires_grad=True), t[:0], -100, "sum")
    assert loss.item() == 0.0


def test_a_target_out_of_range_makes_the_loss_nan():
    """eager's CUDA kernel stops with a device-side assertion; the kernel says NaN."""
    x = torch.randn(3, 8, dtype=torch.bfloat16, device=DEVICE)
    for t in ([1, 8, 2], [1, -3, 2]):
        t = torch.tensor(t, device=DEVICE)
        assert torch.isnan(fused_cross_entropy(x, t, -100, "mean", True))


def test_double_backward_is_eagers():
    torch.manual_seed(2)
    x = torch.randn(4, 10, dtype=torch.float64).float()
    t = torch.tensor([1, -100, 9, 0])
    grads = []
    for f in (fused_cross_entropy, _eager):
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(leaf, t, -100, "mean", False), leaf, create_graph=True)
        (gg,) = torch.autograd.grad((g * g).sum(), leaf)
        grads.append((g.detach(), gg))
    torch.testing.assert_close(grads[0], grads[1])


def test_other_layouts_and_dtypes_run_eagers_ops():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)  # float64: the check's run
    t = torch.tensor([0, 1, 2, 3])
    torch.testing.assert_close(fused_cross_entropy(x, t), F.cross_entropy(x, t))
    y = torch.randn(2, 6, 3)  # (N, C, d): eager's other form
    t3 = torch.randint(0, 6, (2, 3))
    torch.testing.assert_close(fused_cross_entropy(y, t3), F.cross_entropy(y, t3))


class _Head(torch.nn.Module):
    """An LM head and transformers' loss: the logits upcast, flattened, cross entropy."""

    def __init__(self, keep_logits: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(37, 16)
        self.head = torch.nn.Linear(16, 37)
        self.keep_logits = keep_logits

    def forward(self, ids, labels):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            logits = self.head(self.embed(ids))
        logits = logits.float()
        loss = F.cross_entropy(logits.view(-1, 37), labels.view(-1), ignore_index=-100)
        return (loss, logits) if self.keep_logits else loss


def _compiled_steps_match_eager(monkeypatch, model: type, ignore_index: int, *args: Any
                                ) -> Any:
    """Compile a training step (loss, backward, the gradients read, an optimizer step) of one
    of two equal ``model(*args)``s and run it beside eager on the other over three calls
    (fresh tokens, an ignored label that moves), comparing loss, gradients and parameters,
    on CUDA where there is one; the pass runs on CUDA only, so on the CPU the test says it is
    on one (the kernels interpret). Returns the compiled step."""
    from fxlite.codegen.lower import segment

    if DEVICE == "cpu":
        monkeypatch.setattr(segment, "_on_gpu", lambda sample: True)
    torch.manual_seed(3)
    models = [model(*args).to(DEVICE) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]

    def step(model, opt, ids, labels):
        out = model(ids, labels)
        (out[0] if isinstance(out, tuple) else out).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out, grads

    compiled = fxlite.compile(step)
    for call in range(3):
        ids = torch.randint(0, 37, (2, 5), device=DEVICE)
        labels = torch.randint(0, 37, (2, 5), device=DEVICE)
        labels[call % 2, call] = ignore_index
        got = compiled(models[0], opts[0], ids, labels)
        want = step(models[1], opts[1], ids, labels)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)  # the loss
        # the gradients pass through bfloat16 logits: each rounds its own float32 value
        torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-2)
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(p, q, atol=1e-3, rtol=1e-2)
    assert compiled.tier == "replayed"
    return compiled


@pytest.mark.parametrize("keep_logits", [False, True])
def test_a_compiled_training_step_routes_its_loss_and_matches_eager(monkeypatch, keep_logits):
    compiled = _compiled_steps_match_eager(monkeypatch, _Head, -100, keep_logits)
    # the upcast goes only where nothing else reads the float32 logits
    line = compiled.code.split("fused_cross_entropy(")[1].split("\n")[0]
    assert ("True, False)" in line) == (not keep_logits)


def test_the_pass_leaves_other_losses_alone():
    from fxlite.codegen.lower.cross_entropy import fuse_cross_entropy
    from fxlite.passes.shape_prop import ShapeProp

    def smooth(x, t):
        return F.cross_entropy(x.float(), t, label_smoothing=0.1)

    def weighted(x, t, w):
        return F.cross_entropy(x.float(), t, weight=w)

    def each(x, t):
        return F.cross_entropy(x.float(), t, reduction="none")

    x, t = torch.randn(4, 6, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 3])
    for f, args in ((smooth, (x, t)), (weighted, (x, t, torch.rand(6))), (each, (x, t))):
        gm = fxlite.symbolic_trace(f)
        ShapeProp(gm).propagate(*args)
        before = gm.code
        assert not fuse_cross_entropy(copy.deepcopy(gm)) and gm.code == before
    gm = fxlite.symbolic_trace(lambda x, t: F.cross_entropy(x.float(), t))
    ShapeProp(gm).propagate(x, t)
    assert fuse_cross_entropy(gm) and "float" not in gm.code
    torch.testing.assert_close(gm(x, t), F.cross_entropy(x.float(), t))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_cuda_a_vocabulary_of_gpt2s_width_is_as_close_to_float64_as_eager(dtype):
    torch.manual_seed(4)
    x = (torch.randn(64, 50257, device="cuda") * 3).to(dtype)
    t = torch.randint(0, 50257, (64,), device="cuda")
    t[::7] = -100
    got, want = _both(x, t)
    _close(got, want, dtype)
    leaf = x.double().requires_grad_()
    F.cross_entropy(leaf, t).backward()
    for (loss, grad), name in ((got, "fused"), (want, "eager")):
        assert (grad.double() - leaf.grad).abs().mean() <= \
            1.5 * (want[1].double() - leaf.grad).abs().mean() + 1e-12, name


class _Nano(torch.nn.Module):
    """nanoGPT's loss: 16-bit logits under autocast, which runs the loss in float32."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(37, 16)
        self.head = torch.nn.Linear(16, 37)

    def forward(self, ids, labels):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            logits = self.head(self.embed(ids))
            return F.cross_entropy(logits.view(-1, 37), labels.view(-1), ignore_index=-1)


def test_a_loss_under_autocast_reads_the_16_bit_logits(monkeypatch):
    """On CUDA (where it rounds the log-probabilities: the loss is 1e-3 from the float32
    upcast's, far outside the loss's tolerance) and on the CPU (where it does not)."""
    compiled = _compiled_steps_match_eager(monkeypatch, _Nano, -1)
    line = compiled.code.split("fused_cross_entropy(")[1].split("\n")[0]
    assert "-1, 'mean', False, True)" in line


@pytest.mark.gpu
def test_on_cuda_the_autocast_route_is_cross_entropy_under_autocast():
    torch.manual_seed(6)
    x = (torch.randn(64, 50257, device="cuda") * 3).to(torch.bfloat16)
    t = torch.randint(0, 50257, (64,), device="cuda")
    t[::5] = -100
    out = []
    for f in (lambda v: fused_cross_entropy(v, t, -100, "mean", False, True),
              lambda v: F.cross_entropy(v, t)):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(leaf)
        loss.backward()
        out.append((loss.detach(), leaf.grad))
    one = torch.tensor(1.0, device="cuda")
    for got in (out[0], _cuda_autocast(x, t, -100, "mean", one)):
        torch.testing.assert_close(got[0], out[1][0])
        torch.testing.assert_close(got[1], out[1][1], atol=1e-6, rtol=2.0 ** -7)


@pytest.mark.parametrize("model,ignore", [(_Head, -100), (_Nano, -1)], ids=["upcast", "autocast"])
def test_the_loss_reads_a_padded_heads_rows_in_place(monkeypatch, model, ignore):
    """pad_linears pads the head's 37 rows to 40 (bfloat16): the loss reads the padded
    logits, with no clone of their first columns, and its backward writes their gradient."""
    from fxlite.codegen.lower import pad_matmul

    monkeypatch.setattr(pad_matmul, "_MIN_FLOPS", 0)
    compiled = _compiled_steps_match_eager(monkeypatch, model, ignore)
    assert "padded_linear(" in compiled.code and "clone" not in compiled.code
    line = compiled.code.split("fused_cross_entropy(")[1].split("\n")[0]
    assert line.startswith("reshape, ") and line.split(")")[0].endswith(", 37")
    assert re.search(r"reshape\(\w+, \(-1, 40\)\)", compiled.code)


def test_padded_rows_give_the_columns_loss_and_zero_gradients_beyond():
    torch.manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        padded = torch.randn(6, 40, device=DEVICE).to(dtype)
        padded[:, 37:] = 0  # a padded linear's zero rows give zero columns
        t = torch.tensor([0, 36, -100, 5, 1, 2], device=DEVICE)
        got, want = [], []
        for f, out in ((lambda v: fused_cross_entropy(v, t, -100, "mean", True, False, 37),
                        got), (lambda v: _eager(v[:, :37], t, -100, "mean", True), want)):
            leaf = padded.clone().requires_grad_()
            loss = f(leaf)
            loss.backward()
            out += [loss.detach(), leaf.grad]
        _close(got, want, dtype)
        assert torch.equal(got[1][:, 37:], torch.zeros_like(got[1][:, 37:]))
        leaf = padded.clone().requires_grad_()  # create_graph: the same, padded
        (g,) = torch.autograd.grad(fused_cross_entropy(leaf, t, -100, "mean", True, False, 37),
                                   leaf, create_graph=True)
        torch.testing.assert_close(g.detach(), got[1], atol=1e-6, rtol=1e-5)
