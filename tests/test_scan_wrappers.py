"""``ckptool scan`` sees what ships beside the weights (issue 49, items 2-3): NeMo archives (tar and tar.gz, the
layout NeMo's ``SaveRestoreConnector`` writes: ``./model_config.yaml`` beside ``./model_weights.ckpt``) with every
Hydra ``_target_`` rated, gzip streams (``.pkl.gz``) inflated within a budget, and member paths that leave the
archive (zip-slip) noted. Each danger has its benign twin, which is not called dangerous.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest

from ckptool import scan_file
from ckptool.errors import CorruptCheckpointError
from ckptool.model.allowlist import DANGEROUS, NEEDS_TRUST, UNKNOWN, rate_target
from ckptool.scanning.configs import MAX_ALIASES, hydra_targets, parse_config
from ckptool.scanning.pickles import INFLATE_BUDGET

BENIGN = b"""\
target: nemo.collections.asr.models.ctc_models.EncDecCTCModel
nemo_version: 2.0.0
model:
  sample_rate: 16000
  preprocessor:
    _target_: nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor
    window_size: 0.025
  optim:
    name: adamw
    sched:
      _target_: torch.optim.lr_scheduler.CosineAnnealingLR
      _partial_: true
"""

EVIL = BENIGN + b"""\
  decoder:
    _target_: builtins.exec
    _args_: ["import os; os.system('id')"]
"""


def _member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def _nemo(path: Path, config: bytes, weights: bytes, *, gz: bool = False, extra: dict[str, bytes] | None = None
          ) -> Path:
    """A ``.nemo`` archive as NeMo writes it (``tarfile.open(path, "w:")``, or ``"w:gz"`` for older releases, members
    under ``./``)."""
    with tarfile.open(path, "w:gz" if gz else "w:") as tf:
        _member(tf, "./model_config.yaml", config)
        _member(tf, "./model_weights.ckpt", weights)
        for name, data in (extra or {}).items():
            _member(tf, name, data)
    return path


def _weights() -> bytes:
    """The state_dict member: a plain pickle of an empty dict stands in for torch.save's zip (torch-free)."""
    return pickle.dumps({}, protocol=2)


def _target(res: Any, name: str) -> Any:
    found = [g for g in res.globals if g.name == name]
    assert len(found) == 1, [(g.name, g.status) for g in res.globals]
    return found[0]


@pytest.mark.torchfree
@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tar.gz"])
def test_nemo_archive_hydra_exec_is_dangerous(tmp_path: Path, gz: bool) -> None:
    """CVE-2025-23304: ``_target_: builtins.exec`` in model_config.yaml runs when NeMo restores the model."""
    res = scan_file(_nemo(tmp_path / "m.nemo", EVIL, _weights(), gz=gz))
    g = _target(res, "builtins.exec")
    assert g.status == DANGEROUS and "Hydra" in g.reason
    assert g.where == [("gzip content!" if gz else "") + "tar member ./model_config.yaml at model.decoder._target_"]
    assert res.verdict == "dangerous" and res.exit_code == 1


@pytest.mark.torchfree
@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tar.gz"])
def test_nemo_archive_benign_needs_trust(tmp_path: Path, gz: bool) -> None:
    """The benign twin: nemo.* and torch.* targets need trust (Hydra builds them), nothing is dangerous."""
    res = scan_file(_nemo(tmp_path / "m.nemo", BENIGN, _weights(), gz=gz))
    assert _target(res, "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor").status == UNKNOWN
    sched = _target(res, "torch.optim.lr_scheduler.CosineAnnealingLR")
    assert sched.status != DANGEROUS and "_partial_" in sched.reason
    assert res.verdict == "needs-trust" and res.exit_code == 4


def test_nemo_archive_with_torch_weights(tmp_path: Path) -> None:
    """The weights member as NeMo writes it (torch.save's zip inside the tar) is scanned too: a dangerous pickle
    there is found beside a benign config."""
    import torch  # not a torchfree test

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("id",))

    ok, bad = io.BytesIO(), io.BytesIO()
    torch.save({"w": torch.ones(2)}, ok)
    torch.save({"w": torch.ones(2), "x": Evil()}, bad)
    assert scan_file(_nemo(tmp_path / "ok.nemo", BENIGN, ok.getvalue())).verdict == "needs-trust"
    res = scan_file(_nemo(tmp_path / "bad.nemo", BENIGN, bad.getvalue()))
    assert res.verdict == "dangerous" and any(g.name.endswith(".system") for g in res.globals)


@pytest.mark.torchfree
@pytest.mark.parametrize(("target", "status"), [
    ("builtins.exec", DANGEROUS), ("os.system", DANGEROUS), ("subprocess.run", DANGEROUS),
    ("subprocess.Popen", DANGEROUS), ("nemo.collections.common.tokenizers.get_tokenizer", UNKNOWN),
    ("nemo.collections.asr.models.EncDecCTCModel", UNKNOWN), ("torch.optim.AdamW", UNKNOWN),
    ("not a name", NEEDS_TRUST),
])
def test_rate_target(target: str, status: str) -> None:
    assert rate_target(target)[0] == status


@pytest.mark.torchfree
def test_hydra_targets_key_paths_and_uses() -> None:
    cfg = parse_config(b"a:\n  _target_: x.Y\n  _call_: false\nb:\n- _target_: z.f\n  _partial_: true\n", "c.yaml")
    assert sorted(hydra_targets(cfg)) == [("x.Y", "a._target_", "located"), ("z.f", "b[0]._target_", "partial")]
    assert list(hydra_targets(parse_config(b'{"m": {"_target_": "os.system"}}', "io.json"))) == [
        ("os.system", "m._target_", "called")]


@pytest.mark.torchfree
def test_yaml_bomb_refused(tmp_path: Path) -> None:
    """A billion-laughs YAML is refused within its alias bound (a note), not expanded; the archive's verdict
    still comes from the rest."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 200)]
    bomb = "\n".join(lines).encode()
    with pytest.raises(CorruptCheckpointError, match="aliases"):
        parse_config(bomb, "bomb.yaml")
    assert MAX_ALIASES < 10 * 200
    res = scan_file(_nemo(tmp_path / "bomb.nemo", bomb, _weights()))
    assert any("YAML bomb" in n for n in res.notes) and res.verdict != "dangerous"


@pytest.mark.torchfree
def test_deep_yaml_refused() -> None:
    with pytest.raises(CorruptCheckpointError, match="deep"):
        parse_config(b"[" * 100_000 + b"]" * 100_000, "deep.yaml")


@pytest.mark.torchfree
def test_gzip_pickle_dangerous_and_benign(tmp_path: Path) -> None:
    """A pickle inside gzip (``.pkl.gz``): the global inside is found; the benign twin is safe."""

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("id",))

    (tmp_path / "e.pkl.gz").write_bytes(gzip.compress(pickle.dumps(Evil(), protocol=4)))
    (tmp_path / "ok.pkl.gz").write_bytes(gzip.compress(pickle.dumps({"a": [1, 2]}, protocol=4)))
    res = scan_file(tmp_path / "e.pkl.gz")
    assert res.verdict == "dangerous" and res.format == "gzip"
    assert scan_file(tmp_path / "ok.pkl.gz").verdict == "safe"


@pytest.mark.torchfree
def test_gzip_bomb_is_unreadable_not_skipped(tmp_path: Path) -> None:
    """A gzip stream inflating past the budget is an unreadable finding (exit 2), never read whole nor skipped."""
    p = tmp_path / "bomb.pkl.gz"
    p.write_bytes(gzip.compress(b"\x80\x04N" + b"\x00" * (INFLATE_BUDGET + (16 << 20)), compresslevel=1))
    res = scan_file(p)
    assert res.verdict == "error" and any("gzip bomb" in (f.error or "") for f in res.pickles)


@pytest.mark.torchfree
def test_damaged_gzip_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "cut.pkl.gz"
    p.write_bytes(gzip.compress(pickle.dumps({"a": 1}))[:12])
    assert scan_file(p).verdict in ("error", "incomplete")


@pytest.mark.torchfree
def test_member_paths_that_leave_the_archive_are_noted(tmp_path: Path) -> None:
    """zip-slip: a zip member ``../../../../tmp/evil.sh`` beside a torch zip's data.pkl, and a tar member with an
    absolute path and a link, are notes; members inside the archive are not."""
    z = tmp_path / "slip.pt"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        zf.writestr("../../../../tmp/evil.sh", b"echo hi\n")
    res = scan_file(z)
    assert any("'../../../../tmp/evil.sh'" in n and "zip-slip" in n for n in res.notes), res.notes
    t = tmp_path / "slip.nemo"
    with tarfile.open(t, "w:") as tf:
        _member(tf, "./model_config.yaml", BENIGN)
        _member(tf, "/etc/cron.d/x", b"* * * * * id\n")
        link = tarfile.TarInfo("./link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    notes = scan_file(t).notes
    assert any("'/etc/cron.d/x'" in n and "absolute" in n for n in notes), notes
    assert any("'./link'" in n and "link" in n for n in notes), notes
    assert not any("model_config.yaml" in n for n in notes)
    clean = scan_file(_nemo(tmp_path / "ok.nemo", BENIGN, _weights()))
    assert not any("archive" in n and "outside" in n for n in clean.notes)


class _System:
    def __reduce__(self) -> Any:
        return (os.system, ("id",))


@pytest.mark.parametrize("kind", ["npy", "npz"])
def test_object_npy_and_npz_are_scanned_as_pickles(tmp_path: Path, kind: str) -> None:
    """numpy.load(allow_pickle=True) unpickles an object array: the pickle after a .npy header (alone, or an .npz
    member) is read; numeric arrays hold none and are safe."""
    import numpy as np  # the torch extra (README's test command)
    evil, ok = tmp_path / f"evil.{kind}", tmp_path / f"ok.{kind}"
    if kind == "npy":
        np.save(evil, np.array([_System()], dtype=object), allow_pickle=True)
        np.save(ok, np.arange(6, dtype=np.float32).reshape(2, 3))
    else:
        np.savez(evil, a=np.arange(3), o=np.array([_System()], dtype=object))
        np.savez(ok, a=np.arange(3), b=np.ones((2, 2)))
    res = scan_file(evil)
    assert res.verdict == "dangerous" and any(g.name.endswith(".system") for g in res.globals), res.report()
    assert scan_file(ok).verdict == "safe"


def test_zlib_joblib_dump_is_inflated(tmp_path: Path) -> None:
    """joblib.dump(..., compress=3) writes a zlib stream: inflated and scanned; the malicious object inside is
    found; a benign dump with a numpy array is not called dangerous (joblib's array record needs trust)."""
    import joblib  # the test extra
    import numpy as np
    joblib.dump({"model": _System()}, tmp_path / "evil.joblib", compress=3)
    joblib.dump({"coef": np.arange(4.0), "name": "linear"}, tmp_path / "ok.joblib", compress=3)
    res = scan_file(tmp_path / "evil.joblib")
    assert res.format == "zlib" and res.verdict == "dangerous", res.report()
    ok = scan_file(tmp_path / "ok.joblib")
    assert ok.verdict != "dangerous", ok.report()
    assert any(g.name == "joblib.numpy_pickle.NumpyArrayWrapper" and g.status == NEEDS_TRUST for g in ok.globals)


@pytest.mark.torchfree
def test_7z_members_scanned(tmp_path: Path) -> None:
    """A 7z archive (py7zr, the 7z extra): each member scanned as a file; the benign twin is safe."""
    import py7zr  # in the test extra

    (tmp_path / "e.pkl").write_bytes(pickle.dumps(_System(), protocol=2))
    (tmp_path / "ok.pkl").write_bytes(pickle.dumps({"a": 1}, protocol=2))
    with py7zr.SevenZipFile(tmp_path / "evil.7z", "w") as z:
        z.write(tmp_path / "e.pkl", "weights/model.pkl")
    with py7zr.SevenZipFile(tmp_path / "ok.7z", "w") as z:
        z.write(tmp_path / "ok.pkl", "weights/model.pkl")
    res = scan_file(tmp_path / "evil.7z")
    assert res.format == "7z" and res.verdict == "dangerous"
    assert any(w.startswith("7z member weights/model.pkl") for g in res.globals for w in g.where)
    assert scan_file(tmp_path / "ok.7z").verdict == "safe"


@pytest.mark.torchfree
def test_hydra_targets_in_sarif(tmp_path: Path, run_cli: Any) -> None:
    """SARIF: a dangerous Hydra target is a CKPT006 error naming the config and key path; pickle globals keep
    CKPT001/CKPT002."""
    p = _nemo(tmp_path / "m.nemo", EVIL, pickle.dumps(_System(), protocol=2))
    r = run_cli("scan", "--format", "sarif", p)
    assert r.exit_code == 1
    results = json.loads(r.output)["runs"][0]["results"]
    (hydra,) = [x for x in results if x["ruleId"] == "CKPT006" and x["level"] == "error"]
    assert "builtins.exec" in hydra["message"]["text"] and "model.decoder._target_" in hydra["message"]["text"]
    assert any(x["ruleId"] == "CKPT001" for x in results)


@pytest.mark.torchfree
def test_wrappers_inside_a_zip_and_a_tar(tmp_path: Path) -> None:
    """A .pkl.gz member of a zip and a zlib member of a tar are scanned as files; a zip member that merely starts
    like zlib (``x^``) is a note, not an unreadable finding."""
    evil = pickle.dumps(_System(), protocol=2)
    z = tmp_path / "bundle.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("weights/model.pkl.gz", gzip.compress(evil))
        zf.writestr("notes.txt", b"x^ not zlib at all")
    res = scan_file(z)
    assert res.verdict == "dangerous" and any("gzip content" in w for g in res.globals for w in g.where)
    assert any("notes.txt" in n and "zlib" in n for n in res.notes) and all(not p.error for p in res.pickles)
    t = tmp_path / "bundle.tar"
    with tarfile.open(t, "w:") as tf:
        _member(tf, "model.joblib", zlib.compress(evil))
    assert scan_file(t).verdict == "dangerous"
