"""Recognise a checkpoint folder from its listing (never from its name): the folder twin of
:data:`ckptool.formats.detect.HEAD_ACCEPTS`.

Each folder format answers "is this mine?" from the folder's :class:`Listing` (its entry names, read once), in one
ordered list, :data:`FOLDER_ACCEPTS`, as Pillow's plug-ins answer ``_accept(prefix)``; an answer is the path to
read (the folder itself, the iteration folder a Megatron top folder names, a set's index, a model folder's one
weights file), or None. The readers (:func:`ckptool.readers.format_of`) take the first answer (:func:`classify`),
and so does ``scan`` (:func:`is_dcp_unit`: a folder written as a ``torch.distributed.checkpoint`` is read as one
unit). The order:

=====================  ==========================================================================================
answer                 the folder holds (:mod:`ckptool.formats.megatron`, ``deepspeed``, ``dcp``, ``sharded``)
=====================  ==========================================================================================
``megatron-dist``      Megatron-Core's ``metadata.json`` naming a ``sharded_backend`` (a DCP folder beside it), or
                       ``latest_checkpointed_iteration.txt`` naming such an iteration folder
``megatron-legacy``    ``mp_rank_*/model_optim_rng.pt`` folders, or ``latest_checkpointed_iteration.txt``
``deepspeed``          ``latest`` or ZeRO tag folders (``*_model_states.pt`` beside ``*_optim_states.pt``)
``dcp``                ``.metadata`` (``torch.distributed.checkpoint``)
:data:`SHARDED_SET`    one ``*.index.json`` (several are refused): named by its shards' bytes
                       (:func:`ckptool.formats.sharded.index_format`), never their file names
:data:`WEIGHTS_FILE`   one of ``model.safetensors`` / ``pytorch_model.bin`` (``save_pretrained`` of a small
                       model): named by that file's bytes (:func:`ckptool.formats.detect.detect_format`)
:data:`PEFT_ADAPTER`   ``adapter_config.json`` beside ``adapter_model.safetensors`` / ``.bin`` (the file PEFT
                       loads): named by that file's bytes
:data:`ONE_CHECKPOINT`  exactly one checkpoint file, in it or below it, as ``scan`` of the folder finds them
                       (``outputs/last.ckpt``): named by that file's bytes
=====================  ==========================================================================================

Adding a folder format is one entry of :data:`FOLDER_ACCEPTS` and its reader. This module imports the folder
formats' modules; the readers and scan import it when they meet a folder (a command on one file does without it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ckptool.errors import UsageError
from ckptool.formats import dcp, deepspeed, megatron, sharded
from ckptool.formats.detect import (
    CHECKPOINT_SUFFIXES,
    INDEX_SUFFIX,
    MEGATRON_DIST,
    MEGATRON_LEGACY,
    file_starts_like_checkpoint,
)

__all__ = ["DCP", "DCP_WRITTEN", "DEEPSPEED", "FOLDER_ACCEPTS", "ONE_CHECKPOINT", "ONE_FILE", "PEFT_ADAPTER",
           "SHARDED_SET", "WEIGHTS_FILE", "Listing", "checkpoint_files", "classify", "folder_kinds", "is_dcp_unit",
           "listing"]

DCP = "dcp"
DEEPSPEED = "deepspeed"
#: a folder holding one sharded set's index: the set's format is decided by its shards' bytes
SHARDED_SET = "sharded-set"
#: a model folder holding one weights file: that file's format is decided by its bytes
WEIGHTS_FILE = "weights-file"
#: a PEFT adapter folder: the weights file PEFT loads, its format decided by its bytes
PEFT_ADAPTER = "peft-adapter"
#: a folder holding exactly one checkpoint file, in it or below it: that file, its format decided by its bytes
ONE_CHECKPOINT = "one-checkpoint"
#: the answers that name one file, whose format its first bytes decide
ONE_FILE = frozenset({WEIGHTS_FILE, PEFT_ADAPTER, ONE_CHECKPOINT})
#: how many entries :func:`accepts_one_checkpoint` looks at before it gives up (a data folder is no checkpoint)
MAX_WALKED = 10_000
#: the folder formats written as a ``torch.distributed.checkpoint`` folder (``.metadata`` and ``*.distcp``), which
#: ``scan`` reads as one unit (:func:`is_dcp_unit`)
DCP_WRITTEN = frozenset({DCP, MEGATRON_DIST})


@dataclass(frozen=True)
class Listing:
    """A folder's entries, read once: ``path`` as given, ``names`` every entry (files, folders, links, whatever
    they point to), ``dirs`` those that are folders (links followed). ``memo`` keeps what one answer read for the
    next (the Megatron layout, asked by two entries)."""

    path: str
    names: frozenset[str]
    dirs: frozenset[str]
    memo: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of_walk(cls, root: str, dirs: Iterable[str], files: Iterable[str]) -> Listing:
        """The listing ``os.walk`` gave for ``root`` (its ``dirs`` and ``files``), not read again."""
        d = frozenset(dirs)
        return cls(root, d | frozenset(files), d)

    def join(self, name: str) -> str:
        """The path of the entry ``name``."""
        return os.path.join(self.path, name)


def listing(path: str) -> Listing:
    """The :class:`Listing` of the folder ``path`` (one ``os.scandir``).

    Raises:
        OSError: the folder cannot be listed (missing, not a folder, no permission).
    """
    names: list[str] = []
    dirs: list[str] = []
    with os.scandir(path) as it:
        for entry in it:
            names.append(entry.name)
            try:
                if entry.is_dir():
                    dirs.append(entry.name)
            except OSError:  # a link that cannot be followed is no folder
                pass
    return Listing(path, frozenset(names), frozenset(dirs))


# ------------------------------------------------------------------------------------------------ the answers
def _megatron(lst: Listing) -> tuple[str, str] | None:
    """:func:`ckptool.formats.megatron.megatron_layout` of the folder, once per listing; not asked of a folder
    holding none of the names it looks for."""
    if "megatron" not in lst.memo:
        maybe = megatron.METADATA_JSON in lst.names or megatron.LATEST_FILE in lst.names or \
            any(n.startswith("mp_rank_") for n in lst.dirs)
        lst.memo["megatron"] = megatron.megatron_layout(lst.path) if maybe else None
    found = lst.memo["megatron"]
    return found if isinstance(found, tuple) else None


def accepts_megatron_dist(lst: Listing) -> str | None:
    """A Megatron-Core torch_dist folder (or a top folder naming one): its iteration folder."""
    found = _megatron(lst)
    return found[1] if found is not None and found[0] == MEGATRON_DIST else None


def accepts_megatron_legacy(lst: Listing) -> str | None:
    """A Megatron-LM legacy tree (or a top folder naming one): its iteration folder (the top folder when the
    iteration it names is missing: the reader says so)."""
    found = _megatron(lst)
    return found[1] if found is not None and found[0] == MEGATRON_LEGACY else None


def accepts_deepspeed(lst: Listing) -> str | None:
    """A DeepSpeed ZeRO top or tag folder (:func:`ckptool.formats.deepspeed.is_deepspeed_folder`): the folder."""
    maybe = bool(lst.dirs) or deepspeed.LATEST in lst.names or \
        any(n.endswith(deepspeed.MODEL_SUFFIX) for n in lst.names)
    return lst.path if maybe and deepspeed.is_deepspeed_folder(lst.path) else None


def accepts_dcp(lst: Listing) -> str | None:
    """A ``torch.distributed.checkpoint`` folder (its ``.metadata``: :func:`ckptool.formats.dcp.is_dcp_folder`)."""
    return lst.path if dcp.METADATA_FILE in lst.names and dcp.is_dcp_folder(lst.path) else None


def accepts_sharded_set(lst: Listing) -> str | None:
    """A folder holding one sharded set's ``*.index.json``: that index.

    Raises:
        UsageError: the folder holds several indexes.
    """
    indexes = sorted(n for n in lst.names if n.endswith(INDEX_SUFFIX))
    if len(indexes) > 1:
        raise UsageError(f"{lst.path} holds several sharded indexes ({', '.join(indexes)}); pass one of them")
    return lst.join(indexes[0]) if indexes else None


def accepts_weights_file(lst: Listing) -> str | None:
    """A model folder whose weights fit one file (``save_pretrained`` writes no index then): that file, when the
    folder holds exactly one of :data:`ckptool.formats.sharded.SINGLE_FILES`."""
    singles = sorted(n for n in lst.names if n in sharded.SINGLE_FILES)
    return lst.join(singles[0]) if len(singles) == 1 else None


def accepts_peft_adapter(lst: Listing) -> str | None:
    """A PEFT adapter folder (``adapter_config.json`` beside :data:`ckptool.formats.sharded.ADAPTER_FILES`, no
    model weights file): the file PEFT's ``load_peft_weights`` loads, as ``scan`` and ``merge-lora`` read it."""
    if "adapter_config.json" not in lst.names or any(n in lst.names for n in sharded.SINGLE_FILES):
        return None
    return next((lst.join(n) for n in sharded.ADAPTER_FILES if n in lst.names), None)


def checkpoint_files(top: str, stop: int = 2) -> list[str]:
    """The files under the folder ``top`` that ``ckptool scan`` of it reads as checkpoints: a name ending in
    :data:`~ckptool.formats.detect.CHECKPOINT_SUFFIXES` or first bytes of a zip or a pickle
    (:func:`~ckptool.formats.detect.starts_like_checkpoint`), in sorted order, each folder's files before its
    subfolders (links to folders not entered, links that lead nowhere left out), at most ``stop`` of them and none
    past :data:`MAX_WALKED` entries listed (then those found so far). The listing's entry types spare a ``stat`` a
    file, and a file with a checkpoint's name is not opened."""
    found: list[str] = []
    walked = 0
    pending = [top]
    while pending and walked <= MAX_WALKED:
        folder = pending.pop(0)
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        walked += len(entries)
        subfolders = []
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    subfolders.append(e.path)
                    continue
                if not e.is_file():  # a dangling link, a link to a folder, a FIFO
                    continue
            except OSError:
                continue
            if e.name.lower().endswith(CHECKPOINT_SUFFIXES) or file_starts_like_checkpoint(e.path):
                found.append(e.path)
                if len(found) >= stop:
                    return found
        pending[:0] = subfolders
    return found


def accepts_one_checkpoint(lst: Listing) -> str | None:
    """A folder none of the formats before accepts, holding exactly one checkpoint file (:func:`checkpoint_files`:
    ``outputs/last.ckpt``, ``run/weights/model.pt``): that file, as ``scan`` of the folder reads it."""
    found = checkpoint_files(lst.path)
    return found[0] if len(found) == 1 else None


#: THE classifier of folders: each folder format answers "is this mine?" from the folder's listing, in this order
#: (Megatron first: its torch_dist folder is also a DCP folder, and Megatron-DeepSpeed trees hold DeepSpeed's
#: files; a model's formats before the loose files a folder may also hold). The readers and scan take the first
#: answer (:func:`classify`, :func:`is_dcp_unit`).
FOLDER_ACCEPTS: tuple[tuple[str, Callable[[Listing], str | None]], ...] = (
    (MEGATRON_DIST, accepts_megatron_dist), (MEGATRON_LEGACY, accepts_megatron_legacy),
    (DEEPSPEED, accepts_deepspeed), (DCP, accepts_dcp), (SHARDED_SET, accepts_sharded_set),
    (WEIGHTS_FILE, accepts_weights_file), (PEFT_ADAPTER, accepts_peft_adapter),
    (ONE_CHECKPOINT, accepts_one_checkpoint))


def folder_kinds(lst: Listing) -> Iterator[tuple[str, str]]:
    """``(answer, path to read)`` for each entry of :data:`FOLDER_ACCEPTS` that accepts the folder, in order, each
    asked only when the earlier answers were taken or passed over. Raises what an answer raises
    (:func:`accepts_sharded_set`)."""
    for name, accept in FOLDER_ACCEPTS:
        target = accept(lst)
        if target is not None:
            yield name, target


def classify(path: str) -> tuple[str, str]:
    """The first answer of :data:`FOLDER_ACCEPTS` for the folder ``path``: ``(answer, path to read)``; the answer
    is a registry format name, or :data:`SHARDED_SET` / one of :data:`ONE_FILE`, whose format the bytes of the
    file(s) named decide (the caller asks :func:`ckptool.formats.sharded.index_format` /
    :func:`ckptool.formats.detect.detect_format`).

    Raises:
        UsageError: a folder no format accepts, or one holding several sharded indexes.
        OSError: the folder cannot be listed.
    """
    found = next(folder_kinds(listing(path)), None)
    if found is None:
        several = checkpoint_files(path, stop=4)
        held = (f"; it holds several checkpoint files ({', '.join(os.path.relpath(f, path) for f in several[:3])}"
                f"{', ...' if len(several) > 3 else ''}): pass one of them") if several else \
            "; pass the checkpoint file"
        raise UsageError(
            f"{path} is a folder but neither a torch.distributed.checkpoint folder (no .metadata) nor a sharded "
            f"checkpoint (no *.index.json, model.safetensors or pytorch_model.bin){held}")
    return found


def is_dcp_unit(lst: Listing) -> bool:
    """True when the folder is read as one ``torch.distributed.checkpoint`` folder (its ``.metadata`` and every
    record), as ``scan`` reads it: the first answer of :data:`FOLDER_ACCEPTS` is a format of :data:`DCP_WRITTEN`
    and names the folder itself. Never raises for the folder's content (a folder no format accepts is none)."""
    if dcp.METADATA_FILE not in lst.names:  # every format written as DCP holds it: most folders stop here
        return False
    try:
        found = next(folder_kinds(lst), None)
    except UsageError:
        return False
    return found is not None and found[0] in DCP_WRITTEN and found[1] == lst.path
