"""Sparse, quantized, packed and nested tensors: every command that cannot write them names the tensor, what it is
and the fix; inspect, remap, the renaming commands and verify keep them bit for bit (fixtures from
``fixtures/make_nonstrided.py``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import make_nonstrided
import pytest
import torch

from ckptool import verify
from ckptool.ops.inspect.entry import inspect

FIXES = {"coo": "t.to_dense()", "csr": "t.to_dense()", "csc": "t.to_dense()", "bsr": "t.to_dense()",
         "qtensor": "t.dequantize()", "qchannel": "t.dequantize()", "nested": "t.unbind()",
         "jagged": "t.values() and t.offsets()"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_nonstrided.build(tmp_path_factory.mktemp("nonstrided"))


def _load(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, weights_only=False)


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _parts(t: Any) -> list[Any]:
    """Everything that makes the value what it is, as bytes and plain values (independent of ckptool)."""
    if isinstance(t, tuple):
        return [p for x in t for p in _parts(x)]
    if not isinstance(t, torch.Tensor):
        return [t]
    head = [t.dtype, t.layout, tuple(t.shape) if not t.is_nested else None, t.is_nested, t.is_quantized]
    if t.is_nested:
        return head + [p for x in t.unbind() for p in _parts(x)]
    if t.is_quantized:
        q = [t.qscheme(), _bits(t.int_repr())]
        if t.qscheme() == torch.per_tensor_affine:
            return head + q + [t.q_scale(), t.q_zero_point()]
        return head + q + [_bits(t.q_per_channel_scales()), _bits(t.q_per_channel_zero_points()),
                           t.q_per_channel_axis()]
    if t.layout == torch.sparse_coo:
        return [*head, _bits(t._indices()), _bits(t._values())]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [*head, _bits(t.crow_indices()), _bits(t.col_indices()), _bits(t.values())]
    if t.layout == torch.sparse_csc:
        return [*head, _bits(t.ccol_indices()), _bits(t.row_indices()), _bits(t.values())]
    return [*head, t.stride(), t.storage_offset(), _bits(t)]


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert _parts(a[k]) == _parts(b[k]), k


@pytest.mark.parametrize("stem", [*make_nonstrided.CASES])
@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_convert_names_tensor_layout_and_fix(files: dict[str, Path], tmp_path: Path, run_cli: Any, stem: str,
                                             suffix: str) -> None:
    key, what, _make = make_nonstrided.CASES[stem]
    r = run_cli("convert", files[f"{stem}.pt"], "-o", tmp_path / f"out{suffix}")
    assert r.exit_code == 1, r.output
    line = r.output.strip()
    assert line.startswith("Error: ") and "\n" not in line
    assert f"'{key}' is a {what}" in line
    assert FIXES[stem] in line and "ckptool remap" in line
    assert "no state_dict found" not in line
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_dynamic_quantized_state_dict(files: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    r = run_cli("convert", files["dynamic.pt"], "-o", tmp_path / "d.safetensors")
    assert r.exit_code == 1
    assert "'0._packed_params._packed_params' is the packed (quantized weight, bias) of a dynamically quantized" in \
        r.output
    assert "float model's state_dict" in r.output and "no state_dict found" not in r.output
    info = inspect(files["dynamic.pt"])
    assert info.kind == "state_dict" and len(info.tensors) == 4  # scale, zero_point, packed weight and bias
    report = verify(make_nonstrided.dynamic_model, files["dynamic.pt"], device="cpu")
    assert report.ok, report


@pytest.mark.parametrize("stem", ["coo", "jagged"])
def test_dcp_output_refused_by_name(files: dict[str, Path], tmp_path: Path, run_cli: Any, stem: str) -> None:
    key, what, _make = make_nonstrided.CASES[stem]
    r = run_cli("convert", files[f"{stem}.pt"], "--format", "dcp", "-o", tmp_path / "dcp")
    assert r.exit_code == 1, r.output
    assert f"'{key}' is a {what}" in r.output and "torch.distributed.checkpoint" in r.output


@pytest.mark.parametrize("stem", [*make_nonstrided.CASES, "dynamic"])
def test_inspect_remap_and_rename_keep_them(files: dict[str, Path], tmp_path: Path, run_cli: Any,
                                            stem: str) -> None:
    src = files[f"{stem}.pt"]
    r = run_cli("inspect", "--json", src)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["format"] == "torch-zip"
    out = tmp_path / "cpu.pt"
    r = run_cli("remap", src, "--to", "cpu", "-o", out)
    assert r.exit_code == 0, r.output
    _assert_same(_load(src), _load(out))
    renamed = tmp_path / "prefixed.pt"
    r = run_cli("add-prefix", src, "model.", "-o", renamed)
    assert r.exit_code == 0, r.output
    before, after = _load(src), _load(renamed)
    _assert_same({f"model.{k}": v for k, v in before.items()}, after)


def test_verify_sparse_and_quantized_buffers(files: dict[str, Path]) -> None:
    report = verify(make_nonstrided.sparse_net, files["sparse_sd.pt"], device="cpu")
    assert report.ok, report
    model = make_nonstrided.sparse_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.load_state_dict(_load(files["sparse_sd.pt"]))
    _assert_same(dict(model.state_dict()), _load(files["sparse_sd.pt"]))


def test_extract_names_the_buffer(files: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    r = run_cli("extract-state-dict", files["sparse_model.pt"], "-o", tmp_path / "sd.pth")
    assert r.exit_code == 1
    assert "buffer adj of make_nonstrided.SparseNet is a sparse COO tensor (layout torch.sparse_coo)" in r.output
    assert "t.to_dense()" in r.output and "--trust" in r.output


def test_strip_dataparallel_renames_the_sparse_buffer_too(files: dict[str, Path], tmp_path: Path,
                                                          run_cli: Any) -> None:
    sd = _load(files["sparse_sd.pt"])
    ddp = tmp_path / "ddp.pt"
    torch.save({f"module.{k}": v for k, v in sd.items()}, ddp)
    out = tmp_path / "bare.pt"
    r = run_cli("strip-dataparallel", ddp, "-o", out)
    assert r.exit_code == 0, r.output
    _assert_same(sd, _load(out))
    report = verify(make_nonstrided.sparse_net, out, device="cpu")
    assert report.ok, report
