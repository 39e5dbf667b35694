"""GPU benchmark of fused groups under autograd: forward + backward, side by side.

Run on a CUDA machine::

    python benchmarks/bench_autograd.py            # every case, f32 and bf16
    python benchmarks/bench_autograd.py --quick    # two cases, f32

Each case is a function traced and run through the compile passes (normalize, seeded
dropout, decompose, ShapeProp, fuse) with every group swapped for its autograd callable
(``fxlite.codegen.lower.autograd.swap_in_autograd``); the time is one forward plus one
backward with a fixed output gradient. Eager PyTorch and ``torch.compile`` (inductor) run
the same step in the same process. Times are medians of ``triton.testing.do_bench``;
the bandwidth column counts each input, output and gradient tensor once, read or written,
as a share of a device-to-device copy timed first. Kernel counts are fxlite's forward and
backward kernels.
"""

from __future__ import annotations

import argparse
import os
import tempfile

_CACHE = tempfile.mkdtemp(prefix="fxlite-bench-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHE, "triton"))
os.environ.setdefault("FXLITE_CACHE_DIR", os.path.join(_CACHE, "fxlite"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from fxlite.codegen.lower.autograd import swap_in_autograd  # noqa: E402
from fxlite.passes.decompose import decompose  # noqa: E402
from fxlite.passes.fuse import fuse  # noqa: E402
from fxlite.passes.normalize import normalize  # noqa: E402
from fxlite.passes.shape_prop import ShapeProp  # noqa: E402

import fxlite  # noqa: E402
from fxlite.ops.dropout import seed_dropouts  # noqa: E402


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def softmax(x):
    return torch.softmax(x, dim=-1)


def gelu_gate(a, b):
    return F.gelu(a) * F.silu(b)


def rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)


def residual_dropout(x, r):
    return F.dropout(x, 0.1, training=True) + r


def bias_gelu(x, b):
    return F.gelu(x + b, approximate="tanh")


# name: (fn, shapes of the inputs; the last dim is the row), rows x cols
ROWS, COLS = 16 * 1024, 1024
CASES = {
    "layer_norm": (layer_norm, [(ROWS, COLS), (COLS,), (COLS,)]),
    "softmax": (softmax, [(ROWS, COLS)]),
    "gelu*silu": (gelu_gate, [(ROWS, 4 * COLS), (ROWS, 4 * COLS)]),
    "rms_norm": (rms_norm, [(ROWS, COLS), (COLS,)]),
    "dropout+residual": (residual_dropout, [(ROWS, COLS), (ROWS, COLS)]),
    "bias+gelu(tanh)": (bias_gelu, [(ROWS, 4 * COLS), (4 * COLS,)]),
}


def fxlite_version(fn, inputs):
    gm = normalize(fxlite.symbolic_trace(fn))
    gm = seed_dropouts(gm)
    ShapeProp(gm).propagate(*inputs)
    gm = decompose(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ShapeProp(gm).propagate(*inputs)
    fused = fuse(gm)
    return fused, swap_in_autograd(fused)


def step(fn, inputs, grad):
    def run():
        out = fn(*inputs)
        out.backward(grad)
    return run


def copy_time(nbytes):
    a = torch.empty(nbytes // 4, device="cuda")
    b = torch.empty_like(a)
    return triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    dtypes = [torch.float32] if opts.quick else [torch.float32, torch.bfloat16]
    names = ["layer_norm", "softmax"] if opts.quick else list(CASES)
    copy_ms = copy_time(1 << 30)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; copy of 1 GiB: {copy_ms:.3f} ms")
    print(f"{'case':18} {'dtype':9} {'eager ms':>9} {'inductor':>9} {'fxlite':>9} "
          f"{'fx/eager':>9} {'fx/ind':>7} {'fx %copy':>9} {'kernels':>8}")
    for dtype in dtypes:
        for name in names:
            fn, shapes = CASES[name]
            inputs = [torch.randn(s, device="cuda", dtype=dtype, requires_grad=True)
                      for s in shapes]
            grad = torch.randn_like(fn(*inputs))
            fused, groups = fxlite_version(fn, inputs)
            compiled = torch.compile(fn)
            times = {}
            for label, f in (("eager", fn), ("inductor", compiled), ("fxlite", fused)):
                times[label] = triton.testing.do_bench(step(f, inputs, grad),
                                                       grad_to_none=inputs,
                                                       return_mode="median")
            # bytes: inputs read twice (forward, backward), output and grad once, input
            # grads written once
            moved = sum(3 * t.numel() * t.element_size() for t in inputs) + \
                2 * grad.numel() * grad.element_size()
            share = copy_ms * moved / (2 * (1 << 30)) / times["fxlite"] * 100
            kernels = [k for g in groups.values() for k in g.kernels]
            fw = sum(k.direction == "forward" for k in kernels)
            falls = [f for g in groups.values() for f in g.fallbacks]
            print(f"{name:18} {str(dtype)[6:]:9} {times['eager']:9.3f} {times['inductor']:9.3f} "
                  f"{times['fxlite']:9.3f} {times['eager'] / times['fxlite']:9.2f} "
                  f"{times['inductor'] / times['fxlite']:7.2f} {share:8.0f}% "
                  f"{fw:>3}+{len(kernels) - fw:<3}" + (f"  fallbacks: {falls}" if falls else ""))


if __name__ == "__main__":
    main()
