"""``trust`` covers classes, never gadgets: the gate in front of every unrestricted unpickle ckptool does.

``--trust`` (``trust=True``) lets a load import the classes a checkpoint names (a model class, ``DataParallel``,
``argparse.Namespace``: what ``ckptool scan`` calls needs-trust). It never lets it call what ``ckptool scan`` rates
**dangerous** (``os.system``, ``builtins.eval``, a function on no list, a memory bomb; TorchScript that calls an
unregistered op, a native library or Python module shipped in the archive): such a file is refused, in two places
that use scan's own verdict, the one classification of :func:`ckptool.model.allowlist.classify_global`:

1. before anything is read by torch, :func:`refuse_dangerous` scans the input as ``ckptool scan`` does
   (:func:`ckptool.scanning.entry.scan_file`: every pickle of the file, hidden ones too, read by ckptool's restricted
   reader, nothing imported) and raises an :class:`~ckptool.errors.UnsafeCheckpointError` naming the first
   dangerous global and the pickle it is in;
2. every unrestricted unpickle (``torch.load(weights_only=False)``, ``pickle.load``) is given :data:`GUARDED`
   as its ``pickle_module``: its :class:`GuardedUnpickler` refuses a dangerous global in ``find_class``, before its
   module is imported (defence in depth: a pickle the scan could not see, or a loader called directly).

To load such a file anyway, one must do it by hand, outside ckptool, at one's own risk
(``torch.load(path, weights_only=False)``): ``docs/commands/verify.md``, *Safety*.

The scan engine (:mod:`ckptool.scanning`) is the reading layer below this one, imported directly.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from types import SimpleNamespace
from typing import IO, Any

from ckptool.errors import UnsafeCheckpointError
from ckptool.formats.nodes import qualified_name
from ckptool.model.allowlist import DANGEROUS, classify_global
from ckptool.readers import Opened
from ckptool.scanning.entry import scan_file, scans_as_one

__all__ = ["GUARDED", "GadgetRefused", "GuardedUnpickler", "gadget_error", "guarded", "refuse_dangerous",
           "refuse_gadgets"]

#: what a refusal tells the user to do instead
BY_HAND = ("--trust (trust=True) trusts the classes a checkpoint names, never such a gadget, so nothing was loaded; "
           "see `ckptool scan {path}`, and if you must load it, do it by hand outside ckptool at your own risk: "
           "torch.load(path, weights_only=False)")


class GadgetRefused(UnsafeCheckpointError):
    """The refusal of a dangerous global: ``path`` (empty when the unpickler that refused it did not know it),
    ``name`` (``module.qualname``), ``where`` (a zip member, ``pickle at byte 0``, a DCP record; may be empty) and
    ``reason`` (what it can do, :func:`~ckptool.model.allowlist.classify_global`)."""

    def __init__(self, path: str, name: str, where: str, reason: str) -> None:
        place = f" in {where}" if where else ""
        super().__init__(f"{path or 'the pickle'}: {name}{place} is rated DANGEROUS by `ckptool scan` ({reason}); "
                         f"{BY_HAND.format(path=path or 'FILE')}", [name])
        self.path, self.name, self.where, self.reason = path, name, where, reason


def gadget_error(path: str, name: str, where: str, reason: str) -> GadgetRefused:
    """The one-line refusal of the dangerous global ``name`` (``module.qualname``) found in ``where`` (a zip
    member, ``pickle at byte 0``, a DCP record) of ``path``, ``reason`` saying what it can do."""
    return GadgetRefused(path, name, where, reason)


@contextlib.contextmanager
def guarded(path: str, where: str = "") -> Iterator[None]:
    """Around an unrestricted load of ``path`` through :data:`GUARDED`: a refusal of its unpickler (which does not
    know the file) is raised again naming ``path`` (and ``where``)."""
    try:
        yield
    except GadgetRefused as e:
        if e.path:
            raise
        raise gadget_error(path, e.name, where, e.reason) from None


def refuse_gadgets(path: str, names: list[str], where: str = "") -> None:
    """Raise :func:`gadget_error` for the first of ``names`` (globals of one pickle, ``module.qualname``, uses
    included: :func:`ckptool.formats.nodes.use_key`) that :func:`~ckptool.model.allowlist.classify_global` rates
    dangerous; return when none is.

    Raises:
        UnsafeCheckpointError: a dangerous global.
    """
    for name in names:
        status, reason = classify_global(name)
        if status == DANGEROUS:
            raise gadget_error(path, name, where, reason)


def refuse_dangerous(target: str | Opened) -> None:
    """Refuse (before any loader runs) a file, or DCP folder, that ``ckptool scan`` rates dangerous: the first
    dangerous global (with the pickle it is in), else the first dangerous code finding (with its member). Other
    folders (a sharded set, a DeepSpeed folder) are not scanned here: each file of theirs that is unpickled with
    ``trust`` is, when its loader opens it. An input scan cannot read is left to the loader, which reports it.

    Raises:
        UnsafeCheckpointError: the scan found something dangerous.
    """
    if isinstance(target, Opened):
        target = target.target
    if not scans_as_one(target):
        return
    scan = scan_file(target)
    for g in scan.globals:
        if g.level == DANGEROUS:
            raise gadget_error(target, g.name, g.where[0] if g.where else "", g.reason)
    for c in scan.code:
        if c.level == DANGEROUS:
            raise UnsafeCheckpointError(
                f"{target}: the {c.kind} {c.detail or ''} in {c.member} is rated DANGEROUS by `ckptool scan` "
                f"({c.reason}); {BY_HAND.format(path=target)}".replace("  ", " "), [c.member])


class GuardedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` refuses every global ``ckptool scan`` rates dangerous (by
    :func:`~ckptool.model.allowlist.classify_global`, Python 2 names mapped first), before its module is imported.
    torch's ``UnpicklerWrapper`` subclasses it when it is the ``pickle_module``'s ``Unpickler``.

    Raises (from ``load``):
        UnsafeCheckpointError: a dangerous global.
    """

    def find_class(self, module: str, name: str) -> Any:
        full = qualified_name(module, name)
        status, reason = classify_global(full)
        if status == DANGEROUS:
            raise GadgetRefused("", full, "", reason)
        return super().find_class(module, name)


def _load(file: IO[bytes], **kwargs: Any) -> Any:
    return GuardedUnpickler(file, **kwargs).load()


def _loads(data: bytes, **kwargs: Any) -> Any:
    return GuardedUnpickler(io.BytesIO(data), **kwargs).load()


#: the ``pickle_module`` of every unrestricted ``torch.load`` (and ``pickle.load``) ckptool does with ``trust``:
#: ``Unpickler`` is :class:`GuardedUnpickler`, ``load`` / ``loads`` use it (torch's legacy reader calls ``load``)
GUARDED = SimpleNamespace(__name__="ckptool_guarded_pickle", Unpickler=GuardedUnpickler, load=_load, loads=_loads,
                          UnpicklingError=pickle.UnpicklingError, HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL)
