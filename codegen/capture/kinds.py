"""What the capture does with each torch call: the tables behind ``fxlite.codegen.capture.run``.

Every call the ``TorchFunctionMode`` sees falls in one kind::

    kind         examples                                   what the recorder does
    meta         x.shape, x.size(), x.dtype, x.dim()        runs it; sizes mark the path size-specific
    read         bool(t), t.item(), t.tolist(), equal       a read node: the segment ends, the value is keyed
    set          x.grad = None                              an effect node (setattr)
    grad_mode    torch.no_grad() (via _set_grad_enabled)    runs it; the recorder notes the new mode
    external     t.backward(), t.register_hook(f)           an impure node that checks skip
    effect       torch._assert(c, msg)                      an impure node
    op           everything else                            a node; results become values
    unsupported  repr(t), t.data_ptr(), t.storage()         stops recording: the call finishes in eager

Random ops and in-place writes are ordinary ops marked impure (``random_op``; writes are
seen through tensor version counters). ``mutation_candidates`` names the tensors an op may
write, so their values before the write can be kept for the compile-time checks.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.autograd import forward_ad

__all__ = ["DYNAMIC_SHAPE", "SIZE_FANOUT", "SIZE_READERS", "UNSUPPORTED", "autocast_state",
           "classify", "eager_context", "hidden_writes", "mutation_candidates", "random_op",
           "set_autocast", "state_name"]

# Tensor-valued properties: recorded as getattr nodes (read again on every call).
_TENSOR_PROPERTIES = frozenset({"grad", "data", "T", "mT", "H", "mH", "real", "imag", "_base"})
_READS = frozenset({"__bool__", "item", "tolist", "__float__", "__int__", "__index__",
                    "__complex__", "__array__", "numpy", "equal", "allclose", "is_nonzero",
                    "__contains__"})
_META = frozenset({"size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous",
                   "element_size", "storage_offset", "is_floating_point", "is_complex",
                   "is_signed", "get_device", "__len__", "is_same_size", "has_names",
                   "is_pinned", "is_shared", "dim_order", "is_inference", "_is_view",
                   "__hash__", "__dir__", "__sizeof__", "is_set_to", "is_coalesced",
                   "__iter__", "__reversed__", "__array_priority__"})
SIZE_READERS = frozenset({"shape", "size", "numel", "nelement", "stride", "__len__"})
# Ops whose number of results depends on sizes: their results are size-specific too.
SIZE_FANOUT = SIZE_READERS | frozenset({
    "unbind", "split", "chunk", "tensor_split", "hsplit", "vsplit", "dsplit", "unsafe_split",
    "unsafe_chunk", "split_with_sizes", "__iter__"})
# Effects on state outside the graph (gradients, hooks, flags): never run by checks.
_EXTERNAL = frozenset({"backward", "register_hook", "retain_grad", "requires_grad_",
                       "register_post_accumulate_grad_hook"})
_EFFECTS = frozenset({"_assert", "_assert_async"})
UNSUPPORTED: dict[str, str] = {
    "__repr__": "formats a tensor as text (print, repr, f-strings)",
    "__str__": "formats a tensor as text (print, repr, f-strings)",
    "__format__": "formats a tensor as text (print, repr, f-strings)",
    "data_ptr": "reads a tensor's memory address (data_ptr)",
    "untyped_storage": "reads a tensor's storage object",
    "storage": "reads a tensor's storage object",
    "_typed_storage": "reads a tensor's storage object",
    "__reduce_ex__": "pickles a tensor",
    "__deepcopy__": "deep-copies a tensor with copy.deepcopy",
    "__setstate__": "unpickles into a tensor",
    # the hook is a function the call makes (it may hold the call's values): a replay
    # would register the first call's again, and the recording call's checks ran it twice
    "register_hook": "registers a hook on a tensor",
    "register_post_accumulate_grad_hook": "registers a hook on a tensor",
}
# Ops whose result size depends on tensor values.
DYNAMIC_SHAPE = frozenset({"nonzero", "argwhere", "masked_select", "unique", "_unique2",
                           "unique_consecutive", "bincount", "repeat_interleave"})
_RANDOM = frozenset({
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "bernoulli", "multinomial", "normal", "poisson", "rrelu", "gumbel_softmax",
    "random_", "uniform_", "normal_", "exponential_", "cauchy_", "log_normal_", "geometric_",
    "bernoulli_", "rrelu_", "native_dropout"})
_DROPOUTS = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
                       "dropout2d", "dropout3d", "feature_dropout", "dropout_",
                       "alpha_dropout_", "feature_dropout_", "feature_alpha_dropout_"})
# Position of the `inplace` flag in torch.nn.functional activations called positionally.
_INPLACE_AT = {"relu": 1, "relu6": 1, "elu": 2, "selu": 1, "celu": 2, "leaky_relu": 2,
               "hardtanh": 3, "rrelu": 4, "threshold": 3, "silu": 1, "mish": 1,
               "hardswish": 1, "hardsigmoid": 1, "dropout": 3, "alpha_dropout": 3,
               "feature_alpha_dropout": 3, "dropout1d": 3, "dropout2d": 3, "dropout3d": 3}
_INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__setitem__"})

_PROFILER = frozenset({"_record_function_enter", "_record_function_enter_new",
                       "_record_function_exit"})
_KINDS: dict[Any, str] = {}


def state_name(func: Any) -> str:
    """A call's short name: the attribute for property getters and setters."""
    name = getattr(func, "__name__", None)
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__", "__delete__") and isinstance(
            owner, types.GetSetDescriptorType):
        return owner.__name__
    return name if isinstance(name, str) else type(func).__name__


def classify(func: Any) -> str:
    """The kind of ``func`` (see the module docstring); cached per function."""
    try:
        return _KINDS[func]
    except KeyError:
        kind = _KINDS[func] = _classify(func)
        return kind
    except TypeError:  # unhashable
        return _classify(func)


def _classify(func: Any) -> str:
    name = getattr(func, "__name__", None)
    owner = getattr(func, "__self__", None)
    if isinstance(owner, types.GetSetDescriptorType):
        if name == "__get__":
            return "op" if owner.__name__ in _TENSOR_PROPERTIES else "meta"
        return "set"
    short = state_name(func)
    if short in UNSUPPORTED:
        return short
    if short in _PROFILER:  # profiling annotations (an optimizer step opens one)
        return "meta"
    if short == "_set_grad_enabled":
        return "grad_mode"
    if short in _READS:
        return "read"
    if short in _META:
        return "meta"
    if short in _EXTERNAL or func in (torch.autograd.backward, torch.autograd.grad):
        return "external"
    if short in _EFFECTS:
        return "effect"
    return "op"


def random_op(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the call draws random numbers (so it must run on every call, in order)."""
    name = state_name(func)
    if "generator" in kwargs:
        return True
    if name in _RANDOM:
        return True
    if name in _DROPOUTS:
        training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        return bool(training) and p != 0
    return False


def mutation_candidates(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` may write: in-place methods, ``out=``, ``inplace=True``, the
    running statistics of batch/instance norm."""
    name = state_name(func)
    found: list[Any] = []
    first = args[0] if args else None
    if (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS:
        found.append(first)
        if name.startswith("_foreach") and isinstance(first, (list, tuple)):
            found.extend(first)
    if kwargs.get("inplace") is True or (name in _INPLACE_AT and len(args) > _INPLACE_AT[name]
                                         and args[_INPLACE_AT[name]] is True):
        found.append(first)
    out = kwargs.get("out")
    found.extend(out if isinstance(out, (list, tuple)) else [out])
    found.extend(hidden_writes(func, args, kwargs))
    return [t for t in found if isinstance(t, torch.Tensor)]


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def hidden_writes(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors an op writes without bumping their version counters: the running
    statistics batch and instance norm update inside their kernels."""
    import torch.nn.functional as F

    if func is F.batch_norm:
        stats = [_arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var")]
        training = _arg(args, kwargs, 5, "training", False)
    elif func is torch.batch_norm:
        stats = [_arg(args, kwargs, 3, "running_mean"), _arg(args, kwargs, 4, "running_var")]
        training = _arg(args, kwargs, 5, "training", False)
    elif func is F.instance_norm:
        stats = [_arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var")]
        training = _arg(args, kwargs, 5, "use_input_stats", True)
    else:
        return []
    return [t for t in stats if isinstance(t, torch.Tensor)] if training else []


_DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """Autocast's enabled flag and dtype per device type."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in _DEVICE_TYPES)


def set_autocast(state: tuple) -> None:
    """Restore an ``autocast_state()``; recorded where autocast changes inside a function.

    It also empties autocast's cache of weight casts, as leaving ``torch.autocast`` does:
    a cast kept from an earlier call would hold the weights from before an optimizer step.
    """
    torch.clear_autocast_cache()
    for d, (enabled, dtype) in zip(_DEVICE_TYPES, state):
        torch.set_autocast_enabled(d, enabled)
        torch.set_autocast_dtype(d, dtype)


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_INTERPRETERS = getattr(torch._C._functorch, "peek_interpreter_stack", None)


def eager_context() -> str | None:
    """Why calls here must run in eager PyTorch, or None: inside a ``torch.func`` transform
    (``vmap``, ``grad``, ``jvp``: its tensors are wrappers, whose storage a kernel cannot
    read), inside forward-mode AD's ``dual_level`` (its tensors carry tangents, which
    kernels and replayed graphs drop), or inside non-reentrant activation checkpointing,
    in its forward or its recomputation (it checks that both save the same tensors, which
    a recording and a replay of one call do not: the replay's fused groups save fewer)."""
    if _INTERPRETERS is not None and _INTERPRETERS() is not None:
        return ("runs under a torch.func transform (vmap, grad, jvp...), whose wrapped "
                "tensors fxlite's kernels cannot take")
    if forward_ad._current_level >= 0:
        return ("runs inside forward-mode AD (torch.autograd.forward_ad.dual_level), whose "
                "tangents fxlite's kernels would drop")
    hooks = _TOP_HOOKS(False) if _TOP_HOOKS is not None else None
    if hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(
            ("_checkpoint_hook.", "_recomputation_hook.")):
        return ("runs inside torch.utils.checkpoint(use_reentrant=False), whose "
                "recomputation must save the tensors its first forward saved")
    return None
