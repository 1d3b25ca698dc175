"""ckptool.formats.zipdir: the central directory reader, checked against Python's zipfile and TorchZipWriter,
with ZIP64 records, damaged directories, zip bombs and refused members."""

from __future__ import annotations

import io
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pytest

from ckptool.errors import CorruptCheckpointError
from ckptool.formats import zipdir
from ckptool.formats.torchfile import read_checkpoint
from ckptool.formats.torchzip import ALIGNMENT, TorchZipWriter
from ckptool.formats.zipdir import ZipEntry, data_offset, read_directory, read_member, read_member_head

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed

MEMBERS = {
    "archive/data.pkl": b"\x80\x02}q\x00.",
    "archive/data/0": bytes(range(256)) * 40,
    "archive/notes.txt": b"hello " * 500,
    "archive/\u00e9t\u00e9.bin": b"utf-8 name",
    "archive/empty": b"",
}


def _python_zip(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", compression=compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return b.getvalue()


@contextmanager
def _opened(data: bytes, how: str, tmp_path: Path) -> Iterator[BinaryIO]:
    """``data`` as a BytesIO or as a real file on disk."""
    if how == "bytesio":
        yield io.BytesIO(data)
        return
    p = tmp_path / "z.zip"
    p.write_bytes(data)
    with open(p, "rb") as f:
        yield f


def _directory(data: bytes) -> list[ZipEntry]:
    return read_directory(io.BytesIO(data), len(data), "z.zip")


def _eocd(data: bytes) -> int:
    return data.rfind(b"PK\x05\x06")


def _patch(data: bytes, at: int, fmt: str, *values: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, *values)
    return bytes(b)


# ------------------------------------------------------------------------------------------------ normal zips
@pytest.mark.parametrize("how", ["bytesio", "file"])
@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_python_zipfile_directory_and_members(tmp_path: Path, how: str, compression: int) -> None:
    data = _python_zip(MEMBERS, compression)
    infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    with _opened(data, how, tmp_path) as f:
        entries = read_directory(f, len(data), "z.zip")
        assert [e.name for e in entries] == list(MEMBERS)
        for e, zi in zip(entries, infos):
            assert (e.header_offset, e.compress_size, e.file_size, e.crc, e.method, e.flags) == (
                zi.header_offset, zi.compress_size, zi.file_size, zi.CRC, zi.compress_type, zi.flag_bits)
            assert read_member(f, e, "z.zip") == MEMBERS[e.name]
            assert read_member_head(f, e, "z.zip") == MEMBERS[e.name][:8]
            assert read_member_head(f, e, "z.zip", n=3000) == MEMBERS[e.name][:3000]
            start = data_offset(f, e, "z.zip")
            assert data[start:start + e.compress_size] == (
                MEMBERS[e.name] if compression == zipfile.ZIP_STORED else data[start:start + e.compress_size])
    if compression == zipfile.ZIP_DEFLATED:
        assert any(e.method == 8 and e.compress_size < e.file_size for e in entries)


def test_utf8_and_cp437_names() -> None:
    data = _python_zip({"\u00e9.pkl": b"x", "plain.pkl": b"y"})
    e_utf8, e_plain = _directory(data)
    assert e_utf8.name == "\u00e9.pkl" and e_utf8.flags & 0x800
    assert e_plain.name == "plain.pkl" and not e_plain.flags & 0x800
    # the same bytes without the UTF-8 flag are read as cp437, as zipfile does
    cd = data.index(b"PK\x01\x02")
    cp437 = _patch(data, cd + 8, "<H", e_utf8.flags & ~0x800)
    assert _directory(cp437)[0].name == "\u00e9.pkl".encode().decode("cp437")


def test_torch_zip_writer_output(tmp_path: Path) -> None:
    f = io.BytesIO()
    w = TorchZipWriter(f, "arch")
    w.begin_torch_save(b"\x80\x02}q\x00.")
    w.write_bytes("data/0", b"\x01" * 1000)
    w.write_bytes("data/1", b"")
    w.end_torch_save()
    data = f.getvalue()
    entries = _directory(data)
    names = [e.name for e in entries]
    assert names == ["arch/data.pkl", "arch/.format_version", "arch/.storage_alignment", "arch/byteorder",
                     "arch/data/0", "arch/data/1", "arch/version", "arch/.data/serialization_id"]
    assert names == zipfile.ZipFile(io.BytesIO(data)).namelist()
    for e in entries:
        assert e.method == 0 and e.compress_size == e.file_size
        assert data_offset(f, e, "z") % ALIGNMENT == 0  # torch.load(mmap=True) maps records in place
    by_name = {e.name: e for e in entries}
    assert read_member(f, by_name["arch/data/0"], "z") == b"\x01" * 1000
    assert read_member(f, by_name["arch/byteorder"], "z") == b"little"
    assert read_member_head(f, by_name["arch/data.pkl"], "z", n=2) == b"\x80\x02"


# ------------------------------------------------------------------------------------------------ ZIP64
def test_force_zip64_local_header_is_skipped() -> None:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w") as z:
        z.writestr("a.pkl", b"before")
        with z.open("b.pkl", "w", force_zip64=True) as m:
            m.write(b"zip64 member")
        z.writestr("c.pkl", b"after")
    data = b.getvalue()
    entries = _directory(data)
    assert [e.name for e in entries] == ["a.pkl", "b.pkl", "c.pkl"]
    f = io.BytesIO(data)
    e = entries[1]
    # the local header carries a 20-byte ZIP64 extra field that data_offset must step over
    n, m = struct.unpack_from("<HH", data, e.header_offset + 26)
    assert m == 20 and data_offset(f, e, "z") == e.header_offset + 30 + n + 20
    assert [read_member(f, x, "z") for x in entries] == [b"before", b"zip64 member", b"after"]


def test_more_than_65535_entries_use_the_zip64_end_record() -> None:
    n = 65536 + 3
    data = _python_zip({f"a/{i}": str(i).encode() for i in range(n)})
    eocd = _eocd(data)
    assert struct.unpack_from("<H", data, eocd + 10)[0] == 0xFFFF  # the 16-bit count is saturated
    assert data[eocd - 20:eocd - 16] == b"PK\x06\x07"  # ZIP64 end locator
    entries = _directory(data)
    assert len(entries) == n and entries[-1].name == f"a/{n - 1}"
    assert read_member(io.BytesIO(data), entries[65537], "z") == b"65537"


def test_torch_zip_writer_with_more_than_65535_records() -> None:
    f = io.BytesIO()
    w = TorchZipWriter(f, "arch")
    for i in range(65540):
        w.write_bytes(f"data/{i}", i.to_bytes(4, "little"))
    w.close()
    data = f.getvalue()
    entries = _directory(data)
    assert len(entries) == 65540 == len(zipfile.ZipFile(io.BytesIO(data)).namelist())
    assert read_member(f, entries[65539], "z") == (65539).to_bytes(4, "little")


def _handmade_zip(name: bytes, content: bytes, *, zip64_fields: tuple[str, ...] = ("usize", "csize", "off"),
                  cd_extra: bytes | None = None) -> bytes:
    """One stored member whose central directory entry puts the fields named in ``zip64_fields`` in a ZIP64 extra
    field (the 32-bit field holding 0xFFFFFFFF), as writers do past 4 GiB; ``cd_extra`` replaces that field."""
    size, crc = len(content), zlib.crc32(content)
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, 0, crc, size, size, len(name), 0) + name
    values = {"usize": size, "csize": size, "off": 0}
    order = [k for k in ("usize", "csize", "off") if k in zip64_fields]
    extra = struct.pack("<HH", 1, 8 * len(order)) + struct.pack(f"<{len(order)}Q", *(values[k] for k in order))
    extra = extra if cd_extra is None else cd_extra
    u32 = 0xFFFFFFFF
    cd = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, 0, crc,
                     u32 if "csize" in zip64_fields else size, u32 if "usize" in zip64_fields else size,
                     len(name), len(extra), 0, 0, 0, 0, u32 if "off" in zip64_fields else 0) + name + extra
    body = local + content
    return body + cd + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(cd), len(body), 0)


@pytest.mark.parametrize("fields", [("usize", "csize", "off"), ("usize",), ("off",), ("csize", "off")])
def test_zip64_extra_field_in_the_central_directory(fields: tuple[str, ...]) -> None:
    data = _handmade_zip(b"x/data.pkl", b"payload", zip64_fields=fields)
    (e,) = _directory(data)
    assert (e.name, e.header_offset, e.compress_size, e.file_size) == ("x/data.pkl", 0, 7, 7)
    assert read_member(io.BytesIO(data), e, "z") == b"payload"
    assert zipfile.ZipFile(io.BytesIO(data)).read("x/data.pkl") == b"payload"  # a valid zip, as zipfile sees it


def test_zip64_extra_field_missing_is_refused() -> None:
    data = _handmade_zip(b"x/data.pkl", b"payload", cd_extra=struct.pack("<HH", 0x4246, 0))
    with pytest.raises(CorruptCheckpointError, match="ZIP64 sizes missing"):
        _directory(data)


# ------------------------------------------------------------------------------------------------ damaged directories
def test_no_end_record() -> None:
    for data in (b"", b"garbage" * 100, _python_zip(MEMBERS)[:-22]):
        with pytest.raises(CorruptCheckpointError, match="no end of central directory"):
            _directory(data)


def test_directory_out_of_bounds() -> None:
    data = _python_zip(MEMBERS)
    eocd = _eocd(data)
    cd_size, cd_offset = struct.unpack_from("<II", data, eocd + 12)
    with pytest.raises(CorruptCheckpointError, match="out of bounds"):
        _directory(_patch(data, eocd + 16, "<I", cd_offset + 1000))
    with pytest.raises(CorruptCheckpointError, match="out of bounds"):
        _directory(_patch(data, eocd + 12, "<I", cd_size + 1000))
    # a file cut inside its central directory: the end record now points past what is there
    cut = data[:cd_offset + cd_size // 2] + data[eocd:]
    with pytest.raises(CorruptCheckpointError, match="out of bounds"):
        _directory(cut)


def test_directory_cut_short_or_garbled() -> None:
    data = _python_zip(MEMBERS)
    eocd = _eocd(data)
    count, _cd_size, cd_offset = struct.unpack_from("<HII", data, eocd + 10)
    with pytest.raises(CorruptCheckpointError, match="entry counts or disk numbers disagree"):
        _directory(_patch(data, eocd + 10, "<H", count + 5))  # the two counts of the end record disagree
    with pytest.raises(CorruptCheckpointError, match=r"cut short|out of bounds"):  # more entries than it holds
        _directory(_patch(_patch(data, eocd + 10, "<H", count + 1), eocd + 8, "<H", count + 1))
    with pytest.raises(CorruptCheckpointError, match="bad central directory entry"):
        _directory(_patch(data, cd_offset, "<I", 0x12345678))
    second = data.index(b"PK\x01\x02", cd_offset + 4)
    with pytest.raises(CorruptCheckpointError, match="bad central directory entry"):
        _directory(data[:second] + b"\x00" * 46 + data[second + 46:])
    # a name length running past the directory
    with pytest.raises(CorruptCheckpointError, match=r"cut short|bad central directory entry"):
        _directory(_patch(data, cd_offset + 28, "<H", 60000))


def test_bad_zip64_end_record_and_directory_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _python_zip({f"a/{i}": b"" for i in range(3)})
    eocd = _eocd(data)
    # a saturated count with a ZIP64 locator pointing at garbage
    locator = struct.pack("<IIQI", 0x07064B50, 0, 0, 1)
    forged = _patch(data[:eocd] + locator + data[eocd:], eocd + 20 + 10, "<H", 0xFFFF)
    with pytest.raises(CorruptCheckpointError, match="bad ZIP64 end record"):
        _directory(forged)
    monkeypatch.setattr(zipdir, "MAX_DIRECTORY", 16)
    with pytest.raises(CorruptCheckpointError, match="over ckptool's limit"):
        _directory(data)


def test_invalid_utf8_name_is_refused() -> None:
    data = _python_zip({"\u00e9.pkl": b"x"})
    cd = data.index(b"PK\x01\x02")
    name_at = cd + 46
    with pytest.raises(CorruptCheckpointError, match="not valid UTF-8"):
        _directory(data[:name_at] + b"\xff" + data[name_at + 1:])


def test_bad_local_header() -> None:
    data = _python_zip(MEMBERS)
    (e, *_rest) = _directory(data)
    broken = _patch(data, e.header_offset, "<I", 0)
    with pytest.raises(CorruptCheckpointError, match="bad local header"):
        data_offset(io.BytesIO(broken), e, "z")
    with pytest.raises(CorruptCheckpointError, match="bad local header"):
        read_member(io.BytesIO(broken), e, "z")


# ------------------------------------------------------------------------------------------------ members
def test_deflated_member_inflating_past_its_declared_size_is_refused() -> None:
    bomb = b"\x00" * (1 << 20)
    data = _python_zip({"bomb.pkl": bomb}, zipfile.ZIP_DEFLATED)
    (e,) = _directory(data)
    f = io.BytesIO(data)
    assert e.compress_size < 2000 and read_member(f, e, "z") == bomb
    with pytest.raises(CorruptCheckpointError, match="inflates past its declared size"):
        read_member(f, e._replace(file_size=100), "z")
    with pytest.raises(CorruptCheckpointError, match="over ckptool's limit"):  # refused before inflating
        read_member(f, e, "z", limit=1000)
    with pytest.raises(CorruptCheckpointError, match=r"inflates to 1048576 bytes, not its declared 2000000"):
        read_member(f, e._replace(file_size=2_000_000), "z")
    with pytest.raises(CorruptCheckpointError, match=r"inflates to \d+ bytes before its data ends"):
        read_member(f, e._replace(compress_size=e.compress_size // 2), "z")  # a deflate stream cut short
    assert read_member_head(f, e._replace(file_size=100), "z", n=16) == bomb[:16]  # head reads at most n bytes


def test_member_data_problems() -> None:
    data = _python_zip({"a.pkl": b"abcdef" * 100}, zipfile.ZIP_DEFLATED)
    (e,) = _directory(data)
    f = io.BytesIO(data)
    with pytest.raises(CorruptCheckpointError, match="fails its CRC-32 check"):
        read_member(f, e._replace(crc=e.crc ^ 1), "z")
    assert read_member(f, e._replace(crc=e.crc ^ 1), "z", check_crc=False) == b"abcdef" * 100
    with pytest.raises(CorruptCheckpointError, match="unsupported compression method 12"):
        read_member(f, e._replace(method=12), "z")
    with pytest.raises(CorruptCheckpointError, match="unsupported compression method 12"):
        read_member_head(f, e._replace(method=12), "z")
    start = data_offset(f, e, "z")
    garbled = data[:start] + b"\xff" * e.compress_size + data[start + e.compress_size:]
    with pytest.raises(CorruptCheckpointError, match="does not inflate"):
        read_member(io.BytesIO(garbled), e, "z")
    with pytest.raises(CorruptCheckpointError, match="does not inflate"):
        read_member_head(io.BytesIO(garbled), e, "z")
    with pytest.raises(CorruptCheckpointError, match="is truncated"):
        read_member(io.BytesIO(data[:start + 5]), e, "z")
    stored = _python_zip({"s.pkl": b"123456"})
    (s,) = _directory(stored)
    with pytest.raises(CorruptCheckpointError, match="declares 6 bytes stored but 9 bytes"):
        read_member(io.BytesIO(stored), s._replace(file_size=9), "z")


@pytest.mark.parametrize("flag", [0x1, 0x40])
def test_encrypted_member_is_refused(flag: int) -> None:
    data = _python_zip({"secret.pkl": b"\x80\x02N."})
    cd = data.index(b"PK\x01\x02")
    (e,) = _directory(_patch(data, cd + 8, "<H", flag))
    assert e.flags == flag
    with pytest.raises(CorruptCheckpointError, match="is encrypted"):
        read_member(io.BytesIO(data), e, "z")
    with pytest.raises(CorruptCheckpointError, match="is encrypted"):
        read_member_head(io.BytesIO(data), e, "z")


def test_duplicate_names_are_listed_by_zipdir_and_refused_by_read_checkpoint(tmp_path: Path) -> None:
    # zipdir reports every record in directory order (ckptool scan reads both copies); read_checkpoint refuses
    # the archive, since loaders may pick either copy
    b = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile: "Duplicate name"
        with zipfile.ZipFile(b, "w") as z:
            z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
            z.writestr("archive/version", b"3\n")
            z.writestr("archive/data.pkl", b"\x80\x02]q\x00.")
    data = b.getvalue()
    entries = _directory(data)
    assert [e.name for e in entries] == ["archive/data.pkl", "archive/version", "archive/data.pkl"]
    f = io.BytesIO(data)
    assert [read_member(f, e, "z") for e in entries if e.name.endswith(".pkl")] == [
        b"\x80\x02}q\x00.", b"\x80\x02]q\x00."]
    p = tmp_path / "dup.pt"
    p.write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match=r"two members named 'archive/data\.pkl'"):
        read_checkpoint(str(p))
