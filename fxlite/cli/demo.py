"""``fxlite demo``: trace, print, rewrite and compile the bundled example block.

The four steps a new user meets first, on :class:`fxlite.examples.ExampleBlock`:

1. ``symbolic_trace`` and the node table, with shapes from ``ShapeProp``;
2. the generated ``forward()``;
3. a graph rewrite (relu -> gelu), shown as a before/after diff and checked against an
   eager gelu block;
4. ``fxlite.compile``: on a GPU when there is one, otherwise on the tiny input through
   Triton's interpreter; the kernel report, and a check against eager.

Every line fits in 100 columns. It takes a few seconds on a laptop CPU.
"""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import time
from typing import TYPE_CHECKING, TextIO

import torch
import torch.nn.functional as F

import fxlite as fx
from fxlite.cli.commands import KernelCount, say, use_interpreter, wrap_code
from fxlite.cli.progress import Progress
from fxlite.examples import example_input, make_example
from fxlite.logs import kernel_listener
from fxlite.passes import ShapeProp, diff
from fxlite.viz.tabular import tabular

if TYPE_CHECKING:
    from fxlite.graph import Graph

__all__ = ["GPU_INPUT_SHAPE", "relu_to_gelu", "run_demo"]

GPU_INPUT_SHAPE = (32, 256, 8)
"""The (batch, sequence, feature) input of the compile step on a GPU."""

# Every spelling of relu that a traced graph may hold; the demo turns each into gelu.
_RELU_FUNCTIONS = (torch.relu, F.relu)


def relu_to_gelu(graph: Graph) -> int:
    """Point every relu node of ``graph`` at ``F.gelu``; return how many were changed.

    Example::

        gm = fxlite.symbolic_trace(block)
        relu_to_gelu(gm.graph)
        gm.recompile()
    """
    changed = 0
    for node in graph.nodes:  # iterating while erasing is safe
        is_relu = ((node.op == "call_function" and node.target in _RELU_FUNCTIONS)
                   or (node.op == "call_method" and node.target == "relu"))
        if not is_relu:
            continue
        # Put a gelu node in front of the relu, move the relu's users to it, drop the relu.
        # (`inplace`, which F.relu takes and gelu does not, is left behind.)
        with graph.inserting_before(node):
            gelu = graph.call_function(F.gelu, node.args[:1])
        node.replace_all_uses_with(gelu)
        graph.erase_node(node)
        changed += 1
    return changed


def _heading(text: str) -> str:
    return f"\n== {text} " + "=" * max(0, 96 - len(text))


def run_demo(seed: int = 0, out: TextIO | None = None, compile: bool = True) -> int:
    """Trace the bundled example, print its table and code, rewrite it, compile it, check.

    Args:
        seed: seeds the example's weights and its random input.
        out: where to print; ``sys.stdout`` by default.
        compile: run step 4 (``fxlite.compile``).

    Returns:
        0 if every check against eager PyTorch passes, else 1.

    Example::

        >>> run_demo()  # doctest: +SKIP
        0
    """
    out = out if out is not None else sys.stdout
    with contextlib.redirect_stdout(out):
        model = make_example(seed=seed)
        x = example_input(seed=seed)
        say("fxlite demo: trace, rewrite and compile a small transformer block "
            "(fxlite.examples.ExampleBlock)")

        gm = fx.symbolic_trace(model)
        ShapeProp(gm).propagate(x)
        say(_heading(f"1. gm = fxlite.symbolic_trace(block): {len(gm.graph.nodes)} nodes, "
                     f"shapes for input {'x'.join(map(str, x.shape))}"))
        say(tabular(gm.graph, width=100))

        say(_heading("2. gm.code: the generated forward()"))
        say(wrap_code(gm.code))

        rewritten = copy.deepcopy(gm)
        changed = relu_to_gelu(rewritten.graph)
        rewritten.graph.lint()
        rewritten.recompile()
        say(_heading(f"3. rewrite relu -> gelu ({changed} node(s)): fxlite.passes.diff(before, "
                     f"after)"))
        with contextlib.redirect_stdout(io.StringIO()):
            text = diff(gm, rewritten).format(width=100)
        say(text)
        with torch.no_grad():
            eager, traced, edited = model(x), gm(x), rewritten(x)
            reference = make_example(seed=seed, act="gelu")(x)
        checks = {"traced == eager relu block": torch.allclose(traced, eager),
                  "rewritten == eager gelu block": torch.allclose(edited, reference)}
        for what, ok in checks.items():
            say(f"{what + ':':<38}{ok}")
        say(f"{'max |rewritten - traced| (relu/gelu):':<38}{(edited - traced).abs().max():.4f}")

        if compile:
            checks["compiled == eager"] = _compile_step(model, x)
        failed = [what for what, ok in checks.items() if not ok]
        say(_heading("next"))
        say("fxlite show fxlite.examples:ExampleBlock --input 2x4x8 --code    the same, your model")
        say("fxlite compile fxlite.examples:ExampleBlock --input 2x4x8 --bench   vs torch.compile")
        say("notebooks/01_tracing_and_printing.ipynb ...                         the tutorials")
        if failed:
            say(f"\nFAILED: {', '.join(failed)}")
    return 1 if failed else 0


def _compile_step(model: torch.nn.Module, x: torch.Tensor) -> bool:
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        model = model.to("cuda")
        x = torch.randn(GPU_INPUT_SHAPE, device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    shape = "x".join(map(str, x.shape))
    say(_heading(f"4. fxlite.compile(block) on input {shape}"))
    if on_gpu:
        say(f"on {torch.cuda.get_device_name()}")
    elif use_interpreter("cpu"):
        say("no GPU: the kernels run through Triton's interpreter (TRITON_INTERPRET=1), on "
            "the tiny input")
    compiled = fx.compile(model)
    count = KernelCount(compiled)
    with Progress(1, "compile") as bar, kernel_listener(count.add), torch.no_grad():
        with bar.step("first call", count):
            start = time.perf_counter()
            got = compiled(x)
            seconds = time.perf_counter() - start
            count.finished = True
        want = model(x)
    with contextlib.redirect_stdout(io.StringIO()):
        report = compiled.report()
    say(report)
    say(f"fallbacks: {'; '.join(compiled.fallbacks) or 'none'}")
    ok = torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    say(f"{'compiled == eager:':<38}{ok}")
    say(f"{'first call (trace, fuse, generate):':<38}{seconds:.2f} s")
    return ok
