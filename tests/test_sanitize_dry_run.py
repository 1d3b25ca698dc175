"""``ckptool sanitize --dry-run`` (issue 46): what a run would do, written nowhere; what the file is as ``inspect``
and ``scan`` say it; the exit status a run would have."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import make_fixtures
import numpy as np
import pytest
import torch

from ckptool.ops.sanitize import sanitize_dry_run

NAMES = sorted(make_fixtures.SANITIZE_MANIFEST)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_fixtures.build_sanitize_fixtures(tmp_path_factory.mktemp("sanitize"))


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo sanitize-ran-the-file",))


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _json(r: Any) -> dict[str, Any]:
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", NAMES)
def test_dry_run_says_what_a_run_does_and_what_inspect_and_scan_say(files: dict[str, Path], tmp_path: Path,
                                                                    run_cli, name: str) -> None:
    """For each file sanitize rewrites: the dry run's conversions, storages and tags are the run's, its format,
    kind, tensor count and verdict are inspect's and scan's, and it writes nothing (the folder is unchanged)."""
    src = tmp_path / name
    shutil.copy(files[name], src)
    out = tmp_path / "out.pth"
    before = _listing(tmp_path)
    dry = run_cli("sanitize", src, "-o", out, "--to", "cpu", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert _listing(tmp_path) == before
    plan = _json(dry)
    assert plan["schema"] == "ckptool.sanitize-dry-run/1" and plan["would_write"] and plan["error"] is None
    assert plan["exit_code"] == 0 and plan["dst"] == str(out)
    ins = _json(run_cli("inspect", "--json", src))
    scan = _json(run_cli("scan", "--json", src))
    assert (plan["format"], plan["kind"], plan["tensors"]) == (ins["format"], ins["kind"], len(ins["tensors"]))
    assert plan["verdict"] == scan["files"][0]["verdict"] == ins["security"]["verdict"]
    real = run_cli("sanitize", src, "-o", out, "--to", "cpu", "--json")
    assert real.exit_code == 0, real.output
    done = _json(real)
    assert [{k: c[k] for k in ("path", "kind", "source", "detail")} for c in plan["converted"]] == done["converted"]
    assert plan["converted"] and (plan["storages"], plan["new_storages"]) == (done["storages"], done["new_storages"])
    assert (plan["devices"], plan["retagged"]) == (done["devices"], done["retagged"])


def test_dry_run_text_lists_the_conversions_and_the_file_it_would_write(files: dict[str, Path], run_cli) -> None:
    src = files["numpy_train_cuda0_legacy.pt"]
    r = run_cli("sanitize", src, "--dry-run")
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[0].startswith(f"{src}: torch-legacy, training_checkpoint, ") and lines[0].endswith(
        "; scan's verdict: needs-trust")
    assert "  args: argparse.Namespace -> dict (5 entries)" in lines
    assert lines[-1].startswith(f"Would write {src.with_name(src.stem + '.sanitized.pt')} (")
    assert lines[-1].endswith("; nothing written (--dry-run)")
    assert not src.with_name(src.stem + ".sanitized.pt").exists()


def _hostile(tmp: Path) -> Path:
    p = tmp / "hostile.pt"
    torch.save({"weight": torch.ones(2), "cfg": {"lr": np.float32(0.5), "cmd": Evil()}}, p)
    return p


def _arrays(tmp: Path) -> Path:
    p = tmp / "arrays.pt"
    torch.save({"w": torch.ones(2), "a": np.arange(3.0)}, p)
    return p


def _plain(tmp: Path) -> Path:
    p = tmp / "plain.pkl"
    p.write_bytes(pickle.dumps({"a": 1}))
    return p


def _safetensors(tmp: Path) -> Path:
    from safetensors.torch import save_file

    p = tmp / "w.safetensors"
    save_file({"w": torch.ones(2)}, str(p))
    return p


def _taken(tmp: Path) -> Path:
    p = _arrays(tmp)
    (tmp / "taken.pt").write_bytes(b"x")
    return p


#: name -> (make the input in a folder, the arguments after SRC, the exit status a run has)
CASES: dict[str, tuple[Any, tuple[str, ...], int]] = {
    "converts": (_arrays, (), 0),
    "hostile": (_hostile, (), 1),
    "hostile dropped": (_hostile, ("--drop-unknown",), 0),
    "plain pickle": (_plain, (), 1),
    "safetensors": (_safetensors, (), 1),
    "a --map source no storage has": (_arrays, ("--map", "cuda:3=cpu"), 1),
    "an output that exists": (_taken, ("-o", "taken.pt"), 2),
    "the output is the input": (_arrays, ("-o", "arrays.pt"), 2),
    "a missing file": (lambda tmp: tmp / "missing.pt", (), 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("as_json", [False, True])
def test_dry_run_exits_as_the_run_would_and_writes_nothing(tmp_path: Path, run_cli, case: str,
                                                           as_json: bool) -> None:
    """The dry run's exit status is the run's (0, a refused file 1, bad arguments or an output that exists 2),
    with the run's ``Error:`` line; the JSON says that status; the folder is unchanged."""
    make, args, status = CASES[case]
    dry_dir, run_dir = tmp_path / "dry", tmp_path / "run"
    dry_dir.mkdir()
    src = make(dry_dir)
    shutil.copytree(dry_dir, run_dir)
    rel = [str(dry_dir / a) if a.endswith(".pt") else a for a in args]
    before = _listing(dry_dir)
    dry = run_cli("sanitize", src, *rel, "--dry-run", *(["--json"] if as_json else []))
    assert _listing(dry_dir) == before
    run = run_cli("sanitize", run_dir / src.name, *[a.replace(str(dry_dir), str(run_dir)) for a in rel])
    assert run.exit_code == status, run.output
    assert dry.exit_code == status, dry.output
    if status:
        error = [line for line in run.output.splitlines() if line.startswith("Error: ")]
        assert error and error[0].replace(str(run_dir), str(dry_dir)) in dry.output
    if as_json and dry.stdout.startswith("{"):
        plan = _json(dry)
        assert plan["exit_code"] == status and plan["would_write"] is (status == 0)
    elif as_json:
        assert status == 2 and case in ("an output that exists", "the output is the input", "a missing file")


def test_a_refusal_lists_what_no_rule_converts_with_scan_s_level(tmp_path: Path, run_cli) -> None:
    src = _hostile(tmp_path)
    plan = sanitize_dry_run(src)
    assert plan.error is not None and "cfg.cmd" in str(plan.error)
    assert [c.path for c in plan.converted] == ["cfg.lr"]
    assert [(c.path, c.level) for c in plan.unconverted] == [("cfg.cmd", "dangerous")]
    assert (plan.format, plan.kind, plan.tensors, plan.verdict) == ("torch-zip", "tensors", 1, "dangerous")
    r = run_cli("sanitize", src, "--dry-run")
    assert r.exit_code == 1
    assert "No rule converts 1 object (a run refuses the file):" in r.output and "Would write" not in r.output
    assert r.output.strip().splitlines()[-1].startswith("Error: ")
    assert list(tmp_path.iterdir()) == [src]


def test_a_dry_run_of_a_set_says_what_it_is_and_the_refusal(tmp_path: Path, run_cli) -> None:
    """A sharded set (its folder or its index) is refused by sanitize, and the dry run says so after saying what
    it is: its format and the verdict ``scan`` gives the set, in JSON, with the run's exit status (before, the
    refusal came first, as a plain Error line without the JSON)."""

    from safetensors.torch import save_file

    folder = tmp_path / "set"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2)}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    for path in (folder, folder / "model.safetensors.index.json"):
        r = run_cli("sanitize", "--dry-run", "--json", path)
        d = json.loads(r.stdout)
        assert d["format"] == "sharded-safetensors" and d["verdict"] == "safe" and d["error"]
        assert r.exit_code == d["exit_code"] != 0
