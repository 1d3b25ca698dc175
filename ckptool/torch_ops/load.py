"""Load a checkpoint onto a device and into the user's model.

The functions here replace the usual loading boilerplate (``torch.load(..., map_location=...)``, picking
``ckpt["state_dict"]``, ``k.replace("module.", "")``, deleting a head's keys before ``strict=False``)::

    model = Net()
    ckptool.load_into(model, "ckpt.pth", device="cuda:0")   # moves, maps, renames, loads; raises on mismatch

:func:`load_into` moves the model to ``device``, loads the file with ``torch.load(map_location=device,
weights_only=True)`` (:func:`load_checkpoint`), picks the state_dict inside it (:func:`select_state_dict`),
reconciles wrapper prefixes (:func:`ckptool.model.keys.reconcile`) and calls the model's own
``load_state_dict``; it returns a :class:`~ckptool.torch_ops.reports.LoadReport`.

Safety (project rule 1): a file is loaded with ``weights_only=True`` unless ``trust=True``. Before calling torch,
the pickle is read by ckptool's restricted reader (:mod:`ckptool.formats.torchfile`: nothing imported or run) and
any global outside torch's allowlist is named in an :class:`~ckptool.errors.UnsafeCheckpointError`; a
weights-only failure from torch itself becomes the same error. There is no silent fallback to
``weights_only=False``.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptool import _source as source
from ckptool._gc import gc_paused
from ckptool.errors import CkptError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError, UsageError
from ckptool.formats import detect as formats
from ckptool.formats.nodes import qualified_name
from ckptool.formats.safetensors import read_header
from ckptool.formats.sharded import read_index
from ckptool.formats.torchfile import read_checkpoint
from ckptool.model import graph
from ckptool.model.allowlist import ALLOWED, classify_global, refusal_remedy
from ckptool.model.keys import mapping_key_function, rename_metadata_items
from ckptool.readers import Opened, open_checkpoint
from ckptool.torch_ops.annotations import DeviceLike, PrefixSpec, nn, torch  # values at run time too (get_type_hints)
from ckptool.torch_ops.dcp_load import load_dcp_state_dict
from ckptool.torch_ops.devices import TensorMemo, is_tensor, map_tensors, model_device, move_tensor, resolve_device
from ckptool.torch_ops.pt2 import load_pt2_state_dict
from ckptool.torch_ops.reports import DtypeCast, LoadReport, ShapeMismatch, dtype_name, load_suggestions
from ckptool.torch_ops.select import as_state_dict, find_state_dicts, reconciliation, select_state_dict
from ckptool.torch_ops.source_load import load_source
from ckptool.torch_ops.stream import FileSpans
from ckptool.torch_ops.tied import restore_shared, tied_entries
from ckptool.torch_ops.zero import load_zero_state_dict

__all__ = ["find_state_dicts", "load_checkpoint", "load_into", "select_state_dict"]

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


# ------------------------------------------------------------------------------------------------ loading files
def first_line(e: BaseException) -> str:
    """The first line of ``str(e)`` (the exception's class name when empty), at most 300 characters: the part of
    a torch error that goes into ckptool's one-line messages."""
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:300]


def _unsafe_error(path: str, names: list[str], reason: str | None = None) -> UnsafeCheckpointError:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    what = f"globals outside torch.load(weights_only=True)'s allowlist: {shown}" if names else (
        f"objects torch.load(weights_only=True) refuses ({reason})")
    return UnsafeCheckpointError(
        f"{path} holds {what}; loading it would run code named by the file. {refusal_remedy(path, names)}",
        names)


def registered_safe_globals() -> set[str]:
    """``module.qualname`` of what the user added with ``torch.serialization.add_safe_globals``."""
    import torch

    out = set()
    for g in torch.serialization.get_safe_globals():
        obj = g[0] if isinstance(g, tuple) else g
        if isinstance(g, tuple) and len(g) == 2 and isinstance(g[1], str):
            out.add(g[1])
        mod, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if mod and name:
            out.add(f"{mod}.{name}")
    return out


@gc_paused
def _saved_devices_and_unsafe_globals(path: str, fmt: str, facts: dict[str, object] | None = None
                                      ) -> tuple[dict[str, int], list[str]]:
    """Read a torch zip / legacy file's structure without torch (:func:`ckptool.formats.torchfile.read_checkpoint`)
    and return ``(location tag -> tensor count, globals outside torch's weights-only allowlist)``. ``facts``, when
    given, gets ``"foreign_byteorder"``: True when the zip's ``byteorder`` record names another byte order than
    this machine's (torch then byte-swaps the storages it loads, so their bytes are not the file's).

    The same checks as :func:`ckptool.inspect` run first: a hostile or damaged file stops here, before torch.

    Raises:
        CorruptCheckpointError: truncated, damaged or hostile file, or a pickle nested deeper than ckptool can walk
            (a module containing itself, a module tree giving more than ``MAX_MODULE_ENTRIES`` entries).
        UnsupportedError: tuple nesting too deep to read safely.
    """
    try:
        ck = read_checkpoint(path, fmt)
        saved: dict[str, int] = {}
        for root in (ck.root, *ck.extra_roots.values()):
            for _key, t, _rg in graph.iter_tensors(root):
                storage = t.storage
                tag = storage.location if storage is not None else "meta"
                saved[tag] = saved.get(tag, 0) + 1
        for ref in graph.find_state_dicts(ck.root):  # a module tree that contains itself or explodes is corrupt
            if ref.is_module:
                for _entry in graph.iter_state_dict_of_module(ref.obj):
                    pass
        if facts is not None:
            facts["foreign_byteorder"] = ck.byteorder != sys.byteorder
    except RecursionError as e:
        raise CorruptCheckpointError(f"{path}: {graph.too_deep(e)}") from None
    names = dict.fromkeys(qualified_name(m, n) for m, n in ck.globals)
    return saved, [n for n in names if classify_global(n)[0] != ALLOWED]  # a bytearray(1.5e9) call too


def load_checkpoint(path: str | os.PathLike[str], device: DeviceLike = "cpu", *, trust: bool = False,
                    spans: FileSpans | None = None, key: str | None = None) -> tuple[Any, dict[str, int]]:
    """Load the object saved in ``path`` with every tensor on ``device``; safe unless ``trust``.

    torch zip / legacy files: ``torch.load(path, map_location=device, weights_only=not trust)``; the pickle is
    first read by ckptool's restricted reader (nothing imported), and a global outside torch's allowlist (and not
    registered with ``torch.serialization.add_safe_globals``) stops the load with its name. safetensors:
    ``safetensors.torch.load_file(path, device=...)``, then the tied weights and views recorded in the header's
    ``__metadata__`` (by ``ckptool convert`` or ``safetensors.torch.save_model``) are given back their names as
    views of one storage (:func:`ckptool.torch_ops.tied.restore_shared`). A sharded set (``*.index.json`` or its
    folder) or a model folder: every shard loaded so, merged into one ``OrderedDict``. A DeepSpeed ZeRO folder: its
    consolidated fp32 state_dict (:func:`ckptool.torch_ops.zero.load_zero_state_dict`). A DCP folder: the nested
    state ``dcp_to_torch_save`` would rebuild, each record loaded by ``torch.load(weights_only=True)``, non-tensor
    entries unpickled unrestricted only with ``trust`` (:func:`ckptool.torch_ops.dcp_load.load_dcp_state_dict`).
    TorchScript archives (only with ``trust``):
    ``torch.jit.load(path, map_location=device).state_dict()``. Plain pickles (only with ``trust``):
    ``pickle.load``, then tensors moved to ``device`` (:func:`~ckptool.torch_ops.devices.map_tensors`: an object
    reached twice, such as tied weights, stays one object, and tensors sharing a storage still share one on
    ``device``). torch.package archives (no ``trust`` needed, none used): the state_dict ``key`` selects
    (``<member>`` or ``<member>:<path>``; else the one ``convert`` would choose) read by ckptool's reader without
    running the package's code, as ``{key: state_dict}`` (:func:`_load_package`); ``key`` applies to packages only.

    With ``spans`` (a :class:`~ckptool.torch_ops.stream.FileSpans` that :meth:`~FileSpans.available` allows),
    torch zip and safetensors files (shards too) are memory-mapped instead: every tensor is on the CPU, backed by
    the file and not read yet (``torch.load(mmap=True, map_location="cpu")``; safetensors views of an
    ``mmap``), and ``spans`` records where each byte lives so that the caller can stream it into its own
    tensors (:func:`load_into`). Legacy files, TorchScript archives and plain pickles cannot be mapped and are
    loaded as without ``spans``.

    Returns ``(obj, saved_devices)``: the loaded object and location tag -> tensor count as saved in the file
    (empty when unknown).

    Raises:
        UsageError: bad device, missing path, a folder that holds no checkpoint set.
        NotACheckpointError / CorruptCheckpointError: unreadable input, torch failed to read it, an inconsistent
            sharing record in a safetensors header, a tensor in two shards, a DCP record that does not match
            its ``.metadata``.
        UnsafeCheckpointError: the file needs globals outside the weights-only allowlist (or is TorchScript / a
            plain pickle) and ``trust`` is False.
        CkptError: a trusted pickle names code that is not importable here.
    """
    path = os.fspath(path)
    dev = resolve_device(device)
    if spans is not None and not spans.available():
        spans = None
    opened = open_checkpoint(path)
    if opened.format == formats.TORCH_PACKAGE:  # read without running its code (torch_ops.source_load)
        return _load_package(opened, dev, key)
    if opened.format == "deepspeed":  # consolidated as zero_to_fp32 does, without deepspeed (torch_ops.zero)
        return load_zero_state_dict(path, dev), {}
    if opened.format == "dcp":  # torch.load of each record, never DCP's reader (torch_ops.dcp_load)
        return load_dcp_state_dict(opened.target, dev, trust=trust, safe_globals=() if trust else
                                   registered_safe_globals())
    if opened.spec.kind == "set":
        return _load_set(opened.target, dev, trust, spans)
    if source.is_url(opened.target):  # torch.load / load_file / jit.load read a local file: a temporary copy
        with source.local_copy(opened.target) as local:
            return load_checkpoint(local, dev, trust=trust)
    return _LOADERS[opened.format](opened.target, opened.format, dev, trust, spans)


def _load_safetensors(path: str, fmt: str, dev: torch.device, _trust: bool, spans: FileSpans | None
                      ) -> tuple[Any, dict[str, int]]:
    """``safetensors.torch.load_file`` (or a memory map through ``spans``), tied names restored."""
    from safetensors.torch import load_file

    header = read_header(path)
    try:
        tensors = load_file(path, device=str(dev)) if spans is None else spans.safetensors_load(path, header)
    except (MemoryError, ImportError, CkptError):  # the system's errors, not the file's: the CLI names them
        raise
    except Exception as e:  # safetensors raises its own SafetensorError for damaged files
        raise CorruptCheckpointError(f"{path}: safetensors could not read it ({e}); re-download it") from e
    return restore_shared(tensors, header, path), {}


def _load_pt2(path: str, fmt: str, dev: torch.device, _trust: bool, _spans: FileSpans | None
              ) -> tuple[Any, dict[str, int]]:
    return load_pt2_state_dict(path, dev)


def _load_torchscript(path: str, fmt: str, dev: torch.device, trust: bool, _spans: FileSpans | None
                      ) -> tuple[Any, dict[str, int]]:
    """``torch.jit.load(path).state_dict()``, only with ``trust`` (it compiles the archive's code)."""
    import torch

    if not trust:
        raise UnsafeCheckpointError(
            f"{path} is a TorchScript archive: loading it compiles the code stored in it. Pass trust=True "
            "(--trust) only if you trust its source; its state_dict is then taken from torch.jit.load")
    try:
        return dict(torch.jit.load(path, map_location=dev).state_dict()), {}  # type: ignore[no-untyped-call]
    except (MemoryError, ImportError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: torch.jit.load failed: {first_line(e)}") from e


def _load_pickle(path: str, fmt: str, dev: torch.device, trust: bool, _spans: FileSpans | None
                 ) -> tuple[Any, dict[str, int]]:
    """``pickle.load``, only with ``trust``; tensors moved to ``dev`` (:func:`map_tensors` keeps sharing)."""
    if not trust:
        raise UnsafeCheckpointError(
            f"{path} is a plain pickle, not a torch.save file: only an unrestricted unpickler reads it. Pass "
            "trust=True (--trust) only if you trust its source")
    with open(path, "rb") as f:
        try:
            obj = pickle.load(f)  # trusted by the caller
        except MemoryError:
            raise
        except Exception as e:  # an ImportError here is the file's: a class that no longer exists
            raise CorruptCheckpointError(f"{path}: unpickling failed: {first_line(e)}") from e
    memo = TensorMemo()
    return map_tensors(obj, lambda t: move_tensor(t, dev, memo), memo), {}


def _load_package(opened: Opened, dev: torch.device, key: str | None) -> tuple[Any, dict[str, int]]:
    """A torch.package archive's state_dict, read without running the package's code, ``trust`` or not: the one
    ``opened.state_dict(key)`` selects (``key``: ``<member>`` or ``<member>:<path>``, see
    :mod:`ckptool.readers.read_package`, which refuses ``reduce_package`` objects) loaded by
    :func:`~ckptool.torch_ops.source_load.load_source`, returned as ``{key: state_dict}`` (``key`` as given, else
    the selected ``<member>:<path>``) for :func:`select_state_dict` to find it by that name. ``PackageImporter``
    gives the same tensors but runs the package's code; it is never called here."""
    src = opened.state_dict(key)
    saved: dict[str, int] = {}
    for t in src.tensors:
        saved[t.storage.location] = saved.get(t.storage.location, 0) + 1
    return {src.key if key is None else key: load_source(src, dev)}, saved


def _load_torch(path: str, fmt: str, dev: torch.device, trust: bool, spans: FileSpans | None
                ) -> tuple[Any, dict[str, int]]:
    """``torch.load(weights_only=not trust)`` of a torch zip or legacy file, after ckptool's restricted reader
    named every global outside the allowlist (a refusal before torch runs anything)."""
    import torch

    facts: dict[str, object] = {}
    saved, unsafe = _saved_devices_and_unsafe_globals(path, fmt, facts)
    if not trust:
        registered = registered_safe_globals()
        unsafe = [g for g in unsafe if g not in registered]
        if unsafe:
            raise _unsafe_error(path, unsafe)
    try:
        if spans is not None and fmt == formats.TORCH_ZIP and not facts.get("foreign_byteorder"):
            obj = spans.torch_load(path, trust=trust)
        else:
            obj = torch.load(path, map_location=dev, weights_only=not trust)
    except pickle.UnpicklingError as e:
        if trust:
            raise CorruptCheckpointError(f"{path}: unpickling failed: {first_line(e)}") from e
        msg = str(e)
        names = list(dict.fromkeys(_GLOBAL_RE.findall(msg)))
        reason = next((ln.strip() for ln in msg.splitlines() if "WeightsUnpickler error" in ln), first_line(e))
        raise _unsafe_error(path, names, reason) from e
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError) as e:
        raise CorruptCheckpointError(f"{path}: torch.load failed: {first_line(e)}; the file may be truncated "
                                     "or damaged") from e
    except (ImportError, AttributeError) as e:  # trusted full-model pickle whose classes are not importable here
        raise CkptError(f"{path}: the pickle names code that is not importable here ({first_line(e)}); make the "
                        "model's module importable (PYTHONPATH) or load a state_dict instead") from e
    return obj, saved


#: how :func:`load_checkpoint` loads one file of each format (the readers layer's names)
_LOADERS: dict[str, Callable[[str, str, torch.device, bool, FileSpans | None], tuple[Any, dict[str, int]]]] = {
    formats.TORCH_ZIP: _load_torch, formats.TORCH_LEGACY: _load_torch, formats.SAFETENSORS: _load_safetensors,
    formats.PT2: _load_pt2, formats.TORCHSCRIPT: _load_torchscript, formats.PICKLE: _load_pickle,
}


def _load_set(where: str, dev: torch.device, trust: bool, spans: FileSpans | None) -> tuple[Any, dict[str, int]]:
    """:func:`load_checkpoint` for the sharded set of the index ``where`` (as :func:`ckptool.readers.open_checkpoint`
    resolved it): every shard loaded onto ``dev`` and merged into one ``OrderedDict`` state_dict in ``weight_map``
    shard order (each safetensors shard with its recorded sharing restored); saved location tags summed over the
    shards.

    Raises:
        UsageError: a missing shard.
        UnsupportedError: a shard that holds no state_dict.
        CorruptCheckpointError: a tensor in two shards (and what loading each shard raises).
    """
    index = read_index(where)
    out: OrderedDict[str, Any] = OrderedDict()
    saved: dict[str, int] = {}
    for shard in index.shards:
        obj, tags = load_checkpoint(index.shard_path(shard), dev, trust=trust, spans=spans)
        sd = as_state_dict(obj)
        if sd is None:
            raise UnsupportedError(f"{where}: shard {shard} holds a {type(obj).__name__}, not a state_dict")
        for k, v in sd.items():
            if k in out:
                raise CorruptCheckpointError(f"{where}: {k!r} is in two shards (the second is {shard})")
            out[k] = v
        for tag, n in tags.items():
            saved[tag] = saved.get(tag, 0) + n
    return out, saved


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


def _load_state_dict(model: nn.Module, sd: Mapping[str, Any], *, path: str, key: str, found: list[str],
                     device: torch.device, strict: bool, prefixes: PrefixSpec, saved: dict[str, int],
                     spans: FileSpans | None = None, assign: bool = False) -> Loaded:
    import torch
    from torch.nn.parameter import is_lazy

    model_sd = model.state_dict()
    model_keys = list(model_sd)
    ckeys = list(sd)
    rec = reconciliation(ckeys, model_keys, prefixes)
    inverse = {v: k for k, v in rec.mapping.items()}

    to_load: OrderedDict[str, Any] = OrderedDict()
    mismatched: list[ShapeMismatch] = []
    cast_groups: dict[tuple[str, str], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for ck in ckeys:
        mk = rec.mapping[ck]
        v, target = sd[ck], model_sd.get(mk)
        if isinstance(v, torch.Tensor) and isinstance(target, torch.Tensor) and not is_lazy(target):
            if tuple(v.shape) != tuple(target.shape):
                mismatched.append(ShapeMismatch(mk, ck, list(v.shape), list(target.shape)))
                continue
            if v.dtype != target.dtype:
                cast_groups.setdefault((dtype_name(v.dtype), dtype_name(target.dtype)), []).append((mk, v, target))
        to_load[mk] = v
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        if rec.changed:  # module paths follow the keys (later entry wins in the first one's place, as torch does)
            meta = OrderedDict(rename_metadata_items(meta.items(), mapping_key_function(rec.mapping)))
        to_load._metadata = meta  # type: ignore[attr-defined]

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

    casts = []
    for (cd, md), items in cast_groups.items():
        lossy = any(not same_bits(v.to(t.dtype).to(v.dtype), v) for _, v, t in items)
        casts.append(DtypeCast(cd, md, len(items), items[0][0], lossy))

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
                   spans: FileSpans | None = None, key: str | None = None
                   ) -> tuple[str, torch.device, Any, dict[str, int]]:
    """Steps 1 and 2 of :func:`load_into`: ``model.to(device)`` when ``device`` is given (else the model's own
    device is used), then :func:`load_checkpoint` onto that device (memory-mapped on the CPU instead, with
    ``spans``; ``key``: the state_dict of a torch.package archive). Returns ``(path as str, device, loaded
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
    obj, saved = load_checkpoint(p, dev, trust=trust, spans=spans, key=key)
    return p, dev, obj, saved


def load_into(model: nn.Module, path: str | os.PathLike[str], *, device: DeviceLike | None = None,
              key: str | None = None, strict: bool = True, prefixes: PrefixSpec = "auto", trust: bool = False,
              mmap: bool = False) -> LoadReport:
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
       or not: :func:`_load_package`; ``key`` in the ``<member>:<path>`` syntax ``ckptool inspect`` prints).
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
        UnsupportedError: the file holds no state_dict.
        KeyCollisionError: stripping ``prefixes`` would merge two keys.
        CkptError: the model's own ``load_state_dict`` refused a value (its RuntimeError is chained).
    """
    check_model(model)
    if mmap and (resolve_device(device) if device is not None else model_device(model)).type != "cpu":
        raise UsageError("load_into(mmap=True) maps the file into host memory: use device='cpu' (or mmap=False to "
                         "stream the tensors onto the device)")
    with FileSpans() as spans:
        p, dev, obj, saved = load_for_model(model, path, device, trust=trust, spans=spans, key=key)
        done = load_selected(model, obj, path=p, key=key, device=dev, strict=strict, prefixes=prefixes, saved=saved,
                             spans=spans, assign=mmap)
    del obj
    done.loaded.clear()
    if strict:
        done.report.raise_for_errors()
    return done.report
