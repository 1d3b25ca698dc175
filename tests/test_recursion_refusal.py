"""Recursion is a refusal (issue 36 item 5): rules files, safetensors headers and index JSON nested beyond what a
parser can go, and an index whose ``weight_map`` names itself, give one ``Error:`` line and a bad-input exit status,
never an internal error (exit 3); any ``RecursionError`` reaching the CLI is bad input (exit 1).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptool.cli import cli
from ckptool.cli._errors import EXIT_BUG, EXIT_FAILURE, describe_error

pytestmark = pytest.mark.torchfree

DEEP = 100_000


def _run(*args: str | Path) -> tuple[int, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args])
    return res.exit_code, res.output


def _one_error(code: int, out: str, expected: int) -> None:
    assert code == expected and code != EXIT_BUG, out
    assert "Traceback" not in out and "internal error" not in out, out
    assert sum(ln.startswith("Error:") for ln in out.splitlines()) == 1, out


def _safetensors(path: Path, metadata_value: bytes) -> Path:
    hdr = json.dumps({"__metadata__": {"a": "NEST"}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    raw = hdr.encode().replace(b'"NEST"', metadata_value)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0\0\0\0")
    return path


@pytest.fixture
def small_checkpoint(tmp_path: Path) -> Path:
    return _safetensors(tmp_path / "ok.safetensors", b'"x"')


@pytest.mark.parametrize(("name", "text"), [
    ("deep.json", "[" * DEEP + "]" * DEEP),
    ("deep.toml", "rules = " + "[" * DEEP + "]" * DEEP),
    ("deep.yaml", "[" * DEEP + "]" * DEEP),
])
def test_a_deeply_nested_rules_file_is_refused(tmp_path: Path, small_checkpoint: Path, name: str, text: str) -> None:
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    rules = tmp_path / name
    rules.write_text(text, encoding="utf-8")
    code, out = _run("rename", small_checkpoint, "--rules", rules, "-o", tmp_path / "out.safetensors")
    _one_error(code, out, 2)  # a rules file that does not parse is a bad argument, as every other one
    assert "nested deeper than its parser can read" in out or "does not parse" in out, out


@pytest.mark.parametrize("depth", [500, 990, 5000])
@pytest.mark.parametrize("command", ["inspect", "diff", "convert", "report", "scan"])
def test_deeply_nested_safetensors_metadata_is_refused_or_read(tmp_path: Path, depth: int, command: str) -> None:
    path = _safetensors(tmp_path / "nested.safetensors", b'{"k":' * depth + b"1" + b"}" * depth)
    args = {"inspect": ["inspect", path], "diff": ["diff", path, path], "scan": ["scan", path],
            "convert": ["convert", path, "-o", tmp_path / "o.pt"],
            "report": ["report", path, "-o", tmp_path / "r.html"]}
    code, out = _run(*args[command])
    assert code != EXIT_BUG and "Traceback" not in out and "internal error" not in out, out
    if code != 0 and command != "scan":
        _one_error(code, out, EXIT_FAILURE)


def _index(folder: Path, weight_map: dict[str, str], extra: str = "") -> Path:
    folder.mkdir(exist_ok=True)
    p = folder / "model.safetensors.index.json"
    body = json.dumps({"metadata": {}, "weight_map": weight_map})
    p.write_text(body[:-1] + extra + "}" if extra else body, encoding="utf-8")
    return p


@pytest.mark.parametrize("command", ["inspect", "convert", "diff", "scan"])
def test_an_index_naming_itself_is_refused(tmp_path: Path, command: str) -> None:
    index = _index(tmp_path / "self", {"w": "model.safetensors.index.json"})
    args = {"inspect": ["inspect", index], "diff": ["diff", index, index], "scan": ["scan", index.parent],
            "convert": ["convert", index, "-o", tmp_path / "o.safetensors"]}
    code, out = _run(*args[command])
    if command == "scan":  # scan names what it found; the index itself is no shard it reads
        assert code != EXIT_BUG and "Traceback" not in out and "internal error" not in out, out
        return
    _one_error(code, out, EXIT_FAILURE)
    assert "the index itself" in out, out


def test_indexes_naming_each_other_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "pair"
    _index(folder, {"w": "b.index.json"})
    (folder / "b.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors.index.json"}}))
    code, out = _run("inspect", folder / "model.safetensors.index.json")
    _one_error(code, out, EXIT_FAILURE)
    assert "an index, not a checkpoint file" in out, out


def test_a_deeply_nested_index_is_refused(tmp_path: Path) -> None:
    index = _index(tmp_path / "deep", {"w": "a.safetensors"}, extra=', "x": ' + "[" * DEEP + "]" * DEEP)
    code, out = _run("inspect", index)
    _one_error(code, out, EXIT_FAILURE)


def test_any_recursion_error_is_bad_input_not_a_bug(tmp_path: Path, small_checkpoint: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    msg, code = describe_error(RecursionError("maximum recursion depth exceeded"))
    assert code == EXIT_FAILURE and "nested too deeply" in msg
    import ckptool.ops.inspect.entry as entry

    def deep(*_a: object, **_k: object) -> None:
        raise RecursionError("maximum recursion depth exceeded while walking")

    monkeypatch.setattr(entry, "_describe", deep)
    code, out = _run("inspect", small_checkpoint)
    _one_error(code, out, EXIT_FAILURE)
    assert "nested too deeply" in out, out
