"""What a replay cannot check on every call, and what fxlite does instead.

- A container too large to key by its items (more than 256) that the function names
  makes it *followed*: its Python runs on every call, so a changed item is read.
- A module changed behind ``nn.Module``'s back (``m._parameters[k] = p``,
  ``m.__dict__[k] = v``) bumps no counter: the guard walks a sixteenth of the modules on
  each call, so each of them every 16 calls, and once it finds such a change it warns and
  walks all of them on every call.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxlite

TABLE = list(range(300))
NESTED = {"scales": {"by_id": {i: float(i) for i in range(400)}}}


def _scaled(x):
    return x * TABLE[150]


def _nested(x):
    return x * NESTED["scales"]["by_id"][7]


@pytest.mark.parametrize("fn,change,want", [
    (_scaled, lambda: TABLE.__setitem__(150, 7), 7.0),
    (_nested, lambda: NESTED["scales"]["by_id"].__setitem__(7, -2.0), -2.0),
], ids=["list", "nested_dict"])
def test_a_large_container_it_names_is_read_on_every_call(fn, change, want) -> None:
    saved = (list(TABLE), {k: dict(v) for k, v in NESTED["scales"].items()})
    try:
        c = fxlite.compile(fn)
        x = torch.randn(3, 4)
        for _ in range(3):
            torch.testing.assert_close(c(x), fn(x))
        assert c.tier.startswith("followed") and "items" in c.tier, c.tier
        change()
        for _ in range(3):
            torch.testing.assert_close(c(x), x * want)
    finally:
        TABLE[:] = saved[0]
        NESTED["scales"] = saved[1]


def test_a_small_container_still_replays() -> None:
    small = [1.0, 2.0, 3.0]
    c = fxlite.compile(lambda x: x * small[1])
    x = torch.randn(3)
    for _ in range(3):
        c(x)
    assert c.tier == "replayed"
    small[1] = 5.0
    torch.testing.assert_close(c(x), x * 5.0)


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


def _write_parameter(m: _Scale) -> None:
    m.lin._parameters["weight"] = torch.nn.Parameter(torch.randn(3, 4))


def _write_dict(m: _Scale) -> None:
    m.__dict__["scale"] = 5.0


@pytest.mark.parametrize("write", [_write_parameter, _write_dict], ids=["parameters", "dict"])
def test_a_change_behind_the_modules_back_is_found_warned_and_then_checked_every_call(
        write) -> None:
    # a class per case: fxlite warns once per message, and the message names the class
    m = type(f"_Scale{write.__name__}", (_Scale,), {})()
    c = fxlite.compile(m)
    x = torch.randn(2, 4)
    for _ in range(3):
        torch.testing.assert_close(c(x), m(x))
    write(m)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        right = [torch.allclose(c(x), m(x)) for _ in range(16)]
    assert right[-1] and right.index(True) <= 15, right
    assert all(right[right.index(True):]), right
    said = [str(w.message) for w in seen if "behind nn.Module's back" in str(w.message)]
    assert len(said) == 1 and "setattr" in said[0]
    assert seen[0].filename == __file__  # it names the user's line
    m.__dict__["scale"] = 7.0  # from now on every call checks
    torch.testing.assert_close(c(x), m(x))


@pytest.mark.parametrize("where", [0, 7, 20, 39])
def test_each_call_walks_a_part_and_a_change_anywhere_is_found_within_16_calls(where) -> None:
    # A walk of every module on every 16th call made that call 1.5 ms slower for
    # vit_b_16 and 7 ms for maxvit_t on an H200 host; each call now walks one part.
    import fxlite.codegen.capture.guards as guards

    layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)])
    c = fxlite.compile(layers)
    x = torch.randn(2, 4)
    for _ in range(3):
        torch.testing.assert_close(c(x), layers(x))
    walked: list[int] = []
    real = guards.StateGuard._walk_part
    guards.StateGuard._walk_part = lambda self, part: walked.append(part) or real(self, part)
    try:
        parts = []
        for _ in range(16):
            walked.clear()
            torch.testing.assert_close(c(x), layers(x))
            parts += walked
        assert sorted(parts) == list(range(16)), parts  # one part a call, each one once
        layers[where].__dict__["_parameters"]["bias"] = torch.nn.Parameter(torch.ones(4))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            right = [torch.allclose(c(x), layers(x)) for _ in range(16)]
    finally:
        guards.StateGuard._walk_part = real
    assert right[-1] and all(right[right.index(True):]), right


LOG = __import__("logging").getLogger("fxlite-test-guard-limits")


def _by_level(x):
    return x * 2 if LOG.level > 10 else x * 3


def test_a_library_object_it_names_is_guarded_by_its_own_attributes() -> None:
    """A logging.Logger (a library's object) is keyed by its own attributes, not walked on
    into its manager's dict of every logger (0.1-0.4 ms a call for each of the five
    loggers a transformers model's helpers name): a change of its level is still seen."""
    LOG.setLevel(20)
    try:
        c = fxlite.compile(_by_level)
        x = torch.randn(3)
        for _ in range(3):
            torch.testing.assert_close(c(x), x * 2)
        LOG.setLevel(5)
        torch.testing.assert_close(c(x), x * 3)
    finally:
        LOG.setLevel(0)


class _Settings:
    def __init__(self, scale: float) -> None:
        self.scale = scale


class _BySettings(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.settings = _Settings(2.0)

    def forward(self, x):
        return x * self.settings.scale


def test_an_object_rebound_behind_the_modules_back_is_found_within_16_calls() -> None:
    """The walk every 16 calls looks for the plain objects modules hold only when what
    they hold changed (their is_stateful checks were most of a walk's cost): a settings
    object swapped through ``__dict__`` is still found, and then read on every call."""
    m = _BySettings()
    c = fxlite.compile(m)
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(c(x), x * 2)
    m.__dict__["settings"] = _Settings(5.0)
    right = [torch.allclose(c(x), x * 5) for _ in range(16)]
    assert right[-1] and all(right[right.index(True):]), right
    m.settings.scale = 7.0  # the new object's attributes are read on every call
    torch.testing.assert_close(c(x), x * 7)
