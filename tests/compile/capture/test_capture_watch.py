"""The recording watcher (codegen/capture/watch.py): a recording whose Python did more than
compute tensors is not replayed, so every later call does what eager Python does.

Each test runs the compiled function and a plain copy side by side, several calls with
fresh inputs and Python state changed between calls, and compares results and side
effects on every call. Programs the watcher clears must still run kernels.
"""

from __future__ import annotations

from test_compile_contract import DEVICE  # isort: skip
from test_compile_contract import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import contextlib
import io
import itertools
import logging
import random
import time
import types
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from fxlite.codegen.capture.watch import Watch, contents_key, is_stateful

import fxlite

CALLS = 4


def side_by_side(make, change=None, inputs=lambda i: (torch.randn(4, 4, device=DEVICE),)):
    """Run ``make()``'s function eagerly and compiled, from equal fresh state, ``CALLS``
    times each; returns (eager results, compiled results, compiled function, warnings)."""
    runs = []
    for compiled in (False, True):
        random.seed(0)
        torch.manual_seed(0)
        fn, state = make()
        f = fxlite.compile(fn) if compiled else fn
        out = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(CALLS):
                if change is not None:
                    change(state, i)
                torch.manual_seed(100 + i)
                out.append((f(*inputs(i)), state.get("log") and list(state["log"])))
        runs.append((out, f, [str(w.message) for w in caught
                              if str(w.message).startswith("fxlite")]))
    (eager, _, _), (mine, f, said) = runs
    for (a, log_a), (b, log_b) in zip(eager, mine):
        torch.testing.assert_close(b, a)
        assert log_a == log_b
    return f, said


def test_a_list_append_happens_on_every_call():
    def make():
        log = []

        def fn(x):
            log.append(float(x.shape[0]))
            return torch.relu(x) * 2

        return fn, {"log": log}

    f, said = side_by_side(make)
    assert not said and f.kernels  # its Python runs every call, its ops as kernels
    with Watch(make()[0]) as watch:
        make()[0](torch.ones(2))
    assert watch.effect is None  # the list is not named before the call: seen after it

    def make_named():
        fn, state = make()
        log = state["log"]
        watch = Watch(fn)
        with watch:
            fn(torch.ones(2))
        return watch, log

    watch, log = make_named()
    what = watch.changed()
    assert "changes the list log that outlives the call" in what
    assert "def fn(x):" in what  # the user's function


def test_a_counter_bumped_by_a_helper_counts_every_call():
    def make():
        counts = {"n": 0}

        def bump():
            counts["n"] += 1

        def fn(x):
            bump()
            return x + 1

        return fn, {"log": counts.values()}

    side_by_side(make)


@pytest.mark.parametrize("source", ["random", "time", "itertools", "numpy"])
def test_a_python_value_that_changes_by_itself_is_read_every_call(source):
    np = pytest.importorskip("numpy")

    def make():
        clock = itertools.count(1.0)
        counter = itertools.count()
        np.random.seed(0)
        read = {"random": random.random, "itertools": lambda: next(counter),
                "numpy": lambda: float(np.random.rand()),
                "time": lambda: time.time() * 0 + next(clock)}[source]

        def fn(x):
            return x * read()

        return fn, {}

    f, said = side_by_side(make)
    # followed: the Python runs every call, and the number it reads each time is a
    # varying input of the compiled piece (codegen/capture/follow.py), so kernels serve it
    assert not any("runs in eager PyTorch" in s for s in said), said
    assert f.kernels and f.tier.startswith("followed")


def test_print_logging_and_warnings_happen_on_every_call():
    out = io.StringIO()
    records = []
    logger = logging.getLogger("fxlite-test-watch")
    logger.addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r)})())
    logger.setLevel(logging.INFO)

    for body in (lambda: print("step"), lambda: logger.info("step"),
                 lambda: warnings.warn("user warning", stacklevel=1)):
        def make(body=body):
            def fn(x):
                body()
                return x + 1

            return fn, {}

        with contextlib.redirect_stdout(out):
            side_by_side(make)
    assert out.getvalue().count("step") == 2 * CALLS
    assert len(records) == 2 * CALLS


def test_a_helpers_global_and_a_config_object_are_guarded_and_still_compile():
    cfg = types.SimpleNamespace(scale=1.0)
    flags = {"shift": 0.0}
    glob = globals()
    glob["_WATCH_SCALE"] = 1.0

    def helper():
        return _WATCH_SCALE  # noqa: F821  (set above)

    def make():
        def fn(x):
            return x * helper() * cfg.scale + flags["shift"]

        return fn, {}

    def change(state, i):
        glob["_WATCH_SCALE"] = float(1 + i // 2)
        cfg.scale = float(1 + i % 2)
        flags["shift"] = float(i)

    f, said = side_by_side(make, change)
    assert f.kernels and not said


def test_a_mutable_default_that_grows_runs_every_call():
    def make():
        def fn(x, acc=[]):  # noqa: B006  (the point of the test)
            acc.append(1)
            return x * len(acc)

        return fn, {}

    side_by_side(make)


def test_a_returned_generator_is_fresh_on_every_call():
    def make():
        def fn(x):
            return (t for t in (x + 1, x * 2))

        return fn, {}

    runs = []
    for compiled in (False, True):
        fn, _ = make()
        f = fxlite.compile(fn) if compiled else fn
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs.append([list(f(torch.full((2,), float(i)))) for i in range(CALLS)])
    for a, b in zip(*runs):
        assert len(a) == len(b) == 2
        torch.testing.assert_close(b, a)


def test_a_generator_argument_is_drawn_from_as_eager_does():
    def make():
        g = torch.Generator(DEVICE).manual_seed(3)

        def fn(x):
            return x + torch.rand(x.shape, generator=g, device=x.device)

        return fn, {}

    side_by_side(make)


def test_an_exception_reaches_the_users_except_on_a_later_call():
    def make():
        def fn(x, y):
            try:
                return x + y
            except RuntimeError:
                return x * 0

        return fn, {}

    sizes = [4, 4, 3, 4]
    f, said = side_by_side(
        make, inputs=lambda i: (torch.ones(4, device=DEVICE),
                                torch.ones(sizes[i], device=DEVICE)))
    assert not said


class _Scale:  # an object of the user's class: its attributes are read each call
    def __init__(self, value):
        self.value = value


def test_a_closure_value_changing_kind_between_calls_is_seen_each_time():
    # The guard keys a value the way its type is keyed, decided once a type: a closure
    # cell rebound from a float to a list, to an object of the user's class, to a Logger,
    # is read right on each call, and so is a change inside each (the list's item, the
    # object's attribute, the Logger's level).
    logger = logging.getLogger("fxlite.test.kinds")
    logger.setLevel(10)
    v: Any = 2.0

    def fn(x):
        if isinstance(v, float):
            return x * v
        if isinstance(v, list):
            return x * v[0]
        if isinstance(v, logging.Logger):
            return x * v.level
        return x * v.value

    def inside():
        if isinstance(v, list):
            v[0] += 1.0
        elif isinstance(v, logging.Logger):
            v.setLevel(v.level + 10)
        else:
            v.value += 1.0

    f = fxlite.compile(fn)
    for value in (2.0, 3.0, [4.0], None, _Scale(5.0), None, logger, None):
        if value is None:
            inside()
        else:
            v = value
        for _ in range(2):
            x = torch.randn(4, device=DEVICE)
            torch.testing.assert_close(f(x), fn(x))


def test_a_replay_failing_inside_fxlite_warns_once_and_gives_eagers_result(monkeypatch):
    # Session 45 (noticed): a replay that raised from fxlite's own code (a TypeError in a
    # runner), on a pure segment, ran every call in eager with no word. Each such call
    # still gives eager's result; the first one now says so, with the exception.
    f = fxlite.compile(lambda x: torch.relu(x) * 2)
    for _ in range(3):
        f(torch.randn(4, device=DEVICE))
    seg = f._last[0]

    def broken(*args):
        raise TypeError("'NoneType' object is not callable")

    monkeypatch.setattr(seg, "run", broken)
    if f._fast is not None:
        f._fast.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(4, device=DEVICE)
            torch.testing.assert_close(f(x), torch.relu(x) * 2)
    said = [str(w.message) for w in caught if "fxlite" in str(w.message)]
    assert len(said) == 1 and "TypeError: 'NoneType' object is not callable" in said[0] \
        and "fxlite bug" in said[0], said
    assert caught[0].filename == __file__  # the user's line


def test_a_shape_error_propagates_as_eagers():
    f = fxlite.compile(lambda x, y: x + y)
    f(torch.ones(4), torch.ones(4))
    f(torch.ones(4), torch.ones(4))
    with pytest.raises(RuntimeError, match="must match the size"):
        f(torch.ones(4), torch.ones(3))


def test_a_training_step_that_clips_gradients_compiles_with_kernels():
    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1)).to(DEVICE)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def step(x):
            loss = m(x).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step, {"log": [m, opt]}

    runs = []
    for compiled in (False, True):
        step, state = make()
        f = fxlite.compile(step) if compiled else step
        losses = [f(torch.randn(8, 4, generator=torch.Generator().manual_seed(i)).to(DEVICE))
                  for i in range(5)]
        m, opt = state["log"]
        runs.append((losses, [p.detach().clone() for p in m.parameters()],
                     [p.grad for p in m.parameters()], f))
    (l0, p0, g0, _), (l1, p1, g1, f) = runs
    torch.testing.assert_close(l1, l0)
    torch.testing.assert_close(p1, p0)
    assert g0 == g1 == [None] * 4
    assert f.kernels and not f.fallbacks


def test_python_between_tensor_ops_in_torch_itself_is_trusted():
    # nn.Module's own bookkeeping, contextlib, torch's logging checks: not the user's
    with Watch() as watch:
        m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        with torch.no_grad():
            m(torch.ones(1, 2))
    assert watch.effect is None


def test_contents_keys_see_changes_inside_containers_and_objects():
    cfg = types.SimpleNamespace(a=1, b=[1, 2])
    before = contents_key(cfg)
    cfg.b.append(3)
    assert contents_key(cfg) != before
    assert contents_key({"x": float("nan")}) == contents_key({"x": float("nan")})
    assert is_stateful([]) and is_stateful(cfg)
    assert not is_stateful(torch.ones(1)) and not is_stateful(torch.nn.Linear(1, 1))


def test_a_sets_key_sees_an_item_added_removed_or_swapped():
    # A set is keyed by a copy of its items (hashable, compared in C): 12 us a call for
    # transformers' set of output classes, against 3 for the copy.
    class A:
        pass

    class B:
        pass

    s = {A, "x", 1}
    before = contents_key(s)
    assert contents_key(s) == before and contents_key({1, "x", A}) == before
    s.add(B)
    assert contents_key(s) != before
    s.discard(B)
    assert contents_key(s) == before
    s.discard(A)
    s.add(B)  # same size, another item
    assert contents_key(s) != before


class _Marked(torch.Tensor):
    """A subclass whose ops keep the class (``__torch_function__``'s default)."""


def _two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.ones(3), torch.ones(3) * 2)


@pytest.mark.parametrize("make", [lambda: torch.eye(3).to_sparse(),
                                  lambda: torch.eye(3).to_sparse_csr(),
                                  lambda: torch.nested.nested_tensor([torch.ones(2),
                                                                      torch.ones(3)]),
                                  lambda: torch.arange(3.0).as_subclass(_Marked),
                                  _two_tensor],
                         ids=["sparse_coo", "sparse_csr", "nested", "subclass",
                              "dispatch_subclass"])
@pytest.mark.parametrize("plain_first", [False, True])
def test_sparse_nested_and_subclass_inputs_run_eagerly_with_one_warning(make, plain_first):
    """Before: a tensor subclass was recorded as a plain tensor, and replays returned plain
    tensors where eager returns the subclass (also after a plain call was recorded)."""
    def fn(x):
        return x * 2

    f = fxlite.compile(fn)
    if plain_first:
        for _ in range(2):
            f(torch.arange(3.0))  # recorded, and then replayed on the fast path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [f(make()) for _ in range(3)]
    said = [str(w.message) for w in caught if str(w.message).startswith("fxlite")]
    assert len(said) == 1 and "which fxlite does not compile" in said[0]
    for out in outs:
        expected = fn(make())
        assert type(out) is type(expected)
        if out.is_nested:
            torch.testing.assert_close(list(out.unbind()), list(expected.unbind()))
        else:
            torch.testing.assert_close(out.to_dense(), expected.to_dense())


_COLLECTIONS = 0


def _count_collections(phase, info):
    global _COLLECTIONS
    _COLLECTIONS += 1  # a global assigned by a GC callback (hypothesis installs one)


def test_a_garbage_collector_callback_during_the_recording_is_not_the_functions():
    import gc

    def fn(x):
        gc.collect()  # a collection runs the callback inside the recorded call
        return torch.relu(x) * 2

    gc.callbacks.append(_count_collections)
    try:
        with Watch(fn) as watch:
            fn(torch.ones(2))
    finally:
        gc.callbacks.remove(_count_collections)
    assert _COLLECTIONS and watch.effect is None


def test_a_compiled_call_frees_what_eager_frees():
    # The watcher held every generator frame of the call to its end: the genexpr of an
    # `all(...)` that stopped early (transformers' ModelOutput.__post_init__) kept its
    # `self`, an output object, and its logits alive through the backward (0.38 GiB in
    # a GPT-2 step), where eager had freed them.
    import weakref

    seen: list[weakref.ref] = []

    class Output:
        def __init__(self, loss, logits):
            self.loss, self.logits = loss, logits
            if all(getattr(self, k) is None for k in ("loss", "logits")):  # (stops early)
                raise ValueError("an empty output")

    lin = torch.nn.Linear(8, 16).to(DEVICE)

    def logits_alive():
        return seen[-1]() is not None

    def forward(x):
        logits = lin(x).to(torch.bfloat16)  # what the loss keeps is a float32 copy
        seen.append(weakref.ref(logits))
        return Output(logits.float().logsumexp(-1).mean(), logits)

    def step(x):
        loss = forward(x).loss
        alive = logits_alive()
        loss.backward()
        return loss.detach(), alive

    compiled = fxlite.compile(step)
    x = torch.randn(4, 8, device=DEVICE)
    assert step(x)[1] is False  # eager frees them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert compiled(x)[1] is False  # and so does the recording call
        for _ in range(2):  # and a followed call, which held every value it met
            assert compiled(x)[1] is False
        assert compiled.tier.startswith("followed"), compiled.tier


class _Augment:
    def __init__(self):
        import numpy as np

        self.rng = np.random.default_rng(0)

    def __call__(self, x):
        return x * float(self.rng.random())


@pytest.mark.parametrize("where", ["closure", "object", "module", "legacy"])
def test_draws_from_a_numpy_generator_are_not_frozen(where):
    # A numpy Generator's draws are Cython, unseen by the profile hook: the recording
    # was replayed, and every later call reused the first call's rows and numbers.
    import numpy as np

    def make():
        if where == "closure":
            rng = np.random.default_rng(0)
            return lambda x: x[torch.as_tensor(rng.choice(x.shape[0], 2, replace=False))] * 2
        if where == "object":
            aug = _Augment()
            return lambda x: aug(x) + 1
        if where == "module":
            module = torch.nn.Module()
            module.rng = np.random.default_rng(0)
            return lambda x: x * float(module.rng.random())
        legacy = np.random.RandomState(0)
        return lambda x: x * float(legacy.rand())

    fn, eager = make(), make()
    compiled = fxlite.compile(fn)
    x = torch.randn(6, 4, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(CALLS):
            torch.testing.assert_close(compiled(x), eager(x))
    assert compiled.tier.startswith("followed"), compiled.tier


def test_a_function_compiled_under_cprofile_runs_and_the_profiler_goes_on():
    """Before: the watch saved the profile hook it replaced and set it back, but under
    cProfile ``sys.getprofile()`` gives the profiler's object, not a function, and setting
    it made Python call it on every event: the first call crashed with "'Profile' object
    is not callable" (`bench_models.py --profile` hit it). The profiler is enabled again,
    keeping its statistics."""
    import cProfile
    import pstats
    import sys

    def step(x):
        return torch.relu(x) * 2

    compiled = fxlite.compile(step)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for _ in range(3):
            x = torch.randn(5, device=DEVICE)
            torch.testing.assert_close(compiled(x), step(x))
        assert sys.getprofile() is profiler  # still profiling, after the recording too
    finally:
        profiler.disable()
    names = {func for (_, _, func) in pstats.Stats(profiler).stats}  # type: ignore[attr-defined]
    assert "step" in names


def test_user_class_answers_the_same_from_its_cache_and_for_unhashable_classes():
    from fxlite.codegen.capture.watch import user_class

    class Mine:
        pass

    class Unhashable(type):
        __hash__ = None  # type: ignore[assignment]

        def __eq__(cls, other):
            return cls is other

    Odd = Unhashable("Odd", (), {})
    assert [user_class(Mine) for _ in range(2)] == [True, True]
    assert [user_class(int) for _ in range(2)] == [False, False]
    assert [user_class(torch.nn.Linear) for _ in range(2)] == [False, False]
    assert user_class(Odd)  # a TypeError from the cache's lookup: answered without it
