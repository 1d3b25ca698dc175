"""``load_into`` and ``verify`` on torch.package archives, read without running the package's code
(:func:`ckptool.torch_ops.load._load_package` through :func:`ckptool.torch_ops.source_load.load_source`), and the
readers layer's storage-bytes function (:func:`ckptool.readers.data.read_storage`) it reads with.

Every loaded tensor is held to what ``torch.package.PackageImporter(path).load_pickle(...)`` gives (which runs the
package's code: these packages are our own), bit for bit, with the same storage sharing."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.package import PackageExporter, PackageImporter

from ckptool import errors
from ckptool.formats.tensors import Piece, Segment, Storage
from ckptool.readers import open_checkpoint
from ckptool.readers.data import FileRanges, read_range, read_storage
from ckptool.torch_ops.load import load_checkpoint, load_into
from ckptool.torch_ops.source_load import load_source

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fuzz"))
import adversarial
import adversarial_pkgread

#: the model of the packages: tied weights, a view buffer, three dtypes, a BatchNorm (``_metadata`` version 2)
_MODULE = "tests_pkgload_net"
_MODULE_SOURCE = """import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(4, 3, bias=False)
        self.head.weight = self.enc.weight
        self.norm = torch.nn.BatchNorm1d(3)
        self.register_buffer("steps", torch.arange(5))
        self.register_buffer("rows", self.enc.weight.data[1:, ::2])
        self.register_buffer("h16", torch.randn(6).half())
        self.register_buffer("cache", torch.zeros(2), persistent=False)
"""

_REDUCE_MODULE = "tests_pkgload_reduce"
_REDUCE_SOURCE = """def rebuild(importer, data):
    return Holder(data)


class Holder:
    def __init__(self, data):
        self.data = data

    def __reduce_package__(self, exporter):
        return (rebuild, (self.data,))
"""


def _trained(mod: Any, seed: int) -> nn.Module:
    """A ``Net`` with seeded values in every entry (running statistics too)."""
    torch.manual_seed(seed)
    net: nn.Module = mod.Net()
    with torch.no_grad():
        for t in net.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    return net


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _shares(sd: dict[str, torch.Tensor]) -> set[tuple[str, str]]:
    """The pairs of entries of ``sd`` on one storage."""
    return {(a, b) for a in sd for b in sd if a < b
            and sd[a].untyped_storage().data_ptr() == sd[b].untyped_storage().data_ptr()}


def _same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names in the same order, same dtype, shape, stride, offset and bits, same storage sharing."""
    assert list(got) == list(want)
    for k, t in want.items():
        g = got[k]
        assert (g.dtype, g.shape, g.stride(), g.storage_offset()) == (t.dtype, t.shape, t.stride(),
                                                                      t.storage_offset()), k
        assert _bits(g) == _bits(t), k
    assert _shares(got) == _shares(want) and _shares(want)


def _model_holds(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    current = model.state_dict()
    for k, t in want.items():
        assert current[k].dtype == t.dtype and _bits(current[k]) == _bits(t), k


def _sd_package(path: Path, net: nn.Module) -> Path:
    with PackageExporter(str(path)) as exp:
        exp.save_pickle("model", "state_dict.pkl", net.state_dict())
        exp.save_pickle("model", "config.pkl", {"lr": 0.1})
    return path


# ------------------------------------------------------------------------------------------------ load_into
def test_load_into_a_state_dict_package_gives_package_importer_tensors(tmp_path: Path, shipped: Any) -> None:
    mod = shipped(_MODULE, _MODULE_SOURCE)
    pkg = _sd_package(tmp_path / "pkg.pt", _trained(mod, 1))
    want = PackageImporter(str(pkg)).load_pickle("model", "state_dict.pkl")
    model = _trained(mod, 2)
    rep = load_into(model, pkg)
    _model_holds(model, want)
    assert model.head.weight is model.enc.weight
    assert rep.key == "model/state_dict.pkl:" and rep.saved_devices == {"cpu": len(want)} and not rep.missing
    (loaded,) = load_checkpoint(pkg)[0].values()
    _same_tensors(loaded, want)
    assert loaded._metadata == want._metadata and loaded._metadata["norm"] == {"version": 2}


def test_load_into_a_module_package_gives_its_state_dict(tmp_path: Path, shipped: Any) -> None:
    mod = shipped(_MODULE, _MODULE_SOURCE)
    pkg = tmp_path / "net.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.intern(f"{_MODULE}.**")
        exp.save_pickle("nets", "net.pkl", _trained(mod, 3))
    want = PackageImporter(str(pkg)).load_pickle("nets", "net.pkl").state_dict()
    model = _trained(mod, 4)
    rep = load_into(model, pkg)
    _model_holds(model, want)
    assert rep.key == "nets/net.pkl:" and not rep.missing and not rep.unexpected
    (loaded,) = load_checkpoint(pkg)[0].values()
    _same_tensors(loaded, want)


def test_load_into_takes_a_package_key(tmp_path: Path) -> None:
    pkg = tmp_path / "train.pt"
    lin = nn.Linear(2, 2)
    ema = {k: v + 1 for k, v in lin.state_dict().items()}
    with PackageExporter(str(pkg)) as exp:
        exp.save_pickle("m", "ckpt.pkl", {"state_dict": lin.state_dict(), "ema": ema})
        exp.save_pickle("other", "sd.pkl", {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)})
    with pytest.raises(errors.UsageError, match=r"several state_dicts.*--key MEMBER:PATH"):
        load_into(nn.Linear(2, 2), pkg)
    for key, want in (("m/ckpt.pkl:ema", ema), ("m/ckpt.pkl", lin.state_dict())):
        model = nn.Linear(2, 2)
        rep = load_into(model, pkg, key=key)
        assert rep.key == key
        _model_holds(model, want)
    with pytest.raises(errors.UsageError, match="no entry 'nope'"):
        load_into(nn.Linear(2, 2), pkg, key="m/ckpt.pkl:nope")


def test_load_source_moves_each_storage_and_keeps_views(tmp_path: Path) -> None:
    """One tensor per storage on the device asked for (``meta`` here: every CPU build has it), views kept."""
    w = torch.arange(12.0).reshape(3, 4)
    pkg = tmp_path / "p.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.save_pickle("m", "sd.pkl", {"w": w, "col": w[:, 1]})
    got = load_source(open_checkpoint(pkg).state_dict(), "meta")
    assert got["w"].device.type == "meta" and got["col"].stride() == (4,) and got["col"].storage_offset() == 1
    assert _shares(got) == {("col", "w")}


# ------------------------------------------------------------------------------------------------ verify
def test_verify_passes_on_a_package_and_fails_on_a_wrong_model(tmp_path: Path, run_cli: Any) -> None:
    models = tmp_path / "pkg_models.py"
    models.write_text("import torch\n\ndef good():\n    return torch.nn.Linear(4, 3)\n\n"
                      "def wrong():\n    return torch.nn.Linear(4, 2)\n", encoding="utf-8")
    torch.manual_seed(0)
    pkg = tmp_path / "p.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.save_pickle("model", "state_dict.pkl", nn.Linear(4, 3).state_dict())
    res = run_cli("verify", pkg, "--model", f"{models}:good", "--device", "cpu")
    assert res.exit_code == 0 and "2/2 entries bit-identical" in res.output, res.output
    assert "`model/state_dict.pkl:`" in res.output
    res = run_cli("verify", pkg, "--model", f"{models}:good", "--device", "cpu", "--key", "model/state_dict.pkl")
    assert res.exit_code == 0, res.output
    res = run_cli("verify", pkg, "--model", f"{models}:wrong", "--device", "cpu")
    assert res.exit_code == 1 and "FAILED" in res.output and "shape mismatches" in res.output, res.output


def test_verify_holds_package_bytes_to_the_zip_crc(tmp_path: Path, run_cli: Any) -> None:
    """A flipped byte in a storage record: the values the model gets are the reader's, so only the record's
    CRC-32 (the writer's evidence) can tell; verify fails and load_into refuses."""
    models = tmp_path / "crc_models.py"
    models.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(4, 3)\n", encoding="utf-8")
    pkg = tmp_path / "p.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.save_pickle("model", "state_dict.pkl", nn.Linear(4, 3).state_dict())
    st = open_checkpoint(pkg).state_dict().tensors[0].storage
    assert st.crc is not None
    data = bytearray(pkg.read_bytes())
    data[st.offset + 3] ^= 0x40
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    res = run_cli("verify", bad, "--model", f"{models}:build", "--device", "cpu", catch_exceptions=True)
    assert res.exit_code not in (0, 3) and "CRC-32" in res.output and "Traceback" not in res.output, res.output
    with pytest.raises(errors.CorruptCheckpointError, match="CRC-32"):
        load_into(nn.Linear(4, 3), bad)


# ------------------------------------------------------------------------------------------------ code never runs
def test_a_payload_package_is_never_run(tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker payload as the package's pickle (refused: no state_dict), and beside a state_dict (the
    state_dict loads; the payload pickle is never read by torch), ``trust`` or not; PackageImporter runs it."""
    marker = tmp_path / "marker"
    monkeypatch.setenv(adversarial.MARKER_ENV, str(marker))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    alone = adversarial_pkgread.make_payload_member(tmp_path / "a")
    beside = adversarial_pkgread.make_payload_beside_state_dict(tmp_path / "b")
    models = tmp_path / "payload_models.py"
    models.write_text("import torch\n\nclass W(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                      "        self.w = torch.nn.Parameter(torch.ones(3))\n\ndef build():\n    return W()\n",
                      encoding="utf-8")
    with pytest.raises(errors.UnsupportedError, match="no state_dict found in the package's pickles"):
        load_into(nn.Linear(2, 2), alone)
    w = nn.Module()
    w.w = nn.Parameter(torch.ones(3))
    load_into(w, beside)
    assert torch.equal(w.w.detach(), torch.zeros(3))  # the record's 12 zero bytes
    for path in (alone, beside):  # trust covers classes, never gadgets: scan rates both files dangerous
        with pytest.raises(errors.UnsafeCheckpointError, match=r"os\.system .*DANGEROUS"):
            load_into(nn.Linear(2, 2), path, trust=True)
    res = run_cli("verify", alone, "--model", f"{models}:build", "--device", "cpu", catch_exceptions=True)
    assert res.exit_code not in (0, 3) and res.output.count("Error:") == 1, res.output
    res = run_cli("verify", beside, "--model", f"{models}:build", "--device", "cpu", "--trust",
                  catch_exceptions=True)
    assert res.exit_code == 1 and res.output.count("Error:") == 1 and "os.system" in res.output, res.output
    assert not marker.exists()
    PackageImporter(str(alone)).load_pickle("model", "state_dict.pkl")
    assert marker.exists()  # the fixture is live


def test_a_reduce_package_object_is_refused(tmp_path: Path, shipped: Any) -> None:
    mod = shipped(_REDUCE_MODULE, _REDUCE_SOURCE)
    pkg = tmp_path / "reduce.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.intern(_REDUCE_MODULE)
        exp.save_pickle("m", "sd.pkl", {"weight": torch.zeros(2, 2), "h": mod.Holder(torch.ones(3))})
    with pytest.raises(errors.UnsupportedError, match=r"m/sd\.pkl:h is an object the package's own code "
                                                      r"rebuilds.*made by tests_pkgload_reduce\.rebuild"):
        load_into(nn.Linear(2, 2), pkg)
    with pytest.raises(errors.UnsafeCheckpointError, match=r"tests_pkgload_reduce\.rebuild .*DANGEROUS"):
        load_into(nn.Linear(2, 2), pkg, trust=True)  # a function on no list: trust covers classes, not gadgets


# ------------------------------------------------------------------------------------------------ read_storage
def test_read_storage_reads_plain_ranges_segments_and_pieces(tmp_path: Path) -> None:
    """Each form of a Storage's bytes (see ckptool.readers.data) against the same bytes made by torch."""
    f = tmp_path / "data.bin"
    w = torch.arange(12, dtype=torch.float32)
    f.write_bytes(b"xx" + _bits(w) + _bits(w.half()) + _bits(w[:6].reshape(2, 3).t()))
    plain = Storage(str(f), 2, 48, "float32")
    into = bytearray(48)
    assert read_storage(plain, into) is into and bytes(into) == _bits(w)
    widened = Storage(str(f), 2, 72, "float32", segments=[Segment(str(f), 2, 24), Segment(str(f), 50, 48, "float16")])
    assert bytes(read_storage(widened)) == _bits(w[:6]) + _bits(w)
    swapped = Storage(str(f), 2, 48, "float32", segments=[Segment(str(f), 2, 48, swap=4)])
    assert bytes(read_storage(swapped)) == b"".join(struct.pack(">f", v) for v in w.tolist())
    with FileRanges() as files:
        assert bytes(read_range(widened, 20, 8, files.read)) == _bits(w)[20:24] + _bits(w)[:4]
    # a sharing group: storage of 6 float32, one piece the transposed 3x2 view, stored contiguous at offset 74
    pieces = Storage(str(f), -1, 24, "float32", pieces=[Piece(74, 24, 0, (3, 2), (1, 3))])
    assert bytes(read_storage(pieces)) == _bits(w[:6])
    overlapping = Storage(str(f), -1, 24, "float32", pieces=[Piece(2, 12, 3, (3,), (1,)), Piece(2, 8, 0, (2,), (2,))])
    assert bytes(read_storage(overlapping)) == _bits(torch.tensor([0.0, 0, 1, 0, 1, 2]))
    with pytest.raises(errors.CorruptCheckpointError, match="truncated"):
        read_storage(Storage(str(f), 100, 48, "float32"))
    with pytest.raises(ValueError, match="a buffer of 4 bytes"):
        read_storage(plain, bytearray(4))


def test_read_storage_reads_a_package_record_as_package_importer(tmp_path: Path) -> None:
    sd = {"a": torch.randn(5, 7), "b": torch.arange(9, dtype=torch.int16)}
    pkg = tmp_path / "p.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.save_pickle("m", "sd.pkl", sd)
    for t in open_checkpoint(pkg).state_dict().tensors:
        assert bytes(read_storage(t.storage)) == _bits(sd[t.name])


def test_a_package_storage_record_that_ends_early_is_corrupt(tmp_path: Path) -> None:
    pkg = tmp_path / "p.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.save_pickle("m", "sd.pkl", {"a": torch.zeros(4)})
    src = open_checkpoint(pkg).state_dict()
    src.tensors[0].storage.offset = pkg.stat().st_size - 8  # 16 bytes asked, 8 there
    with pytest.raises(errors.CorruptCheckpointError, match="truncated"):
        load_source(src)


def test_load_into_a_package_at_a_url(http: Any) -> None:
    """A package on an HTTP server is read by range (no local copy, nothing run), as a local one."""
    from remote_servers import url

    torch.manual_seed(5)
    lin = nn.Linear(3, 2)
    with PackageExporter(str(http.root / "remote_pkg.pt")) as exp:
        exp.save_pickle("model", "state_dict.pkl", lin.state_dict())
    model = nn.Linear(3, 2)
    rep = load_into(model, url(http, "remote_pkg.pt"))
    _model_holds(model, lin.state_dict())
    assert rep.key == "model/state_dict.pkl:"
