"""``ckptool scan``: list every global each pickle in a file would import, and say whether loading it is safe.

How a global is classified
--------------------------
Each global gets a status and a level from :func:`ckptool.model.allowlist.classify_global` (the rules, with the
reason for each list, are in :mod:`ckptool.model.allowlist`):

* **safe** (status ``allowed``): ``torch.load(weights_only=True)`` accepts it
  (:data:`ckptool.model.allowlist.WEIGHTS_ONLY_ALLOWED`, taken from torch's
  ``_weights_only_unpickler._get_allowed_globals()``). In a TorchScript archive (a zip holding ``constants.pkl``,
  the test ``torch.load`` itself uses to hand the file to ``torch.jit.load``) the names that TorchScript's C++
  unpickler resolves without Python are safe too: ``__torch__.*`` and ``torch.jit._pickle.*``.
* **needs-trust** (status ``needs-trust`` or ``unknown``): a library class or rebuilder that runs no code of the
  file's choosing (``torch.nn`` modules, optimizers, numpy arrays and RNG state, ``argparse.Namespace``, ``pathlib``
  paths, DCP metadata records), or a class on no list (``mypkg.Net``: loading imports its package).
* **dangerous**: a known process, file, network, import or code-evaluation gadget (``os.system``,
  ``builtins.eval``, ``subprocess.Popen``, ``functools.partial``, ``torch.load`` inside a pickle...), or a
  function on no list: loading would call it with arguments the file chooses.

A file's ``level`` is the worst level of its globals. Its three-level ``verdict`` is ``dangerous`` when any global
is (even if the pickle is damaged after it: ``torch.load`` would already have run it), else ``error`` when a pickle
(or the file) could not be read to its end (ckptool cannot vouch for what follows), else its level. The strict
verdict (``ckptool scan --strict``) is the single one of earlier versions: ``unsafe`` when any global is outside
the weights_only allowlist, else ``error``, else ``safe``.

Which pickles are read
----------------------
Scanning looks at the bytes, never at the file name, and reads every place a loader might find a pickle:

* a zip (torch >= 1.6 or TorchScript): every member named ``*.pkl`` / ``*.debug_pkl`` / ``*.pickle`` in any
  folder, duplicates included, with a bad CRC-32 noted but still read (torch does not check it); members that are
  themselves zips are scanned recursively; other members that start like a pickle are read too;
* a legacy stream: its five pickles (magic number, protocol, ``sys_info``, main object, storage keys);
* a legacy tar (torch < 0.4): its ``sys_info``, ``pickle``, ``storages`` and ``tensors`` members;
* a plain pickle (whatever its name: ``.pt``, ``.bin``...);
* in every case, data after the last pickle: further pickles in a row are read, and a zip appended to the file
  (which ``zipfile`` and some scanners see instead of the leading pickle) is scanned as well;
* safetensors files hold no pickle: their header is checked and they are safe.

Nothing is imported or called while scanning: the pickles are read by :mod:`ckptool.formats.unpickler`.
"""

from __future__ import annotations

import io
import os
import struct
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, cast

from ckptool import _source as source
from ckptool._source import RangeView
from ckptool.errors import CkptError, CorruptCheckpointError, UsageError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import STORAGE_TYPES
from ckptool.formats.nodes import StorageRef, qualified_name
from ckptool.formats.pickle_check import PickleBuffer, check_pickle
from ckptool.formats.safetensors import read_header
from ckptool.formats.unpickler import load_pickle_at, partial_globals
from ckptool.formats.zipdir import ZipEntry, read_directory, read_member, read_member_head
from ckptool.model.allowlist import (
    ALLOWED,
    DANGEROUS,
    LEVELS,
    NEEDS_TRUST,
    SAFE,
    classify_global,
    level_of,
    worst_level,
)

__all__ = ["EXIT_CODES", "STRICT_EXIT_CODES", "GlobalFinding", "PickleFinding", "ScanResult", "exit_status",
           "iter_paths", "scan", "scan_file"]

#: the ``ckptool scan`` exit status of each verdict (3 is every command's internal-error status)
EXIT_CODES: dict[str, int] = {SAFE: 0, DANGEROUS: 1, "error": 2, NEEDS_TRUST: 4}
#: the exit status of each strict verdict (``--strict``: the codes of earlier versions)
STRICT_EXIT_CODES: dict[str, int] = {"safe": 0, "unsafe": 1, "error": 2}

# ------------------------------------------------------------------------------------------------ results
@dataclass
class PickleFinding:
    """One pickle found in a file: ``where`` (``archive/data.pkl``, ``pickle at byte 0``, ``legacy sys_info``,
    ``inner.zip!archive/data.pkl``...), its byte ``offset`` in that container, the ``globals`` it names
    (``module.qualname``, first use first) and ``error`` when it could not be read to its STOP opcode (the globals
    are then those named before the failure)."""

    where: str
    offset: int
    globals: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class GlobalFinding:
    """A global named anywhere in the file, its status (``allowed`` / ``needs-trust`` / ``unknown`` /
    ``dangerous``, :func:`ckptool.model.allowlist.classify_global`), why, and the pickles (``where``) that name it."""

    name: str
    status: str
    reason: str
    where: list[str] = field(default_factory=list)

    @property
    def level(self) -> str:
        """``safe``, ``needs-trust`` or ``dangerous`` (:func:`ckptool.model.allowlist.level_of`)."""
        return level_of(self.status)

    def to_dict(self) -> dict[str, Any]:
        """``name``, ``status``, ``level``, ``reason``, ``where``: one entry of ``ckptool scan --json``."""
        return {"name": self.name, "status": self.status, "level": self.level, "reason": self.reason,
                "where": list(self.where)}


@dataclass
class ScanResult:
    """What :func:`scan_file` found in one file.

    ``format`` is the container recognised from the bytes (``torch-zip``, ``torchscript``, ``zip``,
    ``torch-legacy``, ``legacy-tar``, ``pickle``, ``safetensors``, or ``unknown``); ``notes`` list container
    oddities (data after the last pickle, bad CRC-32, duplicate member names, unreadable extra members...);
    ``error`` says why the file could not be read at all; ``bytes_read`` the bytes transferred to scan a URL
    (range requests for zip and safetensors files), None for a local path.
    """

    path: str
    format: str = "unknown"
    pickles: list[PickleFinding] = field(default_factory=list)
    globals: list[GlobalFinding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    bytes_read: int | None = None

    @property
    def readable(self) -> bool:
        """False when the file, or one of its pickles, could not be read to its end."""
        return not (self.error or any(p.error for p in self.pickles))

    @property
    def level(self) -> str:
        """The worst level of the globals found (``safe`` when none): ``safe``, ``needs-trust`` or ``dangerous``."""
        return worst_level(g.status for g in self.globals)

    @property
    def verdict(self) -> str:
        """``dangerous`` if any global is; else ``error`` if a pickle (or the file) could not be read to its end;
        else ``needs-trust`` or ``safe`` (:attr:`level`)."""
        level = self.level
        if level == DANGEROUS or self.readable:
            return level
        return "error"

    @property
    def strict_verdict(self) -> str:
        """The single verdict of ``--strict``: ``unsafe`` if any global is not allowed; else ``error`` if a pickle
        (or the file) could not be read to its end; else ``safe``."""
        if any(g.status != ALLOWED for g in self.globals):
            return "unsafe"
        return "safe" if self.readable else "error"

    @property
    def exit_code(self) -> int:
        """The ``ckptool scan`` exit status for this file alone: 0 safe, 1 dangerous, 2 unreadable, 4 needs trust
        (:data:`EXIT_CODES`)."""
        return EXIT_CODES[self.verdict]

    @property
    def strict_exit_code(self) -> int:
        """The ``ckptool scan --strict`` exit status for this file alone: 0 safe, 1 unsafe, 2 unreadable."""
        return STRICT_EXIT_CODES[self.strict_verdict]

    @property
    def unsafe(self) -> list[GlobalFinding]:
        """The globals that are not allowed, worst level first (dangerous, then needs-trust; stable otherwise)."""
        bad = [g for g in self.globals if g.status != ALLOWED]
        return sorted(bad, key=lambda g: -LEVELS.index(g.level))

    def to_dict(self, *, strict: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (what ``ckptool scan --json`` prints for each file): ``verdict`` (the strict one when
        ``strict``), ``level``, each global with its ``status`` and ``level``, and for a URL ``bytes_read``."""
        d: dict[str, Any] = {
            "path": self.path, "verdict": self.strict_verdict if strict else self.verdict, "level": self.level,
            "format": self.format, "error": self.error,
            "globals": [g.to_dict() for g in self.globals],
            "pickles": [vars(p).copy() for p in self.pickles],
            "notes": list(self.notes),
        }
        if self.bytes_read is not None:  # a URL: the bytes transferred
            d["bytes_read"] = self.bytes_read
        return d


def exit_status(results: Iterable[ScanResult], *, strict: bool = False) -> int:
    """The ``ckptool scan`` exit status of several files: the worst file decides, in the order dangerous (1),
    unreadable (2), needs trust (4), safe (0); with ``strict``: unsafe (1), unreadable (2), safe (0)."""
    codes = {r.strict_exit_code if strict else r.exit_code for r in results}
    return next((c for c in (1, 2, 4) if c in codes), 0)


# ------------------------------------------------------------------------------------------------ scanning
_PICKLE_SUFFIXES = (".pkl", ".debug_pkl", ".pickle")
_ZIP_LOCAL = b"PK\x03\x04"
_ZIP_EOCD = b"PK\x05\x06"
_LEGACY_MAGIC = formats.LEGACY_MAGIC_PREFIX
MAX_ZIP_DEPTH = 3
MAX_TAR_MEMBERS = 10_000
MAX_PICKLES_IN_A_ROW = 10_000
#: a file's first byte starts a pickle only if it is an opcode a pickle can begin with
_PICKLE_FIRST = frozenset(b"\x80(.012NQR}abdel]ostu)\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94"
                          b"KhqJjMGUCXBT\x8a\x8b\x8c\x8d\x8e\x96ILFSVPgpci")


class _Scanner:
    def __init__(self, res: ScanResult) -> None:
        self.res = res
        self.torchscript = False
        self._globals: dict[str, GlobalFinding] = {}

    # -- recording -------------------------------------------------------------------------------------------
    def record(self, finding: PickleFinding) -> None:
        self.res.pickles.append(finding)
        for name in finding.globals:
            g = self._globals.get(name)
            if g is None:
                g = self._globals[name] = GlobalFinding(name, *classify_global(name, torchscript=self.torchscript))
                self.res.globals.append(g)
            if finding.where not in g.where:
                g.where.append(finding.where)

    def _unreadable_member(self, label: str, is_pickle: bool, err: Exception) -> None:
        """A zip member that could not be read: a finding for a pickle member, a note for anything else."""
        if is_pickle:
            self.record(PickleFinding(label, 0, [], str(err)))
        else:
            self.note(f"member {label} could not be read ({err})")

    def note(self, text: str) -> None:
        self.res.notes.append(text)

    # -- one pickle ------------------------------------------------------------------------------------------
    def parse(self, buf: PickleBuffer, pos: int, where: str, *, required: bool = True) -> int | None:
        """Read the pickle at ``buf[pos]``; record it; return the offset after its STOP, or None if it failed.
        A failed optional pickle (data after the last pickle) is recorded only when it named a global."""
        try:
            _root, up, end = load_pickle_at(buf, pos, where)
        except CkptError as e:
            names = self._globals_before_failure(buf, pos, where, e)
            if required or names:
                self.record(PickleFinding(where, pos, names, str(e)))
            return None
        self.record(PickleFinding(where, pos, [qualified_name(m, n) for m, n in up.globals_seen]))
        return end

    def _globals_before_failure(self, buf: PickleBuffer, pos: int, what: str, e: CkptError) -> list[str]:
        up = getattr(e, "unpickler", None)
        if up is not None:  # unpickling itself failed: what it named so far
            return [qualified_name(m, n) for m, n in up.globals_seen]
        stop = getattr(e, "offset", None)
        if stop is None:
            return []
        try:  # refused by the checks: read the flat stream (frames ignored) as far as it is sound
            end = check_pickle(buf, pos, what=what, exact=False, strict_frames=False)
            seen = partial_globals(buf, pos, end)
        except CkptError as e2:
            seen = partial_globals(buf, pos, getattr(e2, "offset", stop))
        return [qualified_name(m, n) for m, n in seen]

    def pickles_in_a_row(self, buf: PickleBuffer, pos: int, where: str, *, first_required: bool = True) -> int | None:
        """Read pickles one after another from ``pos`` while the data looks like one; return the offset where
        reading stopped (``len(buf)`` when everything was read), or None when the first, required, pickle failed."""
        n = 0
        size = len(buf)
        while pos < size and n < MAX_PICKLES_IN_A_ROW:
            if n and (buf[pos] not in _PICKLE_FIRST or buf[pos:pos + 4] == _ZIP_LOCAL):
                return pos
            label = where if n == 0 else f"{where} (pickle {n + 1} in a row, byte {pos})"
            end = self.parse(buf, pos, label, required=n == 0 and first_required)
            if end is None:
                return None if n == 0 and first_required else pos
            pos = end
            n += 1
        return pos

    # -- containers ------------------------------------------------------------------------------------------
    def any(self, buf: PickleBuffer, where: str, depth: int, f: BinaryIO | None = None) -> str:
        """Scan ``buf`` (bytes or mmap, optionally its open file ``f``) as whatever its bytes say it is."""
        head = bytes(buf[:512])
        if head.startswith((_ZIP_LOCAL, _ZIP_EOCD)):
            return self.zip(buf, where, depth, f)
        if head.startswith(_LEGACY_MAGIC):
            self.legacy(buf, where, depth)
            return formats.TORCH_LEGACY
        if len(head) >= 262 and head[257:262] == b"ustar":
            self.tar(buf, where, depth)
            return "legacy-tar"
        if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] + 8 <= len(buf):
            return formats.SAFETENSORS
        if not head or head[0] not in _PICKLE_FIRST:
            raise _NotAPickle()
        self.pickle_file(buf, where, depth)
        return formats.PICKLE

    def pickle_file(self, buf: PickleBuffer, where: str, depth: int) -> None:
        end = self.parse(buf, 0, where or "pickle at byte 0")
        if end is not None and end < len(buf):
            self.trailing(buf, end, where, depth)

    def trailing(self, buf: PickleBuffer, pos: int, where: str, depth: int) -> None:
        """Data after the structures a loader reads: further pickles in a row, then possibly an appended zip."""
        rest = pos
        if buf[pos] in _PICKLE_FIRST and buf[pos:pos + 4] != _ZIP_LOCAL:
            rest = self.pickles_in_a_row(buf, pos, _join(where, f"data after the last pickle, byte {pos}"),
                                         first_required=False) or pos
        start = _zip_start(buf, rest)
        if start is not None:
            if start > rest:
                self.note(f"{start - rest} bytes at byte {rest}{_in(where)} are not a pickle")
            self.note(f"a zip archive is appended at byte {start}{_in(where)} (zipfile-based tools read it instead)")
            try:
                self.zip(bytes(buf[start:]), _join(where, f"appended zip at byte {start}"), depth + 1)
            except CkptError as err:
                self.note(f"the zip appended at byte {start}{_in(where)} could not be read ({err})")
        elif rest < len(buf):
            self.note(f"{len(buf) - rest} bytes at byte {rest}{_in(where)} are not a pickle (no loader reads them)")

    def zip(self, buf: PickleBuffer, where: str, depth: int, f: BinaryIO | None = None) -> str:
        if depth > MAX_ZIP_DEPTH:
            raise CorruptCheckpointError(f"zips nested more than {MAX_ZIP_DEPTH} deep{_in(where)}")
        if f is None:
            f = io.BytesIO(buf if isinstance(buf, bytes) else bytes(buf))
        size = len(buf)
        entries = read_directory(f, size, where or self.res.path)
        if not entries:
            raise CorruptCheckpointError(f"empty zip archive{_in(where)}")
        first = entries[0].name
        top = first.split("/", 1)[0] + "/" if "/" in first else ""
        names = [e.name for e in entries]
        self.torchscript = self.torchscript or (depth == 0 and top + "constants.pkl" in names)
        kind = "torchscript" if top + "constants.pkl" in names else (
            formats.TORCH_ZIP if top + "data.pkl" in names else "zip")
        seen: set[str] = set()
        for e in entries:
            if e.name in seen:
                self.note(f"the zip{_in(where)} holds two members named {e.name!r}: loaders may read either; both "
                          "were scanned")
            seen.add(e.name)
        for e in entries:
            self.zip_member(f, e, top, kind, where, depth)
        end = _zip_end(buf)
        if end is not None and end < size:
            self.trailing(buf, end, where, depth)
        return kind

    def zip_member(self, f: BinaryIO, e: ZipEntry, top: str, kind: str, where: str, depth: int) -> None:
        name = e.name
        rel = name[len(top):] if name.startswith(top) else name
        label = _join(where, name)
        if name.endswith("/"):
            return
        storage = kind != "zip" and rel.startswith(("data/", "constants/", ".data/", "code/"))
        is_pickle = name.endswith(_PICKLE_SUFFIXES)
        if storage and not is_pickle:
            return  # tensor bytes and TorchScript source: no loader unpickles them
        try:
            head = read_member_head(f, e, label)
        except CkptError as err:
            self._unreadable_member(label, is_pickle, err)
            return
        nested = head.startswith(_ZIP_LOCAL)
        looks_pickled = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
        if not (is_pickle or nested or looks_pickled):
            return
        try:
            data = read_member(f, e, label, check_crc=False)
        except CkptError as err:
            self._unreadable_member(label, is_pickle, err)
            return
        if (e.crc & 0xFFFFFFFF) != zlib.crc32(data):
            self.note(f"member {label} fails its CRC-32 check (torch does not check it); scanned anyway")
        if nested:
            self.note(f"member {label} is a zip archive; scanned it too")
            try:
                self.zip(data, label, depth + 1)
            except CkptError as err:
                self.note(f"the zip in member {label} could not be read ({err})")
            return
        rest = self.pickles_in_a_row(data, 0, label, first_required=is_pickle)
        if rest is not None and rest < len(data):
            self.trailing(data, rest, label, depth)

    def legacy(self, buf: PickleBuffer, where: str, depth: int) -> None:
        """The five pickles of a torch legacy stream (torch/serialization.py ``_legacy_load``), then its storage
        blocks, to find data after them."""
        pos = 0
        main_storages: dict[str, StorageRef] = {}
        keys: object = None
        for i, part in enumerate(("magic number", "protocol version", "sys_info", "main pickle", "storage keys")):
            label = _join(where, f"legacy {part}")
            try:
                root, up, end = load_pickle_at(buf, pos, label, storages=main_storages if i == 3 else None)
            except CkptError as e:
                self.record(PickleFinding(label, pos, self._globals_before_failure(buf, pos, label, e), str(e)))
                return
            self.record(PickleFinding(label, pos, [qualified_name(m, n) for m, n in up.globals_seen]))
            if i == 4:
                keys = root
            pos = end
        # the storage blocks: 8-byte element count + numel * element size bytes each, in key order
        if not isinstance(keys, list):
            self.note("the legacy storage key list is not a list; data after it was not checked")
            return
        for key in keys:
            ref = main_storages.get(str(key)) if isinstance(key, (str, int)) else None
            head = bytes(buf[pos:pos + 8])
            if ref is None or len(head) != 8:
                self.note("the legacy storage blocks do not match the storage keys; data after them was not checked")
                return
            numel = struct.unpack("<q", head)[0]
            elsize = STORAGE_TYPES.get(ref.storage_type_name, ("", 1))[1]
            if numel < 0 or pos + 8 + numel * elsize > len(buf):
                self.note("a legacy storage block runs past the end of the file; data after it was not checked")
                return
            pos += 8 + numel * elsize
        if pos < len(buf):
            self.trailing(buf, pos, where, depth)

    def tar(self, buf: PickleBuffer, where: str, depth: int) -> None:
        """A torch legacy tar (torch < 0.4): ``torch.load`` unpickles its ``sys_info``, ``pickle``, ``storages``
        and ``tensors`` members; every member is read as pickles in a row."""
        try:
            with tarfile.open(fileobj=io.BytesIO(buf if isinstance(buf, bytes) else bytes(buf)), mode="r:") as tf:
                self._tar_members(tf, where, depth)
        except tarfile.TarError as e:
            raise CorruptCheckpointError(f"damaged tar archive{_in(where)} ({e})") from e

    def _tar_members(self, tf: tarfile.TarFile, where: str, depth: int) -> None:
        try:
            self._read_tar_members(tf, where, depth)
        except tarfile.TarError as e:
            self.note(f"the tar archive{_in(where)} is damaged after its readable members ({e})")

    def _read_tar_members(self, tf: tarfile.TarFile, where: str, depth: int) -> None:
        for i, member in enumerate(tf):
            if i >= MAX_TAR_MEMBERS:
                self.note(f"more than {MAX_TAR_MEMBERS} tar members; the rest were not scanned")
                break
            if not member.isfile():
                continue
            fobj = tf.extractfile(member)
            data = fobj.read() if fobj is not None else b""
            label = _join(where, f"tar member {member.name}")
            known = member.name in ("sys_info", "pickle", "storages", "tensors")
            if data[:1] and data[0] in _PICKLE_FIRST:
                rest = self.pickles_in_a_row(data, 0, label, first_required=known)
                if rest is not None and rest < len(data) and member.name not in ("storages", "tensors"):
                    self.trailing(data, rest, label, depth)
            elif known:
                self.record(PickleFinding(label, 0, [], "not a pickle"))


class _NotAPickle(Exception):
    pass


def _in(where: str) -> str:
    return f" in {where}" if where else ""


def _join(where: str, name: str) -> str:
    return f"{where}!{name}" if where else name


def _eocd(buf: PickleBuffer) -> tuple[int, int, int, int] | None:
    """``(eocd offset, central directory size, central directory offset, comment length)`` of the last end of
    central directory record in the last 64 KiB of ``buf``, or None."""
    size = len(buf)
    lo = max(0, size - (65535 + 22))
    tail = bytes(buf[lo:size])
    at = tail.rfind(_ZIP_EOCD)
    if at < 0 or at + 22 > len(tail):
        return None
    _sig, _d, _dcd, _n, _count, cd_size, cd_offset, clen = struct.unpack_from("<IHHHHIIH", tail, at)
    return lo + at, cd_size, cd_offset, clen


def _zip_start(buf: PickleBuffer, pos: int) -> int | None:
    """Where a zip appended after ``pos`` starts (what ``zipfile`` computes: end record - directory size -
    directory offset), or None."""
    found = _eocd(buf)
    if found is None:
        return None
    eocd_at, cd_size, cd_offset, _clen = found
    start = eocd_at - cd_size - cd_offset
    if start < pos or bytes(buf[start:start + 4]) != _ZIP_LOCAL:
        return None
    return start


def _zip_end(buf: PickleBuffer) -> int | None:
    found = _eocd(buf)
    return None if found is None else found[0] + 22 + found[3]


def scan_file(path: str | os.PathLike[str]) -> ScanResult:
    """Scan one file: every pickle in it (see the module docstring), each global classified.

    Reads the file without importing or running anything from it, in time and memory bounded by its size. Problems
    with the file's content never raise: they make the result's ``verdict`` ``error`` (with ``error`` or a
    pickle's ``error`` saying what happened), or ``dangerous`` when a dangerous global was found first.

    Returns:
        A :class:`ScanResult`; its ``exit_code`` is 0 (safe), 1 (dangerous), 2 (unreadable) or 4 (needs trust),
        its ``strict_exit_code`` 0 (safe), 1 (unsafe) or 2 (unreadable).
    """
    path = os.fspath(path)
    res = ScanResult(path)
    sc = _Scanner(res)
    start = source.bytes_transferred()
    try:
        formats.check_readable(path)
        # a URL: the zip / safetensors paths read by range (its directory, pickles and headers); others are copied
        with source.open_binary(path) as f, source.whole_view(f, lazy=_indexed) as buf:
            res.format = sc.any(buf, "", 0, f)
            if res.format == formats.SAFETENSORS:
                read_header(path)
    except _NotAPickle:
        res.error = _not_a_pickle(path)
    except CkptError as e:
        res.error = str(e)
    except RecursionError:
        res.error = f"{path}: nested too deeply to scan"
    if res.format == formats.PICKLE and res.pickles and res.pickles[0].error and not res.globals:
        res.error = _not_a_pickle(path)  # a PNG starts with a byte that is also an opcode: say what it is
    if res.format in ("zip", formats.TORCH_ZIP) and not res.pickles and not res.error:
        res.notes.append("the zip holds no pickle")
    if source.is_url(path):
        res.bytes_read = source.bytes_transferred() - start
    return res


def _indexed(view: RangeView) -> bool:
    """True for the layouts scanned through their index, which a remote file gives by range requests: safetensors
    (its header) and a zip with nothing after its end record (its directory and members). Anything else is walked
    from the start (pickles in a row, data appended after a zip) and read whole."""
    head = view[:512]
    if head[8:9] == b"{":
        return True
    # _zip_end only takes len() and slices, which a RangeView gives by range requests
    return head.startswith((_ZIP_LOCAL, _ZIP_EOCD)) and _zip_end(cast("PickleBuffer", view)) == len(view)


def _not_a_pickle(path: str) -> str:
    try:
        formats.detect_format(path)
    except CkptError as e:
        return str(e)
    return f"{path} is not a pickle, a torch checkpoint or safetensors; nothing to scan"


#: file name endings scanned inside a directory (explicit file arguments are always scanned)
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".jit", ".tar", ".zip", ".safetensors",
                       ".model", ".pts", ".torchscript", ".mar", ".npy", ".joblib", ".dat", ".data", ".distcp")


def iter_paths(paths: Iterable[str | os.PathLike[str]]) -> Iterator[str]:
    """The files to scan: each file as given, and in each directory (recursively, sorted) the files whose name ends
    like a checkpoint or whose first bytes are a zip, a pickle protocol 2-5 header or a legacy torch stream.

    Raises:
        UsageError: a path does not exist.
    """
    for given in paths:
        p = os.fspath(given)
        if source.is_url(p):  # one remote file (folders are walked only on disk)
            if source.kind(p) != "file":
                raise UsageError(f"{p}: no such file; check the URL (give a file, not a folder)")
            yield p
            continue
        if not os.path.exists(p):
            raise UsageError(f"{p}: no such file or directory; check the path")
        if not os.path.isdir(p):
            yield p
            continue
        for root, dirs, files in os.walk(p):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                if os.path.islink(full) and not os.path.isfile(full):
                    continue
                if name.lower().endswith(CHECKPOINT_SUFFIXES) or _looks_like_checkpoint(full):
                    yield full


def _looks_like_checkpoint(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(_ZIP_LOCAL) or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def scan(paths: Iterable[str | os.PathLike[str]]) -> list[ScanResult]:
    """:func:`scan_file` for every file of :func:`iter_paths` (files as given, directories walked).

    Raises:
        UsageError: a path does not exist.
    """
    return [scan_file(p) for p in iter_paths(paths)]
