"""Read a ``torch.package`` archive (written by ``torch.package.PackageExporter``) without importing or running it.

The layout, as torch 2.13's ``torch/package/package_exporter.py`` writes it and ``package_importer.py`` reads it,
all under one top folder (the file's stem at save time, as in a torch zip):

* ``.data/extern_modules`` (the modules the package takes from the loading environment, one a line),
  ``.data/python_version``, ``.data/version``, ``.data/serialization_id``, ``byteorder``;
* ``.data/<key>.storage``: one record per storage, raw bytes;
* ``<package path>/<resource>``: each ``save_pickle(package, resource, obj)`` (a pickle, protocol 3 or 4), whose
  storages are the persistent ids ``('storage', <storage class>, key, location, numel)`` of
  ``PackageExporter._persistent_id`` (``key`` an int naming ``.data/<key>.storage``; ``numel`` elements of the
  typed storage, bytes for ``UntypedStorage``); objects with ``__reduce_package__`` are ``('reduce_package', ...)``
  ids instead, which ``PackageImporter.load_pickle`` answers by calling the function the id names;
* ``<module path>.py`` / ``<package path>/__init__.py``: the Python source of each interned module, which
  ``PackageImporter`` runs when a pickle (or an import) needs it; ``.data/ts_code/`` holds TorchScript code.

The pickles are read with :mod:`ckptool.formats.unpickler` (nothing imported or called), sharing one storage table
as the exporter shares one storage context: a storage written once is the same record for every pickle naming it.
Storage bytes are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptool import _source as source
from ckptool.errors import CkptError, CorruptCheckpointError, NotACheckpointError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import storage_element
from ckptool.formats.nodes import GlobalMeta, StorageRef, qualified_name
from ckptool.formats.torchfile import read_pickle_member
from ckptool.formats.unpickler import load_structure
from ckptool.formats.zipdir import ZipEntry, read_member

__all__ = ["MARKER", "TRUSTED_ROUTE", "Package", "PicklePids", "Resource", "check_storages", "module_name",
           "read_package"]

#: the member every ``PackageExporter`` archive holds (under its top folder), which detection looks for
MARKER = ".data/extern_modules"
#: the way around a refusal to rewrite an archive: load it with torch in a trusted environment
TRUSTED_ROUTE = ("Load it with torch.package.PackageImporter(path).load_pickle(package, resource, "
                 "map_location='cpu') in a trusted environment (it runs the package's code) and export it again")
#: the most bytes read of each small text record (``extern_modules``, ``python_version``, ``version``)
_TEXT_LIMIT = 1 << 20


@dataclass
class Resource:
    """One pickle of the archive: ``member`` its path in the archive below the top folder (``weights/sd.pkl``),
    ``package`` / ``resource`` the names ``PackageImporter.load_pickle(package, resource)`` takes, ``root`` the
    node graph (:mod:`ckptool.formats.nodes`), ``globals`` the globals it names (``module.qualname``, first use
    order)."""

    member: str
    package: str
    resource: str
    root: Any
    globals: list[str]


@dataclass
class PicklePids:
    """One pickle member read for a rewrite: its zip ``entry``, ``rel`` (its name below the top folder), node graph
    ``root``, pickle ``protocol``, every persistent id as written (``pids``: ``(pid, record)`` in the order the
    pickle names them, ``record`` the :class:`~ckptool.formats.nodes.StorageRef` or other record the restricted
    reader made of it) and the ``globals`` it names (qualified, with the unsafe uses
    :func:`~ckptool.formats.nodes.use_key` records)."""

    entry: ZipEntry
    rel: str
    root: Any
    protocol: int
    pids: list[tuple[Any, Any]]
    globals: list[str]


@dataclass
class Package:
    """A ``torch.package`` archive: ``size`` in bytes, ``top`` its top folder (with ``/``), ``resources`` its
    pickles (:class:`Resource`, archive order), ``storages`` every storage the pickles name, by key, ``modules``
    the Python modules it ships (dotted names, archive order), ``extern_modules`` those it takes from the loading
    environment, ``python_version`` / ``version`` the text of those records (``""`` when absent)."""

    path: str
    size: int
    top: str
    resources: list[Resource] = field(default_factory=list)
    storages: dict[str, StorageRef] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)
    extern_modules: list[str] = field(default_factory=list)
    python_version: str = ""
    version: str = ""


def module_name(rel: str) -> str:
    """The dotted module name of the source member ``rel`` (below the top folder): ``pkg/sub/mod.py`` ->
    ``pkg.sub.mod``, ``pkg/__init__.py`` -> ``pkg``, as ``PackageExporter.save_source_string`` names its files."""
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(entries: list[ZipEntry]) -> bool:
    """True when the zip directory ``entries`` holds ``<top>/.data/extern_modules`` (every ``PackageExporter``
    archive does: ``_write_mock_and_extern`` writes it on close)."""
    first = entries[0].name if entries else ""
    top = first.split("/", 1)[0] + "/" if "/" in first else ""
    target = top + MARKER
    return any(e.name == target for e in entries)


def read_package(path: str) -> Package:
    """Read the archive at ``path`` (a local path or URL): its directory, its pickles (every member outside
    ``.data/`` whose name ends ``.pkl``, read whole with the restricted unpickler) and its text records.

    Raises:
        NotACheckpointError: not a ``torch.package`` archive (see :func:`is_package`).
        CorruptCheckpointError: a damaged pickle or record, a storage whose ``.data/<key>.storage`` record is
            missing or shorter than the persistent id says.
        UnsupportedError: tuple nesting too deep to read safely.
    """
    entries = formats.zip_entries(path)
    if not is_package(entries):
        raise NotACheckpointError(f"{path} is not a torch.package archive (no {MARKER})")
    top = entries[0].name.split("/", 1)[0] + "/" if "/" in entries[0].name else ""
    pkg = Package(path, source.file_size(path), top)
    by_rel = {e.name[len(top):]: e for e in entries if e.name.startswith(top)}
    cache: dict[tuple[str, str], GlobalMeta] = {}
    with source.open_binary(path) as f:
        pkg.extern_modules = [m for m in _text(f, by_rel.get(MARKER), path).splitlines() if m]
        pkg.python_version = _text(f, by_rel.get(".data/python_version"), path).strip()
        pkg.version = _text(f, by_rel.get(".data/version"), path).strip()
        for rel, e in by_rel.items():
            if rel.startswith(".data/") or rel.endswith("/"):
                continue
            if rel.endswith(".py"):
                pkg.modules.append(module_name(rel))
            elif rel.endswith(".pkl"):
                data = read_pickle_member(f, e, path)
                root, up = load_structure(data, f"{e.name} in {path}", storages=pkg.storages, global_cache=cache)
                package, _sep, resource = rel.rpartition("/")
                pkg.resources.append(Resource(rel, package.replace("/", "."), resource, root,
                                              [qualified_name(m, n) for m, n in up.globals_seen]))
    check_storages(pkg, by_rel)
    return pkg


def _text(f: Any, e: ZipEntry | None, path: str) -> str:
    if e is None:
        return ""
    return read_member(f, e, path, limit=_TEXT_LIMIT).decode("utf-8", "replace")


def check_storages(pkg: Package, by_rel: dict[str, ZipEntry]) -> None:
    """Every storage the pickles name has its ``.data/<key>.storage`` record, holding at least the bytes its
    persistent id declares (``PackageImporter`` reads ``numel`` elements from it). ``by_rel``: the archive's
    members by their name below its top folder.

    Raises:
        CorruptCheckpointError: a storage without its record, or a record shorter than declared.
    """
    for key, ref in pkg.storages.items():
        e = by_rel.get(f".data/{key}.storage")
        if e is None:
            raise CorruptCheckpointError(f"{pkg.path}: a pickle names storage {key!r} but the archive has no "
                                         f"{pkg.top}.data/{key}.storage record; re-export the package")
        try:
            need = ref.numel * storage_element(ref)[1]
        except CkptError:
            continue  # an unknown storage class: its size is not known
        if e.file_size < need:
            raise CorruptCheckpointError(f"{pkg.path}: storage record {pkg.top}.data/{key}.storage holds "
                                         f"{e.file_size} bytes, its pickle declares {need}; truncated or damaged, "
                                         "re-export the package")

