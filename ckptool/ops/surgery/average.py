"""``ckptool.average``: the weighted mean of several checkpoints' state_dicts, streamed tensor by tensor.

What timm's ``avg_checkpoints.py`` and model soups do, without loading any checkpoint whole: each input is read by
``convert``'s readers (a torch zip or legacy file: its state_dict chosen as ``convert`` chooses it, or the one at
``key``, e.g. an EMA copy; a safetensors file, its tied names restored; a sharded set through its index; a
torch.package archive's state_dict, read without running its code), in any mix. Every input must hold the same
keys with the same shapes and dtypes (refused otherwise, naming the key).

Floating tensors (float16, bfloat16, float32, float64, complex) are averaged in float64 (complex128) and cast back
to their dtype (:mod:`ckptool.torch_ops.average`); integer and bool tensors (``num_batches_tracked``, masks) are
taken from the first input, and the result says which (timm's script averages them too and casts every tensor to
float32; here dtypes are kept). Tensors tied in every input (one storage, the same view: tied embeddings) stay one
storage in the output; other views are written as tensors of their own.

Memory is bounded by a few chunks of :data:`CHUNK_ELEMENTS` elements plus the inputs' pickles, not by the
checkpoints: each output tensor is computed chunk by chunk from byte ranges of the inputs into a scratch file beside
the output, which ``convert``'s writer (:func:`ckptool.ops.convert.outputs.write_outputs`) then copies into the
output format (kernel copies): safetensors for a ``.safetensors`` output, else a torch zip ``OrderedDict``
state_dict carrying the first input's ``_metadata``, every storage tagged ``cpu``. torch is never imported.
"""

from __future__ import annotations

import math
import os
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, overload

from ckptool._fileio import same_file
from ckptool.errors import UnsupportedError, UsageError
from ckptool.formats.dtypes import contiguous_stride, element_size
from ckptool.formats.tensors import Source, Storage, Tensor, is_contiguous
from ckptool.model.units import plural, wrote_line
from ckptool.ops.convert import ConvertResult, OutputFormat
from ckptool.ops.convert.outputs import write_outputs
from ckptool.ops.convert.plan import check_safetensors_dtypes
from ckptool.ops.convert.write import Files
from ckptool.ops.merge.methods import MethodOptions, check_method, spool_merged
from ckptool.ops.rewrite.set_writer import scratch_file
from ckptool.ops.rewrite.stream import ProgressFn
from ckptool.readers import open_checkpoint
from ckptool.readers.budget import check_expansion
from ckptool.readers.structures import gather
from ckptool.torch_ops.average import AVERAGED, TAKEN_FROM_FIRST, Accumulator, average_state_dicts
from ckptool.writers import choose_format

__all__ = ["AverageResult", "average"]

#: a checkpoint path given to :func:`average`
PathArg = str | os.PathLike[str]
#: elements averaged at a time (float64 buffers of 8 MiB)
CHUNK_ELEMENTS = 1 << 20


@dataclass
class AverageResult:
    """What :func:`average` wrote: ``dst``, ``format_out`` (``safetensors`` / ``torch-zip``), the ``inputs`` and
    their ``formats_in``, the ``weights`` as given (normalised by their sum), ``key`` (the state_dict chosen in the
    first torch input, ``""`` = top level; None for safetensors), ``tensors`` in the output, ``averaged`` (their
    names count), ``from_first`` (integer / bool tensors copied from the first input), ``tied`` (``alias -> tensor``
    sharing its storage), ``left_out`` (entries of the first input beside its state_dict, not carried), ``skipped``
    (non-tensor entries of the first input's state_dict, not carried), ``bytes_written``, ``notes``."""

    dst: str
    format_out: str
    inputs: list[str]
    formats_in: list[str]
    weights: list[float]
    key: str | None = None
    tensors: int = 0
    averaged: int = 0
    from_first: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_written: int = 0
    notes: list[str] = field(default_factory=list)
    method: str = "linear"
    base: str | None = None

    def __str__(self) -> str:
        """What ``ckptool average`` prints (before its load hint): the weights and what was averaged, taken from
        the first input, tied and left out, then the ``Wrote DST (SIZE, N tensors)`` line."""
        where = f" of state_dict {self.key!r}" if self.key else ""
        if self.method == "linear":
            total = sum(self.weights)
            ws = ", ".join(f"{w / total:.4g}" for w in self.weights)
            lines = [(f"Averaged {len(self.inputs)} checkpoints{where} (weights {ws}): "
                     f"{plural(self.averaged, 'floating tensor')} in float64, cast back to their dtypes")]
        else:
            on = f" onto base {self.base}" if self.base else ""
            lines = [(f"Merged {plural(len(self.inputs), 'checkpoint')}{where} by {self.method}{on} (mergekit's "
                      f"definition): {plural(self.averaged, 'floating tensor')}")]
        if self.from_first:
            src = "the base" if self.base else "the first input"
            lines.append(f"Taken from {src} (integer / bool tensors): {', '.join(self.from_first)}")
        if self.tied:
            lines.append("Tied (one storage): " + ", ".join(f"{a} -> {b}" for a, b in self.tied.items()))
        lines += [f"Note: {note}" for note in self.notes]
        lines += [f"Left out (not averaged): {entry}" for entry in self.left_out]
        lines += [f"Left out of the state_dict (not a tensor): {entry}" for entry in self.skipped]
        lines.append(wrote_line(self.dst, self.bytes_written, plural(self.tensors, "tensor")))
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ reading
def _read(path: str, key: str | None) -> Source:
    """One input as a :class:`~ckptool.formats.tensors.Source` (no tensor bytes read), through the readers layer
    (:func:`ckptool.readers.open_checkpoint`): any format whose tensors ckptool reads; ``key`` applies to the
    formats that hold several mappings (:attr:`ckptool.readers.Format.keyed`: torch files, DCP folders, ``.pt2``,
    torch.package archives: ``<member>:<path>``).

    Raises:
        UnsupportedError: a format whose tensors ckptool does not read without running code (TorchScript, plain
            pickles), with the reason and the route.
    """
    opened = open_checkpoint(path)
    return opened.source(key)


def _check_match(sources: list[Source]) -> None:
    """Every input holds the first one's keys, with the same shapes and dtypes.

    Raises:
        UnsupportedError: naming the first key that is missing, extra or different.
    """
    first = sources[0]
    ref = {t.name: t for t in first.tensors}
    fix = "average needs the same keys, shapes and dtypes in every input (`ckptool rename` / `filter` align keys)"
    for s in sources[1:]:
        names = {t.name: t for t in s.tensors}
        for t in first.tensors:
            o = names.get(t.name)
            if o is None:
                raise UnsupportedError(f"{s.path} has no key {t.name!r}, which {first.path} has; {fix}")
            if (o.shape, o.dtype) != (t.shape, t.dtype):
                raise UnsupportedError(
                    f"{t.name!r} is {t.dtype} {list(t.shape)} in {first.path} but {o.dtype} {list(o.shape)} in "
                    f"{s.path}; {fix}")
        extra = [n for n in names if n not in ref]
        if extra:
            raise UnsupportedError(f"{s.path} has key {extra[0]!r}, which {first.path} has not"
                                   f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; {fix}")
    for t in first.tensors:
        if t.dtype not in AVERAGED and t.dtype not in TAKEN_FROM_FIRST:
            raise UnsupportedError(f"{first.path}: {t.name!r} is {t.dtype}, which average cannot compute in float64; "
                                   "convert it to float16/bfloat16/float32 first (or drop it with `ckptool filter`)")


def _ties(sources: list[Source]) -> dict[str, str]:
    """``alias -> first name`` for every tensor that is the same view of one storage as an earlier one in every
    input (tied weights)."""
    per_input: list[dict[str, str]] = []
    for s in sources:
        first: dict[tuple[Any, ...], str] = {}
        out: dict[str, str] = {}
        for t in s.tensors:
            vid = (id(t.storage), t.dtype, t.offset, t.shape, t.stride)
            out[t.name] = first.setdefault(vid, t.name)
        per_input.append(out)
    ties = {}
    for t in sources[0].tensors:
        targets = {m[t.name] for m in per_input}
        if len(targets) == 1 and (target := targets.pop()) != t.name:
            ties[t.name] = target
    return ties


class _Elements:
    """Reads the elements of input tensors in row-major order, a range at a time."""

    def __init__(self, files: Files) -> None:
        self.files = files
        #: the strided input views of the tensor being computed, gathered whole (:meth:`reset` between tensors)
        self._whole: dict[int, bytes] = {}

    def reset(self) -> None:
        self._whole.clear()

    def _piece_base(self, t: Tensor) -> tuple[str, int]:
        """``(file, offset)`` such that element ``e`` of ``t``'s storage is at ``offset + e * esize`` of the file,
        for a storage of a safetensors sharing group (``pieces``): the stored piece that holds ``t``."""
        st, esize = t.storage, element_size(t.dtype)
        assert st.pieces is not None
        lo, hi = t.span
        for p in st.pieces:
            n = 1
            for s in p.shape:
                n *= s
            if is_contiguous(p.shape, p.stride) and p.offset <= lo and hi <= p.offset + n:
                return st.path, p.file_offset - p.offset * esize
        raise UnsupportedError(f"{st.path}: {t.name!r} is a view across stored tensors of a shared storage; convert "
                               "the file to torch format first (`ckptool convert`)")

    def _storage(self, t: Tensor, first: int, count: int) -> bytes | bytearray:
        """``count`` elements of ``t``'s storage from element ``first``: a byte range of one file, of a stored piece,
        or gathered from several files / byte-swapped (``segments``: :meth:`Files.storage_bytes`)."""
        esize = element_size(t.dtype)
        if t.storage.pieces is None:
            return self.files.storage_bytes(t.storage, first * esize, count * esize)
        path, base = self._piece_base(t)
        return self.files.read(path, base + first * esize, count * esize)

    def read(self, t: Tensor, a: int, b: int) -> bytes | bytearray:
        """The bytes of elements ``[a, b)`` of ``t`` in row-major order."""
        esize = element_size(t.dtype)
        if is_contiguous(t.shape, t.stride):
            return self._storage(t, t.offset + a, b - a)
        whole = self._whole.get(id(t))
        if whole is None:  # a strided view: its storage span read once, gathered in order (kept for its chunks)
            lo, hi = t.span
            span = self._storage(t, lo, hi - lo)
            whole = self._whole[id(t)] = b"".join(gather(span, esize, t.offset - lo, t.shape, t.stride))
        return whole[a * esize:b * esize]


# ------------------------------------------------------------------------------------------------ writing
def _spool(sources: list[Source], weights: list[float], ties: dict[str, str], scratch: BinaryIO, scratch_path: str,
           progress: ProgressFn | None, res: AverageResult) -> list[Tensor]:
    """Compute every output tensor into ``scratch``; returns the output tensors (views of storages in it)."""
    files = Files()
    elements = _Elements(files)
    by_name = [{t.name: t for t in s.tensors} for s in sources]
    total = math.fsum(weights)
    out: list[Tensor] = []
    made: dict[str, Storage] = {}
    try:
        for i, t in enumerate(sources[0].tensors):
            if t.name in ties:
                st = made[ties[t.name]]
                res.tied[t.name] = ties[t.name]
            else:
                offset, crc, n, esize = scratch.tell(), 0, t.numel, element_size(t.dtype)
                average = t.dtype in AVERAGED
                for a in range(0, n, CHUNK_ELEMENTS):
                    b = min(n, a + CHUNK_ELEMENTS)
                    if average:
                        acc = Accumulator(t.dtype, b - a)
                        for src_map, w in zip(by_name, weights):
                            acc.add(elements.read(src_map[t.name], a, b), w)
                        data: bytes | bytearray = acc.result(total)
                        del acc
                    else:
                        data = elements.read(t, a, b)
                    scratch.write(data)
                    crc = zlib.crc32(data, crc)
                    if progress is not None:
                        progress((b - a) * esize)
                elements.reset()
                st = made[t.name] = Storage(scratch_path, offset, n * esize, t.dtype, "cpu", crc)
                if average:
                    res.averaged += 1
                else:
                    res.from_first.append(t.name)
            out.append(Tensor(t.name, t.name, t.dtype, t.shape, contiguous_stride(t.shape), 0, st, t.requires_grad,
                              i))
    finally:
        files.close()
    return out


def _method_weights(method: str, weights: Sequence[float] | None, n: int, has_base: bool) -> list[float]:
    """The weights of ``n`` inputs: :func:`_weights` for ``linear``, else as given (default 1 each).

    Raises UsageError: too few inputs; not one weight per input."""
    if n < (1 if has_base else 2):
        raise UsageError(f"average needs two or more inputs, got {n}")
    if method == "linear":
        return _weights(weights, n)
    ws = [float(w) for w in weights or [1.0] * n]
    if len(ws) != n:
        raise UsageError(f"{len(ws)} weights for {n} inputs; give one weight per input")
    return ws


def _weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """Raises UsageError: not one positive finite weight per input, or weights whose sum overflows."""
    if weights is None:
        return [1.0] * n
    ws = [float(w) for w in weights]
    if len(ws) != n:
        raise UsageError(f"{len(ws)} weights for {n} inputs; give one weight per input (--weights 0.5,0.25,0.25)")
    if any(not math.isfinite(w) or w <= 0 for w in ws):
        raise UsageError(f"weights {ws}: each must be a positive number (they are divided by their sum)")
    if not math.isfinite(sum(ws)):
        raise UsageError(f"weights {ws}: their sum overflows a float64; give smaller weights (only their ratios "
                         "matter: 1,1 for 1e308,1e308)")
    return ws


@overload
def average(inputs: Sequence[Mapping[Any, Any]], dst: None = None, *, weights: Sequence[float] | None = None,
            key: str | None = None, progress: ProgressFn | None = None, method: str = "linear",
            base: PathArg | None = None, density: float | None = None, t: float | None = None,
            seed: int | None = None) -> OrderedDict[Any, Any]: ...
@overload
def average(inputs: Sequence[PathArg], dst: PathArg | None = None, *, weights: Sequence[float] | None = None,
            key: str | None = None, progress: ProgressFn | None = None, method: str = "linear",
            base: PathArg | None = None, density: float | None = None, t: float | None = None,
            seed: int | None = None, max_expand: float | None = None) -> AverageResult: ...
def average(inputs: Sequence[PathArg] | Sequence[Mapping[Any, Any]], dst: PathArg | None = None, *,
            weights: Sequence[float] | None = None, key: str | None = None,
            progress: ProgressFn | None = None, method: str = "linear", base: PathArg | None = None,
            density: float | None = None, t: float | None = None,
            seed: int | None = None, max_expand: float | None = None) -> AverageResult | OrderedDict[Any, Any]:
    """The weighted mean of the state_dicts of ``inputs`` (two or more), written to ``dst``.

    ``inputs`` are checkpoint paths (torch zip, legacy, safetensors, sharded index, in any mix; see the module
    docstring), or loaded state_dicts (mappings of tensors, or checkpoints holding one at ``key``): then the mean is
    returned as a new ``OrderedDict`` (:func:`ckptool.torch_ops.average.average_state_dicts`; needs torch) and
    ``dst`` must be None. ``weights`` (one positive number per input, default equal) are divided by their sum.
    ``key`` selects the state_dict (dotted path, ``"state_dict_ema"``) in torch inputs; by default ``convert``'s
    choice. ``dst``'s extension picks the format: ``.safetensors``, else torch's zip format (loads with
    ``torch.load(dst, weights_only=True)``). ``progress(nbytes)`` is called as output bytes are computed.
    ``max_expand`` holds each input path's tensors to that many times the bytes their storages hold
    (:mod:`ckptool.readers.budget`: a view that repeats elements, as ``expand()`` saves, is averaged and written
    dense; None: the default factor).

    Returns an :class:`AverageResult` for paths. Floating tensors are averaged in float64 and cast back; integer and
    bool tensors come from the first input (``from_first``).

    ``method`` (paths only) picks another of mergekit's merge methods (:mod:`ckptool.ops.merge.methods`, the
    arithmetic in :mod:`ckptool.torch_ops.merge_methods`, computed in the tensors' dtype as mergekit does):
    ``"task-arithmetic"``, ``"ties"``, ``"dare-ties"``, ``"dare-linear"`` merge the differences of ``inputs`` from
    ``base`` (a checkpoint of the same keys), ``weights`` (default 1 each, not normalised, may be negative)
    scaling each; ``density`` (ties, DARE; default 1) is the fraction of each difference kept, ``seed`` (DARE,
    default 0) seeds its random draws; ``"slerp"`` interpolates between two inputs by ``t`` (default 0.5). Integer
    and bool tensors then come from ``base`` (slerp: the first input).

    Raises:
        UsageError: fewer than two inputs (one with a base), bad weights, no ``dst`` for paths, ``dst`` that is an
            input, ``key`` when no input is a torch file, paths mixed with mappings; a method's options that do not
            fit it (:func:`ckptool.ops.merge.methods.check_method`).
        UnsupportedError: keys, shapes or dtypes that differ between inputs (the key is named); a dtype that cannot
            be averaged (float8); an input format average does not read; an input over the ``max_expand`` budget.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    opts = check_method(method, len(inputs), base is not None, density, t, seed,
                        None if weights is None else [float(w) for w in weights])
    ws = _method_weights(method, weights, len(inputs), base is not None)
    if all(isinstance(x, Mapping) for x in inputs):
        if dst is not None or method != "linear":
            raise UsageError("dst and method apply to checkpoint paths; for in-memory state_dicts the mean is returned")
        return average_state_dicts([x for x in inputs if isinstance(x, Mapping)], ws, key=key)
    paths, out = _paths([*inputs, *([base] if base is not None else [])], dst)
    sources = [_read(p, key) for p in paths]
    for src in sources:
        check_expansion(src.tensors, max_expand, src.path, "average")
    if key is not None and all(s.key is None for s in sources):
        raise UsageError("--key selects a state_dict inside torch.save files; every input is a flat mapping of "
                         "tensors (safetensors), so it does not apply")
    _check_match(sources[::-1] if base is not None else sources)  # the base's keys first, when there is one
    if not sources[0].tensors:
        raise UnsupportedError(f"{paths[0]}: the selected state_dict holds no tensors; nothing to average")
    return _write(sources, ws, paths, out, progress, opts)


def _paths(inputs: Sequence[object], dst: PathArg | None) -> tuple[list[str], str]:
    """The input paths of :func:`average` and its output ``dst``.

    Raises:
        UsageError: paths mixed with mappings, no ``dst``, ``dst`` that is an input.
    """
    paths = [os.fspath(x) for x in inputs if isinstance(x, (str, os.PathLike))]
    if len(paths) != len(inputs):
        raise UsageError("give checkpoint paths or loaded state_dicts (mappings), not a mix")
    if dst is None:
        raise UsageError("average writes a new file: give dst (-o OUT.safetensors or OUT.pth)")
    out = os.fspath(dst)
    if choose_format(out).is_folder:
        raise UsageError(f"average writes one file, not a {choose_format(out).name} folder: name it "
                         "OUT.safetensors or OUT.pth")
    for p in paths:
        if same_file(p, out):
            raise UsageError(f"output {out} is the input {p}; choose another -o path")
    return paths, out


def _write(sources: list[Source], ws: list[float], paths: list[str], out: str,
           progress: ProgressFn | None, opts: MethodOptions) -> AverageResult:
    """The mean of ``sources`` (checked to match; the last one the base when ``opts`` needs one) computed into a
    scratch file beside ``out``, then written as ``out`` by ``convert``'s writer in the format
    :func:`ckptool.writers.choose_format` names (safetensors for a ``.safetensors`` name in any case, a torch zip
    file for ``.pt`` / ``.pth`` / ``.bin``...)."""
    has_base = opts.method not in ("linear", "slerp")
    if has_base:  # the base first: its keys, order, _metadata and integer tensors
        sources, paths = [sources[-1], *sources[:-1]], [paths[-1], *paths[:-1]]
    fmt_out = OutputFormat(choose_format(out).name)  # write_outputs' output choice
    safetensors = fmt_out is OutputFormat.SAFETENSORS
    if safetensors:
        check_safetensors_dtypes(sources[0].tensors, None, out)
    res = AverageResult(out, fmt_out.writer.reads_as, paths,
                        [s.format for s in sources], ws, key=sources[0].key, left_out=list(sources[0].left_out),
                        skipped=list(sources[0].skipped))
    res.notes += [n for s in sources for n in s.notes]
    ties = _ties(sources)
    state = next((s.sd_state for s in sources if s.sd_state is not None), None)
    meta = next((s.metadata for s in sources if s.metadata), None)
    with scratch_file(out) as scratch_path, open(scratch_path, "w+b") as scratch:
        if opts.method == "linear":
            tensors = _spool(sources, ws, ties, scratch, scratch_path, progress, res)
        else:
            tensors, res.from_first = spool_merged(sources[0], sources[1:], opts, ws, ties, scratch, scratch_path,
                                                   progress)
            res.averaged = len(tensors) - len(res.from_first) - len(ties)
            res.tied = dict(ties)
        scratch.flush()
        result = Source(out, sources[0].format, tensors, key=sources[0].key, metadata=meta, sd_state=state)
        cres = ConvertResult(scratch_path, out, sources[0].format, fmt_out.value)
        write_outputs(result, out, fmt_out, None, None, lambda _saved: "cpu", None, False, None, cres)
    res.tensors, res.bytes_written = len(tensors), cres.bytes_written
    if has_base:
        res.method, res.base, res.inputs, res.formats_in = opts.method, paths[0], paths[1:], res.formats_in[1:]
    res.method = opts.method
    return res
