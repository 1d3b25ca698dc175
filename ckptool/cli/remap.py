"""``ckptool remap``: re-tag the storages of a checkpoint for another device, optionally renaming keys in the same
pass (a thin command over :func:`ckptool.ops.remap.remap`)."""

from __future__ import annotations

import click

from ckptool.cli._common import key_option, output_options, report_rename, report_write
from ckptool.model.devices import parse_mapping
from ckptool.ops.remap import remap
from ckptool.ops.rename import RenameResult


@click.command("remap")
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
@key_option("Dotted path of the state_dict to rename (default: every one found).")
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
    mapping = parse_mapping(list(maps)) if maps else None
    res = remap(src, dst, to=to, mapping=mapping, in_place=in_place, unwrap=unwrap_keys,
                strip_dataparallel=strip_dataparallel, strip_prefixes=strip_prefixes, add_prefix=add_prefix, key=key)
    if isinstance(res, RenameResult):
        report_rename(res)
    changes = (", ".join(f"{a} -> {b} ({n})" for (a, b), n in sorted(res.retagged.items()))
               or "none (tags already match)")
    report_write(res.dst, res.bytes_written, f"{res.storages} storages; re-tagged: {changes}")
    click.echo("Load it with: torch.load(" + repr(res.dst) + ")")
