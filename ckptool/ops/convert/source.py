"""What ``convert`` reads and reports: the source model (storages, tensors, their layouts), options, the result."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptool.errors import UsageError
from ckptool.formats.dtypes import DTYPE_SIZES, numel
from ckptool.formats.safetensors import SHARED_KEY as SHARED_KEY  # re-exported: ckptool.ops.convert.SHARED_KEY
from ckptool.formats.segments import Segment

#: dtypes ``dtype=`` casts (floating point; float8 formats carry scales elsewhere and are left alone)
CAST_FROM = ("float16", "bfloat16", "float32", "float64")
CAST_TO = ("float16", "bfloat16", "float32", "float64")


@dataclass
class ConvertResult:
    """What :func:`ckptool.ops.convert.convert` did.

    ``dst`` is the file written (the ``*.index.json`` of a named shard set), or the folder for a shard folder and
    DCP output; ``files`` lists every file written (shards, then the index). ``key`` is the dotted path of the
    state_dict converted (``""``: top level; None for safetensors, sharded and whole-object conversions).
    ``tensors`` counts the tensors of the output (aliases included), ``stored`` those whose bytes were written,
    ``bytes_written`` the output size in bytes. ``left_out`` describes the other entries of the source that were not
    carried (``"optimizer_state: optimizer state (12 tensors)"``); ``skipped`` the non-tensor entries of the
    selected state_dict, which safetensors cannot hold. ``aliases`` maps each tensor stored as a view of another to
    that tensor; ``made_contiguous`` lists tensors stored contiguous although their layout was not;
    ``trimmed_bytes`` counts storage bytes that no tensor reached (``torch.save`` of a slice keeps its whole
    storage). ``cast`` counts ``"float32->float16": tensors``. ``renamed`` counts renamed keys. ``verified`` is True
    after a passing verification (``checked``: what was compared with what, the sentence after ``Verified:``),
    None with ``verify=False``. """

    src: str
    dst: str
    format_in: str
    format_out: str
    key: str | None = None
    tensors: int = 0
    stored: int = 0
    bytes_written: int = 0
    files: list[str] = field(default_factory=list)
    shards: int = 1
    left_out: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    made_contiguous: list[str] = field(default_factory=list)
    trimmed_bytes: int = 0
    cast: dict[str, int] = field(default_factory=dict)
    renamed: int = 0
    notes: list[str] = field(default_factory=list)
    verified: bool | None = None
    checked: str = "the output re-opens with the names, shapes, dtypes and values of the source"

    @property
    def load_path(self) -> str:
        """The one path that opens the output: the DCP folder, the index of several shards, else the file written
        (the single file of a shard folder whose tensors fit one shard, not the folder ``dst``)."""
        if self.format_out == "dcp" or not self.files:
            return self.dst
        return self.files[-1]


@dataclass(eq=False)
class Piece:
    """A stored tensor of a safetensors sharing group: its data at ``file_offset`` (``nbytes``) is the contiguous
    copy of the view ``(offset, shape, stride)`` (elements) of the group's storage."""

    file_offset: int
    nbytes: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(eq=False)
class Storage:
    """The bytes of one source storage: ``nbytes`` at ``offset`` of file ``path`` (or, for a safetensors sharing
    group, assembled from ``pieces``), elements of ``dtype``, saved with location tag ``location``; ``crc`` is the
    CRC-32 of the bytes when the source records it (zip members). ``segments``, when set, gathers the bytes from
    ranges of several files instead (a DeepSpeed ZeRO parameter, :mod:`ckptool.formats.segments`; ``path`` and
    ``offset`` then name the first range)."""

    path: str
    offset: int
    nbytes: int
    dtype: str
    location: str = "cpu"
    crc: int | None = None
    pieces: list[Piece] | None = None
    segments: list[Segment] | None = None

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPE_SIZES[self.dtype]


@dataclass(eq=False)
class Tensor:
    """One tensor of the source: output key ``name`` (``src_name`` in the source), ``dtype``, ``shape``, ``stride``
    and storage ``offset`` in elements, its :class:`Storage`, and ``index`` (position in the state_dict)."""

    name: str
    src_name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage: Storage
    requires_grad: bool = False
    index: int = 0

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def span(self) -> tuple[int, int]:
        """``[lo, hi)``: the elements of the storage this tensor reaches (``lo == hi`` when empty)."""
        return span(self.offset, self.shape, self.stride)


@dataclass
class Source:
    """A source checkpoint read for conversion: its tensors in state_dict order plus what was not carried.

    ``sd_state`` is the selected OrderedDict node's BUILD state (``{"_metadata": ...}``), carried to torch output.
    """

    path: str
    format: str
    tensors: list[Tensor]
    key: str | None = None
    left_out: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    metadata: dict[str, str] | None = None
    sd_state: dict[str, object] | None = None
    notes: list[str] = field(default_factory=list)


def span(offset: int, shape: Sequence[int], stride: Sequence[int]) -> tuple[int, int]:
    """``[lo, hi)`` in elements of the storage a view ``(offset, shape, stride)`` reaches."""
    if numel(shape) == 0:
        return offset, offset
    return offset, offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1


def is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """torch's ``is_contiguous()`` for a strided layout: row-major strides, dimensions of size 1 ignored."""
    if numel(shape) == 0:
        return True
    expected = 1
    for s, st in zip(reversed(shape), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def out_dtype(dtype: str, cast: str | None) -> str:
    """The dtype a tensor of ``dtype`` is written as: ``cast`` for the floating dtypes of :data:`CAST_FROM`."""
    return cast if cast is not None and dtype in CAST_FROM else dtype


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10**9, as ``huggingface_hub``'s
    ``parse_size_to_int``), ``"2GiB"`` (2**30), ``"500MB"``, ``"1048576"``.

    Raises:
        UsageError: not a positive size.
    """
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE_RE.match(str(size))
        if not m:
            raise UsageError(f"size {size!r}: give bytes or a number with a unit, e.g. 5GB, 500MB, 2GiB")
        num, unit = float(m.group(1)), (m.group(2) or "b").lower()
        base = 1024 if "i" in unit else 1000
        power = {"b": 0, "k": 1, "m": 2, "g": 3, "t": 4}[unit[0]]
        n = int(num * base ** power)
    if n <= 0:
        raise UsageError(f"size {size!r} must be positive")
    return n
