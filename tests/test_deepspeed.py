"""DeepSpeed ZeRO folders: inspect and convert without deepspeed, equal to DeepSpeed's own zero_to_fp32.

The inputs are real checkpoints written by DeepSpeed on the CPU (``fixtures/deepspeed-zero/``, made by
``fixtures/make_deepspeed.py``), each with ``<case>.oracle.pt``: ``get_fp32_state_dict_from_zero_checkpoint`` of
it. Where deepspeed imports, ``test_live_*`` also regenerate a checkpoint and compare with deepspeed live.
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

from ckptool.errors import CorruptCheckpointError, UsageError
from ckptool.formats.dtypes import DTYPE_SIZES, numel, tensor_dtype
from ckptool.formats.safetensors import read_header
from ckptool.formats.segments import ConcatenatedFile, widen_to_float32
from ckptool.formats.tensors import Segment
from ckptool.formats.torchfile import read_checkpoint, resolve_zip_offsets
from ckptool.model.graph import iter_tensors
from ckptool.model.zero import plan
from ckptool.readers.read_deepspeed import read_zero

REPO = Path(__file__).resolve().parents[1]
DS = REPO / "fixtures" / "deepspeed-zero"  # a hyphen: never importable, so it cannot pose as deepspeed
CASES = ["zero1-2ranks", "zero2-1rank", "zero2-2ranks", "zero3-1rank", "zero3-2ranks"]
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64"}


def oracle_bytes(case: str) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, bytes) of the oracle file, read with ckptool's own reader (no torch)."""
    path = str(DS / f"{case}.oracle.pt")
    ck = read_checkpoint(path)
    out = {}
    with open(path, "rb") as f:
        resolve_zip_offsets(ck, f)
        for name, node, _ in iter_tensors(ck.root):
            rec = ck.record("data/" + node.storage.key)
            dt = tensor_dtype(node)
            es = DTYPE_SIZES[dt]
            f.seek(rec.offset + node.storage_offset * es)
            out[name] = (dt, node.shape, f.read(numel(node.shape) * es))
    return out


def safetensors_bytes(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...], bytes]], dict[str, str]]:
    h = read_header(str(path))
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        base = 8 + n
        out = {}
        for name, e in h.entries.items():
            lo, hi = e["data_offsets"]
            f.seek(base + lo)
            out[name] = (ST_DTYPES[e["dtype"]], tuple(e["shape"]), f.read(hi - lo))
    return out, h.aliases()


# --- torch-free: the plan and the CLI against the oracle's bytes ------------------------------------------------

@pytest.mark.torchfree
@pytest.mark.parametrize("case", CASES)
def test_convert_to_safetensors_equals_zero_to_fp32(case: str, tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "model.safetensors"
    r = run_cli("convert", DS / case, "-o", out)
    assert r.exit_code == 0, r.output
    assert "Verified" in r.output
    got, aliases = safetensors_bytes(out)
    want = oracle_bytes(case)
    assert aliases == {"head.weight": "embed.weight"}  # tied weights stored once
    assert list(got) == [k for k in want if k != "head.weight"]  # zero_to_fp32's order
    for name, value in got.items():
        assert value == want[name], name
    assert want["head.weight"] == want["embed.weight"]


@pytest.mark.torchfree
def test_padding_and_straddling_are_exercised() -> None:
    """The 2-rank fixtures need what the plan implements: ZeRO-3 parameters padded on the last rank, ZeRO-2
    parameters that straddle two ranks' partitions."""
    z3 = read_zero(str(DS / "zero3-2ranks"))
    t3 = {t.name: t for t in plan(z3)}
    assert z3.stage == 3 and z3.world_size == 2
    assert len(t3["embed.weight"].segments) == 2  # 21 elements: 11 + 10 of 11 (one padding element dropped)
    assert [s.nbytes for s in t3["embed.weight"].segments] == [44, 40]
    z2 = read_zero(str(DS / "zero2-2ranks"))
    assert z2.stage == 2 and z2.world_size == 2 and z2.weights_dtype == "bfloat16"
    assert any(len({s.path for s in t.segments}) == 2 for t in plan(z2) if t.kind == "param")
    buffers = [t for t in plan(z2) if t.kind == "buffer"]
    assert {t.dtype for t in buffers} == {"float32", "int64"}  # bf16 buffers widened, as v.float()
    assert any(s.widen == "bfloat16" for t in buffers for s in t.segments)


@pytest.mark.torchfree
def test_inspect_json(run_cli: Any) -> None:
    r = run_cli("inspect", DS / "zero3-2ranks", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["format"] == "deepspeed"
    m = d["metadata"]
    assert (m["zero_stage"], m["world_size"], m["deepspeed_version"]) == ("3", "2", "0.19.8")
    assert m["master_dtype"] == "float32" and m["frozen"] == "frozen.weight, frozen.bias"
    assert m["buffers"] == "scale, running, calls, f16, b16" and "exp_avg" in m["optimizer_state"]
    assert m["consolidate"] == f"ckptool convert {DS / 'zero3-2ranks'} -o model.safetensors"
    shapes = {t["key"]: t["shape"] for t in d["tensors"]}
    assert shapes["embed.weight"] == [7, 3] and shapes["fc1.weight"] == [5, 3]
    assert any(g["name"].startswith("deepspeed.") and not g["allowed"] for g in d["globals"])


@pytest.mark.torchfree
def test_inspect_text_says_the_command(run_cli: Any) -> None:
    r = run_cli("inspect", DS / "zero2-2ranks" / "global_step2")
    assert r.exit_code == 0, r.output
    assert "zero stage: 2" in r.output and "weights dtype: bfloat16" in r.output
    assert f"ckptool convert {DS / 'zero2-2ranks' / 'global_step2'} -o model.safetensors" in r.output


@pytest.mark.torchfree
def test_tags_and_errors(tmp_path: Path, run_cli: Any) -> None:
    top = tmp_path / "ckpt"
    shutil.copytree(DS / "zero3-2ranks", top)
    assert read_zero(str(top), "global_step2").ds.tag == "global_step2"
    with pytest.raises(UsageError, match="no tag folder 'global_step9'"):
        read_zero(str(top), "global_step9")
    (top / "latest").unlink()
    with pytest.raises(UsageError, match=r"pass the tag folder itself .* or --tag"):
        read_zero(str(top))
    r = run_cli("convert", top, "-o", tmp_path / "m.safetensors", "--tag", "global_step2")
    assert r.exit_code == 0, r.output
    os.unlink(top / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CorruptCheckpointError, match="saved by 2 ranks but holds 1"):
        read_zero(str(top), "global_step2")
    r = run_cli("convert", top, "-o", tmp_path / "x.safetensors", "--tag", "global_step2")
    assert r.exit_code == 1 and r.output.startswith("Error: ") and not (tmp_path / "x.safetensors").exists()
    r = run_cli("convert", DS / "zero3-2ranks.oracle.pt", "-o", tmp_path / "y.safetensors", "--tag", "x")
    assert r.exit_code == 2


@pytest.mark.torchfree
def test_exclude_frozen(tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "m.safetensors"
    assert run_cli("convert", DS / "zero2-1rank", "-o", out, "--exclude-frozen").exit_code == 0
    got, _ = safetensors_bytes(out)
    want = oracle_bytes("zero2-1rank")
    assert list(got) == [k for k in want if not k.startswith("frozen.") and k != "head.weight"]


@pytest.mark.torchfree
def test_segments_reader() -> None:
    data = {"a": b"0123456789", "b": b"abcdef"}

    def read(p: str, off: int, n: int) -> bytes:
        return data[p][off:off + n]

    r = ConcatenatedFile([Segment("a", 2, 3), Segment("b", 1, 4)], read)
    assert r.read() == b"234bcde"
    r.seek(2)
    buf = bytearray(4)
    assert r.readinto(buf) == 4 and bytes(buf) == b"4bcd"
    bf16 = struct.pack("<2H", 0x3F80, 0xC000)  # 1.0, -2.0
    assert struct.unpack("<2f", widen_to_float32(bf16, "bfloat16")) == (1.0, -2.0)
    assert struct.unpack("<2f", widen_to_float32(struct.pack("<2e", 0.5, 3.0), "float16")) == (0.5, 3.0)
    wide = ConcatenatedFile([Segment("w", 0, 8, "bfloat16")], lambda p, o, n: bf16[o:o + n])
    wide.seek(3)
    assert wide.read(3) == widen_to_float32(bf16, "bfloat16")[3:6]


def _blocker(folder: Path) -> Path:
    for mod in ("deepspeed", "torch", "numpy"):
        (folder / mod).mkdir(parents=True, exist_ok=True)
        (folder / mod / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{mod}'\", name={mod!r})\n")
    return folder


@pytest.mark.torchfree
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_without_deepspeed_or_torch(fmt: str, tmp_path: Path) -> None:
    """In a process where ``import deepspeed`` (and torch) fail: inspect and convert work, and say so."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_blocker(tmp_path / "block")), str(REPO)])}
    out = tmp_path / f"model.{fmt}"
    for args in (["inspect", str(DS / "zero3-2ranks")], ["convert", str(DS / "zero3-2ranks"), "-o", str(out)]):
        p = subprocess.run([sys.executable, "-m", "ckptool", *args], env=env, capture_output=True, text=True,
                           timeout=120, check=False)
        assert p.returncode == 0, p.stderr
    probe = "import deepspeed" if fmt == "pt" else "import torch"
    p = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert p.returncode != 0  # really blocked
    if fmt == "safetensors":
        got, _ = safetensors_bytes(out)
        want = oracle_bytes("zero3-2ranks")
        assert all(got[k] == want[k] for k in got)


# --- with torch: torch output, casts, shards, load_into ---------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_convert_to_torch_equals_oracle(case: str, tmp_path: Path, run_cli: Any) -> None:
    torch = pytest.importorskip("torch")
    out = tmp_path / "model.pt"
    r = run_cli("convert", DS / case, "-o", out)
    assert r.exit_code == 0, r.output
    got = torch.load(out, weights_only=True)
    want = torch.load(DS / f"{case}.oracle.pt", weights_only=True)
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert got["head.weight"].data_ptr() == got["embed.weight"].data_ptr()  # still tied


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_cast_matches_zero_to_fp32(dtype: str, tmp_path: Path, run_cli: Any) -> None:
    """``--dtype`` casts floating tensors, as ``convert_zero_checkpoint_to_state_dict(dtype=...)`` does."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    out = tmp_path / "m.safetensors"
    assert run_cli("convert", DS / "zero3-2ranks", "-o", out, "--dtype", dtype).exit_code == 0
    got = load_file(out)
    want = torch.load(DS / "zero3-2ranks.oracle.pt", weights_only=True)
    for k, v in got.items():
        ref = want[k].to(getattr(torch, dtype)) if want[k].is_floating_point() else want[k]
        assert v.dtype == ref.dtype and torch.equal(v, ref), k


def test_sharded_output(tmp_path: Path, run_cli: Any) -> None:
    torch = pytest.importorskip("torch")
    out = tmp_path / "out"
    r = run_cli("convert", DS / "zero2-2ranks", "-o", f"{out}/", "--max-shard-size", "200")
    assert r.exit_code == 0, r.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    from safetensors.torch import load_file

    got: dict[str, Any] = {}
    for shard in set(index["weight_map"].values()):
        got.update(load_file(out / shard))
    want = torch.load(DS / "zero2-2ranks.oracle.pt", weights_only=True)
    assert set(got) == set(want) - {"head.weight"}
    assert all(torch.equal(got[k], want[k]) for k in got)


# --- live: regenerate with deepspeed and compare ------------------------------------------------------------------

def _deepspeed() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.utils  # a real installation (a stray namespace folder named deepspeed has no submodules)
    except Exception as e:  # not installed, or its ops cannot be built here
        pytest.skip(f"deepspeed is not importable here ({type(e).__name__}); the committed fixtures are used")
    return deepspeed


@pytest.mark.parametrize("case", ["zero2-2ranks", "zero3-1rank"])
def test_live_committed_folders_match_deepspeed(case: str, tmp_path: Path, run_cli: Any) -> None:
    """deepspeed's own consolidation of the committed folders, computed now, equals ckptool's output."""
    _deepspeed()
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "fixtures"))
    import make_deepspeed

    want = make_deepspeed.oracle_state_dict(DS / case)
    out = tmp_path / "m.pt"
    assert run_cli("convert", DS / case, "-o", out).exit_code == 0
    got = torch.load(out, weights_only=True)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero2-2ranks", "zero3-2ranks"])
def test_live_regenerated_two_ranks(case: str, tmp_path: Path, run_cli: Any) -> None:
    """A fresh ZeRO-2 (bfloat16) and ZeRO-3 (float32) checkpoint from 2 ranks (torch.distributed.run, gloo), larger
    hidden size, compared with deepspeed's zero_to_fp32 live, frozen parameters excluded too."""
    _deepspeed()
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "fixtures"))
    import make_deepspeed

    folder = make_deepspeed.make_case(tmp_path, case, hidden=37, oracle=False)
    for exclude in (False, True):
        want = make_deepspeed.oracle_state_dict(folder, exclude_frozen=exclude)
        out = tmp_path / f"m{exclude}.pt"
        args = ["convert", folder, "-o", out] + (["--exclude-frozen"] if exclude else [])
        assert run_cli(*args).exit_code == 0
        got = torch.load(out, weights_only=True)
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_load_into_and_verify_take_the_folder() -> None:
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "fixtures"))
    import make_deepspeed

    import ckptool

    want = torch.load(DS / "zero2-2ranks.oracle.pt", weights_only=True)
    model = make_deepspeed._model(5)
    ckptool.load_into(model, DS / "zero2-2ranks")
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
    assert model.head.weight is model.embed.weight
    rep = ckptool.verify(lambda: make_deepspeed._model(5), DS / "zero3-2ranks")
    assert rep.ok, rep


@pytest.mark.torchfree
def test_zero1_frozen_parameters_are_named(run_cli: Any) -> None:
    """ZeRO-1 saves no frozen_param_shapes: zero_to_fp32 (and so ckptool) leaves frozen parameters out; ckptool
    says so."""
    z = read_zero(str(DS / "zero1-2ranks"))
    assert z.stage == 1 and z.uncovered == ["frozen.weight", "frozen.bias"]
    r = run_cli("inspect", DS / "zero1-2ranks", "--json")
    assert "frozen.weight, frozen.bias" in json.loads(r.output)["metadata"]["not_consolidated"]


def test_no_verify_copies_a_view_from_its_offset(tmp_path: Path, run_cli: Any) -> None:
    """Regression (found while adding segmented storages to convert's writer): with --no-verify, a contiguous view
    that starts inside its storage was copied from the storage's start."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    base = torch.arange(10.0)
    torch.save({"a": base[:4], "b": base[6:]}, tmp_path / "views.pt")
    out = tmp_path / "views.safetensors"
    assert run_cli("convert", tmp_path / "views.pt", "-o", out, "--no-verify").exit_code == 0
    got = load_file(out)
    assert torch.equal(got["b"], base[6:]) and torch.equal(got["a"], base[:4])
