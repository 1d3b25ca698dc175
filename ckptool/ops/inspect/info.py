"""The result of ``ckptool inspect`` (:func:`ckptool.ops.inspect.entry.inspect`): :class:`CheckpointInfo` and its parts,
and their JSON (``inspect --json``, schema :data:`SCHEMA`).

Bytes are counted one way everywhere (the totals, the per-device / dtype table, ``--json``): the bytes of each
storage, once, however many tensors (tied weights, views) use it (:mod:`ckptool.ops.inspect.totals`); a tensor's
own ``nbytes`` is its numel * element size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from itertools import chain
from typing import TYPE_CHECKING, Any

from ckptool.formats import plugin
from ckptool.model.allowlist import (
    DANGEROUS,
    NEEDS_TRUST,
    UNKNOWN,
    classify_global,
    is_allowed,
    level_of,
)
from ckptool.model.keys import has_flat_param_key, shared_prefixes, suggest_command
from ckptool.model.quantization import summary as quant_summary
from ckptool.model.units import human_bytes, plural
from ckptool.model.verdict import Verdict, exit_code, verdict_of
from ckptool.ops.inspect.json_rows import rows_json
from ckptool.ops.inspect.values import ValueInfo
from ckptool.scanning.entry import ScanResult

if TYPE_CHECKING:  # the module tree and its HTML are built on demand (--tree, Jupyter): plug-ins
    from ckptool.model.tree import TreeNode

__all__ = ["FSDP_REMEDY", "SCHEMA", "TENSOR_FIELDS", "ByteTotal", "CheckpointInfo", "GlobalInfo", "StateDictInfo",
           "TensorInfo", "rate_globals", "state_dict_info"]

#: the ``"schema"`` of :meth:`CheckpointInfo.to_dict` (``ckptool inspect --json``)
SCHEMA = "ckptool.inspect/3"


@dataclass(slots=True)  # no __dict__: one per tensor (a million in a big state_dict)
class TensorInfo:
    """One tensor: dotted ``key``; ``shape`` / ``stride`` in elements; ``dtype`` torch name (``float32``);
    ``device`` the saved location tag; ``nbytes`` = numel * element size; ``storage_key`` the record it lives in
    (tensors that share a storage share the key); ``storage_offset`` in elements."""

    key: str
    shape: list[int]
    dtype: str
    device: str
    nbytes: int
    stride: list[int] = field(default_factory=list)
    storage_offset: int = 0
    storage_key: str | None = None
    requires_grad: bool = False


#: the fields of :class:`TensorInfo`, in order (the keys of each tensor in ``inspect --json``)
TENSOR_FIELDS = tuple(f.name for f in fields(TensorInfo))


@dataclass
class StateDictInfo:
    """A state_dict in the file: dotted ``path`` (``""`` = top level), tensor count, shared wrapper ``prefixes``
    (``["module."]``), the ckptool command that removes them, and whether it holds FSDP flat parameters."""

    path: str
    tensors: int
    prefixes: list[str]
    fix: str | None = None
    flat_params: bool = False

    @property
    def remedy(self) -> str | None:
        """What to do before loading it into a model: consolidate FSDP's flat parameters first
        (:data:`FSDP_REMEDY`), else :attr:`fix`; None when nothing is needed."""
        return FSDP_REMEDY if self.flat_params else self.fix


#: what a state_dict of FSDP flat parameters needs before it loads into a model
FSDP_REMEDY = "FSDP flat parameters: consolidate first (torch.distributed.checkpoint / Lightning)"


def state_dict_info(path: str, keys: list[str]) -> StateDictInfo:
    """The :class:`StateDictInfo` of the state_dict at dotted ``path`` holding ``keys``: its shared wrapper prefixes
    (:func:`ckptool.model.keys.shared_prefixes`), the command that removes them, whether it holds FSDP flat
    parameters."""
    prefixes = shared_prefixes(keys)
    return StateDictInfo(path, len(keys), prefixes, suggest_command(prefixes), has_flat_param_key(keys))


@dataclass
class GlobalInfo:
    """A global the pickle would import (``module.qualname``): ``allowed``, whether ``torch.load(weights_only=True)``
    accepts it (:func:`ckptool.model.allowlist.is_allowed`, held to torch's own verdict by a test); ``status`` and
    ``reason``, how ``ckptool scan`` rates it where it is named (:func:`ckptool.model.allowlist.classify_global`,
    filled in from ``name`` alone when not given: :func:`rate_globals` gives the pickle's context); :attr:`level`,
    scan's level of it."""

    name: str
    allowed: bool
    status: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.status:
            self.status, self.reason = classify_global(self.name)

    @property
    def level(self) -> str:
        """``safe``, ``needs-trust`` or ``dangerous``: the level ``ckptool scan`` gives this global
        (:func:`ckptool.model.allowlist.level_of`, as :attr:`ckptool.scanning.results.GlobalFinding.level`)."""
        return level_of(self.status)


def rate_globals(names: Iterable[str], *, torchscript: bool = False, dcp_metadata: bool = False) -> list[GlobalInfo]:
    """A :class:`GlobalInfo` for each of ``names`` (each once, first use first), rated as ``ckptool scan`` rates it in
    the same pickle: :func:`ckptool.model.allowlist.classify_global` with the pickle's context (``torchscript``: the
    pickle of a TorchScript archive; ``dcp_metadata``: a DCP folder's ``.metadata``); ``allowed`` is torch's
    weights_only verdict whatever the context."""
    return [GlobalInfo(n, is_allowed(n), *classify_global(n, torchscript=torchscript, dcp_metadata=dcp_metadata))
            for n in dict.fromkeys(names)]


@dataclass
class ByteTotal:
    """The tensors of one location tag and dtype: ``tensors`` counts every tensor (views and tied weights
    included), ``storages`` the distinct storages they use and ``bytes`` those storages' bytes, each storage once
    (a storage shared by tensors of several dtypes counts under the first one's). A storage no tensor uses counts
    under its own storage class's dtype, with ``tensors`` 0."""

    device: str
    dtype: str
    tensors: int = 0
    storages: int = 0
    bytes: int = 0


@dataclass
class CheckpointInfo:
    """The result of :func:`inspect`; :meth:`to_dict` is what ``ckptool inspect --json`` prints.

    ``size`` is the file size in bytes; ``devices`` maps location tag -> tensor count; ``storage_bytes`` maps
    location tag -> bytes of distinct storages there (each storage once); ``totals`` the same per location tag and
    dtype (:class:`ByteTotal`); ``storages`` counts distinct storages; ``metadata`` holds safetensors
    ``__metadata__``; ``values`` the non-tensor entries (:class:`~ckptool.ops.inspect.values.ValueInfo`), all of
    them unless ``values_complete`` is False (cut by :class:`~ckptool.ops.inspect.values.PreviewLimits`);
    ``programs`` the signature of each exported program of a ``torch.export`` archive
    (:meth:`ckptool.formats.pt2.Program.signature`);
    ``bytes_read`` the bytes transferred to read a URL (range requests: the zip directory, the pickle, headers),
    None for a local path.
    """

    path: str
    format: str
    kind: str
    size: int
    tensors: list[TensorInfo]
    devices: dict[str, int]
    storage_bytes: dict[str, int]
    state_dicts: list[StateDictInfo]
    globals: list[GlobalInfo]
    storages: int = 0
    metadata: dict[str, str] | None = None
    totals: list[ByteTotal] = field(default_factory=list)
    values: list[ValueInfo] = field(default_factory=list)
    values_complete: bool = True
    #: the safety analysis, the one ``ckptool scan`` makes (every pickle in the file, hidden ones included)
    scan: ScanResult | None = field(default=None, repr=False)
    #: the signature of each exported program of a ``torch.export`` archive (``.pt2``), else empty
    programs: list[dict[str, Any]] = field(default_factory=list)
    bytes_read: int | None = None
    #: why torch 2.13's ``torch.load(weights_only=True)`` refuses the file whatever its globals (an opcode its
    #: unpickler does not read: ``pickle_protocol=4`` saves), None when only the globals decide
    #: (:attr:`ckptool.formats.torchfile.Checkpoint.weights_only_refusal`)
    weights_only_refusal: str | None = None
    #: a ``torch.package`` archive (:func:`ckptool.ops.inspect.pickles.package_info`): ``resources`` (each pickle:
    #: ``member``, ``package``, ``resource``, ``kind``, ``tensors``, ``globals``), ``modules`` (the Python modules
    #: it ships, which ``PackageImporter`` runs), ``extern_modules``, ``python_version``, ``version``; else None
    package: dict[str, Any] | None = None
    #: the quantization: scheme, quantized weights and their scales, blocks, sizes, or why it is not dequantized
    #: (:func:`ckptool.model.quantization.describe`, from the tensors and the folder's ``config.json``); else None
    quantization: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (``dataclasses.asdict`` without its deep copies: fast for 50,000 tensors), with
        ``"schema": "ckptool.inspect/3"``, ``total_bytes`` (storage bytes, each storage once), ``totals`` and
        ``values`` (``{"path", "type", "value"}`` or ``{"path", "type", "preview"}``)."""
        d = self._dict_without_tensors()
        d["tensors"] = [{  # the fields of TensorInfo (TENSOR_FIELDS), in order: a dict display, built fastest
            "key": t.key, "shape": t.shape, "dtype": t.dtype, "device": t.device, "nbytes": t.nbytes,
            "stride": t.stride, "storage_offset": t.storage_offset, "storage_key": t.storage_key,
            "requires_grad": t.requires_grad} for t in self.tensors]
        return d

    def to_json(self, indent: int | None = None) -> str:
        """``json.dumps(self.to_dict(), indent=indent)``: the same text (what ``ckptool inspect --json`` prints),
        made faster (:meth:`json_pieces`).

        Raises:
            ValueError / TypeError: as ``json.dumps`` (a value JSON cannot hold)."""
        return "".join(self.json_pieces(indent))

    def json_pieces(self, indent: int | None = None) -> Iterator[str]:
        """The text of :meth:`to_json` in pieces (a few thousand tensor rows each), to write one after another:
        without a dict per tensor when ``indent`` is None (the tensor rows column by column). Everything is
        encoded before this returns: an error is raised here, not while the pieces are read.

        Raises:
            ValueError / TypeError: as ``json.dumps`` (a value JSON cannot hold)."""
        if indent is not None or not self.tensors:
            return iter((json.dumps(self.to_dict(), indent=indent),))
        d = self._dict_without_tensors()
        items = list(d.items())
        at = list(d).index("tensors")
        head = json.dumps(dict(items[:at]))[:-1]  # "{...": the entries before "tensors"
        tail = json.dumps(dict(items[at + 1:]))[1:]  # "...}": the entries after it
        ts = self.tensors
        columns = ([t.key for t in ts], [t.shape for t in ts], [t.dtype for t in ts], [t.device for t in ts],
                   [t.nbytes for t in ts], [t.stride for t in ts], [t.storage_offset for t in ts],
                   [t.storage_key for t in ts], [t.requires_grad for t in ts])  # TENSOR_FIELDS, in order
        rows = rows_json(TENSOR_FIELDS, columns, len(ts))
        return chain((f'{head}{", " if at else ""}"tensors": [',), rows,
                     (f']{", " if tail != "}" else ""}{tail}',))

    def _dict_without_tensors(self) -> dict[str, Any]:
        """:meth:`to_dict` with ``"tensors"`` left as the list of :class:`TensorInfo` (in its place)."""
        d = {"schema": SCHEMA, **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "scan"}}
        d["total_bytes"] = self.total_bytes
        d["totals"] = [r.__dict__.copy() for r in self.totals]
        d["values"] = [v.to_dict() for v in self.values]
        d["state_dicts"] = [sd.__dict__.copy() for sd in self.state_dicts]
        d["globals"] = [{"name": g.name, "allowed": g.allowed} for g in self.globals]
        d["security"] = self.security()
        return d

    def security(self) -> dict[str, Any]:
        """The ``security`` object of ``inspect --json``: the verdict of ``ckptool scan`` on the same file, from
        the same analysis (:attr:`scan`: every pickle in the file, not only the ones ``torch.load`` reads).

        ``verdict`` (:class:`~ckptool.model.verdict.Verdict`'s word, scan's ``verdict``) and its ``exit_code``
        (scan's), ``dangerous`` (name, reason, ``where``), ``unknown`` and ``needs_trust`` names, ``hidden_pickles``
        (the pickles ``torch.load`` does not read today: ``where``, ``globals``, ``level``, ``error``), ``notes``,
        ``code`` (code that ships in the file: ``member``, ``kind``, ``level``, ``reason``, ``detail``) and
        ``recognised`` (a known library file type)."""
        sc = self.scan
        verdict = self.verdict
        if sc is None:  # built by hand: the globals listed are all there is
            globs: list[tuple[str, str, str, list[str]]] = [(g.name, g.status, g.reason, []) for g in self.globals]
            return {"verdict": verdict.value, "exit_code": exit_code(verdict),
                    "dangerous": [{"name": n, "reason": r, "where": w} for n, st, r, w in globs if st == DANGEROUS],
                    "unknown": [n for n, st, _r, _w in globs if st == UNKNOWN],
                    "needs_trust": [n for n, st, _r, _w in globs if level_of(st) == NEEDS_TRUST],
                    "hidden_pickles": [], "notes": [], "code": [], "recognised": None}
        return {
            "verdict": verdict.value, "exit_code": sc.exit_code,
            "dangerous": [{"name": g.name, "reason": g.reason, "where": list(g.where)} for g in sc.globals
                          if g.status == DANGEROUS],
            "unknown": list(dict.fromkeys(g.name for g in sc.globals if g.status == UNKNOWN)),
            "needs_trust": list(dict.fromkeys(g.name for g in sc.globals if g.level == NEEDS_TRUST)),
            "hidden_pickles": [{"where": p.where, "globals": list(p.globals), "error": p.error,
                                "level": sc.pickle_level(p)} for p in sc.hidden],
            "notes": list(sc.notes),
            "code": [c.to_dict() for c in sc.code],
            "recognised": None if sc.recognised is None else {"kind": sc.recognised[0],
                                                              "description": sc.recognised[1]},
        }

    @property
    def unsafe_globals(self) -> list[str]:
        return [g.name for g in self.globals if not g.allowed]

    @property
    def weights_only_loads(self) -> bool:
        """True when ``torch.load(weights_only=True)`` (torch 2.13's rules) reads the file: every global on its
        allowlist and every opcode one its unpickler reads."""
        return not self.unsafe_globals and self.weights_only_refusal is None

    @property
    def verdict(self) -> Verdict:
        """``ckptool scan``'s verdict on the file (:attr:`ckptool.scanning.results.ScanResult.verdict`, from the same
        analysis: :attr:`scan`); for an info built by hand, :func:`~ckptool.model.verdict.verdict_of` the levels of
        its :attr:`globals`."""
        if self.scan is not None:
            return self.scan.verdict
        return verdict_of(g.level for g in self.globals)

    @property
    def total_bytes(self) -> int:
        """Bytes of all storages, each counted once (tied weights and views share theirs)."""
        return sum(self.storage_bytes.values())

    def tree(self, *, fold: bool = True) -> TreeNode:
        """The module tree of :attr:`tensors` by dotted key (:func:`ckptool.model.tree.build_tree`; repeated
        numbered blocks folded into one node unless ``fold`` is False)."""
        tree: TreeNode = plugin("ckptool.model.tree:build_tree")(self.tensors, fold=fold)
        return tree

    def facts(self) -> list[tuple[str, str]]:
        """The summary as ``(name, value)`` rows: format, kind, size, tensors, devices, wrapper prefixes, safety
        (what :meth:`__str__` prints and Jupyter shows above the module tree)."""
        tensors = f"{len(self.tensors)} in {plural(self.storages, 'storage')}, {human_bytes(self.total_bytes)}"
        return [("format", self.format), ("kind", self.kind), ("size", human_bytes(self.size)),
                ("tensors", tensors),
                ("devices", ", ".join(f"{d} ({n})" for d, n in self.devices.items()) or "-"),
                ("wrapper prefixes", "; ".join(f"{sd.path or '(top level)'}: {' '.join(sd.prefixes)}"
                                               for sd in self.state_dicts if sd.prefixes) or "-"),
                ("safety", self.verdict.value),
                *([("quantization", quant_summary(self.quantization))] if self.quantization else [])]

    def __str__(self) -> str:
        """A short summary (``print(ckptool.inspect(path))``): the path, then one line per :meth:`facts` row;
        ``ckptool inspect PATH`` prints the long form, :meth:`to_dict` is the whole."""
        return "\n".join([self.path, *(f"  {name + ':':<17} {value}" for name, value in self.facts())])

    def _repr_html_(self) -> str:
        """The summary and the module tree, for Jupyter (``ckptool.inspect(path)`` as a cell's last line)."""
        html: str = plugin("ckptool.model.notebook:facts_table")(self.path, self.facts())
        return html + str(plugin("ckptool.model.notebook:tree_html")(self.tree()))

