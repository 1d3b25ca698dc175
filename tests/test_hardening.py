"""Hostile input: every reader refuses resource bombs with a CkptError in bounded time and memory, follows the same
opcodes every loader would, and never imports or runs anything from the file (proved with an audit hook over a
corpus of hostile files, one per gadget and container trick, pickle protocols 0-5)."""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import re
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptool.errors import CkptError, CorruptCheckpointError
from ckptool.formats import pickle_check, unpickler, zipdir
from ckptool.formats.nodes import ObjectNode
from ckptool.formats.pickle_check import call_with_stack, check_pickle
from ckptool.formats.pickler import PicklerError, dumps
from ckptool.formats.torchfile import read_checkpoint
from ckptool.formats.unpickler import load_structure
from ckptool.model import graph
from ckptool.ops.inspect.entry import inspect

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
import hostile_corpus as hc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[hc.Entry, Path]]:
    return hc.write(tmp_path_factory.mktemp("hostile"))


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


# ------------------------------------------------------------------------------------------------ the opcode walk
@pytest.mark.torchfree
def test_opcode_tables_cover_pickletools_exactly() -> None:
    """Every opcode pickletools knows is classified with the argument layout it documents, and nothing else is."""
    layout = {
        None: "noarg", "uint1": 1, "uint2": 2, "int4": 4, "uint4": 4, "float8": 8, "uint8": 8,
        "string1": "len1", "bytes1": "len1", "unicodestring1": "len1", "long1": "len1",
        "bytes4": "len4u", "unicodestring4": "len4u", "string4": "len4s", "long4": "len4s",
        "bytes8": "len8", "unicodestring8": "len8", "bytearray8": "len8",
        "decimalnl_short": "line", "decimalnl_long": "line", "floatnl": "line", "stringnl": "line",
        "unicodestringnl": "line", "stringnl_noescape": "line", "stringnl_noescape_pair": "line2",
    }
    seen = set()
    for op in pickletools.opcodes:
        c = op.code.encode("latin1")[0]
        seen.add(c)
        want = layout[op.arg.name if op.arg else None]
        if c == pickle_check._STOP:
            continue
        if want == "noarg":
            assert c in pickle_check._NOARG and pickle_check._ARG_SIZE[c] == 0, op.name
        elif isinstance(want, int):
            assert pickle_check._ARG_SIZE[c] == want, op.name
        elif want == "len1":
            assert c in pickle_check._LEN1, op.name
        elif want == "len4u":
            assert c in pickle_check._LEN4_UNSIGNED, op.name
        elif want == "len4s":
            assert c in pickle_check._LEN4_SIGNED, op.name
        elif want == "len8":
            assert c in pickle_check._LEN8, op.name
        elif want == "line":
            assert c in pickle_check._LINE1, op.name
        else:
            assert c in pickle_check._LINE2, op.name
    pc = pickle_check
    known = (set(pc._ARG_SIZE) | set(pc._LEN1) | set(pc._LEN4_UNSIGNED) | set(pc._LEN4_SIGNED) | set(pc._LEN8)
             | set(pc._LINE1) | set(pc._LINE2))
    assert known | {pickle_check._STOP} == seen


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=300)
    | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=5),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(obj=_values, protocol=st.integers(0, 5), tail=st.binary(max_size=8))
@pytest.mark.torchfree
def test_check_pickle_finds_the_stop_opcode_pickletools_finds(obj, protocol: int, tail: bytes) -> None:
    data = pickle.dumps(obj, protocol=protocol)
    *_, (op, _arg, pos) = pickletools.genops(data)
    assert op.name == "STOP"
    assert check_pickle(data + tail, exact=False) == pos + 1
    root, _ = load_structure(data + tail)
    if protocol >= 3:  # (protocols 0-2 write bytes as a _codecs.encode call: a node, not bytes)
        assert root == obj


@pytest.mark.torchfree
def test_big_memo_indices_of_real_pickles_pass() -> None:
    """A pickle with more than 65,536 memo entries (LONG_BINPUT) is read both in memory and from a stream."""
    obj = [str(i) for i in range(70_000)]
    data = pickle.dumps(obj, protocol=2)
    assert load_structure(data)[0] == obj
    f = io.BytesIO(b"junk" + data + b"more")
    f.seek(4)
    assert load_structure(f)[0] == obj and f.tell() == 4 + len(data)


# ------------------------------------------------------------------------------------------------ pickle bombs
@pytest.mark.parametrize("data", [
    b"\x80\x02Nr\xf0\xff\xff\x3f.",  # LONG_BINPUT 1 Gi: the C unpickler would allocate and clear 16 GiB
    b"\x80\x02Nr\xff\xff\xff\xff.",
    b"Np1073741823\n.",  # the same with a protocol-0 PUT
    b"\x80\x02" + b"N" * 100 + b"r\x00\x00\x00\x40.",
    b"\x80\x02" + b"]" * 300 + b"r\x00\x00\x01\x00.",  # a 65,536 index 300 bytes into the pickle
    b"\x80\x02" + b"N0" * 20_000 + b"Nr\x00\x00\x00\x40.",  # past the first 24 KiB: found by the fast scan
])
@pytest.mark.torchfree
def test_memo_bombs_are_refused_before_allocating(data: bytes) -> None:
    t = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match="memo index"):
        load_structure(data)
    assert time.perf_counter() - t < 1


@pytest.mark.parametrize("data", [
    b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"abc.",  # BINUNICODE8
    b"\x80\x04\x8e" + struct.pack("<Q", 1 << 33) + b"abc.",  # BINBYTES8: 8 GiB allocated before reading
    b"\x80\x05\x96" + struct.pack("<Q", 1 << 34) + b"abc.",  # BYTEARRAY8
    b"\x80\x02X\xff\xff\xff\xffabc.",  # BINUNICODE
    b"\x80\x02\x8b\xff\xff\xff\x7f\x00.",  # LONG4
    b"\x80\x04\x95" + struct.pack("<Q", (1 << 63) - 1) + b"N.",  # FRAME
    b"\x80\x02T\xff\xff\xff\xffabc.",  # BINSTRING with a negative length
])
@pytest.mark.torchfree
def test_huge_declared_lengths_are_refused(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="corrupted or truncated"):
        load_structure(data)
    f = io.BytesIO(data)  # the same from a stream (the legacy format): the rest of the file is the limit
    with pytest.raises(CorruptCheckpointError, match="corrupted or truncated"):
        load_structure(f)


@pytest.mark.torchfree
def test_frame_that_cuts_an_opcode_is_refused() -> None:
    """CPython's C unpickler reading from a file without peek (torch.load's ``data.pkl``) drops the rest of a frame
    that an opcode runs past, so it sees other opcodes than an in-memory read: such pickles are refused."""
    short = hc.gadget_pickle("os", "system", "id", 4, frame_len=3)
    with pytest.raises(CorruptCheckpointError, match="runs past the end of its FRAME"):
        load_structure(short)
    # two frames where the second starts inside the first
    inner = b"\x95" + struct.pack("<Q", 1) + b"N"
    with pytest.raises(CorruptCheckpointError, match="inside the previous frame"):
        load_structure(b"\x80\x04\x95" + struct.pack("<Q", 12) + inner + b"0N.")
    # the same far into a pickle, where the fast expression does the walking
    body = b"N0" * 15_000 + b"\x8c\x02ab" + b"0N."
    with pytest.raises(CorruptCheckpointError, match="runs past the end of its FRAME"):
        load_structure(b"\x80\x04\x95" + struct.pack("<Q", 30_002) + body)
    assert load_structure(b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body)[0] is None
    # a frame of exactly the right size, and an empty one, are fine
    good = hc.gadget_pickle("os", "system", "id", 4)
    assert load_structure(good)[1].globals_seen == {("os", "system"): None}
    assert load_structure(hc.gadget_pickle("os", "system", "id", 4, frame_len=0))[0] is not None
    # ... and the flat reading stays available to the scanner
    end = check_pickle(short, strict_frames=False)
    assert end == len(short)


@pytest.mark.torchfree
def test_real_protocol_5_frames_pass() -> None:
    obj = {f"k{i}": str(i) * 40 for i in range(5000)}  # several 64 KiB frames
    data = pickle.dumps(obj, protocol=5)
    assert data.count(b"\x95") >= 2
    assert load_structure(data)[0] == obj


DEEP_TUPLE_SCRIPT = textwrap.dedent("""
    import sys
    from ckptool.errors import CkptError
    from ckptool.ops.inspect.entry import inspect
    from ckptool.formats.unpickler import load_structure
    data = open(sys.argv[1], "rb").read()
    root, _ = load_structure(data)          # the dict is built: its key was hashed in a big-stack thread
    print("loaded", type(root).__name__)
    try:
        inspect(sys.argv[1])
        print("inspected")
    except CkptError as e:
        print("CkptError", e)
""")


@pytest.mark.torchfree
def test_deep_tuple_dict_key_does_not_crash(tmp_path: Path) -> None:
    """A million nested 1-tuples used as a dict key: hashing recurses in C without a depth check (a segfault on an
    8 MiB stack). Run in a child process so that a crash cannot take the test session down."""
    p = _write(tmp_path, "deep.pt", hc.deep_tuple_key_pickle(1_000_000))
    r = subprocess.run([sys.executable, "-c", DEEP_TUPLE_SCRIPT, str(p)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "loaded dict" in r.stdout
    assert "CkptError" in r.stdout or "inspected" in r.stdout


@pytest.mark.torchfree
def test_call_with_stack_runs_deep_work_in_a_helper_thread() -> None:
    assert call_with_stack(lambda: threading.current_thread().name, 10) != "ckptool-unpickle"
    assert call_with_stack(lambda: threading.current_thread().name, 10**6) == "ckptool-unpickle"

    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        call_with_stack(boom, 10**6)
    with pytest.raises(CkptError, match="stack"):
        call_with_stack(boom, 10**10)


@pytest.mark.parametrize("name", ["deep-list.pt", "deep-dict-values.pt"])
@pytest.mark.torchfree
def test_deep_nesting_is_a_clear_error(corpus, name: str) -> None:
    path = {e.name: p for e, p in corpus}[name]
    with pytest.raises(CorruptCheckpointError, match="deeper than ckptool can walk"):
        inspect(path)


@pytest.mark.torchfree
def test_pickler_refuses_too_deep_graphs() -> None:
    root: list = []
    for _ in range(sys.getrecursionlimit() + 1000):  # torch._dynamo raises the limit when a test compiles a model
        root = [root]
    with pytest.raises(PicklerError, match="nested deeper"):
        dumps(root)


# ------------------------------------------------------------------------------------------------ module trees
def _module(params: dict, modules: dict) -> object:
    """A pickled nn.Module node: NEWOBJ of a placeholder class, BUILD with its __dict__."""
    up = unpickler.RestrictedUnpickler(io.BytesIO(b""))
    cls = up.find_class("mypkg", "Net")
    m = ObjectNode.__new__(cls)
    m.__setstate__({"_parameters": params, "_buffers": {}, "_modules": modules, "training": True})
    return m


@pytest.mark.torchfree
def test_module_that_contains_itself_is_refused(tmp_path: Path) -> None:
    m = _module({}, {})
    m.state["_modules"]["me"] = m
    p = _write(tmp_path, "cycle.pt", dumps(m))
    with pytest.raises(CorruptCheckpointError, match="contains itself"):
        inspect(p)


@pytest.mark.torchfree
def test_exponential_module_tree_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Submodules shared at every level: 2**40 state_dict entries from a pickle of a few KiB."""
    base = _module({"w": None}, {})
    m = base
    for _ in range(40):
        m = _module({}, {"a": m, "b": m})
    p = _write(tmp_path, "dag.pt", dumps(m))
    monkeypatch.setattr(graph, "MAX_MODULE_ENTRIES", 10_000)
    t = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match="more than 10000 state_dict entries"):
        inspect(p)
    assert time.perf_counter() - t < 5


@pytest.mark.torchfree
def test_many_items_do_not_make_find_state_dicts_quadratic(tmp_path: Path) -> None:
    p = _write(tmp_path, "wide.pt", pickle.dumps({"a": list(range(300_000))}, protocol=2))
    t = time.perf_counter()
    info = inspect(p)
    assert info.kind == "tensors" and time.perf_counter() - t < 5


# ------------------------------------------------------------------------------------------------ zip files
def _torch_zip_bytes(obj: object) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rezip(data: bytes, change: dict[str, bytes | None], compress: set[str] = frozenset()) -> bytes:
    """Copy a zip, replacing (or with None dropping) members whose name ends with a key of ``change``."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body = src.read(info)
            for suffix, new in change.items():
                if info.filename.endswith(suffix):
                    body = new
            if body is None:
                continue
            method = zipfile.ZIP_DEFLATED if any(info.filename.endswith(s) for s in compress) else zipfile.ZIP_STORED
            dst.writestr(zipfile.ZipInfo(info.filename), body, compress_type=method)
    return out.getvalue()


def test_storage_larger_than_its_record_is_refused(tmp_path: Path) -> None:
    import torch

    data = _torch_zip_bytes({"w": torch.arange(16, dtype=torch.float32)})
    p = _write(tmp_path, "short.pt", _rezip(data, {"data/0": bytes(32)}))
    with pytest.raises(CorruptCheckpointError, match=r"declares 16 elements .64 bytes. but its record holds 32"):
        read_checkpoint(str(p))
    p = _write(tmp_path, "missing.pt", _rezip(data, {"data/0": None}))
    with pytest.raises(CorruptCheckpointError, match="has no record data/0"):
        inspect(p)


def test_zip_bombs_are_refused_in_bounded_time(corpus, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    paths = {e.name: p for e, p in corpus}
    with pytest.raises(CorruptCheckpointError, match="over ckptool's limit"):
        inspect(paths["zip-bomb-declared.pt"])
    t = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match="inflates past its declared size"):
        inspect(paths["zip-bomb-lying.pt"])
    assert time.perf_counter() - t < 1
    # a legitimately compressed data.pkl reads, unless it is over the limit
    import torch

    p = _write(tmp_path, "deflated.pt", _rezip(_torch_zip_bytes({"w": torch.ones(3)}), {}, compress={"data.pkl"}))
    assert [t.key for t in inspect(p).tensors] == ["w"]
    monkeypatch.setattr(zipdir, "MAX_INFLATE", 10)
    with pytest.raises(CorruptCheckpointError, match="over ckptool's limit of 10 bytes"):
        inspect(p)


@pytest.mark.torchfree
def test_duplicate_and_encrypted_members_are_refused(corpus) -> None:
    paths = {e.name: p for e, p in corpus}
    with pytest.raises(CorruptCheckpointError, match=r"two members named 'archive/data\.pkl'"):
        inspect(paths["zip-duplicate-data-pkl.pt"])
    with pytest.raises(CorruptCheckpointError, match="encrypted"):
        inspect(paths["zip-encrypted-flag.pt"])


@pytest.mark.torchfree
def test_damaged_central_directories_are_clear_errors(tmp_path: Path) -> None:
    good = hc.torch_zip(hc.benign_pickle())
    cd = good.rfind(b"PK\x01\x02")
    # a UTF-8-flagged name that is not UTF-8
    bad = bytearray(good)
    struct.pack_into("<H", bad, cd + 8, 0x0800)
    name_at = cd + 46
    bad[name_at] = 0xFF
    with pytest.raises(CorruptCheckpointError, match="not valid UTF-8"):
        inspect(_write(tmp_path, "badname.pt", bytes(bad)))
    # ZIP64 sizes announced (0xFFFFFFFF) but no ZIP64 extra field
    bad = bytearray(good)
    struct.pack_into("<I", bad, cd + 24, 0xFFFFFFFF)
    with pytest.raises(CorruptCheckpointError, match=r"ZIP64|damaged zip"):
        inspect(_write(tmp_path, "zip64.pt", bytes(bad)))
    bad = bytearray(good)
    struct.pack_into("<HH", bad, cd + 30, 20, 0)  # extra field length 20 with nothing there
    struct.pack_into("<I", bad, cd + 24, 0xFFFFFFFF)
    with pytest.raises(CorruptCheckpointError):
        inspect(_write(tmp_path, "zip64b.pt", bytes(bad)))


# ------------------------------------------------------------------------------------------------ legacy streams
@pytest.mark.torchfree
def test_legacy_globals_of_every_pickle_are_reported(corpus) -> None:
    """torch.load unpickles all five pickles of a legacy stream: a gadget in sys_info counts."""
    path = {e.name: p for e, p in corpus}["legacy-sys-info-gadget.pt"]
    info = inspect(path)
    assert "os.system" in info.unsafe_globals and info.verdict == "dangerous"


def test_legacy_duplicate_storage_keys_are_refused(tmp_path: Path) -> None:
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    at = _legacy_keys_at(data)
    end = check_pickle(data, at, exact=False)
    keys = pickle.loads(data[at:end])
    p = _write(tmp_path, "dup.pt", data[:at] + pickle.dumps(keys + keys, protocol=2) + data[end:])
    with pytest.raises(CorruptCheckpointError, match="names a storage twice"):
        read_checkpoint(str(p))


def _legacy_keys_at(data: bytes) -> int:
    pos = 0
    for _ in range(4):
        pos = check_pickle(data, pos, exact=False)
    return pos


# ------------------------------------------------------------------------------------------------ safetensors
@pytest.mark.parametrize("name", ["safetensors-deep-json.safetensors", "safetensors-huge-int.safetensors"])
@pytest.mark.torchfree
def test_hostile_safetensors_headers(corpus, name: str) -> None:
    path = {e.name: p for e, p in corpus}[name]
    from ckptool.formats.safetensors import read_header

    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        read_header(str(path))


# ------------------------------------------------------------------------------------------------ the corpus
@pytest.mark.torchfree
def test_every_hostile_file_reads_or_fails_cleanly(corpus) -> None:
    """inspect either describes a hostile file (naming its gadget as a global torch would refuse) or raises a
    CkptError; bombs are always refused; nothing takes more than a second."""
    for entry, path in corpus:
        t = time.perf_counter()
        try:
            info = inspect(path)
        except CkptError:
            info = None
        except Exception as e:
            pytest.fail(f"{entry.name}: {type(e).__name__}: {e}")
        assert time.perf_counter() - t < 2, entry.name
        if entry.bomb:
            assert info is None, entry.name
        elif info is not None and not entry.scan_only:
            assert entry.expect <= set(info.unsafe_globals), (entry.name, info.unsafe_globals)
            if entry.expect:
                assert info.verdict in ("dangerous", "needs-trust"), entry.name


AUDIT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from ckptool.errors import CkptError
    from ckptool.formats.torchfile import read_checkpoint, read_pickle_file
    from ckptool.ops.inspect.entry import inspect
    from ckptool.formats import detect as formats
    try:
        from ckptool.scanning.entry import scan_file
    except ImportError:
        scan_file = None
    try:
        from ckptool.ops.extract import extract_state_dict
    except ImportError:
        extract_state_dict = None

    corpus, warm, outdir = sys.argv[1], sys.argv[2], sys.argv[3]

    def read_all(path, out_name):
        results = []
        for fn in (inspect, read_checkpoint, read_pickle_file, scan_file):
            if fn is None:
                continue
            try:
                fn(path)
                results.append("ok")
            except CkptError as e:
                results.append("CkptError")
            except Exception as e:
                results.append("BUG %s: %s" % (type(e).__name__, e))
        if extract_state_dict is not None:
            try:
                extract_state_dict(path, os.path.join(outdir, out_name + ".pth"))
                results.append("ok")
            except CkptError:
                results.append("CkptError")
            except Exception as e:
                results.append("BUG %s: %s" % (type(e).__name__, e))
        return results

    for name in sorted(os.listdir(warm)):   # load what ckptool itself imports lazily
        read_all(os.path.join(warm, name), "warm-" + name)

    events = []
    FORBIDDEN = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.kill", "os.startfile",
                 "subprocess.", "pty.", "socket.", "urllib.", "http.client.", "ftplib.", "smtplib.", "webbrowser.",
                 "ctypes.", "import", "exec", "compile", "code.__new__", "builtins.input", "pickle.find_class",
                 "marshal.load", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                 "os.truncate", "os.link", "os.symlink", "shutil.", "os.putenv", "os.unsetenv", "cpython.run_",
                 "os.add_dll_directory", "sys.addaudithook")
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    current = [None]

    def hook(event, args):
        if current[0] is None:
            return
        bad = event.startswith(FORBIDDEN)
        if event == "open":
            mode, flags = (args[1] if len(args) > 1 else "r"), (args[2] if len(args) > 2 else 0)
            path = str(args[0])
            writing = ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                       or (isinstance(flags, int) and flags & WRITE))
            bad = bool(writing) and not path.startswith(outdir)
        if bad:
            events.append([current[0], event, repr(args)[:200]])

    sys.addaudithook(hook)
    results = {}
    for name in sorted(os.listdir(corpus)):
        current[0] = name
        results[name] = read_all(os.path.join(corpus, name), name)
        current[0] = None
    print(json.dumps({"events": events, "results": results, "torch": "torch" in sys.modules}))
""")


def _warm_files(folder: Path) -> None:
    """One benign file per container kind, read before the hook is armed (ckptool's own lazy imports)."""
    folder.mkdir()
    (folder / "plain.pt").write_bytes(hc.benign_pickle())
    (folder / "zip.pt").write_bytes(hc.torch_zip(hc.benign_pickle()))
    (folder / "nested.pt").write_bytes(hc.torch_zip(hc.benign_pickle(), extra={"in.zip": hc.torch_zip(b"N.")}))
    (folder / "legacy.pt").write_bytes(hc.legacy_stream(hc.benign_pickle()))
    (folder / "tar.pt").write_bytes(hc.legacy_tar({"pickle": hc.benign_pickle()}))
    (folder / "deep.pt").write_bytes(b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b".")
    (folder / "x.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    (folder / "bomb.pt").write_bytes(hc._zip_bomb(100))


@pytest.mark.torchfree
def test_reading_hostile_files_runs_nothing(corpus, tmp_path: Path) -> None:
    """With an audit hook armed, reading every hostile file (inspect, read_checkpoint, read_pickle_file, and scan /
    extract-state-dict where present) raises no process, network, import, code-execution or file-write event,
    and every failure is a CkptError."""
    corpus_dir = corpus[0][1].parent
    warm = tmp_path / "warm"
    _warm_files(warm)
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-c", AUDIT_SCRIPT, str(corpus_dir), str(warm), str(out)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["events"] == []
    assert len(report["results"]) == len(corpus)
    bugs = {name: res for name, res in report["results"].items() if any(x.startswith("BUG") for x in res)}
    assert bugs == {}
    assert report["torch"] is False  # reading never needed torch


# ------------------------------------------------------------------------------------------------ bounded inflation
sys.path.insert(0, str(REPO / "fixtures"))
import make_hostile

#: runs one command in-process in a child and prints how long it took (the child's peak RSS is read by the parent)
_TIMED = textwrap.dedent("""
    import sys, time
    import ckptool.cli
    sys.argv = ["ckptool", *sys.argv[1:]]
    t = time.perf_counter()
    try:
        ckptool.cli.main()
    finally:
        sys.stderr.write("\\nELAPSED %f\\n" % (time.perf_counter() - t))
""")
#: a grandchild's exit status, time and peak RSS (resource.getrusage(RUSAGE_CHILDREN) of this child: only the
#: grandchild, whatever the test process itself ran before)
_MEASURE = textwrap.dedent("""
    import json, resource, subprocess, sys
    r = subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], capture_output=True, text=True,
                       timeout=120)
    err, _, elapsed = r.stderr.rpartition("ELAPSED ")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"rc": r.returncode, "stderr": err.strip(), "stdout": r.stdout, "elapsed": float(elapsed),
                      "rss_kib": rss}))
""")


def _measure(*args: object) -> dict[str, object]:
    env = {**os.environ, "CKPTOOL_NO_PROGRESS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", _MEASURE, _TIMED, *map(str, args)], capture_output=True, text=True,
                       timeout=300, env=env, check=True)
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """make_hostile's files: about 1 MB each on disk, 1023 MiB once inflated."""
    return make_hostile.write(tmp_path_factory.mktemp("bombs"))


@pytest.mark.parametrize("name", ["pickle-bomb-zeros.pt", "pickle-bomb-trailer.pt", "pickle-bomb-opcodes.pt"])
@pytest.mark.parametrize("command", ["inspect", "remap", "convert"])
@pytest.mark.torchfree
def test_zip_bomb_is_refused_in_bounded_time_and_memory(bombs: dict[str, Path], tmp_path: Path, name: str,
                                                        command: str) -> None:
    """A 1 MB file whose data.pkl inflates to 1 GiB: one Error line, exit 1, under a second and 64 MiB (the whole
    child process: interpreter, ckptool and the refusal), nothing written."""
    path = bombs[name]
    assert path.stat().st_size < 1100_000
    args = {"inspect": [], "remap": ["--to", "cpu", "-o", tmp_path / "out.pt"],
            "convert": ["-o", tmp_path / "out.safetensors"]}[command]
    res = _measure(command, path, *args)
    assert res["rc"] == 1, res
    lines = str(res["stderr"]).splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "zip bomb" in lines[0], res
    assert float(res["elapsed"]) < 1.0, res  # type: ignore[arg-type]
    assert int(res["rss_kib"]) < 64 << 10, res  # type: ignore[call-overload]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.torchfree
def test_storage_bomb_is_copied_compressed(bombs: dict[str, Path], tmp_path: Path) -> None:
    """remap and the prefix commands copy a deflated 1 GiB storage record (1 MB on disk) as its compressed bytes:
    no inflation, so under a second and 64 MiB; the record keeps its method, sizes and CRC-32."""
    src = bombs["storage-bomb.pt"]
    out = tmp_path / "out.pt"
    for args in (["remap", src, "--to", "cuda:0", "-o", out], ["add-prefix", src, "model.", "-o", out, "--force"]):
        res = _measure(*args)
        assert res["rc"] == 0, res
        assert float(res["elapsed"]) < 1.0 and int(res["rss_kib"]) < 64 << 10, res  # type: ignore[arg-type]
        with zipfile.ZipFile(src) as a, zipfile.ZipFile(out) as b:
            ia = next(i for i in a.infolist() if i.filename.endswith("/data/0"))
            ib = next(i for i in b.infolist() if i.filename.endswith("/data/0"))
            assert (ib.compress_type, ib.CRC, ib.file_size, ib.compress_size) == (
                zipfile.ZIP_DEFLATED, ia.CRC, ia.file_size, ia.compress_size)
        assert out.stat().st_size < 1100_000
    info = inspect(out)
    assert [(t.key, t.shape) for t in info.tensors] == [("model.w", [make_hostile.GIB * 1023 // 1024 // 4])]


def test_compressed_storage_rewrite_loads_with_torch(tmp_path: Path) -> None:
    """A small deflated-storage file (2 MiB of zeros, ~2 KiB on disk) and a deflated real checkpoint: the remapped
    output keeps the records deflated and torch.load reads the same values as from the source."""
    import torch

    from ckptool.ops.rewrite.remap import remap

    src = tmp_path / "small.pt"
    src.write_bytes(make_hostile.build(2)["storage-bomb.pt"])
    remap(str(src), str(tmp_path / "a.pt"), to="cuda:1")
    with zipfile.ZipFile(tmp_path / "a.pt") as z:
        assert [i.compress_type for i in z.infolist() if i.filename.endswith("data/0")] == [zipfile.ZIP_DEFLATED]
    got = torch.load(tmp_path / "a.pt", map_location="cpu", weights_only=True)
    assert got["w"].shape == (1 << 19,) and not got["w"].any()
    sd = {"w": torch.randn(300, 7), "b": torch.arange(10)}
    sd["v"] = sd["w"][1:5]
    p = _write(tmp_path, "deflated.pt", _rezip(_torch_zip_bytes(sd), {}, compress={"data/0", "data/1", "data.pkl"}))
    remap(str(p), str(tmp_path / "b.pt"), to="cpu")
    back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    assert back["v"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()


@pytest.mark.torchfree
def test_deflated_pickle_is_checked_as_it_inflates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the ratio limit (raised here to let 32 MiB of zeros through), the opcodes are checked as each chunk
    arrives: garbage is refused at the first chunk, a trailer past 1 MiB as soon as it is seen, never the whole
    member in memory."""
    import tracemalloc

    monkeypatch.setattr(zipdir, "FREE_INFLATE", 64 << 20)
    small = make_hostile.build(32)
    for name, match in (("pickle-bomb-zeros.pt", r"invalid opcode b'\\x00' at byte 0"),
                        ("pickle-bomb-trailer.pt", "goes on for more than 1048576 bytes after its pickle ends")):
        p = _write(tmp_path, name, small[name])
        tracemalloc.start()
        try:
            with pytest.raises(CorruptCheckpointError, match=match):
                read_checkpoint(str(p))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 6 << 20, (name, peak)


@pytest.mark.torchfree
def test_valid_deflated_pickle_reads_in_one_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid deflated data.pkl is inflated once, into one buffer (not a list of chunks joined, not a bytes copy),
    and the unpickler reads that buffer without a copy. The pickle (8 MB of NONE, POP) builds nothing, so the
    peaks are the buffers alone."""
    import tracemalloc

    from ckptool.formats.torchfile import read_pickle_member
    from ckptool.formats.zipdir import read_directory

    monkeypatch.setattr(zipdir, "FREE_INFLATE", 64 << 20)
    body = b"\x80\x02" + b"N0" * (4 << 20) + b"N."
    comp, crc, size = make_hostile.deflated(body, 0)
    p = _write(tmp_path, "n.pt", make_hostile.torch_zip(("data.pkl", comp, 8, crc, size), []))
    with open(p, "rb") as f:
        entry = next(e for e in read_directory(f, p.stat().st_size, str(p)) if e.name.endswith("data.pkl"))
        tracemalloc.start()
        try:
            buf = read_pickle_member(f, entry, str(p))
            inflate_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            root, _ = load_structure(buf)
            load_peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
    assert type(buf) is bytearray and buf == body and root is None
    assert inflate_peak < len(body) * 1.15 + 2 * zipdir.INFLATE_CHUNK, inflate_peak
    assert load_peak < len(body) // 4, load_peak  # no copy of the 8 MB


# ------------------------------------------------------------------------------------------------ tensor layouts
#: (storage numel, sizes, strides, storage offset) of float32 tensors, and whether torch.load accepts them
LAYOUTS = {
    "fits": (4, (2, 2), (2, 1), 0, True),
    "one past the end": (4, (5,), (1,), 0, False),
    "offset past the end": (4, (2,), (1,), 3, False),
    "empty, offset at the end": (4, (0,), (1,), 4, True),
    "empty, offset beyond the end": (4, (0,), (1,), 100, True),
    "empty with a huge size": (4, (0, 1 << 62), (1, 1), 0, True),
    "expanded (zero stride)": (4, (1000, 4), (0, 1), 0, True),
    "all zero strides": (1, (1 << 20, 1 << 20), (0, 0), 0, True),
    "negative stride": (4, (2,), (-1,), 1, False),
    "negative stride on a size-1 dim": (4, (1,), (-1,), 0, True),
    "negative size": (4, (-1,), (1,), 0, False),
    "negative offset": (4, (1,), (1,), -1, False),
    "numel overflow": (4, (1 << 40, 1 << 40), (1, 1), 0, False),
    "numel overflow before a zero size": (4, (1 << 40, 1 << 40, 0), (1, 1, 1), 0, False),
    "zero size before an overflow": (4, (0, 1 << 40, 1 << 40), (1, 1, 1), 0, True),
    "scalar at the last element": (4, (), (), 3, True),
    "scalar past the end": (4, (), (), 4, False),
    "fewer strides than sizes": (4, (2, 2), (1,), 0, False),
    "huge stride on a size-1 dim": (4, (1, 4), (1 << 62, 1), 0, True),
    "scalar over an empty storage": (0, (), (), 0, False),
    "byte count overflow": (4, (1 << 61,), (1,), 0, False),
    "issue 16: 2^40 x 2^40 over 4 elements": (4, (1 << 40, 1 << 40), (1, 1), 0, False),
}


def _layout_file(tmp_path: Path, name: str) -> Path:
    n, shape, stride, off, _ok = LAYOUTS[name]
    data = make_hostile.torch_zip(make_hostile.stored("data.pkl", make_hostile.tensor_pickle(n, shape, stride, off)),
                                  [make_hostile.stored("data/0", bytes(4 * n))])
    return _write(tmp_path, "layout.pt", data)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tensor_layouts_are_judged_as_torch_load_judges_them(tmp_path: Path, name: str) -> None:
    """Every reader refuses exactly the tensor layouts torch.load refuses (the same file through both)."""
    import torch

    p = _layout_file(tmp_path, name)
    try:
        torch.load(p, weights_only=True)
        torch_ok = True
    except RuntimeError:
        torch_ok = False
    assert torch_ok == LAYOUTS[name][4]
    try:
        read_checkpoint(str(p))
        ours = True
    except CorruptCheckpointError as e:
        ours = False
        assert "tensor 'w' does not fit in its storage" in str(e) and "torch.load refuses it too" in str(e)
    assert ours == torch_ok


@pytest.mark.parametrize("command", [
    ["inspect"], ["remap", "--to", "cpu", "-o", "{out}.pt"], ["add-prefix", "model.", "-o", "{out}.pt"],
    ["strip-prefix", "module.", "-o", "{out}.pt"], ["convert", "-o", "{out}.safetensors"],
    ["extract-state-dict", "-o", "{out}.pt"], ["diff", "{src}"], ["sanitize", "-o", "{out}.pt"], ["scan"],
])
@pytest.mark.torchfree
def test_impossible_tensor_is_refused_by_every_command(tmp_path: Path, run_cli, command: list[str]) -> None:
    """Issue 16's file (shape 2^40 x 2^40, stride (1, 1), 4-element storage): one Error line naming the key and
    exit 1 from every command that reads tensors, nothing written; scan (which reads no tensor) still answers."""
    p = _layout_file(tmp_path, "issue 16: 2^40 x 2^40 over 4 elements")
    args = [a.format(out=tmp_path / "out", src=p) for a in command]
    r = run_cli(args[0], p, *args[1:])
    if command == ["scan"]:
        assert r.exit_code == 0, r.output
        return
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert lines[0].startswith("Error: ") and "tensor 'w' does not fit in its storage" in lines[0]
    assert "element count overflows 64 bits" in lines[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["layout.pt"]


def test_impossible_tensor_error_names_its_key(tmp_path: Path) -> None:
    """The error names the tensor by its key in the checkpoint: nested dicts and a pickled module alike."""
    import torch

    from ckptool.ops.rewrite.stream import rewrite_file

    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    for obj, key in (({"model": {"fc.weight": torch.zeros(4)}, "epoch": 3}, "model.fc.weight"),
                     ({"net": net}, "net.0.bias")):
        src = tmp_path / "src.pt"
        torch.save(obj, src)
        ck = read_checkpoint(str(src))
        node = next(t for path, t, _rg in graph.iter_tensors(ck.root) if path == key)
        node.args = (node.args[0], node.args[1], (3,), (2,), *node.args[4:])  # reaches element 5 of 2 or 4
        bad = tmp_path / "bad.pt"
        rewrite_file(ck, str(bad), ck.root)
        want = rf"tensor '{re.escape(key)}' does not fit in its storage: sizes \(3,\), strides \(2,\) and storage"
        with pytest.raises(CorruptCheckpointError, match=want):
            read_checkpoint(str(bad))
        with pytest.raises(RuntimeError):
            torch.load(bad, weights_only=False)


@pytest.mark.parametrize("shape, offsets, why", [
    ([1 << 40, 1 << 40], [0, 16], "element count overflows 64 bits"),
    ([5], [0, 16], r"shape \[5\] of F32 is 20 bytes but data_offsets hold 16"),
    ([2, -2], [0, 16], "not a list of sizes"),
])
def test_safetensors_entry_must_match_its_data(tmp_path: Path, run_cli, shape: list[int], offsets: list[int],
                                               why: str) -> None:
    """A safetensors header entry whose shape does not match its byte range: refused by every reader (inspect,
    convert, diff) with one line, as safetensors itself refuses it."""
    from safetensors import SafetensorError, safe_open

    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}).encode()
    header += b" " * (-len(header) % 8)
    p = _write(tmp_path, "bad.safetensors", struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(SafetensorError), safe_open(str(p), "pt") as f:
        f.get_tensor("w")
    for args in (["inspect", p], ["convert", p, "-o", tmp_path / "o.pt"], ["diff", p, p]):
        r = run_cli(*args)
        assert r.exit_code == 1 and re.search(why, r.output), r.output
        assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o.pt").exists()


def test_dcp_entry_with_an_impossible_shape_is_refused(tmp_path: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptool.formats.dcp import METADATA_FILE, read_dcp_metadata
    from ckptool.formats.nodes import ReduceNode
    from ckptool.formats.pickler import dumps

    folder = tmp_path / "dcp"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(folder))
    finally:
        dist.destroy_process_group()
    meta = folder / METADATA_FILE
    root, _ = load_structure(meta.read_bytes())
    size = root.state["state_dict_metadata"]["w"].state["size"]
    assert isinstance(size, ReduceNode)
    size.args = ([1 << 40, 1 << 40],)
    meta.write_bytes(dumps(root))
    with pytest.raises(CorruptCheckpointError, match=r"DCP entry 'w' declares an impossible tensor: its element"):
        read_dcp_metadata(folder)


def test_tuple_levels_bounds_the_nesting_and_counts_only_large_pickles() -> None:
    """:func:`tuple_levels` is an upper bound on tuple nesting: a pickle of INLINE_TUPLE_LEVELS bytes or fewer is
    bounded by its length (its tuple opcodes not counted: one small pickle a file of a folder's scan); a larger one
    by its count of TUPLE, TUPLE1, TUPLE2 and TUPLE3 bytes, which decides the helper thread's stack."""
    from ckptool.formats.pickle_stack import INLINE_TUPLE_LEVELS, tuple_levels

    small = pickle.dumps(((((1,),),), (2, 3), (4, 5, 6), [7]), protocol=2)
    assert tuple_levels(small) == len(small) <= INLINE_TUPLE_LEVELS
    data = b"\x80\x02)" + b"\x85" * 3000 + b"."  # 3,000 nested TUPLE1s
    assert len(data) > INLINE_TUPLE_LEVELS
    assert tuple_levels(data) == sum(data.count(op) for op in (b"t", b"\x85", b"\x86", b"\x87")) >= 3000
