"""The torch legacy stream walk of ``ckptool scan`` (:class:`LegacyWalk`, a base class of
:class:`ckptool.scanning.pickles.Scanner`): the five pickles of a file ``torch.save`` wrote before torch 1.6, then
its storage blocks, to find data after them; and the streams nested in a pickle's ``torch.storage._load_from_bytes``
calls (``pickle.dump`` of a tensor writes its storage so), each walked in place, as the stream torch.load reads it
(:meth:`LegacyWalk.nested_streams`). Nothing is imported or called from the file.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, BinaryIO

from ckptool.errors import CkptError, TruncatedError
from ckptool.formats.dtypes import STORAGE_TYPES
from ckptool.formats.nodes import LOAD_FROM_BYTES, BlobView, StorageRef, global_placeholder, qualified_name
from ckptool.formats.pickle_check import PickleBuffer, release_pages
from ckptool.scanning.byte_windows import ZIP_LOCAL, Container, Window
from ckptool.scanning.results import PickleFinding, ScanResult
from ckptool.scanning.tar import inside, join_where

if TYPE_CHECKING:
    from ckptool.formats.unpickler import RestrictedUnpickler
    from ckptool.scanning.layouts import Layout

__all__ = ["MAX_STREAM_DEPTH", "STREAM_LOADER", "LegacyWalk", "failed"]

#: ``torch.storage._load_from_bytes`` streams inside the stream of another are walked this deep (a real
#: ``pickle.dump`` of tensors nests one); a stream deeper still is an unreadable finding (the verdict is then no
#: better than ``error``)
MAX_STREAM_DEPTH = 4
#: the pages a walk of a stream touched are handed back in this many bytes around it: the kernel maps up to 64 KiB
#: around a page read from a mapped file (fault-around), pages of the bytes before the stream included
_AROUND = 64 << 10
#: the first three pickles of every stream ``torch.save`` writes in the legacy format on a little-endian machine (the
#: magic number, the protocol version 1001, the sys-info dict; torch/serialization.py ``_legacy_save``), and the
#: offsets where each ends: they name no global, so a stream that starts with these bytes (each storage of a
#: ``pickle.dump`` of tensors) has them recorded as a read records them, without reading them again
TORCH_HEAD = (b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03."
              b"\x80\x02}q\x00(X\x10\x00\x00\x00protocol_versionq\x01M\xe9\x03X\r\x00\x00\x00little_endianq\x02\x88"
              b"X\n\x00\x00\x00type_sizesq\x03}q\x04(X\x05\x00\x00\x00shortq\x05K\x02X\x03\x00\x00\x00intq\x06K\x04"
              b"X\x04\x00\x00\x00longq\x07K\x04uu.")
_HEAD_ENDS = (15, 21, len(TORCH_HEAD))
_HEAD_OFFSETS = (0, *_HEAD_ENDS[:2])
#: the five pickles of a legacy stream, as their ``where`` names them
_LEGACY_PARTS = ("legacy magic number", "legacy protocol version", "legacy sys_info", "legacy main pickle",
                 "legacy storage keys")
#: the last two pickles of a stream ``torch.save`` of one storage writes in the legacy format (each storage of a
#: ``pickle.dump`` of tensors), in one expression: the main pickle, the persistent id ``('storage',
#: torch.<Type>Storage, key, location, numel, None)`` (torch/serialization.py ``_legacy_save.persistent_id``,
#: protocol 2; ``torch.storage.UntypedStorage`` for dtypes with no storage class of their own: float8, uint16...),
#: then the key list ``[key]``; for a key and a location tag under 256 bytes and an element count of BININT1, BININT2
#: or BININT (:func:`own_storage_pickles` checks the lengths and the signs it leaves open). Any other is unpickled
_OWN_BOTH = re.compile(rb"\x80\x02\(X\x07\x00\x00\x00storageq\x00c(torch|torch\.storage)\n(\w{1,64})\nq\x01"
                       rb"X(.)\x00\x00\x00(.*?)q\x02X(.)\x00\x00\x00(.*?)q\x03(?:K(.)|M(..)|J(....))Ntq\x04Q\."
                       rb"\x80\x02\]q\x00X(.)\x00\x00\x00(.*?)q\x01a\.", re.DOTALL)
#: the bytes :data:`_OWN_BOTH` may span at most (its fixed opcodes, a 64-character type name, a key twice and a tag
#: of 255 bytes each)
_OWN_WINDOW = 1024
#: the opcodes of the key list before its key's length (PROTO 2, EMPTY_LIST, BINPUT 0, BINUNICODE)
_KEYS_HEAD = b"\x80\x02]q\x00X"


def own_storage_pickles(buf: PickleBuffer, pos: int,
                        stop: int) -> tuple[str, str, str, str, int, int, int] | None:
    """``(storage type module, name, key, location, numel, end of the main pickle, end of the key list)`` when
    ``buf[pos:stop]`` starts with the two pickles torch's legacy ``torch.save`` of one storage writes after its first
    three (:data:`_OWN_BOTH`): what the restricted unpickler reads from them (the key and location decoded as
    BINUNICODE is, UTF-8 with surrogates passed), without unpickling; None for anything else (a numel that is
    negative, a key of the key list that is not the storage's, other opcodes), which is then unpickled. A hypothesis
    test compares the two on mutated streams."""
    m = _OWN_BOTH.match(buf, pos, min(stop, pos + _OWN_WINDOW))
    if m is None:
        return None
    key, loc = m[4], m[6]
    if len(key) != m[3][0] or len(loc) != m[5][0] or m[10] != m[3] or m[11] != key:
        return None
    count = m[7] or m[8] or m[9]
    numel = int.from_bytes(count, "little", signed=len(count) == 4)
    if numel < 0:
        return None
    try:
        text, tag = key.decode("utf-8", "surrogatepass"), loc.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    return m[1].decode("ascii"), m[2].decode("ascii"), text, tag, numel, m.start(10) - len(_KEYS_HEAD), m.end()


#: the global whose calls pass a stream that torch.load reads (:meth:`LegacyWalk.nested_streams`)
STREAM_LOADER = qualified_name(*LOAD_FROM_BYTES)


#: the labels of the five pickles of a stream at ``where`` (:func:`_labels`), remembered for so many places: the
#: streams of a folder of like files are at the same places, and a label shared is one string in memory and in the
#: pickle a forked child sends its results in
_LABELS_KEPT = 1024
_labels_of: dict[str, tuple[str, ...]] = {}


def _labels(where: str) -> tuple[str, ...]:
    """``where!legacy magic number`` ... ``where!legacy storage keys`` (:data:`_LEGACY_PARTS`)."""
    got = _labels_of.get(where)
    if got is None:
        got = tuple(join_where(where, part) for part in _LEGACY_PARTS)
        if len(_labels_of) < _LABELS_KEPT:
            _labels_of[where] = got
    return got


def failed(where: str, offset: int, names: list[str], err: Exception) -> PickleFinding:
    """The finding of a pickle that could not be read to its end because of ``err``: ``truncated`` when the data
    ended first (:class:`~ckptool.errors.TruncatedError`)."""
    return PickleFinding(where, offset, names, str(err), truncated=isinstance(err, TruncatedError))


class LegacyWalk:
    """The legacy stream walk of a scan, a base class of :class:`~ckptool.scanning.pickles.Scanner`, which provides
    the attributes and methods declared here."""

    res: ScanResult
    #: the pickles torch's loader reads (every other one is hidden)
    loaded: set[str]
    #: the root of the first pickle torch's loader reads
    root: Any
    #: how many ``_load_from_bytes`` streams the walk is inside (:meth:`nested_streams`)
    stream_depth: int = 0

    if TYPE_CHECKING:  # provided by Scanner
        def load_at(self, buf: PickleBuffer, pos: int, where: str, storages: dict[str, StorageRef] | None,
                    stop: int | None = None) -> tuple[Any, Any, int]: ...
        def record(self, finding: PickleFinding, root: Any = None, uncalled: Collection[str] = ()) -> None: ...
        def note(self, text: str) -> None: ...
        def trailing(self, buf: PickleBuffer, pos: int, where: str, depth: int, *, base: int = 0,
                     stop: int | None = None) -> None: ...
        def globals_before_failure(self, buf: PickleBuffer, pos: int, what: str, e: CkptError,
                                   stop: int | None = None) -> list[str]: ...
        def zip(self, buf: Container, where: str, depth: int, f: BinaryIO | None = None, *,
                loaded: bool = False) -> Layout: ...

    def legacy(self, buf: PickleBuffer, where: str, depth: int, *, start: int = 0, stop: int | None = None,
               loaded: bool = False) -> None:
        """The five pickles of a torch legacy stream (torch/serialization.py ``_legacy_load``), then its storage
        blocks, to find data after them. ``start``, ``stop``: the stream is ``buf[start:stop]`` (a window of the
        outer buffer: a ``_load_from_bytes`` stream, read in place), its offsets counted from ``start``;
        ``loaded``: torch's loader reads the stream (the file itself is always read)."""
        stop = len(buf) if stop is None else stop
        pos = start
        main_storages: dict[str, StorageRef] = {}
        keys: object = None
        known = buf[start:start + len(TORCH_HEAD)] == TORCH_HEAD and start + len(TORCH_HEAD) <= stop
        own = own_storage_pickles(buf, start + len(TORCH_HEAD), stop) if known else None
        if own is not None:  # torch's own five pickles of one storage: what their read records
            pos, keys = self._own_storage(own, where, start, main_storages, loaded or not where)
        for i, part in enumerate(_LEGACY_PARTS if own is None else ()):
            label = join_where(where, part)
            if loaded or not where:
                self.loaded.add(label)
            if known and i < len(_HEAD_ENDS):  # torch's own first pickles (TORCH_HEAD): what a read records
                self.record(PickleFinding(label, pos - start, []))
                pos = start + _HEAD_ENDS[i]
                continue
            try:
                root, up, end = self.load_at(buf, pos, label, main_storages if i == 3 else None, stop)
            except CkptError as e:
                self.record(failed(label, pos - start, self.globals_before_failure(buf, pos, label, e, stop), e))
                self.nested_streams(buf, getattr(e, "unpickler", None), label, pos)
                return
            self.record(PickleFinding(label, pos - start, [qualified_name(m, n) for m, n in up.globals_seen]),
                        root if i == 3 else None, up.uncalled_globals())
            self.nested_streams(buf, up, label, pos)
            if i == 4:
                keys = root
            pos = end
        after = self._storage_blocks(buf, keys, main_storages, pos, start, stop, where)
        if after is not None and after < stop:
            self.trailing(buf, after, where, depth, base=start, stop=stop)

    def _own_storage(self, own: tuple[str, str, str, str, int, int, int], where: str, start: int,
                     main_storages: dict[str, StorageRef], loaded: bool) -> tuple[int, list[str]]:
        """Record the five pickles of a legacy stream at ``start`` that begins with :data:`TORCH_HEAD` and
        :func:`own_storage_pickles`' answer ``own``, as their read records them: no global in the first four, the
        storage type global in the main pickle, held as a value (a persistent id's part: never called), the
        :class:`~ckptool.formats.nodes.StorageRef` its root, into ``main_storages``; ``loaded``: torch's loader
        reads them. Returns where the key list ends and the key list."""
        module, type_name, key, location, numel, main_end, keys_end = own
        labels = _labels(where)
        seen = self.loaded
        if loaded:
            seen.update(labels)
        pickles = self.res.pickles  # the pickles that name no global: what record() adds for them, hidden or not
        for i in (0, 1, 2):
            pickles.append(PickleFinding(labels[i], _HEAD_OFFSETS[i], [], None, labels[i] not in seen))
        name = qualified_name(module, type_name)
        # the storage type as a value (nothing calls it): the process's one placeholder of the name, never used
        ref = main_storages[key] = StorageRef("storage", global_placeholder(module, type_name), key, location, numel,
                                              (None,))
        self.record(PickleFinding(labels[3], len(TORCH_HEAD), [name]), ref, (name,))
        pickles.append(PickleFinding(labels[4], main_end - start, [], None, labels[4] not in seen))
        return keys_end, [key]

    def _storage_blocks(self, buf: PickleBuffer, keys: object, main_storages: dict[str, StorageRef], pos: int,
                        start: int, stop: int, where: str) -> int | None:
        """The storage blocks of a legacy stream ``buf[start:stop]`` from ``pos`` (after its pickles), in the order
        of the storage ``keys`` (the last pickle's root): 8-byte element count + numel * element size bytes each,
        stepped over by their declared sizes, never read. Returns where they end; None (a note, or what is cut
        short) when they do not add up."""
        if not isinstance(keys, list):
            self.note(f"the legacy storage key list{inside(where)} is not a list; data after it was not checked")
            return None
        for key in keys:
            ref = main_storages.get(str(key)) if isinstance(key, (str, int)) else None
            head = bytes(buf[pos:min(pos + 8, stop)])
            if ref is not None and len(head) != 8:
                self.res.incomplete.append(f"the data ends at byte {stop - start}{inside(where)}, before the legacy "
                                           f"storage {key}: the file is truncated (torch.load fails on it)")
                return None
            if ref is None:
                self.note(f"the legacy storage blocks{inside(where)} do not match the storage keys; data after them "
                          "was not checked")
                return None
            numel = struct.unpack("<q", head)[0]
            elsize = STORAGE_TYPES.get(ref.storage_type_name, ("", 1))[1]
            if numel < 0:
                self.note(f"a legacy storage block{inside(where)} has a negative size; data after it was not checked")
                return None
            if pos + 8 + numel * elsize > stop:
                self.res.incomplete.append(
                    f"legacy storage {key} needs {numel * elsize} bytes at byte {pos + 8 - start}{inside(where)}, but "
                    f"the data ends at byte {stop - start}: the file is truncated (torch.load fails on it)")
                return None
            pos += 8 + numel * elsize
        return pos

    def nested_streams(self, buf: PickleBuffer, up: RestrictedUnpickler | None, where: str, pos: int) -> None:
        """The stream each ``torch.storage._load_from_bytes(b)`` call of the pickle just read at ``buf[pos]``
        (``up``: its unpickler, :meth:`~ckptool.formats.unpickler.RestrictedUnpickler.streams`; None: none) passed:
        ``torch.load(io.BytesIO(b), weights_only=False)`` runs what ``b``'s pickles name, so each ``b`` is walked
        (:meth:`stream`), where ``b`` lies in ``buf`` (a :class:`~ckptool.formats.nodes.BlobView`: never copied), at
        ``where!_load_from_bytes at byte M`` (``M``: its first byte, counted from the pickle's start); a short ``b``
        (read as bytes) at ``where!_load_from_bytes call N``. A memo reference passing the same ``b`` again is not
        walked again; an argument that is no bytes the pickle holds (a value built by a call) is a note."""
        streams = up.streams() if up is not None else []
        loaded = where in self.loaded
        seen: set[int] = set()
        for n, b in enumerate(streams, 1):
            if id(b) in seen:
                continue
            seen.add(id(b))
            if isinstance(b, BlobView) and b.kind != "str":
                self.stream(buf, b.offset, b.offset + b.length,
                            join_where(where, f"_load_from_bytes at byte {b.offset - pos}"), loaded)
            elif isinstance(b, (bytes, bytearray)):
                self.stream(b, 0, len(b), join_where(where, f"_load_from_bytes call {n}"), loaded)
            else:
                what = "a str" if isinstance(b, (str, BlobView)) else f"a {type(b).__name__} (not bytes the file holds)"
                self.note(f"torch.storage._load_from_bytes call {n} in {where} is passed {what}: no stream to walk")

    def stream(self, buf: PickleBuffer, start: int, stop: int, where: str, loaded: bool) -> None:
        """``buf[start:stop]``, a stream ``torch.load`` reads from memory (``io.BytesIO``: it never tries the tar
        layout there), walked in place: a zip (its first bytes ``PK\\x03\\x04``, torch's ``_is_zipfile``) by
        :meth:`zip` over a :class:`~ckptool.scanning.byte_windows.Window`, anything else as a legacy stream
        (:meth:`legacy`), whose first pickle torch unpickles whatever it is. ``loaded``: torch's loader reads the
        pickle that passes it. Nested more than :data:`MAX_STREAM_DEPTH` deep: an unreadable finding. The pages of
        a mapped ``buf`` the walk touched, and those the kernel mapped around them (:data:`_AROUND`), are handed
        back after it (:func:`~ckptool.formats.pickle_check.release_pages`)."""
        if loaded:
            self.loaded.add(where)
        if self.stream_depth >= MAX_STREAM_DEPTH:
            self.record(PickleFinding(where, 0, [], f"not read: torch.storage._load_from_bytes streams nested more "
                                                    f"than {MAX_STREAM_DEPTH} deep"))
            return
        root = self.root
        self.stream_depth += 1
        try:
            if bytes(buf[start:min(start + 4, stop)]) == ZIP_LOCAL:
                try:
                    self.zip(Window(buf, start, stop - start), where, self.stream_depth, loaded=loaded)
                except CkptError as err:
                    self.record(failed(where, 0, [], err))
            else:
                self.legacy(buf, where, self.stream_depth, start=start, stop=stop, loaded=loaded)
        finally:
            self.stream_depth -= 1
            self.root = root  # the root of the file's pickle, not of a stream inside it
            release_pages(buf, start // _AROUND * _AROUND, min(len(buf), -(-stop // _AROUND) * _AROUND))
