"""The budget every command that materialises tensors holds to: what it reads, allocates and writes is bounded
by the bytes the input holds.

A tensor saved as a view can show more elements than its storage holds: ``torch.zeros(1).expand(2**20, 2**20)``
is saved by ``torch.save`` as its 4-byte storage and a stride-0 view of 2^40 elements (4 TiB once made dense), and
a DCP ``.metadata`` can declare such a tensor over a record of a few bytes. Reading the structure of such a file
costs nothing (``inspect``, ``scan`` and ``remap`` copy storages, never views), but a command that makes a view
dense (``convert`` to safetensors or through torch, ``diff`` and ``report`` comparing values, ``average``, DCP
loads in ``verify`` and ``load_into``) would allocate and write what the view declares.

:class:`ExpandBudget` adds up, over the tensors a command will make dense, their dense bytes
(:attr:`ckptool.formats.tensors.Tensor.nbytes`) and the bytes of their distinct storages, and refuses, with one
:class:`~ckptool.errors.UnsupportedError` naming the most expanded tensor, its factor and ``--max-expand``, when
the dense bytes exceed ``max_expand`` times the storage bytes, above :data:`EXPAND_FLOOR`. Every real checkpoint
sits far below the default :data:`MAX_EXPAND`: a tensor, a slice or a transpose shows at most its storage, and tied
weights count each view in full (2x for an embedding tied to its head). The sum, not each tensor alone, is held
to the factor, so that many small expansions of one shared storage cannot add up to what one large one is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ckptool.errors import UnsupportedError, UsageError
from ckptool.formats.tensors import EXPAND_FLOOR, MAX_EXPAND, Tensor
from ckptool.model.units import human_bytes

__all__ = ["EXPAND_FLOOR", "MAX_EXPAND", "ExpandBudget", "check_expansion", "max_expand_value"]

#: the words that say how to lift the limit, per caller: the CLI flag and the Python keyword
FLAG = "--max-expand"


def max_expand_value(value: float | None) -> float:
    """``value`` as a limit: None -> :data:`MAX_EXPAND`; ``0`` or ``inf`` -> no limit (``math.inf``).

    Raises:
        UsageError: a negative or NaN value.
    """
    if value is None:
        return MAX_EXPAND
    if math.isnan(value) or value < 0:
        raise UsageError(f"--max-expand {value}: give a factor >= 1 (0 or inf: no limit)")
    return math.inf if value == 0 else float(value)


class ExpandBudget:
    """The dense bytes of the tensors :meth:`add` was given against ``max_expand`` (a factor, ``math.inf``: no
    limit; None: :data:`MAX_EXPAND`) times the bytes of their distinct storages (by identity), at least
    :data:`EXPAND_FLOOR`; ``where`` (the input's path) and ``doing`` (what the command would do with the tensors:
    ``"convert"``, ``"compare"``...) are named in the refusal."""

    def __init__(self, max_expand: float | None, where: str, doing: str) -> None:
        self.limit = max_expand_value(max_expand)
        self.where, self.doing = where, doing
        self.held = 0
        self.dense = 0
        self._seen: set[int] = set()
        self._worst: Tensor | None = None

    def add(self, tensors: Iterable[Tensor]) -> ExpandBudget:
        """Count ``tensors`` (their storages once each). Returns ``self``."""
        for t in tensors:
            if id(t.storage) not in self._seen:
                self._seen.add(id(t.storage))
                self.held += t.storage.nbytes
            self.dense += t.nbytes
            if self._worst is None or t.expansion > self._worst.expansion:
                self._worst = t
        return self

    def check(self) -> None:
        """Refuse when the dense bytes counted exceed the budget.

        Raises:
            UnsupportedError: naming the most expanded tensor (its shape, dtype, dense bytes, storage bytes and
                factor), the totals, and the ``--max-expand`` value that allows it.
        """
        if self.dense <= max(self.limit * self.held, EXPAND_FLOOR):
            return
        t = self._worst
        assert t is not None  # dense > 0: a tensor was added
        need = math.ceil(self.dense / max(self.held, 1)) + 1
        raise UnsupportedError(
            f"{self.where}: tensor {t.name!r} {list(t.shape)} ({t.dtype}) is {human_bytes(t.nbytes)} dense over a "
            f"storage of {human_bytes(t.storage.nbytes)} ({t.expansion:.3g}x: a view that repeats elements, as "
            f"expand() or broadcasting saves); to {self.doing} these tensors would take {human_bytes(self.dense)} "
            f"from the {human_bytes(self.held)} the input holds, over the {FLAG} limit of {self.limit:g}x. "
            f"If that is meant, pass {FLAG} {need} (max_expand={need} in Python)")


def check_expansion(tensors: Iterable[Tensor], max_expand: float | None, where: str, doing: str) -> None:
    """:class:`ExpandBudget` over ``tensors``: refuse when their dense bytes exceed ``max_expand`` (None: the
    default :data:`MAX_EXPAND`) times the bytes of their storages.

    Raises:
        UnsupportedError: see :meth:`ExpandBudget.check`.
        UsageError: a negative ``max_expand``.
    """
    ExpandBudget(max_expand, where, doing).add(tensors).check()
