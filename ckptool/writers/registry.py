"""The output formats ckptool writes, each registered once with its suffixes, the file a folder output holds, what
it can hold and its load hint (issue 47). Commands ask :func:`choose_format`; none picks a format by itself.

What each can hold follows the format, not ckptool: a torch zip (``torch.save``) holds a whole pickled
checkpoint (non-tensor entries such as ``epoch``, views sharing one storage, any strides, storage location tags);
safetensors holds contiguous tensors only, one per name, no sharing (the ``safetensors`` format spec), plus a
str -> str ``__metadata__`` header; a ``torch.distributed.checkpoint`` folder holds tensors and pickled plain
entries, written by torch as a folder. A training checkpoint's ``epoch`` and other plain scalars (``scalars``) go
into safetensors' ``__metadata__`` as strings and stay entries of a DCP folder's state; a torch file of a state_dict
does not take them: they would be keys ``load_state_dict`` rejects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptool.errors import UsageError
from ckptool.formats import detect


@dataclass(frozen=True)
class Writer:
    """One output format.

    ``name``: the ``--format`` value; ``suffixes``: the lower-case file suffixes that choose it; ``folder_file``:
    the file a folder output holds (the name ``transformers``' ``from_pretrained`` reads; ``""``: the format is a
    folder of its own); ``non_tensor_entries``, ``shared_storages``, ``strides``, ``location_tags``: what it can
    hold; ``is_folder``: written as a folder by torch (no shards, no URL output); ``hint``: the load call for a
    file, with ``{path}`` the output path as a Python literal. ``scalars``: where a training checkpoint's plain
    top-level values (``epoch``, ``global_step``: :attr:`ckptool.formats.tensors.Source.scalars`) go without
    changing how the output loads: ``"metadata"`` (safetensors' ``__metadata__``, str -> str: written as strings),
    ``"state"`` (entries of the saved state itself), ``""`` nowhere, for the reason ``scalars_why``.
    ``reads_as``: the format name the readers (:func:`ckptool.readers.open_checkpoint`, ``inspect``) give what it
    writes (``torch-zip``, ``safetensors``, ``dcp``): the ``format`` a writing command's result reports for its output.
    """

    name: str
    suffixes: tuple[str, ...]
    folder_file: str
    non_tensor_entries: bool
    shared_storages: bool
    strides: bool
    location_tags: bool
    is_folder: bool
    hint: str
    reads_as: str
    scalars: str = ""
    scalars_why: str = ""


#: every output format, by ``--format`` name
WRITERS: dict[str, Writer] = {
    "torch": Writer("torch", (".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl"), "pytorch_model.bin",
                    non_tensor_entries=True, shared_storages=True, strides=True, location_tags=True, is_folder=False,
                    hint="torch.load({path}, weights_only=True)", reads_as=detect.TORCH_ZIP, scalars="",
                    scalars_why="a torch state_dict file holds them only as extra keys, which "
                                "model.load_state_dict would reject as unexpected"),
    "safetensors": Writer("safetensors", (".safetensors",), "model.safetensors", non_tensor_entries=False,
                          shared_storages=False, strides=False, location_tags=False, is_folder=False,
                          hint="safetensors.torch.load_file({path})", reads_as=detect.SAFETENSORS,
                          scalars="metadata"),
    "dcp": Writer("dcp", (), "", non_tensor_entries=True, shared_storages=False, strides=False,
                  location_tags=False, is_folder=True,
                  hint="torch.distributed.checkpoint.load(state_dict, checkpoint_id={path})", reads_as="dcp",
                  scalars="state"),
}


def writer(name: str) -> Writer:
    """The output format ``name`` (``torch``, ``safetensors``, ``dcp``).

    Raises:
        UsageError: no such format (the message lists them).
    """
    try:
        return WRITERS[name.lower()]
    except KeyError:
        *others, last = WRITERS
        raise UsageError(f"unknown format {name!r}: choose {', '.join(others)} or {last}") from None


def known_suffixes() -> list[str]:
    """Every suffix that names an output format, in registry order (``.pt``, ..., ``.safetensors``)."""
    return [s for w in WRITERS.values() for s in w.suffixes]


def suffix_writer(dst: str) -> Writer | None:
    """The format the suffix of ``dst``'s last part names, compared case-insensitively (``x.SafeTensors`` is
    safetensors); None when it names none."""
    low = os.path.basename(dst.rstrip("/" + os.sep)).lower()
    return next((w for w in WRITERS.values() if low.endswith(w.suffixes)), None)


def choose_format(dst: str, fmt: str | None = None, *, folder: bool = False, default: str | None = None) -> Writer:
    """THE choice of the output format, for every writing command (convert, extract-state-dict, average,
    merge-lora, and through :class:`ckptool.ops.convert.OutputFormat` the others): ``fmt`` when given (``--format``),
    else the format ``dst``'s suffix names (case-insensitive), else for a folder output (``folder``) ``default`` or
    safetensors (a ``transformers`` folder's ``model.safetensors``), else ``default``.

    Raises:
        UsageError: ``fmt`` names no format; a file output whose suffix names none and no ``default`` (the message
            lists the known suffixes).
    """
    if fmt is not None:
        return writer(fmt)
    found = suffix_writer(dst)
    if found is not None:
        return found
    if folder:
        return writer(default or "safetensors")
    if default is not None:
        return writer(default)
    raise UsageError(f"cannot tell the output format from {dst!r}: name it with one of "
                     f"{', '.join(known_suffixes())}, end it with / for a folder, or pass --format "
                     f"{'|'.join(WRITERS)}")
