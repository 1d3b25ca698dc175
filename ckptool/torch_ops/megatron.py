"""``load_into`` / ``verify`` of a Megatron checkpoint folder: its consolidated state_dict as torch tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptool.torch_ops.source_load import load_source

if TYPE_CHECKING:
    from ckptool.readers import Opened
    from ckptool.torch_ops.loaders import LoadRequest

__all__ = ["load_megatron"]


def load_megatron(opened: Opened, req: LoadRequest) -> tuple[Any, dict[str, int]]:
    """A Megatron legacy tree or torch_dist folder (a loader of :data:`~ckptool.torch_ops.loaders.LOAD`): the
    consolidated state_dict (:meth:`ckptool.readers.Opened.state_dict`, read without Megatron and without running
    its pickles: tensor bytes only), every tensor on ``req.device``; no saved location tags are reported (the
    shards' tags do not describe the joined tensors).

    Raises: what the format's reader raises (:mod:`ckptool.readers.read_megatron`).
    """
    return load_source(opened.state_dict(), req.device), {}
