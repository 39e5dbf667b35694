"""Copies derived from parameters, made once and kept until a parameter changes.

Some rewrites run a layer on a transformed copy of its weight (padded rows, another memory
format). Making the copy on every call costs a kernel and host time each call; keeping it
costs memory, and the copy must follow the weight: :func:`kept` makes it again whenever
one of its sources was written in place (``_version``), given new storage (``.data``,
``set_``) or a new shape, stride or dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["kept"]

_kept: WeakIdKeyDictionary = WeakIdKeyDictionary()  # owner -> {tag: (state, copy)}


def _state(t: torch.Tensor | None) -> tuple:
    return () if t is None else (t._version, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def kept(owner: torch.Tensor, tag: str, sources: tuple[torch.Tensor | None, ...],
         make: Callable[..., Any]) -> Any:
    """``make(*sources)`` (run without autograd), from the copy kept with ``owner`` under
    ``tag`` while none of ``sources`` has changed since it was made.

    Example::

        w_cl = kept(w, "channels_last", (w,), lambda w: w.contiguous(memory_format=CL))
    """
    state = tuple(_state(t) for t in sources)
    entries = _kept.get(owner)
    if entries is None:
        entries = _kept[owner] = {}
    found = entries.get(tag)
    if found is None or found[0] != state:
        with torch.no_grad():
            found = entries[tag] = (state, make(*sources))
    return found[1]
