"""``ckptool.ops.hints``: the closing "Load it with: ..." line of every command that writes a file, derived from
what the written file holds, never a fixed string.

:func:`load_hint` reads the output back (the pickle as a node graph, or the safetensors header / shard index,
through :func:`ckptool.ops.inspect.entry.inspect`; tensor bytes are never read, nothing is imported or run) and builds
the one Python expression that opens it with plain torch on a machine without a GPU:

* format: a torch zip file -> ``torch.load``; safetensors -> ``safetensors.torch.load_file``; a folder of shards
  with its index -> the loader users use, never a list of shard paths (:func:`set_hint`): ``transformers``
  ``from_pretrained(folder)`` when the folder is a model folder (a ``config.json`` beside an index of the names
  transformers reads), else ``ckptool.load_into(model, folder)``; a folder holding one shard -> its single file
  (never the folder: ``load_file('out/')`` fails); a URL -> the file ``fsspec`` opens (a set at a URL: its shards
  merged into one dict).
* tied weights in safetensors (stored once, the alias recorded in ``__metadata__``) -> the model is needed:
  ``safetensors.torch.load_model(model, path)``, or for shards the merged dict with each alias given its kept
  tensor; other views recorded by ckptool (``ckptool.shared``) -> ``ckptool.load_into(model, path)``.
* location tags: every storage ``cpu`` -> no ``map_location``; any other tag -> ``map_location='cpu'``
  (:func:`ckptool.model.devices.map_location_for`), and a note when those tags were not chosen with ``--to`` /
  ``--map`` (with the exact mapping that puts them on one GPU).
* globals outside the ``weights_only=True`` allowlist (:func:`ckptool.model.allowlist.is_allowed`: a full-model
  pickle, numpy arrays, an ``argparse.Namespace``) -> a note naming ``ckptool sanitize`` first, and
  ``weights_only=False`` in the expression, for a source the user trusts.
* a state_dict inside a bigger dict -> the indexing (``['state_dict']``) inside ``model.load_state_dict(...)``.
* a DCP folder -> ``torch.distributed.checkpoint.load`` of ``model.state_dict()`` wrapped in the nesting the
  folder was saved with (``{'model': model.state_dict()}``): DCP matches the flattened keys.
* a ``torch.package`` archive (remap's output) -> ``torch.package.PackageImporter(path).load_pickle(...)`` of its
  first pickle, with a note that it runs the package's code.

Importing this module does not import torch.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptool import _source as source
from ckptool.errors import CkptError
from ckptool.model.allowlist import DANGEROUS, level_word
from ckptool.model.devices import map_location_for
from ckptool.model.keys import WRAPPER_COMPONENTS, shared_prefixes, suggest_command
from ckptool.ops.inspect.entry import CheckpointInfo, GlobalInfo, inspect
from ckptool.readers import Opened, open_checkpoint
from ckptool.readers.registry import Role
from ckptool.readers.structures import SINGLE_FILES, recorded_names

__all__ = ["HINT", "HintMaker", "LoadHint", "dcp_hint", "load_hint", "megatron_dist_hint", "package_hint",
           "renamed_set_hint", "safetensors_hint", "set_hint", "torch_hint"]

_LISTED = 3  # globals named in the note before "and N more"
_NO_DEVICE_TAGS = frozenset({"cpu", "meta"})  # tags that open on any machine without map_location


@dataclass
class LoadHint:
    """How to open a written file: ``code`` is one Python expression that loads it with plain torch on a machine
    without a GPU, once the statements ``imports`` have run (``import torch``, ``import safetensors.torch``,
    ``import fsspec`` for a URL, ``import ckptool`` where only ckptool rebuilds views) and, where the code names
    them, ``model`` is the user's ``nn.Module`` (``state_dict``, for a DCP folder holding no state_dict: the
    dict of tensors to fill);
    ``notes`` are the lines to print before it (devices kept, globals that ``weights_only=True`` refuses, tied
    weights)."""

    code: str
    notes: list[str] = field(default_factory=list)
    imports: list[str] = field(default_factory=lambda: ["import torch"])


class HintMaker(Protocol):
    """The ``hint`` role: the "Load it with" lines of a written checkpoint ``opened`` (:func:`load_hint`'s
    ``info``, ``state_dict`` and ``chosen`` as there); a format with none registered gets :func:`torch_hint`."""

    def __call__(self, opened: Opened, info: CheckpointInfo, state_dict: str | None, chosen: frozenset[str], /
                 ) -> LoadHint: ...


#: each format's hint maker, registered at the end of this module (the readers layer names none)
HINT: Role[HintMaker] = Role("hint", "ckptool.ops")


def _index(path: str) -> str:
    """``['state_dict']`` / ``['model']['ema']`` / ``[0]`` for a dotted state_dict path (``""``: nothing)."""
    if not path:
        return ""
    return "".join(f"[{int(c)}]" if c.isascii() and c.isdigit() else f"[{c!r}]" for c in path.split("."))


def _torch_load(file_expr: str, tags: Iterable[str], trusted: bool) -> str:
    """``torch.load(<file_expr>, [map_location=...,] weights_only=...)``."""
    args = [file_expr]
    ml = map_location_for(tags)
    if ml is not None:
        args.append(f"map_location={ml}")
    args.append("weights_only=False" if trusted else "weights_only=True")
    return f"torch.load({', '.join(args)})"


def _device_notes(path: str, tags: set[str], chosen: frozenset[str], sharded: bool = False) -> list[str]:
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
        load = ("torch.load of each shard (weights_only=True)" if sharded
                else f"torch.load({path!r}, weights_only=True)")  # an index is JSON: torch.load reads the shards
        notes.append(f"Storages are tagged {', '.join(asked)} as asked: on a machine with that device {load} puts "
                     "them there; the line below opens it anywhere")
    return notes


def _unsafe_note(path: str, info: CheckpointInfo) -> str:
    """Why ``torch.load(weights_only=True)`` refuses ``path``: each global it names outside the allowlist with the
    level ``ckptool scan`` gives it (:func:`ckptool.model.allowlist.level_word`), then the remedy: a weights-only copy
    with ``ckptool sanitize``, or ``weights_only=False`` for a trusted source; never that for a dangerous global."""
    unsafe = [g for g in info.globals if not g.allowed] or [GlobalInfo(n, False) for n in info.unsafe_globals]
    more = f" and {len(unsafe) - _LISTED} more" if len(unsafe) > _LISTED else ""
    named = ", ".join(f"{g.name} ({level_word(g.level)})" for g in unsafe[:_LISTED])
    if any(g.level == DANGEROUS for g in unsafe):
        return (f"torch.load(weights_only=True) refuses this file: it names {named}{more}. Do not load it with "
                f"weights_only=False: that runs the file's code; see `ckptool scan {shlex.quote(path)}`")
    stem, ext = os.path.splitext(path)
    safe = f"{stem}.safe{ext or '.pt'}"
    return (f"torch.load(weights_only=True) refuses this file: it names {named}{more}. Make a weights-only copy "
            f"with `ckptool sanitize {shlex.quote(path)} -o {shlex.quote(safe)}` first; load it with "
            "weights_only=False (below) only if you trust its source, since that runs the file's code")


def _shard_files(opened: Opened) -> list[str]:
    """The shard files the set ``opened`` lists in its index, in name order, spelled from its index path as given
    (a relative index path gives relative shard paths)."""
    path, index = opened.target, opened.index()
    if source.is_url(path):
        return [index.shard_path(s) for s in sorted(index.shards)]
    return [os.path.join(os.path.dirname(path), s) for s in sorted(index.shards)]


#: the index names ``transformers`` ``from_pretrained`` looks for in a model folder
_TRANSFORMERS_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _architecture(folder: str) -> str | None:
    """The model class ``config.json`` of ``folder`` names (``architectures[0]``, ``AutoModel`` when it names none);
    None without a readable ``config.json``."""
    try:  # a FIFO or device named config.json is never opened for reading (open_regular)
        with source.open_regular(os.path.join(folder, "config.json")) as f:
            config = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError, CkptError):
        return None
    if not isinstance(config, dict):
        return None
    names = config.get("architectures")
    first = names[0] if isinstance(names, list) and names else None
    return first if isinstance(first, str) and first.isidentifier() else "AutoModel"


def _config(folder: str) -> dict[str, Any] | None:
    """``config.json`` of ``folder`` as a dict; None without a readable one."""
    try:  # a FIFO or device named config.json is never opened for reading (open_regular)
        with source.open_regular(os.path.join(folder, "config.json")) as f:
            config = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError, CkptError):
        return None
    return config if isinstance(config, dict) else None


#: the output head ``transformers`` ties to the input embeddings in its language models (``_tied_weights_keys``)
TIED_HEAD = "lm_head.weight"


def tied_head(folder: str | None, names: Iterable[str]) -> str | None:
    """The output head a ``transformers`` language model of the model folder ``folder`` ties to its input
    embeddings and that the written tensors ``names`` leave out (``save_pretrained`` stores a tied weight once):
    :data:`TIED_HEAD` when ``config.json`` names a ``*ForCausalLM`` / ``*LMHeadModel`` architecture and ties the
    word embeddings (``tie_word_embeddings`` true, or absent: ``PretrainedConfig``'s default), else None."""
    config = _config(folder) if folder is not None else None
    if config is None or config.get("tie_word_embeddings", True) is not True:
        return None
    arch = _architecture(folder) if folder is not None else None
    if arch is None or not arch.endswith(("ForCausalLM", "LMHeadModel")) or TIED_HEAD in set(names):
        return None
    return TIED_HEAD


def tied_hint(hint: LoadHint, path: str, head: str) -> LoadHint:
    """``hint`` (a ``model.load_state_dict(...)`` line) for a file that leaves out the tied output ``head``: the
    safetensors file through ``safetensors.torch.load_model`` (it ties the head from the model's side), a torch
    file with ``strict=False`` (the head stays the model's tied embedding), the head named in a note."""
    why = (f"{head} is tied to the input embeddings (config.json: tie_word_embeddings) and stored once, as "
           "transformers' save_pretrained does")
    if hint.code.startswith("model.load_state_dict(safetensors.torch.load_file("):
        return LoadHint(f"safetensors.torch.load_model(model, {path!r})",
                        [*hint.notes, f"{why}: safetensors.torch.load_model ties it from the model's side"],
                        hint.imports)
    if hint.code.startswith("model.load_state_dict(") and hint.code.endswith(")"):
        return LoadHint(f"{hint.code[:-1]}, strict=False)",
                        [*hint.notes, f"{why}: strict=False leaves {head} missing, as the model's tie fills it"],
                        hint.imports)
    return hint


def _set_place(index: str) -> str:
    """How the hint names the set of ``index``: its folder when the index has a name transformers reads
    (``model.safetensors.index.json``: a model folder) and the folder opens as that set (its one index), else the
    index itself (a folder holding several sets, ``NAME.safetensors.index.json``, and one that may get more)."""
    folder = os.path.dirname(index) or "."
    if os.path.basename(index) not in _TRANSFORMERS_INDEXES:
        return index
    try:
        same = open_checkpoint(folder).target == index
    except CkptError:
        same = False
    return folder if same else index


def set_hint(opened: Opened, notes: list[str], *, trusted: bool) -> LoadHint | None:
    """The hint of the local sharded set ``opened`` (``notes`` before it; ``trusted``: its pickles need
    ``weights_only=False``): ``transformers.<Architecture>.from_pretrained(folder)`` when the folder holds a
    ``config.json`` and an index of the names transformers reads (a note says when to load into one's own model
    instead) and its keys do not all start with a wrapper's prefix (``module.``, ``_orig_mod.``: from_pretrained
    would match none), else ``ckptool.load_into(model, folder)`` (``trust=True`` for pickles torch's weights_only
    refuses).
    None for a set at a URL (the caller lists its shards)."""
    index = opened.target
    if source.is_url(index):
        return None
    place = _set_place(index)
    trust = ", trust=True" if trusted else ""
    into = f"ckptool.load_into(model, {place!r}{trust})"
    arch = _architecture(os.path.dirname(index) or ".")
    if arch is None or os.path.basename(index) not in _TRANSFORMERS_INDEXES:
        return LoadHint(into, notes, ["import ckptool"])
    wrappers = [p for p in shared_prefixes(list(opened.index().weight_map)) if p[:-1] in WRAPPER_COMPONENTS]
    if wrappers:  # from_pretrained would match none of its names and start from random weights
        note = (f"every key starts with {''.join(wrappers)} (a wrapper's): from_pretrained would load none of "
                f"them; ckptool.load_into removes it (or `ckptool strip-dataparallel` / `unwrap` first)")
        return LoadHint(into, [*notes, note], ["import ckptool"])
    note = (f"from_pretrained builds the model config.json describes and loads the set into it; into your own "
            f"model: {into}")
    return LoadHint(f"transformers.{arch}.from_pretrained({place!r})", [*notes, note], ["import transformers"])


def _dropped(files: list[str]) -> tuple[dict[str, str], list[str]]:
    """The tensors the safetensors ``files`` hold only as records in ``__metadata__`` (:mod:`ckptool.formats.
    safetensors`): ``(exact, views)``, ``exact`` alias -> kept name for a tensor that *is* a stored one (a tied
    weight: ``safetensors.torch.save_model``'s convention), ``views`` the names of the other members of a
    :data:`~ckptool.formats.safetensors.SHARED_KEY` group (a slice, a transpose), which only ckptool rebuilds."""
    exact: dict[str, str] = {}
    views: list[str] = []
    for f in files:
        header = open_checkpoint(f).safetensors_header()
        aliases = header.aliases()
        exact.update(aliases)
        views += [n for n in recorded_names(header, f) if n not in aliases]
    return exact, views


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def safetensors_hint(opened: Opened, _info: CheckpointInfo, state_dict: str | None, _chosen: frozenset[str]
                     ) -> LoadHint:
    """The hint of a safetensors file or a sharded safetensors set (registered in :data:`HINT` for both):

    * views only ckptool rebuilds (:func:`_dropped`) -> ``ckptool.load_into(model, path)``, which restores them;
    * tied weights, one local file -> ``safetensors.torch.load_model(model, path)`` (it ties them from the model
      side; ``load_file`` leaves the alias out, and a strict ``load_state_dict`` then misses it);
    * tied weights in shards or at a URL -> the merged dict with every alias given its kept tensor, into
      ``model.load_state_dict``;
    * else ``safetensors.torch.load_file`` (a URL: ``safetensors.torch.load`` of the bytes that ``fsspec`` reads;
      shards: one dict merged from the index's files), into ``model.load_state_dict`` when ``state_dict`` is
      not None.
    """
    path = opened.target
    sharded = opened.spec.kind == "set"
    url = source.is_url(path)
    if sharded and not url:
        found = set_hint(opened, [], trusted=False)
        assert found is not None
        return found
    files = _shard_files(opened) if sharded else [path]
    exact, views = _dropped(files)
    if views:
        note = (f"{len(views)} tensor(s) are views of another tensor that safetensors cannot hold ({_names(views)}): "
                "ckptool recorded their layout in __metadata__ and ckptool.load_into rebuilds them; "
                "safetensors.torch.load_file returns the stored tensors only")
        return LoadHint(f"ckptool.load_into(model, {path!r})", [note], ["import ckptool"])
    imports = ["import fsspec", "import safetensors.torch"] if url else ["import safetensors.torch"]

    def one(f: str) -> str:
        return f"safetensors.torch.load(fsspec.open({f}, 'rb').open().read())" if url else \
            f"safetensors.torch.load_file({f})"

    loaded = f"{{k: v for f in {files!r} for k, v in {one('f')}.items()}}" if sharded else one(repr(path))
    notes = []
    if exact:
        pairs = [f"{a} is {k}" for a, k in exact.items()]
        if not sharded and not url:
            notes.append(f"tied weights are stored once ({_names(pairs)}): safetensors.torch.load_model ties them "
                         "from the model's side; safetensors.torch.load_file leaves them out")
            return LoadHint(f"safetensors.torch.load_model(model, {path!r})", notes, imports)
        notes.append(f"tied weights are stored once ({_names(pairs)}): the line below gives each its kept tensor")
        items = ", ".join(f"{a!r}: sd[{k!r}]" for a, k in exact.items())
        return LoadHint(f"model.load_state_dict({{**(sd := {loaded}), {items}}})", notes, imports)
    code = loaded if state_dict is None else f"model.load_state_dict({loaded})"
    return LoadHint(code, notes, imports)


def package_hint(opened: Opened, info: CheckpointInfo, _state_dict: str | None, _chosen: frozenset[str]
                 ) -> LoadHint:
    """A ``torch.package`` archive (registered in :data:`HINT`): ``PackageImporter(path).load_pickle(package,
    resource)`` of its first pickle
    (``map_location`` as for ``torch.load``), with a note that it runs the package's code and, for several
    pickles, names the others."""
    path = opened.target
    resources = (info.package or {}).get("resources", [])
    ml = map_location_for(set(info.storage_bytes))
    where = f", map_location={ml}" if ml is not None else ""
    notes = [("PackageImporter runs the package's own code (its modules and pickled objects): load it only if you "
              "trust its source")]
    if not resources:
        return LoadHint(f"torch.package.PackageImporter({path!r})", notes, ["import torch.package"])
    first = resources[0]
    if len(resources) > 1:
        others = ", ".join(f"({r['package']!r}, {r['resource']!r})" for r in resources[1:_LISTED + 1])
        notes.append(f"the archive holds {len(resources)} pickles; load the others with load_pickle(package, "
                     f"resource{where}) too: {others}{' and more' if len(resources) > _LISTED + 1 else ''}")
    code = (f"torch.package.PackageImporter({path!r}).load_pickle({first['package']!r}, {first['resource']!r}"
            f"{where})")
    return LoadHint(code, notes, ["import torch.package"])


def _dcp_paths(opened: Opened) -> list[tuple[Any, ...]]:
    """The path of every entry of the DCP folder ``opened`` in the nesting it was saved with, as its
    ``planner_data`` records it (``("model", "fc.weight")``; ``(fqn,)`` where the planner recorded none), tensor
    entries first."""
    meta = opened.dcp_metadata()
    planner = meta.planner_data or {}
    entries = sorted(meta.entries, key=lambda e: e.dtype is None)
    return [c if isinstance(c := planner.get(e.fqn), tuple) and c else (e.fqn,) for e in entries]


def dcp_hint(opened: Opened, info: CheckpointInfo, state_dict: str | None, _chosen: frozenset[str]) -> LoadHint:
    """A DCP folder (registered in :data:`HINT`): ``torch.distributed.checkpoint.load`` of ``model.state_dict()``
    wrapped in the nesting the folder was saved with (``{'model': model.state_dict()}`` for a folder saved as
    ``{"model": sd}``: DCP matches the flattened keys, ``model.fc.weight``, and loads in place into the model's
    tensors). The state_dict is ``state_dict`` (a dotted path) where given, else the folder's largest one; the
    note names the folder's other top-level entries, which the line leaves unloaded."""
    target = opened.target
    imports = ["import torch.distributed.checkpoint"]
    biggest = sorted(info.state_dicts, key=lambda sd: -sd.tensors)
    path = state_dict if state_dict is not None else biggest[0].path if biggest else None
    if path is None:
        note = ("fill state_dict (a dict of tensors of the right shapes, in the nesting the folder was saved with) "
                "first; DCP loads in place")
        return LoadHint(f"torch.distributed.checkpoint.load(state_dict, checkpoint_id={target!r})", [note], imports)
    paths = _dcp_paths(opened)
    nesting = next((p[:-1] for p in paths if ".".join(map(str, p[:-1])) == path),
                   tuple(path.split(".")) if path else ())
    wrapped = "model.state_dict()"
    for key in reversed(nesting):
        wrapped = f"{{{key!r}: {wrapped}}}"
    if nesting:
        under = " -> ".join(map(repr, nesting))
        note = ("DCP loads in place into the tensors it is given, matched by their keys: the line passes "
                f"model.state_dict() in the nesting the folder was saved with (under {under}), which fills model")
    else:
        note = ("DCP loads in place into the tensors it is given, matched by their keys: the line passes "
                "model.state_dict() as the folder was saved (at its top level), which fills model")
    others = list(dict.fromkeys(str(p[0]) for p in paths if nesting and p[:1] != nesting[:1]))
    if others:
        note += f"; the folder's other entries ({_names(others)}) stay unloaded: add them to the dict to load them"
    return LoadHint(f"torch.distributed.checkpoint.load({wrapped}, checkpoint_id={target!r})", [note], imports)


def megatron_dist_hint(opened: Opened, _info: CheckpointInfo, _state_dict: str | None,
                       _chosen: frozenset[str]) -> LoadHint:
    """A Megatron-Core torch_dist folder (registered in :data:`HINT`, :attr:`~ckptool.readers.Format.dcp`): what
    Megatron loads it with, ``dist_checkpointing.load`` of the model's sharded state dict (megatron-core 0.16
    ``serialization.py`` ``load``: each ``ShardedTensor``'s key is an FQN of the folder), and the note saying
    that plain torch reads its tensors through ``convert``."""
    target = opened.target
    note = ("Megatron-Core loads a torch_dist folder into the ShardedTensors of the sharded state dict it is given, "
            "matched by their keys (a renamed folder: keys as renamed); without Megatron, `ckptool convert "
            f"{target} -o model.safetensors` writes its tensors as one file")
    return LoadHint(f"dist_checkpointing.load(model.sharded_state_dict(), {target!r})", [note],
                    ["from megatron.core import dist_checkpointing"])


def torch_hint(opened: Opened, info: CheckpointInfo, state_dict: str | None, chosen: frozenset[str]) -> LoadHint:
    """A torch file or a sharded set of torch shards (every format with no hint in :data:`HINT`):
    ``torch.load`` (each shard, merged), with notes for globals ``weights_only=True`` refuses and for location
    tags."""
    path = opened.target
    sharded = opened.spec.kind == "set"
    unsafe = info.unsafe_globals
    tags = set(info.storage_bytes)
    notes: list[str] = []
    if unsafe:
        notes.append(_unsafe_note(path, info))
    elif info.weights_only_refusal is not None:
        notes.append(f"torch.load(weights_only=True) refuses this file: its pickle uses {info.weights_only_refusal}, "
                     "which torch's weights_only unpickler does not read (a pickle_protocol above 3?); load it with "
                     "weights_only=False (below) only if you trust its source")
    notes += _device_notes(path, tags, chosen, sharded=sharded)
    imports = ["import torch"]
    found = set_hint(opened, notes, trusted=not info.weights_only_loads) if sharded else None
    if found is not None:
        return found
    if sharded:
        one = _torch_load("f", tags, not info.weights_only_loads)
        code = f"{{k: v for f in {_shard_files(opened)!r} for k, v in {one}.items()}}"
    else:
        # a URL: torch opens files, not URLs; fsspec gives the file
        expr = repr(path)
        if source.is_url(path):
            expr = f"fsspec.open({path!r}, 'rb').open()"
            imports.insert(0, "import fsspec")
        code = _torch_load(expr, tags, not info.weights_only_loads) + _index(state_dict or "")
    if state_dict is not None:
        code = f"model.load_state_dict({code})"
    return LoadHint(code, notes, imports)


def load_hint(path: str | os.PathLike[str], *, state_dict: str | None = None,
              chosen: Iterable[str] = (), renamed: bool = False) -> LoadHint:
    """The :class:`LoadHint` of the file (or sharded set, or DCP folder) at ``path``, read from the file itself:
    the checkpoint opened once (:func:`ckptool.readers.open_checkpoint`: a local folder that is not a DCP
    checkpoint is the set it holds, its ``*.index.json`` or the single ``model.safetensors`` /
    ``pytorch_model.bin`` of a one-shard set), described by :func:`ckptool.ops.inspect.entry.inspect`, and the hint
    registered for its format in :data:`HINT` (:func:`safetensors_hint`, :func:`dcp_hint`,
    :func:`package_hint`; else :func:`torch_hint`).

    Args:
        path: the output just written: a torch zip file, a safetensors file, an ``*.index.json``, a folder of
            shards (its index, or its single file) or a DCP folder; a URL for a file uploaded there.
        state_dict: dotted path of the state_dict to load into a model (``""`` the top level,
            ``"state_dict"`` inside a Lightning checkpoint); the code is then
            ``model.load_state_dict(<load>[...])``. None: the code returns the loaded object (a pickled module
            loads as itself). Tied weights and views in safetensors need the model whatever ``state_dict`` is.
        chosen: the location tags the user asked for (:func:`ckptool.model.devices.chosen_tags`); other non-cpu
            tags in the file get a note saying they were kept.
        renamed: the command that wrote ``path`` renamed its keys: a model folder's set then loads into the
            user's model (``ckptool.load_into``), not through ``from_pretrained``, whose class may no longer match
            the names (:func:`set_hint`).

    Raises what :func:`ckptool.ops.inspect.entry.inspect` raises for an unreadable file, and UsageError for a folder
    that holds no checkpoint set.
    """
    opened = open_checkpoint(path)
    info = inspect(opened)
    hint = HINT.get(opened.format, torch_hint)(opened, info, state_dict, frozenset(chosen))
    hint = one_file_folder_hint(opened, info, hint) or hint
    if renamed and hint.imports == ["import transformers"]:  # set_hint's from_pretrained line
        return renamed_set_hint(opened, hint, trusted=opened.tensor_header() is None
                                 and not info.weights_only_loads)
    wrapped = _wrapper_note(info, os.fspath(path), state_dict) if hint.code.startswith("model.load_state_dict(") \
        else None
    return hint if wrapped is None else LoadHint(hint.code, [*hint.notes, wrapped], hint.imports)


def one_file_folder_hint(opened: Opened, info: CheckpointInfo, hint: LoadHint) -> LoadHint | None:
    """The hint of a local model folder's one weights file (``model.safetensors`` / ``pytorch_model.bin`` beside a
    ``config.json``, the file the folder opens as: ``transformers`` ``save_pretrained`` of a model that fits one
    file), as :func:`set_hint` gives a set's: ``transformers.<Architecture>.from_pretrained(folder)``, ``hint`` (the
    file's own line) in a note. None for any other file, one whose keys all start with a wrapper's prefix
    (from_pretrained would match none), or pickles ``torch.load(weights_only=True)`` refuses (transformers loads
    with it)."""
    path = opened.target
    folder = os.path.dirname(path) or "."
    if opened.spec.kind != "file" or source.is_url(path) or os.path.basename(path) not in SINGLE_FILES:
        return None
    arch = _architecture(folder)
    top = next((s for s in info.state_dicts if s.path == ""), None)
    if arch is None or not info.weights_only_loads or top is None or \
            any(p[:-1] in WRAPPER_COMPONENTS for p in top.prefixes):
        return None
    try:
        if open_checkpoint(folder).target != path:
            return None
    except CkptError:
        return None
    note = (f"from_pretrained builds the model config.json describes and loads the file into it; into your own "
            f"model: {hint.code}")
    return LoadHint(f"transformers.{arch}.from_pretrained({folder!r})", [*hint.notes, note], ["import transformers"])


def _wrapper_note(info: CheckpointInfo, path: str, state_dict: str | None) -> str | None:
    """The note of a ``model.load_state_dict(...)`` hint whose state_dict (dotted path ``state_dict``) has every key
    under a wrapper's prefix (``module.``: ``torch.save(nn.DataParallel(model).state_dict())``, or the state_dict
    ``extract-state-dict`` takes from a pickled ``DataParallel``): the line loads it into the wrapped model only;
    how to load it into the bare one. None otherwise."""
    sd = next((s for s in info.state_dicts if s.path == state_dict), None)
    if sd is None or not sd.prefixes or not all(p[:-1] in WRAPPER_COMPONENTS for p in sd.prefixes):
        return None
    key = f", key={state_dict!r}" if state_dict else ""
    example = _WRAPPED.get("".join(sd.prefixes))
    wrapped = f"the wrapped model ({example})" if example else "the wrapped model"
    return (f"every key starts with {''.join(sd.prefixes)} (a wrapper's): the line below loads it into {wrapped}; "
            f"into the bare model: ckptool.load_into(model, {path!r}{key}), which removes it, or "
            f"`{suggest_command(sd.prefixes, src=path, key=state_dict or None)}` first")


#: the wrapped model a state_dict of these prefixes loads into, for :func:`_wrapper_note`
_WRAPPED = {"module.": "nn.DataParallel(model)", "_orig_mod.": "torch.compile(model)"}


def renamed_set_hint(opened: Opened, hint: LoadHint, *, trusted: bool) -> LoadHint:
    """The hint of a model folder's set whose keys a command renamed (``hint``: its ``from_pretrained`` line):
    ``ckptool.load_into(model, folder)``, with a note that ``from_pretrained`` loads it only where the names still
    match the class ``config.json`` names."""
    place = _set_place(opened.target)
    note = (f"keys were renamed: {hint.code} loads the folder only where the names still match that class's "
            "(transformers adds or removes the base model's own prefix, such as transformer., itself); the line "
            "below loads it into your own model")
    into = f"ckptool.load_into(model, {place!r}{', trust=True' if trusted else ''})"
    return LoadHint(into, [*hint.notes[:-1], note], ["import ckptool"])


HINT.register("torch-package", package_hint)
HINT.register("safetensors", safetensors_hint)
HINT.register("sharded-safetensors", safetensors_hint)
HINT.register("dcp", dcp_hint)
HINT.register("megatron-dist", megatron_dist_hint)
