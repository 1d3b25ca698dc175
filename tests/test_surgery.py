"""Key surgery (issue 29): `ckptool rename` by regex rules and `ckptool filter` by globs, on files and in memory.

Checked against torch itself: every output is opened by executing the "Load it with:" line the CLI printed (with a
real nn.Module for `model`), `_metadata` is compared with what the renamed model's own `state_dict()` carries, and
storage sharing with `storage_groups` of the loaded objects.
"""

from __future__ import annotations

import json
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import storage_groups
from models import LpipsLinearLayers
from torch import nn

import ckptool
from ckptool.errors import KeyCollisionError, PrefixNotFoundError, UnsupportedError, UsageError
from ckptool.ops.surgery.edit import load_rules


# ------------------------------------------------------------------------------------------------ fixtures
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.head = nn.Linear(4, 2)


class Renamed(nn.Module):
    """Net with `features` called `backbone` and its layers `layer0`, `layer1`."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.layer0 = nn.Conv2d(3, 4, 3)
        self.backbone.layer1 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def dp_file(tmp_path: Path) -> Path:
    """A DataParallel state_dict (`module.` keys, `_metadata` with the wrapper's levels), as torch saves it."""
    p = tmp_path / "dp.pth"
    torch.save(nn.DataParallel(_net()).state_dict(), p)
    return p


@pytest.fixture
def net_file(tmp_path: Path) -> Path:
    p = tmp_path / "net.pth"
    torch.save(_net().state_dict(), p)
    return p


@pytest.fixture
def train_file(tmp_path: Path) -> Path:
    """A training checkpoint: model and EMA state_dicts, optimizer state, an epoch."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    p = tmp_path / "train.pth"
    torch.save({"epoch": 3, "state_dict": net.state_dict(), "state_dict_ema": _net().state_dict(),
                "optimizer": opt.state_dict()}, p)
    return p


@pytest.fixture
def tied_file(tmp_path: Path) -> Path:
    emb = torch.randn(5, 3)
    sd = OrderedDict([("model.emb.weight", emb), ("model.lm_head.weight", emb), ("model.bias", torch.randn(3))])
    p = tmp_path / "tied.pth"
    torch.save(sd, p)
    return p


def _hint(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.startswith("Load it with: ")]
    assert len(lines) == 1, output
    return lines[0][len("Load it with: "):]


def _exec_hint(output: str, model: nn.Module | None = None) -> Any:
    """Run the printed load line as the user would (`torch`, `safetensors` imported, `model` their module)."""
    import safetensors.torch

    scope: dict[str, Any] = {"torch": torch, "safetensors": safetensors, "model": model}
    code = _hint(output)
    return eval(code, scope)


# ------------------------------------------------------------------------------------------------ rename
def test_rule_is_strip_dataparallel_byte_for_byte(dp_file: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    ckptool.strip_dataparallel(dp_file, a)
    res = ckptool.rename(dp_file, b, rules=[r"^module\.="])
    assert a.read_bytes() == b.read_bytes()
    assert res.renamed == 9 and [(u.rule, u.matched) for u in res.rules] == [(r"^module\.=", 9)]


def test_rule_is_add_prefix_byte_for_byte(net_file: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    ckptool.add_prefix(net_file, "module.", a)
    ckptool.rename(net_file, b, rules=[("^", "module.")])
    assert a.read_bytes() == b.read_bytes()


def test_rules_with_groups_rename_metadata_and_load_strict(net_file: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "r.pth"
    r = run_cli("rename", net_file, "--rule", r"^features\.(\d+)\.=backbone.layer\1.", "-o", out)
    assert r.exit_code == 0, r.output
    assert "renamed 7 of 9 keys" in r.output
    assert r"Rule 1 ^features\.(\d+)\.=backbone.layer\1.: matched 7 keys" in r.output
    model = Renamed()
    _exec_hint(r.output, model)  # model.load_state_dict(torch.load(...)), strict
    sd = torch.load(out, weights_only=True)
    assert dict(sd._metadata) == {k: v for k, v in Renamed().state_dict()._metadata.items() if k != "backbone"}
    assert torch.equal(model.backbone.layer0.weight, _net().features[0].weight)


def test_rules_apply_in_order_each_to_the_previous_result(net_file: Path) -> None:
    sd = torch.load(net_file, weights_only=True)
    out = ckptool.rename(sd, rules=[r"^features\.=f.", r"^f\.0\.=conv."])
    assert list(out)[:2] == ["conv.weight", "conv.bias"]
    assert next(iter(sd)) == "features.0.weight"  # input untouched


def test_tied_weights_stay_tied(tied_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.pth"
    ckptool.rename(tied_file, out, rules=[r"^model\.="])
    loaded = torch.load(out, weights_only=True)
    assert storage_groups(loaded) == {frozenset({"emb.weight", "lm_head.weight"})}


def test_key_renames_one_state_dict_and_leaves_the_optimizer(train_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.pth"
    ckptool.rename(train_file, out, rules=[r"^features\.=backbone."], key="state_dict_ema")
    before, after = torch.load(train_file, weights_only=True), torch.load(out, weights_only=True)
    assert list(after["state_dict"]) == list(before["state_dict"])
    assert next(iter(after["state_dict_ema"])) == "backbone.0.weight"
    assert after["optimizer"]["state"].keys() == before["optimizer"]["state"].keys()
    assert after["epoch"] == 3


def test_collision_is_refused_and_nothing_written(net_file: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "c.pth"
    merged = r"'x\.weight' <- 'features\.0\.weight', 'features\.1\.weight', 'head\.weight'"
    with pytest.raises(KeyCollisionError, match=merged):
        ckptool.rename(net_file, out, rules=[r"^.*\.weight$=x.weight"])
    r = run_cli("rename", net_file, "--rule", r"^.*\.weight$=x.weight", "-o", out)
    assert r.exit_code == 1 and "renaming would merge keys" in r.output
    assert not out.exists()


def test_unused_rule_is_refused_unless_allowed(net_file: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "u.pth"
    r = run_cli("rename", net_file, "--rule", r"^features\.=f.", "--rule", r"^classifier\.=head.", "-o", out)
    assert r.exit_code == 1 and "rule 2 (^classifier\\.=head.) matches no key" in r.output
    assert not out.exists()
    r = run_cli("rename", net_file, "--rule", r"^features\.=f.", "--rule", r"^classifier\.=head.", "-o", out,
                "--allow-unused")
    assert r.exit_code == 0 and "Rule 2 ^classifier\\.=head.: matched 0 keys" in r.output
    assert next(iter(torch.load(out, weights_only=True))) == "f.0.weight"


def test_bad_rules_are_usage_errors(net_file: Path, run_cli) -> None:
    for rule, why in [("(unclosed=x", "missing"), (r"^features\.=\2", "invalid group reference"), ("nosep", "REGEX=")]:
        r = run_cli("rename", net_file, "--rule", rule, "--dry-run")
        assert r.exit_code == 2 and why in r.output, r.output
    assert run_cli("rename", net_file, "--dry-run").exit_code == 2


def test_dry_run_prints_old_new_and_writes_nothing(net_file: Path, tmp_path: Path, run_cli) -> None:
    r = run_cli("rename", net_file, "--rule", r"^head\.=classifier.", "--dry-run")
    assert r.exit_code == 0
    assert "would rename 2 of 9 keys:\n  head.weight -> classifier.weight\n  head.bias -> classifier.bias\n" in r.output
    assert "Dry run: nothing was written" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.pth"]


@pytest.mark.parametrize("ext", ["json", "yaml", "toml"])
def test_rules_file(net_file: Path, tmp_path: Path, run_cli, ext: str) -> None:
    rules = [[r"^features\.(\d+)\.", r"backbone.layer\1."]]
    text = {"json": json.dumps(rules),
            "yaml": "- ['^features\\.(\\d+)\\.', 'backbone.layer\\1.']\n",
            "toml": "rules = [['^features\\.(\\d+)\\.', 'backbone.layer\\1.']]\n"}[ext]
    f = tmp_path / f"rules.{ext}"
    f.write_text(text)
    assert load_rules(f) == [tuple(r) for r in rules]
    out = tmp_path / "r.pth"
    r = run_cli("rename", net_file, "--rules", f, "-o", out)
    assert r.exit_code == 0, r.output
    Renamed().load_state_dict(torch.load(out, weights_only=True))


def test_rules_file_of_the_wrong_shape(tmp_path: Path) -> None:
    f = tmp_path / "r.json"
    f.write_text('{"^a": "b"}')
    with pytest.raises(UsageError, match="list of"):
        load_rules(f)


def test_in_memory_rename_renames_metadata_and_keeps_values(dp_file: Path) -> None:
    sd = torch.load(dp_file, weights_only=True)
    out = ckptool.rename(sd, rules=[r"^module\.="])
    ref = _net().state_dict()
    assert list(out) == list(ref) and dict(out._metadata) == dict(ref._metadata)
    assert all(out[k] is sd["module." + k] for k in out)
    assert next(iter(sd)).startswith("module.")
    with pytest.raises(PrefixNotFoundError):
        ckptool.rename(sd, rules=[r"^nothing\.="])


def test_safetensors_rename_keeps_tied_names(tied_file: Path, tmp_path: Path, run_cli) -> None:
    st, out = tmp_path / "tied.safetensors", tmp_path / "r.safetensors"
    ckptool.convert(tied_file, st)
    r = run_cli("rename", st, "--rule", r"^model\.=", "-o", out)
    assert r.exit_code == 0, r.output
    back = tmp_path / "back.pth"
    ckptool.convert(out, back)  # reads the sharing records: they name the new keys
    assert storage_groups(torch.load(back, weights_only=True)) == {frozenset({"emb.weight", "lm_head.weight"})}


def test_full_model_pickle_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "full.pt"
    torch.save(nn.Linear(2, 2), p)
    with pytest.raises(UnsupportedError, match="extract-state-dict"):
        ckptool.rename(p, tmp_path / "o.pt", rules=["^=x."])


# ------------------------------------------------------------------------------------------------ filter
def test_filter_drops_listed_keys_and_their_bytes(net_file: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "f.pth"
    r = run_cli("filter", net_file, "--drop", "head.*", "-o", out)
    assert r.exit_code == 0, r.output
    assert "kept 7 of 9 keys; dropped 2:\n  head.weight\n  head.bias\n" in r.output
    model = Backbone()
    _exec_hint(r.output, model)
    names = zipfile.ZipFile(out).namelist()
    assert sum("/data/" in n for n in names) == 7  # the head's storages are not in the file
    assert dict(torch.load(out, weights_only=True)._metadata) == dict(_net().state_dict()._metadata)


def test_filter_keep_and_drop(net_file: Path) -> None:
    sd = torch.load(net_file, weights_only=True)
    out = ckptool.filter_keys(sd, keep=["features.*"], drop=["*.num_batches_tracked"])
    assert list(out) == [k for k in sd if k.startswith("features.") and not k.endswith("num_batches_tracked")]
    assert out._metadata == sd._metadata and len(sd) == 9


def test_filter_key_extracts_the_ema_state_dict(train_file: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "ema.pth"
    r = run_cli("filter", train_file, "--key", "state_dict_ema", "--drop", "head.*", "-o", out)
    assert r.exit_code == 0, r.output
    assert "extracted state_dict 'state_dict_ema': kept 7 of 9 keys" in r.output
    _exec_hint(r.output, Backbone())  # strict: exactly the backbone's keys
    sd = torch.load(out, weights_only=True)
    ema = torch.load(train_file, weights_only=True)["state_dict_ema"]
    assert list(sd) == list(ema)[:7] and all(torch.equal(sd[k], ema[k]) for k in sd)
    assert sum("/data/" in n for n in zipfile.ZipFile(out).namelist()) == 7  # no optimizer, no other state_dict


def test_filter_keeps_the_tie_of_what_stays(tied_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "f.pth"
    ckptool.filter_keys(tied_file, out, drop="model.bias")
    assert storage_groups(torch.load(out, weights_only=True)) == {frozenset({"model.emb.weight",
                                                                             "model.lm_head.weight"})}
    out2 = tmp_path / "f2.pth"
    ckptool.filter_keys(tied_file, out2, drop="model.lm_head.*")  # the storage stays: emb uses it
    sd = torch.load(out2, weights_only=True)
    assert list(sd) == ["model.emb.weight", "model.bias"]


def test_filter_glob_matching_nothing_is_refused(net_file: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "f.pth"
    r = run_cli("filter", net_file, "--drop", "classifier.*", "-o", out)
    assert r.exit_code == 1 and "--drop 'classifier.*' matches no key" in r.output
    assert not out.exists()
    with pytest.raises(UsageError, match="drop every key"):
        ckptool.filter_keys(net_file, out, drop="*")
    with pytest.raises(UsageError, match="nothing to filter"):
        ckptool.filter_keys(net_file, out)
    assert not out.exists()


def test_filter_safetensors(tied_file: Path, tmp_path: Path, run_cli) -> None:
    st, out = tmp_path / "t.safetensors", tmp_path / "f.safetensors"
    ckptool.convert(tied_file, st)
    r = run_cli("filter", st, "--drop", "model.bias", "-o", out)
    assert r.exit_code == 0, r.output
    model = nn.Module()  # the tied pair of the file, and no bias
    model.model = nn.Module()
    model.model.emb = nn.Embedding(5, 3)
    model.model.lm_head = nn.Linear(3, 5, bias=False)
    model.model.lm_head.weight = model.model.emb.weight
    if _hint(r.output).startswith("model.load_state_dict("):  # load_file leaves out the tied name: not strict
        got = _exec_hint(r.output.replace("model.load_state_dict(", "(lambda sd: sd)("), None)
        model.load_state_dict(got, strict=False)
    else:  # safetensors.torch.load_model(model, ...), which restores tied names
        _exec_hint(r.output, model)
    assert torch.equal(model.model.lm_head.weight, torch.load(tied_file)["model.emb.weight"])


def test_filter_dry_run_writes_nothing(net_file: Path, tmp_path: Path, run_cli) -> None:
    r = run_cli("filter", net_file, "--keep", "head.*", "--dry-run")
    assert r.exit_code == 0 and "would drop 7" in r.output and "Dry run: nothing was written" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.pth"]


def test_real_checkpoint_rename_and_filter(real_dir: Path, tmp_path: Path, run_cli) -> None:
    src = real_dir / "lpips-v0.1-alex.pth"  # legacy format, tagged cuda:0
    out = tmp_path / "l.pth"
    r = run_cli("rename", src, "--rule", r"^lin(\d)\.model\.1\.=lin\1.", "--to", "cpu", "-o", out)
    assert r.exit_code == 0, r.output
    model = nn.Module()
    for i, c in enumerate(LpipsLinearLayers.CHANNELS):
        setattr(model, f"lin{i}", nn.Conv2d(c, 1, 1, bias=False))  # lpips' NetLinLayer without its Sequential
    _exec_hint(r.output, model)  # strict, on a machine without a GPU: the tags are cpu now
    assert list(torch.load(out, weights_only=True)) == [f"lin{i}.weight" for i in range(5)]
    back = tmp_path / "back.pth"
    ckptool.rename(out, back, rules=[r"^lin(\d)\.=lin\1.model.1."])
    LpipsLinearLayers().load_state_dict(torch.load(back, weights_only=True))  # torch's lpips layout again


# the page's console examples run in tests/test_docs.py (every page's)
def test_json_reports(net_file: Path, tmp_path: Path, run_cli) -> None:
    r = run_cli("rename", net_file, "--rule", r"^head\.=classifier.", "-o", tmp_path / "r.pth", "--json")
    doc = json.loads(r.output)
    assert doc["schema"] == "ckptool.rename/1" and doc["rules"] == [{"rule": r"^head\.=classifier.", "matched": 2}]
    assert doc["renames"][0] == {"path": "", "old": "head.weight", "new": "classifier.weight"}
    assert doc["renamed"] == 2 and doc["load_hint"]["code"].startswith("model.load_state_dict(")
    r = run_cli("filter", net_file, "--drop", "head.*", "-o", tmp_path / "f.pth", "--json")
    doc = json.loads(r.output)
    assert doc["schema"] == "ckptool.filter/1" and doc["changes"] == [
        {"path": "", "keys": 9, "kept": 7, "dropped": ["head.weight", "head.bias"]}]
    assert doc["globs"] == [{"kind": "drop", "glob": "head.*", "matched": 2}] and doc["storages"] == 7


def test_a_pickled_module_beside_the_state_dict_is_left_alone(tmp_path: Path) -> None:
    """Only a module whose keys would change is refused: one the rules do not touch stays in the file as it was."""
    p = tmp_path / "both.pt"
    torch.save({"model": nn.Linear(2, 2), "state_dict": _net().state_dict()}, p)
    out = tmp_path / "o.pt"
    res = ckptool.rename(p, out, rules=[r"^features\.=backbone."])
    assert res.renamed == 7
    loaded = torch.load(out, weights_only=False)
    assert isinstance(loaded["model"], nn.Linear) and next(iter(loaded["state_dict"])) == "backbone.0.weight"
    with pytest.raises(UnsupportedError, match=r"'model' is a pickled nn\.Module"):
        ckptool.rename(p, out, rules=[r"weight$=w"], allow_unused=True)


def test_rename_and_filter_import_no_torch(net_file: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys, ckptool; from ckptool.cli import main\n"
            "ckptool.rename(sys.argv[1], sys.argv[2], rules=[r'^head\\.=classifier.'])\n"
            "ckptool.filter_keys(sys.argv[2], sys.argv[3], drop='classifier.*')\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported'")
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", code, str(net_file), str(tmp_path / "r.pth"), str(tmp_path / "f.pth")],
                         capture_output=True, text=True, env=env, check=False)
    assert res.returncode == 0, res.stderr
    assert list(torch.load(tmp_path / "f.pth", weights_only=True))[-1] == "features.1.num_batches_tracked"
