"""Start-up: each command imports only what it runs.

A command runs in a subprocess (``python -c`` calling :func:`ckptool.cli.main`) that prints, at exit, the
``ckptool`` modules and the third-party top-level packages in ``sys.modules``; the test pins that set for a safe
``scan`` and for an ``inspect`` of one torch zip file (no load hint, no .pt2, DCP, DeepSpeed, sharded-set,
safetensors or torch.package code, no SARIF writer), so that a new import on their path is a decision someone
makes, with this test.
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
#: zip and pickle walk (the zip directory, the restricted unpickler, the allowlist and the graph walk), the code
#: finder (every zip member outside the tensor records is looked at for a native library's first bytes) and the
#: legacy tar walk the pickle scanner shares. The code of the other formats (.pt2, DCP, DeepSpeed, sharded sets,
#: safetensors, torch.package, native library headers) and of SARIF output is named as strings and imported only
#: when met (:func:`ckptool.formats.plugin`); issue 41 took this set from 45 modules to 33; the tensor model
#: (``formats.tensors``) came back with issue 36's note on tensors that expand past the input's budget, and went
#: again when that budget's two numbers moved to ``formats.dtypes`` (issue 52: its dataclasses, 2 ms); issue 46
#: added the one verdict (``model.verdict``); issue 49 the name checks of configs that make a loader run code
#: (``scanning.configs``: NeMo's Hydra targets and a transformers ``auto_map``, by name), asked of every file a
#: scan meets; ``_ranges`` is the range store split out of ``_remote``, ``formats.pickle_stack`` the
#: C stack sizing split out of ``formats.pickle_check`` (the same code as before, in modules under 600 lines);
#: ``scanning.wrappers``, ``scanning.legacy_stream`` and ``scanning.key_paths``: the base classes and key path walk
#: of the pickle scanner, split out of ``scanning.pickles`` (the same code, in modules under 600 lines);
#: ``scanning.targets``: what a scan reads for its paths, split out of ``scanning.entry`` (the same code).
SCAN_ZIP_MODULES = {
    "ckptool", "ckptool._gc", "ckptool._ranges", "ckptool._remote", "ckptool._source", "ckptool.errors",
    "ckptool.cli", "ckptool.cli._common", "ckptool.cli._errors", "ckptool.cli._flags", "ckptool.cli.scan",
    "ckptool.formats", "ckptool.formats.detect", "ckptool.formats.dtypes", "ckptool.formats.nodes",
    "ckptool.formats.pickle_check", "ckptool.formats.pickle_stack",
    "ckptool.formats.unpickler",
    "ckptool.formats.zipdir", "ckptool.model", "ckptool.model.allowlist", "ckptool.model.devices",
    "ckptool.model.graph", "ckptool.model.units", "ckptool.model.verdict", "ckptool.model.weights_only",
    "ckptool.scanning", "ckptool.scanning.entry", "ckptool.scanning.byte_windows",
    "ckptool.scanning.configs", "ckptool.scanning.directories", "ckptool.scanning.layouts",
    "ckptool.scanning.pickles",
    "ckptool.scanning.results", "ckptool.scanning.shipped_code", "ckptool.scanning.tar",
    "ckptool.scanning.key_paths", "ckptool.scanning.legacy_stream", "ckptool.scanning.wrappers",
    "ckptool.scanning.targets",
}

#: every ckptool module ``inspect`` of one torch zip file loads: scan's (its safety analysis is scan's, less the
#: scan command) and the readers layer with the torch zip reader, the node graph walks, the tensor model, the
#: inspect operation (describer of pickled files, totals, values, advice) and the printers it needs. The other
#: formats' readers and describers are registry plug-ins, imported when met, and so are the module tree and its
#: HTML (``--tree``, Jupyter); issue 41 took this set from 73 modules to 54; issue 46 added the reader base class
#: (``readers.reader``: the torch zip's ``PickledReader`` derives from it); issue 48 the quantization schemes
#: (``model.quantization``: inspect names a checkpoint's scheme from its tensors' layout). Since the scan engine moved
#: to ``ckptool.scanning`` (issue 46), a scan of one file imports no ``ckptool.ops`` module at all.
INSPECT_ZIP_MODULES = (SCAN_ZIP_MODULES - {"ckptool.cli.scan"}) | {
    "ckptool.cli.inspect",
    "ckptool.formats.segments", "ckptool.formats.strided", "ckptool.formats.tensors", "ckptool.formats.torchfile",
    "ckptool.model.keys", "ckptool.model.nonstrided", "ckptool.model.numpy_nodes", "ckptool.model.paths",
    "ckptool.model.quantization",
    "ckptool.model.values",
    "ckptool.ops", "ckptool.ops.inspect", "ckptool.ops.inspect.advice", "ckptool.ops.inspect.entry",
    "ckptool.ops.inspect.info",
    "ckptool.ops.inspect.json_rows", "ckptool.ops.inspect.pickles", "ckptool.ops.inspect.totals",
    "ckptool.ops.inspect.values",
    "ckptool.readers", "ckptool.readers.read_torch", "ckptool.readers.reader", "ckptool.readers.registry",
    "ckptool.readers.support",
}

#: the third-party packages neither command imports: torch, numpy, the table printer, the progress bar, fsspec;
#: and the standard library's modules that only a tar archive or a remote file needs (tarfile, tempfile and shutil
#: import bz2, lzma, random...: a few milliseconds of a start-up of about a hundred)
HEAVY = {"torch", "numpy", "tabulate", "tqdm", "fsspec", "safetensors", "jinja2", "tarfile", "tempfile", "shutil"}


def loaded_modules(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``ckptool ARGS`` in a fresh interpreter (this checkout first on ``PYTHONPATH``); return the process and
    the names in its ``sys.modules`` at exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], check=False, capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("MODULES ")]
    assert line, proc.stderr
    return proc, set(json.loads(line[-1][len("MODULES "):]))


def _torch_zip(tmp_path: Path) -> Path:
    torch = pytest.importorskip("torch")
    path = tmp_path / "sd.pt"
    torch.save({"w": torch.zeros(4), "b": torch.ones(2, dtype=torch.float16)}, path)
    return path


def _ours(mods: set[str]) -> set[str]:
    return {m for m in mods if m == "ckptool" or m.startswith("ckptool.")}


def _diff(ours: set[str], pinned: set[str]) -> str:
    return f"new: {sorted(ours - pinned)}; gone: {sorted(pinned - ours)}"


def test_safe_scan_of_one_zip_file_imports_only_the_scan_code(tmp_path: Path) -> None:
    path = _torch_zip(tmp_path)
    proc, mods = loaded_modules(["scan", str(path)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "safe (torch-zip" in proc.stdout
    ours = _ours(mods)
    assert ours == SCAN_ZIP_MODULES, _diff(ours, SCAN_ZIP_MODULES)
    assert not HEAVY & mods


def test_inspect_of_one_zip_file_imports_only_the_zip_reader(tmp_path: Path) -> None:
    path = _torch_zip(tmp_path)
    for args in (["inspect", str(path)], ["inspect", "--json", str(path)]):
        proc, mods = loaded_modules(args, tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "torch-zip" in proc.stdout
        ours = _ours(mods)
        assert ours == INSPECT_ZIP_MODULES, f"{args}: {_diff(ours, INSPECT_ZIP_MODULES)}"
        # the text report prints its tables with tabulate, which imports shutil and tempfile
        allowed = set() if "--json" in args else {"tabulate", "shutil", "tempfile"}
        assert not (HEAVY - allowed) & mods, sorted((HEAVY - allowed) & mods)


@pytest.mark.torchfree
def test_top_level_help_imports_no_command(tmp_path: Path) -> None:
    proc, mods = loaded_modules(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not {m for m in mods if m.startswith(("ckptool.ops", "ckptool.formats", "ckptool.model"))}
