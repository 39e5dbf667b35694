"""A compiled training step takes Adam, AdamW and SGD steps with torch's fused kernels
(``codegen/lower/optimizer_steps.py``), and eagerly whenever it cannot do so exactly.

Each test trains a compiled copy and an eager copy side by side for several steps and
compares parameters, optimizer state and step counts after every step."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fxlite

from test_compile_training import train_step  # isort: skip  (zero_grad, loss, backward, step)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(),
                         nn.Linear(16, 3)).to(DEVICE)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of torch's fused optimizer kernels."""
    calls: list[str] = []
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_"):
        orig = getattr(torch, name)

        def counting(*args, _orig=orig, _name=name, **kwargs):
            calls.append(_name)
            return _orig(*args, **kwargs)
        monkeypatch.setattr(torch, name, counting)
    return calls


def train_side_by_side(make_opt, steps=5, backend="python", between=None):
    model = mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model), make_opt(ref)
    step = fxlite.compile(train_step, backend=backend)
    torch.manual_seed(1)
    for i in range(steps):
        x = torch.randn(8, 6, device=DEVICE)
        y = torch.randint(0, 3, (8,), device=DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback, no warning of any kind
            loss = step(model, opt, x, y)
        want = train_step(ref, ref_opt, x, y)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=f"loss at step {i}")
        torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"parameters after step {i}: {m}")
        torch.testing.assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"state after step {i}: {m}")
        if between is not None:
            between(i, opt, ref_opt)
    return step, opt


OPTIMIZERS = {
    "adam": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), "_fused_adam_"),
    "adam_amsgrad_wd_maximize": (lambda m: torch.optim.Adam(
        m.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.1, maximize=True), "_fused_adam_"),
    "adamw": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), "_fused_adamw_"),
    "adam_foreach_off": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False),
                         "_fused_adam_"),
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "_fused_sgd_"),
    "sgd_nesterov": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                               nesterov=True, weight_decay=0.01),
                     "_fused_sgd_"),
    "sgd_dampening": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5,
                                                dampening=0.3), "_fused_sgd_"),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_steps_take_fused_optimizer_steps_equal_to_eager(name, fused_calls):
    make_opt, kernel = OPTIMIZERS[name]
    calls_after = []
    step, opt = train_side_by_side(make_opt, steps=6,
                                   between=lambda i, o, r: calls_after.append(len(fused_calls)))
    # the first steps record and compile (eagerly: the first creates the state); from
    # then on every step is one fused call (one device, one dtype)
    assert set(fused_calls) == {kernel}
    assert calls_after[-4:] == [calls_after[-4] + k for k in range(4)] and calls_after[-4] >= 1
    counts = {float(s["step"]) for s in opt.state.values() if "step" in s}
    assert counts in ({6.0}, set())  # the CPU step counts advanced as eager's do


def test_a_step_hook_or_a_tensor_learning_rate_runs_the_optimizers_own_step(fused_calls):
    seen = []

    def make(m):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        opt.register_step_post_hook(lambda o, a, k: seen.append(o))
        return opt

    train_side_by_side(make, steps=3)
    assert fused_calls == [] and len(seen) == 6  # hooks ran on every step of both copies
    train_side_by_side(lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2)),
                       steps=3)
    assert fused_calls == []


def test_state_loaded_between_calls_is_followed(fused_calls):
    """Loading a state dict (new step counts and moments) between compiled steps: the
    fused steps continue from the loaded counts, as eager's own step would."""
    saved = {}

    def between(i, opt, ref_opt):
        if i == 1:
            saved["opt"], saved["ref"] = (copy.deepcopy(o.state_dict()) for o in (opt, ref_opt))
        if i == 3:  # roll both back two steps
            opt.load_state_dict(saved["opt"])
            ref_opt.load_state_dict(saved["ref"])

    step, opt = train_side_by_side(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
                                   steps=6, between=between)
    assert {float(s["step"]) for s in opt.state.values()} == {4.0}
    assert len(fused_calls) == 4  # steps 3 to 6 (the first two record and compile)


def test_the_triton_backend_takes_the_fused_steps_too(fused_calls):
    pytest.importorskip("triton")
    from fxlite.codegen.runtime.kernel import interpreting

    if DEVICE == "cpu" and not interpreting():
        pytest.skip("kernels need a GPU or TRITON_INTERPRET=1")
    train_side_by_side(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), steps=4,
                       backend="triton")
    assert fused_calls == ["_fused_adamw_"] * 2  # steps 3 and 4


def test_adam_under_a_learning_rate_scheduler_compiles_and_follows_the_schedule(fused_calls):
    """A scheduler wraps ``opt.step`` in an instance attribute; the step still records as
    one call (it used to be recorded op by op, and its replay failed: eager whole)."""

    def step_fn(model, opt, sched, x, y):
        loss = train_step(model, opt, x, y)
        sched.step()
        return loss

    model = mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (opt, ref_opt))
    compiled = fxlite.compile(step_fn, backend="python")
    for i in range(5):
        x = torch.randn(8, 6, device=DEVICE)
        y = torch.randint(0, 3, (8,), device=DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss = compiled(model, opt, sched, x, y)
        torch.testing.assert_close(loss, step_fn(ref, ref_opt, ref_sched, x, y))
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** (i + 1)
        torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-6)
        assert getattr(opt.step, "_wrapped_by_lr_sched", False)  # the scheduler's, as before
    assert compiled.fallbacks == [] and fused_calls == ["_fused_adam_"] * 3


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_a_fused_step_follows_what_changes_between_steps(kind, fused_calls):
    """``FusedStep`` keeps its tensor lists between calls: each change below must be seen
    (gradients appearing and disappearing, new gradient tensors, a written step count, a
    replaced moment, a new parameter group, a changed learning rate)."""
    from fxlite.codegen.lower.optimizer_steps import FusedStep

    torch.manual_seed(0)
    params = [torch.randn(5, device=DEVICE, requires_grad=True) for _ in range(4)]
    ref = [p.detach().clone().requires_grad_() for p in params]
    make = (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True)) if kind == "adam" \
        else (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    opt, ref_opt = make(params), make(ref)
    step = FusedStep(opt.step)

    def both(grads):
        for ps in (params, ref):
            for p, g in zip(ps, grads):
                p.grad = None if g is None else g.clone()
        step()
        ref_opt.step()
        # fused kernels work out Adam's bias corrections in float32 (eager: float64)
        torch.testing.assert_close(params, ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=1e-4, atol=1e-5)

    def grads(*alive):
        return [torch.randn(5, device=DEVICE) if i in alive else None for i in range(4)]

    both(grads(0, 1, 2, 3))  # creates the state: eager
    both(grads(0, 1, 2, 3))
    both(grads(0, 2))  # two parameters without gradients: skipped, as eager skips them
    both(grads(0, 1, 2, 3))  # parameter 3 has state, parameter 1 too: all fused again
    name = "step" if kind == "adam" else "momentum_buffer"
    for o in (opt, ref_opt):  # someone writes a count or buffer in place
        o.state[o.param_groups[0]["params"][0]][name].mul_(2 if kind == "sgd" else 1).add_(3)
    both(grads(0, 1, 2, 3))
    for o in (opt, ref_opt):  # and replaces a state tensor
        slot = o.state[o.param_groups[0]["params"][1]]
        key = "exp_avg" if kind == "adam" else "momentum_buffer"
        slot[key] = slot[key] * 0.5
    both(grads(0, 1, 2, 3))
    for o in (opt, ref_opt):
        o.param_groups[0]["lr"] = 0.05
    both(grads(0, 1, 2, 3))
    extra = torch.randn(3, device=DEVICE, requires_grad=True)
    extra_ref = extra.detach().clone().requires_grad_()
    opt.add_param_group({"params": [extra]})
    ref_opt.add_param_group({"params": [extra_ref]})
    params.append(extra)
    ref.append(extra_ref)
    both([*grads(0, 1, 2, 3), torch.randn(3, device=DEVICE)])  # the new group's first: eager
    both([*grads(0, 1, 2, 3), torch.randn(3, device=DEVICE)])
    assert len(fused_calls) >= 6


@pytest.mark.parametrize("change", ["gradient", "parameter"])
def test_a_layout_changed_after_fused_steps_takes_the_optimizers_own_step(change,
                                                                          fused_calls):
    """The plan checks each step's new gradients (and the parameters) against the last
    layouts that passed with torch's C++ guard: a later gradient laid out unlike its
    parameter (a transposed one), or a parameter given another layout (``p.data = ...``),
    must fail that guard and then the plan's own check, and the step runs eagerly; the
    next plain step is fused again."""
    from fxlite.codegen.lower.optimizer_steps import FusedStep

    torch.manual_seed(0)
    params = [torch.randn(4, 6, device=DEVICE, requires_grad=True) for _ in range(3)]
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = (torch.optim.Adam(ps, lr=0.1) for ps in (params, ref))
    step = FusedStep(opt.step)

    def both(odd: bool) -> None:
        grads = [torch.randn(4, 6, device=DEVICE) for _ in params]
        if odd and change == "gradient":
            grads[1] = torch.randn(6, 4, device=DEVICE).t()  # strides (1, 6), not (6, 1)
        for ps in (params, ref):
            for p, g in zip(ps, grads):
                p.grad = g.clone(memory_format=torch.preserve_format)
        before = len(fused_calls)
        step()
        ref_opt.step()
        assert len(fused_calls) == before + (not odd), (odd, fused_calls)
        torch.testing.assert_close(params, ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=1e-4,
                                   atol=1e-5)

    both(odd=True)  # creates the state: eager
    both(odd=False)
    both(odd=False)
    if change == "parameter":
        with torch.no_grad():
            params[2].data = params[2].detach().t().contiguous().t()  # strides (1, 4)
    both(odd=True)
    if change == "parameter":
        with torch.no_grad():
            params[2].data = params[2].detach().contiguous()
    both(odd=False)
    both(odd=False)


def test_parameters_made_double_between_steps_keep_float_moments_as_eager():
    # model.double() converts the parameters in place but not SGD's momentum buffers,
    # which eager's step accepts: the fused plan (float32 moments) raised from then on
    # (probe of session 30)
    model = mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    step = fxlite.compile(train_step)
    torch.manual_seed(1)
    for i in range(6):
        if i == 3:
            model.double(), ref.double()
        dtype = torch.float64 if i >= 3 else torch.float32
        x = torch.randn(8, 6, device=DEVICE, dtype=dtype)
        y = torch.randint(0, 3, (8,), device=DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = step(model, opt, x, y)
        torch.testing.assert_close(loss, train_step(ref, ref_opt, x, y), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-6)


def _sliced_step(w, opt, x, g=None):
    if g is None:
        (w * x).sum().backward()
    else:
        w.grad = g  # a gradient of the caller's layout
    opt.step()
    opt.zero_grad()
    return w.sum(-1) * 1.0


@pytest.mark.parametrize("kind", ["sliced", "channels_last_with_a_row_major_gradient"])
@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.5),
                                  lambda p: torch.optim.Adam([p], lr=0.1)], ids=["sgd", "adam"])
def test_parameters_torchs_fused_kernels_step_wrong_take_the_optimizers_own_step(
        kind, make, fused_calls):
    """Before: a sliced parameter (``w[..., ::2]``, a leaf) took torch's fused kernels
    from the third call on, which walk memory flat (``_fused_sgd_`` left a sliced
    parameter as it was), and so did a channels-last one given a row-major gradient
    (stepped with the gradient's elements in the wrong places). No check saw it (the
    step is the optimizer's effect) and no warning came."""
    torch.manual_seed(0)
    if kind == "sliced":
        base = torch.randn(2, 3, 2, 8, device=DEVICE)
        p = base[..., ::2].detach().requires_grad_()
    else:
        p = torch.randn(2, 3, 2, 4, device=DEVICE).contiguous(
            memory_format=torch.channels_last).requires_grad_()
    q = p.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    if kind == "sliced":
        q = torch.empty(2, 3, 2, 8, device=DEVICE)[..., ::2].copy_(p.detach()).requires_grad_()
    opt_p, opt_q = make(p), make(q)
    step = fxlite.compile(_sliced_step)
    for _ in range(5):
        x = torch.randn(2, 3, 2, 4, device=DEVICE)
        g = None if kind == "sliced" else torch.randn(2, 3, 2, 4, device=DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = step(p, opt_p, x, g)
        want = _sliced_step(q, opt_q, x, None if g is None else g.clone())
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(p, q)
    assert fused_calls == []
