"""``ckptool remap`` on ``torch.package`` archives (``torch.package.PackageExporter``): the location tags in the
pickles' storage ids are rewritten without running the package's code, every other member is copied byte for
byte, and what cannot be rewritten faithfully (``reduce_package`` ids) is refused. The output is checked with
torch's own ``PackageImporter`` (it runs the package's code: our own test package) and ``zipfile``."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.package.package_exporter as package_exporter
from torch.package import PackageExporter, PackageImporter

#: the module the package interns: an nn.Module and an object rebuilt by ``__reduce_package__``
MODULE = "tpkg_remap_net"
_SOURCE = """import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))


def rebuild_box(importer, value):
    return Box(value)


class Box:
    def __init__(self, value):
        self.value = value

    def __reduce_package__(self, exporter):
        return (rebuild_box, (self.value,))
"""
#: the pickles of the main fixture: (package, resource)
RESOURCES = [("weights", "state_dict.pkl"), ("model", "model.pkl"), ("weights", "raw"), ("weights.half", "h.pkl")]


@contextlib.contextmanager
def package_tags(tag: str) -> Iterator[None]:
    """Within the block ``PackageExporter`` tags every storage ``tag``. It calls the ``location_tag`` it imported
    from torch.serialization (``from torch.serialization import location_tag``), so patching
    ``torch.serialization.location_tag`` (``fixtures/tagging.py``) does not reach it: patch its own name."""
    orig = package_exporter.location_tag
    package_exporter.location_tag = lambda storage: tag
    try:
        yield
    finally:
        package_exporter.location_tag = orig


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    d = tmp_path_factory.mktemp("tpkg_remap_src")
    (d / f"{MODULE}.py").write_text(_SOURCE)
    sys.path.insert(0, str(d))
    try:
        yield __import__(MODULE)
    finally:
        sys.path.remove(str(d))
        sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def package(module: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``gpu.pt``: a state_dict (protocol 3), an nn.Module of an interned module sharing the state_dict's storages, a
    tensor pickled as the resource ``raw`` (no ``.pkl``, protocol 4), a float16 state_dict, a text and a binary
    resource; every storage tagged ``cuda:1``."""
    torch.manual_seed(0)
    net = module.Net()
    path = tmp_path_factory.mktemp("tpkg_remap") / "gpu.pt"
    with package_tags("cuda:1"), PackageExporter(str(path)) as e:
        e.intern(MODULE)
        e.extern("torch.**")
        e.save_pickle("weights", "state_dict.pkl", net.state_dict())
        e.save_pickle("model", "model.pkl", net)
        e.save_pickle("weights", "raw", torch.randn(7, 3)[::2], pickle_protocol=4)
        e.save_pickle("weights.half", "h.pkl", {"h": torch.randn(4).half()})
        e.save_text("notes", "readme.txt", "cuda:1 stays cuda:1 in text")
        e.save_binary("notes", "blob.bin", bytes(range(256)))
    return path


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a loaded pickle by path (a module: its state_dict; a dict: its values; a tensor: itself)."""
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    return {f"{prefix}{k}": v for k, v in obj.items()}


def _load_all(path: Path, **kw: Any) -> dict[str, torch.Tensor]:
    imp = PackageImporter(str(path))
    out: dict[str, torch.Tensor] = {}
    for package, resource in RESOURCES:
        out.update(_tensors(imp.load_pickle(package, resource, **kw), f"{package}/{resource}:"))
    return out


def _members(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


class _Any:
    """Whatever a pickle builds, for :func:`_pids` (accepts every call, item and state, keeps nothing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


def _pids(data: bytes) -> list[list[tuple[str, Any]]]:
    """Every persistent id of the pickle ``data`` as ``(type name, value)`` pairs (a class as its qualified name),
    read with Python's own pickle.Unpickler, every global a stand-in class (independent of ckptool's reader)."""
    found: list[list[tuple[str, Any]]] = []

    class Reader(pickle._Unpickler):  # the pure-Python unpickler: find_class may return any class
        def find_class(self, module: str, name: str) -> type:
            return type(name, (_Any,), {"qualified": f"{module}.{name}"})

        def persistent_load(self, pid: Any) -> Any:
            found.append([(type(x).__name__, getattr(x, "qualified", x)) for x in pid])
            return _Any()

    Reader(io.BytesIO(data)).load()
    return found


def test_input_is_tagged_cuda(package: Path) -> None:
    """The fixture's tags are cuda: loading it without map_location fails on a machine without CUDA."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        PackageImporter(str(package)).load_pickle("weights", "state_dict.pkl")
    with pytest.raises(RuntimeError, match="CUDA"):
        PackageImporter(str(package)).load_pickle("weights", "raw")


@pytest.mark.parametrize("args", [("--to", "cpu"), ("--map", "cuda:1=cpu"), ("--map", "cuda=cpu")])
def test_remap_to_cpu_loads_with_package_importer(package: Path, tmp_path: Path, run_cli: Any,
                                                  args: tuple[str, str]) -> None:
    out = tmp_path / "cpu.pt"
    res = run_cli("remap", package, *args, "-o", out)
    assert res.exit_code == 0, res.output
    assert "re-tagged cuda:1 -> cpu (5)" in res.output
    got = _load_all(out)  # no map_location: the tags are cpu now
    want = _load_all(package, map_location="cpu")
    assert got.keys() == want.keys() and len(got) == 8
    for key, t in got.items():
        assert t.device.type == "cpu", key
        assert t.dtype == want[key].dtype and t.shape == want[key].shape and t.stride() == want[key].stride(), key
        assert t.storage_offset() == want[key].storage_offset(), key
        assert torch.equal(t, want[key]), key
    model = PackageImporter(str(out)).load_pickle("model", "model.pkl")
    assert type(model).__name__ == "Net"
    assert model.fc.weight.requires_grad and model.steps.dtype == torch.int64


def test_other_members_are_copied_byte_for_byte(package: Path, tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "cpu.pt"
    assert run_cli("remap", package, "--to", "cpu", "-o", out).exit_code == 0
    before, after = _members(package), _members(out)
    assert [n for n, _ in before] == [n for n, _ in after]  # same names, same order
    rewritten = {"gpu/weights/state_dict.pkl", "gpu/model/model.pkl", "gpu/weights/raw", "gpu/weights/half/h.pkl"}
    for (name, a), (_, b) in zip(before, after):
        if name in rewritten:
            assert a != b and a[:2] == b[:2], name  # the pickle's protocol is kept
            assert b"cuda" not in b and b"cuda:1" in a, name
            # each persistent id as written (an int key, the same fields) but for the tag
            pids_a, pids_b = _pids(a), _pids(b)
            assert pids_a and [[*p[:3], p[4]] for p in pids_a] == [[*p[:3], p[4]] for p in pids_b], name
            assert all(p[2][0] == "int" and p[3] == ("str", "cuda:1") for p in pids_a), name
            assert all(p[3] == ("str", "cpu") for p in pids_b), name
        else:
            assert a == b, name
    with zipfile.ZipFile(out) as z:  # records 64-byte aligned, stored, as PyTorchStreamWriter writes them
        for info in z.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            assert (info.header_offset + 30 + len(info.filename.encode()) + len(_local_extra(out, info))) % 64 == 0


def _local_extra(path: Path, info: zipfile.ZipInfo) -> bytes:
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(n, 1)
        return f.read(m)


def test_map_source_matching_nothing_is_refused(package: Path, tmp_path: Path, run_cli: Any) -> None:
    res = run_cli("remap", package, "--map", "cuda:7=cpu", "-o", tmp_path / "out.pt")
    assert res.exit_code == 1
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "'cuda:7'" in errors[0] and "cuda:1" in errors[0]
    assert not any(tmp_path.iterdir())
    res = run_cli("remap", package, "--map", "cuda:7=cpu", "--allow-missing", "-o", tmp_path / "out.pt")
    assert res.exit_code == 0 and "nothing re-tagged (tags already match)" in res.output


def test_partial_map_keeps_other_tags(module: Any, tmp_path: Path, run_cli: Any) -> None:
    """--map rewrites the matching tags only; the pickles that need no change are copied as they are."""
    src = tmp_path / "mixed.pt"
    with PackageExporter(str(src)) as e:
        with package_tags("cuda:1"):
            e.save_pickle("a", "one.pkl", {"x": torch.ones(3)})
        with package_tags("cuda:2"):
            e.save_pickle("b", "two.pkl", {"y": torch.zeros(2)})
    out = tmp_path / "out.pt"
    res = run_cli("remap", src, "--map", "cuda:1=cpu", "-o", out)
    assert res.exit_code == 0 and "cuda:1 -> cpu (1)" in res.output, res.output
    imp = PackageImporter(str(out))
    assert imp.load_pickle("a", "one.pkl")["x"].device.type == "cpu"
    assert dict(_members(src))["mixed/b/two.pkl"] == dict(_members(out))["mixed/b/two.pkl"]


def test_reduce_package_is_refused(module: Any, tmp_path: Path, run_cli: Any) -> None:
    src = tmp_path / "box.pt"
    with package_tags("cuda:1"), PackageExporter(str(src)) as e:
        e.intern(MODULE)
        e.extern("torch.**")
        e.save_pickle("w", "sd.pkl", {"x": torch.ones(2)})
        e.save_pickle("obj", "box.pkl", module.Box(torch.ones(2)))
    # the fixture is live: torch's loader calls the function the id names
    box = PackageImporter(str(src)).load_pickle("obj", "box.pkl", map_location="cpu")
    assert type(box).__name__ == "Box"
    before = src.read_bytes()
    res = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "out.pt")
    assert res.exit_code == 1
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, res.output
    assert "box/obj/box.pkl" in errors[0] and "reduce_package" in errors[0]
    assert "PackageImporter(path).load_pickle(" in errors[0]
    assert not (tmp_path / "out.pt").exists() and src.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["box.pt"]  # no temporary file left


def test_prefix_flags_are_refused(package: Path, tmp_path: Path, run_cli: Any) -> None:
    res = run_cli("remap", package, "--to", "cpu", "--unwrap", "-o", tmp_path / "out.pt")
    assert res.exit_code == 1 and "is a torch.package archive" in res.output
    assert not any(tmp_path.iterdir())


def test_scan_of_the_output_says_what_scan_of_the_input_said(package: Path, tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "gpu.pt"  # the same file name: the same top folder, so the same member names
    assert run_cli("remap", package, "--to", "cpu", "-o", out).exit_code == 0
    scans = []
    for path in (package, out):
        res = run_cli("scan", "--json", path)
        d = json.loads(res.output.replace(str(path), "PATH"))
        scans.append((res.exit_code, d))
    assert scans[0] == scans[1]
    assert scans[0][1]["files"][0]["verdict"] == "dangerous"  # the package ships Python code


def test_load_hint_opens_the_output(package: Path, tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "cpu.pt"
    res = run_cli("remap", package, "--to", "cpu", "-o", out)
    line = next(x for x in res.output.splitlines() if x.startswith("Load it with: "))[len("Load it with: "):]
    assert line == f"torch.package.PackageImporter({str(out)!r}).load_pickle('weights', 'state_dict.pkl')"
    loaded = eval(line, {"torch": torch})  # our own package: its code may run
    assert all(t.device.type == "cpu" for t in loaded.values())


def test_in_place_keeps_the_mode(package: Path, tmp_path: Path, run_cli: Any) -> None:
    src = tmp_path / "gpu.pt"
    src.write_bytes(package.read_bytes())
    src.chmod(0o640)
    res = run_cli("remap", src, "--to", "cpu", "--in-place")
    assert res.exit_code == 0, res.output
    assert src.stat().st_mode & 0o777 == 0o640
    assert PackageImporter(str(src)).load_pickle("weights", "raw").device.type == "cpu"


def _pickle(*ops: bytes) -> bytes:
    """A protocol 3 pickle of ``ops`` (raw opcodes) followed by STOP."""
    return b"\x80\x03" + b"".join(ops) + b"."


def _s(text: str) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text.encode()


def _storage_pid(key: bytes) -> bytes:
    """``('storage', torch.FloatStorage, <key>, 'cuda:1', 2)`` then BINPERSID (``key``: the opcode of the key)."""
    return b"(" + _s("storage") + b"ctorch\nFloatStorage\n" + key + _s("cuda:1") + b"K\x02tQ"


#: pickles remap must refuse to rewrite, and the phrase its error names
_UNFAITHFUL = {
    # one storage named by an int key and by a str key: PackageImporter would load it twice, unshared
    "two-ids": (_pickle(b"(", _storage_pid(b"K\x00"), _storage_pid(_s("0")), b"t"), "two different persistent ids"),
    # a persistent id that is not a storage's
    "module-id": (_pickle(b"(", _s("module"), b"ctorch\nFloatStorage\n", _s("a"), _s("b"), b"tQ"), "('module', ...)"),
    # a BUILD on the class itself (class mutation), next to a storage
    "class-build": (_pickle(b"(ccollections\nOrderedDict\n}b", _storage_pid(b"K\x00"), b"t"), "class mutation"),
    # a storage id of 6 fields
    "six-fields": (_pickle(b"(", _s("storage"), b"ctorch\nFloatStorage\nK\x00", _s("cuda:1"), b"K\x02NtQ"),
                   "with 6 fields"),
}


def _replaced(src: Path, dst: Path, member: str, data: bytes, extra: tuple[str, bytes] | None = None) -> None:
    """Copy the archive ``src`` to ``dst`` with ``member``'s bytes replaced by ``data`` (and ``extra`` added)."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for info in z.infolist():
            out.writestr(info.filename, data if info.filename == member else z.read(info))
        if extra is not None:
            out.writestr(*extra)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``p.pt``: one state_dict pickle ``p/a/sd.pkl`` naming one 2-element float32 storage, tagged ``cuda:1``."""
    path = tmp_path_factory.mktemp("tpkg_small") / "p.pt"
    with package_tags("cuda:1"), PackageExporter(str(path)) as e:
        e.save_pickle("a", "sd.pkl", {"x": torch.ones(2)})
    return path


@pytest.mark.parametrize("case", sorted(_UNFAITHFUL))
def test_unfaithful_pickles_are_refused(small: Path, tmp_path: Path, run_cli: Any, case: str) -> None:
    data, phrase = _UNFAITHFUL[case]
    src = tmp_path / "p.pt"
    _replaced(small, src, "p/a/sd.pkl", data)
    res = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "out.pt")
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert res.exit_code == 1 and len(errors) == 1, res.output
    assert phrase in errors[0] and "'p/a/sd.pkl'" in errors[0] and "PackageImporter(path).load_pickle(" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.pt"]


def test_member_outside_the_top_folder_is_refused(small: Path, tmp_path: Path, run_cli: Any) -> None:
    src = tmp_path / "p.pt"
    _replaced(small, src, "", b"", extra=("elsewhere/x.txt", b"x"))
    res = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "out.pt")
    assert res.exit_code == 1 and "'elsewhere/x.txt' is outside the archive's folder 'p/'" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.pt"]


def test_a_rewritable_crafted_pickle_loads(small: Path, tmp_path: Path, run_cli: Any) -> None:
    """The control of the refusals above: the same writer and a faithful pickle give a loadable output."""
    src = tmp_path / "p.pt"
    with zipfile.ZipFile(small) as z:
        _replaced(small, src, "p/a/sd.pkl", z.read("p/a/sd.pkl"))
    res = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "out.pt")
    assert res.exit_code == 0, res.output
    assert torch.equal(PackageImporter(str(tmp_path / "out.pt")).load_pickle("a", "sd.pkl")["x"], torch.ones(2))


def test_a_resource_that_begins_like_a_pickle_but_is_none_is_refused(small: Path, tmp_path: Path,
                                                                     run_cli: Any) -> None:
    """A binary resource whose first bytes are ``PROTO 3`` but which does not read as a pickle: remap cannot tell
    whether it names storages, so it says so rather than copy it unexamined."""
    src = tmp_path / "p.pt"
    _replaced(small, src, "", b"", extra=("p/a/blob", b"\x80\x03 not a pickle"))
    res = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "out.pt")
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert res.exit_code == 1 and len(errors) == 1, res.output
    assert "'p/a/blob' begins like a pickle but ckptool cannot read it" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.pt"]
