"""``torch.distributed.checkpoint`` (DCP) folders, read without torch and without running their pickles.

A DCP folder holds ``.metadata`` (a pickled ``torch.distributed.checkpoint.metadata.Metadata``: per fully
qualified name a ``TensorStorageMetadata`` with dtype and size, or a ``BytesStorageMetadata`` for a non-tensor
entry; ``storage_data`` maps each entry's ``MetadataIndex`` to a ``_StorageInfo`` naming the ``__<rank>_<n>.distcp``
file, offset and length of its bytes) plus the ``.distcp`` data files (torch/distributed/checkpoint/metadata.py,
filesystem.py). Non-tensor entries are stored as ``torch.save`` records. Everything here is read with ckptool's
restricted unpickler; torch's own reader (``FileSystemReader``) unpickles them without restriction.
"""

from __future__ import annotations

import io
import os
import zipfile
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptool.errors import CorruptCheckpointError, UsageError
from ckptool.formats.nodes import GlobalMeta, ObjectNode, PickledObject, ReduceNode, qualified_name
from ckptool.formats.strided import shape_problem
from ckptool.formats.unpickler import load_structure

METADATA_FILE = ".metadata"

#: globals a DCP ``.metadata`` pickle names (torch/distributed/checkpoint/metadata.py, filesystem.py)
DCP_GLOBALS = frozenset({
    *(f"torch.distributed.checkpoint.metadata.{n}" for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    # StorageMeta.checkpoint_id: the folder as a path object (Python 3.13 pickles name pathlib._local)
    *(f"pathlib.{sub}{n}" for sub in ("", "_local.") for n in (
        "Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
})


class DcpEntry(NamedTuple):
    """An entry of ``state_dict_metadata``: its FQN, and for a tensor its dtype name (``"unknown"`` when the pickle
    does not say) and shape; both None for a non-tensor entry."""

    fqn: str
    dtype: str | None
    shape: tuple[int, ...] | None


@dataclass
class ByteRecord:
    """Where a non-tensor entry's ``torch.save`` bytes lie: ``length`` bytes at ``offset`` of ``relative_path`` in
    the folder; ``transformed`` when DCP applied a transform (compression...) that ckptool cannot undo."""

    fqn: str
    relative_path: str
    offset: int
    length: int
    transformed: bool


class DcpItem(NamedTuple):
    """One record of ``.metadata``'s ``storage_data`` (a ``_StorageInfo``): the entry's ``fqn``; ``is_bytes`` for
    a non-tensor entry (``BYTE_IO``: ``torch.save`` bytes that the default load planner reads with
    ``torch.load(weights_only=False)``), else a tensor chunk (``torch.save`` of the tensor, read with
    ``weights_only=True``, or raw bytes in a safetensors-serialized folder); ``length`` bytes at ``offset`` of
    ``relative_path`` (None when the record is malformed); ``transforms`` its ``transform_descriptors``."""

    fqn: str
    is_bytes: bool
    relative_path: str | None
    offset: int
    length: int
    transforms: tuple[str, ...]


@dataclass
class DcpMetadata:
    """A parsed ``.metadata``: the ``root`` node, the qualified names of the ``globals`` it names (pickle order,
    repeats kept), its ``entries``, ``planner_data`` (FQN -> path components, when the planner recorded them) and the
    DCP ``version`` string."""

    folder: str
    root: ObjectNode
    globals: list[str]
    entries: list[DcpEntry]
    planner_data: dict[Any, Any] | None
    version: str | None

    def byte_records(self) -> list[ByteRecord]:
        """The storage records of the non-tensor entries.

        Raises:
            CorruptCheckpointError: a record points outside the folder or at a missing file.
        """
        byte_fqns = {e.fqn for e in self.entries if e.dtype is None}
        out = []
        for idx, info in (_state(self.root).get("storage_data") or {}).items():
            ist, sst = _state(idx), _state(info)
            if type(ist) is not dict or ist.get("fqn") not in byte_fqns or type(sst) is not dict:
                continue
            fqn = str(ist["fqn"])
            rel = str(sst.get("relative_path", ""))
            transformed = bool(sst.get("transform_descriptors"))
            if not transformed and (os.path.isabs(rel) or os.path.normpath(rel).startswith("..")
                                    or not os.path.isfile(os.path.join(self.folder, rel))):
                raise CorruptCheckpointError(f"{self.folder}: entry {fqn!r} points at a missing file {rel!r}")
            out.append(ByteRecord(fqn, rel, int(sst.get("offset", 0)), int(sst.get("length", 0)), transformed))
        return out

    def items(self) -> list[DcpItem]:
        """Every storage record of ``storage_data`` (tensor chunks and non-tensor entries), in pickle order, as
        recorded: nothing is checked here (a hostile ``.metadata`` may point anywhere; see
        :func:`ckptool.ops.scan_dcp.scan_dcp_folder`). Records whose fields are not of the recorded types are
        returned with ``relative_path`` None.

        Raises:
            CorruptCheckpointError: ``storage_data`` is not a dict.
        """
        byte_fqns = {e.fqn for e in self.entries if e.dtype is None}
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

    def record_globals(self, record: ByteRecord) -> list[str]:
        """The globals the ``torch.save`` record of a non-tensor entry names, read with the restricted unpickler.

        Raises:
            CorruptCheckpointError: the bytes are not a ``torch.save`` zip record, or its pickle is damaged.
        """
        with open(os.path.join(self.folder, record.relative_path), "rb") as f:
            f.seek(record.offset)
            blob = f.read(record.length)
        what = f"entry {record.fqn!r} of {self.folder}"
        try:
            with zipfile.ZipFile(io.BytesIO(blob)) as z:
                pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
                _obj, up = load_structure(z.read(pkl), what)
        except (zipfile.BadZipFile, StopIteration) as e:
            raise CorruptCheckpointError(f"{self.folder}: entry {record.fqn!r} is not a torch.save record; the "
                                         "folder is damaged") from e
        return [qualified_name(m, n) for m, n in up.globals_seen]


def _state(node: Any) -> Any:
    return node.state if isinstance(node, PickledObject) else None


def is_dcp_folder(path: str) -> bool:
    """True when ``path`` is a folder holding a DCP ``.metadata`` file."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_dcp_metadata(folder: str | os.PathLike[str]) -> DcpMetadata:
    """Read the ``.metadata`` pickle of a DCP folder with ckptool's restricted unpickler (nothing imported or run).

    Raises:
        UsageError: no ``.metadata`` in ``folder``.
        CorruptCheckpointError: the pickle is damaged, or is not a DCP ``Metadata`` (malformed entries included).
    """
    folder = os.fspath(folder)
    p = os.path.join(folder, METADATA_FILE)
    if not os.path.isfile(p):
        raise UsageError(f"{folder} has no .metadata: not a torch.distributed.checkpoint folder")
    with open(p, "rb") as f:
        data = f.read()
    root, up = load_structure(data, f".metadata of {folder}")
    st = _state(root)
    if not (isinstance(root, ObjectNode) and root.global_name.endswith("checkpoint.metadata.Metadata")
            and type(st) is dict and isinstance(st.get("state_dict_metadata"), dict)):
        raise CorruptCheckpointError(f"{p} is not a torch.distributed.checkpoint Metadata pickle; the folder is "
                                     "damaged or not a DCP checkpoint")
    planner = st.get("planner_data")
    version = st.get("version")
    try:
        entries = _entries(st)
    except (TypeError, ValueError, AttributeError) as e:  # a size or dtype of the wrong type: not DCP's own writing
        raise CorruptCheckpointError(f"{p}: a state_dict_metadata entry is malformed ({e}); the folder is damaged "
                                     "or not written by torch.distributed.checkpoint") from e
    return DcpMetadata(folder, root, [qualified_name(m, n) for m, n in up.globals_seen], entries,
                       planner if isinstance(planner, dict) else None, version if isinstance(version, str) else None)


def _entries(state: dict[str, Any]) -> list[DcpEntry]:
    out = []
    for fqn, md in state["state_dict_metadata"].items():
        st = _state(md)
        if type(st) is dict and "size" in st:
            props = _state(st.get("properties"))
            if isinstance(props, tuple) and props:
                dt = props[0]
            else:
                dt = props.get("dtype") if type(props) is dict else None
            size = st["size"]
            shape = size.args[0] if isinstance(size, ReduceNode) and size.args else size or ()
            problem = shape_problem(shape)
            if problem is not None:
                raise CorruptCheckpointError(f"DCP entry {str(fqn)!r} declares an impossible tensor: {problem}; the "
                                             ".metadata is damaged or was crafted")
            shape = tuple(shape)
            out.append(DcpEntry(str(fqn), dt.name if isinstance(dt, GlobalMeta) else "unknown", shape))
        else:
            out.append(DcpEntry(str(fqn), None, None))
    return out
