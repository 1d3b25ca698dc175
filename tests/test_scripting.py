"""Scripting conventions of issue 13: ``--json`` (one versioned schema per command, parsed here), ``--quiet``,
``-o -``, ``--force`` and one-line usage errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def ckpts(tmp_path: Path) -> dict[str, Path]:
    """A DataParallel state_dict, a full-model pickle and a checkpoint holding a numpy array, all tagged cpu."""
    import numpy as np

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    out = {"dp": tmp_path / "dp.pt", "full": tmp_path / "full.pt", "np": tmp_path / "np.pt"}
    torch.save(torch.nn.DataParallel(net).state_dict(), out["dp"])
    torch.save(net, out["full"])
    torch.save({"w": torch.ones(3), "arr": np.arange(4, dtype=np.float32)}, out["np"])
    return out


def _json(r: Any, command: str) -> dict[str, Any]:
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["schema"] == f"ckptool.{command}/1"
    return d


def test_json_of_every_writing_command(run_cli, ckpts: dict[str, Path], tmp_path: Path) -> None:
    dp, full = ckpts["dp"], ckpts["full"]
    d = _json(run_cli("remap", dp, "--to", "cpu", "-o", tmp_path / "r.pt", "--json"), "remap")
    assert d["dst"] == str(tmp_path / "r.pt") and d["storages"] == 4 and d["retagged"] == []
    assert d["load_hint"]["code"].startswith("torch.load(")
    d = _json(run_cli("remap", dp, "--map", "cpu=cuda:0", "--unwrap", "-o", tmp_path / "r2.pt", "--json"), "remap")
    assert d["retagged"] == [{"from": "cpu", "to": "cuda:0", "storages": 4}] and d["renamed"] == 4
    d = _json(run_cli("strip-dataparallel", dp, "-o", tmp_path / "s.pt", "--json"), "strip-dataparallel")
    assert d["operation"] == "strip-dataparallel" and d["removed"] == {"module.": 4}
    assert d["changes"][0]["renamed"] == 4
    d = _json(run_cli("strip-prefix", dp, "module.", "-o", tmp_path / "p.pt", "--json"), "strip-prefix")
    assert d["renamed"] == 4
    d = _json(run_cli("add-prefix", tmp_path / "s.pt", "_orig_mod.", "-o", tmp_path / "a.pt", "--json"),
              "add-prefix")
    assert d["added"] == {"_orig_mod.": 4}
    d = _json(run_cli("unwrap", dp, "--json"), "unwrap")
    assert d["dst"] == str(tmp_path / "dp.unwrapped.pt")
    d = _json(run_cli("extract-state-dict", full, "--json"), "extract-state-dict")
    assert d["keys"] == ["0.weight", "0.bias", "2.weight", "2.bias"] and d["trusted"] is False
    d = _json(run_cli("sanitize", ckpts["np"], "--json"), "sanitize")
    assert [c["path"] for c in d["converted"]] == ["arr"] and d["new_storages"] == 1
    d = _json(run_cli("convert", dp, "-o", tmp_path / "c.safetensors", "--json"), "convert")
    assert d["format_out"] == "safetensors" and d["tensors"] == 4 and d["verified"] is True


def test_json_with_quiet_prints_only_the_json(run_cli, ckpts: dict[str, Path], tmp_path: Path) -> None:
    r = run_cli("remap", ckpts["dp"], "--to", "cpu", "-o", tmp_path / "q.pt", "--json", "--quiet")
    assert json.loads(r.stdout)["schema"] == "ckptool.remap/1" and r.stderr == ""


@pytest.mark.parametrize("args", [
    ["remap", "{dp}", "--to", "cpu"],
    ["strip-dataparallel", "{dp}"],
    ["unwrap", "{dp}"],
    ["extract-state-dict", "{full}"],
    ["sanitize", "{np}"],
    ["convert", "{dp}", "-o", "{tmp}/c.pt"],
])
def test_quiet_prints_nothing(run_cli, ckpts: dict[str, Path], tmp_path: Path, args: list[str]) -> None:
    args = [a.format(tmp=tmp_path, **ckpts) for a in args]
    r = run_cli(*args, "-q")
    assert r.exit_code == 0 and r.output == ""
    assert len(list(tmp_path.iterdir())) == 4  # the three inputs and the output


@pytest.mark.parametrize("args", [
    ["remap", "{dp}", "--to", "cpu", "-o", "-"],
    ["unwrap", "{dp}", "-o", "-"],
    ["sanitize", "{np}", "-o", "-"],
    ["extract-state-dict", "{full}", "-o", "-"],
    ["convert", "{dp}", "-o", "-"],
])
def test_stdout_output_is_a_clear_usage_error(run_cli, ckpts: dict[str, Path], tmp_path: Path,
                                              args: list[str]) -> None:
    r = run_cli(*[a.format(**ckpts) for a in args])
    lines = r.output.splitlines()
    assert r.exit_code == 2 and len(lines) == 2, r.output
    assert lines[0].startswith("Error: -o - (stdout) is not supported: ") and "seek" in lines[0]
    assert lines[1].startswith("Try '") and lines[1].endswith(f" {args[0]} --help' for help.")
    assert not (tmp_path / "-").exists() and len(list(tmp_path.iterdir())) == 3


@pytest.mark.parametrize("args, default", [
    (["remap", "{dp}", "--to", "cpu"], "dp.cpu.pt"),
    (["strip-dataparallel", "{dp}"], "dp.stripped.pt"),
    (["unwrap", "{dp}"], "dp.unwrapped.pt"),
    (["extract-state-dict", "{full}"], "full.state_dict.pth"),
    (["sanitize", "{np}"], "np.sanitized.pt"),
])
def test_existing_default_output_needs_force(run_cli, ckpts: dict[str, Path], tmp_path: Path, args: list[str],
                                             default: str) -> None:
    args = [a.format(**ckpts) for a in args]
    out = tmp_path / default
    out.write_bytes(b"keep me")
    r = run_cli(*args)
    expected = (f"Error: output {out} exists; pass --force to replace it, or choose another -o path\n"
                f"Try 'cli {args[0]} --help' for help.\n")
    assert r.exit_code == 2 and r.output == expected
    assert out.read_bytes() == b"keep me"
    assert run_cli(*args, "--force").exit_code == 0 and out.read_bytes() != b"keep me"


def test_convert_refuses_an_existing_file_and_shard_set(run_cli, ckpts: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "m.safetensors"
    dst.write_bytes(b"x")
    r = run_cli("convert", ckpts["dp"], "-o", dst)
    assert r.exit_code == 2 and "pass --force" in r.output and dst.read_bytes() == b"x"
    assert run_cli("convert", ckpts["dp"], "-o", dst, "--force").exit_code == 0
    shards = tmp_path / "shards"
    assert run_cli("convert", ckpts["dp"], "-o", f"{shards}/", "--max-shard-size", "100B").exit_code == 0
    r = run_cli("convert", ckpts["dp"], "-o", f"{shards}/", "--max-shard-size", "100B")
    assert r.exit_code == 2 and "already holds a shard set" in r.output
    assert run_cli("convert", ckpts["dp"], "-o", f"{shards}/", "--max-shard-size", "100B", "--force").exit_code == 0


def test_in_place_needs_no_force(run_cli, ckpts: dict[str, Path]) -> None:
    r = run_cli("strip-dataparallel", ckpts["dp"], "--in-place")
    assert r.exit_code == 0, r.output
    assert not any(k.startswith("module.") for k in torch.load(ckpts["dp"], weights_only=True))


@pytest.mark.torchfree
@pytest.mark.parametrize("args, message", [
    (["remap"], "Error: Missing argument 'SRC'."),
    (["remap", "x.pt", "--nonsense"], "Error: No such option '--nonsense'."),  # (--bogus: "Did you mean '--jobs'?")
    (["inspect", "x.pt", "--limit", "many"],
     "Error: Invalid value for '--limit': 'many' is not a valid integer range."),
])
def test_usage_errors_are_one_line_plus_the_help_hint(run_cli, args: list[str], message: str) -> None:
    r = run_cli(*args)
    assert r.exit_code == 2
    lines = r.output.splitlines()
    assert len(lines) == 2 and lines[0] == message and lines[1].endswith(f" {args[0]} --help' for help.")


@pytest.mark.torchfree
def test_unknown_command_and_group_option(run_cli) -> None:
    for args in (["nope"], ["--nope"]):
        r = run_cli(*args)
        lines = r.output.splitlines()
        assert r.exit_code == 2 and len(lines) == 2 and lines[1].endswith(" --help' for help."), r.output


def test_every_command_takes_quiet_and_progress(run_cli) -> None:
    from ckptool.cli import COMMANDS, cli

    for name in COMMANDS:
        opts = {o for p in cli.commands[name].params for o in p.opts}
        assert {"--quiet", "-q", "--progress"} <= opts, name
