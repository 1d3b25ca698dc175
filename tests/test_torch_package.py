"""``torch.package`` archives (``torch.package.PackageExporter``): recognised, inspected without importing or running
anything (the pickles' tensors, the modules the archive ships, its extern modules, scan's verdict)."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch.package import PackageExporter, PackageImporter

from ckptool import errors
from ckptool.formats import detect
from ckptool.formats.torch_package import read_package
from ckptool.ops.inspect.entry import inspect

#: the module the model package ships; its top-level code touches $TPKG_MARKER when that is set
MODULE = "tpkg_shipped_net"
_SOURCE = """import os
import torch

_marker = os.environ.get("TPKG_MARKER")
if _marker:
    open(_marker, "w").close()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.register_buffer("steps", torch.zeros(5, dtype=torch.int64))
"""


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``sd.pt``: two state_dict pickles (float32 on cpu; float16 retagged ``cuda:0``); ``model.pt``: a model whose
    class comes from :data:`MODULE`, shipped in the archive."""
    d = tmp_path_factory.mktemp("tpkg")
    sd = d / "sd.pt"
    with PackageExporter(str(sd)) as e:
        e.save_pickle("weights", "sd.pkl", {"w": torch.zeros(2, 3)})
        e.save_pickle("weights.half", "gpu.pkl", {"b": torch.ones(4, dtype=torch.float16)})
    _retag(sd, "weights/half/gpu.pkl")
    (d / f"{MODULE}.py").write_text(_SOURCE)
    sys.path.insert(0, str(d))
    try:
        mod = __import__(MODULE)
        model = d / "model.pt"
        with PackageExporter(str(model)) as e:
            e.intern(MODULE)
            e.extern("torch.**")
            e.save_pickle("model", "model.pkl", mod.Net())
    finally:
        sys.path.remove(str(d))
        sys.modules.pop(MODULE, None)
    return {"sd": sd, "model": model}


def _retag(path: Path, member: str) -> None:
    """Give the storage of ``member`` the location tag ``cuda:0`` (what a package saved on a GPU holds)."""
    with zipfile.ZipFile(path) as z:
        items = [(i, z.read(i)) for i in z.infolist()]
    out = []
    for info, data in items:
        if info.filename.endswith(member):
            at = data.index(b"X\x03\x00\x00\x00cpu")
            data = data[:at] + b"X\x06\x00\x00\x00cuda:0" + data[at + 8:]
        out.append((info, data))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info, data in out:
            z.writestr(info, data)


def test_detected_as_torch_package(packages: dict[str, Path]) -> None:
    assert detect.detect_format(str(packages["sd"])) == detect.TORCH_PACKAGE
    assert detect.detect_format(str(packages["model"])) == detect.TORCH_PACKAGE


def test_inspect_lists_the_tensors_of_each_pickle(packages: dict[str, Path]) -> None:
    info = inspect(packages["sd"])
    assert (info.format, info.kind) == ("torch-package", "package")
    rows = {t.key: (t.shape, t.dtype, t.device, t.nbytes) for t in info.tensors}
    assert rows == {"weights/sd.pkl:w": ([2, 3], "float32", "cpu", 24),
                    "weights/half/gpu.pkl:b": ([4], "float16", "cuda:0", 8)}
    assert info.devices == {"cpu": 1, "cuda:0": 1} and info.storages == 2 and info.total_bytes == 32
    assert info.package is not None
    assert [(r["member"], r["package"], r["resource"], r["kind"], r["tensors"]) for r in info.package["resources"]] == [
        ("weights/sd.pkl", "weights", "sd.pkl", "state_dict", 1),
        ("weights/half/gpu.pkl", "weights.half", "gpu.pkl", "state_dict", 1)]
    assert info.package["modules"] == [] and "torch" in info.package["extern_modules"]
    assert info.security()["verdict"] == "safe"


def test_inspect_model_package_lists_modules_and_dangerous_verdict(packages: dict[str, Path], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    monkeypatch.setenv("TPKG_MARKER", str(marker))
    info = inspect(packages["model"])
    assert MODULE not in sys.modules and not marker.exists()  # nothing imported, nothing run
    rows = {t.key: (t.shape, t.dtype, t.device) for t in info.tensors}
    assert rows == {"model/model.pkl:fc.weight": ([2, 3], "float32", "cpu"),
                    "model/model.pkl:fc.bias": ([2], "float32", "cpu"),
                    "model/model.pkl:steps": ([5], "int64", "cpu")}
    assert info.package is not None and info.package["modules"] == [MODULE]
    assert info.package["resources"][0]["kind"] == "full_model"
    assert f"{MODULE}.Net" in info.package["resources"][0]["globals"]
    sec = info.security()
    assert sec["verdict"] == "dangerous"
    assert [(c["kind"], c["detail"]) for c in sec["code"]] == [("python-module", MODULE)]
    # the fixture is live: torch's own loader runs the shipped module
    PackageImporter(str(packages["model"])).load_pickle("model", "model.pkl")
    assert marker.exists()


def test_cli_text_and_json(packages: dict[str, Path], run_cli, monkeypatch: pytest.MonkeyPatch,
                           tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    monkeypatch.setenv("TPKG_MARKER", str(marker))
    res = run_cli("inspect", packages["model"])
    assert res.exit_code == 0, res.output
    assert "torch-package" in res.output and "model/model.pkl:fc.weight" in res.output
    assert f"modules it ships (run when loaded): {MODULE}" in res.output
    assert "DANGEROUS: model/" + MODULE + ".py" in res.output
    res = run_cli("inspect", "--json", packages["sd"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["format"] == "torch-package" and d["package"]["resources"][0]["member"] == "weights/sd.pkl"
    assert {t["key"]: (t["shape"], t["dtype"], t["device"]) for t in d["tensors"]} == {
        "weights/sd.pkl:w": ([2, 3], "float32", "cpu"), "weights/half/gpu.pkl:b": ([4], "float16", "cuda:0")}
    assert d["security"]["verdict"] == "safe"
    assert MODULE not in sys.modules and not marker.exists()


def test_missing_storage_record_is_corrupt(packages: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(packages["sd"]) as src, zipfile.ZipFile(bad, "w") as dst:
        for i in src.infolist():
            if not i.filename.endswith(".data/1.storage"):
                dst.writestr(i, src.read(i))
    read_package(str(packages["sd"]))  # the intact archive reads
    with pytest.raises(errors.CorruptCheckpointError, match=r"\.data/1\.storage"):
        read_package(str(bad))


def test_other_commands_refuse_naming_the_format(packages: dict[str, Path], run_cli, tmp_path: Path) -> None:
    # (remap re-tags a package: tests/test_package_remap.py)
    for args in (["sanitize"], ["add-prefix", "net."], ["remap", "--to", "cpu", "--unwrap"]):
        res = run_cli(args[0], packages["sd"], *args[1:], "-o", tmp_path / "out.pt")
        assert res.exit_code != 0 and "torch.package archive" in res.output, args
        assert not (tmp_path / "out.pt").exists()
