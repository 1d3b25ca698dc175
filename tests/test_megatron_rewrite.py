"""Megatron-Core ``torch_dist`` folders rewritten by the DCP rewrites (issue 40): ``metadata.json`` and
``common.pt`` copied byte for byte, the FQNs renamed (or dropped) in ``.metadata`` together with the save plans
megatron-core caches there (``all_local_plans``), and megatron-core's own ``dist_checkpointing.load`` reading a
renamed folder back bit for bit in the fixture script's process group.

The read-back runs ``fixtures/make_megatron.py`` with a Python that has megatron-core: ``$CKPTOOL_MEGATRON_PYTHON``
(here ``/work/venv-megatron/bin/python``), else this interpreter where it imports ``megatron.core``; skipped
otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_megatron import safetensors_bytes, torch_file_bytes

from ckptool.formats.dcp import METADATA_FILE, read_dcp_metadata
from ckptool.formats.pickler import dumps

REPO = Path(__file__).resolve().parents[1]
MG = REPO / "fixtures" / "megatron-ckpts"
DIST = MG / "dist-gpt"

#: strip-prefix decoder. / a rename rule: the saved ShardedTensor key -> its key in the rewritten folder
STRIPPED = {k: k.removeprefix("decoder.") for k in (
    "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight",
    "decoder.layers.mlp.linear_fc2.weight", "decoder.final_layernorm.weight")}
RENAMED = {"decoder.layers.0.self_attention.linear_qkv.weight": "decoder.layers.0.attn.linear_qkv.weight",
           "decoder.layers.0.self_attention.linear_proj.weight": "decoder.layers.0.attn.linear_proj.weight"}
COMMANDS = {"strip-prefix": (["strip-prefix", "{src}", "decoder."], STRIPPED),
            "rename": (["rename", "{src}", "--rule", r"\.self_attention\.=.attn."], RENAMED)}


def _rewrite(run_cli: Any, how: str, out: Path) -> dict[str, str]:
    args, keys = COMMANDS[how]
    r = run_cli(*[a.format(src=DIST) for a in args], "-o", out)
    assert r.exit_code == 0, r.output
    assert "metadata.json, common.pt as they are" in r.output
    assert "Load it with: dist_checkpointing.load(model.sharded_state_dict()" in r.output
    return keys


def _plan_fqns(folder: Path) -> list[str]:
    """The FQNs the save plans cached in ``folder``'s ``.metadata`` name, read with ckptool's own reader."""
    st = read_dcp_metadata(folder).root.state
    return [it.state["index"].state["fqn"] for plan in st["all_local_plans"] for it in plan.state["items"]]


@pytest.mark.torchfree
@pytest.mark.parametrize("how", sorted(COMMANDS))
def test_rewritten_folder_keeps_megatrons_files_and_renames_its_plans(how: str, tmp_path: Path,
                                                                      run_cli: Any) -> None:
    """The rewritten folder is still a torch_dist folder: its companions byte for byte, every FQN renamed in the
    entries, records and cached plans (no old name left), and it converts to the reference's tensors under the new
    names, bit for bit."""
    out = tmp_path / "out"
    keys = _rewrite(run_cli, how, out)
    for name in ("metadata.json", "common.pt"):
        assert (out / name).read_bytes() == (DIST / name).read_bytes(), name
    entries = [e.fqn for e in read_dcp_metadata(out).entries]
    want = [keys.get(e.fqn, e.fqn) for e in read_dcp_metadata(DIST).entries]
    assert entries == want
    assert _plan_fqns(out) == [keys.get(f, f) for f in _plan_fqns(DIST)]
    assert not set(_plan_fqns(out)) & set(keys)  # no old name is left in the cached plans
    r = run_cli("convert", out, "-o", tmp_path / "m.safetensors")
    assert r.exit_code == 0, r.output
    got, _ = safetensors_bytes(tmp_path / "m.safetensors")
    ref = torch_file_bytes(MG / "dist-gpt.reference.pt")
    assert got == {keys.get(k, k): v for k, v in ref.items()}


@pytest.mark.torchfree
def test_filter_drops_the_entry_from_the_cached_plans(tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "out"
    r = run_cli("filter", DIST, "--drop", "*final_layernorm*", "-o", out)
    assert r.exit_code == 0, r.output
    assert "decoder.final_layernorm.weight" not in _plan_fqns(out)
    assert len(_plan_fqns(out)) == len(_plan_fqns(DIST)) - 1
    assert (out / "common.pt").read_bytes() == (DIST / "common.pt").read_bytes()


def _with_metadata_attribute(tmp_path: Path, name: str, value: Any) -> Path:
    """A copy of the fixture whose ``.metadata`` carries one more attribute (written by ckptool's pickler)."""
    folder = tmp_path / "src"
    shutil.copytree(DIST, folder)
    meta = read_dcp_metadata(folder)
    meta.root.state[name] = value
    (folder / METADATA_FILE).write_bytes(dumps(meta.root, protocol=2))
    return folder


@pytest.mark.torchfree
def test_an_unknown_cache_naming_a_renamed_entry_is_refused(tmp_path: Path, run_cli: Any) -> None:
    """An attribute of ``Metadata`` ckptool does not know that names a renamed FQN: refused, nothing written; one
    that names none is kept as it is; ``mcore_data`` (older megatron-core, keyed by FQN) is renamed."""
    folder = _with_metadata_attribute(tmp_path, "future_cache", {"decoder.final_layernorm.weight": 1})
    r = run_cli("strip-prefix", folder, "decoder.", "-o", tmp_path / "out")
    assert r.exit_code not in (0, 3) and "'future_cache'" in r.output and "nothing was written" in r.output, r.output
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name != "src"]
    r = run_cli("strip-prefix", folder, "embedding.", "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert read_dcp_metadata(tmp_path / "out").root.state["future_cache"] == {"decoder.final_layernorm.weight": 1}
    shutil.rmtree(folder)
    folder = _with_metadata_attribute(tmp_path, "mcore_data", {"decoder.final_layernorm.weight": {"x": 1}})
    r = run_cli("strip-prefix", folder, "decoder.", "-o", tmp_path / "out2")
    assert r.exit_code == 0, r.output
    assert read_dcp_metadata(tmp_path / "out2").root.state["mcore_data"] == {"final_layernorm.weight": {"x": 1}}


def _megatron_python() -> str:
    """``$CKPTOOL_MEGATRON_PYTHON``, else this interpreter when it imports megatron-core; skips otherwise."""
    python = os.environ.get("CKPTOOL_MEGATRON_PYTHON")
    if python:
        return python
    pytest.importorskip("megatron.core")
    return sys.executable


def _readback(folder: Path, out: Path, keys: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_megatron_python(), str(REPO / "fixtures" / "make_megatron.py"), str(out), "readback",
                           str(folder), "--keys", json.dumps(keys)],
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("how", sorted(COMMANDS))
def test_megatron_loads_a_folder_ckptool_rewrote(how: str, tmp_path: Path, run_cli: Any) -> None:
    """megatron-core's ``dist_checkpointing.load``, in the fixture script's 2-process gloo group, reads the folder
    ckptool rewrote into a sharded state dict whose keys are the new ones: every rank's tensors equal, bit for bit,
    what was saved, and ``common.pt``'s entries come back. The same load asking for the old keys fails (the
    rename is real)."""
    _megatron_python()
    out = tmp_path / "out"
    keys = _rewrite(run_cli, how, out)
    p = _readback(out, tmp_path / "rb", keys)
    assert p.returncode == 0 and p.stdout.count(": equal") == 2, p.stdout + p.stderr[-4000:]
    if how == "strip-prefix":
        p = _readback(out, tmp_path / "rb", {})
        assert p.returncode != 0, p.stdout


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_common_pt_is_copied_never_run(tmp_path: Path, run_cli: Any) -> None:
    """A ``common.pt`` whose pickle would run ``os.system``: the rewrite copies its bytes and runs nothing (it is
    never unpickled but by ckptool's restricted reader, and the rewrite does not even read it)."""
    torch = pytest.importorskip("torch")
    marker = tmp_path / "PWNED"
    folder = tmp_path / "src"
    shutil.copytree(DIST, folder)
    common = torch.load(folder / "common.pt", weights_only=False)  # the committed fixture
    common["args"] = _Payload(marker)
    torch.save(common, folder / "common.pt")
    r = run_cli("strip-prefix", folder, "decoder.", "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert not marker.exists()
    assert (tmp_path / "out" / "common.pt").read_bytes() == (folder / "common.pt").read_bytes()


@pytest.mark.torchfree
def test_a_companion_that_does_not_copy_back_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies of ``metadata.json`` / ``common.pt`` are compared with their sources before the folder is put in
    place: a difference is an error, and no output or scratch folder is left."""
    import ckptool
    from ckptool.errors import VerificationError
    from ckptool.ops.rewrite import layouts

    monkeypatch.setattr(layouts.filecmp, "cmp", lambda *a, **k: False)
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    with pytest.raises(VerificationError, match=r"metadata\.json differs"):
        ckptool.strip_prefix(DIST, "decoder.", out)
    assert list(out.parent.iterdir()) == []
