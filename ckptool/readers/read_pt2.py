"""Reading a ``torch.export`` archive (``.pt2``) for ``convert`` and ``extract-state-dict``: the weights (or the
constants) of its program as a :class:`~ckptool.formats.tensors.Source`, no tensor bytes read.

Each raw payload member of the archive is the whole untyped storage of one or more tensors
(:mod:`ckptool.formats.pt2`), so it becomes one :class:`~ckptool.formats.tensors.Storage` at the member's data
offset, and each tensor a view of it with the offset, shape and strides of its ``tensor_meta``: the output equals
what ``torch.export.load(path).state_dict`` (or ``.constants``) holds, storage sharing included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptool.errors import UnsupportedError, UsageError
from ckptool.formats import detect as formats
from ckptool.formats.pt2 import Payload, Program, Pt2Archive, read_pt2
from ckptool.formats.tensors import Source, Storage, Tensor
from ckptool.formats.zipdir import data_offset
from ckptool.readers.reader import Reader

if TYPE_CHECKING:
    from ckptool.readers import Opened


def read_archive(path: str) -> Pt2Archive:
    """:func:`ckptool.formats.pt2.read_pt2` of ``path`` (its zip directory read once, shared with detection).

    Raises: what :func:`ckptool.formats.pt2.read_pt2` raises.
    """
    return read_pt2(path, formats.zip_entries(path))


#: the two mappings of a program that ``key`` selects (``state_dict`` by default)
SELECTIONS = ("state_dict", "constants")


def selections(arch: Pt2Archive) -> dict[str, tuple[Program, str]]:
    """Dotted path -> ``(program, "state_dict" | "constants")`` of every mapping ``key`` may select: ``state_dict``
    and ``constants`` for an archive of one program, ``<name>.state_dict`` / ``<name>.constants`` for several."""
    out: dict[str, tuple[Program, str]] = {}
    for prog in arch.programs:
        pre = "" if len(arch.programs) == 1 else f"{prog.name}."
        for sel in SELECTIONS:
            out[pre + sel] = (prog, sel)
    return out


def _describe(payloads: list[Payload], what: str) -> str:
    objs = sum(p.kind == "object" for p in payloads)
    return f"{what} ({len(payloads) - objs} tensors" + (f", {objs} objects)" if objs else ")")


def pt2_source(path: str, key: str | None, arch: Pt2Archive | None = None) -> Source:
    """The program's ``state_dict`` (parameters and persistent buffers, as ``torch.export.load(path).state_dict``),
    or with ``key="constants"`` its lifted tensor constants and non-persistent buffers (``.constants``), as a
    :class:`Source` whose storages are the archive's raw payload members. Script and opaque objects among the
    constants are skipped (reported in ``skipped``). ``arch``: the archive's structure when read already
    (:meth:`ckptool.readers.Opened.pt2`), else read here (:func:`read_archive`).

    Raises:
        UsageError: ``key`` names no mapping (the error lists them); several programs and no ``key``.
        UnsupportedError: a selected tensor is pickled in the archive (a tensor subclass, which only
            ``torch.load(weights_only=False)`` rebuilds); an empty selection; and what :func:`read_archive` raises.
        CorruptCheckpointError: a damaged archive.
    """
    arch = arch if arch is not None else read_archive(path)
    sels = selections(arch)
    listing = ", ".join(sels)
    if key is None:
        if len(arch.programs) > 1:
            raise UsageError(f"{path} holds {len(arch.programs)} exported programs; choose a mapping with --key "
                             f"PATH (key=...): {listing}")
        key = "state_dict"
    if key not in sels:
        raise UsageError(f"{path}: no mapping {key!r} in this torch.export archive (--key); choose one of {listing}")
    prog, sel = sels[key]
    chosen = prog.weights if sel == "state_dict" else prog.constants
    src = Source(path, formats.PT2, [], key=key)
    for other, (p2, s2) in sels.items():
        if other != key:
            src.left_out.append(f"{other}: " + _describe(p2.weights if s2 == "state_dict" else p2.constants,
                                                         "parameters and persistent buffers" if s2 == "state_dict"
                                                         else "tensor constants and non-persistent buffers"))
    src.notes.append(f"the exported program's graph (models/{prog.name}.json) is not part of the output: this is "
                     f"its {'state_dict' if sel == 'state_dict' else 'constants'} only")
    storages: dict[str, Storage] = {}
    with open(path, "rb") as f:
        for i, p in enumerate(chosen):
            if p.kind == "object":
                src.skipped.append(f"{p.fqn}: pickled object ({p.member}, not read)")
                continue
            if p.pickled:
                raise UnsupportedError(
                    f"{path}: {p.fqn!r} is a tensor subclass pickled in member {p.member} (torch.export.load "
                    "unpickles it with weights_only=False); ckptool does not run pickles. Load the archive with "
                    "torch.export.load only if you trust it, then save ep.state_dict with torch.save")
            assert p.dtype is not None  # tensor payloads carry a dtype (formats.pt2 checks it)
            st = storages.get(p.member)
            if st is None:
                e = arch.members[p.member]
                st = storages[p.member] = Storage(path, data_offset(f, e, path), e.file_size, p.dtype, p.device,
                                                  e.crc)
            elif st.dtype != p.dtype:
                raise UnsupportedError(f"{path}: {p.fqn!r} views member {p.member} as {p.dtype} while another tensor "
                                       f"views it as {st.dtype}; such an archive cannot be converted")
            src.tensors.append(Tensor(p.fqn, p.fqn, p.dtype, p.shape, p.stride, p.storage_offset, st, False, i))
    if not src.tensors and not src.skipped:
        other = "constants" if sel == "state_dict" else "state_dict"
        raise UnsupportedError(f"{path}: the program's {key} holds no tensors; nothing to convert (see --key {other})")
    return src


class Pt2Reader(Reader):
    """A torch.export archive (the registry's ``reader``): its programs' state_dicts and constants."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened)
        self._archive: Pt2Archive | None = None

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """:func:`pt2_source` over the archive's structure, read once (:meth:`~ckptool.readers.Opened.pt2`)."""
        return pt2_source(self.opened.target, key, self.pt2())

    def pt2(self) -> Pt2Archive:
        """The archive's structure (:func:`ckptool.formats.pt2.read_pt2`: version records, payload configs,
        signatures; nothing unpickled), read once."""
        if self._archive is None:
            self._archive = read_pt2(self.opened.target, self.opened.zip_entries())
        return self._archive
