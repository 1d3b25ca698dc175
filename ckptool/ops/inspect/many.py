"""``ckptool inspect --json`` of many checkpoints at once (several paths, folders, URL prefixes, ``--jobs N``,
``--jsonl``): one task per checkpoint, on the machinery of ``scan``'s many-checkpoint mode
(:class:`ckptool.ops.scan.many.ManyRun`: the same expansion of paths, executors and window).

* What is inspected: each path as :func:`ckptool.ops.scan.many.expand` gives it, except that a local folder that is
  one checkpoint as given (a folder holding a sharded set's index, a DCP, DeepSpeed or Megatron folder:
  :func:`is_one_checkpoint`) is one checkpoint; any other folder is walked as ``scan`` walks it (each checkpoint
  file, by its name or first bytes; a DCP folder as one), and a URL prefix lists its objects (those that are no
  checkpoint by their content are skipped).
* Each task (:func:`inspect_target`) returns an :class:`InspectRow`: the checkpoint's ``inspect --json`` object as
  one line of JSON text (small to send back from a process), or the error that stopped it. A problem of one
  checkpoint is its row, never the end of the run.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from ckptool import _source as source
from ckptool.errors import CkptError, UsageError
from ckptool.ops.inspect.entry import SCHEMA, inspect
from ckptool.ops.inspect.values import ALL_VALUES
from ckptool.ops.scan.many import ManyRun, Target, not_a_checkpoint, target_reads
from ckptool.readers import open_checkpoint

__all__ = ["InspectRow", "InspectRun", "inspect_target", "is_one_checkpoint"]


@dataclass(frozen=True)
class InspectRow:
    """What one task of a many-checkpoint ``inspect`` gave: ``path`` (as found), and ``json``: the object
    ``ckptool inspect --json`` prints for it (``"schema": "ckptool.inspect/3"``, its ``"path"`` and everything
    else), as one line of text; or ``error``: why it could not be read."""

    path: str
    json: str | None = None
    error: str | None = None

    def line(self) -> str:
        """The row as one line of JSON: :attr:`json`, or ``{"schema", "path", "error"}``."""
        if self.json is not None:
            return self.json
        return json.dumps({"schema": SCHEMA, "path": self.path, "error": self.error})


def inspect_target(t: Target, show_all: bool = False) -> InspectRow | None:
    """Inspect one :class:`~ckptool.ops.scan.many.Target` (the task each executor runs; ``show_all``: the limits of
    ``--all``): its row, with ``bytes_read`` the bytes this thread transferred for a URL; None for an object under a
    prefix that is no checkpoint by its content. Never raises for a problem of the checkpoint or the network: the
    row's ``error`` says it."""
    if t.error is not None:
        return InspectRow(t.path, error=t.error)
    start = source.thread_bytes_transferred()
    try:
        with target_reads(t):
            if not_a_checkpoint(t):
                return None
            info = inspect(t.path, ALL_VALUES) if show_all else inspect(t.path)
        if source.is_url(t.path):  # this task's own bytes, not those of the tasks beside it in other threads
            info.bytes_read = source.thread_bytes_transferred() - start
        return InspectRow(t.path, json="".join(info.json_pieces(indent=None)))
    except (CkptError, OSError, RecursionError) as e:  # what the command itself reports as its Error: line
        return InspectRow(t.path, error=str(e) or type(e).__name__)


def is_one_checkpoint(folder: str) -> bool:
    """Whether the local ``folder`` is one checkpoint as given, rather than a folder to walk: what
    :func:`ckptool.readers.open_checkpoint` reads as a set (a folder holding one ``*.index.json``) or a folder (a
    DCP, DeepSpeed or Megatron folder: the registry entry's ``kind``). A folder that holds one weights file beside
    others (``inspect FOLDER`` reads that file) is walked: the file is one of its rows."""
    try:
        return open_checkpoint(folder).spec.kind != "file"
    except UsageError:
        return False
    except (CkptError, OSError):
        return True  # a checkpoint folder that is damaged: its row says why


def _failed(t: Target, why: str) -> InspectRow:
    return InspectRow(t.path, error=f"the inspect task failed: {why}")


class InspectRun(ManyRun[InspectRow]):
    """One ``inspect`` of many checkpoints: :class:`~ckptool.ops.scan.many.ManyRun` of :func:`inspect_target`
    (``task`` given: the same with ``show_all`` bound, a picklable ``functools.partial``)."""

    def __init__(self, paths: tuple[str, ...], *, show_all: bool = False) -> None:
        task = functools.partial(inspect_target, show_all=True) if show_all else inspect_target
        super().__init__(paths, task, _failed, whole=is_one_checkpoint, configs=False)
