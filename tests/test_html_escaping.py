"""Hostile names cannot break the report page or the notebook views (issue 36 item 6).

A key named ``<!--<script>`` put the HTML parser of the report page in its escaped-script state: the JSON block
swallowed the app script and the tree and search never rendered. Every JSON ckptool puts inside a ``<script>``
goes through ``ckptool.model.notebook.script_json`` (``<``, ``>``, ``&``, U+2028, U+2029 as JSON escapes). Pages
built from hostile tensor names, dict keys and safetensors ``__metadata__`` values are parsed here as a browser
parses them (html5lib, the WHATWG algorithm): two script elements, the app script whole, the JSON block parsing
back to the names; and, where Debian's ``chromium`` is installed, the tree renders and the search finds the name.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

import ckptool
from ckptool.model.notebook import script_json

pytestmark = pytest.mark.torchfree  # the torch file's case imports torch itself

html5lib = pytest.importorskip("html5lib")

HOSTILE = ["<!--<script>", "</script>", "<script>", "a\u2028b\u2029c", "&amp;<b>", "]]>--><!--"]
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no headless chromium installed (apt install chromium)")
NS = "{http://www.w3.org/1999/xhtml}"


def _safetensors(path: Path, names: list[str], metadata: dict[str, str] | None = None) -> Path:
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    entries.update({n: {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i, n in enumerate(names)})
    raw = json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(len(names)))
    return path


def _tree_names(node: list[object]) -> list[str]:
    """Every label (and folded block name) of the page's compact tree ``[label, ..., children, folded]``."""
    out = [str(node[0])] + ([str(node[6])] if len(node) > 6 and node[6] else [])
    kids = node[5]
    if isinstance(kids, list):
        for k in kids:
            out += _tree_names(k)
    return out


def _scripts(html: str) -> list[tuple[dict[str, str], str]]:
    doc = html5lib.parse(html)  # the WHATWG parsing algorithm, as a browser runs it
    return [(dict(e.attrib), e.text or "") for e in doc.iter(f"{NS}script")]


def _check_page(html: str, names: list[str]) -> None:
    scripts = _scripts(html)
    assert len(scripts) == 2, [a for a, _ in scripts]
    (data_attrs, data_text), (app_attrs, app_text) = scripts
    assert data_attrs == {"type": "application/json", "id": "data"}
    assert app_attrs == {} and app_text.strip().startswith("(function () {") and app_text.rstrip().endswith("})();")
    data = json.loads(data_text)
    labels = _tree_names(data["tree"])
    for n in names:
        assert any(n in label for label in labels), (n, labels)
    for bad in ("<", ">", "&", "\u2028", "\u2029"):
        assert bad not in data_text


def test_script_json_escapes_what_ends_or_changes_a_script() -> None:
    value = {"k": HOSTILE, "<": "&"}
    text = script_json(value)
    assert json.loads(text) == value
    assert not set(text) & {"<", ">", "&", "\u2028", "\u2029"}
    assert "\\u003c!--\\u003cscript\\u003e" in text and "\\u2028" in text and "\\u0026" in text


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_tensor_names_leave_the_page_whole(tmp_path: Path, name: str) -> None:
    src = _safetensors(tmp_path / "m.safetensors", [f"enc.{name}.weight", "head.weight"])
    out = tmp_path / "r.html"
    ckptool.report(src, dst=out)
    _check_page(out.read_text(encoding="utf-8"), [name])


def test_hostile_metadata_values_leave_the_page_whole(tmp_path: Path) -> None:
    meta = {f"k{i}": v for i, v in enumerate(HOSTILE)} | {"<!--<script>": "</script>"}
    src = _safetensors(tmp_path / "m.safetensors", ["enc.weight", "head.weight"], meta)
    out = tmp_path / "r.html"
    ckptool.report(src, dst=out)
    _check_page(out.read_text(encoding="utf-8"), ["enc", "head"])


def test_comparison_page_with_hostile_names_stays_whole(tmp_path: Path) -> None:
    pytest.importorskip("numpy")  # report A B compares values
    a = _safetensors(tmp_path / "a.safetensors", ["enc.<!--<script>.w", "head.w"])
    b = _safetensors(tmp_path / "b.safetensors", ["enc.</script>.w", "head.w"])
    out = tmp_path / "cmp.html"
    ckptool.report(a, b, dst=out)
    _check_page(out.read_text(encoding="utf-8"), ["<!--<script>"])


def test_hostile_dict_keys_of_a_torch_file_leave_the_page_whole(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    sd = {f"layer.{n}.weight": torch.zeros(2) for n in HOSTILE}
    src = tmp_path / "m.pt"
    torch.save({"state_dict": sd, "notes": {n: n for n in HOSTILE}}, src)
    out = tmp_path / "r.html"
    ckptool.report(src, dst=out)
    _check_page(out.read_text(encoding="utf-8"), HOSTILE)


def test_notebook_views_escape_hostile_names(tmp_path: Path) -> None:
    src = _safetensors(tmp_path / "m.safetensors", [f"enc.{n}.w" for n in HOSTILE])
    html = ckptool.inspect(src)._repr_html_()
    doc = html5lib.parseFragment(html)
    assert not [e for e in doc.iter() if e.tag == f"{NS}script"]
    text = "".join(doc.itertext())
    for n in HOSTILE:
        assert n in text

@needs_browser
@pytest.mark.parametrize("name", ["<!--<script>", "</script>", "a\u2028b"])
def test_page_with_a_hostile_name_renders_and_searches_in_a_browser(tmp_path: Path, name: str) -> None:
    src = _safetensors(tmp_path / "m.safetensors", [f"{name}.weight", "head.weight"])
    out = tmp_path / "r.html"
    ckptool.report(src, dst=out)
    query = json.dumps(name[:4])  # a JSON string is a JavaScript string
    actions = ("<script>var s = document.getElementById('search'); s.value = " + query.replace("<", "\\u003c")
               + "; s.dispatchEvent(new Event('input'));</script>")
    driven = tmp_path / "driven.html"
    driven.write_text(out.read_text(encoding="utf-8").replace("</body>", actions + "</body>"), encoding="utf-8")
    assert BROWSER is not None
    r = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", driven.as_uri()],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and "<body" in r.stdout, r.stderr[-2000:]
    doc = html5lib.parse(r.stdout)
    nodes = [e for e in doc.iter(f"{NS}div") if "node" in (e.get("class") or "").split()]
    assert any(e.get("data-path") == "head" for e in nodes)  # the tree rendered
    matches = [e.get("data-path") for e in nodes if "match" in (e.get("class") or "").split()]
    assert name in matches  # and the search found the hostile name
    assert re.search(r'id="match-count"[^>]*>\d+ matching node', r.stdout)
