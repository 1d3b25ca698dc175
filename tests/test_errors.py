"""Bad input and bad arguments: one `Error: ...` line, a non-zero exit, no traceback, no file left behind.

(--debug, the exit status of system errors and internal errors, and the help texts: tests/test_cli.py.)"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from ckptool.errors import EXIT_FAILURE, EXIT_USAGE

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed

BAD_FILES = {
    # fixture: words the message must contain
    "empty.pt": "empty (0 bytes)",
    "random.pt": "not a PyTorch checkpoint",
    "png.pt": "PNG image",
    "truncated_zip.pt": "damaged zip",
    "truncated_legacy.pt": "truncated",
    "truncated_legacy_pickle.pt": "corrupted or truncated",
    "bad_header.safetensors": "header length",
    "bad_json.safetensors": "not valid JSON",
    "notorch.zip": "without data.pkl",
}


def _one_error_line(result, *, code: int | None = None) -> str:
    assert result.exit_code != 0, result.output
    if code is not None:
        assert result.exit_code == code
    lines = [line for line in result.output.splitlines() if line.strip()]
    if result.exit_code == EXIT_USAGE:  # a usage error: the line, then where to read the usage
        assert len(lines) == 2 and re.fullmatch(r"Try '\S+ [\w-]+ --help' for help\.", lines[1]), result.output
        lines = lines[:1]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("name", sorted(BAD_FILES))
@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json"], ["remap", "--to", "cpu"]])
def test_bad_files(generated, tmp_path: Path, run_cli, name: str, command: list[str]) -> None:
    src = tmp_path / name
    shutil.copy(generated[name], src)
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    r = run_cli(command[0], src, *command[1:])
    line = _one_error_line(r, code=EXIT_FAILURE)
    if "safetensors" in name and command[0] == "remap":
        assert "safetensors" in line
    else:
        assert BAD_FILES[name] in line, line
    assert hashlib.sha256(src.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_missing_file_and_directory(run_cli, tmp_path: Path) -> None:
    line = _one_error_line(run_cli("inspect", tmp_path / "nope.pt"), code=EXIT_USAGE)
    assert "no such file" in line
    line = _one_error_line(run_cli("remap", tmp_path, "--to", "cpu"), code=EXIT_USAGE)
    # remap reads sharded sets (a folder holding an index): a folder with none says what it looked for
    assert "is a folder but neither" in line and "sharded checkpoint" in line


def test_plain_pickle(generated, run_cli) -> None:
    r = run_cli("inspect", generated["plain.pkl"])
    assert r.exit_code == 0 and "Format:   pickle" in r.output
    line = _one_error_line(run_cli("remap", generated["plain.pkl"], "--to", "cpu"))
    assert "plain pickle" in line


def test_safetensors_and_torchscript_remap_explain(real_dir: Path, run_cli, tmp_path: Path) -> None:
    line = _one_error_line(run_cli("remap", real_dir / "silero-vad-16k.safetensors", "--to", "cpu", "-o",
                                   tmp_path / "x"))
    assert "carries no device tags" in line
    line = _one_error_line(run_cli("remap", real_dir / "silero-vad.jit", "--to", "cpu", "-o", tmp_path / "y"))
    assert "torch.jit.load(path, map_location=" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,words", [
    (["--to", "gpu0"], "unknown device 'gpu0'"),
    (["--to", "cuda:x"], "unknown device"),
    (["--map", "cuda:1"], "FROM=TO"),
    (["--map", "cuda:1=banana"], "unknown device 'banana'"),
    ([], "exactly one of --to"),
    (["--to", "cpu", "--map", "cuda:0=cpu"], "exactly one of --to"),
])
def test_bad_device_arguments(generated, run_cli, tmp_path: Path, args: list[str], words: str) -> None:
    line = _one_error_line(run_cli("remap", generated["sd_cuda0.pt"], *args, "-o", tmp_path / "o.pt"), code=EXIT_USAGE)
    assert words in line
    assert list(tmp_path.iterdir()) == []


def test_output_is_input(generated, run_cli, tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    shutil.copy(generated["sd_cuda0.pt"], src)
    line = _one_error_line(run_cli("remap", src, "--to", "cpu", "-o", src), code=EXIT_USAGE)
    assert "--in-place" in line
    link = tmp_path / "link.pt"
    link.symlink_to(src)
    line = _one_error_line(run_cli("remap", src, "--to", "cpu", "-o", link), code=EXIT_USAGE)
    assert "is the input file" in line


def test_output_folder_missing(generated, run_cli, tmp_path: Path) -> None:
    line = _one_error_line(run_cli("remap", generated["sd_cuda0.pt"], "--to", "cpu", "-o", tmp_path / "no" / "o.pt"),
                           code=EXIT_USAGE)
    assert "does not exist" in line


def test_out_of_memory_while_unpickling_is_not_called_corrupt(generated, run_cli, monkeypatch) -> None:
    """A MemoryError inside the restricted unpickler is the machine's limit, not a damaged file: one line that
    says out of memory and names the file, exit 1 (before, it read "corrupted or truncated")."""
    from ckptool.formats.unpickler import RestrictedUnpickler

    def no_memory(self):
        raise MemoryError

    monkeypatch.setattr(RestrictedUnpickler, "load", no_memory)
    src = generated["sd_cpu.pt"]
    line = _one_error_line(run_cli("inspect", src), code=EXIT_FAILURE)
    assert "out of memory" in line
    assert src.name in line
    assert "corrupt" not in line


def test_import_error_while_unpickling_is_not_swallowed(generated, monkeypatch) -> None:
    """ImportError is no longer among the exceptions the unpickler turns into CorruptCheckpointError."""
    from ckptool.formats.unpickler import PICKLE_ERRORS

    assert MemoryError not in PICKLE_ERRORS
    assert ImportError not in PICKLE_ERRORS
