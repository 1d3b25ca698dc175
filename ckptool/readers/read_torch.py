"""Reading a torch zip or legacy file for ``convert``: the state_dict chosen from the node graph, no tensor bytes.

The pickle is read as a node graph (:func:`ckptool.formats.torchfile.read_checkpoint`, nothing imported or run);
each tensor becomes a :class:`~ckptool.formats.tensors.Tensor` pointing at the byte range of its storage record
(zip member or legacy data block). In a file whose ``byteorder`` record says ``big`` each storage is read through
a byte-swapping :class:`~ckptool.formats.segments.Segment` (:meth:`ckptool.formats.torchfile.Checkpoint.
byteswap_size`), so every output holds the values ``torch.load`` gives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ckptool import _source as source
from ckptool.errors import CkptError, CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import element_size, storage_element, storage_nbytes, tensor_dtype
from ckptool.formats.nodes import (
    REBUILD_FROM_TYPE_V2,
    REBUILD_QTENSOR,
    ObjectNode,
    ParameterNode,
    PickledObject,
    ReduceNode,
    StorageRef,
    TensorNode,
)
from ckptool.formats.segments import byteswap
from ckptool.formats.tensors import Segment, Source, Storage, Tensor
from ckptool.formats.torchfile import Checkpoint, Record, read_checkpoint, resolve_zip_offsets
from ckptool.formats.zipdir import read_member
from ckptool.model.graph import (
    Link,
    StateDictRef,
    find_state_dicts,
    is_module,
    is_optimizer_state,
    is_state_dict,
    iter_state_dict_of_module,
    iter_tensors,
    join,
    mapping_items,
    module_state,
    parameter_requires_grad,
    state_children,
    unwrap_tensor,
)
from ckptool.model.keys import STATE_DICT_NAMES
from ckptool.model.nonstrided import NonStrided, find_non_strided, non_strided, refusal
from ckptool.model.paths import resolve_path
from ckptool.model.values import iter_values
from ckptool.readers.reader import Reader


def describe(v: Any) -> str:
    """A short description of a graph value for the ``left_out`` report (``"optimizer state (4 tensors)"``)."""
    special = non_strided(v)
    if special is not None:
        return special.what
    t = unwrap_tensor(v)
    if t is not None:
        return f"tensor {'x'.join(map(str, t.shape)) or 'scalar'} {tensor_dtype(t)}"
    if is_module(v):
        st = module_state(v)
        cls = v.global_name if isinstance(v, ObjectNode) else "module"
        n = sum(1 for _ in iter_state_dict_of_module(v)) if st is not None else 0
        return f"pickled nn.Module {cls} ({n} tensors)"
    items = mapping_items(v)
    if items is not None:
        return _describe_mapping(v, items)
    return _describe_other(v)


def _describe_mapping(v: Any, items: list[tuple[Any, Any]]) -> str:
    """:func:`describe` of a mapping: an optimizer state, a state_dict, or its entry and tensor counts."""
    n = sum(1 for _ in iter_tensors(v))
    if is_optimizer_state(items):
        return f"optimizer state ({n} tensors)"
    if is_state_dict(v):
        return f"state_dict ({n} tensors)"
    return f"mapping of {len(items)} entries" + (f", {n} tensors" if n else "")


def _describe_other(v: Any) -> str:
    """:func:`describe` of a list, tuple, plain value or pickled object."""
    if isinstance(v, (list, tuple)):
        n = sum(1 for _ in iter_tensors(v))
        return f"{type(v).__name__} of {len(v)} items" + (f", {n} tensors" if n else "")
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        r = repr(v)
        return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"
    if isinstance(v, (ReduceNode, ObjectNode)):
        return f"{v.global_name or 'object'} object"
    return type(v).__name__


def left_out(root: Any, trail: Sequence[Link]) -> list[str]:
    """``"name: description"`` for every entry beside the one each link of ``trail`` (from ``root``) follows,
    level by level; listing stops at a level that is no mapping, list or tuple (a module's attribute)."""
    out: list[str] = []
    node, prefix = root, ""
    for link in trail:
        items = mapping_items(node)
        if items is None and isinstance(node, (list, tuple)):
            items = list(enumerate(node))
        if items is None or link.parent is not node:
            break
        chosen = False
        for k, v in items:
            if not chosen and v is link.child and k == link.key:
                chosen = True
            else:
                out.append(f"{join(prefix, k)}: {describe(v)}")
        node, prefix = link.child, join(prefix, link.key)
    return out


#: the longest string value taken as a training scalar (:func:`training_scalars`); longer ones are not "plain"
SCALAR_STR_MAX = 200


def training_scalars(root: Any, chosen: Any) -> dict[str, bool | int | float | str] | None:
    """The plain scalar entries of a training checkpoint's top-level dict ``root`` beside its entry ``chosen`` (the
    key of the state_dict or module taken: ``{'epoch': 3, 'global_step': 120, 'model': sd, ...}`` -> ``{'epoch': 3,
    'global_step': 120}``): str keys whose value is a bool, int, float or str of at most :data:`SCALAR_STR_MAX`
    characters, in file order; None when ``root`` is no mapping or none is there."""
    items = mapping_items(root)
    if items is None:
        return None
    out = {k: v for k, v in items if isinstance(k, str) and k != chosen and type(v) in (bool, int, float, str)
           and (not isinstance(v, str) or len(v) <= SCALAR_STR_MAX)}
    return out or None


def select_state_dict(root: Any, key: str | None, where: str) -> StateDictRef:
    """The state_dict to convert (its dotted path, container, whether it is a module, and the trail to it).

    Without ``key``: the only state_dict found, or among several the one whose name ranks first in
    :data:`ckptool.model.keys.STATE_DICT_NAMES` (``state_dict`` before ``ema``), then the shallowest; ties are
    refused.

    Raises:
        UsageError: ``key`` names no entry or not a mapping / module; several equally likely state_dicts.
        UnsupportedError: no state_dict at all; a mapping that would be one but holds sparse, quantized, packed or
            nested tensors (named, with the fix: :func:`raise_non_strided`).
    """
    found = find_state_dicts(root)
    listing = ", ".join(f"{sd.path or '(top level)'} ({len(sd.keys())} tensors)" for sd in found) or "none"
    if key is not None:
        try:
            trail = resolve_path(root, key)
        except KeyError:
            raise UsageError(f"{where}: no entry {key!r} (--key); state_dicts found: {listing}") from None
        obj = trail[-1].child if trail else root
        if not is_module(obj) and mapping_items(obj) is None:
            raise UsageError(f"{where}: --key {key!r} selects a {describe(obj)}, not a state_dict; "
                             f"state_dicts found: {listing}")
        return StateDictRef(key, obj, is_module(obj), tuple(trail))
    if not found:
        special = find_non_strided(root)
        if special:
            raise_non_strided(where, *special[0], more=len(special) - 1)
        raise UnsupportedError(
            f"{where}: no state_dict found (a mapping of parameter names to tensors, or a pickled nn.Module); "
            "pass --key PATH (key=...) to select the mapping to convert")
    if len(found) == 1:
        return found[0]
    names = STATE_DICT_NAMES

    def rank(sd: StateDictRef) -> tuple[int, int]:
        last = sd.path.rsplit(".", 1)[-1]
        return (names.index(last) if last in names else len(names), sd.path.count("."))

    ranked = sorted(found, key=rank)
    if rank(ranked[0]) == rank(ranked[1]) or rank(ranked[0])[0] == len(names):
        raise UsageError(f"{where} holds several state_dicts: {listing}; choose one with --key PATH (key=...)")
    return ranked[0]


def raise_non_strided(where: str, key: str, found: NonStrided, more: int = 0) -> None:
    """Raise the :class:`UnsupportedError` of ``convert`` for the non-strided tensor ``key``
    (:func:`ckptool.model.nonstrided.refusal`): what it is, how to make it plain, and the commands that keep it as
    it is."""
    others = f" ({more} more such tensor{'s' if more > 1 else ''} in the file)" if more else ""
    raise UnsupportedError(refusal(
        where, key, found, "ckptool convert writes plain strided tensors only (safetensors and torch outputs)",
        f"to keep it as it is, stay in torch format: `ckptool remap {where} --to DEVICE`, `strip-prefix`, "
        f"`unwrap` and `verify` handle it bit for bit{others}"))


def refuse_non_strided_for_dcp(path: str, fmt: str) -> None:
    """Raise :class:`UnsupportedError` naming the first sparse, nested or storage-less tensor of the torch file
    ``path`` (``torch.distributed.checkpoint.save`` reads each tensor's storage, which those have not); quantized
    tensors are left to DCP."""
    for key, found in find_non_strided(read_checkpoint(path, fmt).root):
        if found.kind in ("sparse", "nested", "no_storage"):
            raise UnsupportedError(refusal(
                path, key, found, "torch.distributed.checkpoint writes each tensor's storage, and this one has none",
                "to keep it as it is, stay in torch format (`ckptool remap`, `strip-prefix`, `unwrap`, `verify`)"))


def _check_tensor_node(t: TensorNode, name: str, where: str) -> StorageRef:
    if t.rebuild_name == REBUILD_QTENSOR:
        found = non_strided(t)
        assert found is not None  # a quantized tensor node is non-strided
        raise_non_strided(where, name, found)
    if t.storage is None:
        raise UnsupportedError(f"{where}: {name!r} is a tensor without a storage; it cannot be converted")
    return t.storage


def state_dict_entries(src: Source, obj: Any, is_mod: bool) -> list[tuple[str, TensorNode, bool]]:
    """``(key, tensor node, requires_grad)`` of the selected state_dict ``obj`` (a mapping, or a pickled module
    when ``is_mod``: its ``state_dict()`` entries, with a note in ``src.notes``); non-tensor entries go to
    ``src.skipped``, an ``OrderedDict``'s BUILD state to ``src.sd_state``.

    Raises:
        UnsupportedError: a sparse, quantized, packed or nested tensor (:func:`raise_non_strided`).
    """
    if is_mod:
        src.notes.append("the source is a pickled nn.Module: its state_dict (parameters and persistent buffers) "
                         "was converted; the module's class and code are not part of the output")
        return [(k, t, False) for k, t, _is_param in iter_state_dict_of_module(obj)]
    entries = []
    for k, v in mapping_items(obj) or []:
        t = unwrap_tensor(v)
        special = non_strided(v, k) if t is None and isinstance(k, str) else None
        if special is not None:
            raise_non_strided(src.path, k, special)
        if t is None or not isinstance(k, str):
            src.skipped.append(f"{k}: {describe(v)}" if isinstance(k, str) else f"{k!r} (not a string key)")
            continue
        rg = parameter_requires_grad(v) if isinstance(v, ParameterNode) else t.requires_grad
        entries.append((k, t, rg))
    if isinstance(obj, PickledObject) and type(obj.state) is dict:
        src.sd_state = obj.state
    return entries


def torch_save_graph(path: str) -> Checkpoint:
    """The pickle of the file at ``path`` read as the zip ``torch.save`` writes (:func:`read_checkpoint` of a
    ``torch-zip``, nothing imported or run), whatever else its member names could make the file look like to
    :func:`ckptool.readers.open_checkpoint` (a ``code/`` folder, a ``constants.pkl``): for bytes that ``torch.save``
    wrote by construction, such as a DCP folder's non-tensor record, where ``torch.load`` reads them so.

    Raises:
        NotACheckpointError / CorruptCheckpointError: not a torch zip, or a damaged one (see :func:`read_checkpoint`).
    """
    return read_checkpoint(path, formats.TORCH_ZIP)


def locate_records(ck: Checkpoint, f: Any) -> None:
    """Fill in the data offset of each record of the zip checkpoint ``ck`` (as :meth:`ckptool.readers.Opened.graph`
    read it; ``f`` its file, open for binary reading) that is not known yet, from the record's local header
    (:func:`ckptool.formats.torchfile.resolve_zip_offsets`: 30 bytes plus the name and extra field): the byte ranges
    its storages are read from and a rewrite copies (:func:`ckptool.ops.rewrite.stream.write_zip`). Each header is
    read once; a legacy checkpoint's offsets are known from its read.

    Raises:
        CorruptCheckpointError: a local header is missing.
    """
    resolve_zip_offsets(ck, f)


def torch_source(path: str, fmt: str, key: str | None, ck: Checkpoint | None = None) -> Source:
    """Read a torch zip or legacy file's selected state_dict as a :class:`Source` (no tensor bytes read); ``ck``:
    its pickle already read (:meth:`ckptool.readers.Opened.graph`), else it is read here.

    Raises:
        UsageError / UnsupportedError: see :func:`select_state_dict`; sparse, quantized, packed, nested and other
            non-strided tensors (:mod:`ckptool.model.nonstrided`: the message names the key and the fix),
            compressed records, tensors of different dtypes on one storage, TorchScript archives.
        CorruptCheckpointError: a storage record is missing, too short, or a view runs past its storage.
    """
    if fmt == formats.TORCHSCRIPT:
        raise UnsupportedError(
            f"{path} is a TorchScript archive, not a torch.save checkpoint; load it with torch.jit.load(path, "
            "map_location='cpu'), save model.state_dict() with torch.save, then convert that file")
    ck = ck if ck is not None else read_checkpoint(path, fmt)
    sd = select_state_dict(ck.root, key, path)
    src = Source(path, ck.format, [], key=sd.path, left_out=left_out(ck.root, sd.trail),
                 scalars=training_scalars(ck.root, sd.trail[0].key) if sd.trail and sd.trail[0].parent is ck.root
                 else None)
    entries = state_dict_entries(src, sd.obj, sd.is_module)
    records = {r.name: r for r in ck.records}
    if ck.format != formats.TORCH_LEGACY:
        with source.open_binary(path) as f:
            locate_records(ck, f)

    def storage_of(ref: StorageRef, name: str, dtype: str) -> Storage:
        rec = records.get("data/" + ref.key)
        if rec is None:
            raise CorruptCheckpointError(f"{path}: storage {ref.key!r} of {name!r} has no data record; "
                                         "the file is damaged, re-download or re-save it")
        if rec.zipinfo is not None and rec.zipinfo.method != 0:
            raise UnsupportedError(f"{path}: record data/{ref.key} is compressed; torch never writes that and "
                                   "ckptool does not inflate records. Load the file with torch.load and re-save "
                                   "it with torch.save first")
        nbytes = storage_nbytes(ref)
        if rec.size != nbytes:
            raise CorruptCheckpointError(
                f"{path}: storage {ref.key!r} declares {nbytes} bytes but its record holds {rec.size}; the file "
                "is damaged, re-download or re-save it")
        return record_storage(ck, rec, ref, dtype)

    add_tensors(src, entries, storage_of)
    return src


def record_storage(ck: Checkpoint, rec: Record, ref: StorageRef, dtype: str) -> Storage:
    """The :class:`Storage` of ``ref`` (its declared bytes, elements of ``dtype``, its location tag) over record
    ``rec`` of the torch file ``ck`` (its offset resolved: :func:`ckptool.formats.torchfile.resolve_zip_offsets`);
    in a file whose ``byteorder`` is ``big``, read through a byte-swapping :class:`Segment`, as ``torch.load``
    reverses each element's bytes (no CRC-32 then: it holds for the stored bytes, not the swapped ones)."""
    nbytes = storage_nbytes(ref)
    swap = ck.byteswap_size(ref)
    if swap:
        return Storage(ck.path, rec.offset, nbytes, dtype, ref.location, None,
                       segments=[Segment(ck.path, rec.offset, nbytes, swap=swap)])
    return Storage(ck.path, rec.offset, nbytes, dtype, ref.location, rec.crc)


def _layout(t: TensorNode, dtypes: dict[int, str]) -> tuple[StorageRef | None, str, int, tuple[int, ...],
                                                            tuple[int, ...]]:
    """``(storage ref, dtype, storage offset, shape, stride)`` of tensor node ``t``; the common
    ``_rebuild_tensor_v2`` node read from its arguments directly, its dtype remembered in ``dtypes`` by storage
    class (50,000 tensors: half of :func:`graph_source`'s time otherwise)."""
    a = t.args
    if len(a) >= 4 and type(a[0]) is StorageRef and type(a[1]) is int and type(a[2]) is tuple \
            and type(a[3]) is tuple and t.func.name == "_rebuild_tensor_v2":
        dtype = dtypes.get(id(a[0].storage_type))
        if dtype is None:
            dtype = dtypes[id(a[0].storage_type)] = tensor_dtype(t)
        return a[0], dtype, a[1], a[2], a[3]
    return t.storage, tensor_dtype(t), t.storage_offset, tuple(t.shape), tuple(t.stride)


def graph_source(ck: Checkpoint) -> tuple[Source, dict[str, str]]:
    """Every tensor of the torch file ``ck`` (a torch zip, legacy or TorchScript file read whole, not one selected
    state_dict), keyed by dotted path as :func:`ckptool.model.graph.iter_tensors` keys them, except that a pickled
    ``nn.Module`` gives its state_dict (parameters and persistent buffers: :func:`ckptool.model.graph.
    state_children`), not its other attributes; a TorchScript archive's constants keyed ``constants.<key>`` over
    their ``constants/`` records. Tensors sharing a storage share one :class:`Storage`. No tensor bytes are read.

    Returns ``(source, unread)``: ``unread`` maps the key of each tensor whose bytes ckptool does not read to why
    (a tensor without a storage, kept over an empty one with location ``meta``; a compressed record).

    Raises:
        UnsupportedError: a plain pickle (no torch storages: :attr:`ckptool.readers.Format.refusal`), an unknown
            storage class.
        CorruptCheckpointError: containers nested deeper than ckptool walks; a zip local header missing.
    """
    if ck.format == formats.PICKLE:
        raise UnsupportedError(f"{ck.path} is a plain pickle without torch storages, not a torch.save checkpoint")
    records = {r.name: r for r in ck.records}
    if ck.format != formats.TORCH_LEGACY:
        with source.open_binary(ck.path) as f:
            resolve_zip_offsets(ck, f)
    src = Source(ck.path, ck.format, [])
    unread: dict[str, str] = {}
    storages: dict[str, Storage] = {}
    tensors = src.tensors
    dtypes: dict[int, str] = {}
    roots = [("", "data/", ck.root), *((name, f"{name}/", extra) for name, extra in ck.extra_roots.items())]
    for prefix, folder, root in roots:
        for key, t, rg in iter_tensors(root, prefix, state_children):
            ref, dtype, offset, shape, stride = _layout(t, dtypes)
            rec = records.get(folder + ref.key) if ref is not None else None
            if ref is None or rec is None:
                st = Storage(ck.path, -1, 0, dtype, ref.location if ref is not None else "meta")
                unread[key] = "no storage"
            else:
                found = storages.get(rec.name)
                st = found if found is not None else storages.setdefault(rec.name,
                                                                         record_storage(ck, rec, ref, dtype))
                if rec.zipinfo is not None and rec.zipinfo.method != 0:
                    unread[key] = f"record {rec.name} is compressed"
            tensors.append(Tensor(key, key, dtype, shape, stride, offset, st, rg, len(tensors)))
    return src, unread


def add_tensors(src: Source, entries: Sequence[tuple[str, TensorNode, bool]],
                storage_of: Callable[[StorageRef, str, str], Storage]) -> None:
    """Append a :class:`Tensor` to ``src.tensors`` for each ``(key, tensor node, requires_grad)`` of ``entries``
    (:func:`state_dict_entries`), in order: its layout from the node, its :class:`Storage` from
    ``storage_of(storage ref, key, dtype)``, called once per storage key, so that tensors sharing a storage share
    one :class:`Storage` object.

    Raises:
        UnsupportedError: a quantized or storage-less tensor, tensors of different dtypes on one storage, negative
            strides; and what ``storage_of`` raises.
        CorruptCheckpointError: a storage that is not a whole number of elements, a view past its storage.
    """
    path = src.path
    storages: dict[str, Storage] = {}
    subclass = 0
    for i, (name, t, rg) in enumerate(entries):
        ref = _check_tensor_node(t, name, path)
        if t.func.module == REBUILD_FROM_TYPE_V2[0] and t.func.name == REBUILD_FROM_TYPE_V2[1]:
            subclass += 1
        dtype = tensor_dtype(t)
        st = storages.get(ref.key)
        if st is None:
            st = storages[ref.key] = storage_of(ref, name, dtype)
            if st.nbytes % element_size(dtype):
                raise CorruptCheckpointError(f"{path}: storage {ref.key!r} ({st.nbytes} bytes) is not a whole "
                                             f"number of {dtype} elements; the file is damaged")
        elif st.dtype != dtype:
            raise UnsupportedError(f"{path}: {name!r} views storage {ref.key!r} as {dtype} while another tensor views "
                                   f"it as {st.dtype}; such a checkpoint cannot be converted")
        shape, stride = tuple(t.shape), tuple(t.stride)
        if len(stride) != len(shape) or any(s < 0 for s in stride):
            raise UnsupportedError(f"{path}: {name!r} has an unsupported layout (shape {shape}, stride {stride})")
        tensor = Tensor(name, name, dtype, shape, stride, t.storage_offset, st, rg, i)
        lo, hi = tensor.span
        if hi > st.numel or lo < 0:
            raise CorruptCheckpointError(f"{path}: {name!r} reaches element {hi} of a storage of {st.numel}; the "
                                         "file is damaged")
        src.tensors.append(tensor)
    if subclass:
        src.notes.append(f"{subclass} tensor subclass instance(s) (torch._tensor._rebuild_from_type_v2) were "
                         "converted as plain tensors")


class PickledReader(Reader):
    """A torch zip, legacy or TorchScript file or a plain pickle (the registry's ``reader``): the pickle as a node
    graph, read once (:meth:`~ckptool.readers.Opened.graph`, nothing imported or run)."""

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        """:func:`torch_source` over the node graph (a torch zip or legacy file)."""
        return torch_source(self.opened.target, self.opened.format, key, self.opened.graph())

    def tree(self) -> Any:
        """The pickle's root node."""
        return self.opened.graph().root

    def values(self) -> dict[str, object]:
        """The plain values of the pickle (:func:`ckptool.model.values.iter_values`), a pickled ``nn.Module``'s
        attributes left out (its state_dict is its parameters and buffers), a TorchScript archive's constants
        keyed ``constants.<key>``."""
        ck = self.opened.graph()
        values = dict(iter_values(ck.root, "", state_children))
        for name, extra in ck.extra_roots.items():
            values.update(iter_values(extra, name, state_children))
        return values


@contextmanager
def record_reader(ck: Checkpoint) -> Iterator[Callable[[StorageRef], bytearray]]:
    """Read the storage records of the torch zip or legacy file ``ck`` (its node graph): the function given reads
    storage ``ref``'s ``numel`` elements from its record (inflated when a re-packed archive compressed it),
    byte-swapped as ``torch.load`` swaps them when the file is big-endian (:meth:`~ckptool.formats.torchfile.
    Checkpoint.byteswap_size`). The file stays open inside the ``with`` block.

    Raises (from the function):
        UnsupportedError: a storage without a complete record.
        CkptError: a truncated storage.
    """
    with source.open_binary(ck.path) as f:
        if ck.format != formats.TORCH_LEGACY:
            resolve_zip_offsets(ck, f)

        def read(ref: StorageRef) -> bytearray:
            rec = ck.record("data/" + ref.key)
            nbytes = ref.numel * storage_element(ref)[1]
            if rec is None or rec.size < nbytes:
                raise UnsupportedError(f"{ck.path}: storage {ref.key!r} has no complete record")
            if rec.zipinfo is not None and rec.zipinfo.method != 0:  # a re-packed, compressed archive
                raw = bytearray(read_member(f, rec.zipinfo, ck.path)[:nbytes])
            else:
                f.seek(rec.offset)
                raw = bytearray(f.read(nbytes))
            if len(raw) != nbytes:
                raise CkptError(f"{ck.path}: storage {ref.key!r} is truncated; re-download the file")
            swap = ck.byteswap_size(ref)
            return bytearray(byteswap(raw, swap)) if swap else raw  # saved big-endian: swapped as torch.load does

        yield read
