"""``convert`` and ``extract-state-dict`` decide by the registry's facts and by :class:`OutputFormat`, never by
format names; the sentences ``ckptool convert`` prints come from ``ckptool.ops.convert.report``."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptool.errors import UnsupportedError, UsageError
from ckptool.formats.safetensors import encode_header
from ckptool.ops.convert import ConvertResult, OutputFormat
from ckptool.ops.convert.report import convert_lines, selection, verification_line, written_detail
from ckptool.ops.extract import OPERATION, extract_state_dict
from ckptool.readers import FORMATS

pytestmark = pytest.mark.torchfree


def _safetensors(path: Path) -> Path:
    """A safetensors file of one float32 tensor ``w`` [2], written without torch."""
    entries = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    path.write_bytes(encode_header(entries, None) + bytes(8))
    return path


def test_output_format_from_option_or_suffix() -> None:
    assert OutputFormat.choose("x.SafeTensors", None, False) is OutputFormat.SAFETENSORS
    assert OutputFormat.choose("x.pth", None, False) is OutputFormat.TORCH
    assert OutputFormat.choose("out/", None, True) is OutputFormat.SAFETENSORS  # a folder of shards
    assert OutputFormat.choose("x.pth", "dcp", False) is OutputFormat.DCP
    with pytest.raises(UsageError, match="unknown format 'zip': choose torch, safetensors or dcp"):
        OutputFormat.choose("x.pt", "zip", False)
    with pytest.raises(UsageError, match=r"or pass --format torch\|safetensors\|dcp"):
        OutputFormat.choose("x.weights", None, False)
    assert [f for f in OutputFormat if f.location_tags] == [OutputFormat.TORCH]
    assert [f for f in OutputFormat if f.folder] == [OutputFormat.DCP]


def test_registry_facts_single_out_the_formats_convert_treats_apart() -> None:
    assert [f.name for f in FORMATS.values() if f.tagged] == ["deepspeed"]
    assert [f.name for f in FORMATS.values() if f.torch_distributed] == ["dcp"]
    assert {f.name: f.key_form for f in FORMATS.values() if f.key_form != "PATH"} == {"torch-package": "MEMBER:PATH"}
    assert sorted(f.name for f in FORMATS.values() if OPERATION in f.refusals) == [
        "pickle", "safetensors", "torchscript"]


def test_report_sentences_follow_the_input_format() -> None:
    ds = ConvertResult("ds/", "m.pt", "deepspeed", "torch", left_out=["optimizer: 3 tensors"], tensors=2, stored=2)
    assert selection(ds) == "the consolidated ZeRO state_dict (fp32 master weights, buffers)"
    assert convert_lines(ds)[1] == "Not carried: 1 other entry of the file:"  # one model: no --key to pass
    pkg = ConvertResult("p.pt", "m.safetensors", "torch-package", "safetensors", key="model.pkl:",
                        left_out=[f"x{i}" for i in range(22)])
    lines = convert_lines(pkg)
    assert lines[0] == "Converted state_dict 'model.pkl:' of p.pt (torch-package) to safetensors."
    assert lines[1] == ("Not carried: 22 other entries of the file (pass --key MEMBER:PATH to convert another "
                        "state_dict):")
    assert lines[-1] == "  ... and 2 more" and len(lines) == 23
    shard = ConvertResult("i.json", "m.pt", "sharded-safetensors", "torch", tensors=4, stored=3, shards=2,
                          cast={"float32->float16": 4}, verified=None)
    assert convert_lines(shard) == ["Converted the tensors of i.json (sharded-safetensors) to torch.",
                                    "Cast: float32->float16 (4)"]
    assert written_detail(shard) == "3 of 4 tensors stored, 2 shards + index"
    assert verification_line(shard) == "Not verified (--no-verify)"
    whole = ConvertResult("d/", "m.pt", "dcp", "torch", verified=True, checked="it matches")
    assert selection(whole) == "the whole checkpoint" and verification_line(whole) == "Verified: it matches"


def test_extract_refusals_come_from_the_registry(tmp_path: Path) -> None:
    st = _safetensors(tmp_path / "m.safetensors")
    with pytest.raises(UnsupportedError, match=r"m\.safetensors is safetensors: it already is a state_dict$"):
        extract_state_dict(st, tmp_path / "out.pth")
    with pytest.raises(UsageError, match="a safetensors output carries none"):
        extract_state_dict(st, tmp_path / "out.safetensors", to="cpu")


def test_convert_cli_prints_the_ops_sentences(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    st = _safetensors(tmp_path / "m.safetensors")
    r = run_cli("convert", st, "-o", tmp_path / "m.pt", "--key", "x")
    assert r.exit_code == 2 and "holds one flat mapping of tensors, so --key does not apply" in r.output
    r = run_cli("convert", st, "-o", tmp_path / "m.safetensors.out", "--to", "cpu", "--format", "safetensors")
    assert r.exit_code == 2 and "safetensors output carries none" in r.output
    r = run_cli("convert", st, "-o", tmp_path / "back.pt")
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"Converted the tensors of {st} (safetensors) to torch.\nWrote ")
    assert "Verified: the output, re-opened with" in r.output
