"""Strided views over raw storage bytes: which views fit their storage, and their elements in row-major order,
without torch.

A tensor is ``storage[offset + sum(i_k * stride_k)]`` for every index ``i`` of ``shape`` (torch's strided layout,
``Tensor.as_strided``). :func:`view_problem` is the one structural check of a tensor against its storage (the
checks ``torch.load`` runs when it rebuilds a tensor); :func:`check_tensor_views` runs it over a checkpoint's graph
for every reader. :func:`gather` yields a view's elements' bytes in the order ``Tensor.contiguous()`` lays them
out, reading from the bytes of the storage span the view reaches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast

from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.dtypes import element_size, storage_nbytes, tensor_dtype
from ckptool.formats.nodes import GlobalMeta, PersistentRef, PickledObject, ReduceNode, StorageRef, TensorNode

__all__ = ["check_tensor_views", "gather", "shape_problem", "tensor_view_problem", "view_problem"]

#: element size in bytes -> the ``memoryview.cast`` format of an unsigned integer that wide
_WORDS: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}


def gather(span: bytes | bytearray | memoryview, esize: int, offset: int, shape: Sequence[int],
           stride: Sequence[int], *, chunk: int | None = None) -> Iterator[bytes]:
    """The bytes of the view ``offset`` / ``shape`` / ``stride`` (in elements, ``offset`` from the start of ``span``)
    over ``span`` (a storage's bytes, elements of ``esize`` bytes), in row-major order, as pieces of at most
    ``chunk`` bytes (``chunk`` a multiple of ``esize``; None: one piece). Strides must be non-negative and the view
    inside ``span`` (the caller checks the span, as torch's ``setStorage`` does).

    Memory: the output pieces; rows are sliced from ``span`` with ``memoryview`` steps (no per-element Python work
    for element sizes 1, 2, 4 and 8).
    """
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return
    buf = memoryview(span).cast("B")
    if not shape:
        yield bytes(buf[offset * esize:(offset + 1) * esize])
        return
    fmt = _WORDS.get(esize)
    elems = buf.cast(fmt) if fmt else None
    limit = chunk if chunk is not None else n * esize
    out = bytearray()
    inner, step = shape[-1], stride[-1]
    for idx in itertools.product(*(range(s) for s in shape[:-1])):
        start = offset + sum(i * s for i, s in zip(idx, stride[:-1], strict=True))
        if elems is not None and step > 0:
            out += elems[start:start + (inner - 1) * step + 1:step].tobytes()
        else:
            for j in range(inner):
                p = (start + j * step) * esize
                out += buf[p:p + esize]
        while len(out) >= limit:
            yield bytes(out[:limit])
            del out[:limit]
    if out:
        yield bytes(out)


# ------------------------------------------------------------------------------------------------ view checks
_I64 = (1 << 63) - 1
_U64 = (1 << 64) - 1


def shape_problem(shape: object) -> str | None:
    """Why a tensor of sizes ``shape`` cannot exist in torch, or None: the sizes must be a sequence of non-negative
    integers whose product (the element count, in c10 ``safe_compute_numel``'s 64-bit arithmetic, where an overflow
    on the way counts even if a later size is 0) fits in a signed 64-bit integer."""
    if not isinstance(shape, (tuple, list)) or not all(type(v) is int or type(v) is bool for v in shape):
        return "its sizes are not a sequence of integers"
    sizes = tuple(int(v) for v in shape)
    if any(v < 0 for v in sizes):
        return f"a size is negative (sizes {sizes})"
    n = 1
    overflow = False
    for v in sizes:
        n *= v
        if n > _U64:
            overflow = True
            n &= _U64
    if overflow or n > _I64:
        return f"its element count overflows 64 bits (sizes {sizes})"
    return None


def view_problem(shape: Sequence[object], stride: Sequence[object], offset: object, itemsize: int,
                 storage_nbytes: int) -> str | None:
    """Why ``torch.load`` would refuse a tensor of ``shape`` / ``stride`` / ``offset`` (elements of ``itemsize``
    bytes) over a storage of ``storage_nbytes`` bytes, or None when it accepts it.

    The checks ``Tensor.set_`` runs when ``torch._utils._rebuild_tensor`` rebuilds a tensor (aten ``setStrided``,
    ``checkInBoundsForStorage``, ``computeStorageNbytes`` and c10 ``safe_compute_numel``, torch 2.13): sizes,
    strides and the offset are integers, as many strides as sizes, sizes and the offset non-negative, the element
    count (the product of sizes, in 64-bit arithmetic) without overflow; then, unless a size is 0 (an empty tensor
    fits any storage, whatever its offset and strides), strides non-negative where the size is over 1, and
    ``(storage_offset + 1 + Σ (size_i - 1) · stride_i) · itemsize <= storage_nbytes`` without overflow.
    """
    if not all(type(v) is int or type(v) is bool for v in (*shape, *stride, offset)):
        return "its sizes, strides and storage offset are not all integers"
    if len(shape) != len(stride):
        return f"it has {len(shape)} sizes but {len(stride)} strides"
    sizes = [int(v) for v in shape]  # type: ignore[call-overload]
    strides = [int(v) for v in stride]  # type: ignore[call-overload]
    off = int(offset)  # type: ignore[call-overload]
    if off < 0:
        return f"its storage offset {off} is negative"
    problem = shape_problem(sizes)
    if problem is not None:
        return problem
    if 0 in sizes:
        return None
    if any(st < 0 and s > 1 for s, st in zip(sizes, strides, strict=True)):  # (size 1: the stride is never used)
        return f"a stride is negative (sizes {tuple(sizes)}, strides {tuple(strides)})"
    reach = 1 + sum((s - 1) * st for s, st in zip(sizes, strides, strict=True))
    need = (off + reach) * itemsize
    if reach * itemsize > _I64 or need > _I64:
        return f"the bytes it reaches overflow 64 bits (sizes {tuple(sizes)}, strides {tuple(strides)})"
    if need > storage_nbytes:
        return (f"sizes {tuple(sizes)}, strides {tuple(strides)} and storage offset {off} reach byte {need} of a "
                f"storage of {storage_nbytes} bytes")
    return None


def tensor_view_problem(t: TensorNode) -> str | None:
    """:func:`view_problem` for a tensor node of a checkpoint graph, against the storage its persistent id declares
    (``numel`` elements of its storage class, bytes for ``UntypedStorage``); None for a tensor without a storage,
    over a legacy storage view (torch < 0.4: its offsets count from the view), or of a dtype ckptool does not know
    (reported where the dtype is needed)."""
    ref = t.storage
    if ref is None or (ref.extra and ref.extra[0] is not None):
        return None
    a = t.rebuild_args
    if len(a) < 4:
        return "its rebuild call has fewer than 4 arguments (storage, storage offset, sizes, strides)"
    shape, stride = a[2], a[3]
    if not isinstance(shape, (tuple, list)) or not isinstance(stride, (tuple, list)):
        return "its sizes and strides are not sequences"
    try:
        itemsize = element_size(tensor_dtype(t))
        nbytes = storage_nbytes(ref)
    except UnsupportedError:
        return None
    return view_problem(shape, stride, a[1], itemsize, nbytes)


_ATOMS = (str, int, float, bytes, bool, complex, type(None), StorageRef, PersistentRef, GlobalMeta)


def _children(obj: object) -> list[tuple[str, Any]]:
    """``(name, child)`` of one graph node, for naming a tensor in an error (dict keys, indices, object state;
    a module's ``_parameters`` / ``_buffers`` / ``_modules`` add no name, so the name is the state_dict key)."""
    if isinstance(obj, dict):
        return [(str(k), v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(str(i), v) for i, v in enumerate(obj)]
    return _object_children(obj) if isinstance(obj, PickledObject) else []


def _object_children(obj: PickledObject) -> list[tuple[str, Any]]:
    """:func:`_children` of an object: its dict, list and set items, its state (a module's ``_parameters`` /
    ``_buffers`` / ``_modules`` adding no name), and a call's arguments (a ``_rebuild_*`` call's adding none)."""
    out: list[tuple[str, Any]] = []
    if obj.dictitems:
        out += [(str(k), v) for k, v in obj.dictitems]
    if obj.listitems:
        out += [(str(i), v) for i, v in enumerate(obj.listitems)]
    if obj.setitems:
        out += [(str(i), v) for i, v in enumerate(obj.setitems)]
    st = obj.state
    if isinstance(st, tuple) and len(st) == 2 and isinstance(st[0], dict):  # (dict state, slot state)
        st = st[0]
    if isinstance(st, dict):
        out += [("" if k in ("_parameters", "_buffers", "_modules") else str(k), v) for k, v in st.items()]
    elif st is not None:
        out.append(("", st))
    if isinstance(obj, ReduceNode) and not isinstance(obj, TensorNode):
        out += [("" if isinstance(obj.func, GlobalMeta) and obj.func.name.startswith("_rebuild") else f"<{i}>", v)
                for i, v in enumerate(obj.args)]
    return out


def _fits(t: TensorNode) -> bool:
    """True when ``t`` is a ``_rebuild_tensor_v2`` view that surely fits its typed storage (the common case, checked
    in a few operations); False sends it to :func:`tensor_view_problem`."""
    a = t.args
    if len(a) < 4 or t.func.name != "_rebuild_tensor_v2":
        return False
    ref, off, shape, stride = a[0], a[1], a[2], a[3]
    if (type(ref) is not StorageRef or type(off) is not int or type(shape) is not tuple or type(stride) is not tuple
            or len(shape) != len(stride) or off < 0 or (ref.extra and ref.extra[0] is not None)):
        return False
    n = 1
    for size, st in zip(shape, stride, strict=True):
        if type(size) is not int or type(st) is not int or size <= 0 or st < 0:
            return False
        n *= size
        off += (size - 1) * st
    # in elements of the storage class (the dtype of a _rebuild_tensor_v2 tensor is its storage's)
    return off < ref.numel and n <= _I64


def _first_misfit(tensors: list[TensorNode]) -> TensorNode | None:
    """The first of ``tensors`` that does not fit its storage (:func:`tensor_view_problem`), or None.

    :func:`_fits` inlined for the commonest tensor, a one-dimensional ``_rebuild_tensor_v2`` view of a storage that
    surely holds it (the same verdict in a few operations, without a call: this runs for every tensor); the rest go
    through :func:`_fits`, then :func:`tensor_view_problem`."""
    rebuild_v2 = None  # the placeholder seen last whose name is _rebuild_tensor_v2 (one per file)
    for t in tensors:
        a = t.args
        func = t.func
        if len(a) >= 4 and (func is rebuild_v2 or func.name == "_rebuild_tensor_v2"):
            rebuild_v2 = func
            ref, off, shape, stride = a[0], a[1], a[2], a[3]
            if ((type(ref), type(off), type(shape), type(stride)) == _VECTOR_TYPES and len(shape) == len(stride) == 1
                    and not (ref.extra and ref.extra[0] is not None)):
                size, st = shape[0], stride[0]
                if (type(size), type(st)) == _INTS and 0 < size <= _I64 and off >= 0 and st >= 0 and \
                        off + (size - 1) * st < ref.numel:
                    continue
        if not _fits(t) and tensor_view_problem(t) is not None:
            return t
    return None


#: the types of a one-dimensional view's storage, storage offset, sizes and strides; of a size and a stride
_VECTOR_TYPES = (StorageRef, int, tuple, tuple)
_INTS = (int, int)


def _walk(root: object, pick: Callable[[list[TensorNode]], TensorNode | None],
          named: bool) -> tuple[str, TensorNode] | None:
    """The first tensor node reachable from ``root`` (depth-first, each container once) that ``pick`` chooses
    (``pick(tensors)`` returns the first of ``tensors`` it wants, or None), with its dotted path when ``named``."""
    stack: list[tuple[str, object]] = [("", root)]
    seen: set[int] = set()
    while stack:
        path, obj = stack.pop()
        if type(obj) is TensorNode:
            if pick([obj]) is not None:
                return path, obj
            continue
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if not named and _is_mapping_only(obj):
            found = _state_dict_batch(cast(PickledObject, obj), pick, stack)
            if found is not None:
                return "", found
            continue
        kids = _children(obj)
        if named:
            stack += [(f"{path}.{k}" if path and k else path or k, v) for k, v in reversed(kids)]
        else:
            stack += [("", v) for _, v in reversed(kids)]
    return None


def _is_mapping_only(obj: object) -> bool:
    """An object holding dict items alone (a state_dict, an ``OrderedDict``)."""
    return isinstance(obj, PickledObject) and bool(obj.dictitems) and not obj.listitems and obj.state is None


def _state_dict_batch(obj: PickledObject, pick: Callable[[list[TensorNode]], TensorNode | None],
                      stack: list[tuple[str, object]]) -> TensorNode | None:
    """A state_dict's tensors checked in one batch, in order, without a stack: the one ``pick`` chooses, or None
    (its other values, and a call's arguments, then pushed on ``stack`` unnamed)."""
    values = [v for _k, v in obj.dictitems or ()]
    found = pick([v for v in values if type(v) is TensorNode])
    if found is not None:
        return found
    stack += [("", v) for v in values if type(v) is not TensorNode]
    if isinstance(obj, ReduceNode):
        stack += [("", v) for v in obj.args]
    return None


def check_tensor_views(root: object, where: str) -> None:
    """Refuse the graph ``root`` (a checkpoint's pickle) when one of its tensors does not fit in its storage
    (:func:`tensor_view_problem`), naming the first such tensor by its key. Every torch reader runs it
    (:func:`ckptool.formats.torchfile.read_checkpoint`), so inspect, remap, the prefix commands, convert,
    extract-state-dict, diff and load_into see the same verdict ``torch.load`` gives. Linear in the graph.

    Raises:
        CorruptCheckpointError: a tensor with an impossible layout (``where`` names the file).
    """
    found = _walk(root, _first_misfit, named=False)
    if found is None:
        return
    bad = found[1]
    named = _walk(root, lambda ts: bad if bad in ts else None, named=True)
    key = named[0] if named is not None and named[0] else "(a tensor)"
    raise CorruptCheckpointError(
        f"{where}: tensor {key!r} does not fit in its storage: {tensor_view_problem(found[1])}; torch.load refuses "
        "it too. The file is damaged or was crafted: re-download it, or save it again from the model")
