"""Load a checkpoint onto a device and into the user's model.

The functions here replace the usual loading boilerplate (``torch.load(..., map_location=...)``, picking
``ckpt["state_dict"]``, ``k.replace("module.", "")``, deleting a head's keys before ``strict=False``)::

    model = Net()
    ckptool.load_into(model, "ckpt.pth", device="cuda:0")   # moves, maps, renames, loads; raises on mismatch

:func:`load_into` moves the model to ``device``, loads the file with ``torch.load(map_location=device,
weights_only=True)`` (:func:`load_checkpoint`), picks the state_dict inside it (:func:`select_state_dict`),
reconciles wrapper prefixes (:func:`ckptool.model.keys.reconcile`) and calls the model's own
``load_state_dict``; it returns a :class:`~ckptool.torch_ops.reports.LoadReport`.

Safety (project rule 1): a file is loaded with ``weights_only=True`` unless ``trust=True`` (each format's loader,
:mod:`ckptool.torch_ops.loaders`). There is no silent fallback to ``weights_only=False``.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptool.errors import CkptError, UsageError
from ckptool.model.keys import mapping_key_function, rename_metadata_items
from ckptool.torch_ops.annotations import DeviceLike, PrefixSpec, nn, torch  # values at run time too (get_type_hints)
from ckptool.torch_ops.devices import is_tensor, model_device, resolve_device
from ckptool.torch_ops.loaders import first_line, load_checkpoint
from ckptool.torch_ops.reports import DtypeCast, LoadReport, ShapeMismatch, dtype_name, load_suggestions
from ckptool.torch_ops.select import find_state_dicts, reconciliation, select_state_dict
from ckptool.torch_ops.stream import FileSpans
from ckptool.torch_ops.tied import tied_entries

__all__ = ["find_state_dicts", "first_line", "load_checkpoint", "load_into", "select_state_dict"]


# ------------------------------------------------------------------------------------------------ core load
@dataclass
class Loaded:
    """The result of :func:`load_selected`: the report, model key -> the checkpoint tensor copied into it, the
    state_dict that was loaded and the :class:`~ckptool.torch_ops.stream.FileSpans` its tensors were streamed
    through (None when they were not)."""

    report: LoadReport
    loaded: dict[str, Any]
    source: Mapping[str, Any] | None = None
    spans: FileSpans | None = None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors (NaN-safe): same dtype, same shape, same bytes (False for meta tensors,
    which hold no data)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.device.type == "meta" or b.device.type == "meta":  # no data to compare
        return False
    if a.device != b.device:
        b = b.to(a.device)
    import torch

    if a.layout != torch.strided or b.layout != torch.strided or a.is_nested or b.is_nested or a.is_quantized \
            or b.is_quantized:
        return _same_parts(a, b)
    ra, rb = a.detach().reshape(-1), b.detach().reshape(-1)
    if ra.numel() == 0:
        return True
    try:
        return bool(torch.equal(ra.contiguous().view(torch.uint8), rb.contiguous().view(torch.uint8)))
    except RuntimeError:  # layouts that cannot be viewed as bytes (quantized, sparse): compare values
        return bool(torch.equal(ra, rb))


def _same_parts(a: torch.Tensor, b: torch.Tensor) -> bool:
    """:func:`same_bits` for tensors that are not one strided view (:mod:`ckptool.model.nonstrided`): same layout,
    and the same bits in each part: the indices and values of a sparse tensor, the integers and quantization
    parameters of a quantized one, the components of a nested one."""
    import torch

    if a.layout != b.layout or a.is_nested != b.is_nested or a.is_quantized != b.is_quantized:
        return False
    if a.is_nested:
        pa, pb = a.unbind(), b.unbind()
        return len(pa) == len(pb) and all(same_bits(x, y) for x, y in zip(pa, pb))
    if a.is_quantized:
        if a.qscheme() != b.qscheme() or not same_bits(a.int_repr(), b.int_repr()):
            return False
        if a.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            return a.q_scale() == b.q_scale() and a.q_zero_point() == b.q_zero_point()
        return (a.q_per_channel_axis() == b.q_per_channel_axis()
                and same_bits(a.q_per_channel_scales(), b.q_per_channel_scales())
                and same_bits(a.q_per_channel_zero_points(), b.q_per_channel_zero_points()))
    if a.layout == torch.sparse_coo:
        return same_bits(a._indices(), b._indices()) and same_bits(a._values(), b._values())
    if a.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (torch.Tensor.crow_indices, torch.Tensor.col_indices, torch.Tensor.values)
    else:  # sparse_csc, sparse_bsc
        parts = (torch.Tensor.ccol_indices, torch.Tensor.row_indices, torch.Tensor.values)
    return all(same_bits(p(a), p(b)) for p in parts)


def _streamed(to_load: OrderedDict[str, Any], model_sd: Mapping[str, Any], spans: FileSpans | None
              ) -> OrderedDict[str, Any]:
    """What to hand to ``load_state_dict``: ``to_load`` with every entry whose bytes ``spans`` could stream into
    the model's own tensor (same dtype and shape, :meth:`FileSpans.read_into`) replaced by that tensor, so that
    torch's ``param.copy_(value)`` copies nothing (a tensor copied onto itself) while every module hook, check and
    report still runs; ``_metadata`` kept."""
    if spans is None:
        return to_load
    fed: OrderedDict[str, Any] = OrderedDict()
    for mk, v in to_load.items():
        target = model_sd.get(mk)
        fed[mk] = target if is_tensor(v) and is_tensor(target) and spans.read_into(target, v) else v
    meta = getattr(to_load, "_metadata", None)
    if meta is not None:
        fed._metadata = meta  # type: ignore[attr-defined]
    return fed


@dataclass
class _Fitted:
    """The checkpoint's entries sorted against the model's: what to hand to ``load_state_dict`` (model keys,
    ``_metadata`` renamed alongside), the entries set aside for their shape, and the dtype casts torch will make
    (grouped by ``(checkpoint dtype, model dtype)``)."""

    to_load: OrderedDict[str, Any]
    mismatched: list[ShapeMismatch]
    cast_groups: dict[tuple[str, str], list[tuple[str, torch.Tensor, torch.Tensor]]]


def _fit(sd: Mapping[str, Any], mapping: Mapping[str, str], changed: bool, model_sd: Mapping[str, Any]) -> _Fitted:
    """Each checkpoint entry of ``sd`` under its model key (``mapping``): set aside when its shape differs from the
    model's tensor (torch would raise even with ``strict=False``), its cast noted when its dtype does; the
    ``_metadata`` module paths renamed with the keys when ``changed``."""
    import torch
    from torch.nn.parameter import is_lazy

    fitted = _Fitted(OrderedDict(), [], {})
    for ck in sd:
        mk = mapping[ck]
        v, target = sd[ck], model_sd.get(mk)
        if isinstance(v, torch.Tensor) and isinstance(target, torch.Tensor) and not is_lazy(target):
            if tuple(v.shape) != tuple(target.shape):
                fitted.mismatched.append(ShapeMismatch(mk, ck, list(v.shape), list(target.shape)))
                continue
            if v.dtype != target.dtype:
                key = (dtype_name(v.dtype), dtype_name(target.dtype))
                fitted.cast_groups.setdefault(key, []).append((mk, v, target))
        fitted.to_load[mk] = v
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        if changed:  # module paths follow the keys (later entry wins in the first one's place, as torch does)
            meta = OrderedDict(rename_metadata_items(meta.items(), mapping_key_function(mapping)))
        fitted.to_load._metadata = meta  # type: ignore[attr-defined]
    return fitted


def _casts(groups: Mapping[tuple[str, str], list[tuple[str, torch.Tensor, torch.Tensor]]]) -> list[DtypeCast]:
    """One :class:`DtypeCast` per ``(checkpoint dtype, model dtype)``: its count, an example key, and whether the
    cast loses bits for any of its tensors (cast there and back, compared bit for bit)."""
    casts = []
    for (cd, md), items in groups.items():
        lossy = any(not same_bits(v.to(t.dtype).to(v.dtype), v) for _, v, t in items)
        casts.append(DtypeCast(cd, md, len(items), items[0][0], lossy))
    return casts


def _load_state_dict(model: nn.Module, sd: Mapping[str, Any], *, path: str, key: str, found: list[str],
                     device: torch.device, strict: bool, prefixes: PrefixSpec, saved: dict[str, int],
                     spans: FileSpans | None = None, assign: bool = False) -> Loaded:
    model_sd = model.state_dict()
    model_keys = list(model_sd)
    ckeys = list(sd)
    rec = reconciliation(ckeys, model_keys, prefixes)
    inverse = {v: k for k, v in rec.mapping.items()}
    fitted = _fit(sd, rec.mapping, rec.changed, model_sd)
    to_load, mismatched = fitted.to_load, fitted.mismatched

    try:
        result = model.load_state_dict(to_load if assign else _streamed(to_load, model_sd, spans), strict=False,
                                       assign=assign)
    except RuntimeError as e:  # a module's own _load_from_state_dict refused a value
        raise CkptError(f"{type(model).__name__}.load_state_dict refused {path}: {first_line(e)}") from e
    skipped = {m.key for m in mismatched}
    unexpected = [inverse.get(k, k) for k in result.unexpected_keys]
    unused = set(result.unexpected_keys)
    loaded = {k: v for k, v in to_load.items() if k not in unused}
    missing = [k for k in result.missing_keys if k not in skipped]
    tied = tied_entries(model_sd, missing, loaded)  # lm_head.weight absent because it *is* embed.weight
    missing = [k for k in missing if k not in tied]

    casts = _casts(fitted.cast_groups)
    report = LoadReport(
        path=path, model=type(model).__name__, device=str(device), key=key, strict=strict, found=found,
        prefixes_removed=list(rec.removed), prefixes_added=list(rec.added),
        renamed=sum(1 for a, b in rec.mapping.items() if a != b), loaded=len(loaded), model_entries=len(model_keys),
        checkpoint_entries=len(ckeys), missing=missing, tied=tied, unexpected=unexpected, mismatched=mismatched,
        casts=casts, saved_devices=dict(saved),
    )
    report.suggestions = load_suggestions(report, ckeys, model_keys)
    return Loaded(report, loaded, sd, spans)


def load_selected(model: nn.Module, obj: Any, *, path: str, key: str | None, device: torch.device, strict: bool,
                  prefixes: PrefixSpec, saved: dict[str, int], spans: FileSpans | None = None,
                  assign: bool = False) -> Loaded:
    """Choose the state_dict in the loaded ``obj`` (:func:`select_state_dict`) and load it into ``model`` as
    :func:`load_into` does (never raising for a mismatch: the report says it). With ``spans`` (``obj`` was
    memory-mapped by :func:`load_checkpoint`) each tensor's bytes are read from the file straight into the
    model's tensor where :meth:`~ckptool.torch_ops.stream.FileSpans.read_into` can; with ``assign`` the
    checkpoint's tensors themselves become the model's (``load_state_dict(assign=True)``).

    Raises:
        UsageError / UnsupportedError / KeyCollisionError: as :func:`select_state_dict` and ``prefixes``.
        CkptError: the model's own ``load_state_dict`` refused a value.
    """
    model_keys = list(model.state_dict())
    where, sd, found = select_state_dict(obj, key, model_keys, prefixes=prefixes, path=path)
    return _load_state_dict(model, sd, path=path, key=where, found=found, device=device, strict=strict,
                            prefixes=prefixes, saved=saved, spans=spans, assign=assign)


# ------------------------------------------------------------------------------------------------ public API
def check_model(model: object) -> None:
    """Raise :class:`~ckptool.errors.UsageError` unless ``model`` is a ``torch.nn.Module``."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def load_for_model(model: nn.Module, path: str | os.PathLike[str], device: DeviceLike | None, *, trust: bool,
                   spans: FileSpans | None = None, key: str | None = None, max_expand: float | None = None
                   ) -> tuple[str, torch.device, Any, dict[str, int]]:
    """Steps 1 and 2 of :func:`load_into`: ``model.to(device)`` when ``device`` is given (else the model's own
    device is used), then :func:`load_checkpoint` onto that device (memory-mapped on the CPU instead, with
    ``spans``; ``key``: the state_dict of a torch.package archive; ``max_expand``: the budget of a DCP folder's
    records, :mod:`ckptool.readers.budget`). Returns ``(path as str, device, loaded
    object, saved location tags)``.

    Raises:
        UsageError: ``model`` not an ``nn.Module``, bad device.
        UnsafeCheckpointError / NotACheckpointError / CorruptCheckpointError / CkptError: as
            :func:`load_checkpoint`.
    """
    check_model(model)
    dev = resolve_device(device) if device is not None else model_device(model)
    if device is not None:
        model.to(dev)
    p = os.fspath(path)
    obj, saved = load_checkpoint(p, dev, trust=trust, spans=spans, key=key, max_expand=max_expand)
    return p, dev, obj, saved


def load_into(model: nn.Module, path: str | os.PathLike[str], *, device: DeviceLike | None = None,
              key: str | None = None, strict: bool = True, prefixes: PrefixSpec = "auto", trust: bool = False,
              mmap: bool = False, max_expand: float | None = None) -> LoadReport:
    """Load the checkpoint at ``path`` into ``model`` on ``device``, fixing what usually needs boilerplate.

    1. ``model.to(device)`` when ``device`` is given (else the model stays where it is, and its device is used).
    2. The file is opened without a second copy of the model: a torch zip or safetensors file (or a sharded set
       of them) is memory-mapped (``torch.load(mmap=True, map_location="cpu", weights_only=True)``; see
       :func:`load_checkpoint` and :mod:`ckptool.torch_ops.stream`), and in step 5 each tensor's bytes are read
       from the file straight into the model's parameter or buffer (through a bounded pinned buffer for a CUDA
       device); peak memory is the model plus a few MiB. Legacy (``_use_new_zipfile_serialization=False``)
       files cannot be mapped and, like full-model pickles and TorchScript (with ``trust``), are loaded whole
       onto the device first (``torch.load(map_location=device)``), then copied: twice the model at the peak.
       So are torch.package archives, read by ckptool's reader without running the package's code (``trust``
       or not: :func:`load_package`; ``key`` in the ``<member>:<path>`` syntax ``ckptool inspect`` prints).
    3. The state_dict is chosen: ``key`` (dotted path, e.g. ``"state_dict"``, ``"ema"``) or automatically
       (:func:`select_state_dict`).
    4. Keys are reconciled with the model's (``prefixes="auto"``: :func:`ckptool.model.keys.reconcile`, e.g.
       ``module.`` removed for a bare model or added for a DataParallel one, ``_orig_mod.`` for compiled models,
       Lightning's ``model.``); ``prefixes=None`` keeps the keys as saved; a prefix or list of prefixes strips
       exactly those. ``_metadata`` (module versions) is renamed alongside.
    5. Entries whose shape differs from the model's are set aside (torch would raise even with ``strict=False``);
       the rest go through the model's own ``load_state_dict(strict=False)``, which copies (and casts) each into
       the existing parameters and buffers. Missing and unexpected keys are those torch reports, less the
       *tied* ones: a model entry absent from the checkpoint whose tensor shares storage with a loaded entry
       (``lm_head.weight`` is ``embed.weight``; :func:`ckptool.torch_ops.tied.tied_entries`) got its values from
       that entry and is reported in ``LoadReport.tied``, not as missing.

    ``max_expand`` (default :data:`ckptool.readers.budget.MAX_EXPAND`; ``0``: no limit) bounds what a DCP
    folder's tensors take in memory by what its records hold: a ``.metadata`` declaring a tensor larger than its
    records, or a record saved as a stride-0 view (``expand()``), is refused before torch allocates it
    (:mod:`ckptool.readers.budget`). A torch file's views are loaded as views: the model bounds what they take.

    With ``mmap=True`` (CPU only) nothing is copied at all: the memory-mapped tensors themselves become the
    model's parameters and buffers (``load_state_dict(assign=True)``: they take the checkpoint's dtypes too, and
    their pages are read from the file when first used). The file must then not be overwritten while the model
    lives (``torch.load(mmap=True)``'s own caveat); legacy files have no mapping and give plain tensors.

    With ``strict=True`` any missing (tied entries are not missing), unexpected or shape-mismatched entry raises
    after the load, like torch's
    ``load_state_dict(strict=True)`` (the matching entries have been copied by then); with ``strict=False`` they
    are only reported. Returns the :class:`~ckptool.torch_ops.reports.LoadReport`.

    Raises:
        StateDictMismatchError: ``strict`` and the state_dict does not fit (message: the report's tables).
        UnsafeCheckpointError: the file needs globals outside the weights-only allowlist and ``trust`` is False.
        UsageError: bad device, ``model`` not an ``nn.Module``, ``key`` names no state_dict, bad ``prefixes``,
            ``mmap`` with a device other than the CPU.
        NotACheckpointError / CorruptCheckpointError: unreadable file.
        UnsupportedError: the file holds no state_dict; a DCP folder's tensors over the ``max_expand`` budget.
        KeyCollisionError: stripping ``prefixes`` would merge two keys.
        CkptError: the model's own ``load_state_dict`` refused a value (its RuntimeError is chained).
    """
    check_model(model)
    if mmap and (resolve_device(device) if device is not None else model_device(model)).type != "cpu":
        raise UsageError("load_into(mmap=True) maps the file into host memory: use device='cpu' (or mmap=False to "
                         "stream the tensors onto the device)")
    with FileSpans() as spans:
        p, dev, obj, saved = load_for_model(model, path, device, trust=trust, spans=spans, key=key,
                                            max_expand=max_expand)
        done = load_selected(model, obj, path=p, key=key, device=dev, strict=strict, prefixes=prefixes, saved=saved,
                             spans=spans, assign=mmap)
    del obj
    done.loaded.clear()
    if strict:
        done.report.raise_for_errors()
    return done.report
