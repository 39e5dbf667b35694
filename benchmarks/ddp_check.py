"""A compiled model inside DistributedDataParallel gives eager DDP's losses (2+ GPUs).

Run on a machine with two GPUs::

    torchrun --nproc_per_node=2 benchmarks/ddp_check.py [--steps 10] [--mode reduce-overhead] [--json OUT]

Both runs train torchvision's resnet18 (batch 16 per rank, 128x128, Adam) from the same
weights on the same per-rank data: once as ``DDP(model)``, once as
``DDP(fxlite.compile(model))``. DDP keeps its gradient buckets and all-reduce (NCCL); the
compiled module runs the forward and backward kernels inside it, so DDP's hooks see the
parameters' gradients as they accumulate. Rank 0 prints both loss curves, their largest
relative difference, and the median step time of each over the second half of the steps
(the first calls of a compiled module record, compile and try kernels against recorded ops).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxlite


def train(ddp_model, steps, data):
    opt = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
    losses, times = [], []
    for i in range(steps):
        x, y = data[i % len(data)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp_model(x), y)
        loss.backward()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        losses.append(float(loss))
        times.append(start.elapsed_time(end))
    return losses, statistics.median(times[len(times) // 2:])


def _graphs(compiled) -> list[dict]:
    """Per segment of the latest call: CUDA graphs captured (forward and backward
    regions), and why graphs are off where they are."""
    from fxlite.codegen.runtime.segment_graphs import SegmentGraphs

    out = []
    for seg in compiled._compiled._last:
        run = seg.run
        if isinstance(run, SegmentGraphs):
            regions = [r for lay in run.layouts.values() for r in lay.regions or []]
            out.append({"captured": run.captured, "off": run.off,
                        "with_backward": sum(r.back is not None for r in regions)})
        else:
            out.append({"runner": type(run).__name__})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mode", default=None, help="fxlite.compile's mode (reduce-overhead)")
    parser.add_argument("--json")
    args = parser.parse_args()
    import torchvision

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    base = torchvision.models.resnet18(num_classes=10).cuda()
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    data = [(torch.randn(16, 3, 128, 128, device="cuda", generator=gen),
             torch.randint(0, 10, (16,), device="cuda", generator=gen)) for _ in range(4)]
    eager_losses, eager_ms = train(DDP(copy.deepcopy(base)), args.steps, data)
    compiled = fxlite.compile(copy.deepcopy(base), mode=args.mode)
    fx_losses, fx_ms = train(DDP(compiled), args.steps, data)
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(fx_losses, eager_losses))
    if rank == 0:
        result = {"world_size": dist.get_world_size(), "mode": args.mode or "default", "device": torch.cuda.get_device_name(),
                  "eager_losses": eager_losses, "fxlite_losses": fx_losses,
                  "max_rel_diff": rel, "eager_step_ms": eager_ms, "fxlite_step_ms": fx_ms,
                  "kernels": len(compiled.kernels), "fallbacks": compiled.fallbacks[:5],
                  "graphs": _graphs(compiled)}
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
