"""The scan verdicts of every corpus in the repository, recorded once from the main branch's code into
``tests/data/scan_verdicts.json`` (issue 52: the skipping opcode walk must not change a verdict).

Run as a script to record them again (only when a verdict is meant to change)::

    PYTHONPATH=. python tests/verdict_corpus.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECORD = HERE / "data" / "scan_verdicts.json"
for _p in (ROOT / "fuzz", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def corpus_paths(folder: Path) -> dict[str, Path]:
    """Every input of the hostile corpus (``fuzz/hostile_corpus.py``), the adversarial corpus
    (``fuzz/adversarial*.py``) and ``fixtures/real``, written under ``folder``: name -> path."""
    import adversarial
    import hostile_corpus as hc

    out: dict[str, Path] = {}
    for e, p in hc.write(folder / "hostile"):
        out[f"hostile/{e.name}"] = p
    for case, p in adversarial.write(folder / "adversarial"):
        out[f"adversarial/{case.name}"] = p
    blobs = folder / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for name, data in blob_pickles().items():
        (blobs / name).write_bytes(data)
        out[f"blobs/{name}"] = blobs / name
    for p in sorted((ROOT / "fixtures" / "real").iterdir()):
        if p.suffix != ".md":
            out[f"real/{p.name}"] = p
    return out


def blob_pickles() -> dict[str, bytes]:
    """Plain pickles whose payload is mostly blobs (bytes, bytearray, long strings, tensors pickled through
    ``torch.storage._load_from_bytes``), clean and with a gadget among the blobs, in protocols 2 to 5."""
    import collections
    import pickle

    import hostile_corpus as hc
    import torch

    out: dict[str, bytes] = {}
    blob = bytes(range(256)) * 600  # 150 KiB: over every small-string path
    for proto in (2, 3, 4, 5):
        d = collections.OrderedDict((f"b{i}", blob[i:]) for i in range(4))
        d["arr"] = bytearray(blob)
        d["text"] = "x" * 70000
        out[f"blobs-p{proto}.pkl"] = pickle.dumps(d, protocol=proto)
        torch.manual_seed(proto)
        out[f"tensors-p{proto}.pkl"] = pickle.dumps({"w": torch.randn(64, 300), "b": torch.zeros(7)}, protocol=proto)
    gadget = hc.gadget_pickle("os", "system", "touch /tmp/ckptool-pwned", 4)
    # a gadget pickle after a list of blobs (protocol 4: a PROTO and FRAMEs of its own in the middle)
    head = pickle.dumps([blob, blob], protocol=4)
    out["blobs-then-gadget.pkl"] = head[:-1] + b"0" + gadget[2:]
    out["gadget-then-blobs.pkl"] = gadget + pickle.dumps([blob] * 3, protocol=4)
    return out


def verdicts(paths: dict[str, Path]) -> dict[str, dict[str, object]]:
    """``scan_file`` of each path: its verdict and the globals found with their status (``--strict`` is a policy on
    the verdict since issue 46, so the record's former ``strict`` column is derived, not kept)."""
    from ckptool.scanning.entry import scan_file

    out: dict[str, dict[str, object]] = {}
    for name, p in sorted(paths.items()):
        try:
            res = scan_file(p)
        except Exception as e:  # a refusal (an Error: line) is a verdict too
            out[name] = {"verdict": f"raised {type(e).__name__}"}
            continue
        out[name] = {"verdict": str(res.verdict),
                     "globals": sorted(f"{g.name} {g.status}" for g in res.globals)}
    return out


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        got = verdicts(corpus_paths(Path(tmp)))
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    print(f"{len(got)} verdicts in {RECORD}")
