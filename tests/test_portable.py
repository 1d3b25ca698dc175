"""One pass to a portable file (issue 12, items 1, 3 and 7).

* Done-when: for each GPU-tagged fixture (zip and legacy; training checkpoint, DataParallel, Lightning, tied
  weights) and each command that writes a torch checkpoint, ``ckptool <cmd> in -o out --to cpu`` gives a file that
  ``torch.load(out, weights_only=True)`` opens with no ``map_location`` on a machine without a GPU, every tensor
  bit-exact (checked in one subprocess with ``CUDA_VISIBLE_DEVICES=``).
* No silent no-ops: a ``--map`` source that matches no storage, a prefix that matches nothing, an ``add-prefix``
  that would nest, all exit 1 and write nothing.
* ``unwrap`` removes every prefix ``inspect`` reports (Lightning's ``model.`` too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_hints import extra, run_loads  # noqa: F401 - ``extra`` is a pytest fixture used here

import ckptool
from ckptool.errors import DeviceNotFoundError, NestedPrefixError
from ckptool.model.keys import attribute_prefix, shared_prefixes, unwrap_keys

#: (fixture, command and its arguments after SRC, Python index of the source that the output holds)
_CASES: list[tuple[str, list[str], str | None]] = [
    *((n, ["remap"], None) for n in ("sd_dp_cuda0.pt", "sd_dp_cuda0_legacy.pt", "train_cuda1.pt",
                                       "train_cuda1_legacy.pt", "train_cuda1_cpustep.pt", "shared_cuda0.pt",
                                       "shared_cuda0_legacy.pt", "lightning_cuda1.ckpt",
                                       "lightning_cuda1_legacy.ckpt")),
    *((n, ["strip-dataparallel"], None) for n in ("sd_dp_cuda0.pt", "sd_dp_cuda0_legacy.pt")),
    *((n, ["unwrap"], None) for n in ("sd_dp_cuda0.pt", "sd_dp_cuda0_legacy.pt", "lightning_cuda1.ckpt",
                                        "lightning_cuda1_legacy.ckpt")),
    ("sd_dp_cuda0_legacy.pt", ["strip-prefix", "module."], None),
    ("train_cuda1.pt", ["strip-prefix", "conv."], None),
    ("train_cuda1_legacy.pt", ["add-prefix", "module.", "--key", "model_state_dict"], None),
    ("train_cuda1_cpustep.pt", ["add-prefix", "_orig_mod."], None),
    ("shared_cuda0.pt", ["strip-prefix", "tied."], None),
    ("shared_cuda0_legacy.pt", ["add-prefix", "module."], None),
    ("lightning_cuda1.ckpt", ["strip-prefix", "model."], None),
    ("lightning_cuda1_legacy.ckpt", ["add-prefix", "net.", "--key", "state_dict"], None),
    ("model_full_cuda0.pt", ["extract-state-dict"], None),
    ("model_full_cuda0_legacy.pt", ["extract-state-dict"], None),
    ("model_dp_full_cuda0.pt", ["extract-state-dict", "--unwrap"], None),
    ("model_dp_full_cuda0_legacy.pt", ["extract-state-dict"], None),
    *((n, ["convert"], "") for n in ("sd_dp_cuda0.pt", "sd_dp_cuda0_legacy.pt", "shared_cuda0.pt",
                                     "shared_cuda0_legacy.pt")),
    *((n, ["convert"], "['model_state_dict']") for n in ("train_cuda1.pt", "train_cuda1_legacy.pt",
                                                         "train_cuda1_cpustep.pt")),
    *((n, ["convert"], "['state_dict']") for n in ("lightning_cuda1.ckpt", "lightning_cuda1_legacy.ckpt")),
]


def test_to_cpu_gives_a_plain_weights_only_load(generated, extra, run_cli, tmp_path: Path) -> None:  # noqa: F811
    files = {**generated, **extra}
    cases = []
    for i, (name, cmd, index) in enumerate(_CASES):
        out = tmp_path / f"out{i}.pt"
        r = run_cli(cmd[0], files[name], *cmd[1:], "-o", out, "--to", "cpu")
        assert r.exit_code == 0, (name, cmd, r.output)
        notes = [ln for ln in r.output.splitlines() if ln.startswith("Note:")]
        # nothing kept that would need a map_location (the note on a wrapper's prefix is about the model, not tags;
        # the one on a training checkpoint's epoch... says what a torch state_dict file leaves out)
        assert all("every key starts with" in ln or "Note: the training entr" in ln for ln in notes), r.output
        ref = "src" if index is None else "src" + index
        cases.append({"code": f"torch.load({str(out)!r}, weights_only=True)", "src": str(files[name]), "ref": ref,
                      "by_key": cmd[0] == "convert"})
    failures = run_loads(cases)
    assert not failures, failures[:3]


# ------------------------------------------------------------------------------------------------ no silent no-ops
def _writers(src: Path) -> list[list[Any]]:
    return [["remap", src], ["strip-dataparallel", src], ["unwrap", src], ["strip-prefix", src, "module."],
            ["add-prefix", src, "net."], ["convert", src], ["extract-state-dict", src]]


@pytest.mark.parametrize("bad", ["cuda:7=cpu", "mps=cpu"])
def test_map_source_matching_nothing_is_an_error_in_every_writer(generated, run_cli, tmp_path: Path,
                                                                 bad: str) -> None:
    for args in _writers(generated["sd_dp_cuda0.pt"]):
        src = generated["model_full_cuda0.pt"] if args[0] == "extract-state-dict" else args[1]
        out = tmp_path / f"{args[0]}.pt"
        r = run_cli(args[0], src, *args[2:], "--map", bad, "-o", out)
        assert r.exit_code == 1, (args, r.output)
        assert "its storages carry cuda:0" in r.output and "--allow-missing" in r.output, r.output
        assert not out.exists() and not list(tmp_path.iterdir())
    # --allow-missing writes it (tags unchanged)
    r = run_cli("remap", generated["sd_dp_cuda0.pt"], "--map", bad, "--allow-missing", "-o", tmp_path / "y.pt")
    assert r.exit_code == 0 and "keeps the location tag(s) cuda:0" in r.output, r.output
    with pytest.raises(DeviceNotFoundError) as e:
        ckptool.remap(generated["sd_mixed.pt"], tmp_path / "z.pt", mapping={"cuda:7": "cpu"})
    assert e.value.found == ["cpu", "cuda:0", "cuda:1"] and not (tmp_path / "z.pt").exists()
    # a bare type matches every index
    ckptool.remap(generated["sd_mixed.pt"], tmp_path / "z.pt", mapping={"cuda": "cpu"})


def test_prefix_matching_nothing_is_an_error_in_every_writer(generated, run_cli, tmp_path: Path) -> None:
    src = generated["sd_cuda0.pt"]
    for args in (["strip-dataparallel"], ["unwrap"], ["strip-prefix", "module."],
                 ["remap", "--to", "cpu", "--strip-prefix", "module."], ["convert", "--strip-prefix", "module."]):
        out = tmp_path / "o.pt"
        r = run_cli(args[0], src, *args[1:], "-o", out)
        assert r.exit_code == 1 and "nothing was written" in r.output, (args, r.output)
        assert not out.exists()
        r = run_cli(args[0], src, *args[1:], "-o", out, "--allow-missing")
        assert r.exit_code == 0 and out.exists(), (args, r.output)
        out.unlink()


def test_add_prefix_refuses_to_nest(generated, run_cli, tmp_path: Path) -> None:
    src = generated["sd_dp_cuda0.pt"]
    for args in (["add-prefix", src, "module."], ["remap", src, "--to", "cpu", "--add-prefix", "module"]):
        r = run_cli(*args, "-o", tmp_path / "n.pt")
        assert r.exit_code == 1 and "'module.module.'" in r.output and "--allow-nested" in r.output, r.output
        assert not (tmp_path / "n.pt").exists()
    r = run_cli("add-prefix", src, "module.", "--allow-nested", "--to", "cpu", "-o", tmp_path / "n.pt")
    assert r.exit_code == 0, r.output
    assert next(iter(torch.load(tmp_path / "n.pt", weights_only=True))) == "module.module.conv.weight"
    with pytest.raises(NestedPrefixError):
        ckptool.add_prefix({"module.a.w": torch.ones(1)}, "module.")
    assert list(ckptool.add_prefix({"module.a.w": torch.ones(1)}, "module.", allow_nested=True)) == [
        "module.module.a.w"]


# ------------------------------------------------------------------------------------------------ unwrap == inspect
@pytest.mark.parametrize("keys", [
    ["model.conv.weight", "model.fc.bias"],
    ["module.model.conv.weight", "module.model.fc.bias"],
    ["_orig_mod.module.fc.weight", "_orig_mod.module.fc.bias"],
    ["net.0.weight", "net.2.weight"],
    ["model.conv.weight", "head.bias"],
])
def test_unwrap_removes_what_inspect_reports(keys: list[str]) -> None:
    prefixes = shared_prefixes(keys)
    mapping, _counts = unwrap_keys(keys)
    assert all(new == old[len("".join(prefixes)):] for old, new in mapping.items())
    assert (attribute_prefix(keys) is not None) == any(p[:-1] in ("model", "net") for p in prefixes)


def test_unwrap_lightning_file_and_memory(extra, run_cli, tmp_path: Path) -> None:  # noqa: F811
    src = extra["lightning_cuda1.ckpt"]
    r = run_cli("inspect", src)
    assert "model." in r.output
    res = ckptool.unwrap(src, tmp_path / "u.ckpt", to="cpu")
    assert res.removed == {"model.": 9}
    out = torch.load(tmp_path / "u.ckpt", weights_only=True)
    assert next(iter(out["state_dict"])) == "conv.weight"
    assert "" in out["state_dict"]._metadata and "model" not in out["state_dict"]._metadata
    assert out["hyper_parameters"] == {"lr": 1e-3, "device": "cuda:1"}  # a config string is not a tag
    loaded = torch.load(src, map_location="cpu", weights_only=True)
    mem = ckptool.unwrap(loaded)
    assert list(mem["state_dict"]) == list(out["state_dict"])
    assert list(mem["state_dict"]._metadata) == list(out["state_dict"]._metadata)
    # extract-state-dict --unwrap and convert --unwrap follow the same rule
    conv = ckptool.convert(src, tmp_path / "c.pt", unwrap=True, to="cpu")
    assert conv.renamed == 9
    assert list(torch.load(tmp_path / "c.pt", weights_only=True)) == list(out["state_dict"])
