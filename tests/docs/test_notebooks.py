"""The tutorials in notebooks/ run top to bottom on the CPU, and are committed without outputs."""

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_the_tutorials_are_there():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    repo = str(path.parents[1])
    # The kernel is a child process: it finds fxlite through PYTHONPATH in a checkout,
    # and runs Triton kernels through the interpreter on the CPU.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()  # raises CellExecutionError, with the cell and its traceback
    except nbclient.exceptions.CellExecutionError as err:
        # what the cells before printed (their warnings too): a rare failure says why
        printed = [f"[{c.get('id')}] " + "".join(o.get("text", "")) for c in book.cells
                   if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"]
        raise AssertionError("\n".join(printed[-12:]) + f"\n{err}") from err
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
