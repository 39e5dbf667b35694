"""The op table: one record per op, consulted by DCE, the rewriter and the passes.

Each :class:`OpInfo` names an op once and lists every spelling that means it::

    OpInfo("add", "pointwise", torch.add,
           functions=(torch.add, operator.add), methods=("add",))

``lookup(node)`` maps a node, whichever spelling it uses, to its record, so that passes
never grow ``if target == ...`` chains. The mechanism is in ``table.py`` and the records
in ``records.py``; importing ``fxlite.ops`` registers every record, complete (kind,
spellings, parameters, dtype rule). What a layer knows about an op beyond that is a dict
keyed by the op's name that lives with the layer: ``fxlite.ops.derivatives.VJP``,
``fxlite.ops.shapes`` (shapes), ``fxlite.passes.decompose.DECOMPOSITIONS`` and
``fxlite.codegen.kernels.ops.TRITON_OPS``.
"""

from fxlite.ops.records import has_side_effect, is_impure
from fxlite.ops.table import (
    OPS,
    OpInfo,
    attribute_at,
    call_args,
    canonical_args,
    canonical_target,
    copying_index,
    dtype_of,
    lookup,
    lookup_target,
    promote,
    register,
    resolve,
    result_dtype,
    same_literal,
    view_base,
    view_root,
)

__all__ = ["OpInfo", "OPS", "attribute_at", "call_args", "canonical_args",
           "canonical_target", "dtype_of", "has_side_effect", "is_impure", "lookup",
           "lookup_target", "promote", "register", "resolve", "result_dtype", "same_literal",
           "copying_index", "view_base", "view_root"]
