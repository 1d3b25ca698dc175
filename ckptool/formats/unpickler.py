"""Restricted unpickler: reads the structure of any checkpoint pickle without importing or running anything.

Security policy
---------------
* ``find_class`` never imports. Every GLOBAL / STACK_GLOBAL / INST / OBJ / EXT in the file resolves to a
  placeholder class (:class:`GlobalMeta` instance) that only remembers ``module`` and ``name``. Nothing named in
  the file is looked up in ``sys.modules`` either, so the same bytes give the same graph on every machine.
* Calling a placeholder (REDUCE) or instantiating it (NEWOBJ) creates a record node (:class:`ReduceNode`,
  :class:`ObjectNode`) holding the callable and its arguments; BUILD, SETITEMS, APPENDS and ADDITEMS on a
  node are recorded on it. No function from the file is ever called.
* ``persistent_load`` turns torch's storage persistent ids (``('storage', StorageType, key, location, numel)``)
  into :class:`StorageRef` records; tensor bytes are never read. Two tensors that share a storage get the
  same :class:`StorageRef` object, so sharing is visible (and survives a rewrite).

* Resource limits: before the C unpickler runs, :func:`check_pickle` walks the opcodes and refuses memo bombs,
  lengths past the end of the data and FRAMEs that cut an opcode; tuple nesting deep enough to overflow the C stack
  when hashed is unpickled in a thread with a stack sized for it (:func:`call_with_stack`). Every failure is a
  :class:`~ckptool.errors.CorruptCheckpointError` (see "resource limits" below).

The graph it produces is made of plain Python values (dict, list, tuple, str, int, float, bytes, ...) and the
node types below; :mod:`ckptool.pickler` writes it back byte-for-byte equivalent for ``torch.load``.
Parsing uses CPython's C ``pickle.Unpickler`` (fast), with its callbacks overridden, reading the checked bytes as
one flat stream.
"""

from __future__ import annotations

import io
import mmap
import pickle
import re
import threading
from typing import Any

from ckptool.errors import CorruptCheckpointError, UnsupportedError

# Names of the tensor rebuild functions torch writes (torch/_utils.py, torch/_tensor.py).
REBUILD_TENSOR_V2 = ("torch._utils", "_rebuild_tensor_v2")
REBUILD_TENSOR_V3 = ("torch._utils", "_rebuild_tensor_v3")
REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor")
REBUILD_QTENSOR = ("torch._utils", "_rebuild_qtensor")
REBUILD_PARAMETER = ("torch._utils", "_rebuild_parameter")
REBUILD_PARAMETER_WITH_STATE = ("torch._utils", "_rebuild_parameter_with_state")
REBUILD_FROM_TYPE_V2 = ("torch._tensor", "_rebuild_from_type_v2")
_STORAGE_TENSOR_REBUILDERS = {REBUILD_TENSOR_V2, REBUILD_TENSOR_V3, REBUILD_TENSOR, REBUILD_QTENSOR}

# protocol-2 pickles name builtins the Python 2 way; torch's allowlist is written with the Python 3 names
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


def qualified_name(module: str, name: str) -> str:
    """``module.name`` with Python 2 module names mapped to Python 3 (``__builtin__`` -> ``builtins``)."""
    return f"{_PY2_MODULES.get(module, module)}.{name}"


class GlobalMeta(type):
    """Metaclass of global placeholders. ``G.module`` / ``G.name`` are the names as written in the pickle.

    Calling a placeholder (what REDUCE does) records a :class:`ReduceNode` (or a :class:`TensorNode` for
    torch's tensor rebuild functions) instead of calling anything.
    """

    module: str
    name: str
    node_type: Any

    def __call__(cls, *args: Any) -> ReduceNode:  # type: ignore[override]
        node = cls.node_type  # chosen once per global in find_class
        if node is None:  # _rebuild_from_type_v2: a tensor when its rebuild function is a tensor rebuilder
            inner = args[0] if args else None
            tensor = isinstance(inner, GlobalMeta) and (inner.module, inner.name) in _STORAGE_TENSOR_REBUILDERS
            node = TensorNode if tensor else ReduceNode
        return node(cls, args)

    @property
    def qualified_name(cls) -> str:
        """``module.name`` with Python 2 module names mapped to Python 3 (``__builtin__`` -> ``builtins``)."""
        return qualified_name(cls.module, cls.name)

    def __repr__(cls) -> str:
        return f"<global {cls.module}.{cls.name}>"


class PickledObject:
    """A node for an object the pickle would build; records what was done to it after creation.

    ``dictitems`` (SETITEMS/SETITEM), ``listitems`` (APPENDS/APPEND), ``setitems`` (ADDITEMS) and ``state``
    (BUILD) are None until the pickle uses them; ``order`` lists those operations in the order they first
    happened, so the writer can repeat them in the same order.
    """

    # the operations live in the instance __dict__, created only when a pickle uses them: most nodes (the
    # 50,000 tensors of a big state_dict) never need one, which keeps reading fast
    __slots__ = ("__dict__", "__weakref__")
    dictitems: list[tuple[Any, Any]] | None = None
    listitems: list[Any] | None = None
    setitems: list[Any] | None = None
    state: Any = None
    order: list[str] | tuple[()] = ()

    def _note(self, op: str) -> None:
        if op not in self.order:
            self.order = [*self.order, op]

    # --- the methods the C unpickler calls for BUILD / SETITEMS / APPENDS / ADDITEMS on non-builtin objects ---
    def __setstate__(self, state: Any) -> None:
        self._note("build")
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.dictitems is None:
            self.dictitems = []
        self._note("setitems")
        self.dictitems.append((key, value))

    def append(self, value: Any) -> None:
        if self.listitems is None:
            self.listitems = []
        self._note("appends")
        self.listitems.append(value)

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)

    def add(self, value: Any) -> None:
        if self.setitems is None:
            self.setitems = []
        self._note("additems")
        self.setitems.append(value)

    # nodes are compared and hashed by identity (they may be dict keys in the graph)
    __hash__ = object.__hash__


class ReduceNode(PickledObject):
    """``func(*args)`` as REDUCE would call it. ``func`` is usually a :class:`GlobalMeta` placeholder."""

    __slots__ = ("func", "args")

    def __init__(self, func: Any, args: tuple) -> None:
        self.func = func
        self.args = args

    def __call__(self, *args: Any) -> ReduceNode:  # REDUCE with a node as the callable
        return ReduceNode(self, args)

    @property
    def global_name(self) -> str | None:
        """``module.name`` of the callable when it is a global, else None."""
        return self.func.qualified_name if isinstance(self.func, GlobalMeta) else None

    def __repr__(self) -> str:
        return f"<reduce {self.global_name or self.func!r}>"


class TensorNode(ReduceNode):
    """A tensor as torch pickles it: ``_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
    backward_hooks[, metadata])``, ``_rebuild_tensor_v3(..., dtype)`` (dtypes without a legacy storage class),
    ``_rebuild_qtensor`` or ``_rebuild_from_type_v2(rebuild_fn, type, args, state)`` (tensor subclasses)."""

    __slots__ = ()

    @property
    def rebuild_args(self) -> tuple:
        """The arguments of the storage-backed rebuild function (unwrapping ``_rebuild_from_type_v2``)."""
        if (self.func.module, self.func.name) == REBUILD_FROM_TYPE_V2:
            inner = self.args[2] if len(self.args) > 2 else ()
            return inner if isinstance(inner, tuple) else ()
        return self.args

    @property
    def rebuild_name(self) -> tuple[str, str]:
        if (self.func.module, self.func.name) == REBUILD_FROM_TYPE_V2:
            return (self.args[0].module, self.args[0].name)
        return (self.func.module, self.func.name)

    @property
    def storage(self) -> StorageRef | None:
        a = self.rebuild_args
        return a[0] if a and isinstance(a[0], StorageRef) else None

    @property
    def storage_offset(self) -> int:
        a = self.rebuild_args
        return a[1] if len(a) > 1 and isinstance(a[1], int) else 0

    @property
    def shape(self) -> tuple[int, ...]:
        a = self.rebuild_args
        return _int_tuple(a[2]) if len(a) > 2 else ()

    @property
    def stride(self) -> tuple[int, ...]:
        a = self.rebuild_args
        return _int_tuple(a[3]) if len(a) > 3 else ()

    @property
    def requires_grad(self) -> bool:
        a = self.args
        if self.func.name == "_rebuild_tensor_v2" and len(a) > 4 and type(a[4]) is bool:  # the common case
            return a[4]
        a = self.rebuild_args
        idx = 5 if self.rebuild_name == REBUILD_QTENSOR else 4
        return bool(a[idx]) if len(a) > idx and isinstance(a[idx], bool) else False

    @property
    def dtype_global(self) -> GlobalMeta | None:
        """The dtype GLOBAL of ``_rebuild_tensor_v3`` (``torch.float8_e4m3fn``), else None."""
        if self.rebuild_name == REBUILD_TENSOR_V3:
            a = self.rebuild_args
            if len(a) > 6 and isinstance(a[6], GlobalMeta):
                return a[6]
        return None

    def __repr__(self) -> str:
        return f"<tensor {self.shape} {self.storage!r}>"


class ParameterNode(ReduceNode):
    """``torch._utils._rebuild_parameter(data, requires_grad, backward_hooks)``; ``tensor`` is the data node."""

    __slots__ = ()

    @property
    def tensor(self) -> Any:
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<parameter {self.tensor!r}>"


class ObjectNode(PickledObject):
    """An instance made by NEWOBJ / NEWOBJ_EX / OBJ / INST: ``cls.__new__(cls, *args, **kwargs)`` then the
    recorded operations (for an ``nn.Module``, BUILD with its ``__dict__``). ``type(node)`` is the class
    placeholder, so ``node.cls`` gives ``module`` and ``name``."""

    __slots__ = ("args", "kwargs")

    def __new__(cls, *args: Any, **kwargs: Any) -> ObjectNode:
        self = object.__new__(cls)
        self.args = args
        self.kwargs = kwargs
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # tp_new already did the work
        pass

    @property
    def cls(self) -> GlobalMeta:
        return type(self)  # type: ignore[return-value]

    @property
    def global_name(self) -> str:
        return type(self).qualified_name  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<object {type(self).module}.{type(self).name}>"  # type: ignore[attr-defined]


class StorageRef:
    """A storage persistent id: ``(typename, storage_type, key, location, numel, *extra)``.

    ``storage_type`` is the GLOBAL placeholder (``torch.FloatStorage``, ``torch.storage.UntypedStorage``...),
    ``key`` names the record (``data/<key>`` in the zip format), ``location`` is the location tag string
    (``'cpu'``, ``'cuda:1'``), ``numel`` the element count of the typed storage (bytes for UntypedStorage).
    ``extra`` keeps anything after ``numel`` (legacy files add ``view_metadata``, normally None).
    """

    __slots__ = ("typename", "storage_type", "key", "location", "numel", "extra", "__weakref__")

    def __init__(self, typename: str, storage_type: Any, key: str, location: str, numel: int, extra: tuple) -> None:
        self.typename = typename
        self.storage_type = storage_type
        self.key = key
        self.location = location
        self.numel = numel
        self.extra = extra

    def pid(self) -> tuple:
        return (self.typename, self.storage_type, self.key, self.location, self.numel, *self.extra)

    @property
    def storage_type_name(self) -> str:
        st = self.storage_type
        return st.name if isinstance(st, GlobalMeta) else str(st)

    def __repr__(self) -> str:
        return f"<storage {self.key} {self.storage_type_name} {self.location} {self.numel}>"


class PersistentRef:
    """A persistent id that is not a storage (legacy ``('module', type, source_file, source)``), kept as-is."""

    __slots__ = ("pid",)

    def __init__(self, pid: Any) -> None:
        self.pid = pid

    def __repr__(self) -> str:
        return f"<persistent {self.pid!r}>"


def _int_tuple(v: Any) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)) and all(isinstance(x, int) for x in v):
        return tuple(v)
    if isinstance(v, ReduceNode) and v.args and isinstance(v.args[0], (tuple, list)):  # torch.Size((..))
        return _int_tuple(v.args[0])
    return ()


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` and ``persistent_load`` never import or execute anything.

    After :meth:`load`, ``globals_seen`` lists every global the pickle names (first use order) as
    ``(module, name)``, and ``storages`` maps each storage key to its :class:`StorageRef` (first use order).
    ``storages`` may be shared between several unpicklers (TorchScript's data.pkl and constants.pkl).
    """

    def __init__(self, file: Any, *, storages: dict[str, StorageRef] | None = None,
                 global_cache: dict[tuple[str, str], GlobalMeta] | None = None) -> None:
        super().__init__(file, encoding="latin1")
        self._globals: dict[tuple[str, str], GlobalMeta] = global_cache if global_cache is not None else {}
        self.globals_seen: dict[tuple[str, str], None] = {}
        self.storages: dict[str, StorageRef] = storages if storages is not None else {}

    def find_class(self, module: str, name: str) -> GlobalMeta:  # noqa: D401 - pickle API
        if not isinstance(module, str) or not isinstance(name, str):
            raise pickle.UnpicklingError("global names must be strings")
        key = (module, name)
        self.globals_seen[key] = None
        g = self._globals.get(key)
        if g is None:
            if key in _STORAGE_TENSOR_REBUILDERS:
                node_type: Any = TensorNode
            elif key in (REBUILD_PARAMETER, REBUILD_PARAMETER_WITH_STATE):
                node_type = ParameterNode
            elif key == REBUILD_FROM_TYPE_V2:
                node_type = None
            else:
                node_type = ReduceNode
            g = GlobalMeta("Global", (ObjectNode,),
                           {"__slots__": (), "module": module, "name": name, "node_type": node_type})
            self._globals[key] = g
        return g

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            typename, storage_type, key, location, numel, *extra = pid
            key = str(key)
            ref = self.storages.get(key)
            if ref is None:
                if not isinstance(location, str) or not isinstance(numel, int) or numel < 0:
                    raise pickle.UnpicklingError(f"malformed storage persistent id for key {key!r}")
                ref = StorageRef(typename, storage_type, key, location, numel, tuple(extra))
                self.storages[key] = ref
            elif ref.location != location or ref.numel != numel:
                raise pickle.UnpicklingError(f"storage {key!r} is declared twice with different location or size")
            return ref
        if isinstance(pid, tuple) and len(pid) == 4 and pid[0] == "module" and isinstance(pid[1], GlobalMeta):
            # legacy full-model files store each nn.Module class as ('module', cls, source_file, source); torch's
            # legacy loader returns cls (the source only feeds a "source code changed" warning). The zip format
            # names the class directly, so returning the placeholder makes a rewrite emit a plain GLOBAL.
            return pid[1]
        return PersistentRef(pid)


#: exceptions that a damaged or hostile pickle can raise inside the C unpickler
PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError,
                 OverflowError, UnicodeDecodeError, RecursionError, MemoryError, ImportError)


# ------------------------------------------------------------------------------------------------ resource limits
# The C unpickler trusts the lengths and indices written in the stream. Before it runs, check_pickle() walks the
# opcodes (pickletools' opcode table: the same argument layout the C unpickler reads) and refuses what would make
# it allocate or recurse out of proportion to the input:
#
# * memo bombs: PUT / LONG_BINPUT with a huge index make CPython's C unpickler grow its memo array to twice the
#   index (``_Unpickler_MemoPut``): 16 bytes per unit of index, 64 GiB for ``r\xff\xff\xff\xff``, all written
#   with NULLs. Picklers number memo entries 0, 1, 2, ... so at byte offset p an index above p cannot come from
#   a real pickler. An index is accepted when it is below p or below the pickle's size rounded down to a power of
#   two (at least 65,536; for a stream of unknown length at most 4 Mi): the memo stays under 16 bytes per byte of
#   input (1 MiB at least).
# * lengths beyond the data: a string, bytes or FRAME whose declared length runs past the end is refused before
#   anything is allocated for it.
# * FRAMEs (protocol 4+) must hold whole opcodes and follow one another, as every pickler writes them: CPython's
#   C unpickler reading a file without ``peek`` (torch.load's data.pkl) drops the rest of a frame an opcode runs
#   past, so a malformed frame would make it see other opcodes than the ones checked here.
# * deep tuple nesting: hashing a tuple recurses in C without a depth check, so a dict key or set element made of
#   a million nested tuples (one byte each: TUPLE1 repeated) overflows the C stack (a segfault). The nesting depth
#   of tuples is at most the number of tuple-building opcodes; when that bound is large, the unpickler runs in a
#   helper thread whose stack is sized for it.
#
# Scanning uses one regular expression that consumes runs of ordinary opcodes in C (strings shorter than 128 bytes
# included) and stops at anything it cannot vouch for; those opcodes are checked one by one in Python.

_NOARG = b"(012NQR}abdel]ostu)\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98"  # no argument (STOP apart)
_ARG1 = b"Khq\x80\x82"  # BININT1 BINGET BINPUT PROTO EXT1
_ARG2 = b"M\x83"  # BININT2 EXT2
_ARG4 = b"Jj\x84r"  # BININT LONG_BINGET EXT4 LONG_BINPUT
_ARG8 = b"G\x95"  # BINFLOAT FRAME (FRAME is checked in Python: frames must hold whole opcodes)
_LEN1 = b"UC\x8c\x8a"  # SHORT_BINSTRING SHORT_BINBYTES SHORT_BINUNICODE LONG1: 1-byte length
_LEN4_UNSIGNED = b"XB"  # BINUNICODE BINBYTES: 4-byte unsigned length
_LEN4_SIGNED = b"T\x8b"  # BINSTRING LONG4: 4-byte signed length
_LEN8 = b"\x8d\x8e\x96"  # BINUNICODE8 BINBYTES8 BYTEARRAY8: 8-byte length
_LINE1 = b"ILFSVPgp"  # INT LONG FLOAT STRING UNICODE PERSID GET PUT: argument up to a newline
_LINE2 = b"ci"  # GLOBAL INST: two lines
_STOP = 0x2E
_FRAME = 0x95
_LONG_BINPUT = 0x72
_PUT = 0x70
_TUPLE_OPS = (b"t", b"\x85", b"\x86", b"\x87")

_ARG_SIZE: dict[int, int] = {}
for _ops, _n in ((_NOARG, 0), (_ARG1, 1), (_ARG2, 2), (_ARG4, 4), (_ARG8, 8)):
    for _op in _ops:
        _ARG_SIZE[_op] = _n

#: tuple nesting up to this bound is unpickled in the caller's thread (about 64 bytes of C stack per level)
INLINE_TUPLE_LEVELS = 2000
_STACK_PER_LEVEL = 160
_STACK_BASE = 4 << 20
#: the largest helper-thread stack ckptool asks for (virtual memory; only what deep nesting uses is touched)
MAX_UNPICKLE_STACK = 2 << 30
_stack_lock = threading.Lock()


def _cls(ops: bytes) -> bytes:
    return b"[" + b"".join(b"\\x%02x" % c for c in ops) + b"]"


def _counted(lengths: bytes) -> bytes:
    """Alternatives ``<length prefix><that many bytes>`` for lengths 0..127 (prefix = byte + ``lengths`` zeros);
    longer values are rare in checkpoints (keys, location tags) and are checked in Python."""
    return b"(?:" + b"|".join(
        b"\\x%02x" % n + b"\\x00" * len(lengths) + (b"[\\s\\S]{%d}" % n if n else b"") for n in range(128)) + b")"


_patterns: dict[int, re.Pattern[bytes]] = {}


def _run_pattern(k: int) -> re.Pattern[bytes]:
    """The opcode-run expression that accepts LONG_BINPUT indices below ``2**k`` (16 <= k <= 32)."""
    pat = _patterns.get(k)
    if pat is None:
        nb, rem = divmod(k, 8)
        put = b"r" + b"[\\s\\S]" * nb
        if nb < 4:
            put += b"[\\x00-\\x%02x]" % ((1 << rem) - 1) + b"\\x00" * (3 - nb)
        alts = [
            put,  # memo puts first: the commonest opcode of a torch pickle
            _cls(_ARG1) + b"[\\s\\S]",
            _cls(_NOARG),
            _cls(_LEN4_UNSIGNED + _LEN4_SIGNED) + _counted(b"\x00\x00\x00"),
            _cls(b"M\x83") + b"[\\s\\S]{2}",
            _cls(b"Jj\x84") + b"[\\s\\S]{4}",
            b"G[\\s\\S]{8}",
            _cls(_LEN1) + _counted(b""),
            _cls(b"ILFSVPg") + b"[^\\n]*\\n",
            _cls(_LINE2) + b"[^\\n]*\\n[^\\n]*\\n",
            b"p[0-9]{1,4}\\n",  # text PUT with a small index
        ]
        pat = _patterns[k] = re.compile(b"(?:" + b"|".join(alts) + b")*+")
    return pat


def _corrupt(what: str, detail: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{what} is corrupted or truncated ({detail}); re-download or re-save the checkpoint")


def _memo_bomb(what: str, idx: int, pos: int, start: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{what} is malformed or hostile: memo index {idx} at byte {pos - start} is larger than the pickle could "
        "have numbered (it would make the unpickler allocate gigabytes); refusing to read it")


def check_pickle(buf: Any, start: int = 0, end: int | None = None, *, what: str = "pickle",
                 exact: bool = True, strict_frames: bool = True) -> int:
    """Walk the opcodes of the pickle at ``buf[start:]`` (bytes or ``mmap``) without building anything and return
    the offset just after its STOP opcode.

    ``exact=True`` says the pickle fills ``buf[start:end]`` (a zip record); ``False`` that more data may follow
    (the legacy stream). See the comment above for what is refused. With ``strict_frames`` (the default) every
    FRAME (protocol 4+) must hold whole opcodes and end where the next FRAME starts, as every pickler writes them:
    CPython's C unpickler reading from a file without ``peek`` (what ``torch.load`` does with ``data.pkl``) drops
    the bytes of a frame that an opcode runs past, so a malformed frame makes it see other opcodes than an
    in-memory read does. ``strict_frames=False`` reads the opcodes as one flat stream (frames are ignored).

    Raises:
        CorruptCheckpointError: an unknown opcode, an argument or length running past ``end``, no STOP opcode, a
            memo index no pickler could have written (a memo bomb), or (``strict_frames``) a malformed FRAME.
    """
    end = len(buf) if end is None else end
    at = [start]
    try:
        return _walk(buf, start, end, what, exact, strict_frames, at)
    except CorruptCheckpointError as e:
        e.offset = at[0]  # type: ignore[attr-defined] # where the refused opcode starts: what precedes was checked
        raise


#: opcodes in the first bytes of a pickle are checked one by one in Python: compiling the fast expression costs
#: a few milliseconds, more than walking a small pickle (the legacy stream's headers, small checkpoints)
_PY_PREFIX = 24 << 10


def _walk(buf: Any, start: int, end: int, what: str, exact: bool, strict_frames: bool, at: list[int]) -> int:
    size = end - start
    k = max(16, min(32, size.bit_length() - 1)) if exact else max(16, min(22, size.bit_length() - 1))
    fast_from = start + _PY_PREFIX
    match = None
    pos = start
    limit = end  # the end of the current frame, or ``end``
    while True:
        if pos >= fast_from:
            if match is None:
                match = _run_pattern(k).match
            pos = match(buf, pos, limit).end()
        at[0] = pos
        if pos == limit and limit != end:  # the frame is used up exactly
            limit = end
            continue
        if pos >= end:
            raise _corrupt(what, "no STOP opcode: the pickle is cut short")
        op = buf[pos]
        if op == _STOP:
            return pos + 1
        if op == _FRAME:
            if pos + 9 > end:
                raise _corrupt(what, f"FRAME at byte {pos - start} is cut short")
            if strict_frames:
                if limit != end:
                    raise _bad_frame(what, pos - start, "a FRAME starts inside the previous frame")
                frame_end = pos + 9 + int.from_bytes(buf[pos + 1:pos + 9], "little")
                if frame_end > end:
                    raise _corrupt(what, f"FRAME at byte {pos - start} runs past the end of the data")
                limit = frame_end
            pos += 9
            continue
        nxt = _check_one(buf, op, pos, start, limit, what)
        if nxt < 0:
            if limit != end and _check_one(buf, op, pos, start, end, what) >= 0:
                raise _bad_frame(what, pos - start, "an opcode runs past the end of its FRAME")
            raise _corrupt(what, f"opcode {bytes([op])!r} at byte {pos - start} runs past the end of the data")
        pos = nxt


def _bad_frame(what: str, at: int, detail: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{what} is malformed or hostile: {detail} (byte {at}); loaders would disagree on what the pickle holds")


def _check_one(buf: Any, op: int, pos: int, start: int, end: int, what: str) -> int:
    """Check one opcode the fast expression stopped at; return the offset of the next one, or -1 when the opcode
    or its argument runs past ``end``."""
    n = _ARG_SIZE.get(op)
    if n is not None:
        if pos + 1 + n > end:
            return -1
        if op == _LONG_BINPUT:
            idx = int.from_bytes(buf[pos + 1:pos + 5], "little")
            if idx > pos - start:
                raise _memo_bomb(what, idx, pos, start)
        return pos + 1 + n
    if op in _LEN1 or op in _LEN4_UNSIGNED or op in _LEN4_SIGNED or op in _LEN8:
        width = 1 if op in _LEN1 else 8 if op in _LEN8 else 4
        if pos + 1 + width > end:
            return -1
        length = int.from_bytes(buf[pos + 1:pos + 1 + width], "little", signed=op in _LEN4_SIGNED)
        if length < 0:
            raise _corrupt(what, f"negative length {length} at byte {pos - start}")
        nxt = pos + 1 + width + length
        return nxt if nxt <= end else -1
    if op in _LINE1 or op in _LINE2:
        nl = buf.find(b"\n", pos + 1, end)
        if nl < 0:
            return -1
        if op == _PUT:
            try:
                idx = int(bytes(buf[pos + 1:nl]))
            except ValueError:
                raise _corrupt(what, f"bad PUT argument at byte {pos - start}") from None
            if idx > pos - start:
                raise _memo_bomb(what, idx, pos, start)
        if op in _LINE2:
            nl = buf.find(b"\n", nl + 1, end)
            if nl < 0:
                return -1
        return nl + 1
    raise _corrupt(what, f"invalid opcode {bytes([op])!r} at byte {pos - start}")


def tuple_levels(data: bytes) -> int:
    """An upper bound on how deeply tuples can nest in pickle ``data``: its number of tuple-building opcode bytes."""
    return sum(data.count(op) for op in _TUPLE_OPS)


def call_with_stack(fn: Any, levels: int, what: str = "pickle") -> Any:
    """``fn()``, run in a helper thread with a C stack large enough for ``levels`` of recursion in C (tuple hashing)
    when ``levels`` exceeds :data:`INLINE_TUPLE_LEVELS`, else in the calling thread. Exceptions propagate.

    Raises:
        UnsupportedError: the stack it would need exceeds :data:`MAX_UNPICKLE_STACK`, or no thread can be started.
    """
    if levels <= INLINE_TUPLE_LEVELS:
        return fn()
    need = _STACK_BASE + levels * _STACK_PER_LEVEL
    if need > MAX_UNPICKLE_STACK:
        raise UnsupportedError(
            f"{what} has {levels} tuple-building opcodes: reading it safely would need a "
            f"{need >> 20} MiB stack, over ckptool's {MAX_UNPICKLE_STACK >> 20} MiB limit")
    need = (need + (1 << 20) - 1) & ~((1 << 20) - 1)
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
            out.append((False, e))

    with _stack_lock:
        old = threading.stack_size()
        try:
            threading.stack_size(need)
            t = threading.Thread(target=run, name="ckptool-unpickle", daemon=True)
            t.start()
        except (RuntimeError, ValueError, MemoryError) as e:
            raise UnsupportedError(f"{what}: cannot start a reader thread with a {need >> 20} MiB stack ({e})") from e
        finally:
            threading.stack_size(old)
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


class _FlatReader(io.BytesIO):
    """A BytesIO whose ``peek`` returns everything left: CPython's C unpickler then keeps the whole pickle in its
    input buffer and reads it as one flat stream (no per-opcode ``read`` calls, which is also faster), the view that
    :func:`check_pickle` checked."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self._data = data

    def peek(self, size: int = 0) -> memoryview:  # noqa: ARG002 - pickle asks for a prefetch size; we give all
        return memoryview(self._data)[self.tell():]  # no copy


def load_pickle_at(buf: Any, pos: int = 0, what: str = "pickle", *, exact: bool = False, strict_frames: bool = True,
                   **kw: Any) -> tuple[Any, RestrictedUnpickler, int]:
    """Check (:func:`check_pickle`) then unpickle the pickle that starts at ``buf[pos]`` into a node graph.

    ``buf`` is bytes or an ``mmap``; ``exact=True`` when the pickle ends exactly at the end of ``buf``;
    ``strict_frames=False`` reads a pickle with malformed FRAMEs as one flat stream instead of refusing it.
    Returns ``(root, unpickler, end)``, ``end`` being the offset just after the pickle's STOP opcode. Keyword
    arguments go to :class:`RestrictedUnpickler`. If parsing fails after the checks, the error's ``unpickler``
    attribute still lists (``globals_seen``) the globals named before the failure.

    Raises:
        CorruptCheckpointError: a truncated, malformed or hostile pickle (``what`` names it in the message).
        UnsupportedError: tuple nesting too deep to read safely (see :func:`call_with_stack`).
    """
    end = check_pickle(buf, pos, what=what, exact=exact, strict_frames=strict_frames)
    chunk = buf if (pos == 0 and end == len(buf) and type(buf) is bytes) else bytes(buf[pos:end])
    up = RestrictedUnpickler(_FlatReader(chunk), **kw)
    try:
        root = call_with_stack(up.load, tuple_levels(chunk), what)
    except PICKLE_ERRORS as e:
        err = CorruptCheckpointError(
            f"{what} is corrupted or truncated ({type(e).__name__}: {_short(e)}); re-download or re-save the checkpoint"
        )
        err.unpickler = up  # type: ignore[attr-defined]
        raise err from e
    return root, up, end


def partial_globals(buf: Any, start: int, stop: int) -> dict[tuple[str, str], None]:
    """The globals named by the opcodes in ``buf[start:stop]``, read as far as they go.

    For a pickle that :func:`check_pickle` refused at offset ``stop`` (``CorruptCheckpointError.offset``): the
    opcodes before it passed the checks, so they can be run through the restricted unpickler to see which globals
    a loader would have imported before failing. Never raises for bad data.
    """
    chunk = bytes(buf[start:stop])
    up = RestrictedUnpickler(_FlatReader(chunk))
    try:
        call_with_stack(up.load, tuple_levels(chunk))
    except (*PICKLE_ERRORS, CorruptCheckpointError, UnsupportedError):
        pass
    return up.globals_seen


def _short(e: BaseException) -> str:
    try:
        s = str(e)
    except Exception:  # noqa: BLE001 - a message that cannot even be rendered
        s = "?"
    return s if len(s) <= 200 else s[:200] + "..."


def load_structure(data: bytes | Any, what: str = "pickle", **kw: Any) -> tuple[Any, RestrictedUnpickler]:
    """Unpickle ``data`` (bytes, or a binary file positioned at the pickle) into a node graph.

    The pickle is checked first (:func:`check_pickle`: memo bombs, lengths past the end, unknown opcodes) and read
    with a stack sized for its tuple nesting (:func:`call_with_stack`). A file is left positioned just after the
    pickle. Returns ``(root, unpickler)``; the unpickler carries ``globals_seen`` and ``storages``.

    Raises:
        CorruptCheckpointError: the pickle is truncated, malformed or hostile (``what`` names it in the message).
        UnsupportedError: tuple nesting too deep to read safely.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        buf = data if type(data) is bytes else bytes(data)
        root, up, _end = load_pickle_at(buf, 0, what, exact=True, **kw)
        return root, up
    f = data
    start = f.tell()
    buf: Any = None
    try:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        f.seek(0)
        buf = f.read()
    try:
        root, up, end = load_pickle_at(buf, start, what, **kw)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
    f.seek(end)
    return root, up
