"""``--trust`` trusts classes, never gadgets (issue 36 item 1): every dangerous case of the adversarial corpus
(``fuzz/adversarial.py``: a marker payload run by an unrestricted unpickler) is refused under ``--trust`` by every
command that takes the flag and under ``trust=True`` by the API, before anything runs: no marker file, a refusal's
exit status (never 3), one ``Error:`` line naming the dangerous global (or shipped code) and where it is. Needs-trust
classes (a model class, ``DataParallel``, ``argparse.Namespace``) still load.
"""

from __future__ import annotations

import argparse
import io
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))

import adversarial

import ckptool
from ckptool.cli import cli
from ckptool.errors import CkptError, UnsafeCheckpointError
from ckptool.torch_ops import loaders, trusted
from ckptool.torch_ops.load import load_checkpoint

DANGEROUS_CASES = [c for c in adversarial.cases() if c.verdict == "dangerous"]
MODELS_PY = "import torch\n\ndef build():\n    return torch.nn.Linear(2, 2)\n"

#: every command that takes --trust (grep "--trust" ckptool/cli); PATH, OUT and MODELS replaced per run
TRUST_COMMANDS: dict[str, list[str]] = {
    "convert": ["convert", "PATH", "-o", "OUT/conv.safetensors", "--trust"],
    "extract-state-dict": ["extract-state-dict", "PATH", "-o", "OUT/sd.pth", "--trust"],
    "verify": ["verify", "PATH", "--model", "MODELS:build", "--device", "cpu", "--no-strict", "--trust"],
}


def _api_calls(path: Path, out: Path) -> dict[str, Any]:
    return {
        "load_checkpoint": lambda: load_checkpoint(path, "cpu", trust=True),
        "load_into": lambda: ckptool.load_into(torch.nn.Linear(2, 2), path, strict=False, trust=True),
        "extract_state_dict": lambda: ckptool.extract_state_dict(path, out / "sd.pth", trust=True),
        "convert": lambda: ckptool.convert(path, out / "c.safetensors", trust=True),
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trust-corpus")
    return {case.name: path for case, path in adversarial.write(root)}


def _named(case: adversarial.Case, text: str) -> bool:
    """The refusal names what scan found: the gadget (DANGEROUS) where ckptool reads the input; a folder whose
    index or ``latest`` leads outside it, and a legacy tar, are refused by their reader before (saying why)."""
    if case.name.startswith("folder-") or case.name.startswith("tar-"):
        return True
    return "DANGEROUS" in text and "--trust" in text and "torch.load(path, weights_only=False)" in text


@pytest.mark.parametrize("command", sorted(TRUST_COMMANDS))
@pytest.mark.parametrize("case", DANGEROUS_CASES, ids=lambda c: c.name)
def test_trust_never_runs_a_gadget_cli(case: adversarial.Case, command: str, corpus: dict[str, Path],
                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "marker"
    monkeypatch.setenv(adversarial.MARKER_ENV, str(marker))
    out = tmp_path / "out"
    out.mkdir()
    models = tmp_path / "trust_models.py"
    models.write_text(MODELS_PY, encoding="utf-8")
    args = [a.replace("PATH", str(corpus[case.name])).replace("OUT", str(out)).replace("MODELS", str(models))
            for a in TRUST_COMMANDS[command]]
    res = CliRunner().invoke(cli, args)
    assert not marker.exists(), f"{command} --trust ran the payload of {case.name}:\n{res.output}"
    assert res.exit_code in (1, 2), f"{command} --trust on {case.name}: exit {res.exit_code}\n{res.output}"
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in res.output, res.output
    assert _named(case, errors[0]), errors[0]


@pytest.mark.parametrize("case", DANGEROUS_CASES, ids=lambda c: c.name)
def test_trust_never_runs_a_gadget_api(case: adversarial.Case, corpus: dict[str, Path], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "marker"
    monkeypatch.setenv(adversarial.MARKER_ENV, str(marker))
    for name, call in _api_calls(corpus[case.name], tmp_path).items():
        with pytest.raises(CkptError) as ei:
            call()
        assert not marker.exists(), f"{name}(trust=True) ran the payload of {case.name}"
        assert _named(case, str(ei.value)), (name, ei.value)
        if not case.name.startswith(("folder-", "tar-")):
            assert isinstance(ei.value, UnsafeCheckpointError) and len(str(ei.value).splitlines()) == 1


def test_trust_refusal_names_global_and_member(corpus: dict[str, Path]) -> None:
    with pytest.raises(UnsafeCheckpointError) as ei:
        load_checkpoint(corpus["basic-zip"], trust=True)
    assert "os.system in archive/data.pkl is rated DANGEROUS" in str(ei.value)
    assert ei.value.globals == ["os.system"]


def test_find_class_refuses_a_gadget_the_scan_did_not_see(corpus: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Defence in depth: with the scan gate switched off, the unpickler handed to torch.load still refuses the
    gadget in find_class, before importing its module."""
    marker = tmp_path / "marker"
    monkeypatch.setenv(adversarial.MARKER_ENV, str(marker))
    monkeypatch.setattr(loaders, "refuse_dangerous", lambda _t: None)
    monkeypatch.setattr(loaders, "refuse_gadgets", lambda *_a: None)
    for name in ("basic-zip", "basic-legacy", "basic-plain-pickle-p4", "zip-case-only-upper"):
        with pytest.raises(UnsafeCheckpointError, match=r"(os|posix)\.system (in .*)?is rated DANGEROUS"):
            load_checkpoint(corpus[name], trust=True)
        assert not marker.exists(), name


def test_guarded_unpickler_alone() -> None:
    evil = adversarial.marker_pickle(2)
    with pytest.raises(trusted.GadgetRefused, match=r"(os|posix)\.system"):
        trusted.GUARDED.loads(evil)
    assert trusted.GUARDED.loads(pickle.dumps({"a": [1, 2.0]})) == {"a": [1, 2.0]}


class TrustNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)


def test_needs_trust_classes_still_load(tmp_path: Path) -> None:
    """A full-model torch.save (a class of this module, DataParallel) and an argparse.Namespace load with trust."""
    net = TrustNet()
    path = tmp_path / "full.pth"
    torch.save({"model": torch.nn.DataParallel(net), "args": argparse.Namespace(lr=0.1)}, path)
    obj, _saved = load_checkpoint(path, trust=True)
    assert isinstance(obj["model"], torch.nn.DataParallel) and obj["args"].lr == 0.1
    assert torch.equal(obj["model"].module.fc.weight, net.fc.weight)
    legacy = tmp_path / "legacy.pth"
    torch.save(net, legacy, _use_new_zipfile_serialization=False)
    report = ckptool.load_into(TrustNet(), legacy, trust=True)
    assert report.loaded == 2
    with pytest.raises(UnsafeCheckpointError):  # and without trust, as before
        load_checkpoint(path)


def test_trusted_dcp_record_refuses_the_gadget_in_find_class() -> None:
    buf = io.BytesIO(adversarial.marker_pickle(2))
    with pytest.raises(trusted.GadgetRefused):
        torch.load(buf, weights_only=False, pickle_module=trusted.GUARDED)
