"""fxlite.logs: graph code under the user's source lines, graph breaks, kernels, FXLITE_LOGS."""

import io
import operator
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fxlite as fx
from fxlite import logs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _logs_off():
    yield
    logs.set_logs()


def _frame(file, line, fn, code):
    return f'  File "{file}", line {line}, in {fn}\n    {code}'


def _graph_with_stack_traces():
    """x -> sin -> add(sin, 1) -> mul(add, x): sin and add from one line, mul from another."""
    g = fx.Graph()
    x = g.placeholder("x")
    sin = g.call_function(torch.sin, (x,))
    add = g.call_function(operator.add, (sin, 1))
    mul = g.call_function(operator.mul, (add, x))
    g.output(mul)
    outer = _frame("/elsewhere/train.py", 40, "main", "model(x)")
    for node, trace in ((sin, _frame("/elsewhere/model.py", 5, "f", "y = torch.sin(x) + 1")),
                        (add, _frame("/elsewhere/model.py", 5, "f", "y = torch.sin(x) + 1")),
                        (mul, _frame("/elsewhere/model.py", 6, "f", "return y * x"))):
        node.meta["stack_trace"] = outer + "\n" + trace  # innermost frame last, as torch.fx
    return fx.GraphModule(torch.nn.Module(), g)


def test_graph_code_puts_each_source_line_above_the_ops_it_produced():
    buf = io.StringIO()
    logs.set_logs(graph_code=True, file=buf)
    gm = _graph_with_stack_traces()
    logs.log_graph(gm, "captured graph 0: f")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "===== captured graph 0: f ====="
    assert lines[1] == "def forward(self, x):"
    c5 = "    # File: /elsewhere/model.py:5 in f, code: y = torch.sin(x) + 1"
    c6 = "    # File: /elsewhere/model.py:6 in f, code: return y * x"
    assert lines[2] == c5 and lines[5] == c6
    assert lines[3].strip().startswith("sin = torch.sin(x)")
    assert lines[4].strip().startswith("add = sin + 1")  # same line: no second comment
    assert lines[6].strip().startswith("mul = add * x")
    assert lines[7].strip() == "return mul"
    # The printout is the module's real code once the comments are taken out.
    code = "\n".join(line for line in lines[1:] if not line.strip().startswith("#"))
    assert code == gm.code[gm.code.index("def forward"):].rstrip("\n")


def test_graph_code_of_nodes_without_stack_traces_is_the_plain_code():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    text = logs.format_graph(gm.graph, "g")
    assert "# File" not in text
    assert text.split("\n", 1)[1] == gm.code[gm.code.index("def forward"):].rstrip("\n")


def test_paths_under_the_working_folder_print_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trace = _frame(str(tmp_path / "pkg" / "m.py"), 3, "g", "return x")
    assert logs.source_comment(trace) == f"# File: {os.path.join('pkg', 'm.py')}:3 in g, code: return x"
    assert logs.source_comment("no frame here") is None
    assert logs.source_comment(None) is None


def test_logs_that_are_off_print_nothing(capsys):
    gm = _graph_with_stack_traces()
    logs.log_graph(gm)
    logs.log_break("data-dependent branch")
    logs.log_kernel(SimpleNamespace(name="k", source="src"))
    assert capsys.readouterr() == ("", "")
    logs.set_logs(graph_breaks=True)          # one log on: only that one prints
    logs.log_graph(gm)
    logs.log_kernel(SimpleNamespace(name="k", source="src"))
    logs.log_break("data-dependent branch\n" + _frame("m.py", 6, "f", "if x.sum() > 0:"))
    err = capsys.readouterr().err
    assert err.splitlines() == ["----- graph break -----", "data-dependent branch",
                                '  File "m.py", line 6, in f', "    if x.sum() > 0:"]


def test_kernel_log_prints_name_kind_ops_and_source(capsys):
    logs.set_logs(kernels=True)
    kernel = SimpleNamespace(name="triton_fused_0", kind="pointwise", nodes=["add", "relu"],
                             source="@triton.jit\ndef triton_fused_0(x_ptr):\n    pass\n")
    logs.log_kernel(kernel)
    assert capsys.readouterr().err.splitlines() == [
        "===== kernel triton_fused_0 (pointwise: add, relu) =====",
        "@triton.jit", "def triton_fused_0(x_ptr):", "    pass"]
    assert logs.enabled("kernels") and not logs.enabled("graph_code")


def test_set_logs_is_reachable_from_fxlite():
    fx.set_logs(graph_code=True)
    assert logs.enabled("graph_code")
    fx.set_logs()
    assert not logs.enabled("graph_code")


@pytest.mark.parametrize("value, on", [
    ("graph_code,kernels", ["graph_code", "kernels"]),
    ("all", ["graph_code", "graph_breaks", "kernels"]),
    (" graph_breaks ,", ["graph_breaks"]),
])
def test_fxlite_logs_values(value, on):
    logs._from_env(value)
    assert [n for n in logs.LOGS if logs.enabled(n)] == on


def test_fxlite_logs_with_an_unknown_name_warns_with_the_valid_ones():
    with pytest.warns(UserWarning, match="unknown log name.s. kernel; use graph_code, "
                                         "graph_breaks, kernels or all"):
        logs._from_env("graph_code,kernel")
    assert logs.enabled("graph_code") and not logs.enabled("kernels")


def test_fxlite_logs_is_read_when_fxlite_logs_is_imported():
    code = "import fxlite.logs as l; print([n for n in l.LOGS if l.enabled(n)])"
    env = dict(os.environ, FXLITE_LOGS="kernels", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['kernels']"


def test_kernel_listener_sees_kernels_with_the_log_off(capsys):
    seen = []
    kernel = SimpleNamespace(name="k", source="src")
    with logs.kernel_listener(seen.append):
        logs.log_kernel(kernel)
    logs.log_kernel(kernel)  # after the block: no longer called
    assert seen == [kernel]
    assert capsys.readouterr() == ("", "")


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs Triton kernels (a GPU or TRITON_INTERPRET=1)")
def test_the_kernel_log_under_autograd_keeps_the_kernels_and_shows_backward_ones(capsys):
    # With the kernels log on, logging an autograd group (which has no source of its own)
    # raised, and the whole function fell back to eager: logging changed what ran.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logs.set_logs(kernels=True)
    f = lambda x: torch.tanh(x * -1.5)  # noqa: E731
    compiled = fx.compile(f)
    for _ in range(2):
        x = torch.randn(7, device=device)
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled(mine).sum().backward()
        f(theirs).sum().backward()
        torch.testing.assert_close(mine.grad, theirs.grad)
    assert compiled.fallbacks == []
    printed = capsys.readouterr().err
    directions = sorted(k.direction for k in compiled.kernels)
    assert directions == ["backward", "forward"]
    for kernel in compiled.kernels:  # each printed once, the backward one when it was made
        assert printed.count(f"===== kernel {kernel.name} ") == 1
