"""Checkpoints written by transformers, huggingface_hub and accelerate (``fixtures/make_library_corpus.py``: tiny
models from configs, nothing downloaded), through inspect, inspect --json, remap --to cpu, convert, verify and
scan; every output compared with what the libraries (or torch.load / safetensors) read from the originals.

Skipped where transformers or accelerate is not installed (they are in the ``test`` extra)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_tensors, storage_groups

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import make_library_corpus

from ckptool import scan_file, verify


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_library_corpus.build(tmp_path_factory.mktemp("library"))


def _st(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _reference(path: Path) -> dict[str, torch.Tensor]:
    """The state_dict as the libraries' loaders read it: safetensors' load_file, torch.load for torch files."""
    if path.suffix == ".safetensors":
        return _st(path)
    return torch.load(path, weights_only=True)


#: every single file of the corpus that holds tensors: name -> path relative to the corpus
FILES = {"safetensors": "gpt2/model.safetensors", "torch-bin": "gpt2-bin/pytorch_model.bin",
         "torch-bin-shard": "gpt2-bin-sharded/pytorch_model-00002-of-00004.bin",
         "accelerate-model": "accelerate/model.safetensors", "accelerate-optimizer": "accelerate/optimizer.bin",
         "accelerate-scheduler": "accelerate/scheduler.bin"}
#: the sets: name -> folder
SETS = {"sharded-safetensors": "gpt2-sharded", "sharded-bin": "gpt2-bin-sharded"}


def _path(corpus: dict[str, Path], rel: str) -> Path:
    head, _, rest = rel.partition("/")
    return corpus[head] / rest if rest else corpus[head]


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a loaded object by dotted key, as ``ckptool inspect`` names them."""
    out: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out[key] = v
        else:
            out.update(_tensors(v, key))
    return out


@pytest.mark.parametrize("name", [*FILES])
def test_inspect_file(corpus: dict[str, Path], run_cli: Any, name: str) -> None:
    path = _path(corpus, FILES[name])
    ref = _tensors(_reference(path))
    r = run_cli("inspect", path)
    assert r.exit_code == 0, r.output
    assert f"{len(ref)} tensors" in r.output
    r = run_cli("inspect", "--json", path)
    d = json.loads(r.output)
    rows = {t["key"]: t for t in d["tensors"]}
    assert set(rows) == set(ref)
    for k, t in ref.items():
        assert (rows[k]["shape"], rows[k]["dtype"]) == (list(t.shape), str(t.dtype).removeprefix("torch.")), k
    assert d["security"]["verdict"] == "safe"


@pytest.mark.parametrize("name", [*SETS])
def test_inspect_set(corpus: dict[str, Path], run_cli: Any, name: str) -> None:
    folder = _path(corpus, SETS[name])
    index = json.loads(next(folder.glob("*.index.json")).read_text())
    r = run_cli("inspect", "--json", folder)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["format"] == name
    assert {t["key"] for t in d["tensors"]} == set(index["weight_map"])
    r = run_cli("inspect", folder)
    assert r.exit_code == 0 and f"Format:   {name}" in r.output


@pytest.mark.parametrize("name", ["torch-bin", "torch-bin-shard", "accelerate-optimizer", "accelerate-scheduler"])
def test_remap_to_cpu_equals_torch_load(corpus: dict[str, Path], tmp_path: Path, run_cli: Any, name: str) -> None:
    src = _path(corpus, FILES[name])
    out = tmp_path / "cpu.pt"
    r = run_cli("remap", src, "--to", "cpu", "-o", out)
    assert r.exit_code == 0, r.output
    before, after = torch.load(src, weights_only=True), torch.load(out, weights_only=True)
    assert_same_tensors(before, after)
    assert storage_groups(before) == storage_groups(after)


def test_bin_to_safetensors_loads_in_transformers(corpus: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    """``pytorch_model.bin`` (tied lm_head) -> ``model.safetensors``: transformers loads it into the same model."""
    from transformers import GPT2LMHeadModel

    folder = tmp_path / "converted"
    folder.mkdir()
    shutil.copy(corpus["gpt2"] / "config.json", folder)
    r = run_cli("convert", corpus["gpt2-bin"] / "pytorch_model.bin", "-o", folder / "model.safetensors")
    assert r.exit_code == 0, r.output
    ref = torch.load(corpus["gpt2-bin"] / "pytorch_model.bin", weights_only=True)
    st = _st(folder / "model.safetensors")
    for k, v in st.items():
        assert torch.equal(v, ref[k]), k
    loaded = GPT2LMHeadModel.from_pretrained(folder)
    sd = loaded.state_dict()
    for k, v in make_library_corpus.gpt2().state_dict().items():
        assert torch.equal(sd[k], v), k
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("name", [*SETS])
def test_set_to_one_safetensors(corpus: dict[str, Path], tmp_path: Path, run_cli: Any, name: str) -> None:
    out = tmp_path / "one.safetensors"
    r = run_cli("convert", _path(corpus, SETS[name]), "-o", out)
    assert r.exit_code == 0, r.output
    st = _st(out)
    ref = make_library_corpus.gpt2().state_dict()
    assert set(st) <= set(ref) and "transformer.wte.weight" in st
    for k, v in st.items():
        assert torch.equal(v, ref[k]), k


@pytest.mark.parametrize("name", ["safetensors", "accelerate-model"])
def test_safetensors_to_torch(corpus: dict[str, Path], tmp_path: Path, run_cli: Any, name: str) -> None:
    src = _path(corpus, FILES[name])
    out = tmp_path / "model.pth"
    r = run_cli("convert", src, "-o", out)
    assert r.exit_code == 0, r.output
    back = torch.load(out, weights_only=True)
    for k, v in _st(src).items():
        assert torch.equal(back[k], v) and back[k].dtype == v.dtype, k


def test_verify_into_the_transformers_model(corpus: dict[str, Path]) -> None:
    for path in (corpus["gpt2-bin"] / "pytorch_model.bin", corpus["gpt2-sharded"], corpus["gpt2"]):
        report = verify(make_library_corpus.gpt2, path, device="cpu")
        assert report.ok, (path, report)


def test_accelerate_optimizer_convert_names_what_is_left(corpus: dict[str, Path], tmp_path: Path,
                                                         run_cli: Any) -> None:
    """An optimizer state_dict holds no model state_dict: convert says so instead of guessing."""
    r = run_cli("convert", corpus["accelerate"] / "optimizer.bin", "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 1 and "Error: " in r.output and "state_dict" in r.output


@pytest.mark.parametrize("rel", [*FILES.values()])
def test_scan_safe(corpus: dict[str, Path], rel: str) -> None:
    res = scan_file(_path(corpus, rel))
    assert res.verdict == "safe", (rel, [(g.name, g.status) for g in res.globals], res.error)


@pytest.mark.parametrize("folder", ["gpt2", "gpt2-sharded", "gpt2-bin-sharded"])
def test_scan_model_folders_safe(corpus: dict[str, Path], run_cli: Any, folder: str) -> None:
    r = run_cli("scan", corpus[folder])
    assert r.exit_code == 0, r.output


def test_scan_accelerate_rng_state_does_not_crash(corpus: dict[str, Path], run_cli: Any) -> None:
    res = scan_file(corpus["accelerate"] / "random_states_0.pkl")
    assert res.error is None and res.readable
    assert res.verdict in ("safe", "needs-trust", "dangerous")
    r = run_cli("scan", corpus["accelerate"] / "random_states_0.pkl")
    assert r.exit_code in (0, 1, 4), r.output


def test_scan_accelerate_rng_state_needs_trust(corpus: dict[str, Path]) -> None:
    """accelerate's numpy RNG state is a known library type: needs trust, not dangerous (model/allowlist)."""
    res = scan_file(corpus["accelerate"] / "random_states_0.pkl")
    assert res.verdict == "needs-trust" and res.recognised is not None
