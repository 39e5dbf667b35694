"""The autograd node of a graphed region (codegen/runtime/graphed_backward.py), on the CPU.

Capturing needs a GPU (test_segment_graphs.py does it there). Here the two graphs are
stand-ins that compute into fixed buffers as a replay does, so the node's own rules run
in CI: its outputs join autograd, a backward copies the gradients in and hands copies
out, and a replay waits while the last one's backward can still come.
"""

from __future__ import annotations

import pytest
import torch
from fxlite.codegen.runtime.graphed_backward import GraphedBackward


class _Replay:
    """A stand-in for a captured graph: ``replay()`` runs ``fn`` (it writes fixed buffers)."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


def _region(w: torch.Tensor):
    """``y = x @ w`` as a graphed region: fixed input, output and gradient buffers."""
    x = torch.randn(3, 4)
    y = torch.empty(3, 5)
    back = GraphedBackward.__new__(GraphedBackward)  # (no capture on the CPU)
    back.leaves, back.differentiable = [w], [True]
    back.outputs, back.grad_outputs = [y], [torch.empty(3, 5)]
    grad_w = torch.empty(4, 5)
    back.grads = [grad_w]
    back.graph = _Replay(lambda: torch.mm(x.t(), back.grad_outputs[0], out=grad_w))
    back.token, back.generation, back.last = torch.empty(0), 0, None
    forward = _Replay(lambda: torch.mm(x, w.detach(), out=y))
    return back, forward, x


def test_a_replay_is_an_autograd_node_whose_backward_hands_out_copies():
    w = torch.randn(4, 5, requires_grad=True)
    back, forward, x = _region(w)
    for i in range(3):  # gradients accumulate on .grad over calls, as in eager
        (y,) = back.apply(forward.replay)
        assert y.requires_grad and forward.replays == i + 1
        torch.testing.assert_close(y, x @ w.detach())
        y.square().sum().backward()
    assert back.graph.replays == 3
    expected = sum(x.t() @ (2 * (x @ w.detach())) for _ in range(3))
    torch.testing.assert_close(w.grad, expected)
    # a copy: the next backward replay writes the graph's buffer, not the user's .grad
    assert w.grad.untyped_storage().data_ptr() != back.grads[0].untyped_storage().data_ptr()


def test_a_replay_waits_while_the_last_ones_backward_can_still_come():
    w = torch.randn(4, 5, requires_grad=True)
    back, forward, _ = _region(w)
    (y,) = back.apply(forward.replay)
    assert back.busy()  # its backward is still to come
    loss = y.sum()
    loss.backward(retain_graph=True)
    assert back.busy()  # it kept its graph: a second backward may come
    loss.backward()
    assert not back.busy()
    (y,) = back.apply(forward.replay)
    del y  # its autograd graph is gone: no backward can come
    assert not back.busy()


def test_a_backward_after_a_later_replay_raises_rather_than_read_its_buffers():
    # (SegmentGraphs never replays while busy(); the node still refuses to read another
    # call's saved tensors)
    w = torch.randn(4, 5, requires_grad=True)
    back, forward, _ = _region(w)
    (first,) = back.apply(forward.replay)
    (second,) = back.apply(forward.replay)
    with pytest.raises(RuntimeError, match="a later call has overwritten"):
        first.sum().backward()
    second.sum().backward()  # the latest one's is fine


def test_a_second_backward_without_retain_graph_raises_as_eager():
    w = torch.randn(4, 5, requires_grad=True)
    back, forward, _ = _region(w)
    (y,) = back.apply(forward.replay)
    loss = y.sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
