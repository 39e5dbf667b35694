"""``fxlite.compile`` on a GPU (CUDA with the interpreter off): direct launches,
misaligned inputs, graph replays that keep what the caller holds, and the straight-line
fast path. Skipped elsewhere.
"""

from __future__ import annotations

from test_compile import HALF_TOL, native_gpu, one_kernel, relu_add_mul, softmax  # isort: skip

import functools

import pytest
import torch
import torch.nn as nn

import fxlite

GPU_TOL = {torch.float32: {}, torch.float16: HALF_TOL[torch.float16]}


@pytest.mark.gpu
@native_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpu_one_kernel_and_direct_launch(dtype):
    for fn in (relu_add_mul, softmax):
        x = torch.randn(64, 256, device="cuda", dtype=dtype)
        c = one_kernel(fn, x, **GPU_TOL[dtype])
        first = c(x)
        second = c(x)  # same shapes: the prepared direct launch
        assert torch.equal(first, second)
        x2 = torch.randn_like(x)
        torch.testing.assert_close(c(x2), fn(x2), **GPU_TOL[dtype])


@pytest.mark.gpu
@native_gpu
def test_gpu_misaligned_input_after_aligned():
    c = fxlite.compile(relu_add_mul)
    n = 1000
    aligned = torch.randn(n, device="cuda")
    torch.testing.assert_close(c(aligned), relu_add_mul(aligned))
    base = torch.randn(n + 1, device="cuda")
    sliced = base[1:]
    assert sliced.data_ptr() % 16 != 0
    torch.testing.assert_close(c(sliced), relu_add_mul(sliced))
    torch.testing.assert_close(c(aligned), relu_add_mul(aligned))


@pytest.mark.gpu
@native_gpu
def test_gpu_reduce_overhead_keeps_outputs_the_caller_holds():
    c = fxlite.compile(relu_add_mul, mode="reduce-overhead")
    x = torch.randn(32, 32, device="cuda")
    x2 = torch.randn(32, 32, device="cuda")
    want1, want2 = relu_add_mul(x), relu_add_mul(x2)
    y1 = c(x)
    y2 = c(x2)
    torch.testing.assert_close(y1, want1)
    torch.testing.assert_close(y2, want2)
    for _ in range(3):  # repeated replays, outputs dropped each time
        torch.testing.assert_close(c(x), want1)
    # The same input tensor changed in place between calls, earlier outputs kept.
    a = c(x)
    x.add_(1)
    want_b = relu_add_mul(x)
    b = c(x)
    x.mul_(-1)
    want_extra = relu_add_mul(x)
    extra = c(x)  # y1, a and b hold outputs: whatever runs must not overwrite them
    torch.testing.assert_close(a, want1)
    torch.testing.assert_close(b, want_b)
    torch.testing.assert_close(extra, want_extra)
    # A detached alias holds the output's memory, too: a replay must not overwrite it.
    del a, b, extra
    d = c(x).detach()
    x.add_(5)
    e = c(x)
    f = c(x)
    torch.testing.assert_close(d, want_extra)
    torch.testing.assert_close(e, relu_add_mul(x))
    torch.testing.assert_close(f, relu_add_mul(x))
    torch.testing.assert_close(y1, want1)
    torch.testing.assert_close(y2, want2)


@pytest.mark.gpu
@native_gpu
def test_gpu_straight_line_fast_path():
    c = fxlite.compile(relu_add_mul)
    x = torch.randn(64, 256, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(c(x), relu_add_mul(x))
    assert c._fast is not None and len(c._fast) == 1
    for other in (torch.randn(64, 256, device="cuda"), torch.randn(256, 64, device="cuda").t(),
                  torch.randn(64 * 256 + 1, device="cuda")[1:].view(64, 256),
                  torch.randn(3, 5, device="cuda")):
        for _ in range(2):
            torch.testing.assert_close(c(other), relu_add_mul(other))
    with_extern = fxlite.compile(lambda a: torch.relu(a.flatten(1) + 1).cumsum(1))
    for _ in range(3):
        torch.testing.assert_close(with_extern(x), torch.relu(x + 1).cumsum(1))
    assert with_extern._fast is not None and len(with_extern._fast) == 1


@pytest.mark.gpu
@native_gpu
def test_gpu_kernels_keep_no_tensor_of_their_last_call_alive():
    """A kernel remembers its last launch to repeat it directly, but not that launch's
    tensors: it kept a GPT-2 step's logits alive between steps (8 GiB over eager's)."""
    import gc
    import weakref

    def fn(a):
        return torch.relu(a * 2 + 1).sum(1)

    c = fxlite.compile(fn)
    refs = []
    for _ in range(12):  # past the trial: kernels and their direct launches run
        x = torch.randn(64, 256, device="cuda")
        out = c(x)
        torch.testing.assert_close(out, fn(x))
        refs += [weakref.ref(x), weakref.ref(out)]
        del x, out
    gc.collect()
    assert c.kernels and [r for r in refs if r() is not None] == []


@pytest.mark.gpu
@native_gpu
def test_gpu_a_tensors_python_attribute_is_seen_past_the_fast_paths():
    """The straight-line and CUDA-graph shortcuts key layouts only: a tensor argument
    with Python attributes (read by ``hasattr``) takes the general path, which keys them."""
    def fn(x):
        return x * 2 if hasattr(x, "flag") else x * 3

    c = fxlite.compile(fn)
    x = torch.randn(64, 256, device="cuda")
    for step in range(14):
        if step == 11:
            x.flag = True
        torch.testing.assert_close(c(x), fn(x))


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


@pytest.mark.gpu
@native_gpu
def test_gpu_straight_line_with_convs_and_parameters(monkeypatch):
    # Extern ops (conv, linear) and parameters' per-channel views no longer keep a model
    # off the straight-line path; what it binds once must still follow the parameters.
    monkeypatch.setenv("FXLITE_TRIAL", "0")  # the kernels run, whatever a trial would say
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    close = functools.partial(torch.testing.assert_close, rtol=1e-4, atol=1e-4)  # conv algos
    m = _ConvBN().cuda().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
    c = fxlite.compile(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8, 12, 12, device="cuda")
            close(c(x), m(x))
        assert c._fast is not None and len(c._fast) == 1
        m.bn.weight.mul_(-2)              # in place: seen through the views bound once
        close(c(x), m(x))
        m.bn.bias.data = torch.randn(16, device="cuda")  # new memory: a new function
        close(c(x), m(x))
        close(c(x), m(x))
        assert len(c._fast) == 1  # the same key, rewritten


@pytest.mark.gpu
@native_gpu
def test_gpu_straight_line_runs_a_function_returning_none_once(monkeypatch):
    monkeypatch.setenv("FXLITE_TRIAL", "0")
    def accumulate(x, total):
        total.add_(torch.relu(x) * 2)

    c = fxlite.compile(accumulate)
    x = torch.randn(64, 32, device="cuda")
    total, want = torch.zeros_like(x), torch.zeros_like(x)
    for _ in range(5):
        assert c(x, total) is None
        accumulate(x, want)
        torch.testing.assert_close(total, want)


class _Scaled(nn.Module):
    """Floats Dynamo passes as 0-d tensors with dynamic=True (eps, scale)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.eps, self.scale = 1e-5, 0.5

    def forward(self, x):
        B, T, C = x.shape
        h = torch.nn.functional.layer_norm(self.lin(x.view(B * T, C)), (C,), eps=self.eps)
        return torch.relu(h).view(B, T, C) * self.scale


@pytest.mark.gpu
@native_gpu
def test_gpu_dynamo_graph_takes_the_straight_line_with_sizes_and_keyed_floats(monkeypatch):
    # A graph of fxlite.compile(dynamic=True) takes sizes, parameters and 0-d float tensors:
    # its calls take the straight line, one per layout, keyed by those floats' values.
    monkeypatch.setenv("FXLITE_TRIAL", "0")
    m = _Scaled().cuda()
    c = fxlite.compile(m, dynamic=True)
    for i, T in enumerate([8, 16, 8, 16, 8, 24, 8]):
        if i == 4:
            m.scale = 2.0  # a new value: not the straight line made for 0.5
        x = torch.randn(2, T, 32, device="cuda")
        torch.testing.assert_close(c(x), m(x))
        assert c.kernels
    (graph,) = c._compiled._graphs
    assert graph._fast and len(graph._fast) >= 2
    assert len({k.values for k in graph._fast}) == 2


class _Counted(torch.nn.Module):
    """Counts its calls in a buffer, as a module tracking its batches does."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), device="cuda"))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(x) * self.calls


@pytest.mark.gpu
@native_gpu
def test_gpu_reduce_overhead_first_replayed_call_writes_once():
    # Regression: a call captured for replay ran once as the capture's warm-up and once
    # more as the capture's first replay, so a buffer it counts up moved twice.
    model, ref = _Counted(), _Counted()
    c = fxlite.compile(model, mode="reduce-overhead")
    x = torch.randn(8, 8, device="cuda")
    for i in range(6):
        torch.testing.assert_close(c(x), ref(x), msg=f"call {i}")
        assert float(model.calls) == float(ref.calls) == i + 1
