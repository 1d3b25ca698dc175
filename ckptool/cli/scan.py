"""``ckptool scan`` and ``ckptool extract-state-dict``.

Registered on :data:`ckptool.cli.cli` when ``ckptool.cli`` is imported. Neither command imports torch to read a
file; ``extract-state-dict`` imports it only to write safetensors or with ``--trust``.
"""

from __future__ import annotations

import json
from typing import Any

import click

from ckptool.cli import cli, human_bytes


def _print_result(res: Any, show_all: bool) -> None:
    from tabulate import tabulate

    verdict = {"safe": "safe", "unsafe": "UNSAFE", "error": "ERROR"}[res.verdict]
    n_pickles = len(res.pickles)
    head = f"{res.path}: {verdict} ({res.format}, {n_pickles} pickle{'s' if n_pickles != 1 else ''}, " \
           f"{len(res.globals)} global{'s' if len(res.globals) != 1 else ''}"
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


@cli.command("scan")
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
    from ckptool.ops.scan import scan

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


@cli.command("extract-state-dict")
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "dst", type=click.Path(dir_okay=False),
              help="Output file: *.safetensors for safetensors, anything else for torch's format. "
                   "Default: SRC's stem + .state_dict.pth.")
@click.option("--key", metavar="PATH", help="Dotted path of the module in the file when it is not the top level "
                                            "(e.g. model).")
@click.option("--unwrap", "unwrap_keys", is_flag=True,
              help="Remove wrapper components from the keys (module. of DataParallel/DDP, _orig_mod. of "
                   "torch.compile, ...).")
@click.option("--to", "to", metavar="DEVICE", help="Re-tag every storage for DEVICE (cpu, cuda:N, ...) in a .pth "
                                                   "output. Default: as saved.")
@click.option("--trust", is_flag=True,
              help="Load SRC with torch.load(weights_only=False), which imports its classes and RUNS ITS CODE, and "
                   "call the module's own state_dict(). Only for files from a source you trust.")
def extract_cmd(src: str, dst: str | None, key: str | None, unwrap_keys: bool, to: str | None, trust: bool) -> None:
    """Write the state_dict of a torch.save(model) file SRC, without the model's class and without running it.

    The pickled module tree is walked as nn.Module.state_dict() would walk it: parameters and persistent
    buffers of each module, then its submodules, detached, with _metadata; the classes are never imported and
    nothing from the file runs. Tensor bytes are copied, not decoded (.pth), or read with torch (.safetensors).
    Modules whose state_dict needs their own code (quantized or lazy modules, state_dict hooks) are refused:
    --trust loads the file with torch.load(weights_only=False) instead, which runs its code.

    \b
    Examples:
      ckptool extract-state-dict model.pth -o model.sd.pth
      ckptool extract-state-dict dp_model.pth -o model.safetensors --unwrap
      ckptool extract-state-dict ckpt.pth --key model --to cpu
    """
    from ckptool.ops.extract import extract_state_dict

    res = extract_state_dict(src, dst, key=key, unwrap=unwrap_keys, to=to, trust=trust)
    where = f" at {res.path}" if res.path else ""
    click.echo(f"Wrote {res.dst} ({res.format}, {human_bytes(res.bytes_written)}): {len(res.keys)} tensors from "
               f"{res.module}{where}, {res.storages} storages" + (" [trusted: the file's code ran]" if res.trusted
                                                                 else "; nothing from the file was imported or run"))
    if res.removed:
        click.echo("Removed wrapper components: "
                   + ", ".join(f"{c}. ({n} keys)" for c, n in sorted(res.removed.items())))
    if res.format == "safetensors":
        click.echo(f"Load it with: safetensors.torch.load_file({res.dst!r})")
    else:
        click.echo(f"Load it with: torch.load({res.dst!r}, weights_only=True"
                   + (")" if to or res.trusted else ", map_location='cpu')"))
