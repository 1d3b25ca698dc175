"""``ckptool._fileio.atomic_output`` under injected failures: the destination is left as it was, no temporary file
remains, and the error names the file it is about (the output for write/fsync/rename failures, the input or
nothing for failures while reading the input)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ckptool import _fileio
from ckptool._fileio import TMP_SUFFIX, atomic_output
from ckptool.errors import OutputError

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed

OLD = b"previous version"


@pytest.fixture
def dst(tmp_path: Path) -> Path:
    p = tmp_path / "out.pt"
    p.write_bytes(OLD)
    return p


def _untouched(dst: Path) -> None:
    assert dst.read_bytes() == OLD
    assert sorted(p.name for p in dst.parent.iterdir()) == [dst.name], "a temporary file was left behind"


def test_success_replaces_destination_and_leaves_no_temp(dst: Path) -> None:
    with atomic_output(str(dst)) as f:
        f.write(b"new")
        f.seek(0)
        assert f.read() == b"new"
    assert dst.read_bytes() == b"new"
    assert sorted(p.name for p in dst.parent.iterdir()) == [dst.name]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("size", [1 << 20, 5], ids=["at-write", "at-final-flush"])
def test_real_enospc_names_the_output(dst: Path, size: int) -> None:
    """A real ENOSPC: the temporary file's descriptor is pointed at /dev/full, whose writes fail with ENOSPC. 1 MiB
    is larger than the buffer and reaches the kernel in ``write``; 5 bytes stay in the buffer until the flush
    atomic_output makes when the block ends."""
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OutputError) as e, atomic_output(str(dst)) as f:
            os.dup2(full, f.fileno())
            f.write(b"x" * size)
    finally:
        os.close(full)
    assert e.value.errno == errno.ENOSPC and e.value.path == str(dst)
    msg = str(e.value)
    assert msg.startswith(f"writing {dst} failed: No space left on device; nothing was written")
    assert "free some space or write elsewhere with -o" in msg
    _untouched(dst)


def test_raw_enospc_from_the_block_is_about_the_output(dst: Path) -> None:
    """Code that writes through the file descriptor itself raises OSError without a file name: ENOSPC, EDQUOT,
    EFBIG and EROFS can only come from a write, so the error names the output."""
    with pytest.raises(OutputError) as e, atomic_output(str(dst)):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert e.value.path == str(dst) and "free some space" in str(e.value)
    _untouched(dst)


@pytest.mark.parametrize("step", ["fsync", "replace", "chmod"])
def test_failure_at_fsync_chmod_or_rename_names_the_output(dst: Path, monkeypatch: pytest.MonkeyPatch,
                                                           step: str) -> None:
    def fail(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC if step == "fsync" else errno.EIO, "injected")

    monkeypatch.setattr(_fileio.os, step, fail)
    with pytest.raises(OutputError) as e, atomic_output(str(dst)) as f:
        f.write(b"new")
    monkeypatch.undo()
    assert e.value.path == str(dst) and str(e.value).startswith(f"writing {dst} failed: injected")
    _untouched(dst)


def test_keyboard_interrupt_cleans_up_and_propagates(dst: Path) -> None:
    with pytest.raises(KeyboardInterrupt), atomic_output(str(dst)) as f:
        f.write(b"partial" * 10000)
        raise KeyboardInterrupt
    _untouched(dst)


def test_input_side_oserror_is_not_reported_against_the_output(dst: Path, tmp_path: Path) -> None:
    """Reading the input fails inside the block: the exception comes out unchanged, naming the input."""
    missing = tmp_path / "input-gone.pt"
    with pytest.raises(FileNotFoundError) as e, atomic_output(str(dst)) as f:
        f.write(b"header")
        open(missing, "rb")  # noqa: SIM115 - the failure is the point
    assert e.value.filename == str(missing)
    assert not isinstance(e.value, OutputError)
    _untouched(dst)


def test_input_side_eio_without_a_name_is_not_attributed_to_the_output(dst: Path) -> None:
    """An I/O error from a read (no file name, and an errno a read can raise) passes through as it was."""
    err = OSError(errno.EIO, "Input/output error")
    with pytest.raises(OSError) as e, atomic_output(str(dst)):
        raise err
    assert e.value is err
    _untouched(dst)


def test_other_exceptions_pass_through(dst: Path) -> None:
    with pytest.raises(ValueError, match="corrupt input"), atomic_output(str(dst)) as f:
        f.write(b"x")
        raise ValueError("corrupt input")
    _untouched(dst)


def test_cannot_create_the_temporary_file_names_the_folder(dst: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object, **k: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(_fileio.tempfile, "mkstemp", refuse)
    with pytest.raises(OutputError) as e, atomic_output(str(dst)):
        pass
    assert e.value.path == str(dst.parent)
    assert str(e.value) == f"cannot write in {dst.parent}: Permission denied; choose a folder you can write to"
    _untouched(dst)


def test_temporary_file_name(dst: Path) -> None:
    with atomic_output(str(dst)) as f:
        names = [n for n in os.listdir(dst.parent) if n != dst.name]
        assert len(names) == 1
        assert names[0].startswith(_fileio.temp_prefix(str(dst))) and names[0].endswith(TMP_SUFFIX)
        f.write(b"x")
