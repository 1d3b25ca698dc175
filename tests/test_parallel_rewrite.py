"""Set rewrites with ``--jobs N`` / ``executor=`` (issue 38): one shard per task, the index written last by the
caller, so the output is the serial run's byte for byte, and a failed or interrupted task leaves no set."""

from __future__ import annotations

import json
import threading
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
