"""The state_dict of a ``torch.export`` archive (``.pt2``) as torch tensors, for ``verify`` and ``load_into``:
read from its raw payload members (:mod:`ckptool.formats.pt2`), nothing unpickled and no program loaded.

``torch.export.load`` itself unpickles the archive's sample inputs (and any pickled payload) and rebuilds the
program; this reads only the weights, each member once as a flat tensor and every weight a view of it
(``torch.as_strided`` with the recorded offset, shape and strides, as ``torch.export.load`` does), so tied weights
and views share storage as they did when exported. Importing this module does not import torch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING

from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.readers import Opened, open_checkpoint
from ckptool.readers.structures import data_offset
from ckptool.torch_ops.cast import torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["load_pt2_state_dict"]


def load_pt2_state_dict(path: str | os.PathLike[str] | Opened, device: torch.device
                        ) -> tuple[OrderedDict[str, torch.Tensor], dict[str, int]]:
    """``(state_dict, {saved location tag: tensor count})`` of the one program of the ``.pt2`` at ``path`` (a local
    file, opened once, or already opened: its structure is :meth:`ckptool.readers.Opened.pt2`), its
    tensors on ``device``: the parameters and persistent buffers of ``torch.export.load(path).state_dict`` (plain
    tensors, bit for bit, in config order).

    Raises:
        UsageError: an archive of several programs.
        UnsupportedError: a weight pickled in the archive (a tensor subclass), and what
            :meth:`ckptool.readers.Opened.pt2` raises.
        CorruptCheckpointError: a member shorter than the file says.
    """
    import torch

    opened = path if isinstance(path, Opened) else open_checkpoint(path)
    path = opened.target
    arch = opened.pt2()
    if len(arch.programs) != 1:
        raise UsageError(f"{path} holds {len(arch.programs)} exported programs; convert one first "
                         f"(`ckptool convert {path} --key NAME.state_dict -o weights.pth`)")
    flat: dict[str, torch.Tensor] = {}
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    saved: dict[str, int] = {}
    with open(path, "rb") as f:
        for p in arch.programs[0].weights:
            if p.pickled or p.dtype is None:
                raise UnsupportedError(f"{path}: {p.fqn!r} is pickled in member {p.member} (a tensor subclass); "
                                       "ckptool does not unpickle it: load the archive with torch.export.load if "
                                       "you trust it")
            base = flat.get(p.member)
            dtype = torch_dtype(p.dtype)
            if base is None:
                e = arch.members[p.member]
                f.seek(data_offset(f, e, path))
                buf = bytearray(e.file_size)
                if f.readinto(buf) != e.file_size:
                    raise CorruptCheckpointError(f"{path}: member {e.name!r} is truncated; re-download it")
                base = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
                base = flat[p.member] = base.to(device)
            elif base.dtype != dtype:
                raise UnsupportedError(f"{path}: {p.fqn!r} views member {p.member} as {p.dtype}, another weight as "
                                       f"{str(base.dtype).removeprefix('torch.')}; load it with torch.export.load")
            out[p.fqn] = base.as_strided(p.shape, p.stride, p.storage_offset)
            saved[p.device] = saved.get(p.device, 0) + 1
    return out, saved
