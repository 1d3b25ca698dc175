"""``ckptool diff`` across formats the other operations read: DeepSpeed ZeRO folders (their consolidated fp32
state_dict, as ``convert`` reads it) and training checkpoints against a bare state_dict (compared through the
state_dict ``convert`` selects, or ``--key``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptool.ops.diff.compare import diff
from ckptool.ops.diff.result import DIFFER

REPO = Path(__file__).resolve().parents[1]
DS = REPO / "fixtures" / "deepspeed-zero"  # the folders tests/test_deepspeed.py reads (fixtures/make_deepspeed.py)
CASES = ["zero1-2ranks", "zero2-1rank", "zero2-2ranks", "zero3-1rank", "zero3-2ranks"]


# --- DeepSpeed ZeRO folders (torch-free) ------------------------------------------------------------------------

@pytest.mark.torchfree
@pytest.mark.parametrize("case", CASES)
def test_deepspeed_folder_equals_its_conversion(case: str, tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "model.safetensors"
    assert run_cli("convert", DS / case, "-o", out).exit_code == 0
    r = run_cli("diff", DS / case, out)
    assert r.exit_code == 0, r.output
    assert "(deepspeed)" in r.output and "identical: " in r.output
    assert "not compared" not in r.output.splitlines()[-1]  # every value was read and compared
    assert "optimizer state" in r.output  # what the consolidated state_dict leaves out is said


@pytest.mark.torchfree
@pytest.mark.parametrize("case", CASES)
def test_deepspeed_values_equal_zero_to_fp32(case: str) -> None:
    """Independent evidence: ``<case>.oracle.pt`` is DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``
    (its zero 1/2 tensors are views of one flat buffer, so only the sharing may differ)."""
    res = diff(DS / case, DS / f"{case}.oracle.pt")
    assert not res.only_a and not res.only_b and not res.prefix and not res.tensors
    assert res.compared >= 11 and res.values_equal == res.compared and res.format_a == "deepspeed"


@pytest.mark.torchfree
def test_deepspeed_changed_value_is_found(tmp_path: Path, run_cli: Any) -> None:
    """An injected fault: one byte of the conversion's last tensor changed makes the diff fail."""
    out = tmp_path / "model.safetensors"
    assert run_cli("convert", DS / "zero3-2ranks", "-o", out).exit_code == 0
    data = bytearray(out.read_bytes())
    data[-1] ^= 0x40
    out.write_bytes(bytes(data))
    res = diff(DS / "zero3-2ranks", out)
    assert not res.identical and [t.values for t in res.tensors] == [DIFFER]


# --- training checkpoints ---------------------------------------------------------------------------------------

def _training(tmp_path: Path, wrapper: str) -> tuple[Path, Any]:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    obj: dict[str, Any] = {"epoch": 1, "optimizer_state_dict": opt.state_dict()}
    if wrapper == "model.state_dict":
        obj["model"] = {"state_dict": m.state_dict()}
    else:
        obj[wrapper] = m.state_dict()
    path = tmp_path / "train.pt"
    torch.save(obj, path)
    return path, m


@pytest.mark.parametrize("wrapper", ["model_state_dict", "state_dict", "model.state_dict"])
def test_training_checkpoint_equals_its_safetensors_conversion(wrapper: str, tmp_path: Path,
                                                               run_cli: Any) -> None:
    path, _ = _training(tmp_path, wrapper)
    out = tmp_path / "model.safetensors"
    assert run_cli("convert", path, "-o", out).exit_code == 0
    r = run_cli("diff", path, out)
    assert r.exit_code == 0, r.output
    assert f"state_dict {wrapper!r}" in r.output and "identical: 4 of 4" in r.output
    assert "optimizer_state_dict: optimizer state" in r.output  # what was not compared is said
    j = json.loads(run_cli("diff", out, path, "--json").output)  # either order
    assert (j["identical"], j["key_a"], j["key_b"], j["only_a"], j["only_b"]) == (True, None, wrapper, [], [])


def test_key_picks_the_state_dict(tmp_path: Path, run_cli: Any) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    sd = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    ema = {k: v + 1 for k, v in sd.items()}
    path = tmp_path / "train.pt"
    torch.save({"epoch": 2, "model": {"state_dict": sd}, "ema": ema}, path)
    torch.save({"step": 7, "ema": ema, "state_dict": sd}, tmp_path / "other.pt")
    out = tmp_path / "ema.safetensors"
    assert run_cli("convert", path, "-o", out, "--key", "ema").exit_code == 0
    r = run_cli("diff", path, out)  # convert's own choice is model.state_dict: values differ
    assert r.exit_code == 1 and "state_dict 'model.state_dict'" in r.output, r.output
    r = run_cli("diff", path, out, "--key", "ema")
    assert r.exit_code == 0 and "state_dict 'ema'" in r.output, r.output
    res = diff(path, tmp_path / "other.pt", key="ema")  # both sides where it resolves
    assert (res.identical, res.key_a, res.key_b, res.compared) == (True, "ema", "ema", 2)


def test_key_that_resolves_nowhere_is_a_usage_error(tmp_path: Path, run_cli: Any) -> None:
    path, _ = _training(tmp_path, "model_state_dict")
    out = tmp_path / "model.safetensors"
    assert run_cli("convert", path, "-o", out).exit_code == 0
    r = run_cli("diff", path, out, "--key", "nope")
    assert r.exit_code == 2 and r.output.startswith("Error: --key 'nope' names no state_dict"), r.output
    assert "model_state_dict" in r.output  # what there is, to choose from
    r = run_cli("diff", path, out, "--key", "epoch")  # resolves, but to no state_dict
    assert r.exit_code == 2 and "names no state_dict" in r.output, r.output
