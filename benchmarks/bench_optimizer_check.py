"""Host cost of a fused optimizer step's plan check, per call.

Run anywhere (CPU tensors: the check is host work only)::

    python benchmarks/bench_optimizer_check.py [--rounds 9] [--calls 2000]

``FusedStep`` (``codegen/lower/optimizer_steps.py``) keeps its tensor lists between steps
and checks on each call that they still describe the optimizer's group. The group here has
GPT-2's 148 parameters (transformers' GPT2LMHeadModel at width 16: the same parameter
count, small tensors) and AdamW's state; each call hands the check new gradient tensors,
as ``zero_grad(set_to_none=True)`` and a backward do every step. Printed: the median
over rounds of the mean time a check, and the spread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from fxlite.codegen.lower.optimizer_steps import FusedStep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=16, n_head=4, n_positions=32,
                                       vocab_size=64))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-9)
    opt.step()  # the state
    step = FusedStep(opt.step)
    step()  # the plan
    plan = step._plans[0][0]
    group = opt.param_groups[0]["params"]
    grads = [[torch.randn_like(p) for p in group] for _ in range(2)]
    for g in grads:
        assert plan.holds(group, g, opt.state)
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for i in range(args.calls):
            plan.holds(group, grads[i & 1], opt.state)
        times.append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"{len(group)} parameters, new gradients each call: {statistics.median(times):.1f} "
          f"us a check (median of {args.rounds} rounds of {args.calls}; "
          f"{min(times):.1f} to {max(times):.1f})")


if __name__ == "__main__":
    main()
