"""Writing a planned conversion: one file, or a set of shards plus its index, in each output format's own way
(:data:`WRITERS`, keyed by :class:`~ckptool.ops.convert.source.OutputFormat`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptool.formats.dtypes import DTYPE_SIZES
from ckptool.formats.tensors import Source
from ckptool.model.casts import total_count
from ckptool.ops.convert.plan import Unit, check_safetensors_dtypes, split, union_elements, units
from ckptool.ops.convert.report import ConvertResult
from ckptool.ops.convert.source import OutputFormat, out_dtype
from ckptool.ops.convert.verify import torch_verifier, verification_check, verify_safetensors, with_evidence
from ckptool.ops.convert.write import Files, Written, archive_name, emit, write_safetensors, write_torch
from ckptool.ops.rewrite.parallel import current_executor, locked
from ckptool.ops.rewrite.set_writer import write_set
from ckptool.ops.rewrite.stream import ProgressFn, announce_total
from ckptool.writers.encoders import output_layout


@dataclass
class Job:
    """One conversion being written: the ``src`` tensors, their ``cast``, the torch output's ``location`` and
    ``rename_key`` (for ``_metadata``), the selected state_dict's BUILD ``state`` (None for several shards: one shard
    of several carries no ``_metadata``), whether to ``verify``, the ``progress`` callback, the ``files`` read and
    the ``res`` filled."""

    src: Source
    cast: str | None
    location: Callable[[str], str]
    rename_key: Callable[[str], str] | None
    verify: bool
    progress: ProgressFn | None
    res: ConvertResult
    files: Files = field(default_factory=Files)
    state: dict[str, object] | None = None
    entries: dict[str, object] | None = None
    allow_overflow: bool = False

    def tick(self, n: int) -> None:
        """Report ``n`` more bytes written."""
        if self.progress is not None:
            self.progress(n)


def _write_safetensors_file(job: Job, path: str, final: str, us: list[Unit]) -> tuple[Written, list[str]]:
    """Write the units ``us`` as one safetensors file at ``path``: what was written, and the names stored."""
    meta = dict(job.src.metadata) if job.src.metadata else None
    check = with_evidence(job.files.evidence, verify_safetensors) if job.verify else None
    w = emit(path, functools.partial(write_safetensors, plan=us, base_meta=meta, files=job.files, cast=job.cast,
                                     progress=job.tick, res=job.res, need_crc=job.verify,
                                     allow_overflow=job.allow_overflow), check)
    return w, [t.name for u in us for t in u.stored]


def _write_torch_file(job: Job, path: str, final: str, us: list[Unit]) -> tuple[Written, list[str]]:
    """Write the tensors of ``us`` as one torch zip file at ``path`` (its records named after ``final``): what was
    written, and the names stored."""
    tensors = sorted((t for u in us for t in u.members), key=lambda t: t.index)
    check = with_evidence(job.files.evidence, torch_verifier(job.cast)) if job.verify else None
    w = emit(path, functools.partial(write_torch, tensors=tensors, files=job.files, cast=job.cast,
                                     location=job.location, archive=archive_name(final), sd_state=job.state,
                                     rename_key=job.rename_key, progress=job.tick, entries=job.entries,
                                     allow_overflow=job.allow_overflow, where=job.res.src or job.src.path), check)
    return w, [t.name for t in tensors]


def _safetensors_tally(plan: list[Unit], src: Source) -> tuple[int, int]:
    """``(tensors stored, storage bytes no tensor reaches)``: safetensors stores each reach of a storage once."""
    trimmed = sum(u.storage.nbytes - union_elements(u.members) * DTYPE_SIZES[u.storage.dtype] for u in plan)
    return sum(len(u.stored) for u in plan), trimmed


def _torch_tally(plan: list[Unit], src: Source) -> tuple[int, int]:
    """``(tensors stored, 0)``: torch output stores every tensor over a copy of its whole storage."""
    return len(src.tensors), 0


def _safetensors_size(u: Unit) -> int:
    return u.stored_bytes()


def _torch_size(u: Unit) -> int:
    return u.storage.numel * DTYPE_SIZES[u.dtype]


def _no_refusal(src: Source, cast: str | None) -> None:
    return None


def _safetensors_refusal(src: Source, cast: str | None) -> None:
    check_safetensors_dtypes(src.tensors, cast, src.path)


@dataclass(frozen=True)
class Writer:
    """How one output format is written: ``refuse`` (raise before writing what it cannot hold), ``unit_size`` (the
    output bytes of a storage's unit), ``write_file`` (one file of units, returning what was written and the names
    it stores), ``tally`` (tensors stored, storage bytes left out)."""

    refuse: Callable[[Source, str | None], None]
    unit_size: Callable[[Unit], int]
    write_file: Callable[[Job, str, str, list[Unit]], tuple[Written, list[str]]]
    tally: Callable[[list[Unit], Source], tuple[int, int]]


#: the writer of each output format ckptool writes itself (DCP output is written by torch: ``convert.dcp``)
WRITERS: dict[OutputFormat, Writer] = {
    OutputFormat.SAFETENSORS: Writer(_safetensors_refusal, _safetensors_size, _write_safetensors_file,
                                     _safetensors_tally),
    OutputFormat.TORCH: Writer(_no_refusal, _torch_size, _write_torch_file, _torch_tally),
}


def _entries(src: Source, fmt_out: OutputFormat, files: int, res: ConvertResult) -> dict[str, object] | None:
    """The plain entries of ``src`` the output holds: all of them in one file of a format that holds non-tensor
    entries (the writers registry), none in shards (with a note) or in a format of tensors only."""
    if not src.entries or not fmt_out.writer.non_tensor_entries:
        return None
    if files > 1:
        res.notes.append(f"the plain entries ({', '.join(src.entries)}) are not written into shards, which hold "
                         "tensors only; write one file to keep them")
        return None
    return src.entries


def _task_job(job: Job, us: list[Unit]) -> Job:
    """``job`` for one task of a parallel write (:mod:`ckptool.ops.rewrite.parallel`): its own source files (one
    file position per thread), its own evidence (held to the records of ``us``) and its own result lists, merged in
    shard order afterwards (:func:`_merge_tasks`), so that the result reads as the serial run's."""
    mine = dataclasses.replace(job, files=Files(), res=ConvertResult("", "", "", ""))
    mine.files.evidence.expect_records(t.storage for u in us for t in u.members)
    return mine


def _merge_tasks(job: Job, tasks: list[Job]) -> None:
    """Add what the ``tasks`` of a parallel write found (shard order) to ``job``: the layouts made contiguous, the
    aliases, the evidence compared."""
    for t in tasks:
        job.res.made_contiguous += t.res.made_contiguous
        job.res.aliases.update(t.res.aliases)
        job.files.evidence.merge(t.files.evidence)
        job.files.cast_counts.update(t.files.cast_counts)


def write_outputs(src: Source, dst: str, fmt_out: OutputFormat | str, shard_bytes: int | None, cast: str | None,
                  location: Callable[[str], str], rename_key: Callable[[str], str] | None, verify: bool,
                  progress: ProgressFn | None, res: ConvertResult,
                  companions: Sequence[tuple[str, str]] = (), allow_overflow: bool = False) -> None:
    """Write ``src`` to ``dst`` as ``fmt_out`` (:attr:`OutputFormat.SAFETENSORS` or :attr:`OutputFormat.TORCH`, or
    its value: :data:`WRITERS`), filling ``res``: one file,
    or with ``shard_bytes`` a set of shards of at most that many bytes each
    (:func:`ckptool.formats.sharded.output_layout`: beside ``dst`` when it is named ``NAME.safetensors`` / ``.bin``
    / ``.pt`` / ``.pth``, else in the folder ``dst``), written as :func:`write_set` describes, with ``companions``
    (source path, file name) copied into the set's folder in the same commit (``merge-lora``'s model folders).
    Inside a :func:`ckptool.ops.rewrite.parallel.shard_executor` block (``convert --jobs N``) the shards are written
    one per task, each task with its own source files; the index is written last, by this thread. ``cast`` fills
    the cast report (:func:`_cast_report`); a file whose cast made inf / NaN is refused unless ``allow_overflow``.

    Raises:
        UnsupportedError: a dtype safetensors cannot hold; a cast making inf / NaN (not ``allow_overflow``).
        UsageError: a file set named by a bare suffix; a folder output that is a file; a file of the output set
            that is an input or a directory; a missing output folder.
        OutputError: writing or renaming an output file failed.
        VerificationError: an output file does not read back as written (nothing of the run is kept).
    """
    fmt_out = OutputFormat(fmt_out)
    writer = WRITERS[fmt_out]
    writer.refuse(src, cast)
    plan = units(src.tensors, cast)
    total = sum(writer.unit_size(u) for u in plan)
    announce_total(progress, total)
    groups = [plan] if shard_bytes is None else split(plan, shard_bytes, writer.unit_size)
    pool = current_executor() if shard_bytes is not None and len(groups) > 1 else None
    job = Job(src, cast, location, rename_key, verify, locked(progress) if pool else progress, res,
              state=src.sd_state if len(groups) == 1 else None, entries=_entries(src, fmt_out, len(groups), res),
              allow_overflow=allow_overflow)
    job.files.evidence.expect_records(t.storage for t in src.tensors)
    weight_map: dict[str, str] = {}
    done: dict[int, Job] = {}  # id(group) -> the job that wrote it
    lock = threading.Lock()

    def write(path: str, final: str, us: list[Unit]) -> None:
        """Write the units ``us`` into ``path``, the bytes of the output file ``final``."""
        mine = job if pool is None else _task_job(job, us)
        try:
            w, names = writer.write_file(mine, path, final, us)
        finally:
            if mine is not job:
                mine.files.close()
        with lock:
            res.bytes_written += w.nbytes
            weight_map.update((n, os.path.basename(final)) for n in names)
            done[id(us)] = mine

    try:
        if shard_bytes is None:
            write(dst, dst, plan)
            res.files.append(dst)
        else:
            inputs = list(dict.fromkeys([src.path, *(t.storage.path for t in src.tensors)]))
            write_set(output_layout(dst, fmt_out.value), groups, write, inputs, weight_map, total, res, dst,
                      companions=companions, pool=pool)
            if pool is not None:
                _merge_tasks(job, [done[id(g)] for g in groups])
    finally:
        job.files.close()
    res.shards = len(groups)
    res.tensors = len(src.tensors)
    res.stored, res.trimmed_bytes = writer.tally(plan, src)
    _cast_report(src, cast, job.files, res)
    if verify:
        res.verified = True
        res.checked = verification_check(fmt_out, {out_dtype(t.dtype, cast) for t in src.tensors},
                                         job.files.evidence.summary())


def _cast_report(src: Source, cast: str | None, files: Files, res: ConvertResult) -> None:
    """Fill ``res.cast`` (``"float32->float16": tensors``; a dequantized weight counted from its stored dtype),
    ``res.cast_values`` (the first tensor of each cast storage -> its :class:`~ckptool.model.casts.CastCount`, in
    state_dict order) and ``res.cast_total`` from what the writers counted."""
    for t in src.tensors:
        out = out_dtype(t.dtype, cast)
        scaled = t.storage.scaled
        if out != t.dtype or scaled is not None:
            k = f"{scaled.weight.dtype if scaled else t.dtype}->{out}"
            res.cast[k] = res.cast.get(k, 0) + 1
    seen: set[int] = set()
    for t in src.tensors:
        got = files.cast_counts.get(id(t.storage))
        if got is not None and id(t.storage) not in seen:
            seen.add(id(t.storage))
            res.cast_values[t.name] = got[1]
    res.cast_total = total_count(res.cast_values)
