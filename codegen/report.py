"""The kernel table behind ``CompiledFunction.report()``: text within 100 columns, HTML in Jupyter."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxlite.viz.html import table_html, wrap_html
from fxlite.viz.tabular import fit_table

__all__ = ["KernelRecord", "KernelReport", "kernel_report"]

REPORT_WIDTH = 100
"""The text report fits this many columns; long cells (fused ops, shapes) wrap."""
_WRAPPED = ("fused ops", "inputs", "outputs")
_KEPT = ("kernel", "kind", "bytes moved", "ms", "GB/s", "% of copy")


@dataclass
class KernelRecord:
    """A kernel plus what it was compiled for: enough to describe and re-time it."""

    kernel: Any
    inputs: list[Any]  # (shape, stride, dtype, device) per tensor; scalars as they were
    outputs: list[tuple[tuple[int, ...], torch.dtype]]
    bytes_moved: int

    @classmethod
    def of(cls, kernel: Any, args: Sequence[Any], result: Any) -> KernelRecord:
        outs = result if isinstance(result, (tuple, list)) else [result]
        specs = [(tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                 else a for a in args]
        return cls(kernel, specs, [(tuple(o.shape), o.dtype) for o in outs
                                   if isinstance(o, torch.Tensor)], kernel.bytes_moved(*args))

    def fresh_inputs(self) -> list[Any]:
        """New random inputs with the recorded shapes, strides, dtypes and devices."""
        made = []
        for spec in self.inputs:
            if not isinstance(spec, tuple):
                made.append(spec)
                continue
            shape, stride, dtype, device = spec
            span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
            if dtype.is_floating_point:
                base = torch.randn(span, device=device).to(dtype)
            else:
                base = torch.randint(0, 2 if dtype == torch.bool else 100, (span,),
                                     device=device).to(dtype)
            made.append(base.as_strided(shape, stride))
        return made


def _shape(shape: Sequence[int]) -> str:
    """``2x4x8`` for a shape, ``()`` for a 0-d tensor."""
    return "x".join(map(str, shape)) if len(shape) else "()"


def _time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        fn()
        n += 1
    return (time.perf_counter() - start) / n * 1e3


class KernelReport(str):
    """The report's text (a ``str``), which renders as an HTML table in Jupyter.

    Attributes:
        headers: the column names.
        rows: one list of cells per kernel.
        sources: each kernel's name and generated source, shown folded under the table.
    """

    headers: list[str]
    rows: list[list[str]]
    sources: list[tuple[str, str]]
    note: str  # a line under the table (how the calls run: replayed, followed or eager)

    def __new__(cls, headers: list[str], rows: list[list[str]],
                sources: list[tuple[str, str]], note: str = "") -> KernelReport:
        text = fit_table(headers, rows, REPORT_WIDTH, wrap=_WRAPPED,
                                                 keep=_KEPT) if rows else \
            "no kernels (nothing was compiled, or everything runs in eager PyTorch)"
        self = super().__new__(cls, f"{text}\n{note}" if note else text)
        self.headers, self.rows, self.sources, self.note = headers, rows, sources, note
        return self

    def __repr__(self) -> str:  # the table, not a quoted string, at a prompt
        return str.__str__(self)

    def _repr_html_(self) -> str:
        import html

        body = table_html(self.headers, self.rows, f"{len(self.rows)} kernel(s)")
        if self.note:
            body += f"<p>{html.escape(self.note)}</p>"
        for name, source in self.sources:
            body += (f"<details><summary>{html.escape(name)} source</summary>"
                     f"<pre>{html.escape(source)}</pre></details>")
        return wrap_html(body)


def kernel_report(records: Sequence[KernelRecord], benchmark: bool = False,
                  note: str = "") -> KernelReport:
    """A table: kernel, kind, fused ops, shapes and bytes moved; with ``benchmark``, also
    the time per launch, GB/s and % of a device-to-device copy of as many bytes; ``note``
    is a line under it.

    The text fits :data:`REPORT_WIDTH` columns (long cells wrap); in Jupyter the result
    renders as an HTML table with each kernel's source folded below it."""
    headers = ["kernel", "kind", "fused ops", "inputs", "outputs", "bytes moved"]
    if benchmark:
        headers += ["ms", "GB/s", "% of copy"]
    rows = []
    for r in records:
        row = [r.kernel.name, r.kernel.kind, ", ".join(r.kernel.nodes),
               ", ".join(_shape(s[0]) for s in r.inputs if isinstance(s, tuple)),
               ", ".join(_shape(s) for s, _ in r.outputs), f"{r.bytes_moved:,}"]
        if benchmark:
            args = r.fresh_inputs()
            device = next(s[3] for s in r.inputs if isinstance(s, tuple))
            ms = _time_ms(lambda k=r.kernel, a=args: k(*a), device)
            half = max(r.bytes_moved // 2, 1)
            src = torch.empty(half, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            copy_ms = _time_ms(lambda d=dst, s=src: d.copy_(s), device)
            gbs = r.bytes_moved / ms / 1e6
            row += [f"{ms:.4f}", f"{gbs:.0f}", f"{100 * copy_ms / ms:.1f}%"]
        rows.append(row)
    sources = [(r.kernel.name, str(getattr(r.kernel, "source", ""))) for r in records]
    return KernelReport(headers, rows, sources, note)
