"""A torch zip whose ``byteorder`` record says ``big``: ``torch.load`` swaps each storage's elements
(serialization.py ``_load``, ``storage.byteswap(dtype)``), so every command that reads values (convert, diff)
must give ``torch.load``'s values, and the commands that copy records byte for byte (remap, the prefix commands)
must keep the record and the bytes. ``torch.load`` is the independent evidence throughout."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptool.errors import CorruptCheckpointError
from ckptool.formats.torchfile import read_checkpoint
from ckptool.ops.convert import convert
from ckptool.ops.diff.compare import diff

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))
from adversarial_dcp import big_endian_torch_file, to_big_endian


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "w": torch.linspace(-2, 3, 12).reshape(3, 4),
        "h": torch.tensor([1.5, -0.25, 1000.0], dtype=torch.float16),
        "b": torch.tensor([1.5, -0.25], dtype=torch.bfloat16),
        "i": torch.tensor([1, -2, 1 << 40]),
        "d": torch.tensor([0.1, -7.0], dtype=torch.float64),
        "c": torch.tensor([1 + 2j, -3.5 + 0.5j], dtype=torch.complex64),
        "u": torch.tensor([1, 2, 255], dtype=torch.uint8),
        # saved over an UntypedStorage (_rebuild_tensor_v3): torch.load does not swap it (dtype uint8)
        "u16": torch.tensor([1, 258], dtype=torch.uint16),
    }


@pytest.fixture
def big(tmp_path: Path) -> Path:
    return big_endian_torch_file(tmp_path / "big.pt", _tensors())


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_the_fixture_is_big_endian_as_torch_reads_it(big: Path) -> None:
    """torch.load gives the original values back (it swaps), and the raw bytes are not little-endian."""
    ref = torch.load(big, weights_only=True)
    orig = _tensors()
    for k in ("w", "h", "i", "c"):
        assert torch.equal(ref[k], orig[k]), k
    with zipfile.ZipFile(big) as z:
        raw = z.read(next(n for n in z.namelist() if n.endswith("/data/0")))
    assert raw != orig["w"].numpy().tobytes()
    assert read_checkpoint(str(big)).byteorder == "big"


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_convert_gives_torch_load_values(big: Path, tmp_path: Path, suffix: str) -> None:
    ref = torch.load(big, weights_only=True)
    out = tmp_path / f"out{suffix}"
    convert(big, out)
    got = load_file(out) if suffix == ".safetensors" else torch.load(out, weights_only=True)
    _assert_same(got, ref)


def test_convert_with_a_cast_and_a_strided_view(tmp_path: Path) -> None:
    src = big_endian_torch_file(tmp_path / "v.pt", {"t": torch.arange(12.0).reshape(3, 4).t(),
                                                   "x": torch.tensor([0.5, -1.25, 3.0])})
    ref = torch.load(src, weights_only=True)
    convert(src, tmp_path / "v.safetensors")
    _assert_same(load_file(tmp_path / "v.safetensors"), {k: v.contiguous() for k, v in ref.items()})
    convert(src, tmp_path / "h.safetensors", dtype="float16")
    _assert_same(load_file(tmp_path / "h.safetensors"), {k: v.half() for k, v in ref.items()})


def test_diff_compares_values_not_bytes(big: Path, tmp_path: Path) -> None:
    """The big-endian file and torch.save of what torch.load gives hold equal values, different bytes."""
    torch.save(torch.load(big, weights_only=True), tmp_path / "little.pt")
    res = diff(big, tmp_path / "little.pt")
    assert res.compared == len(_tensors()) and res.values_equal == res.compared and not res.tensors


def test_diff_sees_a_byteorder_record_change(tmp_path: Path) -> None:
    """Only the record flipped to ``big`` (bytes unchanged): torch.load gives other values, so must diff."""
    t = {"w": torch.linspace(-1, 1, 8)}
    torch.save(t, tmp_path / "a.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as zin, zipfile.ZipFile(tmp_path / "b.pt", "w") as zout:
        for n in zin.namelist():
            zout.writestr(n, b"big" if n.endswith("/byteorder") else zin.read(n))
    assert not torch.equal(torch.load(tmp_path / "b.pt", weights_only=True)["w"], t["w"])  # the evidence
    res = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert [d.key for d in res.tensors] == ["w"] and res.values_equal == 0


@pytest.mark.parametrize("args", [["remap", "--to", "cpu"], ["add-prefix", "module."]])
def test_byte_copies_keep_the_record_and_the_bytes(big: Path, tmp_path: Path, run_cli, args: list[str]) -> None:
    out = tmp_path / "out.pt"
    r = run_cli(args[0], big, *args[1:], "-o", out)
    assert r.exit_code == 0, r.output
    with zipfile.ZipFile(big) as za, zipfile.ZipFile(out) as zb:
        a = {n.split("/", 1)[1]: za.read(n) for n in za.namelist()}
        b = {n.split("/", 1)[1]: zb.read(n) for n in zb.namelist()}
    assert b["byteorder"] == b"big"
    assert {k: v for k, v in a.items() if k.startswith("data/")} == {k: v for k, v in b.items() if
                                                                      k.startswith("data/")}
    ref = torch.load(big, weights_only=True)
    got = torch.load(out, weights_only=True)
    _assert_same({k.removeprefix("module."): v for k, v in got.items()}, ref)


def test_an_unknown_byteorder_is_refused_as_torch_refuses_it(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as zin, zipfile.ZipFile(tmp_path / "b.pt", "w") as zout:
        for n in zin.namelist():
            zout.writestr(n, b"big\n" if n.endswith("/byteorder") else zin.read(n))
    with pytest.raises(ValueError, match="Unknown endianness"):
        torch.load(tmp_path / "b.pt", weights_only=True)
    with pytest.raises(CorruptCheckpointError, match="byteorder"):
        read_checkpoint(str(tmp_path / "b.pt"))


def test_a_big_endian_dcp_tensor_record_converts_to_torchs_values(tmp_path: Path) -> None:
    """A DCP folder whose tensor record is a big-endian ``torch.save``: the torch-free copy must not copy its
    bytes as they are; the output equals what torch's own ``dcp_to_torch_save`` writes."""
    import io
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = tmp_path / "dcp"
    w = torch.linspace(-1, 2, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": w, "step": 1}, checkpoint_id=str(folder), no_dist=True)
    big = big_endian_torch_file(tmp_path / "rec.pt", {"w": w})  # a dict record: rewrite it as the bare tensor
    buf = io.BytesIO()
    torch.save(w, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(big) as zbig:
        swapped = next(zbig.read(n) for n in zbig.namelist() if n.endswith("/data/0"))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as zout:
            for n in zin.namelist():
                zout.writestr(n, b"big" if n.endswith("/byteorder") else swapped if n.endswith("/data/0")
                              else zin.read(n))
    meta_path = folder / ".metadata"
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "w")
    with open(folder / info.relative_path, "ab") as f:
        info.offset = f.seek(0, 2)
        f.write(out.getvalue())
    info.length = len(out.getvalue())
    meta_path.write_bytes(pickle.dumps(meta))
    dcp_to_torch_save(str(folder), str(tmp_path / "torch.pt"))
    want = torch.load(tmp_path / "torch.pt", weights_only=True)
    assert torch.equal(want["w"], w)  # torch swaps the record back
    convert(folder, tmp_path / "ours.pt")
    got = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert torch.equal(got["w"], want["w"]) and got["step"] == 1


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_extract_state_dict_of_a_big_endian_module_file(tmp_path: Path, suffix: str) -> None:
    """A pickled nn.Module saved big-endian: the extracted state_dict equals torch.load(...).state_dict()."""
    from models import NetLinLayer

    from ckptool.ops.extract import extract_state_dict

    torch.manual_seed(0)
    model = NetLinLayer(3, 2, use_dropout=False)
    model.register_buffer("h", torch.tensor([0.5, -2.0], dtype=torch.float16))
    torch.save(model, tmp_path / "m.pt")
    big = to_big_endian(tmp_path / "m.pt", tmp_path / "big.pt")
    want = torch.load(big, weights_only=False).state_dict()  # our own file, its class is importable here
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
    extract_state_dict(big, tmp_path / f"sd{suffix}")
    got = load_file(tmp_path / f"sd{suffix}") if suffix == ".safetensors" else torch.load(
        tmp_path / f"sd{suffix}", weights_only=True)
    _assert_same(dict(got), dict(want))


def test_a_big_endian_deepspeed_folder_is_refused_clearly(tmp_path: Path) -> None:
    """ZeRO partitions are gathered by byte range: a big-endian rank file is refused, not read as little-endian."""
    import shutil

    from ckptool.errors import UnsupportedError

    src = Path(__file__).resolve().parent.parent / "fixtures" / "deepspeed-zero" / "zero2-1rank"
    folder = tmp_path / "ds"
    shutil.copytree(src, folder)
    optim = next(folder.rglob("*optim_states.pt"))
    to_big_endian(optim, tmp_path / "big.pt").replace(optim)
    with pytest.raises(UnsupportedError, match="big-endian"):
        convert(folder, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
