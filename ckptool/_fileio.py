"""Safe output files and byte-range copies: the one home of atomic output, umask, fsync and range copy.

:func:`atomic_output` writes to a temporary file in the destination folder, fsyncs it, renames it into place
and fsyncs the folder; on any failure (or KeyboardInterrupt) the temporary file is removed and the destination is
left as it was. :func:`copy_range` copies a byte range between files with ``os.copy_file_range`` where the kernel
offers it (no user-space copy), else in 8 MiB chunks, so memory stays bounded whatever the size.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import time
import zlib
from collections.abc import Iterator
from typing import BinaryIO

from ckptool.errors import CkptError, CorruptCheckpointError, UsageError

CHUNK = 8 << 20


def _umask() -> int:
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


def remove_stale_temps(dst: str) -> list[str]:
    """Delete temporary files that an earlier write of ``dst`` left behind when its process was killed (SIGKILL,
    power loss: nothing could clean up). A temporary file is stale when it was made on this host by a process
    that no longer runs, or, from another host (a shared filesystem), when it has not changed for a day.
    Returns the paths removed; errors are ignored (the file may belong to someone else).
    """
    folder, base = os.path.split(os.path.abspath(dst))
    lead = f".{base[:120]}.ckptool-"
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(lead) and n.endswith(TMP_SUFFIX)]
    except OSError:
        return removed
    for name in names:
        host, _, rest = name[len(lead):].partition("-")
        pid_text, _, _ = rest.partition("-")
        path = os.path.join(folder, name)
        try:
            if host == _HOST and pid_text.isdigit():
                stale = not _pid_alive(int(pid_text))
            else:
                stale = time.time() - os.stat(path).st_mtime > 24 * 3600
            if stale:
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


_ADVICE = {errno.ENOSPC: "free some space or write elsewhere with -o", errno.EDQUOT: "free some space or write "
           "elsewhere with -o", errno.EACCES: "choose a folder you can write to", errno.EPERM: "choose a folder "
           "you can write to", errno.EROFS: "the filesystem is read-only: choose another output folder"}


@contextlib.contextmanager
def atomic_output(dst: str, *, mode: int | None = None) -> Iterator[BinaryIO]:
    """Yield a binary file whose content becomes ``dst`` only if the block finishes without an exception.

    The data goes to a temporary file ``.<name>.ckptool-<host>-<pid>-<random>.ckptool-tmp`` in the destination
    folder, is fsynced, and is renamed onto ``dst`` (``os.replace``, atomic on POSIX); the folder is fsynced
    too. On any failure (disk full, KeyboardInterrupt...) the temporary file is removed and ``dst`` is left as it
    was. A process killed outright (SIGKILL) cannot clean up: the next write of the same ``dst`` removes such stale
    temporary files (:func:`remove_stale_temps`).

    If ``dst`` is a symbolic link, the file it points to is replaced and the link is kept (what ``torch.save``
    and ``cp`` do when they open the link for writing); the temporary file is made beside that file.

    ``mode`` sets the permission bits of the result (default: ``0o666`` less the umask, as for a new file).

    Raises:
        UsageError: the destination folder does not exist or ``dst`` is a directory.
        CkptError: the write failed (disk full, permission denied, read-only filesystem...); nothing was left
            behind.
    """
    dst = os.path.abspath(dst)
    if os.path.islink(dst):
        dst = os.path.realpath(dst)  # write through the link: its target is replaced, the link stays
    folder = os.path.dirname(dst)
    if not os.path.isdir(folder):
        raise UsageError(f"output folder {folder} does not exist; create it first or choose another -o path")
    if os.path.isdir(dst):
        raise UsageError(f"output path {dst} is a directory; give a file name")
    remove_stale_temps(dst)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(dst), suffix=TMP_SUFFIX, dir=folder)
    except OSError as e:
        advice = _ADVICE.get(e.errno, "choose another output folder")
        raise CkptError(f"cannot write in {folder}: {e.strerror or e}; {advice}") from e
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, dst)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            advice = _ADVICE.get(e.errno)
            raise CkptError(f"writing {dst} failed: {e.strerror or e}; nothing was written"
                            + (f" ({advice})" if advice else "")) from e
        raise
    with contextlib.suppress(OSError):  # make the rename durable; not possible on every filesystem
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def file_mode(path: str) -> int:
    """Permission bits of ``path`` (to keep them on an in-place rewrite)."""
    return stat.S_IMODE(os.stat(path).st_mode)


def copy_range_crc(src: BinaryIO, dst: BinaryIO, offset: int, size: int, crc: int = 0) -> int:
    """Copy ``size`` bytes at ``offset`` of ``src`` to the current position of ``dst`` in ``CHUNK``-byte
    pieces (memory bounded by one chunk); return the CRC-32 of the bytes, continuing from ``crc``.

    Raises:
        CorruptCheckpointError: ``src`` ended before ``size`` bytes were read.
    """
    buf = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buf)
    src.seek(offset)
    left = size
    while left:
        n = src.readinto(view[: min(left, len(buf))])
        if not n:
            raise CorruptCheckpointError(
                f"{getattr(src, 'name', 'the input')} is truncated: a record ends {left} bytes early; re-download it")
        chunk = view[:n]
        crc = zlib.crc32(chunk, crc)
        dst.write(chunk)
        left -= n
    return crc


def copy_range(src: BinaryIO, dst: BinaryIO, offset: int, size: int) -> None:
    """Copy ``size`` bytes at ``offset`` of ``src`` to the current position of ``dst`` with
    ``os.copy_file_range`` (no copy through user space) where the kernel offers it, else with
    :func:`copy_range_crc`. ``dst`` ends positioned after the copied bytes.

    Raises:
        CorruptCheckpointError: ``src`` ended early.
    """
    dst.flush()
    pos = dst.tell()
    done = 0
    cfr = getattr(os, "copy_file_range", None)
    if cfr is not None:
        try:
            while done < size:
                n = cfr(src.fileno(), dst.fileno(), min(size - done, 1 << 30), offset + done, pos + done)
                if n == 0:
                    break
                done += n
        except OSError:  # EXDEV on old kernels, filesystems without support: copy the rest by hand
            pass
    dst.seek(pos + done)
    if done < size:
        copy_range_crc(src, dst, offset + done, size - done)


