"""The ``ckptool`` command line: the command registry, the top-level group and the entry point.

:data:`COMMANDS` maps each command name to the module that defines it, the name of its ``click.Command`` in that
module and a one-line summary, in the manner of pip's ``commands_dict``. A command's module is imported only when
the command runs (or its ``--help`` is shown): the top-level ``--help`` needs only the summaries, so starting
``ckptool`` imports no command module, no library operation and no torch. Command modules import shared options
and helpers from :mod:`ckptool.cli._common`, never one another, and never this module.

Errors become one ``Error: ...`` line and an exit status (``EXIT_*``) through the one table in
:mod:`ckptool.cli._errors`. ``--debug`` (before or after the command) or ``CKPTOOL_DEBUG=1`` shows the
full traceback instead. Usage errors are the ``Error: ...`` line and a ``Try '... --help'`` line.

Every command also takes ``-q/--quiet`` and ``--progress`` (:mod:`ckptool.cli._flags`). SIGINT and SIGTERM stop a
command cleanly: the temporary output is removed (:func:`ckptool._fileio.atomic_output`), one
``Interrupted: nothing was written to OUT`` line is printed and the exit status is 130 / 143; a signal that comes
after the output was put in place prints ``Interrupted after OUT was written: it is complete`` and exits 0.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from types import FrameType
from typing import IO, Any, NamedTuple

import click

from ckptool._gc import skip_final_collection
from ckptool._source import consistent_reads, set_timeout
from ckptool.cli._errors import (
    EXIT_BUG,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    describe_error,
)
from ckptool.cli._flags import common_options, is_quiet, muted_stdout, output_of, remove_made_folders


class CommandInfo(NamedTuple):
    """Where a command lives: ``module`` (dotted), ``attr`` (its ``click.Command`` there) and a one-line
    ``summary`` for the top-level ``--help`` (the first paragraph of the command's own help)."""

    module: str
    attr: str
    summary: str


#: every command of ``ckptool``: name -> where it is defined and its summary
COMMANDS: dict[str, CommandInfo] = {
    "report": CommandInfo(
        "ckptool.cli.report", "report_cmd",
        "Write one self-contained HTML page about checkpoint A, or comparing A with B."),
    "inspect": CommandInfo(
        "ckptool.cli.inspect", "inspect_cmd",
        "Show what checkpoint PATH holds, without running its code or reading tensor data."),
    "remap": CommandInfo(
        "ckptool.cli.remap", "remap_cmd",
        "Re-tag the storages of checkpoint SRC so that a plain torch.load opens it on another device."),
    "strip-dataparallel": CommandInfo(
        "ckptool.cli.prefixes", "strip_dataparallel_cmd",
        "Remove the leading `module.` that nn.DataParallel / DistributedDataParallel add to state_dict keys."),
    "strip-prefix": CommandInfo(
        "ckptool.cli.prefixes", "strip_prefix_cmd",
        "Remove PREFIX (whole dotted components, e.g. `model.`) from the front of state_dict keys."),
    "add-prefix": CommandInfo(
        "ckptool.cli.prefixes", "add_prefix_cmd",
        "Put PREFIX (whole dotted components, e.g. `module.`) in front of every state_dict key."),
    "unwrap": CommandInfo(
        "ckptool.cli.prefixes", "unwrap_cmd",
        "Remove every wrapper prefix that `ckptool inspect` reports from state_dict keys, and say what was removed."),
    "rename": CommandInfo(
        "ckptool.cli.surgery", "rename_cmd",
        "Rename state_dict keys by regex rules (REGEX=REPLACEMENT on the whole key, in order)."),
    "filter": CommandInfo(
        "ckptool.cli.surgery", "filter_cmd",
        "Keep or drop state_dict keys by glob, and list what was dropped."),
    "average": CommandInfo(
        "ckptool.cli.surgery", "average_cmd",
        "Average the state_dicts of two or more checkpoints (any mix of torch and safetensors files)."),
    "merge-lora": CommandInfo(
        "ckptool.cli.merge", "merge_lora_cmd",
        "Merge the LoRA adapter folder ADAPTER (PEFT's adapter_config.json + adapter_model.safetensors) into BASE."),
    "convert": CommandInfo(
        "ckptool.cli.convert", "convert_cmd",
        "Convert checkpoint SRC to DST: torch.save <-> safetensors, sharded sets, torch.distributed.checkpoint."),
    "diff": CommandInfo(
        "ckptool.cli.diff", "diff_cmd",
        "Show what changed between checkpoints A and B, of any formats ckptool reads."),
    "scan": CommandInfo(
        "ckptool.cli.scan", "scan_cmd",
        "Say whether loading each checkpoint in PATHS could run code, without running or importing anything."),
    "extract-state-dict": CommandInfo(
        "ckptool.cli.extract", "extract_cmd",
        "Write the state_dict of a torch.save(model) file SRC, without the model's class and without running it."),
    "sanitize": CommandInfo(
        "ckptool.cli.sanitize", "sanitize_cmd",
        "Turn a checkpoint that torch.load(weights_only=True) refuses into one it accepts, without running it."),
    "verify": CommandInfo(
        "ckptool.cli.verify", "verify_cmd",
        "Check that checkpoint CKPT loads intact into the model --model builds, on DEVICE."),
    "demo": CommandInfo(
        "ckptool.cli.demo", "demo_cmd",
        "Train a small digit classifier and walk the whole checkpoint portability story with it."),
}

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

_DEBUG = "ckptool.debug"  # key in click's Context.meta (shared by the group's context and the command's)

EPILOG = f"""\b
Exit status:
  {EXIT_OK}  success
  {EXIT_FAILURE}  the input was refused or is invalid, or the system refused (out of memory, permission
     denied, disk full, a package missing)
  {EXIT_USAGE}  usage error: bad arguments
  {EXIT_BUG}  internal error: a bug in ckptool; run again with --debug (before or after the command) or
     CKPTOOL_DEBUG=1 for the traceback, and report it
  {EXIT_INTERRUPTED}  interrupted (SIGINT, Ctrl-C); {EXIT_TERMINATED} terminated (SIGTERM): nothing was written
`ckptool scan` has its own: 0 every file safe, 1 a file dangerous, 2 a file unreadable, 4 a file needs trust,
5 a file incomplete (--strict: 0 safe, 1 unsafe, 2 unreadable, 5 incomplete)."""


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[_DEBUG] = True


def _set_timeout(value: float | None) -> None:
    if value is not None:
        set_timeout(value)


def _set_follow_links(on: bool) -> None:
    if on or "ckptool.ops.rewrite.companions" in sys.modules:  # imported only when asked for, or already there
        importlib.import_module("ckptool.ops.rewrite.companions").set_follow_links(on)


def is_debug(ctx: click.Context | None) -> bool:
    """Whether full tracebacks were asked for: ``--debug`` before or after the command, or ``CKPTOOL_DEBUG`` set
    to anything but ``""`` or ``"0"``."""
    if os.environ.get("CKPTOOL_DEBUG", "") not in ("", "0"):
        return True
    return ctx is not None and bool(ctx.meta.get(_DEBUG))


def load_command(info: CommandInfo) -> click.Command:
    """Import the command's module and return its ``click.Command``, with the options every command takes added
    (unless it defines them itself): ``-q/--quiet`` and ``--progress`` (:func:`ckptool.cli._flags.common_options`;
    with ``--quiet`` and without ``--json`` whatever the command prints on stdout is thrown away) and a hidden
    ``--debug`` (so that it is accepted after the command name too)."""
    cmd = getattr(importlib.import_module(info.module), info.attr)
    if not isinstance(cmd, click.Command):
        raise TypeError(f"{info.module}.{info.attr} is a {type(cmd).__name__}, not a click.Command")
    names = {p.name for p in cmd.params}
    if "debug" not in names:
        cmd.params.append(click.Option(["--debug"], is_flag=True, expose_value=False, is_eager=True,
                                       callback=_set_debug, hidden=True,
                                       help="Show the full traceback on error (same as ckptool --debug)."))
    if "quiet" not in names and cmd.callback is not None:
        cmd.params.extend(o for o in common_options() if o.name not in names)
        cmd.callback = _quiet_aware(cmd.callback)
    return cmd


def _quiet_aware(callback: Any) -> Any:
    """``callback`` run with stdout thrown away under ``--quiet`` (unless ``--json`` asked for the JSON object)."""

    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        if is_quiet() and not kwargs.get("as_json"):
            with muted_stdout():
                return callback(*args, **kwargs)
        return callback(*args, **kwargs)

    return run


class Terminated(KeyboardInterrupt):
    """Raised by the SIGTERM handler :func:`main` installs, so that SIGTERM cleans up as Ctrl-C does (a
    KeyboardInterrupt: :func:`ckptool._fileio.atomic_output` removes its temporary file on any exception)."""


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise Terminated()


class OneLineUsageError(click.UsageError):
    """A Click usage error shown as ``Error: MESSAGE`` plus one ``Try 'ckptool CMD --help' for help.`` line,
    without Click's usage line and blank line. ``command_path`` (``"ckptool remap"``) names the command when
    ``ctx`` is not its own context (a :class:`ckptool.errors.UsageError` raised while the command ran)."""

    def __init__(self, message: str, ctx: click.Context | None = None, command_path: str | None = None) -> None:
        super().__init__(message, ctx)
        self.command_path = command_path or (ctx.command_path if ctx is not None else None)

    def show(self, file: IO[Any] | None = None) -> None:
        message = " ".join(self.format_message().split())
        hint = f"\nTry '{self.command_path} --help' for help." if self.command_path else ""
        click.echo(f"Error: {message}{hint}", file=file, err=file is None)


def _one_line(e: click.UsageError) -> OneLineUsageError:
    """``e`` as a :class:`OneLineUsageError` (every Click usage error exits with 2, as ckptool's UsageError does)."""
    return OneLineUsageError(e.format_message(), e.ctx)


@functools.cache
def _error_class(code: int) -> type[click.ClickException]:
    """A ``click.ClickException`` subclass that exits with ``code`` (Click declares ``exit_code`` a class variable)."""
    return type(f"ExitCode{code}Error", (click.ClickException,), {"exit_code": code})


def _committed(out: str) -> bool:
    """Whether the running command put ``out`` in place (:func:`ckptool._commit.was_committed`). A command that never
    imported ``ckptool._commit`` wrote nothing, so the module is looked up, not imported."""
    fio = sys.modules.get("ckptool._commit")
    return fio is not None and bool(fio.was_committed(out))


def _interrupted(ctx: click.Context, e: KeyboardInterrupt) -> click.exceptions.Exit:
    """Print the one ``Interrupted: ...`` line and give the exit that ends the command: 130 / 143 when nothing was
    written; when the signal came after the output was put in place (its commit is atomic with respect to SIGINT
    and SIGTERM: :func:`ckptool._commit.signals_blocked`), ``Interrupted after OUT was written: it is complete``
    and the command's own status, 0 (what was left was its report)."""
    out = output_of(ctx)
    what = "Terminated" if isinstance(e, Terminated) else "Interrupted"
    if out and _committed(out):
        click.echo(f"{what} after {out} was written: it is complete", err=True)
        return click.exceptions.Exit(EXIT_OK)
    click.echo(f"{what}: nothing was written to {out}" if out else what, err=True)
    return click.exceptions.Exit(EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED)


class LazyCommands(MutableMapping[str, click.Command]):
    """``Group.commands`` for :class:`CkptGroup`: names come from a registry and a command's module is imported
    on first access to it. ``name in commands`` and iteration import nothing. Commands added with
    ``add_command`` are kept as given."""

    def __init__(self, registry: Mapping[str, CommandInfo]) -> None:
        self._registry = registry
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        cmd = self._loaded.get(name)
        if cmd is None:
            cmd = self._loaded[name] = load_command(self._registry[name])
        return cmd

    def __setitem__(self, name: str, cmd: click.Command) -> None:
        self._loaded[name] = cmd

    def __delitem__(self, name: str) -> None:
        raise TypeError("ckptool's commands are fixed by ckptool.cli.COMMANDS")

    def __contains__(self, name: object) -> bool:
        return name in self._registry or name in self._loaded

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self._registry) | set(self._loaded)))

    def __len__(self) -> int:
        return len(set(self._registry) | set(self._loaded))


class CkptGroup(click.Group):
    """The ``ckptool`` group: commands loaded from :data:`COMMANDS` when they run, and every exception turned
    into one ``Error: ...`` line with its exit status (:func:`ckptool.cli._errors.describe_error`), unless
    ``--debug`` asked for the traceback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = LazyCommands(COMMANDS)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list of ``--help``: whole summaries from the registry, no command module imported (a
        command added with ``add_command`` shows its own short help)."""
        rows = [(name, COMMANDS[name].summary if name in COMMANDS else self.commands[name].get_short_help_str(200))
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Bare ``ckptool``: the whole help on stdout, exit 0 (as ``git`` does; Click >= 8.2 would print it to
        stderr as a usage error, which :meth:`make_context` folds into one line)."""
        if not args and not ctx.resilient_parsing:
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(EXIT_OK)
        return super().parse_args(ctx, args)

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:  # `ckptool --bad-option`
            raise _one_line(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        fio = sys.modules.get("ckptool._commit")  # a command run before in this process (tests): not this one's
        if fio is not None:
            fio.forget_commits()
        try:
            with consistent_reads():  # one command reads one version of each remote object
                try:
                    return super().invoke(ctx)
                except BaseException:
                    remove_made_folders(ctx)
                    raise
        except click.UsageError as e:  # the command's own arguments, or an unknown command
            raise _one_line(e) from None
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt as e:
            raise _interrupted(ctx, e) from None
        except BrokenPipeError:  # `ckptool inspect ... | head`
            sys.stderr.close()
            raise click.exceptions.Exit(EXIT_OK) from None
        except Exception as e:
            if is_debug(ctx):
                raise
            message, code = describe_error(e)
            if code == EXIT_USAGE:  # ckptool's own UsageError: the same two lines as Click's usage errors
                sub = f" {ctx.invoked_subcommand}" if ctx.invoked_subcommand else ""
                raise OneLineUsageError(message, ctx, command_path=f"{ctx.command_path}{sub}") from e
            raise _error_class(code)(message) from e


@click.group(cls=CkptGroup, context_settings=CONTEXT_SETTINGS, epilog=EPILOG)
@click.version_option(package_name="ckptool")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
              help="Show full tracebacks instead of one-line errors; also accepted after the command "
                   "(or set CKPTOOL_DEBUG=1).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True, max=1e6), default=None, metavar="SECONDS",
              expose_value=False, callback=lambda _c, _p, v: _set_timeout(v),
              help="Seconds an HTTP(S) request may wait to connect or for its next bytes (a range read also fails "
                   "under 64 KiB/s); an object that times out is an error of its own. Default 10, or "
                   "CKPTOOL_TIMEOUT.")
@click.option("--follow-links", is_flag=True, expose_value=False, callback=lambda _c, _p, v: _set_follow_links(v),
              help="Copy a model folder's companion files (config.json, tokenizer files) that are symbolic links "
                   "to regular files outside the folder; default: refused, unless the link stays inside the "
                   "folder or its Hugging Face cache repository. /proc, /sys and /dev stay refused.")
def cli() -> None:
    """Make PyTorch checkpoints portable between machines, devices and model wrappers.

    Inspect what a checkpoint holds without running its code, re-tag its storages for another device
    without a GPU, and fix wrapper prefixes such as DataParallel's `module.`.
    """


def main() -> None:
    """Console-script entry point (``ckptool = ckptool.cli:main``).

    Click prints ``Error: ...`` lines and exits; an exception reaches here only when ``--debug`` asked for it:
    its traceback is printed and the exit status is still the one :func:`ckptool.cli._errors.describe_error`
    gives it. SIGTERM raises :class:`Terminated` (a KeyboardInterrupt), so that it cleans up as Ctrl-C does.
    """
    signal.signal(signal.SIGTERM, _terminate)
    try:
        cli.main(prog_name="ckptool")
    except Exception as e:
        import traceback  # noqa: PLC0415 (only --debug gets here: its import, with linecache and tokenize, is not
        # part of every start-up)

        traceback.print_exc()
        sys.exit(describe_error(e)[1])
    finally:  # the command has finished (click exits through SystemExit): leave what is alive to the exit
        skip_final_collection()
