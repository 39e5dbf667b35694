"""What a compiled function keeps alive between calls: no more tensors than eager does.

A compiled training step once kept its checks' snapshots of every parameter and
optimizer state, so its memory between steps was several times eager's (a GPT-2 step on
an H200: 8 GiB more). These tests count live tensors of a shape only the model uses.
"""

from __future__ import annotations

import gc

import pytest
import torch

import fxlite

_ODD = (37, 29)  # a shape nothing else in the process has


def _live(shape: tuple[int, ...]) -> list[torch.Tensor]:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)
            and tuple(o.shape) == shape]


def _step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # reads .grad
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.AdamW(p, lr=1e-3)], ids=["sgd_momentum", "adamw"])
def test_a_compiled_training_step_keeps_what_eager_keeps(make_opt) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(_ODD[1], _ODD[0]), torch.nn.Tanh())
    twin = torch.nn.Sequential(torch.nn.Linear(_ODD[1], _ODD[0]), torch.nn.Tanh())
    twin.load_state_dict(model.state_dict())
    opt, twin_opt = make_opt(model.parameters()), make_opt(twin.parameters())
    step = fxlite.compile(_step)
    for _ in range(4):
        x = torch.randn(8, _ODD[1])
        torch.testing.assert_close(step(model, opt, x), _step(twin, twin_opt, x))
    torch.testing.assert_close(model[0].weight, twin[0].weight)
    eager_kept = len([t for t in _live(_ODD) if t is twin[0].weight
                      or any(t is v for v in twin_opt.state[twin[0].weight].values())])
    compiled_kept = [t for t in _live(_ODD) if t is not twin[0].weight
                     and not any(t is v for v in twin_opt.state[twin[0].weight].values())]
    # the weight and its optimizer state, nothing more (no snapshot, no recorded value)
    assert len(compiled_kept) == eager_kept, [tuple(t.shape) for t in compiled_kept]


def test_a_dropped_compiled_step_lets_its_model_and_optimizer_go() -> None:
    """A cache of 'is this a Tensor method?' answers, keyed by the functions a recording
    met, kept ``opt.step`` (a bound method) and with it the optimizer and the model."""
    import weakref

    def run() -> tuple[weakref.ref, weakref.ref]:
        model = torch.nn.Sequential(torch.nn.Linear(_ODD[1], _ODD[0]), torch.nn.Tanh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = fxlite.compile(_step)
        for _ in range(3):
            step(model, opt, torch.randn(8, _ODD[1]))
        return weakref.ref(model), weakref.ref(opt)

    model, opt = run()
    gc.collect()
    assert model() is None and opt() is None
