"""The node types the restricted unpickler (:mod:`ckptool.formats.unpickler`) builds a checkpoint's graph from.

A pickle read by ckptool is a graph of plain Python values (dict, list, tuple, str, int, float, bytes, ...) and
these records, which only remember what the pickle asked for and never run it:

* :class:`GlobalMeta` instances stand in for every global the pickle names (``module``, ``name``);
* :class:`ReduceNode` (``func(*args)``, REDUCE), with :class:`TensorNode` and :class:`ParameterNode` for torch's
  tensor and parameter rebuild functions, and :class:`ObjectNode` (``cls.__new__(cls, *args)``, NEWOBJ);
* :class:`StorageRef` for a storage persistent id, :class:`PersistentRef` for any other persistent id;
* :class:`BlobView` for a long bytes, bytearray or str value left where it is in the file (scan and inspect only).

:mod:`ckptool.formats.pickler` writes such a graph back to pickle bytes.
"""

from __future__ import annotations

import _compat_pickle
import functools
import sys
from collections.abc import Callable
from typing import Any, cast

# Names of the tensor rebuild functions torch writes (torch/_utils.py, torch/_tensor.py).
REBUILD_TENSOR_V2 = ("torch._utils", "_rebuild_tensor_v2")
REBUILD_TENSOR_V3 = ("torch._utils", "_rebuild_tensor_v3")
REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor")
REBUILD_QTENSOR = ("torch._utils", "_rebuild_qtensor")
REBUILD_PARAMETER = ("torch._utils", "_rebuild_parameter")
REBUILD_PARAMETER_WITH_STATE = ("torch._utils", "_rebuild_parameter_with_state")
REBUILD_FROM_TYPE_V2 = ("torch._tensor", "_rebuild_from_type_v2")
#: the rebuild functions whose first argument is a storage (``_rebuild_from_type_v2`` wraps one of them)
STORAGE_TENSOR_REBUILDERS = frozenset({REBUILD_TENSOR_V2, REBUILD_TENSOR_V3, REBUILD_TENSOR, REBUILD_QTENSOR})
#: ``torch.storage._load_from_bytes(b)`` runs ``torch.load(io.BytesIO(b), weights_only=False)``: ``b`` is a whole
#: torch.save stream (``pickle.dump`` of a tensor writes its storage so, in the legacy format); the argument of each
#: call is kept (:attr:`GlobalMeta.streams`) for scan to walk
LOAD_FROM_BYTES = ("torch.storage", "_load_from_bytes")

def py3_global(module: str, name: str) -> tuple[str, str]:
    """``(module, name)`` of a global as Python 3's ``pickle`` resolves a Python 2 name: through the standard
    library's own tables (``_compat_pickle.NAME_MAPPING`` for a whole name, such as ``__builtin__.long`` ->
    ``builtins.int`` or ``__builtin__.unicode`` -> ``builtins.str``, else ``IMPORT_MAPPING`` for the module, such as
    ``__builtin__`` -> ``builtins`` or ``copy_reg`` -> ``copyreg``), as ``pickle.Unpickler.find_class`` does with
    ``fix_imports`` (the default) for protocols 0-2 (``torch.save`` writes 2) and ``torch.load``'s restricted
    unpickler does for every protocol. A few table keys are Python 3 names too (``dbm.open`` -> ``dbm.ndbm.open``);
    :func:`qualified_name` leaves those as written."""
    mapped = _compat_pickle.NAME_MAPPING.get((module, name))
    if mapped is not None:
        return mapped
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


#: separates a global's name from an unsafe use of it in a use key (:func:`use_key`)
USE_MARK = " !"
#: the uses :func:`use_key` records: BUILD on the class itself; an allocation over the reader's limit (``alloc=N``)
CLASS_BUILD, ALLOC = "class-build", "alloc="


def use_key(module: str, name: str, use: str) -> tuple[str, str]:
    """The ``(module, name)`` entry a reader adds to the globals it saw for an unsafe use of global
    ``module.name`` (``collections.Counter !class-build``, ``builtins.bytearray !alloc=1500000000``): every command
    that lists and rates a pickle's globals then rates the use too (:func:`split_use`)."""
    module, name = _py2_mapped(module, name)  # __builtin__.long !class-build is builtins.int's
    return module, f"{name}{USE_MARK}{use}"


def split_use(qualified: str) -> tuple[str, str | None]:
    """``(global, use)`` of a name from :func:`qualified_name`: the use recorded by :func:`use_key`, or None."""
    base, mark, use = qualified.partition(USE_MARK)
    return (base, use) if mark else (qualified, None)


#: the top-level modules of Python 3's standard library: a name in one of them is left as written
_PY3_STDLIB = frozenset(sys.stdlib_module_names)


def qualified_name(module: str, name: str) -> str:
    """``module.name`` with Python 2 names mapped to Python 3 (:func:`py3_global`: ``__builtin__.long`` ->
    ``builtins.int``): the one place every command (scan, inspect, sanitize, load) names a global before rating it.
    A name whose module also exists in Python 3 (``dbm.open``, ``itertools.izip``) is left as written: a pickle of
    protocol 3 or more imports it so, and the tests check that it is rated no safer than its mapped form."""
    module, name = _py2_mapped(module, name)
    return f"{module}.{name}"


def _py2_mapped(module: str, name: str) -> tuple[str, str]:
    """``(module, name)`` as :func:`qualified_name` names it: mapped by :func:`py3_global` unless the module also
    exists in Python 3."""
    if (module in _compat_pickle.IMPORT_MAPPING or (module, name) in _compat_pickle.NAME_MAPPING) and (
            module.split(".", 1)[0] not in _PY3_STDLIB):
        return py3_global(module, name)
    return module, name


_new_object = object.__new__


class GlobalMeta(type):
    """Metaclass of global placeholders. ``G.module`` / ``G.name`` are the names as written in the pickle.

    Calling a placeholder (what REDUCE does) records a :class:`ReduceNode` (or a :class:`TensorNode` for
    torch's tensor rebuild functions) instead of calling anything.
    """

    module: str
    name: str
    #: the node REDUCE records (:func:`node_type_for`); None for ``_rebuild_from_type_v2``, decided per call
    node_type: type[ReduceNode] | None

    #: how a call sizes the memory it allocates (:func:`_sizing_for`): 0 (it does not), ``_FIRST_ARG``, ``_INT_ARGS``
    #: or ``_THIRD_ARG_SHAPE``; or ``_STREAM_ARG``: its argument is a stream torch.load reads (kept: :attr:`streams`)
    sizing: int
    #: (``_STREAM_ARG`` globals only: :data:`LOAD_FROM_BYTES`) the argument of each call of one argument, in call
    #: order, the same object once per call (a memo reference passes it again)
    streams: list[Any]
    #: the most elements a call of this global asked to allocate (a class attribute, set only when one did)
    requested: int = 0
    #: how many BUILDs set attributes on the class itself (class mutation; set only when one did)
    class_builds: int = 0
    #: True once the pickle called it (REDUCE) or instantiated it (NEWOBJ / NEWOBJ_EX / OBJ / INST); a global never
    #: called is held only as a value (``typing.Any`` in OmegaConf metadata): loading imports it and calls nothing
    called: bool = False
    #: True once it was passed (at any depth of tuples, lists, sets and dicts) in the arguments of a call other than
    #: torch's tensor and parameter rebuilders: the callable may call it (``copyreg._reconstructor(cls, base, state)``
    #: calls ``base.__init__``), so it does not count as held only as a value
    passed: bool = False
    #: True when the arguments of one of its calls were too many to walk (:data:`MAX_ARGS_WALKED`): which globals
    #: that call was passed is unknown
    args_unread: bool = False

    def __call__(cls, *args: Any) -> ReduceNode:
        if not cls.called:
            cls.called = True
        if cls.sizing:
            _note_request(cls, args)
        node = cls.node_type  # chosen once per global in find_class
        if node is None:  # _rebuild_from_type_v2: a tensor when its rebuild function is a tensor rebuilder
            inner = args[0] if args else None
            tensor = isinstance(inner, GlobalMeta) and (inner.module, inner.name) in STORAGE_TENSOR_REBUILDERS
            node = TensorNode if tensor else ReduceNode
            _note_passed(cls, args)
        elif args and node is ReduceNode:  # not the tensor fast path: its rebuilders call none of their arguments
            _note_passed(cls, args)
        # ReduceNode.__init__ without its Python frame (two REDUCEs per tensor: the rebuild call, its hooks dict)
        obj = _new_object(node)
        obj.func = cls
        obj.args = args
        return obj

    @property
    def qualified_name(cls) -> str:
        """``module.name`` with Python 2 names mapped to Python 3 (:func:`qualified_name`)."""
        return qualified_name(cls.module, cls.name)

    # BUILD looks ``__setstate__`` up on the object it builds; on a placeholder class itself (the pickle pushed a
    # global and BUILDs on it: ``setattr`` on the class, as ``pickle`` does with a (None, slotstate) state) this
    # data descriptor of the metaclass answers before the instance method of PickledObject, and counts it
    @property
    def __setstate__(cls) -> Callable[[Any], None]:  # noqa: PLE0302  # a property: BUILD calls what it returns
        return cls._build_on_class

    def _build_on_class(cls, state: Any) -> None:
        cls.class_builds = cls.class_builds + 1

    def reset_uses(cls) -> None:
        """Forget what a pickle did with this placeholder (the attributes above that a use sets, and the streams
        kept): it answers as a new one (:class:`ckptool.formats.unpickler.PlaceholderPool`)."""
        own = cls.__dict__
        for attr in ("requested", "class_builds", "called", "passed", "args_unread"):
            if attr in own:
                delattr(cls, attr)
        if "streams" in own:
            cls.streams.clear()

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

    def __setitem__(self, key: Any, value: Any) -> None:  # once per state_dict entry: _note inlined
        items = self.dictitems
        if items is None:
            items = self.dictitems = []
        order = self.order
        if "setitems" not in order:
            self.order = [*order, "setitems"]
        items.append((key, value))

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

    __slots__ = ("args", "func")

    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:  # GlobalMeta.__call__ inlines it
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
    def rebuild_args(self) -> tuple[Any, ...]:
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
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> ObjectNode:
        g = cast(GlobalMeta, cls)  # cls is a placeholder
        if not g.called:
            g.called = True
        if g.sizing:
            _note_request(g, args)
        if args or kwargs:
            _note_passed(g, (args, kwargs))
        self = object.__new__(cls)
        self.args = args
        self.kwargs = kwargs
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # tp_new already did the work
        pass

    @property
    def cls(self) -> GlobalMeta:
        """The class placeholder (``type(node)``; find_class makes every placeholder a subclass of ObjectNode)."""
        return cast(GlobalMeta, type(self))

    @property
    def global_name(self) -> str:
        return self.cls.qualified_name

    def __repr__(self) -> str:
        return f"<object {self.cls.module}.{self.cls.name}>"


class StorageRef:
    """A storage persistent id: ``(typename, storage_type, key, location, numel, *extra)``.

    ``storage_type`` is the GLOBAL placeholder (``torch.FloatStorage``, ``torch.storage.UntypedStorage``...),
    ``key`` names the record (``data/<key>`` in the zip format), ``location`` is the location tag string
    (``'cpu'``, ``'cuda:1'``), ``numel`` the element count of the typed storage (bytes for UntypedStorage).
    ``extra`` keeps anything after ``numel`` (legacy files add ``view_metadata``, normally None).
    """

    __slots__ = ("__weakref__", "extra", "key", "location", "numel", "storage_type", "typename")

    def __init__(self, typename: str, storage_type: Any, key: str, location: str, numel: int,
                 extra: tuple[Any, ...]) -> None:
        self.typename = typename
        self.storage_type = storage_type
        self.key = key
        self.location = location
        self.numel = numel
        self.extra = extra

    def pid(self) -> tuple[Any, ...]:
        return (self.typename, self.storage_type, self.key, self.location, self.numel, *self.extra)

    @property
    def storage_type_name(self) -> str:
        st = self.storage_type
        return st.name if isinstance(st, GlobalMeta) else str(st)

    def __repr__(self) -> str:
        return f"<storage {self.key} {self.storage_type_name} {self.location} {self.numel}>"


class BlobView:
    """A long ``bytes``, ``bytearray`` or ``str`` value of a pickle, not read: its payload is ``length`` bytes at
    byte ``offset`` of the buffer the pickle was read from (after the opcode and its length field); ``kind`` is the
    type the unpickler would have built (``"bytes"``, ``"bytearray"``, ``"str"``: UTF-8, or latin-1 for
    BINSTRING). Made by :func:`ckptool.formats.unpickler.load_pickle_at` with ``views=True`` (scan, inspect), so
    that their memory is bounded by a pickle's structure, not its blobs; a graph that holds one is never written
    back (:mod:`ckptool.formats.pickler` refuses it). ``head``: the first 16 bytes of a bytes or bytearray, the
    first 2048 characters of a str; ``chars``: a str's length in characters (-1 for bytes), for previews."""

    __slots__ = ("chars", "head", "kind", "length", "offset")

    def __init__(self, kind: str, offset: int, length: int, head: bytes | str = b"", chars: int = -1) -> None:
        self.kind = kind
        self.offset = offset
        self.length = length
        self.head = head
        self.chars = chars

    def __repr__(self) -> str:
        return f"<{self.kind} of {self.length} bytes at byte {self.offset}>"


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


def node_type_for(module: str, name: str) -> type[ReduceNode] | None:
    """The node REDUCE of global ``module.name`` records: :class:`TensorNode` for torch's storage-backed tensor
    rebuild functions, :class:`ParameterNode` for ``_rebuild_parameter[_with_state]``, None for
    ``_rebuild_from_type_v2`` (a tensor or not depending on the rebuild function it wraps), else
    :class:`ReduceNode`."""
    key = (module, name)
    if key in STORAGE_TENSOR_REBUILDERS:
        return TensorNode
    if key in (REBUILD_PARAMETER, REBUILD_PARAMETER_WITH_STATE):
        return ParameterNode
    if key == REBUILD_FROM_TYPE_V2:
        return None
    return ReduceNode


#: how a global's call sizes what it allocates: 1 its first argument (``bytearray(n)``, ``bytes(n)``, a storage class
#: ``torch.FloatStorage(n)``), 2 the product of its int arguments (a legacy tensor type ``torch.FloatTensor(a, b)``),
#: 3 the product of its third argument (``torch._utils._rebuild_qtensor(storage, offset, size, ...)`` allocates a
#: quantized tensor of ``size`` before it sets its storage)
_FIRST_ARG, _INT_ARGS, _THIRD_ARG_SHAPE, _STREAM_ARG = 1, 2, 3, 4
_BYTES_TYPES = frozenset({("builtins", "bytearray"), ("builtins", "bytes")})
_TORCH_TYPE_MODULES = frozenset({"torch", "torch.cuda", "torch.storage"})


def _sizing_for(module: str, name: str) -> int:
    """How a call of global ``module.name`` sizes the memory it allocates (a ``_FIRST_ARG``-style constant), 0 for
    a global whose call allocates nothing sized by its arguments."""
    module, name = py3_global(module, name)
    if (module, name) == LOAD_FROM_BYTES:
        return _STREAM_ARG
    if (module, name) in _BYTES_TYPES or (module in _TORCH_TYPE_MODULES and name.endswith("Storage")):
        return _FIRST_ARG
    if module in ("torch", "torch.cuda") and name.endswith("Tensor"):
        return _INT_ARGS
    if (module, name) == REBUILD_QTENSOR:
        return _THIRD_ARG_SHAPE
    return 0


def _product(values: Any) -> int:
    """The product of ``values`` when all are non-negative ints (bools excluded), else 0 (nothing is allocated
    from them, or the call fails)."""
    n = 1
    for v in values:
        if type(v) is not int or v < 0:
            return 0
        n *= v
    return n


def requested_elements(g: GlobalMeta, args: tuple[Any, ...]) -> int:
    """How many elements a call of placeholder ``g`` with ``args`` asks to allocate beyond the data the file holds
    for it (0 for a global whose call allocates nothing sized by its arguments; a quantized tensor backed by a
    storage of at least that many elements asks nothing)."""
    if g.sizing == _FIRST_ARG:
        return _product(args[:1]) if args else 0
    if g.sizing == _INT_ARGS:
        return _product(args) if args and all(type(a) is int for a in args) else 0
    if g.sizing == _THIRD_ARG_SHAPE:
        shape = args[2] if len(args) > 2 else None
        n = _product(shape) if isinstance(shape, tuple) else 0
        return 0 if args and isinstance(args[0], StorageRef) and args[0].numel >= n else n
    return 0


#: the most values :func:`_note_passed` walks in the arguments of one call; past it the call's callable is marked
#: ``args_unread`` (no global of that pickle then counts as held only as a value)
MAX_ARGS_WALKED = 4096
_CONTAINERS = (tuple, list, set, frozenset)


def _placeholders(values: Any) -> list[GlobalMeta] | None:
    """The placeholders in ``values`` (tuples, lists, sets and dicts walked; nodes are not entered: their own calls
    marked theirs), or None when it holds more than :data:`MAX_ARGS_WALKED` values."""
    found: list[GlobalMeta] = []
    stack: list[Any] = [values]
    left = MAX_ARGS_WALKED
    while stack:
        a = stack.pop()
        t = type(a)
        if t is GlobalMeta:
            found.append(a)
        elif t in _CONTAINERS:
            stack.extend(a)
        elif t is dict:
            stack.extend(a.keys())
            stack.extend(a.values())
        left -= 1
        if left < 0:
            return None
    return found


def note_persistent_id(pid: Any) -> bool:
    """Mark every placeholder in the persistent id ``pid`` (tuples, lists, sets and dicts walked) as called: a
    loader's ``persistent_load`` decides what it does with them, and torch.package's calls one
    (``('reduce_package', func, args)``: ``func(importer, *args)``, ``torch/package/package_importer.py``), so none
    of them counts as held only as a value. False when ``pid`` holds more than :data:`MAX_ARGS_WALKED` values (none
    marked: the caller refuses it)."""
    found = _placeholders(pid)
    for g in found or ():
        g.called = True
    return found is not None


def _note_passed(g: GlobalMeta, args: tuple[Any, ...]) -> None:
    """Mark every placeholder in ``args`` (the arguments of a call of ``g``) as ``passed``; ``g.args_unread`` when
    they are too many to walk (:func:`_placeholders`)."""
    found = _placeholders(args)
    if found is None:
        g.args_unread = True
        return
    for a in found:
        a.passed = True


def _note_request(g: GlobalMeta, args: tuple[Any, ...]) -> None:
    """Remember on placeholder ``g`` the most elements a call of it asks to allocate (:func:`requested_elements`),
    or (``_STREAM_ARG``) the argument of a call of one argument (torch's ``_load_from_bytes(b)``; other calls fail
    before loading anything)."""
    if g.sizing == _STREAM_ARG:
        if len(args) == 1:
            g.streams.append(args[0])
        return
    n = requested_elements(g, args)
    if n > g.requested:
        g.requested = n


def new_global(module: str, name: str) -> GlobalMeta:
    """A new placeholder for global ``module.name``: a class whose call records a node (:func:`node_type_for`)
    instead of calling anything. The restricted unpickler makes one per name it reads (cached per file)."""
    sizing = _sizing_for(module, name)
    ns: dict[str, Any] = {"__slots__": (), "module": module, "name": name, "node_type": node_type_for(module, name),
                          "sizing": sizing}
    if sizing == _STREAM_ARG:
        ns["streams"] = []
    return GlobalMeta("Global", (ObjectNode,), ns)


@functools.lru_cache(maxsize=1024)
def global_placeholder(module: str, name: str) -> GlobalMeta:
    """The placeholder writers use to build new graphs (a fresh ``collections.OrderedDict``,
    ``torch._utils._rebuild_tensor_v2``, a storage class): one per name per process, so that a written pickle names
    each global once and refers to it by memo afterwards, as ``torch.save`` does."""
    return new_global(module, name)
