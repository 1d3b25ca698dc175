"""``convert``'s DCP steps: a whole DCP folder to one torch file, and a loaded state to a new DCP folder.

Both go through torch's own machinery (:mod:`ckptool.torch_ops.dcp`). A DCP folder is written into a staging
folder beside the destination, named as :func:`ckptool._fileio.atomic_output` names its temporary files, and
renamed into place only once written (and verified); on any failure the staging folder is removed.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from ckptool._fileio import temp_path
from ckptool.errors import UsageError
from ckptool.formats.dcp import DcpMetadata
from ckptool.ops.convert.outputs import scratch_file
from ckptool.ops.convert.source import ConvertResult
from ckptool.ops.convert.verify import verify_fail
from ckptool.ops.convert.write import emit
from ckptool.torch_ops.dcp import dcp_round_trip_difference, dcp_to_torch_file, metadata_difference, save_dcp

WHOLE_NOTE = "the whole checkpoint was converted (pass --key to convert one state_dict)"


def whole_dcp_to_torch(meta: DcpMetadata, dst: str, verify: bool) -> ConvertResult:
    """Write the DCP folder of ``meta`` as one torch file at ``dst`` (``format_utils.dcp_to_torch_save``, written
    atomically), checking before it is kept that it opens with ``torch.load(weights_only=True)`` and, with
    ``verify``, holds every tensor ``.metadata`` lists with its dtype and shape.

    Raises:
        CorruptCheckpointError: torch could not read the folder.
        VerificationError: a tensor is missing or differs (nothing is kept).
    """
    res = ConvertResult(meta.folder, dst, "dcp", "torch", notes=[WHOLE_NOTE])

    def write(out: BinaryIO) -> None:
        dcp_to_torch_file(meta.folder, out)

    def check(_w: None, path: str) -> None:
        res.tensors, diff = metadata_difference(path, meta.entries, verify)
        if diff is not None:
            raise verify_fail(dst, diff)

    emit(dst, write, check)
    res.stored = res.tensors
    if verify:
        res.verified = True
        res.checked = "names, shapes and dtypes of .metadata (DCP records no checksums)"
    res.files = [dst]
    res.bytes_written = os.path.getsize(dst)
    return res


def check_dcp_target(dst: str) -> None:
    """Refuse a DCP destination that is not a new or empty folder in an existing folder.

    Raises:
        UsageError: ``dst`` exists and is a file or a non-empty folder; its parent folder does not exist.
    """
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise UsageError(f"{dst} already exists and is not an empty folder; a DCP checkpoint is written into a new "
                         "folder: choose another -o path")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise UsageError(f"output folder {parent} does not exist; create it first or choose another -o path")


def write_dcp(state: dict[str, Any], dst: str, verify: bool, res: ConvertResult) -> None:
    """Save ``state`` as a DCP checkpoint in the new folder ``dst`` (``torch.distributed.checkpoint.save``, no
    process group), filling ``res``. With ``verify`` the folder is read back (``dcp_to_torch_save``) and every
    tensor compared before it is moved into place.

    Raises:
        VerificationError: a tensor reads back differently (nothing is kept).
    """
    check_dcp_target(dst)
    with temp_path(dst, folder=True) as stage:  # removed on any failure; a killed run's is removed next time
        res.tensors = res.stored = save_dcp(state, stage)
        if verify:
            with scratch_file(dst) as back:
                diff = dcp_round_trip_difference(state, stage, back)
            if diff:
                raise verify_fail(dst, diff)
            res.verified = True
        if os.path.isdir(dst):
            os.rmdir(dst)
        os.replace(stage, dst)
    res.files = sorted(os.path.join(dst, n) for n in os.listdir(dst))
    res.bytes_written = sum(os.path.getsize(p) for p in res.files)
