"""Every ``meta`` key fxlite writes or reads by name, declared once: type, meaning, who
writes it and who reads it.

:data:`NODE_META` holds the keys of ``Node.meta``; :data:`MODULE_META` those of
``GraphModule.meta`` (fused groups and regions, and graphs ``fxlite.export`` returns).
Files are named from the repository root. A key meant for users (``tensor_meta``,
``stack_trace``, ``nn_module_stack``) keeps torch.fx's name and meaning.

Nodes made in place of others copy their meta whole (``Graph.node_copy``, the rewriters,
``Node.replace_all_uses_with(propagate_meta=True)``) or, for a node standing for a
different op, only the provenance keys (``Interpreter``: ``stack_trace``,
``nn_module_stack``, ``source_fn_stack``, ``from_node``, ``custom``); those copies are
not listed as writers.

``tests/core/test_meta_keys.py`` scans the source and fails on a key used but not
declared here, on a writer or reader missing here, and on a file listed here that no
longer names its key.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["MODULE_META", "NODE_META", "MetaKey"]


class MetaKey(NamedTuple):
    """One declared ``meta`` key."""

    name: str
    type: str  # the value's type, as written
    meaning: str
    written_by: tuple[str, ...]
    read_by: tuple[str, ...]


_CAPTURE = "codegen/capture/recorder.py"


def _table(*keys: MetaKey) -> dict[str, MetaKey]:
    return {k.name: k for k in keys}


NODE_META: dict[str, MetaKey] = _table(
    # ------------------------------------------------------------ torch.fx's own
    MetaKey("tensor_meta", "TensorMetadata (or a tuple/list/dict of them)",
            "shape, dtype, requires_grad, stride and memory format of the value, as ShapeProp "
            "computes them; the one abstract evaluator (fxlite/ops/shapes.py) fills it too",
            ("codegen/lower/autocast.py", "codegen/lower/batched_casts.py",
             "codegen/lower/cross_entropy.py", "codegen/lower/pipeline.py", "fxlite/ops/shapes.py",
             "passes/channels_last.py", "passes/fold_constants.py", "passes/functionalize.py",
             "passes/fuse/read_through.py", "passes/normalize.py", "passes/shape_prop.py",
             "passes/sink_views.py", "passes/split_module.py"),
            ("codegen/kernels/cat.py", "codegen/kernels/meta.py", "codegen/kernels/weights.py",
             "codegen/lower/autocast.py", "codegen/lower/autodiff.py",
             "codegen/lower/autograd_regions.py", "codegen/lower/batch_norm.py",
             "codegen/lower/batched_casts.py", "codegen/lower/cross_entropy.py",
             "codegen/lower/pipeline.py", "codegen/lower/row_views.py",
             "codegen/runtime/cat.py",
             "codegen/runtime/kernel.py",
             "codegen/runtime/precompile.py", "fxlite/ops/derivatives.py",
             "fxlite/ops/shapes.py", "fxlite/ops/table.py", "fxlite/tensor_meta.py", "fxlite/viz/dot.py",
             "fxlite/viz/tabular.py",
             "passes/channels_last.py", "passes/decompose_rules.py", "passes/fold_constants.py", "passes/fold_conv_bn.py",
             "passes/functionalize.py", "passes/fuse/__init__.py", "passes/fuse/classes.py",
             "passes/fuse/lone_groups.py", "passes/fuse/read_through.py", "passes/fuse/remat.py",
             "passes/fuse/size_sources.py", "passes/normalize.py", "passes/shape_prop.py",
             "passes/sink_views.py", "passes/split_module.py")),
    MetaKey("type", "type", "the Python type of the node's value (torch.Tensor, tuple, int...)",
            ("codegen/capture/follow.py", _CAPTURE, "codegen/capture/run.py",
             "codegen/capture/symbolic.py", "codegen/kernels/weights.py",
             "codegen/lower/autocast.py", "codegen/lower/batched_casts.py",
             "codegen/lower/pipeline.py", "fxlite/ops/dropout.py",
             "fxlite/ops/shapes.py", "passes/attention.py", "passes/channels_last.py",
             "passes/functionalize.py", "passes/normalize.py",
             "passes/shape_prop.py", "passes/sink_views.py", "passes/split_module.py"),
            ("codegen/capture/follow.py", "codegen/lower/autograd_regions.py",
             "codegen/capture/symbolic.py", "codegen/lower/pipeline.py",
             "codegen/runtime/precompile.py", "fxlite/ops/shapes.py", "fxlite/ops/table.py",
             "passes/fuse/__init__.py", "passes/fuse/classes.py", "passes/fuse/lone_groups.py",
             "passes/fuse/size_sources.py", "passes/normalize.py", "passes/shape_prop.py")),
    MetaKey("written_later", "bool (True only)",
            "the program writes this value (or memory it shares) in place after a fused "
            "group reads or returns it, before a backward runs: autodiff never saves it",
            ("codegen/lower/written_inputs.py",),
            ("codegen/lower/autodiff.py", "codegen/lower/written_inputs.py")),
    MetaKey("saved_by_eager", "tuple of node names",
            "the inputs (by name; \"\" for the op's own result) that eager's autograd "
            "saved for this op's backward, as recorded", (_CAPTURE,), ("codegen/lower/written_inputs.py",)),
    MetaKey("checks_version", "frozenset of output positions",
            "a fused group's placeholder or result that eager's autograd saved for an op "
            "of the group and Python after the segment can write: the group's backward "
            "checks its version when an output in the set got a gradient",
            ("codegen/lower/written_inputs.py",),
            ("codegen/lower/autodiff.py", "codegen/lower/written_inputs.py")),
    MetaKey("checks", "bool (True only)",
            "an op kept though its result is unused, for the error it may raise (a Cholesky "
            "tested for positive definiteness): impure for dead-code elimination, safe to run "
            "again when a replay raises", (_CAPTURE,),
            ("codegen/compile.py", _CAPTURE, "passes/functionalize.py")),
    MetaKey("example_value", "torch.SymInt (or a fake tensor)",
            "Dynamo's example of the node's value: a placeholder holding one of its SymInts "
            "is a size taken as an input", (), ("codegen/capture/symbolic.py",)),
    MetaKey("grapharg", "torch._dynamo's GraphArg",
            "Dynamo's record of a placeholder's argument: one with pass_arg_as_tensor is a "
            "float passed as a 0-d tensor, which fxlite keys by value",
            (), ("codegen/capture/symbolic.py",)),
    MetaKey("value", "int",
            "a placeholder's int argument (a size a recording takes as an input) as ShapeProp "
            "last saw it: what metadata inference computes the sizes that depend on it from",
            ("codegen/capture/run.py", "passes/shape_prop.py"), ("passes/shape_prop.py",)),
    MetaKey("stack_trace", "str",
            "the user's file, line and code that made the node (messages and logs print it)",
            (_CAPTURE, "codegen/lower/autocast.py", "fxlite/node.py", "fxlite/proxy.py",
             "passes/functionalize.py"),
            (_CAPTURE, "codegen/capture/records.py", "codegen/capture/run.py",
             "codegen/compile.py", "codegen/lower/autocast.py", "codegen/lower/segment.py",
             "fxlite/logs.py", "fxlite/node.py", "passes/functionalize.py")),
    MetaKey("nn_module_stack", "dict[str, tuple[str, type]]",
            "the modules the node was traced inside, outermost first: path -> (path, class)",
            ("fxlite/proxy.py",), ()),
    # ------------------------------------------------------------ recorded by capture
    MetaKey("tensor_meta_rec", "tuple (shape, stride, dtype, device, requires_grad)",
            "the recorded tensor's layout (codegen/capture/records.py tensor_meta); "
            "fill_meta turns it into tensor_meta",
            ("codegen/capture/follow.py", _CAPTURE, "codegen/capture/run.py",
             "codegen/lower/cross_entropy.py", "passes/attention.py", "passes/channels_last.py"),
            ("codegen/capture/follow.py", _CAPTURE, "codegen/compile.py",
             "codegen/lower/cross_entropy.py", "codegen/lower/pipeline.py", "passes/attention.py",
             "passes/channels_last.py", "passes/shape_prop.py")),
    MetaKey("device", "torch.device", "the tensor result's device (fill_meta, from "
            "tensor_meta_rec; ShapeProp)",
            ("codegen/lower/autocast.py", "codegen/lower/pipeline.py", "passes/shape_prop.py"),
            ("codegen/kernels/weights.py", "codegen/lower/autocast.py",
             "passes/decompose_rules.py", "passes/fold_constants.py", "passes/shape_prop.py")),
    MetaKey("requires_grad", "bool", "whether the recorded result required grad",
            (_CAPTURE, "passes/attention.py"),
            ("codegen/lower/pad_matmul.py", "codegen/lower/pipeline.py", "passes/attention.py",
             "passes/functionalize.py")),
    MetaKey("grad_enabled", "bool", "grad mode when the call was recorded",
            (_CAPTURE, "codegen/capture/run.py", "codegen/capture/symbolic.py"),
            ("codegen/capture/follow.py", _CAPTURE, "codegen/lower/pad_matmul.py",
             "codegen/lower/pipeline.py", "passes/attention.py", "passes/functionalize.py")),
    MetaKey("autocast", "bool (True only)", "the call was recorded under autocast",
            (_CAPTURE,),
            ("codegen/lower/autocast.py", "codegen/lower/cross_entropy.py",
             "codegen/lower/pad_matmul.py", "codegen/lower/pipeline.py", "passes/attention.py")),
    MetaKey("site", "tuple (file, line, function, source) | None",
            "the user's frame that made the call (codegen/capture/records.py user_site)",
            (_CAPTURE,), (_CAPTURE,)),
    MetaKey("in_place", "bool",
            "the node is an in-place write that functionalize made a new value: eager "
            "stored it in the written tensor's dtype, so a kernel's readers read it rounded",
            ("passes/functionalize.py",), ("codegen/kernels/analysis.py",)),
    MetaKey("impure", "bool",
            "the node has an effect (a write, randomness, an external call, a read of "
            "state): dead-code elimination keeps it and a replay cannot skip it; "
            "functionalize clears it on the writes it turns into copies",
            (_CAPTURE, "passes/functionalize.py"),
            ("codegen/capture/follow.py", _CAPTURE, "codegen/compile.py",
             "codegen/lower/batched_casts.py", "codegen/runtime/straight_line.py",
             "fxlite/ops/records.py", "passes/attention.py", "passes/functionalize.py")),
    MetaKey("external", "bool",
            "the call is recorded whole and runs as recorded, outside kernels and skipped "
            "by checks (t.backward(), an optimizer's step, GradScaler.unscale_)",
            (_CAPTURE,),
            ("codegen/compile.py", "codegen/lower/accuracy.py", "codegen/lower/batched_casts.py",
             "codegen/lower/segment.py")),
    MetaKey("read", "str",
            "the call gives Python a value read from tensors (t.item(), bool(t), a tensor's "
            "address): the call's name; the segment ends after it",
            (_CAPTURE,),
            ("codegen/capture/follow.py", _CAPTURE, "codegen/compile.py", "codegen/explain.py",
             "passes/functionalize.py")),
    MetaKey("mutated", "list[str]", "the names of the tensors the call wrote in place",
            (_CAPTURE, "passes/functionalize.py"),
            ("codegen/capture/follow.py", _CAPTURE, "codegen/capture/run.py",
             "codegen/capture/segments.py", "codegen/compile.py", "codegen/lower/batched_casts.py",
             "codegen/lower/written_inputs.py", "passes/functionalize.py")),
    MetaKey("aliased", "bool", "the in-place write went through a view (it writes its base too)",
            (_CAPTURE, "passes/functionalize.py"), (_CAPTURE, "passes/functionalize.py")),
    MetaKey("same_object", "str",
            "the name of the tensor this in-place call returned (a later version of it)",
            (_CAPTURE, "passes/functionalize.py"),
            (_CAPTURE, "codegen/lower/written_inputs.py", "passes/channels_last.py",
             "passes/functionalize.py")),
    MetaKey("returns_input", "bool (True only)",
            "the call returned its input object unchanged (x.float() of a float tensor)",
            (_CAPTURE,), ("codegen/capture/follow.py", _CAPTURE, "codegen/compile.py",
                          "passes/channels_last.py")),
    MetaKey("view", "bool (True only)",
            "the result is a view of its input: a followed call runs it for real",
            (_CAPTURE,), ("codegen/capture/follow.py",)),
    # ------------------------------------------------------------ compile and lowering
    MetaKey("settled", "list[tuple[str, weakref]]",
            "on an optimizer's step: the tensors it writes that nothing later writes, by name "
            "and real tensor; a check copies their values after the step",
            ("codegen/compile.py",), ("codegen/lower/segment.py",)),
    MetaKey("copies", "list[tuple[weakref, weakref]]",
            "on GradScaler.unscale_: (the user's tensor, the check's private copy) pairs, so "
            "the check unscales the copies' gradients",
            ("codegen/compile.py",), ("codegen/lower/segment.py",)),
    MetaKey("empty_ok", "bool (True only)",
            "an amax that may see an empty input: it runs as amax_or_empty, outside kernels",
            ("passes/decompose_rules.py",),
            ("codegen/kernels/analysis.py", "codegen/lower/pipeline.py")),
    MetaKey("no_fuse", "bool",
            "keep the node out of decompositions and fused groups (nothing in fxlite writes "
            "it today; a caller may)",
            (), ("passes/decompose.py", "passes/fuse/classes.py")),
    MetaKey("fused_space", "str ('full' or 'row')",
            "inside a fused group: the iteration space of the node (the whole shape, or a row)",
            ("passes/fuse/__init__.py",), ()),
    MetaKey("channels_last_of", "str",
            "on a clone to channels-last: the name of the input or weight it converts",
            ("passes/channels_last.py",), ("codegen/kernels/weights.py",)),
)
"""The keys of ``Node.meta``."""

MODULE_META: dict[str, MetaKey] = _table(
    MetaKey("fused_kind", "str ('pointwise', 'reduction', 'region', 'cat', or an op's kind)",
            "marks a submodule as a fused group (or an autograd region) and says which",
            ("codegen/kernels/cat.py", "codegen/lower/autograd_regions.py",
             "passes/fuse/__init__.py", "passes/fuse/lone_groups.py"),
            ("codegen/compile.py", "codegen/kernels/cat.py", "codegen/lower/autograd.py",
             "codegen/lower/autograd_pipeline.py", "codegen/lower/autograd_regions.py",
             "codegen/lower/pipeline.py", "codegen/lower/segment.py",
             "codegen/lower/written_inputs.py",
             "codegen/runtime/kernel.py", "codegen/runtime/precompile.py", "fxlite/viz/dot.py",
             "passes/fuse/lone_groups.py", "passes/fuse/read_through.py", "passes/networkx.py")),
    MetaKey("nodes", "list[str]", "the names of the original nodes a group or region holds",
            ("codegen/kernels/cat.py", "codegen/lower/autograd_regions.py",
             "passes/fuse/__init__.py", "passes/fuse/lone_groups.py"),
            ("codegen/lower/autograd_pipeline.py", "codegen/lower/autograd_regions.py",
             "codegen/lower/segment.py", "codegen/runtime/cat.py",
             "passes/fuse/lone_groups.py")),
    MetaKey("iteration_shape", "tuple[int, ...]", "the shape a fused group iterates over",
            ("passes/fuse/__init__.py",), ()),
    MetaKey("reduction_dims", "tuple[int, ...]",
            "the dims of iteration_shape a reduction group reduces", ("passes/fuse/__init__.py",),
            ()),
    MetaKey("out_spec", "pytree TreeSpec",
            "the structure of the exported function's result (fxlite.export)",
            ("codegen/explain.py",), ()),
)
"""The keys of ``GraphModule.meta``."""
