"""The one output resolver (issue 47): from ``-o`` (or a command's default name) and the source, whether the output
is a file or a folder, its format (:func:`ckptool.writers.registry.choose_format`), the file a folder output holds,
and what already there it would replace. The rules, said once in ``docs/outputs.md``:

- ``-o`` names a **folder** when it ends in a separator (``out/``), is an existing folder, has no suffix at all
  (``out``), or does not end in a format's suffix while the source is a folder (a model folder, a sharded set, a
  DCP folder); otherwise a **file**, whose suffix (compared case-insensitively) names the format. A file name with a
  suffix that names no format is refused with the list of known suffixes, unless ``--format`` names one.
- A folder output holds the file ``transformers`` names for the format (``model.safetensors``,
  ``pytorch_model.bin``), or the input file's own name for a rewrite of one file (``remap``, the prefix commands,
  ``rename``, ``filter``, ``sanitize``); other files in the folder are never touched.
- Nothing that exists is replaced without ``--force``: the file, or in a folder any file of the set of that name
  (``model.safetensors``, ``model-00001-of-00002.safetensors``..., ``model.safetensors.index.json``); with
  ``--force`` only that set is replaced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptool import _source as source
from ckptool.errors import UsageError
from ckptool.formats.sharded import SetLayout
from ckptool.writers.registry import Writer, choose_format, suffix_writer


@dataclass(frozen=True)
class Output:
    """What a command writes for ``-o given``: ``path`` (the file it writes; for a format written as a folder, the
    folder), ``folder`` (the output folder when ``-o`` names one, else None), ``writer`` (the format; None for an
    output that is no checkpoint, such as ``report``'s HTML)."""

    given: str
    path: str
    folder: str | None
    writer: Writer | None

    @property
    def is_folder(self) -> bool:
        """``-o`` names a folder (see the module docstring)."""
        return self.folder is not None


def is_folder_form(dst: str, *, source_is_folder: bool = False) -> bool:
    """Whether ``dst`` names a folder output (the rule in the module docstring); a URL never does."""
    if source.is_url(dst):
        return False
    if dst.endswith(("/", os.sep)) or os.path.isdir(dst):
        return True
    if suffix_writer(dst) is not None:
        return False
    return "." not in os.path.basename(dst).lstrip(".") or source_is_folder


def resolve_output(dst: str, *, fmt: str | None = None, default_format: str | None = None,
                   file_name: str | None = None, source_is_folder: bool = False,
                   checkpoint: bool = True) -> Output:
    """Resolve ``-o dst`` (see the module docstring). ``fmt``: ``--format``; ``default_format``: the format when
    neither ``fmt`` nor a suffix names one (a rewrite keeps its input's); ``file_name``: the file a folder output
    holds (default: the format's :attr:`~ckptool.writers.registry.Writer.folder_file`); ``checkpoint=False``: the
    output is no checkpoint (``report``), only file or folder is decided and ``file_name`` is required.

    Raises:
        UsageError: ``dst`` is a URL ending in ``/`` (an output URL takes one file); what
            :func:`~ckptool.writers.registry.choose_format` raises.
    """
    if source.is_url(dst) and dst.endswith("/"):
        raise UsageError(f"{dst}: an output URL names one file; write a folder locally and upload it")
    folder = is_folder_form(dst, source_is_folder=source_is_folder)
    w = choose_format(dst, fmt, folder=folder, default=default_format) if checkpoint else None
    if not folder or (w is not None and w.is_folder):
        return Output(dst, dst, dst if folder else None, w)
    name = file_name or (w.folder_file if w is not None else "")
    if not name:
        raise UsageError(f"{dst}: name the output file")
    return Output(dst, os.path.join(dst, name), dst, w)


def set_members(folder: str, file_name: str) -> list[str]:
    """The files in ``folder`` that belong to the set named ``file_name``: the file itself, its shards
    (``<stem>-00001-of-0000N<ext>``) and index (``<file_name>.index.json``), sorted; none when ``folder`` is not a
    folder."""
    if not os.path.isdir(folder):
        return []
    stem, ext = os.path.splitext(file_name)
    layout = SetLayout(folder, stem, ext, is_output_folder=True)
    return sorted(n for n in os.listdir(folder) if layout.is_member(n))


def refuse_replacing(out: Output, *, force: bool) -> None:
    """Refuse, unless ``force``, an output that would replace something: the file ``out.path``, or in a folder any
    file of the set named as ``out.path`` (:func:`set_members`).

    Raises:
        UsageError: something is in the way (the message names it and says to pass --force).
    """
    if force:
        return
    if out.folder is not None and out.path != out.folder:
        existing = set_members(out.folder, os.path.basename(out.path))
        if existing:
            raise UsageError(f"{out.folder} already holds {', '.join(existing[:3])}"
                             f"{' ...' if len(existing) > 3 else ''}; pass --force to replace it, or choose "
                             "another -o path")
        return
    exists = source.kind(out.path) == "file" if source.is_url(out.path) else os.path.isfile(out.path)
    if exists:
        raise UsageError(f"output {out.path} exists; pass --force to replace it, or choose another -o path")
