"""ckptool.model.graph / ckptool.model.objects: the one walker over node graphs and loaded objects, and dotted paths."""

from __future__ import annotations

import io
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.nodes import ObjectNode, ReduceNode, StorageRef, TensorNode
from ckptool.formats.torchfile import read_checkpoint
from ckptool.formats.unpickler import RestrictedUnpickler
from ckptool.model import graph
from ckptool.model.graph import find_state_dicts, iter_state_dict_of_module, iter_tensors, walk_module
from ckptool.model.objects import find_object_state_dicts, iter_object_tensors
from ckptool.model.paths import get_path, replace_child, resolve_path

# a small pool: drawing the same tensor twice gives a tied weight (one object under two keys)
POOL = [torch.arange(3, dtype=torch.float32), torch.ones(2, 2, dtype=torch.float16), torch.zeros(0),
        torch.arange(4, dtype=torch.int64)]
POOL.append(POOL[0][1:])  # a view sharing POOL[0]'s storage
KEYS = st.text(alphabet="abcxyz_0123", min_size=1, max_size=4)  # no dots: a dotted path names one entry


def _is_torch_tensor(v: object) -> bool:
    return isinstance(v, torch.Tensor)


def _values() -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.sampled_from(range(len(POOL))).map(lambda i: POOL[i]), st.integers(-3, 3),
                       st.text(max_size=3), st.none())
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.dictionaries(KEYS, children, max_size=4),
            st.dictionaries(KEYS, children, max_size=4).map(OrderedDict),
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
        ),
        max_leaves=25,
    )


def _reference(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, tensor) by plain recursion: the independent reference (the strategy never shares containers)."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    out: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _reference(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += _reference(v, f"{path}.{i}" if path else str(i))
    return out


def _graph_of(obj: Any, tmp_path: Path) -> Any:
    """The node graph the restricted unpickler reads from ``torch.save(obj)``."""
    path = tmp_path / "g.pt"
    torch.save(obj, path)
    return read_checkpoint(str(path)).root


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=_values())
def test_every_tensor_is_found_once_under_each_key(obj: Any, tmp_path: Path) -> None:
    want = _reference(obj)
    # loaded objects: the same (path, tensor object) list, in insertion order
    got = list(iter_object_tensors(obj, _is_torch_tensor))
    assert [p for p, _ in got] == [p for p, _ in want]
    assert all(a is b for (_p, a), (_q, b) in zip(got, want))
    # the node graph of the same object: the same paths; a shared tensor is one node under each key
    root = _graph_of(obj, tmp_path)
    nodes = list(iter_tensors(root))
    assert [p for p, _t, _rg in nodes] == [p for p, _ in want]
    ids = {id(t) for _p, t in want}
    node_of: dict[int, TensorNode] = {}
    for (_p, t), (_q, node, _rg) in zip(want, nodes):
        assert node.shape == tuple(t.shape) and node.stride == t.stride()
        assert node_of.setdefault(id(t), node) is node  # tied tensors are one node
    assert len({id(n) for n in node_of.values()}) == len(ids)
    # every path resolves back to its tensor, in both kinds
    for p, t in want:
        assert get_path(obj, p) is t
        assert get_path(root, p) is node_of[id(t)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=_values())
def test_state_dicts_found_with_their_trail(obj: Any, tmp_path: Path) -> None:
    root = _graph_of(obj, tmp_path)
    py = find_object_state_dicts(obj, _is_torch_tensor)
    nodes = find_state_dicts(root)
    assert [r.path for r in py] == [r.path for r in nodes]
    for refs, top in ((py, obj), (nodes, root)):
        for ref in refs:
            cur = top
            for link in ref.trail:  # each link is a real step from the root
                assert link.parent is cur
                cur = link.child
            assert cur is ref.obj and get_path(top, ref.path) is ref.obj


# ------------------------------------------------------------------------------------------------ linear time
def _tensor_nodes(n: int) -> list[TensorNode]:
    up = RestrictedUnpickler(io.BytesIO(b""))
    rebuild = up.find_class("torch._utils", "_rebuild_tensor_v2")
    ref = StorageRef("storage", up.find_class("torch", "FloatStorage"), "0", "cpu", 1, ())
    return [rebuild(ref, 0, (1,), (1,), False, OrderedDict()) for _ in range(n)]


def _best_time(fn: Any, repeat: int = 3) -> float:
    """The fastest of ``repeat`` runs of ``fn()``, in seconds (other work on the machine only slows runs down)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_walks_are_linear_on_a_200k_list() -> None:
    nodes = _tensor_nodes(200_000)
    got = list(iter_tensors(nodes))
    assert len(got) == 200_000 and got[-1][0] == "199999" and got[0][1] is nodes[0]
    assert find_state_dicts(nodes) == [] and find_state_dicts({"sd": {"w": nodes[0]}, "l": nodes})[0].path == "sd"
    assert _best_time(lambda: list(iter_tensors(nodes))) < 1.0
    assert _best_time(lambda: find_state_dicts(nodes)) < 1.0

    values = [object() for _ in range(200_000)]
    marked = {id(v) for v in values}
    found = list(iter_object_tensors({"w": values}, lambda v: id(v) in marked))
    assert len(found) == 200_000 and found[5] == ("w.5", values[5])
    assert find_object_state_dicts([values, values], lambda v: id(v) in marked) == []
    assert _best_time(lambda: list(iter_object_tensors(values, lambda v: id(v) in marked))) < 1.0
    assert _best_time(lambda: find_object_state_dicts(values, lambda v: id(v) in marked)) < 1.0


def test_deep_nesting_walks_without_recursion_and_stops_at_max_depth() -> None:
    deep: Any = _tensor_nodes(1)[0]
    for _ in range(3_000):  # deeper than Python's recursion limit
        deep = [deep]
    assert [p for p, _t, _rg in iter_tensors(deep)] == [".".join(["0"] * 3_000)]
    for _ in range(graph.MAX_DEPTH):
        deep = [deep]
    with pytest.raises(CorruptCheckpointError, match="deeper than ckptool can walk"):
        list(iter_tensors(deep))


# ------------------------------------------------------------------------------------------------ module trees
def _module(params: dict[str, Any], modules: dict[str, Any]) -> ObjectNode:
    cls = RestrictedUnpickler(io.BytesIO(b"")).find_class("mypkg", "Net")
    m = ObjectNode.__new__(cls)
    m.__setstate__({"_parameters": params, "_buffers": {}, "_modules": modules, "training": True})
    return m


def test_module_walk_is_iterative_and_in_state_dict_order(tmp_path: Path) -> None:
    w = _tensor_nodes(1)[0]
    m: Any = _module({"w": w}, {})
    for _ in range(2_000):
        m = _module({}, {"m": m})
    assert [k for k, _t, _p in iter_state_dict_of_module(m)] == [".".join(["m"] * 2_000 + ["w"])]

    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    root = _graph_of(model, tmp_path)
    assert [k for k, _t, _p in iter_state_dict_of_module(root)] == list(model.state_dict())
    kinds = [(e.key, e.kind) for e in walk_module(root)][:4]
    assert kinds == [("", "module"), ("0", "module"), ("0.weight", "parameter"), ("0.bias", "parameter")]


def test_a_module_that_contains_itself_is_refused() -> None:
    m = _module({}, {})
    m.state["_modules"]["me"] = m
    with pytest.raises(CorruptCheckpointError, match="module me contains itself"):
        list(walk_module(m))


# ------------------------------------------------------------------------------------------------ resolve_path
def test_resolve_path_dotted_int_and_list_keys() -> None:
    sd = {"w": torch.ones(1)}
    obj = {"model.ema": sd, "model": {"ema": "other"}, 3: ["a", ("b", sd)], -1: "neg", "1": "str-one", 1: "int-one"}
    assert get_path(obj, "model.ema") is sd  # the longest dotted run first
    assert get_path(obj, "model.ema.w") is sd["w"]
    assert get_path(obj, "3.1.1") is sd and get_path(obj, "-1") == "neg"
    assert get_path(obj, "1") == "str-one"  # a string key before an int key
    trail = resolve_path(obj, "3.1.1")
    assert [link.key for link in trail] == [3, 1, 1] and trail[0].parent is obj and trail[-1].child is sd
    assert resolve_path(obj, "") == [] and get_path(obj, "") is obj
    for missing in ("3.5", "model.x", "3.-1", "nothing"):
        with pytest.raises(KeyError):
            get_path(obj, missing)


def test_resolve_path_through_modules(tmp_path: Path) -> None:
    model = nn.Sequential(OrderedDict(fc=nn.Linear(2, 3)))
    assert get_path(model, "fc.weight") is model.fc.weight  # loaded objects: getattr
    root = _graph_of({"model": model}, tmp_path)
    node = get_path(root, "model.fc.weight")  # node graph: _modules, then _parameters
    assert node.tensor.shape == (3, 2)
    assert get_path(root, "model.training") is True  # the module's __dict__
    assert get_path(root, "model._modules.fc") is get_path(root, "model.fc")
    optimized = RestrictedUnpickler(io.BytesIO(b"")).find_class("torch._dynamo.eval_frame", "OptimizedModule")
    compiled = ReduceNode(optimized, (get_path(root, "model"),))
    assert get_path(compiled, "_orig_mod.fc.weight") is node
    with pytest.raises(KeyError):
        get_path(compiled, "fc")


def test_replace_child_in_place(tmp_path: Path) -> None:
    root = _graph_of({"a": [1, 2], "b": (3,), "od": OrderedDict(x=1)}, tmp_path)
    assert replace_child(resolve_path(root, "a.1")[-1], "new") and root["a"] == [1, "new"]
    assert replace_child(resolve_path(root, "od.x")[-1], 5) and get_path(root, "od.x") == 5
    assert not replace_child(resolve_path(root, "b.0")[-1], 4)  # a tuple cannot change
