"""Which globals of a ``torch.distributed.checkpoint`` folder ckptool accepts before torch reads it.

torch's ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load`` and ``DefaultLoadPlanner`` loads
non-tensor entries with ``torch.load(weights_only=False)``: either can run code. Before any torch function reads a
folder, :func:`check_dcp_safe` scans it exactly as ``ckptool scan`` does (:func:`ckptool.scanning.dcp.
scan_dcp_folder`: ``.metadata`` under DCP's own record classes, then every record of ``storage_data`` with the
weights-only rules, tensor chunk or not, since a pickle can change an entry's class on the way) and accepts only a
folder that scan calls safe.
"""

from __future__ import annotations

from ckptool.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptool.formats.dcp import DcpMetadata
from ckptool.model.allowlist import ALLOWED, classify_global
from ckptool.scanning.dcp import scan_dcp_folder


def is_dcp_allowed(name: str) -> bool:
    """True for a global (``module.qualname``) a DCP ``.metadata`` may name without ``trust``: the one scan policy,
    :func:`ckptool.model.allowlist.classify_global` with ``dcp_metadata=True``."""
    return classify_global(name, dcp_metadata=True)[0] == ALLOWED


def check_dcp_safe(meta: DcpMetadata, trust: bool) -> None:
    """Refuse (unless ``trust``) a DCP folder that ``ckptool scan`` does not call safe: a global outside
    :func:`is_dcp_allowed` in ``.metadata`` or outside the weights-only allowlist in any record, a record that
    could not be read to check it (transformed by DCP, not a pickle, damaged), an entry whose class is neither
    tensor nor non-tensor metadata.

    Raises:
        UnsafeCheckpointError: such globals, or records torch would unpickle that cannot be checked.
        CorruptCheckpointError: the folder is damaged (missing files, records outside the folder or past a file's
            end, entries of another class) and names no global outside the allowlists.
    """
    if trust:
        return
    res = scan_dcp_folder(meta.folder)
    unsafe = [g.name for g in res.globals if g.status != ALLOWED]
    unchecked = [f"({p.where}: {p.error})" for p in res.pickles if p.error and not p.hidden]
    if unsafe or unchecked:
        names = list(dict.fromkeys(unsafe + unchecked))
        raise UnsafeCheckpointError(
            f"{meta.folder}: loading this DCP checkpoint would import {', '.join(names[:5])}"
            f"{' and more' if len(names) > 5 else ''}, outside torch's weights_only allowlist or unchecked "
            "(torch.distributed.checkpoint unpickles .metadata and non-tensor entries without restriction). "
            "Pass --trust (trust=True) only if you trust where the folder came from", names)
    if res.error or res.cut_short:
        why = res.error or res.cut_short[0]
        raise CorruptCheckpointError(f"{meta.folder}: {why}; `ckptool scan {meta.folder}` says more")
