"""``torch.export`` archives (``.pt2``) for ``inspect`` and ``extract-state-dict``, read without torch and without
running anything (the archive layout is described in :mod:`ckptool.formats.pt2`).

* :func:`describe_pt2` is what ``ckptool inspect`` shows: every weight and constant (FQN, shape, dtype, device,
  bytes, stride, storage offset, the member holding its storage) from the payload configs, the program's
  signature from its serialized JSON, the archive's versions, and the globals of the members a loader unpickles
  (read by :func:`ckptool.scanning.entry.scan_file`: nothing imported or run).
* ``extract-state-dict`` and ``convert`` of a ``.pt2`` (:func:`ckptool.ops.extract.extract_state_dict`,
  :mod:`ckptool.readers.read_pt2`) write the program's state_dict (parameters and persistent buffers, as
  ``torch.export.load(path).state_dict``), or with ``key="constants"`` its constants: tensor bytes copied from the
  archive, never decoded.

Tensor keys: the FQN for the weights, ``constants.<FQN>`` for constants (tensor constants and non-persistent
buffers); an archive of several programs prefixes both with ``<program name>.``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ckptool.ops.inspect.info import TensorInfo
from ckptool.ops.inspect.values import ValueInfo
from ckptool.readers import Opened, open_checkpoint
from ckptool.readers.structures import Payload, Pt2Archive
from ckptool.scanning.entry import GlobalFinding, ScanResult, scan_file

__all__ = ["Pt2Description", "describe_pt2", "tensor_key"]


@dataclass
class Pt2Description:
    """What :func:`describe_pt2` read: the ``archive``; its ``tensors`` as ``inspect`` lists them
    (:class:`~ckptool.ops.inspect.info.TensorInfo`: weights first, then constants, per program; a raw payload's
    storage key is its member, a pickled one has none); ``storages``: member name -> ``(location tag, dtype,
    bytes)`` of every raw payload member, each once; ``state_dicts``: dotted path -> keys of each program's
    state_dict; ``programs``: each program's signature (:meth:`ckptool.formats.pt2.Program.signature`);
    ``metadata``: the archive's version records; ``globals``: the globals of its pickled members as ``ckptool
    scan`` classifies them; ``values``: the pickled objects (not read); ``notes``: what ckptool did not read."""

    archive: Pt2Archive
    tensors: list[TensorInfo] = field(default_factory=list)
    storages: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    state_dicts: dict[str, list[str]] = field(default_factory=dict)
    programs: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    globals: list[GlobalFinding] = field(default_factory=list)
    values: list[ValueInfo] = field(default_factory=list)


def tensor_key(arch: Pt2Archive, program: str, fqn: str, weight: bool) -> str:
    """The key ``inspect`` shows for ``fqn`` of ``program``: the FQN for a weight, ``constants.<FQN>`` for a
    constant, prefixed by ``<program>.`` when the archive holds several programs."""
    key = fqn if weight else f"constants.{fqn}"
    return key if len(arch.programs) == 1 else f"{program}.{key}"


def _row(key: str, p: Payload) -> TensorInfo:
    """The ``inspect`` row of the tensor payload ``p`` under ``key``."""
    return TensorInfo(key, list(p.shape), p.dtype or "unknown", p.device, p.nbytes, list(p.stride), p.storage_offset,
                      None if p.pickled else p.member, p.requires_grad)


def describe_pt2(path: str | os.PathLike[str] | Opened, scan: ScanResult | None = None) -> Pt2Description:
    """Read the ``torch.export`` archive at ``path`` (or opened already: its structure is read once, by
    :meth:`ckptool.readers.Opened.pt2`) for ``inspect``: no tensor bytes, nothing unpickled (pickled members are
    only scanned). ``scan``: the :func:`ckptool.scanning.entry.scan_file` of the same archive when the caller has it
    (``inspect`` shows it too), so that the archive is scanned once; else it is scanned here.

    Raises:
        NotACheckpointError / UnsupportedError / CorruptCheckpointError: see
            :func:`ckptool.formats.pt2.read_pt2` (newer archive or schema versions, legacy layout, damage).
    """
    o = path if isinstance(path, Opened) else open_checkpoint(path)
    arch = o.pt2()
    d = Pt2Description(arch)
    d.metadata = {"archive_version": arch.version}
    for prog in arch.programs:
        sig = prog.signature()
        d.programs.append(sig)
        pre = "" if len(arch.programs) == 1 else f"{prog.name}."
        d.metadata[f"{pre}schema_version"] = prog.schema_version
        if prog.torch_version:
            d.metadata[f"{pre}torch_version"] = prog.torch_version
        for weight, payloads in ((True, prog.weights), (False, prog.constants)):
            for p in payloads:
                key = tensor_key(arch, prog.name, p.fqn, weight)
                if p.kind == "object":
                    d.values.append(ValueInfo(key, "object", f"pickled object in {p.member} (not read)"))
                    continue
                d.tensors.append(_row(key, p))
                if not p.pickled:
                    d.storages.setdefault(p.member, (p.device, p.dtype or "unknown", p.record_size))
        d.state_dicts[prog.name if len(arch.programs) > 1 else ""] = [
            tensor_key(arch, prog.name, p.fqn, True) for p in prog.weights]
    if arch.aoti:
        d.metadata["aotinductor_members"] = str(len(arch.aoti))
    d.globals = (scan if scan is not None else scan_file(o.target)).globals
    return d
