"""Open a torch checkpoint's structure: the pickle as a node graph plus where each storage's bytes live.

Nothing here reads tensor bytes or imports torch. For the zip format (torch >= 1.6) the storage of key ``k`` is
the stored record ``<archive>/data/k``; for the legacy stream (``_use_new_zipfile_serialization=False``) it is
found by walking the stream after the pickles: for each key of the storage-key list, an 8-byte little-endian
element count then the raw bytes (torch/serialization.py ``_legacy_load``). TorchScript archives are read the
same way as torch zip files (their ``data.pkl`` and ``constants.pkl``).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, NotACheckpointError, UnsupportedError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import STORAGE_TYPES, storage_element
from ckptool.formats.nodes import GlobalMeta, StorageRef
from ckptool.formats.pickle_check import walk_prefix, weights_only_refusal
from ckptool.formats.strided import check_tensor_views
from ckptool.formats.unpickler import load_pickle_at, load_structure
from ckptool.formats.zipdir import TorchRecords, ZipEntry, data_offset, duplicate_member, member_buffer, read_member

_UNSET = object()

LEGACY_MAGIC = formats.LEGACY_MAGIC_NUMBER
LEGACY_PROTOCOL = 1001

@dataclass(slots=True)  # no __dict__: one Record per storage (a million in a big state_dict)
class Record:
    """One record of the output or input archive: ``name`` relative to the archive folder (``data/0``,
    ``version``), its data's offset and size in bytes in the source file, and its CRC-32 when known."""

    name: str
    offset: int
    size: int
    crc: int | None = None
    zipinfo: ZipEntry | None = None


@dataclass
class Checkpoint:
    """The structure of one checkpoint file.

    ``root`` is the main pickle as a node graph; ``storages`` maps storage key -> :class:`StorageRef` in first-use
    order; :attr:`records` lists the file's records in file order (zip members, or for legacy files the storage
    data blocks named ``data/<key>``); ``globals`` lists ``(module, name)`` of every global the pickles name.
    """

    path: str
    format: str
    size: int
    root: Any = None
    protocol: int = 2
    storages: dict[str, StorageRef] = field(default_factory=dict)
    #: the records, once made (see :attr:`records`); ``replace(ck, _records=[...])`` gives a copy other records
    _records: list[Record] | None = field(default=None, repr=False)
    globals: list[tuple[str, str]] = field(default_factory=list)
    archive_name: str = "archive"
    #: bytes of the main pickle up to and including its STOP opcode (a torch zip's data.pkl; a plain pickle file: the
    #: file's size)
    pickle_size: int = 0
    extra_roots: dict[str, Any] = field(default_factory=dict)
    #: why torch 2.13's ``weights_only`` unpickler refuses the pickles ``torch.load`` reads for an opcode it does not
    #: read (``"opcode FRAME (0x95) at byte 2"``: a ``pickle_protocol=4`` save), whatever the globals; None: it reads
    #: every opcode (:func:`ckptool.formats.pickle_check.weights_only_refusal`)
    weights_only_refusal: str | None = None
    #: a zip's members (names without the archive folder, their directory entries) not yet made into records
    _members: tuple[list[str], list[ZipEntry]] | None = field(default=None, repr=False, compare=False)
    #: the byte order of the storages: a torch zip's ``byteorder`` record (``"little"`` when it has none, as
    #: torch 2.13 reads it), ``"little"`` for other formats (a big-endian legacy file is refused)
    byteorder: str = "little"

    @property
    def is_legacy(self) -> bool:
        """The legacy stream (``_use_new_zipfile_serialization=False``): storage ids and records laid out as
        ``torch.save`` wrote them before the zip format."""
        return self.format == formats.TORCH_LEGACY

    def byteswap_size(self, ref: StorageRef) -> int:
        """The element size whose bytes must be reversed to read storage ``ref`` as the little-endian values
        ckptool writes and compares (0: none), as ``torch.load`` swaps a storage whose ``byteorder`` is not the
        machine's (``storage.byteswap(dtype)``, dtype from the storage class: ``UntypedStorage`` is bytes and is
        never swapped; complex elements swap each half).

        Raises:
            UnsupportedError: an unknown storage class in a big-endian file.
        """
        if self.byteorder == "little":
            return 0
        dtype, size = storage_element(ref)
        if dtype.startswith("complex"):
            size //= 2
        return size if size > 1 else 0

    @property
    def records(self) -> list[Record]:
        """The file's records in file order (the list itself: rewriters fill in ``Record.offset``). For a zip,
        made from its directory on first use: inspecting a 50,000-member file needs none (25 ms saved)."""
        if self._records is None:
            names, entries = self._members or ([], [])
            self._records = [Record(n, -1, e.file_size, e.crc, e) for n, e in zip(names, entries, strict=True)]
            self._members = None
        return self._records

    def record(self, name: str) -> Record | None:
        """The record called ``name`` (``data/0``, ``constants.pkl``), or None. Before :attr:`records` is made,
        a zip member is looked up by name without making it (the record returned is then not the one
        :attr:`records` will hold: change records through :attr:`records`)."""
        if self._records is None and self._members is not None:
            names, entries = self._members
            try:
                i = names.index(name)
            except ValueError:
                return None
            e = entries[i]
            return Record(name, -1, e.file_size, e.crc, e)
        for r in self.records:
            if r.name == name:
                return r
        return None


def read_checkpoint(path: str, fmt: str | None = None) -> Checkpoint:
    """Read the structure of a torch zip, legacy or TorchScript file.

    Hostile input is refused in bounded time and memory (see :mod:`ckptool.formats.unpickler` and
    :mod:`ckptool.formats.zipdir`): besides the pickle checks, every storage must have its record (``data/<key>``,
    ``constants/<key>`` for TorchScript constants, or the legacy data block) holding at least ``numel * element
    size`` bytes, every tensor must fit in its storage as ``torch.load`` requires
    (:func:`ckptool.formats.strided.check_tensor_views`), and member names must be unique.

    Raises:
        UsageError / NotACheckpointError: see :func:`ckptool.formats.detect.detect_format`.
        CorruptCheckpointError: truncated, damaged or hostile file (memo bombs, lengths past the end, zip bombs,
            storages larger than their records, tensors larger than their storages, duplicate members...).
        UnsupportedError: safetensors, torch.export archives or plain pickles (no pickled torch storages to read),
            big-endian legacy files, tuple
            nesting too deep to read safely.
    """
    fmt = fmt or formats.detect_format(path)
    if fmt in (formats.TORCH_ZIP, formats.TORCHSCRIPT):
        return _read_zip(path, fmt)
    if fmt == formats.TORCH_LEGACY:
        return _read_legacy(path)
    if fmt == formats.PT2:
        raise UnsupportedError(
            f"{path} is a torch.export archive (.pt2), not a torch.save checkpoint: this command does not apply to "
            f"it. `ckptool inspect {path}` lists its weights; `ckptool convert {path} -o weights.pth` (or "
            ".safetensors) writes its state_dict as a file that torch.load reads")
    if fmt == formats.TORCH_PACKAGE:
        raise UnsupportedError(
            f"{path} is a torch.package archive (torch.package.PackageExporter), not a torch.save checkpoint: this "
            f"command does not apply to it. `ckptool convert {path} -o model.safetensors` (or -o model.pt) writes its "
            "state_dict without running the package's code, then run the command on that file; `ckptool inspect "
            f"{path}` lists its pickles, tensors and modules, `ckptool scan {path}` says what loading it runs")
    raise UnsupportedError(f"{path} is {fmt}, not a torch.save checkpoint: this command does not apply to it. "
                           f"`ckptool convert {path} -o model.pt` writes its tensors as a torch.save file, then run "
                           "the command on that file")


def read_pickle_file(path: str, *, views: bool = False) -> Checkpoint:
    """Read a plain pickle file (``pickle.dump``) as a structure without storages (its first pickle), the file
    mapped, not copied. ``views=True`` (``inspect``: a graph never written back) leaves its long bytes, bytearray
    and str values in the file as :class:`~ckptool.formats.nodes.BlobView` records (see
    :func:`~ckptool.formats.unpickler.load_pickle_at`): memory bounded by the pickle's structure.

    Raises:
        UsageError / NotACheckpointError: a missing path, a directory or an empty file.
        CorruptCheckpointError: a truncated, malformed or hostile pickle.
        UnsupportedError: tuple nesting too deep to read safely.
    """
    size = formats.check_readable(path)
    with source.open_binary(path) as f, source.whole_view(f) as buf:
        root, up, _end = load_pickle_at(buf, 0, f"pickle in {path}", exact=True, views=views)
        protocol, total = buf[1], len(buf)
    return Checkpoint(path, formats.PICKLE, size, root=root, protocol=protocol, globals=list(up.globals_seen),
                      pickle_size=total)


def _read_zip(path: str, fmt: str) -> Checkpoint:
    size = source.file_size(path)
    entries = formats.zip_entries(path)
    if not entries:
        raise NotACheckpointError(f"{path} is an empty zip archive, not a torch checkpoint")
    first = entries[0].name
    archive = first.split("/", 1)[0] if "/" in first else ""
    ck = Checkpoint(path, fmt, size, archive_name=archive or "archive")
    lead = archive + "/" if archive else ""
    # comprehensions rather than one loop (50,000 members in a big state_dict); a file that fails a check is walked
    # member by member (_zip_records) to refuse it with the same error
    names, lowered = _member_names([e.name for e in entries], lead)
    by_name = dict(zip(names, entries))
    data_pkl = _torch_data_pkl(path, entries, names, by_name, lowered)
    if len(by_name) == len(entries) and max([e.header_offset + e.compress_size for e in entries]) <= size:
        ck._members = (names, entries)  # records made on first use (Checkpoint.records)
    else:
        by_name = _zip_records(path, entries, lead, size, ck.records, names)
    if sum([e.compress_size for e in entries]) > size:
        raise CorruptCheckpointError(
            f"{path}: the zip's members hold more bytes than the file ({size} bytes): several members share or "
            "overlap their data (a zip bomb or a hand-made archive; torch.save never writes one), so ckptool "
            "refuses it (run `ckptool scan` on it)")
    if lowered != names:  # torch finds records ignoring case (the names are unique so, checked above)
        for n, e in list(by_name.items()):
            by_name.setdefault(n.lower(), e)
    cache: dict[tuple[str, str], GlobalMeta] = {}
    seen: dict[tuple[str, str], None] = {}
    with source.open_binary(path) as f:
        data = read_pickle_member(f, data_pkl, path)
        ck.protocol = data[1] if len(data) > 1 and data[0] == 0x80 else 2
        # load_structure's reading of bytes, keeping where the pickle ends (the member may go on after STOP)
        refusal: list[str | None] = [None]  # the opcode torch's weights_only unpickler refuses, in the same walk
        ck.root, up, ck.pickle_size = load_pickle_at(data, 0, f"data.pkl in {path}", exact=True,
                                                     storages=ck.storages, global_cache=cache, weights_only=refusal)
        ck.weights_only_refusal = refusal[0]
        seen.update(up.globals_seen)
        if "byteorder" in by_name:
            ck.byteorder = read_byteorder(f, by_name["byteorder"], path)
        check_storage_records(path, ck.storages, by_name, "data/")
        check_tensor_views(ck.root, path)
        if fmt == formats.TORCHSCRIPT and "constants.pkl" in by_name:
            const_storages: dict[str, StorageRef] = {}
            consts, up2 = load_structure(read_pickle_member(f, by_name["constants.pkl"], path),
                                         f"constants.pkl in {path}",
                                         storages=const_storages, global_cache=cache)
            ck.extra_roots["constants"] = consts
            seen.update(up2.globals_seen)
            check_storage_records(path, const_storages, by_name, "constants/")
            check_tensor_views(consts, f"{path} (constants.pkl)")
    ck.globals = list(seen)
    return ck


def _member_names(full: list[str], lead: str) -> tuple[list[str], list[str]]:
    """The members' names ``full`` without the archive folder ``lead`` (where they start with it), and the same
    lower-cased: in C loops over the names joined when none holds a newline (50,000 records in a big state_dict),
    else name by name."""
    joined = "\n".join(full)
    if joined.count("\n") == len(full) - 1 and full:
        if not lead:
            names = full
        elif joined.startswith(lead) and joined.count("\n" + lead) == len(full) - 1:  # every name starts so
            joined = joined[len(lead):].replace("\n" + lead, "\n")
            names = joined.split("\n")
        else:
            names = [n[len(lead):] if n.startswith(lead) else n for n in full]
            joined = "\n".join(names)
        return names, joined.lower().split("\n")
    names = [n[len(lead):] if lead and n.startswith(lead) else n for n in full]
    return names, [n.lower() for n in names]


def _torch_data_pkl(path: str, entries: list[ZipEntry], names: list[str], by_name: dict[str, ZipEntry],
                    lower_names: list[str]) -> ZipEntry:
    """The ``data.pkl`` member torch reads (:class:`~ckptool.formats.zipdir.TorchRecords`: names matched ignoring
    ASCII case); ``names`` (the members' names without the archive folder, which ``by_name`` maps; ``lower_names``: the
    same lower-cased) then calls it ``data.pkl``, the name rewriters give the new pickle.

    Raises:
        NotACheckpointError: torch finds no ``data.pkl``.
        CorruptCheckpointError: two member names differ only in case (torch reads one, ``zipfile`` another).
    """
    if len(by_name) == len(names) and len(set(lower_names)) != len(names):
        lowered: dict[str, str] = {}
        for e in entries:
            other = lowered.setdefault(e.name.lower(), e.name)
            if other != e.name:
                raise CorruptCheckpointError(
                    f"{path}: the zip holds members {other!r} and {e.name!r}, whose names differ only in case: "
                    "torch's reader matches names ignoring case and reads one, zipfile-based tools the other, so "
                    "ckptool refuses the file (run `ckptool scan` on it)")
    exact = by_name.get("data.pkl")
    if exact is not None:
        return exact
    found = TorchRecords(entries).find("data.pkl")
    if found is None:
        raise NotACheckpointError(f"{path} is a zip archive without data.pkl, not a torch checkpoint")
    i = entries.index(found)
    del by_name[names[i]]
    names[i] = "data.pkl"
    by_name["data.pkl"] = found
    return found


def _zip_records(path: str, entries: list[ZipEntry], lead: str, size: int, records: list[Record],
                 names: list[str] | None = None) -> dict[str, ZipEntry]:
    """Append a :class:`Record` per zip member to ``records``; return the members by name (``names``, default:
    theirs with ``lead`` removed).

    Raises:
        CorruptCheckpointError: a member runs past ``size`` bytes, or two members have the same name.
    """
    by_name: dict[str, ZipEntry] = {}
    if names is None:
        names = [e.name[len(lead):] if e.name.startswith(lead) else e.name for e in entries]
    for name, e in zip(names, entries, strict=True):
        if e.header_offset + e.compress_size > size:
            raise CorruptCheckpointError(
                f"{path}: record {e.name!r} runs past the end of the file: truncated; re-download it")
        if name in by_name:
            raise CorruptCheckpointError(f"{path}: {duplicate_member(e.name)} (`ckptool scan` lists what each holds)")
        records.append(Record(name, -1, e.file_size, e.crc, e))
        by_name[name] = e
    return by_name


#: bytes a deflated pickle member may hold after its STOP opcode (torch.save writes none) before it is refused
MAX_PICKLE_TRAILER = 1 << 20


def read_pickle_member(f: Any, entry: ZipEntry, path: str) -> bytes | bytearray:
    """The content of pickle member ``entry`` (``data.pkl``, ``constants.pkl``) of the open zip ``f``, in one buffer.

    A deflated member (torch never writes one; a re-packed archive may) is inflated as a stream
    (:func:`ckptool.formats.zipdir.member_buffer`) whose opcodes are checked as they arrive
    (:func:`ckptool.formats.pickle_check.walk_prefix`): inflated garbage, or more than :data:`MAX_PICKLE_TRAILER`
    bytes after the STOP opcode, is refused after one chunk, so a zip bomb costs a few MiB and milliseconds
    however far it would inflate; a valid pickle costs its own size.

    Raises:
        CorruptCheckpointError: see :func:`~ckptool.formats.zipdir.member_buffer`; an invalid opcode; a pickle
            followed by more than :data:`MAX_PICKLE_TRAILER` bytes.
    """
    what = f"{entry.name.rsplit('/', 1)[-1]} in {path}"
    state = [0, -1]  # next opcode to check, end of the pickle (after STOP) once seen

    def watch(buf: bytearray) -> None:
        if state[1] < 0:
            r = walk_prefix(buf, 0, state[0], what)
            if r < 0:
                state[0] = ~r
                return
            state[1] = r
        if len(buf) - state[1] > MAX_PICKLE_TRAILER:
            raise CorruptCheckpointError(
                f"{what} goes on for more than {MAX_PICKLE_TRAILER} bytes after its pickle ends (byte {state[1]}): a "
                "zip bomb or a hidden payload; torch.save writes nothing there. Run `ckptool scan` on the file")

    return member_buffer(f, entry, path, watch=watch if entry.method != 0 else None)


def read_byteorder(f: Any, entry: ZipEntry, path: str) -> str:
    """The content of a torch zip's ``byteorder`` record ``entry``: ``"little"`` or ``"big"``, exactly as
    ``torch.load`` accepts it (serialization.py ``_load``: anything else is "Unknown endianness type").

    Raises:
        CorruptCheckpointError: another value (torch.load refuses the file too).
    """
    data = bytes(read_member(f, entry, path, limit=16)) if entry.file_size <= 16 else b""
    if data not in (b"little", b"big"):
        raise CorruptCheckpointError(f"{path}: the byteorder record holds {data[:16]!r} (size {entry.file_size}), "
                                     "neither 'little' nor 'big'; torch.load refuses it: the file is damaged")
    return data.decode()


def check_storage_records(path: str, storages: dict[str, StorageRef], by_name: dict[str, ZipEntry],
                          folder: str) -> None:
    """Check that every storage has its record ``<folder><key>`` and that the record holds at least the
    ``numel * element size`` bytes its persistent id declares (torch reads that many bytes from it).

    Raises:
        CorruptCheckpointError: a record is missing or shorter than its storage.
    """
    elsize: dict[int, int] = {}
    get = by_name.get
    last_type: Any = _UNSET  # storages of one checkpoint mostly share one type: its element size is looked up once
    n = 1
    for key, ref in storages.items():
        e = get(folder + key)
        if e is None:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r} has no record {folder}{key} in the archive; the file is damaged or "
                "incomplete, re-download it")
        if ref.storage_type is not last_type:
            last_type = ref.storage_type
            st = id(last_type)
            found = elsize.get(st)
            if found is None:
                found = elsize[st] = STORAGE_TYPES.get(ref.storage_type_name, ("", 1))[1]
            n = found
        if ref.numel * n > e.file_size:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r} declares {ref.numel} elements ({ref.numel * n} bytes) but its record "
                f"holds {e.file_size} bytes; the file is damaged or hostile, re-download it")


def resolve_zip_offsets(ck: Checkpoint, f: Any) -> None:
    """Fill ``Record.offset`` (start of the member's data) from each zip local header of the open binary file
    ``f`` (30 bytes + name + extra per member).

    Raises:
        CorruptCheckpointError: a local header is missing.
    """
    for rec in ck.records:
        if rec.zipinfo is not None and rec.offset < 0:
            rec.offset = data_offset(f, rec.zipinfo, ck.path)


def _read_legacy(path: str) -> Checkpoint:
    size = source.file_size(path)
    ck = Checkpoint(path, formats.TORCH_LEGACY, size, archive_name=os.path.splitext(os.path.basename(path))[0])
    # mapped (a remote legacy stream has no index: it is copied to a local temporary file first)
    with source.open_binary(path) as f, source.whole_view(f) as buf:
        _legacy_structure(path, ck, buf, size)
    return ck


def _legacy_structure(path: str, ck: Checkpoint, buf: Any, size: int) -> None:
    """The five pickles of a legacy stream, then the storage blocks (torch/serialization.py ``_legacy_load``).
    Every global of every pickle counts: ``torch.load`` unpickles all of them."""
    seen: dict[tuple[str, str], None] = {}

    def load(pos: int, what: str, **kw: Any) -> tuple[Any, int]:
        root, up, end = load_pickle_at(buf, pos, f"{what} of {path}", **kw)
        seen.update(up.globals_seen)
        if ck.weights_only_refusal is None:  # torch.load(weights_only=True) reads all five with its unpickler
            refused = weights_only_refusal(buf, pos, end)
            ck.weights_only_refusal = refused and f"{refused} of the {what}"
        return root, end

    magic, pos = load(0, "magic number")
    if magic != LEGACY_MAGIC:
        raise NotACheckpointError(f"{path} is not a torch legacy checkpoint (bad magic number)")
    proto, pos = load(pos, "protocol version")
    if proto != LEGACY_PROTOCOL:
        raise UnsupportedError(f"{path}: unsupported legacy protocol version {proto!r}")
    sys_info, pos = load(pos, "sys_info")
    if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
        raise UnsupportedError(f"{path} was saved on a big-endian machine; load and re-save it there")
    start = pos
    ck.root, pos = load(pos, "main pickle", storages=ck.storages)
    ck.pickle_size = pos - start
    keys, pos = load(pos, "storage key list")
    ck.globals = list(seen)
    if not isinstance(keys, list) or not all(isinstance(k, (str, int)) for k in keys):
        raise CorruptCheckpointError(f"{path}: the storage key list is malformed; the file is damaged")
    if len({str(k) for k in keys}) != len(keys):
        raise CorruptCheckpointError(f"{path}: the storage key list names a storage twice; the file is damaged")
    for k in keys:
        key = str(k)
        ref = ck.storages.get(key)
        if ref is None:
            raise CorruptCheckpointError(f"{path}: storage {key!r} has data but no tensor uses it; damaged file")
        head = buf[pos:pos + 8]
        if len(head) != 8:
            raise CorruptCheckpointError(
                f"{path} is truncated: the data of storage {key!r} is missing; re-download or re-save it"
            )
        numel = struct.unpack("<q", head)[0]
        elsize = storage_element(ref)[1]
        if numel != ref.numel:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r} declares {ref.numel} elements but its data holds {numel}; damaged file"
            )
        nbytes = numel * elsize
        if pos + 8 + nbytes > size:
            raise CorruptCheckpointError(
                f"{path} is truncated: storage {key!r} needs {nbytes} bytes at offset {pos + 8} but the file "
                f"ends at {size}; re-download or re-save it"
            )
        ck.records.append(Record("data/" + key, pos + 8, nbytes))
        pos += 8 + nbytes
    have = {str(k) for k in keys}
    missing = [k for k in ck.storages if k not in have]
    if missing:
        raise CorruptCheckpointError(f"{path}: no data for storages {missing[:5]}; the file is damaged")
    check_tensor_views(ck.root, path)
