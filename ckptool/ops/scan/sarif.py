"""``ckptool scan --format sarif``: scan results as a SARIF 2.1.0 log (OASIS Static Analysis Results Interchange
Format, https://docs.oasis-open.org/sarif/sarif/v2.1.0/sarif-v2.1.0.html), the format code-scanning dashboards
(GitHub code scanning, GitLab, DefectDojo...) import.

One run, tool ``ckptool`` with its rules (:data:`RULES`): one result per dangerous global and pickle that names
it (level ``error``), one per needs-trust global and pickle (``warning`` with ``--strict``, else ``note``), one
per file or pickle that could not be read to its end (``warning``), one per piece of code that ships in the file
(``CKPT004``: ``error`` when dangerous, else as needs-trust globals; its member, and ``code_kind`` and ``detail``
in the properties; a Hugging Face ``auto_map`` module is one), one per Hydra ``_target_`` of a config beside the
weights (``CKPT006``, levels as for globals). Each result's location is the file
(``artifactLocation.uri``, relative to the working directory when the path given was) and logical locations
naming the pickle (``member``: ``archive/data.pkl``, ``.metadata``, ``__0_0.distcp bytes 0-1261 (entry 'x')!...``)
and the dotted key path where the global is used (``object``: ``archive/data.pkl::model.evil``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import Any
from urllib.parse import quote

from ckptool.model.allowlist import DANGEROUS, NEEDS_TRUST
from ckptool.scanning.configs import is_target_where
from ckptool.scanning.results import ScanResult

__all__ = ["RULES", "SARIF_SCHEMA", "SARIF_VERSION", "to_sarif"]

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"

#: the rules: id, name, short description, full description, default level
RULES: list[dict[str, Any]] = [
    {"id": "CKPT001", "name": "DangerousGlobal",
     "shortDescription": {"text": "A pickle in the checkpoint names a global that can run code when loaded"},
     "fullDescription": {"text": "Loading the checkpoint with an unrestricted unpickler (torch.load(weights_only="
                                 "False), pickle.load, another tool) would import and call a process, file, network, "
                                 "import or eval gadget, or a function on no list, with arguments the file chooses."},
     "help": {"text": "Do not load the file. `ckptool scan --json FILE` lists each global and where it is; "
                      "`ckptool sanitize` cannot make such a file safe."},
     "defaultConfiguration": {"level": "error"}},
    {"id": "CKPT002", "name": "NeedsTrustGlobal",
     "shortDescription": {"text": "A pickle in the checkpoint names a class outside torch's weights_only allowlist"},
     "fullDescription": {"text": "A library class or rebuilder that runs no code of the file's choosing (torch.nn "
                                 "modules, numpy arrays, argparse.Namespace...), or a class on no list: loading "
                                 "imports its package and builds it from the file's data."},
     "help": {"text": "Load it with weights_only=False only if you trust the file and the package, or convert it "
                      "with `ckptool sanitize FILE -o OUT.pth`."},
     "defaultConfiguration": {"level": "note"}},
    {"id": "CKPT003", "name": "Unreadable",
     "shortDescription": {"text": "A pickle or the checkpoint could not be read to its end"},
     "fullDescription": {"text": "ckptool cannot vouch for what follows the point where reading stopped (a damaged "
                                 "or truncated file, or one built to confuse readers)."},
     "help": {"text": "Re-download or re-save the checkpoint; do not load it until `ckptool scan` reads it."},
     "defaultConfiguration": {"level": "warning"}},
    {"id": "CKPT004", "name": "CodeInCheckpoint",
     "shortDescription": {"text": "The checkpoint carries code that its loader runs, outside any pickle"},
     "fullDescription": {"text": "A native library (an AOTInductor .so: aoti_load_package loads it), a torch.package "
                                 "Python module (PackageImporter imports the modules its pickles name) or TorchScript "
                                 "source (torch.jit.load compiles it; it can call any registered op). Dangerous when "
                                 "native code or Python runs on load or a TorchScript call leaves torch's built-in "
                                 "ops; needs trust otherwise."},
     "help": {"text": "`ckptool scan --json FILE` lists each member under \"code\" with its kind and reason. Load "
                      "such a file only if you trust its author."},
     "defaultConfiguration": {"level": "error"}},
    {"id": "CKPT005", "name": "Incomplete",
     "shortDescription": {"text": "The checkpoint ends before what its structure declares"},
     "fullDescription": {"text": "Every byte of the file was read, but a pickle stops before its end, a zip has no "
                                 "end of central directory, or a storage block or DCP record runs past the end of "
                                 "its file: a truncated download or copy, which torch.load cannot load whole."},
     "help": {"text": "Re-download or re-copy the checkpoint; `ckptool scan FILE` says what is cut short."},
     "defaultConfiguration": {"level": "warning"}},
    {"id": "CKPT006", "name": "ConfigInstantiatesCode",
     "shortDescription": {"text": "A config beside the weights names a callable its loader imports and calls"},
     "fullDescription": {"text": "A Hydra _target_ in a NeMo config (model_config.yaml in a .nemo archive, "
                                 "context/model.yaml of a NeMo 2 folder): hydra.utils.instantiate imports it and "
                                 "calls it with the config's arguments when the model is restored (CVE-2025-23304). "
                                 "Dangerous for a process, eval or other gadget; needs trust for a library class."},
     "help": {"text": "`ckptool scan --json FILE` lists each target under \"globals\" with its key path. Restore "
                      "the model only if you trust the file and the packages it names."},
     "defaultConfiguration": {"level": "error"}},
]
_RULE_INDEX = {r["id"]: i for i, r in enumerate(RULES)}


def artifact_uri(path: str) -> str:
    """The SARIF ``artifactLocation.uri`` of ``path``: a relative URI reference (forward slashes, percent-encoded)
    for a relative path, a ``file://`` URI for an absolute one."""
    if os.path.isabs(path):
        return Path(path).as_uri()
    return quote(PurePath(path).as_posix())


def _result(rule: str, level: str, text: str, res: ScanResult, member: str | None, key_paths: list[str],
            props: dict[str, Any]) -> dict[str, Any]:
    logical: list[dict[str, Any]] = []
    if member is not None:
        logical.append({"name": member, "kind": "member"})
        logical += [{"name": k, "fullyQualifiedName": f"{member}::{k}", "kind": "object"} for k in key_paths]
    location: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": artifact_uri(res.path)}}}
    if logical:
        location["logicalLocations"] = logical
    return {"ruleId": rule, "ruleIndex": _RULE_INDEX[rule], "level": level, "message": {"text": text},
            "locations": [location], "properties": {"format": res.format, **props}}


def _global_results(res: ScanResult, strict: bool) -> list[dict[str, Any]]:
    """The results of the dangerous and needs-trust globals: one per global and pickle that names it (``CKPT001``,
    ``CKPT002``), one per Hydra target and config that names it (``CKPT006``)."""
    out = []
    for g in res.globals:
        if g.level not in (DANGEROUS, NEEDS_TRUST):
            continue
        rule, level = ("CKPT001", "error") if g.level == DANGEROUS else ("CKPT002", "warning" if strict else "note")
        for where in g.where:
            if is_target_where(where):  # a Hydra target of a config (scanning/configs.py), not a pickle's global
                out.append(_result("CKPT006", level, f"{g.name} ({g.status}): {g.reason}; named in {where}", res,
                                   where, [], {"global": g.name, "status": g.status}))
                continue
            pickle = next((p for p in res.pickles if p.where == where), None)
            paths = pickle.key_paths.get(g.name, []) if pickle is not None else []
            hidden = pickle is not None and pickle.hidden
            text = (f"{g.name} ({g.status}): {g.reason}; named in {where}"
                    + (f" at {', '.join(paths)}" if paths else "")
                    + (" (a pickle torch.load does not read today)" if hidden else ""))
            out.append(_result(rule, level, text, res, where, paths,
                               {"global": g.name, "status": g.status, "hidden": hidden}))
    return out


def _file_results(res: ScanResult, strict: bool) -> list[dict[str, Any]]:
    out = _global_results(res, strict)
    out += [_result("CKPT005" if p.truncated else "CKPT003", "warning",
                    f"{p.where} could not be read to its end: {p.error}", res, p.where, [],
                    {"hidden": p.hidden}) for p in res.pickles if p.error]
    out += [_result("CKPT005", "warning", why, res, None, [], {}) for why in res.incomplete]
    if res.error:
        out.append(_result("CKPT003", "warning", res.error, res, None, [], {}))
    for c in res.code:  # code that ships in the file (scanning/shipped_code.py)
        level = "error" if c.level == DANGEROUS else "warning" if strict else "note"
        out.append(_result("CKPT004", level, f"{c.kind} in {c.member}: {c.reason}", res, c.member, [],
                           {"code_kind": c.kind, "level": c.level, "detail": c.detail}))
    return out


def to_sarif(results: Iterable[ScanResult], *, version: str, strict: bool = False) -> dict[str, Any]:
    """The SARIF 2.1.0 log (a JSON-ready dict) of ``results``: ``version`` is ckptool's; ``strict`` reports
    needs-trust globals as warnings instead of notes. Every file scanned is listed in ``artifacts``."""
    results = list(results)
    return {
        "$schema": SARIF_SCHEMA,
        "version": SARIF_VERSION,
        "runs": [{
            "tool": {"driver": {"name": "ckptool", "version": version, "semanticVersion": version,
                                "rules": RULES}},
            "artifacts": [{"location": {"uri": artifact_uri(r.path)}} for r in results],
            "results": [x for r in results for x in _file_results(r, strict)],
            "columnKind": "unicodeCodePoints",
        }],
    }
