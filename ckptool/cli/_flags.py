"""The flags every ``ckptool`` command accepts, whatever defines it: ``-q/--quiet`` and ``--progress``.

:func:`ckptool.cli.load_command` adds them to each command (unless it defines its own); their values live in the
Click context's ``meta`` (shared by the group's context and the command's), read with :func:`is_quiet` and
:func:`progress_wanted`. Kept apart from :mod:`ckptool.cli._common` so that starting ``ckptool`` imports no
library operation.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import click

QUIET = "ckptool.quiet"  # keys in click's Context.meta
PROGRESS = "ckptool.progress"
OUTPUT = "ckptool.output"  # the file a command writes, named in the "Interrupted: ..." line
MADE = "ckptool.made-folders"  # output folders a command made for its file, removed when it fails

#: set to anything but "" or "0" to turn the progress bar off
NO_PROGRESS_ENV = "CKPTOOL_NO_PROGRESS"


def _remember(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and param.name:
        ctx.meta[f"ckptool.{param.name}"] = True


def common_options() -> list[click.Option]:
    """New ``-q/--quiet`` and ``--progress`` options (not passed to the callback; see the module docstring)."""
    return [
        click.Option(["-q", "--quiet"], is_flag=True, expose_value=False, is_eager=True, callback=_remember,
                     help="Print nothing but errors (and, with --json, the JSON); no progress bar."),
        click.Option(["--progress"], is_flag=True, expose_value=False, is_eager=True, callback=_remember,
                     help=f"Show the progress bar even when stderr is not a terminal (default: on a terminal, for "
                          f"more than 64 MiB, unless {NO_PROGRESS_ENV}=1)."),
    ]


def _ctx() -> click.Context | None:
    return click.get_current_context(silent=True)


def is_quiet() -> bool:
    """Whether ``--quiet`` was given to the running command."""
    ctx = _ctx()
    return ctx is not None and bool(ctx.meta.get(QUIET))


def progress_wanted() -> bool:
    """Whether the running command shows a progress bar: always with ``--progress``; never with ``--quiet`` or
    ``CKPTOOL_NO_PROGRESS`` set (to anything but ``""`` / ``"0"``); otherwise when stderr is a terminal."""
    ctx = _ctx()
    if ctx is not None and ctx.meta.get(PROGRESS):
        return True
    if is_quiet() or os.environ.get(NO_PROGRESS_ENV, "") not in ("", "0"):
        return False
    return sys.stderr.isatty()


@contextlib.contextmanager
def muted_stdout() -> Iterator[None]:
    """Throw away what is printed to stdout inside the block (``--quiet``; a report replaced by ``--json``)."""
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        yield


def set_output(path: str) -> None:
    """Record ``path`` as the file the running command writes (for the ``Interrupted: ...`` line)."""
    ctx = _ctx()
    if ctx is not None:
        ctx.meta[OUTPUT] = path


def output_of(ctx: click.Context) -> str | None:
    """The file the command of ``ctx`` writes, once it has said (:func:`set_output`)."""
    out = ctx.meta.get(OUTPUT)
    return out if isinstance(out, str) else None


def output_folder_for(path: str) -> None:
    """Make the missing folder that holds the output file ``path`` (``-o NAME/`` names a new folder), remembered so
    that a failed command removes it again (:func:`remove_made_folders`): a failed run leaves nothing behind.

    Raises:
        OutputError: the folder cannot be made.
    """
    from ckptool._fileio import make_output_folder  # noqa: PLC0415 - only commands that write a new folder

    folder = os.path.dirname(path)
    if not folder or os.path.isdir(folder):
        return
    make_output_folder(folder)
    ctx = _ctx()
    if ctx is not None:
        ctx.meta.setdefault(MADE, []).append(folder)


def remove_made_folders(ctx: click.Context) -> None:
    """Remove the output folders :func:`output_folder_for` made, when they are still empty (the command failed)."""
    for folder in reversed(ctx.meta.pop(MADE, [])):
        with contextlib.suppress(OSError):
            os.rmdir(folder)
