"""Results that hold tensors in nested tuples and lists are values of the call, at any depth.

``torch.histogramdd`` returns ``(hist, bin_edges)`` with ``bin_edges`` a tuple of tensors.
The recorder bound the items of a result one level deep only, so the edges stayed
unknown: a later read of them became a constant holding the recording call's values,
and every replay returned those (Inductor's ``test_kwargs``).
"""

import os

import pytest
import torch
from torch.utils._pytree import tree_leaves

import fxlite


def _same(want, got):
    a, b = tree_leaves(want), tree_leaves(got)
    return len(a) == len(b) and all(
        type(x) is type(y) and (not isinstance(x, torch.Tensor) or
                                torch.allclose(x, y, equal_nan=True))
        for x, y in zip(a, b))


def _check(fn, make_inputs, calls=4):
    f = fxlite.compile(fn)
    for call in range(calls):
        args = make_inputs(torch.Generator().manual_seed(call))
        want, got = fn(*args), f(*args)
        assert _same(want, got), f"call {call + 1} ({f.tier}): {got} != eager {want}"
    return f


def _points(g):
    return torch.randn(6, 2, generator=g), torch.rand(6, generator=g)


def test_histogramdd_bin_edges_are_values_of_each_call():
    f = _check(lambda x, w: torch.histogramdd(x, bins=[3, 4], weight=w), _points)
    assert f.tier.startswith("replayed")


def test_nested_items_feed_later_ops():
    def fn(x, w):
        hist, edges = torch.histogramdd(x, bins=[3, 3], weight=w)
        return hist.sum() + edges[0].sum(), edges[1] * 2, [edges]

    _check(fn, _points)


def test_nested_items_after_a_read():
    # the value read ends a segment: the next recording fast-forwards through the
    # histogramdd call and must bind its nested edges to this call's values
    def fn(x, w):
        hist, edges = torch.histogramdd(x, bins=[2, 2], weight=w)
        if hist.sum() > 2.5:
            return edges[0] * 2 + 1, hist
        return edges[1] - 1, hist

    _check(fn, _points, calls=8)


def test_nested_items_when_python_runs():
    log = []

    def fn(x, w):
        hist, edges = torch.histogramdd(x, bins=[3, 2], weight=w)
        log.append(len(edges))  # a side effect: the call is followed, not replayed
        return hist * 2, edges[0] + edges[1].sum()

    f = _check(fn, _points)
    assert f.tier.startswith("followed")
    assert log == [2] * 8


class _Deep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, ((x + 1, [x - 1, (x * x,)]),)

    @staticmethod
    def backward(ctx, g, *rest):
        return g * 2


def test_any_depth():
    def fn(x):
        a, ((b, [c, (d,)]),) = _Deep.apply(x)
        return a + b, c * d, [[c], (d,)]

    _check(fn, lambda g: (torch.randn(5, generator=g),))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or bool(os.environ.get("TRITON_INTERPRET")),
                    reason="needs CUDA with TRITON_INTERPRET unset")
def test_any_depth_gpu():
    # CUDA results go through the straight-line and CUDA-graph replays
    def fn(x):
        a, ((b, [c, (d,)]),) = _Deep.apply(x)
        return a.sin() + b, c * d, [[c], (d + 1,)]

    _check(fn, lambda g: (torch.randn(64, 32, generator=g).cuda(),), calls=6)
