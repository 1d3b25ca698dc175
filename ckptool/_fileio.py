"""Safe output files and byte-range copies: the one home of atomic output, umask, fsync and range copy.

:func:`atomic_output` writes to a temporary file in the destination folder, fsyncs it, renames it into place
and fsyncs the folder; on any failure (or KeyboardInterrupt) the temporary file is removed and the destination is
left as it was. :func:`copy_range` copies a byte range between files with ``os.copy_file_range`` where the kernel
offers it (no user-space copy), else in 8 MiB chunks, so memory stays bounded whatever the size; as it goes,
:class:`WriteBehind` starts the write-back of what was copied (``sync_file_range``), so that the final fsync has
little left to do. On a filesystem with reflinks (XFS ``reflink=1``, btrfs), :func:`copy_range` clones the
block-aligned part of a range (:func:`clone_range`, ``FICLONERANGE``) when source and destination offsets are
congruent modulo the block size (:func:`clone_block` says whether cloning works and at which block size), so
the data is shared, not copied.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import os
import re
import shutil
import stat
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO, cast

try:
    import fcntl
except ImportError:  # not POSIX: no ioctl, so no clones
    fcntl = None  # type: ignore[assignment]

from ckptool import _commit
from ckptool import _source as source
from ckptool._commit import hold_signals
from ckptool.errors import CkptError, CorruptCheckpointError, OutputError, UsageError, os_error_advice

CHUNK = 8 << 20


def current_umask() -> int:
    """The process's file mode creation mask (``os.umask`` read, unchanged): the mode a new file would get."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


TMP_SUFFIX = ".ckptool-tmp"
_NODE = os.uname().nodename if hasattr(os, "uname") else os.environ.get("COMPUTERNAME", "")
_HOST = "".join(c if c.isalnum() or c in "-_" else "_" for c in _NODE)[:32] or "host"


def temp_prefix(dst: str) -> str:
    """The name every temporary file for ``dst`` starts with: ``.<name>.ckptool-<host>-<pid>-`` (hidden, in the
    destination folder; ``<name>`` cut to 120 characters), followed by a random part and ``.ckptool-tmp``."""
    return f".{os.path.basename(dst)[:120]}.ckptool-{_HOST}-{os.getpid()}-"


#: the random part ``tempfile.mkstemp`` / ``mkdtemp`` put in a name (``tempfile._RandomNameSequence``: 8 characters)
_RANDOM = "[a-z0-9_]{8}"


def _stale_name(base: str) -> re.Pattern[str]:
    """The names :func:`temp_prefix` + ``mkstemp`` give the temporary files of a destination named ``base``: host,
    pid, random part; (a leading ``..`` and a second such part: the temporary file of an atomic write whose
    destination was itself a scratch file)."""
    one = rf"\.ckptool-(?P<host>.+?)-(?P<pid>\d+)-{_RANDOM}{re.escape(TMP_SUFFIX)}"
    nested = rf"\.ckptool-.+?-\d+-{_RANDOM}{re.escape(TMP_SUFFIX)}"
    return re.compile(rf"\.\.?{re.escape(base[:120])}{one}(?:{nested})?")


def remove_stale_temps(dst: str) -> list[str]:
    """Delete the temporary files that an earlier write of ``dst`` left behind when its process was killed
    (SIGKILL, power loss: nothing could clean up): :func:`atomic_output`'s temporary files and convert's shard
    scratch files, named ``.<name>.ckptool-<host>-<pid>-<random>.ckptool-tmp`` (:func:`temp_prefix`, the 8
    characters of ``tempfile``'s random part). One is stale when it was made on this host by a process that no
    longer runs, or, from another host (a shared filesystem), when it has not changed for a day.

    Only what can be ours is deleted: a regular file (not a symbolic link, not a folder: a folder planted under such
    a name is never deleted with its content, and neither is a DCP staging folder a killed run left, which is
    safe to delete by hand), owned by this user, with no other hard link, whose whole name has that form. Returns
    the paths removed; errors are ignored (the file may belong to someone else).
    """
    folder, base = os.path.split(os.path.abspath(dst))
    pattern = _stale_name(base)
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(folder) if n.endswith(TMP_SUFFIX)]
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or (
                    hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
                continue
            here = m["host"] == _HOST  # a process of this host that has gone, else a day old
            if not _pid_alive(int(m["pid"])) if here else time.time() - st.st_mtime > 24 * 3600:
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


@contextlib.contextmanager
def temp_path(near: str, *, folder: bool = False) -> Iterator[str]:
    """A temporary file (or, with ``folder``, an empty folder) beside ``near``, on its filesystem, named as
    :func:`atomic_output` names its temporary files; removed when the block ends, however it ends, unless the block
    renamed it away. A run killed outright (SIGKILL) leaves it behind for the next write of ``near`` to remove
    (:func:`remove_stale_temps`). Convert's shard scratch files and DCP staging folders are made here.

    Raises:
        UsageError: the folder of ``near`` does not exist.
        OutputError: the file or folder cannot be made there.
    """
    near = os.path.abspath(near)
    parent = os.path.dirname(near)
    if not os.path.isdir(parent):
        raise UsageError(f"output folder {parent} does not exist; create it first or choose another -o path")
    remove_stale_temps(near)
    release = hold_signals()
    try:
        if folder:
            path = tempfile.mkdtemp(prefix=temp_prefix(near), suffix=TMP_SUFFIX, dir=parent)
        else:
            fd, path = tempfile.mkstemp(prefix=temp_prefix(near), suffix=TMP_SUFFIX, dir=parent)
            os.close(fd)
    except OSError as e:
        release()
        raise _cannot_write_in(parent, e) from e
    try:
        release()
        yield path
    finally:
        if folder:
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 sends nothing (this process included): does ``pid`` exist?
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError included: the process exists
        pass
    return True


#: errno values only a write raises: such an OSError inside an :func:`atomic_output` block, raised by code that
#: wrote to the output's file descriptor directly, is about the output
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def _write_error(dst: str, e: OSError) -> OutputError:
    advice = os_error_advice(e.errno)
    return OutputError(f"writing {dst} failed: {e.strerror or e}; nothing was written"
                       + (f" ({advice})" if advice else ""), dst, e.errno)


class _OutputFile(io.BufferedRandom):
    """The file :func:`atomic_output` yields: an ``OSError`` from any of :data:`_OUTPUT_METHODS` (a write, the flush
    that a seek or close makes, a read back) is an error writing ``dst`` and is raised as :class:`OutputError`
    naming it."""

    def __init__(self, fd: int, dst: str) -> None:
        super().__init__(io.FileIO(fd, "r+"))
        self.dst = dst

    def discard(self) -> None:
        """Close without flushing what is still buffered (the output is being thrown away)."""
        with contextlib.suppress(OSError):
            self.raw.close()  # a closed raw file makes close() skip the flush
        with contextlib.suppress(OSError):
            super().close()


#: the methods of :class:`_OutputFile` whose ``OSError`` is about the output file
_OUTPUT_METHODS = ("write", "flush", "seek", "truncate", "read", "readinto", "close")


def _blaming_output(name: str) -> Callable[..., object]:
    base = getattr(io.BufferedRandom, name)

    def method(self: _OutputFile, *args: object) -> object:
        try:
            return base(self, *args)
        except OSError as e:
            raise _write_error(self.dst, e) from e

    method.__name__ = method.__qualname__ = name
    return method


for _name in _OUTPUT_METHODS:
    setattr(_OutputFile, _name, _blaming_output(_name))


@contextlib.contextmanager
def atomic_output(dst: str, *, mode: int | None = None) -> Iterator[BinaryIO]:
    """Yield a binary file whose content becomes ``dst`` only if the block finishes without an exception.

    The data goes to a temporary file ``.<name>.ckptool-<host>-<pid>-<random>.ckptool-tmp`` in the destination
    folder, is fsynced, and is renamed onto ``dst`` (``os.replace``, atomic on POSIX); the folder is fsynced
    too. On any failure (disk full, KeyboardInterrupt...) the temporary file is removed and ``dst`` is left as it
    was. A process killed outright (SIGKILL) cannot clean up: the next write of the same ``dst`` removes such stale
    temporary files (:func:`remove_stale_temps`).

    Errors are attributed to the file they concern: an ``OSError`` from the yielded file (write, flush, seek,
    read back), from the fsync, the chmod or the rename becomes :class:`OutputError` naming ``dst``, as does an
    ``OSError`` without a file name whose errno only a write raises (``ENOSPC``, ``EDQUOT``, ``EFBIG``, ``EROFS``:
    code that wrote to the file descriptor directly). Any other exception raised in the block (reading the input
    failed, a corrupt input, KeyboardInterrupt) propagates unchanged, after the clean-up.

    If ``dst`` is a symbolic link to an existing file, that file is replaced and the link is kept (what
    ``torch.save`` and ``cp`` do when they open the link for writing); the temporary file is made beside that file.
    A dangling link is refused: following it would create a file wherever it points (outside the output folder).

    ``mode`` sets the permission bits of the result (default: ``0o666`` less the umask, as for a new file).

    A URL ``dst`` (``s3://...``, see :mod:`ckptool._source`): the temporary file is made in the system temporary
    folder (``TMPDIR``) and uploaded to ``dst`` only once the block has finished (:func:`ckptool._source.upload`,
    which discards a failed upload, so no partial object is left); it is removed in every case.

    Raises:
        UsageError: the destination folder does not exist, ``dst`` is a directory or a dangling symbolic link.
        OutputError: the temporary file could not be made (its ``path`` is the folder) or writing, fsyncing or
            renaming it failed (its ``path`` is ``dst``); nothing was left behind.
        RemoteError: the upload to a URL ``dst`` failed; nothing was left there.
    """
    if source.is_url(dst):
        with _remote_output(dst) as f:
            yield f
        return
    named = dst = os.path.abspath(dst)
    if os.path.islink(dst):
        if not os.path.exists(dst):  # a dangling link: following it would create a file wherever it points
            raise UsageError(f"output {dst} is a symbolic link to {os.readlink(dst)}, which does not exist; ckptool "
                             "writes through a link only to an existing file: remove the link or choose another "
                             "-o path")
        dst = os.path.realpath(dst)  # write through the link: its target is replaced, the link stays
    folder = os.path.dirname(dst)
    if not os.path.isdir(folder):
        raise UsageError(f"output folder {folder} does not exist; create it first or choose another -o path")
    if os.path.isdir(dst):
        raise UsageError(f"output path {dst} is a directory; give a file name")
    remove_stale_temps(dst)
    release = hold_signals()
    try:
        fd, tmp = _make_temp(dst, folder, "choose another output folder")
    except OutputError:
        release()
        raise
    f = _OutputFile(fd, dst)
    try:
        release()  # an interrupt that came while the file was being made is raised here, where it is cleaned up
        with _blaming_writes(dst):
            yield f
        f.flush()
        try:
            os.fsync(f.fileno())
            f.close()
            os.chmod(tmp, mode if mode is not None else 0o666 & ~current_umask())
            with _commit.signals_blocked():  # renamed and recorded, or neither: the Interrupted line tells the truth
                os.replace(tmp, dst)
                _commit.mark_committed(named)
                _fsync_folder(folder)
        except OSError as e:
            raise _write_error(dst, e) from e
    except BaseException:
        f.discard()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable (fsync of the folder); not possible on every filesystem: ignored then."""
    with contextlib.suppress(OSError):
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def make_output_folder(folder: str) -> None:
    """``os.makedirs(folder)`` of a set's output folder; its failure in :func:`temp_path`'s words (OutputError)."""
    try:
        os.makedirs(folder)
    except OSError as e:
        raise _cannot_write_in(os.path.dirname(os.path.abspath(folder)), e) from e


def _cannot_write_in(folder: str, e: OSError, advice: str = "choose another output folder") -> OutputError:
    """The one sentence for an output that cannot be made in ``folder`` (the errno's advice, else ``advice``)."""
    return OutputError(f"cannot write in {folder}: {e.strerror or e}; {os_error_advice(e.errno) or advice}", folder,
                       e.errno)


def _make_temp(dst: str, folder: str, advice: str) -> tuple[int, str]:
    """``tempfile.mkstemp`` for ``dst`` in ``folder``; :func:`_cannot_write_in` ``folder`` when it fails."""
    try:
        return tempfile.mkstemp(prefix=temp_prefix(dst), suffix=TMP_SUFFIX, dir=folder)
    except OSError as e:
        raise _cannot_write_in(folder, e, advice) from e


@contextlib.contextmanager
def _blaming_writes(dst: str) -> Iterator[None]:
    """An ``OSError`` without a file name whose errno only a write raises (code that wrote to the output's file
    descriptor directly) becomes :class:`OutputError` naming ``dst``; any other exception passes unchanged."""
    try:
        yield
    except CkptError:  # an OutputError or RemoteError is an OSError too, and already says what went wrong
        raise
    except OSError as e:
        if e.filename is None and e.errno in _WRITE_ERRNOS:
            raise _write_error(dst, e) from e
        raise


@contextlib.contextmanager
def _remote_output(dst: str) -> Iterator[BinaryIO]:
    """:func:`atomic_output` for a URL: a local temporary file, uploaded when the block finishes."""
    fd, tmp = _make_temp(dst, tempfile.gettempdir(), "set TMPDIR to a folder with room for the output")
    f = _OutputFile(fd, dst)
    try:
        with _blaming_writes(dst):
            yield f
        f.close()
        source.upload(tmp, dst)
        _commit.mark_committed(dst)
    except BaseException:
        f.discard()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def file_mode(path: str) -> int | None:
    """Permission bits of ``path`` (to keep them on an in-place rewrite); None for a URL (no such bits)."""
    if source.is_url(path):
        return None
    return stat.S_IMODE(os.stat(path).st_mode)


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """``sync_file_range(2)`` from the C library (Linux; Python's ``os`` does not offer it), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", fn)


#: ``sync_file_range`` (None where the platform lacks it: write-back then starts at the final fsync)
sync_file_range = _libc_sync_file_range()
SYNC_FILE_RANGE_WRITE = 2
#: bytes written between two write-back requests
WRITEBACK_WINDOW = 16 << 20


class WriteBehind:
    """Push an output file's pages to the disk while it is being written, so that the fsync that
    :func:`atomic_output` makes at the end has little left to do: a durable copy then costs about what the
    slower of the copy and the disk costs instead of their sum.

    Every :data:`WRITEBACK_WINDOW` bytes, :meth:`written` starts the write-back of the new window
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: asynchronous, it blocks only while the device queue is full,
    which paces the copy to the disk). Waiting for earlier windows as well (``SYNC_FILE_RANGE_WAIT_*``) was
    measured slower: 2 GiB on ext4, 2 cores, 1.60 s waiting 8 windows behind against 1.39 s not waiting, with
    ``cp && sync`` at 1.45 s and one fsync at the end at 1.88 s. A hint only: durability still comes from the
    final fsync, errors are ignored (the fsync reports them), and without ``sync_file_range`` (not Linux)
    nothing is done.
    """

    def __init__(self, fd: int, start: int) -> None:
        self.fd = fd
        self.start = start  # first byte whose write-back has not been started

    def written(self, end: int) -> None:
        """The bytes before offset ``end`` are in the file (not in a user-space buffer); start their write-back
        once a window is full."""
        sfr = sync_file_range
        n = end - self.start
        if sfr is None or n < WRITEBACK_WINDOW:
            return
        sfr(self.fd, self.start, n, SYNC_FILE_RANGE_WRITE)
        self.start = end


def write_behind_for(f: BinaryIO) -> WriteBehind | None:
    """A :class:`WriteBehind` for ``f`` at its current position, or None when ``f`` is not a file on disk."""
    try:
        return WriteBehind(f.fileno(), f.tell())
    except (OSError, AttributeError, ValueError):  # io.UnsupportedOperation is both OSError and ValueError
        return None


def copy_range_crc(src: BinaryIO, dst: BinaryIO, offset: int, size: int, crc: int = 0, *,
                   progress: Callable[[int], None] | None = None, behind: WriteBehind | None = None) -> int:
    """Copy ``size`` bytes at ``offset`` of ``src`` to the current position of ``dst`` in ``CHUNK``-byte
    pieces (memory bounded by one chunk); return the CRC-32 of the bytes, continuing from ``crc``.

    ``progress`` is called with the number of bytes of each piece once it is written. When ``dst`` is a file on
    disk, the write-back of what was copied starts as the copy goes (through ``behind``, the caller's
    :class:`WriteBehind` for ``dst``, else one of its own).

    Raises:
        CorruptCheckpointError: ``src`` ended before ``size`` bytes were read.
    """
    buf = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buf)
    src.seek(offset)
    wb = behind if behind is not None else (write_behind_for(dst) if size > WRITEBACK_WINDOW else None)
    left = size
    while left:
        n = src.readinto(view[: min(left, len(buf))])  # type: ignore[attr-defined]  # BinaryIO omits readinto
        if not n:
            raise CorruptCheckpointError(
                f"{getattr(src, 'name', 'the input')} is truncated: a record ends {left} bytes early; re-download it")
        chunk = view[:n]
        crc = zlib.crc32(chunk, crc)
        dst.write(chunk)
        left -= n
        if wb is not None:
            dst.flush()
            wb.written(dst.tell())
        if progress is not None:
            progress(n)
    return crc


def _kernel_copy(sfd: int, dfd: int, offset: int, pos: int, size: int) -> int:
    """Copy up to ``size`` bytes with ``os.copy_file_range``; return how many were copied (fewer at the end of
    ``src``, 0 where the kernel or filesystem cannot: EXDEV on old kernels, ENOSYS, EINVAL...)."""
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(sfd, dfd, size - done, offset + done, pos + done)
            if n == 0:
                break
            done += n
    except OSError:
        pass
    return done


#: ``FICLONERANGE`` from linux/fs.h: ``_IOW(0x94, 13, struct file_clone_range)``
FICLONERANGE = 0x4020940D
#: errno values that mean "this filesystem (or this pair of files) cannot share extents": copy instead
_NO_CLONE = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS,
                       errno.EBADF, errno.EPERM})
MAX_CLONE_BLOCK = 32 << 10  # the largest block size laid out for (zip padding goes in a <= 65535-byte field)
CLONE_PIECE = 256 << 20  # bytes cloned by one FICLONERANGE call (progress is reported after each)


def clone_range(sfd: int, dfd: int, offset: int, pos: int, size: int) -> bool:
    """Make ``size`` bytes at ``pos`` of descriptor ``dfd`` share the extents of those at ``offset`` of ``sfd``
    (``ioctl(FICLONERANGE)``, linux/fs.h ``struct file_clone_range``): no data is read or written. ``offset``,
    ``pos`` and ``size`` must be multiples of the filesystem block size. Returns False, having changed nothing,
    where the filesystem or the pair of files cannot (``EOPNOTSUPP``, ``EXDEV``, ``EINVAL``...; not Linux).

    Raises:
        OSError: the clone failed for another reason (``ENOSPC``, ``EIO``...).
    """
    if fcntl is None or not sys.platform.startswith("linux") or size <= 0:
        return False
    try:
        fcntl.ioctl(dfd, FICLONERANGE, struct.pack("=qQQQ", sfd, offset, size, pos))
    except OSError as e:
        if e.errno in _NO_CLONE:
            return False
        raise
    return True


def clone_block(src: BinaryIO, dst: BinaryIO) -> int:
    """The block size at which byte ranges of ``src`` can be cloned into ``dst`` (:func:`clone_range`), or 0
    where they cannot: not files on disk, not on one filesystem, a filesystem without reflinks, a block size over
    :data:`MAX_CLONE_BLOCK`, or ``src`` smaller than one block.

    Found by trying: the first block of ``src`` is cloned just past the end of ``dst`` (flushed first), then
    ``dst`` is cut back to its length, so ``dst`` is left as it was. The block size is the filesystem's
    (``fstatvfs`` ``f_bsize``).
    """
    try:
        sfd, dfd = src.fileno(), dst.fileno()
        ss, ds = os.fstat(sfd), os.fstat(dfd)
        block = os.fstatvfs(dfd).f_bsize
    except (OSError, AttributeError, ValueError):  # a URL's reader, io.BytesIO, no statvfs
        return 0
    if (ss.st_dev != ds.st_dev or not stat.S_ISREG(ss.st_mode) or not stat.S_ISREG(ds.st_mode)
            or not 0 < block <= MAX_CLONE_BLOCK or block & (block - 1) or ss.st_size < block):
        return 0
    dst.flush()
    end = os.fstat(dfd).st_size
    try:
        ok = clone_range(sfd, dfd, 0, -end % block + end, block)
    except OSError:
        ok = False
    if ok:
        os.ftruncate(dfd, end)
    return block if ok else 0


def _copy_pieces(src: BinaryIO, dst: BinaryIO, sfd: int, dfd: int, offset: int, pos: int, size: int,
                 wb: WriteBehind, progress: Callable[[int], None] | None) -> None:
    """Copy ``size`` bytes from ``offset`` of ``src`` to ``pos`` of ``dst`` in :data:`WRITEBACK_WINDOW` pieces,
    by ``os.copy_file_range`` while the kernel copies, else through user space."""
    kernel = getattr(os, "copy_file_range", None) is not None  # None: switched off (tests)
    done = 0
    while done < size:
        n = min(size - done, WRITEBACK_WINDOW)
        got = _kernel_copy(sfd, dfd, offset + done, pos + done, n) if kernel else 0
        if got < n:  # no kernel copy (from here on), or the end of src: copy by hand (which reports truncation)
            kernel = False
            dst.seek(pos + done + got)
            copy_range_crc(src, dst, offset + done + got, n - got, behind=wb)
            dst.flush()
        done += n
        wb.written(pos + done)
        if progress is not None:
            progress(n)


def copy_range(src: BinaryIO, dst: BinaryIO, offset: int, size: int, *,
               progress: Callable[[int], None] | None = None, behind: WriteBehind | None = None,
               block: int = 0) -> None:
    """Copy ``size`` bytes at ``offset`` of ``src`` to the current position of ``dst`` with
    ``os.copy_file_range`` (no copy through user space) where the kernel offers it, else with
    :func:`copy_range_crc`. ``dst`` ends positioned after the copied bytes.

    With ``block`` (from :func:`clone_block`) and the destination position congruent with ``offset`` modulo
    ``block``, the whole blocks of the range are cloned instead (:func:`clone_range`: shared extents, nothing
    copied); the partial blocks at either end are copied. Where the clone fails, everything is copied.

    The copy goes in :data:`WRITEBACK_WINDOW` pieces, starting the write-back of each piece as soon as it is
    copied (through ``behind``, the caller's :class:`WriteBehind` for ``dst``, else one of its own);
    ``progress`` is called with the number of bytes of each piece.

    Raises:
        CorruptCheckpointError: ``src`` ended early.
    """
    if not hasattr(src, "fileno"):  # bytes gathered from several files (formats.segments): no kernel copy
        copy_range_crc(src, dst, offset, size, progress=progress, behind=behind)
        return
    dst.flush()
    pos = dst.tell()
    try:
        sfd = src.fileno()
    except (OSError, AttributeError, ValueError):  # not a file on disk (a URL's reader): copy through user space
        copy_range_crc(src, dst, offset, size, progress=progress, behind=behind)
        return
    dfd = dst.fileno()
    wb = behind if behind is not None else WriteBehind(dfd, pos)
    head = -pos % block if block else 0
    whole = (size - head) // block * block if block and (offset - pos) % block == 0 and size > head else 0
    if whole:
        _copy_pieces(src, dst, sfd, dfd, offset, pos, head, wb, progress)
        done = head
        while done < head + whole and clone_range(sfd, dfd, offset + done, pos + done,
                                                  min(CLONE_PIECE, head + whole - done)):
            n = min(CLONE_PIECE, head + whole - done)
            done += n
            wb.start = max(wb.start, pos + done)  # shared extents: nothing to write back
            if progress is not None:
                progress(n)
        _copy_pieces(src, dst, sfd, dfd, offset + done, pos + done, size - done, wb, progress)
    else:
        _copy_pieces(src, dst, sfd, dfd, offset, pos, size, wb, progress)
    dst.seek(pos + size)


def same_file(a: str, b: str) -> bool:
    """True when paths ``a`` and ``b`` name one file: equal absolute paths, or (both existing) the same inode through
    a hard link or a symlink (``os.path.samefile``). A path that does not exist is the same only by name."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
