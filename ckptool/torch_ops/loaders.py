"""Loading a checkpoint file, set or folder with torch: :func:`load_checkpoint` and each format's loader.

The format is recognised once (:func:`ckptool.readers.open_checkpoint`) and the loader registered for it in
:data:`LOAD` is run (a :class:`~ckptool.readers.registry.Role` of this layer: one of the ``load_*`` functions here,
registered for each format at the end of this module, each a :class:`Loader` taking the
:class:`~ckptool.readers.Opened` and a :class:`LoadRequest`); every loader reads the structure it needs through
the :class:`~ckptool.readers.Opened`'s cached readers, never a parser of its own.

Safety (project rule 1): a file is loaded with ``weights_only=True`` unless ``trust=True``. Before calling torch,
the pickle is read by ckptool's restricted reader (nothing imported or run) and any global outside torch's
allowlist is named in an :class:`~ckptool.errors.UnsafeCheckpointError`; a weights-only failure from torch itself
becomes the same error. There is no silent fallback to ``weights_only=False``. ``trust`` covers classes, never
gadgets (:mod:`ckptool.torch_ops.trusted`): a file ``ckptool scan`` rates dangerous is refused first, and every
unrestricted unpickle refuses a dangerous global before importing it.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from ckptool import _source as source
from ckptool._gc import gc_paused
from ckptool.errors import CkptError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError
from ckptool.formats.nodes import qualified_name
from ckptool.model import graph
from ckptool.model.allowlist import ALLOWED, classify_global, refusal_remedy
from ckptool.readers import Opened, open_checkpoint
from ckptool.readers.registry import Role
from ckptool.torch_ops.annotations import DeviceLike, torch  # values at run time too (get_type_hints)
from ckptool.torch_ops.dcp_load import load_dcp_state_dict
from ckptool.torch_ops.devices import MoveMemo, map_tensors, move_tensor, resolve_device
from ckptool.torch_ops.pt2 import load_pt2_state_dict
from ckptool.torch_ops.select import as_state_dict
from ckptool.torch_ops.source_load import load_source
from ckptool.torch_ops.stream import FileSpans
from ckptool.torch_ops.tied import restore_shared
from ckptool.torch_ops.trusted import GUARDED, GuardedUnpickler, guarded, refuse_dangerous, refuse_gadgets
from ckptool.torch_ops.zero import load_zero_state_dict

__all__ = ["LOAD", "LoadRequest", "Loader", "first_line", "load_checkpoint", "load_dcp", "load_deepspeed",
           "load_package",
           "load_pickle", "load_pt2", "load_safetensors", "load_set", "load_tensors", "load_torch_legacy",
           "load_torch_zip", "load_torchscript", "registered_safe_globals"]

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
def _saved_devices_and_unsafe_globals(opened: Opened, facts: dict[str, object] | None = None
                                      ) -> tuple[dict[str, int], list[str]]:
    """Read a torch zip / legacy file's structure without torch (its node graph, :meth:`ckptool.readers.Opened.
    graph`) and return ``(location tag -> tensor count, globals outside torch's weights-only allowlist)``.
    ``facts``, when given, gets ``"foreign_byteorder"``: True when the zip's ``byteorder`` record names another byte
    order than this machine's (torch then byte-swaps the storages it loads, so their bytes are not the file's).

    The same checks as :func:`ckptool.inspect` run first: a hostile or damaged file stops here, before torch.

    Raises:
        CorruptCheckpointError: truncated, damaged or hostile file, or a pickle nested deeper than ckptool can walk
            (a module containing itself, a module tree giving more than ``MAX_MODULE_ENTRIES`` entries).
        UnsupportedError: tuple nesting too deep to read safely.
    """
    try:
        ck = opened.graph()
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
        raise CorruptCheckpointError(f"{opened.target}: {graph.too_deep(e)}") from None
    names = dict.fromkeys(qualified_name(m, n) for m, n in ck.globals)
    return saved, [n for n in names if classify_global(n)[0] != ALLOWED]  # a bytearray(1.5e9) call too


@dataclass(frozen=True)
class LoadRequest:
    """What :func:`load_checkpoint` was asked, as each format's loader (:data:`LOAD`)
    takes it: the ``device``, ``trust``, ``spans`` (a :class:`~ckptool.torch_ops.stream.FileSpans` to map files
    through, None: load them whole), ``key`` (the state_dict of a torch.package archive) and ``max_expand`` (the
    budget of a DCP folder's records: :mod:`ckptool.readers.budget`)."""

    device: torch.device
    trust: bool = False
    spans: FileSpans | None = None
    key: str | None = None
    max_expand: float | None = None


class Loader(Protocol):
    """The ``load`` role: a format's checkpoint ``opened`` loaded as :class:`LoadRequest` asks, returned with the
    saved location tags (tag -> number of storages) as ``(object, tags)``."""

    def __call__(self, opened: Opened, req: LoadRequest, /) -> tuple[Any, dict[str, int]]: ...


#: each format's loader, registered at the end of this module (the readers layer names none); a format that
#: registers none is loaded from its reader's tensors (:func:`load_tensors`)
LOAD: Role[Loader] = Role("load", "ckptool.torch_ops")


def load_checkpoint(path: str | os.PathLike[str] | Opened, device: DeviceLike = "cpu", *, trust: bool = False,
                    spans: FileSpans | None = None, key: str | None = None, max_expand: float | None = None
                    ) -> tuple[Any, dict[str, int]]:
    """Load the object saved in ``path`` (a path or URL, opened once, or a checkpoint already opened with
    :func:`ckptool.readers.open_checkpoint`) with every tensor on ``device``; safe unless ``trust``. The format's
    loader is the one registered in :data:`LOAD` (one of the ``load_*`` functions here).

    torch zip / legacy files: ``torch.load(path, map_location=device, weights_only=not trust)``; the pickle is
    first read by ckptool's restricted reader (nothing imported), and a global outside torch's allowlist (and not
    registered with ``torch.serialization.add_safe_globals``) stops the load with its name. safetensors:
    ``safetensors.torch.load_file(path, device=...)``, then the tied weights and views recorded in the header's
    ``__metadata__`` (by ``ckptool convert`` or ``safetensors.torch.save_model``) are given back their names as
    views of one storage (:func:`ckptool.torch_ops.tied.restore_shared`). A sharded set (``*.index.json`` or its
    folder) or a model folder: every shard loaded so, merged into one ``OrderedDict``. A DeepSpeed ZeRO folder: its
    consolidated fp32 state_dict (:func:`ckptool.torch_ops.zero.load_zero_state_dict`). A DCP folder: the nested
    state ``dcp_to_torch_save`` would rebuild, each record loaded by ``torch.load(weights_only=True)``, non-tensor
    entries unpickled unrestricted only with ``trust`` (:func:`ckptool.torch_ops.dcp_load.load_dcp_state_dict`;
    its records' views held to ``max_expand``, :mod:`ckptool.readers.budget`).
    TorchScript archives (only with ``trust``):
    ``torch.jit.load(path, map_location=device).state_dict()``. Plain pickles (only with ``trust``):
    ``pickle.load``, then tensors moved to ``device`` (:func:`~ckptool.torch_ops.devices.map_tensors`: an object
    reached twice, such as tied weights, stays one object, and tensors sharing a storage still share one on
    ``device``). torch.package archives (no ``trust`` needed, none used): the state_dict ``key`` selects
    (``<member>`` or ``<member>:<path>``; else the one ``convert`` would choose) read by ckptool's reader without
    running the package's code, as ``{key: state_dict}`` (:func:`load_package`); ``key`` applies to packages only.

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
            plain pickle) and ``trust`` is False; with ``trust``, ``ckptool scan`` rates the file dangerous (a
            gadget such as ``os.system``: :func:`~ckptool.torch_ops.trusted.refuse_dangerous`), checked before
            anything is loaded.
        CkptError: a trusted pickle names code that is not importable here.
    """
    dev = resolve_device(device)
    if spans is not None and not spans.available():
        spans = None
    opened = path if isinstance(path, Opened) else open_checkpoint(path)
    if trust:
        refuse_dangerous(opened)
    load = LOAD.get(opened.format, load_tensors)
    return load(opened, LoadRequest(dev, trust, spans, key, max_expand))


def _local_file(load: Loader) -> Loader:
    """``load`` for one file that torch (or the safetensors library) opens itself: a URL is copied to a local
    temporary file first, which is loaded as a file of its own (without ``spans``)."""
    @functools.wraps(load)
    def run(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
        if not source.is_url(opened.target):
            return load(opened, req)
        with source.local_copy(opened.target) as local:
            return load_checkpoint(local, req.device, trust=req.trust)

    return run


@_local_file
def load_safetensors(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """``safetensors.torch.load_file`` (or a memory map through ``spans``), tied names restored."""
    from safetensors.torch import load_file

    path, spans = opened.target, req.spans
    header = opened.safetensors_header()
    try:
        tensors = load_file(path, device=str(req.device)) if spans is None else spans.safetensors_load(path, header)
    except (MemoryError, ImportError, CkptError):  # the system's errors, not the file's: the CLI names them
        raise
    except Exception as e:  # safetensors raises its own SafetensorError for damaged files
        raise CorruptCheckpointError(f"{path}: safetensors could not read it ({e}); re-download it") from e
    return restore_shared(tensors, header, path), {}


@_local_file
def load_pt2(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """A torch.export archive's weights (:func:`ckptool.torch_ops.pt2.load_pt2_state_dict`)."""
    return load_pt2_state_dict(opened, req.device)


@_local_file
def load_torchscript(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """``torch.jit.load(path).state_dict()``, only with ``trust`` (it compiles the archive's code)."""
    import torch

    path = opened.target
    if not req.trust:
        raise UnsafeCheckpointError(
            f"{path} is a TorchScript archive: loading it compiles the code stored in it. Pass trust=True "
            "(--trust) only if you trust its source; its state_dict is then taken from torch.jit.load")
    try:
        return dict(torch.jit.load(path, map_location=req.device).state_dict()), {}  # type: ignore[no-untyped-call]
    except (MemoryError, ImportError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: torch.jit.load failed: {first_line(e)}") from e


@_local_file
def load_pickle(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """``pickle.load``, only with ``trust``; tensors moved to the device (:func:`map_tensors` keeps sharing)."""
    path = opened.target
    if not req.trust:
        raise UnsafeCheckpointError(
            f"{path} is a plain pickle, not a torch.save file: only an unrestricted unpickler reads it. Pass "
            "trust=True (--trust) only if you trust its source")
    with source.open_regular(path) as f, guarded(path, "pickle at byte 0"):
        try:
            obj = GuardedUnpickler(f).load()  # trusted by the caller, gadgets refused
        except (MemoryError, CkptError):
            raise
        except Exception as e:  # an ImportError here is the file's: a class that no longer exists
            raise CorruptCheckpointError(f"{path}: unpickling failed: {first_line(e)}") from e
    memo = MoveMemo()
    return map_tensors(obj, lambda t: move_tensor(t, req.device, memo), memo), {}


def load_package(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """A torch.package archive's state_dict, read without running the package's code, ``trust`` or not: the one
    ``opened.state_dict(key)`` selects (``key``: ``<member>`` or ``<member>:<path>``, see
    :mod:`ckptool.readers.read_package`, which refuses ``reduce_package`` objects) loaded by
    :func:`~ckptool.torch_ops.source_load.load_source`, returned as ``{key: state_dict}`` (``key`` as given, else
    the selected ``<member>:<path>``) for :func:`select_state_dict` to find it by that name. ``PackageImporter``
    gives the same tensors but runs the package's code; it is never called here."""
    src = opened.state_dict(req.key)
    saved: dict[str, int] = {}
    for t in src.tensors:
        saved[t.storage.location] = saved.get(t.storage.location, 0) + 1
    return {src.key if req.key is None else req.key: load_source(src, req.device)}, saved


def load_tensors(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """The loader of a format that registers none (:data:`LOAD`'s default): its reader's finished Source
    (:meth:`ckptool.readers.Opened.source`: ``req.key`` where the format is keyed) read by
    :func:`~ckptool.torch_ops.source_load.load_source` (no pickle run, so ``trust`` changes nothing), with the
    saved location tags counted per tensor. A format whose tensors are not read raises its refusal
    (:class:`~ckptool.errors.UnsupportedError`)."""
    src = opened.source(req.key)
    saved: dict[str, int] = {}
    for t in src.tensors:
        saved[t.storage.location] = saved.get(t.storage.location, 0) + 1
    return load_source(src, req.device), saved


def load_deepspeed(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """A DeepSpeed folder consolidated as zero_to_fp32 does, without deepspeed (:mod:`ckptool.torch_ops.zero`)."""
    return load_zero_state_dict(opened, req.device), {}


def load_dcp(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """A DCP folder: ``torch.load`` of each record, never DCP's reader (:mod:`ckptool.torch_ops.dcp_load`)."""
    return load_dcp_state_dict(opened, req.device, trust=req.trust,
                               safe_globals=() if req.trust else registered_safe_globals(),
                               max_expand=req.max_expand)


def _load_torch(opened: Opened, req: LoadRequest, mappable: bool) -> tuple[Any, dict[str, int]]:
    """``torch.load(weights_only=not trust)`` of a torch zip or legacy file, after ckptool's restricted reader
    named every global outside the allowlist (a refusal before torch runs anything); memory-mapped through
    ``spans`` when ``mappable`` (a zip file in this machine's byte order)."""
    import torch

    path, trust = opened.target, req.trust
    facts: dict[str, object] = {}
    saved, unsafe = _saved_devices_and_unsafe_globals(opened, facts)
    if trust:
        refuse_gadgets(path, unsafe)  # trust covers classes, never gadgets
    else:
        registered = registered_safe_globals()
        unsafe = [g for g in unsafe if g not in registered]
        if unsafe:
            raise _unsafe_error(path, unsafe)
    try:
        with guarded(path):
            if req.spans is not None and mappable and not facts.get("foreign_byteorder"):
                obj = req.spans.torch_load(path, trust=trust)
            elif trust:
                obj = torch.load(path, map_location=req.device, weights_only=False, pickle_module=GUARDED)
            else:
                obj = torch.load(path, map_location=req.device, weights_only=True)
    except CkptError:
        raise
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


@_local_file
def load_torch_zip(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """A ``torch.save`` zip file: :func:`_load_torch`, memory-mapped through ``spans`` where given."""
    return _load_torch(opened, req, mappable=True)


@_local_file
def load_torch_legacy(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """A legacy ``torch.save`` stream: :func:`_load_torch`, loaded whole (it has no mapping)."""
    return _load_torch(opened, req, mappable=False)


def load_set(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """The sharded set ``opened`` (its index, as :func:`ckptool.readers.open_checkpoint` resolved it): every shard
    loaded onto the device and merged into one ``OrderedDict`` state_dict in ``weight_map`` shard order (each
    safetensors shard with its recorded sharing restored); saved location tags summed over the shards.

    Raises:
        UsageError: a missing shard.
        UnsupportedError: a shard that holds no state_dict.
        CorruptCheckpointError: a tensor in two shards (and what loading each shard raises).
    """
    where = opened.target
    index = opened.index()
    out: OrderedDict[str, Any] = OrderedDict()
    saved: dict[str, int] = {}
    for shard in index.shards:
        obj, tags = load_checkpoint(index.shard_path(shard), req.device, trust=req.trust, spans=req.spans)
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


for _fmt, _load in (("torch-zip", load_torch_zip), ("torch-legacy", load_torch_legacy),
                    ("torchscript", load_torchscript), ("torch-package", load_package),
                    ("safetensors", load_safetensors), ("sharded-safetensors", load_set), ("sharded-bin", load_set),
                    ("dcp", load_dcp), ("torch-export", load_pt2), ("deepspeed", load_deepspeed),
                    ("pickle", load_pickle)):
    LOAD.register(_fmt, _load)
# imported when a checkpoint of theirs is met (it names LoadRequest: tests/test_registry.py checks its signature)
LOAD.register_lazy("megatron-legacy", "ckptool.torch_ops.megatron:load_megatron")
LOAD.register_lazy("megatron-dist", "ckptool.torch_ops.megatron:load_megatron")
