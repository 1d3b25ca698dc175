"""DeepSpeed ZeRO checkpoint folders: which files they hold, read without deepspeed and without running them.

``engine.save_checkpoint(save_dir)`` (deepspeed/runtime/engine.py) writes a *top folder* holding ``latest`` (the
tag of the last save, e.g. ``global_step14``) and one *tag folder* per save::

    save_dir/latest
    save_dir/global_step14/mp_rank_00_model_states.pt                      ZeRO-1/2: module, shapes, names
    save_dir/global_step14/zero_pp_rank_N_mp_rank_00_model_states.pt       ZeRO-3: one per rank
    save_dir/global_step14/[bf16_]zero_pp_rank_N_mp_rank_00_optim_states.pt one per data-parallel rank: the rank's
                                                                             flat fp32 partition(s) and optimizer state

Every file is a ``torch.save`` zip whose pickle names deepspeed classes (``ZeroStageEnum``, ``LossScaler``,
``fragment_address``): they are read with ckptool's restricted unpickler (:mod:`ckptool.formats.torchfile`), which
imports none of them, so deepspeed need not be installed and nothing in the files runs. Files are sorted as
``zero_to_fp32.py`` sorts them (``natural_keys``: rank 10 after rank 9). What the pickles mean is
:mod:`ckptool.model.zero`'s business; this module finds the files, reads their structure and says where each
tensor's bytes lie (:func:`tensor_bytes`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptool._source import leaves_folder
from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats.dtypes import DTYPE_SIZES, numel, tensor_dtype
from ckptool.formats.nodes import TensorNode

if TYPE_CHECKING:  # the torch file reader is imported by read_files: a scan's folder walk needs only the tags
    from ckptool.formats.torchfile import Checkpoint

__all__ = ["DeepSpeedFolder", "FlatBytes", "find_deepspeed", "is_deepspeed_folder", "loaded_tag_folders",
           "natural_key", "read_files", "tensor_bytes"]

LATEST = "latest"
#: the files naming the tag to load: ``latest``, and ``latest_universal`` for a universal checkpoint
#: (``engine.load_checkpoint`` reads the one its config asks for)
LATEST_FILES = (LATEST, "latest_universal")
MODEL_SUFFIX = "_model_states.pt"
OPTIM_SUFFIX = "_optim_states.pt"
_MP_RANK = re.compile(r"mp_rank_(\d+)")


def natural_key(text: str) -> list[int | str]:
    """``zero_to_fp32.natural_keys``: digits compare as numbers (``rank_2`` before ``rank_10``)."""
    return [int(c) if c.isascii() and c.isdigit() else c for c in re.split(r"(\d+)", text)]


def _is_tag_folder(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.endswith(OPTIM_SUFFIX) for n in names) and any(n.endswith(MODEL_SUFFIX) for n in names)


def is_deepspeed_folder(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a DeepSpeed checkpoint: a top folder holding ``latest`` (or tag folders of ZeRO files),
    or a tag folder holding ``*_model_states.pt`` and ``*_optim_states.pt`` files. Reads directory listings only."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        return False
    if _is_tag_folder(p):
        return True
    if os.path.isfile(os.path.join(p, LATEST)):
        return True
    return bool(_tags(p))


def _tags(top: str) -> list[str]:
    try:
        names = sorted(os.listdir(top), key=natural_key)
    except OSError:
        return []
    return [n for n in names if _is_tag_folder(os.path.join(top, n))]


@dataclass
class DeepSpeedFolder:
    """A DeepSpeed checkpoint found on disk: ``folder`` is the tag folder read (``top/tag``); ``top`` the folder
    holding ``latest`` (None when a tag folder was given directly); ``tag`` its name; ``model_files`` and
    ``optim_files`` the ``*_model_states.pt`` / ``*_optim_states.pt`` files in ``zero_to_fp32`` order; ``tags``
    every tag folder of ``top``."""

    folder: str
    top: str | None
    tag: str
    model_files: list[str] = field(default_factory=list)
    optim_files: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        return [*self.model_files, *self.optim_files]


def find_deepspeed(path: str | os.PathLike[str], tag: str | None = None) -> DeepSpeedFolder:
    """The tag folder of the DeepSpeed checkpoint at ``path`` and its files.

    ``path`` is a top folder (the tag comes from ``tag``, else from its ``latest`` file, as
    ``get_fp32_state_dict_from_zero_checkpoint`` does) or a tag folder (then ``tag``, if given, must name it).

    Raises:
        UsageError: no such folder; a top folder without ``latest`` and no ``tag``; a tag that is not there; a
            tag that contradicts a tag folder given directly.
        CorruptCheckpointError: ``latest`` names no tag folder, or the tag folder lacks model or optimizer states.
        UnsupportedError: model (tensor) parallel checkpoints (``mp_rank_01``...), which zero_to_fp32 cannot
            consolidate either.
    """
    p = os.path.abspath(os.fspath(path))
    if not os.path.isdir(p):
        raise UsageError(f"{path}: no such folder; pass a DeepSpeed checkpoint folder")
    if _is_tag_folder(p) and not os.path.isfile(os.path.join(p, LATEST)):
        name = os.path.basename(p)
        if tag is not None and tag != name:
            raise UsageError(f"{path} is the tag folder {name!r}; --tag {tag} names another: pass the folder that "
                             "holds the tags with --tag, or drop --tag")
        ds = DeepSpeedFolder(p, None, name)
    else:
        ds = _tag_of_top(path, p, tag)
    _list_states(ds)
    return ds


def _tag_of_top(path: str | os.PathLike[str], p: str, tag: str | None) -> DeepSpeedFolder:
    """The tag folder of the top folder ``p`` (``path`` as given): ``tag``, else the one its ``latest`` names.

    Raises:
        UsageError: no ``latest`` and no ``tag``; no such tag folder.
        CorruptCheckpointError: ``latest`` names no folder inside ``p``.
        UnsupportedError: the tag folder leaves ``p`` (a link elsewhere).
    """
    tags = _tags(p)
    if tag is None:
        tag = _latest_tag(path, p, tags)
    if not tag or os.path.basename(tag) != tag or tag in (".", ".."):
        raise CorruptCheckpointError(f"{path}: 'latest' names {tag!r}, not a tag folder inside the checkpoint "
                                     f"folder (DeepSpeed would read {os.path.join(p, tag)}, outside it); pass "
                                     "--tag, and run ckptool scan on the folder to see what it names")
    folder = os.path.join(p, tag)
    if not os.path.isdir(folder):
        raise UsageError(f"{path}: no tag folder {tag!r} (tags: {', '.join(tags) or 'none found'})")
    why = leaves_folder(p, tag)
    if why is not None:
        raise UnsupportedError(f"{path}: the tag folder {tag!r} is not inside the checkpoint folder ({why}); "
                               "ckptool reads only tags inside it: pass the tag folder itself if you trust "
                               "it, and run ckptool scan on the folder to see what it holds")
    return DeepSpeedFolder(folder, p, tag, tags=tags)


def _latest_tag(path: str | os.PathLike[str], p: str, tags: list[str]) -> str:
    """The tag the ``latest`` file of the top folder ``p`` names (stripped).

    Raises:
        UsageError: there is no ``latest`` file.
    """
    latest = os.path.join(p, LATEST)
    if not os.path.isfile(latest):
        listed = ", ".join(tags) or "none found"
        raise UsageError(f"{path} has no 'latest' file naming the checkpoint to read; pass the tag folder "
                         f"itself ({os.path.join(path, tags[0]) if tags else 'DIR/global_stepN'}) or --tag "
                         f"(tags: {listed})")
    with open(latest, encoding="utf-8", errors="replace") as f:
        return f.read().strip()


def _list_states(ds: DeepSpeedFolder) -> None:
    """Fill ``ds``'s model and optimizer state files (in natural order).

    Raises:
        CorruptCheckpointError: either kind is missing.
        UnsupportedError: model-parallel ranks other than ``00``.
    """
    names = sorted(os.listdir(ds.folder), key=natural_key)
    ds.model_files = [os.path.join(ds.folder, n) for n in names if n.endswith(MODEL_SUFFIX)]
    ds.optim_files = [os.path.join(ds.folder, n) for n in names if n.endswith(OPTIM_SUFFIX)]
    if not ds.model_files or not ds.optim_files:
        what = "*_model_states.pt" if not ds.model_files else "*_optim_states.pt"
        raise CorruptCheckpointError(f"{ds.folder} holds no {what} files; it is not a complete DeepSpeed ZeRO "
                                     "checkpoint (was the save interrupted?)")
    mp = {m.group(1) for f in ds.files for m in [_MP_RANK.search(os.path.basename(f))] if m}
    if mp - {"00"}:
        raise UnsupportedError(f"{ds.folder} holds model-parallel ranks ({', '.join(sorted(mp))}): consolidating "
                               "tensor/pipeline-parallel checkpoints needs the model's own merge rules (DeepSpeed's "
                               "ds_to_universal); ckptool consolidates data-parallel ZeRO checkpoints")


def loaded_tag_folders(top: str, listing: tuple[list[str], list[str]] | None = None) -> list[tuple[str, str]]:
    """The tag folders a DeepSpeed loader may read from the folder ``top`` that are not inside it, each with why:
    the tag named by ``latest`` / ``latest_universal`` joined as ``engine.load_checkpoint`` and ``zero_to_fp32``
    join it (``os.path.join(top, tag)``: an absolute tag or ``..`` leaves ``top``), and every subfolder that is a
    symbolic link to a tag folder elsewhere (``--tag`` / ``tag=`` reads any of them). Tags inside ``top`` are left
    out (a walk of ``top`` sees them); so are tags that name no folder (the loader fails). ``listing``: ``(folders,
    files)`` of ``top`` when the caller has listed it (``os.walk``), else it is listed here. Reads ``latest`` and
    directory listings only; never raises."""
    found: dict[str, str] = {}
    if listing is None:
        try:
            names = os.listdir(top)
        except OSError:
            names = []
        listing = (names, names)
    subdirs, files = listing
    for name in LATEST_FILES:
        latest = os.path.join(top, name)
        if name not in files or not os.path.isfile(latest):
            continue
        try:
            with open(latest, encoding="utf-8", errors="replace") as f:
                tag = f.read(4096).strip()
        except OSError:
            continue
        folder = os.path.join(top, tag)
        why = leaves_folder(top, tag) if tag else None
        if why is not None and os.path.isdir(folder):
            found.setdefault(folder, f"{latest} names the tag {tag!r}: {why}")
    for n in sorted(subdirs, key=natural_key):
        folder = os.path.join(top, n)
        if os.path.islink(folder) and _is_tag_folder(folder):
            why = leaves_folder(top, n)
            if why is not None:
                found.setdefault(folder, f"the tag folder {n}: {why}")
    return list(found.items())


def read_files(paths: list[str]) -> list[Checkpoint]:
    """The structure of each file (:func:`~ckptool.formats.torchfile.read_checkpoint`: pickle only, no tensor data,
    nothing imported) with the data offset of every record filled in.

    Raises:
        NotACheckpointError / CorruptCheckpointError / UnsupportedError: as ``read_checkpoint``; a big-endian
            file (UnsupportedError).
    """
    from ckptool.formats.torchfile import read_checkpoint, resolve_zip_offsets  # noqa: PLC0415

    out = []
    for p in paths:
        ck = read_checkpoint(p)
        if ck.byteorder != "little":  # ZeRO partitions are gathered by byte range, never swapped
            raise UnsupportedError(f"{p} was saved on a big-endian machine (its byteorder record says "
                                   f"{ck.byteorder!r}); ckptool gathers DeepSpeed partitions by byte range and does "
                                   "not swap them: consolidate it with DeepSpeed's zero_to_fp32 instead")
        with open(p, "rb") as f:
            resolve_zip_offsets(ck, f)
        out.append(ck)
    return out


@dataclass(frozen=True)
class FlatBytes:
    """Where a contiguous tensor's bytes lie: ``numel`` elements of ``dtype`` at byte ``offset`` of ``path``;
    ``shape`` is the tensor's shape."""

    path: str
    offset: int
    numel: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


def tensor_bytes(ck: Checkpoint, node: object, what: str) -> FlatBytes:
    """Where the bytes of tensor ``node`` of checkpoint ``ck`` lie (its storage record's data offset plus its
    storage offset). ``what`` names the tensor in errors.

    Raises:
        CorruptCheckpointError: not a tensor, not contiguous, or reaching past its storage.
    """
    if not isinstance(node, TensorNode) or node.storage is None:
        raise CorruptCheckpointError(f"{ck.path}: {what} is not a tensor; the file is not a DeepSpeed checkpoint "
                                     "ckptool can read")
    shape, stride = node.shape, node.stride
    n = numel(shape)
    expected = 1
    for s, st in zip(reversed(shape), reversed(stride)):
        if s != 1 and st != expected:
            raise CorruptCheckpointError(f"{ck.path}: {what} is not contiguous; DeepSpeed saves flat tensors")
        expected *= s
    dtype = tensor_dtype(node)
    ref = node.storage
    rec = ck.record("data/" + ref.key)
    if rec is None or rec.offset < 0:
        raise CorruptCheckpointError(f"{ck.path}: {what} has no storage record; the file is damaged")
    esize = DTYPE_SIZES[dtype]
    if (node.storage_offset + n) * esize > rec.size:
        raise CorruptCheckpointError(f"{ck.path}: {what} reaches past its storage; the file is damaged")
    return FlatBytes(ck.path, rec.offset + node.storage_offset * esize, n, dtype, tuple(shape))
