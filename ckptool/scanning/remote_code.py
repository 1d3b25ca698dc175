"""Code a model folder's configs make a loader run: a Hugging Face ``config.json`` (or ``tokenizer_config.json``)
whose ``auto_map`` names modules of the folder, which ``transformers`` imports under ``trust_remote_code=True``
(``dynamic_module_utils.get_class_from_dynamic_module``: the named module and every module it imports relatively),
and a NeMo config whose Hydra ``_target_`` entries ``hydra.utils.instantiate`` calls (rated by
:meth:`ckptool.scanning.pickles.Scanner.config_member`).

:func:`~ckptool.scanning.configs.is_code_config` says which files of a folder the scan reads for this (by name,
without this module's parser); :func:`hf_remote_code` lists each module ``auto_map`` makes ``transformers`` run,
with its sha256, as a :class:`~ckptool.scanning.results.CodeFinding`: **needs-trust**, or **dangerous** when
:func:`dangerous_calls` finds a call of a process, eval, socket or HTTP function in it. Modules are parsed with
:mod:`ast`, never imported or run.
"""

from __future__ import annotations

import ast
import hashlib
import os
from typing import Any

from ckptool.errors import CkptError
from ckptool.model.allowlist import DANGEROUS, NEEDS_TRUST
from ckptool.scanning.configs import parse_config
from ckptool.scanning.results import CodeFinding

__all__ = ["DANGEROUS_CALLS", "MAX_MODULE_BYTES", "REMOTE_CODE", "dangerous_calls", "hf_remote_code",
           "parse_module"]

#: the kind of a :class:`CodeFinding` for a module ``transformers`` runs under ``trust_remote_code``
REMOTE_CODE = "remote-code"
#: modules larger than this are not parsed (needs-trust, said so)
MAX_MODULE_BYTES = 8 << 20
#: the most modules followed from one config (the named ones and their relative imports)
MAX_MODULES = 256
#: calls that make a module dangerous (dotted names after resolving ``import ... as`` and ``from ... import``):
#: an entry is a full name or a module prefix
DANGEROUS_CALLS: dict[str, str] = {
    "builtins.eval": "evaluates Python code", "builtins.exec": "runs Python code",
    "builtins.compile": "compiles Python code", "builtins.__import__": "imports any module",
    "os.system": "runs a shell command", "os.popen": "runs a shell command", "os.execv": "runs a process",
    "os.execve": "runs a process", "os.execl": "runs a process", "os.execlp": "runs a process",
    "os.execvp": "runs a process", "os.spawnv": "runs a process", "os.spawnl": "runs a process",
    "os.posix_spawn": "runs a process", "subprocess": "runs processes", "pty": "runs processes",
    "socket": "opens network connections", "requests": "opens network connections",
    "urllib.request": "opens network connections", "http.client": "opens network connections",
    "ctypes": "calls C functions", "importlib.import_module": "imports any module",
}


def parse_module(source: bytes, name: str) -> ast.Module:
    """The syntax tree of the Python module ``source`` (:func:`ast.parse`: nothing is imported or run).

    Raises:
        CkptError: the module is over :data:`MAX_MODULE_BYTES`, nested too deeply, or not valid Python.
    """
    if len(source) > MAX_MODULE_BYTES:
        raise CkptError(f"{name} is over the {MAX_MODULE_BYTES >> 20} MiB parsed")
    try:
        return ast.parse(source, filename=name)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CkptError(f"{name} could not be parsed as Python ({type(e).__name__})") from None


def dangerous_calls(tree: ast.Module) -> list[str]:
    """The calls in the module ``tree`` (:func:`parse_module`) that run processes, evaluate code, open sockets or
    HTTP connections (:data:`DANGEROUS_CALLS`), as ``"os.system (line 3): runs a shell command"``; names are
    resolved through the module's imports (``import subprocess as sp``, ``from os import system``)."""
    aliases: dict[str, str] = {"eval": "builtins.eval", "exec": "builtins.exec", "compile": "builtins.compile",
                               "__import__": "builtins.__import__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        full = aliases.get(head, head) + (f".{rest}" if rest else "")
        why = _danger(full)
        if why is not None:
            found.append(f"{full} (line {node.lineno}): {why}")
    return found


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _danger(full: str) -> str | None:
    parts = full.split(".")
    for i in range(len(parts), 0, -1):
        why = DANGEROUS_CALLS.get(".".join(parts[:i]))
        if why is not None:
            return why
    return None


def _auto_map_refs(config: Any) -> list[tuple[str, str]]:
    """``(auto class, reference)`` for each entry of ``config["auto_map"]`` (a string, or a list of strings and
    None as for tokenizers)."""
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto_map, dict):
        return []
    return [(str(key), ref) for key, value in auto_map.items()
            for ref in (value if isinstance(value, list) else [value]) if isinstance(ref, str)]


def hf_remote_code(path: str, data: bytes) -> tuple[list[CodeFinding], list[str]]:
    """The code findings of the Hugging Face config at ``path`` (its bytes ``data``): one per module its
    ``auto_map`` makes ``transformers`` import under ``trust_remote_code=True`` (the named modules of the folder and
    the modules they import relatively, with their sha256), and one per reference to another repository's code
    (``repo--module.Class``, downloaded when loaded); and the notes (a module that is missing or cannot be
    parsed).

    Raises:
        CkptError: the config cannot be parsed within the bounds of :func:`~ckptool.scanning.configs.parse_config`.
    """
    folder = os.path.dirname(path)
    config = parse_config(data, os.path.basename(path))
    findings: list[CodeFinding] = []
    notes: list[str] = []
    queue: list[tuple[str, str]] = []
    for key, ref in _auto_map_refs(config):
        module = ref.rpartition(".")[0]
        if "--" in module:
            repo, _, module = module.partition("--")
            findings.append(CodeFinding(f"{path}: auto_map.{key}", REMOTE_CODE, NEEDS_TRUST, (
                f"auto_map names {ref!r}: transformers downloads {module}.py from the repository {repo} and runs it "
                "under trust_remote_code=True (not checked here)"), ref))
        elif module:
            queue.append((module.replace(".", "/") + ".py", f"auto_map.{key} = {ref!r}"))
    seen: set[str] = set()
    while queue and len(seen) < MAX_MODULES:
        rel, why = queue.pop(0)
        if rel in seen:
            continue
        seen.add(rel)
        file = os.path.join(folder, rel)
        try:
            with open(file, "rb") as f:
                source = f.read(MAX_MODULE_BYTES + 1)
        except OSError:
            notes.append(f"{path}: {why} names {rel}, which is not in the folder (transformers fails to load it)")
            continue
        digest = hashlib.sha256(source).hexdigest()
        try:
            tree = parse_module(source, rel)
        except CkptError as err:
            findings.append(CodeFinding(file, REMOTE_CODE, NEEDS_TRUST, (
                f"{why}: transformers runs it under trust_remote_code=True; {err}, so its calls were not checked"),
                f"sha256 {digest}"))
            continue
        calls = dangerous_calls(tree)
        level = DANGEROUS if calls else NEEDS_TRUST
        reason = (f"{why}: transformers imports it (running its top-level code) under trust_remote_code=True"
                  + (f"; it calls {'; '.join(calls[:5])}" if calls else ""))
        findings.append(CodeFinding(file, REMOTE_CODE, level, reason, f"sha256 {digest}"))
        queue += [(r, f"imported by {rel}") for r in _relative_imports(tree, rel)]
    return findings, notes


def _relative_imports(tree: ast.AST, rel: str) -> list[str]:
    """The module files ``from .x import y`` / ``from . import y`` name, relative to module ``rel``'s folder (as
    ``transformers.dynamic_module_utils.get_relative_imports`` follows them)."""
    base = os.path.dirname(rel)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            up = base
            for _ in range(node.level - 1):
                up = os.path.dirname(up)
            names = [node.module] if node.module else [a.name for a in node.names]
            out += [os.path.normpath(os.path.join(up, n.replace(".", "/") + ".py")) for n in names]
    return [r for r in out if not r.startswith("..")]
