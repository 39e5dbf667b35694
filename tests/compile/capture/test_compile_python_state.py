"""fxlite.compile's contract where Python state is involved: a function that changes Python
state it reads (a module's counter), sets attributes of an argument, or stores tensors in
a module's objects, a global or an argument container is followed (its Python runs on
every call, its torch calls served by kernels; ``tier`` says why); one that returns objects
holding new tensors gets them rebuilt on every call. Never a stale object or result.

Split from test_compile_contract.py, whose helpers and autouse fixture it imports; as
there, every test calls the compiled function several times with fresh inputs.
"""

from __future__ import annotations

from test_compile_contract import DEVICE, rand  # isort: skip
from test_compile_contract import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import dataclasses
import functools
import logging
import os
import threading
import types
import warnings

import pytest
import torch
import torch.nn as nn

pytest.importorskip("triton")

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_python_state_changed_by_the_function_is_followed():
    # (it ran in eager PyTorch; its Python now runs on every call, served by kernels)
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * self.calls

    m = Counter()
    c = fxlite.compile(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(1, 4):
            x = rand(3)
            torch.testing.assert_close(c(x), x * i)
            assert m.calls == i
            assert c.tier.startswith("followed: it changes Python state that it reads"), c.tier
    assert len(c.kernels) > 0 and not c.fallbacks


def _followed(f, mine, eager, match):
    """Compile ``f(state, x)``; over three calls with fresh ``x`` it gives what ``f`` gives
    on a twin ``eager`` state, without a warning, its calls followed for ``match``."""
    c = fxlite.compile(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            x = rand(3)
            torch.testing.assert_close(c(mine, x), f(eager, x))
            assert c.tier.startswith(f"followed: it {match}"), c.tier


def test_a_function_whose_recording_cannot_be_replayed_says_why_in_fallbacks(monkeypatch):
    # a regression: the whole call ran eagerly with an empty `fallbacks`, so a benchmark
    # reported 0 kernels and no fallback
    from fxlite.codegen.compile import CompiledFunction

    def broken(self, *args):
        raise RuntimeError("no replay")

    monkeypatch.setattr(CompiledFunction, "_compile_path", broken)
    c = fxlite.compile(lambda x: x.sin() + 1)
    with pytest.warns(UserWarning, match="replaying its recording failed"):
        for _ in range(2):
            x = rand(3)
            torch.testing.assert_close(c(x), x.sin() + 1)
            assert len(c.fallbacks) == 1 and "RuntimeError: no replay" in c.fallbacks[0]


class _State:
    def __init__(self):
        self.h = torch.zeros(3, device=DEVICE)
        self.steps = 0


@pytest.mark.parametrize("what", ["tensor", "number"])
def test_attributes_set_on_an_argument_object_are_followed(what):
    # a regression: the replay ran the recorded tensor ops but never set state.h again,
    # so from the second call the object and the results were stale (then they ran
    # eagerly; now the Python that sets them runs on every call)
    def f(state, x):
        if what == "tensor":
            state.h = state.h + x
        else:
            state.steps += 1
        return state.h * 2 + state.steps

    mine, eager = _State(), _State()
    _followed(f, mine, eager, "changes the _State state")
    torch.testing.assert_close(mine.h, eager.h)
    assert mine.steps == eager.steps


class _Holder(nn.Module):
    """A module keeping tensors in plain Python state: an object and a list."""

    def __init__(self):
        super().__init__()
        self.state = _State()
        self.history = []

    def forward(self, x):
        self.state.h = self.state.h + x
        self.history.append(x.sum())
        return self.state.h * 2


_GLOBAL = {"h": None}


def _accumulate(x):
    _GLOBAL["h"] = x if _GLOBAL["h"] is None else _GLOBAL["h"] + x
    return _GLOBAL["h"] * 2


def test_tensors_stored_in_a_modules_objects_or_a_global_are_followed():
    # a regression: replays ran the tensor ops but never stored the new tensors, so the
    # object, the list and the global dict kept the first call's and the results drifted
    mine, eager = _Holder().to(DEVICE), _Holder().to(DEVICE)
    mine.state.h, eager.state.h = mine.state.h.to(DEVICE), eager.state.h.to(DEVICE)
    c = fxlite.compile(mine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            x = rand(3)
            torch.testing.assert_close(c(x), eager(x))
            assert c.tier.startswith("followed"), c.tier
    torch.testing.assert_close(mine.state.h, eager.state.h)
    assert len(mine.history) == len(eager.history) == 3
    _GLOBAL["h"] = None
    c = fxlite.compile(_accumulate)
    total = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            x = rand(3)
            total = x if total is None else total + x
            torch.testing.assert_close(c(x), total * 2)
            assert c.tier.startswith("followed: it changes the dict _GLOBAL"), c.tier
    torch.testing.assert_close(_GLOBAL["h"], total)


@dataclasses.dataclass
class _Carry:
    h: torch.Tensor


@pytest.mark.parametrize("kind", ["dataclass", "dict"])
def test_tensors_stored_in_an_argument_container_are_followed(kind):
    # a regression: flattened as containers, a dataclass or dict argument's new tensors
    # were never stored by the replays
    def f(carry, x):
        if kind == "dict":
            carry["h"] = carry["h"] + x
            return carry["h"] * 2
        carry.h = carry.h + x
        return carry.h * 2

    def make():
        return {"h": torch.zeros(3, device=DEVICE)} if kind == "dict" else _Carry(
            torch.zeros(3, device=DEVICE))

    mine, eager = make(), make()
    _followed(f, mine, eager, "changes the ")
    h = (lambda t: t["h"]) if kind == "dict" else (lambda t: t.h)
    torch.testing.assert_close(h(mine), h(eager))


def test_a_modules_config_object_is_guarded_and_still_compiles():
    # a config object a module holds: read on every call, changed between calls
    class Configured(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(scale=2.0)

        def forward(self, x):
            return x * self.config.scale

    m = Configured().to(DEVICE)
    c = fxlite.compile(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for scale in (2.0, 2.0, 3.0, 3.0):
            m.config.scale = scale
            x = rand(3)
            torch.testing.assert_close(c(x), x * scale)
    assert c.kernels


def test_a_counter_in_a_modules_dict_counts_every_call():
    # a Python side effect: a replay would make it on the recording call only
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = {"n": 0}

        def forward(self, x):
            self.calls["n"] += 1
            return x * 2

    m = Counted().to(DEVICE)
    c = fxlite.compile(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(1, 5):
            x = rand(3)
            torch.testing.assert_close(c(x), x * 2)
            assert m.calls["n"] == i
    assert c.tier.startswith("followed: it changes the dict")  # its Python runs each call


class _Cache:
    """Like a transformers DynamicCache: an object made inside the call, holding tensors
    (and a module, which stays shared)."""

    def __init__(self, keys, owner):
        self.layers = [{"keys": keys, "double": keys * 2}]
        self.owner = owner


def test_a_returned_object_holding_new_tensors_is_rebuilt_on_every_call():
    # a regression: the object recorded on the first call came back on every later call
    # (GPT-2's past_key_values held the first call's keys and values)
    m = nn.Linear(4, 4).to(DEVICE)

    def f(x):
        keys = m(x)
        return keys.sum(), _Cache(keys, m)

    c = fxlite.compile(f)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled, no fallback
        for _ in range(3):
            x = rand(2, 4)
            total, cache = c(x)
            torch.testing.assert_close(cache.layers[0]["keys"], m(x))
            torch.testing.assert_close(cache.layers[0]["double"], m(x) * 2)
            torch.testing.assert_close(total, m(x).sum())
            assert cache.owner is m and all(cache is not s for s in seen)
            seen.append(cache)
    assert c.kernels


class _Locked:
    def __init__(self, t):
        self.t = t
        self.lock = threading.Lock()  # deepcopy cannot copy it


def test_a_returned_object_that_cannot_be_copied_is_followed():
    # its Python makes a new one on every call, as eager does
    c = fxlite.compile(lambda x: _Locked(x * 2))
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            x = rand(4)
            out = c(x)
            torch.testing.assert_close(out.t, x * 2)
            assert all(out is not s for s in seen)
            seen.append(out)
            assert c.tier.startswith("followed: it returns a _Locked"), c.tier


def test_returned_objects_without_tensors_and_modules_still_compile():
    m = nn.Linear(3, 3).to(DEVICE)

    def f(x):
        return m(x), m, "tag", torch.float32

    c = fxlite.compile(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            x = rand(2, 3)
            out, mod, tag, dtype = c(x)
            torch.testing.assert_close(out, m(x))
            assert mod is m and tag == "tag" and dtype == torch.float32


@pytest.mark.parametrize("returns", ["none", "object", "module"])
def test_a_single_result_that_is_no_tensor_comes_back_on_later_calls(returns):
    # a regression: a lone result leaf was taken for a tensor on later calls, so a
    # function that wrote its input and returned None raised IndexError on its second
    # call, and a lone returned object came back as its first tensor
    m = nn.Linear(4, 4).to(DEVICE)

    def f(x, total):
        total.add_(torch.relu(x) * 2)
        if returns == "object":
            return _Cache(m(x), m)
        return m if returns == "module" else None

    c = fxlite.compile(f)
    x = rand(3, 4)
    total, want = torch.zeros_like(x), torch.zeros_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            got, expected = c(x, total), f(x, want)
            torch.testing.assert_close(total, want)
            if returns == "object":
                assert isinstance(got, _Cache) and got.owner is m
                torch.testing.assert_close(got.layers[0]["keys"], expected.layers[0]["keys"])
            else:
                assert got is expected


_FLAG = "ENVIRON_READ_TEST_FLAG"


@pytest.mark.parametrize("read", [
    lambda: os.environ.get(_FLAG, "0") == "1",
    lambda: os.getenv(_FLAG) == "1",
    lambda: _FLAG in os.environ,
], ids=["get", "getenv", "contains"])
def test_an_environment_variable_a_call_reads_is_guarded_and_the_call_replayed(
        monkeypatch, read):
    # transformers reads TRANSFORMERS_SDPA_FORCE_GQA in every attention call of a
    # Llama-style model with grouped heads: taken for an effect, the model was followed
    # (its Python run on every call) instead of replayed
    monkeypatch.delenv(_FLAG, raising=False)

    def f(x):
        return x * 2 if read() else x + 1

    c = fxlite.compile(f)
    for flag in (None, "1", None, "1"):
        if flag is None:
            monkeypatch.delenv(_FLAG, raising=False)
        else:
            monkeypatch.setenv(_FLAG, flag)
        for _ in range(2):
            x = rand(4)
            torch.testing.assert_close(c(x), f(x))
            assert c.tier == "replayed"


def test_a_call_that_sets_an_environment_variable_is_followed(monkeypatch):
    monkeypatch.delenv(_FLAG, raising=False)

    def f(x):
        os.environ[_FLAG] = str(int(os.environ.get(_FLAG, "0")) + 1)
        return x + 1

    c = fxlite.compile(f)
    for calls in range(1, 4):
        x = rand(4)
        torch.testing.assert_close(c(x), x + 1)
        assert os.environ[_FLAG] == str(calls)
    assert c.tier.startswith("followed")


@pytest.mark.parametrize("once", [True, False], ids=["first call alone", "every call"])
def test_a_message_logged_by_the_first_call_alone_leaves_later_calls_replayed(caplog, once):
    # transformers' logger.warning_once (an lru_cache over the message): a standalone
    # BertLayer logs on its first call only, and was followed on every call after it. A
    # function that logs on every call is followed, and logs on every call.
    log = logging.getLogger("fxlite.tests.log")
    say = functools.lru_cache(None)(log.warning) if once else log.warning

    def f(x):
        say("built standalone")
        return x + 1

    c = fxlite.compile(f)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(4):
            x = rand(4)
            torch.testing.assert_close(c(x), x + 1)
    assert [r.getMessage() for r in caplog.records if r.name == log.name] == \
        ["built standalone"] * (1 if once else 4)
    assert c.tier == "replayed" if once else c.tier.startswith("followed: it logs a message")


def test_with_one_recording_allowed_a_first_call_that_logs_is_followed():
    # recording again on the second call needs a second recording: with one, the first
    # call's plan is followed, as before, not run in eager
    say = functools.lru_cache(None)(logging.getLogger("fxlite.tests.limit").warning)

    def f(x):
        say("built standalone")
        return x + 1

    c = fxlite.compile(f, recompile_limit=1)
    for _ in range(3):
        x = rand(4)
        torch.testing.assert_close(c(x), x + 1)
    assert c.tier.startswith("followed: it logs a message"), c.tier
