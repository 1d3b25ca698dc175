"""The fast paths of the torch-zip reader give what the general paths give: the restricted unpickler's callbacks
(``persistent_load``, REDUCE, SETITEMS), the batched tensor view check, the zip directory walk, the record list and
the storage-record check; and hostile or odd inputs still take the general path and are refused the same way."""

from __future__ import annotations

import dataclasses
import io
import itertools
import pickle
import struct
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from ckptool.errors import CorruptCheckpointError
from ckptool.formats import torchfile
from ckptool.formats.nodes import (
    GlobalMeta,
    ParameterNode,
    PersistentRef,
    ReduceNode,
    StorageRef,
    TensorNode,
    global_placeholder,
)
from ckptool.formats.pickler import dumps
from ckptool.formats.strided import _first_misfit, _fits, check_tensor_views, tensor_view_problem
from ckptool.formats.torchfile import read_checkpoint
from ckptool.formats.unpickler import RestrictedUnpickler, load_structure
from ckptool.formats.zipdir import read_directory
from ckptool.ops.inspect.entry import inspect

pytestmark = pytest.mark.torchfree  # needs no torch

REBUILD = global_placeholder("torch._utils", "_rebuild_tensor_v2")
FLOAT = global_placeholder("torch", "FloatStorage")
HALF = global_placeholder("torch", "HalfStorage")
LONG = global_placeholder("torch", "LongStorage")
UNTYPED = global_placeholder("torch.storage", "UntypedStorage")


# ------------------------------------------------------------------------------------------------ persistent_load
def _reference_persistent_load(storages: dict[str, StorageRef], locations: dict[str, str], pid: Any) -> Any:
    """The general path of RestrictedUnpickler.persistent_load, as it was before the fast path."""
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
        return pid[1]
    return PersistentRef(pid)


class _Str(str):
    pass


def _fields(x: Any) -> Any:
    if isinstance(x, StorageRef):
        return ("ref", type(x.typename), x.typename, x.storage_type, type(x.key), x.key, type(x.location), x.location,
                type(x.numel), x.numel, x.extra)
    if isinstance(x, PersistentRef):
        return ("pref", x.pid)
    return x


PIDS: list[Any] = [
    ("storage", FLOAT, "0", "cuda:1", 16),            # the fast path
    ("storage", FLOAT, "1", "cuda:1", 0),             # empty storage
    ("storage", FLOAT, "0", "cuda:1", 16),            # the same storage again (general path)
    ("storage", HALF, 7, "cpu", 3),                   # an int key: str(7)
    ("storage", HALF, True, "cpu", 3),                # a bool key
    ("storage", FLOAT, "2", _Str("cpu"), 5),          # a str subclass as location
    ("storage", FLOAT, "3", "cpu", True),             # a bool element count
    ("storage", FLOAT, "4", "cpu", 4, None),          # legacy: view metadata after numel
    ("storage", FLOAT, "5", "cpu", 4, (1, 2, 3)),
    (_Str("storage"), FLOAT, "6", "cpu", 4),          # a str subclass as typename
    ("storage", [1, 2], "8", "cpu", 4),               # an odd storage type
    ("module", FLOAT, "src.py", "class A: ..."),
    ("other", 1, 2, 3, 4),
    ["storage", FLOAT, "9", "cpu", 4],
    "just a string",
]


def test_persistent_load_fast_path_equals_general_path() -> None:
    up = RestrictedUnpickler(io.BytesIO(b""))
    storages: dict[str, StorageRef] = {}
    locations: dict[str, str] = {}
    for pid in PIDS:
        got = up.persistent_load(pid)
        want = _reference_persistent_load(storages, locations, pid)
        assert _fields(got) == _fields(want), pid
    assert list(up.storages) == list(storages)
    assert [_fields(r) for r in up.storages.values()] == [_fields(r) for r in storages.values()]
    # one string object per location tag, shared by every storage that names it
    a = up.persistent_load(("storage", FLOAT, "10", "cuda:" + "1", 1))
    assert a.location is up.storages["0"].location


@pytest.mark.parametrize("pid", [
    ("storage", FLOAT, "n", "cpu", -1),               # negative element count
    ("storage", FLOAT, "n", 3, 4),                    # location not a string
    ("storage", FLOAT, "n", "cpu", 4.0),              # element count not an int
])
def test_malformed_storage_ids_are_still_refused(pid: tuple[Any, ...]) -> None:
    up = RestrictedUnpickler(io.BytesIO(b""))
    with pytest.raises(pickle.UnpicklingError, match="malformed storage persistent id"):
        up.persistent_load(pid)
    assert not up.storages


def test_storage_declared_twice_differently_is_still_refused() -> None:
    up = RestrictedUnpickler(io.BytesIO(b""))
    up.persistent_load(("storage", FLOAT, "0", "cpu", 4))
    with pytest.raises(pickle.UnpicklingError, match="declared twice"):
        up.persistent_load(("storage", FLOAT, "0", "cpu", 5))
    with pytest.raises(pickle.UnpicklingError, match="declared twice"):
        up.persistent_load(("storage", FLOAT, "0", "cuda:0", 4))


# ------------------------------------------------------------------------------------------------ REDUCE / SETITEMS
def test_reduce_records_the_same_nodes_as_their_constructors() -> None:
    param = global_placeholder("torch._utils", "_rebuild_parameter")
    from_type = global_placeholder("torch._tensor", "_rebuild_from_type_v2")
    other = global_placeholder("collections", "OrderedDict")
    ref = StorageRef("storage", FLOAT, "0", "cpu", 4, ())
    t = REBUILD(ref, 0, (4,), (1,), False, other())
    cases = [
        (t, TensorNode(REBUILD, (ref, 0, (4,), (1,), False, t.args[5]))),
        (param(t, True, other()), None),
        (from_type(REBUILD, TensorNode, (ref, 0, (4,), (1,)), {}), None),
        (from_type(other, TensorNode, (), {}), None),
        (from_type(), None),
        (other(), ReduceNode(other, ())),
        (t(1, 2), ReduceNode(t, (1, 2))),   # a node called (REDUCE with a node as the callable)
    ]
    kinds = [TensorNode, ParameterNode, TensorNode, ReduceNode, ReduceNode, ReduceNode, ReduceNode]
    for (node, ref_node), kind in zip(cases, kinds, strict=True):
        assert type(node) is kind
        assert not node.__dict__ and node.order == () and node.dictitems is None and node.state is None
        if ref_node is not None:
            assert (node.func, node.args) == (ref_node.func, ref_node.args)


def test_setitems_after_build_keeps_the_order_of_operations() -> None:
    od = global_placeholder("collections", "OrderedDict")()
    od.__setstate__({"x": 1})
    od["a"] = 1
    od["b"] = 2
    od.append(3)
    assert od.order == ["build", "setitems", "appends"]
    assert od.dictitems == [("a", 1), ("b", 2)]
    fresh = od.func()
    fresh["k"] = "v"
    fresh["k"] = "w"  # a key set twice is recorded twice, as the pickle does it
    assert fresh.order == ["setitems"] and fresh.dictitems == [("k", "v"), ("k", "w")]


def test_unpickled_state_dict_round_trips() -> None:
    refs = [StorageRef("storage", FLOAT, str(i), "cuda:1", 16, ()) for i in range(50)]
    sd = global_placeholder("collections", "OrderedDict")()
    for i, ref in enumerate(refs):
        sd[f"w{i}"] = REBUILD(ref, 0, (16,), (1,), False, global_placeholder("collections", "OrderedDict")())
    data = dumps(sd)
    root, up = load_structure(data)
    assert dumps(root) == data
    assert list(up.storages) == [str(i) for i in range(50)]
    assert all(type(v) is TensorNode for _k, v in root.dictitems)


# ------------------------------------------------------------------------------------------------ tensor view check
def _reference_misfit(t: TensorNode) -> bool:
    return not _fits(t) and tensor_view_problem(t) is not None


def _tensor(ref: Any, off: Any, shape: Any, stride: Any, func: GlobalMeta = REBUILD, more: tuple[Any, ...] = (False,)
            ) -> TensorNode:
    return TensorNode(func, (ref, off, shape, stride, *more))


def _view_cases() -> list[TensorNode]:
    refs = [StorageRef("storage", st, "k", "cpu", n, extra) for st, n, extra in
            [(FLOAT, 16, ()), (FLOAT, 0, ()), (HALF, 7, ()), (LONG, 1, ()), (UNTYPED, 64, ()), (FLOAT, 16, (None,)),
             (FLOAT, 16, ((1, 2),)), (FLOAT, 1 << 62, ())]]
    shapes = [(16,), (15,), (17,), (8,), (0,), (1,), (), (4, 4), (2, 8), (4, 5), (3, 0), (2, 2, 2), [16], (16.0,),
              (True,), (-1,), (1 << 62,), (1 << 63,)]
    strides = [(1,), (2,), (0,), (-1,), (), (4, 1), (1, 4), (8, 1), (5, 1), (0, 0), (4, 2, 1), [1], (1.0,), (True,),
               (1 << 60,)]
    offsets = [0, 1, 8, 15, 16, -1, True, 1.0, 1 << 62]
    out = [_tensor(r, o, sh, st) for r, sh, st, o in itertools.product(refs, shapes, strides, offsets)]
    v3 = global_placeholder("torch._utils", "_rebuild_tensor_v3")
    out += [_tensor(refs[0], 0, (16,), (1,), func=v3, more=(False, OrderedDict(), None, HALF)),
            _tensor(refs[0], 0, (20,), (1,), func=v3, more=(False, OrderedDict(), None, HALF)),
            _tensor(refs[0], 0, (16,), (1,), func=global_placeholder("torch._utils", "_rebuild_tensor")),
            TensorNode(REBUILD, (refs[0], 0, (16,))),
            TensorNode(REBUILD, (PersistentRef(("x",)), 0, (16,), (1,)))]
    return out


def test_batched_view_check_gives_the_verdict_of_the_general_check() -> None:
    cases = _view_cases()
    verdicts = [_reference_misfit(t) for t in cases]
    assert any(verdicts) and not all(verdicts)
    for t, bad in zip(cases, verdicts, strict=True):
        assert (_first_misfit([t]) is t) == bad, t
    # in a batch: the first misfit in order, whatever precedes it
    order = list(range(len(cases)))
    for start in range(0, len(cases), 97):
        batch = [cases[i] for i in order[start:] + order[:start]]
        want = next((t for t in batch if _reference_misfit(t)), None)
        assert _first_misfit(batch) is want
    good = [t for t, bad in zip(cases, verdicts, strict=True) if not bad]
    assert _first_misfit(good) is None


def test_view_check_names_the_first_misfit_of_nested_state_dicts() -> None:
    od = global_placeholder("collections", "OrderedDict")
    ok = StorageRef("storage", FLOAT, "0", "cpu", 16, ())
    short = StorageRef("storage", FLOAT, "1", "cpu", 4, ())
    inner = od()
    inner["fine"] = _tensor(ok, 0, (4, 4), (4, 1), more=(False, od()))
    inner["bad"] = _tensor(short, 0, (4, 2), (1, 4), more=(False, od()))  # a transposed view too big for its storage
    outer = od()
    outer["a"] = _tensor(ok, 15, (1,), (1,), more=(False, od()))
    outer["model"] = inner
    outer["b"] = _tensor(ok, 0, (16,), (1,), more=(False, od()))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'state\.model\.bad' does not fit in its storage: sizes"):
        check_tensor_views({"state": outer}, "f.pt")
    inner.dictitems[1] = ("bad", _tensor(short, 0, (2, 2), (1, 2), more=(False, od())))
    check_tensor_views({"state": outer}, "f.pt")
    shared = _tensor(ok, 1, (16,), (1,), more=(False, od()))  # one element past the end, seen under two names
    outer["b"] = shared
    with pytest.raises(CorruptCheckpointError, match=r"tensor '0\.b' does not fit"):
        check_tensor_views([outer, shared], "f.pt")


# ------------------------------------------------------------------------------------------------ zip directory
def _zip(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w") as zf:
        warnings.simplefilter("ignore")  # duplicate names: on purpose
        for name, data in members:
            zf.writestr(zipfile.ZipInfo(name), data)
    return buf.getvalue()


def _clear_utf8_flag(data: bytes) -> bytes:
    """The same zip with the UTF-8 name flag (bit 11) cleared everywhere: names then read as cp437."""
    b = bytearray(data)
    for sig, flags_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        pos = b.find(sig)
        while pos >= 0:
            (flags,) = struct.unpack_from("<H", b, pos + flags_at)
            struct.pack_into("<H", b, pos + flags_at, flags & ~0x800)
            pos = b.find(sig, pos + 4)
    return bytes(b)


@pytest.mark.parametrize("utf8_flag", [True, False])
def test_directory_names_equal_zipfiles(utf8_flag: bool) -> None:
    names = ["a/data.pkl", "a/data/0", "a/\u00e9t\u00e9", "a/\u4e2d\u6587", "a/x\x7f", "plain", "a/ends/"]
    data = _zip([(n, n.encode()) for n in names])
    if not utf8_flag:
        data = _clear_utf8_flag(data)
    got = read_directory(io.BytesIO(data), len(data), "z.zip")
    want = zipfile.ZipFile(io.BytesIO(data)).infolist()
    assert [e.name for e in got] == [i.filename for i in want]
    assert [(e.header_offset, e.compress_size, e.file_size, e.crc, e.method, e.flags) for e in got] == \
        [(i.header_offset, i.compress_size, i.file_size, i.CRC, i.compress_type, i.flag_bits) for i in want]
    assert all(type(e.name) is str for e in got)


def test_directory_name_invalid_utf8_is_still_refused() -> None:
    data = bytearray(_zip([("a/\u00e9", b"x")]))
    at = data.find(b"PK\x01\x02") + 46 + 2
    data[at:at + 2] = b"\xff\xfe"  # the UTF-8 flag is set: not UTF-8
    with pytest.raises(CorruptCheckpointError, match="not valid UTF-8"):
        read_directory(io.BytesIO(bytes(data)), len(data), "z.zip")


# ------------------------------------------------------------------------------------------------ records
def _storage_zip(tmp_path: Path, names: list[str], sizes: dict[str, int] | None = None, folder: str = "arch") -> Path:
    refs = {}
    sd = global_placeholder("collections", "OrderedDict")()
    types = [FLOAT, LONG, HALF, UNTYPED, FLOAT]
    for i, key in enumerate(names):
        st = types[i % len(types)]
        refs[key] = StorageRef("storage", st, key, "cpu", 4, ())
        sd[f"t{i}"] = REBUILD(refs[key], 0, (4,), (1,), False, global_placeholder("collections", "OrderedDict")())
    lead = f"{folder}/" if folder else ""
    members = [(f"{lead}data.pkl", dumps(sd))]
    elsize = {"FloatStorage": 4, "LongStorage": 8, "HalfStorage": 2, "UntypedStorage": 1}
    for key, ref in refs.items():
        n = (sizes or {}).get(key, 4 * elsize[ref.storage_type.name])
        if n >= 0:
            members.append((f"{lead}data/{key}", bytes(n)))
    members.append((f"{lead}version", b"3\n"))
    p = tmp_path / "ck.pt"
    p.write_bytes(_zip(members))
    return p


@pytest.mark.parametrize("folder", ["arch", ""])
def test_records_equal_the_member_by_member_walk(tmp_path: Path, folder: str) -> None:
    p = _storage_zip(tmp_path, [str(i) for i in range(12)], folder=folder)
    ck = read_checkpoint(str(p))
    from ckptool.formats import detect
    entries = detect.zip_entries(str(p))
    records: list[torchfile.Record] = []
    lead = f"{folder}/" if folder else ""
    by_name = torchfile._zip_records(str(p), entries, lead, p.stat().st_size, records)
    assert ck.records == records
    assert list(by_name) == [r.name for r in ck.records]
    assert [r.name for r in ck.records][:3] == ["data.pkl", "data/0", "data/1"]


def test_storage_records_of_mixed_types_are_checked_each(tmp_path: Path) -> None:
    keys = [str(i) for i in range(10)]
    read_checkpoint(str(_storage_zip(tmp_path, keys)))
    # storage 6 is a LongStorage of 4 elements: 32 bytes needed
    with pytest.raises(CorruptCheckpointError, match=r"storage '6' declares 4 elements \(32 bytes\) but its record "
                                                     r"holds 31 bytes"):
        read_checkpoint(str(_storage_zip(tmp_path, keys, {"6": 31})))
    with pytest.raises(CorruptCheckpointError, match="storage '3' has no record data/3"):
        read_checkpoint(str(_storage_zip(tmp_path, keys, {"3": -1, "8": 1})))
    # an untyped storage counts bytes
    read_checkpoint(str(_storage_zip(tmp_path, keys, {"3": 4})))


def test_storage_type_none_counts_one_byte_per_element(tmp_path: Path) -> None:
    refs = {"0": StorageRef("storage", None, "0", "cpu", 8, ())}
    entry = type("E", (), {"file_size": 8})()
    torchfile.check_storage_records("f.pt", refs, {"data/0": entry}, "data/")  # type: ignore[dict-item]
    entry.file_size = 7
    with pytest.raises(CorruptCheckpointError, match=r"declares 8 elements \(8 bytes\) but its record holds 7"):
        torchfile.check_storage_records("f.pt", refs, {"data/0": entry}, "data/")  # type: ignore[dict-item]


def test_duplicate_and_truncated_members_are_still_refused(tmp_path: Path) -> None:
    good = _storage_zip(tmp_path, ["0", "1"])
    data = good.read_bytes()
    members = [(i.filename, zipfile.ZipFile(io.BytesIO(data)).read(i)) for i in zipfile.ZipFile(io.BytesIO(data))
               .infolist()]
    dup = tmp_path / "dup.pt"
    dup.write_bytes(_zip([*members, ("arch/data/1", bytes(16))]))
    with pytest.raises(CorruptCheckpointError, match="two members named 'arch/data/1'"):
        read_checkpoint(str(dup))
    # a member whose declared size runs past the end of the file (its directory record patched)
    b = bytearray(data)
    at = b.find(b"PK\x01\x02")
    while at >= 0:
        (n,) = struct.unpack_from("<H", b, at + 28)
        if bytes(b[at + 46:at + 46 + n]) == b"arch/data/0":
            struct.pack_into("<II", b, at + 20, len(b), len(b))
        at = b.find(b"PK\x01\x02", at + 4)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(bytes(b))
    with pytest.raises(CorruptCheckpointError, match="record 'arch/data/0' runs past the end of the file"):
        read_checkpoint(str(cut))


# ------------------------------------------------------------------------------------------------ opcode walk
def _outcome(data: bytes) -> tuple[str, object]:
    from ckptool.formats.pickle_check import check_pickle

    try:
        return "end", check_pickle(data)
    except CorruptCheckpointError as e:
        return str(e), getattr(e, "offset", None)


def _newline_pickle() -> bytes:
    """A pickle past the length walked in Python whose arguments are full of newline bytes (BINPUT 10, BININT,
    BINFLOAT and string bytes 0x0a)."""
    rows = [("\n" * (i % 140), 0x0A0A0A0A + i, struct.unpack("<d", b"\n" * 8)[0], b"\n" * (i % 9), i)
            for i in range(3000)]
    return pickle.dumps(rows, protocol=2)


def test_opcode_walk_expression_equals_the_walk_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.formats import pickle_check

    good = _newline_pickle()
    assert len(good) > 4 * pickle_check._PY_PREFIX and good.count(b"\n") > 10_000
    bomb_at = good.rfind(b"r", len(good) // 2)
    cases = [good, good[:-1], good[:len(good) // 2], good[:bomb_at] + b"r\n\n\n\n" + good[bomb_at + 5:],
             good[:bomb_at] + b"p99999999\n" + good[bomb_at:], good[:bomb_at] + b"X\n\n\n\n" + good[bomb_at:],
             good[:bomb_at] + b"\xff" + good[bomb_at:]]
    fast = [_outcome(c) for c in cases]
    monkeypatch.setattr(pickle_check, "_FAST_FROM_START", 0)  # the expression from the first opcode
    assert [_outcome(c) for c in cases] == fast
    monkeypatch.setattr(pickle_check, "_FAST_FROM_START", 1 << 62)
    monkeypatch.setattr(pickle_check, "_PY_PREFIX", 1 << 62)  # every opcode walked in Python
    slow = [_outcome(c) for c in cases]
    assert fast == slow
    assert fast[0] == ("end", len(good))
    assert "memo index" in str(fast[3][0])
    assert all(o[0] != "end" for o in fast[1:])


# ------------------------------------------------------------------------------------------------ format detection
@pytest.mark.parametrize(("names", "kind"), [
    (["a/data.pkl", "a/data/0", "a/version"], "torch-zip"),
    (["a/data.pkl", "a/constants.pkl", "a/version"], "torchscript"),
    # torch hands a zip to torch.jit.load only when it holds constants.pkl (_is_torchscript_zip): code/ beside
    # data.pkl alone is a torch zip to torch.load, to inspect and to scan (issue 46)
    (["a/data.pkl", "a/code/__torch__/m.py"], "torch-zip"),
    (["data.pkl", "code/m.py"], "torch-zip"),
    (["a/data.pkl", "a/constants.pkl", "a/code/__torch__/m.py"], "torchscript"),
    (["a/data.pkl", "a/b/constants.pkl", "a/b/code/x"], "torch-zip"),  # only one folder deep counts
    (["a/data.pkl", "a/xconstants.pkl", "a/mycode/x", "a/constants.pkl.bak"], "torch-zip"),
    (["a/data.pkl", "a/constants.pkl\nb/x"], "torch-zip"),  # a name holding a newline: read name by name
])
def test_torchscript_detection(tmp_path: Path, names: list[str], kind: str) -> None:
    from ckptool.formats.detect import detect_format

    p = tmp_path / "z.pt"
    p.write_bytes(_zip([(n, b"x") for n in names]))
    assert detect_format(str(p)) == kind


# ------------------------------------------------------------------------------------------- records made lazily
def test_zip_records_are_made_on_first_use_and_match_the_directory(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch zip's Records are made from its directory on first use of Checkpoint.records (inspect needs none:
    25 ms for 50,000 members); record(name) before that gives an equal Record without making them; the list
    made is kept (rewriters fill in offsets), and replace(ck, _records=...) gives a copy with other records."""
    path = _storage_zip(tmp_path, [str(i) for i in range(5)])
    ck = read_checkpoint(str(path))
    assert ck._records is None
    early = {n: ck.record(n) for n in ("data.pkl", "data/3", "version", "nope")}
    assert ck._records is None and early["nope"] is None
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    recs = ck.records
    assert ck.records is recs and ck._members is None
    assert [(r.name, r.size, r.crc) for r in recs] == [(i.filename.split("/", 1)[1], i.file_size, i.CRC)
                                                        for i in infos]
    assert all(early[n] == ck.record(n) for n in early if early[n] is not None)
    with open(path, "rb") as f:
        torchfile.resolve_zip_offsets(ck, f)
    assert all(r.offset > 0 for r in ck.records)
    copy = dataclasses.replace(ck, _records=recs[:2])
    assert [r.name for r in copy.records] == [r.name for r in recs[:2]] and len(ck.records) == len(recs)
    made: list[str] = []
    real = torchfile.Record

    def counting(name: str, *args: Any) -> torchfile.Record:
        made.append(name)
        return real(name, *args)

    monkeypatch.setattr(torchfile, "Record", counting)
    info = inspect(path)
    assert len(info.tensors) == 5 and made == ["data.pkl"]  # the one record inspect looks at
