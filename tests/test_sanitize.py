"""``ckptool sanitize``: files that ``torch.load(weights_only=True)`` refuses (numpy arrays and scalars,
``argparse.Namespace``, pickled modules) are rewritten into files it accepts, with the same values, without
importing or running anything from the file; what no rule converts is refused with its key path."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import make_fixtures
import numpy as np
import pytest
import torch
from torch import nn

import ckptool
from ckptool.errors import UnsafeCheckpointError
from ckptool.model.numpy_nodes import read_array
from ckptool.ops.sanitize import sanitize

REPO = Path(__file__).resolve().parent.parent
NAMES = sorted(make_fixtures.SANITIZE_MANIFEST)
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
LOAD = "import sys, torch; torch.load(sys.argv[1], weights_only=True); print('loaded')"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_fixtures.build_sanitize_fixtures(tmp_path_factory.mktemp("sanitize"))


def expected(obj: Any) -> Any:
    """What sanitize must turn a loaded object into (numpy -> tensors, records -> dicts, modules -> state_dict)."""
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.astype(obj.dtype.newbyteorder("=")))
    if isinstance(obj, np.generic):
        return torch.from_numpy(np.asarray(obj))
    if isinstance(obj, np.dtype):
        return getattr(torch, obj.name)
    if isinstance(obj, type) and issubclass(obj, np.generic):
        return getattr(torch, np.dtype(obj).name)
    if isinstance(obj, argparse.Namespace):
        return {k: expected(v) for k, v in vars(obj).items()}
    if isinstance(obj, dict):
        return {k: expected(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(expected(v) for v in obj)
    return obj


def assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert got.numel() == 0 or got.stride() == want.stride(), path  # an empty tensor's stride means nothing
        assert torch.equal(got, want), path
        assert not got.requires_grad, path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (path, list(got), list(want))
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}.{i}")
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


def load_cpu_only(path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", LOAD, str(path)], capture_output=True, text=True, env=CPU_ONLY,
                       timeout=120, check=False)
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("name", NAMES)
def test_refused_before_and_loads_after(files: dict[str, Path], tmp_path: Path, name: str) -> None:
    src = files[name]
    with pytest.raises(pickle.UnpicklingError):
        torch.load(src, map_location="cpu", weights_only=True)
    out = tmp_path / "out.pth"
    res = sanitize(src, out, to="cpu")
    assert res.dst == str(out) and res.devices.keys() == {"cpu"} and not res.dropped
    load_cpu_only(out)
    got = torch.load(out, weights_only=True)
    assert_same(got, expected(torch.load(src, map_location="cpu", weights_only=False)))


def test_what_numpy_content_becomes(files: dict[str, Path], tmp_path: Path) -> None:
    res = sanitize(files["numpy_cuda0.pt"], tmp_path / "out.pth", to="cpu")
    kinds = {c.path: (c.kind, c.detail) for c in res.converted}
    assert kinds["arrays.float16"] == ("array", "tensor float16 [3, 4]")
    assert kinds["zero_d"] == ("array", "tensor float64 []")
    assert kinds["scalars.b"] == ("scalar", "tensor bool []")
    assert kinds["dtype"] == ("dtype", "torch.float16") and kinds["scalar_type"] == ("dtype", "torch.float32")
    assert "weight" not in kinds and "same_array.1" not in kinds  # tensors kept; one array converted once
    out = torch.load(tmp_path / "out.pth", weights_only=True)
    assert out["same_array"][0] is out["same_array"][1]
    assert out["fortran"].stride() == (1, 2) and out["arrays"]["uint16"].dtype == torch.uint16
    assert res.new_storages == sum(1 for c in res.converted if c.kind in ("array", "scalar"))


def test_training_checkpoint_namespace_becomes_dict(files: dict[str, Path], tmp_path: Path) -> None:
    res = sanitize(files["numpy_train_cuda0.pt"], tmp_path / "out.pth")
    assert ("args", "record", "argparse.Namespace") in {(c.path, c.kind, c.source) for c in res.converted}
    assert res.devices == {"cuda:0": res.storages - res.new_storages, "cpu": res.new_storages}
    out = torch.load(tmp_path / "out.pth", map_location="cpu", weights_only=True)
    assert out["args"]["layers"] == [64, 32] and out["args"]["dropout"].item() == 0.125
    assert out["rng_state"][0] == "MT19937" and out["rng_state"][1].dtype == torch.uint32


def test_full_model_becomes_its_state_dict(files: dict[str, Path], tmp_path: Path) -> None:
    res = sanitize(files["model_args_cuda0.pt"], tmp_path / "out.pth", to="cpu")
    mods = [c for c in res.converted if c.kind == "module"]
    assert [(c.path, c.source) for c in mods] == [("model", "fixture_models.TinyNet")]
    out = torch.load(tmp_path / "out.pth", weights_only=True)
    assert out["model"]._metadata[""] == {"version": 1}
    model = make_fixtures.fixture_models.TinyNet()
    model.load_state_dict(out["model"])  # strict: the keys are the model's own


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo sanitize-ran-the-file",))


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    p = tmp_path / "hostile.pt"
    torch.save({"weight": torch.ones(2), "cfg": {"lr": np.float32(0.5), "cmd": Evil()}}, p)
    return p


def test_hostile_global_is_refused_with_its_key_path(hostile: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "out.pth"
    with pytest.raises(UnsafeCheckpointError, match=r"cfg\.cmd: (os|posix)\.system") as e:
        sanitize(hostile, out)
    assert "nothing was written" in str(e.value) and not out.exists()
    assert list(tmp_path.iterdir()) == [hostile]  # no temporary file left either
    r = run_cli("sanitize", hostile, "-o", out)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: ") and "cfg.cmd" in lines[0]
    assert not out.exists()


def test_drop_unknown_leaves_it_out(hostile: Path, tmp_path: Path) -> None:
    res = sanitize(hostile, tmp_path / "out.pth", drop_unknown=True)
    assert [c.path for c in res.dropped] == ["cfg.cmd"] and [c.path for c in res.converted] == ["cfg.lr"]
    out = torch.load(tmp_path / "out.pth", weights_only=True)
    assert out["cfg"].keys() == {"lr"} and torch.equal(out["weight"], torch.ones(2))


def test_cli_reports_and_prints_a_hint_that_works(files: dict[str, Path], tmp_path: Path, run_cli) -> None:
    out = tmp_path / "out.pth"
    r = run_cli("sanitize", files["numpy_train_cuda0_legacy.pt"], "-o", out)
    assert r.exit_code == 0, r.output
    assert "  args: argparse.Namespace -> dict (5 entries)" in r.output
    assert "  best_acc: numpy scalar -> tensor float64 []" in r.output
    hint = r.output.strip().splitlines()[-1]
    assert hint == f"Load it with: torch.load({str(out)!r}, map_location='cpu', weights_only=True)"
    code = "import torch; " + hint.removeprefix("Load it with: ")
    subprocess.run([sys.executable, "-c", code], env=CPU_ONLY, check=True, timeout=120)
    r = run_cli("sanitize", files["numpy_cuda0.pt"], "-o", tmp_path / "cpu.pth", "--to", "cpu")
    assert r.output.strip().splitlines()[-1].endswith("weights_only=True)")


def test_unsafe_load_names_sanitize_first_and_trust_second(files: dict[str, Path], hostile: Path) -> None:
    from ckptool.torch_ops.load import load_checkpoint

    with pytest.raises(UnsafeCheckpointError) as e:
        load_checkpoint(files["numpy_cuda0.pt"])
    msg = str(e.value)
    assert "numpy" in msg and msg.index("ckptool sanitize") < msg.index("--trust")
    with pytest.raises(UnsafeCheckpointError) as e:
        load_checkpoint(hostile)
    assert "ckptool sanitize" not in str(e.value) and "do not load it with trust" in str(e.value)


def test_numpy_one_names_and_big_endian_are_read() -> None:
    from ckptool.formats.unpickler import load_structure

    data = pickle.dumps(np.arange(3, dtype=">u2"), protocol=2).replace(b"cnumpy._core.", b"cnumpy.core.")
    arr = read_array(load_structure(data, "test")[0])
    assert (arr.dtype, arr.shape, arr.data) == ("uint16", (3,), np.arange(3, dtype="<u2").tobytes())


def test_object_arrays_are_left_with_the_reason(tmp_path: Path) -> None:
    src = tmp_path / "obj.pt"
    torch.save({"names": np.array(["a", "b"], dtype=object), "ok": np.ones(1)}, src)
    with pytest.raises(UnsafeCheckpointError, match=r"names: numpy\._core\.multiarray\._reconstruct \(numpy dtype "):
        sanitize(src, tmp_path / "out.pth")


def test_public_api() -> None:
    assert ckptool.sanitize is sanitize and "sanitize" in ckptool.__all__ and "SanitizeResult" in ckptool.__all__


AUDIT = textwrap.dedent("""
    import json, os, sys
    from ckptool.errors import CkptError
    from ckptool.ops.sanitize import sanitize
    files, warm, outdir = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    for i, path in enumerate(files):  # ckptool's own lazy imports (each format's plug-ins), before the hook
        try:
            sanitize(path, os.path.join(outdir, f"warm-{i}.pth"), to="cpu")
        except CkptError:
            pass
    events, armed = [], [False]
    FORBIDDEN = ("import", "exec", "compile", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
                 "subprocess.", "socket.", "ctypes.", "pickle.find_class", "marshal.load")
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def hook(event, args):
        if not armed[0]:
            return
        bad = event.startswith(FORBIDDEN)
        if event == "open":
            mode, flags = (args[1] if len(args) > 1 else "r"), (args[2] if len(args) > 2 else 0)
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE)
            fd = isinstance(args[0], int)  # an fd os.open already opened (and this hook checked)
            bad = bool(writing) and not fd and not str(args[0]).startswith(outdir)
        if bad:
            events.append([event, repr(args)[:200]])

    sys.addaudithook(hook)
    results = {}
    for i, path in enumerate(files):
        armed[0] = True
        try:
            sanitize(path, os.path.join(outdir, f"{i}.pth"), to="cpu")
            results[path] = "ok"
        except CkptError as e:
            results[path] = type(e).__name__
        armed[0] = False
    print(json.dumps({"events": events, "results": results,
                      "loaded": sorted(m for m in ("torch", "numpy", "fixture_models") if m in sys.modules)}))
""")


def test_sanitize_imports_and_runs_nothing_from_the_file(files: dict[str, Path], hostile: Path,
                                                         tmp_path: Path) -> None:
    """With an audit hook armed, sanitizing every fixture and the hostile file imports nothing, runs nothing
    and writes only the outputs; neither torch, numpy nor the model's module is ever imported."""
    paths = [str(p) for p in files.values()] + [str(hostile)]
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-c", AUDIT, json.dumps(paths), paths[0], str(out)], capture_output=True,
                       text=True, timeout=300, check=False, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["events"] == []
    assert report["loaded"] == []
    assert report["results"] == {**dict.fromkeys(paths[:-1], "ok"), str(hostile): "UnsafeCheckpointError"}
