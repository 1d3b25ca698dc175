"""The ``convert`` command: torch.save files, safetensors, sharded sets and DCP folders, in either direction.

A thin Click command over :func:`ckptool.ops.convert.convert`; torch is imported only by the conversions that
need it.
"""

from __future__ import annotations

import dataclasses
import os

import click

from ckptool.cli._common import (
    ZIP_NEEDS_SEEK,
    Progress,
    allow_missing_option,
    claim_output,
    device_options,
    emit_json,
    force_option,
    jobs_option,
    json_option,
    key_option,
    mapping_of,
    max_expand_option,
    refuse_stdout,
    set_output,
)
from ckptool.cli._hints import hint_for, hint_payload, report_hint
from ckptool.errors import UsageError
from ckptool.ops.convert import ConvertResult, OutputFormat, convert
from ckptool.ops.convert.report import convert_text
from ckptool.ops.convert.source import CAST_TO
from ckptool.writers import is_folder_form
from ckptool.writers.encoders import output_layout


def _claim_convert_output(dst: str, fmt: str | None, max_shard_size: str | None, force: bool) -> None:
    """Refuse an existing output without ``force``: the file ``dst``, or with ``max_shard_size`` any file of a
    shard set already in the place the set goes (a DCP folder must be new or empty: convert checks that)."""
    chosen = OutputFormat(fmt) if fmt is not None else None
    if chosen is not None and chosen.folder:
        set_output(dst)
    elif max_shard_size is None and not is_folder_form(dst):
        claim_output(dst, force=force)
    else:
        layout = output_layout(dst, (chosen or OutputFormat.SAFETENSORS).value)
        names = sorted(os.listdir(layout.folder)) if os.path.isdir(layout.folder) else []
        existing = [n for n in names if layout.is_member(n)]
        if existing and not force:
            raise UsageError(f"{layout.folder} already holds a shard set ({', '.join(existing[:3])}"
                             f"{' ...' if len(existing) > 3 else ''}); pass --force to replace it, or choose "
                             "another -o path")
        set_output(dst)


def report_convert(res: ConvertResult) -> None:
    """Print what a conversion did (:mod:`ckptool.ops.convert.report`): the selection, what was left out, aliases,
    layout changes, casts, notes, the files, the verification."""
    click.echo(convert_text(res))


@click.command("convert")
@click.argument("src", type=click.Path(dir_okay=True))
@click.option("-o", "--output", "dst", required=True, type=click.Path(),
              help="Output file (its suffix, in any case, names the format), or a folder (OUT/, an existing folder, "
                   "a name without suffix) holding model.safetensors / pytorch_model.bin and SRC's companion files "
                   "(docs/outputs.md); with --max-shard-size, NAME.safetensors (or .bin/.pt/.pth) gives "
                   "NAME-00001-of-0000N.* shards plus NAME.*.index.json beside it, a folder (ending in /) the "
                   "default shard names inside it; a folder with --format dcp.")
@click.option("--format", "fmt", type=click.Choice([f.value for f in OutputFormat]),
              help="Output format. Default: from DST's suffix (.safetensors; .pt/.pth/.bin/.ckpt), safetensors "
                   "with --max-shard-size.")
@key_option("Dotted path of the state_dict to convert (default: found automatically).")
@device_options
@click.option("--unwrap", "unwrap_keys", is_flag=True,
              help="Remove wrapper prefixes from the keys (module., _orig_mod., Lightning's model., ...; see "
                   "`ckptool unwrap`).")
@click.option("--strip-prefix", "strip_prefixes", metavar="PREFIX", multiple=True,
              help="Remove PREFIX from the front of the keys (repeatable, applied in order).")
@click.option("--max-shard-size", metavar="SIZE",
              help="Write shards of at most SIZE (5GB, 500MB, 2GiB) plus an index, named as Hugging Face does "
                   "(see -o); one shard that fits everything is written as the single file DST, without index.")
@click.option("--dtype", type=click.Choice(list(CAST_TO)),
              help="Cast floating tensors (integer, bool and complex tensors are untouched) and dequantize FP8 and "
                   "MXFP4 weights (docs/dtypes.md); the report counts values made +-inf or 0, NaNs, and the largest "
                   "errors, per tensor and in total.")
@click.option("--allow-overflow", is_flag=True,
              help="With --dtype: write the output even when the cast turns finite values into inf or NaN "
                   "(refused by default, naming the tensors).")
@click.option("--tag", metavar="TAG",
              help="DeepSpeed folder: the tag folder to consolidate (global_step1000; default: named by 'latest').")
@click.option("--exclude-frozen", is_flag=True, help="DeepSpeed folder: leave out frozen parameters.")
@click.option("--tp-dim", "tp_dims", metavar="PATTERN=DIM", multiple=True,
              help="Megatron legacy tree: join the tensor-parallel shards of the tensors whose name matches PATTERN "
                   "(fnmatch) along DIM (0, 1, ...; glu; none: replicated), ahead of the built-in rules "
                   "(docs/megatron.md). Repeatable.")
@allow_missing_option
@jobs_option("With --max-shard-size: write N shards at once (threads; the output is the same byte for byte, the "
             "index is written last, once every shard is written and verified, so an interrupted run leaves no "
             "set). Default 1.")
@click.option("--no-verify", is_flag=True, help="Skip re-opening the output to compare it with the source.")
@click.option("--trust", is_flag=True,
              help="Allow globals outside torch's weights-only allowlist where torch loads the data (DCP). Only for "
                   "files you trust.")
@force_option
@max_expand_option
@json_option("convert")
def convert_cmd(src: str, dst: str, fmt: str | None, key: str | None, to: str | None, maps: tuple[str, ...],
                unwrap_keys: bool, strip_prefixes: tuple[str, ...], max_shard_size: str | None, dtype: str | None,
                tag: str | None, exclude_frozen: bool, tp_dims: tuple[str, ...], allow_missing: bool, no_verify: bool,
                trust: bool, force: bool, max_expand: float | None, as_json: bool, allow_overflow: bool) -> None:
    """Convert checkpoint SRC to DST: torch.save <-> safetensors, sharded sets, torch.distributed.checkpoint.

    SRC is a torch.save file, a safetensors file, a sharded set (*.index.json, or the folder holding it), a
    DCP folder, a torch.export archive (.pt2: its state_dict, or --key constants), a torch.package archive
    (PackageExporter: its state_dict read without running the package's code; --key MEMBER or MEMBER:PATH, the
    keys inspect prints), a DeepSpeed ZeRO 1/2/3 checkpoint folder (consolidated to the fp32 master weights
    and buffers exactly as DeepSpeed's zero_to_fp32 does, without deepspeed and one tensor at a time), or a
    Megatron checkpoint (a legacy mp_rank_XX tree, its tensor-parallel shards joined by layer type and pipeline
    stages renumbered; or a torch_dist folder), without Megatron.

    From a torch file the state_dict is converted (found automatically, or --key); what else the file
    held (optimizer state, epoch...) is listed as not carried. Sparse, quantized and nested tensors are refused
    by name, with the way to convert them. Tied weights and views are stored once in
    safetensors, the others recorded as aliases in __metadata__, and restored as shared storage when ckptool
    converts the file back. Memory stays bounded by the largest tensor (DCP conversions excepted: torch's own
    functions hold the state). After writing, the output is re-opened
    and every tensor compared with the source (names, shapes, dtypes, CRC-32 checksums); the output is written
    atomically and SRC never changes.

    \b
    Examples:
      ckptool convert model.pth -o model.safetensors
      ckptool convert last.ckpt -o model.safetensors --key state_dict --unwrap
      ckptool convert model.safetensors -o model.pt --to cuda:0
      ckptool convert gpu_model.pth -o model.pt --to cpu       # opens with a plain torch.load
      ckptool convert model.pth -o out/ --max-shard-size 2GB --dtype bfloat16
      ckptool convert model.pth -o out/ --max-shard-size 2GB --jobs 4   # 4 shards at once
      ckptool convert checkpoints/step_1000/ -o model.pt           # a DCP folder
      ckptool convert model.pt -o dcp_ckpt/ --format dcp
      ckptool convert ds_checkpoints/ -o model.safetensors         # DeepSpeed ZeRO, tag from 'latest'
      ckptool convert exported.pt2 -o model.safetensors            # torch.export.save archive
      ckptool convert packaged.pt -o model.safetensors             # torch.package archive
      ckptool convert megatron_ckpt/ -o model.safetensors          # Megatron legacy tree or torch_dist
    """
    refuse_stdout(dst, f"{ZIP_NEEDS_SEEK}, and every output is re-opened to verify it before it is kept")
    _claim_convert_output(dst, fmt, max_shard_size, force)
    with Progress("convert") as bar:
        res = convert(src, dst, format=fmt, key=key, to=to, mapping=mapping_of(maps), allow_missing=allow_missing,
                      unwrap=unwrap_keys, strip_prefixes=strip_prefixes, max_shard_size=max_shard_size, dtype=dtype,
                      verify=not no_verify, trust=trust, progress=bar, tag=tag,
                      exclude_frozen=exclude_frozen, tp_dims=tp_dims, max_expand=max_expand,
                      allow_overflow=allow_overflow)
    written = res.load_path  # a sharded set: its index; one shard in a folder: that file
    if as_json:
        emit_json("convert", {**dataclasses.asdict(res), **hint_payload(hint_for(written, to=to, maps=maps))})
        return
    report_convert(res)
    report_hint(written, to=to, maps=maps)
