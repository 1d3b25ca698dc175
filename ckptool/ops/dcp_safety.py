"""Which globals of a ``torch.distributed.checkpoint`` folder ckptool accepts before torch reads it.

torch's ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load`` and ``DefaultLoadPlanner`` loads
non-tensor entries with ``torch.load(weights_only=False)``: either can run code. ckptool reads both with its
restricted unpickler first and accepts only the globals DCP itself writes (:data:`ckptool.formats.dcp.DCP_GLOBALS`)
or that ``torch.load(weights_only=True)`` allows: the rules of ``ckptool scan``
(:func:`ckptool.model.allowlist.classify_global`).
"""

from __future__ import annotations

from ckptool.errors import UnsafeCheckpointError
from ckptool.formats.dcp import DcpMetadata
from ckptool.model.allowlist import ALLOWED, classify_global


def is_dcp_allowed(name: str) -> bool:
    """True for a global (``module.qualname``) a DCP ``.metadata`` may name without ``trust``: the one scan policy,
    :func:`ckptool.model.allowlist.classify_global` with ``dcp_metadata=True``."""
    return classify_global(name, dcp_metadata=True)[0] == ALLOWED


def check_dcp_safe(meta: DcpMetadata, trust: bool) -> None:
    """Refuse (unless ``trust``) a DCP folder whose ``.metadata`` or non-tensor entries name globals outside
    :func:`is_dcp_allowed` (non-tensor entries are held to the weights-only allowlist alone).

    Raises:
        UnsafeCheckpointError: such globals, or a transformed non-tensor entry that cannot be read to check it.
        CorruptCheckpointError: a non-tensor entry is missing or damaged.
    """
    if trust:
        return
    unsafe = [n for n in dict.fromkeys(meta.globals) if not is_dcp_allowed(n)]
    for record in meta.byte_records():
        if record.transformed:
            unsafe.append(f"(transformed entry {record.fqn!r}, cannot be checked)")
            continue
        unsafe += [n for n in meta.record_globals(record) if classify_global(n)[0] != ALLOWED]  # not a bomb either
    if unsafe:
        unsafe = list(dict.fromkeys(unsafe))
        raise UnsafeCheckpointError(
            f"{meta.folder}: loading this DCP checkpoint would import {', '.join(unsafe[:5])}"
            f"{' and more' if len(unsafe) > 5 else ''}, outside torch's weights_only allowlist (torch.distributed."
            "checkpoint unpickles .metadata and non-tensor entries without restriction). Pass --trust (trust=True) "
            "only if you trust where the folder came from", unsafe)
