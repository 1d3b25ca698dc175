"""``ckptool scan`` of a ``torch.distributed.checkpoint`` (DCP) folder, read the way DCP's own reader reads it.

torch's ``FileSystemReader`` (torch/distributed/checkpoint/filesystem.py) unpickles ``.metadata`` with
``pickle.load``, then reads each record of its ``storage_data`` (a ``_StorageInfo``: ``relative_path``, ``offset``,
``length``) from the ``__<rank>_<n>.distcp`` files: a tensor chunk is ``torch.save`` bytes it reads with
``torch.load(weights_only=True)`` (raw bytes when the folder was saved in safetensors serialization), a non-tensor
entry (``BYTE_IO``) ``torch.save`` bytes that ``DefaultLoadPlanner`` reads with ``torch.load(weights_only=False)``.

So scanning a folder reads, with the restricted unpickler and nothing else:

* ``.metadata``, where DCP's record classes and ``pathlib`` paths are allowed as data
  (:func:`ckptool.model.allowlist.classify_global` with ``dcp_metadata=True``) and every other global is rated as
  anywhere else; pickles after it are hidden pickles;
* every record's byte range, tensor chunk or non-tensor entry alike and with the same (ordinary) rules: as the
  ``torch.save`` zip it is (its ``data.pkl``, never its tensor bytes), or, when it is not a zip and starts like a
  pickle, as the pickle ``torch.load`` would unpickle from its first byte (any protocol). Which records are
  non-tensor entries is decided by the entry's class (:func:`ckptool.formats.dcp.entry_kind`), but a pickle can
  BUILD an entry twice and change its class on the way, so no record is skipped for being a tensor's; an entry of
  another class makes the folder unreadable (its records are still scanned); a range past the end of its file,
  outside the folder, or not a ``torch.save`` record for a non-tensor entry makes the folder unreadable; a record
  DCP transformed (``transform_descriptors``) cannot be checked;
* the bytes of a ``.distcp`` file that no record names (DCP never reads them) are noted, and scanned as hidden
  pickles when they look like a pickle or a zip; a ``.distcp`` file no record names is noted.
"""

from __future__ import annotations

import mmap
import os

from ckptool import _source as source
from ckptool.errors import CkptError, NotACheckpointError, TruncatedError
from ckptool.formats.dcp import METADATA_FILE, DcpItem, read_dcp_metadata
from ckptool.scanning.byte_windows import ZIP_LOCAL, Window
from ckptool.scanning.pickles import Scanner, failed
from ckptool.scanning.results import PickleFinding, ScanResult
from ckptool.scanning.shipped_code import CodeScanner
from ckptool.scanning.tar import PICKLE_FIRST

__all__ = ["DCP_FORMAT", "scan_dcp_folder"]

DCP_FORMAT = "dcp"
_PICKLE_HEADS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def scan_dcp_folder(folder: str | os.PathLike[str], part: str | None = None) -> ScanResult:
    """Scan a DCP folder (see the module docstring); ``part`` limits the report to ``.metadata`` or one
    ``.distcp`` file (the metadata is still read to find that file's records).

    Never raises for the folder's content: problems make the result unreadable (``error``), or dangerous when a
    dangerous global was found. Returns a :class:`~ckptool.scanning.pickles.ScanResult` with format ``dcp``.
    """
    folder = os.fspath(folder)
    res = ScanResult(folder if part is None else os.path.join(folder, part), DCP_FORMAT)
    sc = CodeScanner(res)  # also the code in each zip it reads (scanning/shipped_code.py)
    problems: list[str] = []
    if part in (None, METADATA_FILE):
        _scan_metadata_pickle(sc, os.path.join(folder, METADATA_FILE), problems)
    try:
        meta = read_dcp_metadata(folder, strict=False)
        items = meta.items()
        problems += meta.problems
    except CkptError as e:
        (res.incomplete if isinstance(e, TruncatedError) else problems).append(str(e))
        res.error = "; ".join(problems) or None
        return res
    if part == METADATA_FILE:
        res.error = "; ".join(problems) or None
        return res
    by_file: dict[str, list[DcpItem]] = {}
    for it in items:
        rel = it.relative_path
        if rel is None:
            problems.append(f".metadata: the storage record of {it.fqn!r} is malformed; the folder is damaged")
        elif os.path.isabs(rel) or os.path.normpath(rel).startswith(".."):
            problems.append(f".metadata: the record of {it.fqn!r} points outside the folder ({rel!r}); DCP's reader "
                            "would read that file")
        else:
            by_file.setdefault(rel, []).append(it)
    for rel in sorted(by_file):
        if part is None or rel == part:
            _scan_data_file(sc, folder, rel, by_file[rel], problems)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".distcp") and name not in by_file and part in (None, name):
            sc.note(f"{name} is named by no record of .metadata: DCP's reader never reads it")
    res.error = "; ".join(problems) or None
    return res


def _scan_metadata_pickle(sc: Scanner, path: str, problems: list[str]) -> None:
    """``.metadata``: its first pickle under the DCP metadata rules, data after it as hidden pickles."""
    try:
        with source.open_regular(path, "the DCP .metadata") as f:
            if os.fstat(f.fileno()).st_size == 0:
                problems.append(f"{path} is empty; the folder is damaged")
                return
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except NotACheckpointError as e:
        problems.append(str(e))
        return
    except OSError as e:
        problems.append(f"{path}: cannot read it ({e.strerror or e})")
        return
    try:
        sc.loaded.add(METADATA_FILE)
        sc.dcp_metadata = True
        try:
            end = sc.parse(buf, 0, METADATA_FILE)
        finally:
            sc.dcp_metadata = False
        if end is not None and end < len(buf):
            sc.trailing(buf, end, METADATA_FILE, 0)
    finally:
        buf.close()


def _scan_data_file(sc: Scanner, folder: str, rel: str, items: list[DcpItem], problems: list[str]) -> None:
    path = os.path.join(folder, rel)
    if os.path.exists(path) and source.special_kind(os.stat(path).st_mode) is not None:
        problems.append(f".metadata names {rel!r}, which is {source.special_kind(os.stat(path).st_mode)}, not a "
                        "regular file: ckptool does not read it (it could block forever)")
        return
    if not os.path.isfile(path):
        sc.res.incomplete.append(f".metadata names {rel!r}, which is missing: the folder is incomplete")
        return
    with source.open_regular(path, "a DCP data file") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            sc.res.incomplete.append(f"{rel} is empty but .metadata names {len(items)} records in it; the folder is "
                                     "incomplete")
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        covered: list[tuple[int, int]] = []
        for it in sorted(items, key=lambda i: i.offset):
            kind = "entry" if it.is_bytes else "tensor"
            label = f"{rel} bytes {it.offset}-{it.offset + it.length} ({kind} {it.fqn!r})"
            if it.offset < 0 or it.length < 0 or it.offset + it.length > size:
                sc.res.incomplete.append(f"{label}: the range runs past the end of the {size}-byte file (truncated?)")
                continue
            covered.append((it.offset, it.offset + it.length))
            if it.transforms:
                why = (f"transformed by DCP ({', '.join(it.transforms)}): ckptool cannot undo it to check what "
                       "it holds")
                if it.is_bytes:
                    sc.loaded.add(label)
                    sc.record(PickleFinding(label, it.offset, [], why))
                else:
                    sc.note(f"{label}: {why} (torch.load reads tensor chunks with weights_only=True)")
                continue
            _scan_item(sc, Window(mm, it.offset, it.length), it, label)
        _gaps(sc, mm, rel, size, covered)
    finally:
        mm.close()


def _scan_item(sc: Scanner, w: Window, it: DcpItem, label: str) -> None:
    head = w[:8]
    try:
        if head.startswith(ZIP_LOCAL):
            if sc.zip(w, label, 1, loaded=True).bare_zip and it.is_bytes:
                sc.record(PickleFinding(label, it.offset, [], "a zip without data.pkl, not a torch.save record"))
            return
    except CkptError as e:
        sc.loaded.add(label)
        sc.record(failed(label, it.offset, [], e))
        return
    # torch.load of bytes that are not a zip unpickles them from byte 0 (any protocol); DCP hands it a BytesIO, for
    # which _legacy_load never tries the legacy tar layout (that needs a real file)
    if head[:1] and head[0] in PICKLE_FIRST:
        sc.pickle_file(w[:], label, 1)
    elif it.is_bytes:
        sc.loaded.add(label)
        sc.record(PickleFinding(label, it.offset, [], "not a torch.save record (neither a zip nor a pickle); the "
                                                      "folder is damaged"))
    # else: a tensor chunk of raw bytes (safetensors serialization) whose first byte is no pickle opcode: an
    # unpickler given it stops at once, running nothing


def _gaps(sc: Scanner, mm: mmap.mmap, rel: str, size: int, covered: list[tuple[int, int]]) -> None:
    """Note the bytes of ``rel`` that no record names, and scan them when they look like a pickle or a zip."""
    pos = 0
    gaps = []
    for a, b in sorted(covered):
        if a > pos:
            gaps.append((pos, a))
        elif a < pos:
            sc.note(f"{rel}: records overlap at byte {a}")
        pos = max(pos, b)
    if pos < size:
        gaps.append((pos, size))
    for a, b in gaps:
        label = f"{rel} bytes {a}-{b} (named by no record)"
        sc.note(f"{rel}: bytes {a}-{b} are named by no record of .metadata (DCP's reader never reads them)")
        w = Window(mm, a, b - a)
        head = w[:8]
        try:
            if head.startswith(ZIP_LOCAL):
                sc.zip(w, label, 1)
            elif head.startswith(_PICKLE_HEADS) or (head[:1] and head[0] in PICKLE_FIRST and b - a < 1 << 20):
                sc.pickles_in_a_row(w[:], 0, label, first_required=False)
        except CkptError as e:
            sc.note(f"{label} could not be read ({e})")
