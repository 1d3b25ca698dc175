"""``ckptool inspect``: what a checkpoint holds, without running its code or importing torch."""

from __future__ import annotations

import json

import click

from ckptool.cli._common import human_bytes
from ckptool.ops.inspect import CheckpointInfo, inspect


@click.command("inspect")
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
    info = inspect(path)
    if as_json:
        d = info.to_dict()
        click.echo(json.dumps(d, indent=None if len(info.tensors) > 200 else 2))
        return
    _print_info(info, limit=None if show_all else limit)


def _print_info(info: CheckpointInfo, limit: int | None) -> None:
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
        sd_rows: list[tuple[str, int, str, str]] = []
        for sd in info.state_dicts:
            fix = sd.fix or ""
            if sd.flat_params:
                fix = "FSDP flat parameters: consolidate first (torch.distributed.checkpoint / Lightning)"
            sd_rows.append((sd.path or "(top level)", sd.tensors, " ".join(sd.prefixes) or "-", fix or "-"))
        echo(tabulate(sd_rows, headers=["path", "tensors", "wrapper prefix", "remove with"]))
    if info.globals:
        echo("")
        echo("Globals the pickle would import:")
        echo(tabulate([(g.name, "allowed" if g.allowed else "NOT allowed",
                        g.status if g.status != "dangerous" else f"DANGEROUS: {g.reason}") for g in info.globals],
                      headers=["global", "torch.load(weights_only=True)", "ckptool scan"]))
    echo("")
    for line in _advice(info):
        echo(line)


def _advice(info: CheckpointInfo) -> list[str]:
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
