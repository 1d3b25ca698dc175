"""SIGINT and SIGTERM in the middle of a large rewrite, sent to a real ``python -m ckptool`` process: the temporary
output is removed, the source is untouched, one ``Interrupted``/``Terminated`` line is printed and the exit status is
130 / 143."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~300 MiB checkpoint of 300 one-MiB tensors (each record copied on its own)."""
    path = tmp_path_factory.mktemp("big") / "big.pt"
    torch.save({f"w{i}": torch.full((262144,), float(i)) for i in range(300)}, path)
    return path


def _interrupt(src: Path, out: Path, sig: int) -> subprocess.CompletedProcess[str] | None:
    """Run ``ckptool remap SRC --to cpu -o OUT`` and send ``sig`` as soon as its temporary file exists; None when
    the command finished before the signal could be sent (the caller tries again)."""
    env = {**os.environ, "CKPTOOL_NO_PROGRESS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ckptool", "remap", str(src), "--to", "cpu", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if any(n.endswith(".ckptool-tmp") for n in os.listdir(out.parent)):
            time.sleep(0.05)  # into the copy
            proc.send_signal(sig)
            break
        time.sleep(0.001)
    stdout, stderr = proc.communicate(timeout=60)
    if proc.returncode == 0:
        out.unlink()
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "Interrupted"),
                                             (signal.SIGTERM, 143, "Terminated")])
def test_signal_during_rewrite_leaves_nothing(big: Path, tmp_path: Path, sig: int, code: int, word: str) -> None:
    before = _sha(big)
    out = tmp_path / "out.pt"
    for _ in range(5):
        res = _interrupt(big, out, sig)
        if res is not None:
            break
    else:
        pytest.skip("the rewrite finished every time before the signal arrived")
    assert res.returncode == code, res.stderr
    assert res.stderr == f"{word}: nothing was written to {out}\n"
    assert os.listdir(tmp_path) == []  # no output, no temporary file
    assert _sha(big) == before


# ------------------------------------------------------------------------------------------------ after the commit
#: runs ``ckptool ARGS`` with ``os.replace`` wrapped: right after the rename whose destination ends with TRIGGER, the
#: process sends itself SIG (a real signal, not a timing race); the commit (rename, record, index, clean-up) is then
#: atomic with respect to it only if the signal is held until the output is in place and recorded
AFTER_RENAME = """
import os, signal, sys
sig, trigger, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
real = os.replace

def replace(src, dst, *a, **k):
    real(src, dst, *a, **k)
    if str(dst).endswith(trigger):
        signal.raise_signal(sig)

os.replace = replace
sys.argv = ["ckptool", *args]
from ckptool.cli import main
main()
"""


def _after_rename(sig: int, trigger: str, *args: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CKPTOOL_NO_PROGRESS": "1"}
    return subprocess.run([sys.executable, "-c", AFTER_RENAME, str(int(sig)), trigger, *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


@pytest.mark.parametrize("sig, word", [(signal.SIGINT, "Interrupted"), (signal.SIGTERM, "Terminated")])
def test_signal_right_after_the_rename_says_the_output_is_complete(tmp_path: Path, sig: int, word: str) -> None:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.arange(4.0)}, src)
    out = tmp_path / "out.pt"
    r = _after_rename(sig, "out.pt", "remap", src, "--to", "cpu", "-o", out)
    assert r.returncode == 0, r.stderr
    assert r.stderr == f"{word} after {out} was written: it is complete\n"
    assert torch.equal(torch.load(out)["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "out.pt"]  # no temporary file left


def test_signal_after_the_index_rename_keeps_the_whole_set(tmp_path: Path) -> None:
    """The last rename of a sharded set is its index's: the set stays whole (no shard rolled back under an index
    that names it) and the line says so."""
    from safetensors.torch import save_file

    src = tmp_path / "m.safetensors"
    save_file({f"w{i}": torch.zeros(1024) for i in range(6)}, str(src))
    out = tmp_path / "out"
    r = _after_rename(signal.SIGINT, ".index.json", "convert", src, "-o", out, "--max-shard-size", "10KB")
    assert r.returncode == 0, r.stderr
    assert r.stderr == f"Interrupted after {out} was written: it is complete\n"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert all((out / n).is_file() for n in index["weight_map"].values())


def test_signal_before_the_rename_still_writes_nothing(tmp_path: Path) -> None:
    """Control: a signal that lands before the commit (during the scratch write of the first shard) keeps the
    old answer: nothing written, 130."""
    from safetensors.torch import save_file

    src = tmp_path / "m.safetensors"
    save_file({f"w{i}": torch.zeros(1024) for i in range(6)}, str(src))
    out = tmp_path / "out"
    r = _after_rename(signal.SIGINT, ".ckptool-tmp", "convert", src, "-o", out, "--max-shard-size", "10KB")
    assert r.returncode == 130, r.stderr
    assert r.stderr == f"Interrupted: nothing was written to {out}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
