"""Cold compile: every kernel of a fused module compiled before its first run, in parallel.

Without this, each group's kernel is compiled when the first call reaches it, one after
another on one core (convnext_tiny: 59 kernels, 20 s on an H200 host, most of it in
``ptxas``, LLVM and Triton's MLIR passes). Triton holds the GIL for much of a compile, so
threads gain less than their count: 1.7x over one thread for resnet50's 12 compiles on a
16-core H200 host. Worker processes lost to them (BENCHMARKS.md, fifteenth session). :func:`precompile` reads
each group's inputs from its ShapeProp metadata, builds the kernel and the exact launch
the first call will make (memory order, block sizes, argument specialization), drops the
launches that compile to the same binary (identical sources: the repeated blocks of a
network), and compiles the rest on a thread pool. Cat groups plan their one kernel of the
layout given (``CatKernel.planned_launch``); the ops that launch kernels of their own,
the pools, the packed weight copies and the row gathers, plan theirs from their
arguments' metadata. The first call then finds every binary in Triton's in-process
cache::

    fused = fuse(gm)
    report = precompile(fused, torch.device("cuda"))   # {"groups": 59, "compiles": 17, ...}
    run(fused)                                         # no compile on the way

Nothing here can make a result wrong: a launch it did not foresee compiles when it runs,
as before. Under ``TRITON_INTERPRET=1`` nothing is compiled; the plan is still made (and
reported), which is how the CPU tests check it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from fxlite.codegen.runtime.binaries import binary_key, has_binary
from fxlite.codegen.runtime.cache import kernel_dir
from fxlite.codegen.runtime.cat import CatKernel
from fxlite.codegen.runtime.kernel import generate_kernel, interpreting
from fxlite.codegen.runtime.launch import BINARIES, TRITON_OPTIONS

from fxlite.graph_module import GraphModule, attr_at
from fxlite.node import Node, map_arg

__all__ = ["precompile"]

# Stand-in values for scalar inputs: integer scalars are never specialized on
# (do_not_specialize), floats are fp32 arguments; only the type matters.
_SCALARS = {int: 2, float: 2.0, bool: True}


def _meta(n: Node) -> torch.Tensor | None:
    """A ``meta`` tensor laid out as ``n``'s ShapeProp metadata says; None where it
    describes no one strided tensor."""
    tm = n.meta.get("tensor_meta")
    if hasattr(tm, "shape") and hasattr(tm, "stride") and tm.stride != ():
        return torch.empty_strided(tm.shape, tm.stride, dtype=tm.dtype, device="meta")
    return None


def _example_inputs(group: GraphModule) -> list[Any] | None:
    """Inputs like the ones the group's ShapeProp run saw: ``meta`` tensors and scalars."""
    out: list[Any] = []
    for n in group.graph.nodes:
        if n.op != "placeholder":
            continue
        t = _meta(n)
        if t is not None:
            out.append(t)
        elif n.meta.get("type") in _SCALARS:
            out.append(_SCALARS[n.meta["type"]])
        else:
            return None
    return out


def _signature(a: Any) -> Any:
    """What Triton specializes a launch argument on."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if type(a) is int:
        return (int, a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    return type(a)


def _plan(gm: GraphModule, device: torch.device) -> tuple[dict[tuple, tuple], int, int, set]:
    """The distinct launches to compile: key -> (fn, args, grid, constexprs, warps)."""
    stand_ins: dict[torch.dtype, torch.Tensor] = {}

    def real(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        t = stand_ins.get(a.dtype)
        if t is None:  # a fresh allocation is aligned, as the real tensors' usually are
            t = stand_ins[a.dtype] = torch.empty(16, dtype=a.dtype, device=device)
        return t

    jobs: dict[tuple, tuple] = {}
    groups = kernels = 0
    sources: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and _planner(node.target) is not None:
            planned = _op_planned(gm, node)
            if planned is None:
                continue
        elif node.op == "call_module":
            sub = gm.get_submodule(node.target)
            kind = getattr(sub, "meta", {}).get("fused_kind")
            if kind in (None, "region"):
                continue  # (a region's kernels come from its autodiff graphs)
            groups += 1
            inputs = _example_inputs(sub)
            planned = None if inputs is None else \
                _planned(sub, kind, inputs, f"triton_{node.target}")
            if planned is None:
                continue
            kernels += 1
        else:
            continue
        source_id, launch = planned
        sources.add(source_id)
        if launch is None:
            continue
        variant, fn, grid, args, constexprs, warps = launch
        args = [real(a) for a in args]
        key = (source_id, variant, tuple(map(_signature, args)),
               tuple(sorted(constexprs.items())), warps)
        jobs.setdefault(key, (fn, args, grid, constexprs, warps))
    return jobs, groups, kernels, sources


def _planner(target: Any) -> Callable[..., tuple | None] | None:
    """How to plan a call of ``target``: the ``planned_launch(target, args, kwargs)`` an op
    that launches a kernel of its own carries (the pools and the packed weight copies of
    ``codegen/kernels``, ``gather_rows`` of ``codegen/lower/row_gathers.py``), giving the
    compile a call with these (meta) arguments makes; None for other targets."""
    return getattr(target, "planned_launch", None)


def _op_planned(gm: GraphModule, node: Node) -> tuple[str, tuple] | None:
    """What :func:`_planned` gives for a group, for a call of an op that launches a kernel
    of its own (:func:`_planner`)."""
    args = _meta_args(gm, node)
    try:
        found = None if args is None else _planner(node.target)(node.target, *args)
    except Exception:  # a plan that fails here fails (and falls back) at run time
        return None
    if found is None:
        return None
    source_id, fn, args, grid, constexprs, warps = found
    return source_id, (0, fn, grid, args, constexprs, warps)


def _meta_args(gm: GraphModule, node: Node) -> tuple[tuple, dict] | None:
    """``node``'s arguments with each input a meta tensor of its layout (its ShapeProp
    metadata, or for an attribute the attribute's own); None where one is not known."""
    unknown = False

    def meta(n: Node) -> Any:
        nonlocal unknown
        if n.op == "get_attr":
            value = attr_at(gm, n.target, "precompile")
            t = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                    device="meta") if isinstance(value, torch.Tensor) else None
        else:
            t = _meta(n)
        unknown = unknown or t is None
        return t

    args, kwargs = map_arg(node.args, meta), map_arg(node.kwargs, meta)
    return None if unknown else (args, kwargs)


def _planned(sub: GraphModule, kind: str, inputs: list[Any],
             name: str) -> tuple[str, tuple | None] | None:
    """A group's kernel source, and the launch its first call will make, ``(variant, fn,
    grid, args, constexprs, warps)`` (None where not foreseen); None where the group has
    no kernel for these inputs."""
    if kind == "cat":  # one kernel per layout, sizes and strides baked in
        found = CatKernel(sub, name).planned_launch(inputs)
        if found is None:
            return None
        source_id, fn, args, grid, constexprs, warps = found
        return source_id, (0, fn, grid, args, constexprs, warps)
    try:
        kernel = generate_kernel(sub, inputs, name=name)
        if kernel is None:
            return None
        spec, ordered, shape, _ = kernel.select(inputs)
        if spec is None:
            return None
        outs = spec.launch.allocate(shape, torch.device("meta"))
        launch = spec.launch_for(ordered, outs, shape)
    except Exception:  # a plan that fails here fails (and falls back) at run time
        return None
    if launch is None:
        return spec.source_id, None
    variant, grid, args, constexprs, warps = launch
    return spec.source_id, (variant, spec.fns[variant], grid, args, constexprs, warps)


def _known(key: tuple, job: tuple, cache: Path | None) -> bool:
    """Whether the launch path will find this job's binary without Triton's JIT: in this
    process, or in the disk index (warming it up would cost Triton's cache key, a hash of
    its own sources: 0.4 s in a new process)."""
    fn, args, grid, constexprs, warps = job
    found = binary_key(key[0], key[1], args, constexprs, warps)
    return found in BINARIES or has_binary(cache, found)


def precompile(gm: GraphModule, device: torch.device | str | None = None, *,
               workers: int | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Compile the kernels of every fused group of ``gm`` ahead of its first call.

    Args:
        gm: the output of ``fuse`` (groups carry ShapeProp metadata).
        device: the GPU the module will run on (default: the current CUDA device).
        workers: compile threads (default: the CPU count, at most 32).
        progress: show a progress line on stderr; default: when stderr is a terminal and
            there are 8 or more compiles.

    Returns:
        ``{"groups", "kernels", "sources", "compiles", "seconds"}``: fused groups, groups
        with a kernel, distinct kernel sources (the ops' kernels too), distinct binaries
        compiled, and wall time.

    Example::

        report = precompile(fuse(gm), "cuda")
        print(f"{report['sources']} sources for {report['kernels']} kernels")
    """
    start = time.perf_counter()
    if device is None:
        device = torch.device("cpu") if interpreting() else torch.device("cuda")
    jobs, groups, kernels, sources = _plan(gm, torch.device(device))
    report = {"groups": groups, "kernels": kernels, "sources": len(sources),
              "compiles": len(jobs), "seconds": 0.0}
    if not interpreting():  # binaries of earlier calls or processes need no compile
        cache = kernel_dir()
        jobs = {k: j for k, j in jobs.items() if not _known(k, j, cache)}
        report["compiles"] = len(jobs)
    if interpreting() or not jobs:
        report["seconds"] = time.perf_counter() - start
        return report
    todo = list(jobs.values())
    show = progress if progress is not None else (len(todo) >= 8 and sys.stderr.isatty())
    done = 0
    lock = threading.Lock()

    def compile_one(job: tuple) -> None:
        nonlocal done
        fn, args, grid, constexprs, warps = job
        try:
            fn.warmup(*args, grid=grid, **constexprs, num_warps=warps, **TRITON_OPTIONS)
        except Exception:  # compiled (and reported) again when the launch happens
            pass
        with lock:
            done += 1
            if show:
                bar = "#" * (30 * done // len(todo))
                sys.stderr.write(f"\rfxlite: compiling {len(todo)} kernels [{bar:<30}] "
                                 f"{done}/{len(todo)}")
                sys.stderr.flush()

    compile_one(todo[0])  # the first one initializes Triton's driver and target
    threads = workers or min(32, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(compile_one, todo[1:]))
    if show:
        sys.stderr.write("\n")
    report["seconds"] = time.perf_counter() - start
    return report

