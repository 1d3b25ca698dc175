"""Bad input and bad arguments: one `Error: ...` line, a non-zero exit, no traceback, no file left behind.

(--debug, the exit status of system errors and internal errors, and the help texts: tests/test_cli.py.)"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from ckptool.cli._errors import EXIT_FAILURE, EXIT_USAGE

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


# ------------------------------------------------------------------------------------------------ built-in bases
# As huggingface_hub's errors: a caller who knows ckptool catches CkptError, one who does not catches the built-in.

def test_errors_derive_from_the_matching_built_ins() -> None:
    import errno
    import pickle

    from ckptool import errors as E

    assert issubclass(E.InputNotFoundError, FileNotFoundError) and issubclass(E.InputNotFoundError, E.UsageError)
    for cls in (E.NotACheckpointError, E.CorruptCheckpointError, E.UnsupportedError, E.UsageError,
                E.KeyCollisionError, E.PrefixNotFoundError, E.NestedPrefixError, E.DeviceNotFoundError,
                E.InputNotFoundError):
        assert issubclass(cls, E.CkptError) and issubclass(cls, ValueError), cls
    assert issubclass(E.OutputError, OSError) and issubclass(E.RemoteError, OSError)
    assert issubclass(E.UnsafeCheckpointError, pickle.UnpicklingError)  # what torch.load(weights_only=True) raises
    assert issubclass(E.StateDictMismatchError, RuntimeError)  # what load_state_dict(strict=True) raises
    # the built-in base changes neither the message nor the attributes
    missing = E.InputNotFoundError("x.pt: no such file; check the path")
    assert str(missing) == "x.pt: no such file; check the path" and missing.errno == errno.ENOENT
    out = E.OutputError("writing /o.pt failed: No space left on device", "/o.pt", errno.ENOSPC)
    assert str(out) == "writing /o.pt failed: No space left on device" and (out.path, out.errno) == ("/o.pt", 28)
    assert str(E.RemoteError("s3://b/x: refused", "s3://b/x")) == "s3://b/x: refused"


def test_the_exceptions_carry_no_exit_code() -> None:
    """The exit status is decided where the error is shown (ckptool/cli/_errors.py), not in the exception."""
    from ckptool import errors as E

    assert not [n for n in dir(E) if n.startswith("EXIT_")]
    assert not [c for c in vars(E).values() if isinstance(c, type) and hasattr(c, "exit_code")]


def test_the_cli_table_gives_each_error_its_exit_status() -> None:
    from ckptool import errors as E
    from ckptool.cli._errors import describe_error

    assert describe_error(E.InputNotFoundError("x.pt: no such file"))[1] == EXIT_USAGE
    assert describe_error(E.UsageError("bad"))[1] == EXIT_USAGE
    for e in (E.CorruptCheckpointError("x"), E.NotACheckpointError("x"), E.UnsupportedError("x"),
              E.OutputError("x", "/o"), E.RemoteError("x", "s3://x"), E.UnsafeCheckpointError("x"),
              E.StateDictMismatchError("x", None), E.VerificationError("x"), E.CkptError("x")):
        assert describe_error(e) == ("x", EXIT_FAILURE), e


def test_a_missing_input_is_a_file_not_found_error(tmp_path: Path) -> None:
    import ckptool

    with pytest.raises(FileNotFoundError, match="no such file"):
        ckptool.inspect(tmp_path / "absent.pt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        ckptool.scan([tmp_path / "absent.pt"])


def test_a_corrupt_input_is_a_value_error(generated) -> None:
    import ckptool

    for name in ("truncated_zip.pt", "random.pt", "bad_json.safetensors"):
        with pytest.raises(ValueError, match=BAD_FILES[name]):
            ckptool.inspect(generated[name])


def test_wrapped_errors_keep_their_own_message(tmp_path: Path) -> None:
    """An ``except ValueError`` (or ``OSError``) meant for a parser's own failure must not re-word a ckptool error
    that is now a ValueError (or OSError) too."""
    from ckptool.errors import UsageError
    from ckptool.ops.surgery.rules import load_rules

    rules = tmp_path / "rules.txt"
    rules.write_text("[]")
    with pytest.raises(UsageError, match=r"name it \.json, \.yaml / \.yml or \.toml") as info:
        load_rules(rules)
    assert "does not parse" not in str(info.value)


def test_a_missing_index_url_is_not_called_bad_json() -> None:
    pytest.importorskip("fsspec")
    from ckptool.formats.sharded import parse_index

    with pytest.raises(FileNotFoundError, match="no such file") as missing:
        parse_index("memory://absent/model.safetensors.index.json")  # a URL: ckptool's own not-found error
    assert "not valid JSON" not in str(missing.value)
