"""The registry of formats: one :class:`Format` per format ckptool reads, in :data:`FORMATS`, each carrying what
differs per format (its recognised kind, its facts, its refusals per operation, its support-matrix row and its
tensor reader, :meth:`Format.behaviour`). :mod:`ckptool.readers` re-exports it; :func:`ckptool.readers.open_checkpoint`
says which entry a checkpoint is.

What the layers above do differently per format (``inspect``'s describer, ``load_into``'s loader, a written file's
load hint, ``remap``'s rewriter) is theirs: each such layer declares a :class:`Role`, typed by its own
:class:`typing.Protocol`, and registers its plug-in for each format when its module is imported (Pillow's
``Image.register_open`` / ``register_save``), so that registration flows upward and this registry names no module of
a higher layer, in code or in a string.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, cast

from ckptool.errors import UnsupportedError
from ckptool.formats import detect, plugin
from ckptool.readers.support import (
    DCP_REMAP,
    FOLDER,
    JIT,
    MEGATRON,
    NO_MODULE,
    PACKAGE,
    PT2_STATE_DICT,
    SET_ROW,
    ZERO,
    Cell,
)

__all__ = ["FORMATS", "Format", "Kind", "Role", "Roles", "plugin"]

Kind = Literal["file", "set", "folder"]


Roles = Literal["read", "dcp"]

P = TypeVar("P")


class Role(Generic[P]):
    """One kind of plug-in that a layer above the readers supplies per format, as Pillow's plug-ins call
    ``Image.register_open``: the layer that calls the plug-ins declares the role, typed by its own
    :class:`typing.Protocol` (``DESCRIBE: Role[Describer] = Role("describe", "ckptool.ops")``), and registers each
    format's plug-in when the module that defines it is imported (:meth:`register`), or, for a plug-in of its own
    package that a command should import only when a checkpoint of that format is met, as a ``"module:function"``
    reference inside ``owner`` (:meth:`register_lazy`: never a module of a layer above ``owner``). The registry of
    formats (:data:`FORMATS`) never names a plug-in: adding a format to a role is one line in the layer that owns it.

    ``name``: the role, for messages (``"describe"``); ``owner``: the package whose modules its lazy references may
    name (``"ckptool.ops"``).
    """

    def __init__(self, name: str, owner: str) -> None:
        self.name = name
        self.owner = owner
        self._plugins: dict[str, P] = {}
        self._lazy: dict[str, str] = {}

    def register(self, fmt: str, plugin: P) -> P:
        """Register ``plugin`` as this role's for the format named ``fmt`` (a :data:`FORMATS` key); returns it.

        Raises:
            KeyError: ``fmt`` is no registry format.
        """
        if fmt not in FORMATS:
            raise KeyError(f"{fmt!r} is no registered format (ckptool.readers.FORMATS)")
        self._plugins[fmt] = plugin
        self._lazy.pop(fmt, None)
        return plugin

    def register_lazy(self, fmt: str, ref: str) -> None:
        """Register the function ``ref`` (``"package.module:function"``, a module inside :attr:`owner`) as this
        role's for ``fmt``, its module imported the first time a checkpoint of that format is met
        (:func:`ckptool.formats.plugin`); ``tests/test_registry.py`` resolves every one against the role's Protocol.

        Raises:
            KeyError: ``fmt`` is no registry format.
            ValueError: ``ref`` names a module outside :attr:`owner` (a lazy reference never points up a layer).
        """
        if fmt not in FORMATS:
            raise KeyError(f"{fmt!r} is no registered format (ckptool.readers.FORMATS)")
        if not ref.startswith(self.owner + "."):
            raise ValueError(f"the {self.name} plug-in {ref} is not a module of {self.owner}")
        self._lazy[fmt] = ref
        self._plugins.pop(fmt, None)

    def formats(self) -> set[str]:
        """The formats that have a plug-in for this role."""
        return set(self._plugins) | set(self._lazy)

    def references(self) -> dict[str, str]:
        """The lazy references registered (:meth:`register_lazy`), by format."""
        return dict(self._lazy)

    def find(self, fmt: str) -> P | None:
        """The plug-in registered for ``fmt`` (a lazy one imported now), None when there is none."""
        if fmt in self._lazy:  # looked up on each call, so that a test can patch it (:func:`plugin`)
            return cast(P, plugin(self._lazy[fmt]))
        return self._plugins.get(fmt)

    def get(self, fmt: str, default: P | None = None) -> P:
        """The plug-in registered for ``fmt``, else ``default``.

        Raises:
            UnsupportedError: none is registered and there is no ``default``.
        """
        found = self.find(fmt)
        if found is not None:
            return found
        if default is not None:
            return default
        label = FORMATS[fmt].label.strip("`") if fmt in FORMATS else fmt
        raise UnsupportedError(f"a {label} has no {self.name} behaviour")


@dataclass(frozen=True)
class Format:
    """One registry entry: ``name`` (as ``inspect --json``, ``convert``'s result and ``docs/formats.md`` name it),
    ``label`` (what it is, for people), ``kind`` (one ``file``, a ``set`` of files named by an index, or a
    ``folder``), ``pickled`` (its structure is a pickle read as a node graph: :meth:`Opened.graph`), and
    ``tensors``: whether ckptool reads its tensors without running code (:meth:`Opened.state_dict`), else
    ``refusal``, the sentence that says why not and what to do instead (a torch.package archive, whose tensors
    are read, keeps one for the commands that do not take it yet); ``keyed``: it holds several mappings, of which
    a dotted ``key`` selects one (the others hold one flat mapping of tensors, ``flat``: what the format is, in
    the sentence that refuses ``--key``); ``header``: its tensors are listed by name in a JSON header ahead of one
    data block (:meth:`Opened.safetensors_header`), so a rewrite renames them there and copies the data block, and
    the tied names the writing library left out are recorded in its ``__metadata__``; ``consolidate``: its tensors
    are partitions that only a consolidation joins (``ckptool convert`` writes one file of them), so the commands
    that rewrite a checkpoint (remap, the prefix commands, rename, filter) take it only once consolidated, unless
    it is a DCP folder (``dcp``, below: Megatron-Core's torch_dist, rewritten as a DCP folder);
    ``key_form``: how a ``key`` is named, for people (``PATH``, a dotted path; ``MEMBER:PATH`` in a torch.package
    archive); ``tagged``: its checkpoints lie in tag folders (DeepSpeed's ``global_step*``: ``tag`` and
    ``exclude_frozen`` apply); ``torch_distributed``: written by ``torch.distributed.checkpoint``, whose whole state
    (tensors and other entries) torch's own planner restores; ``refusals``: the sentence an operation
    (``"extract-state-dict"``; ``"rewrite"``: remap and sanitize; ``"prefix"``: the prefix commands; ``"edit"``:
    rename and filter; ``"rewrite-folder"``: a folder the rewriting commands take only once consolidated;
    ``"convert --key"`` / ``"convert to dcp"``: ``convert`` given a key, or asked for a DCP folder) refuses it with,
    where that operation has its own (a template: ``{path}``, ``{action}``,
    ``{api}``, ``{done}`` filled by :meth:`refusal_for`); ``location_tags``: its files
    record each storage's location tag (torch pickles; the others open on the CPU); ``strides``: which strides its
    tensors keep, ``"saved"`` (every tensor's, as saved), ``"views"`` (contiguous, but for the views ckptool's
    sharing record gives back: safetensors) or ``"none"`` (a DCP folder: ``dcp.load`` copies each record into the
    caller's tensors); ``loaded_by``: the call its users load it with (``torch.load`` for torch's own files, whose
    pickles ``torch.load(weights_only=True)``'s allowlist decides), what ``inspect``'s advice names; ``counts``: what a
    rewrite of it counts in its ``Wrote`` line, in the singular (``storage``; ``tensor`` where each tensor is its
    own byte range: safetensors); ``selected``: what ``convert`` of it selects when no key is given, for people
    (a DeepSpeed folder's consolidated state_dict; empty: the tensors of a flat mapping, or the whole checkpoint).

    Two plug-ins of the readers layer (or below) are named here as dotted references ``"package.module:function"``,
    resolved lazily by :meth:`behaviour` (imported the first time a checkpoint of that format is met, as fsspec's
    ``known_implementations`` does, so that nothing is imported for formats not met):

    * ``reader``: its reader class (:class:`ckptool.readers.reader.Reader`, in the format's reader module), made
      per checkpoint by :attr:`Opened.reader`: its tensors as a :class:`~ckptool.formats.tensors.Source`
      (:meth:`Opened.state_dict`; a format with ``tensors`` False is refused first), its state_dicts, nesting,
      values and header, each a method of that class;
    * ``dcp``: the folder is a ``torch.distributed.checkpoint`` folder, perhaps with files of its own beside it,
      ``() -> DcpLayout`` (:class:`ckptool.formats.dcp.DcpLayout`: the files a rewrite copies as they are, the
      globals its ``.metadata`` may name besides DCP's own); :meth:`Opened.dcp_metadata` reads it and the DCP
      rewrites write it anew (empty: not a DCP folder).

    What differs per format in the layers above (``inspect``'s describer, ``load_into``'s loader, a written
    output's load hint, ``remap``'s rewriter) is not named here: those layers register it in a :class:`Role` of
    their own, whose default reads the format's tensors through ``reader`` (a new format of one flat mapping of
    tensors registers nothing there).

    ``support`` is the format's row of the support matrix (:mod:`ckptool.ops.matrix`, ``docs/formats.md``):
    operation -> :class:`~ckptool.readers.support.Cell` for every operation that does not plainly work (a refusal
    with its reason and route, a known bug, or a working cell's phrase); None: not a row (plain pickles, which
    only ``inspect`` and ``scan`` read)."""

    name: str
    label: str
    kind: Kind
    pickled: bool = False
    tensors: bool = True
    refusal: str = ""
    keyed: bool = False
    header: bool = False
    consolidate: bool = False
    flat: str = ""
    reader: str = ""
    dcp: str = ""
    support: Mapping[str, Cell] | None = field(default=None, hash=False)
    key_form: str = "PATH"
    tagged: bool = False
    torch_distributed: bool = False
    refusals: Mapping[str, str] = field(default_factory=dict, compare=False)
    location_tags: bool = False
    strides: Literal["saved", "views", "none"] = "none"
    loaded_by: str = "torch.load"
    counts: str = "storage"
    selected: str = ""

    def refusal_for(self, operation: str, path: str, **words: str) -> str | None:
        """The sentence ``operation`` refuses a checkpoint of this format with (:attr:`refusals`), ``path`` first
        and the template's ``{path}`` / ``{...}`` filled from ``words``; None when the operation takes it."""
        template = self.refusals.get(operation)
        return None if template is None else f"{path} {template.format(path=path, **words)}"

    def behaviour(self, role: Roles, default: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """The plug-in of the readers layer (or below) this format names for ``role`` (``"read"``: its tensor
        reader; ``"dcp"``: its DCP layout), its module imported on first use (cached); ``default`` when the format
        names none. The layers above register theirs in a :class:`Role`.

        Raises:
            UnsupportedError: the format names none and there is no ``default``.
        """
        ref = getattr(self, _ROLES[role])
        if not ref:
            if default is not None:
                return default
            raise UnsupportedError(f"a {self.label.strip('`')} has no {role} behaviour")
        return plugin(ref)


#: :meth:`Format.behaviour`'s roles -> the :class:`Format` field naming the plug-in
_ROLES: dict[str, str] = {"read": "reader", "dcp": "dcp"}


_TORCH_READ = "ckptool.readers.read_torch:PickledReader"
_TORCH_ROW = {"scan": Cell("works", "safe"), "diff": Cell("works", "identical"), "extract-state-dict": NO_MODULE}

#: what torch.save files record of each tensor: its storage's location tag and its strides
_TORCH_LAYOUT: dict[str, Any] = {"location_tags": True, "strides": "saved"}

#: every format ckptool reads, in the order of ``docs/formats.md``
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format(detect.TORCH_ZIP, "`torch.save` zip (`pytorch_model.bin`, accelerate's `optimizer.bin`)", "file",
           pickled=True, keyed=True, reader=_TORCH_READ,
           support=_TORCH_ROW, **_TORCH_LAYOUT),
    Format(detect.TORCH_LEGACY, "`torch.save(..., _use_new_zipfile_serialization=False)`", "file", pickled=True,
           keyed=True, reader=_TORCH_READ, support=_TORCH_ROW, **_TORCH_LAYOUT),
    Format(detect.TORCHSCRIPT, "TorchScript (`torch.jit.save`)", "file", pickled=True, tensors=False, **_TORCH_LAYOUT,
           reader=_TORCH_READ,
           loaded_by="torch.jit.load",
           refusal="is a TorchScript archive, not a torch.save checkpoint; load it with torch.jit.load(path, "
                   "map_location='cpu'), save model.state_dict() with torch.save, then run the command on that file",
           refusals={"extract-state-dict": "is a TorchScript archive: its state_dict is torch.jit.load(path, "
                                           "map_location='cpu').state_dict()",
                     "rewrite": "is a TorchScript archive, not a torch.save checkpoint; load it on any device with "
                                "torch.jit.load(path, map_location='cpu') (or 'cuda:0')",
                     "prefix": "is a TorchScript archive: its parameter names are fixed by its compiled code and "
                               "cannot be renamed. Load it with torch.jit.load(path, map_location='cpu') and rename "
                               "model.state_dict() with ckptool.{api}(state_dict)",
                     "edit": "is a TorchScript archive: its parameter names are fixed by its compiled code and "
                             "cannot be {done}. Load it with torch.jit.load(path, map_location='cpu') and save "
                             "model.state_dict() with torch.save first",}, support={
               "scan": Cell("works", "needs-trust"),
               "diff": Cell("works", "identical"),
               "convert": Cell("refused", "is a TorchScript archive", JIT),
               "remap": Cell("refused", "is a TorchScript archive", "torch.jit.load(path, map_location='cpu')"),
               "prefix": Cell("refused", "cannot be renamed", JIT),
               "extract-state-dict": Cell("refused", "is a TorchScript archive", "torch.jit.load(path).state_dict()"),
               "sanitize": Cell("refused", "is a TorchScript archive", "torch.jit.load(path, map_location='cpu')"),
               "verify": Cell("refused", "--trust", "`ckptool verify --trust` (compiles the archive's code)"),
               "load_into": Cell("refused", "trust=True", "ckptool.load_into(model, path, trust=True)"),
               "rename": Cell("refused", "cannot be renamed", JIT),
               "filter": Cell("refused", "cannot be filtered", JIT),
               "average": Cell("refused", "is a TorchScript archive", JIT),
               "average --method": Cell("refused", "is a TorchScript archive", JIT),
               "merge-lora": Cell("refused", "is a TorchScript archive", JIT),
           }),
    Format(detect.TORCH_PACKAGE, "torch.package (`PackageExporter`)", "file", keyed=True, key_form="MEMBER:PATH",
           **_TORCH_LAYOUT, loaded_by="torch.package.PackageImporter",
           refusal="is a torch.package archive: its objects are rebuilt by the package's own code, which this "
                   "command would run; `ckptool convert PATH -o model.safetensors` writes its tensors without "
                   "running it (then run the command on that file), torch.package.PackageImporter(path)."
                   "load_pickle(...) loads them (runs the package's code: trusted files only)",
           reader="ckptool.readers.read_package:PackageReader", support={
               **dict.fromkeys(("prefix", "extract-state-dict", "sanitize", "rename", "filter"), PACKAGE),
               "scan": Cell("works", "safe"),
               "diff": Cell("works", "identical"),
               "remap": Cell("works", "re-tagged"),
               "verify": Cell("works", "bit-identical"),
           }),
    Format(detect.SAFETENSORS, "safetensors file", "file", flat="safetensors", header=True, strides="views",
           counts="tensor",
           loaded_by="safetensors.torch.load_file",
           refusals={"extract-state-dict": "is safetensors: it already is a state_dict",
                     "rewrite": "is safetensors: it carries no device tags, so there is nothing to {action}; "
                                "load it on any device with safetensors.torch.load_file(path, device='cpu')"},
           reader="ckptool.readers.read_safetensors:SafetensorsReader", support={
               "scan": Cell("works", "safe"),
               "diff": Cell("works", "identical"),
               "remap": Cell("refused", "nothing to remap", "safetensors.torch.load_file(path, device=...)"),
               "extract-state-dict": Cell("refused", "already is a state_dict", "use the file as it is"),
               "sanitize": Cell("refused", "nothing to sanitize", "safetensors.torch.load_file(path, device=...)"),
           }),
    Format("sharded-safetensors", "sharded safetensors set (`*.safetensors.index.json`)", "set", strides="views",
           loaded_by="safetensors.torch.load_file",
           refusals={"rewrite": "is safetensors: it carries no device tags, so there is nothing to "
                                "{action}; load it on any device with safetensors.torch.load_file(path, device='cpu')"},
           flat="a sharded set", reader="ckptool.readers.read_safetensors:SetReader", support={
               **SET_ROW,
               "remap": Cell("refused", "carries no device tags", "safetensors.torch.load_file(shard, device=...)"),
           }),
    Format("sharded-bin", "sharded torch set (`*.bin.index.json`)", "set", flat="a sharded set", **_TORCH_LAYOUT,
           reader="ckptool.readers.read_safetensors:SetReader",
           support=SET_ROW),
    Format("dcp", "`torch.distributed.checkpoint` folder", "folder", keyed=True, torch_distributed=True,
           loaded_by="torch.distributed.checkpoint.load",
           reader="ckptool.readers.read_dcp:DcpReader",
           dcp="ckptool.formats.dcp:plain_layout", support={
               "scan": Cell("works", "safe"),
               "diff": Cell("works", "2 of 2 matched tensors equal"),
               "remap": DCP_REMAP,
               "extract-state-dict": FOLDER, "sanitize": FOLDER,
           }),
    Format(detect.PT2, "torch.export archive (`.pt2`)", "file", keyed=True, strides="saved",
           loaded_by="torch.export.load",
           refusals={"edit": "is a torch.export archive; write its state_dict with `ckptool extract-state-dict "
                             "{path}` first"},
           reader="ckptool.readers.read_pt2:Pt2Reader", support={
               "scan": Cell("works", "safe"),
               "diff": Cell("works", "identical"),
               "remap": Cell("refused", "this command does not apply", PT2_STATE_DICT),
               "prefix": Cell("refused", "this command does not apply", PT2_STATE_DICT),
               "sanitize": Cell("refused", "this command does not apply", PT2_STATE_DICT),
               "rename": Cell("refused", "write its state_dict", PT2_STATE_DICT),
               "filter": Cell("refused", "write its state_dict", PT2_STATE_DICT),
           }),
    Format("deepspeed", "DeepSpeed ZeRO folder (`latest`, `global_step*/`)", "folder", flat="a DeepSpeed checkpoint",
           consolidate=True, tagged=True, **_TORCH_LAYOUT, loaded_by="DeepSpeedEngine.load_checkpoint",
           selected="the consolidated ZeRO state_dict (fp32 master weights, buffers)",
           refusals={"rewrite-folder": "is a DeepSpeed ZeRO checkpoint folder, which this command does not rewrite: "
                                       "consolidate it first with `ckptool convert {path} -o model.pt` (exactly as "
                                       "DeepSpeed's zero_to_fp32 does), then run the command on that file",
                     "convert --key": "is a DeepSpeed checkpoint: it holds one model, so --key does not apply",
                     "convert to dcp": "is a DeepSpeed checkpoint: convert it to safetensors or torch (DCP output is "
                                       "for torch files)"},
           reader="ckptool.readers.read_deepspeed:DeepSpeedReader",
           support={
               "scan": Cell("works", "needs-trust"),
               "diff": Cell("works", "identical"),
               "remap": ZERO, "prefix": ZERO,
               "extract-state-dict": FOLDER, "sanitize": FOLDER, "rename": FOLDER, "filter": FOLDER,
           }),
    # --- Megatron-LM / Megatron-Core / NeMo (docs/megatron.md; ckptool.formats.megatron) ---
    Format(detect.MEGATRON_LEGACY, "Megatron-LM legacy tree (`mp_rank_XX/model_optim_rng.pt`)", "folder",
           flat="a Megatron checkpoint", consolidate=True, **_TORCH_LAYOUT, loaded_by="Megatron-LM load_checkpoint",
           refusals={"rewrite-folder": "is a Megatron checkpoint folder, which this command does not rewrite: "
                                       "consolidate it first with `ckptool convert {path} -o model.pt`, then run the "
                                       "command on that file"},
           reader="ckptool.readers.read_megatron:LegacyReader",
           support={"scan": Cell("works", "needs-trust"), "diff": Cell("works", "identical"),
                    "remap": MEGATRON, "prefix": MEGATRON,
                    "extract-state-dict": FOLDER, "sanitize": FOLDER, "rename": FOLDER, "filter": FOLDER}),
    Format(detect.MEGATRON_DIST, "Megatron-Core `torch_dist` folder (`metadata.json`, `common.pt`, `.distcp`)",
           "folder",
           flat="a Megatron checkpoint", consolidate=True, loaded_by="megatron.core.dist_checkpointing.load",
           reader="ckptool.readers.read_megatron:DistReader",
           dcp="ckptool.formats.megatron:dist_layout",
           support={"scan": Cell("works", "needs-trust"), "diff": Cell("works", "identical"), "remap": DCP_REMAP,
                    "extract-state-dict": FOLDER, "sanitize": FOLDER}),
    Format(detect.PICKLE, "a plain pickle (no torch layout)", "file", pickled=True, tensors=False,
           reader=_TORCH_READ,
           loaded_by="pickle.load",
           refusal="is a plain pickle without torch storages, not a torch.save checkpoint",
           refusals={"extract-state-dict": "is a plain pickle without torch storages; there is no state_dict to "
                                           "extract",
                     "rewrite": "is a plain pickle without torch storages; there is nothing to {action}",
                     "prefix": "is a plain pickle without torch storages, not a torch.save checkpoint; load it and "
                               "rename the state_dict in memory",
                     "edit": "is a plain pickle without torch storages, not a torch.save checkpoint"}),
)}
