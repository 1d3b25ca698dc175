"""What one call in a pickle asks to allocate when it is loaded (``bytearray(1500000000)``, ``torch.FloatStorage(n)``),
judged against the restricted reader's limit.

The size is the one :mod:`ckptool.formats.unpickler` computes as it reads (:func:`~ckptool.formats.unpickler.
request_bytes`: the elements the call's arguments ask for times their element size) and the limit its
:data:`~ckptool.formats.unpickler.MAX_REQUEST_BYTES`; a call past it is a use of its global
(:func:`~ckptool.formats.nodes.use_key`: ``builtins.bytearray !alloc=1500000000``) that
:mod:`ckptool.model.allowlist` rates dangerous. ``sanitize`` asks it of each call node it meets, so that an allowed
global called as a memory bomb is never written back as allowed.
"""

from __future__ import annotations

from ckptool.formats.nodes import ALLOC, GlobalMeta, ReduceNode, qualified_name, use_key
from ckptool.formats.unpickler import MAX_REQUEST_BYTES, request_bytes

__all__ = ["oversized_use", "requested_bytes"]


def requested_bytes(obj: object) -> int:
    """The bytes the call node ``obj`` (a :class:`~ckptool.formats.nodes.ReduceNode` of a node graph) asks to
    allocate when loaded, beyond the data the file holds for it; 0 for anything else, or a call whose global
    allocates nothing sized by its arguments."""
    if isinstance(obj, ReduceNode) and isinstance(obj.func, GlobalMeta) and obj.func.sizing:
        return request_bytes(obj.func, obj.args)
    return 0


def oversized_use(obj: object) -> str | None:
    """The qualified use name (``builtins.bytearray !alloc=1500000000``, the name the restricted reader adds to a
    pickle's globals) of a call node ``obj`` that asks to allocate more than
    :data:`~ckptool.formats.unpickler.MAX_REQUEST_BYTES` bytes (:func:`requested_bytes`); None for any other
    object."""
    nbytes = requested_bytes(obj)
    if nbytes <= MAX_REQUEST_BYTES or not isinstance(obj, ReduceNode) or not isinstance(obj.func, GlobalMeta):
        return None
    return qualified_name(*use_key(obj.func.module, obj.func.name, f"{ALLOC}{nbytes}"))
