"""``ckptool scan``: whether loading a checkpoint could run code, from the globals its pickles name (a thin
command over :func:`ckptool.ops.scan.scan`; nothing is imported or run from the files, torch is not imported)."""

from __future__ import annotations

import json

import click

from ckptool.ops.scan import ScanResult, scan


def _print_result(res: ScanResult, show_all: bool) -> None:
    from tabulate import tabulate

    verdict = {"safe": "safe", "unsafe": "UNSAFE", "error": "ERROR"}[res.verdict]
    n_pickles = len(res.pickles)
    head = (f"{res.path}: {verdict} ({res.format}, {n_pickles} pickle{'s' if n_pickles != 1 else ''}, "
            f"{len(res.globals)} global{'s' if len(res.globals) != 1 else ''}")
    bad = res.unsafe
    head += f", {len(bad)} not allowed)" if bad else ")"
    click.echo(head)
    rows = [(g.status.upper() if g.status == "dangerous" else g.status, g.name, g.reason if g.status != "unknown"
             else "loading would import and call it", ", ".join(g.where))
            for g in (res.globals if show_all else bad)]
    if rows:
        click.echo(tabulate(rows, headers=["status", "global", "why", "in"]))
    if res.error:
        click.echo(f"  error: {res.error}")
    for p in res.pickles:
        if p.error:
            click.echo(f"  error in {p.where}: {p.error}")
    for note in res.notes:
        click.echo(f"  note: {note}")


@click.command("scan")
@click.argument("paths", nargs=-1, required=True, type=click.Path(dir_okay=True))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per file (a JSON list) instead of text.")
@click.option("--all", "show_all", is_flag=True, help="List allowed globals too, not only the ones that are not.")
@click.pass_context
def scan_cmd(ctx: click.Context, paths: tuple[str, ...], as_json: bool, show_all: bool) -> None:
    """Say whether loading each checkpoint in PATHS could run code, without running or importing anything.

    Every pickle in each file is read (zip members such as data.pkl and other .pkl files, nested zips, the five
    pickles of a legacy stream, legacy tar members, plain pickles whatever their name, TorchScript pickles, and
    pickles or zips appended after the data), and every global it would import is classified:

    \b
      allowed    torch.load(weights_only=True) accepts it (in a TorchScript archive, also the
                 __torch__.* types torch.jit.load resolves itself)
      dangerous  a known process, file, network, import or eval gadget (os.system, builtins.eval,
                 subprocess.Popen, functools.partial, torch.load, ...): the list only explains
      unknown    anything else, such as a model class: loading would import and call it

    A file is safe only when every global is allowed. Directories are walked for checkpoint files.
    Exit status: 0 when every file is safe, 1 when any file is unsafe, 2 when a file could not be read
    (and none is unsafe).

    \b
    Examples:
      ckptool scan model.pth
      ckptool scan ~/Downloads/*.bin --json
      ckptool scan checkpoints/
    """
    results = scan(paths)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        for i, r in enumerate(results):
            if i:
                click.echo("")
            _print_result(r, show_all)
        if len(results) > 1:
            counts = {v: sum(r.verdict == v for r in results) for v in ("safe", "unsafe", "error")}
            click.echo("")
            click.echo(f"{len(results)} files: {counts['safe']} safe, {counts['unsafe']} unsafe, "
                       f"{counts['error']} unreadable")
        elif not results:
            click.echo("no checkpoint files found")
    codes = [r.exit_code for r in results]
    ctx.exit(1 if 1 in codes else 2 if 2 in codes else 0)
