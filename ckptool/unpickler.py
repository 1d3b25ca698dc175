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

The graph it produces is made of plain Python values (dict, list, tuple, str, int, float, bytes, ...) and the
node types below; :mod:`ckptool.pickler` writes it back byte-for-byte equivalent for ``torch.load``.
Parsing uses CPython's C ``pickle.Unpickler`` (fast), with its callbacks overridden.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from ckptool.errors import CorruptCheckpointError

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


def load_structure(data: bytes | Any, what: str = "pickle", **kw: Any) -> tuple[Any, RestrictedUnpickler]:
    """Unpickle ``data`` (bytes or a binary file positioned at the pickle) into a node graph.

    Returns ``(root, unpickler)``; the unpickler carries ``globals_seen`` and ``storages``.

    Raises:
        CorruptCheckpointError: the pickle is truncated or malformed (``what`` names it in the message).
    """
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    up = RestrictedUnpickler(f, **kw)
    try:
        root = up.load()
    except PICKLE_ERRORS as e:
        raise CorruptCheckpointError(
            f"{what} is corrupted or truncated ({type(e).__name__}: {e}); re-download or re-save the checkpoint"
        ) from e
    return root, up
