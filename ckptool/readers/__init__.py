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

The registry (:data:`FORMATS`, :mod:`ckptool.readers.registry`) lists every format ckptool reads, in the order
``docs/formats.md`` shows them; the support matrix (:mod:`ckptool.ops.matrix`) is generated from it.

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
``megatron-legacy``    ``latest_checkpointed_iteration.txt`` / ``mp_rank_*/model_optim_rng.pt`` folders
``megatron-dist``      a DCP folder with Megatron-Core's ``metadata.json`` (``sharded_backend``)
``pickle``             a plain pickle (protocol 2-5) without torch's layout
=====================  ===============================================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

from ckptool import _source as source
from ckptool.errors import InputNotFoundError, NotACheckpointError, UnsupportedError, UsageError
from ckptool.formats import detect
from ckptool.formats.detect import INDEX_SUFFIX
from ckptool.formats.tensors import Piece, Source, Storage, Tensor, is_contiguous, span
from ckptool.formats.torchfile import Checkpoint, read_checkpoint, read_pickle_file, read_pickle_member
from ckptool.formats.zipdir import ZipEntry
from ckptool.model.keys import check_key_lengths
from ckptool.readers.read_torch import graph_source
from ckptool.readers.reader import Reader, StateDictEntry
from ckptool.readers.registry import FORMATS, Format, plugin

if TYPE_CHECKING:  # the readers of the other formats are imported when a checkpoint of theirs is met (plugin)
    from ckptool.formats.dcp import DcpLayout, DcpMetadata
    from ckptool.formats.pt2 import Pt2Archive
    from ckptool.formats.safetensors import SafetensorsHeader
    from ckptool.formats.sharded import ShardIndex
    from ckptool.formats.torch_package import Package
    from ckptool.model.zero import ZeroCheckpoint

__all__ = [
    "FORMATS",
    "Checkpoint",
    "Format",
    "Opened",
    "Piece",
    "Reader",
    "Source",
    "StateDictEntry",
    "Storage",
    "Tensor",
    "format_of",
    "is_contiguous",
    "open_checkpoint",
    "plugin",
    "span",
]

_T = TypeVar("_T")

@dataclass
class Opened:
    """A checkpoint whose format is known: ``path`` as given, ``target`` the path read (the ``*.index.json`` of a
    sharded set, the single weights file of a model folder, else ``path``), ``format`` its :data:`FORMATS` name.

    Its readers cache what they read, so one command reads each pickle and header once.
    """

    path: str
    format: str
    target: str
    #: what it read, by name (:meth:`_cached`: its reader, the pickle's graph, the zip directory), read once per
    #: command; the structures of one format are kept by that format's reader (:attr:`reader`)
    _parsed: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> Format:
        """The registry entry of :attr:`format`."""
        return FORMATS[self.format]

    @property
    def reader(self) -> Reader:
        """This checkpoint's reader (:class:`~ckptool.readers.reader.Reader`: the class the registry entry names,
        :attr:`Format.reader`, imported when a checkpoint of that format is met), made once; what differs by format
        is its methods, to which :meth:`state_dict`, :meth:`state_dicts`, :meth:`tree`, :meth:`values`,
        :meth:`source` and :meth:`tensor_header` delegate."""
        return self._cached("reader", lambda: cast(Reader, self.spec.behaviour("read", Reader)(self)))

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
        once; also of a folder format built on DCP (:attr:`ckptool.readers.Format.dcp`: Megatron-Core's torch_dist).

        Raises:
            UnsupportedError: not a DCP folder; see also :func:`~ckptool.formats.dcp.read_dcp_metadata`.
        """
        return self.reader.dcp_metadata()

    def dcp_layout(self) -> DcpLayout | None:
        """What a rewrite of a folder written as a ``torch.distributed.checkpoint`` folder carries over beside its
        ``.metadata`` (:class:`ckptool.formats.dcp.DcpLayout`: DCP's own folder, Megatron-Core's torch_dist with its
        ``common.pt`` and ``metadata.json``; the format's ``dcp`` plug-in, :attr:`Format.dcp`); None for a format that
        is not rewritten as a DCP folder."""
        return cast("DcpLayout | None", self.spec.behaviour("dcp", _no_layout)())

    def package(self) -> Package:
        """A torch.package archive's pickles as node graphs (:func:`ckptool.formats.torch_package.read_package`,
        nothing imported or run), read once.

        Raises:
            UnsupportedError: not a torch.package archive; see also
                :func:`~ckptool.formats.torch_package.read_package`.
        """
        return self.reader.package()

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
        return self.reader.safetensors_header()

    def tensor_header(self) -> SafetensorsHeader | None:
        """The header that lists this file's tensors by name ahead of one data block (a safetensors file:
        :meth:`safetensors_header`; :attr:`Format.header`), so that a rewrite renames them there and copies the data
        block; None for a format without one (a pickle's storages are rewritten through its node graph).

        Raises: what :meth:`safetensors_header` raises.
        """
        return self.reader.header()

    def index(self) -> ShardIndex:
        """A sharded set's index, every shard it names checked to exist (:func:`ckptool.formats.sharded.read_index`),
        read once.

        Raises:
            UnsupportedError: not a sharded set; see also :func:`~ckptool.formats.sharded.read_index`.
        """
        return self.reader.index()

    def zip_entries(self) -> list[ZipEntry]:
        """A zip file's central directory (:func:`ckptool.formats.detect.zip_entries`, cached per file version).

        Raises:
            UnsupportedError: a set or folder; see also :func:`~ckptool.formats.detect.zip_entries`.
        """
        if self.spec.kind != "file":
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}, not one zip file")
        return self._cached("zip", lambda: detect.zip_entries(self.target))

    def pickle_member(self, entry: ZipEntry, f: BinaryIO | None = None) -> bytes | bytearray:
        """The bytes of the pickle member ``entry`` (one of :meth:`zip_entries`) of this zip file
        (:func:`ckptool.formats.torchfile.read_pickle_member`: a deflated member inflated as a stream, its opcodes
        checked as they arrive, so that a zip bomb costs a few MiB), read on each call; ``f``: the file already open
        for binary reading, else it is opened.

        Raises:
            UnsupportedError: a set or folder.
            CorruptCheckpointError: see :func:`~ckptool.formats.torchfile.read_pickle_member`.
        """
        if self.spec.kind != "file":
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}, not one zip file")
        if f is not None:
            return read_pickle_member(f, entry, self.target)
        with source.open_binary(self.target) as opened:
            return read_pickle_member(opened, entry, self.target)

    def pt2(self) -> Pt2Archive:
        """A torch.export archive's structure (:func:`ckptool.formats.pt2.read_pt2`: version records, payload
        configs, signatures; nothing unpickled), read once.

        Raises:
            UnsupportedError: not a ``.pt2`` archive; see also :func:`~ckptool.formats.pt2.read_pt2`.
        """
        return self.reader.pt2()

    def zero(self, tag: str | None = None) -> ZeroCheckpoint:
        """A DeepSpeed ZeRO folder's pickles and consolidation plan (:func:`ckptool.readers.read_deepspeed.
        read_zero`, ``tag`` as there), read once per tag.

        Raises:
            UnsupportedError: not a DeepSpeed folder; see also :func:`~ckptool.readers.read_deepspeed.read_zero`.
        """
        return self.reader.zero(tag)

    def graph(self) -> Checkpoint:
        """The pickle as a node graph (nothing imported or run), read once.

        Raises:
            UnsupportedError: a format that is not a torch pickle (safetensors, torch.export and torch.package
                archives: :func:`ckptool.formats.torchfile.read_checkpoint`'s message; sets and folders).
            NotACheckpointError / CorruptCheckpointError: see :func:`ckptool.formats.torchfile.read_checkpoint`.
        """
        if self.spec.kind != "file":
            raise UnsupportedError(f"{self.path} is a {self.spec.label.strip('`')}: several files, not one pickle")
        return self._cached("graph", lambda: read_pickle_file(self.target) if self.format == detect.PICKLE
                            else read_checkpoint(self.target, self.format))

    def described_graph(self) -> Checkpoint:
        """:meth:`graph` for a command that only describes it (``inspect``): a plain pickle's long bytes,
        bytearray and str values stay in the file as :class:`~ckptool.formats.nodes.BlobView` records
        (:func:`~ckptool.formats.torchfile.read_pickle_file` with ``views=True``), so memory follows its structure;
        never to be written back; the full graph when it was read already (one read per :class:`Opened`). Raises
        what :meth:`graph` raises."""
        if self.spec.kind == "file" and self.format == detect.PICKLE and "graph" not in self._parsed:
            return self._cached("described graph", lambda: read_pickle_file(self.target, views=True))
        return self.graph()

    def state_dicts(self) -> list[StateDictEntry]:
        """Every state_dict the checkpoint holds, outermost first (:func:`ckptool.model.graph.find_state_dicts`
        for a pickle or a DCP folder's nesting; every pickle of a torch.package archive, keyed ``<member>:<path>``;
        the one flat mapping of the other formats), with its keys and wrapper prefixes. Reads pickles and headers
        only.

        Raises:
            UnsupportedError: a format whose tensors are not read without running code (TorchScript reads as a
                pickle), see :meth:`state_dict`.
            CorruptCheckpointError: a key longer than :data:`ckptool.model.keys.MAX_KEY_LENGTH`.
        """
        found = self.reader.state_dicts()
        for entry in found:
            check_key_lengths(entry.keys, self.path)
        return found

    def tree(self) -> Any:
        """The nesting in which a dotted ``key`` names a state_dict: a pickle's root node (:meth:`graph`), a DCP
        folder's ``planner_data`` nesting (:func:`ckptool.readers.read_dcp.dcp_tree`); None for the other formats
        (a torch.package archive's state_dicts are ``<member>:<path>``: :meth:`state_dicts`).

        Raises: what :meth:`graph` and :meth:`dcp_metadata` raise.
        """
        return self.reader.tree()

    def all_tensors(self) -> tuple[Source, dict[str, str]]:
        """Every tensor of a torch zip, legacy or TorchScript file read whole, not one selected state_dict
        (:func:`ckptool.readers.read_torch.graph_source`: a pickled ``nn.Module`` gives its state_dict, a TorchScript
        archive's constants are keyed ``constants.<key>``), with ``{key: why}`` for the tensors whose bytes are
        not read (no storage, a compressed record); read once.

        Raises:
            UnsupportedError: a format that is no torch pickle (a plain pickle, sets, folders, other files).
            CorruptCheckpointError: see :meth:`graph`.
        """
        return self._cached("all_tensors", lambda: graph_source(self.graph()))

    def values(self) -> dict[str, object]:
        """The plain non-tensor values by dotted path (epoch, step, hyper-parameters: :func:`ckptool.model.values.
        iter_values`) of a pickle, a pickled ``nn.Module``'s attributes left out (its state_dict is its parameters
        and buffers: :func:`ckptool.model.graph.state_children`), a TorchScript archive's constants keyed
        ``constants.<key>``; a safetensors file's ``__metadata__`` strings; nothing for the other formats (their
        non-tensor entries are pickles ckptool does not run, or absent). Tensor data is never read."""
        return self.reader.values()

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
            CorruptCheckpointError: a key longer than :data:`ckptool.model.keys.MAX_KEY_LENGTH`.
        """
        spec = self.spec
        self.check_tag_options(tag, exclude_frozen)
        if not spec.tensors:
            raise UnsupportedError(f"{self.path} {spec.refusal}")
        if key is not None and not spec.keyed:
            raise UsageError(f"{self.path} is {spec.flat}: it holds one flat mapping of tensors, so --key does not "
                             "apply")
        src = self.reader.tensors(key, tag, exclude_frozen)
        check_key_lengths((t.name for t in src.tensors), self.path)
        return src

    def check_tag_options(self, tag: str | None, exclude_frozen: bool) -> None:
        """Refuse ``tag`` / ``exclude_frozen`` (a tag folder, frozen parameters left out) for a format whose
        checkpoints do not lie in tag folders (:attr:`Format.tagged`: DeepSpeed's ``global_step*``).

        Raises:
            UsageError: either is given and the format has no tag folders.
        """
        if (tag is not None or exclude_frozen) and not self.spec.tagged:
            raise UsageError(f"--tag and --exclude-frozen apply to DeepSpeed checkpoint folders; {self.path} is not "
                             "one")

    def source(self, key: str | None = None, *, tag: str | None = None, exclude_frozen: bool = False) -> Source:
        """The selected state_dict finished for a command that writes its tensors anew (``average``, ``merge-lora``):
        :meth:`state_dict` with ``key`` where the format is keyed (a format of one flat mapping has nothing to
        select, so ``key`` is not used), then the reader's :meth:`~ckptool.readers.reader.Reader.finish`
        (safetensors: the tied names ``safetensors.torch.save_model`` left out, restored as views from its
        ``__metadata__``), so that no caller finishes a :class:`Source` by its format.

        Raises: what :meth:`state_dict` raises.
        """
        src = self.state_dict(key if self.spec.keyed else None, tag=tag, exclude_frozen=exclude_frozen)
        self.reader.finish(src)
        return src


def _no_layout() -> None:
    """The ``dcp`` plug-in of a format that is not rewritten as a DCP folder."""


def format_of(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(format name, path to read)`` of the checkpoint at ``path``: the one place ckptool tells formats apart.

    A folder is the first answer of the folder classifier (:data:`ckptool.formats.folders.FOLDER_ACCEPTS`: a
    Megatron tree, a DeepSpeed or DCP folder, a model folder holding one ``*.index.json``, read as that set, or
    one weights file, read as that file, a PEFT adapter folder, read as the file PEFT loads); a set is named by
    its shards' bytes (:func:`ckptool.formats.sharded.index_format`), as is an ``*.index.json`` given as the path;
    anything else is a file recognised from its first bytes (:data:`ckptool.formats.detect.HEAD_ACCEPTS`,
    :func:`ckptool.formats.detect.detect_format`).

    Raises:
        UsageError: a folder no format accepts, or holding several indexes.
        InputNotFoundError: a missing path or index file.
        NotACheckpointError / CorruptCheckpointError: see :func:`ckptool.formats.detect.detect_format`.
    """
    p = os.fspath(path)
    if not source.is_url(p) and os.path.isdir(p):
        # the folder formats' code is imported when a folder is met (a command on one file does without it)
        from ckptool.formats import folders  # noqa: PLC0415

        kind, target = folders.classify(p)
        if kind == folders.SHARDED_SET:
            return _set_format(target), target
        if kind not in folders.ONE_FILE:
            return kind, target
        p = target  # a model folder's one weights file, a PEFT adapter's: named by its bytes
    elif p.endswith(INDEX_SUFFIX):
        if source.kind(p) != "file":
            raise InputNotFoundError(f"{p}: no such file; check the path")
        return _set_format(p), p
    return _file_format(p), p


def _set_format(index_path: str) -> str:
    """The set's format by its shards' bytes (:func:`ckptool.formats.sharded.index_format`)."""
    from ckptool.formats.sharded import index_format  # noqa: PLC0415  (imported when a set is met)

    return index_format(index_path)


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
