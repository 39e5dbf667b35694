"""Following across sizes (codegen/capture/follow.py): a followed function (its Python has
effects) given tensors of other sizes on each call (a batch of 2, then 3, then 5...) keeps
running its compiled pieces, as a replayed function keeps its segments; a size the Python
reads and passes to a torch call (``x.view(x.shape[0], -1)``) is matched on every call.

Every test runs the compiled function beside a plain copy from equal fresh state, several
calls with fresh inputs of varying sizes, and compares results (exceptions included) and
Python side effects on every call, and counts the calls compiled pieces served.
"""

from __future__ import annotations

from test_compile_contract import DEVICE  # isort: skip
from test_compile_contract import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fxlite.codegen.capture.follow import Follow

import fxlite

SIZES = [2, 3, 5, 4, 1, 6, 3, 7]  # the first call's (recorded) size never comes back


def side_by_side(make, shape, monkeypatch, sizes=SIZES):
    """Run ``make()``'s function (which returns it and its log) eagerly and compiled on
    fresh inputs of ``shape(n)`` for each ``n`` of ``sizes``; returns the compiled
    function, its fxlite warnings and per call after the first, how many pieces compiled
    pieces served (no part of them in eager)."""
    served = [0]
    run = Follow.run_piece

    def counted(self, piece, env):
        ok = run(self, piece, env)
        served[0] += bool(ok and not piece.compiled.fallbacks)
        return ok

    monkeypatch.setattr(Follow, "run_piece", counted)
    runs = []
    for compiled in (False, True):
        fn, log = make()
        f = fxlite.compile(fn) if compiled else fn
        results, per_call = [], []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for i, n in enumerate(sizes):
                x = torch.randn(*shape(n), generator=torch.Generator().manual_seed(i)).to(DEVICE)
                served[0] = 0
                try:
                    results.append(f(x))
                except RuntimeError as e:
                    results.append(type(e))
                per_call.append(served[0])
        runs.append((results, list(log), f, per_call[1:],
                     [str(w.message) for w in said if str(w.message).startswith("fxlite")]))
    (r0, log0, _, _, _), (r1, log1, f, per_call, said) = runs
    assert log1 == log0
    assert len(r1) == len(r0)
    for a, b in zip(r0, r1):
        if isinstance(a, type) or isinstance(b, type):
            assert a is b
        else:
            torch.testing.assert_close(b, a)
    return f, said, per_call


def test_a_followed_function_keeps_its_kernels_when_the_batch_size_changes(monkeypatch):
    """Before: a piece ran only on the recorded sizes; each call of another batch size left
    the recording, and after three such calls the function ran in eager for good ("its
    torch calls differ from its recorded ones on every call")."""
    def make():
        calls = []

        def fn(x):
            calls.append(x.shape[0])
            return torch.relu(x) + 1

        return fn, calls

    f, said, per_call = side_by_side(make, lambda n: (n, 8), monkeypatch)
    assert per_call == [1] * (len(SIZES) - 1)  # the first call recorded: every later one ran
    assert not said and f.fallbacks == [] and len(f.kernels) > 0
    assert f.tier.startswith("followed")


def test_a_layer_norm_and_a_view_of_sizes_that_stay_keep_their_kernels(monkeypatch):
    """Sizes the Python reads and passes (a layer_norm's normalized_shape, a view's width)
    are matched on every call: the last dim stays 8 while the batch and time change."""
    def make():
        seen = []

        def fn(x):
            seen.append(tuple(x.shape))
            h = F.layer_norm(torch.tanh(x) * 2, x.shape[-1:])
            flat = h.reshape(-1, h.shape[-1])
            return flat * 3 + 1, flat.sum(0)

        return fn, seen

    f, said, per_call = side_by_side(make, lambda n: (n, n % 3 + 1, 8), monkeypatch)
    assert all(k == 2 for k in per_call)  # both pieces, on every call of other sizes
    assert not said and f.fallbacks == [] and len(f.kernels) > 0


def test_a_size_passed_to_a_view_ends_the_match_where_it_differs(monkeypatch):
    """``view(x.shape[0], -1)`` passes the batch size: each call of another batch leaves the
    recording at the view (which runs eagerly, as does the rest of that call), after the
    piece before it ran on the call's sizes; three such calls in a row run in eager."""
    def make():
        seen = []

        def fn(x):
            seen.append(x.shape[0])
            h = torch.relu(x) * 2
            return h.view(h.shape[0], -1) + 1

        return fn, seen

    f, said, per_call = side_by_side(make, lambda n: (n, 2, 4), monkeypatch)
    assert per_call[:3] == [1, 1, 1] and per_call[3:] == [0] * (len(SIZES) - 4)
    assert f.tier.startswith("eager") and "differ from its recorded ones" in f.tier
    assert not [m for m in said if "failed" in m]


@pytest.mark.parametrize("late", ["full", "arange", "layer_norm"])
def test_a_size_read_later_in_a_piece_is_matched_at_its_own_call(late, monkeypatch):
    """A piece runs at the first of its calls, computing all its values with the recorded
    numbers; a later call in it that passes another number (here one the batch size
    gives) leaves the match there and runs eagerly, whether the piece's stale value would
    have fit (``torch.full``) or its run raised on the new sizes (``arange``, the
    layer_norm of a square input): never a stale value, never an exception eager does not
    raise. A piece that runs before it serves every call."""
    def make():
        seen = []

        def fn(x):
            seen.append(x.shape[0])
            h = torch.relu(x) * 2
            h = h.t()  # (a view: what comes before is a piece of its own)
            v = torch.sigmoid(h) + 1
            n = x.shape[0]
            if late == "full":
                return v * torch.full((1, 1), float(n), device=x.device) - 1
            if late == "arange":
                return v.sum(0) + torch.arange(n, device=x.device)
            return F.layer_norm(v, v.shape[-1:]) - 1

        return fn, seen

    shape = (lambda n: (n, n)) if late == "layer_norm" else (lambda n: (n, 4))
    f, said, per_call = side_by_side(make, shape, monkeypatch, sizes=[2, 3, 4, 2, 5])
    # calls 2, 3 and 5 (other sizes): the first piece; the second ran too where its
    # stale value fit (``full``), else its run raised; call 4 (the recorded sizes): both
    assert per_call == ([2, 2, 2, 2] if late == "full" else [1, 1, 2, 1])
    assert not [m for m in said if "failed" in m]


def test_results_whose_number_depends_on_sizes_come_from_pieces_of_those_sizes(monkeypatch):
    """``unsafe_split(2)`` makes as many tensors as the batch size asks: a piece holding it
    runs only on the sizes it was made for (the Python is handed the recorded number of
    results); the piece before it serves every call."""
    def make():
        seen = []

        def fn(x):
            seen.append(x.shape[0])
            h = (torch.relu(x) * 2).t()
            return [p + 1 for p in h.unsafe_split(2, dim=1)]

        return fn, seen

    f, said, per_call = side_by_side(make, lambda n: (n, 3), monkeypatch, sizes=[4, 2, 6, 4])
    assert per_call == [1, 1, 2]  # calls 2, 3: the first piece alone; call 4: both
    assert not [m for m in said if "failed" in m]
