"""ckptool's safetensors header reader refuses exactly the files ``safetensors.safe_open`` refuses (issue 36).

``ckptool.formats.safetensors.read_header`` mirrors ``SafeTensors::read_metadata`` / ``Metadata::validate`` of the
library's ``tensor.rs``. Held to the installed library two ways: named cases (each kind of corruption, and the
corners of serde_json that Python's json reads differently) and a hypothesis differential test over generated
headers, valid and corrupted (overlaps, gaps, wrong sizes, past-end offsets, repeated keys and fields, bad dtypes,
numbers serde reads as floats, deep nesting, lone surrogates, extra or missing data bytes). ``HYPOTHESIS_PARITY``
(an int) raises the number of generated files (300 by default; a few thousand in a soak run). Every command
refuses such a file with one ``Error:`` line and exit 1.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.dtypes import ST_BITS
from ckptool.formats.safetensors import read_header

pytestmark = pytest.mark.torchfree  # needs safetensors and numpy (safe_open(..., "np")), not torch

safetensors = pytest.importorskip("safetensors")
pytest.importorskip("numpy")

EXAMPLES = int(os.environ.get("HYPOTHESIS_PARITY", "300"))
A = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
B = '{"dtype":"F32","shape":[1],"data_offsets":[4,8]}'


def _fill(template: str, *values: str) -> str:
    """``template`` with each ``@`` replaced by the next of ``values`` (JSON text holds ``%`` and ``{}``)."""
    for v in values:
        template = template.replace("@", v, 1)
    return template


def _unknown(value: str) -> str:
    return _fill('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"zz":@}}', value)


def _file(path: Path, header: str | bytes, data: int, *, pad: bool = True, length: int | None = None) -> Path:
    raw = header.encode("utf-8", "surrogatepass") if isinstance(header, str) else header
    if pad:
        raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + bytes(data))
    return path


def _library_accepts(path: Path) -> bool:
    try:
        with safetensors.safe_open(str(path), "np") as f:
            f.keys()
    except Exception:  # SafetensorError, and OSError for a file too short to map
        return False
    return True


def _ckptool_accepts(path: Path) -> bool:
    try:
        read_header(str(path))
    except CorruptCheckpointError:
        return False
    return True


# name: (header, data bytes, whether the library accepts it)
CASES: dict[str, tuple[str, int, bool]] = {
    "valid": (_fill('{"a":@,"b":@}', A, B), 8, True),
    "empty header": ("{}", 0, True),
    "overlapping offsets": (_fill('{"a":@,"b":@}', A, A.replace("[0,4]", "[2,6]")), 6, False),
    "gap between tensors": (_fill('{"a":@,"b":@}', A, B.replace("[4,8]", "[5,9]")), 9, False),
    "two tensors inside one 8-byte block that do not tile it": (
        '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}',
        8, False),
    "F32 at an odd offset (the library does not ask for alignment)": (
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}}',
        5, True),
    "offsets past the end": (_fill('{"a":@}', A.replace("[0,4]", "[0,8]").replace("[1]", "[2]")), 4, False),
    "trailing data bytes": (_fill('{"a":@}', A), 5, False),
    "shape does not match the offsets": (_fill('{"a":@}', A.replace("[1]", "[2]")), 4, False),
    "end before begin": (('{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
                          '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}'), 4, False),
    "unknown dtype": (_fill('{"a":@}', A.replace("F32", "Q9")), 4, False),
    "lower-case dtype": (_fill('{"a":@}', A.replace("F32", "f32")), 4, False),
    "duplicate key, different entries": (_fill('{"a":@,"a":@}', A, B), 8, False),
    "duplicate key, the last one tiles": (_fill('{"a":@,"a":@}', B, A), 4, True),
    "duplicate key, same entry": (_fill('{"a":@,"a":@}', A, A), 4, True),
    "duplicate field in an entry": ('{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4, False),
    "duplicate __metadata__": (_fill('{"__metadata__":{"x":"1"},"__metadata__":{"x":"1"},"a":@}', A), 4, False),
    "duplicate key inside __metadata__": (_fill('{"__metadata__":{"x":"1","x":"2"},"a":@}', A), 4, True),
    "__metadata__ null": (_fill('{"__metadata__":null,"a":@}', A), 4, True),
    "__metadata__ value not a string": (_fill('{"__metadata__":{"x":1},"a":@}', A), 4, False),
    "__metadata__ a list": (_fill('{"__metadata__":[],"a":@}', A), 4, False),
    "unknown field in an entry": (_unknown('[1,{"q":null}]'), 4, True),
    "nesting 127 deep": (_unknown("[" * 125 + "]" * 125), 4, True),
    "nesting 128 deep": (_unknown("[" * 126 + "]" * 126), 4, False),
    "lone surrogate": (_unknown('"\\ud800"'), 4, False),
    "surrogate pair": (_unknown('"\\ud83d\\ude00"'), 4, True),
    "lone surrogate in a name": (_fill('{"\\udc00":@}', A), 4, False),
    "NaN": (_unknown("NaN"), 4, False),
    "number out of range": (_unknown("1e400"), 4, False),
    "400-digit integer": (_unknown("9" * 400), 4, False),
    "negative integer in an unknown field": (_unknown("-5"), 4, True),
    "shape size as a float": (_fill('{"a":@}', A.replace("[1]", "[1.0]")), 4, False),
    "shape size -0": ('{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', 0, False),
    "shape size past 64 bits": (_fill('{"a":@}', A.replace("[1]", "[18446744073709551616]")), 4, False),
    "shape size true": (_fill('{"a":@}', A.replace("[1]", "[true]")), 4, False),
    "three data_offsets": (_fill('{"a":@}', A.replace("[0,4]", "[0,4,4]")), 4, False),
    "entry as an array": ('{"a":["F32",[1],[0,4]]}', 4, True),
    "entry as an array of 4": ('{"a":["F32",[1],[0,4],1]}', 4, False),
    "dtype as {code: null}": ('{"a":{"dtype":{"F32":null},"shape":[1],"data_offsets":[0,4]}}', 4, True),
    "dtype as {code: []}": ('{"a":{"dtype":{"F32":[]},"shape":[1],"data_offsets":[0,4]}}', 4, False),
    "missing field": ('{"a":{"shape":[1],"data_offsets":[0,4]}}', 4, False),
    "entry not an object": (_fill('{"a":@,"b":1}', A), 4, False),
    "F4 odd element count": ('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', 2, False),
    "F6 whole bytes": ('{"a":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}}', 3, True),
    "empty tensors at one offset": (('{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
                                     '"b":{"dtype":"I8","shape":[0],"data_offsets":[0,0]}}'), 0, True),
    "element count overflows before a 0": (
        '{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', 0, False),
    "0 before a large element count": (
        '{"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}', 0, True),
    "bits overflow": ('{"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}}', 0, False),
    "not an object": ("[]", 0, False),
    "trailing NUL": (_fill('{"a":@}\0', A), 4, False),
    "form feed before the object": (_fill('\f{"a":@}', A), 4, False),
    "BOM": (_fill('\ufeff{"a":@}', A), 4, False),
    "raw control character in a name": (_fill('{"a\x01":@}', A), 4, False),
    "escaped NUL in a name": (_fill('{"a\\u0000":@}', A), 4, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_cases(tmp_path: Path, name: str) -> None:
    header, data, accepted = CASES[name]
    p = _file(tmp_path / "x.safetensors", header, data)
    assert _library_accepts(p) == accepted, "the library changed: update the case and ckptool's reader"
    assert _ckptool_accepts(p) == accepted


@pytest.mark.parametrize("name, header, data, pad, length", [
    ("no padding", _fill('{"a":@}', A), 4, False, None),
    ("header length past the file", _fill('{"a":@}', A), 4, True, 1 << 20),
    ("header length short", _fill('{"a":@}', A), 4, True, 40),
    ("header length over the library's limit", "{}", 0, True, 100_000_001),
    ("invalid UTF-8", b'{"a\xff":' + A.encode() + b"}", 4, True, None),
    ("empty file", b"", 0, False, None),
])
def test_lengths_and_bytes(tmp_path: Path, name: str, header: str | bytes, data: int, pad: bool,
                           length: int | None) -> None:
    p = _file(tmp_path / "x.safetensors", header, data, pad=pad, length=length)
    if name == "empty file":
        p.write_bytes(b"")
    assert _ckptool_accepts(p) == _library_accepts(p)


# ------------------------------------------------------------------------------------------------ generated
#: names as JSON text: plain, escaped, a lone surrogate escape, and __metadata__ holding an entry
_NAMES = st.sampled_from(['"a"', '"b"', '"c"', '"w.0"', '"\\u00e9"', '"\\ud800"', '"__metadata__"'])
_CODES = st.sampled_from([*ST_BITS, "F32", "F32", "BF16", "Q9", "f16"])


@st.composite
def _headers(draw: st.DrawFn) -> tuple[str, int]:
    """A header and its data size: tensors laid end to end, then a few of their numbers, keys or bytes changed."""
    pieces: list[tuple[str, str]] = []
    offset = 0
    for _ in range(draw(st.integers(0, 4))):
        code = draw(_CODES)
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = 1
        for s in shape:
            n *= s
        nbytes = n * ST_BITS.get(code, 32) // 8
        begin, end = offset, offset + nbytes
        offset = end
        change = draw(st.sampled_from(["", "", "", "overlap", "gap", "size", "swap", "float", "neg", "dtype-map",
                                       "array", "dup-field", "unknown", "deep", "huge"]))
        begin, end, shape_t = {"overlap": (begin - 1, end - 1, json.dumps(shape)),
                               "gap": (begin + 1, end + 1, json.dumps(shape)),
                               "size": (begin, end + draw(st.integers(-2, 2)), json.dumps(shape)),
                               "swap": (end, begin, json.dumps(shape)),
                               "float": (begin, end, json.dumps([float(s) for s in shape]))}.get(
                                   change, (begin, end, json.dumps(shape)))
        offsets = f"[{begin},{end}]" if change != "neg" else f"[-0,{end}]"
        dtype = json.dumps(code) if change != "dtype-map" else _fill('{"@":null}', code)
        if change == "array":
            value = f"[{dtype},{shape_t},{offsets}]"
        else:
            depth = draw(st.integers(120, 130)) if change == "deep" else 0
            extra = {"dup-field": f',"shape":{shape_t}', "unknown": ',"zz":{"q":[1,-2,"x"]}',
                     "deep": ',"zz":' + "[" * depth + "]" * depth, "huge": ',"zz":1e999'}.get(change, "")
            value = f'{{"dtype":{dtype},"shape":{shape_t},"data_offsets":{offsets}{extra}}}'
        pieces.append((draw(_NAMES), value))
    if draw(st.booleans()):
        meta = draw(st.sampled_from(['{"format":"pt"}', "null", '{"x":1}', '{"x":"1","x":"2"}', "[]", '"s"']))
        pieces.insert(draw(st.integers(0, len(pieces))), ('"__metadata__"', meta))
    if pieces and draw(st.integers(0, 5)) == 0:
        pieces.append(draw(st.sampled_from(pieces)))  # a repeated key
    header = "{" + ",".join(f"{k}:{v}" for k, v in pieces) + "}"
    return header, max(0, offset + draw(st.sampled_from([0, 0, 0, 0, 1, -1])))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_headers())
def test_generated_headers_are_judged_as_the_library_judges_them(tmp_path: Path, case: tuple[str, int]) -> None:
    header, data = case
    p = _file(tmp_path / "g.safetensors", header, data)
    assert _ckptool_accepts(p) == _library_accepts(p), header


# ------------------------------------------------------------------------------------------------ every command
CORRUPT = {
    "overlap": (_fill('{"a":@,"b":@}', A, A.replace("[0,4]", "[2,6]")), 6),
    "gap": (_fill('{"a":@,"b":@}', A, B.replace("[4,8]", "[5,9]")), 9),
    "past end": (_fill('{"a":@}', A.replace("[0,4]", "[0,8]").replace("[1]", "[2]")), 4),
    "trailing bytes": (_fill('{"a":@}', A), 5),
    "duplicate key": (_fill('{"a":@,"a":@}', A, B), 8),
    "duplicate field": ('{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "bad dtype": (_fill('{"a":@}', A.replace("F32", "Q9")), 4),
    "shape size": (_fill('{"a":@}', A.replace("[1]", "[2]")), 4),
}
COMMANDS = [["inspect"], ["convert", "-o", "{out}.pt"], ["diff", "{src}"], ["average", "{src}", "-o", "{out}.pt"],
            ["rename", "--rule", "^a$=b", "-o", "{out}.safetensors"], ["filter", "--keep", "a", "-o",
                                                                         "{out}.safetensors"],
            ["report", "-o", "{out}.html"], ["remap", "--to", "cpu", "-o", "{out}.safetensors"]]


@pytest.mark.parametrize("kind", sorted(CORRUPT))
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_every_command_refuses_with_one_line(tmp_path: Path, run_cli, kind: str, command: list[str]) -> None:
    header, data = CORRUPT[kind]
    p = _file(tmp_path / "bad.safetensors", header, data)
    assert not _library_accepts(p)
    args = [a.format(out=tmp_path / "out", src=p) for a in command]
    r = run_cli(args[0], p, *args[1:])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), r.output
    assert "safetensors" in lines[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad.safetensors"]
