"""The training-step fuzzer (``fuzz_train.py``) on a few programs that between them
draw every optimizer, model kind (image, vector, sequence) and option and change between calls; long
runs are ``benchmarks/fuzz_train.py``'s."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from fuzz_train import check_train, draw_train
from fxlite.codegen.runtime.kernel import interpreting

DEVICE = "cpu" if interpreting() else "cuda"


@pytest.mark.parametrize("seed", [20, 42, 75, 3, 13, 2, 97, 51])
def test_a_drawn_training_step_matches_eagers_state_on_every_call(seed):
    program = draw_train(seed)
    stats: dict[str, int] = {}
    failures = check_train(program, DEVICE, stats)
    assert not failures, program.describe() + "\n" + "\n".join(failures)
    assert stats.get("calls with kernels", 0) > 0, stats  # fxlite's kernels ran


def test_the_check_sees_a_step_that_differs_from_eagers(monkeypatch):
    # The comparison is not vacuous: the compiled side's learning rate 1% higher fails.
    import fuzz_train

    build, sides = fuzz_train._build, []

    def higher(program, device, *dtype):
        model, opt, sched = build(program, device, *dtype)
        sides.append(opt)
        if len(sides) == 2:  # eager's, then the compiled side's, then float64's
            for group in opt.param_groups:
                group["lr"] *= 1.01
        return model, opt, sched

    monkeypatch.setattr(fuzz_train, "_build", higher)
    assert check_train(draw_train(20), DEVICE)


def _compiled_side_then(monkeypatch, change):
    """Make the compiled side's step run ``change(model)`` (under no_grad) after itself."""
    import fuzz_train
    import torch

    make, made = fuzz_train._step_fn, []

    def off(program):
        step = make(program)
        made.append(step)
        if len(made) < 4:  # eager's, float64's, the reversed batch's; then the compiled one
            return step

        def step_off(model, opt, sched, x, y):
            out = step(model, opt, sched, x, y)
            with torch.no_grad():
                change(model)
            return out
        return step_off

    monkeypatch.setattr(fuzz_train, "_step_fn", off)


@pytest.mark.parametrize("seed", [20, 42])
def test_the_check_sees_parameters_that_differ_from_eagers(monkeypatch, seed):
    # Each call starts from eager's state (fuzz_train._level): a compiled step that
    # leaves one parameter 3% off still fails, on the values alone (seed 20 is under
    # autocast: the pooled check).
    _compiled_side_then(monkeypatch, lambda model: next(model.parameters()).mul_(1.03))
    failures = check_train(draw_train(seed), DEVICE)
    assert failures and all("param 0.weight" in f for f in failures), failures


@pytest.mark.parametrize("seed", [700053, 701182, 702457, 703034])
def test_autocast_steps_whose_kernels_round_elsewhere_match(seed):
    # A linear then a LayerNorm under bfloat16 autocast: fxlite's fused kernels round at
    # other points than eager's ops (on the CPU, eager's mixed-dtype LayerNorm backward
    # rounds its weight and bias gradients like bfloat16; fxlite's are float32's), and
    # both eager references round each element alike, so one key per call strayed more
    # than 4x eager's distance from float64's by luck. Judged over the call, they match.
    program = draw_train(seed)
    assert program.autocast
    failures = check_train(program, DEVICE)
    assert not failures, program.describe() + "\n" + "\n".join(failures)


@pytest.mark.parametrize("seed", [2, 7])
def test_the_pooled_autocast_check_sees_gradients_that_differ(monkeypatch, seed):
    # Under autocast the check pools its keys over the call; gradients 10% off still fail.
    def scale_grads(model):
        for q in model.parameters():
            if q.grad is not None:
                q.grad.mul_(1.1)

    _compiled_side_then(monkeypatch, scale_grads)
    program = draw_train(seed)
    assert program.autocast
    failures = check_train(program, DEVICE)
    assert failures and all("grad" in f for f in failures), failures
