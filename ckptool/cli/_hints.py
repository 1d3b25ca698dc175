"""The load hint that every command writing a checkpoint prints last (``Load it with: ...``) and puts in its
``--json`` output: :func:`hint_for`, :func:`report_hint`, :func:`hint_payload`.

Apart from :mod:`ckptool.cli._common` because the hint reads the written file back
(:func:`ckptool.ops.hints.load_hint` inspects it), which loads the inspect code: the read-only commands (``scan``,
``inspect``) import :mod:`~ckptool.cli._common` only, and start without it.
"""

from __future__ import annotations

import os
from typing import Any

import click

from ckptool.cli._common import mapping_of
from ckptool.model.devices import chosen_tags
from ckptool.ops.hints import LoadHint, load_hint, tied_head, tied_hint
from ckptool.readers import open_checkpoint


def hint_for(path: str, *, state_dict: str | None = None, to: str | None = None,
             maps: tuple[str, ...] = (), renamed: bool = False, source_folder: str | None = None) -> LoadHint:
    """The :func:`ckptool.ops.hints.load_hint` of the file written at ``path`` (``state_dict``: dotted path to load
    into a model; ``to`` / ``maps``: the tags the user chose; ``renamed``: the command renamed keys;
    ``source_folder``: the model folder the tensors came from, whose ``config.json`` says which weights the model
    ties: :func:`ckptool.ops.hints.tied_head`)."""
    hint = load_hint(path, state_dict=state_dict, chosen=chosen_tags(to, mapping_of(maps)), renamed=renamed)
    if source_folder is None or state_dict != "" or not os.path.isfile(path):
        return hint
    opened = open_checkpoint(path)
    head = tied_head(source_folder, (t.name for t in opened.state_dict("" if opened.spec.keyed else None).tensors))
    return tied_hint(hint, path, head) if head is not None else hint


def after_colon(sentence: str) -> str:
    """``sentence`` continued after ``Note: ``: its first word lower-cased when it is an ordinary capitalised word
    (``Storages are ...`` -> ``storages are ...``), kept as it is otherwise (``URL``, ``DCP``, ``torch.load``)."""
    first = sentence.split(" ", 1)[0]
    if first[:1].isupper() and first[1:].islower():
        return sentence[0].lower() + sentence[1:]
    return sentence


def folder_of(path: str) -> str | None:
    """The local folder ``path`` is, or that holds the file ``path`` (whose ``config.json``, if any, says what the
    model ties: :func:`hint_for`'s ``source_folder``); None for a URL."""
    if "://" in path:
        return None
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def report_hint(path: str, *, state_dict: str | None = None, to: str | None = None,
                maps: tuple[str, ...] = (), renamed: bool = False, source_folder: str | None = None) -> None:
    """Print the notes and the ``Load it with: ...`` line of :func:`hint_for` (same arguments)."""
    hint = hint_for(path, state_dict=state_dict, to=to, maps=maps, renamed=renamed, source_folder=source_folder)
    for note in hint.notes:
        click.echo(f"Note: {after_colon(note)}")
    click.echo(f"Load it with: {hint.code}")


def renamed_keys(res: object) -> bool:
    """Whether the result ``res`` of a rewrite renamed keys (its ``renamed`` count; none for a remap or filter)."""
    return bool(getattr(res, "renamed", 0))


def hint_payload(hint: LoadHint) -> dict[str, Any]:
    """A load hint as the JSON field ``{"load_hint": {"code": "torch.load(...)", "notes": [...], "imports":
    ["import torch"]}}`` (``imports``: the statements to run before ``code``)."""
    return {"load_hint": {"code": hint.code, "notes": list(hint.notes), "imports": list(hint.imports)}}
