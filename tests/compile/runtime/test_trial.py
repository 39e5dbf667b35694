"""The trial (``codegen/runtime/trial.py``): on a GPU a compiled segment's kernels race its
recorded ops on real calls and the faster side stays; under ``mode="reduce-overhead"`` a
training segment's two sides race from CUDA graphs, one after the other.

The timing itself is faked (sides that sleep, ``torch.cuda.synchronize`` a no-op), so
these run on the CPU too.
"""

from __future__ import annotations

from test_compile import DEVICE, LinearRelu, rand  # isort: skip  (sets up the interpreter)

import pytest
import torch

import fxlite


@pytest.mark.parametrize("slow", ["compiled", "recorded"])
def test_a_trial_keeps_the_faster_side_after_timed_calls(monkeypatch, slow):
    # On a GPU a compiled segment first runs on trial against its recorded ops.
    import time as _time

    from fxlite.codegen.runtime.trial import Trial

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls, decided = {"compiled": 0, "recorded": 0}, []

    def side(name):
        def run(x):
            calls[name] += 1
            _time.sleep(0.004 if name == slow else 0.0)
            return x + 1
        return run

    trial = Trial(side("compiled"), side("recorded"), lambda *a: decided.append(a))
    for _ in range(11):
        assert trial(1) == 2
    assert len(decided) == 1 and decided[0][0] is (slow == "recorded")
    assert calls["compiled"] >= 4 and calls["recorded"] >= 4


def test_a_graphed_training_segment_tries_its_kernels_and_recorded_ops_from_graphs(
        monkeypatch):
    # Under mode="reduce-overhead" a training segment's kernels lose no host time to their
    # autograd nodes: both sides replay from CUDA graphs on trial, each observed and
    # captured before it is timed.
    from fxlite.codegen.runtime.segment_graphs import WARMUP, SegmentGraphs
    from fxlite.codegen.runtime.trial import GraphedTrial, Trial, choose_runner

    monkeypatch.setenv("FXLITE_TRIAL", "1")
    m = LinearRelu().to(DEVICE)
    c = fxlite.compile(lambda x: m(x).sum())
    c(rand(4, 8)).backward()
    seg = c._last[0]
    kernels = list(seg.compiled.kernels)
    assert any(hasattr(k, "_variants") for k in kernels)  # autograd groups: a training one
    trial = choose_runner(seg, cuda=True, graphed=True)
    assert isinstance(trial, GraphedTrial) and trial.warm == WARMUP + 2
    ours, theirs = trial.runner, trial.make[1]()
    assert isinstance(ours, SegmentGraphs) and isinstance(theirs, SegmentGraphs)
    assert ours.gm is seg.compiled.gm and theirs.gm is not ours.gm
    assert not any(hasattr(n.target, "_variants") for n in theirs.gm.graph.nodes)
    trial.decide_with(False, 2.0, 1.0, theirs)
    assert seg.run is theirs and not seg.compiled.kernels
    assert "recorded ops ran faster than its" in seg.compiled.fallbacks[-1]
    # without the trial (FXLITE_TRIAL=0) the kernels replay
    seg.compiled.kernels, seg.compiled.gm = kernels, ours.gm
    monkeypatch.setenv("FXLITE_TRIAL", "0")
    run = choose_runner(seg, cuda=True, graphed=True)
    assert isinstance(run, SegmentGraphs) and run.gm is ours.gm
    # without graphs, the plain trial installs its winner the same way
    monkeypatch.setenv("FXLITE_TRIAL", "1")
    plain = choose_runner(seg, cuda=True, graphed=False)
    assert isinstance(plain, Trial) and not isinstance(plain, GraphedTrial)
    plain.decide(False, 2.0, 1.0)
    assert seg.run is seg.compiled.run and not seg.compiled.kernels
    assert seg.compiled.fallbacks[-1].startswith("its recorded ops ran faster than its")


@pytest.mark.parametrize("slow", ["kernels", "recorded"])
def test_a_graphed_trial_keeps_one_sides_graphs_alive_at_a_time(monkeypatch, slow):
    # Each side's graphs hold a memory pool as large as the step's working memory: the
    # sides run one after the other, and the winner is made again at the end.
    import gc
    import time as _time
    import weakref

    from fxlite.codegen.runtime.trial import GraphedTrial

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    made, alive = [], []

    class Side:
        def __init__(self, name):
            gc.collect()
            # no other side's graphs when a side is made
            made.append((name, sum(r() is not None for r in alive)))
            self.name, self.calls = name, 0
            alive.append(weakref.ref(self))

        def __call__(self, x):
            self.calls += 1
            _time.sleep(0.004 if self.name == slow else 0.0)
            return x + 1

    decided = []
    trial = GraphedTrial((lambda: Side("kernels"), lambda: Side("recorded")),
                         lambda *a: decided.append(a), warm=5)
    # (the last timed call's time ends where the 17th call starts: the winner runs it)
    assert [trial(1) for _ in range(17)] == [2] * 17
    kernels_win, ours, theirs, winner = decided[0]
    winner_name = "kernels" if kernels_win else "recorded"
    assert kernels_win is (slow == "recorded") and winner.name == winner_name
    assert made == [("kernels", 0), ("recorded", 0), (winner_name, 0)]
    assert (ours > theirs) is (slow == "kernels")


@pytest.mark.parametrize("slow", ["kernels", "recorded"])
def test_a_graphed_trial_counts_the_work_after_each_call(monkeypatch, slow):
    # A module whose backward runs after it (DistributedDataParallel's, or a user's
    # loss.backward()): a side with the faster forward but the slower backward must lose.
    import time as _time

    from fxlite.codegen.runtime.trial import GraphedTrial

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    last = []

    class Side:
        def __init__(self, name):
            self.name = name

        def __call__(self, x):
            last.append(self.name)
            _time.sleep(0.002 if self.name != slow else 0.0)  # the faster forward
            return x + 1

    decided = []
    trial = GraphedTrial((lambda: Side("kernels"), lambda: Side("recorded")),
                         lambda *a: decided.append(a), warm=5)
    for _ in range(18):
        trial(1)
        _time.sleep(0.008 if last[-1] == slow else 0.0)  # its backward, after the call
    kernels_win = decided[0][0]
    assert kernels_win is (slow == "recorded")


@pytest.mark.parametrize("off", [None, "a module in it has a backward hook"])
def test_a_graphed_trials_winner_that_gave_up_its_graphs_runs_plainly(monkeypatch, off):
    # A side that could not capture (here a module backward hook in a forward whose
    # outputs need autograd after it): the winner then runs plainly, not observed and
    # captured again.
    from fxlite.codegen.runtime.trial import GraphedTrial

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    plain_calls = []

    class Side:
        def __init__(self):
            self.off = None
            self.calls = 0

        def __call__(self, x):
            self.calls += 1
            if self.calls == 4:  # the capture call, as SegmentGraphs gives up
                self.off = off
            return x + 1

        def plain(self, x):
            plain_calls.append(x)
            return x + 1

    decided = []
    trial = GraphedTrial((Side, Side), lambda *a: decided.append(a), warm=5)
    assert [trial(i) for i in range(20)] == [i + 1 for i in range(20)]
    winner = decided[0][3]
    assert plain_calls == ([16, 17, 18, 19] if off else [])
    assert isinstance(winner, Side) is (off is None)


@pytest.mark.parametrize("rewrites", [0, 1, 2])
def test_a_trial_is_not_decided_by_the_compiled_sides_first_calls(monkeypatch, rewrites):
    # The compiled side's first call writes its straight-line forward, and a later call
    # writes it again when its kernels' launches were not all prepared (twice at most):
    # a block holding such a call is left out and run again.
    import time as _time

    from fxlite.codegen.runtime.trial import Trial

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    decided = []

    class Compiled:  # a StraightRunner's count of forwards written
        def __init__(self):
            self.calls = self.writes = 0

        def __call__(self, x):
            self.calls += 1
            if self.calls in (1, 3, 6)[:rewrites + 1]:
                self.writes += 1
                _time.sleep(0.03)
            else:
                _time.sleep(0.001)
            return x + 1

    def recorded(x):
        _time.sleep(0.005)
        return x + 1

    compiled = Compiled()
    trial = Trial(compiled, recorded, lambda *a: decided.append(a))
    for _ in range(8 + 6 * rewrites):  # a void block of one side costs a pair of blocks
        assert not decided
        trial(1)
    assert len(decided) == 1 and decided[0][0], decided
    assert decided[0][1] < 5, decided  # no block with a write was timed
    assert trial.voids == rewrites


def test_void_blocks_are_run_again_a_few_times_only(monkeypatch):
    # A side that writes a forward on every call (its layouts change each time) would
    # leave every block out: after _VOIDS of them the blocks count, and the trial ends.
    import types

    import fxlite.codegen.runtime.trial as trial_module
    from fxlite.codegen.runtime.trial import _VOIDS, Trial

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    now = [0.0]
    monkeypatch.setattr(trial_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    decided = []

    class Writer:
        writes = 0

        def __call__(self, x):
            self.writes += 1
            now[0] += 0.001
            return x

    def recorded(x):
        now[0] += 0.002
        return x

    trial = Trial(Writer(), recorded, lambda *a: decided.append(a))
    calls = 0
    while not decided and calls < 100:
        trial(1)
        calls += 1
    assert decided and decided[0][0] and trial.voids == _VOIDS
    assert calls == 2 + 3 * 2 * (_VOIDS + 1)  # the warm-ups, then _VOIDS + 1 pairs of blocks


def test_a_trial_runs_each_call_once_and_times_blocks_of_calls(monkeypatch):
    # No user call runs a side more than once (an earlier trial ran each timed call of a
    # pure segment three times); the sides are timed over blocks of consecutive calls,
    # and decided after the trial's eighth call when they differ (the user's ninth: the
    # compiled function's first call compiles), so the winner runs from the tenth.
    import time as _time

    from fxlite.codegen.runtime.trial import Trial

    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    order, decided = [], []

    def side(name, seconds):
        def run(x):
            order.append(name)
            _time.sleep(seconds)
            return x + 1
        return run

    trial = Trial(side("compiled", 0.002), side("recorded", 0.006),
                  lambda *a: decided.append((len(order), *a)))
    assert [trial(1) for _ in range(11)] == [2] * 11
    assert order == ["compiled", "recorded"] + ["compiled"] * 3 + ["recorded"] * 3 \
        + ["compiled"] * 3  # warm-ups, a block each, then the winner
    assert len(syncs) == 4  # two a block, none after the decision
    calls, kernels_win, ours, theirs = decided[0]
    assert calls == 8 and kernels_win
    assert 0.002 <= ours / 1e3 < 0.005 and 0.006 <= theirs / 1e3 < 0.012


def test_close_sides_get_a_second_block_each(monkeypatch):
    import types

    import fxlite.codegen.runtime.trial as trial_module
    from fxlite.codegen.runtime.trial import Trial

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    now = [0.0]  # a clock only the sides move: sleeping 5 ms each flaked on a loaded host
    monkeypatch.setattr(trial_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    decided = []

    def side(seconds):
        def run(x):
            now[0] += seconds
            return x
        return run

    trial = Trial(side(0.005), side(0.0052), lambda *a: decided.append(a))
    for call in range(1, 16):
        trial(1)
        assert bool(decided) == (call >= 14), call


@pytest.mark.parametrize("layout_wins", [True, False])
def test_recorded_ops_that_win_race_again_without_their_channels_last_layout(
        monkeypatch, layout_wins):
    # alexnet f32 on an H200: its kernels lost their trial, and its recorded ops, which
    # keep the channels-last convolutions, ran at 0.87x eager's speed. Where the recorded
    # ops win, a second trial races them against the same ops without the rewrite.
    import fxlite.codegen.lower.segment as segment
    from fxlite.codegen.runtime.trial import Trial, choose_runner

    monkeypatch.setenv("FXLITE_TRIAL", "1")
    monkeypatch.setattr(segment, "channels_last_wanted", lambda sample: True)  # (CPU)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 3)).to(DEVICE).eval()
    c = fxlite.compile(model)
    x = rand(2, 3, 9, 9)
    with torch.no_grad():
        c(x)
        seg = c._last[0]
        laid_out, plain = seg.compiled.recorded, seg.compiled.plain
        clones = lambda gm: sum(n.kwargs.get("memory_format") == torch.channels_last  # noqa: E731
                                for n in gm.graph.nodes)
        assert clones(laid_out) >= 2 and clones(plain) == 0
        first = choose_runner(seg, cuda=True, graphed=False)
        assert isinstance(first, Trial)
        first.decide(False, 2.0, 1.0)  # the recorded ops win: the second trial starts
        second = seg.run
        assert isinstance(second, Trial) and not seg.compiled.kernels
        second.decide(layout_wins, *((1.0, 1.5) if layout_wins else (1.5, 1.0)))
        assert seg.compiled.gm is (laid_out if layout_wins else plain)
        assert seg.run is seg.compiled.run
        said = seg.compiled.fallbacks
        assert said[0].startswith("its recorded ops ran faster than its")
        assert any("without channels-last" in f for f in said) is not layout_wins
        for _ in range(3):  # the winner gives eager's values, on fresh inputs too
            y = rand(2, 3, 9, 9)
            torch.testing.assert_close(c(y), model(y))
        torch.testing.assert_close(c(x), model(x))


@pytest.mark.parametrize("layout, graphed", [(False, False), (True, True)])
def test_no_second_trial_without_the_layout_or_under_graphs(monkeypatch, layout, graphed):
    # Without the rewrite there is nothing to race; under CUDA graphs its copies cost no
    # host time, so the recorded ops that won run as they are.
    import fxlite.codegen.lower.segment as segment
    from fxlite.codegen.runtime.segment_graphs import SegmentGraphs
    from fxlite.codegen.runtime.trial import choose_runner

    monkeypatch.setenv("FXLITE_TRIAL", "1")
    monkeypatch.setattr(segment, "channels_last_wanted", lambda sample: layout)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).to(DEVICE).eval()
    c = fxlite.compile(model)
    with torch.no_grad():
        c(rand(2, 3, 9, 9))
    seg = c._last[0]
    assert (seg.compiled.plain is not None) is layout
    choose_runner(seg, cuda=True, graphed=graphed).decide(False, 2.0, 1.0)
    if graphed:
        assert isinstance(seg.run, SegmentGraphs) and seg.run.gm is seg.compiled.gm
    else:
        assert seg.run is seg.compiled.run


def test_a_block_at_sizes_new_to_its_side_is_not_timed(monkeypatch):
    # A Dynamo graph with symbolic sizes gets a new sequence length: the first call of a
    # side at it is slow (a new straight line, Triton compiling for the sizes). Before,
    # such calls fell in the kernels' blocks, and GPT-2's kernels lost 126 ms to 13.7.
    import types

    import fxlite.codegen.runtime.trial as trial_module
    from fxlite.codegen.runtime.trial import Trial

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    now = [0.0]
    monkeypatch.setattr(trial_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    seen: dict[str, set] = {"compiled": set(), "recorded": set()}
    decided = []

    def side(name, steady):
        def run(x, n):
            now[0] += steady if n in seen[name] else 0.1  # a first run at n is slow
            seen[name].add(n)
            return x + n
        return run

    trial = Trial(side("compiled", 0.001), side("recorded", 0.003),
                  lambda *a: decided.append(a))
    lengths = [8, 8, 8, 8, 8, 16, 16, 16, 24, 24, 24] + [8, 16, 24] * 6
    for n in lengths:
        assert trial(torch.zeros(1), n) == n
        if decided:
            break
    assert decided and decided[0][0], decided  # the kernels, faster at every seen size
    assert decided[0][1] < 2 and decided[0][2] < 4


def test_a_compiled_function_says_how_its_trials_ended(monkeypatch):
    # compiled.trials: which side won, after how many of the trial's calls, at what time a
    # call; nothing while the trial runs. (Under the interpreter the kernels are slow, so
    # the recorded ops win.)
    from fxlite.codegen.runtime.trial import TrialResult, choose_runner

    monkeypatch.setenv("FXLITE_TRIAL", "1")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    model = LinearRelu().to(DEVICE).eval()
    c = fxlite.compile(model)
    with torch.no_grad():
        c(rand(4, 8))
        seg = c._last[0]
        seg.run = choose_runner(seg, cuda=True, graphed=False)
        for call in range(1, 11):
            x = rand(4, 8)
            torch.testing.assert_close(c(x), model(x))
            assert len(c.trials) == (call >= 8), call
    (result,) = c.trials
    assert isinstance(result, TrialResult) and result.calls == 8
    assert result.race == "kernels against recorded ops"
    assert result.winner == ("kernels" if result.ms[0] <= result.ms[1] else "recorded ops")
    assert str(result).startswith(f"kernels against recorded ops: {result.winner} won after 8")
    assert (result.winner == "recorded ops") == any("recorded ops ran faster" in f
                                                     for f in c.fallbacks)


def test_a_call_on_trial_computes_its_state_key_once(monkeypatch):
    # On a GPU a call whose straight line is not ready (its segment on trial) missed the
    # fast path and computed the state key a second time, so the walk of the modules
    # meant for every 16th call ran every 8th: on an H200 it landed on vit_b_16's ninth
    # call, the trial's last, with 1-2 ms of host time.
    import fxlite.codegen.capture.guards as guards
    from fxlite.codegen.runtime.trial import choose_runner

    monkeypatch.setenv("FXLITE_TRIAL", "1")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the fast path is on
    keys = []
    real = guards.StateGuard.key
    monkeypatch.setattr(guards.StateGuard, "key", lambda self, *a: keys.append(1) or real(self, *a))
    model = LinearRelu().to(DEVICE).eval()
    c = fxlite.compile(model)
    assert c._fast is not None
    with torch.no_grad():
        c(rand(4, 8))
        seg = c._last[0]
        seg.run = choose_runner(seg, cuda=True, graphed=False)
        for _ in range(5):
            keys.clear()
            x = rand(4, 8)
            torch.testing.assert_close(c(x), model(x))
            assert len(keys) == 1
