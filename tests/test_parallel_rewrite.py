"""Set rewrites with ``--jobs N`` / ``executor=`` (issue 38): one shard per task, the index written last by the
caller, so the output is the serial run's byte for byte, and a failed or interrupted task leaves no set."""

from __future__ import annotations

import json
import threading
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptool
from ckptool.ops.rewrite import sets
from ckptool.ops.rewrite.parallel import shard_executor


def _make_set(run_cli: Callable[..., Any], tmp_path: Path, n: int = 8) -> Path:
    """A set of ``n`` torch shards (one tensor each, tagged cuda:0) in ``tmp_path/set``; its index."""
    g = torch.Generator().manual_seed(38)
    sd = {f"module.layers.{i}.weight": torch.randn(32, 32, generator=g) for i in range(n)}
    torch.save(sd, tmp_path / "model.pth")
    r = run_cli("convert", tmp_path / "model.pth", "-o", f"{tmp_path / 'set'}/", "--format", "torch",
                "--max-shard-size", "5KB", "--to", "cuda:0")
    assert r.exit_code == 0, r.output
    return next((tmp_path / "set").glob("*.index.json"))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("command", [["remap", "--to", "cpu"], ["strip-dataparallel", "--to", "cpu"],
                                     ["rename", "--rule", r"^module\.layers\.(\d+)=blocks.\1"]])
def test_jobs_writes_what_the_serial_run_writes(run_cli: Callable[..., Any], tmp_path: Path,
                                                command: list[str]) -> None:
    index = _make_set(run_cli, tmp_path)
    op, *args = command
    serial = run_cli(op, index.parent, *args, "-o", tmp_path / "one")
    parallel = run_cli(op, index.parent, *args, "-o", tmp_path / "four", "--jobs", "4")
    assert serial.exit_code == parallel.exit_code == 0, serial.output + parallel.output
    assert _files(tmp_path / "one") == _files(tmp_path / "four")
    assert len(json.loads((tmp_path / "four" / index.name).read_text())["weight_map"]) == 8
    assert parallel.output.replace("four", "one") == serial.output


def _failing_on(monkeypatch: pytest.MonkeyPatch, nth: int, error: BaseException) -> list[str]:
    """Make the ``nth`` shard written raise ``error`` (the others are written); the scratch paths written."""
    real = sets.rewrite_file
    seen: list[str] = []
    lock = threading.Lock()

    def flaky(ck: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        with lock:
            seen.append(path)
            mine = len(seen)
        if mine == nth:
            raise error
        return real(ck, path, *args, **kwargs)

    monkeypatch.setattr(sets, "rewrite_file", flaky)
    return seen


def test_interrupted_parallel_rewrite_commits_no_set(run_cli: Callable[..., Any], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    index = _make_set(run_cli, tmp_path)
    seen = _failing_on(monkeypatch, 5, KeyboardInterrupt())
    out = tmp_path / "out"
    with ThreadPoolExecutor(3) as pool, pytest.raises(KeyboardInterrupt):
        ckptool.remap(index, out, to="cpu", executor=pool)
    assert len(seen) >= 5
    assert not out.exists()  # made by the run: removed, with every scratch file in it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth", "set"]


def test_failed_task_leaves_an_earlier_set_whole(run_cli: Callable[..., Any], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    index = _make_set(run_cli, tmp_path)
    out = tmp_path / "out"
    assert run_cli("remap", index.parent, "--to", "cpu", "-o", out).exit_code == 0
    before = _files(out)
    _failing_on(monkeypatch, 3, OSError(28, "No space left on device"))
    with ThreadPoolExecutor(4) as pool, shard_executor(pool), pytest.raises(OSError):
        ckptool.strip_dataparallel(index, out, to="cpu")
    assert _files(out) == before  # the earlier set stays whole: nothing renamed, no scratch file left


def test_executor_runs_one_shard_per_task_off_the_main_thread(run_cli: Callable[..., Any], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    index = _make_set(run_cli, tmp_path)
    real = sets.rewrite_file
    threads: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(sets, "rewrite_file", spy)
    with ThreadPoolExecutor(4, thread_name_prefix="pool") as pool:
        res = ckptool.remap(index, tmp_path / "out", to="cpu", executor=pool)
    assert len(threads) == 8 and all(t.startswith("pool") for t in threads) and len(set(threads)) > 1
    assert res.storages == 8 and res.retagged == {("cuda:0", "cpu"): 8}


# ------------------------------------------------------------------------------------------------ convert --jobs
def _source_file(tmp_path: Path, n: int = 8) -> Path:
    """A torch file of ``n`` tensors and a view of one (an alias in safetensors output)."""
    g = torch.Generator().manual_seed(39)
    sd: dict[str, torch.Tensor] = {f"layers.{i}.weight": torch.randn(32, 32, generator=g) for i in range(n)}
    sd["layers.0.t"] = sd["layers.0.weight"].t()
    torch.save(sd, tmp_path / "model.pth")
    return tmp_path / "model.pth"


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_convert_jobs_writes_what_the_serial_run_writes(run_cli: Callable[..., Any], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    from ckptool.formats import torchzip

    # torch.save's .data/serialization_id is random, as torch's: held to one value, the files compare whole
    monkeypatch.setattr(torchzip, "secrets", types.SimpleNamespace(randbits=lambda _n: 38))
    src = _source_file(tmp_path)
    runs = {}
    for jobs in ("1", "2"):
        runs[jobs] = run_cli("convert", src, "-o", f"{tmp_path / ('j' + jobs)}/", "--format", fmt,
                             "--max-shard-size", "5KB", "--jobs", jobs, "--json")
        assert runs[jobs].exit_code == 0, runs[jobs].output
    assert _files(tmp_path / "j1") == _files(tmp_path / "j2")
    assert len(list((tmp_path / "j2").iterdir())) == 9  # 8 shards (the view shares one) and the index
    one, two = (json.loads(runs[j].output.replace(f"j{j}", "jX")) for j in ("1", "2"))
    assert one == two  # the result too: files, notes, what was verified and how
    assert two["verified"] is True and two["shards"] == 8
    if fmt == "safetensors":  # found by the tasks, merged in shard order
        assert two["aliases"] == {"layers.0.t": "layers.0.weight"} and "zip directory (8 record(s))" in two["checked"]


def _failing_write(monkeypatch: pytest.MonkeyPatch, nth: int, error: BaseException) -> list[str]:
    """Make the ``nth`` shard that ``convert`` writes raise ``error``; the scratch paths written."""
    from ckptool.ops.convert import outputs

    real = outputs.WRITERS[outputs.OutputFormat.SAFETENSORS]
    seen: list[str] = []
    lock = threading.Lock()

    def flaky(job: Any, path: str, *args: Any) -> Any:
        with lock:
            seen.append(path)
            mine = len(seen)
        if mine == nth:
            raise error
        return real.write_file(job, path, *args)

    monkeypatch.setitem(outputs.WRITERS, outputs.OutputFormat.SAFETENSORS,
                        outputs.Writer(real.refuse, real.unit_size, flaky, real.tally))
    return seen


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_convert_failed_or_interrupted_task_commits_no_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          error: BaseException) -> None:
    src = _source_file(tmp_path)
    seen = _failing_write(monkeypatch, 4, error)
    with ThreadPoolExecutor(3) as pool, pytest.raises(type(error)):
        ckptool.convert(src, f"{tmp_path / 'out'}/", max_shard_size="5KB", executor=pool)
    assert len(seen) >= 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth"]  # no folder, no index, no scratch file


# ------------------------------------------------------------------------------------------------ DCP folders
def _dcp_folder(tmp_path: Path) -> Path:
    """A DCP folder of four .distcp files (four writer threads), saved from a DataParallel-style state_dict."""
    from dcp_craft import save_dcp

    g = torch.Generator().manual_seed(40)
    state = {"model": {f"module.layers.{i}.weight": torch.randn(16, 16, generator=g) for i in range(8)}, "step": 3}
    folder = save_dcp(state, tmp_path / "ckpt", thread_count=4)
    assert len(list(folder.glob("*.distcp"))) == 4
    return folder


@pytest.mark.parametrize(("command", "keys"), [
    (["strip-dataparallel"], [f"layers.{i}.weight" for i in range(8)]),
    (["rename", "--rule", r"^module\.layers=blocks"], [f"blocks.{i}.weight" for i in range(8)]),
    (["filter", "--drop", "module.layers.[0-3].*"], [f"module.layers.{i}.weight" for i in range(4, 8)])])
def test_dcp_rewrite_jobs_writes_what_the_serial_run_writes(run_cli: Callable[..., Any], tmp_path: Path,
                                                            command: list[str], keys: list[str]) -> None:
    """One .distcp file per task: the folder is the serial run's byte for byte, and torch's DCP reads it."""
    from dcp_craft import dcp_back

    src = _dcp_folder(tmp_path)
    op, *args = command
    serial = run_cli(op, src, *args, "-o", tmp_path / "one")
    parallel = run_cli(op, src, *args, "-o", tmp_path / "two", "--jobs", "2")
    assert serial.exit_code == parallel.exit_code == 0, serial.output + parallel.output
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    assert parallel.output.replace("two", "one") == serial.output
    back, want = dcp_back(tmp_path / "two"), dcp_back(src)
    assert back["step"] == 3 and sorted(back["model"]) == sorted(keys)
    assert all(torch.equal(back["model"][k], want["model"][f"module.layers.{k.split('.')[-2]}.weight"]) for k in keys)


def test_dcp_rewrite_jobs_runs_one_data_file_per_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.ops.rewrite import dcp as dcp_rewrite

    src = _dcp_folder(tmp_path)
    real = dcp_rewrite._copy_file
    threads: list[tuple[str, str]] = []

    def spy(folder: str, stage: str, rel: str, *args: Any) -> None:
        threads.append((rel, threading.current_thread().name))
        real(folder, stage, rel, *args)

    monkeypatch.setattr(dcp_rewrite, "_copy_file", spy)
    with ThreadPoolExecutor(4, thread_name_prefix="pool") as pool:
        res = ckptool.remap(src, tmp_path / "out", to="cpu", strip_dataparallel=True, executor=pool)
    assert sorted(r for r, _t in threads) == sorted(p.name for p in src.glob("*.distcp"))
    assert all(t.startswith("pool") for _r, t in threads) and res.shards == 4


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_dcp_failed_or_interrupted_task_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        error: BaseException) -> None:
    """A task that fails (or an interrupt) while the data files are written: no folder, no staging folder, and
    .metadata never written."""
    from ckptool.ops.rewrite import dcp as dcp_rewrite

    src = _dcp_folder(tmp_path)
    real, wrote = dcp_rewrite._copy_file, []
    calls: list[str] = []
    lock = threading.Lock()

    def flaky(folder: str, stage: str, rel: str, *args: Any) -> None:
        with lock:
            calls.append(rel)
            mine = len(calls)
        if mine == 2:
            raise error
        real(folder, stage, rel, *args)

    monkeypatch.setattr(dcp_rewrite, "_copy_file", flaky)
    monkeypatch.setattr(dcp_rewrite, "_write_metadata", lambda *a: wrote.append(a))
    with ThreadPoolExecutor(2) as pool, shard_executor(pool), pytest.raises(type(error)):
        ckptool.strip_dataparallel(src, tmp_path / "out")
    assert not wrote
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_dcp_remap_jobs_relays_the_retagged_file_as_the_serial_run(run_cli: Callable[..., Any],
                                                                    tmp_path: Path) -> None:
    """remap --to cpu of a folder whose non-tensor entry is tagged cuda:0: the file holding it is laid out anew by
    its task, the others copied by theirs; the folder equals the serial run's and torch reads it on CPU."""
    from dcp_craft import dcp_back, save_dcp

    extra = (torch.arange(4.0), torch.ones(2, dtype=torch.float16))
    state = {"model": {f"layers.{i}.weight": torch.full((8,), float(i)) for i in range(6)}, "extra": extra}
    src = save_dcp(state, tmp_path / "ckpt", cuda=extra, thread_count=3)
    serial = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "one")
    parallel = run_cli("remap", src, "--to", "cpu", "-o", tmp_path / "two", "--jobs", "3")
    assert serial.exit_code == parallel.exit_code == 0, serial.output + parallel.output
    assert "re-tagged cuda:0 -> cpu (2)" in parallel.output
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    back = dcp_back(tmp_path / "two")
    assert torch.equal(back["extra"][0], extra[0]) and torch.equal(back["model"]["layers.5.weight"],
                                                                   state["model"]["layers.5.weight"])
