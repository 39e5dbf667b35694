"""A compiled module inside DistributedDataParallel trains as the eager module does.

Two CPU processes (gloo) train a small conv net with train-mode BatchNorm, each on its
own data: once as ``DDP(model)`` and once as ``DDP(fxlite.compile(model))``. DDP keeps its
buckets and all-reduce; the compiled module's backward kernels hand it the gradients.
(``benchmarks/ddp_check.py`` is the same check on GPUs, with NCCL.)
"""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxlite

pytestmark = pytest.mark.skipif(
    not dist.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs torch.distributed and the Triton interpreter (CPU kernels)")

STEPS = 4


def _net() -> nn.Module:
    # (no conv biases: before a train-mode BatchNorm their gradient is rounding noise,
    # which Adam scales up to steps of lr in either run)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                         nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                         nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _train(model: nn.Module, data: list) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [t.detach().clone() for t in model.module.state_dict().values()]


def _rank(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=world)
    try:
        torch.manual_seed(0)
        base = _net().train()
        gen = torch.Generator().manual_seed(100 + rank)
        data = [(torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen))
                for _ in range(STEPS)]
        eager = _train(DDP(copy.deepcopy(base)), data)
        compiled = fxlite.compile(copy.deepcopy(base))
        mine = _train(DDP(compiled), data)
        kinds = sorted({k.direction for k in compiled.kernels})
        torch.save({"eager": eager, "fxlite": mine, "kinds": kinds,
                    "fallbacks": compiled.fallbacks}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_compiled_module_in_ddp_gives_eager_ddps_losses_and_weights(tmp_path):
    out = str(tmp_path / "rank")
    mp.spawn(_rank, args=(2, _free_port(), out), nprocs=2, join=True)
    runs = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for r, run in enumerate(runs):
        (want, want_state), (got, got_state) = run["eager"], run["fxlite"]
        assert len(got) == STEPS and got != want[:1] * STEPS  # it trained
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"rank {r} losses")
        for a, b in zip(got_state, want_state):  # weights, biases and running statistics
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert run["kinds"] == ["backward", "forward"] and run["fallbacks"] == []
    # all-reduced gradients: both ranks end with the same weights, from different data
    for a, b in zip(runs[0]["fxlite"][1], runs[1]["fxlite"][1]):
        if a.is_floating_point() and a.dim() > 1:
            torch.testing.assert_close(a, b)
