"""The `fxlite` command: demo, show, compile, --version, and one-line errors for bad arguments.

Most tests run the real command in a subprocess (`python -m fxlite`), as a user would.
"""

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxlite as fx
from fxlite.cli import build_parser, main
from fxlite.cli.commands import wrap_code
from fxlite.cli.demo import relu_to_gelu, run_demo
from fxlite.cli.load import UsageError, load_target, parse_input
from fxlite.examples import ExampleBlock, example_input, make_example

REPO = Path(__file__).resolve().parents[2]
WIDTH = 100


def _env(**extra):
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET="1", **extra)


def fxlite_cmd(*args, cwd=REPO, timeout=300, **env):
    """Run `python -m fxlite ARGS`; return the CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "fxlite", *args], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _assert_fits(text):
    long = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not long, f"{len(long)} line(s) wider than {WIDTH}: {long[0]!r}"


# ---------------------------------------------------------------------- demo
def test_demo_prints_table_code_diff_compile_and_passes_its_checks(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("opcode"))
    assert header.split() == ["opcode", "name", "target", "args", "kwargs", "shape"]
    assert "(every tensor is float32)" in out
    assert out.count("def forward") == 1
    assert "- relu = torch.relu(fc1)" in out and "+ gelu = torch.nn.functional.gelu(fc1)" in out
    assert "~ fc2 = self.fc2(relu)  ->  self.fc2(gelu)" in out
    for check in ("traced == eager relu block:", "rewritten == eager gelu block:",
                  "compiled == eager:"):
        assert re.search(rf"^{re.escape(check)}\s+True$", out, re.M), check
    assert "through Triton's interpreter" in out  # no GPU here: it says so
    assert "triton_fused_0" in out and "fallbacks: none" in out
    assert "FAILED" not in out


def test_demo_every_line_fits_in_100_columns_and_no_object_reprs():
    proc = fxlite_cmd("demo", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    _assert_fits(proc.stdout)
    assert " at 0x" not in proc.stdout and "<built-in" not in proc.stdout
    assert "torch.softmax" in proc.stdout and "torch.relu" in proc.stdout
    # no warnings and no redrawn bar in a pipe: progress lines only, which fit too
    _assert_fits(proc.stderr)
    assert "\r" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith("compile: first call") for line in lines), lines
    assert re.fullmatch(r"compile: first call done \(1/1\): 5 kernel\(s\), [\d.]+ s", lines[-1])


def test_demo_table_lists_every_node():
    buf = io.StringIO()
    assert run_demo(seed=3, out=buf, compile=False) == 0
    gm = fx.symbolic_trace(make_example(seed=3))
    table = buf.getvalue()
    for node in gm.graph.nodes:
        assert re.search(rf"^\S+\s+{re.escape(node.name)}\s", table, re.M), node.name


def test_demo_reports_a_failed_check(monkeypatch, capsys):
    # A rewrite that goes wrong must make the demo say so and exit 1, not print True.
    import fxlite.cli.demo as demo

    monkeypatch.setattr(demo, "relu_to_gelu", lambda graph: 0)
    assert main(["demo", "--no-compile"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^rewritten == eager gelu block:\s+False$", out, re.M)
    assert "FAILED: rewritten == eager gelu block" in out


def test_relu_to_gelu_handles_every_spelling():
    def f(x):
        return torch.relu(x) + F.relu(x, inplace=False) + x.relu()

    gm = fx.symbolic_trace(f)
    assert relu_to_gelu(gm.graph) == 3
    gm.graph.lint()
    gm.recompile()
    assert "relu" not in gm.code
    x = torch.randn(5, 3)
    torch.testing.assert_close(gm(x), 3 * F.gelu(x))


def test_rewritten_block_matches_gelu_block_and_differs_from_relu_block():
    model, x = make_example(seed=2), example_input(seed=2)
    gm = fx.symbolic_trace(model)
    assert relu_to_gelu(gm.graph) == 1
    gm.recompile()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), make_example(seed=2, act="gelu")(x))
        assert not torch.allclose(gm(x), model(x))


def test_example_block_rejects_unknown_activation():
    with pytest.raises(ValueError, match="tanh"):
        ExampleBlock(act="tanh")


# ---------------------------------------------------------------------- --version, help
def test_version():
    proc = fxlite_cmd("--version")
    assert proc.returncode == 0
    assert re.fullmatch(rf"fxlite {re.escape(fx.__version__)} \(torch {re.escape(torch.__version__)}"
                        r", triton \S+, Python \d+\.\d+\.\d+\)\n", proc.stdout)


def test_no_subcommand_prints_help_and_fails(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("demo", "show", "compile", "explain"))


def test_help_of_every_subcommand_fits():
    for cmd in ("demo", "show", "compile", "explain"):
        proc = fxlite_cmd(cmd, "--help", COLUMNS="200")
        assert proc.returncode == 0
        _assert_fits(proc.stdout)


@pytest.mark.skipif(not (Path(sys.executable).parent / "fxlite").exists(),
                    reason="the fxlite console script is installed by pip install -e .")
def test_console_script():
    proc = subprocess.run([str(Path(sys.executable).parent / "fxlite"), "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("fxlite ")


# ---------------------------------------------------------------------- show
def test_show_prints_table_with_shapes_inputs_outputs_and_code():
    proc = fxlite_cmd("show", "fxlite.examples:ExampleBlock", "--input", "3x5x8", "--shapes",
                      "--code")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    _assert_fits(out)
    assert out.startswith("fxlite.examples:ExampleBlock: 20 nodes\n")
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("call_")}
    assert rows["softmax"].split()[2] == "torch.softmax"
    assert rows["softmax"].rstrip().endswith("3x5x5")
    assert rows["fc1"].rstrip().endswith("3x5x32")
    assert "input  x: 3x5x8 float32" in out and "output 0: 3x5x8 float32" in out
    code = out[out.index("import torch"):]
    assert "def forward(self, x" in code
    # The wrapped code is still the module's code: compile it and compare.
    gm = fx.symbolic_trace(ExampleBlock())
    assert code.split() == gm.code.split()


def test_show_a_function_and_a_factory_and_draws_dot(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def gelu_mul(x, y):\n    return torch.nn.functional.gelu(x) * y\n"
        "def small():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n")
    proc = fxlite_cmd("show", "mymodels:gelu_mul", "--input", "2x4", "--input", "2x4:float64",
                      "--svg", str(tmp_path / "g.dot"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "torch.nn.functional.gelu" in proc.stdout
    assert re.search(r"^call_function\s+mul\s+operator.mul .* 2x4\s+float64$", proc.stdout, re.M)
    assert (tmp_path / "g.dot").read_text().startswith("digraph")
    proc = fxlite_cmd("show", "mymodels:small", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^call_module\s+_0\s", proc.stdout, re.M)  # the factory's Sequential


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")
def test_show_svg(tmp_path):
    proc = fxlite_cmd("show", "fxlite.examples:ExampleBlock", "--svg", str(tmp_path / "g.svg"))
    assert proc.returncode == 0, proc.stderr
    assert "<svg" in (tmp_path / "g.svg").read_text()


def test_show_of_untraceable_code_names_the_users_line(tmp_path):
    (tmp_path / "branchy.py").write_text(
        "import torch\ndef f(x):\n    if x.sum() > 0:\n        return x\n    return -x\n")
    proc = fxlite_cmd("show", "branchy:f", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("fxlite show: cannot trace branchy:f: ")
    assert "branchy.py\", line 3" in proc.stderr and "if x.sum() > 0:" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------- compile
def test_compile_prints_kernels_fallbacks_and_checks_on_the_cpu():
    proc = fxlite_cmd("compile", "fxlite.examples:ExampleBlock", "--input", "2x4x8")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    _assert_fits(out)
    assert "through Triton's interpreter (TRITON_INTERPRET=1)" in out
    assert re.search(r"on cpu: [1-9]\d* kernel\(s\)", out)
    assert re.search(r"^kernel\s+kind\s+fused ops\s+inputs\s+outputs\s+bytes moved$", out, re.M)
    assert "fallbacks: none" in out and "check against eager: same" in out


def test_compile_bench_times_eager_fxlite_and_torch_compile():
    proc = fxlite_cmd("compile", "fxlite.examples:ExampleBlock", "--input", "2x4x8", "--bench",
                      timeout=600, FXLITE_PROGRESS="1")
    assert proc.returncode == 0, proc.stderr
    _assert_fits(proc.stdout)
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.split()[:1] in (["eager"], ["fxlite"], ["torch.compile"])}
    assert set(rows) == {"eager", "fxlite", "torch.compile"}
    assert rows["eager"][-1] == "1.00x"
    for name, row in rows.items():
        first, median, p10, dash, p90 = row[1:6]
        assert dash == "-" and float(first) >= 0, name
        assert 0 < float(p10) <= float(median) <= float(p90), name
    assert "fxlite's times measure Triton's interpreter, not a GPU" in proc.stdout
    # The progress bar (forced on) went to stderr, one redrawn line per step.
    assert "bench  [" in proc.stderr and "3/3" in proc.stderr


# ---------------------------------------------------------------------- explain
def test_explain_names_each_graph_break_with_its_line(tmp_path):
    (tmp_path / "branchy.py").write_text(
        "import torch\n"
        "def f(a, b):\n"
        "    x = a / (torch.abs(a) + 1)\n"
        "    if b.sum() < 0:\n"
        "        b = b * -1\n"
        "    return x * b\n")
    proc = fxlite_cmd("explain", "branchy:f", "--input", "10", "--input", "10", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    _assert_fits(out)
    assert "graphs: 2, graph breaks: 1" in out
    assert re.search(r'File ".*branchy.py", line 4, in f\n\s+if b.sum\(\) < 0:', out)
    assert "torch.abs" in out and "guards:" in out


# ---------------------------------------------------------------------- bad arguments
BAD = {
    "unknown module": (["show", "nosuch_pkg.models:Net"], "no module named 'nosuch_pkg'"),
    "no colon": (["show", "fxlite.examples"], "names no object: write PKG.MODULE:OBJ"),
    "unknown attribute": (["show", "fxlite.examples:Nope"], "fxlite.examples has no 'Nope'"),
    "not a module or function": (["show", "fxlite.examples:INPUT_SHAPE"],
                                 "INPUT_SHAPE is a tuple, not a module or a function"),
    "not a module class": (["compile", "fxlite.cli.load:Target", "--input", "2"],
                           "fxlite.cli.load:Target is a class, but not an nn.Module"),
    "bad shape": (["show", "fxlite.examples:ExampleBlock", "--input", "2xq"],
                  "bad --input '2xq': write sizes joined by x and maybe a dtype: 2x16, 4x8:f16"),
    "bad dtype": (["compile", "fxlite.examples:ExampleBlock", "--input", "2x4x8:f99"],
                  "unknown dtype 'f99' in --input; try f32, f16, bf16, f64, i64, i32, bool"),
    "wrong input count": (["show", "fxlite.examples:ExampleBlock", "--input", "2", "--input", "3"],
                          "ExampleBlock takes 1 input(s) (x), not 2: give one --input each"),
    "unknown option": (["demo", "--bogus"], "fxlite demo: error: unrecognized arguments: --bogus"),
    "missing --input": (["compile", "fxlite.examples:ExampleBlock"],
                        "the following arguments are required: --input"),
    "bad --svg name": (["show", "fxlite.examples:ExampleBlock", "--svg", "g.txt"],
                       "use a .svg, .png, .pdf or .dot file name"),
    "unknown subcommand": (["explode"], "invalid choice: 'explode'"),
    "explain without --input": (["explain", "fxlite.examples:ExampleBlock"],
                                "the following arguments are required: --input"),
}
if not torch.cuda.is_available():
    BAD["missing GPU"] = (["compile", "fxlite.examples:ExampleBlock", "--input", "2x4x8",
                           "--device", "cuda"], "--device cuda, but")


# The four kinds of bad argument, and an unknown option, run as real processes
# (at once: each pays for importing torch); every case also runs in-process below.
IN_SUBPROCESS = ["unknown module", "bad shape", "not a module or function", "missing GPU",
                 "unknown option"]


@pytest.fixture(scope="module")
def bad_runs():
    """The IN_SUBPROCESS cases, each a fresh `python -m fxlite`: (exit code, stdout, stderr)."""
    procs = {case: subprocess.Popen([sys.executable, "-m", "fxlite", *BAD[case][0]], cwd=REPO,
                                    env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
             for case in IN_SUBPROCESS if case in BAD}
    return {case: (p.wait(timeout=300), *p.communicate()) for case, p in procs.items()}


def _check_one_line(case, code, out, err):
    assert code == 2, (out, err)
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err  # one line, no traceback
    assert BAD[case][1] in err
    assert err.startswith("fxlite")
    if case != "unknown subcommand":  # argparse lists the choices
        _assert_fits(err)


@pytest.mark.parametrize("case", [c for c in IN_SUBPROCESS if c in BAD])
def test_bad_argument_in_a_subprocess(bad_runs, case):
    _check_one_line(case, *bad_runs[case])


@pytest.mark.parametrize("case", list(BAD))
def test_bad_argument_gives_one_line_and_exit_2(case, capsys):
    try:
        code = main(BAD[case][0])
    except SystemExit as e:  # argparse's errors exit
        code = e.code
    out, err = capsys.readouterr()
    _check_one_line(case, code, out, err)


def test_user_code_that_raises_is_one_message_and_traceback_on_request(tmp_path):
    (tmp_path / "broken.py").write_text("class Net:\n    pass\ndef make():\n    raise OSError('disk')\n")
    proc = fxlite_cmd("show", "broken:make", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == ("fxlite show: error: broken:make() failed: OSError: disk; OBJ must "
                           "build with no arguments (give a factory function that does)\n")


# ---------------------------------------------------------------------- helpers
def test_parse_input():
    assert parse_input("2x16") == ((2, 16), torch.float32)
    assert parse_input("4x8:bf16") == ((4, 8), torch.bfloat16)
    assert parse_input("scalar:int64") == ((), torch.int64)
    assert parse_input("0x3") == ((0, 3), torch.float32)
    for bad in ("", "2x", "x2", "2,3", "-1", "2x3:", "2x3:float99", "2 x 3"):
        with pytest.raises(UsageError):
            parse_input(bad)


def test_load_target_kinds():
    assert load_target("fxlite.examples:ExampleBlock").how == "class"
    made = load_target("fxlite.examples:make_example")
    assert made.how == "factory" and not made.obj.training  # eval mode
    with pytest.raises(UsageError, match="example_input.. returned a Tensor; a factory must"):
        load_target("fxlite.examples:example_input")
    builtin = load_target("torch.nn.functional:gelu")
    assert builtin.how == "builtin" and builtin.parameters is None
    fn = builtin.with_arity(1)
    assert fn.how == "function" and fn.parameters == ["x0"]
    gm = fx.symbolic_trace(fn.obj)
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), F.gelu(x))
    with pytest.raises(UsageError, match="is a builtin: give one --input per input"):
        builtin.with_arity(0)
    assert load_target("fxlite.cli.demo:relu_to_gelu").how == "function"


def test_parser_has_every_subcommand():
    parser = build_parser()
    assert parser.parse_args(["demo", "--seed", "7"]).seed == 7
    args = parser.parse_args(["compile", "m:f", "--input", "2x3", "--bench"])
    assert (args.command, args.target, args.input, args.bench) == ("compile", "m:f", ["2x3"], True)


def test_wrap_code_keeps_code_valid():
    src = ("def forward(self, x):\n"
           "    y = torch.nn.functional.layer_norm(x, (8,), weight = self.w, bias = self.b, "
           "eps = 1e-05);  x = None\n"
           "    s = 'a, b, c, ' + 'd, e';  t = s\n    return y\n")
    wrapped = wrap_code(src, width=60)
    assert max(map(len, wrapped.splitlines())) <= 60
    assert wrapped.split() != src.split()  # it did wrap
    compile(wrapped, "<wrapped>", "exec")   # and it is still Python
    assert "'a, b, c, '" in wrapped         # never inside a string
