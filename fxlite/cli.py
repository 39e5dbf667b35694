"""The ``fxlite`` command (also ``python -m fxlite``).

Subcommands::

    fxlite demo     trace the bundled example block, print its table and code,
                    rewrite relu to gelu, and check both graphs against eager PyTorch
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .graph import Graph

__all__ = ["build_parser", "main", "run_demo"]

# Every spelling of relu that a traced graph may hold; the demo turns each into gelu.
_RELU_FUNCTIONS = (torch.relu, F.relu)


def _relu_to_gelu(graph: Graph) -> int:
    """Point every relu node of ``graph`` at ``F.gelu``; return how many were changed."""
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


def run_demo(seed: int = 0, out: TextIO | None = None) -> int:
    """Trace the bundled example, print its table and code, rewrite relu to gelu, and check.

    Args:
        seed: seeds the example's weights and its random input.
        out: where to print; ``sys.stdout`` by default.

    Returns:
        0 if the traced and rewritten modules both match their eager references, else 1.

    Example::

        >>> run_demo()  # doctest: +SKIP
        0
    """
    import fxlite as fx
    from fxlite.examples import example_input, make_example

    out = out if out is not None else sys.stdout
    model = make_example(seed=seed)
    x = example_input(seed=seed)

    gm = fx.symbolic_trace(model)
    print(f"== traced {type(model).__name__}: {len(gm.graph.nodes)} nodes ==", file=out)
    with contextlib.redirect_stdout(out):  # print_tabular writes to stdout
        gm.graph.print_tabular()
    print("\n== generated code ==", file=out)
    print(gm.code.strip("\n"), file=out)

    rewritten = fx.symbolic_trace(model)
    changed = _relu_to_gelu(rewritten.graph)
    rewritten.graph.lint()
    rewritten.recompile()
    print(f"\n== after rewriting relu -> gelu ({changed} node(s) changed) ==", file=out)
    print(rewritten.code.strip("\n"), file=out)

    with torch.no_grad():
        eager = model(x)
        traced = gm(x)
        edited = rewritten(x)
        reference = make_example(seed=seed, act="gelu")(x)
    traced_ok = torch.allclose(traced, eager)
    edited_ok = torch.allclose(edited, reference)
    print("\n== check on a random input ==", file=out)
    print(f"input shape:                          {tuple(x.shape)}", file=out)
    print(f"output shapes (traced, rewritten):    {tuple(traced.shape)}, {tuple(edited.shape)}",
          file=out)
    print(f"traced == eager relu block:           {traced_ok}", file=out)
    print(f"rewritten == eager gelu block:        {edited_ok}", file=out)
    print(f"max |rewritten - traced| (relu/gelu): {(edited - traced).abs().max().item():.4f}",
          file=out)
    return 0 if traced_ok and edited_ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fxlite`` command, one subparser per subcommand.

    Returns:
        The parser.

    Example::

        >>> build_parser().parse_args(["demo"]).command
        'demo'
    """
    parser = argparse.ArgumentParser(
        prog="fxlite", description="Symbolic tracing and graph rewriting for PyTorch programs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="trace the bundled example model, print its table and code, rewrite it",
        description="Trace the bundled example block, print its table and generated code, "
                    "rewrite relu to gelu, and check both graphs against eager PyTorch.")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed for the example's weights and input (default: 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fxlite`` command with ``argv`` (``sys.argv[1:]`` by default).

    Args:
        argv: the arguments after the program name.

    Returns:
        The exit status: 0 on success.

    Example::

        >>> main(["demo"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(seed=args.seed)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
