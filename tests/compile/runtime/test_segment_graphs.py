"""CUDA graphs for whole segments under ``mode="reduce-overhead"`` (codegen/runtime/segment_graphs.py).

The partition into host nodes and device regions is checked on the CPU; the captures and
replays themselves need a GPU. Each GPU test compares with eager after every call, with
fresh inputs, and checks module state, gradients and optimizer state, not only results.
"""

from __future__ import annotations

from test_compile_training import train_step  # isort: skip  (zero_grad, loss, backward, step)

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fxlite.codegen.runtime.segment_graphs import (
    SegmentGraphs,
    _Region,
    _Runner,
    ambient_node,
    host_node,
    regions,
)

import fxlite

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


class _Net(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        # no bias: before a BatchNorm its gradient is rounding noise, which Adam scales
        # to full steps of either sign, so any other rounding gives other weights
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(p) if p else nn.Identity()
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)), inplace=True)
        return self.fc(self.drop(y.mean((2, 3))))


def _recorded_step_graph():
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    fn = fxlite.compile(train_step, backend="python")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            fn(model, opt, torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
    return fn._last[0].gm


def test_training_step_splits_into_host_nodes_and_one_forward_backward_region():
    gm = _recorded_step_graph()
    nodes = list(gm.graph.nodes)
    host = {n for n in nodes if host_node(n)}
    names = {n.name: n for n in nodes}
    assert all(names[f"setattr_{i}"] in host for i in range(1, 5))  # zero_grad
    step = next(n for n in nodes if "step" in getattr(n.target, "__qualname__", ""))
    assert step in host  # Adam's step counts live on the CPU
    made = regions(nodes, host)
    first = made[0]
    assert any(n.target == "backward" for n in first)
    assert any("conv2d" in n.name for n in first)
    assert all(n not in host for r in made for n in r)
    assert all(nodes.index(r[0]) > nodes.index(step) for r in made[1:])  # stats updates


def test_tensors_from_host_data_are_host_nodes_and_grad_mode_is_ambient():
    def f(x):
        with torch.no_grad():
            y = x * 2
        return y + torch.tensor([1.0, 2.0])

    fn = fxlite.compile(f, backend="python")
    for _ in range(2):
        fn(torch.randn(2))
    nodes = list(fn._last[0].gm.graph.nodes)
    host = [n.name for n in nodes if host_node(n)]
    assert any("tensor" in h for h in host)
    ambient = [n for n in nodes if ambient_node(n)]  # set again after each replay
    assert len(ambient) == 2 and not any(host_node(n) for n in ambient)


def _train(fn, base, data, steps):
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for i in range(steps):
        x, y = data[i % len(data)]
        losses.append(fn(model, opt, x, y))
        grads.append([p.grad for p in model.parameters()])
    return model, opt, losses, grads


def _segment_runner(fn):
    run = fn._last[0].run
    assert isinstance(run, SegmentGraphs), type(run)
    return run


def _net_and_batches(batches: int):
    torch.manual_seed(0)
    data = [(torch.randn(4, 3, 8, 8, device="cuda"), torch.randint(0, 10, (4,), device="cuda"))
            for _ in range(batches)]
    return _Net().cuda(), data



@pytest.mark.parametrize("cxx_guard", [True, False])
def test_a_layout_check_tells_apart_what_the_layout_key_does(cxx_guard, monkeypatch):
    # SegmentGraphs picks a call's captures by this check before computing any key: it
    # must fail wherever the key (shape, strides, dtype, device, or type) would differ.
    import gc
    import weakref

    import torch._C._dynamo.guards as guards
    from fxlite.codegen.capture.guards import LayoutCheck

    if not cxx_guard:  # a torch without the private guard: the key decides alone
        monkeypatch.setattr(guards, "TensorGuards", None)
    x, w = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
    check = LayoutCheck((x, w, 2, None))
    assert check.ok == cxx_guard
    if not cxx_guard:
        return
    assert check((torch.randn(4, 3), torch.randn(3, 5, requires_grad=True), 7, None))
    others = [
        (torch.randn(4, 4), w, 2, None),  # shape
        (torch.randn(3, 4).t(), w, 2, None),  # strides
        (x.double(), w, 2, None),  # dtype
        (x, w.detach(), 2, None),  # requires_grad
        (x, w, 2.0, None),  # a Python value's type
        (x, w, 2),  # count
        (x, 2, w, None),  # a tensor where a number was
    ]
    for args in others:
        assert not check(args), args
    # one tensor given twice (torch's guard refuses it): seen once, and the later place
    # must hold it again
    z = torch.zeros(3)
    twice = LayoutCheck((x, z, z))
    r = torch.randn(3)
    assert twice.ok and twice((torch.randn(4, 3), r, r))
    assert not twice((x, z, torch.zeros(3))) and not twice((x, z, z.double()))
    assert not LayoutCheck((x, z, torch.zeros(3)))((x, z, z))
    # it holds no reference to the tensors it was made from (replays count references)
    ref = weakref.ref(x)
    del x, others, args, twice
    gc.collect()
    assert ref() is None

@cuda
def test_training_step_replays_graphs_and_trains_as_eager():
    base, data = _net_and_batches(3)
    fn = fxlite.compile(train_step, mode="reduce-overhead")
    want = _train(train_step, base, data, 7)
    got = _train(fn, base, data, 7)
    run = _segment_runner(fn)
    assert run.off is None and run.captured >= 1, run.off
    for a, b in zip(got[2], want[2]):  # every loss kept its value (not overwritten later)
        torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-5)
    for ga, gb in zip(got[3], want[3]):  # gradients of every step, each a tensor of its own
        for a, b in zip(ga, gb):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    for a, b in zip(got[0].state_dict().values(), want[0].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # weights and running stats
    sa, sb = got[1].state_dict()["state"], want[1].state_dict()["state"]
    assert [int(s["step"]) for s in sa.values()] == [int(s["step"]) for s in sb.values()]


@cuda
def test_gradients_the_user_keeps_are_not_overwritten_by_the_next_replay():
    base, data = _net_and_batches(2)
    fn = fxlite.compile(train_step, mode="reduce-overhead")
    got, want = _train(fn, base, data, 6), _train(train_step, base, data, 6)
    kept = got[3][4]  # the user held step 5's gradients through step 6
    for a, b in zip(kept, want[3][4]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@cuda
def test_a_gradient_kept_over_a_step_is_not_overwritten_by_the_replay():
    # Regression: a replay's baseline of references was taken while each parameter still
    # held its gradient and a list of ours held them all; after zero_grad a caller's
    # reference to last step's gradient then looked like the parameter's, and a replay
    # could overwrite it (caught before only because the check's own loop variable
    # happened to hold a reference as well).
    base, data = _net_and_batches(3)
    fn = fxlite.compile(train_step, mode="reduce-overhead")
    got, want = copy.deepcopy(base), copy.deepcopy(base)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (got, want)]
    for i in range(16):
        x, y = data[i % len(data)]
        torch.testing.assert_close(fn(got, opts[0], x, y), train_step(want, opts[1], x, y),
                                   rtol=1e-4, atol=1e-5)
        if i in (8, 12):  # keep this step's gradients over the next step
            kept = [p.grad for p in got.parameters()]
            expected = [p.grad.clone() for p in want.parameters()]
        if i in (9, 13):
            for a, b in zip(kept, expected):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
            del kept
    for a, b in zip(got.state_dict().values(), want.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@cuda
def test_dropout_in_a_captured_step_draws_new_masks():
    torch.manual_seed(0)
    model = _Net(p=0.5).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay: only masks differ
    x = torch.randn(4, 3, 8, 8, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")
    fn = fxlite.compile(train_step, mode="reduce-overhead")
    losses = {float(fn(model, opt, x, y)) for _ in range(8)}
    assert len(losses) >= 6


@cuda
def test_inference_with_a_read_and_an_input_written_in_place():
    def f(x, w):
        x.add_(1)
        y = torch.relu(x @ w)
        if x.sum() > 0:
            return y * 2, x.sum()
        return y - 1, x.sum()

    fn = fxlite.compile(f, mode="reduce-overhead")
    w = torch.randn(16, 16, device="cuda")
    for i in range(16):  # both paths get observed, captured and replayed
        x = torch.randn(8, 16, device="cuda") + (2 if i % 3 else -4)
        x2 = x.clone()
        got, want = fn(x, w), f(x2, w)
        torch.testing.assert_close(x, x2)  # the write reached the caller's tensor
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    first = fn._last[0].run
    assert isinstance(first, SegmentGraphs) and first.off is None and first.captured >= 1


# ---------------------------------------------------------------- backward outside the segment
# A compiled module trained by a step the compiler does not see (as inside
# DistributedDataParallel): the forward region's outputs need autograd after it, so its
# backward is captured as a graph of its own (codegen/runtime/graphed_backward.py).


def _module_runner(compiled):
    run = compiled._compiled._last[0].run
    return run if isinstance(run, SegmentGraphs) else None


def _outside_step(model, opt, x, y, accumulate=1):
    """A step whose backward runs outside the compiled module, after ``accumulate``
    forwards (gradient accumulation: their autograd graphs are all alive at once)."""
    opt.zero_grad()
    losses = [F.cross_entropy(model(x[k::accumulate]), y[k::accumulate])
              for k in range(accumulate)]
    sum(losses).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return torch.stack(losses).detach(), grads


def _compare_outside(base, data, steps, trial, monkeypatch, **step_kw):
    monkeypatch.setenv("FXLITE_TRIAL", "1" if trial else "0")
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    compiled = fxlite.compile(model, mode="reduce-overhead")
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    for i in range(steps):
        x, y = data[i % len(data)]
        x = x + 0.01 * i  # a fresh input each step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _outside_step(compiled, opt, x, y, **step_kw)
        want = _outside_step(ref, ref_opt, x, y, **step_kw)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5, msg=f"loss at {i}")
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=f"gradient at {i}")
        torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=1e-3, atol=1e-4,
                                   msg=lambda m: f"weights or running stats after {i}: {m}")
    return compiled


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("trial", [False, True])
def test_a_module_trained_outside_replays_its_forward_and_backward_graphs(trial, monkeypatch):
    base, data = _net_and_batches(3)
    compiled = _compare_outside(base, data, 30, trial, monkeypatch)
    run = _module_runner(compiled)
    assert run is not None and run.off is None and run.captured >= 1, getattr(run, "off", run)
    regions = [r for lay in run.layouts.values() for r in lay.regions]
    assert any(r.back is not None for r in regions)


@pytest.mark.gpu
@cuda
def test_two_forwards_before_one_backward_do_not_share_the_graphs_memory(monkeypatch):
    # The second forward comes while the first's backward is still to come: it must run
    # its nodes, not overwrite the saved tensors the first backward reads.
    base, data = _net_and_batches(2)
    data = [(torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])) for x, y in data]
    compiled = _compare_outside(base, data, 10, False, monkeypatch, accumulate=2)
    run = _module_runner(compiled)
    assert run is not None and run.off is None and run.captured >= 1


@pytest.mark.gpu
@cuda
def test_a_graphed_backward_run_twice_and_gradients_accumulated_over_calls(monkeypatch):
    monkeypatch.setenv("FXLITE_TRIAL", "0")
    base, data = _net_and_batches(2)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    compiled = fxlite.compile(model, mode="reduce-overhead")
    for i in range(8):  # no zero_grad: .grad accumulates over the calls, as in eager
        x = data[i % 2][0] + i
        for m in (compiled, ref):
            loss = m(x).square().mean()
            loss.backward(retain_graph=True)
            loss.backward()  # the same autograd graph a second time
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-4)
    assert _module_runner(compiled).captured >= 1


@pytest.mark.gpu
@cuda
def test_an_input_that_requires_grad_gets_its_gradient_on_every_call(monkeypatch):
    # A fresh leaf input each call (input gradients, adversarial steps): a graph would
    # give the gradient to its own copy of the input, so it must not be captured so.
    monkeypatch.setenv("FXLITE_TRIAL", "0")
    base, data = _net_and_batches(1)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    compiled = fxlite.compile(model, mode="reduce-overhead")
    for i in range(8):
        x = data[0][0] + i
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        compiled(xs[0]).sum().backward()
        ref(xs[1]).sum().backward()
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@cuda
def test_a_parameters_gradient_hook_runs_on_every_backward(monkeypatch):
    monkeypatch.setenv("FXLITE_TRIAL", "0")
    base, data = _net_and_batches(1)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    seen: dict[str, list[float]] = {"got": [], "want": []}
    model.fc.weight.register_hook(lambda g: seen["got"].append(float(g.sum())))
    ref.fc.weight.register_hook(lambda g: seen["want"].append(float(g.sum())))
    compiled = fxlite.compile(model, mode="reduce-overhead")
    for i in range(8):
        x = data[0][0] + i
        compiled(x).sum().backward()
        ref(x).sum().backward()
    assert len(seen["got"]) == 8
    torch.testing.assert_close(seen["got"], seen["want"], rtol=1e-3, atol=1e-4)


class _Block(nn.Module):
    """A pre-norm attention block with a tuple output: the logits and their argmax."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.drop(self.attn(h, h, h, need_weights=False)[0])
        logits = self.head(F.gelu(x)).mean(1)
        return logits, logits.argmax(-1)


def _block_loss(model, x, y):
    logits, picked = model(x)
    return F.cross_entropy(logits, y), picked


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["f32", "bf16_autocast"])
def test_an_attention_block_with_a_tuple_output_trained_outside(monkeypatch, autocast):
    monkeypatch.setenv("FXLITE_TRIAL", "0")
    torch.manual_seed(0)
    base = _Block().cuda()
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    compiled = fxlite.compile(model, mode="reduce-overhead")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-3, atol=1e-4)
    for i in range(12):
        x = torch.randn(4, 8, 16, device="cuda")
        y = torch.randint(0, 10, (4,), device="cuda")
        results = []
        for m, o in ((compiled, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss, picked = _block_loss(m, x, y)
            loss.backward()
            results.append((loss.detach(), picked, [p.grad.clone() for p in m.parameters()]))
            o.step()
        (got, got_pick, got_grads), (want, want_pick, want_grads) = results
        torch.testing.assert_close(got, want, **tol, msg=f"loss at {i}")
        assert got_pick.dtype == want_pick.dtype and not got_pick.requires_grad
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, **tol, msg=f"gradient at {i}")
    run = _module_runner(compiled)
    assert run is not None and run.off is None and run.captured >= 1, getattr(run, "off", run)


@pytest.mark.gpu
@cuda
def test_dropout_in_a_module_trained_outside_draws_new_masks(monkeypatch):
    monkeypatch.setenv("FXLITE_TRIAL", "0")
    torch.manual_seed(0)
    model = _Block(p=0.5).cuda()
    compiled = fxlite.compile(model, mode="reduce-overhead")
    x = torch.randn(4, 8, 16, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")
    losses = set()
    for _ in range(10):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, _ = _block_loss(compiled, x, y)
        loss.backward()  # no optimizer: the weights stay, only the masks differ
        losses.add(float(loss))
    assert len(losses) >= 8
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.gpu
@cuda
def test_two_compiled_modules_chained_under_one_backward(monkeypatch):
    # The second module's input carries the first one's autograd graph: it must not be
    # captured as if it did not (its gradient would never reach the first module).
    monkeypatch.setenv("FXLITE_TRIAL", "0")
    torch.manual_seed(0)
    base = nn.ModuleList([_Net().cuda(), nn.Sequential(nn.Linear(10, 10), nn.ReLU()).cuda()])
    got, want = copy.deepcopy(base), copy.deepcopy(base)
    first, second = (fxlite.compile(m, mode="reduce-overhead") for m in got)
    for i in range(10):
        x = torch.randn(4, 3, 8, 8, device="cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            second(first(x)).square().mean().backward()
        want[1](want[0](x)).square().mean().backward()
        for a, b in zip(got.parameters(), want.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-4, msg=f"call {i}")
    assert _module_runner(first).captured >= 1


def test_a_failed_capture_leaves_the_callers_tensors_for_the_nodes_to_run(monkeypatch):
    # Regression: a capture puts its own copies of changing inputs in the env; when it
    # failed, the region's nodes then ran on those copies, so an in-place write never
    # reached the caller's tensor. (CPU: the capture is made to fail as it starts.)
    def f(x):
        x.add_(1)
        return x * 2

    gm = fxlite.symbolic_trace(f)
    nodes = [n for n in gm.graph.nodes if n.op == "call_method" or n.op == "call_function"]
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")

    @contextlib.contextmanager
    def failing(*args, **kwargs):
        raise RuntimeError("capture failed")
        yield

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", failing)
    runner = _Runner(gm)
    x = torch.zeros(3)
    runner.env = {placeholder: x}
    region = _Region(nodes)
    with pytest.raises(RuntimeError, match="capture failed"):
        region.capture(runner, [False], None)
    assert runner.env[placeholder] is x  # the caller's tensor, not the capture's copy
    runner.run_nodes(region.nodes)
    assert x.tolist() == [1.0, 1.0, 1.0]
