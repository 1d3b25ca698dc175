"""Write side (issue "No code from a checkpoint runs in any command", item 6): an output never follows a dangling
symbolic link out of its folder, and a run never deletes what it did not create: a folder, link or shared file
planted under a stale-temporary name, or another shard set's files in the folder of a set it replaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptool._fileio import _HOST, TMP_SUFFIX, atomic_output, remove_stale_temps, temp_prefix
from ckptool.errors import UsageError
from ckptool.ops.convert import convert

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
from regressions import safetensors_bytes

pytestmark = [pytest.mark.torchfree, pytest.mark.skipif(sys.platform == "win32", reason="symbolic links")]


def _dead_pid() -> int:
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                         check=True)
    return int(out.stdout)


def _stale_name(dst: Path, pid: int) -> str:
    return temp_prefix(str(dst)).replace(f"-{os.getpid()}-", f"-{pid}-") + "abcd1234" + TMP_SUFFIX


# ------------------------------------------------------------------------------------------------ dangling links
def test_dangling_output_link_is_refused(tmp_path: Path) -> None:
    out, away = tmp_path / "out", tmp_path / "away"
    out.mkdir()
    away.mkdir()
    os.symlink(away / "planted.pt", out / "x.pt")
    with pytest.raises(UsageError, match=r"symbolic link .* does not exist"), atomic_output(str(out / "x.pt")) as f:
        f.write(b"data")
    assert os.listdir(away) == [] and os.listdir(out) == ["x.pt"]
    # a link to an existing file is written through, as before
    (away / "real.pt").write_bytes(b"old")
    os.symlink(away / "real.pt", out / "y.pt")
    with atomic_output(str(out / "y.pt")) as f:
        f.write(b"new")
    assert (away / "real.pt").read_bytes() == b"new" and os.path.islink(out / "y.pt")


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_convert_refuses_a_dangling_output_link(tmp_path: Path, run_cli, force: list[str]) -> None:
    src = tmp_path / "m.safetensors"
    src.write_bytes(safetensors_bytes({"w": 4}))
    os.symlink(tmp_path / "elsewhere.safetensors", tmp_path / "o.safetensors")
    r = run_cli("convert", src, "-o", tmp_path / "o.safetensors", *force)
    assert r.exit_code == 2 and r.output.startswith("Error:") and "does not exist" in r.output, r.output
    assert not (tmp_path / "elsewhere.safetensors").exists()


# ------------------------------------------------------------------------------------------------ stale temps
def test_stale_temp_names_delete_only_plain_files_of_ours(tmp_path: Path) -> None:
    dst = tmp_path / "m.pt"
    dead = _dead_pid()
    planted = tmp_path / _stale_name(dst, dead)
    planted.mkdir()
    (planted / "precious.txt").write_text("keep me")
    link_target = tmp_path / "target.bin"
    link_target.write_bytes(b"keep")
    link = tmp_path / _stale_name(dst, dead).replace("abcd1234", "link1234")
    os.symlink(link_target, link)
    shared = tmp_path / _stale_name(dst, dead).replace("abcd1234", "hard1234")
    shared.write_bytes(b"shared")
    os.link(shared, tmp_path / "other-name.bin")
    odd = tmp_path / _stale_name(dst, dead).replace("abcd1234", "x")  # not tempfile's 8-character random part
    odd.write_bytes(b"not ours")
    ours = tmp_path / _stale_name(dst, dead).replace("abcd1234", "ours5678")
    ours.write_bytes(b"left by a killed run")
    with atomic_output(str(dst)) as f:
        f.write(b"out")
    assert (planted / "precious.txt").read_text() == "keep me"
    assert os.path.islink(link) and link_target.read_bytes() == b"keep"
    assert shared.exists() and odd.exists()
    assert not ours.exists()  # the one file that has every mark of a killed run's temporary file
    assert remove_stale_temps(str(dst)) == []


def test_live_host_name_with_dashes_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool._fileio as fio

    monkeypatch.setattr(fio, "_HOST", "my-host")
    dst = tmp_path / "m.pt"
    mine = tmp_path / f".m.pt.ckptool-my-host-{os.getpid()}-abcd1234{TMP_SUFFIX}"
    mine.write_bytes(b"x")
    dead = tmp_path / f".m.pt.ckptool-my-host-{_dead_pid()}-abcd1234{TMP_SUFFIX}"
    dead.write_bytes(b"x")
    assert remove_stale_temps(str(dst)) == [str(dead)] and mine.exists()
    assert _HOST  # the real host name is not touched by the test


# ------------------------------------------------------------------------------------------------ shard sets
def _src(tmp_path: Path) -> Path:
    src = tmp_path / "m.safetensors"
    src.write_bytes(safetensors_bytes({f"w{i}": 1024 for i in range(6)}))
    return src


def test_force_into_a_shard_folder_keeps_another_sets_files(tmp_path: Path, run_cli) -> None:
    src, out = _src(tmp_path), tmp_path / "out"
    out.mkdir()
    # another set in the folder whose shards happen to be named like ours, and a stray file named like ours
    theirs = [f"model-{i:05d}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    for n in theirs:
        (out / n).write_bytes(b"theirs")
    (out / "adapter.index.json").write_text(json.dumps({"weight_map": {f"a{i}": n for i, n in enumerate(theirs)}}))
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stray")
    # the earlier set of ours: its index names its shards
    (out / "model-00001-of-00005.safetensors").write_bytes(b"ours")
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w0": "model-00001-of-00005.safetensors"}}))
    r = run_cli("convert", src, "-o", out, "--max-shard-size", "10KB", "--force")
    assert r.exit_code == 0, r.output
    assert all((out / n).read_bytes() == b"theirs" for n in theirs)
    assert (out / "model-00001-of-00009.safetensors").read_bytes() == b"stray"
    assert not (out / "model-00001-of-00005.safetensors").exists()  # the earlier set of ours is replaced
    assert "left 5 file(s) named like this set's" in r.output, r.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert all((out / n).exists() for n in index["weight_map"].values())


def test_a_set_of_one_replaces_the_earlier_sets_index_and_shards(tmp_path: Path) -> None:
    src, out = _src(tmp_path), tmp_path / "out"
    first = convert(src, out, max_shard_size="10KB")
    assert first.shards > 1
    convert(src, out, max_shard_size="1GB")
    assert sorted(os.listdir(out)) == ["model.safetensors"]
