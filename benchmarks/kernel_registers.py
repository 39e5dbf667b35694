"""Registers and spills of fxlite's row kernels (layer_norm, rms_norm, softmax), compiled
for an H100/H200 (sm_90) on any machine: no GPU needed.

Run anywhere Triton ships its ``ptxas`` and ``cuobjdump`` (its CUDA backend)::

    python benchmarks/kernel_registers.py

A child process builds each kernel under Triton's interpreter (``fxlite.compile`` on small
CPU tensors) and writes its GPU source (libdevice on, as on a GPU); this process compiles
the persistent variant for sm_90 at rows of 8192 and 16,384 with 4 to 32 warps and prints
registers a thread and stack bytes (spills) from ``cuobjdump --dump-resource-usage``. An
SM holds 65,536 registers: a program of 16 warps at 128 registers a thread fills one, so
the count says how many programs of a wide row run at once. Registers are deterministic,
unlike the timings of these kernels, which move by up to a third between machines.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile


def _dump(folder: str) -> None:
    """(Child, under the interpreter.) Write each kernel's GPU source to ``folder``."""
    import torch
    from fxlite.codegen.kernels.generate import generate_source
    from fxlite.codegen.runtime import kernel as runtime_kernel

    import fxlite

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sweep_row_configs as sweep  # its recorder of each kernel's latest inputs
    from bench_kernels import layer_norm, rms_norm, softmax

    runtime_kernel.TritonKernel.__call__ = sweep._recording_call
    for fn, n in ((layer_norm, 3), (rms_norm, 2), (softmax, 1)):
        for dtype in (torch.float32, torch.bfloat16):
            args = [torch.randn(4, 64, dtype=dtype)] + [torch.randn(64, dtype=dtype)
                                                        for _ in range(n - 1)]
            compiled = fxlite.compile(fn)
            compiled(*args)
            k = compiled.kernels[0]
            _, src = generate_source(k.group, list(sweep._SEEN[k.name]), True)
            with open(os.path.join(folder, f"{fn.__name__}_{str(dtype)[6:]}.py"), "w") as f:
                f.write(src.text)


def _usage(cubin: bytes, cuobjdump: str) -> tuple[int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", out)[1]), int(re.search(r"STACK:(\d+)", out)[1])


def main() -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated
    folder = tempfile.mkdtemp(prefix="fxlite-regs-")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, __file__, "--dump", folder], env=env, check=True)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    target = GPUTarget("cuda", 90, 32)
    print(f"triton {triton.__version__}, sm_90; registers a thread / stack bytes (spills)")
    for path in sorted(os.listdir(folder)):
        spec = importlib.util.spec_from_file_location(path[:-3], os.path.join(folder, path))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = next(getattr(module, a) for a in dir(module) if a.endswith("_persistent"))
        ptr = "*bf16" if "bfloat16" in path else "*fp32"
        sig = {a: ptr if a.endswith("_ptr") else "constexpr" if a in ("ROWS", "BLOCK_C")
               else "i64" if a.startswith("in") else "i32" for a in fn.arg_names}
        for width in (8192, 16384):
            cells = []
            for warps in (4, 8, 16, 32):
                k = triton.compile(ASTSource(fn, sig, {"ROWS": 1, "BLOCK_C": width}),
                                   target=target, options={"num_warps": warps})
                regs, stack = _usage(k.asm["cubin"], cuobjdump)
                cells.append(f"{warps:2d} warps {regs:3d} / {stack:3d}")
            print(f"{path[:-3]:20s} {width:6d}   " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--dump"]:
        _dump(sys.argv[2])
    else:
        main()
