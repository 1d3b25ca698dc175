"""Which part of each checkpoint ``ckptool diff`` compares: the whole file, or the state_dict ``convert`` picks.

A training checkpoint (``{"epoch": 1, "model_state_dict": ..., "optimizer_state_dict": ...}``) compared with a bare
state_dict (safetensors, a sharded set, a DCP folder, a ``.pt2`` archive, a DeepSpeed folder, a torch file whose
state_dict is the top level) is compared through the state_dict that ``convert`` would convert from it
(:func:`ckptool.ops.convert.read_torch.select_state_dict`, the same choice); two torch files whose state_dicts sit
at the same place are compared whole, as they are. ``key`` (``--key``) selects that state_dict on every torch side
where it resolves (:func:`ckptool.model.paths.resolve_path`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptool.errors import UnsupportedError, UsageError
from ckptool.formats import detect as formats
from ckptool.formats.deepspeed import is_deepspeed_folder
from ckptool.formats.sharded import is_checkpoint_set, set_kind
from ckptool.formats.torchfile import Checkpoint, read_checkpoint
from ckptool.model.graph import find_state_dicts, is_module, mapping_items
from ckptool.model.paths import resolve_path
from ckptool.ops.convert.read_torch import select_state_dict

__all__ = ["Probe", "choose_keys", "probe"]

#: the kinds of side :func:`probe` tells apart (``torch``: a torch zip, legacy or TorchScript file)
DEEPSPEED, INDEX, DCP, SAFETENSORS, PT2, TORCH = "deepspeed", "index", "dcp", "safetensors", "pt2", "torch"


@dataclass
class Probe:
    """One side of a diff, its format detected once: ``path`` (a set's file or index once resolved), ``kind`` (one
    of the constants above), ``fmt`` (:mod:`ckptool.formats.detect`'s name for a torch file) and, for a torch file,
    its parsed pickle ``ck`` (nothing imported or run)."""

    path: str
    kind: str
    fmt: str = ""
    ck: Checkpoint | None = None

    @property
    def selectable(self) -> bool:
        """A torch.save file (zip or legacy): a state_dict can be chosen in it, as ``convert`` does."""
        return self.ck is not None and self.fmt in (formats.TORCH_ZIP, formats.TORCH_LEGACY)


def probe(path: str) -> Probe:
    """What ``path`` is, detected once, in the order ``convert`` tries them (a DeepSpeed folder first, then a
    checkpoint set, then the file's format); a torch file's pickle is read (:func:`read_checkpoint`).

    Raises:
        UsageError / NotACheckpointError / CorruptCheckpointError: as :func:`ckptool.formats.sharded.set_kind`,
            :func:`ckptool.formats.detect.detect_format` and :func:`read_checkpoint` raise.
    """
    if is_deepspeed_folder(path):
        return Probe(path, DEEPSPEED)
    if is_checkpoint_set(path):
        kind, set_path = set_kind(path)
        if kind == "file":
            return probe(set_path)
        return Probe(set_path, INDEX if kind == "index" else DCP)
    fmt = formats.detect_format(path)
    if fmt == formats.SAFETENSORS:
        return Probe(path, SAFETENSORS, fmt)
    if fmt == formats.PT2:
        return Probe(path, PT2, fmt)
    return Probe(path, TORCH, fmt, read_checkpoint(path, fmt))


def _auto(p: Probe) -> str | None:
    """The dotted path of the state_dict ``convert`` picks in ``p`` (``""``: the top level), None when ``p`` is no
    torch.save file or holds no single likely state_dict."""
    if not p.selectable:
        return None
    assert p.ck is not None
    try:
        return select_state_dict(p.ck.root, None, p.path).path
    except (UsageError, UnsupportedError):
        return None


def _resolves(p: Probe, key: str) -> bool:
    """True when ``key`` names a mapping or a pickled module in the torch file ``p``."""
    if not p.selectable:
        return False
    assert p.ck is not None
    try:
        trail = resolve_path(p.ck.root, key)
    except KeyError:
        return False
    obj = trail[-1].child if trail else p.ck.root
    return is_module(obj) or mapping_items(obj) is not None


def _listing(p: Probe) -> str:
    if not p.selectable:
        return f"{p.path} is {p.kind}: --key does not apply to it"
    assert p.ck is not None
    found = ", ".join(sd.path or "(top level)" for sd in find_state_dicts(p.ck.root)) or "none"
    return f"state_dicts in {p.path}: {found}"


def choose_keys(a: Probe, b: Probe, key: str | None) -> tuple[str | None, str | None]:
    """``(key in A, key in B)``: the dotted path of the state_dict to compare on each side, None to compare the
    side whole (any side that is not a torch.save file, and a torch file whose state_dict is the top level).

    With ``key``: that path on each torch side where it resolves; a torch side where it does not is then
    compared through its automatically chosen state_dict. Without: a torch side's automatically chosen state_dict
    (``convert``'s choice) when the other side is a bare state_dict, or when both sides are training checkpoints
    whose state_dicts sit at different paths; otherwise both sides whole.

    Raises:
        UsageError: ``key`` resolves on neither side (the message lists the state_dicts of each).
    """
    auto_a, auto_b = _auto(a), _auto(b)
    if key is not None:
        ka = key if _resolves(a, key) else None
        kb = key if _resolves(b, key) else None
        if ka is None and kb is None:
            raise UsageError(f"--key {key!r} names no state_dict in A nor in B ({_listing(a)}; {_listing(b)}); "
                             "pass a dotted path that one of them holds")
        return ka if ka is not None else (auto_a or None), kb if kb is not None else (auto_b or None)
    bare_a = a.ck is None or auto_a == ""
    bare_b = b.ck is None or auto_b == ""
    ka = auto_a if auto_a and (bare_b or (auto_b and auto_b != auto_a)) else None
    kb = auto_b if auto_b and (bare_a or (auto_a and auto_a != auto_b)) else None
    return ka, kb
