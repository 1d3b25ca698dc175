"""The ``ckptool`` command line: thin Click commands over the library functions.

Each command parses options, calls one library function and prints its result. Library errors
(:class:`ckptool.errors.CkptError`) become one ``Error: ...`` line on stderr and a non-zero exit; anything else
is reported as an internal error. ``--debug`` (or ``CKPTOOL_DEBUG=1``) shows the full traceback instead.
Modules holding further commands register themselves on :data:`cli` at the bottom of this file.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from ckptool.errors import CkptError

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _debug_enabled(ctx: click.Context | None) -> bool:
    if os.environ.get("CKPTOOL_DEBUG"):
        return True
    while ctx is not None:
        if ctx.obj and ctx.obj.get("debug"):
            return True
        ctx = ctx.parent
    return False


class CkptGroup(click.Group):
    """A Click group that turns library errors into ``Error: ...`` lines (tracebacks only with --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except CkptError as e:
            if _debug_enabled(ctx):
                raise
            err = click.ClickException(str(e))
            err.exit_code = e.exit_code
            raise err from e
        except KeyboardInterrupt:
            raise click.exceptions.Abort() from None
        except BrokenPipeError:  # `ckptool inspect ... | head`
            sys.stderr.close()
            raise click.exceptions.Exit(0) from None
        except Exception as e:  # a bug in ckptool: say so, keep the traceback for --debug
            if _debug_enabled(ctx):
                raise
            raise click.ClickException(
                f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback and report it)"
            ) from e


@click.group(cls=CkptGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="ckptool")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors (also CKPTOOL_DEBUG=1).")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Make PyTorch checkpoints portable between machines, devices and model wrappers.

    Inspect what a checkpoint holds without running its code, re-tag its storages for another device
    without a GPU, and fix wrapper prefixes such as DataParallel's `module.`.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def output_options(f: Any) -> Any:
    """The -o/--output and --in-place options shared by every command that writes a checkpoint."""
    f = click.option("--in-place", is_flag=True, help="Replace SRC itself (atomically) instead of writing a new file.")(f)
    f = click.option("-o", "--output", "dst", type=click.Path(dir_okay=False),
                     help="Output file. Default: next to SRC with the operation in the name.")(f)
    return f


# ---------------------------------------------------------------------------------------------------- inspect
def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


@cli.command("inspect")
@click.argument("path", type=click.Path(dir_okay=True))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (every tensor) instead of tables.")
@click.option("--all", "show_all", is_flag=True, help="List every tensor (by default long tables are summarised).")
@click.option("--limit", default=30, show_default=True, type=click.IntRange(min=1),
              help="Tensor rows to show before summarising.")
def inspect_cmd(path: str, as_json: bool, show_all: bool, limit: int) -> None:
    """Show what checkpoint PATH holds, without running its code or reading tensor data.

    Prints the format (torch-zip, torch-legacy, torchscript, safetensors, pickle), the kind (state_dict,
    training_checkpoint, full_model, torchscript, tensors), a table of tensors (key, shape, dtype, saved device,
    size), totals per device and dtype, the state_dicts found with their wrapper prefixes and the command that
    removes them, and the globals the pickle would import, marked by whether torch.load(weights_only=True)
    allows them. Torch is not imported.
    """
    from ckptool.ops.inspect import inspect

    info = inspect(path)
    if as_json:
        d = info.to_dict()
        click.echo(json.dumps(d, indent=None if len(info.tensors) > 200 else 2))
        return
    _print_info(info, limit=None if show_all else limit)


def _print_info(info: Any, limit: int | None) -> None:
    from tabulate import tabulate

    echo = click.echo
    shared = len(info.tensors) - info.storages if info.format != "safetensors" else 0
    echo(f"File:     {info.path} ({human_bytes(info.size)})")
    echo(f"Format:   {info.format}")
    echo(f"Kind:     {info.kind}")
    echo(f"Tensors:  {len(info.tensors)} in {info.storages} storages, {human_bytes(info.total_bytes)}"
         + (f" ({shared} tensors share a storage with another)" if shared > 0 else ""))
    if info.metadata:
        echo(f"Metadata: {json.dumps(info.metadata)[:200]}")
    if info.tensors:
        rows = [(t.key, "x".join(map(str, t.shape)) or "scalar", t.dtype, t.device, human_bytes(t.nbytes))
                for t in (info.tensors if limit is None else info.tensors[:limit])]
        echo("")
        echo(tabulate(rows, headers=["key", "shape", "dtype", "device", "size"]))
        if limit is not None and len(info.tensors) > limit:
            echo(f"... {len(info.tensors) - limit} more tensors (use --all to list every tensor, --json for machines)")
        totals: dict[tuple[str, str], list[int]] = {}
        for t in info.tensors:
            acc = totals.setdefault((t.device, t.dtype), [0, 0])
            acc[0] += 1
            acc[1] += t.nbytes
        echo("")
        echo(tabulate([(d, dt, n, human_bytes(b)) for (d, dt), (n, b) in sorted(totals.items())],
                      headers=["device", "dtype", "tensors", "tensor bytes"]))
    if info.state_dicts:
        echo("")
        echo("State dicts:")
        rows = []
        for sd in info.state_dicts:
            fix = sd.fix or ""
            if sd.flat_params:
                fix = "FSDP flat parameters: consolidate first (torch.distributed.checkpoint / Lightning)"
            rows.append((sd.path or "(top level)", sd.tensors, " ".join(sd.prefixes) or "-", fix or "-"))
        echo(tabulate(rows, headers=["path", "tensors", "wrapper prefix", "remove with"]))
    if info.globals:
        echo("")
        echo("Globals the pickle would import:")
        echo(tabulate([(g.name, "allowed" if g.allowed else "NOT allowed",
                        g.status if g.status != "dangerous" else f"DANGEROUS: {g.reason}") for g in info.globals],
                      headers=["global", "torch.load(weights_only=True)", "ckptool scan"]))
    echo("")
    for line in _advice(info):
        echo(line)


def _advice(info: Any) -> list[str]:
    out = []
    gpu = sorted(d for d in info.devices if d not in ("cpu", "meta"))
    if info.format == "torchscript":
        out.append("TorchScript archive: load it with torch.jit.load(path, map_location='cpu').")
    elif gpu:
        alt = f" (or --map {gpu[-1]}=cuda:0 for one GPU)" if gpu[-1] not in ("cuda:0", "cuda") else ""
        out.append(f"Saved on {', '.join(gpu)}: a plain torch.load needs that device. "
                   f"Run `ckptool remap {info.path} --to cpu`{alt} to load it anywhere.")
    unsafe = info.unsafe_globals
    if unsafe and info.format != "torchscript":
        out.append(f"{len(unsafe)} global(s) are outside the weights_only allowlist: torch.load(weights_only=True) "
                   "refuses this file; load with weights_only=False only if you trust its source.")
    return out


# ---------------------------------------------------------------------------------------------------- remap
@cli.command("remap")
@click.argument("src", type=click.Path(dir_okay=True))
@click.option("--to", "to", metavar="DEVICE", help="Tag every storage for DEVICE (cpu, cuda, cuda:N, mps, meta).")
@click.option("--map", "maps", metavar="FROM=TO", multiple=True,
              help="Re-tag only storages tagged FROM (repeatable); a bare type such as cuda matches every index.")
@click.option("--unwrap", "unwrap_keys", is_flag=True,
              help="Also remove wrapper components from the keys (module., _orig_mod., ...; see `ckptool unwrap`).")
@click.option("--strip-dataparallel", is_flag=True, help="Also remove the leading module. from the keys.")
@click.option("--strip-prefix", "strip_prefixes", metavar="PREFIX", multiple=True,
              help="Also remove PREFIX from the front of the keys (repeatable, applied in order).")
@click.option("--add-prefix", metavar="PREFIX", help="Also put PREFIX in front of every key (after any removal).")
@click.option("--key", metavar="PATH", help="Dotted path of the state_dict to rename (default: every one found).")
@output_options
def remap_cmd(src: str, to: str | None, maps: tuple[str, ...], unwrap_keys: bool, strip_dataparallel: bool,
              strip_prefixes: tuple[str, ...], add_prefix: str | None, key: str | None, dst: str | None,
              in_place: bool) -> None:
    """Re-tag the storages of checkpoint SRC so that a plain torch.load opens it on another device.

    Tensor bytes are copied, not decoded: no GPU is needed for any source or target tag, and memory stays
    bounded however large the file. Zip and legacy inputs; the output is torch's zip format. Without -o the
    result is written next to SRC with the target in the name (model.cpu.pth). --unwrap, --strip-dataparallel,
    --strip-prefix and --add-prefix rename the state_dict keys in the same pass (one write).

    \b
    Examples:
      ckptool remap model.pth --to cpu
      ckptool remap model.pth --map cuda:1=cuda:0 -o model.gpu0.pth
      ckptool remap ddp_compiled.pth --to cpu --unwrap
    """
    from ckptool.ops.remap import parse_mapping, remap

    mapping = parse_mapping(list(maps)) if maps else None
    res = remap(src, dst, to=to, mapping=mapping, in_place=in_place, unwrap=unwrap_keys,
                strip_dataparallel=strip_dataparallel, strip_prefixes=strip_prefixes, add_prefix=add_prefix, key=key)
    if hasattr(res, "changes"):
        from ckptool.cli.prefixes import report_rename

        report_rename(res)
    _report_write(res)
    click.echo("Load it with: torch.load(" + repr(res.dst) + ")")


def _report_write(res: Any) -> None:
    changes = ", ".join(f"{a} -> {b} ({n})" for (a, b), n in sorted(res.retagged.items())) or "none (tags already match)"
    click.echo(f"Wrote {res.dst} ({human_bytes(res.bytes_written)}, {res.storages} storages; re-tagged: {changes})")


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="ckptool")


# further commands live in their own modules and register on `cli` when imported
for _mod in ("ckptool.cli.prefixes", "ckptool.cli.verify", "ckptool.cli.demo", "ckptool.cli.convert",
             "ckptool.cli.scan"):
    try:
        __import__(_mod)
    except ModuleNotFoundError as _e:
        if _e.name != _mod:
            raise
