"""Adversarial cases for the torch.package reader (``ckptool/readers/read_package.py``): now that ``convert``,
``diff`` and ``average`` read a package's tensors, a package whose pickles hold the payload must still run nothing.

Each archive is written byte by byte with ``zipfile`` (stored members under one top folder, as
``PackageExporter`` writes them): ``.data/extern_modules`` naming ``os`` (the module ``PackageImporter`` then lets
a pickle import), ``.data/version``, a storage record, and the pickles. ``loader``: ``PackageImporter.load_pickle``,
which runs the payload.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

from adversarial import Case, marker_pickle

_LOADER = "from torch.package import PackageImporter\nPackageImporter(PATH).load_pickle('model', 'state_dict.pkl')"


def _archive(path: Path, pickles: dict[str, bytes]) -> Path:
    """A torch.package archive at ``path`` holding ``pickles`` (member below the top folder -> bytes), with one
    12-byte storage record ``.data/0.storage``."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in {".data/extern_modules": b"torch\ncollections\nos\n", ".data/version": b"6\n",
                           ".data/0.storage": bytes(12), **pickles}.items():
            z.writestr(f"package/{name}", data)
    return path


def make_payload_member(folder: Path) -> Path:
    """The pickle ``model/state_dict.pkl`` is the payload itself."""
    return _archive(folder / "package.pt", {"model/state_dict.pkl": marker_pickle(2)})


def make_payload_beside_state_dict(folder: Path) -> Path:
    """``model/config.pkl`` is the payload; ``model/state_dict.pkl`` a plain mapping of one float32 tensor."""
    return _archive(folder / "package.pt", {"model/state_dict.pkl": _state_dict_pickle(),
                                            "model/config.pkl": marker_pickle(2)})


def _state_dict_pickle() -> bytes:
    """``{"w": tensor}`` as PackageExporter pickles it: ``_rebuild_tensor_v2`` over the persistent id
    ``('storage', torch.FloatStorage, '0', 'cpu', 3)``, written opcode by opcode (protocol 2)."""
    out = bytearray(b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01")
    out += b"ctorch._utils\n_rebuild_tensor_v2\nq\x02("  # GLOBAL, MARK
    out += b"(X\x07\x00\x00\x00storageq\x03ctorch\nFloatStorage\nq\x04X\x01\x00\x00\x000q\x05"
    out += b"X\x03\x00\x00\x00cpuq\x06K\x03tq\x07Q"  # the id tuple, BINPERSID
    out += b"K\x00K\x03\x85q\x08K\x01\x85q\x09\x89ccollections\nOrderedDict\nq\x0a)Rq\x0btq\x0cRq\x0d"
    out += pickle.SETITEM + pickle.STOP
    return bytes(out)


CASES: list[Case] = [
    Case("pkgread-payload-member", "torch.package pickle that is the payload", make_payload_member,
         loader=_LOADER),
    Case("pkgread-payload-beside-state-dict", "torch.package payload pickle beside a state_dict",
         make_payload_beside_state_dict,
         loader="from torch.package import PackageImporter\nPackageImporter(PATH).load_pickle('model', 'config.pkl')"),
]
