"""Every ``FXLITE_*`` environment variable, in one table, each with a typed accessor.

The library reads its environment only through the accessors below, and each is called
when the reading module always read it: per call, so a test may set a variable after
import, except where the table says "at import". A value other than the ones named
means the default (``FXLITE_TRIAL=yes`` is on, as unset is).

=========================  =======  ========================================================
Variable                   Default  Meaning
=========================  =======  ========================================================
FXLITE_CACHE_DIR           unset    the disk cache's folder (else ``$XDG_CACHE_HOME/fxlite``,
                                    else ``~/.cache/fxlite``); empty is unset
FXLITE_CHANNELS_LAST       1        ``0``: convolutions on CUDA keep their inputs' layout
                                    (``1``: channels-last, cuDNN's NHWC kernels)
FXLITE_DIRECT_LAUNCH       1        ``0``: no prepared per-layout launches (each call goes
                                    through Triton's JIT dispatcher)
FXLITE_FUSED_OPTIMIZER     1        ``0``: a compiled step keeps the optimizer's own
                                    ``step()`` (``1``: torch's fused multi-tensor kernels)
FXLITE_LINT                0        ``1``: lint each lowering pass's result (always in tests)
FXLITE_LOGS                unset    logs to turn on at import: ``graph_code``,
                                    ``graph_breaks``, ``kernels`` (comma-separated) or ``all``
FXLITE_PROGRESS            auto     the command's progress: ``1`` a bar, ``0`` nothing;
                                    unset: a bar on a terminal, plain lines elsewhere
FXLITE_REGIONS             1        ``0`` (at import): one autograd node per fused group in
                                    training, not one per region of groups
FXLITE_STATIC_LAUNCH       1        ``0``: launch through Triton's own launcher, not
                                    torch's C++ one
FXLITE_TRIAL               1        ``0``: no trial on a GPU; the kernels run from the first
                                    call, whatever the trial would have said
FXLITE_TRITON_SPECIALIZE   1        ``0``: element counts, row lengths and strides are not
                                    specialized on (no recompile when they change alignment)
=========================  =======  ========================================================

:data:`VARIABLES` holds the same table with who reads each; :data:`TEST_VARIABLES` the
knobs only the test suite reads. ``tests/core/test_config.py`` fails on a variable read
anywhere else or missing from these tables.
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["TEST_VARIABLES", "VARIABLES", "Variable", "cache_dir", "channels_last",
           "direct_launch", "fused_optimizer", "lint", "logs", "progress", "regions",
           "static_launch", "trial", "triton_specialize"]


class Variable(NamedTuple):
    """One ``FXLITE_*`` variable: its name, what unset means, its meaning, who reads it."""

    name: str
    default: str
    meaning: str
    read_by: str


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("FXLITE_CACHE_DIR", "unset", "the disk cache's folder; empty is unset",
             "codegen/runtime/cache.py cache_root (per call)"),
    Variable("FXLITE_CHANNELS_LAST", "1", "0: CUDA convolutions keep their inputs' layout",
             "codegen/lower/segment.py channels_last_wanted (per segment)"),
    Variable("FXLITE_DIRECT_LAUNCH", "1", "0: no prepared per-layout launches",
             "codegen/runtime/kernel.py (per kernel made)"),
    Variable("FXLITE_FUSED_OPTIMIZER", "1", "0: the optimizer's own step(), not fused kernels",
             "codegen/lower/segment.py compile_segment (per segment)"),
    Variable("FXLITE_LINT", "0", "1: lint each lowering pass's result",
             "codegen/lower/pipeline.py linting (per pass list)"),
    Variable("FXLITE_LOGS", "unset", "logs to turn on: graph_code, graph_breaks, kernels, all",
             "fxlite/logs.py (at import)"),
    Variable("FXLITE_PROGRESS", "auto", "1: a progress bar, 0: none, unset: by terminal",
             "fxlite/cli/progress.py Progress (per bar)"),
    Variable("FXLITE_REGIONS", "1", "0: one autograd node per fused group",
             "codegen/lower/pipeline.py REGIONS (at import)"),
    Variable("FXLITE_STATIC_LAUNCH", "1", "0: Triton's own launcher, not torch's C++ one",
             "codegen/runtime/launch.py (per kernel made)"),
    Variable("FXLITE_TRIAL", "1", "0: no trial of kernels against eager on a GPU",
             "codegen/runtime/trial.py (per segment)"),
    Variable("FXLITE_TRITON_SPECIALIZE", "1", "0: sizes and strides are not specialized on",
             "codegen/kernels/source.py signature (per kernel)"),
)}
"""The variables the library reads, by name."""

TEST_VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("FXLITE_UPDATE_GOLDEN", "0", "1: rewrite the saved outputs instead of comparing",
             "tests/_golden.py, tests/compile/kernels/test_triton_kernels.py"),
    Variable("FXLITE_SOAK", "unset", "run the long compile soak test",
             "tests/compile/test_compile_soak.py"),
    Variable("FXLITE_SERIALIZE_FUZZ_FILES", "default", "how many files the load fuzzer makes",
             "tests/core/test_serialize_fuzz.py"),
    Variable("FXLITE_SERIALIZE_FUZZ_SEED", "default", "the load fuzzer's seed",
             "tests/core/test_serialize_fuzz.py"),
    Variable("FXLITE_KEEP_SCREENSHOT", "unset", "keep the browser test's screenshot",
             "tests/docs/test_browser.py"),
    Variable("FXLITE_FUZZ_SCALE", "default", "how many programs the program fuzzer makes",
             "tests/fuzz/test_fuzz_programs.py"),
    Variable("FXLITE_FUZZ_EXAMPLES", "default", "how many examples the rewrite fuzzer makes",
             "tests/fuzz/test_rewrite_fuzz.py"),
    Variable("FXLITE_FUZZ_RANDOM", "unset", "the rewrite fuzzer draws a random seed",
             "tests/fuzz/test_rewrite_fuzz.py"),
)}
"""The knobs only the test suite reads (it reads them itself)."""


def _off(name: str) -> bool:
    """Whether ``name`` is set to ``0`` (the switches below are on unless so)."""
    return os.environ.get(name) == "0"


def cache_dir() -> str | None:
    """``FXLITE_CACHE_DIR`` as set (None when unset; an empty value means unset too)."""
    return os.environ.get("FXLITE_CACHE_DIR")


def channels_last(default: bool) -> bool:
    """``FXLITE_CHANNELS_LAST``: ``1`` is on, another value off, unset ``default``."""
    value = os.environ.get("FXLITE_CHANNELS_LAST")
    return default if value is None else value == "1"


def direct_launch() -> bool:
    """``FXLITE_DIRECT_LAUNCH``: on unless ``0``."""
    return not _off("FXLITE_DIRECT_LAUNCH")


def fused_optimizer() -> bool:
    """``FXLITE_FUSED_OPTIMIZER``: on unless ``0``."""
    return not _off("FXLITE_FUSED_OPTIMIZER")


def lint() -> bool:
    """``FXLITE_LINT``: on when set to anything but ``0`` or empty."""
    return os.environ.get("FXLITE_LINT", "0") not in ("", "0")


def logs() -> str:
    """``FXLITE_LOGS``: the log names as written (``""`` when unset)."""
    return os.environ.get("FXLITE_LOGS", "")


def progress() -> bool | None:
    """``FXLITE_PROGRESS``: True for ``1``, False for ``0``, None (decide by the stream)."""
    value = os.environ.get("FXLITE_PROGRESS", "")
    return True if value == "1" else False if value == "0" else None


def regions() -> bool:
    """``FXLITE_REGIONS``: on unless ``0``."""
    return not _off("FXLITE_REGIONS")


def static_launch() -> bool:
    """``FXLITE_STATIC_LAUNCH``: on unless ``0``."""
    return not _off("FXLITE_STATIC_LAUNCH")


def trial() -> bool:
    """``FXLITE_TRIAL``: on unless ``0``."""
    return not _off("FXLITE_TRIAL")


def triton_specialize() -> bool:
    """``FXLITE_TRITON_SPECIALIZE``: on unless ``0``."""
    return not _off("FXLITE_TRITON_SPECIALIZE")
