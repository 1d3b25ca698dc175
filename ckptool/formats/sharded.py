"""Sharded checkpoint sets: the ``*.index.json`` that maps each tensor to its shard, and the file layout.

Layout (``transformers`` ``save_pretrained``, ``huggingface_hub.split_state_dict_into_shards``): an index
``{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file name}}`` beside the shards
``model-00001-of-00003.safetensors`` ... (``pytorch_model-00001-of-00003.bin`` for torch shards): the index of
``NAME.EXT`` shards is ``NAME.EXT.index.json`` (:class:`SetLayout`). A model folder whose weights fit one file
holds ``model.safetensors`` or ``pytorch_model.bin`` and no index.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ckptool import _source as source
from ckptool.errors import CkptError, CorruptCheckpointError, InputNotFoundError, UsageError
from ckptool.formats.detect import INDEX_SUFFIX as INDEX_SUFFIX  # re-exported: its home is detect (format_of)
from ckptool.formats.detect import SAFETENSORS, detect_format

#: output format -> (file stem, suffix) of its shards, as ``transformers`` names them
SHARD_NAMES: dict[str, tuple[str, str]] = {"safetensors": ("model", ".safetensors"), "torch": ("pytorch_model", ".bin")}
#: suffixes of an output name that make a sharded output a set of files beside it rather than a folder
SET_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: the one weights file of a model folder small enough for a single file
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
#: the weights files of a PEFT adapter folder (beside ``adapter_config.json``), in the order PEFT's
#: ``load_peft_weights`` looks for them (``peft/utils/save_and_load.py``)
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass
class ShardIndex:
    """A parsed ``*.index.json``: its ``path``, ``weight_map`` (tensor name -> shard file name, index order) and
    ``metadata`` (the index's ``metadata`` object, ``None`` when absent or not an object)."""

    path: str
    weight_map: dict[str, str]
    metadata: dict[str, Any] | None

    @property
    def folder(self) -> str:
        """The folder of the index (for a URL, the URL up to its last ``/``)."""
        if source.is_url(self.path):
            return self.path.rsplit("/", 1)[0]
        return os.path.dirname(os.path.abspath(self.path))

    @property
    def shards(self) -> list[str]:
        """Shard file names in order of first appearance in ``weight_map``."""
        return list(dict.fromkeys(self.weight_map.values()))

    def shard_path(self, shard: str) -> str:
        if source.is_url(self.path):
            return f"{self.folder}/{shard}"
        return os.path.join(self.folder, shard)


#: a local index file's version (:func:`ckptool._source.version_key`) -> its parsed index: recognising a set's
#: format and reading it parse the JSON once
_parsed: dict[tuple[object, ...], ShardIndex] = {}


#: the largest index file parsed (bytes): the limit the safetensors library puts on a header, which an index is
#: like (one JSON object naming every tensor); a 7-million-entry index of 170 MB is refused unread
MAX_INDEX = 100_000_000


def parse_index(path: str) -> ShardIndex:
    """Parse the sharded-set index at ``path`` (a local path or a URL) without looking at the shards it names; a
    local file is parsed once per version.

    Raises:
        CorruptCheckpointError: larger than :data:`MAX_INDEX` bytes, not JSON, or no ``weight_map`` of strings to
            strings.
    """
    return source.per_version(_parsed, path, lambda: _parse_index(path))


def _parse_index(path: str) -> ShardIndex:
    try:
        with source.open_binary(path) as f:  # a local path or a URL
            text = f.read(MAX_INDEX + 1)
        if len(text) > MAX_INDEX:
            raise CorruptCheckpointError(f"{path} is larger than {MAX_INDEX} bytes, the limit safetensors puts on a "
                                         "header (an index of a few thousand tensors is well under 1 MB); refused "
                                         "before parsing")
        doc = json.loads(text.decode("utf-8"))
    except CkptError:  # a missing index (InputNotFoundError) or a URL that failed: a ValueError / OSError too
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError, a number over 4300 digits
        raise CorruptCheckpointError(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); "
                                     "re-download it") from e
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CorruptCheckpointError(f"{path} has no weight_map (tensor name -> shard file); it is not a "
                                     "sharded checkpoint index")
    meta = doc.get("metadata")
    return ShardIndex(path, wm, meta if isinstance(meta, dict) else None)


def shard_outside(index: ShardIndex, shard: str) -> str | None:
    """Why the shard file ``shard`` of ``index`` is not inside the index's folder, or None. ``transformers``
    opens ``os.path.join(folder, shard)``, so an absolute name or ``..`` leaves the folder, and so does a name
    through a symlinked subfolder (:func:`ckptool._source.leaves_folder`); a symlink to a file (the Hugging Face
    cache) is inside."""
    if source.is_url(index.path):
        norm = shard.replace("\\", "/")
        if norm.startswith("/") or ".." in norm.split("/"):
            return f"{shard} is outside {index.folder}"
        return None
    return source.leaves_folder(index.folder, shard)


def set_format(index: ShardIndex) -> str:
    """The registry name of the set ``index`` describes, from its shards' bytes (:func:`detect_format`), never
    their file names: ``sharded-safetensors`` when every shard is a safetensors file (also ones named
    ``pytorch_model-0000N-of-0000M.bin``), else ``sharded-bin`` (torch shards, or a mix). A shard that cannot be
    read (missing, not a checkpoint, or any shard of a remote set, whose bytes are read later by range) counts by
    its name's ending (``.safetensors``); reading the set then says what is wrong with it."""
    shards = index.shards
    if not shards:
        return "sharded-bin"
    remote = source.is_url(index.path)
    for shard in shards:
        if not (_shard_is_safetensors(index, shard) if not remote else shard.endswith(".safetensors")):
            return "sharded-bin"
    return "sharded-safetensors"


def index_format(index_path: str) -> str:
    """The registry name of the set whose index is at ``index_path`` (a local path or a URL): :func:`set_format` of
    its parsed index, the one answer the readers (:func:`ckptool.readers.format_of`) and ``scan`` give.

    Raises: what :func:`parse_index` raises.
    """
    return set_format(parse_index(index_path))


def _shard_is_safetensors(index: ShardIndex, shard: str) -> bool:
    try:
        return detect_format(index.shard_path(shard)) == SAFETENSORS
    except (CkptError, OSError, ValueError):
        return shard.endswith(".safetensors")


def _same_file(a: str, b: str) -> bool:
    """``a`` and ``b`` are one local file (links followed); False for URLs and missing files."""
    if source.is_url(a) or source.is_url(b):
        return a == b
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # ValueError: a NUL byte in a name the index gives (shard_outside says more)
        return False


def read_index(path: str) -> ShardIndex:
    """Read the sharded-set index at ``path`` and check that every shard it names exists beside it.

    Raises:
        CorruptCheckpointError: not JSON, no ``weight_map`` of strings to strings, or a shard path that points
            outside the index's folder (absolute, ``..``, or through a symlinked subfolder: :func:`shard_outside`;
            ``ckptool scan`` of the folder follows and reports such shards), or a shard that is an index itself
            (the index's own file or another ``*.index.json``: reading it would lead back to an index, forever).
        InputNotFoundError: a shard file is missing (the set was not downloaded completely).
    """
    index = parse_index(path)
    for shard in index.shards:
        itself = _same_file(index.shard_path(shard), path)
        if itself or shard.lower().endswith(INDEX_SUFFIX):
            raise CorruptCheckpointError(f"{path}: its weight_map names {shard!r} as a shard, which is "
                                         f"{'the index itself' if itself else 'an index'}, not a checkpoint file: "
                                         "the index is damaged or hostile; fix its weight_map")
        why = shard_outside(index, shard)
        if why is not None:
            raise CorruptCheckpointError(f"{path}: shard path {shard!r} points outside the index's folder ({why}); "
                                         "ckptool reads only shards inside it: move the shards beside the index, "
                                         "and run ckptool scan on the folder to see what they hold")
        p = index.shard_path(shard)
        if source.kind(p) != "file":
            raise InputNotFoundError(f"{path} lists shard {shard} but {p} does not exist; download every shard")
    return index


def encode_index(weight_map: dict[str, str], total_size: int, metadata: dict[str, Any] | None = None) -> bytes:
    """The bytes of an index file: ``total_size`` (bytes of tensor data) and ``weight_map`` sorted by name, indented
    as ``transformers`` writes it; ``metadata``, when given, is the index's ``metadata`` object as it is (a rewrite
    keeps its input's)."""
    meta = dict(metadata) if metadata is not None else {"total_size": total_size}
    doc = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


@dataclass(frozen=True)
class SetLayout:
    """Where a sharded output set goes: shards ``<stem>-00001-of-0000N<ext>``... and the index
    ``<stem><ext>.index.json`` in ``folder``; a set of one shard is the single file ``<stem><ext>`` and no index
    (``transformers`` ``save_pretrained``, ``huggingface_hub`` ``split_torch_state_dict_into_shards``).
    ``is_output_folder``: the folder is the output itself (made when missing), not the folder of a named set."""

    folder: str
    stem: str
    ext: str
    is_output_folder: bool = False

    @property
    def index_name(self) -> str:
        """``model.safetensors.index.json`` for stem ``model`` and ext ``.safetensors``."""
        return f"{self.stem}{self.ext}{INDEX_SUFFIX}"

    def shard_names(self, n: int) -> list[str]:
        """File names of ``n`` shards: the single ``<stem><ext>`` for ``n == 1``, else
        ``<stem>-00001-of-0000n<ext>``..."""
        if n == 1:
            return [self.stem + self.ext]
        return [f"{self.stem}-{i + 1:05d}-of-{n:05d}{self.ext}" for i in range(n)]

    def is_member(self, name: str) -> bool:
        """True for a file name a set of this layout uses, whatever its shard count: a shard, the single file or
        the index."""
        stem, ext = re.escape(self.stem), re.escape(self.ext)
        return re.fullmatch(rf"{stem}(-\d{{5}}-of-\d{{5}})?{ext}(\.index\.json)?", name) is not None


def files_named(index_path: str) -> set[str]:
    """The shard names the index at ``index_path`` names that are files of its own folder (plain names, not paths);
    none when it does not parse. The set writer's view of an index already in its output folder (an earlier set it
    replaces, or another set's it must leave alone), never raising."""
    try:
        index = parse_index(index_path)
    except CkptError:
        return set()
    return {s for s in index.shards if os.path.basename(s) == s}


def output_layout(dst: str, fmt: str) -> SetLayout:
    """The layout of a sharded output of format ``fmt`` (``"safetensors"`` / ``"torch"``) named ``dst``.

    ``dst`` ending in one of :data:`SET_FILE_SUFFIXES` (and not an existing folder) names the set beside it, as
    ``transformers`` names its files: ``x.safetensors`` gives ``x-00001-of-00003.safetensors``... plus
    ``x.safetensors.index.json``. Any other ``dst`` (an existing folder, a name ending in ``/``, a name without
    such a suffix) is the folder holding the set, named after :data:`SHARD_NAMES` (``model-00001-of-00003.safetensors``
    / ``pytorch_model-00001-of-00003.bin``).

    Raises:
        UsageError: ``dst`` is only a suffix (``.safetensors``): the shards would have no name; ``dst`` names a
            folder but is a file.
    """
    name = os.path.basename(dst)
    ext = next((name[-len(s):] for s in SET_FILE_SUFFIXES if name.lower().endswith(s)), None)
    if ext is None or os.path.isdir(dst):  # a name ending in "/" has no basename, hence no suffix
        if os.path.exists(dst) and not os.path.isdir(dst):
            raise UsageError(f"{dst} is a file; with --max-shard-size, -o names a folder for the shards or a file "
                             f"name ending in {' / '.join(SET_FILE_SUFFIXES)} to write the shards beside it")
        stem, ext = SHARD_NAMES[fmt]
        return SetLayout(os.path.abspath(dst), stem, ext, is_output_folder=True)
    if name == ext:
        raise UsageError(f"output {dst!r} names no file: give the shards a name, such as model{ext}")
    return SetLayout(os.path.dirname(os.path.abspath(dst)), name[: -len(ext)], ext)
