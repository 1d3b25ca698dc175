"""``ckptool diff``: what changed between two checkpoints (a thin command over :func:`ckptool.ops.diff.compare.diff`;
nothing is run from the files, torch is not imported). Exit status as GNU ``diff``: 0 identical, 1 different,
2 usage errors; a file that cannot be read exits with its error's status."""

from __future__ import annotations

import json

import click

from ckptool.cli._common import max_expand_option
from ckptool.ops.diff.compare import diff
from ckptool.ops.diff.result import diff_text


@click.command("diff")
@click.argument("a", type=click.Path(dir_okay=True))
@click.argument("b", type=click.Path(dir_okay=True))
@click.option("--rtol", type=float, default=None,
              help="Relative tolerance: compare values numerically, as torch.testing.assert_close does "
                   "(|b - a| <= atol + rtol * |a|; needs numpy). Default: bit-exact.")
@click.option("--atol", type=float, default=None, help="Absolute tolerance (see --rtol); the one not given is 0.")
@click.option("--keys-only", is_flag=True, help="Compare keys, shapes, dtypes, devices and sharing; skip values.")
@click.option("--strict", is_flag=True,
              help="Count as differences the properties one format cannot store (a device or a non-contiguous "
                   "stride against safetensors or DCP); default: listed as 'not stored in B', exit status "
                   "unchanged.")
@click.option("-v", "--verbose", is_flag=True,
              help="One row per tensor; default: a change repeated over several tensors is one summary line "
                   "('72 tensors: device cuda:0 -> cpu').")
@click.option("--key", default=None, metavar="PATH",
              help="Compare the state_dict at this dotted path (e.g. model_state_dict) of each torch file where it "
                   "resolves; default: a training checkpoint against a bare state_dict is compared through the "
                   "state_dict convert would pick.")
@max_expand_option
@click.option("--json", "as_json", is_flag=True, help='Print the result as JSON ("schema": "ckptool.diff/2").')
@click.pass_context
def diff_cmd(ctx: click.Context, a: str, b: str, rtol: float | None, atol: float | None, keys_only: bool,
             strict: bool, key: str | None, verbose: bool, max_expand: float | None, as_json: bool) -> None:
    """Show what changed between checkpoints A and B, of any formats ckptool reads.

    Works across torch.save files (zip and legacy), safetensors, sharded sets (an *.index.json or its folder),
    torch.distributed.checkpoint folders (names, dtypes and shapes), .pt2 archives and DeepSpeed ZeRO folders
    (their consolidated fp32 state_dict, as convert reads it), and between them. A training checkpoint against
    a bare state_dict (safetensors, sharded...) is compared through the state_dict convert picks in it (--key
    PATH chooses it; the report names it). Keys are matched after
    removing wrapper prefixes such as DataParallel's `module.` (reported once); keys on one side only, shape,
    dtype, saved-device and stride changes, tied / shared storage differences and plain values (epoch,
    hyper-parameters) are reported. A property one format cannot store (safetensors keeps no device and stores
    every tensor contiguous) is listed as "not stored in B", not counted as a difference unless --strict. A
    change repeated over several tensors is one line (--verbose: a row per tensor). Values are compared tensor
    by tensor, streamed from the files (memory bounded by the largest tensor): bit-exact by default, or with
    --rtol/--atol by value, with the greatest absolute and relative difference per tensor. Nothing from the
    files is run, and torch is not needed.

    Exit status: 0 when A and B are identical, 1 when they differ, 2 on usage errors; with --quiet nothing is
    printed and the exit status alone says it.

    \b
    Examples:
      ckptool diff model.pth model.safetensors
      ckptool diff base.pth finetuned.pth --atol 1e-6 --rtol 1e-5
      ckptool diff a.pth b.pth --keys-only --json
      ckptool diff train.ckpt model.safetensors --key model_state_dict
      ckptool diff ds_checkpoint/ model.safetensors    # a DeepSpeed ZeRO folder
      ckptool diff gpu_model.pth model.safetensors --strict   # a device the file cannot keep counts too
    """
    res = diff(a, b, rtol=rtol, atol=atol, keys_only=keys_only, strict=strict, key=key,
               max_expand=max_expand)
    if as_json:
        click.echo(json.dumps(res.to_dict(), indent=2))
    else:
        click.echo(diff_text(res, verbose))
    ctx.exit(0 if res.identical else 1)
