"""Start-up: each command imports only what it runs.

A command runs in a subprocess (``python -c`` calling :func:`ckptool.cli.main`) that prints, at exit, the
``ckptool`` modules and the third-party top-level packages in ``sys.modules``; the test pins that set for a safe
``scan`` of one torch zip file (no load hint, no inspect report, no DCP folder reading, no DeepSpeed or sharded-set
code, no table printer), so that a new import on scan's path is a decision someone makes, with this test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: prints the modules loaded when the command exits (atexit runs after main() returns, before shutdown)
_PROBE = r"""
import atexit, json, sys
def _report():
    mods = sorted(sys.modules)
    sys.__stderr__.write("MODULES " + json.dumps(mods) + "\n")
atexit.register(_report)
sys.argv = ["ckptool", *sys.argv[1:]]
from ckptool.cli import main
main()
"""

#: every ckptool module a safe ``scan`` of one torch zip file loads: the CLI frame, the scan operation with its
#: pickle, zip and safetensors readers, the allowlist and the graph walk, the DCP dispatch (scan_file takes a
#: DCP folder too, and ``ops.scan`` imports its folder scanner), the code finder (native headers: every zip is
#: looked at for libraries; torch.package module names) and the folder walk's readers of DeepSpeed ``latest``
#: files and sharded indexes (about 3 ms together: ``formats.deepspeed`` reads rank files through
#: ``formats.torchfile``)
SCAN_ZIP_MODULES = {
    "ckptool", "ckptool._gc", "ckptool._remote", "ckptool._source", "ckptool.errors",
    "ckptool.cli", "ckptool.cli._common", "ckptool.cli._errors", "ckptool.cli._flags", "ckptool.cli.scan",
    "ckptool.formats", "ckptool.formats.dcp", "ckptool.formats.detect", "ckptool.formats.dtypes",
    "ckptool.formats.deepspeed", "ckptool.formats.native", "ckptool.formats.sharded", "ckptool.formats.torchfile",
    "ckptool.formats.torch_package",
    "ckptool.formats.nodes", "ckptool.formats.pickle_check", "ckptool.formats.pt2", "ckptool.formats.safetensors",
    "ckptool.formats.strided", "ckptool.formats.tensors", "ckptool.formats.unpickler", "ckptool.formats.zipdir",
    "ckptool.model", "ckptool.model.allowlist", "ckptool.model.devices", "ckptool.model.graph",
    "ckptool.model.units", "ckptool.model.weights_only",
    "ckptool.ops", "ckptool.ops.scan", "ckptool.ops.scan.entry", "ckptool.ops.scan.byte_windows",
    "ckptool.ops.scan.shipped_code", "ckptool.ops.scan.dcp", "ckptool.ops.scan.directories",
    "ckptool.ops.scan.layouts",
    "ckptool.ops.scan.pickles",
    "ckptool.ops.scan.results", "ckptool.ops.scan.sarif", "ckptool.ops.scan.tar",
}


def loaded_modules(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``ckptool ARGS`` in a fresh interpreter (this checkout first on ``PYTHONPATH``); return the process and
    the names in its ``sys.modules`` at exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], check=False, capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("MODULES ")]
    assert line, proc.stderr
    return proc, set(json.loads(line[-1][len("MODULES "):]))


def test_safe_scan_of_one_zip_file_imports_only_the_scan_code(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "sd.pt"
    torch.save({"w": torch.zeros(4), "b": torch.ones(2, dtype=torch.float16)}, path)
    proc, mods = loaded_modules(["scan", str(path)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "safe (torch-zip" in proc.stdout
    ours = {m for m in mods if m == "ckptool" or m.startswith("ckptool.")}
    assert ours == SCAN_ZIP_MODULES, (f"new: {sorted(ours - SCAN_ZIP_MODULES)}; "
                                      f"gone: {sorted(SCAN_ZIP_MODULES - ours)}")
    # nor the heavy third-party packages: torch, numpy, the table printer, the progress bar, fsspec
    assert not {"torch", "numpy", "tabulate", "tqdm", "fsspec", "safetensors", "jinja2"} & mods


@pytest.mark.torchfree
def test_top_level_help_imports_no_command(tmp_path: Path) -> None:
    proc, mods = loaded_modules(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not {m for m in mods if m.startswith(("ckptool.ops", "ckptool.formats", "ckptool.model"))}
