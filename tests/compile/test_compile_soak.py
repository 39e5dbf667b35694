"""A soak test of fxlite.compile on small realistic programs.

Each program is a module whose ``forward`` is drawn from the statements ordinary models
use: linear layers, norms, in-place activations, residuals, buffer updates, dropout,
size reads, in-place writes to intermediates and inputs, data-dependent branches, loops
counted by ``.item()``, dict and tuple results. Each is called several times with fresh
inputs (signs flipped, so branches alternate), and after every call three things must
hold: no exception escaped, the result equals eager PyTorch's, and every input and
buffer ends as eager leaves it.

The programs are generated from fixed seeds, so CI runs the same ones every time;
``FXLITE_SOAK=N`` runs N programs instead of the default.
"""

from __future__ import annotations

import copy
import os
import random
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("triton")

from fxlite.codegen.runtime.kernel import interpreting

import fxlite

DEVICE = "cpu" if interpreting() else "cuda"
COUNT = int(os.environ.get("FXLITE_SOAK", "240"))
WIDTH = 8

# Statement templates; {i} is a fresh index for the submodules a statement needs.
_STATEMENTS = [
    ("h = self.lin{i}(h)", "self.lin{i} = nn.Linear(W, W)"),
    ("h = torch.relu(h)", None),
    ("h = F.gelu(h)", None),
    ("h = torch.tanh(h) * 2", None),
    ("h = self.act{i}(h)", "self.act{i} = nn.ReLU(inplace=True)"),
    ("self.act{i}(h)", "self.act{i} = nn.SiLU(inplace=True)"),
    ("h = self.norm{i}(h)", "self.norm{i} = nn.LayerNorm(W)"),
    ("h = h + x", None),
    ("h = h * self.scale{i}", "self.register_buffer('scale{i}', torch.rand(W) + 0.5)"),
    ("self.steps{i} += 1\n        h = h * (1 + self.steps{i} * 0.01)",
     "self.register_buffer('steps{i}', torch.zeros(()))"),
    # Branch on the input's sum: an intermediate's may be rounding noise (the sum of a
    # layer-normed row is about 0), whose sign kernels and eager may not share.
    ("if x.sum() > 0:\n            h = h * 0.5\n        else:\n            h = h - 1", None),
    ("if h.abs().amax() > 1.5:\n            h = h / 2", None),
    ("h = torch.softmax(h, dim=-1) * W", None),
    ("h = h - h.mean(-1, keepdim=True)", None),
    ("h = h.reshape(h.shape[0], 2, -1).sum(1).repeat(1, 2)", None),
    ("h = F.dropout(h, 0.3, self.training)", None),
    ("h.mul_(0.5)", None),
    ("x.add_(0.1)", None),
    ("h = torch.where(h > 0, h, h * 0.1)", None),
    ("h = h.clamp(-2.0, 2.0)", None),
    ("for _ in range(int((h > 0).sum().item()) % 3):\n            h = h * 1.1", None),
    ("h = self.bn{i}(h)", "self.bn{i} = nn.BatchNorm1d(W)"),
    ("h = h + torch.randn_like(h) * 0.01", None),
    ("h = h[:, torch.arange(W - 1, -1, -1, device=h.device)]", None),
]
_RETURNS = ["return h", "return {'out': h, 'total': h.sum()}", "return h, x * 1.0",
            "return h.sum(-1)"]


def make_program(seed: int) -> tuple[str, nn.Module]:
    """Source and instance of a random module (deterministic per seed)."""
    rng = random.Random(seed)
    body, init = [], []
    for i in range(rng.randint(2, 7)):
        stmt, setup = rng.choice(_STATEMENTS)
        body.append(stmt.format(i=i))
        if setup:
            init.append(setup.format(i=i))
    source = "\n".join([
        "class Program(nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
        *(f"        {line}" for line in init or ["pass"]),
        "",
        "    def forward(self, x):",
        "        h = x * 1.0",
        *(f"        {line}" for line in body),
        f"        {rng.choice(_RETURNS)}",
    ])
    namespace = {"nn": nn, "torch": torch, "F": F, "W": WIDTH}
    exec(compile(source, f"<soak program {seed}>", "exec"), namespace)
    torch.manual_seed(seed)
    module = namespace["Program"]().to(DEVICE)
    module.train(rng.random() < 0.5)
    return source, module


@pytest.mark.parametrize("chunk", range(8))
def test_programs_match_eager(chunk):
    failures = []
    for seed in range(chunk, COUNT, 8):
        source, module = make_program(seed)
        eager = copy.deepcopy(module)
        compiled = fxlite.compile(module)
        try:
            for call in range(4):
                x = torch.randn(3, WIDTH, device=DEVICE) * (1 if call % 2 == 0 else -1)
                x_eager, x_comp = x.clone(), x.clone()
                torch.manual_seed(1000 + call)
                with torch.no_grad():
                    want = eager(x_eager)
                torch.manual_seed(1000 + call)
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = compiled(x_comp)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(x_comp, x_eager, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(module.state_dict(), eager.state_dict(),
                                           rtol=1e-4, atol=1e-4)
        except Exception as e:  # collect: one report names every failing program
            failures.append(f"seed {seed}, call {call}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}\n{source}")
    assert not failures, f"{len(failures)} programs differ from eager:\n\n" + "\n\n".join(
        failures[:3])
