"""``ckptool.merge_lora``: a PEFT LoRA adapter merged into its base checkpoint, one weight at a time, without PEFT.

The base is any checkpoint ckptool reads (:func:`ckptool.readers.open_checkpoint`: a transformers folder, a sharded
set, a torch file, safetensors, a DCP folder...); the adapter is a PEFT adapter folder, read as data
(:mod:`ckptool.ops.merge.adapter`). Each LoRA module's target ``<module>.weight`` is matched to a base key: the
adapter's ``base_model.model.`` prefix removed, then exactly, else by the prefix reconciliation ``load_into`` uses
(:func:`ckptool.model.keys.reconcile`: ``transformer.h.0...`` onto a bare ``h.0...``); a target that matches no base
key is an error naming it.

Streaming: the base tensors an adapter changes are read one at a time with their ``A`` and ``B``, merged
(:func:`ckptool.torch_ops.merge.add_lora_delta`) and written to a scratch file beside the output; every other
tensor is copied from the base files by ``convert``'s writer (:func:`ckptool.ops.convert.outputs.write_outputs`),
which writes the output: ``.safetensors``, a torch zip file (``.pt`` / ``.pth`` / ``.bin``), or a folder
(``model.safetensors``, shards with ``max_shard_size``) holding the base folder's companion files
(``config.json``, tokenizer files: :mod:`ckptool.ops.rewrite.companions`). Memory: a few blocks of rows of the
weight being merged (:func:`ckptool.torch_ops.merge.lora_blocks`; the whole weight where it is not one contiguous
range of a file), and ``A`` and ``B``, not the model.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from ckptool._fileio import same_file
from ckptool.errors import UnsupportedError, UsageError
from ckptool.formats.dtypes import contiguous_stride, element_size
from ckptool.formats.tensors import Source, Storage, Tensor, is_contiguous
from ckptool.model.keys import reconcile
from ckptool.model.units import plural, wrote_line
from ckptool.ops.convert import ConvertResult
from ckptool.ops.convert.outputs import write_outputs
from ckptool.ops.convert.plan import check_safetensors_dtypes
from ckptool.ops.convert.source import OutputFormat, parse_size
from ckptool.ops.merge.adapter import Adapter, LoraPair, group_tensors, read_adapter_config, weights_file
from ckptool.ops.rewrite.companions import model_folder_of, source_companions
from ckptool.ops.rewrite.set_writer import scratch_file
from ckptool.ops.rewrite.stream import ProgressFn
from ckptool.readers import open_checkpoint
from ckptool.readers.data import FileRanges, read_range, read_storage
from ckptool.readers.structures import gather
from ckptool.torch_ops.merge import add_lora_delta, lora_blocks, release_freed_memory
from ckptool.writers import resolve_output, suffix_writer

__all__ = ["MergeLoraResult", "merge_lora"]

PathArg = str | os.PathLike[str]


@dataclass
class MergeLoraResult:
    """What :func:`merge_lora` wrote: ``dst`` (a file, or the output folder), ``format_out`` (``safetensors`` /
    ``torch``), the ``base`` and its ``format_in``, the ``adapter`` folder, ``merged`` (base key -> scaling of each
    weight merged), ``copied`` (base keys replaced by the adapter's ``modules_to_save`` tensors), ``renamed``
    (adapter name -> base key, where they differ beyond the ``base_model.model.`` prefix), ``tensors`` in the
    output, ``files`` written, ``kept`` (companion files copied into an output folder), ``bytes_written``,
    ``notes``."""

    dst: str
    format_out: str
    base: str
    format_in: str
    adapter: str
    merged: dict[str, float] = field(default_factory=dict)
    copied: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)
    tensors: int = 0
    files: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    bytes_written: int = 0
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        """What ``ckptool merge-lora`` prints (before its load hint)."""
        scalings = sorted(set(self.merged.values()))
        shown = ", ".join(f"{s:.6g}" for s in scalings[:4]) + (" ..." if len(scalings) > 4 else "")
        lines = [(f"Merged {plural(len(self.merged), 'LoRA weight')} of {self.adapter} into {self.base} "
                  f"(W + scaling * B @ A in float32, cast back to W's dtype; scaling {shown})")]
        if self.copied:
            lines.append(f"Replaced by the adapter's modules_to_save: {', '.join(self.copied)}")
        if self.renamed:
            first = next(iter(self.renamed.items()))
            lines.append(f"Adapter keys matched to base keys by prefix: {plural(len(self.renamed), 'key')} "
                         f"({first[0]} -> {first[1]} ...)")
        if self.kept:
            lines.append(f"kept: {', '.join(self.kept)}")
        lines += [f"Note: {note}" for note in self.notes]
        lines.append(wrote_line(self.dst, self.bytes_written, plural(self.tensors, "tensor")))
        return "\n".join(lines)


def _read_adapter(folder: str) -> Adapter:
    """The adapter folder as :class:`Adapter` (config checked, tensors grouped)."""
    config = read_adapter_config(folder)
    path = weights_file(folder)
    src = open_checkpoint(path).state_dict()
    pairs, copies = group_tensors(config, src.tensors, path)
    if not pairs and not copies:
        raise UnsupportedError(f"{path} holds no LoRA tensors; nothing to merge")
    return Adapter(folder, config, path, pairs, copies)


def _match(names: list[str], base: dict[str, Tensor], where: str) -> dict[str, str]:
    """Adapter name (without ``base_model.model.``) -> base key: exact, else reconciled by prefix.

    Raises:
        UnsupportedError: a name that matches no base key, named.
    """
    out = {n: n for n in names if n in base}
    rest = [n for n in names if n not in base]
    if rest:
        rec = reconcile(rest, list(base))
        out.update((n, rec.mapping[n]) for n in rest if rec.mapping[n] in base)
    missing = [n for n in names if n not in out]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UnsupportedError(f"the adapter changes {missing[0]!r}{more}, which {where} has no key for; is this "
                               "the base model the adapter was trained on? (`ckptool inspect BASE` lists its keys)")
    if len(set(out.values())) != len(out):
        raise UnsupportedError(f"two adapter keys match one key of {where}; the adapter does not fit this base")
    return out


def tensor_bytes(t: Tensor, files: FileRanges) -> bytearray:
    """The elements of ``t`` in row-major order (little-endian, its dtype), read from its files."""
    esize = element_size(t.dtype)
    st = t.storage
    if st.pieces is None and is_contiguous(t.shape, t.stride):
        data = read_range(st, t.offset * esize, t.numel * esize, files.read)
        return data if isinstance(data, bytearray) else bytearray(data)
    whole = read_storage(st, files=files)
    return bytearray(b"".join(gather(whole, esize, t.offset, t.shape, t.stride)))


def _weight_blocks(t: Tensor, files: FileRanges) -> Iterator[tuple[bytearray, tuple[int, int] | None]]:
    """The bytes of ``t`` (row-major) a block of rows at a time (:func:`lora_blocks`) where it is one contiguous
    range of a file, else whole (``None``: every row)."""
    st, esize = t.storage, element_size(t.dtype)
    if st.pieces is not None or len(t.shape) != 2 or not is_contiguous(t.shape, t.stride):
        yield tensor_bytes(t, files), None
        return
    row = t.shape[1] * esize
    for i, j in lora_blocks(t.shape):
        data = read_range(st, t.offset * esize + i * row, (j - i) * row, files.read)
        yield (data if isinstance(data, bytearray) else bytearray(data)), (i, j)


def _merged_tensor(t: Tensor, pair: LoraPair, files: FileRanges, scratch_path: str, scratch: object) -> Tensor:
    """``t`` merged with ``pair``, written at the end of ``scratch`` a block of rows at a time; the output tensor
    (a view of it)."""
    a, b = tensor_bytes(pair.a, files), tensor_bytes(pair.b, files)
    offset, crc = scratch.tell(), 0  # type: ignore[attr-defined]
    for w, rows in _weight_blocks(t, files):
        try:
            add_lora_delta(w, t.dtype, t.shape, a, pair.a.dtype, pair.a.shape, b, pair.b.dtype, pair.b.shape,
                           pair.scaling, pair.transposed, rows)
        except UnsupportedError as e:
            hint = " (fan_in_fan_out in adapter_config.json?)" if "shape" in str(e) else ""
            raise UnsupportedError(f"{t.name!r}: {e}{hint}") from None
        scratch.write(w)  # type: ignore[attr-defined]
        crc = zlib.crc32(w, crc)
    nbytes = t.numel * element_size(t.dtype)
    st = Storage(scratch_path, offset, nbytes, t.dtype, "cpu", crc)
    return Tensor(t.name, t.name, t.dtype, t.shape, contiguous_stride(t.shape), 0, st, t.requires_grad, t.index)


def _check_unshared(base: Source, keys: set[str]) -> None:
    """Raises UnsupportedError when a weight to merge shares its storage with another base tensor (tied)."""
    users: dict[int, list[str]] = {}
    for t in base.tensors:
        users.setdefault(id(t.storage), []).append(t.name)
    for t in base.tensors:
        if t.name in keys and len(users[id(t.storage)]) > 1:
            others = [n for n in users[id(t.storage)] if n != t.name]
            raise UnsupportedError(f"{t.name!r} shares its storage with {others[0]!r} (tied weights); merging one "
                                   "would untie them. Merge with PEFT, or untie them first (`ckptool convert`)")


def _check_copy(adapter: Adapter, t: Tensor, c: Tensor) -> None:
    """Raises UnsupportedError when the adapter's copy ``c`` of base tensor ``t`` is of another shape."""
    if c.shape != t.shape:
        raise UnsupportedError(f"{adapter.file}: the adapter's own {t.name!r} (modules_to_save) is {list(c.shape)}, "
                               f"the base's {list(t.shape)}; is this the base the adapter was trained on?")


def _spool(base: Source, adapter: Adapter, targets: dict[str, LoraPair], copies: dict[str, Tensor],
           scratch_path: str, progress: ProgressFn | None) -> list[Tensor]:
    """The output tensors: merged weights computed into ``scratch_path``, copies, the rest as in the base."""
    out = []
    with FileRanges() as files, open(scratch_path, "w+b") as scratch:
        for t in base.tensors:
            pair = targets.get(t.name)
            if t.name in copies:
                _check_copy(adapter, t, copies[t.name])
            if pair is not None:
                w = replace(copies[t.name], name=t.name, index=t.index) if t.name in copies else t
                out.append(_merged_tensor(w, pair, files, scratch_path, scratch))
                release_freed_memory(t.numel * element_size(t.dtype))
                if progress is not None:
                    progress(t.numel * element_size(t.dtype))
            elif t.name in copies:
                out.append(replace(copies[t.name], name=t.name, index=t.index))
            else:
                out.append(t)
        scratch.flush()
        os.fsync(scratch.fileno())
    return out


def _output(dst: str, max_shard_size: int | str | None, base_is_folder: bool
            ) -> tuple[OutputFormat, int | None, bool]:
    """The output format, shard size and whether ``dst`` is a folder (see :func:`merge_lora`), as the writers'
    resolver decides them (:func:`ckptool.writers.resolve_output`).

    Raises:
        UsageError: ``dst`` names a DCP output, or a file whose suffix names no format.
    """
    shard = parse_size(max_shard_size) if max_shard_size is not None else None
    if os.path.exists(dst) and not os.path.isdir(dst) and suffix_writer(dst) is None:
        raise UsageError(f"{dst} is a file that is neither .safetensors nor .pt / .pth / .bin; name the output "
                         "NAME.safetensors, NAME.pt, or a folder")
    out = resolve_output(dst, source_is_folder=base_is_folder)
    fmt = OutputFormat(out.writer.name if out.writer is not None else "safetensors")
    if fmt.folder:
        raise UsageError(f"{dst}: merge-lora writes safetensors or torch files, not {fmt.value}")
    if not out.is_folder:
        return fmt, shard, False
    return fmt, shard if shard is not None else sys.maxsize, True


def _companions(base_path: str, base: Source, out_folder: str) -> list[tuple[str, str]] | None:
    """The base folder's companion files to copy into ``out_folder`` (a transformers folder's ``config.json``,
    tokenizer files), with the note of what was left; None when the base is not a folder or an index."""
    folder = model_folder_of(base_path)
    if folder is None:
        return None
    return source_companions(base.path, folder, (t.storage.path for t in base.tensors), out_folder).files


def _refuse_overwrite(out: str, inputs: set[str]) -> None:
    """Raises UsageError when ``out`` is one of the ``inputs``."""
    for p in sorted(inputs):
        if same_file(p, out):
            raise UsageError(f"output {out} is the input {p}; choose another -o path")


def merge_lora(base: PathArg, adapter: PathArg, dst: PathArg, *, key: str | None = None,
               max_shard_size: int | str | None = None, progress: ProgressFn | None = None) -> MergeLoraResult:
    """Merge the PEFT LoRA adapter folder ``adapter`` into the checkpoint ``base`` and write the result to ``dst``:
    one checkpoint that loads without PEFT (``from_pretrained(dst)`` for a folder output).

    For every weight the adapter targets, ``W' = W + scaling * (B @ A)`` (transposed with ``fan_in_fan_out`` and for
    embeddings), ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``; ``rank_pattern`` /
    ``alpha_pattern`` honoured), in float32 and cast back to ``W``'s dtype, operation for operation as PEFT's
    ``merge_and_unload()`` computes it, so with its bits (an adapter saved in float16 / bfloat16 has its delta
    rounded to that dtype before the sum, as PEFT does: :mod:`ckptool.torch_ops.merge`). ``modules_to_save``
    tensors replace the base's; every other
    tensor is copied byte for byte. ``key`` selects the state_dict in a base that holds several (torch files, DCP).

    ``dst``: ``NAME.safetensors``; ``NAME.pt`` / ``.pth`` / ``.bin`` (torch zip, ``torch.load(weights_only=True)``);
    anything else a folder, created, holding ``model.safetensors`` (shards of ``max_shard_size`` and their index
    when given, bytes or ``"2GB"``) and the base folder's companion files, as ``save_pretrained`` writes it.
    ``progress(nbytes)`` is called as merged weights are computed.

    Raises:
        InputNotFoundError: no ``adapter_config.json`` or weights file in ``adapter``.
        UnsupportedError: another PEFT type or a LoRA variant that is not ``W + scaling * B @ A`` (DoRA,
            ``lora_bias``, convolutions...), with the reason; an adapter key that matches no base key (named);
            shapes that do not compose; a merged weight tied to another base tensor; a base format whose tensors
            ckptool does not read.
        UsageError: ``dst`` is the base or an adapter file; a bad ``max_shard_size``.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
        OutputError: the output could not be written (nothing is left behind).
    """
    base_p, adapter_p, out = os.fspath(base), os.fspath(adapter), os.fspath(dst)
    fmt, shard, folder = _output(out, max_shard_size, os.path.isdir(base_p))
    ad = _read_adapter(adapter_p)
    opened = open_checkpoint(base_p)
    src = opened.source(key)
    _refuse_overwrite(out, {base_p, ad.file, *(t.storage.path for t in src.tensors)})
    by_name = {t.name: t for t in src.tensors}
    match = _match([p.target for p in ad.pairs] + list(ad.copies), by_name, base_p)
    targets = {match[p.target]: p for p in ad.pairs}
    copies = {match[n]: t for n, t in ad.copies.items()}
    _check_unshared(src, set(targets))
    if fmt is OutputFormat.SAFETENSORS:
        check_safetensors_dtypes(src.tensors, None, out)
    res = MergeLoraResult(out, fmt.value, base_p, src.format, adapter_p, notes=list(src.notes))
    res.renamed = {n: b for n, b in match.items() if n != b}
    companions = _companions(base_p, src, out) if folder else None
    if not folder and os.path.isdir(base_p):
        res.notes.append("the base folder's config and tokenizer files are not copied beside a single file; "
                         "write to a folder (-o OUT/) to keep them")
    with scratch_file(os.path.normpath(os.path.abspath(out))) as scratch:  # beside the file, or the folder
        tensors = _spool(src, ad, targets, copies, scratch, progress)
        result = Source(out, src.format, tensors, key=src.key, metadata=src.metadata, sd_state=src.sd_state)
        cres = ConvertResult(scratch, out, src.format, fmt.value)
        write_outputs(result, out, fmt, shard, None, lambda _saved: "cpu", None, False, None, cres,
                      companions=companions or ())
    res.merged = {name: p.scaling for name, p in targets.items()}
    res.copied = list(copies)
    res.tensors, res.bytes_written, res.files = len(tensors), cres.bytes_written, list(cres.files)
    res.kept = [name for _p, name in companions or ()]
    if folder:
        res.dst = out
    return res
