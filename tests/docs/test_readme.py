"""The README's Python blocks run as written, and its two commands are where .ci/run finds them."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _command(marker):
    found = re.search(rf"<!-- {marker} -->\n```sh\n(.*?)\n```", README)
    assert found, f"no ```sh block after <!-- {marker} -->"
    return found.group(1)


def test_two_commands_one_line_each():
    demo, test = _command("demo-command"), _command("test-command")
    for cmd in (demo, test):
        assert "\n" not in cmd and cmd.startswith("python3 -m venv .venv && ")
        assert ".venv/bin/pip install torch==2.13.0" in cmd
    assert demo.endswith(".venv/bin/fxlite demo")
    assert test.endswith("TRITON_INTERPRET=1 .venv/bin/python -m pytest -q")


def test_the_tour_is_about_twenty_lines():
    lines = [line for line in BLOCKS[0].splitlines() if line.strip()]
    assert 18 <= len(lines) <= 20


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs(index):
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "readme"})
