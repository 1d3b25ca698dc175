"""A format added to the registry and the classifier alone (issue 46: "how many lines adding a format touches
outside its own reader module") is read by every command through the defaults of the roles: the classifier's answer
is the format (``detect_format``), ``inspect`` describes it from its reader's tensors (``inspect_tensors``), ``scan``
has its reader read it and walks no pickle (``scanning.layouts.head_layout``), ``load_checkpoint`` loads its
reader's tensors (``load_tensors``), ``extract-state-dict`` refuses one flat mapping as already a state_dict, and
the rewriting commands refuse it with the route through ``convert``.

The format here, ``flat-test``, is defined in this module: ``FLATTEST`` + u64 header length + a JSON header
``{name: {"dtype", "shape", "offset"}}`` + the data (the toy format of the issue's measurement)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptool import errors
from ckptool.cli import cli
from ckptool.formats import detect
from ckptool.formats.dtypes import ST_CODES, ST_NAMES, contiguous_stride, element_size, numel
from ckptool.formats.tensors import Source, Storage, Tensor
from ckptool.readers import FORMATS, Format, Reader, open_checkpoint
from ckptool.readers.support import Cell

MAGIC = b"FLATTEST"
NAME = "flat-test"


class FlatReader(Reader):
    """The whole reader of ``flat-test``: each tensor its own byte range after the header."""

    def tensors(self, key: str | None, tag: str | None, exclude_frozen: bool) -> Source:
        path = self.opened.target
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(16)[8:])[0]
            header = json.loads(f.read(n))
        size = Path(path).stat().st_size
        src = Source(path, self.opened.format, [])
        for i, (name, e) in enumerate(header.items()):
            dtype, shape = ST_NAMES[e["dtype"]], tuple(e["shape"])
            offset, nbytes = 16 + n + e["offset"], numel(shape) * element_size(dtype)
            if offset + nbytes > size:
                raise errors.CorruptCheckpointError(f"{path}: {name!r} runs past the end of the file")
            st = Storage(path, offset, nbytes, dtype, "cpu")
            src.tensors.append(Tensor(name, name, dtype, shape, contiguous_stride(shape), 0, st, False, i))
        return src


def write_flat(sd: dict[str, torch.Tensor], path: Path, *, cut: int = 0) -> None:
    """``sd`` as a ``flat-test`` file (``cut`` bytes of data left out: a truncated file)."""
    header, data = {}, b""
    for name, t in sd.items():
        header[name] = {"dtype": ST_CODES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "offset": len(data)}
        data += t.contiguous().numpy().tobytes()
    h = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(h)) + h + data[:len(data) - cut])


@pytest.fixture
def flat(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    """A ``flat-test`` file, its format registered as a new format is: its registry entry and its classifier
    answer, nothing else."""
    import ckptool.cli.inspect  # noqa: F401  (its --help lists the registry as imported: the real one)

    entry = Format(NAME, "flat-test file", "file", flat="flat-test", reader=f"{__name__}:FlatReader",
                   support={"scan": Cell("works", "safe")})
    monkeypatch.setitem(FORMATS, NAME, entry)
    accepts = ((NAME, lambda head: head.startswith(MAGIC)),)
    monkeypatch.setattr(detect, "HEAD_ACCEPTS", detect.HEAD_ACCEPTS[:-1] + accepts + detect.HEAD_ACCEPTS[-1:])
    torch.manual_seed(0)
    sd = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3), "steps": torch.arange(5)}
    path = tmp_path / "m.flat"
    write_flat(sd, path)
    yield path, sd


def test_the_classifier_answer_is_the_format(flat: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _sd = flat
    assert detect.detect_format(str(path)) == NAME
    assert open_checkpoint(path).format == NAME


def test_inspect_describes_it_from_its_reader(flat: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from ckptool.ops.inspect.entry import inspect

    path, sd = flat
    info = inspect(path)
    assert (info.format, info.kind, info.size) == (NAME, "tensors", path.stat().st_size)
    assert [(t.key, t.shape, t.dtype, t.nbytes, t.device) for t in info.tensors] == [
        (k, list(v.shape), str(v.dtype).removeprefix("torch."), v.nbytes, "cpu") for k, v in sd.items()]
    assert info.storages == 3 and sum(r.bytes for r in info.totals) == sum(v.nbytes for v in sd.values())
    assert [(s.path, s.tensors) for s in info.state_dicts] == [("", 3)]
    assert info.scan is not None and info.scan.verdict == "safe"
    res = CliRunner().invoke(cli, ["inspect", "--json", str(path)])
    assert res.exit_code == 0 and json.loads(res.output)["format"] == NAME, res.output


def test_scan_has_its_reader_read_it(flat: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    from ckptool.scanning.entry import scan_file

    path, sd = flat
    res = scan_file(path)
    assert (res.format, res.verdict, res.error) == (NAME, "safe", None)
    cut = tmp_path / "cut.flat"
    write_flat(sd, cut, cut=4)  # the fault the reader finds is the scan's error, never "safe"
    bad = scan_file(cut)
    assert bad.verdict == "error" and "runs past the end" in (bad.error or "")


def test_scan_refuses_a_pickled_format_without_a_layout(flat: tuple[Path, dict[str, torch.Tensor]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A format whose structure is a pickle has no default layout: scan walked none of its pickles, so it says
    error, not safe."""
    from ckptool.scanning.entry import scan_file

    path, _sd = flat
    monkeypatch.setitem(FORMATS, NAME, Format(NAME, "flat-test file", "file", pickled=True,
                                              reader=f"{__name__}:FlatReader"))
    res = scan_file(path)
    assert res.verdict == "error" and "no layout" in (res.error or "")


def test_load_checkpoint_loads_its_reader_tensors(flat: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from ckptool.torch_ops.load import load_into
    from ckptool.torch_ops.loaders import load_checkpoint

    path, sd = flat
    loaded, tags = load_checkpoint(path)
    assert list(loaded) == list(sd) and all(torch.equal(loaded[k], v) for k, v in sd.items())
    assert tags == {"cpu": 3}
    model = torch.nn.Linear(4, 3)
    model.register_buffer("steps", torch.zeros(5, dtype=torch.int64))
    state = {k.removeprefix("fc."): v for k, v in sd.items()}
    write_flat(state, path)
    load_into(model, path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_extract_refuses_one_flat_mapping(flat: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, _sd = flat
    res = CliRunner().invoke(cli, ["extract-state-dict", str(path), "-o", str(tmp_path / "out.pt")])
    errors_ = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert res.exit_code not in (0, 3) and len(errors_) == 1, res.output
    assert "already is a state_dict" in errors_[0] and "torch.export" not in res.output
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("args", [["remap", "--to", "cpu"], ["add-prefix", "module."], ["rename", "--rule", "^=n."],
                                  ["sanitize"]])
def test_rewriting_commands_refuse_it_with_a_route(flat: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
                                                   args: list[str]) -> None:
    path, _sd = flat
    res = CliRunner().invoke(cli, [args[0], str(path), *args[1:], "-o", str(tmp_path / "out.pt")])
    errors_ = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert res.exit_code not in (0, 3) and len(errors_) == 1, res.output
    assert "not a torch.save checkpoint" in errors_[0] and f"`ckptool convert {path} -o model.pt`" in errors_[0]
    assert not (tmp_path / "out.pt").exists()


def test_inspect_help_lists_the_registry_formats() -> None:
    """``inspect --help`` names the formats from the registry, not from a list in its text."""
    from ckptool.cli.inspect import inspect_cmd

    assert "torch-legacy" not in (inspect_cmd.callback.__doc__ or "")
    assert f"({', '.join(FORMATS)})" in " ".join((inspect_cmd.help or "").split())
