"""Megatron-LM / Megatron-Core checkpoints (issue 40): a legacy ``mp_rank_XX`` tree consolidated to its known full
weights bit for bit, a ``torch_dist`` folder written by megatron-core itself converted to exactly what torch's
``dcp_to_torch_save`` gives plus ``common.pt``'s plain entries, both without torch; hostile pickles run nothing.

Fixtures: ``fixtures/megatron-ckpts/`` (``fixtures/make_megatron.py``; README there).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptool.errors import UnsupportedError, UsageError
from ckptool.formats.dtypes import DTYPE_SIZES, numel, tensor_dtype
from ckptool.formats.safetensors import read_header
from ckptool.formats.torchfile import read_checkpoint, resolve_zip_offsets
from ckptool.model.graph import iter_tensors
from ckptool.model.megatron import TP_RULES, parse_tp_dims, tp_rule
from ckptool.readers import open_checkpoint

REPO = Path(__file__).resolve().parents[1]
MG = REPO / "fixtures" / "megatron-ckpts"
LEGACY, DIST = MG / "legacy-gpt", MG / "dist-gpt"
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64", "U8": "uint8"}


def torch_file_bytes(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, bytes) of a ``torch.save`` file of contiguous tensors, read with ckptool's own
    reader (no torch)."""
    ck = read_checkpoint(str(path))
    out = {}
    with open(path, "rb") as f:
        resolve_zip_offsets(ck, f)
        for name, node, _ in iter_tensors(ck.root):
            rec = ck.record("data/" + node.storage.key)
            dt = tensor_dtype(node)
            f.seek(rec.offset + node.storage_offset * DTYPE_SIZES[dt])
            out[name] = (dt, tuple(node.shape), f.read(numel(node.shape) * DTYPE_SIZES[dt]))
    return out


def safetensors_bytes(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...], bytes]], dict[str, str]]:
    h = read_header(str(path))
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        out = {}
        for name, e in h.entries.items():
            lo, hi = e["data_offsets"]
            f.seek(8 + n + lo)
            out[name] = (ST_DTYPES[e["dtype"]], tuple(e["shape"]), f.read(hi - lo))
    return out, dict(h.metadata or {})


# --- torch-free ------------------------------------------------------------------------------------------------

@pytest.mark.torchfree
@pytest.mark.parametrize("folder", ["legacy-gpt", "legacy-gpt/iter_0000010"])
def test_legacy_tree_consolidates_to_the_full_weights(folder: str, tmp_path: Path, run_cli: Any) -> None:
    """TP=2 shards joined by layer type (QKV / fc1 / embeddings on dim 0, swiglu's fc1 gate-then-up, linear_proj /
    fc2 on dim 1, norms and row-parallel biases replicated), PP=2 stages renumbered: the full weights, bit for bit,
    in Megatron's names and order."""
    out = tmp_path / "model.safetensors"
    r = run_cli("convert", MG / folder, "-o", out)
    assert r.exit_code == 0, r.output
    assert "Verified" in r.output and "optimizer" in r.output and "rng_state" in r.output
    got, meta = safetensors_bytes(out)
    want = torch_file_bytes(MG / "legacy-gpt.full.pt")
    assert sorted(got) == sorted(want) and len(want) == 28
    for name, value in want.items():
        assert got[name] == value, name
    assert meta["iteration"] == "10" and meta["checkpoint_version"] == "3.0"
    names = [t.name for t in open_checkpoint(MG / folder).state_dict().tensors]
    assert names == list(want)  # Megatron's order: stage 0's layers, then stage 1's


@pytest.mark.torchfree
def test_legacy_layouts_are_exercised() -> None:
    """The fixture needs each rule: dim-1 joins interleave rows, swiglu's fc1 takes gate halves then up halves."""
    src = open_checkpoint(LEGACY).state_dict()
    t = {x.name: x for x in src.tensors}
    assert len(t["decoder.layers.1.mlp.linear_fc2.weight"].storage.segments or []) == 16  # 8 rows x 2 ranks
    fc1 = t["decoder.layers.0.mlp.linear_fc1.weight"].storage.segments or []
    assert [s.nbytes for s in fc1] == [96] * 4 and fc1[0].path != fc1[1].path and fc1[0].path == fc1[2].path
    assert t["decoder.final_layernorm.weight"].storage.segments is None  # replicated: rank 0's record as it is
    assert "mp_rank_00_001" in t["decoder.layers.1.mlp.linear_fc2.bias"].storage.path  # stage 1's layer 0


@pytest.mark.torchfree
def test_dist_folder_converts_to_dcp_to_torch_save_plus_common(tmp_path: Path, run_cli: Any) -> None:
    """The megatron-core folder (column-split, row-split, layer-stacked and replicated tensors) to safetensors: the
    tensors of torch's ``dcp_to_torch_save`` bit for bit, ``common.pt``'s plain entries in ``__metadata__``."""
    out = tmp_path / "model.safetensors"
    r = run_cli("convert", DIST, "-o", out)
    assert r.exit_code == 0, r.output
    assert "common.pt: args: argparse.Namespace" in r.output
    got, meta = safetensors_bytes(out)
    want = torch_file_bytes(MG / "dist-gpt.reference.pt")
    assert sorted(got) == sorted(want) and len(want) == 5
    for name, value in want.items():
        assert got[name] == value, name
    common = json.loads((MG / "dist-gpt.common.json").read_text(encoding="utf-8"))
    assert {k: json.loads(v) for k, v in meta.items() if k != "format"} == common


@pytest.mark.torchfree
def test_inspect_legacy(run_cli: Any) -> None:
    r = run_cli("inspect", LEGACY, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["format"] == "megatron-legacy"
    m = d["metadata"]
    assert m["parallel"] == "TP=2 PP=2 EP=1" and m["iteration"].startswith("10")
    assert m["ranks"].startswith("4: mp_rank_00_000") and m["args.swiglu"] == "True"
    shapes = {t["key"]: t["shape"] for t in d["tensors"]}
    assert shapes["decoder.layers.1.mlp.linear_fc1.weight"] == [24, 8]  # global shapes
    assert shapes["decoder.layers.0.self_attention.linear_proj.weight"] == [8, 8]
    assert {"argparse.Namespace", "numpy.ndarray"} <= {g["name"] for g in d["globals"] if not g["allowed"]}
    text = run_cli("inspect", LEGACY).output
    assert "parallel: TP=2 PP=2 EP=1" in text and f"ckptool convert {LEGACY} -o model.safetensors" in text


@pytest.mark.torchfree
def test_inspect_dist(run_cli: Any) -> None:
    r = run_cli("inspect", DIST, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["format"] == "megatron-dist"
    assert d["metadata"]["backend.sharded_backend"] == "torch_dist" and d["metadata"]["common.iteration"] == "10"
    shapes = {t["key"]: t["shape"] for t in d["tensors"]}
    assert shapes["decoder.layers.mlp.linear_fc2.weight"] == [2, 8, 12]


@pytest.mark.torchfree
@pytest.mark.parametrize("folder", [LEGACY, DIST])
def test_scan_says_needs_trust(folder: Path, run_cli: Any) -> None:
    r = run_cli("scan", folder)
    assert r.exit_code not in (0, 3), r.output  # needs trust: argparse.Namespace, numpy rng states, DCP plans
    assert "argparse.Namespace" in r.output and "need trust, 0 dangerous" in r.output


@pytest.mark.torchfree
def test_tp_rules_table() -> None:
    assert tp_rule("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == "none"
    assert tp_rule("decoder.layers.3.mlp.linear_fc1.weight") == "0"
    assert tp_rule("decoder.layers.3.mlp.linear_fc1.weight", swiglu=True) == "glu"
    assert tp_rule("language_model.encoder.layers.0.self_attention.dense.weight") == "1"
    assert tp_rule("language_model.encoder.layers.0.self_attention.dense.bias") == "none"
    assert tp_rule("decoder.layers.0.mlp.my_proj.weight") is None
    assert tp_rule("decoder.layers.0.mlp.my_proj.weight", user=parse_tp_dims(["*.my_proj.weight=1"])) == "1"
    assert all(r in ("0", "1", "none") for _p, r, _w in TP_RULES)
    with pytest.raises(UsageError, match="PATTERN=DIM"):
        parse_tp_dims(["*.x=row"])


@pytest.mark.torchfree
def test_docs_print_the_rules_table() -> None:
    """docs/megatron.md's table is TP_RULES, row for row."""
    doc = (REPO / "docs" / "megatron.md").read_text(encoding="utf-8")
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    assert rows == [f"| `{p}` | {r} | {w} |" for p, r, w in TP_RULES]


def _copy_tree(tmp_path: Path) -> Path:
    dst = tmp_path / "tree"
    shutil.copytree(LEGACY, dst)
    return dst


@pytest.mark.torchfree
def test_incomplete_tree_is_refused(tmp_path: Path, run_cli: Any) -> None:
    tree = _copy_tree(tmp_path)
    shutil.rmtree(tree / "iter_0000010" / "mp_rank_01_001")
    r = run_cli("convert", tree, "-o", tmp_path / "m.safetensors")
    assert r.exit_code != 0 and "rank tp=1 pp=1 ep=0 is missing" in r.output, r.output
    (tree / "latest_checkpointed_iteration.txt").write_text("20")
    r = run_cli("inspect", tree)
    assert r.exit_code != 0 and "no folder iter_0000020/" in r.output, r.output
    assert not (tmp_path / "m.safetensors").exists()


def _blocker(folder: Path) -> Path:
    for mod in ("megatron", "torch", "numpy"):
        (folder / mod).mkdir(parents=True, exist_ok=True)
        (folder / mod / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{mod}'\", name={mod!r})\n")
    return folder


@pytest.mark.torchfree
def test_without_megatron_or_torch(tmp_path: Path) -> None:
    """In a process where ``import torch`` (and megatron, numpy) fail: inspect and convert of both layouts work."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_blocker(tmp_path / "block")), str(REPO)])}
    for folder in (LEGACY, DIST):
        out = tmp_path / f"{folder.name}.safetensors"
        for args in (["inspect", str(folder)], ["convert", str(folder), "-o", str(out)]):
            p = subprocess.run([sys.executable, "-m", "ckptool", *args], env=env, capture_output=True, text=True,
                               timeout=300, check=False)
            assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True, check=False)
    assert p.returncode != 0
    got, _ = safetensors_bytes(tmp_path / "legacy-gpt.safetensors")
    assert got == torch_file_bytes(MG / "legacy-gpt.full.pt")


# --- with torch ------------------------------------------------------------------------------------------------

def _with_unknown_tensor(tmp_path: Path) -> Path:
    """The legacy tree re-saved with one more tensor-parallel weight whose name no rule covers."""
    torch = pytest.importorskip("torch")
    tree = _copy_tree(tmp_path)
    for d in sorted((tree / "iter_0000010").iterdir()):
        f = d / "model_optim_rng.pt"
        sd = torch.load(f, weights_only=False)  # the committed fixture, written by fixtures/make_megatron.py
        tp = int(d.name[8:10])
        sd["model"]["decoder.layers.0.mlp.my_proj.weight"] = torch.arange(16, dtype=torch.float32).view(4, 4)[
            :, 2 * tp:2 * tp + 2].clone()
        torch.save(sd, f)
    return tree


def test_uncovered_tensor_is_refused_by_name_then_taken_with_tp_dim(tmp_path: Path, run_cli: Any) -> None:
    torch = pytest.importorskip("torch")
    tree = _with_unknown_tensor(tmp_path)
    out = tmp_path / "m.pt"
    r = run_cli("convert", tree, "-o", out)
    assert r.exit_code != 0 and "decoder.layers.0.mlp.my_proj.weight" in r.output and "--tp-dim" in r.output
    assert not out.exists()
    r = run_cli("inspect", tree, "--json")
    assert r.exit_code == 0 and "my_proj" in json.loads(r.output)["metadata"]["consolidation"]
    r = run_cli("convert", tree, "-o", out, "--tp-dim", "*.my_proj.weight=1")
    assert r.exit_code == 0, r.output
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["decoder.layers.0.mlp.my_proj.weight"], torch.arange(16, dtype=torch.float32).view(4, 4))
    assert "decoder.layers.1.mlp.my_proj.weight" in got  # stage 1's local layer 0 is global layer 1


def test_load_into_and_verify_take_the_folders() -> None:
    torch = pytest.importorskip("torch")
    import ckptool

    sys.path.insert(0, str(REPO / "tests"))
    import matrix_fixtures

    want = torch.load(MG / "legacy-gpt.full.pt", weights_only=True)
    model = matrix_fixtures.build_megatron_legacy_model()
    ckptool.load_into(model, LEGACY)
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert ckptool.verify(matrix_fixtures.build_megatron_dist_model, DIST).ok


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickles_run_nothing(tmp_path: Path, run_cli: Any) -> None:
    """A ``model_optim_rng.pt`` and a ``common.pt`` whose pickles would run ``os.system``: no command runs it."""
    torch = pytest.importorskip("torch")
    marker = tmp_path / "PWNED"
    tree = _copy_tree(tmp_path)
    f = tree / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)  # the committed fixture
    sd["args"] = _Payload(marker)
    torch.save(sd, f)
    dist = tmp_path / "dist"
    shutil.copytree(DIST, dist)
    common = torch.load(dist / "common.pt", weights_only=False)
    common["args"] = _Payload(marker)
    torch.save(common, dist / "common.pt")
    for folder in (tree, dist):
        for args in (["inspect", folder], ["scan", folder], ["diff", folder, folder],
                     ["report", folder, "-o", tmp_path / "r.html"],
                     ["convert", folder, "-o", tmp_path / f"{folder.name}.safetensors"],
                     ["convert", folder, "-o", tmp_path / f"{folder.name}.pt"]):
            r = run_cli(*args, catch_exceptions=True)
            assert r.exit_code != 3, (args, r.output)
            assert not marker.exists(), args
        r = run_cli("scan", folder)
        assert r.exit_code != 0 and ("posix.system" in r.output or "os.system" in r.output), r.output
    import ckptool

    sys.path.insert(0, str(REPO / "tests"))
    import matrix_fixtures

    ckptool.load_into(matrix_fixtures.build_megatron_legacy_model(), tree)  # tensor bytes only
    assert not marker.exists()


def test_megatron_reads_back_the_committed_folder(tmp_path: Path) -> None:
    """megatron-core's own ``dist_checkpointing.load`` (in the fixture script's process group) reads the committed
    torch_dist folder back as the sharded state it was saved from, in ``$CKPTOOL_MEGATRON_PYTHON`` or this
    interpreter; skipped where neither has megatron-core (fixtures/make_megatron.py runs in its own venv). A folder
    ckptool rewrote: tests/test_megatron_rewrite.py."""
    python = os.environ.get("CKPTOOL_MEGATRON_PYTHON") or sys.executable
    if python == sys.executable:
        pytest.importorskip("megatron.core")
    p = subprocess.run([python, str(REPO / "fixtures" / "make_megatron.py"), str(tmp_path), "readback",
                        str(DIST)], capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.torchfree
def test_a_zarr_folder_is_refused(tmp_path: Path, run_cli: Any) -> None:
    folder = tmp_path / "zarr"
    shutil.copytree(DIST, folder)
    (folder / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    r = run_cli("convert", folder, "-o", tmp_path / "m.safetensors")
    assert r.exit_code != 0 and "backend 'zarr'" in r.output, r.output
    with pytest.raises(UnsupportedError):
        open_checkpoint(folder).state_dict()


@pytest.mark.torchfree
def test_megatron_deepspeed_folder_stays_deepspeed(tmp_path: Path) -> None:
    """Megatron-DeepSpeed writes latest_checkpointed_iteration.txt beside DeepSpeed's ``latest`` and global_stepN
    folders: still a DeepSpeed folder; a plain tree is recognised from its top folder or its iteration folder."""
    folder = tmp_path / "mds"
    shutil.copytree(REPO / "fixtures" / "deepspeed-zero" / "zero2-1rank", folder)
    (folder / "latest_checkpointed_iteration.txt").write_text("2")
    assert open_checkpoint(folder).format == "deepspeed"
    assert open_checkpoint(LEGACY).format == open_checkpoint(LEGACY / "iter_0000010").format == "megatron-legacy"
    assert open_checkpoint(DIST).format == "megatron-dist"
