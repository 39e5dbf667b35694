"""The HTML views, rendered by a real browser: headless Chromium (Debian's `chromium`).

A page holds a graph's table (and drawing, with Graphviz) and a kernel report; a script in
it reads the *rendered* layout (which tables, which columns, where they sit and how wide
they are) into the DOM, which Chromium dumps; Chromium also takes a screenshot. Skipped
where no chromium is installed (.ci/run installs it).
"""

import contextlib
import io
import json
import os
import re
import shutil
import subprocess

import pytest
import torch
from fxlite.passes import ShapeProp

import fxlite as fx

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

# Reads each rendered table: caption, header texts and boxes, row count, cell texts.
_PROBE = """
<script>
window.addEventListener("load", () => {
  const tables = [...document.querySelectorAll("div.fxlite table")].map(t => {
    const heads = [...t.querySelectorAll("thead th")];
    const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.width, r.height]; };
    return {
      caption: t.caption ? t.caption.textContent : null,
      headers: heads.map(h => h.textContent),
      boxes: heads.map(box),
      rows: [...t.querySelectorAll("tbody tr")].map(r => [...r.cells].map(c => c.textContent)),
      visible: box(t)[1] > 0 && box(t)[2] > 0,
    };
  });
  const svgs = [...document.querySelectorAll("div.fxlite svg")].map(s => {
    const r = s.getBoundingClientRect(); return [r.width, r.height];
  });
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({tables, svgs, details: document.querySelectorAll("details").length});
  document.body.appendChild(out);
});
</script>
"""


def _chromium(*args, tmp_path):
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1000"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def _softmax_block(x):
    return torch.softmax(torch.relu(x) * 2.0, dim=-1) + x


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    gm = fx.symbolic_trace(_softmax_block)
    x = torch.randn(4, 16)
    ShapeProp(gm).propagate(x)
    compiled = fx.compile(_softmax_block)
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        compiled(x)
        compiled(x)
        report = compiled.report()
    if not compiled.kernels:
        pytest.skip("no kernels were built (TRITON_INTERPRET=1 is needed on the CPU)")
    html = (f"<!doctype html><html><head><meta charset='utf-8'></head><body>"
            f"<h3>graph</h3>{gm.graph._repr_html_()}<h3>kernels</h3>{report._repr_html_()}"
            f"{_PROBE}</body></html>")
    path = tmp / "page.html"
    path.write_text(html, encoding="utf-8")
    return tmp, path, gm, compiled


def test_rendered_tables_have_their_columns_in_order(page):
    tmp, path, gm, compiled = page
    proc = _chromium("--dump-dom", path.as_uri(), tmp_path=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert found, proc.stdout[-2000:]
    probe = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&")
                       .replace("&lt;", "<").replace("&gt;", ">"))
    graph_table, kernel_table = probe["tables"]

    assert graph_table["headers"] == ["opcode", "name", "target", "args", "kwargs", "shape",
                                      "dtype"]
    assert graph_table["caption"] == f"{len(gm.graph.nodes)} nodes"
    assert len(graph_table["rows"]) == len(gm.graph.nodes)
    rows = {r[1]: r for r in graph_table["rows"]}
    assert rows["softmax"][2] == "torch.softmax" and rows["softmax"][5] == "(4, 16)"
    assert rows["relu"][2] == "torch.relu"

    assert kernel_table["headers"] == ["kernel", "kind", "fused ops", "inputs", "outputs",
                                       "bytes moved"]
    assert [r[0] for r in kernel_table["rows"]] == [k.name for k in compiled.kernels]
    assert probe["details"] == len(compiled.kernels)  # one folded source per kernel

    for table in (graph_table, kernel_table):
        assert table["visible"]
        lefts = [b[0] for b in table["boxes"]]
        assert lefts == sorted(lefts) and len(set(lefts)) == len(lefts)  # side by side
        assert all(width > 10 and height > 5 for _, width, height in table["boxes"])
    if shutil.which("dot"):
        assert len(probe["svgs"]) == 1 and min(probe["svgs"][0]) > 50


def test_screenshot(page):
    tmp, path, _, _ = page
    shot = tmp / "page.png"
    proc = _chromium(f"--screenshot={shot}", path.as_uri(), tmp_path=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    keep = os.environ.get("FXLITE_KEEP_SCREENSHOT")
    if keep:  # to look at it: FXLITE_KEEP_SCREENSHOT=/tmp/page.png pytest tests/docs/test_browser.py
        shutil.copy(shot, keep)
