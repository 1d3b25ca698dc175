"""`ckptool average --method` (issue 39) against mergekit itself: ``mergekit-yaml ... --lazy-unpickle --random-seed``
on tiny Llama models built from a config, and ckptool on the same folders, compared tensor by tensor.

mergekit pins its own versions of torch / transformers / pydantic, so it lives in a virtual environment of its own:
the tests run ``$CKPTOOL_MERGEKIT`` (the path of ``mergekit-yaml``), else ``mergekit-yaml`` on ``PATH``, and skip
where there is neither. The option checks and refusals run without mergekit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import make_lora

import ckptool
from ckptool.errors import UnsupportedError, UsageError

#: ours -> mergekit's name
NAMES = {"linear": "linear", "task-arithmetic": "task_arithmetic", "ties": "ties", "dare-ties": "dare_ties",
         "dare-linear": "dare_linear"}


def _mergekit() -> str:
    exe = os.environ.get("CKPTOOL_MERGEKIT") or shutil.which("mergekit-yaml")
    if os.environ.get("CKPTOOL_MERGEKIT") and not os.path.exists(exe or ""):  # asked for, and missing: no skip
        pytest.fail(f"CKPTOOL_MERGEKIT={exe} does not exist")
    if not exe or not os.path.exists(exe):
        pytest.skip("mergekit-yaml not found (set CKPTOOL_MERGEKIT to its path)")
    return exe


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three tiny Llama models of one config (different seeds), as save_pretrained folders: m0 is the base."""
    root = tmp_path_factory.mktemp("models")
    out = []
    for i in range(3):
        make_lora.tiny_model("llama", seed=i, hidden=64).save_pretrained(root / f"m{i}")
        out.append(root / f"m{i}")
    return out


def _run_mergekit(tmp: Path, yaml: str, seed: int = 0) -> dict[str, torch.Tensor]:
    (tmp / "merge.yml").write_text(yaml)
    r = subprocess.run([_mergekit(), str(tmp / "merge.yml"), str(tmp / "mk"), "--lazy-unpickle", "--random-seed",
                        str(seed)], capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return safetensors_torch.load_file(tmp / "mk" / "model.safetensors")


def _close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Same keys, and every tensor equal within float32 rounding (a few units in the last place)."""
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=4 * 2.0 ** -23, atol=1e-7, msg=k)


@pytest.mark.parametrize("method", ["task-arithmetic", "ties", "dare-ties", "dare-linear"])
def test_task_methods_equal_mergekit(tmp_path: Path, models: list[Path], method: str) -> None:
    density = 1.0 if method == "task-arithmetic" else 0.5
    yaml = (f"merge_method: {NAMES[method]}\nbase_model: {models[0]}\nmodels:\n"
            f"  - model: {models[1]}\n    parameters: {{weight: 0.7, density: {density}}}\n"
            f"  - model: {models[2]}\n    parameters: {{weight: 0.4, density: {density}}}\ndtype: float32\n")
    theirs = _run_mergekit(tmp_path, yaml, seed=3)
    res = ckptool.average(models[1:], tmp_path / "ours.safetensors", method=method, base=models[0],
                          weights=[0.7, 0.4], density=None if method == "task-arithmetic" else density,
                          seed=3 if method.startswith("dare") else None)
    assert res.method == method and res.base == str(models[0]) and res.averaged == len(theirs)
    _close(safetensors_torch.load_file(tmp_path / "ours.safetensors"), theirs)


def test_slerp_and_linear_equal_mergekit(tmp_path: Path, models: list[Path]) -> None:
    yaml = (f"merge_method: slerp\nbase_model: {models[1]}\nmodels:\n  - model: {models[1]}\n"
            f"  - model: {models[2]}\nparameters: {{t: 0.3}}\ndtype: float32\n")
    (tmp_path / "s").mkdir()
    theirs = _run_mergekit(tmp_path / "s", yaml)
    ckptool.average(models[1:], tmp_path / "slerp.safetensors", method="slerp", t=0.3)
    _close(safetensors_torch.load_file(tmp_path / "slerp.safetensors"), theirs)
    yaml = ("merge_method: linear\nmodels:\n" + "".join(
        f"  - model: {m}\n    parameters: {{weight: {w}}}\n" for m, w in zip(models, (1, 2, 1))) + "dtype: float32\n")
    (tmp_path / "l").mkdir()
    theirs = _run_mergekit(tmp_path / "l", yaml)
    ckptool.average(models, tmp_path / "linear.safetensors", weights=[1, 2, 1])
    _close(safetensors_torch.load_file(tmp_path / "linear.safetensors"), theirs)


def test_methods_follow_their_definitions(tmp_path: Path, models: list[Path]) -> None:
    """Without mergekit: task arithmetic is base + sum w_i (x_i - base); ties with density 1 and one input is
    that input (within rounding); slerp at t=0 is the first input; dare with density 1 is task arithmetic."""
    sd = [safetensors_torch.load_file(m / "model.safetensors") for m in models]
    ckptool.average(models[1:], tmp_path / "ta.safetensors", method="task-arithmetic", base=models[0],
                    weights=[0.5, -0.25])
    ta = safetensors_torch.load_file(tmp_path / "ta.safetensors")
    for k in ta:
        b = sd[0][k]
        want = b + (torch.stack([sd[1][k] - b, sd[2][k] - b]) * torch.tensor([0.5, -0.25]).view(2, *[1] * b.dim())
                    ).sum(0)
        assert torch.equal(ta[k], want), k
    ckptool.average(models[1:], tmp_path / "dl.safetensors", method="dare-linear", base=models[0],
                    weights=[0.5, -0.25], density=1.0)
    assert all(torch.equal(v, ta[k]) for k, v in safetensors_torch.load_file(tmp_path / "dl.safetensors").items())
    ckptool.average(models[1:2], tmp_path / "t1.safetensors", method="ties", base=models[0])
    _close(safetensors_torch.load_file(tmp_path / "t1.safetensors"), sd[1])  # base + (x - base): x, rounded
    ckptool.average(models[1:], tmp_path / "s0.safetensors", method="slerp", t=0.0)
    assert all(torch.equal(v, sd[1][k]) for k, v in safetensors_torch.load_file(tmp_path / "s0.safetensors").items())


def test_method_refusals(tmp_path: Path, models: list[Path], run_cli: object) -> None:
    out = tmp_path / "x.safetensors"
    with pytest.raises(UsageError, match="give --base BASE"):
        ckptool.average(models[1:], out, method="ties")
    with pytest.raises(UsageError, match="slerp interpolates between two inputs, got 3"):
        ckptool.average(models, out, method="slerp")
    with pytest.raises(UsageError, match=r"--density 1\.5"):
        ckptool.average(models[1:], out, method="ties", base=models[0], density=1.5)
    with pytest.raises(UsageError, match="--seed applies to dare"):
        ckptool.average(models[1:], out, method="ties", base=models[0], seed=1)
    with pytest.raises(UsageError, match="--base applies to"):
        ckptool.average(models[1:], out, base=models[0])
    other = tmp_path / "other"
    make_lora.tiny_model("gpt2").save_pretrained(other)
    with pytest.raises(UnsupportedError, match="has no key"):
        ckptool.average([other], out, method="task-arithmetic", base=models[0])
    assert not out.exists()
    r = run_cli("average", models[1], models[2], "--method", "dare-ties", "--base", models[0],  # type: ignore[operator]
                "--density", "0.3", "--seed", "7", "-o", out)
    assert r.exit_code == 0, r.output
    assert "Merged 2 checkpoints by dare-ties onto base" in r.output and "Load it with:" in r.output
