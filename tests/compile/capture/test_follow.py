"""Following (codegen/capture/follow.py): a function whose Python has effects runs that Python on
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
        def fn(x):  # (an exponent: a number passed as a value varies, test_follow_scalars)
            return torch.relu(x) ** random.random()

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


# ---------------------------------------------------------------- the cheap followed path
# A function with no replayed recording is followed without computing its state key; the
# hooks install from one prepared patch; the follower compares each call with a per-step
# key; a piece reads the parameters it uses itself. Each must follow eager as before.

def side_by_side(make, inputs, between=lambda i, state: None, calls=CALLS, grads=False):
    """Like ``twice``, with ``between(i, state)`` run before call ``i`` (``make`` returns
    ``(fn, log, state)``): state changed from outside between calls. With ``grads``, each
    result's gradient with respect to the input is compared too."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        fn, log, state = make()
        f = fxlite.compile(fn) if compiled else fn
        results = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(calls):
                between(i, state)
                args = inputs(i)
                if grads:
                    args = tuple(a.clone().requires_grad_() for a in args)
                out = f(*args)
                results.append(out.detach() if isinstance(out, torch.Tensor) else out)
                if grads:
                    out.sum().backward()
                    results += [a.grad for a in args]
        runs.append((results, list(log), f))
    (r0, log0, _), (r1, log1, f) = runs
    torch.testing.assert_close(r1, r0)
    assert log1 == log0
    return f


def test_module_state_changed_between_followed_calls_is_seen():
    def make():
        m, log = block(), []

        def fn(x):
            log.append(1)
            return torch.relu(m(x)) * 2

        return fn, log, m

    def between(i, m):  # (pieces compile on call 1, the first followed call)
        with torch.no_grad():
            if i == 2:
                m[0].weight.mul_(0.5)  # in place: the piece reads the parameter itself
            if i == 3:
                m[3].bias.data = torch.randn(4, device=DEVICE)  # the same object, new data
            if i == 4:
                m.eval()
            if i == 5:
                m[3].weight = torch.nn.Parameter(torch.randn(4, 8, device=DEVICE))

    side_by_side(make, fresh, between, calls=7)


def test_a_parameter_given_another_shape_between_followed_calls():
    def make():
        m, log = torch.nn.Linear(4, 3).to(DEVICE), []

        def fn(x):
            log.append(1)
            return torch.tanh(m(x)) + 1

        return fn, log, m

    def between(i, m):
        if i == 2:
            m.weight.data = torch.randn(5, 4, device=DEVICE)
            m.bias.data = torch.randn(5, device=DEVICE)

    side_by_side(make, fresh, between)


class _Triple(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2  # its backward is not the derivative: which one ran shows

    @staticmethod
    def backward(ctx, g):
        return g * 3


def test_an_autograd_function_or_cond_a_recording_did_not_call_still_follows_eager():
    def make(kind):
        def make_():
            log, calls = [], [0]

            def fn(x):
                log.append(1)
                calls[0] += 1
                if calls[0] >= 3 and kind == "function":
                    h = _Triple.apply(x)
                elif calls[0] >= 3:
                    h = torch.cond(x.sum() > 0, lambda a: a * 2, lambda a: a - 1, (x,))
                else:
                    h = x * 2
                return torch.sin(h) * 2

            return fn, log, None
        return make_

    side_by_side(make("function"), fresh, calls=5, grads=True)
    side_by_side(make("cond"), fresh, calls=5)


def test_numbers_and_keywords_that_change_between_followed_calls():
    def make(scalars, modes):
        def make_():
            log, i = [], [-1]

            def fn(x):
                log.append(1)
                i[0] += 1
                whole = (x * 10).long() * scalars[i[0]]  # 1 keeps it an integer, 1.0 not
                whole = torch.nan_to_num(whole, nan=0.5)
                h = torch.nn.functional.gelu(x, approximate=modes[i[0]])
                return whole, torch.nan_to_num(h * scalars[i[0]], nan=0.5)

            return fn, log, None
        return make_

    # recorded with 1.0: 1 and True are other calls (each ends its call's match), and a
    # matching call between them resets the count of calls that left the recording
    side_by_side(make([1.0, 1.0, 1, 1.0, True, 1.0, 2.0],
                      ["tanh", "tanh", "tanh", "none", "tanh", "tanh", "tanh"]), fresh, calls=7)
    side_by_side(make([float("nan")] * 4, ["none"] * 4), fresh)  # NaN matches NaN


def test_a_data_dependent_size_and_a_branch_inside_a_piece_follow_eager():
    def make():
        log = []

        def fn(x):
            log.append(1)
            h = torch.relu(x)
            n = torch.nonzero(h).shape[0]  # a size read of a data-dependent shape
            if len(log) % 2:  # Python state picks which ops follow, mid-piece
                return (h * 2 + 1) * n
            return (h - 3) * n

        return fn, log, None

    side_by_side(make, fresh, calls=6)


def test_a_grad_mode_python_picks_at_call_time_is_followed():
    """Python state turns gradients off mid-function on some calls: the pieces were
    compiled where the recording had them on, so a step whose grad mode differs from its
    recorded one ends the match (the follower ran a piece under the wrong mode before)."""
    def make():
        log = []
        w = torch.randn(4, 4, device=DEVICE, requires_grad=True)

        def fn(x):
            log.append(1)
            a = x @ w
            if len(log) in (3, 4, 6):
                torch.set_grad_enabled(False)
            b = a.relu() * 2 + 1
            torch.set_grad_enabled(True)
            return b.requires_grad, b.sum()

        return fn, log, None

    side_by_side(make, fresh, calls=7)
