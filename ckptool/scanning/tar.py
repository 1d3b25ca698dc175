"""The legacy tar archives of ``ckptool scan`` (torch < 0.4, read by torch's ``_legacy_load``): every member is
read as pickles in a row; ``storages`` and ``tensors`` as torch reads them, pickles between raw blocks.

The container walk (:class:`ckptool.scanning.pickles.Scanner`) calls :func:`scan_tar` with itself as the
:class:`PickleWalker` that reads and records each pickle. The pieces both use live here, below the walk: the
opcodes a pickle can begin with, the most pickles read in a row, and the labels of nested places (``a!b``).
Nothing is imported or called from the file.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Protocol

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.detect import tarfile_module
from ckptool.formats.dtypes import STORAGE_TYPES
from ckptool.formats.nodes import GlobalMeta
from ckptool.formats.pickle_check import PickleBuffer
from ckptool.scanning.results import PickleFinding

if TYPE_CHECKING:
    import tarfile

__all__ = [
    "LOADED_TAR_MEMBERS",
    "MAX_PICKLES_IN_A_ROW",
    "MAX_TAR_MEMBERS",
    "PICKLE_FIRST",
    "PickleWalker",
    "inside",
    "join_where",
    "leaves_archive",
    "scan_tar",
    "tar_records",
]

MAX_TAR_MEMBERS = 10_000
MAX_PICKLES_IN_A_ROW = 10_000
#: the members of a legacy tar that torch's ``_legacy_load`` unpickles (member names, not formats)
LOADED_TAR_MEMBERS = frozenset({"sys_info", "pickle", "storages", "tensors"})
#: a file's first byte starts a pickle only if it is an opcode a pickle can begin with
PICKLE_FIRST = frozenset(b"\x80(.012NQR}abdel]ostu)\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94"
                          b"KhqJjMGUCXBT\x8a\x8b\x8c\x8d\x8e\x96ILFSVPgpci")


class PickleWalker(Protocol):
    """What the tar walk needs of the scan's container walk: the labels of the pickles torch's loader reads
    (``loaded``), recording findings and notes, and reading pickles (one with its root, several in a row, data
    after the last one)."""

    loaded: set[str]

    def record(self, finding: PickleFinding, root: Any = None) -> None: ...

    def note(self, text: str) -> None: ...

    def parse_root(self, buf: PickleBuffer, pos: int, where: str) -> tuple[Any, int] | None: ...

    def pickles_in_a_row(self, buf: PickleBuffer, pos: int, where: str, *,
                         first_required: bool = True) -> int | None: ...

    def trailing(self, buf: PickleBuffer, pos: int, where: str, depth: int) -> None: ...

    def tar_member(self, data: bytes, name: str, label: str, depth: int) -> bool: ...


def scan_tar(w: PickleWalker, buf: PickleBuffer, where: str, depth: int) -> tuple[int, bool]:
    """A tar archive in ``buf``: a torch legacy tar (torch < 0.4), whose ``sys_info``, ``pickle``, ``storages`` and
    ``tensors`` members ``torch.load`` unpickles, or another tar (a NeMo ``.nemo`` archive), whose configs, zips and
    gzip streams are read as what they are (``w.tar_member``); every other member is read as pickles in a row, each
    recorded through ``w``. A member whose path leaves the archive is a note. Returns ``(end, legacy)``: the offset
    after the last member read, and whether a member has a legacy record's name.

    Raises:
        CorruptCheckpointError: ``tarfile`` cannot open the archive (damage after the readable members is a note).
    """
    tar = tarfile_module()  # imported for a tar only
    try:
        with tar.open(fileobj=io.BytesIO(buf if isinstance(buf, bytes) else bytes(buf)), mode="r:") as tf:
            _tar_members(w, tf, where, depth)
            return tf.offset, any(m.name in LOADED_TAR_MEMBERS for m in tf.members)
    except tar.TarError as e:
        raise CorruptCheckpointError(f"damaged tar archive{inside(where)} ({e})") from e


def _tar_members(w: PickleWalker, tf: tarfile.TarFile, where: str, depth: int) -> None:
    try:
        _read_tar_members(w, tf, where, depth)
    except tarfile_module().TarError as e:
        w.note(f"the tar archive{inside(where)} is damaged after its readable members ({e})")


def _read_tar_members(w: PickleWalker, tf: tarfile.TarFile, where: str, depth: int) -> None:
    for i, member in enumerate(tf):
        if i >= MAX_TAR_MEMBERS:
            w.note(f"more than {MAX_TAR_MEMBERS} tar members; the rest were not scanned")
            break
        escape = leaves_archive(member.name, member.issym() or member.islnk(), member.linkname)
        if escape:
            w.note(f"tar member {member.name!r}{inside(where)} {escape}")
        if not member.isfile():
            continue
        fobj = tf.extractfile(member)
        data = fobj.read() if fobj is not None else b""
        label = join_where(where, f"tar member {member.name}")
        known = member.name in LOADED_TAR_MEMBERS
        if known and not where:
            w.loaded.add(label)
        if not known and w.tar_member(data, member.name, label, depth):
            continue
        if data[:1] and data[0] in PICKLE_FIRST:
            if member.name in ("storages", "tensors"):  # pickles between raw blocks (torch's legacy_load)
                rest = tar_records(w, data, label, member.name)
                if rest is not None and rest < len(data):
                    rest = w.pickles_in_a_row(data, rest, f"{label} (byte {rest})", first_required=False)
            else:
                rest = w.pickles_in_a_row(data, 0, label, first_required=known)
            if rest is not None and rest < len(data):
                w.trailing(data, rest, label, depth)
        elif known:
            w.record(PickleFinding(label, 0, [], "not a pickle"))


def tar_records(w: PickleWalker, data: bytes, label: str, member: str) -> int | None:
    """The ``storages`` or ``tensors`` member of a legacy tar as torch's ``legacy_load`` reads it: a pickle of
    the count, then per item a pickle and raw bytes (a storage: 8-byte element count and the elements; a
    tensor: ndim, sizes, strides, offset), then (storages) a pickle of the views. Returns where reading
    stopped, or None when a pickle failed; a layout that does not add up ends the walk with a note."""
    got = w.parse_root(data, 0, label)
    if got is None:
        return None
    count, pos = got
    if type(count) is not int or not 0 <= count <= MAX_PICKLES_IN_A_ROW:
        w.note(f"{label}: the item count is not a small integer; the rest was read as pickles in a row")
        return pos
    for i in range(count):
        got = w.parse_root(data, pos, f"{label} (item {i + 1}, byte {pos})")
        if got is None:
            return None
        args, pos = got
        if member == "storages":
            st = args[2] if isinstance(args, tuple) and len(args) == 3 else None
            elsize = STORAGE_TYPES.get(st.name if isinstance(st, GlobalMeta) else "", ("", 0))[1]
            numel = int.from_bytes(data[pos:pos + 8], "little", signed=True)
            step, bad = 8 + numel * elsize, elsize == 0 or numel < 0
        else:
            ndim = int.from_bytes(data[pos:pos + 4], "little", signed=True)
            step, bad = 8 + 16 * ndim + 8, ndim < 0
        if bad:
            w.note(f"{label}: item {i + 1} does not add up; the rest was read as pickles in a row")
            return pos
        if pos + step > len(data) or step < 8:
            w.note(f"{label}: item {i + 1} runs past the member's end")
            return len(data)
        pos += step
    if member == "storages":
        got = w.parse_root(data, pos, f"{label} (storage views, byte {pos})")
        if got is None:
            return None
        pos = got[1]
    return pos


def leaves_archive(name: str, is_link: bool = False, target: str = "") -> str | None:
    """Why extracting the member ``name`` (a link to ``target`` when ``is_link``) writes outside the folder it is
    extracted to (``..`` parts, an absolute path, a drive letter, a link), or None. ``torch.load`` never extracts an
    archive; a user who unpacks it (``tar -xf``, ``unzip``, ``tarfile.extractall`` before Python 3.14) may."""
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "has an absolute path: extracting it writes outside the target folder"
    if ".." in parts:
        return "climbs out of the archive (a '..' part): extracting it writes outside the target folder (zip-slip)"
    if is_link:
        return f"is a link to {target!r}: extracting it makes a path that can point outside the target folder"
    return None


def inside(where: str) -> str:
    """`` in <where>`` for a message about a place (a member, an appended zip), or "" for the file itself."""
    return f" in {where}" if where else ""


def join_where(where: str, name: str) -> str:
    """The label of ``name`` inside the place ``where`` (``a!b``), or ``name`` itself at the top."""
    return f"{where}!{name}" if where else name
