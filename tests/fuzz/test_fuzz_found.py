"""More bugs the program fuzzer found (test_fuzz_regressions.py holds the first ones):
each compiled function is called several times next to eager (``_run``), benign inputs
first, and must give eager's dtypes, bits and buffers from the second call on, when
kernels run, without falling back."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxlite

pytest.importorskip("triton")

from test_fuzz_regressions import _grads, _run  # isort: skip
from test_triton_kernels import DEVICE  # isort: skip


def test_zero_dim_tensor_promotes_less_with_a_transposed_operand():
    # A transposed input runs the kernel in memory order; the 0-dim operand was viewed at
    # the full rank there, so it promoted like a tensor with dims: bf16 / f32 gave f32
    # (seed 750664), int32 max int64 gave int64 (773418).
    a = torch.randn(3, 2, dtype=torch.bfloat16).t()
    _run(lambda x, y: x.div(y, rounding_mode="floor"), [(a, torch.tensor(0.7))] * 3)
    i = torch.randint(-3, 3, (5, 3), dtype=torch.int32).t()
    _run(lambda x, y: torch.maximum(2 - x, y), [(torch.tensor(1), i)] * 3)


def test_operands_are_cast_to_a_half_common_dtype_first():
    # Eager casts every operand to the op's common dtype before comparing: an f16 0-dim
    # tensor against bf16 values is compared as bf16 (seed 767238), and a float literal
    # as its bf16 rounding (0.1 -> 0.10009765625).
    def f(x0, x1, x2):
        x0.copy_(x1)
        return x1 < torch.clamp(x0, x2)

    benign = (torch.zeros(1, 4, dtype=torch.bfloat16), torch.tensor(-2.0, dtype=torch.float16),
              torch.tensor(-1.0))
    # 0.1 in f16 (0.0999755859375) rounds to bf16 0.10009765625: equal there, less in f16
    trap = (torch.zeros(1, 4, dtype=torch.bfloat16), torch.tensor(0.1, dtype=torch.float16),
            torch.tensor(-1.0))
    _run(f, [benign, trap, trap])
    x = torch.full((4,), 0.10009765625, dtype=torch.bfloat16)
    _run(lambda x: (x * 1) > 0.1, [(torch.zeros(4, dtype=torch.bfloat16),), (x,), (x,)])
    _run(lambda x, y: (x + 0) <= y, [(torch.zeros(4, dtype=torch.bfloat16), torch.tensor(0.1)),
                                     (x, torch.tensor(0.1)), (x, torch.tensor(0.1))])


def test_a_zero_dim_output_is_written_when_the_other_tensors_become_empty():
    # b.sub_(b, alpha=2) fused with clamp(b, x, x): for an empty x the kernel launched
    # nothing and the buffer took the uninitialized output's bits (seed 752688).
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.tensor(3))

        def forward(self, x):
            self.b.sub_(self.b, alpha=2)
            return torch.clamp(self.b, x, x) * 2

    ints = lambda n: torch.randint(-4, 4, (n,))  # noqa: E731
    _run(M(), [(ints(3),), (ints(3),), (ints(0),), (ints(0),), (ints(2),)])


def test_results_of_a_kernel_run_in_memory_order_may_be_written_in_place_under_autograd():
    # A transposed or channels-last input runs the kernel on permuted views; its results
    # were views too, and autograd forbids writing in place into views a custom Function
    # returns (seeds 752156, 741680, 740088 and 20 more, all crashing where eager works).
    def sliced(x0, x1):
        v3 = x1 / (x1.unsqueeze(-3).abs() + 1)
        v3[:, 1] = -1.5
        return v3

    def copied(x0, x1):
        v0 = x1 * x0
        v1 = x1.sin()
        v0.copy_(x0)
        return v0 + v1

    t = torch.randn(2, 2).t()
    _grads(sliced, [(torch.randn(2, 2), t)] * 3)
    cl = torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)
    _grads(copied, [(torch.randn(2, 3, 2, 2), cl)] * 3)


def test_a_view_of_a_written_buffer_written_past_a_graph_break_writes_the_buffer():
    # The buffer's in-place update became a pure value plus a write-back; the view taken
    # of it after the update was a view of the pure value, so the branch's mul_ past the
    # graph break wrote a temporary and the buffer lost it (seed 750875).
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.randn(1, 3, 1, 2))

        def forward(self, x):
            self.b.mul_(0.9).add_(x.mean() * 0.1)
            v = self.b.view((6,))
            if (x > 0.5).any():
                v.mul_(2)
            return x * 2

    low, high = torch.zeros(1, 3, 1, 2), torch.ones(1, 3, 1, 2)
    _run(M(), [(low,), (high,), (low,), (high,), (high,)])


def test_a_new_path_writing_an_item_of_an_earlier_result_writes_it_once():
    # The recording of the branch's path wrote min(...)[1] in place, and the check of its
    # compiled segment wrote the same tensor again: 4 where eager gives 2 (seed 781040).
    # An item of a tuple result was not among the values snapshotted before a write.
    def f(x0, x1):
        v0 = x1.min(dim=-2, keepdim=True)[1]
        if x0.sum() > 0:
            v0.mul_(2)
        return v0

    neg, pos = -torch.rand(2, 3), torch.rand(2, 3)
    _run(f, [(neg, torch.randn(3, 2, 2)), (pos, torch.randn(3, 2, 2)),
             (neg, torch.randn(3, 2, 2)), (pos, torch.randn(3, 2, 2))])


def test_softmax_over_a_dim_that_becomes_empty_is_empty_as_in_eager():
    # Softmax over a non-trailing dim leaves its row max out of the kernels, as an eager
    # torch.amax, which raises for an empty dim where softmax returns an empty tensor
    # (seeds 817101, 767139).
    def f(x):
        return torch.sqrt(x.transpose(-3, -1).softmax(-3).abs() + 1)

    r = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    _run(f, [(r(2, 3, 2, 2),), (r(2, 3, 2, 2),), (r(2, 3, 2, 0),)])
    g = lambda x: torch.softmax(x.float().transpose(0, 1), dim=0, dtype=torch.float32)  # noqa: E731
    _run(g, [(r(3, 4),), (r(3, 4),), (r(3, 0),)])


def test_a_region_taking_an_item_of_an_outside_group_keeps_its_gradients():
    # Under autograd, groups joined by reductions become one region; an item of a group's
    # results made outside it was copied in as a member: the pipeline failed on it
    # ('Node' object is not subscriptable, seeds 819348, 798296 and 4 more), and with
    # that patched, the region received the whole tuple and ran without autograd.
    def f(x1, x2):
        v2 = torch.std(x1, dim=0, correction=0, keepdim=True)
        v4 = torch.var(v2, dim=-4, correction=0, keepdim=True)
        if torch.any(x2 < 0):
            v4 = v4 * 2
        return torch.nn.functional.relu6(v4)

    x, r = torch.randn(1, 3, 1, 2, device=DEVICE).half(), torch.rand(3, device=DEVICE)
    _grads_in_kernels(f, [(x, r), (x, -r), (x, r), (x, -r)])


def _warning_free(compiled, *args):
    """``compiled(*args)``, where no part of the call may fall back to eager with a
    warning (it would hide the bug)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(*args)
    assert not [w for w in caught if "fxlite" in str(w.message)], caught[0].message
    return got


def _grads_in_kernels(f, calls):
    """Like ``_grads`` (the first argument requires grad), and no part of any call may
    fall back to eager, which would hide the bug."""
    compiled = fxlite.compile(f)
    for x, *rest in calls:
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = _warning_free(compiled, mine, *rest)
        assert compiled.fallbacks == []
        want = f(theirs, *rest)
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(mine.grad, theirs.grad)

@pytest.mark.parametrize("op", ["batch_norm", "softmax", "log_softmax", "layer_norm", "rms_norm"])
def test_a_view_of_a_norm_of_a_transposed_input_works_as_in_eager(op):
    # Eager's norm and softmax kernels return a row-major result whatever the input's
    # layout; the pointwise ops they decompose into followed the input's, so a later
    # .view(-1) failed and the segment fell back to eager (seeds 805648, 818301; 767265
    # with a channels-last one).
    stats = torch.randn(3, device=DEVICE) * 0.1, torch.rand(3, device=DEVICE) + 1
    norm = {"batch_norm": lambda x: torch.nn.functional.batch_norm(x, *stats),
            "softmax": lambda x: x.softmax(-1),
            "log_softmax": lambda x: x.log_softmax(1),
            "layer_norm": lambda x: torch.nn.functional.layer_norm(x, x.shape[-1:]),
            "rms_norm": lambda x: torch.nn.functional.rms_norm(x, x.shape[-1:])}[op]
    x = torch.randn(2, 3, 4, device=DEVICE).transpose(0, 2)
    if not (op == "batch_norm" and DEVICE == "cuda"):  # CUDA's eager keeps x's layout
        _run(lambda a: norm(a).view(-1) * 2, [(x,), (x * 2,), (-x,)])  # without affine
    if op not in ("batch_norm", "rms_norm"):  # a channels-last input too (these two keep it)
        cl = torch.randn(2, 3, 2, 2, device=DEVICE).to(memory_format=torch.channels_last)
        _run(lambda a: norm(a).view(-1) * 2, [(cl,), (cl * 2,), (-cl,)])


def test_an_identity_group_under_autograd_returns_a_copy_the_caller_may_write():
    # A reduction over the one element of a 0-dim tensor returns it as it is: the group's
    # autograd Function returned its input, and writing in place into a view of the result
    # raised in the compile check, so the segment ran in eager (seed 777156, with prod).
    def f(x):
        v0 = x.sum(-1, dtype=torch.float32)
        v0.masked_fill_(v0 != v0, 0)
        v3 = v0[...]
        v5 = torch.mean(v3, dim=-1, keepdim=False)
        v3.neg_()
        return v5 + v0

    _grads_in_kernels(f, [(torch.randn((), device=DEVICE),) for _ in range(3)])


def test_prod_gradient_with_a_zero_and_an_infinity_is_eagers():
    # With one zero in a row, the other elements' gradients are products that hold the
    # zero: eager computes them exactly (0 * inf is NaN); the rule gave 0 (seeds 760960,
    # 782836, 757672).
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[inf, 0.0, 3.0], [nan, 0.0, 2.0], [0.0, 0.0, inf], [1.5, 2.0, 0.5]])
    for f in (lambda a: a.prod(), lambda a: a.prod(1), lambda a: a.prod(0, dtype=torch.float32)):
        _grads(f, [(torch.randn(4, 3),), (x,), (x,)])


def test_an_in_place_activation_of_an_input_autograd_tracks_keeps_its_backward():
    # Past a graph break, silu_ wrote a segment input that requires grad: functionalized,
    # its write-back changed the input silu had saved for its backward, which then raised
    # where eager works (seed 757816).
    w = torch.randn(2, 3, 1, device=DEVICE)

    def f(x):
        v1 = x % 0.5
        torch._assert(bool(((x == x) | x.isnan()).all()), "equal or NaN")
        torch.nn.functional.silu(v1, inplace=True)
        return torch.nn.functional.conv1d(v1, w, padding=1)

    _grads_in_kernels(f, [(torch.randn(2, 3, 4, device=DEVICE),) for _ in range(3)])


def test_a_value_and_its_detached_copy_from_one_group_keep_their_gradients_apart():
    # A group returning x and detach(x) gave the same tensor for both, and marking the
    # detached one non-differentiable cut the gradient of x too: later results lost
    # requires_grad (seed 793796).
    def f(x, flag):
        v0 = torch.remainder(x, -3)
        v3 = torch.mean(v0, dim=-1, keepdim=True)
        v4 = v0.detach()
        if flag.mean() < 0.5:
            return v3 - 1, v4
        return -v3, v4

    x = torch.randn(()).bfloat16()
    calls = [(x, torch.zeros(2)), (x * 2, torch.ones(2)), (x * 3, torch.zeros(2))]
    compiled = fxlite.compile(f)
    for x, flag in calls:
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = compiled(mine, flag), f(theirs, flag)
        assert [t.requires_grad for t in got] == [t.requires_grad for t in want]
        got[0].backward()
        want[0].backward()
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_trunc_division_of_halves_truncates_the_rounded_quotient():
    # Eager divides halves as halves: trunc(bf16(a / b)), so 4.96875 / 0.99609375 (4.988
    # in fp32, 5.0 in bf16) gives 5; the kernel truncated the fp32 quotient (seed 847720).
    # (CUDA's kernel and the CPU's vector loop do; the CPU's loop for 0-dim tensors does
    # not, so this test keeps to tensors with elements.)
    x = torch.tensor([4.96875, -4.96875, 9.9375, 1.0]).bfloat16()
    y = torch.tensor([0.99609375, 0.99609375, 0.99609375, 3.0]).bfloat16()
    f = lambda a, b: torch.div(a, b, rounding_mode="trunc")  # noqa: E731
    benign = torch.tensor([4.0, -6.0, 9.0, 1.0]).bfloat16()  # exact quotients: no rounding
    _run(f, [(benign, y.abs().round()), (x, y), (x, y), (x * 2, y)])



def test_trunc_division_of_a_float32_by_a_half_does_not_round_the_quotient_to_half():
    # f32 / f16 is a float32 division in eager: -0.93801486 / -0.00012081861 is 7763.827
    # in fp32 (trunc 7763); the kernel rounded it to f16 (7764) because one operand was a
    # half (seed 969747).
    x = torch.tensor([-0.9380148649215698, 1.0, 7.5])
    y = torch.tensor([-0.0001208186149597168, 3.0, 0.5]).half()
    f = lambda a, b: torch.div(a, b, rounding_mode="trunc")  # noqa: E731
    benign = (torch.tensor([4.0, -6.0, 9.0]), torch.tensor([2.0, 3.0, 1.0]).half())
    _run(f, [benign, (x, y), (x, y)])
    _run(lambda a, b: f(b, a), [benign, (x, y), (x, y)])

def test_pow_exponent_gradient_at_a_zero_base_keeps_a_nan_cotangent():
    # Eager multiplies the exponent's gradient by g outside its 0-at-zero-base rule, so a
    # NaN cotangent (softmax of a row holding NaN) gives NaN there; the rule gave 0
    # (seed 854240 of this session's run).
    def f(x):
        return torch.softmax(x ** x.abs().clamp(max=3), 0)

    x = torch.tensor([0.0, -0.0, float("nan"), 1.5, -2.0])
    _grads(f, [(torch.rand(5) + 0.5,), (x,), (x,)])


@pytest.mark.parametrize("case", ["amax_of_a_size_1_dim", "var_of_a_trailing_dim",
                                  "var_of_all", "sum_keepdim"])
def test_a_reductions_input_gradient_is_not_scaled_as_a_broadcast(case):
    # b1a02c5 scaled a cotangent by the size of each dim it was spread over by broadcasting,
    # aligning shapes on the right. A reduction's input has the reduced dims too, so that
    # alignment matched the wrong dims: x.amax(1) of a (4, 1) x gave gradients 4 times too
    # large from the second call on (fuzz seeds 959840, 966560; var: 955400, 960136).
    fn, shape = {"amax_of_a_size_1_dim": (lambda x: x.amax(1, False), (4, 1)),
                 "var_of_a_trailing_dim": (lambda x: torch.var(x, -1, unbiased=False),
                                           (1, 3, 1, 2)),
                 "var_of_all": (lambda x: x.to(torch.float64).var(), (1, 4)),
                 "sum_keepdim": (lambda x: (x * 2).sum((0, 2), keepdim=True), (3, 1, 4))}[case]
    _grads(fn, [(torch.randn(*shape, device=DEVICE),) for _ in range(3)])


def test_a_buffer_written_in_place_twice_keeps_a_write_past_a_graph_break():
    # b0.add_(s) became a new value and b0.copy_(x0) an in-place write into it; the graph
    # passed that value, not b0, to the segment after the data-dependent `if`, whose
    # b0.add_(...) then wrote a temporary: the buffer lost it from the second call on
    # (fuzz seed 962445, since the fourteenth session at least).
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b0", torch.tensor(0.5))

        def forward(self, x0, x1):
            self.b0.add_(x1.sum())
            self.b0.copy_(x0)
            if bool((x1 != 0).all()):
                x1.mul_(2)
            self.b0.add_(x1.sum())
            return x0 <= float("inf"), x0

    _run(M(), [(torch.tensor(-3), torch.randn(())) for _ in range(4)])


def test_a_permute_sunk_through_its_producer_reads_the_input_before_a_write():
    # sink_views rewrote permute(x // x) as permute(x) // permute(x) at the permute's
    # place, after hardtanh_(x), an in-place write left impure (x is a view of another
    # tensor): the division read the clamped x, 1.0 where eager's inf // inf is NaN
    # (seed 980533).
    def f(x):
        v = x.div(x, rounding_mode="floor")
        F.hardtanh(x, inplace=True)
        return v.permute(1, 2, 0) * 2

    compiled = fxlite.compile(f)
    for trap in (False, True, True):
        values = torch.tensor([0.5, 3.0, -2.0, 4.0, 5.0, -6.0], device=DEVICE)
        if trap:
            values[1] = float("inf")
        mine, theirs = values[:].view(1, 2, 3), values.clone()[:].view(1, 2, 3)
        got = _warning_free(compiled, mine)
        torch.testing.assert_close(got, f(theirs), equal_nan=True)
        torch.testing.assert_close(mine, theirs)


def test_a_float32_gradient_through_a_bf16_tanh_is_the_kernels():
    # The backward group g * (1 - o * o) of a bf16 tanh, cast to the float32 input's
    # gradient, was checked against its eager run op by op in bf16 at float32's tolerance:
    # 1 - bf16(o * o) cancels for o near 1 (2.5% off); the kernel, in fp32 and rounded once
    # as eager's tanh_backward, "disagreed" and the group fell back to the worse values
    # (seed 966321).
    x = torch.tensor([-1.3442760, -0.7535459, -0.2251372, 4.8713012, -1.1938664, 3.3006101,
                      -0.8183356])
    w = torch.randn(7, generator=torch.Generator().manual_seed(4242), dtype=torch.float64)
    _grads(lambda x: torch.tanh((x * -1.5).bfloat16()), [(x.flip(0),), (x,), (x,)],
           weights=[w])


def test_a_reshape_written_in_place_past_a_graph_break_under_autograd_writes_its_base():
    # v1 and its reshape left one group as two results; under autograd the group's
    # Function returns a copy for the second (autograd forbids writing into a view a
    # custom Function returns), so v2.neg_() past the read of x1 negated the copy, not v1
    # (fuzz seed 977848, where the gradients differed too). The view is made again outside.
    def f(x0, x1):
        v1 = x0 * 2
        v2 = v1.reshape(v1.shape[0], -1)
        s = float(x1.amax())
        v2.neg_()
        return torch.cat((v1 * s, v2), -1)

    _grads(f, [(torch.randn(3, 5), torch.tensor(s)) for s in (1.7, -1.5, 1.7, 2.0)])


def _written_past_a_break(x):
    """A segment's result written on one path past a graph break, then divided in place
    by an input that requires grad."""
    v = x.new_zeros(x.shape) + 1
    if x.mean() < 0.5:
        v.mul_(2)
    v /= x
    return v


def test_a_write_back_never_changes_a_value_saved_for_backward():
    # Past the graph break, v (the first segment's result) was written as a pure op and
    # copied back: v / x (or a fused group recomputing v * 2) saved v for x's gradient,
    # and the copy into v then failed backward with "modified by an inplace operation"
    # from the second call on (seed 1002406). Such a write now stays in place, as eager's.
    small, big = torch.rand(4) * 0.4 + 0.05, torch.rand(4) + 0.6
    _grads(_written_past_a_break, [(small,), (big,), (small,), (big,), (small,)])


def test_a_new_path_that_writes_through_a_view_checks_from_the_values_before_the_write():
    # The second call records a new path from the break on: its div_ through v0 (an
    # earlier segment's view of x) saved v0's value before the write but not x's, so the
    # compile check read the written x, "disagreed" with eager and the path ran in eager
    # (GPU fuzz seed 1001663).
    def f(x):
        v0 = x.squeeze(-1)
        v2 = x + int(v0.sum().item())
        v0.div_(2)
        return v2

    compiled = fxlite.compile(f)
    for value in (-2.25, 3.5, -3.25):
        mine, theirs = torch.tensor(value, device=DEVICE), torch.tensor(value, device=DEVICE)
        got = _warning_free(compiled, mine)
        torch.testing.assert_close(got, f(theirs))
        torch.testing.assert_close(mine, theirs)


def test_a_write_after_a_cast_back_still_returns_the_argument_itself():
    # x0.mul_(long mask) promotes in its pure form, so functionalize casts it back to
    # float; the next write, ``x0 /= -1.5``, recorded the mul_ as the tensor it writes,
    # not the cast, so it stayed in place and the graph returned the cast's value, a new
    # tensor, where eager returns x0 itself (fuzz seed 8553095).
    def f(x0):
        x0.mul_((1e-3 < x0).long())
        x0 /= -1.5
        return x0

    compiled = _run(f, [(torch.randn(4, 5, device=DEVICE),)] * 4)
    for _ in range(3):
        x = torch.randn(4, 5, device=DEVICE)
        assert compiled(x) is x
    assert len(compiled.kernels) == 1 and "div_" not in compiled.code


def test_a_result_passed_past_a_graph_break_is_not_the_buffer_written_there():
    # Fuzz seed 9014541: ``v3 = v0.to(float16); v3 **= 2``, a graph break, then
    # ``self.b0.add_(v3.sum())`` and ``return v3``. The second segment's placeholder for
    # v3 kept the first segment's meta (``same_object``: "to", the node pow_ wrote); the
    # second segment's own cast back to b0's dtype was also named "to", so functionalize
    # took v3 for a write into b0 and returned b0's write-back: from the second call on
    # the result was the float32 buffer, not the float16 tensor (with NaN values, where
    # the kernel's check ran; other values took another path).
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b0", torch.tensor(0.3, device=DEVICE))

        def forward(self, x1, x2):
            v3 = (self.b0 * float("nan")).to(torch.float16)
            v3 **= 2
            if (x2 > True).any():
                x1.mul_(2)
            self.b0.add_(v3.sum())
            return v3

    model = Model()
    compiled = _run(model, [(torch.randn(1, device=DEVICE).half(),
                             torch.tensor([True], device=DEVICE))] * 4)
    out = compiled(torch.randn(1, device=DEVICE).half(), torch.tensor([True], device=DEVICE))
    assert out.dtype == torch.float16 and out is not model.b0


def test_a_sliced_input_keeps_its_strides_in_the_checks_copy():
    # Fuzz seed 9805300: ``v0 = x0.unsqueeze(0); ...; v0.mul_(x0)`` on a sliced x0 runs in
    # eager (input and output overlap in full); on a row-major x0, eager raises (they
    # overlap in part). The compile check started from a clone() of x0, which is
    # row-major: its replay raised and the program ran in eager, with a warning.
    def f(x0):
        v0 = x0.unsqueeze(0)
        x0.abs_()
        v4 = v0.amax(4, False)
        v0.mul_(x0)
        return v4

    compiled = fxlite.compile(f)
    for _ in range(3):
        base = torch.randn(2, 3, 2, 4, device=DEVICE)
        mine, theirs = base[..., ::2], base.clone()[..., ::2]
        got = _warning_free(compiled, mine)
        torch.testing.assert_close(got, f(theirs))
        torch.testing.assert_close(mine, theirs)


def test_a_sliced_input_with_a_gradient_keeps_its_strides_in_the_checks_copy():
    # As above, for an input whose gradient the call records: the check's copy of it
    # (a non-leaf clone, so that the check may write it as the program did) was made with
    # clone(), row-major, and the overlapping write raised in the replay: the whole
    # function ran in eager, with a warning. The copy keeps the strides now.
    def f(w, x):
        with torch.no_grad():
            v0 = w.unsqueeze(0)
            v0.mul_(w)  # full overlap on a sliced w: eager runs it
        loss = (w * x).sum()
        loss.backward()
        return loss

    compiled = fxlite.compile(f)
    for _ in range(3):
        base = torch.rand(2, 8, device=DEVICE) + 0.5
        mine = base[..., ::2].detach().requires_grad_()
        theirs = base.clone()[..., ::2].detach().requires_grad_()
        x = torch.randn(2, 4, device=DEVICE)
        torch.testing.assert_close(_warning_free(compiled, mine, x), f(theirs, x))
        torch.testing.assert_close(mine, theirs)
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_a_pure_write_then_a_kept_one_write_back_after_both():
    # Past the break, ``v.mul_(2)`` became a pure op written back into v, and ``v /= x``
    # (x requires grad) stayed in place, on the pure value: the write-back went between
    # them, so v missed the division wherever the pure value was not v's own memory. The
    # segment's check caught it, and its ops ran in eager, with a warning.
    _grads_in_kernels(_written_past_a_break, [(torch.rand(4, device=DEVICE) * scale + 0.05,)
                                              for scale in (0.4, 1.0, 0.4)])
