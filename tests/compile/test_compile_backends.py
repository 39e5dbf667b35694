"""``fxlite.compile``'s backends and forms: a custom backend called once per guard key,
the Python backend, the decorator forms, refused modes and backends, and the keys and
liveness checks of ``mode="reduce-overhead"``'s CUDA graph replays.

Split from test_compile.py, whose helpers and autouse fixture it imports.
"""

from __future__ import annotations

from test_compile import cpu_interpreter, rand, relu_add_mul  # isort: skip  (sets up the interpreter)
from test_compile import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import pytest
import torch

pytest.importorskip("triton")

from fxlite.codegen.runtime.cudagraphs import GraphReplays, _Captured

import fxlite

# Masked lanes of the interpreter compute on padding (log(0), x / 0): harmless, but noisy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------------------ backends and forms
def test_custom_backend_is_called_once_per_guard_key():
    seen, examples = [], []

    def my_backend(gm, example_inputs):
        seen.append(gm.code)
        examples.append(example_inputs)
        return gm.forward

    def fn(x, y):
        return torch.relu(x + y) * 2

    c = fxlite.compile(fn, backend=my_backend)
    x, y = rand(4, 8), rand(4, 8)
    torch.testing.assert_close(c(x, y), fn(x, y))
    assert len(seen) == 1 and "relu" in seen[0]
    assert len(examples[0]) == 2 and examples[0][0] is x and examples[0][1] is y
    x2, y2 = rand(6, 3), rand(6, 3)  # same rank and dtype: the same guard key
    torch.testing.assert_close(c(x2, y2), fn(x2, y2))
    assert len(seen) == 1
    xd = x.double()  # a new dtype: a new key
    torch.testing.assert_close(c(xd, y), fn(xd, y))
    assert len(seen) == 2 and examples[1][0] is xd


def test_python_backend():
    c = fxlite.compile(relu_add_mul, backend="python")
    x = rand(4, 8)
    torch.testing.assert_close(c(x), relu_add_mul(x))
    assert c.kernels == [] and "torch.relu" in c.code


def test_decorator_forms_keep_the_name():
    @fxlite.compile
    def plain(x):
        return x * 2 + 1

    @fxlite.compile(backend="python")
    def configured(x):
        return x - 3

    x = rand(4, 8)
    torch.testing.assert_close(plain(x), x * 2 + 1)
    torch.testing.assert_close(configured(x), x - 3)
    assert plain.__name__ == "plain" and configured.__name__ == "configured"
    assert len(plain.kernels) == 1 and configured.kernels == []


def test_bad_mode_and_backend_raise():
    with pytest.raises(ValueError, match="bogus"):
        fxlite.compile(relu_add_mul, mode="bogus")
    with pytest.raises(ValueError, match="bogus"):
        fxlite.compile(relu_add_mul, backend="bogus")
    with pytest.raises(ValueError):
        fxlite.compile(mode="bogus")(relu_add_mul)


@cpu_interpreter
def test_reduce_overhead_on_cpu_is_like_default():
    c = fxlite.compile(relu_add_mul, mode="reduce-overhead")
    x = rand(4, 8)
    for _ in range(3):
        torch.testing.assert_close(c(x), relu_add_mul(x))
    assert len(c.kernels) == 1 and c.fallbacks == []
    assert c._graphs is None or len(c._graphs) == 0  # CUDA graphs: CUDA tensors only


def test_graph_replay_keys_hold_what_a_replay_depends_on():
    x = rand(4, 8)
    key = GraphReplays.key((x, 2), ())
    assert key == GraphReplays.key((x, 2), ())
    assert key != GraphReplays.key((x.clone(), 2), ())          # another address
    assert key != GraphReplays.key((x.view(8, 4), 2), ())       # same address, other shape
    assert key != GraphReplays.key((x.t(), 2), ())              # other strides
    assert key != GraphReplays.key((x.view(torch.int32), 2), ())  # other dtype
    assert key != GraphReplays.key((x, 3), ())                   # another scalar value
    assert key != GraphReplays.key((x, 2), (False,))             # train/eval flags
    with torch.no_grad():
        assert key != GraphReplays.key((x, 2), ())               # grad mode
    assert GraphReplays.key((x, [1, 2]), ()) is None             # a list: never replayed
    graphs = GraphReplays()
    assert graphs.replay(key) is GraphReplays.MISS and graphs.replay(None) is GraphReplays.MISS
    cpu = torch.randn(4, 8)
    out = graphs.run(GraphReplays.key((cpu,)), relu_add_mul, (cpu,))  # CPU: no capture
    torch.testing.assert_close(out, relu_add_mul(cpu))
    assert len(graphs) == 0


def test_graph_replay_sees_detached_and_viewed_outputs():
    # The test of whether a captured graph's outputs are still held by the caller.
    cap = _Captured.__new__(_Captured)
    cap.outputs = torch.randn(4)
    cap.flat = [cap.outputs]
    cap.watch()
    assert cap.free()
    for hold in (lambda t: t, lambda t: t[1:], lambda t: t.detach()):
        kept = hold(cap.outputs)
        assert not cap.free()
        del kept
        assert cap.free()
