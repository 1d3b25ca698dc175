"""``load_into``, ``verify`` and ``load_training_state`` of a ``torch.distributed.checkpoint`` (DCP) folder
(:mod:`ckptool.torch_ops.dcp_load`): the nested state torch's own ``dcp_to_torch_save`` rebuilds, bit for bit,
without DCP's reader unpickling non-tensor entries with ``weights_only=False``.

The reference in each test is torch's own route, run here: ``dcp_to_torch_save`` then ``torch.load`` of what it
wrote (``weights_only=False`` on folders this test made). Folders are written by ``dcp.save`` in this process
(``no_dist=True``), or laid out by hand (:func:`_craft`, as ``FileSystemWriter`` lays them out) for tensors in
several chunks and for hostile records.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from click.testing import CliRunner

import ckptool
from ckptool.cli import cli
from ckptool.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptool.readers.read_dcp import dcp_source
from ckptool.torch_ops.dcp_load import load_dcp_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import adversarial
import matrix_fixtures
from dcp_craft import Chunks, craft


# ------------------------------------------------------------------------------------------------ helpers
def _save(state: dict[str, Any], folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def _torch_reference(folder: Path) -> Any:
    """What torch's own route gives: ``dcp_to_torch_save`` into a file, loaded back."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / f"{folder.name}.reference.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)  # written just now from a folder this test made


def _same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` are the same nesting (same container types, keys in the same order) with bit-identical
    tensors (dtype, shape, contiguity, bytes) and equal plain values."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.is_contiguous()) == (b.dtype, b.shape, b.is_contiguous()), where
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), \
            where
    else:
        assert a == b, where


def _record(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _training_state() -> tuple[Any, Any, dict[str, Any]]:
    torch.manual_seed(0)
    net = matrix_fixtures.Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": net.state_dict(), "optim": opt.state_dict(), "step": 5,
             "extra": [torch.arange(3, dtype=torch.int64), {"lr": 0.5, "name": "run"}],
             "half": torch.randn(2, 3).to(torch.bfloat16), "view": torch.randn(3, 6).t(), "empty": torch.zeros(0, 3)}
    return net, opt, state


# ------------------------------------------------------------------------------------------------ loading
def test_load_into_gives_what_dcp_to_torch_save_gives(tmp_path: Path) -> None:
    net, _opt, state = _training_state()
    folder = _save(state, tmp_path / "ck")
    ref = _torch_reference(folder)
    got, saved = load_dcp_state_dict(folder)
    _same(got, ref)  # the whole nesting: model, optimizer state and param_groups, step, a list, a transposed view
    assert saved == {"cpu": 12}  # 2 model, 6 optimizer (exp_avg, exp_avg_sq, step per parameter), 4 others
    model = matrix_fixtures.build_model()
    report = ckptool.load_into(model, folder)
    assert report.key == "model" and report.loaded == 2
    _same(dict(model.state_dict()), dict(ref["model"]))
    _same(dict(model.state_dict()), dict(net.state_dict()))


def test_load_training_state_from_a_dcp_folder(tmp_path: Path) -> None:
    net, _opt, state = _training_state()
    folder = _save(state, tmp_path / "ck")
    model = matrix_fixtures.build_model()
    st = ckptool.load_training_state(model, None, folder)
    assert st.report.key == "model" and st.global_step == 5
    assert set(st.extra) == {"optim", "step", "extra", "half", "view", "empty"}
    _same(dict(model.state_dict()), dict(net.state_dict()))


def test_optimizer_state_keyed_by_strings_is_refused(tmp_path: Path) -> None:
    """DCP stores ``optimizer.state_dict()``'s integer keys as strings (``dcp_to_torch_save`` gives them back so):
    ``Optimizer.load_state_dict`` would keep that state under ``'0'``, ``'1'``, for no parameter."""
    _net, _opt, state = _training_state()
    folder = _save(state, tmp_path / "ck")
    assert list(_torch_reference(folder)["optim"]["state"]) == ["0", "1"]
    model = matrix_fixtures.build_model()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ckptool.errors.UsageError, match=r"optimizer state at 'optim' holds state under \['0', '1'\]"):
        ckptool.load_training_state(model, fresh, folder, optimizer_key="optim")
    assert not fresh.state


def _sharded(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """``weight`` [4, 6] in two column chunks, ``bias`` [4] in two row chunks, ``blocks`` [4, 4] in four 2x2
    blocks (listed out of order, over two files), ``scalar`` [] whole."""
    torch.manual_seed(2)
    whole = {"weight": torch.randn(4, 6), "bias": torch.randn(4), "blocks": torch.arange(16.).reshape(4, 4),
             "scalar": torch.tensor(3, dtype=torch.int32)}
    folder = craft(tmp_path / "sharded", {
        "weight": (whole["weight"], [((0, 3), (4, 3), 1), ((0, 0), (4, 3), 0)]),
        "bias": (whole["bias"], [((0,), (2,), 0), ((2,), (2,), 1)]),
        "blocks": (whole["blocks"], [((2, 2), (2, 2), 1), ((0, 0), (2, 2), 0), ((0, 2), (2, 2), 1),
                                     ((2, 0), (2, 2), 0)]),
        "scalar": (whole["scalar"], [((), (), 0)]),
    })
    return folder, whole


def test_chunks_by_rows_columns_and_blocks_are_put_back_whole(tmp_path: Path) -> None:
    folder, whole = _sharded(tmp_path)
    ref = _torch_reference(folder)
    _same(ref, whole)  # torch's own reader agrees the folder holds these tensors
    got, _saved = load_dcp_state_dict(folder)
    _same(got, ref)
    model = torch.nn.Linear(6, 4)
    ckptool.load_into(model, folder, strict=False)
    _same(dict(model.state_dict()), {"weight": whole["weight"], "bias": whole["bias"]})


def test_planner_data_nests_dicts_and_lists_as_torch_does(tmp_path: Path) -> None:
    a, b = torch.randn(2), torch.randn(3)
    folder = craft(tmp_path / "nested", {"m.w": (a, [((0,), (2,), 0)]), "l.1": (b, [((0,), (3,), 0)])},
                    values={"l.0": _record({"k": 1})},
                    planner={"m.w": ("m", "w"), "l.1": ("l", 1), "l.0": ("l", 0)})
    ref = _torch_reference(folder)
    got, _saved = load_dcp_state_dict(folder)
    _same(got, ref)
    _same(got, {"m": {"w": a}, "l": [{"k": 1}, b]})


@pytest.mark.parametrize(("chunks", "why"), [
    ([((0, 0), (1, 3), 0), ((2, 0), (2, 3), 1)], "hold 9 of its 12 elements"),
    ([((0, 0), (3, 3), 0), ((2, 0), (2, 3), 1)], "overlap"),
])
def test_chunks_that_leave_a_gap_or_overlap_are_refused(tmp_path: Path, chunks: Chunks, why: str) -> None:
    w = torch.randn(4, 3)
    folder = craft(tmp_path / "bad", {"w": (w, chunks)})
    with pytest.raises(CorruptCheckpointError, match=f"do not cover it once .*{why}"):
        load_dcp_state_dict(folder)


# ------------------------------------------------------------------------------------------------ safety
def _payload(kind: str) -> bytes:
    """The marker pickle as a non-tensor entry's record: inside a torch.save zip, or bare."""
    if kind == "bare":
        return adversarial.marker_pickle(2)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", adversarial.marker_pickle(2))
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["zip", "bare"])
def test_a_payload_in_a_non_tensor_entry_is_refused_unrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          kind: str) -> None:
    marker = tmp_path / "marker"
    monkeypatch.setenv(adversarial.MARKER_ENV, str(marker))
    folder = craft(tmp_path / "evil", {"fc.weight": (torch.ones(3, 4), [((0, 0), (3, 4), 0)])},
                    values={"step": _payload(kind)})
    with pytest.raises(UnsafeCheckpointError, match=r"non-tensor entry 'step'.*--trust") as exc:
        ckptool.load_into(matrix_fixtures.build_model(), folder, strict=False)
    if kind == "zip":
        assert "system" in str(exc.value)  # the global named
    res = CliRunner().invoke(cli, ["verify", str(folder), "--model", f"{matrix_fixtures.__file__}:build_model",
                                   "--device", "cpu"])
    assert res.exit_code not in (0, 3) and "--trust" in res.output, res.output
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="DANGEROUS"):  # trust covers classes, never gadgets
        load_dcp_state_dict(folder, trust=True)
    assert not marker.exists()
    with contextlib.suppress(Exception):  # the payload is live: torch.load(weights_only=False) runs it, as DCP does
        torch.load(io.BytesIO(_payload(kind)), weights_only=False)
    assert marker.exists()


def test_a_tensor_record_holding_a_payload_is_refused_even_with_trust(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "marker"
    monkeypatch.setenv(adversarial.MARKER_ENV, str(marker))
    folder = craft(tmp_path / "evil", {"w": (torch.ones(2), [((0,), (2,), 0)])})
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    payload = _payload("zip")
    meta = pickle.loads((folder / ".metadata").read_bytes())
    (info,) = meta.storage_data.values()
    info.length = len(payload)
    (folder / "__0_0.distcp").write_bytes(payload + bytes(data))
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    for trust in (False, True):  # DCP loads tensor records with weights_only=True whatever the caller trusts
        with pytest.raises(UnsafeCheckpointError, match="system"):
            load_dcp_state_dict(folder, trust=trust)
    assert not marker.exists()


class Config:
    """A value torch.load(weights_only=True) refuses unless registered with add_safe_globals."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


def test_registered_safe_globals_are_accepted_in_non_tensor_entries(tmp_path: Path) -> None:
    folder = _save({"model": {"weight": torch.ones(3, 4), "bias": torch.zeros(3)}, "cfg": Config(4)},
                   tmp_path / "ck")
    with pytest.raises(UnsafeCheckpointError, match=r"'cfg' names test_dcp_load\.Config"):
        ckptool.load_into(torch.nn.Linear(4, 3), folder)
    with torch.serialization.safe_globals([Config]):
        obj, _ = ckptool.torch_ops.load.load_checkpoint(folder)
    assert isinstance(obj["cfg"], Config) and obj["cfg"].depth == 4


# ------------------------------------------------------------------------------------------------ verify
def _verify(folder: Path, model: str = "build_model") -> Any:
    return CliRunner().invoke(cli, ["verify", str(folder), "--model", f"{matrix_fixtures.__file__}:{model}",
                                    "--device", "cpu"])


def test_verify_cli_on_a_dcp_folder(tmp_path: Path) -> None:
    _net, _opt, state = _training_state()
    folder = _save(state, tmp_path / "ck")
    res = _verify(folder)
    assert res.exit_code == 0, res.output
    assert "2/2 entries bit-identical" in res.output and "`model`" in res.output


class _Drifting(torch.nn.Linear):
    """A Linear whose load adds 1 to its weight: an injected fault in the copy that ``verify`` checks."""

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        with torch.no_grad():
            self.weight.add_(1)


def test_verify_fails_when_a_value_lands_wrong(tmp_path: Path) -> None:
    folder = _save({"model": {"weight": torch.randn(3, 4), "bias": torch.randn(3)}}, tmp_path / "ck")
    rep = ckptool.verify(torch.nn.Linear(4, 3), folder, device="cpu")
    assert rep.ok and rep.checked == 2
    rep = ckptool.verify(_Drifting(4, 3), folder, device="cpu")
    assert not rep.ok and rep.value_mismatches == ["weight"]


def test_a_flipped_byte_reads_as_torch_reads_it(tmp_path: Path) -> None:
    """The loaded values come from torch's parse of each record (not ckptool's byte ranges): a byte flipped in a
    tensor's data changes that tensor in ckptool's state exactly as in torch's own."""
    _net, _opt, state = _training_state()
    folder = _save(state, tmp_path / "ck")
    before, _ = load_dcp_state_dict(folder)
    (t,) = [t for t in dcp_source(folder).tensors if t.name == "fc.weight"]  # where its bytes lie
    with open(t.storage.path, "r+b") as f:
        f.seek(t.storage.offset + 5)
        b = f.read(1)
        f.seek(t.storage.offset + 5)
        f.write(bytes([b[0] ^ 0x40]))
    after, _ = load_dcp_state_dict(folder)
    _same(after, _torch_reference(folder))
    assert not torch.equal(after["model"]["fc.weight"], before["model"]["fc.weight"])
    after["model"]["fc.weight"] = before["model"]["fc.weight"]
    _same(after, before)


def test_a_truncated_distcp_is_corrupt(tmp_path: Path) -> None:
    folder = _save({"model": matrix_fixtures.Net().state_dict()}, tmp_path / "ck")
    (data,) = folder.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ckptool.load_into(matrix_fixtures.build_model(), folder)
    res = _verify(folder)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert res.exit_code == 1 and len(errors) == 1 and "truncated" in errors[0], res.output
