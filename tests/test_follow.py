"""Following (codegen/follow.py): a function whose Python has effects runs that Python on
every call, and its torch calls are served by fused kernels.

Every test runs the compiled function beside a plain copy from equal fresh state, several
calls with fresh inputs, and compares results and Python side effects on every call.
"""

from __future__ import annotations

from test_compile_contract import DEVICE  # isort: skip
from test_compile_contract import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import contextlib
import io
import random
import warnings

import pytest
import torch

pytest.importorskip("triton")

import fxlite

CALLS = 4


def twice(make, inputs, calls=CALLS):
    """Run ``make()``'s function eagerly and compiled; each returns (results, its log)."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        random.seed(0)
        fn, log = make()
        f = fxlite.compile(fn) if compiled else fn
        out = io.StringIO()
        results = []
        with warnings.catch_warnings(record=True) as said, contextlib.redirect_stdout(out):
            warnings.simplefilter("always")
            for i in range(calls):
                results.append(f(*inputs(i)))
        runs.append((results, list(log), out.getvalue(), f,
                     [str(w.message) for w in said if str(w.message).startswith("fxlite")]))
    (r0, log0, out0, _, _), (r1, log1, out1, f, said) = runs
    torch.testing.assert_close(r1, r0)
    torch.testing.assert_close(log1, log0)
    assert out1 == out0
    return f, said


def block():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8),
                               torch.nn.Linear(8, 4)).to(DEVICE)


def fresh(i):
    return (torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).to(DEVICE),)


def test_prints_and_appends_happen_every_call_and_kernels_run():
    def make():
        m, log = block(), []

        def fn(x):
            log.append(x.shape[0])
            h = m(x)
            print("norm", round(h.norm().item(), 3))
            return torch.softmax(h * 2, -1)

        return fn, log

    f, said = twice(make, fresh)
    assert f.kernels and not f.fallbacks and not said


def test_a_python_value_that_reaches_a_torch_call_ends_the_match_and_then_runs_eagerly():
    def make():
        def fn(x):
            return torch.relu(x) * random.random()

        return fn, []

    f, said = twice(make, fresh, calls=6)
    assert len(said) == 1 and "differ from its recorded ones" in said[0]


def test_a_training_step_that_logs_its_loss_keeps_its_kernels():
    def make():
        m, log = block(), []
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

        def step(x):
            loss = m(x).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            log.append(round(loss.item(), 4))
            return loss.detach()

        return step, log

    f, said = twice(make, fresh, calls=5)
    assert f.kernels and not said


def test_an_intermediate_kept_in_python_state_is_a_real_tensor():
    def make():
        m, kept = block(), []

        def fn(x):
            h = torch.tanh(m(x))
            kept.append(h)
            return h.sum(-1)

        return fn, kept

    twice(make, fresh)


def test_an_exception_inside_a_followed_function_reaches_its_except():
    def make():
        log = []

        def fn(x, y):
            log.append(1)
            try:
                return torch.relu(x + y)
            except RuntimeError:
                return x * 0

        return fn, log

    sizes = [4, 4, 3, 4]
    f, said = twice(make, lambda i: (torch.ones(4, device=DEVICE),
                                     torch.ones(sizes[i], device=DEVICE)))


def test_a_generator_argument_and_a_returned_iterator_follow_eager():
    def make():
        g = torch.Generator(DEVICE).manual_seed(1)
        log = []

        def fn(x):
            log.append(1)
            return x + torch.rand(x.shape, generator=g, device=x.device)

        return fn, log

    twice(make, fresh)

    def returns_iter():
        def fn(x):
            return iter([torch.relu(x), x * 2])

        return fn, []

    runs = []
    for compiled in (False, True):
        fn, _ = returns_iter()
        f = fxlite.compile(fn) if compiled else fn
        runs.append([list(f(*fresh(i))) for i in range(CALLS)])
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a)


def test_printing_a_tensor_is_followed_and_prints_every_calls_values():
    def make():
        m = block()

        def fn(x):
            h = torch.tanh(m(x))
            print("h:", h.detach().sum())  # formats a tensor: its values, each call
            return h * 2

        return fn, []

    f, said = twice(make, fresh)
    assert f.tier.startswith("followed: it formats a tensor as text") and not said


def test_the_tier_of_a_call_and_explain_say_which_way_it_runs_and_why():
    log = []

    def replayed(x):
        return torch.relu(x) * 2

    def followed(x):
        log.append(1)
        return torch.relu(x) * 2

    x = fresh(0)[0]
    for fn, tier in ((replayed, "replayed"), (followed, "followed")):
        f = fxlite.compile(fn)
        for _ in range(3):
            f(x)
        assert f.tier.split(":")[0] == tier
        report = fxlite.explain(fn)(x)
        assert report.tier == tier and tier in str(report)
    assert "changes the list log" in f.tier and "changes the list log" in report.effect
