"""The command line as a whole: the registry, lazy command loading, --help, --debug and the exit status of each
kind of failure (ckptool/cli/__init__.py, ckptool/cli/_errors.py)."""

from __future__ import annotations

import ast
import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

import ckptool
import ckptool.cli.inspect as inspect_cli
from ckptool.cli import COMMANDS, EPILOG, cli
from ckptool.cli._errors import EXIT_BUG, EXIT_FAILURE, EXIT_OK, EXIT_USAGE, describe_error
from ckptool.errors import (
    CorruptCheckpointError,
    NotACheckpointError,
    OutputError,
    UsageError,
)

REPO = Path(__file__).resolve().parent.parent
CLI_DIR = REPO / "ckptool" / "cli"
BUG = "run again with --debug (or CKPTOOL_DEBUG=1) for the traceback, and report it"


def _squash(text: str) -> str:
    return " ".join(text.split())


def _one_error_line(result: click.testing.Result, code: int) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == code, result.output
    if code == EXIT_USAGE:  # a usage error: the line, then where to read the usage
        assert len(lines) == 2 and re.fullmatch(r"Try '\S+ [\w-]+ --help' for help\.", lines[1]), result.output
        lines = lines[:1]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=REPO, check=False)


# ------------------------------------------------------------------------------------------------ the registry
def test_registry_names_every_command_module_and_a_click_command() -> None:
    modules = {p.stem for p in CLI_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert {info.module.rsplit(".", 1)[1] for info in COMMANDS.values()} == modules
    for name in COMMANDS:
        cmd = cli.commands[name]
        assert isinstance(cmd, click.Command) and cmd.name == name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help_and_its_summary_is_its_first_paragraph(run_cli, name: str) -> None:
    cmd = cli.commands[name]
    assert cmd.help and len(cmd.help) > 40
    assert _squash(cmd.help.split("\n\n")[0]) == COMMANDS[name].summary
    for p in cmd.params:
        if isinstance(p, click.Option):
            assert p.help, f"{name}: option {p.name} has no help"
    r = run_cli(name, "--help")
    assert r.exit_code == 0 and _squash(COMMANDS[name].summary) in _squash(r.output)


@pytest.mark.torchfree
def test_top_level_help_lists_every_command_with_its_whole_summary(run_cli) -> None:
    r = run_cli("--help")
    assert r.exit_code == 0
    commands = _squash(r.output.split("Commands:", 1)[1])
    for name, info in COMMANDS.items():
        assert f"{name} {info.summary}" in commands, name
    assert "..." not in commands  # nothing cut short
    for code in (EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_BUG):  # the exit status table (epilog)
        assert re.search(rf"^\s+{code}\s+\S", r.output, re.M), code
    assert "--debug" in EPILOG and "CKPTOOL_DEBUG=1" in EPILOG


@pytest.mark.torchfree
def test_unknown_command_suggests_without_loading(run_cli) -> None:
    r = run_cli("inspct")
    assert r.exit_code == EXIT_USAGE and "No such command 'inspct'" in r.output


@pytest.mark.torchfree
def test_importing_the_cli_imports_no_command_module_and_no_torch() -> None:
    command_modules = sorted({info.module for info in COMMANDS.values()})
    code = (
        "import sys, ckptool.cli\n"
        f"mods = {command_modules!r}\n"
        "assert 'demo' in ckptool.cli.cli.commands and 'nope' not in ckptool.cli.cli.commands\n"
        "assert sorted(ckptool.cli.cli.commands) == sorted(ckptool.cli.COMMANDS)\n"
        "ckptool.cli.cli.main(['--help'], standalone_mode=False)\n"
        "loaded = [m for m in mods if m in sys.modules] + [m for m in ('torch', 'tabulate') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr


@pytest.mark.torchfree
def test_running_a_command_imports_only_its_own_module(real_dir: Path) -> None:
    code = (
        "import sys, ckptool.cli\n"
        "from click.testing import CliRunner\n"
        "r = CliRunner().invoke(ckptool.cli.cli, ['inspect', sys.argv[1]])\n"
        "assert r.exit_code == 0, r.output\n"
        "cli_mods = sorted(m for m in sys.modules if m.startswith('ckptool.cli.'))\n"
        "assert cli_mods == ['ckptool.cli._common', 'ckptool.cli._errors', 'ckptool.cli._flags', "
        "'ckptool.cli.inspect'], cli_mods\n"
        "assert 'torch' not in sys.modules\n"
    )
    r = _run(code, str(real_dir / "lpips-v0.1-alex.pth"))
    assert r.returncode == 0, r.stderr


@pytest.mark.torchfree
def test_a_read_only_command_loads_no_writer(real_dir: Path) -> None:
    """Start-up pays for what the command runs: inspect --json and scan of a safe file load neither the renaming
    and rewriting code nor the output machinery (ckptool.cli._common needs the rename result type for annotations
    only), nor tabulate (no table to print) nor importlib.metadata (SARIF names ckptool.__version__)."""
    code = (
        "import sys, ckptool.cli\n"
        "from click.testing import CliRunner\n"
        "for cmd in (['inspect', '--json', sys.argv[1]], ['scan', sys.argv[1]]):\n"
        "    r = CliRunner().invoke(ckptool.cli.cli, cmd)\n"
        "    assert r.exit_code == 0, r.output\n"
        "loaded = [m for m in ('ckptool.ops.rewrite.prefixes', 'ckptool.ops.rewrite.stream',\n"
        "                      'ckptool.ops.rewrite.remap',\n"
        "                      'ckptool._fileio',\n"
        "                      'ckptool.formats.torchzip', 'ckptool.formats.pickler', 'tabulate',\n"
        "                      'importlib.metadata') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    r = _run(code, str(real_dir / "lpips-v0.1-alex.pth"))
    assert r.returncode == 0, r.stderr


@pytest.mark.torchfree
def test_no_command_module_imports_another_or_the_package() -> None:
    """Command modules share code only through ckptool/cli/_common.py (which re-exports the flags of
    ckptool/cli/_flags.py, imported by the entry point too) and ckptool/cli/_hints.py (the load hint of the writing
    commands, which imports _common, never the other way) and ckptool/cli/_many.py (scan's many-checkpoint mode, kept
    apart so that one file's scan does not load it); the exit statuses come from ckptool/cli/_errors.py, where they
    live (its ``EXIT_*`` codes, and ``ckpt_exit_code``: the status one of ckptool's errors gives, which
    ``sanitize --dry-run --json`` reports beside the error); only the entry point imports ckptool.cli."""
    for path in CLI_DIR.glob("*.py"):
        if path.name in ("__init__.py", "_flags.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if path.name == "_common.py" and name.startswith("ckptool.cli._flags"):
                    continue
                if name == "ckptool.cli" or name.startswith("ckptool.cli."):
                    assert name.startswith(("ckptool.cli._common", "ckptool.cli._hints", "ckptool.cli._many",
                                            "ckptool.cli._errors.EXIT_")) or name in ("ckptool.cli._errors",
                                                                           "ckptool.cli._errors.ckpt_exit_code"), \
                        f"{path.name} imports {name}"
                    assert path.name != "_common.py", f"_common.py imports {name}"
                    assert not (path.name == "_hints.py" and name.startswith("ckptool.cli._hints")), name


# ------------------------------------------------------------------------------------------------ --debug
@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.torchfree
def test_debug_before_or_after_the_command_raises_the_original(generated, run_cli, where: str) -> None:
    args = ["inspect", generated["random.pt"]]
    args = ["--debug", *args] if where == "before" else [*args, "--debug"]
    r = run_cli(*args, catch_exceptions=True)
    assert isinstance(r.exception, NotACheckpointError)


@pytest.mark.torchfree
def test_debug_from_the_environment(generated, run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTOOL_DEBUG", "1")
    r = run_cli("inspect", generated["random.pt"], catch_exceptions=True)
    assert isinstance(r.exception, NotACheckpointError)
    monkeypatch.setenv("CKPTOOL_DEBUG", "0")
    _one_error_line(run_cli("inspect", generated["random.pt"]), EXIT_FAILURE)


@pytest.mark.torchfree
def test_debug_is_hidden_from_command_help_but_accepted(run_cli) -> None:
    r = run_cli("inspect", "--help")
    assert r.exit_code == 0 and "--debug" not in r.output
    assert "--debug" in run_cli("--help").output


@pytest.mark.torchfree
def test_entry_point_with_debug_prints_the_traceback_and_keeps_the_exit_status(generated) -> None:
    r = subprocess.run([sys.executable, "-m", "ckptool", "inspect", str(generated["random.pt"]), "--debug"],
                       capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert r.returncode == EXIT_FAILURE
    assert "Traceback" in r.stderr and "NotACheckpointError" in r.stderr
    code = (
        "import sys, ckptool.cli.inspect as m\n"
        "def boom(path): raise RuntimeError('injected bug')\n"
        "m.inspect = boom\n"
        "from ckptool.cli import main\n"
        "sys.argv = ['ckptool', 'inspect', 'x.pt', *sys.argv[1:]]\n"
        "main()\n"
    )
    r = _run(code, "--debug")
    assert r.returncode == EXIT_BUG and "Traceback" in r.stderr and "RuntimeError: injected bug" in r.stderr
    r = _run(code)
    assert r.returncode == EXIT_BUG and "Traceback" not in r.stderr
    expected = f"Error: internal error (a bug in ckptool): RuntimeError: injected bug; {BUG}"
    assert r.stderr.strip().splitlines() == [expected]


# ------------------------------------------------------------------------------------------------ exit status
def _inject(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def fail(path: object) -> None:
        raise exc

    monkeypatch.setattr(inspect_cli, "inspect", fail)


@pytest.mark.torchfree
def test_internal_error_exits_3_with_one_line_naming_debug(run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, RuntimeError("injected bug\nsecond line"))
    line = _one_error_line(run_cli("inspect", "x.pt"), EXIT_BUG)
    assert line == f"Error: internal error (a bug in ckptool): RuntimeError: injected bug; {BUG}"
    r = run_cli("inspect", "x.pt", "--debug", catch_exceptions=True)
    assert isinstance(r.exception, RuntimeError)


@pytest.mark.parametrize("exc, code, expected", [
    (MemoryError(), EXIT_FAILURE,
     ("Error: out of memory: this needed more memory than the machine could give; close other programs or run it "
      "on a machine with more memory")),
    (PermissionError(errno.EACCES, "Permission denied", "/data/model.pt"), EXIT_FAILURE,
     "Error: permission denied: /data/model.pt; check its permissions, or choose a file or folder you can access"),
    (OSError(errno.ENOSPC, "No space left on device", "/data/out.pt"), EXIT_FAILURE,
     "Error: No space left on device writing /data/out.pt; free some space or write elsewhere with -o"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), EXIT_FAILURE,
     "Error: Disk quota exceeded; free some space or write elsewhere with -o"),
    (OSError(errno.EIO, "Input/output error", "/data/model.pt"), EXIT_FAILURE,
     "Error: /data/model.pt: Input/output error"),
    (ModuleNotFoundError("No module named 'yaml'", name="yaml"), EXIT_FAILURE,
     "Error: this needs the pyyaml package, which is not installed; install it with: pip install pyyaml"),
    (ModuleNotFoundError("No module named 'safetensors'", name="safetensors"), EXIT_FAILURE,
     ("Error: this needs the safetensors package, which is not installed (`pip install ckptool` leaves it out); "
      "install it with: pip install 'ckptool[torch]'")),
    (ImportError("cannot import name 'x' from 'safetensors.torch'", name="safetensors.torch"), EXIT_FAILURE,
     ("Error: importing safetensors.torch failed (cannot import name 'x' from 'safetensors.torch'); the installed "
      "safetensors may be too old or broken: pip install --upgrade safetensors")),
    (ModuleNotFoundError("No module named 'ckptool.gone'", name="ckptool.gone"), EXIT_BUG,
     f"Error: internal error (a bug in ckptool): ModuleNotFoundError: No module named 'ckptool.gone'; {BUG}"),
    (CorruptCheckpointError("x.pt is truncated"), EXIT_FAILURE, "Error: x.pt is truncated"),
    (OutputError("writing /o.pt failed: No space left on device; nothing was written", "/o.pt", errno.ENOSPC),
     EXIT_FAILURE, "Error: writing /o.pt failed: No space left on device; nothing was written"),
    (UsageError("--to gpu0: unknown device"), EXIT_USAGE, "Error: --to gpu0: unknown device"),
])
@pytest.mark.torchfree
def test_each_kind_of_failure_has_its_line_and_exit_status(run_cli, monkeypatch: pytest.MonkeyPatch,
                                                           exc: BaseException, code: int, expected: str) -> None:
    _inject(monkeypatch, exc)
    assert _one_error_line(run_cli("inspect", "x.pt"), code) == expected
    assert describe_error(exc) == (expected.removeprefix("Error: "), code)


@pytest.mark.torchfree
def test_keyboard_interrupt_exits_130(run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, KeyboardInterrupt())
    r = run_cli("inspect", "x.pt")
    assert r.exit_code == 130 and r.output.strip() == "Interrupted" and "Traceback" not in r.output


@pytest.mark.torchfree
def test_click_usage_errors_exit_2(run_cli) -> None:
    r = run_cli("inspect", "--no-such-option", "x.pt")
    assert r.exit_code == EXIT_USAGE and "No such option" in r.output
    r = run_cli("remap")
    assert r.exit_code == EXIT_USAGE and "Missing argument 'SRC'" in r.output


@pytest.mark.torchfree
def test_input_error_inside_the_output_block_names_the_input(generated, run_cli, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of the input fails while the output is being written: the message is about the input, the output
    path is not mentioned and nothing is left behind."""
    from ckptool.formats.torchzip import TorchZipWriter

    src = tmp_path / "model.pt"
    shutil.copy(generated["sd_cuda0.pt"], src)
    out = tmp_path / "out.pt"

    def unreadable(self: object, *a: object, **k: object) -> None:
        raise OSError(errno.EIO, "Input/output error", str(src))

    monkeypatch.setattr(TorchZipWriter, "copy_record", unreadable)
    line = _one_error_line(run_cli("remap", src, "--to", "cpu", "-o", out), EXIT_FAILURE)
    assert line == f"Error: {src}: Input/output error"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


@pytest.mark.torchfree
def test_scan_keeps_its_verdict_codes(generated, run_cli) -> None:
    assert run_cli("scan", generated["sd_cuda0.pt"]).exit_code == 0


@pytest.mark.torchfree
def test_readme_documents_the_exit_codes() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    for code in (EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_BUG):
        assert re.search(rf"^\| {code} \|", section, re.M), code
    assert "--debug" in section and "CKPTOOL_DEBUG=1" in section
    assert describe_error(ckptool.CkptError("x"))[1] == EXIT_FAILURE
    assert describe_error(UsageError("x"))[1] == EXIT_USAGE


@pytest.mark.torchfree
def test_the_entry_point_leaves_the_heap_to_the_exit(real_dir: Path) -> None:
    """Once a command has finished, main() freezes the objects still alive (gc.freeze): the interpreter's
    shutdown then does not walk them in a last full collection (inspect of 50,000 tensors: -40 ms)."""
    code = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 1000))\n"
        "from ckptool.cli import main\n"
        "sys.argv = ['ckptool', 'inspect', sys.argv[1]]\n"
        "main()\n"
    )
    r = _run(code, str(real_dir / "lpips-v0.1-alex.pth"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("frozen True"), r.stdout[-200:]


def test_the_package_version_is_the_distribution_version() -> None:
    """``ckptool.__version__`` (what ``scan --format sarif`` reports) is the installed distribution's version."""
    import importlib.metadata

    import ckptool

    assert ckptool.__version__ == importlib.metadata.version("ckptool")
