"""Reading a ``torch.package`` archive's state_dict without running its code.

The archive (:mod:`ckptool.formats.torch_package`: ``torch.package.PackageExporter``) holds pickles
(``save_pickle(package, resource, obj)``) that share one table of storages, each a raw ``.data/<key>.storage``
record. Every pickle is read as a node graph (nothing imported or run), the state_dicts are found in all of them
(:func:`ckptool.model.graph.find_state_dicts`: a mapping of tensors saved with ``save_pickle``, or a pickled
``nn.Module`` whose ``state_dict()`` is walked from its ``_parameters`` / ``_buffers`` / ``_modules``), one is
chosen as ``convert`` chooses it (:func:`ckptool.readers.read_torch.select_state_dict`), and each tensor becomes a
:class:`~ckptool.formats.tensors.Tensor` over the byte range of its storage record.

**Keys.** A state_dict is named ``<member>:<path>``, the syntax ``ckptool inspect`` prints for a package's tensors
and state_dicts (:func:`ckptool.ops.inspect.pickles.package_info`): ``<member>`` the pickle's path in the archive
below its top folder (``model/state_dict.pkl``, which may hold dots and slashes but ends in ``.pkl``), ``<path>``
a dotted path inside that pickle (``""``: its top level). ``<member>`` alone selects the state_dict ``convert``
would choose in that pickle. A member name holding ``:`` that makes a key match two members is refused.

**What is refused.** ``PackageImporter.load_pickle`` answers a ``('reduce_package', ...)`` persistent id by calling
a function of the package (a ``torch.fx.GraphModule``, a TorchScript module, any object with
``__reduce_package__``); such an object in the selected state_dict, or in a package where no state_dict is found,
is refused (:class:`~ckptool.errors.UnsupportedError`) with the route through ``PackageImporter`` in a trusted
environment. Storage sharing follows ``PackageImporter``: two tensors of one pickle on one storage share one
:class:`~ckptool.formats.tensors.Storage`.

**For a rewrite** (``remap`` of an archive, :func:`read_package_pickles`): every member that is a pickle, read with
each persistent id kept as written, and refusals of what cannot be written back as it was.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import storage_nbytes
from ckptool.formats.nodes import GlobalMeta, PersistentRef, StorageRef, qualified_name
from ckptool.formats.pickle_check import call_with_stack, check_pickle, tuple_levels
from ckptool.formats.tensors import Source, Storage
from ckptool.formats.torch_package import (
    MARKER,
    TRUSTED_ROUTE,
    Package,
    PicklePids,
    Resource,
    check_storages,
    read_package,
)
from ckptool.formats.unpickler import PICKLE_ERRORS, RestrictedUnpickler
from ckptool.formats.zipdir import ZipEntry, data_offset, read_member_head
from ckptool.model.graph import StateDictRef, depth_first, find_state_dicts, node_children
from ckptool.model.keys import shared_prefixes
from ckptool.model.nonstrided import find_non_strided
from ckptool.model.paths import resolve_path
from ckptool.readers.read_torch import (
    add_tensors,
    describe,
    left_out,
    raise_non_strided,
    select_state_dict,
    state_dict_entries,
)
from ckptool.readers.reader import Reader, StateDictEntry

if TYPE_CHECKING:
    from ckptool.readers import Opened

__all__ = ["PackagePickles", "PackageReader", "package_source", "package_state_dicts", "read_package_pickles",
           "split_key"]


def split_key(pkg: Package, key: str) -> tuple[Resource, str | None]:
    """``(pickle, dotted path in it)`` named by ``key`` (``<member>`` or ``<member>:<path>``, see the module
    docstring); the path is None for ``<member>`` alone.

    Raises:
        UsageError: ``key`` names no pickle of the archive, or two (member names holding ``:``).
    """
    found = [(r, key[len(r.member) + 1:] if len(key) > len(r.member) else None) for r in pkg.resources
             if key == r.member or key.startswith(r.member + ":")]
    if len(found) == 1:
        return found[0]
    members = ", ".join(r.member for r in pkg.resources) or "none"
    if found:
        raise UsageError(f"{pkg.path}: --key {key!r} matches several pickles ({', '.join(r.member for r, _ in found)});"
                         " name the member and the path as MEMBER:PATH")
    raise UsageError(f"{pkg.path}: --key {key!r} names no pickle of the package; pass MEMBER or MEMBER:PATH (the "
                     f"keys `ckptool inspect` prints), with MEMBER one of: {members}")


def _found(pkg: Package) -> list[tuple[Resource, StateDictRef]]:
    """Every state_dict of the archive's pickles with its pickle, outermost first within each, in archive order."""
    return [(r, sd) for r in pkg.resources for sd in find_state_dicts(r.root)]


def package_state_dicts(pkg: Package) -> list[tuple[str, StateDictRef]]:
    """Every state_dict of the archive's pickles, outermost first within each pickle, in archive order, as
    ``(key, ref)`` with ``key`` in the ``<member>:<path>`` syntax and ``ref`` found in the pickle's own graph."""
    return [(f"{r.member}:{sd.path}", sd) for r, sd in _found(pkg)]


def _reduce_package(obj: object) -> PersistentRef | None:
    """``obj`` when it is a ``('reduce_package', ...)`` persistent id, a leaf test for
    :func:`ckptool.model.graph.depth_first`."""
    if type(obj) is PersistentRef and isinstance(obj.pid, tuple) and obj.pid and obj.pid[0] == "reduce_package":
        return obj
    return None


def _refuse_code(pkg: Package, r: Resource, obj: object, inner: str) -> None:
    """Raise :class:`UnsupportedError` when ``obj`` (at dotted ``inner`` in pickle ``r``) reaches a
    ``('reduce_package', ...)`` persistent id (``PackageExporter`` writes ``('reduce_package', id, function,
    args)``; older archives ``('reduce_package', function, args)``): rebuilding it runs the package's code."""
    for where, ref in depth_first(obj, inner, node_children, _reduce_package):
        func = ref.pid[-2] if len(ref.pid) in (3, 4) else None
        name = func.qualified_name if isinstance(func, GlobalMeta) else None
        raise UnsupportedError(
            f"{pkg.path}: {r.member}:{where} is an object the package's own code rebuilds, a ('reduce_package', ...) "
            f"persistent id{f' (made by {name})' if name else ''}; ckptool does not run it, so what it holds "
            f"cannot be read. In a trusted environment, torch.package.PackageImporter({pkg.path!r}).load_pickle("
            f"{r.package!r}, {r.resource!r}) loads it (runs the package's code); save its state_dict() with "
            "torch.save, then run the command on that file")


def _refuse_keyed_code(pkg: Package, r: Resource, inner: str | None) -> None:
    """:func:`_refuse_code` for what ``--key`` names: the object at ``inner``, or, for a pickle named alone that
    holds no state_dict, the whole pickle."""
    if inner is None:
        if not find_state_dicts(r.root):
            _refuse_code(pkg, r, r.root, "")
        return
    try:
        trail = resolve_path(r.root, inner)
    except KeyError:
        return  # select_state_dict says what is there
    _refuse_code(pkg, r, trail[-1].child if trail else r.root, inner)


def _refuse_empty(pkg: Package) -> None:
    """Raise :class:`UnsupportedError` for a package whose pickles hold no state_dict: naming a ``reduce_package``
    object or a non-strided tensor when there is one."""
    for r in pkg.resources:
        _refuse_code(pkg, r, r.root, "")
        special = find_non_strided(r.root)
        if special:
            raise_non_strided(pkg.path, f"{r.member}:{special[0][0]}", special[0][1], len(special) - 1)
    members = ", ".join(r.member for r in pkg.resources) or "none"
    raise UnsupportedError(
        f"{pkg.path}: no state_dict found in the package's pickles ({members}: a mapping of parameter names to "
        "tensors, or a pickled nn.Module); `ckptool inspect` lists what they hold, --key MEMBER:PATH selects a "
        "mapping")


def _select(pkg: Package, key: str | None) -> tuple[Resource, StateDictRef]:
    """The pickle and the state_dict in it to read: ``key`` (see :func:`split_key`), else, when one pickle holds
    state_dicts, the one ``convert`` would choose in it (:func:`ckptool.readers.read_torch.select_state_dict`).

    Raises:
        UsageError: see :func:`split_key` and :func:`select_state_dict`; several equally likely state_dicts, or
            state_dicts in several pickles (listed as ``<member>:<path>``).
        UnsupportedError: a ``reduce_package`` object where ``key`` points; no state_dict (:func:`_refuse_empty`).
    """
    if key is not None:
        r, inner = split_key(pkg, key)
        _refuse_keyed_code(pkg, r, inner)
        return r, select_state_dict(r.root, inner, f"{pkg.path}:{r.member}")
    found = _found(pkg)
    if not found:
        _refuse_empty(pkg)
    r = found[0][0]
    if all(o is r for o, _sd in found):
        try:
            return r, select_state_dict(r.root, None, f"{pkg.path}:{r.member}")
        except UsageError:
            pass  # refused below, listing the choices in the syntax --key takes
    listing = ", ".join(f"{o.member}:{sd.path} ({len(sd.keys())} tensors)" for o, sd in found)
    raise UsageError(f"{pkg.path} holds several state_dicts: {listing}; choose one with --key MEMBER:PATH (key=...)")


def package_source(path: str, key: str | None = None, pkg: Package | None = None) -> Source:
    """Read the selected state_dict of the ``torch.package`` archive at ``path`` (a local path or URL) as a
    :class:`Source` (no tensor bytes read; nothing imported or run): ``key`` in the ``<member>:<path>`` syntax of
    the module docstring, else the one ``convert`` would choose; ``pkg``: the archive already read
    (:func:`ckptool.formats.torch_package.read_package`). Each storage is the byte range of its
    ``.data/<key>.storage`` record (its zip CRC-32 kept when the record holds exactly the storage's bytes); the
    other pickles and the entries beside the state_dict are reported in ``left_out`` as ``<member>:<path>``.

    Raises:
        UsageError: see :func:`split_key`; several equally likely state_dicts.
        UnsupportedError: a ``('reduce_package', ...)`` object in the selected state_dict or in a package without
            one (the route through ``PackageImporter`` in a trusted environment); no state_dict; non-strided
            tensors, compressed records, tensors of different dtypes on one storage
            (:func:`ckptool.readers.read_torch.add_tensors`).
        NotACheckpointError / CorruptCheckpointError: not a package, a damaged archive (see
            :func:`ckptool.formats.torch_package.read_package`), a view past its storage.
    """
    pkg = pkg if pkg is not None else read_package(path)
    r, sd = _select(pkg, key)
    _refuse_code(pkg, r, sd.obj, sd.path)
    where = f"{r.member}:"
    src = Source(path, formats.TORCH_PACKAGE, [], key=where + sd.path,
                 left_out=[f"{o.member}: {describe(o.root)}" for o in pkg.resources if o is not r]
                 + [where + x for x in left_out(r.root, sd.trail)])
    entries = state_dict_entries(src, sd.obj, sd.is_module)
    by_name = {e.name: e for e in formats.zip_entries(path)}

    with source.open_binary(path) as f:
        def storage_of(ref: StorageRef, name: str, dtype: str) -> Storage:
            record = f"{pkg.top}.data/{ref.key}.storage"
            e = by_name.get(record)
            if e is None:
                raise CorruptCheckpointError(f"{path}: storage {ref.key!r} of {where}{name} has no {record} record; "
                                             "re-export the package")
            if e.method != 0:
                raise UnsupportedError(f"{path}: record {record} is compressed; PackageExporter never writes that and "
                                       "ckptool does not inflate records")
            nbytes = storage_nbytes(ref)  # PackageImporter reads numel elements from the record's start
            return Storage(path, data_offset(f, e, path), nbytes, dtype, ref.location,
                           e.crc if e.file_size == nbytes else None)

        add_tensors(src, entries, storage_of)
    return src


class PackageReader(Reader):
    """A torch.package archive (the registry's ``reader``): every pickle of it, its state_dicts keyed
    ``<member>:<path>``."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened)
        self._package: Package | None = None

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """:func:`package_source` over its pickles, read once (:meth:`~ckptool.readers.Opened.package`)."""
        return package_source(self.opened.target, key, self.package())

    def package(self) -> Package:
        """The archive's pickles as node graphs (:func:`ckptool.formats.torch_package.read_package`, nothing
        imported or run), read once."""
        if self._package is None:
            self._package = read_package(self.opened.target)
        return self._package

    def state_dicts(self) -> list[StateDictEntry]:
        """Every state_dict of every pickle, keyed ``<member>:<path>`` as ``inspect`` prints them."""
        return [StateDictEntry(k, tuple(keys), tuple(shared_prefixes(keys)), r.is_module)
                for k, r in package_state_dicts(self.package()) for keys in [r.keys()]]


# ------------------------------------------------------------------------------------------------ for a rewrite
#: the first bytes of a pickle of protocol 2 to 5 (``PROTO n``): a resource that begins so is read as a pickle
_PROTO_HEADS = tuple(bytes((0x80, n)) for n in range(2, 6))
#: the folder ``PackageExporter`` writes a TorchScript module's code and constants into (with ``reduce_package``)
_TS_CODE = ".data/ts_code/"


@dataclass
class PackagePickles:
    """A ``torch.package`` archive read for a rewrite (:func:`read_package_pickles`): ``entries`` its members in
    directory order, ``top`` its top folder (with ``/``), ``pickles`` every member that is a pickle
    (:class:`~ckptool.formats.torch_package.PicklePids`, persistent ids as written), ``storages`` every storage they
    name, by key (one record per key, shared by the pickles as the exporter shares its storage context)."""

    entries: list[ZipEntry]
    top: str
    pickles: list[PicklePids] = field(default_factory=list)
    storages: dict[str, StorageRef] = field(default_factory=dict)


class _PidsUnpickler(RestrictedUnpickler):
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


def read_package_pickles(opened: Opened) -> PackagePickles:
    """Read the ``torch.package`` archive ``opened`` for a rewrite that keeps every member but its pickles' storage
    location tags (``remap``; nothing imported or run): every member that is a pickle (the ``*.pkl`` resources
    outside ``.data/``, and any other resource there but the modules' ``.py`` sources that begins like one,
    ``PROTO 2`` to ``5``: ``save_pickle`` takes any resource name), each persistent id kept as written, each storage
    checked to have its ``.data/<key>.storage`` record.

    Raises:
        UnsupportedError: not a package with one top folder; a member outside that folder, a name used twice, a
            TorchScript part (``.data/ts_code/``); a member that begins like a pickle but is not one; a persistent id
            other than a storage's of the 5 fields ``PackageExporter`` writes (``('reduce_package', ...)``: an
            object a function of the package rebuilds), one storage named by two different ids; tuple nesting too
            deep to read safely. Each names the member and the route through ``PackageImporter``.
        CorruptCheckpointError: a damaged archive, ``.pkl`` member or storage record; a storage declared twice
            differently.
    """
    src = opened.target
    entries, top = _members(src, opened.zip_entries())
    out = PackagePickles(entries, top)
    cache: dict[tuple[str, str], GlobalMeta] = {}
    with source.open_binary(src) as f:
        for e in entries:
            rel = e.name[len(top):]
            if rel.startswith(".data/") or rel.endswith(("/", ".py")):
                continue
            named = rel.endswith(".pkl")
            if not named and read_member_head(f, e, src, 2) not in _PROTO_HEADS:
                continue
            try:
                p = _load(bytes(opened.pickle_member(e, f)), e, rel, f"{e.name} in {src}", out.storages, cache)
            except CorruptCheckpointError as err:
                if named:
                    raise
                raise UnsupportedError(f"{src}: member {e.name!r} begins like a pickle but ckptool cannot read it "
                                       f"as one ({err}); remap cannot tell whether it names storages; nothing "
                                       f"written. {TRUSTED_ROUTE}") from err
            _check_pids(p, src)
            out.pickles.append(p)
    check_storages(Package(src, source.file_size(src), top, storages=out.storages),
                   {e.name[len(top):]: e for e in entries})
    return out


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
                f"ckptool cannot re-tag; nothing written. {TRUSTED_ROUTE}")
    return entries, top


def _load(data: bytes, e: ZipEntry, rel: str, what: str, storages: dict[str, StorageRef],
          cache: dict[tuple[str, str], GlobalMeta]) -> PicklePids:
    """Check (:func:`~ckptool.formats.pickle_check.check_pickle`) then read one pickle member, as
    :func:`ckptool.formats.unpickler.load_structure` does, keeping its persistent ids.

    Raises:
        CorruptCheckpointError: a truncated, malformed or hostile pickle, or bytes after its end.
        UnsupportedError: tuple nesting too deep to read safely.
    """
    check_pickle(data, 0, what=what, exact=True)
    up = _PidsUnpickler(io.BytesIO(data), storages=storages, global_cache=cache)
    try:
        root = call_with_stack(up.load, tuple_levels(data), what)
    except PICKLE_ERRORS as err:
        raise CorruptCheckpointError(f"{what} is corrupted or truncated ({type(err).__name__}: {err}); re-export "
                                     "the package") from err
    protocol = data[1] if data[:1] == b"\x80" else 2
    return PicklePids(e, rel, root, protocol, up.pids, [qualified_name(m, n) for m, n in up.globals_seen])


def _check_pids(p: PicklePids, src: str) -> None:
    """Refuse a pickle whose persistent ids a rewrite cannot keep as written but for the location tag: an id that is
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
                                   f"nothing written. {TRUSTED_ROUTE}")
        if len(pid) != 5:
            raise UnsupportedError(f"{src}: member {p.entry.name!r} names storage {rec.key!r} with {len(pid)} "
                                   f"fields, not the 5 PackageExporter writes; nothing written. {TRUSTED_ROUTE}")
        seen = first.setdefault(id(rec), pid)
        if seen is not pid and [(type(x), x) for x in seen] != [(type(x), x) for x in pid]:
            raise UnsupportedError(f"{src}: member {p.entry.name!r} names storage {rec.key!r} by two different "
                                   f"persistent ids ({seen!r}, {pid!r}); nothing written. {TRUSTED_ROUTE}")
