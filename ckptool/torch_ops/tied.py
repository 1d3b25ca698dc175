"""Tied weights: the shared storages a safetensors file records, restored as shared tensors, and the model entries
that need no value of their own because they share storage with a loaded one.

safetensors stores each tensor on its own, so ``ckptool convert`` and ``safetensors.torch.save_model`` store a
tied weight once and record the dropped name in ``__metadata__`` (:mod:`ckptool.formats.safetensors`).
:func:`restore_shared` gives the dropped names back, as views of the same storage, so a strict
``load_state_dict`` finds every key. :func:`tied_entries` is the model-side rule of safetensors'
``load_model`` (``_remove_duplicate_names``): a model entry absent from the checkpoint is *tied*, not missing,
when its tensor lies inside a loaded contiguous entry of the same storage (``lm_head.weight`` is
``embed.weight``).

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ckptool.formats.dtypes import contiguous_stride
from ckptool.readers.structures import SHARED_KEY, SafetensorsHeader, decode_shared
from ckptool.torch_ops.cast import torch_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["restore_shared", "tied_entries"]


def restore_shared(tensors: Mapping[str, torch.Tensor], header: SafetensorsHeader, path: str
                   ) -> dict[str, torch.Tensor]:
    """``tensors`` (what ``safetensors.torch.load_file`` returned for the file at ``path``, whose parsed header is
    ``header``) with the sharing recorded in ``__metadata__`` restored.

    Each group of :data:`~ckptool.formats.safetensors.SHARED_KEY` becomes one storage (the stored tensor itself
    when it covers the group, else a new one on the tensors' device that the stored views are copied into) and
    every member, aliases included, a view of it with its recorded offset, shape and stride, at its recorded
    position in the state_dict. Then every ``__metadata__[alias] = kept`` item
    (:meth:`~ckptool.formats.safetensors.SafetensorsHeader.aliases`, the convention of
    ``safetensors.torch.save_model``) not restored yet adds ``alias`` as the kept tensor object itself. Stored
    tensors keep the header's order.

    Raises:
        CorruptCheckpointError: the :data:`SHARED_KEY` record is inconsistent with the stored tensors.
        UnsupportedError: a group's dtype is not available in this torch.
    """
    order = [n for n in header.entries if n in tensors]
    out = {n: tensors[n] for n in order}
    raw = (header.metadata or {}).get(SHARED_KEY)
    aliases: list[tuple[int, str]] = []
    for g in decode_shared(raw, path, header.entries) if raw is not None else []:
        stored = [(n, v) for n, v in g.tensors.items() if n in tensors]
        first, v0 = stored[0]
        t0 = tensors[first]
        if len(stored) == 1 and v0.offset == 0 and t0.numel() == g.numel and v0.stride == contiguous_stride(v0.shape):
            base = t0.reshape(-1)  # the common case (a tied weight): a view of the stored tensor, no copy
        else:
            import torch

            base = torch.empty(g.numel, dtype=torch_dtype(g.dtype), device=t0.device)
            for n, v in stored:
                base.as_strided(v.shape, v.stride, v.offset).copy_(tensors[n])
        for n, v in g.tensors.items():
            out[n] = base.as_strided(v.shape, v.stride, v.offset)
            if n not in tensors:
                aliases.append((v.index, n))
    for idx, n in sorted(aliases):  # back at their places in the state_dict order
        order.insert(min(max(idx, 0), len(order)), n)
    for alias, kept in header.aliases().items():
        if alias not in out:
            out[alias] = out[kept]
            order.append(alias)
    return {n: out[n] for n in order}


def _area(t: Any) -> tuple[tuple[str, int, int], int, int] | None:
    """``((device, storage address, storage bytes), first byte, end byte)`` of a strided tensor with data, else
    None (meta, sparse, quantized and empty tensors share nothing that matters here)."""
    import torch

    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    if t.numel() == 0 or min(t.stride(), default=0) < 0:
        return None
    try:
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr(), st.nbytes())
    except (RuntimeError, NotImplementedError):
        return None
    if key[1] == 0 or key[2] == 0:
        return None
    reach = sum((s - 1) * d for s, d in zip(t.shape, t.stride())) + 1
    return key, t.data_ptr(), t.data_ptr() + reach * t.element_size()


def tied_entries(model_sd: Mapping[str, Any], missing: Iterable[str], loaded: Iterable[str]) -> dict[str, str]:
    """``{missing key: loaded key}`` for the model entries of ``missing`` that share storage with a loaded entry:
    the loaded entry's tensor in ``model_sd`` (the model's ``state_dict()``) is contiguous, on the same storage
    (device, ``untyped_storage().data_ptr()``, size) and its bytes cover the missing entry's, so loading it gave the
    missing entry its values too (safetensors' ``_find_shared_tensors`` / ``_is_complete`` rule). Entries shown by
    the model as ``lm_head.weight`` and ``embed.weight`` of one ``Parameter`` are the usual case."""
    keepers: dict[tuple[str, int, int], list[tuple[int, int, str]]] = {}
    for k in loaded:
        t = model_sd.get(k)
        a = _area(t)
        if a is not None and t is not None and t.is_contiguous():
            keepers.setdefault(a[0], []).append((a[1], a[2], k))
    out: dict[str, str] = {}
    for m in missing:
        a = _area(model_sd.get(m))
        if a is None:
            continue
        key, lo, hi = a
        kept = next((name for start, end, name in keepers.get(key, []) if start <= lo and hi <= end), None)
        if kept is not None:
            out[m] = kept
    return out
