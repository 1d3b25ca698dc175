"""``ckptool.ops.rewrite.package``: re-tag the storages of a ``torch.package`` archive, running none of its code.

A ``torch.package.PackageExporter`` archive (layout: :mod:`ckptool.formats.torch_package`) names each storage in its
pickles by the persistent id ``('storage', <storage class>, key, location, numel)``; ``PackageImporter.load_pickle``
restores the storage on the device ``location`` names unless a ``map_location`` says otherwise, as ``torch.load``
does. :func:`remap_package` rewrites those tags:

* every member of the archive that is a pickle (the ``*.pkl`` resources, and any other resource outside ``.data/``
  that begins like one: ``save_pickle`` takes any resource name) is read with ckptool's restricted unpickler
  (nothing imported or called); each persistent id is kept as it was written but for its location tag, chosen by
  :func:`ckptool.model.devices.location_function` (``--to`` / ``--map``, the same checks as remap of a torch
  file); a pickle whose tags change is written anew with :mod:`ckptool.formats.pickler` in the protocol it had;
* every other member (the modules' source, the ``.data/<key>.storage`` records, ``extern_modules``, text and
  binary resources, and the pickles whose tags do not change) is copied byte for byte, under the same name, in the
  same order, into a zip of the layout ``PackageExporter`` writes (torch's ``PyTorchStreamWriter``: records stored
  under the archive's top folder, 64-byte aligned: :class:`ckptool.formats.torchzip.TorchZipWriter`).

What cannot be rewritten faithfully is refused before anything is written: a pickle holding a persistent id other
than a storage's (``('reduce_package', ...)``: an object that a function of the package rebuilds, a TorchScript
module among them, whose own tags ckptool cannot see), a TorchScript part (``.data/ts_code/``), a storage named by two
different persistent ids in one pickle, a BUILD on a class, values the pickle writer cannot express, members outside
the archive's top folder or named twice. The output is atomic (:func:`ckptool._fileio.atomic_output`); the input is
never modified (``in_place`` replaces it by a renamed new file).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptool import _source as source
from ckptool._fileio import atomic_output, file_mode, same_file
from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.nodes import CLASS_BUILD, GlobalMeta, StorageRef, qualified_name, split_use
from ckptool.formats.pickle_check import call_with_stack, check_pickle, tuple_levels
from ckptool.formats.torch_package import MARKER, Package, check_storages
from ckptool.formats.unpickler import PICKLE_ERRORS, RestrictedUnpickler
from ckptool.model.devices import LocationFn, location_function
from ckptool.ops.rewrite.stream import ProgressFn, WriteResult
from ckptool.readers import Opened
from ckptool.readers.structures import ENCRYPTED, ZipEntry, data_offset, read_member_head
from ckptool.writers.encoders import PicklerError, TorchZipWriter, dumps

__all__ = ["remap_package"]

#: the first bytes of a pickle of protocol 2 to 5 (``PROTO n``): a resource that begins so is read as a pickle
_PROTO_HEADS = tuple(bytes((0x80, n)) for n in range(2, 6))
#: the folder ``PackageExporter`` writes a TorchScript module's code and constants into (with ``reduce_package``)
_TS_CODE = ".data/ts_code/"


class _PackageUnpickler(RestrictedUnpickler):
    """The restricted unpickler (nothing imported or called) that also keeps every persistent id as the pickle wrote
    it: ``pids`` lists ``(pid, record)`` in the order the pickle names them, ``record`` the
    :class:`~ckptool.formats.nodes.StorageRef` (or other record) the restricted reader made of it."""

    def __init__(self, file: BinaryIO, *, storages: dict[str, StorageRef],
                 global_cache: dict[tuple[str, str], GlobalMeta]) -> None:
        super().__init__(file, storages=storages, global_cache=global_cache)
        record = self.persistent_load
        pids: list[tuple[Any, Any]] = []
        self.pids = pids

        def persistent_load(pid: Any) -> Any:
            rec = record(pid)
            pids.append((pid, rec))
            return rec

        self.persistent_load = persistent_load  # type: ignore[method-assign]
        # the C unpickler looks the callback up in __init__: look it up again
        pickle.Unpickler.__init__(self, file, encoding="latin1")


@dataclass
class _Pickle:
    """One pickle member: its zip ``entry``, ``rel`` (its name below the top folder), node graph ``root``, pickle
    ``protocol``, the persistent ids as written (``pids``, see :class:`_PackageUnpickler`) and ``globals`` named
    (qualified, with the unsafe uses :func:`~ckptool.formats.nodes.use_key` records)."""

    entry: ZipEntry
    rel: str
    root: Any
    protocol: int
    pids: list[tuple[Any, Any]]
    globals: list[str]


def remap_package(opened: Opened, dst: str, to: str | None = None, mapping: Mapping[str, str] | None = None,
                  allow_missing: bool = False, progress: ProgressFn | None = None, *, renaming: bool = False
                  ) -> WriteResult:
    """Write a copy of the ``torch.package`` archive ``opened`` (:func:`ckptool.readers.open_checkpoint`) to ``dst``
    with its storages re-tagged: ``to`` every
    storage, ``mapping`` only the matching tags (:func:`ckptool.model.devices.location_function`); see the module
    docstring for what is rewritten and what is copied. ``dst`` may be ``src`` (in place: the permission bits are
    kept). ``progress(nbytes)`` is called as members are copied (bytes since the last call). ``renaming``: the
    caller also asked for key renamings (``--unwrap``, ``--strip-*``, ``--add-prefix``), which are refused.

    Returns a :class:`~ckptool.ops.rewrite.stream.WriteResult` (``format_in`` ``torch-package``, ``storages`` named by
    the
    pickles, ``retagged`` ``{(old, new): storage count}``, ``bytes_written``).

    Raises:
        UsageError: bad device strings, or both ``to`` and ``mapping``.
        DeviceNotFoundError: a ``mapping`` source matches no storage of the archive, unless ``allow_missing``.
        UnsupportedError: ``renaming`` (a package's pickles hold objects, not state_dict keys to rename); not a
            package with one top folder; a member ckptool cannot rewrite faithfully (``reduce_package`` ids,
            TorchScript code, a BUILD on a class, ...); nothing written.
        CorruptCheckpointError: a damaged archive, pickle or storage record.
        OutputError: writing ``dst`` failed (nothing left behind).
    """
    src = opened.target
    if renaming:
        raise UnsupportedError(f"{src} is a torch.package archive: its pickles hold objects, not state_dict keys to "
                               "rename; remap re-tags it without --unwrap / --strip-* / --add-prefix")
    entries, top = _members(src, opened.zip_entries())
    storages: dict[str, StorageRef] = {}
    with source.open_binary(src) as f:
        pickles = _read_pickles(opened, f, entries, top, storages)
    check_storages(Package(src, source.file_size(src), top, storages=storages),
                    {e.name[len(top):]: e for e in entries})
    fn = location_function(to, mapping, tags=[r.location for r in storages.values()], allow_missing=allow_missing,
                           where=src)
    new = {p.entry.name: _rewritten(p, src, fn) for p in pickles if _retags(p, fn)}
    res = WriteResult(src, dst, opened.format, storages=len(storages), retagged=_count(storages, fn))
    mode = file_mode(src) if same_file(src, dst) else None
    with source.open_binary(src) as f, atomic_output(dst, mode=mode) as out:
        w = TorchZipWriter(out, top, progress=progress)
        size = source.file_size(src)
        for e in entries:
            rel = e.name[len(top):]
            data = new.get(e.name)
            if data is not None:
                w.write_bytes(rel, data)
            else:
                _copy(w, f, e, rel, src, size)
        w.close()
        res.bytes_written = w.pos
    return res


def _members(src: str, entries: list[ZipEntry]) -> tuple[list[ZipEntry], str]:
    """The archive's members in directory order (``entries``, its central directory) and its top folder (with
    ``/``).

    Raises:
        UnsupportedError: not a ``torch.package`` archive with one top folder; a member outside that folder, a name
            used twice, a TorchScript part.
    """
    entries = list(entries)
    first = entries[0].name if entries else ""
    top = first.split("/", 1)[0] + "/" if "/" in first else ""
    if not top or not any(e.name == top + MARKER for e in entries):
        raise UnsupportedError(f"{src} is not a torch.package archive with one top folder (no {top}{MARKER} "
                               "record); `ckptool inspect` says what it is")
    seen: set[str] = set()
    for e in entries:
        if not e.name.startswith(top) or e.name == top:
            raise UnsupportedError(f"{src}: member {e.name!r} is outside the archive's folder {top!r} (a re-packed "
                                   "zip); ckptool writes every member under that folder, as PackageExporter does, so "
                                   "it cannot keep the member names; nothing written")
        if e.name in seen:
            raise UnsupportedError(f"{src}: member {e.name!r} is in the archive twice; which one a loader reads is "
                                   "not defined, so ckptool does not rewrite it; nothing written")
        seen.add(e.name)
        if e.name[len(top):].startswith(_TS_CODE):
            raise UnsupportedError(
                f"{src}: member {e.name!r} is TorchScript code packaged with a ScriptModule, whose storages "
                f"ckptool cannot re-tag; nothing written. {_ROUTE}")
    return entries, top


#: the way around a refusal: load in a trusted environment with torch
_ROUTE = ("Load it with torch.package.PackageImporter(path).load_pickle(package, resource, map_location='cpu') in a "
          "trusted environment (it runs the package's code) and export it again")


def _read_pickles(opened: Opened, f: BinaryIO, entries: list[ZipEntry], top: str,
                  storages: dict[str, StorageRef]) -> list[_Pickle]:
    """Every pickle member of the archive, read with the restricted unpickler, sharing ``storages`` (one record per
    storage key, as the exporter shares its storage context): the ``*.pkl`` members outside ``.data/``, and every
    other member there that begins like a pickle (``PROTO 2`` to ``5``) but the modules' ``.py`` sources.

    Raises:
        CorruptCheckpointError: a damaged pickle (a ``.pkl`` member, or a member that begins like a pickle: remap
            cannot tell whether it names storages), a storage declared twice differently.
        UnsupportedError: a persistent id other than a storage's (``reduce_package``), see :func:`_check_pids`.
    """
    src = opened.target
    cache: dict[tuple[str, str], GlobalMeta] = {}
    out: list[_Pickle] = []
    for e in entries:
        rel = e.name[len(top):]
        if rel.startswith(".data/") or rel.endswith(("/", ".py")):
            continue
        named = rel.endswith(".pkl")
        if not named and read_member_head(f, e, src, 2) not in _PROTO_HEADS:
            continue
        try:
            p = _load(bytes(opened.pickle_member(e, f)), e, rel, f"{e.name} in {src}", storages, cache)
        except CorruptCheckpointError as err:
            if named:
                raise
            raise UnsupportedError(f"{src}: member {e.name!r} begins like a pickle but ckptool cannot read it as one "
                                   f"({err}); remap cannot tell whether it names storages; nothing written. "
                                   f"{_ROUTE}") from err
        _check_pids(p, src)
        out.append(p)
    return out


def _load(data: bytes, e: ZipEntry, rel: str, what: str, storages: dict[str, StorageRef],
          cache: dict[tuple[str, str], GlobalMeta]) -> _Pickle:
    """Check (:func:`~ckptool.formats.pickle_check.check_pickle`) then read one pickle member, as
    :func:`ckptool.formats.unpickler.load_structure` does, keeping its persistent ids.

    Raises:
        CorruptCheckpointError: a truncated, malformed or hostile pickle, or bytes after its end.
        UnsupportedError: tuple nesting too deep to read safely.
    """
    check_pickle(data, 0, what=what, exact=True)
    up = _PackageUnpickler(io.BytesIO(data), storages=storages, global_cache=cache)
    try:
        root = call_with_stack(up.load, tuple_levels(data), what)
    except PICKLE_ERRORS as err:
        raise CorruptCheckpointError(f"{what} is corrupted or truncated ({type(err).__name__}: {err}); re-export "
                                     "the package") from err
    protocol = data[1] if data[:1] == b"\x80" else 2
    return _Pickle(e, rel, root, protocol, up.pids, [qualified_name(m, n) for m, n in up.globals_seen])


def _check_pids(p: _Pickle, src: str) -> None:
    """Refuse a pickle whose persistent ids remap cannot keep as written but for the location tag: an id that is
    not a storage's (``('reduce_package', ...)``, whose object a function of the package rebuilds, or any other
    kind, which ``PackageImporter`` would refuse), a storage id of other than the 5 fields ``PackageExporter``
    writes, or one storage named by two different ids (the importer would then load it twice).

    Raises:
        UnsupportedError: as above, naming the member and the route.
    """
    first: dict[int, tuple[Any, ...]] = {}
    for pid, rec in p.pids:
        if not isinstance(rec, StorageRef):
            kind = pid[0] if isinstance(pid, tuple) and pid else type(pid).__name__
            what = ("an object that a function of the package rebuilds (__reduce_package__: a TorchScript module, "
                    "a custom object), which ckptool neither runs nor rewrites" if kind == "reduce_package" else
                    "not a storage, which ckptool cannot rewrite")
            raise UnsupportedError(f"{src}: member {p.entry.name!r} holds a ({kind!r}, ...) persistent id: {what}; "
                                   f"nothing written. {_ROUTE}")
        if len(pid) != 5:
            raise UnsupportedError(f"{src}: member {p.entry.name!r} names storage {rec.key!r} with {len(pid)} "
                                   f"fields, not the 5 PackageExporter writes; nothing written. {_ROUTE}")
        seen = first.setdefault(id(rec), pid)
        if seen is not pid and [(type(x), x) for x in seen] != [(type(x), x) for x in pid]:
            raise UnsupportedError(f"{src}: member {p.entry.name!r} names storage {rec.key!r} by two different "
                                   f"persistent ids ({seen!r}, {pid!r}); nothing written. {_ROUTE}")


def _retags(p: _Pickle, fn: LocationFn | None) -> bool:
    """True when ``fn`` changes the location tag of a storage that ``p`` names."""
    return fn is not None and any(fn(rec.location) != rec.location for _pid, rec in p.pids)


def _rewritten(p: _Pickle, src: str, fn: LocationFn | None) -> bytes:
    """The bytes of pickle ``p`` with its storages' location tags rewritten by ``fn``, each persistent id otherwise
    as written (its key's type kept: ``PackageExporter`` writes int keys), in the pickle's own protocol.

    Raises:
        UnsupportedError: a BUILD on a class (class mutation, which the node graph does not hold) or a value the
            pickle writer cannot express, naming the member.
    """
    mutated = [split_use(n)[0] for n in p.globals if split_use(n)[1] == CLASS_BUILD]
    if mutated:
        raise UnsupportedError(f"{src}: member {p.entry.name!r} sets attributes on the class {mutated[0]} "
                               f"itself (class mutation; see `ckptool scan`); ckptool cannot write it back; nothing "
                               f"written. {_ROUTE}")
    written = {id(rec): pid for pid, rec in p.pids}

    def hook(ref: StorageRef) -> tuple[Any, ...]:
        pid = written[id(ref)]
        return (*pid[:3], fn(ref.location) if fn else ref.location, *pid[4:])

    try:
        return dumps(p.root, protocol=p.protocol, storage_hook=hook)
    except PicklerError as e:
        raise UnsupportedError(f"{src}: member {p.entry.name!r}: cannot write the pickle back ({e}); nothing "
                               f"written. {_ROUTE}") from e


def _count(storages: dict[str, StorageRef], fn: LocationFn | None) -> dict[tuple[str, str], int]:
    """``{(old, new): storage count}`` of the tags ``fn`` changes."""
    out: dict[tuple[str, str], int] = {}
    for ref in storages.values():
        new = fn(ref.location) if fn else ref.location
        if new != ref.location:
            out[(ref.location, new)] = out.get((ref.location, new), 0) + 1
    return out


def _copy(w: TorchZipWriter, f: BinaryIO, e: ZipEntry, rel: str, src: str, size: int) -> None:
    """Copy member ``e`` of ``src`` (``size`` bytes) as it is (stored bytes, or the compressed bytes of a deflated
    member, never inflated) as the record ``rel``.

    Raises:
        CorruptCheckpointError: an encrypted member, an unknown compression method, a member past the file's end.
    """
    if e.flags & ENCRYPTED or e.method not in (0, 8):
        raise CorruptCheckpointError(f"{src}: member {e.name!r} is encrypted or uses compression method {e.method}; "
                                     "torch cannot read it either")
    offset = data_offset(f, e, src)
    if offset + e.compress_size > size:
        raise CorruptCheckpointError(f"{src}: member {e.name!r} is truncated; re-download it")
    if e.method == 8:
        w.copy_compressed(rel, f, offset, e.compress_size, e.file_size, e.crc)
    else:
        w.copy_record(rel, f, offset, e.file_size, e.crc)

