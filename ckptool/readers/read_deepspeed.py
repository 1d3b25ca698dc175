"""``convert`` from a DeepSpeed ZeRO checkpoint folder: the consolidated state_dict as a convert :class:`Source`.

The folder is found (:func:`ckptool.formats.deepspeed.find_deepspeed`) and its pickles read without deepspeed
(:func:`read_zero`, :func:`ckptool.model.zero.zero_checkpoint`), then consolidated as
``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` does (:func:`ckptool.model.zero.plan`). Each output
tensor's :class:`~ckptool.formats.tensors.Storage` gathers its bytes from the ranks' partitions
(``segments``), so the writers stream it from the rank files, one tensor at a time: memory stays bounded by one
copy buffer (by the largest tensor for a ``--dtype`` cast), never the model. Tied parameters (``shared_params``)
share one storage, so safetensors stores them once and torch output keeps them tied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptool.formats.deepspeed import find_deepspeed
from ckptool.formats.dtypes import contiguous_stride
from ckptool.formats.tensors import Source, Storage, Tensor
from ckptool.model.zero import ZeroCheckpoint, plan, zero_checkpoint
from ckptool.readers.reader import Reader

if TYPE_CHECKING:
    from ckptool.readers import Opened

__all__ = ["FORMAT", "DeepSpeedReader", "deepspeed_source", "read_zero"]

FORMAT = "deepspeed"


def read_zero(path: str, tag: str | None = None) -> ZeroCheckpoint:
    """Read the DeepSpeed ZeRO checkpoint at ``path`` (top folder or tag folder; ``tag`` as
    :func:`~ckptool.formats.deepspeed.find_deepspeed`): the pickles of every model- and optimizer-state file, with
    the restricted unpickler (deepspeed is not imported, nothing runs; tensor data is not read), and what they
    say (:func:`ckptool.model.zero.zero_checkpoint`).

    Raises:
        UsageError / CorruptCheckpointError / UnsupportedError: see ``find_deepspeed``; a file that is not what
            ``zero_to_fp32`` expects (no ``buffer_names``, no ``zero_stage``, a rank file missing) is corrupt; ZeRO
            stage 0 and checkpoints saved without ZeRO optimizer state are unsupported.
    """
    return zero_checkpoint(find_deepspeed(path, tag))


def deepspeed_source(z: ZeroCheckpoint, exclude_frozen: bool = False) -> Source:
    """The consolidated state_dict of ``z`` as a :class:`Source` (format ``"deepspeed"``), tensors in
    ``zero_to_fp32``'s order; ``left_out`` names the optimizer state that is not carried.

    Raises:
        CorruptCheckpointError / UnsupportedError: see :func:`ckptool.model.zero.plan`.
    """
    tensors: list[Tensor] = []
    storages: dict[str, Storage] = {}
    for i, t in enumerate(plan(z, exclude_frozen)):
        st = storages.get(t.tied_to) if t.tied_to is not None else None
        if st is None:
            first = t.segments[0] if t.segments else None
            st = Storage(first.path if first else z.ds.folder, first.offset if first else 0, t.nbytes, t.dtype,
                         segments=list(t.segments))
            storages[t.name] = st
        tensors.append(Tensor(t.name, t.name, t.dtype, t.shape, contiguous_stride(t.shape), 0, st,
                              requires_grad=False, index=i))
    src = Source(z.ds.folder, FORMAT, tensors)
    if z.optimizer_state:
        src.left_out.append(f"optimizer state: {', '.join(z.optimizer_state)}, partitioned over {z.world_size} "
                            "rank(s)")
    if z.uncovered:
        src.notes.append(f"{len(z.uncovered)} module entr{'y' if len(z.uncovered) == 1 else 'ies'} saved only as "
                         f"module weights, not in the fp32 state, left out as zero_to_fp32 does: "
                         f"{', '.join(z.uncovered[:8])}{' ...' if len(z.uncovered) > 8 else ''}")
    if exclude_frozen and z.frozen:
        src.notes.append(f"frozen parameters left out (--exclude-frozen): {len(z.frozen)}")
    return src


class DeepSpeedReader(Reader):
    """A DeepSpeed ZeRO folder (the registry's ``reader``): one flat mapping, consolidated per tag folder."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened)
        self._zero: dict[str | None, ZeroCheckpoint] = {}

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """The consolidated state_dict of the tag folder ``tag`` (:meth:`~ckptool.readers.Opened.zero`, read once),
        its frozen parameters left out with ``exclude_frozen``."""
        return deepspeed_source(self.zero(tag), exclude_frozen)

    def zero(self, tag: str | None) -> ZeroCheckpoint:
        """The pickles and consolidation plan of the tag folder ``tag`` (:func:`read_zero`), read once per tag."""
        if tag not in self._zero:
            self._zero[tag] = read_zero(self.opened.target, tag)
        return self._zero[tag]
