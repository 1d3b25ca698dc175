"""ckptool's prediction of ``torch.load(weights_only=True)`` (:func:`ckptool.model.allowlist.is_allowed`, the data of
:mod:`ckptool.model.weights_only`) held to torch's own verdict, global by global.

For every global a list of :mod:`ckptool.model.allowlist` names (torch's allowlist as ckptool keeps it, the
needs-trust and dangerous names, DCP's metadata classes and ``pathlib`` paths, TorchScript's builders, accelerate's
safe globals), a tiny torch zip file whose ``data.pkl`` is ``GLOBAL module name; STOP`` is loaded with
``torch.load(weights_only=True)`` in a fresh interpreter that imports nothing but torch (importing
``torch.distributed.tensor`` would add safe globals): torch accepts it exactly when ckptool predicts it does.
Nothing is called: ``GLOBAL`` only looks the name up, and torch refuses a name before importing anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from ckptool.model.allowlist import (
    ACCELERATE_SAFE_GLOBALS,
    DANGEROUS_NAMES,
    DCP_GLOBALS,
    NEEDS_TRUST_NAMES,
    TORCHSCRIPT_NAMES,
    is_allowed,
)
from ckptool.model.weights_only import WEIGHTS_ONLY_ALLOWED

#: every global a list of ckptool names, besides torch's own allowlist
NAMED = sorted({*WEIGHTS_ONLY_ALLOWED, *NEEDS_TRUST_NAMES, *DANGEROUS_NAMES, *DCP_GLOBALS, *TORCHSCRIPT_NAMES,
                *ACCELERATE_SAFE_GLOBALS, "__main__.Net", "torch.nn.parallel.data_parallel.DataParallel",
                "torch.nn.modules.linear.Linear", "argparse.Namespace", "pathlib.PosixPath"})

_CHECK = """
import json, sys, torch
out = {}
for name, path in json.loads(sys.stdin.read()).items():
    try:
        torch.load(path, weights_only=True)
        out[name] = True
    except Exception as e:  # torch's UnpicklingError: "Unsupported global"
        # refused: torch's UnpicklingError ("Unsupported global", or for DTensor's records "torch.distributed.tensor
        # must be imported"); anything else is a fault of the test file
        out[name] = not isinstance(e, torch.serialization.pickle.UnpicklingError) and repr(e)
from torch import _weights_only_unpickler as w
safe = torch.serialization.get_safe_globals()
listed = {*w._get_allowed_globals(), *(f"{o.__module__}.{o.__qualname__}" for o in safe)}
print(json.dumps({"verdicts": out, "listed": sorted(listed)}))
"""


def _global_file(path: Path, name: str) -> None:
    """A torch zip file whose ``data.pkl`` pushes the global ``name`` and stops (protocol 2, ``GLOBAL``)."""
    module, _, qualname = name.rpartition(".")
    pickle = b"\x80\x02c" + module.encode() + b"\n" + qualname.encode() + b"\n."
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")


def test_torch_accepts_exactly_the_predicted_globals(tmp_path: Path) -> None:
    files = {}
    for i, name in enumerate(NAMED):
        files[name] = str(tmp_path / f"g{i}.pt")
        _global_file(Path(files[name]), name)
    run = subprocess.run([sys.executable, "-c", _CHECK], input=json.dumps(files), capture_output=True, text=True,
                         check=True, timeout=300)
    said = json.loads(run.stdout)
    assert set(said["listed"]) == WEIGHTS_ONLY_ALLOWED  # the list as torch 2.13 keeps it (model/weights_only.py)
    torch_says = said["verdicts"]
    errors = {n: v for n, v in torch_says.items() if isinstance(v, str)}
    assert not errors, errors  # refused for another reason than the global: the file itself is wrong
    wrong = {n: ("torch accepts" if torch_says[n] else "torch refuses") for n in NAMED
             if bool(torch_says[n]) != is_allowed(n)}
    assert not wrong, wrong
    assert torch_says["pathlib.PosixPath"] is False
    assert not any(torch_says[n] for n in DCP_GLOBALS)
