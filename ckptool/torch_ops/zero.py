"""A DeepSpeed ZeRO checkpoint folder as a torch state_dict, for ``load_into`` and ``verify``.

The folder is read without deepspeed, nothing in its pickles run (:meth:`ckptool.readers.Opened.zero`), and
consolidated as ``zero_to_fp32`` does (:func:`ckptool.readers.read_deepspeed.deepspeed_source`: each tensor's bytes
are ``segments`` of the ranks' partitions); :func:`ckptool.torch_ops.source_load.load_source` reads each tensor
straight into its own buffer, one at a time.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING

from ckptool.readers import Opened, open_checkpoint
from ckptool.torch_ops.source_load import load_source

if TYPE_CHECKING:
    import torch


def load_zero_state_dict(path: str | os.PathLike[str] | Opened, device: torch.device, tag: str | None = None
                         ) -> OrderedDict[str, torch.Tensor]:
    """The consolidated state_dict of the DeepSpeed checkpoint at ``path`` (a folder, opened once, or already
    opened; its tensors are :meth:`ckptool.readers.Opened.state_dict` with ``tag``; equal to
    ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``), every tensor on ``device``; tied names
    (``shared_params``) are views of one storage.

    Raises:
        UsageError / CorruptCheckpointError / UnsupportedError: see :func:`ckptool.readers.read_deepspeed.
            read_zero` and :func:`ckptool.model.zero.plan`; a folder that is not a DeepSpeed checkpoint.
    """
    opened = path if isinstance(path, Opened) else open_checkpoint(path)
    return load_source(opened.state_dict(tag=tag), device)
