"""The plainest live payloads, as a baseline for the other ``adversarial_*`` modules: a torch zip and a legacy
stream whose main pickle runs the marker, and a plain pickle named like a checkpoint."""

from __future__ import annotations

from pathlib import Path

import hostile_corpus as hc
from adversarial import Case, marker_pickle

TORCH_LOAD = "import torch\ntorch.load(PATH, weights_only=False)"


def _writer(name: str, data: bytes):  # type: ignore[no-untyped-def]
    def make(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(data)
        return path
    return make


CASES: list[Case] = [
    Case("basic-zip", "payload in data.pkl", _writer("model.pth", hc.torch_zip(marker_pickle(2))), loader=TORCH_LOAD),
    Case("basic-legacy", "payload in a legacy stream", _writer("model.pt", hc.legacy_stream(marker_pickle(2))),
         loader=TORCH_LOAD),
    Case("basic-plain-pickle-p4", "plain pickle, protocol 4", _writer("model.bin", marker_pickle(4)),
         loader="import pickle\npickle.load(open(PATH, 'rb'))"),
]
