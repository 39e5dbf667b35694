"""Triton kernels for fused groups: :func:`generate_kernel` and :class:`TritonKernel`.

A fused group (a GraphModule of canonical pointwise and reduction nodes, with ShapeProp
metadata) becomes one Triton kernel::

    kernel = generate_kernel(group, [x, w, b], name="triton_layer_norm")
    if kernel is None:          # something in the group has no provable kernel form
        out = group(x, w, b)
    else:
        out = kernel(x, w, b)   # allocates outputs and launches
        print(kernel.source)    # the generated Triton module

The source comes from ``codegen/kernels/generate.py`` (pure: no disk, no launches); this
module loads it, keeps one specialization per guard key, and launches it through the
:class:`~fxlite.codegen.runtime.launch.LaunchPlan` and binaries of ``launch.py``.

The kernel is specialized on a guard key (:func:`guard_key`: dtypes, ranks, device type,
broadcast/stride pattern, density, index width), never on sizes: sizes and strides are
runtime arguments marked ``do_not_specialize``, so a resize with the same rank reuses it.
Calling it with inputs of another key generates (and caches) another specialization, or
runs the group eagerly when that one is unsupported; it is never wrong.

Numerics:

- **fp16/bf16 intermediates are not rounded between fused ops** (the deliberate choice;
  Inductor's default too). Inside a kernel, half values are held in fp32 and rounded once,
  where they are stored; eager rounds after every op. So a fused chain gives what the same
  ops give in fp32, rounded once: usually within 1 ulp of eager, and the more precise value
  where eager's per-op rounding loses information (``(x + 4e-4) - 1`` on an fp16 ``x = 1``
  is 0 in eager and 4e-4 here; ``x * 1000 / 1000`` overflows to inf in eager for ``x=100``
  and gives 100 here). Rounding after every op would cost two conversions per op and
  element, more than the memory time of a long fp16 chain.
- A half value *is* rounded first where the difference would be discrete: before a
  comparison, ``floor``/``round``/``trunc``/``sign``, a cast, ``//``/``%``, and before it
  is promoted to fp32 by an op with an fp32 operand (``kernels/source.py``'s ``DISCRETE``);
  and where the kernel stores it, its other ops read it rounded, as eager reads what it
  stored (a float16 ``exp_`` that overflows is inf for them too).
- Reductions accumulate halves in fp32. The decompositions of softmax, layer_norm,
  rms_norm, mean, var and std cast half inputs to fp32 and the result back, as eager's
  kernels compute them, so a group's eager fallback agrees with its kernel.
- Integer ``//`` and ``%`` floor as torch does, and max/min propagate NaN. Integer
  division by a tensor or a scalar argument (a divisor that may be 0) is refused: eager
  raises ``ZeroDivisionError`` on the CPU and returns a hardware-defined value on CUDA, and
  neither can be promised by a kernel, so the group runs in eager. ``x ** 0`` is 1 for
  every ``x``, NaN and inf included.

Under ``TRITON_INTERPRET=1`` kernels run on CPU tensors; libdevice (missing from the
interpreter) is used only when compiling for a GPU.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import torch
from fxlite.codegen.kernels.analysis import (
    Plan,
    guard_key,
    iteration_space,
    key_and_shape,
)
from fxlite.codegen.kernels.config import (
    DEFAULT_MAX_BLOCK,
    candidate_configs,
    launch_config,
    np2,
    tile_config,
    triton_cdiv,
    wide_row_configs,
)
from fxlite.codegen.kernels.emit import Unsupported
from fxlite.codegen.kernels.generate import (
    generate_source,
    identifier,
    interpreting,
    why_unsupported,
)
from fxlite.codegen.kernels.layout import (
    inverse,
    memory_order,
    merges,
    permute_inputs,
)
from fxlite.codegen.kernels.source import KernelSource
from fxlite.codegen.runtime.binaries import binary_key, load_binary, save_binary
from fxlite.codegen.runtime.cache import kernel_dir, load_module
from fxlite.codegen.runtime.cat import CatKernel
from fxlite.codegen.runtime.launch import (
    BINARIES,
    SLOT,
    TRITON_OPTIONS,
    Binary,
    DirectLaunch,
    LastLaunch,
    LaunchPlan,
    fingerprint,
)

from fxlite import config
from fxlite import ops as op_table
from fxlite.graph_module import GraphModule

__all__ = ["DEFAULT_MAX_BLOCK", "TritonKernel", "candidate_configs", "generate_kernel",
           "guard_key", "interpreting", "launch_config", "why_unsupported"]


_INTERPRETER_LOCK = threading.Lock()  # see _Spec._launch


def _aliasing(view: torch.Tensor) -> torch.Tensor:
    """A tensor that is not a view (no ``_base``) over ``view``'s memory and strides."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def _no_storage(t: Any) -> Any:
    """An empty tensor replaced by one zero element of the same rank: a reduction over an
    empty dim still loads its broadcast inputs once per row (the values are masked out,
    every other load is masked off), and an empty tensor may have no storage at all."""
    if not isinstance(t, torch.Tensor) or t.numel():
        return t
    return torch.zeros([1] * t.dim(), dtype=t.dtype, device=t.device)


class _Spec:
    """One specialization: a plan, its source, its loaded functions and its launches."""

    def __init__(self, plan: Plan, src: KernelSource, max_block: int) -> None:
        self.plan = plan
        self.src = src
        self.max_block = max_block
        module = load_module(src.text, plan.name)  # plan.name holds a digest of the text
        self.source_id = module.__name__  # carries a digest of the source text
        self.fns = {v: getattr(module, f) for v, f in src.functions.items()}
        self.launch = LaunchPlan.of(plan, src)
        self.tuned: dict[Any, dict[str, Any]] = {}
        self.last_launch: LastLaunch | None = None  # for direct launches
        self._configs: dict[tuple, tuple[dict[str, int], dict[str, Any]]] = {}

    def config(self, shape: tuple[int, ...]) -> tuple[dict[str, int], dict[str, Any]]:
        """Row/element counts and the launch config for ``shape`` (memoized)."""
        found = self._configs.get(shape)
        if found is not None:
            return found
        lp = self.launch
        if lp.pointwise:
            n = math.prod(shape)
            cols = shape[lp.inner] if "rows" in lp.variants and n else 1
            counts = {"numel": n, "cols": cols}
            tile = lp.tile
            if tile is not None:
                counts["lena"] = math.prod(shape[d] for d in tile[0])
                counts["lenb"] = math.prod(shape[d] for d in tile[1])
            found = counts, self.tuned.get(None) or (
                tile_config(counts["lena"], counts["lenb"]) if tile is not None
                else launch_config("pointwise", n, cols))
        else:
            rows = math.prod(shape[d] for d in lp.kept)
            cols = math.prod(shape[d] for d in lp.red)
            found = {"rows": rows, "cols": cols}, self.tuned.get(np2(cols)) or launch_config(
                "reduction", rows, cols, trailing=lp.row_config, max_block=self.max_block,
                row_inputs=lp.row_inputs)
        if len(self._configs) > 256:
            self._configs.clear()
        self._configs[shape] = found
        return found

    def launch_for(self, inputs: Sequence[Any], outs: list[Any], shape: tuple[int, ...],
                   cfg: dict[str, Any] | None = None) -> tuple | None:
        """``(variant, grid, args, constexprs, num_warps)`` of the launch for these inputs
        and outputs, or None when there is nothing to compute (an empty tensor)."""
        counts, heuristic = self.config(shape)
        cfg = cfg or heuristic
        lp = self.launch
        if lp.pointwise:
            n = counts["numel"]
            if not n:
                return None
            if cfg["variant"] == "transpose" and not merges(inputs, lp.tile):
                cfg = launch_config("pointwise", n, counts["cols"])
            if cfg["variant"] == "rows":
                grid = (triton_cdiv(n // counts["cols"], cfg["ROWS"])
                        * triton_cdiv(counts["cols"], cfg["BLOCK"]),)
                constexprs = {"BLOCK": cfg["BLOCK"], "ROWS": cfg["ROWS"]}
            elif cfg["variant"] == "transpose":
                la, lb = counts["lena"], counts["lenb"]
                grid = (triton_cdiv(la, cfg["BA"]) * triton_cdiv(lb, cfg["BB"])
                        * (n // (la * lb)),)
                constexprs = {"BA": cfg["BA"], "BB": cfg["BB"]}
            else:
                grid = (triton_cdiv(n, cfg["BLOCK"]),)
                constexprs = {"BLOCK": cfg["BLOCK"]}
            return (cfg["variant"], grid, lp.arguments(inputs, outs, shape, counts),
                    constexprs, cfg["num_warps"])
        if not counts["rows"]:
            return None
        return (cfg["variant"], (triton_cdiv(counts["rows"], cfg["ROWS"]),),
                lp.arguments(inputs, outs, shape, counts),
                {"ROWS": cfg["ROWS"], "BLOCK_C": cfg["BLOCK_C"]}, cfg["num_warps"])

    def run(self, inputs: Sequence[Any], shape: tuple[int, ...],
            cfg: dict[str, Any] | None = None) -> list[torch.Tensor]:
        for d, size in self.plan.size_checks:
            if (shape[d] == 1) if size < 0 else (shape[d] != size):
                raise RuntimeError(
                    f"{self.plan.name}: a view in it expects "
                    f"{'a size other than 1' if size < 0 else f'size {size}'} in dim {d}, "
                    f"but the inputs now have shape {list(shape)} (eager raises, or "
                    "squeezes the dim, here)")
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        lp = self.launch
        outs = lp.allocate(shape, device)
        empty = not lp.pointwise and math.prod(shape[d] for d in lp.red) == 0
        if empty and lp.needs_nonempty:
            raise IndexError("amax()/amin(): expected the reduced dims to have non-zero size, "
                             "as eager does")
        # nothing to reduce: no load may touch an empty input's storage
        stand_ins = empty and any(isinstance(t, torch.Tensor) and t.numel() == 0
                                  for t in inputs)
        if stand_ins:
            inputs = [_no_storage(t) for t in inputs]
        launch = self.launch_for(inputs, outs, shape, cfg)
        if launch is not None:
            self._launch(*launch)
            if stand_ins:
                self.last_launch = None  # its arguments are stand-ins: no direct replays
        return outs

    def _launch(self, variant: str, grid: tuple[int, ...], args: list[Any],
                constexprs: dict[str, Any], num_warps: int) -> None:
        fn = self.fns[variant]
        if interpreting():
            # Triton's interpreter patches triton.language globally while a kernel runs,
            # so two threads interpreting at once break each other: take turns.
            with _INTERPRETER_LOCK:
                fn[grid](*args, **constexprs, num_warps=num_warps, **TRITON_OPTIONS)
            return
        # A binary compiled before (maybe by another process) skips Triton's JIT.
        key = binary_key(self.source_id, variant, args, constexprs, num_warps)
        binary = BINARIES.get(key)
        if binary is None:
            found = load_binary(kernel_dir(), key, fn)
            if found is None:  # compile only: launching through Triton would build its launcher
                compiled = fn.warmup(*args, grid=grid, **constexprs, num_warps=num_warps,
                                     **TRITON_OPTIONS)
                save_binary(kernel_dir(), key, compiled)
                found = compiled, False
            binary = BINARIES[key] = Binary(*found, key=key)
        values = list(args) + [constexprs[n] for n in list(fn.arg_names)[len(args):]]
        device = next(a.device.index or 0 for a in args if isinstance(a, torch.Tensor))
        grid3 = tuple(grid) + (1,) * (3 - len(grid))  # the launchers want all 3 dims
        binary.launch(grid3, values, device)
        # Remember how to repeat this exact launch without Triton's dispatcher. Not its
        # tensors: every tensor is a per-call slot of the direct launch, and keeping them
        # kept each kernel's last inputs and outputs alive between calls (a GPT-2 training
        # step held 8 GiB more than eager's between steps, its logits four times over).
        self.last_launch = LastLaunch(
            binary, grid3, [SLOT if isinstance(v, torch.Tensor) else v for v in values])


_NOT_POINTWISE = op_table.OpInfo("unknown", "unknown", None)


def _reorderable(group: GraphModule) -> bool:
    """Whether the group may iterate in its inputs' memory order (kernels/layout.py): ops
    that are all pointwise, so that nothing depends on the order of the dims. Not a clone
    into a memory format: its result's layout is that format, whatever its input's."""
    return all((op_table.lookup(n, group) or _NOT_POINTWISE).kind == "pointwise"
               and n.kwargs.get("memory_format") is None
               for n in group.graph.nodes
               if n.op in ("call_function", "call_method", "call_module"))


def _order(inputs: Sequence[Any], least_rank: int) -> tuple[int, ...] | None:
    """The memory order a reorderable group runs ``inputs`` in, or None (the logical one).
    It runs on full-rank views of the inputs (permute_inputs), so an output made from
    lower-rank inputs alone would come back with leading size-1 dims: a group with such an
    output (``least_rank`` below the inputs' rank) keeps the logical order."""
    order = memory_order(inputs)
    return None if order is None or least_rank < len(order) else order


def _runs_ordered(spec: _Spec | None) -> bool:
    """Whether a specialization built for ordered inputs runs them: its outputs have the
    plan's full rank."""
    return spec is not None and all(len(d) == spec.plan.rank for d, *_ in spec.launch.out_layout)


def _least_output_rank(group: GraphModule) -> int:
    """The lowest rank among the group's outputs that ShapeProp described (a large number
    when it described none: the kernel's check against eager still refuses a wrong shape)."""
    out = next((n for n in group.graph.nodes if n.op == "output"), None)
    items = out.args[0] if out is not None else ()
    metas = [n.meta.get("tensor_meta") for n in (
        items if isinstance(items, (tuple, list)) else (items,)) if hasattr(n, "meta")]
    return min((len(tm.shape) for tm in metas if tm is not None), default=1 << 30)


class TritonKernel:
    """A generated kernel for one fused group, callable like the group.

    Attributes:
        name: the name generated code calls it by (the Triton functions in ``source`` are
            named by their ops and a digest of the text, so identical groups share them).
        nodes: names of the group's op nodes.
        kind: ``"pointwise"`` or ``"reduction"``.
        compilations: how many specializations (guard keys) have been generated.
        direction: ``"forward"``, or ``"backward"`` for a kernel of a generated backward
            graph (``fxlite.codegen.lower.autograd`` sets it).

    Example::

        kernel = generate_kernel(group, [x])
        y = kernel(x)
        print(kernel.source, kernel.bytes_moved(x))
    """

    direction = "forward"

    def __init__(self, group: GraphModule, spec: _Spec, *, name: str, libdevice: bool | None,
                 max_block: int) -> None:
        self.group = group
        self.name = name
        self.nodes = list(spec.plan.node_names)
        self.kind = spec.plan.kind
        self._libdevice = libdevice
        self._max_block = max_block
        self._specs: dict[tuple, _Spec | None] = {spec.plan.key: spec}
        self._current = spec
        self._lock = threading.Lock()
        self.compilations = 1
        # fingerprint of the inputs -> a prepared launch (GPU only; see DirectLaunch)
        self._direct: dict[tuple, DirectLaunch] | None = (
            None if interpreting() or not config.direct_launch() else {})
        self._reorder = self.kind == "pointwise" and _reorderable(group)
        self._least_rank = _least_output_rank(group)

    @property
    def __name__(self) -> str:  # generated forward code calls the kernel by this name
        return self.name

    @property
    def source(self) -> str:
        """The Triton module source of the most recently used specialization."""
        return self._current.src.text

    def guard_key(self, inputs: Sequence[Any]) -> tuple:
        """The guard key of ``inputs`` (see :func:`guard_key`)."""
        return guard_key(list(inputs))

    def _spec_for(self, inputs: Sequence[Any], key: tuple | None = None) -> _Spec | None:
        if key is None:
            key = guard_key(inputs)
        spec = self._specs.get(key, False)
        if spec is False:
            with self._lock:
                spec = self._specs.get(key, False)
                if spec is False:
                    spec = _build(self.group, list(inputs), self._libdevice,
                                  self._max_block)
                    self._specs[key] = spec
                    self.compilations += spec is not None
        if spec is not None:
            self._current = spec
        return spec

    def select(self, inputs: Sequence[Any]) -> tuple[_Spec | None, Sequence[Any],
                                                     tuple[int, ...], tuple[int, ...] | None]:
        """The specialization for ``inputs``, the inputs it runs on, the iteration space and
        the memory order (None: the logical one; see ``kernels/layout.py``)."""
        try:
            order = _order(inputs, self._least_rank) if self._reorder else None
            if order is not None:  # the kernel runs on views in memory order
                ordered = permute_inputs(inputs, order)
                key, shape = key_and_shape(ordered)
                spec = self._spec_for(ordered, key)
                if _runs_ordered(spec):
                    return spec, ordered, shape, order
            key, shape = key_and_shape(inputs)
        except RuntimeError:
            # inputs that share no iteration space now, though they did when the group was
            # made (a dim reduced before it broadcasts against a longer one): the group's
            # own ops decide, as eager would
            return None, inputs, (), None
        return self._spec_for(inputs, key), inputs, shape, None

    def __call__(self, *inputs: Any) -> Any:
        """Allocate the outputs and launch; returns what the group returns."""
        if self._direct is not None:
            launch = self._direct.get(fingerprint(inputs))
            if launch is not None:
                return launch.fast(inputs)
        spec, ordered, shape, order = self.select(inputs)
        if spec is None or spec.launch.skips_outputs(shape):
            return self.group(*inputs)
        spec.last_launch = None
        outs = spec.run(ordered, shape)
        if order is not None:
            back = inverse(order)
            # the same memory as tensors of their own, not views: a custom autograd
            # Function may not return views that the caller then writes in place
            outs = [_aliasing(o.permute(back)) for o in outs]
        if self._direct is not None:
            direct = DirectLaunch.build(spec.launch, spec.last_launch, inputs, outs)
            # A binary checked before (this process or an earlier one) had its direct
            # launch compared then; the comparison costs a first call tens of ms.
            if direct is not None and (direct.binary.checked or DirectLaunch.agrees(
                    direct, inputs, outs)):
                if len(self._direct) > 64:
                    self._direct.clear()
                self._direct[fingerprint(inputs)] = direct
        return spec.launch.returned(inputs, outs)

    @property
    def checked(self) -> bool:
        """Whether the binary of the latest launch has matched eager PyTorch before.

        fxlite.compile checks each kernel's first result against eager and records the
        outcome in the disk index of binaries, so a new process can skip the eager run.
        Always False under the interpreter (nothing is cached there).
        """
        record = self._current.last_launch
        return record is not None and record.binary.checked

    def mark_checked(self) -> None:
        """Record that the binary of the latest launch matched eager PyTorch."""
        record = self._current.last_launch
        if record is not None and not record.binary.checked:
            binary = record.binary
            binary.checked = True
            save_binary(kernel_dir(), binary.key, binary.compiled, checked=True)

    def bytes_moved(self, *inputs: Any) -> int:
        """Bytes read (each input element once, broadcasts not repeated) plus written."""
        total = 0
        for t in inputs:
            if isinstance(t, torch.Tensor):
                unique = math.prod(n for n, s in zip(t.shape, t.stride()) if s != 0) \
                    if t.numel() else 0
                total += unique * t.element_size()
        spec, _, shape, _ = self.select(inputs)  # the specialization a call runs
        if spec is not None:
            for dims, span, dtype, _ in spec.launch.out_layout:
                n = math.prod(shape[d] if d in span else 1 for d in dims)
                total += n * dtype.itemsize
        return total

    def tune_wide_rows(self, *inputs: Any) -> dict[str, Any] | None:
        """On a GPU, time the warps of a reduction over rows of at least
        :data:`~fxlite.codegen.kernels.config.WIDE_ROW` elements held whole
        (:func:`~fxlite.codegen.kernels.config.wide_row_configs`) and keep the fastest, as
        :meth:`autotune` does; None where there is nothing to time (other kernels, or
        the interpreter)."""
        if self.kind == "pointwise" or interpreting() or not torch.cuda.is_available():
            return None
        spec = self._spec_for(inputs)
        if spec is None:
            return None
        counts, _ = spec.config(iteration_space(list(inputs)))
        full = [t.element_size() for t in inputs if isinstance(t, torch.Tensor)
                and t.numel() == counts["rows"] * counts["cols"]]
        configs = wide_row_configs(counts["rows"], counts["cols"],
                                   trailing=spec.launch.row_config, max_block=self._max_block,
                                   row_inputs=spec.launch.row_inputs, itemsize=max(full or [4]))
        return self.autotune(*inputs, configs=configs) if len(configs) > 1 else None

    def autotune(self, *inputs: Any, configs: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
        """Time candidate configs on ``inputs`` and keep the fastest for this row size.

        Under the interpreter (no GPU timing) the heuristic config is kept.
        """
        spec = self._spec_for(inputs)
        if spec is None:
            return {}
        shape = iteration_space(list(inputs))
        counts, base = spec.config(shape)
        bucket = None if self.kind == "pointwise" else np2(counts["cols"])
        if interpreting() or not torch.cuda.is_available():
            spec.tuned[bucket] = base
            spec._configs.clear()
            return base
        import triton.testing  # Triton's import cost: only when autotuning on a GPU

        if configs is None:
            rows = counts.get("numel", counts.get("rows", 1))
            configs = candidate_configs(self.kind, rows, counts.get("cols", 1),
                                        trailing=spec.launch.row_config, max_block=self._max_block,
                                        tiles="lena" in counts)
        best, best_ms = base, float("inf")
        for cfg in configs:
            try:
                ms = triton.testing.do_bench(lambda c=cfg: spec.run(inputs, shape, c))
            except Exception:  # a config that does not compile (registers, shared memory)
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        spec.tuned[bucket] = best
        spec._configs.clear()
        if self._direct is not None:
            self._direct.clear()  # prepared launches carry the old configuration
        return best


def _build(group: GraphModule, inputs: list[Any], libdevice: bool | None,
           max_block: int) -> _Spec | None:
    try:
        plan, src = generate_source(group, inputs, libdevice)
    except Unsupported:
        return None
    return _Spec(plan, src, max_block)


def generate_kernel(group_gm: GraphModule, example_inputs: Sequence[Any], name: str = "kernel",
                    *, max_block: int = DEFAULT_MAX_BLOCK, libdevice: bool | None = None
                    ) -> TritonKernel | None:
    """Generate a Triton kernel for a fused group, or None if it cannot be proven right.

    Args:
        group_gm: the group: placeholders, canonical op nodes with ``meta['tensor_meta']``
            (from ShapeProp), and an output (one value or a tuple).
        example_inputs: tensors and Python scalars, one per placeholder.
        name: the kernel's name (made a valid identifier).
        max_block: the longest row (elements) a reduction keeps in registers; longer rows
            run the looped variant.
        libdevice: use libdevice functions; default: when not interpreting.

    Returns:
        A :class:`TritonKernel`, or None (the caller runs the group eagerly).

    Example::

        gm = fxlite.symbolic_trace(lambda x: torch.relu(x + 1) * 2)
        ShapeProp(gm).propagate(x)
        kernel = generate_kernel(gm, [x], name="triton_relu")
        torch.testing.assert_close(kernel(x), gm(x))
    """
    inputs = list(example_inputs)
    if getattr(group_gm, "meta", {}).get("fused_kind") == "cat":
        cat = CatKernel(group_gm, identifier(name), libdevice)
        return cat if cat.prepare(inputs) is not None else None
    # The first specialization is the one the first call will run: for inputs in another
    # memory order than the logical one (channels-last), a pointwise group's in that order
    # (TritonKernel.select); built for the logical order first, every such kernel was
    # generated twice.
    spec = None
    try:
        order = _order(inputs, _least_output_rank(group_gm)) if _reorderable(group_gm) else None
    except RuntimeError:  # no common iteration space: the logical build decides
        order = None
    if order is not None:
        spec = _build(group_gm, permute_inputs(inputs, order), libdevice, max_block)
        if not _runs_ordered(spec) or spec.plan.kind != "pointwise":
            spec = None
    if spec is None:
        spec = _build(group_gm, inputs, libdevice, max_block)
    if spec is None:
        return None
    return TritonKernel(group_gm, spec, name=identifier(name), libdevice=libdevice,
                        max_block=max_block)

