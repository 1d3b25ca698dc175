"""``ckptool diff`` / ``ckptool.diff``: keys, layouts, sharing, plain values and streamed value comparison across
formats, exit codes and JSON."""

from __future__ import annotations

import builtins
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptool
from ckptool.ops.diff import compare as diff_mod
from ckptool.ops.diff.compare import diff
from ckptool.ops.diff.result import DIFFER


def _model_sd() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    return dict(m.state_dict())


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """A small state_dict saved several ways."""
    sd = _model_sd()
    out = {name: tmp_path / f"{name}.pth" for name in ("a", "dp", "ft", "ft_dp", "legacy", "tc1", "tc2")}
    torch.save(sd, out["a"])
    torch.save({"module." + k: v for k, v in sd.items()}, out["dp"])
    ft = {k: v.clone() for k, v in sd.items()}
    ft["2.weight"] += 1e-3
    torch.save(ft, out["ft"])
    torch.save({"module." + k: v for k, v in ft.items()}, out["ft_dp"])
    torch.save(sd, out["legacy"], _use_new_zipfile_serialization=False)
    torch.save({"epoch": 3, "lr": 0.1, "args": {"name": "run1"}, "model": sd}, out["tc1"])
    torch.save({"epoch": 4, "lr": 0.1, "args": {"name": "run1"}, "model": sd}, out["tc2"])
    return out


def test_same_file_identical(files: dict[str, Path], run_cli: Any) -> None:
    res = diff(files["a"], files["a"])
    assert res.identical and res.compared == 4 and res.values_equal == 4
    r = run_cli("diff", files["a"], files["a"])
    assert r.exit_code == 0 and "identical: 4 of 4" in r.output


def test_remap_to_other_device_reports_device_only(files: dict[str, Path], tmp_path: Path) -> None:
    cuda = tmp_path / "cuda.pth"
    ckptool.remap(files["a"], cuda, to="cuda:1")
    cpu = tmp_path / "back.pth"
    ckptool.remap(cuda, cpu, to="cpu")
    res = diff(cuda, cpu)
    assert not res.identical
    assert {t.key for t in res.tensors} == set(_model_sd())
    assert all(t.changes == ["device cuda:1 -> cpu"] and t.values == "equal" for t in res.tensors)
    assert diff(files["a"], cpu).identical


def test_torch_vs_its_safetensors_conversion(files: dict[str, Path], tmp_path: Path) -> None:
    st = tmp_path / "a.safetensors"
    ckptool.convert(files["a"], st)
    assert diff(files["a"], st).identical
    assert diff(files["legacy"], st).identical  # legacy stream vs safetensors
    shards = tmp_path / "shards"
    ckptool.convert(files["a"], shards, max_shard_size=60)
    res = diff(st, shards)
    assert res.identical and res.format_b == "sharded-safetensors" and res.compared == 4


def test_fine_tuned_copy_with_prefix(files: dict[str, Path], run_cli: Any) -> None:
    res = diff(files["a"], files["ft_dp"])
    assert res.prefix is not None and "B has `module.` on every key" in res.prefix
    assert [(t.key, t.key_b, t.values) for t in res.tensors] == [("2.weight", "module.2.weight", DIFFER)]
    t = res.tensors[0]
    assert t.max_abs == pytest.approx(1e-3, rel=1e-3) and t.mismatched == 6 and t.numel == 6
    r = run_cli("diff", files["a"], files["ft_dp"])
    assert r.exit_code == 1
    assert r.output.count("`module.`") == 2 and "2.weight" in r.output and "0.001" in r.output  # keys:, summary
    assert r.output.splitlines()[-1] == ("different: keys differ by a `module.` prefix; values differ in 1 tensor; "
                                         "3 of 4 matched tensors equal (bit-exact)")


def test_tolerances(files: dict[str, Path], run_cli: Any) -> None:
    close = diff(files["a"], files["ft"], atol=1e-2)
    assert close.identical and close.mode == "tolerance"
    assert [(t.key, t.values) for t in close.tensors] == [("2.weight", "close")]
    far = diff(files["a"], files["ft"], atol=1e-5, rtol=1e-5)
    assert not far.identical and far.tensors[0].values == DIFFER and far.tensors[0].mismatched == 6
    assert run_cli("diff", files["a"], files["ft"], "--atol", "1e-2").exit_code == 0
    assert run_cli("diff", files["a"], files["ft"], "--rtol", "1e-6").exit_code == 1


def test_different_dtypes_compare_by_value_only_with_tolerances(files: dict[str, Path], tmp_path: Path) -> None:
    half = tmp_path / "half.pth"
    torch.save({k: v.double() for k, v in _model_sd().items()}, half)
    exact = diff(files["a"], half)
    assert all(t.changes == ["dtype float32 -> float64"] and t.values == "not compared" for t in exact.tensors)
    tol = diff(files["a"], half, atol=0.0)
    assert all(t.values == "close" and t.max_abs == 0 for t in tol.tensors)
    assert not tol.identical  # the dtype change is still a difference


def test_dataparallel_prefix_reported_once(files: dict[str, Path], run_cli: Any) -> None:
    res = diff(files["dp"], files["a"])
    assert res.prefix is not None and res.prefix.startswith("A has `module.` on every key")
    assert res.values_equal == 4 and not res.tensors and not res.only_a and not res.only_b
    assert not res.identical
    r = run_cli("diff", files["a"], files["dp"])
    assert r.exit_code == 1 and r.output.count("module.") == 2  # the keys: line and the summary, no row


def test_missing_and_extra_keys(tmp_path: Path) -> None:
    sd = _model_sd()
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    torch.save(sd, a)
    torch.save({**{k: v for k, v in sd.items() if k != "0.bias"}, "extra.weight": torch.zeros(2)}, b)
    res = diff(a, b)
    assert res.only_a == ["0.bias"] and res.only_b == ["extra.weight"] and res.compared == 3
    assert res.prefix is None and not res.identical


def test_plain_values(files: dict[str, Path], tmp_path: Path) -> None:
    res = diff(files["tc1"], files["tc2"])
    assert [(v.key, v.a, v.b) for v in res.values] == [("epoch", 3, 4)]
    assert res.plain_values == 3 and res.values_equal == 4
    d = res.to_dict()
    assert d["values"] == [{"key": "epoch", "key_b": "epoch", "a": 3, "b": 4}]
    bare = diff(files["a"], files["tc1"])  # training checkpoint vs its bare state_dict: convert's state_dict
    assert bare.identical and bare.key_b == "model" and bare.values_equal == 4 and not bare.only_b
    assert any("epoch: int 3" in n for n in bare.notes)  # what was not compared is said


def test_tied_vs_untied(tmp_path: Path) -> None:
    lin = nn.Linear(3, 3)
    tied = {"emb.weight": lin.weight, "head.weight": lin.weight, "b": lin.bias}
    a, b, st = tmp_path / "tied.pth", tmp_path / "untied.pth", tmp_path / "tied.safetensors"
    torch.save(tied, a)
    torch.save({k: v.clone() for k, v in tied.items()}, b)
    res = diff(a, b)
    assert res.shared == ["emb.weight, head.weight share a storage in A but not in B"]
    assert res.values_equal == 3 and not res.identical
    ckptool.convert(a, st)
    assert diff(a, st).identical  # the tie survives conversion (recorded in __metadata__)


def test_non_contiguous_views(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    a, b, c = tmp_path / "a.pth", tmp_path / "b.pth", tmp_path / "c.pth"
    torch.save({"t": base.t(), "s": base[1:3, ::2], "row": base[2]}, a)
    torch.save({"t": base.t().contiguous(), "s": base[1:3, ::2].clone(), "row": base[2].clone()}, b)
    res = diff(a, b)
    assert res.values_equal == 3
    assert {t.key: t.changes for t in res.tensors} == {"t": ["stride [1, 6] -> [4, 1]"],
                                                       "s": ["stride [6, 2] -> [3, 1]"]}
    changed = base.t().contiguous().clone()
    changed[5, 3] = -1
    torch.save({"t": changed, "s": base[1:3, ::2].clone(), "row": base[2].clone()}, c)
    res = diff(a, c)
    t = next(x for x in res.tensors if x.key == "t")
    assert t.values == DIFFER and t.mismatched == 1 and t.max_abs == 24.0  # element [5, 3] was 23


def test_big_tensor_bounded_memory(tmp_path: Path) -> None:
    n = 8 << 20  # 8 Mi float32 = 32 MiB per file
    x = torch.randn(n)
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    torch.save({"w": x}, a)
    y = x.clone()
    y[-1] += 1
    torch.save({"w": y}, b)
    del x, y
    for tolerances in ({}, {"atol": 0.5}):
        tracemalloc.start()
        try:
            res = diff(a, b, **tolerances)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert res.tensors[0].values == DIFFER and res.tensors[0].mismatched == 1
        assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB: the 32 MiB tensors must be streamed in chunks"


def test_keys_only_exit_codes_and_json(files: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    r = run_cli("diff", files["a"], files["ft"], "--keys-only", "--json")
    assert r.exit_code == 0
    doc = json.loads(r.output)
    assert doc["schema"] == "ckptool.diff/2" and doc["identical"] and doc["mode"] == "keys-only"
    r = run_cli("diff", files["a"], files["ft"], "--json")
    doc = json.loads(r.output)
    assert r.exit_code == 1 and doc["tensors"][0]["key"] == "2.weight" and doc["tensors"][0]["values"] == "differ"
    r = run_cli("diff", files["a"], files["ft"], "--quiet")
    assert r.exit_code == 1 and r.output == ""
    assert run_cli("diff", files["a"], tmp_path / "missing.pth").exit_code == 2
    assert run_cli("diff", files["a"], files["a"], "--atol", "-1").exit_code == 2
    assert run_cli("diff", files["a"], files["a"], "--atol", "1", "--keys-only").exit_code == 2
    assert run_cli("diff", files["a"]).exit_code == 2


def test_dcp_folder_compared_by_value(files: dict[str, Path], tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    folder = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save(_model_sd(), checkpoint_id=str(folder))
    res = diff(files["a"], folder)
    assert res.identical and res.compared == res.values_equal == 4 and res.not_compared == 0
    assert res.format_b == "dcp"


def test_tolerance_mode_needs_numpy(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_numpy(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_numpy)
    with pytest.raises(ModuleNotFoundError):
        diff(files["a"], files["ft"], atol=1e-3)
    res = diff(files["a"], files["ft"])  # bit-exact mode works without numpy, without figures
    assert res.tensors[0].values == DIFFER and res.tensors[0].max_abs is None


def test_chunks_cross_chunk_boundaries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(diff_mod, "CHUNK_BYTES", 64)
    base = torch.arange(300, dtype=torch.float32).reshape(20, 15)
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    torch.save({"v": base.t(), "c": base}, a)
    changed = base.clone()
    changed[19, 14] = 0
    torch.save({"v": changed.t().contiguous(), "c": changed}, b)
    res = diff(a, b)
    assert {t.key: t.mismatched for t in res.tensors} == {"v": 1, "c": 1}


def test_diff_does_not_import_torch(files: dict[str, Path], tmp_path: Path) -> None:
    import subprocess
    import sys

    st = tmp_path / "a.safetensors"
    ckptool.convert(files["a"], st)
    code = ("import sys, ckptool\n"
            "r = ckptool.diff(sys.argv[1], sys.argv[2])\n"
            "assert r.identical, r\n"
            "r = ckptool.diff(sys.argv[1], sys.argv[3])\n"
            "assert not r.identical and r.tensors[0].key == '2.weight'\n"
            "assert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code, str(files["a"]), str(st), str(files["ft"])],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------------------ not stored (issue 27)
def _gpu_file(tmp_path: Path, tag: str = "cuda:0") -> Path:
    """A state_dict saved as on a GPU (every storage tagged ``tag``) with one transposed (non-contiguous) tensor."""
    sd = {**_model_sd(), "t": torch.arange(24, dtype=torch.float32).reshape(4, 6).t()}
    cpu, gpu = tmp_path / "cpu.pth", tmp_path / f"{tag.replace(':', '')}.pth"
    torch.save(sd, cpu)
    ckptool.remap(cpu, gpu, to=tag)
    return gpu


def test_conversion_to_safetensors_is_identical_what_it_cannot_store_is_listed(tmp_path: Path, run_cli: Any) -> None:
    gpu = _gpu_file(tmp_path)
    st = tmp_path / "m.safetensors"
    ckptool.convert(gpu, st)
    res = diff(gpu, st)
    assert res.identical and res.values_equal == 5
    assert {t.key: t.not_stored for t in res.tensors} == {
        **{k: ["device cuda:0 not stored in B"] for k in _model_sd()},
        "t": ["device cuda:0 not stored in B", "stride [1, 6] not stored in B"]}
    assert all(not t.changes for t in res.tensors)
    strict = diff(gpu, st, strict=True)
    assert not strict.identical
    assert [t.not_stored for t in diff(st, gpu).tensors][-1] == ["device cuda:0 not stored in A",
                                                                  "stride [1, 6] not stored in A"]
    r = run_cli("diff", gpu, st)
    assert r.exit_code == 0, r.output
    assert "5 tensors: device cuda:0 in A, not stored in B (safetensors): not counted as a difference" in r.output
    assert "1 tensor: non-contiguous stride [1, 6] in A, not stored in B (safetensors)" in r.output
    assert "tensor " not in r.output  # no per-tensor rows: everything was folded
    r = run_cli("diff", gpu, st, "--strict")
    assert r.exit_code == 1 and "counted (--strict)" in r.output
    doc = json.loads(run_cli("diff", gpu, st, "--json").output)
    assert doc["identical"] and not doc["strict"]
    assert doc["tensors"][0]["not_stored"] == ["device cuda:0 not stored in B"]


def test_cpu_and_contiguous_are_what_a_format_without_them_implies(files: dict[str, Path], tmp_path: Path) -> None:
    st = tmp_path / "a.safetensors"
    ckptool.convert(files["a"], st)
    res = diff(files["a"], st, strict=True)
    assert res.identical and not res.tensors


def test_device_change_between_torch_files_still_differs_and_is_folded(tmp_path: Path, run_cli: Any) -> None:
    gpu = _gpu_file(tmp_path, "cuda:1")
    cpu = tmp_path / "cpu.pth"
    res = diff(gpu, cpu)
    assert not res.identical and all(t.changes[0] == "device cuda:1 -> cpu" and not t.not_stored
                                     for t in res.tensors)
    r = run_cli("diff", gpu, cpu)
    assert r.exit_code == 1
    assert r.output.count("device cuda:1 -> cpu") == 1 and "5 tensors: device cuda:1 -> cpu" in r.output
    assert "tensor " not in r.output
    r = run_cli("diff", gpu, cpu, "--verbose")
    assert r.exit_code == 1 and r.output.count("device cuda:1 -> cpu") == 5 and "0.weight" in r.output


def test_folded_rows_keep_the_tensors_whose_values_differ(tmp_path: Path, run_cli: Any) -> None:
    sd = _model_sd()
    a, b, b_gpu = tmp_path / "a.pth", tmp_path / "b.pth", tmp_path / "b_gpu.pth"
    torch.save(sd, a)
    torch.save({**sd, "2.bias": sd["2.bias"] + 1}, b)
    ckptool.remap(b, b_gpu, to="cuda:0")
    r = run_cli("diff", a, b_gpu)
    assert r.exit_code == 1 and "4 tensors: device cpu -> cuda:0" in r.output
    row = next(ln for ln in r.output.splitlines() if ln.startswith("2.bias"))
    assert "differ" in row and "device" not in row


def test_a_view_stride_safetensors_records_is_compared(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    a, st, c = tmp_path / "a.pth", tmp_path / "a.safetensors", tmp_path / "c.pth"
    torch.save({"w": base, "t": base.t()}, a)
    ckptool.convert(a, st)  # t is stored as a view of w: its stride is recorded
    assert diff(a, st, strict=True).identical
    torch.save({"w": base, "t": base.t().contiguous()}, c)
    res = diff(st, c)
    assert [(t.key, t.changes) for t in res.tensors] == [("t", ["stride [1, 6] -> [4, 1]"])]
    assert not res.identical


def test_dcp_folder_does_not_store_devices(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    gpu = _gpu_file(tmp_path)
    folder = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save(_model_sd(), checkpoint_id=str(folder))
    res = diff(gpu, folder)
    assert res.only_a == ["t"] and all(t.not_stored == ["device cuda:0 not stored in B"] for t in res.tensors)
    assert not diff(gpu, folder, strict=True).identical
