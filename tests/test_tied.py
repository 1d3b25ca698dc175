"""Tied weights survive every round trip (issue 12, item 4): torch -> safetensors -> torch with ``ckptool convert``,
``load_into`` / ``verify`` / ``load_training_state`` with ``strict=True``, files written by
``safetensors.torch.save_model``, sharded sets, and model entries absent from a file only because they are tied.

The reference is the tied model itself: ``lm_head.weight`` is ``embed.weight`` (one ``Parameter``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import requires_cuda
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model
from torch import nn

import ckptool
from ckptool.errors import CorruptCheckpointError
from ckptool.formats.safetensors import (
    SHARED_KEY,
    SharedGroup,
    SharedView,
    decode_shared,
    encode_shared,
    read_header,
)
from ckptool.ops.convert import convert
from ckptool.torch_ops.load import load_checkpoint
from ckptool.torch_ops.reports import StateDictMismatchError
from ckptool.torch_ops.tied import tied_entries


class TiedLM(nn.Module):
    """An embedding tied to the output head, as language models do (``lm_head.weight is embed.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # float features in (verify's fixed-seed input), logits out
        out: torch.Tensor = self.lm_head(self.norm(self.body(x)))
        return out


class UntiedLM(TiedLM):
    """The same names and shapes, but a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head.weight = nn.Parameter(torch.zeros(11, 6))


def trained() -> TiedLM:
    torch.manual_seed(0)
    m = TiedLM()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p))
    return m


def ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def assert_tied_and_equal(model: TiedLM, ref: TiedLM) -> None:
    """The tie holds (one Parameter, one storage) and every entry is bit-identical to ``ref``'s."""
    assert model.lm_head.weight is model.embed.weight
    sd = model.state_dict()
    assert ptr(sd["lm_head.weight"]) == ptr(sd["embed.weight"])
    want = ref.state_dict()
    assert list(sd) == list(want)
    for k, v in want.items():
        a, b = sd[k].detach().cpu(), v.detach().cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k


@pytest.fixture
def tied_pt(tmp_path: Path) -> Path:
    path = tmp_path / "tied.pt"
    torch.save(trained().state_dict(), path)
    return path


# ------------------------------------------------------------------------------------------------ round trip
def test_torch_safetensors_torch_round_trip_loads_strictly(tmp_path: Path, tied_pt: Path, run_cli: Any) -> None:
    st, back = tmp_path / "tied.safetensors", tmp_path / "back.pt"
    res = run_cli("convert", tied_pt, "-o", st)
    assert res.exit_code == 0, res.output
    header = read_header(str(st))
    assert sorted(header.entries) == ["body.bias", "body.weight", "embed.weight", "norm.bias", "norm.weight"]
    assert header.aliases() == {"lm_head.weight": "embed.weight"} and SHARED_KEY in (header.metadata or {})

    res = run_cli("convert", st, "-o", back)
    assert res.exit_code == 0, res.output
    sd = torch.load(back, weights_only=True)
    assert list(sd) == list(trained().state_dict())
    assert ptr(sd["lm_head.weight"]) == ptr(sd["embed.weight"])  # one storage again in the torch file

    ref = trained()
    for path in (st, back):
        fresh = TiedLM()
        rep = ckptool.load_into(fresh, path, strict=True)
        assert rep.ok and rep.missing == [] and rep.loaded == 5 + 1 and rep.tied == {}  # both names in the file
        assert_tied_and_equal(fresh, ref)


def test_verify_strict_passes_on_safetensors_and_torch_outputs(tmp_path: Path, tied_pt: Path, run_cli: Any) -> None:
    st, back = tmp_path / "tied.safetensors", tmp_path / "back.pt"
    convert(tied_pt, st)
    convert(st, back)
    for path in (st, back):
        rep = ckptool.verify(TiedLM, path, device="cpu", strict=True, input_shape=(2, 6))
        assert rep.ok, rep.format()
        assert rep.checked == rep.load.model_entries == 6 and rep.value_mismatches == []
        res = run_cli("verify", path, "--model", "test_tied:TiedLM", "--device", "cpu", "--strict")
        assert res.exit_code == 0, res.output
        assert res.output.startswith("OK:") and "6/6 entries bit-identical" in res.output


def test_load_training_state_strict_on_converted_files(tmp_path: Path, tied_pt: Path) -> None:
    st = tmp_path / "tied.safetensors"
    convert(tied_pt, st)
    model = TiedLM()
    state = ckptool.load_training_state(model, None, st, device="cpu", strict=True)
    assert state.report.ok and state.report.missing == []
    assert_tied_and_equal(model, trained())

    model = TiedLM()
    ck = tmp_path / "train.pt"
    sd = load_checkpoint(st)[0]
    torch.save({"epoch": 3, "model": sd}, ck)  # the restored state_dict saved in a training dict: still tied
    state = ckptool.load_training_state(model, None, ck, device="cpu", strict=True)
    assert state.epoch == 3 and state.report.ok
    assert_tied_and_equal(model, trained())


def test_restored_aliases_are_views_of_one_storage(tmp_path: Path, tied_pt: Path) -> None:
    st = tmp_path / "tied.safetensors"
    convert(tied_pt, st)
    sd, saved = load_checkpoint(st)
    assert saved == {} and list(sd) == list(trained().state_dict())  # aliases back at their state_dict places
    assert ptr(sd["lm_head.weight"]) == ptr(sd["embed.weight"])
    sd["embed.weight"][0, 0] = 123.0  # one storage: a write through one name shows in the other
    assert sd["lm_head.weight"][0, 0] == 123.0


def test_views_with_offsets_and_strides_are_restored(tmp_path: Path) -> None:
    """ckptool's layout record, not only exact aliases: slices and a transpose of one storage come back as views."""
    base = torch.arange(24.0)
    mat = torch.arange(12.0).reshape(3, 4)
    src = OrderedDict([("base", base), ("head", base[:6]), ("strided", base[1::3]), ("mat", mat), ("mat_t", mat.t()),
                       ("a", torch.arange(12.0)[:8])])
    src["b"] = src["a"].as_strided((8,), (1,), 0)  # an exact alias of a
    torch.save(src, tmp_path / "v.pt")
    st = tmp_path / "v.safetensors"
    convert(tmp_path / "v.pt", st)
    got, _ = load_checkpoint(st)
    assert list(got) == list(src)
    for k, v in src.items():
        assert torch.equal(got[k], v) and got[k].stride() == v.stride(), k
    assert len({ptr(got[k]) for k in ("base", "head", "strided")}) == 1
    assert got["strided"].storage_offset() == 1 and ptr(got["mat_t"]) == ptr(got["mat"])
    assert ptr(got["a"]) == ptr(got["b"])


# ------------------------------------------------------------------------------------------------ save_model files
def test_save_model_file_loads_strictly(tmp_path: Path) -> None:
    ref = trained()
    path = tmp_path / "sm.safetensors"
    save_model(ref, str(path))  # drops lm_head.weight, records {"lm_head.weight": "embed.weight"}
    with safe_open(str(path), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 - safe_open has keys(), not __contains__ and f.metadata() == {"lm_head.weight": "embed.weight"}
    sd, _ = load_checkpoint(path)
    assert sd["lm_head.weight"] is sd["embed.weight"]  # the kept tensor under both names

    fresh = TiedLM()
    rep = ckptool.load_into(fresh, path, strict=True)
    assert rep.ok and rep.missing == []
    assert_tied_and_equal(fresh, ref)
    assert ckptool.verify(TiedLM, path, device="cpu", strict=True).ok
    # convert to torch gives the dropped name back as a view of the kept tensor (test_convert): plain torch loads it
    back = tmp_path / "back.pt"
    convert(path, back)
    plain = torch.load(back, weights_only=True)
    assert plain["lm_head.weight"].untyped_storage().data_ptr() == plain["embed.weight"].untyped_storage().data_ptr()
    rep = ckptool.load_into(TiedLM(), back, strict=True)
    assert rep.ok and rep.missing == [] and rep.tied == {}


def test_untied_model_still_reports_the_head_as_missing(tmp_path: Path) -> None:
    """A metadata alias gives the head its name back; a model whose head is its own still gets the values."""
    path = tmp_path / "sm.safetensors"
    save_model(trained(), str(path))
    model = UntiedLM()
    rep = ckptool.load_into(model, path, strict=True)
    assert rep.ok and torch.equal(model.lm_head.weight, trained().embed.weight)


# ------------------------------------------------------------------------------------------------ tied, not missing
def test_entry_absent_because_tied_is_reported_as_tied(tmp_path: Path, run_cli: Any) -> None:
    ref = trained()
    sd = ref.state_dict()
    del sd["lm_head.weight"]
    plain = tmp_path / "no_alias.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(plain))  # no metadata at all
    fresh = TiedLM()
    rep = ckptool.load_into(fresh, plain, strict=True)
    assert rep.ok and rep.missing == [] and rep.tied == {"lm_head.weight": "embed.weight"}
    assert rep.loaded == 5 and "+1 tied" in rep.summary()
    assert "Tied keys (1" in rep.tables() and "lm_head.weight  embed.weight" in rep.tables()
    assert rep.to_dict()["tied"] == {"lm_head.weight": "embed.weight"}
    assert_tied_and_equal(fresh, ref)

    vr = ckptool.verify(TiedLM, plain, device="cpu", strict=True)
    assert vr.ok and vr.tied == {"lm_head.weight": "embed.weight"} and vr.checked == 6
    assert "tied:        1 model entries share storage" in vr.format() and "(1 tied)" in vr.summary()
    res = run_cli("verify", plain, "--model", "test_tied:TiedLM", "--device", "cpu", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["load"]["tied"] == {"lm_head.weight": "embed.weight"}

    with pytest.raises(StateDictMismatchError, match="1 missing"):  # untied: the head really is missing
        ckptool.load_into(UntiedLM(), plain, strict=True)


def test_tied_entries_rule() -> None:
    m = TiedLM()
    sd = m.state_dict()
    assert tied_entries(sd, ["lm_head.weight"], ["embed.weight", "body.weight"]) == {"lm_head.weight": "embed.weight"}
    assert tied_entries(sd, ["embed.weight"], ["lm_head.weight"]) == {"embed.weight": "lm_head.weight"}
    assert tied_entries(sd, ["lm_head.weight"], ["body.weight"]) == {}  # its partner was not loaded either
    base = torch.arange(10.0)
    views = {"whole": base, "part": base[2:5], "t": torch.arange(6.0).reshape(2, 3).t(),
             "meta": torch.empty(2, device="meta")}
    assert tied_entries(views, ["part", "meta"], ["whole"]) == {"part": "whole"}
    assert tied_entries(views, ["whole"], ["part"]) == {}  # a slice does not cover its base
    assert tied_entries(views, ["t"], []) == {}


# ------------------------------------------------------------------------------------------------ sharded sets
def test_sharded_safetensors_set_loads_strictly(tmp_path: Path, tied_pt: Path) -> None:
    out = tmp_path / "shards"
    out.mkdir()
    convert(tied_pt, out, format="safetensors", max_shard_size=300)
    index = next(out.glob("*.index.json"))
    assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    for where in (index, out):
        fresh = TiedLM()
        rep = ckptool.load_into(fresh, where, strict=True)
        assert rep.ok and rep.missing == []
        assert_tied_and_equal(fresh, trained())
    assert ckptool.verify(TiedLM, out, device="cpu", strict=True).ok


# ------------------------------------------------------------------------------------------------ the header record
def test_shared_record_round_trip_and_damage(tmp_path: Path) -> None:
    groups = [SharedGroup("float32", 12, {"w": SharedView(0, 0, (3, 4), (4, 1)),
                                          "w_t": SharedView(1, 0, (4, 3), (1, 4))})]
    raw = encode_shared(groups)
    assert raw is not None and encode_shared([]) is None
    entries: dict[str, dict[str, Any]] = {"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}}
    assert decode_shared(raw, "x", entries) == groups
    doc = json.loads(raw)
    doc["groups"][0]["tensors"]["w_t"][1] = 5  # runs past the 12 elements
    with pytest.raises(CorruptCheckpointError, match="'w_t' runs past its storage"):
        decode_shared(json.dumps(doc), "x", entries)
    with pytest.raises(CorruptCheckpointError, match="a group without a stored tensor"):
        decode_shared(raw, "x", {})
    with pytest.raises(CorruptCheckpointError, match="is stored as float16"):
        decode_shared(raw, "x", {"w": {**entries["w"], "dtype": "F16"}})
    with pytest.raises(CorruptCheckpointError, match="unknown version"):
        decode_shared('{"version": 2, "groups": []}', "x", entries)

    path = tmp_path / "bad.safetensors"
    save_file({"w": torch.zeros(3, 4)}, str(path), metadata={SHARED_KEY: json.dumps(doc)})
    with pytest.raises(CorruptCheckpointError, match="Remove that metadata entry"):
        load_checkpoint(path)
    assert list(load_file(str(path))) == ["w"]  # plain safetensors still reads the stored tensor


# ------------------------------------------------------------------------------------------------ CUDA
@requires_cuda
def test_round_trip_onto_cuda(tmp_path: Path, tied_pt: Path) -> None:
    st, back = tmp_path / "tied.safetensors", tmp_path / "back.pt"
    convert(tied_pt, st)
    convert(st, back)
    sm = tmp_path / "sm.safetensors"
    save_model(trained(), str(sm))
    for path in (st, back, sm):
        fresh = TiedLM()
        rep = ckptool.load_into(fresh, path, device="cuda:0", strict=True)
        assert rep.ok and rep.device == "cuda:0"
        assert fresh.embed.weight.device == torch.device("cuda", 0)
        assert_tied_and_equal(fresh, trained())
        vr = ckptool.verify(TiedLM, path, device="cuda:0", strict=True, input_shape=(2, 6))
        assert vr.ok, vr.format()
