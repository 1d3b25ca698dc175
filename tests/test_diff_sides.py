"""``ckptool diff`` reads its sides through the readers: the same :class:`~ckptool.formats.tensors.Tensor` and
:class:`~ckptool.formats.tensors.Storage` objects every operation reads (issue 35), a pickled ``nn.Module`` as its
state_dict (parameters and buffers, not its attributes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ckptool
from ckptool.formats.tensors import Tensor
from ckptool.ops.diff.compare import diff
from ckptool.ops.diff.sides import read_pair, readable
from ckptool.readers import FORMATS, open_checkpoint


class ConvNet(nn.Module):
    """A module whose pickle holds attributes besides its state_dict (``conv.kernel_size``, ``conv.stride``...)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)


def _full_model(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "full.pt"
    torch.save(ConvNet(), path)
    return path


def test_full_model_pickle_equals_its_extracted_state_dict(tmp_path: Path, run_cli: Any) -> None:
    """``torch.save(model)`` against ``ckptool extract-state-dict``'s output: identical, exit 0, either order; the
    module's attributes (``conv.kernel_size.0``, ...) are not keys of its state_dict."""
    full, sd = _full_model(tmp_path), tmp_path / "sd.pt"
    r = run_cli("extract-state-dict", full, "-o", sd)
    assert r.exit_code == 0, r.output
    for a, b in ((full, sd), (sd, full)):
        r = run_cli("diff", a, b)
        assert r.exit_code == 0, r.output
        assert "identical: 9 of 9 matched tensors equal" in r.output and "only in" not in r.output
    doc = json.loads(run_cli("diff", full, sd, "--json").output)
    assert (doc["identical"], doc["only_a"], doc["only_b"], doc["compared"]) == (True, [], [], 9)
    res = diff(full, sd)
    assert res.identical and not res.values and res.plain_values == 0


def test_a_module_inside_a_checkpoint_gives_its_state_dict_and_the_rest_stays_values(tmp_path: Path) -> None:
    """A module nested in a training checkpoint is its state_dict too; the checkpoint's own plain values (epoch)
    are still compared."""
    torch.manual_seed(0)
    m = ConvNet()
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"model": m, "epoch": 1}, a)
    torch.save({"model": m.state_dict(), "epoch": 2}, b)
    res = diff(a, b)
    assert not res.only_a and not res.only_b and res.compared == 9 and res.values_equal == 9
    assert [(v.key, v.a, v.b) for v in res.values] == [("epoch", 1, 2)]
    assert "model.conv.kernel_size.0" not in open_checkpoint(a).values()


def test_sides_are_the_readers_tensors(tmp_path: Path) -> None:
    """Each side's tensors are the readers' :class:`Tensor` objects, storage identity kept: tied weights share
    one :class:`Storage` in a torch file read whole and in its safetensors conversion."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    a, st = tmp_path / "a.pth", tmp_path / "a.safetensors"
    torch.save({"w": base, "tied": base, "t": base.t()}, a)
    ckptool.convert(a, st)
    side_a, side_b, key_a, key_b = read_pair(str(a), str(st), None)
    assert (key_a, key_b) == (None, None)
    for side in (side_a, side_b):
        assert all(type(t) is Tensor for t in side.tensors.values())
        assert side.tensors["w"].storage is side.tensors["tied"].storage is side.tensors["t"].storage
        assert all(readable(t) is not None for t in side.tensors.values())
    assert side_a.spec is FORMATS["torch-zip"] and side_b.spec is FORMATS["safetensors"]
    assert side_a.stride(side_a.tensors["w"]) == (6, 1) and side_b.stride(side_b.tensors["w"]) is None
    assert side_b.stride(side_b.tensors["t"]) == (1, 6)  # a view the sharing record gives back keeps its stride
    assert diff(a, st, strict=True).identical


def test_a_compressed_record_is_matched_and_said_not_compared(tmp_path: Path, run_cli: Any) -> None:
    """A tensor whose zip record is deflated (torch never writes one) keeps its key and layout in the comparison;
    its values are not read, and the note says why (:meth:`ckptool.readers.Opened.all_tensors`' ``unread``)."""
    import zipfile

    plain, packed = tmp_path / "plain.pt", tmp_path / "packed.pt"
    torch.save({"w": torch.arange(6.0), "b": torch.ones(2)}, plain)
    with zipfile.ZipFile(plain) as zi, zipfile.ZipFile(packed, "w") as zo:
        for info in zi.infolist():
            deflate = info.filename.endswith("data/0")
            zo.writestr(info.filename, zi.read(info.filename),
                        compress_type=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
    _src, unread = open_checkpoint(packed).all_tensors()
    assert list(unread.values()) == ["record data/0 is compressed"]
    res = diff(packed, plain)
    assert (res.identical, res.compared, res.values_equal, res.not_compared) == (True, 2, 1, 1)
    assert res.notes == ["values of 1 tensor(s) were not compared: record data/0 is compressed"]
    r = run_cli("diff", packed, plain)
    assert r.exit_code == 0 and "1 not compared" in r.output


def test_what_each_format_records_is_a_registry_fact() -> None:
    """``location_tags`` / ``strides`` (what ``diff`` calls "not stored") come from the registry, not from names
    compared in ``ops/diff``."""
    torch_like = {n for n, f in FORMATS.items() if f.location_tags}
    assert {"torch-zip", "torch-legacy", "torch-package", "sharded-bin"} <= torch_like
    assert not FORMATS["safetensors"].location_tags and FORMATS["safetensors"].strides == "views"
    assert FORMATS["dcp"].strides == "none" and not FORMATS["dcp"].location_tags
    assert FORMATS["torch-export"].strides == "saved" and not FORMATS["torch-export"].location_tags


def test_diff_calls_no_parser_compares_no_format_name_and_stays_simple() -> None:
    """The architecture figures (``tools/architecture_figures.py``) list nothing in diff's modules: no parser
    call, no format name compared, no function above complexity 20, no tensor class of its own."""
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    try:
        import architecture_figures as figures
    finally:
        sys.path.pop(0)
    mine = ("ckptool/ops/diff/", "ckptool/cli/diff.py", "ckptool/cli/report.py", "ckptool/torch_ops/value_stats.py")
    found = (figures.parser_calls() + figures.format_comparisons() + figures.complex_functions()
             + figures.tensor_classes())
    assert not [f for f in found if f.startswith(mine)]
