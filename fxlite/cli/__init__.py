"""The ``fxlite`` command (also ``python -m fxlite``).

Subcommands::

    fxlite demo                          trace, rewrite and compile the bundled example
    fxlite show PKG.MODULE:OBJ [--input 2x16[:dtype]] [--code] [--shapes] [--svg out.svg]
    fxlite compile PKG.MODULE:OBJ --input 2x16[:dtype] [--device cuda|cpu] [--bench]
    fxlite explain PKG.MODULE:OBJ --input 2x16[:dtype]
    fxlite --version

``OBJ`` is an ``nn.Module`` class (built with no arguments), a factory function that
takes none, or a function. A bad argument (an unknown module, a bad shape, an input
bigger than the machine's memory, an object that is not a module or function,
``--device cuda`` without a GPU) prints one line and exits with status 2; everything
printed fits in 100 columns (warnings too). Long steps show their progress on stderr: a
bar on a terminal, plain lines in a pipe or a log (``fxlite.cli.progress``).

``--help`` and ``--version`` import neither torch nor Triton, so they answer at once;
the subcommands import torch when they run.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import NoReturn

from fxlite import __version__

# Nothing here imports torch: `fxlite --help` and `fxlite --version` answer without it
# (main imports fxlite.cli.run, and torch with it, when a subcommand runs).

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (and exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=min(100, shutil.get_terminal_size().columns))


def _version() -> str:
    """fxlite's version and those of torch, Triton and Python, read from the installed
    packages' metadata (importing torch would take seconds)."""

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"fxlite {__version__} (torch {installed('torch')}, triton "
            f"{installed('triton')}, Python {platform.python_version()})")


def _add_target(p: argparse.ArgumentParser, inputs_required: bool) -> None:
    p.add_argument("target", metavar="PKG.MODULE:OBJ",
                   help="what to trace: an nn.Module class (built with no arguments), a factory "
                        "function, or a function, e.g. fxlite.examples:ExampleBlock")
    p.add_argument("--input", action="append", metavar="SHAPE[:DTYPE]",
                   required=inputs_required,
                   help="a random input, e.g. 2x16 or 4x8:float16 (once per input, in order)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random inputs (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fxlite`` command, one subparser per subcommand.

    Returns:
        The parser.

    Example::

        >>> build_parser().parse_args(["demo"]).command
        'demo'
    """
    parser = _Parser(prog="fxlite", formatter_class=_formatter,
                     description="Trace, rewrite and compile PyTorch programs.")
    parser.add_argument("--version", action="store_true", help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true",
                        help="on an error, show Python's full traceback")

    demo = sub.add_parser(
        "demo", formatter_class=_formatter, parents=[common],
        help="trace, rewrite and compile the bundled example block",
        description="Trace the bundled example block, print its table and generated code, "
                    "rewrite relu to gelu (with a diff), compile it (on the CPU through "
                    "Triton's interpreter), and check each step against eager PyTorch.")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed for the example's weights and input (default: 0)")
    demo.add_argument("--no-compile", action="store_true", help="skip the compile step")

    show = sub.add_parser(
        "show", formatter_class=_formatter, parents=[common], help="trace a model and print its graph",
        description="Trace PKG.MODULE:OBJ and print its graph as a table; with --input, run "
                    "ShapeProp so the table has shapes and dtypes.")
    _add_target(show, inputs_required=False)
    show.add_argument("--code", action="store_true", help="print the generated forward()")
    show.add_argument("--shapes", action="store_true",
                      help="print the shape and dtype of each input and output (needs --input)")
    show.add_argument("--svg", metavar="FILE",
                      help="draw the graph to FILE (.svg, .png, .pdf with Graphviz; .dot without)")

    comp = sub.add_parser(
        "compile", formatter_class=_formatter, parents=[common],
        help="compile a model with fxlite.compile and print its kernels",
        description="Compile PKG.MODULE:OBJ with fxlite.compile, run it on random inputs, "
                    "check it against eager PyTorch, and print the kernel report and the "
                    "fallbacks. Without a GPU, kernels run through Triton's interpreter: use "
                    "tiny inputs.")
    _add_target(comp, inputs_required=True)
    comp.add_argument("--device", choices=["cuda", "cpu"],
                      help="where to run (default: cuda when there is a GPU, else cpu)")
    comp.add_argument("--bench", action="store_true",
                      help="time eager, fxlite and torch.compile side by side")
    expl = sub.add_parser(
        "explain", formatter_class=_formatter, parents=[common],
        help="show where a model splits into graphs, and why (fxlite.explain)",
        description="Run PKG.MODULE:OBJ once on random inputs under fxlite's recorder and "
                    "report the graphs it splits into, each graph break with its file, line "
                    "and source, the ops of each graph, and what later calls are guarded on.")
    _add_target(expl, inputs_required=True)
    parser._subparsers_by_name = dict(sub.choices)  # type: ignore[attr-defined]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fxlite`` command with ``argv`` (``sys.argv[1:]`` by default).

    Args:
        argv: the arguments after the program name.

    Returns:
        The exit status: 0 on success, 1 when a check against eager failed or the model
        cannot be traced, 2 for a bad argument.

    Example::

        >>> main(["--version"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand whose arguments were wrong, not the top level
        owner = parser._subparsers_by_name.get(args.command, parser)  # type: ignore[attr-defined]
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.version:
        print(_version())
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    from fxlite.cli.run import run  # imports torch: --help and --version answer without it

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
