"""Writing a planned conversion: one file, or a set of shards plus its index; scratch files beside an output."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from ckptool.formats.dtypes import DTYPE_SIZES
from ckptool.formats.sharded import output_layout
from ckptool.formats.tensors import Source
from ckptool.ops.convert.plan import Unit, check_safetensors_dtypes, split, union_elements, units
from ckptool.ops.convert.source import ConvertResult, out_dtype
from ckptool.ops.convert.verify import torch_verifier, verification_check, verify_safetensors, with_evidence
from ckptool.ops.convert.write import Files, archive_name, emit, write_safetensors, write_torch
from ckptool.ops.rewrite.set_writer import write_set
from ckptool.ops.rewrite.stream import ProgressFn, announce_total


def write_outputs(src: Source, dst: str, fmt_out: str, shard_bytes: int | None, cast: str | None,
                  location: Callable[[str], str], rename_key: Callable[[str], str] | None, verify: bool,
                  progress: ProgressFn | None, res: ConvertResult) -> None:
    """Write ``src`` to ``dst`` as ``fmt_out`` (``"safetensors"`` / ``"torch"``), filling ``res``: one file, or with
    ``shard_bytes`` a set of shards of at most that many bytes each (:func:`ckptool.formats.sharded.output_layout`:
    beside ``dst`` when it is named ``NAME.safetensors`` / ``.bin`` / ``.pt`` / ``.pth``, else in the folder
    ``dst``), written as :func:`write_set` describes.

    Raises:
        UnsupportedError: a dtype safetensors cannot hold.
        UsageError: a file set named by a bare suffix; a folder output that is a file; a file of the output set
            that is an input or a directory; a missing output folder.
        OutputError: writing or renaming an output file failed.
        VerificationError: an output file does not read back as written (nothing of the run is kept).
    """
    if fmt_out == "safetensors":
        check_safetensors_dtypes(src.tensors, cast, src.path)
    plan = units(src.tensors, cast)

    def unit_size(u: Unit) -> int:
        if fmt_out == "safetensors":
            return u.stored_bytes()
        return u.storage.numel * DTYPE_SIZES[u.dtype]

    total = sum(unit_size(u) for u in plan)
    announce_total(progress, total)

    def tick(n: int) -> None:
        if progress is not None:
            progress(n)

    groups = [plan] if shard_bytes is None else split(plan, shard_bytes, unit_size)
    state = src.sd_state if len(groups) == 1 else None  # one shard of several carries no _metadata
    weight_map: dict[str, str] = {}
    files = Files()
    files.evidence.expect_records(t.storage for t in src.tensors)

    def write(path: str, final: str, us: list[Unit]) -> None:
        """Write the units ``us`` into ``path``, the bytes of the output file ``final``."""
        tensors = sorted((t for u in us for t in u.members), key=lambda t: t.index)
        if fmt_out == "safetensors":
            meta = dict(src.metadata) if src.metadata else None
            w = emit(path, functools.partial(write_safetensors, plan=us, base_meta=meta, files=files, cast=cast,
                                             progress=tick, res=res, need_crc=verify),
                     with_evidence(files.evidence, verify_safetensors) if verify else None)
            names = [t.name for u in us for t in u.stored]
        else:
            w = emit(path, functools.partial(write_torch, tensors=tensors, files=files, cast=cast,
                                             location=location, archive=archive_name(final), sd_state=state,
                                             rename_key=rename_key, progress=tick),
                     with_evidence(files.evidence, torch_verifier(cast)) if verify else None)
            names = [t.name for t in tensors]
        res.bytes_written += w.nbytes
        weight_map.update((n, os.path.basename(final)) for n in names)

    try:
        if shard_bytes is None:
            write(dst, dst, plan)
            res.files.append(dst)
        else:
            inputs = list(dict.fromkeys([src.path, *(t.storage.path for t in src.tensors)]))
            write_set(output_layout(dst, fmt_out), groups, write, inputs, weight_map, total, res, dst)
    finally:
        files.close()
    res.shards = len(groups)
    res.tensors = len(src.tensors)
    res.stored = sum(len(u.stored) for u in plan) if fmt_out == "safetensors" else len(src.tensors)
    if fmt_out == "safetensors":  # torch output copies whole storages
        res.trimmed_bytes = sum(u.storage.nbytes - union_elements(u.members) * DTYPE_SIZES[u.storage.dtype]
                                for u in plan)
    for t in src.tensors:
        out = out_dtype(t.dtype, cast)
        if out != t.dtype:
            k = f"{t.dtype}->{out}"
            res.cast[k] = res.cast.get(k, 0) + 1
    if verify:
        res.verified = True
        res.checked = verification_check(fmt_out, {out_dtype(t.dtype, cast) for t in src.tensors},
                                         files.evidence.summary())
