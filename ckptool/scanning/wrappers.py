"""The wrappers walk of ``ckptool scan`` (:class:`WrapperWalk`, a base class of
:class:`ckptool.scanning.pickles.Scanner`): what no checkpoint reader reads but a loader may unpack, scanned inside
within a budget: gzip and zlib streams, ``.npy`` object arrays, tar archives and their members (configs, zips,
wrappers), 7z archives (:mod:`ckptool.scanning.seven_zip`). Nothing is imported or called from the file.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, BinaryIO

from ckptool.errors import CkptError, CorruptCheckpointError
from ckptool.formats.pickle_check import PickleBuffer
from ckptool.model.allowlist import rate_target
from ckptool.scanning import layouts
from ckptool.scanning.byte_windows import ZIP_EOCD, ZIP_LOCAL
from ckptool.scanning.configs import hydra_targets, is_config_name, parse_config, target_where
from ckptool.scanning.layouts import Layout
from ckptool.scanning.results import PickleFinding, ScanResult
from ckptool.scanning.tar import PICKLE_FIRST, inside, join_where, scan_tar

__all__ = ["GZIP_MAGIC", "INFLATE_BUDGET", "MAX_ZIP_DEPTH", "NPY_MAGIC", "SEVEN_ZIP_MAGIC", "NotAPickle",
           "WrapperWalk", "is_wrapper", "is_zlib"]

#: zips inside zips are scanned this deep; a zip deeper still is an unreadable finding (the verdict is then no
#: better than ``error``)
MAX_ZIP_DEPTH = 16
#: the bytes a scan inflates (or copies, for nested zips) from zip members and wrappers: this plus
#: :data:`~ckptool.formats.zipdir.MAX_RATIO` times the file's size; members past it are unreadable findings. Members
#: sharing one local header are read once.
INFLATE_BUDGET = 64 << 20
#: the first bytes of a gzip stream (RFC 1952), of a .npy array (numpy.lib.format), of a 7z archive
GZIP_MAGIC = b"\x1f\x8b"
NPY_MAGIC = b"\x93NUMPY"
SEVEN_ZIP_MAGIC = b"7z\xbc\xaf\x27\x1c"


def is_zlib(head: bytes) -> bool:
    """A zlib stream header (RFC 1950: deflate with a 32 KiB window, ``x``, the check bits right, no preset
    dictionary), as ``zlib.compress`` and joblib's ``compress`` write: ``x\x9c``, ``x\x01``, ``x\xda``. Smaller
    windows are left out: their first bytes (``(``, ``H``, ``X``, ``h``) are also opcodes a pickle starts with."""
    return len(head) >= 2 and head[0] == 0x78 and (head[0] << 8 | head[1]) % 31 == 0 and not head[1] & 0x20


def is_wrapper(head: bytes) -> bool:
    """``head`` (a member's first bytes) starts a gzip or zlib stream or a 7z archive: scanned as a file of its own
    when met inside a zip or tar (:meth:`Scanner.member_file`)."""
    return head.startswith((GZIP_MAGIC, SEVEN_ZIP_MAGIC)) or is_zlib(head)


def _inflate(data: bytes, kind: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the ``gzip`` or ``zlib`` stream ``data``, inflated (a stream that ends early
    raises ``EOFError``)."""
    if kind == "gzip":
        with gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb") as gz:
            return gz.read(limit)
    d = zlib.decompressobj()
    out = d.decompress(data, limit)
    if not d.eof and len(out) < limit:
        raise EOFError("the zlib stream ends before its end")
    return out


class NotAPickle(Exception):
    """:meth:`Scanner.any`: the bytes are no container the scan knows and do not start as a pickle."""


class WrapperWalk:
    """The wrappers walk of a scan, a base class of :class:`~ckptool.scanning.pickles.Scanner`, which provides the
    attributes and methods declared here (the container walk, the recording of findings)."""

    res: ScanResult
    #: the pickles torch's loader reads (every other one is hidden)
    loaded: set[str]
    #: bytes left to inflate from zip members (:data:`INFLATE_BUDGET`), set from the file's size
    inflate_left: int | None

    if TYPE_CHECKING:  # provided by Scanner
        @property
        def budget_words(self) -> str: ...
        def record(self, finding: PickleFinding, root: Any = None, uncalled: Collection[str] = ()) -> None: ...
        def record_global(self, name: str, status: str, reason: str, where: str) -> None: ...
        def note(self, text: str) -> None: ...
        def any(self, buf: PickleBuffer, where: str, depth: int, f: BinaryIO | None = None) -> Layout: ...
        def parse(self, buf: PickleBuffer, pos: int, where: str, *, required: bool = True) -> int | None: ...
        def parse_root(self, buf: PickleBuffer, pos: int, where: str) -> tuple[Any, int] | None: ...
        def pickles_in_a_row(self, buf: PickleBuffer, pos: int, where: str, *,
                             first_required: bool = True) -> int | None: ...
        def trailing(self, buf: PickleBuffer, pos: int, where: str, depth: int) -> None: ...
        def appended_zip(self, buf: PickleBuffer, pos: int, where: str, depth: int) -> bool: ...

    def gzip(self, buf: PickleBuffer, where: str, depth: int) -> None:
        """A gzip stream (``.pkl.gz``, ``.tar.gz``, a ``.nemo`` archive): :meth:`inflated`."""
        self.inflated(buf, where, depth, "gzip")

    def inflated(self, buf: PickleBuffer, where: str, depth: int, kind: str) -> None:
        """A ``gzip`` or ``zlib`` stream (``.pkl.gz``, ``.tar.gz``, a ``.nemo`` archive, a joblib file dumped with
        ``compress``): inflated within the bytes left to inflate (:attr:`inflate_left`) and scanned as a file
        (:meth:`any`); a stream inflating past the budget, or damaged, is an unreadable finding, never skipped."""
        label = join_where(where, f"{kind} content")
        if depth >= MAX_ZIP_DEPTH:
            self.record(PickleFinding(label, 0, [], f"not read: wrappers nested more than {MAX_ZIP_DEPTH} deep"))
            return
        left = self.inflate_left if self.inflate_left is not None else INFLATE_BUDGET
        try:
            data = _inflate(bytes(buf), kind, left + 1)
        except (OSError, EOFError, zlib.error) as err:
            if kind == "zlib" and where:  # two bytes are a weak signature: a member that merely starts like one
                self.note(f"{where} starts like a zlib stream but does not inflate ({err})")
                return
            self.record(PickleFinding(label, 0, [], f"the {kind} stream could not be inflated ({err})",
                                      truncated=isinstance(err, EOFError)))
            return
        if len(data) > left:
            self.record(PickleFinding(label, 0, [], (
                f"not read: it inflates to more than {self.budget_words} (a {kind} bomb?)")))
            return
        if self.inflate_left is not None:
            self.inflate_left -= len(data)
        self.note(f"{where or 'the file'} is {kind}-compressed; its {len(data)} inflated bytes were scanned")
        self.member_file(data, label, depth + 1)

    def npy(self, buf: PickleBuffer, where: str, depth: int) -> None:
        """A ``.npy`` array (numpy's format: magic, version, header length, header dict): an object array
        (``descr`` ``|O``) holds a pickle after its header, which ``numpy.load(allow_pickle=True)`` unpickles:
        read as pickles in a row. A numeric array holds no pickle."""
        head = bytes(buf[:12])
        major = head[6] if len(head) > 6 else 0
        width = 2 if major == 1 else 4
        if len(head) < 8 + width or major not in (1, 2, 3):
            self.note(f"{where or 'the file'} starts like a .npy array but its header is not readable")
            return
        start = 8 + width + int.from_bytes(head[8:8 + width], "little")
        header = bytes(buf[8 + width:start])
        if b"'|O'" not in header and b'"|O"' not in header:
            return
        label = join_where(where, "npy object array")
        self.loaded.add(label)
        if start >= len(buf):
            self.record(PickleFinding(label, start, [], "the object array's pickle is missing: the file is cut short",
                                      truncated=True))
            return
        rest = self.pickles_in_a_row(buf, start, label)
        if rest is not None and rest < len(buf):
            self.trailing(buf, rest, where, depth)

    def member_file(self, data: bytes, label: str, depth: int) -> None:
        """Bytes inside a wrapper (a gzip stream, a tar member) scanned as a file of their own (:meth:`any`); bytes
        that are no checkpoint at all are a note."""
        try:
            self.any(data, label, depth)
        except NotAPickle:
            self.note(f"{label} is not a pickle, a zip or a tar (no loader unpickles it)")

    def config_member(self, data: bytes, label: str) -> None:
        """A YAML or JSON config beside the weights (a NeMo archive's ``model_config.yaml``): every Hydra
        ``_target_`` rated as a global (:func:`~ckptool.model.allowlist.rate_target`), where it is named by the
        config and its key path; a config that cannot be parsed within the bounds is a note."""
        try:
            targets = list(hydra_targets(parse_config(data, label)))
        except CkptError as err:
            self.note(f"the config {label} was not read ({err})")
            return
        for target, path, use in targets:
            status, reason = rate_target(target)
            if use != "called":
                reason += (" (_partial_: a functools.partial of it, called later)" if use == "partial" else
                           " (_call_: false: imported, not called)")
            self.record_global(target, status, reason, target_where(label, path))

    def tar_member(self, data: bytes, name: str, label: str, depth: int) -> bool:
        """A tar member that is not a legacy torch record, read by what it is: a config (:meth:`config_member`), a
        zip, a .npy array, a gzip or zlib stream or a 7z archive (:meth:`member_file`). False when it is none of
        these (the tar walk reads it as pickles)."""
        if is_config_name(name):
            self.config_member(data, label)
            return True
        if data.startswith((ZIP_LOCAL, ZIP_EOCD, NPY_MAGIC)) or is_wrapper(data[:8]):
            self.member_file(data, label, depth + 1)
            return True
        return False

    def tar_archive(self, buf: PickleBuffer, head: bytes, where: str, depth: int) -> Layout | None:
        """A tar archive (its first header valid): its members, the pickle ``pickle.load`` would read at byte 0, a
        zip appended after its members. Returns :data:`~ckptool.scanning.layouts.LEGACY_TAR` when a member has a
        legacy record's name, else :data:`~ckptool.scanning.layouts.TAR`; None (a note) when ``tarfile`` cannot
        read the archive after all."""
        try:
            end, legacy = scan_tar(self, buf, where, depth)
        except CorruptCheckpointError as err:
            self.note(f"the tar header at byte 0{inside(where)} is valid but the archive could not be read ({err})")
            return None
        if head[0] in PICKLE_FIRST:  # pickle.load (and tools that use it) read the file's first bytes
            self.parse(buf, 0, join_where(where, "pickle at byte 0 (read by pickle.load, not torch.load)"),
                       required=False)
        self.appended_zip(buf, max(512, end), where, depth)  # not the zip of a member (scanned as the member)
        return layouts.LEGACY_TAR if legacy else layouts.TAR
