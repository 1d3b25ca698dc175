"""Folders whose loader reads files outside them (``fuzz/adversarial_folders.py``): ``scan`` follows what the
loaders follow (DeepSpeed's ``latest`` and symlinked tag folders, the shards a ``*.index.json`` names), scans those
files and says they are outside; the commands that read the folder as a checkpoint refuse them; a folder with no
checkpoint is an error, not a pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptool._source import leaves_folder
from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats.deepspeed import find_deepspeed
from ckptool.formats.sharded import read_index
from ckptool.scanning.entry import iter_paths, scan

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
import adversarial
import adversarial_folders as af

pytestmark = [pytest.mark.torchfree, pytest.mark.skipif(sys.platform == "win32", reason="symbolic links")]

OUTSIDE = [c for c in af.CASES if c.verdict == "dangerous"]


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "MARKER"
    monkeypatch.setenv(adversarial.MARKER_ENV, str(path))
    return path


@pytest.mark.parametrize("case", OUTSIDE, ids=lambda c: c.name)
def test_scan_follows_the_loader_out_of_the_folder(case: adversarial.Case, tmp_path: Path, run_cli, marker) -> None:
    ckpt = case.make(tmp_path)
    r = run_cli("scan", ckpt)
    assert r.exit_code == 1, r.output  # dangerous, not "safe" / "no checkpoint files found"
    assert "DANGEROUS" in r.output and "os.system" in r.output
    assert "note: outside the scanned folder:" in r.output
    assert not marker.exists()
    res = scan([ckpt])
    # an index whose shard leaves the folder is also refused as the readers refuse it (issue 46): an error row
    refused = [x for x in res if x.path.endswith(".index.json")]
    assert all(x.verdict == "error" and "outside" in (x.error or "") for x in refused)
    if "sharded" in case.name:
        assert len(refused) == 1
    res = [x for x in res if x not in refused]
    assert res and all(x.verdict == "dangerous" for x in res)
    assert all(any(n.startswith("outside the scanned folder") for n in x.notes) for x in res)


@pytest.mark.parametrize("case", OUTSIDE, ids=lambda c: c.name)
@pytest.mark.parametrize("command", [["convert", "-o", "{out}/x.safetensors"], ["inspect"]])
def test_commands_refuse_what_leaves_the_folder(case: adversarial.Case, command: list[str], tmp_path: Path,
                                                run_cli, marker) -> None:
    ckpt = case.make(tmp_path / "in")
    (tmp_path / "o").mkdir()
    args = [a.format(out=tmp_path / "o") for a in command]
    r = run_cli(args[0], ckpt, *args[1:])
    assert r.exit_code != 0, r.output
    assert r.output.startswith("Error:") and "outside" in r.output, r.output
    assert os.listdir(tmp_path / "o") == []
    assert not marker.exists()


@pytest.mark.parametrize("case", OUTSIDE, ids=lambda c: c.name)
def test_the_fixture_is_live(case: adversarial.Case, tmp_path: Path, marker) -> None:
    """The modelled loader runs the payload: the files outside are what it reads."""
    pytest.importorskip("torch")
    ckpt = case.make(tmp_path)
    assert case.loader is not None
    subprocess.run([sys.executable, "-c", f"PATH = {str(ckpt)!r}\n" + case.loader], capture_output=True,
                   env={**os.environ}, timeout=120, check=False)
    assert marker.exists()


def test_reader_refusals_name_the_way_out(tmp_path: Path) -> None:
    ckpt = af.make_tag_symlink(tmp_path / "a")
    with pytest.raises(UnsupportedError, match="symbolic link"):
        find_deepspeed(ckpt)
    ckpt = af.make_shard_symlinked_subfolder(tmp_path / "b")
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        read_index(str(ckpt / af.INDEX))
    ckpt = af.make_shard_absolute(tmp_path / "c")
    with pytest.raises(CorruptCheckpointError, match="outside"):
        read_index(str(ckpt / af.INDEX))


def test_symlinked_files_of_a_hub_cache_stay_readable(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot links each file to its blob outside the snapshot folder: that is the folder's
    content (a walk reads it too), not a way out."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "abc").write_bytes(b"x")
    snap = tmp_path / "snapshots" / "rev"
    snap.mkdir(parents=True)
    os.symlink(os.path.relpath(blobs / "abc", snap), snap / af.SHARD)
    (snap / af.INDEX).write_text(json.dumps({"weight_map": {"w": af.SHARD}}))
    assert read_index(str(snap / af.INDEX)).shards == [af.SHARD]
    assert leaves_folder(str(snap), af.SHARD) is None
    # a symlinked subfolder that stays inside the folder is inside
    (snap / "real").mkdir()
    os.symlink("real", snap / "alias")
    assert leaves_folder(str(snap), "alias/x.bin") is None
    assert leaves_folder(str(snap), "../x.bin") is not None


def test_scan_of_an_index_file_scans_its_shards(tmp_path: Path, run_cli, marker) -> None:
    ckpt = af.make_shard_dotdot(tmp_path)
    # the index itself first: the readers refuse it (a shard outside its folder), so scan reports it as an error
    assert list(iter_paths([ckpt / af.INDEX])) == [str(ckpt / af.INDEX), str(ckpt / ".." / "outside" / af.SHARD)]
    r = run_cli("scan", ckpt / af.INDEX)
    assert r.exit_code == 1 and "outside the scanned folder" in r.output
    assert not marker.exists()


def test_shards_inside_are_scanned_once(tmp_path: Path) -> None:
    """An index naming shards inside the folder adds nothing to the walk (no duplicate, no note)."""
    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / af.SHARD).write_bytes(adversarial.marker_pickle())
    (ckpt / af.INDEX).write_text(json.dumps({"weight_map": {"w": af.SHARD}}))
    res = scan([ckpt])
    assert [r.path for r in res] == [str(ckpt / af.SHARD)] and res[0].notes == []


@pytest.mark.parametrize("make", [lambda p: p, af.make_empty_folder], ids=["empty", "no-checkpoint"])
def test_scan_of_a_folder_without_checkpoints_is_an_error(make, tmp_path: Path, run_cli) -> None:
    folder = make(tmp_path / "d") if make is af.make_empty_folder else tmp_path
    r = run_cli("scan", folder)
    assert r.exit_code == 2, r.output
    lines = r.output.splitlines()
    # one Error line, and the usage-error pointer every exit-2 error carries
    assert lines[0].startswith("Error:") and "holds no checkpoint file" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("Try '") and lines[1].endswith(" scan --help' for help.")
    for extra in (["--json"], ["--format", "sarif"], ["--strict"]):
        assert run_cli("scan", folder, *extra).exit_code == 2
    with pytest.raises(UsageError, match="holds no checkpoint file"):
        scan([folder])
