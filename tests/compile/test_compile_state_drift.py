"""Module and optimizer state across compiled calls: a parameter group added between
steps, data-dependent routing (a mixture of experts whose expert gets no tokens) and a
backward hook added after the first call end every call as eager's do.

Each test runs an eager copy and a compiled copy from equal fresh state, several calls
with fresh inputs, and compares results, parameters and gradients (None included).
"""

from __future__ import annotations

from test_compile_contract import DEVICE  # isort: skip
from test_compile_contract import _fresh_warnings  # noqa: F401  # isort: skip  (autouse fixture)

import warnings

import pytest
import torch

pytest.importorskip("triton")

import fxlite


def side_by_side(make, calls, change=None):
    """``make() -> (fn, model, extra)``; returns the compiled function after comparing."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        fn, model, extra = make()
        f = fxlite.compile(fn) if compiled else fn
        outs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, args in enumerate(calls):
                if change is not None:
                    change(i, model, extra)
                outs.append(f(*args))
        runs.append((outs, model, f))
    (eager, m0, _), (mine, m1, f) = runs
    torch.testing.assert_close(mine, eager)
    for (name, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters()):
        torch.testing.assert_close(b, a, msg=name)
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, msg=name)
    return f


def test_a_param_group_added_between_steps_is_stepped_and_zeroed():
    def make():
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).to(DEVICE)
        opt = torch.optim.SGD(m[1].parameters(), lr=0.1)

        def step(x):
            loss = m(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return step, m, opt

    def change(i, m, opt):
        if i == 2:
            opt.add_param_group({"params": m[0].parameters()})

    calls = [(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).to(DEVICE),)
             for i in range(5)]
    f = side_by_side(make, calls, change)
    assert f.kernels


def test_an_expert_without_tokens_keeps_a_none_gradient_and_routing_follows_the_data():
    routes = [[0, 1, 0], [0, 0, 0], [1, 1, 0], [2, 2, 2], [0, 1, 2]]

    def make():
        experts = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)]).to(DEVICE)

        def fn(x, route):
            out = torch.zeros_like(x)
            for e in range(3):
                idx = (route == e).nonzero().flatten()
                if idx.numel():  # a size that depends on the data: a read
                    out[idx] = experts[e](x[idx])
            return out.sum()

        return fn, experts, None

    calls = [(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).to(DEVICE),
              torch.tensor(r, device=DEVICE)) for i, r in enumerate(routes)]
    side_by_side(make, calls)

    def training():
        fn, experts, _ = make()

        def step(x, route):
            for p in experts.parameters():
                p.grad = None
            loss = fn(x, route)
            loss.backward()
            return loss.detach()

        return step, experts, None

    side_by_side(training, calls)  # expert 2 gets no tokens on the first call: None


def test_a_backward_hook_added_after_the_first_call_runs():
    seen = {}

    def make():
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
                                torch.nn.Linear(4, 1)).to(DEVICE)

        def step(x):
            loss = m(x).sum()
            loss.backward()
            return loss.detach()

        return step, m, []

    def change(i, m, log):
        if i == 2:
            m[0].register_full_backward_hook(lambda mod, gi, go: log.append(go[0].sum()))
        seen.setdefault(id(log), log)

    calls = [(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).to(DEVICE),)
             for i in range(5)]
    side_by_side(make, calls, change)
    eager_log, compiled_log = seen.values()
    assert len(eager_log) == len(compiled_log) == 3
    torch.testing.assert_close(compiled_log, eager_log)
