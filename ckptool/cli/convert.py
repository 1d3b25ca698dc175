"""The ``convert`` command: torch.save files, safetensors, sharded sets and DCP folders, in either direction.

A thin Click command over :func:`ckptool.ops.convert.convert`; torch is imported only by the conversions that
need it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from ckptool.cli._common import (
    allow_missing_option,
    device_options,
    human_bytes,
    key_option,
    mapping_of,
    report_hint,
    report_write,
)
from ckptool.ops.convert import ConvertResult, convert

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar

_LIST = 8  # names listed before "and N more"
_PROGRESS_MIN = 256 << 20  # show a progress bar from this many bytes (when stderr is a terminal)


def _names(items: list[str]) -> str:
    more = f" and {len(items) - _LIST} more" if len(items) > _LIST else ""
    return ", ".join(items[:_LIST]) + more


class _Progress:
    """A Click progress bar on stderr, shown only when stderr is a terminal and the data is large."""

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum
        self.bar: ProgressBar[int] | None = None
        self.done = 0
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.minimum:
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label="converting", file=sys.stderr, show_eta=True,
                                         show_percent=True)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def report_convert(res: ConvertResult) -> None:
    """Print what a conversion did: the selection, what was left out, aliases, layout changes, casts, the files."""
    echo = click.echo
    if res.key:
        what = f"state_dict {res.key!r}"
    elif res.key == "":
        what = "the top-level state_dict"
    elif res.format_in == "safetensors" or res.format_in.startswith("sharded"):
        what = "the tensors"
    else:
        what = "the whole checkpoint"
    echo(f"Converted {what} of {res.src} ({res.format_in}) to {res.format_out}.")
    if res.left_out:
        echo(f"Not carried: {len(res.left_out)} other entr{'y' if len(res.left_out) == 1 else 'ies'} of the file "
             "(pass --key PATH to convert another state_dict):")
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
        echo(f"Verified: the output re-opens with {res.checked} equal to the source")
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
@allow_missing_option
@click.option("--no-verify", is_flag=True, help="Skip re-opening the output to compare it with the source.")
@click.option("--trust", is_flag=True,
              help="Allow globals outside torch's weights-only allowlist where torch loads the data (DCP). Only for "
                   "files you trust.")
def convert_cmd(src: str, dst: str, fmt: str | None, key: str | None, to: str | None, maps: tuple[str, ...],
                unwrap_keys: bool, strip_prefixes: tuple[str, ...], max_shard_size: str | None, dtype: str | None,
                allow_missing: bool, no_verify: bool, trust: bool) -> None:
    """Convert checkpoint SRC to DST: torch.save <-> safetensors, sharded sets, torch.distributed.checkpoint.

    SRC is a torch.save file, a safetensors file, a sharded set (*.index.json, or the folder holding it) or a
    DCP folder. From a torch file the state_dict is converted (found automatically, or --key); what else the file
    held (optimizer state, epoch...) is listed as not carried. Tied weights and views are stored once in
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
    """
    bar = _Progress(_PROGRESS_MIN)
    try:
        res = convert(src, dst, format=fmt, key=key, to=to, mapping=mapping_of(maps), allow_missing=allow_missing,
                      unwrap=unwrap_keys, strip_prefixes=strip_prefixes, max_shard_size=max_shard_size, dtype=dtype,
                      verify=not no_verify, trust=trust, progress=bar)
    finally:
        bar.close()
    report_convert(res)
    written = res.files[-1] if res.shards > 1 and res.files else res.dst  # a sharded set: its index
    report_hint(written, to=to, maps=maps)
