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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import storage_nbytes
from ckptool.formats.nodes import GlobalMeta, PersistentRef, StorageRef
from ckptool.formats.tensors import Source, Storage
from ckptool.formats.torch_package import Package, Resource, read_package
from ckptool.formats.zipdir import data_offset
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

__all__ = ["PackageReader", "package_source", "package_state_dicts", "split_key"]


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
