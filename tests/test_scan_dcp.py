"""``scan`` of the folders real libraries write, without false alarms and without blind spots:
torch.distributed.checkpoint folders (``.metadata`` under DCP's own record classes, ``.distcp`` files read by the
byte ranges of ``storage_data``), sharded ``.bin`` sets, and accelerate ``save_state`` folders (its RNG state is a
known file that needs trust)."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from ckptool.model.allowlist import ACCELERATE_RNG, ALLOWED, DANGEROUS, NEEDS_TRUST, SAFE
from ckptool.ops.inspect.entry import inspect
from ckptool.scanning.entry import scan, scan_file

MARKER = "/tmp/ckptool-scan-dcp-pwned"


class Payload:
    """Pickles as a call of ``os.system`` (nothing here ever unpickles it)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {MARKER}",)


def _save_dcp(state: dict[str, object], folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns and saves as a single rank
        dcp.save(state, checkpoint_id=folder)
    return folder


def _training_state() -> dict[str, object]:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7, "cfg": {"lr": 0.1, "name": "run"}}


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_dcp(_training_state(), tmp_path_factory.mktemp("dcp") / "ckpt")


def test_a_dcp_folder_written_by_torch_is_safe(dcp_folder: Path, run_cli) -> None:
    res = scan_file(dcp_folder)
    assert res.format == "dcp" and res.verdict == SAFE and res.exit_code == 0, (res.error, res.unsafe, res.notes)
    assert not res.notes and not res.hidden
    meta = {g.name: g for g in res.globals if ".metadata" in g.where}
    assert meta["pathlib.PosixPath"].status == ALLOWED and "plain data" in meta["pathlib.PosixPath"].reason
    assert meta["torch.distributed.checkpoint.metadata.Metadata"].status == ALLOWED
    # every storage record of .metadata was read from its byte range: tensors and non-tensor entries
    items = [p.where for p in res.pickles if p.where != ".metadata"]
    assert any("(entry 'step')!" in w for w in items) and any("(tensor 'model.weight')!" in w for w in items)
    assert all(w.endswith("/data.pkl") and ".distcp bytes " in w for w in items)
    r = run_cli("scan", dcp_folder)
    assert r.exit_code == 0 and "damaged zip" not in r.output and ": safe (dcp" in r.output, r.output
    # the folder's files given one by one are read the same way
    for name in (".metadata", "__0_0.distcp"):
        part = scan_file(dcp_folder / name)
        assert part.verdict == SAFE, (name, part.error, part.unsafe)
    assert inspect(dcp_folder).to_dict()["security"]["verdict"] == SAFE


def test_a_folder_walk_scans_a_dcp_folder_as_one(dcp_folder: Path, tmp_path: Path, run_cli) -> None:
    root = tmp_path / "runs"
    (root / "a").mkdir(parents=True)
    _save_dcp({"w": torch.ones(2)}, root / "a" / "dcp")
    torch.save({"w": torch.ones(2)}, root / "a" / "plain.pt")
    results = scan([root])
    assert sorted((Path(r.path).name, r.format, r.verdict) for r in results) == [
        ("dcp", "dcp", SAFE), ("plain.pt", "torch-zip", SAFE)]
    r = run_cli("scan", root)
    assert r.exit_code == 0 and "2 files: 2 safe" in r.output


def test_a_payload_in_dcp_metadata_is_dangerous(dcp_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "hostile"
    folder.mkdir()
    for f in dcp_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    meta = pickle.loads((folder / ".metadata").read_bytes())  # torch's own classes: what DCP's reader does
    meta.planner_data["evil"] = Payload()
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    res = scan_file(folder)
    assert res.verdict == DANGEROUS and res.exit_code == 1
    (bad,) = [g for g in res.globals if g.status == DANGEROUS]
    assert bad.name in ("posix.system", "os.system") and bad.where == [".metadata"]
    assert inspect(folder).to_dict()["security"]["verdict"] == DANGEROUS
    assert not os.path.exists(MARKER)


def test_a_payload_in_a_distcp_entry_is_dangerous(tmp_path: Path) -> None:
    folder = _save_dcp({"w": torch.ones(3), "evil": Payload()}, tmp_path / "dcp")
    res = scan_file(folder)
    assert res.verdict == DANGEROUS
    (bad,) = [g for g in res.globals if g.status == DANGEROUS]
    (where,) = bad.where
    assert where.startswith("__0_0.distcp bytes ") and "(entry 'evil')!" in where
    assert not [p for p in res.pickles if p.hidden]  # DCP's load planner reads it: torch.load(weights_only=False)
    assert not os.path.exists(MARKER)


def test_dcp_allows_its_classes_only_in_metadata(tmp_path: Path) -> None:
    """A pathlib path stored as a non-tensor entry is rebuilt by torch.load(weights_only=False): it needs trust
    there, while the same name in .metadata is DCP's own data."""
    res = scan_file(_save_dcp({"w": torch.ones(1), "out": Path("/data/run")}, tmp_path / "dcp"))
    assert res.verdict == NEEDS_TRUST and res.exit_code == 4
    levels = {(g.name, g.status) for g in res.globals if g.name == "pathlib.PosixPath"}
    assert levels == {("pathlib.PosixPath", ALLOWED), ("pathlib.PosixPath", NEEDS_TRUST)}


def test_bytes_no_record_names_are_scanned_as_hidden(tmp_path: Path) -> None:
    folder = _save_dcp({"w": torch.ones(3)}, tmp_path / "dcp")
    with open(folder / "__0_0.distcp", "ab") as f:
        f.write(pickle.dumps(Payload(), protocol=2))
    res = scan_file(folder)
    assert res.verdict == DANGEROUS
    (bad,) = [p for p in res.pickles if p.globals and p.hidden]
    assert "named by no record" in bad.where
    assert any("named by no record of .metadata" in n for n in res.notes)


def test_a_truncated_distcp_is_unreadable_not_safe(tmp_path: Path) -> None:
    folder = _save_dcp({"w": torch.ones(3), "b": torch.zeros(5)}, tmp_path / "dcp")
    data = (folder / "__0_0.distcp").read_bytes()
    (folder / "__0_0.distcp").write_bytes(data[:len(data) // 2])
    res = scan_file(folder)
    assert res.verdict == "incomplete" and res.exit_code == 5  # cut short (issue 36): never safe
    assert any("runs past the end" in why for why in res.incomplete)
    (folder / "__0_0.distcp").unlink()
    assert any("missing" in why for why in scan_file(folder).incomplete)


def test_accelerate_save_state_folder(tmp_path: Path, run_cli) -> None:
    """accelerate's own save_state: model, optimizer and scheduler are safe; random_states_0.pkl (numpy's RNG state)
    is recognised and needs trust, never dangerous; with a payload added it is dangerous and not recognised."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc.save_state(str(tmp_path / "state"), safe_serialization=False)
    results = {Path(r.path).name: r for r in scan([tmp_path / "state"])}
    assert {n: r.verdict for n, r in results.items()} == {
        "optimizer.bin": SAFE, "pytorch_model.bin": SAFE, "scheduler.bin": SAFE, "random_states_0.pkl": NEEDS_TRUST}
    rng = results["random_states_0.pkl"]
    assert rng.recognised is not None and rng.recognised[0] == ACCELERATE_RNG
    r = run_cli("scan", tmp_path / "state")
    assert r.exit_code == 4 and "accelerate's save_state RNG state" in r.output
    states = torch.load(tmp_path / "state" / "random_states_0.pkl", weights_only=False)
    states["extra"] = Payload()
    torch.save(states, tmp_path / "random_states_0.pkl")
    res = scan_file(tmp_path / "random_states_0.pkl")
    assert res.verdict == DANGEROUS and res.recognised is None


def test_sharded_bin_set(tmp_path: Path, run_cli) -> None:
    """A sharded .bin set laid out as transformers' save_pretrained(safe_serialization=False) writes it: every shard
    is scanned, the set is safe; a payload in one shard makes inspect of the set dangerous, naming the shard."""
    folder = tmp_path / "model"
    folder.mkdir()
    shards = {"pytorch_model-00001-of-00002.bin": {"a.weight": torch.ones(2, 2)},
              "pytorch_model-00002-of-00002.bin": {"b.weight": torch.zeros(3)}}
    for name, sd in shards.items():
        torch.save(sd, folder / name)
    index = {"metadata": {"total_size": 28}, "weight_map": {k: n for n, sd in shards.items() for k in sd}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    r = run_cli("scan", folder)
    assert r.exit_code == 0 and "2 files: 2 safe" in r.output
    assert inspect(folder).to_dict()["security"]["verdict"] == SAFE
    torch.save({"b.weight": torch.zeros(3), "evil": Payload()}, folder / "pytorch_model-00002-of-00002.bin")
    sec = inspect(folder).to_dict()["security"]
    assert sec["verdict"] == DANGEROUS
    assert sec["dangerous"][0]["where"] == ["pytorch_model-00002-of-00002.bin!pytorch_model-00002-of-00002/data.pkl"]
    assert run_cli("scan", folder).exit_code == 1


def test_a_record_pointing_outside_the_folder_is_unreadable(dcp_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "escape"
    folder.mkdir()
    for f in dcp_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    meta = pickle.loads((folder / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = "../outside.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    res = scan_file(folder)
    assert res.verdict == "error" and "points outside the folder" in (res.error or "")


def test_damaged_dcp_folders_never_raise(dcp_folder: Path, tmp_path: Path) -> None:
    """Bytes flipped or cut anywhere in .metadata or the .distcp file: scan answers (unreadable, or a verdict),
    never an exception."""
    import random

    rng = random.Random(1234)
    originals = {f.name: f.read_bytes() for f in dcp_folder.iterdir()}
    for i in range(60):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        target = rng.choice(sorted(originals))
        for name, data in originals.items():
            if name == target:
                b = bytearray(data)
                if rng.random() < 0.3:
                    b = b[:rng.randrange(len(b))]
                else:
                    for _ in range(rng.randint(1, 8)):
                        b[rng.randrange(len(b))] = rng.randrange(256)
                data = bytes(b)
            (folder / name).write_bytes(data)
        res = scan_file(folder)
        assert res.verdict in (SAFE, NEEDS_TRUST, DANGEROUS, "error", "incomplete")
