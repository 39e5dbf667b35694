"""Channel broadcasts and permuted layouts on the GPU: the kernels of conv nets, one by one.

Eval-mode batch_norm (+ ReLU, + residual), a conv bias add, convnext's layer scale over
a permuted tensor, and copies between NCHW and channels-last (activations and conv
weights), at resnet50 / convnext_tiny shapes, in NCHW and channels-last memory,
f32 and bf16: eager, torch.compile (inductor) and fxlite.compile side by side, each as a
percentage of a device-to-device copy of the same bytes measured in this run::

    PYTHONPATH=$PWD python benchmarks/bench_layouts.py [--quick] [--json OUT]

Bytes are each input read once plus the output written; medians of
``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

_CACHE = tempfile.mkdtemp(prefix="fxlite-bench-layouts-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHE, "triton"))
os.environ.setdefault("FXLITE_CACHE_DIR", os.path.join(_CACHE, "fxlite"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402

import fxlite  # noqa: E402


def bn_relu(x, m, v, w, b):
    return F.relu(F.batch_norm(x, m, v, w, b, False, 0.1, 1e-5))


def bn_add_relu(x, m, v, w, b, r):
    return F.relu(F.batch_norm(x, m, v, w, b, False, 0.1, 1e-5) + r)


def bias_add(x, b):
    return x + b.reshape(-1, 1, 1)


def layer_scale(y, g, r):
    return g * y.permute(0, 3, 1, 2) + r


def to_channels_last(x):
    return torch.clone(x, memory_format=torch.channels_last)


def to_contiguous(x):
    return torch.clone(x, memory_format=torch.contiguous_format)


def cases(dtype: torch.dtype, quick: bool) -> list[tuple[str, object, list[torch.Tensor]]]:
    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    def cl(x):
        return x.to(memory_format=torch.channels_last)

    def stats(c):
        return [t(c), t(c).abs() + 0.5, t(c), t(c)]

    n = 8 if quick else 32
    out = []
    for name, shape in (("resnet 256x56x56", (n, 256, 56, 56)), ("resnet 2048x7x7", (n, 2048, 7, 7))):
        x = t(*shape)
        out += [(f"bn+relu NCHW {name}", bn_relu, [x] + stats(shape[1])),
                (f"bn+relu NHWC {name}", bn_relu, [cl(x)] + stats(shape[1])),
                (f"bn+add+relu NCHW {name}", bn_add_relu, [x] + stats(shape[1]) + [t(*shape)]),
                (f"bn+add+relu NHWC {name}", bn_add_relu,
                 [cl(x)] + stats(shape[1]) + [cl(t(*shape))])]
    x = t(n, 96, 56, 56)
    out += [("conv bias NCHW 96x56x56", bias_add, [x, t(96)]),
            ("conv bias NHWC 96x56x56", bias_add, [cl(x), t(96)]),
            ("layer scale, NCHW residual", layer_scale, [t(n, 56, 56, 96), t(96, 1, 1), x]),
            ("layer scale, NHWC residual", layer_scale, [t(n, 56, 56, 96), t(96, 1, 1), cl(x)])]
    # layout conversions: a conv net's input and weights going channels-last (each
    # training step converts its weights), and activations coming back
    x, w = t(n, 256, 56, 56), t(512, 512, 3, 3)
    out += [("to NHWC 256x56x56", to_channels_last, [x]),
            ("to NCHW 256x56x56", to_contiguous, [cl(x)]),
            ("to NHWC weight 512x512x3x3", to_channels_last, [w]),
            ("to NCHW weight 512x512x3x3", to_contiguous, [cl(w)])]
    return out[:3] + out[-6:-4] + out[-3:-1] if quick else out


def nbytes(tensors) -> int:
    return sum(x.untyped_storage().nbytes() for x in tensors if isinstance(x, torch.Tensor))


def ms(fn, args) -> float:
    return triton.testing.do_bench(lambda: fn(*args), warmup=25, rep=200, return_mode="median")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_layouts.py needs a CUDA device")
    big = torch.empty(1 << 28, device="cuda", dtype=torch.uint8)
    other = torch.empty_like(big)
    copy_gbs = 2 * big.numel() / ms(lambda: other.copy_(big), []) / 1e6
    rows = []
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for name, fn, inputs in cases(dtype, args.quick):
                want = fn(*inputs)
                moved = nbytes(inputs) + want.untyped_storage().nbytes()
                row = {"case": name, "dtype": str(dtype).replace("torch.", ""), "MB": moved / 1e6}
                for label, compiled in (("eager", fn), ("inductor", torch.compile(fn)),
                                        ("fxlite", fxlite.compile(fn))):
                    got = compiled(*inputs)
                    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
                    t = ms(compiled, inputs)
                    row[f"{label}_ms"] = t
                    row[f"{label}_%copy"] = 100 * moved / t / 1e6 / copy_gbs
                    if label == "fxlite":
                        row["fxlite_kernels"] = len(compiled.kernels)
                        row["fxlite_fallbacks"] = len(compiled.fallbacks)
                        row["fxlite_out_stride_like_eager"] = got.stride() == want.stride()
                rows.append(row)
                print(f"{name:32} {row['dtype']:9} eager {row['eager_%copy']:6.1f}%  "
                      f"inductor {row['inductor_%copy']:6.1f}%  fxlite {row['fxlite_%copy']:6.1f}% "
                      f"({row['fxlite_kernels']} kernels, {row['fxlite_fallbacks']} fallbacks)")
    print(f"copy: {copy_gbs:.0f} GB/s on {torch.cuda.get_device_name()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBs": copy_gbs, "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "triton": triton.__version__,
                       "command": sys.argv, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
