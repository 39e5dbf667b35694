"""The `fxlite` command: `fxlite demo`, `python -m fxlite`, and the demo's relu->gelu rewrite."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxlite as fx
from fxlite.cli import _relu_to_gelu, build_parser, main, run_demo
from fxlite.examples import ExampleBlock, example_input, make_example

REPO = Path(__file__).resolve().parents[1]


def test_demo_prints_table_code_and_passes_its_checks(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("opcode"))
    assert header.split() == ["opcode", "name", "target", "args", "kwargs"]
    assert out.count("def forward") == 2  # original and rewritten code
    before, after = out.split("after rewriting relu -> gelu")
    assert "torch.relu" in before and "gelu" not in before
    assert "gelu" in after and "torch.relu" not in after
    assert "traced == eager relu block:           True" in out
    assert "rewritten == eager gelu block:        True" in out


def test_demo_table_lists_every_node():
    buf = io.StringIO()
    assert run_demo(seed=3, out=buf) == 0
    gm = fx.symbolic_trace(make_example(seed=3))
    table = buf.getvalue()
    for node in gm.graph.nodes:
        assert f" {node.name} " in table


def test_python_dash_m_runs_the_demo():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "fxlite", "demo", "--seed", "1"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "def forward" in proc.stdout
    assert "opcode" in proc.stdout


def test_no_subcommand_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_parser_has_demo_subcommand_with_seed():
    args = build_parser().parse_args(["demo", "--seed", "7"])
    assert (args.command, args.seed) == ("demo", 7)


def test_relu_to_gelu_handles_every_spelling():
    def f(x):
        return torch.relu(x) + F.relu(x, inplace=False) + x.relu()

    gm = fx.symbolic_trace(f)
    assert _relu_to_gelu(gm.graph) == 3
    gm.graph.lint()
    gm.recompile()
    assert "relu" not in gm.code
    x = torch.randn(5, 3)
    torch.testing.assert_close(gm(x), 3 * F.gelu(x))


def test_rewritten_block_matches_gelu_block_and_differs_from_relu_block():
    model, x = make_example(seed=2), example_input(seed=2)
    gm = fx.symbolic_trace(model)
    assert _relu_to_gelu(gm.graph) == 1
    gm.recompile()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), make_example(seed=2, act="gelu")(x))
        assert not torch.allclose(gm(x), model(x))


def test_example_block_rejects_unknown_activation():
    with pytest.raises(ValueError, match="tanh"):
        ExampleBlock(act="tanh")


def _tabulate_reference(graph):
    from tabulate import tabulate

    rows = [[str(n.op), n.name, str(n.target), str(n.args), str(n.kwargs)] for n in graph.nodes]
    return tabulate(rows, headers=["opcode", "name", "target", "args", "kwargs"],
                    disable_numparse=True)


def test_demo_table_is_tabulates_simple_format(capsys):
    # print_tabular renders plain-ASCII tables itself, for speed; it must match tabulate.
    gm = fx.symbolic_trace(make_example())
    gm.graph.print_tabular()
    assert capsys.readouterr().out.rstrip("\n") == _tabulate_reference(gm.graph)


def test_table_with_wide_and_control_characters_matches_tabulate(capsys):
    def f(x):
        return x + torch.tensor(1.0), {"naïve": x, "tab\there": x, "宽": x}

    gm = fx.symbolic_trace(f)
    gm.graph.print_tabular()
    assert capsys.readouterr().out.rstrip("\n") == _tabulate_reference(gm.graph)
