"""Followed plans that keep matching (codegen/capture/follow.py, compile.py's ``_follow``): a call
that runs for real passed other numbers than the recorded ones goes on matching (its
result keeping the recorded layout), loose constants passed anew are bound at their first
use in the call that finds them, and a plan whose calls changed for good is recorded again
instead of running in eager PyTorch for good.

Every test runs the compiled function beside a plain copy from equal fresh state, several
calls with fresh inputs, and compares results and state (tensors, gradients, optimizer
state, Python logs) after every call.
"""

from __future__ import annotations

from test_compile_contract import DEVICE  # isort: skip
from test_compile_contract import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import itertools
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from fxlite.codegen.capture.follow import Follow

import fxlite


def side_by_side(make: Callable[[], tuple[Callable[..., Any], Callable[[int], tuple], Any]],
                 calls: int = 6) -> tuple[Any, list[str], list[Any]]:
    """Run ``make()``'s function eagerly and compiled. ``make`` returns the function, the
    arguments of call ``i`` and the state to compare (anything ``assert_close`` takes,
    read after each call). Returns the compiled function, its fxlite warnings, and the
    followed plan each compiled call ran (None where it ran none)."""
    runs = []
    plans: list[Any] = []
    for compiled in (False, True):
        torch.manual_seed(0)
        random.seed(0)
        fn, inputs, state = make()
        f = fxlite.compile(fn) if compiled else fn
        results, states = [], []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for i in range(calls):
                out = f(*inputs(i))
                results.append(out)
                states.append(_snapshot(state()))
                if compiled:
                    plans.append(_plan(f))
        runs.append((results, states, f, [str(w.message) for w in said
                                          if str(w.message).startswith("fxlite")]))
    (r0, s0, _, _), (r1, s1, f, said) = runs
    for i, (a, b) in enumerate(zip(r0, r1)):
        torch.testing.assert_close(b, a, msg=lambda m, i=i: f"call {i}: {m}")
        if isinstance(a, torch.Tensor):
            assert b.requires_grad == a.requires_grad and b.dtype == a.dtype
    for i, (a, b) in enumerate(zip(s0, s1)):
        torch.testing.assert_close(b, a, msg=lambda m, i=i: f"state after call {i}: {m}")
    return f, said, plans


def _snapshot(v: Any) -> Any:
    """A copy of ``v`` (tensors detached and cloned, optimizer states as dicts)."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, torch.optim.Optimizer):
        return _snapshot([s for s in v.state.values()])
    if isinstance(v, torch.nn.Module):
        return _snapshot([*v.state_dict().values(), *(p.grad for p in v.parameters())])
    if isinstance(v, dict):
        return {k: _snapshot(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_snapshot(x) for x in v]
    return v


def _plan(f: Any) -> Follow | None:
    return next((p for p in f._followed.values() if getattr(p, "pieces", None) is f._last),
                None)


def fresh(i: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape or (4, 8), generator=torch.Generator().manual_seed(i)).to(DEVICE)


# ---------------------------------------------------------------- numbers of real calls
def test_adam_steps_whose_numbers_change_every_step_keep_matching():
    """Adam's per-tensor ``addcdiv_(..., value=-lr / bias_correction)`` runs for real, with
    another value on every step: the steps go on matching, and kernels serve them."""
    class Trainer:  # (its optimizer's step is followed call by call, not whole)
        def __init__(self) -> None:
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                             torch.nn.Linear(16, 4)).to(DEVICE)
            self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2, foreach=False)
            self.losses: list[float] = []

        def step(self, x, y):
            self.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.losses.append(round(loss.item(), 4))
            return loss.detach()

    def make():
        t = Trainer()
        return t.step, lambda i: (fresh(i), fresh(i + 100, 4, 4)), \
            lambda: (t.model, t.opt, t.losses)

    f, said, plans = side_by_side(make, calls=7)
    assert f.kernels and not f.fallbacks and not said
    plan = plans[-1]
    assert plan is not None and plan.completed >= 3 and plan.diverged == 0


def test_a_write_with_a_new_number_each_call_keeps_matching():
    def make():
        state = torch.zeros(8, device=DEVICE)  # (a plain tensor the function writes)
        log: list[int] = []

        def fn(x):
            log.append(len(x))
            h = torch.relu(x) * 2
            state.add_(h.sum(0), alpha=1.0 / len(log))  # for real, another alpha each call
            return torch.tanh(h + state)

        return fn, lambda i: (fresh(i),), lambda: (state, log)

    f, said, plans = side_by_side(make, calls=6)
    assert f.kernels and not f.fallbacks and not said
    assert plans[-1] is not None and plans[-1].completed >= 3 and plans[-1].diverged == 0


def test_a_view_at_another_offset_feeds_the_pieces_after_it():
    """``x.narrow(1, start, 4)`` with another start: the same layout, other values,
    which the piece after it reads as the real view it is."""
    def make():
        log: list[int] = []

        def fn(x):
            log.append(1)
            start = len(log) % 4
            h = torch.relu(x * 3).narrow(1, start, 4)
            return torch.sigmoid(h * 2 + 1)

        return fn, lambda i: (fresh(i),), lambda: log

    f, said, plans = side_by_side(make, calls=6)
    assert f.kernels and not f.fallbacks and not said
    assert plans[-1] is not None and plans[-1].diverged == 0


def test_a_number_that_changes_a_real_calls_layout_leaves_the_match():
    """``h.narrow(1, s, n)``: another ``s`` keeps the recorded layout and goes on matching;
    another ``n`` gives another layout (the pieces after it were made for the recorded
    one), so that call leaves the match there, the view having run, and runs on eagerly."""
    def make():
        log: list[int] = []

        def fn(x):
            log.append(1)
            s, n = len(log) % 4, 2 if len(log) % 3 == 0 else 4
            h = torch.relu(x * 2).narrow(1, s, n)
            return (h * 2).softmax(-1) + 1

        return fn, lambda i: (fresh(i),), lambda: log

    f, _, plans = side_by_side(make, calls=9)
    plan = plans[-1]  # calls 2, 4, 5, 7, 8 (another s) matched, 3, 6, 9 (another n) left
    assert plan is not None and plan.completed == 5 and not f.fallbacks


def test_a_number_that_makes_a_tensor_require_grad_leaves_the_match():
    """``w.requires_grad_(flag)`` with another flag: the result's layout (whether it
    requires grad) differs, so gradients are never computed by pieces made without (a
    guard: such a call leaves the match, as before)."""
    def make():
        w = torch.randn(8, device=DEVICE)
        log: list[int] = []

        def fn(x):
            log.append(1)
            v = w.detach().requires_grad_(len(log) >= 3)
            y = (torch.tanh(x) * v).sum()
            grad = torch.autograd.grad(y, v)[0] if v.requires_grad else torch.zeros_like(v)
            return y.detach(), grad

        return fn, lambda i: (fresh(i),), lambda: log

    side_by_side(make, calls=6)


# ---------------------------------------------------------------- recorded again
def test_a_model_unfrozen_at_step_three_is_recorded_again():
    def make():
        body, head = torch.nn.Linear(8, 8).to(DEVICE), torch.nn.Linear(8, 4).to(DEVICE)
        body.requires_grad_(False)
        opt = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
        steps = [0]

        def step(x, y):
            steps[0] += 1
            if steps[0] == 3:
                body.requires_grad_(True)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(head(body(x).relu()), y)
            loss.backward()
            opt.step()
            return loss.detach()

        return step, lambda i: (fresh(i), fresh(i + 50, 4, 4)), lambda: (body, head, steps)

    f, said, plans = side_by_side(make, calls=8)
    assert f.kernels and not f.fallbacks and not said
    assert plans[-1] is not None and plans[-1] is not plans[1] and plans[-1].diverged == 0


def test_a_model_put_in_eval_mode_for_good_is_recorded_again():
    def make():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.Dropout(0.3), torch.nn.Linear(8, 4)).to(DEVICE)
        calls = [0]

        def fn(x):
            calls[0] += 1
            if calls[0] == 4:
                model.eval()
            return model(x).softmax(-1)

        return fn, lambda i: (fresh(i),), lambda: (model, calls)

    f, said, _ = side_by_side(make, calls=9)
    assert f.kernels and not f.fallbacks and not said


def test_paths_taken_in_turn_are_not_recorded_again():
    """``next(acts)`` cycles through three activations: each call leaves the match at
    another function than the last, so no plan is recorded again (a new recording would
    serve one call in three, as the first does)."""
    def make():
        acts = itertools.cycle([torch.relu, torch.tanh, torch.sigmoid])

        def fn(x):
            return next(acts)(x * 2) * 2 + 1

        return fn, lambda i: (fresh(i),), lambda: []

    f, said, plans = side_by_side(make, calls=10)
    assert f._recordings == 1 and not said and f.kernels
    assert plans[-1] is not None and plans[-1].completed == 3


def test_a_training_step_whose_first_call_differs_is_recorded_again_at_once():
    """At the first call gradients are None and Adam has no state (``zero_grad`` reads
    each ``.grad``, later calls set it): the plan recorded then is dropped at the first
    call that leaves it at such a step, and the next call's plan serves the rest."""
    class Trainer:
        def __init__(self) -> None:
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                             torch.nn.Linear(16, 4)).to(DEVICE)
            self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2, foreach=False)

        def step(self, data):
            x, y = next(data)
            self.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            return loss.detach()

    def make():
        t = Trainer()
        it = iter([(fresh(i), fresh(i + 100, 4, 4)) for i in range(5)])
        return t.step, lambda i: (it,), lambda: (t.model, t.opt)

    f, said, plans = side_by_side(make, calls=5)
    assert f.kernels and not f.fallbacks and not said
    assert plans[-1] is not None and plans[-1].completed == 2


def test_calls_that_differ_every_time_are_recorded_a_bounded_number_of_times():
    """A function whose torch calls change on every call (a random branch, a number drawn
    anew as an exponent) records at most ``recompile_limit`` times, then runs in eager
    (a guard on recording again)."""
    def make():
        log: list[int] = []

        def fn(x):
            log.append(1)
            r = random.random()
            h = torch.relu(x) ** r if r < 0.5 else torch.tanh(x) * 2
            return h.sum(-1)

        return fn, lambda i: (fresh(i),), lambda: log

    f, said, _ = side_by_side(make, calls=40)
    assert f._recordings <= f.recompile_limit
    assert len(said) <= 1


# ---------------------------------------------------------------- loose constants
def test_batches_from_an_iterator_argument_are_bound_in_the_call_that_finds_them():
    """``x, y = next(it)`` gives tensors made outside the call, recorded as constants: the
    first call passing them anew binds each at its first use and goes on matching."""
    def make():
        gen = torch.Generator().manual_seed(3)
        batches = [(torch.randn(4, 8, generator=gen).to(DEVICE),
                    torch.randn(4, 8, generator=gen).to(DEVICE)) for _ in range(8)]
        it = iter(batches)
        log: list[int] = []

        def fn(data):
            x, y = next(data)
            log.append(1)
            return torch.relu(x) * 2 + torch.tanh(y)

        return fn, lambda i: (it,), lambda: log

    f, said, plans = side_by_side(make, calls=6)
    assert f.kernels and not f.fallbacks and not said
    plan = plans[-1]
    assert plan is not None and plan.completed == 5 and plan.diverged == 0


def test_a_constant_replaced_after_its_piece_began_is_never_stale():
    """The piece that reads ``cache["c"]`` begins before its use (``relu``): the call that
    finds it passed anew cuts the pieces again and computes ``h + c`` again."""
    def make():
        cache = {"c": torch.randn(8, device=DEVICE)}
        log: list[int] = []

        def fn(x):
            log.append(1)
            cache["c"] = cache["c"] * 0.5 + 1  # a new tensor, made before the call's use
            h = torch.relu(x)
            return (h + cache["c"]) * 2

        return fn, lambda i: (fresh(i),), lambda: (cache, log)

    f, said, plans = side_by_side(make, calls=6)
    assert f.kernels and not f.fallbacks and not said
    assert plans[-1] is not None and plans[-1].completed == 5  # (the 2nd call too)


def test_a_constant_passed_anew_with_another_layout_leaves_the_match():
    """A guard: a tensor of another layout is never bound (the pieces were made for the
    recorded one); such a call leaves the match, as before."""
    def make():
        cache = {"c": torch.randn(8, device=DEVICE)}
        log: list[int] = []

        def fn(x):
            log.append(1)
            h = torch.relu(x)
            out = (h + cache["c"]) * 2
            cache["c"] = torch.randn(len(log) % 2 + 1, 8, device=DEVICE)[0].clone()
            if len(log) % 3 == 0:
                cache["c"] = torch.randn(1, device=DEVICE)  # broadcasts: another layout
            return out

        return fn, lambda i: (fresh(i),), lambda: (cache, log)

    side_by_side(make, calls=8)


# ---------------------------------------------------------------- indices from Python
def test_rows_picked_by_a_list_shuffled_anew_keep_matching():
    """``x[order]`` (a gather, run for real) with another list each call: the piece after
    it runs on the rows this call picked."""
    def make():
        log: list[list[int]] = []

        def fn(x):
            order = list(range(x.shape[0]))
            random.shuffle(order)
            log.append(order)
            return torch.softmax(torch.tanh(x[order] * 2) + 1, -1)

        return fn, lambda i: (fresh(i),), lambda: log

    f, said, plans = side_by_side(make, calls=6)
    assert f.kernels and not f.fallbacks and not said
    assert plans[-1] is not None and plans[-1].completed == 5 and plans[-1].diverged == 0


def test_rows_picked_by_a_numpy_array_drawn_anew_keep_matching():
    np = pytest.importorskip("numpy")

    def make():
        np.random.seed(0)

        def fn(x):
            rows = np.random.choice(x.shape[0], 2, replace=False)
            return torch.softmax(torch.tanh(x[torch.as_tensor(rows, device=x.device)]) * 3, -1)

        return fn, lambda i: (fresh(i),), lambda: []

    f, said, plans = side_by_side(make, calls=6)
    assert f.kernels and not f.fallbacks and not said
    assert plans[-1] is not None and plans[-1].completed == 5 and plans[-1].diverged == 0


def test_an_index_list_of_another_length_leaves_the_match():
    """``x[rows]`` with a list of another length gives another layout: that call leaves
    the match there; one of the recorded length goes on matching."""
    def make():
        log: list[int] = []

        def fn(x):
            log.append(1)
            rows = random.sample(range(4), 3 if len(log) % 3 == 0 else 2)
            return torch.tanh(x[rows] * 2).softmax(-1)

        return fn, lambda i: (fresh(i),), lambda: log

    f, _, plans = side_by_side(make, calls=9)
    plan = plans[-1]  # (the 3rd, 6th and 9th calls left it)
    assert plan is not None and plan.completed == 5 and not f.fallbacks


def test_a_numpy_array_of_another_shape_leaves_the_match():
    np = pytest.importorskip("numpy")

    def make():
        log: list[int] = []

        def fn(x):
            log.append(1)
            rows = np.random.permutation(4)[:3 if len(log) % 3 == 0 else 2]
            return torch.tanh(x[torch.as_tensor(rows, device=x.device)] * 2).softmax(-1)

        np.random.seed(0)
        return fn, lambda i: (fresh(i),), lambda: log

    f, _, plans = side_by_side(make, calls=9)
    plan = plans[-1]  # (the 3rd, 6th and 9th calls left it)
    assert plan is not None and plan.completed == 5 and not f.fallbacks
