"""Every input the fuzzers (``tests/test_fuzz.py``, ``fuzz/fuzz_readers.py``) found that made a reader raise
something other than :class:`ckptool.errors.CkptError`: kept as small fixtures, run by
``tests/test_fuzz.py::test_fuzz_regressions`` so that the fix stays fixed.

Add a :class:`Case` for each new crash: its ``kind`` says where the bytes go (``file``: a file read by every
single-file reader; ``index``: a sharded set's ``model.safetensors.index.json`` beside two real shards; ``dcp``: the
``.metadata`` of a DCP folder) and ``found`` says what it raised before the fix.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


def safetensors_bytes(tensors: dict[str, int]) -> bytes:
    """A safetensors file of zero float32 vectors ``name -> length`` (also the fuzzers' sharded-set shards)."""
    header = {}
    pos = 0
    for name, n in tensors.items():
        header[name] = {"dtype": "F32", "shape": [n], "data_offsets": [pos, pos + 4 * n]}
        pos += 4 * n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(pos)


@dataclass(frozen=True)
class Case:
    """One regression: ``name``, where it goes (``kind``), its bytes, and what it raised before the fix."""

    name: str
    kind: str
    data: bytes
    found: str

    def check(self, workdir: Path, fuzz_readers: ModuleType) -> None:
        """Write the case into ``workdir`` and run the readers of its kind (raises ``fuzz_readers.ReaderBug``)."""
        folder = workdir / f"regression-{self.name}"
        folder.mkdir(exist_ok=True)
        if self.kind == "file":
            path = folder / "case.pt"
            path.write_bytes(self.data)
            fuzz_readers.check_file(str(path))
            return
        if self.kind == "index":
            (folder / "model-00001-of-00001.safetensors").write_bytes(safetensors_bytes({"a": 2}))
            path = folder / "model.safetensors.index.json"
            path.write_bytes(self.data)
        else:
            (folder / ".metadata").write_bytes(self.data)
            path = folder
        fuzz_readers.check_file(str(path), which=fuzz_readers.set_readers())


CASES = [
    Case("index-deep-json", "index", b"[" * 100_000 + b"]" * 100_000,
         "RecursionError from json.load in formats/sharded.read_index"),
    Case("index-huge-number", "index", b'{"weight_map": {}, "metadata": {"total_size": ' + b"9" * 5000 + b"}}",
         "ValueError (integer string conversion limit) from json.load in formats/sharded.read_index"),
]
