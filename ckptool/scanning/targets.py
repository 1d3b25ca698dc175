"""What ``ckptool scan`` reads for the paths it is given: each file as given; in each folder (recursively, sorted)
each torch.distributed.checkpoint folder as one, the files whose name ends like a checkpoint or whose first bytes are
a zip's or a pickle's, and the configs that make a loader run code; then what a loader of the folder reads outside
it (the shards an ``*.index.json`` names, DeepSpeed's tag folders). A file or folder that cannot be read is yielded
with an :data:`UNREADABLE` note: what was not looked at is never taken as safe. Split out of
:mod:`ckptool.scanning.entry` (the same code)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator

from ckptool import _source as source
from ckptool._source import leaves_folder
from ckptool.errors import CkptError, InputNotFoundError, UsageError
from ckptool.formats.detect import CHECKPOINT_SUFFIXES, INDEX_SUFFIX, file_starts_like_checkpoint
from ckptool.scanning.configs import is_code_config

__all__ = ["UNREADABLE", "index_refusal", "iter_paths", "iter_targets", "unreadable"]

def iter_paths(paths: Iterable[str | os.PathLike[str]]) -> Iterator[str]:
    """What to scan: each file as given, and in each directory (recursively, sorted) each torch.distributed.checkpoint
    folder as one (its ``.metadata`` and ``.distcp`` files are read through it) and the other files whose name ends
    like a checkpoint or whose first bytes are a zip, a pickle protocol 2-5 header or a legacy torch stream; then
    what a loader of the directory reads outside it (:func:`_targets`). A sharded index given as a file
    (``*.index.json``) stands for the shards it names.

    Raises:
        InputNotFoundError: a path does not exist.
        UsageError: a directory or index holds no checkpoint file.
    """
    for path, _notes in _targets(paths):
        yield path


def iter_targets(paths: Iterable[str | os.PathLike[str]], *, configs: bool = True) -> Iterator[tuple[str, list[str]]]:
    """:func:`iter_paths`, each path with the notes its result gets (why a file outside a scanned folder is
    scanned); raises as :func:`iter_paths` does. ``configs=False``: folders give no config that makes a loader run
    code (:func:`~ckptool.scanning.configs.is_code_config`: for ``inspect``). Used by
    :mod:`ckptool.ops.scan.many`."""
    return _targets(paths, configs)


def _targets(paths: Iterable[str | os.PathLike[str]], configs: bool = True) -> Iterator[tuple[str, list[str]]]:
    """:func:`iter_paths`, each path with the notes to add to its result (why a file outside a scanned folder is
    scanned)."""
    for given in paths:
        p = os.fspath(given)
        if source.is_url(p):  # one remote file (folders are walked only on disk)
            if source.kind(p) != "file":
                raise InputNotFoundError(f"{p}: no such file; check the URL (give a file, not a folder)")
            yield p, []
            continue
        if not os.path.exists(p):
            raise InputNotFoundError(f"{p}: no such file or directory; check the path")
        if os.path.isdir(p) or p.endswith(INDEX_SUFFIX):
            found = 0
            if not os.path.isdir(p) and index_refusal(p) is not None:
                found += 1
                yield p, []
            items = _walk(p, configs) if os.path.isdir(p) else \
                _followed(_index_shards(p, os.path.dirname(p) or "."), set())
            for item in items:
                found += 1
                yield item
            if not found:
                raise UsageError(_nothing_found(p))
            continue
        yield p, []


def _nothing_found(p: str) -> str:
    if os.path.isdir(p):
        return (f"{p} holds no checkpoint file (none named *.pt, *.bin, *.safetensors, ... or starting like a zip "
                "or a pickle, no torch.distributed.checkpoint folder, in any subfolder); nothing was scanned: check "
                "the path, or pass the checkpoint files themselves")
    return f"{p} names no shard file that exists; nothing was scanned: download the shards, or scan them directly"


#: the first note of a path :func:`iter_targets` yields that could not be listed or read (a subfolder or file the
#: user may not read): the rest of the note says why, and the path is a result with that error, never left out
UNREADABLE = "\x00unreadable: "


def unreadable(notes: list[str] | tuple[str, ...]) -> str | None:
    """Why the path :func:`iter_targets` yielded with ``notes`` could not be listed or read (None: it can be)."""
    return notes[0][len(UNREADABLE):] if notes and notes[0].startswith(UNREADABLE) else None


def _walk(top: str, configs: bool = True) -> Iterator[tuple[str, list[str]]]:
    """The checkpoint files under the folder ``top`` (recursively, sorted, symlinked subfolders not entered; with
    ``configs`` also the configs that make a loader run code, :func:`~ckptool.scanning.configs.is_code_config`),
    then the files a loader of ``top`` reads from outside it: the shards a ``*.index.json`` names and the files of
    the DeepSpeed tag folders ``latest`` or a symlinked tag folder lead to (:func:`_followed`). A subfolder that
    cannot be listed (no permission) and a file that cannot be opened are yielded too, with an :data:`UNREADABLE`
    note: what was not looked at is never taken as safe."""
    # the folder formats' code, imported when a folder is met (a scan of one file does without it)
    from ckptool.formats.deepspeed import loaded_tag_folders  # noqa: PLC0415

    seen: set[str] = set()
    away: list[tuple[str, str]] = []
    failed: list[OSError] = []
    for root, dirs, files in os.walk(top, onerror=failed.append):
        yield from _unlisted(failed)
        dirs.sort()
        dcp = ".metadata" in files and _is_dcp_unit(root, dirs, files)
        if dcp:
            seen.add(os.path.realpath(root))
            yield root, []
        real_root = None
        prefix = os.path.join(root, "")  # the folder and its separator: os.path.join(root, name) for each name
        for name in sorted(files):
            full = prefix + name
            link = _is_link(full)  # one lstat a file answers the three questions below (issue 52)
            if name.endswith(INDEX_SUFFIX):
                away += _index_shards(full, top)
                if index_refusal(full) is not None:
                    yield full, []
            if dcp and (name == ".metadata" or name.endswith(".distcp")):
                continue
            if _is_candidate(full, link) or (configs and is_code_config(full)):
                if link:
                    seen.add(os.path.realpath(full))
                else:  # not a link: its real path is its folder's, once a folder, and its name
                    real_root = real_root or os.path.join(os.path.realpath(root), "")
                    seen.add(real_root + name)
                why = _cannot_open(full, link)
                yield full, [] if why is None else [f"{UNREADABLE}{full}: {why}"]
        for folder, why in loaded_tag_folders(root, (dirs, files)):
            away += [(f, f"{why}; DeepSpeed reads it from there") for f in _folder_files(folder)]
    yield from _unlisted(failed)
    yield from _followed(away, seen)


def _is_dcp_unit(root: str, dirs: list[str], files: list[str]) -> bool:
    """The folder classifier's answer (:func:`ckptool.formats.folders.is_dcp_unit`) for a folder ``os.walk`` listed
    (the folder formats' code is imported when a folder holds a ``.metadata``: a walk of other folders does without
    it)."""
    from ckptool.formats.folders import Listing, is_dcp_unit  # noqa: PLC0415

    return is_dcp_unit(Listing.of_walk(root, dirs, files))


def _unlisted(failed: list[OSError]) -> Iterator[tuple[str, list[str]]]:
    """Each folder ``os.walk`` could not list (``failed``, emptied), with its :data:`UNREADABLE` note."""
    while failed:
        e = failed.pop(0)
        where = str(e.filename) if e.filename is not None else "a subfolder"
        why = (f"{UNREADABLE}{where}: this folder cannot be listed ({e.strerror or e}); what it holds was not "
               "scanned: run as a user who may read it")
        yield where, [why]


def _is_link(path: str) -> bool:
    """``os.path.islink(path)``, and True where ``lstat`` fails (then every caller asks again, as for a link)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return True


def _is_candidate(full: str, link: bool = True) -> bool:
    """Whether the walk scans the file ``full``: a checkpoint's name or first bytes, and not a dangling link or a
    link to a folder; ``link=False`` when the caller knows ``full`` is no link (:func:`_is_link`)."""
    if link and os.path.islink(full) and not os.path.isfile(full):
        return False
    name = os.path.basename(full).lower()
    return name.endswith(CHECKPOINT_SUFFIXES) or file_starts_like_checkpoint(full, unreadable=True)


def _folder_files(folder: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))
            and _is_candidate(os.path.join(folder, n))]


def _index_shards(index_path: str, top: str) -> list[tuple[str, str]]:
    """The shards the index at ``index_path`` names, each with why it is outside ``top`` ("" when it is not): the
    paths ``transformers`` opens (``os.path.join(index folder, shard)``). An index that does not parse gives none
    (its loader fails too)."""
    from ckptool.formats import sharded  # noqa: PLC0415  (imported when a set is met)

    try:
        index = sharded.parse_index(index_path)
    except CkptError:
        return []
    out = []
    for shard in index.shards:
        path = index.shard_path(shard)
        why = sharded.shard_outside(index, shard) or leaves_folder(top, path)
        out.append((path, f"{index_path} names the shard {shard!r}: {why}; transformers reads it from there"
                    if why else ""))
    return out


def index_refusal(index_path: str) -> str | None:
    """Why the readers of a sharded set (``inspect``, ``report``, ``convert``...) refuse the index at ``index_path``,
    or None: a shard name that leaves the folder (``../x``, absolute, a URL is no local shard), a shard that is
    missing, or one that is a device, FIFO or socket (``/dev/zero``). ``scan`` then reports the index as an
    ``error`` (:func:`scan_file`), as those readers do, instead of scanning the other shards as safe. An index
    that does not parse is left to the shards' own scan (its loader fails too)."""
    from ckptool.formats import sharded  # noqa: PLC0415  (imported when a set is met)

    try:
        sharded.parse_index(index_path)
    except CkptError:
        return None
    try:
        index = sharded.read_index(index_path)
        for shard in index.shards:
            source.refuse_special(index.shard_path(shard), f"shard {shard!r} of {index_path}")
    except CkptError as e:
        return str(e)
    return None


def _followed(away: list[tuple[str, str]], seen: set[str]) -> Iterator[tuple[str, list[str]]]:
    """Each existing file of ``away`` (path, why) whose real path was not scanned yet (``seen``), with its note."""
    for path, why in away:
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(path):
            continue
        seen.add(real)
        yield path, [f"outside the scanned folder: {why}"] if why else []


def _cannot_open(path: str, link: bool = True) -> str | None:
    """Why the local file ``path`` cannot be opened for reading (no permission), or None; ``link=False`` when the
    caller knows ``path`` is no link (:func:`_is_link`)."""
    if link and os.path.islink(path) and not os.path.exists(path):
        return None
    if os.access(path, os.R_OK) or not os.path.isfile(path):
        return None
    return "this file cannot be opened (permission denied); it was not scanned: run as a user who may read it"
