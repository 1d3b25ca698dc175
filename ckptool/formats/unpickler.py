"""Restricted unpickler: reads the structure of any checkpoint pickle without importing or running anything.

Security policy
---------------
* Nothing is imported. :meth:`RestrictedUnpickler.find_class` never imports and never looks in ``sys.modules``:
  every GLOBAL / STACK_GLOBAL / INST / OBJ / EXT resolves to a placeholder class (a
  :class:`~ckptool.formats.nodes.GlobalMeta` instance) that only remembers ``module`` and ``name``, so the same
  bytes give the same graph on every machine, whatever is installed.
* Nothing from the file is called. Calling a placeholder (REDUCE) or instantiating it (NEWOBJ / NEWOBJ_EX / OBJ /
  INST) creates a record node (:class:`~ckptool.formats.nodes.ReduceNode`, ``TensorNode``, ``ParameterNode``,
  ``ObjectNode``) holding the callable and its arguments; BUILD, SETITEMS, APPENDS and ADDITEMS on a node are
  recorded on it (:class:`~ckptool.formats.nodes.PickledObject`). A BUILD on a placeholder class itself (class
  mutation, which ``pickle`` runs as ``setattr`` on the class) is counted, not refused, and reported as a use of
  that global (:func:`~ckptool.formats.nodes.use_key`: ``collections.Counter !class-build``) in ``globals_seen``.
* :meth:`RestrictedUnpickler.persistent_load` reads no data: torch's storage persistent ids
  (``('storage', StorageType, key, location, numel)``) become :class:`~ckptool.formats.nodes.StorageRef` records
  (one per key, so storage sharing stays visible and survives a rewrite), legacy ``('module', cls, ...)`` ids
  become the class placeholder, anything else a :class:`~ckptool.formats.nodes.PersistentRef`. Tensor bytes are
  never read here.
* Resource limits: before the C unpickler runs, :func:`~ckptool.formats.pickle_check.check_pickle` walks the
  opcodes and refuses memo bombs, lengths past the end of the data and FRAMEs that cut an opcode; tuple nesting deep
  enough to overflow the C stack when hashed is unpickled in a thread with a stack sized for it
  (:func:`~ckptool.formats.pickle_check.call_with_stack`). A call that would allocate memory sized by its
  arguments (``bytearray(n)``, a storage or legacy tensor type, a quantized tensor larger than its storage) over
  :data:`MAX_REQUEST_BYTES` is reported as a use of its global (``builtins.bytearray !alloc=1500000000``); nothing
  is allocated here.
* Every failure of a damaged or hostile pickle becomes one
  :class:`~ckptool.errors.CorruptCheckpointError` (the exceptions in :data:`PICKLE_ERRORS`, ``raise ... from``).

The graph it produces is made of plain Python values (dict, list, tuple, str, int, float, bytes, ...) and the
node types of :mod:`ckptool.formats.nodes`; :mod:`ckptool.formats.pickler` writes it back byte-for-byte equivalent
for ``torch.load``. Parsing uses CPython's C ``pickle.Unpickler`` (fast), with its callbacks overridden, reading the
checked bytes as one flat stream.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import mmap
import os
import pickle
import threading
from collections.abc import Callable, Collection
from typing import Any, BinaryIO, cast

from ckptool.errors import CorruptCheckpointError, UnsupportedError
from ckptool.formats.dtypes import STORAGE_TYPES
from ckptool.formats.nodes import (
    ALLOC,
    CLASS_BUILD,
    LOAD_FROM_BYTES,
    MAX_ARGS_WALKED,
    BlobView,
    GlobalMeta,
    PersistentRef,
    StorageRef,
    new_global,
    note_persistent_id,
    qualified_name,
    requested_elements,
    use_key,
)
from ckptool.formats.pickle_check import (
    BLOB_KINDS,
    RELEASE_EVERY,
    PickleBuffer,
    Span,
    call_with_stack,
    check_pickle,
    release_pages,
    tuple_levels,
)

__all__ = ["MAX_REQUEST_BYTES", "PICKLE_ERRORS", "PlaceholderPool", "RestrictedUnpickler", "element_size",
           "load_pickle_at", "load_structure", "partial_globals", "request_bytes", "thread_pool"]

class PlaceholderPool:
    """Placeholders (:func:`~ckptool.formats.nodes.new_global`) reused from one pickle to the next, one per name:
    making one is a class creation (about 5 µs), and a scan of a folder of small pickles names the same few
    globals in every file. :meth:`take` hands one out reset to a new placeholder's state
    (:meth:`~ckptool.formats.nodes.GlobalMeta.reset_uses`) and remembers which unpickler took it; that unpickler's
    :meth:`RestrictedUnpickler.uncalled_globals` and :meth:`~RestrictedUnpickler.streams` raise ``RuntimeError``
    once another unpickler took one of its placeholders (a read of state that is no
    longer its own, rather than a wrong answer). Not shared between threads (:func:`thread_pool`); holds at most
    ``limit`` names (beyond them a new placeholder each time, as without a pool). The node graphs of earlier pickles
    keep their placeholders; only the use state above is taken from them."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._placeholders: dict[tuple[str, str], GlobalMeta] = {}
        #: the ``id`` of the unpickler that took each placeholder last (not the unpickler: a reference would keep its
        #: memo, and the whole graph it read, alive until the next pickle names the global)
        self._users: dict[tuple[str, str], int] = {}

    def take(self, module: str, name: str, user: object) -> GlobalMeta:
        """The placeholder of ``module.name`` for ``user`` (an unpickler), reset to a new one's state."""
        key = (module, name)
        g = self._placeholders.get(key)
        if g is None:
            g = new_global(module, name)
            if len(self._placeholders) >= self.limit:
                return g
            self._placeholders[key] = g
        else:
            g.reset_uses()
        self._users[key] = id(user)
        return g

    def check(self, user: object, keys: Collection[tuple[str, str]]) -> None:
        """Raise ``RuntimeError`` when a placeholder of ``keys`` that ``user`` took was taken by another since."""
        users, me = self._users, id(user)
        for key in keys:
            if users.get(key, me) != me:
                raise RuntimeError(f"the placeholder of {qualified_name(*key)} was reused before its pickle's "
                                   "uses were read")


_THREAD = threading.local()


def thread_pool() -> PlaceholderPool:
    """This thread's :class:`PlaceholderPool` (the scan's: :meth:`ckptool.scanning.pickles.Scanner.load_at`)."""
    pool: PlaceholderPool | None = getattr(_THREAD, "pool", None)
    if pool is None:
        pool = _THREAD.pool = PlaceholderPool()
    return pool



class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` and ``persistent_load`` never import or execute anything.

    After :meth:`load`, ``globals_seen`` lists every global the pickle names (first use order) as
    ``(module, name)``, and ``storages`` maps each storage key to its :class:`StorageRef` (first use order).
    ``storages`` may be shared between several unpicklers (TorchScript's data.pkl and constants.pkl).
    """

    def __init__(self, file: BinaryIO, *, storages: dict[str, StorageRef] | None = None,
                 global_cache: dict[tuple[str, str], GlobalMeta] | None = None,
                 views: tuple[bytes, list[BlobView]] | None = None, pool: PlaceholderPool | None = None) -> None:
        self._globals: dict[tuple[str, str], GlobalMeta] = global_cache if global_cache is not None else {}
        #: where new placeholders come from (None: :func:`~ckptool.formats.nodes.new_global`, one each)
        self._pool = pool
        self.globals_seen: dict[tuple[str, str], None] = {}
        self.storages: dict[str, StorageRef] = storages if storages is not None else {}
        #: one string per distinct location tag: torch pickles a new ``"cuda:0"`` for every storage
        self._locations: dict[str, str] = {}
        # pickle.Unpickler.__init__ looks the callback up: set first, a closure over the two tables (no attribute
        # lookups in the 50,000 calls of a big state_dict; no reference to self, so no cycle) replaces the method
        loader = _storage_loader(self.storages, self._locations)
        if views is not None:  # the blobs a skeleton (_skeleton) names by persistent id
            loader = _view_loader(loader, *views)
        self.persistent_load = loader  # type: ignore[method-assign,assignment]
        super().__init__(file, encoding="latin1")

    def load(self) -> Any:
        """Unpickle (as ``pickle.Unpickler.load``), then add to ``globals_seen`` a use key
        (:func:`~ckptool.formats.nodes.use_key`) for each global the pickle BUILDs on as a class (class mutation)
        and each call that asks to allocate more than :data:`MAX_REQUEST_BYTES` (``bytearray(1500000000)``); also
        when unpickling fails, for what was read before the failure."""
        try:
            return super().load()
        finally:
            self._note_uses()

    def _note_uses(self) -> None:
        for key in list(self.globals_seen):
            g = self._globals.get(key)
            if g is None:
                continue
            if g.class_builds:
                self.globals_seen[use_key(*key, CLASS_BUILD)] = None
            nbytes = g.requested * element_size(g.name)
            if nbytes > MAX_REQUEST_BYTES:
                self.globals_seen[use_key(*key, f"{ALLOC}{nbytes}")] = None

    def uncalled_globals(self) -> set[str]:
        """The globals of ``globals_seen`` (``module.qualname``, Python 3 names) that the pickle never called
        (REDUCE) nor instantiated (NEWOBJ / NEWOBJ_EX / OBJ / INST) nor BUILT on as a class nor passed to a call (in
        its arguments, at any depth of tuples, lists, sets and dicts): held only as values (BUILD state, dict values,
        list items). Empty when a call's arguments were too many to walk (``args_unread``).
        Meaningful after a :meth:`load` that read the pickle to its STOP (a pickle that failed may have called them
        later); with a shared ``global_cache``, a call in any pickle that shares it counts.

        Raises:
            RuntimeError: a :class:`PlaceholderPool` gave one of its placeholders to another unpickler since.
        """
        if self._pool is not None:
            self._pool.check(self, self._globals)
        if any(g.args_unread for g in self._globals.values()):
            return set()
        out = set()
        for key in self.globals_seen:
            g = self._globals.get(key)
            if g is not None and not (g.called or g.passed or g.class_builds):
                out.add(qualified_name(*key))
        return out

    def streams(self) -> list[Any]:
        """The argument of each ``torch.storage._load_from_bytes`` call the pickle made (one argument each, in call
        order, a memo reference passing the same object again): a ``bytes`` or ``bytearray`` (a
        :class:`~ckptool.formats.nodes.BlobView` when read with views), or whatever else the pickle passed. Each is
        a whole torch.save stream that torch.load reads with ``weights_only=False`` (``torch/storage.py``); also after
        a failed :meth:`load`, for the calls made before the failure. Taken once: the list is emptied.

        Raises:
            RuntimeError: as :meth:`uncalled_globals`.
        """
        if self._pool is not None:
            self._pool.check(self, self._globals)
        g = self._globals.get(LOAD_FROM_BYTES)
        if g is None or not g.streams:
            return []
        got = list(g.streams)
        g.streams.clear()
        return got

    def find_class(self, module: str, name: str) -> GlobalMeta:
        """The placeholder for global ``module.name`` (one per name and ``global_cache``); imports nothing."""
        if not isinstance(module, str) or not isinstance(name, str):
            raise pickle.UnpicklingError("global names must be strings")
        key = (module, name)
        self.globals_seen[key] = None
        g = self._globals.get(key)
        if g is None:
            g = new_global(module, name) if self._pool is None else self._pool.take(module, name, self)
            self._globals[key] = g
        return g

    def persistent_load(self, pid: Any) -> StorageRef | GlobalMeta | PersistentRef:
        """A record for persistent id ``pid``; reads no data (see the security policy above). Each instance
        answers with :func:`_storage_loader`'s closure, which gives the same records."""
        return _persistent_record(self.storages, self._locations, pid)


def _storage_loader(storages: dict[str, StorageRef], locations: dict[str, str]
                    ) -> Callable[[Any], StorageRef | GlobalMeta | PersistentRef]:
    """:meth:`RestrictedUnpickler.persistent_load` over ``storages`` and ``locations``, with the common case first
    (one call per storage): a 5-tuple of exact types that names a new storage. Everything else, a storage named
    again included, goes to :func:`_persistent_record`."""

    new_ref = object.__new__

    def persistent_load(pid: Any) -> StorageRef | GlobalMeta | PersistentRef:
        if type(pid) is tuple and len(pid) == 5 and pid[0] == "storage":
            key, location, numel = pid[2], pid[3], pid[4]
            if (type(key) is str and type(location) is str and type(numel) is int and numel >= 0
                    and key not in storages):
                # StorageRef(...) without its __init__ frame (one per storage: 50,000 in a big state_dict)
                ref = storages[key] = new_ref(StorageRef)
                ref.typename, ref.storage_type, ref.key, ref.numel, ref.extra = pid[0], pid[1], key, numel, ()
                ref.location = locations.setdefault(location, location)
                return ref
        return _persistent_record(storages, locations, pid)

    return persistent_load


def _view_loader(loader: Callable[[Any], Any], nonce: bytes, views: list[BlobView]) -> Callable[[Any], Any]:
    """``loader`` that first answers the persistent ids a skeleton puts in place of its blobs: bytes of ``nonce``
    (16 random bytes, which no pickle can have guessed) followed by the blob's 8-byte index into ``views``."""

    def persistent_load(pid: Any) -> Any:
        if type(pid) is bytes and len(pid) == 24 and pid[:16] == nonce:
            return views[int.from_bytes(pid[16:], "little")]
        return loader(pid)

    return persistent_load


def _persistent_record(storages: dict[str, StorageRef], locations: dict[str, str],
                       pid: Any) -> StorageRef | GlobalMeta | PersistentRef:
    """The record for persistent id ``pid`` (see the security policy above); a new storage goes into ``storages``,
    its location tag into ``locations``.

    Raises:
        pickle.UnpicklingError: a malformed storage id, or a storage declared twice with another location or size.
    """
    if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
        typename, storage_type, key, location, numel, *extra = pid
        key = str(key)
        ref = storages.get(key)
        if ref is None:
            if not isinstance(location, str) or not isinstance(numel, int) or numel < 0:
                raise pickle.UnpicklingError(f"malformed storage persistent id for key {key!r}")
            location = locations.setdefault(location, location)
            ref = StorageRef(typename, storage_type, key, location, numel, tuple(extra))
            storages[key] = ref
        elif ref.location != location or ref.numel != numel:
            raise pickle.UnpicklingError(f"storage {key!r} is declared twice with different location or size")
        return ref
    if isinstance(pid, tuple) and len(pid) == 4 and pid[0] == "module" and isinstance(pid[1], GlobalMeta):
        # legacy full-model files store each nn.Module class as ('module', cls, source_file, source); torch's
        # legacy loader returns cls (the source only feeds a "source code changed" warning). The zip format
        # names the class directly, so returning the placeholder makes a rewrite emit a plain GLOBAL.
        return pid[1]
    if not note_persistent_id(pid):  # its globals are called by the loader's persistent_load (torch.package)
        raise pickle.UnpicklingError(f"a persistent id of more than {MAX_ARGS_WALKED} values")
    return PersistentRef(pid)


#: the most bytes one call in a pickle may ask to allocate (``bytearray(n)``, ``torch.FloatStorage(n)``...) before
#: the call is reported as an unsafe use: ``torch.save`` never writes such calls (storages come from persistent ids,
#: bytes as data), and ``bytearray(1500000000)`` fills 1.5 GB when loaded
MAX_REQUEST_BYTES = 1 << 28


def element_size(name: str) -> int:
    """Bytes per element of what a sized call of the global named ``name`` (its last part) allocates: a torch
    storage or tensor type's element type's (``torch.Tensor``, ``TypedStorage``: float32's); ``bytearray`` and
    ``bytes``: 1; an unknown one: 1, the least."""
    storage = name[:-len("Tensor")] + "Storage" if name.endswith("Tensor") else name
    return STORAGE_TYPES.get(storage, ("", 4 if name in ("Tensor", "TypedStorage") else 1))[1]


def request_bytes(g: GlobalMeta, args: tuple[Any, ...]) -> int:
    """The bytes a call of placeholder ``g`` with ``args`` asks to allocate beyond the file's data
    (:func:`~ckptool.formats.nodes.requested_elements` times :func:`element_size`)."""
    return requested_elements(g, args) * element_size(g.name)


#: exceptions that a damaged or hostile pickle can raise inside the C unpickler
PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError,
                 OverflowError, UnicodeDecodeError, RecursionError)


class _FlatReader:
    """A read-only file over one buffer whose ``peek`` returns everything left: CPython's C unpickler then keeps the
    whole pickle in its input buffer and reads it as one flat stream (no per-opcode ``read`` calls, which is also
    faster), the view that :func:`check_pickle` checked. Nothing is copied: ``read`` and ``peek`` return
    ``memoryview`` slices (the C unpickler takes any buffer)."""

    def __init__(self, data: bytes | bytearray) -> None:
        self._data = data
        self._view = memoryview(data)
        self._pos = 0

    def peek(self, size: int = 0) -> memoryview:  # pickle asks for a prefetch size; we give all
        return self._view[self._pos:]

    def read(self, size: int = -1) -> memoryview:
        start = self._pos
        self._pos = len(self._view) if size is None or size < 0 else min(len(self._view), start + size)
        return self._view[start:self._pos]

    def readinto(self, b: bytearray | memoryview) -> int:
        chunk = self.read(len(b))
        b[:len(chunk)] = chunk
        return len(chunk)

    def readline(self, size: int = -1) -> bytes:
        end = len(self._data) if size is None or size < 0 else min(len(self._data), self._pos + size)
        nl = self._data.find(b"\n", self._pos, end)
        return bytes(self.read((end if nl < 0 else nl + 1) - self._pos))

    def tell(self) -> int:
        return self._pos


def _flat_reader(data: bytes | bytearray) -> BinaryIO:
    return cast(BinaryIO, _FlatReader(data))  # the C unpickler needs only read, readinto, readline and peek


def load_pickle_at(buf: PickleBuffer, pos: int = 0, what: str = "pickle", *, exact: bool = False,
                   strict_frames: bool = True, storages: dict[str, StorageRef] | None = None,
                   global_cache: dict[tuple[str, str], GlobalMeta] | None = None,
                   weights_only: list[str | None] | None = None, views: bool = False, end: int | None = None,
                   pool: PlaceholderPool | None = None) -> tuple[Any, RestrictedUnpickler, int]:
    """Check (:func:`check_pickle`) then unpickle the pickle that starts at ``buf[pos]`` into a node graph.

    ``buf`` is bytes or an ``mmap``; ``exact=True`` when the pickle ends exactly at the end of ``buf``;
    ``strict_frames=False`` reads a pickle with malformed FRAMEs as one flat stream instead of refusing it.
    Returns ``(root, unpickler, end)``, ``end`` being the offset just after the pickle's STOP opcode. ``storages``
    and ``global_cache`` go to :class:`RestrictedUnpickler`; ``weights_only`` to :func:`check_pickle` (its one item
    set to the opcode torch's weights_only unpickler refuses, found in the same walk). With ``views=True`` (scan,
    inspect: commands that never write the graph back) every blob (a bytes, bytearray or str value of
    :data:`~ckptool.formats.pickle_check.BLOB_MIN` bytes or more) is left in ``buf`` and stands in the graph as a
    :class:`~ckptool.formats.nodes.BlobView`: the walk steps over it by its declared length and the unpickler reads
    a skeleton of the opcodes without it (:func:`_skeleton`), so memory follows the pickle's structure, not its
    size; the same opcodes run in the same order, so the globals and errors are those of a full read. ``end``: the
    data ends there (a window of ``buf``: a stream nested in a blob, read in place), not at ``len(buf)``; lengths
    and a missing STOP are judged against it. ``pool``: where the unpickler's placeholders come from
    (:class:`PlaceholderPool`; None: new ones). If parsing fails after the checks, the error's ``unpickler``
    attribute still lists (``globals_seen``) the globals named before the failure.

    Raises:
        CorruptCheckpointError: a truncated, malformed or hostile pickle (``what`` names it in the message).
        UnsupportedError: tuple nesting too deep to read safely (see :func:`call_with_stack`).
    """
    spans: list[Span] | None = [] if views else None
    gaps: list[tuple[bytes, bytes]] | None = [] if views else None
    end = check_pickle(buf, pos, end, what=what, exact=exact, strict_frames=strict_frames, weights_only=weights_only,
                       blobs=spans, gaps=gaps)
    chunk, found = _skeleton(buf, pos, end, spans, gaps) if spans else (_chunk(buf, pos, end), None)
    up = RestrictedUnpickler(_flat_reader(chunk), storages=storages, global_cache=global_cache, views=found,
                             pool=pool)
    try:
        root = call_with_stack(up.load, tuple_levels(chunk), what)
    except MemoryError as e:  # not the file's fault as such: say which file needed it (the CLI reports it)
        raise MemoryError(f"reading the {len(chunk)}-byte {what}") from e
    except PICKLE_ERRORS as e:
        err = CorruptCheckpointError(
            f"{what} is corrupted or truncated ({type(e).__name__}: {_short(e)}); re-download or re-save the checkpoint"
        )
        err.unpickler = up  # type: ignore[attr-defined]
        raise err from e
    return root, up, end


def _chunk(buf: PickleBuffer, pos: int, end: int) -> bytes | bytearray:
    """``buf[pos:end]`` as bytes (``buf`` itself when it is exactly that)."""
    if pos == 0 and end == len(buf) and isinstance(buf, (bytes, bytearray)):
        return buf
    return bytes(buf[pos:end])


#: the bytes of UTF-8 a string blob's check decodes at a time
_UTF8_CHUNK = 1 << 20
#: the characters of a string blob a BlobView keeps for previews: more than ``inspect``'s widest preview reads
#: (``--all``: 400 characters a value, four times that to decide whether a container fits on a line)
_STR_HEAD = 2048


def _utf8_text(buf: PickleBuffer, start: int, stop: int) -> tuple[int, str] | None:
    """``(length in characters, first :data:`_STR_HEAD` characters)`` of ``buf[start:stop]`` decoded as the C
    unpickler decodes BINUNICODE (UTF-8, ``surrogatepass``), read :data:`_UTF8_CHUNK` bytes at a time; None when it
    is not UTF-8."""
    dec = codecs.getincrementaldecoder("utf-8")("surrogatepass")
    chars, head = 0, ""
    try:
        for at in range(start, stop, _UTF8_CHUNK):
            text = dec.decode(buf[at:min(stop, at + _UTF8_CHUNK)])
            chars += len(text)
            head = head or text[:_STR_HEAD]
            release_pages(buf, at, min(stop, at + _UTF8_CHUNK))
        dec.decode(b"", final=True)
    except UnicodeDecodeError:
        return None
    return chars, head


#: the nonce of every skeleton's persistent ids (:func:`_skeleton`): 16 random bytes drawn once a process, before any
#: file it reads was opened, so that no file can hold them (the skeleton is made from the file's bytes; the file's
#: own bytes, nested streams included, are read from the file, never from a skeleton)
_NONCE = os.urandom(16)


def _skeleton(buf: PickleBuffer, pos: int, end: int, spans: list[Span], gaps: list[tuple[bytes, bytes]] | None = None
              ) -> tuple[bytes | bytearray, tuple[bytes, list[BlobView]] | None]:
    """The pickle ``buf[pos:end]`` with each blob of ``spans`` (:func:`check_pickle`'s ``blobs``) replaced by a
    persistent id (SHORT_BINBYTES of a random nonce and the blob's index, then BINPERSID) that the unpickler answers
    with its :class:`BlobView`, and without its FRAME opcodes (the C unpickler reads the checked bytes as one flat
    stream, where a frame changes nothing; their lengths would no longer hold). A string blob that is not valid
    UTF-8 stays in place, so that the unpickler fails on it where a full read does. ``gaps``: :func:`check_pickle`'s
    copies of the bytes between the spans and of each blob's first bytes (else read from ``buf``). Returns
    ``(skeleton, (nonce,
    views))``, ``(skeleton, None)`` when ``spans`` holds no blob (only FRAMEs), the plain chunk and None when it is
    empty."""
    if not spans:
        return _chunk(buf, pos, end), None
    nonce = _NONCE
    views: list[BlobView] = []
    parts: list[bytes] = []
    prev = released = pos
    for i, (a, b, op) in enumerate(spans):
        if gaps is None and b - released >= RELEASE_EVERY:  # what was copied is not needed in memory again
            release_pages(buf, released, a)
            released = a
        gap, first = gaps[i] if gaps is not None else (bytes(buf[prev:a]), b"")
        parts.append(gap)
        prev = b
        kind = BLOB_KINDS.get(op)
        if kind is None:  # a FRAME
            continue
        head = a + 1 + (8 if op in (0x8D, 0x8E, 0x96) else 4)
        text = _utf8_text(buf, head, b) if kind == "str" else None
        if kind == "str" and text is None:
            parts.append(bytes(buf[a:b]))  # read in full, where the C unpickler raises what it raises
            continue
        parts.append(b"C\x18" + nonce + len(views).to_bytes(8, "little") + b"Q")
        if text is not None:
            view = BlobView("str", head, b - head, text[1], text[0])
        elif kind == "latin1":
            view = BlobView("str", head, b - head, bytes(buf[head:head + _STR_HEAD]).decode("latin1"), b - head)
        else:
            view = BlobView(kind, head, b - head, first if gaps is not None else bytes(buf[head:head + 16]))
        views.append(view)
    parts.append(bytes(buf[prev:end]))
    return b"".join(parts), (nonce, views) if views else None


def partial_globals(buf: PickleBuffer, start: int, stop: int, *, cut: bool = False) -> dict[tuple[str, str], None]:
    """The globals named by the opcodes in ``buf[start:stop]``, read as far as they go.

    For a pickle that :func:`check_pickle` refused at offset ``stop`` (``CorruptCheckpointError.offset``): the
    opcodes before it passed the checks, so they can be run through the restricted unpickler to see which globals
    a loader would have imported before failing. ``cut=True`` says the data was cut short at ``stop`` (a
    :class:`~ckptool.errors.TruncatedError`): the opcodes of a FRAME that runs past ``stop`` then count, as those
    of the whole file would; otherwise the read ends at such a FRAME, where a loader stops (a length no cut
    explains). Blobs are not read (:func:`_skeleton`). Never raises for bad data.
    """
    spans: list[Span] = []
    with contextlib.suppress(CorruptCheckpointError):  # the spans before the refusal are what counts
        check_pickle(buf, start, stop, what="pickle", exact=True, strict_frames=False, blobs=spans)
    # without its FRAMEs: with ``cut``, a frame cut short (declaring 20 bytes with 17 present) would make the C
    # unpickler refuse it before reading the opcodes it holds, which may name a global; without, the read stops
    # where a loader's does, at a FRAME running past ``stop``
    for a, _b, op in spans:
        if not cut and op not in BLOB_KINDS and a + 9 + int.from_bytes(buf[a + 1:a + 9], "little") > stop:
            stop = a
            spans = [s for s in spans if s[1] <= a]
            break
    chunk, found = _skeleton(buf, start, stop, spans)
    up = RestrictedUnpickler(_flat_reader(chunk), views=found)
    try:
        call_with_stack(up.load, tuple_levels(chunk))
    except (*PICKLE_ERRORS, CorruptCheckpointError, UnsupportedError):
        pass
    return up.globals_seen


def _short(e: BaseException) -> str:
    try:
        s = str(e)
    except Exception:  # a message that cannot even be rendered
        s = "?"
    return s if len(s) <= 200 else s[:200] + "..."


def load_structure(data: bytes | bytearray | memoryview | BinaryIO, what: str = "pickle", *,
                   storages: dict[str, StorageRef] | None = None,
                   global_cache: dict[tuple[str, str], GlobalMeta] | None = None) -> tuple[Any, RestrictedUnpickler]:
    """Unpickle ``data`` (bytes, or a binary file positioned at the pickle) into a node graph.

    The pickle is checked first (:func:`check_pickle`: memo bombs, lengths past the end, unknown opcodes) and read
    with a stack sized for its tuple nesting (:func:`call_with_stack`). A file is left positioned just after the
    pickle. Returns ``(root, unpickler)``; the unpickler carries ``globals_seen`` and ``storages``. ``storages``
    (shared between the pickles of one archive) and ``global_cache`` go to :class:`RestrictedUnpickler`.

    Raises:
        CorruptCheckpointError: the pickle is truncated, malformed or hostile (``what`` names it in the message).
        UnsupportedError: tuple nesting too deep to read safely.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        buf = bytes(data) if isinstance(data, memoryview) else data
        root, up, _end = load_pickle_at(buf, 0, what, exact=True, storages=storages, global_cache=global_cache)
        return root, up
    f = data
    start = f.tell()
    whole: PickleBuffer
    try:
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        f.seek(0)
        whole = f.read()
    try:
        root, up, end = load_pickle_at(whole, start, what, storages=storages, global_cache=global_cache)
    finally:
        if isinstance(whole, mmap.mmap):
            whole.close()
    f.seek(end)
    return root, up
