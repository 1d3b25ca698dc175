"""A DeepSpeed ZeRO checkpoint folder as a torch state_dict, for ``load_into`` and ``verify``.

The folder is read without deepspeed, nothing in its pickles run (:func:`ckptool.model.zero.read_zero`), and
consolidated as ``zero_to_fp32`` does (:func:`ckptool.readers.read_deepspeed.deepspeed_source`: each tensor's bytes
are ``segments`` of the ranks' partitions); :func:`ckptool.torch_ops.source_load.load_source` reads each tensor
straight into its own buffer, one at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from ckptool.model.zero import read_zero
from ckptool.readers.read_deepspeed import deepspeed_source
from ckptool.torch_ops.source_load import load_source

if TYPE_CHECKING:
    import torch


def load_zero_state_dict(path: str, device: torch.device, tag: str | None = None) -> OrderedDict[str, torch.Tensor]:
    """The consolidated state_dict of the DeepSpeed checkpoint at ``path`` (equal to
    ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``), every tensor on ``device``; tied names
    (``shared_params``) are views of one storage.

    Raises:
        UsageError / CorruptCheckpointError / UnsupportedError: see :func:`ckptool.model.zero.read_zero` and
            :func:`ckptool.model.zero.plan`.
    """
    return load_source(deepspeed_source(read_zero(path, tag)), device)
