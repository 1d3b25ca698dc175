"""The readers layer: one entry point for every checkpoint format, and the registry of formats.

:func:`open_checkpoint` (a local path or a URL) recognises the format once, from the bytes and the folder layout
(never from a file name alone), and returns an :class:`Opened`: the format's registry entry, the path to read, and
the readers of what it holds, each read at most once:

* :meth:`Opened.graph`: the pickle as a node graph (:func:`ckptool.formats.torchfile.read_checkpoint`, nothing
  imported or run), for the formats that are pickles;
* :meth:`Opened.state_dict`: the selected state_dict's tensors as one :class:`~ckptool.formats.tensors.Source`
  (FQN, dtype, shape, strides, storage offset, storage identity, location tag, and the byte ranges that hold the
  data in which file), the same for every format, so that an operation never reads a format through another
  operation's code.

The registry (:data:`FORMATS`) lists every format ckptool reads, in the order ``docs/formats.md`` shows them; the
support matrix (:mod:`ckptool.ops.matrix`) has one row per entry, and a test holds the two to the same names.

=====================  ===============================================================================
format                 recognised by (:mod:`ckptool.formats.detect`, :mod:`ckptool.formats.sharded`, ...)
=====================  ===============================================================================
``torch-zip``          a zip holding ``data.pkl`` (``torch.save``)
``torch-legacy``       the legacy magic number as the first pickle (``_use_new_zipfile_serialization=False``)
``torchscript``        a zip holding ``constants.pkl`` or ``code/`` (``torch.jit.save``)
``torch-package``      a zip holding ``.data/extern_modules`` (``torch.package.PackageExporter``)
``safetensors``        an 8-byte header length, then ``{``
``sharded-safetensors`` an ``*.index.json`` (or a folder holding one) whose shards are safetensors
``sharded-bin``        an ``*.index.json`` whose shards are torch files (or a mix)
``dcp``                a folder holding ``.metadata`` (``torch.distributed.checkpoint``)
``torch-export``       a zip holding ``archive_format`` (``torch.export.save``, ``.pt2``)
``deepspeed``          a folder holding ``latest`` or ``global_step*/`` ZeRO files
``pickle``             a plain pickle (protocol 2-5) without torch's layout
=====================  ===============================================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar, cast

from ckptool import _source as source
from ckptool.errors import NotACheckpointError, UnsupportedError, UsageError
from ckptool.formats import detect, torch_package
from ckptool.formats import pt2 as pt2_layout
from ckptool.formats.dcp import DcpMetadata, read_dcp_metadata
from ckptool.formats.deepspeed import is_deepspeed_folder
from ckptool.formats.pt2 import Pt2Archive
from ckptool.formats.safetensors import SafetensorsHeader, read_header
from ckptool.formats.sharded import INDEX_SUFFIX, ShardIndex, is_checkpoint_set, parse_index, read_index, set_kind
from ckptool.formats.tensors import Piece, Source, Storage, Tensor, is_contiguous, span
from ckptool.formats.torchfile import Checkpoint, read_checkpoint, read_pickle_file
from ckptool.formats.zipdir import ZipEntry
from ckptool.model.graph import find_state_dicts
from ckptool.model.keys import shared_prefixes
from ckptool.model.values import iter_values
from ckptool.model.zero import ZeroCheckpoint, read_zero
from ckptool.readers.read_dcp import dcp_source, dcp_tree
from ckptool.readers.read_deepspeed import deepspeed_source
from ckptool.readers.read_package import package_source, package_state_dicts
from ckptool.readers.read_pt2 import pt2_source
from ckptool.readers.read_safetensors import index_source, safetensors_source
from ckptool.readers.read_torch import torch_source

__all__ = [
    "FORMATS",
    "Format",
    "Opened",
    "Piece",
    "Source",
    "StateDictEntry",
    "Storage",
    "Tensor",
    "format_of",
    "is_contiguous",
    "open_checkpoint",
    "span",
]

Kind = Literal["file", "set", "folder"]
_T = TypeVar("_T")


@dataclass(frozen=True)
class Format:
    """One registry entry: ``name`` (as ``inspect --json``, ``convert``'s result and ``docs/formats.md`` name it),
    ``label`` (what it is, for people), ``kind`` (one ``file``, a ``set`` of files named by an index, or a
    ``folder``), ``pickled`` (its structure is a pickle read as a node graph: :meth:`Opened.graph`), and
    ``tensors``: whether ckptool reads its tensors without running code (:meth:`Opened.state_dict`), else
    ``refusal``, the sentence that says why not and what to do instead (a torch.package archive, whose tensors
    are read, keeps one for the commands that do not take it yet: ``ckptool.ops.matrix``); ``keyed``: it holds
    several mappings, of which a dotted ``key`` selects one (the others hold one flat mapping of tensors);
    ``loaded_by``: the call its users load it with (``torch.load`` for torch's own files, whose pickles
    ``torch.load(weights_only=True)``'s allowlist decides), what ``inspect``'s advice names."""

    name: str
    label: str
    kind: Kind
    pickled: bool = False
    tensors: bool = True
    refusal: str = ""
    keyed: bool = False
    loaded_by: str = "torch.load"


#: every format ckptool reads, in the order of ``docs/formats.md``
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format(detect.TORCH_ZIP, "`torch.save` zip (`pytorch_model.bin`, accelerate's `optimizer.bin`)", "file",
           pickled=True, keyed=True),
    Format(detect.TORCH_LEGACY, "`torch.save(..., _use_new_zipfile_serialization=False)`", "file", pickled=True,
           keyed=True),
    Format(detect.TORCHSCRIPT, "TorchScript (`torch.jit.save`)", "file", pickled=True, tensors=False,
           loaded_by="torch.jit.load",
           refusal="is a TorchScript archive, not a torch.save checkpoint; load it with torch.jit.load(path, "
                   "map_location='cpu'), save model.state_dict() with torch.save, then run the command on that file"),
    Format(detect.TORCH_PACKAGE, "torch.package (`PackageExporter`)", "file", keyed=True,
           loaded_by="torch.package.PackageImporter",
           refusal="is a torch.package archive: its objects are rebuilt by the package's own code, which this "
                   "command would run; `ckptool convert PATH -o model.safetensors` writes its tensors without "
                   "running it (then run the command on that file), torch.package.PackageImporter(path)."
                   "load_pickle(...) loads them (runs the package's code: trusted files only)"),
    Format(detect.SAFETENSORS, "safetensors file", "file", loaded_by="safetensors.torch.load_file"),
    Format("sharded-safetensors", "sharded safetensors set (`*.safetensors.index.json`)", "set",
           loaded_by="safetensors.torch.load_file"),
    Format("sharded-bin", "sharded torch set (`*.bin.index.json`)", "set"),
    Format("dcp", "`torch.distributed.checkpoint` folder", "folder", keyed=True,
           loaded_by="torch.distributed.checkpoint.load"),
    Format(detect.PT2, "torch.export archive (`.pt2`)", "file", keyed=True, loaded_by="torch.export.load"),
    Format("deepspeed", "DeepSpeed ZeRO folder (`latest`, `global_step*/`)", "folder",
           loaded_by="DeepSpeedEngine.load_checkpoint"),
    Format(detect.PICKLE, "a plain pickle (no torch layout)", "file", pickled=True, tensors=False,
           loaded_by="pickle.load",
           refusal="is a plain pickle without torch storages, not a torch.save checkpoint"),
)}


@dataclass(frozen=True)
class StateDictEntry:
    """A state_dict a checkpoint holds: its dotted ``path`` (``""``: the top level, or the one flat mapping of
    safetensors, sharded sets and DeepSpeed folders), its ``keys``, the wrapper ``prefixes`` every key shares
    (``module.`` of DataParallel / DDP, ``_orig_mod.`` of ``torch.compile``, Lightning's ``model.``:
    :func:`ckptool.model.keys.shared_prefixes`), and whether it is a pickled ``nn.Module``'s (``module``)."""

    path: str
    keys: tuple[str, ...]
    prefixes: tuple[str, ...]
    module: bool = False


@dataclass
class Opened:
    """A checkpoint whose format is known: ``path`` as given, ``target`` the path read (the ``*.index.json`` of a
    sharded set, the single weights file of a model folder, else ``path``), ``format`` its :data:`FORMATS` name.

    Its readers cache what they read, so one command reads each pickle and header once.
    """

    path: str
    format: str
    target: str
    _graph: Checkpoint | None = field(default=None, repr=False)
    _dcp: DcpMetadata | None = field(default=None, repr=False)
    _package: torch_package.Package | None = field(default=None, repr=False)
    _parsed: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> Format:
        """The registry entry of :attr:`format`."""
        return FORMATS[self.format]

    def require_file(self) -> Opened:
        """``self`` when it is one file; for a command that reads one checkpoint file.

        Raises:
            UsageError: a folder (DCP, DeepSpeed, or a model folder holding a sharded set).
            NotACheckpointError: a sharded set's ``*.index.json``.
            (each naming ``ckptool convert``, which makes one file of it)
        """
        if self.spec.kind == "file":
            return self
        if os.path.isdir(self.path):
            raise UsageError(detect.folder_refusal(self.path))
        raise NotACheckpointError(detect.index_refusal(self.path))

    def dcp_metadata(self) -> DcpMetadata:
        """A DCP folder's ``.metadata`` (:func:`ckptool.formats.dcp.read_dcp_metadata`, restricted unpickler), read
        once.

        Raises:
            UnsupportedError: not a DCP folder; see also :func:`~ckptool.formats.dcp.read_dcp_metadata`.
        """
        if self.format != "dcp":
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}, not a DCP folder")
        if self._dcp is None:
            self._dcp = read_dcp_metadata(self.target)
        return self._dcp

    def package(self) -> torch_package.Package:
        """A torch.package archive's pickles as node graphs (:func:`ckptool.formats.torch_package.read_package`,
        nothing imported or run), read once.

        Raises:
            UnsupportedError: not a torch.package archive; see also
                :func:`~ckptool.formats.torch_package.read_package`.
        """
        if self.format != detect.TORCH_PACKAGE:
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}, not a torch.package archive")
        if self._package is None:
            self._package = torch_package.read_package(self.target)
        return self._package

    def _cached(self, what: str, read: Callable[[], _T]) -> _T:
        """``read()`` once per :class:`Opened` and ``what`` (the parse of one structure of the checkpoint)."""
        if what not in self._parsed:
            self._parsed[what] = read()
        return cast(_T, self._parsed[what])

    def safetensors_header(self) -> SafetensorsHeader:
        """A safetensors file's JSON header (:func:`ckptool.formats.safetensors.read_header`), read once.

        Raises:
            UnsupportedError: not a safetensors file; see also :func:`~ckptool.formats.safetensors.read_header`.
        """
        if self.format != detect.SAFETENSORS:
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}, not a safetensors file")
        return self._cached("header", lambda: read_header(self.target))

    def index(self) -> ShardIndex:
        """A sharded set's index, every shard it names checked to exist (:func:`ckptool.formats.sharded.read_index`),
        read once.

        Raises:
            UnsupportedError: not a sharded set; see also :func:`~ckptool.formats.sharded.read_index`.
        """
        if self.spec.kind != "set":
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}, not a sharded set")
        return self._cached("index", lambda: read_index(self.target))

    def zip_entries(self) -> list[ZipEntry]:
        """A zip file's central directory (:func:`ckptool.formats.detect.zip_entries`, cached per file version).

        Raises:
            UnsupportedError: a set or folder; see also :func:`~ckptool.formats.detect.zip_entries`.
        """
        if self.spec.kind != "file":
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}, not one zip file")
        return self._cached("zip", lambda: detect.zip_entries(self.target))

    def pt2(self) -> Pt2Archive:
        """A torch.export archive's structure (:func:`ckptool.formats.pt2.read_pt2`: version records, payload
        configs, signatures; nothing unpickled), read once.

        Raises:
            UnsupportedError: not a ``.pt2`` archive; see also :func:`~ckptool.formats.pt2.read_pt2`.
        """
        if self.format != detect.PT2:
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}, not a torch.export archive")
        # the parser by its module: the name read_pt2 in this package is the submodule readers.read_pt2
        return self._cached("pt2", lambda: pt2_layout.read_pt2(self.target, self.zip_entries()))

    def zero(self, tag: str | None = None) -> ZeroCheckpoint:
        """A DeepSpeed ZeRO folder's pickles and consolidation plan (:func:`ckptool.model.zero.read_zero`, ``tag``
        as there), read once per tag.

        Raises:
            UnsupportedError: not a DeepSpeed folder; see also :func:`~ckptool.model.zero.read_zero`.
        """
        if self.format != "deepspeed":
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}, not a DeepSpeed folder")
        return self._cached(f"zero:{tag}", lambda: read_zero(self.target, tag))

    def graph(self) -> Checkpoint:
        """The pickle as a node graph (nothing imported or run), read once.

        Raises:
            UnsupportedError: a format that is not a torch pickle (safetensors, torch.export and torch.package
                archives: :func:`ckptool.formats.torchfile.read_checkpoint`'s message; sets and folders).
            NotACheckpointError / CorruptCheckpointError: see :func:`ckptool.formats.torchfile.read_checkpoint`.
        """
        if self._graph is None:
            if self.spec.kind != "file":
                raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}: several files, not one pickle")
            self._graph = (read_pickle_file(self.target) if self.format == detect.PICKLE
                           else read_checkpoint(self.target, self.format))
        return self._graph

    def state_dicts(self) -> list[StateDictEntry]:
        """Every state_dict the checkpoint holds, outermost first (:func:`ckptool.model.graph.find_state_dicts`
        for a pickle or a DCP folder's nesting; every pickle of a torch.package archive, keyed ``<member>:<path>``;
        the one flat mapping of the other formats), with its keys and wrapper prefixes. Reads pickles and headers
        only.

        Raises:
            UnsupportedError: a format whose tensors are not read without running code (TorchScript reads as a
                pickle), see :meth:`state_dict`.
        """
        if self.spec.pickled or self.format == "dcp":
            root = self.graph().root if self.spec.pickled else dcp_tree(self.dcp_metadata())
            refs = find_state_dicts(root)
            return [StateDictEntry(r.path, tuple(keys), tuple(shared_prefixes(keys)), r.is_module)
                    for r in refs for keys in [r.keys()]]
        if self.format == detect.TORCH_PACKAGE:  # keyed <member>:<path>, as inspect prints them
            return [StateDictEntry(k, tuple(keys), tuple(shared_prefixes(keys)), r.is_module)
                    for k, r in package_state_dicts(self.package()) for keys in [r.keys()]]
        names = tuple(t.name for t in self.state_dict().tensors)
        return [StateDictEntry("", names, tuple(shared_prefixes(names)))]

    def values(self) -> dict[str, object]:
        """The plain non-tensor values by dotted path (epoch, step, hyper-parameters: :func:`ckptool.model.values.
        iter_values`) of a pickle; a safetensors file's ``__metadata__`` strings; nothing for the other formats
        (their non-tensor entries are pickles ckptool does not run, or absent). Tensor data is never read."""
        if self.spec.pickled:
            return dict(iter_values(self.graph().root))
        if self.format == detect.SAFETENSORS:
            return dict(self.safetensors_header().metadata or {})
        return {}

    def state_dict(self, key: str | None = None, *, tag: str | None = None, exclude_frozen: bool = False) -> Source:
        """The selected state_dict's tensors as a :class:`Source` (no tensor bytes read), chosen as ``convert``
        chooses it: ``key`` (a dotted path; in a torch.package archive ``<member>`` or ``<member>:<path>``,
        :func:`ckptool.readers.read_package.package_source`), else the one state_dict of a training checkpoint
        (:func:`ckptool.readers.read_torch.select_state_dict`); in a DCP folder, in the nesting its
        ``planner_data`` records, ``""`` selecting every tensor by its fully qualified name
        (:func:`ckptool.readers.read_dcp.dcp_source`). ``tag`` / ``exclude_frozen``: a DeepSpeed folder's
        tag folder and frozen parameters.

        Raises:
            UsageError: ``key`` for a format holding one flat mapping (safetensors, sharded sets, DeepSpeed) or
                naming nothing; ``tag`` / ``exclude_frozen`` for a format that is not DeepSpeed.
            UnsupportedError: a format whose tensors ckptool does not read without running code
                (:attr:`Format.refusal`); see also the format's reader.
        """
        spec = self.spec
        if (tag is not None or exclude_frozen) and self.format != "deepspeed":
            raise UsageError(f"--tag and --exclude-frozen apply to DeepSpeed checkpoint folders; {self.path} is not "
                             "one")
        if not spec.tensors:
            raise UnsupportedError(f"{self.path} {spec.refusal}")
        if key is not None and not spec.keyed:
            what = {"safetensors": "is safetensors", "deepspeed": "is a DeepSpeed checkpoint"}.get(
                spec.name, "is a sharded set")
            raise UsageError(f"{self.path} {what}: it holds one flat mapping of tensors, so --key does not apply")
        reader = _TENSOR_READERS[spec.name]
        return reader(self, key, tag, exclude_frozen)


def _torch(o: Opened, key: str | None, _tag: str | None, _frozen: bool) -> Source:
    return torch_source(o.target, o.format, key, o.graph())


def _package(o: Opened, key: str | None, _tag: str | None, _frozen: bool) -> Source:
    return package_source(o.target, key, o.package())


def _safetensors(o: Opened, _key: str | None, _tag: str | None, _frozen: bool) -> Source:
    return safetensors_source(o.target)


def _sharded(o: Opened, _key: str | None, _tag: str | None, _frozen: bool) -> Source:
    return index_source(o.target)


def _pt2(o: Opened, key: str | None, _tag: str | None, _frozen: bool) -> Source:
    return pt2_source(o.target, key, o.pt2())


def _dcp(o: Opened, key: str | None, _tag: str | None, _frozen: bool) -> Source:
    return dcp_source(o.target, key, o.dcp_metadata())


def _deepspeed(o: Opened, _key: str | None, tag: str | None, frozen: bool) -> Source:
    return deepspeed_source(o.zero(tag), frozen)


_TENSOR_READERS: dict[str, Callable[[Opened, str | None, str | None, bool], Source]] = {
    detect.TORCH_ZIP: _torch, detect.TORCH_LEGACY: _torch, detect.SAFETENSORS: _safetensors,
    "sharded-safetensors": _sharded, "sharded-bin": _sharded, detect.PT2: _pt2, "deepspeed": _deepspeed,
    "dcp": _dcp, detect.TORCH_PACKAGE: _package,
}


def _set_format(index_path: str) -> str:
    """``sharded-safetensors`` when every shard the index names is a ``.safetensors`` file, else ``sharded-bin``
    (the shards' own bytes are checked when they are read)."""
    shards = parse_index(index_path).shards
    return "sharded-safetensors" if shards and all(s.endswith(".safetensors") for s in shards) else "sharded-bin"


def format_of(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(format name, path to read)`` of the checkpoint at ``path``: the one place ckptool tells formats apart.

    A folder is a DeepSpeed checkpoint (:func:`ckptool.formats.deepspeed.is_deepspeed_folder`), a DCP checkpoint
    (``.metadata``), a model folder holding one ``*.index.json`` (read as that set) or one weights file
    (``model.safetensors`` / ``pytorch_model.bin``: read as that file); an ``*.index.json`` is a sharded set;
    anything else is a file recognised from its first bytes (:func:`ckptool.formats.detect.detect_format`).

    Raises:
        UsageError: a missing path; a folder that is none of those.
        NotACheckpointError / CorruptCheckpointError: see :func:`ckptool.formats.detect.detect_format`.
    """
    p = os.fspath(path)
    if not source.is_url(p) and os.path.isdir(p) and is_deepspeed_folder(p):
        return "deepspeed", p
    if (not source.is_url(p) and is_checkpoint_set(p)) or p.endswith(INDEX_SUFFIX):
        kind, target = set_kind(p)
        if kind == "dcp":
            return "dcp", target
        if kind == "index":
            return _set_format(target), target
        p = target  # a model folder holding one weights file
    return _file_format(p), p


#: a local file's version (:func:`ckptool._source.version_key`) -> its format, so that the steps of one command
#: (its output name, the operation, the hint it prints) recognise a file once
_detected: dict[tuple[object, ...], str] = {}


def _file_format(path: str) -> str:
    """:func:`ckptool.formats.detect.detect_format` of ``path``, remembered per version of a local file."""
    return source.per_version(_detected, path, lambda: detect.detect_format(path), keep=64)


def open_checkpoint(path: str | os.PathLike[str]) -> Opened:
    """Open the checkpoint at ``path`` (a file, a sharded set's ``*.index.json``, a folder, or a URL of a file or
    index): its format recognised once (:func:`format_of`), nothing else read yet.

    Raises: what :func:`format_of` raises.
    """
    p = os.fspath(path)
    fmt, target = format_of(p)
    return Opened(p, fmt, target)
