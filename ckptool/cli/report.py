"""``ckptool report``: a checkpoint, or two compared, as one self-contained HTML page (a thin command over
:func:`ckptool.ops.diff.report.report`)."""

from __future__ import annotations

import os

import click

from ckptool.cli._common import claim_target, emit_json, force_option, human_bytes, json_option, max_expand_option
from ckptool.ops.diff.report import report


def default_output(a: str) -> str:
    """``model.pth`` -> ``model.report.html`` in the current folder (a URL's or folder's last name is used)."""
    name = os.path.basename(a.rstrip("/")) or "checkpoint"
    stem = name.split(".")[0] or name
    return f"{stem}.report.html"


@click.command("report")
@click.argument("a", type=click.Path(dir_okay=True))
@click.argument("b", type=click.Path(dir_okay=True), required=False)
@click.option("-o", "--output", "dst", metavar="OUT", help="The page to write, or a folder (OUT/) to hold "
              "it. Default: A's name up to its first dot + .report.html, in the current folder (model.pth -> "
              "model.report.html).")
@force_option
@max_expand_option
@json_option("report")
def report_cmd(a: str, b: str | None, dst: str | None, force: bool, max_expand: float | None,
               as_json: bool) -> None:
    """Write one self-contained HTML page about checkpoint A, or comparing A with B.

    The page (CSS and JavaScript inline; it opens from disk in any current browser, with no network) shows the
    format, kind, size, parameters and bytes by dtype and by saved device, wrapper prefixes with the command that
    removes them, the safety verdict (the analysis of `ckptool scan`), the non-tensor entries, a collapsible
    module tree with repeated blocks folded (layers.0-31 x32) and a search box, and a treemap of the bytes by
    module coloured by dtype. With B: every key as equal, value change, shape or dtype change, or on one side
    only, and per module the relative change ||B - A|| / ||A|| as bars (every tensor of both is streamed once;
    needs numpy). Nothing from either file is run, and without B no tensor data is read. With --json the page
    is written too, and what it summarises is printed as one JSON object.

    \b
    Examples:
      ckptool report model.pth -o model.html
      ckptool report base.safetensors finetuned.safetensors -o what-moved.html
      ckptool report base.pth tuned.pth --json    # the page, and its figures as JSON
    """
    out = claim_target(dst or default_output(a), force=force, file_name=default_output(a), checkpoint=False)
    res = report(a, b, dst=out, max_expand=max_expand)
    if as_json:
        emit_json("report", {"dst": res.dst, "bytes_written": res.bytes_written, "seconds": round(res.seconds, 3),
                             "compared": res.compared, **res.figures})
        return
    click.echo(f"Wrote {res.dst} ({human_bytes(res.bytes_written)}, {res.tensors} tensors"
               f"{', compared with ' + b if b else ''}, in {res.seconds:.1f} s)")
    click.echo(f"Open it in a browser: file://{os.path.abspath(res.dst)}")
