"""What a DeepSpeed ZeRO checkpoint folder holds, for ``ckptool inspect``: read without deepspeed, no tensor data.

:func:`describe_deepspeed` reads the folder's pickles (:func:`ckptool.model.zero.read_zero`) and the consolidation
plan (:func:`ckptool.model.zero.plan`), and says: the ZeRO stage, the data-parallel world size, the DeepSpeed
version, the dtype of the saved weights and of the fp32 master copy, every tensor of the consolidated state_dict
(parameters with their shapes, buffers, frozen parameters, tied names), the optimizer state the files hold, and
the exact command that consolidates it (:func:`consolidate_command`).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from ckptool.formats.nodes import qualified_name
from ckptool.model.zero import ZeroCheckpoint, ZeroTensor, plan
from ckptool.readers import Opened, open_checkpoint

__all__ = ["DeepSpeedSummary", "consolidate_command", "describe_deepspeed"]


@dataclass
class DeepSpeedSummary:
    """The result of :func:`describe_deepspeed`: ``zero`` (what the pickles say), ``tensors`` (the consolidated
    state_dict, :class:`~ckptool.model.zero.ZeroTensor`), ``metadata`` (the report lines as strings, the
    ``metadata`` of ``ckptool inspect --json``), ``size`` (bytes of the tag folder's files), ``globals``
    (``module.name`` the pickles name)."""

    path: str
    zero: ZeroCheckpoint
    tensors: list[ZeroTensor]
    metadata: dict[str, str]
    size: int
    globals: list[str] = field(default_factory=list)


def consolidate_command(path: str, tag: str | None = None, output: str = "model.safetensors") -> str:
    """``ckptool convert PATH -o model.safetensors`` (with ``--tag TAG`` when given), shell-quoted."""
    cmd = ["ckptool", "convert", path, "-o", output]
    if tag is not None:
        cmd += ["--tag", tag]
    return shlex.join(cmd)


def _names(items: list[str], limit: int = 12) -> str:
    more = f" ... ({len(items)} in all)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more if items else "none"


def describe_deepspeed(path: str | os.PathLike[str] | Opened, tag: str | None = None) -> DeepSpeedSummary:
    """Describe the DeepSpeed checkpoint at ``path`` (a top folder with ``latest``, or a tag folder; or opened
    already: its pickles are read once, by :meth:`ckptool.readers.Opened.zero`) without importing deepspeed or torch
    and without reading tensor data.

    Raises:
        UsageError / CorruptCheckpointError / UnsupportedError: see :func:`ckptool.model.zero.read_zero` and
            :func:`ckptool.model.zero.plan`.
    """
    o = path if isinstance(path, Opened) else open_checkpoint(path)
    p = o.target
    z = o.zero(tag)
    tensors = plan(z)
    kinds: dict[str, list[str]] = {}
    for t in tensors:
        kinds.setdefault(t.kind, []).append(t.name)
    params = kinds.get("param", [])
    meta = {
        "deepspeed_version": z.ds_version or "not recorded",
        "zero_stage": str(z.stage),
        "world_size": str(z.world_size),
        "tag": z.ds.tag + ("" if tag is not None or z.ds.top is None else " (from 'latest')"),
        "weights_dtype": z.weights_dtype or "unknown (ZeRO-3 keeps no weights in the model states)",
        "master_dtype": z.master_dtype,
        "parameters": f"{len(params)} trainable in {len(z.param_shapes)} group(s), fp32 master copy partitioned "
                      f"over {z.world_size} rank(s)",
        "frozen": _names(kinds.get("frozen", [])),
        "buffers": _names(kinds.get("buffer", [])),
        "tied": _names([f"{t.name} -> {t.tied_to}" for t in tensors if t.tied_to is not None]),
        "optimizer_state": (f"{', '.join(z.optimizer_state)} (partitioned, fp32; not carried by convert)"
                            if z.optimizer_state else "none"),
        "files": f"{len(z.ds.model_files)} model-state, {len(z.ds.optim_files)} optimizer-state",
        "consolidate": consolidate_command(p, tag),
    }
    if z.uncovered:
        meta["not_consolidated"] = (f"{_names(z.uncovered)}: saved only as module weights, not in the fp32 state "
                                    "(zero_to_fp32 leaves them out too)")
    if z.ds.top is not None and len(z.ds.tags) > 1:
        meta["tags"] = _names(z.ds.tags)
    size = sum(os.path.getsize(f) for f in z.ds.files)
    globs = [qualified_name(m, n) for m, n in z.globals]
    return DeepSpeedSummary(p, z, tensors, meta, size, globs)
