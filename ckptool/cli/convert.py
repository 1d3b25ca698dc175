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
    human_bytes,
    json_option,
    key_option,
    mapping_of,
    refuse_stdout,
    report_write,
    set_output,
)
from ckptool.cli._hints import hint_for, hint_payload, report_hint
from ckptool.errors import UsageError
from ckptool.formats.sharded import output_layout
from ckptool.ops.convert import ConvertResult, convert

_LIST = 8  # names listed before "and N more"


def _names(items: list[str]) -> str:
    more = f" and {len(items) - _LIST} more" if len(items) > _LIST else ""
    return ", ".join(items[:_LIST]) + more


def _claim_convert_output(dst: str, fmt: str | None, max_shard_size: str | None, force: bool) -> None:
    """Refuse an existing output without ``force``: the file ``dst``, or with ``max_shard_size`` any file of a
    shard set already in the place the set goes (a DCP folder must be new or empty: convert checks that)."""
    if fmt == "dcp":
        set_output(dst)
    elif max_shard_size is None:
        claim_output(dst, force=force)
    else:
        layout = output_layout(dst, fmt or "safetensors")
        names = sorted(os.listdir(layout.folder)) if os.path.isdir(layout.folder) else []
        existing = [n for n in names if layout.is_member(n)]
        if existing and not force:
            raise UsageError(f"{layout.folder} already holds a shard set ({', '.join(existing[:3])}"
                             f"{' ...' if len(existing) > 3 else ''}); pass --force to replace it, or choose "
                             "another -o path")
        set_output(dst)


def report_convert(res: ConvertResult) -> None:
    """Print what a conversion did: the selection, what was left out, aliases, layout changes, casts, the files."""
    echo = click.echo
    if res.key:
        what = f"state_dict {res.key!r}"
    elif res.key == "":
        what = "the top-level state_dict"
    elif res.format_in == "deepspeed":
        what = "the consolidated ZeRO state_dict (fp32 master weights, buffers)"
    elif res.format_in == "safetensors" or res.format_in.startswith("sharded"):
        what = "the tensors"
    else:
        what = "the whole checkpoint"
    echo(f"Converted {what} of {res.src} ({res.format_in}) to {res.format_out}.")
    if res.left_out:
        path = "MEMBER:PATH" if res.format_in == "torch-package" else "PATH"
        how = "" if res.format_in == "deepspeed" else f" (pass --key {path} to convert another state_dict)"
        echo(f"Not carried: {len(res.left_out)} other entr{'y' if len(res.left_out) == 1 else 'ies'} of the file"
             f"{how}:")
        for line in res.left_out[:20]:
            echo(f"  {line}")
        if len(res.left_out) > 20:
            echo(f"  ... and {len(res.left_out) - 20} more")
    if res.skipped:
        echo(f"Not stored: {len(res.skipped)} non-tensor entr{'y' if len(res.skipped) == 1 else 'ies'} of the "
             f"state_dict: {_names(res.skipped)}")
    if res.aliases:
        pairs = [f"{a} -> {k}" for a, k in res.aliases.items()]
        echo(f"Shared storage: {len(res.aliases)} tensor(s) stored once, as views of another (recorded in "
             f"__metadata__; ckptool restores them): {_names(pairs)}")
    if res.made_contiguous:
        echo(f"Stored contiguous (their layout was not): {_names(res.made_contiguous)}")
    if res.trimmed_bytes:
        echo(f"Storage bytes no tensor reaches were not carried: {human_bytes(res.trimmed_bytes)}")
    if res.cast:
        echo("Cast: " + ", ".join(f"{k} ({n})" for k, n in sorted(res.cast.items())))
    if res.renamed:
        echo(f"Renamed {res.renamed} key(s)")
    for note in res.notes:
        echo(f"Note: {note}")
    shards = f", {res.shards} shards + index" if res.shards > 1 else ""
    stored = f"{res.stored} of {res.tensors} tensors stored" if res.stored != res.tensors else f"{res.tensors} tensors"
    report_write(res.dst, res.bytes_written, f"{stored}{shards}")
    if res.verified:
        echo(f"Verified: {res.checked}")
    elif res.verified is None:
        echo("Not verified (--no-verify)")


@click.command("convert")
@click.argument("src", type=click.Path(dir_okay=True))
@click.option("-o", "--output", "dst", required=True, type=click.Path(),
              help="Output file; with --max-shard-size, NAME.safetensors (or .bin/.pt/.pth) gives "
                   "NAME-00001-of-0000N.* shards plus NAME.*.index.json beside it, a folder (ending in /) the "
                   "default shard names inside it; a folder with --format dcp.")
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors", "dcp"]),
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
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32", "float64"]),
              help="Cast floating tensors (integer, bool, complex and float8 tensors are untouched).")
@click.option("--tag", metavar="TAG",
              help="DeepSpeed folder: the tag folder to consolidate (global_step1000; default: named by 'latest').")
@click.option("--exclude-frozen", is_flag=True, help="DeepSpeed folder: leave out frozen parameters.")
@allow_missing_option
@click.option("--no-verify", is_flag=True, help="Skip re-opening the output to compare it with the source.")
@click.option("--trust", is_flag=True,
              help="Allow globals outside torch's weights-only allowlist where torch loads the data (DCP). Only for "
                   "files you trust.")
@force_option
@json_option("convert")
def convert_cmd(src: str, dst: str, fmt: str | None, key: str | None, to: str | None, maps: tuple[str, ...],
                unwrap_keys: bool, strip_prefixes: tuple[str, ...], max_shard_size: str | None, dtype: str | None,
                tag: str | None, exclude_frozen: bool, allow_missing: bool, no_verify: bool, trust: bool, force: bool,
                as_json: bool) -> None:
    """Convert checkpoint SRC to DST: torch.save <-> safetensors, sharded sets, torch.distributed.checkpoint.

    SRC is a torch.save file, a safetensors file, a sharded set (*.index.json, or the folder holding it), a
    DCP folder, a torch.export archive (.pt2: its state_dict, or --key constants), a torch.package archive
    (PackageExporter: its state_dict read without running the package's code; --key MEMBER or MEMBER:PATH, the
    keys inspect prints), or a DeepSpeed ZeRO 1/2/3 checkpoint folder (consolidated to the fp32 master weights
    and buffers exactly as DeepSpeed's zero_to_fp32 does, without deepspeed and one tensor at a time).

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
      ckptool convert checkpoints/step_1000/ -o model.pt           # a DCP folder
      ckptool convert model.pt -o dcp_ckpt/ --format dcp
      ckptool convert ds_checkpoints/ -o model.safetensors         # DeepSpeed ZeRO, tag from 'latest'
      ckptool convert exported.pt2 -o model.safetensors            # torch.export.save archive
      ckptool convert packaged.pt -o model.safetensors             # torch.package archive
    """
    refuse_stdout(dst, f"{ZIP_NEEDS_SEEK}, and every output is re-opened to verify it before it is kept")
    _claim_convert_output(dst, fmt, max_shard_size, force)
    with Progress("convert") as bar:
        res = convert(src, dst, format=fmt, key=key, to=to, mapping=mapping_of(maps), allow_missing=allow_missing,
                      unwrap=unwrap_keys, strip_prefixes=strip_prefixes, max_shard_size=max_shard_size, dtype=dtype,
                      verify=not no_verify, trust=trust, progress=bar, tag=tag,
                      exclude_frozen=exclude_frozen)
    written = res.load_path  # a sharded set: its index; one shard in a folder: that file
    if as_json:
        emit_json("convert", {**dataclasses.asdict(res), **hint_payload(hint_for(written, to=to, maps=maps))})
        return
    report_convert(res)
    report_hint(written, to=to, maps=maps)
