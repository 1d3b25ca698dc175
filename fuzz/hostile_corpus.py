"""Build a corpus of hostile checkpoint files: one per code-execution gadget (across pickle protocols 0-5) and per
container trick that pickle scanners have fallen for, plus resource bombs.

Nothing here imports torch or ckptool; every file is written byte by byte (``pickle`` would refuse to write a
global it cannot import, such as ``nt.system`` on Linux). Used by ``tests/test_hardening.py``,
``tests/test_scan.py`` and ``tests/test_fuzz.py``; as a script it writes the corpus into a folder::

    python fuzz/hostile_corpus.py OUTDIR

Each entry of :func:`build` says which globals a reader must report for it (``expect``: the gadget names; the
scan verdict must then be ``unsafe``) or that the file must be refused with a clear error (``bomb``).
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
import sys
import tarfile
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

#: (module, name, argument) of each gadget: called with one string argument by REDUCE
GADGETS: list[tuple[str, str, str]] = [
    ("os", "system", "touch /tmp/ckptool-pwned"),
    ("posix", "system", "touch /tmp/ckptool-pwned"),
    ("nt", "system", "echo pwned"),
    ("subprocess", "check_output", "id"),
    ("subprocess", "Popen", "id"),
    ("builtins", "eval", "__import__('os').system('id')"),
    ("builtins", "exec", "import os; os.system('id')"),
    ("builtins", "__import__", "webbrowser"),
    ("builtins", "getattr", "system"),
    ("builtins", "open", "/tmp/ckptool-pwned"),
    ("builtins", "compile", "1"),
    ("__builtin__", "eval", "1"),  # protocol-2 pickles name builtins the Python 2 way
    ("operator", "attrgetter", "system"),
    ("operator", "methodcaller", "system"),
    ("functools", "partial", "x"),
    ("importlib", "import_module", "antigravity"),
    ("pkgutil", "resolve_name", "os:system"),
    ("runpy", "run_path", "/tmp/x.py"),
    ("runpy", "run_module", "antigravity"),
    ("pydoc", "locate", "os.system"),
    ("code", "InteractiveInterpreter", "x"),
    ("pty", "spawn", "/bin/sh"),
    ("socket", "create_connection", "example.com"),
    ("ctypes", "CDLL", "libc.so.6"),
    ("pickle", "loads", "x"),
    ("_pickle", "loads", "x"),
    ("torch", "load", "/tmp/x.pt"),
    ("torch.serialization", "load", "/tmp/x.pt"),
    ("webbrowser", "open", "http://example.com"),
    ("shutil", "rmtree", "/tmp/ckptool-nothing"),
    ("timeit", "timeit", "import os"),
    ("numpy.testing._private.utils", "runstring", "import os"),
    # on no danger list: dangerous by the default rules of ckptool/model/allowlist.py (a function on no list, a
    # method reached through its class, a class whose module opens files)
    ("no_such_pkg.utils", "run_command", "id"),
    ("operator", "call", "x"),
    ("numpy.distutils.exec_command", "exec_command", "id"),
    ("torch._tensor", "_rebuild_from_type", "x"),
    ("pathlib", "Path.write_text", "/tmp/ckptool-pwned"),
    ("logging", "FileHandler", "/tmp/ckptool-pwned"),
]

GADGET_NAMES = {f"{'builtins' if m == '__builtin__' else m}.{n}" for m, n, _ in GADGETS}


@dataclass
class Entry:
    """One corpus file: ``data`` to write under ``name``; ``expect`` = globals a reader must report (the gadget);
    ``bomb`` = the file must be refused with a clear error (CkptError), in bounded time and memory;
    ``scan_only``: the gadget sits where ``torch.load`` does not look (a second pickle, another zip member), so
    ``inspect`` (which describes what torch.load reads) need not report it but ``scan`` must; ``kind`` a label."""

    name: str
    data: bytes
    kind: str
    expect: set[str] = field(default_factory=set)
    bomb: bool = False
    scan_only: bool = False


# ------------------------------------------------------------------------------------------------ pickle bytes
def _text_str(s: str) -> bytes:
    return b"V" + s.encode("raw_unicode_escape") + b"\n"


def _bin_str(s: str, proto: int) -> bytes:
    b = s.encode("utf-8")
    if proto >= 4 and len(b) < 256:
        return b"\x8c" + bytes([len(b)]) + b
    return b"X" + struct.pack("<I", len(b)) + b


def global_op(module: str, name: str, proto: int, *, via_memo: bool = False) -> bytes:
    """Opcodes that push the global ``module.name``: GLOBAL for protocols 0-3, STACK_GLOBAL for 4-5.

    ``via_memo`` builds STACK_GLOBAL's two strings in the memo first and fetches them back with BINGET (the
    "names built through the memo" trick)."""
    if proto < 4:
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    if via_memo:
        return (_bin_str(name, proto) + b"\x94" + _bin_str(module, proto) + b"\x94" + b"0" + b"0"
                + b"h\x01" + b"h\x00" + b"\x93")
    return _bin_str(module, proto) + b"\x94" + _bin_str(name, proto) + b"\x94" + b"\x93"


def gadget_pickle(module: str, name: str, arg: str, proto: int, *, via_memo: bool = False,
                  frame_len: int | None = None) -> bytes:
    """A pickle that calls ``module.name(arg)`` when loaded with an unrestricted unpickler, in protocol ``proto``.

    Protocols 4-5 wrap the body in a FRAME; ``frame_len`` overrides its declared length (wrong-length frames)."""
    if proto == 0:
        return global_op(module, name, 0) + b"(" + _text_str(arg) + b"tR."
    if proto == 1:
        return global_op(module, name, 1) + b"(" + _bin_str(arg, 1) + b"tR."
    body = global_op(module, name, proto, via_memo=via_memo) + _bin_str(arg, proto) + b"\x85R"
    if proto >= 4:
        body += b"\x94"
    body += b"."
    head = b"\x80" + bytes([proto])
    if proto >= 4:
        n = len(body) if frame_len is None else frame_len
        return head + b"\x95" + struct.pack("<Q", n) + body
    return head + body


def benign_pickle(proto: int = 2) -> bytes:
    """``{'a': 1}``, written by ``pickle`` itself."""
    return pickle.dumps({"a": 1}, protocol=proto)


# ------------------------------------------------------------------------------------------------ containers
def torch_zip(data_pkl: bytes, *, folder: str = "archive", extra: dict[str, bytes] | None = None,
              compress: bool = False) -> bytes:
    """A zip laid out like ``torch.save``'s (``<folder>/data.pkl``, ``version``, ...)."""
    buf = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(buf, "w", method) as zf:
        zf.writestr(f"{folder}/data.pkl", data_pkl)
        zf.writestr(f"{folder}/byteorder", b"little")
        for k, v in (extra or {}).items():
            zf.writestr(f"{folder}/{k}" if not k.startswith("/") else k[1:], v)
        zf.writestr(f"{folder}/version", b"3\n")
    return buf.getvalue()


def legacy_stream(main: bytes, *, sys_info: bytes | None = None, keys: bytes | None = None) -> bytes:
    """A torch legacy stream: magic number, protocol 1001, sys_info, ``main``, storage keys (no storages)."""
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
    proto = pickle.dumps(1001, protocol=2)
    info = sys_info if sys_info is not None else pickle.dumps(
        {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}},
        protocol=2)
    return magic + proto + info + main + (keys if keys is not None else pickle.dumps([], protocol=2))


def legacy_tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _patch_zip(data: bytes, member_suffix: bytes, *, flags: int | None = None, crc: int | None = None) -> bytes:
    """Change the general-purpose flags and/or the CRC-32 of the member whose name ends with ``member_suffix``, in
    both its local header and its central-directory record."""
    b = bytearray(data)
    for sig, name_len_at, flags_at, crc_at, hdr in ((b"PK\x03\x04", 26, 6, 14, 30), (b"PK\x01\x02", 28, 8, 16, 46)):
        pos = 0
        while True:
            pos = b.find(sig, pos)
            if pos < 0:
                break
            n = struct.unpack_from("<H", b, pos + name_len_at)[0]
            if bytes(b[pos + hdr:pos + hdr + n]).endswith(member_suffix):
                if flags is not None:
                    struct.pack_into("<H", b, pos + flags_at, flags)
                if crc is not None:
                    struct.pack_into("<I", b, pos + crc_at, crc)
            pos += 4
    return bytes(b)


def zip_with_names(members: list[tuple[str, bytes]]) -> bytes:
    """A zip of ``members`` in order (duplicate names allowed)."""
    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w") as zf:
        warnings.simplefilter("ignore")  # "Duplicate name": on purpose
        for name, data in members:
            zf.writestr(zipfile.ZipInfo(name), data)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ the corpus
def build() -> list[Entry]:
    """Every hostile file, in a fixed order."""
    out: list[Entry] = []
    os_sys = {"os.system"}
    # 1. every gadget, every protocol, as a plain pickle named like a checkpoint
    for module, name, arg in GADGETS:
        qual = f"{'builtins' if module == '__builtin__' else module}.{name}"
        out.extend(Entry(f"gadget-{module}.{name}-p{proto}.pt", gadget_pickle(module, name, arg, proto), "gadget",
                         {qual}) for proto in range(6))
        out.append(Entry(f"gadget-{module}.{name}-zip.pth",
                         torch_zip(gadget_pickle(module, name, arg, 2)), "gadget-zip", {qual}))
    g = gadget_pickle("os", "system", "id", 2)
    # 2. container and stream tricks
    out += [
        Entry("plain-pickle.bin", g, "plain pickle named .bin", os_sys),
        Entry("stack-global-via-memo-p4.pt", gadget_pickle("os", "system", "id", 4, via_memo=True), "memo names",
              os_sys),
        Entry("stack-global-via-memo-p5.pt", gadget_pickle("os", "system", "id", 5, via_memo=True), "memo names",
              os_sys),
        Entry("frame-too-short.pt", gadget_pickle("os", "system", "id", 4, frame_len=3), "frame length", os_sys),
        Entry("frame-too-long.pt", gadget_pickle("os", "system", "id", 4, frame_len=1 << 40), "frame length"),
        Entry("frame-zero.pt", gadget_pickle("os", "system", "id", 5, frame_len=0), "frame length", os_sys),
        Entry("pickle-then-zip.pt", g + torch_zip(benign_pickle()), "pickle with a zip appended", os_sys),
        Entry("benign-then-gadget.pt", benign_pickle() + g, "several pickles in a row", os_sys, scan_only=True),
        Entry("benign-p0-then-gadget.pt", benign_pickle(0) + gadget_pickle("subprocess", "Popen", "id", 0),
              "several pickles in a row", {"subprocess.Popen"}, scan_only=True),
        Entry("zip-then-gadget-pickle.pt", torch_zip(benign_pickle()) + g, "zip with a pickle appended", os_sys,
              scan_only=True),
        Entry("zip-data-pkl-trailing-pickle.pt", torch_zip(benign_pickle() + g), "two pickles in data.pkl", os_sys,
              scan_only=True),
        Entry("zip-deflated-data-pkl.pt", torch_zip(g, compress=True), "deflated data.pkl", os_sys),
        Entry("zip-odd-folder.pt", torch_zip(g, folder="../../weird\\folder"), "odd member names", os_sys),
        Entry("zip-pkl-elsewhere.pt", torch_zip(benign_pickle(), extra={"/other/data.pkl": g}),
              "second data.pkl in another folder", os_sys, scan_only=True),
        Entry("zip-extra-pkl-member.pt", torch_zip(benign_pickle(), extra={"extra.pkl": g}), "other .pkl member",
              os_sys, scan_only=True),
        Entry("zip-hidden-pickle-member.pt", torch_zip(benign_pickle(), extra={"weights.bin": g}),
              "pickle under another name", os_sys, scan_only=True),
        Entry("zip-duplicate-data-pkl.pt",
              zip_with_names([("archive/data.pkl", benign_pickle()), ("archive/data.pkl", g),
                              ("archive/version", b"3\n")]),
              "duplicate member names", os_sys),
        Entry("zip-bad-crc.pt", _patch_zip(torch_zip(g), b"data.pkl", crc=0x12345678), "bad CRC-32 on data.pkl",
              os_sys),
        Entry("zip-flag-bits.pt", _patch_zip(torch_zip(g), b"data.pkl", flags=0x0808 | 0x0006), "odd flag bits",
              os_sys),
        Entry("zip-encrypted-flag.pt", _patch_zip(torch_zip(g), b"data.pkl", flags=0x0001), "encrypted flag",
              set()),
        Entry("zip-nested.pt", torch_zip(benign_pickle(), extra={"inner.zip": torch_zip(g)}), "nested zip", os_sys,
              scan_only=True),
        Entry("zip-nested-twice.pt",
              torch_zip(benign_pickle(), extra={"a.zip": torch_zip(benign_pickle(), extra={"b.zip": torch_zip(g)})}),
              "zip in a zip in a zip", os_sys, scan_only=True),
        Entry("torchscript-like-gadget.pt", torch_zip(g, extra={"constants.pkl": benign_pickle(), "code/x.py": b""}),
              "TorchScript archive with a gadget", os_sys),
        Entry("code-folder-no-constants.pt", torch_zip(g, extra={"code/__torch__/m.py": b"x = 1\n"}),
              "code/ without constants.pkl (torch.load unpickles it)", os_sys),
        Entry("legacy-main-gadget.pt", legacy_stream(g), "legacy stream, main pickle", os_sys),
        Entry("legacy-sys-info-gadget.pt", legacy_stream(benign_pickle(), sys_info=g), "legacy stream, sys_info",
              os_sys),
        Entry("legacy-keys-gadget.pt", legacy_stream(benign_pickle(), keys=g), "legacy stream, key list", os_sys),
        Entry("legacy-tar.pt", legacy_tar({"sys_info": benign_pickle(), "pickle": g, "storages": benign_pickle(),
                                           "tensors": benign_pickle()}), "legacy tar", os_sys, scan_only=True),
        Entry("inst-opcode-p0.pt", b"(S'id'\nios\nsystem\n.", "INST opcode", os_sys),
        Entry("obj-opcode-p1.pt", b"(cos\nsystem\nU\x02ido.", "OBJ opcode", os_sys),
        Entry("newobj-p2.pt", b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00id\x85\x81.", "NEWOBJ", os_sys),
        Entry("build-setstate-p2.pt", b"\x80\x02cos\nsystem\n)\x81}X\x01\x00\x00\x00a\x4b\x01sb.", "BUILD", os_sys),
        Entry("persid-gadget-p2.pt", b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00id\x85RQ.", "persistent id", os_sys),
        Entry("reduce-error-after.pt", g[:-1] + b"\xff", "gadget then garbage", os_sys),
    ]
    # 3. resource bombs: each must be refused in bounded time and memory
    out += [
        Entry("memo-bomb-long-binput.pt", b"\x80\x02N r\xf0\xff\xff\x3f.".replace(b" ", b""), "memo bomb", bomb=True),
        Entry("memo-bomb-put.pt", b"Np1073741823\n.", "memo bomb (text PUT)", bomb=True),
        Entry("memo-bomb-late.pt", b"\x80\x02" + b"N" * 100 + b"r\x00\x00\x00\x40.", "memo bomb", bomb=True),
        Entry("huge-binunicode8.pt", b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"abc.", "huge length", bomb=True),
        Entry("huge-binbytes8.pt", b"\x80\x04\x8e" + struct.pack("<Q", 1 << 33) + b"abc.", "huge length", bomb=True),
        Entry("huge-bytearray8.pt", b"\x80\x05\x96" + struct.pack("<Q", 1 << 34) + b"abc.", "huge length", bomb=True),
        Entry("huge-binunicode.pt", b"\x80\x02X\xff\xff\xff\xffabc.", "huge length", bomb=True),
        Entry("huge-long4.pt", b"\x80\x02\x8b\xff\xff\xff\x7f\x00.", "huge length", bomb=True),
        Entry("huge-frame.pt", b"\x80\x04\x95" + struct.pack("<Q", (1 << 63) - 1) + b"N.", "huge frame", bomb=True),
        Entry("deep-list.pt", b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b".", "deep nesting", bomb=True),
        Entry("deep-dict-values.pt", b"\x80\x02" + b"}X\x01\x00\x00\x00k" * 50_000 + b"Ns" + b"s" * 49_999 + b".",
              "deep nesting", bomb=True),
        Entry("zip-bomb-declared.pt", _zip_bomb(declared=3 << 30), "zip bomb (declared size)", bomb=True),
        Entry("zip-bomb-lying.pt", _zip_bomb(declared=100), "zip bomb (lying size)", bomb=True),
        Entry("zip-no-directory.pt", torch_zip(g)[:-30], "truncated zip", bomb=True),
        Entry("safetensors-deep-json.safetensors", _safetensors_header(b"[" * 100_000 + b"]" * 100_000),
              "deep JSON", bomb=True),
        Entry("safetensors-huge-int.safetensors", _safetensors_header(b'{"a": ' + b"9" * 100_000 + b"}"),
              "huge JSON number", bomb=True),
    ]
    return out


def deep_tuple_key_pickle(depth: int = 1_000_000) -> bytes:
    """A dict whose key is ``depth`` nested 1-tuples: hashing it recurses ``depth`` times in C (CPython's tuple
    hash has no depth check), a segfault on an 8 MiB stack. Not in :func:`build` because a reader that gets it wrong
    crashes the process: test it in a subprocess."""
    return b"\x80\x02}" + b")" + b"\x85" * depth + b"Ns."


@functools.lru_cache(maxsize=1)
def _zeros_deflated() -> tuple[bytes, int]:
    raw = b"\x80\x02N." + b"\x00" * (16 << 20)
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    return comp.compress(raw) + comp.flush(), zlib.crc32(raw)


def _zip_bomb(declared: int) -> bytes:
    """A torch-like zip whose data.pkl is 16 MiB of zeros deflated to ~16 KiB, declaring ``declared`` bytes."""
    body, crc = _zeros_deflated()
    name = b"archive/data.pkl"
    size32 = min(declared, 0xFFFFFFFF)
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, crc, len(body), size32, len(name), 0) + name
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0, crc, len(body), size32,
                          len(name), 0, 0, 0, 0, 0, 0) + name
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(local) + len(body), 0)
    return local + body + central + eocd


def _safetensors_header(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


def write(outdir: Path) -> list[tuple[Entry, Path]]:
    """Write :func:`build` into ``outdir``; returns ``(entry, path)`` pairs."""
    outdir.mkdir(parents=True, exist_ok=True)
    res = []
    for e in build():
        p = outdir / e.name.replace("/", "_")
        p.write_bytes(e.data)
        res.append((e, p))
    return res


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "hostile-corpus")
    files = write(target)
    print(f"{len(files)} files in {target}")
