"""Small bundled models for ``fxlite demo``, the README and the tests.

They use only the standard ``torch.nn`` leaf modules and plain torch ops, so they trace
with the default :class:`fxlite.Tracer` and run on the CPU in milliseconds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["INPUT_SHAPE", "ExampleBlock", "example_input", "make_example"]


class ExampleBlock(nn.Module):
    """A pre-norm transformer block: single-head attention, then an MLP, each with a residual.

    Args:
        dim: the feature size of the input's last dimension.
        hidden: the MLP's hidden size.
        act: the MLP activation, ``"relu"`` or ``"gelu"``. The demo traces the ``"relu"``
            block, rewrites its graph to use gelu, and checks it against the ``"gelu"`` one.

    Example::

        >>> block = ExampleBlock()
        >>> block(torch.randn(2, 4, 8)).shape
        torch.Size([2, 4, 8])
    """

    def __init__(self, dim: int = 8, hidden: int = 32, act: str = "relu") -> None:
        super().__init__()
        if act not in ("relu", "gelu"):
            raise ValueError(f"act must be 'relu' or 'gelu', got {act!r}")
        self.dim = dim
        self.act = act
        self.scale = 1.0 / math.sqrt(dim)
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.norm_bias = nn.Parameter(torch.zeros(dim))
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (self.dim,), self.norm_weight, self.norm_bias)
        scores = self.q(h) @ self.k(h).transpose(-2, -1) * self.scale
        x = x + self.proj(torch.softmax(scores, dim=-1) @ self.v(h))
        h = F.layer_norm(x, (self.dim,), self.norm_weight, self.norm_bias)
        # `self.act` is a plain string, so this branch is decided while tracing.
        h = torch.relu(self.fc1(h)) if self.act == "relu" else F.gelu(self.fc1(h))
        return x + self.fc2(h)


INPUT_SHAPE = (2, 4, 8)
"""The (batch, sequence, feature) shape that the demo feeds :class:`ExampleBlock`."""


def make_example(seed: int = 0, act: str = "relu") -> ExampleBlock:
    """Build an :class:`ExampleBlock` with weights drawn from ``seed``, in eval mode.

    The same ``seed`` gives the same weights whatever ``act`` is, so a ``"gelu"`` block
    is the eager reference for a traced ``"relu"`` block rewritten to use gelu.

    Args:
        seed: the seed for ``torch.manual_seed`` before the weights are initialised.
        act: the MLP activation, ``"relu"`` or ``"gelu"``.

    Returns:
        The module.

    Example::

        >>> model = make_example(seed=1)
    """
    torch.manual_seed(seed)
    return ExampleBlock(act=act).eval()


def example_input(seed: int = 0) -> torch.Tensor:
    """A random float32 input of shape :data:`INPUT_SHAPE` for :class:`ExampleBlock`.

    Args:
        seed: the seed of the generator that draws it.

    Returns:
        The tensor.

    Example::

        >>> example_input().shape
        torch.Size([2, 4, 8])
    """
    return torch.randn(INPUT_SHAPE, generator=torch.Generator().manual_seed(seed))
