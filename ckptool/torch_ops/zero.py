"""A DeepSpeed ZeRO checkpoint folder as a torch state_dict, for ``load_into`` and ``verify``.

The folder is consolidated by :func:`ckptool.model.zero.consolidated_arrays` (deepspeed not needed, nothing in the
pickles run), one tensor at a time; each tensor is made over its bytes without a copy (``torch.frombuffer``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from ckptool.model.zero import consolidated_arrays
from ckptool.torch_ops.cast import torch_dtype

if TYPE_CHECKING:
    import torch


def load_zero_state_dict(path: str, device: torch.device, tag: str | None = None) -> OrderedDict[str, torch.Tensor]:
    """The consolidated state_dict of the DeepSpeed checkpoint at ``path`` (equal to
    ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``), every tensor on ``device``; tied names
    (``shared_params``) are one tensor.

    Raises:
        UsageError / CorruptCheckpointError / UnsupportedError: see :func:`ckptool.model.zero.read_zero`.
    """
    import torch

    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, dtype, shape, buf, tied_to in consolidated_arrays(path, tag):
        if tied_to is not None and tied_to in out:
            out[name] = out[tied_to]
            continue
        dt = torch_dtype(dtype)
        flat = torch.frombuffer(buf, dtype=dt) if buf else torch.empty(0, dtype=dt)
        out[name] = flat.reshape(shape).to(device)
    return out
