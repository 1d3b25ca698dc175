"""Writing a planned conversion: one file, or a folder of shards plus its index; scratch files beside an output."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator

from ckptool._fileio import TMP_SUFFIX, atomic_output, remove_stale_temps, temp_prefix
from ckptool.errors import UsageError
from ckptool.formats.dtypes import DTYPE_SIZES
from ckptool.formats.sharded import encode_index, index_name, is_set_file, shard_names
from ckptool.ops.convert.plan import Unit, check_safetensors_dtypes, split, union_elements, units
from ckptool.ops.convert.source import ConvertResult, Source, out_dtype
from ckptool.ops.convert.verify import torch_verifier, verify_safetensors
from ckptool.ops.convert.write import Files, archive_name, emit, write_safetensors, write_torch


@contextlib.contextmanager
def scratch_file(near: str) -> Iterator[str]:
    """A temporary file path beside ``near`` (same filesystem), removed afterwards. It is named as
    :func:`ckptool._fileio.atomic_output` names its temporary files, so a run killed outright leaves nothing that
    the next write of ``near`` does not remove (:func:`ckptool._fileio.remove_stale_temps`).

    Raises:
        UsageError: the folder of ``near`` does not exist.
    """
    folder = os.path.dirname(os.path.abspath(near))
    if not os.path.isdir(folder):
        raise UsageError(f"output folder {folder} does not exist; create it first or choose another -o path")
    remove_stale_temps(near)
    fd, p = tempfile.mkstemp(prefix=temp_prefix(near), suffix=TMP_SUFFIX, dir=folder)
    os.close(fd)
    try:
        yield p
    finally:
        with contextlib.suppress(OSError):
            os.unlink(p)


def write_outputs(src: Source, dst: str, fmt_out: str, shard_bytes: int | None, cast: str | None,
                  location: Callable[[str], str], rename_key: Callable[[str], str] | None, verify: bool,
                  progress: Callable[[int, int], None] | None, res: ConvertResult) -> None:
    """Write ``src`` to ``dst`` as ``fmt_out`` (``"safetensors"`` / ``"torch"``), in shards of at most
    ``shard_bytes`` into the folder ``dst`` when given, filling ``res``.

    Raises:
        UnsupportedError: a dtype safetensors cannot hold.
        UsageError: ``dst`` is a file while shards were asked for.
        VerificationError: an output file does not read back as written (it is not kept).
    """
    if fmt_out == "safetensors":
        check_safetensors_dtypes(src.tensors, cast, src.path)
    plan = units(src.tensors, cast)

    def unit_size(u: Unit) -> int:
        if fmt_out == "safetensors":
            return u.stored_bytes()
        return u.storage.numel * DTYPE_SIZES[u.dtype]

    total = sum(unit_size(u) for u in plan)
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    state = src.sd_state if shard_bytes is None else None  # one shard of several carries no _metadata
    files = Files()
    try:
        if shard_bytes is None:
            outputs = [(dst, plan)]
        else:
            if os.path.exists(dst) and not os.path.isdir(dst):
                raise UsageError(f"{dst} is a file; with --max-shard-size, -o names a folder for the shards")
            os.makedirs(dst, exist_ok=True)
            shards = split(plan, shard_bytes, unit_size)
            outputs = [(os.path.join(dst, n), s) for n, s in zip(shard_names(fmt_out, len(shards)), shards)]
        weight_map: dict[str, str] = {}
        for path, us in outputs:
            tensors = sorted((t for u in us for t in u.members), key=lambda t: t.index)
            if fmt_out == "safetensors":
                meta = dict(src.metadata) if src.metadata else None
                w = emit(path, functools.partial(write_safetensors, plan=us, base_meta=meta, files=files, cast=cast,
                                                 progress=tick, res=res, need_crc=verify),
                         verify_safetensors if verify else None)
                names = [t.name for u in us for t in u.stored]
            else:
                w = emit(path, functools.partial(write_torch, tensors=tensors, files=files, cast=cast,
                                                 location=location, archive=archive_name(path), sd_state=state,
                                                 rename_key=rename_key, progress=tick),
                         torch_verifier(cast) if verify else None)
                names = [t.name for t in tensors]
            res.files.append(path)
            res.bytes_written += w.nbytes
            weight_map.update((n, os.path.basename(path)) for n in names)
        res.shards = len(outputs)
        if shard_bytes is not None:
            _finish_folder(dst, fmt_out, [p for p, _u in outputs], weight_map, total, res)
    finally:
        files.close()
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


def _finish_folder(dst: str, fmt_out: str, shards: list[str], weight_map: dict[str, str], total: int,
                   res: ConvertResult) -> None:
    """Write the index (several shards) and remove shards of an earlier run that the new set does not use."""
    keep = {os.path.basename(p) for p in shards}
    if len(shards) > 1:
        index = os.path.join(dst, index_name(fmt_out))
        with atomic_output(index) as f:
            f.write(encode_index(weight_map, total))
        res.files.append(index)
        keep.add(os.path.basename(index))
    stale = [n for n in os.listdir(dst) if is_set_file(n, fmt_out) and n not in keep]
    for n in stale:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(dst, n))
    if stale:
        res.notes.append(f"removed {len(stale)} file(s) of an earlier shard set in {dst}: "
                         f"{', '.join(sorted(stale)[:3])}")
