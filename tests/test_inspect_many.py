"""``ckptool inspect --json`` / ``--jsonl`` of many checkpoints in one run (issue 38): several paths, folders walked
as ``scan`` walks them, URL prefixes, ``--jobs``; each row is what ``inspect --json`` of that one checkpoint prints,
a checkpoint that cannot be read is a row with its error, and one path prints what it printed.

The checkpoints are written here byte by byte (plain pickles, a safetensors file, a sharded safetensors set: no
torch); the servers are the fixtures of ``remote_servers.py``.
"""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.torchfree


def _safetensors(names: list[str]) -> bytes:
    """A safetensors file of one float32 [2] tensor per name."""
    header = {n: {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]} for i, n in enumerate(names)}
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + bytes(8 * len(names))


def _tree(folder: Path) -> dict[str, str]:
    """A folder of checkpoints with a damaged one among them, a README, and a sharded set in a subfolder; the
    format each checkpoint file has (relative path -> format)."""
    (folder / "runs" / "a").mkdir(parents=True)
    (folder / "runs" / "a" / "last.pt").write_bytes(pickle.dumps({"step": 3, "lr": 0.1}, protocol=2))
    (folder / "model.safetensors").write_bytes(_safetensors(["w", "b"]))
    (folder / "broken.pt").write_bytes(b"\x80\x02}q\x00(X\x01\x00\x00")  # cut short
    (folder / "README.md").write_text("# not a checkpoint\n")
    s = folder / "set"
    s.mkdir()
    (s / "model-00001-of-00002.safetensors").write_bytes(_safetensors(["a"]))
    (s / "model-00002-of-00002.safetensors").write_bytes(_safetensors(["b"]))
    (s / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 16}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                       "b": "model-00002-of-00002.safetensors"}}))
    return {"runs/a/last.pt": "pickle", "model.safetensors": "safetensors",
            "set/model-00001-of-00002.safetensors": "safetensors",
            "set/model-00002-of-00002.safetensors": "safetensors"}


def _rows(output: str) -> dict[str, dict[str, Any]]:
    return {row["path"]: row for row in map(json.loads, output.splitlines())}


def test_folder_with_a_bad_file_jsonl_rows_are_the_single_json(tmp_path: Path, run_cli: Any) -> None:
    """Each good row is exactly what `inspect --json` of that path prints; the damaged file is a row with its
    error (the same words as its single-path Error: line); the run goes on; exit 1."""
    formats = _tree(tmp_path)
    r = run_cli("inspect", tmp_path, "--jsonl")
    assert r.exit_code == 1, r.output
    rows = _rows(r.output)
    assert sorted(rows) == sorted([str(tmp_path / "broken.pt"), *(str(tmp_path / p) for p in formats)])
    bad = rows.pop(str(tmp_path / "broken.pt"))
    assert set(bad) == {"schema", "path", "error"} and bad["schema"] == "ckptool.inspect/3"
    single_bad = run_cli("inspect", tmp_path / "broken.pt", "--json")
    assert single_bad.exit_code == 1 and bad["error"] in single_bad.output
    for rel, fmt in formats.items():
        path = str(tmp_path / rel)
        one = run_cli("inspect", path, "--json")
        assert one.exit_code == 0, one.output
        assert rows[path] == json.loads(one.output) and rows[path]["format"] == fmt


def test_json_is_one_array_of_the_rows(tmp_path: Path, run_cli: Any) -> None:
    _tree(tmp_path)
    lines = run_cli("inspect", tmp_path, "--jsonl")
    array = run_cli("inspect", tmp_path, "--json", "--jobs", "2")  # local files: processes
    assert array.exit_code == 1, array.output
    got = json.loads(array.output)
    assert isinstance(got, list)
    assert sorted(got, key=lambda r: r["path"]) == sorted(_rows(lines.output).values(), key=lambda r: r["path"])


def test_a_folder_that_is_one_checkpoint_is_one_row(tmp_path: Path, run_cli: Any) -> None:
    """Among several paths, a sharded set's folder is read as `inspect FOLDER` reads it: one checkpoint."""
    _tree(tmp_path)
    r = run_cli("inspect", tmp_path / "set", tmp_path / "model.safetensors", "--jsonl")
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines()]
    assert [row["format"] for row in rows] == ["sharded-safetensors", "safetensors"]
    assert rows[0] == json.loads(run_cli("inspect", tmp_path / "set", "--json").output)


def test_one_path_prints_what_it_printed(tmp_path: Path, run_cli: Any) -> None:
    """One path without --jsonl / --jobs: the one JSON object, and the tables, as before."""
    _tree(tmp_path)
    r = run_cli("inspect", tmp_path / "model.safetensors", "--json")
    assert r.exit_code == 0 and isinstance(json.loads(r.output), dict) and r.output.startswith("{\n")
    assert run_cli("inspect", tmp_path / "model.safetensors").output.startswith("File:")


@pytest.mark.parametrize(("args", "words"), [([], "the tables show one checkpoint"),
                                             (["--tree", "--json"], "--tree show"),
                                             (["--json", "--jsonl"], "two outputs")])
def test_several_paths_need_one_json_output(tmp_path: Path, run_cli: Any, args: list[str], words: str) -> None:
    _tree(tmp_path)
    r = run_cli("inspect", tmp_path / "model.safetensors", tmp_path / "runs", *args)
    assert r.exit_code == 2 and r.output.startswith("Error:") and words in r.output, r.output


def test_missing_path_and_empty_folder_are_rows(tmp_path: Path, run_cli: Any) -> None:
    """As in scan's many-checkpoint mode: a path that cannot be walked is a row with its error; exit 1."""
    _tree(tmp_path)
    r = run_cli("inspect", tmp_path / "model.safetensors", tmp_path / "gone.pt", "--jsonl")
    rows = _rows(r.output)
    assert r.exit_code == 1 and rows[str(tmp_path / "model.safetensors")]["format"] == "safetensors"
    assert "no such file" in rows[str(tmp_path / "gone.pt")]["error"]
    (tmp_path / "empty").mkdir()
    r = run_cli("inspect", tmp_path / "empty", "--jsonl")
    assert r.exit_code == 1 and "holds no checkpoint file" in _rows(r.output)[str(tmp_path / "empty")]["error"]


def test_s3_prefix_with_threads(request: pytest.FixtureRequest, run_cli: Any, tmp_path: Path) -> None:
    """A URL prefix: its objects that are checkpoints by content, in threads; each row's bytes_read its own."""
    for name in ("fsspec", "s3fs", "moto.server", "aiohttp"):
        pytest.importorskip(name)
    s3 = request.getfixturevalue("s3")
    _tree(tmp_path)
    files = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    s3.pipe({f"ckpt/inspect38/{name}": data for name, data in files.items()})
    r = run_cli("inspect", "s3://ckpt/inspect38/", "--jobs", "4", "--jsonl")
    assert r.exit_code == 1, r.output
    rows = _rows(r.output)
    # the README is skipped, the index is no checkpoint by its content (its shards are rows of their own)
    assert sorted(p.removeprefix("s3://ckpt/inspect38/") for p in rows) == sorted(
        ["broken.pt", "model.safetensors", "runs/a/last.pt", "set/model-00001-of-00002.safetensors",
         "set/model-00002-of-00002.safetensors"])
    good = [row for row in rows.values() if "error" not in row]
    assert len(good) == 4 and all(0 < row["bytes_read"] < 4096 for row in good)


def test_cycle_collector_runs_between_checkpoints(tmp_path: Path, run_cli: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The command pauses the cycle collector for one checkpoint's graph; a run over many keeps it on between
    checkpoints (each inspect pauses it again while it reads), so a long run does not pile up cyclic garbage."""
    import gc

    from ckptool.ops.inspect import many

    _tree(tmp_path)
    seen: list[bool] = []
    real = many.not_a_checkpoint
    monkeypatch.setattr(many, "not_a_checkpoint", lambda t: seen.append(gc.isenabled()) or real(t))
    assert run_cli("inspect", tmp_path, "--jsonl").exit_code == 1
    assert len(seen) == 5 and all(seen)
