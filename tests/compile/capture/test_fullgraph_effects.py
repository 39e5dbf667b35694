"""``fullgraph=True`` means what Dynamo's does: no graph break, not "no Python effects".

A function that writes Python objects outliving the call (attributes of an argument set
through a descriptor, a property or ``__slots__``, tensors kept in a dict or a
thread-local, a set updated) is followed: its Python runs on every call, as eager's does,
and its torch calls are served by kernels; so is one that runs in inference mode, and a
tensor carried from call to call is bound where it is first used. Values fixed by sizes
(``torch.sym_max`` of sizes, the rows of an empty tensor) are no read. ``fullgraph=True``
accepts all of these; it still refuses a tensor's value read in Python (a real graph
break).

Each test calls the compiled function several times with fresh inputs, changing state
between calls, beside eager on a twin of every object, and compares results, arguments
and the objects' state.
"""

from __future__ import annotations

from test_compile_contract import DEVICE, rand  # isort: skip
from test_compile_contract import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import itertools
import threading
import warnings

import pytest
import torch
import torch.nn as nn

pytest.importorskip("triton")

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _quiet_calls(compiled, eager, make_args, check, calls=4):
    """Call ``compiled`` and ``eager`` on twin arguments from ``make_args(i)`` (fresh
    tensors each call), with no warning; ``check(i, got, want, mine, theirs)`` compares."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(calls):
            mine, theirs = make_args(i)
            got, want = compiled(*mine), eager(*theirs)
            check(i, got, want, mine, theirs)


# ---------------------------------------------------------------- attributes of arguments
class _Accumulate:
    """A data descriptor: every set adds to what the object holds (Dynamo's
    test_set_descriptor)."""

    def __set__(self, obj, value):
        obj.__dict__["field"] = obj.__dict__["field"] + value * 2

    def __get__(self, obj, objtype=None):
        return self if obj is None else obj.__dict__["field"]


class _Foo:
    field = _Accumulate()

    def __init__(self):
        self.__dict__["field"] = 0


def test_a_descriptor_set_on_an_argument_runs_on_every_call():
    def fn(x, foo, step):
        foo.field = step
        return torch.relu(x) * 2 + foo.field

    c = fxlite.compile(fn, fullgraph=True)
    mine, theirs = _Foo(), _Foo()
    steps = [1, 1, 2, 2, 2]  # (a set that changes nothing, of 0, would replay)

    def make(i):
        x = rand(5)
        return (x, mine, steps[i]), (x.clone(), theirs, steps[i])

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        assert mine.field == theirs.field
        assert c.tier.startswith("followed: it changes the _Foo foo"), c.tier

    _quiet_calls(c, fn, make, check, calls=5)
    assert mine.field == 16


class _Box:
    """A property whose setter computes a tensor (Dynamo's test_property_setter)."""

    def __init__(self):
        self._value = torch.zeros(3, device=DEVICE)

    @property
    def value(self):
        return self._value + 1

    @value.setter
    def value(self, new):
        self._value = new * 2


def test_a_property_setter_on_an_argument_keeps_each_calls_tensor():
    def fn(b, x):
        b.value = torch.sin(x) + b.value  # reads the tensor the last call set
        return b.value * 3

    c = fxlite.compile(fn, fullgraph=True)
    mine, theirs = _Box(), _Box()

    def make(i):
        x = rand(3)
        return (mine, x), (theirs, x.clone())

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(mine._value, theirs._value)
        assert c.tier.startswith("followed"), c.tier

    _quiet_calls(c, fn, make, check, calls=6)
    assert c.kernels and c._recordings == 1  # one recording, its kernels serve the calls


class _Slotted:
    __slots__ = ("x", "__dict__")

    def __init__(self, x):
        self.x = x


def test_an_attribute_set_through_dunder_dict_of_a_slotted_object():
    def fn(obj, t):
        obj.__dict__["custom"] = obj.__dict__.get("custom", 0) + obj.x
        return t * obj.__dict__["custom"] + 1

    c = fxlite.compile(fn, fullgraph=True)
    mine, theirs = _Slotted(2), _Slotted(2)

    def make(i):
        if i == 2:  # state changed between calls
            mine.x = theirs.x = 5
        t = rand(4)
        return (mine, t), (theirs, t.clone())

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        assert mine.__dict__ == theirs.__dict__

    _quiet_calls(c, fn, make, check)


def test_a_set_argument_updated_in_place():
    def fn(x, seen, items):
        seen.update(map(int, items))
        return torch.cos(x) + len(seen)

    c = fxlite.compile(fn, fullgraph=True)
    mine, theirs = set(), set()
    lists = [[1, 2, 1], [1, 2], [3], [3]]

    def make(i):
        x = rand(2)
        return (x, mine, lists[i]), (x.clone(), theirs, list(lists[i]))

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        assert mine == theirs

    _quiet_calls(c, fn, make, check)


# ---------------------------------------------------------------- tensors kept after the call
def test_tensors_kept_in_a_thread_local_are_each_calls_own():
    def fn(x, loc):
        loc.x = x * 2
        loc.history = getattr(loc, "history", 0) + 1
        return loc.x + 1

    c = fxlite.compile(fn, fullgraph=True)
    mine, theirs = threading.local(), threading.local()

    def make(i):
        x = rand(2, 2)
        return (x, mine), (x.clone(), theirs)

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(mine.x, theirs.x)
        assert mine.history == theirs.history == i + 1
        assert mine.x is not got

    _quiet_calls(c, fn, make, check)


def test_a_dict_of_tensors_cached_by_shape_across_calls():
    # Dynamo's test_torch_size_as_dict_key, over more calls: the first tensor of each
    # shape is kept in the argument dict and added to the later ones
    def fn(x, cached):
        if x.shape not in cached:
            cached[x.shape] = x
        return x + cached[x.shape]

    c = fxlite.compile(fn, fullgraph=True)
    mine, theirs = {}, {}
    shapes = [(2, 3), (2, 3), (4,), (2, 3), (4,)]

    def make(i):
        x = rand(*shapes[i])
        return (x, mine), (x.clone(), theirs)

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        assert mine.keys() == theirs.keys()
        for k in mine:
            torch.testing.assert_close(mine[k], theirs[k])

    _quiet_calls(c, fn, make, check, calls=5)


class _Cleared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = {"a": torch.randn(2, 2), "b": torch.randn(2, 2)}

    def forward(self, x):
        self.a.clear()
        self.a["next"] = x * 2
        return torch.tanh(x) + len(self.a)


def test_a_modules_dict_of_tensors_cleared_and_refilled():
    mine = _Cleared()
    theirs = _Cleared()
    theirs.a = {k: v.clone() for k, v in mine.a.items()}
    c = fxlite.compile(mine, fullgraph=True)

    def make(i):
        x = rand(2, 2)
        return (x,), (x.clone(),)

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        assert mine.a.keys() == theirs.a.keys() == {"next"}
        torch.testing.assert_close(mine.a["next"], theirs.a["next"])

    _quiet_calls(c, theirs, make, check)


def test_a_returned_object_it_cannot_rebuild_is_made_on_every_call():
    # Dynamo's test_catch_watchings2: each call returns a new catch_warnings
    def fn(x):
        return x.sin(), warnings.catch_warnings(record=True)

    c = fxlite.compile(fn, fullgraph=True)
    seen = []

    def make(i):
        x = rand(8)
        return (x,), (x.clone(),)

    def check(i, got, want, *_):
        torch.testing.assert_close(got[0], want[0])
        assert isinstance(got[1], warnings.catch_warnings)
        assert all(got[1] is not s for s in seen)
        seen.append(got[1])

    _quiet_calls(c, fn, make, check)


def test_a_tensor_kept_from_the_last_call_and_read_again():
    # an object argument carrying a tensor from call to call: a followed plan's key holds
    # the object's class, identity and attribute names, not what it holds (the Python
    # reads it on every call), and the tensor is bound where it is first used
    class Carry:
        def __init__(self):
            self.h = torch.zeros(3, device=DEVICE)

    def fn(c, x):
        c.h = torch.tanh(c.h + x)
        return c.h * 2

    compiled = fxlite.compile(fn, fullgraph=True)
    mine, theirs = Carry(), Carry()

    def make(i):
        x = rand(3)
        return (mine, x), (theirs, x.clone())

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(mine.h, theirs.h)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(10):
            m, t = make(i)
            if i == 5:  # the caller resets the state of both
                mine.h = torch.ones(3, device=DEVICE)
                theirs.h = torch.ones(3, device=DEVICE)
            check(i, compiled(*m), fn(*t))
    assert compiled.kernels and compiled._recordings == 1


# ---------------------------------------------------------------- tensors carried between calls
# A tensor kept outside module state (a global dict, a module's plain attribute) is a
# constant in the recording; a later call passes another one there. After the first such
# call the follower binds it where it is first used, and the kernels serve every call.
_CACHE: dict = {}


def _carry(x):
    _CACHE["h"] = torch.tanh(_CACHE["h"] + x) * 2
    return _CACHE["h"] + 1


def test_a_tensor_carried_in_a_global_dict_is_served_by_kernels():
    c = fxlite.compile(_carry, fullgraph=True)
    _CACHE["h"] = torch.zeros(3, device=DEVICE)
    want_h = torch.zeros(3, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(6):
            x = rand(3)
            if i == 4:  # state changed between calls, by the caller
                _CACHE["h"] = _CACHE["h"] * 0 + 5
                want_h = want_h * 0 + 5
            want_h = torch.tanh(want_h + x) * 2
            torch.testing.assert_close(c(x), want_h + 1)
            torch.testing.assert_close(_CACHE["h"], want_h)
            assert c.tier.startswith("followed"), c.tier
    assert c.kernels  # the later calls matched: their pieces ran
    plan = next(iter(c._followed.values()))
    assert plan.diverged == 0 and plan.varying


class _Recurrent(nn.Module):
    """Keeps its hidden state as a plain tensor attribute (no buffer)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.h = torch.zeros(2, 4)
        self.steps = []

    def forward(self, x):
        out = torch.tanh(self.lin(x) + self.h)
        self.h = out.detach()  # (kept with its history, it would differ in requires_grad)
        self.steps.append(1)
        return out.sum(1)


def test_a_modules_plain_tensor_attribute_carried_between_calls():
    mine = _Recurrent().to(DEVICE)
    mine.h = mine.h.to(DEVICE)
    theirs = _Recurrent().to(DEVICE)
    theirs.load_state_dict(mine.state_dict())
    theirs.h = mine.h.clone()
    c = fxlite.compile(mine, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(6):
            x = rand(2, 4)
            if i == 3:  # the caller resets the state
                mine.h = torch.ones(2, 4, device=DEVICE)
                theirs.h = torch.ones(2, 4, device=DEVICE)
            torch.testing.assert_close(c(x), theirs(x.clone()))
            torch.testing.assert_close(mine.h, theirs.h)
    assert len(mine.steps) == len(theirs.steps) == 6
    assert c.kernels


def test_a_carried_tensor_of_another_layout_or_passed_twice_leaves_the_match():
    # another shape at the varying constant, or the recording's one tensor now two
    # different ones: those calls run on eagerly, each result as eager's
    def fn(x):
        a = _CACHE["a"]
        y = torch.sin(a) + x
        return y * 2 + _CACHE["b"]

    c = fxlite.compile(fn, fullgraph=True)
    shared = torch.ones(3, device=DEVICE)
    _CACHE["a"] = _CACHE["b"] = shared
    with warnings.catch_warnings(record=True):
        for i in range(8):
            x = rand(3)
            if i in (2, 3):
                _CACHE["a"] = _CACHE["b"] = rand(3)
            elif i in (4, 5):
                _CACHE["a"], _CACHE["b"] = rand(3), rand(3)
            elif i == 6:
                _CACHE["a"] = rand(1)  # broadcasts, another layout
            torch.testing.assert_close(c(x), fn(x))


# ---------------------------------------------------------------- values fixed by sizes
def test_iterating_a_tensor_whose_first_dimension_is_empty():
    # iter(x) of a (0, 3) tensor gives no rows: a value fixed by the sizes (Dynamo's
    # test_itertools_islice), not a tensor's value read
    def fn(x, y):
        total = y * 1
        for row in x:
            total = total + row
        return total * 2, itertools.islice(x, 1, 3)

    c = fxlite.compile(fn, fullgraph=True)
    rows = [0, 0, 2, 0, 3]

    def make(i):
        x, y = rand(rows[i], 3), rand(3)
        return (x, y), (x.clone(), y.clone())

    def check(i, got, want, *_):
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(list(got[1]), list(want[1]))

    _quiet_calls(c, fn, make, check, calls=5)


def test_sym_max_of_sizes():
    # make_contiguous_strides_for calls torch.sym_max on sizes (Dynamo's
    # test_make_contiguous_strides_for_under_compile)
    from torch._prims_common import make_contiguous_strides_for

    def fn(x):
        strides = make_contiguous_strides_for(x.shape)
        return x.as_strided(x.shape, strides) * 2 + torch.sym_max(x.shape[0], 3)

    c = fxlite.compile(fn, fullgraph=True, dynamic=True)
    shapes = [(4, 8), (4, 8), (7, 8), (1, 8), (4, 8)]

    def make(i):
        x = rand(*shapes[i]).t().contiguous().t() if i == 4 else rand(*shapes[i])
        return (x,), (x.clone(),)

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)

    _quiet_calls(c, fn, make, check, calls=5)


# ---------------------------------------------------------------- inference mode
# Inference tensors carry no version counter: the recorder sees writes through the aten
# ops' schemas, and the function is followed (no replay check could see its writes).
class _Stats(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x, out):
        h = torch.relu(self.lin(x)) * 2
        self.seen.add_(h.sum(0))  # a buffer written in place
        out[0].copy_(h[0])  # an argument written through a view
        x.mul_(0.5)  # an argument written in place
        return torch.tanh(h) + 1


def test_a_module_under_inference_mode_writes_as_eager():
    mine = _Stats().to(DEVICE)
    theirs = _Stats().to(DEVICE)
    theirs.load_state_dict(mine.state_dict())
    c = fxlite.compile(mine, fullgraph=True)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            x, out = rand(3, 4), rand(2, 4)
            x2, out2 = x.clone(), out.clone()
            got, want = c(x, out), theirs(x2, out2)
            torch.testing.assert_close(got, want)
            assert got.is_inference()
            torch.testing.assert_close(x, x2)
            torch.testing.assert_close(out, out2)
            torch.testing.assert_close(mine.seen, theirs.seen)
            assert c.tier.startswith("followed: it runs in inference mode"), c.tier
    assert c.kernels


def test_a_function_that_enters_inference_mode_itself():
    def fn(x, w):
        with torch.inference_mode():
            y = torch.sigmoid(x @ w) + 1
            y[:, 0] = 0.0
        return y, x + 1

    c = fxlite.compile(fn, fullgraph=True)

    def make(i):
        x, w = rand(3, 3), rand(3, 3)
        return (x, w), (x.clone(), w.clone())

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        assert got[0].is_inference() and not got[1].is_inference()
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

    _quiet_calls(c, fn, make, check)


@pytest.mark.parametrize("how", ["data", "parameter"])
def test_inference_tensors_read_as_data_and_wrapped_in_a_parameter(how):
    # Dynamo's test_data_access_in_inference_mode and test_inference_mode_param
    def fn(x):
        if how == "data":
            return x.data * 3
        p = torch.nn.Parameter(x, requires_grad=False)
        return x * p

    c = fxlite.compile(fn, fullgraph=True)
    with torch.inference_mode(), warnings.catch_warnings(record=True):
        # (a Parameter made in the call is a tensor the recording cannot match on later
        # calls: those run on eagerly, then all of it, with a warning)
        for _ in range(5):
            x = torch.rand(4, device=DEVICE)
            got, want = c(x), fn(x.clone())
            torch.testing.assert_close(got, want)
            assert got.is_inference()


def test_inference_tensors_given_outside_inference_mode():
    def fn(x):
        return torch.cos(x) * 2 + x.sum()

    c = fxlite.compile(fn, fullgraph=True)

    def make(i):
        with torch.inference_mode():
            x = rand(5)
        return (x,), (x.clone(),)

    def check(i, got, want, *_):
        torch.testing.assert_close(got, want)
        assert not got.is_inference()

    _quiet_calls(c, fn, make, check)


# ---------------------------------------------------------------- still refused
def test_fullgraph_still_refuses_a_value_read_that_steers_python():
    def fn(x, box):
        box.last = x
        if x.sum() > 0:
            return x * 2
        return x

    c = fxlite.compile(fn, fullgraph=True)
    with pytest.raises(fxlite.TraceError, match="reads a tensor's value"):
        c(rand(3), _Box())
