"""Print the architecture figures of issue 35 for ``ckptool/`` (and fail with ``--check`` past their limits).

Each figure is computed from the source tree alone (``ast`` and radon), so it cannot drift from the code:

- ``format-name comparisons``: ``==`` / ``!=`` / ``in`` / ``not in`` against a string that is a format name
  (``FORMAT_NAMES``) or a constant holding one (``detect.TORCH_ZIP``, ...), and dict literals keyed by two or more
  of them (per-format tables), outside ``ckptool/readers``, ``ckptool/writers`` (the registries) and
  ``ckptool/formats``;
- ``parser calls``: calls of a format parser (``PARSERS`` below: detection, headers, zip directories, indexes, DCP
  metadata, pickles), by its name or through its module (not a method of an object, such as ``Opened``'s cached
  readers), outside ``ckptool/readers``, ``ckptool/formats`` and scan's byte-level walk (``ckptool/scanning``, the
  reading layer below ``torch_ops``);
- ``private imports``: ``from X import _name`` inside ``ckptool`` where ``_name`` is not a module;
- ``complex functions``: functions and methods of cyclomatic complexity above 20 as radon counts it (grade D or worse);
- ``modules in ops/``: the ``.py`` files directly in ``ckptool/ops`` (``__init__.py`` aside);
- ``tensor classes``: classes whose name holds Tensor, Storage, Piece, Segment or Chunk;
- ``single-format facts``: reads of a registry fact that is true for exactly one format (``SINGLE_FORMAT_FACTS``:
  ``spec.header`` = safetensors, ``spec.tagged`` = DeepSpeed, ``spec.torch_distributed`` / ``spec.dcp`` = DCP,
  ``spec.consolidate``, ``spec.rewriter``) in ``ckptool/ops``, ``ckptool/torch_ops`` and ``ckptool/cli``: what
  differs by format is a method of its reader, not a fact the caller tests (issue 46);
- ``upward plug-ins``: ``"ckptool.module:function"`` strings and imports inside functions that name a module of a
  higher layer than the one they are in (``LAYERS``, the import-linter contract's order), which import-linter
  cannot see (issue 46: the layers above register their plug-ins, :class:`ckptool.readers.registry.Role`);
- ``format-module imports``: import lines in ``ckptool/ops``, ``ckptool/torch_ops`` and ``ckptool/cli`` that name a
  format's own module (``FORMAT_MODULES``) rather than the shared tensor model, the readers or the writers, at
  module level or inside a function, and ``"ckptool.formats.<module>[:function]"`` plug-in strings that name one.

Usage: ``python tools/architecture_figures.py [--check] [--list]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

from radon.complexity import cc_visit  # the test extra's radon: McCabe, boolean operators counted

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "ckptool"

FORMAT_NAMES = {
    "torch-zip", "torch-legacy", "torchscript", "torch-package", "safetensors", "sharded-safetensors",
    "sharded-bin", "dcp", "torch-export", "deepspeed", "pickle",
    # the names the formats had before the registry (detect_format's and inspect's spellings)
    "zip", "legacy", "pt2", "package", "sharded-torch", "sharded-mixed", "sharded",
}
PARSERS = {
    "detect_format", "format_of", "read_header", "read_directory", "plain_directory", "zipfile_directory",
    "read_index", "parse_index", "read_dcp_metadata", "read_checkpoint", "read_pickle_file", "read_pickle_member",
    "read_pt2", "read_pt2_file", "read_package", "find_deepspeed", "is_dcp_folder", "is_deepspeed_folder",
    "is_checkpoint_set", "set_kind", "load_structure", "load_pickle_at", "zip_entries", "resolve_zip_offsets",
    "read_zero", "torch_end_record", "zipfile_end_record", "read_member", "member_buffer", "read_byteorder",
}
#: registry facts that are true for exactly one format (or one family): tested by a caller, they are a format switch
SINGLE_FORMAT_FACTS = {"header", "tagged", "torch_distributed", "consolidate", "dcp", "rewriter"}
#: the layers, highest first (pyproject.toml's import-linter contract): a plug-in string names a module of its own
#: layer or a lower one
LAYERS = ["cli", "demo", "ops", "torch_ops", "scanning", "readers", "model", "formats"]
#: the modules of one format each (or of the pickle machinery only the readers and writers use): every module of
#: ``ckptool/formats`` but the shared tensor model (``tensors``, ``dtypes``, ``nodes``) and its ``plugin`` reference;
#: pyproject.toml's import-linter contract "The operations read and write through the readers and writers" lists
#: the same modules (``tests/test_architecture_figures.py`` holds the two together)
FORMAT_MODULES = {"safetensors", "torchfile", "torchzip", "zipdir", "dcp", "sharded", "pickler", "pickle_check",
                  "pickle_stack", "unpickler", "strided", "segments", "detect", "folders", "torch_package", "pt2",
                  "deepspeed", "megatron", "native"}
PLUGIN_REF = re.compile(r"^ckptool\.([a-z_]+)(?:\.[A-Za-z0-9_.]+)?(?::[A-Za-z0-9_]+)?$")
LIMITS = {
    "format-name comparisons": 0,
    "parser calls": 0,
    "private imports": 0,
    "complex functions": 0,
    "modules in ops/": 12,
    "tensor classes": 8,
    "single-format facts": 0,
    "upward plug-ins": 0,
    # 79 before issue 46; 28 after its first stop, 21 of them scan's byte walk, which then moved to the reading
    # layer ckptool/scanning below torch_ops (so that torch_ops' trusted loads call it without a plug-in string); the
    # last 9 became methods and functions of the readers and writers (torch.package rewriting, written formats' names)
    "format-module imports": 0,
}
MAX_COMPLEXITY = 20
TENSOR_CLASS = re.compile(r"Tensor|Storage|Piece|Segment|Chunk")


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _outside(p: Path, *dirs: str) -> bool:
    rel = p.relative_to(PKG).as_posix()
    return not any(rel == d or rel.startswith((d + "/", d + "_")) for d in dirs)


#: the constants that hold format names (``ckptool.formats.detect``): comparing against them is comparing names
FORMAT_CONSTANTS = {"TORCH_ZIP", "TORCH_LEGACY", "TORCHSCRIPT", "TORCH_PACKAGE", "SAFETENSORS", "PICKLE", "PT2", "DCP",
                    "DEEPSPEED", "SHARDED_SAFETENSORS", "SHARDED_BIN"}


def _is_format_name(node: ast.AST, modules: set[str]) -> bool:
    """A format-name string, or a format-name constant read from a module (``detect.TORCH_ZIP``) or imported by
    name; not a member of an enum of ckptool's own (``OutputFormat.DCP``: an output choice)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in FORMAT_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in FORMAT_CONSTANTS and isinstance(node.value, ast.Name) and node.value.id in modules
    return isinstance(node, ast.Name) and node.id in FORMAT_CONSTANTS


def _names_format(node: ast.AST, modules: set[str]) -> bool:
    if _is_format_name(node, modules):
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_format_name(e, modules) for e in node.elts)
    return False


def format_comparisons() -> list[str]:
    found = []
    for p in _modules():
        if not _outside(p, "readers", "formats", "writers"):
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        modules = _module_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                if any(_names_format(c, modules) for c in [node.left, *node.comparators]):
                    found.append(f"{_rel(p)}:{node.lineno}")
            elif isinstance(node, ast.Dict):
                if sum(1 for k in node.keys if k is not None and _is_format_name(k, modules)) >= 2:
                    found.append(f"{_rel(p)}:{node.lineno} (table)")
            elif isinstance(node, ast.match_case) and _names_format(getattr(node.pattern, "value", ast.Pass()),
                                                                    modules):
                found.append(f"{_rel(p)}:{node.pattern.lineno}")
    return found


def _module_names(tree: ast.Module) -> set[str]:
    """The names a module binds to imported modules (``import a.b as m``, ``from ckptool.formats import detect``):
    ``m.read_header(...)`` on one of them is a call of the parser, ``opened.zip_entries()`` (a cached reader of
    :class:`ckptool.readers.Opened`) is not."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = ROOT.joinpath(*node.module.split("."))
            names.update(a.asname or a.name for a in node.names if _is_module(base, a.name))
    return names


def parser_calls() -> list[str]:
    found = []
    for p in _modules():
        if not _outside(p, "readers", "formats", "scanning"):
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        modules = _module_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name):
                    name = f.id
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
                    name = f.attr
                else:
                    continue
                if name in PARSERS:
                    found.append(f"{_rel(p)}:{node.lineno} {name}")
    return found


def _is_module(base: Path, name: str) -> bool:
    return (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()


def private_imports() -> list[str]:
    found = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = p.parent
                for _ in range(node.level - 1):
                    base = base.parent
                if node.module:
                    base = base.joinpath(*node.module.split("."))
            elif node.module and node.module.split(".")[0] == "ckptool":
                base = ROOT.joinpath(*node.module.split("."))
            else:
                continue
            for alias in node.names:
                n = alias.name
                if n.startswith("_") and not n.startswith("__") and not _is_module(base, n):
                    found.append(f"{_rel(p)}:{node.lineno} {n}")
    return found


def complex_functions() -> list[str]:
    found = {
        f"{_rel(p)}:{b.lineno} {b.fullname} {b.complexity}"
        for p in _modules()
        for block in cc_visit(p.read_text(encoding="utf-8"))
        for b in [block, *getattr(block, "methods", [])]
        if b.complexity > MAX_COMPLEXITY and not hasattr(b, "methods")
    }
    return sorted(found)


def ops_modules() -> list[str]:
    return sorted(_rel(p) for p in (PKG / "ops").glob("*.py") if p.name != "__init__.py")


def tensor_classes() -> list[str]:
    return [
        f"{_rel(p)}:{node.lineno} {node.name}"
        for p in _modules()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and TENSOR_CLASS.search(node.name)
    ]


def _layer(rel: str) -> int | None:
    """The rank of the layer a module (``scanning/entry.py`` or ``ckptool.scanning.entry``) is in, 0 highest."""
    top = rel.replace(".", "/").split("/")[0]
    return LAYERS.index(top) if top in LAYERS else None


def single_format_facts() -> list[str]:
    found = []
    for p in _modules():
        if _outside(p, "ops", "torch_ops", "cli"):
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in SINGLE_FORMAT_FACTS:
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "spec") or (
                        isinstance(owner, ast.Attribute) and owner.attr == "spec"):
                    found.append(f"{_rel(p)}:{node.lineno} spec.{node.attr}")
    return found


def upward_plugins() -> list[str]:
    found = []
    for p in _modules():
        here = _layer(p.relative_to(PKG).as_posix())
        if here is None:
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names: list[tuple[int, str]] = []
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and PLUGIN_REF.match(node.value):
                names.append((node.lineno, node.value))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("ckptool."):
                        names.append((sub.lineno, sub.module))
                    elif isinstance(sub, ast.Import):
                        names.extend((sub.lineno, a.name) for a in sub.names if a.name.startswith("ckptool."))
            for line, name in names:
                there = _layer(name.split(":")[0].removeprefix("ckptool."))
                if there is not None and there < here:
                    found.append(f"{_rel(p)}:{line} {name}")
    return sorted(set(found))


def format_module_imports() -> list[str]:
    found = []
    for p in _modules():
        if _outside(p, "ops", "torch_ops", "cli"):
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PLUGIN_REF.match(node.value):
                mods = [node.value.split(":")[0]]
            if any(m.startswith("ckptool.formats.") and m.split(".")[2] in FORMAT_MODULES for m in mods):
                found.append(f"{_rel(p)}:{node.lineno}")
    return found


FIGURES = {
    "format-name comparisons": format_comparisons,
    "parser calls": parser_calls,
    "private imports": private_imports,
    "complex functions": complex_functions,
    "modules in ops/": ops_modules,
    "tensor classes": tensor_classes,
    "single-format facts": single_format_facts,
    "upward plug-ins": upward_plugins,
    "format-module imports": format_module_imports,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a figure is past its limit")
    ap.add_argument("--list", action="store_true", help="list every place counted")
    ap.add_argument("--json", action="store_true", help="the figures as one JSON object")
    args = ap.parse_args(argv)
    results = {name: fn() for name, fn in FIGURES.items()}
    over = [name for name, found in results.items() if len(found) > LIMITS[name]]
    if args.json:
        print(json.dumps({name: len(found) for name, found in results.items()}))
    else:
        for name, found in results.items():
            mark = "  OVER" if name in over else ""
            print(f"{name:<26}{len(found):>5}   (limit {LIMITS[name]}){mark}")
            if args.list:
                for place in found:
                    print(f"    {place}")
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
