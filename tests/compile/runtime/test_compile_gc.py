"""A compiled function frees what it made once the caller drops it.

Weak references to the compiled function, its segments (one per side of a graph break),
their generated modules and their kernels must all be dead after ``gc.collect()``: no
module-level cache may keep a dropped function's kernels (or, on a GPU, its CUDA graphs
and their memory pool) alive.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

pytest.importorskip("triton")

import fxlite

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _segments(compiled) -> list:
    inner = getattr(compiled, "_compiled", compiled)
    found, todo = [], list(inner._trees.values())
    while todo:
        seg = todo.pop()
        if hasattr(seg, "gm"):
            found.append(seg)
            todo += list(seg.children.values())
    return found


def _refs(compiled) -> dict[str, weakref.ref]:
    segments = _segments(compiled)
    assert len(segments) >= 2, "the function should have split at its read"
    kernels = [k for s in segments if s.compiled for k in s.compiled.kernels]
    assert kernels, "no kernels were made"
    refs = {"compiled": weakref.ref(compiled)}
    for i, s in enumerate(segments):
        refs[f"segment {i}"] = weakref.ref(s)
        refs[f"segment {i} module"] = weakref.ref(s.compiled.gm)
    for i, k in enumerate(kernels):
        refs[f"kernel {i}"] = weakref.ref(k)
    return refs


def _branchy(x, y):
    h = torch.relu(x) * 2 + y
    if h.sum() > 0:
        return torch.softmax(h, -1)
    return h - 1


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = self.norm(torch.relu(self.lin(x)) + x)
        if h.mean() > 0:
            h = h * 2
        return h


def _use(fn, *shapes, mode=None):
    compiled = fxlite.compile(fn, mode=mode)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for sign in (1, -1, 1, -1):
            compiled(*[torch.randn(*s, device=DEVICE) * sign for s in shapes])
    return _refs(compiled)


def _assert_freed(refs: dict[str, weakref.ref]) -> None:
    gc.collect()
    alive = [name for name, r in refs.items() if r() is not None]
    assert not alive, f"still alive after the compiled function was dropped: {alive}"


def test_dropped_compiled_function_frees_its_segments_and_kernels():
    _assert_freed(_use(_branchy, (4, 8), (4, 8)))


def test_dropped_compiled_module_frees_its_segments_and_kernels():
    block = _Block().to(DEVICE)
    refs = _use(block, (4, 8))
    _assert_freed(refs)
    assert block.lin.weight.grad is None  # the module itself lives on, untouched


@pytest.mark.gpu
def test_dropped_cuda_graphs_give_their_memory_back():
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    refs = _use(_branchy, (64, 256), (64, 256), mode="reduce-overhead")
    _assert_freed(refs)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() <= before
