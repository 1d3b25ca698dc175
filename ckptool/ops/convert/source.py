"""What ``convert`` reports and its options: the result, output dtypes, sizes. The source model (storages, tensors,
their layouts) is the readers layer's: :mod:`ckptool.formats.tensors`."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from ckptool.errors import UsageError
from ckptool.formats.safetensors import SHARED_KEY as SHARED_KEY  # re-exported: ckptool.ops.convert.SHARED_KEY

#: dtypes ``dtype=`` casts (floating point; float8 formats carry scales elsewhere and are left alone)
CAST_FROM = ("float16", "bfloat16", "float32", "float64")
CAST_TO = ("float16", "bfloat16", "float32", "float64")


class OutputFormat(enum.Enum):
    """What ``convert`` writes (``format=`` / ``--format``; ``ConvertResult.format_out`` holds its ``value``), with
    what each output carries: :attr:`suffixes` (a ``dst`` so named chooses it), :attr:`location_tags` (storages
    tagged with a device: ``to`` / ``mapping`` apply), :attr:`shared_storages` (views of one storage stay views),
    :attr:`whole_state` (a whole pickled checkpoint, not tensors only), :attr:`folder` (several files written by torch
    into a new folder: no shards, no URL output)."""

    TORCH = "torch"
    SAFETENSORS = "safetensors"
    DCP = "dcp"

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The ``dst`` suffixes that choose this format when ``format`` is not given."""
        return _SUFFIXES.get(self, ())

    @property
    def location_tags(self) -> bool:
        """Its storages carry location tags (``--to`` / ``--map`` apply)."""
        return self is OutputFormat.TORCH

    @property
    def shared_storages(self) -> bool:
        """Tensors sharing a storage stay views of one storage (tied names come back as views)."""
        return self is OutputFormat.TORCH

    @property
    def whole_state(self) -> bool:
        """It holds a whole pickled checkpoint (nested dicts, non-tensor values, a state_dict's ``_metadata``), not
        tensors only."""
        return self is OutputFormat.TORCH

    @property
    def folder(self) -> bool:
        """Written as a folder of files by torch (``torch.distributed.checkpoint``): not sharded by ckptool."""
        return self is OutputFormat.DCP

    @classmethod
    def choose(cls, dst: str, fmt: str | None, sharded: bool) -> OutputFormat:
        """The format ``fmt`` names, else the one ``dst``'s suffix names, else safetensors for a folder of shards.

        Raises:
            UsageError: ``fmt`` names no output format; no ``fmt`` and ``dst``'s suffix names none.
        """
        if fmt is not None:
            try:
                return cls(fmt)
            except ValueError:
                raise UsageError(f"unknown format {fmt!r}: choose torch, safetensors or dcp") from None
        low = dst.lower()
        found = next((f for f in cls if low.endswith(f.suffixes)), None)
        if found is not None:
            return found
        if sharded:  # a folder of shards
            return cls.SAFETENSORS
        raise UsageError(f"cannot tell the output format from {dst!r}: name it *.safetensors or *.pt / *.pth / *.bin, "
                         "or pass --format torch|safetensors|dcp")


_SUFFIXES = {
    OutputFormat.SAFETENSORS: (".safetensors",),
    OutputFormat.TORCH: (".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl"),
}


@dataclass
class ConvertResult:
    """What :func:`ckptool.ops.convert.convert` did.

    ``format_in`` is the input's registry name (:data:`ckptool.readers.FORMATS`: ``torch-zip``,
    ``sharded-safetensors``, ``dcp``...), ``format_out`` an :class:`OutputFormat`'s value (``torch``,
    ``safetensors``, ``dcp``).
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
        if OutputFormat(self.format_out).folder or not self.files:
            return self.dst
        return self.files[-1]


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
