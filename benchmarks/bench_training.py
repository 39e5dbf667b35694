"""Training steps on the GPU: eager vs torch.compile vs fxlite.compile, side by side.

Run on a CUDA machine (torchvision and transformers installed)::

    python benchmarks/bench_training.py               # resnet18 and a GPT-2 block
    python benchmarks/bench_training.py --quick       # fewer timed steps
    python benchmarks/bench_training.py --mode reduce-overhead   # both compilers' CUDA graphs

Each compiler compiles the whole step, as the compile tutorial does::

    def train(model, opt, x, y):
        opt.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); opt.step()

or, with ``--compile model``, only the model: ``model = compiler(model)``, with the
step's loss, backward and optimizer left to eager (as inside DistributedDataParallel).

Cases (``--cases``; ``gpt2_lm_step``, ``gpt2_124m``, ``nanogpt_124m``, ``resnet50`` and
``vit_b_16`` on request): the
tutorial's resnet18 step (batch 16, 128x128 images, Adam) in float32, and a
GPT-2 block step (transformers' GPT2Block, batch 8 x 256 tokens, AdamW, dropout off) in
float32 and under bfloat16 autocast. Contenders: eager, eager with the optimizer's own
``fused=True`` kernels (which needs no compiler), torch.compile and fxlite.compile.
Reported per case: the median step time of each contender (CUDA events around each step,
after warm-up; the steps are timed in three rounds, each round timing every contender in
turn, and the median of the rounds' medians is reported), speedups over eager and against
inductor, cold compile (the first step, fresh caches), the kernels fxlite ran
(forward/backward), and the largest relative difference of the first steps' losses from
eager's (same data and initial weights; every contender starts from a copy of one model),
over the first 20 steps, whose total time is reported too, with each contender's peak
memory (less what the contenders before it hold). ``gpt2_lm_step`` is transformers'
GPT2LMHeadModel (6 layers, width 512, batch 8 x 512) with ``labels=``, bfloat16 autocast,
gradient clipping, AdamW and ``zero_grad(set_to_none=True)``. ``resnet50`` and
``vit_b_16`` are the resnet18 step's model swapped for torchvision's, at batch 32 and
224x224 images (1000 classes). ``gpt2_124m`` is the issue's GPT-2 124M step (batch 8 x 1024
tokens); its utilisation (6 x parameters x tokens a step over 989 TFLOP/s, an H100's dense
bfloat16 peak) is printed beside its times; ``nanogpt_124m`` is the same step on nanoGPT's
own model (tied head, the loss on the 16-bit logits under autocast), counted alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

_CACHE = tempfile.mkdtemp(prefix="fxlite-bench-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHE, "triton"))
os.environ.setdefault("FXLITE_CACHE_DIR", os.path.join(_CACHE, "fxlite"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

import fxlite  # noqa: E402


def resnet18_case():
    return vision_case("resnet18", 16, 128, 10)


def vision_case(name, batch, size, classes):
    """A torchvision classifier's step: cross-entropy on random images, Adam."""
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=classes).cuda()
    data = [(torch.randn(batch, 3, size, size, device="cuda"),
             torch.randint(0, classes, (batch,), device="cuda")) for _ in range(4)]

    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return model, lambda m, **kw: torch.optim.Adam(m.parameters(), lr=1e-3, **kw), data, step, None


def gpt2_block_case(dtype):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    # dropout off, so the contenders' losses can be compared step by step
    cfg = GPT2Config(n_embd=768, n_head=12, n_positions=256, attn_implementation="sdpa",
                     resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    block = GPT2Block(cfg).cuda()
    data = [(torch.randn(8, 256, 768, device="cuda"), None) for _ in range(4)]

    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = model(x)
            hidden = out[0] if isinstance(out, tuple) else out
            loss = hidden.float().square().mean()
        loss.backward()
        opt.step()
        return loss
    return (block, lambda m, **kw: torch.optim.AdamW(m.parameters(), lr=1e-4, **kw), data, step,
            dtype)


def gpt2_lm_step_case():
    """The faithful-Python issue's nanoGPT-style step: transformers' GPT2LMHeadModel (6
    layers, width 512) called with ``labels=``, bfloat16 autocast, ``clip_grad_norm_``,
    AdamW and ``zero_grad(set_to_none=True)``; batch 8 x 512 tokens, dropout off."""
    return _gpt2_lm_case(dict(n_layer=6, n_embd=512, n_head=8, n_positions=512), 512, 1e-4)


def gpt2_124m_case():
    """GPT-2 124M as nanoGPT and llm.c train it: transformers' GPT2LMHeadModel at its
    default size (12 layers, width 768, 1024 positions), batch 8 x 1024 tokens, bfloat16
    autocast, ``clip_grad_norm_``, AdamW (its fused kernels in the ``eager_fused`` row) and
    ``zero_grad(set_to_none=True)``; dropout off."""
    return _gpt2_lm_case({}, 1024, 6e-4)


def _gpt2_lm_case(sizes, tokens, lr):
    """A GPT2LMHeadModel step (the two cases above): ``sizes`` for its config, batch 8 x
    ``tokens``, AdamW at ``lr``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**sizes, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0,
                     attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg).cuda()
    data = [(torch.randint(0, cfg.vocab_size, (8, tokens), device="cuda"), None)
            for _ in range(4)]

    def step(model, opt, ids, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return (model, lambda m, **kw: torch.optim.AdamW(m.parameters(), lr=lr, **kw), data,
            step, torch.bfloat16)


class _NanoBlock(torch.nn.Module):
    """nanoGPT's block (karpathy/nanoGPT model.py, written here): pre-LayerNorm causal
    attention through ``scaled_dot_product_attention``, and a GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.c_attn = torch.nn.Linear(width, 3 * width)
        self.c_proj = torch.nn.Linear(width, width)
        self.c_fc = torch.nn.Linear(width, 4 * width)
        self.mlp_proj = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class _NanoGPT(torch.nn.Module):
    """nanoGPT's GPT: token and position embeddings, blocks, a final LayerNorm and a head
    tied to the token embedding; ``forward(idx, targets)`` returns the mean cross-entropy of
    the 16-bit logits, as nanoGPT's training loop calls it under autocast."""

    def __init__(self, layers: int, width: int, heads: int, positions: int, vocab: int):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(positions, width)
        self.h = torch.nn.ModuleList(_NanoBlock(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)


def nanogpt_124m_case():
    """nanoGPT's own model (not transformers') at GPT-2 124M's size, batch 8 x 1024 tokens,
    its training loop's step: the loss under bfloat16 autocast, ``clip_grad_norm_``, AdamW,
    ``zero_grad(set_to_none=True)``; dropout off."""
    torch.manual_seed(0)
    model = _NanoGPT(12, 768, 12, 1024, 50257).cuda()
    data = [(torch.randint(0, 50257, (8, 1024), device="cuda"),
             torch.randint(0, 50257, (8, 1024), device="cuda")) for _ in range(4)]

    def step(model, opt, ids, targets):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return (model, lambda m, **kw: torch.optim.AdamW(m.parameters(), lr=6e-4, **kw), data,
            step, torch.bfloat16)


# Steps before timing, for every contender alike: fxlite's trial takes 10 calls, and 16
# under reduce-overhead for a training step (each side is observed 3 times and captured
# before it is timed: codegen/runtime/trial.py).
WARMUP = 24


def time_steps(step, model, opt, data, steps):
    times = []
    for i in range(steps):
        x, y = data[i % len(data)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(model, opt, x, y)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


ROUNDS = 3  # timed rounds; each round times every contender in turn


def run_case(name, case, steps, mode=None, what="step"):
    """One case: each contender's cold step, first 20 steps and peak memory in turn, then
    the steady-state steps in ``ROUNDS`` interleaved rounds (every contender's model and
    optimizer stay alive), so that a slow spell of the host falls on all of them alike."""
    base, make_opt, data, step, _ = case
    results, losses, live = {}, {}, {}
    fx_step = None
    torch.cuda.synchronize()
    at_start = torch.cuda.memory_allocated()
    for label in ("eager", "eager_fused", "torch.compile", "fxlite"):
        # memory held by the contenders before this one, left out of this one's peaks
        others = torch.cuda.memory_allocated() - at_start
        model = copy.deepcopy(base)
        # eager_fused: eager with the optimizer's own fused=True kernels, which a user
        # can ask for without any compiler
        opt = make_opt(model, fused=True) if label == "eager_fused" else make_opt(model)
        if label.startswith("eager"):
            fn = step
        elif what == "model":  # (the optimizer holds the same parameters)
            fn = step
            model = (torch.compile if label == "torch.compile" else fxlite.compile)(
                model, mode=mode)
        elif label == "torch.compile":
            fn = torch.compile(step, mode=mode)
        else:
            fn = fxlite.compile(step, mode=mode)
        if label == "fxlite":
            fx_step = model if what == "model" else fn
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        first = fn(model, opt, *data[0])
        torch.cuda.synchronize()
        cold = time.perf_counter() - start
        # the first 20 steps' losses (the rest of the warm-up: new layouts, the trial,
        # graph captures), and their total time
        losses[label] = [float(first)] + [float(fn(model, opt, *data[i % len(data)]))
                                          for i in range(1, 20)]
        torch.cuda.synchronize()
        first20 = time.perf_counter() - start
        for i in range(WARMUP - 16):
            fn(model, opt, *data[i % len(data)])
        peak = (torch.cuda.max_memory_allocated() - others) / 2**30
        torch.cuda.reset_peak_memory_stats()
        for i in range(4):
            fn(model, opt, *data[i % len(data)])
        torch.cuda.synchronize()
        results[label] = {"cold_s": cold, "first20_s": first20, "peak_gib": peak,
                          "steady_peak_gib": (torch.cuda.max_memory_allocated() - others)
                          / 2**30, "times": []}
        live[label] = (fn, model, opt)
    per_round = max(1, steps // ROUNDS)
    for _ in range(ROUNDS):
        for label, (fn, model, opt) in live.items():
            results[label]["times"].append(time_steps(fn, model, opt, data, per_round))
    for r in results.values():
        r["ms"] = statistics.median(r["times"])
    del live
    torch.cuda.empty_cache()
    eager_ms, ind_ms, fx_ms = (results[k]["ms"] for k in ("eager", "torch.compile", "fxlite"))
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["fxlite"], losses["eager"]))
    kernels = fx_step.kernels if fx_step is not None else []
    directions = [getattr(k, "direction", "forward") for k in kernels]
    return {"case": name, "mode": mode or "default", "compiled": what, **{f"{k}_ms": v["ms"] for k, v in results.items()},
            **{f"{k}_round_ms": v["times"] for k, v in results.items()},
            **{f"{k}_cold_s": v["cold_s"] for k, v in results.items()},
            **{f"{k}_first20_s": v["first20_s"] for k, v in results.items()},
            **{f"{k}_peak_gib": v["peak_gib"] for k, v in results.items()},
            **{f"{k}_steady_peak_gib": v["steady_peak_gib"] for k, v in results.items()},
            "losses": losses,
            "fxlite_vs_eager": eager_ms / fx_ms, "fxlite_vs_inductor": ind_ms / fx_ms,
            "inductor_vs_eager": eager_ms / ind_ms, "loss_max_rel_diff": rel,
            "fxlite_vs_eager_fused": results["eager_fused"]["ms"] / fx_ms,
            "kernels_forward": directions.count("forward"),
            "kernels_backward": directions.count("backward"),
            "fallbacks": list(fx_step.fallbacks) if fx_step is not None else [],
            "fxlite_tier": getattr(fx_step, "tier", "-").split(":")[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--cases", default="resnet18,gpt2_block_f32,gpt2_block_bf16")
    parser.add_argument("--mode", default=None, help="compile mode of both compilers "
                        "(default, reduce-overhead, max-autotune)")
    parser.add_argument("--compile", default="step", choices=("step", "model"),
                        help="what each compiler compiles: the whole step, or the model only")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_training.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    makers = {"resnet18": resnet18_case,
              "gpt2_block_f32": lambda: gpt2_block_case(torch.float32),
              "gpt2_block_bf16": lambda: gpt2_block_case(torch.bfloat16),
              "gpt2_lm_step": gpt2_lm_step_case, "gpt2_124m": gpt2_124m_case,
              "nanogpt_124m": nanogpt_124m_case,
              "resnet50": lambda: vision_case("resnet50", 32, 224, 1000),
              "vit_b_16": lambda: vision_case("vit_b_16", 32, 224, 1000)}
    steps = 10 if args.quick else 30
    rows = []
    for name in args.cases.split(","):
        rows.append(run_case(name, makers[name](), steps, args.mode, args.compile))
        r = rows[-1]
        print(f"{name}: eager {r['eager_ms']:.2f} ms, inductor {r['torch.compile_ms']:.2f}, "
              f"fxlite {r['fxlite_ms']:.2f} ({r['fxlite_tier']}); peak GiB eager "
              f"{r['eager_peak_gib']:.2f}, inductor {r['torch.compile_peak_gib']:.2f}, fxlite "
              f"{r['fxlite_peak_gib']:.2f} (steady state: {r['eager_steady_peak_gib']:.2f}, "
              f"{r['torch.compile_steady_peak_gib']:.2f}, {r['fxlite_steady_peak_gib']:.2f})"
              f"; first 20 steps s: eager {r['eager_first20_s']:.1f}, "
              f"inductor {r['torch.compile_first20_s']:.1f}, fxlite {r['fxlite_first20_s']:.1f}"
              f"; fallbacks: {r['fallbacks'][:3]}", flush=True)
        if name in ("gpt2_124m", "nanogpt_124m"):
            # 6 x parameters x tokens a step (forward and backward), over an H100's dense
            # bfloat16 peak, as the issue and llm.c count utilisation
            flop = 6 * 124_439_808 * 8 * 1024
            print("utilisation: " + ", ".join(
                f"{k} {flop / (r[k + '_ms'] * 1e-3) / 989e12:.1%}"
                for k in ("eager", "eager_fused", "torch.compile", "fxlite")), flush=True)
    print(f"\ndevice: {torch.cuda.get_device_name()}; torch {torch.__version__}; median of "
          f"{ROUNDS} interleaved rounds of {max(1, steps // ROUNDS)} steps; TF32 on; mode "
          f"{args.mode or 'default'}; compiled: the {args.compile}")
    print(tabulate([[r["case"], f"{r['eager_ms']:.2f}", f"{r['torch.compile_ms']:.2f}",
                     f"{r['fxlite_ms']:.2f}", f"{r['eager_fused_ms']:.2f}",
                     f"{r['fxlite_vs_eager']:.2f}x", f"{r['fxlite_vs_eager_fused']:.2f}x",
                     f"{r['inductor_vs_eager']:.2f}x", f"{r['fxlite_vs_inductor']:.2f}x",
                     f"{r['torch.compile_cold_s']:.1f}", f"{r['fxlite_cold_s']:.1f}",
                     f"{r['kernels_forward']}/{r['kernels_backward']}",
                     f"{r['loss_max_rel_diff']:.1e}"] for r in rows],
                   headers=["case", "eager ms", "inductor ms", "fxlite ms",
                            "eager fused-optimizer ms", "fxlite vs eager",
                            "fxlite vs eager fused-optimizer",
                            "inductor vs eager", "fxlite vs inductor", "inductor cold s",
                            "fxlite cold s", "kernels fwd/bwd", "loss rel diff"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
