"""Cases from PyTorch's Dynamo tests (``benchmarks/dynamo_parity.py``) that fxlite got
wrong or crashed on, each compared with eager over several calls."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch

import fxlite


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_a_method_compiled_in_a_class_body_binds_its_instance() -> None:
    """``@fxlite.compile`` on a method: ``obj.run(x)`` passes ``obj`` as ``self``, as a
    function and torch.compile's result do (it raised a missing-argument TypeError)."""
    class Model:
        def __init__(self, scale: float) -> None:
            self.scale = scale

        @fxlite.compile
        def run(self, x):
            return torch.sin(x) * self.scale

    a, b = Model(2.0), Model(3.0)
    x = torch.randn(4)
    for _ in range(3):
        torch.testing.assert_close(a.run(x), torch.sin(x) * 2.0)
        torch.testing.assert_close(b.run(x), torch.sin(x) * 3.0)
    assert isinstance(Model.__dict__["run"], fxlite.codegen.compile.CompiledFunction)


def test_a_size_built_from_sizes_stays_a_size() -> None:
    """``x.size() + x.size()`` is a ``torch.Size`` in eager; replays returned a tuple."""
    f = fxlite.compile(lambda x: x.size() + x.size())
    for n in (10, 10, 10, 4, 4):
        got = f(torch.ones(n, 3))
        assert type(got) is torch.Size and got == torch.Size([n, 3, n, 3])


def test_a_namedtuple_size_argument_replays() -> None:
    """``torch.rand(Shape(2, 3))`` with a namedtuple size: replays rebuilt the namedtuple
    from one generator and raised TypeError."""
    Shape = collections.namedtuple("Shape", ["a", "b"])

    def fn():
        return torch.rand(Shape(2, 3), requires_grad=True) + 1

    f = fxlite.compile(fn)
    for seed in range(3):
        torch.manual_seed(seed)
        got = f()
        torch.manual_seed(seed)
        torch.testing.assert_close(got, fn())
        assert got.requires_grad


def test_a_caller_in_inference_mode_is_followed_with_a_reason() -> None:
    """Inference tensors carry no version counter: the recorder sees writes through the
    ops' schemas, and the function is followed (its tier says why; it ran in eager, with
    a warning that said the function *entered* inference mode, when the caller had)."""
    f = fxlite.compile(lambda x: x * 2 + 1)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            got = f(torch.ones(2))
            torch.testing.assert_close(got, torch.full((2,), 3.0))
            assert got.is_inference()
    assert f.tier.startswith("followed: it runs in inference mode"), f.tier


def test_a_write_into_a_parameter_under_no_grad_set_inside_the_function() -> None:
    """``set_grad_enabled(False); param.add_(y)``, then gradients back on: the write was
    made a pure add plus a write-back before the output, after gradients were on again,
    where a leaf that requires grad refuses an in-place write (replays raised)."""
    def fn(param, y):
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(False)
            param.add_(y)
        finally:
            torch.set_grad_enabled(prev)
        return param * 2

    f = fxlite.compile(fn)
    p = torch.nn.Parameter(torch.randn(4))
    q = torch.nn.Parameter(p.detach().clone())
    for i in range(4):
        y = torch.full((4,), float(i))
        torch.testing.assert_close(f(p, y), fn(q, y))
        torch.testing.assert_close(p, q)
    assert torch.is_grad_enabled()


def test_an_attribute_added_to_a_dataclass_argument_is_another_structure() -> None:
    """A dataclass argument was split into its declared fields alone, so ``cfg.z = True``
    (read by ``hasattr``) did not change the key and the old path replayed."""
    import dataclasses

    @dataclasses.dataclass
    class Cfg:
        scale: float

    def fn(x, cfg):
        out = x * cfg.scale
        return out + 1 if hasattr(cfg, "z") else out - 1

    f = fxlite.compile(fn)
    cfg = Cfg(2.0)
    x = torch.randn(3)
    for step in range(5):
        if step == 2:
            cfg.z = True
        if step == 4:
            del cfg.z
        torch.testing.assert_close(f(x, cfg), fn(x, cfg))
