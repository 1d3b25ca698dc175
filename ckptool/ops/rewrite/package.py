"""``ckptool.ops.rewrite.package``: re-tag the storages of a ``torch.package`` archive, running none of its code.

A ``torch.package.PackageExporter`` archive (layout: :mod:`ckptool.formats.torch_package`) names each storage in its
pickles by the persistent id ``('storage', <storage class>, key, location, numel)``; ``PackageImporter.load_pickle``
restores the storage on the device ``location`` names unless a ``map_location`` says otherwise, as ``torch.load``
does. :func:`remap_package` rewrites those tags:

* every member of the archive that is a pickle (the ``*.pkl`` resources, and any other resource outside ``.data/``
  that begins like one: ``save_pickle`` takes any resource name) is read with ckptool's restricted unpickler
  (nothing imported or called) by the reader, :func:`ckptool.readers.read_package.read_package_pickles`; each
  persistent id is kept as it was written but for its location tag, chosen by
  :func:`ckptool.model.devices.location_function` (``--to`` / ``--map``, the same checks as remap of a torch
  file); a pickle whose tags change is written anew in the protocol it had by the writer,
  :func:`ckptool.writers.package.retagged_pickle`;
* every other member (the modules' source, the ``.data/<key>.storage`` records, ``extern_modules``, text and
  binary resources, and the pickles whose tags do not change) is copied byte for byte, under the same name, in the
  same order, into a zip of the layout ``PackageExporter`` writes (:func:`ckptool.writers.package.write_package`).

What cannot be rewritten faithfully is refused before anything is written: a pickle holding a persistent id other
than a storage's (``('reduce_package', ...)``: an object that a function of the package rebuilds, a TorchScript
module among them, whose own tags ckptool cannot see), a TorchScript part (``.data/ts_code/``), a storage named by two
different persistent ids in one pickle, a BUILD on a class, values the pickle writer cannot express, members outside
the archive's top folder or named twice. The output is atomic (:func:`ckptool._fileio.atomic_output`); the input is
never modified (``in_place`` replaces it by a renamed new file).
"""

from __future__ import annotations

from collections.abc import Mapping

from ckptool._fileio import atomic_output, file_mode, same_file
from ckptool.errors import UnsupportedError
from ckptool.model.devices import location_function
from ckptool.ops.rewrite.stream import ProgressFn, WriteResult, retag_counts
from ckptool.readers import Opened
from ckptool.readers.read_package import read_package_pickles
from ckptool.writers.package import retagged_pickle, write_package

__all__ = ["remap_package"]


def remap_package(opened: Opened, dst: str, to: str | None = None, mapping: Mapping[str, str] | None = None,
                  allow_missing: bool = False, progress: ProgressFn | None = None, *, renaming: bool = False
                  ) -> WriteResult:
    """Write a copy of the ``torch.package`` archive ``opened`` (:func:`ckptool.readers.open_checkpoint`) to ``dst``
    with its storages re-tagged: ``to`` every storage, ``mapping`` only the matching tags
    (:func:`ckptool.model.devices.location_function`); see the module docstring for what is rewritten and what is
    copied. ``dst`` may be ``src`` (in place: the permission bits are kept). ``progress(nbytes)`` is called as
    members are copied (bytes since the last call). ``renaming``: the caller also asked for key renamings
    (``--unwrap``, ``--strip-*``, ``--add-prefix``), which are refused.

    Returns a :class:`~ckptool.ops.rewrite.stream.WriteResult` (``format_in`` ``torch-package``, ``storages`` named by
    the pickles, ``retagged`` ``{(old, new): storage count}``, ``bytes_written``).

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
    archive = read_package_pickles(opened)
    fn = location_function(to, mapping, tags=[r.location for r in archive.storages.values()],
                           allow_missing=allow_missing, where=src)
    new = {p.entry.name: retagged_pickle(p, src, fn) for p in archive.pickles
           if fn is not None and any(fn(rec.location) != rec.location for _pid, rec in p.pids)}
    res = WriteResult(src, dst, opened.format, storages=len(archive.storages),
                      retagged=retag_counts(archive.storages, fn))
    mode = file_mode(src) if same_file(src, dst) else None
    with atomic_output(dst, mode=mode) as out:
        res.bytes_written = write_package(out, src, archive.top, archive.entries, new, progress)
    return res
