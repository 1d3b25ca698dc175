"""Verifying ``convert``'s output: re-opened by a reader other than the writer and compared with what was read.

Which reader depends on what is installed (:func:`verification_check` says which ran, for
``ConvertResult.checked``):

* safetensors: ``safetensors.safe_open`` (its NumPy framework when NumPy holds every dtype, else torch's) checks
  names, dtypes, shapes, CRC-32 and ``__metadata__``; with neither torch nor NumPy installed, ckptool's own header
  reader (:meth:`ckptool.readers.Opened.safetensors_header`) with the safetensors library's layout rules and a
  CRC-32 of each tensor's bytes. Then ckptool reads the file back and compares every tensor (aliases included) and the
  storage sharing.
* torch: ``torch.load(mmap=True, weights_only=True)``
  (:func:`ckptool.torch_ops.convert_verify.torch_load_difference`), or without torch ckptool's restricted reader
  (:meth:`ckptool.readers.Opened.state_dict`); then every storage record's CRC-32 through ``zipfile``.

The output is opened through :func:`ckptool.readers.open_checkpoint` like any checkpoint; what it is compared with
never passed through that reader: the tensors the writer meant to write (:class:`~ckptool.ops.convert.write.Written`)
and the CRC-32 checksums of the bytes as they were written.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar

from ckptool._fileio import copy_range_crc
from ckptool.errors import CkptError
from ckptool.errors import VerificationError as VerificationError  # re-export: its home is ckptool.errors
from ckptool.formats.dtypes import ST_NAMES, contiguous_stride, element_size, numel
from ckptool.formats.tensors import Tensor
from ckptool.ops.convert.evidence import SourceEvidence
from ckptool.ops.convert.source import OutputFormat, out_dtype
from ckptool.ops.convert.write import Written
from ckptool.readers import open_checkpoint
from ckptool.torch_ops.convert_verify import (
    WHOLE_BYTES,
    is_installed,
    safe_open_difference,
    safetensors_framework,
    storage_numbers,
    torch_load_difference,
)

_CHUNK = 8 << 20
W = TypeVar("W")


def verify_fail(path: str, what: str) -> VerificationError:
    """The :class:`VerificationError` for output ``path`` differing in ``what``."""
    return VerificationError(f"verification of {path} failed: {what}; the output was not kept. Check the disk and "
                             "retry; if it fails again, report it with the source file's `ckptool inspect --json`")


def _safetensors_check(dtypes: Collection[str]) -> str:
    """What :func:`verify_safetensors` compares for an output of ``dtypes`` on this installation."""
    framework = safetensors_framework(dtypes)
    if framework is None:
        how = ("ckptool's own safetensors reader and a CRC-32 of each tensor's bytes (the safetensors library "
               "with torch or NumPy is not installed)")
    else:
        how = f"safetensors.safe_open with {'NumPy' if framework == 'numpy' else 'torch'}"
        return (f"the output, re-opened with {how}, holds the names, shapes, dtypes and CRC-32 checksums written "
                f"(a tensor over {WHOLE_BYTES >> 20} MiB: its bytes read back in pieces with ckptool's header "
                "reader)")
    return f"the output, re-opened with {how}, holds the names, shapes, dtypes and CRC-32 checksums written"


def _torch_check(dtypes: Collection[str]) -> str:
    """What :func:`torch_verifier`'s check compares on this installation."""
    how = "torch.load(weights_only=True)" if is_installed("torch") else "ckptool's own reader (torch is not installed)"
    return (f"the output, re-opened with {how} and zipfile, holds the names, shapes, dtypes, strides, storage "
            "sharing and record CRC-32 checksums written")


_CHECKS: dict[OutputFormat, Callable[[Collection[str]], str]] = {
    OutputFormat.SAFETENSORS: _safetensors_check,
    OutputFormat.TORCH: _torch_check,
}


def verification_check(fmt_out: OutputFormat, dtypes: Collection[str], evidence: str = "") -> str:
    """What :func:`verify_safetensors` (safetensors output) or :func:`torch_verifier` (torch output) compare for an
    output of ``dtypes`` on this installation, with which reader, and against what evidence about the source
    (``evidence``: :meth:`ckptool.ops.convert.evidence.SourceEvidence.summary`): the text of
    ``ConvertResult.checked``, which the CLI prints after ``Verified:``.

    Raises:
        KeyError: ``fmt_out`` is an output ckptool does not write itself (DCP).
    """
    what = _CHECKS[fmt_out](dtypes)
    if evidence:
        what += f"; the source bytes written match {evidence}"
    return what


def with_evidence(evidence: SourceEvidence, verifier: Callable[[W, str], None]) -> Callable[[W, str], None]:
    """``verifier`` (a check for :func:`ckptool.ops.convert.write.emit`), followed by :meth:`SourceEvidence.check`
    of the source ranges the output was made from: the output must read back as written, and what was written must
    match evidence about the source that did not pass through ckptool's reader.

    The check raises :class:`VerificationError` on any difference."""
    def check(w: W, path: str) -> None:
        verifier(w, path)
        diff = evidence.check()
        if diff is not None:
            raise verify_fail(path, diff)

    return check


def header_difference(path: str, expect: Sequence[tuple[str, str, tuple[int, ...], int | None]],
                      metadata: Mapping[str, str] | None) -> str | None:
    """The check of :func:`ckptool.torch_ops.convert_verify.safe_open_difference` without torch or NumPy: the
    header is read by :meth:`ckptool.readers.Opened.safetensors_header` and held to the rules the safetensors
    library enforces on opening (the tensors' byte ranges follow one another without gap or overlap and fill the
    data block, each as long as its dtype and shape need); then names, dtypes, shapes, ``__metadata__`` and the
    CRC-32 of each tensor's bytes are compared with ``expect`` (``[(name, dtype, shape, crc or None)]``).

    Raises:
        CorruptCheckpointError: the header itself is malformed.
        UnsupportedError / NotACheckpointError: the file is not a safetensors file.
        OSError: the file cannot be read.
    """
    h = open_checkpoint(path).safetensors_header()
    if set(h.entries) != {e[0] for e in expect}:
        return f"tensor names differ ({', '.join(sorted(set(h.entries) ^ {e[0] for e in expect})[:3])})"
    if (h.metadata or None) != (metadata or None):
        return "__metadata__ differs"
    end = 0
    for name, e in sorted(h.entries.items(), key=lambda ne: tuple(ne[1]["data_offsets"])):
        begin, stop = e["data_offsets"]
        dtype = ST_NAMES.get(e["dtype"])
        if begin != end or dtype is None or stop - begin != numel(e["shape"]) * element_size(dtype):
            return f"{name!r}: its data_offsets {[begin, stop]} do not follow the previous tensor or fit its shape"
        end = stop
    if end != h.data_size:
        return f"the data block holds {h.data_size - end} bytes no tensor uses"
    with open(path, "rb") as f, open(os.devnull, "wb") as sink:
        for name, dtype, shape, crc in expect:
            e = h.entries[name]
            got = (ST_NAMES.get(e["dtype"]), tuple(e["shape"]))
            if got != (dtype, tuple(shape)):
                return f"{name!r} reads back as {got[0]} {list(got[1])}, expected {dtype} {list(shape)}"
            begin, stop = e["data_offsets"]
            if crc is not None and copy_range_crc(f, sink, h.data_start + begin, stop - begin) != crc:
                return f"{name!r} reads back with different bytes (CRC-32)"
    return None


def _safe_open_then_pieces(path: str, expect: Sequence[tuple[str, str, tuple[int, ...], int | None]],
                           metadata: Mapping[str, str] | None, framework: str) -> str | None:
    """:func:`~ckptool.torch_ops.convert_verify.safe_open_difference`, then the CRC-32 of each tensor over
    :data:`~ckptool.torch_ops.convert_verify.WHOLE_BYTES` (which ``safe_open`` only looked at: it reads a tensor
    whole) read in bounded pieces by :func:`header_difference`. None when all match, else the first difference."""
    diff = safe_open_difference(path, expect, metadata, framework)
    if diff is not None:
        return diff
    big = [(n, d, s, c if numel(s) * element_size(d) > WHOLE_BYTES else None) for n, d, s, c in expect]
    return header_difference(path, big, metadata)


def verify_safetensors(w: Written, path: str) -> None:
    """Re-open ``path`` with ``safetensors.safe_open`` (or, without torch and NumPy, :func:`header_difference`) and
    compare every stored tensor's name, dtype, shape and CRC-32 with ``w.expect``, and the ``__metadata__`` (a tensor
    over :data:`~ckptool.torch_ops.convert_verify.WHOLE_BYTES`: its CRC-32 through :func:`header_difference`, read in
    bounded pieces, since ``safe_open`` reads a tensor whole: peak memory stays off the largest tensor); then
    read it back with ckptool and compare every tensor (aliases included) and the storage sharing with ``w``.

    Raises:
        VerificationError: any difference.
    """
    framework = safetensors_framework({e[1] for e in w.expect})
    try:
        if framework is None:
            diff = header_difference(path, w.expect, w.metadata)
        else:
            diff = _safe_open_then_pieces(path, w.expect, w.metadata, framework)
    except (MemoryError, ImportError):
        raise
    except CkptError as e:  # ckptool's header reader refused the file
        raise verify_fail(path, str(e)) from e
    except Exception as e:  # the safetensors library refused the file
        raise verify_fail(path, f"safetensors.safe_open refused it ({type(e).__name__}: {e})") from e
    if diff is not None:
        raise verify_fail(path, diff)
    back = open_checkpoint(path).state_dict()
    unit_of = {id(t): u for u in w.units for t in u.members}

    def expected(t: Tensor) -> tuple[str, str, tuple[int, ...], tuple[int, ...], int]:
        u = unit_of[id(t)]
        if len(u.members) > 1:
            return (t.name, u.dtype, t.shape, t.stride, (t.offset - u.lo) if t.numel else 0)
        return (t.name, u.dtype, t.shape, contiguous_stride(t.shape), 0)

    got = [(t.name, t.dtype, t.shape, t.stride, t.offset) for t in back.tensors]
    exp = [expected(t) for t in w.tensors]
    if got != exp:
        g, x = next(((g, x) for g, x in zip(got, exp) if g != x), (got[len(exp):], exp[len(got):]))
        raise verify_fail(path, f"reading it back with ckptool gives {g}, expected {x}")
    by_name = {t.name: t for t in back.tensors}
    for u in w.units:
        if len({id(by_name[t.name].storage) for t in u.members}) != 1:
            raise verify_fail(path, f"{u.members[0].name!r} and the tensors sharing its storage no longer share one")


def records_difference(path: str, records: Mapping[str, int] | None) -> str | None:
    """Read every record of the torch zip file at ``path`` named in ``records`` (``data/0`` -> CRC-32 expected from
    the source; None: every record, each against its own CRC-32) through ``zipfile``, which checks each record's
    bytes against its stored CRC-32, and compare that CRC-32 with ``records``. None when all match, else the first
    difference."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = {i.filename.split("/", 1)[-1]: i for i in z.infolist()}
            if records is None:
                records = {name: i.CRC for name, i in infos.items()}
            for name, crc in records.items():
                info = infos.get(name)
                if info is None or crc != info.CRC:
                    return f"record {name} is missing or its CRC-32 differs from the source's"
                with z.open(info) as fh:
                    while fh.read(_CHUNK):
                        pass
    except zipfile.BadZipFile as e:
        return f"a record fails its CRC-32 check ({e})"
    return None


def reader_difference(path: str, expected: Sequence[Tensor], dtype_of: Callable[[str], str] = str) -> str | None:
    """The check of :func:`ckptool.torch_ops.convert_verify.torch_load_difference` without torch: the torch zip
    file at ``path`` is read back with ckptool's restricted reader (:meth:`ckptool.readers.Opened.
    state_dict`) and every tensor's key (in order), dtype (``dtype_of(t.dtype)``: the dtype written), shape,
    stride, storage offset, ``requires_grad`` and storage sharing compared with the tensors meant to be written
    (``expected``)."""
    try:
        back = open_checkpoint(path).state_dict()
    except CkptError as e:
        return f"ckptool's reader refused it ({e})"
    if [t.name for t in back.tensors] != [t.name for t in expected]:
        return "the state_dict keys differ"
    owner: dict[int, int] = {}
    by_storage: dict[int, int] = {}
    for t, x, n in zip(back.tensors, expected, storage_numbers(expected)):
        want = (dtype_of(x.dtype), x.shape, x.stride, x.offset, x.requires_grad)
        got = (t.dtype, t.shape, t.stride, t.offset, t.requires_grad)
        if got != want:
            return f"{t.name!r} reads back as {got}, expected {want}"
        if owner.setdefault(id(t.storage), n) != n:
            return f"{t.name!r} shares a storage it should not"
        if by_storage.setdefault(n, id(t.storage)) != id(t.storage):
            return f"{t.name!r} no longer shares its storage"
    return None


def torch_verifier(cast: str | None) -> Callable[[Written, str], None]:
    """A check for :func:`ckptool.ops.convert.write.emit` of a torch output written with ``cast``: it opens the file
    with ``torch.load(mmap=True, weights_only=True)`` (without torch: ckptool's own reader, :func:`reader_difference`)
    and compares every tensor's name, dtype, shape, stride, storage offset, requires_grad and storage sharing, and
    every storage record's CRC-32 (:func:`records_difference`), with what was written.

    The check raises :class:`VerificationError` on any difference.
    """
    def check(w: Written, path: str) -> None:
        def dtype_of(dtype: str) -> str:
            return out_dtype(dtype, cast)

        if is_installed("torch"):
            diff = torch_load_difference(path, w.tensors, dtype_of, w.entries)
        else:
            diff = reader_difference(path, w.tensors, dtype_of)
        diff = diff or records_difference(path, w.records)
        if diff is not None:
            raise verify_fail(path, diff)

    return check
