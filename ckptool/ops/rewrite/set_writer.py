"""Writing a set of files as one output: a sharded set (shards plus their ``*.index.json``), each file into a
scratch file beside its final name and all renamed into place once every one is written and checked; an earlier
set of the same names replaced whole. Shared by ``convert`` (:mod:`ckptool.ops.convert.outputs`) and the rewrites of
sharded sets (:mod:`ckptool.ops.rewrite.sets`), without the conversion machinery (so a remap of one file does not
import it).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

from ckptool._commit import mark_committed, signals_blocked
from ckptool._fileio import atomic_output, make_output_folder, same_file, temp_path
from ckptool.errors import OutputError, UsageError
from ckptool.ops.rewrite.companions import copy_companion
from ckptool.ops.rewrite.parallel import run_all
from ckptool.writers.encoders import INDEX_SUFFIX, SetLayout, encode_index, files_named

#: one shard's worth of what :func:`write_set` writes (convert: a list of units; a rewrite: an input shard)
G = TypeVar("G")


@contextlib.contextmanager
def scratch_file(near: str) -> Iterator[str]:
    """A temporary file path beside ``near`` (same filesystem), removed afterwards
    (:func:`ckptool._fileio.temp_path`: named as :func:`ckptool._fileio.atomic_output` names its temporary files,
    so a run killed outright leaves nothing that the next write of ``near`` does not remove).

    Raises:
        UsageError: the folder of ``near`` does not exist.
        OutputError: the file cannot be made there.
    """
    with temp_path(near) as p:
        yield p


class SetFiles(Protocol):
    """What :func:`write_set` fills: ``files`` written, ``notes`` for the user, ``dst`` (the index of a named set)."""

    files: list[str]
    notes: list[str]
    dst: str


def write_set(layout: SetLayout, groups: Sequence[G], write: Callable[[str, str, G], None],
              inputs: list[str], weight_map: dict[str, str], total: int, res: SetFiles, out: str, *,
              metadata: dict[str, Any] | None = None, always_index: bool = False,
              companions: Sequence[tuple[str, str]] = (), one_file: bool = False,
              pool: Executor | None = None) -> None:
    """Write the shards ``groups`` with ``write(path, final path, group)`` as the set ``layout`` (several: shards
    plus the index of ``weight_map``, which ``write`` fills, and ``total`` bytes, or the index ``metadata`` given,
    kept as it is; one: the single file, no index, as ``transformers`` ``save_pretrained`` does, unless
    ``always_index``), adding the files to ``res``; ``companions`` (source path, file name): files copied byte for
    byte into the set's folder with the shards, in the same commit (a model folder's ``config.json``, tokenizer
    files: :mod:`ckptool.ops.rewrite.companions`; not added to ``res.files``). ``pool``: an executor that runs ``write``
    one shard per task (``write`` must then be safe to run in several threads at once). Used by ``convert``, by the
    shard-set rewrites of :mod:`ckptool.ops.rewrite.sets` (a group there is one input shard) and by the rewrites of
    a model folder holding one file (:mod:`ckptool.ops.rewrite.folders`: ``one_file``, one group, no note saying
    that everything fit one shard).

    The files an earlier run wrote for the same layout are this run's to replace (as ``convert`` replaces an
    existing output file); nothing else is touched. Steps: (1) refuse before writing when a file of the set is an
    input (by name, hard or symbolic link) or a directory; (2) write and verify every shard into a scratch file
    beside its final name (:func:`scratch_file`; each written atomically by
    :func:`ckptool.ops.convert.write.emit`), so an earlier set stays whole until the new one is complete;
    (3) rename the shards into place, then write the index atomically; (4) remove the earlier set's files the new
    one does not use: those its index named, its index and its single file, never a file another index of the
    folder names (:func:`_earlier_set`); and record ``out`` (the output as the command names it) as complete.
    Steps (3) and (4) run with SIGINT and SIGTERM held (:func:`ckptool._commit.signals_blocked`). A failure in (2)
    or (3) removes every file of this run (and the folder when this run made it) and raises.

    Raises:
        UsageError: step (1) refused, or the output folder is missing (file sets).
        OutputError: a shard could not be renamed into place, or the index not written.
        VerificationError: a shard does not read back as written.
    """
    n = len(groups)
    paths = [os.path.join(layout.folder, name) for name in layout.shard_names(n)]
    index = os.path.join(layout.folder, layout.index_name) if n > 1 or always_index else None
    own = [*paths, *([index] if index else [])]
    extra = [(src, os.path.join(layout.folder, name)) for src, name in companions]
    _refuse_set_target(layout, [*own, *(p for _s, p in extra)], inputs)
    earlier = _earlier_set(layout)  # read before the new index replaces the old one
    made = layout.is_output_folder and not os.path.isdir(layout.folder)
    if made:
        make_output_folder(layout.folder)
    committed: list[str] = []
    keep = {os.path.basename(p) for p in own}
    if index is None and not one_file:  # before the notes of the commit (what it removed), which follow from it
        res.notes.append(f"everything fits one shard: wrote the single file {os.path.basename(paths[0])} and no "
                         "index, as transformers' save_pretrained does")
    done = False
    try:
        with contextlib.ExitStack() as stack:  # the scratch files go when it closes, whatever happened
            staged = _stage(stack, paths, groups, write, pool)
            staged += _stage(stack, [p for _s, p in extra], [s for s, _p in extra], _copy)
            # every shard is written and verified: put them in place, write the index, remove the earlier set's
            # files and record the output as complete with SIGINT / SIGTERM held, so that an interrupt comes before
            # the set changes (nothing kept) or after it is whole (the CLI says so)
            with signals_blocked():
                _move_into_place(staged, committed)
                if index is not None:
                    with atomic_output(index) as f:
                        f.write(encode_index(weight_map, total, metadata))
                _remove_earlier(layout, earlier, keep, res)
                mark_committed(out)
                done = True
    except BaseException:
        if not done:
            _undo(committed, layout.folder if made else None)
        raise
    res.files += own
    if index is not None and not layout.is_output_folder:
        res.dst = index  # NAME.safetensors itself is not written: the index names the set


def _stage(stack: contextlib.ExitStack, paths: list[str], groups: Sequence[G],
           write: Callable[[str, str, G], None], pool: Executor | None = None) -> list[tuple[str, str]]:
    """Write each group with ``write`` into a scratch file beside its final path (removed when ``stack`` closes),
    one task per group on ``pool`` when given;
    ``(scratch, final)`` pairs."""
    if pool is None or len(paths) < 2:  # one scratch file made at a time: a killed run leaves at most one behind
        staged = []
        for final, us in zip(paths, groups):
            staged.append((stack.enter_context(scratch_file(final)), final))
            write(staged[-1][0], final, us)
        return staged
    staged = [(stack.enter_context(scratch_file(final)), final) for final in paths]
    # one task per shard; all done (or all stopped) before the caller commits or cleans up
    run_all(pool, [functools.partial(write, tmp, final, us) for (tmp, final), us in zip(staged, groups)])
    return staged


def _copy(path: str, _final: str, src: str) -> None:
    """Copy the companion file ``src`` into the scratch file ``path``."""
    copy_companion(src, path)


def _move_into_place(staged: list[tuple[str, str]], committed: list[str]) -> None:
    """Rename each scratch file to its final path, adding the final paths to ``committed`` as they are done.

    Raises:
        OutputError: a rename failed (the files moved so far are in ``committed``).
    """
    for tmp, final in staged:
        try:
            os.replace(tmp, final)
        except OSError as e:
            raise OutputError(f"moving {final} into place failed: {e.strerror or e}; nothing was kept", final,
                              e.errno) from e
        committed.append(final)


def _undo(committed: list[str], made: str | None) -> None:
    """Remove the files of a failed run moved into place (``committed``), and the folder ``made`` (this run made it)
    when given."""
    for p in committed:
        with contextlib.suppress(OSError):
            os.unlink(p)
    if made is not None:
        with contextlib.suppress(OSError):
            os.rmdir(made)


def _earlier_set(layout: SetLayout) -> set[str]:
    """The files of the set an earlier run wrote for ``layout``, which this run replaces: its index
    (``layout.index_name``), the shards that index names, and the single file ``<stem><ext>`` (a set of one), each
    only when it is a file of the layout's names; less any file another ``*.index.json`` of the folder names
    (another set's file is never ours to remove)."""
    folder = layout.folder
    if not os.path.isdir(folder):
        return set()
    names = set(os.listdir(folder))
    ours = {layout.index_name, layout.stem + layout.ext} & names
    if layout.index_name in names:
        ours |= files_named(os.path.join(folder, layout.index_name)) & names
    others = set().union(*(files_named(os.path.join(folder, n)) for n in names
                           if n.endswith(INDEX_SUFFIX) and n != layout.index_name))
    return {n for n in ours - others if layout.is_member(n)}


def _remove_earlier(layout: SetLayout, earlier: set[str], keep: set[str], res: SetFiles) -> None:
    """Remove the files of the earlier set (:func:`_earlier_set`) this run did not write, and note them; note, not
    remove, the other files named like the layout's members that no index of this set named."""
    folder = layout.folder
    stale = sorted(n for n in earlier - keep if os.path.isfile(os.path.join(folder, n)))
    for name in stale:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
    if stale:
        res.notes.append(f"removed {len(stale)} file(s) of an earlier shard set in {folder}: "
                         f"{', '.join(stale[:3])}{' ...' if len(stale) > 3 else ''}")
    left = sorted(n for n in os.listdir(folder) if layout.is_member(n) and n not in keep and n not in earlier)
    if left:
        res.notes.append(f"left {len(left)} file(s) named like this set's in {folder} that no index of this set "
                         f"names (another set's, or not ckptool's): {', '.join(left[:3])}"
                         f"{' ...' if len(left) > 3 else ''}")


def _refuse_set_target(layout: SetLayout, targets: list[str], inputs: list[str]) -> None:
    """Raise UsageError when a file of the output set (``targets``, or an existing file of the layout, which the
    run removes) is one of the ``inputs`` (same path, hard link or symbolic link), or a target is a directory."""
    folder = layout.folder
    existing = [os.path.join(folder, n) for n in os.listdir(folder) if layout.is_member(n)] \
        if os.path.isdir(folder) else []
    for p in dict.fromkeys([*targets, *existing]):
        hit = next((i for i in inputs if same_file(i, p)), None)
        if hit is not None:
            raise UsageError(f"the output set would replace the input {hit}; choose another -o path")
        if os.path.isdir(p):
            raise UsageError(f"output path {p} is a directory; choose another -o path")
