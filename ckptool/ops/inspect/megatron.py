"""What a Megatron checkpoint folder holds, for ``ckptool inspect``: read without Megatron and without torch, no
tensor data, nothing run (:mod:`ckptool.readers.read_megatron`).

A legacy tree: the iteration, the parallel sizes (TP, PP, EP, virtual chunks) and the ranks present, every tensor of
the consolidated model with its global shape (or, when a tensor has no tensor-parallel rule, every rank's tensors
and why they are not joined), the training arguments (``args``, an ``argparse.Namespace`` read as plain values) and
the other entries. A torch_dist folder: the DCP tensors with their global shapes from ``.metadata``, the
``metadata.json`` backend and ``common.pt``'s entries.
"""

from __future__ import annotations

import json
import os
import shlex

from ckptool.errors import UnsupportedError
from ckptool.formats.dtypes import DTYPE_SIZES, contiguous_stride, numel
from ckptool.formats.tensors import Tensor
from ckptool.ops.inspect.info import CheckpointInfo, GlobalInfo, TensorInfo, rate_globals, state_dict_info
from ckptool.ops.inspect.totals import device_bytes, one_storage_each
from ckptool.ops.inspect.values import PreviewLimits, ValueInfo
from ckptool.readers import Opened
from ckptool.readers.read_megatron import LegacyTree, legacy_source, read_dist, read_legacy

__all__ = ["ARGS_SHOWN", "inspect_dist", "inspect_legacy"]

#: the training arguments ``inspect`` lists in its metadata (all plain ones are in ``values``)
ARGS_SHOWN = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "padded_vocab_size", "seq_length", "max_position_embeddings", "swiglu", "bf16", "fp16",
              "position_embedding_type", "untie_embeddings_and_output_weights", "num_experts",
              "use_distributed_optimizer", "ckpt_format")


def _folder_size(files: list[str]) -> int:
    return sum(os.path.getsize(f) for f in files if os.path.isfile(f))


def _infos(tensors: list[Tensor]) -> list[TensorInfo]:
    return [TensorInfo(t.name, list(t.shape), t.dtype, t.storage.location, numel(t.shape) * DTYPE_SIZES[t.dtype],
                       list(contiguous_stride(t.shape)), 0, t.name) for t in tensors]


def _summary(tensors: list[TensorInfo], path: str, fmt: str, size: int, globs: list[GlobalInfo],
             meta: dict[str, str], values: list[ValueInfo]) -> CheckpointInfo:
    totals = one_storage_each(tensors)
    devices: dict[str, int] = {}
    for t in tensors:
        devices[t.device] = devices.get(t.device, 0) + 1
    return CheckpointInfo(path, fmt, "training_checkpoint", size, tensors, devices, device_bytes(totals),
                          [state_dict_info("", [t.key for t in tensors])], globs, storages=len(tensors),
                          metadata=meta, totals=totals, values=values)


def _legacy_tensors(tree: LegacyTree, meta: dict[str, str]) -> list[TensorInfo]:
    """The consolidated model's tensors; when it cannot be consolidated, every rank's (keyed
    ``mp_rank_XX[_YYY]/model...``) with why in ``meta["consolidation"]``."""
    try:
        return _infos(legacy_source(tree).tensors)
    except UnsupportedError as e:
        meta["consolidation"] = str(e)
    out: list[Tensor] = []
    for s in tree.ranks:
        rank = os.path.basename(os.path.dirname(s.path))
        for ts in s.chunks.values():
            out += [Tensor(f"{rank}/{t.src_name}", t.src_name, t.dtype, t.shape, t.stride, 0, t.storage) for t in ts]
    return _infos(out)


def inspect_legacy(o: Opened, _limits: PreviewLimits | None) -> CheckpointInfo:
    """``ckptool inspect`` of a legacy tree (a describer of :data:`~ckptool.ops.inspect.entry.DESCRIBE`).

    Raises: what :func:`ckptool.readers.read_megatron.read_legacy` raises.
    """
    tree = read_legacy(o.target)
    mf = tree.mf
    meta = {
        "iteration": str(tree.iteration) + (f" (from {os.path.basename(mf.folder)}/)" if mf.top else ""),
        "checkpoint_version": str(tree.checkpoint_version),
        "parallel": f"TP={tree.tp_size} PP={tree.pp_size} EP={tree.ep_size}"
                    + (f" virtual chunks={tree.vp_size}" if tree.vp_size > 1 else ""),
        "ranks": f"{len(tree.ranks)}: {', '.join(r.name for r in mf.ranks[:8])}{' ...' if len(mf.ranks) > 8 else ''}",
        "entries": ", ".join(f"{k} ({v})" for k, v in tree.ranks[0].entries.items()),
        "consolidate": shlex.join(["ckptool", "convert", o.path, "-o", "model.safetensors"]),
    }
    meta.update({f"args.{k}": str(tree.args[k]) for k in ARGS_SHOWN if k in tree.args})
    tensors = _legacy_tensors(tree, meta)
    globs = sorted({g for s in tree.ranks for g in s.globals})
    values = [ValueInfo(f"args.{k}", type(v).__name__, repr(v), v, True) for k, v in tree.args.items()
              if v is None or isinstance(v, (bool, int, float, str))]
    return _summary(tensors, mf.folder, o.format, _folder_size(mf.files), rate_globals(globs), meta, values)


def inspect_dist(o: Opened, _limits: PreviewLimits | None) -> CheckpointInfo:
    """``ckptool inspect`` of a torch_dist folder (a describer of :data:`~ckptool.ops.inspect.entry.DESCRIBE`).

    Raises: what :func:`ckptool.readers.read_megatron.read_dist` raises.
    """
    d = read_dist(o.target)
    mf, dmeta, kept, other = d.mf, d.meta, d.common, d.other
    tensors = [TensorInfo(e.fqn, list(e.shape or ()), e.dtype, "cpu",
                          numel(e.shape or ()) * DTYPE_SIZES.get(e.dtype, 0), list(contiguous_stride(e.shape or ())),
                          0, e.fqn) for e in dmeta.entries if e.dtype is not None]
    meta = {f"backend.{k}": str(v) for k, v in mf.backend.items()}
    if mf.iteration is not None:
        meta["iteration_folder"] = mf.iteration
    meta.update({f"common.{k}": v for k, v in kept.items()})
    if other:
        meta["common.other"] = "; ".join(x.split(": ", 1)[1] for x in other)
    non_tensor = [e.fqn for e in dmeta.entries if e.dtype is None]
    if non_tensor:
        meta["non_tensor_entries"] = ", ".join(non_tensor)
    meta["consolidate"] = shlex.join(["ckptool", "convert", o.path, "-o", "model.safetensors"])
    globs = [*dmeta.globals, *d.common_globals]
    values = [ValueInfo(f"common.{k}", type(json.loads(v)).__name__, v, json.loads(v), True) for k, v in kept.items()]
    files = [os.path.join(mf.folder, n) for n in os.listdir(mf.folder)]
    return _summary(tensors, mf.folder, o.format, _folder_size(files),
                    rate_globals(dict.fromkeys(globs), dcp_metadata=True), meta, values)
