"""The `fxlite` command's quick answers and its progress (issue 39).

- ``fxlite --help`` and ``fxlite --version`` import neither torch nor Triton, and take
  under half the time of ``python -c "import torch"``;
- progress is a redrawn bar on a terminal and plain lines anywhere else, every line within
  100 columns, and the count it ends on is the kernels the call runs;
- ``--input`` too big for the machine is a usage error: one line, exit status 2.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WIDTH = 100


def _env(**extra):
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET="1", **extra)


def _run(*args, **env):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_env(**env),
                          capture_output=True, text=True, timeout=300)


def _fits(text):
    long = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not long, long[0]


# ---------------------------------------------------------------------- without torch
NO_TORCH = ("import sys; from fxlite.cli import main\n"
            "try:\n    code = main({args!r})\nexcept SystemExit as e:\n    code = e.code\n"
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'imported'\n"
            "sys.exit(code)")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["demo", "--help"],
                                  ["compile", "--help"], ["show", "--help"],
                                  ["explain", "--help"], []])
def test_help_and_version_do_not_import_torch(args):
    proc = _run("-c", NO_TORCH.format(args=args), COLUMNS="200")
    assert proc.returncode == (2 if not args else 0), proc.stderr
    assert proc.stderr == ""
    _fits(proc.stdout)
    assert proc.stdout


def test_the_subcommands_leave_triton_unimported_until_they_run():
    # `fxlite compile` on the CPU sets TRITON_INTERPRET (commands.use_interpreter) after
    # main has imported fxlite.cli.run; Triton reads it once, when imported.
    proc = _run("-c", "import sys, fxlite.cli.run; assert 'torch' in sys.modules; "
                      "assert 'triton' not in sys.modules, 'imported'")
    assert proc.returncode == 0, proc.stderr


def test_version_names_torch_and_triton_from_their_metadata():
    from importlib import metadata

    proc = _run("-m", "fxlite", "--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith("fxlite 0.1.0 (torch ")
    assert f"torch {metadata.version('torch')}," in proc.stdout
    assert "Python " in proc.stdout and proc.stdout.count("\n") == 1


def _best_of(times, *command):
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        subprocess.run(list(command), cwd=REPO, env=_env(), capture_output=True, timeout=300,
                       check=True)
        best = min(best, time.perf_counter() - start)
    return best


def test_help_and_version_take_under_half_of_importing_torch():
    script = Path(sys.executable).parent / "fxlite"  # the console script, when installed
    commands = [[sys.executable, "-m", "fxlite"]] + ([[str(script)]] if script.exists() else [])
    torch_s = _best_of(2, sys.executable, "-c", "import torch")
    for command in commands:
        for flag in ("--help", "--version"):
            ours = _best_of(2, *command, flag)
            assert ours < torch_s / 2, (command, flag, ours, torch_s)


def test_import_fxlite_imports_no_torch():
    proc = _run("-c", "import sys, fxlite; assert 'torch' not in sys.modules; "
                      "print(fxlite.__version__, 'compile' in dir(fxlite))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "0.1.0 True\n"


# ---------------------------------------------------------------------- progress
class _Pipe(io.StringIO):
    def isatty(self):
        return False


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_prints_lines_away_from_a_terminal(monkeypatch):
    from fxlite.cli import progress
    from fxlite.cli.progress import Progress

    monkeypatch.delenv("FXLITE_PROGRESS", raising=False)
    monkeypatch.setattr(progress, "LINE_EVERY", 0.05)
    out = _Pipe()
    count = iter(range(100))
    with Progress(2, "compile", stream=out) as bar:
        with bar.step("first call", lambda: f"{next(count)} kernel(s)"):
            time.sleep(0.3)
        with bar.step("x" * 150):
            pass
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "compile: first call ..."
    assert any(line.startswith("compile: first call: ") and "kernel(s)" in line
               for line in lines[1:-3])  # while it ran
    assert lines[-3].startswith("compile: first call done (1/2): ")
    assert lines[-1].endswith("...") and lines[-1].startswith("compile: xxx")
    assert all(len(line) <= WIDTH for line in lines)


def test_progress_bar_on_a_terminal_and_off_when_asked(monkeypatch):
    from fxlite.cli.progress import Progress

    monkeypatch.delenv("FXLITE_PROGRESS", raising=False)
    tty = _Tty()
    with Progress(1, "bench", stream=tty) as bar, bar.step("eager"):
        pass
    assert "\rbench  [####################]  1/1  eager: " in tty.getvalue()
    assert "\n" not in tty.getvalue()
    monkeypatch.setenv("FXLITE_PROGRESS", "0")
    quiet = _Pipe()
    with Progress(1, "bench", stream=quiet) as bar, bar.step("eager"):
        pass
    assert quiet.getvalue() == ""


def test_kernel_count_ends_on_the_kernels_the_call_runs():
    from types import SimpleNamespace

    from fxlite.cli.commands import KernelCount

    compiled = SimpleNamespace(kernels=["k0", "k1", "k2"])
    count = KernelCount(compiled)
    kernel = object()
    count.add(kernel)
    count.add(kernel)  # logged twice (a retried layout): counted once
    assert count() == "1 kernel(s) made so far"
    count.finished = True
    assert count() == "3 kernel(s)"


# ---------------------------------------------------------------------- too big
@pytest.mark.parametrize("command", ["compile", "explain", "show"])
def test_an_input_bigger_than_memory_is_one_line_and_exit_2(command):
    proc = _run("-m", "fxlite", command, "fxlite.examples:ExampleBlock",
                "--input", "99999999999x99999999999")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"fxlite {command}: error: --input 99999999999x99999999999 "
                                  "needs 4e+13 GB, more than the ")
    _fits(proc.stderr)


def test_check_size_before_any_allocation():
    import torch

    from fxlite.cli.load import UsageError, check_size

    check_size("2x3", (2, 3), torch.float32, "cpu")
    check_size("0x99999999999", (0, 99999999999), torch.float32, "cpu")
    with pytest.raises(UsageError, match="needs .* GB, more than"):
        check_size("99999999999x99999999999x99999999999:f64",
                   (99999999999,) * 3, torch.float64, "cpu")


# ---------------------------------------------------------------------- warnings
def test_warnings_are_fitted_lines_on_stderr(tmp_path):
    (tmp_path / "printing.py").write_text(
        "import torch\n\n\ndef f(x):\n    print(x.shape)\n    x.data_ptr()  # eager from here: "
        "a tensor's address read, which the warning names with this long line\n"
        "    return torch.relu(x) * 2\n")
    proc = subprocess.run([sys.executable, "-m", "fxlite", "compile", "printing:f", "--input",
                           "4x4"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    _fits(proc.stdout)
    _fits(proc.stderr)
    assert "warning: fxlite.compile: f runs in eager PyTorch: it reads a tensor's memory" \
        in proc.stderr
    assert "UserWarning" not in proc.stderr and "check against eager: same" in proc.stdout
