"""Read a ``torch.export`` archive (``torch.export.save``, ``.pt2``) without torch and without running anything.

What torch 2.13 writes (``torch/export/pt2_archive/_package.py`` ``package_pt2``, names from
``torch/csrc/export/pt2_archive_constants.h``), all members stored uncompressed under one top folder (the file's
stem at save time, like ``torch.save``):

* ``archive_format`` = ``pt2``; ``archive_version`` = ``0`` (``ARCHIVE_VERSION_VALUE``; ``torch.export.load``
  refuses any other value, and an archive without the record counts as version 0); ``byteorder`` (``little``);
  ``.data/version`` and ``.data/serialization_id`` as in ``torch.save`` files.
* ``models/<name>.json``: the serialized ``ExportedProgram`` (``torch/_export/serde/schema.py``, ``schema_version``
  ``{"major": 8, "minor": ...}`` in torch 2.13): ``graph_module.signature`` holds the ``input_specs``
  (``parameter``, ``buffer`` with ``persistent``, ``tensor_constant``, ``custom_obj``, ``token``, ``user_input``,
  ``constant_input``) and ``output_specs``; ``graph_module.graph.tensor_values`` the dtype and shape of each tensor
  argument. ``torch.export.save`` writes one program named ``model``.
* ``data/weights/<name>_weights_config.json`` and ``data/constants/<name>_constants_config.json``: a
  ``PayloadConfig`` ``{"config": {FQN: PayloadMeta}}``, each ``PayloadMeta`` = ``path_name`` (the member under
  ``data/weights/`` or ``data/constants/``), ``is_param``, ``use_pickle`` and ``tensor_meta`` (``dtype`` as the
  schema's ``ScalarType`` number, ``sizes`` / ``strides`` / ``storage_offset`` as ``{"as_int": n}``, ``device``
  ``{"type", "index"}``, ``requires_grad``, ``layout``). The weights are the program's ``state_dict``
  (parameters and persistent buffers); the constants are its lifted tensor constants and non-persistent buffers.
* ``data/weights/weight_<i>`` / ``data/constants/tensor_<i>`` with ``use_pickle`` false: the **raw bytes of a whole
  untyped storage** (tensors sharing a storage share one member, each tensor a view of it by ``storage_offset``
  and ``strides``, in elements); ``torch.export.load`` rebuilds them with ``torch.as_strided``, so ckptool reads
  them as storages. A member of 0 bytes is an empty (or fake) tensor.
* Members that ``torch.export.load`` unpickles: payloads with ``use_pickle`` true (tensor subclasses, written with
  ``torch.save`` and loaded with ``torch.load(weights_only=False)``), ``data/constants/custom_obj_<i>``
  (TorchScript objects, ``torch._C._pickle_save``), ``data/constants/opaque_obj_<i>`` (``pickle.dumps``),
  ``data/sample_inputs/<name>.pt`` (``torch.save`` of the example inputs) and the legacy
  ``data/weights/<name>.pt`` / ``data/constants/<name>.pt`` of older torch versions. ckptool reads none of them
  here: :func:`pickle_members` names them for ``ckptool scan``. A constant's role comes from its ``path_name``
  prefix, not from its config (``_load_constants``): ``tensor_`` is raw bytes or, with ``use_pickle``, a
  ``torch.load``; ``custom_obj_`` goes to ``torch._C._pickle_load_obj`` and ``opaque_obj_`` to ``pickle.loads``
  whatever ``use_pickle`` and ``tensor_meta`` say; any other prefix is refused by torch
  (:func:`constant_role`). A weight's role comes from ``use_pickle`` alone (``_load_state_dict``).
* ``data/aotinductor/...``: AOTInductor packages (compiled shared libraries): listed, never loaded.

Read: ``archive_format`` ``pt2``, ``archive_version`` 0 (or absent), serialized-program schema major version 8
(:data:`ARCHIVE_VERSIONS`, :data:`SCHEMA_MAJOR`); anything newer is refused with :class:`UnsupportedError`, as is the
legacy layout whose weights are one pickled ``<name>.pt`` (re-export it with a current torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ckptool.errors import CkptError, CorruptCheckpointError, NotACheckpointError, UnsupportedError
from ckptool.formats.dtypes import DTYPE_SIZES, numel
from ckptool.formats.zipdir import ZipEntry, duplicate_member, read_member

#: the ``archive_version`` values ckptool reads (torch 2.13's ``ARCHIVE_VERSION_VALUE``)
ARCHIVE_VERSIONS = ("0",)
#: the serialized program's ``schema_version["major"]`` ckptool reads (torch 2.13: 8)
SCHEMA_MAJOR = 8
#: the most bytes of JSON (a program, a payload config) read from one member
MAX_JSON = 1 << 30

#: ``ScalarType`` number of ``torch/_export/serde/schema.py`` -> torch dtype name (``serialize.py``
#: ``_TORCH_TO_SERIALIZE_DTYPE``)
SCALAR_TYPES: dict[int, str] = {
    1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float16", 7: "float32", 8: "float64",
    9: "complex32", 10: "complex64", 11: "complex128", 12: "bool", 13: "bfloat16", 28: "uint16",
    29: "float8_e4m3fn", 30: "float8_e5m2", 31: "float8_e4m3fnuz", 32: "float8_e5m2fnuz", 33: "float8_e8m0fnu",
    34: "uint32", 35: "uint64",
}
#: ``Layout`` number of the schema -> torch layout name
LAYOUTS: dict[int, str] = {0: "unknown", 1: "sparse_coo", 2: "sparse_csr", 3: "sparse_csc", 4: "sparse_bsr",
                           5: "sparse_bsc", 6: "_mkldnn", 7: "strided"}

WEIGHTS_DIR = "data/weights/"
CONSTANTS_DIR = "data/constants/"
MODELS_DIR = "models/"
SAMPLE_INPUTS_DIR = "data/sample_inputs/"
#: the ``path_name`` prefixes of constants (torch/csrc/export/pt2_archive_constants.h)
TENSOR_CONSTANT_PREFIX = "tensor_"
CUSTOM_OBJ_PREFIX = "custom_obj_"
OPAQUE_OBJ_PREFIX = "opaque_obj_"
#: the members ``torch.export.load`` unpickles by name alone (``custom_obj_*``, ``opaque_obj_*`` constants)
OBJECT_MEMBER_PREFIXES = (CONSTANTS_DIR + CUSTOM_OBJ_PREFIX, CONSTANTS_DIR + OPAQUE_OBJ_PREFIX)
AOTINDUCTOR_DIR = "data/aotinductor/"


@dataclass
class Payload:
    """One weight or constant of a program: its ``fqn``; ``kind`` ``parameter`` / ``buffer`` (the weights, the
    program's state_dict) or ``constant`` (tensor constants and non-persistent buffers) or ``object`` (a pickled
    script or opaque object); ``member`` its zip member (relative to the top folder); ``dtype``, ``shape``,
    ``stride``, ``storage_offset`` (elements) and ``device`` (``cpu``, ``cuda:0``) from its ``tensor_meta``
    (``dtype`` None for objects); ``pickled`` when ``torch.export.load`` unpickles the member; ``layout``
    (``strided``...); ``record_size`` the member's size in bytes."""

    fqn: str
    kind: str
    member: str
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    storage_offset: int = 0
    device: str = "cpu"
    requires_grad: bool = False
    pickled: bool = False
    layout: str = "strided"
    record_size: int = 0

    @property
    def nbytes(self) -> int:
        """numel * element size (0 for objects)."""
        return numel(self.shape) * DTYPE_SIZES.get(self.dtype or "", 0) if self.dtype else 0


@dataclass
class SignatureEntry:
    """One input or output of the exported program's signature: ``kind`` as the schema names it
    (``user_input``, ``parameter``, ``buffer``, ``tensor_constant``, ``custom_obj``, ``token``, ``constant_input``,
    ``user_output``, ``buffer_mutation``, ``loss_output``...), ``name`` of the graph argument, ``target`` the FQN it
    binds (parameters, buffers, constants, mutations), ``persistent`` for buffers, and for tensor arguments
    ``dtype`` / ``shape`` (a dimension that is symbolic is shown by its expression)."""

    kind: str
    name: str
    target: str | None = None
    persistent: bool | None = None
    dtype: str | None = None
    shape: list[int | str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Program:
    """One exported program of the archive (``models/<name>.json``): its ``weights`` (the state_dict: parameters
    and persistent buffers) and ``constants`` in the order of their configs, its signature ``inputs`` and
    ``outputs``, the ``schema_version`` (``"8.20"``) and the ``torch_version`` that wrote it."""

    name: str
    weights: list[Payload] = field(default_factory=list)
    constants: list[Payload] = field(default_factory=list)
    inputs: list[SignatureEntry] = field(default_factory=list)
    outputs: list[SignatureEntry] = field(default_factory=list)
    schema_version: str = ""
    torch_version: str | None = None

    def signature(self) -> dict[str, Any]:
        """The program as ``ckptool inspect --json`` reports it (``"program"``)."""
        return {"name": self.name, "schema_version": self.schema_version, "torch_version": self.torch_version,
                "inputs": [e.to_dict() for e in self.inputs], "outputs": [e.to_dict() for e in self.outputs],
                "parameters": sum(p.kind == "parameter" for p in self.weights),
                "buffers": sum(p.kind == "buffer" for p in self.weights),
                "constants": len(self.constants)}


@dataclass
class Pt2Archive:
    """The structure of a ``.pt2`` file: ``path``, ``size`` in bytes, ``archive_name`` (top folder),
    ``version`` (``archive_version``), ``programs``, every member by relative name (``members``) and the names of
    AOTInductor members (``aoti``)."""

    path: str
    size: int
    archive_name: str
    version: str
    programs: list[Program] = field(default_factory=list)
    members: dict[str, ZipEntry] = field(default_factory=dict)
    aoti: list[str] = field(default_factory=list)


def _relative(entries: list[ZipEntry]) -> tuple[str, dict[str, ZipEntry]]:
    first = entries[0].name
    top = first.split("/", 1)[0] + "/" if "/" in first else ""
    out: dict[str, ZipEntry] = {}
    for e in entries:
        rel = e.name[len(top):] if top and e.name.startswith(top) else e.name
        if rel in out:
            raise CorruptCheckpointError(f"{duplicate_member(e.name)} (`ckptool scan` lists what each holds)")
        out[rel] = e
    return top.rstrip("/"), out


def _text(f: Any, e: ZipEntry, path: str, limit: int = 4096) -> str:
    try:
        return read_member(f, e, path, limit=limit).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{path}: {e.name!r} is not text; the archive is damaged") from None


def _json(f: Any, e: ZipEntry, path: str) -> Any:
    if e.file_size > MAX_JSON:
        raise UnsupportedError(f"{path}: {e.name!r} holds {e.file_size} bytes of JSON, over ckptool's limit")
    try:
        return json.loads(read_member(f, e, path, limit=MAX_JSON))
    except CkptError:  # read_member's CorruptCheckpointError is a ValueError too: it keeps its own message
        raise
    except (ValueError, RecursionError) as err:
        raise CorruptCheckpointError(f"{path}: {e.name!r} is not valid JSON ({err}); the archive is damaged") from None


def read_pt2(path: str, entries: list[ZipEntry]) -> Pt2Archive:
    """Read the structure of the ``torch.export`` archive at ``path`` from its zip ``entries``
    (:func:`ckptool.formats.detect.zip_entries`): the version records, each program's payload configs and
    signature. No payload bytes are read and nothing is unpickled.

    Raises:
        NotACheckpointError: ``archive_format`` is not ``pt2``.
        UnsupportedError: an ``archive_version`` other than 0 or a program schema other than major version 8 (a
            newer torch); a big-endian archive; the legacy layout (weights pickled in one ``<name>.pt``); an
            archive with no exported program (an AOTInductor-only package).
        CorruptCheckpointError: a missing or malformed config or program, a payload whose member is missing or
            too short for the tensors that view it, duplicate member names, members past the end of the file.
    """
    with open(path, "rb") as f:
        return read_pt2_file(f, os.path.getsize(path), entries, path)


def read_pt2_file(f: BinaryIO, size: int, entries: list[ZipEntry], path: str) -> Pt2Archive:
    """:func:`read_pt2` of an open binary file ``f`` of ``size`` bytes (a zip nested in another: ``path`` names
    it in messages). Raises what :func:`read_pt2` raises."""
    if not entries:
        raise NotACheckpointError(f"{path} is an empty zip archive, not a torch checkpoint")
    try:
        top, members = _relative(entries)
    except CorruptCheckpointError as err:
        raise CorruptCheckpointError(f"{path}: {err}") from None
    for e in entries:
        if e.header_offset + e.compress_size > size:
            raise CorruptCheckpointError(f"{path}: member {e.name!r} runs past the end of the file: truncated; "
                                         "re-download it")
    version = _archive_version(f, members, path)
    arch = Pt2Archive(path, size, top or "archive", version, members=members,
                      aoti=[n for n in members if n.startswith(AOTINDUCTOR_DIR)])
    names = sorted(n[len(MODELS_DIR):-len(".json")] for n in members
                   if n.startswith(MODELS_DIR) and n.endswith(".json") and "/" not in n[len(MODELS_DIR):])
    if not names:
        what = "an AOTInductor package (compiled code, no exported program)" if arch.aoti else "no exported program"
        raise UnsupportedError(f"{path} is a torch.export archive with {what}; ckptool reads the weights of "
                               "programs saved by torch.export.save")
    for name in names:
        arch.programs.append(_program(f, path, name, members))
    return arch


def _archive_version(f: BinaryIO, members: dict[str, ZipEntry], path: str) -> str:
    """The archive's ``archive_version``, once its ``archive_format`` says ``pt2``, the version is one ckptool
    reads and its ``byteorder`` (if recorded) is little-endian.

    Raises:
        NotACheckpointError: another ``archive_format``.
        UnsupportedError: another version, or big-endian.
    """
    fmt = _text(f, members["archive_format"], path) if "archive_format" in members else ""
    if fmt != "pt2":
        raise NotACheckpointError(f"{path}: archive_format is {fmt[:40]!r}, not 'pt2'; not a torch.export archive")
    version = _text(f, members["archive_version"], path) if "archive_version" in members else "0"
    if version not in ARCHIVE_VERSIONS:
        raise UnsupportedError(
            f"{path} is a torch.export archive of archive_version {version[:20]!r}; ckptool reads version "
            f"{', '.join(ARCHIVE_VERSIONS)} (torch 2.13). Load it with the torch that wrote it (torch.export.load) "
            "and save its state_dict with torch.save, or upgrade ckptool")
    if "byteorder" in members and _text(f, members["byteorder"], path) != "little":
        raise UnsupportedError(f"{path} was saved on a big-endian machine; load and re-save it there")
    return version


def _program(f: Any, path: str, name: str, members: dict[str, ZipEntry]) -> Program:
    doc = _json(f, members[f"{MODELS_DIR}{name}.json"], path)
    prog = Program(name)
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: models/{name}.json is not an object; the archive is damaged")
    prog.schema_version = _schema_version(doc, path, name)
    tv = doc.get("torch_version")
    prog.torch_version = tv if isinstance(tv, str) else None
    sig, values = _signature(doc, path, name)
    prog.inputs = [_spec(s, values) for s in sig.get("input_specs") or []]
    prog.outputs = [_spec(s, values) for s in sig.get("output_specs") or []]
    for legacy in (f"{WEIGHTS_DIR}{name}.pt", f"{CONSTANTS_DIR}{name}.pt"):
        if legacy in members:
            raise UnsupportedError(
                f"{path}: program {name!r} keeps its tensors in the legacy pickled member {legacy} (written by an "
                "older torch); load it with torch.export.load (which unpickles it: trusted files only) and "
                "torch.export.save it again with torch 2.13, or save its state_dict with torch.save")
    buffers = {e.target: e.persistent for e in prog.inputs if e.kind == "buffer"}
    prog.weights = _payloads(f, path, members, f"{WEIGHTS_DIR}{name}_weights_config.json", WEIGHTS_DIR,
                             lambda fqn, is_param: "parameter" if is_param else "buffer")
    prog.constants = _payloads(f, path, members, f"{CONSTANTS_DIR}{name}_constants_config.json", CONSTANTS_DIR,
                               lambda fqn, is_param: "buffer" if fqn in buffers else "constant", by_name=True)
    return prog


def _schema_version(doc: dict[str, Any], path: str, name: str) -> str:
    """``major.minor`` of a program's serialized-program schema.

    Raises:
        UnsupportedError: a major version other than :data:`SCHEMA_MAJOR`.
    """
    sv = doc.get("schema_version")
    major = sv.get("major") if isinstance(sv, dict) else None
    if major != SCHEMA_MAJOR:
        raise UnsupportedError(
            f"{path}: program {name!r} uses serialized-program schema version {major!r}; ckptool reads major "
            f"version {SCHEMA_MAJOR} (torch 2.13). Re-export it with torch 2.13, or load it with the torch that "
            "wrote it and save its state_dict with torch.save")
    return f"{major}.{sv.get('minor')}" if isinstance(sv, dict) else ""


def _signature(doc: dict[str, Any], path: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(graph signature, tensor values)`` of a program's graph module.

    Raises:
        CorruptCheckpointError: either is missing or not an object.
    """
    gm = doc.get("graph_module")
    graph = gm.get("graph") if isinstance(gm, dict) else None
    sig = gm.get("signature") if isinstance(gm, dict) else None
    values = graph.get("tensor_values") if isinstance(graph, dict) else None
    if not isinstance(sig, dict) or not isinstance(values, dict):
        raise CorruptCheckpointError(f"{path}: models/{name}.json has no graph signature; the archive is damaged")
    return sig, values


def _spec(spec: Any, values: dict[str, Any]) -> SignatureEntry:
    """A :class:`SignatureEntry` from one ``InputSpec`` / ``OutputSpec`` union (``{"kind": {...}}``)."""
    if not isinstance(spec, dict) or len(spec) != 1:
        return SignatureEntry("unknown", "?")
    kind, body = next(iter(spec.items()))
    body = body if isinstance(body, dict) else {}
    arg = body.get("arg")
    name, tensor = _argument(arg)
    target = next((body[k] for k in ("parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name",
                                     "user_input_name") if isinstance(body.get(k), str)), None)
    if kind == "constant_input":
        name = str(body.get("name", "?"))
    entry = SignatureEntry(str(kind), name, target,
                           body.get("persistent") if isinstance(body.get("persistent"), bool) else None)
    meta = values.get(tensor) if tensor is not None else None
    if isinstance(meta, dict):
        dt = meta.get("dtype")
        entry.dtype = SCALAR_TYPES.get(dt, f"scalar type {dt}") if isinstance(dt, int) else None
        entry.shape = [_sym(s) for s in meta.get("sizes") or []]
    return entry


def _argument(arg: Any) -> tuple[str, str | None]:
    """``(shown name, tensor name or None)`` of a serialized ``Argument`` (or a bare ``{"name": ...}``)."""
    if not isinstance(arg, dict):
        return "?", None
    if isinstance(arg.get("name"), str):
        return arg["name"], arg["name"]
    if len(arg) == 1:
        kind, val = next(iter(arg.items()))
        if kind == "as_tensor" and isinstance(val, dict) and isinstance(val.get("name"), str):
            return val["name"], val["name"]
        if isinstance(val, dict) and isinstance(val.get("name"), str):
            return val["name"], None
        if kind == "as_none":
            return "None", None
        return f"{kind[3:] if kind.startswith('as_') else kind}={json.dumps(val)[:40]}", None
    return "?", None


def _sym(s: Any) -> int | str:
    if isinstance(s, dict) and len(s) == 1:
        kind, val = next(iter(s.items()))
        if kind == "as_int" and isinstance(val, int):
            return val
        expr = val.get("expr_str") if isinstance(val, dict) else None
        if isinstance(expr, str):
            return expr
        if isinstance(val, str):
            return val
    return "?"


def _ints(v: Any, what: str, where: str) -> tuple[int, ...]:
    vals = [_sym(s) for s in v] if isinstance(v, list) else None
    if vals is None or not all(isinstance(x, int) for x in vals):
        raise CorruptCheckpointError(f"{where}: {what} is not a list of integers; the archive is damaged")
    return tuple(int(x) for x in vals)


def constant_role(path_name: str, use_pickle: bool) -> str | None:
    """How ``torch.export.load`` reads the constant whose config names member ``path_name`` (torch/export/
    pt2_archive/_package.py ``_load_constants``, which decides by the name's prefix): ``"raw"`` (a ``tensor_``
    member without ``use_pickle``: raw storage bytes), ``"pickled"`` (a ``tensor_`` member with ``use_pickle``:
    ``torch.load(weights_only=False)``), ``"object"`` (``custom_obj_``: ``torch._C._pickle_load_obj``;
    ``opaque_obj_``: ``pickle.loads``, whatever ``use_pickle`` and ``tensor_meta`` say), None for any other name
    (torch raises "Unsupported constant type")."""
    if path_name.startswith(TENSOR_CONSTANT_PREFIX):
        return "pickled" if use_pickle else "raw"
    if path_name.startswith((CUSTOM_OBJ_PREFIX, OPAQUE_OBJ_PREFIX)):
        return "object"
    return None


def _payloads(f: Any, path: str, members: dict[str, ZipEntry], config: str, folder: str,
              kind_of: Any, by_name: bool = False) -> list[Payload]:
    """The payloads a program's weights or constants ``config`` lists, each over its member in ``folder``;
    ``kind_of(fqn, is_param)`` names its kind; ``by_name``: constants, whose member names say their role
    (:func:`constant_role`).

    Raises:
        CorruptCheckpointError: the config is missing or malformed, names a missing member or a bad layout.
        UnsupportedError: an unknown dtype, a raw tensor that is not strided.
    """
    if config not in members:
        raise CorruptCheckpointError(f"{path}: {config} is missing; the archive is damaged or incomplete")
    doc = _json(f, members[config], path)
    items = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(items, dict):
        raise CorruptCheckpointError(f"{path}: {config} holds no \"config\" mapping; the archive is damaged")
    return [_payload(f"{path}: {fqn!r} in {config}", fqn, meta, members, folder, kind_of, by_name)
            for fqn, meta in items.items()]


def _payload(where: str, fqn: Any, meta: Any, members: dict[str, ZipEntry], folder: str, kind_of: Any,
             by_name: bool) -> Payload:
    """One entry of a payload config (:func:`_payloads`); ``where`` names it in errors."""
    if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
        raise CorruptCheckpointError(f"{where} has no path_name; the archive is damaged")
    member = folder + meta["path_name"]
    e = members.get(member)
    if e is None or "/" in meta["path_name"]:
        raise CorruptCheckpointError(f"{where} names member {member!r}, which the archive does not hold; "
                                     "the archive is damaged or incomplete")
    p = Payload(str(fqn), kind_of(fqn, meta.get("is_param") is True), member,
                pickled=meta.get("use_pickle") is True, record_size=e.file_size)
    tm = meta.get("tensor_meta")
    role = constant_role(meta["path_name"], p.pickled) if by_name else None
    if by_name and role is None:
        raise CorruptCheckpointError(f"{where} names member {meta['path_name']!r}, whose name is none of the "
                                     "constant kinds torch.export.load reads (tensor_, custom_obj_, "
                                     "opaque_obj_); the archive is damaged or was crafted")
    if tm is None or role == "object":
        p.kind = "object"
        p.pickled = True
        p.layout = "object"
        return p
    if not isinstance(tm, dict):
        raise CorruptCheckpointError(f"{where} has a malformed tensor_meta; the archive is damaged")
    _tensor_meta(p, tm, where)
    if not p.pickled:
        _check_raw(p, e, where)
    return p


def _tensor_meta(p: Payload, tm: dict[str, Any], where: str) -> None:
    """Set ``p``'s dtype, shape, strides, storage offset, device, ``requires_grad`` and layout from its
    ``tensor_meta``."""
    dt = tm.get("dtype")
    p.dtype = SCALAR_TYPES.get(dt) if isinstance(dt, int) else None
    if p.dtype is None:
        raise UnsupportedError(f"{where}: unknown dtype number {dt!r} (not a torch 2.13 ScalarType)")
    p.shape = _ints(tm.get("sizes"), "sizes", where)
    p.stride = _ints(tm.get("strides"), "strides", where)
    off = _sym(tm.get("storage_offset"))
    if not isinstance(off, int) or off < 0 or len(p.stride) != len(p.shape) or any(
            s < 0 for s in (*p.shape, *p.stride)):
        raise CorruptCheckpointError(f"{where} has an invalid layout (sizes {p.shape}, strides {p.stride}, "
                                     f"offset {off}); the archive is damaged")
    p.storage_offset = off
    dev = tm.get("device")
    if isinstance(dev, dict) and isinstance(dev.get("type"), str):
        p.device = dev["type"] + (f":{dev['index']}" if isinstance(dev.get("index"), int) else "")
    p.requires_grad = tm.get("requires_grad") is True
    lay = tm.get("layout")
    p.layout = LAYOUTS.get(lay, f"layout {lay}") if isinstance(lay, int) else "strided"


def _check_raw(p: Payload, e: ZipEntry, where: str) -> None:
    """A raw payload must be a strided view inside its stored member (torch reads the member as the storage)."""
    if p.layout != "strided":
        raise UnsupportedError(f"{where} is a {p.layout} tensor stored as raw bytes; ckptool reads strided ones")
    if e.method != 0:
        raise CorruptCheckpointError(f"{where}: member {e.name!r} is compressed; torch.export never writes that")
    elsize = DTYPE_SIZES[p.dtype or ""]
    n = numel(p.shape)
    if e.file_size % elsize:
        raise CorruptCheckpointError(f"{where}: member {e.name!r} ({e.file_size} bytes) is not a whole number of "
                                     f"{p.dtype} elements; the archive is damaged")
    if n == 0:
        return
    hi = p.storage_offset + sum((s - 1) * st for s, st in zip(p.shape, p.stride)) + 1
    if hi * elsize > e.file_size:
        raise CorruptCheckpointError(
            f"{where} reaches byte {hi * elsize} of member {e.name!r}, which holds {e.file_size} bytes"
            + (" (a fake tensor without data?)" if e.file_size == 0 else "") + "; the archive is damaged")


def _named_pickle(rel: str) -> bool:
    """Whether ``torch.export.load`` unpickles the member ``rel`` (relative name) whatever the configs say: sample
    inputs, script and opaque objects, legacy ``<name>.pt`` payloads. Case-insensitive, as torch's zip reader
    looks names up."""
    low = rel.lower()
    return low.startswith((SAMPLE_INPUTS_DIR, *OBJECT_MEMBER_PREFIXES)) or (
        low.startswith((WEIGHTS_DIR, CONSTANTS_DIR)) and low.endswith(".pt"))


def pickle_members(arch: Pt2Archive) -> list[str]:
    """The members (relative names) ``torch.export.load`` unpickles: pickled payloads, script and opaque objects
    (every ``data/constants/custom_obj_*`` / ``opaque_obj_*`` member, named by a config or not), sample inputs and
    legacy ``<name>.pt`` records. Every other member is JSON, text or raw tensor bytes."""
    out: list[str] = []
    for prog in arch.programs:
        out += [p.member for p in (*prog.weights, *prog.constants) if p.pickled]
    out += [n for n in arch.members if _named_pickle(n)]
    return list(dict.fromkeys(out))


def _config_roles(f: BinaryIO, e: ZipEntry, rel: str, path: str) -> list[tuple[str, str]]:
    """``(member, role)`` (relative names; ``"pickled"`` or ``"raw"``) of every payload the member ``e`` (``rel``
    in the archive) lists when it is a weights or constants config that is JSON, read as the loader reads it;
    [] for any other member.

    Raises:
        CorruptCheckpointError / UnsupportedError: the config cannot be read (past the end of the file, over
            :data:`MAX_JSON`).
    """
    low = rel.lower()
    weights = low.startswith(WEIGHTS_DIR) and low.endswith("_weights_config.json")
    if not (weights or (low.startswith(CONSTANTS_DIR) and low.endswith("_constants_config.json"))):
        return []
    if e.file_size > MAX_JSON:
        raise UnsupportedError(f"{path}: {e.name!r} holds {e.file_size} bytes of JSON, over ckptool's limit")
    data = read_member(f, e, path, limit=MAX_JSON, check_crc=False)  # a bad CRC-32 does not stop torch
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # not JSON: torch.export.load fails on it too
        return []
    items = doc.get("config") if isinstance(doc, dict) else None
    out: list[tuple[str, str]] = []
    for meta in (items or {}).values() if isinstance(items, dict) else ():
        name = meta.get("path_name") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            continue
        use_pickle = meta.get("use_pickle") is True
        role = ("pickled" if use_pickle else "raw") if weights else constant_role(name, use_pickle)
        if role is not None:
            out.append(((WEIGHTS_DIR if weights else CONSTANTS_DIR) + name, role))
    return out


def member_roles(f: BinaryIO, size: int, entries: list[ZipEntry], path: str) -> tuple[set[str], set[str]]:
    """For ``ckptool scan``: ``(pickled, raw)``, the full names of the members of a ``torch.export`` archive that
    ``torch.export.load`` unpickles (whatever their first bytes: ``torch.load`` and ``pickle.loads`` read protocols
    0 and 1 too) and of those it reads only as raw tensor bytes.

    Read leniently, as the loader reads: by name (:func:`_named_pickle`), then every payload config in the archive
    (``data/weights/*_weights_config.json``, ``data/constants/*_constants_config.json``, whatever programs
    ``models/`` names; a config that is not JSON is skipped, as torch cannot load it): weights by ``use_pickle``,
    constants by :func:`constant_role`. Names are compared case-insensitively (torch's zip reader does), so a
    member is pickled when any spelling of its name is; nothing of the archive is refused here.

    Raises:
        CorruptCheckpointError / UnsupportedError: a config cannot be read (past the end of the file, over
            :data:`MAX_JSON`).
    """
    first = entries[0].name if entries else ""
    top = first.split("/", 1)[0] + "/" if "/" in first else ""
    by_low: dict[str, list[str]] = {}
    rels: list[tuple[str, ZipEntry]] = []
    for e in entries:
        rel = e.name[len(top):] if top and e.name.startswith(top) else e.name
        rels.append((rel, e))
        by_low.setdefault(rel.lower(), []).append(e.name)
    pickled = {e.name for rel, e in rels if _named_pickle(rel)}
    raw: set[str] = set()
    for rel, e in rels:
        for member, role in _config_roles(f, e, rel, path):
            (raw if role == "raw" else pickled).update(by_low.get(member.lower(), []))
    return pickled, raw - pickled
