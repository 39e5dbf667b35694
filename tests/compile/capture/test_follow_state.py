"""Following a function that changes Python state it reads (codegen/compile.py,
``_stays_eager``): a module's counter, a buffer rebound to a new tensor, a training flag
set inside the call. A replay would skip that Python, so such a function is *followed*
(codegen/capture/follow.py): its Python runs on every call, its torch calls served by kernels; a
call whose torch calls the state changes (BatchNorm in eval, not train) leaves the
recording there, and a tensor rebound between calls is bound where first used.

Every test runs the compiled function beside a twin made from the same seed, several calls
with fresh inputs and with state changed between calls, and compares on every call the
results, the modules' state (parameters, buffers, gradients, training flags, plain
attributes) and the optimizers' state; and it checks that compiled pieces served calls.
"""

from __future__ import annotations

from test_compile_contract import DEVICE  # isort: skip
from test_compile_contract import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("triton")

from fxlite.codegen.capture.follow import Follow

import fxlite


def fresh(i: int, *shape: int) -> torch.Tensor:
    """A fresh input for call ``i``."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + i)).to(DEVICE)


def same(a: Any, b: Any, where: str) -> None:
    """``a`` (compiled) equals ``b`` (eager): tensors by value, containers item by item."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), where
        torch.testing.assert_close(a, b, msg=where)
    elif isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in b:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def state(obj: Any) -> Any:
    """What a call may change of a module (parameters, buffers, gradients, training flags,
    plain attributes) or an optimizer (its ``state_dict``)."""
    if isinstance(obj, torch.optim.Optimizer):
        return obj.state_dict()
    return {"tensors": {k: v.detach().clone() for k, v in obj.state_dict().items()},
            "grads": {k: p.grad for k, p in obj.named_parameters()},
            "training": {k: m.training for k, m in obj.named_modules()},
            "attrs": {f"{k}.{a}": v for k, m in obj.named_modules() for a, v in vars(m).items()
                      if not a.startswith("_") and a != "training"}}


def side_by_side(make: Callable[[], tuple[Callable[..., Any], dict[str, Any]]],
                 args: Callable[[int], tuple], calls: int, monkeypatch: pytest.MonkeyPatch,
                 between: Callable[[dict[str, Any], int], None] | None = None,
                 warns: str | None = None) -> list[tuple]:
    """Run ``make()``'s function eagerly and compiled (each from seed 0) on ``args(i)``,
    ``between(objects, i)`` changing the state before call ``i``; compare results and
    state after every call. fxlite warns nothing, or once ``warns``. Returns per compiled
    call: (tier, kernels, fallbacks, how many pieces' kernels served it, whether it was
    recorded: such a call runs in eager PyTorch by construction)."""
    runs: list[tuple[list, list, list[str]]] = []
    served = [0]
    run = Follow.run_piece

    def counted(self: Follow, piece: Any, env: dict[str, Any]) -> bool:
        ok = run(self, piece, env)
        served[0] += ok and not piece.compiled.fallbacks
        return ok

    monkeypatch.setattr(Follow, "run_piece", counted)
    for compiled in (False, True):
        torch.manual_seed(0)
        fn, objects = make()
        f = fxlite.compile(fn) if compiled else fn
        outs, tiers = [], []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for i in range(calls):
                if between is not None:
                    between(objects, i)
                served[0] = 0
                recorded = getattr(f, "_recordings", 0)
                outs.append((f(*args(i)), {k: state(v) for k, v in objects.items()}))
                if compiled:
                    tiers.append((f.tier, len(f.kernels), list(f.fallbacks), served[0],
                                  f._recordings > recorded))
        told = [str(w.message) for w in said if str(w.message).startswith("fxlite")]
        runs.append((outs, tiers, told))
    (eager, _, _), (mine, tiers, told) = runs
    for i, (a, b) in enumerate(zip(mine, eager)):
        same(a, b, f"call {i}")
    assert told == ([] if warns is None else [warns]), told
    return tiers


def followed(tier: tuple) -> bool:
    """Whether a call was followed with no fallback, compiled pieces serving it."""
    return tier[0].startswith("followed: it changes Python state") and not tier[2] \
        and tier[3] > 0 and not tier[4]


def kernels_ran(tiers: list[tuple]) -> bool:
    """Whether Triton kernels ran on the last call (the pieces followed, or replayed)."""
    return tiers[-1][1] > 0 and not tiers[-1][2] and not tiers[-1][4]


def test_a_module_counter_read_as_a_number_is_followed(monkeypatch):
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.num_calls = 0

        def forward(self, x):
            self.num_calls += 1
            return self.fc(x).relu() * self.num_calls

    def make():
        m = Counted().to(DEVICE)
        return m, {"model": m}

    def between(objects, i):
        if i == 3:
            objects["model"].num_calls = 10  # set from outside: the Python reads it

    tiers = side_by_side(make, lambda i: (fresh(i, 4, 8),), 6, monkeypatch, between)
    assert all(followed(t) for t in tiers[1:]) and kernels_ran(tiers), tiers


def test_a_buffer_rebound_in_forward_is_bound_on_every_call(monkeypatch):
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            self.calls = self.calls + 1  # a new tensor bound to the buffer's name
            return self.fc(x) / self.calls

    def make():
        m = Counting().to(DEVICE)
        return m, {"model": m}

    def between(objects, i):
        if i == 4:  # rebound from outside too
            objects["model"].calls = torch.full((), 10.0, device=DEVICE)

    tiers = side_by_side(make, lambda i: (fresh(i, 4, 8),), 7, monkeypatch, between)
    # call 1 passes another tensor where call 0 read the buffer: it leaves the recording,
    # and from then on the buffer is bound where first used
    assert all(followed(t) for t in tiers[2:]) and kernels_ran(tiers), tiers


def test_a_buffer_rebound_after_its_piece_began_is_never_stale(monkeypatch):
    class Smoothed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("h", torch.zeros(8))

        def forward(self, x):
            y = self.fc(x)  # the piece that starts here reads h further on
            self.h = (y.mean(0) * 0.5 + self.h).detach()  # (as recorded: no grad)
            return y.relu() + self.h

    def make():
        m = Smoothed().to(DEVICE)
        return m, {"model": m}

    def between(objects, i):
        if i == 4:
            objects["model"].h = torch.ones(8, device=DEVICE)

    tiers = side_by_side(make, lambda i: (fresh(i, 4, 8),), 7, monkeypatch, between)
    # call 1: fc's piece ran ahead on the recorded h, and the call left the recording at
    # the h it passes (the piece's values that read h were never returned)
    assert all(followed(t) for t in tiers[2:]) and kernels_ran(tiers), tiers


def test_a_training_flag_passed_as_an_argument_gets_a_plan_per_mode(monkeypatch):
    def make():
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()).to(DEVICE)

        def fn(x, training):
            model.train(training)
            return model(x)

        return fn, {"model": model}

    tiers = side_by_side(make, lambda i: (fresh(i, 4, 8), i % 2 == 0), 7, monkeypatch)
    # call 0 (train, as the model was) changes nothing: replayed; calls 1 and 2 record
    # the eval and the train plan; then each call follows its mode's
    assert tiers[0][0] == "replayed" and tiers[0][1] > 0
    assert all(followed(t) for t in tiers[3:]) and kernels_ran(tiers), tiers


def test_a_training_flag_set_inside_forward_leaves_the_recording_where_calls_differ(
        monkeypatch):
    class Flipping(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.bn = nn.BatchNorm1d(8)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            self.bn.train(self.calls % 3 != 0)  # eval on every third call
            return self.bn(self.fc(x)).tanh()

    def make():
        m = Flipping().to(DEVICE)
        return m, {"model": m}

    tiers = side_by_side(make, lambda i: (fresh(i, 4, 8),), 7, monkeypatch)
    # in eval, BatchNorm makes other calls (no num_batches_tracked += 1, other batch_norm
    # arguments): the call leaves the recording there, having run fc's piece before
    assert all(followed(t) for t in tiers if not t[4]) and kernels_ran(tiers), tiers
    assert sum(not t[4] for t in tiers) >= 5, tiers


def test_a_distillation_step_setting_train_and_eval_runs_kernels(monkeypatch):
    def make():
        teacher = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                nn.Linear(16, 4)).to(DEVICE)
        student = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(),
                                nn.Linear(8, 4)).to(DEVICE)
        opt = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)

        def step(x):
            teacher.eval()
            student.train()
            with torch.no_grad():
                soft = teacher(x).softmax(-1)
            opt.zero_grad()
            loss = F.kl_div(student(x).log_softmax(-1), soft, reduction="batchmean")
            loss.backward()
            opt.step()
            return loss.detach()

        return step, {"teacher": teacher, "student": student, "opt": opt}

    def between(objects, i):
        if i % 2:
            objects["teacher"].train()  # the step sets it back to eval

    tiers = side_by_side(make, lambda i: (fresh(i, 6, 8),), 6, monkeypatch, between)
    assert all(followed(t) for t in tiers[2:]) and kernels_ran(tiers), tiers


def test_a_path_recorded_after_a_read_that_changes_state_is_never_replayed(monkeypatch):
    class Toggling(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.flag = False

        def forward(self, x):
            y = self.fc(x)
            if x.sum() > 0:  # a read: the path after it is recorded when first taken
                self.flag = not self.flag
            return y.relu() * (2.0 if self.flag else 1.0)

    def make():
        m = Toggling().to(DEVICE)
        return m, {"model": m}

    signs = [-1, 1, -1, 1, 1, -1, 1, 1, -1]
    # (a replay of that path would not toggle the flag: it runs in eager PyTorch)
    tiers = side_by_side(make, lambda i: (fresh(i, 3, 4).abs() * signs[i],), len(signs),
                         monkeypatch, warns="fxlite.compile: a path of Toggling runs in eager "
                         "PyTorch: it changes Python state that it reads (a module attribute, "
                         "flag or parameter)")
    assert tiers[-1][0] == "replayed" and tiers[-1][1] > 0 and not tiers[-1][2], tiers
