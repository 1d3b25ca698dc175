"""``torch.export`` archives (``.pt2``) for ``inspect`` and ``extract-state-dict``, read without torch and without
running anything (the archive layout is described in :mod:`ckptool.formats.pt2`).

* :func:`describe_pt2` is what ``ckptool inspect`` shows: every weight and constant (FQN, shape, dtype, device,
  bytes, stride, storage offset, the member holding its storage) from the payload configs, the program's
  signature from its serialized JSON, the archive's versions, and the globals of the members a loader unpickles
  (read by :func:`ckptool.ops.scan.scan_file`: nothing imported or run).
* :func:`extract_pt2` is ``extract-state-dict`` of a ``.pt2``: the program's state_dict (parameters and persistent
  buffers, as ``torch.export.load(path).state_dict``), or with ``key="constants"`` its constants, written by
  ``convert``'s writers (:func:`ckptool.ops.convert.convert`): tensor bytes copied from the archive, never decoded.

Tensor keys: the FQN for the weights, ``constants.<FQN>`` for constants (tensor constants and non-persistent
buffers); an archive of several programs prefixes both with ``<program name>.``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptool.formats.pt2 import Payload, Pt2Archive
from ckptool.model.keys import unwrap_keys
from ckptool.ops.convert import ConvertResult, convert
from ckptool.ops.convert.read_pt2 import pt2_source, read_archive
from ckptool.ops.inspect_values import ValueInfo
from ckptool.ops.scan import GlobalFinding, scan_file

__all__ = ["Pt2Description", "Pt2Extract", "Pt2Tensor", "describe_pt2", "extract_pt2", "tensor_key"]


@dataclass
class Pt2Tensor:
    """One tensor of the archive as ``inspect`` lists it: its ``key`` (see the module docstring), the
    :class:`~ckptool.formats.pt2.Payload` and whether it belongs to the state_dict (``weight``)."""

    key: str
    payload: Payload
    weight: bool


@dataclass
class Pt2Description:
    """What :func:`describe_pt2` read: the ``archive``; its ``tensors`` (weights first, then constants, per
    program); ``storages``: member name -> ``(location tag, dtype, bytes)`` of every raw payload member, each once;
    ``state_dicts``: dotted path -> keys of each program's state_dict; ``programs``: each program's signature
    (:meth:`ckptool.formats.pt2.Program.signature`); ``metadata``: the archive's version records; ``globals``: the
    globals of its pickled members as ``ckptool scan`` classifies them; ``values``: the pickled objects (not read);
    ``notes``: what ckptool did not read."""

    archive: Pt2Archive
    tensors: list[Pt2Tensor] = field(default_factory=list)
    storages: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    state_dicts: dict[str, list[str]] = field(default_factory=dict)
    programs: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    globals: list[GlobalFinding] = field(default_factory=list)
    values: list[ValueInfo] = field(default_factory=list)


@dataclass
class Pt2Extract:
    """What :func:`extract_pt2` wrote: the ``convert`` ``result``, the ``keys`` in order, the wrapper components
    ``removed`` by ``unwrap`` (``{component: key count}``) and the number of source ``storages`` (payload members)."""

    result: ConvertResult
    keys: list[str]
    removed: dict[str, int]
    storages: int


def tensor_key(arch: Pt2Archive, program: str, fqn: str, weight: bool) -> str:
    """The key ``inspect`` shows for ``fqn`` of ``program``: the FQN for a weight, ``constants.<FQN>`` for a
    constant, prefixed by ``<program>.`` when the archive holds several programs."""
    key = fqn if weight else f"constants.{fqn}"
    return key if len(arch.programs) == 1 else f"{program}.{key}"


def describe_pt2(path: str | os.PathLike[str]) -> Pt2Description:
    """Read the ``torch.export`` archive at ``path`` for ``inspect``: no tensor bytes, nothing unpickled (pickled
    members are only scanned).

    Raises:
        NotACheckpointError / UnsupportedError / CorruptCheckpointError: see
            :func:`ckptool.formats.pt2.read_pt2` (newer archive or schema versions, legacy layout, damage).
    """
    path = os.fspath(path)
    arch = read_archive(path)
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
                d.tensors.append(Pt2Tensor(key, p, weight))
                if not p.pickled:
                    d.storages.setdefault(p.member, (p.device, p.dtype or "unknown", p.record_size))
        d.state_dicts[prog.name if len(arch.programs) > 1 else ""] = [
            tensor_key(arch, prog.name, p.fqn, True) for p in prog.weights]
    if arch.aoti:
        d.metadata["aotinductor_members"] = str(len(arch.aoti))
    d.globals = scan_file(path).globals
    return d


def extract_pt2(src: str, dst: str, *, key: str | None, unwrap: bool, to: str | None,
                mapping: Mapping[str, str] | None, allow_missing: bool,
                progress: Callable[[int], None] | None) -> Pt2Extract:
    """Write the state_dict of the program in the ``.pt2`` ``src`` (or its constants, ``key="constants"``) to
    ``dst``: ``*.safetensors`` for safetensors, anything else torch's zip format, through
    :func:`ckptool.ops.convert.convert` (verified; ``unwrap``, ``to``, ``mapping``, ``allow_missing`` as there).
    ``progress(nbytes)`` is called with the bytes written since the last call.

    Returns a :class:`Pt2Extract`.

    Raises: what :func:`ckptool.ops.convert.convert` raises for a ``.pt2`` source.
    """
    source = pt2_source(src, key)
    names = [t.name for t in source.tensors]
    removed: dict[str, int] = {}
    if unwrap:
        renamed, removed = unwrap_keys(names)
        names = [renamed[n] for n in names]
    done = 0

    def tick(now: int, _total: int) -> None:
        nonlocal done
        if progress is not None and now > done:
            progress(now - done)
        done = max(done, now)

    fmt = "safetensors" if dst.endswith(".safetensors") else "torch"
    res = convert(src, dst, format=fmt, key=key, to=to, mapping=mapping, allow_missing=allow_missing, unwrap=unwrap,
                  progress=tick)
    return Pt2Extract(res, names, removed, len({id(t.storage) for t in source.tensors}))
