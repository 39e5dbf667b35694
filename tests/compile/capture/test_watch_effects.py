"""Python effects the recording watcher must see, so that later calls do them again.

Each test calls the compiled function several times and compares its result and its
effect with eager's on every call (bugs found by benchmarks/dynamo_parity.py).
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from fxlite.codegen.capture.structure import flatten, unflatten
from fxlite.codegen.capture.watch import Watch, contents_key, is_stateful

import fxlite


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore")


def test_deque_argument_popped_every_call() -> None:
    def fn(q):
        return q.pop() * q.pop()

    f = fxlite.compile(fn)
    for i in range(4):
        q = collections.deque(["foo", torch.full((2,), i + 1.0), torch.full((2,), 2.0)])
        q2 = collections.deque(q)
        torch.testing.assert_close(f(q), fn(q2))
        assert list(q) == list(q2) == ["foo"]


def test_deque_global_appended_every_call() -> None:
    log: collections.deque = collections.deque(maxlen=10)

    def fn(x):
        log.append(1)
        return x * 2

    f = fxlite.compile(fn)
    for i in range(4):
        x = torch.full((3,), float(i))
        torch.testing.assert_close(f(x), x * 2)
        assert len(log) == i + 1


def test_deque_is_keyed_by_contents() -> None:
    q = collections.deque([1, 2])
    before = contents_key(q)
    q.rotate(1)
    assert is_stateful(q) and contents_key(q) != before


def test_tensor_attributes_set_every_call() -> None:
    def fn(x, flag):
        x.flag = flag
        y = x + 1
        y.foo = 42
        return y

    f = fxlite.compile(fn, fullgraph=True)
    for i in range(4):
        x, x2 = torch.full((5,), float(i)), torch.full((5,), float(i))
        y, y2 = f(x, True), fn(x2, True)
        torch.testing.assert_close(y, y2)
        assert x.flag is x2.flag is True and y.foo == y2.foo == 42


def test_tensor_attribute_on_argument_only() -> None:
    def fn(x):
        x.seen = True
        return x.sin()

    f = fxlite.compile(fn)
    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(f(x), x.sin())
        assert x.seen is True


def test_namedtuple_subclass_attributes_returned() -> None:
    class NT(collections.namedtuple("NT", ["a", "b"])):
        pass

    def fn(x):
        t = NT(x + 1, x * 2)
        t.c = x - 3
        return t

    f = fxlite.compile(fn)
    for i in range(4):
        x = torch.full((2,), float(i))
        got, want = f(x), fn(x)
        assert type(got) is NT
        torch.testing.assert_close(tuple(got), tuple(want))
        torch.testing.assert_close(got.c, want.c)


def test_namedtuple_subclass_flatten_round_trip() -> None:
    class NT(collections.namedtuple("NT", ["a", "b"])):
        pass

    t = NT(1, 2)
    t.c = 3
    leaves, spec = flatten(t)
    assert leaves == [1, 2, 3]
    u = unflatten(spec, [4, 5, 6])
    assert type(u) is NT and tuple(u) == (4, 5) and u.c == 6


def test_returned_closure_is_made_every_call() -> None:
    def fn(x):
        v = x + torch.randn(10)

        def inner():
            return v + 1
        return inner

    f = fxlite.compile(fn)
    x = torch.zeros(10)
    torch.manual_seed(0)
    got = [f(x)() for _ in range(4)]
    torch.manual_seed(0)
    want = [fn(x)() for _ in range(4)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert not torch.equal(got[1], got[2])


def test_returned_plain_function_still_replays() -> None:
    def fn(x):
        return x + 1, torch.sin

    with Watch(fn) as watch:
        fn(torch.ones(2))
    assert watch.effect is None and watch.changed() is None


def test_real_assignment_writes_every_call() -> None:
    def fn(x):
        x.real = 10
        return x + 1

    f = fxlite.compile(fn)
    for i in range(4):
        x = torch.ones(5, dtype=torch.cfloat) * (i + 1)
        y = x.clone()
        torch.testing.assert_close(f(x), fn(y))
        torch.testing.assert_close(x, y)


def test_generator_set_state_every_call() -> None:
    def fn():
        st = torch.default_generator.get_state()
        x = torch.rand(2, 3)
        torch.default_generator.set_state(st)
        return x, torch.rand(2, 3)

    f = fxlite.compile(fn)
    for _ in range(4):
        a, b = f()
        torch.testing.assert_close(a, b)


def test_set_rng_state_every_call() -> None:
    def fn(x):
        st = torch.get_rng_state()
        a = x + torch.rand(3)
        torch.set_rng_state(st)
        return a, x + torch.rand(3)

    f = fxlite.compile(fn)
    for i in range(4):
        torch.manual_seed(i)
        a, b = f(torch.zeros(3))
        torch.manual_seed(i)
        a2, b2 = fn(torch.zeros(3))
        torch.testing.assert_close(a, b)
        torch.testing.assert_close((a, b), (a2, b2))
