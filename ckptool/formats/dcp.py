"""``torch.distributed.checkpoint`` (DCP) folders, read without torch and without running their pickles.

A DCP folder holds ``.metadata`` (a pickled ``torch.distributed.checkpoint.metadata.Metadata``: per fully
qualified name a ``TensorStorageMetadata`` with dtype and size, or a ``BytesStorageMetadata`` for a non-tensor
entry; ``storage_data`` maps each entry's ``MetadataIndex`` to a ``_StorageInfo`` naming the ``__<rank>_<n>.distcp``
file, offset and length of its bytes) plus the ``.distcp`` data files (torch/distributed/checkpoint/metadata.py,
filesystem.py). Non-tensor entries are stored as ``torch.save`` records. Everything here is read with ckptool's
restricted unpickler; torch's own reader (``FileSystemReader``) unpickles them without restriction.

An entry is a tensor or a non-tensor entry by its class, as DCP decides (``isinstance(md, BytesStorageMetadata)``
in planner_helpers ``_create_read_items``, ``isinstance(v, TensorStorageMetadata)`` in default_planner), never by
its attributes: :func:`entry_kind`. The class is only what the pickle's last BUILD shows; a pickle can BUILD an
object twice (the first BUILD's slot state setting ``__class__``), so callers that guard a loader
(:mod:`ckptool.scanning.dcp_safety`, :mod:`ckptool.scanning.dcp`) check every record with the same rules whatever its
entry's class.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ckptool import _source as source
from ckptool.errors import CorruptCheckpointError, UsageError
from ckptool.formats.nodes import GlobalMeta, ObjectNode, PickledObject, ReduceNode, qualified_name
from ckptool.formats.strided import shape_problem
from ckptool.formats.unpickler import load_structure

METADATA_FILE = ".metadata"
_MD = "torch.distributed.checkpoint.metadata."
#: the class of a tensor entry of ``state_dict_metadata``
TENSOR_METADATA = _MD + "TensorStorageMetadata"
#: the class of a non-tensor entry (``BYTE_IO``: read with ``torch.load(weights_only=False)``)
BYTES_METADATA = _MD + "BytesStorageMetadata"
#: the globals a ``.metadata`` pickle names are listed with the allowlist (``ckptool.model.allowlist.DCP_GLOBALS``)


@dataclass(frozen=True)
class DcpLayout:
    """What a folder format built on DCP adds to its ``.metadata`` and ``.distcp`` files (the registry's ``dcp``
    plug-in, :attr:`ckptool.readers.Format.dcp`): ``companions``, the files beside them that a rewrite of the
    folder copies byte for byte (Megatron-Core's ``metadata.json`` and ``common.pt``); ``globals``, the globals
    its ``.metadata`` may name besides DCP's own (Megatron-Core's cached save plans, ``all_local_plans``)."""

    companions: tuple[str, ...] = ()
    globals: frozenset[str] = frozenset()


def plain_layout() -> DcpLayout:
    """A plain DCP folder's :class:`DcpLayout`: nothing beside ``.metadata`` and the data files."""
    return DcpLayout()


class DcpEntry(NamedTuple):
    """An entry of ``state_dict_metadata``: its FQN, and for a tensor its dtype name (``"unknown"`` when the pickle
    does not say) and shape; both None for a non-tensor entry."""

    fqn: str
    dtype: str | None
    shape: tuple[int, ...] | None


class DcpItem(NamedTuple):
    """One record of ``.metadata``'s ``storage_data`` (a ``_StorageInfo``): the entry's ``fqn``; ``is_bytes`` for
    a non-tensor entry (``BYTE_IO``: ``torch.save`` bytes that the default load planner reads with
    ``torch.load(weights_only=False)``), else a tensor chunk (``torch.save`` of the tensor, read with
    ``weights_only=True``, or raw bytes in a safetensors-serialized folder); ``length`` bytes at ``offset`` of
    ``relative_path`` (None when the record is malformed); ``transforms`` its ``transform_descriptors``. An entry
    whose class is neither (:attr:`DcpMetadata.problems`) counts as a non-tensor entry."""

    fqn: str
    is_bytes: bool
    relative_path: str | None
    offset: int
    length: int
    transforms: tuple[str, ...]


@dataclass
class DcpMetadata:
    """A parsed ``.metadata``: the ``root`` node, the qualified names of the ``globals`` it names (pickle order,
    repeats kept), its ``entries``, ``planner_data`` (FQN -> path components, when the planner recorded them), the
    DCP ``version`` string and ``problems``: the entries :func:`entry_kind` refused (only when read with
    ``strict=False``; such an entry is left out of ``entries``)."""

    folder: str
    root: ObjectNode
    globals: list[str]
    entries: list[DcpEntry]
    planner_data: dict[Any, Any] | None
    version: str | None
    problems: list[str] = field(default_factory=list)
    #: the FQNs of the entries left out of ``entries`` (``problems``)
    unclassified: set[str] = field(default_factory=set)

    def items(self) -> list[DcpItem]:
        """Every storage record of ``storage_data`` (tensor chunks and non-tensor entries), in pickle order, as
        recorded: nothing is checked here (a hostile ``.metadata`` may point anywhere; see
        :func:`ckptool.scanning.dcp.scan_dcp_folder`). Records whose fields are not of the recorded types are
        returned with ``relative_path`` None.

        Raises:
            CorruptCheckpointError: ``storage_data`` is not a dict.
        """
        byte_fqns = {e.fqn for e in self.entries if e.dtype is None} | self.unclassified
        storage_data = _state(self.root).get("storage_data")
        if type(storage_data) is not dict:
            raise CorruptCheckpointError(f"{self.folder}: .metadata has no storage_data dict; the folder is damaged")
        out = []
        for idx, info in storage_data.items():
            ist, sst = _state(idx), _state(info)
            ist = ist if type(ist) is dict else {}
            sst = sst if type(sst) is dict else {}
            fqn = ist.get("fqn")
            fqn = fqn if type(fqn) is str else repr(fqn)
            rel, off, n = sst.get("relative_path"), sst.get("offset"), sst.get("length")
            desc = sst.get("transform_descriptors")
            transforms = tuple(map(str, desc)) if isinstance(desc, (list, tuple)) else () if desc is None else (
                repr(desc),)
            if type(rel) is str and type(off) is int and type(n) is int:
                out.append(DcpItem(fqn, fqn in byte_fqns, rel, off, n, transforms))
            else:
                out.append(DcpItem(fqn, fqn in byte_fqns, None, 0, 0, transforms))
        return out


def _state(node: Any) -> Any:
    return node.state if isinstance(node, PickledObject) else None


def is_dcp_folder(path: str) -> bool:
    """True when ``path`` is a folder holding a DCP ``.metadata`` file (or a FIFO or device of that name, which
    reading it then refuses: :func:`read_dcp_metadata`)."""
    p = os.path.join(path, METADATA_FILE)
    return os.path.exists(p) and not os.path.isdir(p)


def read_dcp_metadata(folder: str | os.PathLike[str], *, strict: bool = True) -> DcpMetadata:
    """Read the ``.metadata`` pickle of a DCP folder with ckptool's restricted unpickler (nothing imported or run).

    With ``strict=False`` (``scan``) an entry :func:`entry_kind` refuses is listed in ``problems`` instead of
    raising, and its records are treated as a non-tensor entry's.

    Raises:
        UsageError: no ``.metadata`` in ``folder``.
        CorruptCheckpointError: the pickle is damaged, or is not a DCP ``Metadata`` (with ``strict``: an entry of
            another class or a malformed entry).
    """
    folder = os.fspath(folder)
    p = os.path.join(folder, METADATA_FILE)
    source.refuse_special(p, "the DCP .metadata")
    if not os.path.isfile(p):
        raise UsageError(f"{folder} has no .metadata: not a torch.distributed.checkpoint folder")
    with source.open_regular(p, "the DCP .metadata") as f:
        data = f.read()
    root, up = load_structure(data, f".metadata of {folder}")
    st = _state(root)
    if not (isinstance(root, ObjectNode) and root.global_name.endswith("checkpoint.metadata.Metadata")
            and type(st) is dict and isinstance(st.get("state_dict_metadata"), dict)):
        raise CorruptCheckpointError(f"{p} is not a torch.distributed.checkpoint Metadata pickle; the folder is "
                                     "damaged or not a DCP checkpoint")
    planner = st.get("planner_data")
    version = st.get("version")
    meta = DcpMetadata(folder, root, [qualified_name(m, n) for m, n in up.globals_seen], [],
                       planner if isinstance(planner, dict) else None, version if isinstance(version, str) else None)
    for fqn, md in st["state_dict_metadata"].items():
        try:
            try:
                meta.entries.append(_entry(str(fqn), md))
            except CorruptCheckpointError:  # _entry's own, a ValueError too: already worded
                raise
            except (TypeError, ValueError, AttributeError) as e:  # a size or dtype of the wrong type
                raise CorruptCheckpointError(f"entry {str(fqn)!r} is malformed ({e}); the folder is damaged or "
                                             "not written by torch.distributed.checkpoint") from None
        except CorruptCheckpointError as e:
            if strict:
                raise CorruptCheckpointError(f"{p}: {e}") from None
            meta.problems.append(f".metadata: {e}")
            meta.unclassified.add(str(fqn))
    return meta


def entry_class(md: Any) -> str | None:
    """The qualified name of the class an unpickled ``state_dict_metadata`` entry ``md`` has, as far as the pickle
    shows it: ``cls.__new__(cls)`` (NEWOBJ, what DCP's protocol-2 pickle writes) or
    ``copyreg._reconstructor(cls, object, None)`` (protocols 0 and 1); None for anything else (a call of another
    function, a plain value)."""
    if isinstance(md, ObjectNode):
        return md.global_name
    if isinstance(md, ReduceNode) and md.global_name == "copyreg._reconstructor" and len(md.args) == 3:
        cls, base, state = md.args
        if isinstance(cls, GlobalMeta) and isinstance(base, GlobalMeta) and base.qualified_name in (
                "builtins.object", "__builtin__.object") and state is None:
            return cls.qualified_name
    return None


def entry_kind(fqn: str, md: Any) -> str:
    """``"tensor"`` or ``"bytes"``: how DCP's load planner reads the ``state_dict_metadata`` entry ``md`` of
    ``fqn``, by its class (:data:`TENSOR_METADATA`, :data:`BYTES_METADATA`) as DCP decides, whatever attributes it
    carries (a ``BytesStorageMetadata`` with a ``size`` is a non-tensor entry).

    Raises:
        CorruptCheckpointError: another class (torch's planner refuses it, or ckptool cannot tell how it is read);
            operations DCP never pickles on it (state that is not a plain attribute dict, which may set
            ``__class__`` through BUILD's slot state; items set on it); a tensor entry without ``size`` or
            ``properties``.
    """
    cls = entry_class(md)
    if cls not in (TENSOR_METADATA, BYTES_METADATA):
        if cls:
            what = f"an object of class {cls}"
        elif isinstance(md, ReduceNode):
            what = f"a call of {md.global_name or 'an object'}"
        else:
            what = f"a {type(md).__name__}"
        raise CorruptCheckpointError(f"entry {fqn!r} is {what}, neither TensorStorageMetadata nor "
                                     "BytesStorageMetadata; the .metadata is damaged or was crafted")
    st = md.state
    extra = [op for op in md.order if op != "build"]
    if extra or not (st is None or type(st) is dict) or (type(st) is dict and "__class__" in st):
        raise CorruptCheckpointError(
            f"entry {fqn!r} ({cls.rsplit('.', 1)[1]}) is built in a way DCP never pickles "
            f"({', '.join(extra) or 'state ' + type(st).__name__}): it may change its own class; the .metadata "
            "is damaged or was crafted")
    if cls == TENSOR_METADATA and (st is None or "size" not in st or "properties" not in st):
        raise CorruptCheckpointError(f"tensor entry {fqn!r} has no size or properties; the .metadata is damaged")
    return "tensor" if cls == TENSOR_METADATA else "bytes"


def _entry(fqn: str, md: Any) -> DcpEntry:
    if entry_kind(fqn, md) == "bytes":
        return DcpEntry(fqn, None, None)
    st = md.state
    props = _state(st.get("properties"))
    if isinstance(props, tuple) and props:
        dt = props[0]
    else:
        dt = props.get("dtype") if type(props) is dict else None
    size = st["size"]
    shape = size.args[0] if isinstance(size, ReduceNode) and size.args else size or ()
    problem = shape_problem(shape)
    if problem is not None:
        raise CorruptCheckpointError(f"DCP entry {fqn!r} declares an impossible tensor: {problem}; the "
                                     ".metadata is damaged or was crafted")
    try:
        shape = tuple(shape)
    except TypeError as e:
        raise CorruptCheckpointError(f"DCP entry {fqn!r} has a malformed size ({e}); the .metadata is damaged "
                                     "or was not written by torch.distributed.checkpoint") from None
    return DcpEntry(fqn, dt.name if isinstance(dt, GlobalMeta) else "unknown", shape)
