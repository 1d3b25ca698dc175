"""SIGINT and SIGTERM in the middle of a large rewrite, sent to a real ``python -m ckptool`` process: the temporary
output is removed, the source is untouched, one ``Interrupted``/``Terminated`` line is printed and the exit status is
130 / 143."""

from __future__ import annotations

import hashlib
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
