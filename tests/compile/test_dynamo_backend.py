"""``torch.compile(model, backend="fxlite")``: Dynamo captures, fxlite compiles each graph
and runs its own Triton kernels (Triton's interpreter on the CPU).

Needs the package installed (``pip install -e .``), which registers the
``torch_dynamo_backends`` entry point. Each test compares with eager over several calls:
outputs, Python side effects (a print at the graph break), gradients and, for training,
the parameters after every optimizer step.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import torch._dynamo
from fxlite.codegen import dynamo_backend, options

import fxlite
from fxlite.logs import kernel_listener

pytest.importorskip("triton")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
STEPS = 4


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    fxlite.reset()
    yield
    torch._dynamo.reset()


def test_fxlite_is_a_registered_dynamo_backend():
    assert "fxlite" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("fxlite") is dynamo_backend.fxlite_backend
    assert "fxlite_aot" in torch._dynamo.list_backends(exclude_tags=())


def with_breaks(x, w):
    y = torch.relu(x @ w + 1)
    print("between graphs")  # a graph break: Python runs here on every call
    s = y.sum().item()  # and another
    return (y * 2).sum(0) + s


def test_graph_breaks_equal_eager_and_fxlite_kernels_run(capsys):
    compiled = torch.compile(with_breaks, backend="fxlite")
    made = []
    with kernel_listener(made.append):
        for i in range(STEPS):
            x, w = torch.randn(4, 8), torch.randn(8, 8)
            torch.testing.assert_close(compiled(x, w), with_breaks(x, w))
            assert dynamo_backend.kernel_count() > 0  # the latest call ran fxlite kernels
    assert capsys.readouterr().out == "between graphs\n" * (2 * STEPS)
    graphs = dynamo_backend.compiled_graphs()
    assert len(graphs) >= 2  # one per piece between the breaks
    assert made and all(not g.fallbacks for g in graphs)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        if h.mean() > 10:  # a data-dependent branch: a graph break under Dynamo
            h = h / 2
        return self.fc2(h * 2 + 1)


def train(model, step_model, steps=STEPS, opt=torch.optim.SGD, **kw):
    """Train ``model`` (through ``step_model``) on a fixed stream of batches."""
    optimizer = opt(model.parameters(), **kw)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, target = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(step_model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("backend", ["fxlite", "fxlite_aot"])
@pytest.mark.parametrize("opt, kw", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                     (torch.optim.Adam, dict(lr=0.01))])
def test_training_steps_equal_eager(backend, opt, kw):
    torch.manual_seed(0)
    eager = Net()
    model = copy.deepcopy(eager)
    want = train(eager, eager, opt=opt, **kw)
    got = train(model, torch.compile(model, backend=backend), opt=opt, **kw)
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    names = [k.name for g in dynamo_backend.compiled_graphs() for k in g.kernels]
    if backend == "fxlite":  # forward and backward kernels of fxlite's own
        assert any("bwd" in n for n in names), names
    else:  # AOTAutograd's forward and backward graphs, their aten ops fused by fxlite
        assert len(dynamo_backend.compiled_graphs()) >= 2 and names, names


def test_a_compiled_step_that_calls_backward_equals_eager_and_runs_fxlites_backward():
    # the tutorial's pattern: the whole step compiled, backward() inside it. Dynamo traced
    # into fxlite's backward from the graph break at backward(), and a first call did not
    # finish in 100 s (session 30)
    torch.manual_seed(0)
    eager = Net()
    model = copy.deepcopy(eager)

    def step(model, opt, x, target):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        return loss.detach()

    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, eager))
    compiled = torch.compile(step, backend="fxlite")
    for _ in range(STEPS):
        x, target = torch.randn(6, 8), torch.randn(6, 4)
        torch.testing.assert_close(compiled(model, opt, x, target), step(eager, ref_opt, x, target))
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, msg=name)
    names = [k.name for g in dynamo_backend.compiled_graphs() for k in g.kernels]
    assert any("bwd" in n for n in names), names


def test_torch_compile_mode_reaches_fxlite():
    compiled = torch.compile(lambda x: torch.relu(x) * 3, backend="fxlite",
                             mode="max-autotune-no-cudagraphs")
    for _ in range(STEPS):
        x = torch.randn(16)
        torch.testing.assert_close(compiled(x), torch.relu(x) * 3)
    assert [g._mode for g in dynamo_backend.compiled_graphs()] == ["max-autotune"]


def test_reset_forgets_the_graphs():
    torch.compile(lambda x: x.sin() + 1, backend="fxlite")(torch.randn(3))
    assert dynamo_backend.compiled_graphs()
    fxlite.reset()
    assert dynamo_backend.compiled_graphs() == []


def test_to_torch_fx_keeps_the_program():
    model = Net().eval()
    x = torch.randn(3, 8)
    gm = fxlite.symbolic_trace(torch.nn.Sequential(model.fc1, torch.nn.ReLU(), model.fc2))
    tgm = options.to_torch_fx(gm)
    assert isinstance(tgm, torch.fx.GraphModule)
    assert [n.name for n in tgm.graph.nodes] == [n.name for n in gm.graph.nodes]
    torch.testing.assert_close(tgm(x), gm(x))


def test_the_old_paths_of_dynamos_backends_inside_fxlite_warn():
    with pytest.warns(DeprecationWarning, match="fxlite.codegen.options.to_torch_fx"):
        assert dynamo_backend.to_torch_fx is options.to_torch_fx
    with pytest.raises(AttributeError):
        dynamo_backend.no_such_name  # noqa: B018
