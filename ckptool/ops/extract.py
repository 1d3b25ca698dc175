"""``ckptool.extract_state_dict``: turn a ``torch.save(model)`` pickle into a plain state_dict, without the model's
class and without running anything from the file.

A full-model pickle holds each ``nn.Module`` as an object whose ``__dict__`` carries ``_parameters``,
``_buffers``, ``_non_persistent_buffers_set`` and ``_modules``. Walking that tree in the node graph of
:mod:`ckptool.unpickler` gives exactly what ``nn.Module.state_dict()`` gives (torch/nn/modules/module.py
``state_dict`` / ``_save_to_state_dict``): for each module, pre-order, its parameters then its persistent buffers
(``None`` ones skipped), then its submodules, keys joined with ``.``; each value the tensor detached
(``requires_grad=False``, a plain tensor, not a Parameter, sharing the parameter's storage); and ``_metadata``
mapping each module path to ``{"version": cls._version}``. ``_version`` is a class attribute the pickle does not
hold: it is 1 (``nn.Module``'s) except for torch's norm layers (2), taken from a table.

What the walk cannot reproduce, because it lives in code the pickle does not carry, is refused with a clear error
(use ``trust=True`` for those): torch classes that override ``_save_to_state_dict`` (quantized, lazy and fake-quant
modules), modules with registered state_dict hooks. A user class that overrides ``state_dict``,
``_save_to_state_dict`` or ``get_extra_state`` cannot be detected: its extra state is not in the result.

``trust=True`` is the explicit alternative: ``torch.load(weights_only=False)`` imports the classes (running the
file's code) and the module's own ``state_dict()`` is called.

Output: a ``.safetensors`` path gets a safetensors file (tensors materialized with torch, contiguous); any other
path gets torch's zip format, written by streaming (tensor bytes copied, never decoded; only the storages the
state_dict uses). Both are written atomically. Importing this module does not import torch.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field, replace
from typing import Any

from ckptool.formats import detect as formats
from ckptool._gc import gc_paused
from ckptool.formats.torchfile import DTYPE_SIZES, Checkpoint, read_checkpoint, resolve_zip_offsets, storage_element
from ckptool.errors import CkptError, UnsupportedError, UsageError
from ckptool.model.graph import compiled_inner, find_state_dicts, get_path, is_module, mapping_items, module_entries, \
    module_state, too_deep, unwrap_tensor
from ckptool.model.keys import metadata_key_mapping, raise_on_collisions, unwrap_key
from ckptool.formats.zipdir import read_member
from ckptool.formats.unpickler import (
    REBUILD_FROM_TYPE_V2,
    REBUILD_QTENSOR,
    GlobalMeta,
    RestrictedUnpickler,
    StorageRef,
    TensorNode,
)

__all__ = ["ExtractResult", "extract_state_dict", "module_versions"]

#: ``_version`` of torch module classes whose version is not nn.Module's 1 (torch 2.13,
#: ``{c: c._version for c in nn.Module subclasses if c._version != 1}``, norm layers only)
_VERSIONS: dict[str, int] = {
    f"torch.nn.modules.{mod}.{cls}": 2
    for mod, classes in {
        "batchnorm": ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "_BatchNorm", "_NormBase"),
        "instancenorm": ("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "_InstanceNorm"),
    }.items()
    for cls in classes
}
#: torch classes whose state_dict is not nn.Module's default (custom ``_save_to_state_dict`` or ``state_dict``)
_CUSTOM_PREFIXES = ("torch.ao.", "torch.nn.quantized.", "torch.nn.intrinsic.", "torch.nn.qat.",
                    "torch.distributed.", "torch.quantization.")


def module_versions() -> dict[str, int]:
    """The ``_version`` table used for ``_metadata`` (class ``module.qualname`` -> version; others are 1)."""
    return dict(_VERSIONS)


@dataclass
class ExtractResult:
    """What :func:`extract_state_dict` wrote: ``dst``, the output ``format`` (``torch-zip`` or ``safetensors``),
    the state_dict ``keys`` in order, the class of the module it came from (``module``, ``module.qualname``), where
    it was in the file (``path``, ``""`` = the top level), ``storages`` copied, ``bytes_written``, the wrapper
    components ``unwrap`` removed (``{component: key count}``) and whether the file's code ran (``trusted``)."""

    src: str
    dst: str
    format: str
    keys: list[str] = field(default_factory=list)
    module: str = ""
    path: str = ""
    storages: int = 0
    bytes_written: int = 0
    removed: dict[str, int] = field(default_factory=dict)
    trusted: bool = False


# ------------------------------------------------------------------------------------------------ the walk
def _find_module(root: Any, key: str | None, path: str) -> tuple[str, Any]:
    if key is not None:
        try:
            obj = get_path(root, key)
        except KeyError:
            raise UsageError(f"{path}: no entry {key!r}; run `ckptool inspect {path}` to see what it holds") from None
        if not is_module(obj):
            raise UsageError(f"{path}: {key!r} is not a pickled nn.Module")
        return key, obj
    if is_module(root):
        return "", root
    mods = [sd for sd in find_state_dicts(root) if sd.is_module]
    if not mods:
        raise UnsupportedError(
            f"{path} holds no pickled nn.Module (no torch.save(model)): its state_dicts can be used as they are "
            f"(`ckptool inspect {path}` lists them)")
    if len(mods) > 1:
        raise UsageError(f"{path} holds several modules ({', '.join(m.path for m in mods)}); choose one with --key")
    return mods[0].path, mods[0].obj


def _class_name(node: Any) -> str:
    cls = type(node)
    return cls.qualified_name if isinstance(cls, GlobalMeta) else type(node).__name__


def _walk(node: Any, prefix: str, entries: list[tuple[str, TensorNode]], meta: dict[str, int],
          active: set[int]) -> None:
    if id(node) in active:
        raise UnsupportedError(f"module {prefix[:-1] or '(top level)'} contains itself; the pickle is malformed")
    inner = compiled_inner(node)
    if inner is not None:  # torch.compile's OptimizedModule: an nn.Module holding the model as _orig_mod
        meta.setdefault(prefix[:-1], 1)
        active.add(id(node))
        _walk(inner, prefix + "_orig_mod.", entries, meta, active)
        active.discard(id(node))
        return
    st = module_state(node)
    where = prefix[:-1] or "(top level)"
    if st is None:
        raise UnsupportedError(f"submodule {where} is not a pickled nn.Module ({_class_name(node)}); extract it with "
                               "--trust")
    cls = _class_name(node)
    if cls.startswith(_CUSTOM_PREFIXES) or (cls.startswith("torch.nn.modules.") and ".Lazy" in cls):
        raise UnsupportedError(
            f"module {where} is a {cls}, whose state_dict torch computes with its own code; extract with --trust "
            "(runs the file's code) or load the model and call state_dict()")
    for hooks in ("_state_dict_hooks", "_state_dict_pre_hooks"):
        if mapping_items(st.get(hooks)):
            raise UnsupportedError(
                f"module {where} ({cls}) has state_dict hooks, which change what state_dict() returns; extract with "
                "--trust (runs the file's code)")
    meta.setdefault(prefix[:-1], _VERSIONS.get(cls, 1))
    active.add(id(node))
    for name, value, kind in module_entries(st):
        if kind == "module":
            _walk(value, f"{prefix}{name}.", entries, meta, active)
            continue
        t = unwrap_tensor(value)
        if t is None or t.storage is None:
            raise UnsupportedError(
                f"{kind} {prefix}{name} of {cls} is not a storage-backed tensor ({value!r}); extract with --trust")
        entries.append((prefix + name, t))
    active.discard(id(node))


def _detached(t: TensorNode) -> TensorNode:
    """The tensor as ``state_dict()`` holds it: ``param.detach()``, so ``requires_grad=False``."""
    if not t.requires_grad:
        return t
    args = list(t.args)
    if (t.func.module, t.func.name) == REBUILD_FROM_TYPE_V2:
        inner = list(args[2])
        inner[5 if t.rebuild_name == REBUILD_QTENSOR else 4] = False
        args[2] = tuple(inner)
    else:
        args[5 if t.rebuild_name == REBUILD_QTENSOR else 4] = False
    return TensorNode(t.func, tuple(args))


def _collect(ck: Checkpoint, key: str | None) -> tuple[str, str, list[tuple[str, TensorNode]], dict[str, int]]:
    path, module = _find_module(ck.root, key, ck.path)
    entries: list[tuple[str, TensorNode]] = []
    meta: dict[str, int] = {}
    try:
        _walk(module, "", entries, meta, set())
    except RecursionError:
        raise too_deep() from None
    return path, _class_name(compiled_inner(module) or module), entries, meta


# ------------------------------------------------------------------------------------------------ writing
def _state_dict_graph(items: list[tuple[str, Any]], meta: dict[str, int]) -> Any:
    """``OrderedDict`` node with the items and a ``_metadata`` attribute, as torch pickles a state_dict."""
    od = RestrictedUnpickler(io.BytesIO(b"")).find_class("collections", "OrderedDict")
    md = od()
    md.dictitems = [(k, {"version": v}) for k, v in meta.items()]
    md.order = ["setitems"]
    sd = od()
    sd.dictitems = list(items)
    sd.state = {"_metadata": md}
    sd.order = ["setitems", "build"]
    return sd


def _write_zip(ck: Checkpoint, dst: str, sd: Any, used: set[str], location_fn: Any) -> tuple[int, int]:
    from ckptool.ops.rewrite import rewrite_file

    keep = {"data/" + k for k in used}
    records = [r for r in ck.records if not r.name.startswith("data/") or r.name in keep]
    storages = {k: v for k, v in ck.storages.items() if k in used}
    res = rewrite_file(replace(ck, records=records, storages=storages), dst, sd, location_fn)
    return res.storages, res.bytes_written


def _torch_dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedError(f"dtype {name} is not available in this torch")
    return dt


def _materialize(ck: Checkpoint, entries: list[tuple[str, TensorNode]]) -> dict[str, Any]:
    """Each tensor as a contiguous CPU torch tensor, read from its storage record (one read per storage)."""
    import torch

    from ckptool.ops.inspect import tensor_dtype

    out: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    with open(ck.path, "rb") as f:
        if ck.format != formats.TORCH_LEGACY:
            resolve_zip_offsets(ck, f)
        for key, t in entries:
            if t.rebuild_name == REBUILD_QTENSOR:
                raise UnsupportedError(f"{key} is a quantized tensor: safetensors cannot hold it; write a .pth file")
            ref: StorageRef = t.storage  # type: ignore[assignment]
            dtype_name = tensor_dtype(t)
            base = flat.get(ref.key)
            if base is None:
                rec = ck.record("data/" + ref.key)
                nbytes = ref.numel * storage_element(ref)[1]
                if rec is None or rec.size < nbytes:
                    raise UnsupportedError(f"{ck.path}: storage {ref.key!r} has no complete record")
                if rec.zipinfo is not None and rec.zipinfo.method != 0:  # a re-packed, compressed archive
                    raw = bytearray(read_member(f, rec.zipinfo, ck.path)[:nbytes])
                else:
                    f.seek(rec.offset)
                    raw = bytearray(f.read(nbytes))
                if len(raw) != nbytes:
                    raise CkptError(f"{ck.path}: storage {ref.key!r} is truncated; re-download the file")
                base = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                flat[ref.key] = base
            el = DTYPE_SIZES.get(dtype_name, 1)
            typed = base[: len(base) - len(base) % el].view(_torch_dtype(dtype_name))
            try:
                out[key] = typed.as_strided(t.shape, t.stride, t.storage_offset).clone(
                    memory_format=torch.contiguous_format)
            except RuntimeError as e:
                raise CkptError(
                    f"{ck.path}: tensor {key} does not fit in its storage ({e}); the file is damaged") from e
    return out


def _save_safetensors(tensors: dict[str, Any], dst: str) -> int:
    from safetensors.torch import save

    from ckptool._fileio import atomic_output

    try:
        data = save(tensors, metadata={"format": "pt"})
    except (ValueError, TypeError, RuntimeError) as e:
        raise UnsupportedError(f"safetensors cannot hold this state_dict ({e}); write a .pth file instead") from e
    with atomic_output(dst) as out:
        out.write(data)
    return len(data)


# ------------------------------------------------------------------------------------------------ the API
def _default_dst(src: str) -> str:
    stem, _ext = os.path.splitext(src)
    return f"{stem}.state_dict.pth"


@gc_paused
def extract_state_dict(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *,
                       key: str | None = None, unwrap: bool = False, to: str | None = None, trust: bool = False,
                       quiet: bool = False) -> ExtractResult:
    """Write the state_dict of the ``nn.Module`` pickled in ``src`` (``torch.save(model)``) to ``dst``.

    Without ``trust`` nothing from the file is imported or run: the module tree in the pickle is walked (see the
    module docstring), and the result equals ``torch.load(src, weights_only=False).state_dict()`` (keys, values,
    dtypes, shapes, strides, storage sharing, ``_metadata``) for modules that use ``nn.Module``'s own state_dict.

    Args:
        src: a torch zip or legacy file holding a pickled module (or a dict holding one: pick it with ``key``).
        dst: ``*.safetensors`` for safetensors, anything else for torch's zip format. Default:
            ``<stem>.state_dict.pth`` beside ``src``.
        key: dotted path of the module inside the file (``"model"``) when it is not the top-level object.
        unwrap: remove wrapper components from the keys (``module.`` of DataParallel/DDP, ``_orig_mod.`` of
            torch.compile...; :func:`ckptool.keys.unwrap_key`), renaming ``_metadata`` to match.
        to: re-tag every storage for this device (``cpu``, ``cuda:0``) in a ``.pth`` output; default: as saved.
        trust: load ``src`` with ``torch.load(weights_only=False)`` (runs the file's code, imports its classes)
            and call the module's own ``state_dict()``.
        quiet: unused by the library (kept for callers that print progress).

    Returns:
        An :class:`ExtractResult`.

    Raises:
        UsageError: ``dst`` is ``src``, a missing output folder, ``key`` naming nothing or not a module, several
            modules without ``key``, a bad ``to`` device.
        UnsupportedError: no pickled module in the file, a TorchScript archive, safetensors input, a module whose
            state_dict needs its own code (quantized / lazy modules, state_dict hooks), a tensor safetensors
            cannot hold.
        CorruptCheckpointError / NotACheckpointError: a damaged or foreign file.
        KeyCollisionError: ``unwrap`` would give two keys one name.
        CkptError: with ``trust``, the model's classes cannot be imported; writing failed.
    """
    src = os.fspath(src)
    dst = os.fspath(dst) if dst is not None else _default_dst(src)
    from ckptool.ops.rewrite import _same_file

    if _same_file(src, dst):
        raise UsageError(f"output {dst} is the input file; choose another -o path")
    safetensors_out = dst.endswith(".safetensors")
    location_fn = None
    if to is not None:
        from ckptool.ops.remap import location_function

        location_fn = location_function(to=to)
    fmt = formats.detect_format(src)
    if fmt == formats.SAFETENSORS:
        raise UnsupportedError(f"{src} is safetensors: it already is a state_dict")
    if fmt == formats.TORCHSCRIPT:
        raise UnsupportedError(
            f"{src} is a TorchScript archive: its state_dict is torch.jit.load(path, map_location='cpu').state_dict()")
    if fmt == formats.PICKLE:
        raise UnsupportedError(f"{src} is a plain pickle without torch storages; there is no state_dict to extract")
    if trust:
        return _extract_trusted(src, dst, key, unwrap, to, safetensors_out)
    ck = read_checkpoint(src, fmt)
    path, cls, entries, meta = _collect(ck, key)
    items = [(k, _detached(t)) for k, t in entries]
    removed: dict[str, int] = {}
    if unwrap:
        mapping: dict[str, str] = {}
        for k, _t in items:
            new, comps = unwrap_key(k)
            mapping[k] = new
            for c in comps:
                removed[c] = removed.get(c, 0) + 1
        raise_on_collisions(mapping, "the extracted state_dict")
        items = [(mapping[k], t) for k, t in items]
        renamed: dict[str, int] = {}
        for old, new in metadata_key_mapping(list(meta), lambda k: unwrap_key(k)[0]).items():
            renamed.pop(new, None)  # the inner module's entry (later) replaces the wrapper's
            renamed[new] = meta[old]
        meta = renamed
    res = ExtractResult(src, dst, formats.SAFETENSORS if safetensors_out else formats.TORCH_ZIP,
                        [k for k, _t in items], cls, path, removed=removed)
    if safetensors_out:
        res.bytes_written = _save_safetensors(_materialize(ck, items), dst)
        res.storages = len({t.storage.key for _k, t in items if t.storage is not None})
        return res
    used = {t.storage.key for _k, t in items if t.storage is not None}
    res.storages, res.bytes_written = _write_zip(ck, dst, _state_dict_graph(items, meta), used, location_fn)
    return res


def _extract_trusted(src: str, dst: str, key: str | None, unwrap: bool, to: str | None,
                     safetensors_out: bool) -> ExtractResult:
    import torch
    from torch import nn

    from ckptool._fileio import atomic_output

    device = to or "cpu"
    try:
        obj = torch.load(src, map_location=device, weights_only=False)  # the user passed --trust
    except (ModuleNotFoundError, AttributeError) as e:
        raise CkptError(f"{src}: loading with --trust needs the model's classes importable here ({e}); run from the "
                        "project that defines them, or extract without --trust") from e
    path = key or ""
    module = obj
    if key is not None:
        for comp in key.split("."):
            module = module[comp] if isinstance(module, dict) else getattr(module, comp, None)
    if not isinstance(module, nn.Module):
        raise UsageError(f"{src}: {'the file' if key is None else repr(key)} is not an nn.Module (it is a "
                         f"{type(module).__name__}); pick the module with --key")
    sd = module.state_dict()
    removed: dict[str, int] = {}
    if unwrap:
        from ckptool.ops.rename import rename_state_dict

        for k in sd:
            for c in unwrap_key(k)[1]:
                removed[c] = removed.get(c, 0) + 1
        sd = rename_state_dict(sd, lambda k: unwrap_key(k)[0])
    cls = f"{type(module).__module__}.{type(module).__qualname__}"
    res = ExtractResult(src, dst, formats.SAFETENSORS if safetensors_out else formats.TORCH_ZIP, list(sd), cls, path,
                        removed=removed, trusted=True)
    if safetensors_out:
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}
        res.bytes_written = _save_safetensors(tensors, dst)
    else:
        with atomic_output(dst) as out:
            torch.save(sd, out)
            res.bytes_written = out.tell()
    res.storages = len({v.untyped_storage().data_ptr() for v in sd.values() if isinstance(v, torch.Tensor)})
    return res
