"""The names in the annotations of the public torch functions (``load_into``, ``load_training_state``, ``verify``),
with values at run time too, so that ``typing.get_type_hints(ckptool.load_into)`` resolves them.

Importing this module does not import torch. For type checkers ``torch`` and ``nn`` are the modules; at run time
they are stand-ins that import the module on first attribute access, which is when ``get_type_hints`` evaluates
``nn.Module``: where torch is installed the hints are torch's own classes, and where it is not they raise
``ModuleNotFoundError`` naming torch, as calling the function does (never a ``NameError``). A module whose public
functions are annotated with these names imports them from here (outside ``TYPE_CHECKING``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ForwardRef, Literal, Union


class ModuleOnFirstUse:
    """Stands for the module ``name``, imported when an attribute is first read: a name for annotations that
    ``typing.get_type_hints`` resolves without the module being imported before (torch here; the pools and the scan
    cache in :mod:`ckptool.ops.scan.many`)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


if TYPE_CHECKING:  # pragma: no cover
    from typing import TypeAlias

    import torch as torch
    from torch import nn as nn

    #: what the loading functions accept as a device: ``"cpu"``, ``"cuda:1"``, a CUDA index, a ``torch.device``
    DeviceLike: TypeAlias = str | int | torch.device
    #: how keys are matched to the model's: ``"auto"`` (reconcile wrapper prefixes), None / False / ``"none"``
    #: (keys as saved), or the prefix (or prefixes, in order) to strip
    PrefixSpec: TypeAlias = str | Sequence[str] | Literal[False] | None
else:
    torch = ModuleOnFirstUse("torch")
    nn = ModuleOnFirstUse("torch.nn")
    # the forward reference is evaluated in this module (whose ``torch`` imports torch), wherever the alias is used
    DeviceLike = Union[str, int, ForwardRef("torch.device", module=__name__)]  # noqa: UP007 (a run-time value)
    PrefixSpec = Union[str, Sequence[str], Literal[False], None]  # noqa: UP007

__all__ = ["DeviceLike", "ModuleOnFirstUse", "PrefixSpec", "nn", "torch"]
