"""Code that ships inside a checkpoint, outside any pickle, and that the file's normal loader runs: the findings
``ckptool scan`` (and ``inspect``'s security verdict) add to those of the pickles.

Every zip the scan walks (the file itself, nested zips, a zip appended after the data, the zips in a DCP folder's
files) is looked at once more for:

* **native libraries** (:data:`NATIVE`): any member whose first bytes are an ELF, Mach-O or PE header
  (:func:`ckptool.formats.native.describe_native`), whatever its name: **dangerous**, with its architecture.
  ``torch._inductor.aoti_load_package`` dlopens the ``*.so`` under ``data/aotinductor/<model>/`` of an AOTInductor
  ``.pt2`` package, which runs the library's initialisers; elsewhere no torch loader maps it, but a native library
  in a checkpoint has no other purpose. The tensor records the loader reads as storage bytes (``data/`` and
  ``constants/`` of a torch zip or TorchScript archive, ``.data/`` of a torch.package, the raw weight members a
  ``.pt2``'s configs name) are not read, as ``inspect`` never reads tensor data; ``data/aotinductor/`` and members
  named like a library (``.so``, ``.dylib``, ``.dll``, ``.pyd``) always are. The C++ source of an AOTInductor
  package (``data/aotinductor/**.cpp``, kind :data:`NATIVE_SOURCE`) is **dangerous** too: without a packaged
  library, ``aoti_load_package`` compiles it with the flags the archive gives and loads the result (torch 2.13
  asks for ``*_compile_flags.json`` when the ``.so`` is missing).
* **torch.package modules** (:data:`PYTHON`): in a zip holding ``.data/extern_modules`` (the layout of
  ``torch.package.PackageExporter``: ``.data/`` records, ``*.pkl`` resources, ``*.py`` modules), each ``.py`` module
  outside ``.data/``. ``PackageImporter.load_pickle`` imports, from the archive, the module of every global its
  pickle names (and the packages above it), which runs the module's top-level code: a module named by a pickle of
  the archive is **dangerous**; one no pickle names is **needs-trust** (``PackageImporter.import_module``, or a
  module that imports it, runs it).
* **TorchScript source** (:data:`TORCHSCRIPT`): the ``code/`` members of a TorchScript archive (and
  ``.data/ts_code/`` of a torch.package). ``torch.jit.load`` compiles them and calling the model runs them; they
  run no Python, but can call any operator registered in the process (:func:`torchscript_ops`). The archive is
  **needs-trust** when the code calls only the operators of torch's own namespaces (:data:`BUILTIN_NAMESPACES`);
  a call into any other namespace (a custom op: whatever library registered it runs, with the file's arguments),
  a use of ``ops`` whose namespace cannot be read, an ``aten`` op that touches files (:data:`FILE_OPS`), or a
  TorchBind class (``__torch__.torch.classes.NS.Cls``, in the source or in the archive's pickles) outside
  :data:`BUILTIN_CLASS_NAMESPACES` is **dangerous**, naming the op or class and the file.

Nothing is imported, compiled or run: members are read as bytes, TorchScript source is split into tokens by
:mod:`tokenize`.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterable, Iterator
from itertools import compress, repeat
from operator import attrgetter, not_, or_
from typing import BinaryIO

from ckptool import _source as source
from ckptool.errors import CkptError
from ckptool.formats import detect as formats
from ckptool.formats import plugin
from ckptool.formats.zipdir import ZipEntry, read_directory, read_member, read_member_head
from ckptool.model.allowlist import DANGEROUS, NEEDS_TRUST
from ckptool.scanning.layouts import Layout
from ckptool.scanning.pickles import Container, Scanner, as_file
from ckptool.scanning.results import CodeFinding, ScanResult

__all__ = ["BUILTIN_CLASS_NAMESPACES", "BUILTIN_NAMESPACES", "FILE_OPS", "NATIVE", "NATIVE_SOURCE", "PYTHON",
           "TORCHSCRIPT", "CodeScanner", "package_modules", "torchscript_ops", "zip_code"]

NATIVE, NATIVE_SOURCE, PYTHON, TORCHSCRIPT = "native-library", "native-source", "python-module", "torchscript"

#: operator namespaces libtorch itself registers (torch 2.13, ``torch._C._jit_get_all_schemas()`` after
#: ``import torch``) whose ops compute on tensors in the process: ATen, the TorchScript primitives, the
#: decomposition primitives, quantized kernels, oneDNN / MKL kernels, sparse kernels, the profiler's record
#: functions and philox RNG. Left out, and so dangerous when called: ``c10d``, ``_c10d_functional*``, ``symm_mem``,
#: ``_dtensor`` (network collectives), ``debugprims`` (``load_tensor`` reads a file by name), ``inductor``,
#: ``static_runtime``, ``export``, ``onnx``, ``_test``, ``_native``, ``debug_mode_ops``, and namespaces torch
#: no longer has (``_caffe2``).
BUILTIN_NAMESPACES = frozenset({"aten", "prim", "prims", "quantized", "_quantized", "quantization", "sparse", "mkldnn",
                                "mkldnn_prepacked", "onednn", "mkl", "profiler", "rngprims"})
#: TorchBind class namespaces torch itself registers (torch 2.13: the classes its op schemas name, and XNNPACK's
#: op contexts in builds with XNNPACK); ``c10d`` and ``dist_rpc`` (process groups, RPC) are left out. A TorchBind
#: class is C++ code a library registered: its methods, and its ``__setstate__`` when ``torch.jit.load`` unpickles
#: an instance, run that code.
BUILTIN_CLASS_NAMESPACES = frozenset({"quantized", "sparse", "mkldnn", "profiler", "rnn", "xnnpack"})
_CLASS_REGEX = re.compile(r"__torch__\s*\.\s*torch\s*\.\s*classes\s*\.\s*([A-Za-z_]\w*)\s*\.\s*([A-Za-z_]\w*)")
#: ATen ops that read or write a file the code names (``torch.save(obj, path)``; ``torch.from_file(path,
#: shared=True)`` maps it writable)
FILE_OPS = frozenset({"aten::save", "aten::from_file"})
_AOTI_SOURCE = ("AOTInductor C++ source: when the package holds no compiled library for it, "
                "torch._inductor.aoti_load_package builds one with the compiler flags the archive gives "
                "(*_compile_flags.json) and loads it")
_LIBRARY_SUFFIXES = (".so", ".dylib", ".dll", ".pyd")
#: storage members read all the same (one search over the joined names)
_SPECIAL = re.compile(r"/aotinductor/|/ts_code/|\.(?:so|dylib|dll|pyd)$", re.I)
_SPECIAL_HINTS = ("/aotinductor/", "/ts_code/", ".so", ".dylib", ".dll", ".pyd")
_MANGLE = re.compile(r"^<torch_package_\d+>\.?")
_OPS_REGEX = re.compile(r"\bops\s*\.\s*([A-Za-z_]\w*)\s*\.\s*([A-Za-z_]\w*)")


class CodeScanner(Scanner):
    """The scan's container walk (:class:`~ckptool.scanning.pickles.Scanner`), which also records the code found
    in every zip it walks into :attr:`ScanResult.code` (see the module docstring)."""

    def zip(self, buf: Container, where: str, depth: int, f: BinaryIO | None = None, *,
            loaded: bool = False) -> Layout:
        layout = super().zip(buf, where, depth, f, loaded=loaded)
        try:
            self.res.code += zip_code(self.res, f if f is not None else as_file(buf), len(buf), where, depth, layout,
                                      self.pt2_roles.get(where, (set(), set()))[1])
        except CkptError as err:
            self.note(f"the code in the zip{' in ' + where if where else ''} could not be checked ({err})")
        return layout


def zip_code(res: ScanResult, f: BinaryIO, size: int, where: str, depth: int, layout: Layout,
             raw: set[str]) -> list[CodeFinding]:
    """The code findings of one zip (``f``, ``size`` bytes, its ``where`` in the file; ``layout``: what the scan
    recognised it as; ``raw``: the raw tensor members of a ``.pt2``), given the pickles ``res`` holds already.

    Raises:
        CkptError: the zip's directory cannot be read.
    """
    if depth == 0 and not where and size == source.file_size(res.path):
        entries = formats.zip_entries(res.path)  # the file itself: parsed once per version (inspect did already)
    else:
        entries = read_directory(f, size, where or res.path)
    first = entries[0].name if entries else ""
    top = first.split("/", 1)[0] + "/" if "/" in first else ""
    listed = list(map(attrgetter("name"), entries))
    package = top + ".data/extern_modules" in listed
    storage: tuple[str, ...] = ()
    if layout.torch_records:
        storage = (top + "data/", top + "constants/", top + ".data/")
    elif package:
        storage = (top + ".data/",)
    members = _MemberCode(f, where, top, layout.script, package)
    for e in _outside_storage(entries, listed, storage):
        members.add(e, skip_native=e.name.startswith(storage) or e.name in raw)
    out, script, modules = members.out, members.script, members.modules
    names = set(listed) if modules or script or layout.script else set()
    if modules:
        out += _package_findings(res, where, names, modules)
    if script:
        out += _torchscript_findings(script, f"{where}!{top}code/" if where else f"{top}code/")
    if layout.script or script:
        out += _torchbind_in_pickles(res, where, names)
    return out


class _MemberCode:
    """The code of one zip's members, member by member: native libraries and AOTInductor sources (findings), the
    TorchScript sources to read (:attr:`script`: ``(label, source)``), a torch.package's modules (:attr:`modules`:
    module name -> label)."""

    def __init__(self, f: BinaryIO, where: str, top: str, is_script: bool, package: bool) -> None:
        self.f, self.where, self.top, self.is_script, self.package = f, where, top, is_script, package
        self.out: list[CodeFinding] = []
        self.script: list[tuple[str, str]] = []
        self.modules: dict[str, str] = {}

    def add(self, e: ZipEntry, *, skip_native: bool) -> None:
        """One member; ``skip_native``: a tensor record, whose bytes are not looked at unless it lies under
        ``aotinductor/`` or is named like a library."""
        name = e.name
        if name.endswith("/"):
            return
        label = f"{self.where}!{name}" if self.where else name
        rel = name[len(self.top):] if name.startswith(self.top) else name
        if name.endswith(".py") and ((self.is_script and rel.startswith("code/"))
                                     or (self.package and rel.startswith(".data/ts_code/"))):
            self.script.append((label, _text(self.f, e, label)))
            return
        aoti = "/aotinductor/" in name
        if aoti and name.endswith(".cpp"):
            self.out.append(CodeFinding(label, NATIVE_SOURCE, DANGEROUS, _AOTI_SOURCE, "C++ source"))
        if self.package and name.endswith(".py") and not rel.startswith(".data/"):
            self.modules[plugin("ckptool.formats.torch_package:module_name")(rel)] = label
        if skip_native and not (aoti or name.lower().endswith(_LIBRARY_SUFFIXES)):
            return
        found = _native(self.f, e, label)
        if found is not None:
            self.out.append(found)


def _outside_storage(entries: list[ZipEntry], names: list[str], storage: tuple[str, ...]) -> Iterable[ZipEntry]:
    """``entries`` (named ``names``) less the tensor records under the ``storage`` folders, without a Python call
    per record (a big state_dict has 50,000), except those under ``aotinductor/`` or ``ts_code/`` or named like a
    library."""
    if not storage:
        return entries
    text = "\n".join(names).lower()
    if text.count("\n") != len(names) - 1:  # a name holds a newline: look at each one
        return entries
    special: set[str] = set()
    if any(s in text for s in _SPECIAL_HINTS):  # the expression scans every name; the literals rule most out
        special = {n for n in names if _SPECIAL.search(n)}
    keep = map(or_, map(not_, map(str.startswith, names, repeat(storage))), map(special.__contains__, names))
    return compress(entries, keep)


def _native(f: BinaryIO, e: ZipEntry, label: str) -> CodeFinding | None:
    try:
        head = read_member_head(f, e, label, 64)
        if not formats.may_be_native(head):
            return None
        describe = plugin("ckptool.formats.native:describe_native")  # imported when a member may be a library
        desc = describe(read_member_head(f, e, label, formats.NATIVE_HEAD_BYTES) if head[:2] == b"MZ" else head)
    except CkptError:
        return None  # unreadable members are reported by the pickle walk
    if desc is None:
        return None
    if "/aotinductor/" in label:
        why = ("an AOTInductor compiled library: torch._inductor.aoti_load_package loads it (dlopen), which runs "
               "its native code")
    else:
        why = ("native code in the archive: no torch loader maps it, but loading it (ctypes, torch.ops.load_library, "
               "an extension import) runs its native code")
    return CodeFinding(label, NATIVE, DANGEROUS, f"{why} ({desc})", str(desc))


def _text(f: BinaryIO, e: ZipEntry, label: str) -> str:
    try:
        return read_member(f, e, label, check_crc=False).decode("utf-8", "replace")
    except CkptError:
        return ""


def package_modules(globals_: list[str]) -> set[str]:
    """The modules ``PackageImporter`` imports to resolve ``globals_`` (``module.qualname`` names): each global's
    module and the packages above it, with torch.package's ``<torch_package_N>.`` mangling removed. A dotted name
    is split at every dot, since the restricted reader joins module and qualified name with one."""
    out: set[str] = set()
    for g in globals_:
        parts = _MANGLE.sub("", g).split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


def _archive_globals(res: ScanResult, where: str, names: set[str]) -> Iterator[tuple[str, str]]:
    """(pickle ``where``, global) for the pickles of the zip at ``where`` whose member is one of ``names`` (pickles
    in a row and data after them included; not those of nested zips)."""
    prefix = f"{where}!" if where else ""
    for p in res.pickles:
        rest = p.where[len(prefix):] if p.where.startswith(prefix) else None
        if rest is not None and re.split(r"!| \(pickle ", rest, maxsplit=1)[0] in names:
            yield from ((p.where, g) for g in p.globals)


def _package_findings(res: ScanResult, where: str, names: set[str], modules: dict[str, str]) -> list[CodeFinding]:
    named = package_modules([g for _w, g in _archive_globals(res, where, names)])
    out = []
    for module, label in modules.items():
        if module in named:
            out.append(CodeFinding(label, PYTHON, DANGEROUS, f"torch.package module {module}: a pickle of the "
                                   "archive names it, so PackageImporter.load_pickle imports it and runs its "
                                   "top-level code", module))
        else:
            out.append(CodeFinding(label, PYTHON, NEEDS_TRUST, f"torch.package module {module}: no pickle of the "
                                   "archive names it; PackageImporter.import_module (or a module that imports it) "
                                   "runs its code", module))
    return out


def torchscript_ops(text: str) -> Iterator[tuple[str, str]]:
    """The operators TorchScript source ``text`` calls, as ``(namespace, op)``: ``ops.NS.OP`` (how torch's
    printer writes every non-ATen op), ``torch.ops.NS.OP``, and ``torch.OP`` / ``torch.autograd.OP`` (ATen: the
    source importer binds ``torch`` to the ``aten`` namespace). A use of ``ops`` (or ``torch.ops``) whose namespace
    or op is not written out (``getattr(ops, "x")``, ``f = ops``) gives ``"?"`` for what is missing. Source that
    :mod:`tokenize` rejects is searched with a regular expression instead (strings and comments included).
    Never raises."""
    try:
        toks = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
                if t.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER, tokenize.STRING)]
    except (tokenize.TokenError, SyntaxError, ValueError, RecursionError):
        yield from ((m.group(1), m.group(2)) for m in _OPS_REGEX.finditer(text))
        return

    def name_at(i: int) -> str:
        return toks[i] if i < len(toks) and (toks[i].isidentifier()) else "?"

    for i, t in enumerate(toks):
        if i and toks[i - 1] == ".":
            continue  # an attribute (self.ops, __torch__.torch.nn...), not the global
        if t == "ops":
            j = i
        elif t == "torch" and toks[i + 1:i + 3] == [".", "ops"]:
            j = i + 2
        elif t == "torch" and toks[i + 1:i + 2] == ["."]:
            if toks[i + 2:i + 3] == ["classes"]:
                continue  # TorchBind class types (see the module docstring)
            k = i + 4 if toks[i + 2:i + 4] == ["autograd", "."] else i + 2
            yield "aten", name_at(k)
            continue
        else:
            continue
        ns = name_at(j + 2) if toks[j + 1:j + 2] == ["."] else "?"
        op = name_at(j + 4) if ns != "?" and toks[j + 3:j + 4] == ["."] else "?"
        yield ns, op


def _torchbind(qual: str) -> str:
    return (f"TorchScript uses the TorchBind class {qual}, outside torch's own: C++ code a library registered, "
            "run by its methods and by its __setstate__ when torch.jit.load unpickles an instance")


def _torchbind_in_pickles(res: ScanResult, where: str, names: set[str]) -> list[CodeFinding]:
    """TorchBind objects the archive's pickles hold (``__torch__.torch.classes.NS.Cls``, resolved by TorchScript's
    unpickler, which calls their C++ ``__setstate__``) whose namespace is not torch's own."""
    out, seen = [], set()
    for label, g in _archive_globals(res, where, names):
        m = _CLASS_REGEX.match(g)
        if m and m.group(1) not in BUILTIN_CLASS_NAMESPACES and (label, g) not in seen:
            seen.add((label, g))
            qual = f"{m.group(1)}.{m.group(2)}"
            out.append(CodeFinding(label, TORCHSCRIPT, DANGEROUS, _torchbind(qual), qual))
    return out


def _torchscript_findings(script: list[tuple[str, str]], folder: str) -> list[CodeFinding]:
    out: list[CodeFinding] = []
    namespaces: set[str] = set()
    for label, text in script:
        seen: set[str] = set()
        for m in _CLASS_REGEX.finditer(text):
            qual = f"{m.group(1)}.{m.group(2)}"
            if m.group(1) not in BUILTIN_CLASS_NAMESPACES and qual not in seen:
                seen.add(qual)
                out.append(CodeFinding(label, TORCHSCRIPT, DANGEROUS, _torchbind(qual), qual))
        for ns, op in torchscript_ops(text):
            qual = f"{ns}::{op}"
            if ns in BUILTIN_NAMESPACES and qual not in FILE_OPS:
                namespaces.add(ns)
                continue
            if qual in seen:
                continue
            seen.add(qual)
            if qual in FILE_OPS:
                why = f"TorchScript calls {qual}, which reads or writes a file the code names"
            elif ns == "?" or op == "?":
                why = (f"TorchScript uses the op table ({qual}) in a way ckptool cannot follow: it may call any "
                       "registered op")
            else:
                why = (f"TorchScript calls the custom op {qual}: torch.jit.load needs it registered, and calling "
                       "the model runs whatever code registered it")
            out.append(CodeFinding(label, TORCHSCRIPT, DANGEROUS, why, qual))
    used = ", ".join(sorted(namespaces)) or "none"
    out.insert(0, CodeFinding(
        folder, TORCHSCRIPT, NEEDS_TRUST,
        f"TorchScript source ({len(script)} file{'s' if len(script) != 1 else ''}): torch.jit.load compiles it and "
        f"calling the model runs it; it runs no Python, and calls torch's built-in ops ({used})"
        + (" and the ops listed as dangerous" if out else " only"),
        f"{len(script)} files; op namespaces: {used}"))
    return out
