"""Code that ships inside a checkpoint, outside any pickle (the issue "scan and inspect report code that ships inside
a checkpoint"): an AOTInductor ``.pt2`` with a native library, a torch.package whose module its pickle imports, a
TorchScript archive calling a custom op, and native code hidden under another name in a nested zip.

The torch-made files are written by a fresh Python (``sys.executable``, which must have torch) in a subprocess, so
that neither torch nor the custom op is loaded into the process that builds the corpus, and without
``CKPTOOL_MARKER`` in its environment. The ``.pt2``'s library is compiled with the system C compiler when there is
one (its initialiser runs the marker, so ``aoti_load_package`` shows the payload is live); without a compiler it is
a bare ELF header, which scan must flag all the same (no loader is then given).
"""

from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import hostile_corpus as hc
from adversarial import MARKER_COMMAND, MARKER_ENV, Case

#: the C compiler used for the marker library, or None
CC = shutil.which("cc") or shutil.which("gcc")
#: the custom op the TorchScript case calls, registered only while it is made (and by its loader)
CUSTOM_OP = "ckptool_adversarial::touch"
_MARKER_C = ('#include <stdlib.h>\n'
             '__attribute__((constructor)) static void ckptool_marker(void) { system("touch \\"$'
             + MARKER_ENV + '\\""); }\n')
#: what a PackageExporter'd module runs when imported
PACKAGE_MODULE = f"import os\nos.system({MARKER_COMMAND!r})\n\n\nclass Thing:\n    pass\n"
#: the metadata aoti_load_package reads before it dlopens a packaged library (torch 2.13)
_AOTI_METADATA = b'{"AOTI_DEVICE_KEY": "cpu", "AOTI_PLATFORM": "linux", "AOTI_MACHINE": "x86_64"}'

_REGISTER_OP = f"""
import os, torch
torch.library.define({CUSTOM_OP!r}, "(Tensor x) -> Tensor")
@torch.library.impl({CUSTOM_OP!r}, "CPU")
def _touch(x):
    os.system({MARKER_COMMAND!r})
    return x
"""


def _python(code: str, *args: str, cwd: Path | None = None) -> None:
    """Run ``code`` in a fresh Python with ``args`` as ``sys.argv[1:]``, without the marker variable."""
    env = {k: v for k, v in os.environ.items() if k != MARKER_ENV}
    subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd, check=True, capture_output=True,
                   timeout=300)


def minimal_elf() -> bytes:
    """A 64-byte ELF64 header of an x86-64 shared library (``ET_DYN``), nothing else: what a scanner must see."""
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    return ident + struct.pack("<HHIQQQIHHHHHH", 3, 0x3E, 1, 0, 64, 0, 0, 64, 56, 0, 64, 0, 0)


def _marker_library(folder: Path) -> bytes:
    if CC is None:
        return minimal_elf()
    src, lib = folder / "marker.c", folder / "marker.so"
    src.write_text(_MARKER_C, encoding="utf-8")
    subprocess.run([CC, "-shared", "-fPIC", "-Os", "-o", str(lib), str(src)], check=True, capture_output=True,
                   timeout=120)
    data = lib.read_bytes()
    src.unlink()
    lib.unlink()
    return data


def make_aoti_pt2(folder: Path) -> Path:
    """A ``torch.export.save`` archive with an AOTInductor library added under ``data/aotinductor/model/``."""
    plain = folder / "plain.pt2"
    _python("import sys, torch\n"
            "class M(torch.nn.Module):\n    def forward(self, x):\n        return x + 1\n"
            "torch.export.save(torch.export.export(M(), (torch.zeros(2),)), sys.argv[1])\n", str(plain))
    path = folder / "model.pt2"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w") as out:
        top = src.namelist()[0].split("/", 1)[0]
        for info in src.infolist():
            out.writestr(info, src.read(info))
        out.writestr(f"{top}/data/aotinductor/model/m.wrapper.so", _marker_library(folder))
        out.writestr(f"{top}/data/aotinductor/model/m.wrapper_metadata.json", _AOTI_METADATA)
    plain.unlink()
    return path


def _package(folder: Path, *, referenced: bool) -> Path:
    """A torch.package archive: ``res/obj.pkl`` holds a tensor and, when ``referenced``, an instance of the
    package's module ``mymod`` (whose top-level code runs the marker); otherwise ``mymod`` is packaged by source
    and nothing names it."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "mymod.py").write_text(PACKAGE_MODULE, encoding="utf-8")
        path = folder / "package.pt"
        obj = "{'w': torch.zeros(3), 't': mymod.Thing()}" if referenced else "{'w': torch.zeros(3)}"
        _python("import sys, warnings, torch\nwarnings.simplefilter('ignore')\n"
                "from torch.package import PackageExporter\n"
                + ("import mymod\n" if referenced else "")
                + "with PackageExporter(sys.argv[1]) as e:\n"
                "    e.extern(['torch.**', 'collections', 'os'])\n"
                + ("    e.intern('mymod')\n" if referenced else
                   f"    e.save_source_string('mymod', {PACKAGE_MODULE!r})\n")
                + f"    e.save_pickle('res', 'obj.pkl', {obj})\n", str(path), cwd=Path(tmp))
    return path


def make_package_used(folder: Path) -> Path:
    return _package(folder, referenced=True)


def make_package_unused(folder: Path) -> Path:
    return _package(folder, referenced=False)


def make_custom_op_script(folder: Path) -> Path:
    """A traced module whose ``forward`` calls :data:`CUSTOM_OP` (printed as ``ops.ckptool_adversarial.touch``)."""
    path = folder / "scripted.pt"
    _python(_REGISTER_OP + "import sys\n"
            "class M(torch.nn.Module):\n"
            f"    def forward(self, x):\n        return torch.relu(torch.ops.{CUSTOM_OP.replace('::', '.')}(x))\n"
            "torch.jit.save(torch.jit.trace(M(), (torch.zeros(2),)), sys.argv[1])\n", str(path))
    return path


def make_nested_renamed_elf(folder: Path) -> Path:
    """A torch zip whose member ``extra.zip`` is a zip holding an ELF library named ``weights.bin``."""
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("weights.bin", minimal_elf() + bytes(256))
    path = folder / "model.pth"
    path.write_bytes(hc.torch_zip(hc.benign_pickle(), extra={"extra.zip": inner.getvalue()}))
    return path


CASES: list[Case] = [
    Case("code-aoti-library", "native library in an AOTInductor .pt2", make_aoti_pt2,
         loader="import torch\ntorch._inductor.aoti_load_package(PATH)" if CC else None),
    Case("code-package-module", "torch.package module its pickle imports", make_package_used,
         loader="from torch.package import PackageImporter\nPackageImporter(PATH).load_pickle('res', 'obj.pkl')"),
    Case("code-package-unused-module", "torch.package module nothing names", make_package_unused,
         verdict="needs-trust", reason="no pickle names the module, so load_pickle does not import it; importing "
                                       "it by hand would run it"),
    Case("code-torchscript-custom-op", "TorchScript calling a custom op", make_custom_op_script,
         loader=_REGISTER_OP + "torch.jit.load(PATH)(torch.zeros(2))"),
    Case("code-nested-renamed-elf", "native library under another name in a nested zip", make_nested_renamed_elf),
]
