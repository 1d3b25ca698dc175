"""Every command on every case of the adversarial corpus (``fuzz/adversarial.py``): the marker payload never runs,
and ``scan`` gives the verdict the case names.

Each case carries a payload that runs ``touch "$CKPTOOL_MARKER"`` under an unrestricted unpickler. A test sets
``CKPTOOL_MARKER`` to a fresh path, runs one ckptool command (in this process, through Click's runner, so that a
payload run anywhere in ckptool, torch included, would create the file), then asserts that the file does not exist,
that the command ended without an internal error (exit 3) or a traceback, and for ``scan`` that the exit status is
the verdict's. Where a case names its normal loader, :func:`test_loader_runs_the_payload` shows that the payload is
live: the loader (in a subprocess) does create the marker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))

import adversarial

from ckptool.cli import cli

CASES = adversarial.cases()

#: scan's exit status for each verdict (docs/commands/scan.md)
SCAN_STATUS = {"safe": 0, "dangerous": 1, "refused": 2, "needs-trust": 4}

MODELS_PY = "import torch\n\ndef build():\n    return torch.nn.Linear(2, 2)\n"

#: command name -> argument list; PATH, OUT and MODELS are replaced per run
COMMANDS: dict[str, list[str]] = {
    "inspect": ["inspect", "PATH"],
    "inspect-json": ["inspect", "PATH", "--json"],
    "scan": ["scan", "PATH"],
    "remap": ["remap", "PATH", "--to", "cpu", "-o", "OUT/remap.pth"],
    "strip-dataparallel": ["strip-dataparallel", "PATH", "-o", "OUT/strip.pth"],
    "unwrap": ["unwrap", "PATH", "-o", "OUT/unwrap.pth"],
    "convert-safetensors": ["convert", "PATH", "-o", "OUT/conv.safetensors"],
    "convert-pt": ["convert", "PATH", "-o", "OUT/conv.pt"],
    "diff": ["diff", "PATH", "PATH"],
    "sanitize": ["sanitize", "PATH", "-o", "OUT/san.pth"],
    "extract-state-dict": ["extract-state-dict", "PATH", "-o", "OUT/sd.pth"],
    "verify": ["verify", "PATH", "--model", "MODELS:build", "--device", "cpu", "--no-strict"],
    "rename": ["rename", "PATH", "--rule", "^=x.", "--allow-unused", "-o", "OUT/rename.pth"],
    "filter": ["filter", "PATH", "--drop", "zzz*", "--allow-unused", "-o", "OUT/filter.pth"],
    "average": ["average", "PATH", "PATH", "-o", "OUT/average.pth"],
    "report": ["report", "PATH", "-o", "OUT/report.html"],
    "report-compare": ["report", "PATH", "PATH", "-o", "OUT/compare.html"],
    "inspect-tree": ["inspect", "PATH", "--tree"],
}


def _ids(case: adversarial.Case) -> str:
    return case.name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case written once, name -> input path."""
    root = tmp_path_factory.mktemp("adversarial")
    return {case.name: path for case, path in adversarial.write(root)}


def _run(args: list[str], marker: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.setenv(adversarial.MARKER_ENV, str(marker))
    result = CliRunner().invoke(cli, args, catch_exceptions=True)
    output = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        output += f"\n<exception {type(result.exception).__name__}: {result.exception}>"
    return result.exit_code, output


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_no_command_runs_the_payload(case: adversarial.Case, command: str, corpus: dict[str, Path],
                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.commands is not None and command not in case.commands:
        pytest.skip(f"{case.name} is not a {command} case")
    out = tmp_path / "out"
    out.mkdir()
    models = tmp_path / "adversarial_model.py"
    models.write_text(MODELS_PY, encoding="utf-8")
    marker = tmp_path / "marker"
    args = [a.replace("PATH", str(corpus[case.name])).replace("OUT", str(out)).replace("MODELS", str(models))
            for a in COMMANDS[command]]
    code, output = _run(args, marker, monkeypatch)
    assert not marker.exists(), f"{command} ran the payload of {case.name} ({case.klass}):\n{output}"
    assert "Traceback" not in output, output
    assert code != 3, f"internal error in {command} on {case.name}:\n{output}"
    if command == "scan":
        assert code == SCAN_STATUS[case.verdict], f"scan of {case.name} ({case.klass}): exit {code}\n{output}"
        if case.verdict != "refused":
            assert case.verdict.split("-")[0].upper() in output.upper(), output


LOADER_CASES = [c for c in CASES if c.loader]


@pytest.mark.parametrize("case", LOADER_CASES, ids=_ids)
def test_loader_runs_the_payload(case: adversarial.Case, corpus: dict[str, Path], tmp_path: Path) -> None:
    """The fixture is live: its normal loader (run in a subprocess, errors ignored) creates the marker."""
    assert case.loader is not None
    marker = tmp_path / "marker"
    body = textwrap.indent(case.loader, "    ")
    code = f"PATH = {str(corpus[case.name])!r}\ntry:\n{body}\nexcept BaseException:\n    pass\n"
    env = {**os.environ, adversarial.MARKER_ENV: str(marker)}
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300, check=False, cwd=tmp_path)
    assert marker.exists(), f"the loader of {case.name} did not run the payload: the fixture is not live"


def test_every_case_names_a_known_verdict() -> None:
    assert all(c.verdict in SCAN_STATUS for c in CASES)
    assert all(c.verdict != "needs-trust" or c.reason for c in CASES)
