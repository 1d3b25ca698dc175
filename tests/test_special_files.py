"""Regular files only (issue 36 item 3): an input, a DCP record file, a DCP ``.metadata``, a rules file that is a
FIFO or a device is refused before it is opened for reading, with one ``Error:`` line (or, for ``scan``, an error
verdict), never a hang; a folder walk skips a FIFO it would only have opened to look at.

Each command runs in a subprocess with a generous ``timeout`` as the hang guard (no timing is asserted): a command
that blocked on a FIFO would raise ``subprocess.TimeoutExpired``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptool import _source as source
from ckptool.errors import NotACheckpointError

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")

REPO = Path(__file__).resolve().parent.parent
#: the hang guard: far above what any of these commands needs
HANG_GUARD_S = 240


def _ckptool(*args: str | Path, cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "ckptool", *map(str, args)], capture_output=True, text=True,
                         timeout=HANG_GUARD_S, env=env, cwd=cwd, stdin=subprocess.DEVNULL, check=False)
    return res.returncode, res.stdout + res.stderr


def _refused(code: int, out: str, *, scan: bool = False) -> None:
    assert code not in (0, 3) and "Traceback" not in out, out
    if scan:
        assert code == 2 and "not a regular file" in out, out
    else:
        errors = [ln for ln in out.splitlines() if ln.startswith("Error:")]
        assert len(errors) == 1 and ("not a regular file" in errors[0] or "FIFO" in errors[0]), out


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    p = tmp_path / "pipe.pt"
    os.mkfifo(p)
    return p


@pytest.mark.torchfree
def test_open_regular_refuses_a_fifo_without_blocking(fifo: Path) -> None:
    with pytest.raises(NotACheckpointError, match=r"is a FIFO \(named pipe\), not a regular file"):
        source.open_regular(str(fifo))
    with pytest.raises(NotACheckpointError, match="a character device"):
        source.open_binary("/dev/zero")
    assert source.special_kind(os.stat(fifo).st_mode) == "a FIFO (named pipe)"


@pytest.mark.torchfree
def test_open_regular_reads_a_regular_file_and_names_it(tmp_path: Path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    with source.open_regular(str(p)) as f:
        assert f.read() == b"abc" and f.name == str(p)


@pytest.mark.parametrize("command", [["inspect"], ["scan"], ["diff", "OTHER"], ["convert", "-o", "out.safetensors"]])
def test_a_fifo_input_is_refused(fifo: Path, tmp_path: Path, command: list[str]) -> None:
    other = tmp_path / "other.pt"
    other.write_bytes(b"\x80\x02}q\x00.")
    args = [a.replace("OTHER", str(other)) for a in command]
    code, out = _ckptool(args[0], fifo, *args[1:], cwd=tmp_path)
    _refused(code, out, scan=command[0] == "scan")


def test_dev_zero_input_is_refused(tmp_path: Path) -> None:
    os.symlink("/dev/zero", tmp_path / "zero.pt")
    code, out = _ckptool("inspect", "zero.pt", cwd=tmp_path)
    _refused(code, out)


def _dcp(tmp_path: Path) -> Path:
    torch = pytest.importorskip("torch")
    from dcp_craft import craft

    return craft(tmp_path / "ckpt", {"w": (torch.ones(2, 3), [((0, 0), (2, 3), 0)])})


MODELS = "import torch\n\ndef build():\n    return torch.nn.Linear(3, 2)\n"


@pytest.mark.parametrize("command", ["diff", "verify", "convert", "scan", "inspect"])
def test_a_fifo_dcp_record_is_refused(tmp_path: Path, command: str) -> None:
    folder = _dcp(tmp_path)
    (folder / "__0_0.distcp").unlink()
    os.mkfifo(folder / "__0_0.distcp")
    (tmp_path / "special_models.py").write_text(MODELS, encoding="utf-8")
    args = {"diff": ["diff", folder, folder], "convert": ["convert", folder, "-o", "out.safetensors"],
            "verify": ["verify", folder, "--model", f"{tmp_path / 'special_models.py'}:build", "--no-strict"],
            "scan": ["scan", folder], "inspect": ["inspect", folder]}[command]
    code, out = _ckptool(*args, cwd=tmp_path)
    assert code != 3 and "Traceback" not in out, out
    if command == "scan":
        assert code == 2 and "not a regular file" in out, out
    elif command == "inspect":  # inspect reads .metadata only: the record is never opened
        assert code == 0, out
    else:
        _refused(code, out)


@pytest.mark.parametrize("command", ["scan", "inspect", "diff", "convert"])
def test_a_fifo_metadata_is_refused(tmp_path: Path, command: str) -> None:
    folder = _dcp(tmp_path)
    (folder / ".metadata").unlink()
    os.mkfifo(folder / ".metadata")
    args = {"diff": ["diff", folder, folder], "convert": ["convert", folder, "-o", "out.safetensors"],
            "scan": ["scan", folder], "inspect": ["inspect", folder]}[command]
    code, out = _ckptool(*args, cwd=tmp_path)
    _refused(code, out, scan=command == "scan")


@pytest.mark.parametrize("rules", ["fifo.json", "zero.json", "/dev/zero"])
def test_a_fifo_or_device_rules_file_is_refused(tmp_path: Path, rules: str) -> None:
    ck = tmp_path / "in.pt"
    torch = pytest.importorskip("torch")
    torch.save({"a": torch.ones(2)}, ck)
    if rules == "fifo.json":
        os.mkfifo(tmp_path / rules)
    elif rules == "zero.json":
        os.symlink("/dev/zero", tmp_path / rules)
    code, out = _ckptool("rename", ck, "--rules", rules, "-o", "out.pt", cwd=tmp_path)
    assert code == 2 and out.count("Error:") == 1 and "Traceback" not in out, out
    assert ("not a regular file" in out) if rules != "/dev/zero" else ("name it .json" in out), out


@pytest.mark.torchfree
def test_rules_file_size_cap(tmp_path: Path) -> None:
    from ckptool.errors import UsageError
    from ckptool.ops.surgery.rules import MAX_RULES_BYTES, load_rules

    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b" " * (MAX_RULES_BYTES + 1) + b"]")
    with pytest.raises(UsageError, match="larger than 4 MiB"):
        load_rules(big)


def test_scan_of_a_folder_never_opens_a_fifo(tmp_path: Path) -> None:
    folder = tmp_path / "walk"
    folder.mkdir()
    os.mkfifo(folder / "noname")  # only opened to look at its first bytes: skipped
    pickle_file = folder / "data"
    pickle_file.write_bytes(b"\x80\x02}q\x00.")
    code, out = _ckptool("scan", folder, cwd=tmp_path)
    assert code == 0 and "noname" not in out, out
    os.mkfifo(folder / "model.pt")  # named like a checkpoint: reported, never opened
    code, out = _ckptool("scan", folder, cwd=tmp_path)
    assert code == 2 and "model.pt is a FIFO" in out, out
