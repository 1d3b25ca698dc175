"""What ``convert`` reports and its options: the result, output dtypes, sizes. The source model (storages, tensors,
their layouts) is the readers layer's: :mod:`ckptool.formats.tensors`."""

from __future__ import annotations

import enum
import re

from ckptool.errors import UsageError
from ckptool.readers.structures import SHARED_KEY as SHARED_KEY  # re-exported: ckptool.ops.convert.SHARED_KEY
from ckptool.writers import Writer, choose_format, is_folder_form, writer

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
    def writer(self) -> Writer:
        """Its entry in the writers registry (:data:`ckptool.writers.WRITERS`): suffixes, what it holds, its hint."""
        return writer(self.value)

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The ``dst`` suffixes that choose this format when ``format`` is not given."""
        return self.writer.suffixes

    @property
    def location_tags(self) -> bool:
        """Its storages carry location tags (``--to`` / ``--map`` apply)."""
        return self.writer.location_tags

    @property
    def shared_storages(self) -> bool:
        """Tensors sharing a storage stay views of one storage (tied names come back as views)."""
        return self.writer.shared_storages

    @property
    def whole_state(self) -> bool:
        """It holds a whole pickled checkpoint (nested dicts, non-tensor values, a state_dict's ``_metadata``), not
        tensors only."""
        return self.writer.non_tensor_entries and not self.writer.is_folder

    @property
    def folder(self) -> bool:
        """Written as a folder of files by torch (``torch.distributed.checkpoint``): not sharded by ckptool."""
        return self.writer.is_folder

    @classmethod
    def choose(cls, dst: str, fmt: str | None, sharded: bool) -> OutputFormat:
        """The format ``fmt`` names, else the one ``dst``'s suffix names, else safetensors for a folder output (a
        folder of shards): :func:`ckptool.writers.choose_format`, the one choice of every command.

        Raises:
            UsageError: ``fmt`` names no output format; no ``fmt`` and ``dst``'s suffix names none.
        """
        return cls(choose_format(dst, fmt, folder=sharded or is_folder_form(dst)).name)


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
