"""Training-mode dropout as a deterministic op: the mask is a function of a seed.

``seed_dropouts(gm)`` rewrites each training-mode dropout into the table op
``seeded_dropout(x, p, seed, offset)``, with one ``draw_seed()`` per dropout at the top of
the graph::

    before                                   after
        y = F.dropout(x, 0.1)                    seed = draw_seed()       # torch's generator
                                                 y = seeded_dropout(x, 0.1, seed, 0)

``seeded_dropout`` is pure given its seed: it keeps element ``i`` (row-major index in
``x``) when ``philox_uniform(seed, offset + i) >= p`` and scales kept elements by
``1 / (1 - p)``. So it fuses like any pointwise op, a Triton kernel draws the mask in
registers (``tl.rand``, the same Philox stream as :func:`philox_uniform`, bit for bit),
and its derivative is ``seeded_dropout(g, p, seed, offset)``: the backward regenerates the
mask from the saved seed instead of storing it. Seeds come from torch's default (CPU)
generator, so calls differ and ``torch.manual_seed`` makes them reproducible. The mask is
not eager's (another generator); its law is the same.
"""

from __future__ import annotations

from typing import Any

import torch

from fxlite.ops.table import resolve

__all__ = ["draw_seed", "philox_uniform", "seed_dropouts", "seeded_dropout"]

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_SCALE = torch.tensor(4.6566127342e-10, dtype=torch.float32)  # tl's uint -> [0, 1) factor


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` 32-bit words of ``a * b`` for uint32 values held in int64 (no overflow:
    ``a`` is split in 16-bit halves)."""
    ah, al = a >> 16, a & 0xFFFF
    low = al * b  # < 2**48
    high = ah * b  # < 2**48
    hi = (high + (low >> 16)) >> 16
    lo = (((high & 0xFFFF) << 16) + low) & _MASK32
    return hi, lo


def philox_uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.rand(seed, index)`` in torch: float32 uniforms in [0, 1).

    Philox-4x32 with 10 rounds on the counter ``(index_lo, index_hi, 0, 0)`` and key
    ``(seed_lo, seed_hi)``, as ``triton.language.random`` computes it.
    """
    index = index.to(torch.int64)
    c0, c1 = index & _MASK32, (index >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi_b, lo_b = _mul32(_ROUND_B, c2)
        hi_a, lo_a = _mul32(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # as int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * _SCALE.to(x.device)


def seeded_dropout(input: torch.Tensor, p: float, seed: int, offset: int = 0) -> torch.Tensor:
    """Dropout whose mask is a function of ``(seed, offset)`` (see the module docstring).

    Example::

        y = seeded_dropout(x, 0.5, seed=7)      # the same y for the same seed
    """
    index = torch.arange(input.numel(), device=input.device).view(input.shape) + offset
    keep = philox_uniform(seed, index) >= p
    scale = 1.0 / (1.0 - p) if p < 1 else 0.0
    return torch.where(keep, input * scale, 0.0).to(input.dtype)


def draw_seed() -> int:
    """A fresh Philox seed from torch's default generator (advances it)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def seed_dropouts(gm: Any) -> Any:
    """Rewrite training-mode ``F.dropout`` / ``nn.Dropout`` calls of ``gm`` to
    ``seeded_dropout`` with a ``draw_seed()`` each (see the module docstring).

    Args:
        gm: a GraphModule (normalized or not). In-place dropouts and the channel and
            alpha variants are left as they are.

    Returns:
        ``gm``, recompiled.

    Example::

        # before                                # after
        def forward(self, x):                   def forward(self, x):
            dropout = F.dropout(x, 0.1)             draw_seed = fxlite...draw_seed()
            return dropout                          seeded_dropout = ...(x, 0.1, draw_seed, 0)
                                                    return seeded_dropout
    """
    graph = gm.graph
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        found = resolve(node, gm)
        if found is None or found[0].name != "dropout":
            continue
        args = found[1]
        p, x = args.get("p", 0.5), args.get("input")
        if args.get("training", True) is not True or args.get("inplace", False) is not False \
                or type(p) not in (int, float) or not 0 < p <= 1 or set(args) - {
                    "input", "p", "training", "inplace"}:
            continue  # (p == 0 draws nothing in eager: it stays a dropout, seedless)
        with graph.inserting_before(first):
            seed = graph.call_function(draw_seed, ())
        seed.meta["type"] = int
        with graph.inserting_before(node):
            new = graph.call_function(seeded_dropout, (x, float(p), seed, 0))
        new.meta = {k: v for k, v in node.meta.items() if k != "impure"}  # seeded: pure
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
