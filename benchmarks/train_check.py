"""Compiled training steps against eager on a GPU: losses and parameters, step by step.

Run on a CUDA machine (transformers installed for ``gpt2``)::

    FXLITE_TRIAL=0 python benchmarks/train_check.py                  # every case
    FXLITE_TRIAL=0 python benchmarks/train_check.py --cases nanogpt --steps 10

Each case trains a small model from one initial copy twice, with ``fxlite.compile`` and
eagerly, on the same data: AdamW, ``clip_grad_norm_``, ``zero_grad(set_to_none=True)``;
in float32 with TF32 off, then under bfloat16 autocast. It prints both losses every step,
then the largest difference between the two models' parameters, the compile's fallbacks
and the kinds of its fused groups (``region``: an autograd region,
``codegen/lower/autograd_regions.py``).

Why: a step's outputs are its loss; the gradients only reach the parameters through the
optimizer. A wrong gradient (a linear's weight gradient multiplied by the batch, found
this way on an H200 in the thirtieth session: nanoGPT's float32 losses left eager's from
the fourth step) passes every check that compares outputs, and shows here as losses that
drift apart, where float32 without TF32 keeps them equal to about 1e-6.

Cases: ``nanogpt`` (benchmarks/bench_training.py's nanoGPT: 4 layers, width 256, 256
tokens; its linears are ``nn.Linear``) and ``gpt2`` (transformers' GPT2LMHeadModel: 2
layers, width 256; its linears are ``Conv1D``, an ``addmm`` between views).
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_training import _NanoGPT  # noqa: E402

import fxlite  # noqa: E402

VOCAB, TOKENS, BATCH = 1000, 256, 4


def _nanogpt() -> tuple[torch.nn.Module, object]:
    # each position predicts the next token (the last one the first), as nanoGPT trains:
    # with the tokens themselves as targets, the tied embedding made the loss 0 from the
    # first step (the model reads its answer), and losses that agree said nothing
    return _NanoGPT(4, 256, 4, TOKENS, VOCAB), lambda model, ids: model(ids, ids.roll(-1, 1))


def _gpt2() -> tuple[torch.nn.Module, object]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=TOKENS, vocab_size=VOCAB,
                     resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0,
                     attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg), lambda model, ids: model(ids, labels=ids).loss


CASES = {"nanogpt": _nanogpt, "gpt2": _gpt2}


def check(name: str, bf16: bool, steps: int, device: str = "cuda") -> None:
    """Train case ``name`` compiled and eagerly for ``steps`` steps; print the comparison."""
    torch.manual_seed(0)
    model, loss_of = CASES[name]()
    model = model.to(device)
    eager = copy.deepcopy(model)
    opt, eager_opt = (torch.optim.AdamW(m.parameters(), lr=6e-4) for m in (model, eager))

    def step(model, opt, ids):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    compiled = fxlite.compile(step)
    label = f"{name} {'bf16' if bf16 else 'f32'}"
    for i in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, TOKENS), device=device)
        got, want = compiled(model, opt, ids), step(eager, eager_opt, ids)
        print(f"{label} step {i}: loss {got.item():.6f}, eager {want.item():.6f}", flush=True)
    worst = max((p.float() - q.float()).abs().max().item()
                for p, q in zip(model.state_dict().values(), eager.state_dict().values()))
    kinds = collections.Counter(
        getattr(getattr(k, "group", None), "meta", {}).get("fused_kind")
        for seg in compiled._last for k in seg.compiled.kernels)
    print(f"{label}: largest parameter difference {worst:.3g}; fallbacks "
          f"{compiled.fallbacks}; groups {dict(kinds)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: "
                        + ", ".join(CASES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda",
                        help="cpu runs the kernels in Triton's interpreter (slow; set "
                             "TRITON_INTERPRET=1)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in args.cases.split(","):
        for bf16 in (False, True):
            check(name, bf16, args.steps, args.device)


if __name__ == "__main__":
    main()
