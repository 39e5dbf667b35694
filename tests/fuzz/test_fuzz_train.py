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
