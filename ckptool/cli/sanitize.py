"""``ckptool sanitize``: make a checkpoint that ``torch.load(weights_only=True)`` refuses load with it, without
running the file (a thin command over :func:`ckptool.ops.sanitize.sanitize`)."""

from __future__ import annotations

import click

from ckptool.cli._common import (
    ZIP_NEEDS_SEEK,
    Progress,
    allow_missing_option,
    check_output,
    claim_output,
    device_options,
    emit_json,
    json_option,
    mapping_of,
    output_options,
    refuse_stdout,
    retagged_list,
    source_size,
)
from ckptool.cli._errors import ckpt_exit_code
from ckptool.cli._hints import hint_for, hint_payload, report_hint
from ckptool.ops.sanitize import Conversion, SanitizeDryRun, sanitize, sanitize_dry_run, sanitize_output


@click.command("sanitize")
@click.argument("src", type=click.Path(dir_okay=True))  # a folder gets the reader's advice
@output_options
@device_options
@allow_missing_option
@click.option("--drop-unknown", is_flag=True,
              help="Leave out what no rule converts (listed) instead of refusing the file.")
@click.option("--dry-run", is_flag=True,
              help="Say what the file is (format, kind, tensors, scan's verdict) and what a run would convert, drop "
                   "or refuse; write nothing. Exits as the run would.")
@json_option("sanitize", dry_run="sanitize-dry-run")
def sanitize_cmd(src: str, dst: str | None, in_place: bool, force: bool, to: str | None, maps: tuple[str, ...],
                 allow_missing: bool, drop_unknown: bool, dry_run: bool, as_json: bool) -> None:
    """Turn a checkpoint that torch.load(weights_only=True) refuses into one it accepts, without running it.

    SRC is read without importing or running anything from it. numpy arrays and scalars become tensors
    (dtype, shape and values kept), numpy dtypes the torch dtype of the same name, argparse.Namespace and
    other plain records dicts, pathlib paths strings, and a pickled nn.Module (torch.save(model)) its
    state_dict. Anything else outside torch's weights_only allowlist is named with its key path and nothing
    is written, unless --drop-unknown leaves it out. The output is torch's zip format; existing tensor bytes
    are copied, not decoded.

    \b
    Examples:
      ckptool sanitize train.pth -o train.safe.pth
      ckptool sanitize gpu_run.ckpt -o portable.pth --to cpu
      ckptool sanitize model_full.pth -o model.sd.pth --drop-unknown
      ckptool sanitize train.pth --dry-run --json
    """
    refuse_stdout(dst, ZIP_NEEDS_SEEK)
    if dry_run:
        check_output(sanitize_output(src, dst, in_place), force=force, in_place=in_place)
        plan = sanitize_dry_run(src, dst, to=to, mapping=mapping_of(maps), allow_missing=allow_missing,
                                drop_unknown=drop_unknown, in_place=in_place)
        if as_json:
            emit_json("sanitize-dry-run", _dry_run_payload(plan))
        else:
            click.echo(plan)
        if plan.error is not None:  # the run's error line and exit status
            raise plan.error
        return
    out = claim_output(sanitize_output(src, dst, in_place), force=force, in_place=in_place, given=dst)
    with Progress("sanitize", source_size(src)) as bar:
        res = sanitize(src, out, to=to, mapping=mapping_of(maps), allow_missing=allow_missing,
                       drop_unknown=drop_unknown, in_place=in_place, progress=bar)
    if as_json:
        emit_json("sanitize", {
            "src": res.src, "dst": res.dst, "format_in": res.format_in, "converted": _conversions(res.converted),
            "dropped": _conversions(res.dropped), "storages": res.storages, "new_storages": res.new_storages,
            "bytes_written": res.bytes_written, "devices": res.devices, "retagged": retagged_list(res.retagged),
            **hint_payload(hint_for(res.dst, to=to, maps=maps))})
        return
    click.echo(res)
    report_hint(res.dst, to=to, maps=maps)


def _conversions(items: list[Conversion], *, levels: bool = False) -> list[dict[str, str]]:
    """Each conversion as JSON; ``levels``: with the scan level of a global no rule converts (``""``: none)."""
    return [{"path": c.path, "kind": c.kind, "source": c.source, "detail": c.detail,
             **({"level": c.level} if levels else {})} for c in items]


def _dry_run_payload(plan: SanitizeDryRun) -> dict[str, object]:
    """The ``ckptool.sanitize-dry-run/1`` object: what the file is, what a run would do, and how it would end."""
    return {
        "src": plan.src, "dst": plan.dst, "format": plan.format, "kind": plan.kind, "tensors": plan.tensors,
        "verdict": plan.verdict, "would_write": plan.error is None,
        "converted": _conversions(plan.converted), "dropped": _conversions(plan.dropped, levels=True),
        "unconverted": _conversions(plan.unconverted, levels=True), "storages": plan.storages,
        "new_storages": plan.new_storages, "devices": plan.devices, "retagged": retagged_list(plan.retagged),
        "error": None if plan.error is None else str(plan.error),
        "exit_code": 0 if plan.error is None else ckpt_exit_code(plan.error)}
