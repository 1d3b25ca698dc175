"""The torch half of ``extract-state-dict``: tensors materialized for a safetensors output, and the trusted path.

:func:`materialize` reads the storages of a node graph's tensors from the checkpoint file and builds contiguous
CPU tensors (for safetensors, which stores each tensor on its own); :func:`save_safetensors` writes them
atomically. :func:`load_trusted_module` / :func:`save_trusted` are ``extract_state_dict(trust=True)``:
``torch.load(weights_only=False)`` (the file's code runs) and the module's own ``state_dict()``.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptool._fileio import atomic_output
from ckptool.errors import CkptError, CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats.dtypes import DTYPE_SIZES, tensor_dtype
from ckptool.formats.nodes import REBUILD_QTENSOR, StorageRef, TensorNode
from ckptool.model.nonstrided import non_strided, refusal
from ckptool.model.paths import get_path
from ckptool.readers import Checkpoint
from ckptool.readers.read_torch import record_reader
from ckptool.torch_ops.cast import torch_dtype
from ckptool.torch_ops.trusted import GUARDED, guarded

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["load_trusted_module", "materialize", "save_safetensors", "save_trusted"]


def materialize(ck: Checkpoint, entries: Sequence[tuple[str, TensorNode]]) -> dict[str, torch.Tensor]:
    """Each ``(key, tensor node)`` of ``ck`` as a contiguous CPU tensor of its dtype and shape, read from its
    storage record (:func:`ckptool.readers.read_torch.record_reader`: one read per storage; tensors sharing a
    storage share that read), byte-swapped as ``torch.load`` swaps it when the file is big-endian.

    Raises:
        UnsupportedError: a quantized tensor (safetensors cannot hold it), a storage without a complete record, a
            dtype this torch lacks.
        CkptError: a truncated storage, or a tensor that does not fit in its storage.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    flat: dict[str, torch.Tensor] = {}
    with record_reader(ck) as read:
        for key, t in entries:
            if t.rebuild_name == REBUILD_QTENSOR:
                found = non_strided(t)
                assert found is not None  # a quantized tensor node is non-strided
                raise UnsupportedError(refusal(
                    ck.path, key, found, "safetensors holds plain strided tensors only",
                    "or write a .pth output (-o NAME.pth), which keeps it as it is"))
            ref: StorageRef | None = t.storage
            if ref is None:
                raise UnsupportedError(f"{key} is not a storage-backed tensor; write a .pth file")
            dtype_name = tensor_dtype(t)
            base = flat.get(ref.key)
            if base is None:
                raw = read(ref)
                base = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                flat[ref.key] = base
            el = DTYPE_SIZES.get(dtype_name, 1)
            typed = base[: len(base) - len(base) % el].view(torch_dtype(dtype_name))
            try:
                out[key] = typed.as_strided(t.shape, t.stride, t.storage_offset).clone(
                    memory_format=torch.contiguous_format)
            except RuntimeError as e:
                raise CkptError(
                    f"{ck.path}: tensor {key} does not fit in its storage ({str(e).strip().splitlines()[0][:300]}); "
                    "the file is damaged") from e
    return out


def save_safetensors(tensors: Mapping[str, torch.Tensor], dst: str, metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` (contiguous, CPU) to safetensors file ``dst`` atomically, its ``__metadata__``
    ``{"format": "pt"}`` plus ``metadata`` (str -> str: a training checkpoint's ``epoch``...); returns the bytes
    written.

    Raises:
        UnsupportedError: safetensors cannot hold them (shared or non-contiguous tensors, an unknown dtype).
        OutputError: as :func:`ckptool._fileio.atomic_output`.
    """
    from safetensors.torch import save

    try:
        data = save(dict(tensors), metadata={**(metadata or {}), "format": "pt"})
    except (ValueError, TypeError, RuntimeError) as e:
        raise UnsupportedError(f"safetensors cannot hold this state_dict ({e}); write a .pth file instead") from e
    with atomic_output(dst) as out:
        out.write(data)
    return len(data)


def load_trusted_module(src: str, key: str | None, device: str) -> nn.Module:
    """``torch.load(src, map_location=device, weights_only=False)`` (runs the file's code: the caller was told to
    trust it) and the ``nn.Module`` in it, at dotted ``key`` (:func:`ckptool.model.paths.get_path`) if given.

    Raises:
        CkptError: the model's classes cannot be imported here.
        UsageError: ``key`` names nothing, or the object is not an ``nn.Module``.
    """
    import torch
    from torch import nn

    try:
        with guarded(src):  # the user passed --trust: classes, never gadgets
            obj = torch.load(src, map_location=device, weights_only=False, pickle_module=GUARDED)
    except CkptError:
        raise
    except (ModuleNotFoundError, AttributeError) as e:
        raise CkptError(f"{src}: loading with --trust needs the model's classes importable here ({e}); run from the "
                        "project that defines them, or extract without --trust") from e
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError) as e:
        raise CorruptCheckpointError(f"{src}: torch.load failed: {str(e).strip()[:300] or type(e).__name__}; the "
                                     "file may be truncated, damaged or not a torch.save file") from e
    module = obj
    if key is not None:
        try:
            module = get_path(obj, key)
        except KeyError:
            raise UsageError(f"{src}: no entry {key!r}; pick the module with --key") from None
    if not isinstance(module, nn.Module):
        raise UsageError(f"{src}: {'the file' if key is None else repr(key)} is not an nn.Module (it is a "
                         f"{type(module).__name__}); pick the module with --key")
    return module


def save_trusted(state_dict: Mapping[str, Any], dst: str, safetensors_out: bool) -> tuple[int, int]:
    """Write a module's ``state_dict()`` to ``dst`` atomically: safetensors (tensors detached, on the CPU,
    contiguous) or ``torch.save``. Returns ``(bytes written, number of distinct storages)``.

    Raises:
        UnsupportedError: safetensors cannot hold the state_dict.
        OutputError: as :func:`ckptool._fileio.atomic_output`.
    """
    import torch

    if safetensors_out:
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
        written = save_safetensors(tensors, dst)
    else:
        with atomic_output(dst) as out:
            torch.save(state_dict, out)
            written = out.tell()
    storages = len({v.untyped_storage().data_ptr() for v in state_dict.values() if isinstance(v, torch.Tensor)})
    return written, storages
