"""Following with varying numbers (codegen/capture/follow.py): a Python number that a followed
function passes to a pointwise op and that changes from call to call (``x * next(it)``,
``x * random.random()``, ``x * len(cache)``) becomes an input of the piece that computes
it, so later calls run its kernels with their own number instead of leaving the match.

Every test runs the compiled function beside a plain copy from equal fresh state, several
calls with fresh inputs, and compares results (values and dtypes) on every call.
"""

from __future__ import annotations

from test_compile_contract import DEVICE  # isort: skip
from test_compile_contract import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import itertools
import random
import warnings

import pytest
import torch

pytest.importorskip("triton")

from fxlite.codegen.capture.follow import Follow

import fxlite


def count_served(monkeypatch, served: list[int]) -> None:
    """From now on, add to ``served[0]`` each time compiled pieces (no part of them in
    eager) serve a followed call's values."""
    run = Follow.run_piece

    def counted(self, piece, env):
        ok = run(self, piece, env)
        served[0] += ok and not piece.compiled.fallbacks
        return ok

    monkeypatch.setattr(Follow, "run_piece", counted)


def side_by_side(make, calls=8, dtype=torch.float32, monkeypatch=None, watch_from=4):
    """Run ``make()``'s function eagerly and compiled on fresh inputs; returns the compiled
    function, its fxlite warnings and how many times compiled pieces (no part of them in
    eager) served the calls from ``watch_from`` on (when ``monkeypatch`` is given)."""
    runs = []
    served = [0]
    for compiled in (False, True):
        random.seed(0)
        fn = make()
        f = fxlite.compile(fn) if compiled else fn
        results, errors = [], []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for i in range(calls):
                if compiled and monkeypatch is not None and i == watch_from:
                    count_served(monkeypatch, served)
                x = (torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) * 4).to(dtype)
                try:
                    results.append(f(x.to(DEVICE)))
                except (RuntimeError, ZeroDivisionError) as e:
                    errors.append((i, type(e)))
        runs.append((results, errors, f, [str(w.message) for w in said
                                          if str(w.message).startswith("fxlite")]))
    (r0, e0, _, _), (r1, e1, f, said) = runs
    assert e1 == e0
    for a, b in zip(r0, r1):
        assert b.dtype == a.dtype
        torch.testing.assert_close(b, a, equal_nan=True)
    return f, said, served[0]


def _plan(f):
    return next(p for p in f._followed.values() if getattr(p, "pieces", None) is f._last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_a_random_scale_is_a_kernel_argument(dtype, monkeypatch):
    def make():
        def fn(x):
            return torch.relu(x) * random.random() + 1

        return fn

    f, said, served = side_by_side(make, dtype=dtype, monkeypatch=monkeypatch)
    assert not said and f.tier.startswith("followed") and f.kernels and not f.fallbacks
    assert served == 4 * len(_plan(f).pieces)  # calls 4-7: each ran every piece
    assert _plan(f).diverged == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_an_integer_counter_stays_an_integer(dtype, monkeypatch):
    def make():
        c = itertools.count(1)

        def fn(x):
            k = next(c)  # int: an int tensor times k stays int, a bool one becomes int64
            return x * k + k

        return fn

    f, said, served = side_by_side(make, dtype=dtype, monkeypatch=monkeypatch)
    assert not said and f.kernels and not f.fallbacks and served == 4 * len(_plan(f).pieces)
    # an integer argument: Triton must not specialize a kernel on its value (1, 16k)
    assert any("do_not_specialize=['in" in k.source for k in f.kernels)


def test_several_numbers_of_one_call_vary_in_the_call_that_finds_them(monkeypatch):
    def make():
        it = iter(range(100))

        def fn(x):
            a, b, c = float(next(it)), next(it), next(it) % 2 == 0
            return torch.clamp(x * a + b, max=a) * c - 0.5

        return fn

    f, said, served = side_by_side(make, monkeypatch=monkeypatch, watch_from=2)
    assert not said and f.kernels and not f.fallbacks and served == 6 * len(_plan(f).pieces)
    assert len(_plan(f).scalars) == 4  # mul, add, clamp's max, the second mul


def test_a_number_whose_type_changes_ends_that_calls_match(monkeypatch):
    scales = [0.5, 1.5, 2, 2.5, True, 3.5, 4.5, 5.5, 6.5]

    def make():
        it = iter(scales)

        def fn(x):
            return (x * 10).long() * next(it)  # 2 keeps it an integer, 2.5 not

        return fn

    f, said, served = side_by_side(make, dtype=torch.float32, calls=len(scales),
                                   monkeypatch=monkeypatch, watch_from=5)
    assert not said and f.kernels and served == 4 * len(_plan(f).pieces)


def test_a_dim_an_exponent_or_a_size_that_changes_still_ends_the_match():
    for op in (lambda x, k: x.sum(k % 2), lambda x, k: x ** (k + 0.5),
               lambda x, k: x.reshape(-1, 2 ** (k % 3)) * 2):
        def make(op=op):
            c = itertools.count()

            def fn(x):
                return op(torch.relu(x), next(c))

            return fn

        f, said, _ = side_by_side(make, calls=6)
        plan = next((p for p in f._followed.values() if getattr(p, "pieces", None) is f._last),
                    None)  # (None: it went eager, having left the match on every call)
        assert plan is None and said or plan is not None and not plan.scalars


def test_an_integer_divisor_that_becomes_zero_raises_as_eager():
    divisors = [3, 2, 5, 0, 4, 0, 7]

    def make():
        it = iter(divisors)

        def fn(x):
            k = next(it)
            return (x.long() + 1) // k + x.long() % k + x.long().div(k, rounding_mode="floor")

        return fn

    side_by_side(make, calls=len(divisors))


def test_a_mutable_default_list_and_a_global_counter(monkeypatch):
    def make():
        def fn(x, cache=[]):  # noqa: B006
            cache.append(x.shape[0])
            return x.tanh() * len(cache) / (len(cache) + 0.5) + x.long() / (len(cache) - 1)

        return fn

    f, said, served = side_by_side(make, monkeypatch=monkeypatch)
    assert not said and f.kernels and not f.fallbacks and served == 4 * len(_plan(f).pieces)


def _with_numbers(fn, numbers, monkeypatch, watch_from=10):
    """Call ``fn`` eagerly and compiled on fresh tensors and ``numbers``, one a call;
    returns the compiled function, its fxlite warnings, and how many times compiled
    pieces (no part of them in eager) served calls from ``watch_from`` on."""
    f, served = fxlite.compile(fn), [0]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for i, a in enumerate(numbers):
            if i == watch_from:
                count_served(monkeypatch, served)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(DEVICE)
            want = fn(x, a)
            torch.testing.assert_close(f(x, a), want)
    return f, [str(w.message) for w in said if str(w.message).startswith("fxlite")], served[0]


def test_a_replayed_function_given_a_new_float_on_every_call_is_followed_past_the_limit(
        monkeypatch):
    def fn(x, a):
        return torch.relu(x) * a + a / 2

    numbers = [0.1 * i + 0.05 for i in range(14)]
    f, said, served = _with_numbers(fn, numbers, monkeypatch)
    # recorded 8 times (recompile_limit), replayed for those values; then one recording
    # followed with the float varying, not eager with a warning
    assert not said and f.tier.startswith("followed: it is given another float")
    assert f._recordings == 9 and served == 4 * len(_plan(f).pieces) and not f.fallbacks
    f(torch.randn(4, 8, device=DEVICE), numbers[0])
    assert f.tier == "replayed"


def test_a_followed_function_given_a_new_float_on_every_call_stays_followed(monkeypatch):
    log = []

    def fn(x, a):
        log.append(a)  # (followed from its first call)
        return torch.tanh(x) * a

    f, said, served = _with_numbers(fn, [0.25 * i for i in range(14)], monkeypatch)
    assert not said and f._recordings == 9 and served == 4 * len(_plan(f).pieces)
    assert log == [0.25 * i for i in range(14) for _ in range(2)]


def test_an_integer_argument_that_changes_on_every_call_still_ends_in_eager(monkeypatch):
    def fn(x, k):  # an int may pick a dim, a size or a path: each value is recorded
        return torch.relu(x) * k

    f, said, _ = _with_numbers(fn, list(range(10)), monkeypatch)
    assert len(said) == 1 and "recompile_limit" in said[0]


def test_a_second_number_of_one_call_that_starts_changing_later(monkeypatch):
    def make():
        it = itertools.count()

        def fn(x):
            k = next(it)
            lo = -1.0 if k < 3 else -1.0 - k  # changes from call 3 on
            return torch.clamp(x * (k + 0.5), lo, 2.0 + k)

        return fn

    f, said, served = side_by_side(make, monkeypatch=monkeypatch, watch_from=4)
    assert not said and f.kernels and served == 4 * len(_plan(f).pieces)
    assert _plan(f).diverged == 0


def test_a_number_that_starts_varying_on_a_call_of_other_sizes_leaves_the_match_there():
    """Before: the call that found the varying number cut the pieces again and compiled
    them on its own tensors, of other sizes than the recording's, whose graph holds sizes
    (a layer_norm's normalized_shape): the compile failed and was reported as a fallback
    (fuzz seed 1001). The piece is now made only on the recording's sizes."""
    import torch.nn.functional as F

    log = []

    def fn(x):
        log.append(x.shape[0])  # followed: an effect on every call
        v = x.sigmoid() * float(x.amax())
        return F.layer_norm(v, v.shape[-1:]) + 1

    compiled = fxlite.compile(fn)
    sizes = [3, 5, 3, 3, 5, 3]  # the second call is the first with another number
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for k, n in enumerate(sizes):
            x = torch.randn(n, n, generator=torch.Generator().manual_seed(k)).to(DEVICE)
            torch.testing.assert_close(compiled(x), fn(x))
    assert log == [n for n in sizes for _ in range(2)]  # (eager and compiled each call)
    assert not [str(w.message) for w in said if "failed" in str(w.message)]
    assert not compiled.fallbacks  # the last call, of the recorded sizes, ran its pieces
