"""The files a model folder holds beside its weights (``config.json``, ``generation_config.json``, tokenizer files,
``README.md``...), which a rewrite of the folder's sharded set copies byte for byte into its output, so that
``transformers`` ``from_pretrained(output)`` finds them.

What is copied: every regular file directly in the input set's folder (files only: ``transformers`` folders are
flat), except
- the set's own shards and index (they are the files the rewrite writes anew);
- hidden files (a name starting with ``.``: ``.git``, ``.gitattributes``, ``.cache``), which belong to the
  repository or tool that made the folder, not to the model;
- other weights (:data:`WEIGHT_SUFFIXES`: another set's shards and index, ``pytorch_model.bin`` beside
  ``model.safetensors``, ``tf_model.h5``, ``training_args.bin`` too): copied unchanged they would hold the old
  names, and ``from_pretrained`` could load them instead of the rewritten set. They are named in a note instead,
  as are subfolders (not copied).
A set read through a URL, or written into its own folder, keeps nothing (the files are where they were). A model
folder holding one weights file, given as the folder, is written as a folder with its companions in the same way
(:mod:`ckptool.ops.rewrite.folders`); the weights file given as a file is rewritten into one file: nothing is
copied.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field

from ckptool import _source as source
from ckptool._fileio import same_file
from ckptool.errors import OutputError
from ckptool.writers.encoders import INDEX_SUFFIX

#: names that hold weights: not copied beside a rewritten set (their content would not match it)
WEIGHT_SUFFIXES = (INDEX_SUFFIX, ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                   ".onnx", ".distcp")


@dataclass
class Companions:
    """The files to copy beside a rewritten set: ``files`` (source path, file name) in name order, and ``left``:
    what the folder holds that is not copied (other weights, subfolders), for a note."""

    files: list[tuple[str, str]] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """The names of the files copied."""
        return [name for _p, name in self.files]

    def notes(self) -> list[str]:
        """The note naming what was left out of the output folder; none when nothing was."""
        if not self.left:
            return []
        shown = ", ".join(self.left[:4]) + (" ..." if len(self.left) > 4 else "")
        return [(f"not copied from the input folder: {shown} (subfolders, and weights files this rewrite did "
                 "not change, would not match the new set)")]


def model_folder_of(path: str) -> str | None:
    """The model folder a checkpoint argument names: the folder itself, or the folder holding a ``*.index.json``;
    None for a URL or a single file (whose folder the user did not give)."""
    if source.is_url(path):
        return None
    if os.path.isdir(path):
        return path
    return os.path.dirname(os.path.abspath(path)) if path.endswith(INDEX_SUFFIX) else None


def source_companions(path: str, folder: str, weights: Iterable[str], out_folder: str) -> Companions:
    """:func:`companion_files` of the model folder ``folder`` that ``path`` names, leaving out the checkpoint's own
    files: ``path`` itself and the ``weights`` files its tensors are read from."""
    own = {os.path.basename(p) for p in weights} | {os.path.basename(path)}
    return companion_files(folder, own, out_folder)


def companion_files(folder: str, own: set[str], out_folder: str) -> Companions:
    """The files of ``folder`` (the input set's) to copy into ``out_folder`` (see the module docstring); ``own``:
    the names of the set's shards and index. None to copy when ``folder`` is a URL or is ``out_folder`` itself."""
    if source.is_url(folder) or not os.path.isdir(folder) or same_file(folder, out_folder):
        return Companions()
    found = Companions()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name in own or name.startswith("."):
            continue
        if os.path.isdir(path):
            found.left.append(name + "/")
        elif name.lower().endswith(WEIGHT_SUFFIXES):
            found.left.append(name)
        elif os.path.isfile(path):
            found.files.append((path, name))
    return found


def copy_companion(src: str, dst: str) -> None:
    """Copy the file ``src`` to ``dst`` (a scratch file of the set writer) byte for byte, and fsync it.

    Raises:
        OutputError: reading ``src`` or writing ``dst`` failed.
    """
    try:
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:  # durable before the commit renames it into place, as the weights are
            os.fsync(f.fileno())
    except OSError as e:
        raise OutputError(f"copying {src} into the output failed: {e.strerror or e}; nothing was kept", dst,
                          e.errno) from e
