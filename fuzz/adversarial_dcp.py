"""Adversarial cases: DCP ``.metadata`` entries whose class is not what a reader deciding by attributes thinks,
``torch.export`` constants that ``torch.export.load`` unpickles by their name, and a torch zip whose ``byteorder``
record says ``big``.

* DCP (``torch.distributed.checkpoint``): ``DefaultLoadPlanner`` decides "non-tensor entry" by the class of the
  ``state_dict_metadata`` entry (``isinstance(md, BytesStorageMetadata)``, planner_helpers ``_create_read_items``)
  and reads such an entry's record with ``torch.load(weights_only=False)`` (default_planner ``load_bytes``). A
  ``BytesStorageMetadata`` that also carries ``size`` and ``properties``, or a ``TensorStorageMetadata`` turned into
  one by a BUILD whose slot state sets ``__class__``, is a non-tensor entry to torch. The payload record is a
  protocol-0 marker pickle (not a zip, and not starting with ``\\x80``): ``torch.load`` of it runs
  ``pickle.load`` on the bytes (``_legacy_load`` reads the magic number first).
* ``.pt2``: ``torch.export.load`` (torch/export/pt2_archive/_package.py ``_load_constants``) decides by the
  constant's ``path_name``: ``opaque_obj_*`` goes to ``pickle.loads`` whatever ``use_pickle`` and ``tensor_meta``
  say. The case is a real archive whose tensor constant's member is renamed ``opaque_obj_0`` and holds the payload.
* byte order: a torch zip whose ``byteorder`` record says ``big`` and whose storages are the big-endian bytes of
  the values: ``torch.load`` swaps them back (serialization.py ``_load``), a reader that ignores the record gives
  other values. No payload: the case checks values (``verdict`` safe), not code.

Each ``make`` imports torch (``tests/test_adversarial.py`` runs these cases where torch is installed).
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from adversarial import Case, marker_pickle  # noqa: E402

#: the loader of a DCP folder as ``dcp.load`` / ``dcp_to_torch_save`` run it: every entry, non-tensor ones through
#: ``DefaultLoadPlanner.load_bytes``
DCP_LOADER = (
    "from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner\n"
    "from torch.distributed.checkpoint.filesystem import FileSystemReader\n"
    "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict\n"
    "_load_state_dict({}, storage_reader=FileSystemReader(PATH), planner=_EmptyStateDictLoadPlanner(), "
    "no_dist=True)\n"
)
PT2_LOADER = "import torch\ntorch.export.load(PATH)\n"


# ------------------------------------------------------------------------------------------------ DCP
def _dcp_base(folder: Path) -> Path:
    """A DCP folder saved by torch: two tensors and the non-tensor entry ``step``."""
    import torch
    import torch.distributed.checkpoint as dcp

    out = folder / "ckpt"
    out.mkdir()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3), "step": 7},
                 checkpoint_id=str(out), no_dist=True)
    return out


def _payload_record(folder: Path, meta: object, fqn: str) -> None:
    """Append a protocol-0 marker pickle to the ``.distcp`` file of ``fqn``'s record and point the record at it."""
    sd = meta.storage_data  # type: ignore[attr-defined]
    idx = next(i for i in sd if i.fqn == fqn)
    info = sd[idx]
    path = folder / info.relative_path
    payload = marker_pickle(0)
    with open(path, "ab") as f:
        offset = f.seek(0, os.SEEK_END)
        f.write(payload)
    info.offset, info.length = offset, len(payload)


def _rewrite_metadata(folder: Path, meta: object, pickler: type[pickle.Pickler] = pickle.Pickler) -> None:
    buf = io.BytesIO()
    pickler(buf, protocol=2).dump(meta)
    (folder / ".metadata").write_bytes(buf.getvalue())


def _load_meta(folder: Path) -> object:
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # the folder torch just wrote


def make_dcp_bytes_with_size(folder: Path) -> Path:
    """``step`` stays a ``BytesStorageMetadata`` but also carries ``size`` and ``properties`` (a tensor's
    attributes); its record is the payload."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties

    out = _dcp_base(folder)
    meta = _load_meta(out)
    md = meta.state_dict_metadata["step"]  # type: ignore[attr-defined]
    md.size = torch.Size([1])
    md.properties = TensorProperties(dtype=torch.float32)
    md.chunks = []
    _payload_record(out, meta, "step")
    _rewrite_metadata(out, meta)
    return out


class _Switched:
    """Pickled (by :class:`_SwitchPickler`) as ``TensorStorageMetadata.__new__`` + BUILD ``(state, {"__class__":
    BytesStorageMetadata})``: the unpickled object is a ``BytesStorageMetadata`` (BUILD's slot state runs
    ``setattr``)."""

    def __init__(self, state: dict[str, object]) -> None:
        self.state = state


class _TwiceBuilt(_Switched):
    """As :class:`_Switched`, but the class switch is a first BUILD and a plain BUILD of a tensor's state follows it
    (a reader that keeps the last BUILD sees a tensor)."""


class _SwitchPickler(pickle._Pickler):  # type: ignore[name-defined,misc]  # the Python pickler: save_reduce
    def save(self, obj: object, save_persistent_id: bool = True) -> None:
        if isinstance(obj, _Switched):
            import copyreg

            from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

            switch = {"__class__": BytesStorageMetadata}
            if type(obj) is _TwiceBuilt:
                self.save_reduce(copyreg.__newobj__, (TensorStorageMetadata,), state=(None, switch))
                self.save(obj.state)
                self.write(pickle.BUILD)
            else:
                self.save_reduce(copyreg.__newobj__, (TensorStorageMetadata,), state=(obj.state, switch))
            return
        super().save(obj, save_persistent_id)


def _switch(folder: Path, kind: type[_Switched]) -> Path:
    out = _dcp_base(folder)
    meta = _load_meta(out)
    sdm = meta.state_dict_metadata  # type: ignore[attr-defined]
    w = sdm["w"]
    sdm["step"] = kind({"properties": w.properties, "size": w.size, "chunks": w.chunks})
    _payload_record(out, meta, "step")
    _rewrite_metadata(out, meta, _SwitchPickler)
    return out


def make_dcp_class_switch(folder: Path) -> Path:
    """``step`` is pickled as a ``TensorStorageMetadata`` whose BUILD slot state sets ``__class__`` to
    ``BytesStorageMetadata``."""
    return _switch(folder, _Switched)


def make_dcp_class_switch_twice_built(folder: Path) -> Path:
    """As :func:`make_dcp_class_switch`, the class switch in a first BUILD, a tensor's state in a second."""
    return _switch(folder, _TwiceBuilt)


def make_dcp_unknown_entry_class(folder: Path) -> Path:
    """``step``'s entry is a ``ChunkStorageMetadata`` (a DCP class, neither tensor nor bytes metadata)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    out = _dcp_base(folder)
    meta = _load_meta(out)
    meta.state_dict_metadata["step"] = ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))  # type: ignore[attr-defined]
    _payload_record(out, meta, "step")
    _rewrite_metadata(out, meta)
    return out


# ------------------------------------------------------------------------------------------------ .pt2
def make_pt2_opaque_obj(folder: Path) -> Path:
    """A real ``torch.export`` archive whose tensor constant's member is renamed ``data/constants/opaque_obj_0``
    (config kept: ``use_pickle`` false, a ``tensor_meta``) and holds the payload pickle."""
    import json

    import torch

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    src = folder / "base.pt2"
    torch.export.save(torch.export.export(M(), (torch.ones(1, 2),)), str(src))
    out = folder / "model.pt2"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        names = zin.namelist()
        top = names[0].split("/", 1)[0] + "/"
        cfg_name = top + "data/constants/model_constants_config.json"
        cfg = json.loads(zin.read(cfg_name))
        renames = {}
        for meta in cfg["config"].values():
            if meta["path_name"].startswith("tensor_"):
                renames[top + "data/constants/" + meta["path_name"]] = top + "data/constants/opaque_obj_0"
                meta["path_name"] = "opaque_obj_0"
                break
        for n in names:
            if n == cfg_name:
                zout.writestr(n, json.dumps(cfg))
            elif n in renames:
                zout.writestr(renames[n], marker_pickle(0))
            else:
                zout.writestr(n, zin.read(n))
    src.unlink()
    return out


def make_pt2_pickled_constant_bad_crc(folder: Path) -> Path:
    """The constant of :func:`make_pt2_opaque_obj` renamed ``tensor_9`` with ``use_pickle`` true (so
    ``torch.load(weights_only=False)`` reads it) and its config's CRC-32 broken (torch's reader ignores it)."""
    import json

    import hostile_corpus as hc

    src = make_pt2_opaque_obj(folder)
    tmp = folder / "tmp.pt2"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w") as zout:
        for n in zin.namelist():
            data = zin.read(n)
            if n.endswith("model_constants_config.json"):
                cfg = json.loads(data)
                meta = next(m for m in cfg["config"].values() if m["path_name"] == "opaque_obj_0")
                meta["path_name"], meta["use_pickle"] = "tensor_9", True
                data = json.dumps(cfg).encode()
            zout.writestr(n.replace("opaque_obj_0", "tensor_9"), data)
    src.write_bytes(hc._patch_zip(tmp.read_bytes(), b"model_constants_config.json", crc=0))
    tmp.unlink()
    return src


# ------------------------------------------------------------------------------------------------ byte order
def big_endian_torch_file(path: Path, tensors: dict[str, object]) -> Path:
    """``torch.save`` of ``tensors`` rewritten as a big-endian machine writes it: the ``byteorder`` record says
    ``big`` and each storage holds the big-endian bytes of its elements (complex: of each half), as
    ``torch.load`` reads them (it swaps storages whose file order is not the machine's)."""
    import torch

    buf = io.BytesIO()
    torch.save(tensors, buf)
    sizes: dict[str, int] = {}
    # the storage key -> element size: torch.save numbers storages in first-use order, as the dict iterates
    seen: dict[int, int] = {}
    for t in tensors.values():
        assert isinstance(t, torch.Tensor)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            es = t.element_size() // (2 if t.is_complex() else 1)
            seen[ptr] = es
            sizes[str(len(seen) - 1)] = es
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin:
        names = zin.namelist()
        top = names[0].split("/", 1)[0] + "/"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
            for n in names:
                data = zin.read(n)
                rel = n[len(top):]
                if rel == "byteorder":
                    data = b"big"
                elif rel.startswith("data/") and rel[5:] in sizes and sizes[rel[5:]] > 1:
                    es = sizes[rel[5:]]
                    data = b"".join(data[i:i + es][::-1] for i in range(0, len(data), es))
                zout.writestr(n, data)
    return path


def to_big_endian(src: Path, dst: Path) -> Path:
    """The little-endian torch zip ``src`` (any object, a pickled module too) as a big-endian machine would have
    written it, into ``dst``: ``byteorder`` = ``big`` and each storage's elements byte-swapped by its storage
    class's element size (complex: each half; ``UntypedStorage`` not at all), the rule ``torch.load`` undoes."""
    from ckptool.formats.dtypes import storage_element
    from ckptool.formats.torchfile import read_checkpoint

    ck = read_checkpoint(str(src))
    sizes = {}
    for key, ref in ck.storages.items():
        dtype, es = storage_element(ref)
        sizes[key] = es // 2 if dtype.startswith("complex") else es
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for n in zin.namelist():
            data = zin.read(n)
            rel = n.split("/", 1)[1] if "/" in n else n
            if rel == "byteorder":
                data = b"big"
            elif rel.startswith("data/") and sizes.get(rel[5:], 1) > 1:
                es = sizes[rel[5:]]
                data = b"".join(data[i:i + es][::-1] for i in range(0, len(data), es))
            zout.writestr(n, data)
    return dst


def make_big_endian(folder: Path) -> Path:
    """A torch zip with ``byteorder`` = ``big`` holding float32, float16, int64 and complex64 tensors."""
    import torch

    return big_endian_torch_file(folder / "big.pt", {
        "w": torch.linspace(-2, 3, 12).reshape(3, 4),
        "h": torch.tensor([1.5, -0.25, 1000.0], dtype=torch.float16),
        "i": torch.tensor([1, -2, 1 << 40]),
        "c": torch.tensor([1 + 2j, -3.5 + 0.5j], dtype=torch.complex64),
        "u": torch.tensor([1, 2, 255], dtype=torch.uint8),
    })


CASES: list[Case] = [
    Case("dcp-bytes-entry-with-size", "dcp bytes entry with a size", make_dcp_bytes_with_size, "dangerous",
         loader=DCP_LOADER),
    Case("dcp-class-switch", "dcp entry class switched by BUILD", make_dcp_class_switch, "dangerous",
         loader=DCP_LOADER),
    Case("dcp-class-switch-twice-built", "dcp entry class switched by BUILD", make_dcp_class_switch_twice_built,
         "dangerous", loader=DCP_LOADER),
    Case("dcp-unknown-entry-class", "dcp entry of another class", make_dcp_unknown_entry_class, "dangerous"),
    Case("pt2-opaque-obj-constant", "pt2 opaque_obj member", make_pt2_opaque_obj, "dangerous", loader=PT2_LOADER),
    Case("pt2-pickled-constant-config-bad-crc", "pt2 config with a bad CRC-32", make_pt2_pickled_constant_bad_crc,
         "dangerous", loader=PT2_LOADER),
    Case("byteorder-big", "byteorder big", make_big_endian, "safe",
         reason="no payload: values must equal torch.load's (the storages are big-endian)"),
]
