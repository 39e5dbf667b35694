"""Capture for fxlite.compile: ordinary Python, graph breaks that keep compiling, explain,
export and fullgraph (the compile tutorial's examples, then the wider cases).

Each compiled function is called several times with inputs that take different paths,
and compared with eager PyTorch every time.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("triton")

import fxlite.codegen.compile as compile_mod
from fxlite.codegen.runtime.kernel import interpreting

import fxlite

DEVICE = "cpu" if interpreting() else "cuda"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(compile_mod, "_warned", set())


@pytest.fixture
def recordings(monkeypatch):
    """The recordings fxlite.compile made (a new key or a new path): the read each one
    started from (None for a whole new recording). Calls that only finish eagerly after
    the recompile limit are not recordings."""
    seen, real = [], compile_mod.record

    def counting(fn, *args, **kwargs):
        if kwargs.get("record_rest", True):
            seen.append(kwargs.get("upto"))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(compile_mod, "record", counting)
    return seen


def rand(*shape):
    return torch.randn(*shape, device=DEVICE)


def line_of(fn, text):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, s in enumerate(lines) if text in s)


# ------------------------------------------------------------------ the tutorial
def f1(x, y):
    if x.sum() < 0:
        return -y
    return y


def bar(a, b):
    x = a / (torch.abs(a) + 1)
    if b.sum() < 0:
        b = b * -1
    return x * b


def bar_fixed(a, b):
    x = a / (torch.abs(a) + 1)

    def true_branch(y):
        return y * -1

    def false_branch(y):
        return y.clone()  # torch.cond does not allow aliased outputs

    x = torch.cond(b.sum() < 0, true_branch, false_branch, (b,))
    return x * b


def f2(x, y):
    return x + y


def test_f1_is_right_on_each_branch_in_alternation():
    c = fxlite.compile(f1)
    x, y = rand(5, 5), rand(5, 5)
    for sign in (1, -1, 1, -1, -1, 1):
        torch.testing.assert_close(c(sign * x, y), f1(sign * x, y))


def test_bar_runs_kernels_on_both_branches(recordings):
    c = fxlite.compile(bar)
    a, b = rand(10), rand(10).abs() + 0.1
    for sign in (1, -1, 1, -1):
        torch.testing.assert_close(c(a, sign * b), bar(a, sign * b))
        assert len(c.kernels) >= 2 and c.fallbacks == []  # before and after the break
    assert len(recordings) == 2  # one recording per branch, then replays


def test_explain_bar_reports_the_break_and_its_line():
    report = fxlite.explain(bar, rand(10), rand(10))
    assert report.graph_count >= 2 and report.graph_break_count == 1
    reason = report.break_reasons[0]
    assert reason.line == line_of(bar, "if b.sum() < 0") and reason.file == __file__
    assert reason.source == "if b.sum() < 0:"
    text = str(report)
    assert "if b.sum() < 0:" in text and "graph breaks: 1" in text
    assert len(report.ops_per_graph) == report.graph_count
    assert any("torch.abs" in op for op in report.ops_per_graph[0])
    assert report.guards and "<table>" in report._repr_html_()


def test_fullgraph_bar_raises_at_the_line():
    with pytest.raises(fxlite.TraceError) as info:
        fxlite.compile(bar, fullgraph=True)(rand(10), rand(10))
    text = str(info.value)
    assert f"line {line_of(bar, 'if b.sum() < 0')}" in text and "if b.sum() < 0:" in text
    assert "torch.cond" in text and "torch.where" in text


def test_bar_fixed_compiles_as_one_graph_under_fullgraph():
    c = fxlite.compile(bar_fixed, fullgraph=True)
    a, b = rand(10), rand(10).abs() + 0.1
    for sign in (1, -1, -1, 1):
        torch.testing.assert_close(c(a, sign * b), bar_fixed(a, sign * b))
        # b.sum() < 0, y * -1, y.clone(), x * b
        assert len(c.kernels) == 4 and c.fallbacks == []
    report = fxlite.explain(bar_fixed, a, b)
    assert report.graph_count == 1 and report.graph_break_count == 0


def test_f2_retraces_when_its_int_changes(recordings):
    c = fxlite.compile(f2)
    x = rand(5, 5)
    for y in (3, 3, 4, 3, 4):
        torch.testing.assert_close(c(x, y), f2(x, y))
    assert len(recordings) == 2


# ------------------------------------------------------------------ ordinary Python
def doubles(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) * 2
    return wrapper


@doubles
def decorated(x):
    return torch.relu(x)


def test_decorators_keep_their_ops():
    c = fxlite.compile(decorated)
    for _ in range(3):
        x = rand(6)
        torch.testing.assert_close(c(x), torch.relu(x) * 2)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux: dict
    note: str = "ok"


def test_dataclass_and_dict_outputs():
    def heads(x):
        return Output(x * 2, {"sum": x.sum(-1), "n": 3})

    c = fxlite.compile(heads)
    for _ in range(3):
        x = rand(2, 4)
        out = c(x)
        assert isinstance(out, Output) and out.note == "ok" and out.aux["n"] == 3
        torch.testing.assert_close(out.logits, x * 2)
        torch.testing.assert_close(out.aux["sum"], x.sum(-1))


class TrainOnlyNoise(nn.Module):
    def forward(self, x):
        if self.training:
            return F.dropout(x, 0.5) * 0 + x + 1
        return x - 1


def test_self_training_branches_follow_the_flag():
    m = TrainOnlyNoise()
    c = fxlite.compile(m)
    x = rand(4)
    for mode in (True, False, True, False):
        m.train(mode)
        torch.testing.assert_close(c(x), x + 1 if mode else x - 1)


def test_a_loop_whose_trip_count_comes_from_item(recordings):
    def repeat_double(x, n):
        for _ in range(int(n.item())):
            x = x * 2
        return x

    c = fxlite.compile(repeat_double)
    x = rand(3)
    for n in (2, 3, 2, 0, 3):
        torch.testing.assert_close(c(x, torch.tensor(n)), x * 2**n)
    assert len(recordings) == 3  # one path per trip count


def test_early_returns_and_nested_branches_cache_each_path(recordings):
    def nested(x, y):
        if x.sum() > 0:
            if y.sum() > 0:
                return x + y
            return x - y
        if y.mean() > 0:
            return x * y
        return torch.relu(x) + 1

    c = fxlite.compile(nested)
    x, y = rand(4).abs() + 0.1, rand(4).abs() + 0.1
    cases = [(x, y), (x, -y), (-x, y), (-x, -y)]
    for xx, yy in cases + cases[::-1] + cases:
        torch.testing.assert_close(c(xx, yy), nested(xx, yy))
    assert len(recordings) == 4  # each of the four paths recorded once


def test_too_many_paths_warn_once_naming_the_read_then_run_eagerly(recordings):
    def by_value(x, n):
        return x * int(n.item())

    c = fxlite.compile(by_value)
    x = rand(3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for n in range(12):
            torch.testing.assert_close(c(x, torch.tensor(n)), x * n)
    ours = [str(w.message) for w in record if "recompile_limit" in str(w.message)]
    assert len(ours) == 1 and f"line {line_of(by_value, 'n.item()')}" in ours[0]
    assert len(recordings) == compile_mod.CompiledFunction.recompile_limit


def test_export_returns_one_graph_module_and_refuses_breaks():
    gm = fxlite.export(lambda x, y: {"s": torch.relu(x + y), "k": 3}, rand(3), rand(3))
    x, y = rand(3), rand(3)
    out = gm(x, y)
    assert out["k"] == 3 and "relu" in gm.code
    torch.testing.assert_close(out["s"], torch.relu(x + y))
    with pytest.raises(fxlite.TraceError, match="if b.sum"):
        fxlite.export(bar, rand(10), rand(10))


# ------------------------------------------------------------------ real models
transformers = pytest.importorskip("transformers")


def tiny(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                      vocab_size=100, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2Model(cfg).eval().to(DEVICE)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=100,
                                  max_position_embeddings=64)
    return transformers.BertModel(cfg).eval().to(DEVICE)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_tiny_hugging_face_models_compile_into_kernels(kind):
    model = tiny(kind)
    c = fxlite.compile(model)
    padded = torch.ones(2, 8, dtype=torch.long, device=DEVICE)
    padded[1, 6:] = 0
    full = torch.ones(2, 8, dtype=torch.long, device=DEVICE)
    with torch.no_grad():
        for mask in (padded, full, padded):
            ids = torch.randint(0, 100, (2, 8), device=DEVICE)
            got, want = c(ids, attention_mask=mask), model(ids, attention_mask=mask)
            torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
            assert type(got) is type(want)
            assert len(c.kernels) >= 5 and c.fallbacks == [], c.tier
            if kind == "gpt2":  # its KV cache is this call's (a regression: the first's)
                for mine, theirs in zip(got.past_key_values.layers, want.past_key_values.layers):
                    torch.testing.assert_close(mine.keys, theirs.keys)
                    torch.testing.assert_close(mine.values, theirs.values)


# ------------------------------------------------------------------ bugs the soak test found
def test_a_new_path_sees_in_place_writes_made_before_the_read():
    # Fast-forwarding to the read must hand Python the written tensor, not a stand-in for
    # the value before the write (they are one object in eager).
    def written(x):
        h = x[:, torch.arange(3, -1, -1, device=x.device)]
        h.mul_(0.5)
        if x.sum() > 0:
            return h * 2
        return h - 1

    c = fxlite.compile(written)
    x = rand(3, 4).abs() + 0.1
    for xx in (x, -x, x, -x):
        torch.testing.assert_close(c(xx), written(xx))


def test_a_new_path_after_train_mode_batch_norm():
    # batch_norm writes its running statistics but returns a new tensor: fast-forwarding
    # must return that result, not the tensor it wrote.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            h = self.bn(x)
            for _ in range(int((x > 0).sum().item()) % 3):
                h = h * 1.5
            return h

    import copy

    m = Net().to(DEVICE)
    ref = copy.deepcopy(m)
    c = fxlite.compile(m)
    with torch.no_grad():
        for n_pos in (2, 3, 4, 3):  # 2, 0, 1, 0 loop trips
            x = -rand(6, 4).abs() - 0.1
            x.view(-1)[:n_pos] *= -1
            torch.testing.assert_close(c(x), ref(x))
            torch.testing.assert_close(m.state_dict(), ref.state_dict())


def test_too_many_keys_warn_once_naming_the_failing_guard():
    def scaled(x, alpha):
        return x * alpha

    c = fxlite.compile(scaled)
    x = rand(3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for alpha in range(12):  # an int: it may pick sizes or paths, so it stays guarded
            torch.testing.assert_close(c(x, alpha), x * alpha)  # (a float is followed:
    ours = [str(w.message) for w in record if "recompile_limit" in str(w.message)]  # b2f0cc5)
    assert len(ours) == 1 and "argument 1's value (now 8)" in ours[0]


# ------------------------------------------------------------------ reads the key fixes
def from_positions(x):
    pos = torch.arange(x.shape[1], device=x.device)  # GPT-2's position ids
    gaps = torch.diff(pos, prepend=pos[:1] - 1) != 1
    if gaps.any():  # a function of x's size alone: no break, no wait for the GPU
        return x * 2
    if pos.sum() > 10:
        return x - 1
    return x + 1


def test_a_read_of_values_made_from_sizes_alone_does_not_break(recordings):
    c = fxlite.compile(from_positions)
    for cols in (3, 6, 3, 6, 5):  # sums 3, 15, 3, 15, 10: both outcomes of the 2nd read
        x = rand(2, cols)
        torch.testing.assert_close(c(x), from_positions(x))
        assert [seg.read for seg in c._last] == [None]  # one segment, no read
        assert len(c.kernels) == 1 and c.fallbacks == []
    assert recordings == [None, None, None]  # one recording per size, none per read


def test_a_read_that_depends_on_an_input_or_a_random_draw_still_breaks(recordings):
    def mixed(x):
        pos = torch.arange(x.shape[1], device=x.device)
        if (pos * x).sum() > 0:  # the input's values: a real break
            return x * 2
        return x + 1

    def drawn(x):
        if torch.rand(1, device=x.device).item() > 0.5:  # random: read every call
            return x * 2
        return x + 1

    c = fxlite.compile(mixed)
    x = rand(2, 4).abs() + 0.1
    for xx in (x, -x, x):
        torch.testing.assert_close(c(xx), mixed(xx))
    assert c._last[0].read is not None
    c = fxlite.compile(drawn)
    seen = set()
    for seed in range(8):
        torch.manual_seed(seed)
        got = c(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, drawn(x))
        seen.add(bool(torch.equal(got, x * 2)))
    assert seen == {True, False}


def test_layout_copies_share_memory_as_the_tensors_do_and_copy_only_what_they_span():
    """The checks' snapshots of tensors that share memory (a buffer and its view) share one
    copy of it, so that a write through one shows in the other (fuzz seed 12006268); the
    copy spans the bytes they reach, not their whole storage (two small views of a large
    tensor copy those views' bytes)."""
    from fxlite.codegen.capture.records import layout_copies

    big = torch.arange(1000, dtype=torch.float32)
    a, b, c = big[10:20], big[15:30].view(3, 5), big.view(torch.int32)[12:14]
    alone = torch.ones(3)
    ca, cb, cc, calone = layout_copies([a, b, c, alone])
    for copy, t in ((ca, a), (cb, b), (cc, c), (calone, alone)):
        assert torch.equal(copy, t) and copy.stride() == t.stride() and copy.dtype == t.dtype
    assert ca.untyped_storage().data_ptr() == cb.untyped_storage().data_ptr() \
        == cc.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert ca.untyped_storage().nbytes() == 20 * 4  # elements 10 to 29
    ca += 1
    assert torch.equal(cb.flatten()[:5], a[5:] + 1) and torch.equal(a, big[10:20])
    z = torch.randn(4, dtype=torch.complex64)
    cz, cconj = layout_copies([z, z.conj()])  # a flag, not bytes: copies of their own
    assert torch.equal(cz, z) and torch.equal(cconj.resolve_conj(), z.conj().resolve_conj())
