"""The torch.package reader (:mod:`ckptool.readers.read_package`): a package's state_dict read without running its
code, its tensors byte ranges of the ``.data/<key>.storage`` records that hold exactly what
``torch.package.PackageImporter`` loads; ``convert``, ``diff`` and ``average`` reading packages through it; code the
package would run (``reduce_package`` ids, a payload pickle) refused, never run."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.package import PackageExporter, PackageImporter

from ckptool import errors
from ckptool.formats.tensors import Source
from ckptool.readers import open_checkpoint
from ckptool.readers.read_package import package_source

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fuzz"))
import adversarial

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64}

#: the module the nn.Module package interns: tied weights, a view buffer, a non-persistent buffer
_MODULE = "tests_pkgmod"
_MODULE_SOURCE = """import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(4, 3)
        self.dec = torch.nn.Linear(3, 4)
        self.head = torch.nn.Linear(4, 3, bias=False)
        self.head.weight = self.enc.weight
        self.register_buffer("steps", torch.arange(5))
        self.register_buffer("rows", self.enc.weight.data[1:])
        self.register_buffer("cache", torch.zeros(2), persistent=False)
"""

#: a module whose objects PackageImporter rebuilds by calling its function (``__reduce_package__``)
_REDUCE_MODULE = "tests_pkgreduce"
_REDUCE_SOURCE = """def rebuild(importer, data):
    return Holder(data)


class Holder:
    def __init__(self, data):
        self.data = data

    def __reduce_package__(self, exporter):
        return (rebuild, (self.data,))
"""


def _state_dict() -> dict[str, torch.Tensor]:
    """Tensors of three dtypes; ``tied`` is ``w`` itself, ``view`` a strided view of ``w``'s storage."""
    torch.manual_seed(0)
    w = torch.randn(4, 6)
    return {"w": w, "tied": w, "view": w[1:, ::2], "half": torch.randn(3).half(), "n": torch.arange(7)}


def _sd_package(path: Path, sd: dict[str, Any]) -> Path:
    with PackageExporter(str(path)) as exp:
        exp.save_pickle("model", "state_dict.pkl", sd)
        exp.save_pickle("model", "config.pkl", {"lr": 0.1, "layers": 2})
    return path


def _module_package(path: Path, shipped: Any) -> Path:
    mod = shipped(_MODULE, _MODULE_SOURCE)
    torch.manual_seed(1)
    with PackageExporter(str(path)) as exp:
        exp.intern(f"{_MODULE}.**")
        exp.save_pickle("nets", "net.pkl", mod.Net())
    return path


def _from_bytes(src: Source) -> dict[str, torch.Tensor]:
    """Each tensor of ``src`` rebuilt from the bytes at its Storage's byte range, read with ``open`` (no reader)."""
    out: dict[str, torch.Tensor] = {}
    storages: dict[int, torch.Tensor] = {}
    for t in src.tensors:
        st = t.storage
        if id(st) not in storages:
            with open(st.path, "rb") as f:
                f.seek(st.offset)
                raw = bytearray(f.read(st.nbytes))
            storages[id(st)] = torch.frombuffer(raw, dtype=_DTYPES[t.dtype]) if raw else torch.empty(0)
        out[t.name] = storages[id(st)].as_strided(t.shape, t.stride, t.offset)
    return out


def _same_as_loaded(src: Source, want: dict[str, torch.Tensor]) -> None:
    """``src``'s tensors equal ``want`` bit for bit, in state_dict order, with the same storage sharing."""
    got = _from_bytes(src)
    assert list(got) == list(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
        assert src.tensors[list(want).index(k)].stride == t.stride(), k
    by_name = {t.name: t for t in src.tensors}
    for a in want:
        for b in want:
            shared = want[a].untyped_storage().data_ptr() == want[b].untyped_storage().data_ptr()
            assert (by_name[a].storage is by_name[b].storage) == shared, (a, b)


def test_state_dict_package_reads_as_package_importer_loads(tmp_path: Path) -> None:
    pkg = _sd_package(tmp_path / "pkg.pt", _state_dict())
    src = package_source(str(pkg))
    want = PackageImporter(str(pkg)).load_pickle("model", "state_dict.pkl")
    _same_as_loaded(src, want)
    assert src.key == "model/state_dict.pkl:" and src.format == "torch-package"
    assert src.left_out == ["model/config.pkl: mapping of 2 entries"]
    assert src.tensors[0].storage.crc is not None  # the record's zip CRC-32, for convert's evidence


def test_module_package_reads_its_state_dict(tmp_path: Path, shipped: Any) -> None:
    pkg = _module_package(tmp_path / "net.pt", shipped)
    src = open_checkpoint(pkg).state_dict()
    want = PackageImporter(str(pkg)).load_pickle("nets", "net.pkl").state_dict()
    assert "cache" not in want and "head.weight" in want  # a non-persistent buffer, tied weights
    _same_as_loaded(src, want)
    assert src.key == "nets/net.pkl:"
    assert any("pickled nn.Module" in n for n in src.notes)


def test_key_selects_a_pickle_and_a_path_in_it(tmp_path: Path) -> None:
    sd = _state_dict()
    pkg = tmp_path / "two.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.save_pickle("a.b", "v1.0.sd.pkl", {"w": sd["w"].clone()})  # member a/b/v1.0.sd.pkl
        exp.save_pickle("train", "ckpt.pkl", {"epoch": 3, "state_dict": {"x": sd["n"].clone()},
                                              "ema": {"x": sd["n"] + 1}})
    with pytest.raises(errors.UsageError, match=r"several state_dicts: a/b/v1\.0\.sd\.pkl: \(1 tensors\), "
                                                r"train/ckpt\.pkl:state_dict"):
        package_source(str(pkg))
    assert [t.name for t in package_source(str(pkg), "a/b/v1.0.sd.pkl").tensors] == ["w"]
    assert [t.name for t in package_source(str(pkg), "a/b/v1.0.sd.pkl:").tensors] == ["w"]
    chosen = package_source(str(pkg), "train/ckpt.pkl")  # convert's choice inside that pickle: state_dict
    assert chosen.key == "train/ckpt.pkl:state_dict" and "train/ckpt.pkl:ema: state_dict (1 tensors)" in chosen.left_out
    ema = package_source(str(pkg), "train/ckpt.pkl:ema")
    assert torch.equal(_from_bytes(ema)["x"], sd["n"] + 1)
    with pytest.raises(errors.UsageError, match="names no pickle"):
        package_source(str(pkg), "a/b/v1.0.sd")
    with pytest.raises(errors.UsageError, match="no entry 'nope'"):
        package_source(str(pkg), "train/ckpt.pkl:nope")
    # the keys inspect prints for the package's state_dicts are keys package_source takes
    for entry in open_checkpoint(pkg).state_dicts():
        assert package_source(str(pkg), entry.path).key == entry.path


def test_convert_writes_the_package_tensors(tmp_path: Path, shipped: Any, run_cli: Any) -> None:
    from safetensors.torch import load_file

    pkg = _module_package(tmp_path / "net.pt", shipped)
    want = PackageImporter(str(pkg)).load_pickle("nets", "net.pkl").state_dict()
    res = run_cli("convert", pkg, "-o", tmp_path / "x.safetensors")
    assert res.exit_code == 0, res.output
    got = load_file(str(tmp_path / "x.safetensors"))
    assert set(got) <= set(want) and {"enc.weight", "dec.bias", "steps"} <= set(got)
    for k, t in got.items():
        assert torch.equal(t, want[k]), k
    res = run_cli("convert", pkg, "-o", tmp_path / "x.pt")
    assert res.exit_code == 0, res.output
    back = torch.load(tmp_path / "x.pt", weights_only=True)
    assert list(back) == list(want) and all(torch.equal(back[k], want[k]) for k in want)
    assert back["head.weight"].untyped_storage().data_ptr() == back["enc.weight"].untyped_storage().data_ptr()


def test_convert_to_dcp_writes_a_dcp_folder(tmp_path: Path, run_cli: Any) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    sd = {k: v.clone() for k, v in _state_dict().items() if k in ("w", "half", "n")}
    pkg = _sd_package(tmp_path / "pkg.pt", sd)
    res = run_cli("convert", pkg, "-o", tmp_path / "out", "--format", "dcp")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / ".metadata").is_file()
    dcp_to_torch_save(tmp_path / "out", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_diff_package_against_its_torch_save_is_identical(tmp_path: Path, run_cli: Any) -> None:
    sd = _state_dict()
    pkg = _sd_package(tmp_path / "pkg.pt", sd)
    torch.save(sd, tmp_path / "model.pt")
    res = run_cli("diff", pkg, tmp_path / "model.pt")
    assert res.exit_code == 0 and "identical" in res.output, res.output
    changed = dict(sd, half=sd["half"] + 1)
    torch.save(changed, tmp_path / "changed.pt")
    res = run_cli("diff", pkg, tmp_path / "changed.pt")
    assert res.exit_code != 0 and "half" in res.output, res.output


def test_diff_key_selects_a_package_state_dict(tmp_path: Path, run_cli: Any) -> None:
    ema = {"w": torch.full((2,), 7.0)}
    pkg = tmp_path / "train.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.save_pickle("m", "ckpt.pkl", {"state_dict": {"w": torch.zeros(2)}, "ema": ema})
    torch.save(ema, tmp_path / "ema.pt")
    res = run_cli("diff", pkg, tmp_path / "ema.pt", "--key", "m/ckpt.pkl:ema")
    assert res.exit_code == 0 and "identical" in res.output, res.output
    res = run_cli("diff", pkg, tmp_path / "ema.pt", "--key", "m/ckpt.pkl:nope", catch_exceptions=True)
    assert res.exit_code == 2 and "m/ckpt.pkl:state_dict, m/ckpt.pkl:ema" in res.output, res.output


def test_diff_compares_the_package_location_tags(tmp_path: Path, run_cli: Any) -> None:
    """A package records each storage's location tag, as torch.save does: a retagged one is a difference."""
    sd = {"w": torch.zeros(3)}
    pkg = _sd_package(tmp_path / "pkg.pt", sd)
    with zipfile.ZipFile(pkg) as z:
        items = [(i, z.read(i)) for i in z.infolist()]
    gpu = tmp_path / "gpu.pt"
    with zipfile.ZipFile(gpu, "w", zipfile.ZIP_STORED) as z:
        for info, data in items:
            if info.filename.endswith("model/state_dict.pkl"):
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            z.writestr(info, data)
    assert open_checkpoint(gpu).state_dict().tensors[0].storage.location == "cuda:0"
    res = run_cli("diff", pkg, gpu)
    assert res.exit_code != 0 and "cuda:0" in res.output, res.output


def test_average_of_packages(tmp_path: Path, run_cli: Any) -> None:
    from safetensors.torch import load_file

    a = {"w": torch.ones(3), "n": torch.arange(3)}
    b = {"w": torch.full((3,), 3.0), "n": torch.arange(3)}
    pa, pb = _sd_package(tmp_path / "a.pt", a), _sd_package(tmp_path / "b.pt", b)
    res = run_cli("average", pa, pb, "-o", tmp_path / "mean.safetensors")
    assert res.exit_code == 0, res.output
    got = load_file(str(tmp_path / "mean.safetensors"))
    assert torch.equal(got["w"], torch.full((3,), 2.0)) and torch.equal(got["n"], a["n"])


def test_average_takes_a_package_key(tmp_path: Path, run_cli: Any) -> None:
    from safetensors.torch import load_file

    paths = []
    for i in (1.0, 3.0):
        paths.append(tmp_path / f"p{i}.pt")
        with PackageExporter(str(paths[-1])) as exp:
            exp.save_pickle("m", "ckpt.pkl", {"state_dict": {"w": torch.zeros(2)}, "ema": {"w": torch.full((2,), i)}})
    res = run_cli("average", *paths, "--key", "m/ckpt.pkl:ema", "-o", tmp_path / "ema.safetensors")
    assert res.exit_code == 0, res.output
    assert torch.equal(load_file(str(tmp_path / "ema.safetensors"))["w"], torch.full((2,), 2.0))


def test_a_damaged_storage_record_fails_convert_verification(tmp_path: Path, run_cli: Any) -> None:
    """convert holds the bytes it copies to the record's zip CRC-32: a flipped byte in the record is caught."""
    pkg = _sd_package(tmp_path / "pkg.pt", {"w": torch.zeros(64)})
    src = package_source(str(pkg))
    data = bytearray(pkg.read_bytes())
    data[src.tensors[0].storage.offset + 5] ^= 0xFF
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    res = run_cli("convert", bad, "-o", tmp_path / "x.safetensors", catch_exceptions=True)
    assert res.exit_code not in (0, 3) and "CRC" in res.output, res.output
    assert not (tmp_path / "x.safetensors").exists()


def test_a_payload_pickle_converts_nothing_and_never_runs(tmp_path: Path, run_cli: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A package whose pickle is the marker payload (``os.system`` when PackageImporter loads it): ckptool
    converts nothing and the marker never appears; PackageImporter does run it (the fixture is live)."""
    pkg = _sd_package(tmp_path / "pkg.pt", {"w": torch.zeros(3)})
    evil = tmp_path / "evil.pt"
    with zipfile.ZipFile(pkg) as src, zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("model/state_dict.pkl"):
                data = adversarial.marker_pickle(2)
            elif info.filename.endswith(".data/extern_modules"):  # what PackageImporter lets the pickle import
                data += b"os\n"
            dst.writestr(info, data)
    marker = tmp_path / "marker"
    monkeypatch.setenv(adversarial.MARKER_ENV, str(marker))
    for args in (["convert", evil, "-o", tmp_path / "out" / "x.safetensors"],
                 ["convert", evil, "--key", "model/state_dict.pkl:", "-o", tmp_path / "out" / "x.pt"],
                 ["diff", evil, pkg], ["average", evil, evil, "-o", tmp_path / "out" / "m.safetensors"]):
        (tmp_path / "out").mkdir(exist_ok=True)
        res = run_cli(*args, catch_exceptions=True)
        assert res.exit_code not in (0, 3), (args, res.output)
        assert res.output.count("Error:") == 1 and "Traceback" not in res.output, res.output
        assert not marker.exists() and not any((tmp_path / "out").iterdir()), args
    PackageImporter(str(evil)).load_pickle("model", "state_dict.pkl")
    assert marker.exists()


def test_a_reduce_package_object_is_refused(tmp_path: Path, shipped: Any, run_cli: Any) -> None:
    mod = shipped(_REDUCE_MODULE, _REDUCE_SOURCE)
    pkg = tmp_path / "reduce.pt"
    with PackageExporter(str(pkg)) as exp:
        exp.intern(_REDUCE_MODULE)
        exp.save_pickle("m", "sd.pkl", {"w": torch.zeros(2), "h": mod.Holder(torch.ones(3))})
        exp.save_pickle("m", "only.pkl", mod.Holder(torch.ones(3)))
    with pytest.raises(errors.UnsupportedError, match=r"m/sd\.pkl:h is an object the package's own code rebuilds"
                                                      r".*PackageImporter\(.*\)\.load_pickle\('m', 'sd\.pkl'\)"):
        package_source(str(pkg), "m/sd.pkl")
    with pytest.raises(errors.UnsupportedError, match=r"m/only\.pkl: is an object the package's own code"):
        package_source(str(pkg), "m/only.pkl:")
    with pytest.raises(errors.UnsupportedError, match=r"made by tests_pkgreduce\.rebuild"):
        package_source(str(pkg))  # m/sd.pkl is the one state_dict; its entry h is rebuilt by code
    res = run_cli("convert", pkg, "-o", tmp_path / "x.safetensors", catch_exceptions=True)
    assert res.exit_code not in (0, 3) and "reduce_package" in res.output and "trusted" in res.output, res.output
    assert not (tmp_path / "x.safetensors").exists()

