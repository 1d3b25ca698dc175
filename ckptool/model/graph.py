"""Walk a checkpoint: name its tensors by dotted path, find its state_dicts and modules, follow a dotted path.

The node graph the restricted unpickler builds (:mod:`ckptool.formats.unpickler`) is read here: plain dicts, lists
and tuples plus ``TensorNode`` / ``ReduceNode`` / ``ObjectNode`` records, mappings through :func:`mapping_items`,
pickled ``nn.Module`` objects through their ``__dict__`` (:func:`module_state`). The traversal engines
(:func:`depth_first`, :func:`breadth_first`) also serve loaded Python objects (:mod:`ckptool.model.objects`), and
:func:`ckptool.model.paths.resolve_path` follows dotted paths in both. Every walk is iterative: linear in the
number of nodes, and a too deep pickle gives :func:`too_deep`'s error, never a ``RecursionError``.

Names are what users see after ``torch.load`` (``model_state.lstm.weight``, ``optimizer.state.0.exp_avg``) and,
for a pickled ``nn.Module``, what ``model.state_dict()`` gives (torch/nn/modules/module.py ``_save_to_state_dict``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any, NamedTuple, TypeVar, cast

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.nodes import (
    GlobalMeta,
    ObjectNode,
    ParameterNode,
    PickledObject,
    ReduceNode,
    TensorNode,
    global_placeholder,
)

#: the most entries :func:`walk_module` yields (submodules shared at every level grow exponentially with depth)
MAX_MODULE_ENTRIES = 2_000_000
#: the deepest nesting of containers (or modules) a walk follows; no real checkpoint comes near it
MAX_DEPTH = 5_000

_T = TypeVar("_T")
ATOMS = (str, int, float, bytes, bool, complex, type(None))
_LEAVES = (*ATOMS, GlobalMeta)  # never entered by a walk


class TooDeepError(CorruptCheckpointError):
    """A node graph nested deeper than ckptool walks (:func:`too_deep`): every command that walks the graph refuses
    it, and ``scan`` calls the file ``error`` with the same words (the walk of its tensors meets the same limit)."""


def too_deep(e: RecursionError | None = None) -> CorruptCheckpointError:
    """The error for a graph nested deeper than ckptool walks (:data:`MAX_DEPTH`, or Python's recursion limit): a
    :class:`TooDeepError`."""
    return TooDeepError(
        "the pickle nests containers deeper than ckptool can walk (or a module contains itself); the file is "
        "malformed or hostile")


_DICT_CLASSES = {("collections", "OrderedDict"), ("builtins", "dict"), ("__builtin__", "dict")}
_SET_FUNCS = {("builtins", "set"), ("__builtin__", "set")}
#: endings of the non-tensor entries ``nn.Module.state_dict()`` writes: ``get_extra_state()`` values, and the packed
#: parameters of a dynamically quantized layer (``LinearPackedParams._save_to_state_dict``: a dtype and a
#: ``(quantized weight, bias)`` tuple)
STATE_DICT_SKIP_SUFFIX = ("_extra_state", "_packed_params.dtype", "_packed_params._packed_params")


def join(prefix: str, name: object) -> str:  # ``prefix.name``, or ``name`` alone at the top level
    return f"{prefix}.{name}" if prefix else str(name)


# ------------------------------------------------------------------------------------------------ node access
def _is_dict_reduce(obj: object) -> bool:
    return isinstance(obj, ReduceNode) and isinstance(obj.func, GlobalMeta) and (
        obj.func.module, obj.func.name) in _DICT_CLASSES


def _pairs_arg(obj: object) -> list[Any] | tuple[Any, ...] | None:
    """The ``[[key, value], ...]`` argument of ``OrderedDict([...])`` as old (Python 2 era) torch pickled it."""
    ok = isinstance(obj, ReduceNode) and _is_dict_reduce(obj) and len(obj.args) == 1
    pairs: Any = obj.args[0] if ok else None  # type: ignore[attr-defined]  # obj is a ReduceNode when ok
    ok = isinstance(pairs, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs)
    return pairs if ok else None


def mapping_items(obj: object) -> list[tuple[Any, Any]] | None:
    """The ``(key, value)`` pairs of a dict, an OrderedDict node (built by SETITEMS or from a list of pairs), or
    another dict-like node; None for anything else. The list may be the node's own: do not mutate it (use
    :func:`set_mapping_items`)."""
    t = type(obj)
    if t is dict:
        return list(obj.items())  # type: ignore[attr-defined]  # obj is a dict
    if t is not TensorNode and isinstance(obj, PickledObject):  # tensors first: the most common node by far
        pairs = _pairs_arg(obj)
        if pairs is None:
            if obj.dictitems is not None:
                return obj.dictitems  # not copied: callers only read it
            return [] if _is_dict_reduce(obj) else None
        return [(p[0], p[1]) for p in pairs] + (obj.dictitems or [])
    return None


def set_mapping_items(obj: object, items: list[tuple[Any, Any]]) -> None:
    """Replace the pairs of a mapping found by :func:`mapping_items`, in place (identity and ``_metadata`` kept).

    Raises:
        TypeError: ``obj`` is not a mapping.
    """
    if type(obj) is dict:
        obj.clear()
        obj.update(items)
        return
    if not isinstance(obj, PickledObject) or mapping_items(obj) is None:
        raise TypeError(f"not a mapping: {obj!r}")
    pairs = _pairs_arg(obj)
    if isinstance(obj, ReduceNode) and pairs is not None and obj.dictitems is None:
        obj.args = ([[k, v] for k, v in items],)  # OrderedDict([[k, v], ...]): keep that form
        return
    if isinstance(obj, ReduceNode) and pairs is not None:
        obj.args = ([],)
    obj.dictitems = list(items)
    if "setitems" not in obj.order:
        obj.order = ["setitems", *obj.order]


def ordered_dict_node(items: Iterable[tuple[Any, Any]]) -> ReduceNode:
    """A new ``collections.OrderedDict()`` node filled by SETITEMS with ``items``, as torch pickles a state_dict."""
    node = global_placeholder("collections", "OrderedDict")()
    node.dictitems = list(items)
    node.order = ["setitems"]
    return node


def class_name(obj: object) -> str:
    """The qualified name of a node's class (``torch.nn.modules.linear.Linear``) or, for a ``func(*args)`` record,
    of its callable (``torch._dynamo.eval_frame.OptimizedModule``); else the Python type's name."""
    if isinstance(obj, ObjectNode):
        return obj.global_name
    if isinstance(obj, ReduceNode) and obj.global_name:
        return obj.global_name
    return type(obj).__name__


def unwrap_tensor(obj: object) -> TensorNode | None:
    """The tensor node of a tensor or a Parameter node, else None."""
    if isinstance(obj, TensorNode):
        return obj
    if isinstance(obj, ParameterNode) and isinstance(obj.tensor, TensorNode):
        return obj.tensor
    return None


def is_tensor(obj: object) -> bool:
    """A tensor node or a Parameter node holding one."""
    if type(obj) is TensorNode:  # the common case, without a call
        return True
    return unwrap_tensor(obj) is not None


def parameter_requires_grad(node: ParameterNode) -> bool:
    """``requires_grad`` of a pickled Parameter: ``_rebuild_parameter(data, requires_grad, hooks)``'s second
    argument (``bool()`` of it, as torch passes it to ``Parameter(data, requires_grad)``); without one, the
    tensor's own flag."""
    if len(node.args) > 1:
        return bool(node.args[1])
    inner = node.tensor
    return inner.requires_grad if isinstance(inner, TensorNode) else False


def module_state(obj: object) -> dict[str, Any] | None:
    """The ``__dict__`` of a pickled ``nn.Module`` (a dict holding ``_parameters`` and ``_modules``), else None."""
    if isinstance(obj, ObjectNode) and type(obj.state) is dict and {"_parameters", "_modules"} <= obj.state.keys():
        return obj.state
    return None


OPTIMIZED_MODULE = ("torch._dynamo.eval_frame", "OptimizedModule")


def compiled_inner(obj: object) -> Any:
    """The wrapped module of ``torch.save(torch.compile(model))`` (``OptimizedModule(orig_mod, dynamo_ctx)``
    by its ``__reduce__``), else None."""
    if (type(obj) is ReduceNode and isinstance(obj.func, GlobalMeta) and obj.args
            and (obj.func.module, obj.func.name) == OPTIMIZED_MODULE):
        return obj.args[0]
    return None


def is_module(obj: object) -> bool:
    """A pickled ``nn.Module`` (its ``__dict__`` holds ``_parameters`` and ``_modules``) or a compiled one."""
    return module_state(obj) is not None or compiled_inner(obj) is not None


def non_persistent_buffers(state: Mapping[str, Any]) -> set[str]:
    """Names in a module's ``_non_persistent_buffers_set`` (pickled as ``set([...])`` or a set)."""
    v = state.get("_non_persistent_buffers_set")
    if isinstance(v, (set, frozenset)):
        return {x for x in v if isinstance(x, str)}
    if isinstance(v, ReduceNode) and isinstance(v.func, GlobalMeta) and (v.func.module, v.func.name) in _SET_FUNCS \
            and v.args and isinstance(v.args[0], (list, tuple)):
        return {x for x in v.args[0] if isinstance(x, str)}
    return set()


def module_entries(state: Mapping[str, Any]) -> Iterator[tuple[str, Any, str]]:
    """``(name, value, kind)`` of a module's parameters, persistent buffers and submodules, in state_dict order;
    kind is ``parameter``, ``buffer`` or ``module``."""
    skip = non_persistent_buffers(state)
    for kind, attr in (("parameter", "_parameters"), ("buffer", "_buffers")):
        for name, v in mapping_items(state.get(attr)) or []:
            if v is not None and not (kind == "buffer" and name in skip):
                yield str(name), v, kind
    for name, v in mapping_items(state.get("_modules")) or []:
        if v is not None:
            yield str(name), v, "module"


# ------------------------------------------------------------------------------------------------ depth-first
def depth_first(root: object, prefix: str, children: Callable[[str, Any], Iterable[tuple[str, Any]]],
                 leaf: Callable[[Any], _T | None], same: type | None = None) -> Iterator[tuple[str, _T]]:
    """``(path, leaf(obj))`` for every node reachable from ``root`` for which ``leaf`` gives a value, depth-first
    in ``children`` order. Leaves are reported each time they are reached, containers entered once. Objects of
    exactly the type ``same`` (for which ``leaf`` gives the object itself) are reported without a call to ``leaf``.

    Raises:
        CorruptCheckpointError: containers nested deeper than :data:`MAX_DEPTH`."""
    first = leaf(root)
    if first is not None:
        yield prefix, first
        return
    if isinstance(root, _LEAVES):
        return
    seen = {id(root)}
    stack = [iter(children(prefix, root))]
    while stack:
        for path, obj in stack[-1]:
            if type(obj) is same:  # the common leaf (a tensor), without a call
                yield path, obj  # type: ignore[misc]  # leaf(obj) is obj for these
                continue
            found = leaf(obj)
            if found is not None:
                yield path, found
                continue
            if isinstance(obj, _LEAVES) or id(obj) in seen:
                continue
            seen.add(id(obj))
            if len(stack) >= MAX_DEPTH:
                raise too_deep()
            stack.append(iter(children(path, obj)))
            break
        else:
            stack.pop()


def tensor_leaf(obj: object) -> TensorNode | ParameterNode | None:
    """``obj`` itself when it is a tensor node or a Parameter node holding one (exact types: the tensors
    :func:`iter_tensors` reports), else None. A leaf test for :func:`depth_first`."""
    t = type(obj)
    if t is TensorNode:  # the common case first, tested by exact type
        return obj  # type: ignore[return-value]  # obj is a TensorNode
    if t is ParameterNode and type(obj.tensor) is TensorNode:  # type: ignore[attr-defined]  # a ParameterNode
        return obj  # type: ignore[return-value]
    return None


def iter_tensors(root: object, prefix: str = "",
                 children: Callable[[str, Any], Iterable[tuple[str, Any]]] | None = None,
                 ) -> Iterator[tuple[str, TensorNode, bool]]:
    """Yield ``(dotted key, tensor node, requires_grad)`` for every tensor reachable from node graph ``root``, in
    pickle order.

    Tensors are listed each time they are reached (tied weights appear under each name), containers once.
    Non-persistent buffers and other tensors in a module's ``__dict__`` are listed under their attribute path
    (``children``: :func:`node_children` by default; :func:`state_children` lists a module's state_dict only).
    Time is linear in the number of nodes.

    Raises:
        CorruptCheckpointError: containers nested deeper than :data:`MAX_DEPTH`.
    """
    for path, x in depth_first(root, prefix, children or node_children, tensor_leaf, TensorNode):
        if type(x) is TensorNode:
            yield path, x, x.requires_grad
        else:
            p = cast(ParameterNode, x)
            yield path, p.tensor, parameter_requires_grad(p)


def node_children(path: str, obj: object) -> Iterable[tuple[str, Any]]:
    """The named children of one container or node, for :func:`iter_tensors` (their names made here, the pairs
    when iterated)."""
    inner = compiled_inner(obj)
    if inner is not None:
        return [(join(path, "_orig_mod"), inner)]
    st = module_state(obj)
    if st is not None:
        return _module_children(path, st)
    items = mapping_items(obj)
    if items is not None:
        names = [f"{path}.{k}" for k, _v in items] if path else [k if type(k) is str else str(k) for k, _v in items]
        pairs = zip(names, map(itemgetter(1), items))  # a state_dict: 50,000 pairs not made into a list
        if isinstance(obj, PickledObject) and obj.state is not None:
            return chain(pairs, ((join(path, "_state"), obj.state),))
        return pairs
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(join(path, i), v) for i, v in enumerate(obj)]
    if isinstance(obj, PickledObject):
        return _object_children(path, obj)
    return []


def _module_children(path: str, st: dict[str, Any]) -> list[tuple[str, Any]]:
    """A pickled module's children: its state_dict entries, then the other tensors it keeps as attributes
    (non-persistent buffers, caches)."""
    children = []
    named = set()
    for name, v, _kind in module_entries(st):
        children.append((join(path, name), v))
        named.add(name)
    for attr, v in st.items():
        if attr == "_buffers":
            children += [(join(path, n), b) for n, b in mapping_items(v) or [] if n not in named and b is not None]
        elif attr not in ("_parameters", "_modules") and isinstance(v, (dict, list, tuple, PickledObject)):
            children.append((join(path, attr), v))
    return children


def _object_children(path: str, obj: PickledObject) -> list[tuple[str, Any]]:
    """An object's children: its state (by key when a dict, else at its own path), its list items, the arguments
    of its call."""
    children: list[tuple[str, Any]] = []
    if type(obj.state) is dict:
        children += [(join(path, k), v) for k, v in obj.state.items()]
    elif obj.state is not None:
        children.append((path, obj.state))
    if obj.listitems:
        children += [(join(path, i), v) for i, v in enumerate(obj.listitems)]
    args = getattr(obj, "args", ())
    if isinstance(args, tuple):
        children += [(join(path, f"<arg{i}>"), v) for i, v in enumerate(args)]
    return children


# ------------------------------------------------------------------------------------------------ module trees
def state_children(path: str, obj: object) -> Iterable[tuple[str, Any]]:
    """:func:`node_children`, except that a pickled ``nn.Module`` gives only what ``module.state_dict()`` holds:
    its parameters, persistent buffers and submodules (:func:`module_entries`), not its other attributes (the
    configuration its class rebuilds: ``kernel_size``, ``stride``, caches, non-persistent buffers)."""
    st = module_state(obj)
    if st is not None:
        return [(join(path, name), v) for name, v, _kind in module_entries(st)]
    return node_children(path, obj)


class ModuleEntry(NamedTuple):
    """One step of :func:`walk_module`: ``kind`` ``"module"`` (``key``: the module path; ``value``: whatever the
    pickle holds there), or ``"parameter"`` / ``"buffer"`` (``key``: the state_dict key; ``value``: its node)."""

    key: str
    value: Any
    kind: str


def walk_module(node: object, prefix: str = "") -> Iterator[ModuleEntry]:
    """The module tree of a pickled ``nn.Module`` in ``module.state_dict()`` order: each module (pre-order, the root
    first) followed by its parameters and persistent buffers, then its submodules. A compiled model
    (``OptimizedModule``) is followed by the module it wraps, under ``_orig_mod``. Entries in a module position
    that are not modules are reported (kind ``"module"``) but not entered.

    Raises:
        CorruptCheckpointError: a module contains itself, the tree is nested deeper than :data:`MAX_DEPTH`, or it
            would give more than :data:`MAX_MODULE_ENTRIES` entries (submodules shared at every level).
    """
    budget = MAX_MODULE_ENTRIES
    stack: list[tuple[Iterator[tuple[str, Any, str]], int, str]] = []  # (entries, id of the module, its path)
    active: set[int] = set()  # the ids on the stack

    def enter(obj: object, path: str) -> bool:
        inner = compiled_inner(obj)
        st = module_state(obj) if inner is None else None
        if inner is None and st is None:
            return False
        if id(obj) in active:
            raise CorruptCheckpointError(f"module {path or '(top level)'} contains itself; the file is malformed or "
                                         "hostile")
        if len(stack) >= MAX_DEPTH:
            raise too_deep()
        entries = iter([("_orig_mod", inner, "module")]) if st is None else module_entries(st)
        stack.append((entries, id(obj), path))
        active.add(id(obj))
        return True

    yield ModuleEntry(prefix, node, "module")
    enter(node, prefix)
    while stack:
        entries, node_id, path = stack[-1]
        for name, value, kind in entries:
            budget -= 1
            if budget < 0:
                raise CorruptCheckpointError(
                    f"the pickled module tree gives more than {MAX_MODULE_ENTRIES} state_dict entries (submodules "
                    "shared at every level?); the file is malformed or hostile")
            key = join(path, name)
            yield ModuleEntry(key, value, kind)
            if kind == "module" and enter(value, key):
                break
        else:
            stack.pop()
            active.discard(node_id)


def iter_state_dict_of_module(node: object, prefix: str = "") -> Iterator[tuple[str, TensorNode, bool]]:
    """``(key, tensor, is_parameter)`` in the order ``module.state_dict()`` would give (see :func:`walk_module`);
    entries that are not tensors are left out.

    Raises:
        CorruptCheckpointError: as :func:`walk_module`.
    """
    for key, value, kind in walk_module(node, prefix):
        if kind != "module":
            t = unwrap_tensor(value)
            if t is not None:
                yield key, t, isinstance(value, ParameterNode)


# ------------------------------------------------------------------------------------------------ state_dicts
def looks_like_state_dict(items: Iterable[tuple[Any, Any]] | None, tensor_test: Callable[[Any], bool]) -> bool:
    """The state_dict rule, for any ``(key, value)`` pairs: string keys, at least one value for which
    ``tensor_test(value)`` holds, and nothing else but ``*_extra_state`` entries. Shared by the node graph
    (:func:`is_state_dict`) and by loaded objects (:func:`find_object_state_dicts`). A tensor node counts as a
    tensor without a call of ``tensor_test`` (every test of a node graph says so)."""
    if not items:
        return False
    n = 0
    for k, v in items:
        if not isinstance(k, str):
            return False
        if type(v) is TensorNode or tensor_test(v):  # a node graph's commonest value, without a call
            n += 1
        elif not k.endswith(STATE_DICT_SKIP_SUFFIX):
            return False
    return n > 0


#: torch's rebuild functions of tensors that are not one strided storage view (sparse, nested, subclasses...):
#: state_dict values all the same (:mod:`ckptool.model.nonstrided` tells them apart, and names them in refusals)
_NON_STRIDED_REBUILDERS = frozenset({
    ("torch._utils", "_rebuild_sparse_tensor"), ("torch._utils", "_rebuild_nested_tensor"),
    ("torch._utils", "_rebuild_wrapper_subclass"), ("torch._utils", "_rebuild_meta_tensor_no_storage"),
    ("torch._utils", "_rebuild_device_tensor_from_numpy"), ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"),
    ("torch._tensor", "_rebuild_from_type_v2"),
})


def is_state_dict_value(v: object) -> bool:
    """A value a state_dict holds as a tensor: a tensor node (:func:`is_tensor`), or a tensor torch rebuilds with
    another function (sparse, nested, wrapper subclasses; :data:`_NON_STRIDED_REBUILDERS`)."""
    if type(v) is TensorNode or is_tensor(v):
        return True
    return isinstance(v, ReduceNode) and isinstance(v.func, GlobalMeta) and (
        v.func.module, v.func.name) in _NON_STRIDED_REBUILDERS


def is_state_dict(obj: object) -> bool:
    """A mapping node that :func:`looks_like_state_dict` (its tensors tested with :func:`is_state_dict_value`)."""
    return looks_like_state_dict(mapping_items(obj), is_state_dict_value)


def is_optimizer_state(items: Iterable[tuple[Any, Any]]) -> bool:
    """True for ``optimizer.state_dict()`` (``state`` keyed by parameter index, ``param_groups``): its per-parameter
    dicts of tensors (``exp_avg``...) are not model state_dicts."""
    # compared one by one, not put in a set: a key may be a hostile nest of tuples that cannot be hashed safely
    state = groups = False
    for k, _v in items:
        if type(k) is str:
            state = state or k == "state"
            groups = groups or k == "param_groups"
    return state and groups


class Link(NamedTuple):
    """One step of a path through a checkpoint: ``child`` is found in ``parent`` under ``key`` (a mapping key, a
    list or tuple index, an attribute name, ``"_orig_mod"`` of a compiled model)."""

    parent: Any
    key: Any
    child: Any


@dataclass
class StateDictRef:
    """A state_dict found in a checkpoint: ``path`` (dotted, ``""`` for the top level), the container ``obj``
    (a mapping, or a module for full-model pickles), ``is_module``, and the ``trail`` of :class:`Link` from the
    root to it (empty for the root itself; the last link's parent and key say where to put a replacement)."""

    path: str
    obj: Any
    is_module: bool = False
    trail: tuple[Link, ...] = field(default=(), repr=False)

    def keys(self) -> list[str]:
        """The state_dict keys (node graph): module keys in ``state_dict()`` order, or the mapping's tensor keys
        (sparse, quantized and nested tensors included: :func:`is_state_dict_value`)."""
        if self.is_module:
            return [k for k, _t, _p in iter_state_dict_of_module(self.obj)]
        return [k if type(k) is str else str(k) for k, v in mapping_items(self.obj) or []
                if type(v) is TensorNode or is_state_dict_value(v)]  # the common case without a call


def breadth_first(root: object, *, items: Callable[[Any], list[tuple[Any, Any]] | None],
                  tensor_test: Callable[[Any], bool], is_module: Callable[[Any], bool],
                  max_depth: int | None) -> list[StateDictRef]:
    """The state_dict search behind :func:`find_state_dicts` and
    :func:`ckptool.model.objects.find_object_state_dicts`, breadth-first (outermost first): ``items`` gives the
    pairs of a mapping (None for anything else), ``tensor_test`` tells tensors apart, ``is_module`` modules."""
    out: list[StateDictRef] = []
    seen: set[int] = set()
    # (object, back-pointer, depth); a back-pointer is (the parent's back-pointer, parent, key), None at the root,
    # so that paths and trails are only built for what is found
    queue: deque[tuple[Any, Any, int]] = deque([(root, None, 0)])
    while queue:
        obj, up, depth = queue.popleft()
        if isinstance(obj, _LEAVES) or id(obj) in seen:
            continue
        seen.add(id(obj))
        pairs = items(obj)
        hit = pairs is not None and looks_like_state_dict(pairs, tensor_test)
        if hit or is_module(obj):
            trail: list[Link] = []
            child = obj
            while up is not None:
                up, parent, key = up
                trail.append(Link(parent, key, child))
                child = parent
            trail.reverse()
            out.append(StateDictRef(".".join(str(link.key) for link in trail), obj, not hit, tuple(trail)))
            continue
        if max_depth is not None and depth >= max_depth:
            continue
        # tensors hold no state_dict, so they are not queued: one tensor test per item of a 200,000-tensor list
        if pairs is not None:
            if not is_optimizer_state(pairs):
                queue.extend((v, (up, obj, k), depth + 1) for k, v in pairs
                             if (type(k) is str or type(k) is int) and not tensor_test(v))
        elif isinstance(obj, (list, tuple)):
            queue.extend((v, (up, obj, i), depth + 1) for i, v in enumerate(obj) if not tensor_test(v))
    return out


def find_state_dicts(root: object) -> list[StateDictRef]:
    """Every state_dict in node graph ``root``, outermost first (breadth-first): the top level, nested ones
    (``state_dict``, ``model_state_dict``, ``ema``, ...) and pickled modules (full models, compiled ones included).
    Does not look inside a found one, nor inside an optimizer's state_dict; enters mappings (by string and int
    keys), lists and tuples. Time is linear in the number of nodes."""
    return breadth_first(root, items=mapping_items, tensor_test=is_state_dict_value, is_module=is_module,
                         max_depth=None)
