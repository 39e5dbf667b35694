"""What a conv net's convolutions cost on their first call in each layout, eagerly.

Run on a CUDA machine (torchvision installed)::

    PYTHONPATH=$PWD python benchmarks/cudnn_first_calls.py efficientnet_b0:f32 [--threads 8]

A compile that runs a net channels-last pays cuDNN's first call of every convolution
shape in that layout, on the thread that calls it; eager, in NCHW, pays its own. For each
case (a torchvision model by name, ``f32`` or ``bf16``, batch 32, TF32 on) the model runs
one NCHW forward (its convolutions' input shapes are read by forward hooks), then every
convolution runs once by itself, synced and timed: channels-last (input and weight),
channels-last again, then NCHW (which the forward has run once already, as eager would).
Printed per pass: the seconds summed over depthwise convolutions (``groups > 1``) and
over the others, and the four slowest calls.

``--threads N`` first calls each distinct depthwise shape once on a pool of N threads,
then times the channels-last pass on the main thread: whether work on other threads
(the parallel precompile's) can take the first calls' cost off the main thread.

``--benchmark`` turns on cuDNN's benchmark mode (``torch.backends.cudnn.benchmark``: it
times the engines on a shape's first call); ``--steady`` adds, per layout, the summed
steady-state time of the convolutions (``triton.testing.do_bench`` each), for a mode or
layout that makes the first calls cheap only to cost each later call. torch's
``TORCH_CUDNN_V8_API_DISABLED=1`` in the environment runs cuDNN's older API where torch
still has it.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _shapes(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[Any, torch.Size]]:
    """Each conv2d of ``model`` and its input's shape in an NCHW forward at batch 32."""
    found: list[tuple[Any, torch.Size]] = []
    hooks = [m.register_forward_hook(lambda m, i, o: found.append((m, i[0].shape)))
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(torch.randn(32, 3, 224, 224, device="cuda", dtype=dtype))
    torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    return found


def _operands(conv: Any, shape: torch.Size, dtype: torch.dtype, channels_last: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh input of ``shape`` and ``conv``'s weight, in the layout asked for."""
    x, w = torch.randn(shape, device="cuda", dtype=dtype), conv.weight
    if channels_last:
        x, w = (t.contiguous(memory_format=torch.channels_last) for t in (x, w))
    return x, w


def _call(conv: Any, shape: torch.Size, dtype: torch.dtype, channels_last: bool) -> float:
    """Seconds of one synced call of ``conv`` on a fresh input of ``shape``."""
    x, w = _operands(conv, shape, dtype, channels_last)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        F.conv2d(x, w, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _report(label: str, convs: list[tuple[Any, torch.Size]], dtype: torch.dtype,
            channels_last: bool) -> None:
    totals = {"depthwise": 0.0, "other": 0.0}
    calls = []
    for conv, shape in convs:
        seconds = _call(conv, shape, dtype, channels_last)
        totals["depthwise" if conv.groups > 1 else "other"] += seconds
        calls.append((seconds, tuple(shape), conv.kernel_size, conv.stride, conv.groups))
    print(f"  {label}: " + ", ".join(f"{k} {v:.3f} s" for k, v in totals.items()), flush=True)
    for seconds, shape, k, s, g in sorted(calls, reverse=True)[:4]:
        print(f"    {seconds:.3f} s  input {shape} kernel {k} stride {s} groups {g}")


def _steady(convs: list[tuple[Any, torch.Size]], dtype: torch.dtype) -> None:
    """The summed steady-state ms of the convolutions, depthwise and other, per layout."""
    from triton.testing import do_bench

    for channels_last in (True, False):
        totals = {"depthwise": 0.0, "other": 0.0}
        for conv, shape in convs:
            x, w = _operands(conv, shape, dtype, channels_last)
            with torch.no_grad():
                totals["depthwise" if conv.groups > 1 else "other"] += do_bench(
                    lambda c=conv, x=x, w=w: F.conv2d(x, w, c.bias, c.stride, c.padding,
                                                      c.dilation, c.groups))
        print(f"  steady, {'channels-last' if channels_last else 'NCHW'}: "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in totals.items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", help="comma-separated torchvision model:dtype (f32 or bf16)")
    p.add_argument("--threads", type=int, default=0,
                   help="first call the depthwise shapes on this many threads first")
    p.add_argument("--benchmark", action="store_true", help="cuDNN's benchmark mode on")
    p.add_argument("--steady", action="store_true",
                   help="add each layout's summed steady-state time")
    args = p.parse_args()
    import torchvision

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = args.benchmark
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, benchmark "
          f"mode {args.benchmark}")
    for case in args.cases.split(","):
        name, dtype_name = case.split(":")
        dtype = DTYPES[dtype_name]
        model = getattr(torchvision.models, name)().cuda().eval().to(dtype)
        convs = _shapes(model, dtype)
        print(f"{case}: {len(convs)} convolutions", flush=True)
        if args.threads:
            distinct = {(tuple(s), c.kernel_size, c.stride, c.padding): (c, s)
                        for c, s in convs if c.groups > 1}
            start = time.perf_counter()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(lambda cs, d=dtype: _call(*cs, d, True), distinct.values()))
            print(f"  {len(distinct)} depthwise shapes on {args.threads} threads: "
                  f"{time.perf_counter() - start:.3f} s")
        _report("channels-last, first", convs, dtype, True)
        _report("channels-last, again", convs, dtype, True)
        _report("NCHW", convs, dtype, False)
        if args.steady:
            _steady(convs, dtype)


if __name__ == "__main__":
    main()
