"""The scan decides what a container is once (:class:`ckptool.scanning.layouts.Layout`) and follows its facts:
the format it reports, the note for a zip without pickles, the check of a safetensors header, the "not a pickle"
verdict for bytes that only begin like one."""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path

import pytest

from ckptool.formats import detect
from ckptool.scanning import layouts
from ckptool.scanning.entry import scan_file


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_layouts_report_the_detector_names() -> None:
    """Each layout reports the name format detection gives the same container (``zip`` and ``legacy-tar`` are the
    scan's own)."""
    assert (layouts.TORCH_ZIP.format, layouts.TORCHSCRIPT.format, layouts.EXPORT.format, layouts.LEGACY.format,
            layouts.SAFETENSORS.format, layouts.PICKLE.format) == (
        detect.TORCH_ZIP, detect.TORCHSCRIPT, detect.PT2, detect.TORCH_LEGACY, detect.SAFETENSORS, detect.PICKLE)
    assert layouts.TORCHSCRIPT.loaded_records == ("data.pkl", "constants.pkl")
    assert layouts.TORCH_ZIP.torch_records and not layouts.ZIP.torch_records and not layouts.EXPORT.torch_records


@pytest.mark.torchfree
def test_a_zip_without_pickles_is_noted(tmp_path: Path) -> None:
    res = scan_file(_zip(tmp_path / "plain.zip", {"readme.txt": b"hello"}))
    assert res.format == "zip" and "the zip holds no pickle" in res.notes and res.error is None


@pytest.mark.torchfree
def test_a_torch_zip_reads_its_data_pkl_as_loaded(tmp_path: Path) -> None:
    res = scan_file(_zip(tmp_path / "m.pt", {"archive/data.pkl": pickle.dumps({"a": 1}, protocol=2),
                                             "archive/data/0": b"\x00" * 8}))
    assert res.format == detect.TORCH_ZIP and [p.where for p in res.pickles] == ["archive/data.pkl"]
    assert not res.pickles[0].hidden and "the zip holds no pickle" not in res.notes


@pytest.mark.torchfree
def test_a_torchscript_zip_loads_constants_pkl_too(tmp_path: Path) -> None:
    data = pickle.dumps({"a": 1}, protocol=2)
    res = scan_file(_zip(tmp_path / "s.pt", {"archive/data.pkl": data, "archive/constants.pkl": data,
                                             "archive/code/__torch__.py": b"x = 1\n"}))
    assert res.format == detect.TORCHSCRIPT
    assert {p.where: p.hidden for p in res.pickles} == {"archive/data.pkl": False, "archive/constants.pkl": False}


@pytest.mark.torchfree
def test_a_safetensors_header_is_checked(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()  # 8 of 16 bytes
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 16)
    res = scan_file(path)
    assert res.format == detect.SAFETENSORS and res.error is not None


@pytest.mark.torchfree
def test_bytes_that_only_begin_like_a_pickle_are_not_one(tmp_path: Path) -> None:
    path = tmp_path / "image.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    res = scan_file(path)
    assert res.format == detect.PICKLE and res.error is not None
    assert "is a PNG image, not a PyTorch checkpoint" in res.error
