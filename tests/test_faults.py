"""Write faults on real files and real subprocesses: disk full (simulated and RLIMIT_FSIZE), a read-only folder,
symlinked destinations, SIGKILL/SIGTERM/SIGINT at several points of remap and convert, and the output equal to
the input. After each: the destination is absent or complete and valid, the source bytes are unchanged (sha256),
no temporary file is left (after anything but SIGKILL), and a later run removes what a killed run left behind."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckptool import _fileio as writer
from ckptool.formats.torchzip import TorchZipWriter
from ckptool.ops.inspect import inspect


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _one_error(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.fixture
def src(generated: dict[str, Path], tmp_path: Path) -> Path:
    p = tmp_path / "model.pt"
    shutil.copy(generated["sd_cuda0.pt"], p)
    return p


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.torchfree
def test_disk_full_leaves_input_and_folder_as_they_were(src: Path, run_cli, monkeypatch, in_place: bool) -> None:
    """ENOSPC while the records are copied (simulated): one clear error, the input intact, nothing left behind."""
    before = _digest(src)
    real = TorchZipWriter.copy_record
    calls = []

    def full(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *a, **kw)

    monkeypatch.setattr(TorchZipWriter, "copy_record", full)
    args = ["--in-place"] if in_place else ["-o", src.parent / "out.pt"]
    line = _one_error(run_cli("remap", src, "--to", "cpu", *args))
    assert "No space left on device" in line and "nothing was written" in line and "free some space" in line
    assert _digest(src) == before
    assert sorted(p.name for p in src.parent.iterdir()) == ["model.pt"]


@pytest.mark.torchfree
def test_disk_full_at_fsync(src: Path, run_cli, monkeypatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer.os, "fsync", full)
    _one_error(run_cli("remap", src, "--to", "cpu", "-o", src.parent / "out.pt"))
    assert sorted(p.name for p in src.parent.iterdir()) == ["model.pt"]


@pytest.mark.torchfree
def test_real_write_failure_file_size_limit(src: Path) -> None:
    """A real failing write (RLIMIT_FSIZE: the kernel refuses to grow a file past it, EFBIG; Python ignores
    SIGXFSZ): the child exits 1 with one error line and leaves no file."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    out = src.parent / "out.pt"
    r = subprocess.run([sys.executable, "-m", "ckptool", "remap", str(src), "--to", "cpu", "-o", str(out)],
                       capture_output=True, text=True, preexec_fn=limit, timeout=120, check=False)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("Error: writing") and "File too large" in r.stderr and "nothing was written" in r.stderr
    assert sorted(p.name for p in src.parent.iterdir()) == ["model.pt"]


@pytest.mark.torchfree
def test_read_only_destination_folder(src: Path, run_cli, monkeypatch, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:  # root writes anywhere: there the refusal is simulated below
        ro.chmod(0o555)
        try:
            line = _one_error(run_cli("remap", src, "--to", "cpu", "-o", ro / "out.pt"))
            assert "cannot write in" in line and "Permission denied" in line
        finally:
            ro.chmod(0o755)

    def refuse(*a, **kw):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(writer.tempfile, "mkstemp", refuse)
    line = _one_error(run_cli("remap", src, "--to", "cpu", "-o", ro / "out.pt"))
    assert f"cannot write in {ro}: Permission denied; choose a folder you can write to" in line
    assert list(ro.iterdir()) == []


def test_symlinked_destination_is_written_through(src: Path, run_cli, tmp_path: Path) -> None:
    """The link stays a link; the file it points to gets the new content (as torch.save and cp behave)."""
    import torch

    target = tmp_path / "runs" / "model.cpu.pt"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "latest.pt"
    link.symlink_to(target)
    r = run_cli("remap", src, "--to", "cpu", "-o", link, "--force")
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and link.resolve() == target.resolve()
    sd = torch.load(link, weights_only=True)
    assert all(t.device.type == "cpu" for t in sd.values())
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.cpu.pt"]
    # a dangling link: the file is created where it points
    dangling = tmp_path / "next.pt"
    dangling.symlink_to(tmp_path / "runs" / "new.pt")
    assert run_cli("remap", src, "--to", "cpu", "-o", dangling).exit_code == 0
    assert dangling.is_symlink() and (tmp_path / "runs" / "new.pt").is_file()


@pytest.mark.torchfree
def test_symlink_to_the_input(src: Path, run_cli, tmp_path: Path) -> None:
    link = tmp_path / "link.pt"
    link.symlink_to(src)
    r = run_cli("remap", src, "--to", "cpu", "-o", link)
    assert r.exit_code == 2 and "is the input file" in r.output
    before = _digest(src)
    r = run_cli("remap", link, "--to", "cpu", "--in-place")
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and _digest(src) != before
    assert inspect(src).devices == {"cpu": len(inspect(src).tensors)}


KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import ckptool._fileio as w
    from ckptool.ops.remap import remap

    def hang(fd):
        print("writing", flush=True)
        time.sleep(600)

    w.os.fsync = hang        # the data is written; stop before the rename
    remap(sys.argv[1], sys.argv[2], to="cpu")
""")


@pytest.mark.torchfree
def test_killed_mid_write_leaves_input_and_destination_intact(src: Path, tmp_path: Path) -> None:
    """SIGKILL during a write: the input is intact, the destination untouched; the temporary file a killed
    process cannot remove (``.<name>.ckptool-<host>-<pid>-*.ckptool-tmp``) is cleaned by the next write."""
    out = tmp_path / "out.pt"
    out.write_bytes(b"previous version")
    before = _digest(src)
    child = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(src), str(out)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert _digest(src) == before and out.read_bytes() == b"previous version"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".ckptool-tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".out.pt.ckptool-") and f"-{child.pid}-" in leftovers[0]
    from ckptool.ops.remap import remap

    remap(str(src), str(out), to="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "out.pt"]
    assert inspect(out).devices == {"cpu": len(inspect(out).tensors)}


@pytest.mark.torchfree
def test_remove_stale_temps_keeps_live_and_recent_ones(tmp_path: Path) -> None:
    dst = tmp_path / "m.pt"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(dead.stdout)
    host = writer._HOST
    names = {
        "dead": f".m.pt.ckptool-{host}-{dead_pid}-abc.ckptool-tmp",
        "live": f".m.pt.ckptool-{host}-{os.getpid()}-abc.ckptool-tmp",
        "other-new": ".m.pt.ckptool-otherhost-1-abc.ckptool-tmp",
        "other-old": ".m.pt.ckptool-otherhost-2-abc.ckptool-tmp",
        "other-file": ".n.pt.ckptool-otherhost-2-abc.ckptool-tmp",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    old = time.time() - 2 * 24 * 3600
    os.utime(tmp_path / names["other-old"], (old, old))
    removed = {Path(p).name for p in writer.remove_stale_temps(str(dst))}
    assert removed == {names["dead"], names["other-old"]}
