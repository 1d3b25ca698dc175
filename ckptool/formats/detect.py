"""Recognise a checkpoint container from its first bytes (never from its file name).

The signatures are those listed in ``shared/FORMATS.md`` and torch/serialization.py: the zip local-file
magic ``PK\\x03\\x04``; the legacy stream's first pickle, the magic number ``0x1950a86a20f9469cfc6c`` as a
protocol-2 LONG1 (``80 02 8a 0a 6c fc 9c 46 f9 20 6a a8 50 19``); the legacy tar (a first block ``tarfile`` accepts
as a header, with or without ``ustar``: :func:`is_tar`; torch.load tries it before anything but a zip);
safetensors' 8-byte little-endian header length followed by ``{``. A zip is a TorchScript archive when it holds
``constants.pkl`` under its top folder (torch/serialization.py ``_is_torchscript_zip``: ``torch.load`` hands such a
zip to ``torch.jit.load``; a ``code/`` folder beside ``data.pkl`` alone does not), a torch checkpoint when it holds
``data.pkl``, a
``torch.export`` archive (``.pt2``, :mod:`ckptool.formats.pt2`) when it holds ``archive_format``, a
``torch.package`` archive (:mod:`ckptool.formats.torch_package`) when it holds ``.data/extern_modules`` (checked
first: a package may ship a module named ``code`` or a resource named ``data.pkl``). :func:`zip_kind` is that
order, the one answer ``inspect`` (:func:`detect_format`) and ``scan`` (its zip walk) both ask.
"""

from __future__ import annotations

import importlib
import os
import re
import stat
import struct
from collections.abc import Callable, Iterator
from types import ModuleType

from ckptool import _source as source
from ckptool.errors import CkptError, CorruptCheckpointError, InputNotFoundError, NotACheckpointError, UsageError
from ckptool.formats.pickle_check import check_pickle
from ckptool.formats.unpickler import load_pickle_at
from ckptool.formats.zipdir import TorchRecords, ZipEntry, read_directory

TORCH_ZIP = "torch-zip"
TORCH_LEGACY = "torch-legacy"
TORCHSCRIPT = "torchscript"
PT2 = "torch-export"
TORCH_PACKAGE = "torch-package"
SAFETENSORS = "safetensors"
PICKLE = "pickle"
#: a zip before its members say which (:func:`zip_kind`), and torch's legacy tar (refused by the readers)
ZIP = "zip"
LEGACY_TAR = "legacy-tar"
MEGATRON_LEGACY = "megatron-legacy"  # folders: ckptool.formats.megatron
MEGATRON_DIST = "megatron-dist"

#: the name ending of a sharded set's index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``;
#: :mod:`ckptool.formats.sharded` reads it)
INDEX_SUFFIX = ".index.json"

LEGACY_MAGIC_PREFIX = bytes.fromhex("80028a0a6cfc9c46f9206aa85019")
ZIP_MAGIC = b"PK\x03\x04"
ZIP_EMPTY = b"PK\x05\x06"

# other files people rename to .pt/.pth/.bin by mistake, to say what was found instead
_KNOWN_MAGIC = [
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF", "a PDF document"),
    (b"\x1f\x8b", "a gzip archive (decompress it first)"),
    (b"BZh", "a bzip2 archive (decompress it first)"),
    (b"\xfd7zXZ\x00", "an xz archive (decompress it first)"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras/TensorFlow weights?)"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"\x93NUMPY", "a NumPy .npy array (load it with numpy.load)"),
    (b"<!DOCTYPE", "an HTML page (a failed download?)"),
    (b"<html", "an HTML page (a failed download?)"),
    (b"version https://git-lfs", "a Git LFS pointer, not the file itself (run `git lfs pull`)"),
]


def folder_refusal(path: str) -> str:
    """The message of a command that reads one checkpoint file, given the folder ``path``, with the route."""
    return (f"{path} is a folder, and this command reads one checkpoint file: `ckptool convert {path} -o "
            "model.safetensors` (or -o model.pt) makes one from a sharded set, a torch.distributed.checkpoint or a "
            "DeepSpeed folder; then run the command on that file")


def index_refusal(path: str) -> str:
    """The message of a command that reads one checkpoint file, given a sharded set's index ``path``."""
    return (f"{path} is the index of a sharded set, and this command reads one checkpoint file: `ckptool convert "
            f"{path} -o model.safetensors` (or -o model.pt) merges the set into one; then run the command on it")


def check_readable(path: str, st: os.stat_result | None = None) -> int:
    """Return the size of ``path`` in bytes.

    ``path`` may be a URL (:mod:`ckptool._source`); ``st``: an ``os.stat(path)`` the caller made already (not made
    again: many small files).

    Raises:
        InputNotFoundError: the path does not exist.
        UsageError: the path is a directory.
        NotACheckpointError: the file is empty.
        RemoteError: a URL could not be queried.
    """
    if source.is_url(path):
        found = source.kind(path)
        if found is None:
            raise InputNotFoundError(f"{path}: no such file; check the URL")
        if found == "directory":
            raise UsageError(f"{path} is a folder; over a URL give a checkpoint file or a sharded set's *.index.json "
                             "(torch.distributed.checkpoint folders are read on disk only)")
        size = source.file_size(path)
        if size == 0:
            raise NotACheckpointError(f"{path} is empty (0 bytes); re-upload or re-save the checkpoint")
        return size
    try:  # one stat answers all four questions (exists, folder, FIFO/device/socket, size): many small files
        st = os.stat(path) if st is None else st
    except (OSError, ValueError):  # as os.path.exists: any failure to stat is "no such file"
        raise InputNotFoundError(f"{path}: no such file; check the path") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(folder_refusal(path))
    source.refuse_special(path, mode=st.st_mode)
    size = st.st_size
    if size == 0:
        raise NotACheckpointError(f"{path} is empty (0 bytes); re-download or re-save the checkpoint")
    return size


def accepts_zip(head: bytes) -> bool:
    """A zip's local-file magic (or an empty zip's end record) at byte 0."""
    return head.startswith((ZIP_MAGIC, ZIP_EMPTY))


def accepts_safetensors(head: bytes) -> bool:
    """safetensors' 8-byte little-endian header length, then the header's ``{``."""
    return len(head) >= 9 and head[8:9] == b"{"


def accepts_pickle(head: bytes) -> bool:
    """A pickle's PROTO opcode of protocol 2 to 5 at byte 0 (what ``torch.save``'s pickles start with)."""
    return head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5


def detect_format(path: str) -> str:
    """Return one of ``torch-zip``, ``torchscript``, ``torch-export``, ``torch-package``, ``torch-legacy``,
    ``safetensors``, ``pickle``.

    Reads at most the first 512 bytes, plus the zip central directory for zip files.

    Raises:
        UsageError: missing path or a directory.
        NotACheckpointError: empty file, another known file type, or unknown bytes.
        CorruptCheckpointError: a zip whose central directory cannot be read (truncated download).
    """
    size = check_readable(path)
    with source.open_binary(path) as f:
        head = f.read(512)
    kind = next(head_kinds(head), None)
    if kind == ZIP:
        return _zip_kind(path)
    if kind == LEGACY_TAR:  # torch.load tries tarfile before the legacy stream (serialization.py _legacy_load)
        raise NotACheckpointError(
            f"{path} is a tar archive: the torch legacy tar format (torch < 0.4) is not supported; "
            "load it with an old torch and re-save it with torch.save (and run `ckptool scan` on it first: "
            "torch.load unpickles its members)"
        )
    if kind == TORCH_LEGACY:
        return TORCH_LEGACY
    if kind == SAFETENSORS:
        n = struct.unpack("<Q", head[:8])[0]
        if n + 8 > size:
            raise CorruptCheckpointError(
                f"{path} looks like safetensors but its header length ({n} bytes) runs past the end of the "
                f"file ({size} bytes): truncated or not safetensors; re-download it"
            )
        return SAFETENSORS
    if kind is not None and kind != PICKLE:  # a format its first bytes alone decide (HEAD_ACCEPTS)
        return kind
    if kind == PICKLE or (kind is None and _is_old_pickle(path, head)):
        return PICKLE
    for magic, what in _KNOWN_MAGIC:
        if head.startswith(magic):
            raise NotACheckpointError(f"{path} is {what}, not a PyTorch checkpoint")
    if path.endswith(".index.json"):
        raise NotACheckpointError(index_refusal(path))
    raise NotACheckpointError(
        f"{path} is not a PyTorch checkpoint (first bytes {head[:8].hex(' ')}): expected a torch zip or legacy "
        "file, a TorchScript archive or safetensors"
    )


#: the opcodes a pickle of protocol 0 or 1 can start with (it has no PROTO header: ``pickle.dump(obj, f, 0)``,
#: Python 2's default): MARK, EMPTY_DICT/LIST/TUPLE, NONE, the ints, floats and strings, GLOBAL
_OLD_PICKLE_FIRST = frozenset(b"(}])NIJKLMFGSTUVXc")


def _is_old_pickle(path: str, head: bytes) -> bool:
    """The local file ``path`` (first bytes ``head``) is one pickle of protocol 0 or 1: its opcodes walk
    (:func:`~ckptool.formats.pickle_check.check_pickle`, nothing built) from byte 0 to a STOP at its last byte, as
    ``pickle.load`` reads it and as ``ckptool scan`` walks it. Asked only of a file no other format accepted; the
    walk stops at the first byte that is no opcode, so text and other files cost a few bytes."""
    if not head or head[0] not in _OLD_PICKLE_FIRST or source.is_url(path):
        return False
    with source.open_binary(path) as f, source.whole_view(f) as buf:
        try:
            return check_pickle(buf, 0, len(buf), what=path, exact=True) == len(buf)
        except CkptError:
            return False


#: the file names ``ckptool scan`` takes for a checkpoint's when it walks a folder (beside first bytes that are a
#: zip's or a pickle's, :func:`starts_like_checkpoint`), and the one-checkpoint folder answer of
#: :data:`ckptool.formats.folders.FOLDER_ACCEPTS` too
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".jit", ".tar", ".zip", ".safetensors",
                       ".model", ".pts", ".torchscript", ".mar", ".npy", ".joblib", ".dat", ".data", ".distcp",
                       ".pt2", ".nemo")


def starts_like_checkpoint(head: bytes) -> bool:
    """``head`` (a file's first 4 bytes or more) is a zip's local header or a pickle's PROTO opcode of protocol 2 to
    5: a file a folder walk takes for a checkpoint whatever its name."""
    return head.startswith(b"PK\x03\x04") or accepts_pickle(head)


def file_starts_like_checkpoint(path: str, *, unreadable: bool = False) -> bool:
    """:func:`starts_like_checkpoint` of the first bytes of the regular file ``path``; a FIFO, device or socket is
    never opened (False), and a file that may not be read (no permission) is ``unreadable``: ``scan`` counts it
    (a result with an error, never left out), the folder classifier does not."""
    try:
        with source.open_regular(path) as f:
            return starts_like_checkpoint(f.read(4))
    except PermissionError:
        return unreadable
    except (OSError, CkptError):
        return False


#: the magic number a torch legacy stream starts with, as its first pickle (any protocol)
LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C


#: the opcodes that make an int past BININT's 32 bits (INT and LONG as text, LONG1, LONG4): the restricted unpickler
#: makes ints of no other opcode (a call gives a node), so a first pickle without one of these bytes is no magic number
_INT_OPCODES = (b"I", b"L", b"\x8a", b"\x8b")


def is_legacy_stream(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts with a pickle of torch's legacy magic number, in any pickle
    protocol (``torch.save(..., _use_new_zipfile_serialization=False, pickle_protocol=4)`` writes it with FRAME),
    as ``torch.load``'s ``_legacy_load`` reads it."""
    if head.startswith(LEGACY_MAGIC_PREFIX):
        return True
    if head[:1] != b"\x80" or head[1:2] not in (b"\x03", b"\x04", b"\x05"):
        return False
    first = bytes(head[:64])
    if not any(op in first[2:] for op in _INT_OPCODES):
        return False  # no opcode there makes an int that large: not read (most plain pickles, issue 52)
    try:
        value, _up, _end = load_pickle_at(first, 0, "magic number")
    except CkptError:
        return False
    return type(value) is int and value == LEGACY_MAGIC_NUMBER


def tarfile_module() -> ModuleType:
    """The standard library's ``tarfile``, imported the first time a file that is not a zip is looked at (for
    :func:`is_tar`, and scan's walk of a legacy tar): it imports ``shutil``, ``bz2``, ``lzma``..., which the start-up
    of a command on a zip does without."""
    return importlib.import_module("tarfile")


def is_tar(head: bytes) -> bool:
    """True when ``head`` (a file's first 512 bytes or more) starts with a tar header that Python's ``tarfile``
    accepts (``tarfile.TarInfo.frombuf``: its checksum matches, its number fields parse; or a block of zeros, an
    empty archive), with or without the POSIX
    ``ustar`` magic (old V7 tars have none): ``torch.load`` opens any file that is not a zip with
    ``tarfile.open(mode="r:")`` first and, when that works, loads it as a legacy tar checkpoint
    (torch/serialization.py ``_legacy_load``), even when its first bytes also parse as a pickle."""
    if _surely_not_tar(bytes(head[:512])):
        return False
    tarfile = tarfile_module()
    try:
        tarfile.TarInfo.frombuf(bytes(head[:512]), "utf-8", "surrogateescape")
    except tarfile.HeaderError as e:  # a block of zeros: tarfile opens an empty archive (torch.load then fails)
        return type(e).__name__ == "EOFHeaderError"
    return True


#: the bytes with the high bit set: a tar header's checksum over signed chars counts each 256 less
_HIGH_BYTES = bytes(range(128, 256))


def _surely_not_tar(block: bytes) -> bool:
    """True when ``tarfile.TarInfo.frombuf(block)`` surely refuses ``block`` (a file's first 512 bytes or fewer) for
    another reason than an end-of-archive block: it is not 512 bytes long, or its checksum field (bytes 148-156, octal
    digits up to a NUL) does not parse or matches neither the unsigned nor the signed sum of the other bytes plus 256
    (tarfile's ``nti`` and ``calc_chksums``, whose steps this repeats). A file that is no tar is told so without
    importing ``tarfile`` (and the ``shutil``, ``bz2``, ``lzma`` it imports: about 10 ms of a scan of many small
    pickles, issue 52); False leaves the answer to ``tarfile`` (a zero block, a base-256 field, a matching sum)."""
    if len(block) != 512:
        return True  # tarfile: an empty or truncated header, neither of them an end-of-archive block
    if not block.strip(b"\0"):
        return False  # a block of zeros: tarfile's end of archive
    field = block[148:156]
    if field[0] in (0o200, 0o377):
        return False  # a base-256 number: tarfile's reading
    try:
        chksum = int(field.split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
    except ValueError:
        return True  # tarfile: "invalid header"
    rest = block[:148] + block[156:]
    unsigned = 256 + sum(rest)
    signed = unsigned - 256 * (len(rest) - len(rest.translate(None, _HIGH_BYTES)))
    return chksum not in (unsigned, signed)


#: THE classifier of a file's first bytes (at least 512, for the tar test): each container answers "is this
#: mine?" (as Pillow's plug-ins answer ``_accept(prefix)``), in the order torch.load tries them (a zip, then
#: ``tarfile``, then the legacy stream's magic number; safetensors and plain pickles after). The readers
#: (:func:`detect_format`) take the first answer; ``scan`` walks the file as each answer in turn until one reads
#: (a tar ``tarfile`` cannot read after all, a safetensors header past the end), then as bytes that begin like
#: a pickle (protocol 0 and 1 too, which no loader of checkpoints reads).
HEAD_ACCEPTS: tuple[tuple[str, Callable[[bytes], bool]], ...] = (
    (ZIP, accepts_zip), (LEGACY_TAR, is_tar), (TORCH_LEGACY, is_legacy_stream),
    (SAFETENSORS, accepts_safetensors), (PICKLE, accepts_pickle))


def head_kinds(head: bytes) -> Iterator[str]:
    """The containers of :data:`HEAD_ACCEPTS` that accept ``head`` (a file's first bytes), in order, each asked
    only when the earlier answers were taken or passed over (a zip never imports ``tarfile``)."""
    return (name for name, accept in HEAD_ACCEPTS if accept(head))


_zip_cache: dict[tuple[object, ...], list[ZipEntry]] = {}


def zip_entries(path: str) -> list[ZipEntry]:
    """The central directory of the zip at ``path`` (:func:`ckptool.formats.zipdir.read_directory`), parsed once per
    file version: format detection and reading share it.

    Raises:
        CorruptCheckpointError: the central directory cannot be read.
    """
    def read() -> list[ZipEntry]:
        with source.open_binary(path) as f:
            return read_directory(f, f.seek(0, os.SEEK_END), path)

    return source.per_version(_zip_cache, path, read, keep=1, remote=True)


_TORCHSCRIPT_MEMBER = re.compile(r"\n(?:[^/\n]*/)?constants\.pkl\n")
_DATA_PKL_MEMBER = re.compile(r"\n(?:[^/\n]*/)?data\.pkl\n")
#: the member every torch.package archive holds (torch/package/package_exporter.py ``_write_mock_and_extern``)
_PACKAGE_MEMBER = re.compile(r"\n(?:[^/\n]*/)?\.data/extern_modules\n")


#: the bytes :func:`ckptool.formats.native.describe_native` reads of a native binary (a PE header may start a few
#: hundred bytes in)
NATIVE_HEAD_BYTES = 4096


def may_be_native(head: bytes) -> bool:
    """True when the first 4 bytes of ``head`` are one of the magics of a native binary (ELF, Mach-O, a universal
    Mach-O, PE's ``MZ``) that :func:`ckptool.formats.native.describe_native` reads further."""
    return head[:4] in (b"\x7fELF", b"\xfe\xed\xfa\xce", b"\xfe\xed\xfa\xcf", b"\xce\xfa\xed\xfe",
                        b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe", b"\xca\xfe\xba\xbf") or head[:2] == b"MZ"


def is_pt2_names(names: list[str]) -> bool:
    """Whether zip member ``names`` are a ``torch.export`` archive's: an ``archive_format`` record at the top
    level or under the one top folder."""
    return any(n == "archive_format" or (n.count("/") == 1 and n.endswith("/archive_format")) for n in names)


def zip_kind(entries: list[ZipEntry], records: TorchRecords | None = None) -> str | None:
    """The one answer to "which zip is this?" from its members' names (``inspect``, the readers and ``scan`` ask
    it), in this order: ``torch-package`` (``.data/extern_modules``), ``torchscript`` (``constants.pkl`` under the
    top folder, as torch's ``_is_torchscript_zip`` decides), ``torch-zip`` (``data.pkl``, found as torch finds it:
    ignoring case, :class:`~ckptool.formats.zipdir.TorchRecords` ``records`` when the caller has them),
    ``torch-export`` (``archive_format``), else None (a zip no torch loader reads)."""
    names = [e.name for e in entries]
    # one search over all the names (50,000 records in a large state_dict) instead of a Python loop
    text = "\n" + "\n".join(names) + "\n"
    if text.count("\n") == len(names) + 1:
        # (the expression scans every name; the literal searches rule most archives out far faster)
        script = "constants.pkl\n" in text and _TORCHSCRIPT_MEMBER.search(text) is not None
        data = _DATA_PKL_MEMBER.search(text) is not None
        package = "extern_modules\n" in text and _PACKAGE_MEMBER.search(text) is not None
    else:  # a member name holds a newline: look at each name
        leaf = {n.split("/", 1)[1] if "/" in n else n for n in names}
        script = "constants.pkl" in leaf
        data = "data.pkl" in leaf
        package = ".data/extern_modules" in leaf
    if not data:  # torch finds data.pkl ignoring case (archive/DATA.PKL)
        data = (records if records is not None else TorchRecords(entries)).find("data.pkl") is not None
    if package:
        return TORCH_PACKAGE
    if script:
        return TORCHSCRIPT
    if not data and is_pt2_names(names):
        return PT2
    return TORCH_ZIP if data else None


def _zip_kind(path: str) -> str:
    entries = zip_entries(path)
    kind = zip_kind(entries)
    if kind is not None:
        return kind
    names = [e.name for e in entries]
    raise NotACheckpointError(
        f"{path} is a zip archive without data.pkl, not a torch checkpoint ({len(names)} entries, "
        f"e.g. {', '.join(names[:3]) or 'none'})"
    )
