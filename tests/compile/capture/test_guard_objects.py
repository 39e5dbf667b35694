"""Guards on arguments that are objects, not tensors or scalars: every compiled call is
compared with eager, over several calls whose arguments change between them.

- An object argument is keyed by its class and an identity no later object can share
  (``guards.identity``), so a freed object's address reused by another class, or a new
  ``functools.partial`` holding other values, does not replay the old recording.
- A ``functools.partial`` is keyed by its function and bound values.
- A numpy array is keyed by its values (changed in place, the key changes).
- A plain object is keyed by its attribute names and values (``hasattr(obj, "z")``).
- A tensor argument is keyed by its Python attributes (``hasattr(x, "test")``).
"""

from __future__ import annotations

import functools
import gc
import types

import numpy as np
import torch
from fxlite.codegen.capture.guards import argument_key, identity

import fxlite


class _Called:
    def __call__(self) -> None:
        pass


class _Plain:
    pass


def _callable_branch(x, arg):
    return x * 2 if callable(arg) else x + 1


def test_freed_object_address_reused_by_another_class():
    f = fxlite.compile(_callable_branch)
    x = torch.randn(4)
    for _ in range(20):
        a = _Plain()
        torch.testing.assert_close(f(x, a), _callable_branch(x, a))
        del a
        gc.collect()
        b = _Called()  # often where `a` was
        torch.testing.assert_close(f(x, b), _callable_branch(x, b))
        del b


def test_identity_is_not_reused_after_free():
    seen = set()
    for _ in range(50):
        a = _Plain()
        k = identity(a)
        assert identity(a) == k
        assert k not in seen
        seen.add(k)
        del a


def _mul(x, y):
    return x * y


def _apply(f0, x):
    return f0(x)


def test_partial_with_new_bound_tensor_each_call():
    g = fxlite.compile(_apply)
    for _ in range(8):
        p = functools.partial(_mul, y=torch.randn(3, 3))
        x = torch.randn(3, 3)
        torch.testing.assert_close(g(p, x), _apply(p, x))
        del p


def test_partial_keyed_by_contents():
    g = fxlite.compile(_apply)
    x = torch.randn(3)
    for y in (2.0, 3.0, 2.0, 5.0):
        p = functools.partial(_mul, y=y)
        torch.testing.assert_close(g(p, x), _apply(p, x))
    assert argument_key(functools.partial(_mul, y=2.0)) == \
        argument_key(functools.partial(_mul, y=2.0))


def _mean(a):
    return torch.tensor(a.sum() / len(a))


def test_numpy_array_changed_in_place():
    f = fxlite.compile(_mean)
    small, large = np.ones(4), np.ones(1000)
    for i in range(4):
        for arr in (small, large):
            arr[0] = 10.0 * i
            torch.testing.assert_close(f(arr), _mean(arr))


def test_numpy_array_key_by_value():
    a = np.arange(6.0)
    assert argument_key(a) == argument_key(a.copy())
    assert argument_key(a) != argument_key(a.astype(np.float32))
    big = np.arange(1000.0)
    k = argument_key(big)
    big[999] = -1.0
    assert argument_key(big) != k
    assert argument_key(big[::2]) == argument_key(big[::2].copy())


def _has_z(x, obj):
    return x - 2 if hasattr(obj, "z") else x * obj.scale


def test_new_attribute_on_object_argument():
    f = fxlite.compile(_has_z)
    x = torch.randn(3)
    o = _Plain()
    o.scale = 2.0
    for step in range(5):
        if step == 2:
            o.z = True
        if step == 3:
            del o.z
            o.scale = 4.0
        torch.testing.assert_close(f(x, o), _has_z(x, o))


def test_attribute_renamed_on_library_object_argument():
    f = fxlite.compile(_has_z)
    x = torch.randn(3)
    o = types.SimpleNamespace(scale=2.0, y=1.0)
    for step in range(4):
        if step == 2:  # the same values under other names
            del o.y
            o.z = 1.0
        torch.testing.assert_close(f(x, o), _has_z(x, o))


def _has_test(x):
    return x + 2 if hasattr(x, "test") else x + 1


def test_tensor_python_attribute():
    f = fxlite.compile(_has_test, fullgraph=True)
    for step in range(5):
        x = torch.ones(2)
        if step in (2, 4):
            x.test = None
        torch.testing.assert_close(f(x), _has_test(x))


def _scaled_by_attr(x):
    return x * x.scale if hasattr(x, "scale") else x


def test_tensor_python_attribute_value():
    f = fxlite.compile(_scaled_by_attr)
    for scale in (None, 2.0, 3.0, None, 2.0):
        x = torch.ones(2)
        if scale is not None:
            x.scale = scale
        torch.testing.assert_close(f(x), _scaled_by_attr(x))
