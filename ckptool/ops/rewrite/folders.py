"""A model folder holding one weights file, given as the folder, rewritten into a folder: the single-file rewrites
(``remap``, the prefix commands, ``rename``, ``filter``) of a ``transformers`` folder saved in one file
(``config.json``, ``model.safetensors`` or ``pytorch_model.bin``, ``generation_config.json``, tokenizer files).

The rule (what the user passes decides what is written):

- **the folder** (:func:`model_folder`): the output is a folder, ``-o DIR`` (made when missing) or by default
  ``<folder>.<tag>`` beside the input folder (``gpt2/`` -> ``gpt2.stripped/``, as a sharded set's folder gets its
  output folder: :func:`ckptool.ops.rewrite.sets.set_output`). It holds the rewritten weights file under its own
  name and every other file of the input folder copied byte for byte (:mod:`ckptool.ops.rewrite.companions`: not
  hidden files, subfolders nor other weights, which a note names), listed in the result's ``kept``; written as a
  set is (:func:`ckptool.ops.rewrite.set_writer.write_set`: scratch files beside their final names, all renamed
  into place with SIGINT / SIGTERM held; a failed run leaves nothing, and removes the folder it made);
- **the weights file itself**, ``-o`` naming a file (a name ending in ``.safetensors`` / ``.bin`` / ``.pt`` /
  ``.pth`` that is not a folder), or ``--in-place``: one file, as for any single file; nothing is copied.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ckptool import _source as source
from ckptool._fileio import same_file
from ckptool.errors import UsageError
from ckptool.ops.rewrite.companions import companion_files
from ckptool.ops.rewrite.set_writer import write_set
from ckptool.ops.rewrite.stream import WriteResult
from ckptool.readers import Opened
from ckptool.writers.encoders import SET_FILE_SUFFIXES, SetLayout

#: what a single-file write returns (a :class:`~ckptool.ops.rewrite.stream.WriteResult`, or a tuple holding one)
R = TypeVar("R")


def model_folder(opened: Opened) -> str | None:
    """The folder ``opened`` names when the user passed a local model folder holding one weights file
    (:func:`ckptool.readers.open_checkpoint` read its single file, :attr:`~ckptool.readers.Opened.target`); None for
    a file, a sharded set, a DCP or DeepSpeed folder, a URL."""
    if opened.spec.kind != "file" or source.is_url(opened.path) or not os.path.isdir(opened.path):
        return None
    return opened.path


def names_file(dst: str) -> bool:
    """Whether the output ``dst`` names a file, not a folder: a name ending in a weights suffix
    (:data:`~ckptool.formats.sharded.SET_FILE_SUFFIXES`) that is not an existing folder."""
    return dst.lower().endswith(SET_FILE_SUFFIXES) and not os.path.isdir(dst)


def folder_output(folder: str, dst: str | os.PathLike[str] | None, tag: str, in_place: bool, refusal: str) -> str:
    """The output folder of a rewrite of a set or folder of files: ``dst``, or by default ``<folder>.<tag>`` beside
    ``folder``.

    Raises:
        UsageError: ``in_place``, with the message ``refusal`` (such inputs are written anew elsewhere).
    """
    if in_place:
        raise UsageError(refusal)
    if dst is not None:
        return os.fspath(dst)
    where = os.path.abspath(folder)
    return f"{where.rstrip(os.sep) or where}.{tag}"


def model_folder_output(opened: Opened, dst: str | os.PathLike[str] | None, tag: str, in_place: bool) -> str | None:
    """The output folder of a rewrite of the model folder ``opened`` (see the module docstring): ``dst`` or
    ``<folder>.<tag>``; None when the output is one file (``opened`` is not a model folder, ``in_place``, or ``dst``
    names a file: :func:`names_file`)."""
    folder = model_folder(opened)
    if folder is None or in_place or (dst is not None and names_file(os.fspath(dst))):
        return None
    return folder_output(folder, dst, tag, False, "")


def is_folder_output(opened: Opened, out: str) -> bool:
    """Whether the rewrite of ``opened`` to the output ``out`` (:func:`model_folder_output`, or a file) writes a
    model folder."""
    return model_folder(opened) is not None and not names_file(out) and not same_file(out, opened.target)


def _layout(opened: Opened, out: str) -> SetLayout:
    """The output folder ``out`` holding one file named as the input's weights file."""
    stem, ext = os.path.splitext(os.path.basename(opened.target))
    return SetLayout(os.path.abspath(out), stem, ext, is_output_folder=True)


def refuse_existing_folder(opened: Opened, out: str, *, force: bool) -> None:
    """Refuse, unless ``force``, a folder output ``out`` that already holds a weights file of the name the rewrite
    writes (or a set of that name); a no-op for a file output.

    Raises:
        UsageError: such a file is in the way.
    """
    if force or not is_folder_output(opened, out) or not os.path.isdir(out):
        return
    layout = _layout(opened, out)
    existing = sorted(n for n in os.listdir(out) if layout.is_member(n))
    if existing:
        raise UsageError(f"{out} already holds {', '.join(existing[:3])}{' ...' if len(existing) > 3 else ''}; "
                         "pass --force to replace it, or choose another -o path")


@dataclass
class _Files:
    """What :func:`~ckptool.ops.rewrite.set_writer.write_set` fills (:class:`~ckptool.ops.rewrite.set_writer.
    SetFiles`)."""

    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dst: str = ""


def write_output(opened: Opened, out: str, write: Callable[[str], R],
                 result: Callable[[R], WriteResult] | None = None) -> R:
    """Run ``write(path)``, the single-file rewrite of ``opened`` into ``path``: into ``out`` itself for a file
    output; for a folder output (:func:`is_folder_output`), into a scratch file committed with the input folder's
    other files as one set (see the module docstring). ``result(value)``: the
    :class:`~ckptool.ops.rewrite.stream.WriteResult` of what ``write`` returned (the value itself when None), whose
    ``dst`` becomes the file in the folder, ``kept`` the names of the files copied and ``notes`` what was not.

    Raises what ``write`` raises, and :func:`~ckptool.ops.rewrite.set_writer.write_set`'s UsageError /
    OutputError (an output file that is the input, a folder that cannot be made, a copy that failed).
    """
    if not is_folder_output(opened, out):
        return write(out)
    layout = _layout(opened, out)
    name = os.path.basename(opened.target)
    companions = companion_files(os.path.dirname(os.path.abspath(opened.target)), {name}, layout.folder)
    done: list[R] = []
    files = _Files()
    write_set(layout, [opened.target], lambda path, _final, _src: done.append(write(path)),
              [os.path.abspath(opened.target)], {}, 0, files, out, companions=companions.files, one_file=True)
    res = result(done[0]) if result is not None else done[0]
    assert isinstance(res, WriteResult)
    res.dst = os.path.join(layout.folder, name)
    res.kept = companions.names
    res.notes += files.notes + companions.notes()
    return done[0]
