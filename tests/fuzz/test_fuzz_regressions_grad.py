"""Bugs the gradient check (tests/fuzz/fuzz_check_grad.py) found, each as the minimal
program it shrank to: compiled and eager backward of the same program, from the same
weighted sum of its results, compared through ``_grads`` (results and every input's
``.grad``, None where eager's is None).

Split from test_fuzz_regressions.py, which holds ``_grads``, the other regressions, and
the open bugs (strict xfails).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from test_fuzz_regressions import _grads  # isort: skip

import fxlite


def test_remainder_grad_of_an_infinite_dividend_is_nan():
    # d(x % y)/dy = -(x // y), which eager's floor division makes NaN for an infinite x;
    # the rule's floor(x / y) gave -inf (fmod: trunc division, which gives inf as eager).
    x = torch.tensor([float("inf"), float("-inf"), 4.3, -1.2, float("nan")])
    y = torch.tensor([1.87, -0.5, 0.5, 2.8, 1.0])
    for f in (lambda a, b: a % b, torch.fmod):
        _grads(f, [(torch.randn(5), torch.rand(5) + 1), (x, y)])


def test_input_reached_only_by_an_unused_result_gets_no_grad():
    # A fused group returning (trunc(a) * 2, minimum(tanh(b), trunc(a))): backward from the
    # first result alone gave b a zero gradient where eager leaves b.grad None (an
    # optimizer then skips b).
    def f(a, b):
        t = a.trunc()
        return t * 2, torch.minimum(torch.tanh(b), t)

    _grads(f, [(torch.randn(2, 3), torch.randn(2, 3))] * 3, weights=[1.0, None])


def test_var_gradient_of_a_row_holding_an_infinity():
    # Found by the gradient check on an H200 (9 programs, e.g. seeds 6903, 7445, 9733),
    # reproduced on the CPU: var and std were differentiated after decompose, through their
    # mean, whose gradient term (0 for finite rows) was NaN for a row holding an infinity
    # and spread across the row; eager's var_backward gives -inf at the finite elements.
    x = torch.randn(2, 3)
    x[0, 1] = float("inf")
    _grads(lambda t: torch.var(t, -1, unbiased=False), [(torch.randn(2, 3),), (x,), (x,)])


def test_var_gradient_of_a_whole_tensor_with_no_degree_of_freedom():
    # Fuzz seed 8918352 (``fmod(x, 0.5).var()`` of a 0-dim NaN): eager's var_backward has
    # a case of its own for a var of the whole tensor (no dim, or a 0-dim input) with
    # n <= correction: the gradient is g * inf where x differs from the mean (a NaN
    # does), NaN where it equals it, whatever the sign. The rule 2 (x - mean) / (n - c)
    # gave NaN for a NaN and -inf below the mean. Over a dim, eager keeps the formula.
    nan = float("nan")
    reduce = torch.var
    _grads(lambda t: torch.fmod(reduce(t), 7.0) * 1.5,
           [(torch.tensor(nan),), (torch.tensor(3.0),), (torch.tensor(nan),)])
    _grads(lambda t: reduce(t) * 1.5, [(torch.tensor([nan]),), (torch.tensor([3.0]),)] * 2)
    _grads(lambda t: reduce(t, correction=2) * 1.5, [(torch.tensor([1.0, 3.0]),)] * 3)
    _grads(lambda t: reduce(t, 0, correction=2) * 1.5, [(torch.tensor([1.0, 3.0]),)] * 3)


def test_a_piecewise_constant_op_passes_zeros_back_as_eager():
    # Fuzz seed 9010224 (``x.amax().div(0.0, rounding_mode="floor")``): the gradient of a
    # piecewise-constant op (floor, sign, round, a floor division) is zero, and eager
    # passes a tensor of zeros back, which amax's backward divides by its count of maxima:
    # NaN everywhere for an input holding a NaN. The rule passed nothing back, so the
    # compiled gradient was 0 from the second call on. Benign inputs keep zero gradients.
    nan = float("nan")
    special = torch.tensor([[nan, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    for f in (lambda t: t.amax().floor(), lambda t: t.amax().div(0.0, rounding_mode="floor"),
              lambda t: torch.sign(t.amin(-1)), lambda t: (t / t.sum(-1, keepdim=True)).round()):
        _grads(f, [(torch.randn(3, 4),), (special,), (torch.randn(3, 4),), (special,)])


def test_std_gradient_where_std_is_zero():
    # Found with the one above (seeds 847, 6000, 7445): std's gradient is 0 where std is 0
    # in eager (std_backward masks it); sqrt's derivative there is g / 0, and NaN once
    # multiplied by the centred zeros. Benign rows first, then a constant row and an
    # infinity, then a single element.
    const = torch.tensor([[2.0, 2.0, 2.0], [1.0, -3.0, 0.5]])
    inf = const.clone()
    inf[1, 1] = float("inf")
    _grads(lambda t: torch.std(t, -1, unbiased=False),
           [(torch.randn(2, 3),), (const,), (inf,), (const,)])
    _grads(lambda t: torch.std(t, 0, keepdim=True, unbiased=False), [(torch.randn(1, 4),)] * 2)


def test_detach_inside_a_group_cuts_the_gradient():
    # Found by the gradient fuzzer on an H200 (seeds 5288, 9484) once detach had a record:
    # a result computed only from x.detach() required grad, and x got a zero gradient
    # where eager gives None. Then x.detach() * x: the gradient flows through one factor.
    def only(x, y):
        v = torch.clamp(x, min=2.0, max=0.0).detach()
        return F.softmax(F.gelu(torch.std(v, dim=-1, correction=0, keepdim=True)), -1,
                         dtype=torch.float32) + y

    compiled = fxlite.compile(only)
    for _ in range(3):
        x, y = torch.randn(1, 4, requires_grad=True), torch.randn(1, 1, requires_grad=True)
        out = compiled(x, y)
        out.sum().backward()
        assert x.grad is None and y.grad is not None
    _grads(lambda t: t.detach() * t + t, [(torch.randn(2, 4),)] * 3)


@pytest.mark.parametrize("act", [F.silu, F.gelu, lambda t: F.gelu(t, approximate="tanh")],
                         ids=["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_activation_gradient_of_an_infinite_incoming_gradient(act, dtype):
    # Fuzz seed 9304060 (``silu(x) * inf``): silu was decomposed into x * sigmoid(x) and
    # differentiated by the product rule, g s + g x s (1 - s): inf - inf, NaN, at x < 0,
    # where eager's g s (1 + x (1 - s)) is an infinity. gelu's decomposition had the same
    # exposure (g Phi + g x phi). Both now stay whole where their input needs a gradient,
    # so autograd takes their own rules. Finite incoming gradients first, then infinite.
    x = torch.tensor([-3.0, -1.0, -0.5, 0.5, 2.0], dtype=dtype)
    calls = [(torch.randn(5, dtype=dtype),), (x,), (x,)]
    _grads(act, calls)
    _grads(act, calls, weights=[float("inf")])


def test_prod_gradient_of_a_0d_tensor():
    # Fuzz seed 9503603 (an H200 run, reproduced on the CPU): a prod over dim 0 of a 0-d
    # tensor (an amax over every dim). The rule counts a row's zeros, NaNs and infinities
    # with a sum over the reduced dims; a 0-d input has none to sum, so the count stayed a
    # bool tensor, and ``count - 1`` raised in the compiled backward, where eager's runs.
    def program(x0):
        v1 = torch.softmax(x0, -2).amax((1, 0))
        v2 = F.relu(v1)
        return torch.addcdiv(v2.prod(0, dtype=torch.float32), v1, v2.abs() + 1)

    _grads(program, [(torch.randn(2, 3),) for _ in range(3)])
    calls = [(torch.tensor(v),) for v in (0.7, 0.0, float("inf"), float("nan"), -2.0)]
    _grads(lambda t: torch.prod(F.relu(t), 0) + t, calls)
