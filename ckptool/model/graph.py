"""Walk a checkpoint's node graph: name its tensors by dotted path, find its state_dicts and modules.

Naming follows what users see after ``torch.load``: ``conv1.weight`` at top level, ``model_state.lstm.weight``
or ``optimizer_state.state.0.exp_avg`` when nested, and for a pickled ``nn.Module`` the names
``model.state_dict()`` gives (parameters, then buffers, then submodules, from ``_parameters`` / ``_buffers`` /
``_modules``; torch/nn/modules/module.py ``_save_to_state_dict``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.unpickler import GlobalMeta, ObjectNode, ParameterNode, PickledObject, ReduceNode, TensorNode

#: the most ``(key, tensor)`` entries :func:`iter_state_dict_of_module` yields: a pickle can share submodules
#: between parents at every level, and a state_dict of such a tree grows exponentially with its depth
MAX_MODULE_ENTRIES = 2_000_000


def too_deep(e: RecursionError | None = None) -> CorruptCheckpointError:
    """The error for a graph nested deeper than Python can walk (or holding a module that contains itself)."""
    return CorruptCheckpointError(
        "the pickle nests containers deeper than ckptool can walk (or a module contains itself); the file is "
        "malformed or hostile")

_DICT_CLASSES = {("collections", "OrderedDict"), ("builtins", "dict"), ("__builtin__", "dict")}
_SET_FUNCS = {("builtins", "set"), ("__builtin__", "set")}
STATE_DICT_SKIP_SUFFIX = "_extra_state"


def join(prefix: str, name: Any) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _is_dict_reduce(obj: Any) -> bool:
    return isinstance(obj, ReduceNode) and isinstance(obj.func, GlobalMeta) and (
        obj.func.module, obj.func.name) in _DICT_CLASSES


def _pairs_arg(obj: Any) -> list | None:
    """The ``[[key, value], ...]`` argument of ``OrderedDict([...])`` as old (Python 2 era) torch pickled it."""
    if _is_dict_reduce(obj) and len(obj.args) == 1 and isinstance(obj.args[0], (list, tuple)):
        pairs = obj.args[0]
        if all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            return pairs
    return None


def mapping_items(obj: Any) -> list[tuple[Any, Any]] | None:
    """The ``(key, value)`` pairs of a dict, an OrderedDict node (built by SETITEMS or from a list of pairs), or
    another dict-like node; None for anything else. The list may be the node's own: do not mutate it (use
    :func:`set_mapping_items`)."""
    if type(obj) is dict:
        return list(obj.items())
    if isinstance(obj, PickledObject):
        pairs = _pairs_arg(obj)
        if pairs is None:
            if obj.dictitems is not None:
                return obj.dictitems  # not copied: callers only read it
            return [] if _is_dict_reduce(obj) else None
        return [(p[0], p[1]) for p in pairs] + (obj.dictitems or [])
    return None


def set_mapping_items(obj: Any, items: list[tuple[Any, Any]]) -> None:
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
    if pairs is not None and obj.dictitems is None:  # OrderedDict([[k, v], ...]): keep that form
        obj.args = ([[k, v] for k, v in items],)  # type: ignore[union-attr]
        return
    if pairs is not None:
        obj.args = ([],)  # type: ignore[union-attr]
    obj.dictitems = list(items)
    if "setitems" not in obj.order:
        obj.order = ["setitems", *obj.order]


def is_dict_like(obj: Any) -> bool:
    return mapping_items(obj) is not None


def unwrap_tensor(obj: Any) -> TensorNode | None:
    """The tensor node of a tensor or a Parameter node, else None."""
    if isinstance(obj, TensorNode):
        return obj
    if isinstance(obj, ParameterNode) and isinstance(obj.tensor, TensorNode):
        return obj.tensor
    return None


def is_tensor(obj: Any) -> bool:
    if type(obj) is TensorNode:  # the common case, without a call
        return True
    return unwrap_tensor(obj) is not None


def module_state(obj: Any) -> dict | None:
    """The ``__dict__`` of a pickled ``nn.Module`` (a dict holding ``_parameters`` and ``_modules``), else None."""
    if isinstance(obj, ObjectNode) and type(obj.state) is dict and "_parameters" in obj.state and "_modules" in obj.state:
        return obj.state
    return None


OPTIMIZED_MODULE = ("torch._dynamo.eval_frame", "OptimizedModule")


def compiled_inner(obj: Any) -> Any:
    """The wrapped module of ``torch.save(torch.compile(model))`` (``OptimizedModule(orig_mod, dynamo_ctx)``
    by its ``__reduce__``), else None."""
    if (type(obj) is ReduceNode and isinstance(obj.func, GlobalMeta) and obj.args
            and (obj.func.module, obj.func.name) == OPTIMIZED_MODULE):
        return obj.args[0]
    return None


def is_module(obj: Any) -> bool:
    """A pickled ``nn.Module`` (its ``__dict__`` holds ``_parameters`` and ``_modules``) or a compiled one."""
    return module_state(obj) is not None or compiled_inner(obj) is not None


def non_persistent_buffers(state: dict) -> set[str]:
    """Names in a module's ``_non_persistent_buffers_set`` (pickled as ``set([...])`` or a set)."""
    v = state.get("_non_persistent_buffers_set")
    if isinstance(v, (set, frozenset)):
        return {x for x in v if isinstance(x, str)}
    if isinstance(v, ReduceNode) and isinstance(v.func, GlobalMeta) and (v.func.module, v.func.name) in _SET_FUNCS:
        if v.args and isinstance(v.args[0], (list, tuple)):
            return {x for x in v.args[0] if isinstance(x, str)}
    return set()


def module_entries(state: dict) -> Iterator[tuple[str, Any, str]]:
    """``(name, value, kind)`` of a module's parameters, persistent buffers and submodules, in state_dict order;
    kind is ``parameter``, ``buffer``, ``module`` or ``attribute`` (other tensors in ``__dict__``)."""
    skip = non_persistent_buffers(state)
    for kind, attr in (("parameter", "_parameters"), ("buffer", "_buffers")):
        for name, v in mapping_items(state.get(attr)) or []:
            if v is not None and not (kind == "buffer" and name in skip):
                yield str(name), v, kind
    for name, v in mapping_items(state.get("_modules")) or []:
        if v is not None:
            yield str(name), v, "module"


def iter_tensors(root: Any, prefix: str = "") -> Iterator[tuple[str, TensorNode, bool]]:
    """Yield ``(dotted key, tensor node, requires_grad)`` for every tensor reachable from ``root``, in pickle order.

    Tensors are listed each time they are reached (tied weights appear under each name), containers once.
    Non-persistent buffers and other tensors in a module's ``__dict__`` are listed under their attribute path.
    """
    seen: set[int] = set()

    def visit(path: str, obj: Any) -> Iterator[tuple[str, TensorNode, bool]]:
        t = type(obj)
        if t is TensorNode:
            yield path, obj, obj.requires_grad
            return
        if t is ParameterNode:
            inner = obj.tensor
            if type(inner) is TensorNode:
                yield path, inner, bool(obj.args[1]) if len(obj.args) > 1 else inner.requires_grad
                return
        if obj is None or t in (str, int, float, bytes, bool) or isinstance(obj, GlobalMeta) or id(obj) in seen:
            return
        seen.add(id(obj))
        for child_path, child in _children(path, obj):
            if type(child) is TensorNode:  # the common case, without a generator per tensor
                yield child_path, child, child.requires_grad
            else:
                yield from visit(child_path, child)

    try:
        yield from visit(prefix, root)
    except RecursionError as e:
        raise too_deep(e) from None


def _children(path: str, obj: Any) -> list[tuple[str, Any]]:
    """The named children of one container or node, for :func:`iter_tensors`."""
    inner = compiled_inner(obj)
    if inner is not None:
        return [(join(path, "_orig_mod"), inner)]
    st = module_state(obj)
    if st is not None:
        children = []
        named = set()
        for name, v, _kind in module_entries(st):
            children.append((join(path, name), v))
            named.add(name)
        for attr, v in st.items():  # other tensors kept as attributes (non-persistent buffers, caches)
            if attr == "_buffers":
                children += [(join(path, n), b) for n, b in mapping_items(v) or [] if n not in named and b is not None]
            elif attr not in ("_parameters", "_modules") and isinstance(v, (dict, list, tuple, PickledObject)):
                children.append((join(path, attr), v))
        return children
    items = mapping_items(obj)
    if items is not None:
        children = [(f"{path}.{k}" if path else str(k), v) for k, v in items]
        if isinstance(obj, PickledObject) and obj.state is not None:
            children.append((join(path, "_state"), obj.state))
        return children
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(join(path, i), v) for i, v in enumerate(obj)]
    children = []
    if isinstance(obj, PickledObject):
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


@dataclass
class StateDictRef:
    """A state_dict found in a checkpoint: ``path`` (dotted, ``""`` for the top level), the container ``obj``
    (a dict / OrderedDict node, or a module node for full-model pickles) and ``is_module``."""

    path: str
    obj: Any
    is_module: bool = False

    def keys(self) -> list[str]:
        if self.is_module:
            return [k for k, _t, _rg in iter_state_dict_of_module(self.obj)]
        return [str(k) for k, v in mapping_items(self.obj) or [] if is_tensor(v)]


def iter_state_dict_of_module(node: Any, prefix: str = "") -> Iterator[tuple[str, TensorNode, bool]]:
    """``(key, tensor, requires_grad)`` in the order ``module.state_dict()`` would give.

    Raises:
        CorruptCheckpointError: a module contains itself, the tree is nested deeper than Python can walk, or it
            would give more than :data:`MAX_MODULE_ENTRIES` entries (submodules shared at every level).
    """
    budget = [MAX_MODULE_ENTRIES]
    try:
        yield from _module_entries(node, prefix, set(), budget)
    except RecursionError as e:
        raise too_deep(e) from None


def _module_entries(node: Any, prefix: str, active: set[int], budget: list[int]
                    ) -> Iterator[tuple[str, TensorNode, bool]]:
    if id(node) in active:
        raise too_deep()
    inner = compiled_inner(node)
    if inner is not None:
        active.add(id(node))
        yield from _module_entries(inner, join(prefix, "_orig_mod"), active, budget)
        active.discard(id(node))
        return
    st = module_state(node)
    if st is None:
        return
    active.add(id(node))
    for name, v, kind in module_entries(st):
        budget[0] -= 1
        if budget[0] < 0:
            raise CorruptCheckpointError(
                f"the pickled module tree gives more than {MAX_MODULE_ENTRIES} state_dict entries (submodules "
                "shared at every level?); the file is malformed or hostile")
        if kind == "module":
            yield from _module_entries(v, join(prefix, name), active, budget)
        else:
            t = unwrap_tensor(v)
            if t is not None:
                yield join(prefix, name), t, isinstance(v, ParameterNode)
    active.discard(id(node))


def looks_like_state_dict(items: Any, tensor_test: Any) -> bool:
    """The state_dict rule, for any ``(key, value)`` pairs: string keys, at least one value for which
    ``tensor_test(value)`` holds, and nothing else but ``*_extra_state`` entries. Shared by the node graph
    (:func:`is_state_dict`) and by the loaded-object code (``prefixes``, ``loading``)."""
    if not items:
        return False
    n = 0
    for k, v in items:
        if not isinstance(k, str):
            return False
        if tensor_test(v):
            n += 1
        elif not k.endswith(STATE_DICT_SKIP_SUFFIX):
            return False
    return n > 0


def is_state_dict(obj: Any) -> bool:
    """A mapping with string keys, at least one tensor value, and only tensors (or ``*_extra_state`` entries)."""
    return looks_like_state_dict(mapping_items(obj), is_tensor)


def is_optimizer_state(items: list[tuple[Any, Any]]) -> bool:
    """True for ``optimizer.state_dict()`` (``state`` keyed by parameter index, ``param_groups``): its per-parameter
    dicts of tensors (``exp_avg``...) are not model state_dicts."""
    # compared one by one, not put in a set: a key may be a hostile nest of tuples that cannot be hashed safely
    state = groups = False
    for k, _v in items:
        if type(k) is str:
            state = state or k == "state"
            groups = groups or k == "param_groups"
    return state and groups


def find_state_dicts(root: Any) -> list[StateDictRef]:
    """Every state_dict in the graph, outermost first: the top level, nested ones (``state_dict``,
    ``model_state_dict``, ``ema``, ...) and pickled modules (full models). Does not look inside a found one."""
    out: list[StateDictRef] = []
    seen: set[int] = set()
    queue: deque[tuple[str, Any]] = deque([("", root)])
    while queue:
        path, obj = queue.popleft()
        if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bytes, bool)):
            continue
        seen.add(id(obj))
        if is_state_dict(obj):
            out.append(StateDictRef(path, obj))
            continue
        if is_module(obj):
            out.append(StateDictRef(path, obj, is_module=True))
            continue
        items = mapping_items(obj)
        if items is not None:
            if is_optimizer_state(items):
                continue
            queue.extend((join(path, k), v) for k, v in items if isinstance(k, (str, int)))
        elif isinstance(obj, (list, tuple)):
            queue.extend((join(path, i), v) for i, v in enumerate(obj))
    return out


def get_path(root: Any, path: str) -> Any:
    """The object at dotted ``path`` (``""`` = root) following mapping keys, list indices and module attributes.

    Raises:
        KeyError: no such path.
    """
    if path == "":
        return root
    obj = root
    for comp in path.split("."):
        items = mapping_items(obj)
        if items is not None:
            for k, v in items:
                if str(k) == comp:
                    obj = v
                    break
            else:
                raise KeyError(path)
        elif isinstance(obj, (list, tuple)) and comp.isdigit() and int(comp) < len(obj):
            obj = obj[int(comp)]
        elif module_state(obj) is not None and comp in module_state(obj):
            obj = module_state(obj)[comp]
        else:
            raise KeyError(path)
    return obj
