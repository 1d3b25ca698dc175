"""Adversarial cases for the container parsers (issue 24, "scan sees exactly what the loader sees"): zips that torch's
zip reader (miniz, ``torch._C.PyTorchFileReader``), Python's ``zipfile`` and ckptool could read differently, a V7
tar that ``torch.load`` opens as a legacy checkpoint, bytes after a pickle or a safetensors file, nesting, and a
zip whose directory entries share one deflated stream.

Every file is written byte by byte (:func:`zip_layout` places local headers, central directories and end records
where a case needs them); the payload is :func:`adversarial.marker_pickle`. ``loader`` snippets name the reader
that runs the payload: ``torch.load`` where it does, else the ``zipfile`` + ``pickle`` pair that zip-based tools use.
"""

from __future__ import annotations

import json
import pickle
import random
import struct
import zlib
from pathlib import Path

import hostile_corpus as hc
from adversarial import Case, marker_pickle

BENIGN = pickle.dumps({"a": 1}, protocol=2)
TORCH_LOAD = "import torch; torch.load(PATH, weights_only=False)"
ZIPFILE_LOAD = "import pickle, zipfile; pickle.loads(zipfile.ZipFile(PATH).read('archive/data.pkl'))"
TORCH_READER_LOAD = "import pickle, torch; pickle.loads(torch._C.PyTorchFileReader(PATH).get_record('data.pkl'))"

# ------------------------------------------------------------------------------------------------ zip bytes


def local_header(name: str, data: bytes, *, deflate: bool = False) -> tuple[bytes, tuple[int, int, int, int]]:
    """A local file header followed by ``data`` (stored, or deflated raw); returns the bytes and (crc, compressed
    size, size, method) for its central directory entry."""
    crc = zlib.crc32(data)
    if deflate:
        c = zlib.compressobj(6, zlib.DEFLATED, -15)
        body, method = c.compress(data) + c.flush(), 8
    else:
        body, method = data, 0
    nb = name.encode("utf-8")
    hdr = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(body), len(data), len(nb), 0)
    return hdr + nb + body, (crc, len(body), len(data), method)


def central_entry(name: str, offset: int, info: tuple[int, int, int, int], comment: bytes = b"") -> bytes:
    """A central directory entry for ``name`` whose local header is at ``offset``."""
    crc, csize, usize, method = info
    nb = name.encode("utf-8")
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, csize, usize, len(nb), 0,
                       len(comment), 0, 0, 0, offset) + nb + comment


def end_record(count: int, cd_size: int, cd_offset: int) -> bytes:
    """The 32-bit end of central directory record."""
    return struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, cd_offset, 0)


def zip64_end(count: int, cd_size: int, cd_offset: int) -> bytes:
    """A ZIP64 end of central directory record (56 bytes)."""
    return struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)


def zip64_locator(at: int) -> bytes:
    """A ZIP64 end of central directory locator pointing at file offset ``at``."""
    return struct.pack("<IIQI", 0x07064B50, 0, at, 1)


def zip_layout(members: list[tuple[str, bytes]], base: int = 0, *,
               deflate: bool = False) -> tuple[bytes, list[bytes]]:
    """The local headers + data of ``members`` as if they started at file offset ``base``, and their central
    directory entries (offsets absolute: ``base`` included)."""
    out = bytearray()
    central = []
    for name, data in members:
        local, info = local_header(name, data, deflate=deflate)
        central.append(central_entry(name, base + len(out), info))
        out += local
    return bytes(out), central


def plain_zip(members: list[tuple[str, bytes]], base: int = 0) -> bytes:
    """A zip of ``members`` whose offsets count from ``base`` bytes before it (0: an ordinary zip; the length of
    data put in front: offsets absolute in the whole file, as torch's reader wants them)."""
    body, central = zip_layout(members, base)
    cd = b"".join(central)
    return body + cd + end_record(len(central), len(cd), base + len(body))


def _torch_members(data_pkl: bytes, name: str = "data.pkl") -> list[tuple[str, bytes]]:
    return [(f"archive/{name}", data_pkl), ("archive/byteorder", b"little"), ("archive/version", b"3\n")]


# ------------------------------------------------------------------------------------------------ the files
def case_only_upper(folder: Path) -> Path:
    """``archive/DATA.PKL`` (a protocol-0 payload: no ``\\x80`` header) and no ``data.pkl``: torch finds it."""
    p = folder / "upper.pt"
    p.write_bytes(plain_zip(_torch_members(marker_pickle(0), "DATA.PKL")))
    return p


def case_two(folder: Path) -> Path:
    """``archive/DATA.PKL`` (payload) before ``archive/data.pkl`` (benign): torch reads the first, zipfile the
    second."""
    p = folder / "two-cases.pt"
    members = [("archive/DATA.PKL", marker_pickle(0)), *_torch_members(BENIGN)]
    p.write_bytes(plain_zip(members))
    return p


def _two_directories() -> tuple[bytes, list[bytes], list[bytes]]:
    """Locals of directory A (benign data.pkl) then B (payload), and the two sets of central entries."""
    body_a, cen_a = zip_layout(_torch_members(BENIGN))
    body_b, cen_b = zip_layout(_torch_members(marker_pickle(2)), len(body_a))
    return body_a + body_b, cen_a, cen_b


def zip64_other_directory(folder: Path) -> Path:
    """The 32-bit end record points to directory A (benign); a ZIP64 end record just before the ZIP64 locator
    points to directory B (payload), which torch and zipfile read (neither needs the 0xFFFF markers)."""
    body, cen_a, cen_b = _two_directories()
    cd_a, cd_b = b"".join(cen_a), b"".join(cen_b)
    at_a = len(body)
    at_b = at_a + len(cd_a)
    z64_at = at_b + len(cd_b)
    data = (body + cd_a + cd_b + zip64_end(len(cen_b), len(cd_b), at_b) + zip64_locator(z64_at)
            + end_record(len(cen_a), len(cd_a), at_a))
    p = folder / "zip64-two-directories.pt"
    p.write_bytes(data)
    return p


def zip64_split_readers(folder: Path) -> Path:
    """torch reads directory B through a ZIP64 end record away from the locator (miniz follows the locator's
    offset); Python 3.11's zipfile looks for that record just before the locator, finds none, and reads directory A
    (benign), whose last entry's comment is the locator itself."""
    body, cen_a, cen_b = _two_directories()
    cd_b = b"".join(cen_b)
    at_b = len(body)
    z64_at = at_b + len(cd_b)
    at_a = z64_at + 56
    head_a = b"".join(cen_a[:-1])
    last = cen_a[-1]
    locator = zip64_locator(z64_at)
    last = last[:32] + struct.pack("<H", 20) + last[34:] + locator  # comment length 20: the locator
    cd_a = head_a + last
    data = body + cd_b + zip64_end(len(cen_b), len(cd_b), at_b) + cd_a + end_record(len(cen_a), len(cd_a), at_a)
    p = folder / "zip64-split-readers.pt"
    p.write_bytes(data)
    return p


def _tar_header(name: bytes, size: int) -> bytes:
    """A V7 tar header (no ``ustar`` magic) for a regular file."""
    h = bytearray(512)
    h[0:len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"00000000000\0"
    h[148:156] = b" " * 8
    h[156:157] = b"0"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def v7_tar_tiny_pickle(folder: Path) -> Path:
    """A V7 tar whose first member is named ``\\x80\\x02N.`` (so the file's first bytes are a pickle of None) and
    whose ``storages`` member is the payload: ``torch.load`` tries tarfile first and unpickles ``storages``."""
    out = bytearray()
    for name, data in ((b"\x80\x02N.", b""), (b"storages", marker_pickle(2)), (b"tensors", pickle.dumps(0, 2)),
                       (b"pickle", BENIGN)):
        out += _tar_header(name, len(data)) + data + bytes(-len(data) % 512)
    out += bytes(1024)
    p = folder / "v7.tar.pt"
    p.write_bytes(bytes(out))
    return p


def pickle_then_absolute_zip(folder: Path) -> Path:
    """A benign pickle followed by a zip whose offsets count from the file's start (torch's reader and zipfile
    read it; the leading pickle is what pickle.load sees)."""
    p = folder / "pickle-abs-zip.pt"
    p.write_bytes(BENIGN + plain_zip(_torch_members(marker_pickle(2)), len(BENIGN)))
    return p


def safetensors_then_zip(folder: Path) -> Path:
    """A valid safetensors file (one float32 tensor) with a zip appended after its last tensor."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    st = struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, 2.0)
    p = folder / "st-then-zip.safetensors"
    p.write_bytes(st + plain_zip(_torch_members(marker_pickle(2)), len(st)))
    return p


def entry_beyond_count(folder: Path) -> Path:
    """The end record counts 3 entries; the directory holds a 4th, a second ``archive/data.pkl`` (payload) that
    zipfile reads (it reads every entry in the directory's bytes; the last of a name wins) and torch never sees."""
    members = [*_torch_members(BENIGN), ("archive/data.pkl", marker_pickle(2))]
    body, central = zip_layout(members)
    cd = b"".join(central)
    p = folder / "beyond-count.pt"
    p.write_bytes(body + cd + end_record(3, len(cd), len(body)))
    return p


def five_deep(folder: Path) -> Path:
    """A torch zip holding a zip holding a zip ... the payload's ``data.pkl`` five zips deep."""
    data = hc.torch_zip(marker_pickle(2))
    for _ in range(4):
        data = hc.torch_zip(BENIGN, extra={"inner.zip": data})
    p = folder / "five-deep.pt"
    p.write_bytes(data)
    return p


def shared_stream_payload(n_bytes: int) -> bytes:
    """A pickle that runs the marker and then returns ``n_bytes`` of data that deflates about 8 times (so its
    member stays under ckptool's inflate ratio of 16)."""
    rnd = random.Random(24)
    filler = b"".join(rnd.randbytes(6) + bytes(58) for _ in range(n_bytes // 64 + 1))[:n_bytes]
    marker = marker_pickle(2)
    return marker[:-1] + b"0" + b"B" + struct.pack("<I", len(filler)) + filler + b"."


def shared_stream(entries: int, n_bytes: int = 8 << 20) -> bytes:
    """A torch-like zip whose ``entries`` central directory entries (``archive/data.pkl``, ``archive/p<i>.pkl``)
    all point to one local header and its deflated stream."""
    local, info = local_header("archive/data.pkl", shared_stream_payload(n_bytes), deflate=True)
    version, vinfo = local_header("archive/version", b"3\n")
    central = [central_entry("archive/data.pkl", 0, info)]
    central += [central_entry(f"archive/p{i}.pkl", 0, info) for i in range(1, entries)]
    central.append(central_entry("archive/version", len(local), vinfo))
    cd = b"".join(central)
    return local + version + cd + end_record(len(central), len(cd), len(local) + len(version))


def _shared(entries: int):  # type: ignore[no-untyped-def]
    def make(folder: Path) -> Path:
        p = folder / f"shared-{entries}.pt"
        p.write_bytes(shared_stream(entries))
        return p
    return make


CASES: list[Case] = [
    Case("zip-case-only-upper", "zip member name case (torch ignores it)", case_only_upper, loader=TORCH_LOAD),
    Case("zip-case-two-variants", "zip member name case (torch ignores it)", case_two, loader=TORCH_LOAD),
    Case("zip64-record-other-directory", "ZIP64 end record vs 32-bit record", zip64_other_directory,
         loader=TORCH_LOAD),
    Case("zip64-torch-vs-zipfile", "ZIP64 end record vs 32-bit record", zip64_split_readers, loader=TORCH_LOAD),
    Case("tar-v7-tiny-pickle", "V7 tar opened by torch.load", v7_tar_tiny_pickle, loader=TORCH_LOAD),
    Case("pickle-then-absolute-zip", "bytes never looked at", pickle_then_absolute_zip, loader=ZIPFILE_LOAD),
    Case("safetensors-then-zip", "bytes never looked at", safetensors_then_zip, loader=TORCH_READER_LOAD),
    Case("zip-entry-beyond-count", "bytes never looked at", entry_beyond_count, loader=ZIPFILE_LOAD),
    Case("zip-five-deep", "bytes never looked at", five_deep),
    Case("zip-shared-stream-40", "resources: shared deflated stream", _shared(40), loader=TORCH_LOAD),
    Case("zip-shared-stream-160", "resources: shared deflated stream", _shared(160), loader=TORCH_LOAD),
]
