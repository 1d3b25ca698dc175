"""Writing a ``torch.package`` archive back with its storages re-tagged (``remap`` of an archive), byte for byte but
for the pickles whose tags change.

The layout is the one ``torch.package.PackageExporter`` writes (torch's ``PyTorchStreamWriter``: every record
stored under the archive's top folder, 64-byte aligned: :class:`ckptool.formats.torchzip.TorchZipWriter`). A pickle
whose tags change is written anew with :mod:`ckptool.formats.pickler` in the protocol it had, each persistent id as
written but for its location tag (:func:`retagged_pickle`); every other member (the modules' source, the
``.data/<key>.storage`` records, ``extern_modules``, text and binary resources, the pickles whose tags do not change)
is copied as it is stored, under the same name, in the same order (:func:`write_package`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.nodes import CLASS_BUILD, StorageRef, split_use
from ckptool.formats.pickler import PicklerError, dumps
from ckptool.formats.torch_package import TRUSTED_ROUTE, PicklePids
from ckptool.formats.torchzip import TorchZipWriter
from ckptool.formats.zipdir import ENCRYPTED, ZipEntry, data_offset
from ckptool.model.devices import LocationFn

__all__ = ["retagged_pickle", "write_package"]


def retagged_pickle(p: PicklePids, src: str, fn: LocationFn | None) -> bytes:
    """The bytes of the pickle member ``p`` of the archive ``src`` (read by
    :func:`ckptool.readers.read_package.read_package_pickles`) with its storages' location tags rewritten by
    ``fn`` (:func:`ckptool.model.devices.location_function`; None keeps them), each persistent id otherwise as
    written (its key's type kept: ``PackageExporter`` writes int keys), in the pickle's own protocol.

    Raises:
        UnsupportedError: a BUILD on a class (class mutation, which the node graph does not hold) or a value the
            pickle writer cannot express, naming the member and the route through ``PackageImporter``.
    """
    mutated = [split_use(n)[0] for n in p.globals if split_use(n)[1] == CLASS_BUILD]
    if mutated:
        raise UnsupportedError(f"{src}: member {p.entry.name!r} sets attributes on the class {mutated[0]} "
                               f"itself (class mutation; see `ckptool scan`); ckptool cannot write it back; nothing "
                               f"written. {TRUSTED_ROUTE}")
    written = {id(rec): pid for pid, rec in p.pids}

    def hook(ref: StorageRef) -> tuple[Any, ...]:
        pid = written[id(ref)]
        return (*pid[:3], fn(ref.location) if fn else ref.location, *pid[4:])

    try:
        return dumps(p.root, protocol=p.protocol, storage_hook=hook)
    except PicklerError as e:
        raise UnsupportedError(f"{src}: member {p.entry.name!r}: cannot write the pickle back ({e}); nothing "
                               f"written. {TRUSTED_ROUTE}") from e


def write_package(out: BinaryIO, src: str, top: str, entries: Sequence[ZipEntry], replaced: Mapping[str, bytes],
                  progress: Callable[[int], None] | None = None) -> int:
    """Write the archive ``src`` (its members ``entries`` in directory order, all under the folder ``top``, with
    ``/``) into ``out`` (a new file open for binary writing) in ``PackageExporter``'s layout: the members named in
    ``replaced`` (zip name -> new bytes) written anew, every other one copied as it is stored (a deflated member's
    compressed bytes, never inflated). ``progress(nbytes)`` is called as members are copied (bytes since the last
    call). Returns the bytes written.

    Raises:
        CorruptCheckpointError: an encrypted member, an unknown compression method, a member past the file's end.
    """
    size = source.file_size(src)
    with source.open_binary(src) as f:
        w = TorchZipWriter(out, top, progress=progress)
        for e in entries:
            rel = e.name[len(top):]
            data = replaced.get(e.name)
            if data is not None:
                w.write_bytes(rel, data)
            else:
                _copy(w, f, e, rel, src, size)
        w.close()
    return w.pos


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
