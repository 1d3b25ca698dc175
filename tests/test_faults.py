"""Write faults on real files and real subprocesses: disk full (simulated and RLIMIT_FSIZE), a read-only folder,
symlinked destinations, SIGKILL/SIGTERM/SIGINT at several points of remap and convert, and the output equal to
the input. After each: the destination is absent or complete and valid, the source bytes are unchanged (sha256),
no temporary file is left (after anything but SIGKILL), and a later run removes what a killed run left behind."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptool import _fileio as writer
from ckptool.formats.torchzip import TorchZipWriter
from ckptool.ops.inspect.entry import inspect


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
    # a dangling link is refused: following it would create a file wherever it points
    dangling = tmp_path / "next.pt"
    dangling.symlink_to(tmp_path / "runs" / "new.pt")
    r = run_cli("remap", src, "--to", "cpu", "-o", dangling)
    assert r.exit_code == 2 and "does not exist" in r.output, r.output
    assert dangling.is_symlink() and not (tmp_path / "runs" / "new.pt").exists()


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
    from ckptool.ops.rewrite.remap import remap

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
    from ckptool.ops.rewrite.remap import remap

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
        "dead": f".m.pt.ckptool-{host}-{dead_pid}-abc12345.ckptool-tmp",
        "live": f".m.pt.ckptool-{host}-{os.getpid()}-abc12345.ckptool-tmp",
        "other-new": ".m.pt.ckptool-otherhost-1-abc12345.ckptool-tmp",
        "other-old": ".m.pt.ckptool-otherhost-2-abc12345.ckptool-tmp",
        "other-file": ".n.pt.ckptool-otherhost-2-abc12345.ckptool-tmp",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    old = time.time() - 2 * 24 * 3600
    os.utime(tmp_path / names["other-old"], (old, old))
    # a DCP staging folder and the temporary file of an atomic write into a scratch file, both of the dead process
    names["dead-folder"] = f".m.pt.ckptool-{host}-{dead_pid}-def12345.ckptool-tmp"
    (tmp_path / names["dead-folder"]).mkdir()
    (tmp_path / names["dead-folder"] / "__0_0.distcp").write_bytes(b"x")
    nested = f"{names['dead']}.ckptool-{host}-{dead_pid}-ghi12345.ckptool-tmp"
    names["dead-nested"] = nested.replace(".m.pt", "..m.pt", 1)
    (tmp_path / names["dead-nested"]).write_bytes(b"x")
    removed = {Path(p).name for p in writer.remove_stale_temps(str(dst))}
    assert removed == {names["dead"], names["other-old"], names["dead-nested"]}
    # a folder is never deleted (what a planted folder holds is not ours to remove), a DCP staging folder included
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("live", "other-new", "other-file", "dead-folder"))


# ------------------------------------------------------------------------------------------------ the signal matrix
#: runs ``ckptool ARGS`` after arranging for it to stop at POINT (prints PAUSED on stderr, then sleeps) so that the
#: test can signal it there: ``temp-created`` (the temporary output, scratch file or DCP staging folder exists and
#: nothing is in it: the first write into an output, or torch's DCP save, has not started), ``mid-write`` (after the
#: third write into an output: part of the data is in the temporary file), ``before-rename`` (everything written
#: and fsynced, the first rename not done)
PAUSE_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import ckptool._fileio as fio
    point, args = sys.argv[1], sys.argv[2:]
    done = []

    def pause():
        if not done:
            done.append(1)
            sys.stderr.write("PAUSED\\n")
            sys.stderr.flush()
            time.sleep(120)

    real_write = fio._OutputFile.write
    calls = []

    def write(self, b):
        if point == "temp-created":
            pause()
        r = real_write(self, b)
        calls.append(1)
        if point == "mid-write" and len(calls) == 3:
            self.flush()
            pause()
        return r
    fio._OutputFile.write = write
    real_copy = getattr(os, "copy_file_range", None)
    if real_copy is not None:  # records and tensors copied by the kernel count as writes too
        def copy_file_range(*a, **k):
            if point == "temp-created":
                pause()
            r = real_copy(*a, **k)
            calls.append(1)
            if point == "mid-write" and len(calls) == 3:
                pause()
            return r
        os.copy_file_range = copy_file_range
    if point == "temp-created" and "dcp" in args:
        import ckptool.ops.convert.dcp as cv_dcp
        real_save = cv_dcp.save_dcp

        def save(state, folder):
            pause()
            return real_save(state, folder)
        cv_dcp.save_dcp = save
    if point == "before-rename":  # before the commit, whose rename and record are made with the signals held
        import contextlib
        import ckptool._commit as commit
        real_blocked = commit.signals_blocked

        @contextlib.contextmanager
        def blocked():
            pause()
            with real_blocked():
                yield
        commit.signals_blocked = blocked
    sys.argv = ["ckptool", *args]
    import ckptool.cli
    ckptool.cli.main()
""")

_SIGNALS = {"SIGINT": (signal.SIGINT, 130, "Interrupted"), "SIGTERM": (signal.SIGTERM, 143, "Terminated"),
            "SIGKILL": (signal.SIGKILL, -signal.SIGKILL, None)}


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 MiB checkpoint of 8 tensors (records small enough to be written through the output file object)."""
    torch = pytest.importorskip("torch")
    p = tmp_path_factory.mktemp("multi") / "multi.pt"
    torch.save({f"w{i}": torch.full((65536,), float(i)) for i in range(8)}, p)
    return p


def _tmp_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(writer.TMP_SUFFIX))


def _run_paused(point: str, sig: int, args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``ckptool ARGS`` stopped at ``point``, send ``sig`` there, and return the finished process."""
    env = {**os.environ, "CKPTOOL_NO_PROGRESS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", PAUSE_SCRIPT, point, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line == "PAUSED\n", line + proc.stderr.read()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _valid(kind: str, out: Path) -> None:
    """The output of a finished run loads with plain torch / safetensors."""
    import torch

    if kind == "remap" or kind == "in-place":
        sd = torch.load(out, weights_only=True)
        assert sorted(sd) == [f"w{i}" for i in range(8)] and all(t.device.type == "cpu" for t in sd.values())
    elif kind == "safetensors":
        from safetensors.torch import load_file

        assert torch.equal(load_file(out)["w7"], torch.full((65536,), 7.0))
    elif kind == "shards":
        from safetensors.torch import load_file

        index = json.loads((out / "model.safetensors.index.json").read_text())
        got = {k: v for shard in set(index["weight_map"].values()) for k, v in load_file(out / shard).items()}
        assert sorted(got) == [f"w{i}" for i in range(8)]
    else:
        from ckptool.ops.inspect.entry import inspect_set

        assert len(inspect_set(out).tensors) == 8


_COMMANDS = {
    "remap": lambda src, out: ["remap", str(src), "--to", "cpu", "-o", str(out / "out.pt")],
    "in-place": lambda src, out: ["remap", str(src), "--to", "cpu", "--in-place"],
    "safetensors": lambda src, out: ["convert", str(src), "-o", str(out / "out.safetensors")],
    "shards": lambda src, out: ["convert", str(src), "-o", str(out) + "/", "--max-shard-size", "600KB"],
    "dcp": lambda src, out: ["convert", str(src), "-o", str(out / "dcp"), "--format", "dcp"],
}
#: (command, point, signal): every signal at every point of remap; for convert, every signal mid-write and
#: SIGKILL at the other points (each convert child pays torch's import)
MATRIX = [(c, p, s) for c in ("remap", "in-place") for p in ("temp-created", "mid-write", "before-rename")
          for s in _SIGNALS] + \
         [(c, "mid-write", s) for c in ("safetensors", "shards") for s in _SIGNALS] + \
         [(c, p, "SIGKILL") for c in ("safetensors", "shards") for p in ("temp-created", "before-rename")] + \
         [("dcp", "temp-created", "SIGTERM"), ("dcp", "before-rename", "SIGKILL")]


@pytest.mark.parametrize("command, point, sig_name", MATRIX, ids=["-".join(m) for m in MATRIX])
def test_signal_matrix(multi: Path, tmp_path: Path, command: str, point: str, sig_name: str) -> None:
    """A real ``python -m ckptool`` process signalled at a point of its write: the destination absent (or, in
    place, the old file whole), the source's sha256 unchanged, no temporary file left unless SIGKILL, one line
    and 130 / 143 for SIGINT / SIGTERM; after SIGKILL, the same command run again succeeds, writes a valid output
    and removes what the killed run left."""
    sig, code, word = _SIGNALS[sig_name]
    src_dir, out = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir()
    out.mkdir()
    src = src_dir / "multi.pt"
    shutil.copy(multi, src)
    before = _digest(src)
    args = _COMMANDS[command](src, out)
    res = _run_paused(point, sig, args)
    assert res.returncode == code, (res.returncode, res.stderr)
    if word is not None:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{word}: nothing was written to "), res.stderr
    assert _digest(src) == before
    leftovers = _tmp_names(tmp_path)
    if sig_name == "SIGKILL":
        assert len(leftovers) <= 2  # the killed run's temporary output (and, for a set, its scratch file)
    else:
        assert leftovers == []
    assert sorted(p.name for p in src_dir.iterdir()) == ["multi.pt"] or command == "in-place"
    assert [p.name for p in out.iterdir() if not p.name.endswith(writer.TMP_SUFFIX)] == []  # nothing in place
    if sig_name != "SIGKILL":
        return
    # the next run removes what the killed one left, and writes
    env = {**os.environ, "CKPTOOL_NO_PROGRESS": "1"}
    again = subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True, text=True, env=env,
                           timeout=300, check=False)
    assert again.returncode == 0, again.stderr
    left = _tmp_names(tmp_path)
    # only a killed DCP run's staging folder stays: a folder under a temporary name is never deleted (what it holds
    # cannot be proven ours); it can be removed by hand
    assert left == [] or (command == "dcp" and all((out / n).is_dir() for n in left)), left
    _valid(command, src if command == "in-place" else out / "out.pt" if command == "remap"
           else out / "out.safetensors" if command == "safetensors" else out if command == "shards" else out / "dcp")
    if command != "in-place":
        assert _digest(src) == before


# ------------------------------------------------------------------------------------------------ real filesystems
@contextlib.contextmanager
def _tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` with ``options`` (root only; the test skips where mounting is refused)."""
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


_FULL_COMMANDS = {
    "remap": lambda src, out: ["remap", str(src), "--to", "cpu", "-o", str(out / "out.pt")],
    "prefix": lambda src, out: ["add-prefix", str(src), "model.", "-o", str(out / "out.pt")],
    "safetensors": lambda src, out: ["convert", str(src), "-o", str(out / "out.safetensors")],
    "shards": lambda src, out: ["convert", str(src), "-o", str(out) + "/", "--max-shard-size", "600KB"],
}


@pytest.mark.parametrize("command", list(_FULL_COMMANDS))
def test_disk_full_on_a_real_filesystem(multi: Path, tmp_path: Path, command: str) -> None:
    """A 2 MiB checkpoint written to a 1 MiB tmpfs: ENOSPC from the kernel, one Error line, exit 1, nothing left on
    the full filesystem, the source unchanged."""
    src = tmp_path / "multi.pt"
    shutil.copy(multi, src)
    before = _digest(src)
    with _tmpfs(tmp_path / "small", "size=1m") as out:
        r = subprocess.run([sys.executable, "-m", "ckptool", *_FULL_COMMANDS[command](src, out)], capture_output=True,
                           text=True, timeout=300, check=False, env={**os.environ, "CKPTOOL_NO_PROGRESS": "1"})
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and "No space left on device" in lines[0], r.stderr
        assert list(out.iterdir()) == []
    assert _digest(src) == before


@pytest.mark.parametrize("command", list(_FULL_COMMANDS))
def test_read_only_filesystem(multi: Path, tmp_path: Path, command: str) -> None:
    """A target on a read-only mount (EROFS, which root cannot override): one Error line naming the folder,
    exit 1, nothing written, the source unchanged."""
    src = tmp_path / "multi.pt"
    shutil.copy(multi, src)
    before = _digest(src)
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as out:
        r = subprocess.run([sys.executable, "-m", "ckptool", *_FULL_COMMANDS[command](src, out)], capture_output=True,
                           text=True, timeout=300, check=False, env={**os.environ, "CKPTOOL_NO_PROGRESS": "1"})
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and "Read-only file system" in lines[0], r.stderr
        assert str(out) in lines[0]
        assert list(out.iterdir()) == []
    assert _digest(src) == before


@pytest.mark.parametrize("args", [
    ["remap", "{src}", "--to", "cpu", "-o", "{src}"],
    ["add-prefix", "{src}", "model.", "-o", "{src}"],
    ["convert", "{src}", "-o", "{src}"],
    ["convert", "{src}", "-o", "{link}"],
    ["remap", "{src}", "--to", "cpu", "-o", "{hard}"],
])
@pytest.mark.torchfree
def test_output_equal_to_input_is_refused(src: Path, tmp_path: Path, args: list[str]) -> None:
    """-o naming the input (itself, a symbolic link to it, a hard link to it): a usage error (exit 2) before
    anything is written; the input unchanged (``--in-place`` is the way to rewrite a file in place)."""
    (tmp_path / "link.pt").symlink_to(src)
    os.link(src, tmp_path / "hard.pt")
    before = _digest(src)
    names = sorted(p.name for p in tmp_path.iterdir())
    filled = [a.format(src=src, link=tmp_path / "link.pt", hard=tmp_path / "hard.pt") for a in args]
    r = subprocess.run([sys.executable, "-m", "ckptool", *filled], capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("Error: ") and "input" in r.stderr.splitlines()[0], r.stderr
    assert _digest(src) == before and sorted(p.name for p in tmp_path.iterdir()) == names


@pytest.mark.torchfree
def test_interrupt_while_the_temporary_file_is_made_leaves_nothing(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT landing right after the temporary file exists but before its clean-up is armed (the window between
    ``mkstemp`` returning and the ``try``): held until the clean-up is armed, then raised; nothing is left."""
    real = writer.tempfile.mkstemp

    def mkstemp_then_interrupt(*a: object, **k: object) -> tuple[int, str]:
        r = real(*a, **k)  # type: ignore[call-overload]
        os.kill(os.getpid(), signal.SIGINT)  # delivered at once unless held
        time.sleep(0.01)
        return r

    monkeypatch.setattr(writer.tempfile, "mkstemp", mkstemp_then_interrupt)
    for make in (lambda: writer.atomic_output(str(tmp_path / "out.pt")), lambda: writer.temp_path(str(tmp_path / "x"))):
        with pytest.raises(KeyboardInterrupt), make() as f:
            pytest.fail(f"the interrupt was not raised before the block ({f!r})")
        assert list(tmp_path.iterdir()) == []
    old = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        release = writer.hold_signals()
        os.kill(os.getpid(), signal.SIGTERM)  # held: the handler does not run yet
        time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):
            release()
    finally:
        signal.signal(signal.SIGTERM, old)
