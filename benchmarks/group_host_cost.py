"""The host time of a fused group's call under autograd, less its kernels.

Run (CPU, kernels interpreted; or on a CUDA machine with ``--device cuda``)::

    TRITON_INTERPRET=1 python benchmarks/group_host_cost.py [--layers 2] [--calls 200]

Compiles a small GPT-2 training step (transformers' GPT2LMHeadModel from a config, AdamW),
then calls each of its fused groups again with the arguments of one step, its compiled
graphs answering from a cache: what is left is the group's own host time (its
``AutogradGroup`` call, its ``torch.autograd.Function`` and autograd's work on the
outputs). Prints microseconds a group call.
"""

from __future__ import annotations

import argparse
import time

import torch
from fxlite.codegen.lower import autograd
from fxlite.codegen.lower.autograd_pipeline import CompiledGraph

import fxlite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200, help="rounds over the groups")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=64, n_head=4, n_positions=32,
                     vocab_size=128, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0,
                     attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), device=args.device)

    def step(model, opt, ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    fn = fxlite.compile(step)
    for _ in range(3):
        fn(model, opt, ids)
    calls, results = [], {}
    call, run = autograd.AutogradGroup.__call__, CompiledGraph.__call__

    def recording(self, *a):
        calls.append((self, a))
        return call(self, *a)

    def cached(self, *a):  # each compiled graph's first result, from then on
        if id(self) not in results:
            results[id(self)] = run(self, *a)
        return results[id(self)]

    autograd.AutogradGroup.__call__, CompiledGraph.__call__ = recording, cached
    try:
        fn(model, opt, ids)
        autograd.AutogradGroup.__call__ = call
        for group, a in calls:  # warm
            group(*a)
        start = time.perf_counter()
        for _ in range(args.calls):
            for group, a in calls:
                group(*a)
        spent = time.perf_counter() - start
    finally:
        autograd.AutogradGroup.__call__, CompiledGraph.__call__ = call, run
    print(f"{len(calls)} group calls a step; {spent / args.calls / len(calls) * 1e6:.1f} us "
          "of host time a group call, its kernels left out")


if __name__ == "__main__":
    main()
