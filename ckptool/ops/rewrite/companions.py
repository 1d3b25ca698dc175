"""The files a model folder holds beside its weights (``config.json``, ``generation_config.json``, tokenizer files,
``README.md``...), which a rewrite of the folder's sharded set copies byte for byte into its output, so that
``transformers`` ``from_pretrained(output)`` finds them.

What is copied: every regular file directly in the input set's folder (files only: ``transformers`` folders are
flat), except
- the set's own shards and index (they are the files the rewrite writes anew);
- hidden files (a name starting with ``.``: ``.git``, ``.gitattributes``, ``.cache``), which belong to the
  repository or tool that made the folder, not to the model;
- other weights (:data:`WEIGHT_SUFFIXES`: another set's shards and index, ``pytorch_model.bin`` beside
  ``model.safetensors``, ``tf_model.h5``, ``training_args.bin`` too): copied unchanged they would hold the old
  names, and ``from_pretrained`` could load them instead of the rewritten set. They are named in a note instead,
  as are subfolders (not copied).
A companion that is a symbolic link is followed only to a regular file inside the input folder or, in a Hugging Face
cache snapshot (``.../models--ORG--NAME/snapshots/REV/``), inside that repository's ``blobs/`` folder (where the
cache keeps each file once); a link anywhere else (``/etc/passwd``, ``/proc/self/environ`` with the user's cloud
keys, another folder, ``/dev``, a FIFO) is refused with its name before anything is written
(:func:`check_link`). A FIFO, device or socket among the files is never opened: it is named in the note. A copy keeps
the source's holes (``SEEK_DATA`` / ``SEEK_HOLE``, each data extent copied with ``os.copy_file_range``) and its mode
bits (as ``shutil.copy`` does), and the output filesystem's free space is checked first (:func:`copy_companion`).
A set read through a URL, or written into its own folder, keeps nothing (the files are where they were). A model
folder holding one weights file, given as the folder, is written as a folder with its companions in the same way
(:mod:`ckptool.ops.rewrite.folders`); the weights file given as a file is rewritten into one file: nothing is
copied.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from ckptool import _source as source
from ckptool._fileio import same_file
from ckptool.errors import OutputError, UnsupportedError
from ckptool.writers.encoders import INDEX_SUFFIX

#: names that hold weights: not copied beside a rewritten set (their content would not match it)
WEIGHT_SUFFIXES = (INDEX_SUFFIX, ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                   ".onnx", ".distcp")


@dataclass
class Companions:
    """The files to copy beside a rewritten set: ``files`` (source path, file name) in name order, and ``left``:
    what the folder holds that is not copied (other weights, subfolders), for a note."""

    files: list[tuple[str, str]] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """The names of the files copied."""
        return [name for _p, name in self.files]

    def notes(self) -> list[str]:
        """The note naming what was left out of the output folder; none when nothing was."""
        if not self.left:
            return []
        shown = ", ".join(self.left[:4]) + (" ..." if len(self.left) > 4 else "")
        return [(f"not copied from the input folder: {shown} (subfolders, and weights files this rewrite did "
                 "not change, would not match the new set)")]


def model_folder_of(path: str) -> str | None:
    """The model folder a checkpoint argument names: the folder itself, or the folder holding a ``*.index.json``;
    None for a URL or a single file (whose folder the user did not give)."""
    if source.is_url(path):
        return None
    if os.path.isdir(path):
        return path
    return os.path.dirname(os.path.abspath(path)) if path.endswith(INDEX_SUFFIX) else None


def source_companions(path: str, folder: str, weights: Iterable[str], out_folder: str) -> Companions:
    """:func:`companion_files` of the model folder ``folder`` that ``path`` names, leaving out the checkpoint's own
    files: ``path`` itself and the ``weights`` files its tensors are read from."""
    own = {os.path.basename(p) for p in weights} | {os.path.basename(path)}
    return companion_files(folder, own, out_folder)


def companion_files(folder: str, own: set[str], out_folder: str) -> Companions:
    """The files of ``folder`` (the input set's) to copy into ``out_folder`` (see the module docstring); ``own``:
    the names of the set's shards and index. None to copy when ``folder`` is a URL or is ``out_folder`` itself."""
    if source.is_url(folder) or not os.path.isdir(folder) or same_file(folder, out_folder):
        return Companions()
    found = Companions()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name in own or name.startswith("."):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            found.left.append(name + "/")
        elif name.lower().endswith(WEIGHT_SUFFIXES):
            found.left.append(name)
        elif os.path.islink(path):
            check_link(folder, path)
            found.files.append((path, name))
        elif os.path.isfile(path):
            found.files.append((path, name))
        else:  # a FIFO, device or socket: never opened
            found.left.append(name)
    return found


def _hf_blobs(folder: str) -> str | None:
    """The ``blobs/`` folder of the Hugging Face cache repository whose snapshot ``folder`` (real path) is
    (``.../models--ORG--NAME/snapshots/REV``), else None."""
    parent = os.path.dirname(folder)
    repo = os.path.dirname(parent)
    if os.path.basename(parent) != "snapshots" or "--" not in os.path.basename(repo):
        return None
    blobs = os.path.join(repo, "blobs")
    return blobs if os.path.isdir(blobs) else None


def _inside(root: str, real: str) -> bool:
    return os.path.commonpath([root, real]) == root


#: ``ckptool --follow-links``: a companion link may lead to a regular file anywhere (but ``/proc``, ``/sys``,
#: ``/dev``); set per run by the CLI (:func:`set_follow_links`)
_follow = [False]
_PSEUDO = ("/proc", "/sys", "/dev")


def set_follow_links(on: bool) -> None:
    """Let companion links lead to regular files outside the model folder (``ckptool --follow-links``), or not."""
    _follow[0] = on


def check_link(folder: str, link: str) -> None:
    """Refuse the companion ``link`` (a symbolic link in the model folder ``folder``) unless it leads to a regular
    file inside ``folder`` or inside the ``blobs/`` folder of the Hugging Face cache repository ``folder`` is a
    snapshot of; with :func:`set_follow_links`, to any regular file outside ``/proc``, ``/sys`` and ``/dev``.

    Raises:
        UnsupportedError: it dangles, or leads to something else (outside the folder, ``/proc``, ``/dev``, a FIFO),
            named with where it leads.
    """
    real = os.path.realpath(link)
    top = os.path.realpath(folder)
    blobs = _hf_blobs(top)
    try:
        regular = stat.S_ISREG(os.stat(link).st_mode)
    except OSError:
        regular = False
    if regular and (_inside(top, real) or (blobs is not None and _inside(os.path.realpath(blobs), real))):
        return
    if regular and _follow[0] and not any(_inside(p, real) for p in _PSEUDO):
        return
    what = "a regular file" if regular else "no regular file" if os.path.exists(real) else "nothing (it dangles)"
    raise UnsupportedError(f"{link}: this companion file is a symbolic link to {real}, {what} outside the model "
                           "folder; it is not copied into the output (it could carry any file of this machine "
                           "there): replace the link by the file, remove it, or pass ckptool --follow-links to "
                           "copy a regular file it leads to")


def copy_companion(src: str, dst: str) -> None:
    """Copy the file ``src`` to ``dst`` (a scratch file of the set writer) byte for byte, keeping its holes (each
    data extent ``SEEK_DATA`` finds copied, the rest left unwritten, the size set with ``ftruncate``) and its mode
    bits (``shutil.copymode``, as ``shutil.copy`` does), after checking that the output filesystem has room for the
    blocks ``src`` takes; fsynced.

    Raises:
        OutputError: reading ``src`` or writing ``dst`` failed, or the output has too little free space (nothing
            is written then).
    """
    try:
        with open(src, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            need = min(st.st_size, getattr(st, "st_blocks", st.st_size // 512 + 1) * 512)
            vfs = os.statvfs(os.path.dirname(os.path.abspath(dst)))
            if need > vfs.f_bavail * vfs.f_frsize:
                raise OutputError(f"copying {src} into the output needs {need} bytes but its filesystem has "
                                  f"{vfs.f_bavail * vfs.f_frsize} free; nothing was kept: free space or choose "
                                  "another output folder", dst, errno.ENOSPC)
            with open(dst, "wb") as o:
                _copy_sparse(f.fileno(), o.fileno(), st.st_size)
                os.fsync(o.fileno())  # durable before the commit renames it into place, as the weights are
        shutil.copymode(src, dst)
    except OutputError:
        raise
    except OSError as e:
        raise OutputError(f"copying {src} into the output failed: {e.strerror or e}; nothing was kept", dst,
                          e.errno) from e


def _copy_sparse(sfd: int, dfd: int, size: int) -> None:
    """Copy ``size`` bytes from ``sfd`` to ``dfd``, data extents only where the filesystem says where they are
    (``SEEK_DATA`` / ``SEEK_HOLE``), else everything; ``os.copy_file_range`` where the kernel has it."""
    seek_data, seek_hole = getattr(os, "SEEK_DATA", None), getattr(os, "SEEK_HOLE", None)
    pos = 0
    while pos < size:
        if seek_data is not None and seek_hole is not None:
            try:
                start = os.lseek(sfd, pos, seek_data)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole is left
                    break
                start, end = pos, size  # no SEEK_DATA on this filesystem: all of it
            else:
                end = min(os.lseek(sfd, start, seek_hole), size)
        else:
            start, end = pos, size
        _copy_extent(sfd, dfd, start, end)
        pos = end
    os.ftruncate(dfd, size)


def _copy_extent(sfd: int, dfd: int, start: int, end: int) -> None:
    done = start
    kernel = getattr(os, "copy_file_range", None)
    while done < end:
        n = 0
        if kernel is not None:
            try:
                n = kernel(sfd, dfd, min(end - done, 1 << 30), done, done)
            except OSError:
                kernel = None
        if not n:
            os.lseek(sfd, done, os.SEEK_SET)
            piece = os.read(sfd, min(end - done, 8 << 20))
            if not piece:
                raise OSError(errno.EIO, "the file ended early")
            n = os.pwrite(dfd, piece, done)
        done += n
