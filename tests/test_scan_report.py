"""``scan`` where security teams work: ``--format sarif`` (a SARIF 2.1.0 log), a recursive folder scan with a
summary table, and the pre-commit hook (``.pre-commit-hooks.yaml``)."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptool.ops.scan.sarif import RULES, to_sarif
from ckptool.scanning.entry import scan

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
import hostile_corpus as hc

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed


class _Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, ("true",)


# The parts of the SARIF 2.1.0 schema (https://json.schemastore.org/sarif-2.1.0.json, OASIS SARIF v2.1.0 section 3)
# that every log must satisfy: required properties, the version constant, the result levels and the shapes of the
# objects ckptool writes.
_MESSAGE = {"type": "object", "anyOf": [{"required": ["text"]}, {"required": ["id"]}],
            "properties": {"text": {"type": "string"}}}
_LOCATION = {"type": "object", "properties": {
    "physicalLocation": {"type": "object", "anyOf": [{"required": ["address"]}, {"required": ["artifactLocation"]}],
                         "properties": {"artifactLocation": {"type": "object", "properties": {
                             "uri": {"type": "string", "format": "uri-reference"}}}}},
    "logicalLocations": {"type": "array", "minItems": 0, "uniqueItems": True, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "fullyQualifiedName": {"type": "string"},
                                         "kind": {"type": "string"}}}}}}
SARIF_SUBSET: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object", "required": ["version", "runs"],
    "properties": {
        "$schema": {"type": "string", "format": "uri"},
        "version": {"enum": ["2.1.0"]},
        "runs": {"type": ["array", "null"], "minItems": 0, "items": {
            "type": "object", "required": ["tool"],
            "properties": {
                "tool": {"type": "object", "required": ["driver"], "properties": {"driver": {
                    "type": "object", "required": ["name"],
                    "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                   "rules": {"type": "array", "uniqueItems": True, "items": {
                                       "type": "object", "required": ["id"],
                                       "properties": {"id": {"type": "string"},
                                                      "shortDescription": _MESSAGE, "fullDescription": _MESSAGE,
                                                      "defaultConfiguration": {"type": "object", "properties": {
                                                          "level": {"enum": ["none", "note", "warning",
                                                                             "error"]}}}}}}}}}},
                "artifacts": {"type": "array", "items": {"type": "object", "properties": {
                    "location": {"type": "object", "properties": {"uri": {"type": "string"}}}}}},
                "results": {"type": "array", "items": {
                    "type": "object", "required": ["message"],
                    "properties": {"ruleId": {"type": "string"}, "ruleIndex": {"type": "integer", "minimum": -1},
                                   "level": {"enum": ["none", "note", "warning", "error"]},
                                   "message": _MESSAGE,
                                   "locations": {"type": "array", "items": _LOCATION}}}},
            }}},
    },
}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Three files in nested folders: a safe plain pickle, a torch zip whose ``model.evil`` calls os.system, and a
    pickle of a class on no list."""
    root = tmp_path / "repo"
    (root / "models" / "sub").mkdir(parents=True)
    (root / "models" / "ok.pkl").write_bytes(pickle.dumps({"a": [1, 2]}, protocol=2))
    evil = pickle.dumps({"model": {"w": 1, "evil": _Payload()}}, protocol=2)
    (root / "models" / "sub" / "evil.pt").write_bytes(hc.torch_zip(evil))
    (root / "models" / "net.pkl").write_bytes(hc.gadget_pickle("mypkg.models", "Net", "x", 2))
    (root / "README.md").write_text("not a checkpoint")
    return root


def _validate(log: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(log, SARIF_SUBSET, format_checker=jsonschema.FormatChecker())


def test_sarif_log(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(folder)
    log = to_sarif(scan(["models"]), version="1.2.3")
    _validate(log)
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "ckptool" and driver["version"] == "1.2.3"
    assert [r["id"] for r in driver["rules"]] == ["CKPT001", "CKPT002", "CKPT003", "CKPT004", "CKPT005",
                                                 "CKPT006"]
    assert driver["rules"] == RULES
    assert sorted(a["location"]["uri"] for a in run["artifacts"]) == [
        "models/net.pkl", "models/ok.pkl", "models/sub/evil.pt"]
    for res in run["results"]:
        assert driver["rules"][res["ruleIndex"]]["id"] == res["ruleId"]
    (danger,) = [r for r in run["results"] if r["ruleId"] == "CKPT001"]
    assert danger["level"] == "error" and danger["properties"]["global"] in ("os.system", "posix.system")
    (loc,) = danger["locations"]
    assert loc["physicalLocation"]["artifactLocation"]["uri"] == "models/sub/evil.pt"
    assert loc["logicalLocations"] == [
        {"name": "archive/data.pkl", "kind": "member"},
        {"name": "model.evil", "fullyQualifiedName": "archive/data.pkl::model.evil", "kind": "object"}]
    assert "model.evil" in danger["message"]["text"]
    (trust,) = [r for r in run["results"] if r["ruleId"] == "CKPT002"]
    assert trust["level"] == "note" and trust["properties"]["global"] == "mypkg.models.Net"
    assert to_sarif(scan(["models"]), version="1", strict=True)["runs"][0]["results"][1]["level"] in (
        "warning", "error")


def test_sarif_for_unreadable_and_absolute_paths(tmp_path: Path) -> None:
    bad = tmp_path / "cut.pt"
    bad.write_bytes(pickle.dumps({"a": 1}, protocol=2)[:-3])  # cut short: incomplete (CKPT005, issue 36)
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(b"\x80\x02\x9b" + bytes(20))  # an invalid opcode: unreadable (CKPT003)
    log = to_sarif(scan([bad, damaged]), version="1")
    _validate(log)
    results = log["runs"][0]["results"]
    rules = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]: r["ruleId"] for r in results}
    assert rules == {bad.as_uri(): "CKPT005", damaged.as_uri(): "CKPT003"}
    assert {r["level"] for r in results} == {"warning"}


def test_cli_sarif_keeps_the_exit_status(folder: Path, run_cli) -> None:
    r = run_cli("scan", "--format", "sarif", folder)
    assert r.exit_code == 1
    log = json.loads(r.output)
    _validate(log)
    assert {x["ruleId"] for x in log["runs"][0]["results"]} == {"CKPT001", "CKPT002"}
    r = run_cli("scan", "--format", "sarif", folder / "models" / "ok.pkl")
    assert r.exit_code == 0 and json.loads(r.output)["runs"][0]["results"] == []
    r = run_cli("scan", "--json", "--format", "sarif", folder)
    assert r.exit_code == 2 and r.output.startswith("Error: ")
    r = run_cli("scan", "--format", "json", folder / "models" / "ok.pkl")
    assert r.exit_code == 0 and json.loads(r.output)["schema"] == "ckptool.scan/2"


def test_a_folder_is_scanned_recursively_with_a_summary_table(folder: Path, run_cli) -> None:
    r = run_cli("scan", folder)
    assert r.exit_code == 1
    lines = r.output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("file "))
    assert re.split(r"\s{2,}", lines[head]) == ["file", "verdict", "format", "pickles", "not allowed",
                                                "worst global"]
    rows = {re.split(r"\s{2,}", line)[0]: re.split(r"\s{2,}", line)[1:] for line in lines[head + 2:head + 5]}
    models = folder / "models"
    assert rows[str(models / "ok.pkl")][:3] == ["safe", "pickle", "1"]
    assert rows[str(models / "sub" / "evil.pt")][0] == "DANGEROUS"
    assert rows[str(models / "net.pkl")][0] == "NEEDS TRUST" and "mypkg.models.Net" in rows[str(models / "net.pkl")][4]
    assert lines[-1] == "3 files: 1 safe, 1 need trust, 1 dangerous, 0 unreadable"
    assert "README.md" not in r.output


def test_pre_commit_hook(folder: Path) -> None:
    """``.pre-commit-hooks.yaml`` is valid for pre-commit (a list of hooks with id, name, entry, language), selects
    checkpoint files by name, and its entry run on staged files fails the commit exactly when scan does."""
    yaml = pytest.importorskip("yaml")
    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    assert isinstance(hooks, list)
    (hook,) = [h for h in hooks if h["id"] == "ckptool-scan"]
    assert {"id", "name", "entry", "language"} <= set(hook) and hook["language"] == "python"
    assert hook["entry"] == "ckptool scan"
    files = re.compile(hook["files"])
    for name in ("a.pt", "b.pth", "c.bin", "d.ckpt", "e.safetensors", "f.pkl", "g.pt2", "dir/H.PT"):
        assert files.search(name), name
    for name in ("a.py", "b.ptx", "model.pt.md", "README"):
        assert not files.search(name), name
    exe = shutil.which("ckptool")
    cmd = [exe, *hook["entry"].split()[1:]] if exe else [sys.executable, "-m", "ckptool", *hook["entry"].split()[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([*cmd, str(folder / "models" / "ok.pkl")], env=env, capture_output=True, text=True,
                        timeout=120, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run([*cmd, str(folder / "models" / "ok.pkl"), str(folder / "models" / "sub" / "evil.pt")],
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1 and "DANGEROUS" in bad.stdout
