"""Values a program writes in place before its backward are never saved by fused groups
(``codegen/lower/written_inputs.py``): the backward gives eager's gradients, and raises
only where eager's raises, on several calls with fresh inputs."""

from __future__ import annotations

import warnings

from test_triton_kernels import DEVICE  # isort: skip  (sets TRITON_INTERPRET on CPU)

import pytest
import torch
import torch.nn.functional as F

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _norm_then_written(x):
    v = x * 1.5
    y = F.rms_norm(v, (4,))
    v[..., ::2] = -1.5  # eager's rms_norm saved a float32 copy of v, not v
    return y


def _results_then_written(x):
    v = x * 1.5
    y = torch.sigmoid(v) + torch.exp(v)  # eager saves both results; the group saved v
    v[..., ::2] = -1.5
    return y


def _sigmoid_then_written_past_a_break(x):
    v = x + x
    y = torch.sigmoid(v) + torch.exp(v)  # eager saves both results; the group saved v
    if x.sum() > -1e9:  # a read: what follows is another segment
        v.mul_(2)
    return y


def _grads(fn, x):
    x = x.clone().requires_grad_()
    out = fn(x)
    out.float().square().sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("fn, dtype", [
    pytest.param(_norm_then_written, torch.float16, marks=pytest.mark.skipif(
        DEVICE == "cuda", reason="CUDA's fused rms_norm saves its input: eager's backward "
        "raises there too, and the capture runs the function eagerly")),
    (_results_then_written, torch.float32),
    (_sigmoid_then_written_past_a_break, torch.float32)])
def test_a_value_written_before_the_backward_gives_eagers_gradients(fn, dtype):
    compiled = fxlite.compile(fn)
    for _ in range(4):
        x = torch.randn(3, 4, device=DEVICE, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no part of it runs eagerly
            got = _grads(compiled, x)
        want = _grads(fn, x)
        torch.testing.assert_close(got, want)
    assert compiled.kernels and compiled.fallbacks == []


def test_a_value_eager_saved_and_the_program_wrote_raises_as_in_eager():
    # v * w saves v in eager too: writing v before the backward raises in both
    def fn(x, w):
        v = x * 2
        y = torch.sigmoid(v * w)
        v.add_(1)
        return y

    compiled = fxlite.compile(fn)
    for _ in range(3):
        outcomes = []
        for f in (fn, compiled):
            x = torch.randn(3, 4, device=DEVICE, requires_grad=True)
            w = torch.randn(4, device=DEVICE, requires_grad=True)
            try:
                f(x, w).sum().backward()
                outcomes.append(None)
            except RuntimeError as e:
                outcomes.append("modified by an inplace operation" in str(e))
        assert outcomes == [True, True]


def _outcome(run):
    """None when ``run()`` passes; True when it raises eager's error for a saved value
    written in place."""
    try:
        run()
        return None
    except RuntimeError as e:
        return "modified by an inplace operation" in str(e)


def _relu6_then_written_on_one_path(x0, x1):
    # fuzz seed 9409364: relu6 saves its input, v4, which the path past the read writes
    v4 = torch.remainder(x0, -3).unsqueeze(1)
    v6 = F.relu6(v4)
    if x1.sum() > 0:
        v4.mul_(2)
    return v6


def _std_then_written_on_one_path(x0, x1):
    # fuzz seed 9716528: std saves its result, v1, which the path past the read writes
    v1 = (x0.squeeze(1) + 2).std()
    if x1.sum() > 0:
        v1.mul_(2)
    return v1.to(copy=True)


@pytest.mark.parametrize("fn", [_relu6_then_written_on_one_path, _std_then_written_on_one_path])
def test_a_value_eager_saved_that_a_later_path_writes_raises_as_in_eager_on_every_call(fn):
    # the path without the write compiles its first segment first; the writing path reuses
    # it, and its backward must raise where eager's does
    compiled = fxlite.compile(fn)
    for sign in (-1, -1, 1, 1, -1, 1):
        x1 = torch.full((4, 1), float(sign), device=DEVICE)
        outcomes = []
        for f in (fn, compiled):
            x0 = torch.randn(4, 1, device=DEVICE, requires_grad=True)
            outcomes.append(_outcome(lambda: f(x0, x1).sum().backward()))
        assert outcomes == ([True, True] if sign > 0 else [None, None]), (sign, outcomes)


def _relu6_and_triple(x):
    return F.relu6(x), x * 3  # relu6 saves x; x * 3 saves nothing of it


@pytest.mark.parametrize("loss", ["both", "triple_only"])
def test_an_input_written_after_the_call_raises_only_where_eagers_backward_reads_it(loss):
    compiled = fxlite.compile(_relu6_and_triple)
    for _ in range(4):
        outcomes = []
        for f in (_relu6_and_triple, compiled):
            x = torch.randn(4, 3, device=DEVICE, requires_grad=True) * 1  # not a leaf
            out = f(x)
            x.mul_(2)  # after the call, before the backward
            total = out[1].sum() + (out[0].sum() if loss == "both" else 0)
            outcomes.append(_outcome(total.backward))
        assert outcomes == ([True, True] if loss == "both" else [None, None]), outcomes
    assert compiled.kernels


def test_a_write_after_the_backward_leaves_the_groups_saved_values_alone():
    # a step's update of w comes after loss.backward(), which read what the groups saved:
    # they save as before, and keep their kernels
    def stepping(w):
        def step(x):
            loss = (torch.sigmoid(x * w) * w).sum()
            loss.backward()
            with torch.no_grad():
                w.sub_(0.1 * w.grad)
                w.grad = None
            return loss.detach()
        return step

    w = torch.randn(4, device=DEVICE, requires_grad=True)
    eager_w = w.detach().clone().requires_grad_()
    compiled, eager_step = fxlite.compile(stepping(w)), stepping(eager_w)
    for _ in range(4):
        x = torch.randn(3, 4, device=DEVICE)
        torch.testing.assert_close(compiled(x), eager_step(x))
        torch.testing.assert_close(w, eager_w)
    assert compiled.kernels
    assert not [f for f in compiled.fallbacks if "eager autograd" in f]


def test_an_optimizer_step_after_the_backward_leaves_the_groups_saved_values_alone():
    # one replayed segment: forward groups, loss.backward(), then the step writes the
    # norm's weight, which the group's backward needs: it stays saved, with its kernels
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(DEVICE)
    eager_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(DEVICE)
    eager_model.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)

    def step(m, o, x):
        loss = torch.tanh(m(x)).square().mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    compiled = fxlite.compile(lambda x: step(model, opt, x))
    for _ in range(4):
        x = torch.randn(4, 8, device=DEVICE)
        torch.testing.assert_close(compiled(x), step(eager_model, eager_opt, x))
        torch.testing.assert_close(model.state_dict(), eager_model.state_dict())
    assert compiled.kernels
    assert not [f for f in compiled.fallbacks if "eager autograd" in f]
