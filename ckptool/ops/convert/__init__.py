"""``ckptool.ops.convert``: move a state_dict between torch.save files, safetensors, sharded sets and DCP folders.

One pass from SRC to DST, memory bounded by the largest storage, not by the file:

* **torch -> safetensors.** The pickle is read as a node graph (:meth:`ckptool.readers.Opened.graph`, nothing
  imported or run) and the state_dict is selected (``key``, or found automatically; what else the file
  held, such as optimizer state, is reported as not carried). Each tensor's bytes are read from its storage record
  (zip member or legacy data block) and written straight into the safetensors data block; only a tensor that needs a
  new layout (a non-contiguous view) or a ``dtype`` cast is materialised with torch, one storage at a time.
  The safetensors format (:mod:`ckptool.formats.safetensors`) is written here rather than with
  ``safetensors.torch.save_file``, which needs every tensor in memory at once; the result is re-opened with
  ``safetensors.safe_open`` to verify it.
* **Shared storages** (tied weights, views): safetensors holds no sharing, so each storage is stored once. A tensor
  that lies inside a stored contiguous tensor of the same storage is not stored again: it becomes an *alias*. The
  kept tensor is the first in state_dict order (the embedding before the head it is tied to), so
  ``safetensors.torch.load_model`` (which re-ties from the model side) and ckptool both restore the model. The
  layout of every shared storage is recorded in ``__metadata__["ckptool.shared"]`` (JSON, see
  :data:`SHARED_KEY`), and each exact alias also as ``__metadata__[alias] = kept name``, the convention of
  ``safetensors.torch.save_model``. Reading the file back with ckptool (``convert`` to torch) restores the aliases
  as views of one storage, with their original offsets, shapes and strides.
* **safetensors -> torch.** A zip checkpoint in the layout ``torch.save`` writes
  (:class:`ckptool.formats.torchzip.TorchZipWriter`, records 64-byte aligned so ``torch.load(mmap=True)`` maps it)
  holding an ``OrderedDict`` state_dict; ``torch.load(dst, weights_only=True)`` opens it. Storages are tagged
  ``cpu`` or ``to``.
* **dtype.** ``dtype`` casts floating tensors (float16, bfloat16, float32, float64); integer, bool, complex and
  float8 tensors are untouched. A cast is applied to a whole storage, so views keep their offsets and strides, and
  counted (the cast report: :class:`~ckptool.model.casts.CastCount`; one making inf / NaN from finite values is
  refused unless ``allow_overflow``). Quantized weights with their scales (fine-grained and compressed-tensors FP8,
  MXFP4) are dequantized to ``dtype`` first (:mod:`ckptool.ops.convert.dequant`, docs/dtypes.md).
* **Sharded sets** (:mod:`ckptool.formats.sharded`). An ``*.index.json`` is read as one checkpoint.
  ``max_shard_size`` writes shards plus an index, named as ``transformers`` names them, that it and
  ``huggingface_hub`` read; tensors that share a storage stay in one shard.
* **DCP folders** (``torch.distributed.checkpoint``: ``.metadata`` plus ``__<rank>_<n>.distcp``) are converted with
  torch's own machinery (:mod:`ckptool.torch_ops.dcp`). DCP's ``FileSystemReader`` unpickles ``.metadata`` and
  non-tensor entries without restriction, so both are first read with ckptool's restricted unpickler and refused
  unless every global they name is one DCP itself writes (or the weights-only allowlist accepts), or ``trust=True``
  (:mod:`ckptool.scanning.dcp_safety`).
* **Verification** (on by default): the output is re-opened lazily by the format's own reader and every tensor's
  name, shape and dtype, and a CRC-32 of its bytes, is compared with what was read from the source
  (:mod:`ckptool.ops.convert.verify`).

Every decision about the input is a fact of its registry entry (:attr:`ckptool.readers.Opened.spec`: ``tagged``,
``torch_distributed``, ``pickled``, ``tensors``, ``kind``), every decision about the output one of
:class:`~ckptool.ops.convert.source.OutputFormat`'s; no format is named in a comparison.

Importing this package does not import torch; the functions import it when they need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

from ckptool._fileio import same_file
from ckptool._source import holding_versions, is_url
from ckptool.errors import PrefixNotFoundError, UnsupportedError, UsageError
from ckptool.formats.tensors import Source
from ckptool.model.devices import location_function
from ckptool.model.keys import raise_on_collisions
from ckptool.model.megatron import USER_RULES, parse_tp_dims
from ckptool.model.rename_plan import RenamePlan, build_plan
from ckptool.ops.convert.dcp import WHOLE_NOTE, check_dcp_target, whole_dcp_to_torch, write_dcp
from ckptool.ops.convert.dequant import dequantize_source, quantization_config, unquantized_config
from ckptool.ops.convert.outputs import write_outputs
from ckptool.ops.convert.report import ConvertResult
from ckptool.ops.convert.source import CAST_TO, SHARED_KEY, OutputFormat, parse_size
from ckptool.ops.convert.verify import VerificationError
from ckptool.ops.rewrite.companions import Companions, model_folder_of, source_companions
from ckptool.ops.rewrite.parallel import shard_executor
from ckptool.ops.rewrite.set_writer import scratch_file
from ckptool.ops.rewrite.stream import ProgressFn
from ckptool.readers import Opened, open_checkpoint
from ckptool.readers.budget import check_expansion
from ckptool.readers.read_dcp import check_records
from ckptool.readers.read_safetensors import restore_library_aliases
from ckptool.readers.read_torch import refuse_non_strided_for_dcp
from ckptool.readers.registry import Role
from ckptool.scanning.dcp_safety import check_dcp_safe
from ckptool.torch_ops.dcp import dcp_to_torch_file
from ckptool.torch_ops.load import load_checkpoint
from ckptool.torch_ops.trusted import refuse_dangerous
from ckptool.writers import is_folder_form
from ckptool.writers.encoders import output_layout

__all__ = ["SHARED_KEY", "ConvertResult", "OutputFormat", "VerificationError", "convert", "parse_size", "place_scalars"]


def _with_tp_rules(fn: Callable[..., ConvertResult]) -> Callable[..., ConvertResult]:
    """``fn`` run with its ``tp_dims`` argument as the Megatron tensor-parallel rules of the call
    (:data:`ckptool.model.megatron.USER_RULES`), and its ``executor`` argument (when given) as the executor of the
    shards (:func:`ckptool.ops.rewrite.parallel.shard_executor`), both restored after it."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> ConvertResult:
        token = USER_RULES.set(parse_tp_dims(kwargs.get("tp_dims") or ()))
        pool = kwargs.get("executor")
        try:
            with shard_executor(pool) if pool is not None else contextlib.nullcontext():
                return fn(*args, **kwargs)
        finally:
            USER_RULES.reset(token)
    return run


class Converter(Protocol):
    """The ``convert`` role: a format that ``convert`` hands whole to a converter of its own (a DCP folder, whose
    whole state torch's planner restores), ``opened`` written to ``dst`` as ``fmt_out`` with :func:`convert`'s
    other ``options``."""

    def __call__(self, opened: Opened, dst: str, /, *, fmt_out: OutputFormat, trust: bool,
                 options: dict[str, Any]) -> ConvertResult: ...


#: the formats ``convert`` hands to a converter of their own, registered at the end of this module
CONVERT: Role[Converter] = Role("convert", "ckptool.ops")


@_with_tp_rules
@holding_versions
def convert(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, format: str | None = None, key: str | None = None,
    to: str | None = None, mapping: Mapping[str, str] | None = None, allow_missing: bool = False,
    unwrap: bool = False, strip_prefixes: str | Sequence[str] = (), max_shard_size: int | str | None = None,
    dtype: str | None = None, verify: bool = True, trust: bool = False, allow_overflow: bool = False,
    progress: ProgressFn | None = None, tag: str | None = None, exclude_frozen: bool = False,
    tp_dims: Sequence[str] = (), max_expand: float | None = None, executor: Executor | None = None,
) -> ConvertResult:
    """Convert checkpoint ``src`` to ``dst`` in one pass.

    ``src`` is a torch.save file (zip or legacy), a ``torch.export`` archive (``.pt2``: its state_dict, or with
    ``key="constants"`` its constants; :mod:`ckptool.readers.read_pt2`), a ``torch.package`` archive (its state_dict
    read without running the package's code, ``key`` as ``<member>`` or ``<member>:<path>``:
    :mod:`ckptool.readers.read_package`), a safetensors file, a sharded set (its ``*.index.json``, or the folder
    holding it), a DCP folder, or a DeepSpeed ZeRO checkpoint folder (consolidated to its fp32 state_dict as
    ``zero_to_fp32`` does, without deepspeed: :mod:`ckptool.readers.read_deepspeed`; ``tag`` picks the tag folder,
    default from ``latest``; ``exclude_frozen`` leaves out frozen parameters). ``format`` is ``"torch"``,
    ``"safetensors"`` or ``"dcp"``; by default it follows ``dst``'s suffix (``.safetensors``; ``.pt`` / ``.pth`` /
    ``.bin`` / ``.ckpt``; compared case-insensitively), and is safetensors for a folder output
    (:func:`ckptool.writers.choose_format`). A ``dst`` that names a folder (``out/``, an existing folder, a name
    without suffix: :func:`ckptool.writers.is_folder_form`) gets a ``transformers``-style folder: one
    ``model.safetensors`` (``pytorch_model.bin``), or shards and an index with ``max_shard_size``, with the source
    model folder's companion files.

    * ``key`` selects the state_dict (dotted path such as ``"model_state_dict"``); by default it is found, and the
      other entries of the file are reported in ``left_out``, not carried.
    * ``to`` sets the location tag of every storage of a torch output (``"cpu"``, ``"cuda:0"``), ``mapping``
      (``{"cuda:1": "cpu"}``) only of the matching ones (:func:`ckptool.model.devices.location_function`); by
      default torch inputs keep theirs and other inputs get ``cpu``.
    * ``unwrap`` / ``strip_prefixes`` rename the keys as ``ckptool unwrap`` / ``strip-prefix`` do.
    * ``allow_missing``: write the output even when a prefix to strip, or a ``mapping`` source, matches nothing.
    * ``max_shard_size`` (bytes, or ``"5GB"``, ``"2GiB"``) writes shards plus an index: ``x.safetensors`` gives
      ``x-00001-of-0000N.safetensors``... and ``x.safetensors.index.json`` beside it (likewise ``.bin`` / ``.pt`` /
      ``.pth``), a folder ``dst`` gets ``model-00001-of-0000N.safetensors``... / ``pytorch_model-...bin``; a set
      that fits one shard is the single file, without index (``transformers`` ``save_pretrained``).
    * ``dtype`` (float16, bfloat16, float32, float64) casts floats, dequantizes FP8 (:mod:`.dequant`), reports each
      cast (``cast_values``; inf / NaN refused unless ``allow_overflow``). ``verify``: re-read and compare.
    * ``max_expand``: what the tensors may take dense, per storage byte (:mod:`ckptool.readers.budget`; 0: no limit).
      ``trust`` allows globals outside the weights-only allowlist when a step loads with torch (DCP).
    * ``executor``: a thread pool writing a sharded output's shards at once (:mod:`ckptool.ops.rewrite.parallel`).
    * ``tp_dims``: a Megatron legacy tree's rules ``"PATTERN=DIM"`` (:func:`ckptool.model.megatron.parse_tp_dims`).
    * ``progress(nbytes)``: the bytes of tensor data written since the last call; a ``total`` attribute of it that is
      None (ckptool's bar) is first set to the bytes to write (:func:`ckptool.ops.rewrite.stream.announce_total`).

    Returns a :class:`ConvertResult`. The output is written atomically; ``src`` is never modified.

    Raises:
        UsageError: bad option values or combinations (``to`` for safetensors, ``key`` for a safetensors input,
            an output suffix that names no format, ``dst`` the same file as ``src``), a missing output folder or
            shard.
        UnsupportedError: plain pickles and TorchScript archives; dtypes safetensors cannot hold (complex128,
            quantized tensors); no state_dict found; over ``max_expand``; a cast making inf (:mod:`.dequant` too).
        NotACheckpointError / CorruptCheckpointError: unreadable or damaged input.
        UnsafeCheckpointError: a DCP folder (or a torch file converted to DCP) needs globals outside the allowlist
            and ``trust`` is False; with ``trust``, ``ckptool scan`` rates the input dangerous (:func:`_open_source`).
        PrefixNotFoundError / KeyCollisionError: as :func:`ckptool.ops.rewrite.prefixes.strip_prefix`.
        DeviceNotFoundError: a ``mapping`` source matches no storage of the source (unless ``allow_missing``).
        VerificationError: the output does not read back as the source (it is not kept).
    """
    src_p, dst_p = os.fspath(src), os.fspath(dst)
    strip = [strip_prefixes] if isinstance(strip_prefixes, str) else list(strip_prefixes)
    fmt_out, shard_bytes = _plan_output(src_p, dst_p, format, max_shard_size, dtype, to is not None or bool(mapping))
    renames: dict[str, Any] = {"unwrap": unwrap, "strip_prefixes": strip}
    opened = _open_source(src_p, trust)
    opened.check_tag_options(tag, exclude_frozen)
    own = CONVERT.find(opened.format)  # a DCP folder: torch's planner restores its whole state
    if own is not None:
        return own(opened, dst_p, fmt_out=fmt_out, trust=trust, options=dict(
            key=key, to=to, mapping=mapping, allow_missing=allow_missing, max_shard_size=shard_bytes, dtype=dtype,
            verify=verify, progress=progress, max_expand=max_expand, allow_overflow=allow_overflow, **renames))
    _refuse_options(opened, fmt_out, key)
    if fmt_out.folder and opened.spec.tensors:
        return _to_dcp(opened, dst_p, key=key, trust=trust, verify=verify, renames=renames, cast=dtype,
                       max_expand=max_expand, allow_overflow=allow_overflow)
    source = _read_source(opened, fmt_out, key, tag, exclude_frozen, max_expand)
    return _convert_source(source, src_p, dst_p, fmt_out, shard_bytes, to=to, mapping=mapping,
                           allow_missing=allow_missing, unwrap=unwrap, strip=strip, dtype=dtype, verify=verify,
                           progress=progress, allow_overflow=allow_overflow)


def _plan_output(src: str, dst: str, format: str | None, max_shard_size: int | str | None, dtype: str | None,
                 retag: bool) -> tuple[OutputFormat, int | None]:
    """The output format of :func:`convert` (``format``, else from ``dst``: :meth:`OutputFormat.choose`) and its
    shard size in bytes (``max_shard_size`` parsed; ``sys.maxsize`` for a folder ``dst`` without it: one
    ``model.safetensors`` / ``pytorch_model.bin``, as ``save_pretrained``; None for one file), options checked
    (:func:`_check_options`: UsageError)."""
    shard_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    fmt_out = OutputFormat.choose(dst, format, shard_bytes is not None)
    if shard_bytes is None and not fmt_out.folder and is_folder_form(dst):
        shard_bytes = sys.maxsize  # a folder output: one model.safetensors / pytorch_model.bin, as save_pretrained
    _check_options(src, dst, fmt_out, shard_bytes, dtype, retag)
    return fmt_out, shard_bytes


def _convert_source(source: Source, src: str, dst: str, fmt_out: OutputFormat, shard_bytes: int | None, *,
                    to: str | None, mapping: Mapping[str, str] | None, allow_missing: bool, unwrap: bool,
                    strip: Sequence[str], dtype: str | None, verify: bool, progress: ProgressFn | None,
                    allow_overflow: bool) -> ConvertResult:
    """Write the read ``source`` to ``dst`` for :func:`convert` (its options, same meaning): refuse to overwrite
    the input, retag locations (``to`` / ``mapping``), rename the keys (``unwrap`` / ``strip``), then
    :func:`_write`; the :class:`ConvertResult`."""
    _refuse_overwriting_input(source, dst, shard_bytes is not None)
    res = ConvertResult(src, dst, source.format, fmt_out.value, key=source.key, left_out=list(source.left_out),
                        skipped=list(source.skipped), notes=list(source.notes))
    location = location_function(to, mapping, tags=[t.storage.location for t in source.tensors],
                                 allow_missing=allow_missing, where=src) or _keep_location
    res.renamed, plan = _apply_renames(source, unwrap, strip, allow_missing)
    _write(source, res, fmt_out, shard_bytes, dtype, location, plan, verify, progress, allow_overflow)
    return res


def _write(source: Source, res: ConvertResult, fmt_out: OutputFormat, shard_bytes: int | None, dtype: str | None,
           location: Callable[[str], str], plan: RenamePlan | None, verify: bool,
           progress: ProgressFn | None, allow_overflow: bool = False) -> None:
    """Write ``source`` to ``res.dst`` as ``fmt_out`` (:func:`ckptool.ops.convert.outputs.write_outputs`), with the
    notes of what the output format does not carry; with ``dtype``, quantized weights dequantized first."""
    res.notes += source.notes[len(res.notes):]
    source = carry_scalars(source, res, fmt_out)
    dequantized = dtype is not None and _dequantize(source, res)
    if not fmt_out.whole_state and source.sd_state is not None:
        res.notes.append(f"the state_dict's _metadata (module versions for load_state_dict) was not carried: "
                         f"{fmt_out.value} holds tensors only")
    companions = _model_folder_files(res, source, fmt_out, shard_bytes)
    with tempfile.TemporaryDirectory(prefix="ckptool-config-") as tmp:
        files = companions.files
        if dequantized:  # config.json without its quantization_config: transformers loads the weights as they are
            files = [(unquantized_config(p, tmp) or p, n) if n == "config.json" else (p, n) for p, n in files]
            if files != companions.files:
                res.notes.append("config.json copied without its quantization_config (the rest byte for byte)")
        write_outputs(source, res.dst, fmt_out, shard_bytes, dtype, location, plan.rename if plan else None,
                      verify, progress, res, companions=files, allow_overflow=allow_overflow)
    res.kept = companions.names


def _training(names: Sequence[str]) -> str:
    """``"the training entry epoch was"`` / ``"the training entries epoch, step were"``."""
    one = len(names) == 1
    return f"the training {'entry' if one else 'entries'} {', '.join(names)} {'was' if one else 'were'}"


def place_scalars(scalars: Mapping[str, object], fmt_out: OutputFormat, taken: set[str]
                  ) -> tuple[dict[str, str], list[str]]:
    """Where a training checkpoint's plain ``scalars`` (``epoch``, ``global_step``...) go in ``fmt_out``, as the
    writers registry says (:attr:`ckptool.writers.Writer.scalars`): ``(__metadata__ entries to add, notes)``.
    ``"metadata"`` (safetensors): each as ``str(value)`` (``"3"``), but a name in ``taken`` (the header's own:
    ``format``, a tensor's name) left out and named; ``""`` (torch): none, one note naming them with the registry's
    reason (``scalars_why``); ``"state"`` (DCP): none and no note (the folder's state holds them as entries).
    Used by ``convert`` and ``extract-state-dict``."""
    how, names = fmt_out.writer.scalars, list(scalars)
    if not names or how == "state":
        return {}, []
    if how == "":
        return {}, [f"{_training(names)} not written: {fmt_out.writer.scalars_why}"]
    kept = {k: str(v) for k, v in scalars.items() if k not in taken | {"format", SHARED_KEY}}
    clash = [k for k in names if k not in kept]
    notes = [(f"{_training(list(kept))} written into __metadata__ as strings (read them back with "
              "safetensors.safe_open(path, 'pt').metadata())")] if kept else []
    if clash:
        notes.append(f"{_training(clash)} not written: __metadata__ already uses the name")
    return kept, notes


def carry_scalars(source: Source, res: ConvertResult, fmt_out: OutputFormat) -> Source:
    """``source`` with its training scalars (:attr:`Source.scalars`) placed as :func:`place_scalars` says for
    ``fmt_out`` (safetensors: into ``source.metadata``, taken off ``res.left_out``), its notes added to ``res``."""
    if not source.scalars:
        return source
    meta = dict(source.metadata or {})
    kept, notes = place_scalars(source.scalars, fmt_out, set(meta) | {t.name for t in source.tensors})
    res.notes += notes
    if not kept:
        return source
    res.left_out = [x for x in res.left_out if x.split(": ", 1)[0] not in kept]
    return dataclasses.replace(source, metadata={**meta, **kept})


def _dequantize(source: Source, res: ConvertResult) -> bool:
    """Dequantize the quantized weights of ``source`` (:func:`ckptool.ops.convert.dequant.dequantize_source`, with
    the ``quantization_config`` of the model folder, or of the folder holding a single file), noting it in ``res``;
    whether there were any."""
    folder = model_folder_of(res.src)
    if folder is None and not is_url(res.src):  # one file: the config.json beside it, if any, says the block size
        folder = os.path.dirname(os.path.abspath(res.src))
    notes = dequantize_source(source, quantization_config(folder))
    res.notes += notes
    return bool(notes)


def _model_folder_files(res: ConvertResult, source: Source, fmt_out: OutputFormat,
                        shard_bytes: int | None) -> Companions:
    """The files of the input's model folder (``config.json``, tokenizer files: :mod:`ckptool.ops.rewrite.companions`)
    to copy beside a set written into a folder, as the rewriting commands copy them (issue 37); none for other
    inputs and outputs, with a note when a model folder becomes one file or a named set (nothing copied)."""
    folder = model_folder_of(res.src)
    if folder is None or fmt_out.folder:  # DCP output: a folder of its own, written by torch
        return Companions()
    layout = output_layout(res.dst, fmt_out.value) if shard_bytes is not None else None
    if layout is None or not layout.is_output_folder:
        if os.path.isfile(os.path.join(folder, "config.json")):
            res.notes.append("the model folder's other files (config.json, tokenizer files) are not copied beside "
                             "a file; write a folder (-o OUT/ --max-shard-size SIZE) to keep them with the weights")
        return Companions()
    found = source_companions(res.src, folder, (t.storage.path for t in source.tensors), layout.folder)
    res.notes += found.notes()
    return found


def _check_options(src: str, dst: str, fmt_out: OutputFormat, shard_bytes: int | None, dtype: str | None,
                   retag: bool) -> None:
    """Raise UsageError for option values and combinations :func:`convert` refuses before reading anything."""
    if dtype is not None and dtype not in CAST_TO:
        raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(CAST_TO)}")
    if retag and not fmt_out.location_tags:
        raise UsageError(f"--to sets torch location tags, and so does --map; {fmt_out.value} output carries none "
                         "(load it with the device you want instead)")
    if shard_bytes is not None and fmt_out.folder:
        raise UsageError("--max-shard-size does not apply to DCP output (DCP writes one file per rank)")
    if is_url(dst) and (shard_bytes is not None or fmt_out.folder):
        raise UsageError(f"{dst}: a sharded set and a DCP checkpoint are several files, written to a local folder "
                         "only; write it there and upload the folder (an output URL takes one file)")
    if same_file(src, dst):
        raise UsageError(f"output {dst} is the input; choose another -o path")


def _open_source(src: str, trust: bool) -> Opened:
    """``open_checkpoint(src)``; with ``trust``, refused first when ``ckptool scan`` rates it dangerous: trust
    covers classes, never gadgets (:func:`ckptool.torch_ops.trusted.refuse_dangerous`).

    Raises:
        UnsafeCheckpointError: ``trust`` and a dangerous global or shipped code; what ``open_checkpoint`` raises.
    """
    opened = open_checkpoint(src)
    if trust:
        refuse_dangerous(opened)
    return opened


def _read_source(opened: Opened, fmt_out: OutputFormat, key: str | None, tag: str | None,
                 exclude_frozen: bool, max_expand: float | None) -> Source:
    """The tensors to convert (:meth:`ckptool.readers.Opened.state_dict`); for an output that keeps shared storages
    (torch) from one file, the tied names ``safetensors.torch.save_model`` dropped given back (only a safetensors
    source records them; a sharded set's metadata is its first shard's alone).

    Raises:
        UnsupportedError: the selected state_dict holds no tensors, or is over the ``max_expand`` budget
            (:func:`ckptool.readers.budget.check_expansion`), and what the reader raises.
    """
    source = opened.state_dict(key, tag=tag, exclude_frozen=exclude_frozen)
    if fmt_out.shared_storages and opened.spec.kind == "file":
        restore_library_aliases(source)
    if not source.tensors:
        raise UnsupportedError(f"{opened.path}: the selected state_dict holds no tensors; nothing to convert")
    check_expansion(source.tensors, max_expand, opened.path, "convert")
    return source


def _keep_location(saved: str) -> str:
    return saved


def _apply_renames(src: Source, unwrap: bool, strip_prefixes: Sequence[str],
                   allow_missing: bool = False) -> tuple[int, RenamePlan | None]:
    """Rename the source's keys in place with :func:`ckptool.model.rename_plan.build_plan` (bound to the source's
    keys, :meth:`~ckptool.model.rename_plan.RenamePlan.bind`); returns ``(renamed keys, plan)``. Unlike
    :func:`ckptool.model.rename_plan.plan_keys`, ``unwrap`` with no wrapper to remove is a note, not an error.

    Raises:
        UsageError: a bad prefix.
        PrefixNotFoundError: a prefix to strip is carried by no key (unless ``allow_missing``).
        KeyCollisionError: two keys would get one name.
    """
    if not unwrap and not strip_prefixes:
        return 0, None
    plan = build_plan(strip_prefixes=list(strip_prefixes), unwrap=unwrap).bind(t.name for t in src.tensors)
    mapping: dict[str, str] = {}
    hits: set[str] = set()
    for t in src.tensors:
        new, removed, _added = plan.trace(t.name)
        mapping[t.name] = new
        hits.update(c for step in removed for c in step)
    for step in plan.steps:
        if step.kind == "strip" and not allow_missing:
            missing = [p for p in step.prefixes if p not in hits]
            if missing:
                seen = ", ".join(repr(t.name) for t in src.tensors[:3]) or "no keys"
                wanted = " or ".join(map(repr, missing))
                raise PrefixNotFoundError(f"{src.path}: no key starts with {wanted} (keys look like {seen}); nothing "
                                          "was written. Check the prefix with `ckptool inspect`")
    raise_on_collisions(mapping, where=src.path)
    n = 0
    for t in src.tensors:
        if mapping[t.name] != t.name:
            n += 1
            t.name = mapping[t.name]
    if unwrap and not n:
        src.notes.append("no key carried a wrapper component: nothing to unwrap")
    return n, plan


def _refuse_overwriting_input(src: Source, dst: str, folder: bool) -> None:
    """Raise UsageError when the output would replace an input file (a shard of the input set; hard links and
    symbolic links count), or when sharded output goes into the folder holding the input (its shards could carry
    the same names)."""
    inputs = dict.fromkeys([src.path, *(t.storage.path for t in src.tensors)])
    if folder and any(same_file(os.path.dirname(os.path.abspath(p)), dst) for p in inputs):
        raise UsageError(f"{dst} holds the input; write the shards into another folder")
    if not folder and any(same_file(p, dst) for p in inputs):
        raise UsageError(f"output {dst} is one of the input files; choose another -o path")


def _from_dcp(opened: Opened, dst: str, *, fmt_out: OutputFormat, trust: bool,
              options: dict[str, Any]) -> ConvertResult:
    """Convert a DCP folder: whole to a torch file, or through a temporary torch file beside ``dst``
    (``format_utils.dcp_to_torch_save``) to ``dst`` with the other ``options``.

    Raises:
        UsageError: DCP output (the folder already is one).
        UnsafeCheckpointError: ``.metadata`` names globals DCP does not write and ``trust`` is False.
    """
    src = opened.path
    if fmt_out.folder:
        raise UsageError(f"{src} is already a DCP checkpoint; convert it to torch or safetensors")
    meta = opened.dcp_metadata()
    check_dcp_safe(meta, trust)
    check_records(meta, options.get("max_expand"), "convert")  # before torch allocates what .metadata declares
    whole = fmt_out.whole_state and not any(options.get(k) for k in ("key", "to", "mapping", "max_shard_size",
                                                                      "dtype", "unwrap", "strip_prefixes"))
    if whole:
        return whole_dcp_to_torch(meta, dst, options.get("verify", True))
    with scratch_file(dst) as tmp:
        dcp_to_torch_file(src, tmp)
        res = convert(tmp, dst, format=fmt_out.value, trust=True, **options)  # written by torch just now
    res.src, res.format_in = src, opened.format
    return res


def _to_dcp(opened: Opened, dst: str, *, key: str | None, trust: bool, verify: bool, renames: dict[str, Any],
            cast: str | None, max_expand: float | None, allow_overflow: bool = False) -> ConvertResult:
    """Write a DCP folder at ``dst`` (:func:`ckptool.ops.convert.dcp.write_dcp`) from a checkpoint whose tensors
    ckptool reads (a torch file, a sharded set, safetensors, ``.pt2``, torch.package).

    A torch file (a pickle) converts whole (training state included) unless ``key``, renames or ``cast`` ask for
    one state_dict; other inputs are first converted to a temporary torch file, loaded with
    :func:`ckptool.torch_ops.load.load_checkpoint` (safe unless ``trust``).

    Raises:
        UsageError: ``dst`` is not a new or empty folder.
        UnsupportedError: the input holds no dict; sparse, nested or storage-less tensors (DCP writes storages).
    """
    check_dcp_target(dst)
    src = opened.target
    if not (renames["unwrap"] or renames["strip_prefixes"]):
        renames = {}
    res = ConvertResult(src, dst, opened.format, OutputFormat.DCP.value)
    sub: ConvertResult | None = None
    if opened.spec.pickled and key is None and not renames and cast is None:
        refuse_non_strided_for_dcp(src, opened.format)
        check_expansion(opened.all_tensors()[0].tensors, max_expand, src, "convert")  # torch saves them dense
        res.notes.append(WHOLE_NOTE)
        obj, _saved = load_checkpoint(src, "cpu", trust=trust)
    else:
        with scratch_file(dst) as tmp:
            sub = convert(src, tmp, format=OutputFormat.TORCH.value, key=key, dtype=cast, verify=verify, trust=trust,
                          max_expand=max_expand, allow_overflow=allow_overflow, **renames)
            res.key, res.left_out, res.skipped, res.cast, res.renamed = (sub.key, sub.left_out, sub.skipped,
                                                                         sub.cast, sub.renamed)
            res.cast_values, res.cast_total = sub.cast_values, sub.cast_total
            obj, _saved = load_checkpoint(tmp, "cpu", trust=trust)
    if not isinstance(obj, dict):
        raise UnsupportedError(f"{src} holds a {type(obj).__name__}, not a dict; DCP saves a state_dict (a dict)")
    write_dcp(obj, dst, verify, res)
    res.checked = ("the DCP folder, read back with torch's dcp_to_torch_save, holds every tensor, value for value, "
                   "of what torch.load(weights_only=True) read from "
                   + ("the source" if sub is None else f"a torch file made from the source, where {sub.checked}"))
    return res


def _refuse_options(opened: Opened, fmt_out: OutputFormat, key: str | None) -> None:
    """Raise UsageError for ``--key`` or DCP output where the input's format refuses them
    (:meth:`ckptool.readers.Format.refusal_for`: a DeepSpeed folder holds one model and converts to a file)."""
    for operation, given in (("convert --key", key is not None), ("convert to dcp", fmt_out.folder)):
        refusal = opened.spec.refusal_for(operation, opened.path) if given else None
        if refusal is not None:
            raise UsageError(refusal)


CONVERT.register("dcp", _from_dcp)
