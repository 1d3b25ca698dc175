"""Megatron-LM / Megatron-Core / NeMo checkpoint folders: which files they hold (directory listings, two small
text files), read without Megatron and without running anything.

Two layouts (``docs/megatron.md``):

* a **legacy tree** (Megatron-LM ``megatron/training/checkpointing.py``, ``--ckpt-format torch``): a top folder
  holding ``latest_checkpointed_iteration.txt`` (an iteration number or ``release``) and one folder per save,
  ``iter_{iteration:07d}/`` or ``release/``, holding one ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/`` folder per
  model-parallel rank (``get_checkpoint_name``: the pipeline suffix only with pipeline parallelism, the expert
  suffix only with expert parallelism) with ``model_optim_rng.pt`` (and ``distrib_optim.pt`` beside it with the
  distributed optimizer);
* a **torch_dist folder** (Megatron-Core ``dist_checkpointing``, the default ``--ckpt-format torch_dist``, also
  NeMo 2's ``weights/``): a ``torch.distributed.checkpoint`` folder (``.metadata``, ``__{rank}_{i}.distcp``)
  plus ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``,
  ``megatron/core/dist_checkpointing/core.py`` ``CheckpointingConfig``) and ``common.pt`` (a ``torch.save`` of the
  entries that are not sharded tensors: ``serialization.py`` ``save``). A top folder with
  ``latest_checkpointed_iteration.txt`` may hold either; the iteration folder it names decides.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from ckptool._source import leaves_folder
from ckptool.errors import CorruptCheckpointError, UsageError
from ckptool.formats import detect
from ckptool.formats.dcp import DcpLayout

__all__ = ["COMMON_FILE", "DIST", "LATEST_FILE", "LEGACY", "MCORE_METADATA_GLOBALS", "RANK_FILE", "MegatronFolder",
           "RankFolder",
           "dist_layout", "find_megatron", "megatron_layout", "read_backend"]

LEGACY = detect.MEGATRON_LEGACY
DIST = detect.MEGATRON_DIST
LATEST_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
METADATA_JSON = "metadata.json"
COMMON_FILE = "common.pt"
#: the globals Megatron-Core adds to a torch_dist ``.metadata``: the save plans it caches there
#: (``Metadata.all_local_plans``, ``strategies/torch.py`` ``MCoreSavePlanner``), torch's own planner dataclasses
MCORE_METADATA_GLOBALS = frozenset(f"torch.distributed.checkpoint.planner.{n}" for n in (
    "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"))
#: the files of a torch_dist folder beside DCP's, which Megatron-Core's ``dist_checkpointing.load`` reads
#: (``core.py`` ``maybe_load_config``, ``strategies/common.py`` ``load_common``) and a rewrite copies as they are
DIST_COMPANIONS = (METADATA_JSON, COMMON_FILE)
_RANK_DIR = re.compile(r"mp_rank_([0-9]{2})(?:_([0-9]{3}))?(?:_([0-9]{3}))?")
_MAX_TEXT = 4096


@dataclass(frozen=True)
class RankFolder:
    """One ``mp_rank_*`` folder: its name, its tensor-parallel rank and the one or two 3-digit suffixes after it
    (pipeline, expert: which is which depends on the parallel sizes, :meth:`ranks`), its ``model_optim_rng.pt``."""

    name: str
    tp: int
    suffixes: tuple[int, ...]
    path: str

    def ranks(self, pipeline: bool) -> tuple[int, int, int]:
        """``(tp, pp, ep)``: with one suffix it is the pipeline rank when ``pipeline`` (pipeline parallelism is on),
        else the expert rank (``get_checkpoint_name`` appends the expert suffix alone without pipelining)."""
        s = self.suffixes
        if len(s) == 2:
            return self.tp, s[0], s[1]
        if len(s) == 1:
            return (self.tp, s[0], 0) if pipeline else (self.tp, 0, s[0])
        return self.tp, 0, 0


@dataclass
class MegatronFolder:
    """A Megatron checkpoint found on disk: ``folder`` the iteration folder read; ``top`` the folder holding
    ``latest_checkpointed_iteration.txt`` (None when the iteration folder was given); ``iteration`` as the
    latest file or the folder name says (``"10"``, ``"release"``; None for a bare torch_dist folder); ``layout``
    :data:`LEGACY` or :data:`DIST`; ``ranks`` the legacy tree's rank folders (sorted by name); ``backend`` a
    torch_dist folder's ``metadata.json``."""

    folder: str
    top: str | None
    iteration: str | None
    layout: str
    ranks: list[RankFolder] = field(default_factory=list)
    backend: dict[str, object] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        """The pickles a legacy tree's ranks hold (``model_optim_rng.pt``, ``distrib_optim.pt``)."""
        out = []
        for r in self.ranks:
            out.append(r.path)
            opt = os.path.join(os.path.dirname(r.path), DISTRIB_OPTIM_FILE)
            if os.path.isfile(opt):
                out.append(opt)
        return out


def dist_layout() -> DcpLayout:
    """A torch_dist folder as DCP's rewrites see it (the registry's ``dcp`` plug-in): ``metadata.json`` and
    ``common.pt`` copied byte for byte (``common.pt`` is never unpickled but by the restricted reader: its entries
    are not sharded, so no FQN of ``.metadata`` is in it), and the save plans Megatron-Core caches in
    ``.metadata`` (``all_local_plans``: torch's planner dataclasses) allowed there."""
    return DcpLayout(DIST_COMPANIONS, MCORE_METADATA_GLOBALS)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _rank_folders(folder: str) -> list[RankFolder]:
    out = []
    for n in _listdir(folder):
        m = _RANK_DIR.fullmatch(n)
        f = os.path.join(folder, n, RANK_FILE)
        if m and os.path.isfile(f):
            out.append(RankFolder(n, int(m.group(1)), tuple(int(g) for g in m.groups()[1:] if g is not None), f))
    return out


def read_backend(folder: str) -> dict[str, object] | None:
    """The ``metadata.json`` of a torch_dist folder when it names a ``sharded_backend``, else None (no such file,
    not JSON, too large). Never raises."""
    p = os.path.join(folder, METADATA_JSON)
    try:
        if not os.path.isfile(p) or os.path.getsize(p) > _MAX_TEXT:
            return None
        with open(p, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and isinstance(d.get("sharded_backend"), str) else None


def _iteration_layout(folder: str) -> str | None:
    if read_backend(folder) is not None:
        return DIST
    return LEGACY if _rank_folders(folder) else None


def _latest(top: str) -> str | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names (stripped), None without one."""
    p = os.path.join(top, LATEST_FILE)
    try:
        with open(p, encoding="utf-8", errors="replace") as f:
            return f.read(_MAX_TEXT).strip()
    except OSError:
        return None


def _iteration_folder(iteration: str) -> str:
    """``release`` or ``iter_{n:07d}`` (Megatron's ``get_checkpoint_name``); the text itself when it is neither."""
    if iteration == "release":
        return iteration
    return f"iter_{int(iteration):07d}" if iteration.isascii() and iteration.isdigit() else iteration


def megatron_layout(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(layout, iteration folder)`` of a Megatron checkpoint at ``path`` (a top folder with
    ``latest_checkpointed_iteration.txt`` whose named iteration folder is one, or an iteration folder: a legacy
    tree's ``mp_rank_*`` folders, or a torch_dist folder's ``metadata.json``), else None. Reads listings and the
    two small text files only; never raises."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        return None
    found = _iteration_layout(p)
    if found is not None:
        return found, p
    latest = _latest(p)
    if latest is None:
        return None
    sub = os.path.join(p, _iteration_folder(latest))
    if leaves_folder(p, _iteration_folder(latest)) is not None or not os.path.isdir(sub):
        # a top folder that names nothing usable: the reader says what is wrong; unless DeepSpeed's `latest` is
        # there too (Megatron-DeepSpeed writes both, its tags are DeepSpeed's global_stepN folders)
        return None if os.path.isfile(os.path.join(p, "latest")) else (LEGACY, p)
    found = _iteration_layout(sub)
    return (found, sub) if found is not None else (LEGACY, p)


def find_megatron(path: str | os.PathLike[str]) -> MegatronFolder:
    """The iteration folder of the Megatron checkpoint at ``path`` and its files.

    Raises:
        UsageError: not a folder; a top folder whose latest file names an iteration folder that is not there.
        CorruptCheckpointError: the latest file names a folder outside the top folder, or an iteration folder
            without rank folders.
    """
    p = os.path.abspath(os.fspath(path))
    if not os.path.isdir(p):
        raise UsageError(f"{path}: no such folder; pass a Megatron checkpoint folder")
    top: str | None = None
    iteration: str | None = None
    folder = p
    if _iteration_layout(p) is None:
        latest = _latest(p)
        if latest is None:
            raise UsageError(f"{path} holds neither {LATEST_FILE} nor mp_rank_* folders nor a torch_dist "
                             "metadata.json; pass a Megatron checkpoint folder")
        name = _iteration_folder(latest)
        why = leaves_folder(p, name) if name and name not in (".", "..") else "an empty or dot name"
        if why is not None or os.path.basename(name) != name:
            raise CorruptCheckpointError(f"{path}: {LATEST_FILE} names {latest!r}, not an iteration folder inside "
                                         f"the checkpoint folder ({why or 'a path'}); pass the iteration folder")
        folder, top, iteration = os.path.join(p, name), p, latest
        if not os.path.isdir(folder):
            raise UsageError(f"{path}: {LATEST_FILE} names iteration {latest!r}, but there is no folder {name}/ "
                             f"(found: {', '.join(n for n in _listdir(p) if n != LATEST_FILE) or 'nothing'})")
    else:
        base = os.path.basename(p)
        iteration = "release" if base == "release" else (base[5:].lstrip("0") or "0") if re.fullmatch(
            r"iter_\d+", base) else None
    backend = read_backend(folder)
    if backend is not None:
        return MegatronFolder(folder, top, iteration, DIST, backend=backend)
    ranks = _rank_folders(folder)
    if not ranks:
        raise CorruptCheckpointError(f"{folder} holds no mp_rank_*/{RANK_FILE} files and no torch_dist "
                                     "metadata.json: not a complete Megatron checkpoint (was the save interrupted?)")
    return MegatronFolder(folder, top, iteration, LEGACY, ranks=ranks)
