"""Linear layers with odd output widths run as aligned row groups or with padded, aligned
weights (``codegen/lower/pad_matmul.py``), giving eager's values and layout; both follow every
write to the weight, through ``.data`` too."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from fxlite.codegen.lower import pad_matmul
from fxlite.codegen.lower.pad_matmul import grouped_linear, pad_linears, padded_linear
from fxlite.passes.shape_prop import ShapeProp

import fxlite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_padded_linear_gives_aligned_rows_that_start_with_eagers_values(dtype, with_bias):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, dtype=dtype)
    for w in (torch.randn(13, 16, dtype=dtype), torch.randn(16, 13, dtype=dtype).t()):
        b = torch.randn(13, dtype=dtype) if with_bias else None
        torch.empty(4096, dtype=dtype).fill_(float("nan"))  # freed memory the pad may reuse
        with torch.no_grad():
            got, want = padded_linear(x, w, b), F.linear(x, w, b)
        assert got.shape == (2, 3, 16)  # 13 rounded up to 16 bytes' worth
        assert got.stride(-2) * got.element_size() % 16 == 0
        torch.testing.assert_close(got[..., :13], want)
        assert torch.equal(got[..., 13:], torch.zeros_like(got[..., 13:]))  # zero rows


def test_the_padded_copy_follows_every_write_to_the_weight():
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    writes = [lambda: w.mul_(2),  # in place
              lambda: w.data.copy_(torch.randn(5, 8)),  # through .data: no version change
              lambda: setattr(w, "data", torch.randn(5, 8))]  # new storage
    with torch.no_grad():
        for write in writes:
            torch.testing.assert_close(padded_linear(x, w)[:, :5], F.linear(x, w))
            write()
            torch.testing.assert_close(padded_linear(x, w)[:, :5], F.linear(x, w))


@pytest.mark.parametrize("with_bias", [False, True])
def test_calls_autograd_records_are_padded_and_get_eagers_gradients(with_bias):
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    b = torch.randn(5, requires_grad=True) if with_bias else None
    leaves = [t for t in (x, w, b) if t is not None]
    out = padded_linear(x, w, b)
    assert out.shape == (4, 8)  # padded: a training step's matmuls are aligned too
    seed = torch.randn(4, 5)
    (out[:, :5] * seed).sum().backward()
    got = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    (F.linear(x, w, b) * seed).sum().backward()
    for g, t in zip(got, leaves):
        assert g.shape == t.shape
        torch.testing.assert_close(g, t.grad)


def test_under_autocast_the_weight_is_padded_in_the_dtype_the_matmul_runs_in():
    x = torch.randn(4, 8)
    w = torch.randn(12, 8, requires_grad=True)  # aligned for float32, not for bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.linear(x, w)
    for autocast in (True, False):  # the recorded dtype holds whatever autocast says
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = padded_linear(x, w, None, 16, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == (4, 16)
        torch.testing.assert_close(got[:, :12], want)
        got[:, :12].float().sum().backward()
        gw, w.grad = w.grad, None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.linear(x, w).float().sum().backward()
        assert gw.dtype == torch.float32
        torch.testing.assert_close(gw, w.grad)
        w.grad = None


class Head(torch.nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, rows, bias=False)

    def forward(self, x):  # F.linear: what fxlite.compile's recordings hold
        hidden = torch.relu(F.linear(x, self.proj.weight, self.proj.bias))
        return F.linear(hidden, self.head.weight)


def _nan_empty(monkeypatch):
    """new_empty gives NaNs: a column a kernel leaves unwritten shows."""
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, size, **kw: torch.full(
        size, float("nan"), dtype=self.dtype, device=self.device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [521, 1001, 1031])
def test_grouped_linear_writes_every_column_of_eagers_contiguous_result(monkeypatch, dtype,
                                                                        rows):
    _nan_empty(monkeypatch)
    torch.manual_seed(rows)
    x, w = torch.randn(2, 520, 64, dtype=dtype), torch.randn(rows, 64, dtype=dtype)
    with torch.no_grad(), mock.patch.object(torch, "bmm", wraps=torch.bmm) as bmm:
        got = grouped_linear(x, w, None)  # recordings pass the bias None positionally
    assert bmm.call_count == 1  # the row groups ran, not the plain linear
    want = F.linear(x.double(), w.double())
    assert got.shape == want.shape and got.is_contiguous() and got.dtype == dtype
    tol = {torch.float32: 1e-5}.get(dtype, 1e-2)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 8)


def test_grouped_linear_runs_the_plain_linear_for_tensors_that_do_not_fit():
    torch.manual_seed(0)
    w = torch.randn(1001, 64)
    base = torch.randn(1024 * 64 + 1)
    cases = {"transposed": torch.randn(64, 1024).t(),
             "misaligned": base[1:].view(1024, 64),
             "rows per does not divide": torch.randn(1023, 64),
             "no rows": torch.randn(0, 64),
             "a bias": torch.randn(1024, 64)}
    for name, x in cases.items():
        with torch.no_grad(), mock.patch.object(torch, "bmm", wraps=torch.bmm) as bmm:
            bias = torch.randn(1001) if name == "a bias" else None
            got = grouped_linear(x, w, bias)
        assert bmm.call_count == 0, name
        torch.testing.assert_close(got, F.linear(x, w, bias), msg=name)
    x = torch.randn(1024, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got, want = grouped_linear(x, w), F.linear(x, w)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    x.requires_grad_()
    seed = torch.randn(1024, 1001)
    grouped_linear(x, w).backward(seed)  # autograd records it: the plain linear
    torch.testing.assert_close(x.grad, seed @ w)


def test_the_pass_routes_only_large_unaligned_linears(monkeypatch):
    monkeypatch.setattr(pad_matmul, "_MIN_FLOPS", 2 * 64 * 32 * 32 + 1)  # proj is too small
    monkeypatch.setattr(pad_matmul, "_F32_PAD_ROWS", 64)
    for rows, expect in ((1001, True), (1000, False)):
        gm = fxlite.symbolic_trace(Head(rows))
        x = torch.randn(64, 32)
        ShapeProp(gm).propagate(x)
        assert pad_linears(gm) == expect
        assert ("padded_linear" in gm.code) == expect and gm.code.count("padded_linear") <= 1
        with torch.no_grad():
            got = gm(x)
            torch.testing.assert_close(got, Head.forward(gm, x))
            assert got.is_contiguous()


def test_the_pass_picks_row_groups_for_many_rows_and_leaves_few_float32_rows_alone(
        monkeypatch):
    _nan_empty(monkeypatch)
    monkeypatch.setattr(pad_matmul, "_MIN_FLOPS", 0)
    for rows_in, routed in ((512, "grouped_linear"), (256, None)):  # f32: 4 to 16 bytes
        gm = fxlite.symbolic_trace(Head(1001))
        x = torch.randn(rows_in, 32)
        ShapeProp(gm).propagate(x)
        assert pad_linears(gm) == (routed is not None)
        assert "padded_linear" not in gm.code  # fewer than _F32_PAD_ROWS float32 rows
        assert routed is None or gm.code.count(routed) == 1
        with torch.no_grad():
            for _ in range(2):
                x = torch.randn(rows_in, 32)
                got = gm(x)
                torch.testing.assert_close(got, Head.forward(gm, x))
                assert got.is_contiguous()


def test_compiled_the_padded_head_copies_its_columns_in_a_kernel(monkeypatch):
    """The clone of the linear's columns is a graph op: fuse makes it a kernel (here a
    lone copy; the pass runs on CUDA only, so this test says it is on one)."""
    from fxlite.codegen.lower import segment

    monkeypatch.setattr(pad_matmul, "_MIN_FLOPS", 0)
    monkeypatch.setattr(pad_matmul, "_F32_PAD_ROWS", 0)
    monkeypatch.setattr(segment, "_on_gpu", lambda sample: True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # conftest interprets on CPU
    torch.manual_seed(0)
    model = Head(37).eval().to(device)
    compiled = fxlite.compile(model)
    with torch.no_grad():
        for _ in range(3):  # fresh inputs each call
            x = torch.randn(2, 5, 32, device=device)
            got, want = compiled(x), model(x)
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
            got.add_(1)  # the result is the caller's: no other tensor changes
            torch.testing.assert_close(compiled(x), want)
    assert "padded_linear" in compiled.code
    rows = [line.split() for line in compiled.report().splitlines()]
    assert [r[1:3] for r in rows if "clone" in r] == [["pointwise", "clone"]]  # one copy kernel


def _write_the_weight(weight, k):
    """The k-th write of a GPU test (none for k < 0): in place, then through ``.data``,
    then new storage."""
    if k == 0:
        weight.mul_(-2)
    elif k == 1:
        weight.data.mul_(-1)
    elif k == 2:
        weight.data = torch.randn_like(weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fxlite pads on CUDA")
def test_on_the_gpu_an_lm_head_with_an_odd_vocabulary_is_padded():
    torch.manual_seed(0)
    model = Head(50257).cuda().eval().to(torch.bfloat16)
    compiled = fxlite.compile(model)
    with torch.no_grad():
        for step in range(6):
            _write_the_weight(model.head.weight, step - 3)
            x = torch.randn(64, 8, 32, device="cuda", dtype=torch.bfloat16)
            got, want = compiled(x), model(x)
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
            assert got.stride() == want.stride()
    assert "padded_linear" in compiled.code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fxlite pads on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_the_gpu_an_lm_head_over_many_rows_runs_as_row_groups(dtype):
    torch.manual_seed(0)
    model = Head(50257).cuda().eval().to(dtype)
    compiled = fxlite.compile(model)
    tol = {torch.float32: {}}.get(dtype, {"rtol": 1.6e-2, "atol": 1e-2})
    with torch.no_grad():
        for step in range(5):
            _write_the_weight(model.head.weight, step - 2)
            x = torch.randn(16, 128, 32, device="cuda", dtype=dtype)
            got, want = compiled(x), model(x)
            torch.testing.assert_close(got, want, **tol)
            assert got.stride() == want.stride()
    assert "grouped_linear" in compiled.code


def _train(model, opt, x, y, autocast):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    return loss


def _training_matches_eager(device, rows, autocast, steps, tol):
    import copy

    torch.manual_seed(0)
    model = Head(rows).to(device)
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    compiled = fxlite.compile(_train)
    for step in range(steps):  # fresh inputs each step; the weights change every step
        x = torch.randn(4, 16, 32, device=device)
        y = torch.randint(0, rows, (4, 16), device=device)
        got = compiled(model, opt, x, y, autocast)
        want = _train(twin, twin_opt, x, y, autocast)
        torch.testing.assert_close(got, want, **tol)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, **tol, msg=name)
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)
            state, twin_state = opt.state[p], twin_opt.state[q]
            torch.testing.assert_close(state["exp_avg"], twin_state["exp_avg"], **tol)
    return compiled


def _spy_on_padding(monkeypatch):
    """The (width, dtype) of each padded_linear call the compiled step makes."""
    padded = []
    real = pad_matmul.padded_linear

    def spy(*args):
        padded.append(args[3:])
        return real(*args)

    monkeypatch.setattr(pad_matmul, "padded_linear", spy)
    return padded


@pytest.mark.parametrize("autocast", [False, True])
def test_a_compiled_training_step_pads_the_head_and_matches_eager(monkeypatch, autocast):
    """Autograd records the padded linear: the backward's matmuls are aligned too, and
    losses, gradients, weights and optimizer state are eager's over several steps."""
    from fxlite.codegen.lower import segment

    monkeypatch.setattr(pad_matmul, "_MIN_FLOPS", 0)
    monkeypatch.setattr(pad_matmul, "_F32_PAD_ROWS", 0)
    monkeypatch.setattr(segment, "_on_gpu", lambda sample: True)
    padded = _spy_on_padding(monkeypatch)
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {}
    compiled = _training_matches_eager("cpu", 37, autocast, 4, tol)
    assert not compiled.fallbacks
    # rows of 37 pad to 40 in float32 and bfloat16 alike: the dtype is the recorded one
    assert padded and set(padded) == {(40, torch.bfloat16 if autocast else None)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fxlite pads on CUDA")
def test_on_the_gpu_a_training_step_with_an_odd_vocabulary_pads_its_head(monkeypatch):
    monkeypatch.setattr(pad_matmul, "_MIN_FLOPS", 0)  # a small batch, to keep it quick
    padded = _spy_on_padding(monkeypatch)
    _training_matches_eager("cuda", 50257, True, 6, {"rtol": 2e-2, "atol": 2e-2})
    assert set(padded) == {(50264, torch.bfloat16)}  # bfloat16: 8 elements to 16 bytes
