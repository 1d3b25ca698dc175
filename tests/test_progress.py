"""The progress bar (issue 13): bytes done/total, throughput and ETA on stderr when stderr is a terminal (checked
through a pseudo-terminal), off with --quiet, CKPTOOL_NO_PROGRESS=1, a pipe or a small file, on with --progress."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")

#: tqdm's byte bar: "remap: 100%|#####| 80.0M/80.0M [00:00<00:00, 512MB/s]"
BAR = re.compile(r"remap: +100%.*\d+(\.\d+)?M/\d+(\.\d+)?M \[[\d:]+<[\d:]+, +[\d.]+[kMG]?B/s\]")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("progress")
    out = {"big": folder / "big.pt", "small": folder / "small.pt"}
    torch.save({f"w{i}": torch.full((262144,), float(i)) for i in range(80)}, out["big"])  # 80 MiB
    torch.save({"w": torch.zeros(1000)}, out["small"])
    return out


def _run(args: list[str], *, tty: bool, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``python -m ckptool ARGS`` with stderr on a pseudo-terminal (``tty``) or a pipe; return (exit status,
    stderr)."""
    cmd = [sys.executable, "-m", "ckptool", *args]
    full_env = {k: v for k, v in os.environ.items() if k != "CKPTOOL_NO_PROGRESS"} | (env or {})
    if not tty:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=full_env, timeout=120)
        return r.returncode, r.stderr
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=slave, env=full_env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the process closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


def test_bar_on_a_terminal(files: dict[str, Path], tmp_path: Path) -> None:
    code, err = _run(["remap", str(files["big"]), "--to", "cpu", "-o", str(tmp_path / "o.pt")], tty=True)
    assert code == 0, err
    assert BAR.search(err), err


@pytest.mark.parametrize("extra, env", [(["--quiet"], None), ([], {"CKPTOOL_NO_PROGRESS": "1"})])
def test_no_bar_when_asked(files: dict[str, Path], tmp_path: Path, extra: list[str], env: dict[str, str] | None,
                           ) -> None:
    code, err = _run(["remap", str(files["big"]), "--to", "cpu", "-o", str(tmp_path / "o.pt"), *extra], tty=True,
                     env=env)
    assert code == 0 and "remap:" not in err and "B/s" not in err, err


def test_no_bar_for_a_small_file(files: dict[str, Path], tmp_path: Path) -> None:
    code, err = _run(["remap", str(files["small"]), "--to", "cpu", "-o", str(tmp_path / "o.pt")], tty=True)
    assert code == 0 and "B/s" not in err, err


def test_pipe_only_with_progress(files: dict[str, Path], tmp_path: Path) -> None:
    args = ["unwrap", str(files["big"]), "--allow-missing", "-o", str(tmp_path / "o.pt")]
    code, err = _run(args, tty=False)
    assert code == 0 and err == ""
    code, err = _run([*args, "--force", "--progress"], tty=False)
    assert code == 0 and re.search(r"unwrap: +100%.*B/s\]", err), err


def test_convert_uses_the_same_bar(files: dict[str, Path], tmp_path: Path) -> None:
    code, err = _run(["convert", str(files["big"]), "-o", str(tmp_path / "o.safetensors"), "--progress"], tty=False)
    assert code == 0 and re.search(r"convert: +100%.*\d+(\.\d+)?M/\d+(\.\d+)?M .*B/s\]", err), err
