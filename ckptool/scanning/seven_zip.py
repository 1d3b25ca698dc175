"""7z archives in ``ckptool scan``: each member inflated by ``py7zr`` (the ``7z`` extra) within the scan's
inflate budget and member bound, then scanned as a file (:meth:`ckptool.scanning.pickles.Scanner.member_file`).
Imported only when a file starts with the 7z signature. Nothing is extracted to disk; nothing is imported or run.
"""

from __future__ import annotations

import io
from typing import Any

from ckptool.errors import CkptError
from ckptool.scanning.pickles import INFLATE_BUDGET, Container, Scanner
from ckptool.scanning.results import PickleFinding
from ckptool.scanning.tar import MAX_TAR_MEMBERS, join_where, leaves_archive

__all__ = ["scan_7z"]


def scan_7z(sc: Scanner, buf: Container, where: str, depth: int) -> None:
    """Scan the 7z archive ``buf``: at most :data:`~ckptool.scanning.tar.MAX_TAR_MEMBERS` members, together no more
    than the bytes left to inflate (:attr:`Scanner.inflate_left`); a member path that leaves the archive is a note.
    Without ``py7zr``, or for an archive it cannot read (encrypted, damaged), an unreadable finding: never skipped.
    """
    label = join_where(where, "7z archive")
    try:
        import py7zr  # noqa: PLC0415 (the 7z extra, for 7z archives only)
        from py7zr.io import Py7zIO, WriterFactory  # noqa: PLC0415
    except ImportError:
        sc.record(PickleFinding(label, 0, [], "not read: reading 7z archives needs py7zr (pip install 'ckptool[7z]')"))
        return
    left = sc.inflate_left if sc.inflate_left is not None else INFLATE_BUDGET

    class Budgeted(Py7zIO):  # one member's bytes, within the archive's shared budget
        def __init__(self, budget: list[int]) -> None:
            self.budget = budget
            self.buf = io.BytesIO()

        def write(self, s: Any) -> int:
            n = min(len(s), self.budget[0])
            self.budget[0] -= len(s)
            return self.buf.write(bytes(s[:n]))

        def read(self, size: int | None = None) -> bytes:
            return self.buf.read(size)

        def seek(self, offset: int, whence: int = 0) -> int:
            return self.buf.seek(offset, whence)

        def flush(self) -> None:
            self.buf.flush()

        def size(self) -> int:
            return self.buf.getbuffer().nbytes

    class Factory(WriterFactory):
        def __init__(self) -> None:
            self.budget = [left]
            self.products: dict[str, Budgeted] = {}

        def create(self, filename: str) -> Budgeted:
            product = self.products[filename] = Budgeted(self.budget)
            return product

    try:
        with py7zr.SevenZipFile(io.BytesIO(bytes(buf[:len(buf)])), mode="r") as archive:
            infos = archive.list()
            if len(infos) > MAX_TAR_MEMBERS:
                raise CkptError(f"more than {MAX_TAR_MEMBERS} members")
            declared = sum(i.uncompressed or 0 for i in infos)
            if declared > left:
                raise CkptError(f"its members come to {declared} bytes, over the {left} bytes left to inflate "
                                "(a 7z bomb?)")
            for info in infos:
                why = leaves_archive(info.filename, bool(getattr(info, "is_symlink", False)))
                if why:
                    sc.note(f"7z member {info.filename!r}{' in ' + where if where else ''} {why}")
            factory = Factory()
            archive.extractall(factory=factory)
    except CkptError as err:
        sc.record(PickleFinding(label, 0, [], f"not read: {err}"))
        return
    except Exception as err:  # py7zr's errors (Bad7zFile, PasswordRequired, lzma/zlib errors, EOF) have no base
        sc.record(PickleFinding(label, 0, [], f"the 7z archive could not be read ({type(err).__name__}: {err})"))
        return
    if factory.budget[0] < 0:
        sc.record(PickleFinding(label, 0, [], "not read: its members inflate past the bytes left to inflate "
                                              "(their headers understate them: a 7z bomb?)"))
        return
    if sc.inflate_left is not None:
        sc.inflate_left = factory.budget[0]
    sc.note(f"{where or 'the file'} is a 7z archive of {len(factory.products)} members; each was scanned")
    for name, product in factory.products.items():
        sc.member_file(product.buf.getvalue(), join_where(where, f"7z member {name}"), depth + 1)
