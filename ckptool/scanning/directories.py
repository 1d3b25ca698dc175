"""The central directories of a zip that ``ckptool scan`` walks: torch's reader's, Python's ``zipfile``'s, and the
one a 32-bit end record points to where it differs from the ZIP64 record's. Loaders disagree about hostile zips;
the scan reads the members of every directory any of them would read, and notes where they differ."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import repeat
from operator import attrgetter, mul
from typing import Any, BinaryIO, cast

from ckptool.errors import CkptError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import STORAGE_TYPES
from ckptool.formats.nodes import StorageRef
from ckptool.formats.zipdir import (
    Directory,
    TorchRecords,
    ZipEntry,
    plain_directory,
    read_directory,
    zipfile_directory,
)
from ckptool.scanning.tar import inside

__all__ = ["first_of_group", "record_problem", "zip_directories"]


def zip_directories(f: BinaryIO, size: int, where: str, path: str, top_file: bool, note: Callable[[str], None]
                    ) -> tuple[list[ZipEntry] | None, list[ZipEntry]]:
    """torch's central directory of the zip in ``f`` (``size`` bytes at ``where`` in the file ``path``; None when
    torch's reader refuses it) and the union of it with ``zipfile``'s
    (:func:`ckptool.formats.zipdir.zipfile_directory`) and the 32-bit end record's, torch's entries first;
    ``note`` is told where the readers disagree. ``top_file``: the zip is the file itself, whose directory format
    detection and the readers parsed already (cached per version).

    Raises:
        CorruptCheckpointError: neither reader can read the directory.
    """
    label = where or path
    torch_view, torch_err = _torch_directory(f, size, label, path if top_file else None)
    try:
        zf_view: list[ZipEntry] | None = zipfile_directory(f, size, label, torch_view)
    except CkptError as err:
        if torch_err is not None:
            raise torch_err from None
        assert torch_view is not None
        note(f"Python's zipfile cannot read the zip{inside(where)} ({err}); torch's reader can: its members "
             "were scanned")
        return torch_view, list(torch_view)
    assert zf_view is not None
    if torch_view is None:
        note(f"torch's zip reader refuses the zip{inside(where)} ({torch_err}); Python's zipfile reads it: "
             "its members were scanned")
        return None, zf_view
    extra: list[ZipEntry] = []
    if zf_view is not torch_view:  # (the same directory, the common case: no set of its 50,000 names to build)
        have = {(e.name, e.header_offset) for e in torch_view}
        extra = [e for e in zf_view if (e.name, e.header_offset) not in have]
        if extra or len(zf_view) != len(torch_view):
            z = cast(Directory, zf_view).end
            note(f"torch's zip reader and Python's zipfile read different central directories{inside(where)} "
                 f"(torch: {len(torch_view)} entries at byte {torch_view.end.offset}; zipfile: "
                 f"{len(zf_view)} entries at byte {z.offset}): the members of both were scanned")
    return torch_view, list(torch_view) + extra + _plain_extra(f, size, where, label, torch_view, extra, note)


def _torch_directory(f: BinaryIO, size: int, label: str, top_file: str | None
                     ) -> tuple[Directory | None, CkptError | None]:
    """torch's central directory of the zip (``top_file``: the file itself, read through the per-version cache), or
    the error for which torch's reader refuses it."""
    try:
        got = formats.zip_entries(top_file) if top_file is not None else read_directory(f, size, label)
        return (got if isinstance(got, Directory) else read_directory(f, size, label)), None
    except CkptError as err:
        return None, err


def _plain_extra(f: BinaryIO, size: int, where: str, label: str, torch_view: Directory, extra: list[ZipEntry],
                 note: Callable[[str], None]) -> list[ZipEntry]:
    """The entries (neither torch's nor ``extra``, zipfile's others) of the central directory the 32-bit end
    record points to, where it is another than the ZIP64 record's (which torch and zipfile read) and readers that
    take the ZIP64 record only when the 32-bit one is full would read it; a note when it has entries torch's
    lacks."""
    t = torch_view.end
    if t.plain is None or t.plain == (t.entries, t.size, t.offset) or 0xFFFF in t.plain[:1] or \
            0xFFFFFFFF in t.plain[1:]:
        return []
    try:
        plain = plain_directory(f, size, label)
    except CkptError:
        plain = Directory()
    have = {(e.name, e.header_offset) for e in torch_view}
    more = [e for e in plain if (e.name, e.header_offset) not in have]
    if not more:
        return []
    note(f"the zip's 32-bit end record{inside(where)} points to another central directory than its "
         f"ZIP64 end record (which torch and zipfile read): its {len(plain)} entries were scanned too")
    seen = {(e.name, e.header_offset) for e in extra}
    return [e for e in more if (e.name, e.header_offset) not in seen]


def first_of_group(shared: dict[tuple[int, int, int, int], list[str]] | None, e: ZipEntry, label: str) -> bool:
    """Add ``label`` to the members sharing ``e``'s local header, sizes and method; True for the first of them
    (the one read)."""
    if shared is None:
        return True
    group = shared.setdefault((e.header_offset, e.compress_size, e.method, e.file_size), [])
    group.append(label)
    return len(group) == 1


def record_problem(recs: TorchRecords, template: str, storages: Mapping[str, Any]) -> str | None:
    """Why torch's loader fails on the storage records a ``data.pkl`` names (``storages``: key ->
    :class:`~ckptool.formats.nodes.StorageRef`, as the restricted unpickler records them): a record the zip lacks
    (``template``: ``data/{key}``), or one holding fewer bytes than its persistent id declares (``numel`` times the
    element size of its storage type, :data:`~ckptool.formats.dtypes.STORAGE_TYPES`: torch reads that many, as
    :func:`ckptool.formats.torchfile.check_storage_records` checks for the readers). The readers refuse such a file
    as damaged, so the scan cannot call it safe. None when every record is there and whole."""
    refs = list(storages.values())
    numels = list(map(attrgetter("numel"), refs)) if set(map(type, refs)) <= {StorageRef} else []
    if len(numels) != len(refs) or not set(map(type, numels)) <= {int}:  # hostile: no StorageRef, a numel no int
        numels = [r.numel if isinstance(r, StorageRef) and type(r.numel) is int else 0 for r in refs]
    if refs and isinstance(refs[0], StorageRef) and \
            len(set(map(id, map(attrgetter("storage_type"), refs)))) == 1:  # one storage type: one element size
        needs = dict(zip(storages, map(mul, numels, repeat(_element_size(refs[0])))))
    else:
        needs = {k: x * _element_size(r) for (k, r), x in zip(storages.items(), numels)}
    missing, short = recs.lacking(template, needs)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return (f"storage {missing[0]!r} has no record {template.format(key=missing[0])} in the archive{more}; the "
                "file is damaged or incomplete")
    if short:
        more = f" (and {len(short) - 1} more)" if len(short) > 1 else ""
        return (f"storage {short[0]!r} declares {needs[short[0]]} bytes but its record "
                f"{template.format(key=short[0])} holds fewer{more}; the file is damaged or hostile")
    return None


def _element_size(ref: Any) -> int:
    """The bytes of one element of ``ref``'s storage type (1 for an untyped or unknown one)."""
    return STORAGE_TYPES.get(ref.storage_type_name if isinstance(ref, StorageRef) else "", ("", 1))[1]
