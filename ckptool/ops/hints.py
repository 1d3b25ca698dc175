"""``ckptool.ops.hints``: the closing "Load it with: ..." line of every command that writes a file, derived from
what the written file holds, never a fixed string.

:func:`load_hint` reads the output back (the pickle as a node graph, or the safetensors header / shard index,
through :func:`ckptool.ops.inspect.inspect`; tensor bytes are never read, nothing is imported or run) and builds
the one Python expression that opens it with plain torch on a machine without a GPU:

* format: a torch zip file -> ``torch.load``; safetensors -> ``safetensors.torch.load_file``; a sharded set -> the
  shards listed in its index, merged into one dict.
* location tags: every storage ``cpu`` -> no ``map_location``; any other tag -> ``map_location='cpu'``
  (:func:`ckptool.model.devices.map_location_for`), and a note when those tags were not chosen with ``--to`` /
  ``--map`` (with the exact mapping that puts them on one GPU).
* globals outside the ``weights_only=True`` allowlist (:func:`ckptool.model.allowlist.is_allowed`: a full-model
  pickle, numpy arrays, an ``argparse.Namespace``) -> a note naming ``ckptool sanitize`` first, and
  ``weights_only=False`` in the expression, for a source the user trusts.
* a state_dict inside a bigger dict -> the indexing (``['state_dict']``) inside ``model.load_state_dict(...)``.

Importing this module does not import torch.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from ckptool import _source as source
from ckptool.formats import detect as formats
from ckptool.formats.sharded import read_index
from ckptool.model.devices import map_location_for
from ckptool.ops.inspect import CheckpointInfo, inspect

__all__ = ["LoadHint", "load_hint"]

_LISTED = 3  # globals named in the note before "and N more"
_NO_DEVICE_TAGS = frozenset({"cpu", "meta"})  # tags that open on any machine without map_location


@dataclass
class LoadHint:
    """How to open a written file: ``code`` is one Python expression (``torch`` and ``safetensors.torch``
    imported; ``model`` the user's ``nn.Module`` when it starts with ``model.load_state_dict``) that loads it with
    plain torch on a machine without a GPU; ``notes`` are the lines to print before it (devices kept, globals
    that ``weights_only=True`` refuses)."""

    code: str
    notes: list[str] = field(default_factory=list)


def _index(path: str) -> str:
    """``['state_dict']`` / ``['model']['ema']`` / ``[0]`` for a dotted state_dict path (``""``: nothing)."""
    return "".join(f"[{int(c)}]" if c.isdigit() else f"[{c!r}]" for c in path.split(".")) if path else ""


def _torch_load(file_expr: str, tags: Iterable[str], trusted: bool) -> str:
    """``torch.load(<file_expr>, [map_location=...,] weights_only=...)``."""
    args = [file_expr]
    ml = map_location_for(tags)
    if ml is not None:
        args.append(f"map_location={ml}")
    args.append("weights_only=False" if trusted else "weights_only=True")
    return f"torch.load({', '.join(args)})"


def _device_notes(path: str, tags: set[str], chosen: frozenset[str]) -> list[str]:
    gpu = sorted(tags - _NO_DEVICE_TAGS)
    if not gpu:
        return []
    kept = [t for t in gpu if t not in chosen]
    asked = [t for t in gpu if t in chosen]
    notes = []
    if kept:
        one_gpu = map_location_for(tags, "cuda:0")
        gpu_hint = f" (onto one GPU: map_location={one_gpu})" if one_gpu is not None else ""
        notes.append(
            f"The output keeps the location tag(s) {', '.join(kept)} of the source (not chosen with --to / --map): "
            f"torch.load without map_location needs that device. Load it with map_location='cpu' on any machine"
            f"{gpu_hint}, or rewrite it with --to cpu")
    if asked:
        notes.append(f"Storages are tagged {', '.join(asked)} as asked: on a machine with that device "
                     f"torch.load({path!r}, weights_only=True) puts them there; the line below opens it anywhere")
    return notes


def _unsafe_note(path: str, unsafe: list[str]) -> str:
    more = f" and {len(unsafe) - _LISTED} more" if len(unsafe) > _LISTED else ""
    stem, ext = os.path.splitext(path)
    safe = f"{stem}.safe{ext or '.pt'}"
    return (f"torch.load(weights_only=True) refuses this file: it names {', '.join(unsafe[:_LISTED])}{more}. Make "
            f"a weights-only copy with `ckptool sanitize {shlex.quote(path)} -o {shlex.quote(safe)}` first; load "
            "it with weights_only=False (below) only if you trust its source, since that runs the file's code")


def _sharded(path: str, info: CheckpointInfo) -> str:
    index = read_index(path)
    files = [index.shard_path(s) for s in index.shards]
    if info.format == "sharded-safetensors":
        one = "safetensors.torch.load_file(f)"
    else:
        one = _torch_load("f", set(info.storage_bytes), bool(info.unsafe_globals))
    return f"{{k: v for f in {files!r} for k, v in {one}.items()}}"


def load_hint(path: str | os.PathLike[str], *, state_dict: str | None = None,
              chosen: Iterable[str] = ()) -> LoadHint:
    """The :class:`LoadHint` of the file (or sharded set, or DCP folder) at ``path``, read from the file itself.

    Args:
        path: the output just written: a torch zip file, a safetensors file, an ``*.index.json`` or a DCP folder.
        state_dict: dotted path of the state_dict to load into a model (``""`` the top level,
            ``"state_dict"`` inside a Lightning checkpoint); the code is then
            ``model.load_state_dict(<load>[...])``. None: the code returns the loaded object (a pickled module
            loads as itself).
        chosen: the location tags the user asked for (:func:`ckptool.model.devices.chosen_tags`); other non-cpu
            tags in the file get a note saying they were kept.

    Raises what :func:`ckptool.ops.inspect.inspect` raises for an unreadable file.
    """
    path = os.fspath(path)
    info = inspect(path)
    notes: list[str] = []
    if info.format == "dcp":
        return LoadHint(f"torch.distributed.checkpoint.load(state_dict, checkpoint_id={path!r})",
                        ["fill state_dict (a dict of tensors of the right shapes) first; DCP loads in place"])
    unsafe = info.unsafe_globals
    tags = set(info.storage_bytes)
    if unsafe:
        notes.append(_unsafe_note(path, unsafe))
    elif info.weights_only_refusal is not None:
        notes.append(f"torch.load(weights_only=True) refuses this file: its pickle uses {info.weights_only_refusal}, "
                     "which torch's weights_only unpickler does not read (a pickle_protocol above 3?); load it with "
                     "weights_only=False (below) only if you trust its source")
    # a URL: torch and safetensors open files, not URLs; fsspec (imported as fsspec) gives the file
    opened = f"fsspec.open({path!r}, 'rb').open()" if source.is_url(path) else repr(path)
    if info.format == formats.SAFETENSORS:
        code = (f"safetensors.torch.load({opened}.read())" if source.is_url(path)
                else f"safetensors.torch.load_file({path!r})")
    elif info.format.startswith("sharded-"):
        notes += _device_notes(path, tags, frozenset(chosen))
        code = _sharded(path, info)
    else:
        notes += _device_notes(path, tags, frozenset(chosen))
        code = _torch_load(opened, tags, not info.weights_only_loads) + _index(state_dict or "")
    if state_dict is not None:
        code = f"model.load_state_dict({code})"
    return LoadHint(code, notes)
