"""The cast report of ``convert --dtype`` (issue 48): per tensor and in total, values made +-inf (overflow), finite
values made 0 (underflow), NaNs in and out, the largest absolute and relative errors; a cast that makes inf from
finite values is refused unless ``--allow-overflow``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ckptool
from ckptool.errors import UnsupportedError

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")


def _known_values(dtype: torch.dtype) -> torch.Tensor:
    """Random normals plus values with a known fate in float16: overflows (65520 rounds to inf, 1e6, -3e38),
    values that stay finite (65504, 65519), underflows (1e-8, -3e-41, 2.9e-8), float16 subnormals (6e-8, 1e-5),
    zeros, NaNs and infinities already there."""
    g = torch.Generator().manual_seed(0)
    special = [65520.0, 1e6, -3e38, 65504.0, 65519.0, 1e-8, -3e-41, 2.9e-8, 6e-8, 1e-5, -1e-5, 0.0, -0.0,
               float("nan"), float("nan"), float("inf"), float("-inf"), 1.0 / 3]
    x = torch.cat([torch.randn(1026, generator=g) * 100, torch.tensor(special)]).to(dtype)
    return x[torch.randperm(x.numel(), generator=g)].reshape(-1, 18)


def _direct(x: torch.Tensor, y: torch.Tensor) -> dict[str, object]:
    """What the cast from ``x`` to ``y`` did, computed directly on whole tensors."""
    a, b = x.double().reshape(-1), y.double().reshape(-1)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    err = (b[both] - a[both]).abs()
    nz = a[both] != 0
    return {"elements": a.numel(), "overflow": int((fa & torch.isinf(b)).sum()),
            "underflow": int((fa & (a != 0) & (b == 0)).sum()), "nan_in": int(torch.isnan(a).sum()),
            "nan_out": int(torch.isnan(b).sum()), "nan_made": int((fa & torch.isnan(b)).sum()),
            "max_abs_error": float(err.max()), "max_rel_error": float((err[nz] / a[both][nz].abs()).max())}


@pytest.mark.parametrize(("src", "dst"), [("float32", "float16"), ("bfloat16", "float16"), ("float32", "bfloat16"),
                                          ("float64", "float32"), ("float16", "float32")])
@pytest.mark.parametrize("block", [None, 7])
def test_counts_equal_a_direct_torch_computation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src: str,
                                                 dst: str, block: int | None) -> None:
    if block is not None:  # counted block by block: the same totals as one block
        monkeypatch.setattr("ckptool.torch_ops.cast._COUNT_BLOCK", block)
    w = _known_values(getattr(torch, src))
    tied = torch.linspace(-1, 1, 12, dtype=getattr(torch, src))
    st_torch.save_file({"w": w, "tied": tied, "ids": torch.arange(5)}, tmp_path / "in.safetensors")
    res = ckptool.convert(tmp_path / "in.safetensors", tmp_path / "out.safetensors", dtype=dst, allow_overflow=True)
    out = st_torch.load_file(tmp_path / "out.safetensors")
    assert out["w"].dtype == getattr(torch, dst)
    assert torch.equal(out["w"].view(torch.uint8), w.to(getattr(torch, dst)).view(torch.uint8))  # NaN bits too
    want = _direct(w, out["w"])
    got = res.cast_values["w"]
    assert (got.src, got.dst) == (src, dst)
    rel = want.pop("max_rel_error")
    assert {k: getattr(got, k) for k in want} == want  # max_abs_error too: exact
    assert got.max_rel_error == pytest.approx(rel, rel=1e-6)  # a quotient, rounded once
    assert set(res.cast_values) == {"w", "tied"}  # integer tensors are not cast
    total = res.cast_total
    assert total is not None and total.elements == w.numel() + tied.numel()
    assert total.overflow == want["overflow"] and total.nan_in == want["nan_in"]
    if dst == "float16":  # the values of known fate
        # bfloat16 rounds 65504 and 65519 up to 65536 and -3e-41 to 0 before the cast
        assert (want["overflow"], want["underflow"]) == ((3, 3) if src == "float32" else (5, 2))
        assert want["nan_in"] == want["nan_out"] == 2 and want["nan_made"] == 0


def test_the_overflow_refusal_names_tensors_and_counts_and_writes_nothing(tmp_path: Path) -> None:
    big = torch.tensor([1.0, 70000.0, -1e5, 2.0], dtype=torch.bfloat16)
    st_torch.save_file({"a.weight": big, "b.weight": torch.ones(3, dtype=torch.bfloat16)}, tmp_path / "in.safetensors")
    for dst in ("out.safetensors", "out.pt"):
        with pytest.raises(UnsupportedError, match=r"a\.weight \(bfloat16->float16: 2 to \+-inf of 4\)") as e:
            ckptool.convert(tmp_path / "in.safetensors", tmp_path / dst, dtype="float16")
        assert "b.weight" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]
    res = ckptool.convert(tmp_path / "in.safetensors", tmp_path / "out.pt", dtype="float16", allow_overflow=True)
    assert res.cast_values["a.weight"].overflow == 2 and res.cast_values["b.weight"].overflow == 0
    assert torch.isinf(torch.load(tmp_path / "out.pt", weights_only=True)["a.weight"]).sum() == 2


def test_cli_refuses_bf16_to_fp16_above_65504_without_allow_overflow(tmp_path: Path, run_cli) -> None:
    st_torch.save_file({"h": torch.tensor([65536.0, 1.0], dtype=torch.bfloat16)}, tmp_path / "in.safetensors")
    r = run_cli("convert", tmp_path / "in.safetensors", "-o", tmp_path / "o.safetensors", "--dtype", "float16")
    assert r.exit_code == 1
    assert r.output.startswith("Error: ") and r.output.count("\n") == 1 and "Traceback" not in r.output
    assert "h (bfloat16->float16: 1 to +-inf of 2)" in r.output and "--allow-overflow" in r.output
    assert not (tmp_path / "o.safetensors").exists()
    r = run_cli("convert", tmp_path / "in.safetensors", "-o", tmp_path / "o.safetensors", "--dtype", "float16",
                "--allow-overflow")
    assert r.exit_code == 0, r.output
    assert "Cast report (2 values): overflow to +-inf 1, underflow to 0 0" in r.output
    assert "  h (bfloat16->float16): overflow to +-inf 1" in r.output
    r = run_cli("convert", tmp_path / "in.safetensors", "-o", tmp_path / "o.safetensors", "--dtype", "float16",
                "--allow-overflow", "--force", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["cast_total"]["overflow"] == 1 and doc["cast_values"]["h"]["elements"] == 2


def test_a_shard_set_with_an_overflow_leaves_nothing(tmp_path: Path, run_cli) -> None:
    tensors = {f"l{i}": torch.full((256,), 1.0 if i != 2 else 1e5) for i in range(4)}
    st_torch.save_file(tensors, tmp_path / "in.safetensors")
    (tmp_path / "out").mkdir()
    r = run_cli("convert", tmp_path / "in.safetensors", "-o", f"{tmp_path / 'out'}/", "--max-shard-size", "600B",
                "--dtype", "float16", "--jobs", "2")
    assert r.exit_code == 1 and "l2 (float32->float16: 256 to +-inf of 256)" in r.output, r.output
    assert os.listdir(tmp_path / "out") == []


def test_no_cast_no_report(tmp_path: Path) -> None:
    st_torch.save_file({"w": torch.ones(3)}, tmp_path / "in.safetensors")
    res = ckptool.convert(tmp_path / "in.safetensors", tmp_path / "out.safetensors", dtype="float32")
    assert res.cast_values == {} and res.cast_total is None
    assert "Cast report" not in str(res)
