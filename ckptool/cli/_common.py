"""Options and report helpers shared by several ``ckptool`` commands, each defined once here.

Command modules import from here, never from one another or from :mod:`ckptool.cli` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ckptool.model.devices import DEVICE_HELP, chosen_tags, parse_mapping
from ckptool.ops.hints import load_hint

if TYPE_CHECKING:
    from ckptool.ops.rename import RenameResult

F = TypeVar("F", bound=Callable[..., Any])

#: ``--key`` help of the renaming commands (the others say what their state_dict or module is for)
RENAME_KEY_HELP = ("Dotted path of the state_dict to rename (state_dict, model_state_dict, model, ema.model). "
                   "Default: every state_dict found (optimizer state is never renamed).")


def output_options(f: F) -> F:
    """The ``-o/--output`` (parameter ``dst``) and ``--in-place`` options of every command that rewrites a
    checkpoint into one file."""
    f = click.option("--in-place", is_flag=True,
                     help="Replace SRC itself (atomically) instead of writing a new file.")(f)
    return click.option("-o", "--output", "dst", type=click.Path(dir_okay=False),
                        help="Output file. Default: next to SRC with the operation in the name.")(f)


def key_option(help_text: str = RENAME_KEY_HELP) -> Callable[[F], F]:
    """``--key PATH`` (parameter ``key``, default ``None``): the dotted path of a state_dict or module in the
    file; ``help_text`` says which, for this command."""
    return click.option("--key", metavar="PATH", default=None, help=help_text)


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


def report_hint(path: str, *, state_dict: str | None = None, to: str | None = None,
                maps: tuple[str, ...] = ()) -> None:
    """Print the notes and the ``Load it with: ...`` line that :func:`ckptool.ops.hints.load_hint` derives from the
    file written at ``path`` (``state_dict``: dotted path to load into a model; ``to`` / ``maps``: the tags the user
    chose)."""
    hint = load_hint(path, state_dict=state_dict, chosen=chosen_tags(to, mapping_of(maps)))
    for note in hint.notes:
        click.echo(f"Note: {note}")
    click.echo(f"Load it with: {hint.code}")


def human_bytes(n: int) -> str:
    """A size in bytes in binary units: ``1536`` -> ``1.5 KiB``, ``100`` -> ``100 B``."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def report_write(dst: str, bytes_written: int, detail: str) -> None:
    """Print ``Wrote DST (SIZE, DETAIL)``: the line every rewriting command ends its report with."""
    click.echo(f"Wrote {dst} ({human_bytes(bytes_written)}, {detail})")


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
