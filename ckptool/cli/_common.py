"""Options and report helpers shared by several ``ckptool`` commands, each defined once here.

Command modules import from here, never from one another or from :mod:`ckptool.cli` itself.

The scripting conventions live here too: ``--quiet`` and ``--progress`` (added to every command by
:func:`ckptool.cli.load_command`, read with :func:`is_quiet` / :func:`progress_wanted`), ``--json`` with one
versioned schema per command (:func:`json_option`, :func:`emit_json`), ``--force`` and the checks on ``-o``
(:func:`force_option`, :func:`claim_output`), and the one progress bar (:class:`Progress`, tqdm on stderr).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from ckptool import _source as source
from ckptool.cli._flags import is_quiet as is_quiet  # re-exported: command modules import only from here
from ckptool.cli._flags import muted_stdout as muted_stdout
from ckptool.cli._flags import output_folder_for
from ckptool.cli._flags import progress_wanted as progress_wanted
from ckptool.cli._flags import set_output as set_output
from ckptool.errors import CkptError, UsageError
from ckptool.formats.dtypes import EXPAND_FLOOR, MAX_EXPAND
from ckptool.model.devices import DEVICE_HELP, parse_mapping
from ckptool.model.units import human_bytes as human_bytes
from ckptool.model.units import wrote_line

if TYPE_CHECKING:
    from tqdm import tqdm

    from ckptool.ops.rewrite.prefixes import RenameResult  # annotations only: the renaming code loads with its commands
    from ckptool.ops.rewrite.stream import WriteResult

F = TypeVar("F", bound=Callable[..., Any])

#: ``--key`` help of the renaming commands (the others say what their state_dict or module is for)
RENAME_KEY_HELP = ("Dotted path of the state_dict to rename (state_dict, model_state_dict, model, ema.model). "
                   "Default: every state_dict found (optimizer state is never renamed).")


def output_options(f: F) -> F:
    """The ``-o/--output`` (parameter ``dst``), ``--in-place`` and ``--force`` options of every command that
    rewrites a checkpoint into one file."""
    f = force_option(f)
    f = click.option("--in-place", is_flag=True,
                     help="Replace SRC itself (atomically) instead of writing a new file.")(f)
    return click.option("-o", "--output", "dst", type=click.Path(),
                        help="Output file, or a folder (OUT/) to hold it under SRC's name (docs/outputs.md). "
                             "Default: next to SRC with the operation in the name.")(f)


def _shard_jobs(ctx: click.Context, _param: click.Parameter, jobs: int) -> None:
    """``--jobs N``: the command runs in a :func:`ckptool.ops.rewrite.parallel.shard_jobs` block (a pool of N threads
    for the shards of a set), closed with the command's context."""
    if jobs > 1:
        from ckptool.ops.rewrite.parallel import shard_jobs  # noqa: PLC0415 - only for --jobs: not at start-up

        ctx.with_resource(shard_jobs(jobs))


#: ``--jobs N`` of the commands that rewrite sets (:func:`set_output_options`)
SET_JOBS_HELP = ("For a sharded set or a DCP folder: write N shards (.distcp files) at once (threads; the index "
                 "or .metadata is written last, once every shard is written, so an interrupted run leaves no set). "
                 "Default 1.")


def jobs_option(help_text: str = SET_JOBS_HELP) -> Callable[[F], F]:
    """``--jobs N`` / ``-j N`` (no parameter): the command runs inside a
    :func:`ckptool.ops.rewrite.parallel.shard_jobs` block of N threads, where sets are written one shard per task;
    ``help_text`` says what it applies to, for this command."""
    return click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, metavar="N", expose_value=False,
                        callback=_shard_jobs, help=help_text)


def set_output_options(f: F) -> F:
    """:func:`output_options` for the commands that also rewrite sharded sets (``remap``, the prefix commands):
    ``-o`` may name a folder, which holds the rewritten set; ``--jobs N`` writes N shards of a set at once."""
    f = force_option(f)
    f = jobs_option()(f)
    f = click.option("--in-place", is_flag=True,
                     help="Replace SRC itself (atomically) instead of writing a new file (not for sharded sets).")(f)
    return click.option("-o", "--output", "dst", type=click.Path(),
                        help="Output file, or a folder (OUT/) to hold it under SRC's name (docs/outputs.md). "
                             "Default: next to SRC with the operation in the name. For a sharded set "
                             "(*.index.json or its folder): a folder (created), or NAME.safetensors.index.json / "
                             "NAME.bin.index.json; for a model folder holding one weights file: a folder (created; "
                             "the other files copied), or a file name (that file alone); default for both: the "
                             "folder <folder>.<operation> beside it.")(f)


def key_option(help_text: str = RENAME_KEY_HELP) -> Callable[[F], F]:
    """``--key PATH`` (parameter ``key``, default ``None``): the dotted path of a state_dict or module in the
    file; ``help_text`` says which, for this command."""
    return click.option("--key", metavar="PATH", default=None, help=help_text)


def max_expand_option(f: F) -> F:
    """``--max-expand FACTOR`` (parameter ``max_expand``, default None: :data:`ckptool.formats.tensors.MAX_EXPAND`):
    the budget of the commands that make tensors dense (:mod:`ckptool.readers.budget`)."""
    return click.option(
        "--max-expand", "max_expand", metavar="FACTOR", type=float, default=None,
        help=f"Refuse tensors whose dense size is more than FACTOR times the bytes their storages hold in the "
             f"input (a view saved over a few bytes: expand(), broadcasting, a DCP .metadata declaring more than "
             f"its records hold), beyond {human_bytes(EXPAND_FLOOR)}. Default: {MAX_EXPAND:g}; 0: no limit.")(f)


def device_options(f: F) -> F:
    """``--to DEVICE`` (parameter ``to``) and ``--map FROM=TO`` (parameter ``maps``, repeatable): the location-tag
    rewrite of every command that writes a torch checkpoint, applied in its one streaming pass
    (:func:`ckptool.model.devices.location_function`; turn ``maps`` into a dict with :func:`mapping_of`)."""
    f = click.option("--map", "maps", metavar="FROM=TO", multiple=True,
                     help="Re-tag only storages tagged FROM (repeatable); a bare type such as cuda matches every "
                          "index. A FROM that matches no storage is an error (see --allow-missing).")(f)
    return click.option("--to", "to", metavar="DEVICE",
                        help=f"Tag every storage for DEVICE ({DEVICE_HELP}); --to cpu gives a file that a plain "
                             "torch.load opens without a GPU. Default: the tags as saved.")(f)


def mapping_of(maps: tuple[str, ...]) -> dict[str, str] | None:
    """The ``--map`` values as ``{"cuda:1": "cuda:0"}`` (None when none was given).

    Raises:
        UsageError: an item without ``=`` or with a bad device.
    """
    return parse_mapping(list(maps)) if maps else None


def allow_missing_option(f: F) -> F:
    """``--allow-missing``: write the file even when a prefix or a ``--map`` source matches nothing."""
    return click.option(
        "--allow-missing", is_flag=True,
        help="Write the output even when no key carries the prefix or no storage carries a --map source tag "
             "(default: exit with an error, write nothing).",
    )(f)


def allow_nested_option(f: F) -> F:
    """``--allow-nested``: add a prefix even in front of keys that already carry it."""
    return click.option(
        "--allow-nested", is_flag=True,
        help="Add the prefix even to keys that already start with it (module.module.fc.weight); default: exit "
             "with an error, write nothing.",
    )(f)


def report_write(dst: str, bytes_written: int, detail: str) -> None:
    """Print ``Wrote DST (SIZE, DETAIL)``: the line every rewriting command ends its report with."""
    click.echo(wrote_line(dst, bytes_written, detail))


def report_kept(res: object) -> None:
    """Print ``kept: config.json, tokenizer.json, ...``: the files of a model folder a rewrite of its set copied
    beside the new set (the result's ``kept``, :class:`ckptool.ops.rewrite.sets.SetFilesResult`); nothing when
    none were."""
    kept = getattr(res, "kept", None)
    if kept:
        click.echo(f"kept: {', '.join(kept)}")


def renamed_state_dict(res: RenameResult) -> str | None:
    """The dotted path of the one state_dict a rename changed (a mapping, not a pickled module), for the load
    hint's ``model.load_state_dict(...[path])``; None when it changed several, or a module."""
    if len(res.state_dicts) != 1 or any(c.is_module for c in res.changes):
        return None
    return res.state_dicts[0]


def report_rename(res: RenameResult) -> None:
    """Print what a rename did: one line per selected state_dict, then the wrappers removed from a full model."""
    for ch in res.changes:
        what = "pickled module" if ch.is_module else "state_dict"
        if not ch.renamed:
            click.echo(f"{what} {ch.label}: {ch.keys} keys, unchanged (no key to rename)")
            continue
        parts = []
        if ch.removed:
            parts.append("removed " + ", ".join(f"{c} ({n})" for c, n in ch.removed.items()))
        if ch.added:
            parts.append("added " + ", ".join(f"{c} ({n})" for c, n in ch.added.items()))
        click.echo(f"{what} {ch.label}: renamed {ch.renamed} of {ch.keys} keys; " + "; ".join(parts))
        if ch.wrappers_removed:
            click.echo(f"  replaced wrapper object(s) by the module they hold: {', '.join(ch.wrappers_removed)}")


# ------------------------------------------------------------------------------------------------ --json
#: the version of a ``--json`` schema (``"schema": "ckptool.<command>/1"``); raised when a field changes meaning
#: or goes away (new fields keep the version): :data:`SCHEMA_VERSIONS` lists the commands past 1 (CHANGELOG.md)
SCHEMA_VERSION = 1
#: the commands whose ``--json`` schema is past :data:`SCHEMA_VERSION`: scan and report 2 (one ``verdict``, the
#: ``level`` / ``unsafe`` words gone), diff 2 (a quantized side compared after dequantization: its scales leave
#: ``only_a``; :data:`ckptool.ops.diff.result.SCHEMA`)
SCHEMA_VERSIONS: dict[str, int] = {"scan": 2, "report": 2, "diff": 2}


def schema_name(command: str) -> str:
    """``ckptool.<command>/<version>``, the ``"schema"`` of ``command``'s ``--json`` object."""
    return f"ckptool.{command}/{SCHEMA_VERSIONS.get(command, SCHEMA_VERSION)}"


def json_option(command: str, *, dry_run: str | None = None) -> Callable[[F], F]:
    """``--json`` (parameter ``as_json``): print one JSON object of schema ``ckptool.<command>/1`` instead of the
    report (see :func:`emit_json`); ``dry_run``: the command whose schema a ``--dry-run`` prints, named in the help
    too."""
    also = f" (with --dry-run \"{schema_name(dry_run)}\")" if dry_run else ""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print one JSON object instead of the report: \"schema\": "
                             f"\"{schema_name(command)}\"{also} plus the result fields.")


def emit_json(command: str, payload: dict[str, Any]) -> None:
    """Print ``{"schema": "ckptool.<command>/1", **payload}`` on stdout (also with ``--quiet``); a value JSON has no
    type for (a path) is written as its string."""
    click.echo(json.dumps({"schema": schema_name(command), **payload}, indent=2, default=str))


def retagged_list(retagged: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
    """``{(old, new): n}`` as ``[{"from": old, "to": new, "storages": n}, ...]`` (sorted) for JSON."""
    return [{"from": a, "to": b, "storages": n} for (a, b), n in sorted(retagged.items())]


def write_payload(res: WriteResult, rename: RenameResult | None = None) -> dict[str, Any]:
    """The JSON fields of a rewrite (``remap``, the prefix commands): ``src``, ``dst``, ``format_in``, ``storages``,
    ``bytes_written`` (bytes), ``retagged`` (:func:`retagged_list`) and, for a renaming (``rename``: ``res``
    itself when it is a :class:`~ckptool.ops.rewrite.prefixes.RenameResult`, which the caller knows), ``renamed``
    (keys),
    ``removed`` / ``added`` ``{prefix: keys}`` and ``changes`` (one object per state_dict: ``path``, ``keys``,
    ``renamed``, ``removed``, ``added``, ``is_module``, ``wrappers_removed``)."""
    out: dict[str, Any] = {"src": res.src, "dst": res.dst, "format_in": res.format_in, "storages": res.storages,
                           "bytes_written": res.bytes_written, "retagged": retagged_list(res.retagged)}
    if rename is not None:
        out.update(renamed=rename.renamed, removed=rename.removed, added=rename.added,
                   changes=[{"path": c.path, "keys": c.keys, "renamed": c.renamed, "removed": c.removed,
                             "added": c.added, "is_module": c.is_module, "wrappers_removed": c.wrappers_removed}
                            for c in rename.changes])
    return out


# ------------------------------------------------------------------------------------------------ -o / --force
def force_option(f: F) -> F:
    """``--force``: replace an existing output file (default: refuse it, write nothing)."""
    return click.option("--force", is_flag=True,
                        help="Replace the output if it exists (default: refuse, write nothing).")(f)


def refuse_stdout(dst: str | None, why: str) -> None:
    """Refuse ``-o -`` for an output that cannot be streamed; ``why`` says why (it ends the message).

    Raises:
        UsageError: ``dst`` is ``-``.
    """
    if dst == "-":
        raise click.UsageError(f"-o - (stdout) is not supported: {why}; write to a file and read that instead")


#: why a torch zip cannot go to stdout
ZIP_NEEDS_SEEK = ("torch's zip format is written with seeks (record headers are patched and the central "
                  "directory points back into the file)")


def claim_output(path: str, *, force: bool, in_place: bool = False, given: str | None = None) -> str:
    """Check the output ``path`` a command is about to write and remember it for the ``Interrupted: ...`` line.

    An existing file is refused unless ``force`` (or ``in_place``: the source is the output by request). ``given``:
    the user's ``-o`` when the command already resolved it to ``path`` (a rewrite of one file into the folder
    ``-o NAME/``: :func:`ckptool.ops.rewrite.stream.output_path`); that folder is made when missing, and removed
    again when the command fails.

    Raises:
        UsageError: ``path`` exists and neither ``force`` nor ``in_place`` was given.
    """
    # the output resolver loads with the writing commands only, not with scan or inspect
    from ckptool.writers import Output, is_folder_form, refuse_replacing  # noqa: PLC0415

    refuse_replacing(Output(path, path, None, None), force=force or in_place)
    if given is not None and is_folder_form(given) and not is_folder_form(path):
        output_folder_for(path)
    set_output(path)
    return path


def check_output(path: str, *, force: bool, in_place: bool = False) -> str:
    """What :func:`claim_output` checks of ``path`` for a dry run, which writes nothing: an existing file is refused
    unless ``force`` or ``in_place``, so that a dry run exits as the run would. Returns ``path``.

    Raises:
        UsageError: ``path`` exists and neither ``force`` nor ``in_place`` was given.
    """
    from ckptool.writers import Output, refuse_replacing  # noqa: PLC0415 - writing commands only

    refuse_replacing(Output(path, path, None, None), force=force or in_place)
    return path


def claim_set(dst: str, *, force: bool, source_is_folder: bool = False) -> str:
    """Check the output ``dst`` of a command that writes a folder itself when ``dst`` names one (``merge-lora``):
    in a folder, the set named as the format's ``model.safetensors`` / ``pytorch_model.bin`` must not be there
    unless ``force`` (other files in the folder are never touched); a file is checked as :func:`claim_output`
    does. Returns ``dst``.

    Raises:
        UsageError: something would be replaced and ``force`` was not given; a suffix that names no format.
    """
    from ckptool.writers import refuse_replacing, resolve_output  # noqa: PLC0415 - writing commands only

    out = resolve_output(dst, source_is_folder=source_is_folder)
    refuse_replacing(out, force=force)
    set_output(dst)
    return dst


def claim_target(dst: str, *, force: bool, file_name: str | None = None, fmt: str | None = None,
                 default_format: str | None = None, checkpoint: bool = True) -> str:
    """Resolve the user's ``-o dst`` (:func:`ckptool.writers.resolve_output`, the rules of ``docs/outputs.md``),
    check it as :func:`claim_output` does and return the file to write.

    A ``dst`` that names a folder (``out/``, an existing folder, a name without suffix) holds the file
    ``file_name`` (default: the format's ``model.safetensors`` / ``pytorch_model.bin``), the folder made when
    missing (and removed again when the command fails). An existing file, or in a folder a file of the set of that
    name, is refused unless ``force``; other files in the folder are never touched.

    Raises:
        UsageError: something would be replaced and ``force`` was not given; a folder holding a sharded set of
            the file's name (one file cannot replace it whole, even with ``force``); a suffix that names no format
            (with ``checkpoint``: the output is a checkpoint).
    """
    from ckptool.writers import refuse_replacing, resolve_output, set_members  # noqa: PLC0415 - writing only

    out = resolve_output(dst, fmt=fmt, file_name=file_name, default_format=default_format, checkpoint=checkpoint)
    if out.folder is not None and out.path != out.folder:
        name = os.path.basename(out.path)
        shards = [n for n in set_members(out.folder, name) if n != name]
        if shards:  # one file cannot replace a set atomically: its shards and index would stay beside it
            raise UsageError(f"{out.folder} holds a sharded set named {name} ({', '.join(shards[:3])}"
                             f"{' ...' if len(shards) > 3 else ''}), which this command, writing one file, cannot "
                             "replace whole; remove it or choose another -o path")
    refuse_replacing(out, force=force)
    if out.folder is not None and out.path != out.folder:
        output_folder_for(out.path)
    set_output(out.path)
    return out.path


# ------------------------------------------------------------------------------------------------ progress
#: a command shows a progress bar when it reads or writes more than this many bytes (and :func:`progress_wanted`)
PROGRESS_MIN = 64 << 20


class Progress:
    """The progress bar of every command: bytes done of ``total``, throughput and ETA (tqdm, on stderr).

    Call it with the bytes done since the last call (the library's one ``progress(nbytes)`` convention); an
    operation whose total is not the input's size sets :attr:`total` before its first call
    (:func:`ckptool.ops.rewrite.stream.announce_total`). Nothing is shown unless :func:`progress_wanted` and the total
    is more
    than :data:`PROGRESS_MIN`. Use it as a context manager (the bar is closed on exit, also on an error).
    """

    def __init__(self, label: str, total: int | None = None) -> None:
        self.label = label
        self.total = total
        self.enabled = progress_wanted()
        self.bar: tqdm[NoReturn] | None = None  # NoReturn: typing.Never is 3.11+
        self.done = 0

    def _start(self) -> bool:
        if not self.enabled or self.total is None or self.total <= PROGRESS_MIN:
            self.enabled = False
            return False
        from tqdm import tqdm  # here: most runs show no bar, and importing tqdm costs a few hundredths of a second

        self.bar = tqdm(total=self.total, desc=self.label, unit="B", unit_scale=True, unit_divisor=1024,
                        file=sys.stderr, dynamic_ncols=True, mininterval=0.2, leave=True)
        return True

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is None and not self._start():
            return
        assert self.bar is not None
        self.bar.update(nbytes)

    def close(self) -> None:
        """Close the bar (it stays on the screen, its line ended)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def source_size(path: str) -> int | None:
    """The size in bytes of file ``path`` (the total of a rewrite's progress bar), None for a folder or a file
    that cannot be read (the command reports that itself)."""
    try:
        if source.is_url(path):
            return source.file_size(path) if source.kind(path) == "file" else None
        return os.path.getsize(path) if os.path.isfile(path) else None
    except (OSError, CkptError):
        return None



def usable_cpus() -> int:
    """The CPUs this process may run on (``os.sched_getaffinity``: a container's or ``taskset``'s limit, not the
    machine's count), else ``os.cpu_count()``; at least 1. The default of ``scan --jobs``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1
