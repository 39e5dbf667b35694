"""What the ``fxlite`` command is pointed at: ``PKG.MODULE:OBJ``, ``--input`` shapes, a device.

Every problem with them raises :class:`UsageError` with one line that says what is wrong
and what to write instead; the command prints it and exits with status 2.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Target", "UsageError", "check_device", "check_size", "load_target", "make_inputs",
           "parse_input"]


class UsageError(Exception):
    """A bad argument: the command prints the message on one line and exits with 2."""


_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "f32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "f16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "double": torch.float64, "f64": torch.float64,
    "int64": torch.int64, "long": torch.int64, "i64": torch.int64,
    "int32": torch.int32, "int": torch.int32, "i32": torch.int32,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_SHAPE = re.compile(r"\d+(x\d+)*")
_INPUT_HELP = "sizes joined by x and maybe a dtype: 2x16, 4x8:f16"


@dataclass
class Target:
    """What ``PKG.MODULE:OBJ`` named, ready to trace or compile.

    Attributes:
        spec: the text the user gave.
        obj: an ``nn.Module`` (in eval mode) or a function.
        how: how it was made: ``"module"``, ``"class"``, ``"factory"`` or ``"function"``.
    """

    spec: str
    obj: torch.nn.Module | Callable[..., Any]
    how: str

    def with_arity(self, n: int) -> Target:
        """For a builtin without a signature: a function of ``n`` inputs that calls it."""
        if self.how != "builtin":
            return self
        if n == 0:
            raise UsageError(f"{self.spec} is a builtin: give one --input per input")
        fn = self.obj

        def call(*inputs: Any) -> Any:
            return fn(*inputs)

        params = [inspect.Parameter(f"x{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for i in range(n)]
        # symbolic_trace reads the signature to make one placeholder per input
        call.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        call.__name__ = call.__qualname__ = getattr(fn, "__name__", "builtin")
        return Target(self.spec, call, "function")

    @property
    def parameters(self) -> list[str] | None:
        """The names of the inputs that ``--input`` must give, in order (None: unknown)."""
        fn = self.obj.forward if isinstance(self.obj, torch.nn.Module) else self.obj
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return None
        return [p.name for p in sig.parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.default is p.empty]


def _required(fn: Callable[..., Any]) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sum(1 for p in sig.parameters.values() if p.default is p.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _import(module_name: str) -> Any:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules in the current folder
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UsageError(f"no module named {e.name!r} (not installed, and not in the "
                             f"current folder)") from None
        raise UsageError(f"importing {module_name} failed: {e}") from None
    except Exception as e:
        raise UsageError(f"importing {module_name} failed: {type(e).__name__}: {e}") from None


def load_target(spec: str) -> Target:
    """Import ``PKG.MODULE:OBJ`` and make what it names ready to trace.

    ``OBJ`` may be an ``nn.Module`` instance, a module class (built with no arguments),
    a factory function (one that takes no arguments and returns a module or function),
    or a function to trace. Modules are put in eval mode.

    Args:
        spec: ``PKG.MODULE:OBJ``, e.g. ``fxlite.examples:ExampleBlock``; ``OBJ`` may be
            dotted (``models:Zoo.small``).

    Returns:
        The :class:`Target`.

    Raises:
        UsageError: a malformed spec, an unknown module or attribute, an object that is
            not a module or function, or a class or factory that fails without arguments.

    Example::

        >>> load_target("fxlite.examples:ExampleBlock").how
        'class'
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{spec!r} names no object: write PKG.MODULE:OBJ, e.g. mymodels:Net")
    obj: Any = _import(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{module_name} has no {attr!r} (no attribute {part!r})")
        obj = getattr(obj, part)
    how = "module"
    if isinstance(obj, type):
        if not issubclass(obj, torch.nn.Module):
            raise UsageError(f"{spec} is a class, but not an nn.Module")
        obj, how = _build(spec, obj), "class"
    elif not isinstance(obj, torch.nn.Module):
        if not callable(obj):
            raise UsageError(f"{spec} is a {type(obj).__name__}, not a module or a function")
        required = _required(obj)
        if required is None:  # a builtin (torch.relu): traced through a wrapper, see with_arity
            how = "builtin"
        elif required == 0:  # a factory: call it for the module or function
            made = _build(spec, obj)
            if not (isinstance(made, torch.nn.Module) or callable(made)):
                raise UsageError(f"{spec}() returned a {type(made).__name__}; a factory must "
                                 f"return an nn.Module or a function")
            obj, how = made, "factory"
        elif required:
            how = "function"
    if isinstance(obj, torch.nn.Module):
        obj.eval()
    return Target(spec, obj, how)


def _build(spec: str, maker: Callable[..., Any]) -> Any:
    try:
        return maker()
    except Exception as e:
        raise UsageError(f"{spec}() failed: {type(e).__name__}: {e}; OBJ must build with no "
                         f"arguments (give a factory function that does)") from None


def parse_input(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Parse one ``--input``: ``2x16`` or ``2x16:float16`` (``scalar`` for a 0-d tensor).

    Args:
        text: the argument.

    Returns:
        (shape, dtype); float32 when no dtype is given.

    Raises:
        UsageError: for anything else.

    Example::

        >>> parse_input("4x8:bf16")
        ((4, 8), torch.bfloat16)
    """
    shape_text, colon, dtype_text = text.strip().partition(":")
    if shape_text == "scalar":
        shape: tuple[int, ...] = ()
    elif _SHAPE.fullmatch(shape_text):
        shape = tuple(int(s) for s in shape_text.split("x"))
    else:
        raise UsageError(f"bad --input {text!r}: write {_INPUT_HELP}")
    dtype = torch.float32
    if colon:
        if dtype_text not in _DTYPES:
            raise UsageError(f"unknown dtype {dtype_text!r} in --input; try f32, f16, bf16, "
                             f"f64, i64, i32, bool")
        dtype = _DTYPES[dtype_text]
    return shape, dtype


def make_inputs(specs: Sequence[str], device: str, seed: int = 0) -> list[torch.Tensor]:
    """Random tensors for ``--input`` specs: normal floats, small integers, fair booleans.

    Args:
        specs: the ``--input`` arguments, one per input.
        device: ``"cpu"`` or ``"cuda"``.
        seed: the seed of the generator that draws them.

    Returns:
        The tensors, in order.
    """
    parsed = [parse_input(s) for s in specs]
    for text, (shape, dtype) in zip(specs, parsed):
        check_size(text, shape, dtype, device)
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for shape, dtype in parsed:
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dtype)
        elif dtype == torch.bool:
            t = torch.rand(shape, generator=gen) > 0.5
        else:
            t = torch.randint(0, 10, shape, generator=gen).to(dtype)
        tensors.append(t.to(device))
    return tensors


def _memory(device: str) -> int | None:
    """Bytes of memory on ``device`` (None where unknown)."""
    try:
        if device == "cuda":
            return int(torch.cuda.mem_get_info()[1])
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None


def check_size(text: str, shape: Sequence[int], dtype: torch.dtype, device: str) -> None:
    """Raise :class:`UsageError` for an ``--input`` too big for ``device``'s memory,
    before anything is allocated.

    Example::

        check_size("99999999999x99999999999", (99999999999, 99999999999), torch.float32,
                   "cpu")   # UsageError: --input 99999999999x99999999999 needs 4e+13 GB, more ...
    """
    numel = 1
    for size in shape:
        numel *= size
    need = numel * dtype.itemsize
    have = _memory(device)
    if numel >= 2**63 or (have is not None and need > have):
        where = f"the {have / 1e9:.0f} GB here" if have is not None else "any memory"
        shown = text if len(text) <= 24 else text[:21] + "..."
        raise UsageError(f"--input {shown} needs {need / 1e9:.2g} GB, more than {where}")


def check_device(device: str | None) -> str:
    """The device to run on: ``cuda`` when available and not told otherwise, else ``cpu``.

    Raises:
        UsageError: ``--device cuda`` on a machine where torch sees no GPU.
    """
    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        reason = ("this torch is a CPU-only build" if torch.version.cuda is None
                  else "torch sees no GPU")
        raise UsageError(f"--device cuda, but {reason}: use --device cpu")
    return device or ("cuda" if available else "cpu")


def check_arity(target: Target, inputs: Sequence[str]) -> None:
    """Raise :class:`UsageError` unless there is one ``--input`` per required parameter."""
    names = target.parameters
    if names is not None and len(inputs) != len(names):
        wanted = ", ".join(names) or "none"
        name = target.spec.rpartition(":")[2]
        raise UsageError(f"{name} takes {len(names)} input(s) ({wanted}), not {len(inputs)}: "
                         f"give one --input each")
