"""``remap`` and the prefix commands on ``torch.distributed.checkpoint`` folders (issue 26): the output is a new DCP
folder whose ``.metadata`` names the renamed FQNs and whose ``.distcp`` files are copies (not links) of the input's.

Folders are written by ``torch.distributed.checkpoint.save`` itself; outputs are checked with torch alone: its
``FileSystemReader.read_metadata``, ``dcp.load`` into a model's state_dict and ``format_utils.dcp_to_torch_save``,
compared bit for bit with the input as torch reads it. GPU tags of non-tensor entries are written without a GPU by
patching ``torch.serialization.location_tag`` while DCP saves (``fixtures/tagging.py``), only for the storages of the
tensors placed in a tuple: DCP saves such a value with ``torch.save(value)`` as it is (``BYTE_IO``), while each
tensor entry is moved to CPU first (as on a GPU machine: the tags patched are the ones a GPU would give).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_craft import dcp_back, save_dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader

import ckptool
from ckptool.errors import (
    CorruptCheckpointError,
    DeviceNotFoundError,
    KeyCollisionError,
    PrefixNotFoundError,
    UnsupportedError,
    UsageError,
    VerificationError,
)
from ckptool.ops.rewrite import dcp as dcp_rewrite


def _same(a: Any, b: Any, path: str = "") -> None:
    """``a`` and ``b`` hold the same keys, values and tensors (dtype, shape, bits)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b), path
        assert a.device == b.device, path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def _model_sd(prefix: str = "") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(26)
    return {f"{prefix}{k}": torch.randn(*s, generator=g) for k, s in
            (("enc.weight", (4, 3)), ("enc.bias", (4,)), ("head.weight", (2, 4)))}


def _no_leftovers(parent: Path, *keep: str) -> None:
    assert sorted(p.name for p in parent.iterdir()) == sorted(keep), "a failed run left files behind"


def _distcp_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.glob("*.distcp")}


# ------------------------------------------------------------------------------------------------ renaming
def test_strip_dataparallel_nested_model(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """``{"model": ddp.state_dict(), "optim": ..., "step": 7}``: strip-dataparallel renames the model's FQNs
    (model.module.enc.weight -> model.enc.weight) in state_dict_metadata, storage_data and planner_data, leaves the
    optimizer state alone, copies every .distcp file byte for byte (a copy, not a link), and dcp.load fills a bare
    model's state_dict from it."""
    optim = {"state": {"0": {"exp_avg": torch.ones(4, 3)}}, "param_groups": [{"lr": 0.1, "params": ["0"]}]}
    src = save_dcp({"model": _model_sd("module."), "optim": optim, "step": 7}, tmp_path / "ckpt")
    r = run_cli("strip-dataparallel", src, "-o", tmp_path / "bare")
    assert r.exit_code == 0, r.output
    out = tmp_path / "bare"
    assert "renamed 3 of 3 keys" in r.output and "checkpoint_id=" in r.output
    md = FileSystemReader(str(out)).read_metadata()
    want = [f"model.{k}" for k in _model_sd()]
    assert [k for k in md.state_dict_metadata if k.startswith("model.")] == want
    assert {i.fqn for i in md.storage_data} == set(md.state_dict_metadata)
    assert md.planner_data["model.enc.weight"] == ("model", "enc.weight")
    assert "optim.state.0.exp_avg" in md.state_dict_metadata
    expected = dcp_back(src)
    expected["model"] = {k.removeprefix("module."): v for k, v in expected["model"].items()}
    _same(dcp_back(out), expected)
    assert _distcp_bytes(out) == _distcp_bytes(src)
    for p in out.glob("*.distcp"):
        assert os.stat(p).st_nlink == 1 and not os.path.samefile(p, src / p.name)
    model = {k: torch.zeros_like(v) for k, v in _model_sd().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": model}, checkpoint_id=str(out), no_dist=True)
    for k, v in _model_sd().items():
        assert torch.equal(model[k], v), k


def test_unwrap_flat_folder_and_add_prefix_back(tmp_path: Path) -> None:
    """A folder saved from a DDP-of-compiled state_dict itself (FQNs module._orig_mod.enc.weight, one-element
    planner paths) is one flat state_dict: unwrap gives enc.weight; add-prefix module. puts it back, and the round
    trip holds the input's tensors under the input's names."""
    src = save_dcp(_model_sd("module._orig_mod."), tmp_path / "ckpt")
    res = ckptool.unwrap(src, tmp_path / "bare")
    assert res.removed == {"module.": 3, "_orig_mod.": 3}
    md = FileSystemReader(str(tmp_path / "bare")).read_metadata()
    assert list(md.state_dict_metadata) == list(_model_sd())
    assert md.planner_data == {k: (k,) for k in _model_sd()}
    _same(dcp_back(tmp_path / "bare"), _model_sd())
    ckptool.add_prefix(tmp_path / "bare", "module._orig_mod.", tmp_path / "again")
    _same(dcp_back(tmp_path / "again"), dcp_back(src))


def test_key_selects_one_state_dict(tmp_path: Path) -> None:
    """--key ema renames only the EMA copy, as on a training checkpoint file."""
    src = save_dcp({"model": _model_sd("module."), "ema": _model_sd("module.")}, tmp_path / "ckpt")
    ckptool.strip_dataparallel(src, tmp_path / "out", key="ema")
    back = dcp_back(tmp_path / "out")
    assert list(back["model"]) == list(_model_sd("module.")) and list(back["ema"]) == list(_model_sd())


def test_refusals_write_nothing(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """The planner's errors on a DCP folder are the file commands' own; nothing is written, no staging left."""
    src = save_dcp({"model": {**_model_sd("module."), "enc.weight": torch.ones(1)}}, tmp_path / "ckpt")
    with pytest.raises(PrefixNotFoundError, match=r"'foo\.'"):
        ckptool.strip_prefix(src, "foo.", tmp_path / "out")
    with pytest.raises(KeyCollisionError, match=r"'enc\.weight' <- "):
        ckptool.strip_dataparallel(src, tmp_path / "out")
    _no_leftovers(tmp_path, "ckpt")
    r = run_cli("strip-prefix", src, "foo.", "-o", tmp_path / "out")
    assert r.exit_code == 1 and [ln for ln in r.output.splitlines() if ln.startswith("Error:")], r.output
    _no_leftovers(tmp_path, "ckpt")


def test_collision_across_state_dicts(tmp_path: Path) -> None:
    """Two entries of different containers renamed to one FQN (model.module.x -> model.x beside a top-level
    "model.x") are refused: DCP would hold one FQN twice."""
    src = save_dcp({"model": {"module.x": torch.ones(2)}, "model.x": torch.zeros(2)}, tmp_path / "ckpt")
    with pytest.raises(KeyCollisionError, match=r"'model\.x' <- "):
        ckptool.strip_dataparallel(src, tmp_path / "out")
    _no_leftovers(tmp_path, "ckpt")


def test_output_must_be_new_or_empty(tmp_path: Path) -> None:
    src = save_dcp(_model_sd("module."), tmp_path / "ckpt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UsageError, match="not an empty folder"):
        ckptool.strip_dataparallel(src, tmp_path / "full")
    with pytest.raises(UsageError, match="--in-place"):
        ckptool.strip_dataparallel(src, in_place=True)
    (tmp_path / "empty").mkdir()
    ckptool.strip_dataparallel(src, tmp_path / "empty")
    _same(dcp_back(tmp_path / "empty"), _model_sd())
    ckptool.strip_dataparallel(src)  # the default output: the folder beside, named after the operation
    _same(dcp_back(tmp_path / "ckpt.stripped"), _model_sd())


def test_injected_fault_in_written_metadata_is_caught(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The read-back check compares the written .metadata (read by the restricted unpickler) with the plan: a
    pickler that wrote an FQN wrong makes it fail, and nothing is kept."""
    src = save_dcp(_model_sd("module."), tmp_path / "ckpt")
    real = dcp_rewrite.dumps

    def wrong(root: Any, **kw: Any) -> bytes:
        return real(root, **kw).replace(b"enc.bias", b"enc.bxas")

    monkeypatch.setattr(dcp_rewrite, "dumps", wrong)
    with pytest.raises(VerificationError, match="differs from the plan"):
        ckptool.strip_dataparallel(src, tmp_path / "out")
    _no_leftovers(tmp_path, "ckpt")


def test_failure_while_copying_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    src = save_dcp(_model_sd("module."), tmp_path / "ckpt")

    def boom(*_a: Any, **_k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_rewrite, "_write_metadata", boom)
    with pytest.raises(OSError, match="No space"):
        ckptool.strip_dataparallel(src, tmp_path / "out")
    _no_leftovers(tmp_path, "ckpt")


# ------------------------------------------------------------------------------------------------ remap
def _gpu_folder(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A folder whose non-tensor entry "extra" (a tuple of tensors) is tagged cuda:0, as a GPU machine writes it."""
    extra = (torch.arange(4.0), torch.ones(2, dtype=torch.float16))
    state = {"model": _model_sd(), "extra": extra, "step": 3}
    return save_dcp(state, tmp_path / "ckpt", cuda=extra), state


def test_remap_non_tensor_entry_to_cpu(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """torch cannot read the input on a machine without CUDA (the tuple's record is tagged cuda:0); after remap
    --to cpu, dcp_to_torch_save gives every value bit for bit, and the tensor records' bytes are the input's."""
    src, state = _gpu_folder(tmp_path)
    with pytest.raises(CheckpointException) as exc:
        dcp_back(src)
    assert any("on a CUDA device" in str(getattr(f, "exception", f)) for f in exc.value.failures.values())
    r = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "cpu")
    assert r.exit_code == 0, r.output
    assert "re-tagged cuda:0 -> cpu (2)" in r.output
    out = tmp_path / "cpu"
    _same(dcp_back(out), state)
    a, b = FileSystemReader(str(src)).read_metadata(), FileSystemReader(str(out)).read_metadata()
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)
    data_a, data_b = _distcp_bytes(src), _distcp_bytes(out)
    for idx, info in b.storage_data.items():
        old = a.storage_data[idx]
        if idx.fqn != "extra":  # tensor chunks and the other non-tensor entry: the same bytes
            got = data_b[info.relative_path][info.offset:info.offset + info.length]
            assert got == data_a[old.relative_path][old.offset:old.offset + old.length], idx.fqn


def test_remap_with_renaming_in_one_pass(tmp_path: Path) -> None:
    extra = (torch.ones(3),)
    src = save_dcp({"model": _model_sd("module."), "extra": extra}, tmp_path / "ckpt", cuda=extra)
    res = ckptool.remap(src, tmp_path / "out", to="cpu", strip_dataparallel=True)
    assert res.retagged == {("cuda:0", "cpu"): 1}
    _same(dcp_back(tmp_path / "out"), {"model": _model_sd(), "extra": extra})


def test_remap_nothing_to_remap_is_refused(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """An ordinary DCP folder (every record cpu) has nothing to remap: one Error line that says why and what to do;
    a --map source no tag matches is DeviceNotFoundError, as for files; nothing is written."""
    src = save_dcp({"model": _model_sd(), "step": 1}, tmp_path / "ckpt")
    r = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "out")
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert r.exit_code == 1 and len(errors) == 1, r.output
    assert "store every tensor chunk from CPU" in errors[0] and "nothing to remap" in errors[0]
    assert "dcp.load places tensors where the state_dict you pass lives" in errors[0]
    with pytest.raises(UnsupportedError, match="nothing to remap"):
        ckptool.remap(src, tmp_path / "out", mapping={"cuda:1": "cpu"})
    _no_leftovers(tmp_path, "ckpt")
    (tmp_path / "g").mkdir()
    gpu, _state = _gpu_folder(tmp_path / "g")
    with pytest.raises(DeviceNotFoundError, match="'cuda:1'"):
        ckptool.remap(gpu, tmp_path / "out", mapping={"cuda:1": "cpu"})
    with pytest.raises(UnsupportedError, match="tagged cuda:0 already"):
        ckptool.remap(gpu, tmp_path / "out", mapping={"cuda:0": "cuda:0"})
    _no_leftovers(tmp_path, "ckpt", "g")


def test_several_data_files(tmp_path: Path) -> None:
    """A folder written by two IO threads has two .distcp files: remap re-lays out only the one holding the
    re-tagged entry, the other is copied byte for byte; renaming copies both."""
    extra = (torch.arange(3.0),)
    state = {"model": _model_sd("module."), "extra": extra}
    src = save_dcp(state, tmp_path / "ckpt", cuda=extra, thread_count=2)
    files = _distcp_bytes(src)
    assert len(files) == 2
    ckptool.remap(src, tmp_path / "cpu", to="cpu")
    got = _distcp_bytes(tmp_path / "cpu")
    assert sorted(got) == sorted(files) and sum(got[n] == files[n] for n in files) == 1
    _same(dcp_back(tmp_path / "cpu"), state)
    ckptool.strip_dataparallel(tmp_path / "cpu", tmp_path / "bare")
    assert _distcp_bytes(tmp_path / "bare") == got
    _same(dcp_back(tmp_path / "bare"), {"model": _model_sd(), "extra": extra})


def test_safetensors_serialized_folder_is_refused(tmp_path: Path) -> None:
    """DCP's safetensors serialization writes each .distcp file as a safetensors file whose own header names the
    tensors by FQN (checked here with safetensors itself): renaming .metadata alone would leave those names behind,
    so it is refused with the route, nothing written."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    src = save_dcp({"model": _model_sd("module.")}, tmp_path / "ckpt",
                     serialization_format=SerializationFormat.SAFETENSORS)
    (data,) = src.glob("*.distcp")
    with safe_open(str(data), "pt") as f:
        assert set(f.keys()) == {f"model.{k}" for k in _model_sd("module.")}
    with pytest.raises(UnsupportedError, match="safetensors serialization"):
        ckptool.unwrap(src, tmp_path / "bare")
    _no_leftovers(tmp_path, "ckpt")


def test_metadata_naming_other_globals_is_not_written_back(tmp_path: Path) -> None:
    """The .metadata is re-pickled: one that names a global DCP never writes there (here ``os.getcwd``, stored, not
    called) is refused rather than written into a fresh-looking folder; nothing is written."""
    import pickle

    from ckptool.errors import UnsafeCheckpointError

    src = save_dcp(_model_sd("module."), tmp_path / "ckpt")
    md = FileSystemReader(str(src)).read_metadata()
    md.storage_meta.modules = [os.getcwd]  # type: ignore[union-attr, list-item]
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|nt)\.getcwd"):
        ckptool.strip_dataparallel(src, tmp_path / "out")
    _no_leftovers(tmp_path, "ckpt")


def test_non_tensor_record_that_is_no_torch_save_zip(tmp_path: Path) -> None:
    """A non-tensor entry whose record is not a torch.save zip is refused by remap, naming the record (not a
    scratch copy), nothing written."""
    extra = (torch.ones(2),)
    src = save_dcp({"model": _model_sd(), "extra": extra}, tmp_path / "ckpt", cuda=extra)
    md = FileSystemReader(str(src)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "extra")
    path = src / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset:info.offset + 4] = b"\x80\x02cx"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"'extra' \(\d+ bytes at byte \d+ of __0_0.distcp\) is not a "):
        ckptool.remap(src, tmp_path / "out", to="cpu")
    _no_leftovers(tmp_path, "ckpt")


def test_convert_of_gpu_tagged_non_tensor_entries_names_remap(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """torch's CheckpointException (a BaseException) on a machine without CUDA becomes one Error line with the route
    (remap the folder to cpu first), not a traceback; after that remap, convert works."""
    if torch.cuda.is_available():
        pytest.skip("the folder loads where CUDA exists")
    src, _state = _gpu_folder(tmp_path)
    r = run_cli("convert", src, "-o", tmp_path / "out.pt")
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert r.exit_code == 1 and len(errors) == 1 and "ckptool remap" in errors[0], r.output
    assert "Traceback" not in r.output and not (tmp_path / "out.pt").exists()
    assert run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "cpu").exit_code == 0
    r = run_cli("convert", tmp_path / "cpu", "-o", tmp_path / "out.pt")
    assert r.exit_code == 0, r.output
