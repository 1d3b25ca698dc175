"""``ckptool.ops.rewrite.remap``: rewrite the location tags of a checkpoint's storages, without torch and without a GPU.

``torch.load`` restores each storage on the device its location tag names (``default_restore_location`` in
torch/serialization.py), unless a ``map_location`` says otherwise. Rewriting the tags in the file gives the same
effect as ``torch.load(src, map_location=...)`` followed by ``torch.save``, but the tensor bytes are copied, not
decoded, so no GPU, no torch and no memory for the tensors are needed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol

from ckptool._gc import gc_paused
from ckptool.errors import UsageError
from ckptool.model.devices import parse_device
from ckptool.model.rename_plan import RenamePlan, build_plan
from ckptool.ops.rewrite.dcp import rewrite_dcp
from ckptool.ops.rewrite.folders import write_output
from ckptool.ops.rewrite.prefixes import RenameResult, rename_graph
from ckptool.ops.rewrite.sets import dcp_folder, opened_input, rewrite_output, rewrite_set, set_index
from ckptool.ops.rewrite.stream import ProgressFn, WriteResult, refuse_unwritable, retag_function, rewrite_file
from ckptool.readers import Opened, open_checkpoint
from ckptool.readers.registry import Role


@gc_paused
class Rewriter(Protocol):
    """The ``rewrite`` role: ``remap`` of a file whose storages are not one torch pickle's (a torch.package
    archive), ``opened`` written to ``dst`` with its location tags rewritten (``to`` / ``mapping`` /
    ``allow_missing`` / ``progress`` as :func:`remap` takes them; ``renaming``: a key renaming was asked for, which
    it may refuse). A format with none registered is rewritten as its pickle's node graph."""

    def __call__(self, opened: Opened, dst: str, to: str | None, mapping: Mapping[str, str] | None,
                 allow_missing: bool, progress: ProgressFn | None, /, *, renaming: bool) -> WriteResult: ...


#: the formats ``remap`` writes through a rewriter of their own, registered at the end of this module
REWRITE: Role[Rewriter] = Role("rewrite", "ckptool.ops")


def remap(
    src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *, to: str | None = None,
    mapping: Mapping[str, str] | None = None, in_place: bool = False, unwrap: bool = False,
    strip_dataparallel: bool = False, strip_prefixes: str | Sequence[str] = (), add_prefix: str | None = None,
    key: str | None = None, allow_missing: bool = False, allow_nested: bool = False,
    progress: ProgressFn | None = None, executor: Executor | None = None,
) -> WriteResult:
    """Write a copy of checkpoint ``src`` whose storages are tagged for another device.

    ``to="cpu"`` retags every storage; ``mapping={"cuda:1": "cuda:0"}`` only the matching ones (a bare device
    type such as ``"cuda"`` matches every index). The result opens with a plain ``torch.load(dst)`` on the target.
    Zip and legacy inputs are accepted; the output is torch's zip format (64-byte aligned records, so
    ``torch.load(mmap=True)`` works). Everything else in the pickle is kept: dtypes, shapes, strides, storage
    offsets, storage sharing, ``requires_grad``, ``_metadata`` and non-tensor values (a config string
    ``"cuda:1"`` stays ``"cuda:1"``). Full-model pickles are rewritten without importing their classes.

    ``dst`` defaults to ``<stem>.<target><ext>`` beside ``src`` (``model.cpu.pth``); ``in_place=True`` replaces
    ``src``. Writing is atomic: a temporary file in the destination folder, fsynced, then renamed. A model folder
    holding one weights file, given as the folder, gives a folder (by default ``<folder>.<target>``) with its other
    files copied, listed in the result's ``kept`` (:mod:`ckptool.ops.rewrite.folders`).

    A sharded set (``*.index.json``, or the folder holding it) is rewritten shard by shard into a set of the same
    layout with its index (:func:`ckptool.ops.rewrite.sets.rewrite_set`): ``dst`` a folder (created) or
    ``NAME.bin.index.json``, by default the folder ``<folder>.<target>`` beside the set's; no ``in_place``. The
    result is then a :class:`~ckptool.ops.rewrite.sets.SetWriteResult` (``SetRenameResult`` with a renaming) whose
    ``dst`` is the output index. A set of safetensors shards is refused as one safetensors file is.

    A ``torch.distributed.checkpoint`` folder is written as a new DCP folder (``dst`` new or empty, by default
    ``<folder>.<target>``; :func:`ckptool.ops.rewrite.dcp.rewrite_dcp`): DCP stores every tensor chunk from CPU, so
    only the tensors its non-tensor entries hold are re-tagged, and a folder with no tag to change raises
    UnsupportedError ("nothing to remap") unless keys are renamed in the same pass.

    A ``torch.package`` archive is re-tagged by :func:`ckptool.ops.rewrite.package.remap_package` (the tags in its
    pickles' storage ids; every other member copied byte for byte; nothing of the package run), without renamings.

    The key renamings of :mod:`ckptool.ops.rewrite.prefixes` can be done in the same pass (one read, one write):
    ``strip_prefixes``, ``strip_dataparallel``, ``unwrap`` and ``add_prefix``, applied in that order to the
    state_dict(s) found, or to the one at dotted path ``key``; ``allow_missing`` as in
    :func:`ckptool.ops.rewrite.prefixes.strip_prefix` (it also lets a ``mapping`` source that matches no storage pass),
    ``allow_nested`` as in :func:`ckptool.ops.rewrite.prefixes.add_prefix`. ``progress(nbytes)`` is called as the
    input's records are copied (bytes since the last call); ``executor``: a ``ThreadPoolExecutor`` writing a set's
    shards (a DCP folder's data files) one per task, the index (``.metadata``) last
    (:mod:`ckptool.ops.rewrite.parallel`).

    Returns a :class:`~ckptool.ops.rewrite.stream.WriteResult` (``dst``, ``retagged`` ``{(old, new): storage count}``),
    a :class:`~ckptool.ops.rewrite.prefixes.RenameResult` (the renaming added) when keys were renamed.

    Raises:
        UsageError: bad device strings, ``dst`` equal to ``src`` without ``in_place``, missing output folder,
            ``key`` without a renaming, bad prefixes.
        PrefixNotFoundError / KeyCollisionError: see :func:`ckptool.ops.rewrite.prefixes.strip_prefix`; nothing written.
        NestedPrefixError: see :func:`ckptool.ops.rewrite.prefixes.add_prefix`; nothing written.
        DeviceNotFoundError: a ``mapping`` source matches no storage (the tags found are listed), unless
            ``allow_missing``; nothing written.
        UnsupportedError: safetensors (no tags), TorchScript (use ``torch.jit.load(map_location=...)``), plain pickles.
        NotACheckpointError / CorruptCheckpointError: unreadable input.
    """
    src = os.fspath(src)
    if (to is None) == (not mapping):
        raise UsageError("give exactly one of --to DEVICE or --map FROM=TO")
    plan = _renaming(strip_prefixes, strip_dataparallel, unwrap, add_prefix, allow_nested, key)
    opened = open_checkpoint(src)
    folder = dcp_folder(opened)
    if folder is not None:
        out = remap_output(opened, dst, to=to, in_place=in_place)
        renamer = None if plan is None else (
            lambda root: rename_graph(root, plan, key=key, allow_missing=allow_missing, where=folder))
        return rewrite_dcp(opened, out, operation="remap", rename=renamer, to=to, mapping=mapping,
                           allow_missing=allow_missing, progress=progress, executor=executor)
    index = set_index(opened)
    if index is not None:
        out = remap_output(opened, dst, to=to, in_place=in_place)
        return rewrite_set(opened, out, operation="remap", plan=plan, to=to, mapping=mapping, key=key,
                           allow_missing=allow_missing, progress=progress, executor=executor)
    return _remap_file(opened, dst, plan, to=to, mapping=mapping, in_place=in_place, key=key,
                       allow_missing=allow_missing, progress=progress)


def _renaming(strip_prefixes: str | Sequence[str], strip_dataparallel: bool, unwrap: bool, add_prefix: str | None,
              allow_nested: bool, key: str | None) -> RenamePlan | None:
    """The renaming :func:`remap` does in the same pass, None for none.

    Raises:
        UsageError: ``key`` without a renaming; bad prefixes.
    """
    if unwrap or strip_dataparallel or strip_prefixes or add_prefix is not None:
        return build_plan(strip_prefixes=strip_prefixes, strip_dataparallel=strip_dataparallel, unwrap=unwrap,
                          add_prefix=add_prefix, allow_nested=allow_nested)
    if key is not None:
        raise UsageError("--key selects the state_dict to rename: add --unwrap, --strip-dataparallel, "
                         "--strip-prefix or --add-prefix")
    return None


def _remap_file(opened: Opened, dst: str | os.PathLike[str] | None, plan: RenamePlan | None, *, to: str | None,
                mapping: Mapping[str, str] | None, in_place: bool, key: str | None, allow_missing: bool,
                progress: ProgressFn | None) -> WriteResult:
    """:func:`remap` of one file ``opened`` (arguments as there), with the renaming ``plan`` (None: none); a
    ``torch.package`` archive through :func:`ckptool.ops.rewrite.package.remap_package` (no renaming). A model
    folder holding the file is written as a folder (:func:`ckptool.ops.rewrite.folders.write_output`)."""
    src = opened.target
    refuse_unwritable(opened.spec, src, "remap")
    out = remap_output(opened, dst, to=to, in_place=in_place)
    rewrite = REWRITE.find(opened.format)
    if rewrite is not None:  # a file whose storage ids are not one torch pickle's (torch.package)
        return write_output(opened, out, lambda path: rewrite(opened, path, to, mapping, allow_missing, progress,
                                                              renaming=plan is not None))
    ck = opened.graph()
    fn = retag_function(ck, to, mapping, allow_missing=allow_missing)
    if plan is None:
        return write_output(opened, out, lambda path: rewrite_file(ck, path, ck.root, fn, progress=progress))
    root, summary = rename_graph(ck.root, plan, key=key, allow_missing=allow_missing, where=src)
    return write_output(opened, out, lambda path: RenameResult.combine(
        rewrite_file(ck, path, root, fn, progress=progress), summary, "remap"))


def remap_output(src: str | os.PathLike[str] | Opened, dst: str | os.PathLike[str] | None, *, to: str | None,
                 in_place: bool = False) -> str:
    """The file :func:`remap` writes: ``dst``, ``src`` itself with ``in_place``, or ``<stem>.<target><ext>`` beside
    ``src`` (``model.cpu.pth``, ``model.cuda0.pth``; ``model.remapped.pth`` for a ``mapping``); for a sharded set
    the folder ``<folder>.<target>`` beside the set's (:func:`ckptool.ops.rewrite.sets.set_output`).

    Raises:
        UsageError: as :func:`ckptool.ops.rewrite.stream.output_path`; a bad ``to`` device.
    """
    tag = parse_device(to).replace(":", "") if to is not None else "remapped"
    return rewrite_output(opened_input(src), dst, tag, in_place)


# imported when a checkpoint of its format is met (a module of this layer)
REWRITE.register_lazy("torch-package", "ckptool.ops.rewrite.package:remap_package")

if TYPE_CHECKING:  # the lazy rewriters, checked against the Protocol
    from ckptool.ops.rewrite.package import remap_package

    _LAZY: tuple[Rewriter, ...] = (remap_package,)
