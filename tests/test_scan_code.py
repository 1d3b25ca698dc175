"""``scan`` (and ``inspect``'s security verdict) report code that ships inside a checkpoint outside any pickle:
native libraries (:mod:`ckptool.formats.native`), torch.package modules and TorchScript source
(:mod:`ckptool.scanning.shipped_code`), in the text report, ``--json``, SARIF and the verdict."""

from __future__ import annotations

import importlib.util
import io
import json
import struct
import sys
import zipfile
from pathlib import Path

import pytest

from ckptool.formats.native import describe_native
from ckptool.model.allowlist import DANGEROUS, NEEDS_TRUST
from ckptool.ops.inspect.entry import inspect
from ckptool.ops.scan.sarif import to_sarif
from ckptool.scanning.entry import combine_results, scan_file
from ckptool.scanning.shipped_code import package_modules, torchscript_ops

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
import adversarial_code as ac
import hostile_corpus as hc

pytestmark = pytest.mark.torchfree  # the torch-made fixtures are skipped where torch is not installed
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="makes its fixture with torch")


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _torchscript(tmp_path: Path, code: str, name: str = "ts.pt") -> Path:
    path = tmp_path / name
    path.write_bytes(hc.torch_zip(hc.benign_pickle(), extra={"constants.pkl": hc.benign_pickle(),
                                                             "code/__torch__/m.py": code.encode()}))
    return path


def _pe(machine: int, chars: int, magic: int) -> bytes:
    head = bytearray(512)
    head[:2] = b"MZ"
    struct.pack_into("<I", head, 0x3C, 0x80)
    head[0x80:0x84] = b"PE\x00\x00"
    struct.pack_into("<HH", head, 0x84, machine, 1)
    struct.pack_into("<H", head, 0x80 + 22, chars)
    struct.pack_into("<H", head, 0x80 + 24, magic)
    return bytes(head)


# ------------------------------------------------------------------------------------------------ native headers
def test_native_headers_name_format_kind_and_architecture() -> None:
    assert str(describe_native(ac.minimal_elf())) == "ELF 64-bit shared library for x86-64"
    macho = struct.pack("<IiiI", 0xFEEDFACF, 0x0100000C, 0, 6) + bytes(16)
    assert str(describe_native(macho)) == "Mach-O 64-bit dynamic library for arm64"
    assert str(describe_native(_pe(0x8664, 0x2022, 0x20B))) == "PE 64-bit DLL for x86-64"
    fat = struct.pack(">III", 0xCAFEBABE, 2, 0x01000007) + bytes(16)
    assert describe_native(fat) is not None and describe_native(fat).format == "Mach-O"  # type: ignore[union-attr]


def test_lookalikes_are_not_native() -> None:
    java_class = struct.pack(">IHH", 0xCAFEBABE, 0, 52) + bytes(16)  # shares the fat Mach-O magic
    assert describe_native(java_class) is None
    assert describe_native(b"MZ" + bytes(200)) is None  # no PE signature: a DOS program, no loader runs it
    assert describe_native(b"\x7fELF\x02\x09" + bytes(30)) is None  # no byte order
    assert describe_native(b"\x80\x02}q\x00.") is None


def test_a_real_system_library(tmp_path: Path) -> None:
    lib = next((p for p in Path("/usr/lib/x86_64-linux-gnu").glob("libBrokenLocale.so*") if p.is_file()), None)
    if lib is None:
        pytest.skip("no x86-64 system library to read")
    desc = describe_native(lib.read_bytes()[:4096])
    assert desc is not None and (desc.format, desc.kind, desc.arch, desc.bits) == ("ELF", "shared library",
                                                                                   "x86-64", 64)


# ------------------------------------------------------------------------------------------------ native in zips
def test_native_library_anywhere_whatever_its_name(tmp_path: Path) -> None:
    (tmp_path / "a.zip").write_bytes(_zip({"docs/readme.txt": ac.minimal_elf(), "b.pkl": hc.benign_pickle()}))
    res = scan_file(tmp_path / "a.zip")
    assert [(c.member, c.kind, c.level, c.detail) for c in res.code] == [
        ("docs/readme.txt", "native-library", DANGEROUS, "ELF 64-bit shared library for x86-64")]
    assert res.verdict == DANGEROUS and res.exit_code == 1 and res.strict_exit_code == 1
    (tmp_path / "pe.zip").write_bytes(_zip({"x/tool.dat": _pe(0xAA64, 0x0002, 0x20B), "b.pkl": hc.benign_pickle()}))
    assert [c.detail for c in scan_file(tmp_path / "pe.zip").code] == ["PE 64-bit executable for ARM64"]


def test_nested_zip_library_is_named_by_its_path(tmp_path: Path) -> None:
    res = scan_file(ac.make_nested_renamed_elf(tmp_path))
    assert [(c.member, c.level) for c in res.code] == [("archive/extra.zip!weights.bin", DANGEROUS)]
    assert "ELF 64-bit shared library for x86-64" in res.code[0].reason


def test_tensor_records_are_not_read_but_library_names_are(tmp_path: Path) -> None:
    """A torch zip's ``data/<key>`` records are tensor bytes (never read: inspect's rule); a member there named like
    a library, and anything under ``data/aotinductor/``, is read."""
    path = tmp_path / "t.pth"
    path.write_bytes(hc.torch_zip(hc.benign_pickle(), extra={"data/0": ac.minimal_elf(),
                                                             "data/evil.so": ac.minimal_elf()}))
    assert [c.member for c in scan_file(path).code] == ["archive/data/evil.so"]


def test_aoti_library_and_source_in_a_pt2(tmp_path: Path) -> None:
    path = tmp_path / "m.pt2"
    path.write_bytes(_zip({"m/archive_format": b"pt2", "m/archive_version": b"1",
                           "m/data/aotinductor/model/k.cpp": b"int f() { return 0; }",
                           "m/data/aotinductor/model/k.so": ac.minimal_elf()}))
    res = scan_file(path)
    got = {c.member: (c.kind, c.level) for c in res.code}
    assert got == {"m/data/aotinductor/model/k.so": ("native-library", DANGEROUS),
                   "m/data/aotinductor/model/k.cpp": ("native-source", DANGEROUS)}
    so = next(c for c in res.code if c.kind == "native-library")
    assert "aoti_load_package" in so.reason and "x86-64" in so.reason


# ------------------------------------------------------------------------------------------------ torch.package
def _package(tmp_path: Path, pickle_bytes: bytes) -> Path:
    path = tmp_path / "pkg.pt"
    path.write_bytes(_zip({"pkg/.data/version": b"6\n", "pkg/.data/extern_modules": b"collections\n",
                           "pkg/res/obj.pkl": pickle_bytes, "pkg/sub/__init__.py": b"", "pkg/sub/inner.py": b"x = 1",
                           "pkg/mymod.py": b"import os", "pkg/.data/0.storage": b"\x00" * 8}))
    return path


def test_package_modules_named_by_a_pickle_are_dangerous(tmp_path: Path) -> None:
    res = scan_file(_package(tmp_path, hc.gadget_pickle("sub.inner", "Thing", "x", 2)))
    got = {c.detail: (c.member, c.level) for c in res.code}
    assert got == {"sub": ("pkg/sub/__init__.py", DANGEROUS), "sub.inner": ("pkg/sub/inner.py", DANGEROUS),
                   "mymod": ("pkg/mymod.py", NEEDS_TRUST)}
    assert res.verdict == DANGEROUS
    assert "load_pickle imports it" in next(c.reason for c in res.code if c.detail == "sub.inner")


def test_package_module_nobody_names_is_reported_present(tmp_path: Path) -> None:
    res = scan_file(_package(tmp_path, hc.benign_pickle()))
    assert {(c.detail, c.level) for c in res.code} == {("sub", NEEDS_TRUST), ("sub.inner", NEEDS_TRUST),
                                                         ("mymod", NEEDS_TRUST)}
    assert res.verdict == NEEDS_TRUST and res.exit_code == 4


def test_package_modules_of_a_global() -> None:
    assert package_modules(["<torch_package_0>.a.b.Net", "c.f"]) == {"a", "a.b", "c"}
    # GLOBAL 'x.y Outer.Inner' reads as x.y.Outer.Inner: every prefix may be the module
    assert package_modules(["x.y.Outer.Inner"]) == {"x", "x.y", "x.y.Outer"}


# ------------------------------------------------------------------------------------------------ TorchScript
def test_torchscript_ops_are_read_from_tokens() -> None:
    src = ('def forward(self, x):\n  y = ops.prim.data(x)\n  z = torch.relu(y)\n  w = ops.my_ns.evil(z)\n'
           '  v = torch.ops.other.op(w)\n  s = "ops.instring.op"  # ops.incomment.op\n'
           '  u = self.ops.attr.x\n  torch.save(v, "/tmp/p")\n  return torch.autograd.grad(u)\n')
    assert list(torchscript_ops(src)) == [("prim", "data"), ("aten", "relu"), ("my_ns", "evil"),
                                          ("other", "op"), ("aten", "save"), ("aten", "grad")]
    assert list(torchscript_ops('def f(x):\n  return getattr(ops, "evil")(x)\n')) == [("?", "?")]
    assert list(torchscript_ops("def f(x):\n  return getattr(ops.evil, 'op')(x)\n")) == [("evil", "?")]
    # source tokenize rejects is searched as text
    assert list(torchscript_ops('def f(x):\n  return ops.hidden.op(x)\n"""unterminated')) == [("hidden", "op")]


def test_builtin_torchscript_needs_trust_with_its_reason(tmp_path: Path) -> None:
    res = scan_file(_torchscript(tmp_path, "def forward(self, x):\n  return ops.quantized.add(torch.relu(x))\n"))
    assert [(c.member, c.kind, c.level) for c in res.code] == [("archive/code/", "torchscript", NEEDS_TRUST)]
    assert "built-in ops (aten, quantized) only" in res.code[0].reason
    assert res.verdict == NEEDS_TRUST and res.strict_exit_code == 1


@pytest.mark.parametrize(("code", "op"), [
    ("def forward(self, x):\n  return ops.my_ext.run(x)\n", "my_ext::run"),
    ("def forward(self, x):\n  torch.save(x, 'out.pt')\n  return x\n", "aten::save"),
    ("def forward(self, x):\n  return ops.c10d.broadcast_(x)\n", "c10d::broadcast_"),
    ("def forward(self, x):\n  return ops._caffe2.Foo(x)\n", "_caffe2::Foo"),
])
def test_other_ops_are_dangerous_naming_op_and_file(tmp_path: Path, code: str, op: str) -> None:
    res = scan_file(_torchscript(tmp_path, code))
    bad = [c for c in res.code if c.level == DANGEROUS]
    assert [(c.member, c.detail) for c in bad] == [("archive/code/__torch__/m.py", op)]
    assert op in bad[0].reason and res.verdict == DANGEROUS


def test_foreign_torchbind_classes_are_dangerous(tmp_path: Path) -> None:
    """A TorchBind class outside torch's own namespaces, named in code/ or held by a pickle of the archive."""
    code = ("def forward(self, x: __torch__.torch.classes.quantized.LinearPackedParamsBase,\n"
            "    t: __torch__.torch.classes.my_lib.Tokenizer) -> Tensor:\n  return torch.relu(x)\n")
    res = scan_file(_torchscript(tmp_path, code))
    assert [(c.member, c.detail) for c in res.code if c.level == DANGEROUS] == [
        ("archive/code/__torch__/m.py", "my_lib.Tokenizer")]
    path = tmp_path / "obj.pt"
    path.write_bytes(hc.torch_zip(hc.gadget_pickle("__torch__.torch.classes.my_lib", "Tokenizer", "x", 2),
                                  extra={"constants.pkl": hc.benign_pickle(), "code/__torch__/m.py": b""}))
    res = scan_file(path)
    assert [(c.member, c.detail) for c in res.code if c.level == DANGEROUS] == [("archive/data.pkl",
                                                                                 "my_lib.Tokenizer")]
    assert res.verdict == DANGEROUS


def test_code_folder_is_read_only_in_torchscript_archives(tmp_path: Path) -> None:
    """torch.load hands a zip to torch.jit.load only with constants.pkl; otherwise code/ is never compiled."""
    path = tmp_path / "fake.pt"
    path.write_bytes(hc.torch_zip(hc.benign_pickle(), extra={"code/__torch__/m.py": b"ops.evil.op(x)"}))
    assert scan_file(path).code == []


def test_real_torchscript_stays_needs_trust(real_dir: Path) -> None:
    res = scan_file(real_dir / "silero-vad.jit")
    assert res.verdict == NEEDS_TRUST and res.exit_code == 4
    assert [(c.kind, c.level) for c in res.code] == [("torchscript", NEEDS_TRUST)]
    assert "built-in ops (aten, prim) only" in res.code[0].reason
    assert res.code[0].member.endswith("/code/")
    assert scan_file(real_dir / "facenet-pnet.pt").code == []  # a legacy stream: no code


# ------------------------------------------------------------------------------------------------ outputs
def test_json_sarif_inspect_and_text_carry_member_and_kind(tmp_path: Path, real_dir: Path, run_cli) -> None:
    path = tmp_path / "a.zip"
    path.write_bytes(_zip({"lib/x.bin": ac.minimal_elf(), "b.pkl": hc.benign_pickle()}))
    d = scan_file(path).to_dict()
    assert d["code"] == [{"member": "lib/x.bin", "kind": "native-library", "level": DANGEROUS,
                          "reason": d["code"][0]["reason"], "detail": "ELF 64-bit shared library for x86-64"}]
    sarif = to_sarif([scan_file(path)], version="0")
    (hit,) = [r for r in sarif["runs"][0]["results"] if r["ruleId"] == "CKPT004"]
    assert hit["level"] == "error" and hit["locations"][0]["logicalLocations"] == [{"name": "lib/x.bin",
                                                                                    "kind": "member"}]
    assert hit["properties"]["code_kind"] == "native-library"
    out = json.loads(run_cli("scan", "--json", path).output)
    assert out["exit_code"] == 1 and out["files"][0]["code"][0]["member"] == "lib/x.bin"
    r = run_cli("scan", path)
    assert r.exit_code == 1 and "code (DANGEROUS, native-library): lib/x.bin:" in r.output
    sec = inspect(real_dir / "silero-vad.jit").to_dict()["security"]
    assert sec["verdict"] == NEEDS_TRUST and [c["kind"] for c in sec["code"]] == ["torchscript"]


def test_combined_results_prefix_the_part(tmp_path: Path) -> None:
    path = tmp_path / "a.zip"
    path.write_bytes(_zip({"lib/x.bin": ac.minimal_elf(), "b.pkl": hc.benign_pickle()}))
    res = combine_results("set", "sharded-torch", [("s1.bin", scan_file(path))])
    assert [c.member for c in res.code] == ["s1.bin!lib/x.bin"] and res.verdict == DANGEROUS


# ------------------------------------------------------------------------------------------------ torch-made fixtures
@needs_torch
def test_torch_made_fixtures(tmp_path: Path) -> None:
    """The adversarial cases made with torch itself (tests/test_adversarial.py runs their loaders)."""
    for name, make in [("pt2", ac.make_aoti_pt2), ("pkg", ac.make_package_used), ("ts", ac.make_custom_op_script)]:
        (tmp_path / name).mkdir()
        res = scan_file(make(tmp_path / name))
        bad = [(c.kind, c.detail) for c in res.code if c.level == DANGEROUS]
        assert res.verdict == DANGEROUS, (name, res.code)
        if name == "pt2":
            assert bad == [("native-library", "ELF 64-bit shared library for x86-64")]
        elif name == "pkg":
            assert bad == [("python-module", "mymod")]
        else:
            assert bad == [("torchscript", ac.CUSTOM_OP)]


@needs_torch
def test_a_library_in_a_zip_inside_a_dcp_file(tmp_path: Path) -> None:
    """DCP folders are walked by their byte ranges (scanning/dcp.py); the zips found there are checked too."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, checkpoint_id=folder)
    with open(folder / "__0_0.distcp", "ab") as f:
        f.write(_zip({"lib/x.so": ac.minimal_elf()}))
    res = scan_file(folder)
    (hit,) = res.code
    assert hit.kind == "native-library" and hit.member.endswith("(named by no record)!lib/x.so"), hit
    assert res.verdict == DANGEROUS
