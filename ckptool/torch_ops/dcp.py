"""``torch.distributed.checkpoint`` (DCP) through torch's own machinery, for ``ckptool convert``.

In: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``. Out: ``torch.distributed.checkpoint.save``
with ``no_dist=True`` (no process group needed). ``format_utils.torch_save_to_dcp`` is not used: it would
``torch.load`` the source with ``weights_only=False``. The caller checks a DCP folder's globals before any of this
runs (torch unpickles ``.metadata`` without restriction).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import IO, Any

from ckptool.errors import CkptError, CorruptCheckpointError
from ckptool.formats.dcp import DcpEntry
from ckptool.torch_ops.convert_verify import flat_tensors, same_tensors


def dcp_to_torch_file(folder: str, out: str | IO[bytes]) -> None:
    """Write the DCP checkpoint in ``folder`` as one ``torch.save`` file to the path or binary file ``out``.

    Raises:
        CorruptCheckpointError: torch could not read the folder (incomplete or damaged).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        dcp_to_torch_save(folder, out)  # type: ignore[arg-type]  # torch.save inside takes a file object too
    except (CkptError, MemoryError, ImportError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{folder}: torch.distributed.checkpoint could not read it "
                                     f"({type(e).__name__}: {e}); the folder is incomplete or damaged") from e


def save_dcp(state: dict[str, Any], folder: str) -> int:
    """Save ``state`` as a DCP checkpoint into the (empty) ``folder`` in this process; returns its tensor count."""
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        save(state, checkpoint_id=folder, no_dist=True)
    return len(flat_tensors(state))


def dcp_round_trip_difference(state: dict[str, Any], folder: str, scratch: str) -> str | None:
    """Read the DCP checkpoint in ``folder`` back (``dcp_to_torch_save`` into the file ``scratch``, then
    ``torch.load(weights_only=True)``) and compare every tensor with ``state``: None when all are equal (dtype,
    shape, bytes), else the first difference."""
    import torch

    dcp_to_torch_file(folder, scratch)
    again = torch.load(scratch, map_location="cpu", weights_only=True)
    return same_tensors(flat_tensors(state), flat_tensors(again))


def metadata_difference(path: str, entries: Sequence[DcpEntry], verify: bool) -> tuple[int, str | None]:
    """Open the torch file ``path`` written from a DCP folder (``torch.load(weights_only=True, mmap=True)``);
    returns its tensor count and, with ``verify``, the first tensor of ``entries`` (the folder's ``.metadata``)
    that is missing or has another dtype or shape (None when every one matches)."""
    import torch

    flat = flat_tensors(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    if verify:
        for fqn, dt, shape in entries:
            if dt is None:
                continue
            t = flat.get(fqn)
            if t is None or str(t.dtype) != f"torch.{dt}" or tuple(t.shape) != shape:
                return len(flat), f"{fqn!r} is missing or differs from the DCP metadata ({dt} {list(shape or ())})"
    return len(flat), None
