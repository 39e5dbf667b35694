"""Run a parsed ``fxlite`` subcommand, and turn what goes wrong into one line and a status.

:func:`fxlite.cli.main` parses the arguments without torch and imports this module only
when a subcommand is to run: everything below imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
import warnings
from collections.abc import Iterator
from typing import TextIO

from fxlite.cli.commands import WIDTH, run_compile, run_explain, run_show
from fxlite.cli.demo import run_demo
from fxlite.cli.load import UsageError
from fxlite.proxy import TraceError

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Run the subcommand ``args.command`` with warnings fitted to the command's width.

    Args:
        args: the parsed arguments (``args.command`` is not None).

    Returns:
        The exit status: 0 on success, 1 when a check against eager failed or the model
        cannot be traced, 2 for a bad argument, 130 when interrupted.
    """
    try:
        with _fitted_warnings():
            return _dispatch(args)
    except UsageError as e:
        print(f"fxlite {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fxlite {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fxlite demo | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # the user's code failed (or fxlite did): say so briefly
        if args.traceback:
            raise
        if isinstance(e, TraceError):  # it names the user's file, line and code, and a fix
            print(f"fxlite {args.command}: cannot trace {args.target}: {e}", file=sys.stderr)
        else:
            first = (str(e).splitlines() or [""])[0]
            print(f"fxlite {args.command}: {type(e).__name__}: {first}\n(add --traceback to "
                  f"see where)", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return run_demo(seed=args.seed, compile=not args.no_compile)
    return {"show": run_show, "compile": run_compile, "explain": run_explain}[args.command](args)


@contextlib.contextmanager
def _fitted_warnings() -> Iterator[None]:
    """Print warnings as ``warning: ...`` lines on stderr, wrapped to 100 columns (Python's
    own format starts with the file path and runs on), while a subcommand runs."""
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        stream = file if file is not None else sys.stderr
        kind = "warning" if category is UserWarning else category.__name__
        for part in f"{kind}: {message}".splitlines():
            stream.write(textwrap.fill(part, WIDTH, subsequent_indent="  ",
                                       break_long_words=False, break_on_hyphens=False) + "\n")

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown
