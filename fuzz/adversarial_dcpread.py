"""Adversarial cases for the DCP tensor reader (:mod:`ckptool.readers.read_dcp`, which ``diff`` reads DCP folders
through): a tensor entry whose ``torch.save`` record carries the marker payload instead of a tensor.

DCP's ``FileSystemReader`` reads a tensor record with ``torch.load(weights_only=True)``, which refuses the payload's
``os.system``, so no loader runs it (``loader`` None); the cases check that ckptool, which reads the record's
``data.pkl`` as a node graph, never runs it either and refuses the record (its globals are outside the
``weights_only`` allowlist, and it is not one tensor). Each ``make`` imports torch.
"""

from __future__ import annotations

import io
import os
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from adversarial import Case, marker_pickle  # noqa: E402
from adversarial_dcp import _dcp_base, _load_meta, _rewrite_metadata  # noqa: E402


def _replace_record(folder: Path, fqn: str, data: bytes) -> Path:
    """Append ``data`` to the ``.distcp`` file of tensor ``fqn``'s record and point the record at it."""
    meta = _load_meta(folder)
    sd = meta.storage_data  # type: ignore[attr-defined]
    info = sd[next(i for i in sd if i.fqn == fqn)]
    with open(folder / info.relative_path, "ab") as f:
        offset = f.seek(0, os.SEEK_END)
        f.write(data)
    info.offset, info.length = offset, len(data)
    _rewrite_metadata(folder, meta)
    return folder


def make_tensor_record_zip_gadget(folder: Path) -> Path:
    """Tensor ``w``'s record is a torch-zip layout whose ``data.pkl`` is the payload (protocol 2)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", marker_pickle(2))
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return _replace_record(_dcp_base(folder), "w", buf.getvalue())


def make_tensor_record_bare_gadget(folder: Path) -> Path:
    """Tensor ``w``'s record is the bare payload pickle (no zip: ``torch.load`` would read it as a legacy file)."""
    return _replace_record(_dcp_base(folder), "w", marker_pickle(2))


CASES: list[Case] = [
    Case("dcp-tensor-record-zip-gadget", "dcp tensor record holding a payload", make_tensor_record_zip_gadget,
         "dangerous"),
    Case("dcp-tensor-record-bare-gadget", "dcp tensor record holding a payload", make_tensor_record_bare_gadget,
         "dangerous"),
]
