"""The one description of a checkpoint's tensors that every operation reads: :class:`Tensor` (FQN, dtype, shape,
strides and storage offset in elements, requires_grad, position) over a :class:`Storage` (the file and byte range
that hold its data, or the ``segments`` of several files, or a safetensors sharing group's ``pieces``; dtype,
location tag, the CRC-32 the container records), gathered in a :class:`Source` with what was not carried.

It sits at the bottom of the package, beside the parsers (:mod:`ckptool.formats`), so that every layer above
speaks of tensors in these words and ``span``, ``numel`` and ``is_contiguous`` are defined here alone. No tensor bytes
are read to build one: the readers (:mod:`ckptool.readers`) fill them from pickles and headers.
Storage identity is object identity: two tensors share a storage exactly when ``a.storage is b.storage``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ckptool.formats.dtypes import DTYPE_SIZES, EXPAND_FLOOR, MAX_EXPAND, element_size, numel

__all__ = ["EXPAND_FLOOR", "MAX_EXPAND", "Piece", "Segment", "Source", "Storage", "Tensor", "is_contiguous", "span",
           "view_nbytes"]



class Segment(NamedTuple):
    """``nbytes`` of the concatenation, read from ``offset`` of ``path`` (widened from ``widen`` when set; each
    ``swap``-byte element byte-swapped when ``swap`` > 1, counted from ``offset``)."""

    path: str
    offset: int
    nbytes: int
    widen: str | None = None
    swap: int = 0


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
    ranges of several files instead (a DeepSpeed ZeRO parameter, read by :mod:`ckptool.formats.segments`; ``path`` and
    ``offset`` then name the first range)."""

    path: str
    offset: int
    nbytes: int
    dtype: str
    location: str = "cpu"
    crc: int | None = None
    pieces: list[Piece] | None = None
    segments: list[Segment] | None = None
    #: set for the values of a quantized weight (``convert --dtype`` dequantizing): then this storage holds no bytes
    #: of its own (``dtype`` float32, ``nbytes`` of those values); they are computed from :class:`Scaled`'s storages
    scaled: Scaled | None = None

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPE_SIZES[self.dtype]


@dataclass(eq=False)
class Scaled:
    """A quantized weight's values, in float32 (a block scale scheme; MXFP4: :attr:`fp4_packed`): the elements of
    ``weight`` (a contiguous storage of ``shape``, of a float8 dtype) times the scale of their block, ``scale`` (a
    tensor of one float per ``block = (rows, columns)`` block of the last two dimensions; the last block of a row or
    column may be partial), each product rounded once to ``compute`` (float32 as transformers' ``Fp8Dequantize``
    computes it; the scale's dtype as compressed-tensors' ``dequantize`` does). ``scheme`` names the quantization
    (for reports)."""

    weight: Storage
    shape: tuple[int, ...]
    scale: Tensor
    block: tuple[int, int]
    scheme: str
    compute: str = "float32"
    #: MXFP4 (gpt-oss): ``weight`` holds uint8 bytes of two e2m1 values each, ``shape`` ``(experts, rows, groups,
    #: 16)``, ``scale`` uint8 E8M0 exponents ``(experts, rows, groups)``; the values are laid out as transformers'
    #: ``convert_moe_packed_tensors`` returns them, ``(experts, groups * 32, rows)``
    fp4_packed: bool = False


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
    def nbytes(self) -> int:
        """The bytes of the tensor as a dense array: what materialising it (a contiguous copy, a safetensors
        record, a value comparison) allocates and writes (:func:`view_nbytes`)."""
        return view_nbytes(self.shape, self.dtype)

    @property
    def expansion(self) -> float:
        """How many times :attr:`nbytes` exceeds the bytes its storage holds (``storage.nbytes``; 1 for an empty
        storage): at most 1 for a contiguous tensor, a slice or a transpose, 2 and more only for a view that
        shows elements more than once (stride 0 from ``expand()`` or broadcasting, overlapping strides) or that
        tied views of one storage each count in full. :mod:`ckptool.readers.budget` holds every command to it."""
        return self.nbytes / max(self.storage.nbytes, 1)

    @property
    def span(self) -> tuple[int, int]:
        """``[lo, hi)``: the elements of the storage this tensor reaches (``lo == hi`` when empty)."""
        return span(self.offset, self.shape, self.stride)


@dataclass
class Source:
    """A source checkpoint read for conversion: its tensors in state_dict order plus what was not carried.

    ``sd_state`` is the selected OrderedDict node's BUILD state (``{"_metadata": ...}``), carried to torch output.
    ``entries``: plain top-level entries beside the tensors (None, bool, int, float, str, lists and dicts of them:
    a Megatron checkpoint's ``iteration``, ``common.pt``'s entries), written by an output format that holds
    non-tensor entries (``ckptool.writers``: torch) as items of the same dict, as the source keeps them.
    ``scalars``: a training checkpoint's plain top-level values beside the selected state_dict (``epoch``,
    ``global_step``, ``best_acc``: int, float, bool, short str, in file order), carried where the output format can
    hold them without changing how the output loads (``ckptool.writers``' ``scalars``: safetensors
    ``__metadata__``); they stay named in ``left_out`` until a writer carries them.
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
    entries: dict[str, object] | None = None
    scalars: dict[str, bool | int | float | str] | None = None


def span(offset: int, shape: Sequence[int], stride: Sequence[int]) -> tuple[int, int]:
    """``[lo, hi)`` in elements of the storage a view ``(offset, shape, stride)`` reaches."""
    if numel(shape) == 0:
        return offset, offset
    return offset, offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1


def view_nbytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of a dense ``shape`` array of ``dtype`` (its element size: :func:`ckptool.formats.dtypes.
    element_size`)."""
    return numel(shape) * element_size(dtype)


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
