"""``ckptool.extract_state_dict``: turn a ``torch.save(model)`` pickle into a plain state_dict, without the model's
class and without running anything from the file.

A full-model pickle holds each ``nn.Module`` as an object whose ``__dict__`` carries ``_parameters``,
``_buffers``, ``_non_persistent_buffers_set`` and ``_modules``. Walking that tree in the node graph of
:mod:`ckptool.formats.unpickler` gives exactly what ``nn.Module.state_dict()`` gives (torch/nn/modules/module.py
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

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ckptool._fileio import same_file
from ckptool._gc import gc_paused
from ckptool.errors import UnsupportedError, UsageError
from ckptool.formats.nodes import TensorNode
from ckptool.model.devices import LocationFn
from ckptool.model.graph import (
    class_name,
    compiled_inner,
    find_state_dicts,
    is_module,
)
from ckptool.model.keys import raise_on_collisions, unwrap_keys
from ckptool.model.module_state import detached, module_state_dict, state_dict_node
from ckptool.model.paths import get_path, resolve_path
from ckptool.model.rename_memory import rename_state_dict
from ckptool.model.rename_plan import build_plan
from ckptool.model.units import human_bytes, plural
from ckptool.ops.convert import OutputFormat, convert, place_scalars
from ckptool.ops.rewrite.stream import ProgressFn, retag_function, rewrite_file
from ckptool.readers import Checkpoint, Opened, open_checkpoint
from ckptool.readers.read_torch import training_scalars
from ckptool.torch_ops.extract import load_trusted_module, materialize, save_safetensors, save_trusted
from ckptool.torch_ops.trusted import refuse_dangerous
from ckptool.writers import choose_format

__all__ = ["ExtractResult", "extract_state_dict"]

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
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        """What ``ckptool extract-state-dict`` prints (before its load hint): the ``Wrote ...`` line, and the
        wrapper components removed."""
        where = f" at {self.path}" if self.path else ""
        ran = " [trusted: the file's code ran]" if self.trusted else "; nothing from the file was imported or run"
        text = (f"Wrote {self.dst} ({self.format}, {human_bytes(self.bytes_written)}): "
                f"{plural(len(self.keys), 'tensor')} from {self.module}{where}, "
                f"{plural(self.storages, 'storage')}{ran}")
        if self.removed:
            text += "\nRemoved wrapper components: " + ", ".join(f"{c}. ({plural(n, 'key')})"
                                                                 for c, n in sorted(self.removed.items()))
        return text + "".join(f"\nNote: {n}" for n in self.notes)


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


def _collect(ck: Checkpoint, key: str | None) -> tuple[str, str, list[tuple[str, TensorNode]], dict[str, int]]:
    path, module = _find_module(ck.root, key, ck.path)
    entries, meta = module_state_dict(module)
    return path, class_name(compiled_inner(module) or module), entries, meta


# ------------------------------------------------------------------------------------------------ writing
def _write_zip(ck: Checkpoint, dst: str, sd: Any, used: set[str], location_fn: LocationFn | None,
               progress: ProgressFn | None) -> tuple[int, int]:
    keep = {"data/" + k for k in used}
    records = [r for r in ck.records if not r.name.startswith("data/") or r.name in keep]
    storages = {k: v for k, v in ck.storages.items() if k in used}
    res = rewrite_file(replace(ck, _records=records, storages=storages), dst, sd, location_fn, progress=progress)
    return res.storages, res.bytes_written


# ------------------------------------------------------------------------------------------------ the API
def default_output(src: str | os.PathLike[str]) -> str:
    """The file :func:`extract_state_dict` writes when no ``dst`` is given: ``<stem>.state_dict.pth`` beside
    ``src``."""
    stem, _ext = os.path.splitext(os.fspath(src))
    return f"{stem}.state_dict.pth"


@gc_paused
def extract_state_dict(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *,
                       key: str | None = None, unwrap: bool = False, to: str | None = None,
                       mapping: Mapping[str, str] | None = None, allow_missing: bool = False, trust: bool = False,
                       quiet: bool = False, progress: ProgressFn | None = None) -> ExtractResult:
    """Write the state_dict of the ``nn.Module`` pickled in ``src`` (``torch.save(model)``) to ``dst``.

    Without ``trust`` nothing from the file is imported or run: the module tree in the pickle is walked (see the
    module docstring), and the result equals ``torch.load(src, weights_only=False).state_dict()`` (keys, values,
    dtypes, shapes, strides, storage sharing, ``_metadata``) for modules that use ``nn.Module``'s own state_dict.

    Args:
        src: a torch zip or legacy file holding a pickled module (or a dict holding one: pick it with ``key``), or
            a ``torch.export`` archive (``.pt2``: its program's state_dict; ``key="constants"``: its constants).
        dst: ``*.safetensors`` for safetensors, anything else for torch's zip format. Default:
            ``<stem>.state_dict.pth`` beside ``src``.
        key: dotted path of the module inside the file (``"model"``) when it is not the top-level object.
        unwrap: remove wrapper prefixes from the keys (``module.`` of DataParallel/DDP, ``_orig_mod.`` of
            torch.compile, a shared attribute prefix such as ``model.``...; :func:`ckptool.model.keys.unwrap_keys`),
            renaming ``_metadata`` to match.
        to: re-tag every storage for this device (``cpu``, ``cuda:0``) in a ``.pth`` output; default: as saved.
        mapping: re-tag only the storages whose tag matches (``{"cuda:1": "cpu"}``), in a ``.pth`` output.
        allow_missing: write the file even when a ``mapping`` source matches no storage.
        trust: load ``src`` with ``torch.load(weights_only=False)`` (runs the file's code, imports its classes)
            and call the module's own ``state_dict()``.
        quiet: unused by the library (kept for callers that print progress).
        progress: ``progress(nbytes)`` is called as storage records are copied into a ``.pth`` output (bytes since
            the last call).

    Returns:
        An :class:`ExtractResult`.

    Raises:
        UsageError: ``dst`` is ``src``, a missing output folder, ``key`` naming nothing or not a module, several
            modules without ``key``, a bad ``to`` device, ``to`` / ``mapping`` with a ``.safetensors`` output,
            ``mapping`` with ``trust``.
        DeviceNotFoundError: a ``mapping`` source matches no storage (unless ``allow_missing``).
        UnsupportedError: no pickled module in the file, a TorchScript archive, safetensors input, a module whose
            state_dict needs its own code (quantized / lazy modules, state_dict hooks), a tensor safetensors
            cannot hold.
        CorruptCheckpointError / NotACheckpointError: a damaged or foreign file.
        KeyCollisionError: ``unwrap`` would give two keys one name.
        CkptError: with ``trust``, the model's classes cannot be imported; writing failed.
    """
    src = os.fspath(src)
    dst = os.fspath(dst) if dst is not None else default_output(src)
    out = _output_format(src, dst, to, mapping, trust)
    if trust:
        refuse_dangerous(src)  # trust covers classes, never gadgets
    opened = _extractable(src)
    if not opened.spec.pickled and not opened.spec.refusal:  # .pt2: its state_dict through the registry's reader
        return _extract_pt2(opened, dst, out, key, unwrap, to, mapping, allow_missing, progress)
    if trust:
        return _extract_trusted(src, dst, key, unwrap, to, out)
    ck = opened.graph()  # a torch.package archive: the reader's refusal (its objects need the package's code)
    location_fn = retag_function(ck, to, mapping, allow_missing=allow_missing)
    path, cls, items, meta, removed = _walk(ck, key, unwrap)
    res = ExtractResult(src, dst, out.writer.reads_as, [k for k, _t in items], cls, path, removed=removed)
    used = {t.storage.key for _k, t in items if t.storage is not None}
    kept, res.notes = place_scalars(_scalars(ck, path), out, {k for k, _t in items})
    if out is OutputFormat.SAFETENSORS:
        res.bytes_written = save_safetensors(materialize(ck, items), dst, metadata=kept)
        res.storages = len(used)
        return res
    res.storages, res.bytes_written = _write_zip(ck, dst, state_dict_node(items, meta), used, location_fn, progress)
    return res


#: this command's name in the registry's per-operation refusals (:attr:`ckptool.readers.Format.refusals`)
OPERATION = "extract-state-dict"


def _output_format(src: str, dst: str, to: str | None, mapping: Mapping[str, str] | None,
                   trust: bool) -> OutputFormat:
    """The output format ``dst`` names (:func:`ckptool.writers.choose_format`: safetensors for
    ``*.safetensors`` in any case, torch for ``.pt`` / ``.pth`` / ``.bin``...).

    Raises:
        UsageError: ``dst``'s suffix names no format, or a folder format; ``dst`` is ``src``; ``to`` /
            ``mapping`` for an output without location tags; ``mapping`` with ``trust``.
    """
    if same_file(src, dst):
        raise UsageError(f"output {dst} is the input file; choose another -o path")
    out = OutputFormat(choose_format(dst).name)
    if out.folder:
        raise UsageError(f"extract-state-dict writes one file, not a {out.value} folder: name it OUT.pt or "
                         "OUT.safetensors")
    if not out.location_tags and (to is not None or mapping):
        raise UsageError("--to / --map set torch location tags; a safetensors output carries none (load it with "
                         "safetensors.torch.load_file(path, device=...))")
    if trust and mapping:
        raise UsageError("--trust loads the module onto one device: give --to DEVICE instead of --map")
    return out


def _scalars(ck: Checkpoint, path: str) -> dict[str, bool | int | float | str]:
    """A training checkpoint's plain top-level values beside the module at ``path``
    (:func:`ckptool.readers.read_torch.training_scalars`); {} for a module at the top level."""
    trail = resolve_path(ck.root, path) if path else []
    if not trail or trail[0].parent is not ck.root:
        return {}
    return training_scalars(ck.root, trail[0].key) or {}


def _walk(ck: Checkpoint, key: str | None, unwrap: bool
          ) -> tuple[str, str, list[tuple[str, TensorNode]], dict[str, int], dict[str, int]]:
    """The module's state_dict as ``nn.Module.state_dict()`` gives it, from the node graph: ``(path of the module,
    its class, [(key, detached tensor node)], _metadata versions, wrapper components removed)``, the keys
    unwrapped (and ``_metadata`` renamed to match) with ``unwrap``.

    Raises:
        UsageError / UnsupportedError: as :func:`_find_module`; KeyCollisionError: ``unwrap`` would merge keys.
    """
    path, cls, entries, meta = _collect(ck, key)
    items = [(k, detached(t)) for k, t in entries]
    removed: dict[str, int] = {}
    if unwrap:
        keys, removed = unwrap_keys(k for k, _t in items)
        raise_on_collisions(keys, "the extracted state_dict")
        items = [(keys[k], t) for k, t in items]
        meta = dict(build_plan(unwrap=True).bind(keys).rename_metadata(meta.items()))
    return path, cls, items, meta, removed


def _extractable(src: str) -> Opened:
    """``src`` opened (:func:`ckptool.readers.open_checkpoint`) when a state_dict can be extracted from it: one torch
    zip or legacy file, or a ``.pt2`` archive.

    Raises:
        UnsupportedError: a format the registry says this command refuses (safetensors: already a state_dict,
            TorchScript, a plain pickle: :attr:`ckptool.readers.Format.refusals`); any other format of one flat
            mapping of tensors that is no pickle (not :attr:`~ckptool.readers.Format.keyed`: already a
            state_dict, where the ``.pt2`` path would describe it as an exported program); a folder or a set
            (:meth:`ckptool.readers.Opened.require_file`).
    """
    opened = open_checkpoint(src).require_file()
    spec = opened.spec
    refusal = spec.refusals.get(OPERATION)
    if refusal is None and not spec.keyed and not spec.pickled:  # one flat mapping of tensors, no nn.Module
        refusal = (f"is {spec.flat or 'a ' + spec.label.strip('`')}: it already is a state_dict (one flat mapping "
                   "of tensors); use it as it is")
    if refusal:
        raise UnsupportedError(f"{src} {refusal}")
    return opened


def _extract_pt2(opened: Opened, dst: str, out: OutputFormat, key: str | None, unwrap: bool, to: str | None,
                 mapping: Mapping[str, str] | None, allow_missing: bool, progress: ProgressFn | None) -> ExtractResult:
    """A ``torch.export`` archive: its program's state_dict (``key="constants"``: its constants;
    :meth:`ckptool.readers.Opened.state_dict`), written and verified by :func:`ckptool.ops.convert.convert`
    (tensor bytes copied, never decoded). Nothing in the archive needs running, so ``trust`` changes nothing."""
    src = opened.path
    source = opened.state_dict(key)
    keys = [t.name for t in source.tensors]
    removed: dict[str, int] = {}
    if unwrap:
        renamed, removed = unwrap_keys(keys)
        keys = [renamed[k] for k in keys]
    res = convert(src, dst, format=out.value, key=key, to=to, mapping=mapping, allow_missing=allow_missing,
                  unwrap=unwrap, progress=progress)
    return ExtractResult(src, dst, out.writer.reads_as, keys, f"the torch.export program's {source.key}", "",
                         len({id(t.storage) for t in source.tensors}), res.bytes_written, removed)


def _extract_trusted(src: str, dst: str, key: str | None, unwrap: bool, to: str | None,
                     out: OutputFormat) -> ExtractResult:
    module = load_trusted_module(src, key, to or "cpu")
    sd = module.state_dict()
    removed: dict[str, int] = {}
    if unwrap:
        keys, removed = unwrap_keys(sd)
        sd = rename_state_dict(sd, build_plan(unwrap=True).bind(keys).rename)
    cls = f"{type(module).__module__}.{type(module).__qualname__}"
    res = ExtractResult(src, dst, out.writer.reads_as, list(sd), cls, key or "", removed=removed, trusted=True)
    res.bytes_written, res.storages = save_trusted(sd, dst, out is OutputFormat.SAFETENSORS)
    return res
